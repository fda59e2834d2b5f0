from .plan import (BACKWARD_RESULTS, NO_FP8_BACKWARD, MergeConfig, check_prefill_tokens_with_context, plan_merge_attn_states,
                   plan_merge_attn_states_backward)
from .mask_plan import plan_mask_empty_context_lse
from .reference import (mask_empty_context_lse_reference, merge_attn_states_backward_reference,
                        merge_attn_states_reference)

__all__ = ["BACKWARD_RESULTS", "MergeConfig", "check_prefill_tokens_with_context", "plan_merge_attn_states", "merge_attn_states_reference",
           "NO_FP8_BACKWARD", "plan_merge_attn_states_backward", "merge_attn_states_backward_reference",
           "plan_mask_empty_context_lse", "mask_empty_context_lse_reference"]

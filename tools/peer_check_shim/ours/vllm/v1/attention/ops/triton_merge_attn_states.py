"""--impl ours: vllm.v1.attention.ops.triton_merge_attn_states -> adapters.torch (our code)."""
from adapters.torch import mask_empty_context_lse, merge_attn_states

__all__ = ["mask_empty_context_lse", "merge_attn_states"]

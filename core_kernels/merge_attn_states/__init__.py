from .plan import MergeConfig, plan_merge_attn_states
from .reference import merge_attn_states_reference

__all__ = ["MergeConfig", "plan_merge_attn_states", "merge_attn_states_reference"]

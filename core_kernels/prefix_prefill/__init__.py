from .plan import PrefixPrefillConfig, plan_prefix_prefill
from .reference import context_attention_reference

__all__ = ["PrefixPrefillConfig", "plan_prefix_prefill", "context_attention_reference"]

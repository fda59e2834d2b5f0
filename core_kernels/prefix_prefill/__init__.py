from .plan import PrefixPrefillConfig, plan_prefix_prefill
from .reference import context_attention_reference

__all__ = ["PrefixPrefillConfig", "plan_prefix_prefill", "context_attention_reference"]
from .checks import check_prefix_prefill

__all__ += ["check_prefix_prefill"]

from .checks import check_unified_attention
from .op import UNIFIED_ATTENTION
from .plan import plan_unified_attention
from .problem import KV_QUANT_MODES, kv_quant_mode_value
from .reference import unified_attention_reference

__all__ = ["UNIFIED_ATTENTION", "KV_QUANT_MODES", "check_unified_attention", "kv_quant_mode_value",
           "plan_unified_attention", "unified_attention_reference"]

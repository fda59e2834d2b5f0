from .plan import plan_prefix_prefill, tile_config
from .reference import context_attention_reference

__all__ = ["plan_prefix_prefill", "tile_config", "context_attention_reference"]

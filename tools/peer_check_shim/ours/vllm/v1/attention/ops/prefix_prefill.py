"""--impl ours: vllm.v1.attention.ops.prefix_prefill -> adapters.torch (our code)."""
from adapters.torch import context_attention_fwd

__all__ = ["context_attention_fwd"]

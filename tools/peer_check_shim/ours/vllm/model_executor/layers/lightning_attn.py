"""--impl ours: vllm.model_executor.layers.lightning_attn -> adapters.torch (our code)."""
from adapters.torch import lightning_attention, linear_decode_forward_triton

__all__ = ["lightning_attention", "linear_decode_forward_triton"]

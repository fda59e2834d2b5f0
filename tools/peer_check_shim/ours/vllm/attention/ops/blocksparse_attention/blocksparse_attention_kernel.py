"""--impl ours: vllm.attention.ops.blocksparse_attention.blocksparse_attention_kernel
-> adapters.torch (our code)."""
from adapters.torch import blocksparse_flash_attn_varlen_fwd

__all__ = ["blocksparse_flash_attn_varlen_fwd"]

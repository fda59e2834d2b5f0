"""--impl ours: vllm.attention.ops.blocksparse_attention.interface -> adapters.torch (our code)."""
from adapters.torch import LocalStridedBlockSparseAttn

__all__ = ["LocalStridedBlockSparseAttn"]

"""--impl ours: vllm.attention.ops.blocksparse_attention.utils -> adapters.torch (our code).

vLLM's module also has dense_to_crow_col / crow_col_to_dense / dense_to_ccol_row /
ccol_row_to_dense / binary_mask_to_bias helpers; adapters.torch has no counterparts
(none of the fetched tests import them)."""
from adapters.torch import get_head_sliding_step, get_sparse_attn_mask
from peer_check_missing import missing

_MOD = "vllm.attention.ops.blocksparse_attention.utils"
dense_to_crow_col = missing(_MOD, "dense_to_crow_col")
crow_col_to_dense = missing(_MOD, "crow_col_to_dense")

__all__ = ["get_head_sliding_step", "get_sparse_attn_mask"]

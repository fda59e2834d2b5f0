from .layout import dense_to_crow_col, get_sparse_attn_mask
from .plan import (BlocksparseDecodeConfig, BlocksparseGroupDecodeConfig, BlocksparsePrefillConfig,
                   choose_config, plan_blocksparse_attention)
from .reference import (blocksparse_attention_reference, crow_col_to_dense,
                        formula_block_mask)

__all__ = ["get_sparse_attn_mask", "dense_to_crow_col", "plan_blocksparse_attention", "choose_config",
           "BlocksparsePrefillConfig", "BlocksparseDecodeConfig", "BlocksparseGroupDecodeConfig",
           "blocksparse_attention_reference", "crow_col_to_dense", "formula_block_mask"]

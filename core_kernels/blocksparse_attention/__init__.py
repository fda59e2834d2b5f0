from .layout import dense_to_crow_col, get_sparse_attn_mask
from .plan import plan_blocksparse_attention
from .reference import (blocksparse_attention_reference, crow_col_to_dense,
                        formula_block_mask)

__all__ = ["get_sparse_attn_mask", "dense_to_crow_col", "plan_blocksparse_attention",
           "blocksparse_attention_reference", "crow_col_to_dense", "formula_block_mask"]

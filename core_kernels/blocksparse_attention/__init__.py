from .layout import (active_heads, build_sparse_layout, local_strided_pattern, dense_to_crow_col, get_head_sliding_step,
                     vllm_sparse_attn_mask)
from .plan import (BlocksparseDecodeConfig, BlocksparseGroupDecodeConfig, BlocksparsePrefillConfig,
                   choose_config, plan_blocksparse_attention)
from .reference import (blocksparse_attention_backward_reference, blocksparse_attention_reference,
                        crow_col_to_dense, formula_block_mask)
from .backward_plan import (NO_DECODE_CONFIG, BlocksparseBackwardConfig,
                            plan_blocksparse_attention_backward, plan_blocksparse_attention_lse)

__all__ = ["active_heads", "build_sparse_layout", "local_strided_pattern", "vllm_sparse_attn_mask", "get_head_sliding_step", "dense_to_crow_col",
           "plan_blocksparse_attention", "choose_config",
           "BlocksparsePrefillConfig", "BlocksparseDecodeConfig", "BlocksparseGroupDecodeConfig",
           "blocksparse_attention_reference", "crow_col_to_dense", "formula_block_mask",
           "blocksparse_attention_backward_reference", "plan_blocksparse_attention_lse",
           "plan_blocksparse_attention_backward", "BlocksparseBackwardConfig", "NO_DECODE_CONFIG"]
from .checks import check_blocksparse_attention

__all__ += ["check_blocksparse_attention"]

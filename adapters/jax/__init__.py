"""JAX adapter: functional ops over the shared kernels, usable under jax.jit and
jax.vmap (each vmap folds into one launch: _vmap.py). Each public function is
defined, with its custom_vmap rule and custom_vjp, in its ``_ops_<op>.py``;
this module only re-exports them."""
from ._ops_merge import mask_empty_context_lse, merge_attn_states, merge_attn_states_backward
from ._ops_prefix_prefill import context_attention_fwd

__all__ = ["context_attention_fwd", "mask_empty_context_lse", "merge_attn_states",
           "merge_attn_states_backward"]
from ._ops_blocksparse import (blocksparse_flash_attn_varlen_backward, blocksparse_flash_attn_varlen_fwd,
                               blocksparse_flash_attn_varlen_fwd_lse)
from ._ops_blocksparse_module import LocalStridedBlockSparseAttn, get_head_sliding_step, get_sparse_attn_mask

__all__ += ["LocalStridedBlockSparseAttn", "blocksparse_flash_attn_varlen_fwd", "get_head_sliding_step",
            "get_sparse_attn_mask", "blocksparse_flash_attn_varlen_fwd_lse",
            "blocksparse_flash_attn_varlen_backward"]
from ._ops_lightning import lightning_attention, lightning_attention_backward, linear_decode_forward_triton

__all__ += ["lightning_attention", "lightning_attention_backward", "linear_decode_forward_triton"]
from ._ops_lightning_varlen import lightning_attention_varlen, lightning_attention_varlen_backward

__all__ += ["lightning_attention_varlen", "lightning_attention_varlen_backward"]
from ._ops_reshape_and_cache_flash import reshape_and_cache_flash

__all__ += ["reshape_and_cache_flash"]

from ._ops_unified_attention import unified_attention

__all__ += ["unified_attention"]
from ._ops_lightning_cp import lightning_attention_cp

__all__ += ["lightning_attention_cp"]
from ._ops_example_scale import example_scale  # noqa: E402,F401  (the example op: ADDING_AN_OP.md)

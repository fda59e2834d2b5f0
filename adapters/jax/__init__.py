"""JAX adapter: functional ops over the shared kernels, usable under jax.jit and
jax.vmap (each vmap folds into one launch: _vmap.py)."""
from ._ops_merge import mask_empty_context_lse, merge_attn_states, merge_attn_states_backward
from ._ops_prefix_prefill import context_attention_fwd

__all__ = ["context_attention_fwd", "mask_empty_context_lse", "merge_attn_states",
           "merge_attn_states_backward"]
from ._ops_blocksparse import (LocalStridedBlockSparseAttn, blocksparse_flash_attn_varlen_backward,
                               blocksparse_flash_attn_varlen_fwd, blocksparse_flash_attn_varlen_fwd_lse,
                               get_head_sliding_step, get_sparse_attn_mask)

__all__ += ["LocalStridedBlockSparseAttn", "blocksparse_flash_attn_varlen_fwd", "get_head_sliding_step",
            "get_sparse_attn_mask", "blocksparse_flash_attn_varlen_fwd_lse",
            "blocksparse_flash_attn_varlen_backward"]
from ._ops_lightning import lightning_attention, linear_decode_forward_triton

__all__ += ["lightning_attention", "lightning_attention_backward", "linear_decode_forward_triton"]
from ._ops_lightning_varlen import lightning_attention_varlen, lightning_attention_varlen_backward

__all__ += ["lightning_attention_varlen", "lightning_attention_varlen_backward"]

from ._vmap import with_vmap as _with_vmap  # noqa: E402

from ._ops_merge import with_vjp as _with_vjp  # noqa: E402
from ._ops_lightning import lightning_attention_backward, with_vjp as _with_lightning_vjp  # noqa: E402

merge_attn_states_backward = _with_vmap(merge_attn_states_backward)
merge_attn_states = _with_vjp(_with_vmap(merge_attn_states), merge_attn_states_backward)
mask_empty_context_lse = _with_vmap(mask_empty_context_lse)
lightning_attention_backward = _with_vmap(lightning_attention_backward)
lightning_attention = _with_lightning_vjp(_with_vmap(lightning_attention), lightning_attention_backward)
linear_decode_forward_triton = _with_vmap(linear_decode_forward_triton)
from ._ops_lightning_varlen import with_vjp as _with_varlen_vjp  # noqa: E402

lightning_attention_varlen_backward = _with_vmap(lightning_attention_varlen_backward)
lightning_attention_varlen = _with_varlen_vjp(_with_vmap(lightning_attention_varlen),
                                              lightning_attention_varlen_backward)
from ._ops_blocksparse import with_vjp as _with_bs_vjp  # noqa: E402

blocksparse_flash_attn_varlen_fwd_lse = _with_vmap(blocksparse_flash_attn_varlen_fwd_lse)
blocksparse_flash_attn_varlen_backward = _with_vmap(blocksparse_flash_attn_varlen_backward)
blocksparse_flash_attn_varlen_fwd = _with_bs_vjp(_with_vmap(blocksparse_flash_attn_varlen_fwd),
                                                 blocksparse_flash_attn_varlen_fwd_lse,
                                                 blocksparse_flash_attn_varlen_backward)
context_attention_fwd = _with_vmap(context_attention_fwd)

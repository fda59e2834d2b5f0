"""Block-sparse varlen attention for JAX: functional, works under jax.jit."""
from __future__ import annotations

import jax.numpy as jnp

from core_kernels.blocksparse_attention import get_sparse_attn_mask, plan_blocksparse_attention

from ._executor import info, run_plan, target


def blocksparse_flash_attn_varlen_fwd(q, k, v, cu_seqlens_k, cu_seqlens_q, sm_scale, sparse_layout,
                                      *, block_size=64, q_block_size=None, max_seqlen=None, config=None):
    """Causal block-sparse attention over packed (varlen) sequences.

    Same arguments and result as the torch adapter's function (q [Tq, Hq, D],
    k/v [Tk, Hkv, D], int32 cu_seqlens, sparse_layout = (crow, col) int32);
    sm_scale and max_seqlen are Python numbers (static), the arrays may be
    traced: sequence lengths are read on the device, never on the host.
    ``config`` (static): an optional ``BlocksparsePrefillConfig``,
    ``BlocksparseDecodeConfig`` or ``BlocksparseGroupDecodeConfig`` overriding the
    planner's kernel variant and tuning (see the torch adapter).
    Returns [Tq, Hq, D] in q's dtype.
    """
    crow, col = (jnp.asarray(x) for x in sparse_layout)
    arrays = dict(q=q, k=k, v=v, cu_seqlens_k=cu_seqlens_k, crow=crow, col=col)
    if cu_seqlens_q is not None:
        arrays["cu_seqlens_q"] = cu_seqlens_q
    tgt = target(arrays)
    plan = plan_blocksparse_attention(
        tgt, info(q), info(k), info(v), info(cu_seqlens_k),
        None if cu_seqlens_q is None else info(cu_seqlens_q), info(crow), info(col),
        sm_scale=None if sm_scale is None else float(sm_scale), block_size=int(block_size),
        q_block_size=None if q_block_size is None else int(q_block_size),
        max_seqlen=None if max_seqlen is None else int(max_seqlen), config=config)
    return run_plan(plan, arrays, tgt)[0]


class LocalStridedBlockSparseAttn:
    """Local + vertical-stride block-sparse attention: holds the layout, callable
    as ``attn(q, k, v, cu_seqlens_k, cu_seqlens_q=None, sm_scale=None, *, config=None)``
    (inside or outside jax.jit). Arguments as the torch module's."""

    def __init__(self, n_heads, max_seqlen, local_blocks, vert_stride, block_size, device=None,
                 dtype=None, homo_head=False, active_head_range=None, q_block_size=None):
        (crow, col), self.block_mask = get_sparse_attn_mask(
            n_heads, max_seqlen, block_size, local_blocks, vert_stride, homo_head, active_head_range)
        if q_block_size is not None and (q_block_size < block_size or q_block_size % block_size):
            raise ValueError(f"q_block_size: expected a positive multiple of block_size={block_size}, "
                             f"got {q_block_size!r}")
        self.sparse_layout = (jnp.asarray(crow), jnp.asarray(col))  # on the device once
        self.n_heads, self.max_seqlen, self.block_size = n_heads, max_seqlen, block_size
        self.local_blocks, self.vert_stride, self.q_block_size = local_blocks, vert_stride, q_block_size
        self.device, self.dtype = device, dtype

    def __call__(self, q, k, v, cu_seqlens_k, cu_seqlens_q=None, sm_scale=None, *, config=None):
        return blocksparse_flash_attn_varlen_fwd(
            q, k, v, cu_seqlens_k, cu_seqlens_q, sm_scale, self.sparse_layout,
            block_size=self.block_size, q_block_size=self.q_block_size, max_seqlen=self.max_seqlen,
            config=config)

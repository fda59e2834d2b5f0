"""vLLM's block-sparse helpers for JAX: ``get_sparse_attn_mask`` and the
``LocalStridedBlockSparseAttn`` module, over blocksparse_flash_attn_varlen_fwd
(_ops_blocksparse.py)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from core_kernels.blocksparse_attention import (build_sparse_layout, get_head_sliding_step,
                                                local_strided_pattern, vllm_sparse_attn_mask)

from ._ops_blocksparse import blocksparse_flash_attn_varlen_fwd


def _put(x, device):
    x = jnp.asarray(x)
    return x if device is None else jax.device_put(x, device)


def get_sparse_attn_mask(n_heads, q_len, max_seqlen, dtype, device, block_size=64, local_blocks=4,
                         vert_stride=4, homo_head=True, return_dense=False, dense_mask_type="binary"):
    """vLLM's ``get_sparse_attn_mask`` (same positional order and results), as jax arrays.

    Args:
        n_heads: number of heads (of the CSR and of a per-head block_mask / dense_mask).
        q_len: query length; the CSR and dense mask cover the last q_len positions.
        max_seqlen: sequence length the layout covers.
        dtype: dtype of block_mask and dense_mask.
        device: a jax Device (or sharding) to put the arrays on, or None (the default device).
        block_size: layout block size (default 64).
        local_blocks: most recent blocks every query block keeps (default 4).
        vert_stride: every vert_stride-th block is kept too (default 4).
        homo_head: True (default): one pattern for all heads; False: the vertical
            offset slides from head to head (``get_head_sliding_step``).
        return_dense: also build the token-level dense mask.
        dense_mask_type: "binary" (default) or "bias"; anything else: ValueError.

    Returns ``((crow, col), block_mask, dense_mask)``:
    - block_mask: ``dtype`` 1/0, [NB, NB] if homo_head else [n_heads, NB, NB]
      (NB = ceil(max_seqlen / block_size)): the local + vertical-stride layout;
    - crow [n_heads, nbq + 1], col [n_heads, nnz]: int64 with jax_enable_x64, else int32
      (JAX's widest integer then); CSR of the last nbq = ceil(q_len / block_size) rows,
      col padded with -1 (with homo_head one row set expanded over the heads, as vLLM does);
    - dense_mask: None, or with ``return_dense`` [n_heads, q_len, max_seqlen] in
      ``dtype``: query i (absolute position max_seqlen - q_len + i) and key j, with
      the token-level causal mask; "binary": 1 kept, 0 skipped; "bias": 0 kept,
      -inf skipped. (Memory: n_heads * q_len * max_seqlen elements.)

    Transforms: builds the layout on the host (numpy, concrete arguments only) and
    puts it on ``device``; no kernel launch and no gradient. Its arrays may then be
    passed into jitted calls.

    Example::

        (crow, col), block_mask, _ = get_sparse_attn_mask(32, 1, 4096, jnp.bfloat16, None,
                                                          block_size=64, homo_head=False)

    See docs/ops/blocksparse_attention.md ("The layout").
    """
    if dense_mask_type not in ("binary", "bias"):
        raise ValueError(f"dense_mask_type: expected 'binary' or 'bias', got {dense_mask_type!r}")
    (crow, col), block_mask, dense = vllm_sparse_attn_mask(
        n_heads, q_len, max_seqlen, block_size, local_blocks, vert_stride, bool(homo_head),
        bool(return_dense))
    index = jax.dtypes.canonicalize_dtype(np.int64)
    crow, col = (_put(np.ascontiguousarray(x).astype(index), device) for x in (crow, col))
    block = _put(np.ascontiguousarray(block_mask), device).astype(dtype)
    if dense is not None:
        dense = _put(np.ascontiguousarray(dense), device)
        dense = dense.astype(dtype) if dense_mask_type == "binary" else \
            jnp.where(dense, jnp.zeros((), dtype), jnp.array(-jnp.inf, dtype))
    return (crow, col), block, dense


def _concrete(x):
    """numpy value of x, or None when x is traced (under jax.jit)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


class LocalStridedBlockSparseAttn:
    """Local + vertical-stride block-sparse attention (Phi-3-small style), vLLM's module in JAX.

    A plain class holding the layout (no parameters), usable inside and outside jax.jit.

    ``LocalStridedBlockSparseAttn(n_heads, max_seqlen, local_blocks, vert_stride,
    block_size, device=None, dtype=None, homo_head=False, active_head_range=None,
    q_block_size=None, use_spda=None)``:
    - the kernel's layout (``build_sparse_layout``, int32; heads h0..h1-1 with
      ``active_head_range=(h0, h1)``) is held on ``device`` (a jax Device or None: the
      default device) as ``sparse_layout`` = (crow, col). With q_block_size (a positive
      multiple of block_size, else ValueError) it keeps block_size rows: the kernel
      merges them.
    - ``use_spda``: None (default) or False runs the Triton kernel; True runs ``spda``
      (a masked softmax in jnp over padded sequences, fp32 inside, prefill only).
    - ``dtype``: of the dense mask (default bfloat16).
    - ``homo_head`` defaults to False here (per-head shift, as Phi-3-small), unlike
      ``get_sparse_attn_mask``.
    Attributes and methods as vLLM's: ``sparse_layout``, ``block_mask``,
    ``head_sliding_step``, ``get_attn_pattern``, ``varlen_attn``, ``spda``,
    ``transpose_and_pad``, ``transpose_and_unpad``.

    ``forward(q, k, v, cu_seqlens_k, cu_seqlens_q=None, sm_scale=None, *, config=None,
    validate_indices=None)`` (also ``__call__``): q [Tq, Hq, D], k/v [Tk, Hkv, D],
    cu_seqlens [B + 1] int32/int64 -> [Tq, Hq, D] in q's dtype; ``config`` and
    ``validate_indices`` as blocksparse_flash_attn_varlen_fwd's (kernel only). A falsy
    sm_scale means 1 / sqrt(D), as in vLLM.

    Transforms (kernel path): ``jax.jit``, ``jax.vmap``, ``jax.grad``, sharding over
    heads and ``jax.export`` on a GPU, as ``blocksparse_flash_attn_varlen_fwd``.

    Example::

        attn = LocalStridedBlockSparseAttn(32, 8192, local_blocks=16, vert_stride=8,
                                           block_size=64)
        o = jax.jit(attn)(q, k, v, cu_seqlens_k)     # q [Tq, 32, D], k/v [Tk, Hkv, D] bf16

    See docs/ops/blocksparse_attention.md.
    """

    def __init__(self, n_heads, max_seqlen, local_blocks, vert_stride, block_size, device=None,
                 dtype=None, homo_head=False, active_head_range=None, q_block_size=None,
                 use_spda=None):
        (crow, col), self.block_mask = build_sparse_layout(
            n_heads, max_seqlen, block_size, local_blocks, vert_stride, homo_head, active_head_range)
        if q_block_size is not None and (q_block_size < block_size or q_block_size % block_size):
            raise ValueError(f"q_block_size: expected a positive multiple of block_size={block_size}, "
                             f"got {q_block_size!r}")
        self.sparse_layout = (_put(crow, device), _put(col, device))  # on the device once
        self.n_heads, self.max_seqlen, self.block_size = n_heads, max_seqlen, block_size
        self.local_blocks, self.vert_stride, self.q_block_size = local_blocks, vert_stride, q_block_size
        self.homo_head = homo_head
        self.active_head_range = None if active_head_range is None else tuple(active_head_range)
        self.use_spda = bool(use_spda)
        self.device, self.dtype = device, jnp.dtype(jnp.bfloat16 if dtype is None else dtype)
        self.head_sliding_step = get_head_sliding_step(n_heads, vert_stride, homo_head)
        self.dense_attn_mask = self.get_attn_pattern(self.dtype, device)[2] if self.use_spda else None

    def _attn_pattern(self, dtype, device, return_dense):
        return local_strided_pattern(get_sparse_attn_mask, self, dtype, device, return_dense)

    def get_attn_pattern(self, dtype, device):
        """vLLM's: (sparse_layout CSR, block pattern, dense bias mask or None (built
        when use_spda)), heads sliced to active_head_range unless homo_head."""
        return self._attn_pattern(dtype, device, self.use_spda)

    def varlen_attn(self, q, k, v, cu_seqlens_k, cu_seqlens_q=None, sm_scale=None, *, config=None,
                    validate_indices=None):
        # the public op (bound at the end of this module): its vmap rule and VJP (jax.grad works)
        sm_scale = sm_scale or 1.0 / math.sqrt(q.shape[-1])
        return blocksparse_flash_attn_varlen_fwd(
            q, k, v, cu_seqlens_k, cu_seqlens_q, sm_scale, self.sparse_layout,
            block_size=self.block_size, q_block_size=self.q_block_size, max_seqlen=self.max_seqlen,
            config=config, validate_indices=validate_indices)

    @staticmethod
    def transpose_and_pad(x, cu_seqlens, maxlen, head_repeats=1):
        """[T, H, D] packed -> [B, H * head_repeats, maxlen, D] (each head repeated
        head_repeats times in a row; positions past a sequence's end are 0). ``maxlen``
        static; cu_seqlens may be traced."""
        maxlen = int(maxlen)
        cu = jnp.asarray(cu_seqlens)
        pos = jnp.arange(maxlen, dtype=cu.dtype)
        valid = pos[None, :] < (cu[1:] - cu[:-1])[:, None]
        idx = jnp.where(valid, cu[:-1, None] + pos[None, :], 0)
        if x.shape[0] == 0:
            g = jnp.zeros(idx.shape + tuple(x.shape[1:]), x.dtype)
        else:
            g = jnp.where(valid[:, :, None, None], x[idx], jnp.zeros((), x.dtype))  # [B, maxlen, H, D]
        g = jnp.repeat(jnp.transpose(g, (0, 2, 1, 3)), head_repeats, axis=1)
        return g

    @staticmethod
    def transpose_and_unpad(x_padded, cu_seqlens, total=None):
        """[B, H, L, D] padded -> [total, H, D] packed; ``total`` (static) defaults to
        cu_seqlens[-1], which then must be concrete (not traced)."""
        cu = jnp.asarray(cu_seqlens)
        if total is None:
            total = int(_concrete_or_raise(cu)[-1])
        t = jnp.arange(total, dtype=cu.dtype)
        b = jnp.searchsorted(cu[1:], t, side="right")
        return x_padded[b, :, t - cu[b]]

    def spda(self, q, k, v, cu_seqlens_k, cu_seqlens_q=None, sm_scale=None):
        """Dense fallback over padded sequences with the layout's dense bias mask, in
        jnp. Prefill only (Tq == Tk; cu_seqlens_q None or equal to cu_seqlens_k).
        Pads to the longest sequence when cu_seqlens_k is concrete, else to max_seqlen."""
        if q.shape[0] != k.shape[0]:
            raise ValueError("cu_seqlens_q: spda runs prefill only (as many query as key tokens)")
        cu = _concrete(cu_seqlens_k)
        if cu_seqlens_q is not None and cu_seqlens_q is not cu_seqlens_k:
            cq = _concrete(cu_seqlens_q)
            if cu is not None and cq is not None and not np.array_equal(cq, cu):
                raise ValueError("cu_seqlens_q: spda runs prefill only (cu_seqlens_q equal to cu_seqlens_k)")
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"k: {k.shape[1]} KV heads do not divide q's {q.shape[1]} heads")
        ratio = q.shape[1] // k.shape[1]
        sm_scale = sm_scale or 1.0 / math.sqrt(q.shape[-1])
        maxlen = (int(np.max(np.diff(cu))) if cu.size > 1 else 0) if cu is not None else self.max_seqlen
        if self.dense_attn_mask is None or self.dense_attn_mask.dtype != q.dtype:
            self.dense_attn_mask = self._attn_pattern(q.dtype, self.device, True)[2]
        mask = self.dense_attn_mask[None, :, :maxlen, :maxlen].astype(jnp.float32)
        q2 = self.transpose_and_pad(q, cu_seqlens_k, maxlen, 1).astype(jnp.float32)
        k2, v2 = (self.transpose_and_pad(x, cu_seqlens_k, maxlen, ratio).astype(jnp.float32)
                  for x in (k, v))
        s = jnp.einsum("bhqd,bhkd->bhqk", q2, k2, precision="highest") * sm_scale + mask
        out = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v2, precision="highest")
        return self.transpose_and_unpad(out.astype(q.dtype), cu_seqlens_k, q.shape[0])

    def forward(self, q, k, v, cu_seqlens_k, cu_seqlens_q=None, sm_scale=None, *, config=None,
                validate_indices=None):
        """q [Tq, Hq, D], k/v [Tk, Hkv, D], cu_seqlens_k/q [B + 1] int32/int64 -> [Tq, Hq, D]
        in q's dtype; the kernel or ``spda`` (use_spda). A falsy sm_scale: 1 / sqrt(D).
        Other arguments as ``blocksparse_flash_attn_varlen_fwd``'s."""
        if k.ndim != 3:
            raise ValueError(f"k: expected shape [Tk, Hkv, D], got {tuple(k.shape)}")
        if self.use_spda:
            if config is not None:
                raise ValueError("config: the module runs the dense fallback (use_spda=True), not a kernel")
            return self.spda(q, k, v, cu_seqlens_k, cu_seqlens_q=cu_seqlens_q, sm_scale=sm_scale)
        return self.varlen_attn(q, k, v, cu_seqlens_k, cu_seqlens_q=cu_seqlens_q, sm_scale=sm_scale,
                                config=config, validate_indices=validate_indices)

    __call__ = forward


def _concrete_or_raise(x):
    value = _concrete(x)
    if value is None:
        raise ValueError("cu_seqlens: traced under jax.jit; pass total= (the packed token count)")
    return value

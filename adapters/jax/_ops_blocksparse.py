"""Block-sparse varlen attention for JAX: functional, works under jax.jit."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from core_kernels import _index_check
from core_kernels._plan import as_float, as_int
from core_kernels.blocksparse_attention import (build_sparse_layout, local_strided_pattern,
                                                get_head_sliding_step,
                                                plan_blocksparse_attention, vllm_sparse_attn_mask)

from core_kernels.op_axes import BLOCKSPARSE_VARLEN

from . import _spmd
from ._executor import info, run_plan, target
from ._index_validation import check_indices, index_validation


def blocksparse_flash_attn_varlen_fwd(q, k, v, cu_seqlens_k, cu_seqlens_q, sm_scale, sparse_layout,
                                      *, block_size=64, q_block_size=None, max_seqlen=None, config=None,
                                      validate_indices=None):
    """Causal block-sparse attention over packed (varlen) sequences.

    Same arguments and result as the torch adapter's function (q [Tq, Hq, D],
    k/v [Tk, Hkv, D], int32 or int64 cu_seqlens, sparse_layout = (crow, col) int32
    or int64; int64 needs jax_enable_x64, else JAX itself makes them int32);
    sm_scale and max_seqlen are Python numbers (static), the arrays may be
    traced: sequence lengths are read on the device, never on the host.
    ``config`` (static): an optional ``BlocksparsePrefillConfig``,
    ``BlocksparseDecodeConfig`` or ``BlocksparseGroupDecodeConfig`` overriding the
    planner's kernel variant and tuning (see the torch adapter).
    ``validate_indices``: True checks cu_seqlens_k/q, the layout and max_seqlen
    before the launch (one host transfer; ValueError naming the argument; traced
    arrays: ValueError), False never, None follows TANDEM_VALIDATE_INDICES
    (docs/index_validation.md).
    Returns [Tq, Hq, D] in q's dtype.
    """
    crow, col = (jnp.asarray(x) for x in sparse_layout)
    if index_validation(validate_indices, cu_seqlens_k, cu_seqlens_q, crow, col) \
            and q.ndim == 3 and k.ndim == 3:
        check_indices(_index_check.check_blocksparse_attention,
                      dict(cu_seqlens_k=cu_seqlens_k, cu_seqlens_q=cu_seqlens_q, crow=crow, col=col),
                      num_q_tokens=q.shape[0], num_k_tokens=k.shape[0], block_size=int(block_size),
                      max_seqlen=None if max_seqlen is None else int(max_seqlen))
    arrays = dict(q=q, k=k, v=v, cu_seqlens_k=cu_seqlens_k, crow=crow, col=col)
    if cu_seqlens_q is not None:
        arrays["cu_seqlens_q"] = cu_seqlens_q
    return _spmd.call(
        BLOCKSPARSE_VARLEN, _blocksparse, arrays,
        sm_scale=None if sm_scale is None else as_float("sm_scale", sm_scale, finite=False),
        block_size=as_int("block_size", block_size),
        q_block_size=None if q_block_size is None else as_int("q_block_size", q_block_size),
        max_seqlen=None if max_seqlen is None else as_int("max_seqlen", max_seqlen), config=config)[0]


def _blocksparse(arrays, **options):
    tgt = target(arrays)
    cu_q = arrays.get("cu_seqlens_q")
    plan = plan_blocksparse_attention(
        tgt, *(info(arrays[n]) for n in ("q", "k", "v", "cu_seqlens_k")),
        None if cu_q is None else info(cu_q), info(arrays["crow"]), info(arrays["col"]), **options)
    return run_plan(plan, arrays, tgt)


def _put(x, device):
    x = jnp.asarray(x)
    return x if device is None else jax.device_put(x, device)


def get_sparse_attn_mask(n_heads, q_len, max_seqlen, dtype, device, block_size=64, local_blocks=4,
                         vert_stride=4, homo_head=True, return_dense=False, dense_mask_type="binary"):
    """vLLM's ``get_sparse_attn_mask`` as jax arrays: ``((crow, col), block_mask,
    dense_mask or None)``, as the torch adapter's (see there). ``dtype``: of the block
    and dense masks; ``device``: a jax Device (or sharding) or None (the default device).
    crow and col are int64 with jax_enable_x64, else int32 (JAX's widest integer then).
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
    """vLLM's LocalStridedBlockSparseAttn for JAX: the torch module's constructor,
    attributes and methods (see adapters.torch), a plain class holding the layout;
    ``forward`` (also ``__call__``) works inside and outside jax.jit. ``device``: a
    jax Device or None; ``dtype``: of the dense mask (default bfloat16). ``spda`` is
    the dense fallback in jnp (a masked softmax over padded sequences, fp32 inside)."""

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

"""Sparse layouts for block-sparse attention (framework-free numpy).

The local + vertical-stride pattern of the spec: head h, query block qb and
key block kb (absolute block positions) are allowed when

    qb >= kb and (qb - kb < local_blocks or (kb + h * step + 1) % vert_stride == 0)

with step = 0 for a homogeneous pattern, else max(1, vert_stride // n_heads).
"""
from __future__ import annotations

import functools

import numpy as np


def _check_positive(name, value):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def get_head_sliding_step(n_heads: int, vert_stride: int, homo_head: bool = False) -> int:
    """The per-head offset of the vertical stride (vLLM's ``get_head_sliding_step``).

    Exported unchanged by both adapters (``adapters.torch`` and ``adapters.jax``).

    Args:
        n_heads: number of heads (int > 0).
        vert_stride: the layout's vertical stride (int).
        homo_head: True: one pattern for all heads.
    Returns:
        int: 0 if homo_head, else max(1, vert_stride // n_heads). Head h keeps key
        block kb as a vertical column iff (kb + h * step + 1) % vert_stride == 0.

    Transforms: a host function of Python ints (no arrays, no kernel): nothing to
    compile, trace or differentiate.

    Example::

        get_head_sliding_step(2, 4)                    # 2
        get_head_sliding_step(32, 8, homo_head=True)   # 0

    See docs/ops/blocksparse_attention.md ("The layout").
    """
    if homo_head:
        return 0
    return max(1, int(vert_stride) // int(n_heads))


def dense_to_crow_col(block_mask: np.ndarray, index_dtype=np.int32):
    """[H, R, C] (or [R, C]) bool -> (crow [H, R + 1], col [H, max_nnz]) of ``index_dtype``.

    Per head, ``col`` lists the allowed key blocks of every row (ascending),
    rows one after the other; ``crow[h, r]:crow[h, r + 1]`` indexes row r.
    Heads with fewer entries are padded with -1. A 2-D mask gives 1-D crow and col.
    """
    block_mask = np.asarray(block_mask, dtype=bool)
    if block_mask.ndim == 2:
        crow, col = dense_to_crow_col(block_mask[None], index_dtype)
        return crow[0], col[0]
    if block_mask.ndim != 3:
        raise ValueError(f"block_mask: expected shape [H, R, C] or [R, C], got {block_mask.shape}")
    n_heads, nb, _ = block_mask.shape
    counts = block_mask.sum(-1, dtype=np.int64)                     # [H, NB]
    crow = np.zeros((n_heads, nb + 1), index_dtype)
    np.cumsum(counts, axis=1, out=crow[:, 1:])
    nnz = crow[:, -1].astype(np.int64)
    max_nnz = int(nnz.max()) if n_heads else 0
    hh, _, cc = np.nonzero(block_mask)                               # row-major: by head, row, col
    head_start = np.concatenate([[0], np.cumsum(nnz)[:-1]])
    pos = np.arange(hh.size) - head_start[hh]
    col = np.full((n_heads, max(max_nnz, 1)), -1, index_dtype)
    col[hh, pos] = cc
    return crow, col


@functools.lru_cache(maxsize=64)
def _sparse_attn_mask(n_heads, max_seqlen, block_size, local_blocks, vert_stride,
                      homo_head, active_head_range):
    nb = -(-max_seqlen // block_size)
    h0, h1 = active_head_range
    step = get_head_sliding_step(n_heads, vert_stride, homo_head)
    heads = np.arange(h0, h1, dtype=np.int64)[:, None, None]
    qb = np.arange(nb, dtype=np.int64)[None, :, None]
    kb = np.arange(nb, dtype=np.int64)[None, None, :]
    block_mask = (qb >= kb) & (((qb - kb) < local_blocks)
                               | ((kb + heads * step + 1) % vert_stride == 0))
    crow, col = dense_to_crow_col(block_mask)
    for a in (crow, col, block_mask):
        a.setflags(write=False)  # cached: callers must not mutate it
    return (crow, col), block_mask


def build_sparse_layout(n_heads: int, max_seqlen: int, block_size: int = 64,
                        local_blocks: int = 4, vert_stride: int = 4, homo_head: bool = True,
                        active_head_range=None):
    """The local + vertical-stride block layout.

    Returns ``((crow, col), block_mask)``: block_mask [H, NB, NB] bool with
    NB = ceil(max_seqlen / block_size); crow [H, NB + 1] int32 and col
    [H, max_nnz] int32 (CSR per head, columns ascending, padded with -1).
    H = n_heads, or h1 - h0 with ``active_head_range=(h0, h1)`` (heads h0..h1-1,
    global ids in the stride pattern, as one tensor-parallel rank holds).
    Results are cached and read-only (numpy, framework-free).
    """
    for name, value in (("n_heads", n_heads), ("max_seqlen", max_seqlen),
                        ("block_size", block_size), ("local_blocks", local_blocks),
                        ("vert_stride", vert_stride)):
        _check_positive(name, value)
    if active_head_range is None:
        active_head_range = (0, n_heads)
    try:
        h0, h1 = (int(x) for x in active_head_range)
    except (TypeError, ValueError):
        raise ValueError(f"active_head_range: expected (h0, h1), got {active_head_range!r}") from None
    if not 0 <= h0 < h1 <= n_heads:
        raise ValueError(f"active_head_range: expected 0 <= h0 < h1 <= n_heads={n_heads}, "
                         f"got {(h0, h1)}")
    return _sparse_attn_mask(int(n_heads), int(max_seqlen), int(block_size), int(local_blocks),
                             int(vert_stride), bool(homo_head), (h0, h1))


def vllm_sparse_attn_mask(n_heads: int, q_len: int, max_seqlen: int, block_size: int = 64,
                          local_blocks: int = 4, vert_stride: int = 4, homo_head: bool = True,
                          return_dense: bool = False):
    """numpy parts of vLLM's ``get_sparse_attn_mask`` (the adapters convert them).

    Returns ``((crow, col), block_mask, dense)``:
    - block_mask: bool [NB, NB] if homo_head else [n_heads, NB, NB]
      (NB = ceil(max_seqlen / block_size)), the whole layout;
    - crow [n_heads, nbq + 1], col [n_heads, nnz] int64: the CSR of the last
      nbq = ceil(q_len / block_size) rows of block_mask (col padded with -1);
      with homo_head, one row set broadcast (a read-only view) over the heads;
    - dense: None, or with ``return_dense`` bool [n_heads, q_len, max_seqlen]:
      query i sits at absolute position max_seqlen - q_len + i and sees key j
      iff j <= that position and their blocks are allowed (read-only view over
      the heads with homo_head).
    """
    for name, value in (("n_heads", n_heads), ("q_len", q_len), ("max_seqlen", max_seqlen)):
        _check_positive(name, value)
    if q_len > max_seqlen:
        raise ValueError(f"q_len: {q_len} exceeds max_seqlen={max_seqlen}")
    heads = 1 if homo_head else n_heads
    (_, _), block_mask = build_sparse_layout(heads, max_seqlen, block_size, local_blocks,
                                             vert_stride, homo_head)
    nbq = -(-q_len // block_size)
    crow, col = dense_to_crow_col(block_mask[:, -nbq:], np.int64)
    dense = None
    if return_dense:
        qpos = max_seqlen - q_len + np.arange(q_len)
        kpos = np.arange(max_seqlen)
        dense = block_mask[:, (qpos // block_size)[:, None], (kpos // block_size)[None, :]]
        dense &= kpos[None, None, :] <= qpos[None, :, None]
    if homo_head:
        crow, col = (np.broadcast_to(x, (n_heads,) + x.shape[1:]) for x in (crow, col))
        block_mask = block_mask[0]
        if dense is not None:
            dense = np.broadcast_to(dense, (n_heads,) + dense.shape[1:])
    return (crow, col), block_mask, dense


def active_heads(layout, dense, homo_head: bool, active_head_range):
    """vLLM's get_attn_pattern step after the mask: the CSR layout (crow, col) and
    the dense mask (or None) cut to active_head_range unless homo_head. Slicing
    only, so it serves numpy, torch and JAX arrays alike."""
    if homo_head or active_head_range is None:
        return layout, dense
    h0, h1 = active_head_range
    return tuple(x[h0:h1] for x in layout), None if dense is None else dense[h0:h1]


def local_strided_pattern(get_sparse_attn_mask, attn, dtype, device, return_dense: bool):
    """vLLM's LocalStridedBlockSparseAttn.get_attn_pattern, written once for both
    adapters: ``get_sparse_attn_mask`` is the adapter's vLLM-shaped builder, ``attn``
    the module (n_heads, max_seqlen, block_size, local_blocks, vert_stride,
    homo_head, active_head_range). Returns (layout, block pattern, dense bias
    mask or None), heads cut to active_head_range unless homo_head."""
    layout, pattern, dense = get_sparse_attn_mask(
        attn.n_heads, attn.max_seqlen, attn.max_seqlen, dtype, device, block_size=attn.block_size,
        local_blocks=attn.local_blocks, vert_stride=attn.vert_stride, homo_head=attn.homo_head,
        return_dense=return_dense, dense_mask_type="bias")
    layout, dense = active_heads(layout, dense, attn.homo_head, attn.active_head_range)
    return layout, pattern, dense

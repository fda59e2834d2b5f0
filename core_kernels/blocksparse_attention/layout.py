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


def dense_to_crow_col(block_mask: np.ndarray):
    """[H, NB, NB] bool -> (crow [H, NB + 1] int32, col [H, max_nnz] int32).

    Per head, ``col`` lists the allowed key blocks of every row (ascending),
    rows one after the other; ``crow[h, r]:crow[h, r + 1]`` indexes row r.
    Heads with fewer entries are padded with -1.
    """
    block_mask = np.asarray(block_mask, dtype=bool)
    if block_mask.ndim != 3 or block_mask.shape[1] != block_mask.shape[2]:
        raise ValueError(f"block_mask: expected shape [H, NB, NB], got {block_mask.shape}")
    n_heads, nb, _ = block_mask.shape
    counts = block_mask.sum(-1, dtype=np.int64)                     # [H, NB]
    crow = np.zeros((n_heads, nb + 1), np.int32)
    np.cumsum(counts, axis=1, out=crow[:, 1:])
    nnz = crow[:, -1].astype(np.int64)
    max_nnz = int(nnz.max()) if n_heads else 0
    hh, _, cc = np.nonzero(block_mask)                               # row-major: by head, row, col
    head_start = np.concatenate([[0], np.cumsum(nnz)[:-1]])
    pos = np.arange(hh.size) - head_start[hh]
    col = np.full((n_heads, max(max_nnz, 1)), -1, np.int32)
    col[hh, pos] = cc
    return crow, col


@functools.lru_cache(maxsize=64)
def _sparse_attn_mask(n_heads, max_seqlen, block_size, local_blocks, vert_stride,
                      homo_head, active_head_range):
    nb = -(-max_seqlen // block_size)
    h0, h1 = active_head_range
    step = 0 if homo_head else max(1, vert_stride // n_heads)
    heads = np.arange(h0, h1, dtype=np.int64)[:, None, None]
    qb = np.arange(nb, dtype=np.int64)[None, :, None]
    kb = np.arange(nb, dtype=np.int64)[None, None, :]
    block_mask = (qb >= kb) & (((qb - kb) < local_blocks)
                               | ((kb + heads * step + 1) % vert_stride == 0))
    crow, col = dense_to_crow_col(block_mask)
    for a in (crow, col, block_mask):
        a.setflags(write=False)  # cached: callers must not mutate it
    return (crow, col), block_mask


def get_sparse_attn_mask(n_heads: int, max_seqlen: int, block_size: int = 64,
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

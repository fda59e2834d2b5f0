"""Index-data check of unified_attention (the validation mode: core_kernels._index_check)."""
from __future__ import annotations

import numpy as np

from .._index_check import as_int64, check_cumulative, first_index


def check_unified_attention(host: dict, *, num_tokens: int, num_blocks: int, block_size: int,
                            max_seqlen_q: int, max_seqlen_k: int, window_left: int = -1) -> None:
    """unified_attention: ``host`` has cu_seqlens_q [B + 1], seqused_k [B],
    block_table [B, W]. ``num_tokens`` is q's T, ``num_blocks`` / ``block_size``
    k's shape[0] / shape[1]; ``max_seqlen_q`` / ``max_seqlen_k`` the bounds the
    caller passed; ``window_left`` the window's left extent (-1: none).

    Checked for every sequence with queries (a sequence with none is never
    computed): its query length and seqused_k within the bounds, seqused_k not
    below the query length, and every block-table entry of a cache position
    some query can see (from the first key of the window, or 0, up to
    seqused_k - 1) inside the table and a block id in [0, num_blocks). Entries
    no query needs (before the window, past the sequence) may hold anything.
    """
    cu, used, table = (host.get(n) for n in ("cu_seqlens_q", "seqused_k", "block_table"))
    if cu is None or used is None or table is None or table.ndim != 2 \
            or used.shape != (table.shape[0],) or cu.shape != (table.shape[0] + 1,):
        return  # shapes are the planner's to refuse
    cu, used, table = as_int64(cu), as_int64(used), as_int64(table)
    bsz, width = table.shape
    if bsz == 0:
        return
    q_len = check_cumulative("cu_seqlens_q", cu, start=None, end=None, limit=num_tokens,
                             what=f"q has {num_tokens} tokens")
    running = q_len > 0
    if (running & (q_len > max_seqlen_q)).any():
        i = first_index(running & (q_len > max_seqlen_q))
        raise ValueError(f"max_seqlen_q: {max_seqlen_q} is less than sequence {i}'s query length "
                         f"{int(q_len[i])} (cu_seqlens_q[{i + 1}] - cu_seqlens_q[{i}])")
    if (used < 0).any():
        i = first_index(used < 0)
        raise ValueError(f"seqused_k: seqused_k[{i}] = {int(used[i])} is negative")
    short = running & (used < q_len)
    if short.any():
        i = first_index(short)
        raise ValueError(f"seqused_k: seqused_k[{i}] = {int(used[i])} is less than sequence {i}'s "
                         f"query length {int(q_len[i])}: the new tokens' keys must be in the cache")
    if (running & (used > max_seqlen_k)).any():
        i = first_index(running & (used > max_seqlen_k))
        raise ValueError(f"max_seqlen_k: {max_seqlen_k} is less than seqused_k[{i}] = {int(used[i])}")
    ctx = used - q_len
    lo = np.maximum(ctx - window_left, 0) if window_left >= 0 else np.zeros_like(ctx)
    reads = running & (used > lo)
    if not reads.any():
        return
    first_col, last_col = lo // block_size, (used - 1) // block_size
    past = reads & (last_col >= width)
    if past.any():
        i = first_index(past)
        raise ValueError(f"seqused_k: sequence {i} has seqused_k[{i}] = {int(used[i])} keys, which "
                         f"need {int(last_col[i]) + 1} blocks of {block_size}, but block_table has "
                         f"{width} columns")
    cols = np.arange(width)[None, :]
    need = reads[:, None] & (cols >= first_col[:, None]) & (cols <= last_col[:, None])
    bad = need & ((table < 0) | (table >= num_blocks))
    if bad.any():
        i, j = np.argwhere(bad)[0]
        raise ValueError(f"block_table: entry [{i}, {j}] = {int(table[i, j])} is outside the cache's "
                         f"[0, {num_blocks}) blocks (read for sequence {i}'s keys "
                         f"{j * block_size}..{(j + 1) * block_size - 1})")


def check_static(q, k, max_seqlen_q: int, max_seqlen_k: int, window_left: int) -> dict | None:
    """The static keywords of :func:`check_unified_attention` for arrays q and k (any
    framework's), or None where their shapes are malformed (the planner's error
    comes instead)."""
    q_shape, k_shape = tuple(getattr(q, "shape", ())), tuple(getattr(k, "shape", ()))
    if len(q_shape) != 3 or len(k_shape) != 4:
        return None
    return dict(num_tokens=q_shape[0], num_blocks=k_shape[0], block_size=k_shape[1],
                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, window_left=window_left)

"""Index-data check of context_attention_fwd (the validation mode: core_kernels._index_check)."""
from __future__ import annotations

import numpy as np

from .._index_check import as_int64, check_cumulative, first_index


def check_prefix_prefill(host: dict, *, num_tokens: int, num_blocks: int, block_size: int,
                         max_input_len: int, sliding_window: int | None = None, skip_decode: bool = False,
                         cache_new: bool = False, is_block_table_ptr: bool = False,
                         k_cache_address: int | None = None, block_bytes: int = 0,
                         max_seq_len: int = 0) -> None:
    """context_attention_fwd: ``host`` has b_loc [B, W], b_start_loc [B + 1],
    b_seq_len [B]. ``num_tokens`` is q's T, ``num_blocks`` / ``block_size``
    k_cache's shape[0] / shape[3]; ``cache_new``: k = v = None (the new tokens' K/V are read from the
    cache too); ``is_block_table_ptr``: b_loc holds K cache block addresses,
    k_cache_address + id * block_bytes (k_cache_address None: unknown, the
    entries are not checked).

    Only the block-table entries the kernels read are checked: those of the
    cache positions some query of a running sequence can see (a sliding window
    hides the early ones; skip_decode skips sequences with one query), so a
    stale id in an unused slot stays harmless, as the spec promises.
    ``max_seq_len`` > 0 sizes the gathered context: every running sequence's
    context length must not exceed it.
    """
    b_loc, b_start_loc, b_seq_len = (host[n] for n in ("b_loc", "b_start_loc", "b_seq_len"))
    if b_loc.ndim != 2 or b_start_loc.shape != (b_loc.shape[0] + 1,) \
            or b_seq_len.shape != (b_loc.shape[0],) or (is_block_table_ptr and b_loc.dtype != np.int64):
        return  # shapes (and int32 addresses) are the planner's to refuse
    b_loc, b_start_loc, b_seq_len = as_int64(b_loc), as_int64(b_start_loc), as_int64(b_seq_len)
    bsz, width = b_loc.shape
    if bsz == 0:
        return
    q_len = check_cumulative("b_start_loc", b_start_loc, start=None, end=None, limit=num_tokens,
                              what=f"q has {num_tokens} tokens")
    if (b_seq_len < 0).any():
        i = first_index(b_seq_len < 0)
        raise ValueError(f"b_seq_len: b_seq_len[{i}] = {int(b_seq_len[i])} is negative")
    ctx = b_seq_len - q_len
    if (ctx < 0).any():
        i = first_index(ctx < 0)
        raise ValueError(f"b_seq_len: b_seq_len[{i}] = {int(b_seq_len[i])} is less than sequence "
                         f"{i}'s query length {int(q_len[i])} (b_start_loc[{i + 1}] - "
                         f"b_start_loc[{i}]): its context length would be {int(ctx[i])}")
    running = q_len > 0
    if skip_decode:
        running &= q_len != 1
    if max_seq_len > 0 and (running & (ctx > max_seq_len)).any():
        i = first_index(running & (ctx > max_seq_len))
        raise ValueError(f"max_seq_len: {max_seq_len} is less than sequence {i}'s context length "
                         f"{int(ctx[i])}; it sizes the gathered context, so that sequence's outputs "
                         "would be NaN")
    if running.any() and q_len[running].max() > max_input_len:
        i = first_index(running & (q_len > max_input_len))
        raise ValueError(f"max_input_len: {max_input_len} is less than sequence {i}'s query "
                         f"length {int(q_len[i])}; the grid would leave its last query rows "
                         "uncomputed")
    # cache positions [lo, end) each running sequence reads through b_loc
    end = b_seq_len if cache_new else ctx
    window = int(sliding_window) if sliding_window is not None and sliding_window > 0 else 0
    lo = np.maximum(ctx - window + 1, 0) if window else np.zeros_like(ctx)
    reads = running & (end > lo)
    if not reads.any():
        return
    first_col = lo // block_size
    last_col = (end - 1) // block_size
    if (reads & (last_col >= width)).any():
        i = first_index(reads & (last_col >= width))
        raise ValueError(f"b_seq_len: sequence {i} reads cache positions up to {int(end[i]) - 1} "
                         f"(b_seq_len[{i}] = {int(b_seq_len[i])}), which need {int(last_col[i]) + 1} "
                         f"blocks of {block_size}, but b_loc has {width} columns")
    cols = np.arange(width)
    used = reads[:, None] & (cols[None, :] >= first_col[:, None]) & (cols[None, :] <= last_col[:, None])
    ids = b_loc
    if is_block_table_ptr:
        if k_cache_address is None:
            return
        offset = b_loc - int(k_cache_address)
        ids = offset // max(int(block_bytes), 1)
        misaligned = used & (offset % max(int(block_bytes), 1) != 0)
        if misaligned.any():
            i, j = np.argwhere(misaligned)[0]
            raise ValueError(
                f"b_loc: entry [{i}, {j}] = {int(b_loc[i, j]):#x} (used by sequence {i}) is not the "
                f"address of a K cache block (is_block_table_ptr: k_cache at "
                f"{int(k_cache_address):#x} + id * {block_bytes} bytes)")
    bad = used & ((ids < 0) | (ids >= num_blocks))
    if bad.any():
        i, j = np.argwhere(bad)[0]
        what = (f"address {int(b_loc[i, j]):#x} maps to block id {int(ids[i, j])}"
                if is_block_table_ptr else f"block id {int(b_loc[i, j])}")
        raise ValueError(f"b_loc: entry [{i}, {j}]: {what}, outside the cache's [0, {num_blocks}) "
                         f"blocks (used by sequence {i}'s cache positions {j * block_size}.."
                         f"{(j + 1) * block_size - 1})")

"""Opt-in validation of index data (framework-free): one check per op.

The kernels read block tables, start offsets, cumulative lengths, sparse
layouts and slot ids from device memory and trust them: a bad entry gives
garbage, a hang or an illegal memory access, and checking it needs the values
on the host (a device sync). So the check is opt-in (docs/index_validation.md):

- the switch: the environment variable ``TANDEM_VALIDATE_INDICES`` (``1``,
  ``true``, ``yes``, ``on``: on) and, per call, the keyword-only argument
  ``validate_indices`` of every op that takes index data (True / False; None
  follows the environment). :func:`requested` resolves them, for both adapters.
- the adapters copy every index array of the call to the host at once (one
  sync) and call the op's ``check_<op>(host, **static)`` below before planning
  and launching. ``host`` maps argument names to numpy arrays (integer dtype);
  ``static`` carries the shapes and options the check needs. A check raises
  ValueError naming the argument ("b_loc: ...") or returns None.
- a check returns without a word when the arrays' shapes or dtypes do not fit
  each other: those are the planner's errors, raised right after (the adapters
  pass int32 / int64 arrays only, each in its own dtype).

Adding an op (the hook): write ``check_<op>(host, **static)`` here (or beside
the op's planner), give the public function of each adapter a keyword-only
``validate_indices=None`` and call, before planning::

    if index_validation(validate_indices, *index_arrays):
        check_indices(check_<op>, dict(name=array, ...), **static)

where ``index_validation`` and ``check_indices`` come from
``adapters.<torch|jax>._index_validation``; the host copy, the switch and the
torch.compile / CUDA graph / jax.jit rules are theirs. merge_attn_states has
no index data (no check, no argument).
"""
from __future__ import annotations

import os

import numpy as np

ENV_VAR = "TANDEM_VALIDATE_INDICES"
_OFF = ("", "0", "false", "no", "off")
_ENV_KEY = os.environ.encodekey(ENV_VAR) if hasattr(os.environ, "encodekey") else ENV_VAR


def _env_on() -> bool:
    """TANDEM_VALIDATE_INDICES, read at each call (so a change of os.environ
    applies at once). NOTE: os.environ.get costs 1.4 us per call on the 2-core
    CI machine (key encoding and the mapping protocol), the raw dict lookup
    below 0.06 us, with the decode step's whole host time ~7 us on the H200
    machine; the mapping is the fallback where os.environ is not CPython's."""
    env = os.environ
    data = getattr(env, "_data", None)
    raw = env.get(ENV_VAR) if data is None else data.get(_ENV_KEY)
    if raw is None:
        return False
    if isinstance(raw, bytes):
        raw = raw.decode(errors="replace")
    return raw.strip().lower() not in _OFF


def requested(flag=None) -> bool:
    """Whether a call validates its index data: ``flag`` (the op's
    ``validate_indices``) when it is True or False, else the environment
    variable TANDEM_VALIDATE_INDICES (read at each call; unset, "", "0",
    "false", "no", "off": off)."""
    if flag is None:
        return _env_on()
    if not isinstance(flag, (bool, np.bool_)):
        raise TypeError(f"validate_indices: expected True, False or None (follow {ENV_VAR}), "
                        f"got {flag!r}")
    return bool(flag)


def _first(mask) -> int:
    return int(np.flatnonzero(mask)[0])


def _int64(x) -> np.ndarray:
    return np.asarray(x).astype(np.int64, copy=False)


def _check_cumulative(name: str, cu: np.ndarray, *, start: int | None, end: int | None,
                      limit: int, what: str) -> np.ndarray:
    """Offsets ``cu`` [B + 1]: non-decreasing, cu[0] == start (>= 0 when None),
    cu[-1] == end (<= limit when None); returns the lengths [B]."""
    if start is not None and cu[0] != start:
        raise ValueError(f"{name}: {name}[0] = {int(cu[0])}, expected {start} ({what})")
    if cu[0] < 0:
        raise ValueError(f"{name}: {name}[0] = {int(cu[0])} is negative")
    lens = np.diff(cu)
    if (lens < 0).any():
        i = _first(lens < 0)
        raise ValueError(f"{name}: must be non-decreasing, got {name}[{i}] = {int(cu[i])} then "
                         f"{name}[{i + 1}] = {int(cu[i + 1])}")
    if end is not None and cu[-1] != end:
        raise ValueError(f"{name}: {name}[-1] = {int(cu[-1])}, expected {end} ({what})")
    if cu[-1] > limit:
        raise ValueError(f"{name}: {name}[-1] = {int(cu[-1])} exceeds the token count ({what})")
    return lens


# ---------------------------------------------------------------- prefix prefill
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
    b_loc, b_start_loc, b_seq_len = _int64(b_loc), _int64(b_start_loc), _int64(b_seq_len)
    bsz, width = b_loc.shape
    if bsz == 0:
        return
    q_len = _check_cumulative("b_start_loc", b_start_loc, start=None, end=None, limit=num_tokens,
                              what=f"q has {num_tokens} tokens")
    if (b_seq_len < 0).any():
        i = _first(b_seq_len < 0)
        raise ValueError(f"b_seq_len: b_seq_len[{i}] = {int(b_seq_len[i])} is negative")
    ctx = b_seq_len - q_len
    if (ctx < 0).any():
        i = _first(ctx < 0)
        raise ValueError(f"b_seq_len: b_seq_len[{i}] = {int(b_seq_len[i])} is less than sequence "
                         f"{i}'s query length {int(q_len[i])} (b_start_loc[{i + 1}] - "
                         f"b_start_loc[{i}]): its context length would be {int(ctx[i])}")
    running = q_len > 0
    if skip_decode:
        running &= q_len != 1
    if max_seq_len > 0 and (running & (ctx > max_seq_len)).any():
        i = _first(running & (ctx > max_seq_len))
        raise ValueError(f"max_seq_len: {max_seq_len} is less than sequence {i}'s context length "
                         f"{int(ctx[i])}; it sizes the gathered context, so that sequence's outputs "
                         "would be NaN")
    if running.any() and q_len[running].max() > max_input_len:
        i = _first(running & (q_len > max_input_len))
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
        i = _first(reads & (last_col >= width))
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


# ---------------------------------------------------------------- block-sparse attention
def check_blocksparse_attention(host: dict, *, num_q_tokens: int, num_k_tokens: int,
                                block_size: int, max_seqlen: int | None = None) -> None:
    """blocksparse_flash_attn_varlen_fwd: ``host`` has cu_seqlens_k [B + 1],
    cu_seqlens_q [B + 1] (absent or None: decode when Tq == B, else
    cu_seqlens_k places the queries too), crow [H, NB + 1] or [NB + 1], col
    [H, nnz] or [nnz]. ``num_q_tokens`` / ``num_k_tokens``: q's Tq, k's Tk;
    ``max_seqlen``: the static bound the caller passed (None: the layout's).

    The queries' offsets must cover q exactly (0 .. Tq: the output rows of no
    sequence are never written); k's may end before Tk (keys past it are never
    read). The whole layout is checked: crow non-decreasing from >= 0 to <= nnz,
    columns of each row strictly increasing (the kernels read the columns below
    a row without a causal mask) and in [0, NB).
    """
    cu_k, crow, col = host["cu_seqlens_k"], host["crow"], host["col"]
    cu_q = host.get("cu_seqlens_q")
    if cu_k.ndim != 1 or cu_k.shape[0] < 1 or crow.ndim not in (1, 2) or crow.ndim != col.ndim \
            or crow.shape[:-1] != col.shape[:-1] or crow.shape[-1] < 2 \
            or (cu_q is not None and cu_q.shape != cu_k.shape):
        return  # shapes are the planner's to refuse
    cu_k = _int64(cu_k)
    bsz = cu_k.shape[0] - 1
    decode = cu_q is None and num_q_tokens == bsz
    if cu_q is None and not decode and num_q_tokens != num_k_tokens:
        return  # the planner asks for cu_seqlens_q
    if cu_q is not None:
        k_len = _check_cumulative("cu_seqlens_k", cu_k, start=None, end=None, limit=num_k_tokens,
                                  what=f"k has {num_k_tokens} tokens")
        q_len = _check_cumulative("cu_seqlens_q", _int64(cu_q), start=0, end=num_q_tokens,
                                  limit=num_q_tokens, what=f"q has {num_q_tokens} tokens; output "
                                  "rows outside the sequences would never be written")
    elif decode:
        k_len = _check_cumulative("cu_seqlens_k", cu_k, start=None, end=None, limit=num_k_tokens,
                                  what=f"k has {num_k_tokens} tokens")
        q_len = np.ones_like(k_len)
    else:
        k_len = _check_cumulative("cu_seqlens_k", cu_k, start=0, end=num_q_tokens,
                                  limit=num_q_tokens, what=f"q and k have {num_q_tokens} tokens "
                                  "and cu_seqlens_q is None, so cu_seqlens_k places the queries too")
        q_len = k_len
    if (q_len > k_len).any():
        i = _first(q_len > k_len)
        name = "cu_seqlens_q" if cu_q is not None else "cu_seqlens_k"
        n = int(q_len[i])
        raise ValueError(f"{name}: sequence {i} has {n} quer{'y' if n == 1 else 'ies'} but "
                         f"{int(k_len[i])} keys"
                         f"{' (decode: one query each)' if decode else ''}; q_len <= k_len is required "
                         "(queries are the last q_len positions)")
    crow, col = np.atleast_2d(_int64(crow)), np.atleast_2d(_int64(col))
    nb, nnz = crow.shape[1] - 1, col.shape[1]
    covered = nb * block_size
    if bsz and k_len.max() > covered:
        i = _first(k_len > covered)
        raise ValueError(f"cu_seqlens_k: sequence {i} has {int(k_len[i])} tokens, more than the "
                         f"{covered} the layout covers ({nb} rows of {block_size})")
    if max_seqlen is not None and bsz and k_len.max() > max_seqlen:
        i = _first(k_len > max_seqlen)
        raise ValueError(f"max_seqlen: {max_seqlen} is less than sequence {i}'s {int(k_len[i])} "
                         "tokens; the grid would leave part of it uncomputed")
    _check_layout(crow, col, nb, nnz)


def _check_layout(crow: np.ndarray, col: np.ndarray, nb: int, nnz: int) -> None:
    steps = np.diff(crow, axis=1)
    if (crow[:, 0] < 0).any():
        h = _first(crow[:, 0] < 0)
        raise ValueError(f"sparse_layout: crow[{h}, 0] = {int(crow[h, 0])} is negative")
    if (steps < 0).any():
        h, r = np.argwhere(steps < 0)[0]
        raise ValueError(f"sparse_layout: crow must be non-decreasing, got crow[{h}, {r}] = "
                         f"{int(crow[h, r])} then crow[{h}, {r + 1}] = {int(crow[h, r + 1])}")
    if (crow[:, -1] > nnz).any():
        h = _first(crow[:, -1] > nnz)
        raise ValueError(f"sparse_layout: crow[{h}, {nb}] = {int(crow[h, -1])} exceeds col's "
                         f"{nnz} entries per head")
    pos = np.arange(nnz)
    live = (pos[None, :] >= crow[:, :1]) & (pos[None, :] < crow[:, -1:])   # [H, nnz]
    bad = live & ((col < 0) | (col >= nb))
    if bad.any():
        h, j = np.argwhere(bad)[0]
        raise ValueError(f"sparse_layout: col[{h}, {j}] = {int(col[h, j])} is outside the layout's "
                         f"[0, {nb}) key blocks")
    # strictly increasing inside each row: a pair (j, j + 1) in one row
    row_of = np.stack([np.searchsorted(crow[h], pos, side="right") - 1 for h in range(crow.shape[0])])
    same_row = live[:, :-1] & live[:, 1:] & (row_of[:, :-1] == row_of[:, 1:])
    bad = same_row & (col[:, 1:] <= col[:, :-1])
    if bad.any():
        h, j = np.argwhere(bad)[0]
        raise ValueError(f"sparse_layout: the columns of row {int(row_of[h, j])} (head {h}) must be "
                         f"strictly increasing, got col[{h}, {j}] = {int(col[h, j])} then "
                         f"col[{h}, {j + 1}] = {int(col[h, j + 1])}")


# ---------------------------------------------------------------- lightning decode
def check_slot_range(slot_idx, num_slots: int) -> None:
    """Slot ids are -1 (padding) or in [0, num_slots). Host data is checked
    with this always (it costs no sync); see check_linear_decode."""
    ids = _int64(slot_idx)
    bad = ids[(ids < -1) | (ids >= num_slots)]
    if bad.size:
        raise ValueError(f"slot_idx: ids must be -1 or in [0, {num_slots}), got {bad[:4].tolist()}")


def check_linear_decode(host: dict, *, num_slots: int) -> None:
    """linear_decode_forward_triton: ``host`` has slot_idx [B]; ``num_slots`` is
    kv_caches.shape[0]. Ids in [-1, num_slots), and no non-negative id twice
    (two rows would update one slot at once: a race on the GPU)."""
    ids = _int64(host["slot_idx"]).reshape(-1)
    check_slot_range(ids, num_slots)
    used = ids[ids >= 0]
    uniq, counts = np.unique(used, return_counts=True)
    if (counts > 1).any():
        dup = uniq[counts > 1]
        rows = np.flatnonzero(ids == dup[0]).tolist()
        raise ValueError(f"slot_idx: duplicate slot ids {dup[:4].tolist()} (rows {rows[:4]} would "
                         "update one cache slot at once)")


def check_lightning_varlen(host: dict, *, num_tokens: int, num_slots: int) -> None:
    """lightning_attention_varlen: ``host`` has cu_seqlens [B + 1] and, with a
    cache, slot_idx [B]; ``num_tokens`` is q's T, ``num_slots`` kv_cache.shape[0].
    cu_seqlens starts at 0, never decreases and ends at T; slot ids in
    [-1, num_slots), no non-negative id twice (two sequences would write one slot)."""
    from .lightning_attention.varlen_plan import check_varlen_host_data
    cu, slots = host["cu_seqlens"], host.get("slot_idx")
    if cu.ndim != 1 or cu.size < 1 or (slots is not None and (
            num_slots == 0 or slots.shape != (cu.size - 1,))):
        return  # shapes that do not fit each other: the planner's error comes first
    check_varlen_host_data(cu, num_tokens, slots, num_slots)

"""Index-data check of blocksparse_flash_attn_varlen_fwd (the validation mode:
core_kernels._index_check)."""
from __future__ import annotations

import numpy as np

from .._index_check import as_int64, check_cumulative, first_index


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
    cu_k = as_int64(cu_k)
    bsz = cu_k.shape[0] - 1
    decode = cu_q is None and num_q_tokens == bsz
    if cu_q is None and not decode and num_q_tokens != num_k_tokens:
        return  # the planner asks for cu_seqlens_q
    if cu_q is not None:
        k_len = check_cumulative("cu_seqlens_k", cu_k, start=None, end=None, limit=num_k_tokens,
                                  what=f"k has {num_k_tokens} tokens")
        q_len = check_cumulative("cu_seqlens_q", as_int64(cu_q), start=0, end=num_q_tokens,
                                  limit=num_q_tokens, what=f"q has {num_q_tokens} tokens; output "
                                  "rows outside the sequences would never be written")
    elif decode:
        k_len = check_cumulative("cu_seqlens_k", cu_k, start=None, end=None, limit=num_k_tokens,
                                  what=f"k has {num_k_tokens} tokens")
        q_len = np.ones_like(k_len)
    else:
        k_len = check_cumulative("cu_seqlens_k", cu_k, start=0, end=num_q_tokens,
                                  limit=num_q_tokens, what=f"q and k have {num_q_tokens} tokens "
                                  "and cu_seqlens_q is None, so cu_seqlens_k places the queries too")
        q_len = k_len
    if (q_len > k_len).any():
        i = first_index(q_len > k_len)
        name = "cu_seqlens_q" if cu_q is not None else "cu_seqlens_k"
        n = int(q_len[i])
        raise ValueError(f"{name}: sequence {i} has {n} quer{'y' if n == 1 else 'ies'} but "
                         f"{int(k_len[i])} keys"
                         f"{' (decode: one query each)' if decode else ''}; q_len <= k_len is required "
                         "(queries are the last q_len positions)")
    crow, col = np.atleast_2d(as_int64(crow)), np.atleast_2d(as_int64(col))
    nb, nnz = crow.shape[1] - 1, col.shape[1]
    covered = nb * block_size
    if bsz and k_len.max() > covered:
        i = first_index(k_len > covered)
        raise ValueError(f"cu_seqlens_k: sequence {i} has {int(k_len[i])} tokens, more than the "
                         f"{covered} the layout covers ({nb} rows of {block_size})")
    if max_seqlen is not None and bsz and k_len.max() > max_seqlen:
        i = first_index(k_len > max_seqlen)
        raise ValueError(f"max_seqlen: {max_seqlen} is less than sequence {i}'s {int(k_len[i])} "
                         "tokens; the grid would leave part of it uncomputed")
    _check_layout(crow, col, nb, nnz)


def _check_layout(crow: np.ndarray, col: np.ndarray, nb: int, nnz: int) -> None:
    steps = np.diff(crow, axis=1)
    if (crow[:, 0] < 0).any():
        h = first_index(crow[:, 0] < 0)
        raise ValueError(f"sparse_layout: crow[{h}, 0] = {int(crow[h, 0])} is negative")
    if (steps < 0).any():
        h, r = np.argwhere(steps < 0)[0]
        raise ValueError(f"sparse_layout: crow must be non-decreasing, got crow[{h}, {r}] = "
                         f"{int(crow[h, r])} then crow[{h}, {r + 1}] = {int(crow[h, r + 1])}")
    if (crow[:, -1] > nnz).any():
        h = first_index(crow[:, -1] > nnz)
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

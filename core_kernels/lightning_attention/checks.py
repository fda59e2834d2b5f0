"""Index-data checks of linear_decode_forward_triton and lightning_attention_varlen
(the validation mode: core_kernels._index_check)."""
from __future__ import annotations

import numpy as np

from .._index_check import as_int64
from .varlen_plan import check_varlen_host_data


def check_slot_ids(slot_idx, num_slots: int) -> None:
    """Host-side check of slot ids already on the host (no device sync):
    every id must be -1 (padding) or in [0, num_slots). On the device an
    out-of-range id yields a NaN output row and touches no cache slot. The
    adapters run it on host data always (it costs no sync); validation also
    refuses duplicate ids (check_linear_decode)."""
    ids = as_int64(slot_idx)
    bad = ids[(ids < -1) | (ids >= num_slots)]
    if bad.size:
        raise ValueError(f"slot_idx: ids must be -1 or in [0, {num_slots}), got {bad[:4].tolist()}")


def check_linear_decode(host: dict, *, num_slots: int) -> None:
    """linear_decode_forward_triton: ``host`` has slot_idx [B]; ``num_slots`` is
    kv_caches.shape[0]. Ids in [-1, num_slots), and no non-negative id twice
    (two rows would update one slot at once: a race on the GPU)."""
    ids = as_int64(host["slot_idx"]).reshape(-1)
    check_slot_ids(ids, num_slots)
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
    cu, slots = host["cu_seqlens"], host.get("slot_idx")
    if cu.ndim != 1 or cu.size < 1 or (slots is not None and (
            num_slots == 0 or slots.shape != (cu.size - 1,))):
        return  # shapes that do not fit each other: the planner's error comes first
    check_varlen_host_data(cu, num_tokens, slots, num_slots)

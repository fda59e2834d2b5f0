"""Index-data check of reshape_and_cache_flash (the validation mode: core_kernels._index_check)."""
from __future__ import annotations

import numpy as np

from .._index_check import as_int64, first_index


def check_reshape_and_cache_flash(host: dict, *, num_blocks: int, block_size: int) -> None:
    """``host`` has slot_mapping [N]; ``num_blocks`` / ``block_size`` are the
    caches' shape[0] / shape[1]. Every slot is < num_blocks * block_size
    (negative slots are padding: they write nothing), and no slot is named twice
    (two tokens would write one cache row at once: which one lands is undefined)."""
    slots = host["slot_mapping"]
    if slots.ndim != 1:
        return  # the planner's error
    slots = as_int64(slots)
    num_slots = int(num_blocks) * int(block_size)
    past = slots >= num_slots
    if past.any():
        i = first_index(past)
        raise ValueError(f"slot_mapping: slot_mapping[{i}] = {int(slots[i])} is past the cache's "
                         f"{num_slots} slots ({num_blocks} blocks of {block_size}); negative slots "
                         "write nothing")
    used = slots[slots >= 0]
    if used.size != np.unique(used).size:
        order = np.argsort(slots, kind="stable")
        s = slots[order]
        dup = (s[1:] == s[:-1]) & (s[1:] >= 0)
        j = first_index(dup)
        a, b = sorted((int(order[j]), int(order[j + 1])))
        raise ValueError(f"slot_mapping: slot {int(s[j])} is named twice (slot_mapping[{a}] and "
                         f"slot_mapping[{b}]): two tokens would write one cache row")

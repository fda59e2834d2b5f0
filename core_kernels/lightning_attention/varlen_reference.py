"""float64 numpy reference for lightning attention over packed sequences: each
sequence is the prefill's recurrence (reference.py) from its cache slot or zero."""
import numpy as np

from .reference import lightning_attention_reference


def lightning_attention_varlen_reference(q, k, v, ed, cu_seqlens, kv_cache=None, slot_idx=None):
    """q, k [T, H, D], v [T, H, E], cu_seqlens [B + 1], kv_cache [num_slots, H, D, E]
    with slot_idx [B] (-1: start from zero, write nothing) or None.
    Returns (output [T, H, E], new kv_cache or final states [B, H, D, E]) in float64."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    cu = np.asarray(cu_seqlens).astype(np.int64)
    t, h, d = q.shape
    e = v.shape[-1]
    out = np.zeros((t, h, e))
    cache = None if kv_cache is None else np.array(kv_cache, dtype=np.float64, copy=True)
    states = np.zeros((len(cu) - 1, h, d, e))
    for b in range(len(cu) - 1):
        lo, hi = int(cu[b]), int(cu[b + 1])
        slot = -1 if cache is None else int(slot_idx[b])
        start = cache[slot][None] if slot >= 0 else None
        seq = [x[lo:hi].transpose(1, 0, 2)[None] for x in (q, k, v)]
        o, final = lightning_attention_reference(*seq, ed, kv_history=start, output_final_state_only=True)
        out[lo:hi] = o[0].transpose(1, 0, 2)
        states[b] = final[0]
        if slot >= 0:
            cache[slot] = final[0]
    return out, (states if cache is None else cache)

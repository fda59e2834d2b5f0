"""float64 numpy reference for lightning attention, written from the spec:
S_t = lambda_h S_{t-1} + k_t^T v_t, o_t = q_t S_t, lambda_h = exp(-s_h)."""
import numpy as np


def lightning_attention_reference(q, k, v, ed, block_size=256, kv_history=None,
                                  output_final_state_only=False):
    """Returns (output [B, H, N, E], kv) in float64; kv is [B, H, D, E] when
    output_final_state_only, else [B, H, NB + 1, D, E] (state before token
    i * block_size, then the final state)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, h, n, d = q.shape
    e = v.shape[-1]
    lam = np.exp(-np.asarray(ed, dtype=np.float64).reshape(h))[None, :, None, None]
    s = (np.zeros((b, h, d, e)) if kv_history is None
         else np.array(kv_history, dtype=np.float64, copy=True))
    out = np.empty((b, h, n, e))
    states = []
    for t in range(n):
        if t % block_size == 0:
            states.append(s.copy())
        s = lam * s + k[:, :, t, :, None] * v[:, :, t, None, :]
        out[:, :, t] = np.einsum("bhd,bhde->bhe", q[:, :, t], s)
    if output_final_state_only:
        return out, s
    states.append(s)
    return out, np.stack(states, axis=2)


def linear_decode_reference(q, k, v, kv_caches, slope_rate, slot_idx):
    """One decode step. Returns (output [B, H * E], new kv_caches) in float64;
    rows with slot -1 give 0 and leave the cache alone."""
    q, k, v = (np.asarray(x, dtype=np.float64)[:, :, 0] for x in (q, k, v))
    b, h, d = q.shape
    cache = np.array(kv_caches, dtype=np.float64, copy=True)
    lam = np.exp(-np.asarray(slope_rate, dtype=np.float64).reshape(h))[:, None, None]
    out = np.zeros((b, h, v.shape[-1]))
    for i, slot in enumerate(np.asarray(slot_idx)):
        if slot == -1:
            continue
        cache[slot] = lam * cache[slot] + k[i][:, :, None] * v[i][:, None, :]
        out[i] = np.einsum("hd,hde->he", q[i], cache[slot])
    return out.reshape(b, -1), cache

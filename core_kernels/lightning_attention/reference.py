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


def lightning_attention_backward_reference(q, k, v, ed, grad_output, grad_kv=None, block_size=256,
                                           kv_history=None, output_final_state_only=False):
    """float64 gradients of lightning_attention_reference, token by token.

    ``grad_output`` [B, H, N, E]; ``grad_kv``: the gradient of the returned
    states (their shape) or None. Returns (dq, dk, dv, d kv_history [B, H, D, E],
    d ed [H]). The state's adjoint G_t = dL/dS_t walks backwards:
    G_t = q_t^T dO_t + lambda G_{t+1} (+ the gradient of S_t where it is
    returned); dq_t = S_t dO_t, dk_t = G_t v_t, dv_t = k_t G_t, and the decay
    rate s = -log(lambda) collects -lambda <G_t, S_{t-1}>."""
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, grad_output))
    b, h, n, d = q.shape
    e = v.shape[-1]
    lam = np.exp(-np.asarray(ed, dtype=np.float64).reshape(h))[None, :, None, None]
    s0 = np.zeros((b, h, d, e)) if kv_history is None else np.asarray(kv_history, dtype=np.float64)
    states = [s0]  # states[t + 1] = S_t
    for t in range(n):
        states.append(lam * states[-1] + k[:, :, t, :, None] * v[:, :, t, None, :])
    gkv = None if grad_kv is None else np.asarray(grad_kv, dtype=np.float64)
    nb = -(-n // block_size)

    def returned_grad(t):  # gradient of S_t as a returned state
        if gkv is None:
            return 0.0
        if output_final_state_only:
            return gkv if t == n - 1 else 0.0
        if t == n - 1:
            return gkv[:, :, nb]
        if (t + 1) % block_size == 0:
            return gkv[:, :, (t + 1) // block_size]
        return 0.0

    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    d_log_lam = np.zeros((b, h))
    g = np.zeros((b, h, d, e))
    for t in range(n - 1, -1, -1):
        g = g + q[:, :, t, :, None] * do[:, :, t, None, :] + returned_grad(t)
        dq[:, :, t] = np.einsum("bhde,bhe->bhd", states[t + 1], do[:, :, t])
        dk[:, :, t] = np.einsum("bhde,bhe->bhd", g, v[:, :, t])
        dv[:, :, t] = np.einsum("bhd,bhde->bhe", k[:, :, t], g)
        d_log_lam += np.einsum("bhde,bhde->bh", g, lam * states[t])
        g = lam * g
    if gkv is not None and not output_final_state_only:
        g = g + gkv[:, :, 0]
    return dq, dk, dv, g, -d_log_lam.sum(axis=0)

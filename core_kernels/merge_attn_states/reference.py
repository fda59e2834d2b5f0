"""float64 numpy reference for merge_attn_states, written from the spec."""
import numpy as np


def merge_attn_states_reference(prefix_output, prefix_lse, suffix_output, suffix_lse,
                                prefill_tokens_with_context=None, output_scale=None,
                                fp8_max=448.0):
    """Returns (output float64 [N, H, D] before any fp8 cast, output_lse float64 [H, N]).

    With output_scale the returned output is clamp(value / scale) in float64;
    the caller casts it to fp8 the way the framework does.
    """
    po = np.asarray(prefix_output, dtype=np.float64)
    so = np.asarray(suffix_output, dtype=np.float64)
    p = np.asarray(prefix_lse, dtype=np.float64).T.copy()  # [N, H]
    s = np.asarray(suffix_lse, dtype=np.float64).T.copy()
    n = po.shape[0]
    n_ctx = n if prefill_tokens_with_context is None else int(prefill_tokens_with_context)
    out = so.copy()
    out_lse = s.copy()
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for t in range(min(n_ctx, n)):
            pt = np.where(p[t] == np.inf, -np.inf, p[t])
            st = np.where(s[t] == np.inf, -np.inf, s[t])
            nan = np.isnan(pt) | np.isnan(st)
            m = np.maximum(pt, st)
            both_empty = (m == -np.inf) & ~nan
            m_safe = np.where(both_empty, 0.0, m)
            wp = np.exp(pt - m_safe)
            ws = np.exp(st - m_safe)
            w = wp + ws
            wp_n = np.where(both_empty, 0.0, wp / np.where(both_empty, 1.0, w))
            ws_n = np.where(both_empty, 0.0, ws / np.where(both_empty, 1.0, w))
            # an empty part contributes nothing, even if its values are NaN
            po_t = np.where((pt == -np.inf)[:, None], 0.0, po[t])
            so_t = np.where((st == -np.inf)[:, None], 0.0, so[t])
            out[t] = po_t * wp_n[:, None] + so_t * ws_n[:, None]
            out[t][nan] = np.nan
            lse = np.log(np.where(both_empty, 1.0, w)) + m_safe
            out_lse[t] = np.where(both_empty, -np.inf, np.where(nan, np.nan, lse))
        if output_scale is not None:
            out = np.clip(out / float(output_scale), -fp8_max, fp8_max)
    return out, out_lse.T.copy()



def merge_attn_states_backward_reference(prefix_output, prefix_lse, suffix_output, suffix_lse,
                                         grad_output, grad_output_lse=None,
                                         prefill_tokens_with_context=None):
    """The gradients of merge_attn_states (output in the input dtype), float64.

    With w_p = e^p / (e^p + e^s), w_s = 1 - w_p (+inf read as -inf) and ``out``
    the forward's output, for a token t < prefill_tokens_with_context:
    d po = g * w_p, d so = g * w_s, d p = w_p * (sum_d g * (po - out) + g_lse),
    d s = w_s * (sum_d g * (so - out) + g_lse); an empty part (LSE -inf) gets
    zeros whatever its values, both empty: all zero; NaN propagates where the
    forward's is NaN. Tokens t >= it: d so = g, d s = g_lse, d po = d p = 0.
    Returns (grad_prefix_output [N, H, D], grad_prefix_lse [H, N],
    grad_suffix_output, grad_suffix_lse).
    """
    po = np.asarray(prefix_output, dtype=np.float64)
    so = np.asarray(suffix_output, dtype=np.float64)
    g = np.asarray(grad_output, dtype=np.float64)
    n, h, _ = po.shape
    g_lse = (np.zeros((n, h)) if grad_output_lse is None
             else np.asarray(grad_output_lse, dtype=np.float64).T.copy())        # [N, H]
    out, _ = merge_attn_states_reference(po, prefix_lse, so, suffix_lse, prefill_tokens_with_context)
    p = np.asarray(prefix_lse, dtype=np.float64).T                              # [N, H]
    s = np.asarray(suffix_lse, dtype=np.float64).T
    n_ctx = min(n, n if prefill_tokens_with_context is None else int(prefill_tokens_with_context))
    d_po, d_so = np.zeros_like(po), g.copy()
    d_p, d_s = np.zeros((n, h)), g_lse.copy()
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for t in range(n_ctx):
            pt = np.where(p[t] == np.inf, -np.inf, p[t])
            st = np.where(s[t] == np.inf, -np.inf, s[t])
            p_empty, s_empty = pt == -np.inf, st == -np.inf
            m = np.where(p_empty & s_empty, 0.0, np.maximum(pt, st))
            w_sum = np.exp(pt - m) + np.exp(st - m)
            w_p = np.exp(pt - m) / w_sum
            w_s = np.exp(st - m) / w_sum
            dp = w_p * ((g[t] * (po[t] - out[t])).sum(-1) + g_lse[t])
            ds = w_s * ((g[t] * (so[t] - out[t])).sum(-1) + g_lse[t])
            d_po[t] = np.where(p_empty[:, None], 0.0, g[t] * w_p[:, None])
            d_so[t] = np.where(s_empty[:, None], 0.0, g[t] * w_s[:, None])
            d_p[t] = np.where(p_empty, 0.0, dp)
            d_s[t] = np.where(s_empty, 0.0, ds)
    return d_po, d_p.T.copy(), d_so, d_s.T.copy()

def mask_empty_context_lse_reference(lse, query_start_loc, context_start_loc):
    """The LSE [H, T] (float64 copy) with -inf at every token of a request whose
    context chunk is empty; tokens of no request keep their values."""
    out = np.array(lse, dtype=np.float64, copy=True)
    qs = np.asarray(query_start_loc).astype(np.int64)
    cs = np.asarray(context_start_loc).astype(np.int64)
    for r in range(len(qs) - 1):
        if cs[r] == cs[r + 1]:
            out[:, qs[r]:min(qs[r + 1], out.shape[1])] = -np.inf
    return out

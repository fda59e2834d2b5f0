"""float64 numpy reference for context_attention_fwd, written from the spec."""
from __future__ import annotations

import numpy as np

FP8_FORMATS = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def _as_float64(x, fp8_format=None):
    """fp8 given as uint8 bits is reinterpreted, everything else converted exactly."""
    x = np.asarray(x)
    if x.dtype == np.uint8:
        import ml_dtypes
        x = x.view(getattr(ml_dtypes, fp8_format))
    return x.astype(np.float64)


def context_attention_reference(q, k, v, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, *,
                                kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0,
                                alibi_slopes=None, sliding_window=None, sm_scale=None,
                                skip_decode=False, sinks=None, output=None, causal=True,
                                interleaved_v_pack_factor=0):
    """Returns the float64 output [T, Hq, D] (before any output cast).

    ``k`` and ``v`` None: the new tokens' K/V are the cache's tokens at
    positions context_len .. seq_len - 1 (through ``b_loc``). ``causal=False``:
    every new token sees every new token of its sequence (and, with a window,
    keys t with p - t < window, so only earlier keys are cut). With
    ``interleaved_v_pack_factor = x > 0`` the memory of ``v_cache`` (shape
    [num_blocks, Hkv, D, block_size]) holds [num_blocks, Hkv, block_size // x, D, x].

    Rows of decode sequences with ``skip_decode`` (and rows of no sequence)
    keep ``output``'s values (NaN when ``output`` is None, so a test sees them).
    Only the cache blocks a query can see are gathered, so NaN elsewhere in
    the cache is ignored, as the spec requires.
    """
    fmt = None
    if kv_cache_dtype in FP8_FORMATS:  # else "auto" or a plain dtype's name
        fmt = FP8_FORMATS[kv_cache_dtype]
    elif np.asarray(k_cache).dtype.name.startswith("float8"):
        fmt = np.asarray(k_cache).dtype.name
    q64 = np.asarray(q).astype(np.float64)
    from_cache = k is None and v is None
    if not from_cache:
        k64, v64 = (np.asarray(a).astype(np.float64) for a in (k, v))
    v_cache = np.asarray(v_cache)
    if interleaved_v_pack_factor:
        xv = int(interleaved_v_pack_factor)
        nb, h_, d_, bs_ = v_cache.shape
        # the memory, read as [nb, Hkv, bs // x, D, x], back to [nb, Hkv, D, bs]
        mem = np.ascontiguousarray(v_cache).reshape(nb, h_, bs_ // xv, d_, xv)
        v_cache = mem.transpose(0, 1, 3, 2, 4).reshape(nb, h_, d_, bs_)
    kc, vc = _as_float64(k_cache, fmt), _as_float64(v_cache, fmt)
    if fmt is not None:
        kc, vc = kc * float(k_scale), vc * float(v_scale)
    t_total, hq, d = q64.shape
    hkv = kc.shape[1]
    group = hq // hkv
    block_size = kc.shape[3]
    scale = 1.0 / np.sqrt(d) if sm_scale is None else float(sm_scale)
    window = sliding_window if sliding_window is not None and sliding_window > 0 else None
    out = (np.full(q64.shape, np.nan) if output is None
           else np.asarray(output).astype(np.float64).copy())
    b_loc, b_start_loc, b_seq_len = (np.asarray(a).astype(np.int64)
                                     for a in (b_loc, b_start_loc, b_seq_len))
    for i in range(len(b_seq_len)):
        s0, s1 = int(b_start_loc[i]), int(b_start_loc[i + 1])
        qlen = s1 - s0
        ctx = int(b_seq_len[i]) - qlen
        if qlen <= 0 or (skip_decode and qlen == 1):
            continue
        p_pos = ctx + np.arange(qlen)                    # [qlen] absolute query positions
        t_pos = np.arange(ctx + qlen)                    # [ctx + qlen] key positions
        visible = t_pos[None, :] <= p_pos[:, None]
        if not causal:
            visible = np.ones_like(visible)
        if window is not None:
            visible &= (p_pos[:, None] - t_pos[None, :]) < window
        # gather only the cache tokens some query can see
        n_cached = ctx + qlen if from_cache else ctx
        seen = visible[:, :n_cached].any(axis=0)
        kc_seq = np.zeros((n_cached, hkv, d))
        vc_seq = np.zeros((n_cached, hkv, d))
        for t in np.nonzero(seen)[0]:
            blk = b_loc[i, t // block_size]
            off = t % block_size
            kc_seq[t] = kc[blk, :, :, off, :].reshape(hkv, d)   # [Hkv, D//x, x] -> [Hkv, D]
            vc_seq[t] = vc[blk, :, :, off]
        if from_cache:
            keys, vals = kc_seq, vc_seq                            # [ctx + qlen, Hkv, D]
        else:
            keys = np.concatenate([kc_seq, k64[s0:s1]], axis=0)  # [ctx + qlen, Hkv, D]
            vals = np.concatenate([vc_seq, v64[s0:s1]], axis=0)
        for h in range(hq):
            kh, vh = keys[:, h // group], vals[:, h // group]
            s = scale * (q64[s0:s1, h] @ kh.T)              # [qlen, ctx + qlen]
            if alibi_slopes is not None:
                s = s + float(alibi_slopes[h]) * (t_pos[None, :] - p_pos[:, None])
            s = np.where(visible, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            if sinks is not None:
                m = np.maximum(m, float(sinks[h]))
            e = np.exp(s - m)
            den = e.sum(axis=1, keepdims=True)
            if sinks is not None:
                den = den + np.exp(float(sinks[h]) - m)
            out[s0:s1, h] = (e @ np.where(e.any(axis=0)[:, None], vh, 0.0)) / den
    return out

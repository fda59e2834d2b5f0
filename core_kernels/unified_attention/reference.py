"""float64 numpy reference for unified_attention, written from the contract
(docs/ops/unified_attention.md), independent of the kernels and their plans."""
from __future__ import annotations

import numpy as np

FP8_NAMES = ("float8_e4m3fn", "uint8")  # an fp8 cache may come as e4m3 or as its uint8 bits


def _is_fp8(x) -> bool:
    return np.asarray(x).dtype.name in FP8_NAMES


def _values(x) -> np.ndarray:
    """The array with uint8 read as the bits of e4m3 (no copy)."""
    x = np.asarray(x)
    if x.dtype == np.uint8:
        import ml_dtypes
        x = x.view(ml_dtypes.float8_e4m3fn)
    return x


def _as_float64(x) -> np.ndarray:
    """Exact float64 values; uint8 is read as the bits of e4m3."""
    return _values(x).astype(np.float64)


def _descale(d, bsz: int, hkv: int) -> np.ndarray:
    """A descale (a 1-element array / number, or [B, Hkv]) as a [B, Hkv] float64 table."""
    d = np.asarray(d, np.float64)
    if d.size == 1:
        return np.full((bsz, hkv), float(d.reshape(-1)[0]))
    if d.shape != (bsz, hkv):
        raise ValueError(f"descale: shape {d.shape}, expected one element or {(bsz, hkv)}")
    return d


def visible_keys(qlen: int, seq_len: int, causal: bool, window_left: int = -1,
                 window_right: int = -1) -> np.ndarray:
    """[qlen, seq_len] bool: which keys j the query rows i of one sequence see.
    Query i sits at position p = seq_len - qlen + i. Causal: j <= p, and with a
    window (left >= 0) also p - j <= left. Not causal: every j < seq_len, and
    with a window |j - p| <= left (the window is symmetric, as vLLM's kernel
    makes it); ``window_right`` is ignored either way (causal: 0 in effect)."""
    p = seq_len - qlen + np.arange(qlen)[:, None]
    j = np.arange(seq_len)[None, :]
    vis = np.ones((qlen, seq_len), bool)
    if causal:
        vis &= j <= p
    if window_left >= 0:
        vis &= (p - j) <= window_left
        if not causal:
            vis &= (j - p) <= window_left
    return vis


def unified_attention_reference(q, k, v, cu_seqlens_q, seqused_k, block_table, *, softmax_scale,
                                causal=True, window_size=(-1, -1), softcap=0.0, q_descale=None,
                                k_descale=None, v_descale=None, alibi_slopes=None,
                                use_alibi_sqrt=False, sinks=None, out=None) -> np.ndarray:
    """Paged attention of packed queries over their caches; returns float64 [T, Hq, D]
    (before any output cast: an fp8 output is clamp(result / output_scale) rounded).

    q [T, Hq, D] (float, or e4m3 with ``q_descale``); k, v [num_blocks,
    block_size, Hkv, D] (q's dtype, or an e4m3 / uint8 cache dequantised with
    ``k_descale`` / ``v_descale``: one element or [B, Hkv]); cu_seqlens_q [B + 1];
    seqused_k [B] total key lengths; block_table [B, W]. ``causal``: a bool or a
    [B] array of per-sequence flags. ``window_size`` (left, right): left >= 0
    bounds how far back (and, for a non-causal sequence, forward) a query sees.

    Scores s = softmax_scale * q.k, then softcap (c * tanh(s / c)), ALiBi
    (slope * (j - context_len), or -slope * sqrt(p - j) for j <= p with
    ``use_alibi_sqrt``), then the mask; ``sinks`` [Hq] join the max and the
    denominator. Rows of no sequence keep ``out``'s values (NaN without it).
    Only the cache blocks a query can see are gathered: NaN anywhere else in
    the cache, or an out-of-range id in a table slot no query needs, is never read.
    """
    qv = _as_float64(q)
    t, hq, d = qv.shape
    cu = np.asarray(cu_seqlens_q).astype(np.int64)
    lens = np.asarray(seqused_k).astype(np.int64)
    table = np.asarray(block_table).astype(np.int64)
    bsz = len(lens)
    num_blocks, block_size, hkv, _ = np.asarray(k).shape
    group = hq // hkv
    if _is_fp8(q):
        qv = qv * float(np.asarray(q_descale, np.float64).reshape(-1)[0])
    kc, vc = _values(k), _values(v)   # converted per gathered token (a cache may be large)
    fp8_cache = _is_fp8(k)
    kd = _descale(k_descale, bsz, hkv) if fp8_cache else np.ones((bsz, hkv))
    vd = _descale(v_descale, bsz, hkv) if fp8_cache else np.ones((bsz, hkv))
    flags = np.broadcast_to(np.asarray(causal, bool), (bsz,))
    left, right = (-1, -1) if window_size is None else (int(window_size[0]), int(window_size[1]))
    scale = float(softmax_scale)
    cap = float(softcap or 0.0)
    res = np.full((t, hq, d), np.nan) if out is None else _as_float64(out).copy()
    for b in range(bsz):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        qlen, seq_len = s1 - s0, int(lens[b])
        if qlen <= 0:
            continue
        ctx = seq_len - qlen
        assert ctx >= 0, f"sequence {b}: seqused_k {seq_len} < query length {qlen}"
        vis = visible_keys(qlen, seq_len, bool(flags[b]), left, right)     # [qlen, L]
        seen = np.flatnonzero(vis.any(axis=0))
        keys = np.zeros((seq_len, hkv, d))
        vals = np.zeros((seq_len, hkv, d))
        blk, off = table[b, seen // block_size], seen % block_size
        keys[seen] = kc[blk, off].astype(np.float64) * kd[b][None, :, None]
        vals[seen] = vc[blk, off].astype(np.float64) * vd[b][None, :, None]
        qs = qv[s0:s1].reshape(qlen, hkv, group, d)
        s = scale * np.einsum("qhgd,lhd->hgql", qs, keys).reshape(hq, qlen, seq_len)
        if cap > 0:
            s = cap * np.tanh(s / cap)
        if alibi_slopes is not None:
            slopes = np.asarray(alibi_slopes, np.float64).reshape(hq, 1, 1)
            j = np.arange(seq_len)[None, :]
            if use_alibi_sqrt:
                rel = j - (ctx + np.arange(qlen)[:, None])                 # j - p
                bias = np.where(rel <= 0, -np.sqrt(np.maximum(-rel, 0)), 0.0)
            else:
                bias = np.broadcast_to(j - ctx, (qlen, seq_len)).astype(np.float64)
            s = s + slopes * bias[None]
        s = np.where(vis[None], s, -np.inf)
        m = s.max(axis=2, keepdims=True)                                   # [Hq, qlen, 1]
        if sinks is not None:
            sink = np.asarray(sinks, np.float64).reshape(hq, 1, 1)
            m = np.maximum(m, sink)
        e = np.exp(s - m)
        den = e.sum(axis=2, keepdims=True)
        if sinks is not None:
            den = den + np.exp(sink - m)
        o = np.einsum("hgql,lhd->hgqd", e.reshape(hkv, group, qlen, seq_len), vals)
        res[s0:s1] = (o.reshape(hq, qlen, d) / den).transpose(1, 0, 2)
    return res

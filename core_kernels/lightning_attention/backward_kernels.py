"""Triton kernels for the backward of lightning attention (prefill).

Forward, per (b, h) with lambda = exp(-s): S_t = lambda S_{t-1} + k_t^T v_t,
o_t = q_t S_t (S_{-1} = kv_history or 0); the returned states are S after each
block of block_size tokens (and S_{-1} first), or the final state only.

Backward, with G_t = dL/dS_t (the state's adjoint, the future included):

    G_t  = q_t^T dO_t + lambda G_{t+1} + dKV_i   (dKV_i where S_t is returned)
    dq_t = dO_t S_t^T        dk_t = v_t G_t^T     dv_t = k_t G_t
    d kv_history = lambda G_0 (+ dKV_0)

Both scans are chunked (BLOCK_T tokens; chunks laid out per state block as in
the forward, so every returned state sits at a chunk end). For a chunk of L
valid tokens r = 0..L-1 with S0 the state before it and Dst the adjoint of the
state after it (from later tokens and returned states):

    dQ = ((dO V^T) . W) K + lambda^(r+1) dO S0^T         W[r, r'] = lambda^(r-r'), r' <= r
    dK = ((V dO^T) . W^T) Q + lambda^(L-1-r) V Dst^T
    dV = ((K Q^T) . W^T) dO + lambda^(L-1-r) K Dst
    Dst <- lambda^L Dst + (lambda^(r+1) Q)^T dO          (walking backwards)
    S0  <- lambda^L S0 + (lambda^(L-1-r) K)^T V           (walking forwards)

so the cost is linear in N. Three kernels, each a program per (b, h, tile):
dQ walks forwards over a D-tile of the state (all of E); dK walks backwards
over a D-tile of the adjoint (all of E); dV walks backwards over an E-tile
(all of D). Every gradient element is written by one program, in a fixed order:
deterministic, no atomics.

The decay's gradient (a = log lambda = -s; every factor is lambda^m = e^(a m)):

    dL/da = sum_t (t+1) q_t.dq_t - sum_t (t+1) k_t.dk_t + sum_i p_i <dKV_i, KV_i>

(p_i tokens precede returned state i), from partial sums the dQ and dK
programs write; _lightning_bwd_decay_kernel adds them up per head in order.
The two sums are large and cancel (weights up to N): they accumulate in fp64,
and when the decay needs a gradient the plan runs the dQ and dK products in
exact fp32 (NOTE: with bf16 / tf32 products the decay's gradient was off by
7-16% on the H200 at N = 1000, while dq, dk, dv were within tolerance).
"""
import triton
import triton.language as tl

from .._triton_utils import jit
from .kernels import _chunk_span


@triton.jit
def _pow_decay(s, m):
    """lambda^m = exp(-s m) for m >= 0 (s clamped to 1e30: see kernels.py)."""
    return tl.exp(-s * m.to(tl.float32))


@triton.jit
def _rows(ptr, base, t0, o_r, m_r, stride_t, o_c, m_c):
    """[BLOCK_T, len(o_c)] fp32 tile of token rows t0 + o_r (masked rows read 0)."""
    p = ptr + base + (t0 + o_r).to(tl.int64)[:, None] * stride_t + o_c[None, :]
    return tl.load(p, mask=m_r[:, None] & m_c[None, :], other=0.0).to(tl.float32)


@triton.jit
def _cast(x, DOT_BF16: tl.constexpr):
    """MMA operand: bf16 for bf16 inputs, else fp32 (tf32 on the GPU unless ieee)."""
    if DOT_BF16:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _t(x, DOT_BF16: tl.constexpr):
    """The transposed MMA operand (cast first, as the forward's operands)."""
    return tl.trans(_cast(x, DOT_BF16))


@triton.jit
def _dot(a, b, acc, DOT_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a @ b with fp32 accumulation."""
    if DOT_BF16:
        return tl.dot(_cast(a, DOT_BF16), _cast(b, DOT_BF16), acc)
    else:
        return tl.dot(_cast(a, DOT_BF16), _cast(b, DOT_BF16), acc, input_precision=DOT_PRECISION)


@triton.jit
def _sequence(i_bh, num_heads, seq_len, num_chunks, cu_ptr, width,
              BLOCK_T: tl.constexpr, VARLEN: tl.constexpr):
    """(b, h, first token, tokens, chunks, gradient row base, gradient row stride)
    of program row i_bh: one (b, h) of [B, H, N, *] arrays, or with VARLEN
    sequence b of packed [T, H, *] ones (tokens cu[b] .. cu[b + 1] - 1; the
    gradients contiguous [T, H, width])."""
    i_b = (i_bh // num_heads).to(tl.int64)
    i_h = (i_bh % num_heads).to(tl.int64)
    if VARLEN:
        t_first = tl.load(cu_ptr + i_b).to(tl.int64)
        n_tok = (tl.load(cu_ptr + i_b + 1).to(tl.int64) - t_first).to(tl.int32)
        n_chunks = (n_tok + BLOCK_T - 1) // BLOCK_T
        return i_b, i_h, t_first, n_tok, n_chunks, (t_first * num_heads + i_h) * width, num_heads * width
    else:
        return (i_b, i_h, i_b * 0, seq_len + 0 * i_bh, num_chunks + 0 * i_bh,
                i_bh.to(tl.int64) * seq_len * width, width + 0 * i_bh)


@triton.jit
def _store_pair(ptr, x):
    """An fp64 value as two fp32 (hi, x - hi): the buffers stay fp32 (JAX arrays
    without x64) while the decay's partial sums keep fp64's precision."""
    hi = x.to(tl.float32)
    tl.store(ptr, hi)
    tl.store(ptr + 1, (x - hi.to(tl.float64)).to(tl.float32))


@jit
def _lightning_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, hist_ptr, decay_ptr, cu_ptr,
    num_heads, seq_len, head_k, head_v, block_len, num_chunks, stride_decay,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
    stride_hb, stride_hh, stride_hd,
    dq_ptr, part_ptr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, CHUNKS: tl.constexpr,
    HAS_HIST: tl.constexpr, DOT_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """dq for one (b, h, D-tile), walking forwards with the state rows of the tile."""
    i_d = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b, i_h, t_first, n_tok, n_chunks, dq_base, dq_row = _sequence(
        i_bh, num_heads, seq_len, num_chunks, cu_ptr, head_k, BLOCK_T, VARLEN)
    o_r = tl.arange(0, BLOCK_T)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    o_e = tl.arange(0, BLOCK_E)
    m_d = o_d < head_k
    m_e = o_e < head_v
    s = tl.minimum(tl.load(decay_ptr + i_h * stride_decay).to(tl.float32), 1e30)
    q_base = i_b * stride_qb + i_h * stride_qh + t_first * stride_qt
    k_base = i_b * stride_kb + i_h * stride_kh + t_first * stride_kt
    v_base = i_b * stride_vb + i_h * stride_vh + t_first * stride_vt
    do_base = i_b * stride_ob + i_h * stride_oh + t_first * stride_ot
    if HAS_HIST:
        p_h = hist_ptr + i_b * stride_hb + i_h * stride_hh + o_d[:, None] * stride_hd + o_e[None, :]
        b_s = tl.load(p_h, mask=m_d[:, None] & m_e[None, :], other=0.0).to(tl.float32)  # [D, E]
    else:
        b_s = tl.full([BLOCK_D, BLOCK_E], 0.0, tl.float32)
    diff = o_r[:, None] - o_r[None, :]  # r - r'
    part = tl.full([BLOCK_T, BLOCK_D], 0.0, tl.float64)
    for g in range(n_chunks):
        t0, n_valid, blk, j = _chunk_span(g, n_tok, block_len, CHUNKS, BLOCK_T)
        m_r = o_r < n_valid
        b_do = _rows(do_ptr, do_base, t0, o_r, m_r, stride_ot, o_e, m_e)  # [T, E]
        b_v = _rows(v_ptr, v_base, t0, o_r, m_r, stride_vt, o_e, m_e)     # [T, E]
        b_k = _rows(k_ptr, k_base, t0, o_r, m_r, stride_kt, o_d, m_d)     # [T, D]
        b_q = _rows(q_ptr, q_base, t0, o_r, m_r, stride_qt, o_d, m_d)     # [T, D]
        w = tl.where((diff >= 0) & m_r[:, None] & m_r[None, :], _pow_decay(s, tl.maximum(diff, 0)), 0.0)
        b_a = _dot(b_do, _t(b_v, DOT_BF16), tl.full([BLOCK_T, BLOCK_T], 0.0, tl.float32),
                   DOT_BF16, DOT_PRECISION) * w                            # [T, E] @ [E, T]
        b_dq = _dot(b_do, _t(b_s, DOT_BF16), tl.full([BLOCK_T, BLOCK_D], 0.0, tl.float32),
                    DOT_BF16, DOT_PRECISION)                               # [T, E] @ [E, D]
        b_dq = b_dq * tl.where(m_r, _pow_decay(s, o_r + 1), 0.0)[:, None]
        b_dq = _dot(b_a, b_k, b_dq, DOT_BF16, DOT_PRECISION)               # [T, T] @ [T, D]
        p_dq = dq_ptr + dq_base + (t0 + o_r).to(tl.int64)[:, None] * dq_row + o_d[None, :]
        tl.store(p_dq, b_dq.to(dq_ptr.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])
        part += (t0 + o_r + 1).to(tl.float64)[:, None] * (b_q * b_dq).to(tl.float64)
        b_kd = b_k * tl.where(m_r, _pow_decay(s, tl.maximum(n_valid - 1 - o_r, 0)), 0.0)[:, None]
        b_s = _dot(_t(b_kd, DOT_BF16), b_v, b_s * _pow_decay(s, n_valid), DOT_BF16, DOT_PRECISION)
    total = tl.reduce(tl.reduce(part, 1, tl.standard._sum_combine), 0, tl.standard._sum_combine)
    _store_pair(part_ptr + (i_bh.to(tl.int64) * tl.num_programs(0) + i_d) * 2, total)


@jit
def _lightning_bwd_dkv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, decay_ptr, kv_ptr, dkv_ptr, cu_ptr,
    num_heads, seq_len, head_k, head_v, block_len, num_chunks, num_states, stride_decay,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
    grad_ptr, dhist_ptr, part_ptr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, CHUNKS: tl.constexpr,
    FOR_DK: tl.constexpr, HAS_DKV: tl.constexpr, FINAL_ONLY: tl.constexpr, HAS_HIST: tl.constexpr,
    DOT_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
):
    """dk (FOR_DK: the adjoint's rows of one D-tile, all of E; also d kv_history
    and the decay partial) or dv (the adjoint's columns of one E-tile, all of D)
    for one (b, h), walking backwards."""
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    if FOR_DK:
        width = head_k
    else:
        width = head_v
    i_b, i_h, t_first, n_tok, n_chunks, g_base, g_row = _sequence(
        i_bh, num_heads, seq_len, num_chunks, cu_ptr, width, BLOCK_T, VARLEN)
    o_r = tl.arange(0, BLOCK_T)
    if FOR_DK:
        o_d = i_t * BLOCK_D + tl.arange(0, BLOCK_D)
        o_e = tl.arange(0, BLOCK_E)
    else:
        o_d = tl.arange(0, BLOCK_D)
        o_e = i_t * BLOCK_E + tl.arange(0, BLOCK_E)
    m_d = o_d < head_k
    m_e = o_e < head_v
    m_de = m_d[:, None] & m_e[None, :]
    s = tl.minimum(tl.load(decay_ptr + i_h * stride_decay).to(tl.float32), 1e30)
    q_base = i_b * stride_qb + i_h * stride_qh + t_first * stride_qt
    k_base = i_b * stride_kb + i_h * stride_kh + t_first * stride_kt
    v_base = i_b * stride_vb + i_h * stride_vh + t_first * stride_vt
    do_base = i_b * stride_ob + i_h * stride_oh + t_first * stride_ot
    # kv and dkv: contiguous [B, H, num_states, D, E] (num_states 1: the final state)
    st_base = i_bh.to(tl.int64) * num_states * head_k * head_v
    o_de = o_d[:, None] * head_v + o_e[None, :]
    diff = o_r[None, :] - o_r[:, None]  # r' - r
    b_g = tl.full([BLOCK_D, BLOCK_E], 0.0, tl.float32)  # the adjoint Dst of the tile
    part = tl.full([BLOCK_T, BLOCK_D], 0.0, tl.float64)
    part_kv = tl.full([BLOCK_D, BLOCK_E], 0.0, tl.float64)
    for i in range(n_chunks):
        g = n_chunks - 1 - i
        t0, n_valid, blk, j = _chunk_span(g, n_tok, block_len, CHUNKS, BLOCK_T)
        if HAS_DKV:
            # a returned state ends here: its gradient joins the adjoint
            if FINAL_ONLY:
                blk_end = n_tok + 0 * t0
                p_st = st_base + o_de
            else:
                blk_end = tl.minimum((blk + 1) * block_len, n_tok)
                p_st = st_base + (blk + 1).to(tl.int64) * head_k * head_v + o_de
            at_end = (t0 + n_valid == blk_end) & (n_valid > 0)
            b_dkv = tl.load(dkv_ptr + p_st, mask=m_de & at_end, other=0.0)
            b_g += b_dkv
            if FOR_DK:
                b_kv = tl.load(kv_ptr + p_st, mask=m_de & at_end, other=0.0)
                part_kv += blk_end.to(tl.float64) * (b_dkv * b_kv).to(tl.float64)
        m_r = o_r < n_valid
        b_q = _rows(q_ptr, q_base, t0, o_r, m_r, stride_qt, o_d, m_d)     # [T, D]
        b_k = _rows(k_ptr, k_base, t0, o_r, m_r, stride_kt, o_d, m_d)     # [T, D]
        b_v = _rows(v_ptr, v_base, t0, o_r, m_r, stride_vt, o_e, m_e)     # [T, E]
        b_do = _rows(do_ptr, do_base, t0, o_r, m_r, stride_ot, o_e, m_e)  # [T, E]
        w = tl.where((diff >= 0) & m_r[:, None] & m_r[None, :], _pow_decay(s, tl.maximum(diff, 0)), 0.0)
        tail = tl.where(m_r, _pow_decay(s, tl.maximum(n_valid - 1 - o_r, 0)), 0.0)  # lambda^(L-1-r)
        if FOR_DK:
            b_a = _dot(b_v, _t(b_do, DOT_BF16), tl.full([BLOCK_T, BLOCK_T], 0.0, tl.float32),
                       DOT_BF16, DOT_PRECISION) * w                        # [T, E] @ [E, T]
            b_grad = _dot(b_v, _t(b_g, DOT_BF16), tl.full([BLOCK_T, BLOCK_D], 0.0, tl.float32),
                          DOT_BF16, DOT_PRECISION) * tail[:, None]         # [T, E] @ [E, D]
            b_grad = _dot(b_a, b_q, b_grad, DOT_BF16, DOT_PRECISION)       # [T, T] @ [T, D]
            p_grad = grad_ptr + g_base + (t0 + o_r).to(tl.int64)[:, None] * g_row + o_d[None, :]
            tl.store(p_grad, b_grad.to(grad_ptr.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])
            part += (t0 + o_r + 1).to(tl.float64)[:, None] * (b_k * b_grad).to(tl.float64)
        else:
            b_a = _dot(b_k, _t(b_q, DOT_BF16), tl.full([BLOCK_T, BLOCK_T], 0.0, tl.float32),
                       DOT_BF16, DOT_PRECISION) * w                        # [T, D] @ [D, T]
            b_grad = _dot(b_k, b_g, tl.full([BLOCK_T, BLOCK_E], 0.0, tl.float32),
                          DOT_BF16, DOT_PRECISION) * tail[:, None]         # [T, D] @ [D, E]
            b_grad = _dot(b_a, b_do, b_grad, DOT_BF16, DOT_PRECISION)      # [T, T] @ [T, E]
            p_grad = grad_ptr + g_base + (t0 + o_r).to(tl.int64)[:, None] * g_row + o_e[None, :]
            tl.store(p_grad, b_grad.to(grad_ptr.dtype.element_ty), mask=m_r[:, None] & m_e[None, :])
        b_qd = b_q * tl.where(m_r, _pow_decay(s, o_r + 1), 0.0)[:, None]
        b_g = _dot(_t(b_qd, DOT_BF16), b_do, b_g * _pow_decay(s, n_valid), DOT_BF16, DOT_PRECISION)
    if FOR_DK:
        if HAS_HIST:
            # S_{-1} = kv_history: its adjoint is lambda G_0 (the walk's last
            # update includes that factor) plus the gradient of returned state 0
            if HAS_DKV and not FINAL_ONLY:
                b_g += tl.load(dkv_ptr + st_base + o_de, mask=m_de, other=0.0)
            p_dh = dhist_ptr + i_bh.to(tl.int64) * head_k * head_v + o_de
            tl.store(p_dh, b_g, mask=m_de)
        total = -tl.reduce(tl.reduce(part, 1, tl.standard._sum_combine), 0, tl.standard._sum_combine)
        total += tl.reduce(tl.reduce(part_kv, 1, tl.standard._sum_combine), 0, tl.standard._sum_combine)
        _store_pair(part_ptr + (i_bh.to(tl.int64) * tl.num_programs(0) + i_t) * 2, total)


@jit
def _lightning_bwd_decay_kernel(part_q_ptr, part_k_ptr, batch, num_heads, num_parts, grad_ed_ptr):
    """d ed[h] = -dL/da: the partial sums of every (b, D-tile) of head h (the dQ
    programs' and the dK programs'), in order."""
    i_h = tl.program_id(0)
    total = 0.0
    total = total.to(tl.float64)
    for b in range(batch):
        row = (b * num_heads + i_h).to(tl.int64) * num_parts * 2
        for p in range(2 * num_parts):
            total += tl.load(part_q_ptr + row + p).to(tl.float64) + tl.load(part_k_ptr + row + p).to(tl.float64)
    tl.store(grad_ed_ptr + i_h, (-total).to(tl.float32))

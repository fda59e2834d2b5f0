"""Triton kernels for the backward of lightning attention (prefill).

Forward, per (b, h) with lambda = exp(-s) = e^a: S_t = lambda S_{t-1} + k_t^T v_t,
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

so the cost is linear in N. Three launches, each a program per (b, h, tile): dQ walks forwards over a D-tile of the state (all
of E); dK walks backwards over a D-tile of the adjoint (all of E); dV walks
backwards over an E-tile (all of D). Every gradient element is written by one
program, in a fixed order: deterministic, no atomics. NOTE: the three kinds
were also tried as one launch (program index -> kind, runtime branches): on
the H200 (2026-11-24) its bf16 / fp16 gradients were wrong at odd D / E in a
pattern that changed from run to run, which the separate launches never
showed. (A chunk-parallel form, the states before and adjoints after every
chunk stored by light scans and a program per chunk and gradient, measured no
faster: 1515 vs 1516 us for the bf16 backward at B1 H64 N4096 on the H200,
2026-11-24; its chunk programs held 255 registers and up to 160 KB of shared
memory, one per SM.)

The decay's gradient (a = log lambda = -s) is the forward's tangent: with
T_t = dS_t/da = lambda T_{t-1} + lambda S_{t-1} (T_{-1} = 0),

    dL/da = sum_t <dO_t, q_t T_t> + sum_i <dKV_i, T at returned state i>

and per chunk (d/da lambda^m = m lambda^m)

    <dO_r, q_r T_r> = (r+1) lambda^(r+1) q_r.(dO S0^T)_r + lambda^(r+1) q_r.(dO T0^T)_r
                      + sum_{r'<=r} (r-r') lambda^(r-r') (q_r.k_r') (dO_r.v_r')
    T0 <- lambda^L T0 + L lambda^L S0 + ((L-1-r) lambda^(L-1-r) K)^T V

which the dQ programs carry next to the state (NEED_DECAY) and sum per
program (partials over the D-tiles; _lightning_bwd_decay_kernel adds them up
per head in order). NOTE: every term here is a term of the true derivative, so
it is as well conditioned as the result. The identity used before,
dL/da = sum (t+1)(q.dq - k.dk) + ..., subtracts two sums that grow with N: on
the H200 (2026-11-24, N = 1000 and 4097, fp32 with exact fp32 products and
fp64 sums) its result was off by 3-4% of the largest gradient.
"""
import triton
import triton.language as tl

from .._triton_utils import jit
from .prefill_kernels import _chunk_span


@triton.jit
def _pow_decay(s, m):
    """lambda^m = exp(-s m) for m >= 0 (s clamped to 1e30: see prefill_kernels.py)."""
    return tl.exp(-s * m.to(tl.float32))


@triton.jit
def _causal_decay(s, diff):
    """W = lambda^diff where diff >= 0, else 0 (rows past a chunk's end load
    zeros, so W needs no row mask). NOTE: recomputed per chunk (BLOCK_T^2
    exponentials) rather than held across the loop: registers are the scarce
    resource in these kernels."""
    return tl.where(diff >= 0, _pow_decay(s, tl.maximum(diff, 0)), 0.0)


@triton.jit
def _rows(ptr, base, t0, o_r, m_r, stride_t, o_c, m_c):
    """[BLOCK_T, len(o_c)] fp32 tile of token rows t0 + o_r (masked rows read 0).
    NOTE: kept fp32 (each product casts its operands): with the input's dtype
    kept instead, bf16 dv came out wrong on the H200 at D 20, E 12 (max error
    0.66 for values of 0.67, 2026-11-24; not isolated), while fp32 and fp16
    were right."""
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
def _zeros(M: tl.constexpr, N: tl.constexpr):
    return tl.full([M, N], 0.0, tl.float32)


@triton.jit
def _total(x):
    """The sum of a 2-D fp32 tile (tl.sum is not callable under the interpreter:
    prefill_kernels.py)."""
    return tl.reduce(tl.reduce(x, 1, tl.standard._sum_combine), 0, tl.standard._sum_combine)


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


@triton.jit
def _state_end(n_tok, block_len, head_k, head_v, t0, n_valid, blk, FINAL_ONLY: tl.constexpr):
    """(whether the chunk at t0 ends a returned state, that state's offset in the
    [num_states, D, E] states of one (b, h))."""
    if FINAL_ONLY:
        blk_end = n_tok + 0 * t0
        idx = (0 * blk).to(tl.int64)
    else:
        blk_end = tl.minimum((blk + 1) * block_len, n_tok)
        idx = (blk + 1).to(tl.int64)
    return (t0 + n_valid == blk_end) & (n_valid > 0), idx * head_k * head_v


@triton.jit
def _dq_program(q_ptr, k_ptr, v_ptr, do_ptr, hist_ptr, dkv_ptr, dq_ptr, part_ptr, part_idx,
                i_b, i_h, i_bh, i_d, n_tok, n_chunks, dq_base, dq_row, s,
                block_len, num_states, head_k, head_v,
                q_base, k_base, v_base, do_base, stride_qt, stride_kt, stride_vt, stride_ot,
                stride_hb, stride_hh, stride_hd,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                CHUNKS: tl.constexpr, HAS_HIST: tl.constexpr, HAS_DKV: tl.constexpr,
                FINAL_ONLY: tl.constexpr, NEED_DECAY: tl.constexpr, DOT_BF16: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """dq for one (b, h, D-tile), walking forwards with the state rows of the
    tile; with NEED_DECAY also the tile's part of dL/da (the tangent T)."""
    o_r = tl.arange(0, BLOCK_T)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    o_e = tl.arange(0, BLOCK_E)
    m_d = o_d < head_k
    m_e = o_e < head_v
    if HAS_HIST:
        p_h = hist_ptr + i_b * stride_hb + i_h * stride_hh + o_d[:, None] * stride_hd + o_e[None, :]
        b_s = tl.load(p_h, mask=m_d[:, None] & m_e[None, :], other=0.0).to(tl.float32)  # [D, E]
    else:
        b_s = _zeros(BLOCK_D, BLOCK_E)
    b_tan = _zeros(BLOCK_D, BLOCK_E)  # T = dS/da (NEED_DECAY)
    diff = o_r[:, None] - o_r[None, :]  # r - r'
    head = _pow_decay(s, o_r + 1)  # lambda^(r+1)
    st_base = i_bh.to(tl.int64) * num_states * head_k * head_v
    o_de = o_d[:, None] * head_v + o_e[None, :]
    total = 0.0
    total = total.to(tl.float64)
    for g in range(n_chunks):
        t0, n_valid, blk, j = _chunk_span(g, n_tok, block_len, CHUNKS, BLOCK_T)
        m_r = o_r < n_valid
        b_do = _rows(do_ptr, do_base, t0, o_r, m_r, stride_ot, o_e, m_e)  # [T, E]
        b_v = _rows(v_ptr, v_base, t0, o_r, m_r, stride_vt, o_e, m_e)     # [T, E]
        b_k = _rows(k_ptr, k_base, t0, o_r, m_r, stride_kt, o_d, m_d)     # [T, D]
        w = _causal_decay(s, diff)
        b_a = _dot(b_do, _t(b_v, DOT_BF16), _zeros(BLOCK_T, BLOCK_T), DOT_BF16, DOT_PRECISION) * w
        b_in = _dot(b_do, _t(b_s, DOT_BF16), _zeros(BLOCK_T, BLOCK_D), DOT_BF16, DOT_PRECISION)
        b_dq = _dot(b_a, b_k, b_in * head[:, None], DOT_BF16, DOT_PRECISION)  # [T, T] @ [T, D]
        p_dq = dq_ptr + dq_base + (t0 + o_r).to(tl.int64)[:, None] * dq_row + o_d[None, :]
        tl.store(p_dq, b_dq.to(dq_ptr.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])
        tail = _pow_decay(s, tl.maximum(n_valid - 1 - o_r, 0))  # lambda^(L-1-r)
        lam_l = _pow_decay(s, n_valid)
        if NEED_DECAY:
            # NOTE: the tangent's products are fp32 (tf32 unless ieee) for bf16
            # inputs too, dO V^T and dO S0^T taken again at that precision (with
            # them in bf16, tests/test_lightning_backward.py's bf16 case, which
            # checks d ed, failed on the H200 on 2026-11-24)
            b_q = _rows(q_ptr, q_base, t0, o_r, m_r, stride_qt, o_d, m_d)  # [T, D]
            if DOT_BF16:
                b_a = _dot(b_do, _t(b_v, False), _zeros(BLOCK_T, BLOCK_T), False, DOT_PRECISION) * w
                b_in = _dot(b_do, _t(b_s, False), _zeros(BLOCK_T, BLOCK_D), False, DOT_PRECISION)
            b_qk = _dot(b_q, _t(b_k, False), _zeros(BLOCK_T, BLOCK_T), False, DOT_PRECISION)
            b_it = _dot(b_do, _t(b_tan, False), _zeros(BLOCK_T, BLOCK_D), False, DOT_PRECISION)
            rw = (o_r + 1).to(tl.float32)
            part = _total(b_a * diff.to(tl.float32) * b_qk) + _total(
                b_q * (b_in * (rw * head)[:, None] + b_it * head[:, None]))
            total += part.to(tl.float64)
            b_kt = b_k * (tl.maximum(n_valid - 1 - o_r, 0).to(tl.float32) * tail)[:, None]
            b_tan = _dot(_t(b_kt, False), b_v, b_tan * lam_l + b_s * (n_valid.to(tl.float32) * lam_l),
                         False, DOT_PRECISION)
            if HAS_DKV:
                at_end, p_st = _state_end(n_tok, block_len, head_k, head_v, t0, n_valid, blk,
                                          FINAL_ONLY)
                b_dkv = tl.load(dkv_ptr + st_base + p_st + o_de, mask=m_d[:, None] & m_e[None, :] & at_end,
                                other=0.0)
                total += _total(b_dkv * b_tan).to(tl.float64)
        b_kd = b_k * tail[:, None]
        b_s = _dot(_t(b_kd, DOT_BF16), b_v, b_s * lam_l, DOT_BF16, DOT_PRECISION)
    if NEED_DECAY:
        _store_pair(part_ptr + part_idx * 2, total)


@triton.jit
def _dkv_program(q_ptr, k_ptr, v_ptr, do_ptr, dkv_ptr, grad_ptr, dhist_ptr,
                 i_bh, i_t, n_tok, n_chunks, g_base, g_row, s,
                 block_len, num_states, head_k, head_v,
                 q_base, k_base, v_base, do_base, stride_qt, stride_kt, stride_vt, stride_ot,
                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                 CHUNKS: tl.constexpr, FOR_DK: tl.constexpr, HAS_DKV: tl.constexpr,
                 FINAL_ONLY: tl.constexpr, HAS_HIST: tl.constexpr, DOT_BF16: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """dk (FOR_DK: the adjoint's rows of one D-tile, all of E; also d kv_history)
    or dv (the adjoint's columns of one E-tile, all of D) for one (b, h),
    walking backwards."""
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
    # kv and dkv: contiguous [B, H, num_states, D, E] (num_states 1: the final state)
    st_base = i_bh.to(tl.int64) * num_states * head_k * head_v
    o_de = o_d[:, None] * head_v + o_e[None, :]
    diff = o_r[None, :] - o_r[:, None]  # r' - r
    head = _pow_decay(s, o_r + 1)  # lambda^(r+1)
    b_g = _zeros(BLOCK_D, BLOCK_E)  # the adjoint Dst of the tile
    for i in range(n_chunks):
        g = n_chunks - 1 - i
        t0, n_valid, blk, j = _chunk_span(g, n_tok, block_len, CHUNKS, BLOCK_T)
        if HAS_DKV:
            # a returned state ends here: its gradient joins the adjoint
            at_end, p_st = _state_end(n_tok, block_len, head_k, head_v, t0, n_valid, blk,
                                      FINAL_ONLY)
            b_g += tl.load(dkv_ptr + st_base + p_st + o_de, mask=m_de & at_end, other=0.0)
        m_r = o_r < n_valid
        b_q = _rows(q_ptr, q_base, t0, o_r, m_r, stride_qt, o_d, m_d)     # [T, D]
        b_do = _rows(do_ptr, do_base, t0, o_r, m_r, stride_ot, o_e, m_e)  # [T, E]
        tail = _pow_decay(s, tl.maximum(n_valid - 1 - o_r, 0))  # lambda^(L-1-r)
        w = _causal_decay(s, diff)
        if FOR_DK:
            b_v = _rows(v_ptr, v_base, t0, o_r, m_r, stride_vt, o_e, m_e)     # [T, E]
            b_a = _dot(b_v, _t(b_do, DOT_BF16), _zeros(BLOCK_T, BLOCK_T), DOT_BF16, DOT_PRECISION) * w
            b_grad = _dot(b_v, _t(b_g, DOT_BF16), _zeros(BLOCK_T, BLOCK_D), DOT_BF16, DOT_PRECISION)
            b_grad = _dot(b_a, b_q, b_grad * tail[:, None], DOT_BF16, DOT_PRECISION)  # [T, T] @ [T, D]
            p_grad = grad_ptr + g_base + (t0 + o_r).to(tl.int64)[:, None] * g_row + o_d[None, :]
            tl.store(p_grad, b_grad.to(grad_ptr.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])
        else:
            b_k = _rows(k_ptr, k_base, t0, o_r, m_r, stride_kt, o_d, m_d)     # [T, D]
            b_a = _dot(b_k, _t(b_q, DOT_BF16), _zeros(BLOCK_T, BLOCK_T), DOT_BF16, DOT_PRECISION) * w
            b_grad = _dot(b_k, b_g, _zeros(BLOCK_T, BLOCK_E), DOT_BF16, DOT_PRECISION)
            b_grad = _dot(b_a, b_do, b_grad * tail[:, None], DOT_BF16, DOT_PRECISION)  # [T, T] @ [T, E]
            p_grad = grad_ptr + g_base + (t0 + o_r).to(tl.int64)[:, None] * g_row + o_e[None, :]
            tl.store(p_grad, b_grad.to(grad_ptr.dtype.element_ty), mask=m_r[:, None] & m_e[None, :])
        b_qd = b_q * head[:, None]
        b_g = _dot(_t(b_qd, DOT_BF16), b_do, b_g * _pow_decay(s, n_valid), DOT_BF16, DOT_PRECISION)
    if FOR_DK:
        if HAS_HIST:
            # S_{-1} = kv_history: its adjoint is lambda G_0 (the walk's last
            # update includes that factor) plus the gradient of returned state 0
            # (or of the final state when there are no tokens: it is S_{-1})
            if HAS_DKV:
                if FINAL_ONLY:
                    m_0 = m_de & (n_tok == 0)
                else:
                    m_0 = m_de
                b_g += tl.load(dkv_ptr + st_base + o_de, mask=m_0, other=0.0)
            p_dh = dhist_ptr + i_bh.to(tl.int64) * head_k * head_v + o_de
            tl.store(p_dh, b_g, mask=m_de)


@triton.jit
def _prologue(decay_ptr, cu_ptr, i_bh, num_heads, seq_len, num_chunks, width, stride_decay,
              stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
              stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
              BLOCK_T: tl.constexpr, VARLEN: tl.constexpr):
    """(decay rate, _sequence's values but the first token, the q / k / v / dO
    bases) of program row i_bh."""
    s = tl.minimum(tl.load(decay_ptr + (i_bh % num_heads).to(tl.int64) * stride_decay).to(tl.float32), 1e30)
    i_b, i_h, t_first, n_tok, n_chunks, g_base, g_row = _sequence(
        i_bh, num_heads, seq_len, num_chunks, cu_ptr, width, BLOCK_T, VARLEN)
    return (s, i_b, i_h, n_tok, n_chunks, g_base, g_row,
            i_b * stride_qb + i_h * stride_qh + t_first * stride_qt,
            i_b * stride_kb + i_h * stride_kh + t_first * stride_kt,
            i_b * stride_vb + i_h * stride_vh + t_first * stride_vt,
            i_b * stride_ob + i_h * stride_oh + t_first * stride_ot)


@jit
def _lightning_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, hist_ptr, decay_ptr, dkv_ptr, cu_ptr,
    num_heads, seq_len, head_k, head_v, block_len, num_chunks, num_states, stride_decay,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
    stride_hb, stride_hh, stride_hd,
    dq_ptr, part_ptr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, CHUNKS: tl.constexpr,
    HAS_HIST: tl.constexpr, HAS_DKV: tl.constexpr, FINAL_ONLY: tl.constexpr,
    NEED_DECAY: tl.constexpr, DOT_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """Program (D-tile, bh): dq (and with NEED_DECAY the decay's partial)."""
    i_p = tl.program_id(0)
    i_bh = tl.program_id(1)
    s, i_b, i_h, n_tok, n_chunks, g_base, g_row, q_base, k_base, v_base, do_base = _prologue(
        decay_ptr, cu_ptr, i_bh, num_heads, seq_len, num_chunks, head_k, stride_decay,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
        stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot, BLOCK_T, VARLEN)
    _dq_program(q_ptr, k_ptr, v_ptr, do_ptr, hist_ptr, dkv_ptr, dq_ptr, part_ptr,
                i_bh.to(tl.int64) * tl.num_programs(0) + i_p, i_b, i_h, i_bh, i_p, n_tok, n_chunks,
                g_base, g_row, s, block_len, num_states, head_k, head_v,
                q_base, k_base, v_base, do_base, stride_qt, stride_kt, stride_vt, stride_ot,
                stride_hb, stride_hh, stride_hd,
                BLOCK_T, BLOCK_D, BLOCK_E, CHUNKS, HAS_HIST, HAS_DKV, FINAL_ONLY, NEED_DECAY,
                DOT_BF16, DOT_PRECISION)


@jit
def _lightning_bwd_dkv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, decay_ptr, dkv_ptr, cu_ptr,
    num_heads, seq_len, head_k, head_v, block_len, num_chunks, num_states, stride_decay,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
    grad_ptr, dhist_ptr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, CHUNKS: tl.constexpr,
    FOR_DK: tl.constexpr, HAS_DKV: tl.constexpr, FINAL_ONLY: tl.constexpr, HAS_HIST: tl.constexpr,
    DOT_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr, VARLEN: tl.constexpr,
):
    """Program (tile, bh): dk of a D-tile and d kv_history (FOR_DK), or dv of an E-tile."""
    i_p = tl.program_id(0)
    i_bh = tl.program_id(1)
    if FOR_DK:
        width = head_k
    else:
        width = head_v
    s, i_b, i_h, n_tok, n_chunks, g_base, g_row, q_base, k_base, v_base, do_base = _prologue(
        decay_ptr, cu_ptr, i_bh, num_heads, seq_len, num_chunks, width, stride_decay,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
        stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot, BLOCK_T, VARLEN)
    _dkv_program(q_ptr, k_ptr, v_ptr, do_ptr, dkv_ptr, grad_ptr, dhist_ptr,
                 i_bh, i_p, n_tok, n_chunks, g_base, g_row, s,
                 block_len, num_states, head_k, head_v,
                 q_base, k_base, v_base, do_base, stride_qt, stride_kt, stride_vt, stride_ot,
                 BLOCK_T, BLOCK_D, BLOCK_E, CHUNKS, FOR_DK, HAS_DKV, FINAL_ONLY, HAS_HIST,
                 DOT_BF16, DOT_PRECISION)


@jit
def _lightning_bwd_decay_kernel(part_ptr, batch, num_heads, num_parts, grad_ed_ptr):
    """d ed[h] = -dL/da: the partial sums of every (b, D-tile) of head h (the dQ
    programs'), in order."""
    i_h = tl.program_id(0)
    total = 0.0
    total = total.to(tl.float64)
    for b in range(batch):
        row = (b * num_heads + i_h).to(tl.int64) * num_parts * 2
        for p in range(2 * num_parts):
            total += tl.load(part_ptr + row + p).to(tl.float64)
    tl.store(grad_ed_ptr + i_h, (-total).to(tl.float32))



@jit
def _state_map_kernel(src_ptr, decay_ptr, cu_ptr, num_heads, rows, cols, stride_decay, stride_sb, stride_sh,
                      stride_sr, dst_ptr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                      TRANSPOSE: tl.constexpr, DECAY: tl.constexpr, VARLEN: tl.constexpr):
    """The backward's per-(b, h) state maps (backward_plan._forward_passes):
    dst[b, h] = src[b, h]^T (TRANSPOSE; dst [B, H, C, R]) or lambda_h src[b, h]
    (DECAY; dst [B, H, R, C]); src [B, H, R, C] (unit innermost stride, any
    float dtype), dst contiguous float32. A program per (b, h, tile). VARLEN
    (with DECAY): b is sequence b of cu_seqlens, and an empty one is copied
    undecayed."""
    i_bh = tl.program_id(0)
    i_b = (i_bh // num_heads).to(tl.int64)
    i_h = (i_bh % num_heads).to(tl.int64)
    o_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (o_r < rows)[:, None] & (o_c < cols)[None, :]
    x = tl.load(src_ptr + i_b * stride_sb + i_h * stride_sh + o_r[:, None] * stride_sr + o_c[None, :],
                mask=m, other=0.0).to(tl.float32)
    if DECAY:
        lam = tl.exp(-tl.load(decay_ptr + i_h * stride_decay))
        if VARLEN:
            lam = tl.where(tl.load(cu_ptr + i_b + 1) > tl.load(cu_ptr + i_b), lam, 1.0)
        x = x * lam
    base = dst_ptr + i_bh.to(tl.int64) * rows * cols
    if TRANSPOSE:
        tl.store(base + o_c[None, :] * rows + o_r[:, None], x, mask=m)
    else:
        tl.store(base + o_r[:, None] * cols + o_c[None, :], x, mask=m)

"""Triton kernel for merge_attn_states (framework-free).

Rows are the flattened (token, head) pairs r = t * H + h. Each program merges
a [BLOCK_R, BLOCK_D] tile: for contiguous [N, H, D] tensors consecutive rows
are consecutive memory, so every load and store is a wide coalesced access
whatever H and D are.
"""
import triton
import triton.language as tl

from .._triton_utils import jit, round_to_fp8_grid


@triton.jit
def _row_tile(num_ctx_ptr, num_rows, num_heads, num_ctx_arg, BLOCK_R: tl.constexpr,
              BLOCK_D: tl.constexpr, HEAD_SIZE: tl.constexpr, NUM_CTX_FROM_PTR: tl.constexpr,
              HEAD_MAJOR: tl.constexpr):
    """This program's [BLOCK_R] (token, head) rows and [BLOCK_D] channels:
    (o_r, m_r, o_t, o_h, o_d, m_d, m_ctx), o_r = o_t * H + o_h the flat row,
    m_ctx the live rows that have both a prefix and a suffix part (token < the
    context count). Consecutive rows of a tile are consecutive heads of one
    token, or with HEAD_MAJOR consecutive tokens of one head (program
    i * H + h takes tokens [i * BLOCK_R, (i + 1) * BLOCK_R) of head h): the
    tile's LSEs are then one contiguous run of an [H, N] array instead of one
    4-byte access per head."""
    if HEAD_MAJOR:
        pid = tl.program_id(0)
        o_t = ((pid // num_heads) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        o_h = (pid % num_heads).to(tl.int64)
        o_r = o_t * num_heads + o_h
        m_r = o_r < num_rows
    else:
        o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        m_r = o_r < num_rows
        o_t = (o_r // num_heads).to(tl.int64)
        o_h = (o_r % num_heads).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_SIZE
    if NUM_CTX_FROM_PTR:
        num_ctx = tl.load(num_ctx_ptr).to(tl.int64)
    else:
        num_ctx = num_ctx_arg
    m_ctx = m_r & (o_t < num_ctx)
    return o_r, m_r, o_t, o_h, o_d, m_d, m_ctx


@triton.jit
def _merge_weights(p_raw, s_raw, DIVISION: tl.constexpr):
    """The two parts' normalised weights from their LSEs (+inf read as -inf: an
    empty part; an empty part's weight is exactly 0), shared by the forward and
    backward kernels: (p_empty, s_empty, both_empty, m, w_p, w_s, w_sum_safe),
    m the larger LSE (0 when both are empty), log(w_sum_safe) + m the merged LSE."""
    p = tl.where(p_raw == float("inf"), float("-inf"), p_raw)
    s = tl.where(s_raw == float("inf"), float("-inf"), s_raw)
    p_empty = p == float("-inf")
    s_empty = s == float("-inf")
    both_empty = p_empty & s_empty
    m = tl.maximum(p, s)
    m = tl.where(both_empty, 0.0, m)
    w_p = tl.exp(p - m)
    w_s = tl.exp(s - m)
    w_sum_safe = tl.where(both_empty, 1.0, w_p + w_s)
    # weights first, then multiply. DIVISION: "rn" correctly rounded (the
    # kernels'); "approx" the GPU's approximate division (within 2 ulp) and
    # "reciprocal" one correctly rounded reciprocal and two products are there
    # for benchmarks/experiments/exp_merge_small.py's probe (RESULTS.md)
    if DIVISION == "approx":
        w_p = tl.where(both_empty, 0.0, w_p / w_sum_safe)
        w_s = tl.where(both_empty, 0.0, w_s / w_sum_safe)
    elif DIVISION == "reciprocal":
        r = tl.math.div_rn(tl.full(w_sum_safe.shape, 1.0, tl.float32), w_sum_safe)
        w_p = tl.where(both_empty, 0.0, w_p * r)
        w_s = tl.where(both_empty, 0.0, w_s * r)
    else:
        w_p = tl.where(both_empty, 0.0, tl.math.div_rn(w_p, w_sum_safe))
        w_s = tl.where(both_empty, 0.0, tl.math.div_rn(w_s, w_sum_safe))
    return p_empty, s_empty, both_empty, m, w_p, w_s, w_sum_safe


@triton.jit
def _row_offsets(o_t, o_h, stride_t, stride_h, ROW_ALIGN: tl.constexpr):
    """[BLOCK_R] offsets of the rows of an [N, H, D] tensor. NOTE: the row
    strides arrive divided by ROW_ALIGN (their alignment group, see
    _triton_utils.jit), so the compiler knows each row starts 16 bytes aligned
    when they allow it; without that the JAX launch ran 8x slower (H200)."""
    return o_t * (stride_t * ROW_ALIGN) + o_h * (stride_h * ROW_ALIGN)


@triton.jit
def _row_ptrs(base_ptr, o_t, o_h, o_d, stride_t, stride_h, ROW_ALIGN: tl.constexpr):
    """[BLOCK_R, BLOCK_D] pointers to channels o_d of the rows (o_t, o_h)."""
    return base_ptr + (_row_offsets(o_t, o_h, stride_t, stride_h, ROW_ALIGN)[:, None] + o_d[None, :])


@jit
def _merge_attn_states_kernel(
    # input pointers
    prefix_out_ptr, prefix_lse_ptr, suffix_out_ptr, suffix_lse_ptr,
    num_ctx_ptr, out_scale_ptr,
    # runtime scalars
    num_rows, num_heads, num_ctx_arg,
    stride_po_t, stride_po_h, stride_so_t, stride_so_h, stride_o_t, stride_o_h,
    stride_plse_h, stride_plse_t, stride_slse_h, stride_slse_t,
    stride_olse_h, stride_olse_t,
    # output pointers
    out_ptr, out_lse_ptr,
    # constexprs
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_SIZE: tl.constexpr,
    ROW_ALIGN: tl.constexpr, EVICT: tl.constexpr, LOAD_FIRST: tl.constexpr,
    HEAD_MAJOR: tl.constexpr, NUM_CTX_FROM_PTR: tl.constexpr, HAS_OUT_LSE: tl.constexpr,
    HAS_SCALE: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT_BITS: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr, FP8_SUBNORMAL_MAGIC: tl.constexpr,
):
    o_r, m_r, o_t, o_h, o_d, m_d, m_ctx = _row_tile(num_ctx_ptr, num_rows, num_heads, num_ctx_arg,
                                                    BLOCK_R, BLOCK_D, HEAD_SIZE, NUM_CTX_FROM_PTR,
                                                    HEAD_MAJOR)
    if LOAD_FIRST:
        # the values' loads wait for no LSE (issued before them); an empty
        # part's values are zeroed below by a select, so garbage or NaN there
        # cannot leak
        p_po = _row_ptrs(prefix_out_ptr, o_t, o_h, o_d, stride_po_t, stride_po_h, ROW_ALIGN)
        p_so = _row_ptrs(suffix_out_ptr, o_t, o_h, o_d, stride_so_t, stride_so_h, ROW_ALIGN)
        b_po = tl.load(p_po, mask=m_ctx[:, None] & m_d[None, :], other=0.0,
                       eviction_policy=EVICT)                      # [BLOCK_R, BLOCK_D]
        b_so = tl.load(p_so, mask=m_r[:, None] & m_d[None, :], other=0.0,
                       eviction_policy=EVICT)                      # [BLOCK_R, BLOCK_D]

    s_raw = tl.load(suffix_lse_ptr + o_h * stride_slse_h + o_t * stride_slse_t, mask=m_r, other=0.0)
    p_raw = tl.load(prefix_lse_ptr + o_h * stride_plse_h + o_t * stride_plse_t,
                    mask=m_ctx, other=float("-inf"))
    # +inf marks an empty key set in one backend, -inf in the other; NaN in p
    # or s makes the weights NaN, which then reach output and output_lse
    p_empty, s_empty, both_empty, m, w_p, w_s, w_sum_safe = _merge_weights(p_raw, s_raw, "rn")

    if LOAD_FIRST:
        b_po = tl.where(p_empty[:, None], 0.0, b_po.to(tl.float32))
        b_so = tl.where((m_ctx & s_empty)[:, None], 0.0, b_so.to(tl.float32))
    else:
        # an empty part's values are never loaded, so garbage or NaN there cannot leak
        m_p_load = (m_ctx & ~p_empty)[:, None] & m_d[None, :]
        m_s_load = (m_r & ~(m_ctx & s_empty))[:, None] & m_d[None, :]
        # NOTE: the pointers are formed here, after the weights: formed before the
        # LSE loads (as LOAD_FIRST needs them) this form ran 23% slower at
        # 16384x32x128 bf16, 2048/2 tiles (129.6 vs 105.1 us, H200, 2026-11-25)
        p_po = _row_ptrs(prefix_out_ptr, o_t, o_h, o_d, stride_po_t, stride_po_h, ROW_ALIGN)
        p_so = _row_ptrs(suffix_out_ptr, o_t, o_h, o_d, stride_so_t, stride_so_h, ROW_ALIGN)
        b_po = tl.load(p_po, mask=m_p_load, other=0.0, eviction_policy=EVICT).to(tl.float32)
        b_so = tl.load(p_so, mask=m_s_load, other=0.0, eviction_policy=EVICT).to(tl.float32)
    # one explicit fma: both load orders round alike (left to the compiler, the
    # contraction differed between them in the last bit)
    b_merged = tl.fma(b_po, w_p[:, None], b_so * w_s[:, None])
    # tokens without context pass the suffix through bit for bit
    b_o = tl.where(m_ctx[:, None], b_merged, b_so)

    if HAS_SCALE:
        scale = tl.load(out_scale_ptr).to(tl.float32)
        b_o = tl.math.div_rn(b_o, scale)
        b_o = tl.clamp(b_o, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        b_o = round_to_fp8_grid(b_o, FP8_MANT_BITS, FP8_MIN_NORMAL, FP8_SUBNORMAL_MAGIC)
    p_o = out_ptr + _row_offsets(o_t, o_h, stride_o_t, stride_o_h, ROW_ALIGN)[:, None] + o_d[None, :]
    tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])

    if HAS_OUT_LSE:
        lse = tl.log(w_sum_safe) + m
        lse = tl.where(both_empty, float("-inf"), lse)
        lse = tl.where(m_ctx, lse, s_raw)  # no context: copied as is
        tl.store(out_lse_ptr + o_h * stride_olse_h + o_t * stride_olse_t, lse, mask=m_r)



@jit
def _merge_attn_states_bwd_kernel(
    # input pointers
    prefix_out_ptr, prefix_lse_ptr, suffix_out_ptr, suffix_lse_ptr,
    grad_out_ptr, grad_lse_ptr, num_ctx_ptr,
    # runtime scalars
    num_rows, num_heads, num_ctx_arg,
    stride_po_t, stride_po_h, stride_so_t, stride_so_h, stride_go_t, stride_go_h,
    stride_plse_h, stride_plse_t, stride_slse_h, stride_slse_t,
    stride_glse_h, stride_glse_t, stride_dlse_h,
    # output pointers
    grad_prefix_out_ptr, grad_prefix_lse_ptr, grad_suffix_out_ptr, grad_suffix_lse_ptr,
    # constexprs
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_SIZE: tl.constexpr,
    ROW_ALIGN: tl.constexpr, HEAD_MAJOR: tl.constexpr, NUM_CTX_FROM_PTR: tl.constexpr,
    HAS_GRAD_LSE: tl.constexpr,
):
    """Backward of _merge_attn_states_kernel over the same (token, head) row tiles.

    With w_p, w_s the forward's normalised weights (recomputed exactly as there):
    d po = g * w_p, d so = g * w_s, d p = w_p * (sum_d g * (po - out) + g_lse),
    d s = w_s * (sum_d g * (so - out) + g_lse). Since po - out = w_s * (po - so),
    both LSE gradients share c = w_p * w_s * sum_d g * (po - so): d p = c + w_p * g_lse,
    d s = w_s * g_lse - c (no rounded forward output is needed). An empty part gets
    exactly zero gradients; tokens without context get d so = g, d s = g_lse (copied).
    The gradients are written contiguously: [N, H, D] and [H, N].
    """
    o_r, m_r, o_t, o_h, o_d, m_d, m_ctx = _row_tile(num_ctx_ptr, num_rows, num_heads, num_ctx_arg,
                                                    BLOCK_R, BLOCK_D, HEAD_SIZE, NUM_CTX_FROM_PTR,
                                                    HEAD_MAJOR)

    # the forward's weights, computed the same way
    p_raw = tl.load(prefix_lse_ptr + o_h * stride_plse_h + o_t * stride_plse_t,
                    mask=m_ctx, other=float("-inf"))
    s_raw = tl.load(suffix_lse_ptr + o_h * stride_slse_h + o_t * stride_slse_t,
                    mask=m_ctx, other=float("-inf"))
    p_empty, s_empty, both_empty, m, w_p, w_s, w_sum_safe = _merge_weights(p_raw, s_raw, "rn")

    # an empty part's values are never loaded (NaN garbage there cannot leak)
    m_p = m_ctx & ~p_empty
    m_s = m_ctx & ~s_empty
    o_po = _row_offsets(o_t, o_h, stride_po_t, stride_po_h, ROW_ALIGN)
    o_so = _row_offsets(o_t, o_h, stride_so_t, stride_so_h, ROW_ALIGN)
    o_go = _row_offsets(o_t, o_h, stride_go_t, stride_go_h, ROW_ALIGN)
    b_po = tl.load(prefix_out_ptr + o_po[:, None] + o_d[None, :],
                   mask=m_p[:, None] & m_d[None, :], other=0.0).to(tl.float32)   # [BLOCK_R, BLOCK_D]
    b_so = tl.load(suffix_out_ptr + o_so[:, None] + o_d[None, :],
                   mask=m_s[:, None] & m_d[None, :], other=0.0).to(tl.float32)   # [BLOCK_R, BLOCK_D]
    b_g = tl.load(grad_out_ptr + o_go[:, None] + o_d[None, :],
                  mask=m_r[:, None] & m_d[None, :], other=0.0).to(tl.float32)    # [BLOCK_R, BLOCK_D]
    if HAS_GRAD_LSE:
        g_lse = tl.load(grad_lse_ptr + o_h * stride_glse_h + o_t * stride_glse_t, mask=m_r, other=0.0)
    else:
        g_lse = tl.full([BLOCK_R], 0.0, tl.float32)

    # NOTE: tl.reduce with the combine function tl.sum expands to: tl.sum is
    # itself a @triton.jit helper, which the interpreter path cannot swap (see
    # test_no_triton_kernel_calls_a_library_jit_helper)
    c = w_p * w_s * tl.reduce(b_g * (b_po - b_so), 1, tl.standard._sum_combine)   # [BLOCK_R]
    d_p = tl.where(m_p, c + w_p * g_lse, 0.0)
    d_s = tl.where(m_ctx, tl.where(s_empty, 0.0, w_s * g_lse - c), g_lse)
    b_dpo = tl.where(m_p[:, None], b_g * w_p[:, None], 0.0)
    b_dso = tl.where(m_ctx[:, None], tl.where(s_empty[:, None], 0.0, b_g * w_s[:, None]), b_g)

    m_o = m_r[:, None] & m_d[None, :]
    o_dout = o_r.to(tl.int64)[:, None] * HEAD_SIZE + o_d[None, :]   # contiguous [N, H, D]
    tl.store(grad_prefix_out_ptr + o_dout, b_dpo.to(grad_prefix_out_ptr.dtype.element_ty), mask=m_o)
    tl.store(grad_suffix_out_ptr + o_dout, b_dso.to(grad_suffix_out_ptr.dtype.element_ty), mask=m_o)
    o_dlse = o_h * stride_dlse_h + o_t                               # contiguous [H, N]
    tl.store(grad_prefix_lse_ptr + o_dlse, d_p, mask=m_r)
    tl.store(grad_suffix_lse_ptr + o_dlse, d_s, mask=m_r)

@jit
def _mask_empty_context_lse_kernel(
    # input pointers
    query_start_ptr, context_start_ptr, lse_in_ptr,
    # runtime scalars
    num_tokens, num_heads, num_reqs, search_steps, stride_lse_h, stride_lse_t,
    # output pointers
    lse_ptr,
    # constexprs
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """lse[h, t] = -inf for every token t of a request whose context chunk is
    empty (context_start[r] == context_start[r + 1]); every other entry is left
    as it is (lse_in_ptr is lse itself: read by no one, it carries the aliasing).
    Program i takes tokens [i * BLOCK_T, (i + 1) * BLOCK_T) and all heads; each
    token's request is the last r with query_start[r] <= t (binary search, so
    empty requests own no token); tokens outside [query_start[0],
    query_start[num_reqs]) belong to no request and are untouched."""
    o_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)        # [BLOCK_T] token ids
    lo = tl.full([BLOCK_T], 0, tl.int32)
    hi = tl.full([BLOCK_T], 0, tl.int32) + (num_reqs - 1)
    for _ in range(search_steps):                                   # ceil(log2(num_reqs))
        active = lo < hi
        mid = (lo + hi + 1) // 2
        start = tl.load(query_start_ptr + mid, mask=active, other=0)
        take = active & (start <= o_t)
        lo = tl.where(take, mid, lo)
        hi = tl.where(active & ~take, mid - 1, hi)
    first = tl.load(query_start_ptr)
    last = tl.load(query_start_ptr + num_reqs)
    ctx0 = tl.load(context_start_ptr + lo)
    ctx1 = tl.load(context_start_ptr + lo + 1)
    empty = (o_t >= first) & (o_t < last) & (o_t < num_tokens) & (ctx0 == ctx1)   # [BLOCK_T]
    o_tl = o_t.to(tl.int64) * stride_lse_t
    for h0 in range(0, num_heads, BLOCK_H):
        o_h = h0 + tl.arange(0, BLOCK_H)
        p = lse_ptr + o_h.to(tl.int64)[None, :] * stride_lse_h + o_tl[:, None]   # [BLOCK_T, BLOCK_H]
        tl.store(p, tl.full([BLOCK_T, BLOCK_H], float("-inf"), tl.float32),
                 mask=empty[:, None] & (o_h < num_heads)[None, :])

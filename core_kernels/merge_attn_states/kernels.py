"""Triton kernel for merge_attn_states (framework-free).

Rows are the flattened (token, head) pairs r = t * H + h. Each program merges
a [BLOCK_R, BLOCK_D] tile: for contiguous [N, H, D] tensors consecutive rows
are consecutive memory, so every load and store is a wide coalesced access
whatever H and D are.
"""
import triton.language as tl

from .._triton_utils import jit, round_to_fp8_grid


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
    ROW_ALIGN: tl.constexpr, EVICT: tl.constexpr,
    NUM_CTX_FROM_PTR: tl.constexpr, HAS_OUT_LSE: tl.constexpr,
    HAS_SCALE: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT_BITS: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr, FP8_SUBNORMAL_MAGIC: tl.constexpr,
):
    i_r = tl.program_id(0)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < num_rows
    o_t = (o_r // num_heads).to(tl.int64)
    o_h = (o_r % num_heads).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_SIZE

    if NUM_CTX_FROM_PTR:
        num_ctx = tl.load(num_ctx_ptr).to(tl.int64)
    else:
        num_ctx = num_ctx_arg
    # [BLOCK_R] rows that have both a prefix and a suffix part
    m_ctx = m_r & (o_t < num_ctx)

    s_raw = tl.load(suffix_lse_ptr + o_h * stride_slse_h + o_t * stride_slse_t, mask=m_r, other=0.0)
    p_raw = tl.load(prefix_lse_ptr + o_h * stride_plse_h + o_t * stride_plse_t,
                    mask=m_ctx, other=float("-inf"))
    # +inf marks an empty key set in one backend, -inf in the other.
    p = tl.where(p_raw == float("inf"), float("-inf"), p_raw)
    s = tl.where(s_raw == float("inf"), float("-inf"), s_raw)
    p_empty = p == float("-inf")
    s_empty = s == float("-inf")
    both_empty = p_empty & s_empty
    m = tl.maximum(p, s)
    m = tl.where(both_empty, 0.0, m)
    # NaN in p or s makes W NaN, which then reaches output and output_lse.
    w_p = tl.exp(p - m)
    w_s = tl.exp(s - m)
    w_sum = w_p + w_s
    w_sum_safe = tl.where(both_empty, 1.0, w_sum)
    # weights first, then multiply; an empty part has weight exactly 0
    w_p = tl.where(both_empty, 0.0, tl.math.div_rn(w_p, w_sum_safe))
    w_s = tl.where(both_empty, 0.0, tl.math.div_rn(w_s, w_sum_safe))

    # an empty part's values are never loaded, so garbage or NaN there cannot leak
    m_p_load = (m_ctx & ~p_empty)[:, None] & m_d[None, :]
    m_s_load = (m_r & ~(m_ctx & s_empty))[:, None] & m_d[None, :]
    # NOTE: the row strides arrive divided by ROW_ALIGN (their alignment group,
    # see _triton_utils.jit), so the compiler knows each row starts 16 bytes
    # aligned when they allow it; without that the JAX launch ran 8x slower (H200).
    o_po = o_t * (stride_po_t * ROW_ALIGN) + o_h * (stride_po_h * ROW_ALIGN)
    o_so = o_t * (stride_so_t * ROW_ALIGN) + o_h * (stride_so_h * ROW_ALIGN)
    o_o = o_t * (stride_o_t * ROW_ALIGN) + o_h * (stride_o_h * ROW_ALIGN)
    p_po = prefix_out_ptr + o_po[:, None] + o_d[None, :]
    p_so = suffix_out_ptr + o_so[:, None] + o_d[None, :]
    b_po = tl.load(p_po, mask=m_p_load, other=0.0, eviction_policy=EVICT).to(tl.float32)  # [BLOCK_R, BLOCK_D]
    b_so = tl.load(p_so, mask=m_s_load, other=0.0, eviction_policy=EVICT).to(tl.float32)  # [BLOCK_R, BLOCK_D]
    b_merged = b_po * w_p[:, None] + b_so * w_s[:, None]
    # tokens without context pass the suffix through bit for bit
    b_o = tl.where(m_ctx[:, None], b_merged, b_so)

    if HAS_SCALE:
        scale = tl.load(out_scale_ptr).to(tl.float32)
        b_o = tl.math.div_rn(b_o, scale)
        b_o = tl.clamp(b_o, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        b_o = round_to_fp8_grid(b_o, FP8_MANT_BITS, FP8_MIN_NORMAL, FP8_SUBNORMAL_MAGIC)
    p_o = out_ptr + o_o[:, None] + o_d[None, :]
    tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])

    if HAS_OUT_LSE:
        lse = tl.log(w_sum_safe) + m
        lse = tl.where(both_empty, float("-inf"), lse)
        lse = tl.where(m_ctx, lse, s_raw)  # no context: copied as is
        tl.store(out_lse_ptr + o_h * stride_olse_h + o_t * stride_olse_t, lse, mask=m_r)


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

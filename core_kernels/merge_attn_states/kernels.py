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

"""The lightning attention decode kernel: one token per sequence against its
cached [D, E] state (planner: decode_plan.py)."""
import triton.language as tl

from .._triton_utils import jit


@jit
def _lightning_decode_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, cache_in_ptr, decay_ptr, slot_ptr,
    # runtime scalars
    num_heads, num_slots, head_k, head_v, stride_decay,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_cs, stride_ch, stride_cd, stride_ce, stride_ob, stride_oh,
    # output pointers
    out_ptr, cache_ptr,
    # constexprs
    BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_D: tl.constexpr, EVEN_E: tl.constexpr,
    ALIGN: tl.constexpr, OFFS_64: tl.constexpr,
):
    """One decode step for (row b, head h, E-tile): S = lambda S + k^T v in the
    cache slot, o = q S. Slot -1: output 0, no cache access; a slot outside
    [-1, num_slots): output NaN, no cache access (masked, no branches)."""
    # strides arrive divided by their alignment group ALIGN (see the prefill kernel)
    stride_qb, stride_qh, stride_kb, stride_kh = (stride_qb * ALIGN, stride_qh * ALIGN,
                                                  stride_kb * ALIGN, stride_kh * ALIGN)
    stride_vb, stride_vh, stride_ob, stride_oh = (stride_vb * ALIGN, stride_vh * ALIGN,
                                                  stride_ob * ALIGN, stride_oh * ALIGN)
    stride_cs, stride_ch, stride_cd = stride_cs * ALIGN, stride_ch * ALIGN, stride_cd * ALIGN
    i_e = tl.program_id(0)
    o_d = tl.arange(0, BLOCK_D)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    # EVEN_*: all-true masks, dropped so that loads and stores stay vectorized
    m_d = (o_d < head_k) | EVEN_D
    m_e = (o_e < head_v) | EVEN_E
    # within one slot's [D, E] matrix: int32 offsets (the plan checks that they
    # fit), which keeps the per-element address math out of 64-bit registers
    if OFFS_64:
        offs = o_d.to(tl.int64)[:, None] * stride_cd + o_e.to(tl.int64)[None, :] * stride_ce
    else:
        offs = o_d[:, None] * stride_cd + o_e[None, :] * stride_ce
    i_bh = tl.program_id(1)
    i_b = (i_bh // num_heads).to(tl.int64)
    i_h = (i_bh % num_heads).to(tl.int64)
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    s = tl.load(decay_ptr + i_h * stride_decay).to(tl.float32)
    b_q = tl.load(q_ptr + i_b * stride_qb + i_h * stride_qh + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_k = tl.load(k_ptr + i_b * stride_kb + i_h * stride_kh + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_v = tl.load(v_ptr + i_b * stride_vb + i_h * stride_vh + o_e, mask=m_e, other=0.0).to(tl.float32)
    base = tl.where(valid, slot, 0) * stride_cs + i_h * stride_ch  # int64
    m = m_d[:, None] & m_e[None, :] & valid
    b_s = tl.load(cache_in_ptr + base + offs, mask=m, other=0.0).to(tl.float32)  # [D, E]
    b_s = b_s * tl.exp(-s) + b_k[:, None] * b_v[None, :]
    # a bf16/fp16 cache (vLLM's MiniMax layer keeps the state in the model dtype)
    # stores the new state rounded; the output uses it unrounded
    tl.store(cache_ptr + base + offs, b_s.to(cache_ptr.dtype.element_ty), mask=m)
    b_o = tl.reduce(b_q[:, None] * b_s, 0, tl.standard._sum_combine)                          # [E]
    b_o = tl.where(valid, b_o, tl.where(slot == -1, 0.0, float("nan")))
    tl.store(out_ptr + i_b * stride_ob + i_h * stride_oh + o_e, b_o.to(out_ptr.dtype.element_ty),
             mask=m_e)

"""Triton kernel of reshape_and_cache_flash (framework-free): the new tokens'
key / value rows scattered into a paged KV cache in vLLM's flash layout
[num_blocks, block_size, Hkv, D], stored as is or quantised to fp8.

Program (i, j) takes BLOCK_T tokens and BLOCK_H kv heads: a [BLOCK_T, BLOCK_H,
BLOCK_D] tile of each of key and value, read once and written once, so every
access is a run of D contiguous elements (16-byte vectors where the strides'
alignment groups allow).
"""
import triton
import triton.language as tl

from .._triton_utils import jit, round_to_fp8_grid


@triton.jit
def _quantize(b_x, scale_ptr, FP8_E5M2: tl.constexpr, STORE_BITS: tl.constexpr, SOFT_ROUND: tl.constexpr,
              FP8_MAX: tl.constexpr, FP8_MANT_BITS: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
              FP8_SUBNORMAL_MAGIC: tl.constexpr):
    """A tile of key or value rows as an fp8 cache stores them: x / scale in
    fp32 (correctly rounded), saturated to the format's largest finite value,
    rounded to the nearest fp8 value, ties to even, NaN as the code 0x7F (a NaN
    of both formats); with STORE_BITS its bits as uint8 (a uint8 cache).

    SOFT_ROUND (the interpreter): clamp, round with round_to_fp8_grid and mark NaN
    in software, because Triton 3.6's interpreter converts fp32 -> fp8 wrongly
    (a carry into the exponent: see round_to_fp8_grid; and NaN to a finite value,
    384 in e4m3, seen on CPU). Without it (the GPU) the conversion alone does all
    three: sm_90's cvt.rn.satfinite rounds to nearest even, saturates and gives
    0x7F for NaN, bit for bit the software result (the GPU tests compare both
    with the reference). NOTE: H200, bf16 8192 x 8 x 128 into an e4m3 cache
    (benchmarks/bench_reshape_and_cache_flash.py, 2026-11-27): with the software
    rounding 29.7 us (do_bench; 26.5 us in a CUDA graph) at c30d599, with the
    conversion alone 19.2 us (15.7 us) at da6a48b; in one sweep of the later run,
    2 tokens x 4 warps took 28.5 us with the software rounding and 20.4 us without
    (that sweep's fp8 rows were noisy: 21-40 us across tilings). With the software
    rounding the kernel was issue-bound: slower than the bf16 cache's 22.3 us, which
    moves a third more bytes."""
    scale = tl.load(scale_ptr).to(tl.float32)
    b_y = tl.math.div_rn(b_x.to(tl.float32), scale)
    if SOFT_ROUND:
        b_y = tl.clamp(b_y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        b_y = round_to_fp8_grid(b_y, FP8_MANT_BITS, FP8_MIN_NORMAL, FP8_SUBNORMAL_MAGIC)
    if FP8_E5M2:
        b_q = b_y.to(tl.float8e5)
    else:
        b_q = b_y.to(tl.float8e4nv)
    b_bits = b_q.to(tl.uint8, bitcast=True)
    if SOFT_ROUND:
        b_bits = tl.where(b_y != b_y, 0x7F, b_bits.to(tl.int32)).to(tl.uint8)
    if not STORE_BITS:
        b_bits = b_bits.to(b_q.dtype, bitcast=True)
    return b_bits


@jit
def _reshape_and_cache_flash_kernel(
    # input pointers
    key_ptr, value_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    key_cache_in_ptr, value_cache_in_ptr,
    # runtime scalars
    num_tokens, num_slots,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_vc_b, stride_vc_s, stride_vc_h,
    # output pointers
    key_cache_ptr, value_cache_ptr,
    # constexprs
    BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    SRC_ALIGN: tl.constexpr, DST_ALIGN: tl.constexpr,
    EARLY_LOADS: tl.constexpr, FP8: tl.constexpr, FP8_E5M2: tl.constexpr, STORE_BITS: tl.constexpr,
    SOFT_ROUND: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT_BITS: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUBNORMAL_MAGIC: tl.constexpr,
):
    """key_cache[s // BLOCK_SIZE, s % BLOCK_SIZE, h, :] = key[t, h, :] (value
    alike) for s = slot_mapping[t], only where 0 <= s < num_slots: a negative
    slot (padding) writes nothing, and so does a slot past the cache (an index
    error that validate_indices reports; the kernel never writes outside the
    cache). key_cache_in_ptr / value_cache_in_ptr are the caches themselves,
    never read: they carry the in-place update (jax-triton aliases an output to
    an input). The strides arrive divided by their alignment group's constexpr
    (SRC_ALIGN: key and value; DST_ALIGN: the caches; see _triton_utils.jit).
    EARLY_LOADS: the key / value rows are loaded whatever the slot (a padding
    token's row is read for nothing), so those loads need not wait for the slot's.
    NOTE: H200, 2026-11-27 at da6a48b, 8192 x 8 x 128 bf16: 22.1 us with early loads
    against 25.1 us waiting for the slots (one sweep; the main rows of two runs,
    22.3 us before and 22.6 us after, are within noise of each other)."""
    o_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)     # [BLOCK_T] tokens
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)                   # [BLOCK_H] kv heads
    o_d = tl.arange(0, BLOCK_D)                                                # [BLOCK_D] channels
    m_row = o_t < num_tokens
    slot = tl.load(slot_mapping_ptr + o_t, mask=m_row, other=-1).to(tl.int64)  # [BLOCK_T]
    m_t = m_row & (slot >= 0) & (slot < num_slots)
    i_b = slot // BLOCK_SIZE                                                   # cache block
    i_s = slot % BLOCK_SIZE                                                    # position in it
    m_hd = (o_h < NUM_HEADS)[None, :, None] & (o_d < HEAD_SIZE)[None, None, :]
    m = m_t[:, None, None] & m_hd                                              # rows written
    if EARLY_LOADS:
        m_ld = m_row[:, None, None] & m_hd
    else:
        m_ld = m

    o_k = o_t[:, None, None] * (stride_k_t * SRC_ALIGN) + o_h[None, :, None] * (stride_k_h * SRC_ALIGN) \
        + o_d[None, None, :]
    o_v = o_t[:, None, None] * (stride_v_t * SRC_ALIGN) + o_h[None, :, None] * (stride_v_h * SRC_ALIGN) \
        + o_d[None, None, :]
    b_k = tl.load(key_ptr + o_k, mask=m_ld, other=0.0)                         # [BLOCK_T, BLOCK_H, BLOCK_D]
    b_v = tl.load(value_ptr + o_v, mask=m_ld, other=0.0)

    o_kc = (i_b * (stride_kc_b * DST_ALIGN) + i_s * (stride_kc_s * DST_ALIGN))[:, None, None] \
        + o_h[None, :, None] * (stride_kc_h * DST_ALIGN) + o_d[None, None, :]
    o_vc = (i_b * (stride_vc_b * DST_ALIGN) + i_s * (stride_vc_s * DST_ALIGN))[:, None, None] \
        + o_h[None, :, None] * (stride_vc_h * DST_ALIGN) + o_d[None, None, :]
    if FP8:
        b_k = _quantize(b_k, k_scale_ptr, FP8_E5M2, STORE_BITS, SOFT_ROUND, FP8_MAX, FP8_MANT_BITS,
                        FP8_MIN_NORMAL, FP8_SUBNORMAL_MAGIC)
        b_v = _quantize(b_v, v_scale_ptr, FP8_E5M2, STORE_BITS, SOFT_ROUND, FP8_MAX, FP8_MANT_BITS,
                        FP8_MIN_NORMAL, FP8_SUBNORMAL_MAGIC)
    tl.store(key_cache_ptr + o_kc, b_k.to(key_cache_ptr.dtype.element_ty), mask=m)
    tl.store(value_cache_ptr + o_vc, b_v.to(value_cache_ptr.dtype.element_ty), mask=m)

"""Validation and launch plans for lightning attention prefill and decode (framework-free)."""
from __future__ import annotations

import numpy as np

from .._plan import (FLOAT_DTYPES, INT_DTYPES, ArrayInfo, Buffer, Launch, Plan, Scalar, cdiv,
                     check_dtype, check_inner_contiguous, check_ndim, check_shape, memoize,
                     next_pow2)
from .kernels import (_lightning_decode_kernel, _lightning_prefill_kernel,
                      _lightning_segment_scan_kernel, _lightning_segment_state_kernel)

MAX_HEAD_SIZE = 256
DOT_PRECISIONS = ("tf32", "tf32x3", "ieee")
# NOTE: fp32 (and fp16) inputs multiply in tf32 on the GPU (Triton's default).
# The op is memory-bound only if the four dots per chunk run on the tensor
# cores: ieee fp32 runs them on the CUDA cores (~67 TFLOP/s, about 3x the byte
# floor's time at H=64, D=E=128) and tf32x3 costs 3x the MMAs. tf32 rounds each
# operand to 10 mantissa bits (~5e-4 relative per product); the state itself
# is always accumulated in fp32, so the error does not grow with N (measured
# ~1e-3 of the output's RMS at N=4096 on the H200). The kernel this op is
# modelled on also multiplies in tf32. Pass dot_precision="ieee" to the
# planner for exact-fp32 products. The interpreter (CPU) is always exact fp32.
DEFAULT_DOT_PRECISION = "tf32"
# NOTE: one program per (b, h, 64-wide E-tile) keeps a [D, 64] fp32 state in
# registers (64 regs/thread at 4 warps for D=128); 64-token chunks feed the MMAs
# with M=N=64 tiles. B=1, H=64 gives 128 programs, ~one per SM of the H200.
BLOCK_T = 64
BLOCK_E = 64
# Below this many (b, h, E-tile) programs the sequence is cut into segments
# so that about SEGMENT_TARGET programs run: that costs one more read of k and v
# (the segment-state pass), worth it only when most SMs would otherwise idle.
MIN_PROGRAMS = 128
SEGMENT_TARGET = 256
MIN_SEGMENT_CHUNKS = 4


def _check_decay(name, info, h):
    if tuple(info.shape) not in ((h,), (h, 1, 1)):
        raise ValueError(f"{name}: expected shape ({h},) or ({h}, 1, 1), got {tuple(info.shape)}")
    check_dtype(name, info, ("float32",))


def _check_head(name, size):
    if not 1 <= size <= MAX_HEAD_SIZE:
        raise ValueError(f"{name}: head size {size} is not in [1, {MAX_HEAD_SIZE}]")


def prefill_state_shape(b, h, n, d, e, block_size, output_final_state_only):
    """Shape of the returned kv: [B, H, D, E] or [B, H, NB + 1, D, E]."""
    if output_final_state_only:
        return (b, h, d, e)
    return (b, h, cdiv(n, block_size) + 1, d, e)


@memoize
def plan_lightning_attention(
    q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, ed: ArrayInfo, kv_history: ArrayInfo | None = None,
    *, block_size: int = 256, output_final_state_only: bool = False,
    block_t: int | None = None, block_e: int | None = None, num_segments: int | None = None,
    num_warps: int = 4, num_stages: int = 2, dot_precision: str = DEFAULT_DOT_PRECISION,
) -> Plan:
    """Plan lightning-attention prefill.

    Arrays: q, k [B, H, N, D], v [B, H, N, E] (one float dtype, innermost dim
    contiguous), ed [H] or [H, 1, 1] fp32, kv_history [B, H, D, E] fp32 or None
    (read only). Results: "output" [B, H, N, E] (q dtype) and "kv": the final
    state [B, H, D, E] when output_final_state_only, else [B, H, NB + 1, D, E]
    with kv[:, :, i] the state before token i * block_size.
    block_t / block_e / num_segments / num_warps / num_stages / dot_precision
    override the tuning (benchmarks and tests).
    """
    check_ndim("q", q, 4, "[B, H, N, D]")
    check_dtype("q", q, FLOAT_DTYPES)
    b, h, n, d = q.shape
    check_shape("k", k, (b, h, n, d), "same as q")
    check_ndim("v", v, 4, "[B, H, N, E]")
    check_shape("v", v, (b, h, n, v.shape[3]), "[B, H, N, E] with q's B, H, N")
    e = v.shape[3]
    for name, info in (("k", k), ("v", v)):
        if info.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {info.dtype} differs from q's {q.dtype}")
    _check_decay("ed", ed, h)
    _check_head("q", d)
    _check_head("v", e)
    if kv_history is not None:
        check_shape("kv_history", kv_history, (b, h, d, e), "[B, H, D, E]")
        check_dtype("kv_history", kv_history, ("float32",))
        check_inner_contiguous("kv_history", kv_history)
    for name, info in (("q", q), ("k", k), ("v", v)):
        check_inner_contiguous(name, info)
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    if n < 1:
        raise ValueError(f"q: the sequence length N must be >= 1, got shape {tuple(q.shape)}")
    if dot_precision not in DOT_PRECISIONS:
        raise ValueError(f"dot_precision: expected one of {DOT_PRECISIONS}, got {dot_precision!r}")
    block_size = int(block_size)

    kv_shape = prefill_state_shape(b, h, n, d, e, block_size, output_final_state_only)
    buffers = {"output": Buffer((b, h, n, e), q.dtype), "kv": Buffer(kv_shape, "float32")}
    results = ("output", "kv")
    if b == 0 or h == 0:
        return Plan(buffers, (), results)

    block_d = max(16, next_pow2(d))
    block_e = block_e or min(BLOCK_E if block_d <= 128 else 32, max(16, next_pow2(e)))
    block_t = block_t or (BLOCK_T if block_d <= 128 else 32)
    if output_final_state_only:  # block_size is irrelevant: one chunk per "block"
        block_len, chunks = block_t, 1
    else:
        block_t = min(block_t, max(16, next_pow2(block_size)))
        block_len, chunks = block_size, cdiv(block_size, block_t)
    num_blocks = cdiv(n, block_len)
    tail = n - (num_blocks - 1) * block_len
    num_chunks = (num_blocks - 1) * chunks + cdiv(tail, block_t)
    n_e = cdiv(e, block_e)

    programs = b * h * n_e
    if num_segments is None:
        num_segments = 1
        if programs < MIN_PROGRAMS:
            max_segments = max(1, num_chunks // MIN_SEGMENT_CHUNKS)
            num_segments = min(cdiv(SEGMENT_TARGET, programs), max_segments, num_blocks)
    blocks_per_seg = cdiv(num_blocks, max(1, min(int(num_segments), num_blocks)))
    num_segments = cdiv(num_blocks, blocks_per_seg)

    has_hist = kv_history is not None
    hist = "kv_history" if has_hist else "ed"  # dummy pointer when absent
    hist_strides = kv_history.strides[:3] if has_hist else (0, 0, 0)
    decay_stride = Scalar(ed.strides[0])
    common = dict(BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_E=block_e, CHUNKS=chunks,
                  DOT_BF16=q.dtype == "bfloat16", DOT_PRECISION=dot_precision)
    geometry = (Scalar(h), Scalar(n), Scalar(d), Scalar(e), Scalar(block_len), Scalar(num_blocks),
                Scalar(num_chunks), Scalar(blocks_per_seg), decay_stride)
    launches = []
    seg = "q"  # dummy pointer when there are no segments
    seg_strides = (0, 0, 0, 0)
    if num_segments > 1:
        seg = "seg_state"
        buffers[seg] = Buffer((b, h, num_segments, d, e), "float32")
        seg_strides = ArrayInfo.contiguous((b, h, num_segments, d, e), "float32").strides[:4]
        launches.append(Launch(
            _lightning_segment_state_kernel, (n_e, num_segments - 1, b * h),
            ("k", "v", "ed", *geometry, *(Scalar(x) for x in k.strides[:3] + v.strides[:3]),
             *(Scalar(x) for x in seg_strides)),
            (seg,), common, num_warps=num_warps, num_stages=num_stages))
        launches.append(Launch(
            _lightning_segment_scan_kernel, (n_e, b * h),
            (seg, "ed", hist, Scalar(h), Scalar(d), Scalar(e), Scalar(num_segments),
             Scalar(blocks_per_seg * block_len), decay_stride,
             *(Scalar(x) for x in hist_strides), *(Scalar(x) for x in seg_strides)),
            (seg,), dict(BLOCK_D=block_d, BLOCK_E=block_e, HAS_HISTORY=has_hist), num_warps=4,
            num_stages=1))
    out_strides = ArrayInfo.contiguous((b, h, n, e), q.dtype).strides[:3]
    kv_strides = ArrayInfo.contiguous(kv_shape, "float32").strides
    kv_strides = kv_strides[:2] + (0, kv_strides[2]) if output_final_state_only else kv_strides[:4]
    launches.append(Launch(
        _lightning_prefill_kernel, (n_e, num_segments, b * h),
        ("q", "k", "v", "ed", hist, seg, *geometry,
         *(Scalar(x) for x in q.strides[:3] + k.strides[:3] + v.strides[:3] + out_strides
           + hist_strides + seg_strides + kv_strides)),
        ("output", "kv"),
        dict(common, HAS_HISTORY=has_hist, FROM_SEGMENTS=num_segments > 1,
             STORE_BLOCK_STATES=not output_final_state_only),
        num_warps=num_warps, num_stages=num_stages))
    return Plan(buffers, tuple(launches), results)


@memoize
def plan_linear_decode(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, kv_caches: ArrayInfo,
                       slope_rate: ArrayInfo, slot_idx: ArrayInfo, *, block_e: int | None = None,
                       num_warps: int = 4) -> Plan:
    """Plan one lightning-attention decode step.

    Arrays: q, k [B, H, 1, D], v [B, H, 1, E] (one float dtype, innermost dim
    contiguous, other strides free), kv_caches [num_slots, H, D, E] fp32 (any
    strides; updated in place: it is both an argument and a result),
    slope_rate [H] or [H, 1, 1] fp32, slot_idx [B] int32/int64 (-1 = padding).
    Results: "output" [B, H * E] (q dtype) and "kv_caches".
    """
    check_ndim("q", q, 4, "[B, H, 1, D]")
    check_dtype("q", q, FLOAT_DTYPES)
    b, h, one, d = q.shape
    if one != 1:
        raise ValueError(f"q: expected one token per row [B, H, 1, D], got shape {tuple(q.shape)}")
    check_shape("k", k, (b, h, 1, d), "same as q")
    check_ndim("v", v, 4, "[B, H, 1, E]")
    e = v.shape[3]
    check_shape("v", v, (b, h, 1, e), "[B, H, 1, E] with q's B, H")
    for name, info in (("k", k), ("v", v)):
        if info.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {info.dtype} differs from q's {q.dtype}")
        check_inner_contiguous(name, info)
    check_inner_contiguous("q", q)
    _check_head("q", d)
    _check_head("v", e)
    check_ndim("kv_caches", kv_caches, 4, "[num_slots, H, D, E]")
    check_shape("kv_caches", kv_caches, (kv_caches.shape[0], h, d, e), "[num_slots, H, D, E]")
    check_dtype("kv_caches", kv_caches, ("float32",))
    _check_decay("slope_rate", slope_rate, h)
    check_shape("slot_idx", slot_idx, (b,), "[B]")
    check_dtype("slot_idx", slot_idx, INT_DTYPES)

    buffers = {"output": Buffer((b, h * e), q.dtype)}
    results = ("output", "kv_caches")
    if b == 0 or h == 0:
        return Plan(buffers, (), results)
    block_d = max(16, next_pow2(d))
    # NOTE: default tile chosen by benchmarks/bench_lightning_attention.py's sweep.
    block_e = block_e or min(DECODE_BLOCK_E, max(16, next_pow2(e)))
    launch = Launch(
        _lightning_decode_kernel, (cdiv(e, block_e), b * h),
        ("q", "k", "v", "kv_caches", "slope_rate", "slot_idx",
         Scalar(h), Scalar(kv_caches.shape[0]), Scalar(d), Scalar(e), Scalar(slope_rate.strides[0]),
         *(Scalar(x) for x in q.strides[:2] + k.strides[:2] + v.strides[:2] + kv_caches.strides)),
        ("output", "kv_caches"), dict(BLOCK_D=block_d, BLOCK_E=block_e),
        num_warps=num_warps, num_stages=1)
    return Plan(buffers, (launch,), results)


DECODE_BLOCK_E = 64


def check_slot_ids(slot_idx: np.ndarray, num_slots: int) -> None:
    """Host-side check of slot ids already on the host (no device sync):
    every id must be -1 (padding) or in [0, num_slots). On the device an
    out-of-range id yields a NaN output row and touches no cache slot."""
    ids = np.asarray(slot_idx)
    bad = ids[(ids < -1) | (ids >= num_slots)]
    if bad.size:
        raise ValueError(f"slot_idx: ids must be -1 or in [0, {num_slots}), got {bad[:4].tolist()}")

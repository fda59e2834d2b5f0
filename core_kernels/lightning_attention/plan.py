"""Validation and launch plans for lightning attention prefill and decode (framework-free)."""
from __future__ import annotations

import numpy as np

from .._plan import (FLOAT_DTYPES, INT_DTYPES, ArrayInfo, Buffer, Launch, Plan, Scalar, cdiv,
                     check_dtype, check_inner_contiguous, check_ndim, check_shape,
                     interpret_requested, memoize, next_pow2)
from .kernels import _lightning_decode_kernel, _lightning_prefill_kernel

MAX_HEAD_SIZE = 256
DOT_PRECISIONS = ("tf32", "tf32x3", "ieee")
# NOTE: fp32 (and fp16) inputs multiply in tf32 on the GPU (Triton's default).
# Measured on the H200 (B=1, H=64, N=4096, D=E=128, fp32): tf32 550-606 us,
# tf32x3 ~4.0 ms, ieee ~21.5 ms (fp32 on the CUDA cores), so only tf32 can get
# near the byte floor; the kernel this op is modelled on also multiplies in
# tf32. The state is always accumulated in fp32. (At H=64, N=1500 the no-decay
# head's outputs dwarf the others', so an error measured against the global RMS
# reached 2.7-5.4% there: tf32 rounding of the large head; per head the relative
# error is ~4e-4, see tests/test_lightning_attention.check_relative.)
# Pass dot_precision="ieee" to the planner for exact-fp32 products. The
# interpreter (CPU) is always exact fp32. In kernels.py, with "tf32" and whole
# tiles, the state product k^T v is computed from bf16 hi/lo pairs instead (three
# bf16 MMAs, ~16 significant bits: more precise than tf32, and 1.4x faster for the
# whole prefill because bf16 MMAs read the transposed k natively;
# kernels._state_product). The fp32 Gluon kernel makes all four products tf32.
DEFAULT_DOT_PRECISION = "tf32"
# NOTE: one program per (b, h, E-tile) keeps a [D, BLOCK_E] fp32 state in
# registers. Chunk length / E-tile / warps / stages from ptxas' resource report
# (sm_90, compiled off-GPU: tools/offline_compile.py) and the H200 sweeps in
# benchmarks/bench_lightning_attention.py (B=1, H=64, N=4096, D=E=128):
# fp32 with 64-token chunks spills 400+ bytes/thread (tf32 MMAs cannot read k
# transposed from shared memory, so k^T goes through registers) and ran
# 623-734 us; 32-token chunks, E-tile 64, 8 warps, 3 stages spill nothing:
# 575 us (best of 11). bf16: 64-token chunks, E-tile 32 (256 programs), 4
# warps: 2 stages 157-169 us, 3 stages 122.8-134.8 us (session 3; Nsight
# Compute put 21% of the 2-stage kernel's stall samples on the wait for the
# next chunk's loads). 3 stages need 114688 bytes of shared memory, just under
# two programs per SM: the per-block state store inside the loop is split in
# register parts to fit (kernels._store_state_parts). fp32 was bound by shared
# memory traffic instead (Nsight Compute, before the state product's bf16 split:
# L1/shared 79% busy, LDS/LDSM 46% of stall samples: the tf32 operands go
# through shared memory as 32-bit loads), and more stages did not help it
# (529-540 us; 422-430 us after the split).
# The whole of E in one program (E-tile 128: no redundant q k^T per E-tile)
# was slower at every chunk/warp setting tried (fp32 744-953 us, bf16 284-303 us):
# Triton waits for each wgmma right after issuing it, so a program's four
# products per chunk run back to back and only co-resident programs overlap.
BLOCK_T = {"bfloat16": 64, "float16": 32, "float32": 32}
BLOCK_E = {"bfloat16": 32, "float16": 64, "float32": 64}
NUM_WARPS = {"bfloat16": 4, "float16": 8, "float32": 8}
NUM_STAGES = {"bfloat16": 3, "float16": 3, "float32": 3}
# Below MIN_PROGRAMS (b, h, E-tile) programs the sequence is cut into segments
# (whole state blocks, at least MIN_SEGMENT_CHUNKS chunks) so that about
# SEGMENT_TARGET programs run. Segments hand their end states on through
# memory (a chained scan); each reads its k and v twice, the second time
# mostly from L2.
MIN_PROGRAMS = 128
SEGMENT_TARGET = 256
MIN_SEGMENT_CHUNKS = 4


def _align(*values):
    """The largest power of two <= 16 dividing every value (0 divides nothing off)."""
    for a in (16, 8, 4, 2):
        if all(int(x) % a == 0 for x in values):
            return a
    return 1


def _token_offsets_fit_int32(q, k, v) -> bool:
    """Token-row offsets within one (b, h) slice of q, k, v and the contiguous
    output fit in int32 (both prefill kernels then skip 64-bit address math)."""
    n, e = q.shape[2], v.shape[3]
    return max((n - 1) * abs(x.strides[2]) + x.shape[3] for x in (q, k, v)) < 2 ** 31 and n * e < 2 ** 31


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
    num_warps: int | None = None, num_stages: int | None = None,
    dot_precision: str = DEFAULT_DOT_PRECISION, use_gluon: bool | None = None,
) -> Plan:
    """Plan lightning-attention prefill.

    Arrays: q, k [B, H, N, D], v [B, H, N, E] (one float dtype, innermost dim
    contiguous), ed [H] or [H, 1, 1] fp32, kv_history [B, H, D, E] fp32 or None
    (read only). Results: "output" [B, H, N, E] (q dtype) and "kv": the final
    state [B, H, D, E] when output_final_state_only, else [B, H, NB + 1, D, E]
    with kv[:, :, i] the state before token i * block_size.
    block_t / block_e / num_segments / num_warps / num_stages / dot_precision
    override the tuning (benchmarks and tests). use_gluon: None picks the Gluon
    kernel (gluon_kernels.py) wherever it applies, False never, True requires it.
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
    overrides = (block_t, block_e, num_warps, num_stages)
    gluon_ok = _gluon_applies(q, k, v, kv_history, block_size, output_final_state_only, dot_precision)
    if use_gluon and not gluon_ok:
        raise ValueError("use_gluon=True: the Gluon kernel does not apply to these arguments "
                         "(bf16 or fp32 with tf32 products, D=128, E and N multiples of 64, "
                         "a GPU)")
    if gluon_ok and (use_gluon or (use_gluon is None and all(x is None for x in overrides))):
        return _gluon_plan(q, k, v, ed, kv_history, block_size, output_final_state_only, num_segments,
                           buffers, results)

    block_d = max(16, next_pow2(d))
    if (block_e is None and q.dtype == "bfloat16" and d == block_d <= 128 and e % 64 == 0
            and b * h * (e // 64) >= MIN_PROGRAMS):
        # NOTE: enough (b, h) pairs to fill the GPU with E-tile 64 (one program
        # per SM): half the redundant q k^T and q/k reads of E-tile 32. H200,
        # B=1, H=64, N=4096, 3 stages: 126.6 vs 128.1 us with per-block states,
        # 108.6 vs 127.5 us final state only; B=4 x N=1024: 138.0 vs 138.3 /
        # 117.2 vs 132.6 us. With fewer pairs, E-tile 32 gives the chained scan
        # twice the programs (H=8, N=65536: 373 vs 400 us with states).
        block_e = 64
    block_e = block_e or min(BLOCK_E[q.dtype] if block_d <= 128 else 32, max(16, next_pow2(e)))
    # NOTE: bf16 MMA operands with a masked (non-power-of-two) D or E tile gave wrong
    # results and once an illegal address on the H200 (torch launch, D=48/E=80,
    # D=96/E=64; cause not found). Those shapes use fp32 (tf32) operands instead,
    # the path every fp32/fp16 input takes and that passed there.
    num_warps = num_warps or NUM_WARPS[q.dtype]
    block_t = block_t or (BLOCK_T[q.dtype] if block_d <= 128 else 32)
    num_stages = num_stages or NUM_STAGES[q.dtype]
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
    segmented = num_segments > 1
    publish_in_kv = segmented and not output_final_state_only

    has_hist = kv_history is not None
    hist = "kv_history" if has_hist else "ed"  # dummy pointer when absent
    hist_strides = kv_history.strides[:3] if has_hist else (0, 0, 0)
    out_strides = ArrayInfo.contiguous((b, h, n, e), q.dtype).strides[:3]
    kv_strides = ArrayInfo.contiguous(kv_shape, "float32").strides
    kv_strides = kv_strides[:2] + (0, kv_strides[2]) if output_final_state_only else kv_strides[:4]
    # where segments publish their end states: the returned per-block states
    # (segment p's end state is the state before its successor's first block)
    # or a scratch buffer
    if publish_in_kv:
        pub_strides = (kv_strides[0], kv_strides[1], blocks_per_seg * kv_strides[2], kv_strides[3])
        buffers["seg_state"] = Buffer((1,), "float32")  # unused
    elif segmented:
        pub_strides = ArrayInfo.contiguous((b, h, num_segments, d, e), "float32").strides[:4]
        buffers["seg_state"] = Buffer((b, h, num_segments, d, e), "float32")
    else:
        pub_strides = (0, 0, 0, 0)
        buffers["seg_state"] = Buffer((1,), "float32")  # unused
    # ticket counter, then one ready flag per program
    buffers["sync"] = Buffer((1 + num_segments * programs,) if segmented else (1,), "int32",
                             zero_init=segmented)
    strides = q.strides[:3] + k.strides[:3] + v.strides[:3] + out_strides + hist_strides
    align = _align(*strides, *pub_strides, *kv_strides)
    a = lambda xs: tuple(Scalar(x // align) for x in xs)  # noqa: E731
    even_d, even_e = d == block_d, e % block_e == 0
    even_tiles = even_d and even_e
    dot_bf16 = q.dtype == "bfloat16" and even_tiles
    launch = Launch(
        _lightning_prefill_kernel, (num_segments * programs,),
        ("q", "k", "v", "ed", hist, Scalar(h), Scalar(b), Scalar(n), Scalar(d), Scalar(e),
         Scalar(block_len), Scalar(num_blocks), Scalar(num_chunks), Scalar(blocks_per_seg),
         Scalar(ed.strides[0]), *a(strides), *a(pub_strides), *a(kv_strides)),
        ("output", "kv", "seg_state", "sync"),
        dict(BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_E=block_e, CHUNKS=chunks, N_E=n_e,
             EVEN_D=even_d, EVEN_E=even_e, HAS_HISTORY=has_hist,
             STORE_BLOCK_STATES=not output_final_state_only, PUBLISH_IN_KV=publish_in_kv,
             SEGMENTED=segmented,
             DOT_BF16=dot_bf16,
             # fp32 / fp16: the state product from bf16 hi/lo pairs (kernels._state_product);
             # whole tiles only (see the NOTE above on masked bf16 operands). Not under
             # the interpreter (CPU), whose bf16 tl.dot returns garbage (Triton 3.6) and
             # whose fp32 products are exact anyway: the split is tested on the GPU.
             SPLIT_STATE=(not dot_bf16 and even_tiles and dot_precision == "tf32"
                          and not interpret_requested()),
             DOT_PRECISION=dot_precision, ALIGN=align,
             OFFS_64=not _token_offsets_fit_int32(q, k, v),
             # segments' first pass (state products only): twice the chunk, 2 stages (bf16;
             # fp32's split products spilled at twice the chunk)
             P1_T=2 * block_t if dot_bf16 else block_t, P1_STAGES=2),
        num_warps=num_warps, num_stages=num_stages)
    return Plan(buffers, (launch,), results)


# NOTE: the Gluon prefills (gluon_kernels.py) issue each chunk's products as
# asynchronous wgmma with explicit waits, which Triton 3.6's tl.dot cannot. H200,
# B=1, H=64, N=4096, per-block states: bf16 99.9 us (1.25x the byte floor; the
# prototype 101.9) against 126.9 us for kernels.py, final state only 87.0 vs
# 108.9 us; fp32 (tf32 products) 214.5 vs 421.7 us, 194.9 us warp-specialised
# (session 7, see GLUON_TF32_WS_REGS) (benchmarks/RESULTS.md,
# results/experiments/exp_lightning_gluon*.json). Their scope is below;
# everything else runs kernels.py.
GLUON_T = 64
GLUON_BE = 64
# load ring depth: 4 x 40 KB of bf16 chunks; fp32 chunks are 80 KB and, with
# the transposed copies of the state and v, only 2 fit in shared memory.
# Pulling 1-3 further chunks into L2 (prefetch.global.L2) was 4-10% slower for
# both dtypes on the H200 (results/experiments/exp_lightning_gluon_prefetch.json).
GLUON_STAGES = {"bfloat16": 4, "float32": 2}
# More bf16 programs than one wave (one per SM, GLUON_ONE_WAVE on the H200): a
# 2-deep ring (112 KB of shared memory) fits two programs per SM, and each
# program's start (first loads, decays) and end (last stores) then overlap the
# other's loop. H200, B=4, H=64, N=1024 (512 programs): with per-block states
# 110.5 -> 106.6 us, final state only 96.7 -> 86.0 us. Within one wave it is
# slower: B=1, H=64, N=4096 (128 programs) 100.8 -> 110.2 us, and the chained
# scan of B=1, H=8, N=65536 (8 segments x 16 programs) 282.5 -> 319.7 us
# (results/experiments/exp_lightning_gluon_stages2.json,
# exp_lightning_gluon_segment_groups_stages2.json).
GLUON_ONE_WAVE = 132
GLUON_STAGES_MANY = {"bfloat16": 2, "float32": 2}
# one program per SM (shared memory): segments for about one wave of programs.
# More, shorter segments (waves whose k, v re-reads could hit L2) are slower:
# H200 B1 H8 N65536 bf16 with states, 8/16/32/64/128 segments per (b, h, E-tile):
# 283/295/311/333/361 us; fp32 632/639/692/706/726 us (the hand-over chain grows;
# results/experiments/exp_lightning_gluon_segment_sweep.json).
# Session 6, measured and not kept: a scan over groups of segments, where every
# segment publishes its own contribution and only the groups' end states are
# chained (summed in a fixed order, so still deterministic;
# benchmarks/experiments/rejected/gluon_segment_groups.diff). Same shape, groups
# of 1/2/4/8: 8 segments bf16 279.6/276.8/279.4/277.6 us, 128 segments
# 360.5/352.5/396.0/499.2 us, 256 segments 630-660 us; fp32 slower for any
# group > 1 (ptxas spills in the loop: 8 segments 627.7 vs 739-747 us). A short
# segment's program pays several dependent memory round trips (ticket, first
# loads, the publishing fence, the hand-over) that one program per SM cannot
# hide, and two per SM (the 2-deep ring) were slower at every segment count
# (results/experiments/exp_lightning_gluon_segment_groups*.json).
# Session 8 (same shape, bf16 / fp32, per-block states / final state only):
# a segment's own sum now reads its chunks last to first (_segment_sum), so the
# main loop's first chunks may still be in L2: 279.7 -> 275.2, 257.0 -> 253.3,
# 561.5 -> 553.5, 538.6 -> 532.1 us (exp_lightning_gluon_head_start.json). With
# it, 6/8/12/16 segments: bf16 states 343/277/370/288 us, fp32 final
# 677/537/689/539 us; 8 stays (exp_lightning_gluon_reverse_segments.json).
# Measured and not kept, a head start (rejected/gluon_head_start.diff): segment
# 0 half as long, skipping its own sum (its start state is known) and
# publishing its true end state after its loop, plus one more segment started
# in the SM it frees, so (P-1)/(P+1/2) of the sequence is re-read instead of
# (P-1)/P. Bit-identical results, but slower: 291.5 / 261.6 / 572.1 / 543.5 us
# against 279.7 / 257.0 / 561.5 / 538.6. It saves only ~2% of the bytes (the
# GPU's bandwidth is shared, so shorter segments do not shorten the others),
# and the late programs' start and ramp cost more than that.
GLUON_SEGMENT_TARGET = 128
# fp32 kernel (_gluon_prefill_tf32_kernel), session 7: warp-specialised. A state
# warpgroup (loads, the transposed copies of v and S, the state update) and an
# output warpgroup (q k^T, q S, P v) run side by side, handing ring slots and
# copies over through mbarriers; v is read back for its transposed copy without
# the duplicate reads of the earlier layout (whose tile was twice E-tile wide).
# H200 (copy 4.25 TB/s), single-warpgroup kernel -> warp-specialised ->
# + the v layout, per-block states / final state only: B=1, H=64, N=4096
# 216.5/206.0 -> 205.8/194.4 -> 194.5/183.0 us; B=4, H=64, N=1024
# 223.8/216.0 -> 216.4/203.0 -> 207.9/191.9 us; B=1, H=8, N=65536 629.2/600.5 ->
# 609.2/584.3 -> 586.2/560.0 us. Same products: the per-block states' relative
# difference to the Triton kernel is the single-warpgroup kernel's to every printed
# digit; outputs agree to rounding (the q decay is now one ex2.approx). WS_REGS (the output warpgroup's registers) 232 vs 240: within 1%.
# Measured and not kept (results/experiments/exp_lightning_gluon_tf32_warps8.json,
# exp_lightning_gluon_tf32_ws*.json): two warpgroups in lockstep (8 warps
# splitting every product; both read all of q and the whole v^T, P goes through
# shared memory): 229.1/219.4 us at B1 N4096, slower than one; starting q k^T
# before the copies of v and S are made (a second ready barrier): with the v
# layout 191.6/180.1 us at B1 N4096 but 208.6/201.9 at B4 N1024 (vs 207.9/191.9).
# Earlier single-warpgroup variants (sessions 4-5): P formed while the state
# update runs, P through shared memory, decays from shared memory, q k^T with q S
# as one N = 128 wgmma: none faster (exp_lightning_gluon_tf32_variants.json,
# exp_lightning_gluon_{decay_smem,merged}.json).
GLUON_TF32_WS_REGS = 240


def _gluon_applies(q, k, v, kv_history, block_size, output_final_state_only,
                   dot_precision=DEFAULT_DOT_PRECISION) -> bool:
    b, h, n, d = q.shape
    e = v.shape[3]
    if interpret_requested() or d != 128 or e % GLUON_BE or n % GLUON_T:
        return False
    if not (q.dtype == "bfloat16" or (q.dtype == "float32" and dot_precision == "tf32")):
        return False
    if not output_final_state_only and block_size % GLUON_T:
        return False
    elems = 16 // (4 if q.dtype == "float32" else 2)
    if _align(q.strides[2], k.strides[2], v.strides[2]) < elems:  # 16-byte copies of token rows
        return False
    # per-(b, h) offsets of the per-block states are int32 too
    states = 1 if output_final_state_only else cdiv(n, block_size) + 1
    return _token_offsets_fit_int32(q, k, v) and states * d * e < 2 ** 31


def _gluon_plan(q, k, v, ed, kv_history, block_size, output_final_state_only, num_segments,
                buffers, results):
    from .gluon_kernels import _gluon_prefill_kernel, _gluon_prefill_tf32_kernel
    b, h, n, d = q.shape
    e = v.shape[3]
    programs = b * h * (e // GLUON_BE)
    num_chunks = n // GLUON_T
    block_chunks = 0 if output_final_state_only else block_size // GLUON_T
    stages = (GLUON_STAGES_MANY if programs > GLUON_ONE_WAVE else GLUON_STAGES)[q.dtype]
    # segments are whole state blocks (single chunks when only the final state is
    # kept) and start on a ring slot 0 (the kernels take chunk % STAGES as the slot)
    unit = int(np.lcm(block_chunks or 1, stages))
    num_units = cdiv(num_chunks, unit)
    if num_segments is None:
        num_segments = 1
        if programs < MIN_PROGRAMS:
            num_segments = min(cdiv(GLUON_SEGMENT_TARGET, programs),
                               max(1, num_chunks // MIN_SEGMENT_CHUNKS), num_units)
    seg_chunks = cdiv(num_units, max(1, min(int(num_segments), num_units))) * unit
    num_segments = cdiv(num_chunks, seg_chunks)
    segmented = num_segments > 1
    buffers["seg_state"] = Buffer((b, h, num_segments, d, e) if segmented else (1,), "float32")
    # ticket counter, then one ready flag per program
    buffers["sync"] = Buffer((1 + num_segments * programs,) if segmented else (1,), "int32",
                             zero_init=segmented)
    has_hist = kv_history is not None
    hist = "kv_history" if has_hist else "ed"  # dummy pointer when absent
    hist_strides = kv_history.strides[:3] if has_hist else (0, 0, 0)
    strides = q.strides[:2] + k.strides[:2] + v.strides[:2] + hist_strides
    align = _align(*strides)
    fp32 = q.dtype == "float32"
    launch = Launch(
        _gluon_prefill_tf32_kernel if fp32 else _gluon_prefill_kernel, (num_segments * programs,),
        ("q", "k", "v", "ed", hist, Scalar(h), Scalar(b), Scalar(n), Scalar(seg_chunks),
         Scalar(num_segments), Scalar(ed.strides[0]), *(Scalar(x // align) for x in strides)),
        ("output", "kv", "seg_state", "sync"),
        dict(T=GLUON_T, D=d, E=e, BE=GLUON_BE, STAGES=stages, BLOCK_CHUNKS=block_chunks,
             HAS_HISTORY=has_hist, SEGMENTED=segmented, ALIGN=align,
             STRIDE_QT=q.strides[2], STRIDE_KT=k.strides[2], STRIDE_VT=v.strides[2],
             **(dict(WS_REGS=GLUON_TF32_WS_REGS) if fp32 else {})),
        # fp32: 4 warps compile the kernel; its worker partition adds 4 more at launch
        num_warps=4, num_stages=1)
    return Plan(buffers, (launch,), results)


@memoize
def plan_linear_decode(q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, kv_caches: ArrayInfo,
                       slope_rate: ArrayInfo, slot_idx: ArrayInfo, *, block_e: int | None = None,
                       num_warps: int | None = None) -> Plan:
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
    block_e = block_e or min(DECODE_BLOCK_E, max(16, next_pow2(e)))
    num_warps = num_warps or DECODE_NUM_WARPS
    strides = q.strides[:2] + k.strides[:2] + v.strides[:2] + kv_caches.strides[:3]
    align = _align(*strides, h * e, e)
    launch = Launch(
        _lightning_decode_kernel, (cdiv(e, block_e), b * h),
        ("q", "k", "v", "kv_caches", "slope_rate", "slot_idx",
         Scalar(h), Scalar(kv_caches.shape[0]), Scalar(d), Scalar(e),
         Scalar(slope_rate.strides[0]),
         *(Scalar(x // align) for x in strides), Scalar(kv_caches.strides[3]),
         Scalar(h * e // align), Scalar(e // align)),
        ("output", "kv_caches"),
        dict(BLOCK_D=block_d, BLOCK_E=block_e, EVEN_D=d == block_d, EVEN_E=e % block_e == 0,
             ALIGN=align,
             OFFS_64=abs(kv_caches.strides[2]) * d + abs(kv_caches.strides[3]) * e >= 2 ** 31),
        num_warps=num_warps, num_stages=1)
    return Plan(buffers, (launch,), results)


# NOTE: H200 sweeps, B=64, H=64, D=128 (three runs): E-tile 64 at 2/4/8 warps
# 3.82-3.88 / 3.83-3.88 / 3.72-3.89 TB/s; E-tile 32: 3.46-3.67; E-tile 128:
# 0.62 (2 warps, spills) to 3.74. Also measured and dropped: evict-first loads
# with streaming stores (-3%), several (b, h) per program with the next one's
# loads software-pipelined (2, 4, 8 per program: -2% to -20%).
DECODE_BLOCK_E = 64
DECODE_NUM_WARPS = 4


def check_slot_ids(slot_idx: np.ndarray, num_slots: int) -> None:
    """Host-side check of slot ids already on the host (no device sync):
    every id must be -1 (padding) or in [0, num_slots). On the device an
    out-of-range id yields a NaN output row and touches no cache slot."""
    ids = np.asarray(slot_idx)
    bad = ids[(ids < -1) | (ids >= num_slots)]
    if bad.size:
        raise ValueError(f"slot_idx: ids must be -1 or in [0, {num_slots}), got {bad[:4].tolist()}")

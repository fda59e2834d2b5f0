"""Validation and launch plans for lightning attention prefill (framework-free).

Prefill runs one of three kernels: the Triton kernel (prefill_kernels.py, any
shape, config :class:`LightningTritonConfig`) or, on Hopper with Gluon support
and within their scope, the bf16 / fp32 Gluon kernels (gluon_kernels.py, config
:class:`LightningGluonConfig`). Decode is decode_plan.py's, varlen
varlen_plan.py's, the backward backward_plan.py's. The planner: validate ->
problem (a frozen description of the facts) -> config (measured tables, or
``config=``) -> launch.
"""
from __future__ import annotations

import math

import dataclasses

import numpy as np

from .._plan import (FLOAT_DTYPES, INT32_MAX, ArrayInfo, Buffer, Launch, Plan, Scalar, as_int, cdiv,
                     check_config, check_dtype, check_inner_contiguous, check_ndim, check_shape,
                     config_class, memoize, next_pow2, pow2_divisor, row_major_strides)
from .._target import Target
from .prefill_kernels import _lightning_prefill_kernel

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
# Pass LightningTritonConfig(dot_precision="ieee") for exact-fp32 products. The
# interpreter (CPU) is always exact fp32. In prefill_kernels.py, with "tf32" and whole
# tiles, the state product k^T v is computed from bf16 hi/lo pairs instead (three
# bf16 MMAs, ~16 significant bits: more precise than tf32, and 1.4x faster for the
# whole prefill because bf16 MMAs read the transposed k natively;
# prefill_kernels._state_product). The fp32 Gluon kernel makes all four products tf32.
DEFAULT_DOT_PRECISION = "tf32"


@config_class
class LightningTritonConfig:
    """The Triton prefill kernel (prefill_kernels._lightning_prefill_kernel); passing one
    forces that kernel. None fields are the planner's choice (measured tables).
    block_t: tokens per chunk; block_e: E-tile (columns of the state per program);
    num_segments: chained-scan segments per (b, h, E-tile); dot_precision: the
    products' input precision on the GPU ("tf32", "tf32x3" or "ieee")."""
    block_t: int | None = None
    block_e: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    num_segments: int | None = None
    dot_precision: str = DEFAULT_DOT_PRECISION

    def __post_init__(self):
        if self.dot_precision not in DOT_PRECISIONS:
            raise ValueError(f"dot_precision: expected one of {DOT_PRECISIONS}, got {self.dot_precision!r}")


@config_class
class LightningGluonConfig:
    """The Gluon prefill kernels (gluon_kernels.py: bf16, or fp32 with tf32
    products); passing one forces them (ValueError where they do not apply).
    None fields are the planner's choice. num_segments: chained-scan segments
    per (b, h, E-tile); stages: load ring depth (the fp32 kernel needs 2)."""
    num_segments: int | None = None
    stages: int | None = None


# NOTE: one program per (b, h, E-tile) keeps a [D, BLOCK_E] fp32 state in
# registers. Chunk length / E-tile / warps / stages from ptxas' resource report
# (sm_90, compiled off-GPU: tools/offline_compile.py) and the H200 sweeps in
# benchmarks/bench_lightning_attention.py (B=1, H=64, N=4096, D=E=128):
# fp32 with 64-token chunks spills 400+ bytes/thread (tf32 MMAs cannot read k
# transposed from shared memory, so k^T goes through registers) and ran
# 623-734 us; 32-token chunks, E-tile 64, 8 warps, 3 stages spill nothing:
# 575 us (best of 11). bf16: 64-token chunks, E-tile 32 (256 programs), 4
# warps: 2 stages 157-169 us, 3 stages 122.8-134.8 us (2026-11-21, commit
# 2a99d61; Nsight Compute put 21% of the 2-stage kernel's stall samples on the
# wait for the next chunk's loads). 3 stages need 114688 bytes of shared memory,
# just under two programs per SM: the per-block state store inside the loop is
# split in register parts to fit (prefill_kernels._store_state_parts). fp32 was bound by
# shared memory traffic instead (Nsight Compute, before the state product's bf16
# split: L1/shared 79% busy, LDS/LDSM 46% of stall samples: the tf32 operands go
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
# NOTE: grid sizes were tuned on the H200's 132 SMs as program counts:
# MIN_PROGRAMS = 128 (fewer: segments, and bf16 keeps E-tile 32),
# SEGMENT_TARGET = 256 (Triton kernel), GLUON_SEGMENT_TARGET = 128 and
# GLUON_ONE_WAVE = 132 (Gluon kernels). They are now expressions of
# target.num_sms that give those values at 132 SMs (for other SM counts the
# expression is a rule, not a measurement): a grid of _full_wave programs,
# every SM busy but 1/WAVE_IDLE_FRACTION of them (128 of 132: B=1, H=64 at
# E-tile 64), fills the GPU. Below it the sequence is cut into segments (whole
# state blocks, at least MIN_SEGMENT_CHUNKS chunks) so that about
# SEGMENT_WAVES full waves of programs run (GLUON_SEGMENT_WAVES for the Gluon
# kernels, see their NOTE). Segments hand their end states on through memory
# (a chained scan); each reads its k and v twice, the second time mostly from L2.
WAVE_IDLE_FRACTION = 32
SEGMENT_WAVES = 2
MIN_SEGMENT_CHUNKS = 4
# NOTE: batch_invariant=True (the prefill, its backward and varlen): a row's
# arithmetic must not depend on the other rows of the call. The chained scan's
# segment boundaries change each row's arithmetic (a segment's start state is
# its predecessor's end state plus a separately summed contribution, not the
# sequential state), and the defaults above cut segments by the grid's size
# (B * H and the SM count): a call with H/2 heads differed from one with H in
# the last bits (H200, e8ee106: B1 H64 N4096 sharded over two GPUs). Invariant
# plans cut a row every INVARIANT_SEGMENT_TOKENS tokens (whole state blocks /
# Gluon units), whatever B, H or the GPU, and choose E-tiles and load rings from
# the row's dtype and sizes alone. 8192 keeps the measured default of the
# headline shapes (B1 H64 N4096 and B4 H64 N1024: one segment; B1 H8 N65536:
# 8 segments); elsewhere it costs what the grid rule gained: few (b, h) rows of
# <= 8192 tokens run unsegmented on a part of the GPU, many rows of long
# sequences re-read each segment's k and v once more (the segments' first pass).
# No default could keep both: the speed comes from following the grid.
INVARIANT_SEGMENT_TOKENS = 8192


def _full_wave(target: Target) -> int:
    return target.num_sms - target.num_sms // WAVE_IDLE_FRACTION


def _num_segments(target, programs, waves, num_chunks, max_segments) -> int:
    """The default segment count: 1 when ``programs`` fill the GPU, else about
    ``waves`` full waves of programs, segments of >= MIN_SEGMENT_CHUNKS chunks."""
    if programs >= _full_wave(target):
        return 1
    return min(cdiv(waves * _full_wave(target), programs), max(1, num_chunks // MIN_SEGMENT_CHUNKS),
               max_segments)


def _split(units: int, segments: int) -> tuple[int, int]:
    """(units per segment, segments) for ``segments`` requested over ``units``."""
    per = cdiv(units, max(1, min(int(segments), units)))
    return per, cdiv(units, per)


def prefill_state_shape(b, h, n, d, e, block_size, output_final_state_only):
    """Shape of the returned kv: [B, H, D, E] or [B, H, NB + 1, D, E]."""
    if output_final_state_only:
        return (b, h, d, e)
    return (b, h, cdiv(n, block_size) + 1, d, e)


@dataclasses.dataclass(frozen=True)
class _Prefill:
    q: ArrayInfo
    k: ArrayInfo
    v: ArrayInfo
    ed: ArrayInfo
    kv_history: ArrayInfo | None
    b: int
    h: int
    n: int
    d: int
    e: int
    dtype: str
    block_size: int
    final_only: bool
    offs_32: bool  # token-row offsets within one (b, h) slice fit in int32

    @property
    def block_d(self) -> int:
        return max(16, next_pow2(self.d))

    @property
    def kv_shape(self) -> tuple:
        return prefill_state_shape(self.b, self.h, self.n, self.d, self.e, self.block_size, self.final_only)

    def buffers(self, seg_state: tuple | None = None, segments: int = 1, programs: int = 0) -> dict:
        """output and kv; with ``seg_state`` also the chained scan's published
        states and its ticket counter followed by one ready flag per program
        (zeroed when segmented)."""
        out = {"output": Buffer((self.b, self.h, self.n, self.e), self.dtype),
               "kv": Buffer(self.kv_shape, "float32")}
        if seg_state is not None:
            sync = (1 + segments * programs,) if segments > 1 else (1,)
            # unsegmented, both are placeholders (a kernel touches neither); so is
            # seg_state when the segments publish into kv: a (1,) stand-in
            out.update(seg_state=Buffer(seg_state, "float32", placeholder=seg_state == (1,)),
                       sync=Buffer(sync, "int32", zero_init=segments > 1, placeholder=segments == 1))
        return out


PREFILL_RESULTS = ("output", "kv")


@memoize
def plan_lightning_attention(
    target: Target, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, ed: ArrayInfo,
    kv_history: ArrayInfo | None = None, *, block_size: int = 256,
    output_final_state_only: bool = False,
    config: LightningTritonConfig | LightningGluonConfig | None = None, batch_invariant: bool = False,
) -> Plan:
    """Plan lightning-attention prefill.

    Arrays: q, k [B, H, N, D], v [B, H, N, E] (one float dtype, innermost dim
    contiguous), ed [H] or [H, 1, 1] fp32, kv_history [B, H, D, E] or None
    (read only; fp32, or bf16/fp16 as vLLM's MiniMax layer keeps it, read into
    fp32). Results: "output" [B, H, N, E] (q dtype) and "kv": the final
    state [B, H, D, E] when output_final_state_only, else [B, H, NB + 1, D, E]
    with kv[:, :, i] the state before token i * block_size.
    The Gluon kernels run where they apply (see _gluon_unfit), else the Triton
    kernel. ``config``: a LightningTritonConfig forces the Triton kernel, a
    LightningGluonConfig the Gluon ones (ValueError where they do not apply).
    ``batch_invariant``: every (b, h) row's result independent of B, H and the
    GPU's size (the NOTE at INVARIANT_SEGMENT_TOKENS); a ``config``'s own fields
    still apply.
    """
    check_config(config, (LightningTritonConfig, LightningGluonConfig))
    p = _validate_prefill(q, k, v, ed, kv_history, block_size, output_final_state_only)
    if p.b == 0 or p.h == 0:
        return Plan(p.buffers(), (), PREFILL_RESULTS)
    buffers, launch = _planned_launch(target, p, config, bool(batch_invariant))
    return Plan(buffers, (launch,), PREFILL_RESULTS)


def _planned_launch(target: Target, p: _Prefill, config, invariant: bool, reverse: bool = False,
                    hist_shift: bool = False):
    """(buffers, launch) of the kernel ``config`` or the planner picks for ``p``."""
    if _use_gluon(target, p, config):
        return _gluon_launch(p, _gluon_config(target, p, config, invariant), reverse, hist_shift)
    return _triton_launch(target, p, _triton_config(target, p, config, invariant), reverse, hist_shift)


# the decay-rate layouts accepted (vLLM's callers pass [H, 1, 1] from MiniMax's
# slope tensor, [H], or the [1, H, 1, 1] its lightning_attention views [H] as),
# and the axis that holds the heads
DECAY_LAYOUTS = {1: 0, 3: 0, 4: 1}


def _check_decay(name, info, h) -> ArrayInfo:
    """Validate a per-head decay array; returns it as a [H] ArrayInfo (the
    head axis' stride), which is all the kernels read."""
    shapes = ((h,), (h, 1, 1), (1, h, 1, 1))
    if tuple(info.shape) not in shapes:
        raise ValueError(f"{name}: expected shape ({h},), ({h}, 1, 1) or (1, {h}, 1, 1), "
                         f"got {tuple(info.shape)}")
    check_dtype(name, info, ("float32",))
    axis = DECAY_LAYOUTS[info.ndim]
    return ArrayInfo((h,), info.dtype, (info.strides[axis],))


def _check_layout(q, ed):
    """q in [B, N, H, D] (the layout of many other kernels) instead of [B, H, N, D]
    shows as a decay whose head count is q's third axis: name q's layout, not ed."""
    s = tuple(ed.shape)
    heads = math.prod(s)  # the accepted layouts: [H], [H, 1, 1], [1, H, 1, 1]
    if (s in ((heads,), (heads, 1, 1), (1, heads, 1, 1))
            and heads != q.shape[1] and heads == q.shape[2]):
        raise ValueError(f"q: shape {tuple(q.shape)} looks like [B, N, H, D] with H = {heads} (ed's heads); "
                         f"q, k and v are [B, H, N, D]: pass them transposed, e.g. q.transpose(1, 2)")


def _check_head(name, size):
    if not 1 <= size <= MAX_HEAD_SIZE:
        raise ValueError(f"{name}: head size {size} is not in [1, {MAX_HEAD_SIZE}]")


def prefill_config(target: Target, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, ed: ArrayInfo,
                   kv_history: ArrayInfo | None = None, *, block_size: int = 256,
                   output_final_state_only: bool = False, config=None, batch_invariant: bool = False):
    """The config :func:`plan_lightning_attention` runs these arrays with:
    ``config`` completed, or the measured default (Gluon where the target
    runs it). The JAX adapter's vmap pins it, so that a folded launch does the
    per-example arithmetic."""
    p = _validate_prefill(q, k, v, ed, kv_history, as_int("block_size", block_size),
                          bool(output_final_state_only))
    if _use_gluon(target, p, config):
        return _gluon_config(target, p, config, bool(batch_invariant))
    return _triton_config(target, p, config, bool(batch_invariant))


def _validate_prefill(q, k, v, ed, kv_history, block_size, final_only) -> _Prefill:
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
    _check_layout(q, ed)
    ed = _check_decay("ed", ed, h)
    _check_head("q", d)
    _check_head("v", e)
    if kv_history is not None:
        check_shape("kv_history", kv_history, (b, h, d, e), "[B, H, D, E]")
        check_dtype("kv_history", kv_history, FLOAT_DTYPES)
        check_inner_contiguous("kv_history", kv_history)
    for name, info in (("q", q), ("k", k), ("v", v)):
        check_inner_contiguous(name, info)
    block_size = as_int("block_size", block_size, 1, INT32_MAX)  # the kernels hold it in int32
    if n < 1:
        raise ValueError(f"q: the sequence length N must be >= 1, got shape {tuple(q.shape)}")
    # both prefill kernels skip 64-bit address math where the token-row offsets
    # within one (b, h) slice of q, k, v and the contiguous output fit in int32
    offs_32 = (max((n - 1) * abs(x.strides[2]) + x.shape[3] for x in (q, k, v)) < 2 ** 31
               and n * e < 2 ** 31)
    return _Prefill(q, k, v, ed, kv_history, b, h, n, d, e, q.dtype, int(block_size), bool(final_only),
                    offs_32)


# ---------------------------------------------------------------- Triton prefill
def _chunking(p: _Prefill, block_t: int) -> tuple[int, int, int, int]:
    """(block_len, chunks per block, blocks, chunks) of the Triton kernel's chunk layout."""
    if p.final_only:  # block_size is irrelevant: one chunk per "block"
        block_len, chunks = block_t, 1
    else:
        block_len, chunks = p.block_size, cdiv(p.block_size, block_t)
    num_blocks = cdiv(p.n, block_len)
    tail = p.n - (num_blocks - 1) * block_len
    return block_len, chunks, num_blocks, (num_blocks - 1) * chunks + cdiv(tail, block_t)


def _invariant_segments(units: int, unit_tokens: int) -> int:
    """Segments of a batch-invariant plan: one per INVARIANT_SEGMENT_TOKENS tokens
    of the row, in whole units of ``unit_tokens`` tokens (``units`` of them)."""
    return cdiv(units, max(1, INVARIANT_SEGMENT_TOKENS // unit_tokens))


def _triton_config(target: Target, p: _Prefill, override, invariant: bool = False) -> LightningTritonConfig:
    """The Triton kernel's config from the tables above, ``override``'s fields first
    (``invariant``: from the row alone, see INVARIANT_SEGMENT_TOKENS)."""
    o = override or LightningTritonConfig()
    block_e, small_d = o.block_e, p.block_d <= 128
    if (block_e is None and not invariant and p.dtype == "bfloat16" and p.d == p.block_d <= 128
            and p.e % 64 == 0 and p.b * p.h * (p.e // 64) >= _full_wave(target)):
        # NOTE: enough (b, h) pairs to fill the GPU with E-tile 64 (one program
        # per SM): half the redundant q k^T and q/k reads of E-tile 32. H200,
        # B=1, H=64, N=4096, 3 stages: 126.6 vs 128.1 us with per-block states,
        # 108.6 vs 127.5 us final state only; B=4 x N=1024: 138.0 vs 138.3 /
        # 117.2 vs 132.6 us. With fewer pairs, E-tile 32 gives the chained scan
        # twice the programs (H=8, N=65536: 373 vs 400 us with states).
        block_e = 64
    block_e = block_e or min(BLOCK_E[p.dtype] if small_d else 32, max(16, next_pow2(p.e)))
    block_t = o.block_t or (BLOCK_T[p.dtype] if small_d else 32)
    if not p.final_only:
        block_t = min(block_t, max(16, next_pow2(p.block_size)))
    block_len, _, num_blocks, num_chunks = _chunking(p, block_t)
    programs = p.b * p.h * cdiv(p.e, block_e)
    segments = o.num_segments
    if segments is None and invariant:
        segments = _invariant_segments(num_blocks, block_len)
    elif segments is None:
        segments = _num_segments(target, programs, SEGMENT_WAVES, num_chunks, num_blocks)
    return LightningTritonConfig(block_t, block_e, o.num_warps or NUM_WARPS[p.dtype],
                                 o.num_stages or NUM_STAGES[p.dtype], _split(num_blocks, segments)[1],
                                 o.dot_precision)


def _aligned(names: str, values) -> dict:
    """Launch params of strides in alignment group ALIGN (core_kernels._triton_utils.jit)."""
    return {n: Scalar(int(x), align="ALIGN") for n, x in zip(names.split(), values)}


def _triton_launch(target: Target, p: _Prefill, c: LightningTritonConfig, reverse: bool = False,
                   hist_shift: bool = False):
    """The Triton kernel's launch and buffers; ``reverse`` / ``hist_shift``: the
    kernel's variants for the backward (prefill_kernels._lightning_prefill_kernel)."""
    block_len, chunks, num_blocks, num_chunks = _chunking(p, c.block_t)
    n_e = cdiv(p.e, c.block_e)
    programs = p.b * p.h * n_e
    blocks_per_seg, segments = _split(num_blocks, c.num_segments)
    segmented, publish_in_kv = segments > 1, segments > 1 and not p.final_only
    kv = row_major_strides(p.kv_shape)
    kv = kv[:2] + (0, kv[2]) if p.final_only else kv[:4]
    # where segments publish their end states: the returned per-block states
    # (segment p's end state is the state before its successor's first block)
    # or a scratch buffer
    seg_state = (p.b, p.h, segments, p.d, p.e) if segmented and not publish_in_kv else (1,)
    pub = ((kv[0], kv[1], blocks_per_seg * kv[2], kv[3]) if publish_in_kv else
           row_major_strides(seg_state)[:4] if segmented else (0, 0, 0, 0))
    hist = p.kv_history.strides[:3] if p.kv_history is not None else (0, 0, 0)
    even_d, even_e = p.d == p.block_d, p.e % c.block_e == 0
    # NOTE: bf16 MMA operands with a masked (non-power-of-two) D or E tile gave wrong
    # results and once an illegal address on the H200 (torch launch, D=48/E=80,
    # D=96/E=64; cause not found). Those shapes use fp32 (tf32) operands instead,
    # the path every fp32/fp16 input takes and that passed there.
    dot_bf16 = p.dtype == "bfloat16" and even_d and even_e
    launch = Launch(
        kernel=_lightning_prefill_kernel, grid=(segments * programs,),
        params=dict(
            q_ptr="q", k_ptr="k", v_ptr="v", decay_ptr="ed",
            history_ptr="kv_history" if p.kv_history is not None else "ed",  # dummy when absent
            num_heads=Scalar(p.h), num_rows=Scalar(p.b), seq_len=Scalar(p.n), head_k=Scalar(p.d),
            head_v=Scalar(p.e), block_len=Scalar(block_len), num_blocks=Scalar(num_blocks),
            num_chunks=Scalar(num_chunks), blocks_per_seg=Scalar(blocks_per_seg),
            stride_decay=Scalar(p.ed.strides[0]),
            **_aligned("stride_qb stride_qh stride_qt", p.q.strides[:3]),
            **_aligned("stride_kb stride_kh stride_kt", p.k.strides[:3]),
            **_aligned("stride_vb stride_vh stride_vt", p.v.strides[:3]),
            **_aligned("stride_ob stride_oh stride_ot", row_major_strides((p.b, p.h, p.n, p.e))[:3]),
            **_aligned("stride_hb stride_hh stride_hd", hist),
            **_aligned("stride_pb stride_ph stride_pp stride_pd", pub),
            **_aligned("stride_kvb stride_kvh stride_kvi stride_kvd", kv),
            o_ptr="output", kv_ptr="kv", pub_ptr="seg_state", sync_ptr="sync"),
        writes=("o_ptr", "kv_ptr", "pub_ptr", "sync_ptr"),
        constexprs=dict(
            BLOCK_T=c.block_t, BLOCK_D=p.block_d, BLOCK_E=c.block_e, CHUNKS=chunks, N_E=n_e,
            EVEN_D=even_d, EVEN_E=even_e, HAS_HISTORY=p.kv_history is not None,
            STORE_BLOCK_STATES=not p.final_only, PUBLISH_IN_KV=publish_in_kv, SEGMENTED=segmented,
            DOT_BF16=dot_bf16,
            # fp32 / fp16: the state product from bf16 hi/lo pairs (prefill_kernels._state_product);
            # whole tiles only (see the NOTE above on masked bf16 operands). Not under
            # the interpreter (CPU), whose bf16 tl.dot returns garbage (Triton 3.6) and
            # whose fp32 products are exact anyway: the split is tested on the GPU.
            SPLIT_STATE=(not dot_bf16 and even_d and even_e and c.dot_precision == "tf32"
                         and not target.interpret),
            DOT_PRECISION=c.dot_precision, OFFS_64=not p.offs_32,
            # segments' first pass (state products only): twice the chunk, 2 stages (bf16;
            # fp32's split products spilled at twice the chunk)
            P1_T=2 * c.block_t if dot_bf16 else c.block_t, P1_STAGES=2,
            REVERSE=reverse, HIST_SHIFT=hist_shift),
        num_warps=c.num_warps, num_stages=c.num_stages)
    return p.buffers(seg_state, segments, programs), launch


# ---------------------------------------------------------------- Gluon prefill
# NOTE: the Gluon prefills (gluon_kernels.py) issue each chunk's products as
# asynchronous wgmma with explicit waits, which Triton 3.6's tl.dot cannot. H200,
# B=1, H=64, N=4096, per-block states: bf16 99.9 us (1.25x the byte floor; the
# prototype 101.9) against 126.9 us for prefill_kernels.py, final state only 87.0 vs
# 108.9 us; fp32 (tf32 products) 214.5 vs 421.7 us, 194.9 us warp-specialised
# (2026-11-21, commit fdeac68; see GLUON_TF32_WS_REGS) (benchmarks/RESULTS.md,
# results/experiments/exp_lightning_gluon*.json). Their scope is _gluon_unfit's;
# everything else runs prefill_kernels.py.
GLUON_T = 64
GLUON_BE = 64
# load ring depth: 4 x 40 KB of bf16 chunks; fp32 chunks are 80 KB and, with
# the transposed copies of the state and v, only 2 fit in shared memory.
# Pulling 1-3 further chunks into L2 (prefetch.global.L2) was 4-10% slower for
# both dtypes on the H200 (2026-11-21, commit e56c55f;
# results/experiments/exp_lightning_gluon_prefetch.json).
GLUON_STAGES = {"bfloat16": 4, "float32": 2}
# More bf16 programs than one wave (one per SM: more than target.num_sms, 132 on
# the H200): a 2-deep ring (112 KB of shared memory) fits two programs per SM,
# and each program's start (first loads, decays) and end (last stores) then
# overlap the other's loop. H200, B=4, H=64, N=1024 (512 programs): with
# per-block states 110.5 -> 106.6 us, final state only 96.7 -> 86.0 us. Within
# one wave it is slower: B=1, H=64, N=4096 (128 programs) 100.8 -> 110.2 us,
# and the chained scan of B=1, H=8, N=65536 (8 segments x 16 programs) 282.5 ->
# 319.7 us (2026-11-21, commit 800090f; results/experiments/exp_lightning_gluon_stages2.json,
# exp_lightning_gluon_segment_groups_stages2.json).
GLUON_STAGES_MANY = {"bfloat16": 2, "float32": 2}
# one program per SM (shared memory): segments for about one full wave of
# programs (_full_wave: 128 on the H200).
# More, shorter segments (waves whose k, v re-reads could hit L2) are slower:
# H200 B1 H8 N65536 bf16 with states, 8/16/32/64/128 segments per (b, h, E-tile):
# 283/295/311/333/361 us; fp32 632/639/692/706/726 us (the hand-over chain grows;
# 2026-11-21, commit e56c55f; results/experiments/exp_lightning_gluon_segment_sweep.json).
# Measured and not kept (2026-11-21, commit 800090f): a scan over groups of
# segments, where every segment publishes its own contribution and only the
# groups' end states are chained (summed in a fixed order, so still
# deterministic; git keeps the patch: commit 23f9d41,
# benchmarks/experiments/rejected/gluon_segment_groups.diff, applies there).
# Same shape, groups of 1/2/4/8: 8 segments bf16 279.6/276.8/279.4/277.6 us,
# 128 segments 360.5/352.5/396.0/499.2 us, 256 segments 630-660 us; fp32 slower
# for any group > 1 (ptxas spills in the loop: 8 segments 627.7 vs 739-747 us).
# A short segment's program pays several dependent memory round trips (ticket,
# first loads, the publishing fence, the hand-over) that one program per SM
# cannot hide, and two per SM (the 2-deep ring) were slower at every segment
# count (results/experiments/exp_lightning_gluon_segment_groups*.json).
# 2026-11-21, commit 3cc5048 (same shape, bf16 / fp32, per-block states / final
# state only): a segment's own sum now reads its chunks last to first
# (_segment_sum), so the main loop's first chunks may still be in L2: 279.7 ->
# 275.2, 257.0 -> 253.3, 561.5 -> 553.5, 538.6 -> 532.1 us
# (exp_lightning_gluon_head_start.json). With it, 6/8/12/16 segments: bf16
# states 343/277/370/288 us, fp32 final 677/537/689/539 us; 8 stays
# (exp_lightning_gluon_reverse_segments.json).
# Measured and not kept, a head start (same commit; git keeps the patch: commit
# 3cc5048, benchmarks/experiments/rejected/gluon_head_start.diff, applies to
# dd16c74): segment 0 half as long, skipping its own sum (its start state is
# known) and publishing its true end state after its loop, plus one more
# segment started in the SM it frees, so (P-1)/(P+1/2) of the sequence is
# re-read instead of (P-1)/P. Bit-identical results, but slower: 291.5 / 261.6
# / 572.1 / 543.5 us against 279.7 / 257.0 / 561.5 / 538.6. It saves only ~2% of
# the bytes (the GPU's bandwidth is shared, so shorter segments do not shorten
# the others), and the late programs' start and ramp cost more than that.
GLUON_SEGMENT_WAVES = 1
# fp32 kernel (_gluon_prefill_tf32_kernel), 2026-11-21, commit fdeac68:
# warp-specialised. A state warpgroup (loads, the transposed copies of v and S,
# the state update) and an output warpgroup (q k^T, q S, P v) run side by side,
# handing ring slots and copies over through mbarriers; v is read back for its
# transposed copy without the duplicate reads of the earlier layout (whose tile
# was twice E-tile wide).
# H200 (copy 4.25 TB/s), single-warpgroup kernel -> warp-specialised ->
# + the v layout, per-block states / final state only: B=1, H=64, N=4096
# 216.5/206.0 -> 205.8/194.4 -> 194.5/183.0 us; B=4, H=64, N=1024
# 223.8/216.0 -> 216.4/203.0 -> 207.9/191.9 us; B=1, H=8, N=65536 629.2/600.5 ->
# 609.2/584.3 -> 586.2/560.0 us. Same products: the per-block states' relative
# difference to the Triton kernel is the single-warpgroup kernel's to every printed
# digit; outputs agree to rounding (the q decay is now one ex2.approx). WS_REGS (the
# output warpgroup's registers) 232 vs 240: within 1%.
# Measured and not kept (same commit; results/experiments/exp_lightning_gluon_tf32_warps8.json,
# exp_lightning_gluon_tf32_ws*.json): two warpgroups in lockstep (8 warps
# splitting every product; both read all of q and the whole v^T, P goes through
# shared memory): 229.1/219.4 us at B1 N4096, slower than one; starting q k^T
# before the copies of v and S are made (a second ready barrier): with the v
# layout 191.6/180.1 us at B1 N4096 but 208.6/201.9 at B4 N1024 (vs 207.9/191.9).
# Earlier single-warpgroup variants (2026-11-21, commits ca547bc and e56c55f): P
# formed while the state update runs, P through shared memory, decays from shared
# memory, q k^T with q S as one N = 128 wgmma: none faster
# (exp_lightning_gluon_tf32_variants.json, exp_lightning_gluon_{decay_smem,merged}.json).
GLUON_TF32_WS_REGS = 240


def gluon_scope_unfit(target: Target, dtype: str, d: int, e: int, row_strides) -> str | None:
    """What every Gluon lightning kernel (prefill and varlen) needs, or why not:
    an sm_90 target with Gluon, bf16 / fp32, D = 128, E a multiple of the
    E-tile, and q/k/v rows (``row_strides``, in elements) 16-byte aligned."""
    if not (target.gluon and target.hopper and not target.interpret):
        return f"the target {target} has no Gluon kernels (an sm_90 GPU with Gluon support)"
    if dtype not in ("bfloat16", "float32"):
        return f"dtype {dtype} (bf16 or fp32 only)"
    if d != 128 or e % GLUON_BE:
        return f"D={d}, E={e} (D = 128, E a multiple of {GLUON_BE})"
    if pow2_divisor(*row_strides) < 16 // (4 if dtype == "float32" else 2):
        return "q/k/v rows not 16-byte aligned (their copies are 16 bytes wide)"
    return None


def _gluon_unfit(target: Target, p: _Prefill) -> str | None:
    """Why the Gluon kernels do not apply to ``p`` on ``target`` (None: they do)."""
    unfit = gluon_scope_unfit(target, p.dtype, p.d, p.e, (p.q.strides[2], p.k.strides[2], p.v.strides[2]))
    if unfit:
        return unfit
    if p.n % GLUON_T:
        return f"N={p.n} (a multiple of {GLUON_T})"
    if not p.final_only and p.block_size % GLUON_T:
        return f"block_size {p.block_size} (a multiple of {GLUON_T})"
    # per-(b, h) offsets of the per-block states are int32 too
    states = 1 if p.final_only else cdiv(p.n, p.block_size) + 1
    if not (p.offs_32 and states * p.d * p.e < 2 ** 31):
        return "per-(b, h) offsets beyond int32"
    return None


def _use_gluon(target: Target, p: _Prefill, config) -> bool:
    """The Gluon kernels where they apply, unless ``config`` picks the kernel."""
    if isinstance(config, LightningTritonConfig):
        return False
    unfit = _gluon_unfit(target, p)
    if unfit and isinstance(config, LightningGluonConfig):
        raise ValueError(f"config: LightningGluonConfig does not apply here: {unfit}")
    return unfit is None


def _gluon_unit(p: _Prefill, stages: int) -> int:
    """Chunks per segment unit: segments are whole state blocks (single chunks when
    only the final state is kept) and start on ring slot 0 (slot = chunk % STAGES)."""
    return int(np.lcm(1 if p.final_only else p.block_size // GLUON_T, stages))


def _gluon_config(target: Target, p: _Prefill, override, invariant: bool = False) -> LightningGluonConfig:
    o = override or LightningGluonConfig()
    programs = p.b * p.h * (p.e // GLUON_BE)
    num_chunks = p.n // GLUON_T
    # batch-invariant and segmented: the ring depth sets the segments' unit, so
    # it comes from the dtype alone (unsegmented it changes no arithmetic)
    fixed_ring = invariant and o.num_segments is None and p.n > INVARIANT_SEGMENT_TOKENS
    stages = o.stages or (GLUON_STAGES_MANY if programs > target.num_sms and not fixed_ring
                          else GLUON_STAGES)[p.dtype]
    if p.dtype == "float32" and stages != 2:
        raise ValueError(f"config: stages={stages}; the fp32 Gluon kernel keeps a 2-deep load ring")
    unit = _gluon_unit(p, stages)
    units = cdiv(num_chunks, unit)
    segments = o.num_segments
    if segments is None and invariant:
        segments = _invariant_segments(units, unit * GLUON_T)
    elif segments is None:
        segments = _num_segments(target, programs, GLUON_SEGMENT_WAVES, num_chunks, units)
    return LightningGluonConfig(_split(units, segments)[1], stages)


def _gluon_launch(p: _Prefill, c: LightningGluonConfig, reverse: bool = False, hist_shift: bool = False):
    """The Gluon kernel's launch and buffers (``reverse`` / ``hist_shift``: as _triton_launch's)."""
    from .gluon_kernels import _gluon_prefill_kernel, _gluon_prefill_tf32_kernel
    programs = p.b * p.h * (p.e // GLUON_BE)
    unit = _gluon_unit(p, c.stages)
    seg_units, segments = _split(cdiv(p.n // GLUON_T, unit), c.num_segments)
    fp32 = p.dtype == "float32"
    hist = p.kv_history.strides[:3] if p.kv_history is not None else (0, 0, 0)
    launch = Launch(
        kernel=_gluon_prefill_tf32_kernel if fp32 else _gluon_prefill_kernel, grid=(segments * programs,),
        params=dict(
            q_ptr="q", k_ptr="k", v_ptr="v", decay_ptr="ed",
            history_ptr="kv_history" if p.kv_history is not None else "ed",  # dummy when absent
            num_heads=Scalar(p.h), num_rows=Scalar(p.b), seq_len=Scalar(p.n),
            seg_chunks=Scalar(seg_units * unit), last_segment=Scalar(segments - 1),
            stride_decay=Scalar(p.ed.strides[0]),
            **_aligned("stride_qb stride_qh", p.q.strides[:2]),
            **_aligned("stride_kb stride_kh", p.k.strides[:2]),
            **_aligned("stride_vb stride_vh", p.v.strides[:2]),
            **_aligned("stride_hb stride_hh stride_hd", hist),
            o_ptr="output", kv_ptr="kv", pub_ptr="seg_state", sync_ptr="sync"),
        writes=("o_ptr", "kv_ptr", "pub_ptr", "sync_ptr"),
        constexprs=dict(T=GLUON_T, D=p.d, E=p.e, BE=GLUON_BE, STAGES=c.stages,
                        BLOCK_CHUNKS=0 if p.final_only else p.block_size // GLUON_T,
                        HAS_HISTORY=p.kv_history is not None, SEGMENTED=segments > 1,
                        STRIDE_QT=p.q.strides[2], STRIDE_KT=p.k.strides[2], STRIDE_VT=p.v.strides[2],
                        REVERSE=reverse, HIST_SHIFT=hist_shift,
                        **(dict(WS_REGS=GLUON_TF32_WS_REGS) if fp32 else {})),
        # fp32: 4 warps compile the kernel; its worker partition adds 4 more at launch
        num_warps=4, num_stages=1)
    seg_state = (p.b, p.h, segments, p.d, p.e) if segments > 1 else (1,)
    return p.buffers(seg_state, segments, programs), launch

"""Validation and launch plan for block-sparse varlen attention (framework-free).

plan_blocksparse_attention: validate -> _Problem -> config (one frozen config
type per kernel variant, chosen by the measured rules below or given with
``config=``) -> launches. The config's type selects the variant:
- BlocksparsePrefillConfig: _bsattn_fwd_kernel, any batch;
- BlocksparseDecodeConfig: _bsattn_decode_kernel (one program per query head
  and split; the last split of a head merges them), decode-only batches;
- BlocksparseGroupDecodeConfig: _bsattn_decode_group_kernel (GQA-packed, one
  program per KV head and split; likewise merged), decode-only batches.
"""
from __future__ import annotations

import dataclasses
import math

from .._plan import (FLOAT_DTYPES, FP32_MAX, INT32_MAX, ITEMSIZE, ArrayInfo, Buffer, Launch, Plan,
                     Scalar, as_float, as_int, cdiv, check_config, check_dtype,
                     check_inner_contiguous, check_ndim, config_class, memoize, next_pow2)
from .._target import Target
from .kernels import (LOG2E, _bsattn_decode_group_kernel, _bsattn_decode_kernel,
                      _bsattn_fwd_kernel, _bsattn_fwd_lse_kernel)

MAX_HEAD_SIZE = 256
BLOCK_SIZES = (16, 32, 64, 128, 256)
# NOTE: decode splits a row's key blocks (flash-decoding) into
# max(DECODE_PROGRAMS_PER_SM * SMs // (B * Hq), row bound / DECODE_TILES_PER_SPLIT)
# splits (the row bound is what the layout's shape allows, the real row is
# often shorter), each split taking at least DECODE_MIN_PER_SPLIT tiles at run
# time (the rest exit at once). Measured on the H200 (2026-11-21, commit
# bd50a48; 132 SMs: 8 * 132 programs; GPU time in a CUDA graph, Phi-3-small):
# 1x16384 33 splits w4 20.6 us, 23 w2 16.2 us, 33 w2 16.8 us, 23 w8 32.7 us;
# 64x4096 1 split w4 479 us, 4-9 w4 375-385 us, 9 w2 288 us, 9 w8 618 us.
# With the merge in the launch (each split waits for its ticket before it exits,
# and the last one merges S_P2 = next_pow2(splits) rows) at 1x16384 (32 heads):
# 24 splits 17.1-17.4 us, 28 17.3-17.6, 32 17.6, 33 19.0-19.1, 20 19.3-19.6,
# 16 18.9-19.2 (H200, 2026-11-25, benchmarks/experiments/exp_decode_one_launch.py,
# GPU time in a CUDA graph); 2 warps and 147 registers fit 6 programs per SM. The
# row-bound term gives that shape 32 splits (the layout's 256 rows / 8).
DECODE_PROGRAMS_PER_SM = 6
DECODE_TILES_PER_SPLIT = 8
DECODE_MIN_PER_SPLIT = 2
DECODE_MAX_SPLITS = 64
DECODE_WARPS = 2
DECODE_STAGES = 2
# NOTE: the cap at cdiv(row bound, DECODE_MIN_PER_SPLIT) took Phi-3-small
# 1x16384 from 33 splits (10 always empty, 16.1 us) to 23 (15.5 us, H200,
# 2026-11-21, commit 221fefc).
#
# NOTE: GQA-packed decode (_bsattn_decode_group_kernel): one program per
# (sequence, KV head, split) reads each K/V block of the union of its query
# heads' rows once (Phi-3-small 64x4096: 671 MB instead of 1.48 GB). Splits
# take interleaved chunks of DECODE_GROUP_MIN_CHUNK..MAX_CHUNK absolute block
# positions; the split count aims at DECODE_GROUP_PROGRAMS_PER_SM * SMs
# programs (4 * 132 on the H200).
# Measured on the H200 (2026-11-21, commit 221fefc; GPU time in a CUDA graph,
# Phi-3-small, bf16): 64x4096 per-head 276 us, packed 169 us (2 splits x
# 32-block chunks, w4 s3; w2 171, s4 169, 1 split 178, 4x16 175, 8x8 173);
# 1x16384 packed 18.8 us
# (64 x 4, w4 s3; 32x8 19.3, 16x16 23.9, w2 19.5, w8 23.0) vs per-head 15.5:
# a lone sequence is latency-bound (few blocks per program, a longer
# prologue), so packing is used only from DECODE_GROUP_MIN_PROGRAMS
# (sequence, KV head) programs on. Crossover (benchmarks/sweep_blocksparse.py
# crossover; per-head / packed): B*Hkv = 8 (1x16384) 16.2 / 18.4 us; 32:
# 4x4096 29.6 / 19.5, 4x16384 51.9 / 47.7; 64 (8x4096) 45.1 / 31.4; 128
# (16x4096) 76.0 / 54.8. B*Hkv = 16 is not measured.
DECODE_GROUP_MIN_PROGRAMS = 32
DECODE_GROUP_PROGRAMS_PER_SM = 4
DECODE_GROUP_MIN_CHUNK = 4
DECODE_GROUP_MAX_CHUNK = 32
DECODE_GROUP_WARPS = 4
DECODE_GROUP_STAGES = 3
PREFILL_STAGES = 3
# NOTE: shared memory per CTA on Hopper is 227 KiB; keep Q + stages x (K + V)
# under this so large D / fp32 still compile. (Hopper's figure: the kernels are
# tuned for it; other GPUs with less shared memory may need fewer stages.)
SMEM_BUDGET = 200 * 1024
# Index arrays (cu_seqlens, crow, col) of either width, each as given: the kernels
# load whatever integer type they receive (vLLM's layouts are int64), so no cast
# (a copy, or a host sync) is needed; an int32 input compiles exactly as before.
INDEX_DTYPES = ("int32", "int64")


@config_class
class BlocksparsePrefillConfig:
    """_bsattn_fwd_kernel (any batch: prefill, prefill over a cached prefix,
    decode, mixed): query tiles of ``block_m`` rows and K/V tiles of ``block_n``
    keys, both powers of two >= 16 (tl.dot) dividing block_size (a query tile
    lies in one layout row)."""
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = PREFILL_STAGES


@config_class
class BlocksparseDecodeConfig:
    """_bsattn_decode_kernel: decode-only batches, one program per (sequence,
    query head, split); with ``splits`` > 1 the last split of a head merges them."""
    splits: int
    num_warps: int = DECODE_WARPS
    num_stages: int = DECODE_STAGES


@config_class
class BlocksparseGroupDecodeConfig:
    """_bsattn_decode_group_kernel: decode-only batches, one program per
    (sequence, KV head, split) over the union of its query heads' rows;
    key blocks in ``chunk``-block chunks (a power of two in [2, 32]) taken
    round-robin by at most ``splits`` splits (> 1: the last split of a program's
    heads merges them)."""
    splits: int
    chunk: int
    num_warps: int = DECODE_GROUP_WARPS
    num_stages: int = DECODE_GROUP_STAGES


CONFIG_TYPES = (BlocksparsePrefillConfig, BlocksparseDecodeConfig, BlocksparseGroupDecodeConfig)
_DECODE_TYPES = (BlocksparseDecodeConfig, BlocksparseGroupDecodeConfig)


@dataclasses.dataclass(frozen=True)
class _Problem:
    tq: int
    hq: int
    hkv: int
    d: int
    dtype: str
    b: int                 # sequences
    decode_only: bool      # one query per sequence (no cu_seqlens_q, Tq == B)
    has_cu_q: bool
    block_size: int
    group: int             # layout rows per query block (q_block_size // block_size)
    nb: int                # layout rows
    nnz: int               # col's last dimension: with nb, a bound on a row's length
    max_seqlen: int
    qk_scale: float
    layout: dict           # strides (constexprs: fixed per model)

    @property
    def d_pad(self) -> int:
        return max(16, next_pow2(self.d))

    @property
    def qpk(self) -> int:
        return self.hq // self.hkv

    @property
    def empty(self) -> bool:
        return self.tq == 0 or self.b == 0 or self.hq == 0

    @property
    def decode_kernels_apply(self) -> bool:
        return self.decode_only and self.group == 1


@memoize
def plan_blocksparse_attention(
    target: Target, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, cu_seqlens_k: ArrayInfo,
    cu_seqlens_q: ArrayInfo | None, crow: ArrayInfo, col: ArrayInfo, *,
    sm_scale: float | None = None, block_size: int = 64, q_block_size: int | None = None,
    max_seqlen: int | None = None, config=None, batch_invariant: bool = False,
) -> Plan:
    """Plan ``blocksparse_flash_attn_varlen_fwd`` (see the adapters' docstrings).

    Array names: q, k, v, cu_seqlens_k, cu_seqlens_q (absent: None), crow, col;
    the plan allocates ``output`` [Tq, Hq, D] (q's dtype) and, for split
    decode, fp32 scratch. Nothing here reads device data: grids come from
    shapes and ``max_seqlen`` (default: what the layout covers).
    ``config``: one of CONFIG_TYPES, selecting the kernel variant and its
    tuning (default: :func:`choose_config`'s choice). ``batch_invariant``:
    each (sequence, head) row's result independent of B, Hq and the GPU's size
    (INVARIANT_NOTE: only decode-only batches need it; a config's choice stands).
    """
    check_config(config, CONFIG_TYPES)
    p = _validate(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col, sm_scale, block_size,
                  q_block_size, max_seqlen)
    if config is not None:
        _check_variant(type(config), p)
        _check_fields(config, p)
    buffers = {"output": Buffer((p.tq, p.hq, p.d), p.dtype)}
    if p.empty:
        return Plan(buffers, (), ("output",))
    config = config or _choose(target, p, bool(batch_invariant))
    if isinstance(config, BlocksparsePrefillConfig):
        launches = (_prefill_launch(p, config),)
    elif isinstance(config, BlocksparseDecodeConfig):
        launches = _decode_launches(p, config, buffers)
    else:
        launches = _group_decode_launches(p, config, buffers)
    return Plan(buffers, launches, ("output",))


def choose_config(target: Target, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo,
                  cu_seqlens_k: ArrayInfo, cu_seqlens_q: ArrayInfo | None, crow: ArrayInfo,
                  col: ArrayInfo, *, sm_scale: float | None = None, block_size: int = 64,
                  q_block_size: int | None = None, max_seqlen: int | None = None, variant=None,
                  splits: int | None = None, batch_invariant: bool = False):
    """The config plan_blocksparse_attention chooses for these arguments, or with
    ``variant`` (one of CONFIG_TYPES) the measured rule's config of that variant;
    ``splits`` (decode variants) asks for that many splits instead of the rule's
    count, the packed kernel's chunk following from it. For tuning sweeps."""
    p = _validate(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col, sm_scale, block_size,
                  q_block_size, max_seqlen)
    invariant = bool(batch_invariant)
    variant = variant or type(_choose(target, p, invariant))
    if variant not in CONFIG_TYPES:
        raise TypeError(f"variant: expected one of {[c.__name__ for c in CONFIG_TYPES]}, got {variant!r}")
    _check_variant(variant, p)
    if variant is BlocksparsePrefillConfig:
        return _prefill_config(target, p)
    if variant is BlocksparseDecodeConfig:
        return _decode_config(target, p, splits, invariant)
    return _group_decode_config(target, p, splits, invariant)


# ---------------------------------------------------------------- validation
def _validate(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col, sm_scale, block_size, q_block_size,
              max_seqlen) -> _Problem:
    _validate_qkv(q, k, v)
    tq, hq, d = q.shape
    b, decode_only = _validate_batch(cu_seqlens_k, cu_seqlens_q, tq, k.shape[0])
    block_size = as_int("block_size", block_size)
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size: expected one of {BLOCK_SIZES}, got {block_size!r}")
    q_block_size = block_size if q_block_size is None else as_int("q_block_size", q_block_size,
                                                                   block_size, INT32_MAX)
    if q_block_size % block_size:
        raise ValueError(f"q_block_size: expected a positive multiple of block_size={block_size}, "
                         f"got {q_block_size!r}")
    layout_heads, nb = _validate_layout(crow, col, hq)
    covered = nb * block_size
    max_seqlen = covered if max_seqlen is None else as_int(
        "max_seqlen", max_seqlen, 1, covered, f"at most the {covered} tokens the layout covers "
        f"({nb} blocks of {block_size})")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else as_float("sm_scale", sm_scale)
    if not abs(scale * LOG2E) <= FP32_MAX:  # the kernel's fp32 scale
        raise ValueError(f"sm_scale: {scale} * log2(e) overflows float32 (the kernel's scale)")
    strides = (*q.strides[:2], *k.strides[:2], *v.strides[:2], hq * d, d,
               crow.strides[0] if layout_heads > 1 else 0, col.strides[0] if layout_heads > 1 else 0)
    layout = dict(zip(("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
                       "stride_vh", "stride_ot", "stride_oh", "stride_crow_h", "stride_col_h"),
                      strides))
    return _Problem(tq, hq, k.shape[1], d, q.dtype, b, decode_only, cu_seqlens_q is not None,
                    block_size, q_block_size // block_size, nb, col.shape[-1], max_seqlen,
                    scale * LOG2E, layout)


def _validate_qkv(q, k, v) -> None:
    check_ndim("q", q, 3, "[Tq, Hq, D]")
    check_dtype("q", q, FLOAT_DTYPES)
    check_ndim("k", k, 3, "[Tk, Hkv, D]")
    check_ndim("v", v, 3, "[Tk, Hkv, D]")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
    for name, info in (("k", k), ("v", v)):
        if info.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {info.dtype} differs from q's {q.dtype}")
    _, hq, d = q.shape
    _, hkv, dk = k.shape
    if dk != d:
        raise ValueError(f"k: head size {dk} differs from q's {d}")
    if not 1 <= d <= MAX_HEAD_SIZE:
        raise ValueError(f"q: head size {d} is not in [1, {MAX_HEAD_SIZE}]")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"k: {hkv} KV heads do not divide q's {hq} heads (Hq % Hkv must be 0)")
    for name, info in (("q", q), ("k", k), ("v", v)):
        check_inner_contiguous(name, info)


def _validate_batch(cu_seqlens_k, cu_seqlens_q, tq, tk) -> tuple[int, bool]:
    """(B, decode-only) from the cumulative lengths' shapes."""
    check_ndim("cu_seqlens_k", cu_seqlens_k, 1, "[B + 1]")
    check_dtype("cu_seqlens_k", cu_seqlens_k, INDEX_DTYPES)
    check_inner_contiguous("cu_seqlens_k", cu_seqlens_k)  # read with unit stride
    if cu_seqlens_k.shape[0] < 1:
        raise ValueError("cu_seqlens_k: expected shape [B + 1], got an empty array")
    b = cu_seqlens_k.shape[0] - 1
    if cu_seqlens_q is not None:
        check_dtype("cu_seqlens_q", cu_seqlens_q, INDEX_DTYPES)
        check_inner_contiguous("cu_seqlens_q", cu_seqlens_q)
        if tuple(cu_seqlens_q.shape) != tuple(cu_seqlens_k.shape):
            raise ValueError(f"cu_seqlens_q: shape {tuple(cu_seqlens_q.shape)} does not match "
                             f"cu_seqlens_k's {tuple(cu_seqlens_k.shape)} (one entry per sequence + 1)")
        return b, False
    if tq == b:
        return b, True
    if tq == tk:
        return b, False
    raise ValueError(f"cu_seqlens_q: needed when q has {tq} tokens, neither B = {b} "
                     f"(decode) nor k's {tk} (full prefill)")


def _validate_layout(crow, col, hq) -> tuple[int, int]:
    """(layout heads, layout rows NB) of the (crow, col) CSR layout."""
    for name, info in (("crow", crow), ("col", col)):
        if info.ndim not in (1, 2):
            raise ValueError(f"sparse_layout: {name} must be [H, ...] or 1-D, got shape {tuple(info.shape)}")
        check_dtype(f"sparse_layout ({name})", info, INDEX_DTYPES)
        check_inner_contiguous(f"sparse_layout ({name})", info)
    if crow.ndim != col.ndim or (crow.ndim == 2 and crow.shape[0] != col.shape[0]):
        raise ValueError(f"sparse_layout: crow {tuple(crow.shape)} and col {tuple(col.shape)} "
                         "disagree on the number of heads")
    layout_heads = crow.shape[0] if crow.ndim == 2 else 1
    if layout_heads not in (1, hq):
        raise ValueError(f"sparse_layout: {layout_heads} layout heads do not match q's {hq} heads "
                         "(expected 1, broadcast, or Hq)")
    nb = crow.shape[-1] - 1
    if nb < 1:
        raise ValueError(f"sparse_layout: crow must have NB + 1 >= 2 entries per head, got {crow.shape}")
    return layout_heads, nb


def _check_variant(cls, p: _Problem) -> None:
    """The kernel variant of config type ``cls`` can run the problem's inputs."""
    if issubclass(cls, _DECODE_TYPES) and not p.decode_kernels_apply:
        raise ValueError(f"config: {cls.__name__} runs decode-only batches (one query per sequence: "
                         "cu_seqlens_q None and Tq == B) with q_block_size == block_size; "
                         "use BlocksparsePrefillConfig for these inputs")


def _check_fields(config, p: _Problem) -> None:
    if config.num_warps not in (1, 2, 4, 8, 16) or config.num_stages < 1:
        raise ValueError(f"config: num_warps must be a power of two <= 16 and num_stages >= 1, "
                         f"got {config}")
    if isinstance(config, BlocksparsePrefillConfig):
        bm, bn, bs = config.block_m, config.block_n, p.block_size
        if bm < 16 or bn < 16 or bs % bm or bs % bn:
            raise ValueError(f"config: block_m and block_n (>= 16, tl.dot) must divide "
                             f"block_size={bs}, got {bm}/{bn}")
        return
    if config.splits < 1:
        raise ValueError(f"config: splits must be >= 1, got {config.splits}")
    if isinstance(config, BlocksparseGroupDecodeConfig):
        c = config.chunk
        if c < 2 or c > 32 or c & (c - 1):
            raise ValueError(f"config: chunk must be a power of two in [2, 32], got {c}")


# ---------------------------------------------------------------- configs (measured rules)
# NOTE (INVARIANT_NOTE): batch_invariant=True. The prefill kernel's rows do the
# same arithmetic in any batch (query tiles start at each sequence's layout
# rows). The decode kernels split a row's keys into a number of splits that
# follows the grid (B * Hq and the SM count), and the GQA-packed kernel, chosen
# from B * Hkv on, computes a row in another order than the per-head one: both
# change the last bits of a row with the batch. Invariant plans take the packed
# kernel whenever query heads share a KV head and the per-head one otherwise,
# and split by the row's bound alone (the layout's extent, or max_seqlen for
# the packed kernel: pass the same max_seqlen to calls that must agree). The
# price (H200 NOTE above): 1x16384 Phi-3-small decode runs packed, 18.8-19.3 us
# against 16.2 us per-head; 64x4096 keeps its kernel at 8 splits of 8 blocks
# instead of 2 of 32 (173 vs 169 us).
INVARIANT_GROUP_CHUNK = 8


def _choose(target: Target, p: _Problem, invariant: bool = False):
    if p.decode_kernels_apply and (p.qpk > 1 if invariant else _group_decode_pays(p)):
        return _group_decode_config(target, p, None, invariant)
    if p.decode_kernels_apply:
        return _decode_config(target, p, None, invariant)
    return _prefill_config(target, p)


def _fit_stages(rows: int, block_n: int, stages: int, p: _Problem) -> int:
    """Fewer pipeline stages until Q + stages x (K + V) fits SMEM_BUDGET. One
    stage of tiles <= 64 always fits (D <= 256 fp32: (64 + 2 * 64) * 256 * 4 B
    = 192 KiB), so the tiles themselves never need to shrink."""
    while stages > 1 and (rows + stages * 2 * block_n) * p.d_pad * ITEMSIZE[p.dtype] > SMEM_BUDGET:
        stages -= 1
    return stages


def _prefill_config(target: Target, p: _Problem) -> BlocksparsePrefillConfig:
    # NOTE: 64 x 64 tiles (one warpgroup, 4 warps, 3 stages: 2 CTAs per SM)
    # match the 64-token layout rows of the models this serves. Measured on the
    # H200 (2026-11-21, commits bd50a48 and b53c130) at 1x16384 (Phi-3-small):
    # 64x64 w4 s3 1431 us; 128-row tiles spanning two layout rows (walking the
    # union of their columns, each half masked to its row; built, measured, then
    # removed) w8 s2 1709 us, w8 s3 1733 us, w4 s2 2138 us, 128x32 w8 s3 2253 us
    # (255 registers: one CTA per SM, the two warpgroups wait on each other);
    # (64,64,8,3) 0.48x, (32,64,4,3) 0.43x, (64,64,4,4) 0.62x the default's
    # speed. See benchmarks/sweep_blocksparse.py. 8 warps for D > 128.
    # NOTE: Gluon forms of this kernel (sm_90, bf16, D 128), measured on the H200 at
    # 1x16384 Phi-3-small and not kept (2026-11-25; the code is commit 375de9c): one
    # query tile per program with S and the previous block's P V issued together
    # and the softmax overlapping the latter, 1313 us against this kernel's 1311 in
    # the same run; pairs of query tiles (two layout rows sharing each K/V load
    # through the union of their columns, 8 warps, one CTA per SM at 185 registers
    # and 128 KB of shared memory) 1509 against 1284 us, 4x4096 924 against 760 us.
    # NOTE: warp-specialised Gluon forms (sm_90, bf16, D 128; the code is commit
    # cc598c4), bitwise equal to this kernel, measured on the H200 (2026-11-25,
    # Phi-3-small, 1x16384 / 4x4096, against this kernel in the same runs): one CTA
    # of two query tiles with a loader warpgroup and a consumer warpgroup per tile,
    # 2-slot rings per tile and one loader 1449 / 882 us against 1291 / 781; a
    # loader per tile and 3 slots 1340 / 819 against 1290 / 767; with S and the
    # previous P V issued together 1361 / 828 against 1319 / 783; the two tiles of
    # a GQA pair sharing one ring over the union of their columns (each shared
    # local block read once) 1342 / 796 against 1294 / 774. Four tiles per CTA
    # (the whole GQA group) leave 120 registers per consumer: 1.8 KB of spills.
    bm = bn = min(p.block_size, 64)
    return BlocksparsePrefillConfig(bm, bn, 8 if p.d_pad > 128 else 4,
                                    _fit_stages(bm, bn, PREFILL_STAGES, p))


def _decode_block_n(p: _Problem) -> int:
    return min(p.block_size, 64)


def _decode_config(target: Target, p: _Problem, splits: int | None = None,
                   invariant: bool = False) -> BlocksparseDecodeConfig:
    if splits is not None:
        return BlocksparseDecodeConfig(splits, DECODE_WARPS, DECODE_STAGES)
    row_bound = cdiv(min(p.nnz, p.nb) * p.block_size, _decode_block_n(p))  # K/V tiles in a row, at most
    grid_splits = 0 if invariant else DECODE_PROGRAMS_PER_SM * target.num_sms // max(1, p.b * p.hq)
    # a split below DECODE_MIN_PER_SPLIT tiles never has work: cap there
    splits = max(1, min(max(grid_splits, cdiv(row_bound, DECODE_TILES_PER_SPLIT)),
                        cdiv(row_bound, DECODE_MIN_PER_SPLIT), DECODE_MAX_SPLITS))
    return BlocksparseDecodeConfig(splits, DECODE_WARPS, DECODE_STAGES)


def _group_heads(p: _Problem) -> int:
    """Query heads per packed program (the dots' M rows: at least 16 with padding)."""
    return max(2, min(next_pow2(p.qpk), 16))


def _group_decode_pays(p: _Problem) -> bool:
    return p.qpk > 1 and p.b * p.hkv * cdiv(p.qpk, _group_heads(p)) >= DECODE_GROUP_MIN_PROGRAMS


def _group_decode_config(target: Target, p: _Problem, want: int | None = None,
                         invariant: bool = False) -> BlocksparseGroupDecodeConfig:
    positions = cdiv(p.max_seqlen, p.block_size)           # key blocks a row can reach
    progs = p.b * p.hkv * cdiv(p.qpk, _group_heads(p))
    if want is None and invariant:  # INVARIANT_NOTE: from the row's bound alone
        want = min(DECODE_MAX_SPLITS, cdiv(positions, INVARIANT_GROUP_CHUNK))
    want = want or max(1, cdiv(DECODE_GROUP_PROGRAMS_PER_SM * target.num_sms, progs))
    chunk = min(max(next_pow2(cdiv(positions, want)), DECODE_GROUP_MIN_CHUNK), DECODE_GROUP_MAX_CHUNK)
    stages = _fit_stages(max(16, _group_heads(p)), _decode_block_n(p), DECODE_GROUP_STAGES, p)
    return BlocksparseGroupDecodeConfig(max(1, min(want, cdiv(positions, chunk))), chunk,
                                        DECODE_GROUP_WARPS, stages)


# ---------------------------------------------------------------- launches
_INPUTS = dict(q_ptr="q", k_ptr="k", v_ptr="v", cu_k_ptr="cu_seqlens_k", crow_ptr="crow",
               col_ptr="col")


def _query_tiles(p: _Problem, bm: int) -> int:
    """A bound on the query tiles of all sequences (the prefill grid's tiles)."""
    q_tokens = p.b if p.decode_only else p.tq
    # tiles of one sequence <= ceil(q_len / BM) + 1 (alignment) and <= ceil(max_seqlen / BM)
    return min(cdiv(q_tokens, bm) + 2 * p.b, p.b * cdiv(p.max_seqlen, bm))


def _prefill_launch(p: _Problem, config: BlocksparsePrefillConfig, with_lse: bool = False) -> Launch:
    """_bsattn_fwd_kernel, or with ``with_lse`` _bsattn_fwd_lse_kernel (also writes
    buffer "lse" [Tq, Hq] fp32: the variant a backward needs)."""
    bm = config.block_m
    n_flat = _query_tiles(p, bm)
    return Launch(
        kernel=_bsattn_fwd_lse_kernel if with_lse else _bsattn_fwd_kernel, grid=(n_flat * p.hq,),
        params=dict(_INPUTS, cu_q_ptr="cu_seqlens_q" if p.has_cu_q else "cu_seqlens_k",
                    num_seqs=Scalar(p.b), out_ptr="output", **({"lse_ptr": "lse"} if with_lse else {})),
        writes=("out_ptr", "lse_ptr") if with_lse else ("out_ptr",),
        constexprs=dict(num_heads=p.hq, num_rows=p.nb, head_size=p.d, num_queries_per_kv=p.qpk,
                        **p.layout, BLOCK_SIZE=p.block_size, BLOCK_M=bm, BLOCK_N=config.block_n,
                        BLOCK_D=p.d_pad, GROUP=p.group, B_P2=max(2, next_pow2(p.b)),
                        NNZ_P2=max(2, next_pow2(min(p.nnz, p.nb))), CNT_CHUNK=64,
                        DECODE_Q=p.decode_only, EVEN_D=p.d_pad == p.d,
                        IS_FP32=p.dtype == "float32", QK_SCALE=p.qk_scale),
        num_warps=config.num_warps, num_stages=config.num_stages)


def _partials(p: _Problem, splits: int, counters: int, buffers: dict) -> int:
    """Adds the split-decode scratch to ``buffers``; returns LSE_OFFSET.

    "partials": partial outputs [B, Hq, S, D] then their log2-sum-exps
    [B, Hq, S], in one fp32 buffer; "counters": one int32 ticket counter per
    merged row (or group of rows), zero before and after the launch. Both are
    per-stream scratch (no allocation per call: host time). One split writes
    the output directly; both are then placeholders."""
    lse_offset = p.b * p.hq * splits * p.d
    one = splits <= 1
    buffers["partials"] = Buffer((1,) if one else (lse_offset + p.b * p.hq * splits,), "float32",
                                 placeholder=one, per_stream=not one)
    buffers["counters"] = Buffer((1,) if one else (counters,), "int32", zero_init=not one,
                                 placeholder=one, per_stream=not one)
    return lse_offset


def _decode_launches(p: _Problem, config: BlocksparseDecodeConfig, buffers: dict) -> tuple:
    splits = config.splits
    lse_offset = _partials(p, splits, p.b * p.hq, buffers)
    decode = Launch(
        kernel=_bsattn_decode_kernel, grid=(p.b * p.hq * splits,),
        params=dict(_INPUTS, out_ptr="output", part_ptr="partials", cnt_ptr="counters"),
        writes=("out_ptr", "part_ptr", "cnt_ptr"),
        constexprs=dict(num_heads=p.hq, head_size=p.d, num_queries_per_kv=p.qpk, **p.layout,
                        BLOCK_SIZE=p.block_size, BLOCK_N=_decode_block_n(p), BLOCK_D=p.d_pad,
                        NUM_SPLITS=splits, S_P2=max(2, next_pow2(splits)),
                        MIN_PER_SPLIT=DECODE_MIN_PER_SPLIT,
                        LSE_OFFSET=lse_offset, EVEN_D=p.d_pad == p.d, QK_SCALE=p.qk_scale),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return (decode,)


# The last split of a packed program merges its heads' partials, MERGE_HEADS
# heads per round of loads: at most MERGE_VALUES fp32 partial values in flight
# (64 per thread of the 4-warp program; its main loop's registers are free then).
# NOTE: merging a 4-head block's heads one after another cost 27.0 vs 20.1 us at
# 4x4096 (Phi-3-small, H200, 2026-11-25); in one round 20.4 us. The cap keeps the
# kernel's registers (offline sm_90 compile, 32 query / 2 KV heads, 16 sequences
# x 4096, 16 splits: 16-head blocks): 8192 values (4 heads a round) 140 registers,
# as many as without the merge; 16384 168 and a 4-byte spill; 32768 255 and 204.
MERGE_VALUES = 8192


def _heads_per_merge(heads: int, splits: int, d_pad: int) -> int:
    per_head = max(2, next_pow2(splits)) * d_pad
    return max(1, min(heads, 1 << max(0, (MERGE_VALUES // per_head).bit_length() - 1)))


def _group_decode_launches(p: _Problem, config: BlocksparseGroupDecodeConfig, buffers: dict) -> tuple:
    heads = _group_heads(p)
    n_chunks = cdiv(cdiv(p.max_seqlen, p.block_size), config.chunk)
    splits = max(1, min(config.splits, n_chunks))     # a split without a chunk has no work
    programs = p.b * p.hkv * cdiv(p.qpk, heads)
    lse_offset = _partials(p, splits, programs, buffers)
    decode = Launch(
        kernel=_bsattn_decode_group_kernel, grid=(programs * splits,),
        params=dict(_INPUTS, out_ptr="output", part_ptr="partials", cnt_ptr="counters"),
        writes=("out_ptr", "part_ptr", "cnt_ptr"),
        constexprs=dict(num_heads=p.hq, head_size=p.d, num_queries_per_kv=p.qpk, **p.layout,
                        BLOCK_SIZE=p.block_size, BLOCK_M=max(16, heads), BLOCK_N=_decode_block_n(p),
                        BLOCK_D=p.d_pad, HEADS=heads, CHUNK=config.chunk, CNT_CHUNK=64,
                        NUM_SPLITS=splits, S_P2=max(2, next_pow2(splits)),
                        MERGE_HEADS=_heads_per_merge(heads, splits, p.d_pad),
                        NUM_SUB=cdiv(n_chunks, splits), LSE_OFFSET=lse_offset,
                        EVEN_D=p.d_pad == p.d, IS_FP32=p.dtype == "float32",
                        QK_SCALE=p.qk_scale),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return (decode,)

"""The split-KV decode path of unified_attention: every sequence with 1 <= qlen
<= DECODE_MAX_Q new tokens (the kernels read qlen from cu_seqlens_q and skip
the others at once), in one launch of _unified_decode_kernel plus, where a
sequence can need more than one key chunk, one of the combine kernel.

Batch invariance: the chunking rule (decode_kernels._sequence_chunks) and
every constexpr that shapes a sequence's arithmetic (tile sizes, warps, rows
per program) come from the config and the layout only, never from B, T,
max_seqlen_q / max_seqlen_k or the GPU: those size the grid and the scratch
(runtime integers), so a sequence's output is bitwise the same in any batch.
"""
from __future__ import annotations

import math

from .._plan import FP8_MAX, Buffer, Launch, Scalar, cdiv, config_class, next_pow2
from .._triton_utils import FP8_ROUNDING
from .decode_kernels import _unified_decode_combine_kernel, _unified_decode_kernel
from .problem import DECODE_MAX_Q, FP8_E4M3


@config_class
class UnifiedDecodeConfig:
    """_unified_decode_kernel: key tiles of ``block_n`` tokens (a power of two
    >= 16); a sequence's keys split into chunks of ``chunk_min`` keys (a
    multiple of block_n), doubled until at most ``max_chunks`` (a power of two)
    remain; ``prefetch_ids`` loads a tile's block ids one tile ahead.
    Changing any field may change results in the last bits (the chunking and
    the tiles set the summation order): a config is fixed per layout, never
    chosen from the batch."""
    block_n: int = 64
    chunk_min: int = 1024
    max_chunks: int = 64
    num_warps: int = 4
    num_stages: int = 3
    prefetch_ids: bool = True


DECODE_CONFIGS = (UnifiedDecodeConfig,)

# NOTE: a starting point (2026-11-28), to be measured on the H200 at the
# issue's decode shapes (benchmarks/experiments/exp_unified_decode.py).
DEFAULT_CONFIG = UnifiedDecodeConfig()
# rows of one program's tiles for a query of up to DECODE_MAX_Q tokens: at most
# ACC_MAX / BLOCK_D (the fp32 accumulator's elements; larger GQA groups take
# several passes over the chunk for a long query).
# NOTE: 128 rows x 256 (fp32, D 256, a 16-head group) took ptxas 145 s to compile
# offline for sm_90 (64 rows: see tests/test_offline_compile.py's case)
ACC_MAX = 128 * 128
COMBINE_WARPS = 4


def decode_config(target, p) -> UnifiedDecodeConfig:
    """The measured config for ``p``'s layout (never its batch sizes)."""
    return DEFAULT_CONFIG


def _check(config: UnifiedDecodeConfig):
    bn = config.block_n
    if bn < 16 or bn & (bn - 1):
        raise ValueError(f"config: block_n must be a power of two >= 16, got {bn}")
    if config.chunk_min < bn or config.chunk_min % bn:
        raise ValueError(f"config: chunk_min must be a multiple of block_n, got {config.chunk_min}")
    mc = config.max_chunks
    if mc < 1 or mc & (mc - 1):
        raise ValueError(f"config: max_chunks must be a power of two, got {mc}")


def decode_launches(target, p, config=None):
    """(buffers, launches) of the decode path for Problem ``p``."""
    config = config or decode_config(target, p)
    _check(config)
    rows_small = max(16, next_pow2(p.group))
    rows_big = max(rows_small, min(ACC_MAX // p.block_d, next_pow2(p.group * DECODE_MAX_Q)))
    # grid and scratch bounds (runtime values; a sequence's chunk count is at
    # most its span over chunk_min and at most max_chunks)
    max_len = max(0, min(p.max_seqlen_k, p.table_width * p.block_size))
    slots = max(1, min(config.max_chunks, cdiv(max_len, config.chunk_min)))
    rows_per_seq = max(1, min(p.max_seqlen_q, DECODE_MAX_Q))
    split = slots > 1
    n_rows = p.bsz * rows_per_seq
    buffers = {
        "decode_o": Buffer((n_rows, p.hq, slots, p.d) if split else (1,), "float32",
                           placeholder=not split, per_stream=split),
        "decode_m": Buffer((n_rows, p.hq, slots) if split else (1,), "float32",
                           placeholder=not split, per_stream=split),
        "decode_l": Buffer((n_rows, p.hq, slots) if split else (1,), "float32",
                           placeholder=not split, per_stream=split),
    }
    s = p.strides
    out_fp8 = p.out_dtype if p.out_fp8 else None
    fp8 = dict(OUT_FP8=p.out_fp8, FP8_MAX=FP8_MAX.get(out_fp8, 0.0),
               **dict(zip(("FP8_MANT_BITS", "FP8_MIN_NORMAL", "FP8_SUBNORMAL_MAGIC"),
                          FP8_ROUNDING.get(out_fp8, (0, 0.0, 0.0)))))
    window = dict(HAS_WINDOW=p.window_left >= 0, WINDOW=max(p.window_left, 0))
    chunking = dict(BLOCK_N=config.block_n, CACHE_BLOCK=p.block_size, MAX_Q=DECODE_MAX_Q)
    kd = p.k_descale_strides or (0, 0)
    vd = p.v_descale_strides or (0, 0)
    runtime = dict(table_width=Scalar(p.table_width), rows_per_seq=Scalar(rows_per_seq),
                   num_slots=Scalar(slots), chunk_min=Scalar(config.chunk_min),
                   max_chunks=Scalar(config.max_chunks))
    decode = Launch(
        kernel=_unified_decode_kernel, grid=(p.bsz, p.hkv, slots),
        params=dict(q_ptr="q", k_ptr="k", v_ptr="v", cu_seqlens_q_ptr="cu_seqlens_q",
                    seqused_k_ptr="seqused_k", block_table_ptr="block_table",
                    causal_ptr="causal_flags" if p.causal_flags else "cu_seqlens_q",
                    q_descale_ptr="q_descale" if p.q_fp8 else "q",
                    k_descale_ptr="k_descale" if p.kv_fp8 else "q",
                    v_descale_ptr="v_descale" if p.kv_fp8 else "q",
                    alibi_ptr="alibi_slopes" if p.alibi else "q",
                    sinks_ptr="sinks" if p.sinks else "q",
                    out_scale_ptr="output_scale" if p.out_fp8 else "q", out_in_ptr="out",
                    stride_bt_b=Scalar(p.table_strides[0]), stride_bt_n=Scalar(p.table_strides[1]),
                    num_blocks=Scalar(max(p.num_blocks, 1)), **runtime,
                    out_ptr="out", part_o_ptr="decode_o", part_m_ptr="decode_m",
                    part_l_ptr="decode_l"),
        writes=("out_ptr", "part_o_ptr", "part_m_ptr", "part_l_ptr"),
        constexprs=dict(
            SCALE=p.scale, SOFTCAP=p.softcap, NUM_Q_HEADS=p.hq, GROUP=p.group, HEAD_D=p.d,
            BLOCK_D=p.block_d, ID_RUN=math.gcd(config.block_n, p.block_size), OFFS32=p.offs32,
            ROWS_SMALL=rows_small, ROWS_BIG=rows_big, PREFETCH_IDS=bool(config.prefetch_ids),
            CAUSAL=p.causal, HAS_CAUSAL_FLAGS=p.causal_flags, HAS_ALIBI=p.alibi,
            ALIBI_SQRT=p.alibi_sqrt, HAS_SINKS=p.sinks, KV_FP8=p.kv_fp8,
            KV_U8=p.kv_dtype == "uint8", Q_FP8=p.q_fp8, COMPUTE_F16=p.compute_dtype == "float16",
            **chunking, **window, **fp8,
            stride_q_t=s["q_t"], stride_q_h=s["q_h"], stride_o_t=s["o_t"], stride_o_h=s["o_h"],
            stride_kc_b=s["kc_b"], stride_kc_t=s["kc_t"], stride_kc_h=s["kc_h"],
            stride_vc_b=s["vc_b"], stride_vc_t=s["vc_t"], stride_vc_h=s["vc_h"],
            stride_kd_b=kd[0], stride_kd_h=kd[1], stride_vd_b=vd[0], stride_vd_h=vd[1]),
        num_warps=config.num_warps, num_stages=config.num_stages)
    if not split:
        return buffers, [decode]
    combine = Launch(
        kernel=_unified_decode_combine_kernel, grid=(p.bsz, p.hq),
        params=dict(cu_seqlens_q_ptr="cu_seqlens_q", seqused_k_ptr="seqused_k",
                    sinks_ptr="sinks" if p.sinks else "q",
                    out_scale_ptr="output_scale" if p.out_fp8 else "q",
                    part_o_ptr="decode_o", part_m_ptr="decode_m", part_l_ptr="decode_l",
                    out_in_ptr="out", **runtime, out_ptr="out"),
        writes=("out_ptr",),
        constexprs=dict(NUM_Q_HEADS=p.hq, HEAD_D=p.d, BLOCK_D=p.block_d, **chunking,
                        BLOCK_S=max(2, config.max_chunks), HAS_SINKS=p.sinks, **window, **fp8,
                        stride_o_t=s["o_t"], stride_o_h=s["o_h"]),
        num_warps=COMBINE_WARPS, num_stages=1)
    return buffers, [decode, combine]

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
from .problem import DECODE_MAX_Q


@config_class
class UnifiedDecodeConfig:
    """_unified_decode_kernel: key tiles of ``block_n`` tokens (a power of two
    >= 16); a sequence's keys split into chunks of ``chunk_min`` keys (a
    multiple of block_n), doubled until at most ``max_chunks`` (a power of two)
    remain; ``fp8_mode`` for an fp8 cache with 16-bit queries: 0 dots in q's
    dtype, 1 in fp16 (q converted to fp16: exact for |q| in fp16's normal range).
    These fields set the summation order, so changing one may change results
    in the last bits: a config is fixed per layout, never chosen from the
    batch. ``chunks_per_program`` > 0 fixes the work split (how many
    consecutive chunks one program takes; 0: chosen from the batch and the
    GPU): results never depend on it."""
    block_n: int = 64
    chunk_min: int = 1024
    max_chunks: int = 64
    num_warps: int = 4
    num_stages: int = 3
    fp8_mode: int = 1
    chunks_per_program: int = 0


DECODE_CONFIGS = (UnifiedDecodeConfig,)

# NOTE: measured on the H200 (2026-11-28, benchmarks/experiments/exp_unified_decode.py,
# sweeps "first" at a99a7ae and "slim" at the commit of this NOTE; Llama-8B heads
# 32/8 x 128, block 16, bf16 q, GPU time with the L2 flushed, TB/s of the K/V read;
# copy 4.25 TB/s; vLLM 0.33's kernel in the same runs: 291 / 351 / 647 us, B1 x 4096
# 45 us). Config (block_n, chunk_min, max_chunks, warps, stages):
#   (64, 4096, 32, 4, 3): B64 x 4096 260 us (4.13 TB/s), B1 x 131072 143 us (3.76),
#     mixed decode part (127 x 4096 beside a 2048-token chunk) 505 us (4.22),
#     B1 x 4096 77 us (8 programs: one chunk per sequence and kv head);
#   (64, 2048, 64, 4, 3): 277 / 148 / 529 us, B1 x 4096 50 us;
#   (64, 1024, 64, 4, 3): 281 / 148 / 537 us, B1 x 4096 31 us;
#   (64, 512, 64, 4, 3): 288 / 148 / 551 us, B1 x 4096 21 us;
#   (128, 1024, 64, 4, 2) 285 / 150 / 547; at 1024-key chunks also (64, 4) 297 us and
#   (32, 4) 310 us at B64, 8 warps 368 us, 2 stages 314 us, ids not prefetched 322 us.
# Longer chunks win at large batches (each extra chunk stores a partial state and
# the combine merges it: B64 x 4096 260 -> 281 us from one to four chunks) and lose
# at small ones (fewer programs); batch invariance forbids choosing them from the
# batch. The default takes 1024-key chunks: faster than vLLM's kernel at every
# shape measured (B64 x 4096 281 vs 291 us, B1 x 4096 31 vs 45 us, B1 x 131072
# 148 vs 647 us) at 3.82 TB/s for B64 x 4096, 2% short of the 3.9; the
# 4096-key chunks that reach 4.13 TB/s there were 1.7x slower than vLLM at
# B1 x 4096 (77 vs 45 us), a common latency-bound decode.
# fp8 cache (fp8_mode, B64 x 4096): 0 (dots in bf16: e4m3 -> bf16 is four
# conversions per two values) 333 us at 1024-key chunks; 1 (fp16 dots) 258 us
# (2.08 TB/s of fp8 bytes); e4m3 -> fp16 by integer ops (fp8_mode 2 then,
# removed) 351 us at 1024-key chunks, 313 us at 4096 (the kernel spilled). The
# default (fp8_mode 1, 1024-key chunks) is the 258 us row: the fp8 path stays
# compute-bound (converting e4m3 for the dots), short of the 3.4 TB/s. Other head sizes, fp32 and block
# sizes run this config unmeasured.
DEFAULT_CONFIG = UnifiedDecodeConfig()
# rows of one program's tiles for a query of up to DECODE_MAX_Q tokens: at most
# ACC_MAX / BLOCK_D (the fp32 accumulator's elements; larger GQA groups take
# several passes over the chunk for a long query).
# NOTE: 128 rows x 256 (fp32, D 256, a 16-head group) took ptxas 145 s to compile
# offline for sm_90 (64 rows: see tests/test_offline_compile.py's case)
ACC_MAX = 128 * 128
COMBINE_WARPS = 4
# NOTE: the work split aims at 2 programs per SM (B1 x 131072 at 1024-key chunks,
# H200: 148 us with 2 chunks per program, 178 us with 4 (1 program per SM))
PROGRAMS_PER_SM = 2


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
    if config.fp8_mode not in (0, 1):
        raise ValueError(f"config: fp8_mode must be 0 or 1, got {config.fp8_mode}")
    if config.chunks_per_program < 0:
        raise ValueError(f"config: chunks_per_program must be >= 0, got {config.chunks_per_program}")


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
    # the work split: consecutive chunks per program, for about PROGRAMS_PER_SM
    # programs per SM if every sequence had the most chunks (speed only)
    per_program = config.chunks_per_program or cdiv(p.bsz * p.hkv * slots,
                                                    PROGRAMS_PER_SM * target.num_sms)
    per_program = max(1, min(slots, per_program))
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
    kv_f16 = p.kv_fp8 and config.fp8_mode > 0 and p.compute_dtype != "float32"
    decode = Launch(
        kernel=_unified_decode_kernel, grid=(p.bsz, p.hkv, cdiv(slots, per_program)),
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
                    chunks_per_program=Scalar(per_program),
                    out_ptr="out", part_o_ptr="decode_o", part_m_ptr="decode_m",
                    part_l_ptr="decode_l"),
        writes=("out_ptr", "part_o_ptr", "part_m_ptr", "part_l_ptr"),
        constexprs=dict(
            SCALE=p.scale, SOFTCAP=p.softcap, NUM_Q_HEADS=p.hq, GROUP=p.group, HEAD_D=p.d,
            BLOCK_D=p.block_d, ID_RUN=math.gcd(config.block_n, p.block_size), OFFS32=p.offs32,
            ROWS_SMALL=rows_small, ROWS_BIG=rows_big,
            CAUSAL=p.causal, HAS_CAUSAL_FLAGS=p.causal_flags, HAS_ALIBI=p.alibi,
            ALIBI_SQRT=p.alibi_sqrt, HAS_SINKS=p.sinks, KV_FP8=p.kv_fp8,
            KV_U8=p.kv_dtype == "uint8", Q_FP8=p.q_fp8, COMPUTE_F16=p.compute_dtype == "float16",
            KV_F16=kv_f16,
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

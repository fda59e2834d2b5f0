"""The prefill path of unified_attention: sequences with more than DECODE_MAX_Q
new tokens, on context_attention_fwd's kernels (core_kernels/prefix_prefill).

vLLM's flash cache layout k, v [num_blocks, block_size, Hkv, D] is one of the
layouts those kernels read through constexpr strides: K as [num_blocks, Hkv,
D // X, block_size, X] with X = BLOCK_D (one vector of the whole head), token
stride KC_STRIDE_T = k.stride(1) and channel stride 1; V with token stride
VC_STRIDE_T = v.stride(1) and channel stride 1. The new tokens' K/V are read
from the cache (CACHE_NEW), and the kernels' unified_attention options (MIN_Q,
SOFTCAP2, ALIBI_MODE, CAUSAL_FLAGS, SYM_WINDOW, Q_FP8, per-head descales,
FLAT_GRID; see _prefix_prefill_kernel) cover the rest of the contract.
Programs of sequences with at most DECODE_MAX_Q new tokens exit at once: the
decode path (decode_plan.py) writes their rows.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .._plan import FP8_MAX, ITEMSIZE, Buffer, Launch, Scalar, cdiv, config_class
from .._triton_utils import FP8_ROUNDING
from ..prefix_prefill.kernels import _prefix_prefill_gather_kernel, _prefix_prefill_kernel
from ..prefix_prefill.plan import (GATHER_MAX_BYTES, GATHER_MIN_REUSE, _scratch_tokens, check_tiles,
                                   rows_and_pack)
from .problem import DECODE_MAX_Q, FP8_E4M3, LOG2E, Problem


@config_class
class UnifiedPrefillConfig:
    """Tiling of the prefill path: BLOCK_M query rows x BLOCK_N keys (powers of
    two >= 16; BLOCK_M shrinks for short queries), ``num_warps``,
    ``num_stages``; ``pack_gqa`` puts the query heads of one kv head in the
    rows of one tile; ``prefetch_ids`` loads the paged loop's block ids that
    many tiles ahead (0-2); ``gather`` True / False forces the dense scratch
    copy of the keys on / off, None chooses; ``flat_grid`` True / False forces
    the grid over all sequences' row tiles (see the kernel's FLAT_GRID) on /
    off, None chooses."""
    block_m: int
    block_n: int
    num_warps: int = 8
    num_stages: int = 3
    pack_gqa: bool = True
    prefetch_ids: int = 1
    gather: bool | None = None
    flat_grid: bool | None = None


PREFILL_CONFIGS = (UnifiedPrefillConfig,)

C = UnifiedPrefillConfig
# Tiles by (compute itemsize, BLOCK_D) for the paged loop (keys read through
# the block table); GATHER_CONFIGS when the keys were gathered into scratch.
# NOTE: measured 2026-11-28 with benchmarks/experiments/exp_unified_prefill.py
# (results/2026-11-28-unified-prefill/), bf16, 32/8 heads, block 16, GPU time
# by do_bench, on an H100 80GB HBM3 (two runs: the device tool's nvidia-h200
# kind served one) and on an H200 (one run; vLLM 0.33's kernel in the same
# runs: 4203 / 4249 us at B4, 7368 / 7517 us at B1). D 128: on the flash
# layout the paged loop is 4-10% slower than the gathered one, not the 1.5x
# of the prefix layout (whose K rows are 16 bytes). Paged, (128, 128, 8 warps,
# 3 stages, ids one tile ahead) was the best tried: B4 x q1024 over 4096
# 716-732 us, B1 x 8192 1233-1273 us, the mixed batch's 2048-token chunk
# 684-705 us (447-450 TFLOP/s); (128, 64) with 3 or 4 stages 722-745 /
# 1304-1320 / 722-726 us; ids not prefetched 938 / 1620 / 972 us; ids two
# tiles ahead 994 / 1714 / 1037 us; 2 stages 841 / 1414 / 850 us; (64, 64,
# 4 warps) 822 / 1434 / 805 us. Gathered, (128, 64, 8, 3) was the best:
# 685-704 us at B4 (446 TFLOP/s), 1141-1172 us at B1 x 8192 (482 TFLOP/s on
# the H200); 4 stages 693 / 1208 us, 2 stages 867 / 1414 us, (128, 128)
# 756 / 1304 us. An fp8 cache (H200, B4): gathered (widened to bf16) 728 us,
# paged 1193 us. D 64 (H200, B4, one run): paged (128, 128, 4 warps) 413 us,
# (128, 64, 4) 430, gathered (128, 64, 4) 458, (128, 64, 8) 524. D 256 (same):
# paged (128, 64, 8 warps, 2 stages) 1451 us, (64, 64, 4, 2) 1876, gathered
# (64, 64, 4, 2) 1729. fp32 and D 16 / 32 keep context_attention_fwd's
# starting points (prefix_prefill/plan.py).
PAGED_CONFIGS = {
    (2, 16): C(128, 64, 4, 3), (2, 32): C(128, 64, 4, 3), (2, 64): C(128, 128, 4, 3),
    (2, 128): C(128, 128, 8, 3), (2, 256): C(128, 64, 8, 2),
    (4, 16): C(64, 64, 4, 2), (4, 32): C(64, 64, 4, 2), (4, 64): C(64, 64, 4, 2),
    (4, 128): C(64, 32, 4, 2), (4, 256): C(32, 32, 4, 2),
}
GATHER_CONFIGS = {(2, 128): C(128, 64, 8, 3, True, 0, gather=True)}
del C

# The keys of every sequence (context and new tokens) gathered into scratch
# [B, Hkv, ctx_cap, D] (ctx_cap from max_seqlen_k, see prefix_prefill's
# _scratch_tokens): only where GATHER_CONFIGS has an entry, each key tile is
# read by at least GATHER_MIN_REUSE row tiles and the scratch stays under
# GATHER_MAX_BYTES. The mixed batch (127 decodes x 4096 and one chunk over
# 8192) would need 4.3 GB: it runs the paged loop, 4-10% slower per FLOP.

# NOTE: the flat grid (the kernel's FLAT_GRID) against the (max tiles, heads,
# B) grid, same runs: the mixed batch's chunk 684-705 us flat vs 812-833 us
# (127 of every 128 programs of the per-sequence grid exit at once); equal
# within 2% at B4 x q1024 (gathered 685-692 vs 688-704 us, paged 716-724 vs
# 721-724 us) and B1 x 8192 (1141-1170 vs 1141-1165 us). Taken unless it has over 25% more
# programs than the per-sequence grid (many short prefills: its binary search,
# log2 B loads per program, then buys nothing).
FLAT_MAX_EXTRA = 1.25


def _key(p: Problem) -> tuple:
    return (4 if p.compute_dtype == "float32" else 2, p.block_d)


def _rows_and_pack(p: Problem, config: UnifiedPrefillConfig) -> tuple[int, int]:
    return rows_and_pack(p.max_seqlen_q, p.group, config)


def _check_tiles(config: UnifiedPrefillConfig) -> None:
    check_tiles(config)
    for name in ("gather", "flat_grid", "pack_gqa"):
        value = getattr(config, name)
        if not (isinstance(value, bool) or (value is None and name != "pack_gqa")):
            raise ValueError(f"config: {name} must be True or False (or None: automatic), got {config}")


def _scratch_dtype(p: Problem) -> str:
    return p.compute_dtype if p.kv_fp8 else p.kv_dtype


def choose_prefill_config(target, p: Problem, config: UnifiedPrefillConfig | None = None):
    """(config completed: block_m shrunk, gather and flat_grid decided; PACK;
    scratch tokens per sequence)."""
    if config is not None:
        _check_tiles(config)
    key = _key(p)
    chosen = config or PAGED_CONFIGS.get(key) or PAGED_CONFIGS[(key[0], 256)]
    ctx_cap = _scratch_tokens(p.table_width, p.block_size, p.max_seqlen_k)
    gather = chosen.gather
    if gather is None:
        block_m, pack = _rows_and_pack(p, chosen)
        reuse = cdiv(p.max_seqlen_q, block_m // pack)
        scratch_bytes = 2 * p.bsz * p.hkv * ctx_cap * p.d * ITEMSIZE[_scratch_dtype(p)]
        gather = key in GATHER_CONFIGS and reuse >= GATHER_MIN_REUSE and scratch_bytes <= GATHER_MAX_BYTES
    gather = bool(gather) and ctx_cap > 0
    if gather and config is None:
        chosen = GATHER_CONFIGS[key]
    block_m, pack = _rows_and_pack(p, chosen)
    flat = chosen.flat_grid
    if flat is None:  # see FLAT_MAX_EXTRA
        tokens = block_m // pack
        flat = _flat_rows(p, tokens) <= FLAT_MAX_EXTRA * cdiv(p.max_seqlen_q, tokens)
    return dataclasses.replace(chosen, block_m=block_m, gather=gather, flat_grid=bool(flat)), pack, ctx_cap


def _flat_rows(p: Problem, tokens: int) -> int:
    """Grid axis 0 of the flat grid: n0 with n0 * B >= T // TOKENS + B slots."""
    return cdiv(p.t // tokens + p.bsz, p.bsz)


def _window(p: Problem) -> int:
    """The kernels' WINDOW (keys j > p - WINDOW visible): left + 1, 0 for none.
    NOTE: capped at 2**30 so that position arithmetic stays inside int32 (a
    window that wide reaches past any cache that fits in memory)."""
    return 0 if p.window_left < 0 else min(p.window_left + 1, 1 << 30)


def _table_params(p: Problem, ctx_cap: int) -> dict:
    return dict(b_loc_ptr="block_table", b_start_loc_ptr="cu_seqlens_q", b_seq_len_ptr="seqused_k",
                stride_bl_b=Scalar(p.table_strides[0], "i64"),
                stride_bl_n=Scalar(p.table_strides[1], "i64"), ctx_cap=Scalar(ctx_cap, "i32"))


def _cache_strides(p: Problem) -> dict:
    s = p.strides
    return dict(stride_kc_b=s["kc_b"], stride_kc_h=s["kc_h"], stride_kc_dx=0, KC_STRIDE_T=s["kc_t"],
                KC_STRIDE_X=s["kc_d"], stride_vc_b=s["vc_b"], stride_vc_h=s["vc_h"],
                stride_vc_d=s["vc_d"], VC_STRIDE_T=s["vc_t"])


def _gather_launch(p: Problem, ctx_cap: int) -> Launch:
    gather_n = 32 if p.block_d > 128 else 64
    window = _window(p)
    return Launch(
        kernel=_prefix_prefill_gather_kernel,
        grid=(cdiv(ctx_cap, gather_n), p.hkv, p.bsz),
        params=dict(k_cache_ptr="k", v_cache_ptr="v", **_table_params(p, ctx_cap),
                    k_scr_ptr="k_scratch", v_scr_ptr="v_scratch"),
        writes=("k_scr_ptr", "v_scr_ptr"),
        constexprs=dict(
            HEAD_D=p.d, BLOCK_D=p.block_d, GATHER_N=gather_n, CACHE_BLOCK=p.block_size, X=p.block_d,
            NUM_KV_HEADS=p.hkv, HAS_WINDOW=window > 0, WINDOW=window, SKIP_DECODE=False,
            KV_FP8=p.kv_fp8, FP8_E5M2=False, **_cache_strides(p), CACHE_NEW=True, V_PACK=0,
            BT_PTR=False, BLOCK_BYTES=1, MIN_Q=DECODE_MAX_Q + 1),
        num_warps=4, num_stages=1)


def _attention_launch(p: Problem, config: UnifiedPrefillConfig, pack: int, ctx_cap: int) -> Launch:
    dense = config.gather
    window = _window(p)
    tokens = config.block_m // pack
    if config.flat_grid:
        grid = (_flat_rows(p, tokens), p.hq // pack, p.bsz)
    else:
        grid = (cdiv(p.max_seqlen_q, tokens), p.hq // pack, p.bsz)
    s = p.strides
    k_ds = p.k_descale_strides or (0, 0)
    v_ds = p.v_descale_strides or (0, 0)
    return Launch(
        kernel=_prefix_prefill_kernel,
        grid=grid,
        params=dict(
            q_ptr="q",
            # with CACHE_NEW the new tokens' k / v pointers carry the causal flags
            # and q's descale (any valid buffer when absent: never read)
            k_ptr="causal_flags" if p.causal_flags else "q",
            v_ptr="q_descale" if p.q_fp8 else "q",
            k_cache_ptr="k", v_cache_ptr="v",
            k_scale_ptr="k_descale" if p.kv_fp8 else "q", v_scale_ptr="v_descale" if p.kv_fp8 else "q",
            alibi_ptr="alibi_slopes" if p.alibi else "q", sinks_ptr="sinks" if p.sinks else "q",
            out_scale_ptr="output_scale" if p.out_fp8 else "q",
            # read as the old output so that the JAX executor aliases a given
            # "out" (rows of decode sequences keep their values); a plan-allocated
            # "out" does not exist before this first launch that writes it
            out_in_ptr="q" if "out" in p.buffers else "out",
            k_scr_ptr="k_scratch" if dense else "q", v_scr_ptr="v_scratch" if dense else "q",
            **_table_params(p, ctx_cap), out_ptr="out"),
        writes=("out_ptr",),
        constexprs=dict(
            QK_SCALE2=float(np.float32(p.scale * LOG2E)), HEAD_D=p.d, BLOCK_D=p.block_d,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, CACHE_BLOCK=p.block_size, X=p.block_d,
            ID_RUN=math.gcd(config.block_n, p.block_size), GROUP=p.group, PACK=pack,
            PREFETCH_IDS=int(config.prefetch_ids), CACHE_DENSE=dense, OFFS32=p.offs32,
            NUM_KV_HEADS=p.hkv, KV_FP8=p.kv_fp8, FP8_E5M2=False,
            HAS_ALIBI=p.alibi, HAS_WINDOW=window > 0, WINDOW=window, HAS_SINKS=p.sinks,
            SKIP_DECODE=False, OUT_FP8=p.out_fp8, IS_CAUSAL=p.causal and not p.causal_flags,
            CACHE_NEW=True, V_PACK=0, BT_PTR=False, BLOCK_BYTES=1,
            MIN_Q=DECODE_MAX_Q + 1,
            SOFTCAP2=float(np.float32(p.softcap * LOG2E)) if p.softcap > 0 else 0.0,
            ALIBI_MODE=2 if p.alibi_sqrt else 1, CAUSAL_FLAGS=p.causal_flags,
            SYM_WINDOW=window > 0 and (p.causal_flags or not p.causal),
            Q_FP8=(2 if p.compute_dtype == "float16" else 1) if p.q_fp8 else 0,
            KS_STRIDE_B=k_ds[0], KS_STRIDE_H=k_ds[1], VS_STRIDE_B=v_ds[0], VS_STRIDE_H=v_ds[1],
            FLAT_GRID=config.flat_grid,
            FP8_MAX=FP8_MAX[FP8_E4M3] if p.out_fp8 else 0.0,
            **dict(zip(("FP8_MANT_BITS", "FP8_MIN_NORMAL", "FP8_SUBNORMAL_MAGIC"),
                       FP8_ROUNDING[FP8_E4M3] if p.out_fp8 else (0, 0.0, 0.0))),
            stride_q_t=s["q_t"], stride_q_h=s["q_h"], stride_q_d=s["q_d"],
            stride_k_t=0, stride_k_h=0, stride_k_d=0, stride_v_t=0, stride_v_h=0, stride_v_d=0,
            stride_o_t=s["o_t"], stride_o_h=s["o_h"], stride_o_d=s["o_d"], **_cache_strides(p)),
        num_warps=config.num_warps, num_stages=config.num_stages)


def prefill_launches(target, p: Problem, config: UnifiedPrefillConfig | None = None):
    """(buffers, launches) of the prefill path for Problem ``p``: every query
    head's output rows of the sequences with more than DECODE_MAX_Q new tokens."""
    config, pack, ctx_cap = choose_prefill_config(target, p, config)
    buffers, launches = {}, []
    if config.gather:
        for name in ("k_scratch", "v_scratch"):
            buffers[name] = Buffer((p.bsz, p.hkv, ctx_cap, p.d), _scratch_dtype(p))
        launches.append(_gather_launch(p, ctx_cap))
    launches.append(_attention_launch(p, config, pack, ctx_cap))
    return buffers, launches

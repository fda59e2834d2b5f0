"""Validation and launch plan for context_attention_fwd (framework-free)."""
from __future__ import annotations

import contextlib
import math

import numpy as np

from .._plan import (FLOAT_DTYPES, FP8_DTYPES, FP8_MAX, INT_DTYPES, ITEMSIZE, ArrayInfo, Buffer,
                     Launch, Plan, Scalar, cdiv, check_dtype, check_ndim, check_shape, forced_setting,
                     memoize, next_pow2, setting)
from .._triton_utils import FP8_ROUNDING
from .kernels import _prefix_prefill_gather_kernel, _prefix_prefill_kernel

MAX_HEAD_SIZE = 256
LOG2E = 1.4426950408889634
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                   "fp8_e5m2": "float8_e5m2"}

# (BLOCK_M, BLOCK_N, num_warps, num_stages, pack GQA heads into rows, block ids
# prefetched how many tiles ahead) by (query itemsize, BLOCK_D), for the paged
# path (context read through the block table in the loop); GATHER_TILE_CONFIGS
# below overrides them when the context is gathered into dense scratch.
# NOTE: measured on the H200 (bench_prefix_prefill.py, Llama-8B heads, cache
# block 16, three runs): for 16-bit D=128, (128, 128, 8, 3) beat (128, 64, 8, 3)
# by 7-9% at B=4 x q=1024 over ctx=4096 (1211-1273 vs 1325-1366 us) and by
# 10-12% on causal q=8192 (1243 vs 1394-1407 us); 4 warps for BLOCK_M=128
# spill (1.2-1.4x slower); num_stages 2 or 4 and GQA packing off were 1-6%
# slower. Block ids prefetched one tile ahead: 12% faster with BLOCK_N=64,
# within noise with 128; two tiles ahead stops the pipeliner from making the
# K/V loads asynchronous (SASS) and is no faster. Other head sizes and fp32
# keep untuned starting points.
TILE_CONFIGS = {
    (2, 16): (128, 64, 4, 3, True, 1), (2, 32): (128, 64, 4, 3, True, 1),
    (2, 64): (128, 64, 4, 3, True, 1), (2, 128): (128, 128, 8, 3, True, 1),
    (2, 256): (64, 64, 4, 2, True, 1),
    # NOTE: fp32 queries run tl.dot in tf32 on the GPU (the issue allows it);
    # twice the bytes per element, so half the tile.
    (4, 16): (64, 64, 4, 2, True, 1), (4, 32): (64, 64, 4, 2, True, 1),
    (4, 64): (64, 64, 4, 2, True, 1), (4, 128): (64, 32, 4, 2, True, 1),
    (4, 256): (32, 32, 4, 2, True, 1),
}

# Context gathered into dense scratch first (one cheap copy kernel), so the
# attention loop over the context reads dense tiles like the new tokens do.
# NOTE: with block_size 16 every 128-token cache tile gathers 8 blocks; the
# per-token block ids and address math in the loop (about +35% instructions
# per tile in the PTX, plus the id load's latency ahead of the K/V copies)
# made the paged loop ~60% as fast per FLOP as the dense one on the H200.
# Used when each cache tile is read by at least GATHER_MIN_REUSE row tiles
# (otherwise the copy is pure extra traffic) and the scratch, 2 x B x Hkv x
# (block-table width x block_size) x D elements, stays under the limit below
# (the block table's width, not the real context, sizes it).
# NOTE: measured on the H200 (benchmarks/sweep_prefix_prefill.py, B=4 x q=1024
# over ctx=4096, Llama-8B heads, fp16): 1272 us paged (before this change),
# 1111 us paged now (int32 cache offsets; the kernel no longer trips ptxas's
# wgmma serialisation, C7515), 742 us with the gather (42 us of it the copy,
# 3.2 TB/s). With the context dense, (128, 64, 8, 3) equals (128, 128, 8, 3)
# there (741 vs 742-766 us) and wins on causal q=8192 (1171 vs 1225 us) and
# B=16 x q=256 (420 vs 447 us); num_stages 2 or 4 and BLOCK_M=64 were slower.
GATHER_TILE_CONFIGS = {(2, 128): (128, 64, 8, 3, True, 0)}
GATHER_MIN_REUSE = 2
GATHER_MAX_BYTES = 256 << 20


@contextlib.contextmanager
def tile_config(block_m: int, block_n: int, num_warps: int = 4, num_stages: int = 2,
                pack_gqa: bool = True, prefetch_ids: int = 1, gather=None):
    """Force one tile configuration for plans made inside the block (tests,
    benchmarks); ``gather`` None = automatic, True / False = force the dense
    scratch copy of the context on / off. Part of the plan's cache key (and,
    as a forced setting, of the keys of the adapters' plan caches), so cached
    plans never mix."""
    with forced_setting("prefix_prefill.tile", (block_m, block_n, num_warps, num_stages, pack_gqa,
                                                prefetch_ids, gather)):
        yield


def _fp8_format(name: str, info: ArrayInfo, kv_cache_dtype: str, q_dtype: str):
    """The fp8 format the cache holds, or None for a cache in the query dtype."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected one of {tuple(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    fmt = KV_CACHE_DTYPES[kv_cache_dtype]
    if fmt is None:
        if info.dtype == "uint8":
            raise TypeError(f"{name}: a uint8 cache needs kv_cache_dtype 'fp8', 'fp8_e4m3' "
                            "or 'fp8_e5m2' to say how to read it, got 'auto'")
        if info.dtype in FP8_DTYPES:
            return info.dtype
        if info.dtype != q_dtype:
            raise TypeError(f"{name}: dtype {info.dtype} differs from q's {q_dtype}; "
                            "expected the query dtype, an fp8 dtype, or uint8 with an fp8 "
                            "kv_cache_dtype")
        return None
    if info.dtype not in (fmt, "uint8"):
        raise TypeError(f"{name}: dtype {info.dtype} does not hold kv_cache_dtype "
                        f"{kv_cache_dtype!r}; expected {fmt} or uint8")
    return fmt


def _check_scalar_array(name: str, info: ArrayInfo | None, needed: bool):
    if info is None:
        if needed:
            raise ValueError(f"{name}: required here")
        return
    if math.prod(info.shape) != 1 or info.dtype != "float32":
        raise ValueError(f"{name}: expected a 1-element float32 array, got shape "
                         f"{tuple(info.shape)} dtype {info.dtype}")


def plan_prefix_prefill(q, k, v, k_cache, v_cache, b_loc, b_start_loc, b_seq_len,
                        output=None, k_scale=None, v_scale=None, alibi_slopes=None,
                        sinks=None, fp8_out_scale=None, *, max_input_len: int,
                        kv_cache_dtype: str = "auto", sliding_window=None, sm_scale=None,
                        skip_decode: bool = False, output_dtype: str | None = None) -> Plan:
    """Plan prefix-prefill attention (spec: shared/specs/prefix_prefill.md).

    Array arguments are ArrayInfo (``output`` / ``k_scale`` / ``v_scale`` /
    ``alibi_slopes`` / ``sinks`` / ``fp8_out_scale`` may be None = absent).
    ``output`` given: the launch updates that array in place (torch; JAX
    aliases it), so rows skipped by ``skip_decode`` keep their values;
    otherwise the plan allocates a zero-filled output. Scales are 1-element
    float32 device arrays named like their argument; the block table, start
    offsets and lengths are device data, so new values never recompile.
    """
    return _plan(q, k, v, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, output, k_scale,
                 v_scale, alibi_slopes, sinks, fp8_out_scale, int(max_input_len), kv_cache_dtype,
                 None if sliding_window is None else int(sliding_window),
                 None if sm_scale is None else float(sm_scale), bool(skip_decode),
                 output_dtype, setting("prefix_prefill.tile"))


@memoize
def _plan(q, k, v, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, output, k_scale, v_scale,
          alibi_slopes, sinks, fp8_out_scale, max_input_len, kv_cache_dtype, sliding_window,
          sm_scale, skip_decode, output_dtype, config) -> Plan:
    check_ndim("q", q, 3, "[T, Hq, D]")
    check_dtype("q", q, FLOAT_DTYPES)
    t, hq, d = q.shape
    check_ndim("k", k, 3, "[T, Hkv, D]")
    hkv = k.shape[1]
    check_shape("k", k, (t, hkv, d), "[T, Hkv, D]")
    check_shape("v", v, (t, hkv, d), "same as k")
    for name, info in (("k", k), ("v", v)):
        if info.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {info.dtype} differs from q's {q.dtype}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q: {hq} query heads is not a multiple of k's {hkv} kv heads")
    if not 1 <= d <= MAX_HEAD_SIZE:
        raise ValueError(f"q: head size {d} is not in [1, {MAX_HEAD_SIZE}]")

    check_ndim("k_cache", k_cache, 5, "[num_blocks, Hkv, D // x, block_size, x]")
    num_blocks, _, _, block_size, x = k_cache.shape
    if x < 1 or d % x:
        raise ValueError(f"k_cache: x = shape[4] = {x} must divide the head size {d}")
    check_shape("k_cache", k_cache, (num_blocks, hkv, d // x, block_size, x),
                "[num_blocks, Hkv, D // x, block_size, x]")
    if block_size < 1:
        raise ValueError(f"k_cache: block_size = shape[3] must be positive, got {block_size}")
    check_ndim("v_cache", v_cache, 4, "[num_blocks, Hkv, D, block_size]")
    check_shape("v_cache", v_cache, (num_blocks, hkv, d, block_size),
                "[num_blocks, Hkv, D, block_size]")
    fp8 = _fp8_format("k_cache", k_cache, kv_cache_dtype, q.dtype)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache: dtype {v_cache.dtype} differs from k_cache's {k_cache.dtype}")
    _check_scalar_array("k_scale", k_scale, fp8 is not None)
    _check_scalar_array("v_scale", v_scale, fp8 is not None)

    check_ndim("b_loc", b_loc, 2, "[B, max_blocks_per_seq]")
    bsz = b_loc.shape[0]
    check_shape("b_start_loc", b_start_loc, (bsz + 1,), "[B + 1]")
    check_shape("b_seq_len", b_seq_len, (bsz,), "[B]")
    for name, info in (("b_loc", b_loc), ("b_start_loc", b_start_loc), ("b_seq_len", b_seq_len)):
        check_dtype(name, info, INT_DTYPES)
    for name, info in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if info is not None:
            check_shape(name, info, (hq,), "[Hq]")
            check_dtype(name, info, FLOAT_DTYPES)
    if max_input_len < 0:
        raise ValueError(f"max_input_len: must be >= 0, got {max_input_len}")
    if sm_scale is not None and not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale: must be finite, got {sm_scale}")

    has_out_scale = fp8_out_scale is not None
    _check_scalar_array("fp8_out_scale", fp8_out_scale, False)
    out_dtype = output.dtype if output is not None else (
        output_dtype or ("float8_e4m3fn" if has_out_scale else q.dtype))
    expected = "float8_e4m3fn" if has_out_scale else q.dtype
    if out_dtype != expected:
        if out_dtype in FP8_MAX and not has_out_scale:
            raise ValueError("fp8_out_scale: an fp8 output needs fp8_out_scale")
        raise TypeError(f"output: dtype {out_dtype} is not valid here; expected {expected}"
                        + (" when fp8_out_scale is given" if has_out_scale else " (q's dtype)"))
    buffers = {}
    if output is None:
        # rows of no sequence (and skip_decode rows) read as zeros
        buffers["output"] = Buffer((t, hq, d), out_dtype, zero_init=True)
        output = ArrayInfo.contiguous((t, hq, d), out_dtype)
        out_in = "q"  # dummy: the kernel never reads it
    else:
        check_shape("output", output, (t, hq, d), "[T, Hq, D]")
        out_in = "output"
    if t == 0 or bsz == 0 or hq == 0 or max_input_len == 0:
        return Plan(buffers, (), ("output",))

    block_d = max(16, next_pow2(d))
    itemsize = 4 if q.dtype == "float32" else 2
    key = (itemsize, block_d)
    group = hq // hkv

    def rows_and_pack(block_m, pack_gqa):
        # short queries (decode-heavy batches): no point in rows that never exist
        rows_needed = max_input_len * (group if pack_gqa else 1)
        block_m = max(16, min(block_m, next_pow2(rows_needed)))
        # GQA packing needs whole head groups in a tile (powers of two divide BLOCK_M)
        pack = group if pack_gqa and group & (group - 1) == 0 and group <= block_m else 1
        return block_m, pack

    block_m, block_n, num_warps, num_stages, pack_gqa, prefetch, gather = (
        config or (*TILE_CONFIGS[key], None))
    block_m, pack = rows_and_pack(block_m, pack_gqa)
    window = sliding_window if sliding_window is not None and sliding_window > 0 else 0
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out_fp8 = out_dtype if has_out_scale else None

    ctx_cap = b_loc.shape[1] * block_size  # scratch tokens per sequence
    scratch_dtype = q.dtype if fp8 else k_cache.dtype
    if gather is None:  # automatic: only where measured (fp32 (64, 32) tiles: 4.1 vs 3.1 ms)
        reuse = cdiv(max_input_len, block_m // pack)  # row tiles reading each cache tile
        scratch_bytes = 2 * bsz * hkv * ctx_cap * d * ITEMSIZE[scratch_dtype]
        gather = (key in GATHER_TILE_CONFIGS and reuse >= GATHER_MIN_REUSE
                  and scratch_bytes <= GATHER_MAX_BYTES)
    gather = bool(gather) and ctx_cap > 0
    if gather and config is None:
        block_m, block_n, num_warps, num_stages, pack_gqa, prefetch = GATHER_TILE_CONFIGS[key]
        block_m, pack = rows_and_pack(block_m, pack_gqa)

    names = ("stride_q_t", "stride_q_h", "stride_q_d", "stride_k_t", "stride_k_h", "stride_k_d",
             "stride_v_t", "stride_v_h", "stride_v_d", "stride_o_t", "stride_o_h", "stride_o_d")
    strides = dict(zip(names, (*q.strides, *k.strides, *v.strides, *output.strides)))
    strides.update(zip(("stride_kc_b", "stride_kc_h", "stride_kc_dx", "KC_STRIDE_T", "KC_STRIDE_X"),
                       k_cache.strides))
    strides.update(zip(("stride_vc_b", "stride_vc_h", "stride_vc_d", "VC_STRIDE_T"), v_cache.strides))
    # every cache offset (block, head, channel, token) fits in int32?
    offs32 = all(sum((n - 1) * st for n, st in zip(c.shape, c.strides)) < 2 ** 31
                 for c in (k_cache, v_cache))
    # NOTE: the scratch's tokens per sequence is a runtime scalar (the block
    # table's width changes per batch), passed odd (2 * ctx_cap + 1) so that
    # neither torch's launcher (divisibility-16 / == 1 specialisation) nor
    # jax-triton (none) specialises it: both compile the same kernel, so their
    # results stay bitwise equal (see the constexpr strides NOTE in kernels.py).
    launches = []
    if gather:
        for name in ("k_scratch", "v_scratch"):
            buffers[name] = Buffer((bsz, hkv, ctx_cap, d), scratch_dtype)
        gather_n = 32 if block_d > 128 else 64
        launches.append(Launch(
            kernel=_prefix_prefill_gather_kernel,
            grid=(cdiv(ctx_cap, gather_n), hkv, bsz),
            args=("k_cache", "v_cache", "b_loc", "b_start_loc", "b_seq_len",
                  *(Scalar(s, "i64") for s in b_loc.strides), Scalar(2 * ctx_cap + 1, "i32")),
            outputs=("k_scratch", "v_scratch"),
            constexprs=dict(
                HEAD_D=d, BLOCK_D=block_d, GATHER_N=gather_n, CACHE_BLOCK=block_size, X=x,
                NUM_KV_HEADS=hkv, HAS_WINDOW=window > 0, WINDOW=window, SKIP_DECODE=skip_decode,
                KV_FP8=fp8 is not None, FP8_E5M2=fp8 == "float8_e5m2",
                **{n: strides[n] for n in ("stride_kc_b", "stride_kc_h", "stride_kc_dx",
                                           "KC_STRIDE_T", "KC_STRIDE_X", "stride_vc_b",
                                           "stride_vc_h", "stride_vc_d", "VC_STRIDE_T")}),
            num_warps=4, num_stages=1))
    launches.append(Launch(
        kernel=_prefix_prefill_kernel,
        grid=(cdiv(max_input_len, block_m // pack), hq // pack, bsz),
        args=("q", "k", "v", "k_cache", "v_cache", "b_loc", "b_start_loc", "b_seq_len",
              # absent optional arrays: any valid pointer, never read
              "k_scale" if fp8 else "q", "v_scale" if fp8 else "q",
              "alibi_slopes" if alibi_slopes is not None else "q",
              "sinks" if sinks is not None else "q",
              "fp8_out_scale" if has_out_scale else "q", out_in,
              "k_scratch" if gather else "q", "v_scratch" if gather else "q",
              *(Scalar(s, "i64") for s in b_loc.strides), Scalar(2 * ctx_cap + 1, "i32")),
        outputs=("output",),
        constexprs=dict(
            QK_SCALE2=float(np.float32(scale * LOG2E)), HEAD_D=d, BLOCK_D=block_d,
            BLOCK_M=block_m, BLOCK_N=block_n, CACHE_BLOCK=block_size, X=x,
            ID_RUN=math.gcd(block_n, block_size), GROUP=group, PACK=pack, PREFETCH_IDS=int(prefetch),
            CACHE_DENSE=gather, OFFS32=offs32, NUM_KV_HEADS=hkv,
            KV_FP8=fp8 is not None, FP8_E5M2=fp8 == "float8_e5m2",
            HAS_ALIBI=alibi_slopes is not None, HAS_WINDOW=window > 0, WINDOW=window,
            HAS_SINKS=sinks is not None, SKIP_DECODE=skip_decode, OUT_FP8=has_out_scale,
            FP8_MAX=FP8_MAX.get(out_fp8, 0.0),
            **dict(zip(("FP8_MANT_BITS", "FP8_MIN_NORMAL", "FP8_SUBNORMAL_MAGIC"),
                       FP8_ROUNDING.get(out_fp8, (0, 0.0, 0.0)))),
            **strides),
        num_warps=num_warps, num_stages=num_stages,
    ))
    return Plan(buffers, tuple(launches), ("output",))

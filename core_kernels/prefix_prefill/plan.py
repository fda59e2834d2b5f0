"""Validation and launch plan for context_attention_fwd (framework-free)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .._plan import (FLOAT_DTYPES, FP8_DTYPES, FP8_MAX, FP32_MAX, INT32_MAX, INT_DTYPES,
                     ITEMSIZE, ArrayInfo, Buffer, Launch, Plan, Scalar, as_float, as_int, cdiv,
                     check_config, check_dtype, check_inner_contiguous, check_ndim, check_scalar_array, check_shape,
                     config_class, memoize, next_pow2)
from .._target import Target
from .._triton_utils import FP8_ROUNDING
from .kernels import _prefix_prefill_gather_kernel, _prefix_prefill_kernel

MAX_HEAD_SIZE = 256
LOG2E = 1.4426950408889634
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                   "fp8_e5m2": "float8_e5m2"}
# vLLM's cache-dtype names of a plain (unquantised) cache: read as "auto" (vLLM's
# kernel tests pass "float16", also with a float32 cache: see _fp8_format)
PLAIN_CACHE_DTYPES = ("float16", "bfloat16", "float32")


@config_class
class PrefixPrefillConfig:
    """Tiling of _prefix_prefill_kernel: BLOCK_M query rows x BLOCK_N keys per
    tile (powers of two >= 16; BLOCK_M shrinks for short queries), ``num_warps``,
    ``num_stages``; ``pack_gqa`` puts the query heads of one kv head in the rows
    of one tile; ``prefetch_ids`` loads the paged path's block ids that many
    tiles ahead (0-2); ``gather`` True / False forces the dense scratch copy of
    the context (_prefix_prefill_gather_kernel) on / off, None chooses it."""
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    pack_gqa: bool = True
    prefetch_ids: int = 1
    gather: bool | None = None


C = PrefixPrefillConfig
# Tiles by (query itemsize, BLOCK_D), for the paged path (context read through
# the block table in the loop); GATHER_TILE_CONFIGS below overrides them when
# the context is gathered into dense scratch.
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
    (2, 16): C(128, 64, 4, 3, True, 1), (2, 32): C(128, 64, 4, 3, True, 1),
    (2, 64): C(128, 64, 4, 3, True, 1), (2, 128): C(128, 128, 8, 3, True, 1),
    (2, 256): C(64, 64, 4, 2, True, 1),
    # NOTE: fp32 queries run tl.dot in tf32 on the GPU (the issue allows it);
    # twice the bytes per element, so half the tile.
    (4, 16): C(64, 64, 4, 2, True, 1), (4, 32): C(64, 64, 4, 2, True, 1),
    (4, 64): C(64, 64, 4, 2, True, 1), (4, 128): C(64, 32, 4, 2, True, 1),
    (4, 256): C(32, 32, 4, 2, True, 1),
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
GATHER_TILE_CONFIGS = {(2, 128): C(128, 64, 8, 3, True, 0, gather=True)}
GATHER_MIN_REUSE = 2
GATHER_MAX_BYTES = 256 << 20
del C


@dataclasses.dataclass(frozen=True)
class _Problem:
    t: int
    hq: int
    hkv: int
    d: int
    block_d: int              # the head size padded to a power of two >= 16
    group: int                # query heads per kv head
    bsz: int
    block_size: int
    x: int
    max_input_len: int
    q_dtype: str
    fp8: str | None           # the fp8 format the cache holds; None: q's dtype
    scratch_dtype: str        # dtype of the gathered context (q's for an fp8 cache)
    out_fp8: str | None       # the output's fp8 format (with fp8_out_scale), else None
    window: int               # 0: no sliding window
    scale: float              # softmax scale
    alibi: bool
    sinks: bool
    skip_decode: bool
    causal: bool              # False: new tokens see every new token of their sequence
    cache_new: bool           # k = v = None: the new tokens' K/V are read from the cache
    v_pack: int               # interleaved V cache pack factor (0: standard layout)
    bt_ptr: bool              # b_loc holds K cache block addresses, not ids
    block_bytes: int          # bytes between K cache blocks (k_cache's stride 0)
    ctx_cap: int              # scratch tokens per sequence (block-table width x block size)
    offs32: bool              # every cache offset fits in int32
    strides: dict             # the kernels' stride constexprs by parameter name
    table_strides: tuple      # b_loc's (runtime scalars)
    out_in: str               # buffer read as the output's old values (a dummy when allocated)
    buffers: dict

    @property
    def key(self) -> tuple:
        """(query itemsize, BLOCK_D): the tile tables' key."""
        return (4 if self.q_dtype == "float32" else 2, self.block_d)


@memoize
def plan_prefix_prefill(target: Target, q, k, v, k_cache, v_cache, b_loc, b_start_loc, b_seq_len,
                        output=None, k_scale=None, v_scale=None, alibi_slopes=None,
                        sinks=None, fp8_out_scale=None, *, max_input_len: int, max_seq_len: int = 0,
                        kv_cache_dtype: str = "auto", sliding_window=None, sm_scale=None,
                        skip_decode: bool = False, output_dtype: str | None = None,
                        causal: bool = True, interleaved_v_pack_factor: int = 0,
                        is_block_table_ptr: bool = False, config: PrefixPrefillConfig | None = None,
                        batch_invariant: bool = False) -> Plan:
    """Plan prefix-prefill attention (contract: docs/ops/prefix_prefill.md).

    Array arguments are ArrayInfo (``output`` / ``k_scale`` / ``v_scale`` /
    ``alibi_slopes`` / ``sinks`` / ``fp8_out_scale`` may be None = absent).
    ``output`` given: the launch updates that array in place (torch; JAX
    aliases it), so rows skipped by ``skip_decode`` keep their values;
    otherwise the plan allocates a zero-filled output. Scales are 1-element
    float32 device arrays named like their argument; the block table, start
    offsets and lengths are device data, so new values never recompile.
    ``config`` overrides the tiling chosen from TILE_CONFIGS / GATHER_TILE_CONFIGS.
    ``max_seq_len`` > 0: an upper bound on every sequence's context length
    (vLLM passes its longest sequence, or in its tests the longest context)
    that sizes the scratch the context is gathered into (see _scratch_tokens);
    0: the block table's width sizes it. A sequence whose context does not fit
    (device data nobody checked) gets NaN outputs.

    vLLM 0.33's options: ``k`` and ``v`` both None read the new tokens' K/V from
    the paged cache (positions context_len .. seq_len - 1 through ``b_loc``);
    ``causal=False`` lets each new token attend to every new token of its
    sequence; ``interleaved_v_pack_factor=x > 0`` says ``v_cache`` (shape
    [num_blocks, Hkv, D, block_size], the inner two dims contiguous) holds
    [num_blocks, Hkv, block_size // x, D, x] in memory; ``is_block_table_ptr``:
    ``b_loc`` (int64) holds device addresses of K cache blocks (k_cache's data
    pointer + id * k_cache.stride(0) * itemsize; 0 for an unused slot), turned
    into ids in the kernels; V blocks are found by the same id.

    ``batch_invariant``: each (token, head) row's result independent of the
    other sequences of the batch (INVARIANT_NOTE: the context read paged or
    gathered with the same tiles).
    """
    check_config(config, (PrefixPrefillConfig,))
    if config is not None:
        check_tiles(config)
    problem = _validate(q, k, v, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, output, k_scale,
                        v_scale, alibi_slopes, sinks, fp8_out_scale,
                        as_int("max_input_len", max_input_len, 0),
                        kv_cache_dtype, sliding_window, sm_scale, bool(skip_decode), output_dtype,
                        bool(causal), interleaved_v_pack_factor, bool(is_block_table_ptr),
                        as_int("max_seq_len", max_seq_len, 0))
    if problem.t == 0 or problem.bsz == 0 or problem.hq == 0 or problem.max_input_len == 0:
        return Plan(problem.buffers, (), ("output",))
    config, pack = _choose_config(problem, config, bool(batch_invariant))
    buffers = dict(problem.buffers)
    launches = []
    if config.gather:
        for name in ("k_scratch", "v_scratch"):
            buffers[name] = Buffer((problem.bsz, problem.hkv, problem.ctx_cap, problem.d),
                                   problem.scratch_dtype)
        launches.append(_gather_launch(problem))
    launches.append(_attention_launch(problem, config, pack))
    return Plan(buffers, tuple(launches), ("output",))


def check_tiles(config) -> None:
    """The tile fields of a config (this op's, or unified_attention's prefill config)."""
    pow2 = lambda n: isinstance(n, int) and n >= 1 and n & (n - 1) == 0  # noqa: E731
    if not (pow2(config.block_m) and pow2(config.block_n) and min(config.block_m, config.block_n) >= 16):
        raise ValueError(f"config: block_m and block_n must be powers of two >= 16, got {config}")
    if not pow2(config.num_warps) or config.num_stages < 1 or config.prefetch_ids not in (0, 1, 2):
        raise ValueError(f"config: expected num_warps a power of two, num_stages >= 1 and "
                         f"prefetch_ids 0, 1 or 2, got {config}")
    if config.gather not in (None, True, False):
        raise ValueError(f"config: gather must be None (automatic), True or False, got {config}")


# ---------------------------------------------------------------- validate
def prefix_prefill_config(q, k, v, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, output=None,
                          k_scale=None, v_scale=None, alibi_slopes=None, sinks=None, fp8_out_scale=None, *,
                          max_input_len: int, kv_cache_dtype: str = "auto", sliding_window=None,
                          sm_scale=None, skip_decode: bool = False, causal: bool = True, v_pack: int = 0,
                          config: PrefixPrefillConfig | None = None, batch_invariant: bool = False):
    """The tiles (and gather decision) :func:`plan_prefix_prefill` chooses for
    these arrays: ``config`` completed, or the measured table's entry; ``config``
    itself where the problem is empty (nothing is launched). The JAX adapter's
    vmap pins it: the gather decision depends on the batch's scratch size."""
    p = _validate(q, k, v, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, output, k_scale, v_scale,
                  alibi_slopes, sinks, fp8_out_scale, max_input_len, kv_cache_dtype, sliding_window,
                  sm_scale, skip_decode, None, causal, v_pack, False)
    if p.t == 0 or p.bsz == 0 or p.hq == 0 or p.max_input_len == 0:
        return config
    return _choose_config(p, config, bool(batch_invariant))[0]


def _validate(q, k, v, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, output, k_scale, v_scale,
              alibi_slopes, sinks, fp8_out_scale, max_input_len, kv_cache_dtype, sliding_window,
              sm_scale, skip_decode, output_dtype, causal=True, v_pack=0,
              bt_ptr=False, max_seq_len=0) -> _Problem:
    cache_new = k is None and v is None
    if (k is None) != (v is None):
        raise ValueError(f"{'k' if k is None else 'v'}: k and v are both given or both None "
                         "(None: the new tokens' K/V are read from the paged cache)")
    if cache_new:
        check_ndim("k_cache", k_cache, 5, "[num_blocks, Hkv, D // x, block_size, x]")
        # the new tokens' "k" / "v": shapes for the checks, never read
        k = v = ArrayInfo.contiguous((q.shape[0] if q.ndim == 3 else 0, k_cache.shape[1],
                                      q.shape[-1]), q.dtype)
    t, hq, hkv, d = _check_tokens(q, k, v)
    block_size, x, fp8 = _check_cache(k_cache, v_cache, hkv, d, kv_cache_dtype, q.dtype)
    v_pack = as_int("interleaved_v_pack_factor", v_pack, 0, INT32_MAX)
    if v_pack:
        if block_size % v_pack:
            raise ValueError(f"interleaved_v_pack_factor: {v_pack} does not divide the cache "
                             f"block size {block_size}")
        if tuple(v_cache.strides[2:]) != (block_size, 1):
            raise ValueError("v_cache: an interleaved V cache needs its last two dims "
                             f"contiguous (strides ({block_size}, 1)), got {tuple(v_cache.strides)}")
    if bt_ptr and b_loc.dtype != "int64":
        raise TypeError(f"b_loc: a table of block addresses (is_block_table_ptr) must be "
                        f"int64, got {b_loc.dtype}")
    if alibi_slopes is not None and not causal:
        raise ValueError("causal: causal=False is not supported with alibi_slopes (as in vLLM)")
    if alibi_slopes is not None and cache_new:
        raise NotImplementedError("k, v: reading the new tokens' K/V from the cache "
                                  "(k = v = None) is not supported with alibi_slopes")
    _check_scalar_array("k_scale", k_scale, fp8 is not None)
    _check_scalar_array("v_scale", v_scale, fp8 is not None)
    check_ndim("b_loc", b_loc, 2, "[B, max_blocks_per_seq]")
    bsz = b_loc.shape[0]
    check_shape("b_start_loc", b_start_loc, (bsz + 1,), "[B + 1]")
    check_shape("b_seq_len", b_seq_len, (bsz,), "[B]")
    for name, info in (("b_loc", b_loc), ("b_start_loc", b_start_loc), ("b_seq_len", b_seq_len)):
        check_dtype(name, info, INT_DTYPES)
    for name, info in (("b_start_loc", b_start_loc), ("b_seq_len", b_seq_len)):
        check_inner_contiguous(name, info)  # read with unit stride (b_loc's strides are passed)
    for name, info in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if info is not None:
            check_shape(name, info, (hq,), "[Hq]")
            check_dtype(name, info, FLOAT_DTYPES)
    # no sequence has more new tokens than T: a larger bound is T (it only sets the grid)
    max_input_len = min(max_input_len, t)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else as_float("sm_scale", sm_scale)
    if not abs(scale * LOG2E) <= FP32_MAX:  # the kernel's fp32 scale
        raise ValueError(f"sm_scale: {scale} * log2(e) overflows float32 (the kernel's scale)")
    out_fp8, output, out_in, buffers = _check_output(output, fp8_out_scale, output_dtype, q, (t, hq, d))

    window = 0 if sliding_window is None else max(0, as_int("sliding_window", sliding_window,
                                                           hi=INT32_MAX))  # <= 0: no window
    names = ("stride_q_t", "stride_q_h", "stride_q_d", "stride_k_t", "stride_k_h", "stride_k_d",
             "stride_v_t", "stride_v_h", "stride_v_d", "stride_o_t", "stride_o_h", "stride_o_d")
    strides = dict(zip(names, (*q.strides, *k.strides, *v.strides, *output.strides)))
    strides.update(zip(("stride_kc_b", "stride_kc_h", "stride_kc_dx", "KC_STRIDE_T", "KC_STRIDE_X"),
                       k_cache.strides))
    strides.update(zip(("stride_vc_b", "stride_vc_h", "stride_vc_d", "VC_STRIDE_T"), v_cache.strides))
    # every cache offset (block, head, channel, token) fits in int32?
    offs32 = all(sum((n - 1) * st for n, st in zip(c.shape, c.strides)) < 2 ** 31
                 for c in (k_cache, v_cache))
    return _Problem(
        t=t, hq=hq, hkv=hkv, d=d, block_d=max(16, next_pow2(d)), group=hq // hkv, bsz=bsz, block_size=block_size, x=x, max_input_len=max_input_len,
        q_dtype=q.dtype, fp8=fp8, scratch_dtype=q.dtype if fp8 else k_cache.dtype, out_fp8=out_fp8,
        window=window, scale=scale,
        alibi=alibi_slopes is not None, sinks=sinks is not None, skip_decode=skip_decode,
        causal=causal, cache_new=cache_new, v_pack=v_pack, bt_ptr=bt_ptr,
        block_bytes=k_cache.strides[0] * ITEMSIZE[k_cache.dtype],
        ctx_cap=_scratch_tokens(b_loc.shape[1], block_size, max_seq_len + (max_input_len if cache_new else 0)
                                if max_seq_len > 0 else 0), offs32=offs32, strides=strides,
        table_strides=tuple(b_loc.strides), out_in=out_in, buffers=buffers)


# NOTE: vLLM allocates block tables for the model's longest sequence, so the
# table's width can be many times the batch's longest context; a scratch sized
# by it passed GATHER_MAX_BYTES and the call ran the paged loop (278 vs 439
# TFLOP/s at B4 x q1024 over ctx 4096, H200, issue 18). With max_seq_len the
# scratch holds that many tokens (plus max_input_len when the new tokens' K/V
# are gathered too), rounded up to a power of two of cache blocks: at most
# twice the need, and at most log2(width) distinct plans while the batch's
# longest sequence grows from step to step. Only a bound on the context is
# assumed: vLLM's own test passes its longest context as max_seq_len.
def _scratch_tokens(width: int, block_size: int, bound: int) -> int:
    """Scratch tokens per sequence: the block table's width in tokens, or fewer
    from ``bound`` (> 0: no sequence needs more)."""
    cap = width * block_size
    if bound > 0:
        cap = min(cap, next_pow2(cdiv(bound, block_size)) * block_size)
    return cap


def _check_tokens(q, k, v):
    """(T, Hq, Hkv, D) of the new tokens' q, k, v."""
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
    return t, hq, hkv, d


def _check_cache(k_cache, v_cache, hkv, d, kv_cache_dtype, q_dtype):
    """(block_size, x, fp8 format or None) of the paged cache."""
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
    fp8 = _fp8_format("k_cache", k_cache, kv_cache_dtype, q_dtype)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache: dtype {v_cache.dtype} differs from k_cache's {k_cache.dtype}")
    return block_size, x, fp8


def _fp8_format(name: str, info: ArrayInfo, kv_cache_dtype: str, q_dtype: str):
    """The fp8 format the cache holds, or None for a cache in the query dtype."""
    if kv_cache_dtype not in KV_CACHE_DTYPES and kv_cache_dtype not in PLAIN_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected one of "
                         f"{tuple(KV_CACHE_DTYPES) + PLAIN_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    fmt = KV_CACHE_DTYPES.get(kv_cache_dtype)
    if fmt is None:
        if info.dtype == "uint8":
            raise ValueError(f"{name}: a uint8 cache needs kv_cache_dtype 'fp8', 'fp8_e4m3' "
                            f"or 'fp8_e5m2' to say how to read it, got {kv_cache_dtype!r}")
        # NOTE: a plain name ("float16", "bfloat16", "float32") reads as "auto", the
        # cache in its own dtype, whatever the name says: vLLM's kernel only tells
        # fp8 from not, and vLLM's own fp32 kernel test passes "float16" with a
        # float32 cache (a stricter check failed 12 of its cases, 2026-11-24)
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
    check_scalar_array(name, info, ("float32",))  # device data: the value is the kernel's


def _check_output(output, fp8_out_scale, output_dtype, q, shape):
    """(output fp8 format or None, output layout, buffer read as the old output,
    buffers to allocate)."""
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
    out_fp8 = out_dtype if has_out_scale else None
    if output is not None:
        check_shape("output", output, shape, "[T, Hq, D]")
        return out_fp8, output, "output", {}
    # rows of no sequence (and skip_decode rows) read as zeros; the kernel never
    # reads its old-output pointer then (q is a dummy)
    return (out_fp8, ArrayInfo.contiguous(shape, out_dtype), "q",
            {"output": Buffer(shape, out_dtype, zero_init=True)})


# ---------------------------------------------------------------- config
def rows_and_pack(max_q: int, group: int, config) -> tuple[int, int]:
    """(BLOCK_M, PACK): the config's rows shrunk for queries of at most ``max_q``
    tokens, and how many of the ``group`` query heads of a kv head share a tile
    (also unified_attention's prefill path)."""
    # short queries (decode-heavy batches): no point in rows that never exist
    rows_needed = max_q * (group if config.pack_gqa else 1)
    block_m = max(16, min(config.block_m, next_pow2(rows_needed)))
    # GQA packing needs whole head groups in a tile (powers of two divide BLOCK_M)
    pack = group if config.pack_gqa and group & (group - 1) == 0 and group <= block_m else 1
    return block_m, pack


def _rows_and_pack(p: _Problem, config: PrefixPrefillConfig) -> tuple[int, int]:
    return rows_and_pack(p.max_input_len, p.group, config)


# NOTE (INVARIANT_NOTE): batch_invariant=True. Whether the context is gathered
# depends on the batch (the scratch's size: B, the block table's width; the
# reuse: the batch's longest query), and the gathered path runs other key tiles
# than the paged one for 16-bit D=128 (GATHER_TILE_CONFIGS): a row's online
# softmax then walks other tiles. With equal tiles both paths do a row's
# arithmetic alike (the gather copies exact values; tests/test_shard_invariance.py
# checks it bit for bit), so invariant plans give the paged path the gathered
# path's tiles (prefetching block ids one tile ahead as the paged path does).
# The query tiles' shrinking for short batches is invariant as it is: it happens
# only where every sequence fits one tile. The price: the paged loop at BLOCK_N
# 64 instead of 128, 7-12% slower where it runs (H200 NOTE at TILE_CONFIGS;
# measured before the gather existed).
def _choose_config(p: _Problem, config: PrefixPrefillConfig | None, invariant: bool = False):
    """(config with block_m shrunk and gather decided, PACK): the override, or
    the measured tables' choice (``invariant``: INVARIANT_NOTE)."""
    chosen = config or TILE_CONFIGS[p.key]
    if config is None and invariant and p.key in GATHER_TILE_CONFIGS:
        chosen = dataclasses.replace(GATHER_TILE_CONFIGS[p.key], gather=None,
                                     prefetch_ids=TILE_CONFIGS[p.key].prefetch_ids)
    gather = chosen.gather
    if gather is None:  # automatic: only where measured (fp32 (64, 32) tiles: 4.1 vs 3.1 ms)
        block_m, pack = _rows_and_pack(p, chosen)
        reuse = cdiv(p.max_input_len, block_m // pack)  # row tiles reading each cache tile
        scratch_bytes = 2 * p.bsz * p.hkv * p.ctx_cap * p.d * ITEMSIZE[p.scratch_dtype]
        gather = (p.key in GATHER_TILE_CONFIGS and reuse >= GATHER_MIN_REUSE
                  and scratch_bytes <= GATHER_MAX_BYTES)
    gather = bool(gather) and p.ctx_cap > 0
    if gather and config is None:
        chosen = GATHER_TILE_CONFIGS[p.key]
    block_m, pack = _rows_and_pack(p, chosen)
    return dataclasses.replace(chosen, block_m=block_m, gather=gather), pack


# ---------------------------------------------------------------- launches
# NOTE: the scratch's tokens per sequence (ctx_cap) is a runtime scalar (the
# block table's width changes per batch); under the integer policy
# (core_kernels._triton_utils.jit) torch's launcher and jax-triton specialise
# it alike (only == 1), so their results stay bitwise equal (see the
# constexpr strides NOTE in kernels.py).
_CACHE_STRIDES = ("stride_kc_b", "stride_kc_h", "stride_kc_dx", "KC_STRIDE_T", "KC_STRIDE_X",
                  "stride_vc_b", "stride_vc_h", "stride_vc_d", "VC_STRIDE_T")


def _table_params(p: _Problem) -> dict:
    """The block table and the sequences' extents, shared by both kernels."""
    return dict(b_loc_ptr="b_loc", b_start_loc_ptr="b_start_loc", b_seq_len_ptr="b_seq_len",
                stride_bl_b=Scalar(p.table_strides[0], "i64"),
                stride_bl_n=Scalar(p.table_strides[1], "i64"), ctx_cap=Scalar(p.ctx_cap, "i32"))


def _gather_launch(p: _Problem) -> Launch:
    gather_n = 32 if p.block_d > 128 else 64
    return Launch(
        kernel=_prefix_prefill_gather_kernel,
        grid=(cdiv(p.ctx_cap, gather_n), p.hkv, p.bsz),
        params=dict(k_cache_ptr="k_cache", v_cache_ptr="v_cache", **_table_params(p),
                    k_scr_ptr="k_scratch", v_scr_ptr="v_scratch"),
        writes=("k_scr_ptr", "v_scr_ptr"),
        constexprs=dict(
            HEAD_D=p.d, BLOCK_D=p.block_d, GATHER_N=gather_n, CACHE_BLOCK=p.block_size, X=p.x,
            NUM_KV_HEADS=p.hkv, HAS_WINDOW=p.window > 0, WINDOW=p.window, SKIP_DECODE=p.skip_decode,
            KV_FP8=p.fp8 is not None, FP8_E5M2=p.fp8 == "float8_e5m2",
            **{n: p.strides[n] for n in _CACHE_STRIDES}, CACHE_NEW=p.cache_new, V_PACK=p.v_pack,
            BT_PTR=p.bt_ptr, BLOCK_BYTES=p.block_bytes if p.bt_ptr else 1,
            MIN_Q=0),  # unified_attention's option (see the kernel)
        num_warps=4, num_stages=1)


def _id_run(p: _Problem, config: PrefixPrefillConfig) -> int:
    """The kernel's ID_RUN: the block ids of a key tile are constant over
    aligned runs of this many tokens (a compiler hint)."""
    # NOTE: the hint lets tiles that are contiguous along the keys (V in the
    # standard layout, K with x = 1) load 16-byte vectors. With an interleaved
    # V of pack factor 1 ([num_blocks, Hkv, block_size, D]: V contiguous along
    # D), x = 1 and packed GQA heads, Triton 3.6 miscompiles the kernel although
    # the hint is true (H200, 2026-11-24; BLOCK_M = BLOCK_N = 64, block 32,
    # D 24: output off by 0.2-0.6 with one stage, an illegal shared-memory
    # access with two or three; tools/repro_prefix_fault.py). The same tiles
    # are right with pack factor 8, the standard V layout, x = 8 or BLOCK_N 32
    # (test_gpu_cache_layout_matrix). Without the hint only the x = 1 K tile
    # of that V layout loses its vector loads, so it is dropped there.
    return 1 if p.v_pack == 1 else math.gcd(config.block_n, p.block_size)


# unified_attention's options of _prefix_prefill_kernel (see the kernel), all off here
UNIFIED_OFF = dict(MIN_Q=0, SOFTCAP2=0.0, ALIBI_MODE=0, CAUSAL_FLAGS=False, SYM_WINDOW=False,
                   Q_FP8=0, KS_STRIDE_B=0, KS_STRIDE_H=0, VS_STRIDE_B=0, VS_STRIDE_H=0,
                   FLAT_GRID=False)


def _attention_launch(p: _Problem, config: PrefixPrefillConfig, pack: int) -> Launch:
    dense = config.gather
    return Launch(
        kernel=_prefix_prefill_kernel,
        grid=(cdiv(p.max_input_len, config.block_m // pack), p.hq // pack, p.bsz),
        params=dict(
            q_ptr="q", k_ptr="q" if p.cache_new else "k", v_ptr="q" if p.cache_new else "v", k_cache_ptr="k_cache", v_cache_ptr="v_cache",
            # absent optional arrays: any valid pointer, never read
            k_scale_ptr="k_scale" if p.fp8 else "q", v_scale_ptr="v_scale" if p.fp8 else "q",
            alibi_ptr="alibi_slopes" if p.alibi else "q", sinks_ptr="sinks" if p.sinks else "q",
            out_scale_ptr="fp8_out_scale" if p.out_fp8 else "q", out_in_ptr=p.out_in,
            k_scr_ptr="k_scratch" if dense else "q", v_scr_ptr="v_scratch" if dense else "q",
            **_table_params(p), out_ptr="output"),
        writes=("out_ptr",),
        constexprs=dict(
            QK_SCALE2=float(np.float32(p.scale * LOG2E)), HEAD_D=p.d, BLOCK_D=p.block_d,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, CACHE_BLOCK=p.block_size, X=p.x,
            ID_RUN=_id_run(p, config), GROUP=p.group, PACK=pack,
            PREFETCH_IDS=int(config.prefetch_ids), CACHE_DENSE=dense, OFFS32=p.offs32,
            NUM_KV_HEADS=p.hkv, KV_FP8=p.fp8 is not None, FP8_E5M2=p.fp8 == "float8_e5m2",
            HAS_ALIBI=p.alibi, HAS_WINDOW=p.window > 0, WINDOW=p.window, HAS_SINKS=p.sinks,
            SKIP_DECODE=p.skip_decode, OUT_FP8=p.out_fp8 is not None,
            IS_CAUSAL=p.causal, CACHE_NEW=p.cache_new, V_PACK=p.v_pack,
            BT_PTR=p.bt_ptr, BLOCK_BYTES=p.block_bytes if p.bt_ptr else 1,
            **UNIFIED_OFF, FP8_MAX=FP8_MAX.get(p.out_fp8, 0.0),
            **dict(zip(("FP8_MANT_BITS", "FP8_MIN_NORMAL", "FP8_SUBNORMAL_MAGIC"),
                       FP8_ROUNDING.get(p.out_fp8, (0, 0.0, 0.0)))),
            **p.strides),
        num_warps=config.num_warps, num_stages=config.num_stages)

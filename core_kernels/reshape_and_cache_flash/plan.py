"""Validation and launch plan for reshape_and_cache_flash (framework-free)."""
from __future__ import annotations

import math

from .._plan import (FLOAT_DTYPES, FP8_MAX, INT32_MAX, INT_DTYPES, ArrayInfo, Launch, Plan, Scalar, cdiv,
                     check_config, check_dtype, check_inner_contiguous, check_ndim, check_scalar_array,
                     check_shape, config_class, memoize, next_pow2)
from .._target import Target
from .._triton_utils import FP8_ROUNDING
from .kernels import _reshape_and_cache_flash_kernel

MAX_HEAD_SIZE = 256
# kv_cache_dtype -> the fp8 format the cache stores (None: the cache has key's dtype)
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                   "fp8_e5m2": "float8_e5m2"}
RESULTS = ("key_cache", "value_cache")


@config_class
class ReshapeAndCacheConfig:
    """Tiling of _reshape_and_cache_flash_kernel: ``block_t`` tokens times
    ``block_h`` kv heads per program (powers of two), ``num_warps``;
    ``early_loads``: load the key / value rows without waiting for the slots;
    ``soft_round``: fp8 rounding in software (None: under the interpreter only,
    which needs it; see the kernel's _quantize)."""
    block_t: int
    block_h: int
    num_warps: int = 4
    early_loads: bool = True
    soft_round: bool | None = None


# NOTE: elements (tokens x heads x padded head size) per program and warps, chosen so
# that a 4-warp program holds 16 elements per thread: one 16-byte store per thread into
# an fp8 cache (8 elements would give 8-byte stores). Measured on the H200 (2026-11-27
# at da6a48b, benchmarks/bench_reshape_and_cache_flash.py's sweep, 8192 tokens x 8 kv
# heads x 128, bf16, all heads per program): 1, 2, 4 or 8 tokens per program with 2, 4
# or 8 warps all took 21.6-22.9 us (2.94-3.11 TB/s): flat, so the starting point stays
# (2 tokens, 4 warps: 22.1 us). The same sweep into an fp8 cache was noisy (21-40 us
# for one config across repeats; the case's own row: 19.2 us).
TILE_ELEMENTS = 2048
NUM_WARPS = 4


def check_kv_cache_dtype(kv_cache_dtype) -> str:
    """kv_cache_dtype, checked: one of KV_CACHE_DTYPES (TypeError for a non-string,
    ValueError for another name). Both adapters call it before anything else (it
    is a static option: hashed by the plan caches)."""
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype: expected a string, one of {tuple(KV_CACHE_DTYPES)}, "
                        f"got {type(kv_cache_dtype).__name__} {kv_cache_dtype!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected one of {tuple(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return kv_cache_dtype


def default_config(num_tokens: int, num_heads: int, head_size: int) -> ReshapeAndCacheConfig:
    """The planner's tiling: all kv heads of a token in one program where
    TILE_ELEMENTS allows, then as many tokens as fill it (no more than there are)."""
    block_d = next_pow2(head_size)
    block_h = min(next_pow2(num_heads), max(1, TILE_ELEMENTS // block_d))
    block_t = min(max(1, TILE_ELEMENTS // (block_h * block_d)), next_pow2(num_tokens))
    return ReshapeAndCacheConfig(block_t, block_h, NUM_WARPS)


def _check_config(config: ReshapeAndCacheConfig) -> None:
    for name in ("early_loads", "soft_round"):
        if not isinstance(getattr(config, name), (bool, type(None))):
            raise TypeError(f"config: {name} must be a bool, got {getattr(config, name)!r}")
    for name in ("block_t", "block_h"):
        v = getattr(config, name)
        if not (isinstance(v, int) and v >= 1 and v & (v - 1) == 0):
            raise ValueError(f"config: {name} must be a power of two >= 1, got {v!r}")
    if config.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"config: num_warps must be 1, 2, 4, 8 or 16, got {config.num_warps!r}")


def _strides(info: ArrayInfo, dims) -> list:
    """The strides of ``dims``, 0 where the extent is 1 (never used: such a
    stride, often arbitrary in torch, must not spoil the alignment group)."""
    return [info.strides[d] if info.shape[d] > 1 else 0 for d in dims]


def _scalar(value: int, align: str) -> Scalar:
    return Scalar(value, "i32" if abs(value) <= INT32_MAX else "i64", align=align)


@memoize
def plan_reshape_and_cache_flash(target: Target, key: ArrayInfo, value: ArrayInfo, key_cache: ArrayInfo,
                                 value_cache: ArrayInfo, slot_mapping: ArrayInfo, k_scale: ArrayInfo | None = None,
                                 v_scale: ArrayInfo | None = None, *, kv_cache_dtype: str = "auto",
                                 config: ReshapeAndCacheConfig | None = None) -> Plan:
    """Plan reshape_and_cache_flash: write each token's key / value rows into the
    paged caches at its slot.

    Arrays: key, value [N, Hkv, D] float32/float16/bfloat16 (one dtype; with
    "auto" also an fp8 dtype), innermost dim contiguous, other strides free; key_cache,
    value_cache [num_blocks, block_size, Hkv, D] (vLLM's flash layout; any
    block_size >= 1; innermost dim contiguous, other strides free), both updated in
    place (they are arguments and the results "key_cache", "value_cache"):
    key's dtype with kv_cache_dtype "auto", else the fp8 format it names
    (float8_e4m3fn for "fp8" / "fp8_e4m3", float8_e5m2 for "fp8_e5m2") or uint8
    holding its bits; slot_mapping [N] int32/int64 device data: token t goes to
    block s // block_size, position s % block_size for s = slot_mapping[t];
    s < 0 writes nothing (and so does s >= num_blocks * block_size: an index
    error, reported by validate_indices, never a write outside the cache);
    k_scale, v_scale 1-element float32 device data, required for fp8 (the cache
    holds fp8(clamp(x / scale))), checked but unused with "auto".
    """
    check_config(config, (ReshapeAndCacheConfig,))
    check_kv_cache_dtype(kv_cache_dtype)
    fmt = KV_CACHE_DTYPES[kv_cache_dtype]
    check_ndim("key", key, 3, "[N, Hkv, D]")
    n, h, d = key.shape
    check_dtype("key", key, FLOAT_DTYPES + (tuple(FP8_MAX) if fmt is None else ()))
    if not 1 <= d <= MAX_HEAD_SIZE:
        raise ValueError(f"key: head size {d} is not in [1, {MAX_HEAD_SIZE}]")
    check_ndim("value", value, 3, "[N, Hkv, D]")
    check_shape("value", value, key.shape, "key's [N, Hkv, D]")
    if value.dtype != key.dtype:
        raise TypeError(f"value: dtype {value.dtype} differs from key's {key.dtype}")
    check_ndim("key_cache", key_cache, 4, "[num_blocks, block_size, Hkv, D]")
    num_blocks, block_size = key_cache.shape[:2]
    check_shape("key_cache", key_cache, (num_blocks, block_size, h, d), "[num_blocks, block_size, Hkv, D]")
    check_ndim("value_cache", value_cache, 4, "[num_blocks, block_size, Hkv, D]")
    check_shape("value_cache", value_cache, key_cache.shape, "key_cache's")
    if fmt is None and key_cache.dtype != key.dtype:
        raise TypeError(f"key_cache: dtype {key_cache.dtype} differs from key's {key.dtype}; with "
                        "kv_cache_dtype 'auto' the cache stores key as is (pass 'fp8' for an fp8 cache)")
    if fmt is not None and key_cache.dtype not in (fmt, "uint8"):
        raise TypeError(f"key_cache: dtype {key_cache.dtype} does not hold kv_cache_dtype "
                        f"{kv_cache_dtype!r}; expected {fmt} or uint8")
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache: dtype {value_cache.dtype} differs from key_cache's {key_cache.dtype}")
    check_ndim("slot_mapping", slot_mapping, 1, "[N]")
    check_shape("slot_mapping", slot_mapping, (n,), "one slot per token of key")
    check_dtype("slot_mapping", slot_mapping, INT_DTYPES)
    for name, info in (("k_scale", k_scale), ("v_scale", v_scale)):
        if info is None and fmt is not None:
            raise ValueError(f"{name}: required with kv_cache_dtype {kv_cache_dtype!r} (the cache holds "
                             f"x / {name} in fp8)")
        if info is not None:
            check_scalar_array(name, info, ("float32",))   # device data: the value is the kernel's
    for name, info in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                       ("slot_mapping", slot_mapping)):
        check_inner_contiguous(name, info)
    if n > INT32_MAX:
        raise ValueError(f"key: {n} tokens exceed the kernel's int32 token count")
    if n == 0 or h == 0 or math.prod(key_cache.shape) == 0:
        return Plan({}, (), RESULTS)   # nothing to write

    if config is None:
        config = default_config(n, h, d)
    _check_config(config)
    if target.interpret and config.soft_round is False:
        raise ValueError("config: soft_round=False needs the GPU's fp8 conversion; Triton's interpreter "
                         "converts wrongly without the software rounding")
    src = _strides(key, (0, 1)) + _strides(value, (0, 1))
    dst = _strides(key_cache, (0, 1, 2)) + _strides(value_cache, (0, 1, 2))
    fp8 = fmt is not None
    mant_bits, min_normal, magic = FP8_ROUNDING.get(fmt, (0, 0.0, 0.0))
    params = dict(
        key_ptr="key", value_ptr="value", slot_mapping_ptr="slot_mapping",
        k_scale_ptr="k_scale" if fp8 else "key", v_scale_ptr="v_scale" if fp8 else "key",
        key_cache_in_ptr="key_cache", value_cache_in_ptr="value_cache",
        num_tokens=Scalar(n), num_slots=Scalar(num_blocks * block_size, "i64"),
        **{p: _scalar(s, "SRC_ALIGN") for p, s in zip(
            ("stride_k_t", "stride_k_h", "stride_v_t", "stride_v_h"), src)},
        **{p: _scalar(s, "DST_ALIGN") for p, s in zip(
            ("stride_kc_b", "stride_kc_s", "stride_kc_h", "stride_vc_b", "stride_vc_s", "stride_vc_h"), dst)},
        key_cache_ptr="key_cache", value_cache_ptr="value_cache")
    launch = Launch(
        kernel=_reshape_and_cache_flash_kernel, grid=(cdiv(n, config.block_t), cdiv(h, config.block_h)),
        params=params, writes=("key_cache_ptr", "value_cache_ptr"),
        constexprs=dict(BLOCK_SIZE=block_size, NUM_HEADS=h, HEAD_SIZE=d, BLOCK_T=config.block_t,
                        BLOCK_H=config.block_h, BLOCK_D=next_pow2(d), EARLY_LOADS=bool(config.early_loads),
                        FP8=fp8, FP8_E5M2=fmt == "float8_e5m2", STORE_BITS=fp8 and key_cache.dtype == "uint8",
                        SOFT_ROUND=bool(target.interpret if config.soft_round is None else config.soft_round),
                        FP8_MAX=FP8_MAX.get(fmt, 0.0), FP8_MANT_BITS=mant_bits, FP8_MIN_NORMAL=min_normal,
                        FP8_SUBNORMAL_MAGIC=magic),
        num_warps=config.num_warps, num_stages=1)
    return Plan({}, (launch,), RESULTS)

"""Validation and launch plan for lightning attention decode (framework-free):
one token per sequence against its cached state, decode_kernels.py's kernel
(config :class:`LightningDecodeConfig`)."""
from __future__ import annotations

import dataclasses

from .._plan import (FLOAT_DTYPES, INT_DTYPES, ArrayInfo, Buffer, Launch, Plan, Scalar, cdiv, check_config,
                     check_dtype, check_inner_contiguous, check_ndim, check_shape, config_class, memoize,
                     next_pow2)
from .._target import Target
from .decode_kernels import _lightning_decode_kernel
from .prefill_plan import _aligned, _check_decay, _check_head


@config_class
class LightningDecodeConfig:
    """The decode kernel: E-tile (state columns per program) and warps."""
    block_e: int = 64
    num_warps: int = 4


@dataclasses.dataclass(frozen=True)
class _Decode:
    q: ArrayInfo
    k: ArrayInfo
    v: ArrayInfo
    kv_caches: ArrayInfo
    slope_rate: ArrayInfo
    b: int
    h: int
    d: int
    e: int


DECODE_RESULTS = ("output", "kv_caches")


@memoize
def plan_linear_decode(target: Target, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo,
                       kv_caches: ArrayInfo, slope_rate: ArrayInfo, slot_idx: ArrayInfo, *,
                       config: LightningDecodeConfig | None = None) -> Plan:
    """Plan one lightning-attention decode step.

    Arrays: q, k [B, H, 1, D], v [B, H, 1, E] (one float dtype, innermost dim
    contiguous, other strides free), kv_caches [num_slots, H, D, E] fp32, or
    bf16/fp16 (the state in the model dtype, as vLLM's MiniMax layer keeps it:
    updated in fp32, stored rounded; the output uses the unrounded state), any
    strides; updated in place: it is both an argument and a result,
    slope_rate [H] or [H, 1, 1] fp32, slot_idx [B] int32/int64 (-1 = padding).
    Results: "output" [B, H * E] (q dtype) and "kv_caches".
    ``config`` overrides the tiling chosen from the table below.
    """
    check_config(config, (LightningDecodeConfig,))
    p = _validate_decode(q, k, v, kv_caches, slope_rate, slot_idx)
    buffers = {"output": Buffer((p.b, p.h * p.e), q.dtype)}
    if p.b == 0 or p.h == 0:
        return Plan(buffers, (), DECODE_RESULTS)
    config = config or LightningDecodeConfig(min(DECODE_BLOCK_E, max(16, next_pow2(p.e))),
                                             DECODE_NUM_WARPS)
    return Plan(buffers, (_decode_launch(p, config),), DECODE_RESULTS)


def _validate_decode(q, k, v, kv_caches, slope_rate, slot_idx) -> _Decode:
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
    check_dtype("kv_caches", kv_caches, FLOAT_DTYPES)
    slope_rate = _check_decay("slope_rate", slope_rate, h)
    check_shape("slot_idx", slot_idx, (b,), "[B]")
    check_dtype("slot_idx", slot_idx, INT_DTYPES)
    check_inner_contiguous("slot_idx", slot_idx)  # read with unit stride
    return _Decode(q, k, v, kv_caches, slope_rate, b, h, d, e)


# NOTE: H200 sweeps, B=64, H=64, D=128 (three runs): E-tile 64 at 2/4/8 warps
# 3.82-3.88 / 3.83-3.88 / 3.72-3.89 TB/s; E-tile 32: 3.46-3.67; E-tile 128:
# 0.62 (2 warps, spills) to 3.74. Also measured and dropped: evict-first loads
# with streaming stores (-3%), several (b, h) per program with the next one's
# loads software-pipelined (2, 4, 8 per program: -2% to -20%).
DECODE_BLOCK_E = 64
DECODE_NUM_WARPS = 4


def _decode_launch(p: _Decode, c: LightningDecodeConfig) -> Launch:
    block_d = max(16, next_pow2(p.d))
    cache = p.kv_caches.strides
    return Launch(
        kernel=_lightning_decode_kernel, grid=(cdiv(p.e, c.block_e), p.b * p.h),
        params=dict(
            q_ptr="q", k_ptr="k", v_ptr="v", cache_in_ptr="kv_caches", decay_ptr="slope_rate",
            slot_ptr="slot_idx", num_heads=Scalar(p.h), num_slots=Scalar(p.kv_caches.shape[0]),
            head_k=Scalar(p.d), head_v=Scalar(p.e), stride_decay=Scalar(p.slope_rate.strides[0]),
            **_aligned("stride_qb stride_qh", p.q.strides[:2]),
            **_aligned("stride_kb stride_kh", p.k.strides[:2]),
            **_aligned("stride_vb stride_vh", p.v.strides[:2]),
            **_aligned("stride_cs stride_ch stride_cd", cache[:3]), stride_ce=Scalar(cache[3]),
            **_aligned("stride_ob stride_oh", (p.h * p.e, p.e)),
            out_ptr="output", cache_ptr="kv_caches"),
        writes=("out_ptr", "cache_ptr"),
        constexprs=dict(BLOCK_D=block_d, BLOCK_E=c.block_e, EVEN_D=p.d == block_d,
                        EVEN_E=p.e % c.block_e == 0,
                        OFFS_64=abs(cache[2]) * p.d + abs(cache[3]) * p.e >= 2 ** 31),
        num_warps=c.num_warps, num_stages=1)

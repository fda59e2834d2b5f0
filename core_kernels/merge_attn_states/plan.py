"""Validation and launch plan for merge_attn_states (framework-free)."""
from __future__ import annotations

import math

from .._plan import (FLOAT_DTYPES, FP8_MAX, ITEMSIZE, ArrayInfo, Buffer, Launch, Plan, Scalar,
                     cdiv, check_dtype, check_inner_contiguous, check_ndim, check_shape,
                     memoize, next_pow2)
from .._triton_utils import FP8_ROUNDING
from .kernels import _merge_attn_states_kernel

MAX_HEAD_SIZE = 512
# NOTE: elements per tile and warps by input itemsize, from the H200 sweep in
# benchmarks/bench_merge_attn_states.py (16384x32x128): bf16 2048/2w 92.4% of copy
# bandwidth vs 91.2% for 4096/4w; fp32 2048/8w 98% vs 88% for 4096/8w (run-to-run
# spread is a few percent). An evict_first hint on the loads cost 5-15% there, so
# loads use the default policy. A persistent grid-stride loop (grid capped at
# 8x or 16x the SM count) was no faster for bf16 and is not used.
TILE_ELEMS = {2: 2048, 4: 2048}
NUM_WARPS = {2: 2, 4: 8}


@memoize
def plan_merge_attn_states(
    prefix_output: ArrayInfo, prefix_lse: ArrayInfo,
    suffix_output: ArrayInfo, suffix_lse: ArrayInfo,
    output: ArrayInfo | None = None, output_lse: ArrayInfo | None = None,
    *, want_output_lse: bool = True, num_ctx: str = "none",
    has_output_scale: bool = False, output_dtype: str | None = None,
    tile_elems: int | None = None, num_warps: int | None = None, evict: str = "",
) -> Plan:
    """Plan the merge of two partial attention states.

    ``output`` / ``output_lse``: ArrayInfo of caller-provided buffers (in place,
    the torch API) or None to have the plan allocate them (the JAX API).
    ``num_ctx``: how prefill_tokens_with_context arrives: "none" (= N),
    "scalar" (runtime argument ``prefill_tokens_with_context``, an int) or
    "array" (a 1-element int device array named ``prefill_tokens_with_context``).
    With ``has_output_scale`` a 1-element fp32 array named ``output_scale`` is read.
    """
    check_ndim("prefix_output", prefix_output, 3, "[N, H, D]")
    check_dtype("prefix_output", prefix_output, FLOAT_DTYPES)
    n, h, d = prefix_output.shape
    check_shape("suffix_output", suffix_output, (n, h, d), "same as prefix_output")
    if suffix_output.dtype != prefix_output.dtype:
        raise TypeError(f"suffix_output: dtype {suffix_output.dtype} differs from "
                        f"prefix_output's {prefix_output.dtype}")
    for name, info in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse)):
        check_shape(name, info, (h, n), "[H, N]")
        check_dtype(name, info, ("float32",))
    if not 1 <= d <= MAX_HEAD_SIZE:
        raise ValueError(f"prefix_output: head size {d} is not in [1, {MAX_HEAD_SIZE}]")
    check_inner_contiguous("prefix_output", prefix_output)
    check_inner_contiguous("suffix_output", suffix_output)
    if num_ctx not in ("none", "scalar", "array"):
        raise ValueError(f"num_ctx: expected 'none', 'scalar' or 'array', got {num_ctx!r}")

    if output is not None:
        check_shape("output", output, (n, h, d), "[N, H, D]")
        check_inner_contiguous("output", output)
        out_dtype = output.dtype
    else:
        out_dtype = output_dtype or ("float8_e4m3fn" if has_output_scale else prefix_output.dtype)
    allowed_out = ("float8_e4m3fn",) if has_output_scale else (prefix_output.dtype,)
    if out_dtype not in allowed_out:
        if out_dtype in FP8_MAX and not has_output_scale:
            raise ValueError("output_scale: an fp8 output needs output_scale")
        raise TypeError(f"output: dtype {out_dtype} is not valid here; expected {allowed_out[0]}"
                        + (" when output_scale is given" if has_output_scale else
                           " (the input dtype)"))
    if output_lse is not None:
        check_shape("output_lse", output_lse, (h, n), "[H, N]")
        check_dtype("output_lse", output_lse, ("float32",))
    has_out_lse = output_lse is not None or (output is None and want_output_lse)

    buffers = {}
    if output is None:
        buffers["output"] = Buffer((n, h, d), out_dtype)
        output = ArrayInfo.contiguous((n, h, d), out_dtype)
    if has_out_lse and output_lse is None:
        buffers["output_lse"] = Buffer((h, n), "float32")
        output_lse = ArrayInfo.contiguous((h, n), "float32")
    results = ("output", "output_lse") if has_out_lse else ("output",)
    if n == 0 or h == 0:
        return Plan(buffers, (), results)

    block_d = max(16, next_pow2(d))
    itemsize = ITEMSIZE[prefix_output.dtype]
    tile_elems = tile_elems or TILE_ELEMS[itemsize]
    num_warps = num_warps or NUM_WARPS[itemsize]
    rows = n * h
    block_r = max(1, min(tile_elems // block_d, next_pow2(rows)))
    num_ctx_arg = Scalar("prefill_tokens_with_context", "i64") if num_ctx == "scalar" else Scalar(n, "i64")
    num_ctx_ptr = "prefill_tokens_with_context" if num_ctx == "array" else "prefix_lse"
    out_scale_ptr = "output_scale" if has_output_scale else "prefix_lse"  # dummy when absent
    lse_strides = output_lse.strides if has_out_lse else (0, 0)
    launch = Launch(
        kernel=_merge_attn_states_kernel,
        grid=(cdiv(rows, block_r),),
        args=("prefix_output", "prefix_lse", "suffix_output", "suffix_lse",
              num_ctx_ptr, out_scale_ptr,
              Scalar(rows), Scalar(h), num_ctx_arg,
              *(Scalar(s) for s in prefix_output.strides[:2]),
              *(Scalar(s) for s in suffix_output.strides[:2]),
              *(Scalar(s) for s in output.strides[:2]),
              *(Scalar(s) for s in prefix_lse.strides),
              *(Scalar(s) for s in suffix_lse.strides),
              *(Scalar(s) for s in lse_strides)),
        # without output_lse the kernel never touches its pointer: repeat "output"
        outputs=("output", "output_lse" if has_out_lse else "output"),
        constexprs=dict(BLOCK_R=block_r, BLOCK_D=block_d, HEAD_SIZE=d,
                        ROW_ALIGN=math.gcd(16, *prefix_output.strides[:2], *suffix_output.strides[:2],
                                           *output.strides[:2]),
                        EVICT=evict,
                        NUM_CTX_FROM_PTR=num_ctx == "array", HAS_OUT_LSE=has_out_lse,
                        HAS_SCALE=has_output_scale,
                        FP8_MAX=FP8_MAX.get(out_dtype, 0.0),
                        **dict(zip(("FP8_MANT_BITS", "FP8_MIN_NORMAL", "FP8_SUBNORMAL_MAGIC"),
                                   FP8_ROUNDING.get(out_dtype, (0, 0.0, 0.0))))),
        num_warps=num_warps, num_stages=1,
    )
    return Plan(buffers, (launch,), results)

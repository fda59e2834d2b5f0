"""Validation and launch plan for merge_attn_states (framework-free)."""
from __future__ import annotations

import dataclasses

from .._plan import (FLOAT_DTYPES, FP8_MAX, INT_DTYPES, ITEMSIZE, ArrayInfo, Buffer, Launch, Plan,
                     Scalar, as_int, cdiv, check_config, check_dtype, check_inner_contiguous,
                     check_ndim, check_scalar_array, check_shape, config_class, memoize, next_pow2)
from .._target import Target
from .._triton_utils import FP8_ROUNDING
from .kernels import _merge_attn_states_bwd_kernel, _merge_attn_states_kernel

MAX_HEAD_SIZE = 512


@config_class
class MergeConfig:
    """Tiling of _merge_attn_states_kernel: rows of BLOCK_R (token, head) pairs,
    about ``tile_elems`` elements per program, ``num_warps`` warps."""
    tile_elems: int = 2048
    num_warps: int = 4
    evict: str = ""  # eviction policy of the loads ("" = default, "evict_first", ...)
    # issue the values' loads before the LSEs' (an empty part's values are then
    # loaded and zeroed instead of never loaded)
    load_first: bool = False
    # a tile's rows are consecutive tokens of one head (its LSEs one contiguous
    # run) instead of consecutive heads of one token
    head_major: bool = False


# NOTE: the tiling by input itemsize and size (elements E = N * H * padded D):
# for each itemsize, (largest E, config) in order. From the H200 tuning run of
# 2026-11-25 on da7485c's kernel (benchmarks/experiments/exp_merge_small.py
# --only tune, results/2026-11-25-merge-small/exp_merge_small_tune.json; x 32 heads,
# bf16 and fp32, GPU time per call in a CUDA graph over cold inputs, vLLM's
# kernel in the same run):
# - a tiny merge (N = 1) is latency-bound: one row per one-warp program with the
#   values' loads issued before the LSEs' (load_first) took 1.50 us (bf16) and
#   1.89 us (fp32) against vLLM's 1.79 / 2.11 and 1.91 / 2.54 for the previous
#   default; the previous default waited for the LSE loads before loading values.
# - 16-bit up to 4096 x 32 (now to 2048 x 32, see below): 512-element tiles,
#   2 warps, load_first: N = 64 2.56 us (vLLM 3.38, previous default 3.02), 256
#   4.07 (5.16), 1024 9.13 (11.09), 4096 28.19 (29.58). At 16384 x 32 the 2048/2
#   tiles without load_first stay best (100.3 vs 104.8 us in the graph).
# - fp32: one row per warp with load_first up to 64 x 32 (3.14 us, vLLM 3.82,
#   previous 4.06); 512/2 with load_first to 2^20 elements (64 x 128 6.05 vs
#   6.41); 512/2 without it above (1024 x 32 15.47 vs 16.39; 4096 49.8 vs 52.0;
#   16384 188.8 vs 192.8 us).
# - 16-bit above 2^23 elements: head_major 2048/2 tiles (16 tokens of one head:
#   the tile's LSEs one contiguous run instead of 16 scattered 4-byte accesses),
#   same bits (H200, 2026-11-25, exp_merge_small.py --only order, results/
#   2026-11-25-merge-small/exp_merge_small_order.json; do_bench medians of five
#   alternated runs, x 128):
#   16384 x 32 bf16 101.2 us against 105.3 for the heads-of-a-token 2048/2 tiles
#   (95.1% of the 2 GiB copy rate against 91.5%), fp16 102.4 vs 105.3, 16384 x 64
#   bf16 194.2 vs 200.1, 4096 x 32 bf16 31.8 vs 33.9 (the 512/2 load_first tiles);
#   at 1024 x 32 no gain (12.7 vs 12.6). Between them (--only order_mid,
#   exp_merge_small_order_mid.json, seven runs, GPU time in the cold CUDA graph,
#   load_first 512/2 vs head-major 2048/2): 1536 x 32 bf16 12.94 vs 13.23 us, fp16
#   12.55 vs 13.33; 2048 bf16 16.21 vs 16.44, fp16 15.55 vs 16.58; 3072 bf16 23.12
#   vs 22.38, fp16 21.99 vs 22.42; 4096 bf16 29.75 vs 28.32, fp16 28.42 vs 28.21:
#   the 512/2 load_first tiles keep 2^23 elements and below, head-major takes over
#   above. fp32 gained under 1% (16384 x 32 512/2: 192.3 vs 193.3 us) and
#   keeps its tiles; so does the backward (head_major 512/2: 170.5 vs 169.0 us at
#   16384 x 32 bf16).
# An evict_first hint on the loads cost 5-15% (earlier sweep), so loads use the
# default policy. A persistent grid-stride loop was no faster and is not used.
TILINGS = {
    2: ((1 << 14, MergeConfig(128, 1, "", True)), (1 << 23, MergeConfig(512, 2, "", True)),
        (None, MergeConfig(2048, 2, "", False, True))),
    4: ((1 << 18, MergeConfig(128, 1, "", True)), (1 << 20, MergeConfig(512, 2, "", True)),
        (None, MergeConfig(512, 2))),
}
# what plan_merge_attn_states_backward returns, in order
BACKWARD_RESULTS = ("grad_prefix_output", "grad_prefix_lse", "grad_suffix_output", "grad_suffix_lse")


def _block_d(d: int) -> int:
    """A tile row's channels: the head size padded to a power of two >= 16."""
    return max(16, next_pow2(d))


def _row_tiles(n: int, h: int, block_d: int, config: MergeConfig) -> tuple[int, int]:
    """(BLOCK_R, programs) of ``config``'s tiles over N x H rows of ``block_d`` channels."""
    if config.head_major:
        block_r = max(1, min(config.tile_elems // block_d, next_pow2(n)))
        return block_r, h * cdiv(n, block_r)
    block_r = max(1, min(config.tile_elems // block_d, next_pow2(n * h)))
    return block_r, cdiv(n * h, block_r)


def default_config(n: int, h: int, d: int, itemsize: int) -> MergeConfig:
    """The measured tiling of an [N, H, D] merge of ``itemsize``-byte inputs (TILINGS)."""
    block_d = _block_d(d)
    elems = n * h * block_d
    for limit, config in TILINGS[itemsize]:
        if limit is None or elems <= limit:
            if config.head_major and n < config.tile_elems // block_d:
                # fewer tokens than a tile's rows: head-major tiles would run part-empty
                return dataclasses.replace(config, head_major=False)
            return config
    raise AssertionError("TILINGS ends with an unbounded entry")


@dataclasses.dataclass(frozen=True)
class _Problem:
    n: int
    h: int
    d: int
    in_dtype: str
    out_dtype: str
    output: ArrayInfo          # the output's layout (caller's, or the buffer's)
    output_lse: ArrayInfo | None
    has_out_lse: bool
    buffers: dict
    results: tuple


def check_prefill_tokens_with_context(value, n: int) -> int:
    """A host value of prefill_tokens_with_context (Python/numpy int, 0-d numpy
    array) for N tokens: an int in [0, N] (docs/scalar_policy.md)."""
    return as_int("prefill_tokens_with_context", value, 0, n, f"a token count, at most N = {n}")


@memoize
def plan_merge_attn_states(
    target: Target, prefix_output: ArrayInfo, prefix_lse: ArrayInfo,
    suffix_output: ArrayInfo, suffix_lse: ArrayInfo,
    output: ArrayInfo | None = None, output_lse: ArrayInfo | None = None,
    output_scale: ArrayInfo | None = None, prefill_tokens_with_context: ArrayInfo | None = None,
    *, want_output_lse: bool = True, num_ctx: str = "none", output_dtype: str | None = None,
    config: MergeConfig | None = None,
) -> Plan:
    """Plan the merge of two partial attention states.

    ``output`` / ``output_lse``: ArrayInfo of caller-provided buffers (in place,
    the torch API) or None to have the plan allocate them (the JAX API).
    ``num_ctx``: how prefill_tokens_with_context arrives: "none" (= N),
    "scalar" (runtime argument ``prefill_tokens_with_context``, an int) or
    "array" (a 1-element int device array named ``prefill_tokens_with_context``,
    whose ArrayInfo may be passed to have its shape and dtype checked; its value is
    device data: values outside [0, N] act as the nearest bound, see
    docs/scalar_policy.md). A host value is checked with
    :func:`check_prefill_tokens_with_context` by the adapters.
    ``output_scale``: the ArrayInfo of a 1-element fp32 array (the output is fp8), or None.
    ``config`` overrides the tiling chosen from CONFIGS.
    """
    check_config(config, (MergeConfig,))
    problem = _validate(prefix_output, prefix_lse, suffix_output, suffix_lse, output, output_lse,
                        want_output_lse, num_ctx, output_scale, output_dtype)
    if prefill_tokens_with_context is not None:
        if num_ctx != "array":
            raise ValueError("prefill_tokens_with_context: an array is passed with num_ctx='array'")
        check_scalar_array("prefill_tokens_with_context", prefill_tokens_with_context, INT_DTYPES)
    if problem.n == 0 or problem.h == 0:
        return Plan(problem.buffers, (), problem.results)
    config = config or default_config(problem.n, problem.h, problem.d, ITEMSIZE[problem.in_dtype])
    return Plan(problem.buffers, (_launch(problem, config, prefix_output, prefix_lse, suffix_output,
                                          suffix_lse, num_ctx, output_scale is not None),),
                problem.results)


def _validate(prefix_output, prefix_lse, suffix_output, suffix_lse, output, output_lse,
              want_output_lse, num_ctx, output_scale, output_dtype) -> _Problem:
    has_output_scale = output_scale is not None
    if has_output_scale:
        check_scalar_array("output_scale", output_scale, ("float32",))
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
    return _Problem(n, h, d, prefix_output.dtype, out_dtype, output, output_lse if has_out_lse else None,
                    has_out_lse, buffers, results)


def _row_stride(stride: int) -> Scalar:
    """A row stride of an [N, H, D] tensor, passed divided by its alignment group
    (16-byte rows when the strides allow, see the kernels' _row_offsets)."""
    return Scalar(stride, align="ROW_ALIGN")


def _row_launch(kernel, n: int, h: int, d: int, config: MergeConfig, num_ctx: str, prefix_output: ArrayInfo,
                prefix_lse: ArrayInfo, suffix_output: ArrayInfo, suffix_lse: ArrayInfo, params: dict,
                writes: tuple, constexprs: dict) -> Launch:
    """A launch of one of the row-tiled kernels (the forward or the backward) over
    N x H rows of D channels: ``config``'s tiling, the two parts' pointers and
    strides and the context count (``num_ctx`` as in plan_merge_attn_states), plus
    the kernel's own ``params``, ``writes`` and ``constexprs``."""
    block_d = _block_d(d)
    block_r, programs = _row_tiles(n, h, block_d, config)
    return Launch(
        kernel=kernel,
        grid=(programs,),
        params=dict(
            prefix_out_ptr="prefix_output", prefix_lse_ptr="prefix_lse",
            suffix_out_ptr="suffix_output", suffix_lse_ptr="suffix_lse",
            num_ctx_ptr="prefill_tokens_with_context" if num_ctx == "array" else "prefix_lse",
            num_rows=Scalar(n * h), num_heads=Scalar(h),
            num_ctx_arg=(Scalar("prefill_tokens_with_context", "i64") if num_ctx == "scalar"
                         else Scalar(n, "i64")),
            stride_po_t=_row_stride(prefix_output.strides[0]), stride_po_h=_row_stride(prefix_output.strides[1]),
            stride_so_t=_row_stride(suffix_output.strides[0]), stride_so_h=_row_stride(suffix_output.strides[1]),
            stride_plse_h=Scalar(prefix_lse.strides[0]), stride_plse_t=Scalar(prefix_lse.strides[1]),
            stride_slse_h=Scalar(suffix_lse.strides[0]), stride_slse_t=Scalar(suffix_lse.strides[1]),
            **params),
        writes=writes,
        constexprs=dict(BLOCK_R=block_r, BLOCK_D=block_d, HEAD_SIZE=d, HEAD_MAJOR=config.head_major,
                        NUM_CTX_FROM_PTR=num_ctx == "array", **constexprs),
        num_warps=config.num_warps, num_stages=1,
    )


def _launch(p: _Problem, config: MergeConfig, prefix_output, prefix_lse, suffix_output, suffix_lse,
            num_ctx, has_output_scale) -> Launch:
    lse_strides = p.output_lse.strides if p.has_out_lse else (0, 0)
    return _row_launch(
        _merge_attn_states_kernel, p.n, p.h, p.d, config, num_ctx, prefix_output, prefix_lse, suffix_output,
        suffix_lse,
        params=dict(
            out_scale_ptr="output_scale" if has_output_scale else "prefix_lse",  # dummy when absent
            stride_o_t=_row_stride(p.output.strides[0]), stride_o_h=_row_stride(p.output.strides[1]),
            stride_olse_h=Scalar(lse_strides[0]), stride_olse_t=Scalar(lse_strides[1]),
            # without output_lse the kernel never touches its pointer: repeat "output"
            out_ptr="output", out_lse_ptr="output_lse" if p.has_out_lse else "output"),
        writes=("out_ptr", "out_lse_ptr"),
        constexprs=dict(EVICT=config.evict, LOAD_FIRST=config.load_first, HAS_OUT_LSE=p.has_out_lse,
                        HAS_SCALE=has_output_scale, FP8_MAX=FP8_MAX.get(p.out_dtype, 0.0),
                        **dict(zip(("FP8_MANT_BITS", "FP8_MIN_NORMAL", "FP8_SUBNORMAL_MAGIC"),
                                   FP8_ROUNDING.get(p.out_dtype, (0, 0.0, 0.0))))))


# ---------------------------------------------------------------- backward
NO_FP8_BACKWARD = ("output_scale: merge_attn_states with an fp8 output (output_scale given) has no "
                   "backward; merge in the input dtype to train through it, and quantise afterwards")

# NOTE: the backward reads three [N, H, D] tiles (prefix, suffix, gradient) and
# writes two. 512-element tiles with 2 warps were the fastest or tied at every
# size measured (H200, 2026-11-25, 13ec56e's kernel, exp_merge_small.py --only bwd,
# results/2026-11-25-merge-small/exp_merge_small_bwd.json; x 32 heads x 128, GPU
# time per call, do_bench): bf16 16384 tokens 168.3 us (95.6% of the copy rate)
# against 199.2 for the 2048/4 tiles used before, 4096 49.0 vs 55.7, 64 5.4 vs 6.4;
# fp32 16384 324.0 vs 330.5 (98.4%), 4096 87.5 vs 89.7, 64 (CUDA graph) 4.15 vs
# 4.68. Every tiling gave the same bits.
BACKWARD_CONFIGS = {2: MergeConfig(512, 2), 4: MergeConfig(512, 2)}


@memoize
def plan_merge_attn_states_backward(
    target: Target, prefix_output: ArrayInfo, prefix_lse: ArrayInfo,
    suffix_output: ArrayInfo, suffix_lse: ArrayInfo, grad_output: ArrayInfo,
    grad_output_lse: ArrayInfo | None = None, prefill_tokens_with_context: ArrayInfo | None = None,
    *, num_ctx: str = "none", config: MergeConfig | None = None,
) -> Plan:
    """Plan the backward of merge_attn_states (output in the input dtype; an fp8
    output has no backward: :data:`NO_FP8_BACKWARD`).

    ``grad_output``: [N, H, D] in the inputs' dtype, innermost dim contiguous;
    ``grad_output_lse``: [H, N] float32 (any strides) or None (= zero).
    ``num_ctx`` / ``prefill_tokens_with_context``: as for :func:`plan_merge_attn_states`.
    Results, allocated contiguous: ``grad_prefix_output`` [N, H, D] and
    ``grad_suffix_output`` in the inputs' dtype, ``grad_prefix_lse`` [H, N] and
    ``grad_suffix_lse`` float32, in the order (grad_prefix_output, grad_prefix_lse,
    grad_suffix_output, grad_suffix_lse).
    """
    check_config(config, (MergeConfig,))
    problem = _validate(prefix_output, prefix_lse, suffix_output, suffix_lse, None, None,
                        True, num_ctx, None, None)
    n, h, d = problem.n, problem.h, problem.d
    check_ndim("grad_output", grad_output, 3, "[N, H, D]")
    check_shape("grad_output", grad_output, (n, h, d), "same as prefix_output")
    if grad_output.dtype != problem.in_dtype:
        raise TypeError(f"grad_output: dtype {grad_output.dtype} differs from the output's "
                        f"{problem.in_dtype} (the inputs' dtype)")
    check_inner_contiguous("grad_output", grad_output)
    if grad_output_lse is not None:
        check_shape("grad_output_lse", grad_output_lse, (h, n), "[H, N]")
        check_dtype("grad_output_lse", grad_output_lse, ("float32",))
    if prefill_tokens_with_context is not None:
        if num_ctx != "array":
            raise ValueError("prefill_tokens_with_context: an array is passed with num_ctx='array'")
        check_scalar_array("prefill_tokens_with_context", prefill_tokens_with_context, INT_DTYPES)
    buffers = {"grad_prefix_output": Buffer((n, h, d), problem.in_dtype),
               "grad_prefix_lse": Buffer((h, n), "float32"),
               "grad_suffix_output": Buffer((n, h, d), problem.in_dtype),
               "grad_suffix_lse": Buffer((h, n), "float32")}
    results = BACKWARD_RESULTS
    if n == 0 or h == 0:
        return Plan(buffers, (), results)
    config = config or BACKWARD_CONFIGS[ITEMSIZE[problem.in_dtype]]
    glse = grad_output_lse.strides if grad_output_lse is not None else (0, 0)
    launch = _row_launch(
        _merge_attn_states_bwd_kernel, n, h, d, config, num_ctx, prefix_output, prefix_lse, suffix_output,
        suffix_lse,
        params=dict(
            grad_out_ptr="grad_output",
            grad_lse_ptr="grad_output_lse" if grad_output_lse is not None else "prefix_lse",  # dummy
            stride_go_t=_row_stride(grad_output.strides[0]), stride_go_h=_row_stride(grad_output.strides[1]),
            stride_glse_h=Scalar(glse[0]), stride_glse_t=Scalar(glse[1]), stride_dlse_h=Scalar(n),
            grad_prefix_out_ptr="grad_prefix_output", grad_prefix_lse_ptr="grad_prefix_lse",
            grad_suffix_out_ptr="grad_suffix_output", grad_suffix_lse_ptr="grad_suffix_lse"),
        writes=("grad_prefix_out_ptr", "grad_prefix_lse_ptr", "grad_suffix_out_ptr", "grad_suffix_lse_ptr"),
        constexprs=dict(HAS_GRAD_LSE=grad_output_lse is not None))
    return Plan(buffers, (launch,), results)

"""Validation and launch plan for example_scale (framework-free)."""
from __future__ import annotations

import math

from .._plan import (FLOAT_DTYPES, ArrayInfo, Buffer, Launch, Plan, Scalar, cdiv, check_dtype,
                     check_scalar_array, memoize, row_major_strides)
from .._target import Target
from .kernels import _example_scale_kernel

# NOTE: not tuned: the example shows the parts of an op, not a fast scale
EXAMPLE_BLOCK = 1024


@memoize
def plan_example_scale(target: Target, x: ArrayInfo, scale: ArrayInfo) -> Plan:
    """Plan example_scale: ``out = x * scale``.

    Arrays: x [T, H, D] float32/float16/bfloat16, contiguous; scale a
    1-element float32 array (device data, never read on the host). Returns the
    plan whose result "out" is a new [T, H, D] array of x's dtype.
    """
    del target  # one plan for every device: a memory-bound elementwise op
    check_dtype("x", x, FLOAT_DTYPES)
    if len(x.shape) != 3:
        raise ValueError(f"x: expected [T, H, D], got shape {tuple(x.shape)}")
    check_scalar_array("scale", scale, ("float32",))
    n = math.prod(x.shape)
    buffers = {"out": Buffer(tuple(x.shape), x.dtype)}
    if n == 0:
        return Plan(buffers, (), ("out",))
    # the kernel reads x flat: contiguous (the stride of a dimension of one is never used)
    if any(s != r for s, r, e in zip(x.strides, row_major_strides(x.shape), x.shape) if e > 1):
        raise ValueError(f"x: expected a contiguous array, got strides {tuple(x.strides)}")
    launch = Launch(
        kernel=_example_scale_kernel, grid=(cdiv(n, EXAMPLE_BLOCK),),
        params=dict(x_ptr="x", scale_ptr="scale", num_elements=Scalar(n, "i64"), out_ptr="out"),
        writes=("out_ptr",), constexprs=dict(BLOCK=EXAMPLE_BLOCK), num_warps=4, num_stages=1)
    return Plan(buffers, (launch,), ("out",))

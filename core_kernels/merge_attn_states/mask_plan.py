"""Validation and launch plan for mask_empty_context_lse (framework-free): the
step before a chunked-context merge that marks the LSE of every query token
whose context chunk is empty as -inf, so the merge takes the other part only."""
from __future__ import annotations

from .._plan import (INT_DTYPES, ArrayInfo, Launch, Plan, Scalar, cdiv, check_dtype,
                     check_inner_contiguous, check_ndim, memoize, next_pow2)
from .._target import Target
from .kernels import _mask_empty_context_lse_kernel

MASK_BLOCK_T = 128   # tokens per program
MASK_MAX_BLOCK_H = 16


@memoize
def plan_mask_empty_context_lse(target: Target, lse: ArrayInfo, query_start_loc: ArrayInfo,
                                context_start_loc: ArrayInfo) -> Plan:
    """Plan mask_empty_context_lse.

    Arrays: lse [H, T] float32, any strides, updated in place (it is both an
    argument and the result "lse"); query_start_loc [R + 1] and
    context_start_loc [R + 1] int32/int64 device data, R >= 1, query_start_loc
    non-decreasing (not checked on the device: see docs/index_validation.md).
    Tokens of request r are query_start_loc[r] .. query_start_loc[r + 1] - 1; its
    context chunk is empty when context_start_loc[r] == context_start_loc[r + 1].
    Tokens of no request (and tokens >= T) are never written.
    """
    del target  # one plan for every device: a memory-bound scatter of -inf
    check_ndim("lse", lse, 2, "[H, T]")
    check_dtype("lse", lse, ("float32",))
    h, t = lse.shape
    check_ndim("query_start_loc", query_start_loc, 1, "[R + 1]")
    check_dtype("query_start_loc", query_start_loc, INT_DTYPES)
    check_inner_contiguous("query_start_loc", query_start_loc)  # read with unit stride
    reqs = query_start_loc.shape[0] - 1
    if reqs < 1:
        raise ValueError(f"query_start_loc: expected [R + 1] with R >= 1 requests, "
                         f"got shape {tuple(query_start_loc.shape)}")
    check_ndim("context_start_loc", context_start_loc, 1, "[R + 1]")
    check_dtype("context_start_loc", context_start_loc, INT_DTYPES)
    check_inner_contiguous("context_start_loc", context_start_loc)
    if context_start_loc.shape[0] != reqs + 1:
        raise ValueError(f"context_start_loc: expected shape ({reqs + 1},) like query_start_loc, "
                         f"got {tuple(context_start_loc.shape)}")
    if h == 0 or t == 0:
        return Plan({}, (), ("lse",))
    launch = Launch(
        kernel=_mask_empty_context_lse_kernel, grid=(cdiv(t, MASK_BLOCK_T),),
        params=dict(query_start_ptr="query_start_loc", context_start_ptr="context_start_loc",
                    lse_in_ptr="lse", num_tokens=Scalar(t), num_heads=Scalar(h),
                    num_reqs=Scalar(reqs), search_steps=Scalar((reqs - 1).bit_length()),
                    stride_lse_h=Scalar(lse.strides[0]), stride_lse_t=Scalar(lse.strides[1]),
                    lse_ptr="lse"),
        writes=("lse_ptr",),
        constexprs=dict(BLOCK_T=MASK_BLOCK_T, BLOCK_H=min(MASK_MAX_BLOCK_H, max(1, next_pow2(h)))),
        num_warps=4, num_stages=1)
    return Plan({}, (launch,), ("lse",))

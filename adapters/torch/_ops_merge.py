"""merge_attn_states for PyTorch: in place, a drop-in for vLLM's function."""
from __future__ import annotations

from typing import Optional

import torch

from core_kernels._plan import as_int, decode_config, encode_config
from core_kernels.merge_attn_states import (BACKWARD_RESULTS, NO_FP8_BACKWARD, check_prefill_tokens_with_context,
                                           plan_mask_empty_context_lse, plan_merge_attn_states,
                                           plan_merge_attn_states_backward)
from core_kernels.merge_attn_states.op import MASK_EMPTY_CONTEXT_LSE, MERGE_ATTN_STATES, MERGE_ATTN_STATES_BACKWARD

from ._executor import CallMemo, execute
from ._register import custom_op
from ._scalars import scale_tensor

# the torch signature's name of the count tensor (the description says prefill_tokens_with_context)
_RENAMED = {"prefill_tokens_with_context_tensor": "prefill_tokens_with_context"}


def _num_ctx(count, prefill_tokens_with_context) -> str:
    """The planner's num_ctx: the token count as a tensor, absent, or a host int."""
    return "array" if count is not None else "none" if prefill_tokens_with_context is None else "scalar"


_NO_COUNT = {"prefill_tokens_with_context": None}


def _run(plan_fn, arrays: dict, prefill_tokens_with_context: Optional[int], config: Optional[str]) -> dict:
    """Plan ``plan_fn`` over ``arrays`` (name -> tensor or None = absent; the
    token count tensor as "prefill_tokens_with_context") and run it; returns
    every buffer by name. The forward, functional and backward ops all go through here."""
    count = arrays["prefill_tokens_with_context"]  # device data (a tensor), never read on the host
    runtime, check = _NO_COUNT, None
    if prefill_tokens_with_context is not None:  # a host int: checked after the shapes, every call
        runtime = {"prefill_tokens_with_context": prefill_tokens_with_context}

        def check(plan, device):
            check_prefill_tokens_with_context(prefill_tokens_with_context, arrays["prefix_output"].shape[0])
    return execute(plan_fn, arrays, runtime, check, num_ctx=_num_ctx(count, prefill_tokens_with_context),
                   config=None if config is None else decode_config(config))


def _merge_impl(output: torch.Tensor, prefix_output: torch.Tensor, prefix_lse: torch.Tensor,
                suffix_output: torch.Tensor, suffix_lse: torch.Tensor,
                output_lse: Optional[torch.Tensor], prefill_tokens_with_context: Optional[int],
                output_scale: Optional[torch.Tensor], config: Optional[str],
                prefill_tokens_with_context_tensor: Optional[torch.Tensor]) -> None:
    _run(plan_merge_attn_states,
         dict(prefix_output=prefix_output, prefix_lse=prefix_lse, suffix_output=suffix_output,
              suffix_lse=suffix_lse, output=output, output_lse=output_lse, output_scale=output_scale,
              prefill_tokens_with_context=prefill_tokens_with_context_tensor),
         prefill_tokens_with_context, config)


# ---------------------------------------------------------------- autograd
# torch.library takes autograd formulas for functional ops only: a call of the
# in-place op that needs a backward runs the functional op below (which has one)
# and copies its results into output / output_lse with autograd-visible copies.
def _functional_impl(prefix_output: torch.Tensor, prefix_lse: torch.Tensor, suffix_output: torch.Tensor,
                     suffix_lse: torch.Tensor, prefill_tokens_with_context: Optional[int],
                     config: Optional[str], prefill_tokens_with_context_tensor: Optional[torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    env = _run(plan_merge_attn_states,
                  dict(prefix_output=prefix_output, prefix_lse=prefix_lse, suffix_output=suffix_output,
                       suffix_lse=suffix_lse, output=None, output_lse=None, output_scale=None,
                       prefill_tokens_with_context=prefill_tokens_with_context_tensor),
                  prefill_tokens_with_context, config)
    return env["output"], env["output_lse"]


def _functional_fake(prefix_output, prefix_lse, suffix_output, suffix_lse, prefill_tokens_with_context,
                     config, prefill_tokens_with_context_tensor):
    n, h, d = prefix_output.shape
    return prefix_output.new_empty((n, h, d)), prefix_lse.new_empty((h, n))


def _backward_impl(prefix_output: torch.Tensor, prefix_lse: torch.Tensor, suffix_output: torch.Tensor,
                   suffix_lse: torch.Tensor, grad_output: torch.Tensor,
                   grad_output_lse: Optional[torch.Tensor], prefill_tokens_with_context: Optional[int],
                   config: Optional[str], prefill_tokens_with_context_tensor: Optional[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    env = _run(plan_merge_attn_states_backward,
                     dict(prefix_output=prefix_output, prefix_lse=prefix_lse, suffix_output=suffix_output,
                          suffix_lse=suffix_lse, grad_output=grad_output, grad_output_lse=grad_output_lse,
                          prefill_tokens_with_context=prefill_tokens_with_context_tensor),
                     prefill_tokens_with_context, config)
    return tuple(env[r] for r in BACKWARD_RESULTS)


def _backward_fake(prefix_output, prefix_lse, suffix_output, suffix_lse, grad_output, grad_output_lse,
                   prefill_tokens_with_context, config, prefill_tokens_with_context_tensor):
    n, h, d = prefix_output.shape
    return (prefix_output.new_empty((n, h, d)), prefix_lse.new_empty((h, n)),
            prefix_output.new_empty((n, h, d)), prefix_lse.new_empty((h, n)))


_backward_op = custom_op("merge_attn_states_backward", _backward_impl, fake=_backward_fake,
                         axes=MERGE_ATTN_STATES_BACKWARD, renamed=_RENAMED)


def _setup_context(ctx, inputs, output):
    po, pl, so, sl, ptwc, config, count = inputs
    ctx.save_for_backward(po, pl, so, sl, count)
    ctx.ptwc, ctx.config = ptwc, config


def _backward(ctx, grad_output, grad_output_lse):
    po, pl, so, sl, count = ctx.saved_tensors
    if grad_output.stride(-1) != 1:  # e.g. the expanded gradient of a sum()
        grad_output = grad_output.contiguous()
    grads = _backward_op(po, pl, so, sl, grad_output, grad_output_lse, ctx.ptwc, ctx.config, count)
    return (*grads, None, None, None)


_functional_op = custom_op("merge_attn_states_functional", _functional_impl, fake=_functional_fake,
                           autograd=(_backward, _setup_context), axes=MERGE_ATTN_STATES,
                           renamed=_RENAMED)


def _merge_differentiable(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse,
                          prefill_tokens_with_context, output_scale, config, count) -> None:
    """The in-place op's arguments, computed through the functional op (autograd)."""
    if output_scale is not None:
        raise ValueError(NO_FP8_BACKWARD)
    for name, t, shape, dtype in (("output", output, prefix_output.shape, prefix_output.dtype),
                                  ("output_lse", output_lse, prefix_lse.shape, torch.float32)):
        if t is not None and (t.shape != shape or t.dtype != dtype):
            raise ValueError(f"{name}: expected shape {tuple(shape)} dtype {dtype} (an output with a "
                             f"backward), got shape {tuple(t.shape)} dtype {t.dtype}")
    out, lse = _functional_op(prefix_output, prefix_lse, suffix_output, suffix_lse,
                              prefill_tokens_with_context, config, count)
    output.copy_(out)
    if output_lse is not None:
        output_lse.copy_(lse)


_merge_op = custom_op("merge_attn_states", _merge_impl, mutates_args=("output", "output_lse"),
                      differentiable=_merge_differentiable, axes=MERGE_ATTN_STATES, renamed=_RENAMED)


_MEMO = CallMemo(("output", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse", "output_lse",
                  "output_scale", "prefill_tokens_with_context"), written=("output", "output_lse"))


def merge_attn_states(output: torch.Tensor, prefix_output: torch.Tensor, prefix_lse: torch.Tensor,
                      suffix_output: torch.Tensor, suffix_lse: torch.Tensor,
                      output_lse: Optional[torch.Tensor] = None,
                      prefill_tokens_with_context: Optional[int] = None,
                      output_scale: Optional[torch.Tensor] = None, *, config=None) -> None:
    """Merge two partial attention results using their log-sum-exps, in place.

    Args:
        output: [N, H, D], written. Same dtype as the inputs, or float8_e4m3fn
            when ``output_scale`` is given; its head stride may differ (padding).
        prefix_output, suffix_output: [N, H, D] float32/float16/bfloat16, innermost
            dim contiguous, other strides arbitrary (they may differ).
        prefix_lse, suffix_lse: [H, N] float32 natural-log LSE, any strides
            (+inf and -inf both mean "empty part").
        output_lse: optional [H, N] float32, written.
        prefill_tokens_with_context: tokens t >= this value copy the suffix
            (None = N). A host int (Python/numpy int, 0-d numpy array) must be in
            [0, N]; a 1-element int32/int64 tensor on the inputs' device is read by
            the kernel (no host sync; a value outside [0, N] acts as the nearest
            bound). A new value never recompiles.
        output_scale: optional 1-element float32 tensor (device data), or a
            finite float > 0; output is fp8(clamp(value / scale)).
        config: optional ``core_kernels.merge_attn_states.MergeConfig`` overriding the
            tiling the planner would choose.

    Returns:
        None: ``output`` (and ``output_lse`` if given) are written in place.

    Transforms: eager, ``torch.compile(fullgraph=True)``, CUDA graphs (no host sync),
    autograd and DTensor (head-sharded inputs run locally). On a machine
    without a GPU, CPU tensors run under Triton's interpreter.

    Autograd: when grad mode is on and an input requires grad, the call runs
    the functional ``tandem_attn::merge_attn_states_functional`` (which has a
    backward kernel) and copies its results into ``output`` / ``output_lse``
    (in-place copies autograd records), so ``loss.backward()`` reaches the
    prefix / suffix outputs and LSEs. An fp8 output (``output_scale``) has no
    backward (ValueError). Calls that need no gradient take the in-place path.

    Example::

        po, so = (torch.randn(N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        pl, sl = (torch.randn(H, N, device="cuda") for _ in range(2))
        out, out_lse = torch.empty_like(po), torch.empty_like(pl)
        merge_attn_states(out, po, pl, so, sl, out_lse)

    See docs/ops/merge_attn_states.md for the formula, tuning and performance.
    """
    # a host count or scale is no tensor: such calls are never replayed (CallMemo)
    if _MEMO.lookup((output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse, output_scale,
                     prefill_tokens_with_context), (config,), False) is not None:
        return
    try:
        count = None
        if isinstance(prefill_tokens_with_context, torch.Tensor):
            count, prefill_tokens_with_context = prefill_tokens_with_context, None
        elif prefill_tokens_with_context is not None:
            prefill_tokens_with_context = as_int("prefill_tokens_with_context", prefill_tokens_with_context)
        _merge_op(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                  output_lse, prefill_tokens_with_context, scale_tensor("output_scale", output_scale, output),
                  encode_config(config), count)
    except BaseException:
        _MEMO.abandon()
        raise
    _MEMO.commit()


def _mask_impl(lse: torch.Tensor, query_start_loc: torch.Tensor,
               context_start_loc: torch.Tensor) -> None:
    execute(plan_mask_empty_context_lse,
            dict(lse=lse, query_start_loc=query_start_loc, context_start_loc=context_start_loc))


_mask_op = custom_op("mask_empty_context_lse", _mask_impl, mutates_args=("lse",),
                     axes=MASK_EMPTY_CONTEXT_LSE)


def mask_empty_context_lse(lse: torch.Tensor, query_start_loc: torch.Tensor,
                           context_start_loc: torch.Tensor) -> None:
    """Set the LSE of every query token whose context chunk is empty to -inf, in
    place (vLLM's step before merging a chunked-context prefill's two parts).

    Args:
        lse: [H, T] float32, any strides; written in place.
        query_start_loc: [R + 1] int32/int64, non-decreasing: request r's tokens
            are query_start_loc[r] .. query_start_loc[r + 1] - 1.
        context_start_loc: [R + 1] int32/int64: request r's context chunk is
            empty when context_start_loc[r] == context_start_loc[r + 1].
        All three on the same device.

    Returns:
        None: ``lse`` is written in place. Tokens of no request keep their values.

    Transforms: one launch, no host sync; eager, ``torch.compile(fullgraph=True)``,
    CUDA graphs and DTensor (``lse`` sharded over heads). No backward: a call that
    needs one raises RuntimeError.

    Example::

        # 2 requests: tokens 0..2 (context empty) and 3..4 (context non-empty)
        qsl = torch.tensor([0, 3, 5], device="cuda")
        csl = torch.tensor([0, 0, 7], device="cuda")
        mask_empty_context_lse(prefix_lse, qsl, csl)   # prefix_lse [H, 5]: columns 0..2 -> -inf

    See docs/ops/merge_attn_states.md.
    """
    _mask_op(lse, query_start_loc, context_start_loc)

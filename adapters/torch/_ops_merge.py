"""merge_attn_states for PyTorch: in place, a drop-in for vLLM's function."""
from __future__ import annotations

from typing import Optional

import torch

from core_kernels._plan import as_int, decode_config, encode_config
from core_kernels.merge_attn_states import (check_prefill_tokens_with_context, plan_mask_empty_context_lse,
                                           plan_merge_attn_states)

from ._executor import planned, run_plan
from ._register import custom_op
from ._scalars import scale_tensor


def _merge_impl(output: torch.Tensor, prefix_output: torch.Tensor, prefix_lse: torch.Tensor,
                suffix_output: torch.Tensor, suffix_lse: torch.Tensor,
                output_lse: Optional[torch.Tensor], prefill_tokens_with_context: Optional[int],
                output_scale: Optional[torch.Tensor], config: Optional[str],
                prefill_tokens_with_context_tensor: Optional[torch.Tensor]) -> None:
    count = prefill_tokens_with_context_tensor  # device data (a tensor), never read on the host
    plan, device = planned(
        plan_merge_attn_states,
        dict(prefix_output=prefix_output, prefix_lse=prefix_lse, suffix_output=suffix_output,
             suffix_lse=suffix_lse, output=output, output_lse=output_lse, output_scale=output_scale,
             prefill_tokens_with_context=count),
        num_ctx="array" if count is not None else "none" if prefill_tokens_with_context is None
        else "scalar", config=decode_config(config))
    if prefill_tokens_with_context is not None:  # a host int: checked here, after the shapes
        check_prefill_tokens_with_context(prefill_tokens_with_context, prefix_output.shape[0])
    tensors = dict(output=output, prefix_output=prefix_output, prefix_lse=prefix_lse,
                   suffix_output=suffix_output, suffix_lse=suffix_lse)
    if output_lse is not None:
        tensors["output_lse"] = output_lse
    if output_scale is not None:
        tensors["output_scale"] = output_scale
    if count is not None:
        tensors["prefill_tokens_with_context"] = count
    run_plan(plan, tensors, {"prefill_tokens_with_context": prefill_tokens_with_context}, device)


_merge_op = custom_op("merge_attn_states", _merge_impl, mutates_args=("output", "output_lse"))


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
    Works eagerly, under ``torch.compile(fullgraph=True)`` and in CUDA graphs.
    On a machine without a GPU, CPU tensors run under Triton's interpreter.
    """
    count = None
    if isinstance(prefill_tokens_with_context, torch.Tensor):
        count, prefill_tokens_with_context = prefill_tokens_with_context, None
    elif prefill_tokens_with_context is not None:
        prefill_tokens_with_context = as_int("prefill_tokens_with_context", prefill_tokens_with_context)
    _merge_op(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
              output_lse, prefill_tokens_with_context, scale_tensor("output_scale", output_scale, output),
              encode_config(config), count)


def _mask_impl(lse: torch.Tensor, query_start_loc: torch.Tensor,
               context_start_loc: torch.Tensor) -> None:
    tensors = dict(lse=lse, query_start_loc=query_start_loc, context_start_loc=context_start_loc)
    plan, device = planned(plan_mask_empty_context_lse, tensors)
    run_plan(plan, tensors, device=device)


_mask_op = custom_op("mask_empty_context_lse", _mask_impl, mutates_args=("lse",))


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
    Tokens of no request keep their values. One launch, no host sync; works
    eagerly, under ``torch.compile(fullgraph=True)`` and in CUDA graphs.
    """
    _mask_op(lse, query_start_loc, context_start_loc)

"""merge_attn_states for PyTorch: in place, a drop-in for vLLM's function."""
from __future__ import annotations

from typing import Optional

import torch

from core_kernels._plan import decode_config, encode_config
from core_kernels.merge_attn_states import plan_merge_attn_states

from ._executor import planned, run_plan
from ._register import custom_op


def _merge_impl(output: torch.Tensor, prefix_output: torch.Tensor, prefix_lse: torch.Tensor,
                suffix_output: torch.Tensor, suffix_lse: torch.Tensor,
                output_lse: Optional[torch.Tensor], prefill_tokens_with_context: Optional[int],
                output_scale: Optional[torch.Tensor], config: Optional[str]) -> None:
    plan, device = planned(
        plan_merge_attn_states,
        dict(prefix_output=prefix_output, prefix_lse=prefix_lse, suffix_output=suffix_output,
             suffix_lse=suffix_lse, output=output, output_lse=output_lse, output_scale=output_scale),
        num_ctx="none" if prefill_tokens_with_context is None else "scalar",
        config=decode_config(config))
    tensors = dict(output=output, prefix_output=prefix_output, prefix_lse=prefix_lse,
                   suffix_output=suffix_output, suffix_lse=suffix_lse)
    if output_lse is not None:
        tensors["output_lse"] = output_lse
    if output_scale is not None:
        tensors["output_scale"] = output_scale
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
            (None = N). A new value never recompiles.
        output_scale: optional 1-element float32 tensor; output is
            fp8(clamp(value / scale)).
        config: optional ``core_kernels.merge_attn_states.MergeConfig`` overriding the
            tiling the planner would choose.
    Works eagerly, under ``torch.compile(fullgraph=True)`` and in CUDA graphs.
    On a machine without a GPU, CPU tensors run under Triton's interpreter.
    """
    _merge_op(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
              output_lse, prefill_tokens_with_context, output_scale, encode_config(config))

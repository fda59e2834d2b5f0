"""merge_attn_states for JAX: functional, works under jax.jit."""
from __future__ import annotations

import jax.numpy as jnp

from core_kernels.merge_attn_states import plan_merge_attn_states

from ._executor import as_array, info, run_plan, target


def merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse, *,
                      prefill_tokens_with_context=None, output_scale=None, output_dtype=None,
                      config=None):
    """Merge two partial attention results using their log-sum-exps.

    Args:
        prefix_output, suffix_output: [N, H, D] float32/float16/bfloat16.
        prefix_lse, suffix_lse: [H, N] float32 natural-log LSE (+inf or -inf = empty part).
        prefill_tokens_with_context: None (= N), a Python int or a traced int
            scalar; tokens t >= it copy the suffix. Passed as device data, so a
            new value never recompiles.
        output_scale: None, or a float / 1-element float32 array: the output is
            fp8 e4m3 = fp8(clamp(value / scale)).
        output_dtype: the output dtype; defaults to the input dtype (fp8 e4m3
            with output_scale).
        config: optional ``MergeConfig`` overriding the planner's tiling (static).
    Returns:
        (output [N, H, D], output_lse [H, N] float32).
    """
    arrays = dict(prefix_output=prefix_output, prefix_lse=prefix_lse,
                  suffix_output=suffix_output, suffix_lse=suffix_lse)
    if prefill_tokens_with_context is not None:
        arrays["prefill_tokens_with_context"] = as_array(
            "prefill_tokens_with_context", prefill_tokens_with_context, jnp.int32)
    if output_scale is not None:
        arrays["output_scale"] = as_array("output_scale", output_scale, jnp.float32)
    tgt = target(arrays)
    plan = plan_merge_attn_states(
        tgt, info(prefix_output), info(prefix_lse), info(suffix_output), info(suffix_lse),
        num_ctx="none" if prefill_tokens_with_context is None else "array",
        output_scale=None if output_scale is None else info(arrays["output_scale"]),
        output_dtype=None if output_dtype is None else jnp.dtype(output_dtype).name, config=config)
    return run_plan(plan, arrays, tgt)

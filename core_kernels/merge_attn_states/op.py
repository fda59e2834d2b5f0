"""Descriptions of merge_attn_states, its backward and mask_empty_context_lse
(core_kernels.op_axes): per (token, head) ops, folded and sharded along both."""
from __future__ import annotations

from ..op_axes import OpAxes, TOK_H_D

PUBLIC = ("merge_attn_states", "mask_empty_context_lse")


MERGE_ATTN_STATES = OpAxes(
    "merge_attn_states",
    inputs={"prefix_output": TOK_H_D, "prefix_lse": ("heads", "tokens"),
            "suffix_output": TOK_H_D, "suffix_lse": ("heads", "tokens"),
            "prefill_tokens_with_context": (None,), "output_scale": (None,)},
    outputs={"output": TOK_H_D, "output_lse": ("heads", "tokens")},
    independent=("heads", "tokens"),
    # tokens t >= prefill_tokens_with_context copy the suffix: a global token index
    conditional={"tokens": ("prefill_tokens_with_context",)},
    fold=("heads", "tokens"),
    unbatchable=("prefill_tokens_with_context", "output_scale"),
)

# the backward of merge_attn_states: per (token, head) like the forward
MERGE_ATTN_STATES_BACKWARD = OpAxes(
    "merge_attn_states_backward",
    inputs={"prefix_output": TOK_H_D, "prefix_lse": ("heads", "tokens"),
            "suffix_output": TOK_H_D, "suffix_lse": ("heads", "tokens"),
            "grad_output": TOK_H_D, "grad_output_lse": ("heads", "tokens"),
            "prefill_tokens_with_context": (None,)},
    outputs={"grad_prefix_output": TOK_H_D, "grad_prefix_lse": ("heads", "tokens"),
             "grad_suffix_output": TOK_H_D, "grad_suffix_lse": ("heads", "tokens")},
    independent=("heads", "tokens"),
    conditional={"tokens": ("prefill_tokens_with_context",)},
    fold=("heads", "tokens"),
    unbatchable=("prefill_tokens_with_context",),
)

MASK_EMPTY_CONTEXT_LSE = OpAxes(
    "mask_empty_context_lse",
    inputs={"lse": ("heads", None), "query_start_loc": (None,), "context_start_loc": (None,)},
    outputs={"lse": ("heads", None)},
    independent=("heads",),
    fold=("heads",),
    unbatchable=("query_start_loc", "context_start_loc"),
)

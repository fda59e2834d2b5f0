"""Description of context_attention_fwd (core_kernels.op_axes): independent
per query head (kv heads grouped); vmap stacks examples along the tokens."""
from __future__ import annotations

from ..op_axes import OpAxes, TOK_H_D, TOK_KVH_D

PUBLIC = ("context_attention_fwd",)


CONTEXT_ATTENTION_FWD = OpAxes(
    "context_attention_fwd",
    inputs={"q": TOK_H_D, "k": TOK_KVH_D, "v": TOK_KVH_D,
            "k_cache": (None, "kv_heads", None, None, None), "v_cache": (None, "kv_heads", None, None),
            "b_loc": (None, None), "b_start_loc": (None,), "b_seq_len": (None,),
            "alibi_slopes": ("heads",), "sinks": ("heads",), "output": TOK_H_D,
            "k_scale": (None,), "v_scale": (None,), "fp8_out_scale": (None,)},
    outputs={"output": TOK_H_D},
    independent=("heads",),
    groups={"heads": "kv_heads"},
    # vmap: examples' tokens are stacked along the token axis and their caches
    # along the block axis, with block ids offset by each example's block count
    fold=("tokens",),
    unbatchable=("k_scale", "v_scale", "fp8_out_scale"),
    # b_loc holds K cache block addresses under this flag: a redistributed copy (or a local
    # shard) lives elsewhere, so such a call runs only on arrays replicated already
    address_flags=("is_block_table_ptr",),
)

"""Description of unified_attention (core_kernels.op_axes): independent per
query head (kv heads grouped); vmap stacks examples along the tokens (the op's
own rule: sequences appended, block ids offset into the stacked caches)."""
from __future__ import annotations

from ..op_axes import OpAxes, TOK_H_D

PUBLIC = ("unified_attention",)

_CACHE = (None, None, "kv_heads", None)          # [num_blocks, block_size, Hkv, D]

UNIFIED_ATTENTION = OpAxes(
    "unified_attention",
    inputs={"q": TOK_H_D, "k": _CACHE, "v": _CACHE,
            "cu_seqlens_q": (None,), "seqused_k": (None,), "block_table": (None, None),
            "out": TOK_H_D, "causal_flags": (None,),
            # descales: one element (read as [1]: no label) or [B, Hkv] per sequence and kv head
            "q_descale": (None,), "k_descale": (None, "kv_heads"), "v_descale": (None, "kv_heads"),
            "alibi_slopes": ("heads",), "sinks": ("heads",), "output_scale": (None,)},
    outputs={"out": TOK_H_D},
    independent=("heads",),
    groups={"heads": "kv_heads"},
    fold=("tokens",),
    unbatchable=("q_descale", "output_scale"),
)

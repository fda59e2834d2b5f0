"""Descriptions of block-sparse varlen attention (core_kernels.op_axes):
forward, LSE forward and backward, independent per query head (kv heads grouped)."""
from __future__ import annotations

import dataclasses

from ..op_axes import OpAxes, TOK_H_D, TOK_KVH_D

PUBLIC = ("blocksparse_flash_attn_varlen_fwd",)


BLOCKSPARSE_VARLEN = OpAxes(
    "blocksparse_flash_attn_varlen_fwd",
    inputs={"q": TOK_H_D, "k": TOK_KVH_D, "v": TOK_KVH_D,
            "cu_seqlens_k": (None,), "cu_seqlens_q": (None,),
            # layout heads: 1 (homo_head) or one per query head
            "crow": ("heads", None), "col": ("heads", None)},
    outputs={"output": TOK_H_D},
    independent=("heads",),
    groups={"heads": "kv_heads"},
    fold=("heads",),
    unbatchable=("cu_seqlens_k", "cu_seqlens_q"),
)

# the forward a gradient needs (output plus each row's LSE [Tq, Hq]) and the
# backward: per query head like the forward, dk / dv summed within a kv-head group
BLOCKSPARSE_VARLEN_LSE = dataclasses.replace(
    BLOCKSPARSE_VARLEN, name="blocksparse_flash_attn_varlen_fwd_lse",
    outputs={"output": TOK_H_D, "lse": ("tokens", "heads")})

BLOCKSPARSE_VARLEN_BACKWARD = dataclasses.replace(
    BLOCKSPARSE_VARLEN, name="blocksparse_flash_attn_varlen_backward",
    inputs={**BLOCKSPARSE_VARLEN.inputs, "output": TOK_H_D, "lse": ("tokens", "heads"),
            "grad_output": TOK_H_D},
    outputs={"grad_q": TOK_H_D, "grad_k": TOK_KVH_D, "grad_v": TOK_KVH_D})

"""Descriptions of the lightning ops (core_kernels.op_axes): prefill over a
padded batch, decode over cache slots, varlen over packed tokens, and the
backwards; all independent per head."""
from __future__ import annotations

from ..op_axes import OpAxes

PUBLIC = ("lightning_attention", "linear_decode_forward_triton", "lightning_attention_varlen",
          "lightning_attention_cp")

LIGHTNING_ATTENTION = OpAxes(
    "lightning_attention",
    # "sequence": read across (a scan), but split with a state exchange where an
    # adapter passes its context-parallel implementation (adapters/*/_ops_lightning_cp.py)
    inputs={"q": ("batch", "heads", "sequence", None), "k": ("batch", "heads", "sequence", None),
            "v": ("batch", "heads", "sequence", None), "ed": ("heads",),
            "kv_history": ("batch", "heads", None, None)},
    outputs={"output": ("batch", "heads", "sequence", None),
             "kv": ("batch", "heads", None, None, None)},   # [B, H, D, E] when final only
    independent=("batch", "heads"),
    fold=("batch", "heads"),     # heads when ed differs between the examples
)

LIGHTNING_ATTENTION_BACKWARD = OpAxes(
    "lightning_attention_backward",
    inputs={**LIGHTNING_ATTENTION.inputs, "kv": ("batch", "heads", None, None, None),
            "grad_output": ("batch", "heads", "sequence", None),
            "grad_kv": ("batch", "heads", None, None, None)},
    outputs={"grad_q": ("batch", "heads", "sequence", None), "grad_k": ("batch", "heads", "sequence", None),
             "grad_v": ("batch", "heads", "sequence", None), "grad_kv_history": ("batch", "heads", None, None),
             "grad_ed": ("heads",)},
    independent=("heads",),      # grad_ed sums over the batch
    fold=("heads",),
)

LINEAR_DECODE = OpAxes(
    "linear_decode_forward_triton",
    inputs={"q": (None, "heads", None, None), "k": (None, "heads", None, None),
            "v": (None, "heads", None, None), "kv_caches": (None, "heads", None, None),
            "slope_rate": ("heads",), "slot_idx": (None,)},
    # output [B, H * E]: head h owns columns h * E .. (h + 1) * E - 1
    outputs={"output": (None, "heads"), "kv_caches": (None, "heads", None, None)},
    independent=("heads",),
    fold=("heads",),
    unbatchable=("slot_idx",),
)

# packed [T, H, *] tokens of B sequences, and [B or slots, H, D, E] states
_VARLEN_TOKENS = {"q": (None, "heads", None), "k": (None, "heads", None), "v": (None, "heads", None),
                  "ed": ("heads",), "cu_seqlens": (None,)}
_VARLEN_STATES = (None, "heads", None, None)
_VARLEN_OUTPUTS = {"output": (None, "heads", None), "kv": _VARLEN_STATES}

LIGHTNING_VARLEN = OpAxes(
    "lightning_attention_varlen",
    inputs={**_VARLEN_TOKENS, "kv_cache": _VARLEN_STATES, "slot_idx": (None,)},
    outputs=_VARLEN_OUTPUTS,
    independent=("heads",),
    fold=("heads",),
    unbatchable=("cu_seqlens", "slot_idx"),
)

LIGHTNING_VARLEN_HISTORY = OpAxes(  # torch's differentiable form of the cache (sequence b from kv_history[b])
    "lightning_attention_varlen_history",
    inputs={**_VARLEN_TOKENS, "kv_history": _VARLEN_STATES},
    outputs=_VARLEN_OUTPUTS,
    independent=("heads",),
    fold=("heads",),
    unbatchable=("cu_seqlens",),
)

LIGHTNING_VARLEN_BACKWARD = OpAxes(
    "lightning_attention_varlen_backward",
    inputs={**_VARLEN_TOKENS, "kv": _VARLEN_STATES, "grad_output": (None, "heads", None),
            "grad_kv": _VARLEN_STATES, "kv_history": _VARLEN_STATES},
    outputs={"grad_q": (None, "heads", None), "grad_k": (None, "heads", None),
             "grad_v": (None, "heads", None), "grad_ed": ("heads",), "grad_kv_history": _VARLEN_STATES},
    independent=("heads",),
    fold=("heads",),
    unbatchable=("cu_seqlens",),
)

# context parallelism (cp_plan.py): a shard's state sum, and the scan over the gathered ones
LIGHTNING_CP_STATE = OpAxes(
    "lightning_cp_state",
    inputs={"k": ("batch", "heads", None, None), "v": ("batch", "heads", None, None), "ed": ("heads",)},
    outputs={"state": ("batch", "heads", None, None)},
    independent=("batch", "heads"),
    fold=("batch", "heads"),
)

LIGHTNING_CP_COMPOSE = OpAxes(
    "lightning_cp_compose",
    inputs={"states": (None, "batch", "heads", None, None), "ed": ("heads",), "rank": (None,),
            "init": ("batch", "heads", None, None)},
    outputs={"prefix": ("batch", "heads", None, None), "total": ("batch", "heads", None, None)},
    independent=("batch", "heads"),
    fold=("batch", "heads"),
    unbatchable=("rank",),
)

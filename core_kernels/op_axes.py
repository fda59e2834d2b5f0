"""Which axes of each op's arrays are independent: the one framework-free
description that both adapters derive their composability rules from (JAX
vmap folding and SPMD sharding, torch DTensor sharding). No framework imports.

Each array argument or result is described by one label per dimension:

- ``"batch"``    sequences of a padded batch (lightning prefill's B);
- ``"heads"``    query / output heads;
- ``"kv_heads"`` key / value heads: query head h reads kv head h // (Hq // Hkv),
  so a split of the heads into S equal blocks is a split of the kv heads into
  S equal blocks when S divides Hkv (``OpAxes.groups``);
- ``"tokens"``   packed tokens (independent only where ``OpAxes.independent``
  says so, e.g. merge without ``prefill_tokens_with_context``);
- ``None``       an axis the op reads across (head size, sequence length, cache
  blocks and slots, index arrays): never split, never a fold target.

An op is independent along a label when computing it on a slice of every
array along that label (the slices aligned) gives the slice of the result: the
arrays may be split (sharding) or stacked (vmap) along it. ``fold`` names, in
order of preference, the labels a vmapped axis can be folded into so that one
launch computes every example: stack the examples along that label (reshape,
with a transpose where the label is not next to the vmapped axis).
``unbatchable`` lists arguments that cannot differ between the examples of one
launch (host values, or device scalars that apply to the whole launch); a
vmapped one needs the op's own rule (see each adapter).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

Labels = tuple[Optional[str], ...]


@dataclasses.dataclass(frozen=True)
class OpAxes:
    name: str
    inputs: dict[str, Labels]             # argument name -> label per dimension
    outputs: dict[str, Labels]            # result name -> label per dimension
    independent: tuple[str, ...]          # labels the op is independent along
    groups: dict[str, str] = dataclasses.field(default_factory=dict)   # "heads" -> "kv_heads"
    fold: tuple[str, ...] = ()            # vmap: labels to fold a batched axis into
    unbatchable: tuple[str, ...] = ()     # arguments one launch shares across examples
    conditional: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # label -> arguments whose presence makes the op dependent along it

    def labels(self, name: str) -> Labels:
        return self.inputs[name] if name in self.inputs else self.outputs[name]

    def independent_along(self, label: str, present=()) -> bool:
        """Whether the op is independent along ``label`` with the optional
        arguments ``present`` given."""
        if label not in self.independent:
            return False
        return not any(a in present for a in self.conditional.get(label, ()))

    def shards(self, label: str, sizes: dict[str, int], parts: int) -> Optional[str]:
        """None if every array can be split into ``parts`` equal blocks along
        ``label`` (sizes: label -> extent), else why not (for an error message)."""
        for lab in (label, self.groups.get(label)):
            if lab is None or lab not in sizes:
                continue
            if sizes[lab] % parts:
                return f"{lab} ({sizes[lab]}) is not a multiple of the {parts} shards"
        return None


def fit_labels(labels: Labels, shape) -> Optional[tuple]:
    """The label of each dimension of an array of ``shape`` that ``labels``
    describes, or None where they cannot be placed. The adapters' rules (JAX
    SPMD, torch DTensor) both read arrays through this:
    - the described rank: as given;
    - one named label and one non-unit dimension: there (decay rates as [H],
      [H, 1, 1] or [1, H, 1, 1]);
    - as many non-unit dimensions as labels: in order (singletons the
      description omits);
    - fewer dimensions than described: the leading labels (lightning's
      final-state kv [B, H, D, E] against the per-block form [B, H, NB + 1, D, E])."""
    rank = len(shape)
    if rank == len(labels):
        return tuple(labels)
    named = [lab for lab in labels if lab is not None]
    wide = [d for d, n in enumerate(shape) if n != 1]
    if len(named) == 1 and len(wide) == 1:
        return tuple(named[0] if d == wide[0] else None for d in range(rank))
    if len(wide) == len(labels):
        out = [None] * rank
        for d, lab in zip(wide, labels):
            out[d] = lab
        return tuple(out)
    if rank < len(labels):
        return tuple(labels[:rank])
    return None


_TOK_H_D = ("tokens", "heads", None)
_TOK_KVH_D = ("tokens", "kv_heads", None)

MERGE_ATTN_STATES = OpAxes(
    "merge_attn_states",
    inputs={"prefix_output": _TOK_H_D, "prefix_lse": ("heads", "tokens"),
            "suffix_output": _TOK_H_D, "suffix_lse": ("heads", "tokens"),
            "prefill_tokens_with_context": (None,), "output_scale": (None,)},
    outputs={"output": _TOK_H_D, "output_lse": ("heads", "tokens")},
    independent=("heads", "tokens"),
    # tokens t >= prefill_tokens_with_context copy the suffix: a global token index
    conditional={"tokens": ("prefill_tokens_with_context",)},
    fold=("heads", "tokens"),
    unbatchable=("prefill_tokens_with_context", "output_scale"),
)

# the backward of merge_attn_states: per (token, head) like the forward
MERGE_ATTN_STATES_BACKWARD = OpAxes(
    "merge_attn_states_backward",
    inputs={"prefix_output": _TOK_H_D, "prefix_lse": ("heads", "tokens"),
            "suffix_output": _TOK_H_D, "suffix_lse": ("heads", "tokens"),
            "grad_output": _TOK_H_D, "grad_output_lse": ("heads", "tokens"),
            "prefill_tokens_with_context": (None,)},
    outputs={"grad_prefix_output": _TOK_H_D, "grad_prefix_lse": ("heads", "tokens"),
             "grad_suffix_output": _TOK_H_D, "grad_suffix_lse": ("heads", "tokens")},
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

LIGHTNING_ATTENTION = OpAxes(
    "lightning_attention",
    inputs={"q": ("batch", "heads", None, None), "k": ("batch", "heads", None, None),
            "v": ("batch", "heads", None, None), "ed": ("heads",),
            "kv_history": ("batch", "heads", None, None)},
    outputs={"output": ("batch", "heads", None, None),
             "kv": ("batch", "heads", None, None, None)},   # [B, H, D, E] when final only
    independent=("batch", "heads"),
    fold=("batch", "heads"),     # heads when ed differs between the examples
)

LIGHTNING_ATTENTION_BACKWARD = OpAxes(
    "lightning_attention_backward",
    inputs={**LIGHTNING_ATTENTION.inputs, "kv": ("batch", "heads", None, None, None),
            "grad_output": ("batch", "heads", None, None),
            "grad_kv": ("batch", "heads", None, None, None)},
    outputs={"grad_q": ("batch", "heads", None, None), "grad_k": ("batch", "heads", None, None),
             "grad_v": ("batch", "heads", None, None), "grad_kv_history": ("batch", "heads", None, None),
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

BLOCKSPARSE_VARLEN = OpAxes(
    "blocksparse_flash_attn_varlen_fwd",
    inputs={"q": _TOK_H_D, "k": _TOK_KVH_D, "v": _TOK_KVH_D,
            "cu_seqlens_k": (None,), "cu_seqlens_q": (None,),
            # layout heads: 1 (homo_head) or one per query head
            "crow": ("heads", None), "col": ("heads", None)},
    outputs={"output": _TOK_H_D},
    independent=("heads",),
    groups={"heads": "kv_heads"},
    fold=("heads",),
    unbatchable=("cu_seqlens_k", "cu_seqlens_q"),
)

# the forward a gradient needs (output plus each row's LSE [Tq, Hq]) and the
# backward: per query head like the forward, dk / dv summed within a kv-head group
BLOCKSPARSE_VARLEN_LSE = OpAxes(
    "blocksparse_flash_attn_varlen_fwd_lse",
    inputs=BLOCKSPARSE_VARLEN.inputs,
    outputs={"output": _TOK_H_D, "lse": ("tokens", "heads")},
    independent=("heads",),
    groups={"heads": "kv_heads"},
    fold=("heads",),
    unbatchable=("cu_seqlens_k", "cu_seqlens_q"),
)

BLOCKSPARSE_VARLEN_BACKWARD = OpAxes(
    "blocksparse_flash_attn_varlen_backward",
    inputs={**BLOCKSPARSE_VARLEN.inputs, "output": _TOK_H_D, "lse": ("tokens", "heads"),
            "grad_output": _TOK_H_D},
    outputs={"grad_q": _TOK_H_D, "grad_k": _TOK_KVH_D, "grad_v": _TOK_KVH_D},
    independent=("heads",),
    groups={"heads": "kv_heads"},
    fold=("heads",),
    unbatchable=("cu_seqlens_k", "cu_seqlens_q"),
)

CONTEXT_ATTENTION_FWD = OpAxes(
    "context_attention_fwd",
    inputs={"q": _TOK_H_D, "k": _TOK_KVH_D, "v": _TOK_KVH_D,
            "k_cache": (None, "kv_heads", None, None, None), "v_cache": (None, "kv_heads", None, None),
            "b_loc": (None, None), "b_start_loc": (None,), "b_seq_len": (None,),
            "alibi_slopes": ("heads",), "sinks": ("heads",), "output": _TOK_H_D,
            "k_scale": (None,), "v_scale": (None,), "fp8_out_scale": (None,)},
    outputs={"output": _TOK_H_D},
    independent=("heads",),
    groups={"heads": "kv_heads"},
    # vmap: examples' tokens are stacked along the token axis and their caches
    # along the block axis, with block ids offset by each example's block count
    fold=("tokens",),
    unbatchable=("k_scale", "v_scale", "fp8_out_scale"),
)

OPS = {o.name: o for o in (MERGE_ATTN_STATES, MERGE_ATTN_STATES_BACKWARD, MASK_EMPTY_CONTEXT_LSE, LIGHTNING_ATTENTION,
                           LIGHTNING_ATTENTION_BACKWARD,
                           LINEAR_DECODE, LIGHTNING_VARLEN, LIGHTNING_VARLEN_HISTORY, LIGHTNING_VARLEN_BACKWARD,
                           BLOCKSPARSE_VARLEN,
                           BLOCKSPARSE_VARLEN_LSE, BLOCKSPARSE_VARLEN_BACKWARD,
                           CONTEXT_ATTENTION_FWD)}

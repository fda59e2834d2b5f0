"""How an op's description states which axes of its arrays are independent:
the one framework-free description that both adapters derive their
composability rules from (JAX vmap folding and SPMD sharding, torch DTensor
sharding). No framework imports, and no op: each op declares its own
``OpAxes`` in ``core_kernels/<op>/op.py``, with ``PUBLIC``, the names of the
public functions the folder backs in both adapters.

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
    address_flags: tuple[str, ...] = ()
    # options under which an index array holds device addresses of another array's storage:
    # such a call is never sharded (a shard or a copy lives elsewhere)

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


# label tuples several ops' descriptions use: packed [T, H, D] tokens of query heads / kv heads
TOK_H_D: Labels = ("tokens", "heads", None)
TOK_KVH_D: Labels = ("tokens", "kv_heads", None)

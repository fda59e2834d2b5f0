"""torch DTensor sharding rules for every custom op, derived from core_kernels.op_axes.

One generic function turns an op's ``OpAxes`` into the strategies DTensor may
pick (``torch.distributed.tensor.experimental.register_sharding``), for one mesh
dimension (DTensor expands them over the mesh):

- Replicate everything (always valid);
- for each label the op is independent along (with the optional arguments that
  are present, ``OpAxes.independent_along``) and that splits evenly over the
  mesh (``OpAxes.shards``, with the mesh's size: a split of the heads must be a
  split of the kv heads, and ``linear_decode``'s [B, H * E] output must split on
  head boundaries): Shard(d) on every array's dimension d carrying that label or
  its GQA group (``kv_heads``), Replicate on the others.

Arguments the op writes in place follow their input: they are never
redistributed, since the op would write a temporary copy (a silent wrong
result). Their placement picks the strategy; a placement no strategy keeps is a
ValueError naming the argument. Everything else DTensor redistributes to the
cheapest strategy (a head_dim split is gathered, a Partial reduced).

Registration is lazy: importing torch.distributed.tensor costs ~0.6 s, so when
it is not imported yet, an import hook registers the rules right after it is
(``register()`` may also be called directly). Nothing here runs, or fails, when
torch.distributed is unavailable.

Eager calls whose DTensors already have the placements of a strategy (nothing
to redistribute: a sharded model's steady state) skip DTensor's dispatch and
torch.library's Python layers (:func:`local_call`): the strategy is chosen once
per placement signature and cached, the op runs on the local tensors, its
results are wrapped with the strategy's placements. The same local call and
the same placements as DTensor's dispatch; everything else (redistribution,
autograd, torch.compile) goes through the dispatcher as before.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import warnings

import torch

from core_kernels import op_axes

from ._register import NAMESPACE, OPS

# Each op's description (OpAxes) and the torch signature's renames of its arguments come
# with its registration (custom_op's axes= and renamed=): this module names no op.

_lock = threading.Lock()
_registered = False


def _is_shard(p):
    from torch.distributed.tensor import Shard
    return type(p) is Shard


def op_strategies(name: str, axes: op_axes.OpAxes, schema, mutated, args, kwargs):
    """The single-mesh-dim strategies of one call: a list of (output placements,
    input placements) as ``register_sharding`` expects, from ``axes`` alone.
    ``args``/``kwargs`` hold the call's arguments, DTensorSpecs for tensors."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    names = [a.name for a in schema.arguments]
    values = dict(zip(names, args))
    values.update(kwargs)
    order = names[:len(args)] + list(kwargs)  # DTensor's order: positional, then keywords
    renamed = OPS[name].renamed
    specs = {n: v for n, v in values.items() if isinstance(v, DTensorSpec)}
    present = {renamed.get(n, n) for n, v in values.items() if v is not None}
    mesh = next(iter(specs.values())).mesh
    parts = mesh.size()

    # label of each dimension of each tensor argument (None: cannot be split)
    dims, unmapped, unaligned = {}, [], {}
    for n, spec in specs.items():
        n_axes = renamed.get(n, n)  # an array written in place may be described as a result
        labels = axes.inputs.get(n_axes, axes.outputs.get(n_axes))
        if labels is None:
            unmapped.append(n)
            continue
        aligned = op_axes.fit_labels(labels, spec.shape)
        if aligned is None:
            unaligned[n] = labels
        else:
            dims[n] = aligned
    extents: dict[str, set] = {}
    for n, labs in dims.items():
        for lab, size in zip(labs, specs[n].shape):
            if lab is not None:
                extents.setdefault(lab, set()).add(int(size))
    sizes, why_not = {}, {}
    for lab, ext in extents.items():
        big = ext - {1}
        if len(big) > 1:
            why_not[lab] = f"the arrays disagree on its extent {sorted(ext)}"
        sizes[lab] = max(ext)
    # an array whose labels cannot be placed on its dimensions may be replicated
    # along a label only where no dimension of it has that label's extent
    for n, labels in unaligned.items():
        for lab in labels:
            if lab is not None and lab in sizes and sizes[lab] > 1 and sizes[lab] in specs[n].shape:
                why_not.setdefault(lab, f"{n} {tuple(specs[n].shape)} does not match {labels}")

    written = {renamed.get(n, n) for n in mutated}
    returns = [o for o in axes.outputs if o not in axes.inputs and o not in written]
    returns = returns[:len(schema.returns)]
    if len(returns) < len(schema.returns):
        unmapped.append("<results>")

    def strategy(label):
        group = axes.groups.get(label)
        def place(labs, n=None):
            if labs is None:
                return Replicate()
            for d, lab in enumerate(labs):
                if lab is not None and lab in (label, group) and (n is None or specs[n].shape[d] > 1):
                    return Shard(d)
            return Replicate()
        outs = [place(axes.outputs[o]) if label else Replicate() for o in returns]
        ins = [None if n not in specs else place(dims.get(n), n) if label else Replicate()
               for n in order]
        return outs, ins

    candidates = {None: strategy(None)}
    if not unmapped:
        for label in axes.independent:
            if label not in sizes:
                continue
            if not axes.independent_along(label, present):
                why_not[label] = "the op reads across it with " + ", ".join(
                    a for a in axes.conditional.get(label, ()) if a in present)
            elif label not in why_not:
                reason = axes.shards(label, sizes, parts)
                if reason is None:
                    candidates[label] = strategy(label)
                else:
                    why_not[label] = reason

    flags = [f for f in axes.address_flags if values.get(f)]
    if flags:
        moved = [n for n, s in specs.items() if not s.is_replicated()]
        if moved:
            raise ValueError(f"{NAMESPACE}::{name}: with {flags[0]}=True the index tensors hold "
                             f"device addresses, which a shard or a redistributed copy does not "
                             f"keep: {moved[0]} must be a Replicate DTensor, got "
                             f"{specs[moved[0]].placements}")
        return [candidates[None]]
    if not mutated:
        return list(candidates.values())
    return _in_place(name, mesh, order, specs, mutated, candidates, why_not)


def _in_place(name, mesh, order, specs, mutated, candidates, why_not):
    """Strategies that leave the arguments written in place where they are."""
    written = [n for n in mutated if n in specs]
    if not written:
        return list(candidates.values())
    index = {n: order.index(n) for n in specs}
    chosen = []
    for dim in range(mesh.ndim):
        want = {n: specs[n].placements[dim] for n in written}
        match = [lab for lab, (_, ins) in candidates.items()
                 if all(ins[index[n]] == p for n, p in want.items())]
        if not match:
            alone = [n for n in written
                     if not any(ins[index[n]] == want[n] for _, ins in candidates.values())]
            n = (alone or written)[0]
            p = want[n]
            hint = f" (dimension {p.dim} of {tuple(specs[n].shape)})" if _is_shard(p) else ""
            reasons = "; ".join(f"{lab}: {r}" for lab, r in why_not.items())
            raise ValueError(
                f"{NAMESPACE}::{name}: {n} is written in place and cannot be redistributed, but "
                f"its placement {p}{hint} on mesh dimension {dim} is not one the op can compute "
                f"locally (with {', '.join(written)} placed "
                f"{', '.join(str(want[w]) for w in written)}); it can shard along "
                f"{[lab for lab in candidates if lab] or 'nothing'}"
                + (f" ({reasons})" if reasons else "") + ". Redistribute it first.")
        chosen.append(match[0])
    if len(set(chosen)) == 1:
        return [candidates[chosen[0]]]
    # per mesh dimension a different strategy: DTensor expands every combination;
    # the one that keeps the written arguments is the only one free of
    # redistribution only when every argument already has its placement
    for n, spec in specs.items():
        target = tuple(candidates[lab][1][index[n]] for lab in chosen)
        if tuple(spec.placements) != target:
            raise ValueError(
                f"{NAMESPACE}::{name}: {n} has placements {tuple(spec.placements)}; with the "
                f"arguments written in place placed {tuple(specs[written[0]].placements)} it "
                f"must be {target} (redistribute it first)")
    return [candidates[lab] for lab in dict.fromkeys(chosen)]


# ---------------------------------------------------------------- eager fast path
# NOTE: an eager DTensor call through the dispatcher cost 51-53 us of host time
# more than the same call on the local tensors, against 12.7-13.0 us that DTensor
# adds to torch.add on the same DTensors (2 gloo ranks on the development CPU,
# torch 2.13, kernels stubbed out, 2026-11-28, commit ea8c7df + this change;
# benchmarks/bench_dtensor_overhead.py: the merge op at 64 x 32/rank x 128,
# lightning decode at B64 H32/rank D128). Most of it is ours: the custom op's Python
# autograd, ADInplaceOrView (argument defaults filled per call) and backend
# layers, which plain-tensor calls skip too (_register.custom_op); DTensor
# already caches the strategy per OpSchema. The fast path adds 9.1-10.3 us.
_DECISIONS: dict = {}
_DECISIONS_MAX = 1024
_MISS = object()


class _Decision:
    """How a call of one placement signature runs locally: the mesh and each
    result's placements (their global shapes cached per local layout)."""
    __slots__ = ("mesh", "placements", "specs")

    def __init__(self, mesh, placements):
        self.mesh, self.placements, self.specs = mesh, placements, {}

    def wrap(self, result):
        if result is None:
            return None
        if isinstance(result, (tuple, list)):
            return tuple(self._one(i, r) for i, r in enumerate(result))
        return self._one(0, result)

    def _one(self, i, local):
        from torch.distributed.tensor import DTensor
        key = (i, local.shape, local.stride(), local.dtype)
        spec = self.specs.get(key)
        if spec is None:
            from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
            from torch.distributed.tensor._utils import compute_global_tensor_info
            placements = self.placements[i]
            shape, stride = compute_global_tensor_info(local, self.mesh, placements)
            spec = self.specs[key] = DTensorSpec(self.mesh, placements,
                                                 TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
        return DTensor(local, spec, requires_grad=False)


def _signature(a):
    """What of an argument the decision depends on: a DTensor's spec (mesh,
    placements, global shape, strides, dtype; its hash is cached), a plain
    tensor's type (no fast path), any other value itself."""
    if isinstance(a, torch.Tensor):
        spec = getattr(a, "_spec", None)
        return spec if spec is not None else torch.Tensor
    return a


def _decide(name: str, args) -> _Decision | None:
    """The strategy of a call whose DTensor arguments need no redistribution
    (every mesh dimension's placements those of one of op_strategies'
    strategies), or None: the dispatcher decides (and redistributes)."""
    from torch.distributed.tensor import DTensor
    call = OPS[name]
    if call.axes is None:
        return None
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if any(type(args[i]) is not DTensor for i in tensors):
        return None
    mesh = args[tensors[0]]._spec.mesh
    if any(args[i]._spec.mesh != mesh for i in tensors):
        return None
    specs = [a._spec if isinstance(a, torch.Tensor) else a for a in args]
    try:
        strategies = op_strategies(name, call.axes, call.op._opoverload._schema, call.mutates_args, specs, {})
    except Exception:  # noqa: BLE001  (the dispatcher raises it, with DTensor's context)
        return None
    per_dim = []
    for dim in range(mesh.ndim):
        want = [specs[i].placements[dim] for i in tensors]
        outs = next((o for o, ins in strategies if [ins[i] for i in tensors] == want), None)
        if outs is None:
            return None
        per_dim.append(outs)
    results = len(per_dim[0])
    return _Decision(mesh, tuple(tuple(per_dim[d][r] for d in range(mesh.ndim)) for r in range(results)))


def local_call(name: str, impl, args):
    """``impl`` on the local tensors of DTensor ``args`` with the results wrapped
    (module docstring), or NotImplemented where the dispatcher must run."""
    try:
        key = (name, *map(_signature, args))
        decision = _DECISIONS.get(key, _MISS)
    except TypeError:  # an unhashable argument
        return NotImplemented
    if decision is _MISS:
        decision = _decide(name, args)
        if len(_DECISIONS) >= _DECISIONS_MAX:
            _DECISIONS.clear()
        _DECISIONS[key] = decision
    if decision is None:
        return NotImplemented
    mutated = OPS[name].mutates_args
    local = [a._local_tensor if isinstance(a, torch.Tensor) else a for a in args]
    written = []
    if mutated:
        params = _PARAMS.get(name)
        if params is None:
            params = _PARAMS[name] = [a.name for a in OPS[name].op._opoverload._schema.arguments]
        for i, p in enumerate(params[:len(args)]):
            if p in mutated and local[i] is not None:
                written += (args[i], local[i])  # the DTensor and its local tensor
        if not torch.is_inference_mode_enabled() and any(t.is_inference() for t in written):
            return NotImplemented  # the dispatcher's error
    result = decision.wrap(impl(*local))
    if written:
        _increment_version(written)
    return result


_PARAMS: dict = {}
_increment_version = getattr(torch._C, "_increment_version", torch.autograd.graph.increment_version)


def unsupported_arguments(name: str) -> list[str]:
    """Tensor arguments of a registered op that its OpAxes does not describe
    (such a call is replicated only); empty when the description is complete."""
    axes = OPS[name].axes
    schema = OPS[name].op._opoverload._schema
    renamed = OPS[name].renamed
    if axes is None:
        return ["<op>"]
    return [a.name for a in schema.arguments
            if "Tensor" in str(a.type) and renamed.get(a.name, a.name) not in axes.inputs
            and renamed.get(a.name, a.name) not in axes.outputs]


def register() -> bool:
    """Register the sharding rules of every op with DTensor (idempotent). Returns
    False where torch.distributed is unavailable."""
    global _registered
    with _lock:
        if _registered:
            return True
        if not torch.distributed.is_available():
            return False
        from torch.distributed.tensor.experimental import register_sharding
        for name, call in OPS.items():
            axes = call.axes
            if axes is None:  # an op no OpAxes describes: DTensor refuses it (NotImplementedError)
                continue
            overload = call.op._opoverload
            schema, mutated = overload._schema, call.mutates_args

            def rule(*args, _n=name, _a=axes, _s=schema, _m=mutated, **kwargs):
                return op_strategies(_n, _a, _s, _m, args, kwargs)
            register_sharding(overload)(rule)
        _registered = True
        return True


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``register()`` right after torch.distributed.tensor is imported."""
    target = "torch.distributed.tensor"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def run(module):
            exec_module(module)
            try:
                register()
            except Exception as e:  # never break the user's import
                warnings.warn(f"{NAMESPACE}: DTensor sharding rules not registered: {e!r}")
        spec.loader.exec_module = run
        return spec


def install() -> None:
    """At import of adapters.torch: register now if DTensor is loaded, else on its
    import; eager DTensor calls take local_call."""
    try:
        if not torch.distributed.is_available():
            return
    except Exception:
        return
    from . import _register
    _register.subclass_call = local_call
    if _RegisterAfterImport.target in sys.modules:
        try:
            register()
        except Exception as e:
            warnings.warn(f"{NAMESPACE}: DTensor sharding rules not registered: {e!r}")
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())

"""SPMD partitioning of every public JAX op under ``jax.jit``: one generic
mechanism, derived from each op's ``core_kernels.op_axes.OpAxes``.

Each op is split into a public function (argument mapping and host checks, on
the global arrays) and an inner implementation ``impl(arrays, **static)``
(plan + launch) over a dict of arrays and hashable static options. The public
function ends with ``call(AXES, impl, arrays, **static)``:

- Outside a multi-device computation (no argument traced, or one device in the
  process) ``call`` is ``impl(arrays, **static)``: the op runs exactly as a
  plain call, nothing added.
- Otherwise the call goes through one
  ``jax.experimental.custom_partitioning.custom_partitioning`` object per op,
  with the resolved axes as its static argument:

  * ``sharding_rule`` (Shardy, the default partitioner): a callable building an
    ``SdyShardingRule`` from the shapes: one factor per label the op is
    independent along (``batch``, ``heads``, ``kv_heads``, ``tokens``; given
    the optional arguments present, e.g. merge's ``tokens`` only without
    ``prefill_tokens_with_context``), a compound factor where a dimension packs
    a label with a read-across axis (decode's output [B, H * E]), and a
    need-replication factor for every other dimension (head size, sequence,
    cache blocks, index arrays);
  * ``infer_sharding_from_operands`` (GSPMD, ``jax_use_shardy_partitioner``
    off) and ``partition`` (both partitioners): the mesh axes of each label are
    read from the operands' shardings (the first operand carrying it), checked
    (the label's extent a multiple of the shard count; a mesh axis used by one
    label only), and every operand and result gets exactly those axes on that
    label's dimensions, everything else replicated. The lower function calls
    ``impl`` on the local shards, so the planner re-plans for the local shapes
    (fewer heads, fewer sequences, fewer tokens) and no collective is emitted
    for the op; results keep the operands' sharding.

A label the op reads across can still be split where the op passes ``split=(label,
split_impl)`` (lightning prefill's "sequence": context parallelism): operands sharded
along it stay sharded, and the lower function calls ``split_impl`` on the local shards
with the mesh axes of that label, which it reduces over with XLA's collectives. On the
interpreter such a lower function may run several plans: ``call`` registers
SPLIT_SLOTS host-callback trampolines for it (the NOTE in _host_callback).

GQA: query heads and kv heads are two factors. Query head h reads kv head
h // (Hq / Hkv), so S-way head shards are local when the kv heads are split
the same S ways (Hkv a multiple of S) or, when S is a multiple of Hkv, by the
major mesh axes of the head sharding whose product is Hkv (Hkv = 1: kv heads
replicated). A kv-head sharding without a query-head sharding shards the query
heads the same way.

Unsupported shardings are gathered, never computed wrongly: a sharded dimension
that the op reads across (head size, sequence length, cache blocks, index
arrays, merge's tokens with ``prefill_tokens_with_context``), a label whose
extent the shard count does not divide, or a GQA split that no block of kv
heads matches is replicated by the partitioner (XLA inserts an all-gather
before the op) and the op runs on whole arrays along that dimension.

AOT and export (docs/jax_export.md): ``jax.jit(f).lower(...).compile()``
works everywhere. ``jax.export`` cannot serialise the CPU path (Triton's
interpreter runs in a host callback; JAX refuses to export it); on the GPU
each launch is a ``triton_kernel_call`` custom call (jax-triton's target), which
``jax.export`` accepts with
``disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call")]``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import jax
from jax.experimental.custom_partitioning import (ArrayMapping, CompoundFactor, SdyShardingRule,
                                                 custom_partitioning)
from jax.sharding import NamedSharding, PartitionSpec

from core_kernels.op_axes import OpAxes, fit_labels

from ._executor import target
from ._host_callback import Slot, active, register_p

# A resolved dimension: None (replicated), or (label, multiple): the dimension
# is the label's extent times ``multiple`` (1: the label itself; > 1: each
# label index owns ``multiple`` consecutive entries, e.g. decode's [B, H * E]).
Dim = Optional[tuple]


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The static argument of one partitioned call (hashable)."""
    axes: OpAxes = dataclasses.field(compare=False, hash=False)
    impl: Callable = dataclasses.field(compare=False, hash=False)
    key: tuple = ()                      # (op name, impl name): identity of axes / impl
    names: tuple = ()                    # input names, in operand order
    dims: tuple = ()                     # resolved dims per input
    sizes: tuple = ()                    # (label, extent) pairs
    labels: tuple = ()                   # labels the call may shard along
    kwargs: tuple = ()                   # static options of impl, (name, value) pairs
    slot: tuple = ()                     # interpreter: the outer program's host callbacks
    split: tuple = ()                    # (label, split impl name): see call's ``split``
    split_impl: Callable = dataclasses.field(default=None, compare=False, hash=False)


def _resolve(labels, shape, sizes: dict, allowed) -> tuple:
    out = []
    for lab, n in zip(fit_labels(labels, shape) or (None,) * len(shape), shape):
        size = sizes.get(lab)
        if lab not in allowed or not size:
            out.append(None)
        elif n == size:
            out.append((lab, 1))
        elif n % size == 0:
            out.append((lab, n // size))
        else:                       # e.g. a one-head block-sparse layout: shared by all heads
            out.append(None)
    return tuple(out)


def _partitionable(arrays: dict) -> bool:
    return jax.device_count() > 1 and any(isinstance(x, jax.core.Tracer) for x in arrays.values())


# host callbacks a split implementation may make (interpreter): one per plan it runs
SPLIT_SLOTS = 8


def call(axes: OpAxes, impl: Callable, arrays: dict, *, direct: Optional[Callable] = None,
         split: Optional[tuple] = None, **static):
    """``impl(arrays, **static)`` (a tuple of results, named as the first
    entries of ``axes.outputs``), partitioned along ``axes`` under a
    multi-device ``jax.jit`` (module docstring). ``arrays``: name -> array,
    None entries dropped; ``static`` values must be hashable. ``direct``: an
    equivalent zero-argument call used when nothing is partitioned (e.g. one
    reusing a plan the op already made for validation).

    ``split``: optional ``(label, split_impl)``, a label the op is not
    independent along (a scan's sequence) but can still be computed split:
    ``split_impl(arrays, axis_names=..., **static)`` computes the results of
    the local shards, split along ``label`` over the mesh axes ``axis_names``,
    with XLA's collectives over them (context parallelism). Operands sharded
    along it then stay sharded, as the results carrying the label; without
    ``split`` such a sharding is gathered."""
    arrays = {n: x for n, x in arrays.items() if x is not None}
    if not _partitionable(arrays):
        return impl(arrays, **static) if direct is None else direct()
    present = tuple(arrays)
    allowed = [lab for lab in axes.independent if axes.independent_along(lab, present)]
    allowed += [axes.groups[lab] for lab in allowed if lab in axes.groups]
    if split is not None:
        allowed.append(split[0])
    sizes = {}
    for name in axes.inputs:              # a label's extent: the first exact-rank input carrying it
        x = arrays.get(name)
        if x is not None and len(axes.inputs[name]) == x.ndim:
            for lab, n in zip(axes.inputs[name], x.shape):
                if lab in allowed:
                    sizes.setdefault(lab, n)
    names = tuple(n for n in arrays if n in axes.inputs)
    unknown = [n for n in arrays if n not in axes.inputs]
    if unknown:
        raise AssertionError(f"{axes.name}: arrays {unknown} are not described in its OpAxes")
    if _interpreted():
        first = names[0]
        slot = tuple(Slot() for _ in range(1 if split is None else SPLIT_SLOTS))
        x = arrays[first]
        for one in slot:
            x = register_p.bind(x, slot=one)
        arrays = dict(arrays, **{first: x})
    else:
        slot = ()
    spec = _Spec(axes, impl, (axes.name, getattr(impl, "__qualname__", repr(impl))), names,
                 tuple(_resolve(axes.inputs[n], arrays[n].shape, sizes, allowed) for n in names),
                 tuple(sorted(sizes.items())), tuple(allowed), tuple(sorted(static.items())), slot,
                 () if split is None else (split[0], getattr(split[1], "__qualname__", repr(split[1]))),
                 None if split is None else split[1])
    return tuple(_partitioned(spec, *(arrays[n] for n in names)))


# ---------------------------------------------------------------- the partitioned primitive
def _run(spec: _Spec, *operands):
    return tuple(spec.impl(dict(zip(spec.names, operands)), **dict(spec.kwargs)))


_partitioned = custom_partitioning(_run, static_argnums=(0,))


def _result_dims(spec: _Spec, result_shapes) -> list:
    sizes = dict(spec.sizes)
    outs = list(spec.axes.outputs)[:len(result_shapes)]
    return [_resolve(spec.axes.outputs[n], s, sizes, spec.labels) for n, s in zip(outs, result_shapes)]


def _axes_of(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _label_axes(spec: _Spec, mesh, arg_shapes) -> dict:
    """label -> the mesh axes it is split along (only valid, local splits)."""
    sizes = dict(spec.sizes)
    chosen = {}
    for lab in spec.labels:
        for dims, arg in zip(spec.dims, arg_shapes):
            sharding = getattr(arg, "sharding", None)
            pspec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
            for i, d in enumerate(dims):
                if d == (lab, 1) and i < len(pspec) and _axes_of(pspec[i]):
                    chosen.setdefault(lab, _axes_of(pspec[i]))
    groups = spec.axes.groups
    out, used = {}, set()
    for lab in spec.labels:
        if lab in groups.values():
            continue                                     # kv heads follow their query heads
        kv = groups.get(lab)
        axes = chosen.get(lab) or (chosen.get(kv, ()) if kv in sizes else ())
        parts = math.prod(mesh.shape[a] for a in axes)
        if not axes or used & set(axes) or sizes[lab] % parts:
            continue
        if kv in sizes:
            kv_axes = _kv_axes(axes, parts, sizes[kv], mesh)
            if kv_axes is None:
                continue
            out[kv] = kv_axes
        out[lab] = axes
        used |= set(axes)
    return out


def _kv_axes(axes, parts, num_kv, mesh):
    """The mesh axes splitting the kv heads so that each shard of the query heads
    (split ``parts`` ways along ``axes``) holds exactly the kv heads it reads."""
    if num_kv % parts == 0:
        return axes
    if parts % num_kv:
        return None
    prod = 1
    for i, a in enumerate(axes + (None,)):
        if prod == num_kv:
            return axes[:i]
        if a is None:
            return None
        prod *= mesh.shape[a]
    return None


def _sharding(mesh, dims, label_axes) -> NamedSharding:
    entries = []
    for d in dims:
        axes = label_axes.get(d[0], ()) if d is not None else ()
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return NamedSharding(mesh, PartitionSpec(*entries))


def _shapes(result_shape) -> list:
    return [s.shape for s in jax.tree.leaves(result_shape)]


def _infer(spec, mesh, arg_shapes, result_shape):
    label_axes = _label_axes(spec, mesh, arg_shapes)
    return tuple(_sharding(mesh, d, label_axes) for d in _result_dims(spec, _shapes(result_shape)))


def _partition(spec, mesh, arg_shapes, result_shape):
    label_axes = _label_axes(spec, mesh, arg_shapes)
    arg_shardings = tuple(_sharding(mesh, d, label_axes) for d in spec.dims)
    result_shardings = tuple(_sharding(mesh, d, label_axes)
                             for d in _result_dims(spec, _shapes(result_shape)))

    split_axes = label_axes.get(spec.split[0]) if spec.split else None

    def lower(*operands):
        with active(spec.slot):
            if split_axes:
                return tuple(spec.split_impl(dict(zip(spec.names, operands)), axis_names=split_axes,
                                             **dict(spec.kwargs)))
            return _run(spec, *operands)
    return mesh, lower, result_shardings, arg_shardings


def _rule(spec, mesh, operand_types, result_types):
    """The Shardy rule: a factor per shardable label, need-replication elsewhere."""
    from jax._src.lib.mlir import ir
    shapes = [tuple(ir.RankedTensorType(t).shape) for t in result_types]
    replicated, extra, whole, order = [], {}, set(), []

    def mapping(dims):
        out = []
        for d in dims:
            if d is None:
                replicated.append(f"r{len(replicated)}")
                out.append(replicated[-1])
                order.append(replicated[-1])
            elif d[1] == 1:
                whole.add(d[0])
                out.append(d[0])
            else:
                inner = f"m{len(extra)}"
                extra[inner] = d[1]
                order.append(inner)
                out.append(CompoundFactor(d[0], inner))
        return ArrayMapping(*out)

    operands = tuple(mapping(d) for d in spec.dims)
    results = tuple(mapping(d) for d in _result_dims(spec, shapes))
    sizes = dict(spec.sizes)
    compound_only = {lab: sizes[lab] for d in spec.dims + tuple(_result_dims(spec, shapes))
                     for lab in [x[0] for x in d if x is not None] if lab not in whole}
    return SdyShardingRule(tuple(operands), tuple(results),
                           need_replication_factors=tuple(order),  # in order of appearance (sdy: sorted)
                           **extra, **compound_only)


_partitioned.def_partition(_partition, infer_sharding_from_operands=_infer, sharding_rule=_rule)


def _interpreted() -> bool:
    return target().interpret

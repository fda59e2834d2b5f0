"""``jax.vmap`` of every public JAX op as ONE launch of the un-vmapped op.

Each public op is wrapped (:func:`vmappable`) so that, whenever one of its
array arguments is traced, the call goes through a
``jax.custom_batching.custom_vmap`` whose rule folds the vmapped axis (size V)
into an axis of the op itself, calls the op once on the folded arrays and
unfolds the results (reshape + moveaxis). No loop is lowered, and every example
is computed by the same kernel code as a per-example call, so results are equal
bit for bit. A call with no traced argument runs the op directly (eager host
checks unchanged); arguments that are not traced (host data, concrete arrays,
static options) are closed over, never batched. Nested vmap folds once per
level (the rule calls the wrapped op again).

Generic folding comes from ``core_kernels.op_axes``: the first label of
``OpAxes.fold`` that every batched argument carries (and along which the op is
independent, given the optional arguments present) is the fold target; every
array with that label (or its GQA group label: kv heads) is stacked
example-major along it (unbatched ones are tiled), arrays without it are shared
by all examples, and each result is unstacked along its label. Stacking q heads
and kv heads both example-major keeps GQA consistent: folded head v * Hq + h
reads kv head v * Hkv + h // (Hq / Hkv). Default configs are pinned to the
per-example choice where the planner's choice depends on the problem size
(lightning prefill segments, varlen segment length, block-sparse split counts,
prefix-prefill tiles), so the folded launch does the per-example arithmetic.

Op-specific folding (a batched index array that re-bases offsets, a
batched count, pinned configs) is the op's own rule, declared with its public
function in ``_ops_<op>.py`` (``vmappable(fn, AXES, rule)``); this module holds
only the generic mechanism and the fold helpers those rules share, and names no
op.

Every argument may be batched. What no axis can fold (a device scalar that
applies to the whole launch, such as an fp8 output scale, batched; per-head
values batched together with index data that folds the examples into the
tokens) runs :func:`looped`: one launch per example in a ``jax.lax.map``,
bitwise the per-example calls as well.
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from core_kernels.op_axes import OpAxes

from ._executor import info, target


def _traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


# ---------------------------------------------------------------- fold helpers
def stack_along(x, batched: bool, size: int, dim: int):
    """[V, ...] (or an unbatched array, tiled V times) -> the V examples stacked
    example-major along ``dim`` of one example: extent n -> V * n."""
    if not batched:
        x = jnp.broadcast_to(x[None], (size,) + tuple(x.shape))
    x = jnp.moveaxis(x, 0, dim)
    return x.reshape(x.shape[:dim] + (x.shape[dim] * x.shape[dim + 1],) + x.shape[dim + 2:])


def unstack_along(y, size: int, dim: int):
    """Inverse of :func:`stack_along`: V * n along ``dim`` -> [V, ..., n, ...]."""
    y = y.reshape(y.shape[:dim] + (size, y.shape[dim] // size) + y.shape[dim + 1:])
    return jnp.moveaxis(y, dim, 0)


def tile(x, batched: bool, size: int):
    """An argument as [V, ...] (an unbatched one broadcast)."""
    return x if batched else jnp.broadcast_to(x[None], (size,) + tuple(x.shape))


def offset_ids(ids, batched: bool, size: int, extent: int):
    """[V, n] ids into a per-example table of ``extent`` entries -> [V * n] ids
    into the V tables concatenated: id + v * extent for 0 <= id < extent; -1
    (and every other negative id) unchanged; id >= extent -> V * extent (out of
    range of the whole table, as it was of its own)."""
    ids = tile(ids, batched, size)
    shift = (jnp.arange(size, dtype=ids.dtype) * extent).reshape((size,) + (1,) * (ids.ndim - 1))
    out = jnp.where(ids >= extent, jnp.asarray(size * extent, ids.dtype),
                    jnp.where(ids >= 0, ids + shift, ids))
    return out.reshape((-1,) + ids.shape[2:])


def rebase_offsets(offsets, batched: bool, size: int, extent: int):
    """[V, B + 1] cumulative offsets (offsets[0] = 0, offsets[B] = extent) ->
    [V * B + 1]: example v's sequences start at v * extent."""
    offsets = tile(offsets, batched, size)
    shift = (jnp.arange(size, dtype=offsets.dtype) * extent)[:, None]
    body = (offsets[:, :-1] + shift).reshape(-1)
    return jnp.concatenate([body, offsets[-1:, -1] + (size - 1) * extent])


def fold_label(axes: OpAxes, batched: set, arrays: dict) -> str | None:
    """The first of ``axes.fold`` that every batched array carries (itself or
    its group label) and that the op is independent along, or None."""
    present = tuple(n for n, x in arrays.items() if x is not None)
    for label in axes.fold:
        wanted = {label, axes.groups.get(label)}
        if not axes.independent_along(label, present):
            continue
        if all(n in axes.inputs and wanted & set(axes.inputs[n]) for n in batched):
            return label
    return None


def fold_arrays(axes: OpAxes, label: str, size: int, batched: set, arrays: dict,
                shared=()) -> dict:
    """Every array carrying ``label`` (or its group label) stacked along it;
    the others (and ``shared``) passed as they are (they must be unbatched)."""
    wanted = (label, axes.groups.get(label))
    out = {}
    for n, x in arrays.items():
        labels = axes.inputs.get(n, ())
        dim = next((labels.index(w) for w in wanted if w is not None and w in labels), None)
        if x is None or n in shared or dim is None:
            assert x is None or n not in batched, n
            out[n] = x
        else:
            out[n] = stack_along(x, n in batched, size, dim)
    return out


def unfold_results(axes: OpAxes, label: str, size: int, results):
    """Each result (in ``axes.outputs`` order) unstacked along ``label``."""
    wanted = (label, axes.groups.get(label))
    single = not isinstance(results, (tuple, list))
    results = (results,) if single else tuple(results)
    out = []
    for name, y in zip(axes.outputs, results):
        labels = axes.outputs[name]
        dim = next(labels.index(w) for w in wanted if w is not None and w in labels)
        out.append(unstack_along(y, size, dim))
    return out[0] if single else tuple(out)


# ---------------------------------------------------------------- the wrapper
def vmappable(fn, axes: OpAxes, rule=None, components=None, prepare=None):
    """``fn`` (a public op) with a custom_vmap batching rule (``rule``, or the
    generic one of ``axes`` when None, with ``prepare``: see generic_rule).

    The parameters that may be arrays (batched when traced by vmap) are the
    arrays ``axes`` describes; ``components``: parameter -> names of the arrays
    of a tuple argument (block-sparse's ``sparse_layout`` = (crow, col)),
    handled as separate arrays.
    ``rule(size, batched, arrays, static, call)``: ``batched`` the set of
    batched array names, ``arrays`` name -> array (batched ones with the vmapped
    axis first), ``static`` the other arguments; returns the batched results
    (vmapped axis first) computed with ``call(**kwargs)``: the wrapped op itself
    (so a nested vmap folds again), taking components by their own names."""
    sig = inspect.signature(fn)
    components = components or {}
    rule = generic_rule(axes.name, axes, prepare) if rule is None else rule
    parts_of = {p: n for n, parts in components.items() for p in parts}
    # derived once, at definition: the array parameters in axes' order (a component's tuple once)
    array_args = tuple(dict.fromkeys(parts_of.get(n, n) for n in axes.inputs))

    def repack(kwargs: dict) -> dict:
        kwargs = dict(kwargs)
        for n, parts in components.items():
            if parts[0] in kwargs:
                kwargs[n] = tuple(kwargs.pop(p) for p in parts)
        return kwargs

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        values = dict(bound.arguments)
        for n, parts in components.items():
            if isinstance(values.get(n), (tuple, list)) and len(values[n]) == len(parts):
                values.update(zip(parts, values.pop(n)))
        names = [p for n in array_args for p in components.get(n, (n,))]
        operands = {n: values[n] for n in names if n in values and _traced(values[n])}
        if not operands:
            return fn(*args, **kwargs)
        static = {n: x for n, x in values.items() if n not in operands}

        @jax.custom_batching.custom_vmap
        def call(ops):
            return fn(**repack({**static, **ops}))

        @call.def_vmap
        def batching_rule(size, in_batched, ops):
            (in_batched,) = in_batched
            batched = {n for n, b in in_batched.items() if b}
            arrays = {n: values.get(n) for n in names if n in values}
            arrays.update(ops)
            out = rule(size, batched, arrays, {n: x for n, x in static.items() if n not in arrays},
                       lambda *a, **kw: wrapper(*a, **repack(kw)))
            return out, jax.tree.map(lambda _: True, out)

        return call(operands)

    return wrapper


def looped(size, batched, arrays, static, call):
    """The rule of what no axis folds: ``call`` once per example (``jax.lax.map``
    over the batched arrays; the others, and the static arguments, shared), so
    ``size`` launches, each the per-example call itself."""
    shared = {n: x for n, x in arrays.items() if n not in batched}
    return jax.lax.map(lambda ex: call(**shared, **ex, **static), {n: arrays[n] for n in batched})


def generic_rule(op_name: str, axes: OpAxes, prepare=None, pin=None):
    """A rule folding along :func:`fold_label`'s label. ``prepare(size, batched,
    arrays, label) -> (arrays, shared, batched)``: op-specific normalisation
    (decay layouts, one-head layouts; ``shared``: arrays left unfolded);
    ``pin(static, example) -> static``: sets the config the per-example call
    would choose. A batched ``unbatchable`` argument, or arrays no label folds,
    run :func:`looped`."""
    def rule(size, batched, arrays, static, call):
        label = fold_label(axes, batched, arrays)
        if label is None or batched & set(axes.unbatchable):
            return looped(size, batched, arrays, static, call)
        shared = ()
        if prepare is not None:
            arrays, shared, batched = prepare(size, batched, arrays, label)
        kwargs = dict(static)
        if pin is not None:
            kwargs = pin(kwargs, per_example(arrays, batched))
        folded = fold_arrays(axes, label, size, batched, arrays, shared)
        return unfold_results(axes, label, size, call(**folded, **kwargs))
    return rule


def per_example(arrays: dict, batched: set) -> dict:
    """name -> ShapeDtypeStruct of one example (for pinning configs)."""
    return {n: None if x is None else
            jax.ShapeDtypeStruct(x.shape[1:] if n in batched else x.shape, x.dtype)
            for n, x in arrays.items()}


def pinned(plan_config):
    """A ``pin`` that sets ``config`` to ``plan_config(target, example infos,
    static)``: the config (the user's, completed) a per-example call would use."""
    def pin(kwargs, example):
        infos = {n: None if s is None else info(s) for n, s in example.items()}
        config = plan_config(target(), infos, kwargs)
        return kwargs if config is None else dict(kwargs, config=config)
    return pin


def decay_prepare(*names):
    """Decay arrays ([H], [H, 1, 1] or [1, H, 1, 1] per example) as [H]."""
    def prepare(size, batched, arrays, label):
        arrays = dict(arrays)
        for n in names:
            x = arrays.get(n)
            if x is not None:
                arrays[n] = x.reshape((size, -1) if n in batched else (-1,))
        return arrays, (), batched
    return prepare

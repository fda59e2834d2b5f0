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

Per op:

- merge_attn_states: heads ([N, H, D] -> [N, V*H, D], LSE [H, N] -> [V*H, N]).
  A batched ``prefill_tokens_with_context`` (one count per example; the launch
  takes one count): tokens are gathered into one order where every example's
  merged tokens (t < count_v) come first, the launch count is their total, and
  the results are scattered back (a per-token op, so bitwise equal). A batched
  ``output_scale`` raises NotImplementedError (one scale per launch: dividing
  inputs instead would change the rounding).
- mask_empty_context_lse: heads. Batched start locs: tokens ([H, T] ->
  [H, V*T]) with query starts offset by v*T and context starts shifted so that
  the junction between two examples is a non-empty "request" (untouched, as
  tokens of no request are).
- lightning_attention: batch B; heads when ``ed`` is batched.
- linear_decode_forward_triton: heads (output [B, H*E]: head h owns columns
  h*E .. h*E+E-1, so heads fold example-major there too). Batched ``slot_idx``:
  batch rows and cache slots ([V, S, ...] -> [V*S, ...], an unbatched cache
  tiled), ids offset by v*S (-1 stays -1; an out-of-range id stays out of range).
- lightning_attention_varlen: heads. Batched cu_seqlens / slot_idx: tokens
  ([T, ...] -> [V*T, ...]) with cu_seqlens re-based by v*T, caches concatenated
  along slots with ids offset as for decode; final states [B, ...] -> [V*B, ...].
- blocksparse_flash_attn_varlen_fwd: heads (a one-head layout stays shared when
  unbatched, else it is broadcast to every query head). Batched cu_seqlens:
  NotImplementedError.
- context_attention_fwd: heads when the index data (b_loc, b_start_loc,
  b_seq_len) is shared; else tokens: q/k/v/output tokens stacked, sequences
  stacked along the batch, caches concatenated along blocks with block ids
  offset by v * num_blocks and b_start_loc re-based by v*T. Batched k_scale /
  v_scale / fp8_out_scale (one per launch), and alibi_slopes / sinks together
  with batched index data, raise NotImplementedError.

Unsupported combinations raise (naming the argument) while the rule is traced,
before anything is launched.
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


def _unsupported(op: str, name: str, why: str):
    return NotImplementedError(f"{name}: jax.vmap of {op} with {name} batched is not supported ({why})")


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
def vmappable(fn, axes: OpAxes, array_args: tuple, rule, components=None):
    """``fn`` (a public op) with a custom_vmap batching rule.

    ``array_args``: the parameters that may be arrays (batched when traced by
    vmap); ``components``: parameter -> names of the arrays of a tuple argument
    (block-sparse's ``sparse_layout`` = (crow, col)), handled as separate arrays.
    ``rule(size, batched, arrays, static, call)``: ``batched`` the set of
    batched array names, ``arrays`` name -> array (batched ones with the vmapped
    axis first), ``static`` the other arguments; returns the batched results
    (vmapped axis first) computed with ``call(**kwargs)``: the wrapped op itself
    (so a nested vmap folds again), taking components by their own names."""
    sig = inspect.signature(fn)
    components = components or {}

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


def generic_rule(op_name: str, axes: OpAxes, prepare=None, pin=None):
    """A rule folding along :func:`fold_label`'s label. ``prepare(size, batched,
    arrays, label) -> (arrays, shared, batched)``: op-specific normalisation
    (decay layouts, one-head layouts; ``shared``: arrays left unfolded);
    ``pin(static, example) -> static``: sets the config the per-example call
    would choose."""
    def rule(size, batched, arrays, static, call):
        for n in axes.unbatchable:
            if n in batched:
                raise _unsupported(op_name, n, "one value applies to the whole launch")
        label = fold_label(axes, batched, arrays)
        if label is None:
            bad = sorted(n for n in batched if not any(axes.inputs.get(n, ())))
            raise _unsupported(op_name, (bad or sorted(batched))[0], "no axis to fold it into")
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


# ================================================================ per-op rules
from core_kernels import op_axes as _axes  # noqa: E402
from core_kernels._plan import ArrayInfo, as_int  # noqa: E402


def _decay_prepare(*names):
    """Decay arrays ([H], [H, 1, 1] or [1, H, 1, 1] per example) as [H]."""
    def prepare(size, batched, arrays, label):
        arrays = dict(arrays)
        for n in names:
            x = arrays.get(n)
            if x is not None:
                arrays[n] = x.reshape((size, -1) if n in batched else (-1,))
        return arrays, (), batched
    return prepare


# ---------------------------------------------------------------- merge
def _merge_rule(size, batched, arrays, static, call):
    op = "merge_attn_states"
    if "output_scale" in batched:
        raise _unsupported(op, "output_scale", "one scale per launch; pass one shared scale")
    if "prefill_tokens_with_context" not in batched:
        return generic_rule(op, _axes.MERGE_ATTN_STATES)(size, batched, arrays, static, call)
    # one count per example: gather every example's merged tokens (t < count) first, then
    # the copied ones; the launch's count is the number of merged tokens (see the docstring)
    po, pl, so, sl = (tile(arrays[n], n in batched, size) for n in
                      ("prefix_output", "prefix_lse", "suffix_output", "suffix_lse"))
    n = po.shape[1]
    count = jnp.clip(arrays["prefill_tokens_with_context"].reshape(size).astype(jnp.int32), 0, n)
    t = jnp.arange(n, dtype=jnp.int32)
    key = ((t[None, :] >= count[:, None]).astype(jnp.int32) * (size * n)
           + jnp.arange(size, dtype=jnp.int32)[:, None] * n + t[None, :]).reshape(-1)
    perm = jnp.argsort(key)
    inverse = jnp.argsort(perm)
    tokens = lambda x: x.reshape((size * n,) + x.shape[2:])[perm]            # noqa: E731
    lse = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], size * n)[:, perm]  # noqa: E731
    out, out_lse = call(tokens(po), lse(pl), tokens(so), lse(sl),
                        prefill_tokens_with_context=jnp.sum(count), **static)
    out = out[inverse].reshape((size, n) + out.shape[1:])
    out_lse = jnp.moveaxis(out_lse[:, inverse].reshape(out_lse.shape[0], size, n), 1, 0)
    return out, out_lse


def _mask_rule(size, batched, arrays, static, call):
    axes = _axes.MASK_EMPTY_CONTEXT_LSE
    starts = {"query_start_loc", "context_start_loc"}
    if not batched & starts:
        return generic_rule(axes.name, axes)(size, batched, arrays, static, call)
    lse = arrays["lse"]
    t = lse.shape[-1]
    qsl = tile(arrays["query_start_loc"], "query_start_loc" in batched, size)
    csl = tile(arrays["context_start_loc"], "context_start_loc" in batched, size)
    qsl = (qsl + (jnp.arange(size, dtype=qsl.dtype) * t)[:, None]).reshape(-1)
    # shift each example's context starts so that the "request" spanning the junction
    # between two examples (tokens of no request) has a non-empty context: left as it is
    step = csl[:-1, -1] - csl[1:, 0] + 1
    shift = jnp.concatenate([jnp.zeros((1,), csl.dtype), jnp.cumsum(step).astype(csl.dtype)])
    csl = (csl + shift[:, None]).reshape(-1)
    out = call(stack_along(lse, "lse" in batched, size, 1), qsl, csl, **static)
    return unstack_along(out, size, 1)


# ---------------------------------------------------------------- lightning
def _lightning_config(tgt, infos, kw):
    from core_kernels.lightning_attention import plan as lp
    user = kw.get("config")
    p = lp._validate_prefill(infos["q"], infos["k"], infos["v"], infos["ed"], infos.get("kv_history"),
                             as_int("block_size", kw.get("block_size", 256)),
                             bool(kw.get("output_final_state_only", False)))
    if lp._use_gluon(tgt, p, user):
        return lp._gluon_config(tgt, p, user)
    return lp._triton_config(tgt, p, user)


def _lightning_rule(size, batched, arrays, static, call):
    return generic_rule("lightning_attention", _axes.LIGHTNING_ATTENTION, _decay_prepare("ed"),
                        pinned(_lightning_config))(size, batched, arrays, static, call)


def _decode_rule(size, batched, arrays, static, call):
    axes = _axes.LINEAR_DECODE
    if "slot_idx" not in batched:
        return generic_rule(axes.name, axes, _decay_prepare("slope_rate"))(
            size, batched, arrays, static, call)
    if "slope_rate" in batched:
        raise _unsupported(axes.name, "slope_rate", "with slot_idx batched the examples are folded "
                           "into the batch rows, which share the heads' slopes")
    cache = arrays["kv_caches"]
    slots = cache.shape[-4]
    folded = {n: stack_along(arrays[n], n in batched, size, 0) for n in ("q", "k", "v", "kv_caches")}
    ids = offset_ids(arrays["slot_idx"], True, size, slots)
    out, new_cache = call(**folded, slope_rate=arrays["slope_rate"], slot_idx=ids, **static)
    return unstack_along(out, size, 0), unstack_along(new_cache, size, 0)


def _varlen_config(tgt, infos, kw):
    from core_kernels.lightning_attention import varlen_plan as vp
    p = vp._validate(infos["q"], infos["k"], infos["v"], infos["ed"], infos["cu_seqlens"],
                     infos.get("kv_cache"), infos.get("slot_idx"), kw.get("block_size", 256))
    return vp._config(tgt, p, kw.get("config"))


def _varlen_rule(size, batched, arrays, static, call):
    axes = _axes.LIGHTNING_VARLEN
    if not batched & {"cu_seqlens", "slot_idx"}:
        return generic_rule(axes.name, axes, _decay_prepare("ed"),
                            pinned(_varlen_config))(size, batched, arrays, static, call)
    if "ed" in batched:
        raise _unsupported(axes.name, "ed", "with cu_seqlens / slot_idx batched the examples are "
                           "folded into the tokens, which share the heads' decays")
    t = arrays["q"].shape[-3]
    folded = {n: stack_along(arrays[n], n in batched, size, 0) for n in ("q", "k", "v")}
    folded["cu_seqlens"] = rebase_offsets(arrays["cu_seqlens"], "cu_seqlens" in batched, size, t)
    cache, ids = arrays.get("kv_cache"), arrays.get("slot_idx")
    if cache is not None:
        slots = cache.shape[-4]
        folded["kv_cache"] = stack_along(cache, "kv_cache" in batched, size, 0)
        folded["slot_idx"] = offset_ids(ids, "slot_idx" in batched, size, slots)
    elif ids is not None:
        folded["slot_idx"] = tile(ids, "slot_idx" in batched, size).reshape(-1)
    kw = pinned(_varlen_config)(dict(static), per_example(arrays, batched))
    out, state = call(**folded, ed=arrays["ed"], **kw)
    return unstack_along(out, size, 0), unstack_along(state, size, 0)


# ---------------------------------------------------------------- block-sparse
def _blocksparse_config(tgt, infos, kw):
    from core_kernels.blocksparse_attention.plan import choose_config
    if kw.get("config") is not None:
        return kw["config"]
    sm = kw.get("sm_scale")
    qb, ms = kw.get("q_block_size"), kw.get("max_seqlen")
    return choose_config(tgt, infos["q"], infos["k"], infos["v"], infos["cu_seqlens_k"],
                         infos.get("cu_seqlens_q"), infos["crow"], infos["col"],
                         sm_scale=None if sm is None else float(sm),
                         block_size=as_int("block_size", kw.get("block_size", 64)),
                         q_block_size=None if qb is None else as_int("q_block_size", qb),
                         max_seqlen=None if ms is None else as_int("max_seqlen", ms))


def _blocksparse_prepare(size, batched, arrays, label):
    """A one-head layout (homo_head) stays shared when unbatched; batched, it is
    broadcast to every query head of its example."""
    hq = arrays["q"].shape[-2]
    if hq == 1 or any(arrays[n].shape[-2] != 1 for n in ("crow", "col")):
        return arrays, (), batched
    if not batched & {"crow", "col"}:
        return arrays, ("crow", "col"), batched
    arrays = dict(arrays)
    for n in ("crow", "col"):
        x = tile(arrays[n], n in batched, size)
        arrays[n] = jnp.broadcast_to(x, (size, hq, x.shape[-1]))
    return arrays, (), batched | {"crow", "col"}


def _blocksparse_train_rule(axes):
    """The LSE forward and the backward: heads, as the forward (their configs do
    not depend on the head count: nothing to pin)."""
    return generic_rule(axes.name, axes, _blocksparse_prepare)


def _blocksparse_rule(size, batched, arrays, static, call):
    axes = _axes.BLOCKSPARSE_VARLEN
    for n in axes.unbatchable:
        if n in batched:
            raise _unsupported(axes.name, n, "the examples are folded into the heads, which share "
                               "the sequence boundaries")
    return generic_rule(axes.name, axes, _blocksparse_prepare,
                        pinned(_blocksparse_config))(size, batched, arrays, static, call)


# ---------------------------------------------------------------- prefix prefill
_INDEX = ("b_loc", "b_start_loc", "b_seq_len")


def _prefix_config(tgt, infos, kw):
    """The tiles (and gather decision) a per-example call chooses: the gather
    decision depends on the batch's scratch size."""
    from core_kernels.prefix_prefill import plan as pp
    if kw.get("is_block_table_ptr"):
        return kw.get("config")
    scale = ArrayInfo.contiguous((1,), "float32")
    fp8_cache = kw.get("kv_cache_dtype", "auto") != "auto" or infos["k_cache"].dtype.startswith("float8")
    sw, sm, mil = kw.get("sliding_window"), kw.get("sm_scale"), kw.get("max_input_len")
    p = pp._validate(*(infos.get(n) for n in ("q", "k", "v", "k_cache", "v_cache") + _INDEX + ("output",)),
                     scale if fp8_cache else None, scale if fp8_cache else None,
                     infos.get("alibi_slopes"), infos.get("sinks"),
                     None if kw.get("fp8_out_scale") is None and "fp8_out_scale" not in infos else scale,
                     infos["q"].shape[0] if mil is None else as_int("max_input_len", mil),
                     kw.get("kv_cache_dtype", "auto"), None if sw is None else as_int("sliding_window", sw),
                     None if sm is None else float(sm), bool(kw.get("skip_decode", False)), None,
                     bool(kw.get("causal", True)), as_int("v_pack", kw.get("interleaved_v_pack_factor", 0)),
                     False)
    if p.t == 0 or p.bsz == 0 or p.hq == 0 or p.max_input_len == 0:
        return kw.get("config")
    return pp._choose_config(p, kw.get("config"))[0]


def _context_rule(size, batched, arrays, static, call):
    axes = _axes.CONTEXT_ATTENTION_FWD
    op = axes.name
    for n in axes.unbatchable:
        if n in batched:
            raise _unsupported(op, n, "one scale applies to the whole launch")
    if static.get("is_block_table_ptr"):
        raise _unsupported(op, "b_loc", "is_block_table_ptr: block addresses cannot be re-based "
                           "onto a folded cache")
    kw = pinned(_prefix_config)(dict(static), per_example(arrays, batched))
    if not batched & set(_INDEX):  # shared index data: fold into the heads (kv heads grouped)
        folded = fold_arrays(axes, "heads", size, batched, arrays)
        return unstack_along(call(**folded, **kw), size, 1)
    for n in ("alibi_slopes", "sinks"):
        if n in batched:
            raise _unsupported(op, n, "with the index data batched the examples are folded into "
                               "the tokens, which share the heads' values")
    t = arrays["q"].shape[-3]
    blocks = arrays["k_cache"].shape[1 if "k_cache" in batched else 0]
    folded = {n: None if arrays.get(n) is None else stack_along(arrays[n], n in batched, size, 0)
              for n in ("q", "k", "v", "k_cache", "v_cache", "output", "b_seq_len")}
    folded["b_loc"] = offset_ids(arrays["b_loc"], "b_loc" in batched, size, blocks)
    folded["b_start_loc"] = rebase_offsets(arrays["b_start_loc"], "b_start_loc" in batched, size, t)
    for n in ("alibi_slopes", "sinks", "k_scale", "v_scale", "fp8_out_scale"):
        if n in arrays:
            folded[n] = arrays[n]
    return unstack_along(call(**folded, **kw), size, 0)


# ---------------------------------------------------------------- the public ops
RULES = {
    "merge_attn_states": (("prefix_output", "prefix_lse", "suffix_output", "suffix_lse",
                           "prefill_tokens_with_context", "output_scale"), _merge_rule, None),
    "merge_attn_states_backward": (("prefix_output", "prefix_lse", "suffix_output", "suffix_lse",
                                    "grad_output", "grad_output_lse", "prefill_tokens_with_context"),
                                   generic_rule("merge_attn_states_backward",
                                                _axes.MERGE_ATTN_STATES_BACKWARD), None),
    "mask_empty_context_lse": (("lse", "query_start_loc", "context_start_loc"), _mask_rule, None),
    "lightning_attention": (("q", "k", "v", "ed", "kv_history"), _lightning_rule, None),
    "lightning_attention_backward": (("q", "k", "v", "ed", "kv_history", "kv", "grad_output", "grad_kv"),
                                     generic_rule("lightning_attention_backward",
                                                  _axes.LIGHTNING_ATTENTION_BACKWARD, _decay_prepare("ed")),
                                     None),
    "linear_decode_forward_triton": (("q", "k", "v", "kv_caches", "slope_rate", "slot_idx"),
                                     _decode_rule, None),
    "lightning_attention_varlen_backward": (("q", "k", "v", "ed", "cu_seqlens", "kv", "grad_output",
                                             "grad_kv", "kv_history"),
                                            generic_rule("lightning_attention_varlen_backward",
                                                         _axes.LIGHTNING_VARLEN_BACKWARD,
                                                         _decay_prepare("ed")), None),
    "lightning_attention_varlen": (("q", "k", "v", "ed", "cu_seqlens", "kv_cache", "slot_idx"),
                                   _varlen_rule, None),
    "blocksparse_flash_attn_varlen_fwd": (("q", "k", "v", "cu_seqlens_k", "cu_seqlens_q",
                                           "sparse_layout"), _blocksparse_rule,
                                          {"sparse_layout": ("crow", "col")}),
    "blocksparse_flash_attn_varlen_fwd_lse": (
        ("q", "k", "v", "cu_seqlens_k", "cu_seqlens_q", "sparse_layout"),
        _blocksparse_train_rule(_axes.BLOCKSPARSE_VARLEN_LSE), {"sparse_layout": ("crow", "col")}),
    "blocksparse_flash_attn_varlen_backward": (
        ("q", "k", "v", "output", "lse", "grad_output", "cu_seqlens_k", "cu_seqlens_q",
         "sparse_layout"),
        _blocksparse_train_rule(_axes.BLOCKSPARSE_VARLEN_BACKWARD), {"sparse_layout": ("crow", "col")}),
    "context_attention_fwd": (("q", "k", "v", "k_cache", "v_cache") + _INDEX
                              + ("alibi_slopes", "sinks", "output", "k_scale", "v_scale",
                                 "fp8_out_scale"), _context_rule, None),
}


def with_vmap(fn):
    """The public op ``fn`` with its vmap rule (see the module docstring)."""
    array_args, rule, components = RULES[fn.__name__]
    return vmappable(fn, _axes.OPS[fn.__name__], array_args, rule, components)

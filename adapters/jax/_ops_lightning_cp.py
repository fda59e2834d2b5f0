"""Context-parallel lightning attention for JAX: q, k, v split along the
sequence over a mesh axis, one all-gather of [B, H, D, E] shard states
(core_kernels/lightning_attention/cp_plan.py has the scheme).

Two entry points share the steps below:
- ``lightning_attention_cp`` inside ``shard_map`` (the caller names the axis);
- ``lightning_attention`` under ``jax.jit`` with q, k, v sharded along N by a
  ``NamedSharding`` (final state only): ``_spmd`` partitions the call along the
  ops' "sequence" label and lowers it with ``prefill_split`` /
  ``backward_split`` below, on the local shards, with XLA's collectives over
  the mesh axes of that split.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from core_kernels._plan import as_int
from core_kernels.lightning_attention import plan_lightning_attention, plan_lightning_attention_backward
from core_kernels.lightning_attention.cp_plan import plan_lightning_cp_compose, plan_lightning_cp_state

from ._executor import infos, run_plan, target


def _run(planner, arrays: dict, names: tuple, **options) -> tuple:
    """``planner``'s plan over ``arrays`` (None entries: absent), run on the local arrays."""
    arrays = {n: x for n, x in arrays.items() if x is not None}
    tgt = target(arrays)
    return run_plan(planner(tgt, **infos(arrays, *names), **options), arrays, tgt)


def _state(k, v, ed, reverse):
    return _run(plan_lightning_cp_state, dict(k=k, v=v, ed=ed), ("k", "v", "ed"), reverse=reverse)[0]


def _compose(states, ed, rank, init, shard_len, reverse):
    return _run(plan_lightning_cp_compose, dict(states=states, ed=ed, rank=rank, init=init),
                ("states", "ed", "rank", "init"), shard_len=shard_len, reverse=reverse)


def _rank(axis_names):
    return jax.lax.axis_index(axis_names).astype(jnp.int32).reshape(1)


def _varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    kind = getattr(aval, "manual_axis_type", None)
    return frozenset(kind.varying if kind is not None else getattr(aval, "vma", ()))


def _varying(x, axis_names):
    """``x`` typed as varying over ``axis_names`` inside shard_map. NOTE: the
    kernels' results (host callbacks, triton_call) come out typed as invariant
    whatever they hold; a shard's gradient must carry its primal's type, and a
    psum takes varying operands."""
    missing = tuple(a for a in axis_names if a not in _varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _forward(q, k, v, ed, hist, axis_names, block_size, config):
    """(output shard, final state, this shard's starting state)."""
    states = jax.lax.all_gather(_state(k, v, ed, False), axis_names)        # [R, B, H, D, E]
    s_in, final = _compose(states, ed, _rank(axis_names), hist, q.shape[2], False)
    o, _ = _run(plan_lightning_attention, dict(q=q, k=k, v=v, ed=ed, kv_history=s_in),
                ("q", "k", "v", "ed", "kv_history"), block_size=block_size, output_final_state_only=True,
                config=config)
    return o, final, s_in


def _backward(q, k, v, ed, s_in, grad_o, own, grad_final, axis_names, block_size, need_grad_ed, typed):
    """(dq, dk, dv, d kv_history, d ed) of a shard; ``own`` [R, B, H, D, E]: the
    gathered gradients of the shards' starting states from their own outputs.
    ``typed``: inside shard_map, whose values carry their varying axes (a
    custom_partitioning lower function's do not: no casts there)."""
    g_end, d_hist = _compose(own, ed, _rank(axis_names), grad_final, q.shape[2], True)
    arrays = dict(q=q, k=k, v=v, ed=ed, kv_history=s_in, kv=g_end, grad_output=grad_o, grad_kv=g_end)
    dq, dk, dv, _, ded = _run(plan_lightning_attention_backward, arrays, tuple(arrays), block_size=block_size,
                              output_final_state_only=True, need_grad_ed=need_grad_ed)
    if need_grad_ed:  # each shard's share (an all-reduce of [H]: every device gets the same bits)
        ded = jax.lax.psum(_varying(ded, axis_names) if typed else ded, axis_names)
    return dq, dk, dv, d_hist, ded


def lightning_attention_cp(q, k, v, ed, kv_history=None, *, axis_name, block_size=256, config=None):
    """Lightning attention over a sequence split into equal shards along the
    mesh axis ``axis_name`` (context parallelism), for use inside ``shard_map``.

    Each device passes its shard: q, k [B, H, L, D], v [B, H, L, E] (tokens
    r * L .. r * L + L - 1 on the device at index r of ``axis_name``), ed and
    kv_history as :func:`lightning_attention`'s (the same on every device).
    Returns (output [B, H, L, E], this shard's outputs of the whole sequence;
    final state [B, H, D, E] float32 of the whole sequence, the same on every
    device). One collective: an all-gather of the [B, H, D, E] shard states
    (its gradient in the backward likewise; plus an all-gather of [H] when
    ed is differentiated).

    Args:
        axis_name: a mesh axis name, or a tuple of them (shard order: their
            combined index, as ``jax.lax.axis_index`` gives it).
        block_size: accepted for symmetry with lightning_attention (only the
            final state is returned).
        config: as lightning_attention's, for the prefill of each shard.

    Differentiable (custom VJP): dq, dk, dv of the shard, d kv_history and
    d ed (the same on every device). Deterministic; within fp32 rounding of
    the one-device call (the shard states are summed in another order).

    Example::

        f = shard_map(lambda q, k, v, ed: lightning_attention_cp(q, k, v, ed, axis_name="sp"),
                      mesh=mesh, in_specs=(P(None, None, "sp"),) * 3 + (P(),),
                      out_specs=(P(None, None, "sp"), P()))
    """
    axis_names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    block_size = as_int("block_size", block_size, 1)
    has_hist = kv_history is not None
    primals = (q, k, v, ed) + ((kv_history,) if has_hist else ())

    @jax.custom_vjp
    def cp(*args):
        q, k, v, ed, *hist = args
        o, final, _ = _forward(q, k, v, ed, hist[0] if hist else None, axis_names, block_size, config)
        return _varying(o, axis_names), final

    ed_perturbed = []  # static: whether ed is differentiated (symbolic zeros), as _ops_lightning's

    def cp_fwd(*args):
        ed_perturbed.append(args[3].perturbed)
        args = tuple(a.value for a in args)
        q, k, v, ed, *hist = args
        o, final, s_in = _forward(q, k, v, ed, hist[0] if hist else None, axis_names, block_size, config)
        # NOTE: typed varying, s_in stays each device's own residual; typed
        # invariant (as the kernels' results come out), jax.grad's partial
        # evaluation hands every device the first device's (measured: wrong
        # gradients on CPU devices, JAX 0.10.2)
        return (_varying(o, axis_names), final), (args, _varying(s_in, axis_names))

    def cp_bwd(res, grads):
        args, s_in = res
        q, k, v, ed, *hist = args
        grad_o, grad_final = grads
        if isinstance(grad_o, SymbolicZero):   # the kernels read it
            grad_o = jnp.zeros(grad_o.shape, grad_o.dtype)
        grad_final = None if isinstance(grad_final, SymbolicZero) else grad_final
        need = ed_perturbed[-1] if ed_perturbed else True
        own = jax.lax.all_gather(_state(q, grad_o, ed, True), axis_names)
        dq, dk, dv, d_hist, ded = _backward(q, k, v, ed, s_in, grad_o, own, grad_final, axis_names,
                                            block_size, need, True)
        out = (dq, dk, dv, ded.reshape(ed.shape)) + ((d_hist.astype(hist[0].dtype),) if hist else ())
        return tuple(_varying(g, tuple(_varying_axes(x))) for g, x in zip(out, args))

    cp.defvjp(cp_fwd, cp_bwd, symbolic_zeros=True)
    return cp(*primals)


# ---------------------------------------------------------------- the jit path (_spmd's split)
def prefill_split(arrays, *, axis_names, block_size, output_final_state_only, config, batch_invariant=False):
    """lightning_attention's forward on sequence shards (output_final_state_only;
    ``batch_invariant`` does not apply: the shards' arithmetic is the split's own)."""
    o, final, _ = _forward(arrays["q"], arrays["k"], arrays["v"], arrays["ed"], arrays.get("kv_history"),
                           axis_names, block_size, config)
    return o, final


def backward_split(arrays, *, axis_names, block_size, output_final_state_only, need_grad_ed,
                   batch_invariant=False):
    """lightning_attention_backward on sequence shards (output_final_state_only).
    The forward's starting states are not among its residuals: recomputed (one
    more shard-state pass, gathered with the gradients' in one all-gather)."""
    q, k, v, ed, grad_o = (arrays[n] for n in ("q", "k", "v", "ed", "grad_output"))
    hist = arrays.get("kv_history")
    both = jax.lax.all_gather(jnp.stack([_state(k, v, ed, False), _state(q, grad_o, ed, True)]), axis_names)
    s_in, _ = _compose(both[:, 0], ed, _rank(axis_names), hist, q.shape[2], False)
    dq, dk, dv, d_hist, ded = _backward(q, k, v, ed, s_in, grad_o, both[:, 1], arrays.get("grad_kv"),
                                        axis_names, block_size, need_grad_ed, False)
    if hist is None:
        d_hist = jnp.zeros_like(d_hist)
    return dq, dk, dv, d_hist, ded

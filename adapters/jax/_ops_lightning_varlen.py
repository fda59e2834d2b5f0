"""Lightning attention over packed variable-length sequences for JAX (one launch, jit-compatible)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from core_kernels.lightning_attention.varlen_plan import varlen_config
from core_kernels.lightning_attention import (check_varlen_host_data, plan_lightning_attention_varlen,
                                              plan_lightning_attention_varlen_backward)

from core_kernels.lightning_attention.checks import check_lightning_varlen

from core_kernels.lightning_attention.op import LIGHTNING_VARLEN, LIGHTNING_VARLEN_BACKWARD

from . import _spmd
from ._vmap import (decay_prepare, generic_rule, offset_ids, per_example, pinned, rebase_offsets, stack_along,
                    looped, tile, unstack_along, vmappable)
from ._executor import infos, run_plan, target
from ._index_validation import check_indices, index_validation
from ._ops_lightning import output_cotangents


def _host(x) -> bool:
    """Whether ``x`` is host data (checking it costs no device sync)."""
    return isinstance(x, np.ndarray) or (
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
        and all(d.platform == "cpu" for d in x.devices()))


def lightning_attention_varlen(q, k, v, ed, cu_seqlens, *, kv_cache=None, slot_idx=None,
                               block_size=256, config=None, validate_indices=None, batch_invariant=False):
    """Lightning attention (prefill) of B sequences packed along the token axis, one launch.

    For each sequence b (tokens cu_seqlens[b] .. cu_seqlens[b + 1] - 1) and head h:
    S_t = exp(-ed[h]) * S_{t-1} + k_t^T v_t, o_t = q_t S_t, starting from
    kv_cache[slot_idx[b]] (or 0), exactly as ``lightning_attention`` on that sequence.

    Args:
        q, k: [T, H, D]; v: [T, H, E]; float32/float16/bfloat16 (one dtype); D, E <= 256,
            any size.
        ed: [H], [H, 1, 1] or [1, H, 1, 1] float32 decay rates s_h >= 0.
        cu_seqlens: [B + 1] int32/int64 (may be traced): cu_seqlens[0] = 0,
            non-decreasing, cu_seqlens[B] = T; sequences may be empty. Checked
            (ValueError) when it is host data; traced or on the GPU an invalid one is
            undefined behaviour.
        kv_cache: optional [num_slots, H, D, E] float32 state cache, with slot_idx.
        slot_idx: [B] int32/int64 slot per sequence; -1 starts from zero and writes
            nothing. Host data: ids outside [-1, num_slots) and duplicate non-negative
            ids raise ValueError; traced or on the GPU duplicates are undefined and an
            out-of-range id gives that sequence NaN outputs and touches no slot.
        block_size: positive int (static), accepted for symmetry with
            ``lightning_attention``; only final states are returned.
        config: optional ``core_kernels.lightning_attention.LightningVarlenConfig``
            (forces the Triton kernel, its tiling and segmentation) or
            ``LightningVarlenGluonConfig`` (forces the Gluon kernels; ValueError where
            they do not apply), overriding the planner's choice (static).
        validate_indices: True checks cu_seqlens and slot_idx before the launch,
            wherever they live (one host transfer; ValueError; traced: ValueError);
            False never; None follows TANDEM_VALIDATE_INDICES (docs/index_validation.md).
        batch_invariant: True makes each sequence's result, and its gradients,
            independent of the other sequences and heads of the call and of the
            GPU's size (static): no sequence is cut into chained-scan segments,
            so a batch of few long sequences with few heads is slower.
    Returns:
        (output [T, H, E] in q's dtype, new kv_cache or, without a cache, the final
        states [B, H, D, E] float32). The new cache is aliased to the kernel's output:
        under jax.jit with kv_cache donated it is updated in place without a copy;
        slots not named keep their bits. Without a cache every sequence starts from zero.

    Transforms: one launch whatever the lengths; ``jax.jit`` (cu_seqlens and slot_idx
    may be traced), ``jax.vmap`` (one launch; one per example with ed batched together
    with cu_seqlens or slot_idx), ``jax.grad`` (custom VJP over q, k, v, ed
    and kv_cache; the decay's gradient only where ed is differentiated),
    ``NamedSharding`` over heads and ``shard_map``, ``jax.export`` on a GPU
    (docs/jax_export.md). On the CPU the kernels run under Triton's interpreter.

    Example::

        # sequences of 5, 0 and 3 tokens; slots 2, none (-1) and 0 of a 4-slot cache
        q, k, v = (jnp.ones((8, H, D), jnp.bfloat16) for _ in range(3))
        cu_seqlens = jnp.array([0, 5, 5, 8], jnp.int32)
        kv_cache = jnp.zeros((4, H, D, D), jnp.float32)
        o, kv_cache = lightning_attention_varlen(q, k, v, ed, cu_seqlens, kv_cache=kv_cache,
                                                 slot_idx=jnp.array([2, -1, 0], jnp.int32))

    See docs/ops/lightning_attention_varlen.md for the worked example and how it runs.
    """
    arrays = dict(q=q, k=k, v=v, ed=ed, cu_seqlens=cu_seqlens)
    if kv_cache is not None:
        arrays["kv_cache"] = kv_cache
    if slot_idx is not None:
        arrays["slot_idx"] = slot_idx
    tgt = target(arrays)
    plan = plan_lightning_attention_varlen(  # validates before the host checks
        tgt, **infos(arrays, "q", "k", "v", "ed", "cu_seqlens", "kv_cache", "slot_idx"), block_size=block_size,
        config=config, batch_invariant=bool(batch_invariant))
    check_varlen_host_data(np.asarray(cu_seqlens) if _host(cu_seqlens) else None, q.shape[0],
                           np.asarray(slot_idx) if slot_idx is not None and _host(slot_idx) else None,
                           0 if kv_cache is None else kv_cache.shape[0])
    if index_validation(validate_indices, cu_seqlens, slot_idx):
        check_indices(check_lightning_varlen,
                      dict(cu_seqlens=cu_seqlens, slot_idx=slot_idx), num_tokens=q.shape[0],
                      num_slots=0 if kv_cache is None else kv_cache.shape[0])
    return _spmd.call(LIGHTNING_VARLEN, _varlen, arrays, block_size=block_size, config=config,
                      batch_invariant=bool(batch_invariant), direct=lambda: run_plan(plan, arrays, tgt))


def _varlen(arrays, *, block_size, config, batch_invariant):
    tgt = target(arrays)
    plan = plan_lightning_attention_varlen(
        tgt, **infos(arrays, "q", "k", "v", "ed", "cu_seqlens", "kv_cache", "slot_idx"), block_size=block_size,
        config=config, batch_invariant=batch_invariant)
    return run_plan(plan, arrays, tgt)


def lightning_attention_varlen_backward(q, k, v, ed, cu_seqlens, kv, grad_output, grad_kv=None,
                                        kv_history=None, *, need_grad_ed=True, batch_invariant=False):
    """Gradients (dq, dk [T, H, D], dv [T, H, E] in q's dtype, d ed [H] float32
    (zeros unless ``need_grad_ed``), d kv_history [B, H, D, E] float32 (zeros
    without it)) of :func:`lightning_attention_varlen`, sequence b starting from
    ``kv_history[b]`` (None: zero), from its inputs, its final states ``kv``
    [B, H, D, E] and the output gradients (``grad_kv`` may be None). The
    kernels of the torch adapter's backward (bitwise the same). ``batch_invariant``:
    as the forward's."""
    arrays = dict(q=q, k=k, v=v, ed=ed, cu_seqlens=cu_seqlens, kv=kv, grad_output=grad_output)
    if grad_kv is not None:
        arrays["grad_kv"] = grad_kv
    if kv_history is not None:
        arrays["kv_history"] = kv_history
    return _spmd.call(LIGHTNING_VARLEN_BACKWARD, _varlen_backward, arrays, need_grad_ed=bool(need_grad_ed),
                      batch_invariant=bool(batch_invariant))


def _varlen_backward(arrays, *, need_grad_ed, batch_invariant):
    tgt = target(arrays)
    plan = plan_lightning_attention_varlen_backward(
        tgt, **infos(arrays, "q", "k", "v", "ed", "cu_seqlens", "kv", "grad_output", "grad_kv", "kv_history"),
        need_grad_ed=need_grad_ed, batch_invariant=batch_invariant)
    return run_plan(plan, arrays, tgt)


def with_vjp(forward, backward):
    """The public varlen prefill under a ``jax.custom_vjp`` whose backward is
    ``backward``: without a cache, over (q, k, v, ed); with one, over
    (q, k, v, ed, kv_cache) (each sequence's starting state gathered from its
    slot, the returned cache's gradient scattered back; cu_seqlens and slot_idx
    are integers). Symbolic zeros tell whether ed is differentiated. Outside
    any transformation (no traced array) it is ``forward`` itself."""
    @functools.wraps(forward)
    def lightning_attention_varlen(q, k, v, ed, cu_seqlens, *, kv_cache=None, slot_idx=None,
                                   block_size=256, config=None, validate_indices=None, batch_invariant=False):
        kwargs = dict(block_size=block_size, config=config, validate_indices=validate_indices,
                      batch_invariant=batch_invariant)
        cached = kv_cache is not None
        if not any(isinstance(x, jax.core.Tracer) for x in (q, k, v, ed, kv_cache)):
            return forward(q, k, v, ed, cu_seqlens, kv_cache=kv_cache, slot_idx=slot_idx, **kwargs)
        ed_perturbed = []  # static: travels in this closure (as _ops_lightning.py)
        # the integer arrays are arguments too (they may be traced); their cotangents are None
        primals = (q, k, v, ed, cu_seqlens) + ((kv_cache, slot_idx) if cached else ())

        def run(q, k, v, ed, cu, *cache):
            return forward(q, k, v, ed, cu, kv_cache=cache[0] if cache else None,
                           slot_idx=cache[1] if cache else None, **kwargs)

        @jax.custom_vjp
        def varlen(*args):
            return run(*args)

        def varlen_fwd(*args):
            ed_perturbed.append(args[3].perturbed)
            args = tuple(a.value for a in args)
            out = run(*args)
            if not cached:
                return out, (args, out[1], None)
            slot = jnp.asarray(args[6]).astype(jnp.int32)
            named = (slot >= 0)[:, None, None, None]
            gather = jnp.maximum(slot, 0)
            hist = jnp.where(named, args[5][gather], 0.0)
            return out, (args, jnp.where(named, out[1][gather], hist), hist)

        def varlen_bwd(res, grads):
            args, final, hist = res
            q, k, v, ed, cu, *cache = args
            grad_o, grad_kv = output_cotangents(grads)
            need = ed_perturbed[-1] if ed_perturbed else True
            if not cached:
                dq, dk, dv, ded, _ = backward(q, k, v, ed, cu, final, grad_o, grad_kv, need_grad_ed=need,
                                              batch_invariant=batch_invariant)
                return dq, dk, dv, ded.reshape(ed.shape), None
            kv_cache, slot = cache[0], jnp.asarray(cache[1]).astype(jnp.int32)
            named = (slot >= 0)[:, None, None, None]
            rows = jnp.where(slot >= 0, slot, kv_cache.shape[0])  # -1: out of range, dropped
            grad_final = None if grad_kv is None else jnp.where(named, grad_kv[jnp.maximum(slot, 0)], 0.0)
            dq, dk, dv, ded, dhist = backward(q, k, v, ed, cu, final, grad_o, grad_final, hist,
                                              need_grad_ed=need, batch_invariant=batch_invariant)
            # a named slot's input reaches the output only through its sequence
            dcache = (jnp.zeros_like(kv_cache) if grad_kv is None else
                      grad_kv.at[rows].set(0.0, mode="drop"))
            dcache = dcache.at[rows].add(dhist.astype(dcache.dtype), mode="drop")
            return dq, dk, dv, ded.reshape(ed.shape), None, dcache, None

        varlen.defvjp(varlen_fwd, varlen_bwd, symbolic_zeros=True)
        return varlen(*primals)

    return lightning_attention_varlen


# ---------------------------------------------------------------- jax.vmap: one launch (see _vmap)
# - lightning_attention_varlen: heads. Batched cu_seqlens / slot_idx: tokens
# ([T, ...] -> [V*T, ...]) with cu_seqlens re-based by v*T, caches concatenated
# along slots with ids offset as for decode; final states [B, ...] -> [V*B, ...].


def _varlen_config(tgt, infos, kw):
    return varlen_config(tgt, infos["q"], infos["k"], infos["v"], infos["ed"], infos["cu_seqlens"],
                         infos.get("kv_cache"), infos.get("slot_idx"), block_size=kw.get("block_size", 256),
                         config=kw.get("config"), batch_invariant=bool(kw.get("batch_invariant", False)))


def _varlen_rule(size, batched, arrays, static, call):
    axes = LIGHTNING_VARLEN
    if not batched & {"cu_seqlens", "slot_idx"}:
        return generic_rule(axes.name, axes, decay_prepare("ed"),
                            pinned(_varlen_config))(size, batched, arrays, static, call)
    if "ed" in batched:  # the tokens fold shares the heads' decays: one launch per example
        return looped(size, batched, arrays, static, call)
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


# ---------------------------------------------------------------- the public functions
# each with its custom_vmap rule (vmappable) and, where it has a backward, its custom_vjp
lightning_attention_varlen_backward = vmappable(lightning_attention_varlen_backward, LIGHTNING_VARLEN_BACKWARD,
                                                prepare=decay_prepare("ed"))
lightning_attention_varlen = with_vjp(vmappable(lightning_attention_varlen, LIGHTNING_VARLEN, _varlen_rule),
                                      lightning_attention_varlen_backward)

"""Lightning attention for JAX: functional prefill and decode, usable under jax.jit."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from core_kernels.lightning_attention.checks import check_linear_decode
from core_kernels._plan import as_int
from core_kernels.lightning_attention.prefill_plan import prefill_config
from core_kernels.lightning_attention import (check_slot_ids, plan_lightning_attention,
                                              plan_lightning_attention_backward, plan_linear_decode)

from core_kernels.lightning_attention.op import LIGHTNING_ATTENTION, LIGHTNING_ATTENTION_BACKWARD, LINEAR_DECODE

from . import _ops_lightning_cp, _spmd
from ._vmap import decay_prepare, generic_rule, offset_ids, pinned, stack_along, tile, unstack_along, vmappable
from ._executor import infos, run_plan, target
from ._index_validation import check_indices, index_validation


def lightning_attention(q, k, v, ed, block_size=256, kv_history=None,
                        output_final_state_only=False, *, config=None, batch_invariant=False):
    """Linear attention with per-head decay over a whole sequence (prefill).

    S_t = exp(-ed[h]) * S_{t-1} + k_t^T v_t (S_{-1} = kv_history or 0), o_t = q_t S_t.

    Args:
        q, k: [B, H, N, D]; v: [B, H, N, E]; float32/float16/bfloat16 (one dtype);
            D, E <= 256, any size; N any length >= 1.
        ed: [H], [H, 1, 1] or [1, H, 1, 1] float32 decay rates s_h >= 0 (+inf: no
            carry-over).
        block_size: positive int; granularity of the returned per-block states
            (static under jax.jit). Parameters in vLLM's order, by position or
            keyword.
        kv_history: optional [B, H, D, E] starting state, float32 or
            bfloat16/float16 (read into float32).
        output_final_state_only: return only the final state.
        config: optional ``LightningTritonConfig`` (forces the Triton kernel) or
            ``LightningGluonConfig`` (forces the Gluon kernels) overriding the
            planner's choice (static).
        batch_invariant: True makes each (b, h) row's result, and its gradients,
            independent of which other rows share the call and of the GPU's size
            (static): H heads in one call equal two calls of H/2, bit for bit, and
            a sharded run equals an unsharded one. Segments every 8192 tokens
            instead of by the grid: slower where few rows share a GPU.
    Returns:
        (output [B, H, N, E] in q's dtype, kv float32 [B, H, NB + 1, D, E] with
        NB = ceil(N / block_size), kv[:, :, i] the state before token
        i * block_size and kv[:, :, NB] the final state; or [B, H, D, E] (final
        state) with output_final_state_only).

    Accumulation and state are fp32; on the GPU fp32/fp16 products run in tf32
    and bf16 products in bf16; on the CPU the kernels run under Triton's interpreter.

    Transforms: ``jax.jit``, ``jax.vmap`` (one launch), ``jax.grad`` (custom VJP:
    gradients of q, k, v, ed and kv_history; the decay's gradient is computed only
    where ed is differentiated), ``NamedSharding`` over batch or heads and
    ``shard_map``, ``jax.export`` on a GPU (docs/jax_export.md).

    Example::

        q, k, v = (jnp.ones((B, H, N, D), jnp.bfloat16) for _ in range(3))
        ed = jnp.full((H,), 0.1, jnp.float32)
        o, kv = jax.jit(lightning_attention)(q, k, v, ed)          # kv [B, H, NB + 1, D, D]
        o, final = lightning_attention(q, k, v, ed, output_final_state_only=True)

    See docs/ops/lightning_attention.md for the recurrence, numerics and tuning.
    """
    arrays = dict(q=q, k=k, v=v, ed=ed)
    if kv_history is not None:
        arrays["kv_history"] = kv_history
    return _spmd.call(LIGHTNING_ATTENTION, _prefill, arrays, block_size=as_int("block_size", block_size),
                      output_final_state_only=output_final_state_only, config=config,
                      batch_invariant=bool(batch_invariant),
                      split=("sequence", _ops_lightning_cp.prefill_split) if output_final_state_only else None)


def _prefill(arrays, *, block_size, output_final_state_only, config, batch_invariant):
    tgt = target(arrays)
    plan = plan_lightning_attention(tgt, **infos(arrays, "q", "k", "v", "ed", "kv_history"),
                                    block_size=block_size, output_final_state_only=output_final_state_only,
                                    config=config, batch_invariant=batch_invariant)
    return run_plan(plan, arrays, tgt)


def lightning_attention_backward(q, k, v, ed, kv_history, kv, grad_output, grad_kv, *,
                                 block_size=256, output_final_state_only=False, need_grad_ed=True,
                                 batch_invariant=False):
    """Gradients of :func:`lightning_attention`: (dq, dk, dv, d kv_history float32
    [B, H, D, E] (zeros without kv_history), d ed float32 [H] (zeros unless
    ``need_grad_ed``)) from the forward's inputs, its returned states ``kv``
    and the output gradients (``grad_kv`` may be None). The kernels of the
    torch adapter's backward (bitwise the same). Under jax.grad the decay's
    gradient is computed only where ed is differentiated (the custom VJP's
    symbolic zeros tell). Batched by jax.vmap (heads) and partitioned over
    heads, as the forward. ``batch_invariant``: as the forward's."""
    arrays = dict(q=q, k=k, v=v, ed=ed, kv=kv, grad_output=grad_output)
    if kv_history is not None:
        arrays["kv_history"] = kv_history
    if grad_kv is not None:
        arrays["grad_kv"] = grad_kv
    return _spmd.call(LIGHTNING_ATTENTION_BACKWARD, _backward, arrays,
                      block_size=as_int("block_size", block_size),
                      output_final_state_only=output_final_state_only, need_grad_ed=bool(need_grad_ed),
                      batch_invariant=bool(batch_invariant),
                      split=("sequence", _ops_lightning_cp.backward_split) if output_final_state_only else None)


def _backward(arrays, *, block_size, output_final_state_only, need_grad_ed, batch_invariant):
    tgt = target(arrays)
    plan = plan_lightning_attention_backward(
        tgt, **infos(arrays, "q", "k", "v", "ed", "kv_history", "kv", "grad_output", "grad_kv"),
        block_size=block_size, output_final_state_only=output_final_state_only, need_grad_ed=need_grad_ed,
        batch_invariant=batch_invariant)
    return run_plan(plan, arrays, tgt)


def output_cotangents(grads):
    """(output cotangent, states cotangent or None) of a prefill's custom VJP with
    symbolic zeros: a zero output cotangent is materialised (the kernels read
    it), a zero states cotangent is None (the plans take none)."""
    grad_o, grad_kv = grads
    if isinstance(grad_o, SymbolicZero):
        grad_o = jnp.zeros(grad_o.shape, grad_o.dtype)
    return grad_o, None if isinstance(grad_kv, SymbolicZero) else grad_kv


def with_vjp(forward, backward):
    """The public prefill: ``forward`` (with its vmap rule) under a
    ``jax.custom_vjp`` whose backward is ``backward`` (the backward kernels, with
    their own vmap rule: jax.vmap(jax.grad(f)) batches both). Outside any
    transformation (no traced array) it is ``forward`` itself."""
    @functools.wraps(forward)
    def lightning_attention(q, k, v, ed, block_size=256, kv_history=None,
                            output_final_state_only=False, *, config=None, batch_invariant=False):
        primals = (q, k, v, ed) + (() if kv_history is None else (kv_history,))
        if not any(isinstance(x, jax.core.Tracer) for x in primals):
            return forward(q, k, v, ed, block_size, kv_history, output_final_state_only, config=config,
                           batch_invariant=batch_invariant)
        options = dict(block_size=block_size, output_final_state_only=output_final_state_only,
                       batch_invariant=batch_invariant)

        def run(q, k, v, ed, *hist):
            return forward(q, k, v, ed, block_size, hist[0] if hist else None,
                           output_final_state_only, config=config, batch_invariant=batch_invariant)

        @jax.custom_vjp
        def prefill(*args):
            return run(*args)

        # NOTE: symbolic zeros tell whether ed is differentiated (its gradient,
        # the decay's tangent, adds work to the dQ programs); the flag is static, so it travels in this closure, not in the residuals
        ed_perturbed = []

        def prefill_fwd(*args):
            ed_perturbed.append(args[3].perturbed)
            args = tuple(a.value for a in args)
            out = run(*args)
            return out, (args, out[1])

        def prefill_bwd(res, grads):
            args, kv = res
            q, k, v, ed, *hist = args
            grad_o, grad_kv = output_cotangents(grads)
            need = ed_perturbed[-1] if ed_perturbed else True
            dq, dk, dv, dhist, ded = backward(
                q, k, v, ed, hist[0] if hist else None, kv, grad_o, grad_kv, need_grad_ed=need, **options)
            out = (dq, dk, dv, ded.reshape(ed.shape))
            return out + ((dhist.astype(hist[0].dtype),) if hist else ())

        prefill.defvjp(prefill_fwd, prefill_bwd, symbolic_zeros=True)
        return prefill(*primals)

    return lightning_attention


def linear_decode_forward_triton(q, k, v, kv_caches, slope_rate, slot_idx, BLOCK_SIZE=32, *,
                                 config=None, validate_indices=None):
    """One decode step of lightning attention over a slot-indexed state cache.

    Computes S_new = exp(-slope_rate[h]) * S + k^T v and o = q S_new for each row b,
    with S the state in kv_caches[slot_idx[b]].

    Args:
        q, k: [B, H, 1, D]; v: [B, H, 1, E]; float32/float16/bfloat16 (one dtype).
        kv_caches: [num_slots, H, D, E] float32, or bfloat16/float16 (updated
            in float32, stored rounded; the output uses the unrounded state).
        slope_rate: [H], [H, 1, 1] or [1, H, 1, 1] float32.
        slot_idx: [B] int32/int64; -1 marks padding (output 0, no cache write).
            Ids outside [-1, num_slots) raise ValueError when the ids are host
            data; traced or on the GPU such a row's output is NaN and no slot
            is touched.
        BLOCK_SIZE: accepted for vLLM compatibility (by position or keyword);
            the tiling is the planner's.
        config: optional ``LightningDecodeConfig`` overriding the planner's tiling (static).
        validate_indices: True checks slot_idx before the launch, wherever it lives
            (ids in [-1, num_slots), no non-negative id twice: duplicates race on
            the GPU; one host transfer; ValueError; traced: ValueError); False
            never; None follows TANDEM_VALIDATE_INDICES (docs/index_validation.md).
    Returns:
        (output [B, H * E] in q's dtype, new kv_caches). The cache is aliased to
        the kernel's output: under jax.jit with kv_caches donated it is updated
        in place, without a copy; slots not named in slot_idx keep their bits.

    Transforms: ``jax.jit`` (slot_idx may be traced), ``jax.vmap`` (one launch, any
    argument batched), ``NamedSharding`` over heads and
    ``shard_map``, ``jax.export`` on a GPU (docs/jax_export.md). No backward
    (not differentiable with ``jax.grad``).

    Example::

        q, k, v = (jnp.ones((B, H, 1, D), jnp.bfloat16) for _ in range(3))
        kv_caches = jnp.zeros((num_slots, H, D, D), jnp.float32)
        step = jax.jit(linear_decode_forward_triton, donate_argnums=3)
        o, kv_caches = step(q, k, v, kv_caches, slope_rate, jnp.arange(B))  # o [B, H * D]

    See docs/ops/lightning_attention.md.
    """
    if isinstance(slot_idx, np.ndarray) or (
            isinstance(slot_idx, jax.Array) and not isinstance(slot_idx, jax.core.Tracer)
            and all(d.platform == "cpu" for d in slot_idx.devices())):
        check_slot_ids(np.asarray(slot_idx), kv_caches.shape[0])
    if index_validation(validate_indices, slot_idx) and kv_caches.ndim == 4:
        check_indices(check_linear_decode, dict(slot_idx=slot_idx),
                      num_slots=kv_caches.shape[0])
    as_int("BLOCK_SIZE", BLOCK_SIZE, 1)  # unused (vLLM's signature), but an int all the same
    arrays = dict(q=q, k=k, v=v, kv_caches=kv_caches, slope_rate=slope_rate, slot_idx=slot_idx)
    return _spmd.call(LINEAR_DECODE, _decode, arrays, config=config)


def _decode(arrays, *, config):
    tgt = target(arrays)
    plan = plan_linear_decode(tgt, **infos(arrays, "q", "k", "v", "kv_caches", "slope_rate", "slot_idx"),
                              config=config)
    return run_plan(plan, arrays, tgt)


# ---------------------------------------------------------------- jax.vmap: one launch (see _vmap)
# - lightning_attention: batch B; heads when ``ed`` is batched.
# - linear_decode_forward_triton: heads (output [B, H*E]: head h owns columns
# h*E .. h*E+E-1, so heads fold example-major there too). Batched ``slot_idx``:
# batch rows and cache slots ([V, S, ...] -> [V*S, ...], an unbatched cache
# tiled), ids offset by v*S (-1 stays -1; an out-of-range id stays out of range).
# Batched ``slot_idx`` and ``slope_rate``: heads, over the states the rows name
# (_decode_compact).


def _lightning_config(tgt, infos, kw):
    return prefill_config(tgt, infos["q"], infos["k"], infos["v"], infos["ed"], infos.get("kv_history"),
                          block_size=as_int("block_size", kw.get("block_size", 256)),
                          output_final_state_only=bool(kw.get("output_final_state_only", False)),
                          config=kw.get("config"), batch_invariant=bool(kw.get("batch_invariant", False)))


def _lightning_rule(size, batched, arrays, static, call):
    return generic_rule("lightning_attention", LIGHTNING_ATTENTION, decay_prepare("ed"),
                        pinned(_lightning_config))(size, batched, arrays, static, call)


def _decode_rule(size, batched, arrays, static, call):
    axes = LINEAR_DECODE
    if "slot_idx" not in batched:
        return generic_rule(axes.name, axes, decay_prepare("slope_rate"))(
            size, batched, arrays, static, call)
    if "slope_rate" in batched:
        return _decode_compact(size, batched, arrays, static, call)
    cache = arrays["kv_caches"]
    slots = cache.shape[-4]
    folded = {n: stack_along(arrays[n], n in batched, size, 0) for n in ("q", "k", "v", "kv_caches")}
    ids = offset_ids(arrays["slot_idx"], True, size, slots)
    out, new_cache = call(**folded, slope_rate=arrays["slope_rate"], slot_idx=ids, **static)
    return unstack_along(out, size, 0), unstack_along(new_cache, size, 0)


def _decode_compact(size, batched, arrays, static, call):
    """Slots and slopes both batched: rows share no slot across examples, heads no
    slope, so the examples fold into the heads of a cache of the states the rows
    name: row b of every example reads and writes slot b of [B, V * H, D, E]
    (gathered from each example's slot_idx[v, b], scattered back after the launch,
    one launch). Rows with id -1 give 0, ids out of range NaN, and neither touches
    the cache, as the kernel does for them."""
    ids = tile(arrays["slot_idx"], True, size).astype(jnp.int32)           # [V, B]
    cache = tile(arrays["kv_caches"], "kv_caches" in batched, size)        # [V, S, H, D, E]
    slots = cache.shape[1]
    named = (ids >= 0) & (ids < slots)
    states = cache[jnp.arange(size)[:, None], jnp.where(named, ids, 0)]    # [V, B, H, D, E]
    folded = {n: stack_along(arrays[n], n in batched, size, 1) for n in ("q", "k", "v")}
    rows = jnp.arange(ids.shape[1], dtype=arrays["slot_idx"].dtype)
    out, new = call(**folded, kv_caches=stack_along(states, True, size, 1),
                    slope_rate=stack_along(arrays["slope_rate"].reshape(size, -1), True, size, 0),
                    slot_idx=rows, **static)
    out = unstack_along(out, size, 1)                                       # [V, B, H * E]
    out = jnp.where((ids == -1)[..., None], jnp.zeros((), out.dtype),
                    jnp.where(named[..., None], out, jnp.full((), jnp.nan, out.dtype)))
    target_rows = jnp.where(named, ids, slots)                              # others dropped
    new_cache = cache.at[jnp.arange(size)[:, None], target_rows].set(unstack_along(new, size, 1), mode="drop")
    return out, new_cache


# ---------------------------------------------------------------- the public functions
# each with its custom_vmap rule (vmappable) and, where it has a backward, its custom_vjp
lightning_attention_backward = vmappable(lightning_attention_backward, LIGHTNING_ATTENTION_BACKWARD,
                                         prepare=decay_prepare("ed"))
lightning_attention = with_vjp(vmappable(lightning_attention, LIGHTNING_ATTENTION, _lightning_rule),
                               lightning_attention_backward)
linear_decode_forward_triton = vmappable(linear_decode_forward_triton, LINEAR_DECODE, _decode_rule)

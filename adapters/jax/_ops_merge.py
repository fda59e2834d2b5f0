"""merge_attn_states for JAX: functional, works under jax.jit."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from core_kernels._plan import as_int
from core_kernels.merge_attn_states.op import MASK_EMPTY_CONTEXT_LSE, MERGE_ATTN_STATES, MERGE_ATTN_STATES_BACKWARD
from core_kernels.merge_attn_states import (NO_FP8_BACKWARD, check_prefill_tokens_with_context,
                                           plan_mask_empty_context_lse, plan_merge_attn_states,
                                           plan_merge_attn_states_backward)

from . import _spmd
from ._vmap import generic_rule, looped, stack_along, tile, unstack_along, vmappable
from ._executor import as_array, infos, is_device_data, run_plan, scale_array, target


def merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse, *,
                      prefill_tokens_with_context=None, output_scale=None, output_dtype=None,
                      config=None):
    """Merge two partial attention results using their log-sum-exps.

    Args:
        prefix_output, suffix_output: [N, H, D] float32/float16/bfloat16 (one dtype,
            one device); D from 1 to 512, N may be 0.
        prefix_lse, suffix_lse: [H, N] float32 natural-log LSE (+inf or -inf = empty part).
        prefill_tokens_with_context: None (= N), a host int (Python/numpy int or
            0-d numpy array, in [0, N]) or an int JAX array, possibly traced
            (device data: not checked; outside [0, N] it acts as the nearest
            bound); tokens t >= it copy the suffix. Passed as device data, so a
            new value never recompiles.
        output_scale: None, or a finite float > 0 / 1-element float32 array: the
            output is fp8 e4m3 = fp8(clamp(value / scale)).
        output_dtype: the output dtype; defaults to the input dtype (fp8 e4m3
            with output_scale).
        config: optional ``core_kernels.merge_attn_states.MergeConfig`` overriding the
            planner's tiling (static).

    Returns:
        (output [N, H, D] in output_dtype, output_lse [H, N] float32): token t < the
        count merges the two parts, t >= it copies the suffix and its LSE.

    Transforms: ``jax.jit`` (the count and the scale may be traced), ``jax.vmap``
    (one launch; one per example with a batched ``output_scale``), ``jax.grad``
    (custom VJP over the four inputs; an fp8 output has no backward: ValueError),
    ``NamedSharding`` over heads (or tokens, without a count) and ``shard_map``,
    ``jax.export`` on a GPU (docs/jax_export.md). On the CPU the kernels run under
    Triton's interpreter.

    Example::

        po, so = (jnp.ones((N, H, D), jnp.bfloat16) for _ in range(2))
        pl, sl = (jnp.zeros((H, N), jnp.float32) for _ in range(2))
        out, out_lse = jax.jit(merge_attn_states)(po, pl, so, sl)

    See docs/ops/merge_attn_states.md for the formula, tuning and performance.
    """
    arrays = dict(prefix_output=prefix_output, prefix_lse=prefix_lse,
                  suffix_output=suffix_output, suffix_lse=suffix_lse)
    if prefill_tokens_with_context is not None:
        arrays["prefill_tokens_with_context"] = _count_array(prefill_tokens_with_context, prefix_output)
    if output_scale is not None:
        arrays["output_scale"] = scale_array("output_scale", output_scale)
    return _spmd.call(MERGE_ATTN_STATES, _merge, arrays, config=config,
                      output_dtype=None if output_dtype is None else jnp.dtype(output_dtype).name)


def _merge(arrays, *, config, output_dtype):
    tgt = target(arrays)
    count = arrays.get("prefill_tokens_with_context")
    plan = plan_merge_attn_states(
        tgt, **infos(arrays, "prefix_output", "prefix_lse", "suffix_output", "suffix_lse", "output_scale",
                     "prefill_tokens_with_context"),
        num_ctx="none" if count is None else "array", output_dtype=output_dtype, config=config)
    return run_plan(plan, arrays, tgt)



def _count_array(prefill_tokens_with_context, prefix_output):
    """prefill_tokens_with_context as an int32 device array (a host int checked)."""
    count = prefill_tokens_with_context
    if not is_device_data(count):  # a host int: checked (a JAX array is device data)
        count = as_int("prefill_tokens_with_context", count)
        if getattr(prefix_output, "ndim", None) == 3:
            count = check_prefill_tokens_with_context(count, prefix_output.shape[0])
    return as_array("prefill_tokens_with_context", count, jnp.int32)


def merge_attn_states_backward(prefix_output, prefix_lse, suffix_output, suffix_lse, grad_output,
                               grad_output_lse=None, *, prefill_tokens_with_context=None, config=None):
    """The gradients of :func:`merge_attn_states` (output in the input dtype).

    Args:
        prefix_output, prefix_lse, suffix_output, suffix_lse,
        prefill_tokens_with_context: the forward's arguments.
        grad_output: [N, H, D] in the inputs' dtype; grad_output_lse: [H, N]
            float32 or None (zero).
    Returns:
        (grad_prefix_output [N, H, D] input dtype, grad_prefix_lse [H, N] float32,
        grad_suffix_output, grad_suffix_lse).
    """
    arrays = dict(prefix_output=prefix_output, prefix_lse=prefix_lse, suffix_output=suffix_output,
                  suffix_lse=suffix_lse, grad_output=grad_output, grad_output_lse=grad_output_lse)
    if prefill_tokens_with_context is not None:
        arrays["prefill_tokens_with_context"] = _count_array(prefill_tokens_with_context, prefix_output)
    return _spmd.call(MERGE_ATTN_STATES_BACKWARD, _merge_backward, arrays, config=config)


def _merge_backward(arrays, *, config):
    tgt = target(arrays)
    count = arrays.get("prefill_tokens_with_context")
    plan = plan_merge_attn_states_backward(
        tgt, **infos(arrays, "prefix_output", "prefix_lse", "suffix_output", "suffix_lse", "grad_output",
                     "grad_output_lse", "prefill_tokens_with_context"),
        num_ctx="none" if count is None else "array", config=config)
    return run_plan(plan, arrays, tgt)


def with_vjp(forward, backward):
    """The public merge: ``forward`` (merge_attn_states with its vmap rule) with a
    ``jax.custom_vjp`` whose backward is ``backward`` (the backward kernel, with
    its own vmap rule). Outside any transformation (no traced array) it is
    ``forward`` itself. The custom VJP sits outside the vmap rules, so
    ``jax.vmap(jax.grad(f))`` and ``jax.grad(jax.vmap(f))`` batch the forward and
    the backward with their rules. An fp8 output (output_scale) has no backward:
    differentiating it raises ValueError (NO_FP8_BACKWARD)."""
    @functools.wraps(forward)
    def merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse, *,
                          prefill_tokens_with_context=None, output_scale=None, output_dtype=None,
                          config=None):
        primals = (prefix_output, prefix_lse, suffix_output, suffix_lse)
        kwargs = dict(prefill_tokens_with_context=prefill_tokens_with_context,
                      output_scale=output_scale, output_dtype=output_dtype, config=config)
        if not any(isinstance(x, jax.core.Tracer) for x in primals):
            return forward(*primals, **kwargs)
        # device data travels as primal arguments (never closed over); host values stay host values
        count = prefill_tokens_with_context if is_device_data(prefill_tokens_with_context) else None
        scale = output_scale if is_device_data(output_scale) else None

        def fwd_kwargs(c, s):
            return dict(kwargs, prefill_tokens_with_context=prefill_tokens_with_context if c is None else c,
                        output_scale=output_scale if s is None else s)

        @jax.custom_vjp
        def merge(po, pl, so, sl, c, s):
            return forward(po, pl, so, sl, **fwd_kwargs(c, s))

        def merge_fwd(po, pl, so, sl, c, s):
            return forward(po, pl, so, sl, **fwd_kwargs(c, s)), (po, pl, so, sl, c)

        def merge_bwd(res, grads):
            if output_scale is not None:
                raise ValueError(NO_FP8_BACKWARD)
            po, pl, so, sl, c = res
            d = backward(po, pl, so, sl, grads[0], grads[1], config=config,
                         prefill_tokens_with_context=prefill_tokens_with_context if c is None else c)
            return (*d, None, None)

        merge.defvjp(merge_fwd, merge_bwd)
        return merge(*primals, count, scale)

    return merge_attn_states

def mask_empty_context_lse(lse, query_start_loc, context_start_loc):
    """The LSE with -inf at every query token whose context chunk is empty
    (vLLM's step before merging a chunked-context prefill's two parts).

    Args:
        lse: [H, T] float32.
        query_start_loc: [R + 1] int32/int64, non-decreasing: request r's tokens
            are query_start_loc[r] .. query_start_loc[r + 1] - 1.
        context_start_loc: [R + 1] int32/int64: request r's context chunk is
            empty when context_start_loc[r] == context_start_loc[r + 1].
    Returns:
        the new lse [H, T] float32, aliased to the input (under jax.jit with lse donated
        it is updated without a copy). Tokens of no request keep their values.

    Transforms: one launch, no host sync; ``jax.jit`` (the start locs may be traced),
    ``jax.vmap`` (one launch, batched start locs included), ``NamedSharding`` over
    heads and ``shard_map``, ``jax.export`` on a GPU (docs/jax_export.md). No backward
    (not differentiable with ``jax.grad``).

    Example::

        # 2 requests: tokens 0..2 (context empty) and 3..4 (context non-empty)
        qsl, csl = jnp.array([0, 3, 5]), jnp.array([0, 0, 7])
        prefix_lse = mask_empty_context_lse(prefix_lse, qsl, csl)  # [H, 5]: columns 0..2 -> -inf

    See docs/ops/merge_attn_states.md.
    """
    arrays = dict(lse=lse, query_start_loc=query_start_loc, context_start_loc=context_start_loc)
    (out,) = _spmd.call(MASK_EMPTY_CONTEXT_LSE, _mask, arrays)
    return out


def _mask(arrays):
    tgt = target(arrays)
    plan = plan_mask_empty_context_lse(tgt, **infos(arrays, "lse", "query_start_loc", "context_start_loc"))
    return run_plan(plan, arrays, tgt)


# ---------------------------------------------------------------- jax.vmap: one launch (see _vmap)
# - merge_attn_states: heads ([N, H, D] -> [N, V*H, D], LSE [H, N] -> [V*H, N]).
# A batched ``prefill_tokens_with_context`` (one count per example; the launch
# takes one count): tokens are gathered into one order where every example's
# merged tokens (t < count_v) come first, the launch count is their total, and
# the results are scattered back (a per-token op, so bitwise equal). A batched
# ``output_scale``: one launch per example (_vmap.looped; the kernel takes one
# scale, and dividing the inputs instead would change the rounding).
# - mask_empty_context_lse: heads. Batched start locs: tokens ([H, T] ->
# [H, V*T]) with query starts offset by v*T and context starts shifted so that
# the junction between two examples is a non-empty "request" (untouched, as
# tokens of no request are).


def _merge_rule(size, batched, arrays, static, call):
    op = "merge_attn_states"
    if "output_scale" in batched:
        return looped(size, batched, arrays, static, call)
    if "prefill_tokens_with_context" not in batched:
        return generic_rule(op, MERGE_ATTN_STATES)(size, batched, arrays, static, call)
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
    axes = MASK_EMPTY_CONTEXT_LSE
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


# ---------------------------------------------------------------- the public functions
# each with its custom_vmap rule (vmappable) and, where it has a backward, its custom_vjp
merge_attn_states_backward = vmappable(merge_attn_states_backward, MERGE_ATTN_STATES_BACKWARD)
merge_attn_states = with_vjp(vmappable(merge_attn_states, MERGE_ATTN_STATES, _merge_rule), merge_attn_states_backward)
mask_empty_context_lse = vmappable(mask_empty_context_lse, MASK_EMPTY_CONTEXT_LSE, _mask_rule)

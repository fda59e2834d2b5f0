"""Lightning attention over packed variable-length sequences for JAX (one launch, jit-compatible)."""
from __future__ import annotations

import functools

import jax
import numpy as np

from core_kernels.lightning_attention import (check_varlen_host_data, plan_lightning_attention_varlen,
                                              plan_lightning_attention_varlen_backward)

from core_kernels import _index_check

from core_kernels.op_axes import LIGHTNING_VARLEN, LIGHTNING_VARLEN_BACKWARD

from . import _spmd
from ._executor import info, run_plan, target
from ._index_validation import check_indices, index_validation


def _host(x) -> bool:
    """Whether ``x`` is host data (checking it costs no device sync)."""
    return isinstance(x, np.ndarray) or (
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
        and all(d.platform == "cpu" for d in x.devices()))


def lightning_attention_varlen(q, k, v, ed, cu_seqlens, *, kv_cache=None, slot_idx=None,
                               block_size=256, config=None, validate_indices=None):
    """Lightning attention (prefill) of B sequences packed along the token axis, one launch.

    For each sequence b (tokens cu_seqlens[b] .. cu_seqlens[b + 1] - 1) and head h:
    S_t = exp(-ed[h]) * S_{t-1} + k_t^T v_t, o_t = q_t S_t, starting from
    kv_cache[slot_idx[b]] (or 0), exactly as ``lightning_attention`` on that sequence.

    Args:
        q, k: [T, H, D]; v: [T, H, E]; float32/float16/bfloat16 (one dtype); D, E <= 256.
        ed: [H], [H, 1, 1] or [1, H, 1, 1] float32 decay rates.
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
        config: optional ``LightningVarlenConfig`` (static).
        validate_indices: True checks cu_seqlens and slot_idx before the launch,
            wherever they live (one host transfer; ValueError; traced: ValueError);
            False never; None follows TANDEM_VALIDATE_INDICES (docs/index_validation.md).
    Returns:
        (output [T, H, E] in q's dtype, new kv_cache or, without a cache, the final
        states [B, H, D, E] float32). The new cache is aliased to the kernel's output:
        under jax.jit with kv_cache donated it is updated in place without a copy;
        slots not named keep their bits.
    """
    arrays = dict(q=q, k=k, v=v, ed=ed, cu_seqlens=cu_seqlens)
    if kv_cache is not None:
        arrays["kv_cache"] = kv_cache
    if slot_idx is not None:
        arrays["slot_idx"] = slot_idx
    tgt = target(arrays)
    plan = plan_lightning_attention_varlen(  # validates before the host checks
        tgt, info(q), info(k), info(v), info(ed), info(cu_seqlens),
        None if kv_cache is None else info(kv_cache), None if slot_idx is None else info(slot_idx),
        block_size=block_size, config=config)
    check_varlen_host_data(np.asarray(cu_seqlens) if _host(cu_seqlens) else None, q.shape[0],
                           np.asarray(slot_idx) if slot_idx is not None and _host(slot_idx) else None,
                           0 if kv_cache is None else kv_cache.shape[0])
    if index_validation(validate_indices, cu_seqlens, slot_idx):
        check_indices(_index_check.check_lightning_varlen,
                      dict(cu_seqlens=cu_seqlens, slot_idx=slot_idx), num_tokens=q.shape[0],
                      num_slots=0 if kv_cache is None else kv_cache.shape[0])
    return _spmd.call(LIGHTNING_VARLEN, _varlen, arrays, block_size=block_size, config=config,
                      direct=lambda: run_plan(plan, arrays, tgt))


def _varlen(arrays, *, block_size, config):
    tgt = target(arrays)
    plan = plan_lightning_attention_varlen(
        tgt, *(info(arrays[n]) for n in ("q", "k", "v", "ed", "cu_seqlens")),
        *(None if n not in arrays else info(arrays[n]) for n in ("kv_cache", "slot_idx")),
        block_size=block_size, config=config)
    return run_plan(plan, arrays, tgt)


def lightning_attention_varlen_backward(q, k, v, ed, cu_seqlens, kv, grad_output, grad_kv=None):
    """Gradients (dq, dk [T, H, D], dv [T, H, E] in q's dtype, d ed [H] float32)
    of :func:`lightning_attention_varlen` without a cache, from its inputs, its
    final states ``kv`` [B, H, D, E] and the output gradients (``grad_kv`` may be
    None). The kernels of the torch adapter's backward (bitwise the same); the
    decay's gradient is always computed (exact dq / dk products)."""
    arrays = dict(q=q, k=k, v=v, ed=ed, cu_seqlens=cu_seqlens, kv=kv, grad_output=grad_output)
    if grad_kv is not None:
        arrays["grad_kv"] = grad_kv
    return _spmd.call(LIGHTNING_VARLEN_BACKWARD, _varlen_backward, arrays)


def _varlen_backward(arrays):
    tgt = target(arrays)
    plan = plan_lightning_attention_varlen_backward(
        tgt, *(info(arrays[n]) for n in ("q", "k", "v", "ed", "cu_seqlens", "kv", "grad_output")),
        None if "grad_kv" not in arrays else info(arrays["grad_kv"]))
    return run_plan(plan, arrays, tgt)


def with_vjp(forward, backward):
    """The public varlen prefill: without a cache, ``forward`` under a
    ``jax.custom_vjp`` whose backward is ``backward``; with a cache (state read
    and written through slots) it has no backward. Outside any transformation
    (no traced array) it is ``forward`` itself."""
    @functools.wraps(forward)
    def lightning_attention_varlen(q, k, v, ed, cu_seqlens, *, kv_cache=None, slot_idx=None,
                                   block_size=256, config=None, validate_indices=None):
        kwargs = dict(kv_cache=kv_cache, slot_idx=slot_idx, block_size=block_size, config=config,
                      validate_indices=validate_indices)
        primals = (q, k, v, ed)
        if kv_cache is not None or not any(isinstance(x, jax.core.Tracer) for x in primals):
            return forward(q, k, v, ed, cu_seqlens, **kwargs)

        @jax.custom_vjp
        def varlen(q, k, v, ed, cu):
            return forward(q, k, v, ed, cu, **kwargs)

        def varlen_fwd(q, k, v, ed, cu):
            out = forward(q, k, v, ed, cu, **kwargs)
            return out, (q, k, v, ed, cu, out[1])

        def varlen_bwd(res, grads):
            q, k, v, ed, cu, states = res
            dq, dk, dv, ded = backward(q, k, v, ed, cu, states, grads[0], grads[1])
            return dq, dk, dv, ded.reshape(ed.shape), None

        varlen.defvjp(varlen_fwd, varlen_bwd)
        return varlen(q, k, v, ed, cu_seqlens)

    return lightning_attention_varlen

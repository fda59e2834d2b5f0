"""Lightning attention for JAX: functional prefill and decode, usable under jax.jit."""
from __future__ import annotations

import jax
import numpy as np

from core_kernels import _index_check
from core_kernels._plan import as_int
from core_kernels.lightning_attention import (check_slot_ids, plan_lightning_attention,
                                              plan_linear_decode)

from core_kernels.op_axes import LIGHTNING_ATTENTION, LINEAR_DECODE

from . import _spmd
from ._executor import info, run_plan, target
from ._index_validation import check_indices, index_validation


def lightning_attention(q, k, v, ed, block_size=256, kv_history=None,
                        output_final_state_only=False, *, config=None):
    """Linear attention with per-head decay over a whole sequence (prefill).

    S_t = exp(-ed[h]) * S_{t-1} + k_t^T v_t (S_{-1} = kv_history or 0), o_t = q_t S_t.

    Args:
        q, k: [B, H, N, D]; v: [B, H, N, E]; float32/float16/bfloat16 (one dtype);
            D, E <= 256, any size.
        ed: [H], [H, 1, 1] or [1, H, 1, 1] float32 decay rates.
        block_size: positive int; granularity of the returned per-block states
            (static under jax.jit). Parameters in vLLM's order, by position or
            keyword.
        kv_history: optional [B, H, D, E] starting state, float32 or
            bfloat16/float16 (read into float32).
        output_final_state_only: return only the final state.
        config: optional ``LightningTritonConfig`` (forces the Triton kernel) or
            ``LightningGluonConfig`` (forces the Gluon kernels) overriding the
            planner's choice (static).
    Returns:
        (output [B, H, N, E] in q's dtype, kv float32 [B, H, NB + 1, D, E] with
        NB = ceil(N / block_size), or [B, H, D, E] with output_final_state_only).
    """
    arrays = dict(q=q, k=k, v=v, ed=ed)
    if kv_history is not None:
        arrays["kv_history"] = kv_history
    return _spmd.call(LIGHTNING_ATTENTION, _prefill, arrays, block_size=as_int("block_size", block_size),
                      output_final_state_only=output_final_state_only, config=config)


def _prefill(arrays, *, block_size, output_final_state_only, config):
    tgt = target(arrays)
    history = arrays.get("kv_history")
    plan = plan_lightning_attention(tgt, *(info(arrays[n]) for n in ("q", "k", "v", "ed")),
                                    None if history is None else info(history),
                                    block_size=block_size,
                                    output_final_state_only=output_final_state_only, config=config)
    return run_plan(plan, arrays, tgt)


def linear_decode_forward_triton(q, k, v, kv_caches, slope_rate, slot_idx, BLOCK_SIZE=32, *,
                                 config=None, validate_indices=None):
    """One decode step of lightning attention over a slot-indexed state cache.

    Args:
        q, k: [B, H, 1, D]; v: [B, H, 1, E]; float32/float16/bfloat16.
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
    """
    if isinstance(slot_idx, np.ndarray) or (
            isinstance(slot_idx, jax.Array) and not isinstance(slot_idx, jax.core.Tracer)
            and all(d.platform == "cpu" for d in slot_idx.devices())):
        check_slot_ids(np.asarray(slot_idx), kv_caches.shape[0])
    if index_validation(validate_indices, slot_idx) and kv_caches.ndim == 4:
        check_indices(_index_check.check_linear_decode, dict(slot_idx=slot_idx),
                      num_slots=kv_caches.shape[0])
    as_int("BLOCK_SIZE", BLOCK_SIZE, 1)  # unused (vLLM's signature), but an int all the same
    arrays = dict(q=q, k=k, v=v, kv_caches=kv_caches, slope_rate=slope_rate, slot_idx=slot_idx)
    return _spmd.call(LINEAR_DECODE, _decode, arrays, config=config)


def _decode(arrays, *, config):
    tgt = target(arrays)
    plan = plan_linear_decode(tgt, *(info(arrays[n]) for n in ("q", "k", "v", "kv_caches", "slope_rate",
                                                                "slot_idx")), config=config)
    return run_plan(plan, arrays, tgt)

"""Lightning attention for PyTorch: drop-ins for vLLM's `lightning_attention`
(prefill) and `linear_decode_forward_triton` (decode), with the exact recurrence."""
from __future__ import annotations

from typing import Optional

import torch

from core_kernels.lightning_attention.checks import check_linear_decode
from core_kernels._plan import as_int, decode_config, encode_config
from core_kernels.lightning_attention import (check_slot_ids, plan_lightning_attention,
                                              plan_lightning_attention_backward, plan_linear_decode,
                                              prefill_state_shape)
from core_kernels.lightning_attention.op import LIGHTNING_ATTENTION, LIGHTNING_ATTENTION_BACKWARD, LINEAR_DECODE

from . import _ops_lightning_cp
from ._executor import CallMemo, execute, planned, run_plan
from ._index_validation import check_indices, index_validation
from ._register import custom_op


def _prefill_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ed: torch.Tensor,
                  block_size: int, kv_history: Optional[torch.Tensor],
                  output_final_state_only: bool, config: Optional[str],
                  batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    env = execute(plan_lightning_attention, dict(q=q, k=k, v=v, ed=ed, kv_history=kv_history),
                  block_size=block_size, output_final_state_only=output_final_state_only,
                  config=decode_config(config), batch_invariant=batch_invariant)
    return env["output"], env["kv"]


def _prefill_fake(q, k, v, ed, block_size, kv_history, output_final_state_only, config, batch_invariant=False):
    b, h, n, d = q.shape
    e = v.shape[-1]
    return (q.new_empty((b, h, n, e)),
            q.new_empty(prefill_state_shape(b, h, n, d, e, block_size, output_final_state_only),
                        dtype=torch.float32))


def _backward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ed: torch.Tensor,
                   kv_history: Optional[torch.Tensor], kv: torch.Tensor, grad_output: torch.Tensor,
                   grad_kv: Optional[torch.Tensor], block_size: int, output_final_state_only: bool,
                   need_grad_ed: bool, batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor, torch.Tensor]:
    arrays = dict(q=q, k=k, v=v, ed=ed, kv_history=kv_history, kv=kv, grad_output=grad_output,
                  grad_kv=grad_kv)
    plan, device = planned(plan_lightning_attention_backward, arrays, block_size=block_size,
                           output_final_state_only=output_final_state_only, need_grad_ed=need_grad_ed,
                           batch_invariant=batch_invariant)
    env = run_plan(plan, arrays, device=device)
    return tuple(env[r] for r in plan.results)


def _backward_fake(q, k, v, ed, kv_history, kv, grad_output, grad_kv, *options):
    b, h, n, d = q.shape
    e = v.shape[-1]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty((b, h, d, e), dtype=torch.float32), q.new_empty((h,), dtype=torch.float32))


_backward_op = custom_op("lightning_attention_backward", _backward_impl, fake=_backward_fake,
                         axes=LIGHTNING_ATTENTION_BACKWARD)


def _setup_context(ctx, inputs, output):
    q, k, v, ed, block_size, kv_history, final_only, _, *invariant = inputs
    batch_invariant = bool(invariant and invariant[0])
    ctx.save_for_backward(q, k, v, ed, kv_history, output[1])
    ctx.options = (block_size, final_only, batch_invariant)
    ctx.history_dtype = None if kv_history is None else kv_history.dtype


def _backward(ctx, grad_output, grad_kv):
    q, k, v, ed, kv_history, kv = ctx.saved_tensors
    block_size, final_only, batch_invariant = ctx.options
    # NOTE: the kernels read grad_output with a unit last stride and grad_kv
    # contiguous; autograd may hand over expanded or permuted gradients
    grad_output = q.new_zeros((*q.shape[:3], v.shape[-1])) if grad_output is None else grad_output.contiguous()
    grad_kv = None if grad_kv is None else grad_kv.contiguous()
    dq, dk, dv, dhist, ded = _backward_op(q, k, v, ed, kv_history, kv, grad_output, grad_kv,
                                          block_size, final_only, bool(ctx.needs_input_grad[3]), batch_invariant)
    if kv_history is None:
        dhist = None
    else:
        dhist = dhist.to(ctx.history_dtype)
    ded = ded.reshape(ed.shape) if ctx.needs_input_grad[3] else None
    return dq, dk, dv, ded, None, dhist, None, None, None


_prefill_op = custom_op("lightning_attention", _prefill_impl, fake=_prefill_fake,
                        autograd=(_backward, _setup_context), axes=LIGHTNING_ATTENTION)


_PREFILL_MEMO = CallMemo(("q", "k", "v", "ed", "kv_history"))


def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ed: torch.Tensor,
                        block_size: int = 256, kv_history: Optional[torch.Tensor] = None,
                        output_final_state_only: bool = False, *,
                        config=None, batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear attention with per-head decay over a whole sequence (prefill).

    S_t = exp(-ed[h]) * S_{t-1} + k_t^T v_t (S_{-1} = kv_history or 0), o_t = q_t S_t.

    Args:
        q, k: [B, H, N, D]; v: [B, H, N, E]; float32/float16/bfloat16 (one dtype),
            innermost dim contiguous, other strides free. D, E <= 256, any size.
        ed: [H], [H, 1, 1] (MiniMax's slope tensor, as vLLM's callers pass it)
            or [1, H, 1, 1] float32 decay rates s_h >= 0, any strides.
        block_size: positive int; granularity of the returned per-block states
            (vLLM's callers pass it by keyword, vLLM's tests positionally).
        kv_history: optional [B, H, D, E] starting state (vLLM's MiniMax
            layer passes one slot reshaped to [1, H, D, E]); float32, or
            bfloat16/float16 where the model keeps its state in the model dtype
            (read into float32); never modified.
        output_final_state_only: return only the final state (no per-block states
            are written).
        config: optional ``core_kernels.lightning_attention.LightningTritonConfig``
            (forces the Triton kernel; e.g. ``dot_precision="ieee"`` for exact fp32
            products) or ``LightningGluonConfig`` (forces the Gluon kernels; ValueError
            where they do not apply) overriding the planner's choice.
        batch_invariant: True makes each (b, h) row's result, and its gradients,
            independent of which other rows share the call (and of the GPU's
            size): one call with H heads equals two with H/2, bit for bit, as
            do batch halves (sharded runs equal unsharded ones). Rows are cut
            into chained-scan segments every 8192 tokens instead of by the grid,
            which is slower where few rows share a GPU (docs/composability.md, "Batch invariance").
    Returns:
        (output [B, H, N, E] in q's dtype, kv float32): kv is [B, H, NB + 1, D, E]
        with NB = ceil(N / block_size), kv[:, :, i] the state before token
        i * block_size and kv[:, :, NB] the final state; or [B, H, D, E] (final
        state) with output_final_state_only.
    Accumulation and state are fp32; on the GPU fp32/fp16 products run in tf32
    and bf16 products in bf16. CPU tensors run under Triton's interpreter on a
    machine without a GPU.

    Transforms: eager, ``torch.compile(fullgraph=True)``, CUDA graphs (no host sync),
    DTensor (sharded over batch or heads) and autograd: ``loss.backward()`` gives
    the gradients of q, k, v, ed and kv_history (deterministic backward kernels;
    the decay's gradient only when ed requires grad).

    Example::

        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ed = torch.rand(H, device="cuda")
        o, kv = lightning_attention(q, k, v, ed, block_size=256)   # kv [B, H, NB + 1, D, D]
        o, final = lightning_attention(q, k, v, ed, output_final_state_only=True)

    See docs/ops/lightning_attention.md for the recurrence, numerics and tuning.
    """
    if type(q) is not torch.Tensor and _ops_lightning_cp.sequence_sharded(q):  # DTensor Shard(2): context parallel
        result = _ops_lightning_cp.dtensor_call(q, k, v, ed, block_size, kv_history, output_final_state_only, config)
        if result is not None:
            return result
    tensors, scalars = (q, k, v, ed, kv_history), (block_size, output_final_state_only, config, batch_invariant)
    env = _PREFILL_MEMO.lookup(tensors, scalars, False)
    if env is not None:
        return env["output"], env["kv"]
    try:
        result = _prefill_op(q, k, v, ed, as_int("block_size", block_size), kv_history,
                             output_final_state_only, encode_config(config), bool(batch_invariant))
    except BaseException:
        _PREFILL_MEMO.abandon()
        raise
    _PREFILL_MEMO.commit()
    return result


def _decode_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_caches: torch.Tensor,
                 slope_rate: torch.Tensor, slot_idx: torch.Tensor, config: Optional[str]) -> torch.Tensor:
    check = None
    if not getattr(slot_idx, "is_cuda", True):
        def check(plan, device):
            if device.type == "cpu":  # host data: checking costs no device sync
                check_slot_ids(slot_idx.numpy(), kv_caches.shape[0])
    return execute(plan_linear_decode,
                   dict(q=q, k=k, v=v, kv_caches=kv_caches, slope_rate=slope_rate, slot_idx=slot_idx),
                   None, check, config=decode_config(config))["output"]


def _decode_fake(q, k, v, kv_caches, slope_rate, slot_idx, config):
    return q.new_empty((q.shape[0], q.shape[1] * v.shape[-1]))


_decode_op = custom_op("linear_decode_forward_triton", _decode_impl,
                       mutates_args=("kv_caches",), fake=_decode_fake,
                       axes=LINEAR_DECODE)


_DECODE_MEMO = CallMemo(("q", "k", "v", "kv_caches", "slope_rate", "slot_idx"), written=("kv_caches",))


def linear_decode_forward_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 kv_caches: torch.Tensor, slope_rate: torch.Tensor,
                                 slot_idx: torch.Tensor, BLOCK_SIZE: int = 32, *,
                                 config=None, validate_indices=None) -> torch.Tensor:
    """One decode step of lightning attention over a slot-indexed state cache.

    Args:
        q, k: [B, H, 1, D]; v: [B, H, 1, E] (E = D in the models); float32/float16/
            bfloat16, innermost dim contiguous, other strides free.
        kv_caches: [num_slots, H, D, E] float32, any strides. Updated in place:
            kv_caches[s, h] = exp(-slope_rate[h]) * kv_caches[s, h] + k^T v for
            s = slot_idx[b]; no other slot is touched. bfloat16/float16 caches
            (vLLM's MiniMax layer keeps the state in the model dtype) are updated
            in float32 and stored rounded; the output uses the unrounded state.
        slope_rate: [H], [H, 1, 1] (vLLM's MiniMax layer) or [1, H, 1, 1]
            float32, any strides.
        slot_idx: [B] int32/int64; -1 marks a padding row (output 0, no cache
            write). Ids outside [-1, num_slots) raise ValueError when slot_idx is
            on the host; on the GPU (no sync) such a row's output is NaN and no
            cache slot is touched.
        BLOCK_SIZE: accepted for vLLM compatibility, by position (vLLM's MiniMax
            layer passes 32 positionally) or keyword; the tiling is the planner's.
        config: optional ``core_kernels.lightning_attention.LightningDecodeConfig``
            overriding the planner's tiling.
        validate_indices: True checks slot_idx before the launch, wherever it lives
            (ids in [-1, num_slots), no non-negative id twice: duplicates race on
            the GPU; one host sync; ValueError); False never; None (default)
            follows TANDEM_VALIDATE_INDICES (docs/index_validation.md). Host
            slot ids are range-checked either way.
    Returns:
        output [B, H * E] in q's dtype, o = q S_new (``kv_caches`` is updated in place).

    Transforms: eager, ``torch.compile(fullgraph=True)``, CUDA graphs (no host sync
    unless validating) and DTensor (sharded over heads). No backward: a call that
    needs one raises RuntimeError.

    Example::

        q, k, v = (torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        kv_caches = torch.zeros(num_slots, H, D, D, device="cuda")
        slot_idx = torch.arange(B, device="cuda")
        o = linear_decode_forward_triton(q, k, v, kv_caches, slope_rate, slot_idx)  # [B, H * D]

    See docs/ops/lightning_attention.md.
    """
    tensors = (q, k, v, kv_caches, slope_rate, slot_idx)
    env = _DECODE_MEMO.lookup(tensors, (BLOCK_SIZE, config), validate_indices)
    if env is not None:
        return env["output"]
    try:
        if index_validation(validate_indices, slot_idx) and isinstance(kv_caches, torch.Tensor) \
                and kv_caches.dim() == 4:
            check_indices(check_linear_decode, dict(slot_idx=slot_idx),
                          num_slots=kv_caches.shape[0])
        as_int("BLOCK_SIZE", BLOCK_SIZE, 1)  # unused (vLLM's signature), but an int all the same
        out = _decode_op(q, k, v, kv_caches, slope_rate, slot_idx, encode_config(config))
    except BaseException:
        _DECODE_MEMO.abandon()
        raise
    _DECODE_MEMO.commit()
    return out

"""Lightning attention over packed variable-length sequences for PyTorch (one launch)."""
from __future__ import annotations

from typing import Optional

import torch

from core_kernels._plan import decode_config, encode_config
from core_kernels.lightning_attention import (check_varlen_host_data, plan_lightning_attention_varlen,
                                              plan_lightning_attention_varlen_backward)

from core_kernels.lightning_attention.checks import check_lightning_varlen
from core_kernels.lightning_attention.op import (LIGHTNING_VARLEN, LIGHTNING_VARLEN_BACKWARD,
                                                LIGHTNING_VARLEN_HISTORY)

from ._executor import CallMemo, execute, planned, run_plan
from ._index_validation import check_indices, index_validation
from ._register import custom_op


def _run(q, k, v, ed, cu_seqlens, kv_cache, slot_idx, block_size, config, batch_invariant=False):
    tensors = dict(q=q, k=k, v=v, ed=ed, cu_seqlens=cu_seqlens, kv_cache=kv_cache, slot_idx=slot_idx)
    check = None
    if not getattr(cu_seqlens, "is_cuda", True):
        def check(plan, device):
            if device.type == "cpu":  # host data: checking costs no device sync
                check_varlen_host_data(cu_seqlens.numpy(), q.shape[0],
                                       None if slot_idx is None else slot_idx.numpy(),
                                       0 if kv_cache is None else kv_cache.shape[0])
    return execute(plan_lightning_attention_varlen, tensors, None, check, block_size=block_size,
                   config=decode_config(config), batch_invariant=batch_invariant)


def _states_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ed: torch.Tensor,
                 cu_seqlens: torch.Tensor, block_size: int,
                 config: Optional[str], batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    env = _run(q, k, v, ed, cu_seqlens, None, None, block_size, config, batch_invariant)
    return env["output"], env["states"]


def _states_fake(q, k, v, ed, cu_seqlens, block_size, config, batch_invariant=False):
    t, h, d = q.shape
    e = v.shape[-1]
    return q.new_empty((t, h, e)), q.new_empty((cu_seqlens.shape[0] - 1, h, d, e), dtype=torch.float32)


def _cache_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ed: torch.Tensor,
                cu_seqlens: torch.Tensor, kv_cache: torch.Tensor, slot_idx: torch.Tensor,
                block_size: int, config: Optional[str], batch_invariant: bool = False) -> torch.Tensor:
    return _run(q, k, v, ed, cu_seqlens, kv_cache, slot_idx, block_size, config, batch_invariant)["output"]


def _cache_fake(q, k, v, ed, cu_seqlens, kv_cache, slot_idx, block_size, config, batch_invariant=False):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))


def _backward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ed: torch.Tensor,
                   cu_seqlens: torch.Tensor, kv: torch.Tensor, grad_output: torch.Tensor,
                   grad_kv: Optional[torch.Tensor], kv_history: Optional[torch.Tensor], need_grad_ed: bool,
                   batch_invariant: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    tensors = dict(q=q, k=k, v=v, ed=ed, cu_seqlens=cu_seqlens, kv=kv, grad_output=grad_output,
                   grad_kv=grad_kv, kv_history=kv_history)
    plan, device = planned(plan_lightning_attention_varlen_backward, tensors, need_grad_ed=need_grad_ed,
                           batch_invariant=batch_invariant)
    env = run_plan(plan, tensors, device=device)
    return tuple(env[r] for r in plan.results)


def _backward_fake(q, k, v, ed, cu_seqlens, kv, grad_output, grad_kv, kv_history, need_grad_ed,
                   batch_invariant=False):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty((q.shape[1],), dtype=torch.float32), torch.empty_like(kv))


_backward_op = custom_op("lightning_attention_varlen_backward", _backward_impl, fake=_backward_fake,
                         axes=LIGHTNING_VARLEN_BACKWARD)


def _invariant(inputs, at: int) -> bool:
    """The batch_invariant argument of a forward's ``inputs`` (schema default False)."""
    return bool(inputs[at]) if len(inputs) > at else False


def _setup_context(ctx, inputs, output):
    q, k, v, ed, cu_seqlens, *_ = inputs
    ctx.save_for_backward(q, k, v, ed, cu_seqlens, output[1])
    ctx.batch_invariant = _invariant(inputs, 7)


def _gradients(ctx, q, k, v, ed, cu_seqlens, states, kv_history, grad_output, grad_states):
    # NOTE: the kernels read the gradients with a unit last stride / contiguous
    grad_output = q.new_zeros((*q.shape[:2], v.shape[-1])) if grad_output is None else grad_output.contiguous()
    grad_states = None if grad_states is None else grad_states.contiguous()
    dq, dk, dv, ded, dhist = _backward_op(q, k, v, ed, cu_seqlens, states, grad_output, grad_states,
                                          kv_history, bool(ctx.needs_input_grad[3]), ctx.batch_invariant)
    return dq, dk, dv, ded.reshape(ed.shape) if ctx.needs_input_grad[3] else None, dhist


def _backward(ctx, grad_output, grad_states):
    q, k, v, ed, cu_seqlens, states = ctx.saved_tensors
    dq, dk, dv, ded, _ = _gradients(ctx, q, k, v, ed, cu_seqlens, states, None, grad_output, grad_states)
    return dq, dk, dv, ded, None, None, None, None


def _history_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ed: torch.Tensor,
                  cu_seqlens: torch.Tensor, kv_history: torch.Tensor, block_size: int,
                  config: Optional[str], batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b from kv_history[b]: the cache kernels over a copy of the
    history with slot b for sequence b (the copy ends as the final states)."""
    states = kv_history.to(torch.float32, copy=True)
    slots = torch.arange(cu_seqlens.shape[0] - 1, dtype=torch.int32, device=cu_seqlens.device)
    out = _run(q, k, v, ed, cu_seqlens, states, slots, block_size, config, batch_invariant)["output"]
    return out, states


def _history_fake(q, k, v, ed, cu_seqlens, kv_history, block_size, config, batch_invariant=False):
    return _states_fake(q, k, v, ed, cu_seqlens, block_size, config)


def _history_setup_context(ctx, inputs, output):
    q, k, v, ed, cu_seqlens, kv_history, *_ = inputs
    ctx.save_for_backward(q, k, v, ed, cu_seqlens, kv_history, output[1])
    ctx.batch_invariant = _invariant(inputs, 8)


def _history_backward(ctx, grad_output, grad_states):
    q, k, v, ed, cu_seqlens, kv_history, states = ctx.saved_tensors
    dq, dk, dv, ded, dhist = _gradients(ctx, q, k, v, ed, cu_seqlens, states, kv_history.float().contiguous(),
                                        grad_output, grad_states)
    return dq, dk, dv, ded, None, dhist.to(kv_history.dtype), None, None, None


_history_op = custom_op("lightning_attention_varlen_history", _history_impl, fake=_history_fake,
                        autograd=(_history_backward, _history_setup_context),
                        axes=LIGHTNING_VARLEN_HISTORY)


def _cache_with_grad(q, k, v, ed, cu_seqlens, kv_cache, slot_idx, block_size, config, batch_invariant):
    """The cache form under autograd: each sequence's starting state gathered
    from its slot (zero for -1), the history op, and the final states copied
    back into kv_cache in place (named slots only), all tracked by autograd.
    NOTE: the copy back goes through a copy of the cache with one spare slot
    that absorbs the -1 rows: no host sync, at the cost of one cache copy."""
    slot = slot_idx.long()
    named = (slot >= 0).to(kv_cache.dtype).view(-1, 1, 1, 1)
    hist = kv_cache.index_select(0, slot.clamp(min=0)) * named
    out, final = _history_op(q, k, v, ed, cu_seqlens, hist, block_size, config, batch_invariant)
    spare = torch.cat([kv_cache, kv_cache.new_zeros((1, *kv_cache.shape[1:]))])
    rows = torch.where(slot >= 0, slot, kv_cache.shape[0])
    spare = spare.index_put((rows,), final.to(kv_cache.dtype))
    kv_cache.copy_(spare[:kv_cache.shape[0]])
    return out, kv_cache


_states_op = custom_op("lightning_attention_varlen", _states_impl, fake=_states_fake,
                       autograd=(_backward, _setup_context), axes=LIGHTNING_VARLEN)
_cache_op = custom_op("lightning_attention_varlen_cache", _cache_impl, mutates_args=("kv_cache",),
                      fake=_cache_fake, axes=LIGHTNING_VARLEN)


_MEMO = CallMemo(("q", "k", "v", "ed", "cu_seqlens", "kv_cache", "slot_idx"), written=("kv_cache",))


def lightning_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ed: torch.Tensor,
                               cu_seqlens: torch.Tensor, *, kv_cache: Optional[torch.Tensor] = None,
                               slot_idx: Optional[torch.Tensor] = None, block_size: int = 256,
                               config=None, validate_indices=None,
                               batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Lightning attention (prefill) of B sequences packed along the token axis, one launch.

    For each sequence b (tokens cu_seqlens[b] .. cu_seqlens[b + 1] - 1) and head h:
    S_t = exp(-ed[h]) * S_{t-1} + k_t^T v_t, o_t = q_t S_t, starting from
    kv_cache[slot_idx[b]] (or 0), exactly as ``lightning_attention`` on that sequence.

    Args:
        q, k: [T, H, D]; v: [T, H, E]; float32/float16/bfloat16 (one dtype), innermost
            dim contiguous, other strides free. D, E <= 256, any size.
        ed: [H], [H, 1, 1] or [1, H, 1, 1] float32 decay rates s_h >= 0.
        cu_seqlens: [B + 1] int32/int64 on q's device: cu_seqlens[0] = 0, non-decreasing,
            cu_seqlens[B] = T; sequences may be empty. Checked (ValueError) when on the
            host; on the GPU (no sync) an invalid one is undefined behaviour.
        kv_cache: optional [num_slots, H, D, E] float32 state cache (innermost dim
            contiguous). Updated in place: sequence b starts from kv_cache[slot_idx[b]]
            and its final state is written there; slots not named are untouched, bit
            for bit. Needs slot_idx. With grad mode on and q, k, v, ed or kv_cache
            requiring grad, the call is differentiable: the starting states are
            gathered, the history op runs and the final states are copied back in
            place (one cache copy; kv_cache must not be a leaf requiring grad).
        slot_idx: [B] int32/int64 slot per sequence; -1 starts from zero and writes
            nothing. On the host, ids outside [-1, num_slots) and duplicate non-negative
            ids raise ValueError; on the GPU (no sync) duplicates are undefined and an
            out-of-range id gives that sequence NaN outputs and touches no slot.
        block_size: positive int, accepted for symmetry with ``lightning_attention``;
            only final states are returned, so it does not change the result.
        config: optional ``core_kernels.lightning_attention.LightningVarlenConfig``
            (forces the Triton kernel, its tiling and segmentation) or
            ``LightningVarlenGluonConfig`` (forces the Gluon kernels; ValueError where
            they do not apply), overriding the planner's choice.
        validate_indices: True checks cu_seqlens and slot_idx before the launch,
            wherever they live (one host sync; ValueError); False never; None
            (default) follows TANDEM_VALIDATE_INDICES (docs/index_validation.md).
        batch_invariant: True makes each sequence's result, and its gradients,
            independent of the other sequences and heads of the call and of the
            GPU's size (its packing offset included): no sequence is cut into
            chained-scan segments, so a batch of few long sequences with few
            heads is slower (docs/composability.md, "Batch invariance").
    Returns:
        (output [T, H, E] in q's dtype, kv_cache (the argument, updated) or, without
        a cache, the final states [B, H, D, E] float32; every sequence then starts from zero).

    Transforms: one kernel launch whatever the lengths (no host sync unless
    validating): eager, ``torch.compile(fullgraph=True)``, CUDA graphs, DTensor
    (sharded over heads) and autograd (gradients of q, k, v, ed and kv_cache; see
    kv_cache above). CPU tensors run under Triton's interpreter on a machine without a GPU.

    Example::

        # sequences of 5, 0 and 3 tokens; slots 2, none (-1) and 0 of a 4-slot cache
        q, k, v = (torch.randn(8, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cu_seqlens = torch.tensor([0, 5, 5, 8], device="cuda", dtype=torch.int32)
        kv_cache = torch.zeros(4, H, D, D, device="cuda")
        slot_idx = torch.tensor([2, -1, 0], device="cuda", dtype=torch.int32)
        o, kv_cache = lightning_attention_varlen(q, k, v, ed, cu_seqlens, kv_cache=kv_cache,
                                                 slot_idx=slot_idx)

    See docs/ops/lightning_attention_varlen.md for the worked example and how it runs.
    """
    tensors = (q, k, v, ed, cu_seqlens, kv_cache, slot_idx)
    env = _MEMO.lookup(tensors, (block_size, config, batch_invariant), validate_indices)
    if env is not None:  # a cache form when kv_cache is given (the entry's pattern of absent tensors)
        return env["output"], env["states"] if kv_cache is None else kv_cache
    try:
        result = _varlen(q, k, v, ed, cu_seqlens, kv_cache, slot_idx, block_size, config, validate_indices,
                         bool(batch_invariant))
    except BaseException:
        _MEMO.abandon()
        raise
    _MEMO.commit()  # (a call that went through autograd made no plain execute: not kept)
    return result


def _varlen(q, k, v, ed, cu_seqlens, kv_cache, slot_idx, block_size, config, validate_indices, invariant):
    """lightning_attention_varlen's regular path."""
    if index_validation(validate_indices, cu_seqlens, slot_idx) and isinstance(q, torch.Tensor) \
            and q.dim() == 3:
        check_indices(check_lightning_varlen,
                      dict(cu_seqlens=cu_seqlens, slot_idx=slot_idx), num_tokens=q.shape[0],
                      num_slots=kv_cache.shape[0] if isinstance(kv_cache, torch.Tensor) else 0)
    if kv_cache is None and slot_idx is None:
        return _states_op(q, k, v, ed, cu_seqlens, block_size, encode_config(config), invariant)
    if kv_cache is None or slot_idx is None:  # the planner's error, before any launch
        _run(q, k, v, ed, cu_seqlens, kv_cache, slot_idx, block_size, encode_config(config))
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                       for x in (q, k, v, ed, kv_cache)):
        return _cache_with_grad(q, k, v, ed, cu_seqlens, kv_cache, slot_idx, block_size, encode_config(config),
                                invariant)
    out = _cache_op(q, k, v, ed, cu_seqlens, kv_cache, slot_idx, block_size, encode_config(config), invariant)
    return out, kv_cache

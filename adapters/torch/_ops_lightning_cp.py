"""Context-parallel lightning attention for PyTorch: q, k, v split along the
sequence over the ranks of a process group, one all-gather of [B, H, D, E]
shard states through torch.distributed (core_kernels/lightning_attention/cp_plan.py
has the scheme).

- ``lightning_attention_cp``: the local shards and a process group;
- ``lightning_attention`` with DTensors whose q is ``Shard(2)`` on one mesh
  dimension (final state only) comes here (``dtensor_call``) instead of
  DTensor's sharding rules (which would gather the sequence).
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.distributed as dist

from core_kernels._plan import as_int, encode_config
from core_kernels.lightning_attention.cp_plan import plan_lightning_cp_compose, plan_lightning_cp_state
from core_kernels.lightning_attention.op import LIGHTNING_CP_COMPOSE, LIGHTNING_CP_STATE

from ._executor import execute
from ._register import OPS, custom_op


def _state_impl(k: torch.Tensor, v: torch.Tensor, ed: torch.Tensor, reverse: bool) -> torch.Tensor:
    return execute(plan_lightning_cp_state, dict(k=k, v=v, ed=ed), reverse=reverse)["state"]


def _compose_impl(states: torch.Tensor, ed: torch.Tensor, rank: torch.Tensor, init: Optional[torch.Tensor],
                  shard_len: int, reverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    env = execute(plan_lightning_cp_compose, dict(states=states, ed=ed, rank=rank, init=init),
                  shard_len=shard_len, reverse=reverse)
    return env["prefix"], env["total"]


_state_op = custom_op("lightning_cp_state", _state_impl, axes=LIGHTNING_CP_STATE,
                      fake=lambda k, v, ed, reverse: k.new_empty((*k.shape[:2], k.shape[3], v.shape[3]),
                                                                 dtype=torch.float32))
_compose_op = custom_op("lightning_cp_compose", _compose_impl, axes=LIGHTNING_CP_COMPOSE,
                        fake=lambda states, *args: (states.new_empty(states.shape[1:]),
                                                    states.new_empty(states.shape[1:])))


# torch.distributed's all-gather into one tensor (all_gather_into_tensor before torch 2.13)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """[R, *x.shape]: x of every rank of ``group``, in rank order."""
    world = dist.get_world_size(group)
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))   # the concatenation along dim 0 (gloo's form)
    _all_gather(out, x.contiguous(), group=group)
    return out.view(world, *x.shape)


_RANKS = {}


def _rank_tensor(group, device) -> torch.Tensor:
    """This rank's index in ``group`` as a [1] int32 tensor on ``device`` (kept)."""
    key = (id(group), dist.get_rank(group), device)
    t = _RANKS.get(key)
    if t is None:
        t = _RANKS[key] = torch.tensor([dist.get_rank(group)], dtype=torch.int32, device=device)
    return t


class _ContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ed, kv_history, group, block_size, config):
        rank = _rank_tensor(group, q.device)
        states = _gather(_state_op(k, v, ed, False), group)                    # [R, B, H, D, E]
        s_in, final = _compose_op(states, ed, rank, kv_history, q.shape[2], False)
        o, _ = OPS["lightning_attention"](q, k, v, ed, block_size, s_in, True, config)
        ctx.save_for_backward(q, k, v, ed, kv_history, s_in)
        ctx.options = (group, block_size)
        return o, final

    @staticmethod
    def backward(ctx, grad_o, grad_final):
        q, k, v, ed, kv_history, s_in = ctx.saved_tensors
        group, block_size = ctx.options
        grad_o = q.new_zeros((*q.shape[:3], v.shape[-1])) if grad_o is None else grad_o.contiguous()
        grad_final = None if grad_final is None else grad_final.contiguous()
        own = _gather(_state_op(q, grad_o, ed, True), group)
        g_end, d_hist = _compose_op(own, ed, _rank_tensor(group, q.device), grad_final, q.shape[2], True)
        need_ed = bool(ctx.needs_input_grad[3])
        dq, dk, dv, _, ded = OPS["lightning_attention_backward"](q, k, v, ed, s_in, g_end, grad_o, g_end,
                                                                 block_size, True, need_ed)
        if need_ed:  # each rank's share, summed in rank order (the same bits on every rank)
            ded = _gather(ded, group).sum(0).reshape(ed.shape)
        if kv_history is None:
            d_hist = None
        else:
            d_hist = d_hist.to(kv_history.dtype)
        return dq, dk, dv, ded if need_ed else None, d_hist, None, None, None


def lightning_attention_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ed: torch.Tensor,
                           kv_history: Optional[torch.Tensor] = None, *, group=None, block_size: int = 256,
                           config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lightning attention over a sequence split into equal shards over the
    ranks of ``group`` (context parallelism).

    Each rank passes its shard: q, k [B, H, L, D], v [B, H, L, E] (tokens
    r * L .. r * L + L - 1 on the rank of index r in ``group``), ed and
    kv_history as :func:`lightning_attention`'s (the same on every rank).
    Returns (output [B, H, L, E]: this shard's outputs of the whole sequence;
    the final state [B, H, D, E] float32 of the whole sequence, the same on
    every rank). One collective: ``all_gather_into_tensor`` of the [B, H, D, E]
    shard states (and of their gradients in the backward, plus one of [H] when
    ed requires grad).

    Args:
        group: the process group (None: the default group).
        block_size: accepted for symmetry with lightning_attention (only the
            final state is returned).
        config: as lightning_attention's, for the prefill of each shard.

    Autograd: dq, dk, dv of the shard, d kv_history and d ed (the same on every
    rank). Deterministic; within fp32 rounding of the one-device call.
    """
    group = group if group is not None else dist.group.WORLD
    block_size = as_int("block_size", block_size, 1)
    return _ContextParallel.apply(q, k, v, ed, kv_history, group, block_size, encode_config(config))


# ---------------------------------------------------------------- DTensor
def sequence_sharded(q) -> bool:
    """Whether ``q`` is a DTensor sharded along its sequence (dimension 2)."""
    tensor = sys.modules.get("torch.distributed.tensor")
    if tensor is None or not isinstance(q, tensor.DTensor):
        return False
    return any(_is_shard(p, 2, q.ndim) for p in q.placements)


def _is_shard(p, dim, ndim) -> bool:
    from torch.distributed.tensor import Shard
    return type(p) is Shard and p.dim % ndim == dim


def dtensor_call(q, k, v, ed, block_size, kv_history, output_final_state_only, config):
    """lightning_attention over DTensors with q sharded along the sequence, or
    None where this path does not apply (the caller then takes DTensor's own
    rules, which gather the sequence): per-block states requested, k / v
    placed unlike q, the sequence split over more than one mesh dimension or
    unevenly, or ed / kv_history sharded along the sequence's mesh dimension.
    Other mesh dimensions may shard the batch or the heads (every array's
    local block is then what the local call needs)."""
    from torch.distributed.tensor import DTensor, Replicate
    if not output_final_state_only or q.ndim != 4:
        return None
    mesh, places = q.device_mesh, tuple(q.placements)
    seq_dims = [i for i, p in enumerate(places) if _is_shard(p, 2, 4)]
    if len(seq_dims) != 1:
        return None
    dim = seq_dims[0]
    for t in (k, v):
        if not isinstance(t, DTensor) or t.device_mesh != mesh or tuple(t.placements) != places:
            return None
    if q.shape[2] % mesh.size(dim) or v.shape[2] != q.shape[2]:
        return None

    def local(t):
        if t is None or not isinstance(t, DTensor):
            return t
        if t.device_mesh != mesh or type(t.placements[dim]) is not Replicate:
            raise _NotHere
        return t.to_local()

    try:
        ed_l, hist_l = local(ed), local(kv_history)
    except _NotHere:
        return None
    o, final = lightning_attention_cp(q.to_local(), k.to_local(), v.to_local(), ed_l, hist_l,
                                      group=mesh.get_group(dim), block_size=block_size, config=config)
    b, h, n, d = q.shape
    final_places = tuple(Replicate() if i == dim else p for i, p in enumerate(places))
    return _global(o, mesh, places, (b, h, n, v.shape[3])), _global(final, mesh, final_places, (b, h, d, v.shape[3]))


def _global(t, mesh, places, shape):
    from torch.distributed.tensor import DTensor
    stride = tuple(int(torch.tensor(shape[i + 1:]).prod()) for i in range(len(shape)))
    return DTensor.from_local(t, mesh, places, run_check=False, shape=torch.Size(shape), stride=stride)


class _NotHere(Exception):
    pass

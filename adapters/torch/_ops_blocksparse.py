"""Block-sparse varlen attention for PyTorch (a drop-in for vLLM's blocksparse API)."""
from __future__ import annotations

from typing import Optional

import torch

from core_kernels.blocksparse_attention.checks import check_blocksparse_attention
from core_kernels._plan import as_float, as_int, decode_config, encode_config
from core_kernels.blocksparse_attention import (NO_DECODE_CONFIG, BlocksparsePrefillConfig,
                                                plan_blocksparse_attention,
                                                plan_blocksparse_attention_backward,
                                                plan_blocksparse_attention_lse)
from core_kernels.blocksparse_attention.op import (BLOCKSPARSE_VARLEN, BLOCKSPARSE_VARLEN_BACKWARD,
                                                   BLOCKSPARSE_VARLEN_LSE)

from ._executor import CallMemo, execute, planned, run_plan
from ._index_validation import check_indices, index_validation
from ._register import custom_op


def _bsattn_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_k: torch.Tensor,
                 cu_seqlens_q: Optional[torch.Tensor], crow: torch.Tensor, col: torch.Tensor,
                 sm_scale: Optional[float], block_size: int, q_block_size: Optional[int],
                 max_seqlen: Optional[int], config: Optional[str], batch_invariant: bool = False) -> torch.Tensor:
    return execute(plan_blocksparse_attention,
                   dict(q=q, k=k, v=v, cu_seqlens_k=cu_seqlens_k, cu_seqlens_q=cu_seqlens_q, crow=crow, col=col),
                   sm_scale=sm_scale, block_size=block_size, q_block_size=q_block_size,
                   max_seqlen=max_seqlen, config=decode_config(config),
                   batch_invariant=batch_invariant)["output"]


# ---------------------------------------------------------------- autograd
# The backward needs each query row's LSE, which the inference op does not
# compute: a call that needs a gradient runs the functional op
# blocksparse_flash_attn_varlen_fwd_lse (the forward kernel's LSE variant; it has
# the backward) and returns its output.
def _tensors(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col, **more) -> dict:
    tensors = dict(q=q, k=k, v=v, cu_seqlens_k=cu_seqlens_k, crow=crow, col=col, **more)
    if cu_seqlens_q is not None:
        tensors["cu_seqlens_q"] = cu_seqlens_q
    return tensors


def _lse_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_k: torch.Tensor,
              cu_seqlens_q: Optional[torch.Tensor], crow: torch.Tensor, col: torch.Tensor,
              sm_scale: Optional[float], block_size: int, q_block_size: Optional[int],
              max_seqlen: Optional[int], config: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    plan, device = planned(plan_blocksparse_attention_lse,
                           dict(q=q, k=k, v=v, cu_seqlens_k=cu_seqlens_k, cu_seqlens_q=cu_seqlens_q,
                                crow=crow, col=col),
                           sm_scale=sm_scale, block_size=block_size, q_block_size=q_block_size,
                           max_seqlen=max_seqlen, config=decode_config(config))
    env = run_plan(plan, _tensors(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col), None, device)
    return env["output"], env["lse"]


def _lse_fake(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col, *options):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(q.shape[:2], dtype=torch.float32))


def _backward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor,
                   lse: torch.Tensor, grad_output: torch.Tensor, cu_seqlens_k: torch.Tensor,
                   cu_seqlens_q: Optional[torch.Tensor], crow: torch.Tensor, col: torch.Tensor,
                   sm_scale: Optional[float], block_size: int, q_block_size: Optional[int],
                   max_seqlen: Optional[int], config: Optional[str]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan, device = planned(plan_blocksparse_attention_backward,
                           dict(q=q, k=k, v=v, output=output, lse=lse, grad_output=grad_output,
                                cu_seqlens_k=cu_seqlens_k, cu_seqlens_q=cu_seqlens_q, crow=crow, col=col),
                           sm_scale=sm_scale, block_size=block_size, q_block_size=q_block_size,
                           max_seqlen=max_seqlen, config=decode_config(config))
    env = run_plan(plan, _tensors(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col, output=output,
                                  lse=lse, grad_output=grad_output), None, device)
    return tuple(env[r] for r in plan.results)


def _backward_fake(q, k, v, output, lse, grad_output, *rest):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


_backward_op = custom_op("blocksparse_flash_attn_varlen_backward", _backward_impl, fake=_backward_fake,
                         axes=BLOCKSPARSE_VARLEN_BACKWARD)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_k, cu_q, crow, col, sm_scale, block_size, q_block_size, max_seqlen, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_k, cu_q, crow, col)
    ctx.options = (sm_scale, block_size, q_block_size, max_seqlen)
    ctx.mark_non_differentiable(lse)  # an internal result: the public op returns the output only


def _backward(ctx, grad_output, grad_lse):
    q, k, v, out, lse, cu_k, cu_q, crow, col = ctx.saved_tensors
    # NOTE: the kernels read dO with unit stride along D and layout constexpr strides
    # for its rows; an expanded or permuted gradient (a sum()'s) is copied once
    grad_output = grad_output.contiguous()
    dq, dk, dv = _backward_op(q, k, v, out, lse, grad_output, cu_k, cu_q, crow, col, *ctx.options, None)
    return (dq, dk, dv) + (None,) * 9


_lse_op = custom_op("blocksparse_flash_attn_varlen_fwd_lse", _lse_impl, fake=_lse_fake,
                    autograd=(_backward, _setup_context), axes=BLOCKSPARSE_VARLEN_LSE)


def _bsattn_differentiable(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col, sm_scale, block_size,
                           q_block_size, max_seqlen, config, batch_invariant=False):
    """The forward op's call when a gradient is needed: through the LSE op (the
    prefill kernel: batch-invariant as it is)."""
    decoded = decode_config(config)
    if decoded is not None and not isinstance(decoded, BlocksparsePrefillConfig):
        raise ValueError(NO_DECODE_CONFIG + f", got {type(decoded).__name__}")
    return _lse_op(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col, sm_scale, block_size, q_block_size,
                   max_seqlen, config)[0]


_bsattn_op = custom_op("blocksparse_flash_attn_varlen_fwd", _bsattn_impl,
                       fake=lambda q, *args: torch.empty_like(q, memory_format=torch.contiguous_format),
                       differentiable=_bsattn_differentiable, axes=BLOCKSPARSE_VARLEN)


_MEMO = CallMemo(("q", "k", "v", "cu_seqlens_k", "cu_seqlens_q", "crow", "col"))


def blocksparse_flash_attn_varlen_fwd(q, k, v, cu_seqlens_k, cu_seqlens_q, sm_scale, sparse_layout,
                                      *, block_size=64, q_block_size=None, max_seqlen=None, config=None,
                                      validate_indices=None, batch_invariant=False):
    """Causal block-sparse attention over packed (varlen) sequences.

    Args:
        q: [Tq, Hq, D] float16/bfloat16/float32 (D <= 256, any size).
        k, v: [Tk, Hkv, D], q's dtype; Hq % Hkv == 0 (GQA: head h reads h // (Hq / Hkv)).
        cu_seqlens_k: [B + 1] int32 or int64 cumulative key lengths.
        cu_seqlens_q: [B + 1] int32 or int64, or None: decode (one query per sequence) if
            Tq == B, else equal to cu_seqlens_k. Queries are the last q_len
            positions of their sequence.
        sm_scale: float or None (1 / sqrt(D)).
        sparse_layout: (crow [H, NB + 1], col [H, nnz]) int32 or int64 on q's device,
            H = Hq or 1; per head, columns ascending, the diagonal in every row.
        block_size: the layout's block size (16..256, a power of two).
        q_block_size: a multiple of block_size; a query attends to the union of
            the columns of the layout rows of its q block (exact causal mask).
        max_seqlen: static bound on sequence lengths (default: what the layout covers).
        config: optional kernel variant and tuning, overriding the planner's choice: a
            ``core_kernels.blocksparse_attention`` ``BlocksparsePrefillConfig`` (any batch),
            ``BlocksparseDecodeConfig`` (per-head split decode) or
            ``BlocksparseGroupDecodeConfig`` (GQA-packed split decode); the decode
            variants need a decode-only batch and q_block_size == block_size.
        validate_indices: True checks cu_seqlens_k/q, the layout and max_seqlen
            before the launch (one host sync; ValueError naming the argument); False
            never; None (default) follows TANDEM_VALIDATE_INDICES (docs/index_validation.md).
        batch_invariant: True makes each (sequence, head) row's result independent of
            the other sequences and heads of the call and of the GPU's size. Only
            decode-only batches change: the GQA-packed kernel whenever query heads
            share a KV head, and key splits from the row's bound (pass one
            max_seqlen to calls that must agree); a lone sequence decodes a few
            microseconds slower (docs/composability.md, "Batch invariance").

    Returns:
        [Tq, Hq, D] in q's dtype (a new tensor).

    Transforms: no host synchronisation (unless validating): eager,
    ``torch.compile(fullgraph=True)``, CUDA graphs, DTensor (sharded over heads) and
    autograd. CPU tensors run under Triton's interpreter on a machine without a GPU.

    Autograd: when grad mode is on and q, k or v requires grad, the call runs
    ``tandem_attn::blocksparse_flash_attn_varlen_fwd_lse`` (the prefill kernel,
    also saving each row's LSE; a decode ``config`` is refused with ValueError)
    whose backward (``blocksparse_flash_attn_varlen_backward``, deterministic:
    no atomics) gives dq, dk, dv in q's dtype. No double backward.

    Example::

        # 2 prefill sequences of 100 and 28 tokens, 64-token blocks
        (crow, col), _ = build_sparse_layout(Hq, 128, 64, local_blocks=1, vert_stride=2)
        layout = (torch.tensor(crow, device="cuda"), torch.tensor(col, device="cuda"))
        cu = torch.tensor([0, 100, 128], device="cuda", dtype=torch.int32)
        o = blocksparse_flash_attn_varlen_fwd(q, k, v, cu, cu, None, layout, block_size=64)

    ``build_sparse_layout`` is ``core_kernels.blocksparse_attention.build_sparse_layout``.
    See docs/ops/blocksparse_attention.md for the layout rules (a worked example) and tuning.
    """
    crow, col = sparse_layout
    tensors = (q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col)
    scalars = (sm_scale, block_size, q_block_size, max_seqlen, config, batch_invariant)
    env = _MEMO.lookup(tensors, scalars, validate_indices)
    if env is not None:
        return env["output"]
    try:
        if index_validation(validate_indices, cu_seqlens_k, cu_seqlens_q, crow, col):
            _check_indices(q, k, cu_seqlens_k, cu_seqlens_q, crow, col, block_size, max_seqlen)
        out = _bsattn_op(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col,
                         None if sm_scale is None else as_float("sm_scale", sm_scale, finite=False),
                         as_int("block_size", block_size),
                         None if q_block_size is None else as_int("q_block_size", q_block_size),
                         None if max_seqlen is None else as_int("max_seqlen", max_seqlen),
                         encode_config(config), bool(batch_invariant))
    except BaseException:
        _MEMO.abandon()
        raise
    _MEMO.commit()
    return out


def _check_indices(q, k, cu_seqlens_k, cu_seqlens_q, crow, col, block_size, max_seqlen):
    """Index validation (one host sync); malformed arguments are left to the planner."""
    if not (isinstance(q, torch.Tensor) and q.dim() == 3 and isinstance(k, torch.Tensor)
            and k.dim() == 3):
        return
    check_indices(check_blocksparse_attention,
                  dict(cu_seqlens_k=cu_seqlens_k, cu_seqlens_q=cu_seqlens_q, crow=crow, col=col),
                  num_q_tokens=q.shape[0], num_k_tokens=k.shape[0], block_size=int(block_size),
                  max_seqlen=None if max_seqlen is None else int(max_seqlen))

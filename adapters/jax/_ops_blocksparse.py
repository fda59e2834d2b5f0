"""Block-sparse varlen attention for JAX: functional, works under jax.jit."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from core_kernels.blocksparse_attention.checks import check_blocksparse_attention
from core_kernels._plan import as_float, as_int
from core_kernels.blocksparse_attention import (NO_DECODE_CONFIG, BlocksparsePrefillConfig,
                                                plan_blocksparse_attention,
                                                plan_blocksparse_attention_backward,
                                                plan_blocksparse_attention_lse)

from core_kernels.blocksparse_attention.op import (BLOCKSPARSE_VARLEN, BLOCKSPARSE_VARLEN_BACKWARD,
                                                   BLOCKSPARSE_VARLEN_LSE)

from . import _spmd
from ._vmap import (generic_rule, looped, per_example, pinned, rebase_offsets, stack_along, tile, unstack_along,
                    vmappable)
from ._executor import infos, run_plan, target
from ._index_validation import check_indices, index_validation


def blocksparse_flash_attn_varlen_fwd(q, k, v, cu_seqlens_k, cu_seqlens_q, sm_scale, sparse_layout,
                                      *, block_size=64, q_block_size=None, max_seqlen=None, config=None,
                                      validate_indices=None, batch_invariant=False):
    """Causal block-sparse attention over packed (varlen) sequences.

    For sequence i the queries are the last q_len of its k_len positions (q_len = k_len:
    prefill; q_len = 1: decode; between: prefill over a cached prefix).

    Args:
        q: [Tq, Hq, D] float16/bfloat16/float32 (D <= 256, any size).
        k, v: [Tk, Hkv, D], q's dtype; Hq % Hkv == 0 (GQA: head h reads h // (Hq / Hkv)).
        cu_seqlens_k: [B + 1] int32 or int64 cumulative key lengths (may be traced:
            read on the device, never on the host).
        cu_seqlens_q: [B + 1] int32 or int64, or None: decode (one query per sequence)
            if Tq == B, else equal to cu_seqlens_k.
        sm_scale: Python float (static) or None (1 / sqrt(D)).
        sparse_layout: (crow [H, NB + 1], col [H, nnz]) int32 or int64 arrays (may be
            traced), H = Hq or 1; per head, columns ascending, the diagonal in every row.
            int64 needs jax_enable_x64, else JAX itself makes them int32.
        block_size: the layout's block size (16..256, a power of two; static).
        q_block_size: a multiple of block_size (static); a query attends to the union
            of the columns of the layout rows of its q block (exact causal mask).
        max_seqlen: static bound on sequence lengths (default: what the layout covers).
        config: optional kernel variant and tuning, overriding the planner's choice
            (static): a ``core_kernels.blocksparse_attention`` ``BlocksparsePrefillConfig``
            (any batch), ``BlocksparseDecodeConfig`` (per-head split decode) or
            ``BlocksparseGroupDecodeConfig`` (GQA-packed split decode); the decode
            variants need a decode-only batch and q_block_size == block_size.
        validate_indices: True checks cu_seqlens_k/q, the layout and max_seqlen before
            the launch (one host transfer; ValueError naming the argument; traced
            arrays: ValueError), False never, None follows TANDEM_VALIDATE_INDICES
            (docs/index_validation.md).
        batch_invariant: True makes each (sequence, head) row's result independent of
            the other sequences and heads of the call and of the GPU's size (static).
            Only decode-only batches change: the GQA-packed kernel whenever query
            heads share a KV head, and key splits from the row's bound (pass one
            max_seqlen to calls that must agree).

    Returns:
        [Tq, Hq, D] in q's dtype.

    Transforms: ``jax.jit``, ``jax.vmap`` (one launch: heads, or tokens with a batched
    cu_seqlens_k/q; one per example with the layout batched too), ``jax.grad`` (custom VJP over q, k, v: deterministic
    backward kernels, gradients in q's dtype; a decode ``config`` raises ValueError),
    ``NamedSharding`` over heads and ``shard_map``, ``jax.export`` on a GPU
    (docs/jax_export.md). On the CPU the kernels run under Triton's interpreter.

    Example::

        # 2 prefill sequences of 100 and 28 tokens, 64-token blocks
        (crow, col), _ = build_sparse_layout(Hq, 128, 64, local_blocks=1, vert_stride=2)
        cu = jnp.array([0, 100, 128], jnp.int32)
        o = jax.jit(blocksparse_flash_attn_varlen_fwd, static_argnums=5)(
            q, k, v, cu, cu, None, (jnp.asarray(crow), jnp.asarray(col)))

    ``build_sparse_layout`` is ``core_kernels.blocksparse_attention.build_sparse_layout``.
    See docs/ops/blocksparse_attention.md for the layout rules (a worked example) and tuning.
    """
    arrays = _arrays(q, k, v, cu_seqlens_k, cu_seqlens_q, sparse_layout, block_size, max_seqlen,
                     validate_indices)
    return _spmd.call(BLOCKSPARSE_VARLEN, _blocksparse, arrays, config=config,
                      batch_invariant=bool(batch_invariant),
                      **_options(sm_scale, block_size, q_block_size, max_seqlen))[0]


def _arrays(q, k, v, cu_seqlens_k, cu_seqlens_q, sparse_layout, block_size, max_seqlen,
            validate_indices) -> dict:
    """The op's arrays by name (after the opt-in index validation)."""
    crow, col = (jnp.asarray(x) for x in sparse_layout)
    if index_validation(validate_indices, cu_seqlens_k, cu_seqlens_q, crow, col) \
            and q.ndim == 3 and k.ndim == 3:
        check_indices(check_blocksparse_attention,
                      dict(cu_seqlens_k=cu_seqlens_k, cu_seqlens_q=cu_seqlens_q, crow=crow, col=col),
                      num_q_tokens=q.shape[0], num_k_tokens=k.shape[0], block_size=int(block_size),
                      max_seqlen=None if max_seqlen is None else int(max_seqlen))
    arrays = dict(q=q, k=k, v=v, cu_seqlens_k=cu_seqlens_k, crow=crow, col=col)
    if cu_seqlens_q is not None:
        arrays["cu_seqlens_q"] = cu_seqlens_q
    return arrays


def _options(sm_scale, block_size, q_block_size, max_seqlen) -> dict:
    return dict(sm_scale=None if sm_scale is None else as_float("sm_scale", sm_scale, finite=False),
                block_size=as_int("block_size", block_size),
                q_block_size=None if q_block_size is None else as_int("q_block_size", q_block_size),
                max_seqlen=None if max_seqlen is None else as_int("max_seqlen", max_seqlen))


def _planned(planner, arrays, names, **options):
    tgt = target(arrays)
    plan = planner(tgt, **infos(arrays, *names), **options)
    return run_plan(plan, arrays, tgt)


_FWD_NAMES = ("q", "k", "v", "cu_seqlens_k", "cu_seqlens_q", "crow", "col")


def _blocksparse(arrays, **options):
    return _planned(plan_blocksparse_attention, arrays, _FWD_NAMES, **options)


# ---------------------------------------------------------------- training
def blocksparse_flash_attn_varlen_fwd_lse(q, k, v, cu_seqlens_k, cu_seqlens_q, sm_scale, sparse_layout,
                                          *, block_size=64, q_block_size=None, max_seqlen=None,
                                          config=None, validate_indices=None):
    """The forward a gradient needs: (output [Tq, Hq, D] q's dtype, lse [Tq, Hq]
    float32, the natural-log LSE of each row's scaled scores). Arguments as
    :func:`blocksparse_flash_attn_varlen_fwd`; ``config``: None or a
    BlocksparsePrefillConfig."""
    arrays = _arrays(q, k, v, cu_seqlens_k, cu_seqlens_q, sparse_layout, block_size, max_seqlen,
                     validate_indices)
    return _spmd.call(BLOCKSPARSE_VARLEN_LSE, _blocksparse_lse, arrays, config=config,
                      **_options(sm_scale, block_size, q_block_size, max_seqlen))


def _blocksparse_lse(arrays, **options):
    return _planned(plan_blocksparse_attention_lse, arrays, _FWD_NAMES, **options)


def blocksparse_flash_attn_varlen_backward(q, k, v, output, lse, grad_output, cu_seqlens_k, cu_seqlens_q,
                                           sm_scale, sparse_layout, *, block_size=64, q_block_size=None,
                                           max_seqlen=None, config=None):
    """Gradients (dq [Tq, Hq, D], dk, dv [Tk, Hkv, D], q's dtype) of
    blocksparse_flash_attn_varlen_fwd for the output gradient ``grad_output``
    [Tq, Hq, D] (q's dtype), from the forward's arguments and the ``output`` and
    ``lse`` of :func:`blocksparse_flash_attn_varlen_fwd_lse`. Deterministic.
    ``config``: None or a BlocksparseBackwardConfig."""
    arrays = _arrays(q, k, v, cu_seqlens_k, cu_seqlens_q, sparse_layout, block_size, max_seqlen, False)
    arrays.update(output=output, lse=lse, grad_output=grad_output)
    return _spmd.call(BLOCKSPARSE_VARLEN_BACKWARD, _blocksparse_backward, arrays, config=config,
                      **_options(sm_scale, block_size, q_block_size, max_seqlen))


def _blocksparse_backward(arrays, **options):
    return _planned(plan_blocksparse_attention_backward, arrays,
                    ("q", "k", "v", "output", "lse", "grad_output") + _FWD_NAMES[3:], **options)


def with_vjp(forward, forward_lse, backward):
    """The public op: ``forward`` (with its vmap rule) under a ``jax.custom_vjp``
    whose forward rule runs ``forward_lse`` (saving output and LSE) and whose
    backward runs ``backward`` (both with their vmap rules), as merge_attn_states'
    with_vjp. Outside any transformation (no traced q, k, v) it is ``forward``.
    Differentiating a call with a decode config raises ValueError."""
    @functools.wraps(forward)
    def blocksparse_flash_attn_varlen_fwd(q, k, v, cu_seqlens_k, cu_seqlens_q, sm_scale, sparse_layout,
                                          *, block_size=64, q_block_size=None, max_seqlen=None,
                                          config=None, validate_indices=None, batch_invariant=False):
        if not any(isinstance(x, jax.core.Tracer) for x in (q, k, v)):
            return forward(q, k, v, cu_seqlens_k, cu_seqlens_q, sm_scale, sparse_layout,
                           block_size=block_size, q_block_size=q_block_size, max_seqlen=max_seqlen,
                           config=config, validate_indices=validate_indices, batch_invariant=batch_invariant)
        opts = dict(block_size=block_size, q_block_size=q_block_size, max_seqlen=max_seqlen)

        # the index arrays travel as primal arguments (never closed over: they may be traced)
        @jax.custom_vjp
        def attn(q, k, v, cu_k, cu_q, crow, col):
            return forward(q, k, v, cu_k, cu_q, sm_scale, (crow, col), config=config,
                           validate_indices=validate_indices, batch_invariant=batch_invariant, **opts)

        def attn_fwd(q, k, v, cu_k, cu_q, crow, col):
            if config is not None and not isinstance(config, BlocksparsePrefillConfig):
                raise ValueError(NO_DECODE_CONFIG + f", got {type(config).__name__}")
            out, lse = forward_lse(q, k, v, cu_k, cu_q, sm_scale, (crow, col), config=config,
                                   validate_indices=validate_indices, **opts)
            return out, (q, k, v, out, lse, cu_k, cu_q, crow, col)

        def attn_bwd(res, grad_output):
            q, k, v, out, lse, cu_k, cu_q, crow, col = res
            dq, dk, dv = backward(q, k, v, out, lse, grad_output, cu_k, cu_q, sm_scale, (crow, col),
                                  **opts)
            return dq, dk, dv, None, None, None, None

        attn.defvjp(attn_fwd, attn_bwd)
        crow, col = sparse_layout
        return attn(q, k, v, cu_seqlens_k, cu_seqlens_q, jnp.asarray(crow), jnp.asarray(col))

    return blocksparse_flash_attn_varlen_fwd


# ---------------------------------------------------------------- jax.vmap: one launch (see _vmap)
# - blocksparse_flash_attn_varlen_fwd (and its LSE form and backward): heads (a
# one-head layout stays shared when unbatched, else it is broadcast to every
# query head). Batched cu_seqlens_k / cu_seqlens_q: tokens (_tokens_rule), the
# examples' sequences one after another; with the layout batched too, one launch
# per example (_vmap.looped).


def _blocksparse_config(tgt, infos, kw):
    from core_kernels.blocksparse_attention.plan import choose_config
    if kw.get("config") is not None:
        return kw["config"]
    sm = kw.get("sm_scale")
    qb, ms = kw.get("q_block_size"), kw.get("max_seqlen")
    return choose_config(tgt, **{n: infos.get(n) for n in _FWD_NAMES},
                         sm_scale=None if sm is None else float(sm),
                         block_size=as_int("block_size", kw.get("block_size", 64)),
                         q_block_size=None if qb is None else as_int("q_block_size", qb),
                         max_seqlen=None if ms is None else as_int("max_seqlen", ms),
                         batch_invariant=bool(kw.get("batch_invariant", False)))


def _blocksparse_prepare(size, batched, arrays, label):
    """A one-head layout (homo_head) stays shared when unbatched; batched, it is
    broadcast to every query head of its example."""
    hq = arrays["q"].shape[-2]
    if hq == 1 or any(arrays[n].shape[-2] != 1 for n in ("crow", "col")):
        return arrays, (), batched
    if not batched & {"crow", "col"}:
        return arrays, ("crow", "col"), batched
    arrays = dict(arrays)
    for n in ("crow", "col"):
        x = tile(arrays[n], n in batched, size)
        arrays[n] = jnp.broadcast_to(x, (size, hq, x.shape[-1]))
    return arrays, (), batched | {"crow", "col"}


_CU = {"cu_seqlens_k": "k", "cu_seqlens_q": "q"}  # the offsets and the array whose tokens they count


def _tokens_rule(size, batched, arrays, static, call, pin=None):
    """Batched cu_seqlens: q-token arrays ([Tq, ...]: q, output, lse, grad_output)
    and k-token arrays (k, v) stacked example-major along their tokens, the
    offsets re-based by v * T (each sequence is computed on its own: bitwise the
    per-example calls), the layout shared; results unstacked along the tokens.
    Without cu_seqlens_q the folded batch stays decode-only (Tq = B) or a full
    prefill (Tq = Tk), as each example."""
    if batched & {"crow", "col"}:
        return looped(size, batched, arrays, static, call)
    kwargs = dict(static) if pin is None else pin(dict(static), per_example(arrays, batched))
    folded = {}
    for n, x in arrays.items():
        if x is None or n in ("crow", "col"):
            folded[n] = x
        elif n in _CU:
            folded[n] = rebase_offsets(x, n in batched, size, arrays[_CU[n]].shape[-3])
        else:
            folded[n] = stack_along(x, n in batched, size, 0)
    results = call(**folded, **kwargs)
    if not isinstance(results, (tuple, list)):
        return unstack_along(results, size, 0)
    return tuple(unstack_along(y, size, 0) for y in results)


def _rule(axes, pin=None):
    """Heads (generic), or tokens where an offsets array is batched."""
    heads = generic_rule(axes.name, axes, _blocksparse_prepare, pin)

    def rule(size, batched, arrays, static, call):
        if batched & set(_CU):
            return _tokens_rule(size, batched, arrays, static, call, pin)
        return heads(size, batched, arrays, static, call)
    return rule


# the LSE forward and the backward: their configs do not depend on the batch: nothing to pin
_blocksparse_rule = _rule(BLOCKSPARSE_VARLEN, pinned(_blocksparse_config))


# ---------------------------------------------------------------- the public functions
# each with its custom_vmap rule (vmappable) and, where it has a backward, its custom_vjp
_LAYOUT = {"sparse_layout": ("crow", "col")}  # vmap: the layout's arrays, batched separately
blocksparse_flash_attn_varlen_fwd_lse = vmappable(
    blocksparse_flash_attn_varlen_fwd_lse, BLOCKSPARSE_VARLEN_LSE, _rule(BLOCKSPARSE_VARLEN_LSE), _LAYOUT)
blocksparse_flash_attn_varlen_backward = vmappable(
    blocksparse_flash_attn_varlen_backward, BLOCKSPARSE_VARLEN_BACKWARD,
    _rule(BLOCKSPARSE_VARLEN_BACKWARD), _LAYOUT)
blocksparse_flash_attn_varlen_fwd = with_vjp(
    vmappable(blocksparse_flash_attn_varlen_fwd, BLOCKSPARSE_VARLEN, _blocksparse_rule, _LAYOUT),
    blocksparse_flash_attn_varlen_fwd_lse, blocksparse_flash_attn_varlen_backward)

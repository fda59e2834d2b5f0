"""unified_attention for JAX: functional, works under jax.jit, jax.vmap and
sharding over heads."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from core_kernels._plan import normalize_dtype_name
from core_kernels.unified_attention import check_unified_attention, plan_unified_attention
from core_kernels.unified_attention.checks import check_static
from core_kernels.unified_attention.options import host_options
from core_kernels.unified_attention.op import UNIFIED_ATTENTION

from . import _spmd
from ._executor import infos, is_device_data, run_plan, scale_array, target
from ._index_validation import check_indices, index_validation
from ._vmap import looped, offset_ids, rebase_offsets, stack_along, unstack_along, vmappable

_ARRAYS = ("q", "k", "v", "cu_seqlens_q", "seqused_k", "block_table", "out", "causal_flags",
           "q_descale", "k_descale", "v_descale", "alibi_slopes", "sinks", "output_scale")


def _is_array(x) -> bool:
    """Per-sequence flags: a JAX array, or a host sequence / array of them."""
    return is_device_data(x) or isinstance(x, (list, tuple)) or (isinstance(x, np.ndarray) and x.ndim > 0)


def _descale(name: str, value):
    """A k / v descale: a host number (finite, > 0) as a [1] float32 array; an
    array (1-element or [B, Hkv], float32: the planner checks) as it is."""
    if value is None:
        return None
    if not is_device_data(value) and np.ndim(value) == 0:
        return scale_array(name, value)
    return jnp.asarray(value)


def unified_attention(q, k, v, cu_seqlens_q, seqused_k, block_table, *, max_seqlen_q, max_seqlen_k,
                      softmax_scale, causal=True, window_size=(-1, -1), softcap=0.0, q_descale=None,
                      k_descale=None, v_descale=None, alibi_slopes=None, sinks=None,
                      output_scale=None, use_alibi_sqrt=False, out_dtype=None, out=None, config=None,
                      validate_indices=None):
    """Paged attention of packed new tokens over their KV cache, prefill and decode in one call.

    T = new tokens of all sequences, B = sequences, Hq query heads, Hkv KV heads; any
    D <= 256, any block_size.

    Args:
        q: [T, Hq, D] float32/float16/bfloat16 (or float8_e4m3fn with ``q_descale``):
            sequence b owns rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1.
        k, v: [num_blocks, block_size, Hkv, D] paged cache (vLLM's flash layout; the
            new tokens' K/V already written), q's dtype or float8_e4m3fn / uint8
            holding e4m3 (with ``k_descale`` / ``v_descale``); Hq % Hkv == 0.
        cu_seqlens_q: [B + 1] int32/int64 cumulative query lengths; seqused_k: [B]
            total key lengths (context + new tokens; query i of sequence b sits at
            position seqused_k[b] - qlen_b + i); block_table: [B, max_blocks]
            int32/int64. All may be traced (new values never recompile); entries
            past a sequence's length are never read.
        max_seqlen_q, max_seqlen_k: static ints, bounds on every query length /
            seqused_k (they size the grid and the decode split).
        softmax_scale: static float.
        causal: a static truth value, or a [B] bool array of per-sequence flags
            (may be traced; False: a sequence's queries see all its keys).
        window_size: static (left, right); left >= 0 limits a query at position p to
            keys p - left .. p (non-causal sequences: p - left .. p + left).
        softcap: static; 0 (off) or c > 0: s = c * tanh(s / c) before ALiBi and the mask.
        q_descale: None or a float > 0 / 1-element float32 array (an fp8 q).
        k_descale, v_descale: a float > 0, a 1-element or a [B, Hkv] float32 array
            (an fp8 cache; ignored for a plain cache).
        alibi_slopes: optional [Hq] float (``use_alibi_sqrt``: the sqrt variant).
        sinks: optional [Hq] float logits joining the softmax denominator.
        output_scale: None, or a float > 0 / 1-element float32 array: the output is
            float8_e4m3fn = fp8(clamp(attn / output_scale)).
        out_dtype: the output dtype (default q's, bfloat16 for an fp8 q).
        out: optional [T, Hq, D] array aliased to the result: rows of no sequence
            keep its values (zeros without it), a donated buffer is updated in place.
        config: optional prefill or decode config overriding the planner's choice (static).
        validate_indices: True checks cu_seqlens_q, seqused_k, block_table and the
            max_seqlen bounds against each other and the cache before the launch (one
            host transfer; ValueError naming the argument; traced arrays: ValueError);
            False never; None follows TANDEM_VALIDATE_INDICES (docs/index_validation.md).

    Returns:
        out: [T, Hq, D] in q's dtype (or ``out_dtype``, or float8_e4m3fn with
        ``output_scale``).

    Transforms: ``jax.jit``, ``jax.vmap`` (one launch: examples stacked along the
    tokens, block ids offset into the stacked caches; batched alibi_slopes / sinks
    fold into the heads when the index data is shared; a batched q_descale or
    output_scale: one launch per example), ``NamedSharding`` over heads and
    ``shard_map`` (no collectives), ``jax.export`` on a GPU (docs/jax_export.md).
    Forward only. On the CPU the kernels run under Triton's interpreter. Bit for bit
    the torch op's results.

    See docs/ops/unified_attention.md.
    """
    flags = causal if _is_array(causal) else None
    # static host scalars as plain ints / floats (docs/scalar_policy.md); ranges: the planner's
    opts = host_options(max_seqlen_q, max_seqlen_k, softmax_scale, window_size, softcap)
    if index_validation(validate_indices, cu_seqlens_q, seqused_k, block_table):
        static = check_static(q, k, opts["max_seqlen_q"], opts["max_seqlen_k"], opts["window_left"])
        if static is not None:  # None: malformed shapes (the planner's error)
            check_indices(check_unified_attention, dict(cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                                                        block_table=block_table), **static)
    return _unified_attention(
        q, k, v, cu_seqlens_q, seqused_k, block_table, out=out,
        causal_flags=None if flags is None else jnp.asarray(flags),
        q_descale=None if q_descale is None else scale_array("q_descale", q_descale),
        k_descale=_descale("k_descale", k_descale), v_descale=_descale("v_descale", v_descale),
        alibi_slopes=alibi_slopes, sinks=sinks,
        output_scale=None if output_scale is None else scale_array("output_scale", output_scale),
        causal=True if flags is not None else bool(causal), **opts,
        use_alibi_sqrt=bool(use_alibi_sqrt),
        out_dtype=None if out_dtype is None else normalize_dtype_name(jnp.dtype(out_dtype)),
        config=config)


def _unified_attention(q, k, v, cu_seqlens_q, seqused_k, block_table, out=None, causal_flags=None,
                       q_descale=None, k_descale=None, v_descale=None, alibi_slopes=None, sinks=None,
                       output_scale=None, *, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                       window_left, window_right, softcap, use_alibi_sqrt, out_dtype, config):
    """The op over its arrays (named as the description's) and static options
    (checked plain numbers, hashable)."""
    arrays = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                  block_table=block_table, out=out, causal_flags=causal_flags, q_descale=q_descale,
                  k_descale=k_descale, v_descale=v_descale, alibi_slopes=alibi_slopes, sinks=sinks,
                  output_scale=output_scale)
    return _spmd.call(UNIFIED_ATTENTION, _impl, arrays, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                      window_left=window_left, window_right=window_right, softcap=softcap,
                      use_alibi_sqrt=use_alibi_sqrt, out_dtype=out_dtype, config=config)[0]


def _impl(arrays, **options):
    tgt = target(arrays)
    plan = plan_unified_attention(tgt, **infos(arrays, *_ARRAYS), **options)
    return run_plan(plan, arrays, tgt)



# ---------------------------------------------------------------- jax.vmap: one launch (see _vmap)
# - index data (cu_seqlens_q, seqused_k, block_table, causal flags) or the
#   caches batched, or q / out alone: the examples' tokens are stacked along T and
#   their sequences appended (cu_seqlens_q re-based by v * T); batched caches are
#   concatenated along the blocks with block ids offset by v * num_blocks (a
#   shared cache is read as it is); [B, Hkv] descales are stacked along B, a
#   batched one-element descale first broadcast to [B, Hkv].
# - alibi_slopes / sinks batched (and no index data batched): the examples are
#   stacked along the heads (GQA: kv heads too, caches tiled).
# - q_descale, output_scale batched (one per launch), or alibi_slopes / sinks
#   together with batched index data: one launch per example (_vmap.looped).
_INDEX = ("cu_seqlens_q", "seqused_k", "block_table", "causal_flags")


def _descale_tables(size, batched, arrays):
    """Batched one-element k / v descales as [V, B, Hkv] tables."""
    bsz = arrays["seqused_k"].shape[-1]
    hkv = arrays["k"].shape[-2]
    out = dict(arrays)
    for n in ("k_descale", "v_descale"):
        x = arrays.get(n)
        if x is not None and n in batched and x.size == size:
            out[n] = jnp.broadcast_to(x.reshape(size, 1, 1), (size, bsz, hkv))
    return out


def _is_table(x, batched: bool) -> bool:
    return x is not None and x.ndim - batched == 2


def _fold_tokens(size, batched, arrays, static, call):
    t = arrays["q"].shape[-3]
    folded = {n: None if arrays.get(n) is None else stack_along(arrays[n], n in batched, size, 0)
              for n in ("q", "out", "seqused_k", "causal_flags")}
    if batched & {"k", "v"}:  # the caches concatenated along the blocks, ids offset
        blocks = arrays["k"].shape[1 if "k" in batched else 0]
        for n in ("k", "v"):
            folded[n] = stack_along(arrays[n], n in batched, size, 0)
        folded["block_table"] = offset_ids(arrays["block_table"], "block_table" in batched, size, blocks)
    else:                     # one shared cache: every example's ids index it as they are
        folded["k"], folded["v"] = arrays["k"], arrays["v"]
        folded["block_table"] = stack_along(arrays["block_table"], "block_table" in batched, size, 0)
    folded["cu_seqlens_q"] = rebase_offsets(arrays["cu_seqlens_q"], "cu_seqlens_q" in batched, size, t)
    for n in ("k_descale", "v_descale"):
        x = arrays.get(n)
        folded[n] = stack_along(x, n in batched, size, 0) if _is_table(x, n in batched) else x
    for n in ("q_descale", "alibi_slopes", "sinks", "output_scale"):
        folded[n] = arrays.get(n)
    return unstack_along(call(**folded, **static), size, 0)


def _fold_heads(size, batched, arrays, static, call):
    folded = {}
    for n in ("q", "out"):
        folded[n] = None if arrays.get(n) is None else stack_along(arrays[n], n in batched, size, 1)
    for n in ("k", "v"):
        folded[n] = stack_along(arrays[n], n in batched, size, 2)
    for n in ("alibi_slopes", "sinks"):
        x = arrays.get(n)
        folded[n] = None if x is None else stack_along(x, n in batched, size, 0)
    for n in ("k_descale", "v_descale"):
        x = arrays.get(n)
        folded[n] = stack_along(x, n in batched, size, 1) if _is_table(x, n in batched) else x
    for n in _INDEX + ("q_descale", "output_scale"):
        folded[n] = arrays.get(n)
    return unstack_along(call(**folded, **static), size, 1)


def _rule(size, batched, arrays, static, call):
    per_head = batched & {"alibi_slopes", "sinks"}
    if batched & set(UNIFIED_ATTENTION.unbatchable) or (per_head and batched & set(_INDEX)):
        return looped(size, batched, arrays, static, call)
    arrays = _descale_tables(size, batched, arrays)
    if per_head:
        return _fold_heads(size, batched, arrays, static, call)
    return _fold_tokens(size, batched, arrays, static, call)


# ---------------------------------------------------------------- the public function's op
_unified_attention = vmappable(_unified_attention, UNIFIED_ATTENTION, _rule)

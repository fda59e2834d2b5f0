"""context_attention_fwd for JAX: functional, works under jax.jit."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from core_kernels.prefix_prefill.checks import check_prefix_prefill
from core_kernels._plan import INT32_MAX, ArrayInfo, as_float, as_int
from core_kernels.prefix_prefill import plan_prefix_prefill
from core_kernels.prefix_prefill.plan import prefix_prefill_config

from core_kernels.prefix_prefill.op import CONTEXT_ATTENTION_FWD

from . import _spmd
from ._vmap import (fold_arrays, offset_ids, per_example, pinned, rebase_offsets, stack_along, unstack_along,
                    looped, vmappable)
from ._executor import infos, run_plan, scale_array, target
from ._index_validation import buffer_address, check_indices, index_validation


def context_attention_fwd(q, k, v, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, *,
                          max_input_len=None, max_seq_len=None, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0,
                          alibi_slopes=None, sliding_window=None, sm_scale=None,
                          skip_decode=False, fp8_out_scale=None, sinks=None, output=None,
                          is_block_table_ptr=False, interleaved_v_pack_factor=0, causal=True,
                          config=None, validate_indices=None, batch_invariant=False):
    """Causal attention of new tokens over their paged context and themselves.

    T = new tokens of all sequences, B = sequences, Hq query heads, Hkv KV heads;
    D <= 256, any size.

    Args:
        q: [T, Hq, D] float32/float16/bfloat16, the new tokens of all sequences, packed.
        k, v: [T, Hkv, D] (q's dtype), K/V of the new tokens; Hq % Hkv == 0 (query
            head h reads KV head h // (Hq / Hkv)). Both None: the new tokens' K/V are
            read from the paged cache (positions context_len .. seq_len - 1 of each
            sequence; not with alibi_slopes).
        k_cache: [num_blocks, Hkv, D // x, block_size, x]; v_cache: [num_blocks,
            Hkv, D, block_size]; q's dtype, an fp8 dtype, or uint8 holding fp8 (with
            an fp8 ``kv_cache_dtype``); any x dividing D, any block_size.
        b_loc: [B, max_blocks_per_seq] int32/int64 block table (physical block of
            each logical block); b_start_loc: [B + 1] int32/int64 cumulative query
            starts; b_seq_len: [B] int32/int64 context + query lengths. All may be
            traced (device data: new values never recompile).
        max_input_len: static int, upper bound on the query length of any sequence
            (sets the grid; default T, always valid; a value above T acts as T).
        max_seq_len: static int >= 0 or None. > 0: an upper bound on every
            sequence's context length that sizes the scratch the paged context is
            gathered into (a longer context gives that sequence NaN outputs);
            0 or None: unknown (the block table's width sizes it).
        kv_cache_dtype: "auto" (the cache's dtype), "fp8" / "fp8_e4m3" or "fp8_e5m2"
            (a uint8 cache is reinterpreted), or "float16" / "bfloat16" / "float32"
            (read as "auto", as vLLM does).
        k_scale, v_scale: fp8 dequantisation scales: finite floats > 0 or 1-element
            float32 arrays (may be traced), applied to fp8 cache values only.
        alibi_slopes: optional [Hq] float ALiBi slopes.
        sliding_window: None or <= 0 disables; else key t is visible to query
            position p iff p - t < window.
        sm_scale: softmax scale (default 1/sqrt(D)).
        skip_decode: rows of sequences with a query length of 1 are not computed
            (they keep ``output``'s values).
        fp8_out_scale: None, or a finite float > 0 / 1-element float32 array: the
            output is float8_e4m3fn = fp8(clamp(attn / fp8_out_scale)).
        sinks: optional [Hq] float logits that join the softmax denominator only.
        output: optional [T, Hq, D] array (the output dtype) aliased to the result, so
            rows skipped by ``skip_decode`` keep its values (zeros when absent) and a
            donated buffer is updated in place.
        is_block_table_ptr: static; ``b_loc`` (int64) holds device addresses of K
            cache blocks (``k_cache.unsafe_buffer_pointer() + id * bytes per block``;
            0 for an unused slot). GPU only: under the interpreter the kernels run on
            host copies (NotImplementedError).
        interleaved_v_pack_factor: static; x > 0: ``v_cache`` (same 4-D shape, last
            two dims contiguous) holds [num_blocks, Hkv, block_size // x, D, x] in
            memory; 0: [num_blocks, Hkv, D, block_size].
        causal: static; False lets each new token attend to every new token of its
            sequence (and its whole context); not with alibi_slopes.
        config: optional ``core_kernels.prefix_prefill.PrefixPrefillConfig``
            overriding the tiling and the context gather the planner would choose (static).
        validate_indices: True checks b_loc, b_start_loc, b_seq_len and
            max_input_len against each other and the cache before the launch (one host
            transfer; ValueError naming the argument; traced arrays: ValueError); False
            never; None follows TANDEM_VALIDATE_INDICES (docs/index_validation.md).
        batch_invariant: True makes each (token, head) row's result independent of
            the other sequences of the batch (static): the context read through the
            paged cache uses the tiles of the gathered one, whichever the batch's
            size picks (16-bit D=128: a slower paged loop).

    Returns:
        o: [T, Hq, D] in q's dtype, or float8_e4m3fn with ``fp8_out_scale``.

    Transforms: ``jax.jit`` (block table, offsets, lengths and scales may be traced),
    ``jax.vmap`` (every argument; one launch, or one per example where batched
    k_scale / v_scale / fp8_out_scale, alibi_slopes / sinks with batched index data,
    or is_block_table_ptr leave nothing to fold), ``NamedSharding`` over heads and ``shard_map``, ``jax.export`` on a
    GPU (docs/jax_export.md). Forward only: not differentiable with ``jax.grad``. On
    the CPU the kernels run under Triton's interpreter.

    Example::

        # 2 sequences: 3 new tokens over 6 cached, 1 new token over 4 cached
        q = jnp.ones((4, Hq, D), jnp.bfloat16)
        k = v = jnp.ones((4, Hkv, D), jnp.bfloat16)
        b_start_loc = jnp.array([0, 3, 4], jnp.int32)
        b_seq_len = jnp.array([9, 5], jnp.int32)
        o = context_attention_fwd(q, k, v, k_cache, v_cache, b_loc, b_start_loc, b_seq_len,
                                  max_input_len=3, max_seq_len=6)

    See docs/ops/prefix_prefill.md for the paged-cache layout (a worked example),
    numerics, memory and tuning.
    """
    arrays = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, b_loc=b_loc,
                  b_start_loc=b_start_loc, b_seq_len=b_seq_len, output=output,
                  alibi_slopes=alibi_slopes, sinks=sinks)
    if kv_cache_dtype != "auto" or jnp.dtype(k_cache.dtype).name.startswith("float8"):
        arrays["k_scale"] = scale_array("k_scale", k_scale)
        arrays["v_scale"] = scale_array("v_scale", v_scale)
    if fp8_out_scale is not None:
        arrays["fp8_out_scale"] = scale_array("fp8_out_scale", fp8_out_scale)
    arrays = {n: x for n, x in arrays.items() if x is not None}
    tgt = target(arrays)
    if is_block_table_ptr and tgt.interpret:
        raise NotImplementedError("is_block_table_ptr: block addresses need the GPU (under the "
                                  "interpreter the kernels read host copies of the cache)")
    if index_validation(validate_indices, b_loc, b_start_loc, b_seq_len):
        _check_indices(q, k, k_cache, b_loc, b_start_loc, b_seq_len, max_input_len,
                       sliding_window, skip_decode, is_block_table_ptr, max_seq_len)
    return _spmd.call(
        CONTEXT_ATTENTION_FWD, _context_attention, arrays,
        # static host scalars as plain ints / floats (docs/scalar_policy.md); ranges: the planner's
        max_input_len=q.shape[0] if max_input_len is None else as_int("max_input_len", max_input_len),
        max_seq_len=0 if max_seq_len is None else as_int("max_seq_len", max_seq_len, 0, INT32_MAX),
        kv_cache_dtype=kv_cache_dtype,
        sliding_window=None if sliding_window is None else as_int("sliding_window", sliding_window),
        sm_scale=None if sm_scale is None else as_float("sm_scale", sm_scale, finite=False),
        skip_decode=skip_decode, causal=bool(causal),
        interleaved_v_pack_factor=as_int("interleaved_v_pack_factor", interleaved_v_pack_factor),
        is_block_table_ptr=bool(is_block_table_ptr), config=config, batch_invariant=bool(batch_invariant))[0]


def _context_attention(arrays, **options):
    tgt = target(arrays)
    plan = plan_prefix_prefill(
        tgt, **infos(arrays, "q", "k", "v", "k_cache", "v_cache", "b_loc", "b_start_loc", "b_seq_len",
                     "output", "k_scale", "v_scale", "alibi_slopes", "sinks", "fp8_out_scale"), **options)
    return run_plan(plan, arrays, tgt)


def _check_indices(q, k, k_cache, b_loc, b_start_loc, b_seq_len, max_input_len, sliding_window,
                   skip_decode, is_block_table_ptr, max_seq_len=None):
    """Index validation (one host transfer); malformed arguments are left to the planner."""
    if q.ndim != 3 or k_cache.ndim != 5:
        return
    check_indices(check_prefix_prefill,
                  dict(b_loc=b_loc, b_start_loc=b_start_loc, b_seq_len=b_seq_len),
                  num_tokens=q.shape[0], num_blocks=k_cache.shape[0], block_size=k_cache.shape[3],
                  max_input_len=q.shape[0] if max_input_len is None else int(max_input_len),
                  sliding_window=None if sliding_window is None else int(sliding_window),
                  skip_decode=bool(skip_decode), cache_new=k is None,
                  is_block_table_ptr=bool(is_block_table_ptr),
                  k_cache_address=buffer_address(k_cache) if is_block_table_ptr else None,
                  block_bytes=int(np.prod(k_cache.shape[1:])) * jnp.dtype(k_cache.dtype).itemsize,
                  max_seq_len=int(max_seq_len or 0))


# ---------------------------------------------------------------- jax.vmap: one launch (see _vmap)
# - context_attention_fwd: heads when the index data (b_loc, b_start_loc,
# b_seq_len) is shared; else tokens: q/k/v/output tokens stacked, sequences
# stacked along the batch, caches concatenated along blocks with block ids
# offset by v * num_blocks and b_start_loc re-based by v*T. Batched k_scale /
# v_scale / fp8_out_scale (one per launch), alibi_slopes / sinks together with
# batched index data, and block addresses (is_block_table_ptr: they point into
# the one cache the call receives): one launch per example (_vmap.looped).


_INDEX = ("b_loc", "b_start_loc", "b_seq_len")


def _prefix_config(tgt, infos, kw):
    """The tiles (and gather decision) a per-example call chooses: the gather
    decision depends on the batch's scratch size."""
    if kw.get("is_block_table_ptr"):
        return kw.get("config")
    scale = ArrayInfo.contiguous((1,), "float32")
    fp8_cache = kw.get("kv_cache_dtype", "auto") != "auto" or infos["k_cache"].dtype.startswith("float8")
    sw, sm, mil = kw.get("sliding_window"), kw.get("sm_scale"), kw.get("max_input_len")
    return prefix_prefill_config(
        *(infos.get(n) for n in ("q", "k", "v", "k_cache", "v_cache") + _INDEX), output=infos.get("output"),
        k_scale=scale if fp8_cache else None, v_scale=scale if fp8_cache else None,
        alibi_slopes=infos.get("alibi_slopes"), sinks=infos.get("sinks"),
        fp8_out_scale=None if kw.get("fp8_out_scale") is None and "fp8_out_scale" not in infos else scale,
        max_input_len=infos["q"].shape[0] if mil is None else as_int("max_input_len", mil),
        kv_cache_dtype=kw.get("kv_cache_dtype", "auto"),
        sliding_window=None if sw is None else as_int("sliding_window", sw),
        sm_scale=None if sm is None else float(sm), skip_decode=bool(kw.get("skip_decode", False)),
        causal=bool(kw.get("causal", True)), v_pack=as_int("v_pack", kw.get("interleaved_v_pack_factor", 0)),
        config=kw.get("config"), batch_invariant=bool(kw.get("batch_invariant", False)))


def _context_rule(size, batched, arrays, static, call):
    axes = CONTEXT_ATTENTION_FWD
    op = axes.name
    if static.get("is_block_table_ptr") and batched & {"k_cache", "v_cache"}:
        raise ValueError(f"k_cache: {op} with is_block_table_ptr reads block addresses of one cache; "
                         "under jax.vmap the caches must be shared by the examples (unbatched)")
    if (batched & set(axes.unbatchable) or static.get("is_block_table_ptr")
            or (batched & set(_INDEX) and batched & {"alibi_slopes", "sinks"})):
        return looped(size, batched, arrays, static, call)
    kw = pinned(_prefix_config)(dict(static), per_example(arrays, batched))
    if not batched & set(_INDEX):  # shared index data: fold into the heads (kv heads grouped)
        folded = fold_arrays(axes, "heads", size, batched, arrays)
        return unstack_along(call(**folded, **kw), size, 1)
    t = arrays["q"].shape[-3]
    blocks = arrays["k_cache"].shape[1 if "k_cache" in batched else 0]
    folded = {n: None if arrays.get(n) is None else stack_along(arrays[n], n in batched, size, 0)
              for n in ("q", "k", "v", "k_cache", "v_cache", "output", "b_seq_len")}
    folded["b_loc"] = offset_ids(arrays["b_loc"], "b_loc" in batched, size, blocks)
    folded["b_start_loc"] = rebase_offsets(arrays["b_start_loc"], "b_start_loc" in batched, size, t)
    for n in ("alibi_slopes", "sinks", "k_scale", "v_scale", "fp8_out_scale"):
        if n in arrays:
            folded[n] = arrays[n]
    return unstack_along(call(**folded, **kw), size, 0)


# ---------------------------------------------------------------- the public functions
# each with its custom_vmap rule (vmappable) and, where it has a backward, its custom_vjp
context_attention_fwd = vmappable(context_attention_fwd, CONTEXT_ATTENTION_FWD, _context_rule)

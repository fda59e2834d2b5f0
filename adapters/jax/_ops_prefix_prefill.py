"""context_attention_fwd for JAX: functional, works under jax.jit."""
from __future__ import annotations

import jax.numpy as jnp

from core_kernels.prefix_prefill import plan_prefix_prefill

from ._executor import as_array, info, run_plan, target


def context_attention_fwd(q, k, v, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, *,
                          max_input_len=None, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0,
                          alibi_slopes=None, sliding_window=None, sm_scale=None,
                          skip_decode=False, fp8_out_scale=None, sinks=None, output=None,
                          is_block_table_ptr=False, interleaved_v_pack_factor=0, causal=True,
                          config=None):
    """Causal attention of new tokens over their paged context and themselves.

    Shapes, dtypes and options as in ``adapters.torch.context_attention_fwd``;
    the block table, start offsets, lengths and scales may be traced values.
    ``max_input_len`` is static (default T, always valid). ``output``: optional
    [T, Hq, D] array aliased to the result, so rows skipped by ``skip_decode``
    keep its values (zeros when absent) and a donated buffer is updated in place.
    ``k`` and ``v`` None: the new tokens' K/V are read from the paged cache.
    ``causal``, ``interleaved_v_pack_factor`` (static) as in the torch op;
    ``is_block_table_ptr``: ``b_loc`` (int64) holds device addresses of K cache
    blocks (``k_cache.unsafe_buffer_pointer() + id * bytes per block``; GPU only:
    under the interpreter the kernels run on host copies, NotImplementedError).
    ``config``: optional ``PrefixPrefillConfig`` overriding the planner's tiling (static).
    Returns o: [T, Hq, D] in q's dtype, or float8_e4m3fn with ``fp8_out_scale``.
    """
    arrays = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, b_loc=b_loc,
                  b_start_loc=b_start_loc, b_seq_len=b_seq_len, output=output,
                  alibi_slopes=alibi_slopes, sinks=sinks)
    if kv_cache_dtype != "auto" or jnp.dtype(k_cache.dtype).name.startswith("float8"):
        arrays["k_scale"] = as_array("k_scale", k_scale, jnp.float32)
        arrays["v_scale"] = as_array("v_scale", v_scale, jnp.float32)
    if fp8_out_scale is not None:
        arrays["fp8_out_scale"] = as_array("fp8_out_scale", fp8_out_scale, jnp.float32)
    arrays = {n: x for n, x in arrays.items() if x is not None}
    infos = {n: info(x) for n, x in arrays.items()}
    tgt = target(arrays)
    if is_block_table_ptr and tgt.interpret:
        raise NotImplementedError("is_block_table_ptr: block addresses need the GPU (under the "
                                  "interpreter the kernels read host copies of the cache)")
    plan = plan_prefix_prefill(
        tgt,
        *(infos.get(n) for n in ("q", "k", "v", "k_cache", "v_cache", "b_loc", "b_start_loc",
                                 "b_seq_len", "output", "k_scale", "v_scale", "alibi_slopes",
                                 "sinks", "fp8_out_scale")),
        max_input_len=q.shape[0] if max_input_len is None else max_input_len,
        kv_cache_dtype=kv_cache_dtype, sliding_window=sliding_window, sm_scale=sm_scale,
        skip_decode=skip_decode, causal=bool(causal),
        interleaved_v_pack_factor=interleaved_v_pack_factor,
        is_block_table_ptr=bool(is_block_table_ptr), config=config)
    return run_plan(plan, arrays, tgt)[0]

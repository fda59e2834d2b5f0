"""reshape_and_cache_flash for JAX: functional, the caches aliased (updated in
place under jax.jit when donated)."""
from __future__ import annotations

import jax.numpy as jnp

from core_kernels._plan import INT32_MAX
from core_kernels.reshape_and_cache_flash import (RESHAPE_AND_CACHE_FLASH, check_kv_cache_dtype,
                                                  check_reshape_and_cache_flash, plan_reshape_and_cache_flash)

from . import _spmd
from ._executor import infos, run_plan, scale_array, target
from ._index_validation import check_indices, index_validation
from ._vmap import looped, offset_ids, stack_along, unstack_along, vmappable


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, *, kv_cache_dtype="auto",
                            k_scale=None, v_scale=None, config=None, validate_indices=None):
    """The paged KV cache with the new tokens' keys and values written in
    (vLLM's ``triton_reshape_and_cache_flash``, functional).

    Args:
        key, value: [N, Hkv, D] float32/float16/bfloat16 (one dtype; D from 1 to 256).
        key_cache, value_cache: [num_blocks, block_size, Hkv, D] (vLLM's flash
            layout; any block_size >= 1, e.g. 16 or 544): key's dtype with
            kv_cache_dtype "auto"; with an fp8 kv_cache_dtype, the fp8 format it
            names or uint8 holding its bits.
        slot_mapping: [N] int32/int64: token t goes to block s // block_size,
            position s % block_size for s = slot_mapping[t]; s < 0 (padding) writes
            nothing. A slot >= num_blocks * block_size is an index error:
            validate_indices reports it; otherwise that token writes nothing.
        kv_cache_dtype: "auto" (stored as is), "fp8" / "fp8_e4m3" (float8_e4m3fn)
            or "fp8_e5m2" (float8_e5m2): the cache holds fp8(clamp(x / scale)),
            saturating, rounded to nearest even. Static.
        k_scale, v_scale: finite floats > 0 or 1-element float32 arrays (device
            data, may be traced); required with fp8, unused with "auto".
        config: optional ``ReshapeAndCacheConfig`` overriding the planner's tiling (static).
        validate_indices: True checks slot_mapping before the launch (slots below
            num_blocks * block_size, no slot twice; one host transfer; ValueError;
            traced: ValueError); False never; None follows TANDEM_VALIDATE_INDICES
            (docs/index_validation.md).
    Returns:
        (key_cache, value_cache), the new caches, aliased to the inputs: under
        jax.jit with the caches donated they are updated in place, without a copy;
        rows no slot names keep their bits.

    Transforms: ``jax.jit`` (slot_mapping and the scales may be traced), ``jax.vmap``
    (one launch: the examples' caches folded into one cache's blocks, their slots
    offset; batched scales: one launch per example), ``NamedSharding`` over kv
    heads and ``shard_map`` (no collective), ``jax.export`` on a GPU
    (docs/jax_export.md). No backward.

    Example::

        update = jax.jit(reshape_and_cache_flash, donate_argnums=(2, 3))
        key_cache, value_cache = update(key, value, key_cache, value_cache, slot_mapping)

    See docs/ops/reshape_and_cache_flash.md.
    """
    check_kv_cache_dtype(kv_cache_dtype)
    if index_validation(validate_indices, slot_mapping) and getattr(key_cache, "ndim", None) == 4:
        check_indices(check_reshape_and_cache_flash, dict(slot_mapping=slot_mapping),
                      num_blocks=key_cache.shape[0], block_size=key_cache.shape[1])
    arrays = dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,
                  k_scale=None if k_scale is None else scale_array("k_scale", k_scale),
                  v_scale=None if v_scale is None else scale_array("v_scale", v_scale))
    return _spmd.call(RESHAPE_AND_CACHE_FLASH, _reshape_and_cache_flash, arrays, kv_cache_dtype=kv_cache_dtype,
                      config=config)


def _reshape_and_cache_flash(arrays, *, kv_cache_dtype, config):
    tgt = target(arrays)
    plan = plan_reshape_and_cache_flash(
        tgt, **infos(arrays, "key", "value", "key_cache", "value_cache", "slot_mapping", "k_scale", "v_scale"),
        kv_cache_dtype=kv_cache_dtype, config=config)
    return run_plan(plan, arrays, tgt)


# ---------------------------------------------------------------- jax.vmap: one launch (see _vmap)
# The V examples' caches are stacked along the blocks ([V, NB, BS, H, D] ->
# [V * NB, BS, H, D], a free reshape; an unbatched cache is tiled: each example
# gets its own updated copy), their tokens along N, and example v's slots are
# offset by v * NB * BS (negative slots stay negative; a slot past its cache
# stays past the folded one: no example writes another's cache). Every token
# writes what a per-example call writes, so the results are equal bit for bit.
# Batched scales (one per launch), or int32 slots that the folded caches would
# overflow: one launch per example (_vmap.looped).


def _rule(size, batched, arrays, static, call):
    cache = arrays["key_cache"]
    num_blocks, block_size = cache.shape[-4], cache.shape[-3]
    slots = arrays["slot_mapping"]
    if batched & {"k_scale", "v_scale"} or (jnp.dtype(slots.dtype) == jnp.int32
                                            and size * num_blocks * block_size > INT32_MAX):
        return looped(size, batched, arrays, static, call)
    folded = {n: stack_along(arrays[n], n in batched, size, 0)
              for n in ("key", "value", "key_cache", "value_cache")}
    ids = offset_ids(slots, "slot_mapping" in batched, size, num_blocks * block_size)
    key_cache, value_cache = call(**folded, slot_mapping=ids, k_scale=arrays.get("k_scale"),
                                  v_scale=arrays.get("v_scale"), **static)
    return unstack_along(key_cache, size, 0), unstack_along(value_cache, size, 0)


# the public function with its vmap rule
reshape_and_cache_flash = vmappable(reshape_and_cache_flash, RESHAPE_AND_CACHE_FLASH, _rule)

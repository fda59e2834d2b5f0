"""Description of reshape_and_cache_flash (core_kernels.op_axes): a scatter of
each token's kv-head rows into the paged caches, independent per kv head."""
from __future__ import annotations

from ..op_axes import OpAxes

PUBLIC = ("reshape_and_cache_flash",)

_CACHE = (None, None, "kv_heads", None)   # [num_blocks, block_size, Hkv, D]

RESHAPE_AND_CACHE_FLASH = OpAxes(
    "reshape_and_cache_flash",
    inputs={"key": (None, "kv_heads", None), "value": (None, "kv_heads", None),
            "key_cache": _CACHE, "value_cache": _CACHE, "slot_mapping": (None,),
            "k_scale": (None,), "v_scale": (None,)},
    outputs={"key_cache": _CACHE, "value_cache": _CACHE},
    # tokens are not independent: every token may write any row of the (whole) cache
    independent=("kv_heads",),
    # jax.vmap: the op's own rule folds the examples into the cache blocks (slots offset
    # per example: adapters/jax/_ops_reshape_and_cache_flash.py), not into a label
    unbatchable=("k_scale", "v_scale"),   # one scale per launch (a batched slot_mapping: the rule offsets it)
)

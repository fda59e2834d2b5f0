"""reshape_and_cache_flash for PyTorch: in place, vLLM's triton_reshape_and_cache_flash."""
from __future__ import annotations

from typing import Optional

import torch

from core_kernels._plan import decode_config, encode_config
from core_kernels.reshape_and_cache_flash import (RESHAPE_AND_CACHE_FLASH, check_kv_cache_dtype,
                                                  check_reshape_and_cache_flash, plan_reshape_and_cache_flash)

from ._executor import CallMemo, execute
from ._index_validation import check_indices, index_validation
from ._register import custom_op
from ._scalars import scale_tensor


def _impl(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
          slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: Optional[torch.Tensor],
          v_scale: Optional[torch.Tensor], config: Optional[str]) -> None:
    execute(plan_reshape_and_cache_flash,
            dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,
                 k_scale=k_scale, v_scale=v_scale),
            kv_cache_dtype=kv_cache_dtype, config=decode_config(config))


_op = custom_op("reshape_and_cache_flash", _impl, mutates_args=("key_cache", "value_cache"),
                axes=RESHAPE_AND_CACHE_FLASH)

_MEMO = CallMemo(("key", "value", "key_cache", "value_cache", "slot_mapping", "k_scale", "v_scale"),
                 written=("key_cache", "value_cache"))


def reshape_and_cache_flash(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                            k_scale=None, v_scale=None, *, config=None, validate_indices=None) -> None:
    """Write the new tokens' keys and values into the paged KV cache, in place
    (vLLM's ``triton_reshape_and_cache_flash``; its arguments by position or name).

    Args:
        key, value: [N, Hkv, D] float32/float16/bfloat16 (one dtype; D from 1 to
            256, any Hkv), innermost dim contiguous, other strides free (a slice of
            a fused qkv tensor is fine).
        key_cache, value_cache: [num_blocks, block_size, Hkv, D] (vLLM's flash
            layout; any block_size >= 1, e.g. 16 or 544), innermost dim contiguous,
            other strides free (views of one [num_blocks, 2, ...] tensor, an HND
            layout seen as NHD); written in place. Their dtype: key's with
            kv_cache_dtype "auto"; with an fp8 kv_cache_dtype, the fp8 format it
            names or uint8 holding its bits.
        slot_mapping: [N] int64 (or int32): token t goes to block s // block_size,
            position s % block_size for s = slot_mapping[t]; s < 0 (padding)
            writes nothing. A slot >= num_blocks * block_size is an index error:
            validate_indices reports it; otherwise that token writes nothing.
        kv_cache_dtype: "auto" (stored as is), "fp8" / "fp8_e4m3" (float8_e4m3fn)
            or "fp8_e5m2" (float8_e5m2): the cache holds fp8(clamp(x / scale)),
            saturating, rounded to nearest even.
        k_scale, v_scale: 1-element float32 tensors on key's device (device data,
            never read on the host), or finite floats > 0; required with fp8,
            unused with "auto".
        config: optional ``core_kernels.reshape_and_cache_flash.ReshapeAndCacheConfig``
            overriding the planner's tiling.
        validate_indices: True checks slot_mapping before the launch (slots below
            num_blocks * block_size, no slot twice; one host sync; ValueError);
            False never; None (default) follows TANDEM_VALIDATE_INDICES
            (docs/index_validation.md).
    Returns:
        None: the caches are written in place; rows no slot names keep their bits.

    Transforms: eager, ``torch.compile(fullgraph=True)``, CUDA graphs (no host sync
    unless validating) and DTensor (sharded over kv heads). No backward: a call that
    needs one raises RuntimeError.

    Example::

        key, value = (torch.randn(N, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        key_cache, value_cache = (torch.zeros(num_blocks, 16, 8, 128, device="cuda",
                                              dtype=torch.bfloat16) for _ in range(2))
        slot_mapping = torch.arange(N, device="cuda")          # tokens 0..N-1 of block 0, 1, ...
        reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, "auto", None, None)

    See docs/ops/reshape_and_cache_flash.md.
    """
    tensors = (key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    if _MEMO.lookup(tensors, (kv_cache_dtype, config), validate_indices) is not None:
        return
    try:
        check_kv_cache_dtype(kv_cache_dtype)
        if index_validation(validate_indices, slot_mapping) and isinstance(key_cache, torch.Tensor) \
                and key_cache.dim() == 4:
            check_indices(check_reshape_and_cache_flash, dict(slot_mapping=slot_mapping),
                          num_blocks=key_cache.shape[0], block_size=key_cache.shape[1])
        _op(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
            scale_tensor("k_scale", k_scale, key), scale_tensor("v_scale", v_scale, key), encode_config(config))
    except BaseException:
        _MEMO.abandon()
        raise
    _MEMO.commit()

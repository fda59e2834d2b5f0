"""Shim of vllm.utils.torch_utils: the constants/helpers the fetched files use,
with vLLM's values."""
import random

import numpy as np
import torch

# vLLM: fp8 KV caches are allocated as uint8 storage.
STR_DTYPE_TO_TORCH_DTYPE = {
    "float32": torch.float32,
    "half": torch.half,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float,
    "fp8": torch.uint8,
    "fp8_e4m3": torch.uint8,
    "fp8_e5m2": torch.uint8,
    "int8": torch.int8,
    "fp8_inc": torch.float8_e4m3fn,
    "fp8_ds_mla": torch.uint8,
}


def set_random_seed(seed) -> None:
    if seed is not None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)


def is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    return (kv_cache_dtype.startswith("fp8") or kv_cache_dtype.endswith("per_token_head")
            or kv_cache_dtype.startswith("nvfp4"))


def _nvfp4(name):
    from peer_check_missing import out_of_scope
    return out_of_scope("vllm.utils.torch_utils", name,
                        "NVFP4 KV caches are not in the fetched kernel's commit nor in our op")


# the NVFP4 cache layout helpers vLLM's unified-attention tests import
nvfp4_kv_cache_full_dim = _nvfp4("nvfp4_kv_cache_full_dim")
nvfp4_kv_cache_split_views = _nvfp4("nvfp4_kv_cache_split_views")

"""Shim of vllm.v1.kv_cache_interface: the KV cache quantization modes, as the
fetched triton_unified_attention.py (commit 00139433) numbers them: an IntEnum,
passed to its kernel as a constexpr. (Later vLLM commits add NVFP4; its tests
skip before they reach it, see triton_attn.py and utils/torch_utils.py here.)"""
from enum import IntEnum


class KVQuantMode(IntEnum):
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
    INT2_PER_TOKEN_HEAD = 5

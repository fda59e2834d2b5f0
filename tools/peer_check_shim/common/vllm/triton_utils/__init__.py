"""Shim of vllm.triton_utils: the installed triton."""
import triton
import triton.language as tl

HAS_TRITON = True

__all__ = ["HAS_TRITON", "tl", "triton"]

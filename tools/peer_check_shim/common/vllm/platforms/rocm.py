"""Shim of vllm.platforms.rocm: vLLM's ROCm custom paged attention is a compiled
vLLM extension that is not available here, so it is never selected (on CUDA
vLLM's own function returns False for these calls as well)."""


def use_rocm_custom_paged_attention(*args, **kwargs) -> bool:
    return False


def on_gfx9() -> bool:
    return False

"""--impl ours: vllm.v1.attention.ops.triton_reshape_and_cache_flash -> adapters.torch
(our code)."""
from peer_check_missing import from_ours

_MOD = "vllm.v1.attention.ops.triton_reshape_and_cache_flash"
triton_reshape_and_cache_flash = from_ours(_MOD, "triton_reshape_and_cache_flash",
                                           "reshape_and_cache_flash")

__all__ = ["triton_reshape_and_cache_flash"]

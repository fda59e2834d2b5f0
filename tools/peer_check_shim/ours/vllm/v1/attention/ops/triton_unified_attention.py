"""--impl ours: vllm.v1.attention.ops.triton_unified_attention -> adapters.torch (our code).

``_get_nvfp4_launch_config`` (vLLM's NVFP4 launch heuristics, tested by name) is
out of scope: NVFP4 KV caches are not part of our op."""
from peer_check_missing import from_ours, out_of_scope

_MOD = "vllm.v1.attention.ops.triton_unified_attention"
unified_attention = from_ours(_MOD, "unified_attention")
_get_nvfp4_launch_config = out_of_scope(_MOD, "_get_nvfp4_launch_config",
                                        "vLLM's NVFP4 launch heuristics")

__all__ = ["unified_attention"]

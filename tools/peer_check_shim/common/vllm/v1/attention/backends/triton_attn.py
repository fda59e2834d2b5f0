"""Shim of vllm.v1.attention.backends.triton_attn: vLLM's TRITON_ATTN backend
(metadata builder, TritonAttentionImpl.forward and its NVFP4 routing) is not the
kernel under check. Building its classes skips the calling test, counted as
"out of scope"; the module attributes its tests monkeypatch exist."""
from peer_check_missing import out_of_scope

_MOD = "vllm.v1.attention.backends.triton_attn"
_WHY = "vLLM's attention backend class, not the unified_attention kernel"


class TritonAttentionMetadata:
    def __init__(self, *args, **kwargs):
        out_of_scope(_MOD, "TritonAttentionMetadata", _WHY)()


class TritonAttentionImpl:
    def __init__(self, *args, **kwargs):
        out_of_scope(_MOD, "TritonAttentionImpl", _WHY)()


# the names its tests replace with monkeypatch.setattr
context_attention_fwd = out_of_scope(_MOD, "context_attention_fwd", _WHY)
unified_attention = out_of_scope(_MOD, "unified_attention", _WHY)

"""The host options of unified_attention as both adapters take them (vLLM's
forms), checked and turned into the planner's plain values (docs/scalar_policy.md)."""
from __future__ import annotations

from .._plan import INT32_MAX, as_float, as_int
from .problem import KV_QUANT_MODES, kv_quant_mode_value

_UNSUPPORTED = "not supported (NONE and FP8_PER_TENSOR are)"
# vLLM modes without an entry in our table (newer vLLM's NVFP4, ...), named as strings
_VLLM_ONLY_MODES = ("NVFP4", "TURBOQUANT")


def kv_mode(mode) -> int:
    """vLLM's KVQuantMode (an enum member, its int or its name) as our int.
    A mode vLLM has and this op does not implement (per-token-head, INT4,
    INT2, NVFP4, ...) is a NotImplementedError naming kv_quant_mode; an
    unknown int or name a ValueError; None is NONE."""
    if type(mode) is int and 0 <= mode <= 1:
        return mode  # the usual case, first: this runs on every call
    name = getattr(mode, "name", None)
    if isinstance(name, str) and name not in KV_QUANT_MODES:
        raise NotImplementedError(f"kv_quant_mode: {name} is {_UNSUPPORTED}")
    if isinstance(mode, str) and mode.upper().split(".")[-1] in _VLLM_ONLY_MODES:
        raise NotImplementedError(f"kv_quant_mode: {mode} is {_UNSUPPORTED}")
    value = kv_quant_mode_value(mode)
    if value not in (0, 1):
        name = next(n for n, m in KV_QUANT_MODES.items() if m == value)
        raise NotImplementedError(f"kv_quant_mode: {name} is {_UNSUPPORTED}")
    return value


def window_pair(window_size) -> tuple:
    """vLLM's window_size (left, right) as two values, unchecked (None: no window)."""
    if window_size is None:
        return -1, -1
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size: expected (left, right), -1 for none, got {window_size!r}") from None
    return left, right


def host_options(max_seqlen_q, max_seqlen_k, softmax_scale, window_size, softcap) -> dict:
    """The planner's keywords of these host scalars, checked (TypeError /
    ValueError naming the argument); ranges the planner adds are its own."""
    left, right = window_pair(window_size)
    return dict(max_seqlen_q=as_int("max_seqlen_q", max_seqlen_q, 0, INT32_MAX),
                max_seqlen_k=as_int("max_seqlen_k", max_seqlen_k, 0, INT32_MAX),
                softmax_scale=as_float("softmax_scale", softmax_scale),
                window_left=as_int("window_size", left, -1, INT32_MAX, "left, -1 for none"),
                window_right=as_int("window_size", right, -1, INT32_MAX, "right, -1 for none"),
                softcap=0.0 if softcap is None else as_float("softcap", softcap))

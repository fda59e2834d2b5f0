"""The prefill path of unified_attention: sequences with more than DECODE_MAX_Q
new tokens (stub: to be written)."""
from __future__ import annotations

PREFILL_CONFIGS: tuple = ()


def prefill_launches(target, p, config=None):
    """(buffers, launches) of the prefill path for Problem ``p``."""
    raise NotImplementedError("unified_attention: the prefill path is not written yet")

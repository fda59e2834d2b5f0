"""The split-KV decode path of unified_attention: sequences with at most
DECODE_MAX_Q new tokens (stub: to be written)."""
from __future__ import annotations

DECODE_CONFIGS: tuple = ()


def decode_launches(target, p, config=None):
    """(buffers, launches) of the decode path for Problem ``p``."""
    raise NotImplementedError("unified_attention: the decode path is not written yet")

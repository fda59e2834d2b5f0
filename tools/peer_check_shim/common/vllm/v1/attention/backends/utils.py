"""Shim of vllm.v1.attention.backends.utils: the constant lightning_attn imports."""
PAD_SLOT_ID = -1

"""Shim of vllm.envs: the environment switches the fetched files read, with
vLLM's variable names and defaults."""
import os

# VLLM_BATCH_INVARIANT=1 makes vLLM's unified_attention take its 2D path only
VLLM_BATCH_INVARIANT = bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0")))

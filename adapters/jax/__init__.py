"""JAX adapter: functional ops over the shared kernels, usable under jax.jit."""
from ._ops_merge import merge_attn_states

__all__ = ["merge_attn_states"]

"""PyTorch adapter: every op is a torch.library custom op over the shared kernels."""
from ._ops_merge import merge_attn_states

__all__ = ["merge_attn_states"]

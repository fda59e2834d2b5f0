"""PyTorch adapter: every op is a torch.library custom op over the shared kernels."""
from ._ops_merge import mask_empty_context_lse, merge_attn_states
from ._ops_prefix_prefill import context_attention_fwd

__all__ = ["context_attention_fwd", "mask_empty_context_lse", "merge_attn_states"]
from ._ops_blocksparse import blocksparse_flash_attn_varlen_fwd
from ._ops_blocksparse_module import LocalStridedBlockSparseAttn, get_head_sliding_step, get_sparse_attn_mask

__all__ += ["LocalStridedBlockSparseAttn", "blocksparse_flash_attn_varlen_fwd", "get_head_sliding_step",
            "get_sparse_attn_mask"]
from ._ops_lightning import lightning_attention, linear_decode_forward_triton

__all__ += ["lightning_attention", "linear_decode_forward_triton"]
from ._ops_lightning_varlen import lightning_attention_varlen

__all__ += ["lightning_attention_varlen"]
from ._ops_reshape_and_cache_flash import reshape_and_cache_flash

__all__ += ["reshape_and_cache_flash"]
from ._ops_unified_attention import unified_attention

__all__ += ["unified_attention"]
from ._ops_lightning_cp import lightning_attention_cp

__all__ += ["lightning_attention_cp"]

from ._ops_example_scale import example_scale  # noqa: E402,F401  (the example op: ADDING_AN_OP.md)
from . import _dtensor

_dtensor.install()  # DTensor sharding rules, registered once torch.distributed.tensor is imported

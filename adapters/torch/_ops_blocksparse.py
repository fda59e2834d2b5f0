"""Block-sparse varlen attention for PyTorch (a drop-in for vLLM's blocksparse API)."""
from __future__ import annotations

from typing import Optional

import torch

from core_kernels._plan import decode_config, encode_config
from core_kernels.blocksparse_attention import get_sparse_attn_mask, plan_blocksparse_attention

from ._executor import planned, run_plan
from ._register import custom_op


def _bsattn_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_k: torch.Tensor,
                 cu_seqlens_q: Optional[torch.Tensor], crow: torch.Tensor, col: torch.Tensor,
                 sm_scale: Optional[float], block_size: int, q_block_size: Optional[int],
                 max_seqlen: Optional[int], config: Optional[str]) -> torch.Tensor:
    plan, device = planned(plan_blocksparse_attention,
                           dict(q=q, k=k, v=v, cu_seqlens_k=cu_seqlens_k, cu_seqlens_q=cu_seqlens_q,
                                crow=crow, col=col),
                           sm_scale=sm_scale, block_size=block_size, q_block_size=q_block_size,
                           max_seqlen=max_seqlen, config=decode_config(config))
    tensors = dict(q=q, k=k, v=v, cu_seqlens_k=cu_seqlens_k, crow=crow, col=col)
    if cu_seqlens_q is not None:
        tensors["cu_seqlens_q"] = cu_seqlens_q
    return run_plan(plan, tensors, None, device)["output"]


_bsattn_op = custom_op("blocksparse_flash_attn_varlen_fwd", _bsattn_impl,
                       fake=lambda q, *args: torch.empty_like(q, memory_format=torch.contiguous_format))


def blocksparse_flash_attn_varlen_fwd(q, k, v, cu_seqlens_k, cu_seqlens_q, sm_scale, sparse_layout,
                                      *, block_size=64, q_block_size=None, max_seqlen=None, config=None):
    """Causal block-sparse attention over packed (varlen) sequences.

    Args:
        q: [Tq, Hq, D] float16/bfloat16/float32 (D <= 256, any size).
        k, v: [Tk, Hkv, D], q's dtype; Hq % Hkv == 0 (GQA: head h reads h // (Hq / Hkv)).
        cu_seqlens_k: [B + 1] int32 cumulative key lengths.
        cu_seqlens_q: [B + 1] int32, or None: decode (one query per sequence) if
            Tq == B, else equal to cu_seqlens_k. Queries are the last q_len
            positions of their sequence.
        sm_scale: float or None (1 / sqrt(D)).
        sparse_layout: (crow [H, NB + 1], col [H, nnz]) int32 on q's device,
            H = Hq or 1; per head, columns ascending, the diagonal in every row.
        block_size: the layout's block size (16..256, a power of two).
        q_block_size: a multiple of block_size; a query attends to the union of
            the columns of the layout rows of its q block (exact causal mask).
        max_seqlen: static bound on sequence lengths (default: what the layout covers).
        config: optional kernel variant and tuning, overriding the planner's choice: a
            ``core_kernels.blocksparse_attention`` ``BlocksparsePrefillConfig`` (any batch),
            ``BlocksparseDecodeConfig`` (per-head split decode) or
            ``BlocksparseGroupDecodeConfig`` (GQA-packed split decode); the decode
            variants need a decode-only batch and q_block_size == block_size.
    Returns: [Tq, Hq, D] in q's dtype. No host synchronisation: works under
    torch.compile(fullgraph=True) and in CUDA graphs.
    """
    crow, col = sparse_layout
    return _bsattn_op(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col,
                      None if sm_scale is None else float(sm_scale), int(block_size),
                      None if q_block_size is None else int(q_block_size),
                      None if max_seqlen is None else int(max_seqlen), encode_config(config))


class LocalStridedBlockSparseAttn(torch.nn.Module):
    """Local + vertical-stride block-sparse attention (Phi-3-small style).

    Holds the layout of ``get_sparse_attn_mask`` as buffers; ``forward(q, k, v,
    cu_seqlens_k, cu_seqlens_q=None, sm_scale=None, *, config=None)`` -> [Tq, Hq, D],
    with Hq = n_heads, or h1 - h0 with ``active_head_range=(h0, h1)``; ``config`` as
    blocksparse_flash_attn_varlen_fwd's.
    """

    def __init__(self, n_heads, max_seqlen, local_blocks, vert_stride, block_size, device=None,
                 dtype=None, homo_head=False, active_head_range=None, q_block_size=None):
        super().__init__()
        (crow, col), block_mask = get_sparse_attn_mask(
            n_heads, max_seqlen, block_size, local_blocks, vert_stride, homo_head, active_head_range)
        if q_block_size is not None and (q_block_size < block_size or q_block_size % block_size):
            raise ValueError(f"q_block_size: expected a positive multiple of block_size={block_size}, "
                             f"got {q_block_size!r}")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if device is None else device
        self.register_buffer("crow", torch.from_numpy(crow.copy()).to(device), persistent=False)
        self.register_buffer("col", torch.from_numpy(col.copy()).to(device), persistent=False)
        self.block_mask = block_mask
        self.n_heads, self.max_seqlen, self.block_size = n_heads, max_seqlen, block_size
        self.local_blocks, self.vert_stride, self.q_block_size = local_blocks, vert_stride, q_block_size
        self.dtype = dtype

    @property
    def sparse_layout(self):
        return self.crow, self.col

    def forward(self, q, k, v, cu_seqlens_k, cu_seqlens_q=None, sm_scale=None, *, config=None):
        return blocksparse_flash_attn_varlen_fwd(
            q, k, v, cu_seqlens_k, cu_seqlens_q, sm_scale, (self.crow, self.col),
            block_size=self.block_size, q_block_size=self.q_block_size, max_seqlen=self.max_seqlen,
            config=config)

"""vLLM's block-sparse helpers for PyTorch: ``get_sparse_attn_mask`` and the
``LocalStridedBlockSparseAttn`` module, over blocksparse_flash_attn_varlen_fwd
(_ops_blocksparse.py)."""
from __future__ import annotations

import math

import numpy as np
import torch

from core_kernels.blocksparse_attention import (build_sparse_layout, get_head_sliding_step,
                                                local_strided_pattern, vllm_sparse_attn_mask)

from ._ops_blocksparse import blocksparse_flash_attn_varlen_fwd


def _torch_device(device):
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    return torch.device(device)


def get_sparse_attn_mask(n_heads, q_len, max_seqlen, dtype, device, block_size=64, local_blocks=4,
                         vert_stride=4, homo_head=True, return_dense=False, dense_mask_type="binary"):
    """vLLM's ``get_sparse_attn_mask`` (same positional order and results), as torch tensors.

    Args:
        n_heads: number of heads (of the CSR and of a per-head block_mask / dense_mask).
        q_len: query length; the CSR and dense mask cover the last q_len positions.
        max_seqlen: sequence length the layout covers.
        dtype: torch dtype of block_mask and dense_mask.
        device: torch device (or its name), or None (the current CUDA device, else CPU).
        block_size: layout block size (default 64).
        local_blocks: most recent blocks every query block keeps (default 4).
        vert_stride: every vert_stride-th block is kept too (default 4).
        homo_head: True (default): one pattern for all heads; False: the vertical
            offset slides from head to head (``get_head_sliding_step``).
        return_dense: also build the token-level dense mask.
        dense_mask_type: "binary" (default) or "bias"; anything else: ValueError.

    Returns ``((crow, col), block_mask, dense_mask)`` on ``device``:
    - block_mask: ``dtype`` 1/0, [NB, NB] if homo_head else [n_heads, NB, NB]
      (NB = ceil(max_seqlen / block_size)): the local + vertical-stride layout;
    - crow [n_heads, nbq + 1], col [n_heads, nnz] int64 (vLLM's dtype): CSR of the
      last nbq = ceil(q_len / block_size) rows, col padded with -1 (with homo_head
      one row set expanded over the heads, as vLLM does);
    - dense_mask: None, or with ``return_dense`` [n_heads, q_len, max_seqlen] in
      ``dtype``: query i (absolute position max_seqlen - q_len + i) and key j, with
      the token-level causal mask; "binary": 1 kept, 0 skipped; "bias": 0 kept,
      -inf skipped. (Memory: n_heads * q_len * max_seqlen elements.)
    The framework-free layout builder is ``core_kernels.blocksparse_attention.build_sparse_layout``.

    Transforms: builds the layout on the host (numpy) and copies it to ``device``; no
    kernel launch and no gradient.

    Example::

        (crow, col), block_mask, _ = get_sparse_attn_mask(32, 1, 4096, torch.bfloat16, "cuda",
                                                          block_size=64, homo_head=False)

    See docs/ops/blocksparse_attention.md ("The layout").
    """
    if dense_mask_type not in ("binary", "bias"):
        raise ValueError(f"dense_mask_type: expected 'binary' or 'bias', got {dense_mask_type!r}")
    (crow, col), block_mask, dense = vllm_sparse_attn_mask(
        n_heads, q_len, max_seqlen, block_size, local_blocks, vert_stride, bool(homo_head),
        bool(return_dense))
    device = _torch_device(device)
    crow_t, col_t = (torch.from_numpy(np.array(x[0])).to(device).expand(x.shape)
                     if homo_head else torch.from_numpy(np.array(x)).to(device)
                     for x in (crow, col))
    block_t = torch.from_numpy(np.array(block_mask)).to(device=device, dtype=dtype)
    dense_t = None
    if dense is not None:
        dense_b = torch.from_numpy(np.array(dense[:1] if homo_head else dense)).to(device)
        if dense_mask_type == "binary":
            dense_t = dense_b.to(dtype)
        else:
            dense_t = torch.zeros(dense_b.shape, dtype=dtype, device=device).masked_fill_(
                ~dense_b, float("-inf"))
        if homo_head:
            dense_t = dense_t.expand(dense.shape)
    return (crow_t, col_t), block_t, dense_t


def _pad_index(cu_seqlens, maxlen):
    """(token index [B, maxlen], valid [B, maxlen]) of the padded layout, on the device."""
    cu = cu_seqlens.to(torch.int64)
    pos = torch.arange(maxlen, device=cu.device)
    valid = pos[None, :] < (cu[1:] - cu[:-1])[:, None]
    return torch.where(valid, cu[:-1, None] + pos[None, :], 0), valid


def _unpad(x_padded, cu_seqlens, total):
    cu = cu_seqlens.to(device=x_padded.device, dtype=torch.int64)
    t = torch.arange(total, device=x_padded.device)
    b = torch.searchsorted(cu[1:], t, right=True)
    return x_padded[b, :, t - cu[b]]                                   # [total, H, D]


class LocalStridedBlockSparseAttn(torch.nn.Module):
    """Local + vertical-stride block-sparse attention (Phi-3-small style), vLLM's module.

    ``LocalStridedBlockSparseAttn(n_heads, max_seqlen, local_blocks, vert_stride,
    block_size, device=None, dtype=None, homo_head=False, active_head_range=None,
    q_block_size=None, use_spda=None)``:
    - the kernel's layout (``build_sparse_layout``, int32; heads h0..h1-1 with
      ``active_head_range=(h0, h1)``) is held as buffers; ``sparse_layout`` is
      (crow, col). With q_block_size it keeps block_size rows: the kernel merges them
      (vLLM's module stores the merged rows instead).
    - ``use_spda``: None (default) or False runs the Triton kernel, on every device
      (CPU tensors through Triton's interpreter); True runs ``spda`` (torch SDPA with
      the dense bias mask, prefill only, reads cu_seqlens on the host).
    - ``device`` (default: the current CUDA device, else CPU) holds the layout buffers
      and the dense mask; ``dtype`` (default bfloat16; float16 on a GPU older than
      sm_80) is the dense mask's.
    - ``homo_head`` defaults to False here (per-head shift, as Phi-3-small), unlike
      ``get_sparse_attn_mask``.
    ``forward(q, k, v, cu_seqlens_k, cu_seqlens_q=None, sm_scale=None, *, config=None,
    validate_indices=None)`` -> [Tq, Hq, D]; ``config`` and ``validate_indices`` as
    blocksparse_flash_attn_varlen_fwd's (kernel only).
    A falsy sm_scale means 1 / sqrt(D), as in vLLM.

    Transforms (kernel path): eager, ``torch.compile(fullgraph=True)``, CUDA graphs,
    DTensor and autograd, as ``blocksparse_flash_attn_varlen_fwd``. ``use_spda=True``
    runs torch SDPA instead and reads cu_seqlens on the host (a host sync).

    Example::

        attn = LocalStridedBlockSparseAttn(32, 8192, local_blocks=16, vert_stride=8,
                                           block_size=64, device="cuda")
        o = attn(q, k, v, cu_seqlens_k)        # q [Tq, 32, D], k/v [Tk, Hkv, D] bf16

    See docs/ops/blocksparse_attention.md.
    """

    def __init__(self, n_heads, max_seqlen, local_blocks, vert_stride, block_size, device=None,
                 dtype=None, homo_head=False, active_head_range=None, q_block_size=None,
                 use_spda=None):
        super().__init__()
        (crow, col), block_mask = build_sparse_layout(
            n_heads, max_seqlen, block_size, local_blocks, vert_stride, homo_head, active_head_range)
        if q_block_size is not None and (q_block_size < block_size or q_block_size % block_size):
            raise ValueError(f"q_block_size: expected a positive multiple of block_size={block_size}, "
                             f"got {q_block_size!r}")
        device = _torch_device(device)
        if dtype is None:
            old_gpu = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8
            dtype = torch.float16 if old_gpu else torch.bfloat16
        self.register_buffer("crow", torch.from_numpy(crow.copy()).to(device), persistent=False)
        self.register_buffer("col", torch.from_numpy(col.copy()).to(device), persistent=False)
        self.block_mask = block_mask
        self.n_heads, self.max_seqlen, self.block_size = n_heads, max_seqlen, block_size
        self.local_blocks, self.vert_stride, self.q_block_size = local_blocks, vert_stride, q_block_size
        self.homo_head = homo_head
        self.active_head_range = None if active_head_range is None else tuple(active_head_range)
        self.use_spda = bool(use_spda)
        self.device, self.dtype = device, dtype
        self.head_sliding_step = get_head_sliding_step(n_heads, vert_stride, homo_head)
        self.dense_attn_mask = self.get_attn_pattern(dtype, device)[2] if self.use_spda else None

    @property
    def sparse_layout(self):
        return self.crow, self.col

    def _attn_pattern(self, dtype, device, return_dense):
        return local_strided_pattern(get_sparse_attn_mask, self, dtype, device, return_dense)

    def get_attn_pattern(self, dtype, device):
        """vLLM's: (sparse_layout (int64 CSR), block pattern, dense bias mask or None
        (built when use_spda)), heads sliced to active_head_range unless homo_head."""
        return self._attn_pattern(dtype, device, self.use_spda)

    def varlen_attn(self, q, k, v, cu_seqlens_k, cu_seqlens_q=None, sm_scale=None, *, config=None,
                    validate_indices=None):
        """The Triton kernel: q [Tq, Hq, D], k/v [Tk, Hkv, D]; see blocksparse_flash_attn_varlen_fwd."""
        sm_scale = sm_scale or 1.0 / math.sqrt(q.shape[-1])
        return blocksparse_flash_attn_varlen_fwd(
            q, k, v, cu_seqlens_k, cu_seqlens_q, sm_scale, (self.crow, self.col),
            block_size=self.block_size, q_block_size=self.q_block_size, max_seqlen=self.max_seqlen,
            config=config, validate_indices=validate_indices)

    @staticmethod
    def transpose_and_pad(x, cu_seqlens, maxlen, head_repeats=1):
        """[T, H, D] packed -> [B, H * head_repeats, maxlen, D] (each head repeated
        head_repeats times in a row; positions past a sequence's end are 0). No host sync."""
        maxlen = int(maxlen)
        idx, valid = _pad_index(cu_seqlens.to(x.device), maxlen)
        if x.shape[0] == 0:
            g = x.new_zeros(idx.shape + tuple(x.shape[1:]))
        else:
            g = torch.where(valid[:, :, None, None], x[idx], 0).to(x.dtype)   # [B, maxlen, H, D]
        b, _, h, d = g.shape
        g = g.permute(0, 2, 1, 3)
        return g[:, :, None].expand(b, h, head_repeats, maxlen, d).reshape(b, h * head_repeats, maxlen, d)

    @staticmethod
    def transpose_and_unpad(x_padded, cu_seqlens):
        """[B, H, L, D] padded -> [cu_seqlens[-1], H, D] packed (reads cu_seqlens[-1] on the host)."""
        return _unpad(x_padded, cu_seqlens, int(cu_seqlens[-1]))

    def spda(self, q, k, v, cu_seqlens_k, cu_seqlens_q=None, sm_scale=None):
        """Dense fallback: torch SDPA over padded sequences with the layout's dense bias
        mask. Prefill only (cu_seqlens_q None or equal to cu_seqlens_k, Tq == Tk);
        reads the longest sequence length on the host."""
        if q.shape[0] != k.shape[0] or (cu_seqlens_q is not None and cu_seqlens_q is not cu_seqlens_k
                                         and not torch.equal(cu_seqlens_q.cpu(), cu_seqlens_k.cpu())):
            raise ValueError("cu_seqlens_q: spda runs prefill only (cu_seqlens_q None or equal to "
                             "cu_seqlens_k, and as many query as key tokens)")
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"k: {k.shape[1]} KV heads do not divide q's {q.shape[1]} heads")
        ratio = q.shape[1] // k.shape[1]
        sm_scale = sm_scale or 1.0 / math.sqrt(q.shape[-1])
        cu = cu_seqlens_k.cpu()
        maxlen = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        if self.dense_attn_mask is None or self.dense_attn_mask.dtype != q.dtype \
                or self.dense_attn_mask.device != q.device:
            self.dense_attn_mask = self._attn_pattern(q.dtype, q.device, True)[2]
        mask = self.dense_attn_mask[None, :, :maxlen, :maxlen]
        q2 = self.transpose_and_pad(q, cu_seqlens_k, maxlen, 1)
        k2, v2 = (self.transpose_and_pad(x, cu_seqlens_k, maxlen, ratio) for x in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask, scale=sm_scale)
        return _unpad(out, cu_seqlens_k, q.shape[0])

    def forward(self, q, k, v, cu_seqlens_k, cu_seqlens_q=None, sm_scale=None, *, config=None,
                validate_indices=None):
        """q [Tq, Hq, D], k/v [Tk, Hkv, D], cu_seqlens_k/q [B + 1] int32/int64 -> [Tq, Hq, D]
        in q's dtype; the kernel or ``spda`` (use_spda). A falsy sm_scale: 1 / sqrt(D).
        Other arguments as ``blocksparse_flash_attn_varlen_fwd``'s."""
        if k.dim() != 3:
            raise ValueError(f"k: expected shape [Tk, Hkv, D], got {tuple(k.shape)}")
        if self.use_spda:
            if config is not None:
                raise ValueError("config: the module runs torch SDPA (use_spda=True), not a kernel")
            return self.spda(q, k, v, cu_seqlens_k, cu_seqlens_q=cu_seqlens_q, sm_scale=sm_scale)
        return self.varlen_attn(q, k, v, cu_seqlens_k, cu_seqlens_q=cu_seqlens_q, sm_scale=sm_scale,
                                config=config, validate_indices=validate_indices)

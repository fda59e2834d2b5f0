"""Block-sparse varlen attention for PyTorch (a drop-in for vLLM's blocksparse API)."""
from __future__ import annotations

from typing import Optional

import math

import numpy as np
import torch

from core_kernels.blocksparse_attention.checks import check_blocksparse_attention
from core_kernels._plan import as_float, as_int, decode_config, encode_config
from core_kernels.blocksparse_attention import (NO_DECODE_CONFIG, BlocksparsePrefillConfig,
                                                build_sparse_layout, local_strided_pattern,
                                                get_head_sliding_step, plan_blocksparse_attention,
                                                plan_blocksparse_attention_backward,
                                                plan_blocksparse_attention_lse, vllm_sparse_attn_mask)
from core_kernels.blocksparse_attention.op import (BLOCKSPARSE_VARLEN, BLOCKSPARSE_VARLEN_BACKWARD,
                                                   BLOCKSPARSE_VARLEN_LSE)

from ._executor import CallMemo, execute, planned, run_plan
from ._index_validation import check_indices, index_validation
from ._register import custom_op


def _bsattn_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_k: torch.Tensor,
                 cu_seqlens_q: Optional[torch.Tensor], crow: torch.Tensor, col: torch.Tensor,
                 sm_scale: Optional[float], block_size: int, q_block_size: Optional[int],
                 max_seqlen: Optional[int], config: Optional[str]) -> torch.Tensor:
    return execute(plan_blocksparse_attention,
                   dict(q=q, k=k, v=v, cu_seqlens_k=cu_seqlens_k, cu_seqlens_q=cu_seqlens_q, crow=crow, col=col),
                   sm_scale=sm_scale, block_size=block_size, q_block_size=q_block_size,
                   max_seqlen=max_seqlen, config=decode_config(config))["output"]


# ---------------------------------------------------------------- autograd
# The backward needs each query row's LSE, which the inference op does not
# compute: a call that needs a gradient runs the functional op
# blocksparse_flash_attn_varlen_fwd_lse (the forward kernel's LSE variant; it has
# the backward) and returns its output.
def _tensors(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col, **more) -> dict:
    tensors = dict(q=q, k=k, v=v, cu_seqlens_k=cu_seqlens_k, crow=crow, col=col, **more)
    if cu_seqlens_q is not None:
        tensors["cu_seqlens_q"] = cu_seqlens_q
    return tensors


def _lse_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_k: torch.Tensor,
              cu_seqlens_q: Optional[torch.Tensor], crow: torch.Tensor, col: torch.Tensor,
              sm_scale: Optional[float], block_size: int, q_block_size: Optional[int],
              max_seqlen: Optional[int], config: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    plan, device = planned(plan_blocksparse_attention_lse,
                           dict(q=q, k=k, v=v, cu_seqlens_k=cu_seqlens_k, cu_seqlens_q=cu_seqlens_q,
                                crow=crow, col=col),
                           sm_scale=sm_scale, block_size=block_size, q_block_size=q_block_size,
                           max_seqlen=max_seqlen, config=decode_config(config))
    env = run_plan(plan, _tensors(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col), None, device)
    return env["output"], env["lse"]


def _lse_fake(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col, *options):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(q.shape[:2], dtype=torch.float32))


def _backward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor,
                   lse: torch.Tensor, grad_output: torch.Tensor, cu_seqlens_k: torch.Tensor,
                   cu_seqlens_q: Optional[torch.Tensor], crow: torch.Tensor, col: torch.Tensor,
                   sm_scale: Optional[float], block_size: int, q_block_size: Optional[int],
                   max_seqlen: Optional[int], config: Optional[str]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan, device = planned(plan_blocksparse_attention_backward,
                           dict(q=q, k=k, v=v, output=output, lse=lse, grad_output=grad_output,
                                cu_seqlens_k=cu_seqlens_k, cu_seqlens_q=cu_seqlens_q, crow=crow, col=col),
                           sm_scale=sm_scale, block_size=block_size, q_block_size=q_block_size,
                           max_seqlen=max_seqlen, config=decode_config(config))
    env = run_plan(plan, _tensors(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col, output=output,
                                  lse=lse, grad_output=grad_output), None, device)
    return tuple(env[r] for r in plan.results)


def _backward_fake(q, k, v, output, lse, grad_output, *rest):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


_backward_op = custom_op("blocksparse_flash_attn_varlen_backward", _backward_impl, fake=_backward_fake,
                         axes=BLOCKSPARSE_VARLEN_BACKWARD)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_k, cu_q, crow, col, sm_scale, block_size, q_block_size, max_seqlen, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_k, cu_q, crow, col)
    ctx.options = (sm_scale, block_size, q_block_size, max_seqlen)
    ctx.mark_non_differentiable(lse)  # an internal result: the public op returns the output only


def _backward(ctx, grad_output, grad_lse):
    q, k, v, out, lse, cu_k, cu_q, crow, col = ctx.saved_tensors
    # NOTE: the kernels read dO with unit stride along D and layout constexpr strides
    # for its rows; an expanded or permuted gradient (a sum()'s) is copied once
    grad_output = grad_output.contiguous()
    dq, dk, dv = _backward_op(q, k, v, out, lse, grad_output, cu_k, cu_q, crow, col, *ctx.options, None)
    return (dq, dk, dv) + (None,) * 9


_lse_op = custom_op("blocksparse_flash_attn_varlen_fwd_lse", _lse_impl, fake=_lse_fake,
                    autograd=(_backward, _setup_context), axes=BLOCKSPARSE_VARLEN_LSE)


def _bsattn_differentiable(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col, sm_scale, block_size,
                           q_block_size, max_seqlen, config):
    """The forward op's call when a gradient is needed: through the LSE op."""
    decoded = decode_config(config)
    if decoded is not None and not isinstance(decoded, BlocksparsePrefillConfig):
        raise ValueError(NO_DECODE_CONFIG + f", got {type(decoded).__name__}")
    return _lse_op(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col, sm_scale, block_size, q_block_size,
                   max_seqlen, config)[0]


_bsattn_op = custom_op("blocksparse_flash_attn_varlen_fwd", _bsattn_impl,
                       fake=lambda q, *args: torch.empty_like(q, memory_format=torch.contiguous_format),
                       differentiable=_bsattn_differentiable, axes=BLOCKSPARSE_VARLEN)


_MEMO = CallMemo(("q", "k", "v", "cu_seqlens_k", "cu_seqlens_q", "crow", "col"))


def blocksparse_flash_attn_varlen_fwd(q, k, v, cu_seqlens_k, cu_seqlens_q, sm_scale, sparse_layout,
                                      *, block_size=64, q_block_size=None, max_seqlen=None, config=None,
                                      validate_indices=None):
    """Causal block-sparse attention over packed (varlen) sequences.

    Args:
        q: [Tq, Hq, D] float16/bfloat16/float32 (D <= 256, any size).
        k, v: [Tk, Hkv, D], q's dtype; Hq % Hkv == 0 (GQA: head h reads h // (Hq / Hkv)).
        cu_seqlens_k: [B + 1] int32 or int64 cumulative key lengths.
        cu_seqlens_q: [B + 1] int32 or int64, or None: decode (one query per sequence) if
            Tq == B, else equal to cu_seqlens_k. Queries are the last q_len
            positions of their sequence.
        sm_scale: float or None (1 / sqrt(D)).
        sparse_layout: (crow [H, NB + 1], col [H, nnz]) int32 or int64 on q's device,
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
        validate_indices: True checks cu_seqlens_k/q, the layout and max_seqlen
            before the launch (one host sync; ValueError naming the argument); False
            never; None (default) follows TANDEM_VALIDATE_INDICES (docs/index_validation.md).

    Returns:
        [Tq, Hq, D] in q's dtype (a new tensor).

    Transforms: no host synchronisation (unless validating): eager,
    ``torch.compile(fullgraph=True)``, CUDA graphs, DTensor (sharded over heads) and
    autograd. CPU tensors run under Triton's interpreter on a machine without a GPU.

    Autograd: when grad mode is on and q, k or v requires grad, the call runs
    ``tandem_attn::blocksparse_flash_attn_varlen_fwd_lse`` (the prefill kernel,
    also saving each row's LSE; a decode ``config`` is refused with ValueError)
    whose backward (``blocksparse_flash_attn_varlen_backward``, deterministic:
    no atomics) gives dq, dk, dv in q's dtype. No double backward.

    Example::

        # 2 prefill sequences of 100 and 28 tokens, 64-token blocks
        (crow, col), _ = build_sparse_layout(Hq, 128, 64, local_blocks=1, vert_stride=2)
        layout = (torch.tensor(crow, device="cuda"), torch.tensor(col, device="cuda"))
        cu = torch.tensor([0, 100, 128], device="cuda", dtype=torch.int32)
        o = blocksparse_flash_attn_varlen_fwd(q, k, v, cu, cu, None, layout, block_size=64)

    ``build_sparse_layout`` is ``core_kernels.blocksparse_attention.build_sparse_layout``.
    See docs/ops/blocksparse_attention.md for the layout rules (a worked example) and tuning.
    """
    crow, col = sparse_layout
    tensors = (q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col)
    scalars = (sm_scale, block_size, q_block_size, max_seqlen, config)
    env = _MEMO.lookup(tensors, scalars, validate_indices)
    if env is not None:
        return env["output"]
    try:
        if index_validation(validate_indices, cu_seqlens_k, cu_seqlens_q, crow, col):
            _check_indices(q, k, cu_seqlens_k, cu_seqlens_q, crow, col, block_size, max_seqlen)
        out = _bsattn_op(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col,
                         None if sm_scale is None else as_float("sm_scale", sm_scale, finite=False),
                         as_int("block_size", block_size),
                         None if q_block_size is None else as_int("q_block_size", q_block_size),
                         None if max_seqlen is None else as_int("max_seqlen", max_seqlen),
                         encode_config(config))
    except BaseException:
        _MEMO.abandon()
        raise
    _MEMO.commit()
    return out


def _check_indices(q, k, cu_seqlens_k, cu_seqlens_q, crow, col, block_size, max_seqlen):
    """Index validation (one host sync); malformed arguments are left to the planner."""
    if not (isinstance(q, torch.Tensor) and q.dim() == 3 and isinstance(k, torch.Tensor)
            and k.dim() == 3):
        return
    check_indices(check_blocksparse_attention,
                  dict(cu_seqlens_k=cu_seqlens_k, cu_seqlens_q=cu_seqlens_q, crow=crow, col=col),
                  num_q_tokens=q.shape[0], num_k_tokens=k.shape[0], block_size=int(block_size),
                  max_seqlen=None if max_seqlen is None else int(max_seqlen))


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

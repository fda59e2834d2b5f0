"""context_attention_fwd for PyTorch: in place, a drop-in for vLLM's function."""
from __future__ import annotations

from typing import Optional

import torch

from core_kernels.prefix_prefill.checks import check_prefix_prefill
from core_kernels._plan import INT32_MAX, as_float, as_int, decode_config, encode_config
from core_kernels.prefix_prefill import plan_prefix_prefill
from core_kernels.prefix_prefill.op import CONTEXT_ATTENTION_FWD

from ._executor import CallMemo, execute
from ._index_validation import check_indices, index_validation
from ._register import custom_op
from ._scalars import scale_tensor


def _impl(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], o: torch.Tensor,
          kv_cache_dtype: str, k_cache: torch.Tensor, v_cache: torch.Tensor,
          b_loc: torch.Tensor, b_start_loc: torch.Tensor, b_seq_len: torch.Tensor,
          max_seq_len: int, max_input_len: int, k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
          alibi_slopes: Optional[torch.Tensor], sliding_window: Optional[int],
          sm_scale: Optional[float], skip_decode: bool, fp8_out_scale: Optional[torch.Tensor],
          sinks: Optional[torch.Tensor], causal: bool, interleaved_v_pack_factor: int,
          is_block_table_ptr: bool, config: Optional[str], batch_invariant: bool = False) -> None:
    # in the planner's positional order
    tensors = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, b_loc=b_loc,
                   b_start_loc=b_start_loc, b_seq_len=b_seq_len, output=o, k_scale=k_scale,
                   v_scale=v_scale, alibi_slopes=alibi_slopes, sinks=sinks,
                   fp8_out_scale=fp8_out_scale)
    execute(plan_prefix_prefill, tensors, max_input_len=max_input_len, max_seq_len=max_seq_len,
            kv_cache_dtype=kv_cache_dtype, sliding_window=sliding_window,
            sm_scale=sm_scale, skip_decode=skip_decode, causal=causal,
            interleaved_v_pack_factor=interleaved_v_pack_factor,
            is_block_table_ptr=is_block_table_ptr, config=decode_config(config),
            batch_invariant=batch_invariant)


_op = custom_op("context_attention_fwd", _impl, mutates_args=("o",), axes=CONTEXT_ATTENTION_FWD,
                renamed={"o": "output"})


_MEMO = CallMemo(("q", "k", "v", "output", "k_cache", "v_cache", "b_loc", "b_start_loc", "b_seq_len", "k_scale",
                  "v_scale", "alibi_slopes", "sinks", "fp8_out_scale"), written=("output",))


def context_attention_fwd(q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc,
                          b_seq_len, max_seq_len, max_input_len, k_scale=None, v_scale=None,
                          alibi_slopes=None, sliding_window=None, sm_scale=None,
                          skip_decode=False, fp8_out_scale=None, sinks=None,
                          is_block_table_ptr=False, interleaved_v_pack_factor=0, causal=True, *,
                          config=None, validate_indices=None, batch_invariant=False) -> None:
    """Causal attention of new tokens over their paged context and themselves; writes ``o``.

    Args:
        q: [T, Hq, D] float32/float16/bfloat16, the new tokens of all sequences, packed.
        k, v: [T, Hkv, D] (q's dtype), K/V of the new tokens; Hq % Hkv == 0. Both
            None: the new tokens' K/V are read from the paged cache (positions
            context_len .. seq_len - 1 of each sequence; not with alibi_slopes).
        o: [T, Hq, D] output, written in place: q's dtype, or float8_e4m3fn with
            ``fp8_out_scale`` (o = fp8(clamp(attn / fp8_out_scale))).
        kv_cache_dtype: "auto" (the cache dtype: q's, or an fp8 dtype), "fp8" /
            "fp8_e4m3" or "fp8_e5m2" (a uint8 cache is reinterpreted), or the
            name of a plain float dtype "float16" / "bfloat16" / "float32" (read
            as "auto", whatever the cache's float dtype, as vLLM's kernel does).
        k_cache: [num_blocks, Hkv, D // x, block_size, x]; v_cache: [num_blocks,
            Hkv, D, block_size]; any x dividing D, any block_size.
        b_loc: [B, max_blocks_per_seq] int32/int64 block table; b_start_loc: [B + 1]
            cumulative query starts; b_seq_len: [B] context + query lengths (all
            device data: new values never recompile).
        max_seq_len: an int >= 0 or None (vLLM's signature). > 0: an upper bound
            on every sequence's context length (b_seq_len minus its query
            length; vLLM passes its longest sequence) that sizes the scratch
            the paged context is gathered into, so that a block table much
            wider than the batch's contexts keeps the dense path; a sequence
            whose context exceeds it gets NaN outputs. 0 or None: the block
            table's width sizes the scratch (it may then be too big to use, and
            the context is read through the table). max_input_len: upper
            bound on the query length of any sequence (sets the grid; an int >= 0,
            a value above T acts as T).
        k_scale, v_scale: fp8 dequantisation scales (1-element float32 tensors:
            device data, or finite floats > 0), applied to fp8 cache values only.
        alibi_slopes: optional [Hq] float; sliding_window: None or <= 0 disables,
            else key t is visible to query position p iff p - t < window.
        sm_scale: softmax scale (default 1/sqrt(D)); sinks: optional [Hq] logits
            that join the softmax denominator only.
        skip_decode: rows of sequences with a query length of 1 are left untouched.
        is_block_table_ptr: ``b_loc`` (int64) holds device addresses of K cache
            blocks (``k_cache.data_ptr() + id * k_cache.stride(0) * itemsize``;
            0 for an unused slot), as vLLM passes them; the kernels turn them into
            ids on the device (no host sync); V blocks are found by the same id.
        interleaved_v_pack_factor: x > 0: ``v_cache`` (same 4-D shape, last two
            dims contiguous) holds [num_blocks, Hkv, block_size // x, D, x] in
            memory; 0: [num_blocks, Hkv, D, block_size].
        causal: False lets each new token attend to every new token of its
            sequence (and its whole context); not with alibi_slopes.
        config: optional ``core_kernels.prefix_prefill.PrefixPrefillConfig``
            overriding the tiling (and the context gather) the planner would choose.
        validate_indices: True checks b_loc, b_start_loc, b_seq_len and
            max_input_len against each other and the cache before the launch (one
            host sync; ValueError naming the argument); False never; None (default)
            follows TANDEM_VALIDATE_INDICES (docs/index_validation.md).
        batch_invariant: True makes each (token, head) row's result independent of the
            other sequences of the batch: the context read through the paged cache
            uses the tiles of the gathered one, whichever the batch's size picks
            (16-bit D=128: a slower paged loop; docs/composability.md, "Batch invariance").
    All tensors may have any strides. CPU tensors run under Triton's interpreter on
    a machine without a GPU.

    Returns:
        None: ``o`` is written in place (rows skipped by ``skip_decode`` untouched).

    Transforms: eager, ``torch.compile(fullgraph=True)``, CUDA graphs (index data is
    never read on the host unless validating) and DTensor (sharded over heads).
    Forward only: a call that needs a backward raises RuntimeError.

    Example::

        # 2 sequences: 3 new tokens over 6 cached, 1 new token over 4 cached
        q = torch.randn(4, Hq, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(4, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        o = torch.empty_like(q)
        b_start_loc = torch.tensor([0, 3, 4], device="cuda", dtype=torch.int32)
        b_seq_len = torch.tensor([9, 5], device="cuda", dtype=torch.int32)
        context_attention_fwd(q, k, v, o, "auto", k_cache, v_cache, b_loc, b_start_loc,
                              b_seq_len, max_seq_len=6, max_input_len=3)

    See docs/ops/prefix_prefill.md for the paged-cache layout (a worked example),
    numerics, memory and tuning.
    """
    if _MEMO.lookup((q, k, v, o, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, k_scale, v_scale, alibi_slopes,
                     sinks, fp8_out_scale),
                    (kv_cache_dtype, max_seq_len, max_input_len, sliding_window, sm_scale, skip_decode,
                     is_block_table_ptr, interleaved_v_pack_factor, causal, config, batch_invariant),
                    validate_indices) is not None:
        return
    try:
        if index_validation(validate_indices, b_loc, b_start_loc, b_seq_len):
            _check_indices(q, k, k_cache, b_loc, b_start_loc, b_seq_len, max_input_len,
                           sliding_window, skip_decode, is_block_table_ptr, max_seq_len)
        # host scalars as plain ints / floats (docs/scalar_policy.md); ranges are the planner's
        _op(q, k, v, o, kv_cache_dtype, k_cache, v_cache, b_loc, b_start_loc, b_seq_len,
            0 if max_seq_len is None else as_int("max_seq_len", max_seq_len, 0, INT32_MAX),
            as_int("max_input_len", max_input_len), scale_tensor("k_scale", k_scale, q),
            scale_tensor("v_scale", v_scale, q), alibi_slopes,
            None if sliding_window is None else as_int("sliding_window", sliding_window),
            None if sm_scale is None else as_float("sm_scale", sm_scale, finite=False),
            bool(skip_decode), scale_tensor("fp8_out_scale", fp8_out_scale, q), sinks, bool(causal),
            as_int("interleaved_v_pack_factor", interleaved_v_pack_factor, 0, INT32_MAX),
            bool(is_block_table_ptr), encode_config(config), bool(batch_invariant))
    except BaseException:
        _MEMO.abandon()
        raise
    _MEMO.commit()


def _check_indices(q, k, k_cache, b_loc, b_start_loc, b_seq_len, max_input_len, sliding_window,
                   skip_decode, is_block_table_ptr, max_seq_len=0):
    """Index validation (one host sync); malformed arguments are left to the planner."""
    if not (isinstance(q, torch.Tensor) and q.dim() == 3 and isinstance(k_cache, torch.Tensor)
            and k_cache.dim() == 5):
        return
    check_indices(check_prefix_prefill,
                  dict(b_loc=b_loc, b_start_loc=b_start_loc, b_seq_len=b_seq_len),
                  num_tokens=q.shape[0], num_blocks=k_cache.shape[0], block_size=k_cache.shape[3],
                  max_input_len=int(max_input_len),
                  sliding_window=None if sliding_window is None else int(sliding_window),
                  skip_decode=bool(skip_decode), cache_new=k is None,
                  is_block_table_ptr=bool(is_block_table_ptr),
                  k_cache_address=k_cache.data_ptr(),
                  block_bytes=k_cache.stride(0) * k_cache.element_size(),
                  max_seq_len=int(max_seq_len or 0))

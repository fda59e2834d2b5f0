"""unified_attention for PyTorch: in place, a drop-in for vLLM's function (its
TRITON_ATTN backend's one kernel for prefill and decode)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from core_kernels._plan import decode_config, encode_config
from core_kernels.unified_attention import check_unified_attention, plan_unified_attention
from core_kernels.unified_attention.checks import check_static
from core_kernels.unified_attention.options import host_options, kv_mode, window_pair
from core_kernels.unified_attention.op import UNIFIED_ATTENTION

from ._executor import CallMemo, execute
from ._index_validation import check_indices, index_validation
from ._register import custom_op
from ._scalars import scale_tensor


def _impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
          cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
          causal_flags: Optional[torch.Tensor], q_descale: Optional[torch.Tensor],
          k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor],
          alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
          output_scale: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
          softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
          use_alibi_sqrt: bool, kv_quant_mode: int, config: Optional[str]) -> None:
    execute(plan_unified_attention,
            dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                 block_table=block_table, out=out, causal_flags=causal_flags, q_descale=q_descale,
                 k_descale=k_descale, v_descale=v_descale, alibi_slopes=alibi_slopes, sinks=sinks,
                 output_scale=output_scale),
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
            causal=causal, window_left=window_left, window_right=window_right, softcap=softcap,
            use_alibi_sqrt=use_alibi_sqrt, kv_quant_mode=kv_quant_mode, config=decode_config(config))


_op = custom_op("unified_attention", _impl, mutates_args=("out",), axes=UNIFIED_ATTENTION)

_MEMO = CallMemo(("q", "k", "v", "cu_seqlens_q", "seqused_k", "block_table", "out", "causal_flags",
                  "q_descale", "k_descale", "v_descale", "alibi_slopes", "sinks", "output_scale"),
                 written=("out",))


def _refuse_out_of_scope(qq_bias, mm_prefix_range, rswa_prefix_lens, rswa_window, chunk_lookback,
                         use_td) -> None:
    """vLLM's modes this op does not implement: NotImplementedError naming the
    argument unless it has its "off" value."""
    for name, value in (("qq_bias", qq_bias), ("mm_prefix_range", mm_prefix_range),
                        ("rswa_prefix_lens", rswa_prefix_lens), ("rswa_window", rswa_window)):
        if value is not None:
            raise NotImplementedError(f"{name}: not supported by this unified_attention (pass None)")
    if chunk_lookback not in (-1, None):
        raise NotImplementedError(f"chunk_lookback: chunked attention with lookback is not supported "
                                  f"(pass -1), got {chunk_lookback!r}")
    if use_td:
        raise NotImplementedError("use_td: tensor-descriptor loads (Intel Xe) are not supported "
                                  "(pass False)")


def unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
                      softmax_scale, causal, window_size, block_table, softcap, q_descale,
                      k_descale, v_descale, seq_threshold_3D=None, num_par_softmax_segments=None,
                      softmax_segm_output=None, softmax_segm_max=None, softmax_segm_expsum=None,
                      alibi_slopes=None, output_scale=None, qq_bias=None, sinks=None,
                      mm_prefix_range=None, rswa_prefix_lens=None, rswa_window=None,
                      use_alibi_sqrt=False, kv_quant_mode=0, k_scale_cache=None, v_scale_cache=None,
                      chunk_lookback=-1, use_td=False, mm_prefix_clamp_sliding_window=False,
                      raw_k=None, raw_v=None, *, config=None, validate_indices=None) -> None:
    """Paged attention of packed new tokens over their KV cache, prefill and
    decode in one call; writes ``out``. vLLM's ``unified_attention``
    (vllm/v1/attention/ops/triton_unified_attention.py), argument for argument.

    Args:
        q: [T, Hq, D] float32/float16/bfloat16 (or float8_e4m3fn with ``q_descale``),
            the new tokens of B sequences packed: sequence b owns rows
            cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1. Any D <= 256.
        k, v: [num_blocks, block_size, Hkv, D] paged cache (vLLM's flash layout;
            the new tokens' K/V already written), q's dtype or float8_e4m3fn / uint8
            holding e4m3 (with ``k_descale`` / ``v_descale``); Hq % Hkv == 0; any
            block_size (544 included).
        out: [T, Hq, D] written in place: q's dtype (a float dtype for an fp8 q), or
            float8_e4m3fn with ``output_scale``. Rows past cu_seqlens_q[B] untouched.
        cu_seqlens_q: [B + 1] int32/int64 cumulative query lengths; seqused_k: [B]
            total key lengths (context + new tokens); block_table: [B, max_blocks]
            int32/int64 physical block of each logical block. Device data: new
            values never recompile; entries past a sequence's length are never read.
        max_seqlen_q, max_seqlen_k: host ints, bounds on every query length /
            seqused_k (they size the grid and the decode split).
        softmax_scale: host float. causal: a truth value, or a [B] bool tensor of
            per-sequence flags (False: a sequence's queries see all its keys).
        window_size: (left, right); left >= 0 limits a query at position p to keys
            p - left .. p (non-causal sequences: p - left .. p + left); (-1, -1): none.
        softcap: 0 (off) or c > 0: s = c * tanh(s / c) before ALiBi and the mask.
        q_descale: None or a 1-element float32 tensor (an fp8 q). k_descale,
            v_descale: 1-element or [B, Hkv] float32 tensors (an fp8 cache; ignored
            for a plain cache, as vLLM passes them for every cache). Host floats > 0
            are accepted too.
        seq_threshold_3D, num_par_softmax_segments, softmax_segm_output,
            softmax_segm_max, softmax_segm_expsum: vLLM's split-decode scratch;
            accepted and ignored (the planner picks its own split).
        alibi_slopes: optional [Hq] float (``use_alibi_sqrt``: the sqrt variant).
        output_scale: optional 1-element float32 tensor or float > 0: out =
            fp8(clamp(attn / output_scale)).
        sinks: optional [Hq] float logits joining the softmax denominator.
        kv_quant_mode: vLLM's KVQuantMode (the enum, its int or its name): NONE or
            FP8_PER_TENSOR (an fp8 cache's dtype implies it).
        qq_bias, mm_prefix_range, rswa_prefix_lens, rswa_window, chunk_lookback,
            use_td, per-token-head / INT4 / NVFP4 kv_quant_mode: not supported
            (NotImplementedError naming the argument) unless at their off values.
        k_scale_cache, v_scale_cache, raw_k, raw_v, mm_prefix_clamp_sliding_window:
            read only by modes not supported here; ignored.
        config: optional prefill or decode config of core_kernels.unified_attention
            overriding the planner's choice for that path.
        validate_indices: True checks cu_seqlens_q, seqused_k, block_table and the
            max_seqlen bounds against each other and the cache before the launch
            (one host sync; ValueError naming the argument); False never; None
            (default) follows TANDEM_VALIDATE_INDICES (docs/index_validation.md).

    Returns:
        None: ``out`` is written in place.

    Transforms: eager (repeated calls replayed: CallMemo), ``torch.compile(fullgraph=True)``,
    CUDA graphs (index data is never read on the host unless validating), DTensor
    (sharded over heads). Forward only. CPU tensors run under Triton's interpreter.

    See docs/ops/unified_attention.md.
    """
    if qq_bias is not None or mm_prefix_range is not None or rswa_prefix_lens is not None \
            or rswa_window is not None or chunk_lookback not in (-1, None) or use_td:
        _refuse_out_of_scope(qq_bias, mm_prefix_range, rswa_prefix_lens, rswa_window, chunk_lookback,
                             use_td)
    mode = kv_mode(kv_quant_mode)
    flags = causal if isinstance(causal, torch.Tensor) else None
    if flags is None and isinstance(causal, (list, tuple, np.ndarray)) and np.ndim(causal) > 0:
        raise TypeError("causal: expected a truth value or a [B] bool / int tensor of per-sequence "
                        f"flags, got {type(causal).__name__}")
    wl, wr = window_pair(window_size)
    if _MEMO.lookup((q, k, v, cu_seqlens_q, seqused_k, block_table, out, flags, q_descale, k_descale,
                     v_descale, alibi_slopes, sinks, output_scale),
                    (max_seqlen_q, max_seqlen_k, softmax_scale, None if flags is not None else causal,
                     wl, wr, softcap, use_alibi_sqrt, mode, config),
                    validate_indices) is not None:
        return
    try:
        # host scalars as plain ints / floats (docs/scalar_policy.md); ranges are the planner's
        opts = host_options(max_seqlen_q, max_seqlen_k, softmax_scale, (wl, wr), softcap)
        if index_validation(validate_indices, cu_seqlens_q, seqused_k, block_table):
            static = check_static(q, k, opts["max_seqlen_q"], opts["max_seqlen_k"], opts["window_left"])
            if static is not None:  # None: malformed shapes (the planner's error)
                check_indices(check_unified_attention, dict(cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                                                            block_table=block_table), **static)
        _op(q, k, v, out, cu_seqlens_q, seqused_k, block_table, flags,
            scale_tensor("q_descale", q_descale, q), scale_tensor("k_descale", k_descale, q),
            scale_tensor("v_descale", v_descale, q), alibi_slopes, sinks,
            scale_tensor("output_scale", output_scale, q), opts["max_seqlen_q"], opts["max_seqlen_k"],
            opts["softmax_scale"], True if flags is not None else bool(causal), opts["window_left"],
            opts["window_right"], opts["softcap"], bool(use_alibi_sqrt), mode, encode_config(config))
    except BaseException:
        _MEMO.abandon()
        raise
    _MEMO.commit()

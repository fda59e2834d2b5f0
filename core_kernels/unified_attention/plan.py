"""Launch plan of unified_attention (framework-free): validation (problem.py),
then the prefill path's launches (prefill_plan.py) for sequences with more than
DECODE_MAX_Q new tokens and the decode path's (decode_plan.py) for the rest."""
from __future__ import annotations

from .._plan import INT32_MAX, Plan, as_int, check_config, memoize, next_pow2
from .._target import Target
from .decode_plan import DECODE_CONFIGS, decode_launches
from .prefill_plan import PREFILL_CONFIGS, prefill_launches
from .problem import DECODE_MAX_Q, validate


def plan_unified_attention(target: Target, q, k, v, cu_seqlens_q, seqused_k, block_table,
                           out=None, causal_flags=None, q_descale=None, k_descale=None,
                           v_descale=None, alibi_slopes=None, sinks=None, output_scale=None, *,
                           max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                           causal: bool = True, window_left: int = -1, window_right: int = -1,
                           softcap: float = 0.0, use_alibi_sqrt: bool = False,
                           kv_quant_mode=0, out_dtype: str | None = None,
                           config=None) -> Plan:
    """Plan unified paged attention (contract: docs/ops/unified_attention.md).

    ``max_seqlen_q`` / ``max_seqlen_k`` are bounds: rounded up to powers of two
    before the (cached) planning, so a serving loop whose longest sequence
    grows by one token per step reuses one plan per doubling instead of
    planning every step (they size grids, scratch and the tiles of short
    queries: decode_plan.py, prefill_plan.py).
    """
    def bound(name, value):
        n = as_int(name, value, 0, INT32_MAX)
        return min(next_pow2(n), INT32_MAX) if n > 0 else 0
    return _plan(target, q, k, v, cu_seqlens_q, seqused_k, block_table, out, causal_flags,
                 q_descale, k_descale, v_descale, alibi_slopes, sinks, output_scale,
                 max_seqlen_q=bound("max_seqlen_q", max_seqlen_q),
                 max_seqlen_k=bound("max_seqlen_k", max_seqlen_k), softmax_scale=softmax_scale,
                 causal=causal, window_left=window_left, window_right=window_right,
                 softcap=softcap, use_alibi_sqrt=use_alibi_sqrt, kv_quant_mode=kv_quant_mode,
                 out_dtype=out_dtype, config=config)


@memoize
def _plan(target, q, k, v, cu_seqlens_q, seqused_k, block_table, out, causal_flags, q_descale,
          k_descale, v_descale, alibi_slopes, sinks, output_scale, *, max_seqlen_q, max_seqlen_k,
          softmax_scale, causal, window_left, window_right, softcap, use_alibi_sqrt,
          kv_quant_mode, out_dtype, config) -> Plan:
    """plan_unified_attention with its bounds rounded (cached on the arguments).

    Arrays are ArrayInfo (optional ones None). ``out`` given: updated in place
    (torch; JAX aliases it), rows of no sequence keep their values; otherwise
    the plan allocates a zero-filled "out". ``causal_flags`` [B]: per-sequence
    causal flags (then ``causal`` is ignored). ``config``: a prefill or decode
    config overrides that path's choice.
    """
    check_config(config, PREFILL_CONFIGS + DECODE_CONFIGS)
    p = validate(q, k, v, cu_seqlens_q, seqused_k, block_table, out, causal_flags, q_descale,
                 k_descale, v_descale, alibi_slopes, sinks, output_scale,
                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                 softmax_scale=softmax_scale, causal=causal, window_left=window_left,
                 window_right=window_right, softcap=softcap, use_alibi_sqrt=use_alibi_sqrt,
                 kv_quant_mode=kv_quant_mode, out_dtype=out_dtype)
    if p.empty:
        return Plan(p.buffers, (), ("out",))
    buffers, launches = dict(p.buffers), []
    if p.max_seqlen_q > DECODE_MAX_Q:
        b, l = prefill_launches(target, p, config if isinstance(config, PREFILL_CONFIGS) else None)
        buffers.update(b)
        launches += l
    b, l = decode_launches(target, p, config if isinstance(config, DECODE_CONFIGS) else None)
    buffers.update(b)
    launches += l
    return Plan(buffers, tuple(launches), ("out",))

"""The validated problem of unified_attention (framework-free): every check of
the arguments, in one place, before any launch; errors name the argument.

The planner (plan.py) turns a :class:`Problem` into launches: the prefill
path (prefill_plan.py) for sequences with more than ``DECODE_MAX_Q`` new
tokens and the split-KV decode path (decode_plan.py) for the others. Which
path a sequence takes depends on its own query length only (device data read
by the kernels), so a sequence's result never depends on the other sequences
of the call.
"""
from __future__ import annotations

import dataclasses
import math

from .._plan import (FLOAT_DTYPES, FP32_MAX, INT32_MAX, INT_DTYPES, ArrayInfo, Buffer, as_float,
                     as_int, check_dtype, check_inner_contiguous, check_ndim, check_shape,
                     next_pow2)

LOG2E = 1.4426950408889634
HEAD_SIZES = (64, 80, 96, 128, 256)  # the list; any 1 <= D <= 256 is accepted
MAX_HEAD_SIZE = 256
FP8_E4M3 = "float8_e4m3fn"
# vLLM's KVQuantMode values (vllm/v1/kv_cache_interface.py): accepted as the enum,
# its int or its name
KV_QUANT_MODES = {"NONE": 0, "FP8_PER_TENSOR": 1, "INT8_PER_TOKEN_HEAD": 2,
                  "FP8_PER_TOKEN_HEAD": 3, "INT4_PER_TOKEN_HEAD": 4, "INT2_PER_TOKEN_HEAD": 5}
SUPPORTED_KV_QUANT_MODES = (0, 1)


def kv_quant_mode_value(mode) -> int:
    """vLLM's KVQuantMode (an enum member, its int value or its name) -> int."""
    if mode is None:
        return 0
    name = getattr(mode, "name", None)
    if isinstance(name, str) and name in KV_QUANT_MODES:
        return KV_QUANT_MODES[name]
    if isinstance(mode, str):
        key = mode.upper().split(".")[-1]
        if key not in KV_QUANT_MODES:
            raise ValueError(f"kv_quant_mode: unknown mode {mode!r}; expected one of "
                             f"{tuple(KV_QUANT_MODES)}")
        return KV_QUANT_MODES[key]
    value = as_int("kv_quant_mode", getattr(mode, "value", mode), 0)
    if value not in KV_QUANT_MODES.values():
        raise ValueError(f"kv_quant_mode: unknown mode {value}")
    return value


@dataclasses.dataclass(frozen=True)
class Problem:
    """Everything a launch builder needs, validated. Array names (the planner's
    parameters, the adapters' buffer names): q, k, v, cu_seqlens_q, seqused_k,
    block_table, out, causal_flags, q_descale, k_descale, v_descale,
    alibi_slopes, sinks, output_scale."""
    t: int                    # query tokens (q.shape[0])
    hq: int
    hkv: int
    d: int
    block_d: int              # head size padded to a power of two >= 16
    group: int                # query heads per kv head
    bsz: int                  # sequences (seqused_k.shape[0])
    num_blocks: int
    block_size: int           # tokens per cache block (any positive int, e.g. 544)
    table_width: int          # block_table.shape[1]
    max_seqlen_q: int         # bound on every qlen (min(given, T))
    max_seqlen_k: int         # bound on every seqused_k
    q_dtype: str              # float16 / bfloat16 / float32 / float8_e4m3fn
    kv_dtype: str             # the cache's dtype (q's, or an fp8 dtype / uint8 holding e4m3)
    kv_fp8: bool              # the cache holds e4m3 (kv_quant_mode FP8_PER_TENSOR)
    q_fp8: bool               # q is e4m3 (q_descale given)
    compute_dtype: str        # dtype of the MMA operands: q's, or bfloat16 / float16 for fp8 q
    out_dtype: str
    out_fp8: bool             # output_scale given: out = clamp(o / output_scale) as e4m3
    scale: float              # softmax_scale
    causal: bool              # the bool option (ignored where causal_flags is given)
    causal_flags: bool        # a per-sequence bool/int array "causal_flags" [B] is given
    window_left: int          # -1: unbounded
    window_right: int         # -1: unbounded (causal: 0 in effect)
    softcap: float            # 0: off
    alibi: bool
    alibi_sqrt: bool
    sinks: bool
    # descale arrays: strides (in elements) along (sequence, kv head); (0, 0) for a scalar
    q_descale_strides: tuple | None
    k_descale_strides: tuple | None
    v_descale_strides: tuple | None
    offs32: bool              # every cache offset fits in int32
    strides: dict             # q/out/cache strides by name: q_t q_h q_d o_t o_h o_d kc_b kc_t kc_h kc_d vc_b vc_t vc_h vc_d
    table_strides: tuple      # block_table's (row, column) strides
    buffers: dict             # Buffers the plan allocates ("out" when not given)

    @property
    def empty(self) -> bool:
        return self.t == 0 or self.bsz == 0 or self.hq == 0 or self.max_seqlen_q == 0


def _check_descale(name, info, bsz, hkv, per_seq_head: bool):
    """(strides along sequence, kv head) of a descale array: a scalar ([] / [1]),
    or (k/v only) [B, Hkv] with any strides (vLLM passes an expanded scalar)."""
    if info is None:
        return None
    check_dtype(name, info, ("float32",))
    if math.prod(info.shape) == 1 and info.ndim <= 1:
        return (0, 0)
    if per_seq_head and info.ndim == 2 and tuple(info.shape) == (bsz, hkv):
        return tuple(info.strides)
    want = "a 1-element array or [B, Hkv]" if per_seq_head else "a 1-element array"
    raise ValueError(f"{name}: expected {want}, got shape {tuple(info.shape)}")


def validate(q, k, v, cu_seqlens_q, seqused_k, block_table, out=None, causal_flags=None,
             q_descale=None, k_descale=None, v_descale=None, alibi_slopes=None, sinks=None,
             output_scale=None, *, max_seqlen_q, max_seqlen_k, softmax_scale, causal=True,
             window_left=-1, window_right=-1, softcap=0.0, use_alibi_sqrt=False,
             kv_quant_mode=0, out_dtype=None) -> Problem:
    """Check every argument (ArrayInfo or None; options as given) -> Problem."""
    mode = kv_quant_mode_value(kv_quant_mode)
    if mode not in SUPPORTED_KV_QUANT_MODES:
        name = [n for n, m in KV_QUANT_MODES.items() if m == mode][0]
        raise NotImplementedError(f"kv_quant_mode: {name} is not supported (NONE and "
                                  "FP8_PER_TENSOR are)")
    check_ndim("q", q, 3, "[T, Hq, D]")
    check_dtype("q", q, FLOAT_DTYPES + (FP8_E4M3,))
    t, hq, d = q.shape
    if not 1 <= d <= MAX_HEAD_SIZE:
        raise ValueError(f"q: head size {d} is not in [1, {MAX_HEAD_SIZE}]")
    check_ndim("k", k, 4, "[num_blocks, block_size, Hkv, D]")
    num_blocks, block_size, hkv, dk = k.shape
    if dk != d:
        raise ValueError(f"k: head size {dk} differs from q's {d}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q: {hq} query heads is not a multiple of k's {hkv} kv heads")
    if block_size < 1:
        raise ValueError(f"k: block_size = shape[1] must be positive, got {block_size}")
    check_shape("v", v, k.shape, "same as k: [num_blocks, block_size, Hkv, D]")
    if v.dtype != k.dtype:
        raise TypeError(f"v: dtype {v.dtype} differs from k's {k.dtype}")
    for name, info in (("q", q), ("k", k), ("v", v)):
        check_inner_contiguous(name, info)
    kv_fp8 = mode == 1 or k.dtype in (FP8_E4M3, "uint8")
    if kv_fp8:
        if k.dtype not in (FP8_E4M3, "uint8"):
            raise TypeError(f"k: kv_quant_mode FP8_PER_TENSOR needs an {FP8_E4M3} (or uint8) "
                            f"cache, got {k.dtype}")
        if k_descale is None or v_descale is None:
            raise ValueError(f"{'k_descale' if k_descale is None else 'v_descale'}: required "
                             "with an fp8 cache")
    q_fp8 = q.dtype == FP8_E4M3
    if q_fp8 and q_descale is None:
        raise ValueError("q_descale: required with an fp8 q")
    if not kv_fp8 and not q_fp8 and k.dtype != q.dtype:
        raise TypeError(f"k: dtype {k.dtype} differs from q's {q.dtype} (an fp8 cache needs "
                        "kv_quant_mode FP8_PER_TENSOR and k_descale / v_descale)")
    if q_fp8 and not kv_fp8:
        raise TypeError(f"q: an fp8 q needs an fp8 cache, got k of dtype {k.dtype}")

    check_ndim("block_table", block_table, 2, "[B, max_blocks_per_seq]")
    check_dtype("block_table", block_table, INT_DTYPES)
    check_ndim("seqused_k", seqused_k, 1, "[B]")
    bsz = seqused_k.shape[0]
    if block_table.shape[0] != bsz:
        raise ValueError(f"block_table: {block_table.shape[0]} rows, expected one per sequence "
                         f"(seqused_k has {bsz})")
    check_shape("cu_seqlens_q", cu_seqlens_q, (bsz + 1,), "[B + 1]")
    for name, info in (("cu_seqlens_q", cu_seqlens_q), ("seqused_k", seqused_k)):
        check_dtype(name, info, INT_DTYPES)
        check_inner_contiguous(name, info)
    if causal_flags is not None:
        check_shape("causal", causal_flags, (bsz,), "[B], one flag per sequence")
        check_dtype("causal", causal_flags, ("bool", "int8", "int32", "int64", "uint8"))
        check_inner_contiguous("causal", causal_flags)
    for name, info in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if info is not None:
            check_shape(name, info, (hq,), "[Hq]")
            check_dtype(name, info, FLOAT_DTYPES)
            check_inner_contiguous(name, info)
    q_ds = _check_descale("q_descale", q_descale, bsz, hkv, False)
    k_ds = _check_descale("k_descale", k_descale, bsz, hkv, True)
    v_ds = _check_descale("v_descale", v_descale, bsz, hkv, True)
    if output_scale is not None:
        check_dtype("output_scale", output_scale, ("float32",))
        if math.prod(output_scale.shape) != 1:
            raise ValueError(f"output_scale: expected a 1-element array, got shape "
                             f"{tuple(output_scale.shape)}")

    max_seqlen_q = min(as_int("max_seqlen_q", max_seqlen_q, 0, INT32_MAX), t)
    max_seqlen_k = as_int("max_seqlen_k", max_seqlen_k, 0, INT32_MAX)
    scale = as_float("softmax_scale", softmax_scale)
    if not abs(scale * LOG2E) <= FP32_MAX:
        raise ValueError(f"softmax_scale: {scale} * log2(e) overflows float32")
    wl = as_int("window_size", window_left, -1, INT32_MAX, "left, -1 for none")
    wr = as_int("window_size", window_right, -1, INT32_MAX, "right, -1 for none")
    softcap = as_float("softcap", softcap)
    if softcap < 0:
        raise ValueError(f"softcap: expected 0 (off) or a positive cap, got {softcap}")
    if use_alibi_sqrt and alibi_slopes is None:
        raise ValueError("use_alibi_sqrt: needs alibi_slopes")

    compute = q.dtype
    if q_fp8:
        compute = "bfloat16" if out_dtype in (None, "bfloat16", FP8_E4M3) else out_dtype
    elif kv_fp8:
        compute = q.dtype
    if output_scale is not None:
        want_out = FP8_E4M3
    elif out_dtype is not None:
        want_out = out_dtype
    else:
        want_out = "bfloat16" if q_fp8 else q.dtype
    if out is not None:
        check_shape("out", out, (t, hq, d), "[T, Hq, D]")
        check_inner_contiguous("out", out)
        if out.dtype != want_out and not (q_fp8 and output_scale is None
                                          and out.dtype in FLOAT_DTYPES):
            raise TypeError(f"out: dtype {out.dtype}, expected {want_out}"
                            + (" (output_scale given)" if output_scale is not None else ""))
        want_out = out.dtype
        buffers = {}
        o_strides = out.strides
    else:
        buffers = {"out": Buffer((t, hq, d), want_out, zero_init=True)}
        o_strides = ArrayInfo.contiguous((t, hq, d), want_out).strides
    if q_fp8 and output_scale is None:
        compute = want_out if want_out in ("float16", "bfloat16") else "bfloat16"

    strides = dict(zip(("q_t", "q_h", "q_d"), q.strides))
    strides.update(zip(("o_t", "o_h", "o_d"), o_strides))
    strides.update(zip(("kc_b", "kc_t", "kc_h", "kc_d"), k.strides))
    strides.update(zip(("vc_b", "vc_t", "vc_h", "vc_d"), v.strides))
    offs32 = all(sum((n - 1) * st for n, st in zip(c.shape, c.strides)) < 2 ** 31 for c in (k, v))
    return Problem(
        t=t, hq=hq, hkv=hkv, d=d, block_d=max(16, next_pow2(d)), group=hq // hkv, bsz=bsz,
        num_blocks=num_blocks, block_size=block_size, table_width=block_table.shape[1],
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, q_dtype=q.dtype, kv_dtype=k.dtype,
        kv_fp8=kv_fp8, q_fp8=q_fp8, compute_dtype=compute, out_dtype=want_out,
        out_fp8=output_scale is not None, scale=scale, causal=bool(causal),
        causal_flags=causal_flags is not None, window_left=wl, window_right=wr, softcap=softcap,
        alibi=alibi_slopes is not None, alibi_sqrt=bool(use_alibi_sqrt), sinks=sinks is not None,
        q_descale_strides=q_ds, k_descale_strides=k_ds, v_descale_strides=v_ds, offs32=offs32,
        strides=strides, table_strides=tuple(block_table.strides), buffers=buffers)

# NOTE: the path boundary: sequences with at most DECODE_MAX_Q new tokens run the
# split-KV decode path, longer ones the prefill path. A starting point, to be
# measured (decode_plan.py / prefill_plan.py say where it was).
DECODE_MAX_Q = 8

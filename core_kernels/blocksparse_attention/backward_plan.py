"""Plans for training through block-sparse varlen attention (framework-free).

- :func:`plan_blocksparse_attention_lse`: the forward a gradient needs, output
  plus each query row's LSE (_bsattn_fwd_lse_kernel; the prefill kernel for any
  batch, decode-only batches included).
- :func:`plan_blocksparse_attention_backward`: dq, dk, dv from the forward's
  inputs, output and LSE, in three deterministic launches (backward_kernels.py;
  the dQ and dK/dV kernels from gluon_backward.py where they apply, see
  _gluon_applies): transposed layout, dQ (and delta = rowsum(dO * O)), dK + dV.
"""
from __future__ import annotations

from .._plan import (ArrayInfo, Buffer, Launch, Plan, Scalar, cdiv, check_config, check_dtype,
                     check_inner_contiguous, check_ndim, check_shape, config_class, memoize,
                     next_pow2)
from .._target import Target
from .backward_kernels import (ROWS_PER_WORD, _bsattn_bwd_colmask_kernel, _bsattn_bwd_dkdv_kernel,
                               _bsattn_bwd_dq_kernel)
from .kernels import LOG2E
from .plan import (BlocksparsePrefillConfig, _check_fields, _prefill_config, _prefill_launch,
                   _Problem, _query_tiles, _validate)

NO_DECODE_CONFIG = ("config: a call that needs a gradient runs the prefill kernel with its LSE "
                    "(BlocksparsePrefillConfig or None); the decode variants have no backward")


@config_class
class BlocksparseBackwardConfig:
    """The backward's tiles: query tiles of ``block_m`` rows and key tiles of
    ``block_n`` keys (powers of two >= 16 dividing block_size), for both the dQ
    kernel and the dK/dV kernel, with their warps and pipeline stages (the
    Triton kernels'); ``dkdv_gluon`` / ``dq_gluon``: whether those two kernels
    run in Gluon where that applies (gluon_backward.py)."""
    block_m: int = 64
    block_n: int = 64
    dq_warps: int = 4
    dkdv_warps: int = 4
    num_stages: int = 2
    # the Gluon dK/dV and dQ kernels (gluon_backward.py) where they apply (sm_90,
    # 16-bit, D 128, 64-token blocks and tiles, 4 warps); False: the Triton kernels
    dkdv_gluon: bool = True
    dq_gluon: bool = True


@memoize
def plan_blocksparse_attention_lse(
    target: Target, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, cu_seqlens_k: ArrayInfo,
    cu_seqlens_q: ArrayInfo | None, crow: ArrayInfo, col: ArrayInfo, *,
    sm_scale: float | None = None, block_size: int = 64, q_block_size: int | None = None,
    max_seqlen: int | None = None, config=None,
) -> Plan:
    """The forward of :func:`plan_blocksparse_attention` (same arguments and
    errors) plus ``lse`` [Tq, Hq] float32: the natural-log log-sum-exp of each
    query row's scaled scores (sm_scale * q.k over its allowed keys; -inf for a
    row with none). Results ("output", "lse"). ``config``: None or a
    BlocksparsePrefillConfig (the decode variants store no LSE)."""
    if config is not None and not isinstance(config, BlocksparsePrefillConfig):
        raise TypeError(NO_DECODE_CONFIG + f", got {type(config).__name__}")
    p = _validate(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col, sm_scale, block_size,
                  q_block_size, max_seqlen)
    if config is not None:
        _check_fields(config, p)
    buffers = {"output": Buffer((p.tq, p.hq, p.d), p.dtype), "lse": Buffer((p.tq, p.hq), "float32")}
    if p.empty:
        return Plan(buffers, (), ("output", "lse"))
    config = config or _prefill_config(target, p)
    return Plan(buffers, (_prefill_launch(p, config, with_lse=True),), ("output", "lse"))


@memoize
def plan_blocksparse_attention_backward(
    target: Target, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, output: ArrayInfo, lse: ArrayInfo,
    grad_output: ArrayInfo, cu_seqlens_k: ArrayInfo, cu_seqlens_q: ArrayInfo | None,
    crow: ArrayInfo, col: ArrayInfo, *, sm_scale: float | None = None, block_size: int = 64,
    q_block_size: int | None = None, max_seqlen: int | None = None, config=None,
) -> Plan:
    """Plan the backward of ``blocksparse_flash_attn_varlen_fwd``.

    q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col and the options: the
    forward's (same validation). ``output`` [Tq, Hq, D] (q's dtype) and ``lse``
    [Tq, Hq] float32 contiguous: :func:`plan_blocksparse_attention_lse`'s
    results; ``grad_output`` [Tq, Hq, D] in q's dtype, innermost dim contiguous.
    Results ("grad_q" [Tq, Hq, D], "grad_k", "grad_v" [Tk, Hkv, D]) in q's dtype,
    contiguous; tokens outside every sequence get zero gradients.
    ``config``: a :class:`BlocksparseBackwardConfig` or None.
    """
    check_config(config, (BlocksparseBackwardConfig,))
    p = _validate(q, k, v, cu_seqlens_k, cu_seqlens_q, crow, col, sm_scale, block_size,
                  q_block_size, max_seqlen)
    for name, info in (("output", output), ("grad_output", grad_output)):
        check_ndim(name, info, 3, "[Tq, Hq, D]")
        check_shape(name, info, (p.tq, p.hq, p.d), "same as q")
        if info.dtype != p.dtype:
            raise TypeError(f"{name}: dtype {info.dtype} differs from q's {p.dtype}")
        check_inner_contiguous(name, info)
    check_ndim("lse", lse, 2, "[Tq, Hq]")
    check_shape("lse", lse, (p.tq, p.hq), "[Tq, Hq], the forward's LSE")
    check_dtype("lse", lse, ("float32",))
    if p.tq and p.hq and tuple(lse.strides) != (p.hq, 1):
        raise ValueError(f"lse: expected a contiguous [Tq, Hq] array, got strides {tuple(lse.strides)}")
    tk = k.shape[0]
    # NOTE: the gradients are zero-initialised (one memset each, ~2% of the
    # backward's traffic at Phi-3-small 16k) so that tokens outside every sequence
    # (cu_seqlens[-1] < T) get defined zeros without reading cu_seqlens on the host.
    buffers = {"grad_q": Buffer((p.tq, p.hq, p.d), p.dtype, zero_init=True),
               "grad_k": Buffer((tk, p.hkv, p.d), p.dtype, zero_init=True),
               "grad_v": Buffer((tk, p.hkv, p.d), p.dtype, zero_init=True)}
    results = ("grad_q", "grad_k", "grad_v")
    if p.empty or tk == 0:
        return Plan(buffers, (), results)
    if config is not None:
        _check_backward_fields(config, p)
    config = config or _backward_config(target, p)
    gluon_dkdv = config.dkdv_gluon and _gluon_applies(target, p, config) and config.dkdv_warps == 4
    gluon_dq = config.dq_gluon and _gluon_applies(target, p, config) and config.dq_warps == 4
    layout_heads = crow.shape[0] if crow.ndim == 2 else 1
    words = cdiv(p.nb, ROWS_PER_WORD.value)
    buffers["colmask"] = Buffer((layout_heads, p.nb, words), "int32", zero_init=True)
    buffers["delta"] = Buffer((p.tq, p.hq), "float32")
    launches = (_colmask_launch(p, layout_heads, words), _dq_launch(p, config, output, grad_output, gluon_dq),
                _dkdv_launch(p, config, grad_output, tk, words, layout_heads, gluon_dkdv))
    return Plan(buffers, launches, results)


def _gluon_applies(target: Target, p: _Problem, config: BlocksparseBackwardConfig) -> bool:
    """The Gluon kernels' scope (gluon_backward.py), but for their warps (4)."""
    return (target.gluon and target.hopper and p.dtype in ("bfloat16", "float16") and p.d == 128
            and p.block_size == 64 and p.group == 1 and config.block_m == 64 and config.block_n == 64)


def _check_backward_fields(config: BlocksparseBackwardConfig, p: _Problem) -> None:
    bm, bn, bs = config.block_m, config.block_n, p.block_size
    if bm < 16 or bn < 16 or bs % bm or bs % bn or bm & (bm - 1) or bn & (bn - 1):
        raise ValueError(f"config: block_m and block_n (powers of two >= 16, tl.dot) must divide "
                         f"block_size={bs}, got {bm}/{bn}")
    for w in (config.dq_warps, config.dkdv_warps):
        if w not in (1, 2, 4, 8, 16):
            raise ValueError(f"config: warps must be a power of two <= 16, got {config}")
    if config.num_stages < 1:
        raise ValueError(f"config: num_stages must be >= 1, got {config.num_stages}")
    if not (isinstance(config.dkdv_gluon, bool) and isinstance(config.dq_gluon, bool)):
        raise ValueError(f"config: dkdv_gluon and dq_gluon must be bools, got {config}")


def _backward_config(target: Target, p: _Problem) -> BlocksparseBackwardConfig:
    # NOTE: 64 x 64 tiles match the forward's and the 64-token layout blocks of
    # Phi-3-small. Warps and stages measured on the H200 (bench_blocksparse_backward's
    # sweep, Phi-3-small 1x16384, Hq 32 / Hkv 8, D 128, per-head, bf16; 2026-11-24,
    # code of 0259e25; benchmarks/results/2026-11-24-blocksparse-backward/): the
    # backward launches alone take 5.92 ms at (64, 64) tiles, 4 dQ warps, 4 dK/dV
    # warps, 2 stages, against 10.52 ms at the 8 / 8 warps chosen before from
    # ptxas alone (4 warps spill 108 B in dQ and 416 B in dK/dV but run faster:
    # more programs per SM); 8 dQ / 4 dK/dV 8.04 ms, 4 / 8 8.41 ms; 3 stages 6.56
    # ms; 32-row or 32-key tiles 8.5-13.1 ms at 4 / 4 warps. Separately at 8 / 8:
    # dQ 4.08 ms, dK/dV 6.34 ms, the column mask and delta 0.18 and 0.14 ms.
    # fp32 is not measured: it keeps 8 warps from D 128 on (the ptxas rule: its
    # tiles are twice the bytes) and one stage past D 128.
    bm = bn = min(p.block_size, 64)
    warps = 8 if p.d_pad >= 128 and p.dtype == "float32" else 4
    return BlocksparseBackwardConfig(bm, bn, warps, warps,
                                     1 if p.d_pad > 128 and p.dtype == "float32" else 2)


def _common(p: _Problem) -> dict:
    return dict(num_heads=p.hq, head_size=p.d, num_queries_per_kv=p.qpk, BLOCK_SIZE=p.block_size,
                BLOCK_D=p.d_pad, B_P2=max(2, next_pow2(p.b)), DECODE_Q=p.decode_only,
                EVEN_D=p.d_pad == p.d, IS_FP32=p.dtype == "float32", QK_SCALE=p.qk_scale,
                SM_SCALE=p.qk_scale / LOG2E)


def _cu_q(p: _Problem) -> str:
    return "cu_seqlens_q" if p.has_cu_q else "cu_seqlens_k"   # decode-only: never read


def _colmask_launch(p: _Problem, layout_heads: int, words: int) -> Launch:
    return Launch(
        kernel=_bsattn_bwd_colmask_kernel, grid=(layout_heads * p.nb,),
        params=dict(crow_ptr="crow", col_ptr="col", colmask_ptr="colmask"), writes=("colmask_ptr",),
        constexprs=dict(num_rows=p.nb, stride_crow_h=p.layout["stride_crow_h"],
                        stride_col_h=p.layout["stride_col_h"], GROUP=p.group, WORDS=words,
                        CNT_CHUNK=min(64, max(2, next_pow2(min(p.nnz, p.nb))))),
        num_warps=1, num_stages=1)


def _dq_launch(p: _Problem, config: BlocksparseBackwardConfig, output: ArrayInfo,
               grad_output: ArrayInfo, gluon: bool) -> Launch:
    c = _common(p)
    c.update(num_rows=p.nb, stride_ot=output.strides[0], stride_oh=output.strides[1],
             stride_dot=grad_output.strides[0], stride_doh=grad_output.strides[1],
             BLOCK_M=config.block_m, BLOCK_N=config.block_n, GROUP=p.group,
             NNZ_P2=max(2, next_pow2(min(p.nnz, p.nb))), CNT_CHUNK=64,
             **{n: p.layout[n] for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh",
                                         "stride_vt", "stride_vh", "stride_crow_h", "stride_col_h")})
    return Launch(
        kernel=_gluon_kernel("_bsattn_bwd_dq_gluon_kernel") if gluon else _bsattn_bwd_dq_kernel, grid=(_query_tiles(p, config.block_m) * p.hq,),
        params=dict(q_ptr="q", k_ptr="k", v_ptr="v", out_ptr="output", do_ptr="grad_output",
                    lse_ptr="lse", cu_k_ptr="cu_seqlens_k", cu_q_ptr=_cu_q(p), crow_ptr="crow",
                    col_ptr="col", num_seqs=Scalar(p.b), dq_ptr="grad_q", delta_ptr="delta"),
        writes=("dq_ptr", "delta_ptr"), constexprs=c, num_warps=config.dq_warps,
        num_stages=config.num_stages)


def _gluon_kernel(name: str):
    from . import gluon_backward   # Gluon: imported where it runs
    return getattr(gluon_backward, name)


def _dkdv_launch(p: _Problem, config: BlocksparseBackwardConfig, grad_output: ArrayInfo, tk: int,
                 words: int, layout_heads: int, gluon: bool) -> Launch:
    bn = config.block_n
    # key tiles of one sequence: ceil(k_len / BN) <= k_len / BN + 1 and <= ceil(max_seqlen / BN)
    n_flat = min(cdiv(tk, bn) + p.b, p.b * cdiv(p.max_seqlen, bn))
    c = _common(p)
    c.update(num_kv_heads=p.hkv, num_rows=p.nb, stride_dot=grad_output.strides[0],
             stride_doh=grad_output.strides[1], stride_mask_h=p.nb if layout_heads > 1 else 0,
             BLOCK_M=config.block_m, BLOCK_N=bn, WORDS=words,
             **{n: p.layout[n] for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh",
                                         "stride_vt", "stride_vh")})
    return Launch(
        kernel=_gluon_kernel("_bsattn_bwd_dkdv_gluon_kernel") if gluon else _bsattn_bwd_dkdv_kernel, grid=(n_flat * p.hkv,),
        params=dict(q_ptr="q", k_ptr="k", v_ptr="v", do_ptr="grad_output", lse_ptr="lse",
                    delta_ptr="delta", cu_k_ptr="cu_seqlens_k", cu_q_ptr=_cu_q(p),
                    colmask_ptr="colmask", num_seqs=Scalar(p.b), dk_ptr="grad_k", dv_ptr="grad_v"),
        writes=("dk_ptr", "dv_ptr"), constexprs=c, num_warps=config.dkdv_warps,
        num_stages=config.num_stages)

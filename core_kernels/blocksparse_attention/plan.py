"""Validation and launch plan for block-sparse varlen attention (framework-free)."""
from __future__ import annotations

import math

from .._plan import (FLOAT_DTYPES, ITEMSIZE, ArrayInfo, Buffer, Launch, Plan, Scalar, cdiv,
                     check_dtype, check_inner_contiguous, check_ndim, memoize, next_pow2)
from .kernels import (LOG2E, _bsattn_combine_kernel, _bsattn_decode_group_kernel,
                      _bsattn_decode_kernel, _bsattn_fwd_kernel)

MAX_HEAD_SIZE = 256
BLOCK_SIZES = (16, 32, 64, 128, 256)
# NOTE: decode splits a row's key blocks (flash-decoding) into
# max(DECODE_TARGET_PROGRAMS / (B * Hq), row bound / DECODE_TILES_PER_SPLIT)
# splits (H200: 132 SMs; the row bound is what the layout's shape allows, the
# real row is often shorter), each split taking at least DECODE_MIN_PER_SPLIT
# tiles at run time (the rest exit at once). Measured on the H200 (GPU time in
# a CUDA graph, Phi-3-small): 1x16384 33 splits w4 20.6 us, 23 w2 16.2 us,
# 33 w2 16.8 us, 23 w8 32.7 us; 64x4096 1 split w4 479 us, 4-9 w4 375-385 us,
# 9 w2 288 us, 9 w8 618 us. Framework-free code cannot ask the device, so the
# numbers are fixed here.
DECODE_TARGET_PROGRAMS = 8 * 132
DECODE_TILES_PER_SPLIT = 8
DECODE_MIN_PER_SPLIT = 2
DECODE_WARPS = 2
# NOTE: the cap at cdiv(row bound, DECODE_MIN_PER_SPLIT) took Phi-3-small
# 1x16384 from 33 splits (10 always empty, 16.1 us) to 23 (15.5 us, H200).
#
# NOTE: GQA-packed decode (_bsattn_decode_group_kernel): one program per
# (sequence, KV head, split) reads each K/V block of the union of its query
# heads' rows once (Phi-3-small 64x4096: 671 MB instead of 1.48 GB). Splits
# take interleaved chunks of DECODE_GROUP_MIN_CHUNK..MAX_CHUNK absolute block
# positions; the split count aims at DECODE_GROUP_TARGET_PROGRAMS programs.
# Measured on the H200 (GPU time in a CUDA graph, Phi-3-small, bf16):
# 64x4096 per-head 276 us, packed 169 us (2 splits x 32-block chunks, w4 s3;
# w2 171, s4 169, 1 split 178, 4x16 175, 8x8 173); 1x16384 packed 18.8 us
# (64 x 4, w4 s3; 32x8 19.3, 16x16 23.9, w2 19.5, w8 23.0) vs per-head 15.5:
# a lone sequence is latency-bound (few blocks per program, a longer
# prologue), so packing is used only from DECODE_GROUP_MIN_PROGRAMS
# (sequence, KV head) programs on. Crossover (benchmarks/sweep_blocksparse.py
# crossover; per-head / packed): B*Hkv = 8 (1x16384) 16.2 / 18.4 us; 32:
# 4x4096 29.6 / 19.5, 4x16384 51.9 / 47.7; 64 (8x4096) 45.1 / 31.4; 128
# (16x4096) 76.0 / 54.8. B*Hkv = 16 is not measured.
DECODE_GROUP_MIN_PROGRAMS = 32
DECODE_GROUP_TARGET_PROGRAMS = 4 * 132
DECODE_GROUP_MIN_CHUNK = 4
DECODE_GROUP_MAX_CHUNK = 32
DECODE_GROUP_WARPS = 4
DECODE_GROUP_STAGES = 3
# NOTE: shared memory per CTA on Hopper is 227 KiB; keep Q + stages x (K + V)
# under this so large D / fp32 still compile.
SMEM_BUDGET = 200 * 1024


def _prefill_config(block_size, d_pad, itemsize, group, block_m, block_n, num_warps, num_stages):
    # NOTE: 64 x 64 tiles (one warpgroup, 4 warps, 3 stages: 2 CTAs per SM)
    # match the 64-token layout rows of the models this serves. Measured on the
    # H200 at 1x16384 (Phi-3-small): 64x64 w4 s3 1431 us; 128-row tiles spanning
    # two layout rows (walking the union of their columns, each half masked to
    # its row; built, measured, then removed) w8 s2 1709 us, w8 s3 1733 us,
    # w4 s2 2138 us, 128x32 w8 s3 2253 us (255 registers: one CTA per SM, the
    # two warpgroups wait on each other); (64,64,8,3) 0.48x, (32,64,4,3) 0.43x,
    # (64,64,4,4) 0.62x the default's speed. See benchmarks/sweep_blocksparse.py.
    bm = block_m or min(block_size, 64)
    bn = block_n or min(block_size, 64)
    stages = num_stages or 3
    while (bm + stages * 2 * bn) * d_pad * itemsize > SMEM_BUDGET:
        if stages > 1:
            stages -= 1
        elif bn > 16:
            bn //= 2
        elif bm > 16:
            bm //= 2
        else:
            break
    warps = num_warps or (8 if bm >= 128 or d_pad > 128 else 4)
    return bm, bn, warps, stages


@memoize
def plan_blocksparse_attention(
    q: ArrayInfo, k: ArrayInfo, v: ArrayInfo, cu_seqlens_k: ArrayInfo,
    cu_seqlens_q: ArrayInfo | None, crow: ArrayInfo, col: ArrayInfo, *,
    sm_scale: float | None = None, block_size: int = 64, q_block_size: int | None = None,
    max_seqlen: int | None = None, block_m: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
    decode_splits: int | None = None, use_decode_kernel: bool = True,
    decode_group: bool | None = None, decode_chunk: int | None = None,
) -> Plan:
    """Plan ``blocksparse_flash_attn_varlen_fwd`` (see the adapters' docstrings).

    Array names: q, k, v, cu_seqlens_k, cu_seqlens_q (absent: None), crow, col;
    the plan allocates ``output`` [Tq, Hq, D] (q's dtype) and, for split
    decode, fp32 scratch. Nothing here reads device data: grids come from
    shapes and ``max_seqlen`` (default: what the layout covers).
    The keyword arguments after ``max_seqlen`` override tuning choices.
    """
    check_ndim("q", q, 3, "[Tq, Hq, D]")
    check_dtype("q", q, FLOAT_DTYPES)
    tq, hq, d = q.shape
    check_ndim("k", k, 3, "[Tk, Hkv, D]")
    check_ndim("v", v, 3, "[Tk, Hkv, D]")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
    for name, info in (("k", k), ("v", v)):
        if info.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {info.dtype} differs from q's {q.dtype}")
    tk, hkv, dk = k.shape
    if dk != d:
        raise ValueError(f"k: head size {dk} differs from q's {d}")
    if not 1 <= d <= MAX_HEAD_SIZE:
        raise ValueError(f"q: head size {d} is not in [1, {MAX_HEAD_SIZE}]")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"k: {hkv} KV heads do not divide q's {hq} heads (Hq % Hkv must be 0)")
    for name, info in (("q", q), ("k", k), ("v", v)):
        check_inner_contiguous(name, info)

    check_ndim("cu_seqlens_k", cu_seqlens_k, 1, "[B + 1]")
    check_dtype("cu_seqlens_k", cu_seqlens_k, ("int32",))
    if cu_seqlens_k.shape[0] < 1:
        raise ValueError("cu_seqlens_k: expected shape [B + 1], got an empty array")
    b = cu_seqlens_k.shape[0] - 1
    if cu_seqlens_q is not None:
        check_dtype("cu_seqlens_q", cu_seqlens_q, ("int32",))
        if tuple(cu_seqlens_q.shape) != tuple(cu_seqlens_k.shape):
            raise ValueError(f"cu_seqlens_q: shape {tuple(cu_seqlens_q.shape)} does not match "
                             f"cu_seqlens_k's {tuple(cu_seqlens_k.shape)} (one entry per sequence + 1)")
        decode_only = False
    elif tq == b:
        decode_only = True
    elif tq == tk:
        decode_only = False
    else:
        raise ValueError(f"cu_seqlens_q: needed when q has {tq} tokens, neither B = {b} "
                         f"(decode) nor k's {tk} (full prefill)")

    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size: expected one of {BLOCK_SIZES}, got {block_size!r}")
    if q_block_size is None:
        q_block_size = block_size
    if not isinstance(q_block_size, int) or q_block_size < block_size or q_block_size % block_size:
        raise ValueError(f"q_block_size: expected a positive multiple of block_size={block_size}, "
                         f"got {q_block_size!r}")
    group = q_block_size // block_size

    for name, info in (("crow", crow), ("col", col)):
        if info.ndim not in (1, 2):
            raise ValueError(f"sparse_layout: {name} must be [H, ...] or 1-D, got shape {tuple(info.shape)}")
        check_dtype(f"sparse_layout ({name})", info, ("int32",))
        check_inner_contiguous(f"sparse_layout ({name})", info)
    if crow.ndim != col.ndim or (crow.ndim == 2 and crow.shape[0] != col.shape[0]):
        raise ValueError(f"sparse_layout: crow {tuple(crow.shape)} and col {tuple(col.shape)} "
                         "disagree on the number of heads")
    layout_heads = crow.shape[0] if crow.ndim == 2 else 1
    if layout_heads not in (1, hq):
        raise ValueError(f"sparse_layout: {layout_heads} layout heads do not match q's {hq} heads "
                         "(expected 1, broadcast, or Hq)")
    nb = crow.shape[-1] - 1
    if nb < 1:
        raise ValueError(f"sparse_layout: crow must have NB + 1 >= 2 entries per head, got {crow.shape}")
    covered = nb * block_size
    if max_seqlen is None:
        max_seqlen = covered
    if not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise ValueError(f"max_seqlen: expected a positive int, got {max_seqlen!r}")
    if max_seqlen > covered:
        raise ValueError(f"max_seqlen: {max_seqlen} exceeds the {covered} tokens the layout covers "
                         f"({nb} blocks of {block_size})")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    qk_scale = scale * LOG2E
    stride_crow_h = crow.strides[0] if layout_heads > 1 else 0
    stride_col_h = col.strides[0] if layout_heads > 1 else 0

    buffers = {"output": Buffer((tq, hq, d), q.dtype)}
    if tq == 0 or b == 0 or hq == 0:
        return Plan(buffers, (), ("output",))
    d_pad = max(16, next_pow2(d))
    even_d = d_pad == d
    cu_q_name = "cu_seqlens_q" if cu_seqlens_q is not None else "cu_seqlens_k"
    strides = (*q.strides[:2], *k.strides[:2], *v.strides[:2])
    out_strides = (hq * d, d)
    layout_consts = dict(zip(("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
                              "stride_vh", "stride_ot", "stride_oh", "stride_crow_h",
                              "stride_col_h"),
                             (*strides, *out_strides, stride_crow_h, stride_col_h)))

    qpk = hq // hkv
    if decode_group is None:
        heads = max(2, min(next_pow2(qpk), 16))
        decode_group = qpk > 1 and b * hkv * cdiv(qpk, heads) >= DECODE_GROUP_MIN_PROGRAMS
    if decode_only and group == 1 and use_decode_kernel and decode_group:
        return _plan_decode_group(buffers, q, d, d_pad, even_d, b, hq, hkv, block_size, max_seqlen,
                                  layout_consts, qk_scale, decode_splits, decode_chunk, num_warps,
                                  num_stages)
    if decode_only and group == 1 and use_decode_kernel:
        bn = min(block_size, 64)
        row_bound = cdiv(min(col.shape[-1], nb) * block_size, bn)   # K/V tiles in a row, at most
        if decode_splits is None:
            # a split below DECODE_MIN_PER_SPLIT tiles never has work: cap there
            splits = max(1, min(max(cdiv(DECODE_TARGET_PROGRAMS, b * hq),
                                    cdiv(row_bound, DECODE_TILES_PER_SPLIT)),
                                cdiv(row_bound, DECODE_MIN_PER_SPLIT), 64))
        else:
            splits = int(decode_splits)
        # one split writes the output directly; the scratch is then a 1-element dummy.
        # Partial outputs [B, Hq, S, D] then their log2-sum-exps [B, Hq, S], in one
        # fp32 buffer (one allocation less per call: host time).
        lse_offset = b * hq * splits * d
        buffers["partials"] = Buffer((lse_offset + b * hq * splits,) if splits > 1 else (1,),
                                     "float32")
        part = ("partials",)
        decode = Launch(
            kernel=_bsattn_decode_kernel, grid=(b * hq * splits,),
            args=("q", "k", "v", "cu_seqlens_k", "crow", "col"),
            outputs=("output", *part),
            constexprs=dict(num_heads=hq, head_size=d, num_queries_per_kv=hq // hkv,
                            **layout_consts, BLOCK_SIZE=block_size, BLOCK_N=bn, BLOCK_D=d_pad,
                            NUM_SPLITS=splits, MIN_PER_SPLIT=DECODE_MIN_PER_SPLIT,
                            LSE_OFFSET=lse_offset, EVEN_D=even_d, QK_SCALE=qk_scale),
            num_warps=num_warps or DECODE_WARPS, num_stages=num_stages or 2)
        launches = [decode]
        if splits > 1:
            launches.append(Launch(
                kernel=_bsattn_combine_kernel, grid=(b * hq,),
                args=("partials",),
                outputs=("output",),
                constexprs=dict(num_heads=hq, head_size=d, stride_ot=out_strides[0],
                                stride_oh=out_strides[1], NUM_SPLITS=splits, LSE_OFFSET=lse_offset, S_P2=next_pow2(splits),
                                BLOCK_D=d_pad),
                num_warps=4, num_stages=1))
        return Plan(buffers, tuple(launches), ("output",))

    bm, bn, warps, stages = _prefill_config(block_size, d_pad, ITEMSIZE[q.dtype], group,
                                            block_m, block_n, num_warps, num_stages)
    if block_size % bm or block_size % bn or bn < 16:
        raise ValueError(f"block_m and block_n (>= 16, tl.dot) must divide block_size={block_size}, "
                         f"got {bm}/{bn}")
    q_tokens = b if decode_only else tq
    # tiles of one sequence <= ceil(q_len / BM) + 1 (alignment) and <= ceil(max_seqlen / BM)
    n_flat = min(cdiv(q_tokens, bm) + 2 * b, b * cdiv(max_seqlen, bm))
    launch = Launch(
        kernel=_bsattn_fwd_kernel, grid=(n_flat * hq,),
        args=("q", "k", "v", "cu_seqlens_k", cu_q_name, "crow", "col", Scalar(b)),
        outputs=("output",),
        constexprs=dict(num_heads=hq, num_rows=nb, head_size=d, num_queries_per_kv=hq // hkv,
                        **layout_consts, BLOCK_SIZE=block_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d_pad, GROUP=group,
                        B_P2=max(2, next_pow2(b)), NNZ_P2=max(2, next_pow2(min(col.shape[-1], nb))),
                        CNT_CHUNK=64, DECODE_Q=decode_only, EVEN_D=even_d,
                        IS_FP32=q.dtype == "float32", QK_SCALE=qk_scale),
        num_warps=warps, num_stages=stages)
    return Plan(buffers, (launch,), ("output",))


def _plan_decode_group(buffers, q, d, d_pad, even_d, b, hq, hkv, block_size, max_seqlen,
                       layout_consts, qk_scale, decode_splits, decode_chunk, num_warps, num_stages):
    qpk = hq // hkv
    heads = max(2, min(next_pow2(qpk), 16))        # query heads per program
    n_hb = cdiv(qpk, heads)
    block_m = max(16, heads)
    itemsize = ITEMSIZE[q.dtype]
    bn = min(block_size, 64)
    stages = num_stages or DECODE_GROUP_STAGES
    while (block_m + stages * 2 * bn) * d_pad * itemsize > SMEM_BUDGET:
        if stages > 1:
            stages -= 1
        elif bn > 16:
            bn //= 2
        else:
            break
    positions = cdiv(max_seqlen, block_size)           # key blocks a row can reach
    progs = b * hkv * n_hb
    want = int(decode_splits) if decode_splits else max(1, cdiv(DECODE_GROUP_TARGET_PROGRAMS, progs))
    if decode_chunk:
        chunk = int(decode_chunk)
        if chunk < 2 or chunk > 32 or chunk & (chunk - 1):
            raise ValueError(f"decode_chunk: expected a power of two in [2, 32], got {chunk}")
    else:
        chunk = min(max(next_pow2(cdiv(positions, want)), DECODE_GROUP_MIN_CHUNK),
                    DECODE_GROUP_MAX_CHUNK)
    n_chunks = cdiv(positions, chunk)
    splits = max(1, min(want, n_chunks))
    n_sub = cdiv(n_chunks, splits)
    lse_offset = b * hq * splits * d
    buffers["partials"] = Buffer((lse_offset + b * hq * splits,) if splits > 1 else (1,), "float32")
    decode = Launch(
        kernel=_bsattn_decode_group_kernel, grid=(progs * splits,),
        args=("q", "k", "v", "cu_seqlens_k", "crow", "col"),
        outputs=("output", "partials"),
        constexprs=dict(num_heads=hq, head_size=d, num_queries_per_kv=qpk, **layout_consts,
                        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_D=d_pad,
                        HEADS=heads, CHUNK=chunk, CNT_CHUNK=64, NUM_SPLITS=splits, NUM_SUB=n_sub,
                        LSE_OFFSET=lse_offset, EVEN_D=even_d, IS_FP32=q.dtype == "float32",
                        QK_SCALE=qk_scale),
        num_warps=num_warps or DECODE_GROUP_WARPS, num_stages=stages)
    launches = [decode]
    if splits > 1:
        launches.append(Launch(
            kernel=_bsattn_combine_kernel, grid=(b * hq,),
            args=("partials",), outputs=("output",),
            constexprs=dict(num_heads=hq, head_size=d, stride_ot=layout_consts["stride_ot"],
                            stride_oh=layout_consts["stride_oh"], NUM_SPLITS=splits,
                            LSE_OFFSET=lse_offset, S_P2=next_pow2(splits), BLOCK_D=d_pad),
            num_warps=4, num_stages=1))
    return Plan(buffers, tuple(launches), ("output",))

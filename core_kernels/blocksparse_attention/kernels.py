"""Triton kernels for block-sparse varlen attention (framework-free).

NOTE: strides and head counts are constexprs (layout constants). Passed as
runtime integers they compiled to different code in the two frameworks before
the package's integer policy (core_kernels._triton_utils.jit): jax-triton gave
them no divisibility hints while a torch launch marked multiples of 16
(unvectorised loads: JAX prefill ran 5x slower, and decode results differed in
the last bit, seen on the H200, 2026-11-21, commit 6d3b5a0). As constexprs both compile the very same
kernel with the alignment known; they are fixed per model, so this costs no
recompiles in practice. The launched kernels use ``jit`` (the policy) for
their remaining runtime integer (the sequence count).

Three kernels:
- ``_bsattn_fwd_kernel``: any batch (prefill, prefill over a cached prefix,
  decode, mixed). A 1-D grid of (tile, head) programs; the tile schedule is
  read from cu_seqlens on the device (a cumsum over the batch inside every
  program), so the grid depends only on static bounds.
- ``_bsattn_decode_kernel`` / ``_bsattn_decode_group_kernel``: decode-only
  batches (one query per sequence), the row's key blocks split across programs
  (flash-decoding); the last split of a row to finish merges the splits by
  their log-sum-exps (``_finish_decode``), in the same launch.

Positions are absolute (query i of a sequence sits at past + i, past =
k_len - q_len); query tiles are aligned to absolute positions, so a tile of
BLOCK_M <= BLOCK_SIZE queries lies in one layout row.
Scores are kept in base 2: qk * QK_SCALE (= sm_scale * log2(e), a constexpr:
jax-triton bakes scalars into the program anyway), exp2.
"""
import triton
import triton.language as tl

from .._triton_utils import jit

LOG2E = 1.4426950408889634
# kernels read module constants only as tl.constexpr (the GPU compiler refuses plain globals)
LN2 = tl.constexpr(0.6931471805599453)


# NOTE: tl.sum / tl.max / tl.cumsum / tl.zeros are themselves @triton.jit
# functions that core_kernels._interpret cannot swap for interpreted copies;
# tl.reduce / tl.associative_scan with the same combine functions are what they
# expand to on the GPU, and the interpreter runs them as numpy reductions.
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _sum(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, tl.standard._sum_combine)


@triton.jit
def _max(x, AXIS: tl.constexpr):
    return tl.reduce(x, AXIS, tl.standard._elementwise_max)


@triton.jit
def _seq_bounds(cu_k_ptr, cu_q_ptr, num_seqs, B_P2: tl.constexpr, DECODE_Q: tl.constexpr):
    """Per sequence ([B_P2], the batch padded): first key row, key count, first
    query row, query count, read from cu_seqlens on the device."""
    o_b = tl.arange(0, B_P2)
    m_b = o_b < num_seqs
    k_lo_b = tl.load(cu_k_ptr + o_b, mask=m_b, other=0)
    k_len_b = tl.load(cu_k_ptr + o_b + 1, mask=m_b, other=0) - k_lo_b
    if DECODE_Q:  # no cu_seqlens_q, one query per sequence
        q_lo_b = o_b
        q_len_b = tl.where(m_b, 1, 0)
    else:
        q_lo_b = tl.load(cu_q_ptr + o_b, mask=m_b, other=0)
        q_len_b = tl.load(cu_q_ptr + o_b + 1, mask=m_b, other=0) - q_lo_b
    return o_b, k_lo_b, k_len_b, q_lo_b, q_len_b


@triton.jit
def _pick(sel, x_b):
    """x_b [B_P2] at the one sequence where sel is set."""
    return _sum(tl.where(sel, x_b, 0), 0)


@triton.jit
def _query_tiles(k_len_b, q_len_b, BLOCK_M: tl.constexpr):
    """Per sequence: past_b = k_len - q_len, and its query tiles (aligned to
    absolute positions): the first one's index first_b and their count tiles_b."""
    past_b = k_len_b - q_len_b
    first_b = past_b // BLOCK_M
    tiles_b = tl.where(q_len_b > 0, (k_len_b + BLOCK_M - 1) // BLOCK_M - first_b, 0)
    return past_b, first_b, tiles_b


@triton.jit
def _locate(tiles_b, flat):
    """Tile number flat of all sequences' tiles in turn (tiles_b each): end_b,
    the inclusive cumsum of tiles_b, and the sequence i_b it falls in (the batch
    size or more past the last tile)."""
    end_b = tl.associative_scan(tiles_b, 0, _add)
    return end_b, _sum((end_b <= flat).to(tl.int32), 0)


@triton.jit
def _count_below(p_col, start, end, qb, CNT_CHUNK: tl.constexpr):
    """How many of the (ascending) columns p_col[start:end] lie below row qb:
    the key blocks a tile of row qb attends without a causal mask."""
    n_below = start * 0
    for off in range(start, end, CNT_CHUNK):
        o_c = off + tl.arange(0, CNT_CHUNK)
        b_c = tl.load(p_col + o_c, mask=o_c < end, other=2147483647)
        n_below += _sum((b_c < qb).to(tl.int32), 0)
    return n_below


@triton.jit
def _col_at(p_col, start, j, n_steps, SUB: tl.constexpr):
    """The column of step j of a row's loop over its columns p_col[start:]
    (SUB steps per column), 0 past the n_steps steps: the forward and dQ loops
    load it one step ahead into a loop-carried scalar (kernels.py's NOTE)."""
    return tl.load(p_col + start + j // SUB, mask=j < n_steps, other=0)


@triton.jit
def _row_extent(p_crow, row, num_rows: tl.constexpr):
    """[start, end) of layout row ``row`` in col; empty for a row past the last."""
    row_c = tl.minimum(row, num_rows - 1)
    start = tl.load(p_crow + row_c)
    end = tl.where(row < num_rows, tl.load(p_crow + row_c + 1), start)
    return start, end


@triton.jit
def _in_earlier_rows(p_crow, p_col, g0, c, R: tl.constexpr, NNZ_P2: tl.constexpr):
    """How many of the rows g0 .. g0 + R - 1 hold column c (0: the union of a
    q block's rows meets c first in row g0 + R)."""
    drop = c * 0
    for r2 in tl.static_range(R):
        s2 = tl.load(p_crow + g0 + r2)
        e2 = tl.load(p_crow + g0 + r2 + 1)
        o_c = s2 + tl.arange(0, NNZ_P2)
        b_c = tl.load(p_col + o_c, mask=o_c < e2, other=-1)
        drop += _sum((b_c == c).to(tl.int32), 0)
    return drop


@triton.jit
def _attend_block(acc, m_i, l_i, b_q, k_ptrs, v_ptrs, kpos, q_pos, k_len, qk_scale, row_ok,
                  m_dk, m_dv, MASKED: tl.constexpr, HAS_ROW_MASK: tl.constexpr,
                  EVEN_D: tl.constexpr, IS_FP32: tl.constexpr, FOLD_SCALE: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] step of the online softmax.

    kpos [BLOCK_N] absolute key positions; MASKED applies the token-level
    causal mask (and bounds); ``row_ok`` [BLOCK_M] (with HAS_ROW_MASK) masks
    the rows whose layout row does not hold this key block.
    """
    if MASKED:
        m_k = kpos < k_len
        if EVEN_D:
            b_kt = tl.load(k_ptrs, mask=m_k[None, :], other=0.0)            # [BLOCK_D, BLOCK_N]
        else:
            b_kt = tl.load(k_ptrs, mask=m_k[None, :] & m_dk, other=0.0)
    else:
        if EVEN_D:
            b_kt = tl.load(k_ptrs)
        else:
            b_kt = tl.load(k_ptrs, mask=m_dk, other=0.0)
    if IS_FP32:
        b_s = tl.dot(b_q, b_kt, input_precision="ieee")                 # [BLOCK_M, BLOCK_N]
    else:
        b_s = tl.dot(b_q, b_kt)
    if not FOLD_SCALE:
        b_s = b_s * qk_scale
    if MASKED:
        m_s = kpos[None, :] <= q_pos[:, None]
        if HAS_ROW_MASK:
            m_s = m_s & row_ok[:, None]
        b_s = tl.where(m_s, b_s, float("-inf"))
    if FOLD_SCALE:  # scale > 0: max(s) * scale == max(s * scale); s * scale - m is one FMA
        m_new = tl.maximum(m_i, _max(b_s, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, _max(b_s, 1))
    if MASKED:  # a row may have no key yet: keep exp2 away from (-inf) - (-inf)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.math.exp2(m_i - m_use)
    if FOLD_SCALE:
        b_p = tl.math.exp2(b_s * qk_scale - m_use[:, None])
    else:
        b_p = tl.math.exp2(b_s - m_use[:, None])
    l_i = l_i * alpha + _sum(b_p, 1)
    if MASKED:
        if EVEN_D:
            b_v = tl.load(v_ptrs, mask=m_k[:, None], other=0.0)             # [BLOCK_N, BLOCK_D]
        else:
            b_v = tl.load(v_ptrs, mask=m_k[:, None] & m_dv, other=0.0)
    else:
        if EVEN_D:
            b_v = tl.load(v_ptrs)
        else:
            b_v = tl.load(v_ptrs, mask=m_dv, other=0.0)
    acc = acc * alpha[:, None]
    if IS_FP32:
        acc += tl.dot(b_p, b_v, input_precision="ieee")
    else:
        acc += tl.dot(b_p.to(b_v.dtype), b_v)
    return acc, m_new, l_i


@jit
def _bsattn_fwd_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr,
    # runtime scalars
    num_seqs,
    # output pointers
    out_ptr,
    # constexprs
    num_heads: tl.constexpr, num_rows: tl.constexpr, head_size: tl.constexpr,
    num_queries_per_kv: tl.constexpr,
    stride_qt: tl.constexpr, stride_qh: tl.constexpr, stride_kt: tl.constexpr,
    stride_kh: tl.constexpr, stride_vt: tl.constexpr, stride_vh: tl.constexpr,
    stride_ot: tl.constexpr, stride_oh: tl.constexpr, stride_crow_h: tl.constexpr,
    stride_col_h: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, GROUP: tl.constexpr, B_P2: tl.constexpr, NNZ_P2: tl.constexpr,
    CNT_CHUNK: tl.constexpr, DECODE_Q: tl.constexpr, EVEN_D: tl.constexpr,
    IS_FP32: tl.constexpr, QK_SCALE: tl.constexpr,
):
    # the inference forward: no LSE (out_ptr stands in for the unused lse_ptr)
    _bsattn_fwd_program(
        q_ptr, k_ptr, v_ptr, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr, num_seqs, out_ptr, out_ptr,
        num_heads, num_rows, head_size, num_queries_per_kv, stride_qt, stride_qh,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        stride_crow_h, stride_col_h, BLOCK_SIZE, BLOCK_M, BLOCK_N, BLOCK_D,
        GROUP, B_P2, NNZ_P2, CNT_CHUNK, DECODE_Q, EVEN_D,
        IS_FP32, QK_SCALE, False)


@jit
def _bsattn_fwd_lse_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr,
    # runtime scalars
    num_seqs,
    # output pointers
    out_ptr, lse_ptr,
    # constexprs
    num_heads: tl.constexpr, num_rows: tl.constexpr, head_size: tl.constexpr,
    num_queries_per_kv: tl.constexpr,
    stride_qt: tl.constexpr, stride_qh: tl.constexpr, stride_kt: tl.constexpr,
    stride_kh: tl.constexpr, stride_vt: tl.constexpr, stride_vh: tl.constexpr,
    stride_ot: tl.constexpr, stride_oh: tl.constexpr, stride_crow_h: tl.constexpr,
    stride_col_h: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, GROUP: tl.constexpr, B_P2: tl.constexpr, NNZ_P2: tl.constexpr,
    CNT_CHUNK: tl.constexpr, DECODE_Q: tl.constexpr, EVEN_D: tl.constexpr,
    IS_FP32: tl.constexpr, QK_SCALE: tl.constexpr,
):
    """The forward used when a gradient is needed: also writes each query row's
    natural-log LSE of the scaled scores, lse [Tq, Hq] fp32 (the backward's input)."""
    _bsattn_fwd_program(
        q_ptr, k_ptr, v_ptr, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr, num_seqs, out_ptr, lse_ptr,
        num_heads, num_rows, head_size, num_queries_per_kv, stride_qt, stride_qh,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        stride_crow_h, stride_col_h, BLOCK_SIZE, BLOCK_M, BLOCK_N, BLOCK_D,
        GROUP, B_P2, NNZ_P2, CNT_CHUNK, DECODE_Q, EVEN_D,
        IS_FP32, QK_SCALE, True)


# NOTE: one body for both forward kernels, inlined by Triton: with STORE_LSE False
# the LSE code is pruned at compile time. The sm_90 PTX of _bsattn_fwd_kernel
# (1x16384 Phi-3-small, bf16) differs from the pre-LSE kernel only in the
# layout of the early-exit branch (programs past the last tile: one setp/bra
# pair, the other blocks renumbered); every arithmetic instruction, load and
# store is the same, so the inference forward's results are unchanged and its
# speed is not measurably affected (offline compile diff, 2026-11-24).
# NOTE (LSE): the backward needs each row's LSE. Storing it from the forward
# costs one [BLOCK_M] store per tile; recomputing it in the backward would
# repeat the forward's QK^T and exp2 work (about half a forward). So a
# gradient-needing call runs _bsattn_fwd_lse_kernel and saves the LSE.
@triton.jit
def _bsattn_fwd_program(
    q_ptr, k_ptr, v_ptr, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr, num_seqs, out_ptr, lse_ptr,
    num_heads: tl.constexpr, num_rows: tl.constexpr, head_size: tl.constexpr,
    num_queries_per_kv: tl.constexpr,
    stride_qt: tl.constexpr, stride_qh: tl.constexpr, stride_kt: tl.constexpr,
    stride_kh: tl.constexpr, stride_vt: tl.constexpr, stride_vh: tl.constexpr,
    stride_ot: tl.constexpr, stride_oh: tl.constexpr, stride_crow_h: tl.constexpr,
    stride_col_h: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, GROUP: tl.constexpr, B_P2: tl.constexpr, NNZ_P2: tl.constexpr,
    CNT_CHUNK: tl.constexpr, DECODE_Q: tl.constexpr, EVEN_D: tl.constexpr,
    IS_FP32: tl.constexpr, QK_SCALE: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    pid = tl.program_id(0)
    i_h = pid % num_heads   # heads fastest: the heads of one KV group run together (L2 reuse)
    # heaviest tiles (the last of each sequence) first
    flat = tl.num_programs(0) // num_heads - 1 - pid // num_heads

    # ---- tile schedule from cu_seqlens, on the device
    o_b, k_lo_b, k_len_b, q_lo_b, q_len_b = _seq_bounds(cu_k_ptr, cu_q_ptr, num_seqs, B_P2, DECODE_Q)
    past_b, first_b, tiles_b = _query_tiles(k_len_b, q_len_b, BLOCK_M)
    end_b, i_b = _locate(tiles_b, flat)
    if i_b >= num_seqs:
        return
    sel = o_b == i_b
    k_lo = _pick(sel, k_lo_b)
    k_len = _pick(sel, k_len_b)
    q_lo = _pick(sel, q_lo_b)
    past = _pick(sel, past_b)
    tile = _pick(sel, first_b + flat - end_b + tiles_b)

    # ---- query tile
    o_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)          # absolute query positions
    m_m = (o_m >= past) & (o_m < k_len)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < head_size
    q_rows = (q_lo + o_m - past).to(tl.int64)
    p_q = q_ptr + q_rows[:, None] * stride_qt + i_h * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    qk_scale = QK_SCALE
    FOLD_SCALE: tl.constexpr = QK_SCALE > 0

    i_kvh = (i_h // num_queries_per_kv).to(tl.int64)
    k_base = k_ptr + k_lo.to(tl.int64) * stride_kt + i_kvh * stride_kh
    v_base = v_ptr + k_lo.to(tl.int64) * stride_vt + i_kvh * stride_vh
    o_n = tl.arange(0, BLOCK_N)
    k_offs = o_n[None, :] * stride_kt + o_d[:, None]     # [BLOCK_D, BLOCK_N]: K^T tile
    v_offs = o_n[:, None] * stride_vt + o_d[None, :]     # [BLOCK_N, BLOCK_D]
    m_dk = m_d[:, None]
    m_dv = m_d[None, :]
    p_crow = crow_ptr + i_h * stride_crow_h
    p_col = col_ptr + i_h * stride_col_h
    qb = (tile * BLOCK_M) // BLOCK_SIZE                   # the layout row of this tile
    SUB: tl.constexpr = BLOCK_SIZE // BLOCK_N

    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)

    if GROUP == 1:
        start = tl.load(p_crow + qb)
        end = tl.load(p_crow + qb + 1)
        n_below = _count_below(p_col, start, end, qb, CNT_CHUNK)
        # each step's column is loaded one step ahead into a loop-carried scalar:
        # a step's K/V loads then depend on the loop index and that scalar, not on
        # a load in the same step, so they are pipelined. NOTE: H200, Phi-3-small
        # bf16, 2026-11-24: with the column loaded in the step (not pipelined:
        # the cp.async ring drained every step) 1x16384 took 1393 us; with the
        # row's columns held in a register vector and each step's picked out by a
        # masked sum 1304 us (backward_kernels.py's dQ kernel still does that).
        # The sum spans the CTA's four warps: shuffles, a shared-memory exchange
        # and two barriers per step (sm_90 SASS). The loop-carried scalar drops
        # one barrier and the exchange, with the same bits: 2026-11-25, five
        # alternating runs, medians 1295 vs 1329 us at 1x16384 and 774 vs 783 us
        # at 4x4096 (within the runs' spread: 1220-1474 us for the old form).
        c_next = _col_at(p_col, start, 0, n_below * SUB, SUB)
        for j in tl.range(0, n_below * SUB):
            c = c_next
            c_next = _col_at(p_col, start, j + 1, n_below * SUB, SUB)
            kstart = (c * BLOCK_SIZE + (j % SUB) * BLOCK_N).to(tl.int64)
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, b_q, k_base + kstart * stride_kt + k_offs,
                v_base + kstart * stride_vt + v_offs, kstart + o_n, o_m, k_len, qk_scale, m_m,
                m_dk, m_dv, False, False, EVEN_D, IS_FP32, FOLD_SCALE)
        for j in range((start + n_below) * SUB, end * SUB):
            c = tl.load(p_col + j // SUB)
            kstart = (c * BLOCK_SIZE + (j % SUB) * BLOCK_N).to(tl.int64)
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, b_q, k_base + kstart * stride_kt + k_offs,
                v_base + kstart * stride_vt + v_offs, kstart + o_n, o_m, k_len, qk_scale, m_m,
                m_dk, m_dv, True, False, EVEN_D, IS_FP32, FOLD_SCALE)
    else:
        # q_block_size = GROUP rows: attend to the union of the group's rows,
        # each column once (a column already in an earlier row is dropped)
        g0 = (qb // GROUP) * GROUP
        for r in tl.static_range(GROUP):
            start, end = _row_extent(p_crow, g0 + r, num_rows)
            for j in range(start * SUB, end * SUB):
                c = tl.load(p_col + j // SUB)
                drop = _in_earlier_rows(p_crow, p_col, g0, c, r, NNZ_P2)
                kstart = (c * BLOCK_SIZE + (j % SUB) * BLOCK_N).to(tl.int64)
                acc, m_i, l_i = _attend_block(
                    acc, m_i, l_i, b_q, k_base + kstart * stride_kt + k_offs,
                    v_base + kstart * stride_vt + v_offs, kstart + o_n, o_m, k_len, qk_scale,
                    (o_m * 0 + drop) == 0, m_dk, m_dv, True, True, EVEN_D, IS_FP32, FOLD_SCALE)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    b_o = acc / l_safe[:, None]
    p_o = out_ptr + q_rows[:, None] * stride_ot + i_h * stride_oh + o_d[None, :]
    tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])
    if STORE_LSE:
        # natural log (the usual softmax_lse convention); rows with no key keep -inf
        b_lse = tl.where(l_i > 0.0, (m_i + tl.math.log2(l_safe)) * LN2, float("-inf"))
        tl.store(lse_ptr + q_rows * num_heads + i_h, b_lse, mask=m_m)   # lse [Tq, Hq]


@triton.jit
def _merge_heads(part_ptr, p_out, bh0, n_h, stride_oh, NUM_SPLITS: tl.constexpr, S_P2: tl.constexpr,
                 HC: tl.constexpr, LSE_OFFSET: tl.constexpr, head_size: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """The outputs of heads bh0, bh0 + 1, ... (min(n_h, HC) of them; p_out: the
    first one's output row, the others follow at stride_oh), each from its
    NUM_SPLITS partial outputs (scratch rows (bh0 + i) * NUM_SPLITS + s) weighted
    by their base-2 LSEs; one round of loads for all of them. Loaded with .cg:
    written by other programs of this launch (L1 is not coherent). S_P2: a power
    of two >= NUM_SPLITS."""
    o_h = tl.arange(0, HC)
    o_s = tl.arange(0, S_P2)
    o_d = tl.arange(0, BLOCK_D)
    m_h = o_h < n_h
    m_d = o_d < head_size
    rows = (bh0 + o_h)[:, None] * NUM_SPLITS + o_s[None, :]               # [HC, S_P2]
    m_hs = m_h[:, None] & (o_s < NUM_SPLITS)[None, :]
    b_lse = tl.load(part_ptr + LSE_OFFSET + rows, mask=m_hs, other=float("-inf"), cache_modifier=".cg")
    b_o = tl.load(part_ptr + rows.to(tl.int64)[:, :, None] * head_size + o_d[None, None, :],
                  mask=m_hs[:, :, None] & m_d[None, None, :], other=0.0,
                  cache_modifier=".cg")                                     # [HC, S_P2, BLOCK_D]
    m = _max(b_lse, 1)
    w = tl.math.exp2(b_lse - tl.where(m == float("-inf"), 0.0, m)[:, None])
    w_sum = _sum(w, 1)
    out = _sum(w[:, :, None] * b_o, 1) / tl.where(w_sum == 0.0, 1.0, w_sum)[:, None]  # [HC, BLOCK_D]
    tl.store(p_out + o_h[:, None] * stride_oh + o_d[None, :], out.to(p_out.dtype.element_ty),
             mask=m_h[:, None] & m_d[None, :])


@triton.jit
def _store_decode_result(b_o, m_i, l_i, l_safe, p_out, p_part, p_lse, mask_o, mask_lse,
                         NUM_SPLITS: tl.constexpr):
    """A decode program's result: the normalised output itself (one split), or
    the split's partial output and its base-2 LSE (see _finish_decode)."""
    if NUM_SPLITS == 1:
        tl.store(p_out, b_o.to(p_out.dtype.element_ty), mask=mask_o)
    else:
        tl.store(p_part, b_o, mask=mask_o)
        tl.store(p_lse, tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf")), mask=mask_lse)


# NOTE: one launch instead of a decode and a combine kernel: the second launch
# cost ~9 us of host time per call (the C launcher's cuLaunchKernelEx on the
# H200 host), about a quarter of a 1x16384 decode call's wall time. Every split
# takes a ticket on its row's counter after its partial is stored (a CTA barrier,
# then one acq_rel atomic: the release covers the whole CTA's stores); the split
# that draws the last ticket merges the row and sets the counter back to zero,
# so the counters (zeroed once, see Buffer.per_stream) are zero again after
# every launch. Which split merges does not change the result: the merge reads
# the partials in split order. H200, 2026-11-25, Phi-3-small 1x16384 in one
# process (benchmarks/experiments/exp_decode_one_launch.py): 19.6 vs 29.9 us wall
# per call back to back, GPU time 17.6 vs 16.8 us in a CUDA graph.
@triton.jit
def _finish_decode(cnt_ptr, row_id, NUM_SPLITS: tl.constexpr):
    """True in the program that stored the last of row ``row_id``'s splits
    (the counter is reset there)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr + row_id, 1, sem="acq_rel")
    last = ticket == NUM_SPLITS - 1
    if last:
        tl.store(cnt_ptr + row_id, 0)
    return last


# What the two decode kernels (one program per query head and split, or per block
# of GQA heads and split) share besides _store_decode_result, _finish_decode and
# _merge_heads: the sequence's bounds.
@triton.jit
def _decode_sequence(cu_k_ptr, i_b, BLOCK_SIZE: tl.constexpr):
    """Sequence ``i_b``'s first key token, its key count, the query's position
    (its last key) and the layout row of the query's block."""
    k_lo = tl.load(cu_k_ptr + i_b)
    k_len = tl.load(cu_k_ptr + i_b + 1) - k_lo
    q_pos = k_len - 1
    qb = tl.maximum(q_pos, 0) // BLOCK_SIZE
    return k_lo, k_len, q_pos, qb


@jit
def _bsattn_decode_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, cu_k_ptr, crow_ptr, col_ptr,
    # output pointers (part_ptr: [B, Hq, splits] partial outputs, then their LSEs;
    # cnt_ptr: a ticket counter per merged row (or group of rows), zero on entry
    # and on exit; both unused with one split)
    out_ptr, part_ptr, cnt_ptr,
    # constexprs
    num_heads: tl.constexpr, head_size: tl.constexpr, num_queries_per_kv: tl.constexpr,
    stride_qt: tl.constexpr, stride_qh: tl.constexpr, stride_kt: tl.constexpr,
    stride_kh: tl.constexpr, stride_vt: tl.constexpr, stride_vh: tl.constexpr,
    stride_ot: tl.constexpr, stride_oh: tl.constexpr, stride_crow_h: tl.constexpr,
    stride_col_h: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, S_P2: tl.constexpr, MIN_PER_SPLIT: tl.constexpr,
    LSE_OFFSET: tl.constexpr, EVEN_D: tl.constexpr, QK_SCALE: tl.constexpr,
):
    pid = tl.program_id(0)
    i_h = pid % num_heads
    i_s = (pid // num_heads) % NUM_SPLITS
    i_b = pid // (num_heads * NUM_SPLITS)
    k_lo, k_len, q_pos, qb = _decode_sequence(cu_k_ptr, i_b, BLOCK_SIZE)
    p_crow = crow_ptr + i_h * stride_crow_h
    p_col = col_ptr + i_h * stride_col_h
    SUB: tl.constexpr = BLOCK_SIZE // BLOCK_N
    start = tl.load(p_crow + qb) * SUB
    n = tl.load(p_crow + qb + 1) * SUB - start
    per = tl.maximum((n + NUM_SPLITS - 1) // NUM_SPLITS, MIN_PER_SPLIT)
    lo = start + i_s * per
    hi = tl.minimum(lo + per, start + n)

    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < head_size
    o_n = tl.arange(0, BLOCK_N)
    b_q = tl.load(q_ptr + i_b.to(tl.int64) * stride_qt + i_h * stride_qh + o_d, mask=m_d, other=0.0)
    b_q = b_q.to(tl.float32) * QK_SCALE
    i_kvh = (i_h // num_queries_per_kv).to(tl.int64)
    k_base = k_ptr + k_lo.to(tl.int64) * stride_kt + i_kvh * stride_kh
    v_base = v_ptr + k_lo.to(tl.int64) * stride_vt + i_kvh * stride_vh
    k_offs = o_n[:, None] * stride_kt + o_d[None, :]
    v_offs = o_n[:, None] * stride_vt + o_d[None, :]

    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    m_i = _max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    l_i = _sum(tl.full([BLOCK_N], 0.0, tl.float32), 0)
    for j in range(lo, hi):
        c = tl.load(p_col + j // SUB)
        kstart = (c * BLOCK_SIZE + (j % SUB) * BLOCK_N).to(tl.int64)
        kpos = kstart + o_n
        m_k = kpos <= q_pos
        if EVEN_D:
            m_kd = m_k[:, None]
        else:
            m_kd = m_k[:, None] & m_d[None, :]
        b_k = tl.load(k_base + kstart * stride_kt + k_offs, mask=m_kd, other=0.0).to(tl.float32)
        b_s = _sum(b_k * b_q[None, :], 1)                                # [BLOCK_N]
        b_s = tl.where(m_k, b_s, float("-inf"))
        m_new = tl.maximum(m_i, _max(b_s, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        b_p = tl.math.exp2(b_s - m_use)
        l_i = l_i * alpha + _sum(b_p, 0)
        b_v = tl.load(v_base + kstart * stride_vt + v_offs, mask=m_kd, other=0.0).to(tl.float32)
        acc = acc * alpha + _sum(b_p[:, None] * b_v, 0)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    bh = i_b * num_heads + i_h
    row = bh * NUM_SPLITS + i_s
    p_out = out_ptr + i_b.to(tl.int64) * stride_ot + i_h * stride_oh + o_d
    _store_decode_result(acc / l_safe, m_i, l_i, l_safe, p_out,
                         part_ptr + row.to(tl.int64) * head_size + o_d, part_ptr + LSE_OFFSET + row, m_d,
                         None, NUM_SPLITS)
    if NUM_SPLITS > 1:
        if _finish_decode(cnt_ptr, bh, NUM_SPLITS):
            _merge_heads(part_ptr, out_ptr + i_b.to(tl.int64) * stride_ot + i_h * stride_oh, bh, 1,
                         stride_oh, NUM_SPLITS, S_P2, 1, LSE_OFFSET, head_size, BLOCK_D)


@triton.jit
def _or(a, b):
    return a | b


@jit
def _bsattn_decode_group_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, cu_k_ptr, crow_ptr, col_ptr,
    # output pointers (part_ptr: [B, Hq, splits] partial outputs, then their LSEs;
    # cnt_ptr: a ticket counter per merged row (or group of rows), zero on entry
    # and on exit; both unused with one split)
    out_ptr, part_ptr, cnt_ptr,
    # constexprs
    num_heads: tl.constexpr, head_size: tl.constexpr, num_queries_per_kv: tl.constexpr,
    stride_qt: tl.constexpr, stride_qh: tl.constexpr, stride_kt: tl.constexpr,
    stride_kh: tl.constexpr, stride_vt: tl.constexpr, stride_vh: tl.constexpr,
    stride_ot: tl.constexpr, stride_oh: tl.constexpr, stride_crow_h: tl.constexpr,
    stride_col_h: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEADS: tl.constexpr, CHUNK: tl.constexpr, CNT_CHUNK: tl.constexpr, NUM_SPLITS: tl.constexpr,
    S_P2: tl.constexpr, MERGE_HEADS: tl.constexpr, NUM_SUB: tl.constexpr, LSE_OFFSET: tl.constexpr,
    EVEN_D: tl.constexpr, IS_FP32: tl.constexpr,
    QK_SCALE: tl.constexpr,
):
    """Decode with GQA packing: one program = HEADS query heads of one KV head.

    The heads' query rows are the M rows of the dots, so each K/V block of the
    UNION of their layout rows is loaded once; a head whose row lacks the block
    masks it (-inf scores). Key blocks are cut into CHUNK-block chunks of
    absolute positions; split i_s takes chunks i_s, i_s + NUM_SPLITS, ...
    (interleaved: the dense local window spreads over the splits). Per chunk,
    each head's membership is a bitmask (bit x: block b0 + x); the loop walks
    the set bits of their OR, lowest first.
    """
    pid = tl.program_id(0)
    N_HB: tl.constexpr = (num_queries_per_kv + HEADS - 1) // HEADS
    num_kv: tl.constexpr = num_heads // num_queries_per_kv
    i_hb = pid % N_HB
    i_kvh = (pid // N_HB) % num_kv
    i_s = (pid // (N_HB * num_kv)) % NUM_SPLITS
    i_b = pid // (N_HB * num_kv * NUM_SPLITS)
    k_lo, k_len, q_pos, qb = _decode_sequence(cu_k_ptr, i_b, BLOCK_SIZE)

    # this program's heads: [HEADS] for the layout, [BLOCK_M] (>= 16, tl.dot) for the tiles
    o_g = tl.arange(0, HEADS)
    m_g = i_hb * HEADS + o_g < num_queries_per_kv
    h_g = i_kvh * num_queries_per_kv + i_hb * HEADS + o_g
    o_m = tl.arange(0, BLOCK_M)
    m_m = (o_m < HEADS) & (i_hb * HEADS + o_m < num_queries_per_kv)
    h_m = i_kvh * num_queries_per_kv + i_hb * HEADS + o_m
    p_crow = crow_ptr + h_g * stride_crow_h + qb
    start_g = tl.load(p_crow, mask=m_g, other=0)
    len_g = tl.load(p_crow + 1, mask=m_g, other=0) - start_g
    p_col_g = col_ptr + h_g * stride_col_h + start_g                     # [HEADS]
    max_len = _max(len_g, 0)

    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < head_size
    b_q = tl.load(q_ptr + i_b.to(tl.int64) * stride_qt + h_m[:, None] * stride_qh + o_d[None, :],
                  mask=m_m[:, None] & m_d[None, :], other=0.0)             # [BLOCK_M, BLOCK_D]
    qk_scale = QK_SCALE
    FOLD_SCALE: tl.constexpr = QK_SCALE > 0
    k_base = k_ptr + k_lo.to(tl.int64) * stride_kt + i_kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + k_lo.to(tl.int64) * stride_vt + i_kvh.to(tl.int64) * stride_vh
    o_n = tl.arange(0, BLOCK_N)
    k_offs = o_n[None, :] * stride_kt + o_d[:, None]                      # [BLOCK_D, BLOCK_N]: K^T
    v_offs = o_n[:, None] * stride_vt + o_d[None, :]                      # [BLOCK_N, BLOCK_D]
    m_dk = m_d[:, None]
    m_dv = m_d[None, :]
    q_pos_m = o_m * 0 + q_pos
    SUB: tl.constexpr = BLOCK_SIZE // BLOCK_N
    o_c = tl.arange(0, CNT_CHUNK)
    o_x = tl.arange(0, CHUNK)
    o_x64 = o_x.to(tl.int64)                                              # int64 bit masks

    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    for sc in range(NUM_SUB):
        b0 = (i_s + sc * NUM_SPLITS) * CHUNK
        # per head: bit x set iff its row holds block b0 + x (columns are distinct)
        bits_g = (o_g * 0).to(tl.int64)
        for off in range(0, max_len, CNT_CHUNK):
            m_c = m_g[:, None] & (off + o_c[None, :] < len_g[:, None])
            b_c = tl.load(p_col_g[:, None] + off + o_c[None, :], mask=m_c, other=-1) - b0
            hit = (b_c >= 0) & (b_c < CHUNK)                               # [HEADS, CNT_CHUNK]
            bit = hit.to(tl.int64) << tl.where(hit, b_c, 0).to(tl.int64)
            bits_g = bits_g | tl.reduce(bit, 1, _or)
        # blocks past the query's block are fully masked: drop them
        keep = _sum((o_x < qb + 1 - b0).to(tl.int64) << o_x64, 0)
        bits_g = bits_g & keep
        bits = tl.reduce(bits_g, 0, _or)                                   # union (scalar)
        bits_m = _sum(tl.where(o_m[:, None] == o_g[None, :], bits_g[None, :], 0), 1)  # [BLOCK_M]
        n_u = _sum(((bits >> o_x64) & 1).to(tl.int32), 0)
        for _ in range(0, n_u):
            low = bits & (-bits)                                           # lowest set bit
            bits = bits ^ low
            # log2 of a power of two: the fp32 exponent field
            x = (low.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
            row_ok = (bits_m & low) != 0
            for t in tl.static_range(SUB):
                kstart = ((b0 + x) * BLOCK_SIZE + t * BLOCK_N).to(tl.int64)
                acc, m_i, l_i = _attend_block(
                    acc, m_i, l_i, b_q, k_base + kstart * stride_kt + k_offs,
                    v_base + kstart * stride_vt + v_offs, kstart + o_n, q_pos_m, k_len, qk_scale,
                    row_ok, m_dk, m_dv, True, True, EVEN_D, IS_FP32, FOLD_SCALE)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    row = ((i_b * num_heads + h_m) * NUM_SPLITS + i_s).to(tl.int64)   # [BLOCK_M]
    _store_decode_result(acc / l_safe[:, None], m_i, l_i, l_safe,
                         out_ptr + i_b.to(tl.int64) * stride_ot + h_m[:, None] * stride_oh + o_d[None, :],
                         part_ptr + row[:, None] * head_size + o_d[None, :], part_ptr + LSE_OFFSET + row,
                         m_m[:, None] & m_d[None, :], m_m, NUM_SPLITS)
    if NUM_SPLITS > 1:
        # one counter per (sequence, KV head, head block): its last split merges its heads
        if _finish_decode(cnt_ptr, pid % (N_HB * num_kv) + i_b * (N_HB * num_kv), NUM_SPLITS):
            h0 = i_kvh * num_queries_per_kv + i_hb * HEADS                  # the block's first head
            n_live = tl.minimum(num_queries_per_kv - i_hb * HEADS, HEADS)
            for c in tl.static_range(0, HEADS, MERGE_HEADS):
                _merge_heads(part_ptr, out_ptr + i_b.to(tl.int64) * stride_ot + (h0 + c) * stride_oh,
                             i_b * num_heads + h0 + c, n_live - c, stride_oh, NUM_SPLITS, S_P2,
                             MERGE_HEADS, LSE_OFFSET, head_size, BLOCK_D)

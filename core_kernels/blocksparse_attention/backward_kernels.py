"""Triton kernels for the backward of block-sparse varlen attention (framework-free).

Three launches (on sm_90, for bf16/fp16 at D = 128 with 64-token blocks, the
dQ and dK/dV launches run gluon_backward.py's kernels instead: same contract),
all deterministic: every gradient element is written by
exactly one program, which sums its terms in a fixed order (the only atomics
are the bitwise ORs that build the transposed layout, whose result does not
depend on their order):

- ``_bsattn_bwd_colmask_kernel``: the transposed layout. For each layout head
  and key block kb, a bit set over query-block rows: bit qb of word qb // 32 is
  set iff a query tile in row qb attends to kb (the union over the rows of its
  q block when q_block_size > block_size, exactly as the forward walks it;
  only kb <= qb, later blocks being causally masked). Built on the device
  from (crow, col), so it needs no host copy of the layout.
- ``_bsattn_bwd_dq_kernel``: one program per (query tile, query head), the
  forward's tile schedule and column walk; dQ = scale * dS @ K with
  dS = P * (dP - delta), P recomputed from the forward's saved LSE and
  delta = rowsum(dO * O) computed from the tile's O and dO (and stored for the
  dK/dV kernel, which runs after it).
- ``_bsattn_bwd_dkdv_kernel``: one program per (key tile, KV head). It walks
  the query heads of its GQA group in order and, for each, the rows set in the
  transposed layout (ascending), so dK = scale * dS^T @ Q and dV = P^T @ dO
  are summed over the group's heads without atomics.

Scores are handled in base 2 as in the forward: P = exp2(qk * QK_SCALE - lse * log2(e)),
QK_SCALE = sm_scale * log2(e); the saved lse is the natural-log LSE [Tq, Hq].
"""
import triton
import triton.language as tl

from .._triton_utils import jit
from .kernels import (_add, _col_at, _count_below, _in_earlier_rows, _locate, _or, _pick, _query_tiles, _row_extent,
                      _seq_bounds, _sum)

LOG2E = tl.constexpr(1.4426950408889634)   # a constexpr: the GPU compiler refuses plain globals

ROWS_PER_WORD = tl.constexpr(32)  # rows of the transposed layout per int32 word


@triton.jit
def _dot(a, b, IS_FP32: tl.constexpr):
    """a @ b with fp32 accumulation: exact fp32 products for fp32 inputs (as the
    forward), else the inputs' 16-bit type (b's; a is cast)."""
    if IS_FP32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a.to(b.dtype), b)


@jit
def _bsattn_bwd_colmask_kernel(
    # input pointers
    crow_ptr, col_ptr,
    # output pointers
    colmask_ptr,
    # constexprs
    num_rows: tl.constexpr, stride_crow_h: tl.constexpr, stride_col_h: tl.constexpr,
    GROUP: tl.constexpr, WORDS: tl.constexpr, CNT_CHUNK: tl.constexpr,
):
    """Program (layout head, query row qb): sets bit qb of colmask[h, kb, qb // 32]
    for every key block kb <= qb of the union of qb's q block rows. colmask is
    zeroed by the executor; the bits are set with atomic ORs, which commute, so
    the mask is the same whatever order the programs run in."""
    pid = tl.program_id(0)
    qb = pid % num_rows
    i_h = pid // num_rows
    p_crow = crow_ptr + i_h * stride_crow_h
    p_col = col_ptr + i_h * stride_col_h
    p_mask = colmask_ptr + i_h * (num_rows * WORDS) + qb // ROWS_PER_WORD
    bit = 1 << (qb % ROWS_PER_WORD)
    o_c = tl.arange(0, CNT_CHUNK)
    g0 = (qb // GROUP) * GROUP
    for rr in tl.static_range(GROUP):
        start, end = _row_extent(p_crow, g0 + rr, num_rows)
        for off in range(start, end, CNT_CHUNK):
            o = off + o_c
            b_c = tl.load(p_col + o, mask=o < end, other=num_rows)        # [CNT_CHUNK] key blocks
            tl.atomic_or(p_mask + b_c * WORDS, o_c * 0 + bit, mask=b_c <= qb, sem="relaxed")


@triton.jit
def _load_query_tile(q_ptr, do_ptr, lse_ptr, delta_ptr, q_rows, i_h, o_d, m_m, m_md,
                     num_heads: tl.constexpr, stride_qt: tl.constexpr, stride_qh: tl.constexpr,
                     stride_dot: tl.constexpr, stride_doh: tl.constexpr):
    """A query tile's q, dO [BLOCK_M, BLOCK_D], LSE in base 2 and delta [BLOCK_M]
    (head i_h, token rows q_rows)."""
    b_q = tl.load(q_ptr + q_rows[:, None] * stride_qt + i_h * stride_qh + o_d[None, :], mask=m_md,
                  other=0.0)                                                  # [BLOCK_M, BLOCK_D]
    b_do = tl.load(do_ptr + q_rows[:, None] * stride_dot + i_h * stride_doh + o_d[None, :],
                   mask=m_md, other=0.0)
    b_lse2 = tl.load(lse_ptr + q_rows * num_heads + i_h, mask=m_m, other=0.0) * LOG2E
    b_delta = tl.load(delta_ptr + q_rows * num_heads + i_h, mask=m_m, other=0.0)
    return b_q, b_do, b_lse2, b_delta


@triton.jit
def _dq_step(b_dq, b_q, b_do, b_lse2, b_delta, k_ptrs, v_ptrs, kpos, q_pos, k_len, row_ok, m_dk,
             MASKED: tl.constexpr, HAS_ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr,
             IS_FP32: tl.constexpr, QK_SCALE: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] step of dQ: k_ptrs / v_ptrs address K^T / V^T tiles
    [BLOCK_D, BLOCK_N]; MASKED applies the causal mask and key bounds."""
    if MASKED:
        m_k = kpos < k_len
        if EVEN_D:
            m_kd = m_k[None, :]
        else:
            m_kd = m_k[None, :] & m_dk
        b_kt = tl.load(k_ptrs, mask=m_kd, other=0.0)                         # [BLOCK_D, BLOCK_N]
        b_vt = tl.load(v_ptrs, mask=m_kd, other=0.0)
    else:
        if EVEN_D:
            b_kt = tl.load(k_ptrs)
            b_vt = tl.load(v_ptrs)
        else:
            b_kt = tl.load(k_ptrs, mask=m_dk, other=0.0)
            b_vt = tl.load(v_ptrs, mask=m_dk, other=0.0)
    b_s = _dot(b_q, b_kt, IS_FP32)                                            # [BLOCK_M, BLOCK_N]
    b_p = tl.math.exp2(b_s * QK_SCALE - b_lse2[:, None])
    if MASKED:
        m_s = kpos[None, :] <= q_pos[:, None]
        if HAS_ROW_MASK:
            m_s = m_s & row_ok[:, None]
        b_p = tl.where(m_s, b_p, 0.0)
    b_dp = _dot(b_do, b_vt, IS_FP32)                                          # [BLOCK_M, BLOCK_N]
    b_ds = b_p * (b_dp - b_delta[:, None])
    return b_dq + _dot(b_ds, tl.trans(b_kt), IS_FP32)                         # [BLOCK_M, BLOCK_D]


@jit
def _bsattn_bwd_dq_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, out_ptr, do_ptr, lse_ptr, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr,
    # runtime scalars
    num_seqs,
    # output pointers
    dq_ptr, delta_ptr,
    # constexprs
    num_heads: tl.constexpr, num_rows: tl.constexpr, head_size: tl.constexpr,
    num_queries_per_kv: tl.constexpr,
    stride_qt: tl.constexpr, stride_qh: tl.constexpr, stride_kt: tl.constexpr,
    stride_kh: tl.constexpr, stride_vt: tl.constexpr, stride_vh: tl.constexpr,
    stride_ot: tl.constexpr, stride_oh: tl.constexpr,
    stride_dot: tl.constexpr, stride_doh: tl.constexpr, stride_crow_h: tl.constexpr,
    stride_col_h: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, GROUP: tl.constexpr, B_P2: tl.constexpr, NNZ_P2: tl.constexpr,
    CNT_CHUNK: tl.constexpr, DECODE_Q: tl.constexpr, EVEN_D: tl.constexpr, IS_FP32: tl.constexpr,
    QK_SCALE: tl.constexpr, SM_SCALE: tl.constexpr,
):
    """dQ [Tq, Hq, D] (q's dtype): the forward's tile schedule and column walk;
    delta [Tq, Hq] fp32 = rowsum(dO * O) of the tile's rows as well."""
    pid = tl.program_id(0)
    i_h = pid % num_heads
    flat = tl.num_programs(0) // num_heads - 1 - pid // num_heads   # heaviest tiles first

    # ---- tile schedule from cu_seqlens, on the device (as the forward)
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

    # ---- query tile: q, dO, LSE (base 2); delta from O and dO, stored for dK/dV
    o_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = (o_m >= past) & (o_m < k_len)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < head_size
    q_rows = (q_lo + o_m - past).to(tl.int64)
    m_md = m_m[:, None] & m_d[None, :]
    b_q = tl.load(q_ptr + q_rows[:, None] * stride_qt + i_h * stride_qh + o_d[None, :], mask=m_md,
                  other=0.0)                                                  # [BLOCK_M, BLOCK_D]
    b_do = tl.load(do_ptr + q_rows[:, None] * stride_dot + i_h * stride_doh + o_d[None, :],
                   mask=m_md, other=0.0)
    b_o = tl.load(out_ptr + q_rows[:, None] * stride_ot + i_h * stride_oh + o_d[None, :], mask=m_md,
                  other=0.0)
    b_lse2 = tl.load(lse_ptr + q_rows * num_heads + i_h, mask=m_m, other=0.0) * LOG2E
    b_delta = _sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)               # [BLOCK_M]
    tl.store(delta_ptr + q_rows * num_heads + i_h, b_delta, mask=m_m)

    i_kvh = (i_h // num_queries_per_kv).to(tl.int64)
    k_base = k_ptr + k_lo.to(tl.int64) * stride_kt + i_kvh * stride_kh
    v_base = v_ptr + k_lo.to(tl.int64) * stride_vt + i_kvh * stride_vh
    o_n = tl.arange(0, BLOCK_N)
    k_offs = o_n[None, :] * stride_kt + o_d[:, None]                          # [BLOCK_D, BLOCK_N]: K^T
    v_offs = o_n[None, :] * stride_vt + o_d[:, None]                          # V^T
    m_dk = m_d[:, None]
    p_crow = crow_ptr + i_h * stride_crow_h
    p_col = col_ptr + i_h * stride_col_h
    qb = (tile * BLOCK_M) // BLOCK_SIZE
    SUB: tl.constexpr = BLOCK_SIZE // BLOCK_N

    b_dq = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    if GROUP == 1:
        start = tl.load(p_crow + qb)
        end = tl.load(p_crow + qb + 1)
        n_below = _count_below(p_col, start, end, qb, CNT_CHUNK)
        # each step's column loaded one step ahead into a loop-carried scalar, as
        # in the forward (kernels.py's NOTE): the K/V loads stay pipelined. NOTE:
        # H200, Phi-3-small 1x16384 bf16: with the column loaded in the step this
        # kernel alone took 1.945 ms, with the row's columns in a register vector
        # picked by a masked sum (a cross-warp reduction per step) 1.707 ms
        # (2026-11-24).
        c_next = _col_at(p_col, start, 0, n_below * SUB, SUB)
        for j in tl.range(0, n_below * SUB):
            c = c_next
            c_next = _col_at(p_col, start, j + 1, n_below * SUB, SUB)
            kstart = (c * BLOCK_SIZE + (j % SUB) * BLOCK_N).to(tl.int64)
            b_dq = _dq_step(b_dq, b_q, b_do, b_lse2, b_delta, k_base + kstart * stride_kt + k_offs,
                            v_base + kstart * stride_vt + v_offs, kstart + o_n, o_m, k_len, m_m, m_dk,
                            False, False, EVEN_D, IS_FP32, QK_SCALE)
        for j in range((start + n_below) * SUB, end * SUB):
            c = tl.load(p_col + j // SUB)
            kstart = (c * BLOCK_SIZE + (j % SUB) * BLOCK_N).to(tl.int64)
            b_dq = _dq_step(b_dq, b_q, b_do, b_lse2, b_delta, k_base + kstart * stride_kt + k_offs,
                            v_base + kstart * stride_vt + v_offs, kstart + o_n, o_m, k_len, m_m, m_dk,
                            True, False, EVEN_D, IS_FP32, QK_SCALE)
    else:
        # the union of the q block's rows, each column once (as the forward)
        g0 = (qb // GROUP) * GROUP
        for r in tl.static_range(GROUP):
            start, end = _row_extent(p_crow, g0 + r, num_rows)
            for j in range(start * SUB, end * SUB):
                c = tl.load(p_col + j // SUB)
                drop = _in_earlier_rows(p_crow, p_col, g0, c, r, NNZ_P2)
                kstart = (c * BLOCK_SIZE + (j % SUB) * BLOCK_N).to(tl.int64)
                b_dq = _dq_step(b_dq, b_q, b_do, b_lse2, b_delta,
                                k_base + kstart * stride_kt + k_offs,
                                v_base + kstart * stride_vt + v_offs, kstart + o_n, o_m, k_len,
                                (o_m * 0 + drop) == 0, m_dk, True, True, EVEN_D, IS_FP32, QK_SCALE)

    b_dq = b_dq * SM_SCALE
    p_dq = dq_ptr + q_rows[:, None] * (num_heads * head_size) + i_h * head_size + o_d[None, :]
    tl.store(p_dq, b_dq.to(dq_ptr.dtype.element_ty), mask=m_md)


@triton.jit
def _dkdv_step(b_dk, b_dv, b_k, b_v, q_ptr, do_ptr, lse_ptr, delta_ptr, i_h, q_lo, past, k_len,
               o_m, o_n, o_d, m_d, num_heads: tl.constexpr, stride_qt: tl.constexpr,
               stride_qh: tl.constexpr, stride_dot: tl.constexpr, stride_doh: tl.constexpr,
               MASKED: tl.constexpr, EVEN_D: tl.constexpr, IS_FP32: tl.constexpr,
               QK_SCALE: tl.constexpr):
    """One step of dK / dV over the query rows at absolute positions o_m
    [BLOCK_M] of head i_h; transposed scores [BLOCK_N, BLOCK_M]: keys are the
    rows. MASKED applies the causal mask and the sequence's query bounds;
    without it every row must lie in the sequence and after every key."""
    q_rows = (q_lo + o_m - past).to(tl.int64)
    if MASKED:
        m_m = (o_m >= past) & (o_m < k_len)
        b_q, b_do, b_lse2, b_delta = _load_query_tile(q_ptr, do_ptr, lse_ptr, delta_ptr, q_rows, i_h, o_d,
                                                      m_m, m_m[:, None] & m_d[None, :], num_heads,
                                                      stride_qt, stride_qh, stride_dot, stride_doh)
    else:
        p_q = q_ptr + q_rows[:, None] * stride_qt + i_h * stride_qh + o_d[None, :]
        p_do = do_ptr + q_rows[:, None] * stride_dot + i_h * stride_doh + o_d[None, :]
        if EVEN_D:
            b_q = tl.load(p_q)
            b_do = tl.load(p_do)
        else:
            b_q = tl.load(p_q, mask=m_d[None, :], other=0.0)
            b_do = tl.load(p_do, mask=m_d[None, :], other=0.0)
        b_lse2 = tl.load(lse_ptr + q_rows * num_heads + i_h) * LOG2E
        b_delta = tl.load(delta_ptr + q_rows * num_heads + i_h)
    b_st = _dot(b_k, tl.trans(b_q), IS_FP32)                                  # [BLOCK_N, BLOCK_M]
    b_pt = tl.math.exp2(b_st * QK_SCALE - b_lse2[None, :])
    if MASKED:
        # causal (key <= query) within the sequence's query rows; keys past k_len
        # fall out with it (query < k_len)
        b_pt = tl.where((o_n[:, None] <= o_m[None, :]) & m_m[None, :], b_pt, 0.0)
    b_dv += _dot(b_pt, b_do, IS_FP32)                                         # [BLOCK_N, BLOCK_D]
    b_dpt = _dot(b_v, tl.trans(b_do), IS_FP32)                                # [BLOCK_N, BLOCK_M]
    b_dst = b_pt * (b_dpt - b_delta[None, :])
    b_dk += _dot(b_dst, b_q, IS_FP32)                                         # [BLOCK_N, BLOCK_D]
    return b_dk, b_dv


@jit
def _bsattn_bwd_dkdv_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, cu_k_ptr, cu_q_ptr, colmask_ptr,
    # runtime scalars
    num_seqs,
    # output pointers
    dk_ptr, dv_ptr,
    # constexprs
    num_heads: tl.constexpr, num_kv_heads: tl.constexpr, num_rows: tl.constexpr,
    head_size: tl.constexpr, num_queries_per_kv: tl.constexpr,
    stride_qt: tl.constexpr, stride_qh: tl.constexpr, stride_kt: tl.constexpr,
    stride_kh: tl.constexpr, stride_vt: tl.constexpr, stride_vh: tl.constexpr,
    stride_dot: tl.constexpr, stride_doh: tl.constexpr, stride_mask_h: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, B_P2: tl.constexpr, WORDS: tl.constexpr, DECODE_Q: tl.constexpr,
    EVEN_D: tl.constexpr,
    IS_FP32: tl.constexpr, QK_SCALE: tl.constexpr, SM_SCALE: tl.constexpr,
):
    """dK, dV [Tk, Hkv, D] (k's dtype): program (key tile, KV head) sums over the
    query heads of its group and the query rows of the transposed layout."""
    pid = tl.program_id(0)
    i_kvh = pid % num_kv_heads
    flat = pid // num_kv_heads    # a sequence's first key tiles (the most rows) first

    # ---- key tile schedule from cu_seqlens: every key of every sequence (a key no
    # query attends to gets zero gradients, written here)
    o_b, k_lo_b, k_len_b, q_lo_b, q_len_b = _seq_bounds(cu_k_ptr, cu_q_ptr, num_seqs, B_P2, DECODE_Q)
    tiles_b = (k_len_b + BLOCK_N - 1) // BLOCK_N
    end_b, i_b = _locate(tiles_b, flat)
    if i_b >= num_seqs:
        return
    sel = o_b == i_b
    k_lo = _pick(sel, k_lo_b)
    k_len = _pick(sel, k_len_b)
    q_lo = _pick(sel, q_lo_b)
    q_len = _pick(sel, q_len_b)
    past = k_len - q_len
    tile = _pick(sel, flat - end_b + tiles_b)

    kstart = tile * BLOCK_N
    o_n = kstart + tl.arange(0, BLOCK_N)                                      # key positions
    m_n = o_n < k_len
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < head_size
    m_nd = m_n[:, None] & m_d[None, :]
    k_rows = (k_lo + o_n).to(tl.int64)
    b_k = tl.load(k_ptr + k_rows[:, None] * stride_kt + i_kvh * stride_kh + o_d[None, :], mask=m_nd,
                  other=0.0)                                                  # [BLOCK_N, BLOCK_D]
    b_v = tl.load(v_ptr + k_rows[:, None] * stride_vt + i_kvh * stride_vh + o_d[None, :], mask=m_nd,
                  other=0.0)
    b_dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    b_dv = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)

    kb = kstart // BLOCK_SIZE
    r_lo = tl.maximum(kb, past // BLOCK_SIZE)        # query rows that can see this key block
    r_hi = (k_len - 1) // BLOCK_SIZE                 # inclusive
    o_x = tl.arange(0, 32)
    o_mm = tl.arange(0, BLOCK_M)
    SUBM: tl.constexpr = BLOCK_SIZE // BLOCK_M
    if q_len > 0:
        for hh in range(num_queries_per_kv):
            i_h = i_kvh * num_queries_per_kv + hh
            p_mask = colmask_ptr + (i_h * stride_mask_h + kb) * WORDS
            if SUBM == 1:
                # the edge rows r_lo (the diagonal, or the sequence's first query row)
                # and r_hi (its last) with the masks; the rows between need none.
                # NOTE: H200, Phi-3-small 1x16384 bf16: this kernel 3.165 -> 3.035 ms,
                # fwd+bwd 6.18 -> 6.12 ms (2026-11-24; bench_blocksparse_backward.py)
                for e in range(0, 1 + (r_hi > r_lo).to(tl.int32)):
                    r = r_lo + e * (r_hi - r_lo)
                    if ((tl.load(p_mask + r // 32) >> (r % 32)) & 1) == 1:
                        b_dk, b_dv = _dkdv_step(
                            b_dk, b_dv, b_k, b_v, q_ptr, do_ptr, lse_ptr, delta_ptr, i_h, q_lo, past,
                            k_len, r * BLOCK_SIZE + o_mm, o_n, o_d, m_d, num_heads, stride_qt, stride_qh,
                            stride_dot, stride_doh, True, EVEN_D, IS_FP32, QK_SCALE)
                first = r_lo + 1
                last = r_hi - 1
            else:
                first = r_lo
                last = r_hi
            for w in range(r_lo // 32, r_hi // 32 + 1):
                bits = tl.load(p_mask + w)
                lo = first - w * 32
                hi = last - w * 32
                keep = tl.reduce(tl.where((o_x >= lo) & (o_x <= hi), 1 << o_x, 0), 0, _or)
                bits = bits & keep
                # the set bits' rows as a list (rank of each set bit): the step's loads
                # then depend on the loop index alone, so the loop is software-pipelined.
                # NOTE: the bit scan before (each row found from the previous one's
                # bits) left the loads unpipelined: H200, Phi-3-small 1x16384 bf16,
                # this kernel alone 3.9 -> 3.28 ms, fwd+bwd 7.31 -> 6.65-6.75 ms
                # (2026-11-24; benchmarks/bench_blocksparse_backward.py). Measured and not
                # kept: one list over all of a head's rows (every row's bit gathered from
                # its word, ranked by one scan over next_pow2(rows) lanes, a single loop
                # per head): 3.46 ms, slower (same day). Also measured and not kept
                # (H200, the backward launches; 2026-11-24, code of e841cc8 and after):
                # two rows per step (a 128-query gathered tile, both rows' bits ranked)
                # 16.9 ms against 4.87 at 4 warps and 8.6 against 7.2 at 8; steps of 32
                # query rows 4.73 against 4.83 and, issuing the dP^T product before P^T,
                # 4.84-5.17 (within the run's noise: the default timed 4.83 and 5.35)
                is_set = ((bits >> o_x) & 1) == 1
                rank = tl.associative_scan(is_set.to(tl.int32), 0, _add) - 1
                n_set = _sum(is_set.to(tl.int32), 0)
                for i in tl.range(0, n_set):
                    qb = w * 32 + _sum(tl.where(is_set & (rank == i), o_x, 0), 0)
                    if SUBM == 1:  # an interior row: wholly in the sequence, after the keys
                        b_dk, b_dv = _dkdv_step(
                            b_dk, b_dv, b_k, b_v, q_ptr, do_ptr, lse_ptr, delta_ptr, i_h, q_lo,
                            past, k_len, qb * BLOCK_SIZE + o_mm, o_n, o_d, m_d, num_heads, stride_qt,
                            stride_qh, stride_dot, stride_doh, False, EVEN_D, IS_FP32, QK_SCALE)
                    else:
                        for j in tl.static_range(SUBM):
                            qstart = qb * BLOCK_SIZE + j * BLOCK_M
                            # skip sub-tiles wholly outside the sequence's queries or before the keys
                            if (qstart + BLOCK_M > past) & (qstart < k_len) & (qstart + BLOCK_M > kstart):
                                b_dk, b_dv = _dkdv_step(
                                    b_dk, b_dv, b_k, b_v, q_ptr, do_ptr, lse_ptr, delta_ptr, i_h,
                                    q_lo, past, k_len, qstart + o_mm, o_n, o_d, m_d, num_heads,
                                    stride_qt, stride_qh, stride_dot, stride_doh, True, EVEN_D, IS_FP32,
                                    QK_SCALE)

    b_dk = b_dk * SM_SCALE
    p_out = k_rows[:, None] * (num_kv_heads * head_size) + i_kvh * head_size + o_d[None, :]
    tl.store(dk_ptr + p_out, b_dk.to(dk_ptr.dtype.element_ty), mask=m_nd)
    tl.store(dv_ptr + p_out, b_dv.to(dv_ptr.dtype.element_ty), mask=m_nd)

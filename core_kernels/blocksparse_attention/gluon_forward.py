"""The block-sparse prefill forward in Gluon (sm_90, 16-bit inputs, D = 128, 64-token blocks).

The Triton prefill kernel (kernels.py) waits for each wgmma right after
issuing it, so a step's exp runs with the tensor cores idle. This kernel
overlaps them (FA3's intra-warpgroup overlap): step j issues S(j) = Q K_j^T
and the previous step's O += P(j-1) V_(j-1) together, forms the online
softmax of S(j) while the latter runs, then rescales O once it is done.
K and V arrive through a three-slot cp.async ring, two blocks ahead. Only the
diagonal block takes a mask (causal; it also covers the keys past the
sequence's end, which lie in its last block, the last tile's diagonal);
query rows outside the sequence have zero Q and are not stored.

Same launch, arguments and tile schedule as _bsattn_fwd_kernel /
_bsattn_fwd_lse_kernel, the same products (16-bit operands, fp32
accumulation, P rounded to the input type for P V). Scope (the planner checks
it): GPU sm_90, bf16 or fp16, head size 128, block_size = block_m = block_n =
64, q_block_size = block_size, 4 warps.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                             warpgroup_mma_wait)

from .._triton_utils import jit
from .gluon_backward import _add, _exp2_ftz, _load_kv_block, _pick, _seq_bounds

LN2 = gl.constexpr(0.6931471805599453)
RING = gl.constexpr(3)   # K/V ring slots: block j + 2 loads while step j runs


@gluon.jit
def _union_next(p_a, p_b, ia, ib, n_a, n_b):
    """The next key block of the union of two ascending column lists (rows A and
    B of the pair) from cursors ia, ib: (block, in A, in B, ia', ib', valid)."""
    BIG: gl.constexpr = 2147483647
    ca = gl.load(p_a + ia, mask=ia < n_a, other=BIG)
    cb = gl.load(p_b + ib, mask=ib < n_b, other=BIG)
    c = gl.minimum(ca, cb)
    in_a = ca == c
    in_b = cb == c
    return c, in_a, in_b, ia + in_a.to(gl.int32), ib + in_b.to(gl.int32), c < BIG


@gluon.jit
def _softmax_step(acc_s, m_i, l_i, c, in_a, in_b, qb_a, r_s, QK_SCALE: gl.constexpr, mma_s: gl.constexpr):
    """Online softmax of one [128, 64] score tile (rows 0-63: layout row qb_a,
    64-127: qb_a + 1) for key block c: P (unnormalised, base 2), the new running
    max and sum, and alpha = 2^(m_old - m_new) for the output. A half whose row
    does not hold c is masked whole; the row whose diagonal c is, causally."""
    s = acc_s * QK_SCALE
    HALF: gl.constexpr = acc_s.shape[0] // 2
    if (not in_a) | (not in_b) | (c >= qb_a):
        c_s = gl.arange(0, acc_s.shape[1], layout=gl.SliceLayout(0, mma_s))
        half_b = r_s >= HALF
        row_has = gl.where(half_b, in_b, in_a)
        diag = c == qb_a + half_b.to(gl.int32)
        keep = row_has[:, None] & ((c_s[None, :] <= (r_s % HALF)[:, None]) | (not diag)[:, None])
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)   # a row with no key yet
    alpha = _exp2_ftz(m_i - m_use)
    b_p = _exp2_ftz(s - m_use[:, None])
    return b_p, m_new, l_i * alpha + gl.sum(b_p, 1), alpha


@gluon.jit
def _bsattn_fwd_gluon_program(
    q_ptr, k_ptr, v_ptr, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr, num_seqs, out_ptr, lse_ptr,
    num_heads: gl.constexpr, num_rows: gl.constexpr, head_size: gl.constexpr,
    num_queries_per_kv: gl.constexpr, stride_qt: gl.constexpr, stride_qh: gl.constexpr,
    stride_kt: gl.constexpr, stride_kh: gl.constexpr, stride_vt: gl.constexpr, stride_vh: gl.constexpr,
    stride_ot: gl.constexpr, stride_oh: gl.constexpr, stride_crow_h: gl.constexpr,
    stride_col_h: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    B_P2: gl.constexpr, NNZ_P2: gl.constexpr, DECODE_Q: gl.constexpr, QK_SCALE: gl.constexpr,
    STORE_LSE: gl.constexpr,
):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    M2: gl.constexpr = 2 * BLOCK_M                         # a pair of query tiles (layout rows)
    lb: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])          # [*, 128] tiles
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                    instr_shape=[16, BLOCK_N, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                    instr_shape=[16, BLOCK_D, 16])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    sh_q: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M2, BLOCK_D], dtype)
    sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)

    pid = gl.program_id(0)
    i_h = pid % num_heads   # heads fastest: the heads of one KV group run together (L2 reuse)
    flat = gl.num_programs(0) // num_heads - 1 - pid // num_heads   # heaviest pairs first

    # ---- schedule: each sequence's query tiles in pairs (rows qb_a, qb_a + 1)
    o_b, k_lo_b, k_len_b, q_lo_b, q_len_b = _seq_bounds(cu_k_ptr, cu_q_ptr, num_seqs, B_P2, DECODE_Q, lb)
    first_b = (k_len_b - q_len_b) // BLOCK_M
    tiles_b = gl.where(q_len_b > 0, (k_len_b + BLOCK_M - 1) // BLOCK_M - first_b, 0)
    pairs_b = (tiles_b + 1) // 2
    end_b = gl.associative_scan(pairs_b, 0, _add)
    i_b = gl.sum((end_b <= flat).to(gl.int32), 0)
    if i_b >= num_seqs:
        return
    sel = o_b == i_b
    k_lo = _pick(sel, k_lo_b)
    k_len = _pick(sel, k_len_b)
    q_lo = _pick(sel, q_lo_b)
    past = k_len - _pick(sel, q_len_b)
    pair = _pick(sel, flat - end_b + pairs_b)
    qb_a = _pick(sel, first_b) + 2 * pair
    has_b = 2 * pair + 1 < _pick(sel, tiles_b)             # row B lies in the sequence

    r_ld = gl.arange(0, M2, layout=gl.SliceLayout(1, ld))
    c_ld = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld))
    qpos = qb_a * BLOCK_M + r_ld
    m_q = (qpos >= past) & (qpos < k_len)
    t = (q_lo + qpos - past).to(gl.int64)
    q_smem = gl.allocate_shared_memory(dtype, [M2, BLOCK_D], sh_q, gl.load(
        q_ptr + t[:, None] * stride_qt + i_h * stride_qh + c_ld[None, :], mask=m_q[:, None], other=0.0))

    # ---- the two rows' key blocks kb <= row (col is ascending: a prefix of each row)
    p_crow = crow_ptr + i_h * stride_crow_h
    o_c = gl.arange(0, NNZ_P2, layout=lb)
    p_a = col_ptr + i_h * stride_col_h + gl.load(p_crow + qb_a)
    n_a = gl.sum((gl.load(p_a + o_c, mask=o_c < gl.load(p_crow + qb_a + 1) - gl.load(p_crow + qb_a),
                          other=num_rows) <= qb_a).to(gl.int32), 0)
    qb_b = gl.minimum(qb_a + 1, num_rows - 1)
    p_b = col_ptr + i_h * stride_col_h + gl.load(p_crow + qb_b)
    n_b = gl.sum((gl.load(p_b + o_c, mask=o_c < gl.load(p_crow + qb_b + 1) - gl.load(p_crow + qb_b),
                          other=num_rows) <= qb_a + 1).to(gl.int32), 0)
    n_b = gl.where(has_b, n_b, 0)

    i_kvh = (i_h // num_queries_per_kv).to(gl.int64)
    k_base = k_ptr + k_lo.to(gl.int64) * stride_kt + i_kvh * stride_kh
    v_base = v_ptr + k_lo.to(gl.int64) * stride_vt + i_kvh * stride_vh
    k_ring = gl.allocate_shared_memory(dtype, [RING, BLOCK_N, BLOCK_D], sh)
    v_ring = gl.allocate_shared_memory(dtype, [RING, BLOCK_N, BLOCK_D], sh)
    r_kv = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    # the union's first two blocks (e0, e1), one commit group each
    c0, a0, b0, ia, ib, v0 = _union_next(p_a, p_b, 0, 0, n_a, n_b)
    if v0:
        _load_kv_block(k_ring.index(0), v_ring.index(0), k_base, v_base, c0, k_len, r_kv, c_ld, BLOCK_N,
                       stride_kt, stride_vt)
    async_copy.commit_group()
    c1, a1, b1, ia, ib, v1 = _union_next(p_a, p_b, ia, ib, n_a, n_b)
    if v1:
        _load_kv_block(k_ring.index(1), v_ring.index(1), k_base, v_base, c1, k_len, r_kv, c_ld, BLOCK_N,
                       stride_kt, stride_vt)
    async_copy.commit_group()

    zero_s = gl.zeros([M2, BLOCK_N], gl.float32, layout=mma_s)
    r_s = gl.arange(0, M2, layout=gl.SliceLayout(1, mma_s))
    acc = gl.zeros([M2, BLOCK_D], gl.float32, layout=mma_o)
    m_i = gl.full([M2], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma_s))
    l_i = gl.zeros([M2], gl.float32, layout=gl.SliceLayout(1, mma_s))
    b_p = gl.convert_layout(zero_s.to(dtype), a_op)
    if v0:   # step 0: S(0) alone
        async_copy.wait_group(1)
        fence_async_shared()
        gl.thread_barrier()
        acc_s = warpgroup_mma(q_smem, k_ring.index(0).permute((1, 0)), zero_s, use_acc=False)
        p, m_i, l_i, alpha = _softmax_step(acc_s, m_i, l_i, c0, a0, b0, qb_a, r_s, QK_SCALE, mma_s)
        b_p = gl.convert_layout(p.to(dtype), a_op)
    j = 1
    c, in_a, in_b, valid = c1, a1, b1, v1
    while valid:
        # block j + 1 into the slot block j - 2 used (its P V was waited at step j - 1)
        cn, an, bn, ia, ib, vn = _union_next(p_a, p_b, ia, ib, n_a, n_b)
        if vn:
            _load_kv_block(k_ring.index((j + 1) % RING), v_ring.index((j + 1) % RING), k_base, v_base, cn,
                           k_len, r_kv, c_ld, BLOCK_N, stride_kt, stride_vt)
        async_copy.commit_group()
        async_copy.wait_group(1)                 # block j has landed
        fence_async_shared()
        gl.thread_barrier()
        acc_s = warpgroup_mma(q_smem, k_ring.index(j % RING).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
        acc_o = warpgroup_mma(b_p, v_ring.index((j - 1) % RING), acc, is_async=True)
        acc_s = warpgroup_mma_wait(num_outstanding=1, deps=(acc_s,))
        p, m_i, l_i, alpha = _softmax_step(acc_s, m_i, l_i, c, in_a, in_b, qb_a, r_s, QK_SCALE, mma_s)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_o,))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
        b_p = gl.convert_layout(p.to(dtype), a_op)
        c, in_a, in_b, valid = cn, an, bn, vn
        j += 1
    if v0:   # the last block's P V
        acc = warpgroup_mma(b_p, v_ring.index((j - 1) % RING), acc)
    async_copy.wait_group(0)

    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    r_o = gl.arange(0, M2, layout=gl.SliceLayout(1, mma_o))
    c_o = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, mma_o))
    q_o = qb_a * BLOCK_M + r_o
    t_o = (q_lo + q_o - past).to(gl.int64)
    b_o = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, mma_o))[:, None]
    gl.store(out_ptr + t_o[:, None] * stride_ot + i_h * stride_oh + c_o[None, :],
             b_o.to(out_ptr.dtype.element_ty), mask=((q_o >= past) & (q_o < k_len))[:, None])
    if STORE_LSE:
        # natural log (the usual softmax_lse convention); rows with no key keep -inf
        q_l = qb_a * BLOCK_M + r_s
        b_lse = gl.where(l_i > 0.0, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
        gl.store(lse_ptr + (q_lo + q_l - past).to(gl.int64) * num_heads + i_h, b_lse,
                 mask=(q_l >= past) & (q_l < k_len))


@jit(gluon=True)
def _bsattn_fwd_gluon_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr,
    # runtime scalars
    num_seqs,
    # output pointers
    out_ptr,
    # constexprs
    num_heads: gl.constexpr, num_rows: gl.constexpr, head_size: gl.constexpr,
    num_queries_per_kv: gl.constexpr,
    stride_qt: gl.constexpr, stride_qh: gl.constexpr, stride_kt: gl.constexpr,
    stride_kh: gl.constexpr, stride_vt: gl.constexpr, stride_vh: gl.constexpr,
    stride_ot: gl.constexpr, stride_oh: gl.constexpr, stride_crow_h: gl.constexpr,
    stride_col_h: gl.constexpr,
    BLOCK_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_D: gl.constexpr, GROUP: gl.constexpr, B_P2: gl.constexpr, NNZ_P2: gl.constexpr,
    CNT_CHUNK: gl.constexpr, DECODE_Q: gl.constexpr, EVEN_D: gl.constexpr,
    IS_FP32: gl.constexpr, QK_SCALE: gl.constexpr,
):
    """_bsattn_fwd_kernel's contract, within this module's scope (no LSE)."""
    _bsattn_fwd_gluon_program(
        q_ptr, k_ptr, v_ptr, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr, num_seqs, out_ptr, out_ptr,
        num_heads, num_rows, head_size, num_queries_per_kv, stride_qt, stride_qh, stride_kt, stride_kh,
        stride_vt, stride_vh, stride_ot, stride_oh, stride_crow_h, stride_col_h, BLOCK_M, BLOCK_N,
        BLOCK_D, B_P2, NNZ_P2, DECODE_Q, QK_SCALE, False)


@jit(gluon=True)
def _bsattn_fwd_lse_gluon_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr,
    # runtime scalars
    num_seqs,
    # output pointers
    out_ptr, lse_ptr,
    # constexprs
    num_heads: gl.constexpr, num_rows: gl.constexpr, head_size: gl.constexpr,
    num_queries_per_kv: gl.constexpr,
    stride_qt: gl.constexpr, stride_qh: gl.constexpr, stride_kt: gl.constexpr,
    stride_kh: gl.constexpr, stride_vt: gl.constexpr, stride_vh: gl.constexpr,
    stride_ot: gl.constexpr, stride_oh: gl.constexpr, stride_crow_h: gl.constexpr,
    stride_col_h: gl.constexpr,
    BLOCK_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_D: gl.constexpr, GROUP: gl.constexpr, B_P2: gl.constexpr, NNZ_P2: gl.constexpr,
    CNT_CHUNK: gl.constexpr, DECODE_Q: gl.constexpr, EVEN_D: gl.constexpr,
    IS_FP32: gl.constexpr, QK_SCALE: gl.constexpr,
):
    """_bsattn_fwd_lse_kernel's contract, within this module's scope."""
    _bsattn_fwd_gluon_program(
        q_ptr, k_ptr, v_ptr, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr, num_seqs, out_ptr, lse_ptr,
        num_heads, num_rows, head_size, num_queries_per_kv, stride_qt, stride_qh, stride_kt, stride_kh,
        stride_vt, stride_vh, stride_ot, stride_oh, stride_crow_h, stride_col_h, BLOCK_M, BLOCK_N,
        BLOCK_D, B_P2, NNZ_P2, DECODE_Q, QK_SCALE, True)

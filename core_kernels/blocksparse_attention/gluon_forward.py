"""The block-sparse prefill forward in Gluon, warp-specialised (sm_90, 16-bit inputs, D = 128, 64-token blocks).

A prototype, measured against the Triton kernel and not used by the planner
(RESULTS.md). One CTA holds two query tiles: two consecutive programs of the
Triton kernel's schedule, the same tile of query heads 2k and 2k + 1, which
share a KV head. A loader warpgroup (the default partition) walks the union of
the two rows' ascending column lists and copies each key block's K and V once
(cp.async) into a shared ring; one consumer warpgroup per tile runs the online
softmax over the blocks of its own row, which it meets in its row's order, and
frees every slot once it is ready (its own after its P V). Slots are handed
over through mbarriers (ready: the loader threads' cp.async arrivals; free:
one arrival per consumer), so the consumers never wait on a CTA-wide barrier
and never issue a load, and the 16 local blocks the two heads share are read
from L2 once.

Same launch arguments and schedule as _bsattn_fwd_kernel / _bsattn_fwd_lse_kernel
(half their grid) and the same products in the same order: the outputs and
LSE are bitwise equal to the Triton kernel's. Scope: GPU sm_90, bf16 or fp16,
head size 128, block_size = block_m = block_n = 64, q_block_size = block_size,
an even number of query heads per KV head.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                             warpgroup_mma, warpgroup_mma_wait)

from .._gluon_utils import exp2_ftz as _exp2_ftz
from .._triton_utils import jit
from .gluon_backward import _add, _layout, _load_kv_block, _pick, _seq_bounds

LN2 = gl.constexpr(0.6931471805599453)
RING = gl.constexpr(4)          # K/V slots of the shared ring
CONSUMER_REGS = gl.constexpr(232)
LOADER_THREADS = gl.constexpr(128)


@gluon.jit
def _item(item, num_items, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr, num_seqs, num_heads: gl.constexpr,
          stride_crow_h: gl.constexpr, stride_col_h: gl.constexpr, BLOCK_M: gl.constexpr,
          B_P2: gl.constexpr, NNZ_P2: gl.constexpr, DECODE_Q: gl.constexpr, lb: gl.constexpr):
    """Program `item` of the Triton kernel's schedule (heads fastest, heaviest
    tiles first): its head, sequence extents, query tile, and its row's key
    blocks (the pointer to the first, how many lie below the row, how many in
    all; 0 for an item past the last tile)."""
    i_h = item % num_heads
    flat = num_items // num_heads - 1 - item // num_heads
    o_b, k_lo_b, k_len_b, q_lo_b, q_len_b = _seq_bounds(cu_k_ptr, cu_q_ptr, num_seqs, B_P2, DECODE_Q, lb)
    first_b = (k_len_b - q_len_b) // BLOCK_M
    tiles_b = gl.where(q_len_b > 0, (k_len_b + BLOCK_M - 1) // BLOCK_M - first_b, 0)
    end_b = gl.associative_scan(tiles_b, 0, _add)
    i_b = gl.sum((end_b <= flat).to(gl.int32), 0)
    sel = o_b == i_b
    k_lo = _pick(sel, k_lo_b)
    k_len = _pick(sel, k_len_b)
    q_lo = _pick(sel, q_lo_b)
    past = k_len - _pick(sel, q_len_b)
    tile = _pick(sel, first_b + flat - end_b + tiles_b)
    qb = tile                                        # BLOCK_M == BLOCK_SIZE: the layout row
    p_crow = crow_ptr + i_h * stride_crow_h
    start = gl.load(p_crow + qb, mask=i_b < num_seqs, other=0)
    n = gl.load(p_crow + qb + 1, mask=i_b < num_seqs, other=0) - start
    p_col = col_ptr + i_h * stride_col_h + start
    o_c = gl.arange(0, NNZ_P2, layout=lb)
    n_below = gl.sum((gl.load(p_col + o_c, mask=o_c < n, other=2147483647) < qb).to(gl.int32), 0)
    return i_h, k_lo, k_len, q_lo, past, tile, p_col, n_below, n


@gluon.jit
def _union_next(p_a, p_b, ia, ib, n_a, n_b):
    """The next key block of the union of the two tiles' ascending column lists
    from cursors ia, ib: (block, in A, in B, ia', ib', valid)."""
    BIG: gl.constexpr = 2147483647
    ca = gl.load(p_a + ia, mask=ia < n_a, other=BIG)
    cb = gl.load(p_b + ib, mask=ib < n_b, other=BIG)
    c = gl.minimum(ca, cb)
    in_a = ca == c
    in_b = cb == c
    return c, in_a, in_b, ia + in_a.to(gl.int32), ib + in_b.to(gl.int32), c < BIG


@gluon.jit
def _loader(k_ring, v_ring, ready, free, k_base, v_base, k_len, pc_a, n_a, pc_b, n_b,
            BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, stride_kt: gl.constexpr,
            stride_vt: gl.constexpr, ld: gl.constexpr):
    """The default partition: the K/V copies of the union of the two tiles'
    key blocks (one KV head), each into the next ring slot once both consumers
    freed it; each thread's cp.async arrival on the slot's ready barrier
    (count: the loader's threads) marks the copies landed."""
    r_kv = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
    c_ld = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld))
    c, in_a, in_b, ia, ib, valid = _union_next(pc_a, pc_b, 0, 0, n_a, n_b)
    u = 0
    while valid:
        slot = u % RING
        mbarrier.wait(free.index(slot), ((u // RING) & 1) ^ 1)   # the first RING waits pass at once
        _load_kv_block(k_ring.index(slot), v_ring.index(slot), k_base, v_base, c, k_len, r_kv, c_ld,
                       BLOCK_N, stride_kt, stride_vt)
        async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
        c, in_a, in_b, ia, ib, valid = _union_next(pc_a, pc_b, ia, ib, n_a, n_b)
        u += 1
    async_copy.wait_group(0)


@gluon.jit
def _softmax_step(acc_s, m_i, l_i, masked, c, q_pos, c_s, k_len, QK_SCALE: gl.constexpr,
                  BLOCK_N: gl.constexpr):
    """The online softmax of one [BLOCK_M, BLOCK_N] score tile, as the Triton
    kernel's _attend_block with the scale folded (QK_SCALE > 0): P (base 2,
    unnormalised), the new running max and sum, and alpha = 2^(m_old - m_new).
    ``masked``: the diagonal block (key block c): causal and the sequence's end."""
    if masked:
        kpos = c * BLOCK_N + c_s
        acc_s = gl.where((kpos[None, :] <= q_pos[:, None]) & (kpos < k_len)[None, :], acc_s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(acc_s, 1) * QK_SCALE)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)   # a row with no key yet
    else:
        m_new = gl.maximum(m_i, gl.max(acc_s, 1) * QK_SCALE)
        m_use = m_new
    alpha = _exp2_ftz(m_i - m_use)
    p = _exp2_ftz(acc_s * QK_SCALE - m_use[:, None])
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _consumer(q_smem, k_ring, v_ring, ready, free, pc_self, n_self, pc_other, n_other, IS_A: gl.constexpr,
              n_below, tile, k_len, q_lo, past, i_h, out_ptr, lse_ptr, num_heads: gl.constexpr,
              stride_ot: gl.constexpr, stride_oh: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, QK_SCALE: gl.constexpr,
              STORE_LSE: gl.constexpr, dtype: gl.constexpr):
    """A worker partition: one query tile's online softmax over its row's key
    blocks, met in the union's (ascending) order, which is the row's own order:
    the unmasked ones, then the diagonal, masked causally and by the sequence's
    end. A slot holding another tile's block is freed as soon as it is ready
    (never earlier: a consumer then stays within RING steps of the loader).
    Then O and the LSE are stored."""
    mma_s: gl.constexpr = _layout("mma_nn", BLOCK_M, BLOCK_D, dtype)
    mma_o: gl.constexpr = _layout("mma_nd", BLOCK_M, BLOCK_D, dtype)
    a_op: gl.constexpr = _layout("a_op", BLOCK_M, BLOCK_D, dtype)
    r_s = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_s))
    c_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_s))
    q_pos = tile * BLOCK_M + r_s
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_s)
    acc = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, layout=mma_o)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma_s))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, mma_s))
    if IS_A:
        c, mine, other, i_s, i_o, valid = _union_next(pc_self, pc_other, 0, 0, n_self, n_other)
    else:
        c, other, mine, i_o, i_s, valid = _union_next(pc_other, pc_self, 0, 0, n_other, n_self)
    u = 0
    while valid:
        slot = u % RING
        mbarrier.wait(ready.index(slot), (u // RING) & 1)
        if mine:
            fence_async_shared()
            acc_s = warpgroup_mma(q_smem, k_ring.index(slot).permute((1, 0)), zero_s, use_acc=False)
            p, m_i, l_i, alpha = _softmax_step(acc_s, m_i, l_i, i_s > n_below, c, q_pos, c_s, k_len,
                                               QK_SCALE, BLOCK_N)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), a_op), v_ring.index(slot), acc)
        mbarrier.arrive(free.index(slot), count=1)
        if IS_A:
            c, mine, other, i_s, i_o, valid = _union_next(pc_self, pc_other, i_s, i_o, n_self, n_other)
        else:
            c, other, mine, i_o, i_s, valid = _union_next(pc_other, pc_self, i_o, i_s, n_other, n_self)
        u += 1

    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    r_o = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_o))
    c_o = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, mma_o))
    q_o = tile * BLOCK_M + r_o
    t_o = (q_lo + q_o - past).to(gl.int64)
    b_o = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, mma_o))[:, None]
    gl.store(out_ptr + t_o[:, None] * stride_ot + i_h * stride_oh + c_o[None, :],
             b_o.to(out_ptr.dtype.element_ty), mask=((q_o >= past) & (q_o < k_len) & (n_self > 0))[:, None])
    if STORE_LSE:
        # natural log (the usual softmax_lse convention); rows with no key keep -inf
        b_lse = gl.where(l_i > 0.0, (m_i + gl.log2(l_safe)) * LN2, float("-inf"))
        gl.store(lse_ptr + (q_lo + q_pos - past).to(gl.int64) * num_heads + i_h, b_lse,
                 mask=(q_pos >= past) & (q_pos < k_len) & (n_self > 0))


@gluon.jit
def _bsattn_fwd_ws_program(
    q_ptr, k_ptr, v_ptr, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr, num_seqs, out_ptr, lse_ptr,
    num_heads: gl.constexpr, num_rows: gl.constexpr, num_queries_per_kv: gl.constexpr,
    stride_qt: gl.constexpr, stride_qh: gl.constexpr, stride_kt: gl.constexpr, stride_kh: gl.constexpr,
    stride_vt: gl.constexpr, stride_vh: gl.constexpr, stride_ot: gl.constexpr, stride_oh: gl.constexpr,
    stride_crow_h: gl.constexpr, stride_col_h: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, B_P2: gl.constexpr, NNZ_P2: gl.constexpr,
    DECODE_Q: gl.constexpr, QK_SCALE: gl.constexpr, STORE_LSE: gl.constexpr,
):
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    lb: gl.constexpr = _layout("lb", BLOCK_M, BLOCK_D, dtype)
    ld: gl.constexpr = _layout("ld", BLOCK_M, BLOCK_D, dtype)
    sh: gl.constexpr = _layout("sh", BLOCK_M, BLOCK_D, dtype)
    num_items = 2 * gl.num_programs(0)
    ia = 2 * gl.program_id(0)
    (h_a, klo_a, kl_a, qlo_a, past_a, tile_a, pc_a, nb_a, n_a) = _item(
        ia, num_items, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr, num_seqs, num_heads, stride_crow_h,
        stride_col_h, BLOCK_M, B_P2, NNZ_P2, DECODE_Q, lb)
    (h_b, klo_b, kl_b, qlo_b, past_b, tile_b, pc_b, nb_b, n_b) = _item(
        ia + 1, num_items, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr, num_seqs, num_heads, stride_crow_h,
        stride_col_h, BLOCK_M, B_P2, NNZ_P2, DECODE_Q, lb)
    if n_a + n_b == 0:
        return

    # the two Q tiles (rows outside the sequence zero)
    r_ld = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    c_ld = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld))
    qp_a = tile_a * BLOCK_M + r_ld
    qp_b = tile_b * BLOCK_M + r_ld
    q_a = gl.load(q_ptr + (qlo_a + qp_a - past_a).to(gl.int64)[:, None] * stride_qt + h_a * stride_qh
                  + c_ld[None, :], mask=((qp_a >= past_a) & (qp_a < kl_a))[:, None], other=0.0)
    q_b = gl.load(q_ptr + (qlo_b + qp_b - past_b).to(gl.int64)[:, None] * stride_qt + h_b * stride_qh
                  + c_ld[None, :], mask=((qp_b >= past_b) & (qp_b < kl_b) & (n_b > 0))[:, None], other=0.0)
    q_smem_a = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], sh, q_a)
    q_smem_b = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], sh, q_b)
    k_ring = gl.allocate_shared_memory(dtype, [RING, BLOCK_N, BLOCK_D], sh)
    v_ring = gl.allocate_shared_memory(dtype, [RING, BLOCK_N, BLOCK_D], sh)
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(RING):
        mbarrier.init(ready.index(s), count=LOADER_THREADS)
        mbarrier.init(free.index(s), count=2)              # both consumers
    fence_async_shared()

    kvh = (h_a // num_queries_per_kv).to(gl.int64)          # h_b's too (num_queries_per_kv even)
    k_base = k_ptr + klo_a.to(gl.int64) * stride_kt + kvh * stride_kh
    v_base = v_ptr + klo_a.to(gl.int64) * stride_vt + kvh * stride_vh
    gl.warp_specialize([
        (_loader, (k_ring, v_ring, ready, free, k_base, v_base, kl_a, pc_a, n_a, pc_b, n_b, BLOCK_N,
                   BLOCK_D, stride_kt, stride_vt, ld)),
        (_consumer, (q_smem_a, k_ring, v_ring, ready, free, pc_a, n_a, pc_b, n_b, True, nb_a, tile_a,
                     kl_a, qlo_a, past_a, h_a, out_ptr, lse_ptr, num_heads, stride_ot, stride_oh,
                     BLOCK_M, BLOCK_N, BLOCK_D, QK_SCALE, STORE_LSE, dtype)),
        (_consumer, (q_smem_b, k_ring, v_ring, ready, free, pc_b, n_b, pc_a, n_a, False, nb_b, tile_b,
                     kl_b, qlo_b, past_b, h_b, out_ptr, lse_ptr, num_heads, stride_ot, stride_oh,
                     BLOCK_M, BLOCK_N, BLOCK_D, QK_SCALE, STORE_LSE, dtype)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


@jit(gluon=True)
def _bsattn_fwd_ws_kernel(
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
    """_bsattn_fwd_kernel's contract within this module's scope (no LSE), half its grid."""
    _bsattn_fwd_ws_program(
        q_ptr, k_ptr, v_ptr, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr, num_seqs, out_ptr, out_ptr,
        num_heads, num_rows, num_queries_per_kv, stride_qt, stride_qh, stride_kt, stride_kh,
        stride_vt, stride_vh, stride_ot, stride_oh, stride_crow_h, stride_col_h, BLOCK_M, BLOCK_N,
        BLOCK_D, B_P2, NNZ_P2, DECODE_Q, QK_SCALE, False)


@jit(gluon=True)
def _bsattn_fwd_lse_ws_kernel(
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
    """_bsattn_fwd_lse_kernel's contract within this module's scope, half its grid."""
    _bsattn_fwd_ws_program(
        q_ptr, k_ptr, v_ptr, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr, num_seqs, out_ptr, lse_ptr,
        num_heads, num_rows, num_queries_per_kv, stride_qt, stride_qh, stride_kt, stride_kh,
        stride_vt, stride_vh, stride_ot, stride_oh, stride_crow_h, stride_col_h, BLOCK_M, BLOCK_N,
        BLOCK_D, B_P2, NNZ_P2, DECODE_Q, QK_SCALE, True)

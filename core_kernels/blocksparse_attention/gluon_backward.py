"""The block-sparse backward's dK/dV and dQ kernels in Gluon (sm_90, 16-bit inputs, D = 128, 64-token blocks).

The Triton dK/dV kernel (backward_kernels.py) waits for every wgmma right
after issuing it. This kernel issues a step's four products asynchronously and
overlaps the elementwise work with them:

    S^T  = K Q^T  and  dP^T = V dO^T        issued together
    P^T  = exp2(S^T * scale - lse)           while dP^T runs
    dV  += P^T dO                            issued
    dS^T = P^T (dP^T - delta)                while dV runs
    dK  += dS^T Q                            issued; waited at the next step's start,
                                             after that step's loads are issued

and loads the next step's Q, dO, LSE and delta (cp.async, a two-slot ring)
while the current step computes. Only the diagonal step takes a mask (causal):
queries outside the sequence get zero-filled Q, dO, LSE and delta, which add
nothing (_causal). Same launch, arguments and schedule as the Triton kernel
(one program per (key tile, KV head); the query heads of the group in order,
each one's rows of the transposed layout ascending, as one walk: _group_rows) and the same products
(16-bit operands, fp32 accumulation; exp2 flushes results below fp32's normal
range to 0). Scope (the planner checks it): GPU sm_90, bf16 or fp16, head size
128, block_size = block_m = block_n = 64, q_block_size = block_size, 4 warps.

NOTE: measured on the H200 (Phi-3-small 1x16384 bf16, bench_blocksparse_backward.py,
2026-11-25): the dK/dV kernel alone 2.62 ms against the Triton kernel's 3.04, the dQ
kernel 1.52 against 1.72; forward + backward 5.46-5.50 ms (dense causal SDPA 14.27
ms: 2.59-2.61x) without the gradients' memsets, 5.59 ms with them (SDPA 14.41 ms:
2.58x; RESULTS.md). On the way there (same day): the dK/dV kernel walking each query
head of the group as its own pipeline (a load drain per head) took 2.84-2.93 ms
(its spills 148 bytes, now 76: fewer values live across the head loop), and the dQ
kernel loading Q, dO and O into registers before its first K/V block 1.55 ms.
Measured and not kept (same day): the first form, LSE and delta read with plain loads at each step and a causal and bounds
mask on every step, 3.34 ms; a software-pipelined loop (each step issuing the next
step's S^T and dP^T behind its own dV and dK) 5.10 ms for the backward launches
against 5.00 for this form: ptxas serializes its wgmmas (C7514, accumulators in
flight while the registers run out: 255 per thread with 220 bytes of spills).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                             warpgroup_mma_init, warpgroup_mma_wait)

from .._gluon_utils import exp2_ftz as _exp2_ftz
from .._triton_utils import jit

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _pick(sel, x):
    """x at the one lane where sel is set (a scalar)."""
    return gl.sum(gl.where(sel, x, 0), 0)


@gluon.jit
def _popc(x):
    return gl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=True,
                                     pack=1)


@gluon.constexpr_function
def _next_pow2(n):
    p = 2
    while p < n:
        p *= 2
    return p


@gluon.constexpr_function
def _layout(name, B, D, dtype):
    """The kernels' layouts (4 warps, B = 64-row tiles, D = 128), by name: lb of
    1-D vectors, ld of [B, D] loads, mma_nn / mma_nd of the [B, B] / [B, D] wgmma
    accumulators, a_op of a [B, B] 16-bit A operand, sh of [B, D] tiles in shared
    memory."""
    mma_nd = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    return dict(
        lb=lambda: gl.BlockedLayout([1], [32], [4], [0]),
        ld=lambda: gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]),
        mma_nn=lambda: gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, B, 16]),
        mma_nd=lambda: mma_nd,
        a_op=lambda: gl.DotOperandLayout(operand_index=0, parent=mma_nd, k_width=2),
        sh=lambda: gl.NVMMASharedLayout.get_default_for([B, D], dtype),
    )[name]()


@gluon.jit
def _seq_bounds(cu_k_ptr, cu_q_ptr, num_seqs, B_P2: gl.constexpr, DECODE_Q: gl.constexpr, lb: gl.constexpr):
    """Per sequence ([B_P2], layout lb): first key row, key count, first query
    row, query count (kernels.py's _seq_bounds)."""
    o_b = gl.arange(0, B_P2, layout=lb)
    m_b = o_b < num_seqs
    k_lo_b = gl.load(cu_k_ptr + o_b, mask=m_b, other=0)
    k_len_b = gl.load(cu_k_ptr + o_b + 1, mask=m_b, other=0) - k_lo_b
    if DECODE_Q:
        q_lo_b = o_b
        q_len_b = gl.where(m_b, 1, 0)
    else:
        q_lo_b = gl.load(cu_q_ptr + o_b, mask=m_b, other=0)
        q_len_b = gl.load(cu_q_ptr + o_b + 1, mask=m_b, other=0) - q_lo_b
    return o_b, k_lo_b, k_len_b, q_lo_b, q_len_b


@gluon.jit
def _group_rows(p_mask, stride_h, r_lo, r_hi, num_queries_per_kv: gl.constexpr, WORDS: gl.constexpr,
                lw: gl.constexpr):
    """The rows [r_lo, r_hi] set in the transposed-layout bits of the group's query
    heads (p_mask: the first head's words of this key block, stride_h: the next
    head's offset), one lane per (head, word): the bits (rows outside the range
    cleared), the inclusive cumsum of their counts and the total, so that step
    i's head and row are found from i alone (_row_of): heads in order, each
    one's rows ascending."""
    W_P2: gl.constexpr = _next_pow2(WORDS)
    L: gl.constexpr = _next_pow2(num_queries_per_kv) * W_P2
    o_l = gl.arange(0, L, layout=lw)
    o_w = o_l % W_P2
    m_w = (o_l // W_P2 < num_queries_per_kv) & (o_w >= r_lo // 32) & (o_w <= r_hi // 32)
    bits = gl.load(p_mask + (o_l // W_P2) * stride_h + o_w, mask=m_w, other=0).to(gl.uint32, bitcast=True)
    lo = r_lo - o_w * 32                        # first row of the range in the word's bit numbering
    hi = r_hi - o_w * 32
    full = gl.full([L], 0xFFFFFFFF, gl.uint32, layout=lw)
    keep_lo = gl.where(lo <= 0, full, full << gl.minimum(gl.maximum(lo, 0), 31).to(gl.uint32))
    keep_hi = gl.where(hi >= 31, full, full >> (31 - gl.minimum(gl.maximum(hi, 0), 31)).to(gl.uint32))
    bits = gl.where(m_w & (hi >= 0), bits & keep_lo & keep_hi, 0).to(gl.int32, bitcast=True)
    counts = _popc(bits)
    cum = gl.associative_scan(counts, 0, _add)
    return o_l, bits, counts, cum, gl.sum(counts, 0)


@gluon.jit
def _row_of(i, o_l, bits, counts, cum, WORDS: gl.constexpr, lb: gl.constexpr):
    """(head in the group, row) of step i: lane li holds it, as the j-th set bit
    of that lane's word."""
    W_P2: gl.constexpr = _next_pow2(WORDS)
    li = gl.sum((cum <= i).to(gl.int32), 0)
    sel = o_l == li
    j = i - _pick(sel, cum - counts)
    word = _pick(sel, bits)
    o_x = gl.arange(0, 32, layout=lb)
    is_set = ((word >> o_x) & 1) == 1
    rank = gl.associative_scan(is_set.to(gl.int32), 0, _add) - 1
    return li // W_P2, (li % W_P2) * 32 + gl.sum(gl.where(is_set & (rank == j), o_x, 0), 0)


@gluon.jit
def _load_step(q_dst, do_dst, lse_dst, delta_dst, q_ptr, do_ptr, lse_ptr, delta_ptr, row, q_lo, past, k_len,
               i_h, r_ld, c_ld, o_v, num_heads: gl.constexpr, BLOCK_M: gl.constexpr,
               stride_qt: gl.constexpr, stride_qh: gl.constexpr, stride_dot: gl.constexpr,
               stride_doh: gl.constexpr):
    """Start the cp.async copies of query row ``row``'s Q and dO tiles and its
    LSE and delta (queries outside the sequence are zero-filled)."""
    qpos = row * BLOCK_M + r_ld
    m = (qpos >= past) & (qpos < k_len)
    t = (q_lo + qpos - past).to(gl.int64)
    async_copy.async_copy_global_to_shared(
        q_dst, q_ptr + t[:, None] * stride_qt + i_h * stride_qh + c_ld[None, :], mask=m[:, None])
    async_copy.async_copy_global_to_shared(
        do_dst, do_ptr + t[:, None] * stride_dot + i_h * stride_doh + c_ld[None, :], mask=m[:, None])
    qv = row * BLOCK_M + o_v
    mv = (qv >= past) & (qv < k_len)
    tv = (q_lo + qv - past).to(gl.int64) * num_heads + i_h
    async_copy.async_copy_global_to_shared(lse_dst, lse_ptr + tv, mask=mv)
    async_copy.async_copy_global_to_shared(delta_dst, delta_ptr + tv, mask=mv)


@gluon.jit
def _causal(b_pt, diagonal, mma_nn: gl.constexpr):
    """P^T with the causal mask (key <= query) on the diagonal step (query row ==
    key block: local key index <= local query index). No other mask is needed:
    a query outside the sequence has zero Q, dO, LSE and delta (zero-filled
    copies), so its P^T = 1 multiplies zeros in dV and dS^T; a key past the
    sequence only feeds its own dK / dV rows, which are not stored."""
    if diagonal:
        r = gl.arange(0, b_pt.shape[0], layout=gl.SliceLayout(1, mma_nn))
        c = gl.arange(0, b_pt.shape[1], layout=gl.SliceLayout(0, mma_nn))
        b_pt = gl.where(r[:, None] <= c[None, :], b_pt, 0.0)
    return b_pt


@gluon.jit
def _steps(b_dk, b_dv, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, q_ptr, do_ptr, lse_ptr,
           delta_ptr, n_steps, o_l, bits, counts, cum, h0, q_lo, past, k_len, r_ld, c_ld, o_v, kb, zero_nn,
           num_heads: gl.constexpr, BLOCK_M: gl.constexpr, WORDS: gl.constexpr, stride_qt: gl.constexpr,
           stride_qh: gl.constexpr, stride_dot: gl.constexpr, stride_doh: gl.constexpr,
           QK_SCALE: gl.constexpr, lb: gl.constexpr, mma_nn: gl.constexpr, a_op: gl.constexpr,
           dtype: gl.constexpr):
    """The program's steps (query head h0 + head, row from _row_of) into dK and dV
    (in and out as tensors; in between, asynchronous accumulators)."""
    b_dk = warpgroup_mma_init(b_dk)
    b_dv = warpgroup_mma_init(b_dv)
    hh, row = _row_of(0, o_l, bits, counts, cum, WORDS, lb)
    if n_steps > 0:
        _load_step(q_ring.index(0), do_ring.index(0), lse_ring.index(0), delta_ring.index(0), q_ptr, do_ptr,
                   lse_ptr, delta_ptr, row, q_lo, past, k_len, h0 + hh, r_ld, c_ld, o_v, num_heads, BLOCK_M,
                   stride_qt, stride_qh, stride_dot, stride_doh)
        async_copy.commit_group()
    for i in range(0, n_steps):
        slot = i % 2
        b_dk, b_dv = warpgroup_mma_wait(num_outstanding=0, deps=(b_dk, b_dv))   # step i - 1's
        n_hh, nxt = _row_of(gl.minimum(i + 1, n_steps - 1), o_l, bits, counts, cum, WORDS, lb)
        if i + 1 < n_steps:
            _load_step(q_ring.index(1 - slot), do_ring.index(1 - slot), lse_ring.index(1 - slot),
                       delta_ring.index(1 - slot), q_ptr, do_ptr, lse_ptr, delta_ptr, nxt, q_lo, past, k_len,
                       h0 + n_hh, r_ld, c_ld, o_v, num_heads, BLOCK_M, stride_qt, stride_qh, stride_dot,
                       stride_doh)
        async_copy.commit_group()
        async_copy.wait_group(1)
        fence_async_shared()
        gl.thread_barrier()
        q_s = q_ring.index(slot)
        do_s = do_ring.index(slot)
        acc_st = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_nn, use_acc=False, is_async=True)
        acc_dpt = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero_nn, use_acc=False, is_async=True)
        acc_st = warpgroup_mma_wait(num_outstanding=1, deps=(acc_st,))
        b_lse2 = lse_ring.index(slot).load(gl.SliceLayout(0, mma_nn)) * LOG2E
        b_pt = _causal(_exp2_ftz(acc_st * QK_SCALE - b_lse2[None, :]), row == kb, mma_nn)
        b_dv = warpgroup_mma(gl.convert_layout(b_pt.to(dtype), a_op), do_s, b_dv, is_async=True)
        acc_dpt = warpgroup_mma_wait(num_outstanding=1, deps=(acc_dpt,))
        b_delta = delta_ring.index(slot).load(gl.SliceLayout(0, mma_nn))
        b_dst = b_pt * (acc_dpt - b_delta[None, :])
        b_dk = warpgroup_mma(gl.convert_layout(b_dst.to(dtype), a_op), q_s, b_dk, is_async=True)
        row = nxt
    async_copy.wait_group(0)
    return warpgroup_mma_wait(num_outstanding=0, deps=(b_dk, b_dv))


@jit(gluon=True)
def _bsattn_bwd_dkdv_gluon_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, cu_k_ptr, cu_q_ptr, colmask_ptr,
    # runtime scalars
    num_seqs,
    # output pointers
    dk_ptr, dv_ptr,
    # constexprs
    num_heads: gl.constexpr, num_kv_heads: gl.constexpr, num_rows: gl.constexpr,
    head_size: gl.constexpr, num_queries_per_kv: gl.constexpr,
    stride_qt: gl.constexpr, stride_qh: gl.constexpr, stride_kt: gl.constexpr,
    stride_kh: gl.constexpr, stride_vt: gl.constexpr, stride_vh: gl.constexpr,
    stride_dot: gl.constexpr, stride_doh: gl.constexpr, stride_mask_h: gl.constexpr,
    BLOCK_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_D: gl.constexpr, B_P2: gl.constexpr, WORDS: gl.constexpr, DECODE_Q: gl.constexpr,
    EVEN_D: gl.constexpr,
    IS_FP32: gl.constexpr, QK_SCALE: gl.constexpr, SM_SCALE: gl.constexpr,
):
    """dK, dV [Tk, Hkv, D]: _bsattn_bwd_dkdv_kernel's contract (4 warps, one
    warpgroup; EVEN_D and not IS_FP32, BLOCK_M == BLOCK_N == BLOCK_SIZE)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    lb: gl.constexpr = _layout("lb", BLOCK_M, BLOCK_D, dtype)
    ld: gl.constexpr = _layout("ld", BLOCK_M, BLOCK_D, dtype)
    mma_nn: gl.constexpr = _layout("mma_nn", BLOCK_M, BLOCK_D, dtype)
    mma_nd: gl.constexpr = _layout("mma_nd", BLOCK_M, BLOCK_D, dtype)
    a_op: gl.constexpr = _layout("a_op", BLOCK_M, BLOCK_D, dtype)
    sh: gl.constexpr = _layout("sh", BLOCK_M, BLOCK_D, dtype)

    pid = gl.program_id(0)
    i_kvh = pid % num_kv_heads
    flat = pid // num_kv_heads    # a sequence's first key tiles (the most rows) first

    # ---- key tile schedule from cu_seqlens (as the Triton kernel)
    o_b, k_lo_b, k_len_b, q_lo_b, q_len_b = _seq_bounds(cu_k_ptr, cu_q_ptr, num_seqs, B_P2, DECODE_Q, lb)
    tiles_b = (k_len_b + BLOCK_N - 1) // BLOCK_N
    end_b = gl.associative_scan(tiles_b, 0, _add)
    i_b = gl.sum((end_b <= flat).to(gl.int32), 0)
    if i_b >= num_seqs:
        return
    sel = o_b == i_b
    k_lo = _pick(sel, k_lo_b)
    k_len = _pick(sel, k_len_b)
    q_lo = _pick(sel, q_lo_b)
    q_len = _pick(sel, q_len_b)
    past = k_len - q_len
    kstart = _pick(sel, flat - end_b + tiles_b) * BLOCK_N

    # ---- K and V tiles into shared memory
    r_ld = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    c_ld = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld))
    k_rows = (k_lo + kstart + r_ld).to(gl.int64)
    m_nk = ((kstart + r_ld) < k_len)[:, None]
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_D], sh, gl.load(
        k_ptr + k_rows[:, None] * stride_kt + i_kvh * stride_kh + c_ld[None, :], mask=m_nk, other=0.0))
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_D], sh, gl.load(
        v_ptr + k_rows[:, None] * stride_vt + i_kvh * stride_vh + c_ld[None, :], mask=m_nk, other=0.0))
    q_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_D], sh)
    do_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_D], sh)
    sh_v: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_ring = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], sh_v)
    delta_ring = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], sh_v)
    o_v = gl.arange(0, BLOCK_M, layout=lb)
    fence_async_shared()
    gl.thread_barrier()

    b_dk = gl.zeros([BLOCK_N, BLOCK_D], gl.float32, layout=mma_nd)
    b_dv = gl.zeros([BLOCK_N, BLOCK_D], gl.float32, layout=mma_nd)
    zero_nn = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_nn)

    kb = kstart // BLOCK_SIZE
    r_lo = gl.maximum(kb, past // BLOCK_SIZE)        # query rows that can see this key block
    r_hi = (k_len - 1) // BLOCK_SIZE                 # inclusive
    if q_len > 0:
        # one walk over the group's query heads (in order) and their rows: the
        # next head's first tiles load while the last head's last step runs
        h0 = i_kvh * num_queries_per_kv
        o_l, bits, counts, cum, n_steps = _group_rows(colmask_ptr + (h0 * stride_mask_h + kb) * WORDS,
                                                      stride_mask_h * WORDS, r_lo, r_hi, num_queries_per_kv,
                                                      WORDS, lb)
        b_dk, b_dv = _steps(b_dk, b_dv, k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, q_ptr, do_ptr,
                            lse_ptr, delta_ptr, n_steps, o_l, bits, counts, cum, h0, q_lo, past, k_len, r_ld,
                            c_ld, o_v, kb, zero_nn, num_heads, BLOCK_M, WORDS, stride_qt, stride_qh,
                            stride_dot, stride_doh, QK_SCALE, lb, mma_nn, a_op, dtype)

    # ---- dK (scaled), dV, straight from the accumulator layout
    r_o = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_nd))
    c_o = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, mma_nd))
    o_rows = (k_lo + kstart + r_o).to(gl.int64)
    p_out = o_rows[:, None] * (num_kv_heads * head_size) + i_kvh * head_size + c_o[None, :]
    m_out = ((kstart + r_o) < k_len)[:, None]
    gl.store(dk_ptr + p_out, (b_dk * SM_SCALE).to(dk_ptr.dtype.element_ty), mask=m_out)
    gl.store(dv_ptr + p_out, b_dv.to(dv_ptr.dtype.element_ty), mask=m_out)


@gluon.jit
def _load_kv_block(k_dst, v_dst, k_base, v_base, c, k_len, r_ld, c_ld, BLOCK_N: gl.constexpr,
                   stride_kt: gl.constexpr, stride_vt: gl.constexpr):
    """Start the cp.async copies of key block c's K and V tiles (keys past k_len
    zero-filled)."""
    kpos = c * BLOCK_N + r_ld
    m = (kpos < k_len)[:, None]
    rows = kpos.to(gl.int64)
    async_copy.async_copy_global_to_shared(k_dst, k_base + rows[:, None] * stride_kt + c_ld[None, :], mask=m)
    async_copy.async_copy_global_to_shared(v_dst, v_base + rows[:, None] * stride_vt + c_ld[None, :], mask=m)


@jit(gluon=True)
def _bsattn_bwd_dq_gluon_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, out_ptr, do_ptr, lse_ptr, cu_k_ptr, cu_q_ptr, crow_ptr, col_ptr,
    # runtime scalars
    num_seqs,
    # output pointers
    dq_ptr, delta_ptr,
    # constexprs
    num_heads: gl.constexpr, num_rows: gl.constexpr, head_size: gl.constexpr,
    num_queries_per_kv: gl.constexpr,
    stride_qt: gl.constexpr, stride_qh: gl.constexpr, stride_kt: gl.constexpr,
    stride_kh: gl.constexpr, stride_vt: gl.constexpr, stride_vh: gl.constexpr,
    stride_ot: gl.constexpr, stride_oh: gl.constexpr,
    stride_dot: gl.constexpr, stride_doh: gl.constexpr, stride_crow_h: gl.constexpr,
    stride_col_h: gl.constexpr,
    BLOCK_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_D: gl.constexpr, GROUP: gl.constexpr, B_P2: gl.constexpr, NNZ_P2: gl.constexpr,
    CNT_CHUNK: gl.constexpr, DECODE_Q: gl.constexpr, EVEN_D: gl.constexpr, IS_FP32: gl.constexpr,
    QK_SCALE: gl.constexpr, SM_SCALE: gl.constexpr,
):
    """dQ [Tq, Hq, D] and delta [Tq, Hq]: _bsattn_bwd_dq_kernel's contract (4
    warps; EVEN_D and not IS_FP32, GROUP == 1, BLOCK_M == BLOCK_N ==
    BLOCK_SIZE). Per step (key block c of the query tile's row, ascending):

        S = Q K^T  and  dP = dO V^T     issued together
        P = exp2(S * scale - lse)       while dP runs
        dS = P (dP - delta)
        dQ += dS K

    with the next block's K and V loading (cp.async, two slots) meanwhile. Only
    the diagonal block takes a mask (causal), which also covers the keys past
    the sequence's end (they lie in its last block, the last tile's diagonal);
    query rows outside the sequence have zero Q and dO (dS = 0) and are not
    stored."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    lb: gl.constexpr = _layout("lb", BLOCK_M, BLOCK_D, dtype)
    ld: gl.constexpr = _layout("ld", BLOCK_M, BLOCK_D, dtype)
    mma_nn: gl.constexpr = _layout("mma_nn", BLOCK_M, BLOCK_D, dtype)
    mma_nd: gl.constexpr = _layout("mma_nd", BLOCK_M, BLOCK_D, dtype)
    a_op: gl.constexpr = _layout("a_op", BLOCK_M, BLOCK_D, dtype)
    sh: gl.constexpr = _layout("sh", BLOCK_M, BLOCK_D, dtype)

    pid = gl.program_id(0)
    i_h = pid % num_heads
    flat = gl.num_programs(0) // num_heads - 1 - pid // num_heads   # heaviest tiles first

    # ---- query tile schedule from cu_seqlens (as the Triton kernel)
    o_b, k_lo_b, k_len_b, q_lo_b, q_len_b = _seq_bounds(cu_k_ptr, cu_q_ptr, num_seqs, B_P2, DECODE_Q, lb)
    first_b = (k_len_b - q_len_b) // BLOCK_M
    tiles_b = gl.where(q_len_b > 0, (k_len_b + BLOCK_M - 1) // BLOCK_M - first_b, 0)
    end_b = gl.associative_scan(tiles_b, 0, _add)
    i_b = gl.sum((end_b <= flat).to(gl.int32), 0)
    if i_b >= num_seqs:
        return
    sel = o_b == i_b
    k_lo = _pick(sel, k_lo_b)
    k_len = _pick(sel, k_len_b)
    q_lo = _pick(sel, q_lo_b)
    past = k_len - _pick(sel, q_len_b)
    qb = _pick(sel, first_b + flat - end_b + tiles_b)      # the tile's layout row (BLOCK_M == BLOCK_SIZE)

    # ---- the row's key blocks kb <= qb (col is ascending: a prefix of the row)
    p_crow = crow_ptr + i_h * stride_crow_h
    p_col = col_ptr + i_h * stride_col_h + gl.load(p_crow + qb)
    n_row = gl.load(p_crow + qb + 1) - gl.load(p_crow + qb)
    o_c = gl.arange(0, NNZ_P2, layout=lb)
    cols = gl.load(p_col + o_c, mask=o_c < n_row, other=num_rows)
    n_steps = gl.sum((cols <= qb).to(gl.int32), 0)
    c_cur = gl.load(p_col, mask=n_steps > 0, other=0)
    c_nxt = gl.load(p_col + gl.minimum(1, n_steps - 1), mask=n_steps > 0, other=0)

    # ---- one commit group: the first block's K and V, the query tile's Q and dO
    # (cp.async); meanwhile O and the LSE load, then delta = rowsum(dO * O) is
    # formed and stored for the dK/dV kernel.
    # NOTE: H200, Phi-3-small 1x16384 bf16, 2026-11-25: Q, dO and O loaded into
    # registers first and the first block after them, this kernel took 1.55 ms.
    r_ld = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    c_ld = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld))
    i_kvh = (i_h // num_queries_per_kv).to(gl.int64)
    k_base = k_ptr + k_lo.to(gl.int64) * stride_kt + i_kvh * stride_kh
    v_base = v_ptr + k_lo.to(gl.int64) * stride_vt + i_kvh * stride_vh
    k_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_D], sh)
    v_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_D], sh)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], sh)
    do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], sh)
    if n_steps > 0:
        _load_kv_block(k_ring.index(0), v_ring.index(0), k_base, v_base, c_cur, k_len, r_ld, c_ld, BLOCK_N,
                       stride_kt, stride_vt)
    qpos = qb * BLOCK_M + r_ld
    m_q = (qpos >= past) & (qpos < k_len)
    t = (q_lo + qpos - past).to(gl.int64)
    async_copy.async_copy_global_to_shared(
        q_smem, q_ptr + t[:, None] * stride_qt + i_h * stride_qh + c_ld[None, :], mask=m_q[:, None])
    async_copy.async_copy_global_to_shared(
        do_smem, do_ptr + t[:, None] * stride_dot + i_h * stride_doh + c_ld[None, :], mask=m_q[:, None])
    async_copy.commit_group()
    b_o = gl.load(out_ptr + t[:, None] * stride_ot + i_h * stride_oh + c_ld[None, :], mask=m_q[:, None],
                  other=0.0)
    r_s = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_nn))
    q_s = qb * BLOCK_M + r_s
    m_s = (q_s >= past) & (q_s < k_len)
    b_lse2 = gl.load(lse_ptr + (q_lo + q_s - past).to(gl.int64) * num_heads + i_h, mask=m_s,
                     other=0.0) * LOG2E
    async_copy.wait_group(0)
    gl.thread_barrier()
    b_delta = gl.sum(b_o.to(gl.float32) * do_smem.load(ld).to(gl.float32), 1)
    gl.store(delta_ptr + t * num_heads + i_h, b_delta, mask=m_q)
    b_delta = gl.convert_layout(b_delta, gl.SliceLayout(1, mma_nn))
    zero_nn = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_nn)
    b_dq = warpgroup_mma_init(gl.zeros([BLOCK_M, BLOCK_D], gl.float32, layout=mma_nd))
    for j in range(0, n_steps):
        slot = j % 2
        # step j - 1's products are done: its slot takes block j + 1
        c_nn = gl.load(p_col + gl.minimum(j + 2, n_steps - 1))       # read a step ahead of its use
        if j + 1 < n_steps:
            _load_kv_block(k_ring.index(1 - slot), v_ring.index(1 - slot), k_base, v_base, c_nxt, k_len, r_ld,
                           c_ld, BLOCK_N, stride_kt, stride_vt)
        async_copy.commit_group()
        async_copy.wait_group(1)
        fence_async_shared()
        gl.thread_barrier()
        k_s = k_ring.index(slot)
        acc_s = warpgroup_mma(q_smem, k_s.permute((1, 0)), zero_nn, use_acc=False, is_async=True)
        acc_dp = warpgroup_mma(do_smem, v_ring.index(slot).permute((1, 0)), zero_nn, use_acc=False,
                               is_async=True)
        acc_s = warpgroup_mma_wait(num_outstanding=1, deps=(acc_s,))
        b_p = _exp2_ftz(acc_s * QK_SCALE - b_lse2[:, None])
        if c_cur == qb:   # the diagonal: key <= query (local indices)
            c_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_nn))
            b_p = gl.where(c_s[None, :] <= r_s[:, None], b_p, 0.0)
        acc_dp = warpgroup_mma_wait(num_outstanding=0, deps=(acc_dp,))
        b_ds = b_p * (acc_dp - b_delta[:, None])
        b_dq = warpgroup_mma(gl.convert_layout(b_ds.to(dtype), a_op), k_s, b_dq, is_async=True)
        # NOTE: waited here, not at the next step's start: an accumulator still in
        # flight across the loop's back edge made ptxas serialize every wgmma (C7515)
        b_dq = warpgroup_mma_wait(num_outstanding=0, deps=(b_dq,))
        b_dq = warpgroup_mma_init(b_dq)
        c_cur = c_nxt
        c_nxt = c_nn
    async_copy.wait_group(0)
    b_dq = warpgroup_mma_wait(num_outstanding=0, deps=(b_dq,))

    r_o = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_nd))
    c_o = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, mma_nd))
    q_o = qb * BLOCK_M + r_o
    t_o = (q_lo + q_o - past).to(gl.int64)
    gl.store(dq_ptr + t_o[:, None] * (num_heads * head_size) + i_h * head_size + c_o[None, :],
             (b_dq * SM_SCALE).to(dq_ptr.dtype.element_ty), mask=((q_o >= past) & (q_o < k_len))[:, None])

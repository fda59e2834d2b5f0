"""Lightning-attention prefill in Gluon (Triton 3.6's explicit-layout dialect), bf16.

The Triton kernel (kernels.py) is latency-bound on Hopper: Triton waits for each
wgmma right after issuing it, so a chunk's four products run back to back with
one warpgroup per SM (Nsight Compute: the four waits hold 26% of its stall
samples). Gluon exposes asynchronous wgmma with explicit waits. Per chunk this
kernel issues q k^T, q S and the state update k^T v_d together, forms the
masked scores while the latter two run, then issues P v and waits once:

    o   = (q k^T * M) v + (q S0) * lambda^(i+1)       M[i, j] = lambda^(i-j), j <= i
    S1  = lambda^T S0 + k^T (v * lambda^(T-1-j))

The products are the Triton kernel's (bf16 operands, fp32 accumulation, the
state kept in fp32 registers), so the two agree to rounding. Loads go through a
STAGES-deep ring of cp.async copies. Scope (the planner checks it and otherwise
uses kernels.py): bf16, D = 128, E a multiple of the 64-column E-tile, N a
multiple of the 64-token chunk, block_size a multiple of the chunk (or final
state only), enough (b, h, E-tile) programs to fill the GPU, GPU only (Gluon
has no interpreter).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared,
                                                             warpgroup_mma, warpgroup_mma_wait)

# ints are compiled without divisibility specialisation, as jax-triton does
# (see kernels._PREFILL_INTS); strides arrive divided by ALIGN
_GLUON_INTS = ("num_heads seq_len stride_decay stride_qb stride_qh stride_kb stride_kh "
               "stride_vb stride_vh stride_hb stride_hh stride_hd").split()


@gluon.jit
def _load_chunk(q_ring, k_ring, v_ring, slot, c, base_q, base_k, base_v, offs_q, offs_k, offs_v,
                T: gl.constexpr, STRIDE_QT: gl.constexpr, STRIDE_KT: gl.constexpr,
                STRIDE_VT: gl.constexpr):
    """Start the cp.async copies of chunk c's q, k, v tiles into ring slot `slot`."""
    async_copy.async_copy_global_to_shared(q_ring.index(slot), base_q + c * T * STRIDE_QT + offs_q)
    async_copy.async_copy_global_to_shared(k_ring.index(slot), base_k + c * T * STRIDE_KT + offs_k)
    async_copy.async_copy_global_to_shared(v_ring.index(slot), base_v + c * T * STRIDE_VT + offs_v)


@gluon.jit(do_not_specialize=["seq_len"], do_not_specialize_on_alignment=_GLUON_INTS)
def _gluon_prefill_kernel(
    q_ptr, k_ptr, v_ptr, decay_ptr, history_ptr,
    num_heads, seq_len, stride_decay,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_hb, stride_hh, stride_hd,
    o_ptr, kv_ptr,
    T: gl.constexpr, D: gl.constexpr, E: gl.constexpr, BE: gl.constexpr, STAGES: gl.constexpr,
    BLOCK_CHUNKS: gl.constexpr, HAS_HISTORY: gl.constexpr, ALIGN: gl.constexpr,
    STRIDE_QT: gl.constexpr, STRIDE_KT: gl.constexpr, STRIDE_VT: gl.constexpr,
):
    """One program per (b, h, E-tile), 4 warps (one warpgroup).

    BLOCK_CHUNKS > 0: kv is [B, H, NB + 1, D, E] and receives the state before
    every BLOCK_CHUNKS * T tokens plus the final one; 0: kv is the final state
    [B, H, D, E]. o and kv are contiguous; q, k, v, history have strides.
    NOTE: the token strides are constexprs: as runtime values every load offset
    needed its own register across the loop (140 bytes/thread of spills, and a
    112-byte spill made the prototype 2x slower); as constants they fold into
    the address immediates.
    """
    stride_qb, stride_qh, stride_kb, stride_kh = (stride_qb * ALIGN, stride_qh * ALIGN,
                                                  stride_kb * ALIGN, stride_kh * ALIGN)
    stride_vb, stride_vh = stride_vb * ALIGN, stride_vh * ALIGN
    stride_hb, stride_hh, stride_hd = stride_hb * ALIGN, stride_hh * ALIGN, stride_hd * ALIGN
    N_E: gl.constexpr = E // BE
    # register layouts (4 warps)
    ld_qk: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])   # [T, D] bf16
    ld_v: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])     # [T, BE] bf16
    mma_tt: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, T, 16])
    mma_te: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BE, 16])
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_te, k_width=2)
    sh_qk: gl.constexpr = gl.NVMMASharedLayout.get_default_for([T, D], gl.bfloat16)
    sh_v: gl.constexpr = gl.NVMMASharedLayout.get_default_for([T, BE], gl.bfloat16)
    sh_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([D, BE], gl.bfloat16)

    pid = gl.program_id(0)
    i_e = pid % N_E
    i_bh = pid // N_E
    i_b = (i_bh // num_heads).to(gl.int64)
    i_h = (i_bh % num_heads).to(gl.int64)
    s = gl.load(decay_ptr + i_h * stride_decay)
    e0 = i_e * BE
    base_q = q_ptr + (i_b * stride_qb + i_h * stride_qh)
    base_k = k_ptr + (i_b * stride_kb + i_h * stride_kh)
    base_v = v_ptr + (i_b * stride_vb + i_h * stride_vh + e0)
    base_o = o_ptr + (i_bh.to(gl.int64) * seq_len * E + e0)
    num_chunks = seq_len // T

    q_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, T, D], sh_qk)
    k_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, T, D], sh_qk)
    v_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, T, BE], sh_v)
    s_smem = gl.allocate_shared_memory(gl.bfloat16, [D, BE], sh_s)
    vd_smem = gl.allocate_shared_memory(gl.bfloat16, [T, BE], sh_v)

    r_qk = gl.arange(0, T, layout=gl.SliceLayout(1, ld_qk))
    c_qk = gl.arange(0, D, layout=gl.SliceLayout(0, ld_qk))
    r_v = gl.arange(0, T, layout=gl.SliceLayout(1, ld_v))
    c_v = gl.arange(0, BE, layout=gl.SliceLayout(0, ld_v))
    # int32 offsets within one (b, h) slice (the planner checks that they fit)
    offs_q = r_qk[:, None] * STRIDE_QT + c_qk[None, :]
    offs_k = r_qk[:, None] * STRIDE_KT + c_qk[None, :]
    offs_v = r_v[:, None] * STRIDE_VT + c_v[None, :]
    offs_o = r_v[:, None] * E + c_v[None, :]
    for c in gl.static_range(STAGES - 1):
        if c < num_chunks:
            _load_chunk(q_ring, k_ring, v_ring, c, c, base_q, base_k, base_v, offs_q, offs_k, offs_v,
                        T, STRIDE_QT, STRIDE_KT, STRIDE_VT)
        async_copy.commit_group()

    # decays: q S0 rows by lambda^(i+1), v rows by lambda^(T-1-j), scores by lambda^(i-j)
    t_te = gl.arange(0, T, layout=gl.SliceLayout(1, mma_te))
    q_decay = gl.exp(-s * (t_te + 1).to(gl.float32))
    k_decay = gl.exp(-s * (T - 1 - r_v).to(gl.float32))
    i_tt = gl.arange(0, T, layout=gl.SliceLayout(1, mma_tt))
    j_tt = gl.arange(0, T, layout=gl.SliceLayout(0, mma_tt))
    diff = (i_tt[:, None] - j_tt[None, :]).to(gl.float32)
    causal = gl.where(diff >= 0, gl.exp(-s * diff), 0.0)
    chunk_decay = gl.exp(-s * T)

    # the state is read and written straight in the MMA layout (8-byte pieces,
    # whole 32-byte sectors per 4 threads): no conversion scratch or registers
    r_s = gl.arange(0, D, layout=gl.SliceLayout(1, mma_te))
    c_s = gl.arange(0, BE, layout=gl.SliceLayout(0, mma_te))
    offs_s = r_s[:, None] * E + c_s[None, :]
    if HAS_HISTORY:
        b_s = gl.load(history_ptr + (i_b * stride_hb + i_h * stride_hh + e0)
                      + r_s[:, None] * stride_hd + c_s[None, :])
    else:
        b_s = gl.zeros([D, BE], gl.float32, layout=mma_te)
    if BLOCK_CHUNKS > 0:
        num_blocks = (num_chunks + BLOCK_CHUNKS - 1) // BLOCK_CHUNKS
        kv_base = kv_ptr + (i_bh.to(gl.int64) * (num_blocks + 1) * D * E + e0)
    else:
        kv_base = kv_ptr + (i_bh.to(gl.int64) * D * E + e0)
    zero_tt = gl.zeros([T, T], gl.float32, layout=mma_tt)
    zero_te = gl.zeros([T, BE], gl.float32, layout=mma_te)
    for c in range(num_chunks):
        if BLOCK_CHUNKS > 0:
            if c % BLOCK_CHUNKS == 0:  # the state before this block
                gl.store(kv_base + (c // BLOCK_CHUNKS) * D * E + offs_s, b_s)
        # refill the slot chunk c-1 used with chunk c+STAGES-1 (a group is committed
        # every iteration, empty or not, so that the wait_group count stays uniform)
        nxt = c + STAGES - 1
        if nxt < num_chunks:
            _load_chunk(q_ring, k_ring, v_ring, nxt % STAGES, nxt, base_q, base_k, base_v, offs_q,
                        offs_k, offs_v, T, STRIDE_QT, STRIDE_KT, STRIDE_VT)
        async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()
        slot = c % STAGES
        q_s = q_ring.index(slot)
        k_s = k_ring.index(slot)
        v_s = v_ring.index(slot)
        # operands made in registers: the state (for q S) and the decayed v (for k^T v_d)
        s_smem.store(b_s.to(gl.bfloat16))
        b_v = v_s.load(ld_v).to(gl.float32)
        vd_smem.store((b_v * k_decay[:, None]).to(gl.bfloat16))
        # NOTE: scale the state before any wgmma is in flight: touching registers
        # while a wgmma may be using them makes ptxas insert a wait (C7517)
        b_s = b_s * chunk_decay
        fence_async_shared()
        gl.thread_barrier()
        acc_qk = warpgroup_mma(q_s, k_s.permute((1, 0)), zero_tt, use_acc=False, is_async=True)
        acc_qs = warpgroup_mma(q_s, s_smem, zero_te, use_acc=False, is_async=True)
        acc_s = warpgroup_mma(k_s.permute((1, 0)), vd_smem, b_s, is_async=True)
        acc_qk = warpgroup_mma_wait(num_outstanding=2, deps=(acc_qk,))
        p = gl.convert_layout((acc_qk * causal).to(gl.bfloat16), p_op)
        acc_pv = warpgroup_mma(p, v_s, zero_te, use_acc=False, is_async=True)
        acc_qs, acc_s, acc_pv = warpgroup_mma_wait(num_outstanding=0, deps=(acc_qs, acc_s, acc_pv))
        b_s = acc_s
        b_o = acc_pv + acc_qs * q_decay[:, None]
        gl.store(base_o + c * T * E + offs_o, gl.convert_layout(b_o.to(gl.bfloat16), ld_v))
    async_copy.wait_group(0)
    if BLOCK_CHUNKS > 0:
        gl.store(kv_base + num_blocks * D * E + offs_s, b_s)
    else:
        gl.store(kv_base + offs_s, b_s)

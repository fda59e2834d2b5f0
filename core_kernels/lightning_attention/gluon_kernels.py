"""Lightning-attention prefill in Gluon (Triton 3.6's explicit-layout dialect), bf16 and fp32.

The Triton kernel (prefill_kernels.py) is latency-bound on Hopper: Triton waits for each
wgmma right after issuing it, so a chunk's four products run back to back with
one warpgroup per SM (Nsight Compute: the four waits hold 26% of its stall
samples). Gluon exposes asynchronous wgmma with explicit waits. Per chunk the
bf16 kernel issues q k^T, q S and the state update k^T v_d together, forms the
masked scores while the latter two run, then issues P v and waits once:

    o   = (q k^T * M) v + (q S0) * lambda^(i+1)       M[i, j] = lambda^(i-j), j <= i
    S1  = lambda^T S0 + k^T (v * lambda^(T-1-j))

Its products are the Triton kernel's (bf16 operands, fp32 accumulation, the
state kept in fp32 registers), so the two agree to rounding. The fp32 kernel
makes the same products in tf32 and is warp-specialised: a state warpgroup
and an output warpgroup run side by side, synchronised by mbarriers (see
_gluon_prefill_tf32_kernel). Loads go through a STAGES-deep ring of cp.async
copies. With few (b, h) pairs the
sequence is cut into segments chained through memory (_chain), as in
prefill_kernels.py. Scope (the planner checks it and otherwise uses prefill_kernels.py): bf16
or fp32, D = 128, E a multiple of the 64-column E-tile, N a multiple of the
64-token chunk, block_size a multiple of the chunk (or final state only), GPU
only (Gluon has no interpreter).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                             warpgroup_mma, warpgroup_mma_wait)

from .._gluon_utils import exp2_ftz as _exp2_ftz
from .._triton_utils import jit  # the integer policy; strides arrive divided by ALIGN


@gluon.jit
def _copy_rows(dst, src, rows, limit, T: gl.constexpr, MASKED: gl.constexpr):
    """Start the cp.async copy of a chunk tile (src: its [T, *] pointers, rows:
    their row indices). MASKED (varlen): rows at or past `limit` are not read
    and cp.async fills them with zeros; only a partial chunk (limit < T) takes
    the masked copy."""
    if MASKED:
        if limit >= T:
            async_copy.async_copy_global_to_shared(dst, src)
        else:
            async_copy.async_copy_global_to_shared(dst, src, mask=(rows < limit)[:, None])
    else:
        async_copy.async_copy_global_to_shared(dst, src)


@gluon.jit
def _load_kv(k_ring, v_ring, slot, c, base_k, base_v, offs_k, offs_v, T: gl.constexpr,
             STRIDE_KT: gl.constexpr, STRIDE_VT: gl.constexpr, seq_len=0, r_qk=None, r_v=None,
             MASKED: gl.constexpr = False):
    """Start the cp.async copies of chunk c's k and v tiles into ring slot `slot`
    (MASKED: the sequence ends at seq_len, see _copy_rows; r_qk, r_v: the row
    indices of the k and v tiles)."""
    _copy_rows(k_ring.index(slot), base_k + c * T * STRIDE_KT + offs_k, r_qk, seq_len - c * T, T, MASKED)
    _copy_rows(v_ring.index(slot), base_v + c * T * STRIDE_VT + offs_v, r_v, seq_len - c * T, T, MASKED)


@gluon.jit
def _load_chunk(q_ring, k_ring, v_ring, slot, c, base_q, base_k, base_v, offs_q, offs_k, offs_v,
                T: gl.constexpr, STRIDE_QT: gl.constexpr, STRIDE_KT: gl.constexpr,
                STRIDE_VT: gl.constexpr, seq_len=0, r_qk=None, r_v=None, MASKED: gl.constexpr = False):
    """Start the cp.async copies of chunk c's q, k, v tiles into ring slot `slot`
    (MASKED: as _load_kv)."""
    _copy_rows(q_ring.index(slot), base_q + c * T * STRIDE_QT + offs_q, r_qk, seq_len - c * T, T, MASKED)
    _load_kv(k_ring, v_ring, slot, c, base_k, base_v, offs_k, offs_v, T, STRIDE_KT, STRIDE_VT, seq_len,
             r_qk, r_v, MASKED)


@gluon.jit
def _prologue(q_ring, k_ring, v_ring, c_lo, c_hi, base_q, base_k, base_v, offs_q, offs_k, offs_v,
              T: gl.constexpr, SLOTS: gl.constexpr, STRIDE_QT: gl.constexpr,
              STRIDE_KT: gl.constexpr, STRIDE_VT: gl.constexpr, seq_len=0, r_qk=None, r_v=None,
              MASKED: gl.constexpr = False):
    """Fill the first SLOTS ring slots with chunks c_lo, c_lo+1, ... (one commit
    group per slot, empty past c_hi, so that wait_group counts stay uniform)."""
    for i in gl.static_range(SLOTS):
        if c_lo + i < c_hi:
            _load_chunk(q_ring, k_ring, v_ring, i, c_lo + i, base_q, base_k, base_v, offs_q, offs_k,
                        offs_v, T, STRIDE_QT, STRIDE_KT, STRIDE_VT, seq_len, r_qk, r_v, MASKED)
        async_copy.commit_group()


@gluon.jit
def _program(sync_ptr, num_heads, num_rows, seq_len, seg_chunks, decay_ptr, stride_decay,
             q_ptr, k_ptr, v_ptr, o_ptr, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb,
             stride_vh, T: gl.constexpr, E: gl.constexpr, BE: gl.constexpr, ALIGN: gl.constexpr,
             SEGMENTED: gl.constexpr, STRIDE_QT: gl.constexpr, STRIDE_KT: gl.constexpr,
             STRIDE_VT: gl.constexpr, REVERSE: gl.constexpr):
    """This program's (segment, b, h, E-tile), chunk range [c_lo, c_hi) (c_lo is a
    multiple of the ring depth: ring slot = chunk % STAGES), decay rate and the
    q, k, v, o bases of its (b, h, E-tile) (strides arrive divided by ALIGN;
    REVERSE: the bases of the sequence's last token, walked with the negated
    token strides of _signed; int32 offsets, as the planner checks).

    Segmented: programs take tickets from an atomic counter, segment-major, so a
    program only ever waits for one that started before it (no deadlock,
    whatever the scheduling); see _chain."""
    N_E: gl.constexpr = E // BE
    per_seg = num_rows * num_heads * N_E
    num_chunks = seq_len // T
    if SEGMENTED:
        ticket = gl.atomic_add(sync_ptr, 1)  # sync[0]: the ticket counter
        seg = ticket // per_seg
        r = ticket % per_seg
        c_lo = seg * seg_chunks
        c_hi = gl.minimum(c_lo + seg_chunks, num_chunks)
    else:
        ticket = gl.program_id(0)
        seg = 0
        r = ticket
        c_lo = 0
        c_hi = num_chunks
    i_bh = r // N_E
    i_b = (i_bh // num_heads).to(gl.int64)
    i_h = (i_bh % num_heads).to(gl.int64)
    s = gl.load(decay_ptr + i_h * stride_decay)
    s = gl.where(s > 1e30, 1e30, s)  # s = +inf (lambda = 0) without NaN: see prefill_kernels.py's NOTE
    e0 = (r % N_E) * BE
    base_q = q_ptr + (i_b * (stride_qb * ALIGN) + i_h * (stride_qh * ALIGN))
    base_k = k_ptr + (i_b * (stride_kb * ALIGN) + i_h * (stride_kh * ALIGN))
    base_v = v_ptr + (i_b * (stride_vb * ALIGN) + i_h * (stride_vh * ALIGN) + e0)
    base_o = o_ptr + (i_bh.to(gl.int64) * seq_len * E + e0)
    if REVERSE:
        last = seq_len - 1
        base_q, base_k, base_v, base_o = (base_q + last * STRIDE_QT, base_k + last * STRIDE_KT,
                                          base_v + last * STRIDE_VT, base_o + last * E)
    return (ticket, per_seg, seg, i_bh, i_b, i_h, e0, s, c_lo, c_hi, num_chunks, base_q, base_k, base_v,
            base_o)


@gluon.jit
def _start_state(history_ptr, kv_ptr, i_b, i_h, i_bh, e0, num_chunks, stride_hb, stride_hh, stride_hd,
                 D: gl.constexpr, E: gl.constexpr, BE: gl.constexpr, ALIGN: gl.constexpr,
                 BLOCK_CHUNKS: gl.constexpr, HAS_HISTORY: gl.constexpr, mma_te: gl.constexpr):
    """The sequence's starting state (kv_history or 0) in the MMA layout, this
    (b, h, E-tile)'s base in kv ([B, H, NB + 1, D, E] or [B, H, D, E]), and the
    state's row / column indices and offsets in that layout. The state is read
    and written straight in the MMA layout (8-byte pieces, whole 32-byte sectors
    per 4 threads): no conversion scratch or registers."""
    r_s = gl.arange(0, D, layout=gl.SliceLayout(1, mma_te))
    c_s = gl.arange(0, BE, layout=gl.SliceLayout(0, mma_te))
    offs_s = r_s[:, None] * E + c_s[None, :]
    if HAS_HISTORY:
        b_s = gl.load(history_ptr + (i_b * (stride_hb * ALIGN) + i_h * (stride_hh * ALIGN) + e0)
                      + r_s[:, None] * (stride_hd * ALIGN) + c_s[None, :]).to(gl.float32)
    else:
        b_s = gl.zeros([D, BE], gl.float32, layout=mma_te)
    if BLOCK_CHUNKS > 0:
        num_blocks = (num_chunks + BLOCK_CHUNKS - 1) // BLOCK_CHUNKS
        kv_base = kv_ptr + (i_bh.to(gl.int64) * (num_blocks + 1) * D * E + e0)
    else:
        kv_base = kv_ptr + (i_bh.to(gl.int64) * D * E + e0)
    return b_s, kv_base, r_s, c_s, offs_s


@gluon.jit
def _rings(dtype: gl.constexpr, STAGES: gl.constexpr, T: gl.constexpr, D: gl.constexpr,
           BE: gl.constexpr, sh_qk: gl.constexpr, sh_v: gl.constexpr):
    """The q, k and v load rings in shared memory (STAGES chunks each)."""
    q_ring = gl.allocate_shared_memory(dtype, [STAGES, T, D], sh_qk)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, T, D], sh_qk)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, T, BE], sh_v)
    return q_ring, k_ring, v_ring


@gluon.jit
def _token_offsets(ld_qk: gl.constexpr, ld_v: gl.constexpr, T: gl.constexpr, D: gl.constexpr,
                   BE: gl.constexpr, STRIDE_QT: gl.constexpr, STRIDE_KT: gl.constexpr,
                   STRIDE_VT: gl.constexpr):
    """A chunk's q, k ([T, D], layout ld_qk) and v ([T, BE], ld_v) element offsets:
    int32 within one (b, h) slice (the planner checks that they fit); the row
    indices of q, k and of v, and v's column indices."""
    r_qk = gl.arange(0, T, layout=gl.SliceLayout(1, ld_qk))
    c_qk = gl.arange(0, D, layout=gl.SliceLayout(0, ld_qk))
    r_v = gl.arange(0, T, layout=gl.SliceLayout(1, ld_v))
    c_v = gl.arange(0, BE, layout=gl.SliceLayout(0, ld_v))
    offs_q = r_qk[:, None] * STRIDE_QT + c_qk[None, :]
    offs_k = r_qk[:, None] * STRIDE_KT + c_qk[None, :]
    offs_v = r_v[:, None] * STRIDE_VT + c_v[None, :]
    return offs_q, offs_k, offs_v, r_qk, r_v, c_v


@gluon.jit
def _chain(b_s, b_l, s, ticket, per_seg, seg, num_segments, seg_tokens, sync_ptr, pub_ptr, offs_s,
           D: gl.constexpr, E: gl.constexpr):
    """The chained scan's hand-over: wait for the previous segment's end state
    (published with a release flag) and take it as this segment's starting state;
    publish this segment's end state lambda^len * start + b_l (b_l: its own
    contribution from a zero state) and raise this program's flag.
    pub_ptr: this (b, h, E-tile)'s [num_segments, D, E] scratch."""
    if seg > 0:
        p_flag = sync_ptr + 1 + ticket - per_seg
        ready = gl.atomic_add(p_flag, 0, sem="acquire")
        while ready == 0:
            ready = gl.atomic_add(p_flag, 0, sem="acquire")
        b_s = gl.load(pub_ptr + (seg - 1) * D * E + offs_s, cache_modifier=".cg")
    if seg < num_segments - 1:
        gl.store(pub_ptr + seg * D * E + offs_s, b_s * gl.exp(-s * seg_tokens) + b_l)
        gl.thread_barrier()
        gl.atomic_xchg(sync_ptr + 1 + ticket, 1, sem="release")
    return b_s


@gluon.constexpr_function
def _signed(stride, reverse):
    """A token stride as the kernel walks it: negated when REVERSE."""
    return -stride if reverse else stride


@gluon.jit
def _segment_sum(k_ring, v_ring, stage_smem, base_k, base_v, offs_k, offs_v, c_lo, c_hi, k_decay,
                 chunk_decay, T: gl.constexpr, D: gl.constexpr, BE: gl.constexpr, STAGES: gl.constexpr,
                 STRIDE_KT: gl.constexpr, STRIDE_VT: gl.constexpr, ld_v: gl.constexpr,
                 a_op: gl.constexpr, mma_te: gl.constexpr, TF32: gl.constexpr):
    """sum_t lambda^(c_hi*T-1-t) k_t^T v_t over chunks [c_lo, c_hi), from a zero
    state: a segment's own contribution (k and v only, one product per chunk).
    The chunks go last to first (iteration i takes chunk c_hi-1-i into ring slot
    i % STAGES, its decay to the segment's end lambda^(T*i) put on its operand),
    so that the chunks read last, which the main loop reads first, may still be
    in L2. bf16: k^T straight from the ring, the decayed v staged in stage_smem;
    tf32 (operands contiguous along the contraction): the decayed k^T in
    registers (a_op), v^T staged in stage_smem."""
    for i in gl.static_range(STAGES - 1):
        if c_hi - 1 - i >= c_lo:
            _load_kv(k_ring, v_ring, i, c_hi - 1 - i, base_k, base_v, offs_k, offs_v, T, STRIDE_KT,
                     STRIDE_VT)
        async_copy.commit_group()
    b_l = gl.zeros([D, BE], gl.float32, layout=mma_te)
    f = chunk_decay * 0.0 + 1.0  # lambda^(T * i)
    for i in range(0, c_hi - c_lo):
        if c_hi - STAGES - i >= c_lo:
            _load_kv(k_ring, v_ring, (i + STAGES - 1) % STAGES, c_hi - STAGES - i, base_k, base_v, offs_k,
                     offs_v, T, STRIDE_KT, STRIDE_VT)
        async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()
        dec = k_decay * f
        f = f * chunk_decay
        b_v = v_ring.index(i % STAGES).load(ld_v)
        if TF32:
            stage_smem.store(gl.permute(b_v, (1, 0)))
        else:
            stage_smem.store((b_v.to(gl.float32) * dec[:, None]).to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        if TF32:
            kt = k_ring.index(i % STAGES).permute((1, 0)).load(a_op) * dec[None, :]
            b_l = warpgroup_mma(kt, stage_smem.permute((1, 0)), b_l)
        else:
            b_l = warpgroup_mma(k_ring.index(i % STAGES).permute((1, 0)), stage_smem, b_l)
    async_copy.wait_group(0)
    gl.thread_barrier()
    return b_l


@gluon.jit
def _segment_start(b_s, k_ring, v_ring, stage_smem, base_k, base_v, offs_k, offs_v, c_lo, c_hi,
                   k_decay, chunk_decay, s, ticket, per_seg, seg, num_segments, sync_ptr, pub_ptr,
                   i_bh, e0, offs_s, T: gl.constexpr, D: gl.constexpr, E: gl.constexpr,
                   BE: gl.constexpr, STAGES: gl.constexpr, STRIDE_KT: gl.constexpr,
                   STRIDE_VT: gl.constexpr, ld_v: gl.constexpr, a_op: gl.constexpr,
                   mma_te: gl.constexpr, TF32: gl.constexpr, HIST_SHIFT: gl.constexpr = False):
    """A segment's starting state: its own contribution (_segment_sum; the last
    segment needs none), then the hand-over (_chain) through this (b, h,
    E-tile)'s slice of pub_ptr. HIST_SHIFT: the first segment's starting state
    (the history) decays by one token less (see _gluon_prefill_kernel)."""
    b_l = gl.zeros([D, BE], gl.float32, layout=mma_te)
    if seg < num_segments - 1:
        b_l = _segment_sum(k_ring, v_ring, stage_smem, base_k, base_v, offs_k, offs_v, c_lo, c_hi,
                           k_decay, chunk_decay, T, D, BE, STAGES, STRIDE_KT, STRIDE_VT, ld_v, a_op,
                           mma_te, TF32)
    seg_tokens = ((c_hi - c_lo) * T).to(gl.float32)
    if HIST_SHIFT:
        seg_tokens = seg_tokens - (seg == 0).to(gl.float32)
    return _chain(b_s, b_l, s, ticket, per_seg, seg, num_segments, seg_tokens,
                  sync_ptr, pub_ptr + (i_bh.to(gl.int64) * num_segments * D * E + e0), offs_s, D, E)


@gluon.jit
def _store_final(b_s, kv_base, offs_s, seg, num_segments, num_chunks, D: gl.constexpr,
                 E: gl.constexpr, BLOCK_CHUNKS: gl.constexpr):
    """The last segment holds the final state: kv's last block entry, or kv itself."""
    if seg == num_segments - 1:
        if BLOCK_CHUNKS > 0:
            gl.store(kv_base + (num_chunks + BLOCK_CHUNKS - 1) // BLOCK_CHUNKS * D * E + offs_s, b_s)
        else:
            gl.store(kv_base + offs_s, b_s)


@gluon.constexpr_function
def _bf16_layout(name, T, D, BE):
    """The bf16 kernels' layouts (4 warps), by name: ld_qk / ld_v register
    layouts of the [T, D] / [T, BE] tiles, mma_tt / mma_te of the [T, T] /
    [T, BE] wgmma accumulators, p_op of P as an A operand, sh_qk / sh_v / sh_s
    shared layouts of the q/k, v and state tiles."""
    mma_te = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BE, 16])
    return dict(
        ld_qk=lambda: gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]),
        ld_v=lambda: gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]),
        mma_tt=lambda: gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, T, 16]),
        mma_te=lambda: mma_te,
        p_op=lambda: gl.DotOperandLayout(operand_index=0, parent=mma_te, k_width=2),
        sh_qk=lambda: gl.NVMMASharedLayout.get_default_for([T, D], gl.bfloat16),
        sh_v=lambda: gl.NVMMASharedLayout.get_default_for([T, BE], gl.bfloat16),
        sh_s=lambda: gl.NVMMASharedLayout.get_default_for([D, BE], gl.bfloat16),
    )[name]()


@gluon.jit
def _bf16_buffers(T: gl.constexpr, D: gl.constexpr, BE: gl.constexpr, STAGES: gl.constexpr,
                  STRIDE_QT: gl.constexpr, STRIDE_KT: gl.constexpr, STRIDE_VT: gl.constexpr):
    """The bf16 kernels' shared memory (the q, k, v rings; the state and the
    decayed v as wgmma operands) and a chunk's token offsets and row / column
    indices (_token_offsets)."""
    sh_v: gl.constexpr = _bf16_layout("sh_v", T, D, BE)
    q_ring, k_ring, v_ring = _rings(gl.bfloat16, STAGES, T, D, BE, _bf16_layout("sh_qk", T, D, BE), sh_v)
    s_smem = gl.allocate_shared_memory(gl.bfloat16, [D, BE], _bf16_layout("sh_s", T, D, BE))
    vd_smem = gl.allocate_shared_memory(gl.bfloat16, [T, BE], sh_v)
    offs_q, offs_k, offs_v, r_qk, r_v, c_v = _token_offsets(
        _bf16_layout("ld_qk", T, D, BE), _bf16_layout("ld_v", T, D, BE), T, D, BE, STRIDE_QT, STRIDE_KT,
        STRIDE_VT)
    return q_ring, k_ring, v_ring, s_smem, vd_smem, offs_q, offs_k, offs_v, r_qk, r_v, c_v


@gluon.jit
def _bf16_decays(s, r_v, T: gl.constexpr, mma_tt: gl.constexpr, mma_te: gl.constexpr):
    """A whole chunk's decays: q S0 rows by lambda^(i+1), v rows by
    lambda^(T-1-j), scores by lambda^(i-j) (j <= i), the state by lambda^T."""
    t_te = gl.arange(0, T, layout=gl.SliceLayout(1, mma_te))
    q_decay = gl.exp(-s * (t_te + 1).to(gl.float32))
    k_decay = gl.exp(-s * (T - 1 - r_v).to(gl.float32))
    i_tt = gl.arange(0, T, layout=gl.SliceLayout(1, mma_tt))
    j_tt = gl.arange(0, T, layout=gl.SliceLayout(0, mma_tt))
    diff = (i_tt[:, None] - j_tt[None, :]).to(gl.float32)
    causal = gl.where(diff >= 0, gl.exp(-s * diff), 0.0)
    chunk_decay = gl.exp(-s * T)
    return q_decay, k_decay, causal, chunk_decay


@gluon.jit
def _bf16_chunks(b_s, q_ring, k_ring, v_ring, s_smem, vd_smem, c_lo, c_hi, kv_base, offs_s, base_q, base_k,
                 base_v, base_o, offs_q, offs_k, offs_v, offs_o, q_decay, k_decay, causal, chunk_decay,
                 T: gl.constexpr, D: gl.constexpr, E: gl.constexpr, BE: gl.constexpr,
                 STAGES: gl.constexpr, BLOCK_CHUNKS: gl.constexpr, STRIDE_QT: gl.constexpr,
                 STRIDE_KT: gl.constexpr, STRIDE_VT: gl.constexpr, STRIDE_OT: gl.constexpr,
                 ld_v: gl.constexpr, mma_tt: gl.constexpr, mma_te: gl.constexpr, p_op: gl.constexpr,
                 seq_len=0, s=0.0, r_qk=None, r_v=None, MASKED: gl.constexpr = False,
                 q_decay0=None, chunk_decay0=None, HIST_SHIFT: gl.constexpr = False):
    """The bf16 main loop over chunks [c_lo, c_hi) from state b_s; returns the
    end state. o rows are STRIDE_OT apart (offs_o: a chunk's offsets).
    HIST_SHIFT: chunk 0 (the sequence's first) decays its starting state by
    q_decay0 = lambda^i and chunk_decay0 = lambda^(T-1) (see
    _gluon_prefill_kernel).
    MASKED (varlen): the last chunk may hold fewer than T of the sequence's
    seq_len tokens; its loads stop there (zero-filled), its decays are those
    of its length n (v rows by lambda^(n-1-j), the state by lambda^n) and only
    its n rows of o are stored."""
    _prologue(q_ring, k_ring, v_ring, c_lo, c_hi, base_q, base_k, base_v, offs_q, offs_k, offs_v,
              T, STAGES - 1, STRIDE_QT, STRIDE_KT, STRIDE_VT, seq_len, r_qk, r_v, MASKED)
    zero_tt = gl.zeros([T, T], gl.float32, layout=mma_tt)
    zero_te = gl.zeros([T, BE], gl.float32, layout=mma_te)
    for c in range(c_lo, c_hi):
        if BLOCK_CHUNKS > 0:
            if c % BLOCK_CHUNKS == 0:  # the state before this block
                gl.store(kv_base + (c // BLOCK_CHUNKS) * D * E + offs_s, b_s)
        # refill the slot chunk c-1 used with chunk c+STAGES-1 (a group is committed
        # every iteration, empty or not, so that the wait_group count stays uniform)
        if c + STAGES - 1 < c_hi:
            _load_chunk(q_ring, k_ring, v_ring, (c + STAGES - 1) % STAGES, c + STAGES - 1, base_q, base_k,
                        base_v, offs_q, offs_k, offs_v, T, STRIDE_QT, STRIDE_KT, STRIDE_VT, seq_len, r_qk,
                        r_v, MASKED)
        async_copy.commit_group()
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()
        slot = c % STAGES
        q_s = q_ring.index(slot)
        k_s = k_ring.index(slot)
        v_s = v_ring.index(slot)
        if MASKED:
            n = gl.minimum(seq_len - c * T, T)
            kd = gl.where(r_v < n, gl.exp(-s * (n - 1 - r_v).to(gl.float32)), 0.0)
            cd = gl.exp(-s * n.to(gl.float32))
        else:
            kd = k_decay
            cd = chunk_decay
        qd = q_decay
        if HIST_SHIFT:
            qd = gl.where(c == 0, q_decay0, q_decay)
            if MASKED:  # chunk 0 of n tokens decays the history by lambda^(n-1)
                cd = gl.where(c == 0, gl.exp(-s * (n - 1).to(gl.float32)), cd)
            else:
                cd = gl.where(c == 0, chunk_decay0, cd)
        # operands made in registers: the state (for q S) and the decayed v (for k^T v_d)
        s_smem.store(b_s.to(gl.bfloat16))
        b_v = v_s.load(ld_v).to(gl.float32)
        vd_smem.store((b_v * kd[:, None]).to(gl.bfloat16))
        # NOTE: scale the state before any wgmma is in flight: touching registers
        # while a wgmma may be using them makes ptxas insert a wait (C7517)
        b_s = b_s * cd
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
        b_o = gl.convert_layout((acc_pv + acc_qs * qd[:, None]).to(gl.bfloat16), ld_v)
        if MASKED and n < T:  # a partial chunk (varlen)
            gl.store(base_o + c * T * STRIDE_OT + offs_o, b_o, mask=(r_v < n)[:, None])
        else:
            gl.store(base_o + c * T * STRIDE_OT + offs_o, b_o)
    async_copy.wait_group(0)
    return b_s


@jit(gluon=True)
def _gluon_prefill_kernel(
    q_ptr, k_ptr, v_ptr, decay_ptr, history_ptr,
    num_heads, num_rows, seq_len, seg_chunks, last_segment, stride_decay,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_hb, stride_hh, stride_hd,
    o_ptr, kv_ptr, pub_ptr, sync_ptr,
    T: gl.constexpr, D: gl.constexpr, E: gl.constexpr, BE: gl.constexpr, STAGES: gl.constexpr,
    BLOCK_CHUNKS: gl.constexpr, HAS_HISTORY: gl.constexpr, SEGMENTED: gl.constexpr,
    ALIGN: gl.constexpr, STRIDE_QT: gl.constexpr, STRIDE_KT: gl.constexpr, STRIDE_VT: gl.constexpr,
    REVERSE: gl.constexpr, HIST_SHIFT: gl.constexpr,
):
    """One program per (segment, b, h, E-tile), 4 warps (one warpgroup).

    BLOCK_CHUNKS > 0: kv is [B, H, NB + 1, D, E] and receives the state before
    every BLOCK_CHUNKS * T tokens plus the final one; 0: kv is the final state
    [B, H, D, E]. o and kv are contiguous; q, k, v, history have strides.
    SEGMENTED: the sequence is cut into segments of seg_chunks chunks (whole
    state blocks), chained through pub_ptr / sync_ptr (_chain); last_segment is
    the index of the last one (0 when not segmented).
    NOTE: the last segment's index, not the segment count, so that an
    unsegmented launch never passes a 1, which the integer policy specialises
    (core_kernels._triton_utils.jit): a constant count folds _store_final's test,
    and LLVM then kept the state's store offsets live across the loop. H200,
    per-block states, same plans, 2026-11-24: B=1, H=64, N=4096 100.3 us with a
    runtime count, 107.6 us with the count specialised to 1; B=4, N=1024 107.4
    vs 111.4 us (final state only and the fp32 kernel: unchanged).
    NOTE: the token strides are constexprs: as runtime values every load offset
    needed its own register across the loop (140 bytes/thread of spills, and a
    112-byte spill made the prototype 2x slower); as constants they fold into
    the address immediates.
    For the backward (backward_plan.py), as prefill_kernels.py's: REVERSE walks each
    sequence from its last token (bases at that token, negated token strides),
    HIST_SHIFT lets the history enter the first token undecayed.
    """
    ld_v: gl.constexpr = _bf16_layout("ld_v", T, D, BE)
    mma_tt: gl.constexpr = _bf16_layout("mma_tt", T, D, BE)
    mma_te: gl.constexpr = _bf16_layout("mma_te", T, D, BE)
    p_op: gl.constexpr = _bf16_layout("p_op", T, D, BE)
    num_segments = last_segment + 1
    (ticket, per_seg, seg, i_bh, i_b, i_h, e0, s, c_lo, c_hi, num_chunks, base_q, base_k, base_v,
     base_o) = _program(sync_ptr, num_heads, num_rows, seq_len, seg_chunks, decay_ptr, stride_decay,
                        q_ptr, k_ptr, v_ptr, o_ptr, stride_qb, stride_qh, stride_kb, stride_kh,
                        stride_vb, stride_vh, T, E, BE, ALIGN, SEGMENTED, STRIDE_QT, STRIDE_KT, STRIDE_VT,
                        REVERSE)
    SQT: gl.constexpr = _signed(STRIDE_QT, REVERSE)
    SKT: gl.constexpr = _signed(STRIDE_KT, REVERSE)
    SVT: gl.constexpr = _signed(STRIDE_VT, REVERSE)
    SOT: gl.constexpr = _signed(E, REVERSE)

    (q_ring, k_ring, v_ring, s_smem, vd_smem, offs_q, offs_k, offs_v, r_qk, r_v,
     c_v) = _bf16_buffers(T, D, BE, STAGES, SQT, SKT, SVT)
    q_decay, k_decay, causal, chunk_decay = _bf16_decays(s, r_v, T, mma_tt, mma_te)
    q_decay0 = None
    chunk_decay0 = None
    if HIST_SHIFT:
        q_decay0 = gl.exp(-s * gl.arange(0, T, layout=gl.SliceLayout(1, mma_te)).to(gl.float32))
        chunk_decay0 = gl.exp(-s * (T - 1))

    b_s, kv_base, r_s, c_s, offs_s = _start_state(history_ptr, kv_ptr, i_b, i_h, i_bh, e0, num_chunks,
                                                  stride_hb, stride_hh, stride_hd, D, E, BE, ALIGN,
                                                  BLOCK_CHUNKS, HAS_HISTORY, mma_te)
    if SEGMENTED:
        b_s = _segment_start(b_s, k_ring, v_ring, vd_smem, base_k, base_v, offs_k, offs_v, c_lo, c_hi,
                             k_decay, chunk_decay, s, ticket, per_seg, seg, num_segments, sync_ptr, pub_ptr,
                             i_bh, e0, offs_s, T, D, E, BE, STAGES, SKT, SVT, ld_v, p_op,
                             mma_te, False, HIST_SHIFT)
    b_s = _bf16_chunks(b_s, q_ring, k_ring, v_ring, s_smem, vd_smem, c_lo, c_hi, kv_base, offs_s, base_q,
                       base_k, base_v, base_o, offs_q, offs_k, offs_v, r_v[:, None] * SOT + c_v[None, :],
                       q_decay, k_decay, causal, chunk_decay, T, D, E, BE, STAGES, BLOCK_CHUNKS,
                       SQT, SKT, SVT, SOT, ld_v, mma_tt, mma_te, p_op,
                       q_decay0=q_decay0, chunk_decay0=chunk_decay0, HIST_SHIFT=HIST_SHIFT)
    _store_final(b_s, kv_base, offs_s, seg, num_segments, num_chunks, D, E, BLOCK_CHUNKS)


@gluon.jit
def _tf32_state_partition(b_s, q_ring, k_ring, v_ring, st_buf, vt_buf, ready, st_free, vt_free, ring_free,
                          c_lo, c_hi, kv_base, r_s, c_s, base_q, base_k, base_v, offs_q, offs_k, offs_v,
                          s_log2, chunk_decay, T: gl.constexpr, D: gl.constexpr, E: gl.constexpr,
                          BLOCK_CHUNKS: gl.constexpr, STRIDE_QT: gl.constexpr, STRIDE_KT: gl.constexpr,
                          STRIDE_VT: gl.constexpr, ld_vt: gl.constexpr, a_s: gl.constexpr, seq_len=0,
                          r_qk=None, r_v=None, MASKED: gl.constexpr = False, HIST_SHIFT: gl.constexpr = False):
    """Warp-specialised fp32 prefill, the state warpgroup (the default partition):
    issues every load (a 2-deep ring), makes the operands the output warpgroup
    reads (v^T into vt_buf[i % 2], S^T into st_buf) and signals ready[i % 2],
    then updates the state S <- lambda^T S + k_d^T v while the output
    warpgroup's products run. Chunk i = c - c_lo; the output warpgroup frees
    st_buf (q S done), ring slot i % 2 (q k^T, q S done) and vt_buf[i % 2] (P v done).
    MASKED (varlen): as _bf16_chunks, the last chunk's n < T tokens."""
    t_a = gl.arange(0, T, layout=gl.SliceLayout(0, a_s))
    _prologue(q_ring, k_ring, v_ring, c_lo, c_hi, base_q, base_k, base_v, offs_q, offs_k, offs_v,
              T, 2, STRIDE_QT, STRIDE_KT, STRIDE_VT, seq_len, r_qk, r_v, MASKED)
    for c in range(c_lo, c_hi):
        i = c - c_lo
        slot = i % 2
        n = i // 2
        if BLOCK_CHUNKS > 0:
            if c % BLOCK_CHUNKS == 0:
                gl.store(kv_base + (r_s + (c // BLOCK_CHUNKS) * D)[:, None] * E + c_s[None, :], b_s)
        async_copy.wait_group(1)
        gl.thread_barrier()
        vt_smem = vt_buf.index(slot)
        mbarrier.wait(vt_free.index(slot), (n & 1) ^ 1)
        vt_smem.store(gl.permute(v_ring.index(slot).load(ld_vt), (1, 0)))
        mbarrier.wait(st_free.index(0), (i & 1) ^ 1)
        st_buf.index(0).store(gl.permute(b_s, (1, 0)))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ready.index(slot), count=1)
        if MASKED:  # whole chunks: the same decays as unmasked (bitwise)
            # (not `n`: that is the ring phase's count, still needed below)
            n_tok = gl.minimum(seq_len - c * T, T)
            n_dec = n_tok
            if HIST_SHIFT:  # chunk 0 decays the history by lambda^(n_tok-1)
                n_dec = n_tok - (c == 0).to(gl.int32)
            b_s = b_s * gl.where(n_dec == T, chunk_decay, _exp2_ftz(n_dec.to(gl.float32) * s_log2))
            k_decay = gl.where(t_a < n_tok, _exp2_ftz((n_tok - 1 - t_a).to(gl.float32) * s_log2), 0.0)
        elif HIST_SHIFT:  # chunk 0 decays the history by lambda^(T-1) (see the kernel)
            b_s = b_s * gl.where(c == 0, _exp2_ftz((T - 1) * s_log2), chunk_decay)
            k_decay = _exp2_ftz((T - 1 - t_a).to(gl.float32) * s_log2)
        else:
            b_s = b_s * chunk_decay
            k_decay = _exp2_ftz((T - 1 - t_a).to(gl.float32) * s_log2)
        kt = k_ring.index(slot).permute((1, 0)).load(a_s) * k_decay[None, :]
        acc_s = warpgroup_mma(kt, vt_smem.permute((1, 0)), b_s, is_async=True)
        b_s = warpgroup_mma_wait(num_outstanding=0, deps=(acc_s, kt))[0]
        # refill the slot with chunk c+2 once the output warpgroup's q k^T and q S are done
        mbarrier.wait(ring_free.index(slot), n & 1)
        gl.thread_barrier()
        if c + 2 < c_hi:
            _load_chunk(q_ring, k_ring, v_ring, slot, c + 2, base_q, base_k, base_v, offs_q, offs_k,
                        offs_v, T, STRIDE_QT, STRIDE_KT, STRIDE_VT, seq_len, r_qk, r_v, MASKED)
        async_copy.commit_group()
    async_copy.wait_group(0)
    return (b_s,)


@gluon.jit
def _tf32_output_partition(q_ring, k_ring, st_buf, vt_buf, ready, st_free, vt_free, ring_free, c_lo, c_hi,
                           base_o, s_log2, T: gl.constexpr, E: gl.constexpr, BE: gl.constexpr,
                           mma_te: gl.constexpr, a_op: gl.constexpr, STRIDE_OT: gl.constexpr,
                           seq_len=0, MASKED: gl.constexpr = False, HIST_SHIFT: gl.constexpr = False):
    """Warp-specialised fp32 prefill, the output warpgroup (a worker partition):
    o = (q k^T * M) v + (q S) * lambda^(i+1) for each chunk, from the operands
    the state warpgroup made (see _tf32_state_partition); o rows STRIDE_OT
    apart. MASKED (varlen): only the last chunk's rows before seq_len are stored."""
    mma_tt: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, T, 8])
    t_te = gl.arange(0, T, layout=gl.SliceLayout(1, mma_te))
    c_te = gl.arange(0, BE, layout=gl.SliceLayout(0, mma_te))
    q_decay = _exp2_ftz((t_te + 1).to(gl.float32) * s_log2)
    i_tt = gl.arange(0, T, layout=gl.SliceLayout(1, mma_tt)).to(gl.float32)
    j_tt = gl.arange(0, T, layout=gl.SliceLayout(0, mma_tt)).to(gl.float32)
    zero_tt = gl.zeros([T, T], gl.float32, layout=mma_tt)
    zero_te = gl.zeros([T, BE], gl.float32, layout=mma_te)
    for c in range(c_lo, c_hi):
        i = c - c_lo
        slot = i % 2
        mbarrier.wait(ready.index(slot), (i // 2) & 1)
        q_s = q_ring.index(slot)
        acc_qs = warpgroup_mma(q_s, st_buf.index(0).permute((1, 0)), zero_te, use_acc=False, is_async=True)
        acc_qk = warpgroup_mma(q_s, k_ring.index(slot).permute((1, 0)), zero_tt, use_acc=False,
                               is_async=True)
        acc_qs, acc_qk = warpgroup_mma_wait(num_outstanding=0, deps=(acc_qs, acc_qk))
        gl.thread_barrier()
        mbarrier.arrive(st_free.index(0), count=1)
        mbarrier.arrive(ring_free.index(slot), count=1)
        if HIST_SHIFT:  # chunk 0: the history by lambda^i (see the kernel)
            b_o = acc_qs * gl.where(c == 0, _exp2_ftz(t_te.to(gl.float32) * s_log2), q_decay)[:, None]
        else:
            b_o = acc_qs * q_decay[:, None]
        diff = i_tt[:, None] - j_tt[None, :]
        p = gl.where(diff >= 0, acc_qk * _exp2_ftz(diff * s_log2), 0.0)
        p = gl.convert_layout(p, a_op)
        acc_o = warpgroup_mma(p, vt_buf.index(slot).permute((1, 0)), b_o, is_async=True)
        acc_o = warpgroup_mma_wait(num_outstanding=0, deps=(acc_o, p))[0]
        gl.thread_barrier()
        mbarrier.arrive(vt_free.index(slot), count=1)
        if MASKED and (c + 1) * T > seq_len:  # a partial chunk (varlen)
            gl.store(base_o + (t_te + c * T)[:, None] * STRIDE_OT + c_te[None, :], acc_o,
                     mask=(t_te < seq_len - c * T)[:, None])
        else:
            gl.store(base_o + (t_te + c * T)[:, None] * STRIDE_OT + c_te[None, :], acc_o)


@gluon.constexpr_function
def _tf32_layout(name, T, D, BE):
    """The fp32 kernels' layouts (4 warps per partition), by name: ld_qk / ld_v
    register layouts of the [T, D] / [T, BE] fp32 copies, ld_vt of v read back
    4 tokens per thread (so that v^T is stored in 16-byte pieces; tile [8, 64]:
    no warp holds a copy of another's part), mma_te of the [T, BE] wgmma
    accumulator, a_op of a register A operand, sh_* the shared layouts of the
    q/k, v, S^T and v^T tiles."""
    mma_te = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BE, 8])
    return dict(
        ld_qk=lambda: gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0]),
        ld_v=lambda: gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0]),
        ld_vt=lambda: gl.BlockedLayout([4, 1], [1, 32], [2, 2], [0, 1]),
        mma_te=lambda: mma_te,
        a_op=lambda: gl.DotOperandLayout(operand_index=0, parent=mma_te, k_width=1),
        sh_qk=lambda: gl.NVMMASharedLayout.get_default_for([T, D], gl.float32),
        sh_v=lambda: gl.NVMMASharedLayout.get_default_for([T, BE], gl.float32),
        sh_st=lambda: gl.NVMMASharedLayout.get_default_for([BE, D], gl.float32),
        sh_vt=lambda: gl.NVMMASharedLayout.get_default_for([BE, T], gl.float32),
    )[name]()


@gluon.jit
def _tf32_buffers(T: gl.constexpr, D: gl.constexpr, BE: gl.constexpr, STAGES: gl.constexpr,
                  STRIDE_QT: gl.constexpr, STRIDE_KT: gl.constexpr, STRIDE_VT: gl.constexpr):
    """The fp32 kernels' shared memory (the q, k, v rings; S^T and v^T as wgmma
    operands) and a chunk's token offsets and row / column indices."""
    q_ring, k_ring, v_ring = _rings(gl.float32, STAGES, T, D, BE, _tf32_layout("sh_qk", T, D, BE),
                                    _tf32_layout("sh_v", T, D, BE))
    st_buf = gl.allocate_shared_memory(gl.float32, [1, BE, D], _tf32_layout("sh_st", T, D, BE))
    vt_buf = gl.allocate_shared_memory(gl.float32, [2, BE, T], _tf32_layout("sh_vt", T, D, BE))
    offs_q, offs_k, offs_v, r_qk, r_v, c_v = _token_offsets(
        _tf32_layout("ld_qk", T, D, BE), _tf32_layout("ld_v", T, D, BE), T, D, BE, STRIDE_QT, STRIDE_KT,
        STRIDE_VT)
    return q_ring, k_ring, v_ring, st_buf, vt_buf, offs_q, offs_k, offs_v, r_qk, r_v, c_v


@gluon.jit
def _tf32_loop(b_s, q_ring, k_ring, v_ring, st_buf, vt_buf, c_lo, c_hi, kv_base, r_s, c_s, base_q, base_k,
               base_v, base_o, offs_q, offs_k, offs_v, s_log2, chunk_decay, T: gl.constexpr, D: gl.constexpr,
               E: gl.constexpr, BE: gl.constexpr, BLOCK_CHUNKS: gl.constexpr, STRIDE_QT: gl.constexpr,
               STRIDE_KT: gl.constexpr, STRIDE_VT: gl.constexpr, STRIDE_OT: gl.constexpr,
               ld_vt: gl.constexpr, a_op: gl.constexpr, mma_te: gl.constexpr, WS_REGS: gl.constexpr,
               seq_len=0, r_qk=None, r_v=None, MASKED: gl.constexpr = False, HIST_SHIFT: gl.constexpr = False):
    """The fp32 main loop over chunks [c_lo, c_hi): the state and output
    warpgroups side by side (see the partitions); returns the end state."""
    # one arrival completes each barrier's phase (see the partitions for who arrives)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    vt_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ring_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    st_free = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(2):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(vt_free.index(j), count=1)
        mbarrier.init(ring_free.index(j), count=1)
    mbarrier.init(st_free.index(0), count=1)
    return gl.warp_specialize([
        (_tf32_state_partition, (b_s, q_ring, k_ring, v_ring, st_buf, vt_buf, ready, st_free, vt_free,
                                 ring_free, c_lo, c_hi, kv_base, r_s, c_s, base_q, base_k, base_v, offs_q,
                                 offs_k, offs_v, s_log2, chunk_decay, T, D, E, BLOCK_CHUNKS, STRIDE_QT,
                                 STRIDE_KT, STRIDE_VT, ld_vt, a_op, seq_len, r_qk, r_v, MASKED, HIST_SHIFT)),
        (_tf32_output_partition, (q_ring, k_ring, st_buf, vt_buf, ready, st_free, vt_free, ring_free, c_lo,
                                  c_hi, base_o, s_log2, T, E, BE, mma_te, a_op, STRIDE_OT, seq_len,
                                  MASKED, HIST_SHIFT)),
    ], [4], [WS_REGS])[0]


@jit(gluon=True)
def _gluon_prefill_tf32_kernel(
    q_ptr, k_ptr, v_ptr, decay_ptr, history_ptr,
    num_heads, num_rows, seq_len, seg_chunks, last_segment, stride_decay,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_hb, stride_hh, stride_hd,
    o_ptr, kv_ptr, pub_ptr, sync_ptr,
    T: gl.constexpr, D: gl.constexpr, E: gl.constexpr, BE: gl.constexpr, STAGES: gl.constexpr,
    BLOCK_CHUNKS: gl.constexpr, HAS_HISTORY: gl.constexpr, SEGMENTED: gl.constexpr,
    ALIGN: gl.constexpr, STRIDE_QT: gl.constexpr, STRIDE_KT: gl.constexpr, STRIDE_VT: gl.constexpr,
    WS_REGS: gl.constexpr, REVERSE: gl.constexpr, HIST_SHIFT: gl.constexpr,
):
    """_gluon_prefill_kernel for fp32 inputs: every product in tf32 (fp32 accumulation).

    tf32 wgmma reads both operands contiguous along the contraction (no
    transposed operands, unlike bf16). q k^T and q S contract over D, along
    which q and k are stored; the two products over tokens get their operands
    by copies made in registers each chunk:
        q S     B = S^T, the state stored transposed into shared memory
        P v     B = v^T, v stored transposed into shared memory
        k^T v_d A = (k * lambda^(T-1-j))^T, loaded transposed into registers;
                B = v^T (the decay is put on k, so both products share v^T)
    Warp-specialised: after the setup (4 warps: starting state, a segment's
    hand-over) the state warpgroup (_tf32_state_partition: loads, the copies,
    the state update) and the output warpgroup (_tf32_output_partition, a
    worker of WS_REGS registers per thread) run side by side, handing the
    ring slots and copies over through mbarriers. STAGES must be 2.
    REVERSE, HIST_SHIFT: as _gluon_prefill_kernel's.
    """
    ld_vt: gl.constexpr = _tf32_layout("ld_vt", T, D, BE)
    mma_te: gl.constexpr = _tf32_layout("mma_te", T, D, BE)
    a_op: gl.constexpr = _tf32_layout("a_op", T, D, BE)
    gl.static_assert(STAGES == 2, "the warp-specialised loop keeps a 2-deep load ring")

    num_segments = last_segment + 1
    (ticket, per_seg, seg, i_bh, i_b, i_h, e0, s, c_lo, c_hi, num_chunks, base_q, base_k, base_v,
     base_o) = _program(sync_ptr, num_heads, num_rows, seq_len, seg_chunks, decay_ptr, stride_decay,
                        q_ptr, k_ptr, v_ptr, o_ptr, stride_qb, stride_qh, stride_kb, stride_kh,
                        stride_vb, stride_vh, T, E, BE, ALIGN, SEGMENTED, STRIDE_QT, STRIDE_KT, STRIDE_VT,
                        REVERSE)
    SQT: gl.constexpr = _signed(STRIDE_QT, REVERSE)
    SKT: gl.constexpr = _signed(STRIDE_KT, REVERSE)
    SVT: gl.constexpr = _signed(STRIDE_VT, REVERSE)
    SOT: gl.constexpr = _signed(E, REVERSE)

    q_ring, k_ring, v_ring, st_buf, vt_buf, offs_q, offs_k, offs_v = _tf32_buffers(
        T, D, BE, STAGES, SQT, SKT, SVT)[:8]
    t_a = gl.arange(0, T, layout=gl.SliceLayout(0, a_op))
    chunk_decay = gl.exp(-s * T)
    s_log2 = -s * 1.4426950408889634  # lambda^x = 2^(x * s_log2)

    b_s, kv_base, r_s, c_s, offs_s = _start_state(history_ptr, kv_ptr, i_b, i_h, i_bh, e0, num_chunks,
                                                  stride_hb, stride_hh, stride_hd, D, E, BE, ALIGN,
                                                  BLOCK_CHUNKS, HAS_HISTORY, mma_te)
    if SEGMENTED:
        b_s = _segment_start(b_s, k_ring, v_ring, vt_buf.index(0), base_k, base_v, offs_k, offs_v, c_lo,
                             c_hi, _exp2_ftz((T - 1 - t_a).to(gl.float32) * s_log2), chunk_decay, s, ticket,
                             per_seg, seg, num_segments, sync_ptr, pub_ptr, i_bh, e0, offs_s, T, D, E, BE,
                             STAGES, SKT, SVT, ld_vt, a_op, mma_te, True, HIST_SHIFT)

    b_s = _tf32_loop(b_s, q_ring, k_ring, v_ring, st_buf, vt_buf, c_lo, c_hi, kv_base, r_s, c_s, base_q, base_k,
                     base_v, base_o, offs_q, offs_k, offs_v, s_log2, chunk_decay, T, D, E, BE, BLOCK_CHUNKS,
                     SQT, SKT, SVT, SOT, ld_vt, a_op, mma_te, WS_REGS, HIST_SHIFT=HIST_SHIFT)
    _store_final(b_s, kv_base, offs_s, seg, num_segments, num_chunks, D, E, BLOCK_CHUNKS)


# ---------------------------------------------------------------- varlen (packed sequences)
@gluon.jit
def _longest_first(cu_ptr, w, num_seqs, BP: gl.constexpr):
    """The sequence of rank w with the sequences ordered longest first (ties:
    lower index first), from cu_seqlens (BP >= num_seqs, a power of two): each
    sequence's rank is the number of sequences ahead of it ([BP, BP] compares)."""
    lay: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
    i = gl.arange(0, BP, layout=gl.SliceLayout(1, lay))
    j = gl.arange(0, BP, layout=gl.SliceLayout(0, lay))
    len_i = (gl.load(cu_ptr + i + 1, mask=i < num_seqs, other=0)
             - gl.load(cu_ptr + i, mask=i < num_seqs, other=0))
    len_j = (gl.load(cu_ptr + j + 1, mask=j < num_seqs, other=0)
             - gl.load(cu_ptr + j, mask=j < num_seqs, other=0))
    ahead = (len_j[None, :] > len_i[:, None]) | ((len_j[None, :] == len_i[:, None]) & (j[None, :] < i[:, None]))
    rank = gl.sum((ahead & (j[None, :] < num_seqs)).to(gl.int32), axis=1)
    return gl.sum(gl.where((rank == w) & (i < num_seqs), i, 0), axis=0)


@gluon.jit
def _varlen_program(cu_ptr, num_seqs, num_heads, decay_ptr, stride_decay, q_ptr, k_ptr, v_ptr, o_ptr,
                    stride_qh, stride_kh, stride_vh, T: gl.constexpr, E: gl.constexpr, BE: gl.constexpr,
                    ALIGN: gl.constexpr, STRIDE_QT: gl.constexpr, STRIDE_KT: gl.constexpr,
                    STRIDE_VT: gl.constexpr, ORDER_B: gl.constexpr, REVERSE: gl.constexpr = False):
    """This program's (sequence, h, E-tile): program w * H * N_E + r takes the
    sequence of rank w (longest first when ORDER_B > 0, so that the longest
    sequences start first and short ones fill the end of the grid; else
    sequence w), head r // N_E, E-tile r % N_E. Returns the sequence index, its
    length and chunk count, the head, e0, the decay rate and the q, k, v, o bases
    (REVERSE: of the sequence's last token, as _program's)."""
    N_E: gl.constexpr = E // BE
    per_seq = num_heads * N_E
    pid = gl.program_id(0)
    w = pid // per_seq
    r = pid % per_seq
    if ORDER_B > 0:
        i_b = _longest_first(cu_ptr, w, num_seqs, ORDER_B)
    else:
        i_b = w
    seq_start = gl.load(cu_ptr + i_b).to(gl.int32)
    seq_len = gl.load(cu_ptr + i_b + 1).to(gl.int32) - seq_start
    i_h = (r // N_E).to(gl.int64)
    e0 = (r % N_E) * BE
    s = gl.load(decay_ptr + i_h * stride_decay)
    s = gl.where(s > 1e30, 1e30, s)  # s = +inf (lambda = 0) without NaN: see prefill_kernels.py's NOTE
    tok0 = seq_start.to(gl.int64)
    if REVERSE:  # (an empty sequence has no chunk: its bases are never read)
        tok0 = tok0 + seq_len - 1
    base_q = q_ptr + (tok0 * STRIDE_QT + i_h * (stride_qh * ALIGN))
    base_k = k_ptr + (tok0 * STRIDE_KT + i_h * (stride_kh * ALIGN))
    base_v = v_ptr + (tok0 * STRIDE_VT + i_h * (stride_vh * ALIGN) + e0)
    base_o = o_ptr + ((tok0 * num_heads + i_h) * E + e0)
    return i_b, i_h, e0, s, seq_len, (seq_len + T - 1) // T, base_q, base_k, base_v, base_o


@gluon.jit
def _varlen_state(state_ptr, slot_ptr, i_b, i_h, e0, seq_len, num_heads, num_slots, stride_cs, stride_ch,
                  STRIDE_CD: gl.constexpr, D: gl.constexpr, E: gl.constexpr, BE: gl.constexpr,
                  ALIGN: gl.constexpr, HAS_CACHE: gl.constexpr, mma_te: gl.constexpr, b_s=None,
                  STORE: gl.constexpr = False, HIST_BY_SEQ: gl.constexpr = False):
    """A sequence's state in the MMA layout, read (STORE False: the starting
    state) or written (STORE: its final state b_s). With the cache: slot
    slot_idx[i_b]; -1 starts from zero and writes nothing, an id outside [-1,
    num_slots) (device data nobody checked) starts from NaN and writes nothing,
    and an empty sequence leaves its slot alone. Without: zero (HIST_BY_SEQ:
    state_ptr[i_b], a contiguous [B, H, D, E]) / states[i_b].
    NOTE: the cache's row stride is a constexpr: as a runtime value the
    state's offsets, the same expression at the start and at the end, were
    kept live across the loop (sm_90 ptxas: 96 bytes/thread of spills)."""
    r_s = gl.arange(0, D, layout=gl.SliceLayout(1, mma_te))
    c_s = gl.arange(0, BE, layout=gl.SliceLayout(0, mma_te))
    if HAS_CACHE:
        slot = gl.load(slot_ptr + i_b).to(gl.int64)
        valid = (slot >= 0) & (slot < num_slots)
        offs = r_s[:, None] * STRIDE_CD + c_s[None, :]
        p = state_ptr + (gl.where(valid, slot, 0) * (stride_cs * ALIGN) + i_h * (stride_ch * ALIGN) + e0)
        if STORE:
            gl.store(p + offs, b_s, mask=(offs >= 0) & (valid & (seq_len > 0)))
        else:
            b_s = gl.load(p + offs, mask=(offs >= 0) & valid, other=0.0)
            b_s = gl.where((slot < -1) | (slot >= num_slots), float("nan"), b_s)
    else:
        p = state_ptr + ((i_b.to(gl.int64) * num_heads + i_h) * D * E + e0)
        if STORE:
            gl.store(p + r_s[:, None] * E + c_s[None, :], b_s)
        elif HIST_BY_SEQ:
            b_s = gl.load(p + r_s[:, None] * E + c_s[None, :])
        else:
            b_s = gl.zeros([D, BE], gl.float32, layout=mma_te)
    return b_s


@jit(gluon=True)
def _gluon_varlen_kernel(
    q_ptr, k_ptr, v_ptr, decay_ptr, cu_ptr, slot_ptr, cache_in_ptr,
    num_heads, num_seqs, num_slots, stride_decay, stride_qh, stride_kh, stride_vh,
    stride_cs, stride_ch,
    o_ptr, state_ptr,
    T: gl.constexpr, D: gl.constexpr, E: gl.constexpr, BE: gl.constexpr, STAGES: gl.constexpr,
    HAS_CACHE: gl.constexpr, ORDER_B: gl.constexpr, ALIGN: gl.constexpr, STRIDE_QT: gl.constexpr,
    STRIDE_KT: gl.constexpr, STRIDE_VT: gl.constexpr, STRIDE_OT: gl.constexpr, STRIDE_CD: gl.constexpr,
    HIST_BY_SEQ: gl.constexpr, REVERSE: gl.constexpr, HIST_SHIFT: gl.constexpr,
):
    """lightning_attention_varlen in bf16 (varlen_kernels.py's math, the Gluon
    prefill's chunk loop): one program per (sequence, h, E-tile), 4 warps.

    Tokens are packed ([T, H, *], token strides STRIDE_*T; o is [T, H, E]
    contiguous, STRIDE_OT = H * E); sequence b is tokens [cu[b], cu[b + 1]).
    Its chunks start at its first token; the last one may be partial (masked
    loads, zero-filled, and that chunk's own decays: _bf16_chunks). state_ptr
    is the cache (HAS_CACHE, read through cache_in_ptr, the same buffer) or
    the final states [B, H, D, E] (see _varlen_state)."""
    ld_v: gl.constexpr = _bf16_layout("ld_v", T, D, BE)
    mma_tt: gl.constexpr = _bf16_layout("mma_tt", T, D, BE)
    mma_te: gl.constexpr = _bf16_layout("mma_te", T, D, BE)
    p_op: gl.constexpr = _bf16_layout("p_op", T, D, BE)
    i_b, i_h, e0, s, seq_len, num_chunks, base_q, base_k, base_v, base_o = _varlen_program(
        cu_ptr, num_seqs, num_heads, decay_ptr, stride_decay, q_ptr, k_ptr, v_ptr, o_ptr, stride_qh,
        stride_kh, stride_vh, T, E, BE, ALIGN, STRIDE_QT, STRIDE_KT, STRIDE_VT, ORDER_B, REVERSE)
    SQT: gl.constexpr = _signed(STRIDE_QT, REVERSE)
    SKT: gl.constexpr = _signed(STRIDE_KT, REVERSE)
    SVT: gl.constexpr = _signed(STRIDE_VT, REVERSE)
    SOT: gl.constexpr = _signed(STRIDE_OT, REVERSE)

    (q_ring, k_ring, v_ring, s_smem, vd_smem, offs_q, offs_k, offs_v, r_qk, r_v,
     c_v) = _bf16_buffers(T, D, BE, STAGES, SQT, SKT, SVT)
    q_decay, k_decay, causal, chunk_decay = _bf16_decays(s, r_v, T, mma_tt, mma_te)
    q_decay0 = None
    if HIST_SHIFT:  # the history enters the first token undecayed (as _gluon_prefill_kernel)
        q_decay0 = gl.exp(-s * gl.arange(0, T, layout=gl.SliceLayout(1, mma_te)).to(gl.float32))
    b_s = _varlen_state(cache_in_ptr, slot_ptr, i_b, i_h, e0, seq_len, num_heads, num_slots, stride_cs,
                        stride_ch, STRIDE_CD, D, E, BE, ALIGN, HAS_CACHE, mma_te, HIST_BY_SEQ=HIST_BY_SEQ)
    b_s = _bf16_chunks(b_s, q_ring, k_ring, v_ring, s_smem, vd_smem, 0, num_chunks, o_ptr, 0, base_q,
                       base_k, base_v, base_o, offs_q, offs_k, offs_v, r_v[:, None] * SOT + c_v[None, :],
                       q_decay, k_decay, causal, chunk_decay, T, D, E, BE, STAGES, 0,
                       SQT, SKT, SVT, SOT, ld_v, mma_tt, mma_te, p_op,
                       seq_len, s, r_qk, r_v, True, q_decay0=q_decay0, HIST_SHIFT=HIST_SHIFT)
    _varlen_state(state_ptr, slot_ptr, i_b, i_h, e0, seq_len, num_heads, num_slots, stride_cs, stride_ch,
                  STRIDE_CD, D, E, BE, ALIGN, HAS_CACHE, mma_te, b_s, True)


@jit(gluon=True)
def _gluon_varlen_tf32_kernel(
    q_ptr, k_ptr, v_ptr, decay_ptr, cu_ptr, slot_ptr, cache_in_ptr,
    num_heads, num_seqs, num_slots, stride_decay, stride_qh, stride_kh, stride_vh,
    stride_cs, stride_ch,
    o_ptr, state_ptr,
    T: gl.constexpr, D: gl.constexpr, E: gl.constexpr, BE: gl.constexpr, STAGES: gl.constexpr,
    HAS_CACHE: gl.constexpr, ORDER_B: gl.constexpr, ALIGN: gl.constexpr, STRIDE_QT: gl.constexpr,
    STRIDE_KT: gl.constexpr, STRIDE_VT: gl.constexpr, STRIDE_OT: gl.constexpr, STRIDE_CD: gl.constexpr,
    HIST_BY_SEQ: gl.constexpr, REVERSE: gl.constexpr, HIST_SHIFT: gl.constexpr,
    WS_REGS: gl.constexpr,
):
    """_gluon_varlen_kernel for fp32 inputs: the warp-specialised tf32 loop of
    _gluon_prefill_tf32_kernel, masked as the bf16 one. STAGES must be 2."""
    ld_vt: gl.constexpr = _tf32_layout("ld_vt", T, D, BE)
    mma_te: gl.constexpr = _tf32_layout("mma_te", T, D, BE)
    a_op: gl.constexpr = _tf32_layout("a_op", T, D, BE)
    gl.static_assert(STAGES == 2, "the warp-specialised loop keeps a 2-deep load ring")
    i_b, i_h, e0, s, seq_len, num_chunks, base_q, base_k, base_v, base_o = _varlen_program(
        cu_ptr, num_seqs, num_heads, decay_ptr, stride_decay, q_ptr, k_ptr, v_ptr, o_ptr, stride_qh,
        stride_kh, stride_vh, T, E, BE, ALIGN, STRIDE_QT, STRIDE_KT, STRIDE_VT, ORDER_B, REVERSE)
    SQT: gl.constexpr = _signed(STRIDE_QT, REVERSE)
    SKT: gl.constexpr = _signed(STRIDE_KT, REVERSE)
    SVT: gl.constexpr = _signed(STRIDE_VT, REVERSE)
    SOT: gl.constexpr = _signed(STRIDE_OT, REVERSE)

    (q_ring, k_ring, v_ring, st_buf, vt_buf, offs_q, offs_k, offs_v, r_qk, r_v,
     c_v) = _tf32_buffers(T, D, BE, STAGES, SQT, SKT, SVT)
    s_log2 = -s * 1.4426950408889634  # lambda^x = 2^(x * s_log2)
    r_s = gl.arange(0, D, layout=gl.SliceLayout(1, mma_te))
    c_s = gl.arange(0, BE, layout=gl.SliceLayout(0, mma_te))
    b_s = _varlen_state(cache_in_ptr, slot_ptr, i_b, i_h, e0, seq_len, num_heads, num_slots, stride_cs,
                        stride_ch, STRIDE_CD, D, E, BE, ALIGN, HAS_CACHE, mma_te, HIST_BY_SEQ=HIST_BY_SEQ)
    b_s = _tf32_loop(b_s, q_ring, k_ring, v_ring, st_buf, vt_buf, 0, num_chunks, o_ptr, r_s, c_s, base_q,
                     base_k, base_v, base_o, offs_q, offs_k, offs_v, s_log2, gl.exp(-s * T), T, D, E, BE, 0,
                     SQT, SKT, SVT, SOT, ld_vt, a_op, mma_te, WS_REGS,
                     seq_len, r_qk, r_v, True, HIST_SHIFT)
    _varlen_state(state_ptr, slot_ptr, i_b, i_h, e0, seq_len, num_heads, num_slots, stride_cs, stride_ch,
                  STRIDE_CD, D, E, BE, ALIGN, HAS_CACHE, mma_te, b_s, True)

"""Triton kernels for lightning attention (linear attention with per-head decay).

The exact recurrence, per (batch b, head h), with lambda = exp(-s_h):

    S_t = lambda * S_{t-1} + k_t^T v_t        S: [D, E] fp32
    o_t = q_t S_t

Prefill walks the sequence in chunks of BLOCK_T tokens. For a chunk of L valid
tokens i = 0..L-1 starting from state S0:

    o_i   = lambda^(i+1) q_i S0 + sum_{j<=i} lambda^(i-j) (q_i . k_j) v_j
    S_end = lambda^L S0 + sum_{j<L} lambda^(L-1-j) k_j^T v_j

(the carried-in state decays by lambda^(i+1), not lambda^i: token i's own
update is applied after one decay step of everything before it).

A program owns one (b, h, E-tile) and a run of consecutive chunks (a
"segment"); its state tile [BLOCK_D, BLOCK_E] stays in registers, so q, k, v
are read and o written once per E-tile (the planner makes the E-tile the
whole of E where the state fits in registers). When B*H alone cannot fill the
GPU, the sequence is cut into segments that run in parallel and hand their
end states on through memory (a chained scan, see _lightning_prefill_kernel).

Chunks are laid out per state block: block `blk` (block_len tokens, the
caller's block_size) holds CHUNKS = cdiv(block_len, BLOCK_T) chunks, the last
one possibly short, so the state at every block boundary is available for the
returned per-block states whatever block_size is.
"""
import triton
import triton.language as tl

from .._triton_utils import jit

# NOTE: a decay rate s = +inf (lambda = exp(-s) = 0: each token's state forgets
# everything before it) is clamped to 1e30 in the prefill kernels (here and in
# gluon_kernels._program), which gives the same factors lambda^x = exp(-s * x)
# (exactly 1 for x = 0, exactly 0 for x >= 1 in fp32) without the NaN of inf * 0
# on the diagonal (x = i - j = 0) that made the whole output NaN. Any finite
# s > ~104 already gives lambda = 0 in fp32, so the clamp changes no finite
# rate's result; 1e30 keeps -s * log2(e) finite for the Gluon kernels' exp2 form
# (a rate above 2.4e38 overflowed to -inf there, with the same NaN). One compare
# and select per program; a NaN rate still propagates (NaN > 1e30 is false).
# The decode kernel needs none: its one factor is exp(-s) (= 0 for s = +inf).


# NOTE: tl.zeros, tl.sum, tl.cdiv, ... are @triton.jit helpers of triton.language,
# which the interpreter (CPU path) cannot call from a kernel interpreted by
# core_kernels._interpret when triton.language was imported before our package
# (tests/test_architecture.py checks that no kernel uses one); tl.full,
# tl.reduce(x, axis, tl.standard._sum_combine) and plain integer arithmetic
# compile to the same code (the reduce hits the interpreter's numpy fast path).
@triton.jit
def _operand(x, DOT_BF16: tl.constexpr):
    """MMA operand dtype: bf16 for bf16 inputs (bf16 has fp32's range), else fp32
    (tf32 on the GPU): fp16 could not hold a long-context state or score."""
    if DOT_BF16:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _state_product(b_k, b_vd, acc, DOT_BF16: tl.constexpr, SPLIT_STATE: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """acc + k^T v_d (k [T, D], v_d [T, E] fp32, the decayed v).

    SPLIT_STATE (fp32/fp16 inputs on the GPU): each operand as a bf16 pair hi + lo
    (hi = bf16(x), lo = bf16(x - hi): ~16 significant bits) and the product as
    hi.hi + hi.lo + lo.hi, three bf16 MMAs, instead of one tf32 MMA.
    NOTE: tf32 MMAs need both operands contiguous along the contraction (the
    tokens here), while k and v are stored contiguous along D and E, so the
    tf32 product had to transpose k through shared memory with 4-byte copies;
    bf16 MMAs read transposed operands natively. H200, B=1, H=64, N=4096, fp32:
    541 -> 390 us for the whole prefill (benchmarks/experiments). The result is
    also closer to fp32 than tf32's 11 bits.
    """
    if SPLIT_STATE:
        b_k = b_k.to(tl.float32)
        k_hi = b_k.to(tl.bfloat16)
        k_lo = (b_k - k_hi.to(tl.float32)).to(tl.bfloat16)
        v_hi = b_vd.to(tl.bfloat16)
        v_lo = (b_vd - v_hi.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(tl.trans(k_hi), v_hi, acc)
        acc = tl.dot(tl.trans(k_hi), v_lo, acc)
        return tl.dot(tl.trans(k_lo), v_hi, acc)
    else:
        return tl.dot(tl.trans(_operand(b_k, DOT_BF16)), _operand(b_vd, DOT_BF16), acc,
                      input_precision=DOT_PRECISION)


@triton.jit
def _chunk_span(g, seq_len, block_len, CHUNKS: tl.constexpr, BLOCK_T: tl.constexpr):
    """Global chunk index g -> (first token, valid length >= 0, block, index in block)."""
    blk = g // CHUNKS
    j = g % CHUNKS
    t0 = blk * block_len + j * BLOCK_T
    t_end = tl.minimum(tl.minimum(t0 + BLOCK_T, blk * block_len + block_len), seq_len)
    return t0, tl.maximum(t_end - t0, 0), blk, j


@triton.jit
def _row_offsets(rows, stride_row, OFFS_64: tl.constexpr):
    """Offsets of token rows within one (b, h) slice: int32 unless the plan found
    that they may not fit (NOTE: 64-bit address math per element was ~15% of the
    bf16 prefill loop's stall samples in Nsight Compute: IMAD/LEA)."""
    if OFFS_64:
        return rows.to(tl.int64) * stride_row
    else:
        return rows * stride_row


@triton.jit
def _load_tile(ptr, base, rows, stride_row, cols, m_col, EVEN: tl.constexpr, OFFS_64: tl.constexpr):
    """[len(rows), len(cols)] tile of a row-major (innermost contiguous) matrix.

    NOTE: rows are always valid memory (the caller clamps them), so no row mask:
    a [T, D] mask carried through the software pipeline cost ~100 registers per
    thread. Rows past a chunk's end hold real (finite) data that the causal
    structure and the zero k-decay ignore; their outputs are never stored.
    """
    p = (ptr + base) + _row_offsets(rows, stride_row, OFFS_64)[:, None] + cols[None, :]
    if EVEN:
        return tl.load(p)
    else:
        return tl.load(p, mask=m_col[None, :], other=0.0)


@triton.jit
def _load_state(ptr, o_d, o_e, stride_d, m_d, m_e):
    p = ptr + o_d.to(tl.int64)[:, None] * stride_d + o_e[None, :]
    return tl.load(p, mask=m_d[:, None] & m_e[None, :], other=0.0).to(tl.float32)


@triton.jit
def _store_state(ptr, b_s, o_d, o_e, stride_d, m_d, m_e):
    p = ptr + o_d.to(tl.int64)[:, None] * stride_d + o_e[None, :]
    tl.store(p, b_s, mask=m_d[:, None] & m_e[None, :])


@triton.jit
def _store_part(ptr, part, r0, c0, stride_d, head_k, head_v, HALF_D: tl.constexpr,
                HALF_E: tl.constexpr, EVEN_D: tl.constexpr, EVEN_E: tl.constexpr):
    o_r = r0 + tl.arange(0, HALF_D)
    o_c = c0 + tl.arange(0, HALF_E)
    m = ((o_r < head_k) | EVEN_D)[:, None] & ((o_c < head_v) | EVEN_E)[None, :]
    tl.store(ptr + o_r[:, None] * stride_d + o_c[None, :], part, mask=m)


@triton.jit
def _store_state_parts(ptr, b_s, e0, stride_d, head_k, head_v, BLOCK_D: tl.constexpr,
                       BLOCK_E: tl.constexpr, EVEN_D: tl.constexpr, EVEN_E: tl.constexpr):
    """_store_state (columns e0 + [0, BLOCK_E)) from inside the chunk loop, as
    four [BLOCK_D/2, BLOCK_E/2] parts.

    NOTE: a store converts the tile out of the MMA layout through shared memory
    and registers. Converting the whole tile pushed the bf16 kernel with 3 load
    stages past two programs per SM at E-tile 32 (122880 bytes of shared memory
    against 114688 in parts) and past 255 registers at E-tile 64 (spills). Both
    splits are register renamings (row halves and column halves are separate
    register repetitions of the MMA layout), so they move no data.
    """
    HALF_D: tl.constexpr = BLOCK_D // 2
    HALF_E: tl.constexpr = BLOCK_E // 2
    top, bottom = tl.split(tl.permute(tl.reshape(b_s, (2, HALF_D, BLOCK_E)), (1, 2, 0)))
    t_l, t_r = tl.split(tl.permute(tl.reshape(top, (HALF_D, 2, HALF_E)), (0, 2, 1)))
    b_l, b_r = tl.split(tl.permute(tl.reshape(bottom, (HALF_D, 2, HALF_E)), (0, 2, 1)))
    _store_part(ptr, t_l, 0, e0, stride_d, head_k, head_v, HALF_D, HALF_E, EVEN_D, EVEN_E)
    _store_part(ptr, t_r, 0, e0 + HALF_E, stride_d, head_k, head_v, HALF_D, HALF_E, EVEN_D, EVEN_E)
    _store_part(ptr, b_l, HALF_D, e0, stride_d, head_k, head_v, HALF_D, HALF_E, EVEN_D, EVEN_E)
    _store_part(ptr, b_r, HALF_D, e0 + HALF_E, stride_d, head_k, head_v, HALF_D, HALF_E, EVEN_D,
                EVEN_E)


@triton.jit
def _chunk_step(q_ptr, k_ptr, v_ptr, o_ptr, base_q, base_k, base_v, base_o,
                stride_qt, stride_kt, stride_vt, stride_ot, t0, n_valid, seq_len, b_s, s,
                o_t, o_d, o_e, m_d, m_e, q_decay, causal_decay,
                DOT_BF16: tl.constexpr, SPLIT_STATE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                EVEN_D: tl.constexpr, EVEN_E: tl.constexpr, OFFS_64: tl.constexpr,
                REVERSE: tl.constexpr, HIST_SHIFT: tl.constexpr):
    """One chunk of BLOCK_T tokens t0 .. t0 + n_valid - 1 of a sequence: stores
    their outputs o = (q k^T * decay) v + (q S) * q_decay and returns the state
    after them. ``b_s`` [D, E] is the state before the chunk; ``q_decay`` [T]
    and ``causal_decay`` [T, T] are the chunk-independent decay factors. Shared
    by the prefill and the varlen prefill kernels.
    REVERSE: token t is the sequence's row seq_len - 1 - t (the sequence walked
    from its end; rows in memory keep their order within a token). HIST_SHIFT:
    the starting state enters the first token undecayed (in the sequence's
    first chunk, t0 = 0: that chunk runs from S0 / lambda); see
    _lightning_prefill_kernel."""
    rows = t0 + o_t
    m_t = o_t < n_valid
    rows_in = tl.minimum(rows, seq_len - 1)  # valid memory; their outputs are not stored
    if REVERSE:
        rows_in = seq_len - 1 - rows_in
        rows_out = seq_len - 1 - rows  # negative past the end: masked below
    else:
        rows_out = rows
    if HIST_SHIFT:
        shift = (t0 == 0) * 1  # (an int under the interpreter, a tensor compiled)
        q_decay = tl.exp(-s * (o_t + 1 - shift).to(tl.float32))
        n_decay = n_valid - shift
    else:
        n_decay = n_valid
    b_q = _load_tile(q_ptr, base_q, rows_in, stride_qt, o_d, m_d, EVEN_D, OFFS_64)   # [T, D]
    b_k = _load_tile(k_ptr, base_k, rows_in, stride_kt, o_d, m_d, EVEN_D, OFFS_64)   # [T, D]
    b_v = _load_tile(v_ptr, base_v, rows_in, stride_vt, o_e, m_e, EVEN_E, OFFS_64)   # [T, E]
    k_decay = tl.where(m_t, tl.exp(-s * (n_valid - 1 - o_t).to(tl.float32)), 0.0)
    # NOTE: the decays scale dot *results* and v ([T, E]), never the q/k tiles
    # ([T, D]): q and k then go from shared memory straight into the MMAs, and
    # no [T, D] fp32 copy has to live in registers (the first version, which
    # scaled q and k, spilled ~3 KB of stack per thread at T=64, D=128).
    b_q = _operand(b_q, DOT_BF16)
    b_k = _operand(b_k, DOT_BF16)
    b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)          # [T, T]
    b_a = _operand(b_qk * causal_decay, DOT_BF16)
    b_o = tl.dot(b_a, _operand(b_v, DOT_BF16), input_precision=DOT_PRECISION)  # [T, E]
    b_o += tl.dot(b_q, _operand(b_s, DOT_BF16), input_precision=DOT_PRECISION) * q_decay[:, None]
    b_s = b_s * tl.exp(-s * n_decay.to(tl.float32))
    b_s = _state_product(b_k, b_v.to(tl.float32) * k_decay[:, None], b_s, DOT_BF16,  # [D, E]
                         SPLIT_STATE, DOT_PRECISION)
    p_o = (o_ptr + base_o) + _row_offsets(rows_out, stride_ot, OFFS_64)[:, None] + o_e[None, :]
    tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_t[:, None] & m_e[None, :])
    return b_s


@triton.jit
def _segment_contribution(k_ptr, v_ptr, base_k, base_v, stride_kt, stride_vt, s, seq_len, seg_t0, seg_t1,
                          o_d, o_e, m_d, m_e, P1_T: tl.constexpr, P1_STAGES: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                          EVEN_D: tl.constexpr, EVEN_E: tl.constexpr,
                          DOT_BF16: tl.constexpr, SPLIT_STATE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          OFFS_64: tl.constexpr, REVERSE: tl.constexpr):
    """sum_t lambda^(seg_t1-1-t) k_t^T v_t over tokens [seg_t0, seg_t1), from a zero state.

    The segment's tokens are one contiguous run whatever the chunk and block
    layout, so this walks them in steps of P1_T (twice the output loop's chunk)
    with its own pipeline depth (P1_STAGES): one state-update product per step
    and no other, so larger steps halve its waits (the output loop's shared
    memory budget bounds P1_T * P1_STAGES).
    """
    o_t = tl.arange(0, P1_T)
    b_l = tl.full([BLOCK_D, BLOCK_E], 0.0, tl.float32)
    for t0 in tl.range(seg_t0, seg_t1, P1_T, num_stages=P1_STAGES):
        n_valid = tl.minimum(seg_t1 - t0, P1_T)
        rows_in = tl.minimum(t0 + o_t, seq_len - 1)
        if REVERSE:  # as _chunk_step
            rows_in = seq_len - 1 - rows_in
        b_k = _load_tile(k_ptr, base_k, rows_in, stride_kt, o_d, m_d, EVEN_D, OFFS_64)
        b_v = _load_tile(v_ptr, base_v, rows_in, stride_vt, o_e, m_e, EVEN_E, OFFS_64)
        k_decay = tl.where(o_t < n_valid, tl.exp(-s * (n_valid - 1 - o_t).to(tl.float32)), 0.0)
        b_l = b_l * tl.exp(-s * n_valid.to(tl.float32))
        b_l = _state_product(b_k, b_v.to(tl.float32) * k_decay[:, None], b_l, DOT_BF16, SPLIT_STATE,
                             DOT_PRECISION)
    return b_l


# The look-back between segments (prefill) or items (varlen) of one sequence: a
# program publishes its segment's end state and raises the segment's flag; the
# next segment's program spins on that flag, then reads the state. One helper
# each, shared by the prefill and varlen kernels.
@triton.jit
def _draw_ticket(sync_ptr, SEGMENTED: tl.constexpr):
    """This program's ticket: segmented, the next from the counter sync[0], so
    that a program waits only on one that started before it (no deadlock
    whatever the scheduling); else the program id."""
    if SEGMENTED:
        ticket = tl.atomic_add(sync_ptr, 1)
    else:
        ticket = tl.program_id(0)
    return ticket


@triton.jit
def _wait_for_flag(p_flag):
    """Spin until the flag at ``p_flag`` is raised. Acquire: the state stored
    before the flag's release is visible after."""
    ready = tl.atomic_add(p_flag, 0, sem="acquire")
    while ready == 0:
        ready = tl.atomic_add(p_flag, 0, sem="acquire")


@triton.jit
def _publish_and_raise(p_state, b_state, mask, sync_ptr, ticket):
    """Store ``b_state`` [BLOCK_D, BLOCK_E] at ``p_state`` (masked), then raise
    ticket ``ticket``'s flag (sync[1 + ticket]; sync[0] is the ticket counter):
    the barrier orders every thread's store before the release. NOTE: the flag's
    address is computed here, after the barrier, as the kernels did before this
    helper: computed at the call (before the store), the compiler placed it
    elsewhere and the PTX changed (tools/compiled_digest.py, 2026-11-27)."""
    tl.store(p_state, b_state, mask=mask)
    tl.debug_barrier()
    tl.atomic_xchg(sync_ptr + 1 + ticket, 1, sem="release")


@jit
def _lightning_prefill_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, decay_ptr, history_ptr,
    # runtime scalars
    num_heads, num_rows, seq_len, head_k, head_v, block_len, num_blocks, num_chunks, blocks_per_seg,
    stride_decay,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
    stride_hb, stride_hh, stride_hd, stride_pb, stride_ph, stride_pp, stride_pd,
    stride_kvb, stride_kvh, stride_kvi, stride_kvd,
    # output pointers
    o_ptr, kv_ptr, pub_ptr, sync_ptr,
    # constexprs
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, CHUNKS: tl.constexpr,
    N_E: tl.constexpr, EVEN_D: tl.constexpr, EVEN_E: tl.constexpr, HAS_HISTORY: tl.constexpr,
    STORE_BLOCK_STATES: tl.constexpr, PUBLISH_IN_KV: tl.constexpr, SEGMENTED: tl.constexpr,
    DOT_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr, OFFS_64: tl.constexpr,
    P1_T: tl.constexpr, P1_STAGES: tl.constexpr, SPLIT_STATE: tl.constexpr,
    REVERSE: tl.constexpr, HIST_SHIFT: tl.constexpr,
):
    """One program per (segment, b, h, E-tile), segments in launch order.

    A segment is a run of blocks_per_seg state blocks. Its starting state is
    the previous segment's end state, handed over through memory (a chained
    scan with decoupled look-back): each program first computes its own
    segment's contribution L from k and v (phase 1), waits for the previous
    segment's end state P_prev (published with a flag), publishes its own end
    state lambda^len P_prev + L, and only then walks its segment computing the
    outputs from P_prev (phase 2; k and v come back from L2). Programs take
    tickets from an atomic counter in the order segment-major, so a program
    only ever waits on one that started before it: no deadlock whatever the
    scheduling, and in order under the interpreter.
    The published end states are the returned per-block states when those are
    requested (PUBLISH_IN_KV), otherwise a scratch buffer.

    Two variants serve the backward (backward_plan.py), which runs this
    recurrence on other operands: REVERSE walks every sequence from its last
    token to its first (token t is row seq_len - 1 - t of q, k, v and o), and
    HIST_SHIFT lets the starting state enter the first token undecayed
    (S_0 = S_hist + k_0^T v_0, then as above): the first chunk decays it by
    lambda^i instead of lambda^(i+1), and the first segment's end by
    lambda^(len-1). Without them the code is the plain prefill's.
    """
    # NOTE: integer arguments follow the package's policy (core_kernels._triton_utils.jit):
    # the strides arrive divided by their alignment group ALIGN and are multiplied
    # back here, so torch and JAX compile the same code and both know the strides'
    # alignment (before that policy JAX's prefill ran 1.6x slower on the H200).
    stride_qb, stride_qh, stride_qt = stride_qb * ALIGN, stride_qh * ALIGN, stride_qt * ALIGN
    stride_kb, stride_kh, stride_kt = stride_kb * ALIGN, stride_kh * ALIGN, stride_kt * ALIGN
    stride_vb, stride_vh, stride_vt = stride_vb * ALIGN, stride_vh * ALIGN, stride_vt * ALIGN
    stride_ob, stride_oh, stride_ot = stride_ob * ALIGN, stride_oh * ALIGN, stride_ot * ALIGN
    stride_hb, stride_hh, stride_hd = stride_hb * ALIGN, stride_hh * ALIGN, stride_hd * ALIGN
    stride_pb, stride_ph = stride_pb * ALIGN, stride_ph * ALIGN
    stride_pp, stride_pd = stride_pp * ALIGN, stride_pd * ALIGN
    stride_kvb, stride_kvh = stride_kvb * ALIGN, stride_kvh * ALIGN
    stride_kvi, stride_kvd = stride_kvi * ALIGN, stride_kvd * ALIGN
    per_seg = num_rows * num_heads * N_E  # programs per segment
    ticket = _draw_ticket(sync_ptr, SEGMENTED)
    i_p = ticket // per_seg
    r = ticket % per_seg
    i_e = r % N_E
    i_bh = r // N_E
    i_b = (i_bh // num_heads).to(tl.int64)
    i_h = (i_bh % num_heads).to(tl.int64)
    num_segments = (num_blocks + blocks_per_seg - 1) // blocks_per_seg  # not tl.cdiv: see the NOTE above
    s = tl.load(decay_ptr + i_h * stride_decay).to(tl.float32)
    s = tl.where(s > 1e30, 1e30, s)  # s = +inf (lambda = 0) without NaN: see the NOTE at the top

    o_t = tl.arange(0, BLOCK_T)
    o_d = tl.arange(0, BLOCK_D)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    # EVEN_*: all-true masks, folded away so that stores stay vectorized
    m_d = (o_d < head_k) | EVEN_D
    m_e = (o_e < head_v) | EVEN_E

    base_q = i_b * stride_qb + i_h * stride_qh
    base_k = i_b * stride_kb + i_h * stride_kh
    base_v = i_b * stride_vb + i_h * stride_vh
    base_o = i_b * stride_ob + i_h * stride_oh
    p_kv = kv_ptr + i_b * stride_kvb + i_h * stride_kvh  # scalar: a [D, E] pointer tile
    # kept live across the loop would cost 2 registers per state element
    if PUBLISH_IN_KV:  # segment p's end state: the state before block (p + 1) * blocks_per_seg
        p_pub = kv_ptr + i_b * stride_pb + i_h * stride_ph + stride_pp
    else:
        p_pub = pub_ptr + i_b * stride_pb + i_h * stride_ph
    first_chunk = i_p * blocks_per_seg * CHUNKS
    last_chunk = tl.minimum(first_chunk + blocks_per_seg * CHUNKS, num_chunks)

    # starting state of the sequence
    if HAS_HISTORY:
        b_s = _load_state(history_ptr + i_b * stride_hb + i_h * stride_hh, o_d, o_e, stride_hd, m_d, m_e)
    else:
        b_s = tl.full([BLOCK_D, BLOCK_E], 0.0, tl.float32)
    b_s = b_s.to(tl.float32)
    if SEGMENTED:
        b_l = tl.full([BLOCK_D, BLOCK_E], 0.0, tl.float32)
        if i_p < num_segments - 1:  # phase 1: this segment's own contribution
            seg_t0 = i_p * blocks_per_seg * block_len
            seg_t1 = tl.minimum(seg_t0 + blocks_per_seg * block_len, seq_len)
            b_l = _segment_contribution(k_ptr, v_ptr, base_k, base_v, stride_kt, stride_vt, s, seq_len,
                                        seg_t0, seg_t1, o_d, o_e, m_d, m_e, P1_T, P1_STAGES,
                                        BLOCK_D, BLOCK_E, EVEN_D, EVEN_E, DOT_BF16, SPLIT_STATE,
                                        DOT_PRECISION, OFFS_64, REVERSE)
        if i_p > 0:  # look back: wait for the previous segment's end state
            _wait_for_flag(sync_ptr + 1 + ticket - per_seg)
            offs = (i_p - 1) * stride_pp + o_d.to(tl.int64)[:, None] * stride_pd + o_e[None, :]
            b_s = tl.load(p_pub + offs, mask=m_d[:, None] & m_e[None, :], other=0.0,
                          cache_modifier=".cg")
        if i_p < num_segments - 1:  # publish this segment's end state, then raise its flag
            seg_len = (blocks_per_seg * block_len).to(tl.float32)
            if HIST_SHIFT:
                seg_len = seg_len - (i_p == 0).to(tl.float32)
            b_end = b_s * tl.exp(-s * seg_len) + b_l
            offs = i_p * stride_pp + o_d.to(tl.int64)[:, None] * stride_pd + o_e[None, :]
            _publish_and_raise(p_pub + offs, b_end, m_d[:, None] & m_e[None, :], sync_ptr, ticket)

    # decay factors that do not depend on the chunk: [BLOCK_T] and [BLOCK_T, BLOCK_T]
    q_decay = tl.exp(-s * (o_t + 1).to(tl.float32))
    diff = (o_t[:, None] - o_t[None, :]).to(tl.float32)
    causal_decay = tl.where(o_t[:, None] >= o_t[None, :], tl.exp(-s * diff), 0.0)

    for g in range(first_chunk, last_chunk):
        t0, n_valid, blk, j = _chunk_span(g, seq_len, block_len, CHUNKS, BLOCK_T)
        if STORE_BLOCK_STATES:
            # state before token blk * block_len; a segment's first one was
            # published by the previous segment when it lives in kv
            if PUBLISH_IN_KV:
                first = (j == 0) & ((g > first_chunk) | (i_p == 0))
            else:
                first = j == 0
            if first:
                _store_state_parts(p_kv + blk.to(tl.int64) * stride_kvi, b_s, i_e * BLOCK_E, stride_kvd,
                                   head_k, head_v, BLOCK_D, BLOCK_E, EVEN_D, EVEN_E)
        b_s = _chunk_step(q_ptr, k_ptr, v_ptr, o_ptr, base_q, base_k, base_v, base_o,
                          stride_qt, stride_kt, stride_vt, stride_ot, t0, n_valid, seq_len, b_s, s,
                          o_t, o_d, o_e, m_d, m_e, q_decay, causal_decay,
                          DOT_BF16, SPLIT_STATE, DOT_PRECISION, EVEN_D, EVEN_E, OFFS_64, REVERSE,
                          HIST_SHIFT)

    if i_p == num_segments - 1:  # the last segment holds the final state
        if STORE_BLOCK_STATES:
            # i_b * 0: an int64 zero, so the offset cannot overflow int32
            _store_state(p_kv + (i_b * 0 + num_blocks) * stride_kvi, b_s, o_d, o_e, stride_kvd,
                         m_d, m_e)
        else:
            _store_state(p_kv, b_s, o_d, o_e, stride_kvd, m_d, m_e)

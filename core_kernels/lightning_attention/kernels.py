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
are read and o written exactly once per E-tile (sibling E-tiles of one head
run side by side and share q, k through L2). When B*H alone cannot fill the
GPU, the sequence is cut into segments: `_lightning_segment_state_kernel`
computes each segment's own state contribution, `_lightning_segment_scan_kernel`
turns those into each segment's starting state, and the main kernel then runs
all segments in parallel.

Chunks are laid out per state block: block `blk` (block_len tokens, the
caller's block_size) holds CHUNKS = cdiv(block_len, BLOCK_T) chunks, the last
one possibly short, so the state at every block boundary is available for the
returned per-block states whatever block_size is.
"""
import triton
import triton.language as tl


# NOTE: tl.zeros and tl.sum are @triton.jit helpers of triton.language, which
# the interpreter (CPU path) cannot call from a kernel interpreted by
# core_kernels._interpret; tl.full and tl.reduce(x, axis, tl.standard._sum_combine)
# are builtins that compile to the same code (and the latter hits the
# interpreter's numpy fast path for sums).
@triton.jit
def _operand(x, DOT_BF16: tl.constexpr):
    """MMA operand dtype: bf16 for bf16 inputs (bf16 has fp32's range), else fp32
    (tf32 on the GPU): fp16 could not hold a long-context state or score."""
    if DOT_BF16:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _chunk_span(g, seq_len, block_len, CHUNKS: tl.constexpr, BLOCK_T: tl.constexpr):
    """Global chunk index g -> (first token, valid length >= 0, block, index in block)."""
    blk = g // CHUNKS
    j = g % CHUNKS
    t0 = blk * block_len + j * BLOCK_T
    t_end = tl.minimum(tl.minimum(t0 + BLOCK_T, blk * block_len + block_len), seq_len)
    return t0, tl.maximum(t_end - t0, 0), blk, j


@triton.jit
def _load_tile(ptr, base, rows, stride_row, cols, m_col, EVEN: tl.constexpr):
    """[len(rows), len(cols)] tile of a row-major (innermost contiguous) matrix.

    NOTE: rows are always valid memory (the caller clamps them), so no row mask:
    a [T, D] mask carried through the software pipeline cost ~100 registers per
    thread. Rows past a chunk's end hold real (finite) data that the causal
    structure and the zero k-decay ignore; their outputs are never stored.
    """
    p = ptr + base + rows.to(tl.int64)[:, None] * stride_row + cols[None, :]
    if EVEN:
        return tl.load(p)
    else:
        return tl.load(p, mask=m_col[None, :], other=0.0)


@triton.jit
def _load_state(ptr, o_d, o_e, stride_d, m_d, m_e):
    p = ptr + o_d.to(tl.int64)[:, None] * stride_d + o_e[None, :]
    return tl.load(p, mask=m_d[:, None] & m_e[None, :], other=0.0)


@triton.jit
def _store_state(ptr, b_s, o_d, o_e, stride_d, m_d, m_e):
    p = ptr + o_d.to(tl.int64)[:, None] * stride_d + o_e[None, :]
    tl.store(p, b_s, mask=m_d[:, None] & m_e[None, :])


# NOTE: jax-triton specializes no integer argument on divisibility (only == 1),
# while torch's launcher marks every int divisible by 16. Kernels compiled from
# different knowledge pick different layouts (seen on the H200: decode outputs
# differed in the last bit between torch and JAX, and JAX prefill ran 1.6x
# slower). So ints are never specialized on alignment here (as in jax-triton),
# and the plan passes strides divided by ALIGN (a power of two dividing all of
# them), multiplied back in the kernel: both frameworks compile the same code
# and both know the strides' alignment (vectorized loads).
_PREFILL_INTS = ("num_heads seq_len head_k head_v block_len num_blocks num_chunks blocks_per_seg "
                 "stride_decay stride_qb stride_qh stride_qt stride_kb stride_kh stride_kt "
                 "stride_vb stride_vh stride_vt stride_ob stride_oh stride_ot stride_hb stride_hh "
                 "stride_hd stride_sb stride_sh stride_sp stride_sd stride_kvb stride_kvh "
                 "stride_kvi stride_kvd").split()
_SEGMENT_INTS = ("num_heads seq_len head_k head_v block_len num_blocks num_chunks blocks_per_seg "
                 "stride_decay stride_kb stride_kh stride_kt stride_vb stride_vh stride_vt "
                 "stride_sb stride_sh stride_sp stride_sd").split()
_SCAN_INTS = ("num_heads head_k head_v num_segments seg_tokens stride_decay stride_hb stride_hh "
              "stride_hd stride_sb stride_sh stride_sp stride_sd").split()
_DECODE_INTS = ("num_heads num_slots head_k head_v stride_decay stride_qb stride_qh stride_kb "
                "stride_kh stride_vb stride_vh stride_cs stride_ch stride_cd stride_ce "
                "stride_ob stride_oh").split()


@triton.jit(do_not_specialize=["seq_len", "num_blocks", "num_chunks"],
            do_not_specialize_on_alignment=_PREFILL_INTS)
def _lightning_prefill_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, decay_ptr, history_ptr, seg_state_ptr,
    # runtime scalars
    num_heads, seq_len, head_k, head_v, block_len, num_blocks, num_chunks, blocks_per_seg,
    stride_decay,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
    stride_hb, stride_hh, stride_hd, stride_sb, stride_sh, stride_sp, stride_sd,
    stride_kvb, stride_kvh, stride_kvi, stride_kvd,
    # output pointers
    o_ptr, kv_ptr,
    # constexprs
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, CHUNKS: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_E: tl.constexpr, HAS_HISTORY: tl.constexpr, FROM_SEGMENTS: tl.constexpr, STORE_BLOCK_STATES: tl.constexpr,
    DOT_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr,
):
    stride_qb, stride_qh, stride_qt = stride_qb * ALIGN, stride_qh * ALIGN, stride_qt * ALIGN
    stride_kb, stride_kh, stride_kt = stride_kb * ALIGN, stride_kh * ALIGN, stride_kt * ALIGN
    stride_vb, stride_vh, stride_vt = stride_vb * ALIGN, stride_vh * ALIGN, stride_vt * ALIGN
    stride_ob, stride_oh, stride_ot = stride_ob * ALIGN, stride_oh * ALIGN, stride_ot * ALIGN
    stride_hb, stride_hh, stride_hd = stride_hb * ALIGN, stride_hh * ALIGN, stride_hd * ALIGN
    stride_sb, stride_sh = stride_sb * ALIGN, stride_sh * ALIGN
    stride_sp, stride_sd = stride_sp * ALIGN, stride_sd * ALIGN
    stride_kvb, stride_kvh = stride_kvb * ALIGN, stride_kvh * ALIGN
    stride_kvi, stride_kvd = stride_kvi * ALIGN, stride_kvd * ALIGN
    i_e = tl.program_id(0)
    i_p = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b = (i_bh // num_heads).to(tl.int64)
    i_h = (i_bh % num_heads).to(tl.int64)
    s = tl.load(decay_ptr + i_h * stride_decay).to(tl.float32)

    o_t = tl.arange(0, BLOCK_T)
    o_d = tl.arange(0, BLOCK_D)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    # EVEN_*: all-true masks, folded away so that stores stay vectorized
    m_d = (o_d < head_k) | EVEN_D
    m_e = (o_e < head_v) | EVEN_E

    # [BLOCK_D, BLOCK_E] starting state of this segment
    if FROM_SEGMENTS:
        p_s = seg_state_ptr + i_b * stride_sb + i_h * stride_sh + i_p * stride_sp
        b_s = _load_state(p_s, o_d, o_e, stride_sd, m_d, m_e)
    elif HAS_HISTORY:
        b_s = _load_state(history_ptr + i_b * stride_hb + i_h * stride_hh, o_d, o_e, stride_hd, m_d, m_e)
    else:
        b_s = tl.full([BLOCK_D, BLOCK_E], 0.0, tl.float32)
    b_s = b_s.to(tl.float32)

    # decay factors that do not depend on the chunk: [BLOCK_T] and [BLOCK_T, BLOCK_T]
    q_decay = tl.exp(-s * (o_t + 1).to(tl.float32))
    diff = (o_t[:, None] - o_t[None, :]).to(tl.float32)
    causal_decay = tl.where(o_t[:, None] >= o_t[None, :], tl.exp(-s * diff), 0.0)

    base_q = i_b * stride_qb + i_h * stride_qh
    base_k = i_b * stride_kb + i_h * stride_kh
    base_v = i_b * stride_vb + i_h * stride_vh
    base_o = i_b * stride_ob + i_h * stride_oh
    p_kv = kv_ptr + i_b * stride_kvb + i_h * stride_kvh  # scalar: a [D, E] pointer tile
    # kept live across the loop would cost 2 registers per state element

    first_chunk = i_p * blocks_per_seg * CHUNKS
    last_chunk = tl.minimum(first_chunk + blocks_per_seg * CHUNKS, num_chunks)
    for g in range(first_chunk, last_chunk):
        t0, n_valid, blk, j = _chunk_span(g, seq_len, block_len, CHUNKS, BLOCK_T)
        if STORE_BLOCK_STATES:
            if j == 0:  # state before token blk * block_len
                _store_state(p_kv + blk.to(tl.int64) * stride_kvi, b_s, o_d, o_e, stride_kvd,
                             m_d, m_e)
        rows = t0 + o_t
        m_t = o_t < n_valid
        rows_in = tl.minimum(rows, seq_len - 1)
        b_q = _load_tile(q_ptr, base_q, rows_in, stride_qt, o_d, m_d, EVEN_D)   # [T, D]
        b_k = _load_tile(k_ptr, base_k, rows_in, stride_kt, o_d, m_d, EVEN_D)   # [T, D]
        b_v = _load_tile(v_ptr, base_v, rows_in, stride_vt, o_e, m_e, EVEN_E)   # [T, E]
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
        b_vd = _operand(b_v.to(tl.float32) * k_decay[:, None], DOT_BF16)           # [T, E]
        b_s = b_s * tl.exp(-s * n_valid.to(tl.float32))
        b_s = tl.dot(tl.trans(b_k), b_vd, b_s, input_precision=DOT_PRECISION)      # [D, E]
        p_o = o_ptr + base_o + rows.to(tl.int64)[:, None] * stride_ot + o_e[None, :]
        tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_t[:, None] & m_e[None, :])

    if i_p == tl.num_programs(1) - 1:  # the last segment holds the final state
        if STORE_BLOCK_STATES:
            # i_b * 0: an int64 zero, so the offset cannot overflow int32
            _store_state(p_kv + (i_b * 0 + num_blocks) * stride_kvi, b_s, o_d, o_e, stride_kvd,
                         m_d, m_e)
        else:
            _store_state(p_kv, b_s, o_d, o_e, stride_kvd, m_d, m_e)


@triton.jit(do_not_specialize=["seq_len", "num_blocks", "num_chunks"],
            do_not_specialize_on_alignment=_SEGMENT_INTS)
def _lightning_segment_state_kernel(
    # input pointers
    k_ptr, v_ptr, decay_ptr,
    # runtime scalars
    num_heads, seq_len, head_k, head_v, block_len, num_blocks, num_chunks, blocks_per_seg,
    stride_decay,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_sb, stride_sh, stride_sp, stride_sd,
    # output pointers
    seg_state_ptr,
    # constexprs
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, CHUNKS: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_E: tl.constexpr, DOT_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Each segment's own contribution sum_t lambda^(seg_end-1-t) k_t^T v_t (from a zero state)."""
    stride_kb, stride_kh, stride_kt = stride_kb * ALIGN, stride_kh * ALIGN, stride_kt * ALIGN
    stride_vb, stride_vh, stride_vt = stride_vb * ALIGN, stride_vh * ALIGN, stride_vt * ALIGN
    stride_sb, stride_sh = stride_sb * ALIGN, stride_sh * ALIGN
    stride_sp, stride_sd = stride_sp * ALIGN, stride_sd * ALIGN
    i_e = tl.program_id(0)
    i_p = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b = (i_bh // num_heads).to(tl.int64)
    i_h = (i_bh % num_heads).to(tl.int64)
    s = tl.load(decay_ptr + i_h * stride_decay).to(tl.float32)
    o_t = tl.arange(0, BLOCK_T)
    o_d = tl.arange(0, BLOCK_D)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    # EVEN_*: all-true masks, folded away so that stores stay vectorized
    m_d = (o_d < head_k) | EVEN_D
    m_e = (o_e < head_v) | EVEN_E
    base_k = i_b * stride_kb + i_h * stride_kh
    base_v = i_b * stride_vb + i_h * stride_vh

    b_s = tl.full([BLOCK_D, BLOCK_E], 0.0, tl.float32)
    first_chunk = i_p * blocks_per_seg * CHUNKS
    last_chunk = tl.minimum(first_chunk + blocks_per_seg * CHUNKS, num_chunks)
    for g in range(first_chunk, last_chunk):
        t0, n_valid, blk, j = _chunk_span(g, seq_len, block_len, CHUNKS, BLOCK_T)
        rows_in = tl.minimum(t0 + o_t, seq_len - 1)
        m_t = o_t < n_valid
        b_k = _load_tile(k_ptr, base_k, rows_in, stride_kt, o_d, m_d, EVEN_D)
        b_v = _load_tile(v_ptr, base_v, rows_in, stride_vt, o_e, m_e, EVEN_E)
        k_decay = tl.where(m_t, tl.exp(-s * (n_valid - 1 - o_t).to(tl.float32)), 0.0)
        b_vd = _operand(b_v.to(tl.float32) * k_decay[:, None], DOT_BF16)
        b_s = b_s * tl.exp(-s * n_valid.to(tl.float32))
        b_s = tl.dot(tl.trans(_operand(b_k, DOT_BF16)), b_vd, b_s, input_precision=DOT_PRECISION)
    p_s = seg_state_ptr + i_b * stride_sb + i_h * stride_sh + i_p * stride_sp
    tl.store(p_s + o_d.to(tl.int64)[:, None] * stride_sd + o_e[None, :], b_s,
             mask=m_d[:, None] & m_e[None, :])


@triton.jit(do_not_specialize_on_alignment=_SCAN_INTS)
def _lightning_segment_scan_kernel(
    # input pointers
    seg_in_ptr, decay_ptr, history_ptr,
    # runtime scalars
    num_heads, head_k, head_v, num_segments, seg_tokens, stride_decay,
    stride_hb, stride_hh, stride_hd, stride_sb, stride_sh, stride_sp, stride_sd,
    # output pointers
    seg_state_ptr,
    # constexprs
    BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, HAS_HISTORY: tl.constexpr, ALIGN: tl.constexpr,
):
    """In place: segment contributions [p] -> starting states [p] (every segment
    but the last is full, seg_tokens long)."""
    stride_hb, stride_hh, stride_hd = stride_hb * ALIGN, stride_hh * ALIGN, stride_hd * ALIGN
    stride_sb, stride_sh = stride_sb * ALIGN, stride_sh * ALIGN
    stride_sp, stride_sd = stride_sp * ALIGN, stride_sd * ALIGN
    i_e = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = (i_bh // num_heads).to(tl.int64)
    i_h = (i_bh % num_heads).to(tl.int64)
    s = tl.load(decay_ptr + i_h * stride_decay).to(tl.float32)
    seg_decay = tl.exp(-s * seg_tokens)
    o_d = tl.arange(0, BLOCK_D)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    m = (o_d < head_k)[:, None] & (o_e < head_v)[None, :]
    if HAS_HISTORY:
        p_h = history_ptr + i_b * stride_hb + i_h * stride_hh
        b_s = tl.load(p_h + o_d.to(tl.int64)[:, None] * stride_hd + o_e[None, :], mask=m, other=0.0)
    else:
        b_s = tl.full([BLOCK_D, BLOCK_E], 0.0, tl.float32)
    offs = i_b * stride_sb + i_h * stride_sh + o_d.to(tl.int64)[:, None] * stride_sd + o_e[None, :]
    for p in range(0, num_segments):
        off_p = offs + p * stride_sp
        b_local = tl.load(seg_in_ptr + off_p, mask=m & (p < num_segments - 1), other=0.0)
        tl.store(seg_state_ptr + off_p, b_s, mask=m)
        b_s = b_s * seg_decay + b_local


@triton.jit(do_not_specialize_on_alignment=_DECODE_INTS)
def _lightning_decode_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, cache_in_ptr, decay_ptr, slot_ptr,
    # runtime scalars
    num_heads, num_slots, head_k, head_v, stride_decay,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_cs, stride_ch, stride_cd, stride_ce, stride_ob, stride_oh,
    # output pointers
    out_ptr, cache_ptr,
    # constexprs
    BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_D: tl.constexpr, EVEN_E: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """One decode step for (row b, head h, E-tile): S = lambda S + k^T v in the
    cache slot, o = q S. Slot -1: output 0, no cache access; a slot outside
    [-1, num_slots): output NaN, no cache access."""
    stride_qb, stride_qh, stride_kb, stride_kh = (stride_qb * ALIGN, stride_qh * ALIGN,
                                                  stride_kb * ALIGN, stride_kh * ALIGN)
    stride_vb, stride_vh, stride_ob, stride_oh = (stride_vb * ALIGN, stride_vh * ALIGN,
                                                  stride_ob * ALIGN, stride_oh * ALIGN)
    stride_cs, stride_ch, stride_cd = stride_cs * ALIGN, stride_ch * ALIGN, stride_cd * ALIGN
    i_e = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = (i_bh // num_heads).to(tl.int64)
    i_h = (i_bh % num_heads).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    # EVEN_*: all-true masks, dropped so that loads and stores stay vectorized
    m_d = (o_d < head_k) | EVEN_D
    m_e = (o_e < head_v) | EVEN_E
    p_out = out_ptr + i_b * stride_ob + i_h * stride_oh + o_e
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    if slot == -1:
        tl.store(p_out, tl.full([BLOCK_E], 0.0, tl.float32).to(out_ptr.dtype.element_ty), mask=m_e)
    elif (slot < -1) | (slot >= num_slots):
        tl.store(p_out, tl.full([BLOCK_E], float("nan"), tl.float32).to(out_ptr.dtype.element_ty),
                 mask=m_e)
    else:
        s = tl.load(decay_ptr + i_h * stride_decay).to(tl.float32)
        b_q = tl.load(q_ptr + i_b * stride_qb + i_h * stride_qh + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_k = tl.load(k_ptr + i_b * stride_kb + i_h * stride_kh + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_v = tl.load(v_ptr + i_b * stride_vb + i_h * stride_vh + o_e, mask=m_e, other=0.0).to(tl.float32)
        offs = (slot * stride_cs + i_h * stride_ch
                + o_d.to(tl.int64)[:, None] * stride_cd + o_e.to(tl.int64)[None, :] * stride_ce)
        m = m_d[:, None] & m_e[None, :]
        b_s = tl.load(cache_in_ptr + offs, mask=m, other=0.0)            # [D, E]
        b_s = b_s * tl.exp(-s) + b_k[:, None] * b_v[None, :]
        tl.store(cache_ptr + offs, b_s, mask=m)
        b_o = tl.reduce(b_q[:, None] * b_s, 0, tl.standard._sum_combine)                          # [E]
        tl.store(p_out, b_o.to(out_ptr.dtype.element_ty), mask=m_e)

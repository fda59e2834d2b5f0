"""Triton kernels of unified_attention's split-KV decode path.

Sequences with 1 <= qlen <= DECODE_MAX_Q new tokens (problem.py). A program of
_unified_decode_kernel serves one sequence and one kv head: every query head
of that kv head and every new token of the sequence are rows of one tile (row
= token * GROUP + head in the group), so each K/V tile of the paged cache is
read once for all of them.

A sequence's keys [lo, L) (lo > 0 only with a sliding window) are cut into
chunks by _sequence_chunks, from that sequence's own length and the config's
constants only: never from the batch, its sizes or the GPU. Each chunk's
keys are summed in one fixed order from a fresh state. A sequence of one
chunk writes its output directly; otherwise each chunk stores its state (max,
sum, unnormalised output) and _unified_decode_combine_kernel merges the
chunks in chunk order. So a sequence's output is bitwise the same whatever
other sequences share the call, and run to run (no atomics). How many
consecutive chunks one program takes (one pipelined loop, storing each
chunk's state at its end) is the plan's choice from the batch and the GPU:
it changes the speed only.

Every key tile is masked the same way: loads never touch cache tokens
outside [lo, L), block-table entries are read only for those tokens, and
block ids are clamped into the cache, so bad ids never read outside it.
"""
import triton
import triton.language as tl

from .._triton_utils import jit, round_to_fp8_grid

# finite "minus infinity" for running maxima: exp2(m_old - m_new) stays free of
# inf - inf while a row has seen no visible key
NEG_BIG = tl.constexpr(-1.0e30)
LOG2E = tl.constexpr(1.4426950408889634)


# NOTE: tl.max / tl.sum are @triton.jit functions that core_kernels._interpret
# cannot swap for interpreted copies; tl.reduce with the standard combine
# functions is what they expand to (as in prefix_prefill/kernels.py).
@triton.jit
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _sequence(cu_q_ptr, seqused_k_ptr, causal_ptr, i_b, table_width,
              MAX_Q: tl.constexpr, CACHE_BLOCK: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_CAUSAL_FLAGS: tl.constexpr):
    """Sequence i_b: (first query row, qlen, L, its causal flag (int; with
    HAS_CAUSAL_FLAGS only), on the decode path).
    L is capped at the block table's capacity (a longer seqused_k is bad input:
    the table is never read past its width)."""
    q_start = tl.load(cu_q_ptr + i_b).to(tl.int32)
    q_len = tl.load(cu_q_ptr + i_b + 1).to(tl.int32) - q_start
    seq_len = tl.minimum(tl.load(seqused_k_ptr + i_b).to(tl.int32), table_width * CACHE_BLOCK)
    causal = 1
    if HAS_CAUSAL_FLAGS:
        causal = (tl.load(causal_ptr + i_b) != 0).to(tl.int32)
    return q_start, q_len, seq_len, causal, (q_len >= 1) & (q_len <= MAX_Q)


@triton.jit
def _sequence_chunks(q_len, seq_len, chunk_min, max_chunks, HAS_WINDOW: tl.constexpr,
                     WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """The chunking rule: (lo, first chunk start, chunk length, chunk count).

    Keys [lo, L) are visible to some query of the sequence (lo = first query
    position - WINDOW with a window). From lo rounded down to a tile, chunks of
    chunk_min keys, doubled until there are at most max_chunks of them: a
    function of the sequence's own lengths and the config's constants only.
    """
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - q_len - WINDOW, 0)
    start = (lo // BLOCK_N) * BLOCK_N
    span = tl.maximum(seq_len - start, 0)
    chunk = chunk_min
    while (span + chunk - 1) // chunk > max_chunks:
        chunk = chunk * 2
    return lo, start, chunk, (span + chunk - 1) // chunk


@triton.jit
def _tanh(x):
    """tanh from exp2 (no libdevice): sign(x) (1 - e^-2|x|) / (1 + e^-2|x|)."""
    e = tl.math.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _tile_ids(bt_row, stride_bt_n, i_t, lo, hi, num_blocks, BLOCK_N: tl.constexpr,
              CACHE_BLOCK: tl.constexpr, ID_RUN: tl.constexpr, OFFS32: tl.constexpr):
    """[BLOCK_N] physical block of each key of tile i_t. Keys are clamped into
    [lo, hi) first (only live block-table entries are read, whatever tile is
    asked for), ids into [0, num_blocks) (a bad id never reads outside the cache)."""
    tok = tl.minimum(tl.maximum(i_t * BLOCK_N + tl.arange(0, BLOCK_N), lo), hi - 1)
    ids = tl.load(bt_row + (tok // CACHE_BLOCK) * stride_bt_n)
    ids = tl.minimum(tl.maximum(ids, 0), num_blocks - 1)
    if OFFS32:
        ids = ids.to(tl.int32)
    else:
        ids = ids.to(tl.int64)
    # tiles start at multiples of BLOCK_N: aligned runs of ID_RUN = gcd(BLOCK_N,
    # CACHE_BLOCK) keys share a block (clamping keeps that true)
    return tl.max_constancy(ids, ID_RUN)


@triton.jit
def _kv_tile(p, mask, KV_U8: tl.constexpr, DOT_TYPE: tl.constexpr):
    """A [BLOCK_N, BLOCK_D] K or V tile (masked load) as the dot's operand type."""
    x = tl.load(p, mask=mask, other=0.0)
    if KV_U8:
        x = x.to(tl.float8e4nv, bitcast=True)
    return x.to(DOT_TYPE)


@triton.jit
def _tile_step(acc, l_i, m_i, i_blk, i_t, b_q, p_pos, o_d, lo, seq_len, ctx, causal, qk_scale,
               softcap, alibi2, k_base, v_base,
               CAUSAL: tl.constexpr, HAS_CAUSAL_FLAGS: tl.constexpr, HAS_WINDOW: tl.constexpr,
               WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               ALIBI_SQRT: tl.constexpr, EVEN_D: tl.constexpr, HEAD_D: tl.constexpr,
               BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, KV_U8: tl.constexpr,
               DOT_TYPE: tl.constexpr,
               stride_kc_b: tl.constexpr, stride_kc_t: tl.constexpr,
               stride_vc_b: tl.constexpr, stride_vc_t: tl.constexpr):
    """Online softmax (base 2) over key tile i_t (block ids i_blk). Every tile
    is masked alike (keys outside [lo, L) are not loaded; the causal / window
    mask per row), so a tile's arithmetic never depends on which program
    takes it; on a tile every row sees whole, the mask keeps every score."""
    o_n = i_t * BLOCK_N + tl.arange(0, BLOCK_N)                       # [BLOCK_N] key positions
    m_n = (o_n >= lo) & (o_n < seq_len)
    o_t = tl.minimum(tl.maximum(o_n, lo), seq_len - 1) % CACHE_BLOCK
    m_kv = m_n[:, None]
    if not EVEN_D:
        m_kv = m_kv & (o_d < HEAD_D)[None, :]
    p_k = k_base + ((i_blk * stride_kc_b + o_t * stride_kc_t)[:, None] + o_d[None, :])
    b_k = _kv_tile(p_k, m_kv, KV_U8, DOT_TYPE)         # [BLOCK_N, BLOCK_D]
    # NOTE: fp32 products as three tf32 products ("tf32x3": near-fp32 accuracy
    # on the tensor cores); "ieee" unrolls an FMA loop whose code took ptxas
    # minutes at D 256 x 128 rows (offline sm_90 compile, a 51 MB LLVM IR)
    if DOT_TYPE == tl.float32:
        qk = tl.dot(b_q, tl.trans(b_k), input_precision="tf32x3")
    else:
        qk = tl.dot(b_q, tl.trans(b_k))                              # [ROWS, BLOCK_N] fp32
    s = qk * qk_scale
    if HAS_SOFTCAP:  # natural units here: cap, then to base 2
        s = softcap * _tanh(s / softcap) * LOG2E
    if HAS_ALIBI:
        if ALIBI_SQRT:
            rel = o_n[None, :] - p_pos[:, None]
            s = s + alibi2[:, None] * tl.where(
                rel <= 0, -tl.sqrt_rn(tl.maximum(-rel, 0).to(tl.float32)), 0.0)
        else:
            s = s + alibi2[:, None] * (o_n - ctx).to(tl.float32)[None, :]
    vis = m_n[None, :]
    if CAUSAL or HAS_CAUSAL_FLAGS or HAS_WINDOW:
        rel = o_n[None, :] - p_pos[:, None]                          # key - query position
        if HAS_CAUSAL_FLAGS:
            vis = vis & ((rel <= 0) | (causal == 0))
        elif CAUSAL:
            vis = vis & (rel <= 0)
        if HAS_WINDOW:
            vis = vis & (rel >= -WINDOW) & (rel <= WINDOW)
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, _max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + _sum(p, 1)
    p_v = v_base + ((i_blk * stride_vc_b + o_t * stride_vc_t)[:, None] + o_d[None, :])
    b_v = _kv_tile(p_v, m_kv, KV_U8, DOT_TYPE)
    acc = acc * alpha[:, None]
    if DOT_TYPE == tl.float32:
        acc = tl.dot(p, b_v, acc, input_precision="tf32x3")
    else:
        acc = tl.dot(p.to(DOT_TYPE), b_v, acc)                       # [ROWS, BLOCK_N] @ [BLOCK_N, BLOCK_D]
    return acc, l_i, m_new


@triton.jit
def _out_values(b_o, out_scale_ptr, OUT_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                FP8_MANT_BITS: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
                FP8_SUBNORMAL_MAGIC: tl.constexpr):
    """Final fp32 outputs as stored: with OUT_FP8, clamp(o / output_scale)
    rounded to e4m3's grid (the cast to e4m3 is then exact)."""
    if OUT_FP8:
        b_o = tl.math.div_rn(b_o, tl.load(out_scale_ptr).to(tl.float32))
        b_o = tl.clamp(b_o, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        b_o = round_to_fp8_grid(b_o, FP8_MANT_BITS, FP8_MIN_NORMAL, FP8_SUBNORMAL_MAGIC)
    return b_o


@triton.jit
def _store_partial(part_o_ptr, part_m_ptr, part_l_ptr, acc, m_i, l_i, v_scale, i_b, o_tok, o_h,
                   o_d, m_r, i_c, rows_per_seq, num_slots, NUM_Q_HEADS: tl.constexpr,
                   HEAD_D: tl.constexpr):
    """Chunk i_c's state of each (row, head): part_o [R, Hq, S, D] unnormalised
    output (v_scale applied), part_m / part_l [R, Hq, S] running max (base 2)
    and sum; R = B * rows_per_seq, S = num_slots."""
    slot = ((i_b * rows_per_seq + o_tok).to(tl.int64) * NUM_Q_HEADS + o_h) * num_slots + i_c
    tl.store(part_o_ptr + (slot[:, None] * HEAD_D + o_d[None, :]), acc * v_scale,
             mask=m_r[:, None] & (o_d < HEAD_D)[None, :])
    tl.store(part_m_ptr + slot, m_i, mask=m_r)
    tl.store(part_l_ptr + slot, l_i, mask=m_r)


@triton.jit
def _decode_pass(q_ptr, k_ptr, v_ptr, bt_row, stride_bt_n, num_blocks, alibi_ptr, sinks_ptr,
                 out_scale_ptr, out_ptr, part_o_ptr, part_m_ptr, part_l_ptr,
                 i_b, i_kvh, c_lo, c_hi, tok0, q_start, q_len, seq_len, causal, lo, start, chunk,
                 n_chunks, qk_scale, v_scale, softcap, rows_per_seq, num_slots,
                 ROWS: tl.constexpr, GROUP: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
                 HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                 CACHE_BLOCK: tl.constexpr, ID_RUN: tl.constexpr, OFFS32: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_CAUSAL_FLAGS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                 ALIBI_SQRT: tl.constexpr, HAS_SINKS: tl.constexpr, KV_U8: tl.constexpr,
                 DOT_TYPE: tl.constexpr, OUT_FP8: tl.constexpr,
                 FP8_MAX: tl.constexpr, FP8_MANT_BITS: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
                 FP8_SUBNORMAL_MAGIC: tl.constexpr,
                 stride_q_t: tl.constexpr, stride_q_h: tl.constexpr,
                 stride_o_t: tl.constexpr, stride_o_h: tl.constexpr,
                 stride_kc_b: tl.constexpr, stride_kc_t: tl.constexpr, stride_kc_h: tl.constexpr,
                 stride_vc_b: tl.constexpr, stride_vc_t: tl.constexpr, stride_vc_h: tl.constexpr):
    """Chunks [c_lo, c_hi) of the sequence, in one pipelined loop over their key
    tiles, for query tokens tok0 .. tok0 + ROWS // GROUP - 1 (ROWS rows:
    token-major, then the GROUP heads of kv head i_kvh). At each chunk's end
    its state is stored and the running state restarts, so a chunk's result
    is the same whichever program (and with whichever other chunks) takes it."""
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_D
    o_r = tl.arange(0, ROWS)
    o_tok = tok0 + o_r // GROUP                                       # [ROWS] token in the sequence
    o_h = i_kvh * GROUP + o_r % GROUP                                 # [ROWS] query head
    m_r = (o_r < (ROWS // GROUP) * GROUP) & (o_tok < q_len)
    o_d = tl.arange(0, BLOCK_D)
    ctx = seq_len - q_len
    p_pos = ctx + o_tok                                               # absolute query positions
    rows = (q_start + o_tok).to(tl.int64)
    b_q = tl.load(q_ptr + (rows[:, None] * stride_q_t + o_h[:, None] * stride_q_h + o_d[None, :]),
                  mask=m_r[:, None] & (o_d < HEAD_D)[None, :], other=0.0).to(DOT_TYPE)
    alibi2 = 0.0
    if HAS_ALIBI:
        alibi2 = tl.load(alibi_ptr + o_h).to(tl.float32) * LOG2E      # [ROWS]
    m_i = tl.full([ROWS], NEG_BIG, tl.float32)
    l_i = tl.full([ROWS], 0.0, tl.float32)
    if HAS_SINKS:
        sink2 = tl.load(sinks_ptr + o_h).to(tl.float32) * LOG2E
        if n_chunks == 1:  # one chunk: the sink joins here (else in the combine)
            m_i = tl.maximum(m_i, sink2)
            l_i = l_i + tl.math.exp2(sink2 - m_i)
    acc = tl.full([ROWS, BLOCK_D], 0.0, tl.float32)
    k_base = k_ptr + i_kvh * stride_kc_h
    v_base = v_ptr + i_kvh * stride_vc_h

    tiles_per_chunk = chunk // BLOCK_N
    t_begin = start // BLOCK_N + c_lo * tiles_per_chunk
    t_end = (tl.minimum(start + c_hi * chunk, seq_len) + BLOCK_N - 1) // BLOCK_N
    i_c = c_lo
    flush_at = t_begin + tiles_per_chunk                              # first tile of the next chunk
    # NOTE: block ids loaded one tile ahead (as in prefix_prefill): the K/V
    # addresses of a tile are ready when its iteration starts (H200, B64 x
    # 4096: 290 us with, 322 us without)
    ids_next = _tile_ids(bt_row, stride_bt_n, t_begin, lo, seq_len, num_blocks, BLOCK_N,
                         CACHE_BLOCK, ID_RUN, OFFS32)
    for i_t in range(t_begin, t_end):
        i_blk = ids_next
        ids_next = _tile_ids(bt_row, stride_bt_n, i_t + 1, lo, seq_len, num_blocks, BLOCK_N,
                             CACHE_BLOCK, ID_RUN, OFFS32)
        acc, l_i, m_i = _tile_step(
            acc, l_i, m_i, i_blk, i_t, b_q, p_pos, o_d, lo, seq_len, ctx, causal, qk_scale,
            softcap, alibi2, k_base, v_base, CAUSAL, HAS_CAUSAL_FLAGS, HAS_WINDOW, WINDOW,
            HAS_SOFTCAP, HAS_ALIBI, ALIBI_SQRT, EVEN_D, HEAD_D, BLOCK_N, CACHE_BLOCK, KV_U8,
            DOT_TYPE, stride_kc_b, stride_kc_t, stride_vc_b, stride_vc_t)
        if (i_t + 1 == flush_at) & (i_t + 1 < t_end):
            _store_partial(part_o_ptr, part_m_ptr, part_l_ptr, acc, m_i, l_i, v_scale, i_b, o_tok,
                           o_h, o_d, m_r, i_c, rows_per_seq, num_slots, NUM_Q_HEADS, HEAD_D)
            acc = tl.full([ROWS, BLOCK_D], 0.0, tl.float32)
            m_i = tl.full([ROWS], NEG_BIG, tl.float32)
            l_i = tl.full([ROWS], 0.0, tl.float32)
            i_c += 1
            flush_at += tiles_per_chunk

    if n_chunks == 1:
        # every live row sees at least one key (its own, when causal)
        b_o = acc * v_scale / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        b_o = _out_values(b_o, out_scale_ptr, OUT_FP8, FP8_MAX, FP8_MANT_BITS, FP8_MIN_NORMAL,
                          FP8_SUBNORMAL_MAGIC)
        p_o = out_ptr + (rows[:, None] * stride_o_t + o_h[:, None] * stride_o_h + o_d[None, :])
        tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_r[:, None] & (o_d < HEAD_D)[None, :])
    else:
        _store_partial(part_o_ptr, part_m_ptr, part_l_ptr, acc, m_i, l_i, v_scale, i_b, o_tok, o_h,
                       o_d, m_r, i_c, rows_per_seq, num_slots, NUM_Q_HEADS, HEAD_D)


@jit
def _unified_decode_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, cu_seqlens_q_ptr, seqused_k_ptr, block_table_ptr, causal_ptr,
    q_descale_ptr, k_descale_ptr, v_descale_ptr, alibi_ptr, sinks_ptr, out_scale_ptr, out_in_ptr,
    # runtime scalars: the block table's strides and width (they change with the
    # batch), the cache's block count, partial-state rows per sequence and chunk
    # slots per row (the scratch's shape: batch-dependent, so never constexprs);
    # the chunking rule's constants (config values: runtime, so that a sweep
    # does not recompile); chunks per program (the work split, chosen from the
    # batch: it never changes a result)
    stride_bt_b, stride_bt_n, table_width, num_blocks, rows_per_seq, num_slots, chunk_min,
    max_chunks, chunks_per_program,
    # output pointers
    out_ptr, part_o_ptr, part_m_ptr, part_l_ptr,
    # constexprs
    SCALE: tl.constexpr, SOFTCAP: tl.constexpr, NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    CACHE_BLOCK: tl.constexpr, ID_RUN: tl.constexpr, OFFS32: tl.constexpr, MAX_Q: tl.constexpr,
    ROWS_SMALL: tl.constexpr, ROWS_BIG: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_CAUSAL_FLAGS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    WINDOW: tl.constexpr, HAS_ALIBI: tl.constexpr, ALIBI_SQRT: tl.constexpr,
    HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr, KV_U8: tl.constexpr, Q_FP8: tl.constexpr,
    COMPUTE_F16: tl.constexpr, KV_F16: tl.constexpr,
    OUT_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    FP8_MANT_BITS: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_SUBNORMAL_MAGIC: tl.constexpr,
    # NOTE: strides are layout constants (constexprs, see
    # core_kernels._triton_utils.jit): 16-byte vector loads of the cache in
    # both launchers; descale strides (0, 0) for a scalar
    stride_q_t: tl.constexpr, stride_q_h: tl.constexpr,
    stride_o_t: tl.constexpr, stride_o_h: tl.constexpr,
    stride_kc_b: tl.constexpr, stride_kc_t: tl.constexpr, stride_kc_h: tl.constexpr,
    stride_vc_b: tl.constexpr, stride_vc_t: tl.constexpr, stride_vc_h: tl.constexpr,
    stride_kd_b: tl.constexpr, stride_kd_h: tl.constexpr,
    stride_vd_b: tl.constexpr, stride_vd_h: tl.constexpr,
):
    """One program: sequence program_id(0), kv head program_id(1), key chunks
    program_id(2) * chunks_per_program ... (+ chunks_per_program - 1); programs
    past the sequence's chunks exit at once.

    KV_F16: an fp8 cache's K / V (and q) enter the dots as fp16 (e4m3 converts
    to fp16 exactly, in one instruction per two values)."""
    i_b = tl.program_id(0)
    i_kvh = tl.program_id(1)
    i_p = tl.program_id(2)
    q_start, q_len, seq_len, causal, decode = _sequence(
        cu_seqlens_q_ptr, seqused_k_ptr, causal_ptr, i_b, table_width, MAX_Q, CACHE_BLOCK, CAUSAL,
        HAS_CAUSAL_FLAGS)
    lo, start, chunk, n_chunks = _sequence_chunks(q_len, seq_len, chunk_min, max_chunks,
                                                  HAS_WINDOW, WINDOW, BLOCK_N)
    # more chunks than the scratch holds only when max_seqlen_k was below a
    # sequence's length (bad input): wrong results, but no write out of bounds
    n_chunks = tl.minimum(n_chunks, num_slots)
    c_lo = i_p * chunks_per_program
    if decode & (c_lo < n_chunks):
        DOT_TYPE: tl.constexpr = (tl.float16 if KV_F16 else
                                  (tl.float16 if COMPUTE_F16 else tl.bfloat16) if Q_FP8
                                  else q_ptr.dtype.element_ty)
        c_hi = tl.minimum(c_lo + chunks_per_program, n_chunks)
        # scores in base 2 (natural units until the cap with a softcap)
        qk_scale = SCALE
        if not SOFTCAP > 0:
            qk_scale = qk_scale * LOG2E
        if Q_FP8:
            qk_scale = qk_scale * tl.load(q_descale_ptr).to(tl.float32)
        v_scale = 1.0
        if KV_FP8:
            qk_scale = qk_scale * tl.load(k_descale_ptr + i_b * stride_kd_b + i_kvh * stride_kd_h)
            v_scale = tl.load(v_descale_ptr + i_b * stride_vd_b + i_kvh * stride_vd_h)
        bt_row = block_table_ptr + i_b.to(tl.int64) * stride_bt_b
        TOK_SMALL: tl.constexpr = ROWS_SMALL // GROUP
        TOK_BIG: tl.constexpr = ROWS_BIG // GROUP
        # NOTE: the row count follows the sequence's own qlen (never the batch's
        # longest): the usual one-token decode fills a 16-row MMA tile
        if q_len <= TOK_SMALL:
            _decode_pass(
                q_ptr, k_ptr, v_ptr, bt_row, stride_bt_n, num_blocks, alibi_ptr, sinks_ptr,
                out_scale_ptr, out_ptr, part_o_ptr, part_m_ptr, part_l_ptr, i_b, i_kvh, c_lo, c_hi,
                0, q_start, q_len, seq_len, causal, lo, start, chunk, n_chunks, qk_scale, v_scale,
                SOFTCAP, rows_per_seq, num_slots, ROWS_SMALL, GROUP, NUM_Q_HEADS, HEAD_D, BLOCK_D,
                BLOCK_N, CACHE_BLOCK, ID_RUN, OFFS32, CAUSAL, HAS_CAUSAL_FLAGS, HAS_WINDOW, WINDOW,
                SOFTCAP > 0, HAS_ALIBI, ALIBI_SQRT, HAS_SINKS, KV_U8, DOT_TYPE, OUT_FP8,
                FP8_MAX, FP8_MANT_BITS, FP8_MIN_NORMAL, FP8_SUBNORMAL_MAGIC,
                stride_q_t, stride_q_h, stride_o_t, stride_o_h,
                stride_kc_b, stride_kc_t, stride_kc_h, stride_vc_b, stride_vc_t, stride_vc_h)
        else:
            # more tokens than one pass holds only when GROUP * MAX_Q > ROWS_BIG
            for tok0 in range(0, q_len, TOK_BIG):
                _decode_pass(
                    q_ptr, k_ptr, v_ptr, bt_row, stride_bt_n, num_blocks, alibi_ptr, sinks_ptr,
                    out_scale_ptr, out_ptr, part_o_ptr, part_m_ptr, part_l_ptr, i_b, i_kvh, c_lo,
                    c_hi, tok0, q_start, q_len, seq_len, causal, lo, start, chunk, n_chunks,
                    qk_scale, v_scale, SOFTCAP, rows_per_seq, num_slots, ROWS_BIG, GROUP,
                    NUM_Q_HEADS, HEAD_D, BLOCK_D, BLOCK_N, CACHE_BLOCK, ID_RUN, OFFS32, CAUSAL,
                    HAS_CAUSAL_FLAGS, HAS_WINDOW, WINDOW, SOFTCAP > 0, HAS_ALIBI, ALIBI_SQRT,
                    HAS_SINKS, KV_U8, DOT_TYPE, OUT_FP8, FP8_MAX, FP8_MANT_BITS,
                    FP8_MIN_NORMAL, FP8_SUBNORMAL_MAGIC,
                    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
                    stride_kc_b, stride_kc_t, stride_kc_h, stride_vc_b, stride_vc_t, stride_vc_h)


@jit
def _unified_decode_combine_kernel(
    # input pointers
    cu_seqlens_q_ptr, seqused_k_ptr, sinks_ptr, out_scale_ptr, part_o_ptr, part_m_ptr,
    part_l_ptr, out_in_ptr,
    # runtime scalars (as the decode kernel's)
    table_width, rows_per_seq, num_slots, chunk_min, max_chunks,
    # output pointers
    out_ptr,
    # constexprs
    NUM_Q_HEADS: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, MAX_Q: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_WINDOW: tl.constexpr, WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    OUT_FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MANT_BITS: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr, FP8_SUBNORMAL_MAGIC: tl.constexpr,
    stride_o_t: tl.constexpr, stride_o_h: tl.constexpr,
):
    """Merge the chunks of sequence program_id(0), query head program_id(1), in
    chunk order, for each of its query tokens; sequences of one chunk (written
    by the decode kernel) exit at once. BLOCK_S (>= max_chunks) is a constant:
    the sums' order never depends on the batch."""
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    q_start, q_len, seq_len, causal, decode = _sequence(
        cu_seqlens_q_ptr, seqused_k_ptr, cu_seqlens_q_ptr, i_b, table_width, MAX_Q, CACHE_BLOCK,
        True, False)
    lo, start, chunk, n_chunks = _sequence_chunks(q_len, seq_len, chunk_min, max_chunks,
                                                  HAS_WINDOW, WINDOW, BLOCK_N)
    # more chunks than the scratch holds only when max_seqlen_k was below a
    # sequence's length (bad input): wrong results, but no write out of bounds
    n_chunks = tl.minimum(n_chunks, num_slots)
    if decode & (n_chunks > 1):
        o_s = tl.arange(0, BLOCK_S)
        m_s = o_s < n_chunks
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < HEAD_D
        sink2 = NEG_BIG
        if HAS_SINKS:
            sink2 = tl.load(sinks_ptr + i_h).to(tl.float32) * LOG2E
        for i_q in range(0, q_len):
            base = ((i_b * rows_per_seq + i_q).to(tl.int64) * NUM_Q_HEADS + i_h) * num_slots
            b_m = tl.load(part_m_ptr + base + o_s, mask=m_s, other=NEG_BIG)       # [BLOCK_S]
            b_l = tl.load(part_l_ptr + base + o_s, mask=m_s, other=0.0)
            m = tl.maximum(_max(b_m, 0), sink2)
            w = tl.math.exp2(b_m - m)
            w = tl.where(m_s, w, 0.0)
            den = _sum(w * b_l, 0)
            if HAS_SINKS:
                den = den + tl.math.exp2(sink2 - m)
            b_o = tl.load(part_o_ptr + ((base + o_s)[:, None] * HEAD_D + o_d[None, :]),
                          mask=m_s[:, None] & m_d[None, :], other=0.0)             # [BLOCK_S, BLOCK_D]
            o = _sum(w[:, None] * b_o, 0) / tl.where(den > 0.0, den, 1.0)          # [BLOCK_D]
            row = (q_start + i_q).to(tl.int64)
            o = _out_values(o, out_scale_ptr, OUT_FP8, FP8_MAX, FP8_MANT_BITS, FP8_MIN_NORMAL,
                            FP8_SUBNORMAL_MAGIC)
            tl.store(out_ptr + row * stride_o_t + i_h * stride_o_h + o_d,
                     o.to(out_ptr.dtype.element_ty), mask=m_d)

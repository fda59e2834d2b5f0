"""Triton kernel for context_attention_fwd (prefix prefill over a paged KV cache).

One program computes a [BLOCK_M, D] tile of output rows of one query head of
one sequence with a flash-attention forward: online softmax in base 2 (the
softmax scale and log2(e) folded into one multiplier), fp32 accumulation, and
key tiles of BLOCK_N tokens taken first from the paged cache (the context),
then from k/v (the new tokens).

For each of the two key sources the visible key range of the row tile is
split into three runs of tiles: [masked | full | masked]. Full tiles are
visible to every row of the tile (inside the context, causal for every row,
inside the window for every row): they need no mask and no bounds, which is
the hot loop. Masked tiles carry the causal / window / bounds mask, and their
loads are masked too, so cache tokens that no row of the tile can see are
never read (stale NaN there cannot leak, unused block-table slots are never
dereferenced). Tiles outside the visible range are skipped entirely.
"""
import triton
import triton.language as tl

from .._triton_utils import jit, round_to_fp8_grid

# Finite "minus infinity" for the running max: keeps exp2(m_old - m_new) and
# exp2(-inf - m) free of inf - inf while a row has seen no visible key yet.
NEG_BIG = tl.constexpr(-1.0e30)
LOG2E = tl.constexpr(1.4426950408889634)


# NOTE: tl.max / tl.sum / tl.zeros are themselves @triton.jit functions, which
# core_kernels._interpret cannot swap for interpreted copies; tl.reduce with
# the same combine functions is what they expand to on the GPU, and the
# interpreter runs those combine functions as vectorised numpy reductions.
@triton.jit
def _row_max(x):
    return tl.reduce(x, 1, tl.standard._elementwise_max)


@triton.jit
def _row_sum(x):
    return tl.reduce(x, 1, tl.standard._sum_combine)


@triton.jit
def _softcap2(s, SOFTCAP2: tl.constexpr):
    """SOFTCAP2 * tanh(s / SOFTCAP2) (scores and cap in log2 units: c * log2(e)),
    with tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-cap, never inf / inf."""
    e = tl.math.exp2(s * (2.0 * LOG2E / SOFTCAP2))
    return SOFTCAP2 - (2.0 * SOFTCAP2) / (e + 1.0)


@triton.jit
def _flat_seq(b_start_loc_ptr, j, nseq, TOKENS: tl.constexpr):
    """The last sequence b < nseq whose first tile slot b_start_loc[b] // TOKENS
    + b is at most j (binary search; slot 0 belongs to sequence 0)."""
    lo = j * 0
    hi = nseq + 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(b_start_loc_ptr + mid).to(tl.int32) // TOKENS + mid <= j:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _tile_runs(lo_key, hi_key, full_lo_key, full_hi_key, BLOCK_N: tl.constexpr):
    """Tile indices [t0, t1) masked, [t1, t2) full, [t2, t3) masked.

    Keys [lo_key, hi_key) are visible to some row, [full_lo_key, full_hi_key)
    to every row. All arguments are >= 0 (integer division of negative
    numbers rounds differently on the GPU and in the interpreter).
    """
    t0 = lo_key // BLOCK_N
    t3 = tl.maximum((hi_key + BLOCK_N - 1) // BLOCK_N, t0)
    t1 = tl.minimum(tl.maximum((full_lo_key + BLOCK_N - 1) // BLOCK_N, t0), t3)
    t2 = tl.maximum(tl.minimum(full_hi_key // BLOCK_N, t3), t1)
    return t0, t1, t2, t3


@triton.jit
def _tile_at(i_k, t_a, t_c, n_first):
    """Tile index of iteration i_k over the runs [t_a, t_a + n_first), [t_c, ...)."""
    return tl.where(i_k < n_first, t_a + i_k, t_c + (i_k - n_first))


@triton.jit
def _block_ids(b_loc_row, stride_bl_n, i_n, lo_key, hi_key, BLOCK_N: tl.constexpr,
               CACHE_BLOCK: tl.constexpr, ID_RUN: tl.constexpr, OFFS32: tl.constexpr,
               bt_base=0, BT_PTR: tl.constexpr = False, BLOCK_BYTES: tl.constexpr = 1):
    """[BLOCK_N] physical block of each token of key tile i_n (int32 when every
    cache offset fits in 31 bits, else int64). BT_PTR: the table holds the
    addresses of K cache blocks, (address - bt_base) // BLOCK_BYTES is the id.

    Tokens are clamped into the visible range [lo_key, hi_key): only live
    block-table slots are read, whatever tile index is asked for.
    """
    tok = tl.minimum(tl.maximum(i_n * BLOCK_N + tl.arange(0, BLOCK_N), lo_key), hi_key - 1)
    i_blk = tl.load(b_loc_row + (tok // CACHE_BLOCK) * stride_bl_n)
    if BT_PTR:
        i_blk = (i_blk.to(tl.int64) - bt_base) // BLOCK_BYTES
    if OFFS32:
        i_blk = i_blk.to(tl.int32)
    else:
        i_blk = i_blk.to(tl.int64)
    # tiles start at multiples of BLOCK_N, so aligned runs of ID_RUN =
    # gcd(BLOCK_N, CACHE_BLOCK) tokens share one physical block (clamping
    # keeps that true: a clamped token lands in its run's block)
    return tl.max_constancy(i_blk, ID_RUN)


@triton.jit
def _attend(
    acc, l_i, m_i, b_q, o_d, p_pos,
    t_a, t_b, t_c, t_d, lo_key, hi_key, pos_base, window, qk_scale2, alibi2, v_scale,
    k_base, v_base, stride_k_tok, stride_k_d, stride_v_tok, stride_v_d,
    b_loc_row, stride_bl_n,
    stride_kc_b, stride_kc_dx, stride_vc_b, stride_vc_d,
    FROM_CACHE: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_ALIBI: tl.constexpr, EVEN_D: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, X: tl.constexpr,
    ID_RUN: tl.constexpr, KV_FP8: tl.constexpr, FP8_TYPE: tl.constexpr,
    DOT_TYPE: tl.constexpr, KC_STRIDE_T: tl.constexpr, KC_STRIDE_X: tl.constexpr,
    VC_STRIDE_T: tl.constexpr, PREFETCH_IDS: tl.constexpr, OFFS32: tl.constexpr,
    DENSE: tl.constexpr, CAUSAL: tl.constexpr = False, V_PACK: tl.constexpr = 0,
    bt_base=0, BT_PTR: tl.constexpr = False, BLOCK_BYTES: tl.constexpr = 1,
    causal_rt=1, alibi_base=0, RT_CAUSAL: tl.constexpr = False, SYM_WINDOW: tl.constexpr = False,
    SOFTCAP2: tl.constexpr = 0.0, ALIBI_MODE: tl.constexpr = 0,
):
    """Online softmax over the key tiles [t_a, t_b) and [t_c, t_d) of one source.

    unified_attention's options (off for context_attention_fwd): RT_CAUSAL, the
    mask is causal where the runtime flag ``causal_rt`` is set; SYM_WINDOW, the
    window also bounds keys after the query (|key - query| < window); SOFTCAP2 >
    0, scores capped (before ALiBi); ALIBI_MODE 1, the bias is slope * (key -
    alibi_base), 2: -slope * sqrt(query - key) for keys up to the query, else 0
    (0: slope * (key - query))."""
    m_d = o_d < HEAD_D
    n_first = t_b - t_a
    ids_next = 0
    ids_next2 = 0
    if FROM_CACHE and not DENSE and PREFETCH_IDS > 0:
        # NOTE: block ids are loaded PREFETCH_IDS tiles ahead into registers.
        # Loaded in the same iteration, the pipeliner turns them into cp.async
        # groups queued between K/V groups, and waiting for the ids (needed for
        # the K/V addresses) also waits for the K/V copies ahead of them
        # (1 tile ahead: 12% faster on the H200 with BLOCK_N=64; see plan.py).
        ids_next = _block_ids(b_loc_row, stride_bl_n, _tile_at(0, t_a, t_c, n_first),
                              lo_key, hi_key, BLOCK_N, CACHE_BLOCK, ID_RUN, OFFS32,
                              bt_base, BT_PTR, BLOCK_BYTES)
        if PREFETCH_IDS > 1:
            ids_next2 = _block_ids(b_loc_row, stride_bl_n, _tile_at(1, t_a, t_c, n_first),
                                   lo_key, hi_key, BLOCK_N, CACHE_BLOCK, ID_RUN, OFFS32,
                                   bt_base, BT_PTR, BLOCK_BYTES)
    for i_k in range(0, n_first + (t_d - t_c)):
        i_n = _tile_at(i_k, t_a, t_c, n_first)
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] key index in its source
        if MASKED:
            m_n = (o_n >= lo_key) & (o_n < hi_key)
            m_kt = m_n[None, :]
            m_v = m_n[:, None]
            if not EVEN_D:
                m_kt = m_kt & m_d[:, None]
                m_v = m_v & m_d[None, :]
        else:
            m_kt = m_d[:, None]
            m_v = m_d[None, :]
        if not DENSE:
            tok = o_n
            if MASKED:
                # clamp into the visible range: only live block-table slots are read
                tok = tl.minimum(tl.maximum(o_n, lo_key), hi_key - 1)
            if PREFETCH_IDS > 1:
                i_blk = ids_next
                ids_next = ids_next2
                ids_next2 = _block_ids(b_loc_row, stride_bl_n, _tile_at(i_k + 2, t_a, t_c, n_first),
                                       lo_key, hi_key, BLOCK_N, CACHE_BLOCK, ID_RUN, OFFS32,
                                       bt_base, BT_PTR, BLOCK_BYTES)
            elif PREFETCH_IDS > 0:
                i_blk = ids_next
                ids_next = _block_ids(b_loc_row, stride_bl_n, _tile_at(i_k + 1, t_a, t_c, n_first),
                                      lo_key, hi_key, BLOCK_N, CACHE_BLOCK, ID_RUN, OFFS32,
                                      bt_base, BT_PTR, BLOCK_BYTES)
            else:
                i_blk = _block_ids(b_loc_row, stride_bl_n, i_n, lo_key, hi_key, BLOCK_N,
                                   CACHE_BLOCK, ID_RUN, OFFS32,
                                   bt_base, BT_PTR, BLOCK_BYTES)
            o_t = tok % CACHE_BLOCK
            # NOTE: per-token and per-channel offsets are summed first and added
            # to the pointer once (int32 when the plan proved every cache offset
            # fits): fewer 64-bit address ops in the loop than one addptr per term.
            # [HEAD_D, BLOCK_N] from [num_blocks, Hkv, D // X, block_size, X]
            o_kn = i_blk * stride_kc_b + o_t * KC_STRIDE_T            # [BLOCK_N]
            o_kd = (o_d // X) * stride_kc_dx + (o_d % X) * KC_STRIDE_X  # [BLOCK_D]
            p_kt = k_base + (o_kn[None, :] + o_kd[:, None])
            if V_PACK > 0:
                # [BLOCK_N, HEAD_D] from [num_blocks, Hkv, block_size // V_PACK, D, V_PACK]
                o_vn = (i_blk * stride_vc_b + (o_t // V_PACK) * (HEAD_D * V_PACK)
                        + o_t % V_PACK)
                p_v = v_base + (o_vn[:, None] + (o_d * V_PACK)[None, :])
            else:
                # [BLOCK_N, HEAD_D] from [num_blocks, Hkv, D, block_size]
                o_vn = i_blk * stride_vc_b + o_t * VC_STRIDE_T
                p_v = v_base + (o_vn[:, None] + (o_d * stride_vc_d)[None, :])
        else:
            o_n64 = o_n.to(tl.int64)
            p_kt = k_base + o_n64[None, :] * stride_k_tok + o_d[:, None] * stride_k_d
            p_v = v_base + o_n64[:, None] * stride_v_tok + o_d[None, :] * stride_v_d
        if MASKED or not EVEN_D:
            b_kt = tl.load(p_kt, mask=m_kt, other=0.0)  # [BLOCK_D, BLOCK_N]
        else:
            b_kt = tl.load(p_kt)
        if FROM_CACHE and KV_FP8 and not DENSE:
            b_kt = b_kt.to(FP8_TYPE, bitcast=True).to(DOT_TYPE)
        # NOTE: fp32 with ALiBi multiplies in exact fp32, as vLLM's ALiBi kernel
        # does (its fp32 ALiBi test asks for 1e-6; tf32 failed it); otherwise fp32
        # products run in tf32 (the spec allows it)
        if HAS_ALIBI and DOT_TYPE == tl.float32:
            qk = tl.dot(b_q, b_kt, input_precision="ieee")
        else:
            qk = tl.dot(b_q, b_kt)  # [BLOCK_M, BLOCK_D] @ [BLOCK_D, BLOCK_N] -> fp32
        s = qk * qk_scale2
        if SOFTCAP2 > 0:
            s = _softcap2(s, SOFTCAP2)
        if HAS_ALIBI or MASKED:
            t_pos = pos_base + o_n
            rel = t_pos[None, :] - p_pos[:, None]  # [BLOCK_M, BLOCK_N] key pos - query pos
            if HAS_ALIBI:
                if ALIBI_MODE == 1:
                    s = s + alibi2[:, None] * (t_pos - alibi_base).to(tl.float32)[None, :]
                elif ALIBI_MODE == 2:
                    s = s + alibi2[:, None] * tl.where(rel <= 0, -tl.sqrt_rn(tl.maximum(-rel, 0).to(tl.float32)), 0.0)
                else:
                    s = s + alibi2[:, None] * rel.to(tl.float32)
            if MASKED:
                vis = m_n[None, :]
                if CAUSAL:
                    vis = vis & (rel <= 0)
                if RT_CAUSAL:
                    vis = vis & ((rel <= 0) | (causal_rt == 0))
                if HAS_WINDOW:
                    vis = vis & (rel > -window)
                    if SYM_WINDOW:  # no causal row sees a later key anyway
                        vis = vis & (rel < window)
                s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, _row_max(s))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + _row_sum(p)
        if MASKED or not EVEN_D:
            b_v = tl.load(p_v, mask=m_v, other=0.0)  # [BLOCK_N, BLOCK_D]
        else:
            b_v = tl.load(p_v)
        if FROM_CACHE and KV_FP8:
            if not DENSE:  # the gather kernel already widened the fp8 values (exactly)
                b_v = b_v.to(FP8_TYPE, bitcast=True).to(DOT_TYPE)
            p = p * v_scale  # dequantise V through P: the new tokens' V is unscaled
        acc = acc * alpha[:, None]
        if HAS_ALIBI and DOT_TYPE == tl.float32:
            acc = tl.dot(p.to(DOT_TYPE), b_v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(DOT_TYPE), b_v, acc)  # [BLOCK_M, BLOCK_N] @ [BLOCK_N, BLOCK_D]
        m_i = m_new
    return acc, l_i, m_i


@jit
def _prefix_prefill_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr,
    b_loc_ptr, b_start_loc_ptr, b_seq_len_ptr,
    k_scale_ptr, v_scale_ptr, alibi_ptr, sinks_ptr, out_scale_ptr, out_in_ptr,
    k_scr_ptr, v_scr_ptr,
    # runtime scalars (the block table's strides and the scratch's tokens per
    # sequence: the table's width changes per batch)
    stride_bl_b, stride_bl_n, ctx_cap,
    # output pointers
    out_ptr,
    # constexprs
    QK_SCALE2: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr, X: tl.constexpr,
    ID_RUN: tl.constexpr, GROUP: tl.constexpr, PACK: tl.constexpr, PREFETCH_IDS: tl.constexpr,
    CACHE_DENSE: tl.constexpr, OFFS32: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_E5M2: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SKIP_DECODE: tl.constexpr, OUT_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    FP8_MANT_BITS: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUBNORMAL_MAGIC: tl.constexpr,
    # vLLM 0.33's options: IS_CAUSAL False lets every new token see all new
    # tokens of its sequence; CACHE_NEW (k = v = None) reads the new tokens'
    # K/V from the paged cache (positions ctx .. seq_len - 1) in the context
    # loop; V_PACK > 0: the V cache is [num_blocks, Hkv, block_size // V_PACK,
    # D, V_PACK] in memory (0: [num_blocks, Hkv, D, block_size])
    IS_CAUSAL: tl.constexpr, CACHE_NEW: tl.constexpr, V_PACK: tl.constexpr,
    # BT_PTR: b_loc holds device addresses of K cache blocks (0: unused), turned
    # into ids here: (address - k_cache_ptr) // BLOCK_BYTES (bytes per K block)
    BT_PTR: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    # unified_attention's options (core_kernels/unified_attention/prefill_plan.py),
    # all off (0 / False) for context_attention_fwd. They need CACHE_NEW, whose
    # unused k / v pointers then carry the per-sequence causal flags (CAUSAL_FLAGS,
    # [B]) and q's descale (Q_FP8, 1 element). MIN_Q > 0: sequences with fewer new
    # tokens exit (another launch has them). SOFTCAP2 > 0: scores capped at
    # c * log2(e) before ALiBi. ALIBI_MODE: see _attend. CAUSAL_FLAGS: causal per
    # sequence (IS_CAUSAL is then ignored). SYM_WINDOW: the window of a non-causal
    # row is symmetric. Q_FP8 1 / 2: q holds e4m3, multiplied in bf16 / fp16.
    # K/V descales: [B, Hkv] with strides (KS_STRIDE_B, KS_STRIDE_H) /
    # (VS_STRIDE_B, VS_STRIDE_H); all 0: one scalar. FLAT_GRID: axes 0 and 2 number
    # slots over the row tiles of all sequences (see the kernel's start).
    MIN_Q: tl.constexpr, SOFTCAP2: tl.constexpr, ALIBI_MODE: tl.constexpr,
    CAUSAL_FLAGS: tl.constexpr, SYM_WINDOW: tl.constexpr, Q_FP8: tl.constexpr,
    KS_STRIDE_B: tl.constexpr, KS_STRIDE_H: tl.constexpr,
    VS_STRIDE_B: tl.constexpr, VS_STRIDE_H: tl.constexpr, FLAT_GRID: tl.constexpr,
    # NOTE: every tensor stride is a constexpr: a layout constant (fixed per
    # model and cache layout), which the integer policy allows (see
    # core_kernels._triton_utils.jit). As runtime ints they would never be
    # specialised on divisibility by 16 (the policy; jax-triton never does),
    # and the kernel lost the 16-byte vector loads of the cache: JAX's launch,
    # compiled that way while torch's launcher still specialised them, was
    # 1.2-1.5x slower on the H200, and the two disagreed in the last bit with
    # alibi (different FMA contraction). Constexprs give both launchers the
    # same, fully aligned kernel. Likewise a cache stride such as x = 8 must be
    # known to keep the 16-byte alignment of each x-vector.
    stride_q_t: tl.constexpr, stride_q_h: tl.constexpr, stride_q_d: tl.constexpr,
    stride_k_t: tl.constexpr, stride_k_h: tl.constexpr, stride_k_d: tl.constexpr,
    stride_v_t: tl.constexpr, stride_v_h: tl.constexpr, stride_v_d: tl.constexpr,
    stride_o_t: tl.constexpr, stride_o_h: tl.constexpr, stride_o_d: tl.constexpr,
    stride_kc_b: tl.constexpr, stride_kc_h: tl.constexpr, stride_kc_dx: tl.constexpr,
    KC_STRIDE_T: tl.constexpr, KC_STRIDE_X: tl.constexpr,
    stride_vc_b: tl.constexpr, stride_vc_h: tl.constexpr, stride_vc_d: tl.constexpr,
    VC_STRIDE_T: tl.constexpr,
):
    TOKENS: tl.constexpr = BLOCK_M // PACK  # query tokens per program
    i_hp = tl.program_id(1)       # PACK query heads i_hp * PACK ... that share one kv head
    i_kvh = (i_hp * PACK) // GROUP
    if FLAT_GRID:
        # NOTE: row tile i of sequence b has the slot b_start_loc[b] // TOKENS + b
        # + i: T // TOKENS + B slots cover every sequence's tiles however the
        # query lengths vary, where the (max tiles, heads, B) grid of a mixed
        # batch (one long prefill, many decodes) is mostly idle programs. The
        # grid is (n0, heads, B) with n0 * B >= the slots (axis 2 gives B);
        # slots are taken from the last down, n0 of them per head sweep, and
        # a binary search over b_start_loc finds each slot's sequence.
        j = (tl.num_programs(0) * tl.num_programs(2) - 1
             - (tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)))
        i_b = _flat_seq(b_start_loc_ptr, j, tl.num_programs(2), TOKENS)
        i_m = j - (tl.load(b_start_loc_ptr + i_b).to(tl.int32) // TOKENS + i_b)
    else:
        # heaviest row tiles (the last ones: longest causal range) start first
        i_m = tl.num_programs(0) - 1 - tl.program_id(0)
        i_b = tl.program_id(2)

    q_start = tl.load(b_start_loc_ptr + i_b).to(tl.int32)
    q_len = tl.load(b_start_loc_ptr + i_b + 1).to(tl.int32) - q_start
    ctx_len = tl.load(b_seq_len_ptr + i_b).to(tl.int32) - q_len
    m0 = i_m * TOKENS                # first query token of this program
    run = m0 < q_len
    if SKIP_DECODE:
        run = run & (q_len != 1)
    if MIN_Q > 0:
        run = run & (q_len >= MIN_Q)
    if run:
        DOT_TYPE: tl.constexpr = (q_ptr.dtype.element_ty if Q_FP8 == 0 else
                                  (tl.float16 if Q_FP8 == 2 else tl.bfloat16))
        FP8_TYPE: tl.constexpr = tl.float8e5 if FP8_E5M2 else tl.float8e4nv
        EVEN_D: tl.constexpr = BLOCK_D == HEAD_D
        window = WINDOW
        # NOTE: GQA packing: the PACK query heads of one kv head are rows of
        # the same tile (row = token * PACK + head), so each K/V tile loaded
        # from the paged cache (block ids, gathers, address math) serves
        # PACK times more FLOPs.
        o_r = tl.arange(0, BLOCK_M)
        o_m = m0 + o_r // PACK                      # [BLOCK_M] query token in the sequence
        o_h = i_hp * PACK + o_r % PACK              # [BLOCK_M] query head
        o_d = tl.arange(0, BLOCK_D)
        m_m = o_m < q_len
        m_d = o_d < HEAD_D
        p_pos = ctx_len + o_m                       # absolute query positions
        rows = (q_start + o_m).to(tl.int64)
        p_q = (q_ptr + rows[:, None] * stride_q_t + o_h[:, None] * stride_q_h
               + o_d[None, :] * stride_q_d)
        b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        if Q_FP8 > 0:
            b_q = b_q.to(tl.float8e4nv, bitcast=True).to(DOT_TYPE)  # exact

        # base-2 softmax: exp(x) = exp2(x * log2(e))
        qk_scale2 = QK_SCALE2
        alibi2 = 0.0
        if HAS_ALIBI:
            alibi2 = tl.load(alibi_ptr + o_h).to(tl.float32) * LOG2E  # [BLOCK_M]
        v_scale = 1.0
        ctx_scale2 = qk_scale2
        if KV_FP8:
            if KS_STRIDE_B == 0 and KS_STRIDE_H == 0:
                ctx_scale2 = qk_scale2 * tl.load(k_scale_ptr).to(tl.float32)
            else:
                ctx_scale2 = qk_scale2 * tl.load(k_scale_ptr + i_b * KS_STRIDE_B
                                                 + i_kvh * KS_STRIDE_H).to(tl.float32)
            if VS_STRIDE_B == 0 and VS_STRIDE_H == 0:
                v_scale = tl.load(v_scale_ptr).to(tl.float32)
            else:
                v_scale = tl.load(v_scale_ptr + i_b * VS_STRIDE_B + i_kvh * VS_STRIDE_H).to(tl.float32)
        if Q_FP8 > 0:
            ctx_scale2 = ctx_scale2 * tl.load(v_ptr).to(tl.float32)  # q's descale
        causal_rt = 1
        if CAUSAL_FLAGS:
            causal_rt = (tl.load(k_ptr + i_b) != 0).to(tl.int32)
        m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        if HAS_SINKS:
            # the sink joins the denominator only: start the running state at it
            sink2 = tl.load(sinks_ptr + o_h).to(tl.float32) * LOG2E  # [BLOCK_M]
            m_i = tl.maximum(m_i, sink2)
            l_i = l_i + tl.math.exp2(sink2 - m_i)
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)

        r_last = tl.minimum(m0 + TOKENS, q_len) - 1  # last live token of this tile
        # ---- context keys (paged cache), positions 0 .. ctx_len - 1
        lo_key = 0
        full_lo = 0
        if HAS_WINDOW:
            lo_key = tl.maximum(ctx_len + m0 - window + 1, 0)
            full_lo = tl.maximum(ctx_len + r_last - window + 1, 0)
        hi_c = ctx_len
        full_hi_c = ctx_len
        if CACHE_NEW:  # the new tokens' keys follow the context in the cache
            if CAUSAL_FLAGS:
                hi_c = tl.where(causal_rt != 0, ctx_len + r_last + 1, ctx_len + q_len)
                full_hi_c = tl.where(causal_rt != 0, ctx_len + m0 + 1, ctx_len + q_len)
            elif IS_CAUSAL:
                hi_c = ctx_len + r_last + 1
                full_hi_c = ctx_len + m0 + 1
            else:
                hi_c = ctx_len + q_len
                full_hi_c = ctx_len + q_len
            if HAS_WINDOW and SYM_WINDOW:  # keys after the query, inside the window
                hi_c = tl.minimum(hi_c, ctx_len + r_last + window)
                full_hi_c = tl.minimum(full_hi_c, ctx_len + m0 + window)
        over = False
        if CACHE_DENSE:
            # the scratch holds ctx_cap tokens per sequence (sized from max_seq_len
            # when given): a longer sequence (max_seq_len below its length, device
            # data nobody checked) reads no further and gives NaN rows
            over = ctx_len + (q_len if CACHE_NEW else 0) > ctx_cap
            hi_c = tl.minimum(hi_c, ctx_cap)
            full_hi_c = tl.minimum(full_hi_c, ctx_cap)
        t0, t1, t2, t3 = _tile_runs(lo_key, hi_c, full_lo, full_hi_c, BLOCK_N)
        if CACHE_DENSE:
            # the context was gathered into [B, Hkv, ctx_cap, D] scratch
            # (_prefix_prefill_gather_kernel): dense tiles, like the new tokens
            scr_row = (i_b * NUM_KV_HEADS + i_kvh).to(tl.int64) * ctx_cap * HEAD_D
            kc_base = k_scr_ptr + scr_row
            vc_base = v_scr_ptr + scr_row
        else:
            kc_base = k_cache_ptr + i_kvh * stride_kc_h
            vc_base = v_cache_ptr + i_kvh * stride_vc_h
        b_loc_row = b_loc_ptr + i_b * stride_bl_b
        bt_base = 0
        if BT_PTR:
            bt_base = k_cache_ptr.to(tl.int64)
        k_base = k_ptr + q_start.to(tl.int64) * stride_k_t + i_kvh * stride_k_h
        v_base = v_ptr + q_start.to(tl.int64) * stride_v_t + i_kvh * stride_v_h
        # masked tiles first, then the full ones
        for masked in tl.static_range(2):
            acc, l_i, m_i = _attend(
                acc, l_i, m_i, b_q, o_d, p_pos,
                t0 if masked == 0 else t1, t1 if masked == 0 else t2,
                t2 if masked == 0 else t2, t3 if masked == 0 else t2,
                lo_key, hi_c, 0, window, ctx_scale2, alibi2, v_scale,
                kc_base, vc_base, HEAD_D, 1, HEAD_D, 1,
                b_loc_row, stride_bl_n, stride_kc_b, stride_kc_dx, stride_vc_b, stride_vc_d,
                True, masked == 0, HAS_WINDOW, HAS_ALIBI, EVEN_D, HEAD_D, BLOCK_N, CACHE_BLOCK,
                X, ID_RUN, KV_FP8, FP8_TYPE, DOT_TYPE, KC_STRIDE_T, KC_STRIDE_X, VC_STRIDE_T,
                PREFETCH_IDS, OFFS32, CACHE_DENSE, CACHE_NEW and IS_CAUSAL and not CAUSAL_FLAGS,
                V_PACK, bt_base, BT_PTR, BLOCK_BYTES, causal_rt, ctx_len, CAUSAL_FLAGS,
                SYM_WINDOW, SOFTCAP2, ALIBI_MODE)

        # ---- new keys (k, v), positions ctx_len .. ctx_len + q_len - 1; causal
        # unless IS_CAUSAL is off (already read from the cache with CACHE_NEW)
        lo_key = 0
        full_lo = 0
        if HAS_WINDOW:
            lo_key = tl.maximum(m0 - window + 1, 0)
            full_lo = tl.maximum(r_last - window + 1, 0)
        if IS_CAUSAL:
            hi_key = r_last + 1
            full_hi = m0 + 1
        else:
            hi_key = q_len
            full_hi = q_len
        t0, t1, t2, t3 = _tile_runs(lo_key, hi_key, full_lo, full_hi, BLOCK_N)
        for masked in tl.static_range(0 if CACHE_NEW else 2):
            acc, l_i, m_i = _attend(
                acc, l_i, m_i, b_q, o_d, p_pos,
                t0 if masked == 0 else t1, t1 if masked == 0 else t2,
                t2 if masked == 0 else t2, t3 if masked == 0 else t2,
                lo_key, hi_key, ctx_len, window, qk_scale2, alibi2, 1.0,
                k_base, v_base, stride_k_t, stride_k_d, stride_v_t, stride_v_d,
                b_loc_row, 0, 0, 0, 0, 0,
                False, masked == 0, HAS_WINDOW, HAS_ALIBI, EVEN_D, HEAD_D, BLOCK_N, CACHE_BLOCK,
                X, ID_RUN, KV_FP8, FP8_TYPE, DOT_TYPE, KC_STRIDE_T, KC_STRIDE_X, VC_STRIDE_T,
                PREFETCH_IDS, OFFS32, True, IS_CAUSAL, 0)

        # every live row sees at least itself, so l_i > 0 there; rows past the
        # sequence may see nothing (0 / 0): keep them quiet, they are never stored
        b_o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        if CACHE_DENSE:
            b_o = tl.where(over, float("nan"), b_o)
        if OUT_FP8:
            b_o = tl.math.div_rn(b_o, tl.load(out_scale_ptr).to(tl.float32))
            b_o = tl.clamp(b_o, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
            b_o = round_to_fp8_grid(b_o, FP8_MANT_BITS, FP8_MIN_NORMAL, FP8_SUBNORMAL_MAGIC)
        p_o = (out_ptr + rows[:, None] * stride_o_t + o_h[:, None] * stride_o_h
               + o_d[None, :] * stride_o_d)
        tl.store(p_o, b_o.to(out_ptr.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])


@jit
def _prefix_prefill_gather_kernel(
    # input pointers
    k_cache_ptr, v_cache_ptr, b_loc_ptr, b_start_loc_ptr, b_seq_len_ptr,
    # runtime scalars (ctx_cap = tokens per sequence in the scratch)
    stride_bl_b, stride_bl_n, ctx_cap,
    # output pointers: [B, Hkv, ctx_cap, D] each, in the cache dtype (q's for fp8)
    k_scr_ptr, v_scr_ptr,
    # constexprs
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, GATHER_N: tl.constexpr,
    CACHE_BLOCK: tl.constexpr, X: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, WINDOW: tl.constexpr, SKIP_DECODE: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_E5M2: tl.constexpr,
    stride_kc_b: tl.constexpr, stride_kc_h: tl.constexpr, stride_kc_dx: tl.constexpr,
    KC_STRIDE_T: tl.constexpr, KC_STRIDE_X: tl.constexpr,
    stride_vc_b: tl.constexpr, stride_vc_h: tl.constexpr, stride_vc_d: tl.constexpr,
    VC_STRIDE_T: tl.constexpr, CACHE_NEW: tl.constexpr, V_PACK: tl.constexpr,
    BT_PTR: tl.constexpr, BLOCK_BYTES: tl.constexpr,
    # unified_attention: sequences with fewer than MIN_Q new tokens are skipped (0: none)
    MIN_Q: tl.constexpr,
):
    """Copy the visible context of one sequence / kv head, GATHER_N tokens per
    program, from the paged cache into dense [token, D] rows. An fp8 cache is
    widened to the scratch's dtype (q's): exact, every fp8 value is a 16-bit
    float, and the scales stay in the attention kernel, so the result is the
    paged path's bit for bit. Only the tokens some query of the sequence can see are read and
    written; the attention kernel reads no others (same visibility bounds). With
    CACHE_NEW the new tokens' K/V (positions ctx_len .. seq_len - 1) are copied too."""
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = tl.program_id(2)
    q_len = tl.load(b_start_loc_ptr + i_b + 1).to(tl.int32) - tl.load(b_start_loc_ptr + i_b).to(tl.int32)
    ctx_len = tl.load(b_seq_len_ptr + i_b).to(tl.int32) - q_len
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx_len - WINDOW + 1, 0)  # window start of the first query row
    end = ctx_len
    if CACHE_NEW:
        end = ctx_len + q_len
    n0 = i_n * GATHER_N
    run = (q_len > 0) & (n0 < end) & (n0 + GATHER_N > lo)
    if SKIP_DECODE:
        run = run & (q_len != 1)
    if MIN_Q > 0:
        run = run & (q_len >= MIN_Q)
    if run:
        o_n = n0 + tl.arange(0, GATHER_N)
        o_d = tl.arange(0, BLOCK_D)
        m_n = (o_n >= lo) & (o_n < end) & (o_n < ctx_cap)
        m = m_n[:, None] & (o_d < HEAD_D)[None, :]
        tok = tl.minimum(tl.maximum(o_n, lo), end - 1)  # only live table slots are read
        i_blk = tl.load(b_loc_ptr + i_b * stride_bl_b + (tok // CACHE_BLOCK) * stride_bl_n).to(tl.int64)
        if BT_PTR:  # K cache block addresses -> ids
            i_blk = (i_blk - k_cache_ptr.to(tl.int64)) // BLOCK_BYTES
        o_t = tok % CACHE_BLOCK
        o_kn = i_blk * stride_kc_b + o_t * KC_STRIDE_T
        o_kd = (o_d // X) * stride_kc_dx + (o_d % X) * KC_STRIDE_X
        b_k = tl.load(k_cache_ptr + i_h * stride_kc_h + (o_kn[:, None] + o_kd[None, :]), mask=m)
        if V_PACK > 0:  # [num_blocks, Hkv, block_size // V_PACK, D, V_PACK]
            o_vn = i_blk * stride_vc_b + (o_t // V_PACK) * (HEAD_D * V_PACK) + o_t % V_PACK
            b_v = tl.load(v_cache_ptr + i_h * stride_vc_h + (o_vn[:, None] + (o_d * V_PACK)[None, :]),
                          mask=m)
        else:
            o_vn = i_blk * stride_vc_b + o_t * VC_STRIDE_T
            b_v = tl.load(v_cache_ptr + i_h * stride_vc_h + (o_vn[:, None] + (o_d * stride_vc_d)[None, :]),
                          mask=m)
        if KV_FP8:
            FP8_TYPE: tl.constexpr = tl.float8e5 if FP8_E5M2 else tl.float8e4nv
            b_k = b_k.to(FP8_TYPE, bitcast=True).to(k_scr_ptr.dtype.element_ty)
            b_v = b_v.to(FP8_TYPE, bitcast=True).to(v_scr_ptr.dtype.element_ty)
        row = (i_b * NUM_KV_HEADS + i_h).to(tl.int64) * ctx_cap + o_n  # [GATHER_N]
        o_s = row[:, None] * HEAD_D + o_d[None, :]
        tl.store(k_scr_ptr + o_s, b_k, mask=m)
        tl.store(v_scr_ptr + o_s, b_v, mask=m)

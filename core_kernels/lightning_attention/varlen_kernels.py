"""Triton kernel for lightning attention over packed variable-length sequences.

The recurrence and the chunk formulas are the prefill's (prefill_kernels.py), per
sequence b and head h with lambda = exp(-s_h):

    S_t = lambda * S_{t-1} + k_t^T v_t        (S_{-1} = kv_cache[slot_idx[b]], or 0)
    o_t = q_t S_t

Work items. The packed token axis [0, T) is cut at every multiple of the
segment length SEG (a plan-time integer) and at every sequence boundary; a work
item is one such piece of one sequence. Sequence b owns the items
[F(b), F(b + 1)) with F(b) = cu_seqlens[b] // SEG + b, so

    * F needs no prefix sum: a program finds its sequence by a binary search
      of F over cu_seqlens (device data, no host sync),
    * every sequence, even an empty one, owns at least one item (the one that
      writes its final state), and
    * there are F(B) = T // SEG + B items in all: the grid depends on T, B and
      SEG only, never on the lengths.

A sequence ending on a multiple of SEG owns one trailing empty item, which
exits at once. Without segmentation (SEGMENTED=False: SEG > T) item b is
sequence b.

Programs: one per (item, head, E-tile). The items of one sequence form a
chained scan exactly like the prefill's segments: each non-last item first sums
its own contribution L from k and v (phase 1), waits for its predecessor's end
state P (published through memory with a flag), publishes lambda^len P + L, and
then walks its tokens computing the outputs from P (phase 2). Tickets from an
atomic counter, item-major, make a program wait only on one that started
before it (no deadlock whatever the scheduling; in order under the interpreter).
"""
import triton
import triton.language as tl

from .._triton_utils import jit
from .prefill_kernels import (_chunk_step, _draw_ticket, _load_state, _publish_and_raise, _segment_contribution,
                              _store_state, _wait_for_flag)


@triton.jit
def _find_sequence(cu_ptr, w, num_seqs, seg_len, search_steps):
    """The sequence b owning work item w: the largest b < num_seqs with
    cu[b] // seg_len + b <= w (a binary search; search_steps >= bit_length(num_seqs))."""
    lo = w * 0
    hi = lo + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        go = tl.load(cu_ptr + mid).to(tl.int32) // seg_len + mid <= w
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@jit
def _lightning_varlen_kernel(
    # input pointers
    q_ptr, k_ptr, v_ptr, decay_ptr, cu_ptr, slot_ptr, cache_in_ptr,
    # runtime scalars
    num_heads, num_seqs, num_slots, head_k, head_v, seg_len, search_steps, stride_decay,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_cs, stride_ch, stride_cd, stride_pw, stride_ph, stride_pd,
    # output pointers
    o_ptr, state_ptr, pub_ptr, sync_ptr,
    # constexprs
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, N_E: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_E: tl.constexpr, HAS_CACHE: tl.constexpr, SEGMENTED: tl.constexpr,
    DOT_BF16: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr, OFFS_64: tl.constexpr,
    P1_T: tl.constexpr, P1_STAGES: tl.constexpr, SPLIT_STATE: tl.constexpr,
    HIST_BY_SEQ: tl.constexpr, REVERSE: tl.constexpr, HIST_SHIFT: tl.constexpr,
):
    """One program per (work item, head, E-tile), items in ticket order.

    state_ptr is the slot cache (HAS_CACHE: read through cache_in_ptr, the same
    buffer, and written in place at slot_idx[b]) or the final states [B, H, D, E].
    HIST_BY_SEQ (without a cache): sequence b starts from cache_in_ptr[b], a
    [B, H, D, E] array with the final states' strides.

    The backward (backward_plan.py) runs this recurrence on other operands, with
    the prefill kernel's two variants (prefill_kernels.py, _lightning_prefill_kernel):
    REVERSE walks each sequence from its last token to its first, HIST_SHIFT
    lets the starting state enter the first token undecayed (the first item's
    end decays it by lambda^(len - 1)).
    """
    # strides arrive divided by their alignment group ALIGN (core_kernels._triton_utils.jit)
    stride_qt, stride_qh, stride_kt, stride_kh = (stride_qt * ALIGN, stride_qh * ALIGN,
                                                  stride_kt * ALIGN, stride_kh * ALIGN)
    stride_vt, stride_vh, stride_ot, stride_oh = (stride_vt * ALIGN, stride_vh * ALIGN,
                                                  stride_ot * ALIGN, stride_oh * ALIGN)
    stride_cs, stride_ch, stride_cd = stride_cs * ALIGN, stride_ch * ALIGN, stride_cd * ALIGN
    stride_pw, stride_ph, stride_pd = stride_pw * ALIGN, stride_ph * ALIGN, stride_pd * ALIGN
    per_item = num_heads * N_E  # programs per work item
    ticket = _draw_ticket(sync_ptr, SEGMENTED)
    w = ticket // per_item
    r = ticket % per_item
    i_e = r % N_E
    i_h = (r // N_E).to(tl.int64)

    # ---- the work item: sequence i_b, tokens [seg_t0, seg_t1) of it
    if SEGMENTED:
        i_b = _find_sequence(cu_ptr, w, num_seqs, seg_len, search_steps)
    else:
        i_b = w
    seq_start = tl.load(cu_ptr + i_b).to(tl.int32)
    seq_len = tl.load(cu_ptr + i_b + 1).to(tl.int32) - seq_start
    if SEGMENTED:
        first_block = seq_start // seg_len
        j = w - (first_block + i_b)  # the item's index within its sequence
        seg_t0 = tl.maximum((first_block + j) * seg_len - seq_start, 0)
        seg_t1 = tl.minimum((first_block + j + 1) * seg_len - seq_start, seq_len)
        if (seg_t0 >= seg_t1) & (seq_len > 0):
            return  # the empty item after a sequence that ends on a multiple of seg_len
    else:
        j = w * 0
        seg_t0 = 0
        seg_t1 = seq_len
    is_last = seg_t1 >= seq_len

    s = tl.load(decay_ptr + i_h * stride_decay).to(tl.float32)
    s = tl.where(s > 1e30, 1e30, s)  # s = +inf (lambda = 0) without NaN: see prefill_kernels.py's NOTE

    o_t = tl.arange(0, BLOCK_T)
    o_d = tl.arange(0, BLOCK_D)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    # EVEN_*: all-true masks, folded away so that stores stay vectorized
    m_d = (o_d < head_k) | EVEN_D
    m_e = (o_e < head_v) | EVEN_E
    tok0 = seq_start.to(tl.int64)
    base_q = tok0 * stride_qt + i_h * stride_qh
    base_k = tok0 * stride_kt + i_h * stride_kh
    base_v = tok0 * stride_vt + i_h * stride_vh
    base_o = tok0 * stride_ot + i_h * stride_oh

    # ---- the starting state: only a sequence's first item reads its slot; slot -1
    # starts from zero; an id outside [-1, num_slots) (device data nobody checked)
    # starts from NaN, so that sequence's outputs are NaN and no slot is touched
    if HAS_CACHE:
        slot = tl.load(slot_ptr + i_b).to(tl.int64)
        valid = (slot >= 0) & (slot < num_slots)
        p_in = cache_in_ptr + tl.where(valid, slot, 0) * stride_cs + i_h * stride_ch
        b_s = _load_state(p_in, o_d, o_e, stride_cd, m_d & (valid & (j == 0)), m_e)
        b_s = tl.where((slot < -1) | (slot >= num_slots), float("nan"), b_s)
    elif HIST_BY_SEQ:
        b_s = _load_state(cache_in_ptr + i_b.to(tl.int64) * stride_cs + i_h * stride_ch, o_d, o_e, stride_cd,
                          m_d & (j == 0), m_e)
    else:
        b_s = tl.full([BLOCK_D, BLOCK_E], 0.0, tl.float32)
    b_s = b_s.to(tl.float32)

    if SEGMENTED:
        p_pub = pub_ptr + i_h * stride_ph
        b_l = tl.full([BLOCK_D, BLOCK_E], 0.0, tl.float32)
        if seg_t1 < seq_len:  # phase 1: this item's own contribution
            b_l = _segment_contribution(k_ptr, v_ptr, base_k, base_v, stride_kt, stride_vt, s, seq_len,
                                        seg_t0, seg_t1, o_d, o_e, m_d, m_e, P1_T, P1_STAGES,
                                        BLOCK_D, BLOCK_E, EVEN_D, EVEN_E, DOT_BF16, SPLIT_STATE,
                                        DOT_PRECISION, OFFS_64, REVERSE)
        if j > 0:  # look back: wait for the previous item's end state
            _wait_for_flag(sync_ptr + 1 + ticket - per_item)
            offs = (w - 1).to(tl.int64) * stride_pw + o_d.to(tl.int64)[:, None] * stride_pd + o_e[None, :]
            b_s = tl.load(p_pub + offs, mask=m_d[:, None] & m_e[None, :], other=0.0, cache_modifier=".cg")
        if seg_t1 < seq_len:  # publish this item's end state, then raise its flag
            if HIST_SHIFT:  # the first item's end: the history decayed one token less
                b_end = b_s * tl.exp(-s * (seg_t1 - seg_t0 - (j == 0).to(tl.int32)).to(tl.float32)) + b_l
            else:
                b_end = b_s * tl.exp(-s * (seg_t1 - seg_t0).to(tl.float32)) + b_l
            offs = w.to(tl.int64) * stride_pw + o_d.to(tl.int64)[:, None] * stride_pd + o_e[None, :]
            _publish_and_raise(p_pub + offs, b_end, m_d[:, None] & m_e[None, :], sync_ptr, ticket)

    # ---- phase 2: the outputs, chunk by chunk (the prefill kernel's chunk step, shared)
    q_decay = tl.exp(-s * (o_t + 1).to(tl.float32))
    diff = (o_t[:, None] - o_t[None, :]).to(tl.float32)
    causal_decay = tl.where(o_t[:, None] >= o_t[None, :], tl.exp(-s * diff), 0.0)
    for t0 in range(seg_t0, seg_t1, BLOCK_T):
        n_valid = tl.minimum(seg_t1 - t0, BLOCK_T)
        b_s = _chunk_step(q_ptr, k_ptr, v_ptr, o_ptr, base_q, base_k, base_v, base_o,
                          stride_qt, stride_kt, stride_vt, stride_ot, t0, n_valid, seq_len, b_s, s,
                          o_t, o_d, o_e, m_d, m_e, q_decay, causal_decay,
                          DOT_BF16, SPLIT_STATE, DOT_PRECISION, EVEN_D, EVEN_E, OFFS_64, REVERSE,
                          HIST_SHIFT)

    # NOTE: the destination is worked out again here rather than kept from before
    # the loop: the loop sits at the 255-register limit, and every value live across
    # it spilled (sm_90 ptxas: 40 bytes per thread with the slot's pointer and mask kept)
    if is_last:  # the last item holds the final state
        if HAS_CACHE:
            slot = tl.load(slot_ptr + i_b).to(tl.int64)
            # an empty sequence leaves its slot alone (its final state is the slot's)
            write = (slot >= 0) & (slot < num_slots) & (seq_len > 0)
            p_out = state_ptr + tl.where(write, slot, 0) * stride_cs + i_h * stride_ch
            _store_state(p_out, b_s, o_d, o_e, stride_cd, m_d & write, m_e)
        else:
            p_out = state_ptr + i_b.to(tl.int64) * stride_cs + i_h * stride_ch
            _store_state(p_out, b_s, o_d, o_e, stride_cd, m_d, m_e)

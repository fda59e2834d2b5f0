"""Triton kernels of context-parallel lightning attention (cp_plan.py).

With the sequence split into R equal shards of L tokens over R devices, shard r
needs the state before its first token, S_in(r). From the recurrence
S_t = lambda S_{t-1} + k_t^T v_t, the state after a run of L tokens that
starts from S is lambda^L S + C, with C = sum_i lambda^(L-1-i) k_i^T v_i the
run's own contribution (its end state from zero). So

    S_in(0) = S_hist (or 0),   S_in(r + 1) = lambda^L S_in(r) + C(r)

a scan over the shards (Horner's rule). Each device computes its C(r)
(_lightning_cp_partial_kernel, then _lightning_cp_scan_kernel over the
partial sums of its splits), the C(r) are all-gathered (the adapters' framework
collective), and every device walks the same scan (_lightning_cp_scan_kernel)
to its own S_in(r) and to the final state S_in(R). The backward is the same
scan walked from the last shard: the gradient of S_in(r) is
G(r) = sum_i lambda^(i+1) q_i^T dO_i (shard r's own outputs) + lambda^L G(r + 1).
"""
import triton
import triton.language as tl

from .._triton_utils import jit
from .prefill_kernels import _segment_contribution, _store_state


@jit
def _lightning_cp_partial_kernel(
    # input pointers
    k_ptr, v_ptr, decay_ptr,
    # runtime scalars
    num_heads, num_rows, seq_len, head_k, head_v, split_len, stride_decay,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_pb, stride_ph, stride_pp, stride_pd,
    # output pointers
    part_ptr,
    # constexprs
    BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, N_E: tl.constexpr, BLOCK_T: tl.constexpr,
    STAGES: tl.constexpr, EVEN_D: tl.constexpr, EVEN_E: tl.constexpr, DOT_BF16: tl.constexpr,
    SPLIT_STATE: tl.constexpr, DOT_PRECISION: tl.constexpr, OFFS_64: tl.constexpr,
    REVERSE: tl.constexpr, ALIGN: tl.constexpr,
):
    """One program per (split p, b, h, E-tile): part[b, h, p] = sum over the
    split's tokens t of lambda^(t1 - 1 - t) k_t^T v_t (t1: the split's end), the
    split's end state from zero. REVERSE: token t is row seq_len - 1 - t (the
    sequence walked from its end, as the prefill kernel's REVERSE)."""
    stride_kb, stride_kh, stride_kt = stride_kb * ALIGN, stride_kh * ALIGN, stride_kt * ALIGN
    stride_vb, stride_vh, stride_vt = stride_vb * ALIGN, stride_vh * ALIGN, stride_vt * ALIGN
    stride_pb, stride_ph = stride_pb * ALIGN, stride_ph * ALIGN
    stride_pp, stride_pd = stride_pp * ALIGN, stride_pd * ALIGN
    pid = tl.program_id(0)
    per_split = num_rows * num_heads * N_E
    i_p = pid // per_split
    r = pid % per_split
    i_e = r % N_E
    i_bh = r // N_E
    i_b = (i_bh // num_heads).to(tl.int64)
    i_h = (i_bh % num_heads).to(tl.int64)
    s = tl.load(decay_ptr + i_h * stride_decay).to(tl.float32)
    s = tl.where(s > 1e30, 1e30, s)  # lambda = 0 without NaN (prefill_kernels.py's NOTE)
    o_d = tl.arange(0, BLOCK_D)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    m_d = (o_d < head_k) | EVEN_D
    m_e = (o_e < head_v) | EVEN_E
    t0 = i_p * split_len
    t1 = tl.minimum(t0 + split_len, seq_len)
    b_l = _segment_contribution(k_ptr, v_ptr, i_b * stride_kb + i_h * stride_kh,
                                i_b * stride_vb + i_h * stride_vh, stride_kt, stride_vt, s, seq_len,
                                t0, t1, o_d, o_e, m_d, m_e, BLOCK_T, STAGES, BLOCK_D, BLOCK_E,
                                EVEN_D, EVEN_E, DOT_BF16, SPLIT_STATE, DOT_PRECISION, OFFS_64, REVERSE)
    p_part = part_ptr + i_b * stride_pb + i_h * stride_ph + i_p.to(tl.int64) * stride_pp
    _store_state(p_part, b_l, o_d, o_e, stride_pd, m_d, m_e)


@jit
def _lightning_cp_scan_kernel(
    # input pointers
    states_ptr, decay_ptr, init_ptr, stop_ptr,
    # runtime scalars
    num_heads, num_steps, step_len, last_len, tail_len, size_de, stride_step, stride_row, stride_decay,
    # output pointers
    prefix_ptr, total_ptr,
    # constexprs
    BLOCK: tl.constexpr, HAS_INIT: tl.constexpr, HAS_PREFIX: tl.constexpr, REVERSE: tl.constexpr,
):
    """Horner's rule over ``num_steps`` stacked [D, E] states of each (b, h) row,
    BLOCK elements per program: acc = init (or 0); for each step j in walk order,
    acc = lambda^len_j acc + states[j] (len_j = step_len, last_len for the last
    step walked); total = lambda^tail_len acc. HAS_PREFIX: ``prefix`` is acc just
    before step stop[0] is added. REVERSE walks the steps from the last.
    Element (row, x) of step j is states[j * stride_step + row * stride_row + x];
    init, prefix and total are contiguous [rows, size_de]."""
    i_bh = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < size_de
    i_h = i_bh % num_heads
    s = tl.load(decay_ptr + i_h * stride_decay).to(tl.float32)
    s = tl.where(s > 1e30, 1e30, s)
    if HAS_INIT:
        acc = tl.load(init_ptr + i_bh * size_de + o, mask=m, other=0.0).to(tl.float32)
    else:
        acc = tl.full([BLOCK], 0.0, tl.float32)
    pre = tl.full([BLOCK], 0.0, tl.float32)
    if HAS_PREFIX:
        stop = tl.load(stop_ptr)
    # "* 1.0", not ".to(tl.float32)": a length of 1 arrives as a Python int (both
    # launchers compile a runtime integer equal to 1 as a constant)
    step_decay = tl.exp(-s * (step_len * 1.0))
    last_decay = tl.exp(-s * (last_len * 1.0))
    for j in range(0, num_steps):
        if REVERSE:
            idx = num_steps - 1 - j
        else:
            idx = j
        if HAS_PREFIX:
            pre = tl.where(idx == stop, acc, pre)
        # i_bh * 0 + idx: an int64 (idx may be a Python int under the interpreter)
        x = tl.load(states_ptr + (i_bh * 0 + idx) * stride_step + i_bh * stride_row + o, mask=m, other=0.0)
        acc = acc * tl.where(j == num_steps - 1, last_decay, step_decay) + x
    if HAS_PREFIX:
        tl.store(prefix_ptr + i_bh * size_de + o, pre, mask=m)
    tl.store(total_ptr + i_bh * size_de + o, acc * tl.exp(-s * (tail_len * 1.0)), mask=m)

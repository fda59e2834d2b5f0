"""Experiment: where does lightning prefill's time go on the H200?

A stripped copy of the prefill loop (one program per (b, h, E-tile), no
segments, final state only, D and E powers of two) whose parts can be switched
off (intra-chunk products, q·S, the state update), and whose products can be
forced onto mma.sync (compiled with DISABLE_MMA_V3=1) instead of wgmma. Times each variant with the L2 flushed; the full variants are
checked against the production kernel.

    python3 -m benchmarks.experiments.exp_lightning_prefill   (GPU only)
"""
from __future__ import annotations

import json
import os
import sys

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, MMA2: tl.constexpr):
    # MMA2 only keys the compile cache: the variant is compiled with
    # DISABLE_MMA_V3=1 in the environment (mma.sync instead of wgmma)
    return tl.dot(a, b, acc)


@triton.jit
def _split(x):
    """fp32 -> (hi, lo) bf16 with hi + lo = x to ~16 bits."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot3(a_hi, a_lo, b_hi, b_lo, acc):
    acc = tl.dot(a_hi, b_hi, acc)
    acc = tl.dot(a_hi, b_lo, acc)
    return tl.dot(a_lo, b_hi, acc)


@triton.jit
def _exp_kernel(q_ptr, k_ptr, v_ptr, decay_ptr, o_ptr, kv_ptr, H, N,
                BLOCK_T: tl.constexpr, D: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr,
                DO_INTRA: tl.constexpr, DO_INTER: tl.constexpr, DO_STATE: tl.constexpr,
                MMA2: tl.constexpr, BF16: tl.constexpr, SPLIT: tl.constexpr = 0, OT: tl.constexpr = 0):
    N_E: tl.constexpr = E // BLOCK_E
    pid = tl.program_id(0)
    i_e = pid % N_E
    i_bh = pid // N_E
    i_h = i_bh % H
    s = tl.load(decay_ptr + i_h)
    o_t = tl.arange(0, BLOCK_T)
    o_d = tl.arange(0, D)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    base_qk = i_bh.to(tl.int64) * N * D
    base_v = i_bh.to(tl.int64) * N * E
    op_ty = tl.bfloat16 if BF16 else tl.float32
    b_s = tl.zeros([D, BLOCK_E], tl.float32)
    q_decay = tl.exp(-s * (o_t + 1).to(tl.float32))
    k_decay = tl.exp(-s * (BLOCK_T - 1 - o_t).to(tl.float32))
    diff = (o_t[:, None] - o_t[None, :]).to(tl.float32)
    causal = tl.where(o_t[:, None] >= o_t[None, :], tl.exp(-s * diff), 0.0)
    chunk_decay = tl.exp(-s * BLOCK_T)
    for c in range(0, N // BLOCK_T):
        rows = c * BLOCK_T + o_t
        b_q = tl.load(q_ptr + base_qk + rows.to(tl.int64)[:, None] * D + o_d[None, :]).to(op_ty)
        b_k = tl.load(k_ptr + base_qk + rows.to(tl.int64)[:, None] * D + o_d[None, :]).to(op_ty)
        b_v = tl.load(v_ptr + base_v + rows.to(tl.int64)[:, None] * E + o_e[None, :])
        b_o = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        if SPLIT == 3:  # every product as three bf16 products of hi/lo halves
            q_hi, q_lo = _split(b_q)
            k_hi, k_lo = _split(b_k)
            b_vf = b_v.to(tl.float32)
            v_hi, v_lo = _split(b_vf)
            b_qk = _dot3(q_hi, q_lo, tl.trans(k_hi), tl.trans(k_lo), tl.zeros([BLOCK_T, BLOCK_T], tl.float32))
            p_hi, p_lo = _split(b_qk * causal)
            b_o = _dot3(p_hi, p_lo, v_hi, v_lo, b_o)
            s_hi, s_lo = _split(b_s)
            b_o += _dot3(q_hi, q_lo, s_hi, s_lo, tl.zeros([BLOCK_T, BLOCK_E], tl.float32)) * q_decay[:, None]
            vd_hi, vd_lo = _split(b_vf * k_decay[:, None])
            b_s = _dot3(tl.trans(k_hi), tl.trans(k_lo), vd_hi, vd_lo, b_s * chunk_decay)
        elif OT:  # o^T = V^T P^T + (S^T Q^T) decay: M = E-tile, so wgmma even for 32-token chunks
            b_qk = tl.dot(b_q, tl.trans(b_k))
            p_t = tl.trans(b_qk * causal)                                  # [T_k, T_q]
            acc_t = tl.dot(tl.trans(b_v.to(tl.float32)), p_t)              # [E, T_q]
            acc_t2 = tl.dot(tl.trans(b_s), tl.trans(b_q))                  # [E, T_q]
            b_o = tl.trans(acc_t + acc_t2 * q_decay[None, :])
        elif DO_INTRA:
            b_qk = _dot(b_q, tl.trans(b_k), tl.zeros([BLOCK_T, BLOCK_T], tl.float32), MMA2)
            b_o = _dot((b_qk * causal).to(op_ty), b_v.to(op_ty), b_o, MMA2)
        else:
            b_o += b_v.to(tl.float32)
        if OT:
            pass
        elif DO_INTER and SPLIT == 4:  # q S from hi/lo halves too
            q_hi, q_lo = _split(b_q)
            s_hi, s_lo = _split(b_s)
            b_o += _dot3(q_hi, q_lo, s_hi, s_lo, tl.zeros([BLOCK_T, BLOCK_E], tl.float32)) * q_decay[:, None]
        elif DO_INTER and SPLIT != 3:
            b_o += _dot(b_q, b_s.to(op_ty), tl.zeros([BLOCK_T, BLOCK_E], tl.float32), MMA2) * q_decay[:, None]
        if DO_STATE and SPLIT != 3:
            if SPLIT == 1 or SPLIT == 2 or SPLIT == 4:  # fp32: k^T v_d from bf16 hi/lo halves
                b_vf = b_v.to(tl.float32) * k_decay[:, None]
                k_hi = b_k.to(tl.bfloat16)
                k_lo = (b_k - k_hi.to(tl.float32)).to(tl.bfloat16)
                v_hi = b_vf.to(tl.bfloat16)
                v_lo = (b_vf - v_hi.to(tl.float32)).to(tl.bfloat16)
                if SPLIT == 2:  # hi.lo + lo.hi as one product over a doubled contraction
                    a2 = tl.reshape(tl.permute(tl.join(k_hi, k_lo), (2, 0, 1)), (2 * BLOCK_T, D))
                    b2 = tl.reshape(tl.permute(tl.join(v_lo, v_hi), (2, 0, 1)), (2 * BLOCK_T, BLOCK_E))
                    acc = tl.dot(tl.trans(k_hi), v_hi, b_s * chunk_decay)
                    b_s = tl.dot(tl.trans(a2), b2, acc)
                else:
                    acc = tl.dot(tl.trans(k_hi), v_hi, b_s * chunk_decay)
                    acc = tl.dot(tl.trans(k_hi), v_lo, acc)
                    b_s = tl.dot(tl.trans(k_lo), v_hi, acc)
            else:
                b_vd = (b_v.to(tl.float32) * k_decay[:, None]).to(op_ty)
                b_s = _dot(tl.trans(b_k), b_vd, b_s * chunk_decay, MMA2)
        if not (DO_INTRA or DO_INTER or DO_STATE):  # keep q and k loads alive
            b_o += (tl.sum(b_q.to(tl.float32), 1) + tl.sum(b_k.to(tl.float32), 1))[:, None]
        tl.store(o_ptr + base_v + rows.to(tl.int64)[:, None] * E + o_e[None, :], b_o.to(o_ptr.dtype.element_ty))
    tl.store(kv_ptr + i_bh.to(tl.int64) * D * E + o_d[:, None] * E + o_e[None, :], b_s)


def variants():
    out = []
    for dt, t, be, w, st in (("bfloat16", 64, 32, 4, 2), ("float32", 32, 64, 8, 3)):
        for name, flags in (("full", (1, 1, 1)), ("no-intra", (0, 1, 1)), ("no-inter", (1, 0, 1)),
                            ("no-state", (1, 1, 0)), ("loads-only", (0, 0, 0)),
                            ("intra-only", (1, 0, 0)), ("state-only", (0, 0, 1))):
            out.append((dt, name, t, be, w, st, flags, 0, 0, 0))
        out.append((dt, "full-mma2", t, be, w, st, (1, 1, 1), 1, 0, 0))
    # bigger tiles / other shapes of the same loop
    for dt, t, be, w, st, sp, ot in (("float32", 32, 64, 8, 3, 1, 0), ("float32", 32, 64, 8, 3, 1, 1),
                                     ("float32", 32, 64, 4, 3, 1, 1), ("float32", 32, 64, 8, 2, 1, 1),
                                     ("float32", 32, 64, 8, 4, 1, 1), ("float32", 16, 64, 4, 4, 1, 1),
                                     ("float32", 32, 128, 8, 3, 1, 1)):
        out.append((dt, f"T{t}-E{be}-w{w}-s{st}-split{sp}" + ("-ot" if ot else ""), t, be, w, st, (1, 1, 1),
                    0, sp, ot))
    return out


def main():
    import torch
    from benchmarks import timing
    from adapters.torch import lightning_attention
    B, H, N, D = 1, 64, 4096, 128
    copy_bw = timing.copy_bandwidth()
    rows = []
    inputs = {}
    for dt in ("bfloat16", "float32"):
        tdt = getattr(torch, dt)
        q = torch.randn(B, H, N, D, device="cuda", dtype=tdt) * 0.3
        k = torch.randn(B, H, N, D, device="cuda", dtype=tdt) * 0.3
        v = torch.randn(B, H, N, D, device="cuda", dtype=tdt)
        ed = torch.rand(H, device="cuda") * 0.5 + 0.01
        ref, kv_ref = lightning_attention(q, k, v, ed, output_final_state_only=True)
        t_ref = timing.kernel_time_torch(lambda: lightning_attention(q, k, v, ed, output_final_state_only=True))
        isz = q.element_size()
        nbytes = B * H * N * 4 * D * isz
        rows.append(dict(dtype=dt, name="production", us=t_ref * 1e6,
                         x_floor=t_ref / (nbytes / copy_bw)))
        print(rows[-1], flush=True)
        inputs[dt] = (q, k, v, ed, ref, kv_ref, nbytes)
    only = os.environ.get("EXP_ONLY")
    for dt, name, t, be, w, st, (a, b_, c), d3, sp, ot in variants():
        if only and only not in name:
            continue
        q, k, v, ed, ref, kv_ref, nbytes = inputs[dt]
        o = torch.empty_like(v)
        kv = torch.empty(B, H, D, D, device="cuda", dtype=torch.float32)
        grid = (B * H * (D // be),)

        def call():
            _exp_kernel[grid](q, k, v, ed, o, kv, H, N, BLOCK_T=t, D=D, E=D, BLOCK_E=be,
                              DO_INTRA=a, DO_INTER=b_, DO_STATE=c, MMA2=d3, BF16=dt == "bfloat16", SPLIT=sp, OT=ot,
                              num_warps=w, num_stages=st)
        try:
            if d3:
                os.environ["DISABLE_MMA_V3"] = "1"
            try:
                call()
            finally:
                os.environ.pop("DISABLE_MMA_V3", None)
            torch.cuda.synchronize()
            tm = timing.kernel_time_torch(call)
            row = dict(dtype=dt, name=name, us=tm * 1e6, x_floor=tm / (nbytes / copy_bw))
            if (a, b_, c) == (1, 1, 1):
                err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                kerr = ((kv - kv_ref).norm() / kv_ref.norm()).item()
                row.update(rel_err=err, kv_rel_err=kerr)
        except Exception as exc:  # noqa: BLE001
            row = dict(dtype=dt, name=name, error=repr(exc)[:200])
        rows.append(row)
        print(row, flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "exp_lightning_prefill.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

"""Experiment: does Triton 3.6's automatic warp specialisation on Hopper
(``tl.range(..., warp_specialize=True)``: a TMA producer warpgroup and two
consumer warpgroups) speed up a plain flash-attention forward at the prefix
prefill's shape? Non-causal, dense K/V through on-device TMA descriptors, bf16,
D = 128; each form against torch SDPA for the result. Second part (``--part bs``):
the block-sparse prefill's loop shape, 64-row query tiles over a list of 64-key
blocks read from memory inside the loop (46 of 256 blocks per row, as the
Phi-3-small layout's longest rows), against a float32 reference. GPU only.

    python3 -m benchmarks.experiments.exp_prefix_ws_probe [--out DIR]
"""
import argparse
import json
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _fa_probe(q_ptr, k_ptr, v_ptr, o_ptr, NQ, NK, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              WS: tl.constexpr, SCALE2: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    dq = tl.make_tensor_descriptor(q_ptr + bh * NQ * D, [NQ, D], [D, 1], [BM, D])
    dk = tl.make_tensor_descriptor(k_ptr + bh * NK * D, [NK, D], [D, 1], [BN, D])
    dv = tl.make_tensor_descriptor(v_ptr + bh * NK * D, [NK, D], [D, 1], [BN, D])
    do = tl.make_tensor_descriptor(o_ptr + bh * NQ * D, [NQ, D], [D, 1], [BM, D])
    q = dq.load([pid_m * BM, 0])
    m_i = tl.full([BM], -1e30, tl.float32)
    l_i = tl.full([BM], 0.0, tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for n0 in tl.range(0, NK, BN, warp_specialize=WS):
        k = dk.load([n0, 0])
        s = tl.dot(q, k.T) * SCALE2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = dv.load([n0, 0])
        acc = tl.dot(p.to(tl.bfloat16), v, acc)
        m_i = m_new
    acc = acc / l_i[:, None]
    do.store([pid_m * BM, 0], acc.to(tl.bfloat16))


@triton.jit
def _bs_probe(q_ptr, k_ptr, v_ptr, o_ptr, col_ptr, NQ, NK, NCOL, D: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, WS: tl.constexpr, SCALE2: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    dq = tl.make_tensor_descriptor(q_ptr + bh * NQ * D, [NQ, D], [D, 1], [BM, D])
    dk = tl.make_tensor_descriptor(k_ptr + bh * NK * D, [NK, D], [D, 1], [BN, D])
    dv = tl.make_tensor_descriptor(v_ptr + bh * NK * D, [NK, D], [D, 1], [BN, D])
    do = tl.make_tensor_descriptor(o_ptr + bh * NQ * D, [NQ, D], [D, 1], [BM, D])
    q = dq.load([pid_m * BM, 0])
    m_i = tl.full([BM], -1e30, tl.float32)
    l_i = tl.full([BM], 0.0, tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    p_col = col_ptr + (bh * tl.num_programs(0) + pid_m) * NCOL
    for j in tl.range(0, NCOL, warp_specialize=WS):
        n0 = tl.load(p_col + j) * BN
        k = dk.load([n0, 0])
        s = tl.dot(q, k.T) * SCALE2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = dv.load([n0, 0])
        acc = tl.dot(p.to(tl.bfloat16), v, acc)
        m_i = m_new
    acc = acc / l_i[:, None]
    do.store([pid_m * BM, 0], acc.to(tl.bfloat16))


BS_FORMS = [(False, 4, 3, 64, 64), (False, 4, 2, 64, 64), (True, 4, 2, 64, 64), (True, 4, 3, 64, 64)]


def bs_part(rows):
    h, nq, nk, d, ncol = 32, 16384, 16384, 128, 46
    bn = 64
    q = torch.randn(h, nq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(h, nk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(h, nk, d, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cpu").manual_seed(0)
    cols = torch.stack([torch.randperm(nk // bn, generator=g)[:ncol].sort().values
                        for _ in range(h * nq // 64)]).to(torch.int32).cuda()
    flops = 4 * h * nq * ncol * bn * d
    # float32 reference for a few tiles of head 0
    scale2 = d ** -0.5 * 1.4426950408889634
    for ws, nw, ns, bm, bn_ in BS_FORMS:
        row = dict(form=f"bs ws{int(ws)} w{nw} s{ns} {bm}x{bn_}")
        o = torch.full_like(q, float("nan"))
        try:
            def call():
                _bs_probe[(nq // bm, h)](q, k, v, o, cols, nq, nk, ncol, D=d, BM=bm, BN=bn_, WS=ws,
                                         SCALE2=scale2, num_warps=nw, num_stages=ns)
            call()
            torch.cuda.synchronize()
            err = 0.0
            for t in (0, 7, nq // bm - 1):
                idx = (cols[t].long()[:, None] * bn_ + torch.arange(bn_, device="cuda")[None, :]).reshape(-1)
                qs = q[0, t * bm:(t + 1) * bm].float()
                att = torch.softmax(qs @ k[0, idx].float().T * d ** -0.5, -1) @ v[0, idx].float()
                err = max(err, float((o[0, t * bm:(t + 1) * bm].float() - att).abs().max()))
            row["max_err"] = err
            ms = triton.testing.do_bench(call, warmup=25, rep=200)
            row.update(ms=ms, tflops=flops / ms / 1e9)
        except Exception as e:  # noqa: BLE001
            row["error"] = str(e)[:300]
        print(row, flush=True)
        rows.append(row)


FORMS = [  # (warp_specialize, num_warps, num_stages, BM, BN)
    (False, 8, 3, 128, 64), (False, 8, 3, 128, 128), (False, 8, 2, 128, 128),
    (True, 4, 2, 128, 64), (True, 4, 3, 128, 64), (True, 4, 2, 128, 128), (True, 4, 4, 128, 64),
]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--part", default="prefix", choices=("prefix", "bs"))
    args = ap.parse_args(argv)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    if args.part == "bs":
        rows = []
        bs_part(rows)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "exp_prefix_ws_probe_bs.json"), "w") as f:
            json.dump(rows, f, indent=1)
        return
    b, h, nq, nk, d = 4, 32, 1024, 4096, 128
    q = torch.randn(b * h, nq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b * h, nk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b * h, nk, d, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v).float()
    flops = 4 * b * h * nq * nk * d
    sdpa_ms = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                                      warmup=25, rep=200)
    rows = [dict(form="torch sdpa", ms=sdpa_ms, tflops=flops / sdpa_ms / 1e9)]
    print(rows[-1], flush=True)
    scale2 = d ** -0.5 * 1.4426950408889634
    for ws, nw, ns, bm, bn in FORMS:
        o = torch.full_like(q, float("nan"))
        row = dict(form=f"ws{int(ws)} w{nw} s{ns} {bm}x{bn}")
        try:
            def call():
                _fa_probe[(nq // bm, b * h)](q, k, v, o, nq, nk, D=d, BM=bm, BN=bn, WS=ws, SCALE2=scale2,
                                             num_warps=nw, num_stages=ns)
            call()
            torch.cuda.synchronize()
            row["max_err"] = float((o.float() - ref).abs().max())
            ms = triton.testing.do_bench(call, warmup=25, rep=200)
            row.update(ms=ms, tflops=flops / ms / 1e9)
        except Exception as e:  # noqa: BLE001
            row["error"] = str(e)[:300]
        print(row, flush=True)
        rows.append(row)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "exp_prefix_ws_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

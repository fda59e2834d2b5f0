"""Experiment: does Triton 3.6's automatic warp specialisation on Hopper
(``tl.range(..., warp_specialize=True)``: a TMA producer warpgroup and two
consumer warpgroups) speed up a plain flash-attention forward at the prefix
prefill's shape? Non-causal, dense K/V through on-device TMA descriptors, bf16,
D = 128; each form against torch SDPA for the result. Second part (``--part bs``):
the block-sparse prefill's loop shape, 64-row query tiles over a list of 64-key
blocks read from memory inside the loop (46 of 256 blocks per row, as the
Phi-3-small layout's longest rows), against a float32 reference. Third part
(``--part causal``): the form a warp-specialised prefix kernel would need, one
head per tile (no GQA packing: its Q must come from a 2-D descriptor), one loop
over the context followed by the new tokens in one K/V region, the causal mask
applied to every tile; B 4 x 32 heads (8 KV heads) x 1024 new tokens over 4096
cached ones. GPU only.

    python3 -m benchmarks.experiments.exp_prefix_ws_probe [--out DIR]
"""
import argparse
import json
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _step(q, k, dv, n0, acc, l_i, m_i, SCALE2: tl.constexpr):
    """One key tile of the online softmax, unmasked: k loaded by the caller, V
    rows n0 .. from ``dv`` loaded after the scores (the order the probes were
    measured with; the compiled SASS is the same as with the step written out)."""
    s = tl.dot(q, k.T) * SCALE2
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = dv.load([n0, 0])
    acc = tl.dot(p.to(tl.bfloat16), v, acc)
    return acc, l_i, m_new


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
        acc, l_i, m_i = _step(q, k, dv, n0, acc, l_i, m_i, SCALE2)
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
        acc, l_i, m_i = _step(q, k, dv, n0, acc, l_i, m_i, SCALE2)
    acc = acc / l_i[:, None]
    do.store([pid_m * BM, 0], acc.to(tl.bfloat16))


@triton.jit
def _causal_probe(q_ptr, kv_ptr, o_ptr, NQ, CTX, HQ: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, WS: tl.constexpr, SCALE2: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    kvh = (bh % HQ) // GROUP
    NK = CTX + NQ
    region = (b * (HQ // GROUP) + kvh).to(tl.int64) * NK * D
    dq = tl.make_tensor_descriptor(q_ptr + bh.to(tl.int64) * NQ * D, [NQ, D], [D, 1], [BM, D])
    dk = tl.make_tensor_descriptor(kv_ptr + region, [NK, D], [D, 1], [BN, D])
    dv = tl.make_tensor_descriptor(kv_ptr + region + 4 * (HQ // GROUP) * NK * D, [NK, D], [D, 1], [BN, D])
    do = tl.make_tensor_descriptor(o_ptr + bh.to(tl.int64) * NQ * D, [NQ, D], [D, 1], [BM, D])
    q = dq.load([pid_m * BM, 0])
    q_pos = CTX + pid_m * BM + tl.arange(0, BM)
    o_n = tl.arange(0, BN)
    m_i = tl.full([BM], -1e30, tl.float32)
    l_i = tl.full([BM], 0.0, tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    hi = CTX + (pid_m + 1) * BM
    for i_n in tl.range(0, (hi + BN - 1) // BN, warp_specialize=WS):
        k = dk.load([i_n * BN, 0])
        s = tl.dot(q, k.T) * SCALE2
        s = tl.where((i_n * BN + o_n)[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = dv.load([i_n * BN, 0])
        acc = tl.dot(p.to(tl.bfloat16), v, acc)
        m_i = m_new
    acc = acc / l_i[:, None]
    do.store([pid_m * BM, 0], acc.to(tl.bfloat16))


CAUSAL_FORMS = [(False, 8, 3, 128, 64), (False, 8, 3, 128, 128), (True, 4, 2, 128, 128), (True, 4, 2, 128, 64)]


def causal_part(rows):
    b, hq, hkv, nq, ctx, d = 4, 32, 8, 1024, 4096, 128
    q = torch.randn(b * hq, nq, d, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, b * hkv, ctx + nq, d, device="cuda", dtype=torch.bfloat16)
    flops = 4 * b * hq * nq * (ctx + nq / 2) * d
    scale2 = d ** -0.5 * 1.4426950408889634
    # float32 reference for the last tile of head 5 of sequence 1
    bh, t, bm = 1 * hq + 5, nq // 128 - 1, 128
    kvh = 1 * hkv + 5 // (hq // hkv)
    qs = q[bh, t * bm:(t + 1) * bm].float()
    pos = ctx + t * bm + torch.arange(bm, device="cuda")
    sc = qs @ kv[0, kvh].float().T * d ** -0.5
    sc = sc.masked_fill(torch.arange(ctx + nq, device="cuda")[None, :] > pos[:, None], float("-inf"))
    ref = torch.softmax(sc, -1) @ kv[1, kvh].float()
    for ws, nw, ns, bm_, bn_ in CAUSAL_FORMS:
        row = dict(form=f"causal ws{int(ws)} w{nw} s{ns} {bm_}x{bn_}")
        o = torch.full_like(q, float("nan"))
        try:
            def call():
                _causal_probe[(nq // bm_, b * hq)](q, kv, o, nq, ctx, HQ=hq, GROUP=hq // hkv, D=d, BM=bm_,
                                                    BN=bn_, WS=ws, SCALE2=scale2, num_warps=nw, num_stages=ns)
            call()
            torch.cuda.synchronize()
            row["max_err"] = float((o[bh, t * bm:(t + 1) * bm].float() - ref).abs().max())
            row["all_finite"] = bool(torch.isfinite(o).all())
            ms = triton.testing.do_bench(call, warmup=25, rep=200)
            row.update(ms=ms, tflops=flops / ms / 1e9)
        except Exception as e:  # noqa: BLE001
            row["error"] = str(e)[:300]
        print(row, flush=True)
        rows.append(row)


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
    ap.add_argument("--part", default="prefix", choices=("prefix", "bs", "causal"))
    args = ap.parse_args(argv)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    if args.part in ("bs", "causal"):
        rows = []
        (bs_part if args.part == "bs" else causal_part)(rows)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"exp_prefix_ws_probe_{args.part}.json"), "w") as f:
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

"""Experiment: lightning decode at B=64, H=64, D=128 (bf16 q/k/v, fp32 cache).

Variants of the decode step S = lambda S + k^T v, o = q S against the
production kernel: one cache pointer for the load and the store (the cache is
updated in place, so the second pointer only costs registers), a register cap
(more programs per SM, more bytes in flight), and the grid order; plus the
roofline of the access itself: the cache scaled in place by a flat kernel
(no slots, no q/k/v), next to a copy, all timed the same way (CUDA graph,
rotating input sets) and by the benchmark's per-call timer. EXP_DECODE_SWEEP=0 skips the variant sweep.

    python3 -m benchmarks.experiments.exp_lightning_decode   (GPU only)
"""
from __future__ import annotations

import json
import os

import triton
import triton.language as tl


@triton.jit
def _exp_decode(q_ptr, k_ptr, v_ptr, cache_ptr, decay_ptr, slot_ptr, out_ptr, H, num_slots,
                D: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr, E_FAST: tl.constexpr):
    N_E: tl.constexpr = E // BLOCK_E
    if E_FAST:
        i_e = tl.program_id(0)
        i_bh = tl.program_id(1)
    else:
        i_e = tl.program_id(1)
        i_bh = tl.program_id(0)
    o_d = tl.arange(0, D)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs = o_d[:, None] * E + o_e[None, :]
    i_b = i_bh // H
    i_h = i_bh % H
    slot = tl.load(slot_ptr + i_b).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    s = tl.load(decay_ptr + i_h)
    b_q = tl.load(q_ptr + i_bh * D + o_d).to(tl.float32)
    b_k = tl.load(k_ptr + i_bh * D + o_d).to(tl.float32)
    b_v = tl.load(v_ptr + i_bh * E + o_e).to(tl.float32)
    base = cache_ptr + (tl.where(valid, slot, 0) * H + i_h) * (D * E)
    b_s = tl.load(base + offs, mask=valid, other=0.0)
    b_s = b_s * tl.exp(-s) + b_k[:, None] * b_v[None, :]
    tl.store(base + offs, b_s, mask=valid)
    b_o = tl.sum(b_q[:, None] * b_s, 0)
    b_o = tl.where(valid, b_o, 0.0)
    tl.store(out_ptr + i_bh * E + o_e, b_o.to(out_ptr.dtype.element_ty))


@triton.jit
def _exp_rmw(cache_ptr, a, BLOCK: tl.constexpr):
    """The decode's memory traffic alone: cache = a * cache + 1, in place."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(cache_ptr + offs, tl.load(cache_ptr + offs) * a + 1.0)


def main():
    import torch
    from benchmarks import timing
    from adapters.torch import linear_decode_forward_triton
    B, H, D = 64, 64, 128
    copy_bw = timing.copy_bandwidth()
    nbytes = 2 * B * H * D * D * 4
    sets = 4
    ins = []
    for _ in range(sets):
        q, k, v = (torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        cache = torch.randn(B, H, D, D, device="cuda")
        slope = torch.rand(H, device="cuda")
        slots = torch.randperm(B, device="cuda").to(torch.int32)
        ins.append((q, k, v, cache, slope, slots))
    rows = [dict(name="copy", **{"TB/s": copy_bw / 1e12})]

    def record(name, fn):
        try:
            t = timing.graph_time_torch(fn, sets)
            rows.append(dict(name=name, us=t * 1e6, **{"TB/s": nbytes / t / 1e12}))
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(name=name, error=repr(exc)[:200]))
        print(rows[-1], flush=True)

    record("production", lambda i: linear_decode_forward_triton(*ins[i]))
    copies = [(torch.empty(B * H * D * D, device="cuda"), torch.empty(B * H * D * D, device="cuda"))
              for _ in range(sets)]
    record("copy-same-bytes", lambda i: copies[i][1].copy_(copies[i][0]))
    for block, w in ((8192, 4), (4096, 4), (8192, 8), (16384, 8)):
        record(f"rmw-flat-{block}-w{w}", lambda i, block=block, w=w: _exp_rmw[(B * H * D * D // block,)](
            ins[i][3], 0.5, BLOCK=block, num_warps=w))
    record("production-again", lambda i: linear_decode_forward_triton(*ins[i]))
    # the benchmark's per-call timer (triton do_bench: L2 flushed by a memset before each call)
    for name, fn in (("production", lambda: linear_decode_forward_triton(*ins[0])),
                     ("rmw-flat-8192-w8", lambda: _exp_rmw[(B * H * D * D // 8192,)](
                         ins[0][3], 0.5, BLOCK=8192, num_warps=8))):
        t = timing.kernel_time_torch(fn)
        rows.append(dict(name=f"{name}-do_bench", us=t * 1e6, **{"TB/s": nbytes / t / 1e12}))
        print(rows[-1], flush=True)
    if os.environ.get("EXP_DECODE_SWEEP", "1") == "0":
        with open(os.path.join(os.environ.get("OUT", "."), "exp_lightning_decode_roofline.json"), "w") as f:
            json.dump(rows, f, indent=1)
        return
    # correctness of the experimental kernel against production on one set
    q, k, v, cache, slope, slots = ins[0]
    c1, c2 = cache.clone(), cache.clone()
    o_ref = linear_decode_forward_triton(q, k, v, c1, slope, slots)
    o2 = torch.empty(B, H * D, device="cuda", dtype=torch.bfloat16)
    _exp_decode[(D // 64, B * H)](q, k, v, c2, slope, slots, o2, H, B, D=D, E=D, BLOCK_E=64, E_FAST=True,
                                  num_warps=4)
    rows.append(dict(name="check", out_equal=bool(torch.equal(o_ref, o2)), cache_equal=bool(torch.equal(c1, c2))))
    print(rows[-1], flush=True)
    for be in (64, 32, 128):
        for w in (2, 4, 8):
            for maxnreg in (None, 128, 96, 64):
                for e_fast in (True, False):
                    if maxnreg is not None and not e_fast:
                        continue
                    if be == 128 and w < 4 or be == 32 and w == 8:
                        continue
                    n_e = D // be
                    grid = (n_e, B * H) if e_fast else (B * H, n_e)
                    extra = {} if maxnreg is None else {"maxnreg": maxnreg}

                    def fn(i, grid=grid, be=be, w=w, e_fast=e_fast, extra=extra):
                        q, k, v, cache, slope, slots = ins[i]
                        _exp_decode[grid](q, k, v, cache, slope, slots, o2, H, B, D=D, E=D, BLOCK_E=be,
                                          E_FAST=e_fast, num_warps=w, **extra)
                    record(f"E{be}-w{w}-reg{maxnreg}-{'efast' if e_fast else 'bhfast'}", fn)
    with open(os.path.join(os.environ.get("OUT", "."), "exp_lightning_decode.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

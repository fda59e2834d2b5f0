"""What bounds the block-sparse prefill, and the small merge's latency (GPU only).

    python -m benchmarks.experiments.exp_frontier_bounds [--out DIR] [--only probe,l2,merge,merge_repeat,bsfwd,copy]

``probe``: the block-sparse prefill at 1x16384, Phi-3-small bf16, by a probe
kernel that walks exactly the production schedule (heaviest row tiles first,
heads fastest, each 64-token layout row's columns, the same K/V tile loads
through ``_attend_block``) but computes only the first ROWS of each 64-row
query tile. Every K/V byte the production kernel reads is still read, so as
ROWS falls the time approaches the cost of the loads alone. ROWS = 64 is the
production work and is timed next to the production kernel (the probe is
valid only if the two agree).

``l2``: L2-to-SM read bandwidth: programs read [64, 128] bf16 tiles of a
buffer that fits in L2 (and, for comparison, of one that does not), many times.

``merge``: merge_attn_states at N = 1, 64 (and 16384 for the large-tile
check): vLLM's kernel (``.peer/vllm_merge.py``, see bench_merge_attn_states),
our kernel and the previous kernel (``.peer/old_merge_kernels.py``: the values'
loads masked by the LSEs) at tile / warp variants, GPU time per call (do_bench,
cold L2) and per call inside a CUDA graph. ``merge_repeat``: N = 64, vLLM's
kernel and ours timed in alternation, many times (the spread between runs).
``bsfwd``: the block-sparse prefill forward against the previous kernel
(``.peer/old_bs_kernels.py``, 28da7fc's kernels.py with absolute imports) and
the Triton dQ kernel alone against 28da7fc's (``.peer/old_bs_backward_kernels.py``).
``copy``: the copy rate at a merge's byte count and at 2 GiB. (``ws``, the
warp-specialised Gluon prefill prototype against the Triton kernel, is in
commit cc598c4 with the prototype.)
"""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import triton
import triton.language as tl

from benchmarks.bench_merge_attn_states import vllm_merge
from benchmarks.experiments import run_parts
from core_kernels.blocksparse_attention.kernels import _attend_block, _count_below, _sum

PEER = Path(__file__).resolve().parents[2] / ".peer"


@triton.jit
def _probe_kernel(q_ptr, k_ptr, v_ptr, crow_ptr, col_ptr, out_ptr, num_tokens,
                  num_heads: tl.constexpr, qpk: tl.constexpr, stride_qt: tl.constexpr,
                  stride_kt: tl.constexpr, stride_crow_h: tl.constexpr, stride_col_h: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, NNZ_P2: tl.constexpr,
                  CNT_CHUNK: tl.constexpr, QK_SCALE: tl.constexpr):
    pid = tl.program_id(0)
    i_h = pid % num_heads
    tile = tl.num_programs(0) // num_heads - 1 - pid // num_heads
    o_m = tile * BLOCK + tl.arange(0, ROWS)
    o_d = tl.arange(0, D)
    m_m = o_m < num_tokens
    b_q = tl.load(q_ptr + o_m[:, None].to(tl.int64) * stride_qt + i_h * D + o_d[None, :])
    i_kvh = i_h // qpk
    k_base = k_ptr + i_kvh * D
    v_base = v_ptr + i_kvh * D
    o_n = tl.arange(0, BLOCK)
    k_offs = o_n[None, :] * stride_kt + o_d[:, None]
    v_offs = o_n[:, None] * stride_kt + o_d[None, :]
    p_crow = crow_ptr + i_h * stride_crow_h
    p_col = col_ptr + i_h * stride_col_h
    start = tl.load(p_crow + tile)
    end = tl.load(p_crow + tile + 1)
    n_below = _count_below(p_col, start, end, tile, CNT_CHUNK)
    acc = tl.full([ROWS, D], 0.0, tl.float32)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.full([ROWS], 0.0, tl.float32)
    o_c = tl.arange(0, NNZ_P2)
    cols = tl.load(p_col + start + o_c, mask=o_c < end - start, other=0)
    m_dk = o_d[:, None] < D
    m_dv = o_d[None, :] < D
    for j in tl.range(0, n_below):
        c = _sum(tl.where(o_c == j, cols, 0), 0)
        kstart = (c * BLOCK).to(tl.int64)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, b_q, k_base + kstart * stride_kt + k_offs,
                                      v_base + kstart * stride_kt + v_offs, kstart + o_n, o_m,
                                      num_tokens, QK_SCALE, m_m, m_dk, m_dv, False, False, True,
                                      False, True)
    for j in range(start + n_below, end):
        c = tl.load(p_col + j)
        kstart = (c * BLOCK).to(tl.int64)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, b_q, k_base + kstart * stride_kt + k_offs,
                                      v_base + kstart * stride_kt + v_offs, kstart + o_n, o_m,
                                      num_tokens, QK_SCALE, m_m, m_dk, m_dv, True, False, True,
                                      False, True)
    b_o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + o_m[:, None].to(tl.int64) * stride_qt + i_h * D + o_d[None, :],
             b_o.to(out_ptr.dtype.element_ty))


def probe():
    import torch
    from adapters.torch._executor import info, run_plan, target_for
    from benchmarks.registry import BLOCKSPARSE_MODEL
    from benchmarks.timing import kernel_time_torch
    from core_kernels.blocksparse_attention import build_sparse_layout, plan_blocksparse_attention
    m = BLOCKSPARSE_MODEL
    hq, hkv, d, bs = m["hq"], m["hkv"], m["d"], m["block_size"]
    n = 16384
    (crow_np, col_np), _ = build_sparse_layout(hq, n, bs, m["local_blocks"], m["vert_stride"],
                                               m["homo_head"])
    crow, col = torch.from_numpy(crow_np.copy()).cuda(), torch.from_numpy(col_np.copy()).cuda()
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    plan = plan_blocksparse_attention(target_for(q.device), info(q), info(k), info(v), info(cu), None,
                                      info(crow), info(col), block_size=bs, max_seqlen=n)
    tensors = dict(q=q, k=k, v=v, cu_seqlens_k=cu, cu_seqlens_q=None, crow=crow, col=col)
    rows = []
    t = kernel_time_torch(lambda: run_plan(plan, tensors, None, q.device))
    rows.append(dict(what="production kernel", rows=64, us=t * 1e6))
    print(rows[-1], flush=True)
    nnz = col.shape[-1]
    n_tiles = n // bs
    scale = (1 / d ** 0.5) * 1.4426950408889634
    steps = 0
    for h in range(hq):
        steps += int(crow_np[h if crow_np.ndim > 1 else 0][-1])
    kv_bytes = steps * bs * d * 2 * 2
    for r in (64, 32, 16):
        for warps in ((4,) if r == 64 else (4, 1)):
            def call(r=r, warps=warps):
                _probe_kernel[(n_tiles * hq,)](
                    q, k, v, crow, col, out, n, hq, hq // hkv, q.stride(0), k.stride(0),
                    crow.stride(0), col.stride(0), r, bs, d, triton.next_power_of_2(min(nnz, n_tiles)), 64,
                    scale, num_warps=warps, num_stages=3)
            try:
                t = kernel_time_torch(call)
            except Exception as e:  # noqa: BLE001
                rows.append(dict(what="probe", rows=r, warps=warps, error=repr(e)[:300]))
                print(rows[-1], flush=True)
                continue
            rows.append(dict(what="probe", rows=r, warps=warps, us=t * 1e6,
                             kv_read_TBps=kv_bytes / t / 1e12, kv_gb=kv_bytes / 1e9))
            print(rows[-1], flush=True)
    return rows


@triton.jit
def _l2_read_kernel(x_ptr, out_ptr, n_tiles, ITERS: tl.constexpr, BM: tl.constexpr,
                    BD: tl.constexpr):
    pid = tl.program_id(0)
    o = tl.arange(0, BM)[:, None] * BD + tl.arange(0, BD)[None, :]
    acc = tl.full([BM, BD], 0.0, tl.float32)
    for i in range(ITERS):
        t = (pid * 7 + i * 13) % n_tiles
        acc += tl.load(x_ptr + t.to(tl.int64) * (BM * BD) + o).to(tl.float32)
    tl.store(out_ptr + pid * (BM * BD) + o, acc)


def l2():
    import torch
    from benchmarks.timing import kernel_time_torch
    rows = []
    for mb in (16, 32, 2048):
        n_tiles = (mb << 20) // (64 * 128 * 2)
        x = torch.randn(n_tiles * 64 * 128, device="cuda", dtype=torch.bfloat16)
        for per_sm, warps in ((8, 4), (16, 4), (8, 8)):
            grid = 132 * per_sm
            iters = 64
            out = torch.empty(grid * 64 * 128, device="cuda", dtype=torch.float32)

            def call():
                _l2_read_kernel[(grid,)](x, out, n_tiles, iters, 64, 128, num_warps=warps)
            t = kernel_time_torch(call)
            nbytes = grid * iters * 64 * 128 * 2
            rows.append(dict(what="l2 read", buffer_mb=mb, programs=grid, warps=warps,
                             us=t * 1e6, TBps=nbytes / t / 1e12))
            print(rows[-1], flush=True)
        del x
    return rows


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def merge():
    import torch
    from adapters.torch._executor import info, run_plan, target_for
    from benchmarks.timing import graph_time_torch, kernel_time_torch
    from core_kernels._plan import Plan
    from core_kernels.merge_attn_states import MergeConfig, plan_merge_attn_states
    peer = vllm_merge()
    old = _load("old_merge_kernels", PEER / "old_merge_kernels.py")._merge_attn_states_kernel
    rows = []
    cases = [(nn, h, 128, dt) for nn in (1, 64, 512, 4096, 16384) for h in (32, 64)
             for dt in ("bfloat16", "float16")]
    tiles = ((256, 1), (512, 1), (512, 2), (1024, 2), (1024, 4), (2048, 2), (2048, 4), (4096, 4))
    for n, h, d, dt in cases:
        tdt = getattr(torch, dt)
        sets = [(torch.randn(n, h, d, device="cuda", dtype=tdt), torch.randn(h, n, device="cuda") * 3,
                 torch.randn(n, h, d, device="cuda", dtype=tdt), torch.randn(h, n, device="cuda") * 3)
                for _ in range(4)]
        out, lse = torch.empty_like(sets[0][0]), torch.empty_like(sets[0][1])
        po, pl, so, sl = sets[0]
        variants = {"vllm": None, "ours": None}
        for tile, warps in tiles:
            variants[f"tile{tile}-w{warps}"] = MergeConfig(tile, warps)
            variants[f"old-kernel-tile{tile}-w{warps}"] = MergeConfig(tile, warps)
        ref = None
        for name, cfg in variants.items():
            if name == "vllm":
                fn = lambda i=0: peer(out, *sets[i], output_lse=lse)  # noqa: E731
            else:
                plan = plan_merge_attn_states(target_for(po.device), info(po), info(pl), info(so),
                                              info(sl), info(out), info(lse), config=cfg)
                if name.startswith("old-kernel"):
                    plan = Plan(plan.buffers, tuple(dataclasses.replace(la, kernel=old)
                                                    for la in plan.launches), plan.results)

                def fn(i=0, plan=plan):
                    po_, pl_, so_, sl_ = sets[i]
                    run_plan(plan, dict(output=out, output_lse=lse, prefix_output=po_,
                                        prefix_lse=pl_, suffix_output=so_, suffix_lse=sl_), {})
            fn(0)
            torch.cuda.synchronize()
            res = out.clone()
            if ref is None:
                ref = res
            row = dict(what="merge", n=n, h=h, d=d, dtype=dt, variant=name,
                       us=kernel_time_torch(fn) * 1e6, graph_us=graph_time_torch(fn, 4) * 1e6,
                       max_diff_vs_vllm=float((res.float() - ref.float()).abs().max()))
            if name == "ours":
                base = res
            if name != "vllm":
                row["bitwise_vs_ours"] = bool(torch.equal(res, base))
            rows.append(row)
            print(row, flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows


def merge_repeat(trials: int = 15, variants=((128, 1), (256, 2), (512, 2), (512, 4))):
    """N = 64 merges, vLLM's kernel and ours (the planner's default, then the
    tilings ``variants``) timed in alternation ``trials`` times: the spread of a
    ~6 us GPU time between runs."""
    import statistics

    import torch
    import adapters.torch as at
    from benchmarks.timing import kernel_time_torch
    from core_kernels.merge_attn_states import MergeConfig
    peer = vllm_merge()
    configs = [None] + [MergeConfig(t, w) for t, w in variants]
    rows = []
    for h in (32, 64):
        for dt in ("bfloat16", "float16"):
            tdt = getattr(torch, dt)
            po, so = (torch.randn(64, h, 128, device="cuda", dtype=tdt) for _ in range(2))
            pl, sl = (torch.randn(h, 64, device="cuda") * 3 for _ in range(2))
            out, lse = torch.empty_like(po), torch.empty_like(pl)
            for cfg in configs:
                ours, theirs = [], []
                for _ in range(trials):
                    theirs.append(kernel_time_torch(lambda: peer(out, po, pl, so, sl, output_lse=lse)) * 1e6)
                    ours.append(kernel_time_torch(lambda: at.merge_attn_states(
                        out, po, pl, so, sl, lse, config=cfg)) * 1e6)
                ratio = [t / o for t, o in zip(theirs, ours)]
                rows.append(dict(what="merge-repeat", n=64, h=h, d=128, dtype=dt, trials=trials,
                                 config=None if cfg is None else dataclasses.astuple(cfg),
                                 ours_median_us=statistics.median(ours),
                                 vllm_median_us=statistics.median(theirs),
                                 ours_range_us=[min(ours), max(ours)],
                                 vllm_range_us=[min(theirs), max(theirs)],
                                 vllm_over_ours_median=statistics.median(ratio),
                                 trials_ours_faster=sum(r > 1 for r in ratio)))
                print(rows[-1], flush=True)
    return rows


def bsfwd(trials: int = 5):
    """The block-sparse prefill forward against the previous kernel
    (``.peer/old_bs_kernels.py``) on the same plan, alternating, Phi-3-small bf16:
    GPU time per call (cold L2) and bitwise equality of the outputs."""
    import statistics

    import torch
    from adapters.torch._executor import info, run_plan, target_for
    from benchmarks.registry import BLOCKSPARSE_MODEL
    from benchmarks.timing import kernel_time_torch
    from core_kernels._plan import Plan
    from core_kernels.blocksparse_attention import (BlocksparseBackwardConfig, build_sparse_layout,
                                                    plan_blocksparse_attention,
                                                    plan_blocksparse_attention_backward,
                                                    plan_blocksparse_attention_lse)
    old = _load("old_bs_kernels", PEER / "old_bs_kernels.py")
    m = BLOCKSPARSE_MODEL
    hq, hkv, d, bs = m["hq"], m["hkv"], m["d"], m["block_size"]
    rows = []
    for lens in ([16384], [4096] * 4):
        n = max(lens)
        (crow_np, col_np), _ = build_sparse_layout(hq, n, bs, m["local_blocks"], m["vert_stride"],
                                                   m["homo_head"])
        crow, col = torch.from_numpy(crow_np.copy()).cuda(), torch.from_numpy(col_np.copy()).cuda()
        t = sum(lens)
        q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
        new = plan_blocksparse_attention(target_for(q.device), info(q), info(k), info(v), info(cu),
                                         None, info(crow), info(col), block_size=bs, max_seqlen=n)
        prev = Plan(new.buffers, tuple(dataclasses.replace(
            la, kernel=getattr(old, la.kernel.fn.__name__)) for la in new.launches), new.results)
        tensors = dict(q=q, k=k, v=v, cu_seqlens_k=cu, cu_seqlens_q=None, crow=crow, col=col)
        outs = {}
        times = {"new": [], "old": []}
        for _ in range(trials):
            for name, plan in (("old", prev), ("new", new)):
                times[name].append(kernel_time_torch(lambda p=plan: run_plan(p, tensors, None, q.device)) * 1e6)
                outs[name] = run_plan(plan, tensors, None, q.device)["output"].clone()
        row = dict(what="bsfwd", lens=f"{len(lens)}x{n}", new_us=statistics.median(times["new"]),
                   old_us=statistics.median(times["old"]), new_all=times["new"], old_all=times["old"],
                   bitwise=bool(torch.equal(outs["new"], outs["old"])))
        rows.append(row)
        print(row, flush=True)
        if len(lens) > 1:
            continue
        # the Triton dQ kernel (dq_gluon=False), alone, against 28da7fc's
        oldb = _load("old_bs_backward_kernels", PEER / "old_bs_backward_kernels.py")
        scale = d ** -0.5
        fwd = plan_blocksparse_attention_lse(target_for(q.device), info(q), info(k), info(v), info(cu),
                                             info(cu), info(crow), info(col), sm_scale=scale,
                                             block_size=bs, max_seqlen=n)
        env = run_plan(fwd, dict(q=q, k=k, v=v, cu_seqlens_k=cu, cu_seqlens_q=cu, crow=crow, col=col))
        go = torch.randn_like(q)
        bt = dict(q=q, k=k, v=v, output=env["output"], lse=env["lse"], grad_output=go, cu_seqlens_k=cu,
                  cu_seqlens_q=cu, crow=crow, col=col)
        args = [info(bt[x]) for x in ("q", "k", "v", "output", "lse", "grad_output", "cu_seqlens_k",
                                      "cu_seqlens_q", "crow", "col")]
        bwd = plan_blocksparse_attention_backward(
            target_for(q.device), *args, sm_scale=scale, block_size=bs, max_seqlen=n,
            config=BlocksparseBackwardConfig(dq_gluon=False))
        full = run_plan(bwd, bt)
        (dq_launch,) = [la for la in bwd.launches if la.kernel.fn.__name__ == "_bsattn_bwd_dq_kernel"]
        written = {dq_launch.params[w] for w in dq_launch.writes}
        given = {**bt, **{b: full[b] for b in bwd.buffers if b not in written}}
        bufs = {nm: b for nm, b in bwd.buffers.items() if nm in written}
        plans = {"new": Plan(bufs, (dq_launch,), ()),
                 "old": Plan(bufs, (dataclasses.replace(dq_launch, kernel=oldb._bsattn_bwd_dq_kernel),), ())}
        times = {"new": [], "old": []}
        dqs = {}
        for _ in range(trials):
            for name in ("old", "new"):
                times[name].append(kernel_time_torch(lambda p=plans[name]: run_plan(p, given)) * 1e6)
                dqs[name] = run_plan(plans[name], given)["grad_q"].clone()
        row = dict(what="bs-dq-triton", lens=f"1x{n}", new_us=statistics.median(times["new"]),
                   old_us=statistics.median(times["old"]), new_all=times["new"], old_all=times["old"],
                   bitwise=bool(torch.equal(dqs["new"], dqs["old"])))
        rows.append(row)
        print(row, flush=True)
    return rows


def copy_sizes():
    """Device-to-device copy rate (read + write counted, do_bench, cold L2) at the
    byte count of a 16384x32x128 bf16 merge and at the 2 GiB the benches' copy
    ceiling uses: what a fixed per-launch cost does to a rate at that size."""
    import torch
    from benchmarks.timing import kernel_time_torch
    rows = []
    merge_bytes = 3 * 16384 * 32 * 128 * 2 + 3 * 16384 * 32 * 4
    for nbytes in (merge_bytes, 2 << 30):
        src = torch.empty(nbytes // 2 // 4, device="cuda", dtype=torch.float32)
        dst = torch.empty_like(src)
        t = kernel_time_torch(lambda: dst.copy_(src))
        moved = 2 * src.numel() * 4
        rows.append(dict(what="copy", bytes_moved=moved, us=t * 1e6, TBps=moved / t / 1e12))
        print(rows[-1], flush=True)
        del src, dst
    return rows


def main():
    run_parts("exp_frontier_bounds", {"probe": probe, "l2": l2, "merge": merge, "merge_repeat": merge_repeat,
                                      "bsfwd": bsfwd, "copy": copy_sizes}, default="probe,l2,merge")


if __name__ == "__main__":
    main()

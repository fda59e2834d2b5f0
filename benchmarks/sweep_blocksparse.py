"""One-call tuning sweep for block-sparse attention on the GPU (prefill tiles, decode splits).

    python3 -m benchmarks.sweep_blocksparse      (writes $OUT/sweep_blocksparse.json)
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch

from adapters.torch._executor import info, run_plan, target_for
from benchmarks.bench_blocksparse_attention import allowed_pairs
from benchmarks.registry import BLOCKSPARSE_MODEL as M
from benchmarks.timing import graph_time_torch, host_overhead, kernel_time_torch
from core_kernels.blocksparse_attention import (BlocksparseDecodeConfig, BlocksparseGroupDecodeConfig,
                                                BlocksparsePrefillConfig, choose_config, build_sparse_layout,
                                                plan_blocksparse_attention)
import adapters.torch as at

OUT = os.environ.get("OUT", "results")
HQ, HKV, D, BS = M["hq"], M["hkv"], M["d"], M["block_size"]
rows = []


def shape(lens_k, lens_q):
    max_seqlen = max(lens_k)
    (crow_np, col_np), bm = build_sparse_layout(HQ, max_seqlen, BS, M["local_blocks"], M["vert_stride"],
                                                 M["homo_head"])
    crow, col = torch.from_numpy(crow_np.copy()).cuda(), torch.from_numpy(col_np.copy()).cuda()
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    cu_q = None if lens_q is None else torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]),
                                                    dtype=torch.int32, device="cuda")
    tk, tq = sum(lens_k), (len(lens_k) if lens_q is None else sum(lens_q))
    n_sets = 3 if tk * HKV * D * 4 > (256 << 20) else 6
    sets = [(torch.randn(tq, HQ, D, device="cuda", dtype=torch.bfloat16),
             torch.randn(tk, HKV, D, device="cuda", dtype=torch.bfloat16),
             torch.randn(tk, HKV, D, device="cuda", dtype=torch.bfloat16)) for _ in range(n_sets)]
    flops = 4 * D * allowed_pairs(bm, lens_k, lens_q, BS)
    return dict(crow=crow, col=col, cu_k=cu_k, cu_q=cu_q, sets=sets, flops=flops, max_seqlen=max_seqlen)


def _planner_args(sh):
    q0, k0, v0 = sh["sets"][0]
    cu_q = sh["cu_q"]
    return (target_for(q0.device), info(q0), info(k0), info(v0), info(sh["cu_k"]),
            None if cu_q is None else info(cu_q), info(sh["crow"]), info(sh["col"]))


def rule(sh, kind):
    """The measured rule's config of variant ``kind`` (a config class) for this shape."""
    return choose_config(*_planner_args(sh), block_size=BS, max_seqlen=sh["max_seqlen"], variant=kind)


def variant(sh, config=None):
    cu_q = sh["cu_q"]
    plan = plan_blocksparse_attention(*_planner_args(sh), block_size=BS, max_seqlen=sh["max_seqlen"],
                                      config=config)

    def fn(i=0):
        q, k, v = sh["sets"][i]
        return run_plan(plan, dict(q=q, k=k, v=v, cu_seqlens_k=sh["cu_k"], cu_seqlens_q=cu_q,
                                   crow=sh["crow"], col=sh["col"]), None, q.device)["output"]
    return fn


def record(name, label, sh, fn, graph=False):
    t0 = time.time()
    try:
        t = kernel_time_torch(fn, rep_ms=100)
        row = dict(name=name, variant=label, time_us=t * 1e6, tflops=sh["flops"] / t / 1e12)
        if graph:
            row["gpu_us"] = graph_time_torch(fn, len(sh["sets"])) * 1e6
    except Exception as e:  # noqa: BLE001
        row = dict(name=name, variant=label, error=str(e)[:300])
    row["wall_s"] = round(time.time() - t0, 1)
    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    rows.append(row)
    json.dump(rows, open(os.path.join(OUT, "sweep_blocksparse.json"), "w"), indent=1)


def main():
    os.makedirs(OUT, exist_ok=True)
    what = sys.argv[1:] or ["prefill", "decode"]
    if "prefill" in what:
        sh = shape([16384], [16384])
        for cfg in [None, BlocksparsePrefillConfig(64, 64, 4, 4)]:
            record("prefill-1x16384", str(cfg or "default"), sh, variant(sh, cfg))
        del sh
        sh = shape([4096] * 4, [4096] * 4)
        for cfg in [None]:
            record("prefill-4x4096", str(cfg or "default"), sh, variant(sh, cfg))
        del sh
        torch.cuda.empty_cache()
    if "decode" in what:
        # per-head kernel (splits, warps) vs GQA-packed (splits, chunk, warps, stages);
        # None: the measured rule's config of that kernel
        for lens, old, grp in [
            ([16384], [(None, None), (23, 2)],
             [(None, None, None, None), (64, 4, 4, 3), (32, 8, 4, 3), (32, 4, 4, 3), (16, 16, 4, 3),
              (64, 4, 2, 3), (128, 2, 4, 3), (32, 8, 4, 4), (16, 8, 4, 3), (64, 4, 8, 3),
              (64, 4, 4, 4), (32, 8, 2, 3)]),
            ([4096] * 64, [(None, None), (9, 2)],
             [(None, None, None, None), (2, 32, 4, 3), (1, 32, 4, 3), (4, 16, 4, 3), (2, 32, 2, 3),
              (4, 16, 2, 3), (8, 8, 4, 3), (2, 32, 4, 4), (1, 32, 2, 3)]),
        ]:
            sh = shape(lens, None)
            name = f"decode-{len(lens)}x{lens[0]}"
            ref = variant(sh, rule(sh, BlocksparseDecodeConfig))(0).float()
            for s, w in old:
                cfg = rule(sh, BlocksparseDecodeConfig) if s is None else BlocksparseDecodeConfig(s, w)
                record(name, f"perhead-splits{s}-w{w}", sh, variant(sh, cfg), graph=True)
            for s, c, w, st in grp:
                cfg = (rule(sh, BlocksparseGroupDecodeConfig) if s is None
                       else BlocksparseGroupDecodeConfig(s, c, w, st))
                fn = variant(sh, cfg)
                print("max abs diff vs per-head", (fn(0).float() - ref).abs().max().item(), flush=True)
                record(name, f"group-splits{s}-chunk{c}-w{w}-s{st}", sh, fn, graph=True)
            del sh, ref
            torch.cuda.empty_cache()
    if "crossover" in what:
        # per-head vs GQA-packed by batch size (the plan's DECODE_GROUP_MIN_PROGRAMS)
        for lens in ([16384], [4096] * 4, [4096] * 8, [4096] * 16, [16384] * 4):
            sh = shape(lens, None)
            name = f"decode-{len(lens)}x{lens[0]}"
            for kind in (BlocksparseDecodeConfig, BlocksparseGroupDecodeConfig):
                record(name, f"group={kind is BlocksparseGroupDecodeConfig}", sh,
                       variant(sh, rule(sh, kind)), graph=True)
            del sh
            torch.cuda.empty_cache()
    json.dump(rows, open(os.path.join(OUT, "sweep_blocksparse.json"), "w"), indent=1)


if __name__ == "__main__":
    main()

"""Experiment: block-sparse split decode in one launch (the last split of a row
merges it; scratch kept per stream) against the previous two launches (decode,
then a combine kernel; scratch allocated per call). GPU only.

    python3 -m benchmarks.experiments.exp_decode_one_launch [--out DIR]

The previous kernels come from ``.peer/pre_fuse_bs_kernels.py`` (kernels.py of
commit e8fc89c with absolute imports; not committed). Phi-3-small layout, bf16.
Per shape, in alternating rounds (host timing on the GPU machines moves 30-40%
between runs): wall time per call of back-to-back calls (pipelined), host time
per call (enqueue only), GPU time per call in a CUDA graph; outputs compared
bit for bit, and through the public op (what a user calls).
"""
import argparse
import importlib.util
import json
import os
import statistics
from pathlib import Path

import numpy as np
import torch

from benchmarks.registry import BLOCKSPARSE_MODEL
from benchmarks.timing import graph_time_torch, host_overhead, pipelined_time

PEER = Path(__file__).resolve().parents[2] / ".peer"
SHAPES = (("decode-1x16384", [16384]), ("decode-64x4096", [4096] * 64), ("decode-4x4096", [4096] * 4))
SWEEP = {"decode-1x16384": (12, 16, 20, 24, 28, 33), "decode-64x4096": (2, 4), "decode-4x4096": (4, 8, 16)}


def _old_kernels():
    spec = importlib.util.spec_from_file_location("pre_fuse_bs_kernels", PEER / "pre_fuse_bs_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _old_plan(new_plan, old):
    """The two-launch plan of the same problem: the new launch's constexprs,
    the previous decode kernel, then the previous combine kernel."""
    from core_kernels._plan import Buffer, Launch, Plan
    (launch,) = new_plan.launches
    c = dict(launch.constexprs)
    splits, s_p2 = c["NUM_SPLITS"], c.pop("S_P2")
    c.pop("MERGE_HEADS", None)
    kernel = {"_bsattn_decode_kernel": old._bsattn_decode_kernel,
              "_bsattn_decode_group_kernel": old._bsattn_decode_group_kernel}[launch.kernel.fn.__name__]
    params = {k: v for k, v in launch.params.items() if k != "cnt_ptr"}
    decode = Launch(kernel=kernel, grid=launch.grid, params=params, writes=("out_ptr", "part_ptr"),
                    constexprs=c, num_warps=launch.num_warps, num_stages=launch.num_stages)
    combine = Launch(kernel=old._bsattn_combine_kernel, grid=(new_plan.buffers["output"].shape[0]
                                                               * c["num_heads"],),
                     params=dict(part_ptr="partials", out_ptr="output"), writes=("out_ptr",),
                     constexprs=dict(num_heads=c["num_heads"], head_size=c["head_size"],
                                     stride_ot=c["stride_ot"], stride_oh=c["stride_oh"], NUM_SPLITS=splits,
                                     LSE_OFFSET=c["LSE_OFFSET"], S_P2=s_p2, BLOCK_D=c["BLOCK_D"]),
                     num_warps=4, num_stages=1)
    part = new_plan.buffers["partials"]
    buffers = dict(new_plan.buffers)
    buffers["partials"] = Buffer(part.shape, part.dtype)
    del buffers["counters"]
    return Plan(buffers, (decode, combine), new_plan.results)


def _profile(fn, n=2000):
    """Where the public op's host time goes: cProfile's top entries by own time."""
    import cProfile
    import io
    import pstats
    fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(18)
    print(out.getvalue(), flush=True)
    return [line for line in out.getvalue().splitlines() if line.strip()][:30]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    import adapters.torch as at
    from adapters.torch._executor import info, run_plan, target_for
    from core_kernels.blocksparse_attention import build_sparse_layout, plan_blocksparse_attention

    old = _old_kernels()
    m = BLOCKSPARSE_MODEL
    hq, hkv, d, bs = m["hq"], m["hkv"], m["d"], m["block_size"]
    rows = []
    for name, lens in SHAPES:
        max_seqlen = max(lens)
        (crow_np, col_np), _ = build_sparse_layout(hq, max_seqlen, bs, m["local_blocks"], m["vert_stride"],
                                                   m["homo_head"])
        crow, col = torch.from_numpy(crow_np.copy()).cuda(), torch.from_numpy(col_np.copy()).cuda()
        cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
        n_sets = 3
        sets = [(torch.randn(len(lens), hq, d, device="cuda", dtype=torch.bfloat16),
                 torch.randn(sum(lens), hkv, d, device="cuda", dtype=torch.bfloat16),
                 torch.randn(sum(lens), hkv, d, device="cuda", dtype=torch.bfloat16)) for _ in range(n_sets)]
        q0, k0, v0 = sets[0]
        new_plan = plan_blocksparse_attention(target_for(q0.device), info(q0), info(k0), info(v0), info(cu_k),
                                              None, info(crow), info(col), block_size=bs,
                                              max_seqlen=max_seqlen)
        old_plan = _old_plan(new_plan, old)

        def runner(plan):
            def fn(i=0):
                q, k, v = sets[i]
                return run_plan(plan, dict(q=q, k=k, v=v, cu_seqlens_k=cu_k, crow=crow, col=col), None,
                                q.device)["output"]
            return fn

        def op(i=0):
            q, k, v = sets[i]
            return at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, None, None, (crow, col), block_size=bs,
                                                        max_seqlen=max_seqlen)

        fns = {"one_launch": runner(new_plan), "two_launches": runner(old_plan), "op": op}
        bits = {k: f(0).view(torch.int16).clone() for k, f in fns.items()}
        torch.cuda.synchronize()
        equal = {k: bool(torch.equal(bits[k], bits["two_launches"])) for k in fns}
        res = {k: dict(wall=[], host=[], gpu=[]) for k in fns}
        for _ in range(args.rounds):
            for k, f in fns.items():
                res[k]["wall"].append(pipelined_time([lambda i=i, f=f: f(i) for i in range(n_sets)], "torch",
                                                     reps=300, trials=3) * 1e6)
                res[k]["host"].append(host_overhead(lambda f=f: f(0), "torch", reps=300, trials=5) * 1e6)
                res[k]["gpu"].append(graph_time_torch(f, n_sets) * 1e6)
        row = dict(name=name, launches={"one_launch": len(new_plan.launches), "two_launches": 2},
                   splits=new_plan.launches[0].constexprs["NUM_SPLITS"],
                   kernel=new_plan.launches[0].kernel.fn.__name__, bitwise_equal_to_two_launches=equal)
        for k in fns:
            for metric, vals in res[k].items():
                row[f"{k}_{metric}_us"] = round(statistics.median(vals), 2)
                row[f"{k}_{metric}_us_all"] = [round(x, 2) for x in vals]
        # GPU time in a CUDA graph per split count, both forms (the split rule was
        # measured with two launches)
        from core_kernels.blocksparse_attention import (BlocksparseDecodeConfig,
                                                        BlocksparseGroupDecodeConfig, choose_config)
        variant = (BlocksparseDecodeConfig if new_plan.launches[0].kernel.fn.__name__ == "_bsattn_decode_kernel"
                   else BlocksparseGroupDecodeConfig)
        sweep = {}
        for splits in SWEEP[name]:
            pargs = (info(q0), info(k0), info(v0), info(cu_k), None, info(crow), info(col))
            cfg = choose_config(target_for(q0.device), *pargs, block_size=bs, max_seqlen=max_seqlen,
                                variant=variant, splits=splits)
            p_new = plan_blocksparse_attention(target_for(q0.device), *pargs, block_size=bs,
                                               max_seqlen=max_seqlen, config=cfg)
            if p_new.launches[0].constexprs["NUM_SPLITS"] < 2:
                continue
            p_old = _old_plan(p_new, old)
            sweep[splits] = {k: round(statistics.median(graph_time_torch(runner(p), n_sets) * 1e6
                                                        for _ in range(3)), 2)
                             for k, p in (("one_launch", p_new), ("two_launches", p_old))}
        row["gpu_us_by_splits"] = sweep
        if name == "decode-1x16384":
            row["op_profile"] = _profile(op)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "exp_decode_one_launch.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Tile / mode sweep for context_attention_fwd on the GPU (one device call).

    python3 -m benchmarks.sweep_prefix_prefill   (writes $OUT/sweep_prefix_prefill.json)

Each config is the fields of PrefixPrefillConfig (BLOCK_M, BLOCK_N, num_warps,
num_stages, pack GQA, prefetch ids, gather), passed as ``config=``: gather True
copies the context into dense scratch first, False reads the paged cache in the
loop. Results are appended as they come, so a run cut short still reports what
it measured.
"""
from __future__ import annotations

import json
import os
import time

from benchmarks import timing
from benchmarks.bench_prefix_prefill import (check_one_sequence, configured_call, make_inputs,
                                             useful_flops)
from benchmarks.registry import PREFIX_PREFILL_MODEL, PREFIX_PREFILL_SHAPES

G = True
CONFIGS = {
    "B4-q1024-ctx4096-fp16": [
        None, (128, 128, 8, 3, True, 0, G), (128, 64, 8, 3, True, 0, G),
        (128, 64, 8, 4, True, 0, G), (128, 128, 8, 2, True, 0, G), (128, 64, 8, 2, True, 0, G),
        (64, 64, 4, 3, True, 0, G), (64, 64, 4, 4, True, 0, G),
        (128, 128, 8, 3, True, 1, False), (128, 128, 8, 3, True, 0, False),
        (128, 64, 8, 3, True, 2, False)],
    "B1-q8192-ctx0-bf16": [
        None, (128, 128, 8, 2, True, 0, G), (128, 64, 8, 3, True, 0, G),
        (128, 64, 8, 4, True, 0, G)],
    "B4-q1024-ctx4096-bf16-fp8kv": [
        None, (128, 64, 8, 3, True, 0, G), (128, 64, 8, 4, True, 0, G),
        (128, 128, 8, 3, True, 1, False)],
    "B16-q256-ctx2048-bf16": [None, (128, 64, 8, 3, True, 0, G), (128, 128, 8, 3, True, 1, False)],
}


def main():
    import torch
    from core_kernels.prefix_prefill import plan as pp
    from adapters.torch._executor import info, run_plan, target_for
    from core_kernels._plan import Plan
    out_dir = os.environ.get("OUT", "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "sweep_prefix_prefill.json")
    rows = []
    t_start = time.time()
    m = PREFIX_PREFILL_MODEL
    shapes = {name: (seqs, dt, opts) for name, seqs, dt, opts in PREFIX_PREFILL_SHAPES}
    for name, configs in CONFIGS.items():
        seqs, dtype, opts = shapes[name]
        inp = make_inputs(seqs, dtype, opts)
        flops = useful_flops(seqs, m["hq"], m["d"], opts.get("sliding_window"))
        out = torch.empty_like(inp["q"])
        for cfg in configs:
            row = dict(name=name, config=str(cfg))
            try:
                call = configured_call(inp, out, opts, cfg)
                out.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                row["max_err"] = check_one_sequence(inp, out, opts)
                t = timing.kernel_time_torch(call, rep_ms=150)
                row.update(us=t * 1e6, tflops=flops / t / 1e12)
            except Exception as e:
                row["error"] = repr(e)[:300]
            row["elapsed_s"] = time.time() - t_start
            print(row, flush=True)
            rows.append(row)
            json.dump(rows, open(path, "w"), indent=1)
        if name == "B4-q1024-ctx4096-fp16":  # the gather kernel alone
            try:
                names = ("q", "k", "v", "k_cache", "v_cache", "b_loc", "b_start_loc", "b_seq_len")
                plan = pp.plan_prefix_prefill(target_for(out.device),
                                              *(info(inp[n]) for n in names), info(out),
                                              max_input_len=inp["max_input_len"])
                g = Plan({n: b for n, b in plan.buffers.items() if "scratch" in n},
                         plan.launches[:1], ())
                tensors = {n: inp[n] for n in names}
                t = timing.kernel_time_torch(lambda: run_plan(g, tensors), rep_ms=100)
                nbytes = 2 * sum(b.shape[0] * b.shape[1] * b.shape[2] * b.shape[3] * 2
                                 for n, b in g.buffers.items())
                row = dict(name=name, config="gather-kernel-only", us=t * 1e6,
                           TBps=nbytes / t / 1e12)
            except Exception as e:
                row = dict(name=name, config="gather-kernel-only", error=repr(e)[:300])
            print(row, flush=True)
            rows.append(row)
            json.dump(rows, open(path, "w"), indent=1)
        del inp, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

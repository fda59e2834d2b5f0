"""Experiment: lightning prefill (bf16), the Gluon kernel against the Triton kernel.

The Gluon kernel (core_kernels/lightning_attention/gluon_kernels.py) started
here as a standalone prototype (final state only, contiguous inputs); its
measurements are in results/experiments/exp_lightning_gluon_first.json (ring
depth 2-4, E-tile 32/64) and exp_lightning_gluon.json (with per-block states).
This script now times the production kernels on one shape through the planner
(use_gluon=True / False), with the L2 flushed, and checks that they agree.

    python3 -m benchmarks.experiments.exp_lightning_gluon   (GPU only)
"""
from __future__ import annotations

import json
import os


def main():
    import torch

    from adapters.torch._executor import info, run_plan
    from benchmarks import timing
    from benchmarks.bench_lightning_attention import _prefill_bytes, _prefill_inputs
    from core_kernels.lightning_attention import plan_lightning_attention
    copy_bw = timing.copy_bandwidth()
    rows = []
    q, k, v, ed = _prefill_inputs(1, 64, 4096, 128, 128, "bfloat16")[0]
    tensors = dict(q=q, k=k, v=v, ed=ed)
    for fso in (False, True):
        outs = {}
        for use_gluon in (False, True):
            plan = plan_lightning_attention(info(q), info(k), info(v), info(ed), None, block_size=256,
                                            output_final_state_only=fso, use_gluon=use_gluon)
            outs[use_gluon] = run_plan(plan, tensors)
            t = timing.kernel_time_torch(lambda: run_plan(plan, tensors))
            nbytes = _prefill_bytes(1, 64, 4096, 128, 128, "bfloat16", 256, fso)
            rows.append(dict(name=f"{'gluon' if use_gluon else 'triton'}-{'final' if fso else 'states'}",
                             us=t * 1e6, x_floor=t / (nbytes / copy_bw)))
        a, b = outs[True], outs[False]
        rows[-1].update(
            rel_err_vs_triton=((a["output"].float() - b["output"].float()).norm()
                               / b["output"].float().norm()).item(),
            kv_equal=bool(torch.equal(a["kv"], b["kv"])))
        for r in rows[-2:]:
            print(r, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "exp_lightning_gluon_vs_triton.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

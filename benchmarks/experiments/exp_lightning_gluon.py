"""Experiment: lightning prefill, the Gluon kernels against the Triton kernel.

The bf16 Gluon kernel (core_kernels/lightning_attention/gluon_kernels.py)
started as a standalone prototype (final state only, contiguous inputs); its
measurements are in results/experiments/exp_lightning_gluon_first.json (ring
depth 2-4, E-tile 32/64) and exp_lightning_gluon.json (with per-block states).
This script times the production kernels through the planner (the Triton
kernel forced by LightningTritonConfig(), the Gluon kernels by
LightningGluonConfig()) with the L2 flushed, plus variants of the Gluon launch
(EXP_VARIANTS, a JSON list of dicts, e.g. '[{"stages": 2}, {"WS_REGS": 232}]':
LightningGluonConfig fields go to the config, other keys replace the launch's
constexprs; applied to the default plan and to every segmented one) and
segment counts (EXP_SEGMENTS, e.g. 8,32,128: the chained scan with that many
segments per (b, h, E-tile)). Every variant is checked against the Triton
kernel and the default Gluon plan, and run twice: the second run must be
bit-identical (deterministic). The segment-group variant (EXP_GROUPS) ran from
this script's copy in commit 23f9d41 with that commit's patch applied (see
README.md).

    EXP_DTYPES=float32,bfloat16 EXP_SHAPES=1x64x4096,4x64x1024 \\
        python3 -m benchmarks.experiments.exp_lightning_gluon   (GPU only)
"""
from __future__ import annotations

import dataclasses
import json
import os


def _variant(plan_for, base, var):
    """The plan of Gluon config ``base`` with ``var`` applied: config fields through
    the planner, other keys as the one launch's constexprs."""
    from core_kernels.lightning_attention import LightningGluonConfig
    fields = {f.name for f in dataclasses.fields(LightningGluonConfig)}
    plan = plan_for(dataclasses.replace(base, **{k: v for k, v in var.items() if k in fields}))
    consts = {k: v for k, v in var.items() if k not in fields}
    launch = plan.launches[0]
    launch = dataclasses.replace(launch, constexprs={**launch.constexprs, **consts})
    return dataclasses.replace(plan, launches=(launch,))


def main():
    import torch

    from adapters.torch._executor import info, run_plan, target_for
    from benchmarks import timing
    from benchmarks.bench_lightning_attention import _prefill_bytes, _prefill_inputs
    from core_kernels.lightning_attention import (LightningGluonConfig, LightningTritonConfig,
                                                  plan_lightning_attention)
    dtypes = os.environ.get("EXP_DTYPES", "bfloat16").split(",")
    shapes = [tuple(int(x) for x in s.split("x"))
              for s in os.environ.get("EXP_SHAPES", "1x64x4096").split(",")]
    variants = json.loads(os.environ.get("EXP_VARIANTS", "[]"))
    segments = [int(x) for x in os.environ.get("EXP_SEGMENTS", "").split(",") if x]
    copy_bw = timing.copy_bandwidth()
    rows = []

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    for dtype in dtypes:
        for b, h, n in shapes:
            q, k, v, ed = _prefill_inputs(b, h, n, 128, 128, dtype)[0]
            tensors = dict(q=q, k=k, v=v, ed=ed)
            for fso in (False, True):
                nbytes = _prefill_bytes(b, h, n, 128, 128, dtype, 256, fso)

                def plan_for(config):
                    return plan_lightning_attention(target_for(q.device), info(q), info(k), info(v),
                                                    info(ed), None, block_size=256,
                                                    output_final_state_only=fso, config=config)
                plans = {"triton": plan_for(LightningTritonConfig()),
                         "gluon": plan_for(LightningGluonConfig())}
                for name, base in [("gluon", LightningGluonConfig())] + [
                        (f"gluon-seg{nseg}", LightningGluonConfig(num_segments=nseg)) for nseg in segments]:
                    plans.setdefault(name, plan_for(base))
                    for var in variants:
                        plans[f"{name}-{json.dumps(var, separators=(',', ':'))}"] = _variant(
                            plan_for, base, var)
                ref = None
                for name, plan in plans.items():
                    row = dict(name=f"{name}-{dtype}-B{b}-H{h}-N{n}-{'final' if fso else 'states'}")
                    try:
                        out = run_plan(plan, tensors)
                        again = run_plan(plan, tensors)
                        row.update(deterministic=bool(torch.equal(out["output"], again["output"])
                                                      and torch.equal(out["kv"], again["kv"])))
                        t = timing.kernel_time_torch(lambda: run_plan(plan, tensors))
                        row.update(us=t * 1e6, x_floor=t / (nbytes / copy_bw),
                                   tb_s=nbytes / t / 1e12)
                        if name == "gluon":
                            gluon_out = out
                        elif name.startswith("gluon-"):
                            row.update(equal_to_gluon=bool(torch.equal(out["output"], gluon_out["output"])
                                                           and torch.equal(out["kv"], gluon_out["kv"])))
                        if ref is None:
                            ref = out
                        else:
                            row.update(rel_out_vs_triton=rel(out["output"], ref["output"]),
                                       rel_kv_vs_triton=rel(out["kv"], ref["kv"]),
                                       kv_equal=bool(torch.equal(out["kv"], ref["kv"])))
                    except Exception as exc:  # a variant that fails to compile or run
                        row.update(error=f"{type(exc).__name__}: {str(exc)[-300:]}")
                    rows.append(row)
                    print(row, flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "exp_lightning_gluon_vs_triton.json"), "w") as f:
        json.dump(dict(copy_tb_s=copy_bw / 1e12, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

"""Experiment: production lightning prefill under config overrides (B=1, H=64,
N=4096, D=E=128; with EXP_SHAPES also B=1 H=8 N=65536 and B=4 H=64 N=1024),
with and without the per-block states; L2 flushed. Each row also gives the
output's relative difference to the planner's own choice.

EXP_CONFIGS replaces the list: "dtype:CONFIG;dtype:CONFIG", CONFIG a
LightningTritonConfig(...) / LightningGluonConfig(...) expression or None, e.g.
EXP_CONFIGS='bfloat16:LightningTritonConfig(num_stages=2);float32:LightningGluonConfig(num_segments=4)'

    python3 -m benchmarks.experiments.exp_lightning_configs   (GPU only)
"""
import dataclasses
import json
import os

import torch

from adapters.torch._executor import info, run_plan, target_for
from benchmarks import timing
from benchmarks.bench_lightning_attention import _prefill_bytes, _prefill_inputs
from core_kernels.lightning_attention import (LightningGluonConfig, LightningTritonConfig,
                                              plan_lightning_attention)

T = LightningTritonConfig
CONFIGS = [("bfloat16", None), ("bfloat16", T()), ("bfloat16", T(num_stages=4, block_t=32)),
           ("float32", None), ("float32", T()), ("float32", T(num_stages=4))]
EXTRA = os.environ.get("EXP_CONFIGS")
if EXTRA:
    NAMES = dict(LightningTritonConfig=LightningTritonConfig, LightningGluonConfig=LightningGluonConfig)
    CONFIGS = [(c.split(":", 1)[0], eval(c.split(":", 1)[1], NAMES)) for c in EXTRA.split(";")]


def _name(config):
    if config is None:
        return "default"
    return type(config).__name__ + "-" + "-".join(f"{f.name}{getattr(config, f.name)}"
                                                 for f in dataclasses.fields(config)
                                                 if getattr(config, f.name) != f.default)


def main():
    copy_bw = timing.copy_bandwidth()
    rows = []
    shapes = [(1, 64, 4096)] + ([(1, 8, 65536), (4, 64, 1024)] if os.environ.get("EXP_SHAPES") else [])
    for b, h, n in shapes:
        for dtype, cfg in CONFIGS:
            q, k, v, ed = _prefill_inputs(b, h, n, 128, 128, dtype)[0]
            tensors = dict(q=q, k=k, v=v, ed=ed)
            for fso in (False, True):
                name = f"B{b}-H{h}-N{n}-{dtype}-{'final' if fso else 'states'}-{_name(cfg)}"
                try:
                    plans = [plan_lightning_attention(target_for(q.device), info(q), info(k), info(v),
                                                      info(ed), None, block_size=256,
                                                      output_final_state_only=fso, config=c)
                             for c in (cfg, None)]
                    out = run_plan(plans[0], tensors)["output"]
                    ref = run_plan(plans[1], tensors)["output"]
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    t = timing.kernel_time_torch(lambda: run_plan(plans[0], tensors), rep_ms=100)
                    nbytes = _prefill_bytes(b, h, n, 128, 128, dtype, 256, fso)
                    rows.append(dict(name=name, kernel=plans[0].launches[0].kernel.fn.__name__,
                                     us=t * 1e6, x_floor=t / (nbytes / copy_bw), rel_to_default=err))
                except Exception as exc:  # noqa: BLE001
                    rows.append(dict(name=name, error=repr(exc)[:160]))
                print(rows[-1], flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "exp_lightning_configs.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

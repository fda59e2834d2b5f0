"""Experiment: production lightning prefill under config overrides (B=1, H=64,
N=4096, D=E=128), with and without the per-block states; L2 flushed.

    python3 -m benchmarks.experiments.exp_lightning_configs   (GPU only)
"""
import json
import os

import torch

from adapters.torch._executor import info, run_plan
from benchmarks import timing
from benchmarks.bench_lightning_attention import _prefill_bytes, _prefill_inputs
from core_kernels.lightning_attention import plan_lightning_attention

CONFIGS = [("bfloat16", {}), ("bfloat16", dict(num_stages=3)), ("bfloat16", dict(num_stages=4, block_t=32)),
           ("float32", {}), ("float32", dict(num_stages=4))]
EXTRA = os.environ.get("EXP_CONFIGS")  # "dtype:k=v,k=v;dtype:..."
if EXTRA:
    CONFIGS = [(c.split(":")[0], eval("dict(" + c.split(":")[1] + ")")) for c in EXTRA.split(";")]


def main():
    copy_bw = timing.copy_bandwidth()
    rows = []
    shapes = [(1, 64, 4096)] + ([(1, 8, 65536), (4, 64, 1024)] if os.environ.get("EXP_SHAPES") else [])
    for b, h, n in shapes:
        for dtype, cfg in CONFIGS:
            q, k, v, ed = _prefill_inputs(b, h, n, 128, 128, dtype)[0]
            ref = None
            for fso in (False, True):
                name = f"B{b}-H{h}-N{n}-{dtype}-{'final' if fso else 'states'}-" + "-".join(f"{a}{x}" for a, x in cfg.items())
                try:
                    plan = plan_lightning_attention(info(q), info(k), info(v), info(ed), None, block_size=256,
                                                    output_final_state_only=fso, **cfg)
                    tensors = dict(q=q, k=k, v=v, ed=ed)
                    out = run_plan(plan, tensors)["output"]
                    base = plan_lightning_attention(info(q), info(k), info(v), info(ed), None, block_size=256,
                                                    output_final_state_only=fso)
                    ref = run_plan(base, tensors)["output"]
                    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    t = timing.kernel_time_torch(lambda: run_plan(plan, tensors), rep_ms=100)
                    nbytes = _prefill_bytes(b, h, n, 128, 128, dtype, 256, fso)
                    rows.append(dict(name=name, us=t * 1e6, x_floor=t / (nbytes / copy_bw), rel_to_default=err))
                except Exception as exc:  # noqa: BLE001
                    rows.append(dict(name=name, error=repr(exc)[:160]))
                print(rows[-1], flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "exp_lightning_configs.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Experiment driver for Nsight Compute: run lightning prefill (B=1, H=64,
N=4096, D=E=128) once for warm-up and once to be profiled, with the planner's
choice or a config (a LightningTritonConfig(...) / LightningGluonConfig(...)
expression):

    ncu --kernel-name regex:prefill --launch-skip 1 --launch-count 1 \
        python3 -m benchmarks.experiments.exp_lightning_ncu bfloat16 "LightningTritonConfig(num_stages=3)"
"""
import sys

import torch

from adapters.torch._executor import info, run_plan, target_for
from core_kernels.lightning_attention import (LightningGluonConfig, LightningTritonConfig,
                                              plan_lightning_attention)

dtype = sys.argv[1]
config = eval(sys.argv[2] if len(sys.argv) > 2 else "None",
              dict(LightningTritonConfig=LightningTritonConfig, LightningGluonConfig=LightningGluonConfig))
tdt = getattr(torch, dtype)
q, k = (torch.randn(1, 64, 4096, 128, device="cuda", dtype=tdt) * 0.3 for _ in range(2))
v = torch.randn(1, 64, 4096, 128, device="cuda", dtype=tdt)
ed = torch.rand(64, device="cuda") * 0.5 + 0.01
plan = plan_lightning_attention(target_for(q.device), info(q), info(k), info(v), info(ed), None,
                                block_size=256, config=config)
for _ in range(2):
    run_plan(plan, dict(q=q, k=k, v=v, ed=ed))
torch.cuda.synchronize()

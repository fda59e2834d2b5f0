"""Experiment driver for Nsight Compute: run lightning prefill (B=1, H=64,
N=4096, D=E=128) once for warm-up and once to be profiled.

    ncu --kernel-name regex:prefill --launch-skip 1 --launch-count 1 \
        python3 -m benchmarks.experiments.exp_lightning_ncu bfloat16 "num_stages=3"
"""
import sys

import torch

from adapters.torch._executor import info, run_plan
from core_kernels.lightning_attention import plan_lightning_attention

dtype = sys.argv[1]
cfg = eval("dict(" + (sys.argv[2] if len(sys.argv) > 2 else "") + ")")
tdt = getattr(torch, dtype)
q, k = (torch.randn(1, 64, 4096, 128, device="cuda", dtype=tdt) * 0.3 for _ in range(2))
v = torch.randn(1, 64, 4096, 128, device="cuda", dtype=tdt)
ed = torch.rand(64, device="cuda") * 0.5 + 0.01
plan = plan_lightning_attention(info(q), info(k), info(v), info(ed), None, block_size=256, **cfg)
for _ in range(2):
    run_plan(plan, dict(q=q, k=k, v=v, ed=ed))
torch.cuda.synchronize()

"""Experiment: torch-side host time per call of lightning decode (B=1) and
prefill, before and after JAX (and jax-triton) are imported in the process,
with the executor's fast-path state. GPU only.

    python3 -m benchmarks.experiments.exp_host_overhead

Output of the run after the fast-path fix (c54272a):
results/experiments/exp_host_overhead_after_fix.txt.
"""
import time

import torch

import adapters.torch as at
from adapters.torch import _launcher as ex


def host_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    b, h, d = 1, 64, 128
    q, k, v = (torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cache = torch.randn(b, h, d, d, device="cuda")
    slope = torch.rand(h, device="cuda")
    slots = torch.arange(b, device="cuda", dtype=torch.int32)
    dec = lambda: at.linear_decode_forward_triton(q, k, v, cache, slope, slots)  # noqa: E731
    qp, kp, vp = (torch.randn(1, 64, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    pre = lambda: at.lightning_attention(qp, kp, vp, slope, 256, None, True)  # noqa: E731
    print("decode host us", host_us(dec), "prefill host us", host_us(pre), "fast", ex._FAST_PATH,
          "compiled", sum(len(r.compiled) for p in ex._PROGRAMS.values() for _, r in p.launches), flush=True)
    import jax  # noqa: F401
    import adapters.jax as aj
    aj.lightning_attention(*(jax.dlpack.from_dlpack(x) for x in (qp, kp, vp, slope)))
    print("after jax: decode host us", host_us(dec), "prefill host us", host_us(pre), "fast", ex._FAST_PATH,
          "compiled", sum(len(r.compiled) for p in ex._PROGRAMS.values() for _, r in p.launches), flush=True)


if __name__ == "__main__":
    main()

"""Experiment: where the torch eager host time of each op goes (cProfile over
the bench_host_overhead cases, GPU only), plus the cost of the pieces:
torch.empty of a small CUDA tensor and a cached compiled kernel's launcher.

    python3 -m benchmarks.experiments.exp_host_profile
"""
import cProfile
import io
import pstats

import torch

from benchmarks.bench_host_overhead import _cases, _recorded
from benchmarks.experiments.exp_host_overhead import host_us


def per_call_us(fn):
    return host_us(fn, n=2000)


def main():
    from adapters.torch import _launcher as ex
    print("torch.empty((1,)) us", per_call_us(lambda: torch.empty((1,), device="cuda")))
    print("torch.empty((64,8,128)) bf16 us",
          per_call_us(lambda: torch.empty((64, 8, 128), device="cuda", dtype=torch.bfloat16)))
    with torch.inference_mode():
        for name, call, _ in _cases():
            rec, (launchers, allocs, _) = _recorded(call)
            print(f"\n=== {name}: {per_call_us(call):.1f} us/call, fast path {ex._FAST_PATH}", flush=True)
            for (launch, _), launcher in zip(rec, launchers):
                if launcher is None:
                    print("  no cached launcher for", launch.kernel.fn.__name__)
                    continue
                print(f"  raw launcher {launch.kernel.fn.__name__}: {per_call_us(launcher):.1f} us")
            for alloc in allocs:
                print(f"  allocation: {per_call_us(alloc):.1f} us")
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(1000):
                call()
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
            print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:3500])


if __name__ == "__main__":
    main()

"""GPU timing shared by every benchmark (method summary: benchmarks/RESULTS.md). Times are
medians after warm-up over fresh inputs, with the L2 cold for memory-bound kernels; a
single JAX call timed with a sync after it would add JAX's own sync latency, so JAX is
timed as back-to-back calls with one sync at the end.

- ``kernel_time_torch``: CUDA-event median over many runs with L2 flushed
  before each run (triton.testing.do_bench) — GPU time of the torch launch.
- ``graph_cold_time_torch``: the same from one CUDA graph over enough input
  sets that each call reads cold (GPU time without the host; steadier than
  do_bench for kernels of a few microseconds).
- ``pipelined_time``: enqueue ``reps`` calls back to back (rotating between
  input sets so nothing stays in L2) and wait once; per-call time is
  max(GPU time, host dispatch time). This is how the JAX side is timed (JAX
  runs on its own stream, so torch events cannot see it), and the torch side
  is timed the same way for the JAX/torch ratio.
- ``host_overhead``: per-call host time of a tiny launch, with the GPU idle.
"""
from __future__ import annotations

import statistics
import time


def _sync(framework):
    if framework == "torch":
        import torch
        torch.cuda.synchronize()


def kernel_time_torch(fn, warmup_ms=25, rep_ms=200) -> float:
    """Median seconds of ``fn()`` on the GPU, cold L2."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e-3


def graph_time_torch(fn, n_sets: int, reps_per_set: int = 4) -> float:
    """Median seconds per call of ``fn(i)`` (i = input set) replayed from one
    CUDA graph of ``reps_per_set * n_sets`` calls over rotating input sets:
    GPU time without host gaps between launches."""
    import torch
    reps = reps_per_set * n_sets
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for r in range(reps):
            fn(r % n_sets)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / reps)
    return statistics.median(times)


def graph_cold_time_torch(fn, nbytes_per_set: int) -> float:
    """Seconds per call of ``fn(i)`` replayed from one CUDA graph of one call on
    each of K input sets (i = 0 .. K-1, K = cold_sets(nbytes_per_set): the sets
    together hold about 128 MiB, 2.5x the H200's L2): each call reads its inputs
    cold, with no host time between launches."""
    return graph_time_torch(fn, n_sets=cold_sets(nbytes_per_set), reps_per_set=1)


def cold_sets(nbytes_per_set: int) -> int:
    """How many input sets graph_cold_time_torch rotates over."""
    return max(8, min(2048, -(-128 * 2 ** 20 // nbytes_per_set)))


def pipelined_time(calls, framework: str, reps: int = 200, trials: int = 5) -> float:
    """Median over ``trials`` of (wall time of ``reps`` back-to-back calls) / reps.

    ``calls`` is a list of zero-argument callables over different input sets;
    a JAX callable returns arrays, the last of which is waited on.
    """
    def block(r):
        if framework == "jax":
            import jax
            jax.block_until_ready(r)
        else:
            _sync("torch")

    for c in calls:  # warm-up and compile
        block(c())
    results = []
    for _ in range(trials):
        block(calls[0]())
        t0 = time.perf_counter()
        r = None
        for i in range(reps):
            r = calls[i % len(calls)]()
        block(r)
        results.append((time.perf_counter() - t0) / reps)
    return statistics.median(results)


def host_overhead(call, framework: str, reps: int = 200, trials: int = 15) -> float:
    """Seconds of host time per call: the time to enqueue ``reps`` calls (fewer
    than the launch queue holds, so the host never waits for the GPU),
    median over trials, with the device drained between trials."""
    def drain(r):
        if framework == "jax":
            import jax
            jax.block_until_ready(r)
        else:
            _sync("torch")

    drain(call())
    results = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            r = call()
        results.append((time.perf_counter() - t0) / reps)
        drain(r)
    return statistics.median(results)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (read + write counted)."""
    import torch
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = kernel_time_torch(lambda: dst.copy_(src))
    return nbytes / t


def matmul_tflops(n: int = 8192) -> float:
    """Measured dense bf16 matmul rate in FLOP/s on random data."""
    import torch
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = kernel_time_torch(lambda: a @ b)
    return 2 * n ** 3 / t

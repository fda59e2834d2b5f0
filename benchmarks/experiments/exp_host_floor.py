"""Experiment: how low the eager host time of a checked op call can go in Python.

``ideal_decode`` is lightning decode (``linear_decode_forward_triton``) written
as one flat function with the checks the op keeps on every call (torch.compile
tracing, tensor subclasses, grad mode, the index-validation switch, the int
check of BLOCK_SIZE, the layout key of every tensor, the current device,
Triton launch hooks, the version bump of the written cache) and nothing else:
no custom-op layer, no plan / run_plan / launch functions, no dicts. Any
other call falls back to the op. It is timed beside the op, a plain Triton
launch of the same kernel and the floor pieces (C launcher, allocation,
layout key), on the GPU; with ``--stub`` the GPU touch points are stubbed as
in exp_host_python (Python time only, any machine).

    python3 -m benchmarks.experiments.exp_host_floor [--stub]
"""
from __future__ import annotations

import argparse
import functools
import operator

import torch


def make_ideal_decode():
    import adapters.torch as at
    from adapters.torch import _executor, _launcher as ex  # the launcher since the executor's split
    from adapters.torch._register import _any_requires_grad, _increment_version
    from core_kernels._index_check import _env_on
    from core_kernels.lightning_attention import plan_linear_decode

    Tensor, is_compiling, grad_enabled = torch.Tensor, torch.compiler.is_compiling, torch.is_grad_enabled
    reduce, or_, cache = functools.reduce, operator.or_, {}
    full = at.linear_decode_forward_triton

    def linear_decode(q, k, v, kv_caches, slope_rate, slot_idx, BLOCK_SIZE=32, *, config=None,
                      validate_indices=None):
        if (is_compiling() or type(q) is not Tensor or config is not None or validate_indices
                or (validate_indices is None and _env_on()) or type(BLOCK_SIZE) is not int
                or (grad_enabled() and _any_requires_grad(q, k, v, kv_caches, slope_rate, slot_idx))):
            return full(q, k, v, kv_caches, slope_rate, slot_idx, BLOCK_SIZE, config=config,
                        validate_indices=validate_indices)
        try:
            key = ((q.shape, q.stride(), q.dtype, q.device), (k.shape, k.stride(), k.dtype, k.device),
                   (v.shape, v.stride(), v.dtype, v.device),
                   (kv_caches.shape, kv_caches.stride(), kv_caches.dtype, kv_caches.device),
                   (slope_rate.shape, slope_rate.stride(), slope_rate.dtype, slope_rate.device),
                   (slot_idx.shape, slot_idx.stride(), slot_idx.dtype, slot_idx.device))
        except AttributeError:
            key = None
        hit = cache.get(key)
        if hit is None:
            out = full(q, k, v, kv_caches, slope_rate, slot_idx, BLOCK_SIZE)
            tensors = dict(q=q, k=k, v=v, kv_caches=kv_caches, slope_rate=slope_rate, slot_idx=slot_idx)
            plan, device = _executor.planned(plan_linear_decode, tensors, config=None)
            prog = ex._program(plan)
            if key is not None and len(prog.launches) == 1 and [a[4] for a in prog.allocs] == [ex._EMPTY]:
                (name, shape, strides, dtype, _, _), = prog.allocs
                recipe = prog.launches[0][1]
                order = [("output" if n == name else n) for n in recipe.ptr_names]
                pick = operator.itemgetter(*[["q", "k", "v", "kv_caches", "slope_rate", "slot_idx",
                                              "output"].index(n) for n in order])
                cache[key] = (shape, strides, dtype, q.device, device.index, recipe, pick)
            return out
        shape, strides, dtype, device, index, recipe, pick = hit
        out = torch.empty_strided(shape, strides, dtype=dtype, device=device)
        ptrs = [t.data_ptr() for t in pick((q, k, v, kv_caches, slope_rate, slot_idx, out))]
        entry = recipe.compiled.get(index if not reduce(or_, ptrs, 0) & 15 else ex._spec(index, ptrs, ()))
        if entry is None or index != ex._current_device() or ex._hooks_set():
            return full(q, k, v, kv_caches, slope_rate, slot_idx, BLOCK_SIZE)
        entry(ex._raw_stream(index), recipe.getter(ptrs + recipe.consts))
        _increment_version((kv_caches,))
        return out
    return linear_decode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stub", action="store_true", help="stub the GPU (Python time only)")
    a = ap.parse_args()
    dev = "cpu" if a.stub else "cuda"
    if a.stub:
        from benchmarks.experiments.exp_host_python import stub_gpu
        stub_gpu()
    import adapters.torch as at
    from benchmarks import timing
    from benchmarks.bench_host_overhead import _floor_us, _plain, _recorded
    b, h, d = 1, 64, 128
    q, k, v = (torch.randn(b, h, 1, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    cache = torch.randn(b, h, d, d, device=dev)
    slope = torch.rand(h, device=dev)
    slots = torch.arange(b, device=dev, dtype=torch.int32)
    ideal = make_ideal_decode()
    op = lambda: at.linear_decode_forward_triton(q, k, v, cache, slope, slots)  # noqa: E731
    flat = lambda: ideal(q, k, v, cache, slope, slots)  # noqa: E731
    with torch.inference_mode():
        op(), flat(), flat()
        if a.stub:
            import time
            for name, fn in (("op", op), ("ideal", flat), ("op", op), ("ideal", flat)):
                t0 = time.perf_counter()
                for _ in range(20000):
                    fn()
                print(f"{name:6s} {(time.perf_counter() - t0) / 20000 * 1e6:6.2f} us per call (Python only)")
            return
        ref = cache.clone()
        o1 = op()
        cache.copy_(ref)
        o2 = flat()
        torch.cuda.synchronize()
        print("ideal == op:", torch.equal(o1, o2))
        rec, floor = _recorded(op)
        plain = _plain(rec)
        plain()
        launcher, alloc, check = _floor_us(floor)
        rows = []
        for r in range(3):
            row = {"op": timing.host_overhead(op, "torch") * 1e6,
                   "ideal": timing.host_overhead(flat, "torch") * 1e6,
                   "triton": timing.host_overhead(plain, "torch") * 1e6}
            rows.append(row)
            print(f"round {r}: op {row['op']:.2f} us ({row['op'] / row['triton']:.3f}x), ideal "
                  f"{row['ideal']:.2f} us ({row['ideal'] / row['triton']:.3f}x), plain Triton {row['triton']:.2f} us",
                  flush=True)
        print(f"floor pieces: launcher {launcher:.2f} us, allocation {alloc:.2f} us, layout key {check:.2f} us")


if __name__ == "__main__":
    main()

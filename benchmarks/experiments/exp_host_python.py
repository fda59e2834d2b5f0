"""Experiment: the Python host time of every torch op's eager call, on any machine.

The GPU path of the torch executor runs on CPU tensors with its CUDA touch
points stubbed: the device the plan cache records reads as a GPU, the target
is an H200's, allocations land on the host, and the cached compiled kernel's
C launcher is a no-op. What is left is the Python between the user's call
and the launcher (argument checks, the plan cache, the custom-op wrapper,
buffers, argument packing), the part of issue 18's host target that this
package controls; the launcher itself and a CUDA allocation come on top
(benchmarks/bench_host_overhead.py measures the whole call on the GPU).

    python3 -m benchmarks.experiments.exp_host_python [--profile NAME]
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import time
import types

import torch


class _FakeCuda:
    type = "cuda"
    index = 0

    def __repr__(self):
        return "cuda:0 (stub)"


def _torch_proxy():
    """The torch module as the executor sees it: CUDA calls stubbed, allocations on the host."""
    def alloc(fn):
        def f(*args, device=None, **kwargs):
            return fn(*args, **kwargs)
        return f
    cuda = types.SimpleNamespace(current_device=lambda: 0, is_current_stream_capturing=lambda: False,
                                 device=lambda d: contextlib.nullcontext(), is_available=lambda: False)
    c = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda i: 0)

    class Proxy(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)
    p = Proxy("torch_stub")
    p.empty, p.zeros, p.cuda, p._C = alloc(torch.empty), alloc(torch.zeros), cuda, c
    return p


class _NoLaunch:
    """A cached compiled kernel (adapters.torch._executor._Compiled) whose C launch
    does nothing (or appends its arguments to ``launched``)."""
    grid, function, coop, pdl, meta = (1, 1, 1), 0, False, False, None

    def __init__(self, launched=None):
        self.launched = launched

    def raw(self, *args):
        if self.launched is not None:
            self.launched.append(args[13:])  # the kernel's own arguments

    def __call__(self, stream, args):
        if self.launched is not None:
            self.launched.append(tuple(args))


class _AlwaysCompiled(dict):
    def __init__(self, entry):
        super().__init__()
        self.entry = entry

    def get(self, key, default=None):
        return self.entry


def stub_gpu(patch=setattr, launched=None):
    """Route the torch executor's GPU path to host stubs (see the module doc).
    ``patch``: how to set each attribute (a test passes monkeypatch.setattr);
    ``launched``: a list that gets every launch's kernel arguments."""
    import importlib

    from adapters.torch import _executor as ex
    from core_kernels._target import Target
    # the executor's modules (plan cache, launcher, call memo, replay since the split of
    # 2026-11-27): each name is patched wherever a module holds it
    launcher = importlib.import_module("adapters.torch._launcher")
    mods = [ex, launcher] + [importlib.import_module(f"adapters.torch.{m}")
                             for m in ("_device", "_call_memo", "_replay")]

    def patch_all(name, value):
        for m in mods:
            if hasattr(m, name):
                patch(m, name, value)
    device = _FakeCuda()
    orig_check = ex.check_devices
    entry = _NoLaunch(launched)

    def check_devices(**tensors):
        orig_check(**tensors)
        return device
    patch(ex, "check_devices", check_devices)
    patch(ex, "target_for", lambda d: Target("cuda", 90, 132, gluon=True))
    patch_all("torch", _torch_proxy())
    patch_all("_current_device", lambda: 0)
    patch_all("_raw_stream", lambda index: 0)
    patch_all("_is_capturing", lambda: False)  # the executor's capture check since 2026-11-25
    patch_all("_FAST_PATH", True)
    empty_strided = torch.empty_strided  # the executor's allocation since 2026-11-25
    patch_all("_empty_strided", lambda *args, device=None, **kwargs: empty_strided(*args, **kwargs))
    orig_recipe = launcher._Recipe.__init__

    def recipe(self, launch):
        orig_recipe(self, launch)
        self.compiled = _AlwaysCompiled(entry)
    patch(launcher._Recipe, "__init__", recipe)


def cases():
    """(name, call) at the sizes of bench_host_overhead, on CPU tensors (also the
    calls of tests/test_architecture.py's check of the launch argument order)."""
    import adapters.torch as at
    from benchmarks.registry import BLOCKSPARSE_MODEL, PREFIX_PREFILL_MODEL
    from core_kernels.blocksparse_attention import build_sparse_layout

    bf16 = torch.bfloat16
    out = []
    po, so = torch.randn(2, 1, 32, 128, dtype=bf16)
    pl, sl = torch.randn(2, 32, 1)
    o, lse = torch.empty_like(po), torch.empty(32, 1)
    out.append(("merge_attn_states N1 32x128", lambda: at.merge_attn_states(o, po, pl, so, sl, lse)))
    q, k, v = (torch.randn(1, 64, 1, 128, dtype=bf16) for _ in range(3))
    cache = torch.randn(1, 64, 128, 128)
    slope = torch.rand(64)
    slots = torch.arange(1, dtype=torch.int32)
    out.append(("linear_decode B1 H64", lambda: at.linear_decode_forward_triton(q, k, v, cache, slope, slots)))
    qp, kp, vp = (torch.randn(1, 8, 64, 128, dtype=bf16) for _ in range(3))
    s8 = slope[:8].contiguous()
    out.append(("lightning_attention B1 H8 N64", lambda: at.lightning_attention(qp, kp, vp, s8, 256, None, True)))
    cu = torch.tensor([0, 33, 73], dtype=torch.int32)
    qv, kv_, vv = (torch.randn(73, 8, 128, dtype=bf16) for _ in range(3))
    vcache = torch.randn(4, 8, 128, 128)
    vslots = torch.tensor([2, 0], dtype=torch.int32)
    out.append(("lightning_attention_varlen B2", lambda: at.lightning_attention_varlen(
        qv, kv_, vv, s8, cu, kv_cache=vcache, slot_idx=vslots)))
    m = PREFIX_PREFILL_MODEL
    hq, hkv, d, bs = m["hq"], m["hkv"], m["d"], m["block_size"]
    x = 8
    pq = torch.randn(16, hq, d, dtype=bf16)
    pk, pv = (torch.randn(16, hkv, d, dtype=bf16) for _ in range(2))
    kc, vc = torch.randn(4, hkv, d // x, bs, x, dtype=bf16), torch.randn(4, hkv, d, bs, dtype=bf16)
    b_loc = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    b_start = torch.tensor([0, 16], dtype=torch.int32)
    b_seq = torch.tensor([64], dtype=torch.int32)
    one = torch.ones(1)
    pout = torch.empty_like(pq)
    out.append(("context_attention_fwd B1 q16 ctx48", lambda: at.context_attention_fwd(
        pq, pk, pv, pout, "auto", kc, vc, b_loc, b_start, b_seq, 0, 16, one, one)))
    bm = BLOCKSPARSE_MODEL
    hq, hkv, d, bs = bm["hq"], bm["hkv"], bm["d"], bm["block_size"]
    for label, n, decode in (("decode 1x16384", 16384, True), ("prefill 1x64", 64, False)):
        (crow, col), _ = build_sparse_layout(hq, n, bs, bm["local_blocks"], bm["vert_stride"], bm["homo_head"])
        crow, col = torch.from_numpy(crow.copy()), torch.from_numpy(col.copy())
        cu_k = torch.tensor([0, n], dtype=torch.int32)
        bq = torch.randn(1 if decode else n, hq, d, dtype=bf16)
        bk, bv = (torch.randn(n if not decode else 256, hkv, d, dtype=bf16) for _ in range(2))
        if decode:
            bk, bv = (torch.randn(n, hkv, d, dtype=bf16).as_strided((n, hkv, d), (hkv * d, d, 1))
                      for _ in range(2))
        out.append((f"blocksparse {label}", lambda bq=bq, bk=bk, bv=bv, cu_k=cu_k, decode=decode, crow=crow,
                    col=col, n=n: at.blocksparse_flash_attn_varlen_fwd(
                        bq, bk, bv, cu_k, None if decode else cu_k, None, (crow, col),
                        block_size=bs, max_seqlen=n)))
    return out


def per_call_us(fn, n=3000, trials=7):
    fn()
    best = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n * 1e6)
    best.sort()
    return best[len(best) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None, help="substring of a case name to profile")
    a = ap.parse_args()
    stub_gpu()
    print("torch.empty((1,)) on the host:", f"{per_call_us(lambda: torch.empty((1,))):.2f} us")
    with torch.inference_mode():
        for name, call in cases():
            print(f"{name:40s} {per_call_us(call):6.2f} us per call", flush=True)
            if a.profile and a.profile in name:
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(2000):
                    call()
                pr.disable()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
                print(s.getvalue())


if __name__ == "__main__":
    main()

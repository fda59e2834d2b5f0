"""lightning_attention_varlen on the GPU: one launch for a packed batch against a
Python loop of single-sequence ``lightning_attention`` calls (what an engine does
without this op), the byte floor and the measured copy bandwidth; torch and JAX.

Floor: read q, k, v and write o once, plus each named slot's state read and
written (2·B·H·D·E·4 bytes). `x_floor` = time / (floor bytes / copy bandwidth).
`loop_us`: per sequence, q/k/v as [1, H, n, D] views of the packed tensors,
lightning_attention(..., kv_history=cache[slot:slot + 1], output_final_state_only=True),
its output copied into the packed output and its final state into the slot
(CUDA-event time of the whole loop, host gaps included); `x_loop` = loop / ours.
torch times are CUDA-event medians with L2 flushed; jax/torch compares pipelined
dispatch of both (see timing.py). Sweep rows force a LightningVarlenConfig.
"""
from __future__ import annotations

import gc
import traceback

from benchmarks import timing
from benchmarks.registry import LIGHTNING_VARLEN

COLUMNS = ["name", "us", "TB/s", "%copy", "x_floor", "loop_us", "x_loop", "jax_us", "torch_pipe_us",
           "jax/torch", "bitwise", "items", "error"]


def _bytes(t, b, h, d, e, dtype):
    isz = 4 if dtype == "float32" else 2
    return t * h * (2 * d + 2 * e) * isz + 2 * b * h * d * e * 4


def _inputs(lens, h, d, e, dtype, sets=1):
    import torch
    tdt = getattr(torch, dtype)
    t, b = sum(lens), len(lens)
    cu = torch.tensor([0] + list(lens), device="cuda").cumsum(0).to(torch.int32)
    out = []
    for _ in range(sets):
        cache = torch.randn(b + 4, h, d, e, device="cuda") * 0.1
        slots = torch.randperm(b + 4, device="cuda")[:b]
        out.append((torch.randn(t, h, d, device="cuda", dtype=tdt) * 0.3,
                    torch.randn(t, h, d, device="cuda", dtype=tdt) * 0.3,
                    torch.randn(t, h, e, device="cuda", dtype=tdt),
                    torch.rand(h, device="cuda") * 0.5 + 0.01, cu, cache, slots))
    return out


def _loop(at, q, k, v, ed, cu_host, cache, slots_host, out):
    """The engine's loop: one single-sequence prefill per sequence, state to and from its slot."""
    for b, slot in enumerate(slots_host):
        lo, hi = cu_host[b], cu_host[b + 1]
        if hi == lo:
            continue
        o, kv = at.lightning_attention(q[lo:hi].transpose(0, 1).unsqueeze(0),
                                       k[lo:hi].transpose(0, 1).unsqueeze(0),
                                       v[lo:hi].transpose(0, 1).unsqueeze(0), ed, 256,
                                       cache[slot:slot + 1], True)
        out[lo:hi].copy_(o[0].transpose(0, 1))
        cache[slot].copy_(kv[0])
    return out


def _row(name, t, nbytes, copy_bw, **extra):
    return dict(name=name, us=t * 1e6, **{"TB/s": nbytes / t / 1e12, "%copy": 100 * nbytes / t / copy_bw,
                                          "x_floor": t / (nbytes / copy_bw)}, **extra)


def cases(copy_bw):
    import jax
    import torch
    import adapters.jax as aj
    import adapters.torch as at
    from adapters.torch._executor import info, target_for
    from core_kernels.lightning_attention import plan_lightning_attention_varlen
    from core_kernels.lightning_attention.varlen_plan import varlen_work_items
    rows = []
    for case in LIGHTNING_VARLEN:
        lens, h, d, e, dtype, name = (case[x] for x in ("lens", "h", "d", "e", "dtype", "name"))
        try:
            sets = _inputs(lens, h, d, e, dtype, sets=2)
            nbytes = _bytes(sum(lens), len(lens), h, d, e, dtype)
            q, k, v, ed, cu, cache, slots = sets[0]
            plan = plan_lightning_attention_varlen(target_for(q.device), *(info(x) for x in sets[0]))
            calls = [lambda s=s: at.lightning_attention_varlen(*s[:5], kv_cache=s[5], slot_idx=s[6])
                     for s in sets]
            t = timing.kernel_time_torch(calls[0])
            reps = max(10, min(200, int(0.2 / t)))
            t_pipe = timing.pipelined_time(calls, "torch", reps=reps, trials=3)
            # the loop over sequences (its indices on the host, as an engine has them)
            cu_host, slots_host = cu.tolist(), slots.tolist()
            loop_out = torch.empty(q.shape[0], h, e, device="cuda", dtype=q.dtype)
            t_loop = timing.kernel_time_torch(
                lambda: _loop(at, q, k, v, ed, cu_host, cache, slots_host, loop_out))
            # JAX: the cache donated and carried from call to call
            jf = jax.jit(lambda q, k, v, ed, cu, c, s: aj.lightning_attention_varlen(
                q, k, v, ed, cu, kv_cache=c, slot_idx=s), donate_argnums=(5,))
            jsets = [[jax.dlpack.from_dlpack(x) for x in s] for s in sets]
            state = [jax.dlpack.from_dlpack(s[5].clone()) for s in sets]

            def jcall(i):
                out, state[i] = jf(*jsets[i][:5], state[i], jsets[i][6])
                return state[i]
            t_jax = timing.pipelined_time([lambda i=i: jcall(i) for i in range(2)], "jax", reps=reps,
                                          trials=3)
            # bitwise: one call each from the same cache; and the loop's agreement
            c_t, c_j = cache.clone(), jax.dlpack.from_dlpack(cache.clone())
            o_t, _ = at.lightning_attention_varlen(q, k, v, ed, cu, kv_cache=c_t, slot_idx=slots)
            o_j, c_j = jax.jit(lambda *a: aj.lightning_attention_varlen(
                *a[:5], kv_cache=a[5], slot_idx=a[6]))(*jsets[0][:5], c_j, jsets[0][6])
            bitwise = torch.equal(o_t, torch.from_dlpack(o_j)) and torch.equal(c_t, torch.from_dlpack(c_j))
            c_l = cache.clone()
            o_l = _loop(at, q, k, v, ed, cu_host, c_l, slots_host, torch.empty_like(o_t))
            rel = ((o_t.float() - o_l.float()).norm() / o_l.float().norm()).item()
            rows.append(_row(name, t, nbytes, copy_bw, loop_us=t_loop * 1e6, x_loop=t_loop / t,
                             jax_us=t_jax * 1e6, torch_pipe_us=t_pipe * 1e6,
                             **{"jax/torch": t_jax / t_pipe}, bitwise=bitwise,
                             items=varlen_work_items(plan), vs_loop_rel_err=rel))
            if case.get("sweep"):
                rows += sweep(name, sets[0], nbytes, copy_bw)
        except Exception as exc:
            traceback.print_exc()
            rows.append(dict(name=name, error=repr(exc)[:160]))
        sets = jsets = calls = state = None
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def sweep(name, tensors, nbytes, copy_bw):
    """The Gluon kernels with and without longest-first order, then the Triton
    kernel's segment lengths and E-tiles (torch launch, cold L2)."""
    import dataclasses
    from adapters.torch._executor import info, run_plan, target_for
    from core_kernels.lightning_attention import (LightningVarlenConfig, LightningVarlenGluonConfig,
                                                  plan_lightning_attention_varlen)
    from core_kernels.lightning_attention.varlen_plan import varlen_work_items
    C, G = LightningVarlenConfig, LightningVarlenGluonConfig
    configs = [G(longest_first=True), G(longest_first=False), C(), C(segment_len=4096), C(segment_len=1024)]
    if tensors[0].dtype.itemsize == 2:
        configs += [G(stages=4), C(block_e=32), C(block_e=64, num_stages=2)]
    names = ("q", "k", "v", "ed", "cu_seqlens", "kv_cache", "slot_idx")
    env = dict(zip(names, tensors))
    rows = []
    for cfg in configs:
        label = "-".join(f"{f.name}{getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                         if getattr(cfg, f.name) is not None and f.name != "dot_precision")
        row_name = f"sweep-{name}-{'gluon' if isinstance(cfg, G) else 'triton'}-{label}".rstrip("-")
        try:
            plan = plan_lightning_attention_varlen(target_for(tensors[0].device), *(info(x) for x in tensors),
                                                   config=cfg)
            t = timing.kernel_time_torch(lambda: run_plan(plan, env), rep_ms=100)
            rows.append(_row(row_name, t, nbytes, copy_bw, items=varlen_work_items(plan)))
        except Exception as exc:  # a config that does not compile
            rows.append(dict(name=row_name, error=repr(exc)[:120]))
    return rows


def run():
    copy_bw = timing.copy_bandwidth()
    rows = [dict(name="copy-bandwidth", **{"TB/s": copy_bw / 1e12})]
    try:
        rows += cases(copy_bw)
    except Exception as exc:
        traceback.print_exc()
        rows.append(dict(name="cases", error=repr(exc)[:160]))
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if "loop_us" in r]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.5))
    y = range(len(rows))
    ax.barh([i - 0.2 for i in y], [r["us"] for r in rows], height=0.4, label="one launch (varlen)")
    ax.barh([i + 0.2 for i in y], [r["loop_us"] for r in rows], height=0.4,
            label="loop of single-sequence calls")
    ax.set_yticks(list(y), [r["name"] for r in rows])
    ax.set_xlabel("us (H200 GPU time, cold L2)")
    ax.invert_yaxis()
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)

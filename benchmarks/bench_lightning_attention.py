"""Lightning attention on the GPU: prefill and decode, torch and JAX, against
the byte floor, the measured copy bandwidth and the plain-framework versions.

Prefill floor: read q, k, v and write o once, plus the returned states
((NB + 1) or 1 per head, fp32). Decode: 2·B·H·D·E·4 bytes of state (read +
write), the q/k/v/o vectors are noise. `x_floor` = time / (floor bytes / copy
bandwidth). torch times are CUDA-event medians with L2 flushed; jax/torch
compares pipelined dispatch of both (see timing.py). Decode rows also carry
`graph_us` / `graph_TB/s`: steps replayed back to back from one CUDA graph.
"""
from __future__ import annotations

import dataclasses
import gc
import traceback

import numpy as np

from benchmarks import timing
from benchmarks.registry import LIGHTNING_DECODE, LIGHTNING_PREFILL

COLUMNS = ["name", "us", "TB/s", "%copy", "x_floor", "jax_us", "torch_pipe_us", "jax/torch",
           "bitwise", "graph_us", "graph_TB/s", "baseline", "baseline_us", "vs_baseline"]
MODEL_KERNEL_US = {"prefill-B1-H64-N4096-float32": 1090.0, "decode-B64-bfloat16": 169.0}


def _prefill_bytes(b, h, n, d, e, dtype, block_size, fso):
    isz = 4 if dtype == "float32" else 2
    states = 1 if fso else -(-n // block_size) + 1
    return b * h * n * (2 * d + 2 * e) * isz + states * b * h * d * e * 4


def _prefill_inputs(b, h, n, d, e, dtype, sets=1):
    import torch
    tdt = getattr(torch, dtype)
    out = []
    for _ in range(sets):
        out.append((torch.randn(b, h, n, d, device="cuda", dtype=tdt) * 0.3,
                    torch.randn(b, h, n, d, device="cuda", dtype=tdt) * 0.3,
                    torch.randn(b, h, n, e, device="cuda", dtype=tdt),
                    torch.rand(h, device="cuda") * 0.5 + 0.01))
    return out


def _row(name, t, nbytes, copy_bw, **extra):
    return dict(name=name, us=t * 1e6, **{"TB/s": nbytes / t / 1e12, "%copy": 100 * nbytes / t / copy_bw,
                                          "x_floor": t / (nbytes / copy_bw)}, **extra)


def _ours_row(name, t, nbytes, copy_bw, t_pipe, t_jax, pairs):
    """Our op's row: bandwidth, JAX/torch (both pipelined), torch == JAX bit for bit over
    the (torch tensor, JAX array) result pairs, and the modelled kernel where measured."""
    import torch
    bitwise = all(torch.equal(a, torch.from_dlpack(b)) for a, b in pairs)
    row = _row(name, t, nbytes, copy_bw, jax_us=t_jax * 1e6, torch_pipe_us=t_pipe * 1e6,
               **{"jax/torch": t_jax / t_pipe}, bitwise=bitwise)
    if name in MODEL_KERNEL_US:
        row.update(baseline="vllm-kernel(same H200)", baseline_us=MODEL_KERNEL_US[name],
                   vs_baseline=MODEL_KERNEL_US[name] * 1e-6 / t)
    return row


def _config_name(config) -> str:
    """A sweep row's suffix: '' for the planner's choice; a Triton config's set fields
    (e.g. 'block_e32-num_stages2', the names of the rows before configs existed, when
    any tiling keyword forced the Triton kernel), or 'triton' when none is set; 'gluon'
    and a Gluon config's set fields."""
    if config is None:
        return ""
    fields = [f"{f.name}{getattr(config, f.name)}" for f in dataclasses.fields(config)
              if getattr(config, f.name) != f.default]
    if type(config).__name__ == "LightningTritonConfig":
        return "-".join(fields) or "triton"
    return "-".join(["gluon"] + fields)


def prefill_sweep(copy_bw):
    """Kernel / tile / warp / stage / segment variants (torch launch, cold L2): the
    planner's choice (None) and configs that force the Triton or Gluon kernel."""
    import torch
    from adapters.torch._executor import info, run_plan, target_for
    from core_kernels.lightning_attention import (LightningGluonConfig, LightningTritonConfig,
                                                  plan_lightning_attention)
    T = LightningTritonConfig
    rows = []
    variants = {"float32": [None, T(), T(num_stages=4), T(block_t=16, num_warps=4, num_stages=4)],
                "bfloat16": [None, T(), T(block_e=32), T(block_e=32, num_stages=2),
                             T(block_e=64, num_stages=2)]}
    long_seq = {"float32": [None, T()], "bfloat16": [None, T(), T(block_e=64),
                                                    LightningGluonConfig(num_segments=16)]}
    shapes = [((1, 64, 4096, 128, 128), variants), ((1, 8, 65536, 128, 128), long_seq)]
    for (b, h, n, d, e), var in shapes:
        for dtype, configs in var.items():
            q, k, v, ed = _prefill_inputs(b, h, n, d, e, dtype)[0]
            nbytes = _prefill_bytes(b, h, n, d, e, dtype, 256, False)
            for cfg in configs:
                name = f"sweep-B{b}-H{h}-N{n}-{dtype}-" + _config_name(cfg)
                try:
                    plan = plan_lightning_attention(target_for(q.device), info(q), info(k), info(v),
                                                    info(ed), None, block_size=256, config=cfg)
                    tensors = dict(q=q, k=k, v=v, ed=ed)
                    t = timing.kernel_time_torch(lambda: run_plan(plan, tensors), rep_ms=100)
                    rows.append(_row(name, t, nbytes, copy_bw))
                except Exception as exc:  # a config that does not compile (shared memory)
                    rows.append(dict(name=name, error=repr(exc)[:120]))
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def _jnp_prefill(q, k, v, ed, block=256):
    """What a JAX user would write: the chunked form under lax.scan, fp32 math."""
    import jax
    import jax.numpy as jnp
    b, h, n, d = q.shape
    e = v.shape[-1]
    nb = n // block
    s = ed.reshape(1, h, 1, 1).astype(jnp.float32)
    i = jnp.arange(block, dtype=jnp.float32)
    causal = jnp.where(i[:, None] >= i[None, :], jnp.exp(-s * (i[:, None] - i[None, :])), 0.0)
    q_dec = jnp.exp(-s[..., 0] * (i + 1))[..., None]          # [1, H, T, 1]
    k_dec = jnp.exp(-s[..., 0] * (block - 1 - i))[..., None]
    blk_dec = jnp.exp(-s * block)
    qs, ks, vs = (x.reshape(b, h, nb, block, -1).transpose(2, 0, 1, 3, 4).astype(jnp.float32)
                  for x in (q, k, v))

    def step(state, x):
        qb, kb, vb = x
        o = jnp.einsum("bhij,bhje->bhie", jnp.einsum("bhid,bhjd->bhij", qb, kb) * causal, vb)
        o = o + jnp.einsum("bhid,bhde->bhie", qb * q_dec, state)
        new = state * blk_dec + jnp.einsum("bhjd,bhje->bhde", kb * k_dec, vb)
        return new, (o, state)

    final, (o, states) = jax.lax.scan(step, jnp.zeros((b, h, d, e), jnp.float32), (qs, ks, vs))
    o = o.transpose(1, 2, 0, 3, 4).reshape(b, h, n, e).astype(q.dtype)
    return o, jnp.concatenate([states.transpose(1, 2, 0, 3, 4), final[:, :, None]], axis=2)


def prefill_cases(copy_bw):
    import jax
    import torch
    import adapters.jax as aj
    import adapters.torch as at
    rows = []
    for case in LIGHTNING_PREFILL:
        b, h, n, d, e, dtype, fso = (case[k] for k in ("b", "h", "n", "d", "e", "dtype", "fso"))
        name = case["name"]
        try:
            sets = _prefill_inputs(b, h, n, d, e, dtype, sets=2)
            nbytes = _prefill_bytes(b, h, n, d, e, dtype, 256, fso)
            calls = [lambda s=s: at.lightning_attention(*s, 256, None, fso) for s in sets]
            t = timing.kernel_time_torch(calls[0])
            reps = max(10, min(200, int(0.2 / t)))
            t_pipe = timing.pipelined_time(calls, "torch", reps=reps, trials=3)
            jf = jax.jit(lambda q, k, v, ed: aj.lightning_attention(q, k, v, ed, block_size=256,
                                                                   output_final_state_only=fso))
            jsets = [[jax.dlpack.from_dlpack(x) for x in s] for s in sets]
            t_jax = timing.pipelined_time([lambda s=s: jf(*s) for s in jsets], "jax", reps=reps, trials=3)
            o_t, kv_t = calls[0]()
            o_j, kv_j = jf(*jsets[0])
            rows.append(_ours_row(name, t, nbytes, copy_bw, t_pipe, t_jax, ((o_t, o_j), (kv_t, kv_j))))
            if case.get("jnp_baseline"):
                jb = jax.jit(_jnp_prefill)
                t_b = timing.pipelined_time([lambda s=s: jb(*s) for s in jsets], "jax", reps=20, trials=3)
                rows.append(_row(name + "-jnp-scan", t_b, nbytes, copy_bw, baseline="jnp lax.scan chunked",
                                 baseline_us=t_b * 1e6, vs_baseline=t_b / min(t_jax, t_pipe)))
        except Exception as exc:
            traceback.print_exc()
            rows.append(dict(name=name, error=repr(exc)[:160]))
        sets = jsets = calls = None
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _decode_inputs(b, h, d, dtype, num_slots):
    import torch
    tdt = getattr(torch, dtype)
    q, k, v = (torch.randn(b, h, 1, d, device="cuda", dtype=tdt) for _ in range(3))
    cache = torch.randn(num_slots, h, d, d, device="cuda") * 0.1
    slope = torch.rand(h, device="cuda") * 0.5 + 0.01
    slots = torch.randperm(num_slots, device="cuda")[:b]
    return q, k, v, cache, slope, slots


def _torch_decode_math(q, k, v, cache, slope, slots):
    """What a torch user would write (all rows valid), for torch.compile."""
    import torch
    s = cache.index_select(0, slots)
    lam = torch.exp(-slope).view(1, -1, 1, 1)
    s = lam * s + k[:, :, 0, :, None].float() * v[:, :, 0, None, :].float()
    cache.index_copy_(0, slots, s)
    o = (q[:, :, 0, :, None].float() * s).sum(2)
    return o.reshape(q.shape[0], -1).to(q.dtype)


def _jnp_decode_math(q, k, v, cache, slope, slots):
    import jax.numpy as jnp
    s = cache[slots]
    lam = jnp.exp(-slope).reshape(1, -1, 1, 1)
    s = lam * s + k[:, :, 0, :, None].astype(jnp.float32) * v[:, :, 0, None, :].astype(jnp.float32)
    o = jnp.einsum("bhd,bhde->bhe", q[:, :, 0].astype(jnp.float32), s)
    return o.reshape(q.shape[0], -1).astype(q.dtype), cache.at[slots].set(s)


def decode_sweep(copy_bw):
    from adapters.torch._executor import info, run_plan, target_for
    from core_kernels.lightning_attention import LightningDecodeConfig, plan_linear_decode
    rows = []
    b, h, d = 64, 64, 128
    q, k, v, cache, slope, slots = _decode_inputs(b, h, d, "bfloat16", b)
    nbytes = 2 * b * h * d * d * 4
    for block_e, warps in ((64, 2), (64, 4), (64, 8), (32, 4), (64, 4), (64, 2)):
        name = f"sweep-decode-B{b}-bf16-be{block_e}-w{warps}"
        try:
            plan = plan_linear_decode(target_for(q.device), info(q), info(k), info(v), info(cache),
                                      info(slope), info(slots),
                                      config=LightningDecodeConfig(block_e, warps))
            tensors = dict(q=q, k=k, v=v, kv_caches=cache, slope_rate=slope, slot_idx=slots)
            t = timing.kernel_time_torch(lambda: run_plan(plan, tensors), rep_ms=100)
            rows.append(_row(name, t, nbytes, copy_bw))
        except Exception as exc:
            rows.append(dict(name=name, error=repr(exc)[:120]))
    return rows


def decode_cases(copy_bw):
    import jax
    import torch
    import adapters.jax as aj
    import adapters.torch as at
    rows = []
    for case in LIGHTNING_DECODE:
        b, h, d, dtype = case["b"], case["h"], case["d"], case["dtype"]
        name = case["name"]
        try:
            q, k, v, cache, slope, slots = _decode_inputs(b, h, d, dtype, b)
            nbytes = 2 * b * h * d * d * 4
            call = lambda: at.linear_decode_forward_triton(q, k, v, cache, slope, slots)  # noqa
            t = timing.kernel_time_torch(call)
            t_pipe = timing.pipelined_time([call], "torch", reps=200, trials=3)
            f = jax.jit(aj.linear_decode_forward_triton, donate_argnums=(3,))
            jq, jk, jv, jslope, jslots = (jax.dlpack.from_dlpack(x) for x in (q, k, v, slope, slots))
            state = {"c": jax.dlpack.from_dlpack(cache.clone())}

            def jcall():
                out, state["c"] = f(jq, jk, jv, state["c"], jslope, jslots)
                return state["c"]
            t_jax = timing.pipelined_time([jcall], "jax", reps=200, trials=3)
            # bitwise: one step from the same cache
            c_t = cache.clone()
            o_t = at.linear_decode_forward_triton(q, k, v, c_t, slope, slots)
            o_j, c_j = jax.jit(aj.linear_decode_forward_triton)(jq, jk, jv, jax.dlpack.from_dlpack(cache.clone()),
                                                                jslope, jslots)
            row = _ours_row(name, t, nbytes, copy_bw, t_pipe, t_jax, ((o_t, o_j), (c_t, c_j)))
            # back to back in one CUDA graph (how serving engines replay decode steps):
            # no launch gaps; 4 caches in rotation
            gsets = [(q, k, v, cache, slope, slots)] + [_decode_inputs(b, h, d, dtype, b) for _ in range(3)]
            t_g = timing.graph_time_torch(lambda i: at.linear_decode_forward_triton(*gsets[i]), len(gsets))
            row.update(graph_us=t_g * 1e6, **{"graph_TB/s": nbytes / t_g / 1e12})
            rows.append(row)
            gsets = None
            if case.get("baselines"):
                comp = torch.compile(_torch_decode_math, dynamic=False)
                t_c = timing.kernel_time_torch(lambda: comp(q, k, v, cache, slope, slots))
                rows.append(_row(name + "-torch.compile", t_c, nbytes, copy_bw, baseline="torch.compile",
                                 baseline_us=t_c * 1e6, vs_baseline=t_c / t))
                jb = jax.jit(_jnp_decode_math, donate_argnums=(3,))
                bstate = {"c": jax.dlpack.from_dlpack(cache.clone())}

                def bcall():
                    out, bstate["c"] = jb(jq, jk, jv, bstate["c"], jslope, jslots)
                    return bstate["c"]
                t_b = timing.pipelined_time([bcall], "jax", reps=100, trials=3)
                rows.append(_row(name + "-jnp-jit", t_b, nbytes, copy_bw, baseline="jnp under jax.jit",
                                 baseline_us=t_b * 1e6, vs_baseline=t_b / t_jax))
        except Exception as exc:
            traceback.print_exc()
            rows.append(dict(name=name, error=repr(exc)[:160]))
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def run():
    copy_bw = timing.copy_bandwidth()
    rows = [dict(name="copy-bandwidth", **{"TB/s": copy_bw / 1e12})]
    import os
    parts = (decode_sweep, decode_cases, prefill_cases, prefill_sweep)
    only = os.environ.get("LIGHTNING_BENCH_PARTS")  # e.g. "prefill_cases,decode_cases"
    if only:
        parts = [p for p in parts if p.__name__ in only.split(",")]
    for part in parts:
        try:
            rows += part(copy_bw)
        except Exception as exc:
            traceback.print_exc()
            rows.append(dict(name=part.__name__, error=repr(exc)[:160]))
        for r in rows[-3:]:
            print(r, flush=True)
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if "us" in r and not r["name"].startswith("sweep") and "%copy" in r]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1))
    ax.barh([r["name"] for r in rows], [r["%copy"] for r in rows])
    ax.set_xlabel("% of measured copy bandwidth (byte floor)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path)

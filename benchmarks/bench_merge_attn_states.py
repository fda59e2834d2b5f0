"""merge_attn_states on the GPU: our kernel (torch and JAX) vs the same math
compiled by torch.compile and by XLA (jnp under jax.jit), and vs vLLM's Triton
kernel (the one this op is modelled on) where its file is present in .peer/
(git-ignored, never imported by the package: ``vllm_merge.py`` holding vLLM's
``merge_attn_states``; without it those columns stay empty).

Bytes moved = 3·N·H·D·itemsize + 3·N·H·4; percent of the device-to-device copy
bandwidth measured in the same run. JAX is timed by pipelined dispatch (see
timing.py), torch both ways; the JAX/torch ratio compares like with like.
Under 4096 tokens (a few microseconds) ``torch_us`` and ``vllm_us`` are the
medians of SMALL_TRIALS do_bench runs taken in alternation, and ``graph_us`` /
``vllm_graph_us`` time both kernels in a CUDA graph over cold input sets (no
host time, no per-call events).
"""
from __future__ import annotations

import gc
import importlib.util
from pathlib import Path

import numpy as np

from benchmarks import timing
from benchmarks.registry import merge_shapes

COLUMNS = ["name", "torch_us", "plain_triton_us", "torch_with_ctx_us", "TB/s", "%copy", "jax_us", "torch_pipe_us", "jax/torch",
           "compile_us", "jnp_us", "vllm_us", "vs_compile", "vs_jnp", "vs_vllm", "graph_us", "vllm_graph_us",
           "graph_vs_vllm"]
ROTATE = 4  # input sets cycled so repeated calls never hit in L2
VLLM_FILE = Path(__file__).resolve().parent.parent / ".peer" / "vllm_merge.py"


def vllm_merge():
    """vLLM's merge_attn_states(output, prefix_output, prefix_lse, suffix_output,
    suffix_lse, output_lse) from VLLM_FILE, or None when the file is absent."""
    if not VLLM_FILE.exists():
        return None
    spec = importlib.util.spec_from_file_location("peer_vllm_merge", VLLM_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.merge_attn_states


def _torch_math(po, pl, so, sl):
    import torch
    p = pl.t().unsqueeze(-1)
    s = sl.t().unsqueeze(-1)
    p = torch.where(p == float("inf"), float("-inf"), p)
    s = torch.where(s == float("inf"), float("-inf"), s)
    m = torch.maximum(p, s)
    wp, ws = torch.exp(p - m), torch.exp(s - m)
    w = wp + ws
    out = po.float() * (wp / w) + so.float() * (ws / w)
    return out.to(po.dtype), (torch.log(w) + m).squeeze(-1).t()


def _jnp_math(po, pl, so, sl):
    import jax.numpy as jnp
    p = jnp.where(pl.T == jnp.inf, -jnp.inf, pl.T)[..., None]
    s = jnp.where(sl.T == jnp.inf, -jnp.inf, sl.T)[..., None]
    m = jnp.maximum(p, s)
    wp, ws = jnp.exp(p - m), jnp.exp(s - m)
    w = wp + ws
    out = po.astype(jnp.float32) * (wp / w) + so.astype(jnp.float32) * (ws / w)
    return out.astype(po.dtype), (jnp.log(w) + m)[..., 0].T


def _inputs(n, h, d, dtype, k):
    import torch
    tdt = getattr(torch, dtype)
    sets = []
    for _ in range(k):
        sets.append((torch.randn(n, h, d, device="cuda", dtype=tdt),
                     torch.randn(h, n, device="cuda") * 3,
                     torch.randn(n, h, d, device="cuda", dtype=tdt),
                     torch.randn(h, n, device="cuda") * 3))
    return sets


def tile_sweep(copy_bw):
    """Time tile sizes / warps, load orders and row orders for the headline shape
    (torch launch, cold L2)."""
    import torch
    from adapters.torch._executor import info, run_plan, target_for
    from core_kernels.merge_attn_states import MergeConfig, plan_merge_attn_states
    n, h, d = 16384, 32, 128
    rows = []
    for dtype in ("bfloat16", "float16", "float32"):
        po, pl, so, sl = _inputs(n, h, d, dtype, 1)[0]
        out, lse = torch.empty_like(po), torch.empty_like(pl)
        nbytes = 3 * n * h * d * po.element_size() + 3 * n * h * 4
        for tile in (512, 2048, 4096):
            for warps in (2, 4, 8):
                for first, head_major in ((False, False), (True, False), (False, True)):
                    plan = plan_merge_attn_states(target_for(po.device), info(po), info(pl), info(so),
                                                  info(sl), info(out), info(lse),
                                                  config=MergeConfig(tile, warps, "", first, head_major))
                    tensors = dict(output=out, output_lse=lse, prefix_output=po, prefix_lse=pl,
                                   suffix_output=so, suffix_lse=sl)
                    t = timing.kernel_time_torch(lambda: run_plan(plan, tensors, {}))
                    rows.append(dict(name=f"sweep-{dtype}-tile{tile}-w{warps}" + ("-loadfirst" if first else "")
                                     + ("-headmajor" if head_major else ""),
                                     torch_us=t * 1e6,
                                     **{"TB/s": nbytes / t / 1e12, "%copy": 100 * nbytes / t / copy_bw}))
    return rows


def host_overheads():
    """Per-call host time for a decode-sized merge (N=1, 32x128 bf16)."""
    import jax
    import torch
    import adapters.jax as aj
    import adapters.torch as at
    from core_kernels.merge_attn_states.kernels import _merge_attn_states_kernel
    from adapters.torch._executor import info, target_for
    from core_kernels.merge_attn_states import plan_merge_attn_states
    from core_kernels._plan import Scalar
    po, pl, so, sl = _inputs(1, 32, 128, "bfloat16", 1)[0]
    out, lse = torch.empty_like(po), torch.empty_like(pl)
    timing.host_overhead(lambda: at.merge_attn_states(out, po, pl, so, sl, lse), "torch")  # settle clocks
    ours = timing.host_overhead(lambda: at.merge_attn_states(out, po, pl, so, sl, lse), "torch")
    ours_ctx = timing.host_overhead(lambda: at.merge_attn_states(out, po, pl, so, sl, lse, 1), "torch")
    # the plain Triton launch of the same kernel, arguments prepared in advance
    launch = plan_merge_attn_states(target_for(po.device), info(po), info(pl), info(so), info(sl),
                                    info(out), info(lse)).launches[0]
    env = dict(output=out, output_lse=lse, prefix_output=po, prefix_lse=pl, suffix_output=so, suffix_lse=sl)
    args = [a.value if isinstance(a, Scalar) else env[a] for a in launch.args] + [env[o] for o in launch.outputs]
    plain = timing.host_overhead(lambda: _merge_attn_states_kernel[launch.grid](
        *args, **launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages), "torch")
    jargs = [jax.dlpack.from_dlpack(t) for t in (po, pl, so, sl)]
    f = jax.jit(aj.merge_attn_states)
    jx = timing.host_overhead(lambda: f(*jargs), "jax")
    return [dict(name="host-overhead-N1-32x128-bf16", torch_us=ours * 1e6, torch_with_ctx_us=ours_ctx * 1e6,
                 plain_triton_us=plain * 1e6, jax_us=jx * 1e6)]


SMALL_TRIALS = 5  # alternated do_bench trials per kernel for merges under 4096 tokens


def _gpu_times(ours, theirs, trials: int):
    """(ours, theirs or None) GPU seconds per call: the medians of ``trials``
    do_bench runs taken in alternation, so that a few-microsecond time is
    compared within one stretch of the run (a single do_bench of vLLM's kernel
    at N = 1 has read 4.7 and 10.5 us an hour apart)."""
    import statistics
    t_ours, t_theirs = [], []
    for _ in range(trials):
        t_ours.append(timing.kernel_time_torch(ours))
        if theirs is not None:
            t_theirs.append(timing.kernel_time_torch(theirs))
    return statistics.median(t_ours), statistics.median(t_theirs) if t_theirs else None


def graph_cold_us(peer, n, h, d, dtype, configs: dict) -> dict:
    """GPU time per call (us) in a CUDA graph over cold input sets (timing.py):
    our merge under each of ``configs`` (name -> MergeConfig or None, the
    planner's choice) and, under "vllm", vLLM's kernel when ``peer`` is given;
    the merge alone, without do_bench's per-call events."""
    import torch
    import adapters.torch as at
    itemsize = 4 if dtype == "float32" else 2
    nbytes = 3 * n * h * d * itemsize + 3 * n * h * 4
    sets = _inputs(n, h, d, dtype, timing.cold_sets(nbytes))
    outs = [(torch.empty_like(s[0]), torch.empty_like(s[1])) for s in sets]
    times = {name: 1e6 * timing.graph_cold_time_torch(
        lambda i, cfg=cfg: at.merge_attn_states(outs[i][0], *sets[i], outs[i][1], config=cfg), nbytes)
        for name, cfg in configs.items()}
    if peer is not None:
        times["vllm"] = 1e6 * timing.graph_cold_time_torch(
            lambda i: peer(outs[i][0], *sets[i], output_lse=outs[i][1]), nbytes)
    return times


def _graph_row(peer, n, h, d, dtype) -> dict:
    times = graph_cold_us(peer, n, h, d, dtype, {"ours": None})
    row = dict(graph_us=times["ours"])
    if "vllm" in times:
        row.update(vllm_graph_us=times["vllm"], graph_vs_vllm=times["vllm"] / times["ours"])
    return row


def run():
    import jax
    import torch
    import adapters.jax as aj
    import adapters.torch as at
    copy_bw = timing.copy_bandwidth()
    rows = [dict(name="copy-bandwidth", **{"TB/s": copy_bw / 1e12})]
    rows += tile_sweep(copy_bw)
    rows += host_overheads()
    import torch._dynamo
    for knob in ("recompile_limit", "cache_size_limit"):  # one compile per shape/dtype
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 1000)
    compiled = torch.compile(_torch_math, dynamic=False)
    jnp_jit = jax.jit(_jnp_math)
    ours_jit = jax.jit(aj.merge_attn_states)
    peer = vllm_merge()
    for case in merge_shapes():
        n, h, d, dtype = case["n"], case["h"], case["d"], case["dtype"]
        itemsize = 4 if dtype == "float32" else 2
        nbytes = 3 * n * h * d * itemsize + 3 * n * h * 4
        sets = _inputs(n, h, d, dtype, ROTATE)
        outs = [(torch.empty_like(s[0]), torch.empty_like(s[1])) for s in sets]
        calls = [lambda s=s, o=o: at.merge_attn_states(o[0], s[0], s[1], s[2], s[3], o[1])
                 for s, o in zip(sets, outs)]
        v_out, v_lse = torch.empty_like(outs[0][0]), torch.empty_like(outs[0][1])
        t_torch, t_v = _gpu_times(calls[0], None if peer is None else (
            lambda: peer(v_out, *sets[0], output_lse=v_lse)), trials=SMALL_TRIALS if n < 4096 else 1)
        t_torch_pipe = timing.pipelined_time(calls, "torch")
        jsets = [[jax.dlpack.from_dlpack(t) for t in s] for s in sets]
        t_jax = timing.pipelined_time([lambda s=s: ours_jit(*s) for s in jsets], "jax")
        # bitwise agreement on the first set
        at.merge_attn_states(outs[0][0], *sets[0], output_lse=outs[0][1])
        j_out, j_lse = ours_jit(*jsets[0])
        bitwise = bool(torch.equal(outs[0][0], torch.from_dlpack(j_out))
                       and torch.equal(outs[0][1], torch.from_dlpack(j_lse)))
        row = dict(name=case["name"], n=n, h=h, d=d, dtype=dtype, torch_us=t_torch * 1e6,
                   **{"TB/s": nbytes / t_torch / 1e12, "%copy": 100 * nbytes / t_torch / copy_bw},
                   jax_us=t_jax * 1e6, torch_pipe_us=t_torch_pipe * 1e6,
                   **{"jax/torch": t_jax / t_torch_pipe}, bitwise=bitwise)
        if n >= 4096:
            t_c = timing.kernel_time_torch(lambda: compiled(*sets[0]))
            t_j = timing.pipelined_time([lambda s=s: jnp_jit(*s) for s in jsets], "jax")
            row.update(compile_us=t_c * 1e6, jnp_us=t_j * 1e6, vs_compile=t_c / t_torch,
                       vs_jnp=t_j / min(t_jax, t_torch_pipe), baseline="torch.compile",
                       baseline_us=t_c * 1e6)
        if n < 4096:
            row.update(_graph_row(peer, n, h, d, dtype))
        if peer is not None:
            # the modelled kernel, GPU time the same way (its output checked against ours)
            close = bool(torch.allclose(v_out.float(), outs[0][0].float(), atol=2e-2, rtol=2e-2))
            row.update(vllm_us=t_v * 1e6, vs_vllm=t_v / t_torch, vllm_close=close)
            if n < 4096:
                row.update(baseline="vLLM merge_attn_states kernel", baseline_us=t_v * 1e6)
        rows.append(row)
        del sets, outs, jsets, calls
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = [r for r in rows if "n" in r and r["n"] >= 64]
    fig, ax = plt.subplots(figsize=(12, 4))
    x = np.arange(len(cases))
    ax.bar(x - 0.2, [r["%copy"] for r in cases], 0.4, label="ours (torch), % of copy BW")
    ax.bar(x + 0.2, [100 * r["TB/s"] * r["torch_us"] / r["compile_us"] / rows[0]["TB/s"]
                     if "compile_us" in r else 0 for r in cases], 0.4, label="torch.compile, % of copy BW")
    ax.set_xticks(x, [r["name"] for r in cases], rotation=75, fontsize=7)
    ax.set_ylabel("% of measured copy bandwidth")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)

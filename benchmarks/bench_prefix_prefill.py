"""context_attention_fwd on the GPU: useful TFLOP/s of our kernel (torch and JAX).

Useful FLOPs = 4·Hq·D·(visible query-key pairs); without a window that is
4·Hq·D·Σ q·(ctx + (q+1)/2), the issue's formula. Percent of the dense bf16
matmul rate measured in the same run; the kernel the spec is modelled on does
~139 TFLOP/s (2.2 ms) on the first shape. A tile sweep (torch launches, cold
L2) over several (BLOCK_M, BLOCK_N, warps, stages) picks the configuration;
the rows marked "default" use the plan's own TILE_CONFIGS.
"""
from __future__ import annotations

import gc
import os

import numpy as np

from benchmarks import timing
from benchmarks.registry import PREFIX_PREFILL_MODEL, PREFIX_PREFILL_SHAPES

COLUMNS = ["name", "config", "torch_us", "TFLOP/s", "%matmul", "vs_baseline", "vs_standard",
           "jax_us", "torch_pipe_us", "jax/torch", "bitwise", "max_err"]
BASELINE_TFLOPS = 139.0
# PrefixPrefillConfig fields (BLOCK_M, BLOCK_N, num_warps, num_stages, pack GQA heads,
# prefetch block ids, gather the context into dense scratch first); the default
# gathers when it pays
SWEEP = [(128, 128, 8, 3, True, 1, False)]  # the paged path, for comparison
SWEEP_SHAPES = ("B4-q1024-ctx4096-fp16", "B4-q1024-ctx4096-bf16-fp8kv")
# vLLM 0.33's layouts next to the standard one (same shape; target: within 5% of
# STANDARD's time): the V cache interleaved with x = 8, and the new tokens' K/V
# read from the paged cache (k = v = None; the cache holds them)
STANDARD = "B4-q1024-ctx4096-bf16"
VLLM033_SHAPES = (
    ("B4-q1024-ctx4096-bf16-interleaved-v", [(1024, 4096)] * 4, "bfloat16",
     {"interleaved_v_pack_factor": 8}),
    ("B4-q1024-ctx4096-bf16-cached-kv", [(1024, 4096)] * 4, "bfloat16", {"cache_kv": True}),
    # vLLM's block tables are as wide as the model's longest sequence (here 131072
    # tokens): without max_seq_len the gather scratch would be table-sized
    ("B4-q1024-ctx4096-bf16-table131072", [(1024, 4096)] * 4, "bfloat16", {"table_width": 8192}),
    ("B4-q1024-ctx4096-bf16-table131072-max_seq_len", [(1024, 4096)] * 4, "bfloat16",
     {"table_width": 8192, "max_seq_len": 5120}),
)


def useful_flops(seqs, hq, d, window=None):
    pairs = 0
    for q, c in seqs:
        if window:
            p = c + np.arange(q)
            pairs += int(np.minimum(p + 1, window).sum())
        else:
            pairs += q * c + q * (q + 1) // 2
    return 4 * hq * d * pairs


def make_inputs(seqs, dtype, opts, seed=0):
    import torch
    m = PREFIX_PREFILL_MODEL
    hq, hkv, d, bs = m["hq"], m["hkv"], m["d"], m["block_size"]
    g = torch.Generator(device="cuda").manual_seed(seed)
    tdt = getattr(torch, dtype)
    t = sum(q for q, _ in seqs)
    x = 16 // torch.tensor([], dtype=tdt).element_size()
    rnd = lambda *shape: torch.randn(*shape, device="cuda", generator=g, dtype=torch.float32)
    q, k, v = (rnd(t, h, d).to(tdt) for h in (hq, hkv, hkv))
    cache_kv = bool(opts.get("cache_kv"))
    nblk = [-(-(c + (q if cache_kv else 0)) // bs) for q, c in seqs]
    num_blocks = max(1, sum(nblk))
    fp8 = opts.get("kv_cache_dtype", "auto") != "auto"
    cdt = torch.float8_e4m3fn if fp8 else tdt
    k_cache = rnd(num_blocks, hkv, d // x, bs, x).to(cdt)
    v_cache = rnd(num_blocks, hkv, d, bs).to(cdt)
    perm = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    width = max(nblk + [1, opts.get("table_width", 0)])  # unused slots: block 0
    b_loc = torch.zeros(len(seqs), width, dtype=torch.int32, device="cuda")
    pos = 0
    for i, n in enumerate(nblk):
        b_loc[i, :n] = perm[pos:pos + n]
        pos += n
    qlens = torch.tensor([q for q, _ in seqs], dtype=torch.int32, device="cuda")
    ctxs = torch.tensor([c for _, c in seqs], dtype=torch.int32, device="cuda")
    b_start = torch.zeros(len(seqs) + 1, dtype=torch.int32, device="cuda")
    b_start[1:] = torch.cumsum(qlens, 0)
    one = torch.ones(1, dtype=torch.float32, device="cuda")
    if cache_kv:  # the new tokens' K/V at positions ctx .. ctx + q - 1 of the cache
        s0 = 0
        for i, (ql, c) in enumerate(seqs):
            pos = torch.arange(c, c + ql, device="cuda")
            blk, off = b_loc[i, pos // bs].long(), pos % bs
            k_cache[blk, :, :, off, :] = k[s0:s0 + ql].view(ql, hkv, d // x, x).to(cdt)
            v_cache[blk, :, :, off] = v[s0:s0 + ql].to(cdt)
            s0 += ql
    v_std = v_cache
    xv = opts.get("interleaved_v_pack_factor", 0)
    if xv:  # the same values stored [num_blocks, Hkv, bs // x, D, x] behind the 4-D shape
        v_cache = (v_cache.view(num_blocks, hkv, d, bs // xv, xv).permute(0, 1, 3, 2, 4)
                   .contiguous().view(num_blocks, hkv, d, bs))
    return dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, v_cache_std=v_std, b_loc=b_loc,
                b_start_loc=b_start,
                b_seq_len=qlens + ctxs, k_scale=one * 0.5 if fp8 else one, v_scale=one * 0.7 if fp8 else one,
                max_input_len=max(q for q, _ in seqs))


def configured_call(inp, out, opts, cfg):
    """The torch call with ``config=PrefixPrefillConfig(*cfg)`` (the plan's own choice
    when cfg is None)."""
    from core_kernels.prefix_prefill import PrefixPrefillConfig
    return torch_call(inp, out, opts, None if cfg is None else PrefixPrefillConfig(*cfg))


def torch_call(inp, out, opts, config=None):
    import adapters.torch as at
    k, v = (None, None) if opts.get("cache_kv") else (inp["k"], inp["v"])
    return lambda: at.context_attention_fwd(
        inp["q"], k, v, out, opts.get("kv_cache_dtype", "auto"), inp["k_cache"],
        inp["v_cache"], inp["b_loc"], inp["b_start_loc"], inp["b_seq_len"], opts.get("max_seq_len", 0),
        inp["max_input_len"],
        inp["k_scale"], inp["v_scale"], sliding_window=opts.get("sliding_window"),
        interleaved_v_pack_factor=opts.get("interleaved_v_pack_factor", 0), config=config)


def check_one_sequence(inp, out, opts, seq_index=0, rows=256):
    """max |out - ref| / max |ref| for the last ``rows`` queries of one sequence, vs torch fp32."""
    import torch
    m = PREFIX_PREFILL_MODEL
    hq, hkv, d, bs = m["hq"], m["hkv"], m["d"], m["block_size"]
    s0, s1 = int(inp["b_start_loc"][seq_index]), int(inp["b_start_loc"][seq_index + 1])
    ctx = int(inp["b_seq_len"][seq_index]) - (s1 - s0)
    blocks = inp["b_loc"][seq_index, :-(-ctx // bs)].long()
    scale = float(inp["k_scale"]), float(inp["v_scale"])
    kc = inp["k_cache"][blocks].float().permute(0, 3, 1, 2, 4).reshape(-1, hkv, d)[:ctx] * scale[0]
    vc = inp["v_cache_std"][blocks].float().permute(0, 3, 1, 2).reshape(-1, hkv, d)[:ctx] * scale[1]
    keys = torch.cat([kc, inp["k"][s0:s1].float()]).repeat_interleave(hq // hkv, 1)
    vals = torch.cat([vc, inp["v"][s0:s1].float()]).repeat_interleave(hq // hkv, 1)
    r0 = max(s0, s1 - rows)
    qq = inp["q"][r0:s1].float()
    p = ctx + torch.arange(r0 - s0, s1 - s0, device="cuda")
    t = torch.arange(keys.shape[0], device="cuda")
    vis = t[None] <= p[:, None]
    if opts.get("sliding_window"):
        vis &= (p[:, None] - t[None]) < opts["sliding_window"]
    sc = torch.einsum("qhd,khd->hqk", qq, keys) / d ** 0.5
    sc = sc.masked_fill(~vis[None], float("-inf")).softmax(-1)
    ref = torch.einsum("hqk,khd->qhd", sc, vals)
    return float((out[r0:s1].float() - ref).abs().max() / ref.abs().max())


def run():
    import jax
    import torch
    import adapters.jax as aj
    m = PREFIX_PREFILL_MODEL
    mm = timing.matmul_tflops()
    rows = [dict(name="dense-bf16-matmul", **{"TFLOP/s": mm / 1e12})]
    standard_us = None
    # e.g. "table,ctx4096-bf16": the rows whose name holds one of these
    only = [o for o in os.environ.get("PREFIX_PREFILL_ONLY", "").split(",") if o]
    for name, seqs, dtype, opts in (*PREFIX_PREFILL_SHAPES, *VLLM033_SHAPES):
        if only and not any(o in name for o in only):
            continue
        inp = make_inputs(seqs, dtype, opts)
        flops = useful_flops(seqs, m["hq"], m["d"], opts.get("sliding_window"))
        out = torch.empty_like(inp["q"])
        configs = [None] + (SWEEP if name in SWEEP_SHAPES else [])
        best = None
        for cfg in configs:
            try:
                call = configured_call(inp, out, opts, cfg)
                out.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                err = check_one_sequence(inp, out, opts)
                t = timing.kernel_time_torch(call)
            except Exception as e:  # a config that does not fit (shared memory) is reported
                rows.append(dict(name=name, config=str(cfg), error=repr(e)[:200]))
                print(name, cfg, "failed:", repr(e)[:300], flush=True)
                continue
            tf = flops / t / 1e12
            row = dict(name=name, config="default" if cfg is None else str(cfg), torch_us=t * 1e6,
                       **{"TFLOP/s": tf, "%matmul": 100 * flops / t / mm},
                       vs_baseline=tf / BASELINE_TFLOPS, max_err=err)
            if cfg is None and name == STANDARD:
                standard_us = t * 1e6
            if cfg is None and name in dict((n, 0) for n, *_ in VLLM033_SHAPES) and standard_us:
                row["vs_standard"] = t * 1e6 / standard_us
            print(row, flush=True)
            rows.append(row)
            if best is None or t < best[0]:
                best = (t, cfg)
        # JAX vs torch (default plan config), pipelined, and bitwise agreement
        try:
            call = torch_call(inp, out, opts)
            t_pipe = timing.pipelined_time([call], "torch", reps=20, trials=3)
            jin = {n: jax.dlpack.from_dlpack(inp[n]) for n in
                   ("q", "k", "v", "k_cache", "v_cache", "b_loc", "b_start_loc", "b_seq_len",
                    "k_scale", "v_scale")}
            no_kv = bool(opts.get("cache_kv"))
            f = jax.jit(lambda a: aj.context_attention_fwd(
                a["q"], None if no_kv else a["k"], None if no_kv else a["v"], a["k_cache"],
                a["v_cache"], a["b_loc"], a["b_start_loc"], a["b_seq_len"],
                max_input_len=inp["max_input_len"], max_seq_len=opts.get("max_seq_len"),
                kv_cache_dtype=opts.get("kv_cache_dtype", "auto"), k_scale=a["k_scale"],
                v_scale=a["v_scale"], sliding_window=opts.get("sliding_window"),
                interleaved_v_pack_factor=opts.get("interleaved_v_pack_factor", 0)))
            t_jax = timing.pipelined_time([lambda: f(jin)], "jax", reps=20, trials=3)
            call()
            torch.cuda.synchronize()
            bitwise = bool(torch.equal(out, torch.from_dlpack(f(jin))))
            rows.append(dict(name=name, config="default-pipelined", torch_pipe_us=t_pipe * 1e6,
                             jax_us=t_jax * 1e6, **{"jax/torch": t_jax / t_pipe}, bitwise=bitwise,
                             best_config=str(best[1]) if best else None))
            print(rows[-1], flush=True)
        except Exception as e:
            rows.append(dict(name=name, config="jax", error=repr(e)[:300]))
            print(name, "jax failed:", repr(e)[:300], flush=True)
        del inp, out
        gc.collect()
        torch.cuda.empty_cache()
    rows += dense_sdpa(mm)
    return rows


def dense_sdpa(mm):
    """torch SDPA (flash) on the ctx=0 shape: what a dense causal kernel does here."""
    import torch
    import torch.nn.functional as F
    try:
        q = torch.randn(1, 32, 8192, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        t = timing.kernel_time_torch(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                          enable_gqa=True))
        flops = useful_flops([(8192, 0)], 32, 128)
        return [dict(name="torch-sdpa-causal-B1-8192-bf16", torch_us=t * 1e6,
                     **{"TFLOP/s": flops / t / 1e12, "%matmul": 100 * flops / t / mm})]
    except Exception as e:
        return [dict(name="torch-sdpa", error=repr(e)[:200])]


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = [r for r in rows if r.get("config") == "default" and "TFLOP/s" in r]
    fig, ax = plt.subplots(figsize=(10, 4))
    x = np.arange(len(cases))
    ax.bar(x, [r["TFLOP/s"] for r in cases], 0.6, label="ours (torch launch)")
    ax.axhline(BASELINE_TFLOPS, color="gray", ls="--", label="modelled kernel, first shape")
    ax.axhline(420, color="red", ls=":", label="target")
    ax.set_xticks(x, [r["name"] for r in cases], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("useful TFLOP/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)

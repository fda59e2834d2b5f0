"""Block-sparse varlen attention on the GPU at Phi-3-small settings.

Per shape: GPU time of our kernel (torch launch, cold L2; decode also as the
GPU time per call inside a CUDA graph over rotating inputs), several tile
configs for prefill, dense causal torch SDPA in the same run, effective
TFLOP/s over the allowed (token-exact) pairs, percent of the measured bf16
matmul rate, host overhead, and the JAX/torch ratio of pipelined per-call time.
"""
from __future__ import annotations

import os

import numpy as np

from benchmarks.registry import BLOCKSPARSE_MODEL, BLOCKSPARSE_SHAPES
from benchmarks.timing import (copy_bandwidth, graph_time_torch, host_overhead, kernel_time_torch,
                               matmul_tflops, pipelined_time)

COLUMNS = ["name", "variant", "time_us", "gpu_us", "tflops", "pct_roofline", "tbps", "host_us",
           "sdpa_us", "speedup_vs_sdpa", "vs_baseline", "jax_torch_ratio"]
# the kernel this is modelled on, same H200 (issue 5)
BASELINE_US = {"prefill-1x16384": 1520.0, "decode-1x16384": 258.0}
PREFILL_VARIANTS = [  # BlocksparsePrefillConfig(block_m, block_n, num_warps, num_stages); None = the plan's
    None, (64, 64, 4, 2),
]
# first H200 run: (64,64,8,3) 0.48x, (32,64,4,3) 0.43x, (64,64,4,4) 0.62x the default's speed;
# 128-row tiles over two layout rows (since removed): 1709 us at 1x16384 vs 1431 for the default
# decode variants: (group, splits); None = the plan's default. group: False = the per-head
# kernel (BlocksparseDecodeConfig), True = GQA-packed (BlocksparseGroupDecodeConfig: one
# program per KV head reads the union of blocks), None = the default's kernel; splits None =
# the measured rule's, else that many (a packed config's chunk follows from it, as the rule's)
DECODE_SPLITS = [None, (False, None), (True, None), (None, 4), (None, 16)]


def decode_variant_config(target, args, options, group, splits):
    """The config of a (group, splits) decode variant for the planner's ``args``."""
    from core_kernels.blocksparse_attention import (BlocksparseDecodeConfig,
                                                    BlocksparseGroupDecodeConfig, choose_config)
    variant = {None: None, False: BlocksparseDecodeConfig, True: BlocksparseGroupDecodeConfig}[group]
    return choose_config(target, *args, **options, variant=variant, splits=splits)


def allowed_pairs(block_mask, lens_k, lens_q, bs):
    """Exact count of (query, key) pairs attended, summed over heads."""
    total = 0
    nb = block_mask.shape[1]
    kb = np.arange(nb)
    for kl, ql in zip(lens_k, lens_q if lens_q is not None else [1] * len(lens_k)):
        p = np.arange(kl - ql, kl)
        vis = np.clip(p[:, None] - kb[None, :] * bs + 1, 0, bs)        # [ql, nb]
        rows = block_mask[:, p // bs, :]                                  # [H, ql, nb]
        total += int((rows * vis[None]).sum())
    return total


def run():
    import torch
    import jax
    import jax.numpy as jnp

    import adapters.jax as aj
    import adapters.torch as at
    from adapters.torch._executor import info, run_plan, target_for
    from core_kernels.blocksparse_attention import (BlocksparsePrefillConfig, build_sparse_layout,
                                                    plan_blocksparse_attention)

    m = BLOCKSPARSE_MODEL
    hq, hkv, d, bs = m["hq"], m["hkv"], m["d"], m["block_size"]
    dt = torch.bfloat16
    peak = matmul_tflops()
    bw = copy_bandwidth()
    print(f"measured: bf16 matmul {peak / 1e12:.0f} TFLOP/s, copy {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    only = os.environ.get("BLOCKSPARSE_ONLY")   # e.g. "decode": rows whose name holds it
    for name, lens_k, lens_q in BLOCKSPARSE_SHAPES:
        if only and only not in name:
            continue
        max_seqlen = max(lens_k)
        (crow_np, col_np), block_mask = build_sparse_layout(
            hq, max_seqlen, bs, m["local_blocks"], m["vert_stride"], m["homo_head"])
        crow, col = torch.from_numpy(crow_np.copy()).cuda(), torch.from_numpy(col_np.copy()).cuda()
        cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
        cu_q = None if lens_q is None else torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]),
                                                        dtype=torch.int32, device="cuda")
        tk = sum(lens_k)
        tq = len(lens_k) if lens_q is None else sum(lens_q)
        decode = lens_q is None
        n_sets = 3 if tk * hkv * d * 4 > (256 << 20) else 6   # rotate inputs: nothing stays in L2
        sets = [(torch.randn(tq, hq, d, device="cuda", dtype=dt),
                 torch.randn(tk, hkv, d, device="cuda", dtype=dt),
                 torch.randn(tk, hkv, d, device="cuda", dtype=dt)) for _ in range(n_sets)]
        flops = 4 * d * allowed_pairs(block_mask, lens_k, lens_q, bs)
        # bytes the kernel must read: K and V of the UNIQUE allowed blocks per KV head (the
        # union over its query heads' rows; the GQA-packed decode reads each once)
        kv_bytes = 0
        for kl in lens_k if decode else []:
            qb = (kl - 1) // bs
            union = block_mask[:, qb, :qb + 1].reshape(hkv, hq // hkv, qb + 1).any(axis=1)
            kv_bytes += int(union.sum()) * bs * d * 2 * 2
        q0, k0, v0 = sets[0]

        def ours(i=0, **cfg):
            q, k, v = sets[i]
            return at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, cu_q, None, (crow, col),
                                                        block_size=bs, max_seqlen=max_seqlen)

        # dense causal SDPA baseline (prefill: per sequence with equal lengths batched)
        sdpa_us = None
        try:
            F = torch.nn.functional
            if len(set(lens_k)) == 1 and (decode or lens_q == lens_k):
                b, n = len(lens_k), lens_k[0]
                qd = q0.view(b, -1, hq, d).transpose(1, 2)
                kd = k0.view(b, n, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
                vd = v0.view(b, n, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
                sdpa_us = kernel_time_torch(lambda: F.scaled_dot_product_attention(
                    qd, kd, vd, is_causal=not decode)) * 1e6
                del kd, vd
        except Exception as e:  # noqa: BLE001
            print("sdpa failed:", e)
        torch.cuda.synchronize()

        variants = [None] + (PREFILL_VARIANTS[1:] if not decode else DECODE_SPLITS[1:])
        for var in variants:
            if var is None:
                fn = ours
                label = "default"
            else:
                target = target_for(q0.device)
                args = (info(q0), info(k0), info(v0), info(cu_k), None if cu_q is None else info(cu_q),
                        info(crow), info(col))
                options = dict(block_size=bs, max_seqlen=max_seqlen)
                if decode:
                    config = decode_variant_config(target, args, options, *var)
                    label = f"group{var[0]}-splits{var[1]}"
                else:
                    config = BlocksparsePrefillConfig(*var)
                    label = "bm{}-bn{}-w{}-s{}".format(*var)
                plan = plan_blocksparse_attention(target, *args, **options, config=config)

                def fn(i=0, plan=plan):
                    q, k, v = sets[i]
                    return run_plan(plan, dict(q=q, k=k, v=v, cu_seqlens_k=cu_k, cu_seqlens_q=cu_q,
                                               crow=crow, col=col), None, q.device)["output"]
            try:
                t = kernel_time_torch(fn)
            except Exception as e:  # noqa: BLE001
                print(f"{name} {label} failed: {e}", flush=True)
                continue
            row = dict(name=name, variant=label, time_us=t * 1e6, tflops=flops / t / 1e12,
                       pct_roofline=100 * flops / t / peak, sdpa_us=sdpa_us,
                       speedup_vs_sdpa=None if sdpa_us is None else sdpa_us / (t * 1e6))
            if name in BASELINE_US:
                row["vs_baseline"] = BASELINE_US[name] / (t * 1e6)
            if var is None:
                # GPU time per call without host gaps: a CUDA graph of calls over rotating inputs
                gpu_us = graph_time_torch(fn, n_sets) * 1e6
                row["gpu_us"] = gpu_us
                if decode:
                    row["tbps"] = kv_bytes / (gpu_us * 1e-6) / 1e12
                    row["pct_roofline"] = 100 * kv_bytes / (gpu_us * 1e-6) / bw
                    row["tflops"] = flops / (gpu_us * 1e-6) / 1e12
                    if name in BASELINE_US:
                        row["vs_baseline"] = BASELINE_US[name] / (row["time_us"])
                    row["host_us"] = host_overhead(lambda: fn(0), "torch", reps=500) * 1e6
                # JAX vs torch, pipelined per-call time over rotating inputs
                jsets = [tuple(jnp.asarray(x.cpu().float().numpy()).astype(jnp.bfloat16) for x in s)
                         for s in sets]
                jcu_k = jnp.asarray(cu_k.cpu().numpy())
                jcu_q = None if cu_q is None else jnp.asarray(cu_q.cpu().numpy())
                jattn = aj.LocalStridedBlockSparseAttn(hq, max_seqlen, m["local_blocks"],
                                                       m["vert_stride"], bs, homo_head=False)
                jf = jax.jit(lambda q, k, v, a, b: jattn(q, k, v, a, b))
                t_jax = pipelined_time([lambda s=s: jf(*s, jcu_k, jcu_q) for s in jsets], "jax",
                                       reps=50 if not decode else 200)
                t_torch = pipelined_time([lambda i=i: fn(i) for i in range(n_sets)], "torch",
                                         reps=50 if not decode else 200)
                row["jax_torch_ratio"] = t_jax / t_torch
                row["torch_pipelined_us"] = t_torch * 1e6
                row["jax_pipelined_us"] = t_jax * 1e6
                # bitwise torch vs JAX on identical inputs
                tj = np.asarray(jf(*jsets[0], jcu_k, jcu_q).astype(jnp.float32))
                tt = fn(0).float().cpu().numpy()
                row["bitwise_equal"] = bool(np.array_equal(tj.view(np.uint32), tt.view(np.uint32)))
                del jsets
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            rows.append(row)
        del sets
        torch.cuda.empty_cache()
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    best = {}
    for r in rows:
        if r["name"] not in best or r["time_us"] < best[r["name"]]["time_us"]:
            best[r["name"]] = r
    names = list(best)
    fig, ax = plt.subplots(figsize=(10, 4))
    x = np.arange(len(names))
    ax.bar(x - 0.2, [best[n]["time_us"] for n in names], 0.4, label="block-sparse (best config)")
    ax.bar(x + 0.2, [best[n].get("sdpa_us") or 0 for n in names], 0.4, label="dense SDPA")
    ax.set_xticks(x, names, rotation=15, fontsize=7)
    ax.set_ylabel("us")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)

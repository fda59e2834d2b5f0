"""Block-sparse attention forward + backward on the GPU at Phi-3-small settings.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_blocksparse_backward.py

One sequence of 16384 tokens, Hq 32, Hkv 8, D 128, block 64, local_blocks 16,
vert_stride 8, per-head layout (homo_head=False), bf16. Times (CUDA events,
L2 flushed: benchmarks.timing.kernel_time_torch) of:
- ours: the LSE forward + the backward (the path a training step takes);
- dense causal torch SDPA forward + backward (K/V expanded to the query heads,
  as the dense baseline of bench_blocksparse_attention does);
with effective TFLOP/s over the attended (token-exact) pairs for ours (forward
4 D flops per pair, backward 10 D: five matmuls, the dQ kernel recomputing P)
and over the causal pairs for SDPA (forward 4 D, backward 8 D, the flash
backward's count), and the SDPA / ours time ratio (target: >= 2.5).
Also checks that torch and JAX give bitwise equal gradients. With
BLOCKSPARSE_BWD_SWEEP=1 it then times the backward launches alone for a grid of
BlocksparseBackwardConfig (and each launch of the default on its own).
Imports on a CPU-only machine; running needs a CUDA GPU.
"""
from __future__ import annotations

import os

import numpy as np

from benchmarks.registry import BLOCKSPARSE_MODEL
from benchmarks.timing import kernel_time_torch

SEQ_LEN = 16384
TARGET_RATIO = 2.5


def allowed_pairs(block_mask, seq_len, bs):
    """Exact number of (query, key) pairs attended by one full-prefill sequence, all heads."""
    nb = block_mask.shape[1]
    p = np.arange(seq_len)
    vis = np.clip(p[:, None] - np.arange(nb)[None, :] * bs + 1, 0, bs)  # [L, NB] keys of each block
    return int((block_mask[:, p // bs, :] * vis[None]).sum())


def run():
    import torch
    import jax
    import jax.numpy as jnp

    import adapters.jax as aj
    import adapters.torch as at
    from core_kernels.blocksparse_attention import build_sparse_layout

    if not torch.cuda.is_available():
        raise SystemExit("bench_blocksparse_backward needs a CUDA GPU")
    m = BLOCKSPARSE_MODEL
    hq, hkv, d, bs = m["hq"], m["hkv"], m["d"], m["block_size"]
    n = SEQ_LEN
    dev, dt = "cuda", torch.bfloat16
    (crow_np, col_np), block_mask = build_sparse_layout(hq, n, bs, m["local_blocks"], m["vert_stride"],
                                                        m["homo_head"])
    crow, col = (torch.from_numpy(np.ascontiguousarray(x)).to(dev) for x in (crow_np, col_np))
    cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(n, hq, d, device=dev, dtype=dt, generator=g).requires_grad_(True)
    k = torch.randn(n, hkv, d, device=dev, dtype=dt, generator=g).requires_grad_(True)
    v = torch.randn(n, hkv, d, device=dev, dtype=dt, generator=g).requires_grad_(True)
    go = torch.randn(n, hq, d, device=dev, dtype=dt, generator=g)
    scale = d ** -0.5

    def ours():
        out = at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu, cu, scale, (crow, col), block_size=bs,
                                                   max_seqlen=n)
        torch.autograd.grad(out, (q, k, v), go)

    def ours_fwd():
        with torch.no_grad():
            at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu, cu, scale, (crow, col), block_size=bs,
                                                 max_seqlen=n)

    # dense causal SDPA, GQA expanded: [1, H, L, D]
    qd = q.detach().permute(1, 0, 2)[None].contiguous().requires_grad_(True)
    kd = k.detach().repeat_interleave(hq // hkv, 1).permute(1, 0, 2)[None].contiguous().requires_grad_(True)
    vd = v.detach().repeat_interleave(hq // hkv, 1).permute(1, 0, 2)[None].contiguous().requires_grad_(True)
    god = go.permute(1, 0, 2)[None].contiguous()

    def sdpa():
        out = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
        torch.autograd.grad(out, (qd, kd, vd), god)

    t_ours = kernel_time_torch(ours)
    t_fwd = kernel_time_torch(ours_fwd)
    t_sdpa = kernel_time_torch(sdpa)
    pairs = allowed_pairs(block_mask, n, bs)
    causal = hq * n * (n + 1) // 2
    flops_ours = pairs * d * (4 + 10)
    flops_sdpa = causal * d * (4 + 8)
    print(f"Phi-3-small 1x{n}, Hq {hq}, Hkv {hkv}, D {d}, block {bs}, local {m['local_blocks']}, "
          f"vert_stride {m['vert_stride']}, per-head layout, bf16; density {pairs / causal:.3f} of causal")
    print(f"{'':28s}{'time_ms':>10s}{'TFLOP/s':>10s}")
    print(f"{'ours fwd (inference)':28s}{t_fwd * 1e3:10.3f}{pairs * d * 4 / t_fwd / 1e12:10.1f}")
    print(f"{'ours fwd+bwd':28s}{t_ours * 1e3:10.3f}{flops_ours / t_ours / 1e12:10.1f}")
    print(f"{'dense causal SDPA fwd+bwd':28s}{t_sdpa * 1e3:10.3f}{flops_sdpa / t_sdpa / 1e12:10.1f}")
    ratio = t_sdpa / t_ours
    print(f"SDPA / ours: {ratio:.2f}x (target >= {TARGET_RATIO}x: {'met' if ratio >= TARGET_RATIO else 'NOT met'})")

    # torch vs JAX gradients, bitwise
    out = at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu, cu, scale, (crow, col), block_size=bs, max_seqlen=n)
    grads_t = torch.autograd.grad(out, (q, k, v), go)
    to_j = lambda t: jnp.asarray(t.detach().float().cpu().numpy()).astype(jnp.bfloat16)  # noqa: E731
    jq, jk, jv, jgo = map(to_j, (q, k, v, go))
    jcrow, jcol, jcu = (jnp.asarray(x.cpu().numpy()) for x in (crow, col, cu))

    def loss(q, k, v):
        o = aj.blocksparse_flash_attn_varlen_fwd(q, k, v, jcu, jcu, scale, (jcrow, jcol), block_size=bs,
                                                 max_seqlen=n)
        return (o.astype(jnp.float32) * jgo.astype(jnp.float32)).sum()

    # d/do of sum(o * go) is go rounded to bf16: the same dO the torch backward receives
    grads_j = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jq, jk, jv)
    for name, a, b in zip(("dq", "dk", "dv"), grads_t, grads_j):
        same = np.array_equal(a.float().cpu().numpy(), np.asarray(b.astype(jnp.float32)))
        print(f"torch vs JAX {name}: {'bitwise equal' if same else 'DIFFER'}")


    if SWEEP:
        sweep(q.detach(), k.detach(), v.detach(), go, cu, crow, col, scale, bs, n)


# BlocksparseBackwardConfig grid of the sweep: (block_m, block_n, dq_warps, dkdv_warps, stages,
# dkdv_gluon, dq_gluon); the Gluon kernels apply to 64 x 64 tiles and 4 warps only
SWEEP_CONFIGS = [(bm, bn, wq, wk, st, gk, gq) for bm, bn in ((64, 64), (32, 64), (64, 32), (32, 32))
                 for wq in (4, 8) for wk in (4, 8) for st in (2, 3)
                 for gk in ((True, False) if (bm, bn, wk) == (64, 64, 4) else (False,))
                 for gq in ((True, False) if (bm, bn, wq) == (64, 64, 4) else (False,))]
SWEEP = os.environ.get("BLOCKSPARSE_BWD_SWEEP") == "1"   # the config sweep (and each launch alone)
if os.environ.get("BLOCKSPARSE_BWD_SWEEP_TILES"):  # e.g. "64x64": only those (block_m, block_n) tiles
    _tiles = {tuple(int(x) for x in t.split("x")) for t in os.environ["BLOCKSPARSE_BWD_SWEEP_TILES"].split(",")}
    SWEEP_CONFIGS = [c for c in SWEEP_CONFIGS if c[:2] in _tiles]


def sweep(q, k, v, go, cu, crow, col, scale, bs, n):
    """The backward launches alone (CUDA events, L2 flushed) per config, and each
    launch of the planner's default on its own."""
    from adapters.torch._executor import info, run_plan, target_for
    from core_kernels._plan import Plan
    from core_kernels.blocksparse_attention import (BlocksparseBackwardConfig, plan_blocksparse_attention_backward,
                                                    plan_blocksparse_attention_lse)
    tgt = target_for(q.device)
    opts = dict(sm_scale=scale, block_size=bs, max_seqlen=n)
    fwd = plan_blocksparse_attention_lse(tgt, info(q), info(k), info(v), info(cu), info(cu), info(crow),
                                         info(col), **opts)
    env = run_plan(fwd, dict(q=q, k=k, v=v, cu_seqlens_k=cu, cu_seqlens_q=cu, crow=crow, col=col))
    tensors = dict(q=q, k=k, v=v, output=env["output"], lse=env["lse"], grad_output=go, cu_seqlens_k=cu,
                   cu_seqlens_q=cu, crow=crow, col=col)
    args = [info(tensors[x]) for x in ("q", "k", "v", "output", "lse", "grad_output", "cu_seqlens_k",
                                       "cu_seqlens_q", "crow", "col")]
    default = plan_blocksparse_attention_backward(tgt, *args, **opts)
    full = run_plan(default, tensors)
    print("default backward launches alone:")
    for launch in default.launches:
        # only the buffers this launch writes are allocated (zeroed where the plan
        # zeroes them); the ones earlier launches wrote are the full run's
        written = {launch.params[w] for w in launch.writes}
        one = Plan({n: b for n, b in default.buffers.items() if n in written}, (launch,), ())
        given = {**tensors, **{b: full[b] for b in default.buffers if b not in written}}
        t = kernel_time_torch(lambda one=one, given=given: run_plan(one, given))
        print(f"  {launch.kernel.fn.__name__:36s}{t * 1e3:9.3f} ms")
    print(f"{'config (bm, bn, dq_warps, dkdv_warps, stages, dkdv_gluon, dq_gluon)':64s}{'bwd_ms':>9s}")
    for cfg in [None] + SWEEP_CONFIGS:
        try:
            plan = default if cfg is None else plan_blocksparse_attention_backward(
                tgt, *args, **opts, config=BlocksparseBackwardConfig(*cfg))
            t = kernel_time_torch(lambda plan=plan: run_plan(plan, tensors))
            print(f"{'default' if cfg is None else str(cfg):64s}{t * 1e3:9.3f}", flush=True)
        except Exception as exc:  # noqa: BLE001  a config that does not compile
            print(f"{str(cfg):56s} error {exc!r:.100}", flush=True)


if __name__ == "__main__":
    run()

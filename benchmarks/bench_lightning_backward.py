"""Lightning attention forward + backward on the GPU, side by side with
flash-linear-attention's chunk_simple_gla (fla-core 0.6.0, a benchmark-only
wheel: g_gamma = -ed, scale 1, [B, T, H, D] layout, final state; the
comparison of gpu.md) in the same run.

    PYTHONPATH=. python benchmarks/bench_lightning_backward.py [--sweep]

Shapes: B1 H64 N4096 and B4 H64 N1024, D = E = 128, bf16 and fp32, final state
only, loss = sum(o * dO) + sum(kv * dKV). Times: median of triton's do_bench
(L2 flushed) for forward + backward through torch autograd, every input
requiring grad except ed (a constant, as in MiniMax); with ed constant the backward runs the
forward's kernels (backward_plan._forward_passes). "bwd alone" times the backward plan by
itself in both forms: the forward's kernels and the scan kernels (LightningBackwardConfig).
Also checks torch vs JAX gradients bitwise (both forms) and that the backward is bitwise
deterministic. Target: ours <= 0.5x fla's time.
``--varlen``: the same over packed sequences (lightning_attention_varlen; the
registry's B16-mixed256-8192 and B64-mixed64-1024 batches, H 64, D = E = 128),
fla's chunk_simple_gla with cu_seqlens beside it (bf16), the backward alone in both
forms (the varlen forward kernel reversed and shifted, and the scans), and
torch vs JAX bitwise.
Imports on a CPU-only machine; running needs a CUDA GPU. ``--sweep``: the
backward launch alone (its plan run directly) over LightningBackwardConfig's
tiles, warps and stages at the same shapes (the measurement behind the
plan's default configs).
"""
from __future__ import annotations

import numpy as np

from benchmarks.timing import kernel_time_torch

SHAPES = [(1, 64, 4096, 128), (4, 64, 1024, 128)]


def run():
    import torch
    import adapters.torch as at
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as exc:  # noqa: BLE001 - a benchmark-only dependency
        chunk_simple_gla = None
        print(f"flash-linear-attention not importable ({exc}); ours only")
    dev = "cuda"
    for dtype in (torch.bfloat16, torch.float32):
        for b, h, n, d in SHAPES:
            g = torch.Generator(device="cpu").manual_seed(0)
            q, k, v = (torch.randn(b, h, n, d, generator=g).mul(0.3).to(dev, dtype).requires_grad_()
                       for _ in range(3))
            # ed constant (MiniMax's decay rates are fixed; fla's g_gamma gets no gradient)
            ed = torch.rand(h, generator=g).mul(0.5).add(0.01).to(dev)
            do = torch.randn(b, h, n, d, generator=g).to(dev, dtype)
            dkv = torch.randn(b, h, d, d, generator=g).to(dev)

            def ours():
                o, kv = at.lightning_attention(q, k, v, ed, 256, None, True)
                return torch.autograd.grad((o * do).sum() + (kv * dkv).sum(), (q, k, v))
            grads = ours()
            again = ours()
            det = all(torch.equal(a, b_) for a, b_ in zip(grads, again))
            t_ours = kernel_time_torch(ours)
            t_fwd = kernel_time_torch(lambda: at.lightning_attention(q.detach(), k.detach(), v.detach(),
                                                                     ed.detach(), 256, None, True))
            t_fwd_form, t_scans = _backward_alone(q, k, v, ed, do, dkv)
            line = (f"{str(dtype)[6:]:9s} B{b} H{h} N{n} D{d}: ours fwd {t_fwd * 1e6:7.0f} us, "
                    f"fwd+bwd {t_ours * 1e6:7.0f} us, deterministic {det}; bwd alone {t_fwd_form * 1e6:7.0f} us "
                    f"(scan kernels {t_scans * 1e6:7.0f} us)")
            print(line, flush=True)  # before fla's first call (its autotuning takes minutes)
            if chunk_simple_gla is not None:
                qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
                dot = do.transpose(1, 2).contiguous()
                gamma = (-ed.detach()).float()

                def fla():
                    o, st = chunk_simple_gla(qt, kt, vt, g_gamma=gamma, scale=1.0, output_final_state=True)
                    return torch.autograd.grad((o * dot).sum() + (st * dkv).sum(), (qt, kt, vt))
                line += _fla_timed(fla, t_ours) + " (target <= 0.5)"
            print(line, flush=True)
    _torch_vs_jax()


def _fla_timed(fla, t_ours) -> str:
    """fla's forward + backward time beside ours, or why it failed."""
    try:
        t_fla = kernel_time_torch(fla)
        return f" | fla fwd+bwd {t_fla * 1e6:7.0f} us, ours / fla {t_ours / t_fla:.2f}"
    except Exception as exc:  # noqa: BLE001 - a benchmark-only dependency
        return f" | fla failed: {type(exc).__name__}: {str(exc)[:120]}"


def _backward_alone(q, k, v, ed, do, dkv):
    """The backward plan by itself (final state only, ed constant): the default
    form (the forward's kernels) and the scan kernels."""
    import torch
    import adapters.torch as at
    from adapters.torch._executor import planned, run_plan
    from core_kernels.lightning_attention import LightningBackwardConfig, plan_lightning_attention_backward
    with torch.no_grad():
        _, kv = at.lightning_attention(q, k, v, ed, 256, None, True)
    arrays = dict(q=q.detach(), k=k.detach(), v=v.detach(), ed=ed, kv_history=None, kv=kv, grad_output=do,
                  grad_kv=dkv)
    tensors = {n_: t for n_, t in arrays.items() if t is not None}
    times = []
    for cfg in (None, LightningBackwardConfig() if q.dtype == torch.bfloat16 else LightningBackwardConfig(block_t=32)):
        plan, dev = planned(plan_lightning_attention_backward, arrays, block_size=256,
                            output_final_state_only=True, need_grad_ed=False, config=cfg)
        times.append(kernel_time_torch(lambda: run_plan(plan, tensors, device=dev)))
    return times


def _torch_vs_jax():
    """Gradients through both adapters, bitwise: ed differentiated with per-block
    states (the scan kernels), and ed constant with a history and the final
    state (the forward's kernels; Gluon at D = 128, N a multiple of 64)."""
    import jax
    import jax.numpy as jnp
    import torch
    import adapters.jax as aj
    import adapters.torch as at
    rng = np.random.default_rng(1)
    for dtype, (b, h, n, d), ed_grad, final in ((np.float32, (1, 8, 1000, 64), True, False),
                                               (np.float32, (2, 16, 4096, 128), False, True),
                                               ("bfloat16", (2, 16, 4096, 128), False, True)):
        cast = (lambda x: jnp.asarray(x).astype(jnp.bfloat16)) if dtype == "bfloat16" else jnp.asarray
        q, k, v = (cast(rng.standard_normal((b, h, n, d)).astype(np.float32) * 0.3) for _ in range(3))
        ed = rng.uniform(0.01, 0.5, h).astype(np.float32)
        do = cast(rng.standard_normal((b, h, n, d)).astype(np.float32))
        hist = None if not final else rng.standard_normal((b, h, d, d)).astype(np.float32)
        dkv = rng.standard_normal((b, h, d, d) if final else (b, h, n // 256 + (n % 256 > 0) + 1, d, d))
        dkv = dkv.astype(np.float32)
        tq, tk, tv = (torch.from_dlpack(x).clone().requires_grad_(True) for x in (q, k, v))
        ted = torch.tensor(ed, device="cuda", requires_grad=ed_grad)
        thist = None if hist is None else torch.tensor(hist, device="cuda", requires_grad=True)
        o, kv = at.lightning_attention(tq, tk, tv, ted, 256, thist, final)
        loss = (o.float() * torch.from_dlpack(do).float()).sum() + (kv * torch.tensor(dkv, device="cuda")).sum()
        wrt = (tq, tk, tv) + ((ted,) if ed_grad else ()) + ((thist,) if thist is not None else ())
        tgrads = torch.autograd.grad(loss, wrt)

        def jloss(q, k, v, ed, hist):
            o, kv = aj.lightning_attention(q, k, v, ed, 256, hist, final)
            return (o.astype(jnp.float32) * do.astype(jnp.float32)).sum() + (kv * jnp.asarray(dkv)).sum()
        argnums = (0, 1, 2) + ((3,) if ed_grad else ()) + ((4,) if hist is not None else ())
        jgrads = jax.jit(jax.grad(jloss, argnums=argnums))(q, k, v, jnp.asarray(ed),
                                                          None if hist is None else jnp.asarray(hist))
        names = ("dq", "dk", "dv") + (("ded",) if ed_grad else ()) + (("dhist",) if hist is not None else ())
        verdicts = []
        for name, a, j in zip(names, tgrads, jgrads):
            bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
            a = a.detach().view(bits).cpu().numpy()
            j = np.asarray(j).view(np.int16 if bits == torch.int16 else np.int32)
            verdicts.append(f"{name} {'bitwise equal' if np.array_equal(a, j) else 'DIFFER'}")
        print(f"torch vs JAX, {np.dtype(dtype).name if dtype != 'bfloat16' else 'bfloat16'} B{b} H{h} N{n} D{d}, "
              f"{'ed differentiated, per-block states' if ed_grad else 'ed constant, history, final state'}: "
              + ", ".join(verdicts), flush=True)


def varlen():
    import jax
    import jax.numpy as jnp
    import torch
    import adapters.jax as aj
    import adapters.torch as at
    from adapters.torch._executor import planned, run_plan
    from benchmarks.registry import LIGHTNING_VARLEN_LENS
    from core_kernels.lightning_attention import LightningBackwardConfig, plan_lightning_attention_varlen_backward
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as exc:  # noqa: BLE001 - a benchmark-only dependency
        chunk_simple_gla = None
        print(f"flash-linear-attention not importable ({exc}); ours only")
    h, d = 64, 128
    for name in ("B16-mixed256-8192", "B64-mixed64-1024"):
        lens = LIGHTNING_VARLEN_LENS[name]
        t, b = sum(lens), len(lens)
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
        for dtype in (torch.bfloat16, torch.float32):
            g = torch.Generator(device="cpu").manual_seed(0)
            q, k, v = (torch.randn(t, h, d, generator=g).mul(0.3).to("cuda", dtype).requires_grad_()
                       for _ in range(3))
            ed = torch.rand(h, generator=g).mul(0.5).add(0.01).to("cuda")
            do = torch.randn(t, h, d, generator=g).to("cuda", dtype)
            dkv = torch.randn(b, h, d, d, generator=g).to("cuda")

            def ours():
                o, st = at.lightning_attention_varlen(q, k, v, ed, cu)
                return torch.autograd.grad((o * do).sum() + (st * dkv).sum(), (q, k, v))
            grads, again = ours(), ours()
            det = all(torch.equal(a, b_) for a, b_ in zip(grads, again))
            t_ours = kernel_time_torch(ours)
            with torch.no_grad():
                t_fwd = kernel_time_torch(lambda: at.lightning_attention_varlen(q, k, v, ed, cu))
                _, st = at.lightning_attention_varlen(q, k, v, ed, cu)
            arrays = dict(q=q.detach(), k=k.detach(), v=v.detach(), ed=ed, cu_seqlens=cu, kv=st, grad_output=do,
                          grad_kv=dkv, kv_history=None)
            tensors = {n_: x for n_, x in arrays.items() if x is not None}
            alone = []
            for cfg in (None, LightningBackwardConfig(block_t=64 if dtype == torch.bfloat16 else 32)):
                plan, dev = planned(plan_lightning_attention_varlen_backward, arrays, need_grad_ed=False, config=cfg)
                alone.append(kernel_time_torch(lambda: run_plan(plan, tensors, device=dev)))
            line = (f"{str(dtype)[6:]:9s} varlen {name} (T {t}) H{h} D{d}: ours fwd {t_fwd * 1e6:7.0f} us, "
                    f"fwd+bwd {t_ours * 1e6:7.0f} us, deterministic {det}; bwd alone {alone[0] * 1e6:7.0f} us "
                    f"(scan kernels {alone[1] * 1e6:7.0f} us)")
            print(line, flush=True)
            if chunk_simple_gla is not None and dtype == torch.bfloat16:  # (fp32: its autotuning takes minutes)
                qt, kt, vt = (x.detach()[None].requires_grad_() for x in (q, k, v))
                gamma, cu64 = (-ed).float(), cu.long()

                def fla():
                    o, fin = chunk_simple_gla(qt, kt, vt, g_gamma=gamma, scale=1.0, output_final_state=True,
                                              cu_seqlens=cu64)
                    return torch.autograd.grad((o[0] * do).sum() + (fin * dkv).sum(), (qt, kt, vt))
                print(line + _fla_timed(fla, t_ours), flush=True)
            if dtype == torch.bfloat16:  # torch vs JAX, bitwise
                jx = [jnp.asarray(x.detach().float().cpu().numpy()).astype(jnp.bfloat16) for x in (q, k, v, do)]
                jdkv, jcu, jed = (jnp.asarray(x.cpu().numpy()) for x in (dkv, cu, ed))

                def jloss(q, k, v):
                    o, fin = aj.lightning_attention_varlen(q, k, v, jed, jcu)
                    return (o.astype(jnp.float32) * jx[3].astype(jnp.float32)).sum() + (fin * jdkv).sum()
                jg = jax.jit(jax.grad(jloss, argnums=(0, 1, 2)))(*jx[:3])
                same = [np.array_equal(a.detach().view(torch.int16).cpu().numpy(), np.asarray(j).view(np.int16))
                        for a, j in zip(grads, jg)]
                print(f"  torch vs JAX (dq, dk, dv): {'bitwise equal' if all(same) else f'DIFFER {same}'}",
                      flush=True)


def sweep():
    import itertools
    import torch
    import adapters.torch as at
    from adapters.torch._executor import planned, run_plan
    from core_kernels.lightning_attention import LightningBackwardConfig, plan_lightning_attention_backward
    from benchmarks.timing import kernel_time_torch
    grid = list(itertools.product((32, 64), (32, 64), (4, 8), (1,))) + [(64, 64, 8, 2), (32, 64, 8, 2)]
    for dtype in (torch.bfloat16, torch.float32):
        for b, h, n, d in SHAPES:
            g = torch.Generator(device="cpu").manual_seed(0)
            q, k, v = (torch.randn(b, h, n, d, generator=g).mul(0.3).to("cuda", dtype) for _ in range(3))
            ed = torch.rand(h, generator=g).mul(0.5).add(0.01).to("cuda")
            do = torch.randn(b, h, n, d, generator=g).to("cuda", dtype)
            _, kv = at.lightning_attention(q, k, v, ed, 256, None, True)
            dkv = torch.randn_like(kv)
            arrays = dict(q=q, k=k, v=v, ed=ed, kv_history=None, kv=kv, grad_output=do, grad_kv=dkv)
            rows = []
            for block_t, tile, warps, stages in grid:
                cfg = LightningBackwardConfig(block_t=block_t, block_d=tile, block_e=tile, num_warps=warps,
                                              num_stages=stages)
                try:
                    plan, dev = planned(plan_lightning_attention_backward, arrays, block_size=256,
                                        output_final_state_only=True, need_grad_ed=False, config=cfg)
                    tensors = {n_: t for n_, t in arrays.items() if t is not None}
                    t = kernel_time_torch(lambda: run_plan(plan, tensors, device=dev), warmup_ms=10, rep_ms=60)
                    rows.append((t, cfg))
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                    print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
            rows.sort(key=lambda r: r[0])
            print(f"{str(dtype)[6:]} B{b} H{h} N{n} D{d}: backward alone, {len(rows)} configs", flush=True)
            for t, cfg in rows:
                print(f"  {t * 1e6:8.1f} us  block_t {cfg.block_t} tile {cfg.block_d} warps {cfg.num_warps} "
                      f"stages {cfg.num_stages}",
                      flush=True)


if __name__ == "__main__":
    import sys
    if "--sweep" in sys.argv[1:]:
        sweep()
    elif "--varlen" in sys.argv[1:]:
        varlen()
    else:
        run()

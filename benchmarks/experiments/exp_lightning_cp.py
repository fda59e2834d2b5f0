"""Experiment: context-parallel lightning attention on two GPUs against one GPU
(B=1, H=64, D=E=128, N=4096 and 65536, final state only), forward and
forward + backward, with the results checked against the one-GPU call
(relative error, run-to-run bit equality) and, for JAX, the compiled HLO's
all-gathers (none may be q/k/v-sized).

    python3 -m benchmarks.experiments.exp_lightning_cp jax  [OUT.json]   # one process, 2 GPUs
    torchrun --standalone --nproc_per_node 2 -m benchmarks.experiments.exp_lightning_cp torch [OUT.json]
    python3 -m benchmarks.experiments.exp_lightning_cp sweep [OUT.json]  # shard-state kernel configs, 1 GPU

Times are per call: back-to-back calls and one sync (JAX: timing.pipelined_time;
torch: the same loop, the ranks started together by a barrier). The one-GPU
baseline runs the whole sequence on one GPU in the same process (torch: on
every rank at once, rank 0's time). ``jax_rows`` / ``torch_rows`` return the
rows for a caller such as benchmarks/bench_scaleout.py.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

SHAPES = [(1, 64, 4096), (1, 64, 65536)]
DTYPES = ["float32", "bfloat16"]
D = E = 128


def _err(got, want) -> float:
    """max |got - want| / max |want|, on want's device (fp32)."""
    if hasattr(want, "device_buffers") or type(want).__module__.startswith("jax"):
        import jax
        import jax.numpy as jnp
        got = jax.device_put(got, want.sharding).astype(jnp.float32)
        want = want.astype(jnp.float32)
        return float(jnp.abs(got - want).max() / jnp.maximum(jnp.abs(want).max(), 1e-30))
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------- JAX (one process, both GPUs)
def jax_rows(shapes=SHAPES, dtypes=DTYPES, reps=20, entry="jit"):
    """``entry``: "jit" (NamedSharding of the sequence: _spmd's split, whose backward
    recomputes the shard states) or "shard_map" (lightning_attention_cp, which keeps them)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from adapters.jax import lightning_attention, lightning_attention_cp
    try:
        from jax import shard_map
    except ImportError:
        from jax.experimental.shard_map import shard_map
    from benchmarks import timing

    devs = jax.devices()[:2]
    mesh = Mesh(np.array(devs), ("sp",))
    seq, rep = NamedSharding(mesh, P(None, None, "sp")), NamedSharding(mesh, P())

    def whole(q, k, v, ed):
        return lightning_attention(q, k, v, ed, output_final_state_only=True)

    def in_shard_map(q, k, v, ed):
        s = P(None, None, "sp")
        return shard_map(lambda q, k, v, ed: lightning_attention_cp(q, k, v, ed, axis_name="sp"), mesh=mesh,
                         in_specs=(s, s, s, P()), out_specs=(s, P()))(q, k, v, ed)

    def make(call):
        def fwd(q, k, v, ed):
            return call(q, k, v, ed)

        def fwd_bwd(q, k, v, ed, do, dfin):
            out, vjp = jax.vjp(lambda q, k, v: call(q, k, v, ed), q, k, v)
            return out + vjp((do, dfin))
        return fwd, fwd_bwd

    rows = []
    for b, h, n in shapes:
        for dtype in dtypes:
            name = f"lightning-cp B{b} H{h} N{n} {dtype}"
            try:
                keys = jax.random.split(jax.random.PRNGKey(n), 6)
                dt = jnp.dtype(dtype)
                with jax.default_device(devs[0]):
                    q = (jax.random.normal(keys[0], (b, h, n, D), jnp.float32) * 0.3).astype(dt)
                    k = (jax.random.normal(keys[1], (b, h, n, D), jnp.float32) * 0.3).astype(dt)
                    v = jax.random.normal(keys[2], (b, h, n, E), jnp.float32).astype(dt)
                    do = jax.random.normal(keys[3], (b, h, n, E), jnp.float32).astype(dt)
                    ed = jax.random.uniform(keys[4], (h,), jnp.float32) * 0.5 + 0.01
                    dfin = jax.random.normal(keys[5], (b, h, D, E), jnp.float32)
                one = (q, k, v, ed, do, dfin)
                two = tuple(jax.device_put(x, s) for x, s in zip(one, (seq, seq, seq, rep, seq, rep)))
                row = dict(name=name, framework="jax", entry=entry, devices=[str(d) for d in devs])
                fns = zip(("fwd", "fwd_bwd"), make(whole), make(in_shard_map if entry == "shard_map" else whole),
                          (4, 6))
                for what, fn1, fn2, nargs in fns:
                    f1, f = jax.jit(fn1), jax.jit(fn2)
                    want = f1(*one[:nargs])
                    got = f(*two[:nargs])
                    again = f(*two[:nargs])
                    row[f"{what}_err"] = max(_err(g, w) for g, w in zip(got, want))
                    row[f"{what}_bitwise_rerun"] = all(bool(jnp.array_equal(a, g)) for a, g in zip(again, got))
                    row[f"{what}_out_sharding"] = str(got[0].sharding.spec)
                    hlo = f.lower(*two[:nargs]).compile().as_text()
                    # (the GPU's HLO holds async all-gather-start / -done pairs)
                    row[f"{what}_hlo_all_gathers"] = re.findall(r"= (\S+) all-gather(?:-start)?\(", hlo)
                    row[f"{what}_hlo_all_reduces"] = re.findall(r"= (\S+) all-reduce(?:-start)?\(", hlo)
                    t1 = timing.pipelined_time([lambda: f1(*one[:nargs])], "jax", reps=reps, trials=3)
                    t2 = timing.pipelined_time([lambda: f(*two[:nargs])], "jax", reps=reps, trials=3)
                    row.update({f"{what}_1gpu_us": t1 * 1e6, f"{what}_2gpu_us": t2 * 1e6,
                                f"{what}_speedup": t1 / t2})
                    del want, got, again
            except Exception as e:  # keep the other rows
                row = dict(name=name, framework="jax", error=repr(e)[:2000])
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


# ---------------------------------------------------------------- torch (torchrun, one GPU a rank)
def _torch_time(fn, reps):
    import torch
    import torch.distributed as dist
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(3):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / reps)
    return sorted(times)[1]


def torch_rows(shapes=SHAPES, dtypes=DTYPES, reps=20):
    import torch
    import torch.distributed as dist

    import adapters.torch as at
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    mesh = init_device_mesh(dev.type, (world,))
    rows = []
    for b, h, n in shapes:
        for dtype in dtypes:
            name = f"lightning-cp B{b} H{h} N{n} {dtype}"
            row = dict(name=name, framework="torch", world=world,
                       device=torch.cuda.get_device_name(dev) if gpu else "cpu")
            try:
                g = torch.Generator(device=dev).manual_seed(n)   # the same full inputs on every rank
                tdt = getattr(torch, dtype)
                q = (torch.randn(b, h, n, D, device=dev, generator=g) * 0.3).to(tdt)
                k = (torch.randn(b, h, n, D, device=dev, generator=g) * 0.3).to(tdt)
                v = torch.randn(b, h, n, E, device=dev, generator=g).to(tdt)
                do = torch.randn(b, h, n, E, device=dev, generator=g).to(tdt)
                ed = torch.rand(h, device=dev, generator=g) * 0.5 + 0.01
                dfin = torch.randn(b, h, D, E, device=dev, generator=g)

                def shard(t):
                    return t.chunk(world, 2)[rank].contiguous()

                ql, kl, vl, dol = (shard(t) for t in (q, k, v, do))

                def full_fwd():
                    return at.lightning_attention(q, k, v, ed, output_final_state_only=True)

                def cp_fwd():
                    return at.lightning_attention_cp(ql, kl, vl, ed)

                def fwd_bwd(call, leaves, do_):
                    def run():
                        xs = [t.detach().requires_grad_(True) for t in leaves]
                        o, fin = call(*xs)
                        return (o, fin) + torch.autograd.grad((o, fin), xs, (do_, dfin))
                    return run

                one_fb = fwd_bwd(lambda a, b_, c: at.lightning_attention(a, b_, c, ed, output_final_state_only=True),
                                 (q, k, v), do)
                cp_fb = fwd_bwd(lambda a, b_, c: at.lightning_attention_cp(a, b_, c, ed), (ql, kl, vl), dol)
                for what, one, two, sharded in (("fwd", full_fwd, cp_fwd, (True, False)),
                                                ("fwd_bwd", one_fb, cp_fb, (True, False, True, True, True))):
                    want, got, again = one(), two(), two()
                    row[f"{what}_err"] = max(_err(g, shard(w) if s else w) for w, g, s in zip(want, got, sharded))
                    row[f"{what}_bitwise_rerun"] = all(torch.equal(a, g) for a, g in zip(again, got))
                    t1, t2 = _torch_time(one, reps), _torch_time(two, reps)
                    row.update({f"{what}_1gpu_us": t1 * 1e6, f"{what}_2gpu_us": t2 * 1e6,
                                f"{what}_speedup": t1 / t2})
                    del want, got, again
                # the DTensor path (Shard(2) on the sequence), forward
                dts = [DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (ql, kl, vl)]
                edr = DTensor.from_local(ed, mesh, [Replicate()], run_check=False)
                o_dt, _ = at.lightning_attention(*dts, edr, output_final_state_only=True)
                o_cp, _ = cp_fwd()
                row["dtensor_fwd_equal_cp"] = bool(torch.equal(o_dt.to_local(), o_cp))
                row["dtensor_fwd_us"] = _torch_time(
                    lambda: at.lightning_attention(*dts, edr, output_final_state_only=True), reps) * 1e6
            except Exception as e:
                row["error"] = repr(e)[:2000]
            if rank == 0:
                print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- the shard-state kernel's configs
def sweep_rows(n=32768, h=64, configs=None, dtypes=DTYPES, prefill=True):
    import torch

    from adapters.torch._executor import info, run_plan, target_for
    from benchmarks import timing
    from core_kernels.lightning_attention import plan_lightning_attention
    from core_kernels.lightning_attention.cp_plan import LightningCPConfig, plan_lightning_cp_state

    rows = []
    for dtype in dtypes:
        tdt = getattr(torch, dtype)
        q, k = (torch.randn(1, h, n, D, device="cuda") * 0.3).to(tdt), (torch.randn(1, h, n, D, device="cuda") * 0.3).to(tdt)
        v = torch.randn(1, h, n, E, device="cuda").to(tdt)
        ed = torch.rand(h, device="cuda") * 0.5 + 0.01
        tgt = target_for(q.device)
        nbytes = 2 * k.numel() * k.element_size()
        ref = None
        for bt, be, stages, split in configs or [(32, 64, 3, True), (64, 64, 3, True), (64, 128, 2, True)]:
            cfg = LightningCPConfig(block_t=bt, block_e=be, num_stages=stages, split_state=split)
            row = dict(name=f"cp-state B1 H{h} N{n} {dtype}", config=str(cfg))
            try:
                plan = plan_lightning_cp_state(tgt, info(k), info(v), info(ed), config=cfg)
                tensors = dict(k=k, v=v, ed=ed)
                out = run_plan(plan, tensors)["state"]
                ref = out if ref is None else ref
                t = timing.kernel_time_torch(lambda: run_plan(plan, tensors), rep_ms=100)
                row.update(us=t * 1e6, tbps=nbytes / t / 1e12, rel_to_first=_err(out, ref))
            except Exception as e:
                row["error"] = repr(e)[:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
        for hist in (None, torch.zeros(1, h, D, E, device="cuda")) if prefill else ():
            plan = plan_lightning_attention(tgt, info(q), info(k), info(v), info(ed),
                                            None if hist is None else info(hist), output_final_state_only=True)
            tensors = dict(q=q, k=k, v=v, ed=ed, kv_history=hist)
            t = timing.kernel_time_torch(lambda: run_plan(plan, tensors), rep_ms=100)
            row = dict(name=f"prefill B1 H{h} N{n} {dtype} final, history={hist is not None}", us=t * 1e6,
                       tbps=4 * nbytes / 2 / t / 1e12)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main():
    mode = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else None
    if mode == "jax":
        rows = jax_rows()
    elif mode == "jax_shard_map":
        rows = jax_rows(shapes=SHAPES[1:], entry="shard_map") + jax_rows(shapes=SHAPES[:1], dtypes=DTYPES[:1])
    elif mode == "sweep":
        rows = sweep_rows()
    elif mode == "sweep_fp32":
        rows = sweep_rows(configs=[(64, 128, 2, True), (32, 64, 3, False), (64, 64, 3, False), (32, 128, 2, False),
                                   (64, 128, 2, False), (64, 128, 3, True)], dtypes=["float32"], prefill=False)
    elif mode == "torch":
        import torch
        import torch.distributed as dist
        local = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
            rows = torch_rows()
        else:  # a dry run on the CPU (gloo, tiny shapes)
            dist.init_process_group("gloo")
            rows = torch_rows(shapes=[(1, 2, 32)], dtypes=["float32"], reps=1)
        if dist.get_rank():
            out = None
        dist.destroy_process_group()
    else:
        raise SystemExit(f"mode: expected jax, torch or sweep, got {mode!r}")
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

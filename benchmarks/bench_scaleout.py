"""Scale-out on two GPUs (issue 44): every op at its headline shape, throughput on two
GPUs against one, for JAX (jit over a NamedSharding of the heads, one process holding
both GPUs) and torch (DTensors sharded over the heads, two ranks over NCCL; eager and
torch.compile), each two-GPU result checked bit for bit against the one-GPU result and
the compiled JAX program checked for collectives (none may run); plus context-parallel
lightning (B1 H64 N4096 and N65536, sequence sharded) from
benchmarks/experiments/exp_lightning_cp.py where that module exists.

The exact commands (nvidia-h200-x2 or nvidia-h100-x2; NCCL_NVLS_ENABLE=0 as the machine
sets it; after ``source scripts/env.sh``):

    python3 -m benchmarks.bench_scaleout jax OUT_jax.json          # one process, both GPUs
    torchrun --standalone --nproc_per_node 2 -m benchmarks.bench_scaleout torch OUT_torch.json
    python3 -m benchmarks.run scaleout --out DIR                   # both (torch through torchrun):
                                                                   # DIR/bench_scaleout.json + summary.json

Rows: ``name`` (op and shape), ``framework``, ``variant`` (``heads`` / ``heads,
batch_invariant`` / ``compile`` / ``cp``), ``one_gpu_us`` (the whole problem on one GPU,
in the same process: torch runs it on every rank at once and reports rank 0's),
``us`` (two GPUs), ``speedup`` = one_gpu_us / us, ``bitwise`` (two-GPU result == one-GPU
result), ``collectives`` (JAX: all-gather / all-reduce / collective-permute /
all-to-all ops in the compiled two-GPU program). Times are per call over back-to-back
calls with one sync (JAX: timing.pipelined_time; torch: the ranks start together after
a barrier, the slower rank's time). ``baseline`` / ``baseline_us`` repeat the one-GPU
time for summary.json (ratio = speedup). Lightning prefill and varlen run with
``batch_invariant=True`` (bitwise across shardings; docs/composability.md) and, for
comparison, with the default plan. ``small=True`` (or ``--small``) shrinks every shape
(a quick check on any two devices).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks import timing

COLUMNS = ["name", "framework", "variant", "one_gpu_us", "us", "speedup", "bitwise", "collectives", "error"]
VARLEN_LENS = [8192, 256, 4096, 512, 1024, 7000, 300, 2048, 6000, 256, 3000, 5000, 1500, 700, 8192, 3333]


# ------------------------------------------------------------------ the cases (numpy inputs, one seed)
def _cases(small: bool):
    """name -> (make() -> {array: numpy fp32/int}, {array: sharded axis or None},
    {array: dtype to cast to}, the op's keyword options, its kind)."""
    g = np.random.default_rng(0)
    f32 = lambda *s, scale=1.0: (g.standard_normal(s) * scale).astype(np.float32)  # noqa: E731
    s = 64 if small else 1
    cases = {}

    n, h, d = 16384 // s, 32, 128
    cases[f"merge_attn_states N{n} H{h} D{d} bf16"] = (
        lambda: dict(prefix_output=f32(n, h, d), prefix_lse=f32(h, n, scale=3.0), suffix_output=f32(n, h, d),
                     suffix_lse=f32(h, n, scale=3.0)),
        dict(prefix_output=1, prefix_lse=0, suffix_output=1, suffix_lse=0),
        dict(prefix_output="bfloat16", suffix_output="bfloat16"), {}, "merge")

    b, q_len, ctx, hq, hkv, bs = 4, 1024 // s, 4096 // s, 32, 8, 16

    def prefix():
        blocks = ctx // bs
        table = g.permutation(b * blocks + 1)[:b * blocks].reshape(b, blocks).astype(np.int32)
        return dict(q=f32(b * q_len, hq, d), k=f32(b * q_len, hkv, d), v=f32(b * q_len, hkv, d),
                    k_cache=f32(b * blocks + 1, hkv, d // 8, bs, 8), v_cache=f32(b * blocks + 1, hkv, d, bs),
                    b_loc=table, b_start_loc=(np.arange(b + 1) * q_len).astype(np.int32),
                    b_seq_len=np.full(b, q_len + ctx, np.int32))
    cases[f"prefix_prefill B{b} q{q_len} ctx{ctx} {hq}/{hkv}x{d} bf16"] = (
        prefix, dict(q=1, k=1, v=1, k_cache=1, v_cache=1),
        dict(q="bfloat16", k="bfloat16", v="bfloat16", k_cache="bfloat16", v_cache="bfloat16"),
        dict(max_input_len=q_len, max_seq_len=ctx), "prefix")

    for n in ((4096 // s,) if small else (4096,)):
        for invariant in (True, False):
            cases[f"lightning_attention B1 H64 N{n} D128 bf16" + ("" if invariant else " default")] = (
                lambda n=n: dict(q=f32(1, 64, n, 128, scale=0.3), k=f32(1, 64, n, 128, scale=0.3),
                                 v=f32(1, 64, n, 128), ed=np.linspace(0.01, 0.5, 64).astype(np.float32)),
                dict(q=1, k=1, v=1, ed=0), dict(q="bfloat16", k="bfloat16", v="bfloat16"),
                dict(batch_invariant=invariant), "lightning")

    bd = 4 if small else 64
    cases[f"linear_decode B{bd} H64 D128 bf16"] = (
        lambda: dict(q=f32(bd, 64, 1, 128), k=f32(bd, 64, 1, 128), v=f32(bd, 64, 1, 128),
                     kv_caches=f32(bd, 64, 128, 128, scale=0.1), slope_rate=np.linspace(0.01, 0.5, 64).astype(np.float32),
                     slot_idx=np.arange(bd, dtype=np.int32)),
        dict(q=1, k=1, v=1, kv_caches=1, slope_rate=0), dict(q="bfloat16", k="bfloat16", v="bfloat16"), {}, "decode")

    lens = [x // s for x in VARLEN_LENS]
    for invariant in (True, False):
        cases["lightning_attention_varlen 16 seqs (issue 22) H64 D128 bf16" + ("" if invariant else " default")] = (
            lambda: dict(q=f32(sum(lens), 64, 128, scale=0.3), k=f32(sum(lens), 64, 128, scale=0.3),
                         v=f32(sum(lens), 64, 128), ed=np.linspace(0.01, 0.5, 64).astype(np.float32),
                         cu_seqlens=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)),
            dict(q=1, k=1, v=1, ed=0), dict(q="bfloat16", k="bfloat16", v="bfloat16"),
            dict(batch_invariant=invariant), "varlen")

    from core_kernels.blocksparse_attention import build_sparse_layout
    for kind, lens_k, decode in (("prefill", [16384 // s], False), ("decode", [4096 // s] * (4 if small else 64), True)):
        seq = max(lens_k)
        (crow, col), _ = build_sparse_layout(32, seq, 64, 16, 8, False)

        def blocksparse(lens_k=lens_k, decode=decode, crow=crow, col=col):
            tk = sum(lens_k)
            return dict(q=f32(len(lens_k) if decode else tk, 32, 128), k=f32(tk, 8, 128), v=f32(tk, 8, 128),
                        cu_seqlens_k=np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32),
                        crow=np.asarray(crow), col=np.asarray(col))
        cases[f"blocksparse {kind} {len(lens_k)}x{seq} 32/8x128 bf16"] = (
            blocksparse, dict(q=1, k=1, v=1, crow=0, col=0), dict(q="bfloat16", k="bfloat16", v="bfloat16"),
            dict(block_size=64, max_seqlen=seq, batch_invariant=True, decode=decode), "blocksparse")
    return cases


# ------------------------------------------------------------------ JAX: one process, both GPUs
def _jax_call(kind, a, opts):
    import adapters.jax as aj
    if kind == "merge":
        return aj.merge_attn_states(a["prefix_output"], a["prefix_lse"], a["suffix_output"], a["suffix_lse"])
    if kind == "prefix":
        return aj.context_attention_fwd(*(a[n] for n in ("q", "k", "v", "k_cache", "v_cache", "b_loc",
                                                         "b_start_loc", "b_seq_len")), **opts)
    if kind == "lightning":
        return aj.lightning_attention(a["q"], a["k"], a["v"], a["ed"], **opts)
    if kind == "decode":
        return aj.linear_decode_forward_triton(a["q"], a["k"], a["v"], a["kv_caches"], a["slope_rate"], a["slot_idx"])
    if kind == "varlen":
        return aj.lightning_attention_varlen(a["q"], a["k"], a["v"], a["ed"], a["cu_seqlens"], **opts)
    opts = dict(opts)
    decode = opts.pop("decode")
    return aj.blocksparse_flash_attn_varlen_fwd(a["q"], a["k"], a["v"], a["cu_seqlens_k"],
                                                None if decode else a["cu_seqlens_k"], None,
                                                (a["crow"], a["col"]), **opts)


def _collectives(hlo: str) -> int:
    return sum(hlo.count(op) for op in ("all-gather(", "all-reduce(", "collective-permute(", "all-to-all(",
                                        "all-gather-start", "all-reduce-start"))


def jax_rows(small=False, reps=None):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    devs = jax.devices()
    if len(devs) < 2:
        return [dict(name="(all)", framework="jax", error=f"{len(devs)} device(s): two needed")]
    mesh = Mesh(np.array(devs[:2]), ("h",))
    reps = reps or (2 if small else 50)
    rows = []
    for name, (make, axes, dtypes, opts, kind) in _cases(small).items():
        row = dict(name=name, framework="jax", variant=_variant("heads", opts))
        try:
            host = {n: jnp.asarray(x).astype(dtypes.get(n, x.dtype)) for n, x in make().items()}

            def placed(sharded):
                out = {}
                for n, x in host.items():
                    ax = axes.get(n)
                    spec = P(*[("h" if i == ax else None) for i in range(x.ndim)]) if sharded and ax is not None else P()
                    out[n] = jax.device_put(x, NamedSharding(mesh, spec) if sharded else devs[0])
                return out
            one, two = placed(False), placed(True)
            f = jax.jit(lambda a, kind=kind, opts=opts: _jax_call(kind, a, opts))
            r1, r2 = f(one), f(two)
            row["bitwise"] = all(np.array_equal(np.asarray(x), np.asarray(y))
                                 for x, y in zip(jax.tree.leaves(r1), jax.tree.leaves(r2)))
            row["collectives"] = _collectives(f.lower(two).compile().as_text())
            trials = 1 if small else 3
            t1 = timing.pipelined_time([lambda: f(one)], "jax", reps=reps, trials=trials)
            t2 = timing.pipelined_time([lambda: f(two)], "jax", reps=reps, trials=trials)
            row.update(_times(t1, t2))
        except Exception as e:  # noqa: BLE001  (keep the other rows)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        print(row, flush=True)
        rows.append(row)
    rows += _cp_rows("jax_rows", small)
    return rows


def _variant(base, opts):
    return base + (", batch_invariant" if opts.get("batch_invariant") else "")


def _times(t1, t2):
    return dict(one_gpu_us=t1 * 1e6, us=t2 * 1e6, speedup=t1 / t2, baseline="one GPU (same process)",
                baseline_us=t1 * 1e6)


def _cp_rows(which, small):
    """Context-parallel lightning rows of the cp experiment, where it exists."""
    try:
        from benchmarks.experiments import exp_lightning_cp as cp
    except ImportError as e:
        return [dict(name="lightning_attention_cp B1 H64 N4096/N65536", framework=which.split("_")[0],
                     variant="cp", error=f"skipped: {e}")]
    kw = dict(shapes=[(1, 2, 256)], dtypes=["float32"], reps=2) if small else {}
    framework = which.split("_")[0]
    try:
        rows = getattr(cp, which)(**kw)
    except Exception as e:  # noqa: BLE001
        return [dict(name="lightning_attention_cp", framework=framework, variant="cp",
                     error=f"{type(e).__name__}: {e}"[:300])]
    # one row per timed part ("<what>_1gpu_us" / "<what>_2gpu_us": forward, forward+backward)
    out = []
    for r in rows:
        parts = [c[:-len("_2gpu_us")] for c in r if c.endswith("_2gpu_us")]
        if not parts:
            out.append(dict(name=str(r.get("name")), framework=framework, variant="cp", error=r.get("error")))
        for what in parts:
            t1, t2 = r.get(f"{what}_1gpu_us"), r[f"{what}_2gpu_us"]
            out.append(dict(name=f"{r.get('name')} {what}", framework=framework, variant="cp",
                            rel_err=r.get(f"{what}_err"), deterministic=r.get(f"{what}_bitwise_rerun"),
                            **(_times(t1 * 1e-6, t2 * 1e-6) if t1 else dict(us=t2))))
    return out


# ------------------------------------------------------------------ torch: two ranks (torchrun), NCCL
def _torch_call(kind, a, opts):
    import adapters.torch as at
    if kind == "merge":
        at.merge_attn_states(a["output"], a["prefix_output"], a["prefix_lse"], a["suffix_output"], a["suffix_lse"])
        return (a["output"],)
    if kind == "prefix":
        at.context_attention_fwd(a["q"], a["k"], a["v"], a["output"], "auto", a["k_cache"], a["v_cache"], a["b_loc"],
                                 a["b_start_loc"], a["b_seq_len"], opts["max_seq_len"], opts["max_input_len"])
        return (a["output"],)
    if kind == "lightning":
        return at.lightning_attention(a["q"], a["k"], a["v"], a["ed"], **opts)
    if kind == "decode":
        out = at.linear_decode_forward_triton(a["q"], a["k"], a["v"], a["kv_caches"], a["slope_rate"], a["slot_idx"])
        return out, a["kv_caches"]
    if kind == "varlen":
        return at.lightning_attention_varlen(a["q"], a["k"], a["v"], a["ed"], a["cu_seqlens"], **opts)
    opts = dict(opts)
    decode = opts.pop("decode")
    return (at.blocksparse_flash_attn_varlen_fwd(a["q"], a["k"], a["v"], a["cu_seqlens_k"],
                                                 None if decode else a["cu_seqlens_k"], None,
                                                 (a["crow"], a["col"]), **opts),)


# arrays each torch call writes in place: (name, like, axis)
_WRITTEN = {"merge": ("output", "prefix_output"), "prefix": ("output", "q")}


def _torch_time(fn, reps):
    """Seconds per call of ``reps`` back-to-back calls and one sync, the ranks started
    together; the slower rank's time, best of three."""
    import time
    import torch
    import torch.distributed as dist
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        t = torch.tensor([(time.perf_counter() - t0) / reps], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        best = min(best, float(t))
    return best


def torch_rows(small=False, reps=None):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    rank = int(os.environ.get("RANK", 0))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    world = dist.get_world_size()
    mesh = DeviceMesh("cuda", list(range(world)))
    reps = reps or (2 if small else 50)
    rows = []
    for name, (make, axes, dtypes, opts, kind) in _cases(small).items():
        row = dict(name=name, framework="torch", variant=_variant("heads", opts))
        try:
            full = {n: torch.from_numpy(x).cuda().to(getattr(torch, dtypes.get(n, str(x.dtype))))
                    for n, x in make().items()}
            if kind in _WRITTEN:
                out, like = _WRITTEN[kind]
                full[out] = torch.zeros_like(full[like])
                axes = dict(axes, **{out: axes[like]})

            def sharded(src):
                return {n: DTensor.from_local(x if axes.get(n) is None else x.chunk(world, axes[n])[rank].contiguous(),
                                              mesh, [Replicate() if axes.get(n) is None else Shard(axes[n])],
                                              run_check=False) for n, x in src.items()}
            fresh = lambda: {n: x.clone() for n, x in full.items()}  # noqa: E731
            one, two = fresh(), sharded(fresh())
            with torch.no_grad():
                r1 = _torch_call(kind, one, opts)
                r2 = _torch_call(kind, two, opts)
                r2 = [x.full_tensor() if isinstance(x, DTensor) else x for x in r2]
                row["bitwise"] = all(torch.equal(x, y) for x, y in zip(r1, r2))
                t1 = _torch_time(lambda: _torch_call(kind, one, opts), reps)
                t2 = _torch_time(lambda: _torch_call(kind, two, opts), reps)
            row.update(_times(t1, t2))
            rows.append(row)
            # torch.compile(fullgraph=True): the DTensor dispatch traced away
            crow = dict(name=name, framework="torch", variant=_variant("compile", opts))
            try:
                torch._dynamo.reset()
                f = torch.compile(lambda a, kind=kind, opts=opts: _torch_call(kind, a, opts), fullgraph=True)
                with torch.no_grad():
                    c1, c2 = f(one), f(two)
                    c2 = [x.full_tensor() if isinstance(x, DTensor) else x for x in c2]
                    crow["bitwise"] = all(torch.equal(x, y) for x, y in zip(c1, c2))
                    crow.update(_times(_torch_time(lambda: f(one), reps), _torch_time(lambda: f(two), reps)))
            except Exception as e:  # noqa: BLE001
                crow["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(crow)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
        if rank == 0:
            print(rows[-2:] if "error" not in row else rows[-1:], flush=True)
    rows += _cp_rows("torch_rows", small)
    return rows


# ------------------------------------------------------------------ both
def run(small=False):
    """Both frameworks (benchmarks.run): JAX here, torch through torchrun (2 ranks)."""
    import torch
    if torch.cuda.device_count() < 2:
        print(f"bench_scaleout: {torch.cuda.device_count()} GPU(s); two needed", flush=True)
        return []
    rows = jax_rows(small)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "torch.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "benchmarks.bench_scaleout", "torch", out] + (["--small"] if small else [])
        proc = subprocess.run(cmd, env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
        if proc.returncode == 0 and os.path.exists(out):
            with open(out) as f:
                rows += json.load(f)
        else:
            rows.append(dict(name="(all)", framework="torch", error=f"torchrun exited {proc.returncode}"))
    return rows


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    small = "--small" in args
    args = [a for a in args if a != "--small"]
    which = args[0] if args and args[0] in ("jax", "torch") else None
    out = args[1] if which and len(args) > 1 else (args[0] if args and not which else None)
    rows = {"jax": lambda: jax_rows(small), "torch": lambda: torch_rows(small), None: lambda: run(small)}[which]()
    if int(os.environ.get("RANK", 0)) == 0:
        for r in rows:
            print("  ".join(f"{c}={r[c]:.4g}" if isinstance(r.get(c), float) else f"{c}={r.get(c)}"
                            for c in COLUMNS if c in r), flush=True)
        if out:
            with open(out, "w") as f:
                json.dump(rows, f, indent=1)
    if which == "torch":
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""DTensor overhead: the host time an eager call on sharded DTensors adds over the
same call on each rank's local tensors, for our ops and for a built-in op
(``torch.add``) on the same DTensors.

    python3 -m benchmarks.bench_dtensor_overhead [OUT.json]          # one process, one rank
    torchrun --standalone --nproc_per_node 2 -m benchmarks.bench_dtensor_overhead [OUT.json]

Per case (decode-sized inputs, heads sharded over the ranks): ``local_us`` the op
on this rank's local tensors, ``dtensor_us`` the same call on the DTensors (the
eager fast path, adapters/torch/_dtensor.local_call), ``dispatch_us`` the
DTensors through DTensor's dispatch (the fast path off, as before it existed),
``add_local_us`` / ``add_dtensor_us`` torch.add of two of the case's tensors,
local and as DTensors; ``*_overhead_us`` the differences to the local calls.
Times are per call over back-to-back calls with one sync at the end (on a GPU,
max(host, GPU) time; these cases are host-bound). Without a GPU the ranks talk
gloo and the kernels are stubbed out (the interpreter would take milliseconds):
host time of everything but the kernel. Rank 0 writes the rows.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

COLUMNS = ["case", "world", "local_us", "dtensor_us", "dispatch_us", "add_local_us", "add_dtensor_us",
           "overhead_us", "dispatch_overhead_us", "add_overhead_us"]


def _group():
    """(rank, world, device): the torchrun group, or a one-rank group of this process."""
    import torch
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if "RANK" in os.environ:
            rank = int(os.environ["RANK"])
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
            dist.init_process_group("nccl" if cuda else "gloo",
                                    **({"device_id": torch.device("cuda", torch.cuda.current_device())}
                                       if cuda else {}))
        else:
            dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                                    init_method="file://" + tempfile.mktemp(prefix="dtensor_overhead_"))
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    return dist.get_rank(), dist.get_world_size(), device


def _stub_kernels():
    """Without a GPU: runs of a plan allocate its buffers and launch nothing."""
    import torch
    from adapters.torch import _call_memo, _executor, _launcher

    def run(plan, tensors, runtime, device):
        env = dict(tensors)
        for name, buf in plan.buffers.items():
            if env.get(name) is None:
                env[name] = torch.empty(buf.shape, dtype=getattr(torch, buf.dtype), device=device)
        return env
    for module in (_executor, _launcher, _call_memo):
        module._run_interpreted = run


def _per_call(fn, reps, sync):
    for _ in range(10):
        fn()
    sync()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def _cases(world, device):
    """(name, op call, its full arguments, their placements: a Shard dim or None = replicated,
    two argument indices for torch.add)."""
    import torch
    import adapters.torch as at
    g = torch.Generator().manual_seed(0)
    h = 32 * world
    # (bf16 arithmetic on the CPU is slow enough to hide the host time torch.add measures)
    half = torch.bfloat16 if device.startswith("cuda") else torch.float32

    def randn(*shape, dtype=half):
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    n, d = 64, 128
    merge = ([randn(n, h, d), randn(n, h, d), randn(h, n, dtype=torch.float32), randn(n, h, d),
              randn(h, n, dtype=torch.float32)], [1, 1, 0, 1, 0])
    b = 64
    slots = torch.arange(b, device=device)
    decode = ([randn(b, h, 1, d), randn(b, h, 1, d), randn(b, h, 1, d), randn(b, h, d, d, dtype=torch.float32),
               randn(h, dtype=torch.float32).abs(), slots], [1, 1, 1, 1, 0, None])
    return [
        ("merge_attn_states N64 H32/rank D128",
         lambda o, po, pl, so, sl: at.merge_attn_states(o, po, pl, so, sl), *merge, (1, 3)),
        ("linear_decode B64 H32/rank D128", at.linear_decode_forward_triton, *decode, (0, 1)),
    ]


def run(reps=200):
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from adapters.torch import _register
    rank, world, device = _group()
    if not device.startswith("cuda"):
        _stub_kernels()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    mesh = DeviceMesh(device.split(":")[0], list(range(world)))
    fast = _register.subclass_call
    rows = []
    for name, fn, args, places, (i, j) in _cases(world, device):
        local = [a if p is None else a.chunk(world, p)[rank].contiguous() for a, p in zip(args, places)]
        sharded = [DTensor.from_local(x, mesh, [Replicate() if p is None else Shard(p)], run_check=False)
                   for x, p in zip(local, places)]
        with torch.no_grad():
            t_local = _per_call(lambda: fn(*local), reps, sync)
            t_dt = _per_call(lambda: fn(*sharded), reps, sync)
            _register.subclass_call = None
            try:
                t_dispatch = _per_call(lambda: fn(*sharded), reps, sync)
            finally:
                _register.subclass_call = fast
            t_add = _per_call(lambda: torch.add(local[i], local[j]), reps, sync)
            t_add_dt = _per_call(lambda: torch.add(sharded[i], sharded[j]), reps, sync)
        us = 1e6
        rows.append(dict(case=name, world=world, local_us=t_local * us, dtensor_us=t_dt * us,
                         dispatch_us=t_dispatch * us, add_local_us=t_add * us, add_dtensor_us=t_add_dt * us,
                         overhead_us=(t_dt - t_local) * us, dispatch_overhead_us=(t_dispatch - t_local) * us,
                         add_overhead_us=(t_add_dt - t_add) * us,
                         kernels="stubbed (host time only)" if device == "cpu" else "run"))
    return rows if rank == 0 else []


def main():
    rows = run()
    if rows:
        for r in rows:
            print("  ".join(f"{c}={r[c]:.4g}" if isinstance(r[c], float) else f"{c}={r[c]}" for c in COLUMNS))
        if len(sys.argv) > 1:
            with open(sys.argv[1], "w") as f:
                json.dump(rows, f, indent=1)
    import torch.distributed as dist
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

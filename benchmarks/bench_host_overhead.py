"""Host time per call at tiny shapes, every op (issue 18's host-cost target).

For each op: the torch eager call (``torch_us``: a repeated call, which
adapters.torch._executor.CallMemo replays; ``torch_regular_us`` /
``regular_x_triton``: the same call with the memo off, every call on the op's
regular path), a plain Triton launch of the same
kernel(s) with the same arguments (``triton_us``: ``kernel[grid](*args, **constexprs)``
for every launch the op made, outputs preallocated: what calling the Triton kernel
directly costs), ``x_triton`` = torch_us / triton_us (target <= 0.6; the three measured in turn,
ROUNDS times, medians, the ratios the median of each round's), and a jitted JAX
call of the op (``jax_us``, ``jax_x_triton``). Host time: enqueue time per call,
``timing.host_overhead`` (fewer calls than the launch queue holds, so the host never
waits). ``gpu_us``: the op's GPU time (CUDA events, L2 flushed), to tell a host-bound
op from a kernel-bound one. ``wall_us``: CUDA-event time of back-to-back eager calls
(host gaps included), for block-sparse decode 1x16384 (target <= 30 us).

The floor of an eager call on this host, measured beside it: ``launcher_us``, the
compiled kernels' own C launchers called with their final arguments (what is left
when every line of Python is gone), ``alloc_us``, the ``torch.empty_strided`` / ``torch.zeros``
calls of the buffers the op returns or allocates per call, ``check_us``, the layout
read that a call which checks its arguments cannot skip (shape, strides, dtype and
device of each argument tensor the launches read or write, hashed into one key and
looked up in a dict: what the plan cache does on a hit), and ``floor_x`` = their sum
/ ``triton_us``: the lowest ratio a Python wrapper that checks its arguments could
reach here; the rest of ``torch_us`` is the op's own Python.
"""
from __future__ import annotations

import gc
import traceback

import numpy as np

from benchmarks import timing

COLUMNS = ["name", "launches", "torch_us", "triton_us", "x_triton", "torch_regular_us", "regular_x_triton",
           "launcher_us", "alloc_us", "check_us", "floor_x",
           "jax_us", "jax_x_triton", "gpu_us", "wall_us", "error"]


def _recorded(call):
    """The (launch, args) of every kernel launch ``call`` makes through the torch
    executor, and ``floor``: (launchers, allocations), zero-argument callables that
    make the same C launches and the same per-call allocations, nothing else."""
    from adapters.torch import _executor as ex, _launcher as la
    rec, launchers, allocs, buffers, inputs = [], [], [], set(), {}
    orig_launch, orig_program = la._launch, ex._program

    def spy(launch, recipe, env, runtime, device_index):
        rec.append((launch, la._tensor_args(launch, env, runtime)))
        orig_launch(launch, recipe, env, runtime, device_index)
        launchers.append(_direct(la, recipe, env, runtime, device_index))
        inputs.update((n, env[n]) for n in recipe.ptr_names if n not in buffers)

    def program(plan):
        prog = orig_program(plan)
        allocs.extend(_alloc(la, a) for a in prog.allocs if a[4] in (la._EMPTY, la._ZEROS))
        buffers.update(plan.buffers)
        return prog
    la._launch, ex._program = spy, program
    ex.set_call_memo(False)  # a replayed call (CallMemo) passes neither
    try:
        call()
    finally:
        la._launch, ex._program = orig_launch, orig_program
        ex.set_call_memo(True)
    return rec, (launchers, allocs, list(inputs.values()))


def _direct(la, recipe, env, runtime, device_index):
    """The cached compiled kernel's C launch of one recorded launch, arguments
    prepared (None when the executor took Triton's regular path)."""
    import torch
    ptrs = [env[n].data_ptr() for n in recipe.ptr_names]
    rts = [runtime[n] for n in recipe.rt_names]
    entry = recipe.compiled.get(la._spec(device_index, ptrs, rts))
    if entry is None:
        return None
    stream, args = torch.cuda.current_stream(device_index).cuda_stream, recipe.getter(ptrs + rts + recipe.consts)
    return lambda: entry(stream, args)


def _alloc(la, a):
    import torch
    name, shape, strides, dtype, mode, _ = a
    if mode == la._ZEROS:
        return lambda: torch.zeros(shape, dtype=dtype, device="cuda")
    return lambda: torch.empty_strided(shape, strides, dtype=dtype, device="cuda")


def _floor_us(floor):
    """Host time of the C launches alone and of the allocations alone (us per call)."""
    from benchmarks import timing
    launchers, allocs, inputs = floor
    if not launchers or any(f is None for f in launchers):
        return None, None, None

    def launch_all():
        for f in launchers:
            f()

    def alloc_all():
        return [f() for f in allocs]

    def key():
        return (_floor_us, *[(t.shape, t.stride(), t.dtype, t.device) for t in inputs])
    cache = {key(): True}
    return (timing.host_overhead(launch_all, "torch") * 1e6,
            timing.host_overhead(alloc_all, "torch") * 1e6 if allocs else 0.0,
            timing.host_overhead(lambda: cache.get(key()), "torch") * 1e6)


def _plain(rec):
    """Those launches as a user calling the Triton kernels would write them."""
    def launch_all():
        for launch, args in rec:
            launch.kernel[launch.grid](*args, **launch.constexprs, num_warps=launch.num_warps,
                                       num_stages=launch.num_stages)
    return launch_all


def _cases():
    """(name, torch call, jax call or None) at decode / tiny-prefill sizes."""
    import jax
    import jax.numpy as jnp
    import torch
    import adapters.jax as aj
    import adapters.torch as at
    from benchmarks.registry import BLOCKSPARSE_MODEL
    from core_kernels.blocksparse_attention import build_sparse_layout

    dev, bf16 = "cuda", torch.bfloat16
    J = jax.dlpack.from_dlpack
    out = []
    # merge: one decode token, 32 heads x 128 (vLLM's decode-time merge of two attention parts)
    po, so = torch.randn(2, 1, 32, 128, device=dev, dtype=bf16)
    pl, sl = torch.randn(2, 32, 1, device=dev)
    o, lse = torch.empty_like(po), torch.empty(32, 1, device=dev)
    jm = jax.jit(lambda *a: aj.merge_attn_states(*a))
    out.append(("merge_attn_states N1 32x128 bf16", lambda: at.merge_attn_states(o, po, pl, so, sl, lse),
                lambda a=[J(x) for x in (po, pl, so, sl)]: jm(*a)))
    # lightning decode: B1, H 64, D 128 (one token per step)
    q, k, v = (torch.randn(1, 64, 1, 128, device=dev, dtype=bf16) for _ in range(3))
    cache = torch.randn(1, 64, 128, 128, device=dev)
    slope = torch.rand(64, device=dev)
    slots = torch.arange(1, device=dev, dtype=torch.int32)
    jd = jax.jit(lambda *a: aj.linear_decode_forward_triton(*a))
    out.append(("linear_decode B1 H64 bf16", lambda: at.linear_decode_forward_triton(q, k, v, cache, slope, slots),
                lambda a=[J(x) for x in (q, k, v, cache, slope, slots)]: jd(*a)))
    # lightning prefill: B1, H 8, N 64, final state only
    qp, kp, vp = (torch.randn(1, 8, 64, 128, device=dev, dtype=bf16) for _ in range(3))
    s8 = slope[:8].contiguous()
    jp = jax.jit(lambda *a: aj.lightning_attention(*a, 256, None, True))
    out.append(("lightning_attention B1 H8 N64 bf16", lambda: at.lightning_attention(qp, kp, vp, s8, 256, None, True),
                lambda a=[J(x) for x in (qp, kp, vp, s8)]: jp(*a)))
    # lightning varlen: two short sequences from a slot cache
    cu = torch.tensor([0, 33, 73], device=dev, dtype=torch.int32)
    qv, kv_, vv = (torch.randn(73, 8, 128, device=dev, dtype=bf16) for _ in range(3))
    vcache = torch.randn(4, 8, 128, 128, device=dev)
    vslots = torch.tensor([2, 0], device=dev, dtype=torch.int32)
    jv = jax.jit(lambda q, k, v, e, c, kc, s: aj.lightning_attention_varlen(q, k, v, e, c, kv_cache=kc, slot_idx=s))
    out.append(("lightning_attention_varlen B2 (33+40) H8 bf16",
                lambda: at.lightning_attention_varlen(qv, kv_, vv, s8, cu, kv_cache=vcache, slot_idx=vslots),
                lambda a=[J(x) for x in (qv, kv_, vv, s8, cu, vcache, vslots)]: jv(*a)))
    # prefix prefill: one request, 16 new tokens on a 48-token cached context (Llama-8B heads)
    from benchmarks.bench_prefix_prefill import make_inputs, torch_call
    inp = make_inputs([(16, 48)], "bfloat16", {})
    po_ = torch.empty_like(inp["q"])
    out.append(("context_attention_fwd B1 q16 ctx48 bf16", torch_call(inp, po_, {}), None))
    # block-sparse (Phi-3-small layout): decode 1 x 16384 and a 64-token prefill
    m = BLOCKSPARSE_MODEL
    hq, hkv, d, bs = m["hq"], m["hkv"], m["d"], m["block_size"]
    for label, n, decode in (("decode 1x16384", 16384, True), ("prefill 1x64", 64, False)):
        (crow, col), _ = build_sparse_layout(hq, n, bs, m["local_blocks"], m["vert_stride"], m["homo_head"])
        crow, col = torch.from_numpy(crow.copy()).to(dev), torch.from_numpy(col.copy()).to(dev)
        cu_k = torch.tensor([0, n], device=dev, dtype=torch.int32)
        cu_q = None if decode else cu_k
        bq = torch.randn(1 if decode else n, hq, d, device=dev, dtype=bf16)
        bk, bv = (torch.randn(n, hkv, d, device=dev, dtype=bf16) for _ in range(2))
        jb = jax.jit(lambda q, k, v, ck, cq, r, c, n=n: aj.blocksparse_flash_attn_varlen_fwd(
            q, k, v, ck, cq, None, (r, c), block_size=bs, max_seqlen=n))
        out.append((f"blocksparse {label} bf16",
                    lambda bq=bq, bk=bk, bv=bv, cu_k=cu_k, cu_q=cu_q, crow=crow, col=col, n=n:
                    at.blocksparse_flash_attn_varlen_fwd(bq, bk, bv, cu_k, cu_q, None, (crow, col),
                                                         block_size=bs, max_seqlen=n),
                    lambda a=[None if x is None else J(x) for x in (bq, bk, bv, cu_k, cu_q, crow, col)]: jb(*a)))
    del jnp
    return out


ROUNDS = 7


def _alternated(call, plain, ex):
    """torch_us, torch_regular_us and triton_us measured in turn, ROUNDS times
    (each a timing.host_overhead of 5 trials), and the ratios as the median of
    each round's ratio: the host's speed drifts between rounds (a plain launch
    took 22 to 37 us in rounds of one call, 2026-11-25), so a ratio is taken
    between neighbouring measurements."""
    times = {"torch": [], "regular": [], "triton": []}
    for _ in range(ROUNDS):
        ex.set_call_memo(False)
        try:
            call()
            times["regular"].append(timing.host_overhead(call, "torch", trials=5))
        finally:
            ex.set_call_memo(True)
        call()
        times["torch"].append(timing.host_overhead(call, "torch", trials=5))
        times["triton"].append(timing.host_overhead(plain, "torch", trials=5))
    med = {k: float(np.median(v)) * 1e6 for k, v in times.items()}
    ratio = {k: float(np.median(np.array(times[k]) / np.array(times["triton"]))) for k in ("torch", "regular")}
    return dict(torch_us=med["torch"], torch_regular_us=med["regular"], triton_us=med["triton"],
                x_triton=ratio["torch"], regular_x_triton=ratio["regular"])


def run():
    import torch
    from adapters.torch import _executor as ex
    rows = []
    with torch.inference_mode():
        for name, call, jcall in _cases():
            row = dict(name=name)
            try:
                call()
                rec, floor = _recorded(call)
                plain = _plain(rec)
                plain()  # compiled by now (the op compiled the same kernels)
                row["launches"] = len(rec)
                row.update(_alternated(call, plain, ex))
                row["launcher_us"], row["alloc_us"], row["check_us"] = _floor_us(floor)
                if row["launcher_us"] is not None:
                    row["floor_x"] = (row["launcher_us"] + row["alloc_us"] + row["check_us"]) / row["triton_us"]
                row["gpu_us"] = timing.kernel_time_torch(call) * 1e6
                if "decode 1x16384" in name:
                    row["wall_us"] = _wall_us(call)
                if jcall is not None:
                    jcall()
                    row["jax_us"] = timing.host_overhead(jcall, "jax") * 1e6
                    row["jax_x_triton"] = row["jax_us"] / row["triton_us"]
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                row["error"] = repr(exc)[:160]
            rows.append(row)
            gc.collect()
    return rows


def _wall_us(call, reps=200):
    """CUDA-event time per call of ``reps`` back-to-back eager calls (host gaps included)."""
    import torch
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            call()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return float(np.median(times))

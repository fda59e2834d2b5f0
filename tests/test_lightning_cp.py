"""Context-parallel lightning attention (core_kernels/lightning_attention/cp_plan.py):
the shard-state and scan kernels against float64 references (both adapters, bit
for bit across them), then the whole scheme on two CPU "devices": JAX (forced host
devices: shard_map, and jax.jit over a NamedSharding of the sequence) and torch
(two gloo ranks: lightning_attention_cp and DTensor Shard(2)), each against the
one-device call (fp32 tolerance), run to run bit for bit, with one all-gather of
shard states as the only collective. Calls the split cannot serve (per-block states,
packed sequences over token shards) are gathered and exact."""
import os
import pathlib
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import core_kernels
from harness import GPU, TOL, rng, to_torch
from test_lightning_attention import check_relative

from core_kernels._plan import ArrayInfo
from core_kernels._target import Target
from core_kernels.lightning_attention.cp_plan import (LightningCPConfig, plan_lightning_cp_compose,
                                                      plan_lightning_cp_state)

REPO = pathlib.Path(core_kernels.__file__).parent.parent


def _state_reference(k, v, ed, reverse):
    """sum_i lambda^(N-1-i) k_i^T v_i, or lambda^(i+1) with ``reverse``, float64."""
    n = k.shape[2]
    lam = np.exp(-np.asarray(ed, np.float64))
    power = np.arange(n) + 1 if reverse else n - 1 - np.arange(n)
    w = lam[None, :, None] ** power[None, None, :]
    return np.einsum("bhn,bhnd,bhne->bhde", w, k.astype(np.float64), v.astype(np.float64))


def _compose_reference(states, ed, rank, init, shard_len, reverse):
    lam = np.exp(-np.asarray(ed, np.float64) * shard_len)[None, :, None, None]
    acc = np.zeros(states.shape[1:]) if init is None else np.asarray(init, np.float64)
    prefix = None
    for j in (range(states.shape[0] - 1, -1, -1) if reverse else range(states.shape[0])):
        if j == rank:
            prefix = acc.copy()
        acc = lam * acc + states[j]
    return prefix, acc


def _run_state(k, v, ed, reverse, config=None):
    """(torch result, JAX result) as numpy."""
    from adapters.jax._ops_lightning_cp import _run
    from adapters.torch._executor import execute
    got_t = execute(plan_lightning_cp_state, dict(k=to_torch(k), v=to_torch(v), ed=to_torch(ed)),
                    reverse=reverse, config=config)["state"].cpu().numpy()
    got_j = np.asarray(_run(plan_lightning_cp_state, dict(k=k, v=v, ed=ed), ("k", "v", "ed"),
                            reverse=reverse, config=config)[0])
    return got_t, got_j


@pytest.mark.parametrize("reverse", [False, True], ids=["end", "start"])
@pytest.mark.parametrize("b,h,n,d,e,splits", [(1, 2, 37, 16, 16, None), (2, 3, 50, 12, 20, 3)],
                         ids=["B1-H2-N37-D16-E16", "B2-H3-N50-D12-E20-splits3"])
def test_shard_state(b, h, n, d, e, splits, reverse):
    g = rng()
    k, v = (g.standard_normal((b, h, n, x)).astype(np.float32) for x in (d, e))
    ed = g.uniform(0.01, 0.5, h).astype(np.float32)
    ed[-1] = np.inf if h > 2 else 0.0   # lambda = 0 (only the last token), or no decay
    cfg = LightningCPConfig(block_t=16, num_splits=splits) if splits else None
    got_t, got_j = _run_state(k, v, ed, reverse, cfg)
    want = _state_reference(k, v, ed, reverse)
    if GPU:  # the state product from bf16 hi/lo pairs (~16 bits), as the prefill's
        check_relative(got_t, want, "float32", "shard state")
    else:
        atol, rtol = TOL["float32"]
        np.testing.assert_allclose(got_t, want, atol=atol * np.abs(want).max(), rtol=rtol)
    assert np.array_equal(got_t, got_j), "torch and JAX differ"


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("init_dtype", [None, "float32", "bfloat16"])
def test_compose(reverse, init_dtype):
    from adapters.torch._executor import execute
    g = rng()
    r, b, h, d, e, shard_len = 3, 2, 2, 8, 12, 5
    states = g.standard_normal((r, b, h, d, e)).astype(np.float32)
    ed = g.uniform(0.01, 0.5, h).astype(np.float32)
    init = None if init_dtype is None else to_torch(g.standard_normal((b, h, d, e)).astype(np.float32))
    if init is not None:
        init = init.to(getattr(torch, init_dtype))
    for rank in range(r):
        env = execute(plan_lightning_cp_compose,
                      dict(states=to_torch(states), ed=to_torch(ed),
                           rank=torch.tensor([rank], dtype=torch.int32), init=init),
                      shard_len=shard_len, reverse=reverse)
        want_p, want_t = _compose_reference(states, ed, rank, None if init is None else init.float().numpy(),
                                            shard_len, reverse)
        atol, rtol = TOL["float32"]
        np.testing.assert_allclose(env["prefix"].numpy(), want_p, atol=atol, rtol=rtol)
        np.testing.assert_allclose(env["total"].numpy(), want_t, atol=atol, rtol=rtol)


def _info(shape, dtype="float32"):
    return ArrayInfo.contiguous(shape, dtype)


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((_info((1, 2, 8, 4)), _info((1, 2, 9, 4)), _info((2,))), {}, ValueError, "v:"),
    ((_info((1, 2, 8, 4)), _info((1, 2, 8, 4), "float16"), _info((2,))), {}, TypeError, "v: dtype"),
    ((_info((1, 2, 8, 4)), _info((1, 2, 8, 4)), _info((3,))), {}, ValueError, "ed:"),
    ((_info((1, 2, 8, 300)), _info((1, 2, 8, 4)), _info((2,))), {}, ValueError, "k: head size"),
    ((_info((1, 2, 8, 4)), _info((1, 2, 8, 4)), _info((2,))), dict(config="not a config"), TypeError, "config"),
])
def test_state_errors_name_the_argument(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        plan_lightning_cp_state(Target.interpreter(), *args, **kwargs)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="block_t"):
        LightningCPConfig(block_t=24)
    with pytest.raises(ValueError, match="dot_precision"):
        LightningCPConfig(dot_precision="fp64")


@pytest.mark.parametrize("states,rank,init,match", [
    (_info((2, 1, 2, 4, 4), "bfloat16"), _info((1,), "int32"), None, "states: dtype"),
    (_info((1, 2, 4, 4)), _info((1,), "int32"), None, "states:"),
    (_info((2, 1, 2, 4, 4)), _info((1,), "int64"), None, "rank: dtype"),
    (_info((2, 1, 2, 4, 4)), _info((2,), "int32"), None, "rank:"),
    (_info((2, 1, 2, 4, 4)), _info((1,), "int32"), _info((1, 2, 4, 5)), "init:"),
])
def test_compose_errors_name_the_argument(states, rank, init, match):
    with pytest.raises((ValueError, TypeError), match=match):
        plan_lightning_cp_compose(Target.interpreter(), states, _info((2,)), rank, init, shard_len=4)


# ------------------------------------------------------------------ JAX: two host devices
_JAX = r"""
import os, sys, re
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
try:
    from jax import shard_map
except ImportError:
    from jax.experimental.shard_map import shard_map
import adapters.jax as aj
seed, tol = int(sys.argv[1]), float(sys.argv[2])
g = np.random.default_rng(seed)
B, H, N, D, E = 1, 2, 24, 8, 12
q, k, v = (g.standard_normal((B, H, N, x)).astype(np.float32) for x in (D, D, E))
ed = g.uniform(0.05, 0.5, H).astype(np.float32)
hist = g.standard_normal((B, H, D, E)).astype(np.float32)
W = g.standard_normal((B, H, N, E)).astype(np.float32)
Wf = g.standard_normal((B, H, D, E)).astype(np.float32)
mesh = Mesh(np.array(jax.devices()), ("sp",))
seq = P(None, None, "sp")


def close(got, want, what):
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = np.abs(a - b).max() / np.abs(b).max()
        assert err < tol, f"{what}: result {i} relative error {err}"


def same(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def whole(q, k, v, ed, h):
    return aj.lightning_attention(q, k, v, ed, kv_history=h, output_final_state_only=True)


def in_shard_map(q, k, v, ed, h):
    return shard_map(lambda q, k, v, ed, h: aj.lightning_attention_cp(q, k, v, ed, h, axis_name="sp"),
                     mesh=mesh, in_specs=(seq, seq, seq, P(), P()), out_specs=(seq, P()))(q, k, v, ed, h)


def loss(f):
    return lambda *a: jnp.sum(f(*a)[0] * W) + jnp.sum(f(*a)[1] * Wf)


args = (q, k, v, ed, hist)
want = whole(*args)
grads_want = jax.grad(loss(whole), argnums=(0, 1, 2, 3, 4))(*args)
# shard_map
f = jax.jit(in_shard_map)
got = f(*args)
close(got, want, "shard_map forward")
assert same(got, f(*args)), "shard_map forward: not bitwise run to run"
gf = jax.jit(jax.grad(loss(in_shard_map), argnums=(0, 1, 2, 3, 4)))
got = gf(*args)
close(got, grads_want, "shard_map gradients")
assert same(got, gf(*args)), "shard_map gradients: not bitwise run to run"
close(jax.jit(jax.grad(loss(in_shard_map), argnums=(0, 1)))(*args), grads_want[:2], "shard_map, ed constant")
print("ok shard_map", flush=True)

# jit over a NamedSharding of the sequence: no q/k/v gather, outputs stay sharded
sh = [NamedSharding(mesh, s) for s in (seq, seq, seq, P(), P())]
placed = [jax.device_put(x, s) for x, s in zip(args, sh)]
state_gathers = {f"f32[2,{B},{H},{D},{E}]", f"f32[2,2,{B},{H},{D},{E}]"}


def gathers(fn):
    hlo = fn.lower(*placed).compile().as_text()
    found = {s.split("{")[0] for s in re.findall(r"= (\S+) all-gather\(", hlo)}
    assert found and found <= state_gathers, f"all-gathers {found}"
    return hlo


f = jax.jit(whole)
got = f(*placed)
close(got, want, "jit forward")
assert same(got, f(*placed)), "jit forward: not bitwise run to run"
assert got[0].sharding.spec == seq, got[0].sharding
gathers(f)
gf = jax.jit(jax.grad(loss(whole), argnums=(0, 1, 2, 3, 4)))
got = gf(*placed)
close(got, grads_want, "jit gradients")
assert same(got, gf(*placed)), "jit gradients: not bitwise run to run"
assert got[0].sharding.spec == seq, got[0].sharding
gathers(gf)
gf = jax.jit(jax.grad(loss(whole), argnums=(0, 1, 2)))
close(gf(*placed), grads_want[:3], "jit gradients, ed constant")
assert "all-reduce" not in gathers(gf), "an all-reduce without the decay's gradient"
# per-block states: the sequence is gathered (the op reads across it), results exact
per_block = jax.jit(lambda q, k, v, ed: aj.lightning_attention(q, k, v, ed, 8))
got = per_block(*placed[:4])
assert same(got, aj.lightning_attention(q, k, v, ed, 8)), "per-block states with a sharded sequence"
# packed sequences split over the token shards (one spans the boundary): gathered, exact
pq, pk, pv = (g.standard_normal((22, H, x)).astype(np.float32) for x in (D, D, E))
cu = np.array([0, 5, 17, 22], np.int32)
tok = NamedSharding(mesh, P("sp"))
fn = jax.jit(lambda q, k, v, ed, cu: aj.lightning_attention_varlen(q, k, v, ed, cu, block_size=8))
got = fn(*[jax.device_put(x, tok) for x in (pq, pk, pv)], ed, cu)
assert same(got, aj.lightning_attention_varlen(pq, pk, pv, ed, cu, block_size=8)), "varlen over token shards"
print("ok jit", flush=True)
"""


@pytest.mark.skipif(GPU, reason="host devices (the CPU interpreter path)")
def test_jax_two_devices():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    seed = random.randrange(2 ** 31)
    res = subprocess.run([sys.executable, "-c", _JAX, str(seed), str(10 * TOL["float32"][1])], env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok jit"), \
        f"seed {seed}:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"


# ------------------------------------------------------------------ torch: two gloo ranks
_TORCH = r'''
import sys
import torch
import torch.distributed as dist
rank, world, init_file, seed, tol = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
import adapters.torch as at
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.device_mesh import DeviceMesh

dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
mesh = DeviceMesh("cpu", list(range(world)))
g = torch.Generator().manual_seed(seed)   # the same full inputs on every rank
B, H, N, D, E = 1, 2, 24, 8, 12
q, k, v = (torch.randn(B, H, N, x, generator=g) for x in (D, D, E))
ed = torch.rand(H, generator=g) * 0.45 + 0.05
hist = torch.randn(B, H, D, E, generator=g)
W, Wf = torch.randn(B, H, N, E, generator=g), torch.randn(B, H, D, E, generator=g)


def shard(t):
    return t.chunk(world, 2)[rank]


def close(got, want, what):
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < tol, (what, err)


leaves = [t.clone().requires_grad_(True) for t in (q, k, v, ed, hist)]
o, f = at.lightning_attention(*leaves[:4], kv_history=leaves[4], output_final_state_only=True)
((o * W).sum() + (f * Wf).sum()).backward()
want, want_grads = (o.detach(), f.detach()), [t.grad for t in leaves]

# local shards and a process group
for run in range(2):
    xs = [shard(t).contiguous().requires_grad_(True) for t in (q, k, v)] + \
         [t.clone().requires_grad_(True) for t in (ed, hist)]
    with CommDebugMode() as comm:
        o, f = at.lightning_attention_cp(*xs[:4], xs[4])
    assert comm.get_total_counts() == 1, comm.get_comm_counts()
    close(o, shard(want[0]), "cp output")
    close(f, want[1], "cp final state")
    ((o * shard(W)).sum() + (f * Wf).sum()).backward()
    for i, (x, w) in enumerate(zip(xs, want_grads)):
        close(x.grad, shard(w) if i < 3 else w, f"cp gradient {i}")
    results = [o, f] + [x.grad for x in xs]
    if run:
        assert all(torch.equal(a, b) for a, b in zip(results, first)), "not bitwise run to run"
    first = results
print("ok cp", flush=True)

# DTensor: Shard(2) dispatches to the context-parallel path
S2, R = Shard(2), Replicate()
dts = [DTensor.from_local(shard(t).contiguous(), mesh, [S2], run_check=False).requires_grad_(True)
       for t in (q, k, v)] + [DTensor.from_local(t.clone(), mesh, [R], run_check=False).requires_grad_(True)
                              for t in (ed, hist)]
with CommDebugMode() as comm:
    o, f = at.lightning_attention(*dts[:4], kv_history=dts[4], output_final_state_only=True)
assert comm.get_total_counts() == 1, comm.get_comm_counts()
assert o.placements == (S2,) and f.placements == (R,), (o.placements, f.placements)
assert torch.equal(o.to_local(), first[0].detach()) and torch.equal(f.to_local(), first[1].detach())
Wd = DTensor.from_local(shard(W).contiguous(), mesh, [S2], run_check=False)
((o * Wd).sum() + (f * DTensor.from_local(Wf, mesh, [R], run_check=False)).sum()).backward()
for i, (x, w) in enumerate(zip(dts, want_grads)):
    assert x.grad.placements == x.placements, (i, x.grad.placements)
    assert torch.equal(x.grad.to_local(), first[2 + i]), f"DTensor gradient {i} differs from the local call"
# per-block states: DTensor's own rule gathers the sequence (same as the whole call)
o, kv = at.lightning_attention(*[d.detach() for d in dts[:4]], 8)
ref_o, ref_kv = at.lightning_attention(q, k, v, ed, 8)
assert torch.equal(o.full_tensor(), ref_o) and torch.equal(kv.full_tensor(), ref_kv)
# packed sequences split over the token shards (one spans the boundary): gathered, exact
pq, pk, pv = (torch.randn(22, H, x, generator=g) for x in (D, D, E))
cu = torch.tensor([0, 5, 17, 22], dtype=torch.int32)
S0 = Shard(0)
o, kv = at.lightning_attention_varlen(*[DTensor.from_local(t.chunk(world)[rank].contiguous(), mesh, [S0],
                                                           run_check=False) for t in (pq, pk, pv)],
                                      DTensor.from_local(ed, mesh, [R], run_check=False),
                                      DTensor.from_local(cu, mesh, [R], run_check=False), block_size=8)
ref_o, ref_kv = at.lightning_attention_varlen(pq, pk, pv, ed, cu, block_size=8)
assert torch.equal(o.full_tensor(), ref_o) and torch.equal(kv.full_tensor(), ref_kv), "varlen over token shards"
dist.destroy_process_group()
print("done", flush=True)
'''


@pytest.mark.skipif(
    torch.cuda.is_available() and tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4),
    reason="CPU tensors over gloo run under Triton's interpreter, which numpy >= 2.4 breaks")
def test_torch_two_ranks(tmp_path):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is unavailable")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    seed = random.randrange(2 ** 31)
    init = tmp_path / "pg_init"
    procs = [subprocess.Popen([sys.executable, "-c", _TORCH, str(r), "2", str(init), str(seed),
                               str(10 * TOL["float32"][1])],
                              env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and out.strip().endswith("done"), \
            f"rank {r} (seed {seed}):\n{out[-2000:]}\n{err[-4000:]}"

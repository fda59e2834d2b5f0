"""torch DTensor: every op runs on head- (and batch-) sharded DTensors locally, with
no collective inside the call, and equals the unsharded call bit for bit; shardings
the op cannot compute locally are redistributed (same result) or refused by name.
Eager calls that need no redistribution take the local fast path (_dtensor.local_call),
the others DTensor's dispatch; under torch.compile(fullgraph=True) the dispatch is
traced away (a second compiled call runs no sharding rule and no fast path).

Two gloo ranks on the CPU (Triton's interpreter), one process group for every op:
starting the processes is most of the cost."""
import os
import pathlib
import random
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import core_kernels

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is unavailable", allow_module_level=True)

_WORKER = r'''
import sys
import torch
import torch.distributed as dist

rank, world, init_file, seed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
import adapters.torch as at   # before torch.distributed.tensor: the rules register on its import
from adapters.torch import _dtensor, _register
assert not _dtensor._registered
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.device_mesh import DeviceMesh
from core_kernels.blocksparse_attention import build_sparse_layout
assert _dtensor._registered

dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
calls = {"fast": 0, "dispatch": 0, "rules": 0}
_local_call, _strategies = _register.subclass_call, _dtensor.op_strategies


def _counted_local(name, impl, args):
    r = _local_call(name, impl, args)
    calls["fast" if r is not NotImplemented else "dispatch"] += 1
    return r


def _counted_rule(*args, **kwargs):
    calls["rules"] += 1
    return _strategies(*args, **kwargs)


_register.subclass_call, _dtensor.op_strategies = _counted_local, _counted_rule
mesh = DeviceMesh("cpu", list(range(world)))
g = torch.Generator().manual_seed(seed)  # the same full inputs on every rank
R = Replicate()


def randn(*shape):
    return torch.randn(shape, generator=g, dtype=torch.float32)


def local(t, p):
    """This rank's block of ``t`` (no communication)."""
    return t if p == R else t.chunk(world, p.dim)[rank].contiguous()


def dt(t, p, m=mesh):
    """t's DTensor placed p on m's first dimension (replicated on the others)."""
    return DTensor.from_local(local(t, p), m, [p] + [R] * (m.ndim - 1), run_check=False)


def check(what, fn, args, places, results, expect_comm=False, m=mesh):
    """fn(*full args) vs fn(*DTensors): results (indices into args of tensors written
    in place, or "r<i>" for the i-th returned tensor) equal bit for bit, each rank
    holding its block; no collective inside the call unless expected."""
    full = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    ref = fn(*full)
    sharded = [dt(a, p, m) if p is not None else a for a, p in zip(args, places)]
    fast = calls["fast"]
    with CommDebugMode() as comm:
        out = fn(*sharded)
    counts = comm.get_total_counts()
    assert (counts > 0) if expect_comm else counts == 0, (what, comm.get_comm_counts())
    assert (calls["fast"] == fast) if expect_comm else (calls["fast"] == fast + 1), (what, "fast path")
    ref = ref if isinstance(ref, tuple) else (ref,)
    out = out if isinstance(out, tuple) else (out,)
    for r in results:
        if isinstance(r, str):
            want, got = ref[int(r[1:])], out[int(r[1:])]
            assert isinstance(got, DTensor), (what, r)
            got_local = got.to_local()
            p = got.placements[0]
        else:
            want, got_local, p = full[r], sharded[r].to_local(), places[r]
        assert torch.equal(local(want, p), got_local), (what, r, (local(want, p) - got_local).abs().max())
        if not expect_comm and p != R:
            assert got_local.shape != want.shape, (what, r, "not sharded")
    print("ok", what, flush=True)


S0, S1, S2 = Shard(0), Shard(1), Shard(2)
N, H, D = 6, 4, 16

# merge_attn_states: [N, H, D] states, [H, N] LSEs, written in place
po, so = randn(N, H, D), randn(N, H, D)
pl, sl = randn(H, N), randn(H, N)
out, out_lse = torch.full((N, H, D), float("nan")), torch.full((H, N), float("nan"))
merge = lambda o, a, b, c, d, e, n=None: at.merge_attn_states(o, a, b, c, d, e, n)
check("merge heads", merge, [out, po, pl, so, sl, out_lse], [S1, S1, S0, S1, S0, S0], [0, 5])
check("merge tokens", merge, [out, po, pl, so, sl, out_lse], [S0, S0, S1, S0, S1, S1], [0, 5])
# head size split: the inputs are gathered, the output (written in place) stays sharded on heads
check("merge head_dim inputs", merge, [out, po, pl, so, sl, out_lse], [S1, S2, S0, S2, S0, S0],
      [0, 5], expect_comm=True)
try:  # a token count reads global token ids: tokens are not independent, and out stays put
    merge(dt(out, S0), dt(po, S0), dt(pl, S1), dt(so, S0), dt(sl, S1), dt(out_lse, S1), 3)
    raise AssertionError("merge with a token count on token shards ran")
except RuntimeError as e:  # DTensor wraps the rule's ValueError
    assert isinstance(e.__cause__, ValueError), e
    assert "output is written in place" in str(e) and "prefill_tokens_with_context" in str(e), e
try:
    merge(dt(out, S2), dt(po, S1), dt(pl, S0), dt(so, S1), dt(sl, S0), dt(out_lse, S0))
    raise AssertionError("merge into a head_dim-sharded output ran")
except RuntimeError as e:
    assert "output is written in place" in str(e) and "S(2)" in str(e), e
print("ok merge refusals", flush=True)
# a 2-D mesh (2 x 1): heads on one mesh dimension, replicated on the other
mesh2 = DeviceMesh("cpu", [[r] for r in range(world)])
check("merge heads 2-D mesh", merge, [out, po, pl, so, sl, out_lse], [S1, S1, S0, S1, S0, S0], [0, 5],
      m=mesh2)
try:  # DTensor would pick among strategy combinations; the in-place output must not move
    merge(dt(out, S1, mesh2), dt(po, R, mesh2), dt(pl, S0, mesh2), dt(so, S1, mesh2),
          dt(sl, S0, mesh2), dt(out_lse, S0, mesh2))
    raise AssertionError("merge on a 2-D mesh with a replicated input ran")
except RuntimeError as e:
    assert "prefix_output has placements" in str(e), e

# mask_empty_context_lse: lse [H, T] in place
lse = randn(H, N)
qsl, csl = torch.tensor([0, 2, 5, 6], dtype=torch.int32), torch.tensor([0, 0, 3, 3], dtype=torch.int32)
check("mask_empty_context_lse heads", at.mask_empty_context_lse, [lse, qsl, csl], [S0, R, R], [0])

# context_attention_fwd: GQA (4 query heads on 2 kv heads), paged cache
HKV, BS, X = 2, 16, 8
qlens, ctxs = [3, 2], [5, 17]
T = sum(qlens)
q, k, v = randn(T, H, D), randn(T, HKV, D), randn(T, HKV, D)
o = torch.full((T, H, D), float("nan"))
kc, vc = randn(4, HKV, D // X, BS, X), randn(4, HKV, D, BS)
b_loc = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
b_start = torch.tensor([0, 3, 5], dtype=torch.int32)
b_seq = torch.tensor([c + l for c, l in zip(ctxs, qlens)], dtype=torch.int32)
sinks = randn(H)
ctx = lambda q, k, v, o, kc, vc, bl, bst, bsq, sinks: at.context_attention_fwd(
    q, k, v, o, "auto", kc, vc, bl, bst, bsq, 0, max(qlens), sinks=sinks)
check("context_attention_fwd heads", ctx, [q, k, v, o, kc, vc, b_loc, b_start, b_seq, sinks],
      [S1, S1, S1, S1, S1, S1, R, R, R, S0], [3])

# unified_attention: GQA, vLLM's flash cache [num_blocks, block_size, Hkv, D] sharded on its kv heads
ukc, ukv = randn(5, BS, HKV, D), randn(5, BS, HKV, D)
uo = torch.full((T, H, D), float("nan"))
table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
cuq = torch.tensor([0, 3, 5], dtype=torch.int32)
used = torch.tensor([c + l for c, l in zip(ctxs, qlens)], dtype=torch.int32)
slopes = randn(H).abs()
max_k = max(c + l for c, l in zip(ctxs, qlens))
uni = lambda q, k, v, o, cu, used, table, sinks, slopes: at.unified_attention(
    q, k, v, o, cu, max(qlens), used, max_k, 0.25, True, (7, 0), table, 0.0, None, None, None,
    sinks=sinks, alibi_slopes=slopes)
check("unified_attention heads", uni, [q, ukc, ukv, uo, cuq, used, table, sinks, slopes],
      [S1, S2, S2, S1, R, R, R, S0, S0], [3])

# blocksparse_flash_attn_varlen_fwd: GQA, one layout per query head
(crow, col), _ = build_sparse_layout(H, 64, 16, 2, 2, False)
crow, col = torch.from_numpy(crow.copy()), torch.from_numpy(col.copy())
cu = torch.tensor([0, 20, 37], dtype=torch.int32)
bq, bk, bv = randn(37, H, D), randn(37, HKV, D), randn(37, HKV, D)
bsp = lambda q, k, v, cu, crow, col: at.blocksparse_flash_attn_varlen_fwd(
    q, k, v, cu, None, None, (crow, col), block_size=16, max_seqlen=64)
check("blocksparse heads", bsp, [bq, bk, bv, cu, crow, col], [S1, S1, S1, R, S0, S0], ["r0"])

# lightning_attention: [B, H, N, D], ed [H]; batch and heads
B, E = 2, 16
lq, lk, lv, ed = randn(B, H, N, D), randn(B, H, N, D), randn(B, H, N, E), randn(H).abs()
hist = randn(B, H, D, E)
light = lambda q, k, v, ed, hist: at.lightning_attention(q, k, v, ed, 4, hist)
check("lightning heads", light, [lq, lk, lv, ed, hist], [S1, S1, S1, S0, S1], ["r0", "r1"])
check("lightning batch", light, [lq, lk, lv, ed, hist], [S0, S0, S0, R, S0], ["r0", "r1"])

# linear_decode_forward_triton: [B, H, 1, D], kv_caches [slots, H, D, E] in place, output [B, H * E]
dq, dk, dv = randn(B, H, 1, D), randn(B, H, 1, D), randn(B, H, 1, E)
caches, slope = randn(3, H, D, E), randn(H).abs()
slots = torch.tensor([2, 0], dtype=torch.int64)
check("linear_decode heads", at.linear_decode_forward_triton, [dq, dk, dv, caches, slope, slots],
      [S1, S1, S1, S1, S0, R], [3, "r0"])

# lightning_attention_varlen: packed [T, H, D]; with and without a slot cache (in place)
vq, vk, vv = randn(7, H, D), randn(7, H, D), randn(7, H, E)
vcu = torch.tensor([0, 4, 7], dtype=torch.int32)
varlen = lambda q, k, v, ed, cu: at.lightning_attention_varlen(q, k, v, ed, cu, block_size=4)
check("lightning_varlen heads", varlen, [vq, vk, vv, ed, vcu], [S1, S1, S1, S0, R], ["r0", "r1"])
vcache = randn(3, H, D, E)
varlen_c = lambda q, k, v, ed, cu, kv, s: at.lightning_attention_varlen(
    q, k, v, ed, cu, kv_cache=kv, slot_idx=s, block_size=4)
check("lightning_varlen_cache heads", varlen_c, [vq, vk, vv, ed, vcu, vcache, slots],
      [S1, S1, S1, S0, R, S1, R], [5, "r0"])

# GQA with fewer kv heads than shards: the heads cannot split, the inputs are gathered
bk1, bv1 = randn(37, 1, D), randn(37, 1, D)
check("blocksparse 1 kv head", bsp, [bq, bk1, bv1, cu, crow, col], [S1, R, R, R, S0, S0], ["r0"],
      expect_comm=True)

# torch.compile(fullgraph=True) over DTensors: the sharding is decided while tracing;
# a second call with new values runs neither a sharding rule nor the eager fast path
args = [dt(x, p) for x, p in zip((lq, lk, lv, ed, hist), (S1, S1, S1, S0, S1))]
with torch.no_grad():
    want = light(*args)
    compiled = torch.compile(light, fullgraph=True, backend="aot_eager")
    compiled(*args)
    args[0] = dt(randn(B, H, N, D), S1)
    want = light(*args)
    calls.update(fast=0, dispatch=0, rules=0)
    got = compiled(*args)
assert calls == {"fast": 0, "dispatch": 0, "rules": 0}, calls
for a, b in zip(got, want):
    assert isinstance(a, DTensor) and a.placements == b.placements and torch.equal(a.to_local(), b.to_local())
print("ok compile", flush=True)
dist.destroy_process_group()
print("done", flush=True)
'''


@pytest.mark.skipif(
    torch.cuda.is_available() and tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4),
    reason="CPU tensors over gloo run under Triton's interpreter, which numpy >= 2.4 breaks "
           "(loops with runtime bounds); the GPU environment has such a numpy, the CPU one pins < 2.4")
def test_dtensor_ops_on_two_ranks(tmp_path):
    repo = pathlib.Path(core_kernels.__file__).parent.parent
    # CPU tensors over gloo: the kernels run under Triton's interpreter, on a GPU machine too
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    seed = random.randrange(2**31)
    init = tmp_path / "pg_init"
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(r), "2", str(init), str(seed)],
                              env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and out.strip().endswith("done"), \
            f"rank {r} (seed {seed}):\n{out[-2000:]}\n{err[-4000:]}"


def test_every_op_is_described():
    """Each custom op's tensor arguments are covered by its OpAxes (else it replicates)."""
    import adapters.torch  # noqa: F401
    from adapters.torch import _dtensor
    from adapters.torch._register import OPS
    assert {n: _dtensor.unsupported_arguments(n) for n in OPS} == {n: [] for n in OPS}

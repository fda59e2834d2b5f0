"""SPMD partitioning under jax.jit (adapters/jax/_spmd.py) and AOT / export.

The sharded checks run in ONE subprocess (JAX must see 4 host devices before it
initialises): for every op at tiny shapes, jit over NamedSharding inputs split
along the op's independent axes gives (a) results bitwise equal to the unsharded
call, (b) results sharded as the inputs, (c) no collective in the compiled HLO;
(d) a sharding the op cannot split (head size, merge's tokens with a count, a
GQA split no kv block matches) is gathered and still exact.
"""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import core_kernels
from harness import GPU

_SCRIPT = r"""
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, "tests")
import numpy as np, jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import adapters.jax as aj
from core_kernels.blocksparse_attention import build_sparse_layout
from test_blocksparse_attention import make_batch
from test_lightning_attention import make_decode, make_prefill
from test_lightning_varlen import make_varlen
from test_merge_attn_states import make_inputs
from test_prefix_prefill import ARRAYS, make_case

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
devs = np.array(jax.devices())
m4 = Mesh(devs, ("x",))
m2 = Mesh(devs[:2], ("x",))
m22 = Mesh(devs.reshape(2, 2), ("a", "b"))
R = None  # replicated


def check(name, fn, mesh, arrays, specs, gathered=False):
    want = fn(*arrays)
    want = want if isinstance(want, tuple) else (want,)
    args = [jax.device_put(a, NamedSharding(mesh, P() if s is R else s)) for a, s in zip(arrays, specs)]
    f = jax.jit(fn)
    got = f(*args)
    got = got if isinstance(got, tuple) else (got,)
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(np.asarray(g), np.asarray(w), equal_nan=True), f"{name}: result {i} differs"
    hlo = f.lower(*args).compile().as_text()
    found = [c for c in COLLECTIVES if c in hlo]
    if gathered:
        assert "all-gather" in found or "all-to-all" in found, f"{name}: expected a gather, HLO has {found}"
    else:
        assert not found, f"{name}: collectives {found} in the compiled HLO"
    return got


g = np.random.default_rng(0)
t0 = time.time()
# merge: heads, tokens; head size (read across) and tokens with a count: gathered
po, pl, so, sl = make_inputs(8, 4, 16, "float32", 1)
heads3, heads_lse = P(None, "x"), P("x")
out = check("merge/heads", aj.merge_attn_states, m4, (po, pl, so, sl), (heads3, heads_lse) * 2)
assert out[0].sharding.spec == heads3 and out[1].sharding.spec == heads_lse, "merge: output sharding"
out = check("merge/tokens", aj.merge_attn_states, m4, (po, pl, so, sl), (P("x"), P(None, "x")) * 2)
assert out[0].sharding.spec == P("x") and out[1].sharding.spec == P(None, "x"), "merge tokens sharding"
check("merge/head_dim", aj.merge_attn_states, m4, (po, pl, so, sl), (P(None, None, "x"), R) * 2,
      gathered=True)
count = np.int32(5)
check("merge/count tokens", lambda a, b, c, d, n: aj.merge_attn_states(a, b, c, d, prefill_tokens_with_context=n),
      m4, (po, pl, so, sl, count), (P("x"), P(None, "x")) * 2 + (R,), gathered=True)
check("merge/count heads", lambda a, b, c, d, n: aj.merge_attn_states(a, b, c, d, prefill_tokens_with_context=n),
      m4, (po, pl, so, sl, count), (heads3, heads_lse) * 2 + (R,))

# mask_empty_context_lse: heads
lse = g.standard_normal((4, 7)).astype(np.float32)
qsl, csl = np.array([0, 2, 2, 6], np.int32), np.array([0, 1, 1, 3], np.int32)
out = check("mask", aj.mask_empty_context_lse, m4, (lse, qsl, csl), (P("x"), R, R))
assert out[0].sharding.spec == P("x"), "mask: output sharding"

# lightning prefill: batch x heads on a 2 x 2 mesh; decay [1, H, 1, 1]
q, k, v, ed, kvh = make_prefill(2, 2, 20, 16, 16, "float32", seed=2)
bh = P("a", "b")
fn = lambda q, k, v, ed, kvh: aj.lightning_attention(q, k, v, ed, 8, kv_history=kvh)
out = check("lightning", fn, m22, (q, k, v, ed, kvh), (bh, bh, bh, P("b"), bh))
assert out[0].sharding.spec == bh and out[1].sharding.spec == bh, "lightning: output sharding"
fn = lambda q, k, v, ed: aj.lightning_attention(q, k, v, ed.reshape(1, -1, 1, 1), 8, output_final_state_only=True)
out = check("lightning/final", fn, m22, (q, k, v, ed), (bh, bh, bh, P("b")))
assert out[1].sharding.spec == bh, "lightning final state: output sharding"
check("lightning/head_dim", fn, m22, (q, k, v, ed), (P(None, None, None, "b"),) * 3 + (R,), gathered=True)

# decode: heads (output [B, H * E] split in head blocks)
q, k, v, cache, slope = make_decode(3, 4, 16, 5, "float32", 3)
ids = np.array([4, -1, 1], np.int32)
h4 = P(None, "x")
out = check("decode", aj.linear_decode_forward_triton, m4, (q, k, v, cache, slope, ids),
            (h4, h4, h4, h4, P("x"), R))
assert out[0].sharding.spec == h4 and out[1].sharding.spec == h4, "decode: output sharding"

# varlen: heads, with a slot cache
q, k, v, ed, cu, cache = make_varlen([5, 3], 4, 16, 16, "float32", num_slots=3, seed=4)
slots = np.array([2, -1], np.int32)
fn = lambda q, k, v, ed, cu, cache, slots: aj.lightning_attention_varlen(q, k, v, ed, cu, kv_cache=cache,
                                                                          slot_idx=slots)
out = check("varlen", fn, m4, (q, k, v, ed, cu, cache, slots), (h4, h4, h4, P("x"), R, h4, R))
assert out[0].sharding.spec == h4 and out[1].sharding.spec == h4, "varlen: output sharding"

# block-sparse: GQA (4 query heads, 2 kv heads), per-head layout, 2 devices
crow, col = (np.asarray(x) for x in build_sparse_layout(4, 32, 16, 1, 2, False)[0])
q, k, v, cu, _ = make_batch([12, 9], [12, 9], 4, 2, 16, "float32", 5)
fn = lambda q, k, v, cu, crow, col: aj.blocksparse_flash_attn_varlen_fwd(
    q, k, v, cu, cu, 0.25, (crow, col), block_size=16, max_seqlen=32)
out = check("blocksparse", fn, m2, (q, k, v, cu, crow, col), (h4, h4, h4, R, P("x"), P("x")))
assert out[0].sharding.spec == h4, "blocksparse: output sharding"
# only the query heads sharded by the user: the kv heads follow (a local slice, no collective)
check("blocksparse/q only", fn, m2, (q, k, v, cu, crow, col), (h4, R, R, R, R, R))

# context_attention_fwd: GQA, output= aliased; 4 query heads over 2 x 2 axes, 2 kv heads over "a"
case = make_case([(3, 10), (2, 5)], 4, 2, 16, 8, 8, "float32", seed=6)
arrs = tuple(case[n] for n in ARRAYS) + (np.full(case["q"].shape, np.nan, np.float32),)
fn = lambda q, k, v, kc, vc, bl, bs, sl, o: aj.context_attention_fwd(q, k, v, kc, vc, bl, bs, sl,
                                                                     max_input_len=4, output=o)
hab, ha = P(None, ("a", "b")), P(None, "a")
out = check("context/gqa", fn, m22, arrs, (hab, ha, ha, ha, ha, R, R, R, hab))
assert out[0].sharding.spec == hab, "context: output sharding"
h2 = P(None, "x")
check("context", fn, m2, arrs, (h2, h2, h2, h2, h2, R, R, R, h2))
# 4 query heads over 4 devices, kv heads replicated: a valid local GQA split? 2 kv heads cannot
# follow 4 shards on one axis: gathered, still exact
check("context/gqa gathered", fn, m4, arrs, (P(None, "x"), R, R, R, R, R, R, R, P(None, "x")),
      gathered=True)

# unified_attention: GQA over 2 x 2 axes (4 query heads, 2 kv heads on "a"), per-sequence causal
# flags, sinks [Hq], [B, Hkv] fp8 descales sharded with the kv heads, out= aliased
import test_unified_attention as tua
uc = tua.make_case([(9, 20), (1, 7), (3, 0)], 4, 2, 16, 8, "float32", kv="fp8", per_seq_descale=True,
                   causal=[True, False, True], seed=7)
sinks = g.standard_normal(4).astype(np.float32)
uarrs = tuple(uc[n] for n in tua.ARRAYS) + (uc["causal"], uc["k_descale"], uc["v_descale"], sinks,
                                            np.full(uc["q"].shape, np.nan, np.float32))
fn = lambda q, k, v, cu, used, table, flags, kd, vd, sinks, o: aj.unified_attention(
    q, k, v, cu, used, table, max_seqlen_q=9, max_seqlen_k=27, softmax_scale=0.3, causal=flags,
    window_size=(11, 0), k_descale=kd, v_descale=vd, sinks=sinks, out=o)
kva = P(None, None, "a")
out = check("unified/gqa", fn, m22, uarrs, (hab, kva, kva, R, R, R, R, ha, ha, P(("a", "b")), hab))
assert out[0].sharding.spec == hab, "unified: output sharding"
check("unified/gqa gathered", fn, m4, uarrs, (P(None, "x"), R, R, R, R, R, R, R, R, P("x"), P(None, "x")),
      gathered=True)
print(f"ok {time.time() - t0:.1f}s")
"""


@pytest.mark.skipif(GPU, reason="host devices (the CPU interpreter path)")
def test_spmd_sharded_jit_on_cpu_devices():
    repo = pathlib.Path(core_kernels.__file__).parent.parent
    env = dict(os.environ, PYTHONPATH=str(repo))
    res = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, cwd=repo,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1].startswith("ok"), \
        res.stdout[-2000:] + res.stderr[-4000:]


# ------------------------------------------------------------------ AOT and jax.export
def _merge_and_lightning(po, pl, so, sl, q, k, v, ed):
    import adapters.jax as aj
    return aj.merge_attn_states(po, pl, so, sl), aj.lightning_attention(q, k, v, ed, 8)


def _export_inputs():
    from test_lightning_attention import make_prefill
    from test_merge_attn_states import make_inputs
    return make_inputs(8, 4, 16, "float32", 1) + make_prefill(1, 2, 20, 16, 16, "float32", seed=2)[:4]


def _bitwise(a, b):
    import jax
    return all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_aot_lower_compile():
    """jax.jit(f).lower(...).compile() of a function using our ops runs and
    gives the direct call's bits."""
    import jax
    args = _export_inputs()
    compiled = jax.jit(_merge_and_lightning).lower(*args).compile()
    assert _bitwise(compiled(*args), _merge_and_lightning(*args))


def test_one_device_mesh_shard_map_and_named_sharding():
    """On this process's first device (the GPU there): shard_map and jit over
    NamedSharding inputs on a 1-device mesh give the unsharded call's bits."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    try:
        from jax import shard_map
    except ImportError:
        from jax.experimental.shard_map import shard_map
    args = _export_inputs()                 # merge [N, H, D] / [H, N], lightning [B, H, N, D]
    mesh = Mesh(np.array(jax.devices()[:1]), ("h",))
    specs = (P(None, "h"), P("h"), P(None, "h"), P("h"), P(None, "h"), P(None, "h"), P(None, "h"), P("h"))
    out_specs = ((P(None, "h"), P("h")), (P(None, "h"), P(None, "h")))
    whole = _merge_and_lightning(*args)
    f = jax.jit(shard_map(_merge_and_lightning, mesh=mesh, in_specs=specs, out_specs=out_specs))
    for _ in range(3):
        assert _bitwise(f(*args), whole), "shard_map on a 1-device mesh"
    placed = [jax.device_put(a, NamedSharding(mesh, sp)) for a, sp in zip(args, specs)]
    assert _bitwise(jax.jit(_merge_and_lightning)(*placed), whole), "NamedSharding on a 1-device mesh"


@pytest.mark.skipif(GPU, reason="the CPU path (host callbacks)")
def test_export_refused_on_cpu():
    """On CPU the kernels run in a host callback, which jax.export cannot
    serialise: JAX raises (docs/jax_export.md says so)."""
    import jax
    with pytest.raises(NotImplementedError, match="host_callbacks"):
        jax.export.export(jax.jit(_merge_and_lightning))(*_export_inputs())


@pytest.mark.skipif(not GPU, reason="needs a GPU (the launches are jax-triton custom calls)")
def test_export_roundtrip_on_gpu():
    """jax.export with jax-triton's custom-call target allowed: serialise,
    deserialise and run; bitwise equal to the direct call."""
    import jax
    args = tuple(jax.device_put(a) for a in _export_inputs())
    want = _merge_and_lightning(*args)
    exported = jax.export.export(
        jax.jit(_merge_and_lightning),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call")])(*args)
    restored = jax.export.deserialize(exported.serialize())
    assert _bitwise(restored.call(*args), want)

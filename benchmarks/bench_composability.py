"""JAX composability on one GPU: ``jax.vmap`` (one folded launch) against a
jitted Python loop of per-example calls, and ``jax.jit`` over inputs placed
with a NamedSharding on a 1-device mesh against the unsharded call (the
partitioning machinery must cost nothing there). Every pair is also checked
bit for bit. JAX only; timed with ``timing.pipelined_time`` (two input sets).
"""
from __future__ import annotations

import numpy as np

from benchmarks import timing

COLUMNS = ["case", "what", "us", "baseline", "baseline_us", "ratio", "bitwise"]


def _merge_inputs(g, v, n, h, d, jnp):
    def t(*shape):
        return jnp.asarray(g.standard_normal(shape).astype(np.float32)).astype(jnp.bfloat16)
    lse = lambda: jnp.asarray(g.standard_normal((v, h, n)).astype(np.float32))  # noqa: E731
    return t(v, n, h, d), lse(), t(v, n, h, d), lse()


def _lightning_inputs(g, v, h, n, d, jnp):
    def t(*shape):
        return jnp.asarray((g.standard_normal(shape) * 0.1).astype(np.float32)).astype(jnp.bfloat16)
    ed = jnp.asarray(np.linspace(0.01, 0.5, h).astype(np.float32))
    return t(v, 1, h, n, d), t(v, 1, h, n, d), t(v, 1, h, n, d), ed


def _row(case, what, t, baseline, tb, same):
    return dict(case=case, what=what, us=t * 1e6, baseline=baseline, baseline_us=tb * 1e6,
                ratio=tb / t, bitwise=bool(same))


def _equal(a, b):
    import jax
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def _time(calls, framework):
    return timing.pipelined_time(calls, framework, reps=_REPS[0], trials=5 if _REPS[0] > 10 else 1)


_REPS = [200]


def run(small=False, reps=200):
    """``small``: tiny shapes and few repetitions (a CPU check of this script)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import adapters.jax as aj
    g = np.random.default_rng(0)
    _REPS[0] = reps
    big = (lambda n: 16 if small else n)  # noqa: E731
    rows = []

    # ---- vmap vs a loop of calls
    merge = lambda po, pl, so, sl: aj.merge_attn_states(po, pl, so, sl)  # noqa: E731
    vm = jax.jit(jax.vmap(merge))
    loop = jax.jit(lambda po, pl, so, sl: tuple(
        jnp.stack(r) for r in zip(*[merge(po[i], pl[i], so[i], sl[i]) for i in range(po.shape[0])])))
    for v, n in ((8, big(512)), (8, big(4096))):
        sets = [_merge_inputs(g, v, n, big(32), big(128), jnp) for _ in range(2)]
        t = _time([lambda s=s: vm(*s) for s in sets], "jax")
        tl = _time([lambda s=s: loop(*s) for s in sets], "jax")
        rows.append(_row(f"merge V{v} x N{n} H32 D128 bf16", "vmap", t, "loop of calls", tl,
                         _equal(vm(*sets[0]), loop(*sets[0]))))

    light = lambda q, k, v_, ed: aj.lightning_attention(q, k, v_, ed, output_final_state_only=True)  # noqa: E731
    vl = jax.jit(jax.vmap(light, in_axes=(0, 0, 0, None)))
    loopl = jax.jit(lambda q, k, v_, ed: tuple(
        jnp.stack(r) for r in zip(*[light(q[i], k[i], v_[i], ed) for i in range(q.shape[0])])))
    for v, n in ((4, big(1024)), (8, big(256))):
        sets = [_lightning_inputs(g, v, big(64), n, big(128), jnp) for _ in range(2)]
        t = _time([lambda s=s: vl(*s) for s in sets], "jax")
        tl = _time([lambda s=s: loopl(*s) for s in sets], "jax")
        rows.append(_row(f"lightning V{v} x B1 H64 N{n} D128 bf16", "vmap", t, "loop of calls", tl,
                         _equal(vl(*sets[0]), loopl(*sets[0]))))

    # ---- NamedSharding on a 1-device mesh vs unsharded
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    heads = NamedSharding(mesh, P(None, "x", None))
    lse_heads = NamedSharding(mesh, P("x", None))
    sets = [tuple(a[0] for a in _merge_inputs(g, 1, big(16384), big(32), big(128), jnp)) for _ in range(2)]
    plain = jax.jit(merge)
    placed = [tuple(jax.device_put(a, s) for a, s in zip(st, (heads, lse_heads, heads, lse_heads)))
              for st in sets]
    sharded = jax.jit(merge, out_shardings=(heads, lse_heads))
    t = _time([lambda s=s: sharded(*s) for s in placed], "jax")
    tb = _time([lambda s=s: plain(*s) for s in sets], "jax")
    rows.append(_row("merge N16384 H32 D128 bf16", "1-device mesh, heads sharded", t, "unsharded", tb,
                     _equal(sharded(*placed[0]), plain(*sets[0]))))

    bh = NamedSharding(mesh, P(None, "x", None, None))
    sets = [tuple(a[0] for a in _lightning_inputs(g, 1, big(64), big(4096), big(128), jnp)[:3])
            + (_lightning_inputs(g, 1, big(64), 8, big(128), jnp)[3],) for _ in range(2)]
    plain = jax.jit(light)
    placed = [tuple(jax.device_put(a, bh) for a in st[:3]) + (jax.device_put(st[3], NamedSharding(mesh, P("x"))),)
              for st in sets]
    sharded = jax.jit(light)
    t = _time([lambda s=s: sharded(*s) for s in placed], "jax")
    tb = _time([lambda s=s: plain(*s) for s in sets], "jax")
    rows.append(_row("lightning B1 H64 N4096 D128 bf16", "1-device mesh, heads sharded", t, "unsharded",
                     tb, _equal(sharded(*placed[0]), plain(*sets[0]))))
    return rows

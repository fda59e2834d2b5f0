"""Lightning attention backward (issue 17, item 1): torch autograd and JAX
custom_vjp over the same kernels, against the float64 token-by-token reference
(itself checked by finite differences)."""
import numpy as np
import pytest
import torch

from core_kernels.lightning_attention import (lightning_attention_backward_reference,
                                              lightning_attention_reference)
from harness import GPU, TOL, assert_bitwise_equal, assert_close, cast, decay_rates, to_torch, torch_to_numpy

import adapters.torch as at

# (B, H, N, D, E, block_size, final_only, with history): several chunks per
# block (N 150, block 128 > the 64-token chunk), blocks shorter than a chunk,
# a short last block, odd D / E
CASES = {
    "hist-blocks16-D20E12": (2, 2, 37, 20, 12, 16, False, True),
    "final-2chunks-per-block": (1, 2, 150, 16, 24, 128, True, False),
    "blocks-hist-2chunks": (1, 1, 150, 8, 8, 128, False, True),
}
if GPU:
    CASES["gpu-B1H8N4096-D128"] = (1, 8, 4096, 128, 128, 256, True, True)
    CASES["gpu-B2H4N1000-D64E96"] = (2, 4, 1000, 64, 96, 256, False, True)
    # one program per (b, h, E-tile), no segments: the Gluon kernels unsegmented
    CASES["gpu-B1H64N256-D128"] = (1, 64, 256, 128, 128, 256, True, True)


def make(case, dtype, seed=0):
    b, h, n, d, e, bs, final, hist = case
    g = np.random.default_rng(seed)
    q, k = (cast(g.standard_normal((b, h, n, d)) * 0.5, dtype) for _ in range(2))
    v = cast(g.standard_normal((b, h, n, e)) * 0.5, dtype)
    ed = decay_rates(g, h, zero_head=False)
    kv_history = g.standard_normal((b, h, d, e)).astype(np.float32) if hist else None
    _, kv = lightning_attention_reference(q, k, v, ed, bs, kv_history, final)
    grad_output = cast(g.standard_normal((b, h, n, e)), dtype)
    grad_kv = g.standard_normal(kv.shape).astype(np.float32)
    return dict(q=q, k=k, v=v, ed=ed, kv_history=kv_history, grad_output=grad_output, grad_kv=grad_kv,
                block_size=bs, final=final)


def reference(c):
    return lightning_attention_backward_reference(
        c["q"], c["k"], c["v"], c["ed"], c["grad_output"].astype(np.float64), c["grad_kv"], c["block_size"],
        c["kv_history"], c["final"])


def tol_dtype(dtype):
    # NOTE: on the GPU fp32 and fp16 products run in tf32 (as the forward)
    return "bfloat16" if GPU and dtype in ("float32", "float16") else dtype


def check(got, ref, dtype, what):
    names = ("dq", "dk", "dv", "d kv_history", "d ed")
    for name, a, r in zip(names, got, ref):
        if a is None:
            continue
        r = np.asarray(r, np.float64)
        scale = max(1.0, float(np.abs(r).max()))  # the decay's gradient sums over every token
        assert_close(np.asarray(a, np.float64) / scale, r / scale, tol_dtype(dtype), f"{what} {name}")


def torch_grads(c, ed_grad=True, with_kv=True):
    """with_kv=False: the loss ignores the returned states (no gradient reaches them)."""
    t = {n: to_torch(c[n]).requires_grad_(True) for n in ("q", "k", "v")}
    ed = to_torch(c["ed"]).requires_grad_(ed_grad)
    hist = None if c["kv_history"] is None else to_torch(c["kv_history"]).requires_grad_(True)
    o, kv = at.lightning_attention(t["q"], t["k"], t["v"], ed, c["block_size"], hist, c["final"])
    loss = (o.float() * to_torch(c["grad_output"]).float()).sum()
    if with_kv:
        loss = loss + (kv * to_torch(c["grad_kv"])).sum()
    loss.backward()
    return [torch_to_numpy(x.grad) if x is not None and x.grad is not None else None
            for x in (t["q"], t["k"], t["v"], hist, ed)]


def jax_grads(c, ed_grad=True):
    import jax
    import jax.numpy as jnp
    import adapters.jax as aj
    args = [jnp.asarray(c[n]) for n in ("q", "k", "v", "ed")]
    hist = None if c["kv_history"] is None else jnp.asarray(c["kv_history"])
    go, gkv = jnp.asarray(c["grad_output"]).astype(jnp.float32), jnp.asarray(c["grad_kv"])

    def loss(q, k, v, ed, hist):
        o, kv = aj.lightning_attention(q, k, v, ed, c["block_size"], hist, c["final"])
        return (o.astype(jnp.float32) * go).sum() + (kv * gkv).sum()
    argnums = (0, 1, 2) + ((3,) if ed_grad else ()) + ((4,) if hist is not None else ())
    grads = dict(zip(argnums, jax.jit(jax.grad(loss, argnums=argnums))(*args, hist)))
    return [np.asarray(grads[i]) if i in grads else None for i in (0, 1, 2, 4, 3)]


@pytest.mark.parametrize("ed_grad", [True, False], ids=["ed-grad", "ed-constant"])
@pytest.mark.parametrize("name", list(CASES))
def test_torch_matches_reference(name, ed_grad):
    """ed differentiated: the dQ programs also carry the decay's tangent."""
    c = make(CASES[name], "float32")
    check(torch_grads(c, ed_grad), reference(c), "float32", f"torch {name}")


@pytest.mark.parametrize("dtype,name", [("bfloat16", "hist-blocks16-D20E12")] + (
    [("float16", "hist-blocks16-D20E12"), ("bfloat16", "gpu-B2H4N1000-D64E96"),
     # bf16 Gluon kernels, reversed and shifted (ed constant): segmented and not
     ("bfloat16", "gpu-B1H8N4096-D128"), ("bfloat16", "gpu-B1H64N256-D128")] if GPU else []))
@pytest.mark.parametrize("ed_grad", [True, False], ids=["ed-grad", "ed-constant"])
def test_low_precision(dtype, name, ed_grad):
    c = make(CASES[name], dtype, seed=3)
    check(torch_grads(c, ed_grad), reference(c), dtype, f"torch {dtype} {name}")


def test_jax_matches_reference_and_torch_bitwise():
    c = make(CASES["blocks-hist-2chunks" if not GPU else "gpu-B2H4N1000-D64E96"], "float32", seed=1)
    j = jax_grads(c)
    check(j, reference(c), "float32", "jax")
    t = torch_grads(c)
    for name, a, b in zip(("dq", "dk", "dv", "d kv_history", "d ed"), t, j):
        assert_bitwise_equal(a, b, f"{name}: torch vs jax")


@pytest.mark.parametrize("name", ["hist-blocks16-D20E12", "final-hist"])
def test_jax_ed_constant_matches_torch_bitwise(name):
    """jax.grad without ed: the custom VJP's symbolic zeros pick the backward
    without the decay's gradient, as torch with ed not requiring grad (per-block
    states: the scan kernels; final state only: the forward's kernels)."""
    case = CASES[name] if name in CASES else (2, 2, 45, 16, 8, 256, True, True)
    c = make(case, "float32", seed=5)
    j = jax_grads(c, ed_grad=False)
    assert j[4] is None
    check(j, reference(c), "float32", "jax, ed constant")
    t = torch_grads(c, ed_grad=False)
    for name, a, b in zip(("dq", "dk", "dv", "d kv_history"), t, j):
        assert_bitwise_equal(a, b, f"{name}: torch vs jax, ed constant")


def test_deterministic_and_ed_constant():
    c = make(CASES["final-2chunks-per-block"], "float32", seed=2)
    first, second = torch_grads(c), torch_grads(c)
    for a, b in zip(first, second):
        if a is not None:
            assert_bitwise_equal(a, b, "run to run")
    without, again = torch_grads(c, ed_grad=False), torch_grads(c, ed_grad=False)
    assert without[4] is None
    for a, b in zip(without, again):  # the forward's kernels (final state only, ed constant)
        if a is not None:
            assert_bitwise_equal(a, b, "run to run, ed constant")
    check(without, reference(c), "float32", "torch, ed constant")


# (B, H, N, D, E, block_size, final_only, with history): the forward-kernel form's
# cases, each with and without a gradient on the returned states
FORWARD_FORM = {
    "final-hist-3chunks-D24E40": (2, 3, 150, 24, 40, 256, True, True),
    "blocks-no-state-grad": (1, 2, 70, 16, 16, 32, False, True),
    "final-1token": (1, 2, 1, 8, 16, 256, True, True),
}


@pytest.mark.parametrize("with_kv", [True, False], ids=["state-grad", "no-state-grad"])
@pytest.mark.parametrize("name,dtype", [(n, "float32") for n in FORWARD_FORM]
                         + [("final-hist-3chunks-D24E40", "bfloat16")])
def test_forward_form_matches_reference(name, dtype, with_kv):
    """ed constant: dq, dk, dv from the forward's kernels, reversed and shifted
    (backward_plan._forward_passes), with a history and the final state's gradient."""
    case = FORWARD_FORM[name]
    if not case[6] and with_kv:
        pytest.skip("gradients on per-block states take the scan kernels")
    c = make(case, dtype, seed=7)
    ref = lightning_attention_backward_reference(
        c["q"], c["k"], c["v"], c["ed"], c["grad_output"].astype(np.float64), c["grad_kv"] if with_kv else None,
        c["block_size"], c["kv_history"], c["final"])
    check(torch_grads(c, ed_grad=False, with_kv=with_kv), ref[:4] + (None,), dtype, f"torch {name}")


@pytest.mark.parametrize("rate", [30.0, float("inf")], ids=["s30", "s-inf"])
def test_forward_form_extreme_decay(rate):
    """lambda ~ 1e-13 and lambda = 0 in one head: the final state's gradient enters
    the last token undecayed (no division by lambda), finite and right."""
    c = make((1, 2, 70, 8, 8, 256, True, True), "float32", seed=8)
    c["ed"] = np.array([rate, 0.1], np.float32)
    ref = reference(c)
    got = torch_grads(c, ed_grad=False)
    assert all(np.isfinite(x).all() for x in got[:4])
    check(got, ref[:4] + (None,), "float32", f"torch, s = {rate}")


def test_backward_form_by_plan():
    """The forward's kernels where ed is constant and no per-block state has a
    gradient; the scan kernels otherwise, or when a LightningBackwardConfig asks."""
    from core_kernels._plan import ArrayInfo
    from core_kernels._target import Target
    from core_kernels.lightning_attention import LightningBackwardConfig, plan_lightning_attention_backward
    from core_kernels.lightning_attention.backward_kernels import _lightning_bwd_dq_kernel
    cpu = Target("interpreter", 0, 4)
    q = ArrayInfo.contiguous((1, 2, 50, 16), "float32")
    ed = ArrayInfo.contiguous((2,), "float32")
    hist = ArrayInfo.contiguous((1, 2, 16, 16), "float32")
    blocks = ArrayInfo.contiguous((1, 2, 3, 16, 16), "float32")

    def kernels(final, grad_kv, need, config=None):
        kv = hist if final else blocks
        plan = plan_lightning_attention_backward(cpu, q, q, q, ed, hist, kv, q, kv if grad_kv else None,
                                                 block_size=32, output_final_state_only=final,
                                                 need_grad_ed=need, config=config)
        return [launch.kernel.fn.__name__ for launch in plan.launches]
    forward = ["_state_map_kernel", "_state_map_kernel"] + ["_lightning_prefill_kernel"] * 3 + ["_state_map_kernel"]
    assert kernels(True, True, False) == forward
    assert kernels(False, False, False) == forward[1:]
    scans = kernels(True, True, True)
    assert scans[0] == _lightning_bwd_dq_kernel.fn.__name__ and "_lightning_prefill_kernel" not in scans
    assert "_lightning_prefill_kernel" not in kernels(False, True, False)
    assert "_lightning_prefill_kernel" not in kernels(True, True, False, LightningBackwardConfig())


def test_opcheck_and_compile():
    c = make((1, 1, 9, 8, 8, 4, False, True), "float32", seed=4)
    args = [to_torch(c[n]).requires_grad_(True) for n in ("q", "k", "v")]
    ed, hist = to_torch(c["ed"]).requires_grad_(True), to_torch(c["kv_history"]).requires_grad_(True)
    torch.library.opcheck(torch.ops.tandem_attn.lightning_attention,
                          (*args, ed, c["block_size"], hist, False, None))

    def loss(q, k, v, ed, hist):
        o, kv = at.lightning_attention(q, k, v, ed, c["block_size"], hist)
        return o.square().sum() + kv.sum()
    eager = torch.autograd.grad(loss(*args, ed, hist), (*args, ed, hist))
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*args, ed, hist), (*args, ed, hist))
    for a, b in zip(eager, compiled):
        assert_bitwise_equal(torch_to_numpy(a), torch_to_numpy(b), "compile vs eager")


def test_reference_matches_finite_differences():
    g = np.random.default_rng(5)
    b, h, n, d, e, bs = 1, 2, 7, 3, 2, 3
    q, k = g.standard_normal((2, b, h, n, d))
    v = g.standard_normal((b, h, n, e))
    ed, hist = g.uniform(0.05, 0.5, h), g.standard_normal((b, h, d, e))
    for final in (False, True):
        o, kv = lightning_attention_reference(q, k, v, ed, bs, hist, final)
        go, gkv = g.standard_normal(o.shape), g.standard_normal(kv.shape)
        grads = lightning_attention_backward_reference(q, k, v, ed, go, gkv, bs, hist, final)
        args = [q, k, v, hist, ed]

        def loss(*a):
            o, kv = lightning_attention_reference(a[0], a[1], a[2], a[4], bs, a[3], final)
            return (o * go).sum() + (kv * gkv).sum()
        for i, grad in enumerate(grads):
            num = np.zeros_like(args[i])
            for idx in np.ndindex(args[i].shape):
                up, down = [x.copy() for x in args], [x.copy() for x in args]
                up[i][idx] += 1e-6
                down[i][idx] -= 1e-6
                num[idx] = (loss(*up) - loss(*down)) / 2e-6
            np.testing.assert_allclose(grad, num, rtol=1e-6, atol=1e-6)


def test_jax_vmap_of_grad_is_one_launch_per_kernel():
    """jax.vmap(jax.grad(f)): the forward and the backward fold the examples into
    their heads (no loop in the lowering), each example equal to its own gradient."""
    import jax
    import jax.numpy as jnp
    import adapters.jax as aj
    g = np.random.default_rng(6)
    size, b, h, n, d, e, bs = 3, 1, 2, 20, 8, 8, 8
    q, k = (g.standard_normal((size, b, h, n, d)).astype(np.float32) * 0.5 for _ in range(2))
    v = g.standard_normal((size, b, h, n, e)).astype(np.float32) * 0.5
    ed = g.uniform(0.05, 0.5, h).astype(np.float32)

    def loss(q, k, v, ed):
        o, kv = aj.lightning_attention(q, k, v, ed, bs, None, False)
        return (o * o).sum() + kv.sum()
    batched = jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3)), in_axes=(0, 0, 0, None))
    assert "while" not in jax.make_jaxpr(batched)(q, k, v, ed).pretty_print()
    grads = jax.jit(batched)(q, k, v, ed)
    for i in range(size):
        o, kv = lightning_attention_reference(q[i], k[i], v[i], ed, bs)
        ref = lightning_attention_backward_reference(q[i], k[i], v[i], ed, 2 * o, np.ones_like(kv), bs)
        check([np.asarray(x[i]) for x in grads[:3]] + [None, np.asarray(grads[3][i])], ref, "float32",
              f"vmap example {i}")


# ------------------------------------------------------------------ packed sequences (no cache)
def _varlen_case(lens, h, d, e, dtype, seed):
    g = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1])
    q, k = (cast(g.standard_normal((t, h, d)) * 0.5, dtype) for _ in range(2))
    v = cast(g.standard_normal((t, h, e)) * 0.5, dtype)
    ed = decay_rates(g, h, zero_head=False)
    return dict(q=q, k=k, v=v, ed=ed, cu=cu, grad_output=cast(g.standard_normal((t, h, e)), dtype),
                grad_states=g.standard_normal((len(lens), h, d, e)).astype(np.float32))


def _varlen_reference(c):
    """Per sequence, the dense reference on [1, H, n, *] (final state only)."""
    dq, dk, dv = (np.zeros(c[n].shape) for n in ("q", "k", "v"))
    ded = np.zeros(c["ed"].shape)
    for b, (s0, s1) in enumerate(zip(c["cu"][:-1], c["cu"][1:])):
        if s1 == s0:
            continue
        seq = [c[n][s0:s1].astype(np.float64).transpose(1, 0, 2)[None] for n in ("q", "k", "v", "grad_output")]
        r = lightning_attention_backward_reference(*seq[:3], c["ed"], seq[3], c["grad_states"][b][None],
                                                   output_final_state_only=True)
        for out, x in zip((dq, dk, dv), r[:3]):
            out[s0:s1] = x[0].transpose(1, 0, 2)
        ded += r[4]
    return dq, dk, dv, None, ded


def _varlen_torch(c):
    t = {n: to_torch(c[n]).requires_grad_(True) for n in ("q", "k", "v", "ed")}
    o, states = at.lightning_attention_varlen(t["q"], t["k"], t["v"], t["ed"], to_torch(c["cu"]))
    ((o.float() * to_torch(c["grad_output"]).float()).sum() + (states * to_torch(c["grad_states"])).sum()).backward()
    return [torch_to_numpy(t["q"].grad), torch_to_numpy(t["k"].grad), torch_to_numpy(t["v"].grad), None,
            torch_to_numpy(t["ed"].grad)]


def test_varlen_matches_reference_and_jax_bitwise():
    """Empty, one-token and multi-chunk sequences (70 > the 64-token chunk)."""
    import jax
    import jax.numpy as jnp
    import adapters.jax as aj
    lens = [37, 0, 1, 70, 5] if not GPU else [1000, 0, 1, 4097, 300, 64]
    c = _varlen_case(lens, 2, 12, 20, "float32", seed=7)
    t = _varlen_torch(c)
    check(t, _varlen_reference(c), "float32", "torch varlen")
    go, gs = jnp.asarray(c["grad_output"]), jnp.asarray(c["grad_states"])

    def loss(q, k, v, ed):
        o, states = aj.lightning_attention_varlen(q, k, v, ed, jnp.asarray(c["cu"]))
        return (o * go).sum() + (states * gs).sum()
    j = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*(jnp.asarray(c[n]) for n in ("q", "k", "v", "ed")))
    for name, a, b in zip(("dq", "dk", "dv", "d ed"), [t[0], t[1], t[2], t[4]], j):
        assert_bitwise_equal(a, np.asarray(b), f"varlen {name}: torch vs jax")


def _cache_case(lens, slots, h, d, e, dtype, seed, num_slots=6):
    c = _varlen_case(lens, h, d, e, dtype, seed)
    g = np.random.default_rng(seed + 100)
    c["slot"] = np.array(slots, np.int32)
    c["cache"] = g.standard_normal((num_slots, h, d, e)).astype(np.float32)
    c["grad_cache"] = g.standard_normal((num_slots, h, d, e)).astype(np.float32)
    return c


def _cache_reference(c):
    """Per sequence, the dense reference from its slot's state (zero for -1) with
    its slot's output gradient as the final state's (zero for -1); the input
    cache's gradient: the output's, except named slots, which get their
    sequence's d kv_history."""
    dq, dk, dv = (np.zeros(c[n].shape) for n in ("q", "k", "v"))
    ded = np.zeros(c["ed"].shape)
    dcache = c["grad_cache"].astype(np.float64)
    dcache[c["slot"][c["slot"] >= 0]] = 0.0
    for b, (s0, s1) in enumerate(zip(c["cu"][:-1], c["cu"][1:])):
        slot = c["slot"][b]
        hist = c["cache"][slot][None] if slot >= 0 else np.zeros((1, *c["cache"].shape[1:]))
        gfin = c["grad_cache"][slot][None] if slot >= 0 else np.zeros_like(hist)
        if s1 == s0:  # no tokens: the final state is the starting one
            if slot >= 0:
                dcache[slot] += gfin[0]
            continue
        seq = [c[n][s0:s1].astype(np.float64).transpose(1, 0, 2)[None] for n in ("q", "k", "v", "grad_output")]
        r = lightning_attention_backward_reference(*seq[:3], c["ed"], seq[3], gfin, kv_history=hist,
                                                   output_final_state_only=True)
        for out, x in zip((dq, dk, dv), r[:3]):
            out[s0:s1] = x[0].transpose(1, 0, 2)
        ded += r[4]
        if slot >= 0:
            dcache[slot] += r[3][0]
    return dq, dk, dv, dcache, ded


def test_varlen_cache_matches_reference_and_jax_bitwise():
    """The slot-cache form under autograd: sequences start from their slots'
    states, named slots take the final states; slot -1, an empty sequence with a
    named slot, one token, two chunks (70 > 64); torch (the cache a non-leaf
    copy of a leaf) and jax.grad (the cache an argument) agree bitwise."""
    import jax
    import jax.numpy as jnp
    import adapters.jax as aj
    lens, slots = ([9, 0, 1, 70, 5], [3, 0, -1, 5, 1]) if not GPU else ([1000, 0, 1, 4097, 300], [3, 0, -1, 5, 1])
    c = _cache_case(lens, slots, 2, 12, 20, "float32", seed=9)
    t = {n: to_torch(c[n]).requires_grad_(True) for n in ("q", "k", "v", "ed", "cache")}
    cache = t["cache"].clone()
    o, out_cache = at.lightning_attention_varlen(t["q"], t["k"], t["v"], t["ed"], to_torch(c["cu"]),
                                                 kv_cache=cache, slot_idx=to_torch(c["slot"]))
    assert out_cache is cache
    ((o * to_torch(c["grad_output"])).sum() + (out_cache * to_torch(c["grad_cache"])).sum()).backward()
    got = [torch_to_numpy(t[n].grad) for n in ("q", "k", "v", "cache", "ed")]
    check(got, _cache_reference(c), "float32", "torch varlen cache")
    go, gc = jnp.asarray(c["grad_output"]), jnp.asarray(c["grad_cache"])

    def loss(q, k, v, ed, kv_cache):
        o, new = aj.lightning_attention_varlen(q, k, v, ed, jnp.asarray(c["cu"]), kv_cache=kv_cache,
                                               slot_idx=jnp.asarray(c["slot"]))
        return (o * go).sum() + (new * gc).sum()
    j = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*(jnp.asarray(c[n]) for n in ("q", "k", "v", "ed",
                                                                                        "cache")))
    for name, a, b in zip(("dq", "dk", "dv", "d ed", "d kv_cache"), [got[0], got[1], got[2], got[4], got[3]], j):
        assert_bitwise_equal(a, np.asarray(b), f"varlen cache {name}: torch vs jax")


@pytest.mark.parametrize("cache", [False, True])
def test_varlen_forward_form_matches_reference_and_jax_bitwise(cache):
    """ed constant: the varlen backward runs the varlen forward kernel reversed
    and shifted (the plan's forward form, checked below). Empty, one-token and
    multi-chunk sequences, one cut into two work items (the 130 tokens of the
    last cross the 128-token segment boundary under the interpreter's plan);
    with the cache, sequences start from their slots (d kv_cache through the
    history's gradient; the empty sequence's is its final state's, undecayed)."""
    import jax
    import jax.numpy as jnp
    import adapters.jax as aj
    lens = [37, 0, 1, 70, 5, 130] if not GPU else [1000, 0, 1, 4097, 300, 64]
    slots = [3, 0, -1, 5, 1, 2]
    c = _cache_case(lens, slots, 2, 12, 20, "float32", seed=11) if cache else \
        _varlen_case(lens, 2, 12, 20, "float32", seed=11)
    names = ("q", "k", "v", "cache") if cache else ("q", "k", "v")
    t = {n: to_torch(c[n]).requires_grad_(True) for n in names}
    ed, cu = to_torch(c["ed"]), to_torch(c["cu"])
    if cache:
        o, fin = at.lightning_attention_varlen(t["q"], t["k"], t["v"], ed, cu, kv_cache=t["cache"].clone(),
                                               slot_idx=to_torch(c["slot"]))
        g_fin = c["grad_cache"]
    else:
        o, fin = at.lightning_attention_varlen(t["q"], t["k"], t["v"], ed, cu)
        g_fin = c["grad_states"]
    ((o * to_torch(c["grad_output"])).sum() + (fin * to_torch(g_fin)).sum()).backward()
    got = [torch_to_numpy(t[n].grad) for n in names]
    want = _cache_reference(c) if cache else _varlen_reference(c)
    check(got[:3] + [got[3] if cache else None, None], want[:4] + (None,), "float32", "torch varlen, ed constant")

    def loss(*xs):
        kw = dict(kv_cache=xs[3], slot_idx=jnp.asarray(c["slot"])) if cache else {}
        o, fin = aj.lightning_attention_varlen(*xs[:3], jnp.asarray(c["ed"]), jnp.asarray(c["cu"]), **kw)
        return (o * jnp.asarray(c["grad_output"])).sum() + (fin * jnp.asarray(g_fin)).sum()
    j = jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))(*(jnp.asarray(c[n]) for n in names))
    for name, a, b in zip(names, got, j):
        assert_bitwise_equal(a, np.asarray(b), f"varlen forward form d{name}: torch vs jax")


@pytest.mark.skipif(not GPU, reason="the Gluon varlen kernels run on sm_90 only")
@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_varlen_forward_form_gluon(dtype, cache):
    """The Gluon varlen kernels reversed and shifted (D = E = 128): an empty, a
    one-token, partial-chunk and multi-chunk sequences; with the cache, from
    their slots. Checked against the reference, and the plan checked to run the
    Gluon kernels."""
    from adapters.torch._executor import info, target_for
    from core_kernels.lightning_attention import plan_lightning_attention_varlen_backward
    # 8 sequences x 16 heads x 2 E-tiles: enough programs for the Gluon kernels (asserted below)
    lens, slots = [300, 0, 1, 700, 64, 200, 129, 500], [3, 0, -1, 5, 1, 2, 7, 6]
    c = _cache_case(lens, slots, 16, 128, 128, dtype, seed=12, num_slots=8) if cache else \
        _varlen_case(lens, 16, 128, 128, dtype, seed=12)
    names = ("q", "k", "v", "cache") if cache else ("q", "k", "v")
    t = {n: to_torch(c[n]).requires_grad_(True) for n in names}
    ed, cu = to_torch(c["ed"]), to_torch(c["cu"])
    kw = dict(kv_cache=t["cache"].clone(), slot_idx=to_torch(c["slot"])) if cache else {}
    o, fin = at.lightning_attention_varlen(t["q"], t["k"], t["v"], ed, cu, **kw)
    g_fin = to_torch(c["grad_cache"] if cache else c["grad_states"])
    ((o.float() * to_torch(c["grad_output"]).float()).sum() + (fin * g_fin).sum()).backward()
    got = [torch_to_numpy(t[n].grad) for n in names]
    want = _cache_reference(c) if cache else _varlen_reference(c)
    check(got[:3] + [got[3] if cache else None, None], want[:4] + (None,), dtype, f"torch varlen Gluon {dtype}")
    st = info(torch.zeros(len(lens), 16, 128, 128, device=cu.device))
    plan = plan_lightning_attention_varlen_backward(target_for(cu.device), *(info(t[n]) for n in ("q", "k", "v")),
                                                    info(ed), info(cu), st, info(t["q"]), st,
                                                    st if cache else None, need_grad_ed=False)
    assert sum("_gluon_varlen" in x.kernel.fn.__name__ for x in plan.launches) == 3


def test_varlen_backward_form_by_plan():
    """The varlen backward's forward form: the state maps and three varlen forward
    launches (reversed and shifted where the history is the output gradient's);
    the scans when d ed is needed."""
    from core_kernels._plan import ArrayInfo
    from core_kernels._target import Target
    from core_kernels.lightning_attention import plan_lightning_attention_varlen_backward
    cpu = Target("interpreter", 0, 4)
    q = ArrayInfo.contiguous((40, 2, 16), "float32")
    ed, cu = ArrayInfo.contiguous((2,), "float32"), ArrayInfo.contiguous((3,), "int32")
    st = ArrayInfo.contiguous((2, 2, 16, 16), "float32")

    def launches(hist, need):
        plan = plan_lightning_attention_varlen_backward(cpu, q, q, q, ed, cu, st, q, st, hist, need_grad_ed=need)
        return [(x.kernel.fn.__name__, x.constexprs.get("REVERSE"), x.constexprs.get("HIST_SHIFT"))
                for x in plan.launches]
    fwd = [("_lightning_varlen_kernel", False, False)] + [("_lightning_varlen_kernel", True, True)] * 2
    assert launches(None, False) == [("_state_map_kernel", None, None)] + fwd
    assert launches(st, False) == [("_state_map_kernel", None, None)] * 2 + fwd + [("_state_map_kernel", None, None)]
    assert "_lightning_varlen_kernel" not in [n for n, _, _ in launches(st, True)]


def test_varlen_cache_without_grad_is_the_cache_kernel():
    """No input requiring grad: the in-place cache op as before (the slot not
    named stays bit for bit; the forward is unchanged by the backward route)."""
    c = _cache_case([5, 3], [2, -1], 2, 8, 8, "float32", seed=8, num_slots=3)
    cache = to_torch(c["cache"])
    before = cache.clone()
    o, out_cache = at.lightning_attention_varlen(to_torch(c["q"]), to_torch(c["k"]), to_torch(c["v"]),
                                                 to_torch(c["ed"]), to_torch(c["cu"]), kv_cache=cache,
                                                 slot_idx=to_torch(c["slot"]))
    assert out_cache is cache and o.grad_fn is None
    assert_bitwise_equal(torch_to_numpy(cache[:2]), torch_to_numpy(before[:2]), "slots not named")


def test_narrow_tiles_run_at_most_four_warps():
    """8 warps with tiles narrower than 64 gave NaN in bf16 dv on the H200: the plan
    runs 4 there even when the config asks for 8, and keeps 8 for 64-wide tiles."""
    from core_kernels._plan import ArrayInfo
    from core_kernels._target import Target
    from core_kernels.lightning_attention import LightningBackwardConfig, plan_lightning_attention_backward
    h200 = Target("cuda", 90, 132, gluon=True)
    for (d, e), want in (((20, 12), 4), ((64, 96), 8), ((128, 128), 8)):
        q, v = ArrayInfo.contiguous((1, 2, 50, d), "bfloat16"), ArrayInfo.contiguous((1, 2, 50, e), "bfloat16")
        ed, kv = ArrayInfo.contiguous((2,), "float32"), ArrayInfo.contiguous((1, 2, d, e), "float32")
        for config in (LightningBackwardConfig(), LightningBackwardConfig(num_warps=8)):
            plan = plan_lightning_attention_backward(h200, q, q, v, ed, None, kv, v, kv, output_final_state_only=True,
                                                     need_grad_ed=False, config=config)
            assert [launch.num_warps for launch in plan.launches] == [want] * 3, (d, e, config)

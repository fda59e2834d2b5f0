"""merge_attn_states backward: the float64 reference against finite differences,
both adapters against the reference, torch vs JAX bitwise (spec: merge_attn_states.md)."""
import numpy as np
import pytest
import torch

import adapters.torch as at
from adapters.torch._register import OPS
from core_kernels.merge_attn_states import (NO_FP8_BACKWARD, MergeConfig,
                                            merge_attn_states_backward_reference,
                                            merge_attn_states_reference)
from harness import (DEVICE, GPU, JaxAdapter, TorchAdapter, assert_bitwise_equal, assert_close,
                     assert_matches_finite_differences, cast, rng, to_jax, to_torch, torch_to_numpy)

DTYPES = ["float32", "float16"] + (["bfloat16"] if GPU else [])
BACKEND = "inductor" if GPU else "aot_eager"
INF, NAN = np.float32(np.inf), np.float32(np.nan)


def make_case(n, h, d, dtype, kind="plain", seed=None):
    """Fresh random inputs and output gradients; ``kind`` "edge" puts every LSE
    edge case of the spec in the first tokens."""
    g = rng(seed)
    po = cast(g.standard_normal((n, h, d)), dtype)
    so = cast(g.standard_normal((n, h, d)), dtype)
    pl = (g.standard_normal((h, n)) * 3).astype(np.float32)
    sl = (g.standard_normal((h, n)) * 3).astype(np.float32)
    go = cast(g.standard_normal((n, h, d)), dtype)
    gl = g.standard_normal((h, n)).astype(np.float32)
    if kind == "edge":
        pl[0, 0] = -INF; po[0, 0] = NAN          # empty prefix (NaN garbage ignored)
        sl[1, 1] = INF; so[1, 1] = NAN           # empty suffix (+inf convention)
        pl[0, 2], sl[0, 2] = -INF, -INF          # both empty
        pl[1, 3], sl[1, 3] = INF, -INF           # both empty, mixed conventions
        pl[0, 4] = NAN                           # NaN propagates to the whole row
        pl[1, 5], sl[1, 5] = 60.0, -60.0         # extreme but finite
    return po, pl, so, sl, go, gl


def reference(po, pl, so, sl, go, gl, ptwc=None):
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    return merge_attn_states_backward_reference(f(po), pl, f(so), sl, f(go), gl, ptwc)


def check_grads(got, want, dtype):
    for name, g, w, dt in zip(("d prefix_output", "d prefix_lse", "d suffix_output", "d suffix_lse"),
                              got, want, (dtype, "float32", dtype, "float32")):
        assert np.asarray(g).dtype == cast(np.zeros(1), dt).dtype, f"{name}: dtype {np.asarray(g).dtype}"
        # the LSE gradients sum D products of dtype-rounded inputs in fp32
        assert_close(g, w, dt, name, scale=1.0 if dt == dtype else 4.0)


# ------------------------------------------------------------------ core reference
def test_reference_matches_finite_differences():
    n, h, d, ptwc = 5, 2, 3, 4
    po, pl, so, sl, go, gl = make_case(n, h, d, "float64")
    po, so, go = po.astype(np.float64), so.astype(np.float64), go.astype(np.float64)
    pl, sl, gl = pl.astype(np.float64), sl.astype(np.float64), gl.astype(np.float64)
    pl[0, 0] = -np.inf; sl[1, 1] = np.inf; pl[0, 2] = sl[0, 2] = -np.inf; pl[1, 3] = np.inf

    def loss(po, pl, so, sl):
        out, lse = merge_attn_states_reference(po, pl, so, sl, ptwc)
        return (go * out).sum() + (gl * np.where(np.isfinite(lse), lse, 0.0)).sum()

    args = [po, pl, so, sl]
    want = merge_attn_states_backward_reference(po, pl, so, sl, go, gl, ptwc)
    assert_matches_finite_differences(loss, args, want)
    assert np.all(want[0][ptwc:] == 0) and np.all(want[1][:, ptwc:] == 0), "copied tokens: no prefix grad"
    assert np.array_equal(want[2][ptwc:], go[ptwc:]) and np.array_equal(want[3][:, ptwc:], gl[:, ptwc:])


# ------------------------------------------------------------------ both adapters
class MergeBackwardTests:
    """numpy in, numpy gradients (d po, d pl, d so, d sl) out, per adapter."""

    def grads(self, po, pl, so, sl, go, gl, ptwc=None):
        raise NotImplementedError

    def merge_fp8(self, po, pl, so, sl):
        """Differentiate a merge with an fp8 output (must raise)."""
        raise NotImplementedError

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("kind,ptwc", [("plain", None), ("plain", 6), ("edge", None), ("edge", 4)],
                             ids=["plain", "plain-ptwc6", "edge", "edge-ptwc4"])
    def test_matches_reference(self, dtype, kind, ptwc):
        po, pl, so, sl, go, gl = make_case(9, 2, 40, dtype, kind)
        got = self.grads(po, pl, so, sl, go, gl, ptwc)
        want = reference(po, pl, so, sl, go, gl, ptwc)
        check_grads(got, want, dtype)
        if kind == "edge":
            dpo, dpl, dso, dsl = (np.asarray(x, np.float32) for x in got)
            assert np.all(dpo[0, 0] == 0) and dpl[0, 0] == 0, "empty prefix: zero gradients"
            assert np.all(dso[1, 1] == 0) and dsl[1, 1] == 0, "empty suffix: zero gradients"
            for t, hh in ((2, 0), (3, 1)):
                assert np.all(dpo[t, hh] == 0) and np.all(dso[t, hh] == 0), "both empty: zero"
                assert dpl[hh, t] == 0 and dsl[hh, t] == 0
        k = 9 if ptwc is None else ptwc
        if kind == "edge" and k > 4:
            assert np.isnan(np.asarray(got[0], np.float32)[4, 0]).all() and np.isnan(got[3][0, 4]), \
                "NaN LSE propagates"
        assert_bitwise_equal(np.asarray(got[2])[k:], go[k:], "copied tokens: d so = g")
        assert_bitwise_equal(np.asarray(got[3])[:, k:], gl[:, k:], "copied tokens: d s = g_lse")

    def test_fp8_output_has_no_backward(self):
        po, pl, so, sl, _, _ = make_case(4, 2, 16, "float32")
        with pytest.raises(ValueError, match="output_scale.*no backward"):
            self.merge_fp8(po, pl, so, sl)


class TestTorch(TorchAdapter, MergeBackwardTests):
    def grads(self, po, pl, so, sl, go, gl, ptwc=None, strided=False, config=None):
        n, h, d = po.shape
        inputs = [to_torch(x).requires_grad_(True) for x in (po, pl, so, sl)]
        if strided:  # padded output heads, transposed output_lse view
            out = torch.full((n, h + 2, d), float("nan"), dtype=inputs[0].dtype, device=DEVICE)[:, :h]
            lse = torch.full((n, h), float("nan"), device=DEVICE).t()
        else:
            out = torch.full((n, h, d), float("nan"), dtype=inputs[0].dtype, device=DEVICE)
            lse = torch.full((h, n), float("nan"), device=DEVICE)
        at.merge_attn_states(out, *inputs, output_lse=lse, prefill_tokens_with_context=ptwc, config=config)
        torch.autograd.backward([out, lse], [to_torch(go), to_torch(gl)])
        return [torch_to_numpy(x.grad) for x in inputs]

    def merge_fp8(self, po, pl, so, sl):
        inputs = [to_torch(x).requires_grad_(True) for x in (po, pl, so, sl)]
        out = torch.empty(po.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
        at.merge_attn_states(out, *inputs, output_scale=torch.tensor([0.1], device=DEVICE))

    def test_strided_output_and_tensor_count(self):
        po, pl, so, sl, go, gl = make_case(7, 3, 24, "float32", "edge")
        got = self.grads(po, pl, so, sl, go, gl, 5, strided=True)
        check_grads(got, reference(po, pl, so, sl, go, gl, 5), "float32")
        inputs = [to_torch(x).requires_grad_(True) for x in (po, pl, so, sl)]
        out = torch.empty(po.shape, device=DEVICE)
        at.merge_attn_states(out, *inputs, prefill_tokens_with_context=torch.tensor([5], device=DEVICE))
        (out * to_torch(go)).sum().backward()  # no output_lse; an expanded gradient inside
        want = reference(po, pl, so, sl, go, np.zeros_like(gl), 5)
        check_grads([torch_to_numpy(x.grad) for x in inputs], want, "float32")

    @pytest.mark.parametrize("config", [MergeConfig(256, 1, head_major=True),
                                        MergeConfig(2048, 2, head_major=True), MergeConfig(4096, 8)],
                             ids=["tile256-w1-head-major", "tile2048-w2-head-major", "tile4096-w8"])
    def test_tilings_give_the_same_bits(self, config):
        """The config given to the forward also tiles the backward: any tiling, rows
        in either order (a tile's heads of one token, or tokens of one head), gives
        the default's bits, edge cases and a partial last tile included."""
        po, pl, so, sl, go, gl = make_case(37, 3, 72, "float32", "edge")
        default = self.grads(po, pl, so, sl, go, gl, 20)
        forced = self.grads(po, pl, so, sl, go, gl, 20, config=config)
        for name, a, b in zip(("d prefix_output", "d prefix_lse", "d suffix_output", "d suffix_lse"),
                              forced, default):
            assert_bitwise_equal(a, b, name)
        check_grads(forced, reference(po, pl, so, sl, go, gl, 20), "float32")

    def test_no_grad_path_unchanged(self):
        po, pl, so, sl, _, _ = make_case(6, 2, 16, "float32")
        inputs = [to_torch(x).requires_grad_(True) for x in (po, pl, so, sl)]
        out = torch.empty(po.shape, device=DEVICE)
        with torch.no_grad():
            at.merge_attn_states(out, *inputs)
        assert out.grad_fn is None
        assert_close(torch_to_numpy(out), merge_attn_states_reference(po, pl, so, sl)[0], "float32")

    def test_compile_fullgraph_grads_equal_eager(self):
        po, pl, so, sl, go, gl = make_case(6, 2, 16, "float32", "edge")
        go, gl = to_torch(go), to_torch(gl)

        def f(a, b, c, d):
            out = torch.empty_like(a)
            lse = torch.empty_like(b)
            at.merge_attn_states(out, a, b, c, d, lse, 5)
            return (out * go).sum() + (lse.nan_to_num(0.0, 0.0, 0.0) * gl).sum()

        grads = []
        for fn in (f, torch.compile(f, fullgraph=True, backend=BACKEND)):
            inputs = [to_torch(x).requires_grad_(True) for x in (po, pl, so, sl)]
            fn(*inputs).backward()
            grads.append([torch_to_numpy(x.grad) for x in inputs])
        for e, c in zip(*grads):
            assert_bitwise_equal(c, e, "compiled vs eager gradient")

    def test_opcheck(self):
        po, pl, so, sl, go, gl = (to_torch(x) for x in make_case(5, 2, 16, "float32"))
        functional = OPS["merge_attn_states_functional"].op
        for count, ptwc in ((None, None), (None, 3), (torch.tensor([2], device=DEVICE), None)):
            args = [po.clone().requires_grad_(True), pl.clone().requires_grad_(True),
                    so.clone().requires_grad_(True), sl.clone().requires_grad_(True), ptwc, None, count]
            torch.library.opcheck(functional, args)
        torch.library.opcheck(OPS["merge_attn_states_backward"].op, [po, pl, so, sl, go, gl, 3, None, None])

    def test_double_backward_is_refused(self):
        po, pl, so, sl, go, _ = make_case(4, 2, 16, "float32")
        inputs = [to_torch(x).requires_grad_(True) for x in (po, pl, so, sl)]
        out = torch.empty(po.shape, device=DEVICE)
        at.merge_attn_states(out, *inputs)
        with pytest.raises(RuntimeError, match="merge_attn_states_backward has no backward"):
            torch.autograd.grad((out * to_torch(go)).sum(), inputs[1:2], create_graph=True)


class TestJax(JaxAdapter, MergeBackwardTests):
    def grads(self, po, pl, so, sl, go, gl, ptwc=None, jit=False):
        import jax
        import adapters.jax as aj

        def vjp(po, pl, so, sl, go, gl, ptwc):
            merge = lambda *a: aj.merge_attn_states(*a, prefill_tokens_with_context=ptwc)  # noqa: E731
            return jax.vjp(merge, po, pl, so, sl)[1]((go, gl))
        if jit:
            vjp = jax.jit(vjp)
            ptwc = None if ptwc is None else np.int32(ptwc)
        return [np.asarray(x) for x in vjp(*map(to_jax, (po, pl, so, sl, go, gl)), ptwc)]

    def merge_fp8(self, po, pl, so, sl):
        import jax
        import jax.numpy as jnp
        import adapters.jax as aj
        pl, so, sl = map(to_jax, (pl, so, sl))
        jax.grad(lambda p: aj.merge_attn_states(p, pl, so, sl, output_scale=0.1)[0]
                 .astype(jnp.float32).sum())(to_jax(po))

    def test_jit_traced_count_and_backward_function(self):
        import adapters.jax as aj
        po, pl, so, sl, go, gl = make_case(8, 2, 16, "float32", "edge")
        check_grads(self.grads(po, pl, so, sl, go, gl, 5, jit=True), reference(po, pl, so, sl, go, gl, 5),
                    "float32")
        got = aj.merge_attn_states_backward(*map(to_jax, (po, pl, so, sl, go)), None)  # no LSE gradient
        check_grads([np.asarray(x) for x in got], reference(po, pl, so, sl, go, np.zeros_like(gl)),
                    "float32")

    def test_vmap_and_grad_compose(self):
        import jax
        import adapters.jax as aj
        v, ptwc = 2, 3
        cases = [make_case(5, 2, 16, "float32", seed=None) for _ in range(v)]
        po, pl, so, sl, go, gl = (np.stack(x) for x in zip(*cases))

        def loss(po, pl, so, sl, go, gl):
            out, lse = aj.merge_attn_states(po, pl, so, sl, prefill_tokens_with_context=ptwc)
            return (out * go).sum() + (lse * gl).sum()

        def vloss(po, pl, so, sl, go, gl):
            return jax.vmap(loss)(po, pl, so, sl, go, gl).sum()

        args = tuple(map(to_jax, (po, pl, so, sl, go, gl)))
        vg = jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
        gv = jax.grad(vloss, argnums=(0, 1, 2, 3))(*args)
        for i in range(v):
            want = reference(*cases[i], ptwc)
            check_grads([np.asarray(x[i]) for x in vg], want, "float32")
            check_grads([np.asarray(x[i]) for x in gv], want, "float32")

    def test_vmap_of_batched_count_through_backward_matches_per_example(self):
        """A batched prefill_tokens_with_context (a count per example) runs the
        backward once per example: bitwise equal to separate calls."""
        import jax
        import adapters.jax as aj
        cases = [make_case(4, 2, 16, "float32") for _ in range(2)]
        stacked = [np.stack(xs) for xs in zip(*cases)]
        counts = np.array([1, 3], np.int32)

        def g(po, pl, so, sl, go, gl, k):
            return aj.merge_attn_states_backward(po, pl, so, sl, go, gl, prefill_tokens_with_context=k)
        got = jax.vmap(g)(*map(to_jax, stacked), to_jax(counts))
        for i, case in enumerate(cases):
            want = g(*map(to_jax, case), to_jax(counts[i:i + 1]))
            for a, b in zip(got, want):
                assert_bitwise_equal(np.asarray(a)[i], np.asarray(b), f"example {i}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_and_jax_gradients_bitwise_equal(dtype):
    po, pl, so, sl, go, gl = make_case(11, 3, 24, dtype, "edge")
    t = TestTorch().grads(po, pl, so, sl, go, gl, 8)
    j = TestJax().grads(po, pl, so, sl, go, gl, 8, jit=True)
    for name, a, b in zip(("d prefix_output", "d prefix_lse", "d suffix_output", "d suffix_lse"), t, j):
        assert_bitwise_equal(a, b, f"{name}: torch vs jax")


def test_fp8_message_is_shared():
    assert "output_scale" in NO_FP8_BACKWARD and "no backward" in NO_FP8_BACKWARD

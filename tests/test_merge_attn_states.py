"""merge_attn_states: both adapters against the float64 reference (spec: merge_attn_states.md)."""
import functools

import numpy as np
import pytest
import torch

from core_kernels.merge_attn_states import (MergeConfig, merge_attn_states_reference,
                                            plan_merge_attn_states)
from harness import (DEVICE, FLOAT_DTYPES, GPU, JaxAdapter, TorchAdapter, assert_bitwise_equal,
                     assert_close, assert_within_one_fp8_step, cast, poison_like, requires_gpu, rng,
                     to_jax, to_torch, torch_to_numpy)
import adapters.torch as at


def make_inputs(n, h, d, dtype, seed=None, lse_scale=3.0):
    g = rng(seed)
    po = cast(g.standard_normal((n, h, d)), dtype)
    so = cast(g.standard_normal((n, h, d)), dtype)
    pl = (g.standard_normal((h, n)) * lse_scale).astype(np.float32)
    sl = (g.standard_normal((h, n)) * lse_scale).astype(np.float32)
    return po, pl, so, sl


def reference(po, pl, so, sl, ptwc=None, scale=None):
    return merge_attn_states_reference(po.astype(np.float64), pl, so.astype(np.float64), sl,
                                       ptwc, scale)


def special_inputs(dtype, n=12, h=3, d=40):
    """Rows that exercise every LSE edge case of the spec."""
    po, pl, so, sl = make_inputs(n, h, d, dtype)
    inf, nan = np.float32(np.inf), np.float32(np.nan)
    pl[0, 0], sl[0, 0] = -inf, -inf            # both empty (-inf)
    pl[1, 1], sl[1, 1] = inf, inf              # both empty (+inf)
    pl[2, 2], sl[2, 2] = inf, -inf             # mixed conventions, both empty
    pl[0, 3] = -inf; po[3, 0] = nan            # empty prefix with NaN garbage
    sl[1, 4] = inf; so[4, 1] = nan             # empty suffix (+inf) with NaN garbage
    pl[2, 5] = nan                             # NaN LSE propagates
    sl[0, 6] = nan
    pl[1, 7], sl[1, 7] = 80.0, -80.0           # extreme but finite
    pl[0, 8] = inf; so[8, 0, :] = so[8, 0, :]  # +inf prefix only: pure suffix
    return po, pl, so, sl


def _bad_cases():
    po, pl, so, sl = make_inputs(4, 2, 16, "float32")
    return [
        ("suffix_output", dict(so=so[:, :1])),
        ("prefix_lse", dict(pl=pl.astype(np.float16))),
        ("suffix_lse", dict(sl=sl[:1])),
        ("prefix_output", dict(po=po.astype(np.int32), so=so.astype(np.int32))),
        ("suffix_output", dict(so=so.astype(np.float16))),
        ("prefix_output", dict(po=np.zeros((4, 2, 600), np.float32), so=np.zeros((4, 2, 600), np.float32))),
    ], (po, pl, so, sl)



class MergeTests:
    """Every merge_attn_states test, written once; a subclass per adapter
    implements ``merge`` (and may add framework-only tests)."""

    def merge(self, po, pl, so, sl, *, ptwc=None, scale=None, with_lse=True, config=None):
        """numpy inputs -> numpy (output, output_lse or None) through this adapter."""
        raise NotImplementedError

    def framework_fp8(self, x: np.ndarray, scale: float) -> np.ndarray:
        """fp8(clamp(x / scale)) computed by the framework itself."""
        raise NotImplementedError

    @pytest.mark.parametrize("dtype", FLOAT_DTYPES)
    @pytest.mark.parametrize("n,h,d", [(7, 4, 128), (33, 3, 80), (5, 2, 1), (3, 2, 512), (19, 5, 24)],
                             ids=lambda v: str(v))
    def test_matches_reference(self, dtype, n, h, d):
        po, pl, so, sl = make_inputs(n, h, d, dtype)
        out, lse = self.merge(po, pl, so, sl)
        ref_out, ref_lse = reference(po, pl, so, sl)
        assert_close(out, ref_out, dtype, "output")
        assert_close(lse, ref_lse, "float32", "output_lse")

    @pytest.mark.parametrize("dtype", FLOAT_DTYPES)
    @pytest.mark.parametrize("config", [None, MergeConfig(2048, 2, "", False),
                                        MergeConfig(2048, 2, "", False, True)],
                             ids=["default-values-first", "values-after-lses",
                                  "values-after-lses-head-major"])
    def test_edge_cases(self, dtype, config):
        """Every LSE edge case, with both load orders: the default at this size
        loads the values before the LSEs (and zeroes an empty part's), the large
        merges' tiling loads them after, masked by the LSEs; and with a tile's
        rows taken along the tokens of one head."""
        po, pl, so, sl = special_inputs(dtype)
        out, lse = self.merge(po, pl, so, sl, config=config)
        ref_out, ref_lse = reference(po, pl, so, sl)
        assert_close(out, ref_out, dtype, "output")
        assert_close(lse, ref_lse, "float32", "output_lse")
        assert np.all(np.asarray(out[0, 0], np.float32) == 0) and lse[0, 0] == -np.inf
        assert np.all(np.asarray(out[1, 1], np.float32) == 0) and lse[1, 1] == -np.inf
        assert not np.isnan(np.asarray(out[3, 0], np.float32)).any(), "empty prefix's NaN leaked"
        assert not np.isnan(np.asarray(out[4, 1], np.float32)).any(), "empty suffix's NaN leaked"
        assert np.isnan(np.asarray(out[5, 2], np.float32)).all() and np.isnan(lse[2, 5])
        assert np.isnan(np.asarray(out[6, 0], np.float32)).all() and np.isnan(lse[0, 6])

    @pytest.mark.parametrize("ptwc", [0, 1, 5, 12])  # > N: an error (tests/test_scalar_policy.py)
    def test_prefill_tokens_with_context(self, ptwc):
        po, pl, so, sl = special_inputs("float32")
        sl[2, 9] = np.inf  # copied as is for tokens without context
        out, lse = self.merge(po, pl, so, sl, ptwc=ptwc)
        ref_out, ref_lse = reference(po, pl, so, sl, ptwc)
        assert_close(out, ref_out, "float32", "output")
        assert_close(lse, ref_lse, "float32", "output_lse")
        k = min(ptwc, 12)
        assert_bitwise_equal(out[k:], so[k:], "suffix passes through bit for bit")
        assert_bitwise_equal(lse[:, k:], sl[:, k:], "suffix_lse copied as is")

    @pytest.mark.parametrize("dtype", FLOAT_DTYPES)
    @pytest.mark.parametrize("ptwc", [None, 6])
    @pytest.mark.parametrize("scale", [0.02, 64.0], ids=["normal", "subnormal"])
    def test_fp8_output(self, dtype, ptwc, scale):
        """Scale 0.02: normal fp8 values and saturation; 64: most outputs in e4m3's
        subnormal range (|x| / 64 < 2^-6), where one step is the 2^-9 quantum."""
        po, pl, so, sl = make_inputs(9, 3, 48, dtype)
        po[0, 0, :4] = 1e4  # saturates at scale 0.02: clamp before the cast
        pl[0, 0] = 5.0
        out8, lse = self.merge(po, pl, so, sl, ptwc=ptwc, scale=scale)
        assert out8.dtype.name == "float8_e4m3fn"
        ref_out, ref_lse = reference(po, pl, so, sl, ptwc, scale)
        assert np.all(np.abs(ref_out) <= 448)
        exact, _ = reference(po, pl, so, sl, ptwc)
        exact = np.asarray(exact, np.float64) / scale
        if scale > 1:
            assert np.mean(np.abs(exact) < 2 ** -6) > 0.5, "most outputs must be subnormal"
        assert_within_one_fp8_step(out8, exact, "fp8 output")
        assert_close(lse, ref_lse, "float32", "output_lse")
        if dtype == "float32":
            # bit-identical to clamp-then-cast in the framework applied to our own fp32 merge
            out32, _ = self.merge(po, pl, so, sl, ptwc=ptwc)
            assert_bitwise_equal(out8, self.framework_fp8(out32, scale),
                                 "fp8 output vs framework clamp-then-cast")

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    @pytest.mark.parametrize("config", [MergeConfig(256, 1), MergeConfig(2048, 2),
                                        MergeConfig(4096, 8), MergeConfig(512, 2, "", True),
                                        MergeConfig(2048, 8, "", True), MergeConfig(256, 1, head_major=True),
                                        MergeConfig(2048, 2, head_major=True),
                                        MergeConfig(512, 2, "", True, True)],
                             ids=["tile256-w1", "tile2048-w2", "tile4096-w8", "tile512-w2-values-first",
                                  "tile2048-w8-values-first", "tile256-w1-head-major",
                                  "tile2048-w2-head-major", "tile512-w2-values-first-head-major"])
    def test_config_override(self, config, dtype):
        """Any tiling, either load order and rows in either order (a tile's heads
        of one token, or tokens of one head) give the same bits as the measured
        default (at this size one row per one-warp program, values loaded first),
        edge cases and a partial last tile included."""
        po, pl, so, sl = special_inputs(dtype, 37, 3, 72)
        default = self.merge(po, pl, so, sl, ptwc=20)
        forced = self.merge(po, pl, so, sl, ptwc=20, config=config)
        assert_bitwise_equal(forced[0], default[0], "output")
        assert_bitwise_equal(forced[1], default[1], "output_lse")

    def test_config_of_another_op_is_refused(self):
        po, pl, so, sl = make_inputs(4, 2, 16, "float32")
        with pytest.raises(TypeError, match="config"):
            self.merge(po, pl, so, sl, config=("tile", 2048))

    def test_empty_batch(self):
        po, pl, so, sl = make_inputs(0, 4, 32, "float32")
        out, lse = self.merge(po, pl, so, sl)
        assert out.shape == (0, 4, 32) and lse.shape == (4, 0)

    @pytest.mark.parametrize("case", range(6))
    def test_errors_name_the_argument(self, case):
        cases, (po, pl, so, sl) = _bad_cases()
        name, repl = cases[case]
        args = {**dict(po=po, pl=pl, so=so, sl=sl), **repl}
        with pytest.raises((ValueError, TypeError), match=name):
            self.merge(*(args[k] for k in ("po", "pl", "so", "sl")))


class TestTorch(TorchAdapter, MergeTests):
    def merge(self, po, pl, so, sl, *, ptwc=None, scale=None, with_lse=True, config=None,
              strided=False):
        n, h, d = po.shape
        out_dtype = "float8_e4m3fn" if scale is not None else po.dtype.name
        if out_dtype.startswith("int"):
            out_dtype = "float32"
        if strided:  # differing input strides, transposed LSE views, padded output heads
            po_t = to_torch(np.concatenate([po, po[:, :1]], axis=1))[:, :h]
            so_t = to_torch(np.concatenate([so, so[:, :2], so[:, :1]], axis=1))[:, :h]
            pl_t = to_torch(np.ascontiguousarray(pl.T)).t()
            sl_t = to_torch(np.ascontiguousarray(sl.T)).t()
            out = to_torch(poison_like((n, h + 3, d), out_dtype))[:, :h]
            lse = to_torch(poison_like((n, h), "float32")).t() if with_lse else None
        else:
            po_t, so_t, pl_t, sl_t = map(to_torch, (po, so, pl, sl))
            out = to_torch(poison_like((n, h, d), out_dtype))
            lse = to_torch(poison_like((h, n), "float32")) if with_lse else None
        scale_t = None if scale is None else torch.tensor([scale], dtype=torch.float32, device=DEVICE)
        at.merge_attn_states(out, po_t, pl_t, so_t, sl_t, lse, ptwc, scale_t, config=config)
        return torch_to_numpy(out), None if lse is None else torch_to_numpy(lse)

    def framework_fp8(self, x, scale):
        t = (torch.from_numpy(x) / torch.tensor(scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
        return torch_to_numpy(t)

    def test_plan_is_reused_across_prefill_values(self):
        from adapters.torch import _executor
        po, pl, so, sl = make_inputs(6, 2, 16, "float32")
        self.merge(po, pl, so, sl, ptwc=2)
        before = plan_merge_attn_states.cache_info()
        cached = dict(_executor._PLANS)
        self.merge(po, pl, so, sl, ptwc=4)
        after = plan_merge_attn_states.cache_info()
        # no new plan: neither the planner nor the adapter-side plan cache made one
        assert after.misses == before.misses
        assert cached and _executor._PLANS == cached

    @pytest.mark.parametrize("with_lse", [True, False])
    def test_strided_and_padded(self, with_lse):
        po, pl, so, sl = make_inputs(11, 4, 64, "float16")
        out, lse = self.merge(po, pl, so, sl, strided=True, with_lse=with_lse, ptwc=8)
        ref_out, ref_lse = reference(po, pl, so, sl, 8)
        assert_close(out, ref_out, "float16", "output")
        if with_lse:
            assert_close(lse, ref_lse, "float32", "output_lse")

    def test_misaligned_views_after_aligned(self):
        """The same shapes with a pointer off the 16-byte grid must not reuse a
        kernel compiled for aligned pointers."""
        po, pl, so, sl = make_inputs(6, 2, 32, "float32")
        ref_out, _ = reference(po, pl, so, sl, 3)
        for offset in (0, 1, 0):
            flat = to_torch(np.concatenate([np.zeros(offset, np.float32), po.ravel()]))
            po_t = flat[offset:].view(po.shape)
            out = torch.full(po.shape, float("nan"), device=DEVICE)
            at.merge_attn_states(out, po_t, *map(to_torch, (pl, so, sl)), prefill_tokens_with_context=3)
            assert_close(torch_to_numpy(out), ref_out, "float32", f"offset {offset}")

    def test_padding_heads_untouched(self):
        po, pl, so, sl = make_inputs(5, 2, 32, "float32")
        buf = to_torch(np.full((5, 4, 32), 7.0, np.float32))
        at.merge_attn_states(buf[:, :2], *map(to_torch, (po, pl, so, sl)))
        assert torch.all(buf[:, 2:].cpu() == 7.0)

    def test_errors(self):
        po, pl, so, sl = map(to_torch, make_inputs(4, 2, 16, "float32"))
        with pytest.raises(ValueError, match="output_scale"):
            at.merge_attn_states(torch.empty(4, 2, 16, dtype=torch.float8_e4m3fn, device=DEVICE), po, pl, so, sl)
        with pytest.raises(TypeError, match="output"):
            at.merge_attn_states(torch.empty(4, 2, 16, dtype=torch.float16, device=DEVICE), po, pl, so, sl)
        with pytest.raises(ValueError, match="output_scale"):
            at.merge_attn_states(torch.empty(4, 2, 16, dtype=torch.float8_e4m3fn, device=DEVICE), po, pl, so, sl,
                                 output_scale=torch.tensor([1.0, 2.0], device=DEVICE))
        with pytest.raises(ValueError, match="innermost"):
            big = torch.randn(4, 2, 32, device=DEVICE)
            at.merge_attn_states(torch.empty(4, 2, 16, device=DEVICE), big[..., ::2], pl, big[..., ::2], sl)
        with pytest.raises(ValueError, match="output_lse"):
            at.merge_attn_states(torch.empty(4, 2, 16, device=DEVICE), po, pl, so, sl,
                                 output_lse=torch.empty(4, 2, device=DEVICE))
        with pytest.raises(ValueError, match="suffix_lse.*one device"):
            at.merge_attn_states(torch.empty(4, 2, 16, device=DEVICE), po, pl, so, sl.to("meta"))

    def test_compile_fullgraph(self):
        po, pl, so, sl = make_inputs(8, 2, 32, "float32")
        args = list(map(to_torch, (po, pl, so, sl)))

        def f(a, b, c, d):
            out = torch.empty_like(a)
            lse = torch.empty_like(b)
            at.merge_attn_states(out, a, b, c, d, lse, 5)
            return out * 2, lse

        backend = "inductor" if GPU else "aot_eager"  # CPU: no compiler needed for the opaque op
        out, lse = torch.compile(f, fullgraph=True, backend=backend)(*args)
        ref_out, ref_lse = reference(po, pl, so, sl, 5)
        assert_close(torch_to_numpy(out), 2 * ref_out, "float32", "compiled output")
        assert_close(torch_to_numpy(lse), ref_lse, "float32", "compiled lse")

    def test_config_under_compile(self):
        """config= reaches the planner through the custom op (as a string)."""
        po, pl, so, sl = make_inputs(8, 2, 32, "float32")
        args = list(map(to_torch, (po, pl, so, sl)))
        config = MergeConfig(128, 1)

        def f(a, b, c, d):
            out = torch.empty_like(a)
            at.merge_attn_states(out, a, b, c, d, None, 5, config=config)
            return out

        backend = "inductor" if GPU else "aot_eager"
        before = plan_merge_attn_states.cache_info().misses
        out = torch.compile(f, fullgraph=True, backend=backend)(*args)
        assert plan_merge_attn_states.cache_info().misses > before, "the config made no plan of its own"
        assert_close(torch_to_numpy(out), reference(po, pl, so, sl, 5)[0], "float32", "compiled output")

    @requires_gpu
    def test_cuda_graph_replay(self):
        po, pl, so, sl = make_inputs(64, 8, 128, "bfloat16")
        args = list(map(to_torch, (po, pl, so, sl)))
        out = torch.empty_like(args[0])
        lse = torch.empty_like(args[1])
        at.merge_attn_states(out, *args, output_lse=lse)  # warm-up compiles outside capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            at.merge_attn_states(out, *args, output_lse=lse)
        po2, pl2, so2, sl2 = make_inputs(64, 8, 128, "bfloat16")
        for dst, src in zip(args, (po2, pl2, so2, sl2)):
            dst.copy_(to_torch(src))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert_close(torch_to_numpy(out), reference(po2, pl2, so2, sl2)[0], "bfloat16", "graph replay")


class TestJax(JaxAdapter, MergeTests):
    def merge(self, po, pl, so, sl, *, ptwc=None, scale=None, with_lse=True, config=None, jit=False):
        import jax
        import adapters.jax as aj
        fn = functools.partial(aj.merge_attn_states, config=config)
        kwargs = dict(prefill_tokens_with_context=ptwc, output_scale=scale)
        if jit:
            fn = jax.jit(fn)
            if ptwc is not None:
                kwargs["prefill_tokens_with_context"] = np.int32(ptwc)
        out, lse = fn(*map(to_jax, (po, pl, so, sl)), **kwargs)
        return np.asarray(out), np.asarray(lse)

    def framework_fp8(self, x, scale):
        import jax.numpy as jnp
        return np.asarray(jnp.clip(jnp.asarray(x) / jnp.float32(scale), -448, 448)
                          .astype(jnp.float8_e4m3fn))

    def test_jit_traced_and_python_values(self):
        import jax
        import jax.numpy as jnp
        import adapters.jax as aj
        po, pl, so, sl = make_inputs(10, 2, 16, "float32")
        args = list(map(to_jax, (po, pl, so, sl)))
        f = jax.jit(lambda a, b, c, d, k: aj.merge_attn_states(a, b, c, d, prefill_tokens_with_context=k))
        for k in (3, 7, 10):
            out, lse = f(*args, jnp.int32(k))
            ref_out, ref_lse = reference(po, pl, so, sl, k)
            assert_close(self.numpy(out), ref_out, "float32", f"traced k={k}")
        assert f._cache_size() == 1, "a new prefill_tokens_with_context value recompiled"
        g = jax.jit(lambda a, b, c, d: aj.merge_attn_states(a, b, c, d, prefill_tokens_with_context=4))
        out, _ = g(*args)
        assert_close(self.numpy(out), reference(po, pl, so, sl, 4)[0], "float32", "python int under jit")

    def test_errors(self):
        import adapters.jax as aj
        po, pl, so, sl = map(to_jax, make_inputs(4, 2, 16, "float32"))
        with pytest.raises(TypeError, match="output"):
            aj.merge_attn_states(po, pl, so, sl, output_dtype="float16")
        with pytest.raises(ValueError, match="output_scale"):
            aj.merge_attn_states(po, pl, so, sl, output_scale=[1.0, 2.0])
        with pytest.raises(ValueError, match="output_scale"):
            aj.merge_attn_states(po, pl, so, sl, output_dtype="float8_e4m3fn")




@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scale", [None, 0.05])
def test_torch_and_jax_bitwise_equal(dtype, scale):
    po, pl, so, sl = special_inputs(dtype, n=21, h=4, d=72)
    t_out, t_lse = TestTorch().merge(po, pl, so, sl, ptwc=15, scale=scale)
    j_out, j_lse = TestJax().merge(po, pl, so, sl, ptwc=15, scale=scale, jit=True)
    assert_bitwise_equal(t_out, j_out, "output torch vs jax")
    assert_bitwise_equal(t_lse, j_lse, "output_lse torch vs jax")


# ------------------------------------------------------ mask_empty_context_lse
from core_kernels.merge_attn_states import mask_empty_context_lse_reference  # noqa: E402


def make_mask_case(query_lens, empty_ctx, h, pad=0, int_dtype="int32", seed=None):
    """lse [H, T] (T = sum(query_lens) + pad, NaN in the padding tokens, which
    no request owns and which must stay NaN), query_start_loc, context_start_loc
    (context lengths random, 0 where ``empty_ctx``)."""
    g = rng(seed)
    qs = np.concatenate([[0], np.cumsum(query_lens)]).astype(int_dtype)
    ctx = np.where(empty_ctx, 0, g.integers(1, 50, len(query_lens)))
    cs = np.concatenate([[0], np.cumsum(ctx)]).astype(int_dtype)
    lse = (g.standard_normal((h, int(qs[-1]) + pad)) * 3).astype(np.float32)
    lse[:, int(qs[-1]):] = np.nan
    return lse, qs, cs


# (query lengths, empty context flags): vLLM's test case, one request (no search
# step), empty requests, every context empty / none empty, > 128 requests
MASK_CASES = {
    "vllm": ([2, 131, 1], [False, True, False]),
    "one-request": ([70], [True]),
    "empty-requests": ([0, 5, 0, 0, 140, 0, 3], [True, True, False, True, True, False, True]),
    "all-empty": ([3, 9, 1], [True, True, True]),
    "none-empty": ([3, 9, 1], [False, False, False]),
    "many": ([1 + (i * 7) % 5 for i in range(300)], [i % 3 == 0 for i in range(300)]),
}


class MaskEmptyContextTests:
    """mask_empty_context_lse, written once; a subclass per adapter implements
    ``mask`` (numpy in, numpy out)."""

    def mask(self, lse, qs, cs):
        raise NotImplementedError

    @pytest.mark.parametrize("int_dtype", ["int32", "int64"])
    @pytest.mark.parametrize("name", list(MASK_CASES))
    def test_matches_reference(self, name, int_dtype):
        lens, empty = MASK_CASES[name]
        lse, qs, cs = make_mask_case(lens, empty, 3, pad=5, int_dtype=int_dtype)
        out = self.mask(lse, qs, cs)
        ref = mask_empty_context_lse_reference(lse, qs, cs)
        assert_bitwise_equal(out, ref.astype(np.float32), f"{name}: lse")

    def test_vllm_case(self):
        """vLLM's own test: requests [0, 2) [2, 133) [133, 134), only the middle
        one with an empty context: exactly lse[:, 2:133] becomes -inf."""
        qs = np.array([0, 2, 133, 134], np.int32)
        cs = np.array([0, 4, 4, 7], np.int32)
        lse = rng().standard_normal((4, 134)).astype(np.float32)
        expected = lse.copy()
        expected[:, 2:133] = -np.inf
        assert_bitwise_equal(self.mask(lse, qs, cs), expected, "lse")

    def test_no_tokens_or_heads(self):
        qs = np.array([0, 0], np.int32)
        cs = np.array([0, 0], np.int32)
        for shape in ((0, 0), (3, 0), (0, 4)):
            lse = np.zeros(shape, np.float32)
            assert self.mask(lse, qs, cs).shape == shape

    @pytest.mark.parametrize("name,change", [
        ("lse", dict(lse=np.zeros((2, 5), np.float16))),
        ("lse", dict(lse=np.zeros((2, 5, 1), np.float32))),
        ("query_start_loc", dict(qs=np.array([0.0, 5.0], np.float32))),
        ("query_start_loc", dict(qs=np.array([0], np.int32))),
        ("context_start_loc", dict(cs=np.array([0, 1, 2], np.int32))),
        ("context_start_loc", dict(cs=np.array([[0, 1]], np.int32))),
    ])
    def test_errors_name_the_argument(self, name, change):
        args = dict(lse=np.zeros((2, 5), np.float32), qs=np.array([0, 5], np.int32),
                    cs=np.array([0, 0], np.int32))
        args.update(change)
        with pytest.raises((ValueError, TypeError), match=name):
            self.mask(args["lse"], args["qs"], args["cs"])


class TestMaskTorch(TorchAdapter, MaskEmptyContextTests):
    def mask(self, lse, qs, cs):
        t = to_torch(lse)
        at.mask_empty_context_lse(t, to_torch(qs), to_torch(cs))
        return torch_to_numpy(t)

    def test_strided_lse(self):
        """lse as an [H, T] view of [T, H] storage (and of a wider row)."""
        lse, qs, cs = make_mask_case(*MASK_CASES["empty-requests"], 5, pad=3)
        ref = mask_empty_context_lse_reference(lse, qs, cs).astype(np.float32)
        store = torch.full((lse.shape[1], 8), float("nan"), device=DEVICE)
        view = store[:, 1:6].t()
        view.copy_(to_torch(lse))
        at.mask_empty_context_lse(view, to_torch(qs), to_torch(cs))
        assert_bitwise_equal(torch_to_numpy(view), ref, "strided lse")
        assert torch.isnan(store[:, [0, 6, 7]]).all(), "columns outside the view were written"

    def test_compile_fullgraph_and_version(self):
        lse, qs, cs = make_mask_case(*MASK_CASES["vllm"], 2)
        t, q, c = map(to_torch, (lse, qs, cs))
        version = t._version
        at.mask_empty_context_lse(t, q, c)
        assert t._version > version, "in-place write must bump the version counter"

        def f(x, q, c):
            y = x.clone()
            at.mask_empty_context_lse(y, q, c)
            return y + 1
        backend = "inductor" if GPU else "aot_eager"
        out = torch.compile(f, fullgraph=True, backend=backend)(to_torch(lse), q, c)
        ref = mask_empty_context_lse_reference(lse, qs, cs).astype(np.float32) + 1
        assert_bitwise_equal(torch_to_numpy(out), ref, "compiled")


class TestMaskJax(JaxAdapter, MaskEmptyContextTests):
    def mask(self, lse, qs, cs):
        import adapters.jax as aj
        from harness import jax_to_numpy
        return jax_to_numpy(aj.mask_empty_context_lse(*map(to_jax, (lse, qs, cs))))

    def test_jit_donated(self):
        import jax
        import adapters.jax as aj
        from harness import jax_to_numpy
        lse, qs, cs = make_mask_case(*MASK_CASES["many"], 4, pad=2)
        f = jax.jit(aj.mask_empty_context_lse, donate_argnums=(0,))
        out = f(*map(to_jax, (lse, qs, cs)))
        ref = mask_empty_context_lse_reference(lse, qs, cs).astype(np.float32)
        assert_bitwise_equal(jax_to_numpy(out), ref, "jitted, donated")


@pytest.mark.parametrize("n, h, d, dtype, tile, warps, load_first, head_major", [
    # 16-bit: one row per one-warp program to 2^14 elements, 512/2 load_first to 2^23, then
    # 2048/2 with a tile's rows along the tokens of one head (unless N is under a tile's rows)
    (1, 32, 128, "bfloat16", 128, 1, True, False), (1, 128, 128, "float16", 128, 1, True, False),
    (1, 129, 128, "bfloat16", 512, 2, True, False), (64, 32, 128, "bfloat16", 512, 2, True, False),
    (1, 128, 512, "bfloat16", 512, 2, True, False), (2048, 32, 128, "float16", 512, 2, True, False),
    (2049, 32, 128, "bfloat16", 2048, 2, False, True), (4096, 32, 128, "float16", 2048, 2, False, True),
    (16384, 32, 128, "bfloat16", 2048, 2, False, True), (16383, 7, 72, "float16", 2048, 2, False, True),
    (15, 8192, 128, "bfloat16", 2048, 2, False, False), (16, 8192, 128, "bfloat16", 2048, 2, False, True),
    # fp32: one row per warp to 2^18, 512/2 load_first to 2^20, then 512/2
    (64, 32, 128, "float32", 128, 1, True, False), (65, 32, 128, "float32", 512, 2, True, False),
    (64, 128, 128, "float32", 512, 2, True, False), (256, 32, 100, "float32", 512, 2, True, False),
    (257, 32, 128, "float32", 512, 2, False, False), (16384, 32, 128, "float32", 512, 2, False, False)])
def test_merge_tiling_rule(n, h, d, dtype, tile, warps, load_first, head_major):
    """The planner's measured rule (the NOTE above TILINGS in plan.py), by
    elements N x H x padded D, written out case by case."""
    from core_kernels._plan import ArrayInfo
    from core_kernels._target import Target
    o, lse = ArrayInfo.contiguous((n, h, d), dtype), ArrayInfo.contiguous((h, n), "float32")
    (launch,) = plan_merge_attn_states(Target("cuda", 90, 132), o, lse, o, lse).launches
    block_d = 1 << (max(16, d) - 1).bit_length()
    rows = tile // block_d
    assert launch.num_warps == warps
    assert launch.constexprs["LOAD_FIRST"] is load_first
    assert launch.constexprs["HEAD_MAJOR"] is head_major
    if head_major:  # BLOCK_R tokens of one head per program
        block_r = min(rows, 1 << (n - 1).bit_length())
        assert launch.grid == (h * -(-n // block_r),)
    else:  # BLOCK_R (token, head) rows per program
        block_r = max(1, min(rows, 1 << (n * h - 1).bit_length()))
        assert launch.grid == (-(-n * h // block_r),)
    assert launch.constexprs["BLOCK_R"] == block_r

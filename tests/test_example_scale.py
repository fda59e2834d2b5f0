"""example_scale, the example op of ADDING_AN_OP.md: one test base class run for
each adapter against the float64 reference, the adapters bitwise equal, and the
composability its description gives (jax.vmap, torch.compile)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from core_kernels.example_scale import example_scale_reference
from harness import (FLOAT_DTYPES, JaxAdapter, TorchAdapter, assert_bitwise_equal, assert_close, cast, rng,
                     to_jax, to_torch, torch_to_numpy)

SHAPES = [(1, 1, 1), (7, 3, 16), (130, 4, 33)]


def make_x(shape, dtype, seed=0):
    return cast(rng(seed).standard_normal(shape), dtype)


def _autograd_example():
    return dict(x=to_torch(make_x((5, 2, 8), "float32")), scale=to_torch(np.array([1.5], np.float32)))


# the torch op's example for the generic autograd tests (tests/test_autograd_safety.py)
AUTOGRAD_EXAMPLES = {"example_scale": (_autograd_example, "x")}


class ExampleScaleTests:
    """Every test, written once; the subclasses say how to call the adapter."""

    @pytest.mark.parametrize("dtype", FLOAT_DTYPES)
    @pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-D{}".format(*s))
    def test_matches_reference(self, shape, dtype):
        x = make_x(shape, dtype)
        out = self.call(x, 0.75)
        assert out.shape == shape and out.dtype == x.dtype
        assert_close(out.astype(np.float64), example_scale_reference(x, 0.75), dtype, "out")

    def test_empty(self):
        assert self.call(make_x((0, 2, 4), "float32"), 2.0).shape == (0, 2, 4)

    @pytest.mark.parametrize("bad,error", [(0.0, ValueError), (float("nan"), ValueError), ("2", TypeError)])
    def test_refuses_bad_scale(self, bad, error):
        with pytest.raises(error, match="^scale: "):
            self.call(make_x((2, 2, 4), "float32"), bad)

    def test_refuses_wrong_rank(self):
        with pytest.raises(ValueError, match=r"^x: expected \[T, H, D\]"):
            self.call(make_x((2, 8), "float32"), 2.0)


class TestTorch(TorchAdapter, ExampleScaleTests):
    def call(self, x, scale):
        import adapters.torch as at
        return self.numpy(at.example_scale(self.array(x), scale))

    def test_compiles_to_one_op(self):
        import adapters.torch as at
        x = to_torch(make_x((7, 3, 16), "float32"))
        compiled = torch.compile(lambda t: at.example_scale(t, 1.5), fullgraph=True, backend="eager")
        assert torch.equal(compiled(x), at.example_scale(x, 1.5))


class TestJax(JaxAdapter, ExampleScaleTests):
    def call(self, x, scale):
        import adapters.jax as aj
        return self.numpy(aj.example_scale(self.array(x), scale))

    def test_vmap_is_the_per_example_calls(self):
        import jax

        import adapters.jax as aj
        xs = make_x((3, 7, 2, 16), "float32")
        got = np.asarray(jax.vmap(lambda x: aj.example_scale(x, 1.5))(to_jax(xs)))
        for v in range(3):
            assert_bitwise_equal(got[v], np.asarray(aj.example_scale(to_jax(xs[v]), 1.5)), f"example {v}")


def test_adapters_bitwise_equal():
    import adapters.jax as aj
    import adapters.torch as at
    x = make_x((33, 4, 24), "float16", seed=3)
    assert_bitwise_equal(torch_to_numpy(at.example_scale(to_torch(x), 1.25)),
                         np.asarray(aj.example_scale(to_jax(x), 1.25)), "torch vs jax")

"""Shared test helpers: run any op through either adapter from numpy inputs.

Each op's test module has one test base class holding every test, written
once, and one subclass per adapter (``TestTorch(TorchAdapter, <Op>Tests)``,
``TestJax(JaxAdapter, <Op>Tests)``) that implements the adapter-specific
calls: numpy inputs in, converted to the adapter's arrays on the test device,
numpy results out. So one test body checks both frameworks against the
float64 reference, and parity tests feed the same inputs to both subclasses.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
ADAPTERS = ["torch", "jax"]
# Triton's interpreter gives garbage for bf16 arithmetic and bf16 tl.dot (docs/testing.md):
# bf16 runs on the GPU only.
FLOAT_DTYPES = ["float32", "float16"] + (["bfloat16"] if GPU else [])
requires_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
                "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8}

# (atol, rtol) against the float64 reference, scaled to the output dtype's epsilon
TOL = {"float32": (2e-5, 2e-5), "float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2)}


def rng(seed=None):
    return np.random.default_rng(seed)


def np_dtype(name):
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float values to ``dtype`` (kept as that numpy/ml_dtypes dtype)."""
    return np.asarray(x).astype(np_dtype(dtype))


def to_torch(x: np.ndarray, device=DEVICE) -> torch.Tensor:
    x = np.asarray(x)
    name = x.dtype.name
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        bits = torch.from_numpy(x.view(np.uint16 if name == "bfloat16" else np.uint8).copy())
        return bits.view(TORCH_DTYPES[name]).to(device)
    return torch.from_numpy(x.copy()).to(device)


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    for name, tdt in TORCH_DTYPES.items():
        if t.dtype == tdt and name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            bits = t.contiguous().view(torch.uint16 if name == "bfloat16" else torch.uint8).numpy()
            return bits.view(np_dtype(name))
    return t.numpy()


def to_jax(x: np.ndarray):
    import jax.numpy as jnp
    return jnp.asarray(x)


def jax_to_numpy(x) -> np.ndarray:
    return np.asarray(x)


def poison_like(shape, dtype: str) -> np.ndarray:
    """NaN everywhere (0xFF for byte types): an unwritten element cannot pass."""
    if dtype.startswith("float8"):
        return np.full(shape, 0x7F, np.uint8).view(np_dtype(dtype))
    if dtype.startswith("int"):
        return np.full(shape, -12345, dtype)
    return np.full(shape, np.nan, np.float32).astype(np_dtype(dtype))


def assert_close(actual, expected, dtype: str, what: str = "", scale: float = 1.0,
                 extra_atol: float = 0.0):
    """NaN must be NaN exactly where expected; otherwise a dtype-scaled tolerance
    (plus ``extra_atol``, an error bound the caller derives for its case)."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    assert np.array_equal(nan_a, nan_e), \
        f"{what}: NaN at {np.argwhere(nan_a != nan_e)[:5].tolist()} (actual NaN={nan_a.sum()}, expected {nan_e.sum()})"
    inf_e = np.isinf(e)
    assert np.array_equal(a[inf_e], e[inf_e]), f"{what}: infinities differ"
    atol, rtol = TOL[dtype]
    fin = ~nan_e & ~inf_e
    err = np.abs(a[fin] - e[fin])
    bound = scale * (atol + rtol * np.abs(e[fin])) + extra_atol
    if err.size:
        worst = np.argmax(err - bound)
        assert np.all(err <= bound), \
            f"{what}: max error {err.max():.3g} exceeds tolerance (worst: got {a[fin][worst]}, want {e[fin][worst]})"


def tf32(a):
    """fp32 values as the H200's tensor cores read an fp32 ``tl.dot`` operand: tf32,
    the low 13 mantissa bits ignored (Triton 3.6 emits no rounding conversion for
    sm_90 wgmma). NaN stays NaN; other dtypes and None pass through."""
    if a is None or a.dtype != np.float32:
        return a
    cut = (a.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(np.isnan(a), a, cut)


def assert_matches_finite_differences(loss, args, want, eps=1e-6, rtol=1e-6, atol=1e-7):
    """Each of ``want`` (a reference's gradients of loss(*args), float64) equals
    the central finite difference of ``loss`` in every element of its argument."""
    for i, (x, w) in enumerate(zip(args, want)):
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[i][idx] += eps
            minus[i][idx] -= eps
            fd[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(w, fd, rtol=rtol, atol=atol, err_msg=f"argument {i}")


def assert_bitwise_equal(a, b, what=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    av = a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(f"u{a.dtype.itemsize}")
    bv = b.view(np.uint8) if b.dtype.itemsize == 1 else b.view(f"u{b.dtype.itemsize}")
    diff = np.argwhere(av != bv)
    assert diff.size == 0, f"{what}: {len(diff)} elements differ bitwise, first at {diff[:3].tolist()}"


# ------------------------------------------------------------ test base
class TorchAdapter:
    """Mixin for the torch subclass of an op's test base: arrays as torch tensors."""
    adapter = "torch"
    array = staticmethod(to_torch)
    numpy = staticmethod(torch_to_numpy)


class JaxAdapter:
    """Mixin for the JAX subclass of an op's test base: arrays as JAX arrays.

    ``CPU_SKIP``: test names (with their parameter ids) the subclass runs on the
    GPU only. NOTE: CI time (2 cores, the whole suite under 15 minutes): under the
    interpreter these repeat kernel coverage the torch class has at the same
    shapes, while the JAX plumbing stays covered by the class's other tests and
    the torch-vs-JAX bitwise tests."""
    adapter = "jax"
    array = staticmethod(to_jax)
    numpy = staticmethod(jax_to_numpy)
    CPU_SKIP: tuple = ()

    @pytest.fixture(autouse=True)
    def _cpu_skip(self, request):
        if not GPU and request.node.name in self.CPU_SKIP:
            pytest.skip("GPU only (the torch class covers it on the CPU)")

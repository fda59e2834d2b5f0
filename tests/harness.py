"""Shared test helpers: run any op through either adapter from numpy inputs.

Each op's test module has one test base class holding every test, written
once, and one subclass per adapter (``TestTorch(TorchAdapter, <Op>Tests)``,
``TestJax(JaxAdapter, <Op>Tests)``) that implements the adapter-specific
calls: numpy inputs in, converted to the adapter's arrays on the test device,
numpy results out. So one test body checks both frameworks against the
float64 reference, and parity tests feed the same inputs to both subclasses.
"""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch

from core_kernels._plan import FP8_MAX

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
ADAPTERS = ["torch", "jax"]
# bf16 runs on the CPU too: core_kernels._interpreter_bf16 makes the interpreter's
# bf16 dots and fp32 -> bf16 roundings those of the GPU (Triton 3.6's own give garbage).
FLOAT_DTYPES = ["float32", "float16", "bfloat16"]
requires_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
                "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8}

# (atol, rtol) against the float64 reference, scaled to the output dtype's epsilon
TOL = {"float32": (2e-5, 2e-5), "float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2)}


# Reproducible inputs: rng() without a seed draws from a stream derived from the
# running test's id (tests/conftest.py calls start_test) and TANDEM_TEST_SEED
# (default 0), so a failure replays by rerunning the same test id, and another
# TANDEM_TEST_SEED draws a fresh set of inputs for every test. A failing test's
# report names both (conftest.py).
_stream = {"seed": 0, "draws": 0}


def base_seed() -> int:
    return int(os.environ.get("TANDEM_TEST_SEED", "0"))


def seed_for(test_id: str) -> int:
    """The seed of a test's random inputs: its id and TANDEM_TEST_SEED, hashed."""
    return zlib.crc32(f"{base_seed()}:{test_id}".encode())


def start_test(seed: int) -> None:
    _stream["seed"], _stream["draws"] = seed, 0


def rng(seed=None):
    """A numpy Generator: ``seed`` as given, else the running test's next stream."""
    if seed is not None:
        return np.random.default_rng(seed)
    _stream["draws"] += 1
    return np.random.default_rng([_stream["seed"], _stream["draws"]])


def decay_rates(g, h, zero_head=True):
    """Per-head lightning decay rates that check long-range carries: head 0 a
    small non-zero rate in [0.01, 0.05] (its state lives for ~20-100 tokens, so a
    wrong exponent in a hand-off between segments or blocks shows), the others
    log-uniform in [1e-3, 1]; with ``zero_head`` and h >= 3 the last head has
    rate 0 (no decay: the state sums every token). A rate of exactly 0 alone
    would hide exponent bugs (its factor is 1 whatever the exponent)."""
    s = np.exp(g.uniform(np.log(1e-3), 0.0, h))
    s[0] = g.uniform(0.01, 0.05)
    if zero_head and h >= 3:
        s[-1] = 0.0
    return s.astype(np.float32)


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
    (plus ``extra_atol``, an error bound the caller derives for its case: a scalar or
    one per element)."""
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
    extra = np.broadcast_to(np.asarray(extra_atol, np.float64), e.shape)[fin]  # a scalar or per element
    bound = scale * (atol + rtol * np.abs(e[fin])) + extra
    if err.size:
        worst = np.argmax(err - bound)
        assert np.all(err <= bound), \
            f"{what}: max error {err.max():.3g} exceeds tolerance (worst: got {a[fin][worst]}, want {e[fin][worst]})"


def fp8_ordinal(bits: np.ndarray) -> np.ndarray:
    """A monotone integer index of fp8 values (sign-magnitude bits -> ordered ints)."""
    b = np.asarray(bits).view(np.uint8).astype(np.int32)
    return np.where(b & 0x80, -(b & 0x7F), b & 0x7F)


def assert_within_one_fp8_step(out8, exact, what="", atol=0.0):
    """Each fp8 output is ``exact`` (float64, already divided by the output scale)
    clamped and rounded to the format, or a neighbouring code: the kernel's fp32
    value may sit across a rounding boundary from the exact one. In the normal
    range one step is 1/8 (e4m3) of the value, in the subnormal range a fixed
    quantum (2^-9 for e4m3). ``atol``: an error bound of the caller's inputs
    (magnified by 1/scale) that an element may use instead."""
    out8 = np.asarray(out8)
    fmt = out8.dtype.name
    lim = FP8_MAX[fmt]
    e = np.clip(np.asarray(exact, np.float64), -lim, lim)
    want = e.astype(np.float32).astype(np_dtype(fmt))
    steps = np.abs(fp8_ordinal(out8) - fp8_ordinal(want))
    ok = (steps <= 1) | (np.abs(out8.astype(np.float64) - e) <= atol)
    nan = np.isnan(e)
    ok = np.where(nan, np.isnan(out8.astype(np.float32)), ok)
    if not ok.all():
        i = np.argwhere(~ok)[0]
        raise AssertionError(f"{what}: {int((~ok).sum())} fp8 outputs more than one step from the rounded "
                             f"reference (first at {i.tolist()}: got {out8[tuple(i)]}, exact {e[tuple(i)]:.6g}, "
                             f"{int(steps[tuple(i)])} steps)")


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

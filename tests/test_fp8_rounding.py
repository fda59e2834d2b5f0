"""The fp8 rounding helper (core_kernels._triton_utils.round_to_fp8_grid), run
exhaustively: every e4m3fn and e5m2 code, every midpoint between neighbouring
codes (ties to even) and its fp32 neighbours on either side, subnormals,
underflow to zero, saturation and NaN, against ml_dtypes' cast of the clamped
value (cross-checked against torch's cast), and the same values stored through
an fp8 pointer, as the merge and prefix kernels store their fp8 outputs."""
import ml_dtypes
import numpy as np
import pytest
import torch

import core_kernels  # noqa: F401,I001  (selects the interpreter before triton.language loads)
import triton
import triton.language as tl

from core_kernels._plan import FP8_MAX
from core_kernels._triton_utils import FP8_ROUNDING, round_to_fp8_grid
from harness import DEVICE, GPU, assert_bitwise_equal, rng

FORMATS = ["float8_e4m3fn", "float8_e5m2"]
ML = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
TORCH = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
BLOCK = 1024


@triton.jit
def _round_kernel(x_ptr, n, y_ptr, y8_ptr, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr,
                  MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr, BLOCK: tl.constexpr):
    # the fp8-output epilogue of the merge and prefix kernels: clamp, round, store
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m, other=0.0)
    x = tl.clamp(x, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    y = round_to_fp8_grid(x, MANT_BITS, MIN_NORMAL, MAGIC)
    tl.store(y_ptr + o, y, mask=m)
    tl.store(y8_ptr + o, y.to(y8_ptr.dtype.element_ty), mask=m)


def run_helper(x: np.ndarray, fmt: str):
    """(fp32 rounded values, fp8 stored values) of the kernel epilogue on ``x``."""
    xt = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(DEVICE)
    y = torch.full_like(xt, float("nan"))
    y8 = torch.full(xt.shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(TORCH[fmt])
    _round_kernel[(triton.cdiv(len(x), BLOCK),)](xt, len(x), y, y8, FP8_MAX[fmt], *FP8_ROUNDING[fmt],
                                                 BLOCK=BLOCK)
    return y.cpu().numpy(), y8.cpu().view(torch.uint8).numpy()


def all_codes(fmt):
    """Every finite value of the format, ascending (each once; -0 and +0 both)."""
    v = np.arange(256, dtype=np.uint8).view(ML[fmt]).astype(np.float32)
    v = v[np.isfinite(v)]
    return np.unique(v)  # -0.0 == 0.0: unique keeps one zero; add the other below


def probe_values(fmt):
    """Codes, midpoints (exact in fp32), midpoints +- one fp32 ulp, past-max and tiny values."""
    codes = all_codes(fmt)
    mids = (codes[:-1].astype(np.float64) + codes[1:]) / 2
    mids = mids.astype(np.float32)
    assert np.all(mids.astype(np.float64) == (codes[:-1].astype(np.float64) + codes[1:]) / 2)
    up = np.nextafter(mids, np.float32(np.inf))
    down = np.nextafter(mids, np.float32(-np.inf))
    fmax = FP8_MAX[fmt]
    tiny = np.float32(np.min(codes[codes > 0]))  # the smallest subnormal
    extra = np.array([0.0, -0.0, tiny / 2, -tiny / 2, tiny / 4, np.nextafter(tiny / 2, 1),
                      fmax * 1.01, -fmax * 1.01, fmax * 1e6, 3.0e38, np.inf, -np.inf,
                      np.float32(1.0e-30), -np.float32(1.0e-30)], np.float32)
    g = rng()
    rand = (g.standard_normal(4096) * np.exp2(g.uniform(-22, np.log2(fmax) + 2, 4096))).astype(np.float32)
    return np.concatenate([codes, mids, up, down, extra, rand]).astype(np.float32)


def reference_bits(x: np.ndarray, fmt: str) -> np.ndarray:
    """fp8 bits of clamp(x, -max, max) rounded to nearest even: ml_dtypes' cast."""
    c = np.clip(x.astype(np.float32), -FP8_MAX[fmt], FP8_MAX[fmt])
    return c.astype(ML[fmt]).view(np.uint8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_casts_agree(fmt):
    """The two independent casts the tests rely on agree on every probe value."""
    x = probe_values(fmt)
    c = np.clip(x, -FP8_MAX[fmt], FP8_MAX[fmt])
    t = torch.from_numpy(c).to(TORCH[fmt]).view(torch.uint8).numpy()
    assert_bitwise_equal(t, reference_bits(x, fmt), "torch vs ml_dtypes cast")


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_midpoint_and_neighbour(fmt):
    x = probe_values(fmt)
    want = reference_bits(x, fmt)
    y, y8 = run_helper(x, fmt)
    # the fp32 value the helper returns is exactly an fp8 value: the one ml_dtypes picks
    assert_bitwise_equal(np.asarray(y, np.float32).astype(ML[fmt]).view(np.uint8), want, "rounded value")
    got = want.view(ML[fmt]).astype(np.float32)
    bad = np.nonzero(y.view(np.uint32) != got.view(np.uint32))[0]
    assert bad.size == 0, (f"{bad.size} values round wrongly, e.g. {x[bad[:4]].tolist()} -> "
                           f"{y[bad[:4]].tolist()}, want {got[bad[:4]].tolist()}")
    # and the store through an fp8 pointer keeps it exactly
    assert_bitwise_equal(y8, want, "stored fp8 bits")


@pytest.mark.parametrize("fmt", FORMATS)
def test_subnormals_and_ties(fmt):
    """Every subnormal code and every tie between subnormals, named apart from the
    sweep above so that a failure says which region broke."""
    mant = FP8_ROUNDING[fmt][0]
    min_normal = FP8_ROUNDING[fmt][1]
    step = min_normal / 2 ** mant                    # the subnormal quantum
    k = np.arange(0, 2 ** mant + 1)                  # 0 .. min_normal in subnormal steps
    sub = (k * step).astype(np.float32)
    ties = ((k[:-1] + 0.5) * step).astype(np.float32)
    x = np.concatenate([sub, -sub, ties, -ties])
    y, y8 = run_helper(x, fmt)
    want = reference_bits(x, fmt)
    assert_bitwise_equal(y8, want, "subnormal fp8 bits")
    # ties go to the even code: (k + 0.5) steps -> k or k + 1, whichever is even
    even = np.where(k[:-1] % 2 == 0, k[:-1], k[:-1] + 1) * step
    np.testing.assert_array_equal(np.abs(y[2 * len(sub):2 * len(sub) + len(ties)]), even.astype(np.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_propagates_and_saturation(fmt):
    x = np.array([np.nan, -np.nan, np.inf, -np.inf, 1e30, -1e30], np.float32)
    y, y8 = run_helper(x, fmt)
    assert np.isnan(y[:2]).all(), f"NaN must stay NaN, got {y[:2]}"
    np.testing.assert_array_equal(y[2:], np.array([1, -1, 1, -1], np.float32) * FP8_MAX[fmt])
    assert_bitwise_equal(y8[2:], reference_bits(x[2:], fmt), "saturated fp8 bits")
    if GPU:  # the interpreter's fp32 -> fp8 conversion turns NaN into 0x7C (tests/test_properties.py)
        assert np.isnan(y8[:2].view(ML[fmt]).astype(np.float32)).all()


"""The package's kernel decorator and @triton.jit helpers shared by several ops."""
import inspect

import triton
import triton.language as tl


def _runtime_ints(fn):
    """Every runtime integer parameter: not a constexpr, not a pointer (``*_ptr``)."""
    return [name for name, p in inspect.signature(fn).parameters.items()
            if not name.endswith("_ptr") and "constexpr" not in str(p.annotation)]


def jit(fn=None, *, gluon: bool = False):
    """``triton.jit`` (or ``gluon.jit``) with the package's integer policy.

    The policy, the same for both launchers: a runtime integer parameter is
    never specialised on divisibility by 16 (jax-triton cannot, torch's
    launcher would), only on being equal to 1 (both do). Kernels compiled from
    different knowledge differ in code and, through FMA contraction, in the
    last bit (seen on the H200: torch and JAX decode outputs; JAX loads without
    16-byte vectors ran 1.2-8x slower). Where the compiler must know a
    runtime integer's alignment, the plan puts it in an alignment group
    (``Scalar(value, align="ALIGN")``): the value arrives divided by the
    group's power of two, which arrives as the constexpr of that name, and the
    kernel multiplies it back. Values fixed for a model's layout may instead be
    constexprs. Pointer parameters end in ``_ptr``; the plan's launch check
    relies on that and on this decorator (see core_kernels._plan.Launch).
    """
    def wrap(f):
        if gluon:
            from triton.experimental import gluon as gluon_mod
            return gluon_mod.jit(f, do_not_specialize_on_alignment=_runtime_ints(f))
        return triton.jit(f, do_not_specialize_on_alignment=_runtime_ints(f))
    return wrap if fn is None else wrap(fn)


@triton.jit
def round_to_fp8_grid(x, MANT_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
                      SUBNORMAL_MAGIC: tl.constexpr):
    """Round fp32 ``x`` (already clamped to the fp8 range) to the nearest fp8
    value, ties to even, returned as an fp32 that the final cast converts exactly.

    NOTE: Triton 3.6's interpreter converts fp32 -> fp8 wrongly when rounding
    carries into the exponent (31.6 -> 16 instead of 32, seen on CPU). Rounding
    first keeps the interpreter and the GPU bit-identical, and equal to
    clamp-then-cast in torch/JAX; it costs a few integer ops in memory-bound code.
    """
    bits = x.to(tl.int32, bitcast=True)
    SHIFT: tl.constexpr = 23 - MANT_BITS
    lsb = (bits >> SHIFT) & 1
    normal = ((bits + ((1 << (SHIFT - 1)) - 1) + lsb) & (-(1 << SHIFT))).to(tl.float32, bitcast=True)
    # subnormals: adding 2**k rounds to its ulp (the fp8 subnormal quantum), ties to even
    sub = (tl.abs(x) + SUBNORMAL_MAGIC) - SUBNORMAL_MAGIC
    sub = (sub.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    # NaN stays NaN: the GPU's canonical NaN (0x7FFFFFFF) would carry into the sign
    # bit above and come out as -0 (found by tests/test_properties.py on the H200)
    return tl.where(x == x, tl.where(tl.abs(x) < MIN_NORMAL, sub, normal), x)


# (MANT_BITS, MIN_NORMAL, SUBNORMAL_MAGIC) per fp8 format: the magic number's
# fp32 ulp equals the format's subnormal step (2**-9 for e4m3, 2**-16 for e5m2).
FP8_ROUNDING = {
    "float8_e4m3fn": (3, 2.0 ** -6, 2.0 ** 14),
    "float8_e5m2": (2, 2.0 ** -14, 2.0 ** 7),
}

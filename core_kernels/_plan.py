"""Framework-free launch plans shared by every op and both adapters.

A planner (``plan_<op>``) receives an :class:`ArrayInfo` per array argument
(shape, dtype name, strides in elements) plus the op's options, validates them,
and returns a :class:`Plan`: the buffers to allocate and an ordered list of
:class:`Launch` es over named buffers. The adapters only execute plans, so the
two frameworks can never disagree on grids, scalars or constexprs.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any, Sequence

import numpy as np

# Dtype names are numpy / ml_dtypes spellings; both adapters map to them.
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
INT_DTYPES = ("int32", "int64")
ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1, "int8": 1,
    "int32": 4, "int64": 8, "bool": 1,
}
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """What a planner may know about an array argument."""
    shape: tuple[int, ...]
    dtype: str
    strides: tuple[int, ...]  # in elements

    @staticmethod
    def contiguous(shape: Sequence[int], dtype: str) -> "ArrayInfo":
        shape = tuple(int(s) for s in shape)
        return ArrayInfo(shape, dtype, row_major_strides(shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A buffer the executor allocates (an output or scratch space)."""
    shape: tuple[int, ...]
    dtype: str
    zero_init: bool = False  # executor fills with zeros before the first launch
    # no launch reads or writes it: it stands in for a pointer the launches leave
    # alone (an executor may pass any tensor of the dtype, e.g. one shared one)
    placeholder: bool = False
    # scratch that no result names and no call reads from an earlier call: what
    # the launches leave in it is dead, except that a zero_init buffer is all
    # zero again when the launches end (they restore it). An executor may keep
    # one allocation per device and stream for every call of every plan
    # (calls on one stream run in order), allocated and zeroed once.
    per_stream: bool = False


@dataclasses.dataclass(frozen=True)
class Scalar:
    """A scalar kernel argument; kind is 'i32', 'i64' or 'fp32'.

    A ``str`` value names a runtime value that the adapter supplies at each
    call (so a plan can be cached while that value changes). ``align`` names
    the alignment group (a constexpr of the kernel) of a plan-time integer:
    see :class:`Launch` and core_kernels._triton_utils.jit.
    """
    value: Any
    kind: str = "i32"
    align: str | None = None


def kernel_signature(kernel) -> list:
    """[(parameter name, is constexpr, never specialised on alignment)] of a
    @triton.jit / gluon.jit kernel, compiled or interpreted."""
    fn = kernel.fn
    no_align = getattr(kernel, "do_not_specialize_on_alignment", None)
    if no_align is None:  # an InterpretedFunction keeps the decorator's arguments
        no_align = getattr(kernel, "kwargs", {}).get("do_not_specialize_on_alignment") or ()
    names = list(inspect.signature(fn).parameters)
    no_align = {names[i] if isinstance(i, int) else i for i in no_align}
    return [(n, "constexpr" in str(p.annotation), n in no_align)
            for n, p in inspect.signature(fn).parameters.items()]


ALIGN_MAX = 16  # bytes of the widest vector access; more alignment buys nothing


def pow2_divisor(*values: int) -> int:
    """The largest power of two <= ALIGN_MAX dividing every value (0 divides by any)."""
    a = ALIGN_MAX
    while a > 1 and any(int(v) % a for v in values):
        a //= 2
    return a


@dataclasses.dataclass(frozen=True, eq=False)
class Launch:
    """One kernel launch, its arguments by the kernel's parameter names.

    ``params`` maps every runtime parameter of the kernel to a buffer name
    (parameters named ``*_ptr``) or a :class:`Scalar`; ``writes`` names the
    pointer parameters whose buffers the launch writes; ``constexprs`` gives
    every constexpr parameter. Checked against the kernel's signature here,
    when the plan is built, so an argument cannot land in the wrong position.

    Integers in an alignment group (``Scalar(v, align=G)``) are passed divided
    by the group's :func:`pow2_divisor`, which becomes constexpr ``G``.

    The executors read the resolved fields: ``args`` (buffer names or Scalars
    of the parameters read, in signature order), ``outputs`` (buffer names of
    the written parameters, which come last: jax-triton passes outputs after
    every input), and ``constexprs``. A buffer in both ``args`` and ``outputs``
    is updated in place (the JAX executor aliases it); any other output is
    written in full by this launch (or was zero-initialised).
    """
    kernel: Any
    grid: tuple[int, ...]
    params: dict
    writes: tuple[str, ...]
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 2
    args: tuple = dataclasses.field(init=False)
    outputs: tuple = dataclasses.field(init=False)

    def __post_init__(self):
        name = getattr(getattr(self.kernel, "fn", None), "__name__", repr(self.kernel))
        sig = kernel_signature(self.kernel)
        runtime = [n for n, const, _ in sig if not const]
        consts = {n for n, const, _ in sig if const}
        params, writes = dict(self.params), tuple(self.writes)
        unknown = set(params) - set(runtime)
        missing = [n for n in runtime if n not in params]
        if unknown or missing:
            raise TypeError(f"{name}: launch arguments do not match the kernel's runtime parameters "
                            f"(unknown {sorted(unknown)}, missing {missing})")
        for n, value in params.items():
            if n.endswith("_ptr") != isinstance(value, str):
                raise TypeError(f"{name}: parameter {n} takes "
                                f"{'a buffer name' if n.endswith('_ptr') else 'a Scalar'}, got {value!r}")
        for n, _, no_align in sig:
            if n in params and not n.endswith("_ptr") and not no_align:
                raise TypeError(f"{name}: integer parameter {n} may be specialised on alignment; "
                                "decorate the kernel with core_kernels._triton_utils.jit")
        if set(writes) - {n for n in runtime if n.endswith("_ptr")}:
            raise TypeError(f"{name}: writes {sorted(set(writes) - set(runtime))} are not pointer parameters")
        if runtime[len(runtime) - len(writes):] != list(writes):
            raise TypeError(f"{name}: written parameters {list(writes)} must be the kernel's last "
                            f"runtime parameters, in order (its runtime parameters: {runtime})")
        # alignment groups: plan-time integers divided by their group's power of two
        groups: dict = {}
        for n, value in params.items():
            if isinstance(value, Scalar) and value.align is not None:
                if isinstance(value.value, str):
                    raise TypeError(f"{name}: runtime value {value.value!r} ({n}) cannot be in an "
                                    "alignment group")
                groups.setdefault(value.align, []).append(int(value.value))
        constexprs = dict(self.constexprs)
        for g, values in groups.items():
            if g not in consts or g in constexprs:
                raise TypeError(f"{name}: alignment group {g} must be a constexpr parameter that the "
                                "plan does not set itself")
            constexprs[g] = pow2_divisor(*values)
        for n, value in params.items():
            if isinstance(value, Scalar) and value.align is not None:
                params[n] = Scalar(int(value.value) // constexprs[value.align], value.kind)
        if set(constexprs) != consts:
            raise TypeError(f"{name}: constexprs do not match the kernel's (unknown "
                            f"{sorted(set(constexprs) - consts)}, missing {sorted(consts - set(constexprs))})")
        n_in = len(runtime) - len(writes)
        object.__setattr__(self, "args", tuple(params[n] for n in runtime[:n_in]))
        object.__setattr__(self, "outputs", tuple(params[n] for n in writes))
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "writes", writes)
        object.__setattr__(self, "constexprs", constexprs)
        object.__setattr__(self, "grid", tuple(int(g) for g in self.grid))


@dataclasses.dataclass(frozen=True)
class Plan:
    """Buffers to create, launches to run, and what the op returns.

    ``buffers`` maps names to new allocations. Names that are not in
    ``buffers`` are the op's array arguments, passed by the adapter.
    ``results`` are the names the functional (JAX) API returns, in order; an
    in-place (torch) API writes them into its arguments or returns them.
    """
    buffers: dict
    launches: tuple
    results: tuple[str, ...]

    def __hash__(self):
        return id(self)


# ---------------------------------------------------------------- helpers
def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(strides))


def next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_dtype(name: str, info: ArrayInfo, allowed: Sequence[str]) -> None:
    if info.dtype not in allowed:
        raise TypeError(f"{name}: dtype {info.dtype} is not supported; expected one of {tuple(allowed)}")


def check_shape(name: str, info: ArrayInfo, shape: Sequence[int], what: str = "") -> None:
    if tuple(info.shape) != tuple(shape):
        extra = f" ({what})" if what else ""
        raise ValueError(f"{name}: expected shape {tuple(shape)}{extra}, got {tuple(info.shape)}")


def check_ndim(name: str, info: ArrayInfo, ndim: int, layout: str) -> None:
    if info.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions {layout}, got shape {tuple(info.shape)}")


def check_inner_contiguous(name: str, info: ArrayInfo) -> None:
    if info.ndim and info.shape[-1] > 1 and info.strides[-1] != 1 and math.prod(info.shape):
        raise ValueError(f"{name}: the innermost dimension must be contiguous (stride 1), "
                         f"got strides {tuple(info.strides)}")


# ---------------------------------------------------------------- scalar arguments
# The scalar policy of every op and both adapters (docs/scalar_policy.md): host
# numbers are checked here, by name, before any launch; arrays and tensors that a
# kernel reads (scales, counts) are device data and are never read on the host.
INT32_MAX = 2 ** 31 - 1
INT64_MAX = 2 ** 63 - 1
FP32_MAX = float(np.finfo(np.float32).max)


def _is_bool(value) -> bool:
    return isinstance(value, (bool, np.bool_)) or "bool" in str(getattr(value, "dtype", ""))


def as_int(name: str, value, lo: int | None = None, hi: int = INT64_MAX, what: str = "") -> int:
    """``value`` as a Python int, checked: a Python or numpy integer, or a 0-d
    integer array / tensor (read on the host); never a bool or a float (2.5 and
    2.0 alike: no silent rounding). TypeError for the wrong type, ValueError
    outside [lo, hi] (``hi`` defaults to int64's largest value; pass INT32_MAX
    where a kernel holds the value in int32). ``what`` names the bound in messages."""
    if type(value) is int and (lo is None or value >= lo) and value <= hi:
        return value  # the usual case, first: this runs on every call of an op
    if _is_bool(value):
        raise TypeError(f"{name}: expected an int, got the bool {value!r}")
    try:
        v = int(value.__index__()) if not isinstance(value, int) else int(value)
    except (AttributeError, TypeError, ValueError) as e:  # floats, strings, traced values, ...
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}"
                        + (f" ({e})" if str(e) and not isinstance(e, AttributeError) else "")) from None
    if (lo is not None and v < lo) or v > hi:
        bound = f"in [{lo}, {hi}]" if lo is not None else f"<= {hi}"
        raise ValueError(f"{name}: expected an int {bound}{f' ({what})' if what else ''}, got {v}")
    return v


def as_float(name: str, value, *, finite: bool = True, positive: bool = False) -> float:
    """``value`` as a Python float, checked: a Python or numpy number, or a 0-d /
    1-element array or tensor (read on the host); never a bool or a string.
    ``finite``: NaN, +-inf and values beyond float32's range (kernels take fp32
    scalars) raise ValueError; ``positive``: so do values <= 0."""
    if _is_bool(value) or isinstance(value, (str, bytes)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
    try:
        v = float(value)
    except OverflowError:
        v = math.inf if value > 0 else -math.inf
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: expected a float, got {type(value).__name__} ({e})") from None
    if finite and not (math.isfinite(v) and abs(v) <= FP32_MAX):
        raise ValueError(f"{name}: expected a finite float32 value, got {v}")
    if positive and not v > 0:
        raise ValueError(f"{name}: expected a value > 0, got {v}")
    return v


def check_scalar_array(name: str, info: ArrayInfo, dtypes: Sequence[str]) -> None:
    """A scalar passed as device data: one element (0-d or any shape of size 1)
    of one of ``dtypes``. Its value is never read on the host."""
    if math.prod(info.shape) != 1 or info.dtype not in dtypes:
        raise (TypeError if math.prod(info.shape) == 1 else ValueError)(
            f"{name}: expected a 1-element {' or '.join(dtypes)} array, got shape "
            f"{tuple(info.shape)} dtype {info.dtype}")


def normalize_dtype_name(dtype: Any) -> str:
    """'torch.float16', np.float16, jnp.bfloat16 ... -> 'float16'."""
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    if name.startswith("<class"):
        name = np.dtype(dtype).name
    return name


def memoize(fn):
    """Cache a planner on its (hashable) arguments: repeated calls with the
    same shapes cost one dict lookup, which keeps host overhead low."""
    return functools.lru_cache(maxsize=4096)(fn)


# ---------------------------------------------------------------- configs
# A planner chooses a config (a frozen dataclass per kernel variant) from its
# measured tables; ``config=`` overrides the choice. Config classes register
# here so that an adapter can carry one through a string (torch.library custom
# ops take no arbitrary objects).
CONFIGS: dict = {}


def config_class(cls):
    """Register a frozen dataclass as a config type (decorator)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    CONFIGS[cls.__name__] = cls
    return cls


def encode_config(config) -> str | None:
    """A config as a string (None stays None); ``decode_config`` inverts it."""
    if config is None:
        return None
    if type(config).__name__ not in CONFIGS or CONFIGS[type(config).__name__] is not type(config):
        raise TypeError(f"config: expected one of the config types {sorted(CONFIGS)}, "
                        f"got {type(config).__name__}")
    return repr((type(config).__name__, dataclasses.astuple(config)))


@functools.lru_cache(maxsize=256)
def decode_config(text: str | None):
    if text is None:
        return None
    import ast
    name, values = ast.literal_eval(text)
    return CONFIGS[name](*values)


def check_config(config, allowed: tuple) -> None:
    """``config`` is None or an instance of one of ``allowed`` (clear error otherwise)."""
    if config is not None and not isinstance(config, allowed):
        raise TypeError(f"config: expected {' or '.join(c.__name__ for c in allowed)}, "
                        f"got {type(config).__name__}")

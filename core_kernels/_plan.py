"""Framework-free launch plans shared by every op and both adapters.

A planner (``plan_<op>``) receives an :class:`ArrayInfo` per array argument
(shape, dtype name, strides in elements) plus the op's options, validates them,
and returns a :class:`Plan`: the buffers to allocate and an ordered list of
:class:`Launch` es over named buffers. The adapters only execute plans, so the
two frameworks can never disagree on grids, scalars or constexprs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
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


@dataclasses.dataclass(frozen=True)
class Scalar:
    """A scalar kernel argument; kind is 'i32', 'i64' or 'fp32'.

    A ``str`` value names a runtime value that the adapter supplies at each
    call (so a plan can be cached while that value changes).
    """
    value: Any
    kind: str = "i32"


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch.

    The kernel's parameters are ``args`` (buffer names or Scalars, in order),
    then ``outputs`` (names of buffers this launch writes), then the
    constexprs. A name in ``outputs`` that also appears in ``args`` is updated
    in place (the JAX executor aliases it); any other output is written in
    full by this launch (or was zero-initialised).
    """
    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    outputs: tuple[str, ...]
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 2

    def __hash__(self):  # dict field: hash by identity, plans are cached by key
        return id(self)


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


def normalize_dtype_name(dtype: Any) -> str:
    """'torch.float16', np.float16, jnp.bfloat16 ... -> 'float16'."""
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch."):]
    if name.startswith("<class"):
        name = np.dtype(dtype).name
    return name


def interpret_requested() -> bool:
    """True when the user asked for Triton's interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Planner settings forced for a block of code (tests, benchmarks), e.g.
# prefix_prefill.tile_config. A planner that reads one passes the value into its
# memoized part; a cache kept above the planners (the torch adapter's
# planned()) keys on settings_key() so that it never hands out a plan made
# under other settings.
_SETTINGS: dict = {}


@contextlib.contextmanager
def forced_setting(name: str, value):
    """Force planner setting ``name`` (a hashable value) inside the block."""
    missing = name not in _SETTINGS
    saved = _SETTINGS.get(name)
    _SETTINGS[name] = value
    try:
        yield
    finally:
        if missing:
            del _SETTINGS[name]
        else:
            _SETTINGS[name] = saved


def setting(name: str, default=None):
    """The forced value of planner setting ``name``, or ``default``."""
    return _SETTINGS.get(name, default)


def settings_key() -> tuple:
    """Every forced setting, for the keys of caches kept above the planners."""
    return tuple(sorted(_SETTINGS.items())) if _SETTINGS else ()


def memoize(fn):
    """Cache a planner on its (hashable) arguments: repeated calls with the
    same shapes cost one dict lookup, which keeps host overhead low."""
    return functools.lru_cache(maxsize=4096)(fn)

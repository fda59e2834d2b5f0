"""Run plans under Triton's interpreter on host numpy arrays (no framework).

Used by the JAX adapter on machines without a GPU (through a host callback);
the torch adapter hands CPU tensors to the interpreter directly. Both use
``interpreted`` so they run the very same kernel source.
"""
from __future__ import annotations

import threading
import types

import numpy as np

from ._plan import Plan, Scalar

_INTERPRETED = {}

# NOTE: Triton's interpreter is not thread-safe: a launch patches triton.language's
# functions for the kernel's duration and restores them after, process-wide. Two
# launches at once (XLA runs the host callbacks of shard_map's shards in parallel,
# or user threads) break each other ("Did you forget to add @triton.jit ?") or
# compute with the other's state. Every interpreted launch holds this lock.
INTERPRETER_LOCK = threading.RLock()


def interpreted(kernel):
    """The interpreter's version of a @triton.jit kernel (cached).

    Kernels are compiled for the GPU when TRITON_INTERPRET is unset, so the
    interpreted copy runs over a copy of the module's globals in which every
    @triton.jit helper it calls is itself interpreted.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    if isinstance(kernel, InterpretedFunction):
        return kernel
    fn = kernel.fn
    if fn not in _INTERPRETED:
        # only helpers this function names (a kernel module also holds itself)
        scope = {k: interpreted(v) if isinstance(v, JITFunction) and k in fn.__code__.co_names
                 and v.fn is not fn else v for k, v in fn.__globals__.items()}
        clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        clone.__annotations__ = dict(fn.__annotations__)
        clone.__module__, clone.__qualname__ = fn.__module__, fn.__qualname__
        _INTERPRETED[fn] = InterpretedFunction(clone)
    return _INTERPRETED[fn]


class HostArray:
    """The little of the torch.Tensor interface that Triton's interpreter uses
    for a pointer argument, over a numpy array (zero-copy)."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = array.dtype.name  # 'bfloat16', 'float8_e4m3fn', ... (ml_dtypes)

    def data_ptr(self):
        return self.array.ctypes.data

    # The interpreter copies a device tensor's storage to the host and back;
    # a HostArray already is host memory, so these are identities.
    def untyped_storage(self):
        return self

    def cpu(self):
        return self

    def new_empty(self, *args, **kwargs):
        return self

    def set_(self, *args, **kwargs):
        return self

    def copy_(self, other):
        return self

    def storage_offset(self):
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return self.array.strides


def numpy_dtype(name: str):
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def resolve_scalar(arg: Scalar, runtime: dict):
    value = runtime[arg.value] if isinstance(arg.value, str) else arg.value
    return np.float32(value) if arg.kind == "fp32" else int(value)


def run_plan_numpy(plan: Plan, arrays: dict, runtime: dict | None = None) -> dict:
    """Execute ``plan`` under the interpreter. ``arrays`` maps argument names to
    numpy arrays; outputs that alias an argument are written into a copy.
    Returns the environment (every buffer by name)."""
    runtime = runtime or {}
    env = dict(arrays)
    written = {o for launch in plan.launches for o in launch.outputs}
    for name in written & set(arrays):
        env[name] = np.array(arrays[name], copy=True)  # callers' arrays are never mutated
    for name, buf in plan.buffers.items():
        alloc = np.zeros if buf.zero_init else np.empty
        env[name] = alloc(buf.shape, dtype=numpy_dtype(buf.dtype))
    for launch in plan.launches:
        args = [resolve_scalar(a, runtime) if isinstance(a, Scalar) else HostArray(env[a])
                for a in launch.args]
        args += [HostArray(env[o]) for o in launch.outputs]
        with INTERPRETER_LOCK:
            interpreted(launch.kernel)[launch.grid](*args, **launch.constexprs)
    return env

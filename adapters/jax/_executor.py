"""The one generic executor that runs a core_kernels Plan with JAX arrays.

On a GPU each launch becomes a ``jax_triton.triton_call`` (row-major strides,
outputs after the inputs, in-place outputs aliased to their inputs). Without a
GPU, or with TRITON_INTERPRET=1, the whole plan runs in one host callback under
Triton's interpreter, so ``jax.jit`` code works unchanged on a laptop.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from core_kernels._interpret import run_plan_numpy
from core_kernels._plan import ArrayInfo, Plan, Scalar, as_float
from core_kernels._target import Target

from . import _gluon_bridge
from ._host_callback import host_call

_JT = None


def _jax_triton():
    """Import jax_triton lazily; it clobbers TRITON_CACHE_DIR, which would
    break every later torch-side Triton compile in this process. Installs the
    Gluon bridge where it supports this jax-triton."""
    global _JT
    if _JT is None:
        saved = os.environ.get("TRITON_CACHE_DIR")
        import jax_triton
        if saved is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = saved
        _gluon_bridge.install(jax_triton)
        _JT = jax_triton
    return _JT


def info(x) -> ArrayInfo:
    return ArrayInfo.contiguous(x.shape, jnp.dtype(x.dtype).name)


def infos(arrays: dict, *names) -> dict:
    """The ArrayInfo of each of ``names`` (None for an absent one), by name: a
    planner's array arguments, passed by keyword so that no order can swap them."""
    return {n: None if arrays.get(n) is None else info(arrays[n]) for n in names}


def as_array(name: str, value, dtype, size: int = 1):
    """A scalar or array argument as a 1-D device array of ``size`` (kept as
    data, so a new value never recompiles)."""
    arr = jnp.asarray(value)
    if arr.size != size:
        raise ValueError(f"{name}: expected {size} element(s), got shape {arr.shape}")
    if not (jnp.issubdtype(arr.dtype, jnp.integer) if jnp.issubdtype(dtype, jnp.integer)
            else jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(arr.dtype, jnp.integer)):
        raise TypeError(f"{name}: expected a {jnp.dtype(dtype).name} value, got {arr.dtype}")
    return arr.astype(dtype).reshape(size)


def is_device_data(value) -> bool:
    """A JAX array (committed or traced) is device data, never read on the host; a
    Python / numpy number or numpy array is a host value, checked by the scalar
    policy (docs/scalar_policy.md)."""
    return isinstance(value, jax.Array)


def scale_array(name: str, value):
    """A scale as a 1-element float32 device array; a host number must be finite
    and > 0 (core_kernels._plan.as_float), a JAX array is passed on unchecked."""
    if not is_device_data(value) and np.ndim(value) == 0:  # a host number (lists: as_array's errors)
        value = as_float(name, value, positive=True)
    return as_array(name, value, jnp.float32)


def interpret_requested() -> bool:
    """True when the user asked for Triton's interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _gpu_target(device) -> Target:
    """The facts of a JAX GPU device (its SM count and compute capability)."""
    cap = getattr(device, "compute_capability", None)
    sms = getattr(device, "core_count", None)
    if cap is None or sms is None:  # ask the CUDA driver through Triton
        import triton
        props = triton.runtime.driver.active.utils.get_device_properties(device.local_hardware_id or 0)
        sms = props["multiprocessor_count"]
        cap = cap or "{}.{}".format(*triton.runtime.driver.active.get_device_capability(device.local_hardware_id or 0))
    major, minor = (int(x) for x in str(cap).split(".")[:2])
    gluon = _gluon_bridge.install(_jax_triton())
    return Target("cuda", major * 10 + minor, int(sms), gluon=gluon)


_TARGETS = {}


def target(arrays: dict | None = None) -> Target:
    """The Target the next launch runs on: the interpreter (no GPU backend, or
    TRITON_INTERPRET=1), else JAX's default GPU device. ``arrays`` (name ->
    array) are checked: committed CPU arrays on a GPU machine are refused."""
    if interpret_requested() or jax.default_backend() not in ("gpu", "cuda"):
        return Target.interpreter()
    for name, x in (arrays or {}).items():
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            if any(d.platform == "cpu" for d in x.devices()):
                raise ValueError(f"{name}: a CPU array on a machine with a GPU; put it on the GPU, "
                                 "or set TRITON_INTERPRET=1 to run under Triton's interpreter")
    device = jax.devices()[0]
    if device.id not in _TARGETS:
        _TARGETS[device.id] = _gpu_target(device)
    return _TARGETS[device.id]


def _scalar(arg: Scalar, runtime: dict):
    value = runtime[arg.value] if isinstance(arg.value, str) else arg.value
    return np.float32(value) if arg.kind == "fp32" else int(value)


def _out_struct(plan: Plan, env: dict, name: str) -> jax.ShapeDtypeStruct:
    if name in plan.buffers:
        buf = plan.buffers[name]
        return jax.ShapeDtypeStruct(buf.shape, jnp.dtype(buf.dtype))
    return jax.ShapeDtypeStruct(env[name].shape, env[name].dtype)


def run_plan(plan: Plan, arrays: dict, tgt: Target, runtime: dict | None = None) -> tuple:
    """Run ``plan`` (made for ``tgt``) over ``arrays`` (name -> jax array);
    returns ``plan.results``."""
    runtime = runtime or {}
    arrays = {k: jnp.asarray(v) for k, v in arrays.items()}
    if not plan.launches:
        return tuple(arrays[r] if r in arrays else
                     jnp.zeros(plan.buffers[r].shape, jnp.dtype(plan.buffers[r].dtype))
                     for r in plan.results)
    if tgt.interpret:
        return _run_interpreted(plan, arrays, runtime)
    jt = _jax_triton()
    env = dict(arrays)
    for launch in plan.launches:
        if _gluon_bridge.is_gluon(launch.kernel) and not _gluon_bridge.install(jt):
            raise RuntimeError(f"{launch.kernel.fn.__name__} is a Gluon kernel, but the plan was made "
                               "for a target without Gluon support")
        in_args, array_pos = [], {}
        for a in launch.args:
            if isinstance(a, Scalar):
                in_args.append(_scalar(a, runtime))
            else:
                array_pos.setdefault(a, sum(not isinstance(x, (int, np.float32)) for x in in_args))
                if a not in env:  # a zero-initialised buffer read before any launch wrote it
                    env[a] = _unwritten(plan, a)
                in_args.append(env[a])
        aliases = {array_pos[o]: i for i, o in enumerate(launch.outputs) if o in array_pos}
        zeroed = tuple(i for i, o in enumerate(launch.outputs)
                  if o not in array_pos and o in plan.buffers and plan.buffers[o].zero_init)
        outs = jt.triton_call(
            *in_args, kernel=launch.kernel, grid=launch.grid,
            out_shape=[_out_struct(plan, env, o) for o in launch.outputs],
            input_output_aliases=aliases, zeroed_outputs=zeroed,
            num_warps=launch.num_warps, num_stages=launch.num_stages, **launch.constexprs)
        env.update(zip(launch.outputs, outs))
    return tuple(env[r] if r in env else _unwritten(plan, r) for r in plan.results)


def _unwritten(plan: Plan, name: str):
    """A zero-initialised result that no launch names (e.g. a gradient the plan
    knows is zero)."""
    buf = plan.buffers[name]
    if not buf.zero_init:
        raise AssertionError(f"plan result {name!r} is written by no launch and not zero-initialised")
    return jnp.zeros(buf.shape, jnp.dtype(buf.dtype))


def _run_interpreted(plan: Plan, arrays: dict, runtime: dict) -> tuple:
    names = list(arrays)
    env_structs = dict(arrays)
    result_structs = tuple(_out_struct(plan, env_structs, r) for r in plan.results)

    def host(*values):
        env = run_plan_numpy(plan, {n: np.asarray(v) for n, v in zip(names, values)}, runtime)
        return tuple(np.asarray(env[r]) for r in plan.results)

    return host_call(host, result_structs, [arrays[n] for n in names])

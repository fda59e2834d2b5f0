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
from core_kernels._plan import ArrayInfo, Plan, Scalar, interpret_requested

_JT = None


def _jax_triton():
    """Import jax_triton lazily; it clobbers TRITON_CACHE_DIR, which would
    break every later torch-side Triton compile in this process."""
    global _JT
    if _JT is None:
        saved = os.environ.get("TRITON_CACHE_DIR")
        import jax_triton
        if saved is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = saved
        _enable_gluon_kernels(jax_triton)
        _JT = jax_triton
    return _JT


def _is_gluon(kernel) -> bool:
    return hasattr(kernel, "is_gluon") and kernel.is_gluon()


def _enable_gluon_kernels(jax_triton) -> None:
    """Let ``jax_triton.triton_call`` launch Gluon kernels (jax-triton 0.3.1).

    jax-triton builds every kernel through the Triton-language front end
    (``code_gen.ast_to_ttir`` with an ``ASTSource``, then ``make_ttir`` and
    ``make_ttgir``). A Gluon kernel (``fn.is_gluon()``) is written at the TTGIR
    level: its module must come from Gluon's source object and be lowered by
    the backend's Gluon stage. A warp-specialised Gluon kernel also runs more
    warps than ``num_warps`` (its worker partitions'), which jax-triton would
    launch it with; the compiled count is used instead. Only jax-triton's own
    three references are rebound (its ``code_gen`` and ``triton_kernel_call_lib``
    names and ``compile_ttir_to_ptx_inplace``); Triton's modules, and so the
    torch side, are untouched. Both frameworks then compile the same kernel
    through the same stages.
    """
    import types

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    lib = jax_triton.triton_lib
    if getattr(lib, "_tandem_gluon", False):
        return
    needed = ("code_gen", "compile_ttir_to_ptx_inplace", "CompilationResult", "triton_kernel_call_lib")
    if not all(hasattr(lib, name) for name in needed):
        return  # another jax-triton: run_plan refuses Gluon launches with a clear error
    code_gen, compile_ptx = lib.code_gen, lib.compile_ttir_to_ptx_inplace
    gluon_modules = []  # modules built here, recognised by identity when compiled

    def ast_to_ttir(fn, src, *args, **kwargs):
        if not _is_gluon(fn):
            return code_gen.ast_to_ttir(fn, src, *args, **kwargs)
        capability = lib.triton_kernel_call_lib.get_compute_capability(0)
        gsrc = GluonASTSource(fn, src.signature, src.constants, src.attrs)
        module = gsrc.make_ir(GPUTarget("cuda", capability, 32), kwargs["options"],
                              kwargs["codegen_fns"], kwargs["module_map"], kwargs["context"])
        gluon_modules.append(module)
        return module

    def compile_ttir_to_ptx_inplace(module, backend, options, capability):
        if not any(m is module for m in gluon_modules):
            return compile_ptx(module, backend, options, capability)
        gluon_modules[:] = [m for m in gluon_modules if m is not module]
        metadata = {}
        ttgir = backend.gluon_to_ttgir(module, metadata, options, capability)
        llir = backend.make_llir(ttgir, metadata, options, capability)
        ptx = backend.make_ptx(llir, metadata, options, capability)
        # a warp-specialised kernel runs more warps than it was compiled for
        # (metadata["num_warps"] counts every partition's)
        launch_warps[metadata["name"]] = metadata["num_warps"]
        return lib.CompilationResult(binary=ptx, name=metadata["name"],
                                     shared_mem_bytes=metadata["shared"], ttgir=None, llir=None)

    call_lib = lib.triton_kernel_call_lib
    launch_warps = {}  # Gluon kernel name -> warps to launch

    def triton_kernel(name, num_warps, *args):
        return call_lib.TritonKernel(name, launch_warps.pop(name, num_warps), *args)

    proxy = types.ModuleType(code_gen.__name__)
    proxy.__dict__.update(vars(code_gen))
    proxy.ast_to_ttir = ast_to_ttir
    call_proxy = types.ModuleType(call_lib.__name__)
    call_proxy.__dict__.update(vars(call_lib))
    call_proxy.TritonKernel = triton_kernel
    lib.code_gen = proxy
    lib.compile_ttir_to_ptx_inplace = compile_ttir_to_ptx_inplace
    lib.triton_kernel_call_lib = call_proxy
    lib._tandem_gluon = True


def info(x) -> ArrayInfo:
    return ArrayInfo.contiguous(x.shape, jnp.dtype(x.dtype).name)


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


def _use_interpreter(arrays: dict) -> bool:
    if interpret_requested():
        return True
    if jax.default_backend() not in ("gpu", "cuda", "rocm"):
        return True
    for name, x in arrays.items():
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            if any(d.platform == "cpu" for d in x.devices()):
                raise ValueError(f"{name}: a CPU array on a machine with a GPU; put it on the GPU, "
                                 "or set TRITON_INTERPRET=1 to run under Triton's interpreter")
    return False


def _scalar(arg: Scalar, runtime: dict):
    value = runtime[arg.value] if isinstance(arg.value, str) else arg.value
    return np.float32(value) if arg.kind == "fp32" else int(value)


def _out_struct(plan: Plan, env: dict, name: str) -> jax.ShapeDtypeStruct:
    if name in plan.buffers:
        buf = plan.buffers[name]
        return jax.ShapeDtypeStruct(buf.shape, jnp.dtype(buf.dtype))
    return jax.ShapeDtypeStruct(env[name].shape, env[name].dtype)


def run_plan(plan: Plan, arrays: dict, runtime: dict | None = None) -> tuple:
    """Run ``plan`` over ``arrays`` (name -> jax array); returns ``plan.results``."""
    runtime = runtime or {}
    arrays = {k: jnp.asarray(v) for k, v in arrays.items()}
    if not plan.launches:
        return tuple(arrays[r] if r in arrays else
                     jnp.zeros(plan.buffers[r].shape, jnp.dtype(plan.buffers[r].dtype))
                     for r in plan.results)
    if _use_interpreter(arrays):
        return _run_interpreted(plan, arrays, runtime)
    jt = _jax_triton()
    env = dict(arrays)
    for launch in plan.launches:
        if _is_gluon(launch.kernel) and not getattr(jt.triton_lib, "_tandem_gluon", False):
            raise RuntimeError(f"{launch.kernel.fn.__name__} is a Gluon kernel, which this jax-triton "
                               f"({getattr(jt, '__version__', '?')}) cannot compile; use jax-triton 0.3.1")
        in_args, array_pos = [], {}
        for a in launch.args:
            if isinstance(a, Scalar):
                in_args.append(_scalar(a, runtime))
            else:
                array_pos.setdefault(a, sum(not isinstance(x, (int, np.float32)) for x in in_args))
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
    return tuple(env[r] for r in plan.results)


def _run_interpreted(plan: Plan, arrays: dict, runtime: dict) -> tuple:
    names = list(arrays)
    env_structs = dict(arrays)
    result_structs = tuple(_out_struct(plan, env_structs, r) for r in plan.results)

    def host(*values):
        env = run_plan_numpy(plan, {n: np.asarray(v) for n, v in zip(names, values)}, runtime)
        return tuple(np.asarray(env[r]) for r in plan.results)

    return jax.pure_callback(host, result_structs, *[arrays[n] for n in names],
                             vmap_method="sequential")

"""Launching Gluon kernels through jax-triton (the only patch of another package here).

jax-triton builds every kernel through the Triton-language front end
(``code_gen.ast_to_ttir`` with an ``ASTSource``, then ``make_ttir`` and
``make_ttgir``). A Gluon kernel (``fn.is_gluon()``) is written at the TTGIR
level: its module must come from Gluon's source object and be lowered by the
backend's Gluon stage. A warp-specialised Gluon kernel also runs more warps
than ``num_warps`` (its worker partitions'), which jax-triton would launch it
with; the compiled count is used instead.

The bridge rebinds three of jax-triton's own module-level references (its
``code_gen`` and ``triton_kernel_call_lib`` names and
``compile_ttir_to_ptx_inplace``); Triton's modules, and so the torch side, are
untouched, and both frameworks compile the same kernel through the same stages.
It is written for the jax-triton versions in ``SUPPORTED`` and installs itself
only there: elsewhere ``install`` returns False, the executor's Target says
``gluon=False``, and planners pick their Triton kernels instead.
"""
from __future__ import annotations

import types

SUPPORTED = ("0.3.1",)
_NEEDED = ("code_gen", "compile_ttir_to_ptx_inplace", "CompilationResult", "triton_kernel_call_lib")
_STATE = {"installed": None}


def jax_triton_version() -> str | None:
    from importlib import metadata
    try:
        return metadata.version("jax-triton")
    except metadata.PackageNotFoundError:
        return None


def install(jax_triton) -> bool:
    """Teach ``jax_triton`` to compile Gluon kernels; True when it now can."""
    if _STATE["installed"] is None:
        lib = getattr(jax_triton, "triton_lib", None)
        ok = (jax_triton_version() in SUPPORTED and lib is not None
              and all(hasattr(lib, name) for name in _NEEDED))
        if ok:
            try:
                from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
            except ImportError:
                ok = False
        if ok:
            _rebind(lib)
        _STATE["installed"] = ok
    return _STATE["installed"]


def is_gluon(kernel) -> bool:
    return hasattr(kernel, "is_gluon") and kernel.is_gluon()


def _rebind(lib) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    code_gen, compile_ptx = lib.code_gen, lib.compile_ttir_to_ptx_inplace
    gluon_modules = []  # modules built here, recognised by identity when compiled

    def ast_to_ttir(fn, src, *args, **kwargs):
        if not is_gluon(fn):
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

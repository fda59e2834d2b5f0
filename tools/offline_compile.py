"""Compile a plan's launches for sm_90 without a GPU and report ptxas resources.

    PYTHONPATH=. .venv/bin/python tools/offline_compile.py   (see __main__ for an example)

Use it from Python:
    from tools.offline_compile import plan_dtypes, report
    report(plan, plan_dtypes(plan, {"q": q_info, ...}))   # registers / spills / smem per launch
    (the ArrayInfos the plan was made from, by argument name)

Triton compiles to PTX on the CPU; the bundled ptxas reports registers and
spill bytes per thread, which predicts occupancy and spills before spending
device time. Runtime ints are never specialised on alignment (as in both
launchers) and by default not on the value 1 either, which both launchers do:
``specialize_ones=True`` compiles a plan-time integer equal to 1 as that
constant, so that the code is what a GPU launch compiles
(tests/test_offline_compile.py).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret (core_kernels only sets a default)
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from core_kernels._plan import Scalar  # noqa: E402

_PTR = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "int32": "*i32",
        "int64": "*i64", "uint8": "*u8", "int8": "*i8", "float8_e4m3fn": "*fp8e4nv",
        "float8_e5m2": "*fp8e5", "float64": "*fp64", "bool": "*i1"}


def compile_launch(launch, dtypes: dict, arch: int = 90, specialize_ones: bool = False):
    """Compile one Launch for sm_``arch``; ``dtypes``: buffer name -> dtype name of
    every pointer argument (see :func:`plan_dtypes`); ``specialize_ones``: see
    the module docstring."""
    fn = launch.kernel
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        a = launch.params.get(name)
        if a is None:  # a constexpr parameter
            sig[name], consts[(i,)] = "constexpr", launch.constexprs[name]
        elif not isinstance(a, Scalar):  # a buffer name: 16-byte aligned, as allocated
            sig[name] = _PTR[dtypes[a]]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif specialize_ones and a.kind != "fp32" and not isinstance(a.value, str) and int(a.value) == 1:
            sig[name], consts[(i,)] = "constexpr", 1
        else:
            sig[name] = {"i32": "i32", "i64": "i64", "fp32": "fp32"}[a.kind]
    source = ASTSource
    if hasattr(fn, "is_gluon") and fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    src = source(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def plan_dtypes(plan, arrays: dict) -> dict:
    """Buffer name -> dtype name of everything ``plan``'s launches can name: the
    op's array arguments (``arrays``: name -> ArrayInfo, None for an absent one)
    and the buffers the plan allocates."""
    dtypes = {name: info.dtype for name, info in arrays.items() if info is not None}
    dtypes.update((name, buf.dtype) for name, buf in plan.buffers.items())
    return dtypes


def ptxas_report(ptx: str, arch: int = 90) -> str:
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        open(p, "w").write(ptx)
        r = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", p, "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True)
    return " ".join(l.strip() for l in (r.stderr + r.stdout).splitlines()
                    if re.search(r"registers|spill|stack", l))


def report(plan, dtypes: dict, arch: int = 90, dump_dir: str | None = None):
    """dtypes: buffer/argument name -> dtype name for every pointer argument."""
    dtypes = dict(dtypes)
    for name, buf in plan.buffers.items():
        dtypes.setdefault(name, buf.dtype)
    out = []
    for i, launch in enumerate(plan.launches):
        c = compile_launch(launch, dtypes, arch)
        line = (f"[{i}] {launch.kernel.fn.__name__} grid={launch.grid} warps={launch.num_warps} "
                f"stages={launch.num_stages} smem={c.metadata.shared} | {ptxas_report(c.asm['ptx'], arch)}")
        print(line)
        out.append(line)
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                open(os.path.join(dump_dir, f"{i}_{launch.kernel.fn.__name__}.{ext}"), "w").write(c.asm[ext])
    return out


if __name__ == "__main__":
    from core_kernels._plan import ArrayInfo
    from core_kernels._target import Target
    from core_kernels.lightning_attention import plan_lightning_attention
    h200 = Target("cuda", 90, 132, gluon=True)
    for dt in ("float32", "bfloat16"):
        q = ArrayInfo.contiguous((1, 64, 4096, 128), dt)
        ed = ArrayInfo.contiguous((64,), "float32")
        plan = plan_lightning_attention(h200, q, q, q, ed)
        report(plan, {"q": dt, "k": dt, "v": dt, "ed": "float32"})

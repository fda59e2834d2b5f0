"""The merge kernels compile for sm_90 on a machine without a GPU.

The CPU suite runs every kernel under Triton's interpreter, which accepts code
that the compiler rejects (seen: a string default of a constexpr parameter of
a @triton.jit helper ran interpreted and failed to compile). This test
compiles the planner's launches to PTX with tools/offline_compile.py, in a
subprocess because the interpreter switch is read when the kernels are
defined.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    from tools.offline_compile import compile_launch
    from core_kernels._plan import ArrayInfo
    from core_kernels._target import Target
    from core_kernels.merge_attn_states import plan_merge_attn_states, plan_merge_attn_states_backward
    target = Target("cuda", 90, 132)
    compiled = 0
    for dt in ("bfloat16", "float32"):
        dtypes = dict(prefix_lse="float32", suffix_lse="float32", output_lse="float32",
                      grad_output_lse="float32", grad_prefix_lse="float32", grad_suffix_lse="float32",
                      prefix_output=dt, suffix_output=dt, output=dt, grad_output=dt,
                      grad_prefix_output=dt, grad_suffix_output=dt)
        for n in (1, 64, 16384):  # the tilings of TILINGS: load_first and not
            o, lse = ArrayInfo.contiguous((n, 32, 128), dt), ArrayInfo.contiguous((32, n), "float32")
            for plan in (plan_merge_attn_states(target, o, lse, o, lse),
                         plan_merge_attn_states_backward(target, o, lse, o, lse, o, lse)):
                for launch in plan.launches:
                    ptx = compile_launch(launch, dtypes).asm["ptx"]
                    assert ".entry " + launch.kernel.__name__ in ptx, launch.kernel.__name__
                    compiled += 1
    print("compiled", compiled)
""")


def test_merge_kernels_compile_for_sm90(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compiled 12" in run.stdout, run.stdout

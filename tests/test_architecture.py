"""The launch contract shared by every op: Target, launches by parameter name,
the integer policy, configs, and the jax-triton Gluon bridge's gate."""
import pathlib
import types

import numpy as np
import pytest

# NOTE: core_kernels first: without a GPU it selects Triton's interpreter, which
# must happen before triton.language is imported (its own helpers are decorated then)
import core_kernels  # noqa: F401,I001
import triton
import triton.language as tl

from core_kernels._plan import (ArrayInfo, Launch, Scalar, decode_config, encode_config,
                                kernel_signature, pow2_divisor)
from core_kernels._target import Target
from core_kernels._triton_utils import jit
from core_kernels.merge_attn_states import MergeConfig, plan_merge_attn_states
from harness import GPU, rng


@jit
def _toy_kernel(x_ptr, n, stride_x, y_ptr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    o = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + o * (stride_x * ALIGN), mask=o < n)
    tl.store(y_ptr + o, v, mask=o < n)


@triton.jit
def _plain_kernel(x_ptr, n, y_ptr, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(y_ptr + o, tl.load(x_ptr + o, mask=o < n), mask=o < n)


def _toy(**changes):
    kw = dict(kernel=_toy_kernel, grid=(1,),
              params=dict(x_ptr="x", n=Scalar(5), stride_x=Scalar(24, align="ALIGN"), y_ptr="y"),
              writes=("y_ptr",), constexprs=dict(BLOCK=8))
    kw.update(changes)
    return Launch(**kw)


def test_jit_marks_every_runtime_int_and_no_pointer():
    sig = {name: (const, no_align) for name, const, no_align in kernel_signature(_toy_kernel)}
    assert sig["n"] == (False, True) and sig["stride_x"] == (False, True)
    assert sig["x_ptr"] == (False, False) and sig["y_ptr"] == (False, False)
    assert sig["BLOCK"][0] and sig["ALIGN"][0]


def test_launch_resolves_names_and_alignment_groups():
    launch = _toy()
    assert launch.args == ("x", Scalar(5), Scalar(3))  # 24 = 3 x 8: passed divided by its group's 8
    assert launch.outputs == ("y",)
    assert launch.constexprs == dict(BLOCK=8, ALIGN=8)


@pytest.mark.parametrize("values,expected", [((24,), 8), ((32, 48), 16), ((0, 6), 2), ((7,), 1),
                                             ((0,), 16), ((64, 1024, 2 ** 40), 16)])
def test_pow2_divisor(values, expected):
    assert pow2_divisor(*values) == expected


@pytest.mark.parametrize("changes,match", [
    (dict(params=dict(x_ptr="x", n=Scalar(5), y_ptr="y")), "missing \\['stride_x'\\]"),
    (dict(params=dict(x_ptr="x", n=Scalar(5), stride_x=Scalar(1), y_ptr="y", z=Scalar(1))),
     "unknown \\['z'\\]"),
    (dict(params=dict(x_ptr=Scalar(0), n=Scalar(5), stride_x=Scalar(1), y_ptr="y")), "x_ptr takes a buffer"),
    (dict(params=dict(x_ptr="x", n="n", stride_x=Scalar(1), y_ptr="y")), "n takes a Scalar"),
    (dict(writes=("x_ptr",)), "last runtime parameters"),
    (dict(constexprs=dict(BLOCK=8, ALIGN=4)), "alignment group ALIGN"),
    (dict(constexprs=dict()), "missing \\['BLOCK'\\]"),
    (dict(constexprs=dict(BLOCK=8, EXTRA=1)), "unknown \\['EXTRA'\\]"),
    (dict(params=dict(x_ptr="x", n=Scalar("n", align="ALIGN"), stride_x=Scalar(1, align="ALIGN"),
                      y_ptr="y")), "runtime value"),
])
def test_launch_is_checked_against_the_signature(changes, match):
    with pytest.raises(TypeError, match=match):
        _toy(**changes)


def test_kernel_outside_the_integer_policy_is_refused():
    with pytest.raises(TypeError, match="specialised on alignment"):
        Launch(_plain_kernel, (1,), dict(x_ptr="x", n=Scalar(3), y_ptr="y"), ("y_ptr",), dict(BLOCK=4))


def test_target():
    t = Target.interpreter()
    assert t.interpret and not t.gluon and not t.hopper and t.num_sms == 132
    assert Target("cuda", 90, 132, gluon=True).hopper
    assert not Target("cuda", 100, 148, gluon=True).hopper
    with pytest.raises(ValueError, match="backend"):
        Target("rocm", 90, 100)
    with pytest.raises(ValueError, match="num_sms"):
        Target("cuda", 90, 0)


def test_plans_are_cached_per_target():
    o, lse = ArrayInfo.contiguous((64, 4, 32), "float32"), ArrayInfo.contiguous((4, 64), "float32")
    a = plan_merge_attn_states(Target.interpreter(), o, lse, o, lse)
    b = plan_merge_attn_states(Target("cuda", 90, 132, gluon=True), o, lse, o, lse)
    assert a is plan_merge_attn_states(Target.interpreter(), o, lse, o, lse)
    assert a is not b


def test_config_round_trip_and_refusal():
    cfg = MergeConfig(512, 2, "evict_first")
    assert decode_config(encode_config(cfg)) == cfg
    assert encode_config(None) is None and decode_config(None) is None

    class Stranger:
        pass
    with pytest.raises(TypeError, match="config"):
        encode_config(Stranger())


def test_torch_target_of_cpu_tensors_is_the_interpreter():
    import torch
    from adapters.torch._executor import target_for
    assert target_for(torch.device("cpu")).interpret


@pytest.mark.skipif(GPU, reason="CPU machine: JAX's target is the interpreter")
def test_jax_target_without_a_gpu_is_the_interpreter():
    from adapters.jax._executor import target
    assert target().interpret


# ---------------------------------------------------------------- Gluon bridge
def _fake_jax_triton(complete=True):
    lib = types.SimpleNamespace()
    if complete:
        lib.code_gen = types.ModuleType("fake_code_gen")
        lib.compile_ttir_to_ptx_inplace = lambda *a: None
        lib.CompilationResult = object
        lib.triton_kernel_call_lib = types.ModuleType("fake_call_lib")
    return types.SimpleNamespace(triton_lib=lib)


@pytest.fixture
def bridge(monkeypatch):
    from adapters.jax import _gluon_bridge
    monkeypatch.setitem(_gluon_bridge._STATE, "installed", None)
    return _gluon_bridge


def test_bridge_refuses_other_jax_triton_versions(bridge, monkeypatch):
    monkeypatch.setattr(bridge, "jax_triton_version", lambda: "0.4.0")
    fake = _fake_jax_triton()
    assert bridge.install(fake) is False
    assert fake.triton_lib.code_gen.__name__ == "fake_code_gen"  # nothing rebound


def test_bridge_refuses_missing_internals(bridge, monkeypatch):
    monkeypatch.setattr(bridge, "jax_triton_version", lambda: "0.3.1")
    assert bridge.install(_fake_jax_triton(complete=False)) is False


def test_bridge_rebinds_only_jax_triton_references(bridge, monkeypatch):
    monkeypatch.setattr(bridge, "jax_triton_version", lambda: "0.3.1")
    fake = _fake_jax_triton()
    code_gen = fake.triton_lib.code_gen
    assert bridge.install(fake) is True
    assert fake.triton_lib.code_gen is not code_gen  # a proxy of jax-triton's own module
    assert bridge.install(fake) is True  # idempotent


def test_pyproject_pins_the_bridged_jax_triton_range():
    import pathlib
    import re
    from adapters.jax._gluon_bridge import SUPPORTED
    text = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    spec = re.search(r'"jax-triton([^"]*)"', text).group(1)
    assert spec.startswith(">=") and "<" in spec, f"jax-triton range not pinned: {spec!r}"
    low = spec.split(",")[0][2:]
    assert low in SUPPORTED, "the lowest supported jax-triton must be one the bridge was written for"
    assert np.all([s.startswith("0.3.") for s in SUPPORTED])


# ------------------------------------------------------------ CPU import order
def _triton_library_helpers() -> set:
    """Names of triton.language functions that are themselves @triton.jit
    helpers (tl.cdiv, tl.sum, tl.zeros, ...): decorated when triton.language is
    imported, so compiled rather than interpreted if that import came before ours."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    return {n for n in dir(tl) if isinstance(getattr(tl, n), (JITFunction, InterpretedFunction))}


def test_no_triton_kernel_calls_a_library_jit_helper():
    import ast
    import pathlib
    helpers = _triton_library_helpers()
    assert {"cdiv", "sum", "zeros"} <= helpers
    root = pathlib.Path(core_kernels.__file__).parent
    found = []
    for path in sorted(root.glob("*/kernels.py")) + sorted(root.glob("*/*_kernels.py")):
        if path.name == "gluon_kernels.py":  # GPU only, never interpreted
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "tl" and node.attr in helpers):
                found.append(f"{path.relative_to(root)}:{node.lineno}: tl.{node.attr}")
    assert not found, "kernels call triton.language @jit helpers (breaks the CPU path " \
                      "when triton.language is imported first):\n" + "\n".join(found)


_IMPORT_FIRST = """
import triton, triton.language, torch._dynamo  # before our package
import numpy as np, torch
import adapters.torch as at, adapters.jax as aj
from core_kernels.lightning_attention import lightning_attention_reference
g = np.random.default_rng(0)
q, k, v = (g.standard_normal((1, 2, 70, 16)).astype(np.float32) for _ in range(3))
ed = g.uniform(0.01, 1, 2).astype(np.float32)
ref = lightning_attention_reference(q, k, v, ed, 32)[0]
o = at.lightning_attention(*map(torch.from_numpy, (q, k, v, ed)), 32)[0].numpy()
oj = np.asarray(aj.lightning_attention(q, k, v, ed, 32)[0])
assert np.allclose(o, ref, rtol=1e-4, atol=1e-4) and np.array_equal(o, oj), "wrong result"
print("ok")
"""


@pytest.mark.skipif(GPU, reason="the interpreter path (CPU machines)")
def test_cpu_path_independent_of_import_order():
    """Importing triton, triton.language and torch._dynamo before our package must
    not break the interpreted kernels (it did: lightning prefill's tl.cdiv)."""
    import os
    import pathlib
    import subprocess
    import sys
    repo = pathlib.Path(core_kernels.__file__).parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(repo)
    res = subprocess.run([sys.executable, "-c", _IMPORT_FIRST], env=env, cwd=repo,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


# ------------------------------------------------------------ interpreter thread safety
_SHARD_MAP = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, "tests")
import core_kernels  # noqa: F401
import numpy as np, jax
from jax.sharding import Mesh, PartitionSpec as P
try:
    from jax import shard_map
except ImportError:
    from jax.experimental.shard_map import shard_map
import adapters.jax as aj
from core_kernels.blocksparse_attention import build_sparse_layout
from test_prefix_prefill import make_case
g = np.random.default_rng(20261127)  # fixed: module-level inputs, the same every run
mesh = Mesh(np.array(jax.devices()), ("h",))
h1, h2, h3, R = P(None, "h"), P(None, None, "h"), P("h"), P()


def check(name, fn, args, in_specs, out_specs, reps=10):
    \"\"\"shard_map over heads, ``reps`` calls in a row, each equal bit for bit to the whole call.\"\"\"
    whole = fn(*args)
    f = jax.jit(shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    for _ in range(reps):
        for a, w in zip(jax.tree_util.tree_leaves(f(*args)), jax.tree_util.tree_leaves(whole)):
            assert np.array_equal(np.asarray(a), np.asarray(w)), name + ": shard_map differs from the whole call"


def r(*shape):
    return g.standard_normal(shape).astype(np.float32)


b, h, d = 3, 8, 16
slope = g.uniform(0.1, 1, h).astype(np.float32)
check("decode", aj.linear_decode_forward_triton,
      (r(b, h, 1, d), r(b, h, 1, d), r(b, h, 1, d), r(5, h, d, d), slope, np.array([4, -1, 1], np.int32)),
      (h1, h1, h1, h1, h3, R), (h1, h1))
check("lightning", lambda q, k, v, s: aj.lightning_attention(q, k, v, s, 16),
      (r(1, h, 40, d), r(1, h, 40, d), r(1, h, 40, d), slope), (h1, h1, h1, h3), (h1, h1), reps=4)
check("varlen", lambda q, k, v, s, cu: aj.lightning_attention_varlen(q, k, v, s, cu),
      (r(21, h, d), r(21, h, d), r(21, h, d), slope, np.array([0, 5, 5, 21], np.int32)),
      (h1, h1, h1, h3, R), (h1, h1), reps=4)
check("merge", lambda po, pl, so, sl: aj.merge_attn_states(po, pl, so, sl),
      (r(9, h, d), r(h, 9), r(9, h, d), r(h, 9)), (h1, h3, h1, h3), (h1, h3))
(crow, col), _ = build_sparse_layout(h, 48, 16, 2, 2, homo_head=False)
cu = np.array([0, 17, 48], np.int32)
check("blocksparse", lambda q, k, v, c, cl: aj.blocksparse_flash_attn_varlen_fwd(
          q, k, v, cu, cu, 0.25, (c, cl), block_size=16, max_seqlen=48),
      (r(48, h, d), r(48, h // 2, d), r(48, h // 2, d), crow, col), (h1, h1, h1, h3, h3), h1, reps=3)
c = make_case([(5, 19), (1, 7), (12, 0)], hq=h, hkv=h // 2, d=d)
names = ("q", "k", "v", "k_cache", "v_cache", "b_loc", "b_start_loc", "b_seq_len")
check("prefix", lambda *a: aj.context_attention_fwd(*a, max_input_len=c["max_input_len"]),
      tuple(c[n] for n in names), (h1, h1, h1, h1, h1, R, R, R), h1, reps=3)
print("ok")
"""


@pytest.mark.skipif(GPU, reason="the interpreter path (CPU machines)")
def test_shard_map_on_cpu_devices():
    """shard_map over heads on 4 host devices, every op, several calls in a row
    (10 for decode and merge),
    each equal bit for bit to the whole call: XLA runs the shards' host callbacks
    in parallel, and Triton's interpreter is not thread-safe (it broke or computed
    wrong numbers); every interpreted launch holds core_kernels._interpret's lock."""
    import os
    import pathlib
    import subprocess
    import sys
    repo = pathlib.Path(core_kernels.__file__).parent.parent
    env = dict(os.environ, PYTHONPATH=str(repo))
    res = subprocess.run([sys.executable, "-c", _SHARD_MAP], env=env, cwd=repo,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


@pytest.mark.skipif(GPU, reason="the interpreter path (CPU machines)")
def test_torch_cpu_calls_from_threads():
    """torch CPU tensors from several threads at once: each result equals the
    single-threaded one, bit for bit."""
    import threading
    import torch
    import adapters.torch as at
    g = np.random.default_rng(1)
    cases = []
    for _ in range(4):
        po, so = (torch.from_numpy(g.standard_normal((37, 3, 24)).astype(np.float32)) for _ in range(2))
        pl, sl = (torch.from_numpy(g.standard_normal((3, 37)).astype(np.float32)) for _ in range(2))
        cases.append((po, pl, so, sl))

    def run(c):
        out = torch.empty_like(c[0])
        at.merge_attn_states(out, *c)
        return out
    expected = [run(c) for c in cases]
    results = [None] * len(cases)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(cases[i])))
               for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, expected):
        assert got is not None and torch.equal(got, want)


def test_placeholder_buffers_only_where_no_launch_touches_them():
    """Buffer.placeholder marks stand-ins for pointers a plan's launches leave
    alone (the torch executor passes one shared tensor instead of allocating):
    the unsegmented chained-scan scratch, one-split decode partials; never a
    buffer the launches use."""
    from core_kernels.blocksparse_attention import build_sparse_layout, plan_blocksparse_attention
    from core_kernels.lightning_attention import (LightningTritonConfig, LightningVarlenConfig,
                                                  plan_lightning_attention, plan_lightning_attention_varlen)
    h200 = Target("cuda", 90, 132, gluon=True)
    ed = ArrayInfo.contiguous((64,), "float32")
    q = ArrayInfo.contiguous((4, 64, 1024, 128), "bfloat16")
    for config in (None, LightningTritonConfig()):            # one segment: both stand-ins
        plan = plan_lightning_attention(h200, q, q, q, ed, config=config)
        assert plan.buffers["seg_state"].placeholder and plan.buffers["sync"].placeholder
    few = ArrayInfo.contiguous((1, 8, 65536, 128), "bfloat16")  # chained scan: both used
    for config in (None, LightningTritonConfig()):
        plan = plan_lightning_attention(h200, few, few, few, ArrayInfo.contiguous((8,), "float32"),
                                        config=config, output_final_state_only=True)
        assert not plan.buffers["sync"].placeholder and not plan.buffers["seg_state"].placeholder
    t = ArrayInfo.contiguous((5000, 64, 128), "bfloat16")
    cu = ArrayInfo.contiguous((17,), "int32")
    whole = plan_lightning_attention_varlen(h200, t, t, t, ed, cu, config=LightningVarlenConfig(segment_len=0))
    cut = plan_lightning_attention_varlen(h200, t, t, t, ed, cu, config=LightningVarlenConfig(segment_len=512))
    assert whole.buffers["sync"].placeholder and not cut.buffers["sync"].placeholder
    assert not any(b.placeholder for n, b in whole.buffers.items() if n in whole.results)
    (crow, col), _ = build_sparse_layout(32, 4096, 64, 16, 8, False)
    args = [ArrayInfo.contiguous(s, d) for s, d in (((1, 32, 128), "bfloat16"), ((4096, 8, 128), "bfloat16"),
                                                   ((4096, 8, 128), "bfloat16"), ((2,), "int32"))]
    layout = [ArrayInfo.contiguous(crow.shape, "int32"), ArrayInfo.contiguous(col.shape, "int32")]
    dec = plan_blocksparse_attention(h200, *args, None, *layout, block_size=64, max_seqlen=4096)
    part = dec.buffers["partials"]
    assert part.placeholder == (part.shape == (1,))


def test_cached_launch_arguments_follow_the_kernel_signature(monkeypatch):
    """The torch executor's cached-launcher path (GPU) hands the compiled
    kernel's C launcher one argument per kernel parameter, constexprs included,
    in the kernel's order: each pointer the data pointer of the buffer its
    parameter names, each scalar its plan-time or runtime value. Checked for
    the GPU plans of every op's host-bench case (planned for an H200 on this
    machine, launches not run) against the kernels' own signatures."""
    import inspect

    import torch

    from adapters.torch import _device, _executor as ex, _launcher
    from benchmarks.experiments.exp_host_python import cases

    h200 = Target("cuda", 90, 132, gluon=True)
    monkeypatch.setattr(ex, "_PLANS", {})
    monkeypatch.setattr(ex, "target_for", lambda device: h200)
    monkeypatch.setattr(_device, "interpret_requested", lambda: True)  # CPU tensors on a GPU machine too
    seen = []

    def record(plan, tensors, runtime, device):
        seen.append((plan, dict(tensors), runtime or {}))
        raise _Planned
    monkeypatch.setattr(ex, "_run_interpreted", record)  # where the CPU tensors' plans go
    with torch.inference_mode():
        for name, call in cases():
            with pytest.raises(_Planned):
                call()
    assert len(seen) == 7 and sum(len(p.launches) for p, _, _ in seen) >= 7
    rng_ = rng()
    for plan, tensors, runtime in seen:
        env = {n: t for n, t in tensors.items() if t is not None}
        for name, buf in plan.buffers.items():  # offsets: pointers that differ from every other
            flat = torch.empty(int(np.prod(buf.shape)) + 64, dtype=_device.TORCH_DTYPES[buf.dtype])
            env[name] = flat[int(rng_.integers(1, 64)):]
        runtime = {**runtime, **{a.value: int(rng_.integers(2, 1000)) for la in plan.launches
                                 for a in la.params.values() if isinstance(a, Scalar) and isinstance(a.value, str)
                                 and runtime.get(a.value) is None}}
        for launch in plan.launches:
            recipe = _launcher._Recipe(launch)
            ptrs = [env[n].data_ptr() for n in recipe.ptr_names]
            got = recipe.getter(ptrs + [runtime[n] for n in recipe.rt_names] + recipe.consts)
            want = []
            for pname, p in inspect.signature(launch.kernel.fn).parameters.items():
                if "constexpr" in str(p.annotation):
                    want.append(launch.constexprs[pname])
                    continue
                a = launch.params[pname]
                want.append(env[a].data_ptr() if isinstance(a, str)
                            else runtime[a.value] if isinstance(a.value, str) else a.value)
            assert list(got) == want, launch.kernel.fn.__name__


class _Planned(Exception):
    pass


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_gpu_cached_launcher_respecialises_and_yields_to_hooks():
    """The cached-launcher path (GPU): a call whose pointer alignment or runtime
    integer (1 vs others) differs from the cached one gets its own compiled
    kernel, and installed Triton launch hooks (profilers) see every launch."""
    import torch
    import triton

    import adapters.torch as at
    n, h, d = 9, 4, 64
    base = torch.randn(3, n * h * d + 8, device="cuda")
    pl, sl = torch.randn(2, h, n, device="cuda")

    def ref(po, so, ptwc):
        m = torch.maximum(pl, sl)
        wp, ws = torch.exp(pl - m), torch.exp(sl - m)
        out = (po * wp.T[..., None] + so * ws.T[..., None]) / (wp + ws).T[..., None]
        out[ptwc:] = so[ptwc:]
        return out
    calls = []

    def hook(*args):
        calls.append(args)
    for offset, ptwc, hooked in ((0, 3, False), (1, 3, False), (0, 1, False), (1, 1, True), (0, 3, True),
                                 (0, 3, False), (1, 1, False)):
        po, so, out = (base[i, offset:offset + n * h * d].view(n, h, d) for i in range(3))
        out.fill_(float("nan"))
        if hooked:
            triton.knobs.runtime.launch_enter_hook.add(hook)
        try:
            before = len(calls)
            at.merge_attn_states(out, po, pl, so, sl, prefill_tokens_with_context=ptwc)
            torch.cuda.synchronize()
        finally:
            triton.knobs.runtime.launch_enter_hook.remove(hook)
        assert len(calls) - before == (1 if hooked else 0)
        torch.testing.assert_close(out, ref(po, so, ptwc), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("shape", [(), (1,), (5,), (3, 4, 5), (0, 4), (4, 0, 2), (7, 1, 3), (2, 1, 1, 9)],
                         ids=str)
def test_executor_buffers_are_contiguous(shape):
    """The torch executor makes its buffers with torch.empty_strided and strides
    worked out once per plan (core_kernels._plan.row_major_strides, as for
    ArrayInfo.contiguous): those strides are torch.empty's own for every shape
    (empty and size-1 dimensions included)."""
    import torch
    from core_kernels._plan import row_major_strides
    assert row_major_strides(shape) == torch.empty(shape).stride()
    t = torch.empty_strided(shape, row_major_strides(shape))
    assert t.is_contiguous()


# ------------------------------------------------------------------ one op, one folder
ROOT = pathlib.Path(__file__).resolve().parents[1]
OP_FOLDERS = sorted(p.parent.name for p in ROOT.glob("core_kernels/*/__init__.py"))
# modules every op goes through: they derive from the ops' descriptions and name none
CENTRAL = ("core_kernels/op_axes.py", "core_kernels/_index_check.py", "core_kernels/_plan.py",
           "core_kernels/_interpret.py", "adapters/jax/_vmap.py", "adapters/jax/_spmd.py",
           "adapters/jax/_executor.py", "adapters/jax/_host_callback.py", "adapters/jax/_index_validation.py",
           "adapters/torch/_dtensor.py", "adapters/torch/_register.py", "adapters/torch/_executor.py",
           "adapters/torch/_launcher.py", "adapters/torch/_call_memo.py", "adapters/torch/_replay.py",
           "adapters/torch/_device.py", "adapters/torch/_index_validation.py")


def _missing_pieces(folder: str) -> list:
    """What the op folder core_kernels/<folder>/ lacks of ADDING_AN_OP.md's checklist."""
    import importlib

    from core_kernels.op_axes import OpAxes
    base = ROOT / "core_kernels" / folder
    missing = []
    if not list(base.glob("*kernels.py")):
        missing.append("kernels: core_kernels/{}/kernels.py".format(folder))
    package = importlib.import_module(f"core_kernels.{folder}")
    if not any(n.startswith("plan_") and callable(getattr(package, n)) for n in dir(package)):
        missing.append(f"planner: a plan_<op> exported by core_kernels/{folder}/__init__.py")
    if not any(n.endswith("_reference") for n in dir(package)) or not list(base.glob("*reference.py")):
        missing.append(f"reference: core_kernels/{folder}/reference.py with a <op>_reference, exported")
    if not (base / "op.py").exists():
        return missing + [f"description: core_kernels/{folder}/op.py (OpAxes and PUBLIC)"]
    desc = importlib.import_module(f"core_kernels.{folder}.op")
    if not any(isinstance(v, OpAxes) for v in vars(desc).values()):
        missing.append(f"description: an OpAxes in core_kernels/{folder}/op.py")
    public = getattr(desc, "PUBLIC", ())
    if not public:
        missing.append(f"description: PUBLIC (the public functions) in core_kernels/{folder}/op.py")
    for fw in ("torch", "jax"):
        adapter = importlib.import_module(f"adapters.{fw}")
        for name in public:
            fn = getattr(adapter, name, None)
            if fn is None or not getattr(fn, "__module__", "").startswith(f"adapters.{fw}._ops_"):
                missing.append(f"adapter function: adapters.{fw}.{name}, defined in adapters/{fw}/_ops_*.py")
    if not (ROOT / "tests" / f"test_{folder}.py").exists():
        missing.append(f"tests: tests/test_{folder}.py")
    return missing


@pytest.mark.parametrize("folder", OP_FOLDERS)
def test_op_folder_has_every_piece(folder):
    """Each op folder has the pieces of ADDING_AN_OP.md's checklist; a missing one is named."""
    missing = _missing_pieces(folder)
    assert not missing, f"core_kernels/{folder}/ lacks: " + "; ".join(missing)


def test_example_op_is_the_guide_s():
    assert "example_scale" in OP_FOLDERS
    guide = (ROOT / "ADDING_AN_OP.md").read_text()
    assert "core_kernels/example_scale/" in guide and "tests/test_example_scale.py" in guide


def test_every_registered_torch_op_is_described():
    """Every custom op comes with its description (DTensor derives its strategies from it)."""
    import adapters.torch  # noqa: F401
    from adapters.torch._register import OPS
    from core_kernels.op_axes import OpAxes
    assert [n for n, call in OPS.items() if not isinstance(call.axes, OpAxes)] == []


def test_central_modules_name_no_op():
    """The generic modules hold no per-op table: no op's name appears in them (the ops'
    descriptions, rules and checks live in their folders and _ops_<op>.py modules)."""
    import importlib
    import re

    from core_kernels.op_axes import OpAxes
    names = set()
    for folder in OP_FOLDERS:
        desc = importlib.import_module(f"core_kernels.{folder}.op")
        names |= set(getattr(desc, "PUBLIC", ()))
        names |= {v.name for v in vars(desc).values() if isinstance(v, OpAxes)}
    found = {}
    for path in CENTRAL:
        text = (ROOT / path).read_text()
        hits = sorted(n for n in names if re.search(rf"\b{n}\b", text))
        if hits:
            found[path] = hits
    assert found == {}


def _imports(path: pathlib.Path, module: str) -> set:
    """The package modules ``module`` (at ``path``) imports, at any depth of its code."""
    import ast
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def test_no_import_cycles():
    """No module of core_kernels/ or adapters/ imports itself back through others
    (function-level imports included; a package's __init__ is not an edge back)."""
    modules = {}
    for top in ("core_kernels", "adapters"):
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            modules[name] = path
    graph = {m: {i for i in _imports(p, m) if i in modules and i != m and not modules[i].name == "__init__.py"}
             for m, p in modules.items()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []

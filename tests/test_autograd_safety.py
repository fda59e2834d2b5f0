"""torch ops and autograd (docs/scalar_policy.md, "Autograd"), for every registered op.

The eager fast path skips the dispatcher; it must still (a) refuse a call that
needs a backward the op does not have (eagerly and under torch.compile), while
no_grad / inference_mode calls run; (b) bump the version counter of every tensor
written in place; (c) refuse to write an inference tensor outside inference mode.
The generic tests iterate over adapters.torch._register.OPS, so an op added later
is covered by them and must bring a valid example: AUTOGRAD_EXAMPLES in its own
tests/test_<op>.py (or EXAMPLES below).
"""
import numpy as np
import pytest
import torch

import adapters.torch  # noqa: F401  (registers every op)
from adapters.torch._register import NAMESPACE, OPS
from core_kernels.blocksparse_attention import build_sparse_layout
from harness import DEVICE, GPU, rng, to_torch

BACKEND = "inductor" if GPU else "aot_eager"
NO_BACKWARD = "has no backward"
INFERENCE = "Inplace update to inference tensor outside InferenceMode"


def _schema(name):
    return OPS[name].op._opoverload._schema.arguments


def _args(name, values: dict) -> list:
    """Positional arguments of op ``name`` from ``values`` by schema name (absent: the
    schema's default, else None)."""
    return [values.get(a.name, a.default_value if a.has_default_value() else None) for a in _schema(name)]


def _dummy(name, *, grad=True, inference=()):
    """Arguments of the right kinds whatever the op (the checks run before validation)."""
    values = {}
    for a in _schema(name):
        t = str(a.type)
        if a.name in inference:  # optional or not
            with torch.inference_mode():
                values[a.name] = torch.zeros(2, device=DEVICE)
        elif t == "Tensor":
            values[a.name] = torch.zeros(2, device=DEVICE, requires_grad=grad)
        elif t in ("int", "SymInt"):
            values[a.name] = 1
        elif t == "float":
            values[a.name] = 1.0
        elif t == "bool":
            values[a.name] = False
        elif t == "str":
            values[a.name] = "auto"
    return _args(name, values)


# ------------------------------------------------------------------ examples
def _f32(*shape, seed=0):
    return to_torch(rng(seed).standard_normal(shape).astype(np.float32))


def _i(values, dtype=np.int32):
    return to_torch(np.asarray(values, dtype))


def _merge():
    return dict(output=_f32(5, 2, 16), prefix_output=_f32(5, 2, 16, seed=1), prefix_lse=_f32(2, 5, seed=2),
                suffix_output=_f32(5, 2, 16, seed=3), suffix_lse=_f32(2, 5, seed=4),
                output_lse=_f32(2, 5, seed=5))


def _merge_functional():
    return dict(prefix_output=_f32(5, 2, 16, seed=1), prefix_lse=_f32(2, 5, seed=2),
                suffix_output=_f32(5, 2, 16, seed=3), suffix_lse=_f32(2, 5, seed=4),
                prefill_tokens_with_context=3)


def _merge_backward():
    return dict(_merge_functional(), grad_output=_f32(5, 2, 16, seed=5), grad_output_lse=_f32(2, 5, seed=6))


def _prefix():
    import test_prefix_prefill as tpp
    c = tpp.make_case([(3, 5), (2, 0)], 2, 1, 16, 8, 8, "float32", seed=1)
    t = {n: to_torch(c[n]) for n in ("q", "k", "v", "k_cache", "v_cache", "b_loc", "b_start_loc",
                                      "b_seq_len")}
    return dict(t, o=_f32(*c["q"].shape), kv_cache_dtype="auto", max_seq_len=0,
                max_input_len=c["max_input_len"], skip_decode=False, causal=True, interleaved_v_pack_factor=0, is_block_table_ptr=False)


def _lightning():
    return dict(q=_f32(1, 2, 8, 16), k=_f32(1, 2, 8, 16, seed=1), v=_f32(1, 2, 8, 16, seed=2),
                ed=_i([0.1, 0.5], np.float32), block_size=4, output_final_state_only=False)


def _lightning_backward():
    d = _lightning()
    return dict(d, kv_history=None, kv=_f32(1, 2, 3, 16, 16, seed=3), grad_output=_f32(1, 2, 8, 16, seed=4),
                grad_kv=None, need_grad_ed=True)


def _cp_state():
    return dict(k=_f32(1, 2, 8, 16), v=_f32(1, 2, 8, 16, seed=1), ed=_i([0.1, 0.5], np.float32), reverse=False)


def _cp_compose():
    return dict(states=_f32(2, 1, 2, 16, 16), ed=_i([0.1, 0.5], np.float32), rank=_i([1]),
                init=_f32(1, 2, 16, 16, seed=1), shard_len=8, reverse=False)


def _varlen_backward():
    d = _varlen(False)
    cu = d["cu_seqlens"]
    return dict(q=d["q"], k=d["k"], v=d["v"], ed=d["ed"], cu_seqlens=cu,
                kv=_f32(cu.shape[0] - 1, 2, 16, 16, seed=5), grad_output=_f32(7, 2, 16, seed=6), grad_kv=None,
                kv_history=None, need_grad_ed=True)


def _decode():
    return dict(q=_f32(2, 2, 1, 16), k=_f32(2, 2, 1, 16, seed=1), v=_f32(2, 2, 1, 16, seed=2),
                kv_caches=_f32(3, 2, 16, 16, seed=3), slope_rate=_i([0.1, 0.5], np.float32),
                slot_idx=_i([2, 0], np.int64))


def _blocksparse():
    (crow, col), _ = build_sparse_layout(2, 32, 16, 1, 2, False)
    return dict(q=_f32(32, 2, 16), k=_f32(32, 1, 16, seed=1), v=_f32(32, 1, 16, seed=2),
                cu_seqlens_k=_i([0, 32]), crow=to_torch(np.ascontiguousarray(crow)),
                col=to_torch(np.ascontiguousarray(col)), sm_scale=0.25, block_size=16)


def _blocksparse_lse():
    d = _blocksparse()
    d.update(cu_seqlens_q=None, q_block_size=None, max_seqlen=None, config=None)
    return d


def _blocksparse_backward():
    d = _blocksparse_lse()
    with torch.no_grad():
        out, lse = OPS["blocksparse_flash_attn_varlen_fwd_lse"](*_args("blocksparse_flash_attn_varlen_fwd_lse", d))
    return dict(d, output=out, lse=lse, grad_output=_f32(32, 2, 16, seed=3))


def _varlen(cache):
    d = dict(q=_f32(7, 2, 16), k=_f32(7, 2, 16, seed=1), v=_f32(7, 2, 16, seed=2),
             ed=_i([0.1, 0.5], np.float32), cu_seqlens=_i([0, 3, 7]), block_size=16)
    if cache:
        d.update(kv_cache=_f32(3, 2, 16, 16, seed=3), slot_idx=_i([1, -1]))
    return d


def _varlen_history():
    return dict(_varlen(False), kv_history=_f32(2, 2, 16, 16, seed=4))


def _mask():
    return dict(lse=_f32(2, 6), query_start_loc=_i([0, 2, 6]), context_start_loc=_i([0, 0, 4]))


# name -> (valid arguments by schema name, the float input made to require grad)
EXAMPLES = {
    "merge_attn_states": (_merge, "prefix_output"),
    "merge_attn_states_functional": (_merge_functional, "prefix_lse"),
    "merge_attn_states_backward": (_merge_backward, "grad_output"),   # no double backward
    "context_attention_fwd": (_prefix, "q"),
    "lightning_attention": (_lightning, "k"),
    "lightning_attention_backward": (_lightning_backward, "grad_output"),   # no double backward
    "linear_decode_forward_triton": (_decode, "v"),
    "blocksparse_flash_attn_varlen_fwd": (_blocksparse, "q"),
    "blocksparse_flash_attn_varlen_fwd_lse": (_blocksparse_lse, "k"),
    "blocksparse_flash_attn_varlen_backward": (_blocksparse_backward, "grad_output"),   # no double backward
    "lightning_attention_varlen": (lambda: _varlen(False), "q"),
    "lightning_attention_varlen_backward": (_varlen_backward, "grad_output"),   # no double backward
    "lightning_attention_varlen_cache": (lambda: _varlen(True), "v"),
    "lightning_attention_varlen_history": (_varlen_history, "kv_history"),
    "mask_empty_context_lse": (_mask, None),   # its only float input is written in place
    "lightning_cp_state": (_cp_state, "k"),   # inside lightning_attention_cp's autograd.Function
    "lightning_cp_compose": (_cp_compose, "states"),
}


def _examples_of_op_tests() -> dict:
    """AUTOGRAD_EXAMPLES (same form as EXAMPLES) of the test module of each op folder
    (tests/test_<op>.py for core_kernels/<op>/op.py) that declares them: an op added
    later brings its example in its own tests (ADDING_AN_OP.md)."""
    import importlib
    import pathlib
    found = {}
    root = pathlib.Path(__file__).resolve().parents[1]
    for desc in sorted(root.glob("core_kernels/*/op.py")):
        path = root / "tests" / f"test_{desc.parent.name}.py"
        if path.exists() and "AUTOGRAD_EXAMPLES" in path.read_text():
            found.update(importlib.import_module(path.stem).AUTOGRAD_EXAMPLES)
    return found


EXAMPLES.update(_examples_of_op_tests())
ALL = sorted(OPS)
WITH_EXAMPLE = [n for n in ALL if n in EXAMPLES]
MUTATING = [n for n in ALL if OPS[n].mutates_args]
NO_BACKWARD_OPS = [n for n in ALL if not OPS[n].has_backward]


def _clone(values):
    return {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in values.items()}


def _flat(result):
    if result is None:
        return []
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _run(name, values):
    """Results and the mutated tensors after the call, as CPU tensors."""
    out = _flat(OPS[name](*_args(name, values)))
    return [t.detach().cpu() for t in out] + [values[m].detach().cpu() for m in OPS[name].mutates_args]


def _assert_same(a, b, what):
    assert len(a) == len(b), what
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.uint8) if x.dtype.itemsize == 1 else x,
                           y.view(torch.uint8) if y.dtype.itemsize == 1 else y) or \
            (torch.isnan(x) == torch.isnan(y)).all() and torch.equal(x.nan_to_num(), y.nan_to_num()), what


# ------------------------------------------------------------------ generic: every registered op
def test_every_registered_op_has_an_example():
    missing = [n for n in ALL if n not in EXAMPLES]
    assert not missing, f"add a valid example (AUTOGRAD_EXAMPLES of tests/test_<op>.py) for {missing}"
    assert {"merge_attn_states", "context_attention_fwd", "lightning_attention",
            "linear_decode_forward_triton", "blocksparse_flash_attn_varlen_fwd"} <= set(ALL)


@pytest.mark.parametrize("name", NO_BACKWARD_OPS)
def test_grad_required_raises_naming_the_op(name):
    with pytest.raises(RuntimeError, match=f"{NAMESPACE}::{name} {NO_BACKWARD}"):
        OPS[name](*_dummy(name))


@pytest.mark.parametrize("name", NO_BACKWARD_OPS)
def test_grad_required_raises_under_compile(name):
    call = OPS[name]
    torch._dynamo.reset()
    for fullgraph in (True, False):
        with pytest.raises(RuntimeError, match=f"{NAMESPACE}::{name} {NO_BACKWARD}"):
            torch.compile(lambda *a: call(*a), fullgraph=fullgraph, backend=BACKEND)(*_dummy(name))


@pytest.mark.parametrize("name", MUTATING)
def test_inference_tensor_written_outside_inference_mode_raises(name):
    for arg in OPS[name].mutates_args:
        with pytest.raises(RuntimeError, match=f"{arg}: {INFERENCE}"):
            OPS[name](*_dummy(name, grad=False, inference=(arg,)))


# ------------------------------------------------------------------ with valid inputs
@pytest.mark.parametrize("name", [n for n in WITH_EXAMPLE if n in NO_BACKWARD_OPS])
def test_grad_required_raises_before_any_launch(name):
    make, grad_input = EXAMPLES[name]
    values = make()
    grad_inputs = [grad_input] if grad_input else []
    if not grad_inputs:  # the written tensor itself requires grad (a leaf: torch refuses to write it)
        grad_inputs = [OPS[name].mutates_args[0]]
    for n in grad_inputs:
        values[n].requires_grad_(True)
    before = {m: values[m].detach().clone() for m in OPS[name].mutates_args}
    versions = {m: values[m]._version for m in OPS[name].mutates_args}
    with pytest.raises(RuntimeError, match=NO_BACKWARD):
        OPS[name](*_args(name, values))
    for m, t in before.items():
        assert torch.equal(values[m].detach(), t), f"{m} was written"
        assert values[m]._version == versions[m], f"{m}: version bumped without a write"
    if not OPS[name].mutates_args:  # functional: also as torch.ops.tandem_attn.<name>
        with pytest.raises(RuntimeError, match=NO_BACKWARD):
            OPS[name].op(*_args(name, values))


@pytest.mark.parametrize("name", WITH_EXAMPLE)
def test_no_grad_and_inference_mode_calls_run(name):
    make, grad_input = EXAMPLES[name]
    expected = _run(name, make())
    values = make()
    if grad_input:
        values[grad_input].requires_grad_(True)
    with torch.no_grad():
        _assert_same(_run(name, _clone(values) if not grad_input else values), expected, "no_grad")
    with torch.inference_mode():
        _assert_same(_run(name, make()), expected, "inference_mode, normal tensors")
        _assert_same(_run(name, make()), expected, "inference_mode, inference tensors")


@pytest.mark.parametrize("name", [n for n in WITH_EXAMPLE if n in MUTATING])
def test_in_place_writes_bump_the_version_counter(name):
    make, _ = EXAMPLES[name]
    values = make()
    before = {m: values[m]._version for m in OPS[name].mutates_args if values.get(m) is not None}
    OPS[name](*_args(name, values))
    for m, v in before.items():
        assert values[m]._version > v, f"{m}: version counter not bumped (eager)"
    with torch.inference_mode():  # normal tensors written in inference mode: bumped as well
        OPS[name](*_args(name, values))
    for m, v in before.items():
        assert values[m]._version > v + 1, f"{m}: version counter not bumped (inference mode)"


@pytest.mark.parametrize("name", [n for n in WITH_EXAMPLE if n in MUTATING])
def test_in_place_writes_bump_the_version_counter_compiled(name):
    make, _ = EXAMPLES[name]
    values = make()
    expected = _run(name, make())
    call = OPS[name]
    torch._dynamo.reset()
    before = {m: values[m]._version for m in call.mutates_args if values.get(m) is not None}
    args = _args(name, values)
    result = torch.compile(lambda *a: call(*a), fullgraph=True, backend=BACKEND)(*args)
    for m, v in before.items():
        assert values[m]._version > v, f"{m}: version counter not bumped (compiled)"
    got = [t.detach().cpu() for t in _flat(result)] + [values[m].detach().cpu() for m in call.mutates_args]
    _assert_same(got, expected, "compiled result")


def test_a_tensor_saved_for_backward_and_overwritten_is_detected():
    """The point of (b): autograd sees the in-place write and refuses a stale backward."""
    values = _merge()
    w = torch.ones_like(values["output"], requires_grad=True)
    loss = (w * values["output"]).sum()  # saves output for w's gradient
    OPS["merge_attn_states"](*_args("merge_attn_states", values))  # writes output in place
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_merge_in_place_with_grad_runs_its_backward():
    """merge_attn_states writes in place but has a backward (through its functional
    op): a call that needs one records it instead of raising, eagerly and compiled."""
    assert OPS["merge_attn_states"].has_backward and OPS["merge_attn_states_functional"].has_backward
    for compiled in (False, True):
        values = _merge()
        values["prefix_lse"].requires_grad_(True)
        call = OPS["merge_attn_states"]
        if compiled:
            torch._dynamo.reset()
            call = torch.compile(lambda *a: OPS["merge_attn_states"](*a), fullgraph=True, backend=BACKEND)
        call(*_args("merge_attn_states", values))
        assert values["output"].grad_fn is not None and values["output_lse"].grad_fn is not None
        values["output"].sum().backward()
        assert values["prefix_lse"].grad is not None and values["prefix_lse"].grad.shape == (2, 5)


def test_blocksparse_with_grad_runs_its_backward():
    """blocksparse_flash_attn_varlen_fwd has a backward (through its LSE op): a call
    that needs one records it instead of raising, eagerly and compiled; the
    registered op itself (a dispatcher call cannot be rerouted) still refuses."""
    name = "blocksparse_flash_attn_varlen_fwd"
    assert OPS[name].has_backward and OPS["blocksparse_flash_attn_varlen_fwd_lse"].has_backward
    for compiled in (False, True):
        values = _blocksparse()
        values["q"].requires_grad_(True)
        call = OPS[name]
        if compiled:
            torch._dynamo.reset()
            call = torch.compile(lambda *a: OPS[name](*a), fullgraph=True, backend=BACKEND)
        out = call(*_args(name, values))
        assert out.grad_fn is not None
        out.sum().backward()
        assert values["q"].grad is not None and values["q"].grad.shape == (32, 2, 16)
    with pytest.raises(RuntimeError, match=NO_BACKWARD):
        OPS[name].op(*_args(name, values))


def test_inference_tensor_written_inside_inference_mode():
    values = _decode()
    expected = _run("linear_decode_forward_triton", _clone(values))
    with torch.inference_mode():
        inf_values = {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in values.items()}
        got = _run("linear_decode_forward_triton", inf_values)
    _assert_same(got, expected, "inference tensors in inference mode")
    with pytest.raises(RuntimeError, match=f"kv_caches: {INFERENCE}"):  # and not outside it
        OPS["linear_decode_forward_triton"](*_args("linear_decode_forward_triton", inf_values))
    assert torch.equal(inf_values["kv_caches"].cpu(), got[-1]), "written before the error"

"""The torch adapter's replay of repeated eager calls (adapters.torch._call_memo.CallMemo).

A call with the layouts and host scalars of an earlier successful call runs
that call's plan on the new tensors without the op's Python. These tests
check that a replay computes what the regular path computes on fresh data
(against independent references and bitwise against the regular path), and
that every call the regular path would treat differently misses: other
strides, dtypes, scalar values or scalar types, aliasing, absent tensors,
index validation, gradients, inference tensors, tensor subclasses, calls
that fail.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import adapters.torch as at
from adapters.torch import _call_memo as cm, _executor as ex, _launcher as la, _replay as rp
from adapters.torch import _ops_blocksparse, _ops_lightning, _ops_merge, _ops_prefix_prefill
from core_kernels.blocksparse_attention import build_sparse_layout
from harness import DEVICE, assert_bitwise_equal, torch_to_numpy
from test_blocksparse_attention import formula_block_mask, make_batch, reference as bs_reference

TOL = 2e-5  # float32 against float64 references


@pytest.fixture(autouse=True)
def fresh_memos():
    ex.set_call_memo(True)  # empties every memo
    yield
    ex.set_call_memo(True)


@pytest.fixture
def regular_path_calls(monkeypatch):
    """How many calls reached the regular path's plan lookup (execute's _cached)."""
    calls = []
    orig = ex._cached

    def counted(*args):
        calls.append(args[0])
        return orig(*args)
    monkeypatch.setattr(ex, "_cached", counted)
    return calls


def gpu_fallbacks(monkeypatch):
    """A list that gets an item for each replay of a GPU entry through _run_gpu
    (CallMemo._replay: where the entry's straight-line run declined the call)."""
    calls = []
    orig = ex.CallMemo._replay

    def counted(self, entry, tensors):
        if entry.prog is not None:
            calls.append(1)
        return orig(self, entry, tensors)
    monkeypatch.setattr(ex.CallMemo, "_replay", counted)
    return calls


def gen(seed):
    return torch.Generator().manual_seed(int(seed))


# ------------------------------------------------------------------ merge
def merge_inputs(seed, n=5, h=3, d=16, lse_transposed=False):
    g = gen(seed)
    po, so = (torch.randn(n, h, d, generator=g).to(DEVICE) for _ in range(2))
    if lse_transposed:  # [H, N] views of [N, H] memory
        pl, sl = (torch.randn(n, h, generator=g).to(DEVICE).t() for _ in range(2))
    else:
        pl, sl = (torch.randn(h, n, generator=g).to(DEVICE) for _ in range(2))
    pl[0, 0] = float("inf")  # an empty prefix part
    return po, pl, so, sl


def merge_reference(po, pl, so, sl):
    po, pl, so, sl = (x.detach().cpu().double() for x in (po, pl, so, sl))
    pl = torch.where(torch.isinf(pl), -torch.inf, pl)
    sl = torch.where(torch.isinf(sl), -torch.inf, sl)
    m = torch.maximum(pl, sl)
    wp, ws = torch.exp(pl - m), torch.exp(sl - m)
    out = (po * wp.t()[:, :, None] + so * ws.t()[:, :, None]) / (wp + ws).t()[:, :, None]
    return out, m + torch.log(wp + ws)


def poisoned(shape, **kw):
    return torch.full(shape, float("nan"), device=DEVICE, **kw)


def test_repeated_merge_is_replayed_on_new_data(regular_path_calls):
    memo = _ops_merge._MEMO
    for i in range(5):
        po, pl, so, sl = merge_inputs(100 + i)
        out, lse = poisoned(po.shape), poisoned(pl.shape)
        version = out._version
        at.merge_attn_states(out, po, pl, so, sl, lse)
        ref_out, ref_lse = merge_reference(po, pl, so, sl)
        torch.testing.assert_close(out.cpu().double(), ref_out, atol=TOL, rtol=TOL)
        torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=TOL, rtol=TOL)
        assert out._version > version  # the in-place write is visible to autograd's checks
        assert len(memo.entries) == (i > 0)  # the second call of a plan makes the entry
    assert len(regular_path_calls) == 2  # the first two calls only


def test_other_layouts_miss_and_the_memo_stays_small(regular_path_calls):
    memo = _ops_merge._MEMO
    cases = [dict(), dict(lse_transposed=True), dict(n=7), dict(h=4), dict(d=32), dict(n=2, h=5)]
    for case in cases:
        for seed in (1, 2, 3):
            po, pl, so, sl = merge_inputs(seed, **case)
            out = poisoned(po.shape)
            at.merge_attn_states(out, po, pl, so, sl)
            torch.testing.assert_close(out.cpu().double(), merge_reference(po, pl, so, sl)[0],
                                       atol=TOL, rtol=TOL)
        if cases.index(case) < memo.size:  # while there is room: two misses, then a replay
            assert len(regular_path_calls) == 2 * (cases.index(case) + 1)
    assert len(memo.entries) == memo.size < len(cases)
    calls = len(regular_path_calls)
    # a padded output (another head stride) misses too
    po, pl, so, sl = merge_inputs(3)
    wide = poisoned((5, 3, 32))
    at.merge_attn_states(wide[:, :, :16], po, pl, so, sl)
    torch.testing.assert_close(wide[:, :, :16].cpu().double(), merge_reference(po, pl, so, sl)[0],
                               atol=TOL, rtol=TOL)
    assert wide[:, :, 16:].isnan().all()
    assert len(regular_path_calls) == calls + 1


def test_layouts_that_do_not_repeat_make_no_entries_and_unused_entries_back_off(monkeypatch):
    memo = _ops_merge._MEMO
    built = []
    orig_guard = cm._layout_guard
    monkeypatch.setattr(cm, "_layout_guard", lambda ts: built.append(1) or orig_guard(ts))

    def merge(n):
        po, pl, so, sl = merge_inputs(n, n=n)
        out = poisoned(po.shape)
        at.merge_attn_states(out, po, pl, so, sl)
        torch.testing.assert_close(out.cpu().double(), merge_reference(po, pl, so, sl)[0], atol=TOL, rtol=TOL)
    for n in range(1, 11):  # every call a new token count (prefill lengths)
        merge(n)
    assert not built and not memo.entries
    for n in range(11, 31):  # each count twice, never again: entries made and dropped unused
        merge(n)
        merge(n)
    assert len(memo.entries) == memo.size
    assert memo.skip + memo.last_skip > 0 and len(built) < 20  # it stopped making every one
    for _ in range(3):  # a layout that does repeat still gets its entry (after the skipped ones)
        for _ in range(70):
            merge(40)
    assert any(e.hits for e in memo.entries)


def test_inference_tensor_write_refused_after_a_replayed_layout():
    po, pl, so, sl = merge_inputs(4)
    out = torch.empty_like(po)
    at.merge_attn_states(out, po, pl, so, sl)
    at.merge_attn_states(out, po, pl, so, sl)
    with torch.inference_mode():
        inference_out = torch.empty_like(po)
    with pytest.raises(RuntimeError, match="output: Inplace update to inference tensor"):
        at.merge_attn_states(inference_out, po, pl, so, sl)


def test_gradients_take_the_regular_path():
    po, pl, so, sl = merge_inputs(5)
    pl[0, 0] = 0.5  # every part present: the weights below are finite
    out = torch.empty_like(po)
    at.merge_attn_states(out, po, pl, so, sl)  # recorded without grad
    po.requires_grad_()
    out = torch.empty_like(po)
    at.merge_attn_states(out, po, pl, so, sl)
    assert out.grad_fn is not None
    out.sum().backward()
    # d out / d po = the prefix weight, per token and head
    wp = torch.exp(pl.detach().cpu().double() - merge_reference(po.detach(), pl, so, sl)[1]).t()
    torch.testing.assert_close(po.grad.cpu().double(), wp[:, :, None].expand(po.shape),
                               atol=TOL, rtol=TOL)
    # and a call that needs no gradient takes the plain path again, without one
    with torch.no_grad():
        out2 = torch.empty_like(po)
        at.merge_attn_states(out2, po, pl, so, sl)
    assert out2.grad_fn is None


def test_layout_guard_refuses_what_the_regular_path_treats_differently():
    a = torch.randn(4, 6)
    guard = cm._layout_guard([a])
    if guard is None:
        pytest.skip("this torch has no TensorGuards: no memo at all")

    class Sub(torch.Tensor):
        pass
    with torch.inference_mode():
        inference = torch.randn(4, 6)
    refused = {
        "transposed": torch.randn(6, 4).t(), "padded": torch.randn(4, 8)[:, :6], "dtype": a.double(),
        "requires_grad": torch.randn(4, 6, requires_grad=True), "subclass": torch.randn(4, 6).as_subclass(Sub),
        "inference": inference, "neg view": torch.randn(4, 6)._neg_view(), "shape": torch.randn(4, 7),
        "not a tensor": np.zeros((4, 6), np.float32),
    }
    assert guard.check(torch.randn(4, 6)) and guard.check(torch.randn(8, 6)[4:])
    for what, t in refused.items():
        assert not guard.check(t), what


# ------------------------------------------------------------------ block-sparse
LAYOUT = build_sparse_layout(4, 128, 16, 2, 3, False)[0]
MASK = formula_block_mask(4, 8, 2, 3, False)


def bs_call(seed, decode=True, alias=True, **kw):
    lens = [5, 40, 17] if decode else [20, 33]
    q, k, v, cu_k, cu_q = make_batch(lens, None if decode else lens, 4, 2, 16, "float32", seed)
    t = [torch.from_numpy(np.ascontiguousarray(x)).to(DEVICE) for x in (q, k, v, cu_k)]
    cu_q_t = None if decode else (t[3] if alias else t[3].clone())
    crow, col = (torch.from_numpy(np.array(x)).to(DEVICE) for x in LAYOUT)
    out = at.blocksparse_flash_attn_varlen_fwd(*t, cu_q_t, kw.pop("sm_scale", None), (crow, col),
                                               block_size=16, **kw)
    ref = bs_reference(q, k, v, cu_k, cu_q, MASK, 16)
    return out, ref, (t, cu_q_t, crow, col)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_blocksparse_replay_matches_the_reference_and_the_regular_path(decode, regular_path_calls):
    for seed in (10, 11, 12):
        out, ref, args = bs_call(seed, decode)
        np.testing.assert_allclose(torch_to_numpy(out), ref, atol=TOL, rtol=TOL)
    assert len(regular_path_calls) == 2 and len(_ops_blocksparse._MEMO.entries) == 1
    (q, k, v, cu_k), cu_q, crow, col = args
    replayed = at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, cu_q, None, (crow, col), block_size=16)
    ex.set_call_memo(False)
    regular = at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, cu_q, None, (crow, col), block_size=16)
    assert_bitwise_equal(torch_to_numpy(replayed), torch_to_numpy(regular), "replay vs regular path")


def test_blocksparse_aliasing_and_scalars_are_part_of_the_match(regular_path_calls):
    for seed in (20, 21, 22):
        bs_call(seed, decode=False, alias=True)
    assert len(regular_path_calls) == 2
    out, ref, _ = bs_call(23, decode=False, alias=False)  # cu_seqlens_q a copy: another entry
    np.testing.assert_allclose(torch_to_numpy(out), ref, atol=TOL, rtol=TOL)
    assert len(regular_path_calls) == 3 and len(_ops_blocksparse._MEMO.entries) == 2
    # another sm_scale value: another result, not the recorded one
    out_a, _, args = bs_call(23, sm_scale=0.5)
    (q, k, v, cu_k), cu_q, crow, col = args
    out_b = at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, None, 0.25, (crow, col), block_size=16)
    out_a2 = at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, None, 0.5, (crow, col), block_size=16)
    assert_bitwise_equal(torch_to_numpy(out_a), torch_to_numpy(out_a2), "same scale")
    assert not torch.equal(out_a, out_b)
    # the same value as another type is checked as the regular path checks it
    with pytest.raises(TypeError, match="block_size"):
        at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, None, 0.5, (crow, col), block_size=16.0)
    with pytest.raises(TypeError, match="block_size"):
        at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, None, 0.5, (crow, col), block_size=True)
    out_np = at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, None, 0.5, (crow, col),
                                                  block_size=np.int64(16))  # accepted, not recorded
    assert_bitwise_equal(torch_to_numpy(out_np), torch_to_numpy(out_a2), "numpy block_size")
    assert all(type(s) in cm._SCALAR_TYPES for e in _ops_blocksparse._MEMO.entries for s in e.scalars)


def test_index_validation_runs_on_replayed_layouts(monkeypatch):
    _, _, ((q, k, v, cu_k), _, crow, col) = bs_call(30)
    bs_call(31)
    bad = cu_k.clone()
    bad[1] = 10 ** 6  # past the key tokens
    with pytest.raises(ValueError, match="^cu_seqlens_k: "):
        at.blocksparse_flash_attn_varlen_fwd(q, k, v, bad, None, None, (crow, col), block_size=16,
                                             validate_indices=True)
    monkeypatch.setenv("TANDEM_VALIDATE_INDICES", "1")
    with pytest.raises(ValueError, match="^cu_seqlens_k: "):
        at.blocksparse_flash_attn_varlen_fwd(q, k, v, bad, None, None, (crow, col), block_size=16)
    with pytest.raises(TypeError, match="validate_indices"):
        at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, None, None, (crow, col), block_size=16,
                                             validate_indices=0)


def test_a_failed_call_is_not_recorded(regular_path_calls):
    _, _, ((q, k, v, cu_k), _, crow, col) = bs_call(40)
    memo = _ops_blocksparse._MEMO
    memo.entries.clear()
    for _ in range(2):
        with pytest.raises((TypeError, ValueError), match="^k: "):
            at.blocksparse_flash_attn_varlen_fwd(q, k.double(), v, cu_k, None, None, (crow, col), block_size=16)
    assert not memo.entries
    # a call that failed left its recording behind: a validating call of the same
    # layouts must not turn it into an entry for the failed call's scalars
    with pytest.raises(ValueError):
        at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, None, None, (crow, col), block_size=16,
                                             q_block_size=24)
    at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, None, None, (crow, col), block_size=16,
                                         validate_indices=True)
    assert not memo.entries
    # a failed call's recording keeps none of its tensors alive
    import gc
    import weakref
    wide_k = k.double()
    alive = weakref.ref(wide_k)
    with pytest.raises((TypeError, ValueError), match="^k: "):
        at.blocksparse_flash_attn_varlen_fwd(q, wide_k, v, cu_k, None, None, (crow, col), block_size=16)
    assert cm._RECORDING.state is None  # the failed call's recording was abandoned
    del wide_k
    gc.collect()
    assert alive() is None


# ------------------------------------------------------------------ the other ops
def test_lightning_prefill_replay_is_bitwise_the_regular_path(regular_path_calls):
    g = gen(50)
    ed = torch.rand(2, generator=g).to(DEVICE)
    results = []
    for _ in range(3):
        q, k, v = (torch.randn(1, 2, 20, 16, generator=g).to(DEVICE) for _ in range(3))
        results.append(((q, k, v), at.lightning_attention(q, k, v, ed, 8)))
    assert len(regular_path_calls) == 2 and len(_ops_lightning._PREFILL_MEMO.entries) == 1
    ex.set_call_memo(False)
    for (q, k, v), (out, kv) in results:
        out_r, kv_r = at.lightning_attention(q, k, v, ed, 8)
        assert_bitwise_equal(torch_to_numpy(out), torch_to_numpy(out_r), "output")
        assert_bitwise_equal(torch_to_numpy(kv), torch_to_numpy(kv_r), "kv")
    # a kv_history, and final-state-only, are other entries, replayed as such
    ex.set_call_memo(True)
    hist = torch.randn(1, 2, 16, 16, generator=g).to(DEVICE)
    for final_only in (False, True, False, True, False, True):  # the last two replayed
        replayed = at.lightning_attention(q, k, v, ed, 8, hist, final_only)
    assert len(_ops_lightning._PREFILL_MEMO.entries) == 2  # set_call_memo emptied it
    ex.set_call_memo(False)
    for got, want in zip(replayed, at.lightning_attention(q, k, v, ed, 8, hist, True), strict=True):
        assert_bitwise_equal(torch_to_numpy(got), torch_to_numpy(want), "history, final state only")
    assert replayed[1].shape == (1, 2, 16, 16)
    assert not torch.equal(replayed[0], results[-1][1][0])  # the history counts


def test_prefix_prefill_replay_is_bitwise_the_regular_path():
    from test_prefix_prefill import check, make_case, reference

    def run(case):
        t = {n: (torch.from_numpy(np.ascontiguousarray(x)).to(DEVICE) if isinstance(x, np.ndarray) else x)
             for n, x in case.items()}
        o = poisoned(t["q"].shape)
        at.context_attention_fwd(t["q"], t["k"], t["v"], o, "auto", t["k_cache"], t["v_cache"], t["b_loc"],
                                 t["b_start_loc"], t["b_seq_len"], 0, t["max_input_len"])
        return torch_to_numpy(o)
    outs = []
    first = make_case([(5, 20), (3, 9)], 2, 1, 32, 16, 8, "float32", seed=60)
    g = np.random.default_rng(61)
    for i in range(3):  # the same cache and table, new queries and keys
        case = dict(first) if i else first
        if i:
            case.update({n: g.standard_normal(first[n].shape).astype(np.float32) for n in ("q", "k", "v")})
        outs.append((case, run(case)))
        check(outs[-1][1], reference(case), "float32", f"call {i}")
    assert len(_ops_prefix_prefill._MEMO.entries) == 1
    ex.set_call_memo(False)
    for case, out in outs:
        assert_bitwise_equal(out, run(case), "replay vs regular path")


def test_host_checked_calls_are_never_replayed():
    """linear decode with host slot ids checks their values on every call."""
    g = gen(70)
    q, k, v = (torch.randn(2, 2, 1, 16, generator=g).to(DEVICE) for _ in range(3))
    cache = torch.randn(3, 2, 16, 16, generator=g).to(DEVICE)
    slope = torch.rand(2, generator=g).to(DEVICE)
    slots = torch.tensor([0, 2], dtype=torch.int32)
    if DEVICE != "cpu":
        pytest.skip("host slot ids with GPU tensors: another device (the planner refuses)")
    for _ in range(2):
        at.linear_decode_forward_triton(q, k, v, cache, slope, slots)
    with pytest.raises(ValueError, match="slot_idx"):
        at.linear_decode_forward_triton(q, k, v, cache, slope, torch.tensor([0, 3], dtype=torch.int32))
    assert not _ops_lightning._DECODE_MEMO.entries


# ------------------------------------------------------------------ the GPU replay, on stubs
def test_gpu_replay_launches_what_the_regular_path_launches(monkeypatch):
    """A memo entry's GPU run (_straight) on the executor with its CUDA touch points
    stubbed (benchmarks/experiments/exp_host_python.py): for each op's decode-size
    call, the replayed call hands the kernel launcher exactly the arguments the
    regular path hands it (pointers included: allocations come from a fixed pool
    here), the returned buffers are the same, and so are the version counters'
    bumps of the tensors it writes."""
    from benchmarks.experiments import exp_host_python as e
    launched = []
    e.stub_gpu(monkeypatch.setattr, launched)
    monkeypatch.setattr(ex, "_PLANS", {})
    monkeypatch.setattr(la, "_PROGRAMS", {})
    monkeypatch.setattr(la, "_STREAM_SCRATCH", {})
    pool = {}

    def pooled(shape, strides, dtype=None, device=None):  # one tensor per layout: pointers repeat
        key = (tuple(shape), tuple(strides), dtype)
        if key not in pool:
            pool[key] = torch.empty_strided(shape, strides, dtype=dtype).fill_(float("nan"))
        return pool[key]
    monkeypatch.setattr(la, "_empty_strided", pooled)  # the regular path's allocation
    monkeypatch.setattr(rp, "_empty_strided", pooled)  # the replay's templates
    monkeypatch.setattr(rp, "_new_empty_strided", lambda like, shape, strides: pooled(shape, strides, like.dtype))
    regular_calls = []
    orig_cached = ex._cached
    monkeypatch.setattr(ex, "_cached", lambda *a: regular_calls.append(1) or orig_cached(*a))
    arguments = []
    orig_lookup = ex.CallMemo.lookup
    monkeypatch.setattr(ex.CallMemo, "lookup", lambda self, tensors, *a: arguments.append(tensors)
                        or orig_lookup(self, tensors, *a))

    generic = gpu_fallbacks(monkeypatch)

    def versions():  # the version counters of the last call's tensors (None: absent)
        return [None if t is None else t._version for t in arguments[-1]]
    replayed = 0
    for name, call in e.cases():
        ex.set_call_memo(False)
        launched.clear()
        regular_result = call()
        before = versions()
        call()
        regular = list(launched)[len(launched) // 2:]
        regular_bumps = [b if a is None else b - a for a, b in zip(before, versions())]
        ex.set_call_memo(True)
        call()
        call()  # the second regular call of a plan makes its entry
        launched.clear()
        regular_calls.clear()
        before = versions()
        replay_result = call()
        replayed += not regular_calls
        assert regular and launched == regular, name
        assert not generic, name  # the entry's straight-line replay ran (_straight)
        # a replay bumps the version counters of the tensors it writes, as the regular path does
        assert [b if a is None else b - a for a, b in zip(before, versions())] == regular_bumps, name
        flat = (lambda r: [] if r is None else [r] if isinstance(r, torch.Tensor) else list(r))
        for a, b in zip(flat(regular_result), flat(replay_result), strict=True):
            assert a.data_ptr() == b.data_ptr() and a.shape == b.shape, name
        ex.set_call_memo(True)
    # linear decode and varlen check their host index data (CPU here) on every call: never replayed
    assert replayed == len(e.cases()) - 2


# ------------------------------------------------------------------ the straight-line replay's fallbacks
def test_unaligned_views_of_a_replayed_layout(monkeypatch, regular_path_calls):
    """Views with a recorded layout but pointers off the 16-byte grid (a storage
    offset of one element) are replayed too: on the GPU the straight-line replay
    (_straight), whose kernels were compiled for aligned pointers, hands
    the call to _run_gpu (the regular path's run), which launches the kernel Triton compiles
    for those pointers; the next aligned call is straight-line again."""
    tables = gpu_fallbacks(monkeypatch)

    def unaligned(x):  # the same sizes and strides, one element further on
        flat = torch.full((x.numel() + 1,), float("nan"), device=DEVICE)
        view = flat[1:].view(x.shape)
        view.copy_(x)
        assert view.stride() == x.stride() and view.data_ptr() % 16
        return view
    for seed in (40, 41, 42):  # the entry, then a replay
        po, pl, so, sl = merge_inputs(seed)
        out = poisoned(po.shape)
        at.merge_attn_states(out, po, pl, so, sl)
    assert len(regular_path_calls) == 2 and not tables
    # (seed, unaligned, replays through _run_gpu so far on the GPU)
    for seed, shift, expected in ((43, True, 1), (44, False, 1), (45, True, 2)):
        po, pl, so, sl = merge_inputs(seed)
        out = poisoned(po.shape)
        if shift:
            po, so, out = unaligned(po), unaligned(so), unaligned(out)
        at.merge_attn_states(out, po, pl, so, sl)
        torch.testing.assert_close(out.cpu().double(), merge_reference(po, pl, so, sl)[0], atol=TOL, rtol=TOL)
        if DEVICE == "cuda":
            assert len(tables) == expected, seed
    assert len(regular_path_calls) == 2  # every call after the second replayed


def test_unaligned_views_on_stubs_launch_what_the_regular_path_launches(monkeypatch):
    """The same fallback with CUDA stubbed (so that CI runs it): the _run_gpu
    replay of unaligned views hands the launcher the regular path's arguments."""
    from benchmarks.experiments import exp_host_python as e
    launched = []
    e.stub_gpu(monkeypatch.setattr, launched)
    monkeypatch.setattr(ex, "_PLANS", {})
    monkeypatch.setattr(la, "_PROGRAMS", {})
    tables = gpu_fallbacks(monkeypatch)
    po, pl, so, sl = (x.cpu() for x in merge_inputs(60))
    out = torch.empty_like(po)
    for _ in range(3):
        at.merge_attn_states(out, po, pl, so, sl)
    assert len(_ops_merge._MEMO.entries) == 1 and not tables
    flat = torch.empty(2 * po.numel() + 1)
    po1, out1 = flat[1:po.numel() + 1].view(po.shape), flat[po.numel() + 1:].view(po.shape)
    assert po1.data_ptr() % 16 and out1.data_ptr() % 16
    launched.clear()
    at.merge_attn_states(out1, po1, pl, so, sl)
    replayed = list(launched)
    assert tables == [1]
    ex.set_call_memo(False)
    launched.clear()
    at.merge_attn_states(out1, po1, pl, so, sl)
    assert replayed == launched and po1.data_ptr() in launched[0] and out1.data_ptr() in launched[0]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_cuda_graph_capture_of_replayed_calls():
    """A replayed call captured in a CUDA graph: block-sparse decode (per-stream
    scratch, which a capture allocates afresh: the replay through _run_gpu) and merge
    (no scratch: the straight-line replay runs under the capture). The graphs
    replay on new data, against the references; eager replays before and after
    share nothing with the capture."""
    for seed in (50, 51, 52):  # the entries, then replays
        out, ref, (t, cu_q, crow, col) = bs_call(seed)
        np.testing.assert_allclose(torch_to_numpy(out), ref, atol=TOL, rtol=TOL)
        po, pl, so, sl = merge_inputs(seed)
        m_out = poisoned(po.shape)
        at.merge_attn_states(m_out, po, pl, so, sl)
    assert any(a[4] is la._PER_STREAM for a in _ops_blocksparse._MEMO.entries[0].prog.allocs)  # split scratch
    q, k, v, cu_k = t
    eager = at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, None, None, (crow, col), block_size=16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = at.blocksparse_flash_attn_varlen_fwd(q, k, v, cu_k, None, None, (crow, col), block_size=16)
        at.merge_attn_states(m_out, po, pl, so, sl)
    new_out, new_ref, (new_t, _, _, _) = bs_call(53)  # an eager replay on other data after the capture
    new_po, new_pl, new_so, new_sl = merge_inputs(53)
    for static, fresh in zip((q, k, v, cu_k, po, pl, so, sl), (*new_t, new_po, new_pl, new_so, new_sl)):
        static.copy_(fresh)
    captured.fill_(float("nan"))
    m_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    np.testing.assert_allclose(torch_to_numpy(captured), new_ref, atol=TOL, rtol=TOL)
    assert_bitwise_equal(torch_to_numpy(captured), torch_to_numpy(new_out), "graph vs eager replay")
    torch.testing.assert_close(m_out.cpu().double(), merge_reference(po, pl, so, sl)[0], atol=TOL, rtol=TOL)
    np.testing.assert_allclose(torch_to_numpy(eager), ref, atol=TOL, rtol=TOL)

"""Opt-in index validation (issue 19, item 2; docs/index_validation.md).

With validation on (TANDEM_VALIDATE_INDICES=1 or ``validate_indices=True``),
every bad index case the issue lists raises a ValueError naming its argument
before anything is launched, in both adapters; valid data passes and gives the
same result as without validation. Off, nothing is read back from the device
and no check runs. Bad cases never reach a kernel: ``run_plan`` is replaced by
a sentinel, so a check that failed to raise shows up as ``Launched`` instead of
a crash of the interpreter.
"""
from __future__ import annotations

import contextlib
import importlib

import numpy as np
import pytest
import torch

from core_kernels import _index_check
from core_kernels.blocksparse_attention import build_sparse_layout, check_blocksparse_attention
from core_kernels.prefix_prefill import check_prefix_prefill
from harness import (DEVICE, GPU, JaxAdapter, TorchAdapter, assert_bitwise_equal, requires_gpu, rng, to_jax,
                     to_torch, torch_to_numpy)
import adapters.torch as at

ENV = _index_check.ENV_VAR


class Launched(Exception):
    """Raised by the run_plan stand-in: the call got past validation to its launch."""


# ------------------------------------------------------------------ inputs (numpy)
def prefix_case(seed=0):
    """Two sequences (query, context) = (3, 5), (2, 2); cache blocks of 4 tokens,
    8 blocks, a 3-column table whose unused slots hold wild ids (never read)."""
    g = rng(seed)
    t, hq, hkv, d, bs, nb, x = 5, 2, 1, 16, 4, 8, 8
    f = lambda *s: g.standard_normal(s).astype(np.float32)  # noqa: E731
    return dict(q=f(t, hq, d), k=f(t, hkv, d), v=f(t, hkv, d), k_cache=f(nb, hkv, d // x, bs, x),
                v_cache=f(nb, hkv, d, bs), b_loc=np.array([[1, 2, 99], [3, -7, 50]], np.int32),
                b_start_loc=np.array([0, 3, 5], np.int32), b_seq_len=np.array([8, 4], np.int32),
                max_input_len=3)


def _with(case, name, index, value):
    case = dict(case)
    case[name] = np.array(case[name], copy=True)
    case[name][index] = value
    return case


# name: (mutation of prefix_case(), the argument the error names)
PREFIX_BAD = {
    "block-id-past-cache": (lambda c: _with(c, "b_loc", (0, 1), 8), "b_loc"),
    "block-id-negative": (lambda c: _with(c, "b_loc", (1, 0), -1), "b_loc"),
    "seq-len-past-block-table": (lambda c: _with(c, "b_seq_len", 0, 3 + 13), "b_seq_len"),
    "start-loc-past-tokens": (lambda c: _with(c, "b_start_loc", 2, 6), "b_start_loc"),
    "start-loc-decreasing": (lambda c: _with(c, "b_start_loc", 1, 6), "b_start_loc"),
    "start-loc-negative": (lambda c: _with(c, "b_start_loc", 0, -1), "b_start_loc"),
    "query-longer-than-sequence": (lambda c: _with(c, "b_seq_len", 1, 1), "b_seq_len"),
    "seq-len-negative": (lambda c: _with(c, "b_seq_len", 1, -2), "b_seq_len"),
    "max-input-len-too-small": (lambda c: {**c, "max_input_len": 2}, "max_input_len"),
    # sequence 0's context is 5 tokens: a bound of 4 would leave it NaN
    "max-seq-len-below-a-context": (lambda c: {**c, "max_seq_len": 4}, "max_seq_len"),
}

# valid data the checks must not refuse: entries the kernels never read are free
PREFIX_GOOD = {
    "plain": lambda c: c,
    # a window of 2 hides sequence 0's cache positions 0..3 (its first block)
    "window-hides-first-block": lambda c: {**_with(c, "b_loc", (0, 0), 1000), "sliding_window": 2},
    # skip_decode skips a sequence with one query: its table row is never read
    "skip-decode-row": lambda c: {**_with(_with(_with(c, "b_start_loc", 2, 4), "b_seq_len", 1, 3),
                                         "b_loc", (1, 0), -5), "skip_decode": True},
    "new-kv-from-cache": lambda c: {**c, "k": None, "v": None},
    "max-seq-len-the-longest-context": lambda c: {**c, "max_seq_len": 5},
}


def blocksparse_case(seed=0):
    """k lengths (20, 33), query lengths (20, 5): prefill and prefill over a cached
    prefix; blocks of 16, a 4-row layout per head (covers 64 tokens)."""
    g = rng(seed)
    (crow, col), _ = build_sparse_layout(2, 64, 16, 2, 2, False, None)
    f = lambda *s: g.standard_normal(s).astype(np.float32)  # noqa: E731
    return dict(q=f(25, 2, 16), k=f(53, 1, 16), v=f(53, 1, 16),
                cu_seqlens_k=np.array([0, 20, 53], np.int32),
                cu_seqlens_q=np.array([0, 20, 25], np.int32), crow=crow, col=col, max_seqlen=None)


def _decode_batch(c):
    return {**c, "q": c["q"][:2], "cu_seqlens_q": None}


def _full_prefill(c):
    return {**c, "q": rng(1).standard_normal((53, 2, 16)).astype(np.float32), "cu_seqlens_q": None}


def _longer_than_layout(c):
    g = rng(2)
    return {**c, "k": g.standard_normal((90, 1, 16)).astype(np.float32),
            "v": g.standard_normal((90, 1, 16)).astype(np.float32),
            "cu_seqlens_k": np.array([0, 20, 90], np.int32)}


BLOCKSPARSE_BAD = {
    "cu-k-decreasing": (lambda c: _with(c, "cu_seqlens_k", 1, 60), "cu_seqlens_k"),
    "cu-k-past-tokens": (lambda c: _with(c, "cu_seqlens_k", 2, 54), "cu_seqlens_k"),
    "cu-q-decreasing": (lambda c: _with(c, "cu_seqlens_q", 1, 26), "cu_seqlens_q"),
    "cu-q-short-of-tokens": (lambda c: _with(c, "cu_seqlens_q", 2, 24), "cu_seqlens_q"),
    "cu-q-past-tokens": (lambda c: _with(c, "cu_seqlens_q", 2, 26), "cu_seqlens_q"),
    "prefill-cu-k-short-of-q": (lambda c: _with(_full_prefill(c), "cu_seqlens_k", 2, 50),
                                "cu_seqlens_k"),
    "crow-decreasing": (lambda c: _with(c, "crow", (1, 2), 0), "sparse_layout"),
    "crow-past-col": (lambda c: _with(c, "crow", (0, 4), 10), "sparse_layout"),
    "col-past-blocks": (lambda c: _with(c, "col", (0, 7), 4), "sparse_layout"),
    "col-negative": (lambda c: _with(c, "col", (1, 3), -1), "sparse_layout"),
    "col-not-ascending": (lambda c: _with(_with(c, "col", (0, 5), 2), "col", (0, 6), 1),
                          "sparse_layout"),
    "sequence-longer-than-layout": (_longer_than_layout, "cu_seqlens_k"),
    "q-longer-than-k": (lambda c: _with(c, "cu_seqlens_q", 1, 21), "cu_seqlens_q"),
    "decode-without-keys": (lambda c: _with(_decode_batch(c), "cu_seqlens_k", 1, 0), "cu_seqlens_k"),
    "max-seqlen-too-small": (lambda c: {**c, "max_seqlen": 32}, "max_seqlen"),
}

BLOCKSPARSE_GOOD = {"prefix": lambda c: c, "decode": _decode_batch, "full-prefill": _full_prefill,
                    "k-longer-than-read": lambda c: {**_longer_than_layout(c),
                                                     "cu_seqlens_k": np.array([0, 20, 53], np.int32)}}


def decode_case(seed=0):
    g = rng(seed)
    b, h, d, slots = 3, 2, 16, 4
    f = lambda *s: g.standard_normal(s).astype(np.float32)  # noqa: E731
    return dict(q=f(b, h, 1, d), k=f(b, h, 1, d), v=f(b, h, 1, d), kv_caches=f(slots, h, d, d),
                slope_rate=g.uniform(0.1, 1.0, h).astype(np.float32),
                slot_idx=np.array([2, -1, 0], np.int32))


DECODE_BAD = {  # (slot ids, caught without validation too: host data is range-checked always)
    "slot-past-cache": ([4, -1, 0], True),
    "slot-below-minus-one": ([2, -2, 0], True),
    "duplicate-slots": ([2, 0, 2], False),
}


def varlen_case(seed=0):
    g = rng(seed)
    lens, h, d, slots = [5, 0, 9], 2, 16, 4
    t = sum(lens)
    f = lambda *s: g.standard_normal(s).astype(np.float32)  # noqa: E731
    return dict(q=f(t, h, d), k=f(t, h, d), v=f(t, h, d), ed=g.uniform(0.1, 1.0, h).astype(np.float32),
                cu_seqlens=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
                kv_cache=f(slots, h, d, d), slot_idx=np.array([3, -1, 0], np.int64))


VARLEN_BAD = {  # (what changes, the argument named)
    "cu-not-from-zero": (dict(cu_seqlens=np.array([1, 5, 5, 14], np.int32)), "cu_seqlens"),
    "cu-decreasing": (dict(cu_seqlens=np.array([0, 6, 5, 14], np.int32)), "cu_seqlens"),
    "cu-short-of-T": (dict(cu_seqlens=np.array([0, 5, 5, 12], np.int32)), "cu_seqlens"),
    "slot-past-cache": (dict(slot_idx=np.array([4, -1, 0], np.int64)), "slot_idx"),
    "duplicate-slots": (dict(slot_idx=np.array([2, -1, 2], np.int64)), "slot_idx"),
}


# ------------------------------------------------------------------ switching
@contextlib.contextmanager
def switch(how, monkeypatch):
    """Validation on through the environment ("env") or the call ("call");
    yields the keyword arguments of the call."""
    if how == "env":
        monkeypatch.setenv(ENV, "1")
        yield {}
    else:
        monkeypatch.delenv(ENV, raising=False)
        yield {"validate_indices": True}


class IndexValidationTests:
    """One body per test, run for each adapter (subclasses implement the calls)."""
    OPS = {"prefix": "_ops_prefix_prefill", "blocksparse": "_ops_blocksparse",
           "decode": "_ops_lightning", "varlen": "_ops_lightning_varlen"}

    def module(self, op):
        return importlib.import_module(f"adapters.{self.adapter}.{self.OPS[op]}")

    def no_launch(self, monkeypatch, op):
        def launched(*args, **kwargs):
            raise Launched(op)
        if hasattr(self.module(op), "run_plan"):
            monkeypatch.setattr(self.module(op), "run_plan", launched)
        if self.adapter == "torch":  # where the torch executor starts a plan's run (after its checks)
            ex = importlib.import_module("adapters.torch._executor")
            for name in ("_run_interpreted", "_run_gpu"):
                monkeypatch.setattr(ex, name, launched)
            # a replayed call's GPU run (CallMemo): the entries recorded by earlier tests go,
            # and no call here succeeds, so none is made
            ex.set_call_memo(True)

    def no_validation(self, monkeypatch):
        """Any host copy or check of index data fails the test."""
        def called(*args, **kwargs):
            raise AssertionError("index validation ran")
        monkeypatch.setattr(importlib.import_module(f"adapters.{self.adapter}._index_validation"),
                            "host_arrays", called)
        # each op's check lives in its folder; the adapters' op modules call it by that name
        for op, name in (("prefix", "check_prefix_prefill"), ("blocksparse", "check_blocksparse_attention"),
                         ("decode", "check_linear_decode")):
            monkeypatch.setattr(self.module(op), name, called)

    # ---------------------------------------------------------- prefix prefill
    @pytest.mark.parametrize("how", ["env", "call"])
    @pytest.mark.parametrize("case", PREFIX_BAD)
    def test_prefix_prefill_refuses(self, case, how, monkeypatch):
        mutate, arg = PREFIX_BAD[case]
        self.no_launch(monkeypatch, "prefix")
        with switch(how, monkeypatch) as kw, pytest.raises(ValueError, match=f"^{arg}: "):
            self.prefix(mutate(prefix_case()), **kw)

    @pytest.mark.parametrize("how", ["env", "call"])
    @pytest.mark.parametrize("case", PREFIX_GOOD)
    def test_prefix_prefill_accepts_valid(self, case, how, monkeypatch):
        c = PREFIX_GOOD[case](prefix_case())
        monkeypatch.delenv(ENV, raising=False)
        expected = self.prefix(c)
        with switch(how, monkeypatch) as kw:
            assert_bitwise_equal(self.prefix(c, **kw), expected, case)

    # ---------------------------------------------------------- block-sparse
    @pytest.mark.parametrize("how", ["env", "call"])
    @pytest.mark.parametrize("case", BLOCKSPARSE_BAD)
    def test_blocksparse_refuses(self, case, how, monkeypatch):
        mutate, arg = BLOCKSPARSE_BAD[case]
        self.no_launch(monkeypatch, "blocksparse")
        with switch(how, monkeypatch) as kw, pytest.raises(ValueError, match=f"^{arg}: "):
            self.blocksparse(mutate(blocksparse_case()), **kw)

    @pytest.mark.parametrize("case", BLOCKSPARSE_GOOD)
    def test_blocksparse_accepts_valid(self, case, monkeypatch):
        c = BLOCKSPARSE_GOOD[case](blocksparse_case())
        monkeypatch.delenv(ENV, raising=False)
        expected = self.blocksparse(c)
        assert_bitwise_equal(self.blocksparse(c, validate_indices=True), expected, case)

    def test_blocksparse_module_passes_the_switch_on(self, monkeypatch):
        c = blocksparse_case()
        self.no_launch(monkeypatch, "blocksparse")
        module = self.framework.LocalStridedBlockSparseAttn(2, 64, 2, 2, 16)
        bad = self.array(np.array([0, 20, 10], np.int32))
        with pytest.raises(ValueError, match="^cu_seqlens_k: "):
            module.forward(*(self.array(c[n]) for n in ("q", "k", "v")), bad,
                           self.array(c["cu_seqlens_q"]), validate_indices=True)

    # ---------------------------------------------------------- lightning decode
    @pytest.mark.parametrize("how", ["env", "call"])
    @pytest.mark.parametrize("case", DECODE_BAD)
    def test_decode_refuses(self, case, how, monkeypatch):
        ids, _ = DECODE_BAD[case]
        self.no_launch(monkeypatch, "decode")
        with switch(how, monkeypatch) as kw, pytest.raises(ValueError, match="^slot_idx: "):
            self.decode({**decode_case(), "slot_idx": np.array(ids, np.int32)}, **kw)

    @pytest.mark.parametrize("case", DECODE_BAD)
    def test_decode_host_ids_range_checked_without_validation(self, case, monkeypatch):
        """Host (CPU) slot ids cost no sync: their range is checked always, as before."""
        if GPU:
            pytest.skip("the ids are device data on the GPU: checked only when validating")
        ids, always = DECODE_BAD[case]
        monkeypatch.delenv(ENV, raising=False)
        self.no_launch(monkeypatch, "decode")
        with pytest.raises(ValueError if always else Launched):
            self.decode({**decode_case(), "slot_idx": np.array(ids, np.int32)})

    def test_decode_accepts_valid(self, monkeypatch):
        c = decode_case()
        monkeypatch.delenv(ENV, raising=False)
        expected = self.decode(c)
        monkeypatch.setenv(ENV, "1")
        for a, b in zip(self.decode(c), expected):
            assert_bitwise_equal(a, b)

    # ---------------------------------------------------------- lightning varlen
    @pytest.mark.parametrize("how", ["env", "call"])
    @pytest.mark.parametrize("case", VARLEN_BAD)
    def test_varlen_refuses(self, case, how, monkeypatch):
        change, name = VARLEN_BAD[case]
        self.no_launch(monkeypatch, "varlen")
        with switch(how, monkeypatch) as kw, pytest.raises(ValueError, match=f"^{name}: "):
            self.varlen({**varlen_case(), **change}, **kw)

    def test_varlen_accepts_valid(self, monkeypatch):
        c = varlen_case()
        monkeypatch.delenv(ENV, raising=False)
        expected = self.varlen(c)
        monkeypatch.setenv(ENV, "1")
        for a, b in zip(self.varlen(c), expected):
            assert_bitwise_equal(a, b)

    # ---------------------------------------------------------- off: nothing read back
    @pytest.mark.parametrize("env", [None, "0", "1"])
    def test_off_reads_nothing_back(self, env, monkeypatch):
        """Off (the default, or validate_indices=False over the environment): no
        host copy and no check; bad data goes straight to the launch."""
        if env is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, env)
        kw = {"validate_indices": False} if env == "1" else {}
        self.no_validation(monkeypatch)
        for op in ("prefix", "blocksparse", "decode"):
            self.no_launch(monkeypatch, op)
        with pytest.raises(Launched):
            self.prefix(PREFIX_BAD["block-id-past-cache"][0](prefix_case()), **kw)
        with pytest.raises(Launched):
            self.blocksparse(BLOCKSPARSE_BAD["col-past-blocks"][0](blocksparse_case()), **kw)
        with pytest.raises(Launched):
            self.decode({**decode_case(), "slot_idx": np.array([2, 0, 2], np.int32)}, **kw)

    def test_planner_errors_come_first(self, monkeypatch):
        """Arguments of the wrong dtype or shape are the planner's errors, validation on or off."""
        monkeypatch.setenv(ENV, "1")
        c = blocksparse_case()
        with pytest.raises(TypeError, match="^cu_seqlens_k: "):
            self.blocksparse({**c, "cu_seqlens_k": c["cu_seqlens_k"].astype(np.float32)})
        with pytest.raises(ValueError, match="^b_start_loc: expected shape"):
            self.prefix({**prefix_case(), "b_start_loc": np.array([0, 3], np.int32)})

    def test_flag_must_be_a_bool(self):
        with pytest.raises(TypeError, match="^validate_indices: "):
            self.decode(decode_case(), validate_indices="yes")


class TestTorch(TorchAdapter, IndexValidationTests):
    framework = at

    def prefix(self, c, **kw):
        t = lambda n: None if c[n] is None else to_torch(c[n])  # noqa: E731
        o = torch.zeros(c["q"].shape, dtype=torch.float32, device=DEVICE)
        k_cache = t("k_cache")
        b_loc = to_torch(c["b_loc_ptr"](k_cache)) if "b_loc_ptr" in c else t("b_loc")
        at.context_attention_fwd(t("q"), t("k"), t("v"), o, "auto", k_cache, t("v_cache"), b_loc,
                                 t("b_start_loc"), t("b_seq_len"), c.get("max_seq_len", 0),
                                 c["max_input_len"],
                                 sliding_window=c.get("sliding_window"),
                                 skip_decode=c.get("skip_decode", False),
                                 is_block_table_ptr="b_loc_ptr" in c, **kw)
        return torch_to_numpy(o)

    def blocksparse(self, c, **kw):
        t = lambda n: None if c[n] is None else to_torch(c[n])  # noqa: E731
        out = at.blocksparse_flash_attn_varlen_fwd(
            t("q"), t("k"), t("v"), t("cu_seqlens_k"), t("cu_seqlens_q"), None,
            (t("crow"), t("col")), block_size=16, max_seqlen=c["max_seqlen"], **kw)
        return torch_to_numpy(out)

    def decode(self, c, **kw):
        cache = to_torch(c["kv_caches"])
        out = at.linear_decode_forward_triton(
            *(to_torch(c[n]) for n in ("q", "k", "v")), cache, to_torch(c["slope_rate"]),
            to_torch(c["slot_idx"]), **kw)
        return torch_to_numpy(out), torch_to_numpy(cache)

    def varlen(self, c, **kw):
        cache = to_torch(c["kv_cache"])
        out, _ = at.lightning_attention_varlen(
            *(to_torch(c[n]) for n in ("q", "k", "v", "ed", "cu_seqlens")), kv_cache=cache,
            slot_idx=to_torch(c["slot_idx"]), **kw)
        return torch_to_numpy(out), torch_to_numpy(cache)

    # ---------------------------------------------------------- block addresses (torch only:
    # JAX takes them on the GPU only)
    @staticmethod
    def _addresses(ids, base=None, bad=None):
        def b_loc_ptr(k_cache):
            per_block = k_cache.stride(0) * k_cache.element_size()
            addr = np.where(ids >= 0, k_cache.data_ptr() + ids.astype(np.int64) * per_block, 0)
            if bad is not None:
                addr[bad[0]] = k_cache.data_ptr() + bad[1] * per_block + bad[2]
            return addr.astype(np.int64)
        return b_loc_ptr

    @pytest.mark.parametrize("bad", [((0, 1), 8, 0), ((0, 1), -1, 0), ((1, 0), 3, 2), ((0, 0), None, 0)],
                             ids=["past-cache", "before-cache", "misaligned", "unused-slot-read"])
    def test_block_addresses_refused(self, bad, monkeypatch):
        monkeypatch.delenv(ENV, raising=False)
        self.no_launch(monkeypatch, "prefix")
        ids = np.array([[1, 2, -1], [3, -1, -1]])
        pos, blk, extra = bad
        case = {**prefix_case(), "b_loc_ptr": self._addresses(
            ids, bad=None if blk is None else (pos, blk, extra))}
        if blk is None:  # 0 (unused) where the sequence reads
            ids = ids.copy()
            ids[pos] = -1
            case["b_loc_ptr"] = self._addresses(ids)
        with pytest.raises(ValueError, match="^b_loc: "):
            self.prefix(case, validate_indices=True)

    def test_int32_block_addresses_are_the_planners_error(self, monkeypatch):
        monkeypatch.setenv(ENV, "1")
        ids = np.array([[1, 2, -1], [3, -1, -1]])
        addresses = self._addresses(ids)
        case = {**prefix_case(), "b_loc_ptr": lambda kc: addresses(kc).astype(np.int32)}
        with pytest.raises(TypeError, match="^b_loc: "):
            self.prefix(case)

    def test_block_addresses_accepted(self, monkeypatch):
        monkeypatch.delenv(ENV, raising=False)
        ids = np.array([[1, 2, -1], [3, -1, -1]])
        case = {**prefix_case(), "b_loc_ptr": self._addresses(ids)}
        assert_bitwise_equal(self.prefix(case, validate_indices=True), self.prefix(case))

    # ---------------------------------------------------------- torch.compile
    def _compiled_decode(self, **kw):
        c = decode_case()
        args = [to_torch(c[n]) for n in ("q", "k", "v", "kv_caches", "slope_rate", "slot_idx")]
        fn = torch.compile(lambda *a: at.linear_decode_forward_triton(*a, **kw), fullgraph=True,
                           backend="eager")
        torch._dynamo.reset()
        return fn(*args)

    def test_compile_env_switch_skips(self, monkeypatch):
        """The environment switch skips traced calls: no graph break, nothing read."""
        monkeypatch.setenv(ENV, "1")
        self.no_validation(monkeypatch)
        out = self._compiled_decode()
        monkeypatch.setenv(ENV, "0")
        expected = self.decode(decode_case())[0]
        assert_bitwise_equal(torch_to_numpy(out), expected)

    def test_compile_explicit_request_raises(self, monkeypatch):
        monkeypatch.delenv(ENV, raising=False)
        with pytest.raises(Exception, match="validate_indices: index validation reads"):
            self._compiled_decode(validate_indices=True)

    # ---------------------------------------------------------- GPU: one copy, none when off
    @requires_gpu
    def test_gpu_off_makes_no_sync_and_on_copies_once(self, monkeypatch):
        c = decode_case()
        args = [to_torch(c[n]) for n in ("q", "k", "v", "kv_caches", "slope_rate", "slot_idx")]
        monkeypatch.delenv(ENV, raising=False)
        at.linear_decode_forward_triton(*args)          # warm: plans, compiled kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            at.linear_decode_forward_triton(*args)      # off: a sync would raise here
            with pytest.raises(RuntimeError):            # on: the one copy to the host
                at.linear_decode_forward_triton(*args, validate_indices=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        copies = []
        real_cpu = torch.Tensor.cpu
        monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(1) or real_cpu(self, *a, **k))
        bs = blocksparse_case()
        at.blocksparse_flash_attn_varlen_fwd(
            *(to_torch(bs[n]) for n in ("q", "k", "v", "cu_seqlens_k", "cu_seqlens_q")), None,
            (to_torch(bs["crow"]), to_torch(bs["col"])), block_size=16, validate_indices=True)
        assert len(copies) == 1


class TestJax(JaxAdapter, IndexValidationTests):
    @property
    def framework(self):
        import adapters.jax as aj
        return aj

    def prefix(self, c, **kw):
        import adapters.jax as aj
        j = lambda n: None if c[n] is None else to_jax(c[n])  # noqa: E731
        out = aj.context_attention_fwd(
            *(j(n) for n in ("q", "k", "v", "k_cache", "v_cache", "b_loc", "b_start_loc", "b_seq_len")),
            max_input_len=c["max_input_len"], max_seq_len=c.get("max_seq_len"),
            sliding_window=c.get("sliding_window"), skip_decode=c.get("skip_decode", False), **kw)
        return np.asarray(out)

    def blocksparse(self, c, **kw):
        import adapters.jax as aj
        j = lambda n: None if c[n] is None else to_jax(c[n])  # noqa: E731
        out = aj.blocksparse_flash_attn_varlen_fwd(
            j("q"), j("k"), j("v"), j("cu_seqlens_k"), j("cu_seqlens_q"), None, (j("crow"), j("col")),
            block_size=16, max_seqlen=c["max_seqlen"], **kw)
        return np.asarray(out)

    def decode(self, c, **kw):
        import adapters.jax as aj
        out, cache = aj.linear_decode_forward_triton(
            *(to_jax(c[n]) for n in ("q", "k", "v", "kv_caches", "slope_rate", "slot_idx")), **kw)
        return np.asarray(out), np.asarray(cache)

    def varlen(self, c, **kw):
        import adapters.jax as aj
        out, cache = aj.lightning_attention_varlen(
            *(to_jax(c[n]) for n in ("q", "k", "v", "ed", "cu_seqlens")), kv_cache=to_jax(c["kv_cache"]),
            slot_idx=to_jax(c["slot_idx"]), **kw)
        return np.asarray(out), np.asarray(cache)

    # ---------------------------------------------------------- jax.jit
    def _jitted_blocksparse(self, **kw):
        import jax
        import adapters.jax as aj
        c = blocksparse_case()
        fn = jax.jit(lambda q, k, v, cu_k, cu_q, crow, col: aj.blocksparse_flash_attn_varlen_fwd(
            q, k, v, cu_k, cu_q, None, (crow, col), block_size=16, **kw))
        return fn(*(to_jax(c[n]) for n in ("q", "k", "v", "cu_seqlens_k", "cu_seqlens_q", "crow", "col")))

    def test_jit_env_switch_skips(self, monkeypatch):
        monkeypatch.setenv(ENV, "1")
        self.no_validation(monkeypatch)
        out = np.asarray(self._jitted_blocksparse())
        monkeypatch.setenv(ENV, "0")
        assert_bitwise_equal(out, self.blocksparse(blocksparse_case()))

    def test_jit_explicit_request_raises(self, monkeypatch):
        monkeypatch.delenv(ENV, raising=False)
        with pytest.raises(ValueError, match="^validate_indices: .*traced"):
            self._jitted_blocksparse(validate_indices=True)

    @requires_gpu
    def test_gpu_off_transfers_nothing(self, monkeypatch):
        import jax
        c = decode_case()
        monkeypatch.delenv(ENV, raising=False)
        args = [jax.device_put(c[n]) for n in ("q", "k", "v", "kv_caches", "slope_rate", "slot_idx")]
        import adapters.jax as aj
        jax.block_until_ready(aj.linear_decode_forward_triton(*args))
        with jax.transfer_guard_device_to_host("disallow_explicit"):
            jax.block_until_ready(aj.linear_decode_forward_triton(*args))
            with pytest.raises(Exception):
                aj.linear_decode_forward_triton(*args, validate_indices=True)


# ------------------------------------------------------------------ the switch itself
@pytest.mark.parametrize("value,on", [(None, False), ("", False), ("0", False), ("false", False),
                                      ("off", False), ("no", False), ("1", True), ("true", True),
                                      ("ON", True), ("yes", True)])
def test_environment_switch(value, on, monkeypatch):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert _index_check.requested(None) is on
    assert _index_check.requested(True) is True and _index_check.requested(False) is False


def test_checks_skip_malformed_shapes():
    """Shapes that do not fit each other are the planner's errors: the checks say nothing."""
    c = prefix_case()
    check_prefix_prefill(
        dict(b_loc=c["b_loc"], b_start_loc=c["b_start_loc"][:2], b_seq_len=c["b_seq_len"]),
        num_tokens=5, num_blocks=8, block_size=4, max_input_len=0)
    b = blocksparse_case()
    check_blocksparse_attention(
        dict(cu_seqlens_k=b["cu_seqlens_k"], cu_seqlens_q=b["cu_seqlens_q"][:2], crow=b["crow"],
             col=b["col"]), num_q_tokens=25, num_k_tokens=53, block_size=16)


def test_messages_say_what_and_where():
    c = PREFIX_BAD["block-id-past-cache"][0](prefix_case())
    with pytest.raises(ValueError) as err:
        check_prefix_prefill(
            {n: c[n] for n in ("b_loc", "b_start_loc", "b_seq_len")}, num_tokens=5, num_blocks=8,
            block_size=4, max_input_len=3)
    assert str(err.value) == ("b_loc: entry [0, 1]: block id 8, outside the cache's [0, 8) blocks "
                              "(used by sequence 0's cache positions 4..7)")

"""lightning_attention_varlen: packed sequences in one launch, states from and to
a slot cache (issue 22), both adapters against the float64 recurrence per sequence."""
import dataclasses

import numpy as np
import pytest
import torch

from core_kernels._interpret import run_plan_numpy
from core_kernels._plan import ArrayInfo
from core_kernels._target import Target
from core_kernels.lightning_attention import (LightningGluonConfig, LightningVarlenConfig,
                                              LightningVarlenGluonConfig,
                                              lightning_attention_varlen_reference,
                                              plan_lightning_attention_varlen)
from core_kernels.lightning_attention.varlen_plan import varlen_work_items
from harness import (DEVICE, FLOAT_DTYPES, GPU, JaxAdapter, TorchAdapter, assert_bitwise_equal,
                     assert_close, cast, decay_rates, jax_to_numpy, requires_gpu, rng, to_jax, to_torch,
                     torch_to_numpy)
import adapters.torch as at

# tolerance multipliers on harness.TOL for values normalised by the reference's RMS
# (as tests/test_lightning_attention.py: on the GPU fp32/fp16 products are tf32)
GPU_SCALE = {"float32": 250.0, "float16": 3.0, "bfloat16": 4.0}
HOPPER = Target("cuda", 90, 132, gluon=True)
# a config that cuts sequences into items of 16 tokens (chunks of 16): the chained scan
SPLIT = LightningVarlenConfig(block_t=16, segment_len=16)
WHOLE = LightningVarlenConfig(segment_len=0)  # one item per sequence


def check(actual, expected, dtype, what):
    e = np.asarray(expected, np.float64)
    a = np.asarray(actual, np.float64)
    r = float(np.sqrt(np.mean(e ** 2))) if e.size else 1.0
    assert_close(a / (r or 1.0), e / (r or 1.0), dtype, what, GPU_SCALE[dtype] if GPU else 1.0)


def check_relative(actual, expected, dtype, what, axis=1):
    """Relative Frobenius error per head (``axis``); NaN never passes."""
    a = np.moveaxis(np.asarray(actual, np.float64), axis, 0).reshape(actual.shape[axis], -1)
    e = np.moveaxis(np.asarray(expected, np.float64), axis, 0).reshape(actual.shape[axis], -1)
    assert not np.isnan(a).any(), f"{what}: NaN in the output"
    rel = np.sqrt(((a - e) ** 2).sum(1)) / np.maximum(np.sqrt((e ** 2).sum(1)), 1e-30)
    bound = {"float32": 2e-3, "float16": 3e-3, "bfloat16": 2e-2}[dtype]
    assert rel.max() <= bound, f"{what}: relative error {rel.max():.3g} > {bound} (head {rel.argmax()})"


def make_varlen(lens, h, d, e, dtype, num_slots=0, seed=None, index_dtype=np.int32):
    """Packed q, k, v [T, H, *], ed [H] (head 0 without decay), cu_seqlens, a cache."""
    g = rng(seed)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(index_dtype)
    t = int(cu[-1])
    q = cast(g.standard_normal((t, h, d)), dtype)
    k = cast(g.standard_normal((t, h, d)), dtype)
    v = cast(g.standard_normal((t, h, e)), dtype)
    ed = decay_rates(g, h)
    cache = g.standard_normal((num_slots, h, d, e)).astype(np.float32) if num_slots else None
    return q, k, v, ed, cu, cache


def reference(q, k, v, ed, cu, cache=None, slots=None):
    return lightning_attention_varlen_reference(q.astype(np.float64), k.astype(np.float64),
                                                v.astype(np.float64), ed, cu, cache, slots)


def untouched(cache, slots):
    return [s for s in range(cache.shape[0]) if s not in set(np.asarray(slots).tolist())]


def ci(x):
    return ArrayInfo.contiguous(x.shape, x.dtype.name)


# (lens, H, D, E, config): empty and one-token sequences, lengths that are not
# multiples of block_size / chunks / items, an all-empty batch (T = 0), a
# sequence ending on an item boundary (a trailing empty item), non-power-of-two
# head sizes, the planner's choice, one item per sequence and the chained scan
CASES = [
    ([5, 0, 40, 1, 33, 0], 2, 16, 24, None),
    ([5, 0, 40, 1, 33, 0], 2, 16, 24, SPLIT),
    ([32, 17, 0, 48], 3, 24, 40, LightningVarlenConfig(block_t=16, segment_len=32)),
    ([1], 2, 32, 32, None),
    ([0, 0, 0], 2, 16, 16, None),
    ([70, 2], 1, 16, 16, WHOLE),
    ([300, 10], 1, 16, 16, None),  # one head: the planner itself cuts (items of 128 tokens)
]


def _case_id(c):
    return "L{}-H{}-D{}-E{}-{}".format("_".join(map(str, c[0])), c[1], c[2], c[3],
                                       "auto" if c[4] is None else f"seg{c[4].segment_len}")


def _slots_for(b, num_slots, seed=0):
    """Distinct slots for B sequences, every third one -1."""
    slots = rng(seed).permutation(num_slots)[:b].astype(np.int64)
    slots[1::3] = -1
    return slots


class VarlenTests:
    """Every varlen test, written once; a subclass per adapter implements ``run``,
    ``run_poisoned`` and ``target`` (and may add framework-only tests)."""

    def run(self, q, k, v, ed, cu, cache=None, slots=None, *, config=None, jit=False):
        """numpy inputs -> numpy (output, new cache or final states) through this adapter."""
        raise NotImplementedError

    def run_poisoned(self, plan, arrays):
        """Run ``plan`` with its allocated results supplied pre-filled with NaN;
        returns every result by name."""
        raise NotImplementedError

    def target(self) -> Target:
        raise NotImplementedError

    @pytest.mark.parametrize("cached", [True, False], ids=["cache", "states"])
    @pytest.mark.parametrize("case", CASES, ids=_case_id)
    def test_matches_reference(self, case, cached):
        lens, h, d, e, config = case
        num_slots = len(lens) + 2
        q, k, v, ed, cu, cache = make_varlen(lens, h, d, e, "float32", num_slots if cached else 0)
        slots = _slots_for(len(lens), num_slots) if cached else None
        out, state = self.run(q, k, v, ed, cu, cache, slots, config=config)
        ref_out, ref_state = reference(q, k, v, ed, cu, cache, slots)
        assert out.dtype == q.dtype and out.shape == (cu[-1], h, e) and state.dtype == np.float32
        check(out, ref_out, "float32", "output")
        check(state, ref_state, "float32", "cache" if cached else "final states")
        if cached:
            keep = untouched(cache, slots)
            assert_bitwise_equal(state[keep], cache[keep], "slots not named (or -1)")

    @pytest.mark.parametrize("config", [None, SPLIT], ids=["auto", "split"])
    def test_infinite_decay(self, config):
        """ed = +inf (lambda = 0): each token's state is its own k^T v, as the
        prefill (docs/scalar_policy.md); other heads unaffected, NaN stays in its head."""
        lens = [5, 0, 40, 1, 33]
        q, k, v, _, cu, cache = make_varlen(lens, 4, 16, 16, "float32", 7)
        ed = np.array([np.inf, 0.5, 1e38, np.nan], np.float32)
        slots = np.array([6, 0, -1, 3, 2], np.int64)
        out, state = self.run(q, k, v, ed, cu, cache, slots, config=config)
        ref_out, ref_state = reference(q[:, :3], k[:, :3], v[:, :3], ed[:3], cu, cache[:, :3], slots)
        check(out[:, :3], ref_out, "float32", "output, finite and infinite rates")
        check(state[:, :3], ref_state, "float32", "cache, finite and infinite rates")
        own = np.einsum("td,td->t", q[:, 0], k[:, 0])[:, None] * v[:, 0]
        check(out[:, 0], own, "float32", "lambda = 0: o_t = (q_t . k_t) v_t")
        assert np.isnan(out[:, 3]).all(), "a NaN rate propagates within its head"

    @pytest.mark.parametrize("dtype", FLOAT_DTYPES)
    def test_dtypes(self, dtype):
        q, k, v, ed, cu, cache = make_varlen([9, 0, 50, 1], 2, 32, 16, dtype, 5)
        slots = np.array([4, 0, -1, 2], np.int64)
        out, new_cache = self.run(q, k, v, ed, cu, cache, slots, config=SPLIT)
        ref_out, ref_cache = reference(q, k, v, ed, cu, cache, slots)
        assert out.dtype == q.dtype
        check(out, ref_out, dtype, "output")
        check(new_cache, ref_cache, dtype, "cache")
        assert_bitwise_equal(new_cache[[1, 3]], cache[[1, 3]], "untouched slots")

    @pytest.mark.parametrize("cu_dtype,slot_dtype", [(np.int32, np.int32), (np.int64, np.int64),
                                                     (np.int32, np.int64), (np.int64, np.int32)])
    def test_index_dtypes(self, cu_dtype, slot_dtype):
        q, k, v, ed, cu, cache = make_varlen([20, 3, 0, 17], 2, 16, 16, "float32", 6, index_dtype=cu_dtype)
        slots = np.array([5, -1, 1, 0], slot_dtype)
        out, new_cache = self.run(q, k, v, ed, cu, cache, slots, config=SPLIT)
        ref_out, ref_cache = reference(q, k, v, ed, cu, cache, slots)
        check(out, ref_out, "float32", "output")
        check(new_cache, ref_cache, "float32", "cache")
        assert_bitwise_equal(new_cache[[2, 3, 4]], cache[[2, 3, 4]], "untouched slots")

    @pytest.mark.parametrize("layout", ["H", "H11", "1H11"])
    def test_decay_layouts(self, layout):
        q, k, v, ed, cu, _ = make_varlen([7, 30], 3, 16, 16, "float32")
        shaped = {"H": ed, "H11": ed.reshape(3, 1, 1), "1H11": ed.reshape(1, 3, 1, 1)}[layout]
        out, states = self.run(q, k, v, shaped, cu)
        ref_out, ref_states = reference(q, k, v, ed, cu)
        check(out, ref_out, "float32", "output")
        check(states, ref_states, "float32", "final states")

    def test_slot_minus_one_starts_from_zero_and_writes_nothing(self):
        q, k, v, ed, cu, cache = make_varlen([12, 25], 2, 16, 16, "float32", 3)
        slots = np.array([-1, -1], np.int32)
        out, new_cache = self.run(q, k, v, ed, cu, cache, slots, config=SPLIT)
        assert_bitwise_equal(new_cache, cache, "cache with every slot -1")
        ref_out, ref_states = reference(q, k, v, ed, cu)  # from zero
        check(out, ref_out, "float32", "output")

    def test_matches_single_sequence_calls(self):
        """Each sequence's output and final state equal a single-sequence
        lightning_attention call with kv_history from its slot (to rounding)."""
        import adapters.jax as aj
        q, k, v, ed, cu, cache = make_varlen([33, 0, 1, 47], 2, 16, 32, "float32", 5)
        slots = np.array([3, 0, -1, 1], np.int64)
        out, new_cache = self.run(q, k, v, ed, cu, cache, slots, config=SPLIT)
        for b, slot in enumerate(slots):
            lo, hi = cu[b], cu[b + 1]
            if hi == lo:
                continue
            seq = [np.ascontiguousarray(x[lo:hi].transpose(1, 0, 2)[None]) for x in (q, k, v)]
            hist = cache[slot][None] if slot >= 0 else np.zeros((1, 2, 16, 32), np.float32)
            if self.adapter == "torch":
                o1, kv1 = at.lightning_attention(*map(to_torch, seq), to_torch(ed), 256, to_torch(hist), True)
                o1, kv1 = torch_to_numpy(o1), torch_to_numpy(kv1)
            else:
                o1, kv1 = map(np.asarray, aj.lightning_attention(*map(to_jax, seq), to_jax(ed),
                                                                 kv_history=to_jax(hist),
                                                                 output_final_state_only=True))
            check(out[lo:hi], o1[0].transpose(1, 0, 2), "float32", f"sequence {b} output")
            if slot >= 0:
                check(new_cache[slot], kv1[0], "float32", f"sequence {b} state")

    @pytest.mark.parametrize("cached", [True, False], ids=["cache", "states"])
    def test_poisoned_outputs_are_fully_written(self, cached):
        """Every element of the output and of the final states is written (NaN before)."""
        q, k, v, ed, cu, cache = make_varlen([9, 0, 40, 1], 2, 16, 16, "float32", 5 if cached else 0)
        slots = np.array([2, 4, -1, 0], np.int64) if cached else None
        plan = plan_lightning_attention_varlen(
            self.target(), ci(q), ci(k), ci(v), ci(ed), ci(cu), ci(cache) if cached else None,
            ci(slots) if cached else None, config=SPLIT)
        arrays = dict(q=q, k=k, v=v, ed=ed, cu_seqlens=cu)
        if cached:
            arrays.update(kv_cache=cache, slot_idx=slots)
        env = self.run_poisoned(plan, arrays)
        ref_out, ref_state = reference(q, k, v, ed, cu, cache, slots)
        check(env["output"], ref_out, "float32", "output")
        check(env["kv_cache" if cached else "states"], ref_state, "float32", "states")

    def test_out_of_range_slot_on_device_gives_nan(self):
        """What the kernel does with ids nobody checked (device data): NaN outputs
        for that sequence, no slot read or written; the others are unaffected."""
        q, k, v, ed, cu, cache = make_varlen([10, 20, 5], 2, 16, 16, "float32", 4)
        slots = np.array([1, 4, -3], np.int64)
        plan = plan_lightning_attention_varlen(self.target(), ci(q), ci(k), ci(v), ci(ed), ci(cu),
                                               ci(cache), ci(slots), config=SPLIT)
        env = self.run_poisoned(plan, dict(q=q, k=k, v=v, ed=ed, cu_seqlens=cu, kv_cache=cache,
                                           slot_idx=slots))
        out, new_cache = env["output"], env["kv_cache"]
        assert np.isnan(out[10:]).all() and not np.isnan(out[:10]).any()
        assert_bitwise_equal(new_cache[[0, 2, 3]], cache[[0, 2, 3]], "other slots")
        ref_out, ref_cache = reference(q[:10], k[:10], v[:10], ed, cu[:2], cache, slots[:1])
        check(out[:10], ref_out, "float32", "valid sequence")
        check(new_cache[1], ref_cache[1], "float32", "valid slot")

    @pytest.mark.parametrize("name,change", [
        ("cu_seqlens", dict(cu=np.array([0, 5, 9], np.float32))),
        ("cu_seqlens", dict(cu=np.array([[0, 5, 10]], np.int32))),
        ("cu_seqlens", dict(cu=np.zeros((0,), np.int32))),
        ("cu_seqlens", dict(cu=np.array([0], np.int32))),
        ("cu_seqlens", dict(cu=np.array([0, 5, 9], np.int32))),       # ends before T = 10
        ("cu_seqlens", dict(cu=np.array([1, 5, 10], np.int32))),      # does not start at 0
        ("cu_seqlens", dict(cu=np.array([0, 12, 10], np.int32))),     # decreasing
        ("slot_idx", dict(slots=np.array([0, 4], np.int64))),         # >= num_slots
        ("slot_idx", dict(slots=np.array([-2, 1], np.int64))),
        ("slot_idx", dict(slots=np.array([3, 3], np.int32))),         # two sequences, one slot
        ("slot_idx", dict(slots=np.array([0, 1, 2], np.int64))),
        ("slot_idx", dict(slots=np.array([0, 1], np.float32))),
        ("slot_idx", dict(slots=None)),
        ("kv_cache", dict(cache=None)),
        ("kv_cache", dict(cache="fp16")),
        ("kv_cache", dict(cache="short")),
        ("q", dict(q="4d")),
        ("v", dict(v="one_head")),
        ("k", dict(k="fp16")),
        ("ed", dict(ed=np.zeros(3, np.float32))),
        ("block_size", dict(block_size=0)),
    ])
    def test_errors_name_the_argument(self, name, change):
        q, k, v, ed, cu, cache = make_varlen([5, 5], 2, 16, 16, "float32", 4)
        a = dict(q=q, k=k, v=v, ed=ed, cu=cu, cache=cache, slots=np.array([0, -1], np.int64),
                 block_size=256)
        a.update(change)
        fix = {"4d": lambda x: x[None], "short": lambda x: x[:, :, :8], "one_head": lambda x: x[:, :1],
               "fp16": lambda x: x.astype(np.float16)}
        for key in ("q", "k", "v", "cache"):
            if isinstance(a[key], str):
                a[key] = fix[a[key]]({"q": q, "k": k, "v": v, "cache": cache}[key])
        # index values are checked on every call only where they are host data; on
        # the GPU they are device data, checked under the validation switch
        with pytest.raises((ValueError, TypeError), match=name):
            self.run(a["q"], a["k"], a["v"], a["ed"], a["cu"], a["cache"], a["slots"],
                     block_size=a["block_size"], validate_indices=True if GPU else None)


class TestTorch(TorchAdapter, VarlenTests):
    def run(self, q, k, v, ed, cu, cache=None, slots=None, *, config=None, jit=False, block_size=256,
            validate_indices=None):
        ct = None if cache is None else to_torch(cache)
        out, state = at.lightning_attention_varlen(
            *map(to_torch, (q, k, v, ed, cu)), kv_cache=ct,
            slot_idx=None if slots is None else to_torch(slots),
            block_size=block_size, config=config, validate_indices=validate_indices)
        if ct is not None:
            assert state is ct, "the cache is updated in place and returned"
        return torch_to_numpy(out), torch_to_numpy(state)

    def target(self):
        from adapters.torch._executor import target_for
        return target_for(torch.device(DEVICE))

    def run_poisoned(self, plan, arrays):
        from adapters.torch._executor import run_plan
        plan, poisoned = _poisoned(plan, arrays)
        tensors = {n: to_torch(x) for n, x in {**arrays, **poisoned}.items()}
        run_plan(plan, tensors, device=torch.device(DEVICE))
        return {r: torch_to_numpy(tensors[r]) for r in plan.results}

    def test_strided_inputs(self):
        """q, k, v as views of a fused qkv buffer; the cache as a view of a bigger one."""
        q, k, v, ed, cu, cache = make_varlen([11, 0, 30], 2, 16, 16, "float32", 4)
        slots = np.array([2, 0, 3], np.int64)
        ref_out, ref_cache = reference(q, k, v, ed, cu, cache, slots)
        qkv = to_torch(np.concatenate([q, k, v], axis=-1))
        big = to_torch(np.concatenate([cache, cache], axis=1))  # [slots, 2H, D, E]
        ct = big[:, :2]
        out, _ = at.lightning_attention_varlen(qkv[..., :16], qkv[..., 16:32], qkv[..., 32:], to_torch(ed),
                                               to_torch(cu), kv_cache=ct, slot_idx=to_torch(slots),
                                               config=SPLIT)
        check(torch_to_numpy(out), ref_out, "float32", "output")
        check(torch_to_numpy(ct), ref_cache, "float32", "cache")
        assert_bitwise_equal(torch_to_numpy(big[:, 2:]), cache, "the rest of the cache buffer")

    def test_compile_fullgraph(self):
        q, k, v, ed, cu, cache = make_varlen([9, 0, 21], 2, 16, 16, "float32", 4)
        slots = np.array([3, -1, 1], np.int64)

        def f(q, k, v, ed, cu, cache, slots):
            o1, _ = at.lightning_attention_varlen(q, k, v, ed, cu, kv_cache=cache, slot_idx=slots,
                                                  config=SPLIT)
            o2, states = at.lightning_attention_varlen(q, k, v, ed, cu)
            return o1 * 2, o2, states

        args = [to_torch(x) for x in (q, k, v, ed, cu, cache, slots)]
        o1, o2, states = torch.compile(f, fullgraph=True, backend="inductor" if GPU else "aot_eager")(*args)
        ref_out, ref_cache = reference(q, k, v, ed, cu, cache, slots)
        check(torch_to_numpy(o1), 2 * ref_out, "float32", "compiled output")
        check(torch_to_numpy(args[5]), ref_cache, "float32", "compiled cache update")
        ref_out, ref_states = reference(q, k, v, ed, cu)
        check(torch_to_numpy(o2), ref_out, "float32", "compiled output (no cache)")
        check(torch_to_numpy(states), ref_states, "float32", "compiled final states")


class TestJax(JaxAdapter, VarlenTests):
    def run(self, q, k, v, ed, cu, cache=None, slots=None, *, config=None, jit=False, block_size=256,
            validate_indices=None):
        import jax
        import adapters.jax as aj

        def fn(q, k, v, ed, cu, cache, slots):
            return aj.lightning_attention_varlen(q, k, v, ed, cu, kv_cache=cache, slot_idx=slots,
                                                 block_size=block_size, config=config,
                                                 validate_indices=validate_indices)
        if jit:
            fn = jax.jit(fn)
        out, state = fn(*map(to_jax, (q, k, v, ed, cu)), None if cache is None else to_jax(cache),
                        None if slots is None else to_jax(slots))
        return jax_to_numpy(out), jax_to_numpy(state)

    def target(self):
        from adapters.jax._executor import target
        return target()

    def run_poisoned(self, plan, arrays):
        if GPU:
            pytest.skip("the JAX GPU path allocates its own outputs")
        plan, poisoned = _poisoned(plan, arrays)
        env = run_plan_numpy(plan, {**arrays, **poisoned})
        return {r: env[r] for r in plan.results}

    def test_jit_traced_indices_and_donated_cache(self):
        """cu_seqlens and slot_idx traced: new values (other lengths, other slots) reuse
        the compiled function and the plan; the donated cache comes back updated."""
        import jax
        import adapters.jax as aj
        f = jax.jit(lambda q, k, v, ed, cu, cache, slots: aj.lightning_attention_varlen(
            q, k, v, ed, cu, kv_cache=cache, slot_idx=slots, config=SPLIT), donate_argnums=(5,))
        for i, (lens, slots) in enumerate([([20, 0, 11], [4, 1, -1]), ([1, 29, 1], [0, -1, 3])]):
            q, k, v, ed, cu, cache = make_varlen(lens, 2, 16, 16, "float32", 5, seed=1)
            slots = np.array(slots, np.int32)
            before = plan_lightning_attention_varlen.cache_info()
            out, new_cache = f(*map(to_jax, (q, k, v, ed, cu, cache, slots)))
            ref_out, ref_cache = reference(q, k, v, ed, cu, cache, slots)
            check(jax_to_numpy(out), ref_out, "float32", "output")
            check(jax_to_numpy(new_cache), ref_cache, "float32", "cache")
            if i:
                assert f._cache_size() == 1, "new lengths recompiled"
                assert plan_lightning_attention_varlen.cache_info().misses == before.misses


def _poisoned(plan, arrays):
    """(plan without its result buffers, those results pre-filled with NaN)."""
    poisoned = {r: np.full(plan.buffers[r].shape, np.nan, np.float32).astype(
        arrays["q"].dtype if r == "output" else np.float32) for r in plan.results if r in plan.buffers}
    plan = dataclasses.replace(plan, buffers={k: b for k, b in plan.buffers.items() if k not in poisoned})
    return plan, poisoned


# ------------------------------------------------------------------ parity
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("config", [None, SPLIT], ids=["auto", "split"])
def test_torch_and_jax_bitwise_equal(dtype, config):
    q, k, v, ed, cu, cache = make_varlen([13, 0, 1, 35], 2, 24, 40, dtype, 6)
    slots = np.array([5, 2, -1, 0], np.int64)
    t = TestTorch().run(q, k, v, ed, cu, cache, slots, config=config)
    j = TestJax().run(q, k, v, ed, cu, cache, slots, config=config, jit=True)
    assert_bitwise_equal(t[0], j[0], "output torch vs jax")
    assert_bitwise_equal(t[1], j[1], "cache torch vs jax")
    t = TestTorch().run(q, k, v, ed, cu, config=config)
    j = TestJax().run(q, k, v, ed, cu, config=config, jit=True)
    assert_bitwise_equal(t[0], j[0], "output torch vs jax (no cache)")
    assert_bitwise_equal(t[1], j[1], "final states torch vs jax")


# ------------------------------------------------------------------ plans (no launch)
def _plan(target, t, b, h=64, d=128, e=128, dtype="bfloat16", cache=True, **kw):
    q = ArrayInfo.contiguous((t, h, d), dtype)
    v = ArrayInfo.contiguous((t, h, e), dtype)
    extra = (ArrayInfo.contiguous((b + 3, h, d, e), "float32"), ArrayInfo.contiguous((b,), "int32")) \
        if cache else ()
    return plan_lightning_attention_varlen(target, q, q, v, ArrayInfo.contiguous((h,), "float32"),
                                           ArrayInfo.contiguous((b + 1,), "int32"), *extra, **kw)


def test_grid_depends_on_t_b_and_the_segment_length_only():
    """T // segment_len + B work items (never the lengths: device data), each
    H x E-tiles programs; without a cut, one item per sequence."""
    plan = _plan(HOPPER, 10000, 7, config=LightningVarlenConfig(segment_len=512, block_e=64))
    assert varlen_work_items(plan) == 10000 // 512 + 7
    assert plan.launches[0].grid == ((10000 // 512 + 7) * 64 * 2,)
    assert plan.launches[0].constexprs["SEGMENTED"]
    assert plan.buffers["seg_state"].shape == (26, 64, 128, 128)
    assert plan.buffers["sync"].zero_init and plan.buffers["sync"].shape == (1 + 26 * 128,)
    plan = _plan(HOPPER, 10000, 7, config=LightningVarlenConfig(segment_len=0, block_e=64))
    assert plan.launches[0].grid == (7 * 128,) and not plan.launches[0].constexprs["SEGMENTED"]
    # a segment length >= T cuts nothing
    plan = _plan(HOPPER, 500, 3, config=LightningVarlenConfig(segment_len=512))
    assert not plan.launches[0].constexprs["SEGMENTED"]


def test_segments_only_when_sequences_cannot_fill_the_gpu():
    many = _plan(HOPPER, 16 * 4096, 16)                       # 16 x 64 heads x E-tiles: many waves
    assert many.launches[0].kernel.fn.__name__ == "_gluon_varlen_kernel"  # never cuts
    many = _plan(HOPPER, 16 * 4096, 16, config=LightningVarlenConfig())
    assert not many.launches[0].constexprs["SEGMENTED"]
    few = _plan(HOPPER, 65536, 2, h=8)                        # 2 sequences x 8 heads
    launch = few.launches[0]
    assert launch.constexprs["SEGMENTED"] and launch.grid[0] >= 2 * 128
    assert launch.params["seg_len"].value % launch.constexprs["BLOCK_T"] == 0
    # the CPU tests' own case (the interpreter plans for 132 SMs)
    cpu_case = _plan(Target.interpreter(), 310, 2, h=1, d=16, e=16, dtype="float32")
    assert cpu_case.launches[0].constexprs["SEGMENTED"]
    # more SMs: more items for the same problem
    more = _plan(Target("cuda", 90, 264, gluon=True), 65536, 2, h=8)
    assert varlen_work_items(more) > varlen_work_items(few)


def _kernel(plan):
    return plan.launches[0].kernel.fn.__name__


@pytest.mark.parametrize("dtype,kernel", [("bfloat16", "_gluon_varlen_kernel"),
                                          ("float32", "_gluon_varlen_tf32_kernel")])
def test_gluon_kernels_where_they_apply(dtype, kernel):
    """Gluon on sm_90 for bf16/fp32, D 128, E a multiple of 64, 16-byte rows,
    sequences that fill the GPU uncut; the Triton kernel everywhere else."""
    plan = _plan(HOPPER, 5000, 16, dtype=dtype)
    launch = plan.launches[0]
    assert _kernel(plan) == kernel and launch.grid == (16 * 64 * 2,)
    assert launch.constexprs["ORDER_B"] == 16 and launch.constexprs["STRIDE_OT"] == 64 * 128
    assert launch.outputs == ("output", "kv_cache") and "kv_cache" in launch.args
    assert varlen_work_items(plan) == 16
    states = _plan(HOPPER, 5000, 16, dtype=dtype, cache=False)
    assert not states.buffers["states"].zero_init  # every sequence's state is written
    # B = 1 needs no order; past LONGEST_FIRST_MAX the sequences run in index order
    assert _plan(HOPPER, 5000, 1, h=256, dtype=dtype).launches[0].constexprs["ORDER_B"] == 0
    assert _plan(HOPPER, 5000, 100, dtype=dtype).launches[0].constexprs["ORDER_B"] == 0
    off = _plan(HOPPER, 5000, 16, dtype=dtype, config=LightningVarlenGluonConfig(longest_first=False))
    assert off.launches[0].constexprs["ORDER_B"] == 0
    # elsewhere: the Triton kernel
    for other in (_plan(Target.interpreter(), 5000, 16, dtype=dtype),          # no Gluon
                  _plan(Target("cuda", 80, 108), 5000, 16, dtype=dtype),         # not sm_90
                  _plan(HOPPER, 5000, 16, dtype=dtype, d=64),                    # D != 128
                  _plan(HOPPER, 5000, 16, dtype=dtype, e=96),                    # E % 64
                  _plan(HOPPER, 65536, 2, h=8, dtype=dtype),                     # wants cuts
                  _plan(HOPPER, 5000, 16, dtype=dtype, config=LightningVarlenConfig())):
        assert _kernel(other) == "_lightning_varlen_kernel"
    assert _kernel(_plan(HOPPER, 5000, 16, dtype="float16")) == "_lightning_varlen_kernel"
    # token rows not 16-byte aligned: q with a token stride of H * D + 1 elements
    t, h = 5000, 64
    q = ArrayInfo((t, h, 128), dtype, (h * 128 + 1, 128, 1))
    v = ArrayInfo.contiguous((t, h, 128), dtype)
    odd = plan_lightning_attention_varlen(HOPPER, q, v, v, ArrayInfo.contiguous((h,), "float32"),
                                          ArrayInfo.contiguous((17,), "int32"))
    assert _kernel(odd) == "_lightning_varlen_kernel"


@pytest.mark.parametrize("config,match", [
    (LightningVarlenGluonConfig(), "does not apply here: D=64"),
    (LightningVarlenGluonConfig(stages=3), "fp32 Gluon kernel keeps a 2-deep load ring"),
    (LightningVarlenGluonConfig(longest_first=True), "longest_first for 100 sequences"),
], ids=["unfit", "fp32-stages", "too-many-to-order"])
def test_gluon_config_errors_name_the_config(config, match):
    kw = dict(d=64) if match.endswith("D=64") else {}
    with pytest.raises(ValueError, match="config: .*" + match.replace("(", r"\(")):
        _plan(HOPPER, 5000, 100 if "100" in match else 16, dtype="float32", config=config, **kw)
    with pytest.raises(TypeError, match="config"):  # the prefill's Gluon config is not the varlen one
        _plan(HOPPER, 5000, 16, config=LightningGluonConfig())


def test_cache_aliasing_and_results():
    plan = _plan(HOPPER, 300, 3)
    launch = plan.launches[0]
    assert plan.results == ("output", "kv_cache") and "kv_cache" not in plan.buffers
    assert launch.params["cache_in_ptr"] == "kv_cache" and launch.outputs[1] == "kv_cache"
    plan = _plan(HOPPER, 300, 3, cache=False)
    assert plan.results == ("output", "states") and plan.buffers["states"].shape == (3, 64, 128, 128)
    assert not plan.buffers["states"].zero_init  # the kernel writes every sequence's state
    empty = _plan(HOPPER, 0, 3, cache=False)  # T = 0: no launch, zero states
    assert not empty.launches and empty.buffers["states"].zero_init


# ------------------------------------------------------------------ GPU, real sizes
def _reference_torch64(q, k, v, ed, cu, cache, slots):
    """The float64 recurrence on the GPU, per sequence (fast enough for real sizes)."""
    q, k, v = (torch.as_tensor(x.astype(np.float32)).cuda().double() for x in (q, k, v))
    lam = torch.exp(-torch.as_tensor(ed).cuda().double()).view(-1, 1, 1)
    out = torch.zeros(*v.shape, dtype=torch.float64, device="cuda")
    new_cache = torch.as_tensor(cache).cuda().double()
    for b, slot in enumerate(slots):
        s = new_cache[slot].clone() if slot >= 0 else torch.zeros_like(new_cache[0])
        for t in range(int(cu[b]), int(cu[b + 1])):
            s = lam * s + k[t, :, :, None] * v[t, :, None, :]
            out[t] = torch.einsum("hd,hde->he", q[t], s)
        if slot >= 0:
            new_cache[slot] = s
    return out.cpu().numpy(), new_cache.cpu().numpy()


GPU_LENS = [1500, 0, 1, 700, 2100, 37, 256]


@requires_gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("config", [None, LightningVarlenConfig(segment_len=512)], ids=["auto", "seg512"])
def test_gpu_real_size(dtype, config):
    q, k, v, ed, cu, cache = make_varlen(GPU_LENS, 64, 128, 128, dtype, 10)
    slots = np.array([7, 2, -1, 0, 9, 4, -1], np.int64)
    ref_out, ref_cache = _reference_torch64(q, k, v, ed, cu, cache, slots)
    out, new_cache = TestTorch().run(q, k, v, ed, cu, cache, slots, config=config)
    check_relative(out, ref_out, dtype, "output")
    named = [s for b, s in enumerate(slots) if s >= 0 and cu[b + 1] > cu[b]]
    check_relative(new_cache[named], ref_cache[named], dtype, "cache")
    keep = untouched(cache, slots)
    assert_bitwise_equal(new_cache[keep], cache[keep], "untouched slots")
    j = TestJax().run(q, k, v, ed, cu, cache, slots, config=config, jit=True)
    assert_bitwise_equal(out, j[0], "output torch vs jax")
    assert_bitwise_equal(new_cache, j[1], "cache torch vs jax")


@requires_gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_gpu_matches_loop_of_single_sequence_calls(dtype):
    """Against what an engine does without this op: one lightning_attention call
    per sequence with kv_history from its slot, the final state written back."""
    q, k, v, ed, cu, cache = make_varlen(GPU_LENS, 64, 128, 128, dtype, 10)
    slots = np.array([7, 2, -1, 0, 9, 4, -1], np.int64)
    out, new_cache = TestTorch().run(q, k, v, ed, cu, cache, slots)
    qt, kt, vt = (to_torch(x) for x in (q, k, v))
    loop_cache = to_torch(cache)
    loop_out = torch.zeros_like(to_torch(out))
    for b, slot in enumerate(slots.tolist()):
        lo, hi = int(cu[b]), int(cu[b + 1])
        if hi == lo:
            continue
        seq = [x[lo:hi].transpose(0, 1).unsqueeze(0) for x in (qt, kt, vt)]
        hist = loop_cache[slot:slot + 1] if slot >= 0 else None
        o, kv = at.lightning_attention(*seq, to_torch(ed), 256, hist, True)
        loop_out[lo:hi] = o[0].transpose(0, 1)
        if slot >= 0:
            loop_cache[slot] = kv[0]
    check_relative(out, torch_to_numpy(loop_out), dtype, "output vs the loop")
    named = [s for b, s in enumerate(slots) if s >= 0 and cu[b + 1] > cu[b]]
    check_relative(new_cache[named], torch_to_numpy(loop_cache)[named], dtype, "cache vs the loop")


@requires_gpu
def test_gpu_cuda_graph_replay():
    """Captured once, replayed with new tokens, lengths and slots (device data)."""
    q, k, v, ed, cu, cache = make_varlen([300, 0, 1, 200], 64, 128, 128, "bfloat16", 6)
    slots = np.array([5, 1, -1, 2], np.int64)
    args = [to_torch(x) for x in (q, k, v, ed, cu, cache, slots)]

    def call():
        return at.lightning_attention_varlen(*args[:5], kv_cache=args[5], slot_idx=args[6])[0]
    call()  # compiles outside the capture
    args[5].copy_(to_torch(cache))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = call()
    q2, k2, v2, _, cu2, _ = make_varlen([1, 250, 50, 200], 64, 128, 128, "bfloat16", 6, seed=3)
    slots2 = np.array([0, -1, 4, 3], np.int64)
    for dst, src in zip(args, (q2, k2, v2, ed, cu2, cache, slots2)):
        dst.copy_(to_torch(src))
    g.replay()
    torch.cuda.synchronize()
    ref_out, ref_cache = _reference_torch64(q2, k2, v2, ed, cu2, cache, slots2)
    check_relative(torch_to_numpy(out), ref_out, "bfloat16", "graph replay output")
    check_relative(torch_to_numpy(args[5])[[0, 3, 4]], ref_cache[[0, 3, 4]], "bfloat16", "graph replay cache")
    assert_bitwise_equal(torch_to_numpy(args[5])[[1, 2, 5]], cache[[1, 2, 5]], "untouched slots")


# partial last chunks (63, 65, 127, 4097), whole ones (64, 128, 1024), empty and one-token sequences
GLUON_LENS = [0, 1, 63, 64, 65, 127, 128, 700, 1024, 4097, 3]
GLUON_SLOTS = [3, 0, -1, 5, 7, 13, 1, -1, 9, 2, 11]


@requires_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_gluon_kernels(dtype):
    """The Gluon varlen kernels (forced here; the planner picks them where the
    batch fills the GPU uncut) against the float64 recurrence and the Triton
    kernel; slots -1 and untouched slots; torch == JAX; the program order
    (longest first or index order) changes no bit."""
    h = 4
    q, k, v, ed, cu, cache = make_varlen(GLUON_LENS, h, 128, 128, dtype, 14)
    slots = np.array(GLUON_SLOTS, np.int64)
    gluon = LightningVarlenGluonConfig(longest_first=True)
    out, new_cache = TestTorch().run(q, k, v, ed, cu, cache, slots, config=gluon)
    ref_out, ref_cache = _reference_torch64(q, k, v, ed, cu, cache, slots)
    check_relative(out, ref_out, dtype, "output")
    named = [s for b, s in enumerate(slots) if s >= 0 and cu[b + 1] > cu[b]]
    check_relative(new_cache[named], ref_cache[named], dtype, "cache")
    keep = untouched(cache, slots) + [3]  # slot 3 belongs to the empty sequence: left alone
    assert_bitwise_equal(new_cache[keep], cache[keep], "untouched slots")
    tri_out, tri_cache = TestTorch().run(q, k, v, ed, cu, cache, slots, config=LightningVarlenConfig())
    check_relative(out, tri_out, dtype, "output vs the Triton kernel")
    check_relative(new_cache[named], tri_cache[named], dtype, "cache vs the Triton kernel")
    in_order = TestTorch().run(q, k, v, ed, cu, cache, slots,
                               config=LightningVarlenGluonConfig(longest_first=False))
    assert_bitwise_equal(out, in_order[0], "output, longest first vs index order")
    assert_bitwise_equal(new_cache, in_order[1], "cache, longest first vs index order")
    j = TestJax().run(q, k, v, ed, cu, cache, slots, config=gluon, jit=True)
    assert_bitwise_equal(out, j[0], "output torch vs jax")
    assert_bitwise_equal(new_cache, j[1], "cache torch vs jax")
    # without a cache: every sequence from zero, the final states returned
    out0, states = TestTorch().run(q, k, v, ed, cu, config=gluon)
    ref0, ref_states = _reference_torch64(q, k, v, ed, cu, np.zeros((len(GLUON_LENS), h, 128, 128), np.float32),
                                          np.arange(len(GLUON_LENS)))
    check_relative(out0, ref0, dtype, "output without a cache")
    check_relative(states, ref_states, dtype, "final states")
    assert not states[0].any()  # the empty sequence's state is zero


@requires_gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_gluon_varlen_is_the_prefill_loop(dtype):
    """A sequence of whole chunks runs the single-sequence Gluon prefill's loop
    (one segment): the same bits, output and final state."""
    lens = [1024, 64, 512]
    q, k, v, ed, cu, cache = make_varlen(lens, 4, 128, 128, dtype, 4)
    slots = np.array([2, 0, 1], np.int64)
    out, new_cache = TestTorch().run(q, k, v, ed, cu, cache, slots, config=LightningVarlenGluonConfig())
    qt, kt, vt = (to_torch(x) for x in (q, k, v))
    for b, slot in enumerate(slots.tolist()):
        lo, hi = int(cu[b]), int(cu[b + 1])
        seq = [x[lo:hi].transpose(0, 1).unsqueeze(0) for x in (qt, kt, vt)]
        o, kv = at.lightning_attention(*seq, to_torch(ed), 256, to_torch(cache[slot:slot + 1]), True,
                                       config=LightningGluonConfig(num_segments=1))
        assert_bitwise_equal(out[lo:hi], torch_to_numpy(o[0].transpose(0, 1)), f"output of sequence {b}")
        assert_bitwise_equal(new_cache[slot], torch_to_numpy(kv[0]), f"final state of sequence {b}")


@requires_gpu
def test_gpu_gluon_out_of_range_slot_gives_nan():
    """Device slot ids nobody checked: an id outside [-1, num_slots) gives that
    sequence NaN outputs and writes no slot."""
    q, k, v, ed, cu, cache = make_varlen([100, 70], 2, 128, 128, "bfloat16", 3)
    slots = np.array([1, 7], np.int64)
    out, new_cache = TestTorch().run(q, k, v, ed, cu, cache, slots, config=LightningVarlenGluonConfig(),
                                     validate_indices=False)
    assert np.isnan(out[100:]).all() and not np.isnan(out[:100]).any()
    assert_bitwise_equal(new_cache[[0, 2]], cache[[0, 2]], "slots not named")

"""reshape_and_cache_flash (vLLM's triton_reshape_and_cache_flash): one test base
class run for each adapter against the numpy reference, bit for bit (the op
copies or quantises, it computes nothing else). The caches are poisoned (random
values and NaN): the rows no slot names must keep their bits. Slots are a random
scatter with padding (-1, and other negatives); fp8 with scales, saturation and
ties; block sizes that are not powers of two; strided caches and keys (torch);
errors naming the argument; index validation; torch == JAX bitwise; the
transforms (torch.compile, CUDA graphs, the call memo; jax.jit with donated
caches, vmap, sharding over kv heads)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

import core_kernels
from core_kernels._index_check import ENV_VAR
from core_kernels.reshape_and_cache_flash import (ReshapeAndCacheConfig, plan_reshape_and_cache_flash,
                                                  reshape_and_cache_flash_reference)
from harness import (DEVICE, FLOAT_DTYPES, GPU, JaxAdapter, TorchAdapter, assert_bitwise_equal, cast,
                     np_dtype, requires_gpu, rng, to_jax, to_torch, torch_to_numpy)

FP8_FORMAT = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


# ------------------------------------------------------------------ inputs (numpy)
def make_cache(shape, cache_dtype, g):
    """A poisoned cache: random values, and NaN at every 5th element (fp8: the NaN
    code; uint8: random bits), so that a stray write or a lost row shows bit for bit."""
    if cache_dtype == "uint8":
        return g.integers(0, 256, shape, dtype=np.uint8)
    x = cast(g.standard_normal(shape), cache_dtype)
    flat = x.reshape(-1)
    if cache_dtype.startswith("float8"):
        flat.view(np.uint8)[::5] = 0x7F
    else:
        flat[::5] = np.nan
    return x


def make_case(n, h, d, num_blocks, block_size, dtype="float32", cache_dtype=None, *, pad=3, seed=None,
              key_scale=1.0):
    """key, value [n, h, d]; caches [num_blocks, block_size, h, d] (poisoned);
    slot_mapping [n] int64: distinct random slots of the cache, ``pad`` of the
    tokens padding (-1 and other negatives)."""
    g = rng(seed)
    key = cast(g.standard_normal((n, h, d)) * key_scale, dtype)
    value = cast(g.standard_normal((n, h, d)) * key_scale, dtype)
    cache_dtype = cache_dtype or dtype
    shape = (num_blocks, block_size, h, d)
    key_cache, value_cache = make_cache(shape, cache_dtype, g), make_cache(shape, cache_dtype, g)
    slots = g.permutation(num_blocks * block_size)[:n].astype(np.int64)
    for i, t in enumerate(g.permutation(n)[:min(pad, n)]):
        slots[t] = -1 if i % 2 == 0 else -int(g.integers(2, 10 ** 6))
    return key, value, key_cache, value_cache, slots


def _autograd_example():
    key, value, key_cache, value_cache, slots = make_case(5, 2, 8, 3, 4, seed=1)
    # finite caches: the generic tests compare them with torch.equal (NaN != NaN)
    return dict(key=to_torch(key), value=to_torch(value), key_cache=to_torch(np.nan_to_num(key_cache)),
                value_cache=to_torch(np.nan_to_num(value_cache)), slot_mapping=to_torch(slots), kv_cache_dtype="auto",
                k_scale=None, v_scale=None, config=None)


# the torch op's example for the generic autograd tests (tests/test_autograd_safety.py)
AUTOGRAD_EXAMPLES = {"reshape_and_cache_flash": (_autograd_example, "key")}

SHAPES = [(7, 2, 16, 4, 4), (33, 3, 80, 5, 16), (12, 1, 1, 3, 5), (20, 5, 40, 2, 24)]
SHAPE_ID = "N{}-H{}-D{}-NB{}-BS{}".format
# (kv_cache_dtype, cache dtype): every fp8 name, each format stored as itself and as uint8 bits
FP8_CASES = [("fp8", "float8_e4m3fn"), ("fp8_e4m3", "uint8"), ("fp8_e5m2", "float8_e5m2"),
             ("fp8", "uint8"), ("fp8_e5m2", "uint8")]


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x


class ReshapeAndCacheFlashTests:
    """Every test, written once; the subclasses say how to call the adapter:
    ``call(key, value, key_cache, value_cache, slots, **kw) -> (key_cache, value_cache)``
    as numpy arrays (torch: the caches written in place)."""

    def check(self, case, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0, **kw):
        key, value, key_cache, value_cache, slots = case
        scales = {} if kv_cache_dtype == "auto" else dict(k_scale=k_scale, v_scale=v_scale)
        got = self.call(key, value, key_cache, value_cache, slots, kv_cache_dtype=kv_cache_dtype, **scales, **kw)
        want = reshape_and_cache_flash_reference(key, value, key_cache, value_cache, slots, kv_cache_dtype,
                                                 k_scale, v_scale)
        for g, w, name in zip(got, want, ("key_cache", "value_cache")):
            assert g.dtype == w.dtype, f"{name}: dtype {g.dtype}, expected {w.dtype}"
            assert_bitwise_equal(_bits(g), _bits(w), name)
        return got

    @pytest.mark.parametrize("dtype", FLOAT_DTYPES)
    @pytest.mark.parametrize("shape", SHAPES, ids=lambda s: SHAPE_ID(*s))
    def test_matches_reference(self, shape, dtype):
        self.check(make_case(*shape, dtype))

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
    @pytest.mark.parametrize("kv_cache_dtype,cache_dtype", FP8_CASES, ids=lambda x: x)
    def test_fp8_matches_reference(self, kv_cache_dtype, cache_dtype, dtype):
        g = rng()
        k_scale, v_scale = (float(np.float32(g.uniform(0.02, 3.0))) for _ in range(2))
        # values up to ~50x the scale's reach: some saturate, the rest cover the normal and subnormal ranges
        case = make_case(19, 3, 24, 4, 8, dtype, cache_dtype, key_scale=300.0 if "e4m3" in
                         FP8_FORMAT[kv_cache_dtype] else 1e4)
        self.check(case, kv_cache_dtype, k_scale, v_scale)

    @pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
    def test_fp8_saturation_ties_and_specials(self, kv_cache_dtype):
        """Hand-checked values (independent of the reference): the largest finite
        value for anything beyond it (infinities too), ties to even in the normal
        and subnormal ranges, signed zeros, NaN kept."""
        fmt = FP8_FORMAT[kv_cache_dtype]
        e4m3 = fmt == "float8_e4m3fn"
        top, tie_top = (448.0, 464.0) if e4m3 else (57344.0, 61440.0)
        sub = 2.0 ** -9 if e4m3 else 2.0 ** -16          # the subnormal quantum
        # (x, fp8 value stored) at scale 1
        pairs = [(float("inf"), top), (-float("inf"), -top), (1e30, top), (tie_top, top), (-tie_top, -top),
                 (top, top),
                 (1.0625, 1.0) if e4m3 else (1.125, 1.0),           # tie: to the even mantissa
                 (1.1875, 1.25) if e4m3 else (1.375, 1.5),          # tie: to the even mantissa (up)
                 (sub / 2, 0.0), (3 * sub / 2, 2 * sub), (-3 * sub / 2, -2 * sub), (sub / 4, 0.0),
                 (0.0, 0.0), (-0.0, -0.0), (1.0, 1.0), (-2.0, -2.0)]
        x = np.array([p[0] for p in pairs] + [np.nan], np.float32)
        want = np.array([p[1] for p in pairs] + [np.nan], np.float32)
        n = x.size
        key = np.broadcast_to(x[:, None, None], (n, 1, 8)).copy()
        cache = np.zeros((1, n, 1, 8), np_dtype(fmt))
        slots = np.arange(n, dtype=np.int64)[::-1].copy()        # token t -> row n - 1 - t
        for scale in (1.0, 0.5):                                  # x * 0.5 / 0.5 = x exactly
            k = key * np.float32(scale)
            kc, vc = self.call(k, -k, cache, cache, slots, kv_cache_dtype=kv_cache_dtype, k_scale=scale,
                               v_scale=scale)
            for got, sign, name in ((kc, 1, "key"), (vc, -1, "value")):
                got = got[0, ::-1, 0, :]                          # back in token order
                exp = np.broadcast_to((sign * want).astype(np_dtype(fmt))[:, None], got.shape)
                nan = np.isnan(exp.astype(np.float32))            # NaN stays NaN (its sign bit is free)
                assert np.array_equal(np.isnan(got.astype(np.float32)), nan), f"{name}: NaN, scale {scale}"
                assert_bitwise_equal(got[~nan], exp[~nan], f"{name}, scale {scale}")

    @pytest.mark.parametrize("block_size", [1, 3, 544])
    def test_block_sizes(self, block_size):
        """Any block size, powers of two or not (hybrid models use 544)."""
        num_blocks = max(2, 40 // block_size + 1)
        self.check(make_case(17, 2, 8, num_blocks, block_size, "float16", pad=4))

    def test_only_padding_writes_nothing(self):
        key, value, kc, vc, slots = make_case(6, 2, 8, 2, 4)
        slots[:] = [-1, -2, -1, -(2 ** 31), -1, -3]
        got = self.call(key, value, kc, vc, slots)
        assert_bitwise_equal(got[0], kc, "key_cache")
        assert_bitwise_equal(got[1], vc, "value_cache")

    def test_slot_past_the_cache_writes_nothing_unvalidated(self, monkeypatch):
        """Without validation a slot >= num_blocks * block_size is trusted data
        that the kernel still never writes outside the cache: that token is skipped."""
        monkeypatch.delenv(ENV_VAR, raising=False)
        key, value, kc, vc, slots = make_case(6, 2, 8, 2, 4, pad=0)
        slots[1], slots[4] = 8, 2 ** 31 - 1
        self.check((key, value, kc, vc, slots))

    def test_int32_slots(self):
        key, value, kc, vc, slots = make_case(9, 2, 8, 3, 4)
        self.check((key, value, kc, vc, slots.astype(np.int32)))

    def test_empty(self):
        key, value, kc, vc, slots = make_case(0, 2, 8, 3, 4)
        self.check((key, value, kc, vc, slots))
        key, value, kc, vc, slots = make_case(4, 2, 8, 3, 4)
        self.check((key, value, kc[:0], vc[:0], slots))   # no block: every slot is past the cache

    def test_config_override(self):
        self.check(make_case(21, 3, 24, 4, 8), config=ReshapeAndCacheConfig(block_t=2, block_h=2, num_warps=2))
        case = make_case(9, 2, 16, 3, 4, "bfloat16", "float8_e4m3fn")
        for early, soft in ((False, None), (True, True)) + (((True, False),) if GPU else ()):
            self.check(case, "fp8", 0.5, 0.25, config=ReshapeAndCacheConfig(2, 2, 4, early, soft))

    @pytest.mark.skipif(GPU, reason="the interpreter's refusal")
    def test_interpreter_needs_soft_rounding(self):
        with pytest.raises(ValueError, match="^config: soft_round=False"):
            self.check(make_case(4, 2, 8, 2, 4, "float32", "float8_e4m3fn"), "fp8",
                       config=ReshapeAndCacheConfig(1, 2, 4, soft_round=False))

    # ---------------------------------------------------------------- errors
    @pytest.mark.parametrize("what,exc,arg", [
        ("key_rank", ValueError, "key"), ("value_shape", ValueError, "value"), ("value_dtype", TypeError, "value"),
        ("head_size", ValueError, "key"), ("cache_heads", ValueError, "key_cache"),
        ("value_cache_shape", ValueError, "value_cache"), ("auto_cache_dtype", TypeError, "key_cache"),
        ("fp8_cache_dtype", TypeError, "key_cache"), ("value_cache_dtype", TypeError, "value_cache"),
        ("slot_dtype", TypeError, "slot_mapping"), ("slot_length", ValueError, "slot_mapping"),
        ("kv_cache_dtype_name", ValueError, "kv_cache_dtype"), ("kv_cache_dtype_type", TypeError, "kv_cache_dtype"),
        ("no_k_scale", ValueError, "k_scale"), ("bad_v_scale", ValueError, "v_scale"),
        ("scale_shape", ValueError, "k_scale"), ("key_dtype", TypeError, "key"),
    ])
    def test_errors_name_the_argument(self, what, exc, arg):
        key, value, kc, vc, slots = make_case(4, 2, 8, 2, 4)
        kw = dict(kv_cache_dtype="auto")
        fp8 = dict(kv_cache_dtype="fp8", k_scale=1.0, v_scale=1.0)
        kc8 = np.zeros(kc.shape, np.uint8)
        if what == "key_rank":
            key = key[0]
        elif what == "value_shape":
            value = value[:, :1]
        elif what == "value_dtype":
            value = value.astype(np.float16)
        elif what == "head_size":
            key = value = np.zeros((4, 2, 300), np.float32)
            kc = vc = np.zeros((2, 4, 2, 300), np.float32)
        elif what == "cache_heads":
            kc = vc = np.zeros((2, 4, 3, 8), np.float32)
        elif what == "value_cache_shape":
            vc = vc[:, :2]
        elif what == "auto_cache_dtype":
            kc = vc = kc.astype(np.float16)
        elif what == "fp8_cache_dtype":
            kw = fp8
        elif what == "value_cache_dtype":
            kc, kw = kc8, fp8
            vc = np.zeros(vc.shape, np_dtype("float8_e4m3fn"))
        elif what == "slot_dtype":
            slots = slots.astype(np.float32)
        elif what == "slot_length":
            slots = slots[:3]
        elif what == "kv_cache_dtype_name":
            kw = dict(kv_cache_dtype="int8")
        elif what == "kv_cache_dtype_type":
            kw = dict(kv_cache_dtype=8)
        elif what == "no_k_scale":
            kc = vc = kc8
            kw = dict(kv_cache_dtype="fp8", v_scale=1.0)
        elif what == "bad_v_scale":
            kc = vc = kc8
            kw = dict(fp8, v_scale=0.0)
        elif what == "scale_shape":
            kc = vc = kc8
            kw = dict(fp8, k_scale=np.ones(2, np.float32))
        elif what == "key_dtype":
            key = value = key.astype(np.int32)
            kc = vc = np.zeros(kc.shape, np.int32)
        with pytest.raises(exc, match=f"^{arg}: "):
            self.call(key, value, kc, vc, slots, **kw)

    # ---------------------------------------------------------------- index validation
    @pytest.mark.parametrize("how", ["env", "call"])
    @pytest.mark.parametrize("bad", ["past", "duplicate"])
    def test_validation_refuses(self, bad, how, monkeypatch):
        key, value, kc, vc, slots = make_case(6, 2, 8, 2, 4)
        if bad == "past":
            slots[3], match = 8, r"^slot_mapping: slot_mapping\[3\] = 8 is past the cache's 8 slots"
        else:
            slots[:2], match = 5, r"^slot_mapping: slot 5 is named twice \(slot_mapping\[0\] and slot_mapping\[1\]\)"
        kw = {}
        if how == "env":
            monkeypatch.setenv(ENV_VAR, "1")
        else:
            monkeypatch.delenv(ENV_VAR, raising=False)
            kw = dict(validate_indices=True)
        with pytest.raises(ValueError, match=match):
            self.call(key, value, kc, vc, slots, **kw)

    def test_validation_accepts_valid(self, monkeypatch):
        monkeypatch.delenv(ENV_VAR, raising=False)
        case = make_case(9, 2, 8, 3, 4)
        self.check(case, validate_indices=True)
        self.check(case, validate_indices=False)


class TestTorch(TorchAdapter, ReshapeAndCacheFlashTests):
    def call(self, key, value, key_cache, value_cache, slots, *, kv_cache_dtype="auto", k_scale=None,
             v_scale=None, **kw):
        import adapters.torch as at
        kc, vc = to_torch(key_cache), to_torch(value_cache)
        args = [to_torch(key), to_torch(value), kc, vc, to_torch(slots), kv_cache_dtype]
        scales = [s if s is None or isinstance(s, float) else to_torch(s) for s in (k_scale, v_scale)]
        try:
            at.reshape_and_cache_flash(*args, *scales, **kw)
        except (TypeError, ValueError):
            # nothing was written: the caches keep their poison
            assert_bitwise_equal(_bits(torch_to_numpy(kc)), _bits(key_cache), "key_cache after an error")
            assert_bitwise_equal(_bits(torch_to_numpy(vc)), _bits(value_cache), "value_cache after an error")
            raise
        return torch_to_numpy(kc), torch_to_numpy(vc)

    def test_vllm_calls(self):
        """The way vLLM's kernel tests and backend call it: positional, keyword, 0-d
        float32 scale tensors; an fp8 cache as uint8."""
        import adapters.torch as at
        key, value, kc, vc, slots = make_case(10, 2, 16, 3, 8, "bfloat16", "uint8")
        k_scale, v_scale = (torch.tensor(s, dtype=torch.float32, device=DEVICE) for s in (0.25, 0.5))
        want = reshape_and_cache_flash_reference(key, value, kc, vc, slots, "fp8", 0.25, 0.5)
        for keyword in (False, True):
            t = dict(key=to_torch(key), value=to_torch(value), key_cache=to_torch(kc), value_cache=to_torch(vc),
                     slot_mapping=to_torch(slots), kv_cache_dtype="fp8", k_scale=k_scale, v_scale=v_scale)
            if keyword:
                at.reshape_and_cache_flash(**t)
            else:
                at.reshape_and_cache_flash(*t.values())
            assert_bitwise_equal(torch_to_numpy(t["key_cache"]), want[0], f"key_cache (keywords: {keyword})")
            assert_bitwise_equal(torch_to_numpy(t["value_cache"]), want[1], f"value_cache (keywords: {keyword})")

    @pytest.mark.parametrize("layout", ["kv_pair", "hnd", "padded", "qkv_slice"])
    def test_strided_caches_and_keys(self, layout):
        """Caches as views: K and V of one [num_blocks, 2, block_size, H, D] tensor
        (vLLM's pair layout), an HND tensor seen as NHD, a padded head size; keys
        and values as slices of a fused qkv tensor."""
        import adapters.torch as at
        n, h, d, nb, bs = 11, 3, 16, 4, 8
        key, value, kc, vc, slots = make_case(n, h, d, nb, bs, "float16")
        if layout == "kv_pair":
            both = to_torch(np.stack([kc, vc], axis=1))                         # [nb, 2, bs, h, d]
            kct, vct = both[:, 0], both[:, 1]
        elif layout == "hnd":
            kct, vct = (to_torch(np.ascontiguousarray(c.transpose(0, 2, 1, 3))).transpose(1, 2) for c in (kc, vc))
        elif layout == "padded":
            kct, vct = (to_torch(np.concatenate([c, np.zeros(c.shape[:3] + (8,), c.dtype)], -1))[..., :d]
                        for c in (kc, vc))
        else:
            kct, vct = to_torch(kc), to_torch(vc)
        if layout == "qkv_slice":
            qkv = to_torch(np.concatenate([cast(rng().standard_normal((n, 2 * h, d)), "float16"), key, value], 1))
            kt, vt = qkv[:, 2 * h:3 * h], qkv[:, 3 * h:]
        else:
            kt, vt = to_torch(key), to_torch(value)
        assert not (kct.is_contiguous() and kt.is_contiguous()) or layout == "qkv_slice"
        at.reshape_and_cache_flash(kt, vt, kct, vct, to_torch(slots), "auto", None, None)
        want = reshape_and_cache_flash_reference(key, value, kc, vc, slots)
        assert_bitwise_equal(torch_to_numpy(kct), want[0], "key_cache")
        assert_bitwise_equal(torch_to_numpy(vct), want[1], "value_cache")
        if layout == "kv_pair":   # the pair tensor holds exactly the two caches
            assert_bitwise_equal(torch_to_numpy(both), np.stack(want, axis=1), "pair tensor")

    def test_inner_stride_refused(self):
        import adapters.torch as at
        key, value, kc, vc, slots = make_case(4, 2, 8, 2, 4)
        kct = to_torch(np.ascontiguousarray(kc.transpose(0, 1, 3, 2))).transpose(2, 3)
        with pytest.raises(ValueError, match="^key_cache: the innermost dimension must be contiguous"):
            at.reshape_and_cache_flash(to_torch(key), to_torch(value), kct, to_torch(vc), to_torch(slots))

    def test_compile_fullgraph(self):
        import adapters.torch as at
        key, value, kc, vc, slots = make_case(9, 2, 16, 3, 4, "float32", "float8_e4m3fn")
        t = [to_torch(x) for x in (key, value, kc, vc, slots)]
        scale = torch.tensor([0.5], device=DEVICE)

        def step(k, v, kc, vc, s, scale):
            at.reshape_and_cache_flash(k * 2, v, kc, vc, s, "fp8", scale, scale)
            return kc.float().sum()   # reads the written cache: the mutation must be ordered before it

        backend = "inductor" if GPU else "aot_eager"
        total = torch.compile(step, fullgraph=True, backend=backend)(*t, scale)
        want = reshape_and_cache_flash_reference(key * np.float32(2), value, kc, vc, slots, "fp8", 0.5, 0.5)
        assert_bitwise_equal(torch_to_numpy(t[2]), want[0], "key_cache")
        assert_bitwise_equal(torch_to_numpy(t[3]), want[1], "value_cache")
        assert np.isnan(float(total)) == np.isnan(want[0].astype(np.float32).sum())

    def test_opcheck(self):
        from adapters.torch._register import OPS
        args = list(_autograd_example().values())
        torch.library.opcheck(OPS["reshape_and_cache_flash"].op, args)

    def test_call_memo_replays_with_new_data(self):
        """A repeated call (same layouts) is replayed from the memo: new tensors' data,
        the right rows, version counters bumped."""
        import adapters.torch._ops_reshape_and_cache_flash as mod
        from adapters.torch._executor import set_call_memo
        set_call_memo(True)
        for i in range(4):
            key, value, kc, vc, slots = make_case(8, 2, 16, 3, 4, "float16")
            t = [to_torch(x) for x in (key, value, kc, vc, slots)]
            versions = (t[2]._version, t[3]._version)
            mod.reshape_and_cache_flash(*t)
            want = reshape_and_cache_flash_reference(key, value, kc, vc, slots)
            assert_bitwise_equal(torch_to_numpy(t[2]), want[0], f"key_cache, call {i}")
            assert_bitwise_equal(torch_to_numpy(t[3]), want[1], f"value_cache, call {i}")
            assert t[2]._version > versions[0] and t[3]._version > versions[1]
        assert mod._MEMO.entries and mod._MEMO.entries[0].hits >= 1

    @requires_gpu
    def test_cuda_graph_capture(self):
        import adapters.torch as at
        n, h, d, nb, bs = 64, 8, 128, 40, 16
        key, value, kc, vc, slots = make_case(n, h, d, nb, bs, "bfloat16", "float8_e4m3fn")
        t = [to_torch(x) for x in (key, value, kc, vc, slots)]
        scale = torch.tensor([0.125], device=DEVICE)
        at.reshape_and_cache_flash(*t, "fp8", scale, scale)   # warm-up: compiles outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            at.reshape_and_cache_flash(*t, "fp8", scale, scale)
        key2, value2, kc2, vc2, slots2 = make_case(n, h, d, nb, bs, "bfloat16", "float8_e4m3fn")
        for dst, src in zip(t, (key2, value2, kc2, vc2, slots2)):
            dst.copy_(to_torch(src))
        g.replay()
        torch.cuda.synchronize()
        want = reshape_and_cache_flash_reference(key2, value2, kc2, vc2, slots2, "fp8", 0.125, 0.125)
        assert_bitwise_equal(torch_to_numpy(t[2]), want[0], "key_cache after replay")
        assert_bitwise_equal(torch_to_numpy(t[3]), want[1], "value_cache after replay")

    @requires_gpu
    @pytest.mark.parametrize("dtype,kv_cache_dtype", [("bfloat16", "auto"), ("bfloat16", "fp8"),
                                                       ("float16", "fp8_e5m2")])
    def test_real_size(self, dtype, kv_cache_dtype):
        """The benchmark's size: 8192 tokens x 8 kv heads x 128 into a 16-token-block
        cache of twice the room, slots in shuffled blocks, some padding."""
        cache_dtype = FP8_FORMAT.get(kv_cache_dtype, dtype)
        self.check(make_case(8192, 8, 128, 1024, 16, dtype, cache_dtype, pad=100), kv_cache_dtype, 0.02, 0.05)


class TestJax(JaxAdapter, ReshapeAndCacheFlashTests):
    # see JaxAdapter.CPU_SKIP: the torch class runs these cases on the CPU, and the
    # bitwise torch-vs-JAX tests cover every storage mode through JAX
    CPU_SKIP = tuple(f"test_matches_reference[{SHAPE_ID(*s)}-{dt}]" for s in SHAPES for dt in ("float16", "bfloat16")) \
        + tuple(f"test_fp8_matches_reference[{k}-{c}-{dt}]" for k, c in FP8_CASES for dt in ("float16", "bfloat16"))

    def call(self, key, value, key_cache, value_cache, slots, *, jit=False, **kw):
        import jax
        import adapters.jax as aj
        fn = aj.reshape_and_cache_flash
        if jit:
            fn = jax.jit(fn, static_argnames=("kv_cache_dtype",))
        kc, vc = fn(*map(to_jax, (key, value, key_cache, value_cache, slots)), **kw)
        return np.asarray(kc), np.asarray(vc)

    def test_jit_donated_caches(self):
        import jax
        import adapters.jax as aj
        key, value, kc, vc, slots = make_case(13, 2, 16, 4, 4, "float32", "float8_e4m3fn")
        f = jax.jit(aj.reshape_and_cache_flash, donate_argnums=(2, 3), static_argnames=("kv_cache_dtype",))
        args = [jax.device_put(x) for x in (key, value, kc, vc, slots)]
        scale = jax.device_put(np.array([0.75], np.float32))
        got = f(*args, kv_cache_dtype="fp8", k_scale=scale, v_scale=scale)
        want = reshape_and_cache_flash_reference(key, value, kc, vc, slots, "fp8", 0.75, 0.75)
        assert_bitwise_equal(np.asarray(got[0]), want[0], "key_cache")
        assert_bitwise_equal(np.asarray(got[1]), want[1], "value_cache")
        if GPU:  # aliased: the donated buffers became the results
            assert args[2].is_deleted() and args[3].is_deleted()

    def test_vmap_is_the_per_example_calls(self):
        """Batched caches and slots, and a batched key over a shared cache (each
        example its own updated copy): one launch, bit for bit the per-example calls."""
        import jax
        import adapters.jax as aj
        v = 3
        cases = [make_case(6, 2, 8, 3, 4, "float16") for _ in range(v)]
        key, value, kc, vc, slots = (np.stack([c[i] for c in cases]) for i in range(5))
        slots[1, 2] = 12          # past example 1's cache: writes nothing there (nor elsewhere)
        got = jax.vmap(aj.reshape_and_cache_flash)(*map(to_jax, (key, value, kc, vc, slots)))
        for e in range(v):
            want = reshape_and_cache_flash_reference(key[e], value[e], kc[e], vc[e], slots[e])
            assert_bitwise_equal(np.asarray(got[0][e]), want[0], f"key_cache {e}")
            assert_bitwise_equal(np.asarray(got[1][e]), want[1], f"value_cache {e}")
        shared = jax.vmap(aj.reshape_and_cache_flash, in_axes=(0, 0, None, None, None))(
            *map(to_jax, (key, value, kc[0], vc[0], slots[0])))
        for e in range(v):
            want = reshape_and_cache_flash_reference(key[e], value[e], kc[0], vc[0], slots[0])
            assert_bitwise_equal(np.asarray(shared[0][e]), want[0], f"shared cache, key_cache {e}")

    def test_vmap_batched_scale_runs_per_example(self):
        """A batched scale (one per launch): one launch per example, its bits."""
        import jax
        import adapters.jax as aj
        key, value, kc, vc, slots = make_case(4, 2, 8, 2, 4, "float32", "float8_e4m3fn")
        scales = np.array([[0.5], [2.0]], np.float32)
        call = lambda k, s: aj.reshape_and_cache_flash(k, value, kc, vc, slots, kv_cache_dtype="fp8",  # noqa: E731
                                                       k_scale=s, v_scale=1.0)
        keys = np.stack([key, key[::-1].copy()])
        got = jax.vmap(call)(to_jax(keys), to_jax(scales))
        for e in range(2):
            one = call(to_jax(keys[e]), to_jax(scales[e]))
            for g, w, what in zip(got, one, ("key_cache", "value_cache")):
                assert_bitwise_equal(np.asarray(g[e]).view(np.uint8), np.asarray(w).view(np.uint8), f"{what} {e}")

    def test_traced_validation_refused(self):
        import jax
        import adapters.jax as aj
        key, value, kc, vc, slots = make_case(4, 2, 8, 2, 4)
        f = jax.jit(lambda s: aj.reshape_and_cache_flash(key, value, kc, vc, s, validate_indices=True))
        with pytest.raises(ValueError, match="^validate_indices: "):
            f(to_jax(slots))


# ------------------------------------------------------------------ parity
@pytest.mark.parametrize("dtype,kv_cache_dtype,cache_dtype", [
    ("bfloat16", "auto", "bfloat16"), ("float32", "auto", "float32"), ("bfloat16", "fp8", "uint8"),
    ("float16", "fp8_e4m3", "float8_e4m3fn"), ("float32", "fp8_e5m2", "float8_e5m2")])
def test_torch_and_jax_bitwise_equal(dtype, kv_cache_dtype, cache_dtype):
    key, value, kc, vc, slots = make_case(37, 3, 48, 6, 16 if GPU else 8, dtype, cache_dtype, key_scale=50.0)
    scales = {} if kv_cache_dtype == "auto" else dict(k_scale=0.3, v_scale=0.7)
    t = TestTorch().call(key, value, kc, vc, slots, kv_cache_dtype=kv_cache_dtype, **scales)
    j = TestJax().call(key, value, kc, vc, slots, kv_cache_dtype=kv_cache_dtype, jit=True, **scales)
    assert_bitwise_equal(_bits(t[0]), _bits(j[0]), "key_cache torch vs jax")
    assert_bitwise_equal(_bits(t[1]), _bits(j[1]), "value_cache torch vs jax")


def test_plan_is_one_launch_with_vector_alignment():
    """The bench's layout plans one launch whose strides keep 16-element alignment
    (16-byte vectors for both the 2-byte key and the 1-byte cache)."""
    from core_kernels._plan import ArrayInfo
    from core_kernels._target import Target
    k = ArrayInfo.contiguous((8192, 8, 128), "bfloat16")
    c = ArrayInfo.contiguous((1024, 16, 8, 128), "float8_e4m3fn")
    s, sc = ArrayInfo.contiguous((8192,), "int64"), ArrayInfo.contiguous((1,), "float32")
    plan = plan_reshape_and_cache_flash(Target("cuda", 90, 132), k, k, c, c, s, sc, sc, kv_cache_dtype="fp8")
    (launch,) = plan.launches
    assert launch.constexprs["SRC_ALIGN"] == 16 and launch.constexprs["DST_ALIGN"] == 16
    assert launch.constexprs["FP8"] and not launch.constexprs["STORE_BITS"]


# ------------------------------------------------------------------ sharding (4 CPU devices)
_SHARD_SCRIPT = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, "tests")
import numpy as np, jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import adapters.jax as aj
from test_reshape_and_cache_flash import make_case
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
mesh = Mesh(np.array(jax.devices()), ("x",))
key, value, kc, vc, slots = make_case(9, 4, 8, 3, 4, "float32", "float8_e4m3fn", seed=3)
fn = lambda k, v, kc, vc, s: aj.reshape_and_cache_flash(k, v, kc, vc, s, kv_cache_dtype="fp8", k_scale=0.5,
                                                        v_scale=2.0)
want = fn(key, value, kc, vc, slots)
heads, cache = P(None, "x"), P(None, None, "x")
specs = (heads, heads, cache, cache, P())
args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((key, value, kc, vc, slots), specs)]
f = jax.jit(fn, donate_argnums=(2, 3))
hlo = f.lower(*args).compile().as_text()
got = f(*args)
for g, w in zip(got, want):
    assert np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8)), "sharded result differs"
    assert g.sharding.spec == cache, g.sharding.spec
found = [c for c in COLLECTIVES if c in hlo]
assert not found, found
print("ok")
"""


@pytest.mark.skipif(GPU, reason="host devices (the CPU interpreter path)")
def test_sharded_over_kv_heads_without_collectives():
    repo = pathlib.Path(core_kernels.__file__).parent.parent
    env = dict(os.environ, PYTHONPATH=str(repo))
    res = subprocess.run([sys.executable, "-c", _SHARD_SCRIPT], env=env, cwd=repo, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == "ok", res.stdout[-2000:] + res.stderr[-4000:]


@pytest.mark.skipif(not GPU, reason="needs a GPU (the launch is a jax-triton custom call)")
def test_jax_export_roundtrip():
    import jax
    import adapters.jax as aj
    key, value, kc, vc, slots = make_case(9, 2, 16, 3, 4, "bfloat16")
    args = tuple(jax.device_put(a) for a in (key, value, kc, vc, slots))
    want = aj.reshape_and_cache_flash(*args)
    exported = jax.export.export(
        jax.jit(aj.reshape_and_cache_flash),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call")])(*args)
    got = jax.export.deserialize(exported.serialize()).call(*args)
    for g, w in zip(got, want):
        assert_bitwise_equal(np.asarray(g), np.asarray(w), "exported call")

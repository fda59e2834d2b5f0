"""unified_attention: both adapters against the float64 reference (contract:
docs/ops/unified_attention.md), torch == JAX bit for bit, the vLLM call forms,
index validation, and the transforms (torch.compile, CallMemo, jax.jit / vmap)."""
from __future__ import annotations

import enum
import functools
import math

import numpy as np
import pytest
import torch

from core_kernels._plan import ArrayInfo
from core_kernels._target import Target
from core_kernels.unified_attention import (check_unified_attention, plan_unified_attention,
                                            unified_attention_reference)
from core_kernels.unified_attention.reference import visible_keys
from harness import (DEVICE, FLOAT_DTYPES, GPU, TOL, JaxAdapter, TorchAdapter, assert_bitwise_equal,
                     assert_close, assert_within_one_fp8_step, cast, jax_to_numpy, np_dtype,
                     poison_like, requires_gpu, rng, to_jax, to_torch, torch_to_numpy)
import adapters.torch as at

GARBAGE_ID = 1 << 30  # a table slot no query needs: reading it would fault
E4M3 = "float8_e4m3fn"
ARRAYS = ("q", "k", "v", "cu_seqlens_q", "seqused_k", "block_table")


def _nan_bits(a):
    """Set ``a`` (a view) to NaN, whatever its float or fp8 dtype."""
    if a.dtype.itemsize == 1:
        a.view(np.uint8)[...] = 0x7F
    else:
        a[...] = np.nan


def make_case(seqs, hq=4, hkv=2, d=32, bs=16, dtype="float32", *, kv=None, q_fp8=False,
              window_left=-1, causal=True, seed=None, table_dtype="int32", per_seq_descale=False,
              extra_rows=0, num_blocks=None, width=None):
    """Random inputs for sequences [(query_len, context_len), ...] (seqused_k =
    context + query). ``kv``: None (q's dtype), "fp8" (an e4m3 cache) or "uint8"
    (e4m3 bits as uint8), with descales (one element, or [B, Hkv] with
    ``per_seq_descale``); ``q_fp8``: an e4m3 q with its descale. ``causal``: a
    bool or one per sequence. ``extra_rows``: q rows past the last sequence.

    Physical blocks are permuted; every cache token no query can see (stale
    blocks, the tail of a sequence's last block, tokens before the window, every
    token of a sequence without queries) is NaN, and unused table slots hold a
    NaN block's id or a wild one (never to be read)."""
    g = rng(seed)
    qlens = np.array([s[0] for s in seqs], np.int64)
    lens = np.array([s[0] + s[1] for s in seqs], np.int64)
    t, b = int(qlens.sum()) + extra_rows, len(seqs)
    flags = np.broadcast_to(np.asarray(causal, bool), (b,))
    used = [-(-int(n) // bs) for n in lens]
    width = max(max(used + [1]) + 2, width or 0)
    num_blocks = max(sum(used) + 3, num_blocks or 0)
    ids = g.permutation(num_blocks)
    stale = ids[sum(used):]
    table = np.empty((b, width), np.int64)
    pos = 0
    for i, n in enumerate(used):
        table[i, :n] = ids[pos:pos + n]
        pos += n
        for j in range(n, width):
            table[i, j] = stale[j % len(stale)] if j % 2 else GARBAGE_ID
    cdt = dtype if kv is None else E4M3
    scale = 2.0 if kv else 1.0
    k = cast(g.standard_normal((num_blocks, bs, hkv, d), np.float32) * scale, cdt)
    v = cast(g.standard_normal((num_blocks, bs, hkv, d), np.float32) * scale, cdt)
    for blk in stale:
        _nan_bits(k[blk])
        _nan_bits(v[blk])
    for i in range(b):
        ctx = int(lens[i] - qlens[i])
        lo = max(0, ctx - window_left) if window_left >= 0 else 0
        hidden = range(used[i] * bs) if qlens[i] == 0 else \
            list(range(lo)) + list(range(int(lens[i]), used[i] * bs))
        for tok in hidden:
            _nan_bits(k[table[i, tok // bs], tok % bs])
            _nan_bits(v[table[i, tok // bs], tok % bs])
        if qlens[i] == 0:  # never read: its table row may hold anything
            table[i, :] = GARBAGE_ID
    case = dict(q=cast(g.standard_normal((t, hq, d)) * (2.0 if q_fp8 else 1.0), E4M3 if q_fp8 else dtype),
                k=k.view(np.uint8) if kv == "uint8" else k, v=v.view(np.uint8) if kv == "uint8" else v,
                cu_seqlens_q=np.concatenate([[0], np.cumsum(qlens)]).astype(table_dtype),
                seqused_k=lens.astype(table_dtype), block_table=table.astype(table_dtype),
                max_seqlen_q=int(qlens.max(initial=0)), max_seqlen_k=int(lens.max(initial=0)),
                out_dtype=dtype, causal=bool(causal) if np.ndim(causal) == 0 else flags.copy())
    if kv:
        shape = (b, hkv) if per_seq_descale else (1,)
        case["k_descale"] = g.uniform(0.3, 0.8, shape).astype(np.float32)
        case["v_descale"] = g.uniform(0.6, 1.4, shape).astype(np.float32)
    if q_fp8:
        case["q_descale"] = np.array([0.6], np.float32)
    return case


OPTIONS = ("softmax_scale", "causal", "window_size", "softcap", "q_descale", "k_descale", "v_descale",
           "alibi_slopes", "use_alibi_sqrt", "sinks")


def reference(case, *, out=None, softmax_scale=None, **opts):
    """The float64 reference of a case with the call's options (``out``: the values of
    rows of no sequence)."""
    kw = {n: case[n] for n in ("causal", "q_descale", "k_descale", "v_descale") if n in case}
    kw.update({n: x for n, x in opts.items() if n in OPTIONS})
    scale = softmax_scale if softmax_scale is not None else case["q"].shape[-1] ** -0.5
    return unified_attention_reference(*(case[n] for n in ARRAYS), softmax_scale=scale, out=out, **kw)


def tolerance_dtype(case):
    """fp32 on the GPU: tf32 dots (the fp16 tolerance); an fp8 q computes in bf16."""
    dtype = case["out_dtype"]
    if case["q"].dtype.name == E4M3:
        return "bfloat16"
    return "float16" if GPU and dtype == "float32" else dtype


def check(out, ref, case, what, scale=1.0):
    assert_close(out, ref, tolerance_dtype(case), what, scale=scale)


def fp8_out_check(out8, ref, scale, case, what="fp8 output"):
    """Within one fp8 step of the rounded float64 reference, or within the compute
    dtype's error magnified by 1 / scale."""
    assert out8.dtype.name == E4M3, out8.dtype
    atol = TOL[tolerance_dtype(case)][0] / scale
    assert_within_one_fp8_step(out8, np.asarray(ref, np.float64) / scale, what, atol=atol)


# (seqs, hq, hkv, d, block_size): decode rows (qlen <= 8: the decode path) and prefill
# rows (the prefill path) mixed, empty sequences mid-batch (with and without keys),
# GQA 5:1, MHA, head sizes 64 / 80 / 256, block sizes 16 / 32 / 48.
SHAPES = {
    "mixed-gqa5-d64-bs16": ([(20, 37), (1, 50), (0, 12), (33, 0), (1, 0), (0, 0), (5, 16)], 5, 1, 64, 16),
    "decode-only-d80-bs32": ([(1, 70), (1, 5), (4, 40), (1, 31)], 4, 2, 80, 32),
    "prefill-only-mha-d32-bs48": ([(17, 100), (12, 0)], 2, 2, 32, 48),
    "d256-bs16": ([(10, 20), (1, 3)], 2, 1, 256, 16),
}
MIXED = SHAPES["mixed-gqa5-d64-bs16"][0][:4]


def _opts(name, hq, g):
    """Keyword options of a named combination (words joined by "-")."""
    words = name.split("-")
    opts = {}
    if "window" in words:
        opts["window_size"] = (18, 0)
    if "softcap" in words:
        opts["softcap"] = 3.0
    if "alibi" in words or "alibisqrt" in words:
        opts["alibi_slopes"] = (2.0 ** -(1 + np.arange(hq))).astype(np.float32)
        opts["use_alibi_sqrt"] = "alibisqrt" in words
    if "sinks" in words:
        opts["sinks"] = (g.standard_normal(hq) * 2).astype(np.float32)
    if "scale" in words:
        opts["softmax_scale"] = 0.3
    return opts


OPTION_SETS = ["window", "softcap", "alibi", "alibisqrt", "sinks", "scale",
               "window-softcap-alibi-sinks-scale", "noncausal", "noncausal-window-sinks",
               "perseq-window-alibisqrt"]


def _option_case(name, seed=None):
    """(case, options) of test_options: decode and prefill rows of GQA 2:1, fp16."""
    g = rng(seed)
    opts = _opts(name, 4, g)
    causal = True
    if "noncausal" in name:
        causal = False
    elif "perseq" in name:
        causal = [True, False, False, True]
    case = make_case(MIXED, 4, 2, 32, 16, "float16", causal=causal,
                     window_left=opts.get("window_size", (-1, 0))[0], seed=seed)
    return case, opts


def _error_cases():
    """(argument named, case, options, exception)."""
    c = make_case([(4, 10), (1, 3)], 4, 2, 32, 16, "float32")
    f32 = np.float32
    return [
        ("q", {**c, "q": np.zeros((5, 3, 32), f32)}, {}, ValueError),            # Hq % Hkv
        ("k", {**c, "k": c["k"][..., :16]}, {}, ValueError),                    # head size
        ("v", {**c, "v": c["v"][:, :8]}, {}, ValueError),
        ("k", {**c, "k": c["k"].astype(np.float16), "v": c["v"].astype(np.float16)}, {}, TypeError),
        ("block_table", {**c, "block_table": c["block_table"][:1]}, {}, ValueError),
        ("cu_seqlens_q", {**c, "cu_seqlens_q": c["cu_seqlens_q"][:2]}, {}, ValueError),
        ("seqused_k", {**c, "seqused_k": c["seqused_k"].astype(f32)}, {}, TypeError),
        ("alibi_slopes", c, dict(alibi_slopes=np.ones(3, f32)), ValueError),
        ("sinks", c, dict(sinks=np.ones((4, 1), f32)), ValueError),
        ("softcap", c, dict(softcap=-1.0), ValueError),
        ("window_size", c, dict(window_size=(-2, 0)), ValueError),
        ("k_descale", make_case([(4, 10)], 4, 2, 32, 16, "float32", kv="fp8") | {"k_descale": None},
         {}, ValueError),
    ]


def _bad_table_entry(c):
    c["block_table"] = c["block_table"].copy()
    c["block_table"][0, 1] = c["k"].shape[0]           # a block sequence 0 reads, one past the cache
    return c, {}


def _short_seqused(c):
    c["seqused_k"] = c["seqused_k"].copy()
    c["seqused_k"][3] = 10                              # 33 queries over 10 keys
    return c, {}


def _past_table(c):
    c["seqused_k"] = c["seqused_k"].copy()
    c["seqused_k"][1] += 16 * c["block_table"].shape[1]
    return c, dict(max_seqlen_k=int(c["seqused_k"].max()))


def _not_monotone(c):
    c["cu_seqlens_q"] = c["cu_seqlens_q"].copy()
    c["cu_seqlens_q"][2] = c["cu_seqlens_q"][1] - 1
    return c, {}


def _past_tokens(c):
    c["cu_seqlens_q"] = c["cu_seqlens_q"].copy()
    c["cu_seqlens_q"][-1] += 1
    return c, {}


# name: (the argument the error names, mutation of a valid case -> (case, options))
BAD_INDICES = {
    "block-id-past-the-cache": ("block_table", _bad_table_entry),
    "seqused-below-query-length": ("seqused_k", _short_seqused),
    "length-past-the-table": ("seqused_k", _past_table),
    "cu-seqlens-decreasing": ("cu_seqlens_q", _not_monotone),
    "cu-seqlens-past-the-tokens": ("cu_seqlens_q", _past_tokens),
    "max-seqlen-q-too-small": ("max_seqlen_q", lambda c: (c, dict(max_seqlen_q=c["max_seqlen_q"] - 1))),
    "max-seqlen-k-too-small": ("max_seqlen_k", lambda c: (c, dict(max_seqlen_k=c["max_seqlen_k"] - 1))),
}


class UnifiedTests:
    """Every unified_attention test, written once; a subclass per adapter
    implements ``attention`` (and may add framework-only tests)."""

    def attention(self, case, *, out=None, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                  alibi_slopes=None, use_alibi_sqrt=False, sinks=None, output_scale=None,
                  config=None, validate_indices=None, max_seqlen_q=None, max_seqlen_k=None):
        """A numpy case (make_case) -> the numpy output through this adapter.
        ``out``: the output's values before the call (None: NaN for torch, the
        adapter's default for JAX)."""
        raise NotImplementedError

    @pytest.mark.parametrize("dtype", FLOAT_DTYPES)
    @pytest.mark.parametrize("shape", list(SHAPES))
    def test_matches_reference(self, dtype, shape):
        if dtype != "float32" and shape != "mixed-gqa5-d64-bs16" and not GPU:
            pytest.skip("CPU time: 16-bit dtypes on the mixed batch only")
        seqs, hq, hkv, d, bs = SHAPES[shape]
        case = make_case(seqs, hq, hkv, d, bs, dtype)
        check(self.attention(case), reference(case), case, shape)

    @pytest.mark.parametrize("options", OPTION_SETS)
    def test_options(self, options):
        case, opts = _option_case(options)
        check(self.attention(case, **opts), reference(case, **opts), case, options)

    @pytest.mark.parametrize("kv,per_seq,q_fp8", [("fp8", False, False), ("uint8", True, False),
                                                  ("fp8", True, True)], ids=str)
    def test_fp8_cache(self, kv, per_seq, q_fp8):
        """e4m3 caches (as float8_e4m3fn or uint8 bits) with one descale or one per
        sequence and kv head, and an e4m3 q with its descale (bf16 output)."""
        case = make_case(MIXED, 4, 2, 32, 16, "bfloat16" if q_fp8 else "float16", kv=kv,
                         per_seq_descale=per_seq, q_fp8=q_fp8)
        check(self.attention(case), reference(case), case, f"{kv} per_seq={per_seq} q_fp8={q_fp8}")

    @pytest.mark.parametrize("scale", [0.004, 256.0], ids=["saturating", "subnormal"])
    def test_fp8_output(self, scale):
        """0.004: |o| up to ~2 saturates at 448 (clamp before the cast); 256: every
        output in e4m3's subnormal range."""
        case = make_case([(23, 30), (1, 12), (6, 0)], 4, 2, 32, 16, "float32")
        ref = reference(case)
        fp8_out_check(self.attention(case, output_scale=scale), ref, scale, case)
        if scale < 1:
            assert np.abs(ref / scale).max() > 448, "the test should exercise the clamp"
        else:
            assert np.abs(ref / scale).max() < 2 ** -6, "every output should be subnormal"

    def test_everything_combined(self):
        """fp8 cache with per-sequence descales, fp8 output, window, softcap, ALiBi,
        sinks, per-sequence causal flags, GQA 5:1, block 48, decode and prefill rows."""
        g = rng()
        opts = _opts("window-softcap-alibi-sinks-scale", 5, g)
        case = make_case([(30, 70), (1, 40), (12, 0), (3, 9)], 5, 1, 48, 48, "float16", kv="uint8",
                         per_seq_descale=True, window_left=18, causal=[True, True, False, False])
        fp8_out_check(self.attention(case, output_scale=0.01, **opts), reference(case, **opts), 0.01,
                      case)

    def test_rows_of_no_sequence_keep_out(self):
        """q rows past cu_seqlens_q[B] belong to no sequence: out keeps its values there."""
        case = make_case([(9, 20), (1, 7)], 4, 2, 32, 16, "float32", extra_rows=3)
        keep = rng().standard_normal(case["q"].shape).astype(np.float32)
        out = self.attention(case, out=keep)
        check(out, reference(case, out=keep), case, "rows past the batch")
        assert_bitwise_equal(out[-3:], keep[-3:], "rows of no sequence")

    def test_empty_batches(self):
        """No tokens; sequences without queries only; no sequences."""
        for seqs, rows in (([(0, 5), (0, 0)], 0), ([(0, 5), (0, 0)], 2), ([], 3)):
            case = make_case(seqs, 4, 2, 32, 16, "float32", extra_rows=rows)
            keep = np.full(case["q"].shape, 7.0, np.float32)
            out = self.attention(case, out=keep)
            assert_bitwise_equal(out, keep, f"{seqs} + {rows} rows: nothing to compute")

    def test_max_seqlen_bounds_above_the_lengths(self):
        """Bounds larger than the batch's lengths (vLLM passes the scheduler's) change nothing."""
        case = make_case(MIXED, 4, 2, 32, 16, "float32")
        base = self.attention(case)
        big = self.attention(case, max_seqlen_q=case["max_seqlen_q"] + 40,
                             max_seqlen_k=case["max_seqlen_k"] + 1000)
        assert_bitwise_equal(big, base, "larger max_seqlen bounds")

    def test_results_independent_of_the_batch(self):
        """A sequence's rows are the same bits alone as with others in the call (prefill
        and decode rows)."""
        seqs = [(20, 37), (1, 50), (33, 0), (1, 200)]
        case = make_case(seqs, 4, 2, 32, 16, "float32", table_dtype="int64")
        whole = self.attention(case)
        cu = case["cu_seqlens_q"]
        for i in (0, 1, 3):
            one = {**case, "q": case["q"][cu[i]:cu[i + 1]], "cu_seqlens_q": np.array([0, cu[i + 1] - cu[i]]),
                   "seqused_k": case["seqused_k"][i:i + 1], "block_table": case["block_table"][i:i + 1]}
            assert_bitwise_equal(self.attention(one), whole[cu[i]:cu[i + 1]], f"sequence {i} alone")

    @pytest.mark.parametrize("case", range(12))
    def test_errors_name_the_argument(self, case):
        name, c, opts, exc = _error_cases()[case]
        with pytest.raises(exc, match=name):
            self.attention(c, **opts)

    @pytest.mark.parametrize("bad", list(BAD_INDICES))
    def test_validation_mode_names_the_argument(self, bad):
        name, mutate = BAD_INDICES[bad]
        case = make_case(MIXED, 4, 2, 32, 16, "float32", table_dtype="int64")
        case, opts = mutate(dict(case))
        with pytest.raises(ValueError, match=f"^{name}: "):
            self.attention(case, validate_indices=True, **opts)

    def test_validation_env_switch(self, monkeypatch):
        """TANDEM_VALIDATE_INDICES=1 validates a call that does not ask; False opts out."""
        case, _ = _bad_table_entry(dict(make_case([(1, 30), (1, 9)], 4, 2, 32, 16, "float32")))
        monkeypatch.setenv("TANDEM_VALIDATE_INDICES", "1")
        with pytest.raises(ValueError, match="^block_table: "):
            self.attention(case)
        monkeypatch.setenv("TANDEM_VALIDATE_INDICES", "0")
        with pytest.raises(TypeError, match="^validate_indices: "):
            self.attention(case, validate_indices="yes")

    def test_validation_mode_accepts_unread_garbage(self):
        """Wild ids in table slots no query needs (past a sequence, before its window,
        a sequence without queries) pass the check, and the result is unchanged."""
        case = make_case(MIXED + [(0, 40)], 4, 2, 32, 16, "float32", window_left=10, table_dtype="int64")
        ctx = case["seqused_k"][0] - (case["cu_seqlens_q"][1] - case["cu_seqlens_q"][0])
        assert ctx - 10 >= 16, "sequence 0's first block should be outside its window"
        case["block_table"][0, 0] = -GARBAGE_ID
        opts = dict(window_size=(10, 0))
        check(self.attention(case, validate_indices=True, **opts), reference(case, **opts), case,
              "garbage outside the read range")


# ------------------------------------------------------------------ torch
class KVQuantMode(enum.IntEnum):
    """vLLM's enum (vllm/v1/kv_cache_interface.py), its names and values, for the call forms."""
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
    NVFP4 = 5


def _torch_call(case, out, *, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                use_alibi_sqrt=False, sinks=None, output_scale=None, config=None, validate_indices=None,
                max_seqlen_q=None, max_seqlen_k=None, **extra):
    """at.unified_attention called by keyword as vLLM's backend does; ``out`` (a tensor)
    written in place."""
    t = {n: to_torch(case[n]) for n in ARRAYS}
    causal = case["causal"]
    at.unified_attention(
        q=t["q"], k=t["k"], v=t["v"], out=out, cu_seqlens_q=t["cu_seqlens_q"],
        max_seqlen_q=case["max_seqlen_q"] if max_seqlen_q is None else max_seqlen_q,
        seqused_k=t["seqused_k"],
        max_seqlen_k=case["max_seqlen_k"] if max_seqlen_k is None else max_seqlen_k,
        softmax_scale=case["q"].shape[-1] ** -0.5 if softmax_scale is None else softmax_scale,
        causal=to_torch(causal) if isinstance(causal, np.ndarray) else causal, window_size=window_size,
        block_table=t["block_table"], softcap=softcap,
        q_descale=None if case.get("q_descale") is None else to_torch(case["q_descale"]),
        k_descale=None if case.get("k_descale") is None else to_torch(case["k_descale"]),
        v_descale=None if case.get("v_descale") is None else to_torch(case["v_descale"]),
        alibi_slopes=None if alibi_slopes is None else to_torch(alibi_slopes), use_alibi_sqrt=use_alibi_sqrt,
        sinks=None if sinks is None else to_torch(sinks),
        output_scale=None if output_scale is None else to_torch(np.array([output_scale], np.float32)),
        config=config, validate_indices=validate_indices,
        **{"kv_quant_mode": 1 if case["k"].dtype.name in (E4M3, "uint8") else 0, **extra})
    return out


class TestTorch(TorchAdapter, UnifiedTests):
    def attention(self, case, *, out=None, output_scale=None, **opts):
        dtype = E4M3 if output_scale is not None else case["out_dtype"]
        o = to_torch(poison_like(case["q"].shape, dtype) if out is None else out)
        return self.numpy(_torch_call(case, o, output_scale=output_scale, **opts))

    # ---- vLLM's call forms
    def test_vllm_kernel_test_call(self):
        """The call of vLLM's tests/kernels/attention/test_triton_unified_attention.py:
        every argument by keyword, the split-softmax scratch (ignored), [B, Hkv] fp8
        descales, kv_quant_mode as vLLM's IntEnum; bf16 out for an fp8 q."""
        case = make_case(MIXED, 4, 2, 32, 16, "bfloat16", kv="fp8", per_seq_descale=True, q_fp8=True)
        t = {n: to_torch(case[n]) for n in ARRAYS}
        out = torch.full(case["q"].shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
        segs, hp = 16, 32
        at.unified_attention(
            q=t["q"], k=t["k"], v=t["v"], out=out, cu_seqlens_q=t["cu_seqlens_q"],
            seqused_k=t["seqused_k"], max_seqlen_q=case["max_seqlen_q"],
            max_seqlen_k=case["max_seqlen_k"], softmax_scale=32 ** -0.5, causal=True,
            window_size=(-1, -1), block_table=t["block_table"], softcap=0,
            q_descale=to_torch(case["q_descale"].reshape(())), k_descale=to_torch(case["k_descale"]),
            v_descale=to_torch(case["v_descale"]), seq_threshold_3D=8, num_par_softmax_segments=segs,
            softmax_segm_output=torch.empty(8, 4, segs, hp, device=DEVICE),
            softmax_segm_max=torch.empty(8, 4, segs, device=DEVICE),
            softmax_segm_expsum=torch.empty(8, 4, segs, device=DEVICE),
            kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
        check(self.numpy(out), reference(case), case, "vLLM's test call")

    def test_kv_quant_mode_forms(self):
        """vLLM's enum member, its int, its name (bare or qualified): the same launch."""
        case = make_case([(9, 20), (1, 7)], 4, 2, 32, 16, "float16", kv="fp8")
        outs = [self.numpy(_torch_call(case, to_torch(poison_like(case["q"].shape, "float16")),
                                       kv_quant_mode=mode))
                for mode in (1, KVQuantMode.FP8_PER_TENSOR, "FP8_PER_TENSOR", "KVQuantMode.FP8_PER_TENSOR")]
        for o in outs[1:]:
            assert_bitwise_equal(o, outs[0], "kv_quant_mode forms")
        check(outs[0], reference(case), case, "fp8 cache")

    @pytest.mark.parametrize("arg,value", [
        ("qq_bias", "tensor"), ("mm_prefix_range", "tensor"), ("rswa_prefix_lens", "tensor"),
        ("rswa_window", 64), ("chunk_lookback", 0), ("use_td", True),
        ("kv_quant_mode", KVQuantMode.INT8_PER_TOKEN_HEAD), ("kv_quant_mode", "FP8_PER_TOKEN_HEAD"),
        ("kv_quant_mode", KVQuantMode.INT4_PER_TOKEN_HEAD), ("kv_quant_mode", "NVFP4")], ids=str)
    def test_out_of_scope_modes_raise(self, arg, value):
        case = make_case([(4, 10)], 4, 2, 32, 16, "float32")
        out = to_torch(poison_like(case["q"].shape, "float32"))
        if value == "tensor":
            value = torch.zeros(1, 2, 2, dtype=torch.int32, device=DEVICE)
        with pytest.raises(NotImplementedError, match=f"^{arg}: "):
            _torch_call(case, out, **{arg: value})
        assert torch.isnan(out).all(), "nothing may be written"

    def test_unknown_kv_quant_mode(self):
        case = make_case([(4, 10)], 4, 2, 32, 16, "float32")
        for mode in (9, "FP4_SOMETHING", -1):
            with pytest.raises(ValueError, match="^kv_quant_mode: "):
                _torch_call(case, to_torch(poison_like(case["q"].shape, "float32")), kv_quant_mode=mode)

    def test_per_sequence_causal_tensor_forms(self):
        """The per-sequence flags as a bool tensor or an int32 one: the same bits."""
        case, opts = _option_case("perseq-window-alibisqrt")
        base = self.attention(case, **opts)
        check(base, reference(case, **opts), case, "per-sequence flags")
        ints = {**case, "causal": case["causal"].astype(np.int32)}
        assert_bitwise_equal(self.attention(ints, **opts), base, "int32 flags")

    def test_causal_flags_must_be_a_tensor(self):
        case = make_case([(4, 10), (1, 3)], 4, 2, 32, 16, "float32")
        with pytest.raises(TypeError, match="^causal: "):
            _torch_call({**case, "causal": [True, False]}, to_torch(poison_like(case["q"].shape, "float32")))

    def test_host_descales_and_output_scale(self):
        """Descales and output_scale as host floats give the tensors' bits."""
        case = make_case([(9, 20), (1, 7)], 4, 2, 32, 16, "float32", kv="fp8")
        base = self.attention(case, output_scale=0.05)
        host = {**case, "k_descale": float(case["k_descale"][0]), "v_descale": float(case["v_descale"][0])}
        o = to_torch(poison_like(case["q"].shape, E4M3))
        t = {n: to_torch(case[n]) for n in ARRAYS}
        at.unified_attention(t["q"], t["k"], t["v"], o, t["cu_seqlens_q"], case["max_seqlen_q"],
                             t["seqused_k"], case["max_seqlen_k"], 32 ** -0.5, True, (-1, -1),
                             t["block_table"], 0.0, None, host["k_descale"], host["v_descale"],
                             output_scale=0.05, kv_quant_mode=1)
        assert_bitwise_equal(self.numpy(o), base, "host floats vs tensors (positional call)")

    def test_compile_fullgraph_and_opcheck(self):
        case = make_case([(9, 20), (1, 7), (3, 0)], 4, 2, 32, 16, "float32")
        t = {n: to_torch(case[n]) for n in ARRAYS}
        sinks = to_torch(rng().standard_normal(4).astype(np.float32))

        def f(q, k, v, cu, used, table, sinks, out):
            at.unified_attention(q, k, v, out, cu, case["max_seqlen_q"], used, case["max_seqlen_k"], 0.2,
                                 True, (7, 0), table, 2.0, None, None, None, sinks=sinks)
            return out * 2

        eager = f(*(t[n] for n in ARRAYS), sinks, torch.zeros(case["q"].shape, device=DEVICE))
        backend = "inductor" if GPU else "aot_eager"
        compiled = torch.compile(f, fullgraph=True, backend=backend)(
            *(t[n] for n in ARRAYS), sinks, torch.zeros(case["q"].shape, device=DEVICE))
        assert_bitwise_equal(torch_to_numpy(compiled), torch_to_numpy(eager), "compiled vs eager")
        check(torch_to_numpy(eager) / 2, reference(case, softmax_scale=0.2, window_size=(7, 0), softcap=2.0,
                                                   sinks=torch_to_numpy(sinks)), case, "eager")
        args = (*(t[n] for n in ARRAYS[:3]), torch.zeros(case["q"].shape, device=DEVICE),
                *(t[n] for n in ARRAYS[3:]), None, None, None, None, None, sinks, None,
                case["max_seqlen_q"], case["max_seqlen_k"], 0.2, True, 7, 0, 2.0, False, 0, None)
        torch.library.opcheck(torch.ops.tandem_attn.unified_attention, args)

    def test_call_memo_replays_bitwise(self):
        """Repeated decode-step calls (same layouts, new values) are replayed from the
        CallMemo and give the regular path's bits; a changed scalar takes the regular path."""
        from adapters.torch import _ops_unified_attention as mod
        mod._MEMO.entries.clear()
        mod._MEMO.seen.clear()
        outs, refs = [], []
        for step in range(4):  # the same layouts every step: 2 + 1 + 1 blocks, a 4-column table
            case = make_case([(1, 20 + step), (1, 12), (1, 0)], 4, 2, 32, 16, "float32", seed=100 + step)
            outs.append(self.attention(case, max_seqlen_k=40))
            refs.append(reference(case))
        assert len(mod._MEMO.entries) == 1, "the repeated layout should have a memo entry"
        assert mod._MEMO.entries[0].hits >= 1, "later steps should replay"
        for o, r in zip(outs, refs):
            check(o, r, case, "memo replay")


def _autograd_example():
    case = make_case([(3, 5), (1, 0)], 2, 1, 16, 8, "float32", seed=1)
    t = {n: to_torch(case[n]) for n in ARRAYS}
    return dict(t, out=to_torch(np.zeros(case["q"].shape, np.float32)), causal_flags=None, q_descale=None,
                k_descale=None, v_descale=None, alibi_slopes=None, sinks=None, output_scale=None,
                max_seqlen_q=case["max_seqlen_q"], max_seqlen_k=case["max_seqlen_k"], softmax_scale=0.25,
                causal=True, window_left=-1, window_right=-1, softcap=0.0, use_alibi_sqrt=False,
                kv_quant_mode=0, config=None)


# the torch op's example for the generic autograd tests (tests/test_autograd_safety.py)
AUTOGRAD_EXAMPLES = {"unified_attention": (_autograd_example, "q")}


# ------------------------------------------------------------------ JAX
class TestJax(JaxAdapter, UnifiedTests):
    # NOTE: CPU time: the interpreted kernels these repeat run in the torch class on the
    # same shapes; the JAX plumbing of each option stays covered by the others here
    # and by the torch-vs-JAX bitwise tests.
    CPU_SKIP = tuple(f"test_matches_reference[{s}-{d}]" for s in SHAPES for d in FLOAT_DTYPES
                     if (s, d) != ("mixed-gqa5-d64-bs16", "float32")) + (
        "test_options[window]", "test_options[softcap]", "test_options[alibi]", "test_options[sinks]",
        "test_options[scale]", "test_options[noncausal]", "test_fp8_output[saturating]",
        "test_results_independent_of_the_batch")

    def attention(self, case, *, out=None, softmax_scale=None, max_seqlen_q=None, max_seqlen_k=None,
                  output_scale=None, jit=False, **opts):
        import jax
        import adapters.jax as aj
        fn = functools.partial(
            aj.unified_attention,
            max_seqlen_q=case["max_seqlen_q"] if max_seqlen_q is None else max_seqlen_q,
            max_seqlen_k=case["max_seqlen_k"] if max_seqlen_k is None else max_seqlen_k,
            softmax_scale=case["q"].shape[-1] ** -0.5 if softmax_scale is None else softmax_scale,
            out_dtype=None if output_scale is not None else case["out_dtype"])
        opts = {n: to_jax(x) if isinstance(x, np.ndarray) else x for n, x in opts.items()}
        arrays = {n: case.get(n) for n in ("q_descale", "k_descale", "v_descale")}
        arrays["output_scale"] = None if output_scale is None else np.float32(output_scale)
        arrays["out"] = out
        causal = case["causal"]
        if isinstance(causal, np.ndarray):
            arrays["causal"] = causal
        else:
            fn = functools.partial(fn, causal=causal)
        arrays = {n: to_jax(x) for n, x in arrays.items() if x is not None}
        statics = {n: x for n, x in opts.items() if not hasattr(x, "shape")}
        arrays.update({n: x for n, x in opts.items() if hasattr(x, "shape")})
        fn = functools.partial(fn, **statics)
        if jit:
            fn = jax.jit(fn)
        return jax_to_numpy(fn(*(to_jax(case[n]) for n in ARRAYS), **arrays))

    def test_rows_of_no_sequence_are_zeros_without_out(self):
        case = make_case([(9, 20), (1, 7)], 4, 2, 32, 16, "float32", extra_rows=3)
        out = self.attention(case)
        check(out[:-3], reference(case)[:-3], case, "rows of sequences")
        assert np.all(out[-3:] == 0), "rows of no sequence"

    def test_jit_no_recompile_and_donation(self):
        """New lengths, splits and tables (device data) reuse one compiled program;
        a donated out keeps rows of no sequence."""
        import jax
        import adapters.jax as aj
        f = jax.jit(functools.partial(aj.unified_attention, max_seqlen_q=16, max_seqlen_k=50,
                                      softmax_scale=0.2), donate_argnames=("out",))
        for lens in ([(10, 20), (1, 35), (5, 3)], [(12, 4), (1, 30), (3, 0)], [(1, 30), (1, 19), (14, 0)]):
            c = make_case(lens, 2, 1, 32, 16, "float32", extra_rows=2, num_blocks=12, width=5)
            keep = np.full(c["q"].shape, 3.0, np.float32)
            out = f(*(to_jax(c[n]) for n in ARRAYS), out=to_jax(keep))
            check(self.numpy(out), reference(c, out=keep, softmax_scale=0.2), c, f"lens {lens}")
        assert f._cache_size() == 1, "new tables / lengths recompiled"

    def test_causal_flags_as_a_host_list(self):
        import adapters.jax as aj
        case = make_case([(1, 30), (3, 9)], 4, 2, 32, 16, "float32", causal=[True, False])
        got = aj.unified_attention(*(to_jax(case[n]) for n in ARRAYS), max_seqlen_q=3, max_seqlen_k=30,
                                   softmax_scale=0.2, causal=[True, False])
        assert_bitwise_equal(np.asarray(got), self.attention(case, softmax_scale=0.2), "list vs array flags")

    def test_validation_of_traced_indices_raises(self):
        import jax
        import adapters.jax as aj
        case = make_case([(1, 30), (1, 9)], 4, 2, 32, 16, "float32")
        f = jax.jit(functools.partial(aj.unified_attention, max_seqlen_q=1, max_seqlen_k=30, softmax_scale=0.2,
                                      validate_indices=True))
        with pytest.raises(ValueError, match="^validate_indices: "):
            f(*(to_jax(case[n]) for n in ARRAYS))

    def test_vmap_folds_into_one_call(self):
        """jax.vmap over examples with their own caches and tables (tokens folded,
        block ids offset) and over q alone (a shared cache): each example's bits
        are its own call's."""
        import jax
        import adapters.jax as aj
        cases = [make_case([(9, 20), (1, 7), (4, 0)], 4, 2, 32, 16, "float32", seed=s, per_seq_descale=True,
                           kv="fp8") for s in (1, 2)]
        for c in cases[1:]:
            assert all(c[n].shape == cases[0][n].shape for n in ARRAYS), "examples of one shape"
        f = functools.partial(aj.unified_attention, max_seqlen_q=9, max_seqlen_k=21, softmax_scale=0.3,
                              window_size=(12, 0))
        stacked = {n: to_jax(np.stack([c[n] for c in cases])) for n in ARRAYS + ("k_descale", "v_descale")}
        got = np.asarray(jax.vmap(lambda *a: f(*a[:6], k_descale=a[6], v_descale=a[7]))(
            *(stacked[n] for n in ARRAYS + ("k_descale", "v_descale"))))
        for i, c in enumerate(cases):
            one = np.asarray(f(*(to_jax(c[n]) for n in ARRAYS), k_descale=to_jax(c["k_descale"]),
                               v_descale=to_jax(c["v_descale"])))
            assert_bitwise_equal(got[i], one, f"example {i} (tokens folded)")
        # q batched alone, and sinks batched (heads folded)
        c = cases[0]
        qs = np.stack([c["q"], cases[1]["q"]])
        sinks = rng().standard_normal((2, 4)).astype(np.float32)
        rest = [to_jax(c[n]) for n in ARRAYS[1:]]
        kw = dict(k_descale=to_jax(c["k_descale"]), v_descale=to_jax(c["v_descale"]))
        got = np.asarray(jax.vmap(lambda q, s: f(q, *rest, sinks=s, **kw))(to_jax(qs), to_jax(sinks)))
        for i in range(2):
            one = np.asarray(f(to_jax(qs[i]), *rest, sinks=to_jax(sinks[i]), **kw))
            assert_bitwise_equal(got[i], one, f"example {i} (heads folded)")
        # a batched output scale (one per launch): one launch per example, its bits
        scales = np.array([[0.5], [2.0]], np.float32)
        got = np.asarray(jax.vmap(lambda q, s: f(q, *rest, output_scale=s, **kw))(to_jax(qs), to_jax(scales)))
        for i in range(2):
            one = np.asarray(f(to_jax(qs[i]), *rest, output_scale=to_jax(scales[i]), **kw))
            assert_bitwise_equal(got[i], one, f"example {i} (output_scale batched)")


# ------------------------------------------------------------------ both adapters
@pytest.mark.parametrize("combo", ["fp16-window-alibi-sinks", "bf16-fp8kv-fp8out-perseq-softcap"])
def test_torch_and_jax_bitwise_equal(combo):
    g = rng()
    dtype = "float16" if "fp16" in combo else "bfloat16"
    opts = _opts(combo, 4, g)
    fp8 = "fp8kv" in combo
    if "softcap" in combo:
        opts["softcap"] = 2.5
    causal = [True, False, True, False] if "perseq" in combo else True
    case = make_case(MIXED, 4, 2, 32, 16, dtype, kv="uint8" if fp8 else None, per_seq_descale=fp8,
                     causal=causal, window_left=opts.get("window_size", (-1, 0))[0])
    out_scale = 0.03 if "fp8out" in combo else None
    t = TestTorch().attention(case, output_scale=out_scale, **opts)
    j = TestJax().attention(case, output_scale=out_scale, jit=True, **opts)
    assert_bitwise_equal(t, j, f"torch vs jax ({combo})")


# ------------------------------------------------------------------ the reference itself
def test_reference_agrees_with_the_prefix_prefill_reference():
    """An independent oracle of the same math: context_attention_reference over the
    same tokens in prefix_prefill's cache layout, new tokens read from the cache
    (causal, window, ALiBi: its bias differs by a per-row constant; sinks)."""
    from core_kernels.prefix_prefill import context_attention_reference
    g = rng()
    case = make_case([(7, 20), (1, 9), (5, 0)], 4, 2, 16, 8, "float32", window_left=6)
    k, v = np.nan_to_num(case["k"]), np.nan_to_num(case["v"])
    nb, bs, hkv, d = k.shape
    x = 4
    k_cache = np.ascontiguousarray(k.reshape(nb, bs, hkv, d // x, x).transpose(0, 2, 3, 1, 4))
    v_cache = np.ascontiguousarray(v.transpose(0, 2, 3, 1))
    slopes = g.uniform(0.1, 0.5, 4).astype(np.float32)
    sinks = g.standard_normal(4).astype(np.float32)
    table = np.where(case["block_table"] < nb, case["block_table"], 0)
    # ALiBi and sinks apart: with a sink the per-row constant between the biases matters
    for opts in (dict(alibi_slopes=slopes), dict(sinks=sinks)):
        ours = reference(case, window_size=(6, 0), softmax_scale=0.3, **opts)
        theirs = context_attention_reference(case["q"], None, None, k_cache, v_cache, table,
                                             case["cu_seqlens_q"], case["seqused_k"], sliding_window=7,
                                             sm_scale=0.3, **opts)
        np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12, err_msg=str(list(opts)))


def test_reference_options_by_hand():
    """One query of one sequence, its math written out: softcap then ALiBi (linear
    and sqrt) then the mask, a sink, fp8 descales; a non-causal window is symmetric."""
    g = rng()
    d, bs = 4, 4
    q = g.standard_normal((2, 1, d))
    kv = g.standard_normal((2, 3, bs, 1, d))
    k, v = kv[0], kv[1]
    table, cu, used = np.array([[2, 0, 1]]), np.array([0, 2]), np.array([7])
    keys = np.concatenate([k[2], k[0]])[:7, 0]          # positions 0..6 through the table
    vals = np.concatenate([v[2], v[0]])[:7, 0]
    cap, slope, sink = 1.5, 0.25, 0.7
    for sqrt in (False, True):
        got = unified_attention_reference(q, k, v, cu, used, table, softmax_scale=0.5, softcap=cap,
                                          alibi_slopes=[slope], use_alibi_sqrt=sqrt, sinks=[sink],
                                          window_size=(3, 0))
        for i, p in enumerate((5, 6)):                   # context 5, two queries
            j = np.arange(p - 3, p + 1)
            s = cap * np.tanh(0.5 * keys[j] @ q[i, 0] / cap)
            s = s + slope * (-np.sqrt(p - j) if sqrt else j - 5)
            m = max(s.max(), sink)
            e = np.exp(s - m)
            want = e @ vals[j] / (e.sum() + np.exp(sink - m))
            np.testing.assert_allclose(got[i, 0], want, rtol=1e-12, err_msg=f"sqrt={sqrt} query {i}")
    assert visible_keys(2, 7, False, 1).tolist() == [[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1]]
    assert visible_keys(2, 7, True, 1).tolist() == [[0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1, 1]]
    import ml_dtypes
    k8, v8 = k.astype(ml_dtypes.float8_e4m3fn), v.astype(ml_dtypes.float8_e4m3fn)
    scaled = unified_attention_reference(q, k8, v8.view(np.uint8), cu, used, table, softmax_scale=0.5,
                                         k_descale=np.array([[0.5]]), v_descale=np.array([2.0]))
    plain = unified_attention_reference(q, k8.astype(np.float64) * 0.5, v8.astype(np.float64) * 2.0, cu,
                                        used, table, softmax_scale=0.5)
    np.testing.assert_allclose(scaled, plain, rtol=1e-13)


def test_check_accepts_a_valid_batch_and_skips_malformed_shapes():
    case = make_case(MIXED, 4, 2, 32, 16, "float32", table_dtype="int64")
    host = {n: case[n] for n in ARRAYS[3:]}
    kw = dict(num_tokens=case["q"].shape[0], num_blocks=case["k"].shape[0], block_size=16,
              max_seqlen_q=case["max_seqlen_q"], max_seqlen_k=case["max_seqlen_k"])
    check_unified_attention(host, **kw)
    check_unified_attention({**host, "cu_seqlens_q": host["cu_seqlens_q"][:2]}, **kw)  # the planner's error


# ------------------------------------------------------------------ GPU, real sizes
SM90 = Target("cuda", 90, 132, gluon=True)  # the H200 the GPU tests run on
# (name, seqs, dtype, kv): the benchmark shapes (Llama-3-8B heads: 32 / 8 x 128, block 16)
GPU_CASES = {
    "decode-B64x4096": ([(1, 4095)] * 64, "bfloat16", None),
    "decode-B64x4096-fp8": ([(1, 4095)] * 64, "bfloat16", "fp8"),
    "decode-B1x131072": ([(1, 131071)], "bfloat16", None),
    "prefill-B4-q1024-over-4096": ([(1024, 3072)] * 4, "bfloat16", None),
    "prefill-B1x8192": ([(8192, 0)], "bfloat16", None),
    "mixed-2048-over-8192-and-127-decodes": ([(2048, 6144)] + [(1, 4095)] * 127, "bfloat16", None),
    "mixed-fp16-window-sinks": ([(300, 700), (129, 1024), (1, 2000), (64, 0), (0, 10), (512, 33)],
                                "float16", None),
}


def _gpu_case(name):
    seqs, dtype, kv = GPU_CASES[name]
    case = make_case(seqs, 32, 8, 128, 16, dtype, kv=kv, window_left=255 if "window" in name else -1)
    opts = dict(window_size=(255, 0), sinks=(rng().standard_normal(32) * 2).astype(np.float32)) \
        if "window" in name else {}
    return case, opts


def _sampled_reference(case, opts, rows=8):
    """The reference on the last ``rows`` rows of every sequence (they keep their
    positions with seqused_k unchanged), as (row indices, values): real sizes stay
    cheap in float64."""
    cu = case["cu_seqlens_q"].astype(np.int64)
    keep = [np.arange(max(int(cu[b + 1]) - rows, int(cu[b])), int(cu[b + 1])) for b in range(len(cu) - 1)]
    idx = np.concatenate(keep)
    cu_sub = np.concatenate([[0], np.cumsum([len(x) for x in keep])])
    sub = {**case, "q": case["q"][idx], "cu_seqlens_q": cu_sub}
    return idx, reference(sub, **opts)


@requires_gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_real_sizes(name):
    """The issue's shapes: the last rows of every sequence against the float64
    reference, torch == JAX (jit) bit for bit."""
    case, opts = _gpu_case(name)
    t = TestTorch().attention(case, **opts)
    rows, ref = _sampled_reference(case, opts)
    check(t[rows], ref, case, name)
    j = TestJax().attention(case, jit=True, **opts)
    assert_bitwise_equal(t, j, f"torch vs jax {name}")


@requires_gpu
def test_gpu_cuda_graph_decode():
    """A decode step captured in a CUDA graph and replayed with new lengths and tables
    in the same buffers gives the eager call's bits."""
    case = make_case([(1, 900)] * 8, 32, 8, 128, 16, "bfloat16")
    t = {n: to_torch(case[n]) for n in ARRAYS}
    out = torch.empty(case["q"].shape, dtype=torch.bfloat16, device="cuda")

    def step():
        at.unified_attention(t["q"], t["k"], t["v"], out, t["cu_seqlens_q"], 1, t["seqused_k"], 2048,
                             128 ** -0.5, True, (-1, -1), t["block_table"], 0.0, None, None, None)
    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    t["seqused_k"].sub_(100)
    g.replay()
    torch.cuda.synchronize()
    graphed = out.clone()
    step()
    assert torch.equal(graphed, out)
    c2 = {**case, "seqused_k": case["seqused_k"] - 100}
    check(torch_to_numpy(out), reference(c2), c2, "after replay")


@requires_gpu
def test_gpu_jax_export_roundtrip():
    """jax.export (jax-triton's custom call allowed): serialised, restored and run, the
    same bits as the direct call, with new lengths (device data) after export."""
    import jax
    import adapters.jax as aj
    case = make_case([(40, 300), (1, 500), (3, 20)], 8, 2, 128, 16, "bfloat16", num_blocks=80, width=45)
    f = jax.jit(functools.partial(aj.unified_attention, max_seqlen_q=64, max_seqlen_k=640, softmax_scale=0.09,
                                  window_size=(127, 0)))
    args = tuple(jax.device_put(case[n]) for n in ARRAYS)
    exported = jax.export.export(
        f, disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call")])(*args)
    restored = jax.export.deserialize(exported.serialize())
    assert_bitwise_equal(np.asarray(restored.call(*args)), np.asarray(f(*args)), "exported vs direct")
    c2 = make_case([(10, 600), (1, 200), (33, 0)], 8, 2, 128, 16, "bfloat16", num_blocks=80, width=45)
    args2 = tuple(jax.device_put(c2[n]) for n in ARRAYS)
    check(np.asarray(restored.call(*args2)), reference(c2, softmax_scale=0.09, window_size=(127, 0)), c2,
          "exported, new lengths")


# (D, block_size, Hq, Hkv): the head sizes and block sizes (544: hybrid models), GQA 5:1
GPU_HEADS = [(64, 16, 8, 2), (80, 32, 10, 2), (96, 544, 8, 8), (128, 64, 32, 8), (256, 16, 10, 2)]
GPU_HEAD_SEQS = [(300, 700), (1, 2000), (64, 0), (0, 50), (5, 1100), (1, 3)]


@requires_gpu
@pytest.mark.parametrize("d,bs,hq,hkv", GPU_HEADS, ids=str)
def test_gpu_head_and_block_sizes(d, bs, hq, hkv):
    """Every head size and block size of the issue on a mixed batch (prefill over
    context, decodes, an empty sequence), bf16, against the reference; torch == JAX."""
    case = make_case(GPU_HEAD_SEQS, hq, hkv, d, bs, "bfloat16")
    t = TestTorch().attention(case)
    check(t, reference(case), case, f"D {d} block {bs}")
    assert_bitwise_equal(t, TestJax().attention(case, jit=True), f"torch vs jax D {d} block {bs}")


@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_test_plans_build(name):
    """The GPU-only tests' plans build for sm_90 (launch arguments checked against the
    kernels' signatures) on a machine without a GPU."""
    seqs, dtype, kv = GPU_CASES[name]
    # the plan depends on shapes only: a small cache of the same layout stands in
    qlens = [s[0] for s in seqs]
    t, b = sum(qlens), len(seqs)
    A = ArrayInfo.contiguous
    cdt = E4M3 if kv else dtype
    infos = dict(q=A((t, 32, 128), dtype), k=A((64, 16, 8, 128), cdt), v=A((64, 16, 8, 128), cdt),
                 cu_seqlens_q=A((b + 1,), "int32"), seqused_k=A((b,), "int32"),
                 block_table=A((b, math.ceil(max(q + c for q, c in seqs) / 16)), "int32"))
    if kv:
        infos.update(k_descale=A((1,), "float32"), v_descale=A((1,), "float32"))
    plan = plan_unified_attention(SM90, **infos, max_seqlen_q=max(qlens),
                                  max_seqlen_k=max(q + c for q, c in seqs), softmax_scale=0.088,
                                  window_left=255 if "window" in name else -1, kv_quant_mode=1 if kv else 0)
    assert plan.launches


@pytest.mark.parametrize("d,bs,hq,hkv", GPU_HEADS, ids=str)
def test_gpu_head_size_plans_build(d, bs, hq, hkv):
    A = ArrayInfo.contiguous
    t, b = sum(q for q, _ in GPU_HEAD_SEQS), len(GPU_HEAD_SEQS)
    blocks = -(-max(q + c for q, c in GPU_HEAD_SEQS) // bs)
    plan = plan_unified_attention(SM90, A((t, hq, d), "bfloat16"), A((4 * blocks, bs, hkv, d), "bfloat16"),
                                  A((4 * blocks, bs, hkv, d), "bfloat16"), A((b + 1,), "int32"), A((b,), "int32"),
                                  A((b, blocks), "int32"), max_seqlen_q=300, max_seqlen_k=2001,
                                  softmax_scale=d ** -0.5)
    assert plan.launches


def test_jax_gpu_executor_feeds_unwritten_zero_buffers(monkeypatch):
    """A decode-only plan's first launch reads the zero-initialised "out" that no
    launch wrote yet (it keeps rows of no sequence): the compiled-kernel path of
    the JAX executor must pass zeros (a KeyError on the H200 before, 2026-11-28).
    jax-triton is replaced by a recorder: no GPU needed."""
    pytest.importorskip("jax")
    import jax.numpy as jnp
    from adapters.jax import _executor
    c = make_case([(1, 40), (1, 7)], 4, 2, 32, 16, "float32")
    names = ("q", "k", "v", "cu_seqlens_q", "seqused_k", "block_table")
    infos = {n: ArrayInfo.contiguous(c[n].shape, str(c[n].dtype)) for n in names}
    plan = plan_unified_attention(Target("cuda", 90, 132), **infos, max_seqlen_q=1,
                                  max_seqlen_k=c["max_seqlen_k"], softmax_scale=0.2)
    first = plan.launches[0]
    assert "out" in first.args and "out" in plan.buffers  # the case this test is about
    seen = []

    class Recorder:
        @staticmethod
        def triton_call(*args, out_shape, **kw):
            seen.append([a for a in args if hasattr(a, "shape")])
            return [jnp.full(s.shape, np.nan, s.dtype) for s in out_shape]

    monkeypatch.setattr(_executor, "_jax_triton", lambda: Recorder)
    _executor.run_plan(plan, {n: jnp.asarray(c[n]) for n in names}, Target("cuda", 90, 132))
    pos = [a for a in first.args if not isinstance(a, _executor.Scalar)].index("out")
    fed = np.asarray(seen[0][pos])
    assert fed.shape == plan.buffers["out"].shape and not fed.any()

"""context_attention_fwd: both adapters against the float64 reference (spec: prefix_prefill.md)."""
import dataclasses
import functools

import numpy as np
import pytest
import torch

from core_kernels._plan import ArrayInfo
from core_kernels._target import Target
from core_kernels.prefix_prefill import (PrefixPrefillConfig, context_attention_reference,
                                         plan_prefix_prefill)
from core_kernels.prefix_prefill.plan import TILE_CONFIGS
from harness import (DEVICE, FLOAT_DTYPES, GPU, TOL, JaxAdapter, TorchAdapter,
                     assert_bitwise_equal, assert_close, assert_within_one_fp8_step, cast, jax_to_numpy,
                     np_dtype, poison_like, requires_gpu, rng, to_jax, to_torch, torch_to_numpy)
import adapters.torch as at

GARBAGE_ID = 1 << 30  # an unused block-table slot: reading it would fault or read junk


def block_table(g, cached, bs):
    """(b_loc [B, max_blocks] int64, num_blocks, blocks used per sequence, stale
    block ids) for sequences of ``cached`` cache tokens: permuted physical blocks
    (``g``), two spare columns, and unused slots holding a stale block's id or
    GARBAGE_ID (never to be read)."""
    used = [-(-int(c) // bs) for c in cached]
    max_blocks = max(used + [1]) + 2
    num_blocks = sum(used) + 3
    ids = g.permutation(num_blocks)
    stale = ids[sum(used):]
    b_loc = np.empty((len(used), max_blocks), np.int64)
    pos = 0
    for i, n in enumerate(used):
        b_loc[i, :n] = ids[pos:pos + n]
        pos += n
        for j in range(n, max_blocks):
            b_loc[i, j] = stale[j % len(stale)] if j % 2 else GARBAGE_ID
    return b_loc, num_blocks, used, stale
FP8_FORMATS = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def _nan_bits(a):
    """Set ``a`` (a view) to NaN, whatever its float or fp8 dtype."""
    if a.dtype.itemsize == 1:
        a.view(np.uint8)[...] = 0x7F
    else:
        a[...] = np.nan


def make_case(seqs, hq=4, hkv=2, d=32, bs=16, x=8, dtype="float32", cache_fp8=None,
              as_uint8=False, window=None, seed=None, table_dtype="int32", cache_new=False,
              v_pack=0):
    """Random inputs for sequences [(query_len, context_len), ...].

    ``cache_new``: the cache also holds the new tokens (positions context_len ..
    seq_len - 1, for k = v = None); ``v_pack`` = x > 0: v_cache's memory is
    interleaved ([num_blocks, Hkv, block_size // x, D, x] behind the 4-D shape).

    Physical blocks are permuted; every cache token no query can see (stale
    blocks, the tail of a sequence's last block, tokens before the sliding
    window) is NaN, and unused block-table slots hold a NaN block or a wild id.
    """
    g = rng(seed)
    qlens = np.array([s[0] for s in seqs])
    ctxs = np.array([s[1] for s in seqs])
    t, b = int(qlens.sum()), len(seqs)
    q = cast(g.standard_normal((t, hq, d)), dtype)
    k = cast(g.standard_normal((t, hkv, d)), dtype)
    v = cast(g.standard_normal((t, hkv, d)), dtype)
    cached = ctxs + qlens if cache_new else ctxs   # tokens a query may read from the cache
    b_loc, num_blocks, used, stale = block_table(g, cached, bs)
    cdt = cache_fp8 or dtype
    scale = 2.0 if cache_fp8 else 1.0
    kc = cast(g.standard_normal((num_blocks, hkv, d // x, bs, x)) * scale, cdt)
    vc = cast(g.standard_normal((num_blocks, hkv, d, bs)) * scale, cdt)
    for blk in stale:
        _nan_bits(kc[blk])
        _nan_bits(vc[blk])
    for i in range(b):
        first_visible = 0 if window is None or window <= 0 else max(0, int(ctxs[i]) - window + 1)
        for tok in list(range(first_visible)) + list(range(int(cached[i]), used[i] * bs)):
            blk, off = b_loc[i, tok // bs], tok % bs
            _nan_bits(kc[blk, :, :, off, :])
            _nan_bits(vc[blk, :, :, off])
    if v_pack:  # the same values, stored [num_blocks, Hkv, bs // x, D, x]
        vc = np.ascontiguousarray(vc.reshape(num_blocks, hkv, d, bs // v_pack, v_pack)
                                  .transpose(0, 1, 3, 2, 4)).reshape(num_blocks, hkv, d, bs)
    if as_uint8:
        kc, vc = kc.view(np.uint8), vc.view(np.uint8)
    return dict(q=q, k=k, v=v, k_cache=kc, v_cache=vc, b_loc=b_loc.astype(table_dtype),
                b_start_loc=np.concatenate([[0], np.cumsum(qlens)]).astype(table_dtype),
                b_seq_len=(qlens + ctxs).astype(table_dtype), max_input_len=int(qlens.max()))



ARRAYS = ("q", "k", "v", "k_cache", "v_cache", "b_loc", "b_start_loc", "b_seq_len")


def reference(case, *, kv_cache_dtype="auto", output=None, **opts):
    opts.pop("fp8_out_scale", None)
    opts.pop("config", None)
    return context_attention_reference(*(case.get(n) for n in ARRAYS), kv_cache_dtype=kv_cache_dtype,
                                       output=output, **opts)


def no_kv(case):
    """The case with k = v = None (the new tokens' K/V read from the cache)."""
    return {**case, "k": None, "v": None}


def tolerance_dtype(dtype):
    # NOTE: on the GPU an fp32 tl.dot runs in tf32 (10-bit mantissa, like fp16);
    # the issue allows it, so fp32 is held to the fp16 tolerance there.
    return "float16" if GPU and dtype == "float32" else dtype


def check(out, ref, dtype, what, scale=1.0):
    assert_close(out, ref, tolerance_dtype(dtype), what, scale=scale)


def plan_for(case, target, *, output=True, kv_cache_dtype="auto", k_scale=None, v_scale=None,
             alibi_slopes=None, sinks=None, fp8_out_scale=None, **opts):
    """The plan an adapter makes for a numpy case (contiguous layouts) on ``target``."""
    infos = [None if case[n] is None else ArrayInfo.contiguous(case[n].shape, case[n].dtype.name)
             for n in ARRAYS]
    out_dtype = "float8_e4m3fn" if fp8_out_scale is not None else case["q"].dtype.name
    scalar = lambda x: None if x is None else ArrayInfo.contiguous((1,), "float32")  # noqa: E731
    vec = lambda x: None if x is None else ArrayInfo.contiguous(x.shape, x.dtype.name)  # noqa: E731
    fp8 = kv_cache_dtype != "auto" or case["k_cache"].dtype.name.startswith("float8")
    return plan_prefix_prefill(
        target, *infos, ArrayInfo.contiguous(case["q"].shape, out_dtype) if output else None,
        scalar(k_scale if fp8 else None), scalar(v_scale if fp8 else None), vec(alibi_slopes),
        vec(sinks), scalar(fp8_out_scale), max_input_len=case["max_input_len"],
        kv_cache_dtype=kv_cache_dtype, **opts)


# (seqs, hq, hkv, d, block_size, x): GQA / MQA / MHA, odd head sizes, odd block sizes,
# context 0, decode rows, a context shorter than one block.
SHAPES = {
    "gqa-d32-bs16": ([(20, 37), (1, 50), (33, 0), (5, 16)], 4, 2, 32, 16, 8),
    # empty queries mid-batch: over a context, with no context at all, and last
    "empty-queries-mid": ([(20, 37), (0, 50), (9, 0), (0, 0), (5, 16), (0, 21)], 4, 2, 32, 16, 8),
    "mqa-d24-bs48": ([(17, 100), (3, 5)], 3, 1, 24, 48, 8),
    "mha-d80-bs32-x16": ([(9, 70), (26, 33)], 2, 2, 80, 32, 16),
    "gqa-d96-bs544-x4": ([(12, 600), (7, 30)], 4, 2, 96, 544, 4),
    "d112-bs16-x2": ([(19, 40)], 2, 1, 112, 16, 2),
    "d192-bs32": ([(11, 45)], 2, 1, 192, 32, 8),
    "d256-bs16-x16": ([(10, 20), (1, 3)], 2, 2, 256, 16, 16),
}


def _options(name, hq, g):
    """Keyword options for a named combination (every option combines)."""
    opts = {}
    if "window" in name:
        opts["sliding_window"] = 19
    if "alibi" in name:
        opts["alibi_slopes"] = (2.0 ** -(1 + np.arange(hq))).astype(np.float32)
    if "sinks" in name:
        opts["sinks"] = (g.standard_normal(hq) * 2).astype(np.float32)
    if "scale" in name:
        opts["sm_scale"] = 0.3
    return opts


OPTION_SETS = ["window", "alibi", "sinks", "scale", "window-alibi", "alibi-sinks",
               "window-sinks", "window-alibi-sinks-scale"]


def _fp8_out_check(out8, ref, scale, dtype):
    """Within one fp8 step of the rounded float64 reference, or within the q dtype's
    absolute error magnified by 1/scale (an attention output near 0 of fp16 inputs
    may sit several fine fp8 steps off)."""
    assert out8.dtype.name == "float8_e4m3fn"
    atol = TOL[tolerance_dtype(dtype)][0] / scale
    assert_within_one_fp8_step(out8, np.asarray(ref, np.float64) / scale, "fp8 output", atol=atol)


def _bad(case, **repl):
    return {**case, **repl}


def _error_cases():
    c = make_case([(4, 10)], 4, 2, 32, 16, 8, "float32")
    t = c["q"].shape[0]
    f32 = np.float32
    return [
        ("q", _bad(c, q=np.zeros((t, 3, 32), f32)), {}),                       # Hq % Hkv
        ("k_cache", _bad(c, k_cache=np.zeros((4, 2, 3, 16, 10), f32)), {}),     # x does not divide D
        ("k_cache", _bad(c, k_cache=c["k_cache"].view(np.uint8)[..., :8],
                         v_cache=c["v_cache"].view(np.uint8)[..., :16]), {}),  # uint8 with "auto"
        ("k", _bad(c, k=c["k"].astype(np.float16)), {}),
        ("v", _bad(c, v=c["v"][:, :1]), {}),
        ("v_cache", _bad(c, v_cache=c["v_cache"][:, :, :16]), {}),
        ("b_start_loc", _bad(c, b_start_loc=c["b_start_loc"][:1]), {}),
        ("b_seq_len", _bad(c, b_seq_len=c["b_seq_len"].astype(np.float32)), {}),
        ("kv_cache_dtype", c, dict(kv_cache_dtype="int4")),
        ("alibi_slopes", c, dict(alibi_slopes=np.ones(3, f32))),
        ("sinks", c, dict(sinks=np.ones((4, 1), f32))),
        ("q", _bad(c, q=np.zeros((t, 4, 300), f32), k=np.zeros((t, 2, 300), f32),
                   v=np.zeros((t, 2, 300), f32)), {}),                         # D > 256
        ("k_cache", c, dict(kv_cache_dtype="fp8_e5m2")),                       # fp32 cache as fp8
        ("config", c, dict(config=PrefixPrefillConfig(24, 16))),               # not a power of two
        ("config", c, dict(config=PrefixPrefillConfig(16, 16, prefetch_ids=3))),
    ]


# name: (make_case keywords, call options, k = v = None)
VLLM033 = {
    "noncausal": ({}, dict(causal=False), False),
    "cache-kv": (dict(cache_new=True), {}, True),
    "interleaved-v": (dict(v_pack=4), dict(interleaved_v_pack_factor=4), False),
    "cache-kv-noncausal": (dict(cache_new=True), dict(causal=False), True),
    "interleaved-v16-cache-kv-noncausal": (dict(cache_new=True, v_pack=16),
                                           dict(causal=False, interleaved_v_pack_factor=16), True),
    "interleaved-v-alibi-window": (dict(v_pack=2, window=19),
                                   dict(interleaved_v_pack_factor=2, sliding_window=19,
                                        alibi_slopes=(2.0 ** -(1 + np.arange(4))).astype(np.float32)),
                                   False),
}
VLLM033_COMBOS = ("cache-kv fp8-uint8 window sinks skip_decode fp8-out",
                  "noncausal interleaved fp8_e5m2 window sinks skip_decode mqa-d24-bs48",
                  "cache-kv noncausal interleaved fp8-e4m3 sinks skip_decode d80",
                  "interleaved alibi window sinks fp8-out")


def _vllm033_combo(combo):
    """(case, options, fp8_out_scale) of a named combination (first sequence 30 new
    tokens, then a decode row)."""
    words = combo.split()
    g = rng()
    hq, hkv, d, bs, x, dtype = 4, 2, 32, 16, 8, "float16"
    if "mqa-d24-bs48" in words:
        hq, hkv, d, bs, x = 3, 1, 24, 48, 8
    if "d80" in words:
        hq, hkv, d, bs, x = 4, 2, 80, 32, 16
    opts = {}
    if "window" in words:
        opts["sliding_window"] = 23
    if "sinks" in words:
        opts["sinks"] = (g.standard_normal(hq) * 2).astype(np.float32)
    if "alibi" in words:
        opts["alibi_slopes"] = (2.0 ** -(1 + np.arange(hq))).astype(np.float32)
    if "skip_decode" in words:
        opts["skip_decode"] = True
    if "noncausal" in words:
        opts["causal"] = False
    v_pack = 0
    if "interleaved" in words:
        v_pack = 8 if bs % 8 == 0 else 4
        opts["interleaved_v_pack_factor"] = v_pack
    fp8 = next((w for w in words if w.startswith("fp8") and w != "fp8-out"), None)
    fmt = {"fp8-uint8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "fp8-e4m3": "float8_e4m3fn"}.get(fp8)
    if fp8:
        opts.update(kv_cache_dtype={"fp8-uint8": "fp8", "fp8_e5m2": "fp8_e5m2",
                                    "fp8-e4m3": "auto"}[fp8], k_scale=0.7, v_scale=1.3)
    cache_kv = "cache-kv" in words
    case = make_case([(30, 70), (1, 40), (12, 0), (17, 33)], hq, hkv, d, bs, x, dtype,
                     cache_fp8=fmt, as_uint8=fp8 in ("fp8-uint8", "fp8_e5m2"),
                     window=opts.get("sliding_window"), cache_new=cache_kv, v_pack=v_pack)
    if cache_kv:
        case = no_kv(case)
    return case, opts, (0.01 if "fp8-out" in words else None)


class PrefixPrefillTests:
    """Every context_attention_fwd test, written once; a subclass per adapter
    implements ``attention`` (and may add framework-only tests)."""

    def attention(self, case, *, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0,
                  alibi_slopes=None, sliding_window=None, sm_scale=None, skip_decode=False,
                  fp8_out_scale=None, sinks=None, output=None, max_input_len=None, config=None,
                  causal=True, interleaved_v_pack_factor=0, max_seq_len=0):
        """A numpy case (make_case) -> the numpy output through this adapter.
        ``output``: the output's values before the call (None: the adapter's default)."""
        raise NotImplementedError

    @pytest.mark.parametrize("dtype", FLOAT_DTYPES)
    @pytest.mark.parametrize("shape", list(SHAPES))
    def test_matches_reference(self, dtype, shape):
        seqs, hq, hkv, d, bs, x = SHAPES[shape]
        case = make_case(seqs, hq, hkv, d, bs, x, dtype)
        check(self.attention(case), reference(case), dtype, shape)

    @pytest.mark.parametrize("tiles", [(16, 16), (32, 16, 4, 2, False, 0),
                                       (16, 32, 4, 2, False, 2, False),
                                       (64, 32, 4, 2, True, 2, False), (32, 32, 4, 2, True, 0, True)],
                             ids=str)
    def test_small_tiles_full_and_masked_runs(self, tiles):
        """Small tiles so every run (masked / full, cache / new keys) has several tiles
        (4 query heads packed per kv head: BLOCK_M // 4 tokens per program)."""
        config = PrefixPrefillConfig(*tiles)
        seqs = [(40, 60), (21, 0), (1, 33), (30, 16)]
        case = make_case(seqs, 4, 1, 32, 16, 8, "float32", table_dtype="int64")
        check(self.attention(case, config=config), reference(case), "float32", f"tiles {tiles}")
        w = 23
        case = make_case(seqs, 4, 1, 32, 16, 8, "float32", window=w)
        check(self.attention(case, sliding_window=w, config=config),
              reference(case, sliding_window=w), "float32", f"tiles {tiles} window")

    def test_max_seq_len_sizes_the_gathered_context(self):
        """A block table far wider than the contexts: max_seq_len (a bound on
        every context, here the longest) sizes the gather scratch, with the same
        results as the paged path; with new tokens read from the cache too. A
        context past the bound (device data nobody checked) gives that
        sequence NaN rows, and no other row changes."""
        seqs = [(21, 50), (1, 20), (9, 0), (17, 33)]
        case = make_case(seqs, 4, 2, 32, 16, 8, "float32")
        wide = np.full((4, 64), 7, case["b_loc"].dtype)  # 1024 tokens per row; slot 7 is any block
        wide[:, :case["b_loc"].shape[1]] = case["b_loc"]
        case = {**case, "b_loc": wide}
        gather = PrefixPrefillConfig(16, 16, 4, 2, True, 1, True)
        ref = reference(case)
        check(self.attention(case, config=gather, max_seq_len=50), ref, "float32", "gathered, bound 50")
        new = no_kv(make_case(seqs, 4, 2, 32, 16, 8, "float32", cache_new=True))
        check(self.attention(new, config=gather, max_seq_len=50), reference(new), "float32",
              "gathered with the new tokens, bound 50")
        short = self.attention(case, config=gather, max_seq_len=32)  # sequences 0 and 3 exceed it
        rows = np.concatenate([[0], np.cumsum([s[0] for s in seqs])])
        for i, (ql, ctx) in enumerate(seqs):
            part = short[rows[i]:rows[i + 1]]
            if ctx > 32:
                assert np.isnan(part).all(), f"sequence {i}: context {ctx} past the bound, not NaN"
            else:
                check(part, ref[rows[i]:rows[i + 1]], "float32", f"sequence {i} within the bound")

    @pytest.mark.parametrize("gather", [False, True])
    def test_context_gathered_or_paged(self, gather):
        """Both ways of reading the context (dense scratch copy / paged loads in the
        loop) with odd shapes, fp8 (uint8) cache, window and skip_decode."""
        g = rng()
        for shape in ("mqa-d24-bs48", "gqa-d96-bs544-x4"):
            seqs, hq, hkv, d, bs, x = SHAPES[shape]
            case = make_case(seqs, hq, hkv, d, bs, x, "float32")
            config = PrefixPrefillConfig(16, 16, 4, 2, True, 1, gather)
            check(self.attention(case, config=config), reference(case), "float32",
                  f"{shape} gather={gather}")
        w = 29
        case = make_case([(21, 50), (1, 20), (9, 0), (17, 33)], 4, 2, 32, 16, 8, "float16",
                         cache_fp8="float8_e4m3fn", as_uint8=True, window=w)
        keep = g.standard_normal(case["q"].shape).astype(np.float16)
        opts = dict(kv_cache_dtype="fp8", k_scale=0.7, v_scale=1.3, sliding_window=w,
                    skip_decode=True)
        out = self.attention(case, output=keep, config=PrefixPrefillConfig(32, 16, 4, 2, True, 1, gather),
                             **opts)
        check(out, reference(case, output=keep, **opts), "float16", f"fp8 window gather={gather}")
        assert_bitwise_equal(out[21:22], keep[21:22], "decode row kept")

    @pytest.mark.parametrize("options", OPTION_SETS)
    def test_options(self, options):
        g = rng()
        opts = _options(options, 4, g)
        case = make_case([(25, 40), (1, 60), (18, 0)], 4, 2, 32, 16, 8, "float16",
                         window=opts.get("sliding_window"))
        check(self.attention(case, **opts), reference(case, **opts), "float16", options)

    @pytest.mark.parametrize("dtype", FLOAT_DTYPES)
    def test_plain_cache_dtype_names(self, dtype):
        """vLLM's kernel tests name a plain cache by a float dtype name: read as "auto"
        (bitwise the same launch), also when the name is not the cache's dtype
        (vLLM's fp32 test passes "float16" with a float32 cache)."""
        case = make_case([(21, 50), (1, 20), (9, 0)], 4, 2, 32, 16, 8, dtype)
        auto = self.attention(case)
        check(auto, reference(case), dtype, dtype)
        # its own name, and "float16" (what vLLM's fp32 test passes) or "bfloat16"
        for name in sorted({dtype, "float16" if dtype != "float16" else "bfloat16"}):
            assert_bitwise_equal(self.attention(case, kv_cache_dtype=name), auto, f"{name!r} vs 'auto'")

    @pytest.mark.parametrize("kv_cache_dtype,as_uint8", [("fp8", True), ("fp8_e4m3", False),
                                                         ("fp8_e5m2", True), ("auto", False)])
    @pytest.mark.parametrize("dtype", ["float32", "float16"])
    def test_fp8_cache(self, kv_cache_dtype, as_uint8, dtype):
        fmt = FP8_FORMATS.get(kv_cache_dtype, "float8_e5m2")
        case = make_case([(21, 50), (1, 20), (9, 0)], 4, 2, 32, 16, 8, dtype, cache_fp8=fmt,
                         as_uint8=as_uint8)
        opts = dict(kv_cache_dtype=kv_cache_dtype, k_scale=0.7, v_scale=1.3)
        check(self.attention(case, **opts), reference(case, **opts), dtype, kv_cache_dtype)

    @pytest.mark.parametrize("dtype", FLOAT_DTYPES)
    @pytest.mark.parametrize("scale", [0.004, 256.0], ids=["saturating", "subnormal"])
    def test_fp8_output(self, dtype, scale):
        """Scale 0.004: |o| up to ~2 saturates at 448 (clamp before the cast); 128:
        every output in e4m3's subnormal range (|o| / 256 < 2^-6)."""
        case = make_case([(23, 30), (6, 0)], 4, 2, 32, 16, 8, dtype)
        out8 = self.attention(case, fp8_out_scale=scale)
        ref = reference(case)
        _fp8_out_check(out8, ref, scale, dtype)
        if scale < 1:
            assert np.abs(ref / scale).max() > 448, "the test should exercise the clamp"
        else:
            assert np.abs(ref / scale).max() < 2 ** -6, "every output should be subnormal"
        if dtype == "float32" and not GPU:
            # bit-identical to clamp-then-cast in the framework of our own fp32 output
            out32 = self.attention(case)
            t = (torch.from_numpy(np.array(out32)) / torch.tensor(scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert_bitwise_equal(out8, torch_to_numpy(t), "fp8 output vs clamp-then-cast")

    def test_everything_combined(self):
        """fp8 cache (uint8) + fp8 output + window + alibi + sinks + GQA + skip_decode."""
        g = rng()
        opts = _options("window-alibi-sinks-scale", 4, g)
        case = make_case([(30, 70), (1, 40), (12, 0), (1, 0)], 4, 2, 48, 32, 16, "float16",
                         cache_fp8="float8_e4m3fn", as_uint8=True, window=opts["sliding_window"])
        keep = cast(g.standard_normal(case["q"].shape), "float8_e4m3fn")
        opts.update(kv_cache_dtype="fp8", k_scale=0.5, v_scale=2.0, skip_decode=True)
        out8 = self.attention(case, fp8_out_scale=0.01, output=keep, **opts)
        ref = reference(case, output=keep.astype(np.float64) * 0.01, **opts)
        _fp8_out_check(out8, ref, 0.01, "float16")
        assert_bitwise_equal(out8[30:31], keep[30:31], "decode row kept")
        assert_bitwise_equal(out8[-1:], keep[-1:], "decode row kept")

    @pytest.mark.parametrize("skip_decode", [False, True])
    def test_all_decode_batch(self, skip_decode):
        case = make_case([(1, 30), (1, 0), (1, 77), (1, 16)], 4, 2, 32, 16, 8, "float32")
        keep = np.full(case["q"].shape, 7.0, np.float32)
        out = self.attention(case, skip_decode=skip_decode, output=keep)
        if skip_decode:
            assert_bitwise_equal(out, keep, "all rows untouched")
        else:
            check(out, reference(case), "float32", "decode rows")

    def test_skip_decode_keeps_rows(self):
        case = make_case([(12, 20), (1, 30), (9, 0), (1, 5)], 4, 2, 32, 16, 8, "float32")
        keep = rng().standard_normal(case["q"].shape).astype(np.float32)
        out = self.attention(case, skip_decode=True, output=keep)
        check(out, reference(case, skip_decode=True, output=keep), "float32", "skip_decode")
        assert_bitwise_equal(out[12:13], keep[12:13], "decode row")

    def test_max_input_len_larger_than_needed(self):
        case = make_case([(5, 20), (9, 3)], 2, 1, 32, 16, 8, "float32")
        check(self.attention(case, max_input_len=64), reference(case), "float32", "max_input_len=64")

    @pytest.mark.parametrize("case", range(15))
    def test_errors_name_the_argument(self, case):
        name, c, opts = _error_cases()[case]
        with pytest.raises((ValueError, TypeError), match=name):
            self.attention(c, **opts)

    # ---- vLLM 0.33's options: k = v = None, causal=False, interleaved V, block addresses
    @pytest.mark.parametrize("gather", [None, False, True])
    @pytest.mark.parametrize("name", list(VLLM033))
    def test_vllm033_options(self, name, gather):
        """Each new option alone and together, on the chosen / paged / gathered paths."""
        case_kw, opts, cache_kv = VLLM033[name]
        case = make_case([(20, 37), (1, 50), (33, 0), (5, 16)], 4, 2, 32, 16, 8, "float32", **case_kw)
        if cache_kv:
            case = no_kv(case)
        config = None if gather is None else PrefixPrefillConfig(16, 16, 4, 2, True, 1, gather)
        check(self.attention(case, config=config, **opts), reference(case, **opts), "float32",
              f"{name} gather={gather}")

    @pytest.mark.parametrize("gather", [False, True])
    @pytest.mark.parametrize("combo", list(VLLM033_COMBOS))
    def test_vllm033_options_combined(self, combo, gather):
        """The new options with GQA, window, sinks, fp8 KV (uint8 / fp8 storage), fp8
        output, skip_decode and odd shapes; decode rows are kept bit for bit."""
        case, opts, out_scale = _vllm033_combo(combo)
        keep = cast(rng().standard_normal(case["q"].shape),
                    "float8_e4m3fn" if out_scale else case["q"].dtype.name)
        config = PrefixPrefillConfig(16, 32, 4, 2, True, 1, gather)
        out = self.attention(case, output=keep, fp8_out_scale=out_scale, config=config, **opts)
        dtype = case["q"].dtype.name
        if out_scale:
            ref = reference(case, output=keep.astype(np.float64) * out_scale, **opts)
            _fp8_out_check(out, ref, out_scale, dtype)
        else:
            check(out, reference(case, output=keep, **opts), dtype, f"{combo} gather={gather}")
        if opts.get("skip_decode"):
            assert_bitwise_equal(out[30:31], keep[30:31], "decode row kept")

    def test_vllm033_errors(self):
        c = make_case([(4, 10)], 4, 2, 32, 16, 8, "float32")
        slopes = np.ones(4, np.float32)
        with pytest.raises(ValueError, match="causal"):
            self.attention(c, causal=False, alibi_slopes=slopes)
        with pytest.raises(NotImplementedError, match="k, v"):
            self.attention(no_kv(c), alibi_slopes=slopes)
        with pytest.raises(ValueError, match="k"):
            self.attention({**c, "k": None})
        with pytest.raises(ValueError, match="v"):
            self.attention({**c, "v": None})
        with pytest.raises(ValueError, match="interleaved_v_pack_factor"):
            self.attention(c, interleaved_v_pack_factor=3)       # does not divide block 16
        with pytest.raises(ValueError, match="interleaved_v_pack_factor"):
            self.attention(c, interleaved_v_pack_factor=-1)
        # a uint8 cache with kv_cache_dtype "auto": ValueError (vLLM's issue)
        with pytest.raises(ValueError, match="k_cache"):
            self.attention(_bad(c, k_cache=c["k_cache"].view(np.uint8)[..., :8],
                                v_cache=c["v_cache"].view(np.uint8)[..., :16]))

    def test_config_of_another_op_is_refused(self):
        from core_kernels.merge_attn_states import MergeConfig
        case = make_case([(4, 10)], 4, 2, 32, 16, 8, "float32")
        with pytest.raises(TypeError, match="config"):
            self.attention(case, config=MergeConfig())


def torch_with_addresses(case, opts, keep, config=None):
    """The torch call with ``is_block_table_ptr=True``: b_loc turned into K cache
    block addresses (unused slots: 0, or an address far outside the cache)."""
    kc = to_torch(case["k_cache"])
    bl = case["b_loc"].astype(np.int64)
    base, per_block = kc.data_ptr(), kc.stride(0) * kc.element_size()
    addr = np.where(bl < case["k_cache"].shape[0], base + bl * per_block,
                    np.where(np.arange(bl.shape[1]) % 2 == 0, 0, base + (1 << 40)))
    o = to_torch(keep)
    tt = lambda n: None if case[n] is None else to_torch(case[n])  # noqa: E731
    scl = lambda s: torch.tensor([s], dtype=torch.float32, device=DEVICE)  # noqa: E731
    at.context_attention_fwd(
        tt("q"), tt("k"), tt("v"), o, opts.get("kv_cache_dtype", "auto"), kc, tt("v_cache"),
        to_torch(addr.astype(np.int64)), tt("b_start_loc"), tt("b_seq_len"), 0,
        case["max_input_len"], scl(opts.get("k_scale", 1.0)), scl(opts.get("v_scale", 1.0)),
        None if opts.get("alibi_slopes") is None else to_torch(opts["alibi_slopes"]),
        opts.get("sliding_window"), opts.get("sm_scale"), opts.get("skip_decode", False), None,
        None if opts.get("sinks") is None else to_torch(opts["sinks"]), True,
        opts.get("interleaved_v_pack_factor", 0), opts.get("causal", True), config=config)
    return torch_to_numpy(o)


class TestTorch(TorchAdapter, PrefixPrefillTests):
    def attention(self, case, *, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0,
                  alibi_slopes=None, sliding_window=None, sm_scale=None, skip_decode=False,
                  fp8_out_scale=None, sinks=None, output=None, max_input_len=None, config=None,
                  causal=True, interleaved_v_pack_factor=0, max_seq_len=0):
        out_dtype = "float8_e4m3fn" if fp8_out_scale is not None else case["q"].dtype.name
        mil = case["max_input_len"] if max_input_len is None else max_input_len
        o = to_torch(poison_like(case["q"].shape, out_dtype) if output is None else output)
        scl = lambda s: None if s is None else torch.tensor([s], dtype=torch.float32, device=DEVICE)  # noqa: E731
        tt = lambda n: None if case[n] is None else to_torch(case[n])  # noqa: E731
        at.context_attention_fwd(
            *(tt(n) for n in ARRAYS[:3]), o, kv_cache_dtype,
            *(tt(n) for n in ARRAYS[3:]), max_seq_len, mil, scl(k_scale), scl(v_scale),
            None if alibi_slopes is None else to_torch(alibi_slopes), sliding_window, sm_scale,
            skip_decode, scl(fp8_out_scale), None if sinks is None else to_torch(sinks),
            False, interleaved_v_pack_factor, causal, config=config)
        return torch_to_numpy(o)

    @pytest.mark.parametrize("gather", [False, True])
    @pytest.mark.parametrize("combo", ["plain", "cache-kv noncausal interleaved fp8-uint8 window sinks skip_decode"])
    def test_block_table_addresses(self, combo, gather):
        """is_block_table_ptr: b_loc holds K cache block addresses (0 = unused; the
        garbage ids of make_case become 0 or wild addresses), converted on the device."""
        if combo == "plain":
            case, opts = make_case([(20, 37), (1, 50), (33, 0), (5, 16)], 4, 2, 32, 16, 8,
                                   "float32", table_dtype="int64"), {}
        else:
            case, opts, _ = _vllm033_combo(combo)
        keep = poison_like(case["q"].shape, case["q"].dtype.name)
        out = torch_with_addresses(case, opts, keep, PrefixPrefillConfig(16, 32, 4, 2, True, 1, gather))
        check(out, reference(case, output=keep, **opts), case["q"].dtype.name,
              f"{combo} addresses gather={gather}")
        tt = lambda n: None if case[n] is None else to_torch(case[n])  # noqa: E731
        with pytest.raises(TypeError, match="b_loc"):  # addresses need int64
            at.context_attention_fwd(
                tt("q"), tt("k"), tt("v"), to_torch(keep), opts.get("kv_cache_dtype", "auto"),
                tt("k_cache"), tt("v_cache"), to_torch(case["b_loc"].astype(np.int32)),
                tt("b_start_loc"), tt("b_seq_len"), 0, case["max_input_len"], 1.0, 1.0,
                is_block_table_ptr=True)

    def test_any_strides(self):
        """Padded / permuted views of every tensor argument."""
        case = make_case([(14, 40), (6, 9)], 4, 2, 32, 16, 8, "float16")
        ref = reference(case)

        def padded(a, axis):  # a view of ``a`` inside a larger buffer
            pad = [(0, 0)] * a.ndim
            pad[axis] = (1, 2)
            big = to_torch(np.pad(a, pad))
            return big.narrow(axis, 1, a.shape[axis])

        q, k, v = padded(case["q"], 1), padded(case["k"], 2), padded(case["v"], 0)
        kc, vc = padded(case["k_cache"], 1), padded(case["v_cache"], 3)
        b_loc = to_torch(np.ascontiguousarray(case["b_loc"].T)).t()
        o_big = to_torch(poison_like((case["q"].shape[0], 6, 32), "float16"))
        o = o_big[:, 1:5]
        at.context_attention_fwd(q, k, v, o, "auto", kc, vc, b_loc, to_torch(case["b_start_loc"]),
                                 to_torch(case["b_seq_len"]), 0, case["max_input_len"])
        check(torch_to_numpy(o), ref, "float16", "strided")
        assert torch.isnan(o_big[:, 0].float()).all() and torch.isnan(o_big[:, 5].float()).all()

    def test_compile_fullgraph(self):
        case = make_case([(9, 20), (4, 0)], 2, 1, 32, 16, 8, "float32")
        ts = {n: to_torch(case[n]) for n in ARRAYS}
        config = PrefixPrefillConfig(16, 16, gather=True)

        def f(q, k, v, kc, vc, bl, bs, sl):
            o = torch.empty_like(q)
            at.context_attention_fwd(q, k, v, o, "auto", kc, vc, bl, bs, sl, 0, 9)
            o2 = torch.empty_like(q)
            at.context_attention_fwd(q, k, v, o2, "auto", kc, vc, bl, bs, sl, 0, 9, config=config)
            return o * 2, o2

        backend = "inductor" if GPU else "aot_eager"
        out, out2 = torch.compile(f, fullgraph=True, backend=backend)(*(ts[n] for n in ARRAYS))
        check(torch_to_numpy(out), 2 * reference(case), "float32", "compiled")
        check(torch_to_numpy(out2), reference(case), "float32", "compiled, config=")

    def test_plan_is_cached_and_data_is_runtime(self):
        from adapters.torch import _executor
        case = make_case([(5, 20), (3, 9)], 2, 1, 32, 16, 8, "float32")
        self.attention(case)
        info0 = plan_prefix_prefill.cache_info()
        cached = dict(_executor._PLANS)
        case["b_seq_len"] = case["b_seq_len"] + 1  # other lengths: same plan
        self.attention(case)
        info1 = plan_prefix_prefill.cache_info()
        # no new plan: neither the planner nor the adapter-side plan cache made one
        assert info1.misses == info0.misses
        assert cached and _executor._PLANS == cached

    def test_plan_cache_follows_config(self, monkeypatch):
        """config= reaches plans the torch adapter has already cached for the same
        layouts (its plan cache sits above the planner's): the plain, paged and
        gathered calls each run their own plan."""
        from adapters.torch import _executor as ex
        plans = []
        run_cpu, run_gpu = ex._run_interpreted, ex._run_gpu  # every plan run starts in one of them
        monkeypatch.setattr(ex, "_run_interpreted", lambda plan, *a: (plans.append(plan), run_cpu(plan, *a))[1])
        monkeypatch.setattr(ex, "_run_gpu", lambda prog, *a: (plans.append(prog.plan), run_gpu(prog, *a))[1])
        case = make_case([(20, 40), (1, 17)], 4, 2, 32, 16, 8, "float32")
        ref = reference(case)
        check(self.attention(case), ref, "float32", "plain")
        for gather in (False, True):
            config = PrefixPrefillConfig(16, 16, 4, 2, True, 1, gather)
            check(self.attention(case, config=config), ref, "float32", f"gather={gather}")
        plain, paged, gathered = plans
        assert len(gathered.launches) == len(paged.launches) + 1, (paged.launches, gathered.launches)
        assert paged.launches[-1].constexprs["BLOCK_M"] == 16 != plain.launches[-1].constexprs["BLOCK_M"]

    def test_output_errors(self):
        c = make_case([(4, 10)], 4, 2, 32, 16, 8, "float32")
        args = [to_torch(c[n]) for n in ARRAYS]
        with pytest.raises(TypeError, match="output"):
            at.context_attention_fwd(*args[:3], torch.empty(4, 4, 32, dtype=torch.float16, device=DEVICE),
                                     "auto", *args[3:], 0, 4)
        with pytest.raises(ValueError, match="fp8_out_scale"):
            at.context_attention_fwd(*args[:3], torch.empty(4, 4, 32, dtype=torch.float8_e4m3fn, device=DEVICE),
                                     "auto", *args[3:], 0, 4)
        with pytest.raises(ValueError, match="output"):
            at.context_attention_fwd(*args[:3], torch.empty(5, 4, 32, device=DEVICE), "auto", *args[3:], 0, 4)
        with pytest.raises(ValueError, match="k_scale"):
            at.context_attention_fwd(*args[:3], torch.empty(4, 4, 32, device=DEVICE), "fp8",
                                     to_torch(np.zeros(c["k_cache"].shape, np.uint8)),
                                     to_torch(np.zeros(c["v_cache"].shape, np.uint8)), *args[5:], 0, 4,
                                     k_scale=torch.ones(2, device=DEVICE), v_scale=1.0)
        with pytest.raises(ValueError, match="b_seq_len.*one device"):
            at.context_attention_fwd(*args[:3], torch.empty(4, 4, 32, device=DEVICE), "auto",
                                     *args[3:7], args[7].to("meta"), 0, 4)

    @requires_gpu
    def test_gpu_head_sizes_and_block_sizes(self):
        for d, bs, x in GPU_HEAD_SIZES:
            case = make_case([(200, 300), (77, 0), (1, 50)], 8, 2, d, bs, x, "bfloat16")
            check(self.attention(case), reference(case), "bfloat16", f"d={d} bs={bs}")

    @requires_gpu
    def test_cuda_graph_replay(self):
        case = make_case([(128, 256), (64, 64)], 8, 2, 128, 16, 8, "float16")
        ts = {n: to_torch(case[n]) for n in ARRAYS}
        o = torch.empty(ts["q"].shape, dtype=torch.float16, device="cuda")
        call = lambda: at.context_attention_fwd(ts["q"], ts["k"], ts["v"], o, "auto", ts["k_cache"],  # noqa: E731
                                                ts["v_cache"], ts["b_loc"], ts["b_start_loc"],
                                                ts["b_seq_len"], 0, 128)
        call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        q2 = rng().standard_normal(case["q"].shape).astype(np.float16)
        ts["q"].copy_(to_torch(q2))
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(torch_to_numpy(o), reference({**case, "q": q2}), "float16", "graph replay")


class TestJax(JaxAdapter, PrefixPrefillTests):
    CPU_SKIP = ("test_small_tiles_full_and_masked_runs[(16, 16)]",
                "test_small_tiles_full_and_masked_runs[(32, 16, 4, 2, False, 0)]",
                "test_small_tiles_full_and_masked_runs[(16, 32, 4, 2, False, 2, False)]",
                "test_small_tiles_full_and_masked_runs[(64, 32, 4, 2, True, 2, False)]",
                "test_small_tiles_full_and_masked_runs[(32, 32, 4, 2, True, 0, True)]",
                "test_context_gathered_or_paged[False]", "test_context_gathered_or_paged[True]",
                # JAX's max_seq_len runs in the index-validation tests too
                "test_max_seq_len_sizes_the_gathered_context",
                # CI time (14 min 54 s with setup at ff08afe; the module's torch-vs-JAX
                # bitwise tests still cover JAX's options on the CPU)
                "test_vllm033_options[interleaved-v16-cache-kv-noncausal-False]",
                "test_vllm033_options[cache-kv-noncausal-False]", "test_vllm033_options[cache-kv-False]",
                "test_vllm033_options[noncausal-False]", "test_vllm033_options[interleaved-v-False]",
                "test_vllm033_options[interleaved-v-alibi-window-False]",
                "test_vllm033_options_combined[cache-kv noncausal interleaved fp8-e4m3 sinks skip_decode d80-False]",
                "test_vllm033_options_combined[interleaved alibi window sinks fp8-out-False]",
                "test_vllm033_options_combined[cache-kv fp8-uint8 window sinks skip_decode fp8-out-False]",
                "test_matches_reference[gqa-d96-bs544-x4-float32]")

    def attention(self, case, *, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0,
                  alibi_slopes=None, sliding_window=None, sm_scale=None, skip_decode=False,
                  fp8_out_scale=None, sinks=None, output=None, max_input_len=None, config=None,
                  causal=True, interleaved_v_pack_factor=0, max_seq_len=0, jit=False):
        import jax
        import adapters.jax as aj
        fn = functools.partial(aj.context_attention_fwd, max_input_len=max_input_len, max_seq_len=max_seq_len,
                               kv_cache_dtype=kv_cache_dtype, sliding_window=sliding_window,
                               sm_scale=sm_scale, skip_decode=skip_decode, config=config,
                               causal=causal, interleaved_v_pack_factor=interleaved_v_pack_factor)
        if jit:
            fn = jax.jit(fn)
        kw = dict(k_scale=np.float32(k_scale), v_scale=np.float32(v_scale),
                  alibi_slopes=alibi_slopes, sinks=sinks, output=output,
                  fp8_out_scale=None if fp8_out_scale is None else np.float32(fp8_out_scale))
        kw = {n: to_jax(a) for n, a in kw.items() if a is not None}
        return jax_to_numpy(fn(*(None if case[n] is None else to_jax(case[n]) for n in ARRAYS), **kw))

    def test_block_table_addresses_need_the_gpu(self):
        import adapters.jax as aj
        if GPU:
            pytest.skip("the interpreter's refusal")
        case = make_case([(4, 10)], 4, 2, 32, 16, 8, "float32", table_dtype="int64")
        with pytest.raises(NotImplementedError, match="is_block_table_ptr"):
            aj.context_attention_fwd(*(to_jax(case[n]) for n in ARRAYS), is_block_table_ptr=True)

    def test_skipped_rows_are_zeros_without_output(self):
        case = make_case([(12, 20), (1, 30), (9, 0), (1, 5)], 4, 2, 32, 16, 8, "float32")
        out = self.attention(case, skip_decode=True)
        assert np.all(out[12] == 0) and np.all(out[-1] == 0)

    def test_jit_no_recompile_and_donation(self):
        """New splits and context lengths (device data) reuse one compiled program."""
        import jax
        import adapters.jax as aj
        case = make_case([(10, 40), (7, 35)], 2, 1, 32, 16, 8, "float32")
        f = jax.jit(functools.partial(aj.context_attention_fwd, max_input_len=16, skip_decode=True),
                    donate_argnames=("output",))
        for lens in ([(10, 20), (7, 35)], [(12, 4), (5, 30)], [(1, 30), (16, 19)]):
            qlens = np.array([a for a, _ in lens])
            c2 = dict(case, b_start_loc=np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32),
                      b_seq_len=(qlens + [c for _, c in lens]).astype(np.int32))
            keep = np.full(case["q"].shape, 3.0, np.float32)
            out = f(*(to_jax(c2[n]) for n in ARRAYS), output=to_jax(keep))
            ref = reference(c2, skip_decode=True, output=keep)
            check(self.numpy(out), ref, "float32", f"lens {lens}")
        assert f._cache_size() == 1, "new block tables / lengths recompiled"


# ------------------------------------------------------------------ both adapters, one plan
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_torch_and_jax_bitwise_equal(dtype):
    g = rng()
    opts = _options("window-alibi-sinks", 4, g)
    case = make_case([(33, 45), (1, 20), (20, 0)], 4, 2, 32, 16, 8, dtype,
                     cache_fp8="float8_e5m2", window=opts["sliding_window"])
    opts.update(kv_cache_dtype="fp8_e5m2", k_scale=0.8, v_scale=1.1)
    for out_scale in (None, 0.02):
        t = TestTorch().attention(case, fp8_out_scale=out_scale, **opts)
        j = TestJax().attention(case, fp8_out_scale=out_scale, jit=True, **opts)
        assert_bitwise_equal(t, j, f"torch vs jax (fp8 out {out_scale})")


@pytest.mark.parametrize("combo", VLLM033_COMBOS[:3])
def test_torch_and_jax_bitwise_equal_vllm033(combo):
    case, opts, out_scale = _vllm033_combo(combo)
    keep = cast(rng().standard_normal(case["q"].shape),  # rows skip_decode leaves
                "float8_e4m3fn" if out_scale else case["q"].dtype.name)
    for gather in (False, True):
        config = PrefixPrefillConfig(16, 32, 4, 2, True, 1, gather)
        t = TestTorch().attention(case, fp8_out_scale=out_scale, config=config, output=keep, **opts)
        j = TestJax().attention(case, fp8_out_scale=out_scale, config=config, output=keep, jit=True,
                                **opts)
        assert_bitwise_equal(t, j, f"torch vs jax {combo} gather={gather}")


def test_interleaved_v_needs_contiguous_heads():
    """The interleaved V layout lives in memory: a V cache whose [D, block_size] is
    not contiguous is refused (planner, both adapters alike)."""
    case = make_case([(4, 10)], 4, 2, 32, 16, 8, "float32")
    infos = [ArrayInfo.contiguous(case[n].shape, case[n].dtype.name) for n in ARRAYS]
    infos[4] = ArrayInfo(tuple(case["v_cache"].shape), "float32", (2 * 32 * 16, 32 * 16, 1, 32))
    with pytest.raises(ValueError, match="v_cache"):
        plan_prefix_prefill(Target.interpreter(), *infos, max_input_len=4, interleaved_v_pack_factor=4)
    assert plan_prefix_prefill(Target.interpreter(), *infos, max_input_len=4).launches


def test_gather_plan_policy():
    """Automatic choice: gather when cache tiles are reused and the scratch is small."""
    A = ArrayInfo.contiguous

    def plan(q_len, b, blocks, config=None):
        t = q_len * b
        return plan_prefix_prefill(
            Target.interpreter(), A((t, 32, 128), "float16"), A((t, 8, 128), "float16"),
            A((t, 8, 128), "float16"), A((b * blocks, 8, 16, 16, 8), "float16"),
            A((b * blocks, 8, 128, 16), "float16"), A((b, blocks), "int32"), A((b + 1,), "int32"),
            A((b,), "int32"), max_input_len=q_len, config=config)

    assert len(plan(1024, 4, 256).launches) == 2               # reused, 64 MiB scratch
    assert len(plan(16, 4, 256).launches) == 1                 # one row tile: no reuse
    assert len(plan(1024, 64, 8192).launches) == 1             # scratch too large
    forced = PrefixPrefillConfig(64, 32, 4, 2, True, 0, gather=True)
    assert len(plan(16, 4, 256, forced).launches) == 2         # config= forces it ...
    assert plan(16, 4, 256, forced).launches[-1].constexprs["BLOCK_N"] == 32  # ... with its tiles
    assert len(plan(1024, 4, 256, dataclasses.replace(forced, gather=False)).launches) == 1


def test_max_seq_len_sizes_the_scratch():
    """A block table 8192 blocks wide (131072 tokens) over 4096-token contexts:
    sized by the table the scratch is too large and the context is read paged;
    sized by max_seq_len (rounded up to a power of two of blocks) it is gathered."""
    A = ArrayInfo.contiguous

    def plan(max_seq_len, blocks=8192, cache_new=False):
        t, b = 4096, 4
        kv = (None, None) if cache_new else (A((t, 8, 128), "float16"), A((t, 8, 128), "float16"))
        return plan_prefix_prefill(
            Target.interpreter(), A((t, 32, 128), "float16"), *kv,
            A((b * 256, 8, 16, 16, 8), "float16"), A((b * 256, 8, 128, 16), "float16"),
            A((b, blocks), "int32"), A((b + 1,), "int32"), A((b,), "int32"), max_input_len=1024,
            max_seq_len=max_seq_len)

    assert len(plan(0).launches) == 1                          # table-sized: paged
    gathered = plan(4096)
    assert len(gathered.launches) == 2 and gathered.buffers["k_scratch"].shape == (4, 8, 4096, 128)
    assert plan(5000).buffers["k_scratch"].shape[2] == 8192    # 313 blocks -> 512 blocks
    assert plan(5000).launches[0].grid == plan(8000).launches[0].grid  # one bucket, one plan shape
    assert plan(4096, cache_new=True).buffers["k_scratch"].shape[2] == 8192  # + max_input_len
    assert plan(10 ** 6, blocks=256).buffers["k_scratch"].shape[2] == 4096   # never past the table
    with pytest.raises(ValueError, match="max_seq_len"):
        plan(-1)


# ------------------------------------------------------------------ GPU, real sizes
GPU_SEQS = [(300, 700), (129, 1024), (1, 2000), (64, 0), (512, 33)]
GPU_HEAD_SIZES = ((80, 16, 8), (96, 48, 8), (112, 544, 8), (192, 32, 16), (256, 16, 8), (64, 32, 4))
GPU_OPTIONS = ["plain", "window-alibi-sinks", "fp8"]
SM90 = Target("cuda", 90, 132, gluon=True)  # the H200 the GPU tests run on


def _gpu_case(dtype, options):
    """(case, options) of test_gpu_real_sizes."""
    opts = _options(options, 32, rng())
    if "sliding_window" in opts:
        opts["sliding_window"] = 256
    fp8 = options == "fp8"
    case = make_case(GPU_SEQS, 32, 8, 128, 16, 16 // np_dtype(dtype).itemsize, dtype,
                     cache_fp8="float8_e4m3fn" if fp8 else None, as_uint8=fp8,
                     window=opts.get("sliding_window"))
    if fp8:
        opts.update(kv_cache_dtype="fp8", k_scale=0.6, v_scale=0.9)
    return case, opts


def _paged(dtype):
    """The measured paged-path tiles of 16-bit / fp32 D=128, forced (no gather)."""
    return dataclasses.replace(TILE_CONFIGS[(np_dtype(dtype).itemsize, 128)], gather=False)


@requires_gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("options", GPU_OPTIONS)
def test_gpu_real_sizes(dtype, options):
    case, opts = _gpu_case(dtype, options)
    ref = reference(case, **opts)
    torch_, jax_ = TestTorch(), TestJax()
    t = torch_.attention(case, **opts)
    check(t, ref, dtype, f"torch {options}")
    j = jax_.attention(case, jit=True, **opts)
    assert_bitwise_equal(t, j, f"torch vs jax {options}")
    if options != "window-alibi-sinks":
        return
    # the paged path (context read through the block table in the loop), forced
    t2 = torch_.attention(case, config=_paged(dtype), **opts)
    check(t2, ref, dtype, f"torch {options} paged")
    j2 = jax_.attention(case, jit=True, config=_paged(dtype), **opts)
    assert_bitwise_equal(t2, j2, f"torch vs jax {options} paged")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gpu_test_plans_build(dtype):
    """The plans of the GPU-only tests build for sm_90 (launch arguments checked
    against the kernels' signatures) on a machine without a GPU."""
    for options in GPU_OPTIONS:
        case, opts = _gpu_case(dtype, options)
        plans = [plan_for(case, SM90, **opts)]
        if options == "window-alibi-sinks":
            plans.append(plan_for(case, SM90, config=_paged(dtype), **opts))
            assert len(plans[-1].launches) == 1, "the forced paged path gathered"
        assert all(p.launches for p in plans)
    if dtype == "bfloat16":
        for d, bs, x in GPU_HEAD_SIZES:
            assert plan_for(make_case([(200, 300), (77, 0), (1, 50)], 8, 2, d, bs, x, dtype), SM90).launches
        case = make_case([(128, 256), (64, 64)], 8, 2, 128, 16, 8, "float16")  # CUDA graph replay
        assert plan_for(case, SM90).launches


# ------------------------------------------------------------------ GPU, vLLM 0.33's options
GPU_VLLM033 = ["interleaved", "cache-kv", "noncausal", "cache-kv-noncausal-interleaved-window-sinks"]
GPU_VLLM033_KV = [("bfloat16", None), ("float16", None), ("bfloat16", "fp8")]


def _gpu_vllm033_case(dtype, kv, options):
    """(case, options) at real sizes (Llama-8B heads, D=128, block 16)."""
    x = 16 // np_dtype(dtype).itemsize
    opts = {}
    if "window" in options:
        opts["sliding_window"] = 256
    if "sinks" in options:
        opts["sinks"] = (rng().standard_normal(32) * 2).astype(np.float32)
    if "noncausal" in options:
        opts["causal"] = False
    v_pack = 0
    if "interleaved" in options:
        v_pack = 16 if kv == "fp8" else x
        opts["interleaved_v_pack_factor"] = v_pack
    cache_kv = "cache-kv" in options
    case = make_case(GPU_SEQS, 32, 8, 128, 16, x, dtype,
                     cache_fp8="float8_e4m3fn" if kv else None, as_uint8=bool(kv),
                     window=opts.get("sliding_window"), cache_new=cache_kv, v_pack=v_pack)
    if cache_kv:
        case = no_kv(case)
    if kv:
        opts.update(kv_cache_dtype="fp8", k_scale=0.6, v_scale=0.9)
    return case, opts


@requires_gpu
@pytest.mark.parametrize("dtype,kv", GPU_VLLM033_KV, ids=str)
@pytest.mark.parametrize("options", GPU_VLLM033)
def test_gpu_vllm033_real_sizes(dtype, kv, options):
    """The new options at real sizes: the reference, torch vs JAX bitwise on the
    chosen (gathered) and forced paged paths, block addresses bitwise to block ids."""
    case, opts = _gpu_vllm033_case(dtype, kv, options)
    ref = reference(case, **opts)
    torch_, jax_ = TestTorch(), TestJax()
    for config in (None, _paged(dtype)):
        t = torch_.attention(case, config=config, **opts)
        check(t, ref, dtype, f"torch {options} {kv} config={config}")
        j = jax_.attention(case, jit=True, config=config, **opts)
        assert_bitwise_equal(t, j, f"torch vs jax {options} {kv} config={config}")
        a = torch_with_addresses(case, opts, poison_like(case["q"].shape, dtype), config)
        assert_bitwise_equal(t, a, f"block addresses vs ids {options} {kv} config={config}")


# The cache layouts x tilings of a miscompile found on the H200 (x = 1 K cache,
# interleaved V of pack factor 1, packed GQA heads; see the ID_RUN NOTE in
# core_kernels/prefix_prefill/plan.py): every K layout (x = 1: the K tile is
# contiguous along the keys; x = 8: along D) with every V layout (standard,
# pack factor 1 and 8), 16-bit and fp8 caches, packed and unpacked heads, on
# the planner's tiles and forced paged tilings of one and three stages.
LAYOUT_SEQS = [(12, 158), (31, 0), (0, 0), (70, 97)]
LAYOUT_CONFIGS = (None, PrefixPrefillConfig(64, 64, num_stages=1, gather=False),
                  PrefixPrefillConfig(128, 64, 4, 3, gather=False))


@requires_gpu
@pytest.mark.parametrize("kv", [None, "fp8"], ids=str)
@pytest.mark.parametrize("x", [1, 8])
@pytest.mark.parametrize("v_pack", [0, 1, 8])
@pytest.mark.parametrize("hq,hkv", [(2, 1), (1, 1)])
@pytest.mark.parametrize("d", [24, 64])
def test_gpu_cache_layout_matrix(kv, x, v_pack, hq, hkv, d):
    if d % x:
        pytest.skip("x must divide D")
    opts = dict(sm_scale=0.05, skip_decode=True, interleaved_v_pack_factor=v_pack)
    case = no_kv(make_case(LAYOUT_SEQS, hq, hkv, d, 32, x, "bfloat16",
                           cache_fp8="float8_e4m3fn" if kv else None, cache_new=True, v_pack=v_pack))
    if kv:
        opts.update(k_scale=0.5, v_scale=1.5)
    ref = reference(case, **opts)
    for config in LAYOUT_CONFIGS:
        t = TestTorch().attention(case, config=config, **opts)
        check(t, ref, "bfloat16", f"torch kv={kv} x={x} v_pack={v_pack} hq={hq} d={d} config={config}")


def test_gpu_vllm033_plans_build():
    """The GPU-only vLLM 0.33 tests' plans build for sm_90 (gathered and paged)."""
    for dtype, kv in GPU_VLLM033_KV:
        for options in GPU_VLLM033:
            case, opts = _gpu_vllm033_case(dtype, kv, options)
            chosen = plan_for(case, SM90, **opts)
            paged = plan_for(case, SM90, config=_paged(dtype), **opts)
            addresses = plan_for({**case, "b_loc": case["b_loc"].astype(np.int64)}, SM90,
                                 is_block_table_ptr=True, **opts)
            assert chosen.launches and addresses.launches and len(paged.launches) == 1

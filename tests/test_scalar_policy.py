"""The scalar policy (docs/scalar_policy.md) of every op, through both adapters.

Each bad host scalar raises TypeError / ValueError naming its argument before any
launch (the torch ops' in-place buffers keep their poison); each accepted form of a
scalar (Python int or float, numpy scalar, 0-d numpy array, 0-d tensor / array)
gives bit for bit the result of the plain Python number; device data (tensors,
JAX arrays) is never read on the host and behaves as documented.
"""
import math

import numpy as np
import pytest
import torch

from core_kernels.blocksparse_attention import build_sparse_layout
from core_kernels.lightning_attention import (LightningTritonConfig, lightning_attention_reference,
                                              linear_decode_reference)
from harness import (DEVICE, GPU, assert_bitwise_equal, assert_close, cast, jax_to_numpy, poison_like,
                     rng, to_jax, to_torch, torch_to_numpy)
import adapters.torch as at

ADAPTERS = ["torch", "jax"]


def _aj():
    import adapters.jax as aj
    return aj


def _np(x):
    return torch_to_numpy(x) if isinstance(x, torch.Tensor) else jax_to_numpy(x)


# ------------------------------------------------------------------ op runners
# run(adapter, kw, keep): the op on small fixed inputs with the scalars in ``kw``;
# numpy results out. torch in-place buffers are poisoned and appended to ``keep``.
N_MERGE = 6


def run_merge(adapter, kw, keep):
    g = rng(1)
    po, so = (g.standard_normal((N_MERGE, 2, 16)).astype(np.float32) for _ in range(2))
    pl, sl = (g.standard_normal((2, N_MERGE)).astype(np.float32) for _ in range(2))
    fp8 = kw.get("output_scale") is not None
    if adapter == "torch":
        out = to_torch(poison_like(po.shape, "float8_e4m3fn" if fp8 else "float32"))
        lse = to_torch(poison_like(pl.shape, "float32"))
        keep += [out, lse]
        at.merge_attn_states(out, *map(to_torch, (po, pl, so, sl)), output_lse=lse, **kw)
        return _np(out), _np(lse)
    return tuple(map(_np, _aj().merge_attn_states(*map(to_jax, (po, pl, so, sl)), **kw)))


_PREFIX_CACHE = {}


def _prefix_case(fp8):
    if fp8 not in _PREFIX_CACHE:
        import test_prefix_prefill as tpp
        _PREFIX_CACHE[fp8] = tpp.make_case([(5, 9), (3, 0)], 2, 1, 16, 8, 8, "float32", seed=3,
                                           cache_fp8="float8_e4m3fn" if fp8 else None)
    return _PREFIX_CACHE[fp8]


def run_prefix(adapter, kw, keep):
    kw = dict(kw)
    fp8_cache = "k_scale" in kw or "v_scale" in kw
    c = _prefix_case(fp8_cache)
    out_dtype = "float8_e4m3fn" if kw.get("fp8_out_scale") is not None else "float32"
    max_input_len = kw.pop("max_input_len", c["max_input_len"])
    arrays = [c[n] for n in ("q", "k", "v", "k_cache", "v_cache", "b_loc", "b_start_loc", "b_seq_len")]
    if adapter == "torch":
        o = to_torch(poison_like(c["q"].shape, out_dtype))
        keep.append(o)
        t = list(map(to_torch, arrays))
        at.context_attention_fwd(*t[:3], o, "auto", *t[3:], kw.pop("max_seq_len", 0), max_input_len,
                                 **kw)
        return (_np(o),)
    return (_np(_aj().context_attention_fwd(*map(to_jax, arrays), max_input_len=max_input_len, **kw)),)


def _lightning_inputs(b=1, h=3, n=40, d=16, seed=4):
    g = rng(seed)
    q, k, v = (g.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(3))
    return q, k, v, np.array([0.1, 0.5, 1.0][:h], np.float32)


def run_lightning(adapter, kw, keep):
    q, k, v, ed = _lightning_inputs()
    mod = at if adapter == "torch" else _aj()
    conv = to_torch if adapter == "torch" else to_jax
    return tuple(map(_np, mod.lightning_attention(*map(conv, (q, k, v, ed)), **kw)))


def _decode_inputs():
    g = rng(5)
    q, k, v = (g.standard_normal((2, 3, 1, 16)).astype(np.float32) for _ in range(3))
    cache = g.standard_normal((4, 3, 16, 16)).astype(np.float32)
    return q, k, v, cache, np.array([0.1, 0.5, 1.0], np.float32), np.array([2, 0], np.int64)


def run_decode(adapter, kw, keep):
    q, k, v, cache, slope, slots = _decode_inputs()
    if adapter == "torch":
        cache_t = to_torch(cache)
        keep.append(cache_t)
        cache_t.fill_(float("nan"))  # poisoned: a launch would write slots 0 and 2
        cache_t.copy_(to_torch(cache))
        out = at.linear_decode_forward_triton(*map(to_torch, (q, k, v)), cache_t, to_torch(slope),
                                              to_torch(slots), **kw)
        return _np(out), _np(cache_t)
    return tuple(map(_np, _aj().linear_decode_forward_triton(*map(to_jax, (q, k, v, cache, slope, slots)),
                                                              **kw)))


def _blocksparse_inputs():
    g = rng(6)
    q = g.standard_normal((64, 2, 16)).astype(np.float32)
    k, v = (g.standard_normal((64, 1, 16)).astype(np.float32) for _ in range(2))
    (crow, col), _ = build_sparse_layout(2, 64, 16, 2, 2, False)
    return q, k, v, np.array([0, 64], np.int32), (np.ascontiguousarray(crow), np.ascontiguousarray(col))


def run_blocksparse(adapter, kw, keep):
    kw = dict(kw)
    q, k, v, cu, layout = _blocksparse_inputs()
    sm_scale = kw.pop("sm_scale", 0.25)
    kw.setdefault("block_size", 16)
    mod = at if adapter == "torch" else _aj()
    conv = to_torch if adapter == "torch" else to_jax
    return (_np(mod.blocksparse_flash_attn_varlen_fwd(*map(conv, (q, k, v, cu)), None, sm_scale,
                                                      tuple(map(conv, layout)), **kw)),)


_UNIFIED_CACHE = {}


def run_unified(adapter, kw, keep):
    kw = dict(kw)
    fp8 = "k_descale" in kw or "v_descale" in kw
    if fp8 not in _UNIFIED_CACHE:
        import test_unified_attention as tua
        _UNIFIED_CACHE[fp8] = tua.make_case([(5, 9), (1, 3)], 2, 1, 16, 8, "float32", seed=3,
                                            kv="fp8" if fp8 else None)
    c = _UNIFIED_CACHE[fp8]
    opts = dict(max_seqlen_q=c["max_seqlen_q"], max_seqlen_k=c["max_seqlen_k"], softmax_scale=0.25,
                window_size=(-1, -1), softcap=0.0, k_descale=None, v_descale=None)
    opts.update(kw)
    arrays = [c[n] for n in ("q", "k", "v", "cu_seqlens_q", "seqused_k", "block_table")]
    if adapter == "torch":
        o = to_torch(poison_like(c["q"].shape, "float8_e4m3fn" if opts.get("output_scale") is not None
                                 else "float32"))
        keep.append(o)
        q, k, v, cu, used, table = map(to_torch, arrays)
        at.unified_attention(q, k, v, o, cu, opts.pop("max_seqlen_q"), used, opts.pop("max_seqlen_k"),
                             opts.pop("softmax_scale"), True, opts.pop("window_size"), table,
                             opts.pop("softcap"), None, opts.pop("k_descale"), opts.pop("v_descale"),
                             kv_quant_mode=opts.pop("kv_quant_mode", 1 if fp8 else 0), **opts)
        return (_np(o),)
    return (_np(_aj().unified_attention(*map(to_jax, arrays), **opts)),)


def run_cache(adapter, kw, keep):
    """reshape_and_cache_flash into poisoned fp8 caches (kv_cache_dtype "fp8" unless given)."""
    kw = dict(kw)
    kw.setdefault("kv_cache_dtype", "fp8")
    g = rng(7)
    key, value = (g.standard_normal((5, 2, 8)).astype(np.float32) for _ in range(2))
    slots = np.array([3, -1, 0, 6, 2], np.int64)
    cache = poison_like((2, 4, 2, 8), "float8_e4m3fn")
    if adapter == "torch":
        kc, vc = to_torch(cache), to_torch(cache)
        keep += [kc, vc]
        at.reshape_and_cache_flash(to_torch(key), to_torch(value), kc, vc, to_torch(slots), **kw)
        return _np(kc), _np(vc)
    return tuple(map(_np, _aj().reshape_and_cache_flash(*map(to_jax, (key, value, cache, cache, slots)), **kw)))


RUNNERS = {"merge": run_merge, "prefix": run_prefix, "lightning": run_lightning,
           "decode": run_decode, "blocksparse": run_blocksparse, "cache": run_cache,
           "unified": run_unified}

NAN, INF = float("nan"), float("inf")

# (op, {argument: bad value}, exception): the message must name the argument
BAD = [
    ("merge", dict(prefill_tokens_with_context=-1), ValueError),
    ("merge", dict(prefill_tokens_with_context=N_MERGE + 1), ValueError),
    ("merge", dict(prefill_tokens_with_context=2.5), TypeError),
    ("merge", dict(prefill_tokens_with_context=3.0), TypeError),
    ("merge", dict(prefill_tokens_with_context=True), TypeError),
    ("merge", dict(prefill_tokens_with_context="3"), TypeError),
    ("merge", dict(prefill_tokens_with_context=2 ** 40), ValueError),
    ("merge", dict(prefill_tokens_with_context=2 ** 64), ValueError),
    ("merge", dict(prefill_tokens_with_context=np.array(-1)), ValueError),
    ("merge", dict(output_scale=0.0), ValueError),
    ("merge", dict(output_scale=-0.5), ValueError),
    ("merge", dict(output_scale=NAN), ValueError),
    ("merge", dict(output_scale=INF), ValueError),
    ("merge", dict(output_scale=True), TypeError),
    ("merge", dict(output_scale=np.float32(0.0)), ValueError),
    ("prefix", dict(sm_scale=NAN), ValueError),
    ("prefix", dict(sm_scale=INF), ValueError),
    ("prefix", dict(sm_scale=-INF), ValueError),
    ("prefix", dict(sm_scale=1e39), ValueError),       # beyond float32
    ("prefix", dict(sm_scale=3e38), ValueError),       # times log2(e) beyond float32
    ("prefix", dict(sm_scale=True), TypeError),
    ("prefix", dict(sm_scale="0.1"), TypeError),
    ("prefix", dict(max_input_len=-1), ValueError),
    ("prefix", dict(max_input_len=2.5), TypeError),
    ("prefix", dict(max_input_len=True), TypeError),
    ("prefix", dict(max_input_len=2 ** 64), ValueError),
    ("prefix", dict(sliding_window=2.5), TypeError),
    ("prefix", dict(sliding_window=True), TypeError),
    ("prefix", dict(sliding_window=2 ** 40), ValueError),
    ("prefix", dict(interleaved_v_pack_factor=2.5), TypeError),
    ("prefix", dict(interleaved_v_pack_factor=True), TypeError),
    ("prefix", dict(interleaved_v_pack_factor=-1), ValueError),
    ("prefix", dict(interleaved_v_pack_factor=2 ** 40), ValueError),
    ("prefix", dict(k_scale=0.0, v_scale=1.0), ValueError),
    ("prefix", dict(k_scale=1.0, v_scale=NAN), ValueError),
    ("prefix", dict(k_scale=INF, v_scale=1.0), ValueError),
    ("prefix", dict(k_scale=True, v_scale=1.0), TypeError),
    ("prefix", dict(fp8_out_scale=0.0), ValueError),
    ("prefix", dict(fp8_out_scale=-INF), ValueError),
    ("unified", dict(softmax_scale=NAN), ValueError),
    ("unified", dict(softmax_scale=3e38), ValueError),     # times log2(e) beyond float32
    ("unified", dict(softmax_scale=True), TypeError),
    ("unified", dict(max_seqlen_q=-1), ValueError),
    ("unified", dict(max_seqlen_q=2.5), TypeError),
    ("unified", dict(max_seqlen_k=True), TypeError),
    ("unified", dict(max_seqlen_k=2 ** 40), ValueError),
    ("unified", dict(window_size=(2.5, 0)), TypeError),
    ("unified", dict(window_size=(-2, 0)), ValueError),
    ("unified", dict(window_size=(0, 2 ** 40)), ValueError),
    ("unified", dict(window_size=5), TypeError),
    ("unified", dict(softcap=NAN), ValueError),
    ("unified", dict(softcap=-1.0), ValueError),
    ("unified", dict(softcap="1"), TypeError),
    ("unified", dict(k_descale=0.0, v_descale=1.0), ValueError),
    ("unified", dict(k_descale=1.0, v_descale=INF), ValueError),
    ("unified", dict(output_scale=-1.0), ValueError),
    ("lightning", dict(block_size=0), ValueError),
    ("lightning", dict(block_size=-3), ValueError),
    ("lightning", dict(block_size=2.5), TypeError),
    ("lightning", dict(block_size=True), TypeError),
    ("lightning", dict(block_size=2 ** 40), ValueError),
    ("lightning", dict(block_size=2 ** 64), ValueError),
    ("decode", dict(BLOCK_SIZE=2.5), TypeError),
    ("decode", dict(BLOCK_SIZE=0), ValueError),
    ("blocksparse", dict(sm_scale=NAN), ValueError),
    ("blocksparse", dict(sm_scale=INF), ValueError),
    ("blocksparse", dict(sm_scale=1e39), ValueError),
    ("blocksparse", dict(sm_scale=True), TypeError),
    ("blocksparse", dict(block_size=2.5), TypeError),
    ("blocksparse", dict(block_size=16.0), TypeError),
    ("blocksparse", dict(block_size=48), ValueError),
    ("blocksparse", dict(block_size=2 ** 64), ValueError),
    ("blocksparse", dict(q_block_size=24), ValueError),
    ("blocksparse", dict(q_block_size=2.5), TypeError),
    ("blocksparse", dict(q_block_size=2 ** 40), ValueError),
    ("blocksparse", dict(max_seqlen=0), ValueError),
    ("blocksparse", dict(max_seqlen=65), ValueError),   # beyond what the layout covers
    ("blocksparse", dict(max_seqlen=2.5), TypeError),
    ("blocksparse", dict(max_seqlen=2 ** 40), ValueError),
    ("cache", dict(k_scale=0.0, v_scale=1.0), ValueError),
    ("cache", dict(k_scale=1.0, v_scale=NAN), ValueError),
    ("cache", dict(k_scale=INF, v_scale=1.0), ValueError),
    ("cache", dict(k_scale=-0.5, v_scale=1.0), ValueError),
    ("cache", dict(k_scale=True, v_scale=1.0), TypeError),
    ("cache", dict(k_scale=1.0, v_scale="1"), TypeError),
    ("cache", dict(k_scale=1.0, v_scale=1.0, kv_cache_dtype="fp9"), ValueError),
    ("cache", dict(k_scale=1.0, v_scale=1.0, kv_cache_dtype=8), TypeError),
]
BAD_TORCH_ONLY = [
    ("unified", dict(kv_quant_mode=2.5), TypeError),
    ("unified", dict(kv_quant_mode="BOGUS"), ValueError),
    ("prefix", dict(max_seq_len=2.5), TypeError),
    ("prefix", dict(max_seq_len=-1), ValueError),
]


def _bad_id(case):
    op, kw, exc = case
    return f"{op}-{'-'.join(f'{k}={v!r}' for k, v in kw.items())}"


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("case", BAD + BAD_TORCH_ONLY, ids=_bad_id)
def test_bad_scalar_raises_naming_it_before_any_launch(adapter, case):
    op, kw, exc = case
    if adapter == "jax" and case in BAD_TORCH_ONLY:
        pytest.skip("a torch-only argument (vLLM's signature)")
    names = [n for n, v in kw.items() if not (isinstance(v, float) and v == 1.0)]
    keep = []
    with pytest.raises(exc, match="|".join(names)):
        RUNNERS[op](adapter, kw, keep)
    for t in keep:  # nothing launched: the in-place buffers keep their poison
        a = _np(t)
        if a.dtype.name.startswith("float8"):
            assert np.all(a.view(np.uint8) == 0x7F), "an in-place buffer was written"
        elif t is keep[-1] and op == "decode":
            assert np.array_equal(a, _decode_inputs()[3]), "the decode cache was written"
        else:
            assert np.all(np.isnan(a)), "an in-place buffer was written"


# ------------------------------------------------------------------ accepted forms
def _torch_only(x):
    return pytest.param(x, marks=pytest.mark.torch_only)


def _forms(adapter, value, *, device_data=True):
    """Every host form of an int / float ``value``, plus its 0-d tensor / array."""
    forms = [value, np.asarray(value)[()], np.asarray(value)]
    if isinstance(value, int):
        forms += [np.int32(value), np.int64(value)]
    else:
        forms += [np.float32(value), np.float64(value)]
    if device_data:
        if adapter == "torch":
            forms += [torch.tensor(value, device=DEVICE)]
        else:
            import jax.numpy as jnp
            forms += [jnp.asarray(value)]
    return forms


# (op, argument, plain value, fixed kw): every form of the value gives the plain value's result
FORMS = [
    ("merge", "prefill_tokens_with_context", 3, {}),
    ("merge", "prefill_tokens_with_context", 0, {}),
    ("merge", "prefill_tokens_with_context", N_MERGE, {}),
    ("merge", "output_scale", 0.05, {}),
    ("prefix", "max_input_len", 5, {}),
    ("prefix", "sm_scale", 0.3, {}),
    ("prefix", "sliding_window", 4, {}),
    ("prefix", "k_scale", 0.5, dict(v_scale=2.0)),
    ("prefix", "fp8_out_scale", 0.05, {}),
    ("unified", "softmax_scale", 0.3, {}),
    ("unified", "max_seqlen_q", 5, {}),
    ("unified", "max_seqlen_k", 14, {}),
    ("unified", "softcap", 2.0, {}),
    ("unified", "k_descale", 0.5, dict(v_descale=2.0)),
    ("unified", "output_scale", 0.05, {}),
    ("lightning", "block_size", 16, {}),
    ("decode", "BLOCK_SIZE", 32, {}),
    ("blocksparse", "sm_scale", 0.2, {}),
    ("blocksparse", "block_size", 16, {}),
    ("blocksparse", "q_block_size", 32, {}),
    ("blocksparse", "max_seqlen", 64, {}),   # a bound below the real lengths is undefined
    ("cache", "k_scale", 0.5, dict(v_scale=2.0)),
    ("cache", "v_scale", 0.25, dict(k_scale=1.5)),
]


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("case", FORMS, ids=lambda c: f"{c[0]}-{c[1]}={c[2]}")
def test_every_form_of_a_scalar_gives_the_plain_result(adapter, case):
    op, name, value, fixed = case
    expected = RUNNERS[op](adapter, {name: value, **fixed}, [])
    for form in _forms(adapter, value)[1:]:
        got = RUNNERS[op](adapter, {name: form, **fixed}, [])
        for e, g in zip(expected, got):
            assert_bitwise_equal(g, e, f"{name}={form!r} ({type(form).__name__})")


# ---- documented values
def test_merge_count_as_device_data_acts_as_the_nearest_bound():
    """A tensor / JAX array count is read by the kernel only (no host sync): a value
    below 0 acts as 0, one above N as N (docs/scalar_policy.md)."""
    import jax
    import jax.numpy as jnp
    for adapter in ADAPTERS:
        for raw, bound in ((-3, 0), (N_MERGE + 5, N_MERGE), (2 ** 31 - 1, N_MERGE)):
            expected = run_merge(adapter, dict(prefill_tokens_with_context=bound), [])
            if adapter == "torch":
                forms = [torch.tensor(raw, device=DEVICE), torch.tensor([raw], dtype=torch.int32,
                                                                         device=DEVICE)]
            else:
                forms = [jnp.asarray(raw, jnp.int32)]
            for form in forms:
                got = run_merge(adapter, dict(prefill_tokens_with_context=form), [])
                for e, g in zip(expected, got):
                    assert_bitwise_equal(g, e, f"{adapter} count {raw} -> {bound}")
    # traced under jax.jit: the same
    aj = _aj()
    g = rng(1)
    po, so = (g.standard_normal((N_MERGE, 2, 16)).astype(np.float32) for _ in range(2))
    pl, sl = (g.standard_normal((2, N_MERGE)).astype(np.float32) for _ in range(2))
    f = jax.jit(lambda a, b, c, d, n: aj.merge_attn_states(a, b, c, d, prefill_tokens_with_context=n))
    for raw, bound in ((-3, 0), (N_MERGE + 5, N_MERGE)):
        out = f(*map(to_jax, (po, pl, so, sl)), jnp.int32(raw))
        ref = aj.merge_attn_states(*map(to_jax, (po, pl, so, sl)), prefill_tokens_with_context=bound)
        assert_bitwise_equal(_np(out[0]), _np(ref[0]), f"traced {raw}")


def test_merge_count_tensor_errors():
    """A count tensor is checked for shape and dtype (never for its value)."""
    with pytest.raises(ValueError, match="prefill_tokens_with_context"):
        run_merge("torch", dict(prefill_tokens_with_context=torch.tensor([1, 2], device=DEVICE)), [])
    with pytest.raises(TypeError, match="prefill_tokens_with_context"):
        run_merge("torch", dict(prefill_tokens_with_context=torch.tensor(2.0, device=DEVICE)), [])


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_prefix_max_input_len_above_t_acts_as_t(adapter):
    t = _prefix_case(False)["q"].shape[0]
    expected = run_prefix(adapter, dict(max_input_len=t), [])
    for big in (t + 1, 2 ** 40, 2 ** 63 - 1):
        assert_bitwise_equal(run_prefix(adapter, dict(max_input_len=big), [])[0], expected[0], f"{big}")


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_prefix_sliding_window_not_positive_disables(adapter):
    expected = run_prefix(adapter, {}, [])
    for w in (0, -1, -2 ** 40, np.int64(-5)):
        assert_bitwise_equal(run_prefix(adapter, dict(sliding_window=w), [])[0], expected[0], f"{w}")


# ---- lightning: an infinite decay rate
def _close_tf32(actual, expected, dtype, what):
    """assert_close on values normalised by the reference's RMS, scaled for the
    GPU's tf32 products (as tests/test_lightning_attention.py's check)."""
    e = np.asarray(expected, np.float64)
    r = float(np.sqrt(np.mean(e ** 2))) or 1.0
    assert_close(np.asarray(actual, np.float64) / r, e / r, dtype, what, 250.0 if GPU else 1.0)


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("config", [None, LightningTritonConfig(block_t=16, num_segments=3)],
                         ids=["default", "segmented"])
@pytest.mark.parametrize("final_only", [False, True])
def test_lightning_infinite_decay(adapter, config, final_only):
    """ed = +inf: lambda = 0, each token's state is its own k^T v (S_t = k_t^T v_t,
    o_t = (q_t . k_t) v_t); the other heads are unaffected; ed = NaN propagates to
    its own head only. Prefill then decode equals the longer prefill."""
    q, k, v, _ = _lightning_inputs(b=2, h=4, n=40)
    ed = np.array([np.inf, 0.5, 1e38, np.nan], np.float32)
    hist = rng(7).standard_normal((2, 4, 16, 16)).astype(np.float32)
    mod = at if adapter == "torch" else _aj()
    conv = to_torch if adapter == "torch" else to_jax
    out, kv = map(_np, mod.lightning_attention(*map(conv, (q, k, v, ed)), block_size=16,
                                               kv_history=conv(hist),
                                               output_final_state_only=final_only, config=config))
    ref_out, ref_kv = lightning_attention_reference(q[:, :3], k[:, :3], v[:, :3], ed[:3], 16,
                                                    hist[:, :3], final_only)
    _close_tf32(out[:, :3], ref_out, "float32", "output")
    _close_tf32(kv[:, :3], ref_kv, "float32", "kv")
    own = np.einsum("bnd,bnd->bn", q[:, 0], k[:, 0])[..., None] * v[:, 0]
    _close_tf32(out[:, 0], own, "float32", "lambda = 0: o_t = (q_t . k_t) v_t")
    after = kv[:, 3] if final_only else kv[:, 3, 1:]  # kv[:, :, 0]: the history, before any token
    assert np.isnan(out[:, 3]).all() and np.isnan(after).all(), "a NaN rate propagates"
    # one decode step after the prefill of N - 1 tokens equals the prefill of N tokens
    _, kv_prev = map(_np, mod.lightning_attention(*(conv(x[:, :, :-1]) for x in (q, k, v)), conv(ed),
                                                  block_size=16, kv_history=conv(hist),
                                                  output_final_state_only=True))
    res = mod.linear_decode_forward_triton(*(conv(np.ascontiguousarray(x[:, :, -1:])) for x in (q, k, v)),
                                           conv(kv_prev), conv(ed), conv(np.arange(2, dtype=np.int64)))
    dec = _np(res if adapter == "torch" else res[0])
    dec_ref, _ = linear_decode_reference(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], kv_prev, ed,
                                         np.arange(2))
    _close_tf32(dec.reshape(2, 4, 16)[:, :3], dec_ref.reshape(2, 4, 16)[:, :3], "float32", "decode")
    _close_tf32(dec.reshape(2, 4, 16)[:, :3], out[:, :3, -1], "float32", "decode = prefill")


def test_policy_doc_lists_every_checked_argument():
    """docs/scalar_policy.md names every scalar argument the tests above check."""
    import os
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "scalar_policy.md")).read()
    names = {n for _, kw, _ in BAD + BAD_TORCH_ONLY for n in kw} | {c[1] for c in FORMS}
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"docs/scalar_policy.md does not list {missing}"


def test_as_int_and_as_float():
    from core_kernels._plan import INT32_MAX, as_float, as_int
    assert as_int("x", np.int16(7)) == 7 and as_int("x", torch.tensor(7)) == 7
    assert as_int("x", torch.tensor([7])) == 7 and as_int("x", np.array(7)) == 7
    for bad, exc in ((np.bool_(True), TypeError), (np.float64(1.0), TypeError), (None, TypeError),
                     (np.array([1, 2]), TypeError), (torch.tensor(1.5), TypeError),
                     (torch.tensor(True), TypeError), (2 ** 31, ValueError)):
        with pytest.raises(exc, match="^x: "):
            as_int("x", bad, 0, INT32_MAX)
    assert as_float("s", torch.tensor(0.5)) == 0.5 and as_float("s", np.float16(0.5)) == 0.5
    assert math.isnan(as_float("s", NAN, finite=False))
    for bad, exc in ((2 ** 1024, ValueError), (b"1", TypeError), (np.bool_(False), TypeError),
                     (torch.tensor([1.0, 2.0]), TypeError)):
        with pytest.raises(exc, match="^s: "):
            as_float("s", bad)
    with pytest.raises(ValueError, match="^s: .*> 0"):
        as_float("s", -0.0, positive=True)

"""vLLM drop-in (issue "vLLM drop-in", item 4): adapters.torch accepts every
public parameter of the vLLM functions it replaces, by position and by name,
with vLLM's defaults; and a smoke test per function calls ours the way vLLM's
callers do (small CPU tensors under the interpreter, or the GPU) and checks the
result against our float64 references.

VLLM_SIGNATURES records vLLM's public signatures as data (read from vLLM's
sources, cited per entry; no vLLM import, no vLLM code). The rules
(signature_differences):
  - a positional-or-keyword parameter of vLLM's at index i is ours at index i,
    with the same name and kind positional-or-keyword (so a positional call and a
    keyword call both reach it);
  - a keyword-only parameter of vLLM's is ours by name (keyword-only, or
    positional-or-keyword after vLLM's positional ones);
  - where vLLM has a default, ours has the same default; a parameter vLLM
    requires may have a default in ours (every vLLM call passes it);
  - our extra parameters all have defaults (a vLLM call never passes them).
Cases that do not match yet are marked xfail(strict=True) naming what is
missing, so they fail as soon as the adapter matches (then drop the mark).
"""
from __future__ import annotations

import dataclasses
import inspect
import math

import numpy as np
import pytest
import torch

from core_kernels.blocksparse_attention import (blocksparse_attention_reference, crow_col_to_dense,
                                                formula_block_mask)
from core_kernels.lightning_attention import lightning_attention_reference, linear_decode_reference
from core_kernels.merge_attn_states import merge_attn_states_reference
from core_kernels.prefix_prefill import context_attention_reference
from harness import DEVICE, assert_close, rng, to_torch, torch_to_numpy
import adapters.torch as at

REQ = inspect.Parameter.empty          # no default: the caller must pass it
POK = "positional_or_keyword"
KWO = "keyword_only"
_KINDS = {inspect.Parameter.POSITIONAL_OR_KEYWORD: POK, inspect.Parameter.KEYWORD_ONLY: KWO,
          inspect.Parameter.POSITIONAL_ONLY: "positional_only",
          inspect.Parameter.VAR_POSITIONAL: "var_positional",
          inspect.Parameter.VAR_KEYWORD: "var_keyword"}


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    kind: str = POK
    default: object = REQ


@dataclasses.dataclass(frozen=True)
class VllmSignature:
    source: str                 # vLLM file (and the commit read) the parameters come from
    params: tuple               # Params in order; methods without ``self``


def _p(*names):
    return tuple(Param(n) for n in names)


# ------------------------------------------------------------------ vLLM's signatures (data)
VLLM_SIGNATURES = {
    "merge_attn_states": VllmSignature(
        "vllm/v1/attention/ops/merge_attn_states.py and triton_merge_attn_states.py "
        "(the older vllm/attention/ops/merge_attn_states.py, commit 0328802b, has the "
        "first six only)",
        _p("output", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse")
        + (Param("output_lse", default=None), Param("prefill_tokens_with_context", default=None),
           Param("output_scale", default=None))),
    "mask_empty_context_lse": VllmSignature(
        "vllm/v1/attention/ops/triton_merge_attn_states.py (commit 073c5a87)",
        _p("lse", "query_start_loc", "context_start_loc")),
    "context_attention_fwd": VllmSignature(
        "vllm/attention/ops/prefix_prefill.py (vLLM 0.33)",
        _p("q", "k", "v", "o", "kv_cache_dtype", "k_cache", "v_cache", "b_loc", "b_start_loc",
           "b_seq_len", "max_seq_len", "max_input_len", "k_scale", "v_scale")
        + (Param("alibi_slopes", default=None), Param("sliding_window", default=None),
           Param("sm_scale", default=None), Param("skip_decode", default=False),
           Param("fp8_out_scale", default=None), Param("sinks", default=None),
           Param("is_block_table_ptr", default=False),
           Param("interleaved_v_pack_factor", default=0), Param("causal", default=True))),
    "reshape_and_cache_flash": VllmSignature(
        "vllm/v1/attention/ops/triton_reshape_and_cache_flash.py, triton_reshape_and_cache_flash "
        "(vLLM 0.33; the CUDA op reshape_and_cache_flash takes the same arguments)",
        _p("key", "value", "key_cache", "value_cache", "slot_mapping", "kv_cache_dtype", "k_scale",
           "v_scale")),
    "unified_attention": VllmSignature(
        "vllm/v1/attention/ops/triton_unified_attention.py (vLLM 0.33, commit ced6857a; later "
        "commits append raw_k / raw_v, which ours takes after these). kv_quant_mode's default is "
        "KVQuantMode.NONE, an IntEnum equal to 0: ours is the int 0",
        _p("q", "k", "v", "out", "cu_seqlens_q", "max_seqlen_q", "seqused_k", "max_seqlen_k",
           "softmax_scale", "causal", "window_size", "block_table", "softcap", "q_descale",
           "k_descale", "v_descale")
        + tuple(Param(n, default=None) for n in (
            "seq_threshold_3D", "num_par_softmax_segments", "softmax_segm_output", "softmax_segm_max",
            "softmax_segm_expsum", "alibi_slopes", "output_scale", "qq_bias", "sinks",
            "mm_prefix_range", "rswa_prefix_lens", "rswa_window"))
        + (Param("use_alibi_sqrt", default=False), Param("kv_quant_mode", default=0),
           Param("k_scale_cache", default=None), Param("v_scale_cache", default=None),
           Param("chunk_lookback", default=-1), Param("use_td", default=False),
           Param("mm_prefix_clamp_sliding_window", default=False))),
    "lightning_attention": VllmSignature(
        "vllm/model_executor/layers/lightning_attn.py (commit 030ea52e)",
        _p("q", "k", "v", "ed")
        + (Param("block_size", default=256), Param("kv_history", default=None))),
    "linear_decode_forward_triton": VllmSignature(
        "vllm/model_executor/layers/lightning_attn.py (commit 030ea52e)",
        _p("q", "k", "v", "kv_caches", "slope_rate", "slot_idx") + (Param("BLOCK_SIZE", default=32),)),
    "blocksparse_flash_attn_varlen_fwd": VllmSignature(
        "vllm/attention/ops/blocksparse_attention/blocksparse_attention_kernel.py",
        _p("q", "k", "v", "cu_seqlens_k", "cu_seqlens_q", "sm_scale", "sparse_layout")
        + (Param("block_size", KWO, 64), Param("q_block_size", KWO, None),
           Param("max_seqlen", KWO, None))),
    "get_sparse_attn_mask": VllmSignature(
        "vllm/attention/ops/blocksparse_attention/utils.py (commit 00e3ddc5)",
        _p("n_heads", "q_len", "max_seqlen", "dtype", "device")
        + (Param("block_size", default=64), Param("local_blocks", default=4),
           Param("vert_stride", default=4), Param("homo_head", default=True),
           Param("return_dense", default=False), Param("dense_mask_type", default="binary"))),
    "get_head_sliding_step": VllmSignature(
        "vllm/attention/ops/blocksparse_attention/utils.py (commit 00e3ddc5)",
        _p("n_heads", "vert_stride") + (Param("homo_head", default=False),)),
    "LocalStridedBlockSparseAttn.__init__": VllmSignature(
        "vllm/attention/ops/blocksparse_attention/interface.py (commit 0531c222)",
        _p("n_heads", "max_seqlen", "local_blocks", "vert_stride", "block_size")
        + tuple(Param(n, default=None) for n in ("device", "dtype"))
        + (Param("homo_head", default=False),)
        + tuple(Param(n, default=None) for n in ("active_head_range", "q_block_size", "use_spda"))),
    "LocalStridedBlockSparseAttn.forward": VllmSignature(
        "vllm/attention/ops/blocksparse_attention/interface.py (commit 0531c222)",
        _p("q", "k", "v", "cu_seqlens_k")
        + (Param("cu_seqlens_q", default=None), Param("sm_scale", default=None))),
}

# Cases that do not match adapters.torch yet: {name: what is missing}; each is
# marked xfail(strict=True), so it fails as soon as it matches (then delete its
# entry). Empty since 2026-11-24, 01:52 UTC: get_sparse_attn_mask,
# get_head_sliding_step and LocalStridedBlockSparseAttn.__init__ (use_spda),
# entered at 01:35, matched once the block-sparse adapter landed vLLM's signatures.
NOT_YET: dict[str, str] = {}


def ours(name):
    """The adapters.torch callable recorded under ``name`` (None if absent)."""
    obj = at
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _same_default(a, b) -> bool:
    return type(a) is type(b) and a == b


def signature_differences(fn, vllm: VllmSignature) -> list[str]:
    """What keeps ``fn`` from accepting every call vLLM's signature allows."""
    if fn is None:
        return ["missing: no such function in adapters.torch"]
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    by_name = {p.name: (i, p) for i, p in enumerate(params)}
    diffs = []
    n_pos = sum(1 for p in vllm.params if p.kind == POK)
    for i, want in enumerate(vllm.params):
        if want.name not in by_name:
            diffs.append(f"{want.name}: missing (vLLM: {want.kind}"
                         + ("" if want.default is REQ else f", default {want.default!r}") + ")")
            continue
        j, got = by_name[want.name]
        kind = _KINDS[got.kind]
        if want.kind == POK:
            if j != i:
                diffs.append(f"{want.name}: at position {j}, vLLM's is {i}")
            if kind != POK:
                diffs.append(f"{want.name}: {kind}, vLLM's is {POK}")
        elif kind == POK and j < n_pos:
            diffs.append(f"{want.name}: positional at {j}, where vLLM has {vllm.params[j].name}")
        elif kind not in (POK, KWO):
            diffs.append(f"{want.name}: {kind}, vLLM's is {want.kind}")
        if want.default is not REQ and not _same_default(got.default, want.default):
            have = "none" if got.default is REQ else repr(got.default)
            diffs.append(f"{want.name}: default {have}, vLLM's is {want.default!r}")
    known = {p.name for p in vllm.params}
    for p in params:
        if p.name in known:
            continue
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if p.default is REQ:
            diffs.append(f"{p.name}: extra parameter without a default (vLLM callers never pass it)")
    return diffs


def _cases():
    for name in VLLM_SIGNATURES:
        marks = ([pytest.mark.xfail(strict=True, reason=NOT_YET[name])] if name in NOT_YET else [])
        yield pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", list(_cases()))
def test_signature_matches_vllm(name):
    diffs = signature_differences(ours(name), VLLM_SIGNATURES[name])
    assert not diffs, (f"adapters.torch.{name} vs vLLM ({VLLM_SIGNATURES[name].source}):\n  "
                       + "\n  ".join(diffs))


def test_signature_checker_reports_precisely():
    """The checker names each kind of difference (so the report above is exact)."""
    vllm = VllmSignature("test", _p("a", "b") + (Param("c", default=1), Param("d", KWO, None)))

    def moved(b, a, c=1, *, d=None): ...
    def default(a, b, c=2, *, d=None): ...
    def keyword(a, *, b, c=1, d=None): ...
    def missing(a, b, c=1): ...
    def extra(a, b, c=1, e=None, *, d=None, f): ...
    def good(a, b=0, c=1, *, d=None, config=None): ...
    def good_positional_d(a, b, c=1, d=None): ...
    assert signature_differences(moved, vllm) == ["a: at position 1, vLLM's is 0",
                                                  "b: at position 0, vLLM's is 1"]
    assert signature_differences(default, vllm) == ["c: default 2, vLLM's is 1"]
    assert signature_differences(keyword, vllm) == [f"b: {KWO}, vLLM's is {POK}",
                                                    f"c: {KWO}, vLLM's is {POK}"]
    assert signature_differences(missing, vllm) == [f"d: missing (vLLM: {KWO}, default None)"]
    assert signature_differences(extra, vllm) == [
        "f: extra parameter without a default (vLLM callers never pass it)"]
    assert signature_differences(good, vllm) == []
    assert signature_differences(good_positional_d, vllm) == []
    assert signature_differences(None, vllm) == ["missing: no such function in adapters.torch"]


def requires_match(*names):
    """Skip a smoke test while any of ``names`` does not match vLLM's signature
    (the signature test above reports, or xfails, those)."""
    diffs = [f"{n}: {'; '.join(d)}" for n in names
             for d in [signature_differences(ours(n), VLLM_SIGNATURES[n])] if d]
    return pytest.mark.skipif(bool(diffs), reason="signature does not match vLLM's yet: "
                              + " | ".join(diffs))


def check(actual, expected, what, scale=1.0):
    e = np.asarray(expected, np.float64)
    a = np.asarray(actual, np.float64)
    r = float(np.sqrt(np.mean(e ** 2))) or 1.0
    assert_close(a / r, e / r, "float32", what, scale * (250.0 if DEVICE == "cuda" else 1.0))


def _f32(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------ smoke: merge_attn_states
@requires_match("merge_attn_states")
@pytest.mark.parametrize("with_lse", [False, True])
def test_smoke_merge_attn_states(with_lse):
    """vLLM's attention backends: merge_attn_states(output, prefix_output,
    prefix_lse, suffix_output, suffix_lse[, output_lse]) positionally, in place."""
    g = rng()
    n, h, d = 7, 3, 16
    po, so = _f32(g, n, h, d), _f32(g, n, h, d)
    pl, sl = _f32(g, h, n), _f32(g, h, n)
    out = torch.full((n, h, d), float("nan"), device=DEVICE)
    out_lse = torch.full((h, n), float("nan"), device=DEVICE)
    args = [out, to_torch(po), to_torch(pl), to_torch(so), to_torch(sl)]
    assert at.merge_attn_states(*args, *([out_lse] if with_lse else [])) is None
    ref_out, ref_lse = merge_attn_states_reference(po, pl, so, sl)
    check(torch_to_numpy(out), ref_out, "output")
    if with_lse:
        check(torch_to_numpy(out_lse), ref_lse, "output_lse")


# ------------------------------------------------------------------ smoke: context_attention_fwd
def _prefix_case(g, ctx_lens, q_lens, hq=4, hkv=2, d=32, bs=16, x=4):
    """Packed new tokens over a paged cache in vLLM's layouts (fp32)."""
    b = len(ctx_lens)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    max_blocks = max(math.ceil(s / bs) for s in seq_lens)
    num_blocks = b * max_blocks + 3
    table = g.permutation(num_blocks)[:b * max_blocks].reshape(b, max_blocks).astype(np.int32)
    k_tok = [_f32(g, s, hkv, d) for s in seq_lens]      # every token's K/V, context and new
    v_tok = [_f32(g, s, hkv, d) for s in seq_lens]
    kc = np.zeros((num_blocks, hkv, d // x, bs, x), np.float32)
    vc = np.zeros((num_blocks, hkv, d, bs), np.float32)
    for i, s in enumerate(seq_lens):
        for t in range(s):
            blk, off = table[i, t // bs], t % bs
            kc[blk, :, :, off, :] = k_tok[i][t].reshape(hkv, d // x, x)
            vc[blk, :, :, off] = v_tok[i][t]
    q = _f32(g, sum(q_lens), hq, d)
    k = np.concatenate([kt[c:] for kt, c in zip(k_tok, ctx_lens)])
    v = np.concatenate([vt[c:] for vt, c in zip(v_tok, ctx_lens)])
    start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return dict(q=q, k=k, v=v, k_cache=kc, v_cache=vc, b_loc=table, b_start_loc=start,
                b_seq_len=np.array(seq_lens, np.int32), max_seq_len=max(seq_lens),
                max_input_len=max(q_lens))


@requires_match("context_attention_fwd")
@pytest.mark.parametrize("form", ["chunked_prefill_paged_decode", "positional"])
def test_smoke_context_attention_fwd(form):
    """vLLM's chunked_prefill_paged_decode calls it by keyword (skip_decode=True,
    fp8_out_scale, sinks); older PagedAttention.forward_prefix positionally in
    the same parameter order. Sequences: prefill over context, fresh prefill, decode."""
    g = rng()
    c = _prefix_case(g, ctx_lens=[20, 0, 33], q_lens=[9, 12, 1])
    t = {n: to_torch(c[n]) for n in ("q", "k", "v", "k_cache", "v_cache", "b_loc", "b_start_loc",
                                     "b_seq_len")}
    o = torch.full(c["q"].shape, float("nan"), device=DEVICE)
    one = torch.ones(1, dtype=torch.float32, device=DEVICE)
    sm_scale = 0.3
    if form == "positional":
        at.context_attention_fwd(t["q"], t["k"], t["v"], o, "auto", t["k_cache"], t["v_cache"],
                                 t["b_loc"], t["b_start_loc"], t["b_seq_len"], c["max_seq_len"],
                                 c["max_input_len"], one, one, None, None, sm_scale)
        skip = False
    else:
        at.context_attention_fwd(q=t["q"], k=t["k"], v=t["v"], o=o, kv_cache_dtype="auto",
                                 k_cache=t["k_cache"], v_cache=t["v_cache"], b_loc=t["b_loc"],
                                 b_start_loc=t["b_start_loc"], b_seq_len=t["b_seq_len"],
                                 max_seq_len=c["max_seq_len"], max_input_len=c["max_input_len"],
                                 k_scale=one, v_scale=one, alibi_slopes=None, sliding_window=None,
                                 sm_scale=sm_scale, skip_decode=True, fp8_out_scale=None, sinks=None)
        skip = True
    ref = context_attention_reference(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["b_loc"],
                                      c["b_start_loc"], c["b_seq_len"], sm_scale=sm_scale,
                                      skip_decode=skip)
    out = torch_to_numpy(o)
    rows = ~np.isnan(ref).any(axis=(1, 2))          # skip_decode leaves the decode row alone
    assert rows.sum() == (21 if skip else 22)
    check(out[rows], ref[rows], "output")
    if skip:
        assert np.isnan(out[~rows]).all(), "skip_decode: the decode row must not be written"


# ------------------------------------------------------------------ smoke: unified_attention
@requires_match("unified_attention")
def test_smoke_unified_attention():
    """vLLM's TRITON_ATTN backend (TritonAttentionImpl.forward): every argument by
    keyword, out a slice of the padded output, k_descale / v_descale the layer's
    1-element scales expanded to [B, Hkv] (stride 0) for a plain bf16/fp32 cache, the
    split-softmax scratch passed; a batch of prefill, decode and chunked-prefill rows."""
    from core_kernels.unified_attention import unified_attention_reference
    from test_unified_attention import make_case
    c = make_case([(9, 20), (1, 33), (12, 0)], 4, 2, 32, 16, "float32")
    t = {n: to_torch(c[n]) for n in ("q", "k", "v", "cu_seqlens_q", "seqused_k", "block_table")}
    padded = torch.full((c["q"].shape[0] + 5, 4, 32), float("nan"), device=DEVICE)
    scale = torch.ones((), device=DEVICE)
    b = c["seqused_k"].shape[0]
    at.unified_attention(
        q=t["q"], k=t["k"], v=t["v"], out=padded[:c["q"].shape[0]], cu_seqlens_q=t["cu_seqlens_q"],
        max_seqlen_q=c["max_seqlen_q"], seqused_k=t["seqused_k"], max_seqlen_k=c["max_seqlen_k"],
        softmax_scale=0.3, causal=True, alibi_slopes=None, use_alibi_sqrt=False, window_size=(-1, -1),
        block_table=t["block_table"], softcap=0, q_descale=None, k_descale=scale.expand(b, 2),
        v_descale=scale.expand(b, 2), seq_threshold_3D=8, num_par_softmax_segments=16,
        softmax_segm_output=torch.empty(8, 4, 16, 32, device=DEVICE),
        softmax_segm_max=torch.empty(8, 4, 16, device=DEVICE),
        softmax_segm_expsum=torch.empty(8, 4, 16, device=DEVICE), sinks=None, output_scale=None,
        mm_prefix_range=None, kv_quant_mode=0)
    ref = unified_attention_reference(*(c[n] for n in ("q", "k", "v", "cu_seqlens_q", "seqused_k",
                                                      "block_table")), softmax_scale=0.3)
    out = torch_to_numpy(padded)
    check(out[:-5], ref, "output")
    assert np.isnan(out[-5:]).all(), "rows past out's slice must not be written"


# ------------------------------------------------------------------ smoke: lightning
@requires_match("lightning_attention")
def test_smoke_lightning_attention():
    """vLLM's MiniMax layer (jit_linear_forward_prefix): one sequence [1, H, N, D],
    the [H, 1, 1] slope tensor, block_size by keyword, a cache slot as
    kv_history [1, H, D, D]; and its kernel tests' positional
    lightning_attention(q, k, v, ed, 256, kv_history) with an [H] ed."""
    g = rng()
    h, n, d = 4, 70, 16
    q, k, v = (_f32(g, 1, h, n, d) for _ in range(3))
    ed = g.uniform(0.01, 1.0, h).astype(np.float32)
    kvh = _f32(g, 1, h, d, d)
    ref_out, ref_kv = lightning_attention_reference(q, k, v, ed, 256, kvh)
    for out, kv in (
            at.lightning_attention(to_torch(q), to_torch(k), to_torch(v), to_torch(ed.reshape(h, 1, 1)),
                                   block_size=256, kv_history=to_torch(kvh)),
            at.lightning_attention(to_torch(q), to_torch(k), to_torch(v), to_torch(ed), 256,
                                   to_torch(kvh))):
        assert tuple(kv.shape) == (1, h, 2, d, d)
        check(torch_to_numpy(out), ref_out, "output")
        check(torch_to_numpy(kv[:, :, -1]), ref_kv[:, :, -1], "final state")


@requires_match("linear_decode_forward_triton")
def test_smoke_linear_decode_forward_triton():
    """vLLM's MiniMax layer: linear_decode_forward_triton(q, k, v, kv_cache,
    tp_slope, slot_id, 32) with the [H, 1, 1] slope and int32 slots (-1 padding)."""
    g = rng()
    b, h, d, slots_n = 3, 4, 32, 5
    q, k, v = (_f32(g, b, h, 1, d) for _ in range(3))
    cache = _f32(g, slots_n, h, d, d)
    slope = g.uniform(0.01, 1.0, h).astype(np.float32)
    slots = np.array([4, -1, 1], np.int32)
    ct = to_torch(cache)
    out = at.linear_decode_forward_triton(to_torch(q), to_torch(k), to_torch(v), ct,
                                          to_torch(slope.reshape(h, 1, 1)), to_torch(slots), 32)
    ref_out, ref_cache = linear_decode_reference(q, k, v, cache, slope, slots)
    assert tuple(out.shape) == (b, h * d)
    check(torch_to_numpy(out), ref_out, "output")
    check(torch_to_numpy(ct), ref_cache, "cache")


# ------------------------------------------------------------------ smoke: block-sparse
def _layout(block_mask):
    """(crow [H, NB + 1], col [H, max_nnz] padded with -1) int32 of a bool [H, NB, NB] mask."""
    h, nb, _ = block_mask.shape
    crow = np.zeros((h, nb + 1), np.int32)
    cols = []
    for i in range(h):
        c = [np.flatnonzero(block_mask[i, r]) for r in range(nb)]
        crow[i, 1:] = np.cumsum([len(x) for x in c])
        cols.append(np.concatenate(c))
    col = np.full((h, max(len(x) for x in cols)), -1, np.int32)
    for i, x in enumerate(cols):
        col[i, :len(x)] = x
    return crow, col


def _bs_batch(g, lens, hq, hkv, d):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    t = int(cu[-1])
    return _f32(g, t, hq, d), _f32(g, t, hkv, d), _f32(g, t, hkv, d), cu


@requires_match("blocksparse_flash_attn_varlen_fwd")
def test_smoke_blocksparse_flash_attn_varlen_fwd():
    """LocalStridedBlockSparseAttn.varlen_attn's call: blocksparse_flash_attn_varlen_fwd(
    q, k, v, cu_seqlens_k, cu_seqlens_q, sm_scale, sparse_layout, block_size=...,
    q_block_size=..., max_seqlen=...) with a per-head (crow, col) layout."""
    g = rng()
    hq, hkv, d, bs, local, stride, max_seqlen = 4, 2, 32, 16, 2, 3, 96
    nb = max_seqlen // bs
    mask = formula_block_mask(hq, nb, local, stride, homo_head=False)
    crow, col = _layout(mask)
    q, k, v, cu = _bs_batch(g, [90, 50], hq, hkv, d)
    out = at.blocksparse_flash_attn_varlen_fwd(
        to_torch(q), to_torch(k), to_torch(v), to_torch(cu), to_torch(cu), 0.25,
        (to_torch(crow), to_torch(col)), block_size=bs, q_block_size=None, max_seqlen=max_seqlen)
    ref = blocksparse_attention_reference(q, k, v, cu, cu, mask, block_size=bs, sm_scale=0.25)
    check(torch_to_numpy(out), ref, "output")


@requires_match("get_head_sliding_step")
def test_smoke_get_head_sliding_step():
    for n_heads, vert_stride in [(4, 8), (8, 4), (3, 7), (1, 1)]:
        assert at.get_head_sliding_step(n_heads, vert_stride) == max(1, vert_stride // n_heads)
        assert at.get_head_sliding_step(n_heads, vert_stride, True) == 0
        assert at.get_head_sliding_step(n_heads, vert_stride, False) == max(1, vert_stride // n_heads)


@requires_match("get_sparse_attn_mask")
@pytest.mark.parametrize("homo_head", [True, False])
def test_smoke_get_sparse_attn_mask(homo_head):
    """LocalStridedBlockSparseAttn.get_attn_pattern's call: get_sparse_attn_mask(
    n_heads, max_seqlen, max_seqlen, dtype, device, block_size=, local_blocks=,
    vert_stride=, homo_head=, return_dense=False, dense_mask_type="bias") ->
    ((crow, col), block mask [., NB, NB], None)."""
    n_heads, max_seqlen, bs, local, stride = 4, 100, 16, 2, 3
    nb = -(-max_seqlen // bs)
    (crow, col), block_mask, dense = at.get_sparse_attn_mask(
        n_heads, max_seqlen, max_seqlen, torch.float32, torch.device(DEVICE), block_size=bs,
        local_blocks=local, vert_stride=stride, homo_head=homo_head, return_dense=False,
        dense_mask_type="bias")
    assert dense is None
    want = formula_block_mask(n_heads, nb, local, stride, homo_head=homo_head)
    got = crow_col_to_dense(torch_to_numpy(crow), torch_to_numpy(col), nb)
    assert got.shape[0] in (1, n_heads)
    assert (np.broadcast_to(got, want.shape) == want).all(), "CSR layout"
    bm = torch_to_numpy(block_mask).astype(bool)
    assert (np.broadcast_to(bm, want.shape) == want).all(), "block mask"


@requires_match("LocalStridedBlockSparseAttn.__init__", "LocalStridedBlockSparseAttn.forward")
@pytest.mark.parametrize("form", ["keywords", "positional"])
def test_smoke_local_strided_block_sparse_attn(form):
    """vLLM's block-sparse backend builds LocalStridedBlockSparseAttn(n_heads,
    max_seqlen, local_blocks, vert_stride, block_size, homo_head=,
    active_head_range=) and calls it (q=, k=, v=, cu_seqlens_q=, cu_seqlens_k=,
    sm_scale=); also the positional forms of both."""
    g = rng()
    hq, hkv, d, bs, local, stride, max_seqlen = 4, 2, 32, 16, 2, 3, 96
    q, k, v, cu = _bs_batch(g, [90, 50], hq, hkv, d)
    dev, dt = torch.device(DEVICE), torch.float32
    if form == "keywords":
        attn = at.LocalStridedBlockSparseAttn(hq, max_seqlen, local, stride, bs, device=dev, dtype=dt,
                                              homo_head=False, active_head_range=None)
        out = attn(q=to_torch(q), k=to_torch(k), v=to_torch(v), cu_seqlens_q=to_torch(cu),
                   cu_seqlens_k=to_torch(cu), sm_scale=0.25)
    else:
        attn = at.LocalStridedBlockSparseAttn(hq, max_seqlen, local, stride, bs, dev, dt, False)
        out = attn(to_torch(q), to_torch(k), to_torch(v), to_torch(cu), to_torch(cu), 0.25)
    mask = formula_block_mask(hq, max_seqlen // bs, local, stride, homo_head=False)
    ref = blocksparse_attention_reference(q, k, v, cu, cu, mask, block_size=bs, sm_scale=0.25)
    check(torch_to_numpy(out), ref, "output")

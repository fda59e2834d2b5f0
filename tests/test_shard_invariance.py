"""Shard invariance: a (sequence, head) row's result never depends on which other
sequences or heads share the call.

For every op, both adapters: one call with H heads equals two calls with H/2 heads,
and one call over a batch equals one call per half of it, bit for bit; gradients
too where the op has a backward. Merge, lightning decode and block-sparse prefill
are invariant as they are; lightning prefill / varlen, block-sparse decode and
prefix prefill with ``batch_invariant=True`` (their defaults follow the grid: see
the INVARIANT NOTEs in their plans). The plan tests check, without kernels, that a
batch-invariant plan's arithmetic (kernel, tiles, segment boundaries, splits) does
not change with B, H or the GPU's size, for the GPU's kernels too, and that the
default plans do (so the tests can fail). Under the interpreter the products are
exact fp32; the GPU run of this file (scripts/gpu.sh) checks the kernels' own bits.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import adapters.torch as at
from core_kernels._plan import ArrayInfo
from core_kernels._target import Target
from core_kernels.blocksparse_attention import build_sparse_layout
from core_kernels.blocksparse_attention.plan import choose_config
from core_kernels.lightning_attention import (plan_lightning_attention, plan_lightning_attention_backward,
                                              plan_lightning_attention_varlen,
                                              plan_lightning_attention_varlen_backward, prefill_plan)
from core_kernels.prefix_prefill import PrefixPrefillConfig, plan_prefix_prefill
from harness import ADAPTERS, GPU, assert_bitwise_equal, jax_to_numpy, poison_like, to_jax, to_torch, torch_to_numpy
from test_blocksparse_attention import make_batch
from test_lightning_attention import make_decode, make_prefill
from test_lightning_varlen import make_varlen
from test_merge_attn_states import make_inputs
from test_prefix_prefill import ARRAYS, make_case

DTYPES = ["float32", "bfloat16"] if GPU else ["float32"]
H200 = Target("cuda", 90, 132, gluon=True)


def _np(x, fw):
    return torch_to_numpy(x) if fw == "torch" else jax_to_numpy(x)


def _arr(x, fw):
    return None if x is None else (to_torch(x) if fw == "torch" else to_jax(x))


def _same(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        assert_bitwise_equal(x, y, f"{what} [{i}]")


def _cat(parts, axis):
    """Per-result concatenation of the halves' results along ``axis`` (an int or one per result)."""
    axes = axis if isinstance(axis, tuple) else (axis,) * len(parts[0])
    return [np.concatenate([p[i] for p in parts], axis=a) for i, a in enumerate(axes)]


@pytest.fixture
def short_segments(monkeypatch):
    """Batch-invariant lightning plans cut rows every 64 tokens (as every 8192 on the
    GPU), so that test-sized rows run segmented; every plan cache is emptied around it."""
    from adapters.torch import _call_memo, _executor

    def clear():
        for planner in (plan_lightning_attention, plan_lightning_attention_backward,
                        plan_lightning_attention_varlen, plan_lightning_attention_varlen_backward):
            planner.cache_clear()
        _executor._PLANS.clear()
        for memo in _call_memo._MEMOS:
            memo.entries.clear()
            memo.seen.clear()

    clear()
    monkeypatch.setattr(prefill_plan, "INVARIANT_SEGMENT_TOKENS", 64)
    yield
    monkeypatch.undo()
    clear()


# ------------------------------------------------------------------ merge_attn_states
def _merge(fw, po, pl, so, sl):
    """(output [N, H, D], output LSE [H, N])."""
    if fw == "torch":
        out, lse = torch.empty_like(to_torch(po)), torch.empty_like(to_torch(pl))
        at.merge_attn_states(out, *map(to_torch, (po, pl, so, sl)), output_lse=lse)
        return [torch_to_numpy(out), torch_to_numpy(lse)]
    import adapters.jax as aj
    return [jax_to_numpy(x) for x in aj.merge_attn_states(*map(to_jax, (po, pl, so, sl)))]


@pytest.mark.parametrize("fw", ADAPTERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge(fw, dtype):
    po, pl, so, sl = make_inputs(9, 4, 40, dtype)
    whole = _merge(fw, po, pl, so, sl)
    heads = [_merge(fw, po[:, s], pl[s], so[:, s], sl[s]) for s in (slice(0, 2), slice(2, 4))]
    _same(whole, _cat(heads, (1, 0)), "heads")
    tokens = [_merge(fw, po[s], pl[:, s], so[s], sl[:, s]) for s in (slice(0, 4), slice(4, 9))]
    _same(whole, _cat(tokens, (0, 1)), "tokens")


# ------------------------------------------------------------------ lightning prefill (and its backward)
def _prefill(fw, q, k, v, ed, kvh, grad_ed):
    """(output, kv) and the gradients of q, k, v, kv_history (and ed) of a fixed loss."""
    block = 16
    if fw == "torch":
        args = [to_torch(x).requires_grad_(True) for x in (q, k, v, kvh)]
        ted = to_torch(ed).requires_grad_(grad_ed)
        o, kv = at.lightning_attention(*args[:3], ted, block, args[3], batch_invariant=True)
        (o.square().sum() + kv.sum()).backward()
        grads = [a.grad for a in args] + ([ted.grad] if grad_ed else [])
        return [torch_to_numpy(x) for x in [o, kv] + grads]
    import jax
    import adapters.jax as aj

    def loss(q, k, v, kvh, ed):
        o, kv = aj.lightning_attention(q, k, v, ed, block, kvh, batch_invariant=True)
        return (o.astype("float32") ** 2).sum() + kv.sum(), (o, kv)

    argnums = (0, 1, 2, 3, 4) if grad_ed else (0, 1, 2, 3)
    grads, (o, kv) = jax.grad(loss, argnums, has_aux=True)(*map(to_jax, (q, k, v, kvh, ed)))
    return [jax_to_numpy(x) for x in (o, kv, *grads)]


@pytest.mark.parametrize("fw", ADAPTERS)
@pytest.mark.parametrize("grad_ed", [False, True], ids=["forward-form-backward", "scan-backward"])
def test_lightning_prefill(fw, grad_ed, short_segments):
    """Rows of 80 tokens, segments every 64 (2 per row); heads halves, and batch
    halves (d ed sums over the batch: heads only with it)."""
    q, k, v, ed, kvh = make_prefill(2, 2, 80, 16, 16, "float32")
    whole = _prefill(fw, q, k, v, ed, kvh, grad_ed)
    heads = [_prefill(fw, q[:, s], k[:, s], v[:, s], ed[s], kvh[:, s], grad_ed) for s in (slice(0, 1), slice(1, 2))]
    _same(whole, _cat(heads, 1 if not grad_ed else (1,) * 6 + (0,)), "heads")
    if not grad_ed:
        rows = [_prefill(fw, q[s], k[s], v[s], ed, kvh[s], False) for s in (slice(0, 1), slice(1, 2))]
        _same(whole, _cat(rows, 0), "batch rows")


# ------------------------------------------------------------------ lightning decode
def _decode(fw, q, k, v, cache, slope, slots):
    if fw == "torch":
        tc = to_torch(cache)
        out = at.linear_decode_forward_triton(*map(to_torch, (q, k, v)), tc, to_torch(slope), to_torch(slots))
        return [torch_to_numpy(out), torch_to_numpy(tc)]
    import adapters.jax as aj
    out, new = aj.linear_decode_forward_triton(*map(to_jax, (q, k, v, cache, slope, slots)))
    return [jax_to_numpy(out), jax_to_numpy(new)]


@pytest.mark.parametrize("fw", ADAPTERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lightning_decode(fw, dtype):
    q, k, v, cache, slope = make_decode(4, 4, 16, 6, dtype)
    slots = np.array([3, 0, -1, 5], np.int32)
    whole = _decode(fw, q, k, v, cache, slope, slots)
    halves = [_decode(fw, q[:, s], k[:, s], v[:, s], np.ascontiguousarray(cache[:, s]), slope[s], slots)
              for s in (slice(0, 2), slice(2, 4))]
    out = np.concatenate([h[0].reshape(4, 2, -1) for h in halves], 1).reshape(4, -1)
    _same(whole, [out, np.concatenate([h[1] for h in halves], 1)], "heads")
    first = _decode(fw, q[:2], k[:2], v[:2], cache, slope, slots[:2])
    second = _decode(fw, q[2:], k[2:], v[2:], first[1], slope, slots[2:])  # disjoint slots
    _same(whole, [np.concatenate([first[0], second[0]]), second[1]], "rows")


# ------------------------------------------------------------------ lightning varlen (and its backward)
def _varlen(fw, q, k, v, ed, cu, cache, slots):
    if fw == "torch":
        tc = None if cache is None else to_torch(cache)
        args = [to_torch(x).requires_grad_(cache is None) for x in (q, k, v)]
        o, kv = at.lightning_attention_varlen(*args, to_torch(ed), to_torch(cu), kv_cache=tc,
                                              slot_idx=_arr(slots, fw), batch_invariant=True)
        if cache is not None:
            return [torch_to_numpy(o), torch_to_numpy(kv)]
        (o.square().sum() + kv.sum()).backward()
        return [torch_to_numpy(x) for x in (o, kv, *(a.grad for a in args))]
    import jax
    import adapters.jax as aj

    def loss(q, k, v):
        o, kv = aj.lightning_attention_varlen(q, k, v, to_jax(ed), to_jax(cu), kv_cache=_arr(cache, fw),
                                              slot_idx=_arr(slots, fw), batch_invariant=True)
        return (o ** 2).sum() + kv.sum(), (o, kv)

    if cache is not None:
        return [jax_to_numpy(x) for x in loss(*map(to_jax, (q, k, v)))[1]]
    grads, (o, kv) = jax.grad(loss, (0, 1, 2), has_aux=True)(*map(to_jax, (q, k, v)))
    return [jax_to_numpy(x) for x in (o, kv, *grads)]


@pytest.mark.parametrize("fw", ADAPTERS)
@pytest.mark.parametrize("cached", [False, True], ids=["states+backward", "cache"])
def test_lightning_varlen(fw, cached):
    lens = [5, 30, 0, 9]
    q, k, v, ed, cu, cache = make_varlen(lens, 4, 16, 16, "float32", num_slots=5 if cached else 0)
    slots = np.array([4, 0, -1, 2], np.int32) if cached else None
    whole = _varlen(fw, q, k, v, ed, cu, cache, slots)
    part = lambda x, s: None if x is None else np.ascontiguousarray(x[:, s])  # noqa: E731
    heads = [_varlen(fw, q[:, s], k[:, s], v[:, s], ed[s], cu, part(cache, s), slots)
             for s in (slice(0, 2), slice(2, 4))]
    _same(whole, _cat(heads, 1), "heads")
    # sequences 0-1 and 2-3, each packed from token 0 (another offset than in the whole batch)
    t = int(cu[2])
    first = _varlen(fw, q[:t], k[:t], v[:t], ed, cu[:3], cache, None if slots is None else slots[:2])
    second = _varlen(fw, q[t:], k[t:], v[t:], ed, cu[2:] - t,
                     first[1] if cached else None, None if slots is None else slots[2:])
    if cached:
        _same(whole, [np.concatenate([first[0], second[0]]), second[1]], "sequences")
    else:
        _same(whole, _cat([first, second], 0), "sequences")


# ------------------------------------------------------------------ block-sparse (prefill, backward, decode)
def _blocksparse(fw, q, k, v, cu_k, cu_q, crow, col, grad):
    kw = dict(block_size=16, max_seqlen=64, batch_invariant=True)
    if fw == "torch":
        args = [to_torch(x).requires_grad_(grad) for x in (q, k, v)]
        out = at.blocksparse_flash_attn_varlen_fwd(*args, to_torch(cu_k), _arr(cu_q, fw), 0.3,
                                                   (to_torch(crow), to_torch(col)), **kw)
        if not grad:
            return [torch_to_numpy(out)]
        out.square().sum().backward()
        return [torch_to_numpy(x) for x in (out, *(a.grad for a in args))]
    import jax
    import adapters.jax as aj

    def loss(q, k, v):
        out = aj.blocksparse_flash_attn_varlen_fwd(q, k, v, to_jax(cu_k), _arr(cu_q, fw), 0.3,
                                                   (to_jax(crow), to_jax(col)), **kw)
        return (out ** 2).sum(), out

    if not grad:
        return [jax_to_numpy(loss(*map(to_jax, (q, k, v)))[1])]
    grads, out = jax.grad(loss, (0, 1, 2), has_aux=True)(*map(to_jax, (q, k, v)))
    return [jax_to_numpy(x) for x in (out, *grads)]


@pytest.mark.parametrize("fw", ADAPTERS)
@pytest.mark.parametrize("mode", ["prefill+backward", "decode"])
def test_blocksparse(fw, mode):
    """4 query / 2 KV heads, a per-head layout (vertical stride offset by head)."""
    (crow, col), _ = build_sparse_layout(4, 64, 16, 1, 2, False)
    lens = [24, 19] if mode == "prefill+backward" else [40, 25, 64]
    decode = mode == "decode"
    q, k, v, cu_k, cu_q = make_batch(lens, None if decode else lens, 4, 2, 16, "float32")
    grad = not decode
    whole = _blocksparse(fw, q, k, v, cu_k, cu_q, crow, col, grad)
    heads = [_blocksparse(fw, q[:, 2 * i:2 * i + 2], k[:, i:i + 1], v[:, i:i + 1], cu_k, cu_q,
                          crow[2 * i:2 * i + 2], col[2 * i:2 * i + 2], grad) for i in (0, 1)]
    _same(whole, _cat(heads, 1), "heads")
    tk, tq = int(cu_k[1]), (1 if decode else int(cu_q[1]))
    first = _blocksparse(fw, q[:tq], k[:tk], v[:tk], cu_k[:2], None if decode else cu_q[:2], crow, col, grad)
    rest_q = None if decode else cu_q[1:] - tq
    second = _blocksparse(fw, q[tq:], k[tk:], v[tk:], cu_k[1:] - tk, rest_q, crow, col, grad)
    _same(whole, _cat([first, second], 0), "sequences")


# ------------------------------------------------------------------ prefix prefill
def _prefix(fw, case, config=None):
    mil, msl = 6, 24
    if fw == "torch":
        o = to_torch(poison_like(case["q"].shape, case["q"].dtype.name))
        at.context_attention_fwd(*(to_torch(case[n]) for n in ARRAYS[:3]), o, "auto",
                                 *(to_torch(case[n]) for n in ARRAYS[3:]), msl, mil, config=config,
                                 batch_invariant=True)
        return [torch_to_numpy(o)]
    import adapters.jax as aj
    return [jax_to_numpy(aj.context_attention_fwd(*(to_jax(case[n]) for n in ARRAYS), max_input_len=mil,
                                                  max_seq_len=msl, config=config, batch_invariant=True))]


def _prefix_heads(case, s, kv):
    part = {n: np.ascontiguousarray(case[n][:, s]) for n in ("q",)}
    part.update({n: np.ascontiguousarray(case[n][:, kv]) for n in ("k", "v", "k_cache", "v_cache")})
    return {**case, **part}


def _prefix_sequences(case, seqs):
    """The case of the sequences ``seqs`` (a slice): their tokens, table rows and lengths."""
    start = case["b_start_loc"]
    t0, t1 = int(start[seqs.start]), int(start[seqs.stop])
    out = {n: case[n][t0:t1] for n in ("q", "k", "v")}
    return {**case, **out, "b_loc": case["b_loc"][seqs], "b_seq_len": case["b_seq_len"][seqs],
            "b_start_loc": (start[seqs.start:seqs.stop + 1] - t0).astype(start.dtype)}


@pytest.mark.parametrize("fw", ADAPTERS)
def test_prefix_prefill(fw):
    case = make_case([(6, 10), (1, 17), (4, 0)], 4, 2, 16, 8, 8, "float32")
    whole = _prefix(fw, case)
    heads = [_prefix(fw, _prefix_heads(case, slice(2 * i, 2 * i + 2), slice(i, i + 1))) for i in (0, 1)]
    _same(whole, _cat(heads, 1), "heads")
    seqs = [_prefix(fw, _prefix_sequences(case, s)) for s in (slice(0, 1), slice(1, 3))]
    _same(whole, _cat(seqs, 0), "sequences")


@pytest.mark.parametrize("fw", ADAPTERS)
def test_prefix_context_gathered_or_paged_alike(fw):
    """With equal tiles the gathered and the paged context give equal bits: the
    batch-invariant plans' premise (the gather decision follows the batch)."""
    case = make_case([(6, 10), (1, 17), (4, 23)], 4, 2, 16, 8, 8, "float32")
    paged, gathered = (_prefix(fw, case, PrefixPrefillConfig(16, 16, 4, 2, True, p, g))
                       for p, g in ((1, False), (0, True)))
    _same(paged, gathered, "paged vs gathered")


# ------------------------------------------------------------------ plans (GPU choices, no kernels)
def _row_arithmetic(plan):
    """What fixes a row's arithmetic in a plan: each launch's kernel, its constexprs
    (but the load ring's depth, the programs' order and the layouts' strides, which
    change no value) and the segment / split parameters."""
    keep = ("seg_chunks", "last_segment", "blocks_per_seg", "block_len", "num_blocks", "num_chunks",
            "seq_len", "seg_len")
    out = []
    for launch in plan.launches:
        consts = {n: x for n, x in launch.constexprs.items()
                  if n not in ("STAGES", "ORDER_B", "ALIGN", "LSE_OFFSET", "B_P2", "OFFS_64")
                  and not n.upper().startswith("STRIDE_")}
        params = {n: getattr(x, "value", x) for n, x in launch.params.items() if n in keep}
        out.append((launch.kernel.fn.__name__, sorted(consts.items()), sorted(params.items())))
    return out


TARGETS = [H200, Target("cuda", 90, 78, gluon=True), Target("cuda", 80, 108), Target.interpreter(132)]
TARGET_IDS = ["h200", "h100-78sm-gluon", "a100", "interpreter"]


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
@pytest.mark.parametrize("n,final", [(4096, False), (65536, False), (20000, True)])
def test_lightning_prefill_plans(target, dtype, n, final):
    def plan(b, h, invariant, sms=target.num_sms):
        t = Target(target.backend, target.capability, sms, gluon=target.gluon)
        q, v = ArrayInfo.contiguous((b, h, n, 128), dtype), ArrayInfo.contiguous((b, h, n, 128), dtype)
        ed = ArrayInfo.contiguous((h,), "float32")
        return _row_arithmetic(plan_lightning_attention(t, q, q, v, ed, None, output_final_state_only=final,
                                                        batch_invariant=invariant))
    ref = plan(1, 64, True)
    for b, h, sms in ((1, 32, target.num_sms), (1, 8, target.num_sms), (4, 64, target.num_sms), (1, 1, 16),
                      (2, 3, 200)):
        assert plan(b, h, True, sms) == ref, (b, h, sms)
    if n == 4096 and target.backend == "cuda":  # the default follows the grid
        assert plan(1, 32, False) != plan(1, 64, False)


@pytest.mark.parametrize("target", TARGETS[:1] + TARGETS[2:], ids=["h200", "a100", "interpreter"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_lightning_backward_plans(target, dtype):
    def plan(b, h, invariant):
        q = ArrayInfo.contiguous((b, h, 4096, 128), dtype)
        kv = ArrayInfo.contiguous((b, h, 128, 128), "float32")
        return _row_arithmetic(plan_lightning_attention_backward(
            target, q, q, q, ArrayInfo.contiguous((h,), "float32"), None, kv, q, kv,
            output_final_state_only=True, need_grad_ed=False, batch_invariant=invariant))
    assert plan(1, 64, True) == plan(1, 8, True) == plan(3, 64, True)
    if target.backend == "cuda":
        assert plan(1, 8, False) != plan(1, 64, False)


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_lightning_varlen_plans(target, dtype):
    def plan(lens, h, invariant):
        t = sum(lens)
        q = ArrayInfo.contiguous((t, h, 128), dtype)
        cu = ArrayInfo.contiguous((len(lens) + 1,), "int32")
        return _row_arithmetic(plan_lightning_attention_varlen(target, q, q, q, ArrayInfo.contiguous((h,), "float32"),
                                                               cu, batch_invariant=invariant))
    ref = plan([8192], 64, True)
    # (up to 2**31 output elements: beyond, the Gluon kernels' int32 offsets do not reach; INVARIANT_NOTE)
    for lens, h in (([8192], 8), ([8192, 300, 5000], 64), ([8192] * 24, 64), ([100, 8192], 2)):
        assert plan(lens, h, True) == ref, (lens, h)
    assert plan([8192], 4, False) != plan([8192] * 24, 64, False)  # cut or not, and where


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
@pytest.mark.parametrize("qpk", [1, 4])
def test_blocksparse_decode_plans(target, qpk):
    def config(b, hkv, invariant, sms=target.num_sms):
        t = Target(target.backend, target.capability, sms, gluon=target.gluon)
        crow, col = (ArrayInfo.contiguous(s, "int32") for s in ((hkv * qpk, 257), (hkv * qpk, 40)))
        q, k = ArrayInfo.contiguous((b, hkv * qpk, 128), "bfloat16"), ArrayInfo.contiguous((b * 64, hkv, 128),
                                                                                           "bfloat16")
        cu = ArrayInfo.contiguous((b + 1,), "int32")
        return choose_config(t, q, k, k, cu, None, crow, col, max_seqlen=16384, batch_invariant=invariant)
    ref = config(1, 8, True)
    for b, hkv, sms in ((64, 8, target.num_sms), (1, 1, target.num_sms), (16, 4, 60), (3, 2, 200)):
        assert config(b, hkv, True, sms) == ref, (b, hkv, sms)
    assert config(1, 8, False) != config(64, 8, False)


def test_prefix_prefill_plans():
    """16-bit D=128: the gather decision follows the batch (its scratch's size);
    invariant plans read the paged context with the gathered context's tiles."""
    def tiles(bsz, invariant):
        seqs = [(512, 4096)] * bsz
        t = sum(s[0] for s in seqs)
        q, kv = ArrayInfo.contiguous((t, 32, 128), "bfloat16"), ArrayInfo.contiguous((t, 8, 128), "bfloat16")
        cache = ArrayInfo.contiguous((bsz * 256 + 1, 8, 16, 16, 8), "bfloat16")
        vcache = ArrayInfo.contiguous((bsz * 256 + 1, 8, 128, 16), "bfloat16")
        table = ArrayInfo.contiguous((bsz, 4096), "int32")
        idx = ArrayInfo.contiguous((bsz + 1,), "int32"), ArrayInfo.contiguous((bsz,), "int32")
        plan = plan_prefix_prefill(H200, q, kv, kv, cache, vcache, table, *idx, max_input_len=512,
                                   max_seq_len=4608, batch_invariant=invariant)
        launch = plan.launches[-1]
        return len(plan.launches), launch.constexprs["BLOCK_M"], launch.constexprs["BLOCK_N"]
    assert tiles(2, False)[0] == 2 and tiles(64, False)[0] == 1  # gathered / paged
    assert tiles(2, False)[1:] != tiles(64, False)[1:]
    assert tiles(2, True)[1:] == tiles(64, True)[1:] and tiles(64, True)[0] == 1

"""One small call per kernel variant, at odd shapes, through torch and/or JAX.

Written to be run under NVIDIA's compute-sanitizer (scripts/sanitize.sh runs it
with memcheck, racecheck and initcheck); it also runs on a machine without a
GPU, under Triton's interpreter, where the Gluon and bf16 cases are skipped.

    python -m tools.sanitize_cases [--adapter torch|jax|both] [--only SUBSTR] [--list] [--seed N]

Shapes are deliberately awkward: head sizes that are not powers of two, lengths
that are not multiples of any tile, empty sequences where the op allows them,
GQA groups that are and are not powers of two. Variants the planner would not
pick at these small shapes are forced through ``config=``. Inputs are fresh
random numbers (numpy; the seed is printed) and every index array is valid, so
any sanitizer report is the kernel's. Each result is only checked to be finite
where it should be (the test suite compares against the references).

Output: one line per case, ``ok <adapter> <case>``, ``skip <adapter> <case>:
<why>`` or ``FAIL <adapter> <case>: <why>``; the exit code is 1 when any case
failed. ``--adapter torch`` never imports JAX and ``--adapter jax`` never
uses torch (Triton's interpreter imports it on the CPU), so a sanitizer log
holds one framework's allocations only.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import core_kernels  # noqa: F401  (picks Triton's interpreter when there is no GPU driver)
import numpy as np
from core_kernels.blocksparse_attention import (BlocksparseDecodeConfig, BlocksparseGroupDecodeConfig,
                                                BlocksparsePrefillConfig, build_sparse_layout)
from core_kernels.lightning_attention import (LightningDecodeConfig, LightningGluonConfig,
                                              LightningTritonConfig, LightningVarlenConfig,
                                              LightningVarlenGluonConfig)
from core_kernels.merge_attn_states import MergeConfig
from core_kernels.prefix_prefill import PrefixPrefillConfig


class Skip(Exception):
    """A case that does not apply on this machine (the reason is printed)."""


# ------------------------------------------------------------------ adapters
class TorchSide:
    name = "torch"

    def __init__(self):
        import torch
        import adapters.torch as ops
        self.torch, self.ops = torch, ops
        interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        self.gpu = torch.cuda.is_available() and not interpret
        self.device = "cuda" if self.gpu else "cpu"
        self.gluon = False
        if self.gpu:
            from adapters.torch._executor import target_for
            t = target_for(torch.device("cuda"))
            self.gluon = t.gluon and t.hopper

    def arr(self, x, dtype=None):
        """A numpy array on the device, cast to ``dtype`` (a name) on the device."""
        t = self.torch.from_numpy(np.array(x, order="C")).to(self.device)  # a writable copy
        return t if dtype is None else t.to(getattr(self.torch, dtype))

    def empty(self, shape, dtype):
        return self.torch.empty(shape, dtype=getattr(self.torch, dtype), device=self.device)

    def zeros(self, shape, dtype):
        return self.torch.zeros(shape, dtype=getattr(self.torch, dtype), device=self.device)

    def scale(self, value):
        return self.torch.tensor([value], dtype=self.torch.float32, device=self.device)

    def np(self, x):
        return x.detach().float().cpu().numpy() if x.dtype.is_floating_point else x.cpu().numpy()

    def sync(self):
        if self.gpu:
            self.torch.cuda.synchronize()

    def grads(self, call, arrays, wrt):
        """Gradients of sum(out^2) over ``call(*arrays)``'s float outputs with
        respect to ``arrays[i]`` for i in ``wrt`` (torch autograd)."""
        arrays = [a.detach().requires_grad_(True) if i in wrt else a for i, a in enumerate(arrays)]
        outs = call(*arrays)
        loss = sum(o.float().square().sum() for o in outs if o is not None and o.is_floating_point())
        return self.torch.autograd.grad(loss, [arrays[i] for i in wrt])


class JaxSide:
    name = "jax"

    def __init__(self):
        import jax
        import jax.numpy as jnp
        import adapters.jax as ops
        self.jax, self.jnp, self.ops = jax, jnp, ops
        interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        self.gpu = jax.default_backend() in ("gpu", "cuda") and not interpret
        self.gluon = False
        if self.gpu:
            from adapters.jax._executor import target
            t = target()
            self.gluon = t.gluon and t.hopper

    def arr(self, x, dtype=None):
        a = self.jnp.asarray(np.ascontiguousarray(x))
        return a if dtype is None else a.astype(dtype)

    def scale(self, value):
        return self.jnp.asarray(np.array([value], np.float32))

    def np(self, x):
        x = np.asarray(x)  # bf16 / fp8 come back as ml_dtypes arrays
        return x if x.dtype.kind in "iub" else x.astype(np.float32)

    def sync(self):
        pass  # np() blocks on the results

    def grads(self, call, arrays, wrt):
        """As TorchSide.grads, through jax.grad (the custom VJPs)."""
        jnp = self.jnp

        def loss(*a):
            return sum(jnp.square(o.astype(jnp.float32)).sum() for o in call(*a)
                       if o is not None and jnp.issubdtype(o.dtype, jnp.floating))
        return self.jax.grad(loss, argnums=tuple(wrt))(*arrays)


# ------------------------------------------------------------------ checks
def finite(side, name, x, rows=None):
    """Every element of ``x`` (or of its first-axis ``rows``) is finite."""
    a = side.np(x).astype(np.float64)
    if rows is not None:
        a = a[rows]
    bad = ~np.isfinite(a)
    if bad.any():
        raise AssertionError(f"{name}: {int(bad.sum())} of {a.size} elements not finite "
                             f"(first at {tuple(int(i) for i in np.argwhere(bad)[0])})")


def need(side, *, gpu=False, gluon=False, torch_only=False, why=""):
    if torch_only and side.name != "torch":
        raise Skip(why or "torch only")
    if gpu and not side.gpu:
        raise Skip(why or "GPU only (bf16 is not meaningful under the interpreter)")
    if gluon and not side.gluon:
        raise Skip("Gluon kernels need an sm_90 GPU with Gluon support")


def model_dtype(side):
    """bf16 on the GPU; fp16 under the interpreter (its bf16 arithmetic is broken)."""
    return "bfloat16" if side.gpu else "float16"


# ------------------------------------------------------------------ merge_attn_states
def merge(side, g, *, dtype="float32", lse_out=True, count=None, fp8=False, n=37, h=5, d=72,
          config=None):
    po, so = g.standard_normal((2, n, h, d)).astype(np.float32)
    pl, sl = (g.standard_normal((2, h, n)) * 3).astype(np.float32)
    pl[:, ::7] = -np.inf             # empty prefix parts
    sl[1, [2, 9, 17, 19]] = np.inf   # +inf also means "empty part" (never both; below any count)
    out_dtype = "float8_e4m3fn" if fp8 else dtype
    scale = 0.05 if fp8 else None
    if side.name == "torch":
        out = side.empty((n, h, d), out_dtype)
        out_lse = side.empty((h, n), "float32") if lse_out else None
        if count == "tensor":
            cnt = side.arr(np.array([n - 11], np.int32))
        else:
            cnt = count
        side.ops.merge_attn_states(out, side.arr(po, dtype), side.arr(pl), side.arr(so, dtype),
                                   side.arr(sl), output_lse=out_lse, prefill_tokens_with_context=cnt,
                                   output_scale=side.scale(scale) if fp8 else None, config=config)
    else:
        cnt = side.arr(np.array([n - 11], np.int32)) if count == "tensor" else count
        out, out_lse = side.ops.merge_attn_states(
            side.arr(po, dtype), side.arr(pl), side.arr(so, dtype), side.arr(sl),
            prefill_tokens_with_context=cnt, output_scale=side.scale(scale) if fp8 else None,
            config=config)
    finite(side, "output", out)
    if out_lse is not None:
        finite(side, "output_lse", out_lse)


def mask_lse(side, g, *, h=5):
    qlens = [3, 0, 9, 1, 6]                       # an empty request
    ctx = [4, 0, 0, 7, 0]                          # empty context chunks: requests 1, 2, 4
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    csl = np.concatenate([[0], np.cumsum(ctx)]).astype(np.int32)
    t = int(qsl[-1]) + 2                           # two tokens of no request
    lse = g.standard_normal((h, t)).astype(np.float32)
    if side.name == "torch":
        x = side.arr(lse)
        side.ops.mask_empty_context_lse(x, side.arr(qsl), side.arr(csl))
    else:
        x = side.ops.mask_empty_context_lse(side.arr(lse), side.arr(qsl), side.arr(csl))
    got = side.np(x)
    masked = np.zeros(t, bool)
    for r, c in enumerate(ctx):
        if c == 0:
            masked[qsl[r]:qsl[r + 1]] = True
    if not (np.isneginf(got[:, masked]).all() and np.isfinite(got[:, ~masked]).all()):
        raise AssertionError("lse: -inf not exactly at the tokens of empty-context requests")


# ------------------------------------------------------------------ context_attention_fwd
def prefix_inputs(g, seqs, *, hq, hkv, d, bs, x, cache_new=False):
    """Valid paged inputs for [(query_len, context_len), ...] (fp32 numpy):
    permuted physical blocks, every table slot a valid block id."""
    qlens = np.array([s[0] for s in seqs])
    ctxs = np.array([s[1] for s in seqs])
    t, b = int(qlens.sum()), len(seqs)
    cached = ctxs + qlens if cache_new else ctxs
    used = [-(-int(c) // bs) for c in cached]
    width = max(used + [1]) + 1                    # one spare slot per row
    num_blocks = sum(used) + 2
    ids = g.permutation(num_blocks)
    table = np.zeros((b, width), np.int64)
    pos = 0
    for i, u in enumerate(used):
        table[i, :u] = ids[pos:pos + u]
        table[i, u:] = ids[-1]                     # unused slots: a valid (stale) block
        pos += u
    f = lambda *s: g.standard_normal(s).astype(np.float32)  # noqa: E731
    return dict(q=f(t, hq, d), k=f(t, hkv, d), v=f(t, hkv, d),
                k_cache=f(num_blocks, hkv, d // x, bs, x), v_cache=f(num_blocks, hkv, d, bs),
                b_loc=table.astype(np.int32),
                b_start_loc=np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32),
                b_seq_len=(qlens + ctxs).astype(np.int32), max_input_len=int(qlens.max()),
                qlens=qlens)


PP_SEQS = [(7, 21), (1, 40), (13, 0), (0, 9), (18, 5)]


def prefix(side, g, *, gather, dtype="float32", hq=6, hkv=2, d=40, bs=16, x=8, seqs=PP_SEQS,
           fp8_cache=None, fp8_out=False, window=None, sinks=False, alibi=False, v_pack=0,
           causal=True, no_kv=False, bt_ptr=False, skip_decode=False, tiles=(32, 16)):
    c = prefix_inputs(g, seqs, hq=hq, hkv=hkv, d=d, bs=bs, x=x, cache_new=no_kv)
    config = None if gather is None else PrefixPrefillConfig(tiles[0], tiles[1], 4, 2, True, 1,
                                                             gather=gather)
    cache_dtype = fp8_cache or dtype
    kv_cache_dtype = {"float8_e4m3fn": "fp8", "float8_e5m2": "fp8_e5m2"}.get(fp8_cache, "auto")
    opts = dict(sliding_window=window, skip_decode=skip_decode, causal=causal,
                interleaved_v_pack_factor=v_pack, config=config)
    q = side.arr(c["q"], dtype)
    k = None if no_kv else side.arr(c["k"], dtype)
    v = None if no_kv else side.arr(c["v"], dtype)
    kc, vc = side.arr(c["k_cache"], cache_dtype), side.arr(c["v_cache"], cache_dtype)
    tables = [side.arr(c[n]) for n in ("b_loc", "b_start_loc", "b_seq_len")]
    hq_vec = lambda: side.arr(g.uniform(0.05, 1.0, hq).astype(np.float32))  # noqa: E731
    alibi_slopes = hq_vec() if alibi else None
    sink = side.arr(g.standard_normal(hq).astype(np.float32)) if sinks else None
    out_dtype = "float8_e4m3fn" if fp8_out else dtype
    rows = np.ones(c["q"].shape[0], bool)
    if skip_decode:  # rows of 1-token sequences are left alone
        starts = c["b_start_loc"]
        for i, ql in enumerate(c["qlens"]):
            if ql == 1:
                rows[starts[i]:starts[i + 1]] = False
    if side.name == "torch":
        if bt_ptr:
            per_block = kc.stride(0) * kc.element_size()
            tables[0] = side.arr(kc.data_ptr() + c["b_loc"].astype(np.int64) * per_block)
        # o as vLLM allocates it (uninitialised) unless rows are skipped
        o = side.zeros(c["q"].shape, out_dtype) if skip_decode else side.empty(c["q"].shape, out_dtype)
        side.ops.context_attention_fwd(
            q, k, v, o, kv_cache_dtype, kc, vc, *tables, 0, c["max_input_len"],
            side.scale(1.25) if fp8_cache else None, side.scale(0.75) if fp8_cache else None,
            alibi_slopes, window, None, skip_decode, side.scale(0.5) if fp8_out else None, sink,
            bt_ptr, v_pack, causal, config=config)
    else:
        o = side.ops.context_attention_fwd(
            q, k, v, kc, vc, *tables, max_input_len=c["max_input_len"], kv_cache_dtype=kv_cache_dtype,
            k_scale=1.25, v_scale=0.75, alibi_slopes=alibi_slopes, sinks=sink,
            fp8_out_scale=0.5 if fp8_out else None, **opts)
    finite(side, "o", o, rows)


# ------------------------------------------------------------------ lightning_attention
def lightning(side, g, *, b=2, h=3, n=45, d=40, e=24, dtype="float32", block_size=16,
              final_only=False, history=None, config=None, ed_shape="h"):
    q, k = (g.standard_normal((2, b, h, n, d)) * 0.3).astype(np.float32)
    v = g.standard_normal((b, h, n, e)).astype(np.float32)
    ed = g.uniform(0.0, 0.5, h).astype(np.float32)
    ed[0] = 0.0  # a head without decay
    if ed_shape == "h11":
        ed = ed.reshape(h, 1, 1)
    hist = None if history is None else side.arr(g.standard_normal((b, h, d, e)).astype(np.float32),
                                                 history)
    out, kv = side.ops.lightning_attention(side.arr(q, dtype), side.arr(k, dtype), side.arr(v, dtype),
                                           side.arr(ed), block_size, hist, final_only, config=config)
    finite(side, "output", out)
    finite(side, "kv", kv)


def gluon(side, g, *, dtype, **kw):
    need(side, gluon=True)
    lightning(side, g, dtype=dtype, b=1, h=2, d=128, e=128, block_size=64, **kw)


def decode(side, g, *, dtype="float32", cache_dtype="float32", b=5, h=3, d=40, e=24, slots=7,
           config=None):
    q, k = (g.standard_normal((2, b, h, 1, d)) * 0.3).astype(np.float32)
    v = g.standard_normal((b, h, 1, e)).astype(np.float32)
    cache = g.standard_normal((slots, h, d, e)).astype(np.float32)
    slope = g.uniform(0.0, 0.5, (h, 1, 1)).astype(np.float32)
    slot_idx = np.array([4, -1, 0, 6, -1], np.int32)[:b]
    kvc = side.arr(cache, cache_dtype)
    args = (side.arr(q, dtype), side.arr(k, dtype), side.arr(v, dtype), kvc, side.arr(slope),
            side.arr(slot_idx))
    if side.name == "torch":
        out = side.ops.linear_decode_forward_triton(*args, 32, config=config)
    else:
        out, kvc = side.ops.linear_decode_forward_triton(*args, 32, config=config)
    finite(side, "output", out)
    finite(side, "kv_caches", kvc)


def varlen(side, g, *, lens=(0, 37, 5, 0, 20), h=3, d=40, e=24, dtype="float32", cache=False,
           config=None):
    t = int(sum(lens))
    q, k = (g.standard_normal((2, t, h, d)) * 0.3).astype(np.float32)
    v = g.standard_normal((t, h, e)).astype(np.float32)
    ed = g.uniform(0.0, 0.5, h).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    kw = {}
    if cache:
        kw = dict(kv_cache=side.arr(g.standard_normal((8, h, d, e)).astype(np.float32)),
                  slot_idx=side.arr(np.array([2, -1, 5, 0, 7], np.int32)[:len(lens)]))
    out, states = side.ops.lightning_attention_varlen(
        side.arr(q, dtype), side.arr(k, dtype), side.arr(v, dtype), side.arr(ed), side.arr(cu),
        block_size=16, config=config, **kw)
    finite(side, "output", out)
    finite(side, "kv_cache" if cache else "states", states)


# ------------------------------------------------------------------ blocksparse
def blocksparse(side, g, *, mode, homo=False, hq=6, hkv=2, d=40, bs=16, dtype="float32",
                q_block_size=None, config=None, lens_k=(37, 0, 21, 50), lens_q=None):
    max_seqlen = 64
    (crow, col), _ = build_sparse_layout(hq, max_seqlen, bs, 2, 3, homo)
    if homo:  # one layout head for all query heads (stride 0)
        crow, col = crow[0], col[0]
    lens_k = np.array(lens_k)
    if mode == "decode":
        lens_k = np.maximum(lens_k, 1)            # a decode row has its own token
        lens_q = np.ones_like(lens_k)
    elif mode == "prefill":
        lens_q = lens_k
    else:  # "prefix": the last lens_q tokens of each sequence are queries
        lens_q = np.array(lens_q)
    tk, tq = int(lens_k.sum()), int(lens_q.sum())
    q = g.standard_normal((tq, hq, d)).astype(np.float32)
    k, v = g.standard_normal((2, tk, hkv, d)).astype(np.float32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    cu_q = None if mode in ("decode", "prefill") else \
        side.arr(np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32))
    out = side.ops.blocksparse_flash_attn_varlen_fwd(
        side.arr(q, dtype), side.arr(k, dtype), side.arr(v, dtype), side.arr(cu_k), cu_q, None,
        (side.arr(np.ascontiguousarray(crow)), side.arr(np.ascontiguousarray(col))),
        block_size=bs, q_block_size=q_block_size, max_seqlen=max_seqlen, config=config)
    finite(side, "output", out)


# ------------------------------------------------------------------ backward passes
def merge_backward(side, g, *, dtype="float32", n=37, h=5, d=72):
    po, so = g.standard_normal((2, n, h, d)).astype(np.float32)
    pl, sl = (g.standard_normal((2, h, n)) * 3).astype(np.float32)
    pl[:, ::7] = -np.inf  # empty prefix parts

    def call(po, pl, so, sl):
        if side.name == "torch":
            out, out_lse = side.empty((n, h, d), dtype), side.empty((h, n), "float32")
            side.ops.merge_attn_states(out, po, pl, so, sl, output_lse=out_lse)
            return out, out_lse
        return side.ops.merge_attn_states(po, pl, so, sl)
    for name, x in zip(("d prefix_output", "d prefix_lse", "d suffix_output", "d suffix_lse"),
                       side.grads(call, [side.arr(po, dtype), side.arr(pl), side.arr(so, dtype), side.arr(sl)],
                                  (0, 1, 2, 3))):
        finite(side, name, x)


def lightning_backward(side, g, *, b=2, h=3, n=45, d=40, e=24, dtype="float32", block_size=16,
                       final_only=False, history=True, ed_grad=True):
    q, k = (g.standard_normal((2, b, h, n, d)) * 0.3).astype(np.float32)
    v = g.standard_normal((b, h, n, e)).astype(np.float32)
    ed = g.uniform(0.0, 0.5, h).astype(np.float32)
    arrays = [side.arr(q, dtype), side.arr(k, dtype), side.arr(v, dtype), side.arr(ed)]
    if history:
        arrays.append(side.arr(g.standard_normal((b, h, d, e)).astype(np.float32)))

    def call(q, k, v, ed, *hist):
        return side.ops.lightning_attention(q, k, v, ed, block_size, hist[0] if hist else None, final_only)
    wrt = (0, 1, 2) + ((3,) if ed_grad else ()) + ((4,) if history else ())
    for i, x in zip(wrt, side.grads(call, arrays, wrt)):
        finite(side, f"gradient {i}", x)


def varlen_backward(side, g, *, lens=(0, 37, 5, 0, 20), h=3, d=40, e=24, dtype="float32", cache=False):
    t = int(sum(lens))
    q, k = (g.standard_normal((2, t, h, d)) * 0.3).astype(np.float32)
    v = g.standard_normal((t, h, e)).astype(np.float32)
    ed = g.uniform(0.0, 0.5, h).astype(np.float32)
    cu = side.arr(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    arrays = [side.arr(q, dtype), side.arr(k, dtype), side.arr(v, dtype), side.arr(ed)]
    if cache:  # slots: an empty sequence with a named slot, -1, untouched slots
        arrays.append(side.arr(g.standard_normal((8, h, d, e)).astype(np.float32)))
        slots = side.arr(np.array([2, -1, 5, 0, 7], np.int32)[:len(lens)])

    def call(q, k, v, ed, *kv_cache):
        if kv_cache and side.name == "torch":
            kv_cache = (kv_cache[0].clone(),)  # in place: not on the leaf
        return side.ops.lightning_attention_varlen(
            q, k, v, ed, cu, block_size=16, **(dict(kv_cache=kv_cache[0], slot_idx=slots) if kv_cache else {}))
    wrt = tuple(range(len(arrays)))
    for i, x in zip(wrt, side.grads(call, arrays, wrt)):
        finite(side, f"gradient {i}", x)


def blocksparse_backward(side, g, *, homo=False, hq=6, hkv=2, d=40, bs=16, dtype="float32",
                         q_block_size=None, lens=(37, 0, 21, 50)):
    max_seqlen = 64
    (crow, col), _ = build_sparse_layout(hq, max_seqlen, bs, 2, 3, homo)
    if homo:
        crow, col = crow[0], col[0]
    lens = np.array(lens)
    tk = int(lens.sum())
    q = g.standard_normal((tk, hq, d)).astype(np.float32)
    k, v = g.standard_normal((2, tk, hkv, d)).astype(np.float32)
    cu = side.arr(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    layout = (side.arr(np.ascontiguousarray(crow)), side.arr(np.ascontiguousarray(col)))

    def call(q, k, v):
        return (side.ops.blocksparse_flash_attn_varlen_fwd(
            q, k, v, cu, None, None, layout, block_size=bs, q_block_size=q_block_size,
            max_seqlen=max_seqlen),)
    for name, x in zip(("dq", "dk", "dv"), side.grads(call, [side.arr(q, dtype), side.arr(k, dtype),
                                                               side.arr(v, dtype)], (0, 1, 2))):
        finite(side, name, x)


# ------------------------------------------------------------------ the case list
def gpu_only(fn):
    def run(side, g):
        need(side, gpu=True)
        fn(side, g)
    return run


def torch_only(fn):
    def run(side, g):
        need(side, torch_only=True, why="is_block_table_ptr is run through torch only")
        fn(side, g)
    return run


def cases():
    C = {}
    # merge_attn_states / mask_empty_context_lse
    C["merge/no_output_lse"] = lambda s, g: merge(s, g, lse_out=False)
    C["merge/output_lse"] = lambda s, g: merge(s, g)
    C["merge/count_int"] = lambda s, g: merge(s, g, count=23)
    C["merge/count_tensor"] = lambda s, g: merge(s, g, count="tensor")
    C["merge/fp8_out"] = lambda s, g: merge(s, g, fp8=True, count=30)
    C["merge/fp16_small_tile"] = lambda s, g: merge(s, g, dtype="float16", d=5, h=3,
                                                    config=MergeConfig(64, 1))
    C["merge/bf16"] = gpu_only(lambda s, g: merge(s, g, dtype="bfloat16", count="tensor"))
    C["merge/bf16_fp8_out"] = gpu_only(lambda s, g: merge(s, g, dtype="bfloat16", fp8=True,
                                                          lse_out=False))
    C["mask_empty_context_lse"] = lambda s, g: mask_lse(s, g)
    # context_attention_fwd: every option through both the paged and the gathered path
    pp = {
        "plain": {},
        "gqa_pack4_d24_bs48": dict(hq=8, hkv=2, d=24, bs=48),
        "fp8_cache_e4m3": dict(fp8_cache="float8_e4m3fn"),
        "fp8_cache_e5m2": dict(fp8_cache="float8_e5m2"),
        "fp8_out": dict(fp8_out=True),
        "window_sinks_alibi": dict(window=10, sinks=True, alibi=True),
        "interleaved_v4": dict(v_pack=4),
        "noncausal": dict(causal=False, sinks=True),
        "no_kv": dict(no_kv=True, window=12),
        "skip_decode": dict(skip_decode=True),
    }
    for gather in (False, True):
        path = "gathered" if gather else "paged"
        for name, kw in pp.items():
            C[f"prefix/{path}/{name}"] = (lambda kw, gather: lambda s, g: prefix(s, g, gather=gather, **kw))(kw, gather)
        C[f"prefix/{path}/block_table_ptr"] = torch_only(
            (lambda gather: lambda s, g: prefix(s, g, gather=gather, bt_ptr=True, no_kv=True,
                                                v_pack=2, skip_decode=True))(gather))
        C[f"prefix/{path}/bf16_everything"] = gpu_only(
            (lambda gather: lambda s, g: prefix(s, g, gather=gather, dtype="bfloat16", window=9,
                                                sinks=True, fp8_out=True, fp8_cache="float8_e4m3fn",
                                                v_pack=4, skip_decode=True))(gather))
    C["prefix/auto/bf16_d128"] = gpu_only(lambda s, g: prefix(s, g, gather=None, dtype="bfloat16",
                                                              hq=8, hkv=2, d=128, x=8))
    C["prefix/auto/fp16_d80_bs48"] = lambda s, g: prefix(s, g, gather=None, dtype="float16", d=80,
                                                         bs=48, x=16, hq=4, hkv=4)
    # lightning_attention (Triton, segmented Triton, Gluon) and decode
    T = LightningTritonConfig
    C["lightning/triton"] = lambda s, g: lightning(s, g, config=T(num_segments=1))
    C["lightning/triton_final_hist32"] = lambda s, g: lightning(
        s, g, config=T(num_segments=1), final_only=True, history="float32", ed_shape="h11")
    C["lightning/triton_small_tiles"] = lambda s, g: lightning(
        s, g, config=T(block_t=16, block_e=16, num_segments=1), history="float32")
    C["lightning/triton_segmented"] = lambda s, g: lightning(s, g, config=T(num_segments=3))
    C["lightning/triton_segmented_final_hist32"] = lambda s, g: lightning(
        s, g, config=T(num_segments=2), final_only=True, history="float32")
    C["lightning/triton_fp16"] = lambda s, g: lightning(s, g, dtype="float16", config=T(num_segments=2),
                                                        history="float16")
    C["lightning/triton_hist_bf16"] = gpu_only(lambda s, g: lightning(
        s, g, config=T(num_segments=1), history="bfloat16"))
    C["lightning/triton_bf16_even"] = gpu_only(lambda s, g: lightning(
        s, g, dtype="bfloat16", d=64, e=64, n=100, config=T(num_segments=1), history="bfloat16"))
    C["lightning/triton_bf16_even_segmented"] = gpu_only(lambda s, g: lightning(
        s, g, dtype="bfloat16", d=64, e=64, n=200, config=T(num_segments=3), final_only=True))
    C["lightning/triton_bf16_masked"] = gpu_only(lambda s, g: lightning(
        s, g, dtype="bfloat16", config=T(num_segments=2), history="float32"))
    G = LightningGluonConfig
    C["lightning/gluon_bf16_states"] = lambda s, g: gluon(s, g, dtype="bfloat16", n=192, config=G())
    C["lightning/gluon_bf16_states_hist32_seg2"] = lambda s, g: gluon(
        s, g, dtype="bfloat16", n=512, history="float32", config=G(num_segments=2))
    C["lightning/gluon_bf16_final_histbf16"] = lambda s, g: gluon(
        s, g, dtype="bfloat16", n=320, final_only=True, history="bfloat16", config=G(num_segments=2))
    C["lightning/gluon_bf16_stages2"] = lambda s, g: gluon(
        s, g, dtype="bfloat16", n=256, history="bfloat16", config=G(num_segments=2, stages=2))
    C["lightning/gluon_fp32_states"] = lambda s, g: gluon(s, g, dtype="float32", n=192, config=G())
    C["lightning/gluon_fp32_states_histbf16_seg2"] = lambda s, g: gluon(
        s, g, dtype="float32", n=512, history="bfloat16", config=G(num_segments=2))
    C["lightning/gluon_fp32_final_hist32_seg3"] = lambda s, g: gluon(
        s, g, dtype="float32", n=384, final_only=True, history="float32", config=G(num_segments=3))
    C["lightning/auto_bf16_d128"] = gpu_only(lambda s, g: lightning(
        s, g, dtype="bfloat16", b=1, h=4, n=448, d=128, e=128, block_size=64))
    C["decode/fp32_cache"] = lambda s, g: decode(s, g)
    C["decode/fp32_cache_small_tile"] = lambda s, g: decode(s, g, config=LightningDecodeConfig(16, 2))
    C["decode/fp16_cache"] = lambda s, g: decode(s, g, dtype="float16", cache_dtype="float16")
    C["decode/bf16_cache"] = gpu_only(lambda s, g: decode(s, g, dtype="bfloat16", cache_dtype="bfloat16"))
    C["decode/bf16_q_fp32_cache_d128"] = gpu_only(lambda s, g: decode(
        s, g, dtype="bfloat16", d=128, e=128))
    # lightning_attention_varlen
    V = LightningVarlenConfig
    C["varlen/whole"] = lambda s, g: varlen(s, g, config=V(segment_len=0))
    C["varlen/whole_cache"] = lambda s, g: varlen(s, g, cache=True, config=V(segment_len=0))
    C["varlen/split"] = lambda s, g: varlen(s, g, config=V(block_t=16, segment_len=16))
    C["varlen/split_cache"] = lambda s, g: varlen(s, g, cache=True, config=V(block_t=16, segment_len=16))
    C["varlen/auto_cache_fp16"] = lambda s, g: varlen(s, g, cache=True, dtype="float16")
    C["varlen/bf16_split_cache"] = gpu_only(lambda s, g: varlen(
        s, g, dtype="bfloat16", d=64, e=64, cache=True, config=V(segment_len=32)))
    C["varlen/bf16_masked_split"] = gpu_only(lambda s, g: varlen(
        s, g, dtype="bfloat16", config=V(segment_len=16)))
    # the Gluon kernels: D 128, the last sequence's partial chunk ends at q's end
    VG = LightningVarlenGluonConfig
    C["varlen/gluon_bf16_cache"] = gpu_only(lambda s, g: varlen(
        s, g, lens=(0, 37, 64, 0, 65), dtype="bfloat16", d=128, e=128, cache=True, config=VG()))
    C["varlen/gluon_fp32_states"] = gpu_only(lambda s, g: varlen(
        s, g, lens=(0, 37, 64, 0, 65), d=128, e=128, config=VG(longest_first=False)))
    C["varlen/gluon_fp32_cache"] = gpu_only(lambda s, g: varlen(
        s, g, lens=(1, 130, 0, 63, 5), d=128, e=64, cache=True, config=VG()))
    # blocksparse_flash_attn_varlen_fwd
    P = BlocksparsePrefillConfig
    C["blocksparse/prefill_per_head"] = lambda s, g: blocksparse(s, g, mode="prefill", config=P(16, 16))
    C["blocksparse/prefill_homo"] = lambda s, g: blocksparse(s, g, mode="prefill", homo=True,
                                                             config=P(16, 16))
    C["blocksparse/prefill_prefix"] = lambda s, g: blocksparse(
        s, g, mode="prefix", lens_q=(5, 0, 21, 17), config=P(16, 16))
    C["blocksparse/prefill_qblock32"] = lambda s, g: blocksparse(
        s, g, mode="prefill", q_block_size=32, config=P(16, 16))
    C["blocksparse/prefill_auto_bs32"] = lambda s, g: blocksparse(s, g, mode="prefill", bs=32)
    C["blocksparse/prefill_on_decode_batch"] = lambda s, g: blocksparse(s, g, mode="decode",
                                                                        config=P(16, 16))
    C["blocksparse/decode_splits3"] = lambda s, g: blocksparse(
        s, g, mode="decode", config=BlocksparseDecodeConfig(3))
    C["blocksparse/decode_1split_homo"] = lambda s, g: blocksparse(
        s, g, mode="decode", homo=True, config=BlocksparseDecodeConfig(1))
    C["blocksparse/group_decode"] = lambda s, g: blocksparse(
        s, g, mode="decode", config=BlocksparseGroupDecodeConfig(2, 2))
    C["blocksparse/group_decode_homo_1split"] = lambda s, g: blocksparse(
        s, g, mode="decode", homo=True, config=BlocksparseGroupDecodeConfig(1, 4))
    C["blocksparse/bf16_prefill"] = gpu_only(lambda s, g: blocksparse(
        s, g, mode="prefix", dtype="bfloat16", lens_q=(5, 0, 21, 17)))
    C["blocksparse/bf16_decode"] = gpu_only(lambda s, g: blocksparse(
        s, g, mode="decode", dtype="bfloat16", d=128, hq=8, hkv=2, config=BlocksparseDecodeConfig(4)))
    C["blocksparse/bf16_group_decode"] = gpu_only(lambda s, g: blocksparse(
        s, g, mode="decode", dtype="bfloat16", d=96, hq=8, hkv=2,
        config=BlocksparseGroupDecodeConfig(3, 2)))
    # backward passes (torch autograd / jax.grad)
    C["backward/merge"] = lambda s, g: merge_backward(s, g)
    C["backward/merge_fp16"] = lambda s, g: merge_backward(s, g, dtype="float16", d=5, h=3)
    C["backward/lightning_states_hist"] = lambda s, g: lightning_backward(s, g)
    C["backward/lightning_final_ed_constant"] = lambda s, g: lightning_backward(
        s, g, final_only=True, history=False, ed_grad=False)
    C["backward/lightning_fp16"] = lambda s, g: lightning_backward(s, g, dtype="float16")
    C["backward/lightning_bf16_d128"] = gpu_only(lambda s, g: lightning_backward(
        s, g, dtype="bfloat16", b=1, h=2, n=200, d=128, e=128, block_size=64))
    C["backward/lightning_bf16_odd"] = gpu_only(lambda s, g: lightning_backward(s, g, dtype="bfloat16",
                                                                               ed_grad=False))
    C["backward/lightning_varlen"] = lambda s, g: varlen_backward(s, g)
    C["backward/lightning_varlen_cache"] = lambda s, g: varlen_backward(s, g, cache=True)
    C["backward/blocksparse_per_head"] = lambda s, g: blocksparse_backward(s, g)
    C["backward/blocksparse_homo_qblock32"] = lambda s, g: blocksparse_backward(s, g, homo=True,
                                                                                q_block_size=32)
    C["backward/blocksparse_bf16"] = gpu_only(lambda s, g: blocksparse_backward(
        s, g, dtype="bfloat16", d=128, hq=8, hkv=2))
    return C


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--adapter", choices=("torch", "jax", "both"), default="both")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the case names and exit")
    ap.add_argument("--seed", type=int, default=None, help="numpy seed (default: fresh)")
    a = ap.parse_args(argv)
    all_cases = {n: f for n, f in cases().items() if a.only in n}
    if a.list:
        print("\n".join(all_cases))
        return 0
    seed = a.seed if a.seed is not None else int(np.random.SeedSequence().entropy % 2 ** 32)
    print(f"seed {seed}", flush=True)
    failed = 0
    counts = {"ok": 0, "skip": 0, "FAIL": 0}
    for adapter in (("torch", "jax") if a.adapter == "both" else (a.adapter,)):
        side = TorchSide() if adapter == "torch" else JaxSide()
        print(f"adapter {adapter}: {'GPU' if side.gpu else 'interpreter'}"
              f"{', Gluon' if side.gluon else ''}", flush=True)
        g = np.random.default_rng(seed)
        for name, fn in all_cases.items():
            t0 = time.perf_counter()
            try:
                fn(side, g)
                side.sync()
                status, line = "ok", f"ok {adapter} {name}"
            except Skip as e:
                status, line = "skip", f"skip {adapter} {name}: {e}"
            except Exception as e:  # noqa: BLE001  (report every failure, go on)
                status, line = "FAIL", f"FAIL {adapter} {name}: {type(e).__name__}: {e}"
                traceback.print_exc(file=sys.stdout)
            counts[status] += 1
            if status != "skip":
                line += f" ({time.perf_counter() - t0:.1f} s)"
            print(line, flush=True)
        failed += counts["FAIL"]
    print(f"summary: {counts['ok']} ok, {counts['skip']} skipped, {counts['FAIL']} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

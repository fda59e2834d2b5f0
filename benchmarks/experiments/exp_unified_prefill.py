"""Experiment: unified_attention's prefill path on the H200 (issue 43's shapes).

vLLM's flash cache layout (k, v [num_blocks, block_size, Hkv, D]), bf16, 32
query / 8 KV heads, D 128, block 16, block tables of randomly permuted blocks.
Shapes (``SHAPES``):

- ``b4_q1024_ctx4096``: 4 sequences of 1024 new tokens over 4096 cached;
- ``b1_8192``: one sequence of 8192 new tokens, no context;
- ``mixed``: 127 decodes (1 new token over 4095 cached, first in the batch as
  vLLM orders it) and one chunk of 2048 new tokens over 8192 cached (last).

For each shape, the prefill path alone (``plan_prefill_only`` below: the
problem's validation, then ``prefill_launches``; decode rows untouched) under
the planner's choice and config overrides (gathered vs paged keys, tiles,
stages, block-id prefetch, flat vs per-sequence grid), GPU time by do_bench
(median, cold L2) and useful TFLOP/s (4 Hq D per visible query-key pair);
where ``adapters.torch.unified_attention`` runs, the whole op too; and vLLM
0.33's ``unified_attention`` from ``.peer/vllm_src`` (git-ignored, carried)
when present (through benchmarks/bench_unified_attention.py's shim). Correctness of every variant against torch SDPA over the
gathered dense K/V (bf16, lower-right causal), max |diff| recorded.
With ``extra``: the B4 / B1 batches at head sizes 64 and 256 and with an fp8
cache (``EXTRA``), the prefill path alone. JSON to
``$OUT/exp_unified_prefill.json`` (``exp_unified_prefill_extra.json``).

    python3 -m benchmarks.experiments.exp_unified_prefill [variant-name ...]
    python3 -m benchmarks.experiments.exp_unified_prefill extra   # EXTRA's shapes
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback

HQ, HKV, D, BS = 32, 8, 128, 16
SHAPES = {
    # name: [(qlen, seqused_k), ...]
    "b4_q1024_ctx4096": [(1024, 5120)] * 4,
    "b1_8192": [(8192, 8192)],
    "mixed": [(1, 4096)] * 127 + [(2048, 10240)],
}


# variants also timed with the flat grid at b4_q1024_ctx4096
FLAT_TOO = ("paged_128x64_s3_pf1", "paged_128x128_s3_pf1", "gather_128x64_s3", "gather_128x128_s3",
            "gather_128x64_s4")


def useful_flops(seqs, min_q=9, d=D):
    """4 Hq D per visible (causal) query-key pair of the sequences the prefill
    path computes (qlen >= min_q)."""
    pairs = 0
    for ql, L in seqs:
        if ql >= min_q:
            ctx = L - ql
            pairs += ql * ctx + ql * (ql + 1) // 2
    return 4 * HQ * d * pairs


def make_inputs(seqs, dtype, seed=0, d=D, fp8=False):
    """Inputs of ``seqs`` (the cache in e4m3 with descales 0.5 / 0.25 with ``fp8``)."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    nbl = [-(-L // BS) for _, L in seqs]
    num_blocks = sum(nbl) + 1
    width = max(nbl)
    perm = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    bt = torch.zeros((len(seqs), width), dtype=torch.int32, device="cuda")
    pos = 0
    for b, n in enumerate(nbl):
        bt[b, :n] = perm[pos:pos + n]
        pos += n
    cache = torch.float8_e4m3fn if fp8 else dtype
    k = (torch.randn((num_blocks, BS, HKV, d), device="cuda", generator=g) * (2 if fp8 else 1)).to(cache)
    v = (torch.randn((num_blocks, BS, HKV, d), device="cuda", generator=g) * (4 if fp8 else 1)).to(cache)
    t = sum(q for q, _ in seqs)
    q = torch.randn((t, HQ, d), device="cuda", generator=g).to(dtype)
    cu = torch.tensor([0] + list(__import__("itertools").accumulate(q for q, _ in seqs)),
                      dtype=torch.int32, device="cuda")
    seqused = torch.tensor([L for _, L in seqs], dtype=torch.int32, device="cuda")
    inp = dict(q=q, k=k, v=v, cu_seqlens_q=cu, seqused_k=seqused, block_table=bt,
               max_seqlen_q=max(q for q, _ in seqs), max_seqlen_k=max(L for _, L in seqs))
    if fp8:
        inp.update(k_descale=torch.tensor([0.5], device="cuda"), v_descale=torch.tensor([0.25], device="cuda"))
    return inp


def sdpa_reference(inp, b):
    """Sequence b's [qlen, HQ, D] output by torch SDPA over its gathered K/V."""
    import torch
    import torch.nn.functional as F
    cu, L = inp["cu_seqlens_q"].tolist(), inp["seqused_k"].tolist()
    q = inp["q"][cu[b]:cu[b + 1]]
    ql, lk = q.shape[0], L[b]
    j = torch.arange(lk, device="cuda")
    blk = inp["block_table"][b, j // BS].long()
    kb, vb = inp["k"][blk, j % BS], inp["v"][blk, j % BS]  # [L, HKV, D]
    if "k_descale" in inp:
        kb = (kb.float() * inp["k_descale"]).to(q.dtype)
        vb = (vb.float() * inp["v_descale"]).to(q.dtype)
    pos = (lk - ql) + torch.arange(ql, device="cuda")
    mask = j[None, :] <= pos[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kb.transpose(0, 1)[None],
                                       vb.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True,
                                       scale=q.shape[-1] ** -0.5)
    return o[0].transpose(0, 1)


# the same B4 / B1 batches at other head sizes and with an fp8 cache (argument
# "extra"): shape -> (seqs, head size, fp8 cache, variants)
EXTRA = {
    "b4_q1024_ctx4096_fp8kv": ("b4_q1024_ctx4096", 128, True, ("auto", "paged_128x128_s3_pf1")),
    "b4_q1024_ctx4096_d64": ("b4_q1024_ctx4096", 64, False,
                             ("auto", "gather_128x64_w4", "gather_128x64_s3", "paged_128x128_w4")),
    "b4_q1024_ctx4096_d256": ("b4_q1024_ctx4096", 256, False,
                              ("auto", "gather_64x64_w4", "paged_128x64_s2")),
}


def run(names):
    import torch

    from adapters.torch._device import info, target_for
    from adapters.torch._executor import execute
    from benchmarks import timing
    from core_kernels._plan import Plan, memoize
    from core_kernels.unified_attention.prefill_plan import (UnifiedPrefillConfig,
                                                             choose_prefill_config, prefill_launches)
    from core_kernels.unified_attention.problem import validate

    @memoize
    def plan_prefill_only(target, q, k, v, cu_seqlens_q, seqused_k, block_table, out=None,
                          causal_flags=None, q_descale=None, k_descale=None, v_descale=None,
                          alibi_slopes=None, sinks=None, output_scale=None, *, config=None, **opts):
        p = validate(q, k, v, cu_seqlens_q, seqused_k, block_table, out, causal_flags, q_descale,
                     k_descale, v_descale, alibi_slopes, sinks, output_scale, **opts)
        b, launches = prefill_launches(target, p, config)
        return Plan({**p.buffers, **b}, tuple(launches), ("out",))

    C = UnifiedPrefillConfig
    variants = {
        "auto": None,
        "gather_128x64_s3": C(128, 64, 8, 3, True, 0, gather=True),
        "gather_128x128_s3": C(128, 128, 8, 3, True, 0, gather=True),
        "paged_128x128_s3_pf1": C(128, 128, 8, 3, True, 1, gather=False),
        "paged_128x64_s3_pf1": C(128, 64, 8, 3, True, 1, gather=False),
        "paged_128x64_s3_pf0": C(128, 64, 8, 3, True, 0, gather=False),
        "paged_128x64_s4_pf1": C(128, 64, 8, 4, True, 1, gather=False),
        "paged_128x128_s2_pf1": C(128, 128, 8, 2, True, 1, gather=False),
        "paged_64x64_s3_w4": C(64, 64, 4, 3, True, 1, gather=False),
        "gather_128x64_s4": C(128, 64, 8, 4, True, 0, gather=True),
        "gather_128x64_s2": C(128, 64, 8, 2, True, 0, gather=True),
        "paged_128x128_s3_pf2": C(128, 128, 8, 3, True, 2, gather=False),
        "gather_128x64_w4": C(128, 64, 4, 3, True, 0, gather=True),
        "paged_128x128_w4": C(128, 128, 4, 3, True, 1, gather=False),
        "gather_64x64_w4": C(64, 64, 4, 2, True, 0, gather=True),
        "paged_128x64_s2": C(128, 64, 8, 2, True, 1, gather=False),
    }
    extra = "extra" in names
    names = [n for n in names if n != "extra"]
    all_variants = dict(variants)
    if names:
        variants = {n: c for n, c in variants.items() if n in names or n == "auto"}
    shapes = {name: (seqs, D, False, variants) for name, seqs in SHAPES.items()}
    if extra:
        shapes = {name: (SHAPES[base], d, fp8, {v: all_variants[v] for v in vs})
                  for name, (base, d, fp8, vs) in EXTRA.items()}
    rows = []
    t_start = time.time()
    peer = None
    try:
        from benchmarks.bench_unified_attention import vllm_unified
        module, why = vllm_unified()
        if module is None:
            rows.append(dict(peer_missing=why))
        else:
            peer = module.unified_attention
            rows.append(dict(vllm_commit=why))
    except Exception:  # noqa: BLE001
        rows.append(dict(peer_import_error=traceback.format_exc()[-800:]))
    full = None
    try:
        from adapters.torch import unified_attention as full
    except ImportError:
        pass
    for shape, (seqs, d, fp8, variants) in shapes.items():
        inp = make_inputs(seqs, torch.bfloat16, d=d, fp8=fp8)
        flops = useful_flops(seqs, d=d)
        prefill_b = [b for b, (ql, _) in enumerate(seqs) if ql > 8][:2]
        refs = {b: sdpa_reference(inp, b) for b in prefill_b}
        cu = inp["cu_seqlens_q"].tolist()
        out = torch.empty_like(inp["q"])
        tensors = dict(q=inp["q"], k=inp["k"], v=inp["v"], cu_seqlens_q=inp["cu_seqlens_q"],
                       seqused_k=inp["seqused_k"], block_table=inp["block_table"], out=out,
                       causal_flags=None, q_descale=None, k_descale=inp.get("k_descale"),
                       v_descale=inp.get("v_descale"), alibi_slopes=None, sinks=None, output_scale=None)
        opts = dict(max_seqlen_q=inp["max_seqlen_q"], max_seqlen_k=inp["max_seqlen_k"],
                    softmax_scale=d ** -0.5, kv_quant_mode=1 if fp8 else 0)

        def err_of(o):
            return max(float((o[cu[b]:cu[b + 1]].float() - refs[b].float()).abs().max()) for b in prefill_b)

        for name, cfg in variants.items():
            if time.time() - t_start > float(os.environ.get("EXP_BUDGET_S", "420")):
                rows.append(dict(shape=shape, variant=name, skipped="time budget"))
                continue
            if shape == "mixed" and cfg is not None and cfg.gather:
                continue  # a 4 GiB scratch: never chosen there
            try:
                p = validate(**{n: (None if t is None else info(t)) for n, t in tensors.items()}, **opts)
                chosen = repr(choose_prefill_config(target_for(out.device), p, cfg)[0])
                fn = lambda: execute(plan_prefill_only, tensors, config=cfg, **opts)  # noqa: E731
                out.fill_(float("nan"))
                t0 = time.time()
                fn()
                torch.cuda.synchronize()
                compile_s = time.time() - t0
                err = err_of(out)
                t = timing.kernel_time_torch(fn)
                r = dict(shape=shape, variant=name, chosen=chosen, us=t * 1e6, tflops=flops / t / 1e12,
                         max_err=err, first_call_s=compile_s)
                if shape != "mixed" and name in FLAT_TOO:
                    cf = dataclasses.replace(cfg, flat_grid=True)
                    fn2 = lambda: execute(plan_prefill_only, tensors, config=cf, **opts)  # noqa: E731
                    fn2()
                    t2 = timing.kernel_time_torch(fn2)
                    r.update(flat_us=t2 * 1e6, flat_tflops=flops / t2 / 1e12, flat_err=err_of(out))
            except Exception:  # noqa: BLE001
                r = dict(shape=shape, variant=name, error=traceback.format_exc()[-1500:])
            print(r, flush=True)
            rows.append(r)
        if shape == "mixed" and not extra:
            # the per-sequence grid on the mixed batch (mostly idle programs)
            try:
                cfg = C(128, 64, 8, 3, True, 1, gather=False, flat_grid=False)
                fn = lambda: execute(plan_prefill_only, tensors, config=cfg, **opts)  # noqa: E731
                fn()
                t = timing.kernel_time_torch(fn, rep_ms=100)
                r = dict(shape=shape, variant="paged_128x64_pf1_dense_grid", us=t * 1e6,
                         tflops=flops / t / 1e12, max_err=err_of(out))
            except Exception:  # noqa: BLE001
                r = dict(shape=shape, variant="dense_grid", error=traceback.format_exc()[-1500:])
            print(r, flush=True)
            rows.append(r)
        for label, f in (("ours_full_op", full), ("vllm_unified_attention", peer)):
            if f is None or extra:
                continue
            try:
                o2 = torch.empty_like(inp["q"])
                call = lambda: f(q=inp["q"], k=inp["k"], v=inp["v"], out=o2,  # noqa: E731
                                 cu_seqlens_q=inp["cu_seqlens_q"], max_seqlen_q=inp["max_seqlen_q"],
                                 seqused_k=inp["seqused_k"], max_seqlen_k=inp["max_seqlen_k"],
                                 softmax_scale=D ** -0.5, causal=True, window_size=(-1, -1),
                                 block_table=inp["block_table"], softcap=0, q_descale=None,
                                 k_descale=None, v_descale=None)
                call()
                torch.cuda.synchronize()
                err = err_of(o2)
                t = timing.kernel_time_torch(call)
                r = dict(shape=shape, variant=label, us=t * 1e6, tflops=flops / t / 1e12, max_err=err)
            except Exception:  # noqa: BLE001
                r = dict(shape=shape, variant=label, error=traceback.format_exc()[-1500:])
            print(r, flush=True)
            rows.append(r)
        del inp, refs, tensors, out
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    import torch
    rows = [dict(device=torch.cuda.get_device_name(), torch=torch.__version__)]
    rows += run(sys.argv[1:])
    out_dir = os.environ.get("OUT", ".")
    name = "exp_unified_prefill_extra.json" if "extra" in sys.argv[1:] else "exp_unified_prefill.json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(rows, f, indent=1)

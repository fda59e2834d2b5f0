"""Experiment: torch SDPA's backends on issue 18's prefix-prefill case, beside ours.

The case: B 4 x 1024 new tokens over 4096 cached, 32 query / 8 KV heads, D 128,
bf16 and fp16. Useful FLOPs as ``bench_prefix_prefill.useful_flops`` counts them
(4·Hq·D per visible query-key pair). In one run, GPU time (do_bench, cold L2):

- ``ours``: ``context_attention_fwd`` on the paged cache (the planner's choice,
  the gather into dense scratch included), as ``bench_prefix_prefill`` times it;
- ``<backend> whole``: SDPA over the dense equivalent, queries [B, 32, 1024, D]
  against the context and new tokens [B, 32 (or 8 with GQA), 5120, D], masked by
  ``causal_lower_right`` (query i sees keys up to 4096 + i), per backend;
- ``<backend> parts``: the same work as two SDPA calls, the context part (no
  mask, 1024 x 4096) and the new tokens' causal part (1024 x 1024), each timed
  alone, and their sum; a split kernel would also merge the two (one
  ``merge_attn_states`` over [4096, 32, 128], timed here too: ``merge``).

K/V are stored dense and already expanded to 32 heads where a backend needs it
(what a paged cache costs is not in the SDPA figures). Errors (a backend that
refuses a form) are recorded per row. JSON to ``$OUT/exp_prefix_sdpa.json``.

    python3 -m benchmarks.experiments.exp_prefix_sdpa
"""
from __future__ import annotations

import json
import os
import traceback

B, HQ, HKV, D, NQ, CTX = 4, 32, 8, 128, 1024, 4096


def run():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    import adapters.torch as at
    from benchmarks import timing
    from benchmarks.bench_prefix_prefill import make_inputs, torch_call, useful_flops

    seqs = [(NQ, CTX)] * B
    flops = useful_flops(seqs, HQ, D)
    ctx_flops = 4 * HQ * D * B * NQ * CTX
    new_flops = flops - ctx_flops
    rows = [dict(name="dense-bf16-matmul", tflops=timing.matmul_tflops() / 1e12)]

    def row(name, fn, fl, dtype):
        try:
            fn()
            torch.cuda.synchronize()
            t = timing.kernel_time_torch(fn)
            r = dict(name=name, dtype=dtype, us=t * 1e6, tflops=fl / t / 1e12)
        except Exception as exc:  # noqa: BLE001  (a backend that refuses this form)
            r = dict(name=name, dtype=dtype, error=repr(exc)[:300])
        print(r, flush=True)
        rows.append(r)
        return r

    for dtype in ("bfloat16", "float16"):
        tdt = getattr(torch, dtype)
        inp = make_inputs(seqs, dtype, {})
        out = torch.empty_like(inp["q"])
        row("ours", torch_call(inp, out, {}), flops, dtype)
        del inp, out
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(B, HQ, NQ, D, device="cuda", dtype=tdt, generator=g)
        k8, v8 = (torch.randn(B, HKV, CTX + NQ, D, device="cuda", dtype=tdt, generator=g) for _ in range(2))
        k32, v32 = (x.repeat_interleave(HQ // HKV, dim=1) for x in (k8, v8))
        kc, vc, kn, vn = (x[:, :, s].contiguous() for s in (slice(0, CTX), slice(CTX, None))
                          for x in (k32, v32))
        bias = causal_lower_right(NQ, CTX + NQ)
        backends = dict(cudnn=SDPBackend.CUDNN_ATTENTION, flash=SDPBackend.FLASH_ATTENTION,
                        efficient=SDPBackend.EFFICIENT_ATTENTION)
        for label, backend in backends.items():
            def whole(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k32, v32, attn_mask=bias)

            def ctx_part(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, kc, vc)

            def new_part(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, kn, vn, is_causal=True)
            row(f"{label} whole (lower-right causal, K/V 32 heads)", whole, flops, dtype)
            a = row(f"{label} context part (1024 x 4096, no mask)", ctx_part, ctx_flops, dtype)
            b = row(f"{label} new part (1024 x 1024 causal)", new_part, new_flops, dtype)
            if "us" in a and "us" in b:
                t = (a["us"] + b["us"]) * 1e-6
                r = dict(name=f"{label} parts summed", dtype=dtype, us=t * 1e6, tflops=flops / t / 1e12)
                print(r, flush=True)
                rows.append(r)
        po, so = (torch.randn(B * NQ, HQ, D, device="cuda", dtype=tdt, generator=g) for _ in range(2))
        pl, sl = (torch.randn(HQ, B * NQ, device="cuda", generator=g) for _ in range(2))
        merged = torch.empty_like(po)
        row("merge [4096, 32, 128] (a split kernel's merge)",
            lambda: at.merge_attn_states(merged, po, pl, so, sl), 0, dtype)
        del q, k8, v8, k32, v32, kc, vc, kn, vn
        torch.cuda.empty_cache()
    return rows


def main():
    out = os.environ.get("OUT", "results")
    os.makedirs(out, exist_ok=True)
    try:
        rows = run()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        raise
    with open(os.path.join(out, "exp_prefix_sdpa.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

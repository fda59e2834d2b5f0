"""Experiment: unified_attention's split-KV decode path (decode_plan.py) under
config variants, at the issue's decode shapes, next to vLLM 0.33's kernel and a
device copy in the same run. GPU only.

    python3 -m benchmarks.experiments.exp_unified_decode [--out DIR] [--sweep NAME]

Llama-8B heads (32 query / 8 kv heads x 128, block 16), bf16 q; shapes: decode
B64 x 4096 (bf16 and fp8 e4m3 cache), B1 x 131072, and the decode part of the
mixed batch (127 decodes x 4096 beside one 2048-token chunk over 8192: the
decode launch alone, the prefill sequence skipped). Each (shape, config) runs
the decode path's own plan (problem.validate + decode_launches, no prefill
launch); GPU time per call with the L2 flushed before each run
(benchmarks.timing.kernel_time_torch), TB/s of the K/V bytes the decodes read.
The kernels of every variant are compiled first by worker processes in
parallel (the Triton cache is shared), so the timed process only loads them.
Also checked: the output against a float32 reference, bit equality run to run,
and one sequence computed alone vs inside the batch (bitwise). vLLM's kernel
comes from .peer/ (git-ignored) as in bench_unified_attention.py.
JSON to DIR/exp_unified_decode.json.
"""
import argparse
import concurrent.futures as cf
import dataclasses
import json
import multiprocessing as mp
import os
import time
import traceback
from pathlib import Path

SHAPES = {
    "decode-64x4096": ([(1, 4096)] * 64, {}),
    "decode-64x4096-fp8": ([(1, 4096)] * 64, {"kv_fp8": True}),
    "decode-1x131072": ([(1, 131072)], {}),
    "mixed-decode-part": ([(2048, 8192)] + [(1, 4096)] * 127, {}),
    "decode-1x4096": ([(1, 4096)], {}),
    "decode-8x4096": ([(1, 4096)] * 8, {}),
    "spec4-64x4096": ([(4, 4096)] * 64, {}),
}
# config variants: (block_n, chunk_min, max_chunks, num_warps, num_stages, fp8_mode, pps),
# pps = programs per SM the work split aims at (turned into chunks_per_program per shape).
# The "slim" run quoted in decode_plan.py's NOTE had fp8_mode 2 (e4m3 -> fp16 by
# integer ops, since removed) where these entries have 1, and 1 where they have 0.
SWEEPS = {
    "second": [
        (64, 512, 64, 4, 3, 1, 2), (64, 1024, 64, 4, 3, 1, 2), (64, 2048, 64, 4, 3, 1, 2),
        (64, 4096, 32, 4, 3, 1, 2), (128, 1024, 64, 4, 2, 1, 2), (128, 1024, 64, 4, 3, 1, 2),
        (64, 1024, 64, 4, 4, 1, 2), (64, 1024, 64, 4, 3, 1, 1), (64, 1024, 64, 4, 3, 1, 4),
        (64, 1024, 64, 4, 3, 0, 2), (128, 1024, 64, 8, 3, 1, 2),
        (32, 512, 64, 4, 4, 1, 2),
    ],
    "slim": [
        (64, 1024, 64, 4, 3, 1, 2), (64, 512, 64, 4, 3, 1, 2), (64, 2048, 64, 4, 3, 1, 2),
        (64, 4096, 32, 4, 3, 1, 2), (128, 1024, 64, 4, 2, 1, 2), (64, 1024, 64, 4, 3, 0, 2),
        (64, 1024, 64, 4, 3, 1, 1),
    ],
}
FP8_ONLY = lambda c: c[5] != 1  # noqa: E731  fp8_mode variants: the fp8 shape only


def _model():
    from benchmarks.registry import UNIFIED_MODEL
    return UNIFIED_MODEL


def _inputs(shape):
    from benchmarks.bench_unified_attention import make_inputs
    seqs, opts = SHAPES[shape]
    return make_inputs(seqs, opts)


def _plan(inp, out, config):
    """The decode path's plan alone (validate + decode_launches) and its tensors."""
    from adapters.torch._device import info, target_for
    from core_kernels._plan import Plan
    from core_kernels.unified_attention.decode_plan import decode_launches
    from core_kernels.unified_attention.problem import validate
    tensors = dict(q=inp["q"], k=inp["k"], v=inp["v"], cu_seqlens_q=inp["cu_seqlens_q"],
                   seqused_k=inp["seqused_k"], block_table=inp["block_table"], out=out,
                   k_descale=inp["k_descale"], v_descale=inp["v_descale"])
    p = validate(**{n: (None if t is None else info(t)) for n, t in tensors.items()},
                 max_seqlen_q=inp["max_seqlen_q"], max_seqlen_k=inp["max_seqlen_k"],
                 softmax_scale=inp["softmax_scale"], kv_quant_mode=1 if inp["kv_fp8"] else 0)
    buffers, launches = decode_launches(target_for(out.device), p, config)
    return Plan({**p.buffers, **buffers}, tuple(launches), ("out",)), tensors


def _call(inp, out, config):
    from adapters.torch._executor import run_plan
    plan, tensors = _plan(inp, out, config)
    return lambda: run_plan(plan, tensors, None, out.device)


def _config(c, shape):
    """UnifiedDecodeConfig of sweep entry ``c`` at ``shape`` (pps -> chunks_per_program
    as the planner computes it for 132 SMs)."""
    from core_kernels.unified_attention.decode_plan import UnifiedDecodeConfig
    seqs, _ = SHAPES[shape]
    block_n, chunk_min, max_chunks, warps, stages, fp8_mode, pps = c
    slots = max(1, min(max_chunks, -(-max(kv for _, kv in seqs) // chunk_min)))
    per = max(1, min(slots, -(-len(seqs) * _model()["hkv"] * slots // (pps * 132))))
    return UnifiedDecodeConfig(block_n, chunk_min, max_chunks, warps, stages, fp8_mode, per)


def _configs(shape, configs):
    return [c for c in configs if SHAPES[shape][1].get("kv_fp8") or not FP8_ONLY(c)]


def _warm(shape, configs):
    """Worker: compile (run once) every config at one shape."""
    import torch
    inp = _inputs(shape)
    out = torch.empty_like(inp["q"])
    errors = {}
    for c in _configs(shape, configs):
        try:
            _call(inp, out, _config(c, shape))()
        except Exception as e:  # noqa: BLE001
            errors[str(c)] = repr(e)[:300]
    torch.cuda.synchronize()
    return shape, errors


def _decode_bytes(shape, itemsize):
    m = _model()
    seqs, _ = SHAPES[shape]
    return 2 * sum(kv for q, kv in seqs if q <= 8) * m["hkv"] * m["d"] * itemsize


def _ref_error(inp, out, b):
    from benchmarks.bench_unified_attention import reference_error
    return reference_error(inp, out, b)


def run(out_dir: Path, sweep: str, shapes):
    import torch
    from benchmarks import timing
    from benchmarks.bench_unified_attention import vllm_call, vllm_unified
    configs = SWEEPS[sweep]
    res = dict(sweep=sweep, device=torch.cuda.get_device_name(),
               rows=[], errors={})
    path = out_dir / "exp_unified_decode.json"

    def dump():
        path.write_text(json.dumps(res, indent=1))

    # 1. compile every (shape, config) in parallel worker processes
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=min(14, len(shapes) * 2), mp_context=ctx) as pool:
        jobs = [pool.submit(_warm, s, _configs(s, configs)[i::2]) for s in shapes for i in range(2)]
        for j in cf.as_completed(jobs):
            try:
                shape, errors = j.result()
                res["errors"].update({f"{shape} {k}": v for k, v in errors.items()})
            except Exception as e:  # noqa: BLE001
                res["errors"][f"warm worker"] = repr(e)[:300]
    res["compile_s"] = time.time() - t0
    dump()

    # 2. the copy roofline
    src = torch.empty(2 ** 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t = timing.kernel_time_torch(lambda: dst.copy_(src))
    res["copy_TBps"] = 2 * src.numel() * 2 / t / 1e12
    del src, dst

    vllm, commit = vllm_unified() if not os.environ.get("NO_VLLM") else (None, None)
    res["vllm"] = commit if vllm is not None else None
    for shape in shapes:
        inp = _inputs(shape)
        itemsize = inp["k"].element_size()
        nbytes = _decode_bytes(shape, itemsize)
        seqs, _ = SHAPES[shape]
        check_b = len(seqs) - 1
        row = dict(shape=shape, bytes=nbytes, results=[])
        if vllm is not None and shape != "mixed-decode-part" and not shape.startswith("spec"):
            try:
                v_out = torch.empty_like(inp["q"])
                vcall = vllm_call(vllm, inp, v_out)
                vcall()
                t = timing.kernel_time_torch(vcall)
                row.update(vllm_us=t * 1e6, vllm_TBps=nbytes / t / 1e12)
            except Exception as e:  # noqa: BLE001
                row["vllm_error"] = repr(e)[:300]
        for c in _configs(shape, configs):
            r = dict(config=list(c))
            try:
                out = torch.full_like(inp["q"], float("nan"))
                cfg = _config(c, shape)
                r["chunks_per_program"] = cfg.chunks_per_program
                call = _call(inp, out, cfg)
                call()
                torch.cuda.synchronize()
                r["max_err"] = _ref_error(inp, out, check_b)
                first = out.clone()
                t = timing.kernel_time_torch(call)
                r.update(us=t * 1e6, TBps=nbytes / t / 1e12)
                r["run_to_run_bitwise"] = bool(torch.equal(out.nan_to_num(), first.nan_to_num()))
            except Exception as e:  # noqa: BLE001
                r["error"] = traceback.format_exc()[-600:]
            row["results"].append(r)
            dump()
        res["rows"].append(row)
        del inp
        torch.cuda.empty_cache()
    # 3. batch invariance on the GPU: sequence 5 alone vs inside the batch (default config)
    try:
        res["invariance"] = invariance()
    except Exception:  # noqa: BLE001
        res["invariance"] = traceback.format_exc()[-600:]
    dump()
    return res


def invariance():
    """Sequence 5 of a 16-sequence batch (lengths 1 .. 40000, qlen 1-4) computed
    alone (its own table row, max_seqlen_k = its length) vs in the batch: bitwise."""
    import torch
    from benchmarks.bench_unified_attention import make_inputs
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 40000, (16,), generator=g).tolist()
    qls = torch.randint(1, 5, (16,), generator=g).tolist()
    seqs = [(q, max(q, kv)) for q, kv in zip(qls, lens)]
    inp = make_inputs(seqs, {})
    out = torch.full_like(inp["q"], float("nan"))
    _call(inp, out, None)()
    b = 5
    s0, s1 = int(inp["cu_seqlens_q"][b]), int(inp["cu_seqlens_q"][b + 1])
    alone = dict(inp, q=inp["q"][s0:s1].contiguous(),
                 cu_seqlens_q=torch.tensor([0, s1 - s0], dtype=torch.int32, device="cuda"),
                 seqused_k=inp["seqused_k"][b:b + 1].contiguous(),
                 block_table=inp["block_table"][b:b + 1].contiguous(),
                 max_seqlen_q=s1 - s0, max_seqlen_k=seqs[b][1])
    out1 = torch.full_like(alone["q"], float("nan"))
    _call(alone, out1, None)()
    # the same batch with another work split (one chunk per program)
    import dataclasses
    from core_kernels.unified_attention.decode_plan import DEFAULT_CONFIG
    out2 = torch.full_like(inp["q"], float("nan"))
    _call(inp, out2, dataclasses.replace(DEFAULT_CONFIG, chunks_per_program=1))()
    torch.cuda.synchronize()
    return dict(seq=seqs[b], bitwise=bool(torch.equal(out[s0:s1], out1)),
                max_diff=float((out[s0:s1].float() - out1.float()).abs().max()),
                split_bitwise=bool(torch.equal(out, out2)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", default="slim")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = run(out, args.sweep, args.shapes.split(","))
    for row in res["rows"]:
        best = min((r for r in row["results"] if "us" in r), key=lambda r: r["us"], default=None)
        print(row["shape"], "vllm", row.get("vllm_us"), "best", best)
    print("copy TB/s", res.get("copy_TBps"), "invariance", res.get("invariance"))


if __name__ == "__main__":
    main()

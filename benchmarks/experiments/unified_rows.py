"""benchmarks/results/bench_unified_attention.json from the committed H200
experiment outputs of the unified_attention paths, for benchmarks/summary.py.

The rows are the shipped configs' measurements, vLLM 0.33's kernel timed in the
same runs: the decode path (exp_unified_decode.py "slim" sweep, 2026-11-28, code
of 5ccd1a4; the shipped default is its (64, 1024, 64, 4, 3) config, fp8 with
fp16 dots) and the prefill path and whole op (exp_unified_prefill.py,
2026-11-28, code of f3823a1). GPU time per call after warm-up (decode with the
L2 flushed, prefill by do_bench), bf16, 32/8 heads x 128, block 16. They were
not produced by bench_unified_attention.py: its run on the final tree is still
to come (no JAX columns here; the device time of that stop was spent).

    python -m benchmarks.experiments.unified_rows        (rewrites the JSON)
"""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results"
DECODE = RESULTS / "2026-11-28-unified-decode" / "exp_unified_decode_slim.json"
PREFILL = RESULTS / "2026-11-28-unified-prefill" / "exp_unified_prefill_h200.json"
BASELINE = "vLLM 0.33 unified_attention (same run)"
# the shipped decode default: (block_n, chunk_min, max_chunks, warps, stages) and,
# in this sweep's tuples, fp8_mode (1: fp16 dots) and programs per SM (2)
SHIPPED = (64, 1024, 64, 4, 3)
DECODE_NAMES = {"decode-64x4096": "decode-B64x4096-bf16", "decode-64x4096-fp8": "decode-B64x4096-fp8kv",
                "decode-1x131072": "decode-B1x131072-bf16", "decode-1x4096": "decode-B1x4096-bf16"}
PREFILL_NAMES = {"b4_q1024_ctx4096": "prefill-B4xq1024-ctx4096-bf16",
                 "b1_8192": "prefill-B1x8192-bf16", "mixed": "mixed-2048over8192+127x4096-bf16"}


def _decode_rows(d: dict) -> list:
    rows = []
    for r in d["rows"]:
        name = DECODE_NAMES.get(r["shape"])
        if name is None:
            continue
        fp8 = r["shape"].endswith("fp8")
        [best] = [x for x in r["results"] if tuple(x["config"][:5]) == SHIPPED
                  and x["config"][5] == (1 if fp8 else 2) and x["config"][6] == 2]
        row = {"name": name, "dtype": "bfloat16", "torch_us": best["us"], "TB/s": best["TBps"],
               "%roofline": 100 * best["TBps"] / d["copy_TBps"], "max_err": best["max_err"],
               "source": f"{DECODE.parent.name}/{DECODE.name} (5ccd1a4)"}
        if "vllm_us" in r:
            row.update(vllm_us=r["vllm_us"], baseline=BASELINE, baseline_us=r["vllm_us"],
                       vs_vllm=r["vllm_us"] / best["us"])
        rows.append(row)
    return rows


def _prefill_rows(d: list) -> list:
    by = {}
    for r in d:
        if "shape" in r:
            by.setdefault(r["shape"], {})[r["variant"]] = r
    rows = []
    for shape, name in PREFILL_NAMES.items():
        ours, vllm = by[shape]["ours_full_op"], by[shape]["vllm_unified_attention"]
        rows.append({"name": name, "dtype": "bfloat16", "torch_us": ours["us"],
                     "TFLOP/s": ours["tflops"], "max_err": ours["max_err"], "vllm_us": vllm["us"],
                     "baseline": BASELINE, "baseline_us": vllm["us"],
                     "vs_vllm": vllm["us"] / ours["us"],
                     "source": f"{PREFILL.parent.name}/{PREFILL.name} (f3823a1)"})
    return rows


def main() -> None:
    decode = json.loads(DECODE.read_text())
    rows = [{"name": "copy-bandwidth", "TB/s": decode["copy_TBps"], "device": decode["device"],
             "date": "2026-11-28", "note": " ".join(__doc__.split("\n\n")[0].split())}]
    rows += _decode_rows(decode) + _prefill_rows(json.loads(PREFILL.read_text()))
    (RESULTS / "bench_unified_attention.json").write_text(json.dumps(rows, indent=1) + "\n")
    for r in rows:
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items() if k != "source"})


if __name__ == "__main__":
    main()

"""One uniform table over every benchmark: DIR/summary.json.

Each ``bench_<op>.py`` writes rows with its own columns (``us`` or ``torch_us``
or ``time_us``; ``TB/s`` or ``TFLOP/s``; ``sdpa_us``, ``compile_us``,
``baseline``/``baseline_us``, ...). ``summary_rows(op, rows)`` maps them to

    {"op", "case", "dtype", "time_us", "metric", "value", "baseline", "baseline_us", "ratio"}

through ``OPS`` below (one entry per bench module), where
``ratio = baseline_us / time_us`` (> 1: ours is faster) and ``baseline``,
``baseline_us`` and ``ratio`` are None where the row has no baseline.

Rows without our time column are skipped: reference rows (``copy-bandwidth``,
``dense-bf16-matmul``), error rows and prefix prefill's ``default-pipelined``
rows (the JAX/torch comparison of the case's ``default`` row). So are rows
that time something other than our kernel, named in an entry's ``skip``
(merge's host-overhead row, prefix prefill's dense SDPA row). An op missing
from ``OPS`` gets ``FALLBACK``: the first of the usual columns each row has.
``bench_blocksparse_backward`` and ``bench_lightning_backward`` print and
return no rows: they give no summary rows.

``write_summary(out_dir, per_op)`` writes ``{"generated": <UTC ISO time>,
"rows": [...]}``, keeping the rows of an existing summary.json whose op is not
in ``per_op``. ``python -m benchmarks.summary [DIR] [--write]`` prints the
summary of DIR/bench_*.json (default benchmarks/results) and, with --write,
writes DIR/summary.json.
"""
from __future__ import annotations

import datetime
import glob
import json
import math
import os
import re
import sys

FIELDS = ("op", "case", "dtype", "time_us", "metric", "value", "baseline", "baseline_us", "ratio")

# Per op: ``case``: the string columns joined (" / ") into the case name;
# ``time``: our time in us, ``metric``: (column, label) of the figure of merit,
# each a tuple of candidates (the first the row has wins); ``dtype``: a
# column, else the constant ``dtype_const``, else parsed from the case name;
# ``baseline``: (kind, label, column), kind one of
#   "column":  baseline_us = row[column]                  (measured in the same run)
#   "speedup": baseline_us = time_us * row[column]        (column = baseline / ours)
#   "row":     the row's own "baseline" / "baseline_us"; a row that times the
#              baseline itself (its time == baseline_us, lightning's
#              "-torch.compile" / "-jnp-jit" / "-jnp-scan" rows) is turned round:
#              ours = baseline_us / row[column], the rate metric scaled alike;
# ``skip``: name prefixes of rows that do not time our kernel.
OPS = {
    "blocksparse_attention": dict(
        case=("name", "variant"), time=("time_us",), metric=(("tflops", "TFLOP/s"),),
        dtype_const="bfloat16",  # the module runs bf16 only
        baseline=("column", "torch SDPA (dense causal)", "sdpa_us")),
    "composability": dict(
        case=("case", "what"), time=("us",), metric=(),  # timings only, no rate
        baseline=("row", None, "ratio")),
    "host_overhead": dict(  # host time per call (us), not GPU time
        case=("name",), time=("torch_us",), metric=(("x_triton", "host time / plain Triton launch's"),),
        baseline=("column", "plain Triton launch (host time)", "triton_us")),
    "lightning_attention": dict(
        case=("name",), time=("us",), metric=(("TB/s", "TB/s"),),
        baseline=("row", None, "vs_baseline")),
    "lightning_varlen": dict(
        case=("name",), time=("us",), metric=(("TB/s", "TB/s"),),
        baseline=("column", "loop of lightning_attention calls", "loop_us")),
    "merge_attn_states": dict(
        case=("name",), time=("torch_us",), metric=(("TB/s", "TB/s"),), dtype="dtype",
        # each row names its baseline: torch.compile from 4096 tokens, vLLM's kernel below
        baseline=("row", None, None),
        skip=("host-overhead",)),  # host time per call, not a kernel time
    "reshape_and_cache_flash": dict(
        case=("name",), time=("torch_us",), metric=(("GB/s", "GB/s"),), dtype="dtype",
        baseline=("row", None, None)),   # each case names its baseline: torch index_copy_
    "scaleout": dict(  # two GPUs against one (bench_scaleout.py)
        case=("name", "framework", "variant"), time=("us",), metric=(("speedup", "x one GPU"),),
        baseline=("column", "one GPU (same process)", "one_gpu_us")),
    "prefix_prefill": dict(
        case=("name", "config"), time=("torch_us",), metric=(("TFLOP/s", "TFLOP/s"),),
        # vs_baseline = our TFLOP/s / 139: the modelled kernel's rate on this shape's FLOPs
        baseline=("speedup", "modelled kernel at 139 TFLOP/s", "vs_baseline"),
        skip=("torch-sdpa",)),  # the dense SDPA reference row
    "unified_attention": dict(
        case=("name",), time=("torch_us",), metric=(("TB/s", "TB/s"), ("TFLOP/s", "TFLOP/s")),
        dtype="dtype",
        # each row names its baseline: vLLM's kernel in the same run (where .peer/ has it)
        baseline=("row", None, None),
        skip=("host-overhead",)),  # host time per call, not a kernel time
}
FALLBACK = dict(
    case=("name", "case", "variant", "config", "what"), time=("us", "time_us", "torch_us"),
    metric=(("TB/s", "TB/s"), ("TFLOP/s", "TFLOP/s"), ("tflops", "TFLOP/s"), ("tbps", "TB/s")),
    dtype="dtype", baseline=("row", None, None))

# dtype spellings in case names
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "float32": "float32", "fp32": "float32"}


def _num(v):
    """v as a float when it is a finite number (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _first(row, columns):
    """(column, value) of the first column with a number in row, else (None, None)."""
    for c in columns:
        if _num(row.get(c)) is not None:
            return c, _num(row[c])
    return None, None


def _dtype(row, spec, case):
    col = spec.get("dtype")
    if col and isinstance(row.get(col), str):
        return row[col]
    if spec.get("dtype_const"):
        return spec["dtype_const"]
    for tok in re.split(r"[^A-Za-z0-9]+", case):
        if tok.lower() in _DTYPES:
            return _DTYPES[tok.lower()]
    return None


def _summary_row(op, row, spec):
    _, t = _first(row, spec["time"])
    if t is None:
        return None  # not a timed case of ours (reference, error or pipelined-only row)
    name = str(row.get("name", row.get("case", "")))
    if name.startswith(tuple(spec.get("skip", ()))):
        return None
    case = " / ".join(str(row[c]) for c in spec["case"] if isinstance(row.get(c), str))
    metric, value = None, None
    for col, label in spec["metric"]:
        if _num(row.get(col)) is not None:
            metric, value = label, _num(row[col])
            break
    kind, label, col = spec["baseline"]
    b_us = None
    if kind == "column":
        b_us = _num(row.get(col))
    elif kind == "speedup" and _num(row.get(col)) is not None:
        b_us = t * _num(row[col])
    elif kind == "row":
        label, b_us = row.get("baseline"), _num(row.get("baseline_us"))
        speedup = _num(row.get(col)) if col else None
        if b_us is not None and speedup and math.isclose(b_us, t, rel_tol=1e-9):
            # the row times the baseline: our time is baseline / speedup, a rate goes up alike
            t = b_us / speedup
            value = None if value is None else value * speedup
    if b_us is None:
        label = None
    return dict(op=op, case=case, dtype=_dtype(row, spec, case), time_us=t, metric=metric,
                value=value, baseline=None if label is None else str(label), baseline_us=b_us,
                ratio=None if b_us is None or t <= 0 else b_us / t)


def summary_rows(op: str, rows) -> list[dict]:
    """One op's bench rows in the uniform schema (FIELDS); see the module docstring."""
    spec = OPS.get(op, FALLBACK)
    if not isinstance(rows, list):  # the backward benches' run() returns None
        return []
    out = (_summary_row(op, r, spec) for r in rows if isinstance(r, dict))
    return [r for r in out if r is not None]


def write_summary(out_dir, per_op: dict) -> list[dict]:
    """Write out_dir/summary.json = {"generated": UTC ISO time, "rows": [...]}: the summary
    rows of every op in ``per_op`` ({op: its bench rows}) plus the rows of other ops in an
    existing summary.json (a run of some ops keeps the others). Returns the rows written."""
    path = os.path.join(out_dir, "summary.json")
    kept = []
    try:
        with open(path) as f:
            old = json.load(f)
        old = old.get("rows", []) if isinstance(old, dict) else old
        kept = [r for r in old if isinstance(r, dict) and r.get("op") not in per_op]
    except (OSError, ValueError, AttributeError):
        pass  # no summary yet, or unreadable: start afresh
    rows = kept + [r for op in sorted(per_op) for r in summary_rows(op, per_op[op])]
    rows.sort(key=lambda r: str(r.get("op")))  # stable: each op's rows stay in bench order
    doc = {"generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "rows": rows}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return rows


def load_dir(d) -> dict:
    """{op: rows} of every d/bench_<op>.json."""
    per_op = {}
    for p in sorted(glob.glob(os.path.join(d, "bench_*.json"))):
        with open(p) as f:
            per_op[os.path.basename(p)[len("bench_"):-len(".json")]] = json.load(f)
    return per_op


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    write = "--write" in args
    dirs = [a for a in args if a != "--write"]
    d = dirs[0] if dirs else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    per_op = load_dir(d)
    rows = write_summary(d, per_op) if write else [r for op in per_op for r in summary_rows(op, per_op[op])]

    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))
    widths = {c: max([len(c)] + [len(fmt(r.get(c))) for r in rows]) for c in FIELDS}
    print("  ".join(c.ljust(widths[c]) for c in FIELDS))
    for r in rows:
        print("  ".join(fmt(r.get(c)).ljust(widths[c]) for c in FIELDS))
    return 0


if __name__ == "__main__":
    sys.exit(main())

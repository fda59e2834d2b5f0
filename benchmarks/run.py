"""Run benchmarks on a GPU: ``python3 -m benchmarks.run [op ...] --out DIR``.

Each ``benchmarks/bench_<op>.py`` exposes ``run() -> list[dict]`` (one row per
case, plain numbers and strings) and ``COLUMNS`` (the columns to print).
Results go to DIR/bench_<op>.json and a PNG plot per op (where the module
provides ``plot(rows, path)``).

After all ops ran, DIR/summary.json gets one uniform row per case of every op
(op, case, dtype, time_us, metric, value, baseline, baseline_us, ratio; see
benchmarks/summary.py). Rows of ops not run this time (or that failed) are kept
from an existing summary.json, so running one op does not drop the others.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
import traceback

from benchmarks.summary import write_summary


def available_ops():
    here = os.path.dirname(__file__)
    return sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules([here])
                  if m.name.startswith("bench_"))


def print_table(rows, columns):
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("ops", nargs="*", default=[])
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    ops = args.ops or available_ops()
    failed = False
    per_op = {}  # rows of each op that ran, for summary.json
    for op in ops:
        print(f"\n=== {op}", flush=True)
        try:
            mod = importlib.import_module(f"benchmarks.bench_{op}")
            rows = mod.run()
        except Exception:
            traceback.print_exc()
            failed = True
            continue
        with open(os.path.join(args.out, f"bench_{op}.json"), "w") as f:
            json.dump(rows, f, indent=1)
        per_op[op] = rows
        if hasattr(mod, "plot"):
            try:
                mod.plot(rows, os.path.join(args.out, f"bench_{op}.png"))
            except Exception:
                traceback.print_exc()
        if rows and hasattr(mod, "COLUMNS"):  # the backward benches print and return None
            print_table(rows, mod.COLUMNS)
    try:
        write_summary(args.out, per_op)
    except Exception:  # the per-op JSON files are written already
        traceback.print_exc()
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Compare two benchmark runs row by row: ``python3 -m benchmarks.compare OLD_DIR NEW_DIR [op ...]``.

Rows are matched by their string fields (name, variant, config, dtype, ...); for
every time column both runs have (``*_us`` and ``us``) it prints new / old, and
a summary per op of the kernel-time columns. Used to check that a change
which should not move performance (a refactor) stays within run-to-run noise
of the committed figures (benchmarks/results/).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

# the columns that time our kernels (the others time baselines or frameworks' own code)
OURS = ("us", "torch_us", "jax_us", "time_us", "gpu_us", "graph_us", "torch_pipe_us",
        "torch_pipelined_us", "jax_pipelined_us", "torch_with_ctx_us")


def _key(row):
    return tuple(sorted((k, v) for k, v in row.items()
                        if isinstance(v, str) and k not in ("run", "bitwise", "best_config")))


def compare(old_rows, new_rows):
    old = {_key(r): r for r in old_rows}
    out = []
    for r in new_rows:
        o = old.get(_key(r))
        if o is None:
            continue
        for col in OURS:
            a, b = o.get(col), r.get(col)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0:
                out.append((dict(_key(r)), col, a, b, b / a))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("ops", nargs="*")
    args = ap.parse_args(argv)
    ops = args.ops or sorted(f[len("bench_"):-len(".json")] for f in os.listdir(args.new)
                             if f.startswith("bench_") and f.endswith(".json"))
    for op in ops:
        paths = [os.path.join(d, f"bench_{op}.json") for d in (args.old, args.new)]
        if not all(os.path.exists(p) for p in paths):
            print(f"=== {op}: missing in one run")
            continue
        rows = compare(*(json.load(open(p)) for p in paths))
        print(f"=== {op}: {len(rows)} timings matched")
        for key, col, a, b, ratio in rows:
            label = " ".join(str(v) for v in key.values())
            flag = "  <-- slower" if ratio > 1.05 else ("  <-- faster" if ratio < 0.95 else "")
            print(f"  {label:55s} {col:20s} {a:10.2f} -> {b:10.2f} us  x{ratio:.3f}{flag}")
        if rows:
            ratios = [r[-1] for r in rows]
            print(f"  median new/old {statistics.median(ratios):.3f}, "
                  f"min {min(ratios):.3f}, max {max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

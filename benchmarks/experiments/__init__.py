"""One-off GPU experiments (see README.md); ``run_parts`` is their shared command line."""
from __future__ import annotations


def run_parts(name: str, parts: dict, default: str) -> None:
    """``python -m benchmarks.experiments.<name> [--out DIR] [--only a,b]``: run the
    named parts (zero-argument functions returning rows) in order and write all
    their rows to ``DIR/<name>.json`` (DIR defaults to $OUT, else the current one)."""
    import argparse
    import json
    import os
    from pathlib import Path
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.experiments.{name}")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", default=default, help=f"comma-separated, of: {','.join(parts)}")
    a = ap.parse_args()
    rows = []
    for part in a.only.split(","):
        rows += parts[part]()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"{name}.json").write_text(json.dumps(rows, indent=1))

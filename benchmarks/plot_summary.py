"""The README's "performance at a glance" plot: speed-ups of each op against its peers.

    PYTHONPATH=/path/to/matplotlib python -m benchmarks.plot_summary [--out docs/img/speedups.png]

Speed-up = the peer's time / ours (> 1: ours is faster). Rows come from
benchmarks/results/summary.json where the summary has the pair (same run); the pairs
measured by experiments or by the backward benchmarks, which write no summary rows, are
listed in ``MEASURED`` with the RESULTS.md section they come from. Nothing here is
measured: the script only reads and draws committed figures.
"""
from __future__ import annotations

import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY = os.path.join(ROOT, "benchmarks", "results", "summary.json")

# (label, op, case in summary.json, peer label): ratio read from the summary row
FROM_SUMMARY = [
    ("merge 16384x32x128", "merge_attn_states", "llama8b-N16384-bfloat16", "torch.compile"),
    ("merge 64x32x128", "merge_attn_states", "llama8b-N64-bfloat16", "vLLM kernel"),
    ("prefix prefill B4 q1024 ctx4096", "prefix_prefill", "B4-q1024-ctx4096-bf16 / default", "vLLM kernel"),
    ("lightning prefill fp32 B1 H64 N4096", "lightning_attention", "prefill-B1-H64-N4096-float32", "vLLM kernel"),
    ("lightning prefill fp32 B1 H64 N4096", "lightning_attention", "prefill-B1-H64-N4096-float32-jnp-scan", "jnp"),
    ("lightning decode B64", "lightning_attention", "decode-B64-bfloat16", "vLLM kernel"),
    ("lightning decode B64", "lightning_attention", "decode-B64-bfloat16-torch.compile", "torch.compile"),
    ("lightning decode B64", "lightning_attention", "decode-B64-bfloat16-jnp-jit", "jnp"),
    ("lightning varlen B16", "lightning_varlen", "varlen-B16-mixed256-8192-bfloat16", "loop of calls"),
    ("block-sparse prefill 1x16384", "blocksparse_attention", "prefill-1x16384 / default", "dense SDPA"),
    ("block-sparse decode 64x4096", "blocksparse_attention", "decode-64x4096 / default", "dense SDPA"),
]
# (label, peer label, peer time, our time, source): pairs outside summary.json (us)
MEASURED = [
    ("merge 16384x32x128", "vLLM kernel", 344.6, 101.4,
     "RESULTS.md, merge_attn_states: full bench at f16911f (2026-11-25)"),
    ("prefix prefill B4 q1024 ctx4096", "SDPA (flash)", 962.0, 724.0,
     "RESULTS.md, prefix prefill against torch SDPA's backends (2026-11-25)"),
    ("prefix prefill B4 q1024 ctx4096", "SDPA (cuDNN)", 1077.0, 724.0,
     "RESULTS.md, prefix prefill against torch SDPA's backends (2026-11-25)"),
    ("block-sparse prefill 1x16384", "vLLM kernel", 1520.0, 1296.5,
     "RESULTS.md, block-sparse full bench at 4f507d1; the modelled kernel's 1.52 ms"),
    ("block-sparse fwd+bwd 1x16384", "dense SDPA", 14410.0, 5590.0,
     "RESULTS.md, block-sparse backward in Gluon (7932685, 2026-11-25)"),
    ("lightning fwd+bwd bf16 B1 H64 N4096", "FLA", 2629.0, 823.0,
     "RESULTS.md, lightning backward on the forward's kernels (5d6f83f, 2026-11-24)"),
    ("lightning varlen fwd+bwd B16", "FLA", 13942.0, 5839.0,
     "RESULTS.md, lightning varlen backward (2026-11-24)"),
]
ORDER = ["merge 16384x32x128", "merge 64x32x128", "prefix prefill B4 q1024 ctx4096",
         "lightning prefill fp32 B1 H64 N4096", "lightning fwd+bwd bf16 B1 H64 N4096",
         "lightning decode B64", "lightning varlen B16", "lightning varlen fwd+bwd B16",
         "block-sparse prefill 1x16384", "block-sparse fwd+bwd 1x16384", "block-sparse decode 64x4096"]
# vLLM's merge kernel is timed in every merge run; the other vLLM figures are the
# benches' fixed reference times (RESULTS.md, "The modelled kernel")
LEGEND = {"vLLM kernel": "vLLM kernel (merge: same run; others: earlier run)"}
PEER_COLORS = {"vLLM kernel": "#d62728", "torch.compile": "#1f77b4", "jnp": "#9467bd",
               "FLA": "#2ca02c", "dense SDPA": "#ff7f0e", "SDPA (flash)": "#ff7f0e",
               "SDPA (cuDNN)": "#e6a04d", "loop of calls": "#7f7f7f"}


def speedups(summary_path: str = SUMMARY) -> list[tuple[str, str, float]]:
    """[(case label, peer, speed-up)] in the plot's order."""
    with open(summary_path) as f:
        rows = {(r["op"], r["case"]): r for r in json.load(f)["rows"]}
    out = []
    for label, op, case, peer in FROM_SUMMARY:
        out.append((label, peer, float(rows[(op, case)]["ratio"])))
    for label, peer, theirs, ours, _ in MEASURED:
        out.append((label, peer, theirs / ours))
    return sorted(out, key=lambda r: (ORDER.index(r[0]), r[1]))


def plot(out_path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = speedups()
    labels = list(dict.fromkeys(label for label, _, _ in data))
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(data) + 1.2))
    y, yticks, seen = 0, [], set()
    for label in labels:
        bars = [(peer, s) for lab, peer, s in data if lab == label]
        start = y
        for peer, s in bars:
            ax.barh(y, s, color=PEER_COLORS.get(peer, "#333333"),
                    label=None if peer in seen else LEGEND.get(peer, peer))
            seen.add(peer)
            ax.text(s * 1.03, y, f"{s:.2f}x", va="center", fontsize=7)
            y += 1
        yticks.append(((start + y - 1) / 2, label))
        y += 0.6
    ax.set_yticks([p for p, _ in yticks], [lab for _, lab in yticks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(0.9, 30)  # room on the right for the legend
    ticks = [1, 1.5, 2, 3, 4, 6, 8]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.minorticks_off()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speed-up of ours over the peer (peer time / our time; > 1: ours faster)")
    ax.set_title("tandem-attn on one H200 (2026-11-21 to 2026-11-25), bf16 unless noted", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    print(f"wrote {out_path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "img", "speedups.png"))
    args = p.parse_args(argv)
    for label, peer, s in speedups():
        print(f"{label:<40} {peer:<15} {s:6.2f}x")
    plot(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

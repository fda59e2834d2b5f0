"""Summarise an ncu report: key metrics and the SASS lines with the most stall samples.

    python3 -m benchmarks.experiments.exp_ncu_summary REPORT.ncu-rep

Reports come from exp_lightning_ncu.py; the stored summaries are named by the
commit of the code profiled (results/experiments/ncu_lightning_prefill_<commit>.txt).
Needs only the ncu CLI (no GPU, no project imports)."""
import csv
import io
import subprocess
import sys

rep = sys.argv[1]
raw = subprocess.run(["ncu", "-i", rep, "--page", "details", "--csv"], capture_output=True, text=True).stdout
rows = list(csv.reader(io.StringIO(raw)))
hdr = rows[0]
i_sec, i_name, i_unit, i_val = (hdr.index(h) for h in ("Section Name", "Metric Name", "Metric Unit", "Metric Value"))
for r in rows[1:]:
    if len(r) > i_val and r[i_name]:
        print(f"  [{r[i_sec][:18]}] {r[i_name]}: {r[i_val]} {r[i_unit]}")
src = subprocess.run(["ncu", "-i", rep, "--page", "source", "--csv", "--print-source", "sass"],
                     capture_output=True, text=True).stdout
rows = list(csv.reader(io.StringIO(src)))
h = next((i for i, r in enumerate(rows) if any("Warp Stall Sampling (All" in c for c in r)), None)
if h is None:
    print("no source table; first rows:", rows[:3])
    sys.exit()
hdr = rows[h]
i_s = next(i for i, c in enumerate(hdr) if "Warp Stall Sampling (All" in c)
i_src = next(i for i, c in enumerate(hdr) if c.strip() in ("Source", "# Source", "Sass"))
i_addr = next((i for i, c in enumerate(hdr) if "Address" in c), 0)
body = []
for r in rows[h + 1:]:
    try:
        body.append((float(r[i_s]), r[i_addr], r[i_src]))
    except (ValueError, IndexError):
        pass
total = sum(b[0] for b in body) or 1
print(f"  {len(body)} SASS lines, {total:.0f} stall samples; columns: {hdr[:6]}")
for s, a, t in sorted(body, key=lambda b: -b[0])[:45]:
    print(f"  {100 * s / total:5.1f}%  {a} {t[:120]}")
# opcode totals
ops = {}
for s, a, t in body:
    op = t.strip().split(" ")[0] if not t.strip().startswith("@") else t.strip().split(" ")[1]
    ops[op.split(".")[0]] = ops.get(op.split(".")[0], 0) + s
print("  by opcode:", sorted(((round(100 * v / total, 1), k) for k, v in ops.items()), reverse=True)[:20])

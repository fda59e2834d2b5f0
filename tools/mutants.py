"""Plant known bugs one at a time and check that the CPU tests catch each.

    python tools/mutants.py [--seeds 0,1,2] [--only NAME,...] [--jobs 2] [--list] [--count]

Each mutant below is one small edit of the kernel or planner source (a line a
reviewer could miss). For each mutant and each seed, the tree is copied to a
temporary directory, the edit applied there (the checkout is never touched), and
the mutant's test files run under the Triton interpreter with
``TANDEM_TEST_SEED=<seed>`` (tests/harness.py: every random input derives from
the test id and that seed). A mutant is *caught* when pytest reports a failure,
*missed* when every selected test passes. The table at the end is the result;
the exit status is 1 when any mutant was missed on any seed, or when a mutant's
source text is no longer in the tree (the list must follow the code).

The edit names its text, not a line number, and is searched in every .py file
under core_kernels/ (``path`` narrows the search where the text occurs more than
once), so the list survives files being moved or renamed.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    old: str                 # exact source text, must occur once (in files matching ``path``)
    new: str
    tests: tuple             # pytest arguments (files, -k selections) that should catch it
    path: str = ""           # regex on the file's path relative to the root


LIGHTNING = ("tests/test_lightning_attention.py",)
VARLEN = ("tests/test_lightning_varlen.py",)
PREFIX = ("tests/test_prefix_prefill.py",)
MERGE = ("tests/test_merge_attn_states.py",)
BLOCKSPARSE = ("tests/test_blocksparse_attention.py",)
FP8 = ("tests/test_fp8_rounding.py", "tests/test_merge_attn_states.py", "tests/test_prefix_prefill.py")

MUTANTS = [
    Mutant("merge-weights-swapped", "merge: the two parts' LSE weights swapped",
           "    w_p = tl.exp(p - m)\n    w_s = tl.exp(s - m)\n",
           "    w_p = tl.exp(s - m)\n    w_s = tl.exp(p - m)\n", MERGE),
    Mutant("prefix-causal", "prefix prefill: causal mask `<=` -> `<` (a query misses itself)",
           "vis = vis & (rel <= 0)", "vis = vis & (rel < 0)", PREFIX),
    Mutant("prefix-window-dropped", "prefix prefill: the sliding-window mask dropped",
           "vis = vis & (rel > -window)", "vis = vis", PREFIX),
    Mutant("prefix-window-off-by-one", "prefix prefill: sliding window one key too wide",
           "vis = vis & (rel > -window)", "vis = vis & (rel >= -window)", PREFIX),
    Mutant("prefix-gather-window-start", "prefix prefill: gathered window starts one key late",
           "lo = tl.maximum(ctx_len - WINDOW + 1, 0)", "lo = tl.maximum(ctx_len - WINDOW + 2, 0)", PREFIX),
    Mutant("lightning-q-decay", "lightning: q's in-chunk decay exponent (t+1) -> t",
           "    q_decay = tl.exp(-s * (o_t + 1).to(tl.float32))\n    diff = (o_t[:, None]",
           "    q_decay = tl.exp(-s * (o_t + 0).to(tl.float32))\n    diff = (o_t[:, None]",
           LIGHTNING, path=r"lightning_attention/(kernels|prefill_kernels)\.py$"),
    Mutant("lightning-k-decay", "lightning: k's decay to the chunk end one token short",
           "k_decay = tl.where(m_t, tl.exp(-s * (n_valid - 1 - o_t).to(tl.float32)), 0.0)",
           "k_decay = tl.where(m_t, tl.exp(-s * (n_valid - 2 - o_t).to(tl.float32)), 0.0)", LIGHTNING),
    Mutant("lightning-chunk-state-decay", "lightning: the state decayed one token too many per chunk",
           "b_s = b_s * tl.exp(-s * n_decay.to(tl.float32))",
           "b_s = b_s * tl.exp(-s * (n_decay + 1).to(tl.float32))", LIGHTNING),
    Mutant("lightning-segment-handoff", "lightning: segment hand-off exponent seg_len -> seg_len - 1",
           "seg_len = (blocks_per_seg * block_len).to(tl.float32)",
           "seg_len = (blocks_per_seg * block_len - 1).to(tl.float32)", LIGHTNING),
    Mutant("varlen-segment-handoff", "lightning varlen: item hand-off exponent one token short",
           "b_end = b_s * tl.exp(-s * (seg_t1 - seg_t0).to(tl.float32)) + b_l",
           "b_end = b_s * tl.exp(-s * (seg_t1 - seg_t0 - 1).to(tl.float32)) + b_l", VARLEN),
    Mutant("lightning-decode-decay", "lightning decode: the state decayed twice",
           "b_s = b_s * tl.exp(-s) + b_k[:, None] * b_v[None, :]",
           "b_s = b_s * tl.exp(-2 * s) + b_k[:, None] * b_v[None, :]", LIGHTNING),
    Mutant("lightning-bf16-operand-fp16", "lightning: bf16 MMA operands cast to fp16",
           "        return x.to(tl.bfloat16)\n    else:\n        return x.to(tl.float32)",
           "        return x.to(tl.float16)\n    else:\n        return x.to(tl.float32)",
           LIGHTNING, path=r"lightning_attention/(kernels|prefill_kernels|common)\.py$"),
    Mutant("fp8-e4m3-subnormal", "fp8 e4m3: subnormal rounding constant 2^14 -> 2^15",
           '"float8_e4m3fn": (3, 2.0 ** -6, 2.0 ** 14)', '"float8_e4m3fn": (3, 2.0 ** -6, 2.0 ** 15)', FP8),
    Mutant("fp8-e5m2-subnormal", "fp8 e5m2: subnormal rounding constant 2^7 -> 2^8",
           '"float8_e5m2": (2, 2.0 ** -14, 2.0 ** 7)', '"float8_e5m2": (2, 2.0 ** -14, 2.0 ** 8)', FP8),
    Mutant("fp8-ties-away", "fp8: ties rounded away from zero instead of to even",
           "normal = ((bits + ((1 << (SHIFT - 1)) - 1) + lsb)", "normal = ((bits + ((1 << (SHIFT - 1)) - 0) + 0 * lsb)",
           FP8),
    Mutant("blocksparse-causal", "block-sparse: diagonal-block causal mask `<=` -> `<`",
           "m_s = kpos[None, :] <= q_pos[:, None]", "m_s = kpos[None, :] < q_pos[:, None]", BLOCKSPARSE,
           path=r"blocksparse_attention/kernels\.py$"),
    Mutant("blocksparse-vertical-stride", "block-sparse layout: vertical stride off by one block",
           "| ((kb + heads * step + 1) % vert_stride == 0))", "| ((kb + heads * step) % vert_stride == 0))",
           BLOCKSPARSE),
]


def source_files(root):
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root, check=True,
                         capture_output=True, text=True).stdout.split("\n")
    return [f for f in out if f and os.path.isfile(os.path.join(root, f))]


def locate(m: Mutant, root=ROOT):
    """The one file (relative path) holding ``m.old``; ValueError when none or several do."""
    hits = []
    for f in source_files(root):
        if not f.startswith("core_kernels/") or not f.endswith(".py"):
            continue
        if m.path and not re.search(m.path, f):
            continue
        n = open(os.path.join(root, f)).read().count(m.old)
        hits += [f] * n
    if len(hits) != 1:
        raise ValueError(f"{m.name}: its text occurs {len(hits)} times ({sorted(set(hits))}), want once")
    return hits[0]


def copy_tree(dst):
    for f in source_files(ROOT):
        os.makedirs(os.path.dirname(os.path.join(dst, f)) or dst, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(dst, f))
    venv = os.path.join(ROOT, ".venv")
    if os.path.isdir(venv):
        os.symlink(os.path.realpath(venv), os.path.join(dst, ".venv"))


def run_one(m: Mutant, seed: int, python: str, timeout: int, count: bool = False):
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        copy_tree(tmp)
        f = os.path.join(tmp, locate(m, ROOT))
        text = open(f).read()
        open(f, "w").write(text.replace(m.old, m.new, 1))
        env = dict(os.environ, TANDEM_TEST_SEED=str(seed), PYTHONPATH=tmp,
                   XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONDONTWRITEBYTECODE="1")
        t0 = time.time()
        try:
            p = subprocess.run([python, "-m", "pytest", *([] if count else ["-x"]), "-q", "-p", "no:cacheprovider",
                                *m.tests],
                               cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return m, seed, "timeout", time.time() - t0, ""
        tail = p.stdout.strip().splitlines()[-1:] or [""]
        if p.returncode == 1:
            failed = re.findall(r"^FAILED (\S+)", p.stdout, re.M)
            if count:  # how many of the selected tests fail, not only the first
                return m, seed, "caught", time.time() - t0, tail[0]
            return m, seed, "caught", time.time() - t0, failed[0] if failed else tail[0]
        if p.returncode == 0:
            return m, seed, "MISSED", time.time() - t0, tail[0]
        return m, seed, f"error rc={p.returncode}", time.time() - t0, (p.stdout + p.stderr)[-300:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2", help="TANDEM_TEST_SEED values, one run each")
    ap.add_argument("--only", default="", help="comma-separated mutant names")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per mutant run")
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    ap.add_argument("--list", action="store_true", help="list the mutants and where their text is")
    ap.add_argument("--count", action="store_true",
                    help="run every selected test (no -x) and report how many fail")
    a = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not a.only or m.name in a.only.split(",")]
    missing = []
    for m in chosen:
        try:
            where = locate(m)
        except ValueError as e:
            missing.append(str(e))
            where = "NOT FOUND"
        if a.list:
            print(f"{m.name:30s} {where:55s} {m.what}")
    if missing:
        print("\n".join(missing), file=sys.stderr)
        return 1
    if a.list:
        return 0
    seeds = [int(s) for s in a.seeds.split(",")]
    jobs = [(m, s) for m in chosen for s in seeds]
    results = {}
    with cf.ThreadPoolExecutor(a.jobs) as ex:
        for m, seed, verdict, secs, detail in ex.map(lambda j: run_one(*j, a.python, a.timeout, a.count), jobs):
            results[m.name, seed] = verdict
            print(f"{m.name:30s} seed {seed}: {verdict:8s} {secs:6.0f} s  {detail}", flush=True)
    print()
    print(f"| mutant | {' | '.join(f'seed {s}' for s in seeds)} |")
    print(f"|---|{'---|' * len(seeds)}")
    for m in chosen:
        print(f"| {m.name} | {' | '.join(results[m.name, s] for s in seeds)} |")
    caught = sum(v == "caught" for v in results.values())
    print(f"\n{caught} of {len(results)} runs caught")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())

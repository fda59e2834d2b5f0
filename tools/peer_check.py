"""Peer check: vLLM's own kernel tests, run unmodified against adapters.torch and
against vLLM's own Triton kernels (the baseline), side by side.

    python -m tools.peer_check --impl both            # from the repository root
    python -m tools.peer_check --impl ours --only prefix,merge -k alibi
    python -m tools.peer_check --impl both --collect-only
    python -m tools.peer_check --fetch                 # vLLM's files from GitHub (network)
    python -m tools.peer_check --fetch --from-dir DIR  # or from DIR/<repository path>

vLLM's files live in .peer/vllm_src/ (git-ignored; never committed). Which files,
at which commits, with which sha256: tools/peer_check_shim/MANIFEST.json. --fetch
reads each file that is missing or differs there, from GitHub at its commit or,
with --from-dir, from a directory holding the files at their repository paths
(a vLLM checkout at the commit, or files saved by hand from another source), and
accepts a file only when its sha256 matches. For each mode this tool assembles
.peer/shim/<impl>/ (see tools/peer_check_shim/README.md):
  - a shim `vllm` package: environment facts only (platform, triton, logger,
    utils), `vllm._custom_ops` whose every op skips the calling test;
  - --impl ours: the op modules the tests import re-export adapters.torch (a name
    we lack raises "MISSING in adapters.torch" when called); vLLM's
    chunked_prefill_paged_decode.py is vLLM's file bound to our context_attention_fwd;
  - --impl vllm: vLLM's own files from .peer/vllm_src/vllm/;
  - vLLM's test files (unmodified) under tests/, and our conftest.py.
Each test file runs in its own pytest process (-p no:cacheprovider; --jobs n:
n processes side by side, each taking every n-th test) with a timeout; the JSON summary goes to --out (default $OUT/peer_check.json when $OUT
is set, else .peer/peer_check.json).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHIM_SRC = Path(__file__).resolve().parent / "peer_check_shim"

TEST_FILES = {
    "merge": "tests/kernels/attention/test_merge_attn_states.py",
    "prefix": "tests/kernels/attention/test_prefix_prefill.py",
    "lightning": "tests/kernels/attention/test_lightning_attn.py",
    "blocksparse": "tests/kernels/attention/test_blocksparse_attention.py",
    "unified": "tests/kernels/attention/test_triton_unified_attention.py",
}
IMPLS = ("ours", "vllm")

# vLLM files used in --impl ours too (they wrap our op; a drop-in user runs them as is)
OURS_KEEPS_VLLM = ("vllm/v1/attention/ops/chunked_prefill_paged_decode.py",)

CUSTOM_OP_MARK = "peer-check: vllm._custom_ops."
OPTIONAL_MARK = "need --optional option to run"
# a test of something other than the kernel (vLLM's backend class, NVFP4 caches):
# tools/peer_check_shim/common/peer_check_missing.py
SCOPE_MARK = "peer-check: out of scope:"
MISSING_MARK = "MISSING in adapters.torch"


# --------------------------------------------------------------------------- files
# the vLLM files the check uses (repo, path, commit, sha256); ours, no vLLM code
MANIFEST = SHIM_SRC / "MANIFEST.json"


def load_manifest(peer: Path) -> dict:
    """The file list: tools/peer_check_shim/MANIFEST.json (``peer``/MANIFEST.json is
    the copy --fetch leaves beside the files)."""
    return json.loads(MANIFEST.read_text())


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch(peer: Path, from_dir: Path | None = None) -> int:
    """Put each file of MANIFEST into ``peer``/vllm_src: files already there with the
    manifest's sha256 are kept; the others are read from GitHub at their commit, or
    from ``from_dir``/<path> when given, and written only when their sha256 matches.
    Writes ``peer``/MANIFEST.json; returns the number of files still missing."""
    manifest = json.loads(MANIFEST.read_text())
    missing = 0
    for entry in manifest["files"]:
        dst = peer / "vllm_src" / entry["path"]
        if dst.exists() and _digest(dst.read_bytes()) == entry["sha256"]:
            print(f"peer_check: have {entry['path']} @ {entry['commit'][:8]}")
            continue
        if from_dir is not None:
            src = from_dir / entry["path"]
            data = src.read_bytes() if src.exists() else None
            where = str(src)
        else:
            import urllib.request
            where = (f"https://raw.githubusercontent.com/{entry['repo']}/{entry['commit']}/"
                     f"{entry['path']}")
            try:
                with urllib.request.urlopen(where, timeout=60) as r:  # noqa: S310 (a fixed https host)
                    data = r.read()
            except OSError as e:  # no network: say so per file, keep the others
                print(f"peer_check: {where}: {e}", file=sys.stderr)
                data = None
        if data is None or _digest(data) != entry["sha256"]:
            print(f"peer_check: {'no' if data is None else 'sha256 differs:'} {where}",
                  file=sys.stderr)
            missing += 1
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
        print(f"peer_check: fetched {entry['path']} @ {entry['commit'][:8]} from {where}")
    peer.mkdir(parents=True, exist_ok=True)
    (peer / "MANIFEST.json").write_text(MANIFEST.read_text())
    return missing


def verify_manifest(peer: Path, manifest: dict) -> list[str]:
    problems = []
    for entry in manifest["files"]:
        path = peer / "vllm_src" / entry["path"]
        if not path.exists():
            problems.append(f"missing: {entry['path']}")
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != entry["sha256"]:
            problems.append(f"sha256 differs: {entry['path']}")
    return problems


def _copytree(src: Path, dst: Path) -> None:
    for path in sorted(src.rglob("*")):
        if "__pycache__" in path.parts:
            continue
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)


def _add_init_files(root: Path) -> None:
    for d in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
        if d.name == "__pycache__":
            continue
        init = d / "__init__.py"
        if not init.exists():
            init.write_text('"""peer_check shim package (empty)."""\n')


def build_shim(impl: str, peer: Path, root: Path | None = None) -> Path:
    """(Re)build .peer/shim/<impl>/ (or ``root``) and return it."""
    src = peer / "vllm_src"
    root = root or peer / "shim" / impl
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    common = SHIM_SRC / "common"
    _copytree(common / "vllm", root / "vllm")
    shutil.copyfile(common / "peer_check_missing.py", root / "peer_check_missing.py")
    if importlib.util.find_spec("einops") is None:
        _copytree(common / "einops", root / "einops")
    if impl == "ours":
        _copytree(SHIM_SRC / "ours" / "vllm", root / "vllm")
        for rel in OURS_KEEPS_VLLM:
            if (src / rel).exists():  # else the tests that import it fail to collect
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / rel, root / rel)
    else:
        _copytree(src / "vllm", root / "vllm")
    _copytree(src / "tests", root / "tests")
    _add_init_files(root / "vllm")
    _add_init_files(root / "tests")
    shutil.copyfile(SHIM_SRC / "conftest.py", root / "conftest.py")
    (root / "pytest.ini").write_text("[pytest]\n# peer_check: rootdir anchor (our code)\n")
    return root


# --------------------------------------------------------------------------- running
def run_file(impl: str, key: str, root: Path, args, log_dir: Path) -> dict:
    """Run one vLLM test file in args.jobs pytest processes side by side (each
    takes every jobs-th test, PEER_CHECK_SHARD); one summary of them all."""
    test = TEST_FILES[key]
    jobs = max(1, args.jobs)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-c", str(root / "pytest.ini"),
           "--rootdir", str(root), "-q", "-rN", "--no-header", test]
    if args.collect_only:
        cmd.append("--collect-only")
    if args.k:
        cmd += ["-k", args.k]
    cmd += args.pytest_args
    t0 = time.time()
    procs = []
    for i in range(jobs):
        tag = f"{key}.{impl}" + (f".{i}" if jobs > 1 else "")
        results_path, log_path = log_dir / f"{tag}.jsonl", log_dir / f"{tag}.log"
        results_path.unlink(missing_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(root), str(REPO)] +
                                            ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["PEER_CHECK_IMPL"] = impl
        env["PEER_CHECK_RESULTS"] = str(results_path)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        if jobs > 1:
            env["PEER_CHECK_SHARD"] = f"{i}/{jobs}"
            # NOTE: one CPU thread per process: the tests' host work (torch CPU
            # references) is threaded, and 14 processes of 16 threads each on 16
            # cores took 45-50 s per chunked_prefill_paged_decode case instead of
            # about 5 s (H200 machine, 2026-11-24)
            env.setdefault("OMP_NUM_THREADS", "1")
        log = open(log_path, "w", encoding="utf-8")
        log.write(f"$ {' '.join(cmd)}\n(cwd {root}, impl {impl}, shard {i}/{jobs})\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        procs.append((proc, log, results_path, log_path))
    rcs, timed_out = [], False
    for proc, log, _, _ in procs:
        try:
            rcs.append(proc.wait(timeout=max(1.0, args.timeout - (time.time() - t0))))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)   # the pytest process group this call started
            rcs.append(proc.wait())
        log.close()
    summary = summarize([r for _, _, r, _ in procs], impl)
    rc = next((r for r in rcs if r not in (0, 5)), rcs[0])
    summary.update(file=test, rc=rc, timed_out=timed_out, duration_s=round(time.time() - t0, 1),
                   jobs=jobs, log=[str(lp) for _, _, _, lp in procs])
    if rc not in (0, 1, 5) and not timed_out and not summary["collect_errors"]:
        summary["log_tail"] = procs[rcs.index(rc)][3].read_text(errors="replace").splitlines()[-15:]
    return summary


def _skip_category(reason: str) -> str:
    if CUSTOM_OP_MARK in reason:
        return "custom_op"
    if SCOPE_MARK in reason:
        return "scope"
    if OPTIONAL_MARK in reason:
        return "optional"
    return "other"


def summarize(results_paths: list[Path], impl: str) -> dict:
    collected: list[str] = []
    collect_errors = []
    phases: dict[str, list[dict]] = {}
    for results_path in results_paths:
        if not results_path.exists():
            continue
        for line in results_path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec["event"] == "collected":
                collected += rec["nodeids"]
            elif rec["event"] == "collect_error":
                if all(e["nodeid"] != rec["nodeid"] for e in collect_errors):   # once, not per shard
                    collect_errors.append({"nodeid": rec["nodeid"], "first_line": rec["message"]})
            elif rec["event"] == "report":
                phases.setdefault(rec["nodeid"], []).append(rec)
    outcomes: dict[str, str] = {}
    counts = dict(passed=0, failed=0, errors=0, skipped=0, skipped_custom_op=0, skipped_optional=0,
                  skipped_scope=0, skipped_other=0, missing_in_ours=0)
    failures, skip_reasons = [], {}
    for nodeid, recs in phases.items():
        by = {r["when"]: r for r in recs}
        bad_fixture = [r for w, r in by.items() if w in ("setup", "teardown") and r["outcome"] == "failed"]
        skipped = [r for r in recs if r["outcome"] == "skipped"]
        call = by.get("call")
        if call is not None and call["outcome"] == "failed":
            outcome, msg = "failed", call.get("message", "")
        elif bad_fixture:
            outcome, msg = "error", bad_fixture[0].get("message", "")
        elif skipped:
            outcome, msg = "skipped", skipped[0].get("reason", "")
        elif call is not None and call["outcome"] == "passed":
            outcome, msg = "passed", ""
        else:
            outcome, msg = "error", "no call report (interrupted?)"
        outcomes[nodeid] = outcome
        if outcome == "passed":
            counts["passed"] += 1
        elif outcome == "skipped":
            counts["skipped"] += 1
            counts["skipped_" + _skip_category(msg)] += 1
            skip_reasons[msg] = skip_reasons.get(msg, 0) + 1
        else:
            counts["failed" if outcome == "failed" else "errors"] += 1
            if MISSING_MARK in msg:
                counts["missing_in_ours"] += 1
            failures.append({"nodeid": nodeid, "outcome": outcome, "first_line": msg})
    not_run = [n for n in collected if n not in outcomes]
    return dict(impl=impl, collected=len(collected), **counts, not_run=len(not_run),
                collect_errors=collect_errors, failures=failures, skip_reasons=skip_reasons,
                outcomes=outcomes)


def compare(results: dict) -> dict:
    out = {}
    for key, by_impl in results.items():
        if not all(i in by_impl for i in IMPLS):
            continue
        o, v = by_impl["ours"]["outcomes"], by_impl["vllm"]["outcomes"]
        out[key] = dict(
            ours_passed=by_impl["ours"]["passed"], vllm_passed=by_impl["vllm"]["passed"],
            ours_at_least_vllm=by_impl["ours"]["passed"] >= by_impl["vllm"]["passed"],
            passed_in_vllm_not_ours=sorted(n for n, r in v.items() if r == "passed" and o.get(n) != "passed"),
            passed_in_ours_not_vllm=sorted(n for n, r in o.items() if r == "passed" and v.get(n) != "passed"))
    return out


def environment() -> dict:
    env = {"python": sys.version.split()[0]}
    try:
        import torch
        env["torch"] = torch.__version__
        env["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            env["device"] = torch.cuda.get_device_name(0)
            env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        env["torch"] = f"unavailable: {e}"
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        env["triton"] = f"unavailable: {e}"
    return env


def print_table(results: dict, collect_only: bool) -> None:
    if collect_only:
        head = f"{'file':<12} {'impl':<5} {'collected':>9} {'coll.err':>8} {'rc':>3}"
        print(head + "\n" + "-" * len(head))
        for key, by_impl in results.items():
            for impl, r in by_impl.items():
                print(f"{key:<12} {impl:<5} {r['collected']:>9} {len(r['collect_errors']):>8} {r['rc']:>3}")
        return
    head = (f"{'file':<12} {'impl':<5} {'coll':>5} {'pass':>5} {'fail':>5} {'err':>4} "
            f"{'skip':>5} {'(cuda-op':>8} {'optional':>8} {'scope':>5} {'other)':>6} {'missing':>7} "
            f"{'time_s':>7}")
    print(head + "\n" + "-" * len(head))
    for key, by_impl in results.items():
        for impl, r in by_impl.items():
            flag = " TIMEOUT" if r["timed_out"] else ""
            print(f"{key:<12} {impl:<5} {r['collected']:>5} {r['passed']:>5} {r['failed']:>5} "
                  f"{r['errors'] + len(r['collect_errors']):>4} {r['skipped']:>5} "
                  f"{r['skipped_custom_op']:>8} {r['skipped_optional']:>8} {r['skipped_scope']:>5} "
                  f"{r['skipped_other']:>6} "
                  f"{r['missing_in_ours']:>7} {r['duration_s']:>7}{flag}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.peer_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=("ours", "vllm", "both"), default="both")
    p.add_argument("--only", default=",".join(TEST_FILES),
                   help=f"comma-separated subset of {','.join(TEST_FILES)}")
    p.add_argument("-k", default=None, help="pytest -k expression, passed through")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per test file (default 600)")
    p.add_argument("--jobs", type=int, default=1,
                   help="pytest processes per test file, run side by side (each takes every "
                        "jobs-th test; default 1)")
    p.add_argument("--out", default=None, help="JSON summary path (default $OUT/peer_check.json "
                   "if $OUT is set, else .peer/peer_check.json)")
    p.add_argument("--peer-dir", default=str(REPO / ".peer"), help="where vLLM's files are (default .peer)")
    p.add_argument("--collect-only", action="store_true", help="only collect (no kernels run)")
    p.add_argument("--fetch", action="store_true",
                   help="put vLLM's files listed in tools/peer_check_shim/MANIFEST.json (at "
                        "their commits, sha256-checked) into --peer-dir, then exit: from GitHub, "
                        "or from --from-dir")
    p.add_argument("--from-dir", default=None,
                   help="with --fetch: read the files from DIR/<repository path> (a vLLM "
                        "checkout, or files obtained another way) instead of GitHub")
    p.add_argument("--keep-failures", type=int, default=200,
                   help="at most this many failures listed per file and impl in the JSON")
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = p.parse_args(argv)

    keys = [k.strip() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in keys if k not in TEST_FILES]
    if unknown:
        p.error(f"--only: unknown {unknown}; choose from {list(TEST_FILES)}")
    impls = IMPLS if args.impl == "both" else (args.impl,)
    peer = Path(args.peer_dir).resolve()
    if args.fetch:
        return 1 if fetch(peer, Path(args.from_dir).resolve() if args.from_dir else None) else 0
    if args.from_dir:
        p.error("--from-dir goes with --fetch")
    manifest = load_manifest(peer)
    problems = verify_manifest(peer, manifest)
    for msg in problems:
        print(f"peer_check: MANIFEST: {msg}", file=sys.stderr)
    if args.out:
        out = Path(args.out)
    elif os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "peer_check.json"
    else:
        out = peer / "peer_check.json"
    log_dir = out.parent / "peer_check_logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    results: dict = {}
    for impl in impls:
        root = build_shim(impl, peer)
        for key in keys:
            print(f"peer_check: {key} [{impl}] ...", flush=True)
            r = run_file(impl, key, root, args, log_dir)
            r["failures"] = r["failures"][: args.keep_failures]
            results.setdefault(key, {})[impl] = r

    summary = dict(
        generated=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join([Path(sys.executable).name, "-m", "tools.peer_check", *(argv or sys.argv[1:])]),
        collect_only=args.collect_only, environment=environment(),
        vllm_sources=manifest, manifest_problems=problems,
        categories={"skipped_custom_op": f"skip reason contains {CUSTOM_OP_MARK!r}",
                    "skipped_optional": f"skip reason {OPTIONAL_MARK!r} (vLLM's --optional gate)",
                    "skipped_scope": f"skip reason contains {SCOPE_MARK!r} (not the kernel)",
                    "missing_in_ours": f"failure message contains {MISSING_MARK!r}"},
        results=results, comparison=compare(results) if not args.collect_only else {})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print()
    print_table(results, args.collect_only)
    print(f"\npeer_check: summary -> {out}; logs -> {log_dir}")
    if args.collect_only:
        bad = any(r["collect_errors"] or r["rc"] not in (0,) for by in results.values() for r in by.values())
        # a missing file fails the collection of the tests that import it (counted above);
        # a file that differs from the manifest fails the run
        return 1 if bad or any(m.startswith("sha256") for m in problems) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""conftest for vLLM's kernel tests under the peer_check shim (our code).

Gives the tests what vLLM's own tests/conftest.py gives them, no more:
  - the `--optional` option: tests marked `optional` are skipped unless it is given
    (vLLM's conftest does the same, reason "need --optional option to run");
  - the `kv_cache_factory` fixture name: in vLLM it builds caches for the CUDA
    paged-attention custom-op tests; here those ops cannot exist, so it skips with
    the vllm._custom_ops reason (counted as "custom op").
  - a fetched test file newer than the fetched kernel file it imports from: the
    names that kernel file lacks at its commit (ABSENT_AT_COMMIT) become stubs that
    skip their caller ("out of scope"), so the file's other tests still run.
Records every test report as JSON lines in $PEER_CHECK_RESULTS for tools/peer_check.py.
"""
import gc
import importlib
import json
import os
import sys

import pytest

_OUT = os.environ.get("PEER_CHECK_RESULTS")

# test file -> {module: ((name, why), ...)}: names the test file imports that the
# fetched module does not define at its manifest commit
ABSENT_AT_COMMIT = {
    "test_triton_unified_attention.py": {
        "vllm.v1.attention.ops.triton_unified_attention": (
            ("_get_nvfp4_launch_config",
             "vLLM's NVFP4 launch heuristics, newer than the fetched kernel"),),
    },
}


def pytest_collect_file(file_path, parent):
    """Before a test file is imported: stub the names of ABSENT_AT_COMMIT its
    modules lack (a module that fails to import is left to fail the collection)."""
    from peer_check_missing import out_of_scope
    for mod_name, names in ABSENT_AT_COMMIT.get(file_path.name, {}).items():
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001 - the test file's own import reports it
            continue
        for name, why in names:
            if not hasattr(mod, name):
                setattr(mod, name, out_of_scope(mod_name, name, why))


def _emit(record):
    if _OUT:
        with open(_OUT, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def pytest_addoption(parser):
    parser.addoption("--optional", action="store_true", default=False,
                     help="run optional test")


def pytest_configure(config):
    config.addinivalue_line("markers", "optional: vLLM's optional tests (need --optional)")


def pytest_collection_modifyitems(config, items):
    # $PEER_CHECK_SHARD = "i/n": this process runs every n-th test from the i-th
    # (tools/peer_check.py --jobs n runs the n shards side by side)
    shard = os.environ.get("PEER_CHECK_SHARD")
    if shard:
        i, n = (int(s) for s in shard.split("/"))
        keep = [it for k, it in enumerate(items) if k % n == i]
        config.hook.pytest_deselected(items=[it for k, it in enumerate(items) if k % n != i])
        items[:] = keep
    if config.getoption("--optional"):
        return
    skip_optional = pytest.mark.skip(reason="need --optional option to run")
    for item in items:
        if "optional" in item.keywords:
            item.add_marker(skip_optional)


def pytest_runtest_teardown(item, nextitem):
    # NOTE: each test's cached GPU memory goes back after it: with --jobs processes side
    # by side, the allocator caches of vLLM's largest unified-attention cases (533
    # sequences of 533 tokens) held ~21 GiB per process, and 6 processes ran an 80 GiB
    # H100 out of memory in 38 of 1917 tests (2026-11-28, --impl vllm)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def kv_cache_factory():
    from vllm._custom_ops import SKIP_PREFIX
    pytest.skip(f"{SKIP_PREFIX}(kv_cache_factory) vLLM's CUDA paged-attention test "
                "fixture; its ops are vLLM's CUDA extension, not available here")


def _first_line(report):
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    text = getattr(crash, "message", None) or getattr(report, "longreprtext", "") or ""
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()[:500]
    return ""


def pytest_collectreport(report):
    if report.failed:
        _emit({"event": "collect_error", "nodeid": report.nodeid,
               "message": _first_line(report)})


def pytest_collection_finish(session):
    _emit({"event": "collected", "nodeids": [item.nodeid for item in session.items]})


def pytest_runtest_logreport(report):
    rec = {"event": "report", "nodeid": report.nodeid, "when": report.when,
           "outcome": report.outcome, "duration": round(report.duration, 4)}
    if report.skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        rec["reason"] = str(reason)[:500]
    elif report.failed:
        rec["message"] = _first_line(report)
    _emit(rec)

"""Packaging: each framework adapter installs and imports without the other framework.

``pip install ".[torch]"`` must not need JAX and ``".[jax]"`` must not need
torch. Checked twice: the extras declared in pyproject.toml (and what they pull
in among the installed distributions), and real imports in a subprocess whose
import system refuses the other framework, both from the source tree and from a
``pip install --no-deps --target`` of the package. Offline and CPU-only.
"""
from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.markers import UndefinedEnvironmentName
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# top-level import names of each framework, as the blocked subprocess refuses them
JAX_MODULES = ("jax", "jaxlib", "jax_triton", "jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin")
TORCH_MODULES = ("torch", "torchgen", "functorch")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def is_jax(dist: str) -> bool:
    return canonical(dist) in ("jax", "jaxlib") or canonical(dist).startswith("jax-")


def is_torch(dist: str) -> bool:
    return canonical(dist).startswith("torch")  # torch, torchvision, ...


def extra(name: str) -> list[Requirement]:
    return [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][name]]


def base() -> list[Requirement]:
    return [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]


def applies(req: Requirement) -> bool:
    """Whether a requirement applies here without any extra requested."""
    if req.marker is None:
        return True
    try:
        return req.marker.evaluate({"extra": ""})
    except UndefinedEnvironmentName:
        return False


def closure(reqs: list[Requirement]) -> set[str]:
    """Canonical names of ``reqs`` and, through the installed distributions'
    metadata, everything they require (as far as it is installed here)."""
    seen: set[str] = set()
    todo = [r for r in reqs if applies(r)]
    while todo:
        req = todo.pop()
        name = canonical(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(req.name) or []
        except md.PackageNotFoundError:
            continue
        todo += [r for r in map(Requirement, requires) if applies(r)]
    return seen


# --- declared dependencies ---------------------------------------------------

def test_extras_declared():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"torch", "jax"} <= set(extras)
    assert not [r.name for r in base() if is_jax(r.name) or is_torch(r.name)], \
        "the base dependencies must name neither framework"


def test_torch_extra_pulls_in_no_jax():
    direct = [r.name for r in extra("torch")]
    assert any(is_torch(n) for n in direct)
    assert not [n for n in direct if is_jax(n)]
    assert not sorted(n for n in closure(base() + extra("torch")) if is_jax(n))


def test_jax_extra_pulls_in_no_torch():
    direct = [r.name for r in extra("jax")]
    assert {"jax", "jaxlib", "jax-triton"} <= {canonical(n) for n in direct}
    assert not [n for n in direct if is_torch(n)]
    assert not sorted(n for n in closure(base() + extra("jax")) if is_torch(n))


def test_jax_triton_range():
    """jax-triton 0.3.1 is what the Gluon bridge is written against; 0.4.x needs triton >= 3.7."""
    for name in ("jax", "test"):
        (spec,) = [r.specifier for r in extra(name) if canonical(r.name) == "jax-triton"]
        assert spec == SpecifierSet(">=0.3.1,<0.4"), (name, str(spec))


# --- imports with the other framework missing --------------------------------

BLOCKED_IMPORT = r"""
import importlib, importlib.abc, json, sys

blocked = set(sys.argv[1].split(","))

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by test_packaging)", name=name)
        return None

sys.meta_path.insert(0, Missing())
files = {m: importlib.import_module(m).__file__ for m in sys.argv[2].split(",")}
leaked = sorted(n for n in sys.modules if n.partition(".")[0] in blocked)
print(json.dumps({"files": files, "leaked": leaked}))
"""

CASES = {
    "torch-without-jax": (JAX_MODULES, ("core_kernels", "adapters.torch")),
    "jax-without-torch": (TORCH_MODULES, ("core_kernels", "adapters.jax")),
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The package as ``pip install --no-deps --target`` lays it out (built offline
    from a copy of the sources, so the tree itself gets no build/ or egg-info)."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed (needed to build the package offline)")
    tmp = tmp_path_factory.mktemp("pkg")
    src, target = tmp / "src", tmp / "target"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("core_kernels", "adapters"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
           "--no-deps", "--no-build-isolation", "--target", str(target), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


@pytest.mark.parametrize("source", ["tree", "installed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_adapter_imports_without_other_framework(case, source, request, tmp_path):
    blocked, modules = CASES[case]
    where = ROOT if source == "tree" else request.getfixturevalue("installed")
    env = dict(os.environ, PYTHONPATH=str(where))
    proc = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT, ",".join(blocked), ",".join(modules)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"import of {modules} with {blocked} missing failed:\n{proc.stderr}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["leaked"]
    for module, file in result["files"].items():
        assert Path(file).resolve().is_relative_to(where.resolve()), (module, file, where)


def test_parallel_gpu_suite_covers_every_test_file():
    """scripts/gpu.sh's two parallel calls (PARALLEL_SUITE_1 / _2) name every test
    file, and a file split by -k expressions has parts that complement each other,
    so a new test file cannot drop out of the whole-suite GPU run unnoticed."""
    text = (ROOT / "scripts" / "gpu.sh").read_text()
    entries = []
    for name in ("PARALLEL_SUITE_1", "PARALLEL_SUITE_2"):
        body = re.search(rf"^{name}=\((.*?)\)$", text, re.S | re.M).group(1)
        for stream in re.findall(r'"([^"]*)"', body):
            entries += stream.split(";")
    files = {e.split("@")[0] for e in entries}
    want = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")}
    assert files == want, f"missing: {sorted(want - files)}, unknown: {sorted(files - want)}"
    for f in files:
        ks = [e.split("@", 1)[1] for e in entries if e.startswith(f + "@")]
        whole = [e for e in entries if e == f]
        if ks:  # split: exactly two parts, one the negation of the other (no test run twice or lost)
            assert not whole and len(ks) == 2, f
            pos, neg = sorted(ks, key=lambda k: k.startswith("not "))
            assert neg == " and ".join(f"not {t.strip()}" for t in pos.split(" or ")), (f, ks)
        else:
            assert len(whole) == 1, f"{f} listed {len(whole)} times"

"""The documentation a user reads first: README.md's Python blocks run as written, and
every relative link of README.md, ADDING_AN_OP.md, docs/ and benchmarks/*.md points at
a file or folder that exists.

Each ```python block of README.md runs in a fresh interpreter from the repository root,
as a user who copies it would run it (CPU: Triton's interpreter; GPU: the real kernels).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# the documents whose relative links are checked
DOCS = sorted([README, ROOT / "ADDING_AN_OP.md", *ROOT.glob("docs/**/*.md"),
               *ROOT.glob("benchmarks/*.md")])

_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# [text](target) and ![alt](target); the target ends at whitespace or ")"
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def python_blocks(path: Path) -> list[str]:
    return _FENCE.findall(path.read_text())


def relative_links(path: Path) -> list[str]:
    """The link targets of ``path`` that name a file of the repository (no scheme, no
    pure anchor), without their #anchor; links inside code blocks are ignored."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    out = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s):, mailto:, ... or an anchor in the same page
        out.append(target.split("#", 1)[0])
    return out


def test_readme_has_python_blocks():
    assert len(python_blocks(README)) >= 2  # a PyTorch and a JAX example


@pytest.mark.parametrize("index", range(len(python_blocks(README))))
def test_readme_python_block_runs(index):
    code = python_blocks(README)[index]
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    # "-" reads the program from stdin, so sys.path[0] is the working directory, the root
    proc = subprocess.run([sys.executable, "-"], input=code, text=True, cwd=ROOT, env=env,
                          capture_output=True, timeout=600)
    assert proc.returncode == 0, f"README block {index} failed:\n{code}\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    missing = [t for t in relative_links(doc) if not (doc.parent / t).exists()]
    assert not missing, f"{doc.relative_to(ROOT)}: links to missing paths {missing}"


def test_docs_do_not_point_outside_the_repository():
    """Documents name only paths users have (no session-only folders)."""
    for doc in DOCS:
        for t in relative_links(doc):
            resolved = (doc.parent / t).resolve()
            assert resolved.is_relative_to(ROOT), f"{doc.relative_to(ROOT)}: {t} leaves the repository"
        # paths named in code spans (`docs/ops/x.md`), not only links, exist in the repository
        for path in re.findall(r"`([\w./-]+\.md)`", doc.read_text()):
            assert (doc.parent / path).exists() or (ROOT / path).exists(), \
                f"{doc.relative_to(ROOT)} names {path}, which is not in the repository"

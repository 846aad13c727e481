"""The tree is pyflakes-clean: no undefined name, no unused import or variable, no shadowed import.

An undefined name is a bug waiting for the branch that reaches it; an unused import is a dependency the import-graph
test (tests/test_import_graph.py) counts but nothing needs. ``ruff`` comes with the ``test`` extra.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list:
    try:
        import ruff  # noqa: F401  (the package ships the binary; python -m ruff finds it)
    except ImportError:
        exe = shutil.which("ruff")
        if exe is None:
            pytest.skip("ruff is not installed (pip install -e '.[test]' brings it)")
        return [exe]
    return [sys.executable, "-m", "ruff"]


def test_tree_is_pyflakes_clean():
    paths = [p for p in ("src", "tests", "examples", "bench") if (ROOT / p).is_dir()]
    r = subprocess.run(_ruff() + ["check", "--no-cache", "--output-format", "concise", *paths], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ruff check (pyproject's [tool.ruff]) found problems:\n{r.stdout}{r.stderr}"

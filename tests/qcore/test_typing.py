"""PEP 561: qcore ships ``py.typed`` (and setuptools packages it); the typed core modules pass mypy --strict."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

import qcore

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_py_typed_is_in_the_package_and_shipped():
    assert (pathlib.Path(qcore.__file__).parent / "py.typed").is_file()
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib  # Python 3.11+
    except ImportError:
        assert "[tool.setuptools.package-data]" in text and 'qcore = ["py.typed"]' in text  # pragma: no cover
    else:
        assert "py.typed" in tomllib.loads(text)["tool"]["setuptools"]["package-data"]["qcore"]


def test_public_functions_have_annotations():
    import inspect

    from qcore import conformance, granularity, packing, scales, stats, testing

    for mod in (packing, stats, scales, granularity, testing, conformance):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isfunction(obj):
                sig = inspect.signature(obj)
                assert sig.return_annotation is not inspect.Signature.empty, f"{mod.__name__}.{name}: return"
                for p in sig.parameters.values():
                    assert p.annotation is not inspect.Parameter.empty, f"{mod.__name__}.{name}({p.name})"


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed")
def test_mypy_strict_on_typed_core_modules(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-error-summary",
         "--cache-dir", str(tmp_path / "mypy_cache"), "src/qcore/dtypes.py", "src/qcore/granularity.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr

"""What a user installs is what the tree shows (issue 32).

- ``test_wheel_ships_every_module`` (default run): the wheel built from this tree holds every module of
  ``src/qcore`` and ``py.typed``, and nothing of tests/ or bench/; the version comes from its one place.
- ``test_installed_wheel_end_to_end`` (marker ``wheel``, the README's heavy step): ``python -m build`` makes the
  sdist and the wheel, a fresh virtualenv installs the wheel (not editable, not the checkout), and from a folder
  outside the checkout (beside a clone named ``qcore``, which must not shadow the install) every public module
  imports and a tiny job runs: ``qcore --help``, ``qcore --version``,
  ``qcore quantize`` on a tiny Llama with ``--output``, ``qcore inspect``, the checkpoint reloaded with
  ``from_pretrained`` (same logits as the model quantized in memory), ``qcore conformance export`` / ``check``.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _tree_copy(dst: pathlib.Path) -> pathlib.Path:
    """The files git would commit (tracked and untracked, not ignored) copied to ``dst``: a build there sees this
    working tree, never leaves build/ or egg-info in it."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)
    return dst


def _version() -> str:
    text = (SRC / "qcore" / "__init__.py").read_text()
    m = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
    assert m, "src/qcore/__init__.py must set __version__ (the version's one place)"
    return m.group(1)


def _tree_modules() -> set:
    return {str(p.relative_to(SRC)) for p in (SRC / "qcore").rglob("*.py")}


def _check_wheel(whl: pathlib.Path) -> None:
    names = set(zipfile.ZipFile(whl).namelist())
    shipped = {n for n in names if n.endswith(".py")}
    missing = sorted(_tree_modules() - shipped)
    assert not missing, f"modules of src/qcore left out of the wheel: {missing}"
    assert not sorted(shipped - _tree_modules()), "the wheel ships modules the tree does not have"
    assert "qcore/py.typed" in names
    assert not [n for n in names if n.split("/")[0] in ("tests", "bench", "properties", "docs", "examples")]
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert f"\nVersion: {_version()}\n" in zipfile.ZipFile(whl).read(meta).decode()


def test_version_has_one_place():
    """pyproject.toml reads the version from ``qcore.__version__``; no other file states it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "qcore.__version__"}
    import qcore
    assert qcore.__version__ == _version()


def test_wheel_ships_every_module(tmp_path):
    tree = _tree_copy(tmp_path / "tree")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path / "dist"), str(tree)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp_path / "dist").glob("qcore_numerics-*.whl")
    _check_wheel(whl)


_E2E = r'''
import importlib, pathlib, pkgutil, subprocess, sys, json
import torch, transformers
import qcore
here = pathlib.Path(qcore.__file__).resolve()
assert "site-packages" in here.parts, (f"qcore imported from {here}, not the installed wheel (a clone named "
                                       f"qcore in the working folder must not shadow it)")
# every public module imports (optional heavy dependencies are deferred to the functions that need them)
public = [m.name for m in pkgutil.walk_packages(qcore.__path__, "qcore.")
          if not any(part.startswith("_") for part in m.name.split("."))]
for name in public:
    importlib.import_module(name)
print("qcore", qcore.__version__, "from", pathlib.Path(qcore.__file__).parent)  # site-packages, not the clone
print("imported", len(public), "public modules")
# a tiny job: quantize on the command line, export, inspect, reload
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2)
transformers.LlamaForCausalLM(cfg).save_pretrained("tiny")
def qcore_cli(*args):
    r = subprocess.run([sys.executable, "-m", "qcore", *args], capture_output=True, text=True)
    assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r.stdout
assert "quantize" in qcore_cli("--help")
assert qcore_cli("--version").strip() == f"qcore {qcore.__version__}"
qcore_cli("quantize", "--model", "tiny", "--scheme", "uint4_wo_64", "--eval", "none", "--output", "tiny-uint4",
          "--no-progress", "--report", "report.json")
assert json.loads(pathlib.Path("report.json").read_text())["layers_quantized"] == 14
print("qcore quantize --model tiny --scheme uint4_wo_64: 14 layers quantized")
assert "uint4" in qcore_cli("inspect", "tiny-uint4")
print("qcore inspect tiny-uint4: uint4")
from qcore.adapters import from_pretrained, preset, quantize_model, freeze
back = from_pretrained("tiny-uint4")
ref = transformers.LlamaForCausalLM.from_pretrained("tiny").eval()
quantize_model(ref, preset("uint4_wo_64"), progress=False)
freeze(ref)
x = torch.randint(0, 256, (1, 16))
assert torch.equal(back(x).logits, ref(x).logits)
print("from_pretrained(tiny-uint4): logits equal to quantize_model in memory")
qcore_cli("conformance", "export", "vectors", "--formats", "mxfp4,float8_e4m3fn")
assert "PASS" in qcore_cli("conformance", "check", "vectors", "--outputs", "vectors")
print("qcore conformance export / check (mxfp4, float8_e4m3fn): PASS")
print("end to end: ok")
'''


def test_end_to_end_script_compiles():
    """The installed-wheel script (run only under the ``wheel`` marker) is valid Python: a slip in it shows in the
    default run, not after a 10-minute build."""
    compile(_E2E, "<wheel end to end>", "exec")


@pytest.mark.wheel
def test_installed_wheel_end_to_end(tmp_path):
    tree = _tree_copy(tmp_path / "tree")
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(dist), str(tree)],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = dist.glob("qcore_numerics-*.whl")
    (sdist,) = dist.glob("qcore_numerics-*.tar.gz")
    _check_wheel(whl)
    with tarfile.open(sdist) as t:
        top = {n.split("/")[1] for n in t.getnames() if n.count("/") >= 1}
    assert not top & {"tests", "bench", "properties"}, f"the sdist ships {sorted(top)}"
    assert "src" in top
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=600)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", QCORE_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0", f"{whl}[hf,onnx]", "pytest"], env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    work = tmp_path / "outside"  # not the checkout; a folder that holds a clone named qcore (src/qcore inside it)
    work.mkdir()
    (work / "qcore").symlink_to(tree, target_is_directory=True)
    r = subprocess.run([str(py), "-c", _E2E], cwd=work, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    assert "end to end: ok" in r.stdout
    print(f"\nbuilt {whl.name} ({whl.stat().st_size // 1024} KiB), {sdist.name} ({sdist.stat().st_size // 1024} KiB); "
          f"installed in a fresh venv; from {work}:\n{r.stdout}")  # shown with pytest -s (the closing note's output)

"""Issue 32's proof: the restructuring changes no behaviour. tests/landed/digest.py digests the family matrix,
every algorithm's output, every export (file bytes, reloaded logits), refusals and warnings, and the ``qcore
quantize`` job (report, printed summary, files written), through the public API only; this test runs it under the
landed code (commit ``LANDED``, the flat layout before the src move and the restructuring, taken from git) and
under this tree, and compares the two JSONs key by key.

The landed tree comes from ``git archive LANDED`` into a temporary directory, arranged as the package its
pyproject mapped (``qcore/`` with ``algorithms/``, ``formats/``, ``adapters/`` inside it) and put first on
``PYTHONPATH`` (ahead of the editable install's path, which site-packages' .pth adds after it); the script
records ``qcore.__file__`` and the test checks each run imported the tree it meant. Skipped without git, outside
a git checkout, or in a clone without the commit (shallow). Nothing is written in the checkout; the two JSONs of
a failing run are left in pytest's temporary directory (named in the failure).

Marker ``slow``: two runs of about 2 minutes each (in parallel) on 2 cores.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import pytest

pytestmark = pytest.mark.slow

LANDED = "ce42b8a"  # "gptq: one _numpy_column_quantizers ...": the last commit of the flat layout
ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "landed" / "digest.py"
# the landed pyproject's package-dir: import name -> folder at the repository root
LANDED_PACKAGES = {"qcore": "qcore", "qcore/algorithms": "algorithms", "qcore/formats": "formats",
                   "qcore/adapters": "adapters"}
TIMEOUT = 1800


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=False)


def landed_site(tmp: pathlib.Path) -> pathlib.Path:
    """A directory holding the landed code as the package ``qcore`` (for ``PYTHONPATH``)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the landed code is read from the repository's history")
    if _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout: the landed code ({LANDED}) is read from its history")
    if _git("cat-file", "-e", f"{LANDED}^{{commit}}").returncode != 0:
        pytest.skip(f"this clone lacks commit {LANDED} (the landed code; a shallow clone?): git fetch --unshallow")
    archive = _git("archive", "--format=tar", LANDED, *LANDED_PACKAGES.values())
    assert archive.returncode == 0, archive.stderr.decode()
    extracted = tmp / "archive"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(extracted, filter="data")
        else:  # Python < 3.12 without the filter backport: git's own archive of its own tree
            tar.extractall(extracted)
    site = tmp / "site"
    for package, folder in LANDED_PACKAGES.items():  # qcore first, then its sub-packages into it
        shutil.copytree(extracted / folder, site / package)
    return site


def _start(pythonpath: pathlib.Path, out: pathlib.Path, log: pathlib.Path) -> subprocess.Popen:
    # PYTHONPATH holds only the tree under test (not the caller's, which may name this checkout's src);
    # PYTHONHASHSEED fixed so that both runs iterate any set of strings in the same order
    env = dict(os.environ, PYTHONPATH=str(pythonpath), PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    env.pop("PYTHONSTARTUP", None)
    return subprocess.Popen([sys.executable, str(SCRIPT), str(out)], env=env, cwd=out.parent,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def _flatten(obj, prefix: str) -> dict:
    if isinstance(obj, dict):
        flat = {}
        for k, v in obj.items():
            flat.update(_flatten(v, f"{prefix}/{k}"))
        return flat
    return {prefix: obj}


def _entries(result: dict) -> dict:
    """``{(section/entry, key path): value}`` of a digest JSON (``meta`` aside: where qcore came from, versions,
    seconds)."""
    flat = {}
    for section, entries in result.items():
        if section == "meta":
            continue
        for entry, value in entries.items():
            name = f"{section}/{entry}"
            flat.update({(name, k): v for k, v in _flatten(value, name).items()})
    return flat


# entries where the landed code refused by mistake and a named issue fixed it: the landed run must still show that
# refusal (so the entry is exactly the one fixed) and this tree's run must do the work instead
FIXED = {
    "families/gpt2/gguf_q4_0": ("KeyError: 'num_attention_heads'", "issue 33: llama.cpp mixes on GPT-2"),
    "families/gpt2/gguf_q4_k_m": ("KeyError: 'num_attention_heads'", "issue 33: llama.cpp mixes on GPT-2"),
}


def _fixed(landed: dict, current: dict) -> list:
    """The entries of ``FIXED``, checked: refused by the landed code as recorded, done by this tree's code."""
    out = []
    for entry, (error, why) in FIXED.items():
        section, name = entry.split("/", 1)
        was, now = landed.get(section, {}).get(name), current.get(section, {}).get(name)
        assert was is not None and now is not None, f"{entry} ({why}): not in both digests"
        assert error in str(was.get("error", "")), f"{entry} ({why}): the landed run did not refuse with {error!r}"
        assert "error" not in now, f"{entry} ({why}): still refused: {now['error']}"
        out.append(entry)
    return out


def differences(landed: dict, current: dict) -> list:
    """``[(section/entry, line)]``: one line per key whose value differs."""
    a, b = _entries(landed), _entries(current)
    out = []
    for entry, k in sorted(a.keys() | b.keys()):
        if (entry, k) not in b:
            out.append((entry, f"{k}: only in the landed run: {a[entry, k]!r:.300}"))
        elif (entry, k) not in a:
            out.append((entry, f"{k}: only in this tree's run: {b[entry, k]!r:.300}"))
        elif a[entry, k] != b[entry, k]:
            out.append((entry, f"{k}:\n    landed: {a[entry, k]!r:.400}\n    now:    {b[entry, k]!r:.400}"))
    return out


def _sane(result: dict, name: str) -> None:
    """The run did real work: every section there, exports deterministic, no error of the script's own making."""
    for section in ("families", "algorithms", "exports", "cli"):
        assert result.get(section), f"{name}: section {section!r} is empty"
    flat = {k: v for (_, k), v in _entries(result).items()}
    broken = {k: v for k, v in flat.items() if k.endswith("/error") and
              str(v).startswith(("ImportError", "ModuleNotFoundError", "AttributeError", "NameError"))}
    assert not broken, f"{name}: the digest script could not run these: {broken}"
    unstable = [k for k, v in flat.items() if k.endswith("/deterministic") and v is not True]
    assert not unstable, f"{name}: an export wrote different bytes the second time: {unstable}"
    ok = sum(1 for v in result["families"].values() if "error" not in v)
    assert ok >= 100, f"{name}: only {ok} family x preset cells quantized"


def test_behaviour_is_bit_identical_to_the_landed_code(tmp_path):
    for mod in ("transformers", "tokenizers", "safetensors", "gguf", "onnx", "onnxruntime"):
        pytest.importorskip(mod)
    site = landed_site(tmp_path)
    runs = {"landed": (site, site / "qcore"), "current": (ROOT / "src", ROOT / "src" / "qcore")}
    procs = {}
    for name, (path, _) in runs.items():
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        procs[name] = _start(path, d / "digest.json", d / "log.txt")
    results = {}
    for name, p in procs.items():
        try:
            rc = p.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            pytest.fail(f"the {name} digest run took over {TIMEOUT} s")
        log = (tmp_path / "runs" / name / "log.txt").read_text()
        assert rc == 0, f"the {name} digest run failed ({rc}):\n{log[-6000:]}"
        results[name] = json.loads((tmp_path / "runs" / name / "digest.json").read_text())
    for name, (_, package) in runs.items():
        got = pathlib.Path(results[name]["meta"]["qcore_file"]).resolve()
        assert got == (package / "__init__.py").resolve(), f"the {name} run imported qcore from {got}"
        got = pathlib.Path(results[name]["meta"]["adapters_file"]).resolve()
        assert got == (package / "adapters" / "__init__.py").resolve(), f"the {name} run imported {got}"
        got = pathlib.Path(results[name]["meta"]["cli_qcore_file"]).resolve()
        assert got == (package / "__init__.py").resolve(), f"the {name} run's command line imported qcore from {got}"
        _sane(results[name], name)
    fixed = _fixed(results["landed"], results["current"])
    diff = [(e, line) for e, line in differences(results["landed"], results["current"]) if e not in fixed]
    if diff:
        entries: dict = {}
        for entry, _ in diff:
            entries[entry] = entries.get(entry, 0) + 1
        pytest.fail(f"{len(diff)} digests differ from the landed code ({LANDED}) in {len(entries)} entries: "
                    + ", ".join(f"{e} ({n})" for e, n in entries.items())
                    + f"\nboth JSONs are in {tmp_path / 'runs'}; the first differences:\n"
                    + "\n".join(line for _, line in diff[:60]) + ("\n..." if len(diff) > 60 else ""),
                    pytrace=False)

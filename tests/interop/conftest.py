"""Interop tests against AMD Quark 0.13 (issue 9): the harness. See tests/interop/README.md.

Quark is not a qcore dependency: it runs in a separate virtual environment, driven through the standalone script
``quark_client.py`` (which never imports qcore) in a subprocess. Tests here are marked ``interop`` and run only when
asked for, ``python -m pytest -m interop tests/interop``; in any other run they are skipped (building the venv takes
minutes and the network).

Fixtures for the interop test files:

- ``quark_python``: path of a Python with amd-quark 0.13. ``$QCORE_QUARK_PYTHON`` if set; else the venv cached at
  ``$QCORE_INTEROP_CACHE`` (default ``~/.cache/qcore/interop/quark-0.13``), built on first use with
  ``python -m venv`` + ``pip install`` of :func:`venv_requirements` (``$QCORE_INTEROP_PIP_ARGS``: extra pip
  arguments, e.g. an index) + one ``quark_client.py warm``. If that fails the tests fail with the reason, or skip
  with ``QCORE_SKIP_INTEROP=1``.
- ``quark_ready``: ``quark_python`` after one ``quark_client.py warm`` (compiles Quark's C++ extension once per
  session; checks the version is 0.13); its value is the warm record (``versions``).
- ``run_quark``: the function :func:`run_quark` ``(python, *args, timeout=600)`` -> :class:`QuarkRun` (its
  ``records``: the client's JSON lines).
- ``tiny_llama_dir``: a tiny random float32 Llama saved as a Hugging Face directory (safetensors + byte-level
  tokenizer), built once per session by :func:`make_tiny_llama`.
- ``calib_ids`` / ``eval_ids``: ``.npy`` paths of int64 token ids, ``[4, 32]`` (calibration) and ``[2, 32]``
  (evaluation), from fixed seeds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import types

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent
CLIENT = HERE / "quark_client.py"
CLIENT_PREFIX = "QUARK_CLIENT_JSON "
QUARK_VERSION = "0.13"
TORCH_VERSION = "2.13.0"
DEFAULT_CACHE = pathlib.Path("~/.cache/qcore/interop/quark-0.13")
MARKER_FILE = ".qcore-interop-ready.json"  # written last: a venv without it is half-built and gets rebuilt

TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
SEQ = 32


# ---------------------------------------------------------------------------------------------- marker handling

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test under tests/interop is ``interop``; unless ``-m`` names ``interop`` they are skipped."""
    requested = "interop" in (config.getoption("markexpr", "") or "")
    skip = pytest.mark.skip(reason="interop test: run with `python -m pytest -m interop tests/interop` "
                                   "(needs a venv with amd-quark 0.13, built on first use; tests/interop/README.md)")
    for item in items:
        if HERE in pathlib.Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.interop)
            if not requested:
                item.add_marker(skip)


# ---------------------------------------------------------------------------------------------- the Quark venv

def venv_requirements() -> list[str]:
    """What the cached venv installs: Quark 0.13, torch 2.13.0, and the transformers version of this env."""
    try:
        tf = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        tf = None
    return [f"torch=={TORCH_VERSION}", f"amd-quark=={QUARK_VERSION}",
            f"transformers=={tf}" if tf else "transformers>=5,<6", "safetensors", "accelerate"]


def _venv_python(venv: pathlib.Path) -> pathlib.Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _tail(text: str, n: int = 3000) -> str:
    return text[-n:] if text else ""


def _clean_env() -> dict:
    """The environment for the Quark side: nothing that could put this checkout (qcore) on its path."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONUSERBASE")}
    env.update(OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONNOUSERSITE="1")
    return env


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # two sessions building the same venv: the second waits, then reuses it
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_quark_venv(venv: pathlib.Path, *, timeout: float = 3600) -> pathlib.Path:
    """The python of the venv at ``venv``, built (or rebuilt, if half-built or for other requirements) first.

    Raises RuntimeError naming the failed step and pip's output tail."""
    venv = venv.expanduser().resolve()
    reqs = venv_requirements()
    extra = os.environ.get("QCORE_INTEROP_PIP_ARGS", "").split()
    want = {"requirements": reqs, "pip_args": extra}
    marker = venv / MARKER_FILE
    with _locked(venv.parent / f".{venv.name}.lock"):
        if marker.is_file() and json.loads(marker.read_text()).get("requirements") == reqs:
            return _venv_python(venv)
        if venv.exists():
            shutil.rmtree(venv)
        t0 = time.perf_counter()
        python = str(_venv_python(venv))
        steps = [[sys.executable, "-m", "venv", str(venv)],
                 [python, "-m", "pip", "install", "--disable-pip-version-check", *extra, *reqs],
                 [python, str(CLIENT), "warm"]]  # compiles Quark's C++ extension and byte-compiles the venv
        for cmd in steps:
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_clean_env())
            except subprocess.TimeoutExpired as e:
                raise RuntimeError(f"building the Quark venv at {venv}: `{' '.join(cmd)}` ran past {timeout} s; "
                                   f"output tail:\n{_tail(str(e.stdout or '') + str(e.stderr or ''))}") from None
            if r.returncode != 0:
                raise RuntimeError(f"building the Quark venv at {venv}: `{' '.join(cmd)}` failed "
                                   f"(exit {r.returncode}); output tail:\n{_tail(r.stdout + r.stderr)}")
        want["build_seconds"] = round(time.perf_counter() - t0, 1)
        marker.write_text(json.dumps(want, indent=1) + "\n")
    return _venv_python(venv)


@pytest.fixture(scope="session")
def quark_python() -> pathlib.Path:
    """A python with amd-quark 0.13 (``$QCORE_QUARK_PYTHON``, else the cached venv, built on first use)."""
    given = os.environ.get("QCORE_QUARK_PYTHON")
    try:
        if given:
            python = pathlib.Path(given).expanduser()
            if not python.is_file():
                raise RuntimeError(f"QCORE_QUARK_PYTHON={given!r}: no such file; expected a python executable")
        else:
            python = ensure_quark_venv(pathlib.Path(os.environ.get("QCORE_INTEROP_CACHE") or DEFAULT_CACHE))
        r = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('amd-quark'))"],
                           capture_output=True, text=True, env=_clean_env(), timeout=120)
        version = r.stdout.strip()
        if r.returncode != 0 or version.split(".")[:2] != QUARK_VERSION.split("."):
            raise RuntimeError(f"{python}: expected amd-quark {QUARK_VERSION}, found "
                               f"{version or 'none'} {_tail(r.stderr, 500)}")
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        msg = (f"no Python with amd-quark {QUARK_VERSION} for the interop tests: {e}\n"
               "Set QCORE_QUARK_PYTHON to such a python, or QCORE_SKIP_INTEROP=1 to skip these tests.")
        if os.environ.get("QCORE_SKIP_INTEROP") == "1":
            pytest.skip(msg)
        pytest.fail(msg, pytrace=False)
    return python


# ---------------------------------------------------------------------------------------------- running the client

@dataclasses.dataclass(frozen=True)
class QuarkRun:
    args: tuple
    stdout: str
    stderr: str
    records: list  # the client's QUARK_CLIENT_JSON lines, parsed
    seconds: float

    def results(self, cmd: str) -> list[dict]:
        """The per-item records of ``cmd`` (not the ready / done events)."""
        return [r for r in self.records if r.get("cmd") == cmd and "event" not in r]


def run_quark(python, *args, timeout: float = 600) -> QuarkRun:
    """Run ``quark_client.py *args`` with ``python`` in a clean environment (nothing of qcore on its path).

    Raises RuntimeError with the exit status and stderr tail on failure or timeout, and if the client reports
    having imported qcore."""
    args = tuple(str(a) for a in args)
    cmd = [str(python), str(CLIENT), *args]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_clean_env(), cwd=HERE)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"quark_client {' '.join(args)}: ran past {timeout} s; stderr tail:\n"
                           f"{_tail(e.stderr.decode() if isinstance(e.stderr, bytes) else str(e.stderr or ''))}"
                           ) from None
    if r.returncode != 0:
        raise RuntimeError(f"quark_client {' '.join(args)}: exit {r.returncode}; stderr tail:\n{_tail(r.stderr)}"
                           f"\nstdout tail:\n{_tail(r.stdout, 1000)}")
    records = [json.loads(line[len(CLIENT_PREFIX):]) for line in r.stdout.splitlines()
               if line.startswith(CLIENT_PREFIX)]
    if any(rec.get("qcore_imported") for rec in records):
        raise RuntimeError(f"quark_client {' '.join(args)}: qcore was imported on the Quark side")
    return QuarkRun(args, r.stdout, r.stderr, records, time.perf_counter() - t0)


@pytest.fixture(scope="session", name="run_quark")
def run_quark_fixture():
    """:func:`run_quark` ``(python, *args, timeout=600)``."""
    return run_quark


@pytest.fixture(scope="session")
def quark_ready(quark_python) -> dict:
    """Import quark.torch once (its first import compiles a C++ extension); the warm record (``versions``)."""
    (rec,) = run_quark(quark_python, "warm", timeout=900).results("warm")
    assert rec["versions"]["quark"].startswith(QUARK_VERSION), rec
    return rec


# ---------------------------------------------------------------------------------------------- tiny model, ids

def make_tiny_llama(path, *, seed: int = 0) -> pathlib.Path:
    """Save a tiny random float32 Llama (``TINY``) with a byte-level tokenizer (256 tokens) to ``path``."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = pathlib.Path(path)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    model.save_pretrained(path, safe_serialization=True)
    try:  # a byte-level BPE tokenizer without merges: one token per byte, exactly the 256-token vocabulary
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    except ImportError:
        pass  # the tests use token id arrays; the tokenizer is a convenience
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> pathlib.Path:
    """A tiny random float32 Llama as a Hugging Face directory (built once per session; do not modify)."""
    return make_tiny_llama(tmp_path_factory.mktemp("interop") / "tiny-llama")


def _ids(path: pathlib.Path, n: int, seed: int) -> pathlib.Path:
    np.save(path, np.random.default_rng(seed).integers(0, TINY["vocab_size"], size=(n, SEQ), dtype=np.int64))
    return path


@pytest.fixture(scope="session")
def calib_ids(tmp_path_factory) -> pathlib.Path:
    """``.npy`` of int64 token ids ``[4, 32]`` for calibration (seed 1)."""
    return _ids(tmp_path_factory.mktemp("ids") / "calib.npy", 4, seed=1)


@pytest.fixture(scope="session")
def eval_ids(tmp_path_factory) -> pathlib.Path:
    """``.npy`` of int64 token ids ``[2, 32]`` for comparing logits (seed 2)."""
    return _ids(tmp_path_factory.mktemp("ids") / "eval.npy", 2, seed=2)


from interop_schemes import NAMES, SCHEMES  # noqa: E402


@pytest.fixture(scope="session")
def roundtrip(quark_python, run_quark, tiny_llama_dir, calib_ids, eval_ids, tmp_path_factory):
    """Quark exports all schemes (one process), then Quark's loader reloads them all (one process)."""
    tmp = tmp_path_factory.mktemp("quark_roundtrip")
    scheme_args = [a for s in SCHEMES for a in ("--scheme", s)]
    export = run_quark(quark_python, "export", "--model", tiny_llama_dir, "--calib", calib_ids, "--out",
                       tmp / "exports", "--eval-ids", eval_ids, "--eval-out", tmp / "inmem", *scheme_args,
                       timeout=1500)
    logits = run_quark(quark_python, "logits", "--ids", eval_ids, "--out", tmp / "reload",
                       *[tmp / "exports" / n for n in NAMES], tiny_llama_dir, timeout=900)
    print(f"\nquark export: {export.seconds:.1f} s, quark logits: {logits.seconds:.1f} s")
    return types.SimpleNamespace(
        dir=tmp, exports={r["name"]: r for r in export.results("export")},
        loads={r["name"]: r for r in logits.results("logits")}, float_dir=pathlib.Path(tiny_llama_dir),
        float_name=pathlib.Path(tiny_llama_dir).name, eval_ids=pathlib.Path(eval_ids))

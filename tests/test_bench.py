"""Smoke test of bench/bench_fake_quantize.py: it runs on a tiny input, prints its tables and writes JSON.

No timing is asserted (the machine is shared); only that the script works end to end and that its
bit-identity checks (default path vs the generic oracle, torch vs numpy, quantize+dequantize vs fake) pass.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "bench_fake_quantize.py"


@pytest.mark.slow
def test_bench_script_runs_prints_tables_and_writes_json(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(SCRIPT), "--size", "256", "--repeat", "1", "--formats", "mxfp4,int4_g128",
                        "--no-compile", "--json", str(out)], capture_output=True, text=True, env=env, timeout=300,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    text = p.stdout
    for heading in ("numpy arrays", "torch CPU tensors", "small tensors", "targets", "load average", "torch threads"):
        assert heading in text, f"{heading!r} missing from the output:\n{text}"
    rows = [line.split() for line in text.splitlines()]
    for fmt in ("mxfp4", "int4_g128"):  # one row per backend table: the name, then the reference time in ms
        assert sum(1 for r in rows if len(r) > 2 and r[0] == fmt and r[1].replace(".", "").isdigit()) == 2, text

    res = json.loads(out.read_text())
    assert res["meta"]["size"] == 256 and res["meta"]["torch_threads"] >= 1
    for backend in ("torch", "numpy"):
        got = [r["format"] for r in res[backend]]
        assert got == ["mxfp4", "int4_g128"], (backend, got)
        for r in res[backend]:
            assert r["fake_x"] > 0 and r["q_over_fake"] > 0 and r["dq_over_fake"] > 0
            assert r["bits"]["o"] is True and r["bits"]["q"] is True, (backend, r["format"], r["bits"])
            assert r["bit_identical"] is True
            assert "compiled_x" not in r  # --no-compile
    assert all(r["bits"]["t~n"] is True for r in res["torch"])
    assert {r["backend"] for r in res["small"]} == {"torch", "numpy"}
    assert res["summary"] and all(isinstance(s, str) for s in res["summary"])


def test_bench_script_rejects_unknown_format():
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(SCRIPT), "--formats", "mxfp4,nope"], capture_output=True, text=True,
                       env=env, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and "unknown format(s) nope" in p.stderr


@pytest.mark.slow
def test_bench_script_core_mode_writes_the_core_targets_table(tmp_path):
    """``--core`` (issue 23's rows): the core targets table with the landed figures, as markdown and JSON."""
    pytest.importorskip("torch")
    md, js = tmp_path / "core.md", tmp_path / "core.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(SCRIPT), "--core", "--size", "256", "--repeat", "1", "--threads", "1",
                        "--cpu-time", "--md", str(md), "--json", str(js)], capture_output=True, text=True, env=env,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "core targets (issue 23)" in p.stdout
    res = json.loads(js.read_text())
    assert res["meta"]["clock"] == "thread CPU time" and res["meta"]["torch_threads"] == 1
    assert [r["format"] for r in res["torch"]] == ["mx9", "mx6", "mx4", "bfp16"]
    assert "compiled_x" not in res["torch"][0]  # --core implies --no-compile
    core = res["core"]
    cases = {(r["backend"], r["case"]) for r in core}
    assert ("torch", "fake_quantize mx9 256x256") in cases and ("numpy", "fake_quantize bfp16 256x256") in cases
    assert ("torch", "gptq col, per-row s,z new values each call (576,1)") in cases
    for r in core:
        assert r["ratio"] > 0 and r["same_bits"] is not False, r
        assert r["target"] is None or r["met"] == (r["ratio"] <= r["target"])
    landed = {(r["backend"], r["case"]): r["landed"] for r in core}
    assert landed[("torch", "fake_quantize mx9 256x256")] == 3.84
    text = md.read_text()
    assert "| torch | fake_quantize bfp16 256x256 |" in text and "landed ratio" in text


def test_bench_script_cpu_time_needs_one_thread():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(SCRIPT), "--core", "--cpu-time"], capture_output=True, text=True,
                       env=env, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and "--cpu-time needs --threads 1" in p.stderr

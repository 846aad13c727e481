"""Smoke test of bench/bench_scale.py on tiny shapes: it writes its synthetic checkpoint, runs the RTN, GPTQ and
2-process (data- and layer-parallel) parts, writes its table and JSON, and deletes what it wrote. No timing is
asserted (the machine is shared)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "bench_scale.py"


@pytest.mark.slow
def test_bench_scale_runs_writes_its_table_and_cleans_up(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    work, out = tmp_path / "work", tmp_path / "SCALE"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(SCRIPT), "--dir", str(work), "--out", str(out), "--layers", "3",
                        "--hidden", "64", "--intermediate", "128", "--heads", "4", "--vocab", "256", "--calib", "2",
                        "--seq-len", "16", "--gptq-layers", "2", "--dist-layers", "1", "--shard-gb", "0.0001",
                        "--world", "2"], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert list(work.iterdir()) == []  # the checkpoint, the variants and the outputs are gone
    text = (tmp_path / "SCALE.md").read_text()
    for heading in ("(a) uint4 g128 round-to-nearest", "(b) GPTQ uint4 g128 on the first 2 layers",
                    "(c) the same GPTQ over 2 processes", "load average", "data-parallel", "layer-parallel"):
        assert heading in text, f"{heading!r} missing:\n{text}"
    res = json.loads((tmp_path / "SCALE.json").read_text())
    assert res["checkpoint"]["files"] == 4  # the outer weights, layer 0, layer 1, layer 2
    assert res["rtn"]["peak_rss"] > 0 and res["rtn"]["seconds"] > 0
    assert res["gptq_per_layer"]["n"] == 2 and len(res["gptq_per_layer"]["solves"]) == 4  # qkv, o, gate/up, down
    for tag in ("dp", "lp"):
        ranks = res["dist"][tag]["ranks"]
        assert len(ranks) == 2 and all(len(r["layers"]) == 1 for r in ranks)
    # layer-parallel: the ranks shared the solves (data-parallel: every rank ran all 4)
    assert [len(r["layers"][0]["solves"]) for r in res["dist"]["dp"]["ranks"]] == [4, 4]
    lp = [len(r["layers"][0]["solves"]) for r in res["dist"]["lp"]["ranks"]]
    assert sum(lp) == 4 and min(lp) >= 1


def test_bench_scale_rejects_bad_options():
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(SCRIPT), "--layers", "2", "--gptq-layers", "3"], capture_output=True,
                       text=True, env=env, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and "--gptq-layers must be in 0..--layers (2), got 3" in p.stderr

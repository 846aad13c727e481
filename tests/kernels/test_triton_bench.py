"""bench/bench_kernels.py: says plainly that no GPU is present (exit 0), and its code runs end to end on the
CPU interpreter (``--interpret``: tiny sizes, times meaningless, the bit checks real)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "bench_kernels.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the benchmark would run for real")
def test_no_gpu_is_said_plainly():
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "no GPU is present" in p.stdout and "nothing was measured" in p.stdout


def test_interpret_smoke_run(tmp_path):
    out = tmp_path / "k.json"
    env = {k: v for k, v in os.environ.items() if k != "QCORE_TRITON"}
    p = subprocess.run([sys.executable, str(SCRIPT), "--interpret", "--repeat", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["meta"]["interpret"] is True and res["bandwidth_GBps"] > 0
    assert res["quantization"] and all(r["bits"] for r in res["quantization"])
    assert res["matmul_batch1"] and all(r["max_rel_err"] < 1e-2 for r in res["matmul_batch1"])
    assert any("say nothing about a GPU" in s for s in res["summary"])

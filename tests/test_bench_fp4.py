"""bench/bench_fp4.py: its rows are qcore quantize command lines the CLI accepts, and bench/FP4.md's table is the
rendering of bench/results/FP4.jsonl (one source of truth for the figures)."""

import importlib.util
import json
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_fp4", ROOT / "bench" / "bench_fp4.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_fp4_md_is_the_rendering_of_the_records(tmp_path):
    b = _bench()
    md = tmp_path / "FP4.md"
    shutil.copy(ROOT / "bench" / "FP4.md", md)
    b.render(ROOT / "bench" / "results" / "FP4.jsonl", md)
    assert md.read_text() == (ROOT / "bench" / "FP4.md").read_text(), "rerun python bench/bench_fp4.py --md-only"


def test_every_row_is_a_command_line_qcore_quantize_takes():
    pytest.importorskip("torch")
    from qcore.cli import build_parser
    b = _bench()
    parser = build_parser()
    for label, (group, argv) in b.ROWS.items():
        args = parser.parse_args(["quantize", *argv])
        assert args.scheme == group or args.scheme.startswith(group.split("_")[0]), label


def test_import_records_a_report_made_by_hand(tmp_path):
    b = _bench()
    report = {"scheme": "nvfp4", "command": "qcore quantize --scheme nvfp4 --no-progress --report r.json",
              "ppl": 20.0, "ppl_baseline": 14.0, "algorithms": [], "quantize_seconds": 1.0, "total_seconds": 2.0,
              "peak_rss_bytes": 1, "calibration_samples": 32, "kl_divergence": 0.5, "top1_agreement": 0.7}
    (tmp_path / "r.json").write_text(json.dumps(report))
    md = tmp_path / "FP4.md"
    md.write_text(f"x\n{b.BEGIN}\n{b.END}\ny\n")
    assert b.main(["--jsonl", str(tmp_path / "r.jsonl"), "--md", str(md), "--import", f"nv_rtn={tmp_path / 'r.json'}",
                   "--commit", "abc"]) == 0
    text = md.read_text()
    assert "| nvfp4 | `qcore quantize --scheme nvfp4` | 20.00 (14.00) | 0.5000 | 0.7000 |" in text
    assert "abc (imported)" in text and text.startswith("x\n") and text.endswith("y\n")

"""Issue 34: the FP4 frontier on SmolLM2-135M through the command a user runs (``qcore quantize``).

Each row is one ``qcore quantize`` command line (the CLI is the measurement: no bench-only path). The script runs
the rows you name in a subprocess each, reads the run's ``--report`` JSON, and appends one JSON line per row to
``--jsonl`` (default ``bench/results/FP4.jsonl``): the command, perplexity and the float model's perplexity of the
same run (``ppl_baseline``: measured on the same windows, or read from the float-baseline cache the same run
consults), mean KL to the float model and top-1 agreement where the report has them, quantize time, peak RSS,
the load average at start and end, the commit. ``--md`` renders every recorded row (the latest of each label) to
``bench/FP4.md``'s table between its markers.

    python bench/bench_fp4.py --list
    python bench/bench_fp4.py --rows mx_rtn,mx_quarot_gptq
    python bench/bench_fp4.py --md-only          # re-render bench/FP4.md from the JSON lines
"""

from __future__ import annotations

import argparse
import json
import os
import re
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
JSONL = ROOT / "bench" / "results" / "FP4.jsonl"
MD = ROOT / "bench" / "FP4.md"
BEGIN, END = "<!-- rows:begin -->", "<!-- rows:end -->"


def _q(*a):
    return list(a)


QR32 = '{"name":"quarot","block":32}'
QR16 = '{"name":"quarot","block":16}'

#: label -> (group, qcore quantize arguments)
ROWS: dict[str, tuple[str, list]] = {
    # MXFP4 weights and activations (dynamic, E8M0 'even' as Quark)
    "mx_rtn": ("w_mxfp4_a_mxfp4", _q("--scheme", "w_mxfp4_a_mxfp4")),
    "mx_quarot_gptq": ("w_mxfp4_a_mxfp4", _q("--scheme", "w_mxfp4_a_mxfp4", "--algo", "quarot,gptq")),
    "mx_quarot_gptaq": ("w_mxfp4_a_mxfp4", _q("--scheme", "w_mxfp4_a_mxfp4", "--algo", "quarot,gptaq")),
    "mx_block32_rtn": ("w_mxfp4_a_mxfp4", _q("--scheme", "w_mxfp4_a_mxfp4", "--algo", QR32)),
    "mx_block32_gptq": ("w_mxfp4_a_mxfp4", _q("--scheme", "w_mxfp4_a_mxfp4", "--algo", QR32, "--algo", "gptq")),
    "mx_search_rtn": ("w_mxfp4_a_mxfp4", _q("--scheme", "w_mxfp4_a_mxfp4_search")),
    "mx_quarot_qronos": ("w_mxfp4_a_mxfp4", _q("--scheme", "w_mxfp4_a_mxfp4", "--algo", "quarot,qronos")),
    "mx_block32_qronos": ("w_mxfp4_a_mxfp4", _q("--scheme", "w_mxfp4_a_mxfp4", "--algo", QR32, "--algo", "qronos")),
    "mx_best": ("w_mxfp4_a_mxfp4", _q("--scheme", "w_mxfp4_a_mxfp4", "--algo", "best")),
    # NVFP4 weights and activations
    "nv_rtn": ("nvfp4", _q("--scheme", "nvfp4")),
    "nv_gptq": ("nvfp4", _q("--scheme", "nvfp4", "--algo", "gptq")),
    "nv_qronos": ("nvfp4", _q("--scheme", "nvfp4", "--algo", "qronos")),
    "nv_gptaq": ("nvfp4", _q("--scheme", "nvfp4", "--algo", "gptaq")),
    "nv4o6_rtn": ("nvfp4", _q("--scheme", "nvfp4_4o6")),
    "nv4o6_gptq": ("nvfp4", _q("--scheme", "nvfp4_4o6", "--algo", "gptq")),
    "nv_block16_gptq": ("nvfp4", _q("--scheme", "nvfp4", "--algo", QR16, "--algo", "gptq")),
    "nv_best": ("nvfp4", _q("--scheme", "nvfp4", "--algo", "best")),
    # W4A4 int
    "w4a4_quarot_gptq": ("w_int4_a_int4_per_token_dynamic",
                         _q("--scheme", "w_int4_a_int4_per_token_dynamic", "--algo", "quarot,gptq")),
    "w4a4_quarot_qronos": ("w_int4_a_int4_per_token_dynamic",
                           _q("--scheme", "w_int4_a_int4_per_token_dynamic", "--algo", "quarot,qronos")),
    "w4a4_best": ("w_int4_a_int4_per_token_dynamic",
                  _q("--scheme", "w_int4_a_int4_per_token_dynamic", "--algo", "best")),
}


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_row(label: str, extra: list) -> dict:
    group, argv = ROWS[label]
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "qcore", "quantize", *argv, *extra, "--no-progress", "--report", str(report)]
        load0, t0 = os.getloadavg(), time.time()
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall, load1 = time.time() - t0, os.getloadavg()
        if p.returncode != 0:
            raise SystemExit(f"{label}: qcore quantize failed ({p.returncode}):\n{p.stderr[-3000:]}")
        r = json.loads(report.read_text())
    shown = "qcore quantize " + " ".join(f"'{a}'" if a.startswith("{") else a for a in [*argv, *extra])
    return {"label": label, "group": group, "command": shown, "ppl": r["ppl"], "ppl_baseline": r["ppl_baseline"],
            "kl": r.get("kl_divergence"), "top1": r.get("top1_agreement"), "algorithms": r["algorithms"],
            "quantize_seconds": r["quantize_seconds"], "wall_seconds": wall, "peak_rss_bytes": r["peak_rss_bytes"],
            "calibration_samples": r["calibration_samples"], "load_start": [round(x, 1) for x in load0],
            "load_end": [round(x, 1) for x in load1], "commit": _commit(), "threads": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def render(jsonl: pathlib.Path, md: pathlib.Path) -> None:
    rows: dict = {}
    for line in jsonl.read_text().splitlines() if jsonl.exists() else []:
        if line.strip():
            d = json.loads(line)
            rows[d["label"]] = d
    out = ["| scheme | command | ppl (fp32 same run) | KL | top-1 | quantize s (load start -> end) | commit |",
           "|---|---|---|---|---|---|---|"]
    for d in sorted(rows.values(), key=lambda d: (d["group"], d["ppl"])):
        kl = "-" if d.get("kl") is None else f"{d['kl']:.4f}"
        top = "-" if d.get("top1") is None else f"{d['top1']:.4f}"
        out.append(f"| {d['group']} | `{d['command']}` | {d['ppl']:.2f} ({d['ppl_baseline']:.2f}) | {kl} | {top} | "
                   f"{d['quantize_seconds']:.0f} ({d['load_start'][0]} -> {d['load_end'][0]}) | {d['commit']} |")
    text = md.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{md}: no {BEGIN} ... {END} markers to write the table between")
    head, rest = text.split(BEGIN, 1)
    md.write_text(head + BEGIN + "\n" + "\n".join(out) + "\n" + END + rest.split(END, 1)[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="", help="comma-separated row labels (--list shows them)")
    ap.add_argument("--list", action="store_true", help="print the rows and exit")
    ap.add_argument("--calib-samples", type=int, default=None, help="passed to qcore quantize (default its 32)")
    ap.add_argument("--jsonl", type=pathlib.Path, default=JSONL)
    ap.add_argument("--md", type=pathlib.Path, default=MD)
    ap.add_argument("--md-only", action="store_true", help="only re-render --md from --jsonl")
    ap.add_argument("--import", dest="imports", action="append", default=[], metavar="LABEL=REPORT.json",
                    help="record a run made by hand (qcore quantize ... --report REPORT.json) under a row label; "
                         "its load average is unknown; a label outside the rows records an ablation")
    ap.add_argument("--commit", default=None, help="--import: the commit the imported runs ran at")
    a = ap.parse_args(argv)
    if a.list:
        for k, (g, v) in ROWS.items():
            print(f"{k:20s} {g:34s} qcore quantize {' '.join(v)}")
        return 0
    labels = [s for s in a.rows.split(",") if s]
    bad = [s for s in labels if s not in ROWS]
    if bad:
        ap.error(f"--rows: unknown {bad}; --list shows the rows")
    extra = ["--calib-samples", str(a.calib_samples)] if a.calib_samples is not None else []
    for spec in a.imports:
        label, _, path = spec.partition("=")
        r = json.loads(pathlib.Path(path).read_text())
        shown = re.sub(r" --report \S+| --no-progress", "", r["command"])
        d = {"label": label, "group": ROWS[label][0] if label in ROWS else r["scheme"].split("/")[-1].removesuffix(
            ".json"), "command": shown, "ppl": r["ppl"],
             "ppl_baseline": r["ppl_baseline"], "kl": r.get("kl_divergence"), "top1": r.get("top1_agreement"),
             "algorithms": r["algorithms"], "quantize_seconds": r["quantize_seconds"], "wall_seconds":
             r["total_seconds"], "peak_rss_bytes": r["peak_rss_bytes"], "calibration_samples":
             r["calibration_samples"], "load_start": ["?"], "load_end": ["?"], "commit": (a.commit or _commit()) + " (imported)",
             "threads": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
        with a.jsonl.open("a") as f:
            f.write(json.dumps(d) + "\n")
    for label in labels if not a.md_only else []:
        d = run_row(label, extra)
        print(json.dumps(d), flush=True)
        a.jsonl.parent.mkdir(parents=True, exist_ok=True)
        with a.jsonl.open("a") as f:
            f.write(json.dumps(d) + "\n")
    render(a.jsonl, a.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

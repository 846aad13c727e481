"""Speed of the scaling algorithms (AWQ, SmoothQuant, AutoSmoothQuant) and of static calibration on SmolLM2-135M.

    python bench/bench_scaling_speed.py [--configs awq,smoothquant,autosmoothquant,static] [--batches 32]
        [--layers N] [--threads 2] [--no-ppl] [--ppl-for CONFIGS] [--windows 20] [--qcore-from PATH] [--md ...] [--json ...]
        [--no-write]

The anchors protocol (anchors.md): calibration on 32 x 512-token windows 20..51 of the pydoc text, perplexity on
windows 0..19. For every config the script measures, in one process:

- ``float s``: one float forward of the model over the same calibration tokens (``model(batch)`` per batch,
  ``no_grad``), the reference the ratios are taken against (measured once, at the start, on the same load);
- ``quant s``: the wall time of ``quantize_model(model, config, data)`` on a fresh copy of the fp32 model;
- the per-phase profile of that call (inclusive wall seconds of the wrapped functions: the capture of layer 0's
  inputs, the per-layer statistics forwards, the searches, the folds, the replays, the static calibration
  pass and its observers);
- the perplexity of the quantized model (``--no-ppl`` to skip): quality must not change.

``--layers N`` / ``--batches B`` run a reduced problem (the first N decoder layers, B calibration windows) for
quick iteration; the landed figures are quoted only for the full protocol. ``--qcore-from PATH`` imports qcore
from another checkout (e.g. the landed code) to time it under the same load. Writes bench/results/SPEED_SCALING.md and
.json unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="static,smoothquant,autosmoothquant,awq",
                   help="comma-separated subset of: " + ", ".join(CONFIGS))
    p.add_argument("--batches", type=int, default=32, help="calibration windows (protocol: 32)")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers (quick runs)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--windows", type=int, default=20, help="perplexity windows 0..N-1 (protocol: 20)")
    p.add_argument("--no-ppl", dest="ppl", action="store_false", help="skip the perplexity check")
    p.add_argument("--ppl-for", default=None, help="measure the perplexity for these configs only (comma-separated)")
    p.add_argument("--qcore-from", default=None, help="import qcore from this checkout instead of this one")
    p.add_argument("--md", default=str(ROOT / "bench" / "results" / "SPEED_SCALING.md"))
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "SPEED_SCALING.json"))
    p.add_argument("--no-write", dest="write", action="store_false")
    return p.parse_args()


# name -> (bench_quality.py's config name, preset, preset kwargs, algorithms, landed quant s, landed ppl, target s)
CONFIGS = {
    "static": ("int8 W8A8 per-tensor static (int8)", "int8", {}, (), 83.91, 36.0133, None),
    "smoothquant": ("int8 W8A8 per-tensor static + SmoothQuant a=0.5", "int8", {}, ({"name": "smoothquant"},),
                    186.34, 20.5157, None),
    "autosmoothquant": ("int8 W8A8 per-tensor static + AutoSmoothQuant", "int8", {},
                        ({"name": "autosmoothquant"},), 974.49, 20.3251, 120.0),
    "awq": ("uint4 weight-only g64 asym + AWQ", "w_uint4_per_group_asym", {"group_size": 64}, ({"name": "awq"},),
            192.47, 16.2102, 60.0),
}
NOTES = """Where the time goes and what changed (issue 23):

- **Static calibration** is one forward of the whole model over the calibration batches (observers: about 2 % of
  it): the landed 83.9 s was the float forward itself on a loaded machine. Now each batch after the first ends
  right after the last module with observers (``qcore.adapters._calib_tail.TailSkip``): the excluded output head
  (49152 x 576, about a fifth of SmolLM2's multiply-adds) no longer runs. Same observers on the same tensors:
  the same scales, bit for bit (tests/adapters/passes/test_scaling_speed.py).
- **AutoSmoothQuant**: the alpha search was about 90 % of the run: per scaling group and candidate (20), a
  fake-quantization of the [4096, in] sample and of the weights, then float64 conversions and matmuls. Now every
  candidate is screened with float32 matmuls (its operands are float32 values already) and only the candidates
  within 1e-4 (relative) of the best screened loss are evaluated in float64, in order: the same alpha, scales
  and loss as the landed search (screened losses differ by ~1e-7 relative; ``_reference_auto_smoothquant`` is
  the landed search, compared in the tests). What remains is mostly the fake-quantization of the sample per
  candidate (``qcore.fake_quantize``'s own speed) and the float32 matmuls.
- **SmoothQuant**: the layer forwards (statistics, replay) and the static calibration pass: faster by the
  calibration's skipped output head only.
- **AWQ**: ``awq_search`` was about three quarters of the run. Profiled on SmolLM2's shapes (4096 tokens, one
  thread, idle) the landed search is dominated by the float64 Gram quadratic forms ``sum_rows D G D^T`` (one
  [out, in] x [in, in] float64 matmul per candidate: ~73 % for q,k,v, more for down_proj's 1536 x 1536 Gram);
  ``fake_quantize`` of the scaled weights is ~13 % (a 1536 x 576 weight takes ~2 ms) and the Gram ``x^T x``
  itself the rest. Now (second round) every candidate is screened with float32 products through the Cholesky
  factor of the Gram (``||D L||^2``, lower triangle only: about a quarter of the float64 work), and ratio 0 and
  the candidates within 1e-4 of the best screened loss are evaluated in float64 exactly as before: the same
  ratio, scales and loss, bit for bit (``_reference_awq_search`` is the landed search; tests/adapters/
  test_awq_speed.py). The search is 1.5-1.7x faster; what remains in it is the float64 Gram ``x^T x`` (kept
  for the bit-exact finalists), the screen and the finalists; the per-layer forwards (statistics, replay) and
  ``awq_clip`` (~0.1 s per Linear) are the rest of the run.
"""
LANDED_SOURCE = "bench/results/ALGORITHMS.md (landed, 2-core machine under load ~3.4-5.8)"


class Phases:
    """Inclusive wall time per wrapped function (nested phases are included in their parents)."""

    def __init__(self):
        self.t: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self._undo: list = []

    def wrap(self, owner, attr: str, label: str):
        fn = getattr(owner, attr, None)
        if fn is None:
            return
        phases = self

        @functools.wraps(fn)
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases.t[label] = phases.t.get(label, 0.0) + time.perf_counter() - t0
                phases.n[label] = phases.n.get(label, 0) + 1

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn))

    def undo(self):
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)
        self._undo.clear()


def _instrument(ph: Phases):
    import importlib

    def mod(name):
        try:
            return importlib.import_module(name)
        except ImportError:
            return None

    runner = mod("qcore.adapters.passes.runner")
    sb = mod("qcore.adapters.passes.scaling_bind")
    q = mod("qcore.adapters.quantizer")
    m = mod("qcore.adapters.modules")
    ph.wrap(runner.LayerRunner, "capture", "capture (embeddings -> layer 0 inputs)")
    ph.wrap(runner, "forward_layer", "replay (layer outputs -> next inputs)")
    for attr, label in (("forward_layer", "statistics forward (per layer)"), ("awq_search", "awq_search"),
                        ("awq_clip", "awq_clip"), ("auto_smoothquant", "auto_smoothquant (alpha search)"),
                        ("smoothquant_scales", "smoothquant_scales"), ("fold_scales", "fold_scales"),
                        ("_collect_statistics", "statistics forward (per layer)")):
        if sb is not None:
            ph.wrap(sb, attr, label)
    if sb is not None and hasattr(sb, "_Recorder"):
        ph.wrap(sb._Recorder, "__call__", "  recorder hooks (in statistics forward)")
    ph.wrap(q, "calibrate", "static calibration (full forward + observers)")
    ph.wrap(m.Observer, "update", "  observers (in calibration)")


def _loadavg():
    try:
        return tuple(round(v, 2) for v in os.getloadavg())
    except OSError:
        return None


def _commit(root) -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main():
    args = _parse()
    root = pathlib.Path(args.qcore_from).resolve() if args.qcore_from else ROOT
    sys.path.insert(0, str(root / "src") if (root / "src" / "qcore").is_dir() else str(root))  # older: qcore/ at the root
    import torch

    from qcore.adapters import preset, quantize_model
    from qcore.adapters.eval import evaluate as E
    from qcore.adapters.eval import models

    wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in wanted if c not in CONFIGS]
    if bad:
        raise SystemExit(f"--configs: unknown {bad}; known: {', '.join(CONFIGS)}")
    torch.set_num_threads(args.threads)
    import qcore
    meta = dict(python=platform.python_version(), torch=torch.__version__, threads=torch.get_num_threads(),
                cpus=os.cpu_count(), commit=_commit(root),
                qcore_from=os.path.relpath(pathlib.Path(qcore.__file__).parents[1], ROOT),  # as the repository sees it
                loadavg_start=_loadavg(), batches=args.batches, layers=args.layers, windows=args.windows)
    model, tok = models.load_smollm2()
    if args.layers is not None:
        model.model.layers = model.model.layers[:args.layers]
        model.config.num_hidden_layers = args.layers
    text = E.pydoc_text()
    ids = E.protocol_token_ids(tok, text=text)
    data = E.calibration_batches(None, token_ids=ids, n=args.batches)
    full = args.batches == 32 and args.layers is None

    def float_forward():
        t0 = time.perf_counter()
        with torch.no_grad():
            for b in data:
                model(b)
        return time.perf_counter() - t0

    with torch.no_grad():
        model(data[0])  # warm-up (first-call allocations)
    ref_s = float_forward()
    meta["float_forward_s"] = round(ref_s, 3)
    print(f"float forward over {args.batches} x 512 tokens ({args.layers or 'all'} layers): {ref_s:.2f} s; "
          f"load {meta['loadavg_start']}", flush=True)
    rows = {}
    for name in wanted:
        label, pname, kw, algos, landed_s, landed_ppl, target = CONFIGS[name]
        config = preset(pname, **kw).replace(algorithms=tuple(algos))
        m = copy.deepcopy(model)
        ph = Phases()
        _instrument(ph)
        t0 = time.perf_counter()
        try:
            quantize_model(m, config, data, progress=False)
        finally:
            ph.undo()
        secs = time.perf_counter() - t0
        row = dict(config=label, quant_s=round(secs, 3), ratio=round(secs / ref_s, 3),
                   phases={k: [round(v, 3), ph.n[k]] for k, v in ph.t.items()},
                   landed_s=landed_s if full else None, landed_ppl=landed_ppl if full else None,
                   target_s=target if full else None)
        if args.ppl and (args.ppl_for is None or name in args.ppl_for.split(",")):
            t1 = time.perf_counter()
            row["ppl"] = round(float(E.perplexity(m, None, token_ids=ids, windows=range(args.windows),
                                                  progress=False)), 4)
            row["ppl_s"] = round(time.perf_counter() - t1, 2)
        del m
        rows[name] = row
        print(f"{name}: {secs:.2f} s = {secs / ref_s:.2f} x float forward; ppl {row.get('ppl')}", flush=True)
        for k, (v, n) in sorted(row["phases"].items(), key=lambda kv: -kv[1][0]):
            print(f"    {k:<48} {v:8.2f} s  ({n} calls, {100 * v / secs:5.1f} %)", flush=True)
    meta["loadavg_end"] = _loadavg()
    out = dict(meta=meta, rows=rows)
    md = _markdown(out, sys.argv[1:])
    print(md)
    if args.write:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        pathlib.Path(args.md).write_text(md)


def _markdown(out, argv) -> str:
    m, rows = out["meta"], out["rows"]
    lines = [
        "# Speed of the scaling algorithms and static calibration (bench/bench_scaling_speed.py)", "",
        f"Machine: {m['cpus']} CPUs, torch {m['torch']} ({m['threads']} threads), Python {m['python']}, qcore from "
        f"{m['qcore_from']} at commit {m['commit']}; load average {m['loadavg_start']} -> {m['loadavg_end']}. "
        f"SmolLM2-135M, {m['batches']} x 512 calibration tokens (windows 20..), "
        f"{'all' if m['layers'] is None else m['layers']} decoder layers. Reference: one float forward of the "
        f"model over the same calibration tokens, measured in the same run: **{m['float_forward_s']:.2f} s**. "
        f"Old figures: {LANDED_SOURCE} (quoted only for the full protocol).", "",
        "```", "python bench/bench_scaling_speed.py " + " ".join(argv), "```", "",
        "| config | quant s | x float fwd | old s (landed) | target s | ppl | old ppl |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows.values():
        lines.append(f"| {r['config']} | {r['quant_s']:.2f} | {r['ratio']:.2f} | {r['landed_s'] or '-'} | "
                     f"{r['target_s'] or '-'} | {r.get('ppl', '-')} | {r['landed_ppl'] or '-'} |")
    lines += ["", NOTES, "", "Profile (inclusive wall seconds; indented phases are inside the one above them):", ""]
    for r in rows.values():
        lines += [f"**{r['config']}** ({r['quant_s']:.2f} s)", "", "| phase | s | calls | share |", "|---|---|---|---|"]
        for k, (v, n) in sorted(r["phases"].items(), key=lambda kv: -kv[1][0]):
            lines.append(f"| {k} | {v:.2f} | {n} | {100 * v / r['quant_s']:.1f} % |")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

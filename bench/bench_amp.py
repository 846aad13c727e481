"""Layerwise mixed precision (AMP) on SmolLM2-135M-Instruct: {MXFP4, fp8} at a target of average bits per weight
against uniform MXFP4 and uniform fp8, under the project's perplexity protocol.

    python bench/bench_amp.py [--targets 4.5,5,5.5,6] [--sens-windows 2] [--calib 32] [--threads 2]
        [--sensitivity bench/results/AMP_sensitivity.json] [--remeasure] [--no-uniform] [--algo gptq] [--rotation quarot] [--json bench/results/AMP.json]

1. Sensitivity (``qcore.adapters.passes.amp.layer_sensitivity``, ``Metric.KL``): schemes ``w_mxfp4_a_mxfp4`` (MXFP4
   weights, dynamic MXFP4 activations, Quark's 'even' E8M0 rule) and ``w_fp8_a_fp8`` (fp8 e4m3 weights and static
   activations, per tensor); units as vLLM fuses them (q/k/v together, gate/up together); measured on
   ``--sens-windows`` calibration windows (20, 21, ...). Saved to ``--sensitivity`` and reused unless
   ``--remeasure`` (the search for every target comes from this one measurement).
2. For every target: ``amp_config(..., sensitivity=..., target_bits=t)``; the model quantized with it
   (``quantize_model``, ``--calib`` calibration windows from 20, as the fp8 anchor's 32), perplexity on windows
   0..19 (``qcore.adapters.eval.evaluate``). Bits per weight are over the quantized Linears (lm_head and embeddings
   stay float), scales included (``QuantSpec.bits_per_element``).
3. Uniform ``w_mxfp4_a_mxfp4`` and ``w_fp8_a_fp8`` with the same calibration (anchors: Quark 0.13 44.914 and
   14.345).

``--rotation quarot`` rotates the float model first (QuaRot with its online transforms), so that the
sensitivities and every row are those of the rotated model.

``--algo gptq`` runs GPTQ (on the calibration windows) before rounding in every row, AMP rows included (each
layer with its own scheme); the sensitivities stay those of round-to-nearest.

Prints one JSON line per result and writes them to ``--json``. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

import qcore.adapters as A  # noqa: E402
from qcore.adapters.eval import evaluate as E  # noqa: E402
from qcore.adapters.passes.amp import Sensitivity, amp_config, layer_sensitivity  # noqa: E402
from qcore.adapters.eval.models import load_smollm2  # noqa: E402

SCHEMES = ["w_mxfp4_a_mxfp4", "w_fp8_a_fp8"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="4.5,5,5.5,6")
    ap.add_argument("--sens-windows", type=int, default=2)
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sensitivity", default=str(ROOT / "bench" / "results" / "AMP_sensitivity.json"))
    ap.add_argument("--remeasure", action="store_true")
    ap.add_argument("--no-uniform", action="store_true", help="skip the uniform MXFP4 / fp8 rows")
    ap.add_argument("--algo", default="", help="algorithms before rounding for every row, e.g. gptq")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "AMP.json"))
    ap.add_argument("--rotation", choices=("none", "quarot"), default="none",
                    help="rotate the float model first (QuaRot, qcore.adapters.passes.rotation); sensitivities and every row "
                    "are then of the rotated model (use another --sensitivity file)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    targets = [float(t) for t in args.targets.split(",") if t]
    algos = tuple({"name": a} for a in args.algo.split(",") if a)

    model, tok = load_smollm2()
    if args.rotation == "quarot":
        from qcore.adapters.passes.rotation import rotate_model
        rotate_model(model, key=None)  # the plain Hadamard (what bench/results/AMP.md reports)
    ids = E.protocol_token_ids(tok)
    calib = E.calibration_batches(None, token_ids=ids, n=args.calib)
    results = []

    def emit(d):
        print(json.dumps(d), flush=True)
        results.append(d)

    path = pathlib.Path(args.sensitivity)
    if path.exists() and not args.remeasure:
        sens = Sensitivity.from_dict(json.loads(path.read_text()))
        emit({"sensitivity": "loaded", "file": os.path.relpath(path.resolve(), ROOT)})
    else:
        t0 = time.perf_counter()
        sens = layer_sensitivity(model, SCHEMES, calib[:args.sens_windows], progress=True)
        dt = time.perf_counter() - t0
        path.write_text(json.dumps(sens.to_dict(), indent=1))
        emit({"sensitivity": "measured", "windows": args.sens_windows, "units": len(sens.units),
              "seconds": round(dt, 1), "threads": args.threads})

    def evaluate(name, config, extra):
        if algos:
            config = config.replace(algorithms=algos)
            name += " + " + args.algo
        m = copy.deepcopy(model)
        t0 = time.perf_counter()
        A.quantize_model(m, config, calib, progress=False)
        tq = time.perf_counter() - t0
        ppl = E.perplexity(m, None, token_ids=ids, windows=E.EVAL_WINDOWS, progress=False)
        emit({"config": name, "ppl": round(ppl, 4), "quantize_s": round(tq, 1), **extra})
        del m

    if not args.no_uniform:
        for s in SCHEMES:
            bits = [b[SCHEMES.index(s)] for b in sens.bits]
            avg = sum(b * n for b, n in zip(bits, sens.weights)) / sum(sens.weights)
            evaluate(f"uniform {s}", A.preset(s), {"avg_bits": round(avg, 4)})
    for t in targets:
        r = sens.search(target_bits=t)
        cfg = amp_config(model, SCHEMES, sensitivity=sens, target_bits=t)
        fp8_units = [u for u, s in r.choice if s == "w_fp8_a_fp8"]
        evaluate(f"AMP {t}", cfg, {"target_bits": t, "avg_bits": round(r.average_bits, 4),
                                   "fp8_share": round(r.share("w_fp8_a_fp8"), 4),
                                   "predicted_kl": round(r.predicted_loss, 5), "fp8_units": fp8_units})
    pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Rotations on SmolLM2-135M-Instruct (issue 11): perplexity of W+A MXFP4 and W4A4 int with QuaRot / SpinQuant.

    python bench/bench_rotations.py --scheme w_mxfp4_a_mxfp4 --rotation none|quarot|spinquant
        [--group-size 64] [--steps 40] [--lr 1.5] [--threads 2] [--no-gptq] [--no-rtn]

Loads SmolLM2 (``qcore.adapters.eval.models``), applies the rotation once (``apply_rotation``; SpinQuant trains on the
protocol's calibration windows 20..51 against the scheme), then evaluates, each on a fresh copy of the rotated
model: round-to-nearest (``quantize_model`` with the scheme) and GPTQ (``{"name": "gptq"}``, act-order, damp
0.01, the same 32 calibration windows). This is the same computation as ``quantize_model`` with the algorithms
``[rotation, gptq]``, with the rotation shared by both rows. Perplexity: the project protocol (pydoc text,
512-token windows 0..19; ``../shared/reference/anchors.md``). Prints one JSON line per row. Nothing asserted.
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
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from qcore.adapters.eval import evaluate as E  # noqa: E402
from qcore.adapters import plan_model, preset, quantize_model  # noqa: E402
from qcore.adapters.eval.models import load_smollm2  # noqa: E402
from qcore.adapters.passes.spinquant import apply_rotation  # noqa: E402
from qcore.algorithms.config import QuaRotConfig, SpinQuantConfig  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", required=True)
    ap.add_argument("--group-size", type=int, default=None)
    ap.add_argument("--rotation", choices=("none", "quarot", "spinquant"), default="quarot")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1.5)
    ap.add_argument("--key", default="0", help="random Hadamard signs (QuaRot's randomised Hadamard; the library's "
                    "default 0), or 'none' for the plain Hadamard")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-gptq", action="store_true")
    ap.add_argument("--no-rtn", action="store_true")
    ap.add_argument("--train-weights", choices=("yes", "no"), default="yes",
                    help="SpinQuant: fake-quantize the weights while training (no: activations only, for GPTQ)")
    a = ap.parse_args(argv)
    a.key = None if a.key.lower() == "none" else int(a.key)
    torch.set_num_threads(a.threads)
    model, tok = load_smollm2()
    ids = E.protocol_token_ids(tok)
    calib = E.calibration_batches(None, token_ids=ids)
    cfg = preset(a.scheme, group_size=a.group_size) if a.group_size else preset(a.scheme)
    t = time.perf_counter()
    extra: dict = {}
    if a.rotation != "none":
        algo = QuaRotConfig(key=a.key) if a.rotation == "quarot" else SpinQuantConfig(key=a.key, steps=a.steps, lr=a.lr,
                                                                                  train_weights=a.train_weights == "yes")
        apply_rotation(model, algo, plans=plan_model(model, cfg), data=calib)
        extra = {"rotation": algo.to_dict(), "rotation_s": round(time.perf_counter() - t, 1)}
        if a.rotation == "spinquant":
            extra["losses"] = [round(v, 4) for v in model._qcore_spinquant_losses]
    rows = ([("RTN", ())] if not a.no_rtn else []) + ([("GPTQ", ({"name": "gptq"},))] if not a.no_gptq else [])
    for name, algos in rows:
        m = copy.deepcopy(model)
        t = time.perf_counter()
        q = quantize_model(m, cfg.replace(algorithms=algos), calib, progress=False)
        qs = time.perf_counter() - t
        ppl = E.perplexity(q, None, token_ids=ids, windows=range(20), progress=False)
        print(json.dumps({"scheme": a.scheme, "group_size": a.group_size, "rotation": a.rotation, "row": name,
                          "ppl": round(ppl, 4), "quantize_s": round(qs, 1), **extra}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

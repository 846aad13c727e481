"""Quantization-aware distillation rows for bench/bench_quality.py (issue 24).

GPTQ (and QuaRot) calibrate on the protocol's 32 calibration windows (20..51) as in the landed rows; the
distillation trains on the calibration windows 20..219 (the protocol's 200 calibration windows: never the
evaluation windows 0..19), bounded by the wall clock (``max_seconds``), one 512-token window per step.
Peak memory is about 5-6 GB per row (the bench's float model and its quantized copy, the teacher, AdamW's states);
on the shared machine two such runs were ended by the out-of-memory killer (bench/results/ALGORITHMS_DISTILL.md).
The training's figures (steps, tokens, seconds, first/last loss) are printed and kept in ``LAST_RUNS``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

LAST_RUNS: dict = {}

# time budgets (seconds of training) per row; the environment may shorten them for smoke runs
_MINUTES = float(os.environ.get("QCORE_DISTILL_MINUTES", "30"))


def _distill_rows():
    return {
        "W MXFP4 / A MXFP4 (even) + QuaRot + GPTQ + distill":
            ("w_mxfp4_a_mxfp4", {}, ({"name": "quarot"}, {"name": "gptq"}),
             {"lr": 1e-4, "max_seconds": 60 * _MINUTES}),
        "int4 weight-only g64 sym + GPTQ + distill":
            ("int4_wo_64", {}, ({"name": "gptq"},), {"lr": 5e-5, "max_seconds": 60 * min(_MINUTES, 20.0)}),
        "uint4 weight-only g64 asym RTN + distill":
            ("w_uint4_per_group_asym", {"group_size": 64}, (), {"lr": 1e-4, "max_seconds": 60 * min(_MINUTES, 20.0)}),
        "uint4 weight-only g64 asym + GPTQ + distill":
            ("w_uint4_per_group_asym", {"group_size": 64}, ({"name": "gptq"},),
             {"lr": 1e-4, "max_seconds": 60 * min(_MINUTES, 20.0)}),
        "uint4 weight-only g64 asym + GPTQ + distill (train_scales)":
            ("w_uint4_per_group_asym", {"group_size": 64}, ({"name": "gptq"},),
             {"lr": 5e-5, "train_scales": True, "scale_lr": 1e-6, "max_seconds": 60 * min(_MINUTES, 20.0)}),
    }


def configs(calib, preset) -> dict:
    from qcore.adapters import preset as qpreset
    from qcore.adapters import quantize_model
    from qcore.adapters.eval import evaluate as E

    n_windows = int(os.environ.get("QCORE_DISTILL_WINDOWS", "200"))
    out = {}
    for row, (scheme, kw, algos, dkw) in _distill_rows().items():
        d = {"name": "distill", "steps": 100000, "schedule": "cosine", **dkw}
        config = qpreset(scheme, **kw).replace(algorithms=tuple(algos) + (d,))

        def run(model, config=config, row=row):
            if getattr(model.config, "model_type", "") == "bert":
                return None  # distillation needs a causal LM's logits
            logging.getLogger("qcore.adapters").setLevel(logging.INFO)
            if not logging.getLogger().handlers:
                logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(message)s")
            train = E.calibration_batches(calib.lm_tokenizer, n=n_windows)
            t = time.perf_counter()
            q = quantize_model(model, config, list(calib.lm_batches), distill_data=train, progress=False)
            st = dict(q.qcore_distill, quantize_seconds=time.perf_counter() - t, load=os.getloadavg())
            LAST_RUNS[row] = st
            print(f"[distill] {row}: {json.dumps(st)}", file=sys.stderr, flush=True)
            return q

        out[row] = run
    return out

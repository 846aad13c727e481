"""A short distillation run on SmolLM2 in one lean process (no second copy of the model besides the teacher):
uint4 g64 asym round-to-nearest + distill for QCORE_DISTILL_MINUTES (default 8) of training on calibration
windows 20..219, then the protocol perplexity (windows 0..19). Writes bench/results/ALGORITHMS_DISTILL_SHORT.json.

    python bench/distill_short.py
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import resource
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from qcore.adapters import preset, quantize_model  # noqa: E402
from qcore.adapters.eval import evaluate as E  # noqa: E402
from qcore.adapters.eval import models  # noqa: E402


def main() -> None:
    torch.set_num_threads(2)
    logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(message)s")
    logging.getLogger("qcore.adapters").setLevel(logging.INFO)
    minutes = float(os.environ.get("QCORE_DISTILL_MINUTES", "8"))
    lr = float(os.environ.get("QCORE_DISTILL_LR", "1e-4"))
    lm, tok = models.load_smollm2()
    ids = E.protocol_token_ids(tok, text=E.pydoc_text())
    train = E.calibration_batches(None, token_ids=ids, n=200)
    d = {"name": "distill", "steps": 100000, "lr": lr, "max_seconds": 60 * minutes}
    config = preset("w_uint4_per_group_asym", group_size=64).replace(algorithms=(d,))
    t = time.perf_counter()
    quantize_model(lm, config, train, progress=False)
    qs = time.perf_counter() - t
    t = time.perf_counter()
    ppl = E.perplexity(lm, None, token_ids=ids, windows=range(20), progress=False)
    row = {"row": "uint4 weight-only g64 asym RTN + distill", "ppl": ppl, "quant_s": round(qs, 1),
           "ppl_s": round(time.perf_counter() - t, 1), "distill": lm.qcore_distill, "config": d,
           "load_average": os.getloadavg(), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "landed_rtn_ppl": 18.2068}
    print(json.dumps(row, indent=1))
    out = os.environ.get("QCORE_DISTILL_OUT", "ALGORITHMS_DISTILL_SHORT.json")
    (ROOT / "bench" / "results" / out).write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""issue 24: AutoRound (SignRound) rows of bench/bench_quality.py, beside round-to-nearest and GPTQ at 3 bits.

    python bench/bench_quality.py --configs "<row>,..." --md bench/results/ALGORITHMS_AUTOROUND.md \
        --json bench/results/ALGORITHMS_AUTOROUND.json

SmolLM2 rows run AutoRound with ``SMOLLM2_AUTOROUND`` (fewer iterations and one 512-token window per step: 200
iterations of 8 windows per layer took ~1 s per window and step on this 2-core CPU at load average 1 to 10, 2.6 s
under load 12 to 40: 13 to 35 hours for 30 layers;
bench/results/ALGORITHMS_AUTOROUND.md); MiniLM rows run ``MINILM_AUTOROUND`` (50 iterations of 2 of its 4 sentence
batches). Override with the environment variable ``QCORE_AUTOROUND_SMOLLM2`` (JSON, e.g.
``'{"iters": 200, "batch_size": 8}'``).
"""

from __future__ import annotations

import json
import logging
import os
import sys

_log = logging.getLogger("qcore.adapters")  # the binding's per-layer line (time, loss before -> after) on stderr
if not _log.handlers:
    _h = logging.StreamHandler(sys.stderr)
    _h.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    _log.addHandler(_h)
    _log.setLevel(logging.INFO)

SMOLLM2_AUTOROUND = {"name": "autoround", "iters": 20, "batch_size": 1}
# MiniLM: 4 calibration batches of 16 sentences. The defaults (200 iterations of all 4) took 1100 s for one of the 6
# layers under load average 20 (loss 0.0037 -> 0.00049); the bench runs 50 iterations of 2 batches.
MINILM_AUTOROUND = {"name": "autoround", "iters": 50, "batch_size": 2}


def _smollm2_algo() -> dict:
    over = os.environ.get("QCORE_AUTOROUND_SMOLLM2")
    return {**SMOLLM2_AUTOROUND, **json.loads(over)} if over else dict(SMOLLM2_AUTOROUND)


def _by_model(preset_fn, name, calib, **kw):
    """One row: ``SMOLLM2_AUTOROUND`` on SmolLM2 (Llama), the defaults on MiniLM (BERT)."""
    lm = preset_fn(name, calib, algorithms=(_smollm2_algo(),), **kw)
    enc = preset_fn(name, calib, algorithms=(MINILM_AUTOROUND,), **kw)

    def run(model):
        return (enc if getattr(model.config, "model_type", "") == "bert" else lm)(model)
    return run


def configs(calib, preset) -> dict:
    gptq = ({"name": "gptq"},)
    u3 = dict(group_size=64, weight_dtype="uint3")
    return {
        "uint4 weight-only g64 asym + AutoRound": _by_model(preset, "w_uint4_per_group_asym", calib, group_size=64),
        "uint3 weight-only g64 asym RTN": preset("w_uint4_per_group_asym", calib, **u3),
        "uint3 weight-only g64 asym + GPTQ": preset("w_uint4_per_group_asym", calib, algorithms=gptq, **u3),
        "uint3 weight-only g64 asym + AutoRound": _by_model(preset, "w_uint4_per_group_asym", calib, **u3),
        "int4 weight-only g32 sym + AutoRound": _by_model(preset, "int4_wo_32", calib),
    }

"""HQQ rows for bench/bench_quality.py (issue 24): data-free, so ``quantize_model`` gets no ``data=`` at all.

    python bench/bench_quality.py --configs "uint4 weight-only g64 asym + HQQ,..." --md bench/results/ALGORITHMS_HQQ.md \
        --json bench/results/ALGORITHMS_HQQ.json
"""

from __future__ import annotations

import dataclasses


def _hqq(name: str, *, weight_dtype: str | None = None, hqq: dict | None = None, **kw):
    """``quantize_model(model, preset(name, **kw) + HQQ)`` without calibration data (``weight_dtype``: another
    integer element format for the weights, as bench_quality's ``_preset``)."""
    import qcore
    from qcore.adapters import preset, quantize_model

    config = preset(name, **kw).replace(algorithms=({"name": "hqq", **(hqq or {})},))
    if weight_dtype is not None:
        w = config.layer.weight
        spec = dataclasses.replace(w.spec, dtype=qcore.get_dtype(weight_dtype), name=weight_dtype)
        config = config.replace(layer=dataclasses.replace(config.layer, weight=dataclasses.replace(w, spec=spec)))

    def run(model):
        return quantize_model(model, config, progress=False)  # no data=: HQQ reads the weights only

    return run


def configs(calib, preset) -> dict:
    return {
        "uint4 weight-only g64 asym + HQQ": _hqq("w_uint4_per_group_asym", group_size=64),
        "uint3 weight-only g64 asym RTN": preset("w_uint4_per_group_asym", calib, group_size=64, weight_dtype="uint3"),
        "uint3 weight-only g64 asym + HQQ": _hqq("w_uint4_per_group_asym", group_size=64, weight_dtype="uint3"),
        "int4 weight-only g32 sym + HQQ": _hqq("int4_wo_32"),
    }

"""GPTAQ rows of bench/bench_quality.py (issue 24): uint4 g64 and uint3 g64 weight-only on SmolLM2 beside GPTQ in the
same run, and int4 g32 (the MiniLM column; GPTQ 0.990).

    python bench/bench_quality.py --no-minilm --configs "uint4 weight-only g64 asym + GPTAQ,..." \\
        --md bench/results/ALGORITHMS_GPTAQ.md --json bench/results/ALGORITHMS_GPTAQ.json
"""

from __future__ import annotations

GPTQ = ({"name": "gptq"},)
GPTAQ = ({"name": "gptaq"},)


def configs(calib, preset) -> dict:
    u4 = dict(group_size=64)
    u3 = dict(group_size=64, weight_dtype="uint3")
    return {
        "uint4 weight-only g64 asym + GPTAQ": preset("w_uint4_per_group_asym", calib, algorithms=GPTAQ, **u4),
        "uint4 weight-only g64 asym + GPTAQ (true sequential)": preset(
            "w_uint4_per_group_asym", calib, algorithms=({"name": "gptaq", "true_sequential": True},), **u4),
        "uint3 weight-only g64 asym RTN": preset("w_uint4_per_group_asym", calib, **u3),
        "uint3 weight-only g64 asym + GPTQ": preset("w_uint4_per_group_asym", calib, algorithms=GPTQ, **u3),
        "uint3 weight-only g64 asym + GPTAQ": preset("w_uint4_per_group_asym", calib, algorithms=GPTAQ, **u3),
        "uint3 weight-only g64 asym + GPTAQ (true sequential)": preset(
            "w_uint4_per_group_asym", calib, algorithms=({"name": "gptaq", "true_sequential": True},), **u3),
        "int4 weight-only g32 sym + GPTAQ": preset("int4_wo_32", calib, algorithms=GPTAQ),
        "int4 weight-only g32 sym + GPTAQ (true sequential)": preset(
            "int4_wo_32", calib, algorithms=({"name": "gptaq", "true_sequential": True},)),
        "int4 weight-only g32 sym + GPTAQ (alpha 1)": preset(
            "int4_wo_32", calib, algorithms=({"name": "gptaq", "alpha": 1.0},)),
    }

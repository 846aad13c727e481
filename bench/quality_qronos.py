"""Issue 24, Qronos rows for bench/bench_quality.py (``configs(calib, preset)``): uint4 and uint3 g64 asymmetric
weight-only with Qronos (Quark's default damping, 1e-3 x the largest eigenvalue of H~; and GPTQ's rule, 0.01 x
mean diagonal), GPTQ at uint3 g64 for the comparison in the same run, and MiniLM's int4 g32 (preset int4_wo_32).

    python bench/bench_quality.py --no-minilm --configs "uint4 weight-only g64 asym + Qronos,..." \
        --md bench/results/ALGORITHMS_QRONOS.md --json bench/results/ALGORITHMS_QRONOS.json
"""

QRONOS = ({"name": "qronos"},)
QRONOS_MEAN_DIAG = ({"name": "qronos", "damp_scale": "mean_diagonal", "damp": 0.01},)
GPTQ = ({"name": "gptq"},)


def configs(calib, preset) -> dict:
    g64 = dict(group_size=64)
    return {
        "uint4 weight-only g64 asym + Qronos": preset("w_uint4_per_group_asym", calib, algorithms=QRONOS, **g64),
        "uint4 weight-only g64 asym + Qronos (damp 0.01 mean diag)": preset(
            "w_uint4_per_group_asym", calib, algorithms=QRONOS_MEAN_DIAG, **g64),
        "uint3 weight-only g64 asym RTN": preset("w_uint4_per_group_asym", calib, weight_dtype="uint3", **g64),
        "uint3 weight-only g64 asym + GPTQ": preset("w_uint4_per_group_asym", calib, weight_dtype="uint3",
                                                    algorithms=GPTQ, **g64),
        "uint3 weight-only g64 asym + Qronos": preset("w_uint4_per_group_asym", calib, weight_dtype="uint3",
                                                      algorithms=QRONOS, **g64),
        "int4 weight-only g32 sym + Qronos": preset("int4_wo_32", calib, algorithms=QRONOS),
    }

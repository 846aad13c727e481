"""SVDQuant rows for bench/bench_quality.py (issue 24): W4A4 int (int4 g64 weights, int4 per-token dynamic
activations) with SVDQuant's smoothing + rank-32 branch, with and without GPTQ on the residual; uint4 g64
weight-only + SVDQuant for context. The alpha search runs over 3 candidates (Quark's default grid has 19; on this
shared 2-core machine the full grid would take hours), on 512 token rows of the first 8 calibration windows.

    python bench/bench_quality.py --no-minilm --configs "W4A4 int g64 / per-token + SVDQuant,..." \\
        --md bench/results/ALGORITHMS_SVDQUANT.md --json bench/results/ALGORITHMS_SVDQUANT.json
"""

W4A4 = ("w_int4_a_int4_per_token_dynamic", 64)
ALPHAS = [0.35, 0.5, 0.65]


def configs(calib, preset) -> dict:
    sv = {"name": "svdquant", "alpha_candidates": ALPHAS}
    sv_gptq = {**sv, "use_gptq": True}
    return {
        "W4A4 int g64 / per-token + SVDQuant": preset(W4A4[0], calib, group_size=W4A4[1], algorithms=(sv,)),
        "W4A4 int g64 / per-token + SVDQuant (GPTQ)": preset(W4A4[0], calib, group_size=W4A4[1],
                                                             algorithms=(sv_gptq,)),
        "W4A4 int g64 / per-token + SVDQuant (alpha 0.5)": preset(
            W4A4[0], calib, group_size=W4A4[1], algorithms=({"name": "svdquant", "search_alpha": False},)),
        "W4A4 int g64 / per-token + QuaRot + SVDQuant (GPTQ)": preset(
            W4A4[0], calib, group_size=W4A4[1], algorithms=({"name": "quarot"}, sv_gptq)),
        "uint4 weight-only g64 asym + SVDQuant": preset("w_uint4_per_group_asym", calib, group_size=64,
                                                        algorithms=(sv,)),
        "uint4 weight-only g64 asym + SVDQuant (GPTQ)": preset("w_uint4_per_group_asym", calib, group_size=64,
                                                               algorithms=(sv_gptq,)),
    }

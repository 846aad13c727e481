"""SVDQuant (qcore.algorithms.svdquant) against a direct float64 transcription of the paper's equations
(Li et al., arXiv 2411.05007, eqs. 2-5) on small matrices, numpy and torch."""

import numpy as np
import pytest

import qcore
from qcore.algorithms.gptq import HessianStats, gptq
from qcore.algorithms.svdquant import (DEFAULT_ALPHAS, low_rank, search_alpha, svdquant, svdquant_error)

def _spec():
    import dataclasses
    return dataclasses.replace(qcore.make_spec("int4"), granularity=qcore.PerGroup(8, axis=1))


def _reference_svdquant(x, w, act_absmax, alpha, rank, spec, input_spec=None):
    """The paper, written plainly in float64: lambda_j = max|X_j|^a / max|W_j|^(1-a) (eq. 4 with SmoothQuant's
    rule), X_hat = X diag(lambda)^-1, W_hat = diag(lambda) W (here W is [out, in], so columns scale),
    W_hat = L1 L2 + R with L1 L2 the rank-r truncated SVD (eq. 5), Q(X_hat) Q(R) + X_hat L1 L2 (eq. 2)."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    lam = np.asarray(act_absmax, np.float64) ** alpha / np.abs(w).max(0) ** (1 - alpha)
    lam = np.maximum(lam, 1e-5)
    lam = lam.astype(np.float32).astype(np.float64)  # scales are stored as float32
    w_hat = (w * lam[None, :]).astype(np.float32).astype(np.float64)  # the smoothed weight, as a float32 weight
    x_hat = x / lam[None, :]
    U, S, Vt = np.linalg.svd(w_hat, full_matrices=False)
    lowrank = (U[:, :rank] * S[:rank]) @ Vt[:rank]
    R = w_hat - lowrank
    qR = np.asarray(qcore.dequantize(qcore.quantize(R.astype(np.float32), spec)), np.float64)
    xq = x_hat if input_spec is None else np.asarray(
        qcore.fake_quantize(x_hat.astype(np.float32), input_spec), np.float64)
    y = xq @ qR.T + x_hat @ lowrank.T
    return lam, lowrank, R, y


def _data(seed=0, out=24, inp=32, tokens=40):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, inp)).astype(np.float32)
    x[:, 3] *= 30.0  # an outlier channel
    w = (rng.standard_normal((out, inp)) * 0.1).astype(np.float32)
    return x, w, np.abs(x).max(0)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_matches_the_papers_equations(kind):
    x, w, amax = _data()
    spec = _spec()
    lam, lowrank, R, y_ref = _reference_svdquant(x, w, amax, 0.5, 4, spec)
    from qcore.algorithms.smoothquant import smoothquant_scales, weight_absmax
    conv = (lambda a: a) if kind == "numpy" else (lambda a: __import__("torch").from_numpy(np.asarray(a)))
    s = smoothquant_scales(conv(amax), weight_absmax(conv(w)), alpha=0.5)
    np.testing.assert_allclose(np.asarray(s, np.float64), lam, rtol=1e-6)
    r = svdquant(conv(w), s, spec, rank=4)
    l1, l2 = np.asarray(r.l1, np.float64), np.asarray(r.l2, np.float64)
    assert l1.shape == (4, 32) and l2.shape == (24, 4)
    np.testing.assert_allclose(l2 @ l1, lowrank, atol=1e-5)
    np.testing.assert_allclose(np.asarray(qcore.dequantize(r.residual), np.float64),
                               np.asarray(r.residual_weight, np.float64))
    # the layer's function: Q(x_hat) Q(R)^T + x_hat L1^T L2^T equals the transcription
    x_hat = x / np.asarray(s, np.float64)
    y = x_hat @ np.asarray(r.residual_weight, np.float64).T + x_hat @ l1.T @ l2.T
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-4)
    # the objective is that output's squared error
    err = svdquant_error(conv(x), conv(w), spec, s, rank=4)
    assert err == pytest.approx(float(((x.astype(np.float64) @ w.T.astype(np.float64) - y_ref) ** 2).sum()),
                                rel=1e-4)


def test_low_rank_is_the_truncated_svd_and_full_rank_is_exact():
    _, w, _ = _data(1)
    l1, l2 = low_rank(w, 3)
    U, S, Vt = np.linalg.svd(w.astype(np.float64))
    np.testing.assert_allclose(l2 @ l1, (U[:, :3] * S[:3]) @ Vt[:3], atol=1e-6)
    l1, l2 = low_rank(w, 1000)  # cut to min(out, in): the branch is the whole weight
    np.testing.assert_allclose(l2 @ l1, w, atol=1e-5)


def test_branch_lowers_the_error_and_alpha_search_picks_the_minimum():
    x, w, amax = _data(2)
    spec = _spec()
    in_spec = qcore.make_spec("int4")
    ones = np.ones(w.shape[1], np.float32)
    rtn = float(((x @ w.T - x @ np.asarray(qcore.dequantize(qcore.quantize(w, spec))).T) ** 2).sum())
    assert svdquant_error(x, w, spec, ones, rank=8) < rtn
    res = search_alpha(x, [w, w[:5]], spec, amax, rank=4, alphas=(0.1, 0.5, 0.9), input_spec=in_spec)
    assert set(res.losses) == {0.1, 0.5, 0.9}
    assert res.losses[res.alpha] == min(res.losses.values())
    for a in res.losses:  # each candidate's loss is the transcription's
        tot = 0.0
        for ww in (w, w[:5]):
            from qcore.algorithms.smoothquant import smoothquant_scales, weight_absmax
            s = smoothquant_scales(amax, weight_absmax([w, w[:5]]), alpha=a)
            tot += svdquant_error(x, ww, spec, s, rank=4, input_spec=in_spec)
        assert res.losses[a] == pytest.approx(tot)
    assert len(DEFAULT_ALPHAS) == 19 and DEFAULT_ALPHAS[0] == 0.05


def test_gptq_on_the_residual_uses_the_smoothed_hessian():
    x, w, amax = _data(3)
    spec = _spec()
    from qcore.algorithms.smoothquant import smoothquant_scales, weight_absmax
    s = smoothquant_scales(amax, weight_absmax(w), alpha=0.5)
    h = x.astype(np.float64).T @ x.astype(np.float64)
    r = svdquant(w, s, spec, rank=4, hessian=HessianStats(h, x.shape[0]), act_order=False)
    # the same as GPTQ run by hand on R with the smoothed inputs' Hessian diag(1/s) H diag(1/s) = X_hat^T X_hat
    xh = x.astype(np.float64) / np.asarray(s, np.float64)
    inv = 1.0 / np.asarray(s, np.float64)
    h_hat = h * inv[:, None] * inv[None, :]
    np.testing.assert_allclose(h_hat, xh.T @ xh, rtol=1e-10)
    w_hat = (w.astype(np.float64) * np.asarray(s, np.float64)).astype(np.float32)
    l1, l2 = low_rank(w_hat, 4)
    R = (w_hat.astype(np.float64) - np.asarray(l2, np.float64) @ np.asarray(l1, np.float64)).astype(np.float32)
    g = gptq(R, HessianStats(h_hat, x.shape[0]), spec, act_order=False)
    np.testing.assert_array_equal(np.asarray(r.residual_weight), np.asarray(g.weight))
    # and it beats round-to-nearest on the smoothed inputs
    rtn = svdquant(w, s, spec, rank=4)
    e = lambda q: float(((xh @ (R.astype(np.float64) - np.asarray(q, np.float64)).T) ** 2).sum())  # noqa: E731
    assert e(r.residual_weight) < e(rtn.residual_weight)


def test_errors_before_work():
    x, w, amax = _data()
    with pytest.raises(ValueError, match="rank"):
        low_rank(w, 0)
    with pytest.raises(ValueError, match="scales"):
        svdquant(w, np.ones(5, np.float32), _spec())
    with pytest.raises(ValueError, match="positive"):
        svdquant(w, -np.ones(w.shape[1], np.float32), _spec())
    with pytest.raises(ValueError, match="alphas"):
        search_alpha(x, w, _spec(), amax, alphas=(1.5,))


# ---------------------------------------------------------------------------------------------------------------
# the config: qcore's dict and Quark's algo_config (quark.torch.quantization.config.config.SVDQuantConfig)
# ---------------------------------------------------------------------------------------------------------------

#: Quark 0.13's SVDQuantConfig fields and defaults (config.py, class SVDQuantConfig)
QUARK_DEFAULTS = {"name": "svdquant", "svd_rank": 32, "smooth_alpha": 0.5, "search_alpha": True,
                  "alpha_candidates": None, "alpha_search_max_samples": 8,
                  "exclude_patterns": ["time_embedding", "add_time_proj", "conv_in", "conv_out", "time_proj"],
                  "min_layer_size": 256, "use_gptq": False, "gptq_n_bits": 4, "gptq_symmetric": True,
                  "gptq_group_size": -1, "gptq_blocksize": 128, "gptq_percdamp": 0.01, "gptq_actorder": False}


def test_config_round_trips_and_reads_and_writes_quarks_spelling():
    from qcore.algorithms.config import SVDQuantConfig, parse_algorithm, parse_algorithms
    c = SVDQuantConfig(rank=16, alpha=0.4, search_alpha=False, alpha_candidates=[0.2, 0.7], search_samples=3,
                       use_gptq=True, block_size=64, damp=0.02, act_order=True)
    assert parse_algorithm(c.to_dict()) == c
    assert parse_algorithm(c.to_quark()) == c
    q = c.to_quark()
    assert set(q) <= set(QUARK_DEFAULTS)
    assert q["svd_rank"] == 16 and q["smooth_alpha"] == 0.4 and q["gptq_percdamp"] == 0.02 and q["gptq_actorder"]
    assert parse_algorithm(QUARK_DEFAULTS) == SVDQuantConfig() == parse_algorithm("svdquant")
    assert parse_algorithms("svdquant")[0].rank == 32
    assert SVDQuantConfig().to_quark()["alpha_candidates"] is None  # Quark's "default grid"
    with pytest.raises(ValueError, match="unknown key 'svd_ranks'"):
        parse_algorithm({"name": "svdquant", "svd_ranks": 4})
    with pytest.raises(ValueError, match="rank"):
        SVDQuantConfig(rank=0)
    with pytest.raises(ValueError, match="alpha_candidates"):
        SVDQuantConfig(alpha_candidates=[1.5])
    with pytest.raises(TypeError, match="use_gptq"):
        SVDQuantConfig(use_gptq="yes")


def test_quark_defaults_match_quarks_source():
    """Where Quark 0.13's source is installed (the interop venv), its SVDQuantConfig's fields are the ones above."""
    import ast
    import pathlib
    path = next(pathlib.Path("~/.cache/qcore/interop/quark-0.13").expanduser().glob(
        "lib/python3*/site-packages/quark/torch/quantization/config/config.py"), None)
    if path is None:
        pytest.skip("amd-quark 0.13 is not installed in the interop cache")
    tree = ast.parse(path.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "SVDQuantConfig")
    fields = [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign)]
    assert fields == list(QUARK_DEFAULTS)
    for s in cls.body:
        if isinstance(s, ast.AnnAssign) and isinstance(s.value, ast.Constant):
            assert QUARK_DEFAULTS[s.target.id] == s.value.value


def test_the_searchs_randomized_svd_is_close_to_the_exact_one():
    from qcore._backend import ops
    from qcore.algorithms.svdquant import _sketch_low_rank
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((96, 80)) * np.logspace(0, -2, 80)[None, :]).astype(np.float32)
    a1, a2 = _sketch_low_rank(w, 8, ops(w))
    b1, b2 = low_rank(w, 8)
    ra, rb = np.linalg.norm(w - a2 @ a1), np.linalg.norm(w - b2 @ b1)
    assert rb <= ra <= 1.01 * rb
    x, _, amax = _data(5, out=96, inp=80)
    spec = _spec()
    s = np.ones(80, np.float32)
    e1 = svdquant_error(x, w, spec, s, rank=8, exact=False)
    e2 = svdquant_error(x, w, spec, s, rank=8)
    assert abs(e1 - e2) <= 0.05 * e2

"""SmoothQuant / AutoSmoothQuant (qcore.algorithms.smoothquant): the rule against a direct transcription, the
effect on W8A8 int8 per-tensor error, the search, numpy == torch bit for bit, argument checks."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import math  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import qcore  # noqa: E402
from qcore.algorithms.smoothquant import (SmoothLoss, SmoothResult, SmoothRule, auto_smoothquant,  # noqa: E402
                                          smoothquant_scales, weight_absmax)

INT8 = qcore.make_spec("int8")  # per-tensor symmetric: W8A8 int8 per-tensor


def outlier_data(seed=0, t=256, n=128, outs=(96, 64)):
    """Activations with a few outlier channels (x50), as in LLMs; weights of moderate range."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, n)).astype(np.float32)
    x[:, rng.choice(n, 6, replace=False)] *= 50.0
    ws = [(rng.standard_normal((o, n)) * 0.05).astype(np.float32) for o in outs]
    return x, ws


def w8a8_error(x, ws, s):
    """sum_i mean (x W_i^T - Q(x/s) Q(W_i s)^T)^2, float64, by hand."""
    xq = qcore.fake_quantize((x / s).astype(np.float32), INT8).astype(np.float64)
    tot = 0.0
    for w in ws:
        wq = qcore.fake_quantize((w * s).astype(np.float32), INT8).astype(np.float64)
        ref = x.astype(np.float64) @ w.astype(np.float64).T
        tot += np.mean((ref - xq @ wq.T) ** 2)
    return tot


# ---- the rule ---------------------------------------------------------------------------------------------------


def transcription(act, w, alpha, clamp_min):
    out = np.empty(len(act), dtype=np.float32)
    for j, (a, b) in enumerate(zip(act.astype(np.float64), w.astype(np.float64))):
        if a == 0 or b == 0:
            out[j] = 1.0
        else:
            out[j] = np.float32(max(math.pow(a, alpha) / math.pow(b, 1 - alpha), clamp_min))
    return out


@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5, 0.85, 1.0])
def test_scales_equal_a_direct_transcription(alpha):
    rng = np.random.default_rng(1)
    act = np.abs(rng.standard_normal(200) * 10).astype(np.float32)
    w = np.abs(rng.standard_normal(200) * 0.1).astype(np.float32)
    act[:3] = 0.0
    w[5:7] = 0.0
    act[10] = 1e-12  # clamps at clamp_min for alpha > 0
    s = smoothquant_scales(act, w, alpha=alpha, clamp_min=1e-5)
    assert s.dtype == np.float32
    np.testing.assert_array_equal(s, transcription(act, w, alpha, 1e-5))
    assert np.all(s[:3] == 1) and np.all(s[5:7] == 1)


def test_weight_absmax_over_all_linears():
    _, ws = outlier_data()
    np.testing.assert_array_equal(weight_absmax(ws), np.maximum(np.abs(ws[0]).max(0), np.abs(ws[1]).max(0)))
    np.testing.assert_array_equal(weight_absmax(ws[0]), np.abs(ws[0]).max(0))


def test_smoothing_lowers_w8a8_error_on_outlier_channels():
    x, ws = outlier_data()
    s = smoothquant_scales(np.abs(x).max(0), weight_absmax(ws), alpha=0.5)
    plain = w8a8_error(x, ws, np.ones(x.shape[1], np.float32))
    smooth = w8a8_error(x, ws, s)
    assert smooth < 0.5 * plain, (smooth, plain)


def test_scales_numpy_torch_same_bits(torch):
    rng = np.random.default_rng(2)
    act = np.abs(rng.standard_normal(999) * 30).astype(np.float32)
    w = np.abs(rng.standard_normal(999) * 0.2).astype(np.float32)
    act[::50] = 0
    for alpha in (0.05, 0.5, 0.73, 0.95):
        a = smoothquant_scales(act, w, alpha=alpha)
        b = smoothquant_scales(torch.from_numpy(act), torch.from_numpy(w), alpha=alpha)
        assert isinstance(b, torch.Tensor) and b.dtype == torch.float32
        np.testing.assert_array_equal(a.view(np.uint32), b.numpy().view(np.uint32))


# ---- AutoSmoothQuant --------------------------------------------------------------------------------------------


def test_auto_smoothquant_picks_the_grid_minimum_and_beats_fixed_alpha():
    x, ws = outlier_data(3)
    r = auto_smoothquant(x, ws, weight_spec=INT8, input_spec=INT8)
    assert isinstance(r, SmoothResult)
    alphas = [a for a, _ in r.losses]
    assert alphas[0] is None and alphas[1:] == [i / 20 for i in range(1, 20)]
    assert r.loss == min(v for _, v in r.losses)
    # The reported loss is the W8A8 error of the reported scales, computed independently.
    assert r.loss == pytest.approx(w8a8_error(x, ws, r.scales), rel=1e-9)
    fixed = smoothquant_scales(np.abs(x).max(0), weight_absmax(ws), alpha=0.5)
    assert r.loss <= w8a8_error(x, ws, fixed) * (1 + 1e-9)
    assert r.loss < w8a8_error(x, ws, np.ones(x.shape[1], np.float32))  # smoothing wins on outlier data
    np.testing.assert_array_equal(r.scales, smoothquant_scales(np.abs(x).max(0), weight_absmax(ws), alpha=r.alpha))


def test_identity_kept_when_smoothing_only_hurts():
    # int16 activations lose almost nothing; alpha = 1 moves the activation outliers into the int8 weights.
    x, ws = outlier_data(4)
    i16 = qcore.make_spec("int16")
    r = auto_smoothquant(x, ws, weight_spec=INT8, input_spec=i16, alphas=[1.0])
    assert r.alpha is None and np.all(r.scales == 1)
    assert r.losses[0][1] < r.losses[1][1]
    r2 = auto_smoothquant(x, ws, weight_spec=INT8, input_spec=i16, alphas=[1.0], include_identity=False)
    assert r2.alpha == 1.0 and len(r2.losses) == 1


def test_act_power_rule_is_quarks_grid():
    x, ws = outlier_data(5)
    r = auto_smoothquant(x, ws, weight_spec=INT8, input_spec=INT8, rule=SmoothRule.ACT_POWER)
    assert [a for a, _ in r.losses] == [i / 10 for i in range(10)]  # ratio 0 is the identity, no extra candidate
    act = np.abs(x).max(0).astype(np.float64)
    s = np.maximum(act ** r.alpha, 1e-4)
    s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
    np.testing.assert_array_equal(r.scales, s)
    # rel 1e-6: a candidate that is not a finalist reports its float32-screened loss (module docstring)
    assert r.losses[0][1] == pytest.approx(w8a8_error(x, ws, np.ones(x.shape[1], np.float32)), rel=1e-6)


def test_mae_loss_and_max_tokens():
    x, ws = outlier_data(6, t=300)
    r = auto_smoothquant(x, ws, weight_spec=INT8, input_spec=INT8, loss=SmoothLoss.MAE, alphas=[0.5])
    xs = x / r.scales
    xq = qcore.fake_quantize(xs, INT8).astype(np.float64)
    want = sum(np.mean(np.abs(x.astype(np.float64) @ w.T.astype(np.float64)
                              - xq @ qcore.fake_quantize(w * r.scales, INT8).astype(np.float64).T)) for w in ws)
    assert r.loss == pytest.approx(want, rel=1e-9)
    # max_tokens: the loss uses every 3rd token (ceil(300 / 100)); the statistic still every token.
    r3 = auto_smoothquant(x, ws, weight_spec=INT8, input_spec=INT8, alphas=[0.5], max_tokens=100,
                          include_identity=False)
    s = smoothquant_scales(np.abs(x).max(0), weight_absmax(ws), alpha=0.5)
    np.testing.assert_array_equal(r3.scales, s)
    assert r3.loss == pytest.approx(w8a8_error(x[::3], ws, s), rel=1e-9)


def test_per_weight_specs_and_given_act_absmax():
    x, ws = outlier_data(7)
    specs = [INT8, qcore.make_spec("int8", axis=0)]
    act = np.abs(x).max(0) * 2
    r = auto_smoothquant(x, ws, weight_spec=specs, input_spec=INT8, act_absmax=act, alphas=[0.5],
                         include_identity=False)
    np.testing.assert_array_equal(r.scales, smoothquant_scales(act, weight_absmax(ws), alpha=0.5))


def test_auto_smoothquant_numpy_torch_same_choice_and_bits(torch):
    x, ws = outlier_data(8)
    a = auto_smoothquant(x, ws, weight_spec=INT8, input_spec=INT8)
    b = auto_smoothquant(torch.from_numpy(x), [torch.from_numpy(w) for w in ws], weight_spec=INT8, input_spec=INT8)
    assert a.alpha == b.alpha
    assert isinstance(b.scales, torch.Tensor)
    np.testing.assert_array_equal(a.scales.view(np.uint32), b.scales.numpy().view(np.uint32))
    for (ka, la), (kb, lb) in zip(a.losses, b.losses):
        assert ka == kb and la == pytest.approx(lb, rel=1e-6)  # screened losses: float32 matmuls (docstring)
    assert a.loss == pytest.approx(b.loss, rel=1e-12)  # the winner's: float64 in both


def test_deterministic():
    x, ws = outlier_data(9)
    a = auto_smoothquant(x, ws, weight_spec=INT8, input_spec=INT8)
    b = auto_smoothquant(x, ws, weight_spec=INT8, input_spec=INT8)
    assert a.losses == b.losses and np.array_equal(a.scales, b.scales)


# ---- argument checks --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(act_absmax=np.ones((2, 3), np.float32)), ValueError, "act_absmax must be a 1-D"),
    (dict(weight_absmax=np.ones(5, np.float32)), ValueError, "weight_absmax has 5"),
    (dict(act_absmax=-np.ones(4, np.float32)), ValueError, "act_absmax must be non-negative"),
    (dict(weight_absmax=np.array([1, np.nan, 1, 1], np.float32)), ValueError, "weight_absmax must be finite"),
    (dict(act_absmax=np.ones(4, np.int32)), TypeError, "act_absmax"),
    (dict(act_absmax=[1.0, 2.0, 3.0, 4.0]), TypeError, "act_absmax must be a numpy array"),
    (dict(alpha=1.5), ValueError, "alpha must be in"),
    (dict(alpha="0.5"), TypeError, "alpha"),
    (dict(clamp_min=0.0), ValueError, "clamp_min must be > 0"),
])
def test_smoothquant_scales_rejects(kwargs, exc, match):
    args = dict(act_absmax=np.ones(4, np.float32), weight_absmax=np.ones(4, np.float32))
    args.update(kwargs)
    a, w = args.pop("act_absmax"), args.pop("weight_absmax")
    with pytest.raises(exc, match=match):
        smoothquant_scales(a, w, **args)


def test_smoothquant_scales_rejects_mixed_kinds(torch):
    with pytest.raises(TypeError, match="weight_absmax must be the same array kind"):
        smoothquant_scales(np.ones(4, np.float32), torch.ones(4))


def test_unrepresentable_scale_raises():
    with pytest.raises(ValueError, match="channel 0"):
        smoothquant_scales(np.array([1.0], np.float32), np.array([1e-44], np.float32), alpha=0.0)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(loss="mse"), TypeError, r"loss must be a SmoothLoss.*SmoothLoss\('mse'\)"),
    (dict(rule="quark"), TypeError, "rule must be a SmoothRule"),
    (dict(alphas=[]), ValueError, "alphas must hold"),
    (dict(alphas=[0.5, 0.5]), ValueError, "distinct"),
    (dict(alphas=[0.5, 2.0]), ValueError, r"alphas\[1\] must be in"),
    (dict(max_tokens=0), ValueError, "max_tokens must be >= 1"),
    (dict(weight_spec=None), TypeError, "weight_spec"),
    (dict(weight_spec=[INT8]), ValueError, "one spec per weight"),
    (dict(input_spec="nope"), ValueError, "input_spec"),
    (dict(act_absmax=np.ones(3, np.float32)), ValueError, "act_absmax has 3 channels"),
    (dict(include_identity=1), TypeError, "include_identity"),
])
def test_auto_smoothquant_rejects(kwargs, exc, match):
    x, ws = outlier_data(0, t=16, n=8, outs=(4, 4))
    args = dict(weight_spec=INT8, input_spec=INT8)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        auto_smoothquant(x, ws, **args)


def test_auto_smoothquant_rejects_bad_arrays():
    x, ws = outlier_data(0, t=16, n=8, outs=(4, 4))
    with pytest.raises(ValueError, match=r"weights\[1\] has shape \(4, 7\)"):
        auto_smoothquant(x, [ws[0], ws[1][:, :7]], weight_spec=INT8, input_spec=INT8)
    with pytest.raises(ValueError, match="x must be a 2-D"):
        auto_smoothquant(x[0], ws, weight_spec=INT8, input_spec=INT8)
    bad = x.copy()
    bad[3, 2] = np.nan
    with pytest.raises(ValueError, match="x must be finite"):
        auto_smoothquant(bad, ws, weight_spec=INT8, input_spec=INT8)
    with pytest.raises(ValueError, match="weights must hold at least one"):
        auto_smoothquant(x, [], weight_spec=INT8, input_spec=INT8)
    with pytest.raises(TypeError, match="weights must be"):
        auto_smoothquant(x, "w", weight_spec=INT8, input_spec=INT8)


def test_module_import_does_not_import_torch(numpy_only):
    numpy_only("import numpy as np\nimport qcore.algorithms.smoothquant as sq\nimport qcore.algorithms.awq as awq\n"
               "s = sq.smoothquant_scales(np.ones(3, np.float32), np.ones(3, np.float32))\n")

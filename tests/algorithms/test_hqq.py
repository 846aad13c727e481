"""HQQ (``qcore.algorithms.hqq``) against a plain float64 transcription of its update, its error against
round-to-nearest, numpy/torch agreement, the refusals, and its config."""

import math

import numpy as np
import pytest

import qcore
from qcore import PerChannel, PerGroup, PerTensor, QuantSpec, RoundingMode
from qcore.algorithms.config import HQQConfig, parse_algorithm, parse_algorithms
from qcore.algorithms.hqq import hqq

UINT4_G = QuantSpec("uint4", PerGroup(16, axis=1))


def _weights(shape, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_t(4, size=shape) * 0.02).astype(np.float32)  # heavy tails, as LLM weights


# ---------------------------------------------------------------------------------------------------------------
# the transcription: one group at a time, float64, written from the equations (module docstring of hqq.py; the
# paper's shrinkage and zero-point step, the quadratic step solved over the scale and an integer zero point)
# ---------------------------------------------------------------------------------------------------------------


def _reference_group(w, s, z, qmin, qmax, symmetric, p, beta, kappa, iters, error_p, scale_floor):
    """One group ``w`` (float64 vector) from scale ``s`` and zero point ``z``; returns the best (s, z) by
    ``mean |error|^error_p``."""
    def lp_error(s, z):
        wq = np.clip(np.rint(w / s) + z, qmin, qmax)
        return np.mean(np.abs(w - s * (wq - z)) ** error_p)

    best = (s, z, lp_error(s, z))
    floor = scale_floor * s                                    # the scale never below floor x the min/max one
    for _ in range(iters):
        wq = np.clip(np.rint(w / s) + z, qmin, qmax)           # W_q
        wr = s * (wq - z)                                      # W_r
        d = w - wr
        we = np.zeros_like(d)                                  # W_e = shrink_p(W - W_r, beta)
        nz = d != 0
        we[nz] = np.sign(d[nz]) * np.maximum(np.abs(d[nz]) - np.abs(d[nz]) ** (p - 1) / beta, 0.0)
        t = w - we                                             # the quadratic step's target
        if symmetric:                                          # min_s ||t - s wq||^2
            num, den = np.dot(wq, t), np.dot(wq, wq)
            ok = den > 0 and num > 0
            s_new, z_new = (max(num / den, floor), z) if ok else (s, z)
        else:                                                  # min_{s, z} ||t - s (wq - z)||^2, z integer
            var = np.sum((wq - wq.mean()) ** 2)
            cov = np.sum((wq - wq.mean()) * (t - t.mean()))
            s_ls = cov / var if (var > 0 and cov > 0) else s
            z_int = float(np.clip(np.rint(wq.mean() - t.mean() / s_ls), qmin, qmax))
            num, den = np.dot(wq - z_int, t), np.dot(wq - z_int, wq - z_int)
            ok = den > 0 and num > 0
            s_new, z_new = (max(num / den, floor), z_int) if ok else (s, z)
        s, z = float(np.float32(s_new)), z_new                 # the scale as stored (float32)
        beta *= kappa
        e = lp_error(s, z)
        if e < best[2]:
            best = (s, z, e)
    return best[0], best[1]


def _reference_hqq(w, spec, *, p=0.7, beta=10.0, kappa=1.01, iters=20, error_p=2.0, scale_floor=1.0):
    """HQQ of a 2-D weight under a per-group (axis 1) or per-channel (axis 0) spec, group by group."""
    start = qcore.quantize(w, spec)  # the min/max start (qcore's round-to-nearest parameters)
    s0 = np.asarray(start.scales, np.float64)
    z0 = np.zeros_like(s0) if start.zero_points is None else np.asarray(start.zero_points, np.float64)
    g = spec.granularity
    size = w.shape[1] if isinstance(g, PerChannel) else g.size
    s_out, z_out = np.empty_like(s0), np.empty_like(z0)
    w64 = w.astype(np.float64)
    for r in range(w.shape[0]):
        for j in range(s0.shape[1]):
            grp = w64[r, j * size:(j + 1) * size]
            s_out[r, j], z_out[r, j] = _reference_group(grp, s0[r, j], z0[r, j], float(spec.qmin), float(spec.qmax),
                                                        spec.symmetric, p, beta, kappa, iters, error_p,
                                                        scale_floor)
    zp = None if spec.symmetric else z_out.astype(np.float32)
    return qcore.quantize(w, spec, scale=s_out.astype(np.float32), zero_point=zp)


SPECS = [UINT4_G, QuantSpec("int4", PerGroup(16, axis=1)), QuantSpec("uint3", PerGroup(16, axis=1)),
         QuantSpec("uint4", PerChannel(0)), QuantSpec("uint4", PerGroup(12, axis=1))]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.dtype.name}-{s.granularity}")
@pytest.mark.parametrize("error_p, floor", [(2.0, 1.0), (2.0, 0.0), (0.7, 0.0), (1.0, 0.5)])
def test_hqq_equals_the_float64_transcription(spec, error_p, floor):
    w = _weights((12, 48), seed=1)
    ref = _reference_hqq(w, spec, error_p=error_p, scale_floor=floor)
    got = hqq(w, spec, precision="float64", error_p=error_p, scale_floor=floor)
    np.testing.assert_array_equal(got.scales, ref.scales)
    if not spec.symmetric:
        np.testing.assert_array_equal(got.zero_points, ref.zero_points)
    np.testing.assert_array_equal(got.codes, ref.codes)
    # float32 arithmetic (the default): the iteration is discontinuous (a code that flips changes the next
    # least-squares step), so a group's float32 trajectory may leave the float64 one; most groups end on the same
    # parameters, and the error reached is no more than 5 percent above (in these cases it is within 3 percent,
    # either way)
    f32 = hqq(w, spec, error_p=error_p, scale_floor=floor)
    assert np.mean(np.isclose(f32.scales, ref.scales, rtol=1e-4)) > 0.75
    lp = lambda q: np.mean(np.abs(w.astype(np.float64) - qcore.dequantize(q)) ** error_p)  # noqa: E731
    assert lp(f32) < 1.05 * lp(ref)


def test_the_transcription_moves_the_parameters():
    """Not round-to-nearest in disguise: the iterations change parameters of most groups."""
    w = _weights((16, 64), seed=2)
    rtn, got = qcore.quantize(w, UINT4_G), _reference_hqq(w, UINT4_G)
    assert np.mean(got.scales != rtn.scales) > 0.25 and np.mean(got.codes != rtn.codes) > 0.002


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.dtype.name}-{s.granularity}")
def test_hqq_error_is_below_round_to_nearest(spec):
    w = _weights((64, 96), seed=3)
    rtn, got, by_lp = qcore.quantize(w, spec), hqq(w, spec, scale_floor=0.0), hqq(w, spec, error_p=0.7, scale_floor=0)
    e_rtn, e_hqq = w - qcore.dequantize(rtn), w - qcore.dequantize(got)
    size = w.shape[1] if isinstance(spec.granularity, PerChannel) else spec.granularity.size

    def per_group(e, f):  # per group mean of f(e) (ragged last group included)
        return np.array([[f(e[r, j:j + size]).mean() for j in range(0, w.shape[1], size)] for r in range(w.shape[0])])
    sq = lambda e: e.astype(np.float64) ** 2  # noqa: E731
    lp = lambda e: np.abs(e.astype(np.float64)) ** 0.7  # noqa: E731
    # the error each group's iterate is chosen by: never worse than the start (round-to-nearest) in any group
    assert np.all(per_group(e_hqq, sq) <= per_group(e_rtn, sq) * (1 + 1e-5))
    assert sq(e_hqq).mean() < sq(e_rtn).mean() * 0.995
    e_lp = w - qcore.dequantize(by_lp)  # chosen by the Lp error HQQ's splitting minimises
    assert np.all(per_group(e_lp, lp) <= per_group(e_rtn, lp) * (1 + 1e-5))
    assert lp(e_lp).mean() < lp(e_rtn).mean() * 0.995
    floored = hqq(w, spec)  # the default: scales never below the min/max ones, the error still never above RTN's
    assert np.all(np.asarray(floored.scales) >= np.asarray(rtn.scales))
    e_fl = w - qcore.dequantize(floored)
    assert np.all(per_group(e_fl, sq) <= per_group(e_rtn, sq) * (1 + 1e-5))


def test_numpy_and_torch_agree_and_zero_iterations_is_round_to_nearest():
    torch = pytest.importorskip("torch")
    w = _weights((32, 64), seed=4)
    a, b = hqq(w, UINT4_G), hqq(torch.from_numpy(w), UINT4_G)
    assert isinstance(b.codes, torch.Tensor)
    assert np.mean(a.codes == b.codes.numpy()) > 0.999
    np.testing.assert_allclose(a.scales, b.scales.numpy(), rtol=1e-5)
    rtn = qcore.quantize(w, UINT4_G)
    z = hqq(w, UINT4_G, iters=0)
    np.testing.assert_array_equal(z.codes, rtn.codes)
    np.testing.assert_array_equal(z.scales, rtn.scales)


def test_the_result_is_an_ordinary_qtensor_of_the_spec():
    """Integer zero points in the code range, scales in the scale dtype: quantize with them gives the same codes."""
    spec = QuantSpec("uint4", PerGroup(16, axis=1), scale_dtype="float16")
    w = _weights((8, 64), seed=5)
    q = hqq(w, spec)
    assert q.spec == spec
    z = np.asarray(q.zero_points)
    assert np.all(z == np.rint(z)) and z.min() >= 0 and z.max() <= 15
    assert np.all(np.asarray(q.scales, np.float32).astype(np.float16).astype(np.float32) == q.scales)
    again = qcore.quantize(w, spec, scale=q.scales, zero_point=q.zero_points)
    np.testing.assert_array_equal(again.codes, q.codes)
    # degenerate groups (constant, all zero) keep usable parameters
    w2 = np.zeros((2, 32), np.float32)
    w2[1, :16] = 0.5
    q2, r2 = qcore.dequantize(hqq(w2, spec)), qcore.dequantize(qcore.quantize(w2, spec))
    assert np.all(np.isfinite(q2)) and np.all(q2[0] == 0) and np.abs(q2 - w2).max() <= np.abs(r2 - w2).max()
    qt = hqq(w, QuantSpec("uint4", PerTensor()))
    assert qt.scales.shape == (1, 1)


@pytest.mark.parametrize("spec, match", [
    (QuantSpec("float8_e4m3fn", PerChannel(0)), "float element formats"),
    (qcore.make_spec("mxint8"), "power-of-two scales"),
    (QuantSpec("int4", PerGroup(16, axis=1), rounding=RoundingMode.STOCHASTIC), "round-to-nearest"),
])
def test_specs_it_cannot_take_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        hqq(_weights((4, 64)), spec)


@pytest.mark.parametrize("kw, match", [
    (dict(p=0.0), "p must be in"), (dict(p=1.5), "p must be in"), (dict(beta=0), "beta must be in"),
    (dict(kappa=0.5), "kappa must be in"), (dict(iters=-1), "iters must be"), (dict(iters=2.5), "iters must be"),
    (dict(precision="float16"), "precision must be"), (dict(p=math.nan), "finite"), (dict(error_p=-1), "error_p"),
    (dict(scale_floor=1.5), "scale_floor"),
])
def test_bad_options_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        hqq(_weights((4, 32)), UINT4_G, **kw)


def test_bad_weights_are_refused():
    w = _weights((4, 32))
    w[1, 3] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        hqq(w, UINT4_G)
    with pytest.raises(TypeError, match="numpy array or a torch tensor"):
        hqq([[1.0] * 32], UINT4_G)
    with pytest.raises(TypeError, match="float array"):
        hqq(np.ones((4, 32), np.int32), UINT4_G)
    with pytest.raises(TypeError, match="QuantSpec"):
        hqq(_weights((4, 32)), "uint4")
    with pytest.raises(ValueError, match="non-empty"):
        hqq(np.zeros((0, 32), np.float32), UINT4_G)


# ---------------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------------


def test_config_round_trips_and_has_no_quark_entry():
    c = HQQConfig(p=0.5, beta=20, kappa=1.05, iters=10, error_p=1, scale_floor=0)
    assert parse_algorithm(c.to_dict()) == c and c.beta == 20.0
    assert parse_algorithm("hqq") == HQQConfig() and HQQConfig().to_dict() == {
        "name": "hqq", "p": 0.7, "beta": 10.0, "kappa": 1.01, "iters": 20, "error_p": 2.0, "scale_floor": 1.0,
        "decoder_layers": None}
    assert parse_algorithm({"name": "hqq", "lp_norm": 0.6}).p == 0.6  # mobiusml/hqq's opt_params key
    assert c.to_quark() is None and HQQConfig.data_free  # Quark has no HQQ (and refuses unknown names)
    assert parse_algorithms("awq,hqq")[1] == HQQConfig()
    for kw, match in ((dict(p=0), "HQQConfig.p"), (dict(kappa=0.9), "HQQConfig.kappa"),
                      (dict(iters=-1), "HQQConfig.iters"), (dict(beta=-1.0), "HQQConfig.beta"),
                      (dict(error_p=0), "HQQConfig.error_p"), (dict(scale_floor=2), "HQQConfig.scale_floor")):
        with pytest.raises(ValueError, match=match):
            HQQConfig(**kw)
    with pytest.raises(ValueError, match="unknown key 'lr'"):
        parse_algorithm({"name": "hqq", "lr": 0.1})

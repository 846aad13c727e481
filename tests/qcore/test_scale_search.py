"""Searched FP4 block scales (qcore.stats.four_over_six, qcore.stats.exponent_search) against float64 transcriptions of
their rules: a plain Python loop over the blocks and the candidate scales, with ml_dtypes' casts for the element and
scale grids (not qcore's), float32 arithmetic where the spec's arithmetic is float32, float64 error sums.

Four over six: arXiv 2512.02010 / mit-han-lab/fouroversix (``quantize/pytorch/reference.py``: ``select_fouroversix``,
``E4M3_MAX_FOUROVERSIX = 256``, ``select_4 = err_4 < err_6``).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from qcore import ScaleMode, TensorScale, fake_quantize, make_spec, quantize
from qcore.stats import exponent_search, four_over_six, four_over_six_scale_max

F32 = np.float32
_ML = {"float4_e2m1fn": ml_dtypes.float4_e2m1fn, "float6_e2m3fn": ml_dtypes.float6_e2m3fn,
       "float6_e3m2fn": ml_dtypes.float6_e3m2fn, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}


def _data(kind, shape, seed):
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal(shape).astype(F32)
    if kind == "heavy":  # Student-t with 2 degrees of freedom: a few large outliers per block
        return (rng.standard_t(2, shape) * 0.02).astype(F32)
    raise ValueError(kind)


def _round_to(v: float, name: str) -> float:
    """float32 ``v`` rounded to the element format (nearest-even), saturating at its largest finite value."""
    mx = float(ml_dtypes.finfo(_ML[name]).max)
    v = min(max(v, -mx), mx)
    return float(np.array([v], F32).astype(_ML[name]).astype(F32)[0])


def _sq_err(xs, ys) -> float:
    return sum((float(a) - float(b)) ** 2 for a, b in zip(xs, ys))


# ---------------------------------------------------------------------------------------------------------------
# four over six
# ---------------------------------------------------------------------------------------------------------------


def ref_four_over_six(x, block=16):
    """Per row-block of 16: the tensor scale g = amax / (6 * 256) (float32), the candidate E4M3 block scales
    ``cast(clip(fl(fl(bmax / t) / g), 2**-6, 448))`` for t = 6 and t = 4, each block's elements
    ``round_e2m1(fl(x * fl(fl(1 / g) / s))) * fl(g * s)``, and the candidate of smaller float64 squared error
    (ties: 6)."""
    amax = F32(np.abs(x).max())
    g = F32(amax / F32(6 * 256))
    out = np.zeros((x.shape[0], x.shape[1] // block), F32)
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // block):
            xs = x[r, b * block:(b + 1) * block]
            bmax = F32(np.abs(xs).max())
            best = None
            for t in (6.0, 4.0):
                s = F32(F32(bmax / F32(t)) / g)
                s = F32(min(max(s, F32(2.0 ** -6)), F32(448.0)))
                s = F32(np.array([s], F32).astype(ml_dtypes.float8_e4m3fn).astype(F32)[0])
                q_mul = F32(F32(F32(1.0) / g) / s)
                dq = F32(g * s)
                ys = [F32(F32(_round_to(float(F32(v * q_mul)), "float4_e2m1fn")) * dq) for v in xs]
                e = _sq_err(xs, ys)
                if best is None or e < best[1]:
                    best = (s, e)
            out[r, b] = best[0]
    return g, out


@pytest.mark.parametrize("kind,seed", [("normal", 0), ("heavy", 1), ("heavy", 2)])
def test_four_over_six_matches_the_transcription(kind, seed):
    x = _data(kind, (8, 64), seed)
    spec = make_spec("nvfp4", axis=1)
    p = four_over_six(x, spec)
    g, want = ref_four_over_six(x)
    assert float(p.tensor_scale) == float(g)
    np.testing.assert_array_equal(p.scale, want)
    # both candidates occur (the test exercises the choice, not one branch)
    own = quantize(x, spec, tensor_scale=p.tensor_scale).scales
    assert (p.scale != own).any() and (p.scale == own).any()


def test_four_over_six_params_reproduce_and_never_lose():
    x = _data("heavy", (32, 256), 3)
    spec = make_spec("nvfp4", axis=1)
    p = four_over_six(x, spec)
    q = quantize(x, spec, **p.kwargs())
    np.testing.assert_array_equal(q.scales, p.scale)
    assert float(q.tensor_scale) == float(p.tensor_scale)
    # per block, never worse than the "max -> 6" scale under the same tensor scale
    six = fake_quantize(x, spec, tensor_scale=p.tensor_scale)
    mine = fake_quantize(x, spec, **p.kwargs())
    e6 = ((x.astype(np.float64) - six) ** 2).reshape(32, 16, 16).sum(-1)
    e = ((x.astype(np.float64) - mine) ** 2).reshape(32, 16, 16).sum(-1)
    assert (e <= e6).all() and (e < e6).any()
    # the scales still fit E4M3 without clamping: the largest block's "max -> 4" scale is 384 <= 448
    assert float(np.max(p.scale)) <= 384.0


def test_four_over_six_scale_max():
    assert four_over_six_scale_max(make_spec("nvfp4").scale_dtype) == 256.0
    e5m3 = make_spec("nvfp4", scale_dtype="float8_e5m3").scale_dtype
    m = four_over_six_scale_max(e5m3)
    assert m * 1.5 <= e5m3.max_finite < m * 3


def test_four_over_six_given_tensor_scale_zero_tensor_and_torch():
    torch = pytest.importorskip("torch")
    spec = make_spec("nvfp4", axis=1)
    x = _data("heavy", (4, 64), 4)
    p = four_over_six(x, spec, tensor_scale=0.01)
    assert float(p.tensor_scale) == np.float32(0.01)
    z = four_over_six(np.zeros((2, 32), F32), spec)
    assert float(z.tensor_scale) == 1.0 and np.array_equal(fake_quantize(np.zeros((2, 32), F32), spec,
                                                                         **z.kwargs()), np.zeros((2, 32)))
    pt = four_over_six(torch.from_numpy(x), spec)
    pn = four_over_six(x, spec)
    assert np.array_equal(pt.scale.numpy(), pn.scale) and float(pt.tensor_scale) == float(pn.tensor_scale)
    # TensorScale.ONE: g stays 1 (no tensor scale returned)
    one = four_over_six(x, make_spec("nvfp4", axis=1, tensor_scale_mode=TensorScale.ONE))
    assert one.tensor_scale is None


@pytest.mark.parametrize("spec,call,match", [
    ("mxfp4", "4o6", "not a two-level"),
    ("int4", "4o6", "not a two-level"),
    ("nvfp4", "search", "two-level"),
    ("int8", "search", "not powers of two"),
])
def test_refusals_name_the_spec(spec, call, match):
    x = np.ones((2, 32), F32)
    with pytest.raises(ValueError, match=match):
        (four_over_six if call == "4o6" else exponent_search)(x, make_spec(spec, axis=1))


def test_four_over_six_refusals():
    x = np.ones((2, 32), F32)
    x[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        four_over_six(x, make_spec("nvfp4", axis=1))
    with pytest.raises(ValueError, match="GIVEN: pass tensor_scale"):
        four_over_six(np.ones((2, 32), F32), make_spec("nvfp4", axis=1, tensor_scale_mode=TensorScale.GIVEN))
    with pytest.raises(ValueError, match="float4_e2m1fn"):
        four_over_six(np.ones((2, 32), F32), make_spec("nvfp4", axis=1, dtype="float6_e2m3fn"))
    with pytest.raises(ValueError, match="tensor_scale"):
        four_over_six(np.ones((2, 32), F32), make_spec("nvfp4", axis=1), tensor_scale=-1.0)


# ---------------------------------------------------------------------------------------------------------------
# E8M0 exponent search
# ---------------------------------------------------------------------------------------------------------------


def _emax(name):
    return int(math.floor(math.log2(float(ml_dtypes.finfo(_ML[name]).max))))


def ref_exponent_search(x, element, rule_exponents, radius=1, block=32):
    """Per row-block of 32: candidates e, e-1, e+1, ... (e: the rule's exponent), elements
    ``round(x / 2**s) * 2**s`` (exact in float64), the first candidate of strictly smallest float64 squared error."""
    out = np.zeros((x.shape[0], x.shape[1] // block), F32)
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // block):
            xs = x[r, b * block:(b + 1) * block]
            e = int(rule_exponents[r, b])
            best = None
            for k in [0] + [s * d for d in range(1, radius + 1) for s in (-1, 1)]:
                s = min(max(e + k, -127), 127)
                ys = [_round_to(float(v) * 2.0 ** -s, element) * 2.0 ** s for v in xs]
                err = _sq_err(xs, ys)
                if best is None or err < best[1]:
                    best = (2.0 ** s, err)
            out[r, b] = best[0]
    return out


@pytest.mark.parametrize("fmt,element", [("mxfp4", "float4_e2m1fn"), ("mxfp6_e2m3", "float6_e2m3fn"),
                                         ("mxfp8_e4m3", "float8_e4m3fn")])
@pytest.mark.parametrize("kind,seed", [("normal", 5), ("heavy", 6)])
def test_exponent_search_matches_the_transcription_floor(fmt, element, kind, seed):
    x = _data(kind, (6, 128), seed)
    spec = make_spec(fmt, axis=1, scale_mode=ScaleMode.FLOOR)
    # OCP's FLOOR rule, transcribed: e = floor(log2(amax)) - emax(element) (frexp is exact)
    amax = np.abs(x).reshape(6, 4, 32).max(-1)
    e = np.vectorize(lambda a: math.frexp(float(a))[1] - 1 - _emax(element))(amax)
    np.testing.assert_array_equal(quantize(x, spec).scales, np.exp2(e).astype(F32))
    np.testing.assert_array_equal(exponent_search(x, spec).scale, ref_exponent_search(x, element, e))


@pytest.mark.parametrize("mode", [ScaleMode.EVEN, ScaleMode.CEIL, ScaleMode.RCEIL])
def test_exponent_search_other_rules_start_from_their_exponent(mode):
    x = _data("heavy", (4, 128), 7)
    spec = make_spec("mxfp4", axis=1, scale_mode=mode)
    e = np.log2(quantize(x, spec).scales).astype(int)
    np.testing.assert_array_equal(exponent_search(x, spec, radius=2).scale,
                                  ref_exponent_search(x, "float4_e2m1fn", e, radius=2))


@pytest.mark.parametrize("mode", list(ScaleMode))
def test_exponent_search_never_worse_than_the_rule(mode):
    x = _data("heavy", (16, 256), 8)
    x[0, :32] = 0.0  # a zero block
    x[1, :32] = 1e-30  # a tiny block
    spec = make_spec("mxfp4", axis=1, scale_mode=mode)
    p = exponent_search(x, spec)
    q = quantize(x, spec, **p.kwargs())
    np.testing.assert_array_equal(q.scales, p.scale)
    d = np.log2(p.scale) - np.log2(quantize(x, spec).scales)
    assert set(np.unique(d)) <= {-1.0, 0.0, 1.0}
    x64 = x.astype(np.float64)
    e = ((x64 - fake_quantize(x, spec, **p.kwargs())) ** 2).reshape(16, 8, 32).sum(-1)
    e0 = ((x64 - fake_quantize(x, spec)) ** 2).reshape(16, 8, 32).sum(-1)
    assert (e <= e0).all() and (e < e0).any()


def test_exponent_search_nan_block_torch_and_radius():
    torch = pytest.importorskip("torch")
    x = _data("normal", (2, 64), 9)
    x[0, 3] = np.nan
    spec = make_spec("mxfp4", axis=1)
    p = exponent_search(x, spec)
    assert np.isnan(p.scale[0, 0]) and np.isfinite(p.scale).sum() == 3
    pt = exponent_search(torch.from_numpy(x), spec)
    np.testing.assert_array_equal(pt.scale.numpy(), p.scale)
    for bad, err in ((0, ValueError), (9, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(err, match="radius"):
            exponent_search(x, spec, radius=bad)

"""MX (power-of-two, E8M0) scale properties and the exact ``floor_log2``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qcore
from qcore import FloatDType, ScaleMode, floor_log2, make_spec, quantize
from qcore.scales import scale_exponent_range

from ._specs import MICROEXP, MX_FLOAT, MX_INT, expand_to, require_block_format, shapes
from ._util import examples, f32_of_bits, seeded_arrays

# The tests widen float32 arrays holding signalling NaNs to float64; numpy warns about that (only these warnings,
# raised from this test module, are ignored; qcore's own warnings still show).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning:properties")

# ---------------------------------------------------------------------------------------------------------------
# floor_log2
# ---------------------------------------------------------------------------------------------------------------

_POSITIVE_FINITE_BITS = st.integers(1, 0x7F7FFFFF)
_JUST_BELOW_POW2 = st.integers(1, 255).map(lambda e: (e << 23) - 1)  # 2**k - ulp, subnormal max included
_SUBNORMAL_BITS = st.integers(1, 0x007FFFFF)


@given(us=st.lists(st.one_of(_POSITIVE_FINITE_BITS, _JUST_BELOW_POW2, _SUBNORMAL_BITS), min_size=1, max_size=32),
       negate=st.booleans())
def test_floor_log2_is_exact(us, negate):
    x = f32_of_bits(us)
    if negate:
        x = -x
    got = floor_log2(x)
    assert got.dtype == np.int32, f"floor_log2 is documented to return int32, got {got.dtype}"
    exp = np.array([math.frexp(abs(float(v)))[1] - 1 for v in x], dtype=np.int32)
    bad = got != exp
    assert not bad.any(), f"floor_log2({x[bad][0]!r}) = {got[bad][0]}, exact {exp[bad][0]}"


def test_floor_log2_at_every_binade_edge_and_specials():
    """Every power of two and the float just below it (the place a float log2 gets wrong), exhaustively."""
    k = np.arange(1, 255, dtype=np.uint32)
    pow2 = (k << 23).view(np.float32)  # 2**-126 .. 2**127
    below = ((k << 23) - 1).view(np.float32)  # the float just below each
    sub = (np.uint32(1) << np.arange(23, dtype=np.uint32)).view(np.float32)  # subnormal powers of two
    sub_below = ((np.uint32(1) << np.arange(1, 24, dtype=np.uint32)) - 1).view(np.float32)
    x = np.concatenate([pow2, below, sub, sub_below])
    exp = np.array([math.frexp(float(v))[1] - 1 for v in x], dtype=np.int32)
    assert np.array_equal(floor_log2(x), exp)
    assert np.array_equal(floor_log2(-x), exp)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)
    assert floor_log2(specials).tolist() == [-150, -150, 128, 128, 128]


# ---------------------------------------------------------------------------------------------------------------
# MX scales from quantize
# ---------------------------------------------------------------------------------------------------------------


def _emax_and_max(spec):
    """(emax, element max) in units of the scale."""
    d = spec.dtype
    if isinstance(d, FloatDType):
        return d.emax, d.max_finite
    return d.emax + spec.unit_exponent, spec.qmax * 2.0**spec.unit_exponent


def _block_stats(x, spec):
    q = quantize(x, spec)
    s = q.scales.astype(np.float64)
    m, e = np.frexp(s)
    assert (m == 0.5).all(), f"{spec.name}: scales are not powers of two: {s[m != 0.5]}"
    smin, smax = scale_exponent_range(spec.scale_dtype)
    sexp = e - 1
    assert ((sexp >= smin) & (sexp <= smax)).all()
    # block amax, per block (same shape as the scales)
    a = np.abs(x.astype(np.float64))
    blocks = np.zeros(s.shape)
    per_el = expand_to(np.arange(s.size).reshape(s.shape), spec, x.shape)
    np.maximum.at(blocks.reshape(-1), per_el.reshape(-1), a.reshape(-1))
    return q, s, sexp, blocks, (sexp == smin) | (sexp == smax)


_FLOOR_FORMATS = MX_FLOAT + MX_INT + MICROEXP


@pytest.mark.parametrize("name", _FLOOR_FORMATS)
@given(data=st.data())
@settings(max_examples=examples(0.1))
def test_floor_scale_is_the_exact_floor_of_the_block_amax(name, data):
    """FLOOR (OCP): scale = 2**(floor(log2(amax)) - emax), so amax / scale lies in [2**emax, 2**(emax+1)); bfp16
    may raise it once (bump), which only lowers amax / scale. Zero blocks get the smallest exponent."""
    require_block_format(name)
    shape = data.draw(shapes(min_dims=2, max_dims=2, max_side=70))
    x = data.draw(seeded_arrays(shape, allow_huge=True))
    spec = make_spec(name, scale_mode=ScaleMode.FLOOR)
    q, s, sexp, amax, clamped = _block_stats(x, spec)
    emax, _ = _emax_and_max(spec)
    smin, smax = scale_exponent_range(spec.scale_dtype)
    r = amax / s
    assert (r[~clamped] < 2.0 ** (emax + 1)).all(), f"{name}: amax/scale >= 2**(emax+1)"
    expected = np.array([math.frexp(v)[1] - 1 - emax if v > 0 else smin for v in amax.reshape(-1)]).reshape(s.shape)
    expected = np.clip(expected, smin, smax)
    if spec.bump_on_overflow:
        ok = (sexp == expected) | (sexp == np.minimum(expected + 1, smax))
    else:
        ok = sexp == expected
    assert ok.all(), f"{name}: scale exponent {sexp[~ok][0]} for amax {amax[~ok][0]!r} (expected {expected[~ok][0]})"


@pytest.mark.parametrize("mode", [ScaleMode.CEIL, ScaleMode.RCEIL], ids=lambda m: m.name)
@pytest.mark.parametrize("name", MX_FLOAT + MX_INT)
@given(data=st.data())
@settings(max_examples=examples(0.05, minimum=8))
def test_ceil_and_rceil_scales_never_saturate(name, mode, data):
    """CEIL / RCEIL: every |x| / scale <= element max (unless the exponent is clamped at the scale dtype's end);
    RCEIL's scale is the smallest such power of two."""
    require_block_format(name)
    shape = data.draw(shapes(min_dims=2, max_dims=2, max_side=70))
    x = data.draw(seeded_arrays(shape, allow_huge=True))
    spec = make_spec(name, scale_mode=mode)
    q, s, sexp, amax, clamped = _block_stats(x, spec)
    _, vmax = _emax_and_max(spec)
    r = amax / s
    assert (r[~clamped] <= vmax).all(), f"{name} {mode.name}: amax/scale {r[~clamped].max()!r} > max {vmax}"
    if mode is ScaleMode.RCEIL:
        minimal = (2 * r > vmax) | clamped | (amax == 0)
        assert minimal.all(), f"{name} RCEIL: half the scale would also fit (amax {amax[~minimal][0]!r})"
    se = expand_to(q.scales, spec, x.shape).astype(np.float64)
    el = np.abs(x.astype(np.float64)) / se
    cl = expand_to(clamped, spec, x.shape)
    assert (el[~cl] <= vmax).all()


@pytest.mark.parametrize("name", MX_FLOAT)
@given(data=st.data())
@settings(max_examples=examples(0.05, minimum=8))
def test_even_scale_is_floor_or_one_more(name, data):
    """EVEN: the FLOOR exponent, plus one exactly when amax rounded to the element's precision reaches the next
    binade."""
    shape = data.draw(shapes(min_dims=2, max_dims=2, max_side=70))
    x = data.draw(seeded_arrays(shape))
    spec = make_spec(name, scale_mode=ScaleMode.EVEN)
    _, s, sexp, amax, clamped = _block_stats(x, spec)
    d = spec.dtype
    e = np.array([math.frexp(v)[1] - 1 if v > 0 else -150 for v in amax.reshape(-1)]).reshape(s.shape)
    rounded = qcore.round_to_step(amax.astype(np.float32), np.clip(e - d.mantissa_bits, -149, 127)).astype(np.float64)
    bump = (rounded >= np.exp2(e + 1.0)) & (amax > 0)
    expected = np.clip(np.where(amax > 0, e - d.emax + bump, -127), *scale_exponent_range(spec.scale_dtype))
    assert np.array_equal(sexp, expected)

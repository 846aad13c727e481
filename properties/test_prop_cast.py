"""Properties of ``qcore.cast`` / ``encode`` / ``decode`` for every float format in ``qcore.DTYPES``.

numpy is the path under test here (the oracle); numpy == torch is in test_prop_torch.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import qcore
from qcore import RoundingMode, Specials, cast, decode, encode

from ._util import (
    FLOAT_FORMATS,
    SIGNED_FLOAT_FORMATS,
    SMALL_FLOAT_FORMATS,
    all_values,
    assert_same_bits,
    bits,
    examples,
    f32_arrays,
    f32_of_bits,
    cast_inputs,
    finite_grid,
    halfway_points,
    ml_dtype_of,
)

# The tests widen float32 arrays holding signalling NaNs to float64; numpy warns about that (only these warnings,
# raised from this test module, are ignored; qcore's own warnings still show).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning:properties")

E8M0 = "float8_e8m0fnu"
ML_FORMATS = [n for n in FLOAT_FORMATS if ml_dtype_of(n) is not None]


def _no_nan_for(name, x):
    """Formats without a NaN code cannot encode NaN (ValueError by design): drop NaN inputs for them."""
    d = qcore.get_dtype(name)
    return x if d.has_nan else x[~np.isnan(x)]


# ---------------------------------------------------------------------------------------------------------------
# on the grid: cast is idempotent, and encode/decode round-trips
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FLOAT_FORMATS)
@given(data=st.data())
@settings(max_examples=examples(0.25))
def test_cast_is_idempotent(name, data):
    x = data.draw(cast_inputs(name))
    y = cast(x, name)
    assert_same_bits(cast(y, name), y, f"cast(cast(x)) != cast(x) for {name}", x)


@pytest.mark.parametrize("name", [n for n in FLOAT_FORMATS if n != "float32"])
@given(data=st.data())
@settings(max_examples=examples(0.25))
def test_encode_decode_round_trip(name, data):
    x = _no_nan_for(name, data.draw(cast_inputs(name)))
    y = cast(x, name)
    c = encode(x, name)
    d = qcore.get_dtype(name)
    assert c.dtype == (np.uint8 if d.bits <= 8 else np.int32)
    assert_same_bits(decode(c, name), y, f"decode(encode(x)) != cast(x) for {name}", x)


@given(x=f32_arrays())
@example(x=np.array([1.5], dtype=np.float32))
def test_encode_float32_gives_the_bit_pattern(x):
    x = x[~np.isnan(x)]
    c = encode(x, "float32")
    assert c.dtype == np.int32
    assert np.array_equal(c, bits(x))


@given(x=f32_arrays())
@example(x=np.array([-1.5], dtype=np.float32))
def test_decode_float32_of_the_bit_pattern(x):
    x = x[~np.isnan(x)]
    assert_same_bits(decode(bits(x), "float32"), x, "decode(bits(x), float32) != x")


@pytest.mark.parametrize("name", SMALL_FLOAT_FORMATS)
def test_every_code_round_trips(name):
    """Exhaustive: every non-NaN code decodes to a value that casts to itself and encodes back to that code."""
    d = qcore.get_dtype(name)
    codes = np.arange(1 << d.bits, dtype=np.uint8 if d.bits <= 8 else np.int32)
    v = all_values(name)
    keep = ~np.isnan(v)  # NaN codes encode back to the canonical NaN, not necessarily to themselves
    assert_same_bits(cast(v[keep], name), v[keep], f"{name}: cast of a code's value moved it")
    back = encode(v[keep], name)
    assert np.array_equal(back.astype(np.int64), codes[keep].astype(np.int64)), f"{name}: encode(decode(c)) != c"


def test_cast_float32_is_identity():
    x = f32_of_bits(np.arange(0, 2**32, 65537, dtype=np.uint64))
    y = cast(x, "float32")
    keep = ~np.isnan(x)
    assert_same_bits(y[keep], x[keep], "cast(x, float32) != x")
    assert np.isnan(y[~keep]).all()


# ---------------------------------------------------------------------------------------------------------------
# nearest and ties-to-even
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SMALL_FLOAT_FORMATS)
@given(data=st.data())
@settings(max_examples=examples(0.25))
def test_cast_is_nearest(name, data):
    """For finite x whose result is finite, the result is a value of the format and no value of the format is
    strictly closer to x (all values enumerated with decode(arange(2**bits)))."""
    x = data.draw(cast_inputs(name))
    y = cast(x, name)
    grid = finite_grid(name)
    ok = np.isfinite(x) & np.isfinite(y)
    xs, ys = x[ok].astype(np.float64), y[ok].astype(np.float64)
    assert np.isin(ys, grid).all(), f"{name}: result not a value of the format: {ys[~np.isin(ys, grid)]}"
    # distance to the nearest grid value (the grid is sorted: look at the two neighbours of x)
    i = np.clip(np.searchsorted(grid, xs), 1, len(grid) - 1)
    best = np.minimum(np.abs(grid[i - 1] - xs), np.abs(grid[i] - xs))
    best = np.where(xs <= grid[0], np.abs(grid[0] - xs), best)
    got = np.abs(ys - xs)
    bad = got > best
    assert not bad.any(), (
        f"{name}: cast({xs[bad][0]!r}) = {ys[bad][0]!r} but a grid value is closer (distance {best[bad][0]!r} "
        f"< {got[bad][0]!r})"
    )


@pytest.mark.parametrize("name", [n for n in SMALL_FLOAT_FORMATS if qcore.get_dtype(n).mantissa_bits > 0])
@given(data=st.data(), negative=st.booleans())
@settings(max_examples=examples(0.25))
def test_ties_go_to_even_code(name, data, negative):
    x, lo, hi = data.draw(halfway_points(name))
    even = lo if lo % 2 == 0 else hi
    if negative and qcore.get_dtype(name).signed:
        x = -x
    c = int(encode(np.array([x], np.float32), name)[0])
    d = qcore.get_dtype(name)
    mag = c & ((1 << (d.bits - 1)) - 1) if d.signed else c
    assert mag == even, f"{name}: tie {x!r} between codes {lo} and {hi} encoded to {c} (magnitude {mag})"


@given(data=st.data(), mode=st.sampled_from([RoundingMode.NEAREST_EVEN, RoundingMode.NEAREST_AWAY]))
def test_e8m0_ties_go_up(data, mode):
    """E8M0 keeps only the implicit 1 (odd): a tie 1.5 * 2**k goes to 2**(k+1) (ml_dtypes agrees)."""
    x, lo, hi = data.draw(halfway_points(E8M0))
    assert int(encode(np.array([x], np.float32), E8M0, rounding=mode)[0]) == hi


# ---------------------------------------------------------------------------------------------------------------
# order, sign and saturation
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FLOAT_FORMATS)
@given(data=st.data())
@settings(max_examples=examples(0.25))
def test_cast_is_monotone(name, data):
    x = data.draw(cast_inputs(name))
    x = np.sort(x[~np.isnan(x)])
    y = cast(x, name)
    y = y[~np.isnan(y)]
    bad = y[1:] < y[:-1]
    assert not bad.any(), f"{name}: cast not monotone: {y[:-1][bad][0]!r} > {y[1:][bad][0]!r} for sorted x"


@pytest.mark.parametrize("name", SIGNED_FLOAT_FORMATS)
@given(data=st.data())
@settings(max_examples=examples(0.25))
def test_cast_is_sign_symmetric(name, data):
    x = data.draw(cast_inputs(name))
    a, b = cast(-x, name), -cast(x, name)
    if qcore.get_dtype(name).specials is Specials.FNUZ:  # no -0: compare magnitudes
        a, b = np.abs(a), np.abs(b)
    assert_same_bits(a, b, f"{name}: cast(-x) != -cast(x)", x)


@pytest.mark.parametrize("name", FLOAT_FORMATS)
@given(data=st.data())
@settings(max_examples=examples(0.25))
def test_saturate_bounds_result(name, data):
    x = data.draw(cast_inputs(name))
    d = qcore.get_dtype(name)
    y = cast(x, name, saturate=True)
    keep = ~np.isnan(x)
    xk, yk = x[keep], y[keep]
    nan_ok = np.zeros(xk.shape, bool)  # the documented NaN results of a non-NaN input
    if not d.signed and d.has_nan:
        nan_ok |= np.signbit(xk)  # unsigned formats with NaN: negative inputs (and -0)
    if not d.has_zero:
        nan_ok |= xk == 0  # formats without zero (E8M0): 0 itself
    assert not np.isnan(yk[~nan_ok]).any(), f"{name}: saturating cast made NaN from {x[keep][~nan_ok]}"
    assert (np.abs(yk[~nan_ok]) <= d.max_finite).all(), f"{name}: |cast(x, saturate=True)| > max_finite"
    assert np.isnan(y[~keep]).all(), "NaN must stay NaN"
    # and the saturated value is used for Inf / huge inputs
    big = np.array([np.inf, np.finfo(np.float32).max], np.float32)
    assert (cast(big, name, saturate=True) == np.float32(d.max_finite)).all()
    if d.signed:
        assert (cast(-big, name, saturate=True) == np.float32(-d.max_finite)).all()


# ---------------------------------------------------------------------------------------------------------------
# agreement with ml_dtypes (and numpy for float16)
# ---------------------------------------------------------------------------------------------------------------


def _e8m0_documented_difference(x):
    """float32 subnormals strictly between 2**-127 and 1.5 * 2**-127: qcore rounds to nearest (2**-127),
    ml_dtypes rounds them up to 2**-126."""
    a = np.abs(x.astype(np.float64))
    return (x > 0) & (a > 2.0**-127) & (a < 1.5 * 2.0**-127)


@pytest.mark.parametrize("name", ML_FORMATS)
@given(data=st.data())
@settings(max_examples=examples(0.25))
def test_cast_matches_ml_dtypes(name, data):
    x = data.draw(cast_inputs(name))
    x = x[~np.isnan(x)]
    with np.errstate(all="ignore"):
        ref = x.astype(ml_dtype_of(name)).astype(np.float32)
    got = cast(x, name)
    if name == E8M0:
        diff = _e8m0_documented_difference(x)
        assert (got[diff] == np.float32(2.0**-127)).all()
        assert (ref[diff] == np.float32(2.0**-126)).all()
        x, ref, got = x[~diff], ref[~diff], got[~diff]
    assert_same_bits(got, ref, f"{name}: qcore.cast != ml_dtypes", x)


def test_e8m0_differs_from_ml_dtypes_only_on_the_documented_set():
    """Exhaustive around both ends of the set (2**17 codes each side, both signs) and every 2039th float32:
    qcore and ml_dtypes disagree exactly on (2**-127, 1.5 * 2**-127)."""
    ml = ml_dtype_of(E8M0)
    if ml is None:
        pytest.skip("ml_dtypes has no float8_e8m0fnu")
    around = [np.arange(b - 0x20000, b + 0x20000, dtype=np.uint32) for b in (0x00400000, 0x00600000)]
    u = np.concatenate([*around, np.arange(0, 0x80000000, 2039, dtype=np.uint32)])
    u = np.concatenate([u, u | 0x80000000])
    x = u.view(np.float32)
    with np.errstate(all="ignore"):
        ref = x.astype(ml).astype(np.float32)
    got = cast(x, E8M0)
    differ = ~((bits(ref) == bits(got)) | (np.isnan(ref) & np.isnan(got)))
    expected = _e8m0_documented_difference(x)
    assert np.array_equal(differ, expected), f"differences outside the documented set: {x[differ & ~expected][:5]}"
    assert expected.any()


# ---------------------------------------------------------------------------------------------------------------
# directed rounding modes through cast: the result is the right one of the two grid neighbours
# ---------------------------------------------------------------------------------------------------------------

_DIRECTED = [RoundingMode.FLOOR, RoundingMode.CEIL, RoundingMode.TOWARD_ZERO, RoundingMode.NEAREST_AWAY,
             RoundingMode.NEAREST_EVEN]


def _expected_on_grid(x, lo, hi, mode):
    """The value ``mode`` picks from the neighbours lo <= x <= hi (float64; lo == hi when x is on the grid)."""
    dlo, dhi = x - lo, hi - x
    if mode is RoundingMode.FLOOR:
        return lo
    if mode is RoundingMode.CEIL:
        return hi
    if mode is RoundingMode.TOWARD_ZERO:
        return np.where(x >= 0, lo, hi)
    if mode is RoundingMode.NEAREST_AWAY:
        away = np.where(x >= 0, hi, lo)
        return np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, away))
    raise AssertionError(mode)


@pytest.mark.parametrize("name", SMALL_FLOAT_FORMATS)
@given(data=st.data())
@settings(max_examples=examples(0.25))
def test_cast_rounding_modes_pick_the_right_neighbour(name, data):
    """Inside [min, max] of the format: FLOOR gives the grid value below, CEIL above, TOWARD_ZERO the smaller
    magnitude, NEAREST_AWAY the nearer (ties away from zero). Hence FLOOR <= x <= CEIL and |TOWARD_ZERO| <= |x|.
    (Every mode is checked on the same drawn inputs.)"""
    x = data.draw(cast_inputs(name))
    grid = finite_grid(name)
    x = x[np.isfinite(x) & (x >= grid[0]) & (x <= grid[-1])]
    d = qcore.get_dtype(name)
    if not d.has_zero:
        x = x[x > 0]
    xd = x.astype(np.float64)
    lo, hi = np.searchsorted(grid, xd, side="right") - 1, np.searchsorted(grid, xd, side="left")
    lo, hi = grid[np.clip(lo, 0, len(grid) - 1)], grid[np.clip(hi, 0, len(grid) - 1)]
    for mode in _DIRECTED[:4]:
        y = cast(x, name, rounding=mode).astype(np.float64)
        exp = _expected_on_grid(xd, lo, hi, mode)
        bad = y != exp
        assert not bad.any(), f"{name} {mode.name}: cast({xd[bad][0]!r}) = {y[bad][0]!r}, expected {exp[bad][0]!r}"
        if mode is RoundingMode.FLOOR:
            assert (y <= xd).all()
        elif mode is RoundingMode.CEIL:
            assert (y >= xd).all()
        elif mode is RoundingMode.TOWARD_ZERO:
            assert (np.abs(y) <= np.abs(xd)).all()

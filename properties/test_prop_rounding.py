"""Properties of ``qcore.round_to_step`` / ``round_to_integral`` for every deterministic ``RoundingMode``.

The oracle is exact float64 arithmetic: for float32 x and k in [-149, 127], ``q = x * 2**-k`` is exact in float64
(at most 24 significant bits, exponent within [-276, 277]), numpy's floor/ceil/trunc/rint of q are exact, ties-away
is ``sign(q) * floor(|q| + 0.5)`` (exact: a q with a fractional part is below 2**24), and ``r * 2**k`` is a float32
value (or past the float32 range: Inf).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcore import RoundingMode, round_to_integral, round_to_step

from ._util import assert_same_bits, examples, f32_arrays, f32_values

# The tests widen float32 arrays holding signalling NaNs to float64; numpy warns about that (only these warnings,
# raised from this test module, are ignored; qcore's own warnings still show).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning:properties")

DETERMINISTIC = [m for m in RoundingMode if m is not RoundingMode.STOCHASTIC]


def _oracle_step(x, k, mode):
    """Exact round-to-multiple-of-2**k of float32 x (array) with ``mode``; float32 result, signs of zero kept."""
    xd = x.astype(np.float64)
    q = xd * np.exp2(-np.asarray(k, dtype=np.float64))
    with np.errstate(all="ignore"):
        if mode is RoundingMode.NEAREST_EVEN:
            r = np.rint(q)
        elif mode is RoundingMode.NEAREST_AWAY:
            r = np.copysign(np.floor(np.abs(q) + 0.5), q)
        elif mode is RoundingMode.TOWARD_ZERO:
            r = np.trunc(q)
        elif mode is RoundingMode.FLOOR:
            r = np.floor(q)
        else:
            r = np.ceil(q)
        out = (r * np.exp2(np.asarray(k, dtype=np.float64))).astype(np.float32)
    return np.where(np.isfinite(x), out, x)


_K = st.integers(-149, 127)


@st.composite
def _x_and_k(draw):
    """x and a step exponent k, half the time near x's own exponent (where rounding does something)."""
    x = draw(f32_arrays(max_size=16))
    if draw(st.booleans()):
        k = draw(_K)
    else:
        with np.errstate(all="ignore"):
            e = np.floor(np.log2(np.abs(x[0].astype(np.float64)))) if np.isfinite(x[0]) and x[0] != 0 else 0.0
        k = int(np.clip(e - draw(st.integers(-2, 26)), -149, 127))
    return x, k


@pytest.mark.parametrize("mode", DETERMINISTIC, ids=lambda m: m.name)
@given(xk=_x_and_k())
@settings(max_examples=examples(0.5))
def test_round_to_step_matches_exact_oracle(mode, xk):
    x, k = xk
    assert_same_bits(round_to_step(x, k, mode=mode), _oracle_step(x, k, mode), f"round_to_step k={k} {mode.name}", x)


@pytest.mark.parametrize("mode", DETERMINISTIC, ids=lambda m: m.name)
@given(x=f32_arrays(max_size=16), k=st.lists(_K, min_size=16, max_size=16))
@settings(max_examples=examples(0.25))
def test_round_to_step_per_element_k(mode, x, k):
    k = np.array(k[: x.size], dtype=np.int32)
    assert_same_bits(round_to_step(x, k, mode=mode), _oracle_step(x, k, mode), f"per-element k {mode.name}", x)


@pytest.mark.parametrize("mode", DETERMINISTIC, ids=lambda m: m.name)
@given(xk=_x_and_k())
@settings(max_examples=examples(0.5))
def test_round_to_step_direction_and_neighbours(mode, xk):
    """The result is one of the two multiples of 2**k around x, on the side the mode says."""
    x, k = xk
    x = x[np.isfinite(x)]
    r = round_to_step(x, k, mode=mode).astype(np.float64)
    xd = x.astype(np.float64)
    step = 2.0**k
    lo, hi = np.floor(xd / step) * step, np.ceil(xd / step) * step
    keep = np.abs(hi) < 2.0**128  # results past the float32 range are Inf
    r, xd, lo, hi = r[keep], xd[keep], lo[keep], hi[keep]
    assert ((r == lo) | (r == hi)).all(), f"{mode.name}: not a neighbour"
    if mode is RoundingMode.FLOOR:
        assert (r <= xd).all()
    elif mode is RoundingMode.CEIL:
        assert (r >= xd).all()
    elif mode is RoundingMode.TOWARD_ZERO:
        assert (np.abs(r) <= np.abs(xd)).all()
    else:  # nearest: within half a step; exact ties decided by the mode
        assert (np.abs(r - xd) <= step / 2).all()
        tie = np.abs(xd - lo) == np.abs(hi - xd)
        tie &= lo != hi
        if mode is RoundingMode.NEAREST_AWAY:
            assert (np.abs(r[tie]) > np.abs(xd[tie])).all(), "NEAREST_AWAY: a tie did not go away from zero"
        else:
            assert (np.mod(r[tie] / step, 2) == 0).all(), "NEAREST_EVEN: a tie did not go to the even multiple"


_NUMPY_OF = {
    RoundingMode.NEAREST_EVEN: np.rint,
    RoundingMode.FLOOR: np.floor,
    RoundingMode.CEIL: np.ceil,
    RoundingMode.TOWARD_ZERO: np.trunc,
}


@pytest.mark.parametrize("mode", DETERMINISTIC, ids=lambda m: m.name)
@given(x=f32_arrays(max_size=32))
@settings(max_examples=examples(0.5))
def test_round_to_integral_matches_numpy_and_round_to_step(mode, x):
    got = round_to_integral(x, mode=mode)
    assert got.dtype == np.float32
    if mode in _NUMPY_OF:
        assert_same_bits(got, _NUMPY_OF[mode](x), f"round_to_integral {mode.name} vs numpy", x)
    assert_same_bits(got, _oracle_step(x, 0, mode), f"round_to_integral {mode.name} vs exact oracle", x)
    assert_same_bits(got, round_to_step(x, 0, mode=mode), f"round_to_integral {mode.name} vs round_to_step(x, 0)", x)


@given(x=f32_values())
def test_round_to_step_scalar_and_specials(x):
    """0-d input works; Inf and NaN pass through unchanged (bitwise)."""
    for mode in DETERMINISTIC:
        r = round_to_step(x, 0, mode=mode)
        if not np.isfinite(x):
            assert_same_bits(r, x, "non-finite must pass through")

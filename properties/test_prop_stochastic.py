"""Stochastic rounding: one of the two neighbours, reproducible per key, key-dependent, unbiased, and the same on
numpy and torch.

Unbiasedness is a z-test at 5 standard errors (plus the documented 2**-32-of-a-step resolution of the probability):
a false alarm has probability < 1e-6 per example, and the CI profile is deterministic anyway.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import qcore
from qcore import RoundingMode, cast, round_to_step
from qcore.rounding import random_bits

from ._util import (
    SMALL_FLOAT_FORMATS,
    assert_same_bits,
    cast_inputs,
    examples,
    f32_arrays,
    finite_grid,
    neighbours,
    positive_grid,
)

# The tests widen float32 arrays holding signalling NaNs to float64; numpy warns about that (only these warnings,
# raised from this test module, are ignored; qcore's own warnings still show).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning:properties")

SR = RoundingMode.STOCHASTIC
KEYS = st.integers(0, 2**63 - 1)
_K = st.integers(-149, 127)


@given(x=f32_arrays(max_size=32), k=_K, key=KEYS)
@settings(max_examples=examples(0.5))
def test_round_to_step_sr_gives_a_neighbour_and_is_reproducible(x, k, key):
    r = round_to_step(x, k, mode=SR, key=key)
    assert_same_bits(r, round_to_step(x, k, mode=SR, key=key), "same key, different result", x)
    fin = np.isfinite(x)
    assert_same_bits(r[~fin], x[~fin], "non-finite must pass through")
    xd, rd = x[fin].astype(np.float64), r[fin].astype(np.float64)
    step = 2.0**k
    lo, hi = np.floor(xd / step) * step, np.ceil(xd / step) * step
    ok = (rd == lo) | (rd == hi) | ((np.abs(hi) >= 2.0**128) & np.isinf(rd))
    assert ok.all(), f"SR result not a neighbour: x={xd[~ok][0]!r} k={k} -> {rd[~ok][0]!r}"
    assert (np.signbit(r[fin]) == np.signbit(x[fin])).all(), "SR changed a sign"


@pytest.mark.parametrize("name", SMALL_FLOAT_FORMATS)
@given(data=st.data(), key=KEYS)
@settings(max_examples=examples(0.1))
def test_cast_sr_gives_a_grid_neighbour(name, data, key):
    x = data.draw(cast_inputs(name))
    grid = finite_grid(name)
    x = x[np.isfinite(x) & (x >= grid[0]) & (x <= grid[-1])]
    if not qcore.get_dtype(name).has_zero:
        x = x[x > 0]
    y = cast(x, name, rounding=SR, key=key)
    assert_same_bits(y, cast(x, name, rounding=SR, key=key), "same key, different result", x)
    lo, hi = neighbours(grid, x)
    yd = y.astype(np.float64)
    ok = (yd == lo) | (yd == hi)
    assert ok.all(), f"{name}: SR cast({x[~ok][0]!r}) = {y[~ok][0]!r} is not one of {lo[~ok][0]!r}, {hi[~ok][0]!r}"


@given(k1=KEYS, k2=KEYS)
@example(k1=7, k2=7 + 2**32)  # keys equal in their low 32 bits: every bit of the key counts
@example(k1=0, k2=2**62)
@settings(max_examples=examples(0.1))
def test_different_keys_differ_somewhere(k1, k2):
    if k1 == k2:
        k2 = k1 ^ 1
    n = 4096
    assert not np.array_equal(random_bits(k1, (n,), like=np.zeros(1)), random_bits(k2, (n,), like=np.zeros(1)))
    x = np.linspace(0.01, 100.0, n, dtype=np.float32)  # mostly off the integer grid
    a, b = round_to_step(x, 0, mode=SR, key=k1), round_to_step(x, 0, mode=SR, key=k2)
    assert not np.array_equal(a, b), "two keys gave identical stochastic roundings of 4096 values"


@given(key=KEYS, shape=st.tuples(st.integers(1, 5), st.integers(1, 7)))
@settings(max_examples=examples(0.1))
def test_random_bits_are_32_bit_and_depend_on_the_flat_index_only(key, shape):
    like = np.zeros(1)
    u = random_bits(key, shape, like=like)
    assert u.shape == shape
    assert (u >= 0).all() and (u < 2**32).all()
    assert np.array_equal(u.reshape(-1), random_bits(key, (int(np.prod(shape)),), like=like))


def _z_bound(p: float, n: int) -> float:
    # 5 standard errors, plus a few counts for tiny n*p (Poisson regime), plus the 2**-32 probability resolution
    return 5.0 * math.sqrt(max(p * (1 - p), 0.0) / n) + 6.0 / n + 2.0**-32


@st.composite
def _x_and_k(draw):
    x = np.float32(draw(st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)))
    if x == 0:
        x = np.float32(draw(st.sampled_from([0.3, -7.75, 1e-40, 3e37])))
    e = math.frexp(abs(float(x)))[1] - 1
    k = int(np.clip(e - draw(st.integers(-1, 30)), -149, 127))
    return x, k


@given(xk=_x_and_k(), key=KEYS)
@settings(max_examples=examples(0.15))
def test_round_to_step_sr_is_unbiased(xk, key):
    """Over N copies of x, the fraction rounded up is p = (|x| - lo) / step within 5 standard errors."""
    x, k = xk
    n = 20000
    r = round_to_step(np.full(n, x, np.float32), k, mode=SR, key=key).astype(np.float64)
    xd = float(x)
    step = 2.0**k
    lo = math.floor(abs(xd) / step) * step
    p = (abs(xd) - lo) / step
    hi = lo + step
    if hi >= 2.0**128:
        return  # the upper neighbour is Inf; no mean to speak of
    up = np.count_nonzero(np.abs(r) == hi) if p > 0 else 0
    assert np.all((np.abs(r) == lo) | (np.abs(r) == hi))
    frac = up / n
    assert abs(frac - p) <= _z_bound(p, n), f"x={xd!r} k={k}: rounded up {frac:.6f} of the time, expected {p:.6f}"


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float4_e2m1fn", "bfloat16", "float8_e8m0fnu"])
@given(data=st.data(), key=KEYS)
@settings(max_examples=examples(0.05, minimum=8))
def test_cast_sr_is_unbiased(name, data, key):
    """mean(cast(full(N, x), SR)) is within 5 standard errors of x (x inside the format's range)."""
    g = positive_grid(name).astype(np.float64)
    i = data.draw(st.integers(0, len(g) - 2))
    t = data.draw(st.floats(0, 1))
    x = np.float32(g[i] + t * (g[i + 1] - g[i]))
    xd = float(x)
    lo, hi = (g[i], g[i + 1]) if xd < g[i + 1] else (g[i + 1], g[i + 1])
    n = 20000
    y = cast(np.full(n, x, np.float32), name, rounding=SR, key=key).astype(np.float64)
    assert np.all((y == lo) | (y == hi))
    if hi == lo:
        return
    p = (xd - lo) / (hi - lo)
    frac = np.count_nonzero(y == hi) / n
    assert abs(frac - p) <= _z_bound(p, n), f"{name} x={xd!r}: up {frac:.6f} of the time, expected {p:.6f}"
    assert abs(y.mean() - xd) <= _z_bound(p, n) * (hi - lo)


# ---------------------------------------------------------------------------------------------------------------
# numpy == torch, bit for bit, for the same key
# ---------------------------------------------------------------------------------------------------------------


@given(x=f32_arrays(max_size=32), k=_K, key=KEYS)
@settings(max_examples=examples(0.25))
def test_sr_numpy_equals_torch(x, k, key):
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(x.copy())
    assert_same_bits(round_to_step(t, k, mode=SR, key=key), round_to_step(x, k, mode=SR, key=key), "SR np/torch", x)
    ub = random_bits(key, (3, 5), like=t)
    assert np.array_equal(ub.numpy(), random_bits(key, (3, 5), like=x))
    for name in ("float8_e4m3fn", "bfloat16", "float4_e2m1fn", "float8_e8m0fnu"):
        assert_same_bits(cast(t, name, rounding=SR, key=key), cast(x, name, rounding=SR, key=key),
                         f"SR cast {name} np/torch", x)

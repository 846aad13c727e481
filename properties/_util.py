"""Shared strategies and exact helpers for the property suite (numpy only; torch is imported by the tests that
need it, with ``pytest.importorskip``)."""

from __future__ import annotations

import functools
import math

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

import qcore
from qcore import FloatDType

# ---------------------------------------------------------------------------------------------------------------
# formats
# ---------------------------------------------------------------------------------------------------------------

FLOAT_FORMATS = [name for name, d in qcore.DTYPES.items() if isinstance(d, FloatDType)]
SMALL_FLOAT_FORMATS = [n for n in FLOAT_FORMATS if qcore.get_dtype(n).bits <= 16]  # enumerable grids
SIGNED_FLOAT_FORMATS = [n for n in FLOAT_FORMATS if qcore.get_dtype(n).signed]


def examples(fraction: float, minimum: int = 10) -> int:
    """A per-test example count: ``fraction`` of the active profile's ``max_examples``."""
    return max(minimum, int(settings.default.max_examples * fraction))


def ml_dtype_of(name: str):
    """The numpy/ml_dtypes type of a qcore float format, or None when neither has it (float32 is not compared)."""
    if name == "float16":
        return np.float16
    if name == "float32":
        return None
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
        return None
    return getattr(ml_dtypes, name, None)


# ---------------------------------------------------------------------------------------------------------------
# bit views and comparisons
# ---------------------------------------------------------------------------------------------------------------


def f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def bits(a) -> np.ndarray:
    """float32 -> int32 bit patterns."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.int32)


def to_np(a) -> np.ndarray:
    """numpy view of a numpy array or (CPU/any device) torch tensor."""
    if hasattr(a, "detach"):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def same_bits(a, b) -> bool:
    """Bitwise equality of two float32 arrays, every NaN counting as equal to every NaN."""
    a, b = f32(to_np(a)), f32(to_np(b))
    if a.shape != b.shape:
        return False
    na, nb = np.isnan(a), np.isnan(b)
    if not np.array_equal(na, nb):
        return False
    return np.array_equal(bits(np.where(na, 0, a)), bits(np.where(nb, 0, b)))


def assert_same_bits(a, b, what: str = "", x=None):
    if same_bits(a, b):
        return
    a, b = f32(to_np(a)), f32(to_np(b))
    bad = ~((bits(a) == bits(b)) | (np.isnan(a) & np.isnan(b)))
    i = tuple(np.argwhere(bad)[0]) if bad.ndim else ()
    extra = ""
    if x is not None:
        xv = f32(to_np(x))[i]
        extra = f" x={xv!r} (bits 0x{int(f32(xv).view(np.uint32)):08x})"
    raise AssertionError(
        f"{what}: {int(bad.sum())} element(s) differ; first at {i}:{extra} "
        f"{a[i]!r} (0x{int(a[i].view(np.uint32)):08x}) vs {b[i]!r} (0x{int(b[i].view(np.uint32)):08x})"
    )


def assert_same_ints(a, b, what: str = ""):
    a, b = to_np(a), to_np(b)
    assert a.dtype == b.dtype, f"{what}: dtypes {a.dtype} vs {b.dtype}"
    if not np.array_equal(a, b):
        i = tuple(np.argwhere(a != b)[0])
        raise AssertionError(f"{what}: first difference at {i}: {a[i]!r} vs {b[i]!r}")


def f32_of_bits(u) -> np.ndarray:
    return np.asarray(u, dtype=np.uint64).astype(np.uint32).view(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# grids of the enumerable formats
# ---------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def all_values(name: str) -> np.ndarray:
    """decode(arange(2**bits)): the value of every code of a format of <= 16 bits (NaN/Inf included)."""
    d = qcore.get_dtype(name)
    assert d.bits <= 16
    codes = np.arange(1 << d.bits, dtype=np.uint8 if d.bits <= 8 else np.int32)
    return qcore.decode(codes, d)


@functools.lru_cache(maxsize=None)
def finite_grid(name: str) -> np.ndarray:
    """Sorted distinct finite values of a format of <= 16 bits, as float64."""
    v = all_values(name).astype(np.float64)
    return np.unique(v[np.isfinite(v)])


@functools.lru_cache(maxsize=None)
def positive_grid(name: str) -> np.ndarray:
    """Sorted distinct finite values >= 0 (float32)."""
    g = finite_grid(name)
    return g[g >= 0].astype(np.float32)


def neighbours(grid: np.ndarray, x: np.ndarray):
    """(lo, hi): the largest grid value <= x and the smallest >= x (float64; NaN where there is none)."""
    x = np.asarray(x, dtype=np.float64)
    i = np.searchsorted(grid, x, side="right")  # grid[i-1] <= x < grid[i]
    lo = np.where(i > 0, grid[np.clip(i - 1, 0, len(grid) - 1)], np.nan)
    j = np.searchsorted(grid, x, side="left")  # grid[j-1] < x <= grid[j]
    hi = np.where(j < len(grid), grid[np.clip(j, 0, len(grid) - 1)], np.nan)
    return lo, hi


# ---------------------------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------------------------

U32 = st.integers(0, 2**32 - 1)
"""Any float32 bit pattern (NaNs, Infs, subnormals, -0 included)."""

_FLOAT_BITS = st.floats(width=32).map(lambda v: int(np.array(v, dtype=np.float32).view(np.uint32)))
"""Hypothesis' float32 distribution (boundary values, small integers, ...) as bit patterns."""

ANY_F32_BITS = st.one_of(U32, _FLOAT_BITS)


def _as_f32_array(us) -> np.ndarray:
    return np.array(us, dtype=np.uint64).astype(np.uint32).view(np.float32)


def f32_arrays(element_bits=ANY_F32_BITS, min_size: int = 1, max_size: int = 24):
    """1-d float32 arrays built from bit patterns (exact: no NaN payload is lost on the way)."""
    return st.lists(element_bits, min_size=min_size, max_size=max_size).map(_as_f32_array)


def f32_values(element_bits=ANY_F32_BITS):
    """A 0-d float32 array from a bit pattern."""
    return element_bits.map(lambda u: np.array(u, dtype=np.uint64).astype(np.uint32).view(np.float32).reshape(()))


def _step_bits(u: int, delta: int) -> int:
    """Move a non-negative float32 bit pattern by ``delta`` ulps, staying within [0, +Inf]."""
    return min(max(u + delta, 0), 0x7F800000)


@functools.lru_cache(maxsize=None)
def _top_threshold(name: str) -> float:
    """max_finite + half the top binade's step (the overflow threshold of round-to-nearest), as float32."""
    d = qcore.get_dtype(name)
    step = 2.0 ** (d.emax - d.mantissa_bits)
    v = d.max_finite + step / 2
    return float(np.float32(v)) if v < 3.4028234663852886e38 else float("inf")


@functools.lru_cache(maxsize=None)
def near_grid_bits(name: str):
    """Bit patterns of float32 values on, next to, or halfway between grid points of a <= 16-bit format (either
    sign), and next to the overflow threshold: where rounding bugs live."""
    g = positive_grid(name)

    @st.composite
    def build(draw):
        i = draw(st.integers(0, len(g) - 1))
        kind = draw(st.sampled_from(["on", "mid", "mid", "top"]))
        if kind == "mid" and i + 1 < len(g):
            v = np.float32((float(g[i]) + float(g[i + 1])) / 2)  # exact: one more significant bit than the grid
        elif kind == "top":
            v = np.float32(_top_threshold(name))
        else:
            v = g[i]
        u = int(np.float32(v).view(np.uint32))
        u = _step_bits(u, draw(st.integers(-2, 2)))
        if draw(st.booleans()):
            u |= 0x80000000
        return u

    return build()


@functools.lru_cache(maxsize=None)
def format_f32_bits(name: str):
    """Bit patterns for testing casts to ``name``: any float32, plus values near the format's grid."""
    d = qcore.get_dtype(name)
    if d.bits > 16:
        return ANY_F32_BITS
    return st.one_of(ANY_F32_BITS, near_grid_bits(name), near_grid_bits(name))


def _rng_near_grid(name: str, rng, n: int) -> np.ndarray:
    """numpy version of ``near_grid_bits``: ``n`` bit patterns (uint32) near the grid of a <= 16-bit format."""
    g = positive_grid(name).astype(np.float64)
    i = rng.integers(0, len(g), size=n)
    j = np.minimum(i + 1, len(g) - 1)
    kind = rng.integers(0, 4, size=n)
    v = np.where(kind == 0, g[i], (g[i] + g[j]) / 2)
    v = np.where(kind == 3, _top_threshold(name), v).astype(np.float32)
    u = v.view(np.uint32).astype(np.int64) + rng.integers(-2, 3, size=n)
    u = np.clip(u, 0, 0x7F800000) | (rng.integers(0, 2, size=n) << 31)
    return u.astype(np.uint32)


@functools.lru_cache(maxsize=None)
def cast_inputs(name: str, *, n_drawn: int = 6, n_seeded: int = 58):
    """float32 arrays for testing casts to ``name``: up to ``n_drawn`` hypothesis-drawn values (any float32 or
    near the grid; these shrink) followed by ``n_seeded`` values from a drawn seed (half arbitrary bit patterns,
    half near the grid), which keeps each example cheap."""
    d = qcore.get_dtype(name)

    @st.composite
    def build(draw):
        drawn = draw(st.lists(format_f32_bits(name), min_size=1, max_size=n_drawn))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        raw = rng.integers(0, 2**32, size=n_seeded // 2, dtype=np.uint64).astype(np.uint32)
        near = _rng_near_grid(name, rng, n_seeded - n_seeded // 2) if d.bits <= 16 else raw
        u = np.concatenate([np.array(drawn, dtype=np.uint64).astype(np.uint32), raw, near])
        return u.view(np.float32)

    return build()


@functools.lru_cache(maxsize=None)
def halfway_points(name: str):
    """(x, lo_code, hi_code): a positive float32 exactly halfway between two adjacent finite grid values."""
    vals = all_values(name)
    d = qcore.get_dtype(name)
    top = (1 << (d.bits - 1)) if d.signed else (1 << d.bits)  # positive codes are 0 .. top-1
    ok = np.isfinite(vals[:top])
    # adjacent positive codes c, c+1 that are both finite (and distinct numbers)
    cs = [int(c) for c in np.nonzero(ok[:-1] & ok[1:] & (vals[1:top] > vals[: top - 1]))[0]]

    def mk(c):
        lo, hi = float(vals[c]), float(vals[c + 1])
        return np.float32((lo + hi) / 2), c, c + 1

    return st.sampled_from(cs).map(mk)


@st.composite
def seeded_arrays(draw, shape, *, finite: bool = True, allow_huge: bool = False):
    """Arrays of ``shape`` from a drawn seed and distribution (fast for big arrays), with a few hypothesis-drawn
    special values written over them (signed zeros, subnormals, boundary floats)."""
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(["normal", "quarter_ints", "bits", "lognormal", "sparse"]))
    e = draw(st.integers(-140, 120 if allow_huge else 100))
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    with np.errstate(all="ignore"):
        if kind == "normal":
            x = rng.standard_normal(n) * 2.0**e
        elif kind == "quarter_ints":  # exact ties for many grids
            x = rng.integers(-40, 41, size=n) / 4.0 * 2.0 ** min(max(e, -100), 100)
        elif kind == "bits":
            x = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)
        elif kind == "lognormal":
            x = np.exp2(rng.uniform(-30, 30, size=n) + e / 4) * rng.choice([-1.0, 1.0], size=n)
        else:
            x = np.where(rng.random(n) < 0.7, 0.0, rng.standard_normal(n)) * 2.0**e
        x = np.asarray(x).astype(np.float32)
    specials = draw(st.lists(st.tuples(st.integers(0, n - 1), ANY_F32_BITS), max_size=4))
    xu = x.view(np.uint32).copy()
    for i, u in specials:
        xu[i] = u
    x = xu.view(np.float32)
    if finite:
        x = np.where(np.isfinite(x), x, np.float32(1.0)).astype(np.float32)
    if not allow_huge:
        with np.errstate(all="ignore"):
            x = np.where(np.abs(x) < 2.0**100, x, np.float32(2.0**100)).astype(np.float32)
    return x.reshape(shape)


def frexp_floor_log2(v: float) -> int:
    """floor(log2(|v|)) of a positive finite float, exactly (math.frexp: v = m * 2**e with 0.5 <= m < 1)."""
    return math.frexp(abs(v))[1] - 1

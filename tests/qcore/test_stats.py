"""Tests for qcore.stats: per-block statistics, MSE clipping, calibration state.

References are straightforward numpy loops over blocks written here (slices of x, no padding), not qcore's
blocking. numpy tests never import torch; torch tests import it with ``pytest.importorskip`` inside the test.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from qcore import (PerBlock, PerChannel, PerGroup, PerTensor, RoundingMode, ScaleMode, dequantize, fake_quantize,
                   make_spec, quantize)
from qcore.granularity import scale_shape, tile_shape
from qcore.stats import QParams, RunningStats, absmax, minmax, mse_clip, percentile, scale_from_stats, update

# ---------------------------------------------------------------------------------------------------------------
# independent reference: loop over the blocks, slicing x (short last tiles are simply shorter slices)
# ---------------------------------------------------------------------------------------------------------------


def ref_blocks(x, g):
    """Yield (block index, block values as a flat float32 array) for every block of x."""
    tile = tile_shape(g, x.shape)
    sshape = scale_shape(g, x.shape)
    for idx in itertools.product(*[range(n) for n in sshape]):
        sl = tuple(slice(i * t, min((i + 1) * t, s)) for i, t, s in zip(idx, tile, x.shape))
        yield idx, np.asarray(x[sl], dtype=np.float32).ravel()


def ref_stat(x, g, fn):
    out = np.zeros(scale_shape(g, x.shape), dtype=np.float32)
    for idx, blk in ref_blocks(x, g):
        out[idx] = np.float32(fn(blk))
    return out


def ref_percentile(x, g, q):
    def fn(blk):
        a = np.abs(blk).astype(np.float64)
        if not np.all(np.isfinite(a)):
            return math.nan
        return np.percentile(a, q)  # method="linear", numpy's default

    return ref_stat(x, g, fn)


def data(shape, seed=0):
    """Gaussian data with per-row offsets, so that whole blocks are all-positive or all-negative."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    rows = x.reshape(-1, shape[-1]) if len(shape) > 1 else x[None]
    for i in range(rows.shape[0]):
        rows[i] += np.float32((i % 3 - 1) * 4.0)  # offsets -4, 0, +4
    return x


CASES = [
    ((8, 576), PerGroup(128)),  # ragged: 4 groups of 128 and one of 64
    ((8, 576), PerGroup(128, axis=-1)),
    ((6, 37), PerChannel(0)),
    ((6, 37), PerChannel(axis=-1)),
    ((6, 37), PerTensor()),
    ((300, 10), PerGroup(64, axis=0)),  # ragged along axis 0
    ((10, 300), PerBlock((4, 128))),  # ragged on both axes
    ((3, 5, 70), PerGroup(32, axis=1)),  # group longer than the axis
    ((3, 5, 70), PerGroup(16)),
    ((3, 5, 70), PerBlock((2, 32), axes=(0, 2))),
    ((33,), PerGroup(8)),
]


def _id(case):
    shape, g = case
    return f"{shape}-{g}"


# ---------------------------------------------------------------------------------------------------------------
# statistics: exact against the loops
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_absmax_minmax_exact(case):
    shape, g = case
    x = data(shape)
    a = absmax(x, g)
    lo, hi = minmax(x, g)
    assert a.shape == lo.shape == hi.shape == scale_shape(g, shape)
    assert a.dtype == lo.dtype == hi.dtype == np.float32
    np.testing.assert_array_equal(a, ref_stat(x, g, lambda b: np.max(np.abs(b))))
    np.testing.assert_array_equal(lo, ref_stat(x, g, np.min))
    np.testing.assert_array_equal(hi, ref_stat(x, g, np.max))


def test_minmax_excludes_ragged_padding():
    # K=576 with groups of 128: the short last group (64 values) is all positive / all negative.
    x = np.full((2, 576), 3.0, np.float32)
    x[1] = -3.0
    x[0, -1] = 5.0
    x[1, -1] = -5.0
    lo, hi = minmax(x, PerGroup(128))
    np.testing.assert_array_equal(lo[:, -1], [3.0, -5.0])  # zero padding would give 0 here
    np.testing.assert_array_equal(hi[:, -1], [5.0, -3.0])
    # percentile: q small picks the smallest |x| of the short group, not a padding zero
    np.testing.assert_array_equal(percentile(x, PerGroup(128), q=1e-6)[:, -1], [3.0, 3.0])


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("q", [100.0, 99.9, 99, 50, 37.5, 0.1, 1e-6])
def test_percentile_exact(case, q):
    shape, g = case
    x = data(shape, seed=1)
    got = percentile(x, g, q=q)
    assert got.shape == scale_shape(g, shape) and got.dtype == np.float32
    np.testing.assert_array_equal(got, ref_percentile(x, g, q))
    if q == 100.0:
        np.testing.assert_array_equal(got, absmax(x, g))


def test_percentile_ties_and_tiny_blocks():
    x = np.array([[1.0, 1.0, 1.0, 2.0, -2.0, 7.0, 0.0]], np.float32)
    for q in (10, 25, 50, 60, 75, 90, 100):
        np.testing.assert_array_equal(percentile(x, PerGroup(3), q=q), ref_percentile(x, PerGroup(3), q))
    np.testing.assert_array_equal(percentile(np.float32([[-4.0]]), PerTensor(), q=50), [[4.0]])


def test_zero_blocks():
    x = np.zeros((4, 576), np.float32)
    x[1, :128] = np.linspace(-1, 1, 128, dtype=np.float32)
    g = PerGroup(128)
    a = absmax(x, g)
    lo, hi = minmax(x, g)
    pct = percentile(x, g, q=99)
    zero = np.ones(a.shape, bool)
    zero[1, 0] = False
    assert np.all(a[zero] == 0) and np.all(lo[zero] == 0) and np.all(hi[zero] == 0) and np.all(pct[zero] == 0)
    for spec in (make_spec("int8", granularity=g), make_spec("uint8", granularity=g, symmetric=False),
                 make_spec("mxfp4")):
        p = scale_from_stats(RunningStats.from_array(x, spec.granularity), spec)
        dyn = quantize(x, spec)
        np.testing.assert_array_equal(p.scale, dyn.scales)
        np.testing.assert_array_equal(fake_quantize(x, spec, **p.kwargs()), fake_quantize(x, spec))
        m = mse_clip(x, spec, grid=8)
        np.testing.assert_array_equal(m.scale, dyn.scales)  # all-zero blocks: every ratio ties, r=1 kept


def test_non_finite_blocks():
    x = data((2, 256))
    x[0, 5] = np.nan
    x[1, 200] = -np.inf
    g = PerGroup(128)
    a = absmax(x, g)
    lo, hi = minmax(x, g)
    assert np.isnan(a[0, 0]) and np.isnan(lo[0, 0]) and np.isnan(hi[0, 0])
    assert a[1, 1] == np.inf and lo[1, 1] == -np.inf and np.isfinite(hi[1, 1])
    pct = percentile(x, g, q=50)
    assert np.isnan(pct[0, 0]) and np.isnan(pct[1, 1])
    assert np.isfinite(pct[0, 1]) and np.isfinite(pct[1, 0])
    for m in (a, lo, hi, pct):
        assert np.all(np.isfinite(m[[0, 1], [1, 0]]))
    # mse_clip: non-finite blocks keep the (NaN) dynamic scale, the others are chosen normally
    spec = make_spec("int4", granularity=g)
    p = mse_clip(x, spec, grid=4)
    assert np.isnan(p.scale[0, 0]) and np.isnan(p.scale[1, 1])
    assert np.all(np.isfinite(p.scale[[0, 1], [1, 0]]))


def test_input_dtypes_are_rounded_to_float32():
    x = data((4, 96)).astype(np.float64) * (1 + 1e-12)
    g = PerGroup(32)
    x32 = x.astype(np.float32)
    np.testing.assert_array_equal(absmax(x, g), absmax(x32, g))
    np.testing.assert_array_equal(percentile(x, g, q=90), percentile(x32, g, q=90))
    np.testing.assert_array_equal(absmax(x.astype(np.float16), g), absmax(x.astype(np.float16).astype(np.float32), g))


# ---------------------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------------------


def test_validation():
    x = data((4, 64))
    g = PerGroup(32)
    # Integer and bool *arrays* are refused; a list of numbers is values (as in qcore.cast): float32.
    assert absmax([[1, -2]], PerTensor()).tolist() == [[2.0]]
    for bad in (np.arange(8).reshape(2, 4), np.ones((2, 2), bool), [[True, False]]):
        with pytest.raises(TypeError):
            absmax(bad, PerTensor())
        with pytest.raises(TypeError):
            minmax(bad, PerTensor())
        with pytest.raises(TypeError):
            percentile(bad, PerTensor(), q=50)
        with pytest.raises(TypeError):
            RunningStats.from_array(bad, PerTensor())
    for q in (0, -1, 100.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="q must be"):
            percentile(x, g, q=q)
    for q in ("50", None, True):
        with pytest.raises(TypeError, match="q must be"):
            percentile(x, g, q=q)
    with pytest.raises(TypeError):
        percentile(x, g, 50)  # q is keyword-only
    with pytest.raises((TypeError, ValueError)):
        absmax(x, "group")
    with pytest.raises(ValueError):
        absmax(x, PerGroup(0))
    spec = make_spec("int4", granularity=g)
    for grid in (0, -3):
        with pytest.raises(ValueError, match="grid"):
            mse_clip(x, spec, grid=grid)
    for grid in (2.0, True):
        with pytest.raises(TypeError, match="grid"):
            mse_clip(x, spec, grid=grid)
    for lo in (0.0, -0.5, 1.5, math.nan):
        with pytest.raises(ValueError, match="lo"):
            mse_clip(x, spec, lo=lo)
    for p in (0, -2, math.inf):
        with pytest.raises(ValueError, match="p must"):
            mse_clip(x, spec, p=p)
    with pytest.raises(TypeError):
        mse_clip(np.arange(64).reshape(4, 16), spec)
    with pytest.raises(ValueError, match="microexponent"):
        mse_clip(x, make_spec("mx6"))
    with pytest.raises(ValueError, match="STOCHASTIC"):
        mse_clip(x, make_spec(spec, rounding=RoundingMode.STOCHASTIC))


def test_stats_validation():
    x = data((4, 64))
    s = RunningStats.from_array(x, PerGroup(32))
    with pytest.raises(ValueError, match="granularity"):
        update(s, x, PerGroup(16))
    with pytest.raises(ValueError, match="granularity"):
        update(s, x, PerChannel(0))
    update(s, x, PerGroup(32, axis=1))  # the same granularity spelled with a positive axis is fine
    with pytest.raises(ValueError, match="shape"):
        update(s, data((4, 96)))
    with pytest.raises(ValueError, match="granularity"):
        scale_from_stats(s, make_spec("int8", granularity=PerGroup(16)))
    scale_from_stats(s, make_spec("int8", granularity=PerGroup(32, axis=1)))
    with pytest.raises(ValueError, match="no batch"):
        scale_from_stats(RunningStats.empty(PerTensor()), make_spec("int8"))
    with pytest.raises(TypeError):
        update(s, np.arange(256).reshape(4, 64))
    with pytest.raises(TypeError):
        update("stats", x)
    with pytest.raises(TypeError):
        scale_from_stats(x, make_spec("int8"))
    with pytest.raises((TypeError, ValueError)):
        RunningStats.empty("tensor")
    with pytest.raises(ValueError, match="microexponent"):
        scale_from_stats(RunningStats.from_array(x, PerGroup(16)), make_spec("mx9"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.count = 3  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------------------------
# calibration state
# ---------------------------------------------------------------------------------------------------------------


def test_running_stats_concat_equals_one_shot():
    rng = np.random.default_rng(3)
    batches = [rng.standard_normal((b, 96)).astype(np.float32) * (1 + i) for i, b in enumerate((5, 1, 17, 8))]
    full = np.concatenate(batches, axis=0)
    for g in (PerTensor(), PerChannel(-1), PerChannel(1)):
        s = RunningStats.empty(g)
        assert s.count == 0 and s.absmax is None and s.scale_shape is None
        seen = []
        for b in batches:
            s2 = update(s, b)
            assert s2 is not s
            if s.absmax is not None:  # the old value is untouched
                np.testing.assert_array_equal(s.absmax, seen[-1])
            s = s2
            seen.append(s.absmax.copy())
        one = RunningStats.from_array(full, g)
        assert s.count == len(batches) and one.count == 1
        for f in ("absmax", "lo", "hi"):
            np.testing.assert_array_equal(getattr(s, f), getattr(one, f))
        np.testing.assert_array_equal(s.absmax, ref_stat(full, g, lambda b: np.max(np.abs(b))))
        np.testing.assert_array_equal(s.lo, ref_stat(full, g, np.min))
        np.testing.assert_array_equal(s.hi, ref_stat(full, g, np.max))
        # method spelling
        np.testing.assert_array_equal(RunningStats.empty(g).update(full).absmax, one.absmax)


def test_running_stats_same_shape_batches_ragged():
    g = PerGroup(128)
    batches = [data((4, 576), seed=s) * np.float32(s + 1) for s in range(4)]
    s = RunningStats.empty(g)
    for b in batches:
        s = update(s, b, g)
    np.testing.assert_array_equal(s.absmax, np.max([ref_stat(b, g, lambda v: np.max(np.abs(v))) for b in batches], 0))
    np.testing.assert_array_equal(s.lo, np.min([ref_stat(b, g, np.min) for b in batches], 0))
    np.testing.assert_array_equal(s.hi, np.max([ref_stat(b, g, np.max) for b in batches], 0))


def _bfp16_data():
    x = data((6, 64), seed=7)
    x[0, :8] = [127.7, 1, 2, 3, -4, 5, 6, 7]  # rounds past 127 at exponent 0: bfp16 bumps the exponent
    x[1, 8:16] = [-127.7, 1, 2, 3, -4, 5, 6, 7]  # -128 fits: no bump
    x[2, 16:24] = [63.9, -63.9, 0, 0, 0, 0, 0, 1]
    return x


STATIC_SPECS = [
    make_spec("int8", granularity=PerChannel(0)),
    make_spec("int8", granularity=PerChannel(0), narrow_range=True),
    make_spec("int4", granularity=PerGroup(128)),
    make_spec("int4", granularity=PerGroup(128), scale_dtype="bfloat16"),
    make_spec("uint4", granularity=PerGroup(128), symmetric=False),
    make_spec("uint8", granularity=PerChannel(-1), symmetric=False, scale_dtype="float16"),
    make_spec("int8", granularity=PerBlock((4, 128)), symmetric=False),
    make_spec("float8_e4m3fn"),
    make_spec("float8_e4m3fn", granularity=PerChannel(0), scale_dtype="float8_e5m3"),
    make_spec("float4_e2m1fn", granularity=PerGroup(16), scale_dtype="float8_e4m3fn"),
    make_spec("mxfp4"),
    make_spec("mxfp4", scale_mode=ScaleMode.EVEN),
    make_spec("mxfp4", scale_mode=ScaleMode.CEIL),
    make_spec("mxfp8_e4m3", scale_mode=ScaleMode.RCEIL),
    make_spec("mxfp6_e3m2"),
    make_spec("mxint8"),
    make_spec("bfp16"),
]


def _spec_id(spec):
    return f"{spec.name or spec.dtype.name}-{spec.granularity}-{'sym' if spec.symmetric else 'asym'}-" \
           f"{spec.scale_dtype.name}-{spec.scale_mode.value}-{spec.narrow_range}"


@pytest.mark.parametrize("spec", STATIC_SPECS, ids=_spec_id)
def test_static_equals_dynamic(spec):
    x = data((8, 576), seed=11)
    x[3] *= 1e-3
    x[5, 130:260] = 0.0
    if spec.bump_on_overflow:
        x[:6, :64] = _bfp16_data()
    stats = RunningStats.from_array(x, spec.granularity)
    p = scale_from_stats(stats, spec)
    assert isinstance(p, QParams) and (p.zero_point is None) == spec.symmetric
    assert p.scale.shape == spec.scale_shape(x.shape) and p.scale.dtype == np.float32
    dyn = quantize(x, spec)
    sta = quantize(x, spec, scale=p.scale, zero_point=p.zero_point)
    np.testing.assert_array_equal(sta.scales, dyn.scales)
    np.testing.assert_array_equal(sta.codes, dyn.codes)
    if not spec.symmetric:
        np.testing.assert_array_equal(sta.zero_points, dyn.zero_points)
    np.testing.assert_array_equal(fake_quantize(x, spec, **p.kwargs()), fake_quantize(x, spec))


def test_bfp16_bump_is_exercised():
    spec = make_spec("bfp16")
    x = _bfp16_data()
    p = scale_from_stats(RunningStats.from_array(x, spec.granularity), spec)
    # elements are code / 64 (unit exponent -6) times X = 2**s; FLOOR gives X = 64 for amax 127.7.
    # block 0 of row 0: 127.7 / 64 * 64 rounds to code 128 > 127, bumped to X = 128; block 1 of row 1:
    # -127.7 rounds to -128, which fits: X stays 64.
    assert p.scale[0, 0] == 128.0 and p.scale[1, 1] == 64.0
    np.testing.assert_array_equal(p.scale, quantize(x, spec).scales)


def test_static_from_batches_then_quantize_concat():
    rng = np.random.default_rng(4)
    batches = [rng.standard_normal((b, 64)).astype(np.float32) for b in (3, 9, 4)]
    full = np.concatenate(batches)
    for spec in (make_spec("int8", axis=-1), make_spec("uint8", granularity=PerChannel(-1), symmetric=False),
                 make_spec("float8_e4m3fn")):
        s = RunningStats.empty(spec.granularity)
        for b in batches:
            s = update(s, b)
        p = scale_from_stats(s, spec)
        np.testing.assert_array_equal(quantize(full, spec, **p.kwargs()).codes, quantize(full, spec).codes)


# ---------------------------------------------------------------------------------------------------------------
# MSE clipping
# ---------------------------------------------------------------------------------------------------------------


def outlier_data(shape=(64, 512), seed=2):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    idx = rng.integers(0, x.size, size=x.size // 200)
    x.flat[idx] *= np.float32(12.0)
    return x


def ref_err(x, y, g, p=2.0):
    """sum |x - y|**p per block (float64), by the block loop."""
    d = np.abs(x.astype(np.float64) - y.astype(np.float64)) ** p
    tile = tile_shape(g, x.shape)
    out = np.zeros(scale_shape(g, x.shape), np.float64)
    for idx in itertools.product(*[range(n) for n in out.shape]):
        out[idx] = np.sum(d[tuple(slice(i * t, min((i + 1) * t, s)) for i, t, s in zip(idx, tile, x.shape))])
    return out


MSE_SPECS = [
    make_spec("int4", granularity=PerGroup(128)),
    make_spec("int4", granularity=PerChannel(0), narrow_range=True),
    make_spec("uint4", granularity=PerGroup(128), symmetric=False),
    make_spec("int8", granularity=PerGroup(32), scale_dtype="bfloat16"),
    make_spec("float8_e4m3fn", granularity=PerChannel(0)),
    make_spec("float4_e2m1fn", granularity=PerGroup(16), scale_dtype="float8_e4m3fn"),
    make_spec("mxfp4"),
    make_spec("mxfp4", scale_mode=ScaleMode.CEIL),
    make_spec("mxint8"),
    make_spec("bfp16"),
]


@pytest.mark.parametrize("spec", MSE_SPECS, ids=_spec_id)
def test_mse_clip_never_worse_than_absmax(spec):
    x = outlier_data((16, 576))
    if spec.bump_on_overflow:
        x[:6, :64] = _bfp16_data()
    p = mse_clip(x, spec, grid=24)
    assert isinstance(p, QParams) and (p.zero_point is None) == spec.symmetric
    assert p.scale.shape == spec.scale_shape(x.shape)
    y = fake_quantize(x, spec, **p.kwargs())
    e_clip = ref_err(x, y, spec.granularity)
    e_dyn = ref_err(x, fake_quantize(x, spec), spec.granularity)
    assert np.all(e_clip <= e_dyn)
    # quantize accepts the result directly and agrees with fake_quantize
    np.testing.assert_array_equal(dequantize(quantize(x, spec, **p.kwargs())), y)


@pytest.mark.parametrize("spec", [s for s in MSE_SPECS if s.name != "mxfp4" or s.scale_mode is not ScaleMode.FLOOR],
                         ids=_spec_id)
def test_mse_clip_reduces_error_on_outliers(spec):
    # (mxfp4 with FLOOR scales already saturates its largest elements; clipping finds nothing better there)
    x = outlier_data()
    p = mse_clip(x, spec)
    e_clip = np.sum((fake_quantize(x, spec, **p.kwargs()).astype(np.float64) - x) ** 2)
    e_dyn = np.sum((fake_quantize(x, spec).astype(np.float64) - x) ** 2)
    factor = 0.95 if spec.dtype.bits <= 4 else 0.999  # 4-bit grids gain much more from clipping than 8-bit
    assert e_clip < factor * e_dyn, (e_clip, e_dyn)


def test_mse_clip_matches_bruteforce_reference():
    # int4 symmetric per group: scale = amax * r / 7.5, y = clip(rint(x / scale), -8, 7) * scale
    x = outlier_data((8, 576), seed=9)
    g = PerGroup(128)
    spec = make_spec("int4", granularity=g)
    grid, lo = 11, 0.4
    for pp in (2.0, 1.0, 3.5):
        got = mse_clip(x, spec, grid=grid, lo=lo, p=pp).scale
        ratios = np.linspace(lo, 1.0, grid).astype(np.float32)
        want = np.zeros(scale_shape(g, x.shape), np.float32)
        for idx, blk in ref_blocks(x, g):
            amax = np.max(np.abs(blk))
            best, best_e = None, None
            for r in ratios[::-1]:  # from r = 1 down; ties keep the larger ratio
                s = np.float32(amax * r) / np.float32(7.5)
                yq = np.clip(np.rint(blk / s), -8, 7) * s
                e = np.sum(np.abs(blk.astype(np.float64) - yq.astype(np.float64)) ** pp)
                if best_e is None or e < best_e:
                    best, best_e = s, e
            want[idx] = best
        np.testing.assert_array_equal(got, want)


def test_mse_clip_trivial_grids_equal_dynamic():
    x = outlier_data((8, 576))
    for spec in (make_spec("int4", granularity=PerGroup(128)), make_spec("uint4", granularity=PerGroup(128),
                                                                          symmetric=False), make_spec("bfp16")):
        dyn = quantize(x, spec)
        for kw in (dict(grid=1), dict(lo=1.0), dict(grid=1, lo=0.1)):
            p = mse_clip(x, spec, **kw)
            np.testing.assert_array_equal(p.scale, dyn.scales)
            if not spec.symmetric:
                np.testing.assert_array_equal(p.zero_point, dyn.zero_points)


def test_mse_clip_asymmetric_clips_both_ends():
    x = outlier_data((4, 256))
    spec = make_spec("uint4", granularity=PerGroup(128), symmetric=False)
    p = mse_clip(x, spec)
    dyn = quantize(x, spec)
    assert np.all(p.scale <= dyn.scales) and np.any(p.scale < dyn.scales)
    assert np.all((p.zero_point >= 0) & (p.zero_point <= 15) & (p.zero_point == np.rint(p.zero_point)))


# ---------------------------------------------------------------------------------------------------------------
# numpy never imports torch; torch is bit-identical to numpy
# ---------------------------------------------------------------------------------------------------------------


def test_numpy_path_does_not_import_torch(numpy_only):
    numpy_only(
        "import numpy as np\n"
        "from qcore import make_spec, PerGroup\n"
        "from qcore import stats as S\n"
        "x = np.random.default_rng(0).standard_normal((4, 96)).astype(np.float32)\n"
        "g = PerGroup(32); S.absmax(x, g); S.minmax(x, g); S.percentile(x, g, q=99)\n"
        "spec = make_spec('int4', granularity=g); S.mse_clip(x, spec, grid=4)\n"
        "S.scale_from_stats(S.RunningStats.from_array(x, g), spec)\n"
    )


def _eq(t, a, msg=""):
    assert type(t).__module__.startswith("torch"), msg
    np.testing.assert_array_equal(t.detach().cpu().numpy(), a, err_msg=msg)


def _check_torch(torch, device):
    for shape, g in CASES:
        x = data(shape, seed=5)
        x.flat[7] = np.float32(-1e-30)
        t = torch.from_numpy(x).to(device)
        _eq(absmax(t, g), absmax(x, g), str(g))
        for a, b in zip(minmax(t, g), minmax(x, g)):
            _eq(a, b, str(g))
        for q in (100, 99.9, 50, 12.3, 1e-6):
            r = percentile(t, g, q=q)
            assert r.device == t.device
            _eq(r, percentile(x, g, q=q), f"{g} q={q}")
    # non-finite blocks
    x = data((2, 256))
    x[0, 5] = np.nan
    x[1, 200] = -np.inf
    t = torch.from_numpy(x).to(device)
    for q in (50, 100):
        _eq(percentile(t, PerGroup(128), q=q), percentile(x, PerGroup(128), q=q))
    # torch.float16 / bfloat16 inputs are rounded to float32 first, as numpy's are
    x = data((4, 96))
    th = torch.from_numpy(x).to(device).to(torch.bfloat16)
    _eq(percentile(th, PerGroup(32), q=90), percentile(th.float().cpu().numpy(), PerGroup(32), q=90))
    # mse_clip
    x = outlier_data((16, 576))
    x[:6, :64] = _bfp16_data()
    t = torch.from_numpy(x).to(device)
    for spec in MSE_SPECS:
        pn = mse_clip(x, spec, grid=16)
        pt = mse_clip(t, spec, grid=16)
        _eq(pt.scale, pn.scale, _spec_id(spec))
        if pn.zero_point is not None:
            _eq(pt.zero_point, pn.zero_point, _spec_id(spec))
    # calibration state and static scales
    batches = [data((8, 576), seed=s) for s in range(3)]
    batches[0][:6, :64] = _bfp16_data()
    for spec in STATIC_SPECS:
        sn, st = RunningStats.empty(spec.granularity), RunningStats.empty(spec.granularity)
        for b in batches:
            sn, st = update(sn, b), update(st, torch.from_numpy(b).to(device))
        for f in ("absmax", "lo", "hi"):
            _eq(getattr(st, f), getattr(sn, f), f)
        pn, pt = scale_from_stats(sn, spec), scale_from_stats(st, spec)
        _eq(pt.scale, pn.scale, _spec_id(spec))
        if pn.zero_point is not None:
            _eq(pt.zero_point, pn.zero_point, _spec_id(spec))
        tb = torch.from_numpy(batches[0]).to(device)
        _eq(quantize(tb, spec, **pt.kwargs()).codes, quantize(batches[0], spec, **pn.kwargs()).codes)
    # mixing array kinds in one RunningStats is an error
    with pytest.raises(TypeError, match="numpy"):
        update(RunningStats.from_array(batches[0], PerTensor()), torch.from_numpy(batches[1]).to(device))
    with pytest.raises(TypeError):
        absmax(torch.arange(8, device=device), PerTensor())


def test_torch_cpu_bit_identical_to_numpy():
    torch = pytest.importorskip("torch")
    _check_torch(torch, "cpu")


def test_torch_accelerator_bit_identical_to_numpy():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _check_torch(torch, "cuda")

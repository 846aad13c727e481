"""probes / probes_by_kind: the documented content of every kind, determinism, shapes, errors, numpy only."""

from __future__ import annotations


import numpy as np
import pytest

import qcore
from qcore import PerChannel, PerGroup, make_spec
from qcore.testing import BLOCK_KINDS, ELEMENT_KINDS, probes, probes_by_kind


def bits(v):
    return np.ascontiguousarray(v, dtype=np.float32).view(np.uint32)


def bitset(v):
    return set(bits(v).reshape(-1).tolist())


def grid(fmt):
    d = qcore.get_dtype(fmt)
    if isinstance(d, qcore.IntDType):
        return np.arange(d.min, d.max + 1, dtype=np.float32)
    v = qcore.decode(np.arange(1 << d.bits), d)
    return v[np.isfinite(v)]


ELEMENTS = ["float4_e2m1fn", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float6_e3m2fn", "float8_e8m0fnu",
            "float8_e5m3", "float3_e1m1", "int4", "uint3", "int8", "bfloat16"]


@pytest.mark.parametrize("fmt", ELEMENTS)
def test_element_probes_hold_every_code_with_both_signs_and_their_neighbours(fmt):
    k = probes_by_kind(fmt)
    assert list(k) == [n for n in ELEMENT_KINDS if n in k]  # documented order
    x = probes(fmt)
    assert x.dtype == np.float32 and x.ndim == 1
    assert np.array_equal(bits(x), bits(np.concatenate(list(k.values()))))
    g = grid(fmt)
    assert bitset(np.concatenate([g, -g])) <= bitset(k["grid"])
    assert bitset(k["grid"]) <= bitset(np.concatenate([g, -g]))
    # Every grid value's float32 neighbours +-1 and +-2 ulps are probes (in "neighbours" unless on the grid).
    gf = g[np.isfinite(g)]
    for step in (1, 2):
        for direction in (np.inf, -np.inf):
            n = gf
            for _ in range(step):
                n = np.nextafter(n, np.float32(direction))
            n = n[np.isfinite(n)]
            assert bitset(n) <= bitset(k["neighbours"]) | bitset(k["grid"])


@pytest.mark.parametrize("fmt", ["float4_e2m1fn", "float8_e4m3fn", "float8_e5m2", "int4", "float8_e8m0fnu"])
def test_midpoints_are_exact_ties_and_near_midpoints_are_one_ulp_off(fmt):
    k = probes_by_kind(fmt)
    pos = np.unique(np.abs(grid(fmt).astype(np.float64)))
    mids = k["midpoints"]
    assert mids.size == 2 * (pos.size - 1)  # every adjacent pair, both signs
    m = np.abs(mids[mids > 0].astype(np.float64))
    i = np.searchsorted(pos, m)
    assert np.array_equal(m - pos[i - 1], pos[i] - m)  # exactly halfway
    up = np.nextafter(mids, np.float32(np.inf))
    down = np.nextafter(mids, np.float32(-np.inf))
    assert bitset(k["near_midpoints"]) == bitset(np.concatenate([up, down]))
    # Just above a tie rounds up, just below rounds down (int4's 7.5 is below -8's mirror 8: skip it).
    keep = pos[i] <= qcore.get_dtype(fmt).max_finite
    m, i = m[keep], i[keep]
    assert np.array_equal(qcore.cast(np.nextafter(np.float32(m), np.float32(np.inf)), fmt), pos[i].astype(np.float32))
    assert np.array_equal(qcore.cast(np.nextafter(np.float32(m), np.float32(0)), fmt), pos[i - 1].astype(np.float32))


def test_saturation_and_specials_for_e4m3fn():
    k = probes_by_kind("float8_e4m3fn")
    sat = set(k["saturation"].tolist())
    for v in (448.0, 464.0, 480.0, 896.0, 1792.0, float(np.finfo(np.float32).max), 2.0**127, np.inf):
        assert v in sat and -v in sat
    tie = np.float32(464)
    assert {float(np.nextafter(tie, np.float32(0))), float(np.nextafter(tie, np.float32(1e9)))} <= sat
    assert qcore.cast(np.float32(464), "float8_e4m3fn") == 448  # the overflow tie rounds to even (448)
    assert np.isnan(qcore.cast(np.nextafter(tie, np.float32(1e9)), "float8_e4m3fn"))  # just above it: NaN
    sp = k["specials"]
    assert np.isnan(sp).sum() == 4 and {0x7FC00000, 0xFFC00000, 0x7FC00001, 0x7F800001} <= bitset(sp)
    assert {0x00000000, 0x80000000, 0x7F800000, 0xFF800000} <= bitset(sp)


def test_subnormal_probes():
    k = probes_by_kind("float4_e2m1fn")  # smallest 0.5 (a subnormal), min normal 1.0
    sub = k["subnormals"]
    for v in (0.25, 0.125, 0.375, 2.0**-149, 2.0**-127, 1.5 * 2.0**-127, 2.0**-126):
        assert v in sub and -v in sub
    assert np.any((np.abs(sub) > 0.5) & (np.abs(sub) < 1.0))  # random values inside the subnormal range
    assert np.nextafter(np.float32(0.25), np.float32(0)) in sub  # the tie's neighbours
    assert np.nextafter(np.float32(0.25), np.float32(1)) in sub


def test_random_kinds_are_deterministic_in_key_and_count():
    a = probes_by_kind("float8_e4m3fn", key=3, random=100)
    b = probes_by_kind("float8_e4m3fn", key=3, random=100)
    c = probes_by_kind("float8_e4m3fn", key=4, random=100)
    for n in a:
        assert np.array_equal(bits(a[n]), bits(b[n]))
    assert a["random_bits"].size == 100 and a["random_range"].size == 100
    assert not np.array_equal(bits(a["random_bits"]), bits(c["random_bits"]))
    assert np.array_equal(bits(a["grid"]), bits(c["grid"]))
    expect = np.random.default_rng(3).integers(0, 1 << 32, size=100, dtype=np.uint64).astype(np.uint32)
    assert np.array_equal(bits(a["random_bits"]), expect)  # documented: default_rng(key) bit patterns
    assert "random_bits" not in probes_by_kind("float8_e4m3fn", random=0)
    r = np.abs(a["random_range"])
    assert r.min() >= 2.0**-13 and r.max() < 2.0**11  # e4m3fn's range widened by 3 binades below, 2 above


@pytest.mark.parametrize("fmt, B", [("mxfp4", 32), ("mxint8", 32), ("mx9", 16), ("mx4", 16), ("bfp16", 8)])
def test_block_probes_shape_kinds_and_ragged_group(fmt, B):
    k = probes_by_kind(fmt)
    assert list(k) == list(BLOCK_KINDS)
    x = probes(fmt)
    assert x.dtype == np.float32 and x.shape[1] == 2 * B + B // 2
    assert x.shape[0] == sum(v.shape[0] for v in k.values())
    assert probes(fmt, ragged=False).shape[1] == 2 * B
    assert np.all(k["zeros"] == 0) and np.any(np.signbit(k["zeros"]))
    assert np.all(np.isnan(k["nan"]).reshape(-1, k["nan"].shape[1]).any(axis=1))
    assert np.isinf(k["inf"][:, :2 * B].reshape(-1, B)).any(axis=1).all()
    blocks = k["pow2_amax"][:, :2 * B].reshape(-1, B)
    amax = np.max(np.abs(blocks), axis=1)
    for j in (-100, 0, 10, 126):
        p = np.float32(2.0**j)
        assert p in amax and np.nextafter(p, np.float32(0)) in amax and np.nextafter(p, np.float32(np.inf)) in amax
    tiny = np.max(np.abs(k["tiny"][:, :2 * B].reshape(-1, B)), axis=1)
    assert np.float32(2.0**-127) in tiny and np.float32(2.0**-149) in tiny
    huge = np.max(np.abs(k["huge"][:, :2 * B].reshape(-1, B)), axis=1)
    assert np.finfo(np.float32).max in huge
    r = np.abs(k["random"])
    assert r[r > 0].min() < 2.0**-30 and r.max() > 2.0**30
    assert np.all(np.isfinite(k["random_bits"]))


def test_block_probes_hold_every_element_value_and_in_block_ties():
    k = probes_by_kind("mxfp4")
    eg = k["element_grid"]
    g = grid("float4_e2m1fn")
    assert bitset(np.concatenate([g, -g])) <= bitset(eg)
    assert bitset(np.concatenate([g, -g]) * np.float32(2.0**-20)) <= bitset(eg)
    blocks = eg[:, :64].reshape(-1, 32)
    assert np.all(np.max(np.abs(blocks), axis=1) == blocks[:, 0])  # +maxel first fixes the scale
    mids = k["element_midpoints"]
    for t in (0.25, 2.5, 5.0, -5.0, 2.5 * 2.0**-20):
        assert np.float32(t) in mids


def test_scale_boundaries_cover_each_rule():
    k = probes_by_kind("mxfp4")
    sb = k["scale_boundaries"][:, :64].reshape(-1, 32)
    amax = set(np.max(np.abs(sb), axis=1).tolist())
    # e = 0 (scale 2**-2): EVEN's round-up point 2 - 2**-2 = 1.75 (for fp4 also the saturation tie 7 * 2**-2),
    # RCEIL's maxel * 2**-2 = 1.5, CEIL's 2**0; each with its float32 neighbours.
    for t in (1.75, 1.5, 1.0):
        t = np.float32(t)
        assert {float(t), float(np.nextafter(t, np.float32(0))), float(np.nextafter(t, np.float32(9)))} <= amax
    x = np.zeros((3, 32), np.float32)
    x[:, 0] = [1.75, np.nextafter(np.float32(1.75), np.float32(0)), 1.5]
    s = qcore.quantize(x, "mxfp4", scale_mode=qcore.ScaleMode.EVEN).scales[:, 0]
    assert s.tolist() == [0.5, 0.25, 0.25]  # EVEN moves up a binade exactly at the boundary
    mx9 = probes_by_kind("mx9")["scale_boundaries"]
    assert np.any(np.all(mx9[:, :4] == np.float32([1.75 * 2.0**-20, 0, np.nextafter(np.float32(2.0**-20), 0),
                                                   np.nextafter(np.float32(2.0**-20), 0)]), axis=1))


def test_ragged_last_group_is_the_first_half_of_a_block_of_the_same_kind():
    k = probes_by_kind("mxfp4")
    ob = k["one_outlier"]
    blocks = [ob[r, c * 32:(c + 1) * 32] for r in range(ob.shape[0]) for c in range(2)]
    for r in range(ob.shape[0]):
        tail = ob[r, 64:]
        assert any(np.array_equal(bits(tail), bits(b[:16])) for b in blocks)


def test_quantspec_with_pergroup_is_a_block_format():
    spec = make_spec("int4", granularity=PerGroup(48), symmetric=False)
    x = probes(spec)
    assert x.shape[1] == 2 * 48 + 24
    k = probes_by_kind(spec)
    assert set(np.unique(k["element_grid"][:, :96])) >= set(range(-8, 8)) - {-8}
    with pytest.raises(ValueError, match="PerGroup"):
        probes(make_spec("int4", granularity=PerChannel(0)))
    with pytest.raises(ValueError, match="last axis"):
        probes(make_spec("mxfp4", axis=0))


def test_argument_errors():
    with pytest.raises(ValueError, match="unknown dtype"):
        probes("float9")
    with pytest.raises(TypeError, match="key"):
        probes("fp4", key=-1)
    with pytest.raises(TypeError, match="random"):
        probes("fp4", random=1.5)
    with pytest.raises(TypeError, match="ragged"):
        probes("mxfp4", ragged=1)


def test_numpy_users_never_import_torch(numpy_only):
    numpy_only(
        "import numpy as np, qcore\n"
        "from qcore.testing import probes, probes_by_kind, assert_matches_oracle, compare, Op\n"
        "x = probes('mxfp4'); assert_matches_oracle(qcore.fake_quantize(x, 'mxfp4'), x, 'mxfp4',"
        " kinds=probes_by_kind('mxfp4'))\n"
        "r = compare(np.zeros(3, np.float32), np.ones(3, np.float32)); r.format()\n"
        "import qcore.testing.pytest_plugin\n"
    )

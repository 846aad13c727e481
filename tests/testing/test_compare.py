"""compare / assert_equal / Report: bitwise and ulp rules, NaN and zero rules, integers, torch, formatting."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from qcore.testing import Report, assert_equal, compare, probes_by_kind, ulp_distance

F = np.float32


def up(v, n=1):
    v = np.asarray(v, F)
    for _ in range(n):
        v = np.nextafter(v, F(np.inf))
    return v


def test_equal_arrays_match_and_the_report_says_so():
    x = np.linspace(-3, 3, 12, dtype=F).reshape(3, 4)
    r = compare(x, x.copy())
    assert r.ok and r.n_mismatch == 0 and r.n_total == 12 and r.mismatches == []
    assert r.format() == "qcore.testing: all 12 values match bit for bit"
    assert str(r) == r.format()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.ok = False  # type: ignore[misc]


def test_one_bit_flip_is_reported_with_index_values_and_bits():
    e = np.arange(12, dtype=F).reshape(3, 4)
    a = e.copy()
    a[1, 2] = up(a[1, 2])
    r = compare(a, e, inputs=e * 10)
    assert not r.ok and r.n_mismatch == 1 and r.max_ulp == 1
    m = r.mismatches[0]
    assert (m.index, m.multi_index, m.expected, m.expected_bits, m.ulp) == (6, (1, 2), 6.0, 0x40C00000, 1)
    assert m.actual_bits == 0x40C00001 and m.input == 60.0
    text = r.format()
    assert text.splitlines()[0] == "qcore.testing: 1 of 12 values differ (bit for bit)"
    assert "at flat index 6, index (1, 2)" in text
    assert "input     60.0" in text and "0x42700000" in text
    assert "expected  6.0" in text and "0x40c00000" in text
    assert "actual    6.0000005" in text and "0x40c00001   (1 ulp apart)" in text


def test_ulps_tolerance():
    e = np.array([1.0, -2.0, 1e-40, 3e38], F)
    a1 = up(e, 1)
    a2 = up(e, 2)
    assert not compare(a1, e).ok
    assert compare(a1, e, ulps=1).ok
    r = compare(a2, e, ulps=1)
    assert r.n_mismatch == 4 and r.max_ulp == 2 and "within 1 ulp)" in r.format()
    assert compare(a2, e, ulps=2).ok
    # Across zero: +min_subnormal and -min_subnormal are 2 ulps apart; +0 and the smallest subnormal 1.
    tiny = np.array([1e-45], F)
    assert ulp_distance(tiny, -tiny)[0] == 2 and ulp_distance(tiny, np.zeros(1, F))[0] == 1
    assert compare(-tiny, tiny, ulps=2).ok and not compare(-tiny, tiny, ulps=1).ok
    # Inf matches only Inf, whatever the tolerance.
    big = np.array([np.finfo(F).max], F)
    r = compare(np.array([np.inf], F), big, ulps=1000)
    assert not r.ok and r.mismatches[0].ulp is None
    with pytest.raises(ValueError, match="ulps"):
        compare(e, e, ulps=-1)


def test_nan_rules():
    nan_a = np.array([0x7FC00000], np.uint32).view(F)
    nan_b = np.array([0xFFC00001], np.uint32).view(F)
    assert compare(nan_a, nan_b).ok  # any NaN matches any NaN by default
    r = compare(nan_a, nan_b, nan_equal=False)
    assert not r.ok and "0xffc00001" in r.format()
    assert compare(nan_a, nan_a.copy(), nan_equal=False).ok
    r = compare(nan_a, np.ones(1, F), ulps=10**9)
    assert not r.ok and r.mismatches[0].ulp is None and "nan" in r.format()


def test_signed_zero_rules():
    pz, nz = np.zeros(2, F), -np.zeros(2, F)
    assert not compare(nz, pz).ok
    assert not compare(nz, pz, ulps=5).ok  # sign of zero is not an ulp question
    assert compare(nz, pz, signed_zero=False).ok
    assert "0x80000000" in compare(nz, pz).format()


def test_integer_arrays_compare_exactly():
    e = np.array([0, 1, 0x7E, 0xFF], np.uint8)
    assert compare(e.astype(np.int32), e).ok  # values, not dtypes
    a = e.copy()
    a[2] = 0x7F
    r = compare(a, e, ulps=3)  # ulps does not apply to integers
    assert r.n_mismatch == 1 and r.max_ulp is None
    assert "expected  126            0x7e" in r.format() and "actual    127            0x7f" in r.format()
    s = compare(np.array([-1], np.int8), np.array([1], np.int8))
    assert "0xff" in s.format()  # two's complement at the array's width


def test_shape_and_kind_problems():
    r = compare(np.zeros(3, F), np.zeros(4, F))
    assert not r.ok and "shape" in r.problem and r.format().startswith("qcore.testing: cannot compare")
    r = compare(np.zeros(3, np.uint8), np.zeros(3, F))
    assert not r.ok and "integer" in r.problem and "floating point" in r.problem
    r = compare(np.array([0.1], np.float64), np.array([0.1], F))
    assert not r.ok and "float64" in r.problem
    assert compare(np.array([0.5], np.float64), np.array([0.5], F)).ok


def test_kinds_name_and_count_mismatches():
    kinds = probes_by_kind("float4_e2m1fn", random=8)
    e = np.concatenate(list(kinds.values()))
    a = e.copy()
    a[len(kinds["grid"]) + 1] = 123.0  # the second "neighbours" entry
    a[-1] = 5.0 if a[-1] != 5.0 else 4.0  # the last random_range entry
    r = compare(a, e, kinds=kinds)
    assert r.by_kind == {"neighbours": 1, "random_range": 1}
    assert r.mismatches[0].kind == "neighbours" and "probe kind 'neighbours'" in r.format()
    assert "by probe kind: neighbours 1, random_range 1" in r.format()
    labels = ["a"] * 5 + ["b"] * (len(e) - 5)
    assert compare(a, e, kinds=labels).by_kind == {"b": 2}
    with pytest.raises(ValueError, match="kinds"):
        compare(a[:-1], e[:-1], kinds=kinds)


def test_max_report_and_max_rows():
    e = np.zeros(50, F)
    a = np.ones(50, F)
    r = compare(a, e, max_report=4)
    assert r.n_mismatch == 50 and len(r.mismatches) == 4
    assert "first 4 mismatches" in r.format() and "... and 46 more" in r.format()
    assert "first 2 mismatches" in r.format(max_rows=2) and "... and 48 more" in r.format(max_rows=2)
    assert "[my kernel]" in r.format(title="my kernel").splitlines()[0]


def test_assert_equal_raises_with_the_report():
    e = np.array([1.0, 2.0], F)
    assert isinstance(assert_equal(e, e.copy()), Report)
    with pytest.raises(AssertionError) as ei:
        assert_equal(np.array([1.0, 2.5], F), e, inputs=np.array([10.0, 20.0], F))
    msg = str(ei.value)
    assert "1 of 2 values differ" in msg and "input     20.0" in msg and "0x40200000" in msg
    assert_equal(up(e), e, ulps=1)


def test_torch_tensors_and_low_precision_outputs():
    torch = pytest.importorskip("torch")
    e = np.array([1.0, 0.5, -3.0, 0.0], F)
    assert compare(torch.from_numpy(e.copy()), e).ok
    assert compare(torch.from_numpy(e).to(torch.bfloat16), e).ok  # widened exactly
    assert compare(torch.from_numpy(e).half(), torch.from_numpy(e)).ok
    t = torch.from_numpy(e.copy()).requires_grad_(True) * 1
    assert compare(t, e).ok  # detached
    r = compare(torch.tensor([1, 2, 3], dtype=torch.uint8), np.array([1, 2, 4], np.uint8))
    assert r.n_mismatch == 1 and r.mismatches[0].multi_index == (2,)
    assert compare(torch.from_numpy(e).bfloat16() + 0.001, e).n_mismatch > 0

"""The kit catches seeded kernel bugs on its probes, and its report names the right details.

Each "kernel" here is a small independent numpy implementation of an OCP MX / element-cast / packing kernel,
written the way a kernel engineer would; the correct version of each must pass the kit, and each seeded bug
must be caught on ``probes(...)`` with a report that points at the cause.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import qcore
from qcore.testing import Op, assert_matches_oracle, check_against_oracle, probes, probes_by_kind

MX = {"mxfp4": ("float4_e2m1fn", 2), "mxfp8_e4m3": ("float8_e4m3fn", 8), "mxfp6_e3m2": ("float6_e3m2fn", 4)}


# ---------------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------------


def exact_exponent(amax):
    """floor(log2(amax)) for amax > 0, exactly (float64 frexp; mantissa in [0.5, 1))."""
    return np.frexp(amax.astype(np.float64))[1] - 1


def frexp_exponent(amax):
    """BUG (1): frexp's exponent used as is: one too big (its mantissa is in [0.5, 1), not [1, 2))."""
    return np.frexp(amax.astype(np.float64))[1]


def float_log2_exponent(amax):
    """BUG (5): floor of a float32 log2: log2(2**k - ulp) rounds to k, a binade too big."""
    return np.floor(np.log2(amax.astype(np.float32))).astype(np.int64)


def mx_kernel(x, fmt, *, exponent=exact_exponent, byte_lo=0, saturate=True, codes=False):
    """OCP MX fake-quantize (or quantize, ``codes=True``) along the last axis, blocks of 32, FLOOR scales.

    ``byte_lo``: the smallest E8M0 byte the kernel emits (correct: 0). ``saturate=False`` casts the scaled
    elements with the format's plain overflow rule (e4m3fn: NaN) instead of clamping (BUG (4)).
    """
    el, emax = MX[fmt]
    B = 32
    n = x.shape[-1]
    xp = np.pad(x, [(0, 0), (0, (-n) % B)])
    xb = xp.reshape(x.shape[0], -1, B)
    with np.errstate(invalid="ignore"):
        amax = np.max(np.abs(xb), axis=-1)
    bad = ~np.isfinite(amax)
    zero = amax == 0
    e = exponent(np.where(bad | zero, np.float32(1), amax))
    s = np.clip(e - emax, byte_lo - 127, 127)
    s = np.where(zero, byte_lo - 127, s).astype(np.int32)
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.ldexp(xb, -s[..., None]).astype(np.float32)
        v = qcore.cast(y, el, saturate=True if saturate else None)
    if codes:
        v = np.where(bad[..., None], np.float32(0), v)
        c = qcore.encode(v, el).reshape(x.shape[0], -1)[:, :n]
        scale_bytes = np.where(bad, 255, s + 127).astype(np.uint8)
        return c, scale_bytes
    with np.errstate(over="ignore"):
        out = np.ldexp(v, s[..., None]).astype(np.float32)
    out[bad] = np.nan
    return out.reshape(x.shape[0], -1)[:, :n]


def toy_cast(x, fmt, *, ties_away=False):
    """An element cast in float64, ml_dtypes semantics: round to the grid (half-even, or BUG (2): half away from
    zero, like np.round-half-away / C's round()), overflow saturates (FINITE), gives NaN (FN) or Inf (IEEE)."""
    d = qcore.get_dtype(fmt)
    with np.errstate(invalid="ignore", divide="ignore"):
        x64 = x.astype(np.float64)
        a = np.abs(x64)
        e = np.maximum(np.frexp(np.where(np.isfinite(a), a, 1.0))[1] - 1, d.emin)
        step = np.ldexp(1.0, e - d.mantissa_bits)
        q = a / step
        r = np.floor(q + 0.5) if ties_away else np.rint(q)
        v = r * step
    over = (v > d.max_finite) | np.isinf(a)
    if d.specials is qcore.Specials.FINITE:
        v = np.where(over, d.max_finite, v)
    elif d.specials is qcore.Specials.IEEE:
        v = np.where(over, np.inf, v)
    else:
        v = np.where(over, np.nan, v)
    v = np.copysign(v, x64)
    return np.where(np.isnan(x), np.float32(np.nan), v.astype(np.float32))


def pack_fp4_kernel(codes, *, flipped=False):
    """fp4 nibble packing; BUG (3): element 2i in the HIGH nibble (the OCP/torchao layout has it low)."""
    c = np.asarray(codes, np.uint8)
    if c.size % 2:
        c = np.concatenate([c, np.zeros(1, np.uint8)])
    lo, hi = (c[1::2], c[0::2]) if flipped else (c[0::2], c[1::2])
    return (lo | (hi << 4)).astype(np.uint8)


def _message(excinfo) -> str:
    return str(excinfo.value)


# ---------------------------------------------------------------------------------------------------------------
# the correct kernels pass
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(MX))
def test_correct_mx_kernel_passes(fmt):
    x = probes(fmt)
    assert_matches_oracle(mx_kernel(x, fmt), x, fmt, op=Op.FAKE_QUANTIZE, kinds=probes_by_kind(fmt))
    assert_matches_oracle(mx_kernel(x, fmt, codes=True), x, fmt, op=Op.QUANTIZE)


@pytest.mark.parametrize("fmt", ["float4_e2m1fn", "float8_e4m3fn", "float8_e5m2", "float6_e2m3fn", "float6_e3m2fn"])
def test_correct_cast_kernel_passes(fmt):
    x = probes(fmt)
    assert_matches_oracle(toy_cast(x, fmt), x, fmt, op=Op.CAST)


def test_correct_packing_passes():
    x = probes("float4_e2m1fn")
    codes = qcore.encode(x[~np.isnan(x)], "float4_e2m1fn")
    assert_matches_oracle(pack_fp4_kernel(codes), codes, "float4_e2m1fn", op=Op.PACK)


# ---------------------------------------------------------------------------------------------------------------
# (1) MX scale with an off-by-one exponent
# ---------------------------------------------------------------------------------------------------------------


def test_off_by_one_exponent_is_caught_with_its_scale():
    fmt = "mxfp4"
    x = probes(fmt)
    kinds = probes_by_kind(fmt)
    with pytest.raises(AssertionError) as ei:
        assert_matches_oracle(mx_kernel(x, fmt, exponent=frexp_exponent), x, fmt, op=Op.FAKE_QUANTIZE, kinds=kinds)
    msg = _message(ei)
    rep = check_against_oracle(mx_kernel(x, fmt, exponent=frexp_exponent), x, fmt, kinds=kinds)
    first = rep.mismatches[0]
    # The first mismatch is described completely: position, input, both outputs with bits, block, scale, amax.
    assert f"at flat index {first.index}, index {first.multi_index}" in msg
    assert f"probe kind {first.kind!r}" in msg
    assert f"0x{first.input_bits:08x}" in msg and f"0x{first.expected_bits:08x}" in msg
    assert f"0x{first.actual_bits:08x}" in msg
    b = first.block
    assert b.index == (first.multi_index[0], first.multi_index[1] // 32)
    e = math.frexp(b.amax)[1] - 1
    assert b.scale == 2.0 ** (e - 2) and b.scale_code == e - 2 + 127
    assert f"E8M0 byte 0x{b.scale_code:02x}" in msg and f"amax {np.float32(b.amax)}" in msg
    # With the scales compared directly, every non-special block's byte is one too big.
    with pytest.raises(AssertionError) as ei:
        assert_matches_oracle(mx_kernel(x, fmt, exponent=frexp_exponent, codes=True), x, fmt, op=Op.QUANTIZE,
                              kinds=kinds)
    msg = _message(ei)
    rep = check_against_oracle(mx_kernel(x, fmt, exponent=frexp_exponent, codes=True), x, fmt, op=Op.QUANTIZE)
    m = rep.mismatches[0]
    assert m.component == "scales" and m.actual == m.expected + 1
    assert re.search(r"expected\s+\d+\s+0x[0-9a-f]{2}\n\s+actual\s+\d+\s+0x[0-9a-f]{2}", msg)
    assert "scales" in msg.splitlines()[1]  # "by component: scales N, codes M"


def test_scale_byte_clamped_at_one_is_caught_only_by_tiny_blocks():
    """A subtler off-by-one: the kernel never emits E8M0 byte 0 (clamps the exponent at -126)."""
    fmt = "mxfp4"
    x = probes(fmt)
    kinds = probes_by_kind(fmt)
    rep = check_against_oracle(mx_kernel(x, fmt, byte_lo=1), x, fmt, kinds=kinds, max_report=50)
    assert not rep.ok
    assert "tiny" in rep.by_kind and set(rep.by_kind) <= {"tiny", "pow2_amax"}
    assert all(m.block.scale_code == 0 for m in rep.mismatches)
    assert "E8M0 byte 0x00" in rep.format()
    # Zero blocks quantize to zeros either way, but their scale byte shows it.
    rep = check_against_oracle(mx_kernel(x, fmt, byte_lo=1, codes=True), x, fmt, op=Op.QUANTIZE, kinds=kinds)
    assert rep.by_component.get("scales", 0) > 0 and "zeros" in rep.by_kind


# ---------------------------------------------------------------------------------------------------------------
# (2) ties rounded away from zero
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, tie, expected, actual", [
    ("float4_e2m1fn", 0.25, 0.0, 0.5),
    ("float8_e4m3fn", 2.0**-10, 0.0, 2.0**-9),
])
def test_ties_away_is_caught_on_midpoints(fmt, tie, expected, actual):
    x = probes(fmt)
    kinds = probes_by_kind(fmt)
    with pytest.raises(AssertionError) as ei:
        assert_matches_oracle(toy_cast(x, fmt, ties_away=True), x, fmt, op=Op.CAST, kinds=kinds, max_report=3)
    msg = _message(ei)
    rep = check_against_oracle(toy_cast(x, fmt, ties_away=True), x, fmt, op=Op.CAST, kinds=kinds)
    # Only exact ties differ, so every mismatch is a midpoint (or a tie among the subnormal probes, or the
    # overflow tie: e4m3fn's 464 rounds to 448, not to 480 = NaN), never a near-midpoint or a grid value; and
    # among the midpoints exactly those whose lower neighbour has an even code (RNE rounds those down).
    assert set(rep.by_kind) <= {"midpoints", "subnormals", "saturation", "random_range", "random_bits"}
    assert ("saturation" in rep.by_kind) == (fmt == "float8_e4m3fn")
    mids = kinds["midpoints"]
    lower = qcore.cast(mids, fmt, rounding=qcore.RoundingMode.TOWARD_ZERO)
    assert rep.by_kind["midpoints"] == int(np.sum(qcore.encode(lower, fmt) % 2 == 0))
    first = rep.mismatches[0]
    assert first.kind == "midpoints" and first.input == tie
    assert first.expected == expected and first.actual == actual
    bits = f"0x{int(np.float32(tie).view(np.uint32)):08x}"
    assert "probe kind 'midpoints'" in msg and bits in msg
    assert f"0x{int(np.float32(actual).view(np.uint32)):08x}" in msg


def test_ties_away_in_an_mx_kernel_is_caught_on_element_midpoints():
    fmt = "mxfp4"
    x = probes(fmt)
    kinds = probes_by_kind(fmt)
    B = 32

    def kernel(x):
        xp = np.pad(x, [(0, 0), (0, (-x.shape[1]) % B)]).reshape(x.shape[0], -1, B)
        with np.errstate(invalid="ignore"):
            amax = np.max(np.abs(xp), axis=-1)
        bad = ~np.isfinite(amax)
        s = np.clip(exact_exponent(np.where(bad | (amax == 0), 1, amax)) - 2, -127, 127)
        s = np.where(amax == 0, -127, s)
        with np.errstate(over="ignore"):
            y = np.clip(np.ldexp(xp, -s[..., None]), -6, 6)
        v = toy_cast(y, "float4_e2m1fn", ties_away=True)
        out = np.ldexp(v, s[..., None]).astype(np.float32)
        out[bad] = np.nan
        return out.reshape(x.shape[0], -1)[:, : x.shape[1]]

    rep = check_against_oracle(kernel(x), x, fmt, kinds=kinds)
    assert not rep.ok and rep.by_kind.get("element_midpoints", 0) > 0 and "element_grid" not in rep.by_kind


# ---------------------------------------------------------------------------------------------------------------
# (3) flipped nibble order
# ---------------------------------------------------------------------------------------------------------------


def test_flipped_nibbles_are_caught_with_the_codes_of_the_byte():
    x = probes("float4_e2m1fn")
    x = x[~np.isnan(x)]
    codes = qcore.encode(x, "float4_e2m1fn")
    bad = pack_fp4_kernel(codes, flipped=True)
    with pytest.raises(AssertionError) as ei:
        assert_matches_oracle(bad, codes, "float4_e2m1fn", op=Op.PACK)
    msg = _message(ei)
    good = qcore.packing.pack_fp4(codes)
    k = int(np.flatnonzero(good != bad)[0])
    lo, hi = int(codes[2 * k]), int(codes[2 * k + 1])
    assert good[k] == (hi << 4 | lo) and bad[k] == (lo << 4 | hi)
    assert f"at flat index {k}, index ({k},), packed" in msg
    assert f"0x{good[k]:02x}" in msg and f"0x{bad[k]:02x}" in msg
    assert f"packs elements {2 * k}..{2 * k + 1} along axis 0: codes [0x{lo:x}, 0x{hi:x}]" in msg
    # Bytes whose two nibbles are equal pack the same either way; every other byte is reported.
    rep = check_against_oracle(bad, codes, "float4_e2m1fn", op=Op.PACK)
    assert rep.n_mismatch == int(np.sum(codes[0::2][: len(codes) // 2] != codes[1::2][: len(codes) // 2])) + (
        int(len(codes) % 2 == 1 and codes[-1] != 0))


def test_flipped_nibbles_along_rows_name_the_probe_kind():
    x = probes("float4_e2m1fn", random=64)
    kinds = probes_by_kind("float4_e2m1fn", random=64)
    keep = ~np.isnan(x)
    codes = qcore.encode(np.where(keep, x, 0), "float4_e2m1fn")
    rep = check_against_oracle(pack_fp4_kernel(codes, flipped=True), codes, "float4_e2m1fn", op=Op.PACK,
                               kinds=kinds)
    assert not rep.ok and rep.mismatches[0].kind == "grid"


# ---------------------------------------------------------------------------------------------------------------
# (4) e4m3 without saturation under quantize
# ---------------------------------------------------------------------------------------------------------------


def test_missing_saturation_is_caught_at_the_saturation_boundary():
    fmt = "mxfp8_e4m3"
    x = probes(fmt)
    kinds = probes_by_kind(fmt)
    with pytest.raises(AssertionError) as ei:
        assert_matches_oracle(mx_kernel(x, fmt, saturate=False), x, fmt, kinds=kinds)
    msg = _message(ei)
    rep = check_against_oracle(mx_kernel(x, fmt, saturate=False), x, fmt, kinds=kinds, max_report=100)
    assert rep.by_kind.get("scale_boundaries", 0) > 0
    for m in rep.mismatches:
        # NaN where the oracle clamps to +-448 * scale.
        assert math.isnan(m.actual) and abs(m.expected) == 448.0 * m.block.scale
        assert abs(m.input) / m.block.scale >= 464.0  # beyond the overflow tie
    assert "nan" in msg and "0x7fc00000" in msg
    # The same bug seen through codes: the NaN code 0x7f/0xff where the oracle has 0x7e/0xfe (448).
    rep = check_against_oracle(mx_kernel(x, fmt, saturate=False, codes=True), x, fmt, op=Op.QUANTIZE)
    m = rep.mismatches[0]
    assert m.component == "codes" and m.actual & 0x7F == 0x7F and m.expected & 0x7F == 0x7E
    assert "float8_e4m3fn values: expected" in rep.format() and "actual nan" in rep.format()


# ---------------------------------------------------------------------------------------------------------------
# (5) a float log2 for the shared exponent
# ---------------------------------------------------------------------------------------------------------------


def test_float_log2_exponent_is_caught_just_below_powers_of_two():
    fmt = "mxfp4"
    x = probes(fmt)
    kinds = probes_by_kind(fmt)
    with pytest.raises(AssertionError) as ei:
        assert_matches_oracle(mx_kernel(x, fmt, exponent=float_log2_exponent), x, fmt, kinds=kinds)
    msg = _message(ei)
    rep = check_against_oracle(mx_kernel(x, fmt, exponent=float_log2_exponent), x, fmt, kinds=kinds,
                               max_report=200)
    assert "pow2_amax" in rep.by_kind
    assert "pow2_amax" in msg and "amax" in msg and "E8M0 byte" in msg
    for m in rep.mismatches:
        # Every failing block's amax lies within a few ulps below a power of two.
        mant, e = math.frexp(m.block.amax)
        assert 1 - 2 * mant < 2.0**-18 * 2, m.block
    # Exactly: the kernel's exponent is one too big for each such block.
    bad_blocks = {m.block.index for m in rep.mismatches}
    for bi in bad_blocks:
        amax = np.max(np.abs(x[bi[0], bi[1] * 32:(bi[1] + 1) * 32]))
        assert float_log2_exponent(np.array([amax]))[0] == exact_exponent(np.array([amax]))[0] + 1

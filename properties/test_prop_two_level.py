"""Properties of two-level scales (NVFP4; docs/numerics.md, "Two-level scales").

Each property restates one line of the documented rule in float32 numpy arithmetic and checks qcore against it
on drawn inputs and specs (tensor scale ONE, AMAX or a drawn given one; e4m3 or e5m3 block scales; any group
size along the last or the first axis, ragged groups included). fake_quantize == dequantize(quantize) and
numpy == torch for these specs are covered by test_prop_quantize.py / test_prop_torch.py (quant_cases draws
two-level specs too).
"""

from __future__ import annotations

import numpy as np
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import qcore
from qcore import PerGroup, TensorScale, dequantize, fake_quantize, make_spec, quantize

from ._specs import expand_to, shapes, two_level_specs
from ._util import assert_same_bits, examples, finite_grid, neighbours, seeded_arrays

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)

# Given tensor scales: positive normal float32 values over the whole range.
GIVEN = st.floats(min_value=2.0**-126, max_value=2.0**100, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def cases(draw, *, finite=True, modes=(TensorScale.ONE, TensorScale.AMAX, TensorScale.GIVEN)):
    """(x, spec, call keywords): 1-3 dims, a two-level spec, and tensor_scale= when the mode is GIVEN."""
    shape = draw(shapes(max_side=70))
    spec = draw(two_level_specs(shape, modes=modes))
    x = draw(seeded_arrays(shape, finite=finite))
    kw = {}
    if spec.tensor_scale_mode is TensorScale.GIVEN:
        kw["tensor_scale"] = F32(draw(GIVEN))
    return x, spec, kw


def block_amax(x, spec):
    """Per-block max |x| (NaN if the block holds a NaN), in the scale shape; ragged groups padded with 0."""
    g = spec.granularity
    ax = g.axis % x.ndim
    xm = np.moveaxis(np.abs(x), ax, -1)
    n = xm.shape[-1]
    nb = -(-n // g.size)
    pad = np.zeros(xm.shape[:-1] + (nb * g.size - n,), F32)
    xb = np.concatenate([xm, pad], axis=-1).reshape(xm.shape[:-1] + (nb, g.size))
    with np.errstate(invalid="ignore"):
        a = np.max(xb, axis=-1)
    return np.moveaxis(a, -1, ax).astype(F32)


def nearest_even_ok(values, targets, grid, code_of):
    """values[i] is the nearest point of ``grid`` (float64, sorted) to targets[i]; on a tie the even code."""
    t = targets.astype(np.float64)
    lo, hi = neighbours(grid, t)
    v = values.astype(np.float64)
    dlo = np.where(np.isnan(lo), np.inf, np.abs(t - lo))  # no grid point on that side (t at the ends)
    dhi = np.where(np.isnan(hi), np.inf, np.abs(hi - t))
    best = np.where(dlo < dhi, lo, hi)
    tie = (dlo == dhi) & (dlo > 0)  # t on the grid is no tie
    even = (code_of(values) & 1) == 0
    return np.where(tie, ((v == lo) | (v == hi)) & even, v == best)


def _tensor_scale(q):
    return F32(np.asarray(q.tensor_scale))


@given(case=cases())
@settings(max_examples=examples(0.5))
@example(case=(np.array([[6 * 1.0625] + [0.0] * 15], F32), make_spec("nvfp4", tensor_scale_mode=TensorScale.ONE), {}))
def test_block_scale_is_the_nearest_even_scale_value_to_the_clamped_quotient(case):
    """b = RNE(clamp(fl(fl(amax / M) / g), smallest normal, max)) in the scale format; NaN iff the block (or g)
    is not finite."""
    x, spec, kw = case
    q = quantize(x, spec, **kw)
    g = _tensor_scale(q)
    sd = spec.scale_dtype
    a = block_amax(x, spec)
    bad = ~np.isfinite(a) | ~np.isfinite(g)
    assert np.array_equal(np.isnan(q.scales), bad)
    with np.errstate(all="ignore"):
        s = np.clip((a / F32(spec.qmax)) / g, F32(sd.min_normal), F32(sd.max_finite))
    ok = nearest_even_ok(q.scales[~bad], s[~bad], finite_grid(sd.name),
                         lambda v: qcore.encode(v, sd).astype(np.int64))
    assert ok.all(), f"{spec}: block scale {q.scales[~bad][~ok][0]!r} for quotient {s[~bad][~ok][0]!r}"


@given(case=cases())
@settings(max_examples=examples(0.5))
def test_elements_are_the_nearest_even_values_of_x_times_the_reciprocal(case):
    """codes = RNE(clamp(fl(x * q), -M, M)) with q = min(fl(fl(1 / g) / b), FLT_MAX); codes 0 in NaN blocks;
    dequantized = value * fl(g * b)."""
    x, spec, kw = case
    q = quantize(x, spec, **kw)
    g = _tensor_scale(q)
    b = expand_to(q.scales, spec, x.shape).astype(F32)
    bad = np.isnan(b)
    v = qcore.decode(q.codes, spec.dtype)
    assert np.all(q.codes[bad] == 0)
    with np.errstate(all="ignore"):
        qm = (F32(1) / g) / b
        qm = np.where(qm > FLT_MAX, FLT_MAX, qm)
        y = np.clip(x * qm, F32(-spec.qmax), F32(spec.qmax))
    ok = nearest_even_ok(v[~bad], y[~bad], finite_grid(spec.dtype.name),
                         lambda w: qcore.encode(w, spec.dtype).astype(np.int64))
    assert ok.all(), f"{spec}: element {v[~bad][~ok][0]!r} for scaled value {y[~bad][~ok][0]!r}"
    assert np.array_equal(np.signbit(v[~bad]), np.signbit(y[~bad]))  # the sign (of zero too) is kept
    with np.errstate(all="ignore"):
        deq = v * (g * b)
    assert_same_bits(dequantize(q), deq, f"{spec}: dequantize != value * fl(g * b)", x)
    assert_same_bits(fake_quantize(x, spec, **kw), deq, f"{spec}: fake_quantize", x)


@given(case=cases(modes=(TensorScale.AMAX,)))
@settings(max_examples=examples(0.5))
def test_amax_tensor_scale_and_the_block_holding_the_amax(case):
    """AMAX: g = fl(amax / fl(M * S)) (raised to 2**-126; 1 for a zero tensor); the block holding the tensor amax
    gets the scale format's largest value S (unless g was raised)."""
    x, spec, _ = case
    q = quantize(x, spec)
    g = _tensor_scale(q)
    amax = F32(np.max(np.abs(x)))
    S = F32(spec.scale_dtype.max_finite)
    if amax == 0:
        assert g == 1
        return
    raw = amax / F32(spec.qmax * spec.scale_dtype.max_finite)
    assert g == max(raw, F32(2.0**-126))
    if raw >= F32(2.0**-126):
        assert np.max(q.scales) == S


@given(case=cases(modes=(TensorScale.AMAX,)), k=st.integers(-20, 20))
@settings(max_examples=examples(0.5))
def test_scaling_x_by_a_power_of_two_scales_only_the_tensor_scale(case, k):
    """AMAX: x * 2**k gives the same codes and block scales, g * 2**k and dequantized values * 2**k (no float32
    rounding changes: every step scales exactly while nothing is subnormal)."""
    x, spec, _ = case
    x = np.where(np.abs(x) < 2.0**-60, F32(0), np.clip(x, F32(-(2.0**60)), F32(2.0**60))).astype(F32)
    q = quantize(x, spec)
    q2 = quantize((x * F32(2.0**k)).astype(F32), spec)
    assume(float(np.max(np.abs(x))) > 0)
    assert np.array_equal(q.codes, q2.codes)
    assert_same_bits(q2.scales, q.scales, f"{spec}: block scales moved")
    assert _tensor_scale(q2) == _tensor_scale(q) * F32(2.0**k)
    assert_same_bits(dequantize(q2), dequantize(q) * F32(2.0**k), f"{spec}: values", x)


@given(case=cases(finite=False, modes=(TensorScale.AMAX,)))
@settings(max_examples=examples(0.5))
def test_static_with_its_own_tensor_scale_equals_dynamic(case):
    x, spec, _ = case
    q = quantize(x, spec)
    g = _tensor_scale(q)
    if not np.isfinite(g):
        assert np.all(np.isnan(q.scales)) and np.all(np.isnan(fake_quantize(x, spec)))  # one NaN/Inf: all NaN
        return
    q2 = quantize(x, spec, tensor_scale=g)
    assert np.array_equal(q2.codes, q.codes)
    assert_same_bits(q2.scales, q.scales, "static block scales")
    assert_same_bits(fake_quantize(x, spec, tensor_scale=g), dequantize(q), "static fake_quantize", x)


@given(x=seeded_arrays((4, 48), finite=False), g=GIVEN)
@settings(max_examples=examples(0.5))
def test_non_finite_values_make_exactly_their_blocks_nan(x, g):
    """With a fixed tensor scale (ONE or given) a NaN/Inf makes its own block NaN and no other."""
    bad = ~np.isfinite(x).reshape(4, 3, 16).all(axis=-1)
    for kw in (dict(tensor_scale_mode=TensorScale.ONE), dict(tensor_scale=F32(g))):
        y = fake_quantize(x, "nvfp4", **kw).reshape(4, 3, 16)
        assert np.all(np.isnan(y[bad])) and np.all(np.isfinite(y[~bad]))


@given(x=seeded_arrays((2, 32)), g=GIVEN)
@settings(max_examples=examples(0.25))
def test_e5m3_and_group_32_variant_is_the_same_rule(x, g):
    """make_spec("nvfp4", scale_dtype="float8_e5m3", granularity=PerGroup(32)) follows the same arithmetic: the
    block scale is an e5m3 value in [2**-14, 122880]."""
    spec = make_spec("nvfp4", scale_dtype="float8_e5m3", granularity=PerGroup(32))
    q = quantize(x, spec, tensor_scale=F32(g))
    s = q.scales
    assert np.all((s >= 2.0**-14) & (s <= 122880))
    assert_same_bits(qcore.cast(s, "float8_e5m3"), s, "not e5m3 values")

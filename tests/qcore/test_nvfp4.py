"""NVFP4 and two-level scales (docs/numerics.md, "Two-level scales").

Two oracles: an independent float32 re-implementation in this file (``nvfp4_reference``: no qcore, no
ml_dtypes; rounding by exact float64 arithmetic), so that CI without torchao still pins the semantics, and
torchao 0.18's ``nvfp4_quantize`` / ``NVFP4Tensor`` (skipped when torchao is not importable), compared byte for
byte where the documented semantics agree and checked to differ exactly as documented elsewhere.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import qcore
from qcore import PerGroup, TensorScale, dequantize, fake_quantize, make_spec, quantize

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
ONE = dict(tensor_scale_mode=TensorScale.ONE)


# ---------------------------------------------------------------------------------------------------------------
# the independent reference
# ---------------------------------------------------------------------------------------------------------------


def _rne(v, mbits: int, emin: int):
    """Round non-negative finite float64 ``v`` to nearest-even on a float grid with ``mbits`` mantissa bits and
    smallest normal exponent ``emin`` (subnormal spacing below). Exact: v / step is a power-of-two scaling."""
    v = np.asarray(v, np.float64)
    _, e = np.frexp(v)
    step = np.ldexp(1.0, np.maximum(e - 1, emin) - mbits)
    return np.round(v / step) * step  # np.round: ties to even


def _amax_tensor_scale(x, scale_max):
    with np.errstate(invalid="ignore"):
        a = F32(np.max(np.abs(x))) if x.size else F32(0)
    if not np.isfinite(a):
        return F32(np.nan)
    if a == 0:
        return F32(1)
    return max(a / F32(6 * scale_max), F32(2.0**-126))


def nvfp4_reference(x, g=None, *, block=16, scale_max=448.0, scale_emin=-6):
    """(codes uint8, block scales float32, g, dequantized float32) of 2-D float32 ``x`` (last axis a multiple of
    ``block``). ``g``: None = computed from the tensor amax (TensorScale.AMAX), else the tensor scale (ONE: 1)."""
    x = np.asarray(x, F32)
    g = _amax_tensor_scale(x, scale_max) if g is None else F32(g)
    m, k = x.shape
    xb = x.reshape(m, k // block, block)
    with np.errstate(all="ignore"):
        amax = np.max(np.abs(xb), axis=-1)
        s = np.clip((amax / F32(6)) / g, F32(2.0**scale_emin), F32(scale_max))
        bad = ~np.isfinite(amax) | ~np.isfinite(g)
        b = np.where(bad, F32(np.nan), _rne(np.where(bad, 1, s), 3, scale_emin).astype(F32))
        q = (F32(1) / g) / b
        q = np.where(q > FLT_MAX, FLT_MAX, q)
        y = np.clip(xb * q[..., None], F32(-6), F32(6))
        y = np.where(bad[..., None], F32(0), y)
        mag = _rne(np.abs(y), 1, 0)
        idx = np.searchsorted(E2M1, mag)
        neg = np.signbit(y)
        codes = (idx | (neg << 3)).astype(np.uint8)
        val = np.where(neg, -E2M1[idx], E2M1[idx]).astype(F32)
        deq = val * (g * b)[..., None]
    return codes.reshape(m, k), b, g, deq.reshape(m, k).astype(F32)


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------


def bits(a):
    return np.ascontiguousarray(np.asarray(a, F32)).view(np.uint32)


def same_bits(a, b):
    a, b = np.asarray(a, F32), np.asarray(b, F32)
    if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    return np.array_equal(bits(np.where(np.isnan(a), 0, a)), bits(np.where(np.isnan(b), 0, b)))


def torch_or_skip():
    return pytest.importorskip("torch")


def data(shape=(48, 256), seed=0):
    """randn under per-row magnitudes 10**[-3, 3], with an all-zero block, -0s, an outlier and a tiny block."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, (shape[0], 1))).astype(F32)
    if shape[0] >= 4 and shape[1] >= 32:
        x[0, :16] = 0
        x[1, :16] = -0.0
        x[2, 7] = 5e4
        x[3, 16:32] = rng.standard_normal(16).astype(F32) * F32(1e-30)
    return x


def check_against_reference(x, spec_kw, given=None, ref_g="amax"):
    """qcore (numpy, torch when available) == the reference, bit for bit: codes, scales, g, dequantized."""
    kw = dict(spec_kw)
    if given is not None:
        kw["tensor_scale"] = given
    q = quantize(x, "nvfp4", **kw)
    g = None if ref_g == "amax" else ref_g
    codes, b, g, deq = nvfp4_reference(x, g)
    assert np.array_equal(q.codes, codes), "codes"
    assert same_bits(q.scales, b), "scales"
    assert same_bits(np.asarray(q.tensor_scale).reshape(1), np.array([g], F32)), "tensor scale"
    assert same_bits(dequantize(q), deq), "dequantize"
    assert same_bits(fake_quantize(x, "nvfp4", **kw), deq), "fake_quantize"
    return q


# ---------------------------------------------------------------------------------------------------------------
# the format and the spec
# ---------------------------------------------------------------------------------------------------------------


def test_nvfp4_is_a_two_level_block_format():
    d = qcore.get_dtype("nvfp4")
    assert isinstance(d, qcore.BlockDType) and d.block_size == 16 and d.tensor_scale is TensorScale.AMAX
    assert d.element.name == "float4_e2m1fn" and d.scale.name == "float8_e4m3fn"
    assert d.bits_per_element == 4.5
    s = make_spec("nvfp4")
    assert s.granularity == PerGroup(16, -1) and not s.pow2_scale and s.two_level
    assert s.tensor_scale_mode is TensorScale.AMAX and s.scale_dtype.name == "float8_e4m3fn"
    assert not make_spec("mxfp4").two_level and make_spec("mxfp4").pow2_scale
    assert quantize(np.ones((2, 32), F32), "mxfp4").tensor_scale is None


def test_tensor_scale_of_the_default_spec_is_amax_over_6_times_448():
    x = data()
    q = quantize(x, "nvfp4")
    assert float(q.tensor_scale) == float(F32(np.max(np.abs(x))) / F32(2688))
    assert q.tensor_scale.shape == () and q.tensor_scale.dtype == np.float32
    assert np.nanmax(q.scales) == 448  # the block holding the tensor amax uses e4m3's whole range


# ---------------------------------------------------------------------------------------------------------------
# against the independent reference
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_single_level_amax_and_given(seed):
    x = data(seed=seed)
    check_against_reference(x, ONE, ref_g=F32(1))
    check_against_reference(x, {}, ref_g="amax")
    for g in (0.1, 3.7e-3, 2.0**-126, 1e20):
        check_against_reference(x, dict(tensor_scale_mode=TensorScale.GIVEN), given=g, ref_g=F32(g))
        check_against_reference(x, {}, given=g, ref_g=F32(g))  # a given g replaces the computed one (AMAX)


def test_e5m3_block_scales_follow_the_same_rule():
    x = data(seed=3)
    spec = make_spec("nvfp4", scale_dtype="float8_e5m3", granularity=PerGroup(32))
    q = quantize(x, spec)
    codes, b, g, deq = nvfp4_reference(x, block=32, scale_max=122880.0, scale_emin=-14)
    assert np.array_equal(q.codes, codes) and same_bits(q.scales, b) and same_bits(dequantize(q), deq)
    assert float(q.tensor_scale) == float(g)


def test_ragged_last_block_is_zero_padded():
    x = data((8, 40), seed=4)
    q = quantize(x, "nvfp4")
    xp = np.concatenate([x, np.zeros((8, 8), F32)], axis=1)
    codes, b, g, deq = nvfp4_reference(xp)
    assert np.array_equal(q.codes, codes[:, :40]) and same_bits(q.scales, b)
    assert same_bits(fake_quantize(x, "nvfp4"), deq[:, :40])


def test_other_axes_and_leading_dims():
    x = data((24, 64), seed=5).reshape(4, 6, 64)
    q = quantize(x, "nvfp4")
    codes, b, _, deq = nvfp4_reference(x.reshape(24, 64))
    assert np.array_equal(q.codes.reshape(24, 64), codes) and same_bits(q.scales.reshape(24, 4), b)
    y = data((64, 12), seed=6)
    qa = quantize(y, "nvfp4", axis=0)
    codes, b, _, deq = nvfp4_reference(y.T.copy())
    assert np.array_equal(qa.codes, codes.T) and same_bits(qa.scales, b.T)
    assert same_bits(fake_quantize(y, "nvfp4", axis=0), deq.T)


# ---------------------------------------------------------------------------------------------------------------
# edge cases (each pinned against the reference and stated outright)
# ---------------------------------------------------------------------------------------------------------------


def test_zero_blocks_and_zero_tensor():
    x = np.zeros((2, 32), F32)
    x[1, ::2] = -0.0
    for kw in ({}, ONE):
        q = quantize(x, "nvfp4", **kw)
        assert float(q.tensor_scale) == 1.0  # all-zero tensor: g = 1 (torchao: 0 -> NaN scales)
        assert np.all(q.scales == 2.0**-6) and np.all(qcore.encode(q.scales, "float8_e4m3fn") == 0x08)
        assert np.array_equal(q.codes, np.where(np.signbit(x), 8, 0))
        y = fake_quantize(x, "nvfp4", **kw)
        assert same_bits(y, x)  # zeros stay zeros, with their sign
    check_against_reference(data(), ONE, ref_g=F32(1))


def test_nan_or_inf_in_a_block_makes_that_block_nan_single_level_and_given():
    x = data((4, 64), seed=7)
    x[0, 3] = np.nan
    x[1, 20] = np.inf
    x[2, 40] = -np.inf
    for kw, g in ((ONE, F32(1)), (dict(tensor_scale=0.05), F32(0.05))):
        q = check_against_reference(x, kw, given=kw.get("tensor_scale"), ref_g=g)
        bad = np.zeros((4, 4), bool)
        bad[0, 0] = bad[1, 1] = bad[2, 2] = True
        assert np.all(np.isnan(q.scales[bad])) and np.all(np.isfinite(q.scales[~bad]))
        assert np.all(q.codes.reshape(4, 4, 16)[bad] == 0)
        y = fake_quantize(x, "nvfp4", **kw).reshape(4, 4, 16)
        assert np.all(np.isnan(y[bad])) and np.all(np.isfinite(y[~bad]))


def test_nan_or_inf_anywhere_makes_the_computed_tensor_scale_nan():
    for bad in (np.nan, np.inf, -np.inf):
        x = data((4, 64), seed=8)
        x[3, 63] = bad
        q = check_against_reference(x, {}, ref_g="amax")
        assert np.isnan(q.tensor_scale) and np.all(np.isnan(q.scales)) and np.all(q.codes == 0)
        assert np.all(np.isnan(fake_quantize(x, "nvfp4")))


def test_block_scale_underflow_clamps_to_the_smallest_normal():
    x = np.zeros((1, 32), F32)
    x[0, 0] = 1000.0  # tensor scale 1000 / 2688
    x[0, 16:] = 1e-3  # amax/6/g = 4.5e-4: below e4m3's 2**-6
    q = check_against_reference(x, {}, ref_g="amax")
    assert q.scales[0, 1] == 2.0**-6 and q.scales[0, 0] == 448
    # x * q = 1e-3 / (g * 2**-6) = 0.172 -> 0 (nearest of 0 and 0.5)
    assert np.all(q.codes[0, 16:] == 0)


def test_block_scale_overflow_saturates_at_448_and_elements_at_6():
    x = np.full((1, 16), 1000.0, F32)
    x[0, 1] = -2000.0
    q = check_against_reference(x, {}, given=0.01, ref_g=F32(0.01))  # amax/6/g = 33333 > 448
    assert q.scales[0, 0] == 448
    assert np.all(qcore.decode(q.codes, "float4_e2m1fn")[0, :2] == [6.0, -6.0])
    q1 = check_against_reference(x * F32(10), ONE, ref_g=F32(1))  # single level: 20000 / 6 > 448
    assert q1.scales[0, 0] == 448


def test_block_scale_rounding_ties_go_to_even():
    # amax / 6 exactly between e4m3 neighbours (single level): ties to the even mantissa, +-1 ulp decides.
    lo, hi = 1.0, 1.125
    t = F32(6 * (lo + hi) / 2)
    x = np.zeros((3, 16), F32)
    x[:, 0] = [t, np.nextafter(t, F32(0)), np.nextafter(t, F32(9))]
    q = check_against_reference(x, ONE, ref_g=F32(1))
    assert q.scales[:, 0].tolist() == [1.0, 1.0, 1.125]
    t2 = F32(6 * (1.125 + 1.25) / 2)
    q2 = quantize(np.array([[t2] + [0] * 15], F32), "nvfp4", **ONE)
    assert q2.scales[0, 0] == 1.25  # 1.125 has an odd mantissa


BLOCK_SCALE_ORDER_CASES = [  # (g, amax, b): fl(fl(amax / 6) / g) rounds to b; amax / fl(6 * g) to the other side
    (F32(0.5167034), F32(3.2939847), 1.125),
    (F32(0.94916296), F32(6.0509143), 1.0),
]


def test_block_scale_divides_by_6_then_by_g():
    for g, a, b in BLOCK_SCALE_ORDER_CASES:
        x = np.zeros((1, 16), F32)
        x[0, 3] = a
        q = check_against_reference(x, {}, given=g, ref_g=g)
        assert q.scales[0, 0] == b
        other = qcore.cast(a / (F32(6) * g), "float8_e4m3fn")
        assert other != b


def test_element_step_multiplies_by_the_reciprocal_in_torchaos_order():
    # q = fl(fl(1/g) / b) differs from fl(1 / fl(g * b)) by an ulp here, and x * q lands on the other side of an
    # element tie than x / fl(g * b) or x * fl(1 / fl(g * b)) (found by search; torchao agrees, see below).
    g = F32(0.05056379)
    x = np.zeros((1, 16), F32)
    x[0, :4] = [F32(6 * 1.875 * float(g)), 0.23701777, 0.023701778, 0.071105324]
    q = check_against_reference(x, {}, given=g, ref_g=g)
    assert q.scales[0, 0] == 1.875
    assert qcore.decode(q.codes, "float4_e2m1fn")[0, :4].tolist() == [6.0, 2.0, 0.0, 0.5]
    assert (F32(1) / g) / F32(1.875) != F32(1) / (g * F32(1.875))


def test_tiny_tensor_raises_g_to_the_smallest_float32_normal_and_keeps_q_finite():
    x = np.zeros((1, 32), F32)
    x[0, 0] = 1e-36          # amax / 2688 is a float32 subnormal (torchao: 1/g = Inf, codes 6)
    x[0, 16] = 2.0**-149     # a block far below: q = (2**126 / 2**-6) overflows, kept at FLT_MAX
    q = check_against_reference(x, {}, ref_g="amax")
    assert float(q.tensor_scale) == 2.0**-126
    y = fake_quantize(x, "nvfp4")
    assert np.all(np.isfinite(y)) and abs(float(y[0, 0]) - 1e-36) <= 0.25 * 1e-36


def test_huge_values_single_level_stay_finite():
    x = np.full((2, 16), FLT_MAX, F32)
    x[1] = -x[1]
    y = fake_quantize(x, "nvfp4", **ONE)
    assert np.all(np.abs(y) == 6 * 448)  # the block scale saturates at 448, the elements at 6
    check_against_reference(x, ONE, ref_g=F32(1))


# ---------------------------------------------------------------------------------------------------------------
# invariants: fake == dequantize(quantize), numpy == torch, compile, static == dynamic
# ---------------------------------------------------------------------------------------------------------------


def test_static_tensor_scale_reproduces_the_dynamic_result():
    x = data(seed=9)
    q = quantize(x, "nvfp4")
    q2 = quantize(x, "nvfp4", tensor_scale=q.tensor_scale)
    q3 = quantize(x, "nvfp4", tensor_scale_mode=TensorScale.GIVEN, tensor_scale=float(q.tensor_scale))
    q4 = quantize(x, "nvfp4", scale=q.scales)  # given block scales (values of e4m3) with the computed g
    for other in (q2, q3, q4):
        assert np.array_equal(other.codes, q.codes) and same_bits(other.scales, q.scales)
        assert same_bits(dequantize(other), dequantize(q))


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, ONE, dict(tensor_scale=0.37), dict(scale_dtype="float8_e5m3")])
def test_numpy_equals_torch_and_compiled(kw):
    torch = torch_or_skip()
    x = data(seed=10)
    if "tensor_scale" in kw or kw.get("tensor_scale_mode") is TensorScale.ONE:
        x[5, 3] = np.nan  # one NaN block (under AMAX it would make everything NaN)
    t = torch.from_numpy(x.copy())
    qn, qt = quantize(x, "nvfp4", **kw), quantize(t, "nvfp4", **kw)
    assert np.array_equal(qt.codes.numpy(), qn.codes)
    assert same_bits(qt.scales.numpy(), qn.scales) and same_bits(qt.tensor_scale.numpy(), qn.tensor_scale)
    assert qt.tensor_scale.shape == () and qt.tensor_scale.dtype == torch.float32
    fn = fake_quantize(x, "nvfp4", **kw)
    assert same_bits(dequantize(qt).numpy(), fn) and same_bits(dequantize(qn), fn)
    assert same_bits(fake_quantize(t, "nvfp4", **kw).numpy(), fn)
    assert same_bits(fake_quantize(t, "nvfp4", compile=True, **kw).numpy(), fn)
    assert np.array_equal(quantize(t, "nvfp4", compile=True, **kw).codes.numpy(), qn.codes)
    given = dict(kw, tensor_scale=torch.tensor(0.37)) if "tensor_scale" in kw else kw
    assert same_bits(fake_quantize(t, "nvfp4", **given).numpy(), fn)


def test_stochastic_rounding_is_numpy_torch_identical_and_unbiased_in_the_grid():
    torch = torch_or_skip()
    x = data(seed=11)
    kw = dict(rounding=qcore.RoundingMode.STOCHASTIC, key=7)
    a = fake_quantize(x, "nvfp4", **kw)
    assert same_bits(fake_quantize(torch.from_numpy(x), "nvfp4", **kw).numpy(), a)
    q = quantize(x, "nvfp4", **kw)
    assert same_bits(dequantize(q), a)
    det = quantize(x, "nvfp4")
    assert same_bits(q.scales, det.scales)  # stochastic rounding touches the elements only


# ---------------------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------------------


def test_spec_validation():
    with pytest.raises(ValueError, match="float elements"):
        make_spec("int4", granularity=PerGroup(16), scale_dtype="float8_e4m3fn", tensor_scale_mode=TensorScale.AMAX)
    with pytest.raises(ValueError, match="powers of two"):
        make_spec("nvfp4", scale_dtype="float8_e8m0fnu")
    with pytest.raises(ValueError, match="float32"):
        make_spec("nvfp4", scale_dtype="float32")
    with pytest.raises(TypeError, match="TensorScale"):
        make_spec("nvfp4", tensor_scale_mode="amax")
    with pytest.raises(ValueError, match="two-level"):
        qcore.BlockDType("bad", qcore.get_dtype("int4"), 16, qcore.get_dtype("float8_e4m3fn"),
                         tensor_scale=TensorScale.AMAX)
    with pytest.raises(TypeError, match="TensorScale"):
        qcore.BlockDType("bad", qcore.get_dtype("float4_e2m1fn"), 16, qcore.get_dtype("float8_e4m3fn"),
                         tensor_scale="amax")


@pytest.mark.parametrize("bad, exc, msg", [
    (0.0, ValueError, "2\\*\\*-126"), (-1.0, ValueError, "2\\*\\*-126"), (float("nan"), ValueError, "finite"),
    (float("inf"), ValueError, "finite"), (1e-40, ValueError, "normal"), (1e39, ValueError, "finite"),
    ([0.1, 0.2], ValueError, "one value"), (True, TypeError, "positive float"), ("0.1", TypeError, "positive float"),
])
def test_tensor_scale_argument_validation(bad, exc, msg):
    x = data((2, 32))
    with pytest.raises(exc, match=msg):
        quantize(x, "nvfp4", tensor_scale=bad)
    with pytest.raises(exc, match=msg):
        fake_quantize(x, "nvfp4", tensor_scale=bad)


def test_tensor_scale_argument_must_fit_the_spec():
    x = data((2, 32))
    with pytest.raises(ValueError, match="tensor_scale_mode=ONE"):
        quantize(x, "nvfp4", tensor_scale=0.1, **ONE)
    with pytest.raises(ValueError, match="tensor_scale_mode=NONE"):
        fake_quantize(x, "mxfp4", tensor_scale=0.1)
    with pytest.raises(ValueError, match="tensor_scale="):
        quantize(x, "nvfp4", tensor_scale_mode=TensorScale.GIVEN)
    with pytest.raises(ValueError, match="values of float8_e4m3fn"):
        quantize(x, "nvfp4", scale=np.full((2, 2), 0.3, F32))
    q = quantize(x, "nvfp4")
    with pytest.raises(ValueError, match="tensor_scale"):
        dequantize(qcore.QTensor(q.codes, q.scales, None, q.spec))
    from qcore import stats

    with pytest.raises(ValueError, match="two-level"):
        stats.scale_from_stats(stats.RunningStats.from_array(x, PerGroup(16)), "nvfp4")


# ---------------------------------------------------------------------------------------------------------------
# the kernel-test kit and conformance vectors
# ---------------------------------------------------------------------------------------------------------------


def test_probes_and_oracle_know_nvfp4():
    from qcore.testing import Op, assert_matches_oracle, probes, probes_by_kind

    k = probes_by_kind("nvfp4")
    assert "block_scale_rounding" in k and k["block_scale_rounding"].shape[1] == 40
    amax = np.max(np.abs(k["block_scale_rounding"][:, :32].reshape(-1, 16)), axis=1)
    assert F32(6 * 1.0625) in amax and F32(6 * 464) in amax and F32(6 * 2.0**-7) in amax
    x = probes("nvfp4", ragged=False)
    for kw in (ONE, dict(tensor_scale=0.1)):
        assert_matches_oracle(fake_quantize(x, "nvfp4", **kw), x, "nvfp4", **kw)
        q = quantize(x, "nvfp4", **kw)
        assert_matches_oracle(q, x, "nvfp4", op=Op.QUANTIZE, **kw)
        g = F32(kw.get("tensor_scale", 1.0))
        codes, b, _, deq = nvfp4_reference(x, g)
        assert np.array_equal(q.codes, codes) and same_bits(q.scales, b) and same_bits(dequantize(q), deq)
    q = quantize(x, "nvfp4", tensor_scale=0.1)
    parts = dict(codes=q.codes, scales=q.scales, tensor_scale=np.float32(0.2))
    with pytest.raises(AssertionError, match="tensor_scale"):
        assert_matches_oracle(parts, x, "nvfp4", op=Op.QUANTIZE, tensor_scale=0.1)
    with pytest.raises(AssertionError, match="MISMATCH|mismatch"):
        bad = fake_quantize(x, "nvfp4", **ONE)
        bad[5, 5] = bad[5, 5] + 1
        assert_matches_oracle(bad, x, "nvfp4", **ONE)


def test_conformance_export_and_check(tmp_path):
    from qcore import conformance

    m = conformance.export(tmp_path / "v", ["nvfp4"])
    assert m.case_names == ["nvfp4.quantize.tensor_scale_one", "nvfp4.quantize.tensor_scale_given"]
    for name, g in (("nvfp4.quantize.tensor_scale_one", 1.0), ("nvfp4.quantize.tensor_scale_given", 0.1)):
        assert m.load(name, "input_tensor_scale").tolist() == [float(F32(g))]
        x = m.load(name, "input")
        kw = ONE if g == 1.0 else dict(tensor_scale=g)
        q = quantize(x, "nvfp4", **kw)
        assert np.array_equal(m.load(name, "expected_codes"), q.codes)
        assert np.array_equal(m.load(name, "expected_scale_codes"), qcore.encode(q.scales, "float8_e4m3fn"))
        assert same_bits(m.load(name, "expected_dequantized"), dequantize(q))
        assert "Two-level" in m.case(name)["semantics"]
    out = tmp_path / "out"
    for c in m.cases:
        (out / c["name"]).mkdir(parents=True)
        for f in c["files"]:
            if not f["role"].startswith("input"):
                np.save(out / c["name"] / (f["role"] + ".npy"), m.load(c["name"], f["role"]))
    assert conformance.check(tmp_path / "v", out).ok


# ---------------------------------------------------------------------------------------------------------------
# torchao 0.18 as an oracle
# ---------------------------------------------------------------------------------------------------------------


def _torchao():
    torch = torch_or_skip()
    try:
        from torchao.prototype.mx_formats.kernels import unpack_uint4
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, nvfp4_quantize, per_tensor_amax_to_scale
    except Exception as exc:  # noqa: BLE001 - any import problem means: no oracle here
        pytest.skip(f"torchao's NVFP4 reference is not importable ({type(exc).__name__}: {exc})")
    return torch, nvfp4_quantize, per_tensor_amax_to_scale, NVFP4Tensor, unpack_uint4


def _torchao_qdq(x, g, torch, nvfp4_quantize, NVFP4Tensor, unpack_uint4):
    t = torch.from_numpy(np.ascontiguousarray(x))
    gt = None if g is None else torch.tensor(g, dtype=torch.float32)
    scales, packed = nvfp4_quantize(t, 16, gt)
    nv = NVFP4Tensor.to_nvfp4(t, per_tensor_scale=gt)
    return unpack_uint4(packed).numpy(), scales.view(torch.uint8).numpy(), nv.dequantize(torch.float32).numpy()


def _check_torchao(x, g, ao, where=None):
    torch, nvq, _, NV, unpack = ao
    codes, sbytes, deq = _torchao_qdq(x, g, torch, nvq, NV, unpack)
    kw = ONE if g is None else dict(tensor_scale=g)
    q = quantize(x, "nvfp4", **kw)
    ok_blocks = np.ones(q.scales.shape, bool) if where is None else where
    ok_el = np.repeat(ok_blocks, 16, axis=-1)
    assert np.array_equal(q.codes[ok_el], codes[ok_el]), "codes differ from torchao"
    assert np.array_equal(qcore.encode(q.scales, "float8_e4m3fn")[ok_blocks], sbytes[ok_blocks]), "scale bytes"
    assert same_bits(dequantize(q)[ok_el], deq[ok_el]), "dequantize differs from NVFP4Tensor.dequantize"
    return q, codes, sbytes, deq


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_torchao_with_and_without_tensor_scale(seed):
    ao = _torchao()
    torch, _, amax_to_scale, _, _ = ao
    for shape in ((32, 64), (128, 512), (3, 16)):
        x = data(shape, seed) if shape[0] >= 4 else np.random.default_rng(seed).standard_normal(shape).astype(F32)
        _check_torchao(x, None, ao)
        g = float(amax_to_scale(torch.tensor(np.max(np.abs(x)))))
        q, *_ = _check_torchao(x, g, ao)
        assert float(quantize(x, "nvfp4").tensor_scale) == g  # qcore's AMAX is per_tensor_amax_to_scale
        for g in (0.37, 1e-3, 5.0):
            _check_torchao(x, g, ao)


def test_matches_torchao_on_probes_and_differs_only_where_documented():
    ao = _torchao()
    from qcore.testing import probes

    x = probes("nvfp4", ragged=False)
    amax = np.max(np.abs(x.reshape(x.shape[0], -1, 16)), axis=-1)
    finite = np.isfinite(amax)
    for g in (None, 0.1, 2.0**-20):
        q, codes, sbytes, _ = _check_torchao(x, g, ao, where=finite)
        # NaN blocks: torchao's scale is NaN too (0x7F, its codes are garbage); Inf blocks: torchao 448 (0x7E),
        # qcore NaN (the OCP MX reading); qcore's codes there are 0.
        nan_b = np.isnan(amax)
        inf_b = np.isinf(amax)
        assert np.all((sbytes[nan_b] & 0x7F) == 0x7F) and np.all(np.isnan(q.scales[~finite]))
        if g is None:
            assert np.all(sbytes[inf_b] == 0x7E)
        assert np.all(q.codes.reshape(x.shape[0], -1, 16)[~finite] == 0)


def test_torchao_zero_tensor_and_tiny_tensor_differences():
    ao = _torchao()
    torch, nvq, amax_to_scale, NV, unpack = ao
    z = np.zeros((2, 32), F32)
    g0 = float(amax_to_scale(torch.tensor(0.0)))
    _, sbytes, _ = _torchao_qdq(z, g0, torch, nvq, NV, unpack)
    assert g0 == 0 and np.all((sbytes & 0x7F) == 0x7F)  # torchao: 0 / 0 scales
    assert np.all(qcore.encode(quantize(z, "nvfp4").scales, "float8_e4m3fn") == 0x08)  # qcore: g = 1
    t = np.full((1, 16), 1e-36, F32)
    gt = float(amax_to_scale(torch.tensor(1e-36)))
    codes, _, _ = _torchao_qdq(t, gt, torch, nvq, NV, unpack)
    assert gt < 2.0**-126 and np.all(codes == 7)  # torchao: 1 / g = Inf, every element saturates to 6
    y = fake_quantize(t, "nvfp4")
    assert np.all(np.abs(y - t) <= 0.25 * t)  # qcore: g = 2**-126, a usable scale


def test_element_step_example_matches_torchao():
    ao = _torchao()
    for g, a, _ in BLOCK_SCALE_ORDER_CASES:
        x = np.zeros((1, 16), F32)
        x[0, 3] = a
        _check_torchao(x, float(g), ao)
    g = F32(0.05056379)
    x = np.zeros((1, 16), F32)
    x[0, :4] = [F32(6 * 1.875 * float(g)), 0.23701777, 0.023701778, 0.071105324]
    _check_torchao(x, float(g), ao)


def test_block_scale_rounding_probes_match_torchao():
    ao = _torchao()
    from qcore.testing import probes_by_kind

    x = probes_by_kind("nvfp4", ragged=False)["block_scale_rounding"]
    for g in (None, 0.1):
        _check_torchao(x, g, ao)
    assert math.isfinite(float(np.max(np.abs(x))))

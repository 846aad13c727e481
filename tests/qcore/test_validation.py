"""No silent wrong answers: arguments that used to be ignored, wrapped or misread now raise (or mean something
documented), and fake_quantize has straight-through gradients. One test (or a few) per item of the issue."""

import ast
import math
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pytest

import qcore
from qcore import (PerBlock, PerChannel, PerGroup, PerTensor, QTensor, QuantSpec, RoundingMode, ScaleMode, cast,
                   decode, dequantize, fake_quantize, make_spec, quantize)
from qcore.rounding import random_bits

ROOT = pathlib.Path(__file__).resolve().parents[2]
F32_MAX = float(np.finfo(np.float32).max)


def _data(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _bits(a):
    a = a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# ---------------------------------------------------------------------------------------------------------------
# axis= with granularity= or a QuantSpec
# ---------------------------------------------------------------------------------------------------------------


def test_axis_conflicting_with_an_explicit_granularity_raises():
    w = _data((64, 96))
    with pytest.raises(ValueError, match=r"axis=0 conflicts with granularity=PerGroup\(size=32, axis=-1\)"):
        quantize(w, "int4", granularity=PerGroup(32), axis=0)
    with pytest.raises(ValueError, match="conflicts"):
        fake_quantize(w, "mxfp4", granularity=PerGroup(16), axis=0)
    with pytest.raises(ValueError, match="conflicts"):
        make_spec("int8", granularity=PerChannel(1), axis=0)
    # the same axis twice is not a conflict
    a = fake_quantize(w, "int4", granularity=PerGroup(32, axis=0), axis=0)
    assert np.array_equal(_bits(a), _bits(fake_quantize(w.T.copy(), "int4", granularity=PerGroup(32)).T))


@pytest.mark.parametrize("g", [PerTensor(), PerBlock((8, 8))])
def test_axis_with_a_granularity_that_has_no_axis_raises(g):
    w = _data((16, 32))
    with pytest.raises(ValueError, match=r"axis=0 does not apply to granularity="):
        quantize(w, "int8", granularity=g, axis=0)
    spec = make_spec("int8", granularity=g)
    with pytest.raises(ValueError, match=r"axis=1 does not apply to the spec's granularity"):
        fake_quantize(w, spec, axis=1)


def test_axis_replaces_the_axis_of_a_quantspec():
    w = _data((64, 96), seed=1)
    for spec in (make_spec("int4", granularity=PerGroup(32)), make_spec("mxfp4"), make_spec("int8", axis=1)):
        s0 = make_spec(spec, axis=0)
        assert s0.granularity.axis == 0 and type(s0.granularity) is type(spec.granularity)
        assert np.array_equal(_bits(fake_quantize(w, spec, axis=0)), _bits(fake_quantize(w, s0)))
        assert np.array_equal(_bits(fake_quantize(w, spec, axis=0)),
                              _bits(fake_quantize(w.T.copy(), spec).T))


def test_numpy_integer_axes_and_sizes_are_ints():
    w = _data((64, 32), seed=2)
    assert PerGroup(np.int64(32), np.int32(0)) == PerGroup(32, 0)
    assert type(PerGroup(np.int64(32)).size) is int and type(PerChannel(np.int16(1)).axis) is int
    assert PerBlock([np.int64(4), 8], axes=(np.int8(0), 1)) == PerBlock((4, 8), axes=(0, 1))
    assert np.array_equal(fake_quantize(w, "mxfp4", axis=np.int64(0)), fake_quantize(w, "mxfp4", axis=0))
    assert np.array_equal(fake_quantize(w, "int4", granularity=PerGroup(np.int64(16))),
                          fake_quantize(w, "int4", granularity=PerGroup(16)))
    for bad in (0.0, True, "0"):
        with pytest.raises(TypeError, match="axis must be an int"):
            quantize(w, "mxfp4", axis=bad)
    with pytest.raises(ValueError, match="PerGroup size must be a positive int, got 32.0"):
        quantize(w, "int4", granularity=PerGroup(32.0))


# ---------------------------------------------------------------------------------------------------------------
# unsigned integer formats
# ---------------------------------------------------------------------------------------------------------------


def test_unsigned_formats_default_to_asymmetric_and_use_every_code():
    assert make_spec("uint8").symmetric is False and QuantSpec("uint4").symmetric is False
    assert make_spec("int8").symmetric is True and QuantSpec("int8").symmetric is True
    x = np.linspace(0, 1, 256, dtype=np.float32)
    q = quantize(x, "uint8")
    assert int(q.codes.max()) == 255 and int(q.codes.min()) == 0 and q.zero_points.item() == 0
    assert np.array_equal(q.codes.astype(np.int64), np.arange(256))
    y = fake_quantize(np.float32([0.0, 0.3, 1.0, 0.8]), "uint1")
    assert y.tolist() == [0.0, 0.0, 1.0, 1.0]  # uint1 used to return all zeros


def test_symmetric_unsigned_means_zero_point_zero_over_0_to_qmax():
    x = np.float32([-1.0, 0.0, 0.5, 2.0, 4.0])
    q = quantize(x, "uint8", symmetric=True)
    assert q.zero_points is None and q.scales.item() == np.float32(4.0) / np.float32(255)
    want = np.clip(np.rint(x / q.scales), 0, 255)  # float32 division, RNE, codes [0, 255]
    assert q.codes.tolist() == want.tolist() and q.codes.tolist() == [0, 0, 32, 127, 255]  # -1 clamps to 0
    assert np.array_equal(_bits(dequantize(q)), _bits(fake_quantize(x, "uint8", symmetric=True)))
    assert fake_quantize(np.float32([0.25, 1.0]), "uint1", symmetric=True).tolist() == [0.0, 1.0]
    # power-of-two scales have no zero point: the unsigned default says what to do
    with pytest.raises(ValueError, match="pass symmetric=True"):
        make_spec("uint8", scale_dtype="float8_e8m0fnu")
    assert make_spec("uint8", scale_dtype="float8_e8m0fnu", symmetric=True).pow2_scale


# ---------------------------------------------------------------------------------------------------------------
# zero_point validation
# ---------------------------------------------------------------------------------------------------------------


def test_given_zero_points_are_validated():
    x = _data((2, 8), seed=3)
    s = np.float32([[0.05]])
    with pytest.raises(ValueError, match=r"zero_point must hold integers.*, got 3\.5"):
        quantize(x, "uint8", scale=s, zero_point=3.5)
    with pytest.raises(ValueError, match="must hold integers.*nan"):
        fake_quantize(x, "uint8", scale=s, zero_point=np.nan)
    with pytest.raises(ValueError, match=r"code range \[0, 255\] of uint8, got 300\.0"):
        quantize(x, "uint8", scale=s, zero_point=300)
    with pytest.raises(ValueError, match=r"code range \[-128, 127\] of int8, got -129\.0"):
        quantize(x, "int8", symmetric=False, scale=s, zero_point=-129)
    with pytest.raises(ValueError, match="zero_point=7 was given without scale="):
        quantize(x, "uint8", zero_point=7)
    with pytest.raises(ValueError, match="zero_point=7 was given for a symmetric spec"):
        fake_quantize(x, "int8", scale=s, zero_point=7)
    q = quantize(x, "uint8", scale=s, zero_point=np.float32([[128]]))
    assert q.zero_points.item() == 128
    assert np.array_equal(_bits(dequantize(q)), _bits(fake_quantize(x, "uint8", scale=s, zero_point=128)))


# ---------------------------------------------------------------------------------------------------------------
# decode of wide integers
# ---------------------------------------------------------------------------------------------------------------


def test_decode_checks_the_range_before_narrowing():
    with pytest.raises(ValueError, match=r"valid codes are 0\.\.15, got 4294967299"):
        decode(2**32 + 3, "float4_e2m1fn")
    with pytest.raises(ValueError, match="got 4294967296"):
        decode(np.array([1, 2**32], np.int64), "float8_e4m3fn")
    with pytest.raises(ValueError, match="got 18446744073709551615"):
        decode(np.array([2**64 - 1], np.uint64), "int8")
    assert decode(np.array([3], np.uint64), "float4_e2m1fn").tolist() == [1.5]
    # float32 codes are bit patterns, read as int32 or uint32
    assert decode(np.array([0xBF800000], np.uint32), "float32").tolist() == [-1.0]
    assert decode(np.array([-1082130432], np.int64), "float32").tolist() == [-1.0]
    with pytest.raises(ValueError, match="valid codes"):
        decode(np.array([2**32], np.int64), "float32")


def test_decode_checks_wide_torch_codes():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="got 4294967299"):
        decode(torch.tensor([2**32 + 3]), "float4_e2m1fn")


# ---------------------------------------------------------------------------------------------------------------
# stochastic rounding keys: all 63 bits
# ---------------------------------------------------------------------------------------------------------------


def _old_stream(key, n):
    """The stream as it was for keys below 2**32 (independent re-implementation with Python ints)."""
    def lowbias32(h):
        h &= 0xFFFFFFFF
        h ^= h >> 16
        h = (h * 0x7FEB352D) & 0xFFFFFFFF
        h ^= h >> 15
        h = (h * 0x846CA68B) & 0xFFFFFFFF
        return h ^ (h >> 16)

    kh = lowbias32(key * 0x9E3779B9 + 0x85EBCA6B)
    return [lowbias32(lowbias32((i + kh) & 0xFFFFFFFF) ^ kh) ^ kh for i in range(n)]


def test_stochastic_keys_use_all_63_bits():
    like = np.zeros(1, np.float32)
    assert not np.array_equal(random_bits(7, (256,), like=like), random_bits(7 + 2**32, (256,), like=like))
    assert not np.array_equal(random_bits(0, (256,), like=like), random_bits(2**62, (256,), like=like))
    # keys below 2**32 keep their stream
    for key in (0, 7, 2**32 - 1):
        assert random_bits(key, (64,), like=like).tolist() == _old_stream(key, 64)
    x = np.full((64, 64), 0.3, np.float32)
    kw = dict(scale=np.float32([[1.0]]), rounding=RoundingMode.STOCHASTIC)
    assert not np.array_equal(fake_quantize(x, "int8", key=7, **kw), fake_quantize(x, "int8", key=7 + 2**32, **kw))
    for bad in (2**63, -1, 1.0):
        with pytest.raises(ValueError, match=r"key must be an int in \[0, 2\*\*63\)"):
            fake_quantize(x, "int8", key=bad, **kw)


def test_stochastic_wide_keys_numpy_equals_torch():
    torch = pytest.importorskip("torch")
    key = 2**63 - 12345
    like = np.zeros(1, np.float32)
    assert np.array_equal(random_bits(key, (5, 7), like=torch.zeros(1)).numpy(), random_bits(key, (5, 7), like=like))
    x = _data((8, 32), seed=4)
    a = fake_quantize(x, "float8_e4m3fn", rounding=RoundingMode.STOCHASTIC, key=key)
    b = fake_quantize(torch.from_numpy(x), "float8_e4m3fn", rounding=RoundingMode.STOCHASTIC, key=key)
    assert np.array_equal(_bits(a), _bits(b))


# ---------------------------------------------------------------------------------------------------------------
# torch.Tensor subclasses stay torch
# ---------------------------------------------------------------------------------------------------------------


def test_torch_subclasses_come_back_as_torch():
    torch = pytest.importorskip("torch")

    class MyTensor(torch.Tensor):
        pass

    x = _data((4, 64), seed=5)
    ref = fake_quantize(x, "mxfp4")
    for t in (torch.from_numpy(x).as_subclass(MyTensor), torch.nn.Parameter(torch.from_numpy(x.copy()),
                                                                            requires_grad=False)):
        assert qcore._backend.is_torch(t)
        y = fake_quantize(t, "mxfp4")
        assert isinstance(y, torch.Tensor) and np.array_equal(_bits(y), _bits(ref))
        assert isinstance(cast(t, "float8_e4m3fn"), torch.Tensor)
        assert isinstance(quantize(t, "int8").codes, torch.Tensor)


# ---------------------------------------------------------------------------------------------------------------
# dequantize validates its QTensor
# ---------------------------------------------------------------------------------------------------------------


def test_dequantize_rejects_wrong_scale_shapes_and_dtypes():
    x = _data((4, 64), seed=6)
    q = quantize(x, "mxfp4")  # scales (4, 2)
    with pytest.raises(ValueError, match=r"QTensor.scales has shape \(2, 4\); .* needs \(4, 2\)"):
        dequantize(QTensor(q.codes, q.scales.T.copy(), None, q.spec))
    with pytest.raises(ValueError, match=r"QTensor.scales has shape \(4, 1\)"):
        dequantize(QTensor(q.codes, q.scales[:, :1], None, q.spec))
    with pytest.raises(ValueError, match="QTensor.scales is None"):
        dequantize(QTensor(q.codes, None, None, q.spec))
    # float64 scales: fine when float32 holds them exactly, refused otherwise
    assert np.array_equal(_bits(dequantize(QTensor(q.codes, q.scales.astype(np.float64), None, q.spec))),
                          _bits(dequantize(q)))
    qi = quantize(x, "int8", granularity=PerChannel(0))
    assert np.array_equal(dequantize(QTensor(qi.codes, qi.scales.astype(np.float64), None, qi.spec)),
                          dequantize(qi))
    with pytest.raises(ValueError, match=r"QTensor.scales must hold float32 values, got 0\.1 \(float64\)"):
        dequantize(QTensor(qi.codes, np.full((4, 1), 0.1), None, qi.spec))
    # E8M0 scales must be powers of two; float16 scale dtypes need float16 values
    with pytest.raises(ValueError, match=r"must be 2\*\*k with k in \[-127, 127\], got 0\.3"):
        dequantize(QTensor(q.codes, np.full((4, 2), 0.3, np.float32), None, q.spec))
    qh = quantize(x, "int8", granularity=PerChannel(0), scale_dtype="float16")
    with pytest.raises(ValueError, match=r"QTensor.scales must be float16 values .*got 0\.1"):
        dequantize(QTensor(qh.codes, np.full((4, 1), 0.1, np.float32), None, qh.spec))
    with pytest.raises(ValueError, match="positive"):
        dequantize(QTensor(qi.codes, -qi.scales, None, qi.spec))
    with pytest.raises(TypeError, match="QTensor.spec must be a QuantSpec"):
        dequantize(QTensor(q.codes, q.scales, None, "mxfp4"))


def test_dequantize_checks_codes():
    x = _data((4, 64), seed=7)
    q = quantize(x, "int4", granularity=PerGroup(32))
    with pytest.raises(ValueError, match=r"valid codes are -8\.\.7, got 9"):
        dequantize(QTensor(np.full((4, 64), 9, np.int8), q.scales, None, q.spec))
    with pytest.raises(TypeError, match="codes must be an integer array"):
        dequantize(QTensor(q.codes.astype(np.float32), q.scales, None, q.spec))
    with pytest.raises(TypeError, match="QTensor.codes must be a numpy array or a torch tensor"):
        dequantize(QTensor(q.codes.tolist(), q.scales, None, q.spec))


def test_dequantize_checks_zero_points():
    x = _data((4, 64), seed=8)
    q = quantize(x, "uint8", granularity=PerGroup(32))
    assert q.zero_points is not None
    with pytest.raises(ValueError, match="QTensor.zero_points is None, but the spec is asymmetric"):
        dequantize(QTensor(q.codes, q.scales, None, q.spec))
    with pytest.raises(ValueError, match="QTensor.zero_points must hold integers"):
        dequantize(QTensor(q.codes, q.scales, q.zero_points + np.float32(0.5), q.spec))
    with pytest.raises(ValueError, match=r"QTensor.zero_points must lie in the code range \[0, 255\]"):
        dequantize(QTensor(q.codes, q.scales, q.zero_points + np.float32(256), q.spec))
    with pytest.raises(ValueError, match=r"QTensor.zero_points has shape \(2, 4\)"):
        dequantize(QTensor(q.codes, q.scales, q.zero_points.T.copy(), q.spec))
    # integer zero points are exact
    assert np.array_equal(dequantize(QTensor(q.codes, q.scales, q.zero_points.astype(np.int32), q.spec)),
                          dequantize(q))
    s = quantize(x, "int8")
    with pytest.raises(ValueError, match="QTensor.zero_points must be None for a symmetric spec"):
        dequantize(QTensor(s.codes, s.scales, np.zeros_like(s.scales), s.spec))


def test_dequantize_checks_subblock_shifts():
    x = _data((4, 64), seed=9)
    q = quantize(x, "mx9")
    assert q.subblock_shifts.shape == (4, 32)
    with pytest.raises(ValueError, match=r"QTensor.subblock_shifts is None.*shape \(4, 32\)"):
        dequantize(QTensor(q.codes, q.scales, None, q.spec))
    with pytest.raises(ValueError, match=r"QTensor.subblock_shifts has shape \(32, 4\)"):
        dequantize(QTensor(q.codes, q.scales, None, q.spec, q.subblock_shifts.T.copy()))
    with pytest.raises(ValueError, match=r"subblock_shifts must lie in \[0, 1\], got 2"):
        dequantize(QTensor(q.codes, q.scales, None, q.spec, np.full_like(q.subblock_shifts, 2)))
    with pytest.raises(TypeError, match="subblock_shifts must be an integer array"):
        dequantize(QTensor(q.codes, q.scales, None, q.spec, q.subblock_shifts.astype(np.float32)))
    m = quantize(x, "mxfp4")
    with pytest.raises(ValueError, match="subblock_shifts must be None"):
        dequantize(QTensor(m.codes, m.scales, None, m.spec, q.subblock_shifts))


def test_dequantize_refuses_mixed_array_kinds():
    torch = pytest.importorskip("torch")
    x = _data((4, 64), seed=10)
    q = quantize(x, "mxfp4")
    with pytest.raises(TypeError, match="QTensor.scales is Tensor, but codes are a numpy array"):
        dequantize(QTensor(q.codes, torch.from_numpy(q.scales), None, q.spec))
    with pytest.raises(TypeError, match="QTensor.scales is ndarray, but codes are a torch tensor"):
        dequantize(QTensor(torch.from_numpy(q.codes), q.scales, None, q.spec))
    with pytest.raises(TypeError, match="scale is a torch tensor but x is a numpy array"):
        quantize(x, "int8", scale=torch.ones(1, 1))
    # float16 torch scales are exact: accepted
    qt = quantize(torch.from_numpy(x), "int8", granularity=PerChannel(0), scale_dtype="float16")
    ok = QTensor(qt.codes, qt.scales.to(torch.float16), None, qt.spec)
    assert torch.equal(dequantize(ok), dequantize(qt))


# ---------------------------------------------------------------------------------------------------------------
# given scales are rounded to the scale dtype
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sd", ["float8_e4m3fn", "float16", "bfloat16"])
def test_given_scales_are_rounded_to_the_scale_dtype(sd):
    x = _data((4, 64), seed=11)
    kw = dict(granularity=PerGroup(16), scale_dtype=sd)
    s = np.full((4, 4), 0.1, np.float32)
    q = quantize(x, "float4_e2m1fn", scale=s, **kw)
    assert np.array_equal(_bits(q.scales), _bits(cast(s, sd, saturate=True)))
    assert q.scales[0, 0] != np.float32(0.1)
    assert np.array_equal(_bits(dequantize(q)), _bits(fake_quantize(x, "float4_e2m1fn", scale=s, **kw)))
    # the same as passing the rounded scale
    assert np.array_equal(_bits(fake_quantize(x, "float4_e2m1fn", scale=q.scales, **kw)), _bits(dequantize(q)))


def test_given_scale_that_underflows_the_scale_dtype_stays_positive():
    x = np.float32([[1e-6, -2e-6]])
    q = quantize(x, "int8", scale=np.float32([[1e-12]]), scale_dtype="float8_e4m3fn")
    assert q.scales.item() == np.float32(2.0**-9)  # e4m3fn's smallest subnormal, as for computed scales


# ---------------------------------------------------------------------------------------------------------------
# asymmetric ranges wider than float32: one rule for dynamic and static
# ---------------------------------------------------------------------------------------------------------------


def test_asymmetric_range_wider_than_float32_max():
    from qcore.stats import RunningStats, scale_from_stats

    x = np.float32([[-3.0e38, 3.0e38, 1.0, 0.0]])
    for name in ("int8", "uint8", "int4"):
        spec = make_spec(name, symmetric=False)
        q = quantize(x, spec)
        n = spec.qmax - spec.qmin
        assert q.scales.item() == np.float32(6.0e38 / n)  # the correctly rounded (hi - lo) / (qmax - qmin)
        y = fake_quantize(x, spec)
        assert np.isfinite(y).all()
        p = scale_from_stats(RunningStats.from_array(x, PerTensor()), spec)
        assert np.array_equal(_bits(p.scale), _bits(q.scales))
        assert np.array_equal(_bits(fake_quantize(x, spec, **p.kwargs())), _bits(y))
    q = quantize(np.float32([-F32_MAX, F32_MAX]), "uint1")
    assert q.scales.item() == np.float32(F32_MAX)  # uint1: (hi - lo) / 1 saturates, like any scale


# ---------------------------------------------------------------------------------------------------------------
# RCEIL is NVIDIA's recipe: float32 quotient, then an exact power-of-two ceiling
# ---------------------------------------------------------------------------------------------------------------


def _rceil_byte(amax, maxv):
    q = float(np.float32(amax) / np.float32(maxv))
    if q == 0.0:
        return 0
    m, e = math.frexp(q)
    return min(max((e - 1 if m == 0.5 else e) + 127, 0), 254)


MX_MAX = {"mxfp8_e4m3": 448.0, "mxfp8_e5m2": 57344.0, "mxfp6_e2m3": 7.5, "mxfp6_e3m2": 28.0, "mxfp4": 6.0}


def _rceil_amaxes(maxv):
    base = np.float32(maxv * 2.0**-127)
    up = [base]
    for _ in range(3):
        up.append(np.nextafter(up[-1], np.float32(np.inf)))
    rng = np.random.default_rng(12)
    rand = (rng.uniform(1, 2, 200) * 2.0 ** rng.integers(-149, 127, 200)).astype(np.float32)
    tiny = (rng.integers(1, 2**20, 100) * 2.0**-149).astype(np.float32)
    return np.concatenate([np.array(up, np.float32), rand, tiny, np.float32([maxv, maxv * 2, 2.0**-149])])


@pytest.mark.parametrize("fmt", list(MX_MAX))
def test_rceil_matches_the_float32_quotient_recipe(fmt):
    maxv = MX_MAX[fmt]
    amax = _rceil_amaxes(maxv)
    x = np.zeros((amax.size, 32), np.float32)
    x[:, 3] = amax
    q = quantize(x, fmt, scale_mode=ScaleMode.RCEIL)
    got = (q.scales.view(np.uint32) >> 23).astype(np.int64)[:, 0]
    got = np.where(q.scales[:, 0] == np.float32(2.0**-127), 0, got)  # the subnormal 2**-127 is byte 0
    want = np.array([_rceil_byte(a, maxv) for a in amax])
    assert np.array_equal(got, want), (amax[got != want], got[got != want], want[got != want])
    # one ulp above max * 2**-127: the float32 quotient rounds to 2**-127, so byte 0 (an exact ceiling gives 1)
    assert got[1] == 0 and got[3] == 1


def test_rceil_matches_torchao():
    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    for fmt in ("mxfp8_e4m3", "mxfp4"):
        maxv = MX_MAX[fmt]
        amax = _rceil_amaxes(maxv)
        t = torch.from_numpy(amax.reshape(-1, 1))
        ref, _ = mx._to_mx_rceil(t, t.abs(), maxv)
        ref = ref.numpy().astype(np.int64).reshape(-1)
        x = np.zeros((amax.size, 32), np.float32)
        x[:, 0] = amax
        s = quantize(x, fmt, scale_mode=ScaleMode.RCEIL).scales[:, 0]
        got = np.where(s == np.float32(2.0**-127), 0, (s.view(np.uint32) >> 23).astype(np.int64))
        # torchao's eager fallback takes a float32 log2 of the quotient, which rounds to the integer k just above
        # 2**k (the float-log pitfall qcore avoids): compare elsewhere. The hardware instruction has no such step.
        qt = (amax / np.float32(maxv)).astype(np.float32)
        _, e = np.frexp(qt.astype(np.float64))
        frac = qt.astype(np.float64) / np.ldexp(1.0, e - 1) - 1.0
        log_rounds = (frac > 0) & (frac < 2.0**-15)
        assert not log_rounds[1] and got[1] == ref[1] == 0  # the documented edge: one ulp above max * 2**-127
        assert np.array_equal(got[~log_rounds], ref[~log_rounds])


@pytest.mark.slow
def test_rceil_torch_and_compiled_equal_numpy():
    torch = pytest.importorskip("torch")
    amax = _rceil_amaxes(448.0)
    x = np.zeros((amax.size, 32), np.float32)
    x[:, 5] = amax
    x[:, 6] = -amax / 3
    ref = fake_quantize(x, "mxfp8_e4m3", scale_mode=ScaleMode.RCEIL)
    t = torch.from_numpy(x)
    assert np.array_equal(_bits(fake_quantize(t, "mxfp8_e4m3", scale_mode=ScaleMode.RCEIL)), _bits(ref))
    assert np.array_equal(_bits(fake_quantize(t, "mxfp8_e4m3", scale_mode=ScaleMode.RCEIL, compile=True)),
                          _bits(ref))


# ---------------------------------------------------------------------------------------------------------------
# QuantSpec integer fields
# ---------------------------------------------------------------------------------------------------------------


def test_quantspec_integer_fields_are_validated():
    base = make_spec("mxint8")
    spec = make_spec("mxint8", unit_exponent=np.int64(-6))
    assert spec == base and type(spec.unit_exponent) is int
    with pytest.raises(TypeError, match=r"QuantSpec.unit_exponent must be an int, got -5\.5"):
        make_spec("mxint8", unit_exponent=-5.5)
    with pytest.raises(TypeError, match="QuantSpec.unit_exponent must be an int, got True"):
        make_spec("mxint8", unit_exponent=True)
    with pytest.raises(ValueError, match=r"unit_exponent must be in \[-126, 121\] for int8 .*got -200"):
        make_spec("mxint8", unit_exponent=-200)
    with pytest.raises(ValueError, match=r"\[-126, 121\].*got 122"):
        make_spec("mxint8", unit_exponent=122)
    make_spec("mxint8", unit_exponent=121)
    with pytest.raises(TypeError, match=r"QuantSpec.subblock_size must be an int, got 2\.0"):
        make_spec("mx9", subblock_size=2.0)
    with pytest.raises(ValueError, match="subblock_size must be >= 1, got 0"):
        make_spec("mx9", subblock_size=0)
    with pytest.raises(ValueError, match=r"subblock_shift_bits must be in \[0, 7\].*got 8"):
        make_spec("mx9", subblock_shift_bits=8)
    assert make_spec("mx9", subblock_size=np.int32(2)) == make_spec("mx9")
    with pytest.raises(TypeError, match="QuantSpec.name must be a str"):
        QuantSpec("int8", name=3)


# ---------------------------------------------------------------------------------------------------------------
# straight-through gradients
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,kw,compile", [
    ("mxfp4", {}, False), pytest.param("mxfp4", {}, True, marks=pytest.mark.slow),
    ("int4", {"granularity": PerGroup(32)}, False),
    pytest.param("int4", {"granularity": PerGroup(32)}, True, marks=pytest.mark.slow),
    ("uint8", {}, False), ("mx6", {}, False),
    ("float8_e4m3fn", {"rounding": RoundingMode.STOCHASTIC, "key": 3}, False),
])
def test_fake_quantize_gradient_is_straight_through(fmt, kw, compile):
    torch = pytest.importorskip("torch")
    x0 = _data((4, 64), seed=13) * 4
    x = torch.from_numpy(x0).requires_grad_(True)
    y = fake_quantize(x, fmt, compile=compile, **kw)
    assert y.requires_grad
    assert np.array_equal(_bits(y), _bits(fake_quantize(x0, fmt, **kw)))  # the forward is unchanged
    g = torch.from_numpy(_data((4, 64), seed=14))
    (y * g).sum().backward()
    assert torch.equal(x.grad, g)


def test_gradient_flows_to_low_precision_inputs_and_not_to_scales():
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(_data((4, 32), seed=15)).to(torch.bfloat16).requires_grad_(True)
    scale = torch.full((4, 1), 0.05, requires_grad=True)
    y = fake_quantize(x, "int8", granularity=PerChannel(0), scale=scale)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, torch.ones_like(x))
    assert scale.grad is None  # scales and zero points are constants: no gradient
    with torch.no_grad():
        assert not fake_quantize(x, "int8").requires_grad
    q = quantize(torch.from_numpy(_data((4, 32))).requires_grad_(True), "int8")
    assert not q.scales.requires_grad  # a QTensor holds no autograd graph


def test_import_qcore_does_not_import_torch_or_the_gradient_module():
    code = ("import sys, numpy as np, qcore\n"
            "qcore.fake_quantize(np.ones((2, 32), np.float32), 'mxfp4')\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert 'qcore._grad' not in sys.modules, 'qcore._grad imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---------------------------------------------------------------------------------------------------------------
# inputs: lists, ml_dtypes floats
# ---------------------------------------------------------------------------------------------------------------


def test_lists_of_numbers_are_float32_values():
    assert cast([1, 2, 3], "float4_e2m1fn").tolist() == [1.0, 2.0, 3.0]
    assert cast([[1, 5]], "float4_e2m1fn").dtype == np.float32
    assert np.array_equal(fake_quantize([[1, 2, 3, 40]], "int8"), fake_quantize(np.float32([[1, 2, 3, 40]]), "int8"))
    with pytest.raises(TypeError, match="x must be a floating-point array .*dtype int64"):
        cast(np.array([1, 2, 3]), "float4_e2m1fn")
    with pytest.raises(TypeError, match="dtype bool"):
        cast([True, False], "float4_e2m1fn")


def test_ml_dtypes_float_arrays_are_accepted_exactly():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for name in ("float8_e4m3fn", "float8_e5m2", "bfloat16", "float4_e2m1fn", "float8_e8m0fnu"):
        t = getattr(ml_dtypes, name, None)
        if t is None:
            continue
        a = np.arange(256, dtype=np.uint8 if np.dtype(t).itemsize == 1 else np.uint16)
        if np.dtype(t).itemsize == 1 and name == "float4_e2m1fn":
            a = a[:16]
        v = a.view(t) if np.dtype(t).itemsize == a.dtype.itemsize else a.astype(np.float32).astype(t)
        f = v.astype(np.float32)
        assert np.array_equal(_bits(cast(v, "float32")), _bits(cast(f, "float32")))
        finite = np.isfinite(f)
        assert np.array_equal(_bits(fake_quantize(v[finite].reshape(1, -1), "int8")),
                              _bits(fake_quantize(f[finite].reshape(1, -1), "int8")))
    with pytest.raises(TypeError, match="dtype int4"):
        cast(np.array([1, 2], dtype=ml_dtypes.int4), "float8_e4m3fn")


# ---------------------------------------------------------------------------------------------------------------
# quantize <-> _microexp: one-way dependency
# ---------------------------------------------------------------------------------------------------------------


def _imports(path):
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out.add(("." * node.level) + (node.module or ""))
    return out


def test_microexp_and_elements_do_not_import_quantize():
    for mod in ("_microexp.py", "_elements.py"):
        assert not {".quantize", "qcore.quantize"} & _imports(ROOT / "src" / "qcore" / mod), mod


# ---------------------------------------------------------------------------------------------------------------
# compile=True: bad calls never reach the compiled function, and a failing call does not disable it
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_bad_call_raises_before_compiling_and_keeps_compilation():
    torch = pytest.importorskip("torch")
    from qcore import _compiled
    from qcore.quantize import _fake_quantize_pure

    x = torch.from_numpy(_data((8, 64), seed=16))
    spec = make_spec("int4", granularity=PerGroup(32))
    key = (_fake_quantize_pure.__qualname__, spec)
    _compiled._MEMO.pop(key, None)
    with pytest.raises(ValueError, match=r"scale has shape \(3, 3\)"):
        fake_quantize(x, spec, scale=torch.ones(3, 3), compile=True)
    with pytest.raises(ValueError, match="zero_point=1 was given for a symmetric spec"):
        fake_quantize(x, spec, scale=torch.ones(8, 2), zero_point=1, compile=True)
    with pytest.raises(ValueError, match="at least one dimension"):
        fake_quantize(x[0, 0], spec, compile=True)  # PerGroup on a 0-d tensor
    assert key not in _compiled._MEMO  # validation happened before anything was compiled
    y = fake_quantize(x, spec, compile=True)
    entry = _compiled._MEMO[key]
    assert entry.fast is not None and entry.failures == 0
    assert torch.equal(y.view(torch.int32), fake_quantize(x, spec).view(torch.int32))


def test_compiled_failure_falls_back_for_that_call_only():
    from qcore._compiled import _MAX_FAILURES, _Entry, _Guarded

    calls = []

    def fast(v):
        calls.append(v)
        if v < 0:
            raise RuntimeError("inductor says no")
        return ("fast", v)

    entry = _Entry(fast)
    g = _Guarded(entry, lambda v: ("eager", v))
    with pytest.warns(RuntimeWarning, match="this call runs eager"):
        assert g(-1) == ("eager", -1)
    assert g(2) == ("fast", 2) and entry.fast is fast and entry.failures == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once already
        assert g(-1) == ("eager", -1)
    assert entry.fast is fast
    for _ in range(_MAX_FAILURES - 2):
        g(-1)
    with pytest.warns(RuntimeWarning, match="from now on"):
        g(-1)
    assert entry.fast is None and g(5) == ("eager", 5)

    def user_error(v):
        raise ValueError("bad data")

    with pytest.raises(ValueError, match="bad data"):
        _Guarded(_Entry(user_error), lambda v: v)(1)

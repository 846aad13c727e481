"""quantize / dequantize / fake_quantize: OCP MX rules, granularities, integer schemes, edge blocks, errors."""

import math

import numpy as np
import pytest

import qcore
from qcore import PerBlock, PerChannel, PerGroup, PerTensor, ScaleMode, dequantize, fake_quantize, quantize

ml_dtypes = pytest.importorskip("ml_dtypes")

MX_ELEMENTS = {
    "mxfp8_e4m3": ("float8_e4m3fn", 8, 448.0),
    "mxfp8_e5m2": ("float8_e5m2", 15, 57344.0),
    "mxfp6_e2m3": ("float6_e2m3fn", 2, 7.5),
    "mxfp6_e3m2": ("float6_e3m2fn", 4, 28.0),
    "mxfp4": ("float4_e2m1fn", 2, 6.0),
}


def rceil_exponent(amax, maxv):
    """NVIDIA's RCEIL recipe, independently: the quotient amax / max rounded to float32 (numpy's float32
    division), then the exact ceil(log2) of that float32 (Python's frexp); -127 for a zero quotient."""
    q = float(np.float32(amax) / np.float32(maxv))
    if q == 0.0:
        return -127
    m, e = math.frexp(q)  # q = m * 2**e, 0.5 <= m < 1
    return e - 1 if m == 0.5 else e


def ocp_mx_reference(x, fmt, mode="floor"):
    """Independent OCP MX v1.0 reference: Python's exact frexp for the exponent, ml_dtypes for the elements,
    float64 arithmetic (exact here), blocks of 32 along the last axis."""
    el, emax, maxv = MX_ELEMENTS[fmt]
    xb = x.reshape(-1, 32).astype(np.float64)
    out = np.empty_like(xb)
    for i, blk in enumerate(xb):
        amax = np.max(np.abs(blk))
        if amax == 0:
            e = -127 + emax  # scale byte 0
        else:
            e = math.frexp(amax)[1] - 1
            if mode == "ceil" and amax != 2.0**e:
                e += 1
            if mode == "rceil":
                e = rceil_exponent(amax, maxv) + emax
        s = min(max(e - emax, -127), 127)
        scale = 2.0**s
        v = np.clip(blk / scale, -maxv, maxv).astype(np.float32).astype(getattr(ml_dtypes, el)).astype(np.float64)
        out[i] = v * scale
    return out.astype(np.float32).reshape(x.shape)


def _data(shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.exp(rng.uniform(-8, 8, shape[:-1] + (1,))).astype(np.float32)
    return x


@pytest.mark.parametrize("fmt", list(MX_ELEMENTS))
@pytest.mark.parametrize("mode", ["floor", "ceil", "rceil"])
def test_mx_matches_independent_ocp_reference(fmt, mode):
    x = _data((8, 128))
    m = {"floor": ScaleMode.FLOOR, "ceil": ScaleMode.CEIL, "rceil": ScaleMode.RCEIL}[mode]
    got = fake_quantize(x, fmt, scale_mode=m)
    assert np.array_equal(got.view(np.uint32), ocp_mx_reference(x, fmt, mode).view(np.uint32))


def test_mx_scale_edges():
    # Block 0: all zeros -> E8M0 byte 0 (2**-127), exact zeros out.
    # Block 1: one outlier -> everything else flushes to 0 in mxfp4.
    # Block 2: amax just below a power of two (2 - ulp): floor(log2) must be 0, not 1 (float log2 gives 1).
    # Block 3: a NaN -> the whole block NaN, scale NaN.
    x = np.zeros((4, 32), np.float32)
    x[1, 0] = 1000.0
    x[1, 1:] = 0.01
    x[2, :] = np.nextafter(np.float32(2), np.float32(0))
    x[3, 5] = np.nan
    q = quantize(x, "mxfp4")
    assert q.scales[0, 0] == np.float32(2.0**-127)
    assert np.all(dequantize(q)[0] == 0)
    # 1000 -> e 9, scale 2**7, 7.8 saturates to 6 (FLOOR clamps): 768
    assert np.all(dequantize(q)[1, 1:] == 0) and dequantize(q)[1, 0] == 768.0
    assert q.scales[2, 0] == 0.25  # 2**(0 - emax 2)
    assert np.all(np.isnan(fake_quantize(x, "mxfp8_e4m3")[3]))
    assert np.isnan(qcore.quantize(x[:3], "mxfp8_e4m3").scales).sum() == 0


def test_mx_inf_makes_block_nan():
    x = np.ones((1, 32), np.float32)
    x[0, 3] = np.inf
    assert np.all(np.isnan(fake_quantize(x, "mxfp8_e4m3")))


def test_even_scale_mode_bumps_exactly_when_amax_rounds_up_a_binade():
    # mxfp4: amax 7.0 -> e = 2, 3 bits of precision: 7 = 1.11b * 4 rounds (RNE to 1 mantissa bit) to 8 -> e 3
    x = np.zeros((3, 32), np.float32)
    x[0, 0] = 7.0   # rounds up to 8: scale 2**(3-2) = 2
    x[1, 0] = 5.9   # 1.0111.. * 4 -> rounds to 1.1 * 4 = 6: stays, scale 1
    x[2, 0] = 6.0   # tie? 1.1b exactly -> no rounding, scale 1
    q = quantize(x, "mxfp4", scale_mode=ScaleMode.EVEN)
    assert q.scales[:, 0].tolist() == [2.0, 1.0, 1.0]


def test_mxint8_and_bfp16():
    x = _data((4, 64), seed=3)
    y = fake_quantize(x, "mxint8")
    # independent: scale 2**floor(log2 amax), codes round(x / scale * 64) clamped to +-127
    xb = x.reshape(-1, 32).astype(np.float64)
    e = np.array([math.frexp(a)[1] - 1 for a in np.abs(xb).max(1)])[:, None]
    ref = np.clip(np.rint(xb / 2.0**e * 64), -127, 127) / 64 * 2.0**e
    assert np.array_equal(y, ref.astype(np.float32).reshape(x.shape))
    q = quantize(x, "mxint8")
    assert q.codes.dtype == np.int8 and int(np.abs(q.codes).max()) <= 127
    assert np.array_equal(dequantize(q), y)


def test_ragged_groups_quark_cannot_do():
    """Hidden size 576 with group 128: 5 groups, the last one of 64; padding never leaks into results."""
    x = _data((3, 576), seed=1)
    q = quantize(x, "int4", granularity=PerGroup(128))
    assert q.scales.shape == (3, 5)
    last = x[:, 512:]
    expect = np.abs(last).max(1) / np.float32(7.5)
    assert np.array_equal(q.scales[:, 4], expect.astype(np.float32))
    assert q.codes.shape == x.shape
    assert np.array_equal(dequantize(q), fake_quantize(x, "int4", granularity=PerGroup(128)))


@pytest.mark.parametrize("gran,sshape", [
    (PerTensor(), (1, 1, 1)),
    (PerChannel(0), (2, 1, 1)),
    (PerChannel(-1), (1, 1, 40)),
    (PerGroup(16, axis=1), (2, 2, 40)),
    (PerBlock((8, 16)), (2, 3, 3)),
])
def test_granularity_scale_shapes_and_values(gran, sshape):
    x = _data((2, 24, 40), seed=2)
    q = quantize(x, "int8", granularity=gran)
    assert q.scales.shape == sshape
    # each scale equals absmax of its tile / 127.5 (the Quark / torch.ao / compressed-tensors divisor)
    tile = qcore.granularity.tile_shape(gran, x.shape)
    idx = tuple(slice(0, t) for t in tile)
    assert q.scales[(0,) * 3] == np.float32(np.abs(x[idx]).max() / np.float32(127.5))


def test_asymmetric_uint4():
    x = np.float32([[0.5, 1.0, 2.0, 3.0]])
    q = quantize(x, "uint4", symmetric=False)
    # range widened to include 0: [0, 3] -> scale 0.2, zero point 0
    assert q.scales[0, 0] == np.float32(3.0 / 15) and q.zero_points[0, 0] == 0
    x = np.float32([[-1.0, 0.5, 2.0]])
    q = quantize(x, "uint8", symmetric=False)
    s = np.float32(3.0) / np.float32(255)
    assert q.scales[0, 0] == s and q.zero_points[0, 0] == np.rint(np.float32(1.0) / s)
    assert np.abs(dequantize(q) - x).max() <= s / 2 + 1e-7


def test_static_scale_and_saturation():
    x = np.float32([[0.1, -0.2, 5.0]])
    q = quantize(x, "int8", scale=np.float32([[0.01]]))
    assert q.codes.tolist() == [[10, -20, 127]]  # 500 clamps to 127
    with pytest.raises(ValueError, match="shape"):
        quantize(x, "int8", granularity=PerChannel(1), scale=np.ones((1, 2), np.float32))
    with pytest.raises(ValueError, match="zero_point"):
        quantize(x, "uint8", symmetric=False, scale=np.float32([[0.01]]))


def test_float_element_scales():
    x = _data((4, 64), seed=4)
    q = quantize(x, "float8_e4m3fn", granularity=PerChannel(0))
    assert np.array_equal(q.scales[:, 0], (np.abs(x).max(1) / np.float32(448)).astype(np.float32))
    assert q.codes.dtype == np.uint8
    # NVFP4-like: fp4 elements, groups of 16, e4m3 scales
    q = quantize(x, "float4_e2m1fn", granularity=PerGroup(16), scale_dtype="float8_e4m3fn")
    assert np.array_equal(qcore.cast(q.scales, "float8_e4m3fn"), q.scales)
    assert np.abs(dequantize(q)).max() <= np.abs(x).max() * 1.07


def test_stochastic_rounding_is_reproducible_and_unbiased():
    x = np.full((64, 64), 0.3, np.float32)
    a = fake_quantize(x, "int8", scale=np.float32([[1.0]]), rounding=qcore.RoundingMode.STOCHASTIC, key=7)
    b = fake_quantize(x, "int8", scale=np.float32([[1.0]]), rounding=qcore.RoundingMode.STOCHASTIC, key=7)
    assert np.array_equal(a, b) and set(np.unique(a)) == {0.0, 1.0}
    assert abs(a.mean() - 0.3) < 5 * math.sqrt(0.21 / a.size)


def test_empty_arrays():
    for fmt in ["mxfp4", "int4", "float8_e4m3fn"]:
        x = np.zeros((0, 64), np.float32)
        assert fake_quantize(x, fmt).shape == (0, 64)
        assert dequantize(quantize(x, fmt)).shape == (0, 64)


def test_errors():
    x = np.ones((4, 32), np.float32)
    with pytest.raises(ValueError, match="unknown dtype"):
        quantize(x, "mxfp5")
    with pytest.raises(TypeError, match="floating"):
        quantize(np.ones((4, 32), np.int32), "mxfp4")
    with pytest.raises(ValueError, match="out of range"):
        quantize(x, "mxfp4", axis=2)
    with pytest.raises(ValueError, match="positive"):
        quantize(x, "int4", granularity=PerGroup(0))
    with pytest.raises(ValueError, match="integer dtype"):
        quantize(x, "float8_e4m3fn", symmetric=False)
    with pytest.raises(TypeError, match="unknown QuantSpec field"):
        quantize(x, "int4", group=32)
    with pytest.raises(TypeError, match="QTensor"):
        dequantize(x)


def test_block_axis_and_spec_objects():
    x = _data((64, 8), seed=5)
    a = fake_quantize(x, "mxfp4", axis=0)
    b = fake_quantize(x.T.copy(), "mxfp4").T
    assert np.array_equal(a, b)
    spec = qcore.make_spec("mxfp6_e2m3", axis=0)
    assert spec.granularity == PerGroup(32, 0) and spec.scale_dtype.name == "float8_e8m0fnu"
    with pytest.raises(Exception):
        spec.symmetric = False  # frozen


FORMATS = [("mxfp4", {}), ("mxfp8_e4m3", {}), ("mxfp6_e3m2", {}), ("mxint8", {}), ("bfp16", {}),
           ("float8_e4m3fn", {}), ("int4", {"granularity": PerGroup(24)}),
           ("uint4", {"granularity": PerGroup(24), "symmetric": False}), ("int8", {"granularity": PerChannel(0)})]


@pytest.mark.parametrize("fmt,kw", FORMATS, ids=[f[0] for f in FORMATS])
def test_torch_bit_identical_and_dequantize_equals_fake_quantize(fmt, kw):
    torch = pytest.importorskip("torch")
    x = _data((6, 96), seed=6)
    qa = quantize(x, fmt, **kw)
    qb = quantize(torch.from_numpy(x), fmt, **kw)
    assert np.array_equal(qa.codes, qb.codes.numpy())
    assert np.array_equal(qa.scales.view(np.uint32), qb.scales.numpy().view(np.uint32))
    ya = fake_quantize(x, fmt, **kw)
    assert np.array_equal(ya.view(np.uint32), dequantize(qa).view(np.uint32))
    assert np.array_equal(ya.view(np.uint32), fake_quantize(torch.from_numpy(x), fmt, **kw).numpy().view(np.uint32))


@pytest.mark.slow
def test_compiled_path_bit_identical():
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(_data((16, 128), seed=8))
    for fmt in ["mxfp4", "int4"]:
        kw = {"granularity": PerGroup(32)} if fmt == "int4" else {}
        a = fake_quantize(x, fmt, compile=True, **kw)
        b = fake_quantize(x, fmt, **kw)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_stochastic_key_may_be_a_seeded_generator():
    torch = pytest.importorskip("torch")
    x = np.full((8, 32), 0.3, np.float32)
    kw = dict(scale=np.float32([[1.0]]), rounding=qcore.RoundingMode.STOCHASTIC)
    a = fake_quantize(x, "int8", key=np.random.default_rng(5), **kw)
    b = fake_quantize(x, "int8", key=np.random.default_rng(5), **kw)
    assert np.array_equal(a, b) and set(np.unique(a)) == {0.0, 1.0}
    c = fake_quantize(torch.from_numpy(x), "int8", key=torch.Generator().manual_seed(5), **kw)
    d = fake_quantize(torch.from_numpy(x), "int8", key=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(c, d)
    g = np.random.default_rng(5)
    assert not np.array_equal(fake_quantize(x, "int8", key=g, **kw), fake_quantize(x, "int8", key=g, **kw))
    with pytest.raises(ValueError, match="Generator"):
        fake_quantize(x, "int8", key=-1, **kw)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3", "mxint8", "mx6", "bfp16"])
def test_scale_codes_are_the_e8m0_bytes(fmt):
    from qcore.testing import probes

    x = probes(fmt)  # NaN/Inf blocks (scale NaN -> 0xFF) and zero blocks (2**-127 -> 0x00) included
    q = quantize(x, fmt)
    c = q.scale_codes
    ref = np.asarray(q.scales).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    assert c.dtype == np.uint8 and c.shape == q.scales.shape and np.array_equal(c, ref)
    assert (c == 0xFF).any() and (c == 0).any()
    torch = pytest.importorskip("torch")
    qt = quantize(torch.from_numpy(x), fmt)
    ct = qt.scale_codes
    assert ct.dtype == torch.uint8 and np.array_equal(ct.numpy(), ref)


def test_scale_codes_of_other_scale_formats():
    w = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    q = quantize(w, "float4_e2m1fn", granularity=PerGroup(16), scale_dtype="float8_e4m3fn")  # NVFP4-like
    assert np.array_equal(q.scale_codes, q.scales.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    q16 = quantize(w, "int8", granularity=PerChannel(0), scale_dtype="bfloat16")
    assert q16.scale_codes.dtype == np.int32
    assert np.array_equal(q16.scale_codes, q16.scales.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.int32))
    q32 = quantize(w, "int8")
    assert np.array_equal(q32.scale_codes, np.asarray(q32.scales, np.float32).view(np.int32))
    bad = np.array([[1.0, np.nan, 2.0, 3.0]], np.float32)
    qe = quantize(bad, "float8_e4m3fn", granularity=PerTensor(), scale_dtype="float8_e5m3")
    with pytest.raises(ValueError, match="NaN"):
        qe.scale_codes

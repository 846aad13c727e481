"""MX9 / MX6 / MX4, bfp16 and MXINT8 against the independent Quark oracle (tests/qcore/quark_reference.py,
checked bit for bit against Quark 0.13's own code; see docs/quark_block_semantics.md).

Where qcore deliberately differs from Quark the tests state the difference and check it:
- NaN/Inf: qcore makes the whole block NaN (OCP MX rule); Quark-Torch passes NaN/Inf through or zeroes them.
- Subnormal inputs: kept by qcore; Quark-Torch flushes them to +0 before MX9/MX6.
- bfp16 exponent: from the bits (exact); Quark-Torch uses float32 log2, one binade high just below some powers
  of two. MXINT8: OCP FLOOR scale and codes in [-127, 127]; Quark-Torch's default "even" rounds amax to 8
  significant bits, Quark-ONNX allows code -128.
"""

import numpy as np
import pytest

from qcore import ScaleMode, dequantize, fake_quantize, quantize

import quark_reference as qr  # noqa: E402  (tests/qcore is on sys.path via rootdir conftest)


def data(shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, shape[:-1] + (1,)))
    x = x.astype(np.float32)
    x[0, :16] = 0.0                                  # an all-zero block
    x[1, 5] = 1e3 * np.abs(x[1]).max()               # a one-outlier block
    x[2, 16:32] = np.float32(2.0**5 * 127.9 / 64)    # rounds to code 128: bfp16 bumps its exponent
    return x


def same_bits(a, b):
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


@pytest.mark.parametrize("fmt,ref,impl", [
    ("mx9", qr.quark_mx9, "torch"), ("mx6", qr.quark_mx6, "torch"),
    ("mx9", qr.quark_mx9, "onnx"), ("mx6", qr.quark_mx6, "onnx"), ("mx4", qr.quark_mx4, "onnx"),
])
def test_shared_microexponent_formats_match_quark(fmt, ref, impl):
    x = data((32, 256), seed=1)
    assert same_bits(fake_quantize(x, fmt), ref(x, impl=impl))


def test_mx9_codes_scales_and_shifts():
    x = np.zeros((1, 16), np.float32)
    x[0, 0] = 1.0            # block exponent 0
    x[0, 2:4] = [0.3, -0.2]  # both below 2**0: this pair shifts down one step (finer grid)
    x[0, 4:6] = [1.5, 0.01]  # pair with an element at the block exponent: no shift
    q = quantize(x, "mx9")
    assert q.scales.tolist() == [[1.0]]
    assert q.subblock_shifts.tolist() == [[0, 1, 0, 1, 1, 1, 1, 1]]
    y = dequantize(q)
    assert y[0, 2] == np.float32(round(0.3 * 128) / 128) and y[0, 3] == np.float32(-round(0.2 * 128) / 128)
    assert y[0, 5] == np.float32(round(0.01 * 64) / 64)  # unshifted pair: step 2**-6
    assert same_bits(y, fake_quantize(x, "mx9"))
    # sign-magnitude elements keep -0, like Quark: -0.001 in a block of 1.0 rounds to -0
    x[0, 6] = -0.001
    assert np.signbit(fake_quantize(x, "mx9")[0, 6])


def test_bfp16_matches_quark_torch_including_exponent_bump():
    x = data((32, 256), seed=2)
    y = fake_quantize(x, "bfp16")
    assert same_bits(y, qr.quark_bfp16(x, impl="torch"))
    assert quantize(x, "bfp16").scales[2, 2] == 2.0**6  # bumped from 2**5


def test_bfp16_where_quark_torch_uses_float_log2():
    """Just below 2**k, float32 log2 rounds up to k: Quark-Torch picks a scale one binade too big and loses
    precision; qcore reads the exponent from the bits."""
    x = np.full((1, 8), np.float32(np.nextafter(np.float32(2.0**20), np.float32(0))))
    x[0, 1:] = 1.0
    ours = fake_quantize(x, "bfp16")
    theirs = qr.quark_bfp16(x, impl="torch")
    assert np.abs(ours - x).sum() <= np.abs(theirs - x).sum()


def test_mxint8_matches_quark_onnx_except_code_minus_128():
    x = data((32, 256), seed=3)
    ours = fake_quantize(x, "mxint8")
    theirs = qr.quark_mxint8(x, impl="onnx")
    differ = ours.view(np.uint32) != theirs.view(np.uint32)
    # Quark-ONNX lets code -128 through; qcore (OCP, microxcaling, Quark-Torch) clamps to -127.
    q = quantize(x, "mxint8")
    scale = np.repeat(q.scales, 32, axis=1)
    assert np.all(theirs[differ] == -2.0 * scale[differ])
    assert np.all(q.codes[differ] == -127)


def test_mxint8_even_mode_vs_quark_torch():
    """Quark-Torch's default MXINT8 scale rounds amax to 8 significant bits before taking the exponent; qcore's
    EVEN rounds to the element's own precision (7 bits: code 127.5 -> 128 overflows). They agree away from the
    window [2 - 2**-7, 2 - 2**-9) * 2**e of the block max."""
    x = data((32, 256), seed=4)
    m = np.abs(x.reshape(-1, 32)).max(1)
    frac = m / 2.0 ** np.floor(np.log2(m.astype(np.float64)))
    keep = ~((frac >= 2 - 2**-7) & (frac < 2 - 2**-9))
    keep = np.repeat(keep, 32).reshape(x.shape)
    ours = fake_quantize(x, "mxint8", scale_mode=ScaleMode.EVEN)
    theirs = qr.quark_mxint8(x, impl="torch")
    assert same_bits(ours[keep], theirs[keep])


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2"])
def test_mx_even_scale_mode_matches_quark(fmt):
    el = {"mxfp4": "fp4", "mxfp6_e2m3": "fp6_e2m3", "mxfp6_e3m2": "fp6_e3m2", "mxfp8_e4m3": "fp8_e4m3",
          "mxfp8_e5m2": "fp8_e5m2"}[fmt]
    x = data((16, 256), seed=5)
    x[0, :16] = 1.0  # Quark gives all-zero blocks a different (irrelevant) scale; keep blocks non-zero
    ours = fake_quantize(x, fmt, scale_mode=ScaleMode.EVEN)
    theirs = qr.quark_mx_fp(x, element=el, mode="even")
    assert same_bits(np.where(ours == 0, 0, ours), np.where(theirs == 0, 0, theirs))


def test_microexp_nan_block_and_torch_identity():
    torch = pytest.importorskip("torch")
    x = data((4, 64), seed=6)
    x[3, 20] = np.nan
    y = fake_quantize(x, "mx6")
    assert np.all(np.isnan(y[3, 16:32])) and not np.isnan(y[3, :16]).any()
    t = fake_quantize(torch.from_numpy(x), "mx6").numpy()
    assert same_bits(np.nan_to_num(y), np.nan_to_num(t))
    qa, qb = quantize(x, "mx4"), quantize(torch.from_numpy(x), "mx4")
    assert np.array_equal(qa.codes, qb.codes.numpy())
    assert np.array_equal(qa.subblock_shifts, qb.subblock_shifts.numpy())


def test_microexp_other_axis_and_ragged():
    x = data((40, 24), seed=7)  # blocks of 16 along axis 0: 40 = 16 + 16 + 8
    a = fake_quantize(x, "mx9", axis=0)
    b = fake_quantize(np.ascontiguousarray(x.T), "mx9").T
    assert same_bits(a, b)
    assert same_bits(dequantize(quantize(x, "mx9", axis=0)), a)

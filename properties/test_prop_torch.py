"""numpy (the oracle) == torch (the fast path), bit for bit: casts, codes, quantize / dequantize / fake_quantize.

torch is imported inside each test with ``pytest.importorskip``; the numpy path never imports it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qcore
from qcore import RoundingMode, cast, decode, dequantize, encode, fake_quantize, quantize

from ._specs import BLOCK_FORMATS, quant_cases, require_block_format
from ._util import FLOAT_FORMATS, assert_same_bits, assert_same_ints, cast_inputs, examples

_KEY = st.integers(0, 2**63 - 1)


def _torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("name", FLOAT_FORMATS)
@given(data=st.data(), mode=st.sampled_from(list(RoundingMode)), saturate=st.sampled_from([None, True]),
       key=_KEY)
@settings(max_examples=examples(0.1))
def test_cast_numpy_equals_torch(name, data, mode, saturate, key):
    torch = _torch()
    x = data.draw(cast_inputs(name))
    k = key if mode is RoundingMode.STOCHASTIC else None
    a = cast(x, name, rounding=mode, saturate=saturate, key=k)
    b = cast(torch.from_numpy(x.copy()), name, rounding=mode, saturate=saturate, key=k)
    assert isinstance(b, torch.Tensor) and b.dtype == torch.float32
    assert_same_bits(b, a, f"cast {name} {mode.name} saturate={saturate}: torch != numpy", x)


@pytest.mark.parametrize("name", [n for n in FLOAT_FORMATS if n != "float32"])
@given(data=st.data())
@settings(max_examples=examples(0.1))
def test_encode_decode_numpy_equals_torch(name, data):
    torch = _torch()
    d = qcore.get_dtype(name)
    x = data.draw(cast_inputs(name))
    if not d.has_nan:
        x = x[~np.isnan(x)]
    ca = encode(x, name)
    cb = encode(torch.from_numpy(x.copy()), name)
    assert_same_ints(cb, ca, f"encode {name}: torch != numpy")
    assert_same_bits(decode(cb, name), decode(ca, name), f"decode {name}: torch != numpy")


@pytest.mark.parametrize("name", ["int8", "int4", "uint8", "int16", "uint3"])
@given(data=st.data())
@settings(max_examples=examples(0.05, minimum=8))
def test_integer_cast_and_codes_numpy_equal_torch(name, data):
    torch = _torch()
    x = data.draw(cast_inputs("float32"))
    assert_same_bits(cast(torch.from_numpy(x.copy()), name), cast(x, name), f"cast {name}", x)
    x = x[~np.isnan(x)]
    assert_same_ints(encode(torch.from_numpy(x.copy()), name), encode(x, name), f"encode {name}")


def _assert_qtensors_equal(qt, qn, what):
    assert_same_ints(qt.codes, qn.codes, f"{what}: codes")
    assert_same_bits(qt.scales, qn.scales, f"{what}: scales")
    assert (qt.zero_points is None) == (qn.zero_points is None)
    if qn.zero_points is not None:
        assert_same_bits(qt.zero_points, qn.zero_points, f"{what}: zero points")
    assert (qt.subblock_shifts is None) == (qn.subblock_shifts is None)
    if qn.subblock_shifts is not None:
        assert_same_ints(qt.subblock_shifts, qn.subblock_shifts, f"{what}: subblock shifts")
    assert (qt.tensor_scale is None) == (qn.tensor_scale is None)
    if qn.tensor_scale is not None:
        assert_same_bits(qt.tensor_scale, qn.tensor_scale, f"{what}: tensor scale")


@given(case=quant_cases(finite=False, allow_huge=True), key=_KEY, sr=st.booleans())
@settings(max_examples=examples(0.75))
def test_quantize_dequantize_fake_quantize_numpy_equal_torch(case, key, sr):
    torch = _torch()
    x, spec = case
    if spec.name in BLOCK_FORMATS:
        require_block_format(spec.name)
    kw = {}
    if sr:
        spec = qcore.make_spec(spec, rounding=RoundingMode.STOCHASTIC)
        kw = dict(key=key)
    t = torch.from_numpy(x.copy())
    qn, qt = quantize(x, spec, **kw), quantize(t, spec, **kw)
    _assert_qtensors_equal(qt, qn, str(spec))
    assert_same_bits(dequantize(qt), dequantize(qn), f"{spec}: dequantize torch != numpy", x)
    assert_same_bits(fake_quantize(t, spec, **kw), fake_quantize(x, spec, **kw), f"{spec}: fake_quantize", x)


@given(case=quant_cases(spec_kind="element"))
@settings(max_examples=examples(0.25))
def test_static_quantize_with_given_scales_numpy_equals_torch(case):
    """Calibrated scales / zero points passed in give the same codes on both paths."""
    torch = _torch()
    x, spec = case
    qn = quantize(x, spec)
    t = torch.from_numpy(x.copy())
    kw = dict(scale=qn.scales)
    kwt = dict(scale=torch.from_numpy(np.array(qn.scales)))
    if qn.zero_points is not None:
        kw["zero_point"] = qn.zero_points
        kwt["zero_point"] = torch.from_numpy(np.array(qn.zero_points))
    q2 = quantize(x, spec, **kw)
    assert_same_ints(q2.codes, qn.codes, "static numpy quantize with its own dynamic scales")
    _assert_qtensors_equal(quantize(t, spec, **kwt), q2, f"{spec} static")

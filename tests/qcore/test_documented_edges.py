"""The facts docs/numerics.md states about edges and other libraries, pinned so that the document stays true."""

import numpy as np
import pytest

import qcore
from qcore import ScaleMode

FLT_MAX = np.finfo(np.float32).max


@pytest.mark.parametrize("name, m", [("float8_e1m6", 6), ("float5_e1m3", 3), ("float3_e1m1", 1)])
def test_sign_magnitude_elements_max_is_2_minus_2_to_minus_m(name, m):
    d = qcore.get_dtype(name)
    assert d.mantissa_bits == m and d.max_finite == 2 - 2.0**-m
    assert qcore.cast(np.float32([100.0]), name)[0] == 2 - 2.0**-m


def test_float64_inputs_are_rounded_twice():
    v = 1.0625 + 2**-30  # above the e4m3 midpoint 1.0625, which float32 rounds it onto
    assert np.float32(v) == np.float32(1.0625)
    assert qcore.cast(np.array([v], np.float64), "float8_e4m3fn")[0] == 1.0  # the exact answer would be 1.125


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp6_e2m3", "mxfp8_e4m3", "mxfp8_e5m2"])
def test_scales_that_round_up_overflow_to_inf_near_flt_max(fmt):
    x = np.full((1, 32), FLT_MAX, np.float32)
    with np.errstate(over="ignore"):
        assert np.isfinite(qcore.fake_quantize(x, fmt, scale_mode=ScaleMode.FLOOR)).all()
        for mode in (ScaleMode.CEIL, ScaleMode.EVEN, ScaleMode.RCEIL):
            assert np.isposinf(qcore.fake_quantize(x, fmt, scale_mode=mode)).all(), mode


def test_int8_divisor_127_5_overflows_at_minus_flt_max():
    with np.errstate(over="ignore"):
        y = qcore.fake_quantize(np.float32([FLT_MAX, -FLT_MAX]), "int8")
        assert np.isfinite(y[0]) and np.isneginf(y[1])
        assert np.isneginf(qcore.fake_quantize(np.full((1, 8), -FLT_MAX, np.float32), "bfp16")).all()


def test_gguf_mxfp4_writes_plus_zero_where_qcore_keeps_minus_zero():
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    x = np.linspace(-3, 3, 32).astype(np.float32)
    x[:3] = [-0.0, -0.1, -1e-3]
    g = quants.quantize(x.reshape(1, 32), GGMLQuantizationType.MXFP4)[0, 1:]  # byte 0 is the E8M0 scale
    g_codes = np.concatenate([g & 0xF, g >> 4])  # GGUF Q4 order: element j low nibble, j + 16 high nibble
    q = qcore.quantize(x, "mxfp4")
    assert g_codes[:3].tolist() == [0, 0, 0] and q.codes[:3].tolist() == [8, 8, 8]
    minus_zero = q.codes == 8
    assert np.array_equal(g_codes[~minus_zero], q.codes[~minus_zero]) and (g_codes[minus_zero] == 0).all()

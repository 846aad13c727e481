"""The quantize kernels against their twins in qcore, bit for bit, on the probes of ``qcore.testing``.

fake_quantize, quantize (codes, scales, zero points, scale codes) and dequantize for MX (FLOOR / CEIL / EVEN
scales), NVFP4 (given and unit tensor scales), fp8 (e4m3fn, e4m3fnuz, e5m2, e5m2fnuz) and integers (int8, int4,
uint4, uint8, narrow int8) per tensor, per channel (both axes) and per group, computed and given scales.
"""

import numpy as np
import pytest

import qcore
from qcore import PerGroup, ScaleMode, TensorScale
from qcore.testing import Op, assert_matches_oracle, compare, probes_by_kind

torch = pytest.importorskip("torch")
qt = pytest.importorskip("qcore.adapters.triton")

MX = ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2"]
FP8 = ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"]


def T(x, device):
    return torch.from_numpy(np.ascontiguousarray(x)).to(device)


def _grid2d(v: np.ndarray, cols: int = 64) -> np.ndarray:
    """1-D element probes laid out as rows of ``cols`` (zero padded)."""
    n = -(-v.size // cols) * cols
    out = np.zeros(n, np.float32)
    out[:v.size] = v
    return out.reshape(-1, cols)


# -- MX and NVFP4 ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [ScaleMode.FLOOR, ScaleMode.CEIL, ScaleMode.EVEN])
@pytest.mark.parametrize("fmt", MX)
def test_mx_fake_quantize_matches_core(fmt, mode, device):
    kinds = probes_by_kind(fmt)
    x = np.concatenate(list(kinds.values()))
    out = qt.fake_quantize(T(x, device), fmt, scale_mode=mode)
    assert out.dtype == torch.float32 and out.device.type == device
    assert_matches_oracle(out, x, fmt, op=Op.FAKE_QUANTIZE, kinds=kinds, scale_mode=mode)


@pytest.mark.parametrize("mode", [ScaleMode.FLOOR, ScaleMode.EVEN])
@pytest.mark.parametrize("fmt", MX)
def test_mx_quantize_codes_and_scales_match_core(fmt, mode, device):
    kinds = probes_by_kind(fmt)
    x = np.concatenate(list(kinds.values()))
    q = qt.quantize(T(x, device), fmt, scale_mode=mode)
    assert q.codes.dtype == torch.uint8
    assert_matches_oracle(q, x, fmt, op=Op.QUANTIZE, kinds=kinds, scale_mode=mode)
    ref = qcore.quantize(T(x, "cpu"), fmt, scale_mode=mode)
    assert compare(qt.dequantize(q), qcore.dequantize(ref)).ok
    p = qt.quantize_packed(T(x, device), fmt, scale_mode=mode)
    bits = qcore.get_dtype(fmt).element.bits
    if bits in (4, 6):
        assert torch.equal(p.packed.cpu(), qcore.packing.pack(ref.codes, ref.spec.dtype, axis=-1))
    assert torch.equal(p.scale_codes.cpu(), ref.scale_codes)


@pytest.mark.parametrize("g", [0.1, 1.0, 3.0e-30])
def test_nvfp4_given_tensor_scale_matches_core(g, device):
    kinds = probes_by_kind("nvfp4")
    x = np.concatenate(list(kinds.values()))
    assert_matches_oracle(qt.fake_quantize(T(x, device), "nvfp4", tensor_scale=g), x, "nvfp4", op=Op.FAKE_QUANTIZE,
                          kinds=kinds, tensor_scale=np.float32(g))
    q = qt.quantize(T(x, device), "nvfp4", tensor_scale=g)
    assert_matches_oracle(q, x, "nvfp4", op=Op.QUANTIZE, kinds=kinds, tensor_scale=np.float32(g))
    ref = qcore.quantize(T(x, "cpu"), "nvfp4", tensor_scale=g)
    assert compare(qt.dequantize(ref), qcore.dequantize(ref)).ok
    p = qt.quantize_packed(T(x, device), "nvfp4", tensor_scale=g)
    assert torch.equal(p.packed.cpu(), qcore.packing.pack(ref.codes, ref.spec.dtype, axis=-1))
    assert torch.equal(p.scale_codes.cpu(), ref.scale_codes)


@pytest.mark.parametrize("kind", ["random", "one_outlier", "tiny", "zeros", "nan"])
def test_nvfp4_tensor_scale_from_amax_matches_core(kind, device):
    x = probes_by_kind("nvfp4")[kind]
    out = qt.fake_quantize(T(x, device), "nvfp4")
    assert_matches_oracle(out, x, "nvfp4", op=Op.FAKE_QUANTIZE)
    q = qt.quantize(T(x, device), "nvfp4")
    assert_matches_oracle(q, x, "nvfp4", op=Op.QUANTIZE)
    assert compare(q.tensor_scale, qcore.quantize(x, "nvfp4").tensor_scale).ok
    one = qt.fake_quantize(T(x, device), "nvfp4", tensor_scale_mode=TensorScale.ONE)
    assert_matches_oracle(one, x, "nvfp4", op=Op.FAKE_QUANTIZE, tensor_scale_mode=TensorScale.ONE)


# -- fp8 per tensor / per channel -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_given_scale_is_the_saturating_cast(fmt, device):
    """Scale 1 (and 2**-3): every element probe (grid, neighbours, ties, subnormals, saturation, NaN/Inf)."""
    kinds = probes_by_kind(fmt)
    x = np.concatenate(list(kinds.values()))
    for s in (1.0, 0.125):
        out = qt.fake_quantize(T(x, device), fmt, scale=s)
        assert_matches_oracle(out, x, fmt, op=Op.FAKE_QUANTIZE, kinds=kinds, scale=np.float32(s))
        q = qt.quantize(T(x, device), fmt, scale=s)
        assert_matches_oracle(q, x, fmt, op=Op.QUANTIZE, kinds=kinds, scale=np.float32(s))
        ref = qcore.quantize(T(x, "cpu"), fmt, scale=s)
        assert compare(qt.dequantize(ref), qcore.dequantize(ref)).ok


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_computed_scales_per_tensor_and_per_channel(fmt, device):
    kinds = probes_by_kind(fmt)
    for name in ("grid", "neighbours", "midpoints", "subnormals", "saturation", "random_range"):
        x = kinds[name]
        assert_matches_oracle(qt.fake_quantize(T(x, device), fmt), x, fmt, op=Op.FAKE_QUANTIZE)
        assert_matches_oracle(qt.quantize(T(x, device), fmt), x, fmt, op=Op.QUANTIZE)
    x = _grid2d(np.concatenate(list(kinds.values())))
    for axis in (0, 1):
        out = qt.fake_quantize(T(x, device), fmt, axis=axis)
        assert_matches_oracle(out, x, fmt, op=Op.FAKE_QUANTIZE, axis=axis)
        q = qt.quantize(T(x, device), fmt, axis=axis)
        assert_matches_oracle(q, x, fmt, op=Op.QUANTIZE, axis=axis)
        assert compare(qt.dequantize(q), qcore.dequantize(qcore.quantize(x, fmt, axis=axis))).ok
    x3 = x[: (x.shape[0] // 4) * 4].reshape(4, -1, 64)
    assert_matches_oracle(qt.fake_quantize(T(x3, device), fmt, axis=1), x3, fmt, op=Op.FAKE_QUANTIZE, axis=1)


@pytest.mark.parametrize("fmt,group", [("float8_e4m3fn", 128), ("float8_e4m3fnuz", 32), ("float8_e5m2", 48)])
def test_fp8_per_group_matches_core(fmt, group, device):
    spec = qcore.make_spec(fmt, granularity=PerGroup(group, -1))
    kinds = probes_by_kind(spec)
    x = np.concatenate(list(kinds.values()))
    assert_matches_oracle(qt.fake_quantize(T(x, device), spec), x, spec, op=Op.FAKE_QUANTIZE, kinds=kinds)
    assert_matches_oracle(qt.quantize(T(x, device), spec), x, spec, op=Op.QUANTIZE, kinds=kinds)


def test_bfloat16_and_float16_inputs_are_exact(device):
    x = probes_by_kind("mxfp4")["random"]
    for dt in (torch.bfloat16, torch.float16):
        t = torch.from_numpy(x).to(dt)
        ref = qcore.fake_quantize(t.float(), "mxfp4")
        assert compare(qt.fake_quantize(t.to(device), "mxfp4"), ref).ok


# -- integers -------------------------------------------------------------------------------------------------------

INT_SPECS = {
    "int8": dict(),
    "int8_narrow": dict(narrow_range=True),
    "int4": dict(),
    "uint4": dict(),  # asymmetric (zero points)
    "uint8": dict(),
    "uint4_sym": dict(symmetric=True),
}


def _int_fmt(name):
    return name.split("_")[0]


@pytest.mark.parametrize("name", list(INT_SPECS))
@pytest.mark.parametrize("group", [32, 48])
def test_int_per_group_matches_core(name, group, device):
    fmt, kw = _int_fmt(name), INT_SPECS[name]
    spec = qcore.make_spec(fmt, granularity=PerGroup(group, -1), **kw)
    kinds = probes_by_kind(spec)
    x = np.concatenate(list(kinds.values()))
    assert_matches_oracle(qt.fake_quantize(T(x, device), spec), x, spec, op=Op.FAKE_QUANTIZE, kinds=kinds)
    q = qt.quantize(T(x, device), spec)
    assert q.codes.dtype == (torch.int8 if qcore.get_dtype(fmt).signed else torch.uint8)
    assert_matches_oracle(q, x, spec, op=Op.QUANTIZE, kinds=kinds)
    ref = qcore.quantize(T(x, "cpu"), spec)
    assert compare(qt.dequantize(ref), qcore.dequantize(ref)).ok
    if qcore.get_dtype(fmt).bits == 4 and group % 2 == 0:
        p = qt.quantize_packed(T(x, device), spec)
        assert torch.equal(p.packed.cpu(), qcore.packing.pack(ref.codes, spec.dtype, axis=-1))


@pytest.mark.parametrize("name", list(INT_SPECS))
def test_int_per_tensor_and_channel_computed_and_given(name, device):
    fmt, kw = _int_fmt(name), INT_SPECS[name]
    kinds = probes_by_kind(fmt)
    with np.errstate(all="ignore"):
        x = _grid2d(np.concatenate([v for k, v in kinds.items() if k != "random_bits"]) * np.float32(0.37), 32)
    for axis in (None, 0, 1):
        out = qt.fake_quantize(T(x, device), fmt, axis=axis, **kw)
        assert_matches_oracle(out, x, fmt, op=Op.FAKE_QUANTIZE, axis=axis, **kw)
        q = qt.quantize(T(x, device), fmt, axis=axis, **kw)
        assert_matches_oracle(q, x, fmt, op=Op.QUANTIZE, axis=axis, **kw)
    # given scales and zero points (static activations): NaN inputs excluded (their integer codes are undefined)
    spec = qcore.make_spec(fmt, axis=1, **kw)
    ref = qcore.quantize(x, spec)
    s, zp = ref.scales, ref.zero_points
    finite = np.where(np.isnan(x), np.float32(1.5), x) * np.float32(1.75)
    out = qt.fake_quantize(T(finite, device), spec, scale=T(np.nan_to_num(s, nan=1.0), device),
                           zero_point=None if zp is None else T(zp, device))
    want = qcore.fake_quantize(finite, spec, scale=np.nan_to_num(s, nan=1.0), zero_point=zp)
    assert compare(out, want).ok
    qk = qt.quantize(T(finite, device), spec, scale=T(np.nan_to_num(s, nan=1.0), device),
                     zero_point=None if zp is None else T(zp, device))
    qr = qcore.quantize(finite, spec, scale=np.nan_to_num(s, nan=1.0), zero_point=zp)
    assert np.array_equal(qk.codes.cpu().numpy(), qr.codes)


def test_given_scale_per_group_uses_the_group_layout(device):
    spec = qcore.make_spec("int4", granularity=PerGroup(16, -1))
    x = probes_by_kind(spec)["random"]
    s = qcore.quantize(x, spec).scales * np.float32(1.5)
    out = qt.fake_quantize(T(x, device), spec, scale=T(s, device))
    assert compare(out, qcore.fake_quantize(x, spec, scale=s)).ok
    mx = probes_by_kind("mxfp4")["random"]
    ms = qcore.quantize(mx, "mxfp4").scales * np.float32(2.0)
    assert compare(qt.fake_quantize(T(mx, device), "mxfp4", scale=T(ms, device)),
                   qcore.fake_quantize(mx, "mxfp4", scale=ms)).ok


# -- what the kernels refuse, and a bug they would catch ------------------------------------------------------------


def test_uncovered_specs_are_refused_before_work(device):
    x = T(np.ones((2, 32), np.float32), device)
    for fmt, kw, word in [("mxfp4", dict(rounding=qcore.RoundingMode.STOCHASTIC), "STOCHASTIC"),
                          ("mx9", {}, "microexponents"), ("mxfp4", dict(scale_mode=ScaleMode.RCEIL), "RCEIL"),
                          ("int16", {}, "wider than 8 bits"), ("bfloat16", {}, "element format"),
                          ("int8", dict(granularity=PerGroup(8, 0)), "axis 0"),
                          ("float8_e4m3fn", dict(scale_dtype="bfloat16"), "bfloat16")]:
        assert not qt.supports(qcore.make_spec(fmt, **kw), ndim=2)
        with pytest.raises(ValueError, match=word):
            qt.fake_quantize(x, fmt, **kw)
    assert qt.supports("mxfp4") and qt.supports("nvfp4") and qt.supports("uint4", ndim=2)
    assert qt.why_not("float8_e4m3fnuz") is None
    assert "RCEIL" in qt.why_not(qcore.make_spec("mxfp4", scale_mode=ScaleMode.RCEIL))


def test_a_wrong_tie_rule_would_be_caught(device):
    """The comparison can fail: 2.5 in an fp4 block of scale 1 is a tie (RNE: 2); a kernel rounding ties away
    from zero would give 3."""
    x = np.array([[2.5, 0.25, 5.0, 6.0] + [0.0] * 28], np.float32)
    out = qt.fake_quantize(T(x, device), "mxfp4").cpu().numpy()
    assert out[0, 0] == 2.0 and out[0, 1] == 0.0
    wrong = out.copy()
    wrong[0, 0] = 3.0
    with pytest.raises(AssertionError, match="1 of 32 values differ"):
        assert_matches_oracle(wrong, x, "mxfp4", op=Op.FAKE_QUANTIZE)

"""assert_matches_oracle: qcore itself passes on its probes (numpy, torch, torch.compile) for every op; the
report carries block context; options and errors; the pytest fixture."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import qcore
from qcore import PerGroup, RoundingMode, ScaleMode, make_spec
from qcore.packing import Int4Order
from qcore.testing import (Op, assert_matches_oracle, check_against_oracle, formats, probes, probes_by_kind,
                           reference)

# qcore's numpy path warns (invalid value / overflow) on the NaN and Inf probes; the results are still exact.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")

ELEMENTS = ["float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
            "float8_e5m2fnuz", "float8_e8m0fnu", "float8_e5m3", "float8_e1m6", "float3_e1m1", "bfloat16", "float16",
            "int4", "uint4", "int8", "int2"]
BLOCKS = formats("block")


def no_nan(x):
    return x[~np.isnan(x)]


# ---------------------------------------------------------------------------------------------------------------
# the oracle passes on itself
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ELEMENTS)
def test_element_ops_pass_on_qcore_numpy(fmt):
    x = probes(fmt)
    kinds = probes_by_kind(fmt)
    assert_matches_oracle(qcore.cast(x, fmt), x, fmt, op=Op.CAST, kinds=kinds)
    xs = no_nan(x)
    codes = qcore.encode(xs, fmt)
    assert_matches_oracle(codes, xs, fmt, op=Op.ENCODE)
    assert_matches_oracle(qcore.decode(codes, fmt), codes, fmt, op=Op.DECODE)
    if qcore.get_dtype(fmt).bits <= 8:
        assert_matches_oracle(reference(codes, fmt, op=Op.PACK), codes, fmt, op=Op.PACK)


@pytest.mark.parametrize("fmt", ["float4_e2m1fn", "float8_e4m3fn", "float8_e5m2fnuz", "int4", "float8_e8m0fnu"])
def test_element_ops_pass_on_qcore_torch(fmt):
    torch = pytest.importorskip("torch")
    x = probes(fmt)
    t = torch.from_numpy(x)
    assert_matches_oracle(qcore.cast(t, fmt), t, fmt, op=Op.CAST, kinds=probes_by_kind(fmt))
    xs = torch.from_numpy(no_nan(x))
    codes = qcore.encode(xs, fmt)
    assert_matches_oracle(codes, xs, fmt, op=Op.ENCODE)
    assert_matches_oracle(qcore.decode(codes, fmt), codes, fmt, op=Op.DECODE)


@pytest.mark.parametrize("fmt", BLOCKS)
def test_block_ops_pass_on_qcore_numpy(fmt):
    x = probes(fmt)
    kinds = probes_by_kind(fmt)
    assert_matches_oracle(qcore.fake_quantize(x, fmt), x, fmt, op=Op.FAKE_QUANTIZE, kinds=kinds)
    q = qcore.quantize(x, fmt)
    assert_matches_oracle(q, x, fmt, op=Op.QUANTIZE, kinds=kinds)
    assert_matches_oracle(qcore.dequantize(q), q, fmt, op=Op.DEQUANTIZE, kinds=kinds)
    assert_matches_oracle(qcore.dequantize(q), x, fmt, op=Op.DEQUANTIZE)


@pytest.mark.parametrize("fmt", BLOCKS)
def test_block_ops_pass_on_qcore_torch(fmt):
    torch = pytest.importorskip("torch")
    x = probes(fmt)
    t = torch.from_numpy(x)
    kinds = probes_by_kind(fmt)
    assert_matches_oracle(qcore.fake_quantize(t, fmt), t, fmt, kinds=kinds)
    assert_matches_oracle(qcore.quantize(t, fmt), t, fmt, op=Op.QUANTIZE, kinds=kinds)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["mxfp4", make_spec("int4", granularity=PerGroup(32))])
def test_compiled_torch_path_passes(fmt):
    # The two specs tests/qcore/test_quantize.py also compiles (in one session they share the compiled code).
    torch = pytest.importorskip("torch")
    x = probes(fmt, random=256)
    y = qcore.fake_quantize(torch.from_numpy(x), fmt, compile=True)
    assert_matches_oracle(y, x, fmt, op=Op.FAKE_QUANTIZE, kinds=probes_by_kind(fmt, random=256))


@pytest.mark.parametrize("mode", [ScaleMode.EVEN, ScaleMode.CEIL, ScaleMode.RCEIL])
def test_scale_mode_overrides(mode):
    x = probes("mxfp6_e2m3")
    assert_matches_oracle(qcore.fake_quantize(x, "mxfp6_e2m3", scale_mode=mode), x, "mxfp6_e2m3", scale_mode=mode)
    r = check_against_oracle(qcore.fake_quantize(x, "mxfp6_e2m3", scale_mode=mode), x, "mxfp6_e2m3")
    assert not r.ok  # and the default (FLOOR) differs somewhere on the probes


@pytest.mark.parametrize("spec", [
    make_spec("int4", granularity=PerGroup(48), symmetric=False),
    make_spec("int8", granularity=PerGroup(32), narrow_range=True),
    make_spec("float8_e4m3fn", granularity=PerGroup(16), scale_dtype="float16"),
    make_spec("float4_e2m1fn", granularity=PerGroup(16), scale_dtype="float8_e4m3fn"),
])
def test_group_specs_pass(spec):
    x = probes(spec)
    kinds = probes_by_kind(spec)
    assert_matches_oracle(qcore.quantize(x, spec), x, spec, op=Op.QUANTIZE, kinds=kinds)
    assert_matches_oracle(qcore.fake_quantize(x, spec), x, spec, kinds=kinds)


@pytest.mark.parametrize("spec", [make_spec("int8", granularity=PerGroup(32)),
                                  make_spec("float4_e2m1fn", granularity=PerGroup(16), scale_dtype="float8_e4m3fn")])
def test_tiny_blocks_with_float_scales_stay_finite(spec):
    # Found by the kit's "tiny" probes: a block whose amax is a float32 subnormal (2**-149) got scale 0
    # (amax / 127.5 underflowed), NaN outputs, and for fp4 codes a ValueError from encode.
    x = probes_by_kind(spec)["tiny"]
    q = qcore.quantize(x, spec)
    assert np.all(q.scales > 0) and np.all(np.isfinite(qcore.fake_quantize(x, spec)))


def test_stochastic_rounding_key_is_passed_through():
    x = probes("mxfp4", random=64)
    y = qcore.fake_quantize(x, "mxfp4", rounding=RoundingMode.STOCHASTIC, key=7)
    assert_matches_oracle(y, x, "mxfp4", rounding=RoundingMode.STOCHASTIC, key=7)
    assert not check_against_oracle(y, x, "mxfp4", rounding=RoundingMode.STOCHASTIC, key=8).ok
    c = qcore.cast(x, "float8_e5m2", rounding=RoundingMode.STOCHASTIC, key=1)
    assert_matches_oracle(c, x, "float8_e5m2", op=Op.CAST, rounding=RoundingMode.STOCHASTIC, key=1)


# ---------------------------------------------------------------------------------------------------------------
# the report's context
# ---------------------------------------------------------------------------------------------------------------


def test_microexponent_block_context_shows_the_pair_shift():
    x = probes("mx9")
    y = qcore.fake_quantize(x, "mx9").copy()
    q = qcore.quantize(x, "mx9")
    i = np.argwhere((q.subblock_shifts == 1).repeat(2, axis=1)[:, : x.shape[1]] & (y != 0))[0]
    y[tuple(i)] *= 2
    r = check_against_oracle(y, x, "mx9")
    m = r.mismatches[0]
    assert m.multi_index == tuple(int(v) for v in i) and m.block.subblock_shift == 1
    assert "sub-block shift 1" in r.format() and "E8M0 byte" in r.format()


def test_asymmetric_zero_point_and_scale_components():
    spec = make_spec("uint4", granularity=PerGroup(8), symmetric=False)
    x = probes(spec, random=32)
    q = qcore.quantize(x, spec)
    zp = q.zero_points.copy()
    zp[0, 0] += 1
    r = check_against_oracle((q.codes, q.scales, zp), x, spec, op=Op.QUANTIZE)
    assert r.by_component == {"zero_points": 1} and "zero point" in r.format()
    r = check_against_oracle((q.codes, q.scales), x, spec, op=Op.QUANTIZE)
    assert not r.ok and "zero_points" in r.problem
    r = check_against_oracle({"codes": q.codes, "scales": q.scales * 2, "zero_points": q.zero_points}, x, spec,
                             op=Op.QUANTIZE)
    assert set(r.by_component) == {"scales"}


def test_e8m0_scale_bytes_and_nan_blocks():
    x = probes("mxfp4")
    q = qcore.quantize(x, "mxfp4")
    e8 = qcore.encode(q.scales, "float8_e8m0fnu")
    assert 0xFF in e8 and 0x00 in e8  # NaN/Inf blocks and zero blocks
    assert_matches_oracle((q.codes, e8), x, "mxfp4", op=Op.QUANTIZE)
    bad = e8.copy()
    bad[bad == 0xFF] = 0x7F  # a kernel that gives NaN blocks a finite scale
    r = check_against_oracle((q.codes, bad), x, "mxfp4", op=Op.QUANTIZE, kinds=probes_by_kind("mxfp4"))
    assert set(r.by_kind) == {"nan", "inf"} and "E8M0 byte 0xff" in r.format()


def test_pack_variants():
    codes = qcore.encode(no_nan(probes("float6_e3m2fn", random=30)), "float6_e3m2fn")
    assert_matches_oracle(qcore.packing.pack_fp6(codes), codes, "float6_e3m2fn", op=Op.PACK)
    v = qcore.encode(no_nan(probes("int4", random=30)), "int4")
    v = v[: len(v) // 8 * 8]
    packed = qcore.packing.pack_int4_int32(v, order=Int4Order.REORDER)
    assert_matches_oracle(packed, v, "int4", op=Op.PACK, order=Int4Order.REORDER)
    r = check_against_oracle(packed, v, "int4", op=Op.PACK, order=Int4Order.ORDER)
    assert not r.ok and "packs elements 0..7" in r.format()
    # Float values are encoded first; block formats pack their element codes.
    x = no_nan(probes("float4_e2m1fn", random=16))
    assert_matches_oracle(qcore.packing.pack_fp4(qcore.encode(x, "fp4")), x, "mxfp4", op=Op.PACK)
    # The 3-bit elements of MX4 pack densely (8 codes -> 3 bytes): one byte per code is a mismatch.
    c3 = np.arange(8, dtype=np.uint8)
    assert reference(c3, "mx4", op=Op.PACK).tolist() == [0x88, 0xC6, 0xFA]
    r = check_against_oracle(c3, c3, "mx4", op=Op.PACK)
    assert not r.ok and "shape" in r.problem
    # 16-bit formats: little-endian words
    h = qcore.encode(np.array([1.0, -2.0], np.float32), "float16")
    assert reference(h, "float16", op=Op.PACK).tolist() == [0x00, 0x3C, 0x00, 0xC0]


def test_errors():
    x = probes("fp4", random=8)
    with pytest.raises(TypeError, match="Op"):
        assert_matches_oracle(x, x, "fp4", op="cast")
    with pytest.raises(ValueError, match="kinds"):
        assert_matches_oracle(qcore.cast(x, "fp4"), x, "fp4", op=Op.CAST, kinds=probes_by_kind("fp4"))
    with pytest.raises(TypeError, match="integer array of codes"):
        assert_matches_oracle(x, x, "fp4", op=Op.DECODE)
    with pytest.raises(ValueError, match="cannot encode"):
        assert_matches_oracle(x, x, "fp4", op=Op.ENCODE)
    with pytest.raises(TypeError, match="QTensor"):
        assert_matches_oracle(x, x, "mxfp4", op=Op.QUANTIZE)
    with pytest.raises(TypeError, match="unknown QuantSpec"):
        assert_matches_oracle(x, x, "mxfp4", scale_rule=1)
    r = check_against_oracle(qcore.cast(x, "fp4")[:-1], x, "fp4", op=Op.CAST)
    assert not r.ok and "shape" in r.problem


def test_formats_helper():
    assert "mxfp4" in formats("block") and "float4_e2m1fn" not in formats("block")
    assert "float4_e2m1fn" in formats("element") and "mxfp4" not in formats("element")
    assert set(formats("all")) == set(qcore.DTYPES)
    assert "bfloat16" not in formats("element", max_bits=8) and "int8" in formats("element", max_bits=8)
    with pytest.raises(ValueError, match="kind"):
        formats("blocks")


# ---------------------------------------------------------------------------------------------------------------
# pytest fixture and plugin
# ---------------------------------------------------------------------------------------------------------------


def test_fixture_names_probe_kinds_by_itself(qcore_oracle):
    x = qcore_oracle.probes("mxfp4")
    assert qcore_oracle.assert_matches(qcore.fake_quantize(x, "mxfp4"), x, "mxfp4").ok
    bad = qcore.fake_quantize(x, "mxfp4", scale_mode=ScaleMode.CEIL)
    with pytest.raises(AssertionError, match="probe kind '"):
        qcore_oracle.assert_matches(bad, x, "mxfp4", op=qcore_oracle.Op.FAKE_QUANTIZE)
    assert qcore_oracle.check(bad, x.copy(), "mxfp4").by_kind == {}  # a copy is not a remembered probe array
    assert qcore_oracle.compare(x, x).ok
    assert np.array_equal(qcore_oracle.reference(x, "mxfp4"), qcore.fake_quantize(x, "mxfp4"), equal_nan=True)


def test_plugin_loads_through_pytest_plugins(tmp_path):
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["qcore.testing.pytest_plugin"]\n')
    (tmp_path / "test_kernel.py").write_text(textwrap.dedent("""
        import qcore
        from qcore.testing import Op

        def test_kernel(qcore_oracle):
            x = qcore_oracle.probes("float8_e4m3fn", random=16)
            qcore_oracle.assert_matches(qcore.cast(x, "float8_e4m3fn"), x, "float8_e4m3fn", op=Op.CAST)
    """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout


def test_device_tensors():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = probes("mxfp4")
    t = torch.from_numpy(x).cuda()
    assert_matches_oracle(qcore.fake_quantize(t, "mxfp4"), t, "mxfp4", kinds=probes_by_kind("mxfp4"))
    assert_matches_oracle(qcore.quantize(t, "mxfp4"), t, "mxfp4", op=Op.QUANTIZE)
    c = qcore.cast(torch.from_numpy(probes("float8_e4m3fn")).cuda(), "float8_e4m3fn")
    assert_matches_oracle(c, probes("float8_e4m3fn"), "float8_e4m3fn", op=Op.CAST)

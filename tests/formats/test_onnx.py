"""qcore.formats.onnx: the tensors and nodes qcore writes for quantized weights and activations.

Oracles: onnx's own tensor reader (``numpy_helper.to_array``) and reference evaluator (``onnx.reference``) for the
bytes and the DequantizeLinear semantics; onnxruntime (marker ``onnx_client``) for what a real client computes;
``qcore.dequantize`` / ``qcore.fake_quantize`` for what it must equal, bit for bit.
"""

import numpy as np
import pytest

import qcore
from qcore import PerBlock, PerChannel, PerGroup, PerTensor

onnx = pytest.importorskip("onnx")
from onnx import TensorProto as T, helper as h, numpy_helper  # noqa: E402

from qcore.formats import onnx as X  # noqa: E402
from qcore.formats.quark_layout import WeightParts  # noqa: E402


def _ort():
    return pytest.importorskip("onnxruntime")


def _parts(q):
    zp = None if q.zero_points is None else np.asarray(q.zero_points, np.float32)
    return WeightParts(codes=np.asarray(q.codes), scales=np.asarray(q.scales, np.float32), zero_points=zp)


def _weight(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


WEIGHT_SPECS = {
    "int8_tensor": lambda: qcore.make_spec("int8"),
    "int8_channel": lambda: qcore.make_spec("int8", granularity=PerChannel(0)),
    "int8_narrow_channel": lambda: qcore.make_spec("int8", granularity=PerChannel(0), narrow_range=True),
    "uint8_asym_channel": lambda: qcore.make_spec("uint8", granularity=PerChannel(0)),
    "int4_group32": lambda: qcore.make_spec("int4", granularity=PerGroup(32, axis=1)),
    "int4_group16_short": lambda: qcore.make_spec("int4", granularity=PerGroup(16, axis=1)),  # 40 = 2*16 + 8
    "int4_asym_group32": lambda: qcore.make_spec("int4", granularity=PerGroup(32, axis=1), symmetric=False),
    "uint4_group32": lambda: qcore.make_spec("uint4", granularity=PerGroup(32, axis=1)),
    "uint4_sym_channel": lambda: qcore.make_spec("uint4", granularity=PerChannel(0), symmetric=True),
    "int8_block": lambda: qcore.make_spec("int8", granularity=PerBlock((4, 16))),
    "fp8_e4m3fn_tensor": lambda: qcore.make_spec("float8_e4m3fn"),
    "fp8_e4m3fn_channel": lambda: qcore.make_spec("float8_e4m3fn", granularity=PerChannel(0)),
    "fp8_e5m2_group": lambda: qcore.make_spec("float8_e5m2", granularity=PerGroup(16, axis=1)),
    "fp8_e4m3fnuz_channel": lambda: qcore.make_spec("float8_e4m3fnuz", granularity=PerChannel(0)),
    "fp8_e5m2fnuz_tensor": lambda: qcore.make_spec("float8_e5m2fnuz"),
    "mxint8": lambda: qcore.make_spec("mxint8", granularity=PerGroup(32, axis=1)),  # unit exponent folded
    "bfp16": lambda: qcore.make_spec("bfp16", granularity=PerGroup(8, axis=1)),  # int8 x shared exponent
    "mxfp8_e4m3": lambda: qcore.make_spec("mxfp8_e4m3", granularity=PerGroup(32, axis=1)),  # E8M0 as float32
}


def _dq_model(name, parts, spec, shape):
    g = X.Graph()
    out = X.weight_qdq(g, name, parts, spec, shape, output="w")
    g.outputs.append(h.make_tensor_value_info(out, T.FLOAT, list(shape)))
    return g.model("t")


@pytest.mark.parametrize("kind", sorted(WEIGHT_SPECS))
def test_weight_qdq_equals_qcore_dequantize(kind):
    """onnx's reference DequantizeLinear of the written tensors is qcore.dequantize bit for bit; so is the numpy
    model of it that the exporter's report uses."""
    from onnx.reference import ReferenceEvaluator
    spec = WEIGHT_SPECS[kind]()
    shape = (8, 40) if "short" in kind else (8, 64)
    q = qcore.quantize(_weight(shape), spec)
    ref = np.asarray(qcore.dequantize(q), np.float32)
    parts = _parts(q)
    m = _dq_model("layer", parts, spec, shape)
    onnx.checker.check_model(m)
    assert m.opset_import[0].version == X.OPSET and m.ir_version == X.IR_VERSION
    got = ReferenceEvaluator(m).run(None, {})[0]
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    np.testing.assert_array_equal(X.weight_onnx_values(parts, spec, shape).view(np.uint32), ref.view(np.uint32))


@pytest.mark.onnx_client
@pytest.mark.parametrize("kind", sorted(WEIGHT_SPECS))
def test_onnxruntime_dequantizes_weights_exactly(kind):
    ort = _ort()
    spec = WEIGHT_SPECS[kind]()
    shape = (8, 40) if "short" in kind else (8, 64)
    q = qcore.quantize(_weight(shape, seed=1), spec)
    ref = np.asarray(qcore.dequantize(q), np.float32)
    m = _dq_model("layer", _parts(q), spec, shape)
    got = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})[0]
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_int4_codes_round_trip_through_onnx_reader():
    """INT4 / UINT4 packing (two per byte, low nibble first, odd count padded) read back by onnx itself."""
    rng = np.random.default_rng(3)
    for spec, lo, hi in ((qcore.make_spec("int4"), -8, 8), (qcore.make_spec("uint4"), 0, 16)):
        codes = rng.integers(lo, hi, (3, 5))
        t = X._code_tensor("c", codes, spec)
        assert t.data_type == (T.INT4 if lo < 0 else T.UINT4) and len(t.raw_data) == 8
        np.testing.assert_array_equal(numpy_helper.to_array(t).astype(np.int64), codes)


@pytest.mark.parametrize("fmt, word", [("mxfp4", "float4_e2m1fn"), ("nvfp4", "two-level"), ("mx6", "micro-exponents"),
                                       ("int3", "int3"), ("float6_e2m3fn", "fp6"), ("mx4", "micro-exponents")])
def test_unsupported_specs_are_named(fmt, word):
    spec = qcore.make_spec(fmt)
    r = X.unsupported_reason(spec)
    assert r is not None and word in r
    with pytest.raises(ValueError, match=word):
        X.onnx_type(spec)
    q = qcore.quantize(_weight((4, 32)), spec)
    with pytest.raises(ValueError, match="my.layer"):
        X.weight_qdq(X.Graph(), "my.layer", _parts(q), spec, (4, 32))


def test_activation_refusals_say_why():
    assert "narrow" in X.activation_reason(qcore.make_spec("int8", narrow_range=True), dynamic=False)
    stochastic = qcore.make_spec("int8", rounding=qcore.RoundingMode.STOCHASTIC)
    assert "rounds" in X.activation_reason(stochastic, dynamic=False)
    assert "asymmetric" in X.activation_reason(qcore.make_spec("uint8"), dynamic=True)
    assert X.activation_reason(qcore.make_spec("float8_e4m3fn", granularity=PerChannel(0)), dynamic=True) is None
    assert "per-token" in X.activation_reason(qcore.make_spec("int8", granularity=PerGroup(32, axis=1)), dynamic=True)
    assert X.activation_reason(qcore.make_spec("int8", granularity=PerChannel(0)), dynamic=True) is None
    assert X.activation_reason(qcore.make_spec("uint8"), dynamic=False) is None


def _run(ort, g, feeds, shape):
    g.inputs.append(h.make_tensor_value_info("x", T.FLOAT, list(shape)))
    m = g.model("t")
    onnx.checker.check_model(m)
    so = ort.SessionOptions()
    for k, v in X.EXACT_SESSION_CONFIG.items():
        so.add_session_config_entry(k, v)
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


STATIC = {
    "int8_tensor": (lambda: qcore.make_spec("int8"), False),
    "uint8_asym_tensor": (lambda: qcore.make_spec("uint8"), False),
    "int8_feature": (lambda: qcore.make_spec("int8", granularity=PerChannel(1)), True),
    "int4_tensor": (lambda: qcore.make_spec("int4"), False),
    "uint4_asym_feature": (lambda: qcore.make_spec("uint4", granularity=PerChannel(1)), True),
    "fp8_e4m3fn_tensor": (lambda: qcore.make_spec("float8_e4m3fn"), False),
    "fp8_e5m2_feature": (lambda: qcore.make_spec("float8_e5m2", granularity=PerChannel(1)), True),
}


@pytest.mark.onnx_client
@pytest.mark.parametrize("kind", sorted(STATIC))
def test_static_activation_qdq_is_qcore_fake_quantize(kind):
    """QuantizeLinear + DequantizeLinear with calibrated scales = qcore.fake_quantize with the same scales, bit for
    bit (values beyond the range saturate in both)."""
    ort = _ort()
    spec, per_feature = STATIC[kind][0](), STATIC[kind][1]
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((16, 32)) * 3).astype(np.float32)
    calib = qcore.quantize(x * np.float32(0.5), spec)  # scales from a narrower batch: x saturates somewhere
    s = np.asarray(calib.scales, np.float32)
    zp = None if calib.zero_points is None else np.asarray(calib.zero_points, np.float32)
    ref = np.asarray(qcore.fake_quantize(x, spec, scale=s, zero_point=zp), np.float32)
    g = X.Graph()
    g.reserve("x")
    y = X.activation_qdq(g, "act", "x", spec, s.reshape(-1) if per_feature else s, None if zp is None else
                         (zp.reshape(-1) if per_feature else zp), axis=-1)
    g.outputs.append(h.make_tensor_value_info(y, T.FLOAT, list(x.shape)))
    got = _run(ort, g, {"x": x}, x.shape)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


@pytest.mark.onnx_client
@pytest.mark.parametrize("fmt", ["int8", "int4", "uint8", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz"])
@pytest.mark.parametrize("gran", ["tensor", "token"])
def test_dynamic_activation_is_qcore_fake_quantize(fmt, gran):
    """The composed dynamic quantization (ReduceMax, Div, Round, Clip, Mul; fp8: Cast to fp8 and back) = qcore's
    dynamic fake_quantize bit for bit, an all-zero token included (scale 1)."""
    ort = _ort()
    spec = qcore.make_spec(fmt, granularity=PerTensor() if gran == "tensor" else PerChannel(0), symmetric=True)
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((2, 6, 32)) * np.array([1, 1e-3, 30, 1, 0.5, 2], np.float32)[:, None]).astype(np.float32)
    x[1, 2] = 0
    ref = np.asarray(qcore.fake_quantize(x.reshape(-1, 32), spec), np.float32).reshape(x.shape)
    g = X.Graph()
    g.reserve("x")
    y = X.dynamic_qdq(g, "act", "x", spec)
    g.outputs.append(h.make_tensor_value_info(y, T.FLOAT, list(x.shape)))
    got = _run(ort, g, {"x": x}, x.shape)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


@pytest.mark.onnx_client
@pytest.mark.parametrize("kind", ["int4_group32", "uint4_group32", "int4_asym_group32", "int4_channel",
                                  "uint4_sym_group64"])
def test_matmulnbits_equals_float_matmul_of_dequantized_weight(kind):
    """MatMulNBits (accuracy_level 0) computes x @ dequantize(W).T with exact weights: measured max abs error
    about 1e-6 of |y| (float32 accumulation order); asserted 1e-5 relative to max |y|."""
    ort = _ort()
    spec = {"int4_group32": lambda: qcore.make_spec("int4", granularity=PerGroup(32, axis=1)),
            "uint4_group32": lambda: qcore.make_spec("uint4", granularity=PerGroup(32, axis=1)),
            "int4_asym_group32": lambda: qcore.make_spec("int4", granularity=PerGroup(32, axis=1), symmetric=False),
            "int4_channel": lambda: qcore.make_spec("int4", granularity=PerChannel(0)),
            "uint4_sym_group64": lambda: qcore.make_spec("uint4", granularity=PerGroup(64, axis=1), symmetric=True),
            }[kind]()
    shape = (24, 128)
    q = qcore.quantize(_weight(shape, seed=2), spec)
    w = np.asarray(qcore.dequantize(q), np.float64)
    assert X.matmulnbits_block(spec, shape) is not None
    x = np.random.default_rng(4).standard_normal((3, 5, 128)).astype(np.float32)
    g = X.Graph()
    g.reserve("x")
    y = X.matmulnbits(g, "lin", _parts(q), spec, shape, "x", accuracy_level=0)
    g.outputs.append(h.make_tensor_value_info(y, T.FLOAT, list(x.shape)))
    got = _run(ort, g, {"x": x}, x.shape)
    ref = x.astype(np.float64) @ w.T
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def test_matmulnbits_refuses_what_it_cannot_hold():
    assert X.matmulnbits_block(qcore.make_spec("int8", granularity=PerChannel(0)), (8, 64)) is None
    assert X.matmulnbits_block(qcore.make_spec("int4", granularity=PerGroup(32, axis=1)), (8, 48)) is None
    assert X.matmulnbits_block(qcore.make_spec("int4", granularity=PerGroup(256, axis=1)), (8, 512)) is None
    spec = qcore.make_spec("int4", granularity=PerGroup(32, axis=1))
    q = qcore.quantize(_weight((8, 48)), spec)
    with pytest.raises(ValueError, match="lin.*MatMulNBits"):
        X.matmulnbits(X.Graph(), "lin", _parts(q), spec, (8, 48), "x")


def _tiny_model():
    spec = qcore.make_spec("int4", granularity=PerGroup(32, axis=1))
    q = qcore.quantize(_weight((8, 64)), spec)
    return _dq_model("w", _parts(q), spec, (8, 64))


def test_save_is_deterministic_and_atomic(tmp_path):
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    n = X.save_model(_tiny_model(), a)
    X.save_model(_tiny_model(), b)
    assert a.stat().st_size == n and a.read_bytes() == b.read_bytes()
    with pytest.raises(FileExistsError):
        X.save_model(_tiny_model(), a)
    bad = _tiny_model()
    bad.graph.node[0].input[0] = "missing"  # the checker refuses it: nothing is written, nothing is left behind
    with pytest.raises(onnx.checker.ValidationError):
        X.save_model(bad, tmp_path / "c.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.onnx", "b.onnx"]
    X.save_model(_tiny_model(), a, overwrite=True)
    assert a.read_bytes() == b.read_bytes()


def test_graph_names_are_unique():
    g = X.Graph()
    assert g.fresh("a") == "a" and g.fresh("a") != "a"
    g.reserve("x")
    with pytest.raises(ValueError, match="'x'"):
        g.reserve("x")

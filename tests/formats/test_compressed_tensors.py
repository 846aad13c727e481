"""qcore.formats.compressed_tensors: the quantization_config schema (round trips, validation), QuantizationArgs <->
QuantSpec, and the tensor codecs bit for bit against compressed-tensors 0.20's own pack / unpack functions (marker
ct_client: skipped when compressed_tensors is not importable)."""

import numpy as np
import pytest

import qcore
from qcore import PerBlock, PerChannel, PerGroup, PerTensor
from qcore.formats import compressed_tensors as CT


def _ct():
    return pytest.importorskip("compressed_tensors")


# ---------------------------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_int32_round_trip(bits):
    rng = np.random.default_rng(bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    for shape in [(5, 37), (8, 64), (3, 1), (33, 96)]:
        c = rng.integers(lo, hi + 1, size=shape).astype(np.int8)
        for dim in (0, 1):
            p = CT.pack_int32(c, bits, dim=dim)
            n = shape[dim]
            assert p.dtype == np.int32
            assert p.shape[dim] == -(-n * bits // 32) and p.shape[1 - dim] == shape[1 - dim]
            assert np.array_equal(CT.unpack_int32(p, bits, shape, dim=dim), c)


def test_pack_int32_layout_4bit():
    # eight nibbles per int32, element 0 in the low nibble, codes offset by 8
    c = np.array([[-8, -7, 0, 1, 2, 3, 4, 7]], np.int8)
    word = CT.pack_int32(c, 4)[0, 0].view(np.uint32)
    assert int(word) == sum(int(v + 8) << (4 * i) for i, v in enumerate(c[0]))


@pytest.mark.ct_client
@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_int32_matches_compressed_tensors(bits):
    _ct()
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    rng = np.random.default_rng(100 + bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    for shape in [(5, 37), (16, 128), (3, 1), (33, 96)]:
        c = rng.integers(lo, hi + 1, size=shape).astype(np.int8)
        for dim in (0, 1):
            ref = pack_to_int32(torch.from_numpy(c), bits, packed_dim=dim).numpy()
            ours = CT.pack_int32(c, bits, dim=dim)
            assert ref.shape == ours.shape and np.array_equal(ref, ours)
            back = unpack_from_int32(torch.from_numpy(ours), bits, torch.Size(shape), packed_dim=dim).numpy()
            assert np.array_equal(back, c)


@pytest.mark.ct_client
def test_pack_fp4_matches_compressed_tensors():
    _ct()
    import torch
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(6, 64)).astype(np.uint8)
    vals = torch.from_numpy(np.asarray(qcore.decode(codes, "float4_e2m1fn"), np.float32))
    ref = pack_fp4_to_uint8(vals).numpy()
    ours = CT.pack_fp4(codes)
    neg_zero = codes == 8  # -0.0: compressed-tensors keeps the sign bit too
    assert np.array_equal(ref, ours), neg_zero.sum()
    back = unpack_fp4_from_uint8(torch.from_numpy(ours), 6, 64, dtype=torch.float32).numpy()
    assert np.array_equal(back, vals.numpy())
    assert np.array_equal(CT.unpack_fp4(ours), codes)


def test_pack_errors():
    with pytest.raises(ValueError, match="outside"):
        CT.pack_int32(np.array([[8]]), 4)
    with pytest.raises(ValueError, match="bits"):
        CT.pack_int32(np.zeros((1, 8)), 9)
    with pytest.raises(ValueError, match="does not hold"):
        CT.unpack_int32(np.zeros((2, 3), np.int32), 4, (2, 8))
    with pytest.raises(ValueError, match="even"):
        CT.pack_fp4(np.zeros((2, 3), np.uint8))


@pytest.mark.parametrize("st", ["F32", "BF16", "F16"])
def test_scale_dtype_round_trip(st):
    s = np.array([0.1, 1.0, 3.5, 2.0 ** -20], np.float32)
    back = CT.scale_from_dtype(CT.scale_to_dtype(s, st), st)
    exact = qcore.cast(s, {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[st])
    assert np.array_equal(back, np.asarray(exact, np.float32))


# ---------------------------------------------------------------------------------------------------------------
# schema
# ---------------------------------------------------------------------------------------------------------------

ARGS = [
    {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128, "strategy": "group", "dynamic": False},
    {"num_bits": 4, "type": "int", "symmetric": False, "group_size": 32},
    {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
    {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
    {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False},
    {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
    {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "scale_dtype": "torch.uint8",
     "zp_dtype": "torch.uint8"},
    {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128, "actorder": "static", "observer": "mse"},
]


@pytest.mark.parametrize("d", ARGS)
def test_args_round_trip(d):
    a = CT.CTArgs.from_dict(d)
    again = CT.CTArgs.from_dict(a.to_dict())
    assert again == a and again.to_dict() == a.to_dict()


@pytest.mark.ct_client
@pytest.mark.parametrize("d", ARGS)
def test_args_serialize_as_compressed_tensors(d):
    _ct()
    from compressed_tensors.quantization import QuantizationArgs
    ref = QuantizationArgs.model_validate(d).model_dump()
    ours = CT.CTArgs.from_dict(d).to_dict()
    assert ours == {k: v for k, v in ref.items()}


@pytest.mark.parametrize("bad, msg", [
    ({"num_bits": 8, "strategy": "token"}, "dynamic"),
    ({"num_bits": 4, "strategy": "group"}, "group_size"),
    ({"num_bits": 4, "group_size": 32, "strategy": "channel"}, "strategy 'group'"),
    ({"num_bits": 8, "strategy": "block"}, "block_structure"),
    ({"num_bits": 8, "type": "complex"}, "type"),
    ({"num_bits": 8, "bogus": 1}, "unknown key"),
    ({"num_bits": 8, "strategy": "channel", "dynamic": True}, "dynamic"),
])
def test_args_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        CT.CTArgs.from_dict(bad, where="x")


def _config_dict(**over):
    d = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": ARGS[1], "input_activations": None,
                                       "output_activations": None, "format": "pack-quantized"}},
         "format": "pack-quantized", "global_compression_ratio": None, "ignore": ["lm_head"],
         "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
         "sparsity_config": {}, "transform_config": {}, "version": "0.20.0"}
    d.update(over)
    return d


def test_config_round_trip():
    d = _config_dict()
    c = CT.CTConfig.from_dict(d)
    assert c.scheme_format("group_0") is CT.CTFormat.PACK_QUANTIZED
    out = c.to_dict()
    assert CT.CTConfig.from_dict(out) == c
    assert out["config_groups"]["group_0"]["weights"] == CT.CTArgs.from_dict(ARGS[1]).to_dict()
    assert out["ignore"] == ["lm_head"] and out["quant_method"] == "compressed-tensors"


@pytest.mark.ct_client
def test_config_read_by_compressed_tensors():
    _ct()
    from compressed_tensors.quantization import QuantizationConfig
    ours = CT.CTConfig.from_dict(_config_dict(kv_cache_scheme={"num_bits": 8, "type": "float"})).to_dict()
    ref = QuantizationConfig.model_validate(ours)
    assert ref.format == "pack-quantized" and ref.ignore == ["lm_head"]
    assert ref.config_groups["group_0"].weights.group_size == 32 and ref.kv_cache_scheme.type == "float"


@pytest.mark.parametrize("over, msg", [
    ({"quant_method": "quark"}, "quant_method"),
    ({"quantization_status": "frozen"}, "compressed"),
    ({"format": "nvfp4-pack-quantized"}, "not supported"),
    ({"format": "bogus"}, "format"),
    ({"transform_config": {"x": 1}}, "transform_config"),
    ({"config_groups": {}}, "config_groups"),
    ({"unknown_key": 1}, "unknown key"),
])
def test_config_errors(over, msg):
    with pytest.raises(ValueError, match=msg):
        CT.CTConfig.from_dict(_config_dict(**over))


def test_mixed_precision_needs_group_formats():
    d = _config_dict(format="mixed-precision")
    d["config_groups"]["group_0"]["format"] = None
    with pytest.raises(ValueError, match="format per"):
        CT.CTConfig.from_dict(d).scheme_format("group_0")


# ---------------------------------------------------------------------------------------------------------------
# specs
# ---------------------------------------------------------------------------------------------------------------

SPECS = [
    ("weight", qcore.make_spec("int4", granularity=PerGroup(128, 1)), False),
    ("weight", qcore.make_spec("uint4", granularity=PerGroup(32, 1)), False),
    ("weight", qcore.make_spec("int8", granularity=PerChannel(0)), False),
    ("weight", qcore.make_spec("float8_e4m3fn", granularity=PerTensor()), False),
    ("weight", qcore.make_spec("float8_e4m3fn", granularity=PerBlock((128, 128), axes=(0, 1))), False),
    ("weight", qcore.make_spec("mxfp4", axis=1, scale_mode=qcore.ScaleMode.EVEN), False),
    ("input", qcore.make_spec("int8", granularity=PerChannel(0)), True),
    ("input", qcore.make_spec("float8_e4m3fn"), False),
    ("input", qcore.make_spec("mxfp4", axis=1, scale_mode=qcore.ScaleMode.EVEN), True),
]


@pytest.mark.parametrize("role, spec, dyn", SPECS)
def test_spec_round_trip(role, spec, dyn):
    a = CT.spec_to_args(spec, role=role, dynamic=dyn)
    back, d2 = CT.args_to_spec(a, role=role)
    assert d2 == dyn and back == spec


@pytest.mark.parametrize("role, spec, dyn, msg", [
    ("weight", qcore.make_spec("int8", granularity=PerChannel(0), narrow_range=True), False, "narrow"),
    ("weight", qcore.make_spec("mx9", axis=1), False, "micro-exponents"),
    ("input", qcore.make_spec("int8", granularity=PerChannel(1)), False, "per-feature"),
    ("weight", qcore.make_spec("int16"), False, "16-bit"),
    ("weight", qcore.make_spec("uint4", symmetric=True), False, "unsigned symmetric"),
    ("weight", qcore.make_spec("nvfp4", axis=1), False, "two-level|no spelling"),
    ("input", qcore.make_spec("mxfp4", axis=1), True, "scale_mode FLOOR"),
])
def test_spec_refusals(role, spec, dyn, msg):
    with pytest.raises(ValueError, match=msg):
        CT.spec_to_args(spec, role=role, dynamic=dyn, where="layer 'x'")


def test_infer_format():
    w4 = CT.CTArgs(num_bits=4, group_size=128)
    a8 = CT.CTArgs(num_bits=8, strategy="token", dynamic=True)
    f8 = CT.CTArgs(num_bits=8, type="float")
    assert CT.infer_format(w4, None) is CT.CTFormat.PACK_QUANTIZED
    assert CT.infer_format(CT.CTArgs(num_bits=8), a8) is CT.CTFormat.INT_QUANTIZED
    assert CT.infer_format(f8, f8) is CT.CTFormat.FLOAT_QUANTIZED
    assert CT.infer_format(f8, None) is CT.CTFormat.NAIVE_QUANTIZED
    assert CT.infer_format(CT.CTArgs(num_bits=4, type="float", group_size=32, scale_dtype="uint8"),
                           None) is CT.CTFormat.MXFP4_PACK_QUANTIZED


@pytest.mark.parametrize("spec, fmt", [
    (qcore.make_spec("int4", granularity=PerGroup(32, 1)), CT.CTFormat.PACK_QUANTIZED),
    (qcore.make_spec("uint4", granularity=PerChannel(0)), CT.CTFormat.PACK_QUANTIZED),
    (qcore.make_spec("uint8", granularity=PerChannel(0)), CT.CTFormat.INT_QUANTIZED),
    (qcore.make_spec("float8_e4m3fn", granularity=PerChannel(0)), CT.CTFormat.FLOAT_QUANTIZED),
    (qcore.make_spec("mxfp4", axis=1), CT.CTFormat.MXFP4_PACK_QUANTIZED),
])
def test_weight_codec_round_trip(spec, fmt):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    q = qcore.quantize(w, spec)
    enc = CT.encode_weight(q.codes, q.scales, q.zero_points, spec, w.shape, fmt=fmt, scale_dtype="F32")
    exp = CT.expected_weight(spec, w.shape, fmt=fmt, scale_dtype="F32")
    assert {k: (dt, tuple(a.shape)) for k, (dt, a) in enc.items()} == {k: (dt, tuple(s)) for k, (dt, s) in exp.items()}
    codes, scales, zp = CT.decode_weight({k: a for k, (_, a) in enc.items()}, spec, w.shape, fmt=fmt,
                                         dtypes={k: dt for k, (dt, _) in enc.items()})
    back = qcore.QTensor(codes=codes, scales=scales, zero_points=zp, spec=spec)
    assert np.array_equal(qcore.dequantize(back), qcore.dequantize(q))


def test_decode_validates_values():
    spec = qcore.make_spec("int4", granularity=PerGroup(32, 1))
    w = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    q = qcore.quantize(w, spec)
    fmt = CT.CTFormat.PACK_QUANTIZED
    enc = {k: a for k, (_, a) in CT.encode_weight(q.codes, q.scales, None, spec, w.shape, fmt=fmt,
                                                  scale_dtype="F32").items()}
    dts = {"weight_packed": "I32", "weight_scale": "F32", "weight_shape": "I64"}
    bad = dict(enc, weight_scale=np.where(np.arange(16).reshape(8, 2) == 3, -1.0, enc["weight_scale"]).astype(
        np.float32))
    with pytest.raises(ValueError, match="weight_scale"):
        CT.decode_weight(bad, spec, w.shape, fmt=fmt, dtypes=dts, where="layer 'x'")
    with pytest.raises(ValueError, match="weight_shape"):
        CT.decode_weight(dict(enc, weight_shape=np.array([8, 32])), spec, w.shape, fmt=fmt, dtypes=dts)
    gi = np.arange(64)[::-1] // 32
    with pytest.raises(ValueError, match="g_idx"):
        CT.decode_weight(dict(enc, weight_g_idx=gi), spec, w.shape, fmt=fmt, dtypes=dts)
    with pytest.raises(ValueError, match="divide"):
        CT.expected_weight(spec, (8, 48), fmt=fmt, scale_dtype="F32")

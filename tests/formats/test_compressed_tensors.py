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


# ---------------------------------------------------------------------------------------------------------------
# which config group quantizes a module (issue 33): compressed-tensors' rule and vLLM's
# ---------------------------------------------------------------------------------------------------------------

_Q, _K, _V = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj")
_O, _DOWN = "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"
_LIN = ("Linear", "Module")
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_MODULES = [(n, _LIN) for n in (_Q, _K, _V, _O, _DOWN, "lm_head")]

# (what, {group: targets} in config order, ignore, module, compressed-tensors' group, vLLM's group); None: float,
# "refused": vLLM refuses the config. Read off compressed_tensors 0.20 (utils/match.py match_targets / is_match,
# quantization/lifecycle/apply.py) and vLLM (compressed_tensors/utils.py at 008014e8503b: should_ignore_layer,
# find_matched_target, _find_first_match, _match_fused_layer)
PRECEDENCE = [
    ("a regex target beats a class target (the reported W4A8 -> W4A16)",
     {"w4a16": ["Linear"], "w4a8": ["re:.*down_proj"]}, [], _DOWN, "w4a8", "w4a8"),
    ("an exact name beats a class target", {"a": ["Linear"], "b": [_DOWN]}, [], _DOWN, "b", "b"),
    ("exact before regex in config order: both take the exact name", {"a": [_DOWN], "b": ["re:.*down_proj"]}, [],
     _DOWN, "a", "a"),
    ("regex before exact in config order: compressed-tensors ranks exact names first, vLLM keeps config order",
     {"a": ["re:.*down_proj"], "b": [_DOWN]}, [], _DOWN, "b", "a"),
    ("two regexes: compressed-tensors sorts them, vLLM keeps config order",
     {"a": ["re:.*mlp.*"], "b": ["re:.*down_proj"]}, [], _DOWN, "b", "a"),
    ("a target given twice belongs to the later group", {"a": ["Linear"], "b": ["Linear"]}, [], _O, "b", "b"),
    ("re: patterns are re.match, anchored at the start", {"a": ["re:down_proj"]}, [], _DOWN, None, None),
    ("no target matches: float", {"a": [_O]}, [], _DOWN, None, None),
    ("ignore by exact name", {"a": ["Linear"]}, ["lm_head"], "lm_head", None, None),
    ("ignore by regex", {"a": ["Linear"]}, ["re:.*mlp.*"], _DOWN, None, None),
    ("an ignore entry naming a class: compressed-tensors ignores, vLLM matches names only",
     {"a": ["re:.*"]}, ["Linear"], _O, None, "a"),
    ("a class target as a substring: vLLM only (case-insensitive substring of its class name)",
     {"a": ["near"]}, [], _O, None, "a"),
    ("fused q/k/v named exactly beside a Linear group: vLLM's qkv_proj matches the class target first",
     {"w4a16": ["Linear"], "w4a8": [_Q, _K, _V]}, [], _K, "w4a8", "w4a16"),
    ("fused q/k/v named exactly, no class target: vLLM takes the first shard's target",
     {"a": [_Q, _K, _V], "b": [_O]}, [], _V, "a", "a"),
    ("fused shards in different groups: vLLM gives all of them q_proj's group",
     {"a": [_Q], "b": [_K, _V]}, [], _K, "b", "a"),
    ("a regex matching the fused name (.*v_proj matches ...qkv_proj): vLLM takes it for q too",
     {"a": ["Linear"], "b": ["re:.*v_proj"]}, [], _Q, "a", "b"),
    ("one shard of a fused module ignored: vLLM refuses", {"a": ["Linear"]}, [_Q], _K, "a", "refused"),
    ("every shard ignored: float for both", {"a": ["Linear"]}, [_Q, _K, _V], _V, None, None),
]


@pytest.mark.parametrize("what, groups, ignore, name, want_ct, want_vllm", PRECEDENCE, ids=[c[0] for c in PRECEDENCE])
def test_target_precedence(what, groups, ignore, name, want_ct, want_vllm):
    ct, v = CT.resolve_groups(_MODULES, groups, ignore, fused=_FUSED)[name]
    assert ct.group == want_ct
    assert ("refused" if v.refused else v.group) == want_vllm
    assert (v.layer == "model.layers.0.self_attn.qkv_proj") == (name in (_Q, _K, _V))
    assert ct.describe() and v.describe()


def _their_groups(names_classes, groups, ignore):
    """compressed-tensors' own decision: apply_quantization_config on a module tree with these names, each group
    told apart by its num_bits."""
    _ct()
    import torch
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    class MyLinear(torch.nn.Linear):
        pass

    root = torch.nn.Module()
    for name, cls in names_classes:
        parent = root
        *path, leaf = name.split(".")
        for p in path:
            if not hasattr(parent, p):
                parent.add_module(p, torch.nn.Module())
            parent = getattr(parent, p)
        parent.add_module(leaf, (MyLinear if cls[0] == "MyLinear" else torch.nn.Linear)(4, 4))
    bits = {g: 2 + i for i, g in enumerate(groups)}
    cfg = QuantizationConfig(config_groups={g: {"targets": list(t), "weights": {"num_bits": bits[g]}}
                                            for g, t in groups.items()}, ignore=list(ignore),
                             quantization_status="initialized")
    apply_quantization_config(root, cfg, show_progress=False)
    by_bits = {b: g for g, b in bits.items()}
    out = {}
    for name, _ in names_classes:
        s = getattr(root.get_submodule(name), "quantization_scheme", None)
        out[name] = None if s is None else by_bits[s.weights.num_bits]
    return out


@pytest.mark.ct_client
def test_ct_match_is_compressed_tensors_own_matching():
    """ct_match against the installed compressed-tensors' apply_quantization_config on the same names: every case
    of the precedence table, then random configs from a pool of targets (names, patterns, classes)."""
    import random
    mods = _MODULES + [("model.layers.0.mlp.gate_proj", ("MyLinear", "Linear", "Module"))]
    cases = [(g, i) for _, g, i, *_ in PRECEDENCE]
    pool = ["Linear", "MyLinear", "re:.*proj", "re:.*mlp.*", "re:.*down_proj", "re:model\\.layers\\.0\\..*", _DOWN,
            _Q, _O, "lm_head", "re:.*(q|k)_proj$", "Module"]
    rng = random.Random(0)
    for _ in range(40):
        groups = {f"g{j}": rng.sample(pool, rng.randint(1, 3)) for j in range(rng.randint(1, 4))}
        cases.append((groups, rng.sample(pool, rng.randint(0, 2)) if rng.random() < 0.5 else []))
    for groups, ignore in cases:
        theirs = _their_groups(mods, groups, ignore)
        ours = {n: m[0].group for n, m in CT.resolve_groups(mods, groups, ignore).items()}
        assert ours == theirs, (groups, ignore)

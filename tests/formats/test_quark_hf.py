"""qcore.formats.quark_hf: AMD Quark's quantization_config, read and written exactly, converted to qcore specs.

The fixtures in data/quark_configs/ were written by Quark 0.13 itself (data/make_quark_configs.py); the numerics
checks compare converted specs with the independent Quark oracle tests/qcore/quark_reference.py.
"""

import ast
import dataclasses
import json
import pathlib

import numpy as np
import pytest

import qcore
from qcore import PerChannel, PerGroup, PerTensor, RoundingMode, ScaleMode, TensorScale, make_spec
from qcore.formats.quark_hf import (QuarkConfig, QuarkExport, QuarkLayerSpec, QuarkSpec, Role, qcore_to_quark,
                                    quark_to_qcore)

import quark_reference as qr  # noqa: E402  (tests/qcore is on sys.path via the rootdir conftest)

DATA = pathlib.Path(__file__).resolve().parent / "data" / "quark_configs"
FIXTURES = sorted(p.stem for p in DATA.glob("*.json"))

# Quark 0.13's LLMTemplate schemes (all but the alias fp4_block16_scale_e4m3), the KV-cache and exclude
# variants, and the w_* recipes of the older example that run on 0.13 (make_quark_configs.py's docstring).
EXPECTED_FIXTURES = sorted([
    "amdfp4", "amdfp4_g32", "amdfp4_global16", "amdfp4_global32", "bfp16", "fp8", "fp8_kv_fp8", "int4_fp8",
    "int4_wa_64", "int4_wo_128", "int4_wo_128_exclude", "int4_wo_32", "int4_wo_64", "int4_wo_per_channel", "int8",
    "mx6", "mx9", "mxfp4", "mxfp4_fp8", "mxfp4_mxfp6_e2m3", "mxfp4_weight_only", "mxfp6_e2m3", "mxfp6_e3m2",
    "nvfp4", "ptpc_fp8", "uint4_wo_128", "uint4_wo_32", "uint4_wo_64", "uint4_wo_per_channel",
    "w_fp8_a_fp8", "w_int2_per_group_asym", "w_int4_per_group_sym", "w_int8_a_int8_per_tensor_sym",
    "w_int8_a_int8_per_token_dynamic", "w_int8_per_channel_a_int8_per_tensor_sym", "w_mxfp4_a_mxfp4",
    "w_mxfp6_e2m3_a_mxfp6_e2m3", "w_mxfp6_e3m2_a_mxfp6_e3m2", "w_mxfp8_a_mxfp8", "w_mxint8",
    "w_uint4_per_group_asym",
])

# Specs qcore cannot compute as Quark does: fixture -> the field the ValueError must name.
UNSUPPORTED = {"amdfp4": "scale_format", "amdfp4_g32": "scale_format", "amdfp4_global16": "dtype",
               "amdfp4_global32": "dtype", "w_mxint8": "scale_calculation_mode"}
# Fixtures written with another spelling of the same numerics than Quark 0.13's defaults that from_qcore
# derives (scale_type null/"float32" where the templates write "float"; ch_axis 1 where they write -1).
RESPELLED = {"fp8_kv_fp8": {"scale_type"}, "int4_fp8": {"scale_type"}, "mxfp4_fp8": {"scale_type"},
             "w_fp8_a_fp8": {"scale_type"}, "w_int2_per_group_asym": {"ch_axis"},
             "w_int4_per_group_sym": {"ch_axis"}, "w_uint4_per_group_asym": {"ch_axis"}}
ROLE_OF = {"weight": Role.WEIGHT, "input_tensors": Role.INPUT, "output_tensors": Role.OUTPUT, "bias": Role.BIAS}


def load(name):
    return json.loads((DATA / f"{name}.json").read_text())


def role_values(config):
    """(where, attribute, role, value) for every quantized role of every layer spec of a config."""
    layers = {"global": config.global_quant_config}
    layers.update({f"layer {k}": v for k, v in config.layer_quant_config.items()})
    layers.update({f"kv {k}": v for k, v in config.kv_cache_quant_config.items()})
    for where, layer in layers.items():
        for attr, role in ROLE_OF.items():
            value = getattr(layer, attr)
            if value is not None:
                yield where, attr, role, value


def differing(a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    assert len(a) == len(b)
    return {f.name for x, y in zip(a, b) for f in dataclasses.fields(QuarkSpec)
            if getattr(x, f.name) != getattr(y, f.name)}


def same_bits(a, b):
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


def test_fixture_inventory():
    assert FIXTURES == EXPECTED_FIXTURES


# ---- schema: exact round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FIXTURES)
def test_config_dict_round_trip(name):
    d = load(name)
    config = QuarkConfig.from_dict(d)
    assert config.to_dict() == d
    assert config.to_json() + "\n" == (DATA / f"{name}.json").read_text()  # Quark's key order, byte for byte
    assert QuarkConfig.from_json(json.dumps({"model_type": "llama", "quantization_config": d})) == config
    for _, _, _, value in role_values(config):
        for spec in value if isinstance(value, tuple) else (value,):
            assert QuarkSpec.from_dict(spec.to_dict()) == spec


def test_parsed_structure():
    config = QuarkConfig.from_dict(load("fp8_kv_fp8"))
    assert set(config.kv_cache_quant_config) == {"*k_proj", "*v_proj"}
    kv = config.kv_cache_quant_config["*k_proj"].output_tensors
    assert (kv.dtype, kv.qscheme, kv.is_dynamic) == ("fp8_e4m3", "per_tensor", False)
    assert config.export == QuarkExport(kv_cache_group=("*k_proj", "*v_proj"))
    assert config.exclude == ("lm_head",) and config.version == "0.13" and not config.omitted
    assert QuarkConfig.from_dict(load("int4_wo_128_exclude")).exclude == (
        "lm_head", "*mlp.gate", "*mlp.gate.*", "model.layers.0.*")
    nv = QuarkConfig.from_dict(load("nvfp4")).global_quant_config.weight
    assert isinstance(nv, tuple) and [s.is_scale_quant for s in nv] == [False, True]


# ---- conversion: every fixture spec -> qcore -> the same spec ---------------------------------------------------
@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_specs_round_trip_through_qcore(name):
    config = QuarkConfig.from_dict(load(name))
    respelled = set()
    for where, attr, role, value in role_values(config):
        if name == "int4_fp8" and attr == "weight":  # progressive: fp8, then int4 of the fp8 values
            with pytest.raises(ValueError, match="progressive"):
                quark_to_qcore(value, role=role)
            stages = value
        elif name in UNSUPPORTED:
            with pytest.raises(ValueError, match=UNSUPPORTED[name]):
                quark_to_qcore(value, role=role)
            continue
        else:
            stages = (value,)
        for v in stages:
            spec, dynamic = quark_to_qcore(v, role=role)
            first = v[0] if isinstance(v, tuple) else v
            hints = {"ch_axis": first.ch_axis, "scale_type": first.scale_type}
            back = qcore_to_quark(spec, role=role, dynamic=dynamic, observer=first.observer_cls, quark_fields=hints)
            assert back == v, (where, attr)
            # Without hints: Quark 0.13's own defaults (observer_cls derived too), except the listed spellings.
            derived = qcore_to_quark(spec, role=role, dynamic=dynamic)
            diff = differing(v, derived)
            assert diff <= RESPELLED.get(name, set()), (where, attr, diff)
            respelled |= diff
            assert quark_to_qcore(derived, role=role) == (spec, dynamic)  # same numerics either way
    assert respelled == RESPELLED.get(name, set())


# ---- numerics of converted specs ------------------------------------------------------------------------------
def spec_of(name, attr="weight", index=None):
    value = getattr(QuarkConfig.from_dict(load(name)).global_quant_config, attr)
    return quark_to_qcore(value if index is None else value[index], role=ROLE_OF[attr])


def data(shape, seed):
    """Normal values over many binades, an all-zero block, a one-outlier block (as test_quark_formats.py)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, shape[:-1] + (1,)))).astype(np.float32)
    x[0, :32] = 0.0
    x[1, 5] = 1e3 * np.abs(x[1]).max()
    return x


@pytest.mark.parametrize("name,attr,element,block", [
    ("mxfp4", "weight", "fp4", "mxfp4"), ("mxfp4", "input_tensors", "fp4", "mxfp4"),
    ("w_mxfp4_a_mxfp4", "weight", "fp4", "mxfp4"), ("mxfp6_e2m3", "weight", "fp6_e2m3", "mxfp6_e2m3"),
    ("mxfp6_e3m2", "input_tensors", "fp6_e3m2", "mxfp6_e3m2"), ("w_mxfp8_a_mxfp8", "weight", "fp8_e4m3", "mxfp8_e4m3"),
])
def test_mx_specs_are_qcore_even_mx_and_match_quark(name, attr, element, block):
    spec, dynamic = spec_of(name, attr)
    assert spec == make_spec(block, axis=1, scale_mode=ScaleMode.EVEN)
    assert dynamic is (attr == "input_tensors")
    x = data((16, 256), seed=7)
    ours, theirs = qcore.fake_quantize(x, spec), qr.quark_mx_fp(x, element=element, mode="even")
    # Quark's fp element kernel writes +0 for every zero result; qcore keeps -0 (docs/quark_block_semantics.md).
    assert same_bits(np.where(ours == 0, 0, ours), np.where(theirs == 0, 0, theirs))
    # Quark's "even" is not the OCP FLOOR default: amax 7 (fp4) takes scale 2 (7 -> 3.5 -> 4 -> 8), not 1 (-> 6).
    if element == "fp4":
        y = np.zeros((1, 32), np.float32)
        y[0, 0] = 7.0
        assert qcore.fake_quantize(y, spec)[0, 0] == 8.0 and qcore.fake_quantize(y, block)[0, 0] == 6.0
        assert qr.quark_mx_fp(y, element="fp4", mode="even")[0, 0] == 8.0


@pytest.mark.parametrize("name,ref", [("mx9", qr.quark_mx9), ("mx6", qr.quark_mx6)])
def test_microexponent_specs_match_quark(name, ref):
    for attr in ("weight", "input_tensors"):
        spec, dynamic = spec_of(name, attr)
        assert spec == make_spec(name, axis=1) and spec.subblock_shift_bits == 1 and dynamic is True
    x = data((16, 256), seed=3)
    assert same_bits(qcore.fake_quantize(x, spec), ref(x, impl="torch"))


def test_bfp16_spec_matches_quark():
    spec, _ = spec_of("bfp16")
    assert spec == make_spec("bfp16", axis=1) and spec.bump_on_overflow
    x = data((16, 256), seed=2)
    x[2, 16:24] = np.float32(2.0**5 * 127.9 / 64)  # rounds to code 128: the exponent bump
    assert same_bits(qcore.fake_quantize(x, spec), qr.quark_bfp16(x, impl="torch"))


def test_integer_specs_use_quarks_scale_rules():
    w = data((8, 128), seed=5)
    spec, dynamic = spec_of("int8")  # per tensor, symmetric: scale = amax / 127.5 over [-128, 127]
    assert (spec.granularity, spec.symmetric, spec.narrow_range, dynamic) == (PerTensor(), True, False, False)
    q = qcore.quantize(w, spec)
    assert q.scales.item() == np.float32(np.abs(w).max()) / np.float32(127.5)
    spec, _ = spec_of("uint4_wo_32")  # per group of 32 along in_features, asymmetric, int32 zero point
    assert spec == make_spec("uint4", granularity=PerGroup(32, 1))
    q = qcore.quantize(w, spec)
    g = w.reshape(8, 4, 32)
    lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
    scale = (hi - lo) / np.float32(15)
    live = hi > lo  # an all-zero group: scale 1 in qcore, eps in Quark (its codes are 0 either way)
    assert not live[0, 0] and live.sum() == live.size - 1
    assert np.array_equal(q.scales[live], scale[live])
    with np.errstate(invalid="ignore"):
        zero_point = np.clip(0 - np.rint(lo / scale), 0, 15)  # Quark: quant_min - round(min / scale), clamped
    assert np.array_equal(q.zero_points[live], zero_point[live])
    spec, _ = spec_of("int4_wo_per_channel")
    assert spec == make_spec("int4", axis=0) and qcore.quantize(w, spec).scales.shape == (8, 1)


def test_per_token_fp8_and_two_level_nvfp4():
    weight, wdyn = spec_of("ptpc_fp8")
    act, adyn = spec_of("ptpc_fp8", "input_tensors")
    assert (weight.granularity, wdyn, act.granularity, adyn) == (PerChannel(0), False, PerChannel(0), True)
    tokens = data((6, 64), seed=1)
    assert np.array_equal(qcore.quantize(tokens, act).scales[:, 0], np.abs(tokens).max(1) / np.float32(448))
    spec, dynamic = spec_of("nvfp4")  # static scale-of-scales: the tensor scale is given (stored)
    assert spec == make_spec("nvfp4", axis=1, tensor_scale_mode=TensorScale.GIVEN) and dynamic is False
    spec, dynamic = spec_of("nvfp4", "input_tensors")
    assert spec.tensor_scale_mode is TensorScale.GIVEN and dynamic is True
    dyn = qcore_to_quark(make_spec("nvfp4", axis=1), role="input", dynamic=True)  # AMAX: dynamic tensor scale
    assert dyn[1].is_dynamic is True and dyn[1].is_scale_quant
    with pytest.raises(ValueError, match="tensor_scale_mode"):
        qcore_to_quark(make_spec("nvfp4", axis=1, tensor_scale_mode=TensorScale.ONE), role="weight", dynamic=False)


@pytest.mark.parametrize("scale_type,ok", [("float", True), (None, True), ("float32", True), ("bfloat16", True),
                                           ("float8_e8m0fnu", True), ("float16", False), ("pof2", False)])
def test_mx_scale_storage(scale_type, ok):
    spec = dataclasses.replace(mxfp4(-1), scale_type=scale_type)
    if ok:
        assert spec.to_qcore(role="input")[0] == make_spec("mxfp4", axis=1, scale_mode=ScaleMode.EVEN)
    else:
        with pytest.raises(ValueError, match="scale_type"):
            spec.to_qcore(role="input")
    with pytest.raises(ValueError, match="scale_type"):  # scale_type "float" in a float16 model
        mxfp4(-1).to_qcore(role="input", model_dtype="float16")


def test_scale_type_float_means_the_model_dtype():
    w = QuarkConfig.from_dict(load("int8")).global_quant_config.weight
    assert w.to_qcore(role="weight")[0].scale_dtype.name == "float32"
    spec, _ = w.to_qcore(role="weight", model_dtype="bfloat16")
    assert spec.scale_dtype.name == "bfloat16"
    assert QuarkSpec.from_qcore(spec, role="weight", dynamic=False, model_dtype="bfloat16") == w
    assert QuarkSpec.from_qcore(spec, role="weight", dynamic=False).scale_type == "bfloat16"
    with pytest.raises(ValueError, match="model_dtype"):
        w.to_qcore(role="weight", model_dtype="float8_e4m3fn")


# ---- axes ----------------------------------------------------------------------------------------------------------
def fp8(qscheme, ch_axis, dynamic=False, **kw):
    obs = {"per_tensor": "PerTensorMinMaxObserver", "per_channel": "PerChannelMinMaxObserver"}[qscheme]
    return QuarkSpec(dtype="fp8_e4m3", is_dynamic=dynamic, qscheme=qscheme, ch_axis=ch_axis, symmetric=True,
                     round_method="half_even", scale_type="float", observer_cls=obs, **kw)


def mxfp4(ch_axis, dynamic=True):
    return QuarkSpec(dtype="fp4", is_dynamic=dynamic, qscheme="per_group", ch_axis=ch_axis, group_size=32,
                     round_method="half_even", scale_type="float", scale_format="e8m0",
                     scale_calculation_mode="even", observer_cls="PerBlockMXObserver")


@pytest.mark.parametrize("spec,role,granularity", [
    (fp8("per_channel", 0), "weight", PerChannel(0)),
    (fp8("per_channel", 1), "weight", PerChannel(1)),
    (fp8("per_channel", -1), "weight", PerChannel(1)),
    (fp8("per_channel", 1, True), "input", PerChannel(0)),    # per token (Quark: [batch, seq, features])
    (fp8("per_channel", -1, True), "input", PerChannel(1)),   # per feature
    (fp8("per_channel", 0), "bias", PerChannel(0)),
    (mxfp4(-1, False), "weight", PerGroup(32, 1)),
    (mxfp4(1, False), "weight", PerGroup(32, 1)),
    (mxfp4(0, False), "weight", PerGroup(32, 0)),
    (mxfp4(-1), "input", PerGroup(32, 1)),
    (mxfp4(-1), "output", PerGroup(32, 1)),
    (fp8("per_tensor", None), "output", PerTensor()),
])
def test_axis_mapping(spec, role, granularity):
    q, _ = spec.to_qcore(role=role)
    assert q.granularity == granularity
    # from_qcore writes Quark 0.13's spelling; the given one when asked.
    default = {("weight", PerChannel(1)): 1, ("input", PerChannel(1)): -1}.get((role, granularity))
    back = QuarkSpec.from_qcore(q, role=role, dynamic=spec.is_dynamic, quark_fields={"ch_axis": spec.ch_axis})
    assert back == spec
    written = QuarkSpec.from_qcore(q, role=role, dynamic=spec.is_dynamic).ch_axis
    if default is not None:
        assert written == default
    elif isinstance(granularity, PerGroup):
        assert written == (0 if granularity.axis == 0 else -1)


@pytest.mark.parametrize("spec,role", [
    (fp8("per_channel", 0, True), "input"),   # axis 0 of [batch, seq, features] is the batch
    (fp8("per_channel", 2, True), "input"),
    (fp8("per_channel", 2), "weight"),
    (fp8("per_channel", 1), "bias"),
    (mxfp4(1), "input"),                      # groups along the sequence axis
])
def test_ambiguous_axes_are_refused(spec, role):
    with pytest.raises(ValueError, match="ch_axis"):
        spec.to_qcore(role=role)


def test_from_qcore_needs_canonical_axes():
    with pytest.raises(ValueError, match="granularity"):
        QuarkSpec.from_qcore(make_spec("mxfp4", scale_mode=ScaleMode.EVEN), role="weight", dynamic=False)  # axis -1
    with pytest.raises(ValueError, match="granularity"):
        QuarkSpec.from_qcore(make_spec("int8", axis=1), role="bias", dynamic=False)
    with pytest.raises(ValueError, match="role"):
        mxfp4(-1).to_qcore(role="activation")


# ---- observers ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,role,observer", [
    (make_spec("int8"), "weight", "PerTensorMinMaxObserver"),
    (make_spec("float8_e4m3fn", axis=0), "weight", "PerChannelMinMaxObserver"),
    (make_spec("int4", granularity=PerGroup(128, 1)), "weight", "PerGroupMinMaxObserver"),
    (make_spec("mxfp4", axis=1, scale_mode=ScaleMode.EVEN), "input", "PerBlockMXObserver"),
    (make_spec("float8_e4m3fn", granularity=PerGroup(128, 1)), "input", "PerBlockMXObserver"),
    (make_spec("float8_e4m3fn", granularity=qcore.PerBlock((128, 128), (0, 1))), "weight",
     "PerBlock2DMinMaxObserver"),
    (make_spec("mx9", axis=1), "weight", None),
])
def test_derived_observer(spec, role, observer):
    q = QuarkSpec.from_qcore(spec, role=role, dynamic=role != "weight")
    assert q.observer_cls == observer
    assert q.to_qcore(role=role)[0] == spec


def test_observer_rules():
    static = QuarkSpec.from_qcore(make_spec("int8"), role="weight", dynamic=False, observer="PerTensorMSEObserver")
    assert static.observer_cls == "PerTensorMSEObserver" and static.to_qcore(role="weight")[0] == make_spec("int8")
    with pytest.raises(ValueError, match="observer_cls"):  # a dynamic MSE scale is not the amax rule
        QuarkSpec.from_qcore(make_spec("int8"), role="input", dynamic=True, observer="PerTensorMSEObserver")
    with pytest.raises(ValueError, match="observer_cls"):  # Quark's own check: observer fits the qscheme
        QuarkSpec.from_qcore(make_spec("int8"), role="weight", dynamic=False, observer="PerChannelMinMaxObserver")
    with pytest.raises(ValueError, match="observer"):
        QuarkSpec.from_qcore(make_spec("mx9", axis=1), role="weight", dynamic=True, observer="PerBlockMXObserver")


# ---- what does not convert ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,role,dynamic,field", [
    (make_spec("int8", axis=0, narrow_range=True), "weight", False, "narrow_range"),
    (make_spec("int8", rounding=RoundingMode.STOCHASTIC), "weight", False, "rounding"),
    (make_spec("float8_e4m3fn", saturate=False), "input", False, "saturate"),
    (make_spec("mxfp4", axis=1, scale_mode=ScaleMode.RCEIL), "input", True, "scale_mode"),
    (make_spec("mxint8", axis=1, scale_mode=ScaleMode.EVEN), "weight", False, "scale_calculation_mode"),
    (make_spec("mx4", axis=1), "weight", False, "mx4"),
    (make_spec("mx9", axis=1), "input", False, "dynamic"),
    (make_spec("uint4", symmetric=True), "weight", False, "symmetric"),
    (make_spec("int8", scale_dtype="float8_e4m3fn"), "weight", False, "scale_dtype"),
    (make_spec("float4_e2m1fn", granularity=PerGroup(16, 1), scale_dtype="float8_e4m3fn"), "weight", False,
     "scale_dtype"),
])
def test_unrepresentable_qcore_specs_raise(spec, role, dynamic, field):
    with pytest.raises(ValueError, match=field):
        qcore_to_quark(spec, role=role, dynamic=dynamic)


def spec_dict(**changes):
    d = load("int8")["global_quant_config"]["weight"]
    d.update(changes)
    return d


@pytest.mark.parametrize("changes,field", [
    (dict(round_method="round"), "round_method"),
    (dict(scale_type="pof2"), "scale_type"),
    (dict(symmetric=False, zero_point_type="float32"), "zero_point_type"),
    (dict(dtype="int32"), "dtype"),
    (dict(dtype="bfloat16", observer_cls="PlaceholderObserver"), "dtype"),
    (dict(is_dynamic=True, observer_cls="PerTensorPercentileObserver"), "observer_cls"),
    (dict(dtype="mx9", observer_cls=None, symmetric=None, round_method=None, scale_type=None, ch_axis=-1,
          group_size=16), "qscheme"),  # Quark ignores qscheme for mx9 (with a warning): refused, not dropped
    (dict(dtype="bfp16", qscheme=None, observer_cls=None, symmetric=None, round_method=None, scale_type=None,
          ch_axis=-1, group_size=16), "group_size"),
    (dict(qscheme="per_group", observer_cls="PerGroupMinMaxObserver", ch_axis=-1, group_size=-1), "group_size"),
])
def test_quark_only_fields_raise_in_to_qcore(changes, field):
    spec = QuarkSpec.from_dict(spec_dict(**changes))  # a valid Quark spec ...
    with pytest.raises(ValueError, match=field):        # ... that qcore cannot compute the same way
        spec.to_qcore(role="weight")


# ---- validation and messages -------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes,error,words", [
    (dict(dtype="int9"), ValueError, ["dtype", "int9"]),
    (dict(qscheme="per_row"), ValueError, ["qscheme", "per_row"]),
    (dict(group_size="32"), TypeError, ["group_size", "'32'"]),
    (dict(group_size=0), ValueError, ["group_size", "0"]),
    (dict(symmetric="yes"), TypeError, ["symmetric", "yes"]),
    (dict(is_dynamic=1), TypeError, ["is_dynamic"]),
    (dict(ch_axis=True), TypeError, ["ch_axis"]),
    (dict(block_size=[128]), ValueError, ["block_size"]),
    (dict(observer_cls="MyObserver"), ValueError, ["observer_cls", "MyObserver"]),
    (dict(observer_cls="PerChannelMinMaxObserver"), ValueError, ["observer_cls", "per_tensor"]),
    (dict(observer_cls=None), ValueError, ["observer_cls"]),
    (dict(scale_calculation_mode="rceil"), ValueError, ["scale_calculation_mode"]),
    (dict(max_input_numel=1.5), TypeError, ["max_input_numel"]),
])
def test_spec_validation_names_the_field(changes, error, words):
    with pytest.raises(error) as e:
        QuarkSpec.from_dict(spec_dict(**changes))
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("key", ["dtype", "is_dynamic", "ch_axis", "group_size", "symmetric"])
def test_missing_required_spec_field(key):
    d = spec_dict()
    del d[key]
    with pytest.raises(ValueError, match=f"missing field.*{key}"):
        QuarkSpec.from_dict(d)


def test_config_errors_name_the_json_path():
    d = load("nvfp4")
    d["global_quant_config"]["weight"][1]["dtype"] = "fp7"
    with pytest.raises(ValueError, match=r"global_quant_config: weight\[1\]: QuarkSpec.dtype.*fp7"):
        QuarkConfig.from_dict(d)
    d = load("fp8_kv_fp8")
    d["kv_cache_quant_config"]["*v_proj"]["output_tensors"]["is_dynamic"] = "no"
    with pytest.raises(TypeError, match=r"kv_cache_quant_config\['\*v_proj'\]: output_tensors: .*is_dynamic"):
        QuarkConfig.from_dict(d)
    for key, error in [("global_quant_config", ValueError), ("exclude", ValueError)]:
        d = load("int8")
        del d[key]
        with pytest.raises(error, match=key):
            QuarkConfig.from_dict(d)
    d = load("int8")
    d["exclude"] = "lm_head"
    with pytest.raises(TypeError, match="exclude"):
        QuarkConfig.from_dict(d)
    d = load("int8")
    d["quant_method"] = "awq"
    with pytest.raises(ValueError, match="quant_method"):
        QuarkConfig.from_dict(d)
    d = load("int8")
    d["export"]["pack_method"] = "zigzag"
    with pytest.raises(ValueError, match="export: QuarkExport.pack_method.*zigzag"):
        QuarkConfig.from_dict(d)
    d = load("mxfp4")
    d["global_quant_config"]["input_tensors"]["is_dynamic"] = False  # Quark refuses static per-group activations
    with pytest.raises(ValueError, match="input_tensors"):
        QuarkConfig.from_dict(d)
    with pytest.raises(TypeError, match="QuarkSpec.from_dict"):
        QuarkSpec.from_dict([1, 2])


def test_unknown_and_absent_keys_round_trip():
    d = load("int4_wo_128")
    d["future_key"] = {"a": [1, 2]}
    d["global_quant_config"]["weight"]["new_spec_field"] = "x"
    d["global_quant_config"]["future_role"] = None
    d["export"]["something"] = 3
    for k in ("zero_point_type", "enable_buffer_reuse", "max_input_numel", "block_size", "is_scale_quant"):
        del d["global_quant_config"]["weight"][k]  # as older Quark versions wrote specs
    for k in ("kv_cache_post_rope", "softmax_quant_spec", "version"):
        del d[k]
    config = QuarkConfig.from_dict(d)
    assert config.to_dict() == d and list(config.to_dict()) == list(d)
    w = config.global_quant_config.weight
    assert w.extra == {"new_spec_field": "x"} and "max_input_numel" in w.omitted
    assert config.extra["future_key"]["a"] == (1, 2)
    assert w.to_qcore(role="weight")[0] == make_spec("int4", granularity=PerGroup(128, 1))
    with pytest.raises(ValueError, match="omitted"):
        dataclasses.replace(w, max_input_numel=5)
    with pytest.raises(ValueError, match="extra"):
        dataclasses.replace(w, extra={"dtype": "int8"})


def test_frozen():
    config = QuarkConfig.from_dict(load("mxfp4"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.exclude = ()
    with pytest.raises(TypeError):
        config.layer_quant_config["x"] = config.global_quant_config
    with pytest.raises(TypeError):
        config.global_quant_config.weight.extra["k"] = 1
    w = config.global_quant_config.weight
    assert len({w, QuarkSpec.from_dict(w.to_dict()), config.global_quant_config.input_tensors}) == 2  # hashable


def test_layer_to_qcore_and_building_a_config():
    layer = QuarkConfig.from_dict(load("mxfp4")).global_quant_config
    out = layer.to_qcore()
    assert set(out) == {Role.WEIGHT, Role.INPUT}
    w = qcore_to_quark(out[Role.WEIGHT][0], role="weight", dynamic=False)
    a = qcore_to_quark(out[Role.INPUT][0], role="input", dynamic=True)
    built = QuarkConfig(global_quant_config=QuarkLayerSpec(weight=w, input_tensors=a), exclude=["lm_head"],
                        version="0.13", export=QuarkExport())
    assert built.to_dict() == load("mxfp4")
    with pytest.raises(ValueError, match="weight"):
        QuarkConfig.from_dict(load("int4_fp8")).global_quant_config.to_qcore()


def test_imports_only_qcore_numpy_and_stdlib(numpy_only):
    src = (pathlib.Path(__file__).resolve().parents[2] / "src" / "qcore" / "formats" / "quark_hf.py").read_text()
    roots = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    assert roots <= {"qcore", "numpy", "__future__", "dataclasses", "enum", "json", "types", "typing"}, roots
    numpy_only("import qcore.formats.quark_hf")

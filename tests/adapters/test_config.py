"""ModelConfig and friends: validation at construction, JSON round trips, presets as data."""

import json

import pytest

torch = pytest.importorskip("torch")

import qcore  # noqa: E402
from qcore import PerBlock, PerChannel, PerGroup, PerTensor, ScaleMode  # noqa: E402
from qcore.adapters import (MSE, PRESETS, KVCacheConfig, LayerConfig, MinMax, ModelConfig, Percentile,  # noqa: E402
                            TensorConfig, preset, spec_from_dict, spec_to_dict)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_round_trips_through_json(name):
    c = preset(name, kv_cache="fp8")
    s = c.to_json()
    assert json.loads(s) == c.to_dict()
    back = ModelConfig.from_json(s)
    assert back == c and hash(back) == hash(c)
    assert back.to_dict() == c.to_dict()


@pytest.mark.parametrize("fmt", ["int4", "uint8", "float8_e4m3fnuz", "mxfp4", "mx9", "bfp16", "nvfp4", "mxint8"])
def test_spec_dict_round_trip_keeps_every_field(fmt):
    spec = qcore.make_spec(fmt)
    d = spec_to_dict(spec)
    assert spec_from_dict(d) == spec
    assert json.loads(json.dumps(d)) == d


def test_preset_meanings():
    c = preset("w_mxfp4_a_mxfp4")
    assert c.layer.weight.spec.granularity == PerGroup(32, 1) and c.layer.weight.spec.scale_mode is ScaleMode.EVEN
    assert c.layer.input.dynamic and c.layer.output is None
    assert preset("w_mxfp4_a_mxfp4", scale_mode=ScaleMode.FLOOR).layer.input.spec.scale_mode is ScaleMode.FLOOR
    u = preset("w_uint4_per_group_asym", group_size=64).layer
    assert u.weight.spec.dtype.name == "uint4" and not u.weight.spec.symmetric
    assert u.weight.spec.granularity == PerGroup(64, 1) and u.input is None
    p = preset("ptpc_fp8").layer
    assert p.weight.spec.granularity == PerChannel(0) and p.input.dynamic and p.input.spec.granularity == PerChannel(0)
    f = preset("w_fp8_a_fp8").layer
    assert not f.input.dynamic and f.input.spec.granularity == PerTensor()
    assert preset("int4_wo_64").layer.weight.spec.granularity == PerGroup(64, 1)
    n = preset("nvfp4").layer.weight.spec
    assert n.two_level and n.granularity == PerGroup(16, 1) and n.scale_dtype.name == "float8_e4m3fn"
    kv = preset("fp8", kv_cache="fp8").kv_cache
    assert kv.spec.dtype.name == "float8_e4m3fn" and kv.targets == ("*k_proj", "*v_proj")
    assert preset("fp8").kv_cache is None and preset("fp8").exclude is None


def test_unknown_preset_suggests_close_names():
    with pytest.raises(ValueError, match=r"unknown preset 'w_mxfp4_a_mxfp5'.*did you mean.*w_mxfp4_a_mxfp4"):
        preset("w_mxfp4_a_mxfp5")
    with pytest.raises(ValueError, match="fixes the group size to 64"):
        preset("int4_wo_64", group_size=32)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        preset("int8", group_size=0)
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        preset("int8", kv_cache="int4")


def test_configs_are_frozen_values():
    c = preset("int8")
    with pytest.raises(Exception):
        c.layer = LayerConfig()
    with pytest.raises(TypeError, match="read-only"):
        ModelConfig(by_type={"Linear": None}).by_type["Conv2d"] = None
    assert ModelConfig(by_type={torch.nn.Linear: None}).by_type == {"Linear": None}


@pytest.mark.parametrize("make, match", [
    (lambda: TensorConfig("int8", dynamic=True, observer=Percentile(99.0)), "static scales only"),
    (lambda: TensorConfig(qcore.make_spec("uint8"), observer=Percentile(99.0)), "needs a symmetric spec"),
    (lambda: TensorConfig("int8", dynamic=1), "dynamic must be a bool"),
    (lambda: TensorConfig(3), "TensorConfig.spec must be"),
    (lambda: TensorConfig("int77"), "unknown format 'int77'"),
    (lambda: Percentile(0), r"Percentile.q: got 0; expected a number in \(0, 100\]"),
    (lambda: MSE(grid=0), "MSE.grid"),
    (lambda: LayerConfig(weight=TensorConfig("int8", dynamic=True)), "dynamic=True applies to activations"),
    (lambda: LayerConfig(input=TensorConfig(qcore.make_spec("int8", axis=0))), "per-token scales"),
    (lambda: LayerConfig(input=TensorConfig(qcore.make_spec("mxfp4", axis=1))), "must be dynamic=True"),
    (lambda: LayerConfig(input=TensorConfig(qcore.make_spec("mxfp4", axis=0), dynamic=True)), "along the features"),
    (lambda: LayerConfig(input=TensorConfig(qcore.make_spec("int8", granularity=PerBlock((2, 2))))), "activations take"),
    (lambda: LayerConfig(weight=3), "LayerConfig.weight must be"),
    (lambda: ModelConfig(by_type={"LSTM": None}), "unsupported module type 'LSTM'"),
    (lambda: ModelConfig(by_name={"re:(": None}), "bad regular expression"),
    (lambda: ModelConfig(exclude="lm_head"), "a list of names"),
    (lambda: ModelConfig(algorithms=[{"x": 1}]), "a dict with a 'name'"),
    (lambda: KVCacheConfig(qcore.make_spec("float8_e4m3fn", axis=0)), "per-tensor scales"),
])
def test_bad_configs_are_refused_at_construction(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_from_dict_refuses_unknown_fields():
    d = preset("int8").to_dict()
    d["layers"] = {}
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['layers'\]"):
        ModelConfig.from_dict(d)
    d = preset("int8").to_dict()
    d["layer"]["weight"]["spec"]["bits"] = 8
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['bits'\]"):
        ModelConfig.from_dict(d)
    d = preset("int8").to_dict()
    d["layer"]["weight"]["spec"]["scale_mode"] = "round"
    with pytest.raises(ValueError, match="spec.scale_mode"):
        ModelConfig.from_dict(d)


def test_observers_round_trip():
    for obs in (MinMax(), Percentile(99.5), MSE(grid=20, lo=0.3, p=2.4)):
        c = ModelConfig(LayerConfig(weight=TensorConfig("int8", observer=obs), input=TensorConfig("int8", observer=obs)))
        assert ModelConfig.from_json(c.to_json()) == c


def test_weight_search_observers_round_trip_and_are_validated():
    """FourOverSix (two-level FP4 weights) and ExponentSearch (power-of-two weights): JSON round trip; refused,
    naming the field, on other specs, on activations and on the KV cache."""
    from qcore.adapters import ExponentSearch, FourOverSix
    nv, mx = qcore.make_spec("nvfp4", axis=1), qcore.make_spec("mxfp4", axis=1)
    c = ModelConfig(LayerConfig(weight=TensorConfig(nv, observer=FourOverSix())),
                    by_name={"*down_proj": LayerConfig(weight=TensorConfig(mx, observer=ExponentSearch(radius=2)))})
    assert ModelConfig.from_json(c.to_json()) == c
    assert c.to_dict()["layer"]["weight"]["observer"] == {"kind": "four_over_six"}
    for make, match in [
        (lambda: TensorConfig(mx, observer=FourOverSix()), "FourOverSix\\(\\) applies to two-level FP4"),
        (lambda: TensorConfig("int4", observer=FourOverSix()), "FourOverSix\\(\\) applies to two-level FP4"),
        (lambda: TensorConfig(nv, observer=ExponentSearch()), "ExponentSearch\\(\\) applies to power-of-two"),
        (lambda: TensorConfig("int8", observer=ExponentSearch()), "ExponentSearch\\(\\) applies to power-of-two"),
        (lambda: ExponentSearch(radius=0), "ExponentSearch.radius"),
        (lambda: ExponentSearch(radius=True), "ExponentSearch.radius"),
        (lambda: TensorConfig(mx, dynamic=True, observer=ExponentSearch()), "static scales only"),
        (lambda: LayerConfig(input=TensorConfig(qcore.make_spec("float8_e4m3fn", scale_dtype="float8_e8m0fnu"),
                                                observer=ExponentSearch())), "LayerConfig.input: observer"),
        (lambda: KVCacheConfig(qcore.make_spec("float8_e4m3fn", scale_dtype="float8_e8m0fnu"),
                               observer=ExponentSearch()), "KVCacheConfig.observer"),
    ]:
        with pytest.raises(ValueError, match=match):
            make()
    # Quark's spelling of a searched weight is the spec's (the scales are stored); activations stay refused
    assert ModelConfig(LayerConfig(weight=TensorConfig(nv, observer=FourOverSix()))).to_quark() == \
        ModelConfig(LayerConfig(weight=nv)).to_quark()


@pytest.mark.parametrize("name,base,obs", [("nvfp4_4o6", "nvfp4", "four_over_six"),
                                           ("w_mxfp4_a_mxfp4_search", "w_mxfp4_a_mxfp4", "exponent_search"),
                                           ("mxfp4_weight_only_search", "mxfp4_weight_only", "exponent_search")])
def test_searched_scale_presets_are_their_base_with_the_weight_observer(name, base, obs):
    import dataclasses
    from qcore.adapters.config import observer_from_dict
    b = preset(base)
    want = b.replace(layer=dataclasses.replace(b.layer, weight=TensorConfig(b.layer.weight.spec,
                                                                            observer=observer_from_dict({"kind": obs}))))
    assert preset(name) == want
    assert preset(name, scale_mode=ScaleMode.FLOOR if "mx" in name else ScaleMode.EVEN).layer.weight.observer == \
        want.layer.weight.observer

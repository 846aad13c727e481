"""ModelConfig <-> AMD Quark quantization_config, on configs written by Quark 0.13 itself."""

import json
import pathlib

import pytest

pytest.importorskip("torch")

import qcore  # noqa: E402
from qcore.adapters import PRESETS, LayerConfig, ModelConfig, MSE, TensorConfig, preset  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parents[1] / "formats" / "data" / "quark_configs"
FIXTURES = sorted(p.stem for p in DATA.glob("*.json"))
# Quark-only numerics qcore refuses (see src/qcore/formats/quark_hf.py): E5M3 saturating at 114688, MXINT8's 8-bit 'even',
# progressive fp8 -> int4 weights
NOT_CONVERTIBLE = {"amdfp4", "amdfp4_g32", "amdfp4_global16", "amdfp4_global32", "w_mxint8", "int4_fp8"}


def _load(name):
    return json.loads((DATA / f"{name}.json").read_text())


def test_fixtures_are_there():
    assert len(FIXTURES) >= 40 and {"fp8", "mxfp4", "nvfp4", "ptpc_fp8", "fp8_kv_fp8"} <= set(FIXTURES)


@pytest.mark.parametrize("name", [n for n in FIXTURES if n not in NOT_CONVERTIBLE])
def test_quark_config_read_and_written_back_is_equal(name):
    d = _load(name)
    c = ModelConfig.from_quark(d)
    assert c.to_quark() == d
    # without the remembered source (a JSON round trip drops it) the derived spelling means the same numerics
    fresh = ModelConfig.from_json(c.to_json())
    assert fresh.origin is None
    assert ModelConfig.from_quark(fresh.to_quark()) == c


@pytest.mark.parametrize("name", sorted(NOT_CONVERTIBLE))
def test_quark_numerics_qcore_does_not_share_are_refused(name):
    with pytest.raises(ValueError, match=r"global_quant_config\.weight"):
        ModelConfig.from_quark(_load(name))


@pytest.mark.parametrize("name", [n for n in FIXTURES if n in PRESETS and n not in NOT_CONVERTIBLE])
def test_presets_mean_what_quark_writes(name):
    assert preset(name) == ModelConfig.from_quark(_load(name))


def test_kv_cache_preset_equals_quarks_and_writes_both_lists():
    q = _load("fp8_kv_fp8")
    c = preset("fp8", kv_cache="fp8")
    assert ModelConfig.from_quark(q) == c
    out = c.to_quark()
    assert set(out["kv_cache_quant_config"]) == {"*k_proj", "*v_proj"} == set(out["layer_quant_config"])
    assert out["export"]["kv_cache_group"] == ["*k_proj", "*v_proj"]
    assert ModelConfig.from_quark(out) == c


def test_nvfp4_weight_tensor_scale_is_the_weights_own_activations_calibrated():
    c = ModelConfig.from_quark(_load("nvfp4"))
    assert c.layer.weight.spec.tensor_scale_mode is qcore.TensorScale.AMAX
    assert c.layer.input.spec.tensor_scale_mode is qcore.TensorScale.GIVEN and c.layer.input.dynamic
    assert c.layer.input.calibrated


def test_what_quark_cannot_say_is_refused():
    with pytest.raises(ValueError, match=r"layer.weight: observer MSE.*no Quark spelling"):
        ModelConfig(LayerConfig(weight=TensorConfig("int8", observer=MSE()))).to_quark()
    with pytest.raises(ValueError, match="by_type: None entries"):
        ModelConfig(LayerConfig(weight="int8"), by_type={"Conv2d": None}).to_quark()
    d = _load("fp8")
    d["softmax_quant_spec"] = d["global_quant_config"]["weight"]
    with pytest.raises(ValueError, match="softmax_quant_spec"):
        ModelConfig.from_quark(d)
    d = _load("fp8_kv_fp8")
    d["kv_cache_post_rope"] = True
    with pytest.raises(ValueError, match="kv_cache_post_rope"):
        ModelConfig.from_quark(d)
    d = _load("fp8")
    d["global_quant_config"]["weight"]["dtype"] = "fp9"
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_quark(d)


def test_by_name_none_becomes_an_exclude_entry():
    c = ModelConfig(LayerConfig(weight="int8"), by_name={"model.layers.0.*": None}, exclude=["lm_head"])
    assert c.to_quark()["exclude"] == ["lm_head", "model.layers.0.*"]

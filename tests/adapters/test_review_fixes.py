"""Behaviour found missing by a newcomer review of the adapters (each test failed before its fix)."""

import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import qcore  # noqa: E402
from qcore import PerBlock, PerChannel  # noqa: E402
from qcore.adapters import (LayerConfig, ModelConfig, freeze, plan_model, preset,  # noqa: E402
                            quantize_model, quantized_modules, wrap)


def seq(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))


def test_a_spec_that_does_not_fit_one_weight_is_refused_before_any_weight_is_written():
    m = seq()
    w0 = m[0].weight.detach().clone()
    bad = LayerConfig(weight=qcore.make_spec("int8", granularity=PerBlock((2, 2, 2))))
    with pytest.raises(ValueError, match=r"Linear '2': weight spec .* does not fit its weight of shape \[64, 128\]"):
        quantize_model(m, ModelConfig(LayerConfig(weight="int8"), by_name={"2": bad}), progress=False)
    assert type(m[0]) is nn.Linear and torch.equal(m[0].weight, w0)


def test_qat_state_dict_has_scales_from_the_start_and_loads_into_a_fresh_qat_model():
    a = quantize_model(seq(0), "uint4_wo_32", qat=True, progress=False)
    sd = a.state_dict()
    assert {"0.weight_scale", "0.weight_zero_point", "2.weight_scale"} <= set(sd)
    assert bool(torch.isfinite(sd["0.weight_scale"]).all())
    b = quantize_model(seq(1), "uint4_wo_32", qat=True, progress=False)
    b.load_state_dict(sd)
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    # after a training step the saved scales follow the master weight
    opt = torch.optim.SGD(a.parameters(), lr=0.5)
    a(x).square().sum().backward()
    opt.step()
    a(x)  # grad-enabled forward
    expect = qcore.quantize(a[0].weight.detach(), a[0].specs["weight"]).scales
    assert torch.equal(a.state_dict()["0.weight_scale"], expect)


@pytest.mark.parametrize("name", ["int8", "w_uint4_per_group_asym", "w_mxfp4_a_mxfp4"])
def test_a_frozen_model_can_be_cast_and_keeps_float32_scales(name):
    m = quantize_model(seq(), name, [torch.randn(8, 64)], progress=False)
    freeze(m)
    w32 = m[0]._w().detach()
    m.to(torch.bfloat16)
    assert m[0].weight_scale.dtype in (torch.float32, torch.uint8)
    assert m[0]._w().dtype == torch.bfloat16 and torch.equal(m[0]._w(), w32.to(torch.bfloat16))
    y = m(torch.randn(2, 64, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and bool(torch.isfinite(y).all())


def test_static_scales_stay_float32_when_a_fake_quantized_model_is_cast():
    m = quantize_model(seq(), "fp8", [torch.randn(8, 64)], progress=False)
    s = m[0].input_scale.clone()
    m.half()
    assert m[0].input_scale.dtype == torch.float32 and torch.equal(m[0].input_scale, s)
    assert m(torch.randn(2, 64, dtype=torch.float16)).dtype == torch.float16


def test_calibration_from_an_iterable_dataset_without_len():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            return iter([torch.randn(64, generator=g) for _ in range(8)])

    loader = torch.utils.data.DataLoader(Stream(), batch_size=4)
    m = quantize_model(seq(), "fp8", loader, progress=True)
    assert bool(torch.isfinite(m[0].input_scale))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))


def test_patterns_naming_a_parent_module_cover_its_children():
    torch.manual_seed(0)
    net = nn.ModuleDict({"b0": Block(), "b1": Block()})
    names = {p.name for p in plan_model(net, ModelConfig(LayerConfig(weight="int8"), exclude=["b0"]))}
    assert names == {"b1.q", "b1.mlp.0", "b1.mlp.1"}
    names = {p.name for p in plan_model(net, ModelConfig(LayerConfig(weight="int8"), by_name={"b1.mlp": None}))}
    assert names == {"b0.q", "b0.mlp.0", "b0.mlp.1", "b1.q"}
    plans = {p.name: p for p in plan_model(net, ModelConfig(by_name={"b0.mlp": LayerConfig(weight="int4")}))}
    assert set(plans) == {"b0.mlp.0", "b0.mlp.1"} and plans["b0.mlp.0"].config.weight.spec.dtype.name == "int4"
    assert "b0.mlp.0" in repr(plans["b0.mlp.0"]) and len(repr(plans["b0.mlp.0"])) < 120


def test_subclasses_of_supported_modules_are_reported_not_silently_skipped():
    class MyLinear(nn.Linear):
        pass

    m = nn.Sequential(nn.Linear(8, 8), MyLinear(8, 8))
    with pytest.warns(UserWarning, match=r"1 module\(s\) subclass a supported type .*1 \(MyLinear\)"):
        plans = plan_model(m, ModelConfig(LayerConfig(weight="int8")))
    assert [p.name for p in plans] == ["0"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_model(m, ModelConfig(LayerConfig(weight="int8"), exclude=["1"]))


def test_uncalibrated_static_scales_raise_for_any_width():
    q = wrap(nn.Linear(64, 8), LayerConfig(input=qcore.make_spec("int8", granularity=PerChannel(1))))
    with pytest.raises(RuntimeError, match="static input scales are not calibrated"):
        q(torch.randn(2, 64))


def test_from_dict_refuses_a_string_where_a_list_belongs():
    d = preset("fp8", kv_cache="fp8").to_dict()
    d["exclude"] = "lm_head"
    with pytest.raises(ValueError, match="a list of names"):
        ModelConfig.from_dict(d)
    d = preset("fp8", kv_cache="fp8").to_dict()
    d["kv_cache"]["targets"] = "*k_proj"
    with pytest.raises(ValueError, match="KVCacheConfig.targets"):
        ModelConfig.from_dict(d)


def test_preset_options_that_do_not_apply_are_refused():
    with pytest.raises(ValueError, match="'fp8' has no per-group or block role: group_size=64"):
        preset("fp8", group_size=64)
    with pytest.raises(ValueError, match="'int8' has no OCP MX float role"):
        preset("int8", scale_mode=qcore.ScaleMode.FLOOR)
    with pytest.raises(ValueError, match="'mx9' has no OCP MX float role"):
        preset("mx9", scale_mode=qcore.ScaleMode.FLOOR)
    with pytest.raises(ValueError, match=r"did you mean \['fp8'"):
        preset("FP8")


def test_a_preset_written_to_quark_and_read_back_is_the_preset_and_fits_any_model():
    c = preset("fp8")
    back = ModelConfig.from_quark(c.to_quark())
    assert back == c and back.exclude is None
    quantize_model(seq(), back, [torch.randn(4, 64)], progress=False)


def test_a_block_format_name_means_blocks_along_the_input_axis_for_linear_and_conv():
    cfg = ModelConfig(LayerConfig(weight="mxfp4"))
    net = nn.Sequential(nn.Conv2d(64, 8, 3), nn.Flatten(), nn.Linear(8, 4))
    quantize_model(net, cfg, progress=False)
    assert set(quantized_modules(net)) == {"0", "2"}
    w = net[0].weight.detach()
    ref = qcore.fake_quantize(w, qcore.make_spec("mxfp4", axis=1))
    assert torch.equal(w, ref)

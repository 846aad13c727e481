"""Bad input to quantize_model: clear errors before any work, and the model unchanged afterwards."""

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import qcore  # noqa: E402
from qcore import PerGroup  # noqa: E402
from qcore.adapters import (CalibrationError, LayerConfig, ModelConfig, TensorConfig, calibrate,  # noqa: E402
                            plan_model, preset, quantize_model, quantized_modules)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 32)
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.head = nn.Linear(32, 50)

    def forward(self, ids):
        h = self.embed(ids)
        y = self.proj(h)
        return self.head(torch.relu(y))


def _net():
    torch.manual_seed(0)
    return Net()


def _snapshot(model):
    return ({n: type(m) for n, m in model.named_modules()},
            {k: v.detach().clone() for k, v in model.state_dict().items()})


def _assert_unchanged(model, snap):
    types, state = snap
    assert {n: type(m) for n, m in model.named_modules()} == types
    now = model.state_dict()
    assert now.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(now[k], v), k
    assert not quantized_modules(model)


def _ids(*shape):
    return torch.randint(0, 50, shape)


W8A8 = ModelConfig(LayerConfig(weight="int8", input="int8"), by_type={"Conv2d": None})


def test_pattern_matching_nothing_names_the_closest_modules():
    m = _net()
    with pytest.raises(ValueError, match=r"pattern 'prj' matches no module.*'proj'"):
        plan_model(m, ModelConfig(by_name={"prj": LayerConfig(weight="int8")}))
    with pytest.raises(ValueError, match=r"exclude entry 're:hed' matches no module.*'head'"):
        plan_model(m, ModelConfig(LayerConfig(weight="int8"), exclude=["re:hed"]))
    with pytest.raises(ValueError, match=r"KVCacheConfig.targets pattern '\*k_proj' matches no module"):
        plan_model(m, preset("fp8", kv_cache="fp8"))


def test_name_type_and_exclude_precedence():
    m = _net()
    c = ModelConfig(LayerConfig(weight="int8"), by_type={"Embedding": LayerConfig(weight=qcore.make_spec("int4", axis=0))},
                    by_name={"head": LayerConfig(weight="float8_e4m3fn"), "pro*": None}, exclude=["conv"])
    plans = {p.name: p for p in plan_model(m, c)}
    assert set(plans) == {"embed", "head"}
    assert plans["head"].config.weight.spec.dtype.name == "float8_e4m3fn"
    assert plans["embed"].config.weight.spec.dtype.name == "int4"
    # global config: Linear and Conv2d, not Embedding; no output head to exclude on a plain module
    assert {p.name for p in plan_model(m, ModelConfig(LayerConfig(weight="int8")))} == {"proj", "conv", "head"}
    assert {p.name for p in plan_model(m, ModelConfig(LayerConfig(weight="int8"), by_name={"re:p.*j": None}))} == \
        {"conv", "head"}


def test_conv_group_on_the_wrong_axis_is_refused_before_any_work():
    m = _net()
    snap = _snapshot(m)
    bad = ModelConfig(LayerConfig(weight=qcore.make_spec("int4", granularity=PerGroup(4, axis=-1))))
    with pytest.raises(ValueError, match=r"per-group weight spec .* Conv2d 'conv'.*input axis"):
        quantize_model(m, bad, progress=False)
    _assert_unchanged(m, snap)
    with pytest.raises(ValueError, match="per-channel weight scales are per output channel"):
        quantize_model(m, ModelConfig(LayerConfig(weight=qcore.make_spec("int8", axis=1))), progress=False)
    _assert_unchanged(m, snap)


def test_role_a_module_cannot_take():
    m = _net()
    with pytest.raises(ValueError, match="input of an embedding is indices"):
        quantize_model(m, ModelConfig(by_type={"Embedding": LayerConfig(input=TensorConfig("int8", dynamic=True))}),
                       progress=False)
    with pytest.raises(ValueError, match="per-token scales .* apply to Linear activations"):
        quantize_model(m, ModelConfig(by_name={"conv": LayerConfig(input=TensorConfig(qcore.make_spec("int8", axis=0),
                                                                                      dynamic=True))}),
                       progress=False)


def test_static_activations_need_data_and_data_must_be_batches():
    m = _net()
    snap = _snapshot(m)
    with pytest.raises(ValueError, match="static activation scales .*pass calibration batches as data="):
        quantize_model(m, W8A8, progress=False)
    with pytest.raises(TypeError, match=r"iterable of batches.*wrap a single batch in a list"):
        quantize_model(m, W8A8, _ids(2, 5), progress=False)
    with pytest.raises(TypeError, match="calibration batch 1 is a str; expected a tensor"):
        quantize_model(m, W8A8, [_ids(2, 5), "hello"], progress=False)
    with pytest.raises(ValueError, match="calibration data is empty"):
        quantize_model(m, W8A8, [], progress=False)
    _assert_unchanged(m, snap)


def test_a_batch_the_model_cannot_take_is_reported_and_nothing_changes():
    m = _net()
    snap = _snapshot(m)
    with pytest.raises(ValueError, match=r"calibration batch 1 \(tensor \(2, 5\) torch.float32\) does not fit the model"):
        quantize_model(m, W8A8, [_ids(2, 5), torch.randn(2, 5)], progress=False)
    _assert_unchanged(m, snap)


def test_nan_during_calibration_names_the_layer_and_nothing_changes():
    m = _net()
    snap = _snapshot(m)
    with torch.no_grad():
        m.embed.weight[7] = float("nan")
    snap = _snapshot(m)
    with pytest.raises(CalibrationError, match=r"NaN met in the statistics of 'proj' \(input\) \(batch 2\)"):
        quantize_model(m, W8A8, [torch.tensor([[1, 2, 3]]), torch.tensor([[7, 1]])], progress=False)
    types, state = snap
    assert {n: type(mm) for n, mm in m.named_modules()} == types
    for k, v in state.items():
        assert torch.equal(m.state_dict()[k].nan_to_num(), v.nan_to_num()), k


def test_inf_in_a_weight_is_refused():
    m = _net()
    with torch.no_grad():
        m.proj.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="Linear 'proj': the weight holds NaN or Inf"):
        quantize_model(m, ModelConfig(LayerConfig(weight="int8")), progress=False)


def test_already_quantized_and_unknown_algorithms():
    m = _net()
    quantize_model(m, ModelConfig(LayerConfig(weight="int8")), progress=False)
    with pytest.raises(ValueError, match="already holds qcore quantized modules"):
        quantize_model(m, ModelConfig(LayerConfig(weight="int8")), progress=False)
    with pytest.raises(ValueError, match="algorithm 'nosuchalgo' is not available; known: .*gptq"):
        quantize_model(_net(), ModelConfig(LayerConfig(weight="int8"), algorithms=[{"name": "nosuchalgo"}]), progress=False)
    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ValueError, match="Net is not a Llama-like causal LM"):  # checked before any change
        quantize_model(net, ModelConfig(LayerConfig(weight="int8"), algorithms=[{"name": "quarot"}]), progress=False)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert not getattr(net, "_qcore_partial", False)
    with pytest.raises(ValueError, match="need calibration data"):
        quantize_model(_net(), ModelConfig(LayerConfig(weight="int8"), algorithms=[{"name": "gptq"}]), progress=False)
    with pytest.raises(TypeError, match="config must be a ModelConfig"):
        quantize_model(_net(), 3, progress=False)
    with pytest.raises(ValueError, match="unknown preset"):
        quantize_model(_net(), "w_int9", progress=False)


def test_tied_weights_must_share_a_config():
    m = _net()
    m.head2 = nn.Linear(16, 50, bias=False)
    m.head2.weight = m.embed.weight
    with pytest.raises(ValueError, match=r"tied weight shared by 'embed' \(float\), 'head2' \(int8\)"):
        plan_model(m, ModelConfig(LayerConfig(weight="int8")))
    both = ModelConfig(LayerConfig(weight=qcore.make_spec("int8", axis=0)),
                       by_type={"Embedding": LayerConfig(weight=qcore.make_spec("int8", axis=0))})
    assert {"embed", "head2"} <= {p.name for p in plan_model(m, both)}


def test_nothing_to_quantize_is_an_error():
    with pytest.raises(ValueError, match="quantizes no module"):
        plan_model(nn.Sequential(nn.ReLU()), ModelConfig(LayerConfig(weight="int8")))


def test_calibrate_without_static_roles_is_a_no_op():
    m = _net()
    quantize_model(m, ModelConfig(LayerConfig(weight="int8")), progress=False)
    assert calibrate(m, [_ids(2, 3)], progress=False) == 0


def test_freeze_logs_the_bytes_before_and_after(caplog):
    import logging
    from qcore.adapters import freeze, model_bytes
    m = _net()
    quantize_model(m, ModelConfig(LayerConfig(weight="int8")), progress=False)
    before = model_bytes(m)
    with caplog.at_level(logging.INFO, logger="qcore.adapters"):
        freeze(m)
    after = model_bytes(m)
    assert after < before
    assert f"froze 3 modules: {before:,} -> {after:,} bytes" in caplog.text
    with pytest.raises(ValueError, match="no qcore quantized modules"):
        freeze(_net())

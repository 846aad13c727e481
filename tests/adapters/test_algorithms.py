"""Algorithms bound to models, layer by layer (qcore.adapters.sequential): GPTQ on transformers models, the
committed codes, export, failure semantics."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qcore  # noqa: E402
from qcore.adapters import ModelConfig, export_hf, from_pretrained, preset, quantize_model  # noqa: E402
from qcore.adapters import sequential  # noqa: E402
from qcore.adapters.sequential import AlgorithmError, find_decoder_layers  # noqa: E402


def _mse(model, ref, batch):
    with torch.no_grad():
        return float((model(batch).logits - ref).pow(2).mean())


def _uint4(group=16, algos=()):
    return preset("w_uint4_per_group_asym", group_size=group).replace(algorithms=tuple(algos))


@pytest.fixture(scope="module")
def setup(zoo):
    model = zoo.tiny_llama()
    data = zoo.token_batches(8, seed=1, batch=2, seq=32)
    test = zoo.token_batches(1, seed=2, batch=4, seq=32)[0]
    with torch.no_grad():
        ref = model(test).logits
    return model, data, test, ref


@pytest.mark.parametrize("algo", [{"name": "gptq"}, {"name": "gptq", "true_sequential": True},
                                  {"name": "gptq", "act_order": False},
                                  {"name": "gptq", "desc_act": True, "static_groups": True}])
def test_gptq_beats_round_to_nearest_on_the_model_output(setup, algo):
    model, data, test, ref = setup
    rtn = quantize_model(copy.deepcopy(model), _uint4(), progress=False)
    g = quantize_model(copy.deepcopy(model), _uint4(algos=[algo]), data, progress=False)
    assert _mse(g, ref, test) < 0.95 * _mse(rtn, ref, test)


def test_committed_weights_are_gptqs_codes_and_export_reproduces_them(setup, tmp_path):
    model, data, test, ref = setup
    m = copy.deepcopy(model)
    pinned = {}
    real = sequential.run_algorithms

    def spy(*a, **k):
        pinned.update(real(*a, **k))
        return pinned

    sequential.run_algorithms, saved = spy, real
    try:
        quantize_model(m, _uint4(algos=[{"name": "gptq"}]), data, progress=False)
    finally:
        sequential.run_algorithms = saved
    linears = [n for n, x in m.named_modules() if n.startswith("model.layers.") and isinstance(x, torch.nn.Linear)]
    assert sorted(pinned) == sorted(linears) and len(linears) == 14
    for name, q in pinned.items():
        mod = m.get_submodule(name)
        assert torch.equal(mod.weight, qcore.dequantize(q)), name  # committed as GPTQ left them
        assert torch.equal(mod.weight_scale, q.scales) and torch.equal(mod.weight_zero_point, q.zero_points)
    with torch.no_grad():
        out = m(test).logits
    export_hf(m, tmp_path / "ckpt")
    back = from_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(back(test).logits, out)


def test_the_first_layer_inputs_hold_the_attention_kwargs(setup):
    model, data, _, _ = setup
    path, layers = find_decoder_layers(model)
    assert path == "model.layers" and len(layers) == 2
    inputs = sequential._capture(model, layers[0], data[:2], torch.device("cpu"), False)
    assert len(inputs) == 2 and inputs.args[0][0].shape == (2, 32, 64)
    assert "position_embeddings" in inputs.kwargs[0] and inputs.kwargs[0].get("past_key_values") is None


def test_checks_run_before_any_weight_changes(setup):
    model, data, _, _ = setup
    m = copy.deepcopy(model)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match="gptq modules: 'mlp.nope' is not a module of decoder layer"):
        quantize_model(m, _uint4(algos=[{"name": "gptq", "modules": ["mlp.nope"]}]), data, progress=False)
    with pytest.raises(ValueError, match="decoder_layers 'model.blocks' is not a module"):
        quantize_model(m, _uint4(algos=[{"name": "gptq", "decoder_layers": "model.blocks"}]), data, progress=False)
    with pytest.raises(ValueError, match="micro-exponents"):
        quantize_model(m, preset("w_mx9_a_mx9").replace(algorithms=({"name": "gptq"},)), data, progress=False)
    with pytest.raises(ValueError, match="qat=True"):
        quantize_model(m, _uint4(algos=[{"name": "gptq"}]), data, qat=True, progress=False)
    with pytest.raises(ValueError, match="need calibration data"):
        quantize_model(m, _uint4(algos=[{"name": "gptq"}]), progress=False)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not any(qcore.adapters.modules.is_quantized_module(x) for x in m.modules())


def test_a_failure_half_way_is_reported_and_the_model_is_refused_afterwards(setup, monkeypatch):
    model, data, _, _ = setup
    m = copy.deepcopy(model)
    calls = []
    real = sequential.gptq

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) > 3:
            raise ValueError("boom")
        return real(*a, **k)

    monkeypatch.setattr(sequential, "gptq", flaky)
    with pytest.raises(AlgorithmError, match=r"boom .*decoder layer \d of 'model.layers'.*reload the model"):
        quantize_model(m, _uint4(algos=[{"name": "gptq"}]), data, progress=False)
    assert not any(qcore.adapters.modules.is_quantized_module(x) for x in m.modules())
    with pytest.raises(ValueError, match="failed half-way"):
        quantize_model(m, _uint4(), progress=False)


def test_ctrl_c_stays_a_keyboard_interrupt(setup, monkeypatch):
    model, data, _, _ = setup
    m = copy.deepcopy(model)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(sequential, "gptq", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize_model(m, _uint4(algos=[{"name": "gptq"}]), data, progress=False)
    assert getattr(m, "_qcore_partial", False)


def test_gptq_with_weight_and_static_activation_scales(setup):
    """W8A8 (static input scales): GPTQ's weights are in place before calibration, so the input scales are
    calibrated on the model as it will run."""
    model, data, test, ref = setup
    cfg = preset("w_int8_per_channel_a_int8_per_tensor_sym").replace(algorithms=({"name": "gptq"},))
    g = quantize_model(copy.deepcopy(model), cfg, data, progress=False)
    mods = {n: x for n, x in g.named_modules() if hasattr(x, "input_scale")}
    scales = {n: x.input_scale.clone() for n, x in mods.items()}
    assert len(scales) == 14 and all(bool(torch.isfinite(s).all()) for s in scales.values())
    qcore.adapters.calibrate(g, data, progress=False)  # calibrating the final model again changes nothing
    for n, x in mods.items():
        assert torch.equal(x.input_scale, scales[n]), n

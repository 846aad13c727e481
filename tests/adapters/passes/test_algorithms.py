"""Algorithms bound to models, layer by layer (qcore.adapters.passes.sequential): GPTQ on transformers models, the
committed codes, export, failure semantics."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qcore  # noqa: E402
from qcore.adapters import export_hf, from_pretrained, preset, quantize_model  # noqa: E402
from qcore.adapters.passes import gptq as gptq_binding  # noqa: E402
from qcore.adapters.passes import sequential  # noqa: E402
from qcore.adapters.passes.runner import capture  # noqa: E402
from qcore.adapters.passes.sequential import AlgorithmError, find_decoder_layers  # noqa: E402


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
    inputs = capture(model, layers[0], data[:2], device=torch.device("cpu"), progress=False)
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
    real = gptq_binding.gptq

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) > 3:
            raise ValueError("boom")
        return real(*a, **k)

    monkeypatch.setattr(gptq_binding, "gptq", flaky)
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

    monkeypatch.setattr(gptq_binding, "gptq", interrupted)
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


@pytest.fixture(scope="module")
def outliers(zoo):
    """A tiny Llama (no grouped-query attention) whose norms make a few activation channels large, as in real
    LLMs: the case SmoothQuant and AWQ are for."""
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[:4] *= 20
            layer.post_attention_layernorm.weight[3:6] *= 15
    data = zoo.token_batches(8, seed=1, batch=2, seq=32)
    test = zoo.token_batches(1, seed=2, batch=4, seq=32)[0]
    with torch.no_grad():
        ref = model(test).logits
    return model, data, test, ref


def test_smoothquant_and_autosmoothquant_beat_plain_w8a8(outliers):
    model, data, test, ref = outliers
    cfg = preset("int8")  # W8A8 int8 per-tensor, static activation scales
    plain = _mse(quantize_model(copy.deepcopy(model), cfg, data, progress=False), ref, test)
    sq = _mse(quantize_model(copy.deepcopy(model), cfg.replace(algorithms=({"name": "smoothquant"},)), data,
                             progress=False), ref, test)
    auto = _mse(quantize_model(copy.deepcopy(model), cfg.replace(algorithms=({"name": "autosmoothquant"},)), data,
                               progress=False), ref, test)
    assert sq < 0.6 * plain and auto < 0.6 * plain


def test_awq_beats_round_to_nearest_and_combines_with_gptq(outliers):
    model, data, test, ref = outliers
    rtn = _mse(quantize_model(copy.deepcopy(model), _uint4(), progress=False), ref, test)
    awq = _mse(quantize_model(copy.deepcopy(model), _uint4(algos=[{"name": "awq"}]), data, progress=False), ref, test)
    both = _mse(quantize_model(copy.deepcopy(model), _uint4(algos=[{"name": "awq"}, {"name": "gptq"}]), data,
                               progress=False), ref, test)
    assert awq < 0.6 * rtn and both < 0.6 * rtn


def test_smoothquant_leaves_the_float_function_unchanged(outliers):
    """With nothing quantized but the (unused) scaling, the folded model computes the same function."""
    model, data, test, ref = outliers
    m = copy.deepcopy(model)
    from qcore.adapters.plan import plan_model
    plans = plan_model(m, preset("int8"))
    sequential.run_algorithms(m, plans, [{"name": "smoothquant", "alpha": 0.7}], data, progress=False)
    assert not torch.equal(m.model.layers[0].input_layernorm.weight, model.model.layers[0].input_layernorm.weight)
    with torch.no_grad():
        torch.testing.assert_close(m(test).logits, ref, rtol=1e-4, atol=1e-5)


def test_scaling_checks_run_before_any_weight_changes(setup, zoo):
    model, data, _, _ = setup
    m = copy.deepcopy(model)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match="autosmoothquant: .*needs weight and input quantization"):
        quantize_model(m, _uint4(algos=[{"name": "autosmoothquant"}]), data, progress=False)
    with pytest.raises(ValueError, match="awq: model.layers.0.mlp.up_proj gets no weight quantization"):
        quantize_model(m, _uint4(algos=[{"name": "gptq"}, {"name": "awq"}]).replace(exclude=("lm_head", "*up_proj")),
                       data, progress=False)
    with pytest.raises(ValueError, match="names 'mlp.nope'"):
        quantize_model(m, _uint4(algos=[{"name": "awq", "scaling_layers": [
            {"prev_op": "post_attention_layernorm", "layers": ["mlp.nope"], "inp": "mlp.nope"}]}]), data,
            progress=False)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    bert = zoo.tiny_bert()
    with pytest.raises(ValueError, match="no built-in scaling map .*BertLayer.*scaling_layers"):
        quantize_model(bert, preset("int8").replace(algorithms=({"name": "smoothquant"},)),
                       [torch.randint(0, 128, (2, 8))], progress=False)


def test_gptq_on_an_encoder(zoo):
    """BERT layers take (hidden_states, attention_mask, ...): the layer-by-layer driver replays them too."""
    bert = zoo.tiny_bert()
    data = [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in zoo.token_batches(6, seed=3, seq=16)]
    test = zoo.token_batches(1, seed=4, batch=4, seq=16)[0]
    with torch.no_grad():
        ref = bert(test).last_hidden_state
    cfg = preset("int4_wo_32").replace(exclude=())
    errs = []
    for algos in ((), ({"name": "gptq"},)):
        m = quantize_model(copy.deepcopy(bert), cfg.replace(algorithms=algos), data, progress=False)
        with torch.no_grad():
            errs.append(float((m(test).last_hidden_state - ref).pow(2).mean()))
    assert errs[1] < errs[0]

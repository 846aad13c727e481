"""HQQ bound to models (qcore.adapters.passes.hqq): no calibration data, every quantized Linear (the output head
too), the committed codes, export and reload, the CLI, the refusals before any work."""

from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qcore  # noqa: E402
from qcore.adapters import export_hf, from_pretrained, preset, quantize_model  # noqa: E402
from qcore.adapters.config import MSE, LayerConfig, TensorConfig  # noqa: E402
from qcore.algorithms.config import HQQConfig  # noqa: E402
from qcore.algorithms.hqq import hqq  # noqa: E402
from qcore.cli import main  # noqa: E402


def _uint4(group=16, algos=({"name": "hqq"},), **kw):
    return preset("w_uint4_per_group_asym", group_size=group).replace(algorithms=tuple(algos), **kw)


@pytest.fixture(scope="module")
def setup(zoo):
    model = zoo.tiny_llama()
    test = zoo.token_batches(1, seed=2, batch=2, seq=16)[0]
    return model, test


def _logits(m, x):
    with torch.no_grad():
        return m(x).logits


def test_without_data_every_quantized_linear_gets_hqqs_codes_and_export_reloads_them(setup, tmp_path):
    model, test = setup
    m = copy.deepcopy(model)
    floats = {n: x.weight.detach().clone() for n, x in m.named_modules() if isinstance(x, torch.nn.Linear)}
    quantize_model(m, _uint4(exclude=()), progress=False)  # exclude=(): the output head is quantized too
    assert "lm_head" in floats and len(floats) == 15
    for name, w in floats.items():
        mod = m.get_submodule(name)
        q = hqq(w, mod._qspecs["weight"])  # what HQQ gives for this weight alone
        assert torch.equal(mod.weight, qcore.dequantize(q)), name
        assert torch.equal(mod.weight_scale, q.scales) and torch.equal(mod.weight_zero_point, q.zero_points)
        rtn = qcore.quantize(w, mod._qspecs["weight"])
        assert not torch.equal(q.scales, rtn.scales), name  # not round-to-nearest
    out = _logits(m, test)
    info = export_hf(m, tmp_path / "ckpt")
    assert info.quant_method == "quark"  # a plain uint4 checkpoint Quark and vLLM load
    qc = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert qc["algo_config"] is None  # Quark has no HQQ and refuses names it does not know
    assert qc["qcore"]["config"]["algorithms"] == [HQQConfig().to_dict()]  # the qcore block keeps it
    back = from_pretrained(tmp_path / "ckpt")
    assert torch.equal(_logits(back, test), out)
    assert [a.name for a in back.qcore_config.algorithms] == ["hqq"]


def test_hqq_lowers_the_weight_error_of_round_to_nearest(setup):
    model, _ = setup
    rtn = quantize_model(copy.deepcopy(model), _uint4(algos=()), progress=False)
    h = quantize_model(copy.deepcopy(model), _uint4(), progress=False)
    w = dict(model.named_parameters())

    def err(m):  # the error each group's iterate is chosen by (error_p=2), over every quantized weight
        return sum(float((w[n + ".weight"] - x.weight).detach().pow(2).sum()) for n, x in m.named_modules()
                   if hasattr(x, "_qspecs"))
    assert err(h) < 0.99 * err(rtn)


def test_refusals_come_before_any_work(setup, zoo):
    model, _ = setup
    m = copy.deepcopy(model)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    data = zoo.token_batches(2, seed=1, batch=1, seq=16)
    cases = [
        (_uint4(algos=({"name": "gptq"}, {"name": "hqq"})), data, "both decide the quantized weights"),
        (_uint4(algos=({"name": "hqq"}, {"name": "awq"})), data, "comes last and once"),
        (_uint4(algos=({"name": "quarot"}, {"name": "gptq"}, {"name": "hqq"})), data, "both decide"),
        (_uint4(by_name={"model.layers.0.mlp.down_proj": LayerConfig(weight="float8_e4m3fn")}), None,
         "model.layers.0.mlp.down_proj: hqq: spec .* float8_e4m3fn elements"),
        (_uint4(layer=LayerConfig(weight=TensorConfig(qcore.QuantSpec("uint4", qcore.PerGroup(16)), observer=MSE()))),
         None, "weight observer MSE"),
        (_uint4(by_type={"Embedding": LayerConfig(weight="int8")}), None, "Linear .* weights only"),
        (_uint4(algos=({"name": "awq"}, {"name": "hqq"})), None, r"\['awq'\] need calibration data"),
    ]
    for cfg, d, match in cases:
        with pytest.raises(ValueError, match=match):
            quantize_model(m, cfg, d, progress=False)
        assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
        assert not getattr(m, "_qcore_partial", False)


def test_scaling_before_hqq_and_a_rotation_before_hqq(setup, zoo):
    model, test = setup
    data = zoo.token_batches(2, seed=1, batch=1, seq=16)
    for algos in (({"name": "smoothquant"}, {"name": "hqq"}), ({"name": "quarot"}, {"name": "hqq"})):
        m = quantize_model(copy.deepcopy(model), _uint4(algos=algos), data, progress=False)
        assert torch.isfinite(_logits(m, test)).all()


def test_the_command_line_quantizes_with_hqq_without_calibration(lm_dir, tmp_path, capsys):
    out, rep = tmp_path / "ckpt", tmp_path / "r.json"
    argv = ["quantize", "--model", str(lm_dir), "--scheme", "w_uint4_per_group_asym", "--group-size", "32",
            "--algo", "hqq", "--calib-samples", "0", "--eval", "none", "--output", str(out),
            "--export", "hf", "--report", str(rep),
            "--no-progress"]
    code = main(argv)
    o = capsys.readouterr()
    assert code == 0, o.err
    r = json.loads(rep.read_text())
    assert r["algorithms"] == ["hqq"] and r["calibration_samples"] == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "quark" and qc["qcore"]["config"]["algorithms"][0]["name"] == "hqq"
    back = from_pretrained(out)
    assert isinstance(back.model.layers[0].mlp.down_proj, qcore.adapters.QuantLinear)


def test_the_layer_runner_hook_fits_the_decoder_layers_linears(setup, zoo):
    """sequential.LAYER_BINDINGS[HQQConfig] (check / run per decoder layer, for passes that run the layer algorithms
    themselves): the same QTensors as the data-free pass, for the Linears of the decoder layers."""
    from qcore.adapters.passes import sequential
    from qcore.adapters.plan import plan_model
    model, _ = setup
    m = copy.deepcopy(model)
    cfg = _uint4()
    data = zoo.token_batches(1, seed=1, batch=1, seq=8)
    pinned = sequential.run_algorithms(m, plan_model(m, cfg), cfg.algorithms, data, progress=False)
    assert len(pinned) == 14 and all(n.startswith("model.layers.") for n in pinned)
    for name, q in pinned.items():
        w = model.get_submodule(name).weight
        assert torch.equal(q.codes, hqq(w.detach(), q.spec).codes), name
        assert torch.equal(m.get_submodule(name).weight, qcore.dequantize(q))  # the float weight rewritten

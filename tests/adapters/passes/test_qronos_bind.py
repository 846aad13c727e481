"""Qronos bound to models (src/qcore/adapters/passes/qronos.py): on a tiny Llama it beats round-to-nearest and GPTQ on the
model output, commits its codes, exports and reloads with equal logits; ``qcore quantize --algo qronos`` works end
to end; refusals (unknown modules, fused MoE experts) come before any weight changes."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import qcore  # noqa: E402
from qcore.adapters import export_hf, from_pretrained, preset, quantize_model  # noqa: E402
from qcore.adapters.passes import sequential  # noqa: E402
from qcore.algorithms.config import QronosConfig, parse_algorithm  # noqa: E402
from qcore.cli import main  # noqa: E402


def _uint4(algos=()):
    return preset("w_uint4_per_group_asym", group_size=16).replace(algorithms=tuple(algos))


def _mse(model, ref, batch):
    with torch.no_grad():
        return float((model(batch).logits - ref).pow(2).mean())


@pytest.fixture(scope="module")
def setup(zoo):
    model = zoo.tiny_llama()
    data = zoo.token_batches(4, seed=1, batch=2, seq=32)
    test = zoo.token_batches(1, seed=2, batch=4, seq=32)[0]
    with torch.no_grad():
        ref = model(test).logits
    pinned: dict = {}
    real = sequential.run_algorithms

    def spy(*a, **k):
        pinned.update(real(*a, **k))
        return pinned

    sequential.run_algorithms = spy
    try:
        q = quantize_model(copy.deepcopy(model), _uint4([{"name": "qronos"}]), data, progress=False)
    finally:
        sequential.run_algorithms = real
    return model, data, test, ref, q, pinned


def test_qronos_beats_round_to_nearest_and_gptq_on_the_model_output(setup):
    model, data, test, ref, q, _ = setup
    rtn = quantize_model(copy.deepcopy(model), _uint4(), progress=False)
    g = quantize_model(copy.deepcopy(model), _uint4([{"name": "gptq", "true_sequential": True}]), data,
                       progress=False)
    e_q, e_g, e_r = _mse(q, ref, test), _mse(g, ref, test), _mse(rtn, ref, test)
    assert e_q < 0.8 * e_r and e_q < e_g, (e_q, e_g, e_r)


def test_committed_weights_are_qronos_codes_and_export_reloads_them(setup, tmp_path):
    model, data, test, ref, q, pinned = setup
    linears = [n for n, x in q.named_modules() if n.startswith("model.layers.") and isinstance(x, torch.nn.Linear)]
    assert sorted(pinned) == sorted(linears) and len(linears) == 14
    for name, qt in pinned.items():
        mod = q.get_submodule(name)
        assert torch.equal(mod.weight, qcore.dequantize(qt)), name
        assert torch.equal(mod.weight_scale, qt.scales) and torch.equal(mod.weight_zero_point, qt.zero_points)
    with torch.no_grad():
        out = q(test).logits
    export_hf(q, tmp_path / "ckpt")
    back = from_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(back(test).logits, out)


def test_refusals_come_before_any_weight_changes(setup, family_model, zoo):
    model, data, *_ = setup
    m = copy.deepcopy(model)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match=r"^qronos modules: 'mlp\.nope' is not a module"):
        quantize_model(m, _uint4([{"name": "qronos", "modules": ["mlp.nope"]}]), data, progress=False)
    with pytest.raises(ValueError, match="calibration data"):
        quantize_model(m, _uint4([{"name": "qronos"}]), progress=False)
    after = m.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    moe = copy.deepcopy(family_model("mixtral"))
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    with pytest.raises(ValueError, match=r"^qronos: the plan quantizes fused MoE experts"):
        quantize_model(moe, preset("uint4_wo_32").replace(algorithms=({"name": "qronos"},)),
                       zoo.token_batches(2, seed=3), progress=False)
    after = moe.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_the_cli_quantizes_with_qronos_by_name(lm_dir, tmp_path, capsys):
    out = tmp_path / "ckpt"
    code = main(["quantize", "--model", str(lm_dir), "--scheme", "uint4_wo_32", "--algo", "qronos",
                 "--calib-samples", "2", "--seq-len", "32", "--eval", "none", "--output", str(out), "--no-progress"])
    o = capsys.readouterr()
    assert code == 0, o.err
    import json
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    algo = qc["algo_config"][0]
    assert algo["name"] == "qronos" and "alpha" in algo and "desc_act" in algo  # Quark's spelling
    back = parse_algorithm(algo)
    assert isinstance(back, QronosConfig) and back.to_quark() == algo and back.damp == QronosConfig().damp

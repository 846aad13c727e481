"""GPTAQ bound to models (qcore.adapters.passes.gptaq): quantize_model on a tiny Llama, the committed codes,
export and reload with equal logits, true_sequential, fused experts refused, and ``qcore quantize --algo gptaq``."""

from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qcore  # noqa: E402
from qcore.adapters import export_hf, from_pretrained, preset, quantize_model  # noqa: E402
from qcore.adapters.passes import sequential  # noqa: E402
from qcore.cli import main  # noqa: E402
from qcore.adapters.passes import targets  # noqa: E402


def _mse(model, ref, batch):
    with torch.no_grad():
        return float((model(batch).logits - ref).pow(2).mean())


def _uint4(algos=(), group=16):
    return preset("w_uint4_per_group_asym", group_size=group).replace(algorithms=tuple(algos))


@pytest.fixture(scope="module")
def setup(zoo):
    model = zoo.tiny_llama()
    data = zoo.token_batches(6, seed=1, batch=2, seq=32)
    test = zoo.token_batches(1, seed=2, batch=4, seq=32)[0]
    with torch.no_grad():
        ref = model(test).logits
    return model, data, test, ref


@pytest.mark.parametrize("algo", [{"name": "gptaq"}, {"name": "gptaq", "true_sequential": True, "alpha": 0.5}])
def test_gptaq_beats_round_to_nearest_commits_its_codes_and_reloads(setup, algo, tmp_path):
    model, data, test, ref = setup
    rtn = quantize_model(copy.deepcopy(model), _uint4(), progress=False)
    m = copy.deepcopy(model)
    pinned = {}
    real = sequential.run_algorithms

    def spy(*a, **k):
        pinned.update(real(*a, **k))
        return pinned

    sequential.run_algorithms = spy
    try:
        quantize_model(m, _uint4([algo]), data, progress=False)
    finally:
        sequential.run_algorithms = real
    assert _mse(m, ref, test) < 0.95 * _mse(rtn, ref, test)
    linears = [n for n, x in m.named_modules() if n.startswith("model.layers.") and isinstance(x, torch.nn.Linear)]
    assert sorted(pinned) == sorted(linears) and len(linears) == 14
    for name, q in pinned.items():
        mod = m.get_submodule(name)
        assert torch.equal(mod.weight, qcore.dequantize(q)), name
        assert torch.equal(mod.weight_scale, q.scales) and torch.equal(mod.weight_zero_point, q.zero_points)
    with torch.no_grad():
        out = m(test).logits
    export_hf(m, tmp_path / "ckpt")
    back = from_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(back(test).logits, out)


def test_alpha_zero_is_gptq_on_the_quantized_stream(setup):
    model, data, test, ref = setup
    a = quantize_model(copy.deepcopy(model), _uint4([{"name": "gptaq", "alpha": 0.0}]), data, progress=False)
    g = quantize_model(copy.deepcopy(model), _uint4([{"name": "gptq"}]), data, progress=False)
    # the same algorithm; numpy's loop here and torch's there differ in float32 rounding only
    assert _mse(a, ref, test) == pytest.approx(_mse(g, ref, test), rel=0.05)


def test_checks_run_before_any_weight_changes(setup):
    model, data, _, _ = setup
    m = copy.deepcopy(model)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match="mlp.nope"):
        quantize_model(m, _uint4([{"name": "gptaq", "modules": ["mlp.nope"]}]), data, progress=False)
    with pytest.raises(ValueError, match="alpha"):
        quantize_model(m, _uint4([{"name": "gptaq", "alpha": -1}]), data, progress=False)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())


def test_fused_experts_are_refused_by_name():
    cfg = _uint4([{"name": "gptaq"}])

    class Plan:
        name, type = "model.layers.0.mlp.experts", "Experts"
    with pytest.raises(ValueError, match="gptaq: the plan quantizes fused MoE experts"):
        targets.check_experts_algorithms([Plan()], qcore.algorithms.config.parse_algorithms(cfg.algorithms))


def test_the_command_line_quantizes_with_gptaq(lm_dir, tmp_path, capsys):
    out, rep = tmp_path / "ckpt", tmp_path / "r.json"
    code = main(["quantize", "--model", str(lm_dir), "--scheme", "w_uint4_per_group_asym", "--group-size", "32",
                 "--algo", "gptaq", "--calib-samples", "2", "--seq-len", "32", "--output", str(out), "--export", "hf",
                 "--report", str(rep), "--device", "cpu", "--dtype", "float32", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    r = json.loads(rep.read_text())
    assert r["algorithms"] == ["gptaq"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["algo_config"][0]["name"] == "gptaq" and qc["algo_config"][0]["alpha"] == 0.25
    assert "damp_percent" in qc["algo_config"][0]  # Quark's spelling
    assert main(["inspect", str(out)]) == 0

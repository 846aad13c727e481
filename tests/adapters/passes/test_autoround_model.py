"""AutoRound bound to models (qcore.adapters.passes.autoround): the learnt codes are committed and exported, the CLI
takes it by name, refusals come before any work."""

from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qcore  # noqa: E402
from qcore.adapters import export_hf, from_pretrained, preset, quantize_model  # noqa: E402
from qcore.adapters.passes import sequential  # noqa: E402
from qcore.adapters.passes import targets  # noqa: E402


def _uint4(group=16, algos=(), dtype=None):
    import dataclasses
    c = preset("w_uint4_per_group_asym", group_size=group).replace(algorithms=tuple(algos))
    if dtype is not None:
        w = c.layer.weight
        spec = dataclasses.replace(w.spec, dtype=qcore.get_dtype(dtype), name=dtype)
        c = c.replace(layer=dataclasses.replace(c.layer, weight=dataclasses.replace(w, spec=spec)))
    return c


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
    return model, data, test, ref


def _spy_pinned(monkeypatch):
    pinned = {}
    real = sequential.run_algorithms

    def spy(*a, **k):
        pinned.update(real(*a, **k))
        return pinned
    monkeypatch.setattr(sequential, "run_algorithms", spy)
    return pinned


def test_committed_weights_are_the_learnt_codes_and_export_reproduces_them(setup, tmp_path, monkeypatch):
    model, data, test, ref = setup
    m = copy.deepcopy(model)
    pinned = _spy_pinned(monkeypatch)
    quantize_model(m, _uint4(algos=[{"name": "autoround", "iters": 10, "batch_size": 2}]), data, progress=False)
    linears = [n for n, x in m.named_modules() if n.startswith("model.layers.") and isinstance(x, torch.nn.Linear)]
    assert sorted(pinned) == sorted(linears) and len(linears) == 14
    rtn = quantize_model(copy.deepcopy(model), _uint4(), progress=False)
    differ = 0
    for name, q in pinned.items():
        mod = m.get_submodule(name)
        assert torch.equal(mod.weight, qcore.dequantize(q)), name
        assert torch.equal(mod.weight_scale, q.scales) and torch.equal(mod.weight_zero_point, q.zero_points)
        differ += int(not torch.equal(mod.weight, rtn.get_submodule(name).weight))
    assert differ > 0  # the learnt rounding is not round-to-nearest
    with torch.no_grad():
        out = m(test).logits
    export_hf(m, tmp_path / "ckpt")
    qc = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert qc["algo_config"][0]["name"] == "autoround" and qc["algo_config"][0]["iters"] == 10
    back = from_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(back(test).logits, out)


def test_autoround_beats_round_to_nearest_at_3_bits(setup):
    model, data, test, ref = setup
    rtn = quantize_model(copy.deepcopy(model), _uint4(dtype="uint3"), progress=False)
    ar = quantize_model(copy.deepcopy(model), _uint4(algos=[{"name": "autoround", "iters": 20, "batch_size": 4}],
                                                     dtype="uint3"), data, progress=False)
    assert _mse(ar, ref, test) < _mse(rtn, ref, test)


def test_refusals_come_before_any_weight_changes(setup):
    model, data, _, _ = setup
    m = copy.deepcopy(model)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    mx = preset("mxfp4_weight_only").replace(algorithms=({"name": "autoround", "iters": 1},))
    with pytest.raises(ValueError, match="autoround.*mxfp4|float / MX"):
        quantize_model(m, mx, data, progress=False)
    with pytest.raises(ValueError, match="autoround modules: 'mlp.nope'"):
        quantize_model(m, _uint4(algos=[{"name": "autoround", "modules": ["mlp.nope"]}]), data, progress=False)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert not getattr(m, "_qcore_partial", False)


def test_fused_experts_are_refused_by_name():
    from types import SimpleNamespace
    from qcore.algorithms.config import parse_algorithms
    plans = [SimpleNamespace(name="model.layers.0.mlp.experts", type="Experts")]
    with pytest.raises(ValueError, match="autoround: the plan quantizes fused MoE experts"):
        targets.check_experts_algorithms(plans, parse_algorithms(["autoround"]))


def test_the_cli_takes_autoround_by_name_and_exports_quarks_algo_config(lm_dir, tmp_path, capsys):
    from qcore.cli import main
    out, rep = tmp_path / "ckpt", tmp_path / "r.json"
    argv = ["quantize", "--model", str(lm_dir), "--scheme", "w_uint4_per_group_asym", "--group-size", "32",
            "--exclude", "lm_head", "--algo", "autoround", "--calib-samples", "2", "--seq-len", "32",
            "--output", str(out), "--export", "hf", "--report", str(rep), "--device", "cpu", "--dtype", "float32",
            "--no-progress"]
    code = main(argv)
    assert code == 0, capsys.readouterr().err
    assert json.loads(rep.read_text())["algorithms"] == ["autoround"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    ac = qc["algo_config"][0]
    assert ac["name"] == "autoround" and ac["iters"] == 200 and ac["lr"] == 0.005 and ac["batch_size"] == 8
    back = from_pretrained(out)
    assert all(torch.isfinite(p).all() for p in back.parameters())

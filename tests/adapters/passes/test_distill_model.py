"""Quantization-aware distillation on whole models (qcore.adapters.passes.distill via quantize_model): training
lowers the KL to the float model, the exported checkpoint reloads to the trained model's logits exactly, the CLI
runs it by name, and what it cannot do is refused before any work."""

import copy
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import qcore.adapters as A  # noqa: E402
from qcore.algorithms.distill import kl_divergence  # noqa: E402


torch.set_num_threads(1)
DATA = [torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(i)) for i in range(6)]


def _kl(model, teacher):
    with torch.no_grad():
        return sum(float(kl_divergence(model(b).logits, teacher(b).logits)) for b in DATA) / len(DATA)


def _config(scheme, algos, **kw):
    return A.preset(scheme, **kw).replace(algorithms=tuple({"name": a} if isinstance(a, str) else a for a in algos))


@pytest.mark.parametrize("train_scales", [False, True])
def test_training_lowers_the_kl_to_the_float_model(train_scales, zoo):
    f = zoo.tiny_llama(0)
    cfg = dict(scheme="w_uint4_per_group_asym", group_size=32)
    before = A.quantize_model(copy.deepcopy(f), _config(cfg["scheme"], (), group_size=32), progress=False)
    d = {"name": "distill", "steps": 25, "lr": 1e-4, "train_scales": train_scales, "scale_lr": 1e-5,
         "eval_batches": 6}
    after = A.quantize_model(copy.deepcopy(f), _config(cfg["scheme"], [d], group_size=32), DATA, progress=False)
    k0, k1 = _kl(before, f), _kl(after, f)
    st = after.qcore_distill
    assert st["steps"] == 25 and st["tokens"] == 25 * 32
    assert st["eval_before"] == pytest.approx(k0, rel=1e-5) and st["eval_after"] == pytest.approx(k1, rel=1e-5)
    assert k1 < 0.8 * k0, (k0, k1)
    for m in A.quantized_modules(after).values():  # the weights lie on the grid of their stored scales
        w = m.weight.detach()
        q = __import__("qcore").quantize(w, m._qspecs["weight"], scale=m.weight_scale, zero_point=m.weight_zero_point)
        assert torch.equal(__import__("qcore").dequantize(q), w)


@pytest.mark.parametrize("scheme,algos", [("w_uint4_per_group_asym", ["gptq"]),
                                          ("w_mxfp4_a_mxfp4", ["quarot", "gptq"])])
def test_export_and_reload_give_the_trained_models_logits(scheme, algos, tmp_path, zoo):
    f = zoo.tiny_llama(1)
    kw = {"group_size": 32} if scheme.startswith("w_uint4") else {}
    base = A.quantize_model(copy.deepcopy(f), _config(scheme, algos, **kw), DATA, progress=False)
    m = A.quantize_model(copy.deepcopy(f), _config(scheme, algos + [{"name": "distill", "steps": 8, "lr": 3e-3}],
                                                   **kw), DATA, progress=False)
    ids = DATA[0]
    with torch.no_grad():
        ref = m(ids).logits
        assert not torch.equal(ref, base(ids).logits)  # the training changed the quantized model
    A.export_hf(m, tmp_path / "ckpt")
    qc = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert [a["name"] for a in qc["algo_config"]][-1] == "distill" or "distill" in json.dumps(qc)
    back = A.from_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref)


def test_refusals_before_any_work(zoo):
    f = zoo.tiny_llama(2)
    with pytest.raises(ValueError, match="train_scales"):  # MXFP4's scales are E8M0 powers of two
        A.quantize_model(f, _config("w_mxfp4_a_mxfp4", [{"name": "distill", "train_scales": True}]), DATA,
                         progress=False)
    with pytest.raises(ValueError, match="must come last"):
        A.quantize_model(f, _config("w_uint4_per_group_asym", ["distill", "gptq"], group_size=32), DATA,
                         progress=False)
    with pytest.raises(ValueError, match="needs training batches"):
        A.quantize_model(f, _config("w_uint4_per_group_asym", ["distill"], group_size=32), progress=False)
    with pytest.raises(ValueError, match="distill_data"):
        A.quantize_model(f, _config("w_uint4_per_group_asym", [], group_size=32), DATA, distill_data=DATA,
                         progress=False)
    from qcore.adapters.modules import is_quantized_module
    assert not any(is_quantized_module(m) for m in f.modules())  # nothing changed


def test_distill_data_is_what_it_trains_on(zoo):
    f = zoo.tiny_llama(3)
    cfg = _config("w_uint4_per_group_asym", [{"name": "distill", "steps": 3, "batch": 2, "lr": 1e-4}], group_size=32)
    m = A.quantize_model(copy.deepcopy(f), cfg, DATA[:1], distill_data=[b[:, :16] for b in DATA], progress=False)
    assert m.qcore_distill["tokens"] == 3 * 2 * 16


@pytest.mark.slow  # about 15 s each on the loaded 2-core machine
@pytest.mark.parametrize("algo", ["distill", "quarot,gptq,distill"])
def test_cli_quantizes_with_distill_and_exports(algo, lm_dir, tmp_path, capsys):
    from qcore.cli import main
    text, out, rep = lm_dir.parent / "text.txt", tmp_path / "ckpt", tmp_path / "r.json"
    argv = ["quantize", "--model", str(lm_dir), "--scheme", "w_uint4_per_group_asym", "--group-size", "32",
            "--algo", algo, "--calib-samples", "2", "--seq-len", "32", "--eval", "ppl", "--eval-text",
            str(text), "--output", str(out), "--export", "hf", "--report", str(rep), "--device", "cpu",
            "--no-progress"]
    code = main(argv)
    o = capsys.readouterr()
    assert code == 0, o.err
    r = json.loads(rep.read_text())
    assert r["algorithms"] == algo.split(",")
    assert main(["eval", "--model", str(out), "--eval-text", str(text), "--seq-len", "32", "--no-progress"]) == 0
    ppl = float(capsys.readouterr().out.split("perplexity")[1].split()[0])
    assert abs(ppl - r["ppl"]) < 1e-3 * r["ppl"]

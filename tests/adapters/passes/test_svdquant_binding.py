"""SVDQuant bound to models (src/qcore/adapters/passes/svdquant.py): the low-rank branch on QuantLinear (fake-quantized and
frozen, straight-through gradients), export_hf + from_pretrained with equal logits, the exporters that cannot
write the branch refuse it, and ``qcore quantize --algo svdquant``."""

import copy
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qcore  # noqa: E402
from qcore.adapters import export_hf, from_pretrained, preset, quantize_model  # noqa: E402
from qcore.adapters.modules import low_rank_modules  # noqa: E402

W4A4 = "w_int4_a_int4_per_token_dynamic"


def _quantized(zoo, algo=None, scheme=W4A4, seed=0):
    model = zoo.tiny_llama(seed)
    data = zoo.token_batches(3, seed=1)
    algo = algo or {"name": "svdquant", "rank": 4, "alpha_candidates": [0.3, 0.6]}
    cfg = preset(scheme, group_size=16).replace(algorithms=(algo,))
    return quantize_model(model, cfg, data, progress=False), data


@pytest.fixture(scope="module")
def quantized(zoo):
    ref = zoo.tiny_llama(0)
    model, data = _quantized(zoo)
    return ref, model, data


def test_every_linear_carries_a_branch_and_computes_the_svdquant_function(quantized):
    ref, model, data = quantized
    names = low_rank_modules(model)
    assert len(names) == 14  # 7 Linears x 2 layers; lm_head stays float
    attn = model.model.layers[0].self_attn
    # q/k/v and gate/up: smoothing folded into the norms; o_proj (grouped-query attention: v_proj -> o_proj
    # cannot be folded) keeps it in the module
    assert attn.q_proj.low_rank_branch.smoothing is None and model.model.layers[0].mlp.down_proj.low_rank_branch.smoothing is None
    o = attn.o_proj
    br = o.low_rank_branch
    assert br.smoothing is not None and br.down.shape == (4, 64) and br.up.shape == (64, 4)
    x = torch.randn(5, 64)
    xh = x / br.smoothing
    wq = o.effective("weight")
    spec = o.specs["input"]
    want = qcore.fake_quantize(xh, spec) @ wq.T + xh @ br.down.T @ br.up.T
    with torch.no_grad():
        torch.testing.assert_close(o(x), want, rtol=1e-5, atol=1e-5)
    # the residual is what was quantized: its codes are on the module's weight grid
    assert wq.shape == (64, 64)


def test_smoothing_and_branch_beat_round_to_nearest(quantized, zoo):
    ref, model, data = quantized
    rtn = quantize_model(zoo.tiny_llama(0), preset(W4A4, group_size=16), data, progress=False)
    x = zoo.token_batches(2, seed=7)[0]
    with torch.no_grad():
        a, b, c = ref(x).logits, model(x).logits, rtn(x).logits
    assert (a - b).norm() < 0.9 * (a - c).norm()


def test_straight_through_gradients_and_frozen_forward(quantized):
    _, model, _ = quantized
    m = copy.deepcopy(model.model.layers[1].self_attn.o_proj)
    br = m.low_rank_branch
    x = torch.randn(3, 64, requires_grad=True)
    g = torch.randn(3, 64)
    m(x).backward(g)
    # the activation quantizer passes gradients straight through: dy/dx = (Q(W) + up down) diag(1/s)
    want = (g @ (m.effective("weight") + br.up @ br.down)) / br.smoothing
    torch.testing.assert_close(x.grad, want, rtol=1e-5, atol=1e-6)
    y0 = m(x.detach())
    m.freeze()
    assert m.frozen and m.low_rank_branch is not None
    assert torch.equal(m(x.detach()), y0)


def test_export_hf_reloads_the_branch_with_equal_logits(quantized, tmp_path):
    _, model, data = quantized
    with torch.no_grad():
        want = model(data[0]).logits
    info = export_hf(model, tmp_path / "ckpt")
    assert info.quant_method == "qcore"  # Quark 0.13 has no export layout for SVDQuant's branch
    qc = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert qc["qcore"]["low_rank"]["model.layers.0.self_attn.o_proj"] == [4, True]
    assert qc["qcore"]["low_rank"]["model.layers.0.self_attn.q_proj"] == [4, False]
    assert qc["algo_config"][0]["name"] == "svdquant" and qc["algo_config"][0]["svd_rank"] == 4
    back = from_pretrained(tmp_path / "ckpt")
    assert len(low_rank_modules(back)) == 14
    with torch.no_grad():
        assert torch.equal(back(data[0]).logits, want)


def test_a_checkpoint_missing_its_branch_is_refused(quantized, tmp_path):
    _, model, _ = quantized
    export_hf(model, tmp_path / "c")
    cfgp = tmp_path / "c" / "config.json"
    d = json.loads(cfgp.read_text())
    del d["quantization_config"]["qcore"]["low_rank"]
    cfgp.write_text(json.dumps(d))
    with pytest.raises(Exception, match="lowrank_down|not a tensor"):
        from_pretrained(tmp_path / "c")


@pytest.mark.parametrize("fmt", ["gguf", "onnx", "compressed_tensors"])
def test_formats_without_the_branch_refuse_before_writing(quantized, tmp_path, fmt):
    _, model, _ = quantized
    out = tmp_path / ("m.gguf" if fmt == "gguf" else "m.onnx" if fmt == "onnx" else "ct")
    if fmt == "gguf":
        from qcore.adapters.io.gguf import export_gguf as f
    elif fmt == "onnx":
        from qcore.adapters.io.onnx import export_onnx as f
    else:
        from qcore.adapters.io.compressed_tensors import export_compressed_tensors as f
    with pytest.raises(ValueError, match="low-rank branch") as e:
        f(model, out)
    assert "model.layers.0.self_attn.q_proj" in str(e.value)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_gptq_on_the_residual(zoo):
    a, data = _quantized(zoo, {"name": "svdquant", "rank": 4, "search_alpha": False, "use_gptq": True})
    b, _ = _quantized(zoo, {"name": "svdquant", "rank": 4, "search_alpha": False})
    qa = a.model.layers[0].mlp.down_proj
    qb = b.model.layers[0].mlp.down_proj
    torch.testing.assert_close(qa.low_rank_branch.down, qb.low_rank_branch.down)  # same smoothing, same SVD
    assert not torch.equal(qa.effective("weight"), qb.effective("weight"))  # GPTQ's codes, not RTN's


def test_refusals_before_work(zoo):
    model = zoo.tiny_llama(0)
    before = copy.deepcopy(model.state_dict())
    cfg = preset(W4A4, group_size=16).replace(algorithms=({"name": "svdquant", "use_gptq": True},))
    # a weight spec GPTQ cannot take (stochastic rounding) is refused by name before any change
    import dataclasses
    w = cfg.layer.weight
    bad = cfg.replace(layer=dataclasses.replace(cfg.layer, weight=dataclasses.replace(
        w, spec=dataclasses.replace(w.spec, rounding=qcore.RoundingMode.STOCHASTIC))))
    with pytest.raises(ValueError, match="svdquant .use_gptq."):
        quantize_model(model, bad, zoo.token_batches(2, seed=0), progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_cli_quantize_algo_svdquant(lm_dir, tmp_path, capsys):
    from qcore.cli import main
    text, out, rep = lm_dir.parent / "text.txt", tmp_path / "ckpt", tmp_path / "r.json"
    argv = ["quantize", "--model", str(lm_dir), "--scheme", W4A4, "--group-size", "32", "--algo",
            '{"name": "svdquant", "svd_rank": 4, "alpha_candidates": [0.5]}', "--calib-samples", "2", "--seq-len",
            "32", "--eval", "ppl", "--eval-text", str(text), "--output", str(out), "--export", "hf", "--report",
            str(rep), "--dtype", "float32", "--no-progress"]
    code = main(argv)
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    r = json.loads(rep.read_text())
    assert r["algorithms"] == ["svdquant"] and r["quant_method"] == "qcore"
    assert main(["eval", "--model", str(out), "--eval-text", str(text), "--seq-len", "32", "--no-progress"]) == 0
    ppl = float(capsys.readouterr().out.split("perplexity")[1].split()[0])
    assert abs(ppl - r["ppl"]) < 1e-3 * r["ppl"]
    assert main(["quantize", "--model", str(lm_dir), "--algo", "svdquant", "--calib-samples", "1", "--seq-len", "16",
                 "--no-progress"]) == 0

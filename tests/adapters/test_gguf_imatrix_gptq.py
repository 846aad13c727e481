"""Importance matrices and GPTQ inside ``quantize_model`` for GGUF weight specs (issue 25).

- ``quantize_model(model, config, data, imatrix=stats_or_path)``: every module with a GGUF weight spec is
  quantized by llama.cpp's importance-weighted search: its frozen blocks are ``ggml_quantize_chunk``'s bytes with
  the module's ``quant_weights`` (oracle: ``qcore.testing.ggml``, skipped without llama.cpp's libggml-base);
- GPTQ to GGUF specs (``qcore.algorithms.gptq_gguf``): llama.cpp's search per block on the error-updated weights,
  lower layer output error than round-to-nearest with and without the imatrix; the result freezes exactly and
  exports to a GGUF file that imports as the same codes; with a diagonal Hessian it is llama.cpp's quantizer;
- refusals before any work.

Tiny Llama with 256-wide rows (tests/adapters/io/test_gguf_kquants.py)."""

import numpy as np
import pytest
import torch

import qcore
from qcore import _kquants
from qcore.algorithms.gptq import gptq
from qcore.testing.ggml import ggml_library, ggml_quantize

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from qcore.adapters import freeze, quantize_model  # noqa: E402
from qcore.adapters.config import LayerConfig, ModelConfig  # noqa: E402
from qcore.adapters.imatrix import collect_imatrix, module_quant_weights, save_imatrix  # noqa: E402

needs_ggml = pytest.mark.skipif(ggml_library() is None, reason="llama.cpp's libggml-base is not installed")


def tiny_llama256(seed=0, layers=1):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # weights with some per-column structure, as trained ones have
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.mul_(torch.exp(0.5 * torch.randn(mod.weight.shape[1])))
    return m


def _data(n=8, seq=64):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (1, seq), generator=g) for _ in range(n)]


def _config(name, *, gptq_=False, embedding=True, **algo):
    layer = LayerConfig(weight=qcore.make_spec(name))
    return ModelConfig(layer, by_type={"Embedding": layer} if embedding else {},
                       algorithms=({"name": "gptq", **algo},) if gptq_ else ())


def _linear_inputs(model, data):
    """{module name: [tokens, in] float inputs} of every Linear of the float model over ``data``."""
    xs: dict = {}
    hs = []
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and n != "lm_head":
            hs.append(m.register_forward_pre_hook(
                lambda mod, a, n=n: xs.setdefault(n, []).append(a[0].detach().reshape(-1, a[0].shape[-1]))))
    with torch.no_grad():
        for b in data:
            model(b)
    for h in hs:
        h.remove()
    return {n: torch.cat(v) for n, v in xs.items()}


# ---------------------------------------------------------------------------------------------------------------
# round-to-nearest with an imatrix: llama.cpp's bytes
# ---------------------------------------------------------------------------------------------------------------

@needs_ggml
@pytest.mark.parametrize("name", ["q4_k", "q3_k", "q6_k", "q5_0", "iq4_nl"])
def test_imatrix_blocks_are_ggml_quantize_chunk_with_the_imatrix(name):
    m = tiny_llama256()
    data = _data(2)
    stats = collect_imatrix(m, data, progress=False)
    qw = module_quant_weights(m, stats)
    floats = {n: mod.weight.detach().clone() for n, mod in m.named_modules() if n in qw}
    emb = m.model.embed_tokens.weight.detach().clone()
    quantize_model(m, _config(name), data, imatrix=stats, progress=False)
    assert not any("_gguf_importance" in mod.__dict__ for mod in m.modules())  # dropped at commit
    freeze(m)
    assert len(floats) == 7
    for n, w in floats.items():
        got = bytes(m.get_submodule(n).gguf_blocks())
        assert got == bytes(ggml_quantize(w.numpy(), name, imatrix=qw[n])), n
        assert got != bytes(ggml_quantize(w.numpy(), name)) or name == "q8_0", n  # the imatrix changed them
    # the embedding is a lookup: no statistic, quantized without (as llama.cpp)
    assert bytes(m.model.embed_tokens.gguf_blocks()) == bytes(ggml_quantize(emb.numpy(), name))


def test_imatrix_by_module_names_and_from_files_give_the_same_model(tmp_path):
    data = _data(2)
    ref = tiny_llama256()
    stats = collect_imatrix(ref, data, progress=False)
    by_module = collect_imatrix(ref, data, names="module", progress=False)
    save_imatrix(stats, tmp_path / "m.gguf")
    save_imatrix(stats, tmp_path / "m.dat")
    outs = []
    for imat in (stats, by_module, tmp_path / "m.gguf", str(tmp_path / "m.dat")):
        m = tiny_llama256()
        quantize_model(m, _config("q4_k"), data, imatrix=imat, progress=False)
        outs.append(m.model.layers[0].mlp.down_proj.weight.detach().clone())
    plain = tiny_llama256()
    quantize_model(plain, _config("q4_k"), data, progress=False)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert not torch.equal(plain.model.layers[0].mlp.down_proj.weight, outs[0])


def test_qat_keeps_the_importance_until_freeze():
    data = _data(2)
    m = tiny_llama256()
    stats = collect_imatrix(m, data, progress=False)
    w = m.model.layers[0].self_attn.q_proj.weight.detach().clone()
    qw = module_quant_weights(m, stats)["model.layers.0.self_attn.q_proj"]
    quantize_model(m, _config("q4_k"), data, imatrix=stats, qat=True, progress=False)
    q = m.model.layers[0].self_attn.q_proj
    want = torch.from_numpy(np.asarray(qcore.dequantize(qcore.quantize(w.numpy(), "q4_k", imatrix=qw))))
    assert torch.equal(q.effective("weight"), want)
    freeze(m)
    assert "_gguf_importance" not in q.__dict__
    assert torch.equal(torch.from_numpy(np.asarray(qcore.dequantize(q._frozen_qtensor()))), want)


# ---------------------------------------------------------------------------------------------------------------
# GPTQ to GGUF specs
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["q4_k", "q3_k", "q2_k", "q6_k", "q5_0"])
def test_gptq_beats_rtn_and_rtn_with_imatrix_on_layer_outputs(name):
    data = _data()
    base = tiny_llama256()
    xs = _linear_inputs(base, data)
    stats = collect_imatrix(base, data, progress=False)
    first = [n for n in xs if n.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))]  # float inputs

    def err(m):
        total = 0.0
        for n in first:
            w0 = base.get_submodule(n).weight.detach()
            wq = m.get_submodule(n).weight.detach()
            total += float(((xs[n] @ (w0 - wq).T) ** 2).sum())
        return total

    res = {}
    gq = _config(name, gptq_=True)
    for key, cfg, imat in (("rtn", _config(name), None), ("rtn+imatrix", _config(name), stats),
                           ("gptq", gq, None), ("gptq+imatrix", gq, stats)):
        m = tiny_llama256()
        quantize_model(m, cfg, data, imatrix=imat, progress=False)
        res[key] = err(m)
    assert res["gptq"] < res["rtn"] and res["gptq"] < res["rtn+imatrix"], res
    assert res["gptq+imatrix"] < res["rtn"] and res["gptq+imatrix"] < res["rtn+imatrix"], res


def test_gptq_result_freezes_exactly_and_exports_as_the_same_codes(tmp_path):
    from qcore.adapters.io.gguf import export_gguf, from_gguf

    data = _data(4)
    m = tiny_llama256()
    stats = collect_imatrix(m, data, progress=False)
    quantize_model(m, _config("q4_k", gptq_=True), data, imatrix=stats, progress=False)
    committed = {n: mod.weight.detach().clone() for n, mod in m.named_modules()
                 if n.startswith("model.layers") and hasattr(mod, "gguf_blocks")}
    with torch.no_grad():
        y = m(_data(1)[0]).logits
    freeze(m)  # freeze checks that the stored blocks give the committed weight bit for bit
    for n, w in committed.items():
        back = torch.from_numpy(np.asarray(qcore.dequantize(m.get_submodule(n)._frozen_qtensor())))
        assert torch.equal(back, w), n
    export_gguf(m, tmp_path / "a.gguf")
    back = from_gguf(tmp_path / "a.gguf")
    codes = [r for r in back.qcore_gguf_report.tensors if r.how == "codes"]
    assert len(codes) == 8 and {r.spec.gguf for r in codes} == {"q4_k"}
    down = back.model.layers[0].mlp.down_proj
    assert bytes(down.gguf_blocks()) == bytes(m.model.layers[0].mlp.down_proj.gguf_blocks())
    with torch.no_grad():
        assert torch.equal(back(_data(1)[0]).logits, y)


@pytest.mark.parametrize("name", ["q4_k", "q3_k", "q2_k", "q5_k", "q6_k", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0",
                                  "iq4_nl"])
def test_gptq_with_a_diagonal_hessian_is_llama_cpp_quantizer(name):
    """No error to spread (U diagonal): the blocks' scales are llama.cpp's search with imatrix = diag(H) / 2 and
    the codes its element rule under them (k-quants: its codes too). Float64 Hessians, identity and random."""
    rng = np.random.default_rng(3)
    w = (rng.normal(size=(8, 256)) * np.exp(rng.normal(size=256) * 0.5)).astype(np.float32)
    for diag in (np.ones(256), rng.uniform(0.2, 3.0, size=256)):
        h = np.diag(diag).astype(np.float64)
        r = gptq(w, h, qcore.make_spec(name), damp=0.0)
        ref = qcore.quantize(w, name, imatrix=(diag / 2).astype(np.float32))
        for f in ("d", "dmin", "scale_codes", "min_codes"):
            a, b = getattr(r.qtensor.super_scales, f), getattr(ref.super_scales, f)
            assert (a is None and b is None) or np.array_equal(a, b), f
        assert np.array_equal(r.qtensor.codes, _kquants.requantize(w, ref.super_scales, name))
        if qcore.GGUF_DTYPES[name].is_kquant:
            assert np.array_equal(r.qtensor.codes, ref.codes)
        assert np.array_equal(r.weight, np.asarray(qcore.dequantize(r.qtensor)))


@pytest.mark.parametrize("act_order,static_groups", [(False, False), (True, False), (False, True), (True, True)])
def test_gptq_gguf_act_order_and_static_groups(act_order, static_groups):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(1024, 512)).astype(np.float32)
    x[:, 1:] += 0.6 * x[:, :-1]
    x *= np.exp(rng.normal(size=512) * 0.5).astype(np.float32)
    w = rng.normal(size=(16, 512)).astype(np.float32)
    h = 2 * (x.T.astype(np.float64) @ x) / len(x)
    r = gptq(w, h, qcore.make_spec("q4_k"), act_order=act_order, static_groups=static_groups)
    rtn = np.asarray(qcore.dequantize(qcore.quantize(w, "q4_k", imatrix=(np.diag(h) / 2).astype(np.float32))))
    assert np.array_equal(r.weight, np.asarray(qcore.dequantize(r.qtensor)))
    assert float(((x @ (w - r.weight).T) ** 2).sum()) < float(((x @ (w - rtn).T) ** 2).sum())
    blocks = qcore.packing.pack_gguf_blocks(r.qtensor)  # GGUF bytes of exactly these codes
    assert np.array_equal(np.asarray(qcore.dequantize(qcore.packing.unpack_gguf_blocks(blocks, "q4_k"))), r.weight)


def test_gptq_gguf_torch_inputs_give_torch_results():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(8, 256)).astype(np.float32)
    x = rng.normal(size=(512, 256)).astype(np.float32)
    h = 2 * (x.T.astype(np.float64) @ x) / len(x)
    a = gptq(w, h, qcore.make_spec("q6_k"))
    b = gptq(torch.from_numpy(w), torch.from_numpy(h), qcore.make_spec("q6_k"))
    assert isinstance(b.weight, torch.Tensor) and isinstance(b.qtensor.super_scales.d, torch.Tensor)
    assert np.array_equal(b.weight.numpy(), a.weight)


# ---------------------------------------------------------------------------------------------------------------
# refusals, before any work
# ---------------------------------------------------------------------------------------------------------------

def test_refusals_name_the_module_and_change_nothing(tmp_path):
    data = _data(2)
    m = tiny_llama256()
    stats = collect_imatrix(m, data, progress=False)
    before = {k: v.clone() for k, v in m.state_dict().items()}

    def unchanged():
        assert not any(type(x).__name__.startswith("Quant") for x in m.modules())
        assert not any("_gguf_importance" in x.__dict__ for x in m.modules())
        assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())

    partial = {k: v for k, v in stats.items() if k != "blk.0.ffn_down.weight"}
    with pytest.raises(ValueError, match=r"no entry .*model\.layers\.0\.mlp\.down_proj \(blk\.0\.ffn_down\.weight\)"):
        quantize_model(m, _config("q4_k"), data, imatrix=partial, progress=False)
    unchanged()
    from qcore.algorithms.imatrix import ImatrixStats
    bad = dict(stats)
    bad["blk.0.ffn_down.weight"] = ImatrixStats(np.ones((1, 256)), np.array([4]))
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down\.weight.*model\.layers\.0\.mlp\.down_proj.*512"):
        quantize_model(m, _config("q4_k"), data, imatrix=bad, progress=False)
    unchanged()
    with pytest.raises(ValueError, match="GGUF type.*the config gives none"):
        quantize_model(m, "w_uint4_per_group_asym", data, imatrix=stats, progress=False)
    with pytest.raises(ValueError, match="no such file"):
        quantize_model(m, _config("q4_k"), data, imatrix=tmp_path / "none.gguf", progress=False)
    with pytest.raises(TypeError, match="imatrix must be a mapping"):
        quantize_model(m, _config("q4_k"), data, imatrix=3, progress=False)
    with pytest.raises(ValueError, match=r"imatrix= with the algorithms \['quarot'\]"):
        quantize_model(m, _config("q4_k").replace(algorithms=({"name": "quarot"}, {"name": "gptq"})), data,
                       imatrix=stats, progress=False)
    for algo in ("gptaq", "qronos"):
        with pytest.raises(ValueError, match=f"{algo}: model.layers.0.self_attn.q_proj: GGUF weight specs"):
            quantize_model(m, _config("q4_k").replace(algorithms=({"name": algo},)), data, progress=False)
    unchanged()
    with pytest.raises(ValueError, match="imatrix= applies to GGUF specs"):
        gptq(np.zeros((2, 256), np.float32), np.eye(256), qcore.make_spec("int4"), imatrix=np.ones(256))
    with pytest.raises(ValueError, match=r"imatrix must have shape \(256,\)"):
        gptq(np.zeros((2, 256), np.float32), np.eye(256), qcore.make_spec("q4_k"), imatrix=np.ones(3))


# ---------------------------------------------------------------------------------------------------------------
# qcore quantize --imatrix
# ---------------------------------------------------------------------------------------------------------------

def _scheme(tmp_path):
    import json
    scheme = tmp_path / "q5_0.json"
    scheme.write_text(json.dumps(ModelConfig(LayerConfig(weight=qcore.make_spec("q5_0"))).to_dict()))
    return scheme


def test_cli_imatrix_refusals_before_any_work(lm_dir, tmp_path, capsys):
    from qcore.cli import main

    common = ["--model", str(lm_dir), "--scheme", str(_scheme(tmp_path)), "--eval", "none", "--eval-text",
              str(lm_dir.parent / "text.txt"), "--seq-len", "32", "--calib-samples", "3", "--no-progress"]
    assert main(["quantize", *common, "--imatrix", str(tmp_path / "missing.gguf")]) == 2
    assert "--imatrix" in capsys.readouterr().err
    assert main(["quantize", *common[:3], "uint4_wo_32", *common[4:], "--imatrix", "calib"]) == 2
    assert "--imatrix calib applies to GGUF weight types" in capsys.readouterr().err
    assert main(["quantize", *common, "--imatrix", "calib", "--calib-samples", "0"]) == 2
    assert "--imatrix calib" in capsys.readouterr().err


def test_cli_imatrix_calib_and_file_with_gptq_and_gguf_export(lm_dir, tmp_path, capsys):
    import json

    import gguf as gguf_py

    from qcore.adapters.imatrix import load_imatrix
    from qcore.cli import main

    common = ["--model", str(lm_dir), "--scheme", str(_scheme(tmp_path)), "--eval", "none", "--eval-text",
              str(lm_dir.parent / "text.txt"), "--seq-len", "32", "--calib-samples", "3", "--no-progress"]
    assert main(["imatrix", "--model", str(lm_dir), "--output", str(tmp_path / "i.gguf"), "--eval-text",
                 str(lm_dir.parent / "text.txt"), "--seq-len", "32", "--calib-samples", "3", "--no-progress"]) == 0
    outs = {}
    for key, extra in (("calib", ["--imatrix", "calib"]), ("file", ["--imatrix", str(tmp_path / "i.gguf")])):
        assert main(["quantize", *common, *extra, "--algo", "gptq", "--export", "gguf", "--output",
                     str(tmp_path / key), "--report", str(tmp_path / f"{key}.json")]) == 0
        r = json.loads((tmp_path / f"{key}.json").read_text())
        assert r["algorithms"] == ["gptq"] and r["imatrix"] == ("calib (3 windows)" if key == "calib"
                                                                else str(tmp_path / "i.gguf"))
        reader = gguf_py.GGUFReader(tmp_path / key / "model.gguf")
        outs[key] = {t.name: bytes(np.asarray(t.data)) for t in reader.tensors}
    assert outs["calib"] == outs["file"]  # the same windows: the same importance, the same GPTQ codes
    assert len(load_imatrix(tmp_path / "i.gguf")) == 14


def test_work_dir_resume_keeps_the_gguf_codes_and_is_tied_to_the_imatrix(tmp_path):
    data = _data(2)
    m = tiny_llama256()
    stats = collect_imatrix(m, data, progress=False)
    cfg = _config("q4_k", gptq_=True, embedding=False)
    quantize_model(m, cfg, data, imatrix=stats, work_dir=tmp_path / "w", progress=False)
    freeze(m)
    again = tiny_llama256()
    quantize_model(again, cfg, data, imatrix=stats, work_dir=tmp_path / "w", resume=True, progress=False)
    freeze(again)  # the saved QTensors carry their super-scales: freeze writes the same blocks
    for n in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        assert bytes(again.get_submodule(n).gguf_blocks()) == bytes(m.get_submodule(n).gguf_blocks())
    other = {k: type(v)(v.sums * 2 + 1, v.counts) for k, v in stats.items()}
    with pytest.raises(ValueError, match="work_dir"):
        quantize_model(tiny_llama256(), cfg, data, imatrix=other, work_dir=tmp_path / "w", resume=True,
                       progress=False)


def test_tied_embedding_and_head_get_one_importance_or_none():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    data = _data(2)
    layer = LayerConfig(weight=qcore.make_spec("q6_k"))
    config = ModelConfig(layer, by_type={"Embedding": layer}, exclude=[])
    m = transformers.LlamaForCausalLM(cfg).eval()
    w = m.lm_head.weight.detach().clone()
    stats = collect_imatrix(m, data, process_output=True, progress=False)  # output.weight: the head's inputs
    with pytest.warns(UserWarning, match="tied weight.*quantized without"):
        quantize_model(m, config, data, imatrix=stats, progress=False)
    want = torch.from_numpy(np.asarray(qcore.dequantize(qcore.quantize(w.numpy(), "q6_k"))))
    assert torch.equal(m.lm_head.weight.detach(), want) and m.lm_head.weight is m.model.embed_tokens.weight

"""``qcore.adapters.jobs.convert`` / ``qcore convert``: format detection, conversions measured by loading the destination
back (lossless where both formats hold the grid, each changed tensor named otherwise), strict refusals that leave
the destination untouched, the errors and the command line."""

import json

import numpy as np

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

import qcore  # noqa: E402
import qcore.adapters as A  # noqa: E402
from qcore.adapters.io.formats import detect_format
from qcore.adapters.jobs.convert import compare_models, convert  # noqa: E402

from gguf_kit import tiny_tokenizer  # noqa: E402


def _llama(seed=0):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0)  # tiny_tokenizer's, as a real checkpoint's config
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


IDS = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(5))


def _hf_checkpoint(path, spec_or_preset, **layer):
    m = _llama()
    cfg = (A.preset(spec_or_preset) if isinstance(spec_or_preset, str)
           else A.ModelConfig(A.LayerConfig(weight=spec_or_preset, **layer)))
    A.quantize_model(m, cfg, [IDS[:, :12], IDS[:, 12:]], progress=False)
    A.freeze(m)
    A.export_hf(m, path, tokenizer=tiny_tokenizer())
    return m


def _logits(m):
    with torch.no_grad():
        return m(IDS).logits


def _q4_1_exact():
    return qcore.make_spec("uint4", granularity=qcore.PerGroup(32, axis=-1), scale_dtype="float16", symmetric=True)


def test_detect_format(tmp_path):
    _hf_checkpoint(tmp_path / "hf", "uint4_wo_64")
    assert detect_format(tmp_path / "hf").name == "hf"
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    assert detect_format(tmp_path / "x.gguf").name == "gguf"
    plain = tmp_path / "plain"
    _llama().save_pretrained(plain)
    with pytest.raises(ValueError, match="not quantized"):
        detect_format(plain)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        detect_format(tmp_path / "nope")
    (tmp_path / "w.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        detect_format(tmp_path / "w.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        detect_format(tmp_path / "empty")


def test_hf_to_hf_is_lossless_and_measured(tmp_path):
    m = _hf_checkpoint(tmp_path / "hf", "uint4_wo_64")
    info = convert(tmp_path / "hf", tmp_path / "hf2", to="quark")
    assert info.to == "hf" and info.source_format == "hf" and info.lossless and info.verified_by == "reload"
    assert info.quantized == 14
    back = A.from_pretrained(tmp_path / "hf2")
    assert torch.equal(_logits(back), _logits(m))


def test_compare_models_names_each_changed_tensor():
    a, b = _llama(0), _llama(0)
    spec = qcore.make_spec("int8", granularity=qcore.PerChannel(0))
    for m in (a, b):
        A.quantize_model(m, A.ModelConfig(A.LayerConfig(weight=spec)), [IDS], progress=False)
        A.freeze(m)
    assert compare_models(a, b) == []
    with torch.no_grad():
        b.model.norm.weight[0] += 1
    b.model.layers[1].mlp.up_proj.weight_scale.mul_(2)  # every weight of this layer doubles
    ch = {c.name: c for c in compare_models(a, b)}
    assert set(ch) == {"model.norm.weight", "model.layers.1.mlp.up_proj.weight"}
    assert ch["model.norm.weight"].what == "tensor" and ch["model.norm.weight"].max_abs_diff == 1.0
    assert ch["model.layers.1.mlp.up_proj.weight"].what == "weight"


def test_destination_rules(tmp_path):
    _hf_checkpoint(tmp_path / "hf", "uint4_wo_64")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "f").write_text("keep")
    with pytest.raises(FileExistsError, match="overwrite"):
        convert(tmp_path / "hf", tmp_path / "taken", to="hf")
    assert (tmp_path / "taken" / "f").read_text() == "keep"
    with pytest.raises(ValueError, match="is the source"):
        convert(tmp_path / "hf", tmp_path / "hf", to="hf", overwrite=True)
    with pytest.raises(ValueError, match="to must be one of"):
        convert(tmp_path / "hf", tmp_path / "o", to="safetensors")
    with pytest.raises(TypeError, match="strict must be a bool"):
        convert(tmp_path / "hf", tmp_path / "o", to="hf", strict="yes")
    with pytest.raises(TypeError, match="src must be a non-empty path"):
        convert(None, tmp_path / "o", to="hf")
    with pytest.raises(TypeError, match="dst must be a non-empty path"):
        convert(tmp_path / "hf", "", to="hf")
    with pytest.raises(ValueError, match="dst .*: .* is a file, not a directory"):  # below a file
        convert(tmp_path / "hf", tmp_path / "taken" / "f" / "o", to="hf")
    (tmp_path / "empty").mkdir()
    assert convert(tmp_path / "hf", tmp_path / "empty", to="hf").lossless  # an empty directory needs no overwrite
    info = convert(tmp_path / "hf", tmp_path / "taken", to="hf", overwrite=True)
    assert info.lossless and not (tmp_path / "taken" / "f").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_cli_convert(tmp_path, capsys):
    from qcore.cli import main
    _hf_checkpoint(tmp_path / "hf", "uint4_wo_64")
    rc = main(["convert", str(tmp_path / "hf"), str(tmp_path / "out"), "--to", "hf",
               "--report", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "lossless" in out
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["lossless"] and rep["quantized_weights"] == 14 and rep["changed"] == []
    rc = main(["convert", str(tmp_path / "hf"), str(tmp_path / "out"), "--to", "hf"])
    assert rc == 2 and "exists" in capsys.readouterr().err
    rc = main(["convert", str(tmp_path / "nope"), str(tmp_path / "o2"), "--to", "gguf"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def _q4_0_exact():
    return qcore.make_spec("int4", granularity=qcore.PerGroup(32, axis=-1), scale_dtype="float16")


def test_hf_to_gguf_to_hf_to_gguf_is_lossless_and_byte_identical(tmp_path):
    m = _hf_checkpoint(tmp_path / "hf", _q4_0_exact())
    a = convert(tmp_path / "hf", tmp_path / "a.gguf", to="gguf")
    assert a.lossless and a.verified_by == "reload" and a.quantized == 14 and a.destination.endswith("a.gguf")
    back = A.from_gguf(tmp_path / "a.gguf")
    assert torch.equal(_logits(back), _logits(m))
    b = convert(tmp_path / "a.gguf", tmp_path / "hf2", to="hf")
    assert b.source_format == "gguf" and b.lossless
    c = convert(tmp_path / "hf2", tmp_path / "c", to="gguf")  # a directory: c/model.gguf
    assert c.lossless and c.destination.endswith("model.gguf")
    d = convert(tmp_path / "a.gguf", tmp_path / "d.gguf", to="gguf")
    assert d.lossless
    assert (tmp_path / "d.gguf").read_bytes() == (tmp_path / "a.gguf").read_bytes()  # name and tokenizer kept


def test_inexact_conversion_names_the_tensors_and_strict_refuses(tmp_path):
    _hf_checkpoint(tmp_path / "hf", "uint4_wo_64")  # groups of 64 with float32 scales: no GGUF type holds them
    with pytest.raises(ValueError, match=r"not lossless, 14 tensors change: model\.layers\.0\..*dst was not written"):
        convert(tmp_path / "hf", tmp_path / "s.gguf", to="gguf", strict=True)
    assert not (tmp_path / "s.gguf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    info = convert(tmp_path / "hf", tmp_path / "x.gguf", to="gguf")
    assert not info.lossless and len(info.tensors) == 14
    assert all(t.what == "weight" and 0 < t.max_abs_diff < 0.1 for t in info.tensors)
    assert {t.name for t in info.tensors} == {f"{n}.weight" for n in A.quantized_modules(
        A.from_pretrained(tmp_path / "hf"))}


def test_activation_quantization_gguf_cannot_hold_is_reported(tmp_path):
    _hf_checkpoint(tmp_path / "hf", "w_int8_a_int8_per_token_dynamic")
    info = convert(tmp_path / "hf", tmp_path / "x.gguf", to="gguf")
    dropped = [t for t in info.tensors if t.what == "activation"]
    assert len(dropped) == 14 and all(t.destination == "absent" for t in dropped)
    assert "dropped" in json.dumps(info.to_dict()) or all(c["max_abs_diff"] is None for c in info.to_dict()["changed"]
                                                          if c["what"] == "activation")


def test_cli_convert_gguf_strict(tmp_path, capsys):
    from qcore.cli import main
    _hf_checkpoint(tmp_path / "hf", "uint4_wo_64")
    rc = main(["convert", str(tmp_path / "hf"), str(tmp_path / "o.gguf"), "--to", "gguf", "--strict"])
    assert rc == 2 and "not lossless" in capsys.readouterr().err and not (tmp_path / "o.gguf").exists()
    rc = main(["convert", str(tmp_path / "hf"), str(tmp_path / "o.gguf"), "--to", "gguf"])
    out = capsys.readouterr().out
    assert rc == 0 and "14 tensors changed" in out and "model.layers.0.mlp.down_proj.weight" in out


def test_convert_to_onnx_runs_in_onnxruntime(tmp_path):
    pytest.importorskip("onnxruntime")
    from qcore.adapters.io.onnx import decoder_logits
    from qcore.formats.onnx import ort_session
    m = _hf_checkpoint(tmp_path / "hf", "uint4_wo_64")
    info = convert(tmp_path / "hf", tmp_path / "o", to="onnx")
    # never loaded back (no ONNX loader): not called lossless, only the exporter's report of the quantized weights
    assert info.lossless is None and not info.tensors and info.verified_by == "exporter"
    assert info.destination.endswith("model.onnx")
    got = decoder_logits(ort_session(info.destination), IDS.numpy())
    assert np.allclose(got, _logits(m).numpy(), atol=1e-5)
    _hf_checkpoint(tmp_path / "mx", "mxfp4")  # fp4 has no onnxruntime kernel: refused, naming the tensor
    with pytest.raises(ValueError, match=r"model\.layers\.0\."):
        convert(tmp_path / "mx", tmp_path / "mx.onnx", to="onnx")
    assert not (tmp_path / "mx.onnx").exists()


@pytest.mark.parametrize("scheme", ["uint4_wo_64", "w_int8_a_int8_per_token_dynamic", "fp8"])
def test_hf_compressed_tensors_round_trip_is_lossless(scheme, tmp_path):
    pytest.importorskip("compressed_tensors")
    m = _hf_checkpoint(tmp_path / "hf", scheme)
    a = convert(tmp_path / "hf", tmp_path / "ct", to="ct")
    assert a.to == "compressed-tensors" and a.lossless and a.verified_by == "reload", a.tensors
    assert json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["quant_method"] == \
        "compressed-tensors"
    b = convert(tmp_path / "ct", tmp_path / "hf2", to="hf")
    assert b.source_format == "compressed-tensors" and b.lossless
    assert torch.equal(_logits(A.from_pretrained(tmp_path / "hf2")), _logits(m))


def test_kv_cache_conversion_to_compressed_tensors_says_where_loaders_differ(tmp_path):
    pytest.importorskip("compressed_tensors")
    m = _llama()
    A.quantize_model(m, A.preset("fp8", kv_cache="fp8"), [IDS[:, :12], IDS[:, 12:]], progress=False)
    A.freeze(m)
    A.export_hf(m, tmp_path / "hf", tokenizer=tiny_tokenizer())
    info = convert(tmp_path / "hf", tmp_path / "ct", to="compressed-tensors")
    assert info.lossless  # qcore's own importer reads the same scales back
    assert any("RoPE" in n for n in info.notes)

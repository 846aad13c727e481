"""Issue 21, "what the user is shown is true": a weight onnxruntime cannot dequantize (fp4) is refused with a
message naming what to type where it is read: ``unsupported='dequantize'`` from ``export_onnx``,
``onnx_unsupported='dequantize'`` from ``convert``, ``--onnx-unsupported dequantize`` from ``qcore quantize`` and
``qcore convert`` (one message, ``UnsupportedWeightError``); the fallback then works from each place."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnx")

import qcore.adapters as A  # noqa: E402
from qcore.adapters.jobs.convert import convert  # noqa: E402
from qcore.adapters.io.onnx import UnsupportedWeightError, export_onnx  # noqa: E402
from qcore.cli import main  # noqa: E402

TENSOR = "model.layers.0.self_attn.q_proj.weight"


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A float model directory and its mxfp4 weight-only qcore checkpoint."""
    root = tmp_path_factory.mktemp("mx")
    _llama().save_pretrained(root / "float")
    m = _llama()
    A.quantize_model(m, A.preset("mxfp4_weight_only"), progress=False)
    A.freeze(m)
    A.export_hf(m, root / "mx")
    return root


def _one_line(err):
    lines = [ln for ln in err.splitlines() if ln.startswith("qcore ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_export_onnx_names_its_argument(tmp_path):
    m = _llama()
    A.quantize_model(m, A.preset("mxfp4_weight_only"), progress=False)
    with pytest.raises(UnsupportedWeightError) as e:
        export_onnx(m, tmp_path / "m.onnx")
    assert isinstance(e.value, ValueError) and e.value.tensor == TENSOR and "float4_e2m1fn" in e.value.reason
    assert "Pass unsupported='dequantize' " in str(e.value) and "--onnx" not in str(e.value)
    assert list(tmp_path.iterdir()) == []
    again = e.value.with_option("--x y")  # the same message with another option, nothing else changed
    assert str(again) == str(e.value).replace("unsupported='dequantize'", "--x y")


def test_convert_names_its_argument_and_the_fallback_is_reported(dirs, tmp_path):
    with pytest.raises(UnsupportedWeightError, match=r"Pass onnx_unsupported='dequantize' to write") as e:
        convert(dirs / "mx", tmp_path / "o.onnx", to="onnx")
    assert e.value.tensor == TENSOR and not (tmp_path / "o.onnx").exists()
    with pytest.raises(ValueError, match=r"strict loads dst back .* to='onnx' cannot be loaded back"):
        convert(dirs / "mx", tmp_path / "o.onnx", to="onnx", onnx_unsupported="dequantize", strict=True)
    assert not (tmp_path / "o.onnx").exists()
    info = convert(dirs / "mx", tmp_path / "o.onnx", to="onnx", onnx_unsupported="dequantize")
    assert (tmp_path / "o.onnx").is_file() and not info.lossless and len(info.tensors) == 14
    assert {t.destination for t in info.tensors} == {"FLOAT (dequantized)"}
    for bad, exc in (("yes", ValueError), (1, TypeError)):
        with pytest.raises(exc, match="onnx_unsupported"):
            convert(dirs / "mx", tmp_path / "p.onnx", to="onnx", onnx_unsupported=bad)
    with pytest.raises(ValueError, match=r"onnx_unsupported='dequantize' applies to to='onnx'"):
        convert(dirs / "mx", tmp_path / "p", to="hf", onnx_unsupported="dequantize")
    assert not (tmp_path / "p.onnx").exists() and not (tmp_path / "p").exists()


def test_qcore_convert_names_the_flag(dirs, tmp_path, capsys):
    assert main(["convert", str(dirs / "mx"), str(tmp_path / "o.onnx"), "--to", "onnx"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"qcore convert: error: export_onnx: {TENSOR}: ")
    assert "Pass --onnx-unsupported dequantize to write" in line and "unsupported='" not in line
    assert not (tmp_path / "o.onnx").exists()
    assert main(["convert", str(dirs / "mx"), str(tmp_path / "o.onnx"), "--to", "onnx",
                 "--onnx-unsupported", "dequantize"]) == 0
    out = capsys.readouterr()
    assert "14 tensors changed" in out.out and "FLOAT (dequantized)" in out.out and "Warning" not in out.err
    assert main(["convert", str(dirs / "mx"), str(tmp_path / "h"), "--to", "hf",
                 "--onnx-unsupported", "dequantize"]) == 2
    assert _one_line(capsys.readouterr().err) == ("qcore convert: error: --onnx-unsupported dequantize applies to "
                                                  "--to onnx, not --to hf")
    assert not (tmp_path / "h").exists()


def test_qcore_quantize_names_the_flag(dirs, tmp_path, capsys):
    argv = ["quantize", "--model", str(dirs / "float"), "--scheme", "mxfp4_weight_only", "--eval", "none",
            "--no-progress", "--export", "onnx", "--output", str(tmp_path / "o")]
    assert main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"qcore quantize: error: --export onnx: export_onnx: {TENSOR}: ")  # before any work
    assert "Pass --onnx-unsupported dequantize to write" in line and "unsupported='" not in line
    assert not (tmp_path / "o").exists()
    assert main(argv + ["--onnx-unsupported", "dequantize"]) == 0
    assert (tmp_path / "o" / "model.onnx").is_file()
    err = capsys.readouterr().err  # the fallback is said in the command line's terms, not ONNXExportInfo's
    assert ("qcore quantize: --onnx-unsupported dequantize: 14 weight(s) onnxruntime cannot dequantize are written "
            f"as dequantized float32 (e.g. {TENSOR})") in err and "ONNXExportInfo" not in err

"""``qcore inspect`` (``qcore.formats.inspect``): per-layer bits per weight from what the file holds (mixed
precision, per-name overrides), agreement with ``qcore schemes``' count, GGUF files and ONNX export directories."""

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qcore.cli import main  # noqa: E402
from qcore.formats import inspect as fi  # noqa: E402
from qcore.formats.safetensors_io import SafetensorsFile  # noqa: E402

SUFFIXES = ("weight", "weight_scale", "weight_zero_point", "weight_scale_2", "weight_shifts")


def tiny_llama(hidden=64, inter=128):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def batches(n=1):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (1, 16), generator=g) for _ in range(n)]


def _export(model, config, d, data=None):
    from qcore.adapters import export_hf, quantize_model
    quantize_model(model, config, data, progress=False)
    export_hf(model, d, progress=False)
    return d


def _hand_bpw(d, float_model):
    """Per quantized layer: 8 x (bytes of its weight tensors in the safetensors files) / its float weight's size."""
    entries = {}
    for f in d.glob("*.safetensors"):
        entries.update(SafetensorsFile(f).entries)
    out = {}
    for name, m in float_model.named_modules():
        if f"{name}.weight_scale" not in entries:
            continue
        b = sum(entries[f"{name}.{s}"].end - entries[f"{name}.{s}"].begin for s in SUFFIXES
                if f"{name}.{s}" in entries)
        out[name] = 8 * b / m.weight.numel()
    return out


def test_mixed_precision_by_name_override_bits_per_layer_from_the_stored_tensors(tmp_path):
    from qcore.adapters import preset
    base = preset("uint4_wo_32")
    mx = preset("mxfp4_weight_only").layer
    int2 = preset("w_int2_per_group_asym").layer  # the qcore layout: codes packed row by row, float32 zero points
    fp8 = preset("ptpc_fp8").layer
    config = base.replace(by_name={"*down_proj": mx, "model.layers.1.self_attn.v_proj": int2,
                                   "model.layers.0.self_attn.*": fp8})
    d = _export(tiny_llama(), config, tmp_path / "mixed")
    info = fi.inspect_checkpoint(d)
    hand = _hand_bpw(d, tiny_llama())
    assert set(info["layers"]) == set(hand) and len(hand) == 14
    for n, v in info["layers"].items():
        assert v["bits_per_weight"] == pytest.approx(hand[n], abs=1e-4), n
    L = info["layers"]
    down = L["model.layers.0.mlp.down_proj"]
    # int2 has no Quark layout, so the checkpoint says quant_method "qcore" and every layer is stored in qcore's
    # 1-D packed layout (no tensor a loader without qcore could read as a float weight: docs/export.md)
    assert info["quant_method"] == "qcore" and {v["layout"] for v in L.values()} == {"qcore"}
    assert down["format"] == "mxfp4" and down["bits_per_weight"] == pytest.approx(4.25)
    assert L["model.layers.0.self_attn.q_proj"]["format"] == "float8_e4m3fn"
    # the total is the layers' bits over the layers' weights, each layer in its own format
    size = {k: tiny_llama().get_submodule(k).weight.numel() for k in hand}
    assert info["bits_per_weight"] == pytest.approx(sum(hand[k] * size[k] for k in hand) / sum(size.values()),
                                                    abs=1e-3)
    assert len(info["layers_per_format"]) == 4 and sum(info["layers_per_format"].values()) == 14


def test_cli_inspect_layers_flag(tmp_path, capsys):
    from qcore.adapters import preset
    d = _export(tiny_llama(), preset("mxfp4_weight_only"), tmp_path / "mx")
    assert main(["inspect", str(d), "--layers"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.1.mlp.down_proj" in out and "mxfp4 mx: 4.25 bits/weight" in out
    assert "layer formats" in out and "mxfp4: 14 layers, 4.25 bits/weight" in out


def _presets():
    from qcore.adapters import PRESETS
    return list(PRESETS)


@pytest.mark.parametrize("name", _presets())
def test_schemes_and_inspect_count_the_same_bits(name, tmp_path):
    from qcore.adapters import preset
    from qcore.adapters.modules import _norm_weight_granularity, _with_granularity
    model = tiny_llama(hidden=128, inter=256)
    shapes = {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    d = _export(model, preset(name), tmp_path / name, data=batches())
    info = fi.inspect_checkpoint(d)
    spec0 = preset(name).layer.weight.spec
    assert len(info["layers"]) == 14
    for n, v in info["layers"].items():
        shape = shapes[n]
        spec = _with_granularity(spec0, _norm_weight_granularity(spec0.granularity, "Linear", n, 2, shape))
        layout, bits = fi.layout_bits_per_weight(spec, shape)
        assert v["layout"] == layout and v["weights"] == math.prod(shape), n
        assert v["bits_per_weight"] == pytest.approx(bits, abs=1e-4), n


def test_schemes_prints_the_stored_count_and_says_where_the_spec_differs(capsys):
    assert main(["schemes"]) == 0
    by = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()}
    assert "4.56 bits/weight" in by["uint4_wo_64"] and "needs" not in by["uint4_wo_64"]
    assert "4.56 bits/weight (the spec needs 4.50; the int4_group layout stores zero points" in by["int4_wo_64"]
    assert "12.50 bits/weight (the spec needs 9.00" in by["mx9"] and "shift in a byte" in by["mx9"]
    assert by["mxfp4"].endswith("4.25 bits/weight")


def test_stored_bits_per_weight_checks_its_arguments():
    assert fi.stored_bits_per_weight({"w": ("U8", (4, 2)), "s": ("F32", (4,))}, 16) == (64 + 128) / 16
    with pytest.raises(ValueError, match="n_weights"):
        fi.stored_bits_per_weight({}, 0)
    with pytest.raises(ValueError, match="unknown safetensors dtype 'X9'"):
        fi.stored_bits_per_weight({"w": ("X9", (2,))}, 2)


def test_inspect_a_gguf_file_via_the_cli(tmp_path, capsys):
    pytest.importorskip("gguf")
    from qcore.adapters import preset, quantize_model
    from qcore.adapters.io.gguf import export_gguf
    m = tiny_llama()
    quantize_model(m, preset("int4_wo_32"), progress=False)
    path = tmp_path / "m.gguf"
    export_gguf(m, path)
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "gguf" and info["architecture"] == "llama"
    q = {n: v for n, v in info["layers"].items() if v["type"] == "Q4_0"}
    assert len(q) == 14 and all(v["bits_per_weight"] == 4.5 for v in q.values())
    assert info["layers"]["blk.0.attn_q"]["shape"] == [64, 64] and info["bits_per_weight"] == 4.5
    assert main(["inspect", str(path), "--layers"]) == 0
    out = capsys.readouterr().out
    assert "Q4_0 14" in out and "blk.1.ffn_down" in out
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(path.read_bytes()[:200])
    assert main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qcore inspect: error:") and "bad.gguf" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("fmt", ["qdq", "matmulnbits"])
def test_inspect_an_onnx_export_directory_via_the_cli(fmt, tmp_path, capsys):
    pytest.importorskip("onnx")
    from qcore.adapters import preset, quantize_model
    from qcore.adapters.io.onnx import export_onnx_dir
    m = tiny_llama()
    quantize_model(m, preset("uint4_wo_32"), progress=False)
    d = tmp_path / "onnx"
    export_onnx_dir(m, d, weight_format=fmt)
    assert main(["inspect", str(d), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "onnx" and info["quantized_weights"] == 14
    for v in info["layers"].values():  # 4-bit codes, a float32 scale and a 4-bit zero point per 32 weights
        assert v["bits_per_weight"] == pytest.approx(4 + (32 + 4) / 32, abs=0.02), v
    form = next(iter(info["forms"]))
    assert form.startswith("qdq block 32" if fmt == "qdq" else "MatMulNBits 4-bit block 32")
    assert main(["inspect", str(d), "--layers"]) == 0
    assert "quantized weights" in capsys.readouterr().out
    (d / "model.onnx").write_bytes(b"not onnx")
    assert main(["inspect", str(d)]) == 2
    err = capsys.readouterr().err
    assert "model.onnx" in err and len(err.strip().splitlines()) == 1


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "two").mkdir()
    for n in ("a.onnx", "b.onnx"):
        (tmp_path / "two" / n).write_bytes(b"")
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 60)
    cases = [(tmp_path / "missing", "missing"), (tmp_path / "notes.txt", "not a .gguf or .onnx file"),
             (tmp_path / "noconfig", "no config.json"), (tmp_path / "two", "expected one .onnx file"),
             (tmp_path / "empty.gguf", "empty.gguf"), (tmp_path / "junk.gguf", "junk.gguf")]
    for path, message in cases:
        assert main(["inspect", str(path)]) == 2, path
        err = capsys.readouterr().err
        assert err.startswith("qcore inspect: error:") and message in err, (path, err)
        assert len(err.strip().splitlines()) == 1, err


def test_inspect_of_a_gguf_file_imports_no_torch(tmp_path):
    pytest.importorskip("gguf")
    import subprocess
    import sys
    from qcore.adapters import preset, quantize_model
    from qcore.adapters.io.gguf import export_gguf
    m = tiny_llama()
    quantize_model(m, preset("int4_wo_32"), progress=False)
    export_gguf(m, tmp_path / "m.gguf")
    code = ("import sys; from qcore.cli import main; assert main(['inspect', sys.argv[1]]) == 0; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.gguf")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "Q4_0 14" in r.stdout

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
    from qcore.adapters.modules import weight_granularity, with_granularity
    model = tiny_llama(hidden=128, inter=256)
    shapes = {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    d = _export(model, preset(name), tmp_path / name, data=batches())
    info = fi.inspect_checkpoint(d)
    spec0 = preset(name).layer.weight.spec
    assert len(info["layers"]) == 14
    for n, v in info["layers"].items():
        shape = shapes[n]
        spec = with_granularity(spec0, weight_granularity(spec0.granularity, "Linear", n, 2, shape))
        layout, bits = fi.layout_bits_per_weight(spec, shape)
        assert v["layout"] == layout and v["weights"] == math.prod(shape), n
        assert v["bits_per_weight"] == pytest.approx(bits, abs=1e-4), n


def test_schemes_prints_the_stored_count_and_says_where_the_spec_differs(capsys):
    assert main(["schemes"]) == 0
    by = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()}
    assert "4.56 bits/weight" in by["uint4_wo_64"] and "needs" not in by["uint4_wo_64"]
    assert "4.56 bits/weight (the spec needs 4.50; the int4_group layout stores zero points" in by["int4_wo_64"]
    assert "12.50 bits/weight (the spec needs 9.00" in by["mx9"] and "shift in a byte" in by["mx9"]
    assert by["mxfp4"].split("; --algo best")[0].endswith("4.25 bits/weight")  # then its recipe


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


# ---- MoE checkpoints: fused experts written as per-expert Linears (src/qcore/adapters/io/experts.py) ----

def _zoo():
    """tests/adapters/conftest.py, loaded by path (its tiny random models of TINY_SPECS)."""
    import importlib.util
    import pathlib
    spec = importlib.util.spec_from_file_location(
        "_adapters_conftest", pathlib.Path(__file__).resolve().parents[1] / "adapters" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _entries(d):
    out = {}
    for f in d.glob("*.safetensors"):
        out.update(SafetensorsFile(f).entries)
    return out


@pytest.mark.parametrize("family, stored", [("mixtral", "block_sparse_moe.experts"), ("qwen3_moe", "mlp.experts"),
                                            ("qwen2_moe", "mlp.experts")])
def test_moe_export_with_quantized_experts(family, stored, tmp_path, capsys):
    from qcore.adapters import preset
    model = _zoo().tiny_family(family)
    fused = {n: (m.gate_up_proj.shape, m.down_proj.shape) for n, m in model.named_modules()
             if n.endswith("mlp.experts")}
    assert len(fused) == 2
    # the attention Linears uint4 per group, the experts int8 per channel (their own format, by type)
    config = preset("uint4_wo_32").replace(by_type={"Experts": preset("w_int8_per_channel_sym").layer})
    d = _export(model, config, tmp_path / family)
    info = fi.inspect_path(d)
    entries = _entries(d)
    assert info["quant_method"] == "qcore"
    for name, (gu, dn) in fused.items():
        e, two_i, h = gu
        assert tuple(dn) == (e, h, two_i // 2)
        row = info["layers"][name]
        n = e * (two_i * h + h * two_i // 2)  # E * (2I*H + H*I)
        prefix = name.replace("mlp.experts", stored) + "."
        mine = [k for k in entries if k.startswith(prefix) and k.rsplit(".", 1)[1] in SUFFIXES]
        assert len({k.rsplit(".", 1)[0] for k in mine}) == 3 * e  # every per-expert Linear counted
        nbytes = sum(entries[k].end - entries[k].begin for k in mine)
        assert row["format"] == "int8" and row["layout"] == "qcore" and row["experts"] == e
        assert row["weights"] == n and row["bytes"] == nbytes
        assert row["bits_per_weight"] == pytest.approx(8 * nbytes / n, abs=1e-4)
        assert 8 < row["bits_per_weight"] < 9  # int8 codes plus one float32 scale per output row
        assert row["stored_as"] == prefix[:-1]
    # no per-expert Linear is a layer of its own; the totals are over the layers the export planned
    assert not any(".experts." in n for n in info["layers"])
    planned = json.loads((d / "config.json").read_text())["quantization_config"]["qcore"]["layouts"]
    assert set(info["layers"]) == set(planned) and info["quantized_layers"] == len(planned)
    assert info["layers_per_format"] == {"int8": 2, "uint4": len(planned) - 2}
    tot_b = sum(v["bytes"] for v in info["layers"].values())
    tot_n = sum(v["weights"] for v in info["layers"].values())
    assert info["bits_per_weight"] == round(8 * tot_b / tot_n, 3)
    assert main(["inspect", str(d), "--layers"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("model.layers.0.mlp.experts ")]
    assert len(lines) == 1 and "int8 qcore" in lines[0] and f"stored as model.layers.0.{stored}.<e>" in lines[0]
    assert "int8: 2 layers" in out


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_export_with_the_experts_excluded(family, tmp_path, capsys):
    from qcore.adapters import preset
    config = preset("uint4_wo_32").replace(exclude=("lm_head", "*experts*"))
    d = _export(_zoo().tiny_family(family), config, tmp_path / family)
    info = fi.inspect_path(d)
    entries = _entries(d)
    assert any(".experts.0." in k and entries[k].dtype == "F32" for k in entries)  # float per-expert tensors
    assert info["quantized_layers"] == 8 and not any("expert" in n for n in info["layers"])
    assert info["layers_per_format"] == {"uint4": 8}
    assert main(["inspect", str(d), "--layers"]) == 0
    assert "experts" not in capsys.readouterr().out.split("excluded")[1].split("\n", 1)[1]


def test_inspect_a_moe_gguf_file(tmp_path, capsys):
    pytest.importorskip("gguf")
    from qcore.adapters import preset, quantize_model
    from qcore.adapters.io.gguf import export_gguf
    m = _zoo().tiny_family("mixtral")
    quantize_model(m, preset("int4_wo_32"), progress=False)
    path = tmp_path / "moe.gguf"
    export_gguf(m, path)
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for t, shape in (("gate", [4, 128, 64]), ("up", [4, 128, 64]), ("down", [4, 64, 128])):
        v = info["layers"][f"blk.0.ffn_{t}_exps"]
        assert v["type"] == "Q4_0" and v["shape"] == shape and v["bits_per_weight"] == 4.5
        assert v["weights"] == math.prod(shape) and v["bytes"] == math.prod(shape) // 32 * 18
    assert info["bits_per_weight"] == 4.5


def test_inspect_of_a_moe_checkpoint_imports_no_torch(tmp_path):
    import subprocess
    import sys
    from qcore.adapters import preset
    d = _export(_zoo().tiny_family("qwen3_moe"), preset("uint4_wo_32"), tmp_path / "moe")
    code = ("import sys; from qcore.cli import main; assert main(['inspect', sys.argv[1], '--layers']) == 0; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "model.layers.1.mlp.experts" in r.stdout and "4 experts" in r.stdout


def _write_moe(d, names, config_extra=None):
    """A hand-made 'qcore' checkpoint (numpy only): config.json planning model.layers.0.mlp.experts and 1-D U8
    codes + F32 scales under ``names`` (the per-expert Linears)."""
    import struct

    d.mkdir()
    header, off = {}, 0
    for n in names:
        for s, dt, shape, size in (("weight", "U8", [64], 64), ("weight_scale", "F32", [8, 1], 32)):
            header[f"{n}.{s}"] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + size]}
            off += size
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + bytes(off))
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 8,
           "moe_intermediate_size": 8,
           "quantization_config": {"quant_method": "qcore", "qcore": {
               "qcore_version": "0", "layouts": {"model.layers.0.mlp.experts": "qcore"},
               "config": {"layer": {"weight": {"spec": {"name": "int8"}}}, "by_type": {}, "by_name": {}}}}}
    cfg.update(config_extra or {})
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_hand_made_moe_checkpoint_and_its_corruptions(tmp_path, capsys):
    ok = [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    info = fi.inspect_checkpoint(_write_moe(tmp_path / "ok", ok))
    row = info["layers"]["model.layers.0.mlp.experts"]
    # 2 experts x 3 projections x (64 code bytes + 32 scale bytes), over 2 * (2*8*8 + 8*8) weights
    assert row["weights"] == 384 and row["bytes"] == 576 and row["bits_per_weight"] == 12.0
    assert row["format"] == "int8" and info["quantized_layers"] == 1 and info["bits_per_weight"] == 12.0
    # Mixtral's names: a sibling of the planned module's parent
    mx = [f"model.layers.0.block_sparse_moe.experts.{e}.w{i}" for e in range(2) for i in (1, 2, 3)]
    assert fi.inspect_checkpoint(_write_moe(tmp_path / "mx", mx))["layers"][
        "model.layers.0.mlp.experts"]["stored_as"] == "model.layers.0.block_sparse_moe.experts"
    bad = {"missing_proj": (ok[:-1], "3 projections"),  # expert 1 has no down_proj
           "gap": ([n.replace(".1.", ".2.") for n in ok], "experts 0..E-1"),  # experts 0 and 2
           "two_names": (mx + [n.replace("block_sparse_moe", "moe") for n in mx], "several names"),
           "none": (["model.layers.0.self_attn.q_proj"], "no model.layers.0.mlp.experts.weight"),
           "other_proj": (ok[:-1] + ["model.layers.0.mlp.experts.1.w2"], "the same 3 projections"),
           "fewer_than_config": (ok, "2 experts stored, config.json says 4")}
    for case, (names, message) in bad.items():
        d = _write_moe(tmp_path / case, names, {"num_experts": 4} if case == "fewer_than_config" else None)
        assert main(["inspect", str(d)]) == 2, case
        err = capsys.readouterr().err
        assert err.startswith("qcore inspect: error:") and message in err, (case, err)
        assert len(err.strip().splitlines()) == 1, err

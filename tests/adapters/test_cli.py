"""``qcore quantize`` and ``qcore schemes`` (listed by src/qcore/cli.py; parsers and commands in src/qcore/adapters/cli.py)."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qcore.adapters import PRESETS  # noqa: E402
from qcore.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def test_every_flag_end_to_end_then_inspect_and_eval_the_checkpoint(lm_dir, tmp_path, capsys):
    text, out, rep, png = lm_dir.parent / "text.txt", tmp_path / "ckpt", tmp_path / "r.json", tmp_path / "p.png"
    (out).mkdir()
    (out / "old.txt").write_text("replaced by --overwrite")
    argv = ["quantize", "--model", str(lm_dir), "--scheme", "w_uint4_per_group_asym", "--group-size", "32",
            "--kv-cache-dtype", "fp8", "--exclude", "lm_head", "--algo", "gptq", "--calib-samples", "3", "--seq-len", "64",
            "--eval", "ppl", "--eval-text", str(text), "--output", str(out), "--export", "hf", "--overwrite",
            "--max-shard-size", "40KB", "--report", str(rep), "--device", "cpu", "--dtype", "float32",
            "--no-progress"]
    if __import__("importlib.util").util.find_spec("matplotlib"):
        argv += ["--plot", str(png)]
    code = main(argv)
    o = capsys.readouterr()
    assert code == 0, o.err
    r = json.loads(rep.read_text())
    assert r["output_dir"] == str(out) and r["quant_method"] == "quark" and r["export_format"] == "hf"
    assert r["algorithms"] == ["gptq"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["algo_config"][0]["name"] == "gptq" and "damp_percent" in qc["algo_config"][0]  # Quark's schema
    assert r["bytes_on_disk"] == sum(f.stat().st_size for f in out.iterdir())
    assert r["calibration_samples"] == 3 and r["ppl"] != r["ppl_baseline"] and min(r["ppl"], r["ppl_baseline"]) > 1
    assert not (out / "old.txt").exists() and len(list(out.glob("model-*.safetensors"))) > 1
    assert (out / "tokenizer.json").is_file() and "checkpoint" in o.out
    assert main(["inspect", str(out)]) == 0
    o = capsys.readouterr().out
    assert "int4_group: 14" in o and "bits per weight" in o
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kv_cache"] == ["*k_proj", "*v_proj"] and info["safetensors_files"] > 1
    # the checkpoint evaluates to the perplexity the quantize run reported (the frozen model, reloaded)
    assert main(["eval", "--model", str(out), "--eval-text", str(text), "--seq-len", "64", "--no-progress"]) == 0
    ppl = float(capsys.readouterr().out.split("perplexity")[1].split()[0])
    assert abs(ppl - r["ppl"]) < 1e-3 * r["ppl"]


def test_amp_quantizes_exports_and_reloads(lm_dir, tmp_path, capsys):
    text, out, rep = lm_dir.parent / "text.txt", tmp_path / "amp", tmp_path / "r.json"
    assert main(["quantize", "--model", str(lm_dir), "--amp", "w_mxfp4_a_mxfp4,w_fp8_a_fp8", "--target-bits", "6",
                 "--calib-samples", "3", "--seq-len", "64", "--eval-text", str(text), "--output", str(out),
                 "--report", str(rep), "--no-progress"]) == 0
    o = capsys.readouterr()
    r = json.loads(rep.read_text())
    assert r["scheme"] == "amp w_mxfp4_a_mxfp4,w_fp8_a_fp8 at 6.0 bits/weight" and "amp w_mxfp4" in o.out
    lqc = json.loads((out / "config.json").read_text())["quantization_config"]["layer_quant_config"]
    dtypes = [v["weight"]["dtype"] for v in lqc.values()]
    assert len(lqc) == 14 and set(dtypes) == {"fp4", "fp8_e4m3"}
    fp4 = sum(d == "fp4" for d in dtypes)
    assert 2 <= fp4 <= 12  # a real mix (6 bits: about 40 % of the weights in fp8)
    assert main(["eval", "--model", str(out), "--eval-text", str(text), "--seq-len", "64", "--no-progress"]) == 0
    ppl = float(capsys.readouterr().out.split("perplexity")[1].split()[0])
    assert abs(ppl - r["ppl"]) < 1e-3 * r["ppl"]


def test_existing_output_is_refused_before_any_work(lm_dir, tmp_path, capsys):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x").write_text("keep")
    assert main(["quantize", "--model", str(lm_dir), "--scheme", "int8", "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "exists and is not empty; pass --overwrite" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "o" / "x").read_text() == "keep"


def test_ctrl_c_during_export_leaves_no_output_directory(lm_dir, tmp_path, capsys, monkeypatch):
    from qcore.adapters.io import common as E  # where the writers' shards are written
    real = E.write_file
    n = []

    def interrupted(*a, **k):
        n.append(1)
        if len(n) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(E, "write_file", interrupted)
    code = main(["quantize", "--model", str(lm_dir), "--scheme", "uint4_wo_32", "--eval", "none", "--output",
                 str(tmp_path / "o"), "--max-shard-size", "100KB", "--no-progress"])
    assert code == 130 and "interrupted" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_inspect_errors_are_one_line(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text("{}")
    (tmp_path / "c" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    assert main(["inspect", str(tmp_path / "c")]) == 2
    assert "header length" in capsys.readouterr().err


def test_inspect_does_not_import_torch(numpy_only):
    numpy_only("import qcore.cli\ntry:\n    qcore.cli.main(['inspect', '/nonexistent'])\nexcept SystemExit:\n    pass\n")


def test_schemes_lists_every_preset_with_bits(capsys):
    assert main(["schemes"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    from qcore.adapters import GGUF_MIX_PRESETS  # llama.cpp's mixes last: resolved on the model (docs/gguf.md)
    assert [ln.split()[0] for ln in lines] == list(PRESETS) + list(GGUF_MIX_PRESETS)
    by = {ln.split()[0]: ln for ln in lines}
    # 4 + (32-bit scale + 4-bit zero point) / 64, then the scheme's --algo best recipe
    assert by["uint4_wo_64"].split("; --algo best")[0].endswith("4.56 bits/weight")
    assert "I float8_e4m3fn per-token dynamic" in by["ptpc_fp8"]


def test_quantize_a_model_directory_writes_the_report(llama_dir, tmp_path, capsys):
    rep = tmp_path / "r.json"
    code = main(["quantize", "--model", str(llama_dir), "--scheme", "uint4_wo_32", "--eval", "none", "--report",
                 str(rep), "--no-progress"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "qcore quantize: done" in out.out and "layers quantized            14" in out.out
    r = json.loads(rep.read_text())
    for key in ("model", "scheme", "algorithms", "ppl_baseline", "ppl", "quantize_seconds", "peak_rss_bytes",
                "bytes_on_disk", "output_dir", "per_layer_sqnr_db", "qcore_version", "command"):
        assert key in r, key
    assert r["scheme"] == "uint4_wo_32" and r["ppl"] is None and r["layers_quantized"] == 14
    assert len(r["per_layer_sqnr_db"]) == 14 and "lm_head" not in r["per_layer_sqnr_db"]
    assert all(10 < v < 40 for v in r["per_layer_sqnr_db"].values())  # 4-bit weights: ~20-30 dB
    assert r["model_bytes_frozen"] < r["model_bytes_before"]
    assert r["command"].startswith("qcore quantize --model")


@pytest.mark.parametrize("argv, message", [
    (["--scheme", "w_int9"], "--scheme 'w_int9' is not a preset; did you mean"),
    (["--model", "/nonexistent/m.gguf"], "--model /nonexistent/m.gguf: no such GGUF file"),
    (["--algo", "gptq,quarot"], "--algo gptq,quarot: algorithms ['gptq', 'quarot']: a rotation (quarot / "
                                "spinquant) must come first"),
    (["--algo", "nosuchalgo"], "--algo nosuchalgo: algorithm 'nosuchalgo' is not available"),
    (["--export", "hf"], "--export hf needs --output DIR"),
    (["--max-shard-size", "huge", "--output", "/tmp/qcore-never-written"], "--max-shard-size huge is not a size"),
    (["--scheme", "fp8", "--group-size", "64"], "--group-size 64 does not apply to --scheme fp8: the preset has no "
                                                "per-group or block role"),
    (["--scheme", "/nonexistent/c.json"], "--scheme /nonexistent/c.json: no such file"),
    (["--dtype", "float64"], "--dtype must be one of"),
    (["--amp", "w_mxfp4_a_mxfp4,w_fp9", "--target-bits", "5"], "--amp: 'w_fp9' is not a preset"),
    (["--amp", "w_mxfp4_a_mxfp4,w_fp8_a_fp8"], "--amp needs exactly one of --target-bits and --max-loss"),
    (["--amp", "fp8", "--scheme", "fp8", "--target-bits", "5"], "give --amp or --scheme"),
    (["--target-bits", "5"], "--target-bits 5.0 applies to --amp"),
])
def test_bad_arguments_give_one_line_and_exit_2(argv, message, capsys):
    assert main(["quantize", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_model_errors(llama_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["quantize", "--model", str(tmp_path / "empty"), "--eval", "none"]) == 2
    assert "without config.json" in capsys.readouterr().err
    # static activations need calibration text, which needs the model's tokenizer
    assert main(["quantize", "--model", str(llama_dir), "--scheme", "fp8", "--eval", "none"]) == 2
    assert "no tokenizer found" in capsys.readouterr().err
    assert main(["quantize", "--model", str(llama_dir), "--exclude", "nothing_like_this", "--eval", "none",
                 "--scheme", "uint4_wo_32"]) == 2
    assert "matches no module" in capsys.readouterr().err


def test_debug_shows_the_traceback():
    with pytest.raises(ValueError, match="is not a preset"):
        main(["quantize", "--scheme", "w_int9", "--debug"])


def test_the_command_line_parser_does_not_import_torch(numpy_only):
    """The model commands' parsers live in qcore.adapters.cli: ``qcore --help`` lists them and the numpy commands
    parse without importing torch (or transformers); parsing a model command imports them."""
    numpy_only("import contextlib, io, sys\nimport qcore.cli\np = qcore.cli.build_parser()\n"
               "p.parse_args(['conformance', 'modes'])\n"
               "with contextlib.redirect_stdout(io.StringIO()) as out:\n    assert qcore.cli.main(['--help']) == 0\n"
               "assert 'quantize a model' in out.getvalue() and 'convert' in out.getvalue()\n"
               "assert 'transformers' not in sys.modules")


def test_the_model_commands_parse_through_the_adapters(capsys):
    from qcore.cli import build_parser
    args = build_parser().parse_args(["quantize", "--scheme", "fp8", "--algo", "gptq"])
    assert args.command == "quantize" and args.scheme == "fp8" and args.algo == ["gptq"] and args.seq_len == 512
    for command, needle in (("quantize", "--onnx-unsupported"), ("eval", "--tasks"), ("convert", "--to FORMAT"),
                            ("schemes", "--debug")):
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: qcore {command}") and needle in out, out


def test_eval_needs_a_tokenizer_and_task_flags_need_tasks(llama_dir, capsys):
    assert main(["eval", "--model", str(llama_dir)]) == 2
    assert "no tokenizer found" in capsys.readouterr().err
    # refused before any model loads (no --model: the embedded SmolLM2 is not loaded); --tasks: test_lm_eval.py
    for argv, message in [(["--limit", "3"], "--limit 3 applies to lm-evaluation-harness tasks; give --tasks too"),
                          (["--num-fewshot", "0"], "--num-fewshot 0 applies to lm-evaluation-harness tasks"),
                          (["--batch-size", "8"], "--batch-size 8 applies to lm-evaluation-harness tasks"),
                          (["--no-ppl"], "--no-ppl applies with --tasks"),
                          (["--tasks", "x", "--eval-text", "t.txt", "--no-ppl"], "--eval-text t.txt is read only for "
                                                                                 "perplexity")]:
        assert main(["eval", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_plot_writes_a_png_of_the_per_layer_sqnr(llama_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sqnr.png"
    assert main(["quantize", "--model", str(llama_dir), "--scheme", "mxfp4_weight_only", "--eval", "none",
                 "--plot", str(png), "--no-progress"]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    assert not list(tmp_path.glob("*.partial"))


def test_rotation_algorithms_from_the_command_line(lm_dir, tmp_path, capsys):
    out, rep = tmp_path / "ckpt", tmp_path / "r.json"
    argv = ["quantize", "--model", str(lm_dir), "--scheme", "w_mxfp4_a_mxfp4", "--algo",
            '{"name": "spinquant", "steps": 2, "lr": 0.5}', "--algo", "gptq", "--calib-samples", "2", "--seq-len",
            "32", "--eval", "none", "--output", str(out), "--export", "hf", "--report", str(rep), "--no-progress"]
    code = main(argv)
    o = capsys.readouterr()
    assert code == 0, o.err
    assert json.loads(rep.read_text())["algorithms"] == ["spinquant", "gptq"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "qcore" and qc["algo_config"][0]["name"] == "qcore_rotation"
    assert qc["algo_config"][0]["method"] == "spinquant" and qc["algo_config"][0]["steps"] == 2
    assert main(["quantize", "--model", str(lm_dir), "--algo", "{bad json"]) == 2
    assert "is not a JSON object" in capsys.readouterr().err


def test_export_gguf(lm_dir, tmp_path, capsys):
    """--export gguf writes DIR/model.gguf (tokenizer converted) that transformers loads with the in-memory
    model's weights; uint4_wo_32 has float32 scales, so the report names the small inexact differences."""
    gguf = pytest.importorskip("gguf")
    out, rep = tmp_path / "g", tmp_path / "r.json"
    code = main(["quantize", "--model", str(lm_dir), "--scheme", "int4_wo_32", "--eval", "none", "--export", "gguf",
                 "--output", str(out), "--report", str(rep), "--no-progress"])
    o = capsys.readouterr()
    assert code == 0, o.err
    assert sorted(p.name for p in out.iterdir()) == ["model.gguf"]
    r = json.loads(rep.read_text())
    assert r["export_format"] == "gguf" and r["gguf_lossless"] is False and len(r["gguf_inexact"]) == 14
    assert all(0 < t["max_abs_diff"] < 1e-3 and t["type"] == "Q4_0" for t in r["gguf_inexact"])
    assert "not lossless" in o.out
    rd = gguf.GGUFReader(out / "model.gguf")
    assert len(rd.fields["tokenizer.ggml.tokens"].contents()) == 256
    # activation quantization: refused before any work unless --drop-activations
    assert main(["quantize", "--model", str(lm_dir), "--scheme", "int8", "--eval", "none", "--export", "gguf",
                 "--output", str(tmp_path / "h"), "--no-progress"]) == 2
    assert "--drop-activations" in capsys.readouterr().err
    assert not (tmp_path / "h").exists()

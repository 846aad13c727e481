"""``qcore.adapters.quantize_and_report``: the main job as a function (src/qcore/adapters/jobs/quantize.py). The CLI's ``qcore
quantize`` is a thin parser over it: same report for the same arguments, every bad argument refused before any
work (nothing loaded, evaluated or written), errors naming the Python argument."""

import json
import pathlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qcore.adapters import QuantizeReport, from_pretrained, quantize_and_report  # noqa: E402
from qcore.adapters.jobs import quantize as J  # noqa: E402
from qcore.adapters.presets import preset  # noqa: E402
from qcore.adapters.plan import quantized_modules  # noqa: E402
from qcore.cli import main  # noqa: E402

TIMES = ("quantize_seconds", "total_seconds", "peak_rss_bytes")  # measured: differ between two runs
SQNRS = ("per_layer_sqnr_db", "per_layer_output_sqnr_db", "per_layer_rtn_sqnr_db", "per_layer_rtn_output_sqnr_db")


def _opts(lm_dir):
    return dict(eval_text=str(lm_dir.parent / "text.txt"), seq_len=32, calib_samples=3, progress=False)


@pytest.fixture(scope="module")
def both(lm_dir, tmp_path_factory):
    """The same job through the command line and through the function: (CLI report JSON, QuantizeReport, the
    function's report file, its output directory)."""
    tmp = tmp_path_factory.mktemp("main")
    argv = ["quantize", "--model", str(lm_dir), "--scheme", "uint4_wo_32", "--algo", "gptq", "--eval-text",
            str(lm_dir.parent / "text.txt"), "--seq-len", "32", "--calib-samples", "3", "--exclude", "lm_head",
            "--output", str(tmp / "cli_out"), "--report", str(tmp / "cli.json"), "--no-progress"]
    assert main(argv) == 0
    cli = json.loads((tmp / "cli.json").read_text())
    r = quantize_and_report(lm_dir, "uint4_wo_32", algorithms=["gptq"], exclude=["lm_head"], output=tmp / "py_out",
                            report=tmp / "py.json", command=cli["command"], **_opts(lm_dir))
    return cli, r, tmp / "py.json", tmp / "py_out"


def test_the_function_reports_what_the_command_line_writes(both):
    cli, r, report_file, out = both
    assert isinstance(r, QuantizeReport)
    d = r.to_dict()
    assert list(d) == list(cli)  # the same keys, in the same order
    assert json.loads(report_file.read_text()) == json.loads(json.dumps(d))  # report= writes to_dict()
    for key in d:
        if key in TIMES or key == "output_dir":
            continue
        if key in SQNRS:
            assert d[key] == pytest.approx(cli[key], rel=1e-9, abs=1e-9), key
        else:
            assert d[key] == cli[key], key
    assert d["output_dir"] == str(out) and cli["output_dir"].endswith("cli_out")
    assert d["algorithms"] == ["gptq"] and d["layers_quantized"] == 14 and d["eval_windows"] == 20
    assert d["ppl"] > 1 and d["ppl_baseline"] > 1 and d["ppl"] != d["ppl_baseline"]
    assert d["calibration_samples"] == 3 and d["export_format"] == "hf" and d["quant_method"] == "quark"
    assert [k["weight"] for k in d["kept_float"]] == ["lm_head.weight"]  # excluded, and said so
    assert d["per_layer_rtn_sqnr_db"] is not None  # gptq + report: round-to-nearest measured beside it
    # the value's own fields are what the JSON derives from
    assert r.config.algorithms[0].name == "gptq" and r.worst_layers == d["worst_layers"]
    assert set(r.layer_errors) == set(d["per_layer_sqnr_db"]) and r.export_info.bytes_on_disk == d["bytes_on_disk"]


def test_the_export_loads_back_with_the_quantized_models_logits(both, lm_dir):
    _, r, _, out = both
    q = from_pretrained(out, dtype=torch.float32)
    assert set(quantized_modules(q)) == set(r.layer_errors)
    ids = torch.arange(40).reshape(1, -1)
    with torch.no_grad():
        assert torch.equal(q(ids).logits, r.quantized_model(ids).logits)


def test_a_module_in_memory_is_quantized_in_place(lm_dir, both, tmp_path):
    cli, _, _, _ = both
    model = transformers.AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(lm_dir)
    config = preset("uint4_wo_32").replace(exclude=("lm_head",))
    r = quantize_and_report(model, config, tokenizer=tok, output=tmp_path / "o", export="compressed-tensors",
                            **_opts(lm_dir))
    assert r.quantized_model is model and r.tokenizer is tok and len(quantized_modules(model)) == 14
    assert r.ppl_baseline == cli["ppl_baseline"]  # the same float model on the same windows as the CLI run
    assert r.scheme == "config" and r.model == str(lm_dir) and r.export_format == "compressed-tensors"
    assert r.to_dict()["ct_lossless"] is not None and r.command.startswith("qcore.adapters.quantize_and_report(")
    assert "tokenizer=<" in r.command and "export='compressed-tensors'" in r.command
    q = from_pretrained(tmp_path / "o", dtype=torch.float32)
    ids = torch.arange(40).reshape(1, -1)
    with torch.no_grad():
        torch.testing.assert_close(q(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_the_report_gives_kl_divergence_and_top1_agreement_beside_perplexity(both):
    """Beside perplexity, on the same windows: the mean KL divergence to the float model and the top-1 agreement,
    in the report (the CLI's equal: test_the_function_reports_what_the_command_line_writes) and per window."""
    cli, r, _, _ = both
    d = r.to_dict()
    assert r.kl_divergence == d["kl_divergence"] == cli["kl_divergence"] and d["kl_divergence"] > 0
    assert 0 < d["top1_agreement"] < 1 and d["top1_agreement"] == r.top1_agreement
    assert len(d["kl_per_window"]) == len(d["top1_per_window"]) == d["eval_windows"]
    assert sum(d["kl_per_window"]) / d["eval_windows"] == pytest.approx(d["kl_divergence"], rel=1e-12)
    assert sum(d["top1_per_window"]) / d["eval_windows"] == pytest.approx(d["top1_agreement"], rel=1e-12)
    assert list(d).index("kl_divergence") == list(d).index("ppl") + 1


def _bf16_exact(lm_dir):
    """The tiny model with every weight rounded to bfloat16 (kept float32) and a scheme that rounds weights to
    bfloat16 under power-of-two scales: a "quantization" that changes nothing."""
    from qcore.adapters.config import ModelConfig
    model = transformers.AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    d = preset("w_int8_per_channel_sym").to_dict()
    d["layer"]["weight"]["spec"] = {"dtype": "bfloat16", "granularity": {"kind": "per_tensor"}, "pow2_scale": True}
    return model, transformers.AutoTokenizer.from_pretrained(lm_dir), ModelConfig.from_dict(d)


def test_a_quantization_that_changes_nothing_has_zero_kl_and_full_agreement(lm_dir):
    model, tok, config = _bf16_exact(lm_dir)
    r = quantize_and_report(model, config, tokenizer=tok, **_opts(lm_dir), cache=False)
    assert r.layers_quantized == 14 and r.ppl == r.ppl_baseline
    assert r.kl_divergence == 0.0 and r.top1_agreement == 1.0 and set(r.kl_per_window) == {0.0}
    model, tok, config = _bf16_exact(lm_dir)
    r = quantize_and_report(model, config, tokenizer=tok, **_opts(lm_dir), kl=False)  # skipped
    assert r.kl_divergence is r.top1_agreement is r.kl_per_window is None and r.ppl == r.ppl_baseline
    assert r.to_dict()["kl_divergence"] is None


def test_the_command_line_prints_them(lm_dir, capsys):
    argv = ["quantize", "--model", str(lm_dir), "--scheme", "uint4_wo_32", "--eval-text", str(lm_dir.parent / "text.txt"),
            "--seq-len", "32", "--calib-samples", "2", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("KL divergence to float"))
    assert "nats mean, top-1 agreement" in line and "%  (the same windows)" in line
    assert main(argv + ["--no-kl"]) == 0
    assert "KL divergence" not in capsys.readouterr().out


def test_qcore_eval_reference_compares_a_checkpoint_with_its_float_model(both, lm_dir, capsys):
    """``qcore eval --model CHECKPOINT --reference FLOAT``: the figures ``qcore quantize`` reported for it."""
    _, r, _, out_dir = both
    base = ["eval", "--eval-text", str(lm_dir.parent / "text.txt"), "--seq-len", "32", "--no-progress"]
    assert main(base + ["--model", str(out_dir), "--reference", str(lm_dir)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("KL divergence to reference"))
    assert f"{r.kl_divergence:.6f} nats mean, top-1 agreement {100 * r.top1_agreement:.2f}%" in line, out
    assert f"perplexity {r.ppl_baseline:.4f}" in out and f" {r.ppl:.4f}  (20 windows of 32 tokens" in out, out
    assert main(base + ["--model", str(lm_dir), "--reference", str(lm_dir)]) == 0
    assert "0.000000 nats mean, top-1 agreement 100.00%" in capsys.readouterr().out
    assert main(base + ["--model", str(lm_dir), "--reference", str(out_dir)]) == 2
    assert "--reference " + str(out_dir) + ": a quantized checkpoint" in capsys.readouterr().err


@pytest.fixture
def no_work(monkeypatch):
    """Loading, evaluating and quantizing fail the test if they run."""
    def fail(*a, **k):
        pytest.fail("work started before the refusal")
    monkeypatch.setattr(J, "load_model", fail)
    monkeypatch.setattr(J.E, "perplexity", fail)
    monkeypatch.setattr(J.quantizer, "quantize_model", fail)
    monkeypatch.setattr(J, "plan_model", fail)


def _bad(lm_dir, tmp):
    """(arguments, exception, words of the message): each refused before any work."""
    full = tmp / "full"
    full.mkdir()
    (full / "x").write_text("x")
    good = str(lm_dir)
    return [
        # wrong types, named by argument
        (dict(model=42), TypeError, "model: expected None"),
        (dict(model=good, scheme=3.5), TypeError, "scheme: expected"),
        (dict(model=good, seq_len="32"), TypeError, "seq_len: expected a positive int, got '32'"),
        (dict(model=good, seq_len=True), TypeError, "seq_len"),
        (dict(model=good, calib_samples=-1), ValueError, "calib_samples: expected a non-negative int, got -1"),
        (dict(model=good, exclude="lm_head"), TypeError, "exclude: expected a list"),
        (dict(model=good, device=3), TypeError, "device: expected a torch device"),
        (dict(model=good, progress="no"), TypeError, "progress: expected True or False"),
        (dict(model=good, kl=1), TypeError, "kl: expected True or False"),
        (dict(model=good, kl=False, eval="none"), ValueError, "kl=False applies to the KL divergence measured "
                                                              "beside perplexity, which eval='none' does not measure"),
        (dict(model=good, target_bits=float("nan")), ValueError, "target_bits: expected a positive finite number"),
        (dict(model=good, max_shard_size=1.5), TypeError, "max_shard_size: expected a size"),
        (dict(model=good, report=b"r.json"), TypeError, "report: expected a path"),
        # values outside the choices
        (dict(model=good, eval="bleu"), ValueError, "eval: expected one of 'ppl', 'none', got 'bleu'"),
        (dict(model=good, export="zip", output=str(tmp / "o")), ValueError, "export: expected one of"),
        (dict(model=good, kv_cache_dtype="int8"), ValueError, "kv_cache_dtype"),
        (dict(model=good, dtype="float64"), ValueError, "dtype must be one of"),
        # combinations and values the job refuses, in Python's words
        (dict(model=good, tokenizer=object()), ValueError, "tokenizer: applies to a model given as an nn.Module"),
        (dict(model=good, scheme="w_int9"), ValueError, "scheme='w_int9' is not a preset; did you mean"),
        (dict(model=good, scheme=preset("uint4_wo_32"), group_size=32), ValueError, "group_size applies to a preset scheme"),
        (dict(model=good, export="hf"), ValueError, "export='hf' needs output"),
        (dict(model=good, onnx_weights="matmulnbits"), ValueError, "onnx_weights='matmulnbits' applies to export='onnx'"),
        (dict(model=good, algorithms=["gptq", "quarot"]), ValueError, "algorithms=['gptq', 'quarot']: algorithms"),
        (dict(model=good, algorithms="nosuchalgo"), ValueError, "algorithm 'nosuchalgo' is not available"),
        (dict(model=good, amp="w_mxfp4_a_mxfp4,w_fp8_a_fp8"), ValueError, "amp needs exactly one of target_bits"),
        (dict(model=good, target_bits=5), ValueError, "target_bits=5.0 applies to amp"),
        (dict(model=good, seq_len=1), ValueError, "seq_len=1: perplexity needs windows of 2 tokens or more (or "
                                                  "eval='none')"),
        (dict(model=good, output=str(full)), ValueError, "pass overwrite=True to replace it"),
        (dict(model=good, report=str(lm_dir / "r.json")), ValueError, "lies inside the source"),
        (dict(model=good, output=str(tmp / "o"), report=str(tmp / "o" / "r.json")), ValueError, "report"),
        (dict(model=good, device="xla"), ValueError, "device"),
        (dict(model=good, eval_text=str(tmp / "missing.txt")), ValueError, "eval_text="),
        (dict(model=good, max_shard_size="huge", output=str(tmp / "o")), ValueError, "is not a size"),
        (dict(model=good, scheme="uint4_wo_32", calib_samples=0, algorithms=["gptq"]), ValueError,
         "calib_samples=0: algorithm gptq need calibration windows"),
        (dict(model=good, scheme="fp8", export="gguf", output=str(tmp / "o")), ValueError,
         "pass drop_activations=True"),
        # options that would change nothing (issue 33), and bad values named as given
        (dict(model=good, scheme="uint4_wo_32", calib_samples=8), ValueError,
         "calib_samples=8 has no effect: nothing in this run calibrates (no static scales, KV cache, algorithm "
         "reading data, amp or imatrix='calib')"),
        (dict(model=good, scheme="fp8", group_size=64), ValueError,
         "group_size=64 does not apply to scheme='fp8': the preset has no per-group or block role"),
        (dict(model=good, exclude=["re:[a"]), ValueError, "exclude='re:[a': bad regular expression 're:[a'"),
    ]


def test_bad_arguments_are_refused_before_any_work(lm_dir, tmp_path, no_work):
    cases = _bad(lm_dir, tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    model_files = sorted(p.name for p in pathlib.Path(lm_dir).rglob("*"))
    for kwargs, exc, words in cases:
        model = kwargs.pop("model")
        with pytest.raises(exc) as e:
            quantize_and_report(model, **kwargs)
        msg = str(e.value)
        assert words in msg, (kwargs, msg)
        assert " --" not in msg, msg  # the Python argument, not the command-line flag
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written
    assert sorted(p.name for p in pathlib.Path(lm_dir).rglob("*")) == model_files
    assert len(cases) == 38


def test_module_only_refusals_and_checks_after_loading(lm_dir, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="dtype='bfloat16': applies to a model read from a path"):
        quantize_and_report(model, dtype="bfloat16")
    with pytest.raises(ValueError, match="tokenizer: none given with the module"):  # ppl needs one
        quantize_and_report(model, "uint4_wo_32", progress=False)
    with pytest.raises(ValueError, match=r"seq_len=200: past the model's context \(max_position_embeddings 128\); "
                                         r"use seq_len=128 or less"):
        quantize_and_report(lm_dir, "uint4_wo_32", eval_text=lm_dir.parent / "text.txt", seq_len=200,
                            progress=False)
    assert not quantized_modules(model)  # refused: the module is left as it was


def test_the_command_line_still_names_flags(lm_dir, capsys):
    assert main(["quantize", "--model", str(lm_dir), "--seq-len", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "qcore quantize: error: --seq-len 1: perplexity needs windows of 2 tokens or more (or " \
                          "--eval none)"


def test_every_flag_of_qcore_quantize_is_an_argument_of_the_function():
    import inspect

    from qcore.cli import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["quantize"]
    sub.parse_known_args([])  # the model commands' flags are added when the command is parsed
    flags = {a.dest for a in sub._actions} - {"help", "debug"}  # --debug: tracebacks; Python raises anyway
    renames = {"algo": "algorithms", "no_progress": "progress", "no_cache": "cache", "no_kl": "kl"}
    params = set(inspect.signature(quantize_and_report).parameters)
    assert {renames.get(f, f) for f in flags} == params - {"tokenizer", "command"}


def test_without_torch_a_model_command_says_what_to_install(numpy_only):
    numpy_only("import contextlib, io, sys\nsys.modules['torch'] = None  # as if torch were not installed\n"
               "import qcore.cli\nerr = io.StringIO()\nwith contextlib.redirect_stderr(err):\n"
               "    assert qcore.cli.main(['quantize', '--help']) == 2\n"
               "assert err.getvalue().startswith('qcore quantize: error: this command needs torch'), err.getvalue()\n"
               "assert \"pip install 'qcore-numerics[hf]'\" in err.getvalue()\ndel sys.modules['torch']\n")

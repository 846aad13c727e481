"""Every bad input is one line naming the flag or field, exit code 2, before any work (issue 21).

``BAD_CLI``: a table of bad command lines for every subcommand (quantize, eval, schemes, convert, inspect,
conformance export / check / modes). Each row runs ``qcore.cli.main`` in-process and asserts exit code 2, exactly
one line on stderr that names the flag or field, no traceback, and nothing written (the working directory, where
the row's ``--output`` / ``--report`` / destination would go, holds the same files afterwards). The rows are
cheap: the error comes before any model loads (no row may load the embedded SmolLM2; ``_no_model_loads`` makes
loading one fail the test); the few rows that need a model to know the answer use a tiny saved Llama.
``test_real_entry_point`` runs some rows through the installed ``python -m qcore`` in a fresh interpreter.

Then the Python API (``ModelConfig.from_dict`` / ``from_json`` / ``from_quark``, ``quantize_model``'s
calibration batches, ``export_hf`` of KV-cache-only configs) and the message fixes (GPT-2's Conv1D, now a
supported type, the QuaRot refusal of Gemma's norms, the AWQ scaling-map hint, the gguf_inexact hint, no
warnings from optional libraries).
"""

import copy
import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qcore.adapters import ModelConfig, preset, quantize_model  # noqa: E402
from qcore.cli import main  # noqa: E402


DEEP = "[" * 100_000 + "]" * 100_000  # json.loads: RecursionError
GOOD = preset("w_uint4_per_group_asym").to_dict()
GOOD_QUARK = preset("w_uint4_per_group_asym").to_quark()


def _sub(d: dict, path: tuple, value) -> dict:
    d = copy.deepcopy(d)
    x = d
    for k in path[:-1]:
        x = x[k]
    x[path[-1]] = value
    return d


W = ("layer", "weight", "spec")
QW = ("global_quant_config", "weight")

# --scheme files: name -> (JSON text, what the error names)
SCHEME_FILES = {
    "list.json": ("[1, 2]", "expected a JSON object"),
    "string.json": ('"w_uint4"', "expected a JSON object"),
    "notjson.json": ("{layer: ", "not JSON"),
    "empty.json": ("", "not JSON"),
    "deep.json": (DEEP, "nested too deeply"),
    "qc_list.json": (json.dumps({"quantization_config": [1]}), "quantization_config must be a JSON object"),
    "unknown_key.json": (json.dumps({**GOOD, "colour": "red"}), "unknown field(s) ['colour']"),
    "layer_list.json": (json.dumps({"layer": []}), "layer config"),
    "spec_list.json": (json.dumps(_sub(GOOD, W, [])), "spec_from_dict takes a dict"),
    "group_0.json": (json.dumps(_sub(GOOD, W + ("granularity", "size"), 0)), "PerGroup size"),
    "group_neg.json": (json.dumps(_sub(GOOD, W + ("granularity", "size"), -1)), "PerGroup size"),
    "group_huge.json": (json.dumps(_sub(GOOD, W + ("granularity", "size"), 10**12)), "group / block size"),
    "group_str.json": (json.dumps(_sub(GOOD, W + ("granularity", "size"), "32")), "PerGroup size"),
    "dtype_int.json": (json.dumps(_sub(GOOD, W + ("dtype",), 4)), "dtype"),
    "dtype_unknown.json": (json.dumps(_sub(GOOD, W + ("dtype",), "int99")), "unknown dtype 'int99'"),
    "axis_huge.json": (json.dumps(_sub(GOOD, W + ("granularity", "axis"), 10**20)), "axis"),
    "by_name_list.json": (json.dumps({**GOOD, "by_name": [1]}), "'by_name'"),
    "by_type_list.json": (json.dumps({**GOOD, "by_type": []}), "'by_type'"),
    "exclude_str.json": (json.dumps({**GOOD, "exclude": "lm_head"}), "'exclude'"),
    "exclude_regex.json": (json.dumps({**GOOD, "exclude": ["re:[a"]}), "bad regular expression 're:[a'"),
    "by_name_regex.json": (json.dumps({**GOOD, "by_name": {"re:(": None}}), "bad regular expression 're:('"),
    "algo_unknown.json": (json.dumps({**GOOD, "algorithms": [{"name": "magic"}]}), "'magic' is not available"),
    "algo_int.json": (json.dumps({**GOOD, "algorithms": 5}), "'algorithms'"),
    "kv_unknown.json": (json.dumps({**GOOD, "kv_cache": {"spec": {"dtype": "float8_e4m3fn"}, "x": 1}}),
                        "kv_cache: unknown field(s) ['x']"),
    "quark_weight_str.json": (json.dumps(_sub(GOOD_QUARK, QW, "int4")), "global_quant_config: weight"),
    "quark_group_0.json": (json.dumps(_sub(GOOD_QUARK, QW + ("group_size",), 0)), "group_size"),
    "quark_group_huge.json": (json.dumps(_sub(GOOD_QUARK, QW + ("group_size",), 10**12)), "group / block size"),
    "quark_lqc_list.json": (json.dumps(_sub(GOOD_QUARK, ("layer_quant_config",), [])), "layer_quant_config"),
    "quark_exclude_int.json": (json.dumps(_sub(GOOD_QUARK, ("exclude",), 5)), "exclude"),
    "quark_exclude_regex.json": (json.dumps(_sub(GOOD_QUARK, ("exclude",), ["re:["])), "bad regular expression"),
    "quark_algo_str.json": (json.dumps(_sub(GOOD_QUARK, ("algo_config",), ["gptq"])), "algo_config"),
    "ct_without_qcore.json": (json.dumps({"quant_method": "compressed-tensors", "config_groups": {}}),
                              "a compressed-tensors quantization_config without a qcore block"),
    "qcore_block_newer.json": (json.dumps({"quant_method": "qcore", "qcore": {"format_version": 99, "config": GOOD}}),
                               "format_version is 99"),
}

Q = ["quantize", "--no-progress"]
BAD_CLI = [
    # quantize: --scheme files (every row names the file and the field)
    *[(Q + ["--scheme", name], f"--scheme {name}: ", msg) for name, (_, msg) in SCHEME_FILES.items()],
    (Q + ["--scheme", "missing.json"], "--scheme missing.json", "no such file"),
    (Q + ["--scheme", "w_int9"], "--scheme 'w_int9'", "not a preset"),
    # quantize: flags
    (Q + ["--group-size", "0"], "--group-size", "positive"),
    (Q + ["--group-size", "-1"], "--group-size", "non-negative"),
    (Q + ["--group-size", "abc"], "--group-size", "invalid int"),
    (Q + ["--scheme", "w_uint4_per_group_asym", "--group-size", str(10**12)], "--group-size", "group / block size"),
    (Q + ["--scheme", "fp8", "--group-size", "64"], "--group-size", "no per-group"),
    (Q + ["--exclude", "re:[a"], "--exclude", "bad regular expression 're:[a'"),
    (Q + ["--exclude", "re:("], "--exclude", "bad regular expression"),
    (Q + ["--exclude", ""], "--exclude", "non-empty"),
    *[(Q + ["--max-shard-size", v, "--output", "out"], f"--max-shard-size {v}", "is not a size")
      for v in ("abc", "0", "5XB", "infGB", "0.0000001B")],
    (Q + ["--max-shard-size=-5GB", "--output", "out"], "--max-shard-size -5GB", "is not a size"),
    (Q + ["--max-shard-size", "abc"], "--max-shard-size abc", "applies to the checkpoint written to --output"),
    (Q + ["--calib-samples", "0", "--scheme", "w_fp8_a_fp8"], "--calib-samples 0", "static input scales"),
    (Q + ["--calib-samples", "0", "--kv-cache-dtype", "fp8"], "--calib-samples 0", "KV-cache scales"),
    (Q + ["--calib-samples", "0", "--algo", "gptq"], "--calib-samples 0", "algorithm gptq"),
    (Q + ["--calib-samples", "-1"], "--calib-samples", "non-negative"),
    (Q + ["--calib-samples", "0", "--amp", "w_mxfp4_a_mxfp4", "--target-bits", "5"], "--calib-samples 0",
     "--amp's layer sensitivities"),
    (Q + ["--amp-samples", "0", "--amp", "w_mxfp4_a_mxfp4", "--target-bits", "5"], "--amp-samples 0",
     "sensitivity"),
    *[(Q + ["--amp", "w_mxfp4_a_mxfp4", "--target-bits", v], "--target-bits", "finite number")
      for v in ("-3", "0", "nan", "inf")],
    (Q + ["--amp", "w_mxfp4_a_mxfp4", "--target-bits", "four"], "--target-bits", "invalid number"),
    (Q + ["--amp", "w_mxfp4_a_mxfp4", "--max-loss", "-1"], "--max-loss", "non-negative"),
    (Q + ["--amp", "w_mxfp4_a_mxfp4", "--max-loss", "nan"], "--max-loss", "finite"),
    (Q + ["--amp", "w_mxfp4_a_mxfp4,w_fp9", "--target-bits", "5"], "--amp", "'w_fp9' is not a preset"),
    (Q + ["--algo", "magic"], "--algo magic", "'magic' is not available"),
    (Q + ["--algo", "gptq,rtn"], "--algo gptq,rtn", "'rtn' is not available"),
    (Q + ["--algo", "{not json"], "--algo", "is not a JSON object"),
    (Q + ["--algo", "{" * 100_000], "--algo", "JSON"),
    (Q + ["--algo", '{"name": "gptq", "colour": 1}'], "--algo", "colour"),
    (Q + ["--algo", "gptq,quarot"], "--algo", "must come first"),
    (Q + ["--algo", '{"name": "awq", "scaling_layers": 5}'], "--algo", "AWQConfig.scaling_layers must be a list"),
    (Q + ["--export", "hf"], "--export hf", "needs --output"),
    (Q + ["--export", "zip", "--output", "out"], "--export", "invalid choice"),
    (Q + ["--export", "gguf", "--output", "out", "--scheme", "w_fp8_a_fp8"], "--export gguf", "activations"),
    (Q + ["--dtype", "float64"], "--dtype", "must be one of"),
    (Q + ["--seq-len", "0"], "--seq-len", "positive"),
    (Q + ["--seq-len", "1"], "--seq-len 1", "windows of 2 tokens or more"),
    (Q + ["--eval", "bleu"], "--eval", "invalid choice"),
    (Q + ["--kv-cache-dtype", "int8"], "--kv-cache-dtype", "invalid choice"),
    (Q + ["--target-bits", "4"], "--target-bits", "applies to --amp"),
    (Q + ["--amp", "w_mxfp4_a_mxfp4,float", "--target-bits", "2"], "--target-bits 2.0", "below the fewest bits"),
    (Q + ["--algo", ",,,"], "--algo ,,,", "no algorithm named"),
    (Q + ["--eval-text", "adir"], "--eval-text adir", "no such file"),
    (Q + ["--onnx-weights", "matmulnbits"], "--onnx-weights", "applies to --export onnx"),
    (Q + ["--onnx-unsupported", "dequantize", "--export", "hf", "--output", "out"], "--onnx-unsupported",
     "not --export hf"),
    (Q + ["--drop-activations"], "--drop-activations", "applies to --export gguf"),
    (Q + ["--output", "src.json"], "--output src.json", "not a directory"),
    (Q + ["--model", "adir"], "--model adir", "without config.json"),
    (Q + ["--frobnicate"], "unrecognized arguments: --frobnicate", ""),
    # quantize: --report / --plot over a file the command reads, the checkpoint, or each other
    (Q + ["--eval-text", "src.json", "--plot", "src.json"], "--plot 'src.json' is the source --eval-text 'src.json'",
     "the plot would replace it"),
    (Q + ["--scheme", "src.json", "--report", "src.json"], "--report 'src.json' is the source --scheme 'src.json'",
     "the report would replace it"),
    (Q + ["--plot", "report.json"], "--plot 'report.json' is --report 'report.json'", "overwrite the other"),
    (Q + ["--output", "out", "--report", "out"], "--report 'out' is --output 'out'", "overwrite the other"),
    (Q + ["--output", "out", "--report", "out/model.safetensors"],
     "--report 'out/model.safetensors' lies inside --output 'out'", "which the export replaces"),
    (Q + ["--output", "src.json/out"], "--output 'src.json/out'", "is a file, not a directory"),
    (Q + ["--eval-text", "empty.json"], "--eval-text empty.json", "holds no text"),
    (Q + ["--eval-text", "binary.txt"], "--eval-text binary.txt", "not UTF-8 text"),
    # eval
    (["eval", "--limit", "0"], "--limit", "positive"),
    (["eval", "--limit", "3"], "--limit 3", "give --tasks too"),
    (["eval", "--num-fewshot", "-1"], "--num-fewshot", "non-negative"),
    (["eval", "--batch-size", "0"], "--batch-size", "positive"),
    (["eval", "--seq-len", "x"], "--seq-len", "invalid int"),
    (["eval", "--seq-len", "1"], "--seq-len 1", "windows of 2 tokens or more"),
    (["eval", "--eval-text", "missing.txt"], "--eval-text missing.txt", "no such file"),
    (["eval", "--dtype", "int8"], "--dtype", "must be one of"),
    (["eval", "--no-ppl"], "--no-ppl", "nothing to evaluate"),
    (["eval", "--tasks", ","], "--tasks", "comma-separated"),
    (["eval", "--eval-text", "empty.json"], "--eval-text empty.json", "holds no text"),
    # schemes
    (["schemes", "--all"], "unrecognized arguments: --all", ""),
    (["schemes", "extra"], "unrecognized arguments: extra", ""),
    # convert
    (["convert", "missing.gguf", "out", "--to", "hf"], "src", "does not exist"),
    (["convert", "src.json", "out", "--to", "bogus"], "--to", "must be one of"),
    (["convert", "src.json", "out", "--to", "hf", "--dtype", "float8"], "--dtype", "must be one of"),
    (["convert", "src.json", "out"], "--to", "required"),
    (["convert", "src.json", "out", "--to", "hf", "--report", "adir"], "--report adir", "is a directory"),
    (["convert", "src.json", "out", "--to", "hf", "--report", "out"], "--report 'out' is dst 'out'",
     "overwrite the other"),
    (["convert", "src.json", "out", "--to", "hf", "--report", "out/model.safetensors"],
     "--report 'out/model.safetensors' lies inside dst 'out'", "which the conversion replaces"),
    (["convert", "src.json", "r.json/m", "--to", "hf", "--report", "r.json"], "--report 'r.json' contains dst", ""),
    (["convert", "src.json", "deep.json/m", "--to", "hf"], "dst 'deep.json/m'", "is a file, not a directory"),
    # inspect
    (["inspect", "missing"], "'missing'", "is not a directory"),
    (["inspect", "src.json"], "'src.json'", "not a .gguf or .onnx file, nor a checkpoint directory"),
    (["inspect"], "PATH", "required"),
    (["inspect", "qc_list"], "qc_list/config.json", "quantization_config must be a JSON object, got list"),
    (["inspect", "gqc_str"], "gqc_str/config.json", "a quantization_config field is not what the format expects"),
    # conformance
    (["conformance", "export", "vec", "--formats", "nope"], "--formats", "unknown format 'nope'"),
    (["conformance", "export", "vec", "--formats", "mxfp4", "--modes", "bogus"], "--modes", "unknown mode"),
    (["conformance", "export", "vec", "--formats", "mxfp4", "--key", "-1"], "--key", "non-negative"),
    (["conformance", "export", "vec"], "--formats", "required"),
    (["conformance", "check", "missing", "--outputs", "adir"], "missing'", "no manifest.json"),
    (["conformance", "check", "adir", "--outputs", "adir", "--ulps", "-1"], "--ulps", "non-negative"),
    (["conformance", "check", "vec_empty", "--outputs", "src.json"], "src.json", "is a file, not a directory"),
    (["conformance", "check", "vec_list", "--outputs", "adir"], "manifest.json", "expected a JSON object, got list"),
    (["conformance", "check", "vec_cases", "--outputs", "adir"], "manifest.json", "cases must be a list of objects"),
    (["conformance", "check", "vec_escape", "--outputs", "adir"], "manifest.json", "cases[0].name must be a directory"),
    (["conformance", "check", "adir", "--outputs", "adir", "--max-examples", "x"], "--max-examples", "invalid int"),
    (["conformance", "modes", "--formats", "nope"], "--formats", "unknown dtype 'nope'"),
    (["conformance", "modes", "--formats", ","], "--formats", "comma-separated"),
    (["conformance", "frobnicate"], "invalid choice", ""),
    (["frobnicate"], "invalid choice", ""),
]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The working directory of a row: the --scheme files, an empty directory ``adir``, a JSON file ``src.json``."""
    for name, (text, _) in SCHEME_FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "adir").mkdir()
    (tmp_path / "src.json").write_text("{}")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00\x80" * 8)
    from qcore.conformance import SCHEMA
    for name, manifest in (("vec_list", [1]), ("vec_empty", {"schema": SCHEMA, "formats": ["mxfp4"], "cases": []}),
                           ("vec_cases", {"schema": SCHEMA, "formats": ["mxfp4"], "cases": "x"}),
                           ("vec_escape", {"schema": SCHEMA, "formats": ["mxfp4"], "cases": [
                               {"name": "../x", "format": "mxfp4", "op": "cast", "mode": "m", "files": []}]})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps(manifest))
    for name, qc in (("qc_list", [1]), ("gqc_str", {"quant_method": "quark", "global_quant_config": "x"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"quantization_config": qc}))
        (tmp_path / name / "model.safetensors").write_bytes(b"\x02\0\0\0\0\0\0\0{}")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(autouse=True)
def _no_model_loads(monkeypatch):
    """Loading the embedded SmolLM2 fails the test: a bad input is refused before any model loads."""
    from qcore.adapters.eval import models

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the bad input was refused")
    monkeypatch.setattr(models, "load_smollm2", refuse)


def _listing(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def _assert_one_line(err: str, flag: str, message: str) -> None:
    lines = err.strip().splitlines()
    # the notice that a run without --output saves nothing comes before the work (AMP's measurements, say) that
    # some refusals need; it is not part of the error
    lines = [line for line in lines if not line.startswith("qcore quantize: no --output DIR given")]
    assert len(lines) == 1, err
    assert "Traceback" not in err and flag in lines[0] and message in lines[0], err
    assert lines[0].startswith("qcore"), err
    for py in ("=True", "=False", "=None", "data=", "quark_entries="):  # flags, not Python arguments
        assert py not in lines[0], err


@pytest.mark.parametrize("argv, flag, message", BAD_CLI, ids=[" ".join(r[0])[:60] for r in BAD_CLI])
def test_bad_command_line(argv, flag, message, workdir, capsys):
    before = _listing(workdir)
    if argv[0] == "quantize" and "--report" not in argv:  # asked for, and still not written
        argv = [*argv, "--report", "report.json"]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    _assert_one_line(err, flag, message)
    assert _listing(workdir) == before  # nothing written: no output dir, report, vectors or staging leftovers
    assert not (workdir / "report.json").exists() and not (workdir / "out").exists()


KV_ONLY = json.dumps({"layer": None, "kv_cache": {"spec": {"dtype": "float8_e4m3fn"}}})
ACT_ONLY = json.dumps({"layer": {"input": {"spec": {"dtype": "float8_e4m3fn"}}}})

# rows whose answer needs the model (its module names); the tiny Llama loads, nothing is evaluated or written
BAD_WITH_MODEL = [
    (["--scheme", "kv_only.json", "--output", "out"], "--export hf", "KV-cache-only or activation-only"),
    (["--scheme", "act_only.json", "--output", "out", "--export", "compressed-tensors"],
     "--export compressed-tensors", "not their weight"),
    (["--exclude", "no_such_module"], "--exclude 'no_such_module'", "matches no module"),
    (["--amp", "w_mxfp4_a_mxfp4,float", "--target-bits", "100", "--seq-len", "32", "--amp-samples", "1",
      "--calib-samples", "1", "--eval", "none", "--eval-text", "long.txt"], "--amp chose 'float' for every layer",
     "nothing to quantize"),
    (["--scheme", "w_int4_per_group_sym", "--output", "out", "--export", "compressed-tensors"],
     "--export compressed-tensors", "groups of 128 do not divide the 64 input features"),
    *[(["--scheme", sch, "--output", "out", "--export", "compressed-tensors"], "--export compressed-tensors",
       f"weight ({sch}): ") for sch in ("nvfp4", "mx6", "bfp16")],
    (["--scheme", "w_fp8_a_fp8", "--eval-text", "short.txt", "--seq-len", "32"], "--seq-len 32",
     "static input scales (--scheme) need calibration windows"),
    (["--algo", "gptq", "--scheme", "uint4_wo_32", "--eval-text", "short.txt", "--seq-len", "32", "--eval", "none"],
     "--eval-text", "algorithm gptq need calibration windows"),
]


@pytest.mark.parametrize("argv, flag, message", BAD_WITH_MODEL,
                         ids=[f"{i}-{r[0][1]}" for i, r in enumerate(BAD_WITH_MODEL)])
def test_bad_command_line_known_from_the_model(argv, flag, message, lm_dir, workdir, capsys, monkeypatch):
    (workdir / "kv_only.json").write_text(KV_ONLY)
    (workdir / "act_only.json").write_text(ACT_ONLY)
    (workdir / "long.txt").write_text("a text long enough for a few calibration windows of 32 tokens. " * 40)
    (workdir / "short.txt").write_text("a short text of a hundred bytes, which leaves no calibration window " * 1)
    from qcore.adapters.eval import evaluate
    monkeypatch.setattr(evaluate, "perplexity", lambda *a, **k: pytest.fail("evaluated before refusing"))
    before = _listing(workdir)
    assert main(Q + ["--model", str(lm_dir), *argv]) == 2
    _assert_one_line(capsys.readouterr().err, flag, message)
    assert _listing(workdir) == before


ENTRY_POINT_ROWS = [  # through the real entry point: a fresh interpreter, its stderr as a user sees it
    (["quantize", "--scheme", "deep.json"], "--scheme deep.json: the JSON is nested too deeply"),
    (["quantize", "--group-size", "0"], "argument --group-size: must be a positive int"),
    (["conformance", "modes", "--formats", "nope"], "--formats: unknown dtype 'nope'"),
]


@pytest.mark.parametrize("argv, message", ENTRY_POINT_ROWS, ids=[r[0][1] for r in ENTRY_POINT_ROWS])
def test_real_entry_point(argv, message, workdir):
    before = _listing(workdir)
    p = subprocess.run([sys.executable, "-m", "qcore", *argv], cwd=workdir, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in p.stderr, p.stderr
    assert _listing(workdir) == before


# ---------------------------------------------------------------------------------------------------------------
# the Python API
# ---------------------------------------------------------------------------------------------------------------

BAD_DICTS = [  # ModelConfig.from_dict: (dict, what the message names)
    ([], "takes a dict"),
    ({"layer": []}, "layer config"),
    ({"layer": {"weight": []}}, "tensor config"),
    (_sub(GOOD, W + ("granularity", "size"), 0), "PerGroup size"),
    (_sub(GOOD, W + ("granularity", "size"), -1), "PerGroup size"),
    (_sub(GOOD, W + ("granularity", "size"), 10**12), "group / block size 1000000000000"),
    (_sub(GOOD, W + ("granularity", "size"), "32"), "PerGroup size"),
    (_sub(GOOD, W + ("granularity", "size"), float("nan")), "PerGroup size"),
    (_sub(GOOD, W + ("granularity", "axis"), 10**20), "names an axis outside"),
    (_sub(GOOD, W + ("granularity",), {"kind": "per_block", "shape": 5}), "granularity.shape"),
    (_sub(GOOD, W + ("granularity",), {"kind": "per_block", "shape": [4, 4], "axes": 3}), "granularity.axes"),
    (_sub(GOOD, W + ("granularity",), {"kind": "per_block", "shape": [2**17, 1]}), "group / block size 131072"),
    (_sub(GOOD, W + ("symmetric",), "yes"), "symmetric"),
    (_sub(GOOD, W + ("scale_mode",), []), "spec.scale_mode"),
    ({**GOOD, "by_type": []}, "'by_type'"),
    ({**GOOD, "by_name": [1]}, "'by_name'"),
    ({**GOOD, "by_name": {"re:(": None}}, "bad regular expression 're:('"),
    ({**GOOD, "exclude": 5}, "'exclude'"),
    ({**GOOD, "exclude": {"a": 1}}, "'exclude'"),
    ({**GOOD, "exclude": ["re:[a"]}, "bad regular expression 're:[a'"),
    ({**GOOD, "kv_cache": []}, "kv_cache"),
    ({**GOOD, "kv_cache": {"spec": {"dtype": "float8_e4m3fn"}, "targets": 5}}, "KVCacheConfig.targets"),
    ({**GOOD, "kv_cache": {"spec": {"dtype": "float8_e4m3fn"}, "targets": ["re:("]}}, "bad regular expression"),
    ({**GOOD, "kv_cache": {"spec": {"dtype": "float8_e4m3fn"}, "colour": 1}}, "unknown field(s) ['colour']"),
    ({**GOOD, "algorithms": 5}, "'algorithms'"),
    ({**GOOD, "algorithms": "gptq"}, "'algorithms'"),
    ({**GOOD, "algorithms": [{"name": "gptq", "x": json.loads("[" * 900 + "]" * 900)}]}, ""),  # deep: no crash
    ({"layer": {"input": {"spec": {"dtype": "int8"}, "observer": {"kind": "mse", "grid": 10**12}}}}, "MSE.grid"),
    ({"colour": 1}, "unknown field(s) ['colour']"),
]


@pytest.mark.parametrize("d, message", BAD_DICTS, ids=[str(i) for i in range(len(BAD_DICTS))])
def test_from_dict_refuses_malformed_configs(d, message):
    if not message:  # a deeply nested algorithm setting is refused as a ValueError naming it, never a crash
        try:
            ModelConfig.from_dict(d)
        except ValueError as e:
            assert "nested too deeply" in str(e) or "unknown key 'x'" in str(e)
        return
    with pytest.raises((ValueError, TypeError)) as e:
        ModelConfig.from_dict(d)
    assert message in str(e.value)


@pytest.mark.parametrize("text", [DEEP, '{"layer":' * 50_000 + "null" + "}" * 50_000, "not json", "", "[1]",
                                  "null", "1e999"])
def test_from_json_refuses_malformed_json(text):
    with pytest.raises((ValueError, TypeError)) as e:  # json.JSONDecodeError is a ValueError; never RecursionError
        ModelConfig.from_json(text)
    assert not isinstance(e.value, RecursionError)
    with pytest.raises(TypeError, match="JSON string"):
        ModelConfig.from_json(5)


BAD_QUARK = [
    ([], "expected a dict"),
    (_sub(GOOD_QUARK, ("global_quant_config",), []), "global_quant_config"),
    (_sub(GOOD_QUARK, QW, "int4"), "global_quant_config: weight"),
    (_sub(GOOD_QUARK, QW, []), "global_quant_config"),
    (_sub(GOOD_QUARK, QW + ("dtype",), 4), "QuarkSpec.dtype"),
    (_sub(GOOD_QUARK, QW + ("group_size",), 0), "group_size"),
    (_sub(GOOD_QUARK, QW + ("group_size",), -1), "group_size"),
    (_sub(GOOD_QUARK, QW + ("group_size",), 10**12), "group / block size"),
    (_sub(GOOD_QUARK, QW + ("group_size",), "32"), "group_size"),
    (_sub(GOOD_QUARK, QW + ("ch_axis",), 10**20), "ch_axis"),
    (_sub(GOOD_QUARK, ("layer_quant_config",), []), "layer_quant_config"),
    (_sub(GOOD_QUARK, ("layer_quant_config",), {"x": "int4"}), "layer_quant_config['x']"),
    (_sub(GOOD_QUARK, ("layer_quant_config",), {"re:(": GOOD_QUARK["global_quant_config"]}), "'re:('"),
    (_sub(GOOD_QUARK, ("layer_type_quant_config",), {"Foo": GOOD_QUARK["global_quant_config"]}), "'Foo'"),
    (_sub(GOOD_QUARK, ("kv_cache_quant_config",), [1]), "kv_cache_quant_config"),
    (_sub(GOOD_QUARK, ("exclude",), "lm_head"), "exclude"),
    (_sub(GOOD_QUARK, ("exclude",), ["re:["]), "bad regular expression"),
    (_sub(GOOD_QUARK, ("algo_config",), 5), "algo_config"),
    (_sub(GOOD_QUARK, ("export",), []), "export"),
]


@pytest.mark.parametrize("d, message", BAD_QUARK, ids=[str(i) for i in range(len(BAD_QUARK))])
def test_from_quark_refuses_malformed_configs(d, message):
    with pytest.raises((ValueError, TypeError)) as e:
        ModelConfig.from_quark(d)
    assert message in str(e.value)


@pytest.mark.parametrize("where", ["top", "weight"])
def test_from_quark_refuses_deeply_nested_extra_fields(where):
    d = copy.deepcopy(GOOD_QUARK)
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    (d if where == "top" else d["global_quant_config"]["weight"])["extra"] = deep
    with pytest.raises(ValueError, match="nested too deeply"):
        ModelConfig.from_quark(d)


def test_compressed_tensors_targets_with_bad_regexes_are_refused():
    from qcore.formats.compressed_tensors import CTScheme
    with pytest.raises(ValueError, match=r"QuantizationScheme.targets: bad regular expression 're:\['"):
        CTScheme(targets=["re:["])


@pytest.mark.parametrize("bad, what", [
    (torch.empty(0, 8, dtype=torch.long), "tensor (0, 8)"),
    (torch.empty(2, 0, dtype=torch.long), "tensor (2, 0)"),
    ({"input_ids": torch.empty(0, 8, dtype=torch.long)}, "dict(input_ids=tensor (0, 8)"),
    ((), "tuple()"),
])
@pytest.mark.parametrize("scheme", ["w_int8_a_int8_per_tensor_sym", "gptq"])
def test_empty_calibration_batches_are_blamed_by_index_before_any_work(bad, what, scheme, zoo):
    model = zoo.tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = preset("w_int8_per_channel_sym").replace(algorithms=({"name": "gptq"},)) if scheme == "gptq" \
        else preset(scheme)
    good = zoo.token_batches(3, seed=0)
    with pytest.raises(ValueError, match=rf"calibration batch 2 is empty \({__import__('re').escape(what)}"):
        quantize_model(model, config, [good[0], good[1], bad, good[2]], progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(type(m).__name__.startswith("Quant") for m in model.modules())


@pytest.mark.parametrize("bad, message", [
    (torch.full((1, 8), 10**6), "token id 1000000 is outside the model's vocabulary [0, 128)"),
    (torch.full((1, 8), -1), "token id -1 is outside"),
    (torch.rand(1, 8), "integer token ids"),
    (None, "calibration batch 1 is a NoneType"),
])
def test_bad_calibration_batches_are_blamed_by_index(bad, message, zoo):
    model = zoo.tiny_llama()
    with pytest.raises((ValueError, TypeError)) as e:
        quantize_model(model, "w_int8_a_int8_per_tensor_sym", [zoo.token_batches(1, seed=0)[0], bad],
                       progress=False)
    assert "calibration batch 1" in str(e.value) and message in str(e.value)
    assert not any(type(m).__name__.startswith("Quant") for m in model.modules())


def test_no_calibration_batches_for_static_scales(zoo):
    model = zoo.tiny_llama()
    with pytest.raises(ValueError, match="calibration data is empty"):
        quantize_model(model, "w_int8_a_int8_per_tensor_sym", [], progress=False)


@pytest.mark.parametrize("config", [ModelConfig.from_json(KV_ONLY), ModelConfig.from_json(ACT_ONLY)],
                         ids=["kv_only", "act_only"])
def test_export_hf_refuses_weightless_configs_before_writing(config, tmp_path, zoo):
    from qcore.adapters import export_hf
    model = quantize_model(zoo.tiny_llama(), config, zoo.token_batches(1, seed=0), progress=False)
    from qcore.adapters.io.compressed_tensors import export_compressed_tensors
    for export in (export_hf, export_compressed_tensors):  # compressed-tensors said 'config_groups: got {}'
        with pytest.raises(ValueError, match=f"{export.__name__}: .*KV-cache-only or activation-only config is not"):
            export(model, tmp_path / "out", config=config)
    assert list(tmp_path.iterdir()) == []
    from qcore.adapters import quantize_checkpoint  # the streaming writer stores the same layout (was KeyError)
    zoo.tiny_llama().save_pretrained(tmp_path / "float")
    with pytest.raises(ValueError, match="quantize_checkpoint: .*KV-cache-only or activation-only config"):
        quantize_checkpoint(tmp_path / "float", tmp_path / "out", config, zoo.token_batches(1, seed=0),
                            progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["float"]


def test_exporters_name_a_config_that_is_not_a_model_config(tmp_path, zoo):
    """``config=`` given as a dict (what ``to_dict`` writes) is a TypeError naming ``config``, not "the model
    carries no qcore config (... or pass config=)"."""
    from qcore.adapters import export_hf
    from qcore.adapters.io.compressed_tensors import export_compressed_tensors
    model = quantize_model(zoo.tiny_llama(), "int8", zoo.token_batches(1, seed=0), progress=False)
    for export in (export_hf, export_compressed_tensors):
        with pytest.raises(TypeError, match=f"{export.__name__}: config must be a ModelConfig.*got dict"):
            export(model, tmp_path / "out", config=GOOD)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# messages that say what is true
# ---------------------------------------------------------------------------------------------------------------


def test_gpt2_conv1d_is_a_supported_module_type():
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                                  eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with pytest.raises(ValueError) as e:  # every Conv1D left alone by the config: named among the supported
        quantize_model(model, preset("w_int8_per_channel_sym").replace(by_type={"Conv1D": None}), progress=False)
    msg = str(e.value)
    assert "quantizes no module" in msg and "'transformer.h.0.attn.c_attn'" in msg
    assert "not a supported module type" not in msg and "issue 22" not in msg
    quantize_model(model, "w_int8_per_channel_sym", progress=False)  # quantized as Linears (test_conv1d.py)


def test_quarot_refusal_names_the_gemma_norm():
    cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=64)
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    with pytest.raises(ValueError) as e:
        quantize_model(model, preset("w_int8_per_channel_sym").replace(algorithms=({"name": "quarot"},)),
                       progress=False)
    assert "model.layers.0.input_layernorm is a Gemma2RMSNorm" in str(e.value) and "sandwich norms" in str(e.value)
    assert ":  " not in str(e.value)  # no blank module name


def test_scaling_map_hint_speaks_the_algorithm_setting_not_a_python_argument():
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, max_position_embeddings=64)
    model = transformers.BertForMaskedLM(cfg).eval()
    config = preset("w_int8_per_channel_sym").replace(algorithms=({"name": "awq"},))
    with pytest.raises(ValueError) as e:
        quantize_model(model, config, [torch.randint(0, 128, (1, 8))], progress=False)
    msg = str(e.value)
    assert "quark_entries" not in msg
    assert "AWQConfig(scaling_layers=[...])" in msg and """--algo '{"name": "awq", "scaling_layers": [...]}'""" in msg
    from qcore.algorithms.config import parse_algorithms  # the command-line spelling the hint gives is accepted
    parse_algorithms([{"name": "awq", "scaling_layers": []}])


def test_gguf_inexact_hint_names_the_report_flag(lm_dir, tmp_path, capsys):
    """Without --report the summary says what to type; with it, where to look."""
    argv = Q + ["--model", str(lm_dir), "--scheme", "w_int4_per_group_sym", "--group-size", "32", "--eval", "none",
                "--export", "gguf"]
    assert main(argv + ["--output", str(tmp_path / "a")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("gguf "))
    assert "not lossless" in line and "--report FILE.json lists them" in line and "see the report" not in line
    assert main(argv + ["--output", str(tmp_path / "b"), "--report", str(tmp_path / "r.json")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("gguf "))
    assert "the report's gguf_inexact lists them" in line
    assert json.loads((tmp_path / "r.json").read_text())["gguf_inexact"]


def test_loading_the_model_commands_prints_no_warnings_from_optional_libraries(workdir):
    p = subprocess.run([sys.executable, "-m", "qcore", "schemes"], cwd=workdir, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and "w_mxfp4_a_mxfp4" in p.stdout
    assert p.stderr == "", p.stderr  # torchao's "Failed to load ... .so", torch's pytree register_constant, ...


def test_the_quiet_import_scope_puts_the_levels_back():
    import logging
    from qcore.adapters.io.quark_hf import _NOISY_IMPORT_LOGGERS, quiet_optional_imports
    loggers = [logging.getLogger(n) for n in _NOISY_IMPORT_LOGGERS]
    levels = [lg.level for lg in loggers]
    with quiet_optional_imports():
        assert all(lg.level == logging.ERROR for lg in loggers)
    assert [lg.level for lg in loggers] == levels


def test_scheme_file_may_be_a_qcore_exports_quantization_config(tmp_path):
    """``--scheme`` reads the quantization_config qcore writes (quant_method 'qcore' or 'compressed-tensors' with
    a qcore block; a whole config.json too), not only qcore's own dict and Quark's."""
    from qcore.adapters.jobs.scheme import read_scheme_file as _read_scheme_file
    for i, qc in enumerate(({"quant_method": "qcore", "qcore": {"format_version": 1, "config": GOOD}},
                            {"quant_method": "compressed-tensors", "qcore": {"format_version": 1, "config": GOOD}},
                            {"quant_method": "quark", **GOOD_QUARK, "qcore": {"format_version": 1, "config": GOOD}})):
        f = tmp_path / f"{i}.json"
        f.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "quantization_config": qc}))
        assert _read_scheme_file(str(f)).to_dict() == ModelConfig.from_dict(GOOD).to_dict()

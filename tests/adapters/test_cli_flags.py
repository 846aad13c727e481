"""Every flag of every subcommand, in every context that decides whether it has an effect (issue 33).

``FLAGS``: per subcommand, per flag (its ``dest``), rows ``(argv, expect)``:
- ``OK``: the flag is accepted in this context: the command passes all its checks and reaches its work (the first
  step of which, loading the model / reading the checkpoint, is replaced by ``Reached``: no model loads);
- ``Refused(text)``: the flag has no effect in this context (or its value is bad) and the command refuses it,
  before any work, in one line on stderr that names the flag as typed (with its value) and says ``text``.

The table covers every flag of every subcommand (``test_the_table_covers_every_flag``: a new flag must be
classified): each one has a context where it is accepted, each flag with a ``Needs`` entry (the context in which it
has an effect, ``qcore._argtypes.Needs``) has one where it is refused, and each flag that takes a value has a bad
value refused naming the flag and the value.
"""

from __future__ import annotations

import argparse
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from qcore import cli as numpy_cli  # noqa: E402
from qcore.adapters import cli as adapters_cli  # noqa: E402
from qcore.adapters.jobs.flags import QUANTIZE_NEEDS  # noqa: E402
from qcore.cli import main  # noqa: E402


class Reached(Exception):
    """The command passed its checks and started its work (replaced by this exception)."""


OK = "ok"


class Refused(str):
    """The one-line refusal holds this text (after the flag as typed)."""


# ---------------------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------------------

Q = ["quantize", "--no-progress"]
E = ["eval", "--no-progress"]
C = ["convert", "q4.gguf", "out"]  # an (empty) .gguf file: the source format is told by its name
CH = ["convert", "hfq", "out"]  # an HF (quark) checkpoint directory
I = ["imatrix", "--output", "m.gguf", "--no-progress"]  # noqa: E741

FLAGS = {
    "quantize": {
        "model": [(Q + ["--model", "lm"], OK),
                  (Q + ["--model", "adir"], Refused("--model adir: a directory without config.json"))],
        "eval_text": [(Q + ["--eval-text", "t.txt"], OK),
                      (Q + ["--eval-text", "t.txt", "--eval", "none", "--calib-samples", "0"],
                       Refused("--eval-text t.txt is read for perplexity and the calibration windows")),
                      (Q + ["--eval-text", "missing.txt"], Refused("--eval-text missing.txt: no such file"))],
        "seq_len": [(Q + ["--seq-len", "64"], OK),
                    (Q + ["--seq-len", "64", "--eval", "none", "--calib-samples", "0"],
                     Refused("--seq-len 64 is the length of the perplexity and calibration windows")),
                    (Q + ["--seq-len", "1"], Refused("--seq-len 1: perplexity needs windows of 2 tokens or more")),
                    (Q + ["--seq-len", "0"], Refused("argument --seq-len: must be a positive int, got 0"))],
        "device": [(Q + ["--device", "cpu"], OK),
                   (Q + ["--device", "tpu9"], Refused("--device tpu9: not a torch device"))],
        "dtype": [(Q + ["--dtype", "bfloat16"], OK),
                  (Q + ["--dtype", "float64"], Refused("--dtype must be one of"))],
        "no_progress": [(["quantize", "--no-progress"], OK)],
        "no_cache": [(Q + ["--no-cache"], OK),
                     (Q + ["--no-cache", "--eval", "none"], Refused("--no-cache applies to the float model's "
                                                                    "perplexity, which --eval none does not measure"))],
        "no_kl": [(Q + ["--no-kl"], OK),
                  (Q + ["--no-kl", "--eval", "none"], Refused("--no-kl applies to the KL divergence measured beside "
                                                              "perplexity, which --eval none does not measure"))],
        "debug": [(Q + ["--debug"], OK)],
        "scheme": [(Q + ["--scheme", "w_uint4_per_group_asym"], OK),
                   (Q + ["--scheme", "w_int9"], Refused("--scheme 'w_int9' is not a preset"))],
        "group_size": [(Q + ["--scheme", "w_uint4_per_group_asym", "--group-size", "64"], OK),
                       (Q + ["--scheme", "fp8", "--group-size", "64"],
                        Refused("--group-size 64 does not apply to --scheme fp8: the preset has no per-group")),
                       (Q + ["--group-size", "x"], Refused("argument --group-size: invalid int value: 'x'"))],
        "kv_cache_dtype": [(Q + ["--kv-cache-dtype", "fp8"], OK),
                           (Q + ["--kv-cache-dtype", "int8"], Refused("argument --kv-cache-dtype: invalid choice: "
                                                                      "'int8'"))],
        "exclude": [(Q + ["--exclude", "lm_head"], OK),
                    (Q + ["--exclude", "re:[a"], Refused("--exclude 're:[a': bad regular expression"))],
        "algo": [(Q + ["--algo", "gptq", "--scheme", "w_uint4_per_group_asym"], OK),
                 (Q + ["--algo", "magic"], Refused("--algo magic: algorithm 'magic' is not available"))],
        "calib_samples": [(Q + ["--calib-samples", "8", "--algo", "gptq", "--scheme", "w_uint4_per_group_asym"], OK),
                          (Q + ["--calib-samples", "8", "--scheme", "w_fp8_a_fp8"], OK),  # static input scales
                          (Q + ["--calib-samples", "2"], OK),  # the summary's per-layer output SQNR: 2 windows, not 4
                          (Q + ["--calib-samples", "8", "--scheme", "uint4_wo_32"],
                           Refused("--calib-samples 8 has no effect: nothing in this run calibrates")),
                          (Q + ["--calib-samples", "0", "--algo", "gptq"], Refused("--calib-samples 0")),
                          (Q + ["--calib-samples", "-1"], Refused("argument --calib-samples: must be a "
                                                                  "non-negative int, got -1"))],
        "imatrix": [(Q + ["--scheme", "gguf_q4_k_m", "--imatrix", "calib"], OK),
                    (Q + ["--imatrix", "calib"], Refused("--imatrix calib applies to GGUF weight types")),
                    (Q + ["--scheme", "gguf_q4_k_m", "--imatrix", "calib", "--algo", "quarot"],
                     Refused("--imatrix calib with --algo quarot: rotations and smoothing change the layers' "
                             "inputs")),
                    (Q + ["--scheme", "gguf_q4_k_m", "--imatrix", "missing.dat"], Refused("--imatrix missing.dat"))],
        "amp": [(Q + ["--amp", "w_mxfp4_a_mxfp4,w_fp8_a_fp8", "--target-bits", "6"], OK),
                (Q + ["--amp", "w_mxfp4_a_mxfp4,w_fp9", "--target-bits", "6"], Refused("--amp: 'w_fp9' is not a "
                                                                                      "preset"))],
        "target_bits": [(Q + ["--amp", "w_mxfp4_a_mxfp4,w_fp8_a_fp8", "--target-bits", "6"], OK),
                        (Q + ["--target-bits", "6"], Refused("--target-bits 6.0 applies to --amp")),
                        (Q + ["--amp", "w_mxfp4_a_mxfp4", "--target-bits", "nan"],
                         Refused("argument --target-bits: must be a positive finite number, got 'nan'"))],
        "max_loss": [(Q + ["--amp", "w_mxfp4_a_mxfp4,w_fp8_a_fp8", "--max-loss", "0.1"], OK),
                     (Q + ["--max-loss", "0.1"], Refused("--max-loss 0.1 applies to --amp")),
                     (Q + ["--amp", "w_mxfp4_a_mxfp4", "--max-loss", "-1"],
                      Refused("argument --max-loss: must be a non-negative finite number, got '-1'"))],
        "amp_samples": [(Q + ["--amp", "w_mxfp4_a_mxfp4,w_fp8_a_fp8", "--target-bits", "6", "--amp-samples", "4"],
                         OK),
                        (Q + ["--amp-samples", "4"], Refused("--amp-samples 4 applies to --amp")),
                        (Q + ["--amp", "w_mxfp4_a_mxfp4,w_fp8_a_fp8", "--target-bits", "6", "--amp-samples", "9",
                              "--calib-samples", "8"], Refused("--amp-samples 9 is more than --calib-samples 8")),
                        (Q + ["--amp-samples", "x"], Refused("argument --amp-samples: invalid int value: 'x'"))],
        "output": [(Q + ["--output", "out"], OK),
                   (Q + ["--output", "src.json"], Refused("--output src.json"))],
        "export": [(Q + ["--output", "out", "--export", "compressed-tensors"], OK),
                   (Q + ["--export", "hf"], Refused("--export hf needs --output DIR")),
                   (Q + ["--export", "zip"], Refused("argument --export: invalid choice: 'zip'"))],
        "onnx_weights": [(Q + ["--output", "out", "--export", "onnx", "--scheme", "w_uint4_per_group_asym",
                               "--onnx-weights", "matmulnbits"], OK),
                         (Q + ["--output", "out", "--onnx-weights", "matmulnbits"],
                          Refused("--onnx-weights matmulnbits applies to --export onnx")),
                         (Q + ["--onnx-weights", "int4"], Refused("argument --onnx-weights: invalid choice: 'int4'"))],
        "onnx_unsupported": [(Q + ["--output", "out", "--export", "onnx", "--onnx-unsupported", "dequantize"], OK),
                             (Q + ["--output", "out", "--export", "hf", "--onnx-unsupported", "dequantize"],
                              Refused("--onnx-unsupported dequantize applies to --export onnx, not --export hf")),
                             (Q + ["--onnx-unsupported", "drop"],
                              Refused("argument --onnx-unsupported: invalid choice: 'drop'"))],
        "drop_activations": [(Q + ["--output", "out", "--export", "gguf", "--scheme", "w_fp8_a_fp8",
                                   "--drop-activations"], OK),
                             (Q + ["--drop-activations"], Refused("--drop-activations applies to --export gguf")),
                             (Q + ["--output", "out", "--export", "gguf", "--scheme", "gguf_q4_0",
                                   "--drop-activations"],
                              Refused("--drop-activations has no effect: the scheme quantizes no activations"))],
        "overwrite": [(Q + ["--output", "out", "--overwrite"], OK),
                      (Q + ["--overwrite"], Refused("--overwrite applies to --output DIR"))],
        "max_shard_size": [(Q + ["--output", "out", "--max-shard-size", "1GB"], OK),
                           (Q + ["--max-shard-size", "1GB"], Refused("--max-shard-size 1GB applies to the checkpoint "
                                                                     "written to --output DIR; this run writes none")),
                           (Q + ["--output", "out.gguf", "--export", "gguf", "--scheme", "gguf_q4_0",
                                 "--max-shard-size", "1GB"],
                            Refused("--max-shard-size 1GB applies to the formats written as safetensors shards")),
                           (Q + ["--output", "out", "--max-shard-size", "5XB"],
                            Refused("--max-shard-size 5XB is not a size"))],
        "work_dir": [(Q + ["--algo", "gptq", "--scheme", "w_uint4_per_group_asym", "--work-dir", "wd"], OK),
                     (Q + ["--work-dir", "wd"], Refused("--work-dir wd")),
                     (Q + ["--algo", "gptq", "--scheme", "w_uint4_per_group_asym", "--work-dir", "src.json"],
                      Refused("--work-dir"))],
        "resume": [(Q + ["--algo", "gptq", "--scheme", "w_uint4_per_group_asym", "--work-dir", "wd", "--resume"],
                    OK),
                   (Q + ["--resume"], Refused("--resume needs --work-dir DIR"))],
        "eval": [(Q + ["--eval", "none"], OK),
                 (Q + ["--eval", "bleu"], Refused("argument --eval: invalid choice: 'bleu'"))],
        "report": [(Q + ["--report", "r.json"], OK),
                   (Q + ["--report", "adir"], Refused("--report adir"))],
        "plot": [(Q + ["--plot", "p.png", "--eval", "none"], OK),
                 (Q + ["--plot", "adir"], Refused("--plot adir"))],
    },
    "eval": {
        "model": [(E + ["--model", "lm"], OK),
                  (E + ["--model", "missing/dir/"], Refused("--model missing/dir/: no such file or directory"))],
        "eval_text": [(E + ["--eval-text", "t.txt"], OK),
                      (E + ["--tasks", "x", "--eval-text", "t.txt", "--no-ppl"],
                       Refused("--eval-text t.txt is read only for perplexity, which --no-ppl turns off")),
                      (E + ["--eval-text", "missing.txt"], Refused("--eval-text missing.txt: no such file"))],
        "seq_len": [(E + ["--seq-len", "64"], OK),
                    (E + ["--tasks", "x", "--seq-len", "64"], Refused("--seq-len 64 applies to perplexity")),
                    (E + ["--seq-len", "1"], Refused("--seq-len 1: perplexity needs windows of 2 tokens or more"))],
        "device": [(E + ["--device", "cpu"], OK),
                   (E + ["--device", "tpu9"], Refused("--device tpu9: not a torch device"))],
        "dtype": [(E + ["--dtype", "float16"], OK), (E + ["--dtype", "int8"], Refused("--dtype must be one of"))],
        "no_progress": [(["eval", "--no-progress"], OK)],
        "no_cache": [(E + ["--no-cache"], OK),
                     (E + ["--tasks", "x", "--no-cache"], Refused("--no-cache applies to perplexity"))],
        "debug": [(E + ["--debug"], OK)],
        "reference": [(E + ["--reference", "lm"], OK),
                      (E + ["--tasks", "x", "--reference", "lm"], Refused("--reference lm applies to perplexity")),
                      (E + ["--reference", "missing/dir/"],
                       Refused("--reference missing/dir/: no such file or directory"))],
        "tasks": [(E + ["--tasks", "x"], OK), (E + ["--tasks", ","], Refused("argument --tasks: expected a "
                                                                            "comma-separated list of names, got ','"))],
        "limit": [(E + ["--tasks", "x", "--limit", "3"], OK),
                  (E + ["--limit", "3"], Refused("--limit 3 applies to lm-evaluation-harness tasks; give --tasks")),
                  (E + ["--tasks", "x", "--limit", "0"], Refused("argument --limit: must be a positive int, got 0"))],
        "num_fewshot": [(E + ["--tasks", "x", "--num-fewshot", "0"], OK),
                        (E + ["--num-fewshot", "2"], Refused("--num-fewshot 2 applies to lm-evaluation-harness")),
                        (E + ["--tasks", "x", "--num-fewshot", "-1"],
                         Refused("argument --num-fewshot: must be a non-negative int, got -1"))],
        "batch_size": [(E + ["--tasks", "x", "--batch-size", "4"], OK),
                       (E + ["--batch-size", "4"], Refused("--batch-size 4 applies to lm-evaluation-harness")),
                       (E + ["--tasks", "x", "--batch-size", "0"],
                        Refused("argument --batch-size: must be a positive int, got 0"))],
        "ppl": [(E + ["--tasks", "x", "--ppl"], OK), (E + ["--tasks", "x", "--no-ppl"], OK),
                (E + ["--ppl"], Refused("--ppl applies with --tasks")),
                (E + ["--no-ppl"], Refused("--no-ppl applies with --tasks")),
                (E + ["--ppl=1"], Refused("argument --ppl/--no-ppl: ignored explicit argument '1'"))],
    },
    "convert": {
        "src": [(C + ["--to", "hf"], OK), (["convert", "missing", "out", "--to", "hf"],
                                           Refused("src 'missing' does not exist"))],
        "dst": [(C + ["--to", "hf"], OK), (["convert", "q4.gguf", "q4.gguf", "--to", "gguf"], Refused("dst")),
                (["convert", "q4.gguf", "hfq", "--to", "hf"],
                 Refused("dst 'hfq' exists; pass --overwrite to replace it"))],
        "to": [(C + ["--to", "ct"], OK),
               (C + ["--to", "zip"], Refused("--to must be one of ['hf', 'gguf', 'onnx', 'compressed-tensors'], "
                                             "got 'zip'"))],
        "strict": [(C + ["--to", "hf", "--strict"], OK),
                   (C + ["--to", "onnx", "--strict"], Refused("--strict loads dst back and compares it, and --to onnx "
                                                              "cannot be loaded back"))],
        "overwrite": [(C + ["--to", "hf", "--overwrite"], OK)],
        "dtype": [(C + ["--to", "hf", "--dtype", "bfloat16"], OK),
                  (CH + ["--to", "hf", "--dtype", "float32"], OK),
                  (C + ["--to", "hf", "--dtype", "float32"], Refused("--dtype float32 changes nothing: a GGUF source "
                                                                     "loads in float32")),
                  (C + ["--to", "onnx", "--dtype", "float32"], Refused("--dtype float32 changes nothing with --to "
                                                                       "onnx: it always loads float32")),
                  (C + ["--to", "onnx", "--dtype", "bfloat16"], Refused("--dtype bfloat16: ONNX exports are float32 "
                                                                        "models")),
                  (C + ["--to", "hf", "--dtype", "float8"], Refused("--dtype must be one of"))],
        "tokenizer_pre": [(CH + ["--to", "gguf", "--tokenizer-pre", "smollm"], OK),
                          (C + ["--to", "hf", "--tokenizer-pre", "smollm"],
                           Refused("--tokenizer-pre smollm changes nothing: it names llama.cpp's pre-tokenizer of a "
                                   "GGUF destination, not --to hf")),
                          (C + ["--to", "gguf", "--tokenizer-pre", "smollm"],
                           Refused("--tokenizer-pre smollm changes nothing: a GGUF source's tokenizer fields")),
                          (["convert", "hfnotok", "out", "--to", "gguf", "--tokenizer-pre", "smollm"],
                           Refused("--tokenizer-pre smollm changes nothing: the source holds no tokenizer")),
                          (CH + ["--to", "gguf", "--tokenizer-pre", ""],
                           Refused("--tokenizer-pre '': expected a non-empty NAME"))],
        "no_verify": [(C + ["--to", "hf", "--no-verify"], OK),
                      (C + ["--to", "onnx", "--no-verify"], Refused("--no-verify changes nothing with --to onnx: it "
                                                                    "is never loaded back")),
                      (C + ["--to", "hf", "--strict", "--no-verify"], Refused("--strict with --no-verify: --strict "
                                                                              "always loads dst back"))],
        "onnx_unsupported": [(C + ["--to", "onnx", "--onnx-unsupported", "dequantize"], OK),
                             (C + ["--to", "hf", "--onnx-unsupported", "dequantize"],
                              Refused("--onnx-unsupported dequantize applies to --to onnx, not --to hf")),
                             (C + ["--to", "onnx", "--onnx-unsupported", "drop"],
                              Refused("argument --onnx-unsupported: invalid choice: 'drop'"))],
        "report": [(C + ["--to", "hf", "--report", "r.json"], OK),
                   (C + ["--to", "hf", "--report", "adir"], Refused("--report adir: is a directory"))],
        "no_progress": [(C + ["--to", "hf", "--no-progress"], OK)],
        "debug": [(C + ["--to", "hf", "--debug"], OK)],
    },
    "imatrix": {
        "model": [(I + ["--model", "lm"], OK),
                  (I + ["--model", "./nowhere"], Refused("--model ./nowhere: no such file or directory"))],
        "eval_text": [(I + ["--eval-text", "t.txt"], OK),
                      (I + ["--eval-text", "missing.txt"], Refused("--eval-text missing.txt: no such file"))],
        "seq_len": [(I + ["--seq-len", "32"], OK), (I + ["--seq-len", "0"], Refused("argument --seq-len: must be a "
                                                                                    "positive int, got 0"))],
        "device": [(I + ["--device", "cpu"], OK),
                   (I + ["--device", "tpu9"], Refused("--device tpu9: not a torch device"))],
        "dtype": [(I + ["--dtype", "float16"], OK), (I + ["--dtype", "int8"], Refused("--dtype must be one of"))],
        "no_progress": [(I, OK)],
        "no_cache": [(I + ["--no-cache"], Refused("--no-cache has no effect: qcore imatrix measures no perplexity"))],
        "debug": [(I + ["--debug"], OK)],
        "output": [(I, OK), (["imatrix", "--output", "m.txt"], Refused("--output m.txt: an imatrix file is named "
                                                                       ".gguf"))],
        "calib_samples": [(I + ["--calib-samples", "4"], OK),
                          (I + ["--calib-samples", "0"], Refused("argument --calib-samples: must be a positive int, "
                                                                 "got 0"))],
        "process_output": [(I + ["--process-output"], OK)],
        "overwrite": [(I + ["--overwrite"], OK),
                      (["imatrix", "--output", "old.gguf"], Refused("--output old.gguf: exists; pass --overwrite "
                                                                    "to replace it"))],
    },
    "schemes": {
        "debug": [(["schemes", "--debug"], OK)],
    },
    "inspect": {
        "directory": [(["inspect", "hfq"], OK), (["inspect", "missing"], Refused("'missing'"))],
        "layers": [(["inspect", "hfq", "--layers"], OK),
                   (["inspect", "hfq", "--layers", "--json"], Refused("--layers has no effect with --json"))],
        "json": [(["inspect", "hfq", "--json"], OK)],
        "debug": [(["inspect", "hfq", "--debug"], OK)],
    },
}

# commands whose flags all have an effect wherever they are given, and are checked by test_bad_inputs.py's rows
# (conformance export / check / modes: numpy only, no model): listed so that the coverage test sees them
ALWAYS = {
    ("conformance", "export"): {"directory", "formats", "modes", "key", "overwrite"},
    ("conformance", "check"): {"vectors", "outputs", "ulps", "formats", "cases", "allow_missing", "strict_nan",
                               "max_examples", "json"},
    ("conformance", "modes"): {"formats"},
}

# flags accepted by no context: shared flags a command has (so that a shared script passing them gets a reason), but
# no use for (qcore imatrix measures no perplexity, whose cache --no-cache is about)
NEVER = {("imatrix", "no_cache")}


# ---------------------------------------------------------------------------------------------------------------
# the parsers: every flag of every subcommand
# ---------------------------------------------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return a.choices
    return {}


def _parser(command: str) -> argparse.ArgumentParser:
    if command in ("quantize", "eval", "schemes", "convert", "imatrix"):
        p = argparse.ArgumentParser(prog=f"qcore {command}")
        adapters_cli.add_arguments(command, p)
        return p
    return _subparsers(numpy_cli.build_parser())[command]


def _dests(parser: argparse.ArgumentParser) -> set:
    return {a.dest for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))}


def _needs(command: str) -> set:
    """The flags of ``command`` with a ``Needs`` entry (an effect only in some contexts)."""
    if command == "quantize":
        back = {v: k for k, v in adapters_cli._JOB_ARGUMENT.items()}
        return {back.get(n.option, n.option) for n in QUANTIZE_NEEDS} | {"imatrix", "drop_activations"}
    if command == "inspect":
        return {n.option for n in numpy_cli._INSPECT_NEEDS}
    return {n.option for n in getattr(_parser(command), "qcore_needs", ())}


def test_the_table_covers_every_flag():
    top = _subparsers(numpy_cli.build_parser())
    assert set(top) == set(FLAGS) | {c for c, _ in ALWAYS}
    for (command, sub), dests in ALWAYS.items():
        assert _dests(_subparsers(top[command])[sub]) == dests, (command, sub)
    for command, rows in FLAGS.items():
        parser = _parser(command)
        assert set(rows) == _dests(parser), command  # every flag classified, none invented
        takes_value = {a.dest for a in parser._actions if a.nargs != 0 and not isinstance(a, argparse._HelpAction)}
        for dest, cases in rows.items():
            if (command, dest) not in NEVER:
                assert any(e is OK for _, e in cases), f"{command} {dest}: no context where it is accepted"
            if dest in _needs(command):
                assert any(isinstance(e, Refused) for _, e in cases), f"{command} {dest}: never refused"
            if dest in takes_value:  # a bad value: refused naming the flag
                assert any(isinstance(e, Refused) for _, e in cases), f"{command} {dest}: no bad value"


# ---------------------------------------------------------------------------------------------------------------
# the rows
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def workdir(tmp_path, monkeypatch, lm_dir):
    """The working directory of a row: ``lm`` (a tiny Llama directory, never loaded), an empty ``adir``, a file
    ``src.json``, a text ``t.txt``, an empty ``q4.gguf``, quark checkpoint directories ``hfq`` (with a tokenizer) and
    ``hfnotok`` (without), ``old.gguf``."""
    (tmp_path / "lm").symlink_to(lm_dir, target_is_directory=True)
    (tmp_path / "adir").mkdir()
    (tmp_path / "src.json").write_text("{}")
    (tmp_path / "t.txt").write_text("some text to read. " * 50)
    (tmp_path / "q4.gguf").write_bytes(b"")
    (tmp_path / "old.gguf").write_bytes(b"")
    (tmp_path / "hfq").mkdir()
    (tmp_path / "hfq" / "config.json").write_text('{"quantization_config": {"quant_method": "quark"}}')
    (tmp_path / "hfq" / "tokenizer.json").write_text("{}")  # a tokenizer the GGUF destination converts
    (tmp_path / "hfnotok").mkdir()
    (tmp_path / "hfnotok" / "config.json").write_text('{"quantization_config": {"quant_method": "quark"}}')
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def stop_at_work(monkeypatch):
    """Each command's first step of work raises ``Reached``: reading a model's weights (quantize, eval, imatrix:
    every check of ``--model`` before it runs), reading the quantized source (convert), reading a checkpoint that
    exists (inspect), the listing (schemes); lm-eval's task loading is a no-op (lm-eval's own errors:
    test_lm_eval.py)."""
    import transformers
    from qcore.adapters.eval import lm_eval_tasks as LT
    from qcore.adapters.eval import models
    from qcore.adapters.jobs import common
    from qcore.adapters.jobs import convert as jc
    from qcore.formats import inspect as fi

    def reached(*a, **k):
        raise Reached()
    for owner, name in ((models, "load_smollm2"), (common, "load_float_model"), (common, "from_pretrained"),
                        (jc, "_load_quantized"), (adapters_cli, "schemes_command")):
        monkeypatch.setattr(owner, name, reached)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", reached)
    inspect_path = fi.inspect_path
    monkeypatch.setattr(fi, "inspect_path", lambda p, *a, **k: reached() if os.path.exists(p) else inspect_path(p))
    monkeypatch.setattr(LT, "require_lm_eval", lambda: None)
    monkeypatch.setattr(LT, "load_tasks", lambda *a, **k: ["task"])


ROWS = [(command, dest, argv, expect) for command, flags in FLAGS.items() for dest, cases in flags.items()
        for argv, expect in cases]


@pytest.mark.parametrize("command, dest, argv, expect", ROWS,
                         ids=[f"{c}-{d}-{i}" for i, (c, d, _, _) in enumerate(ROWS)])
def test_flag_in_context(command, dest, argv, expect, workdir, stop_at_work, capsys):
    if expect is OK:
        with pytest.raises(Reached):
            main(argv)
        return
    code = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, out, err)
    assert lines[0].startswith(f"qcore {command}: error: ") and "Traceback" not in err, err
    assert expect in lines[0], err
    for py in ("=True", "=False", "=None", "reload the model", "resume=", "pass overwrite"):  # not Python-speak
        assert py not in lines[0], err
    for d in {d for flags in FLAGS.values() for d in flags if "_" in d}:  # flags, not Python argument names
        assert d not in lines[0], err
    assert not (workdir / "out").exists() and not (workdir / "m.gguf").exists()


BASE = {"quantize": Q, "eval": E, "convert": CH + ["--to", "hf"], "imatrix": I}
EMPTY = [(c, a.dest, a.option_strings[0] if a.option_strings else a.dest) for c in BASE
         for a in _parser(c)._actions if a.nargs != 0 and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command, dest, flag", EMPTY, ids=[f"{c}-{d}" for c, d, _ in EMPTY])
def test_an_empty_value_is_refused_naming_the_flag(command, dest, flag, workdir, stop_at_work, capsys):
    argv = list(BASE[command])
    if flag in argv:
        argv[argv.index(flag) + 1] = ""
    elif flag in ("src", "dst"):
        argv[argv.index({"src": "hfq", "dst": "out"}[flag])] = ""
    else:
        argv += [flag, ""]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"{flag}" in err and ("''" in err or "got ''" in err), err

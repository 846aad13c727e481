"""The checkpoint formats as data: one ``Format`` record per format (its name, aliases, the export options that
belong to it alone, what it cannot hold, and its check, writer and loader), in one table, ``FORMATS``, that the
main job (``qcore quantize --export``), ``convert`` (``qcore convert --to``) and the command line read. A format is
found by name (``format_named``) or detected from a path (``detect_format``), never re-parsed from strings along the
way.

Each writer takes the model, the destination and an ``ExportRequest`` (what the caller knows: the config, the
tokenizer, the options) and returns what it wrote (``Written``).
"""

from __future__ import annotations

import pathlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from torch import nn

from qcore.formats.safetensors_io import read_json_object

from ..config import ModelConfig

from . import compressed_tensors as CT
from . import gguf as GG
from . import onnx as OX
from . import quark_hf as HF
from .common import check_format_version
from . import from_pretrained

__all__ = ["Format", "ExportRequest", "Written", "FORMATS", "format_named", "detect_format", "gguf_in_dir",
           "EXPORT_OPTION_DEFAULTS", "option_owner", "format_of_method", "aliases_text"]


@dataclass(frozen=True)
class ExportRequest:
    """What a caller gives a writer besides the model and the destination. ``None`` leaves the writer's default
    (``config``: ``model.qcore_config``; ``max_shard_size``: 5GB)."""

    config: Any = None
    tokenizer: Any = None  # a transformers tokenizer, or (GGUF) the path of a GGUF file whose tokenizer is copied
    overwrite: bool = False
    progress: bool = False
    max_shard_size: Union[None, int, str] = None
    drop_activations: bool = False  # GGUF: write a model whose activations are quantized, without that
    onnx_weights: str = "qdq"
    onnx_unsupported: str = "error"
    tokenizer_pre: Optional[str] = None  # GGUF: llama.cpp's pre-tokenizer name for a converted tokenizer
    name: Optional[str] = None  # GGUF: general.name
    metadata: Optional[str] = None  # GGUF: a GGUF file whose other metadata keys are carried (export_gguf metadata=)
    file_ok: bool = False  # the destination may be a file of the format's suffix (convert), not only a directory


@dataclass(frozen=True)
class Written:
    """What a writer wrote: the path (a directory, or a file), the directory it is in, the quantization method it
    declares, the exporter's own report (``ExportInfo``, ``GGUFExportInfo``, ``ONNXExportInfo``, ``CTExportInfo``),
    notes for a report, and the weights written dequantized (ONNX)."""

    path: pathlib.Path
    directory: str
    quant_method: str
    info: Any
    notes: tuple = ()
    dequantized: tuple = ()


@dataclass(frozen=True)
class Format:
    """One checkpoint format (see the module docstring).

    options: the export options that apply to this format only, with their defaults (another format given one of
        them is an error: an option that changes nothing is a mistake).
    activations: whether the format holds activation quantization; ``no_activations``: why not (in messages).
    float32_only: whether the format computes in float32 only (``float32_why``: in messages).
    weightless_ok: whether a module quantizing activations but not its weight can be written.
    check: ``check(model, config, request, plans)``: the refusals the model and the config decide, before any work
        (``plans``: ``plan_model(model, config)`` when the caller has made it, else None).
    write: ``write(model, dst, request) -> Written``.
    load: ``load(path, dtype) -> nn.Module`` of frozen qcore modules (None: not a source format).
    """

    name: str
    aliases: tuple
    summary: str
    check: Callable
    write: Callable
    load: Optional[Callable] = None
    options: tuple = ()
    activations: bool = True
    no_activations: str = ""
    float32_only: bool = False
    float32_why: str = ""
    weightless_ok: bool = False
    suffix: Optional[str] = None  # a file destination's suffix (convert's dst may be DIR or FILE.suffix)
    shards: bool = False  # writes safetensors shards of at most ``ExportRequest.max_shard_size`` (--max-shard-size)
    gguf_specs: bool = False  # holds GGUF block types as they are (float block offsets, super-block scales)
    copies_own_source: bool = False  # from a source of its own format: tokenizer and name copied as they are
    methods: tuple = ()  # the quantization_config.quant_method values a checkpoint directory of it declares
    config_of: Optional[Callable] = None  # (quantization_config dict) -> the ModelConfig it describes
    file_holds_tokenizer: bool = True  # a file destination (``suffix``) can hold a tokenizer
    read_tokenizer: Callable = None  # (path) -> the checkpoint's transformers tokenizer (raises when unreadable)
    held_tokenizer: Callable = None  # (path) -> a description of the tokenizer the checkpoint holds, or None

    def __post_init__(self):
        if self.read_tokenizer is None:
            object.__setattr__(self, "read_tokenizer", _dir_tokenizer)
        if self.held_tokenizer is None:
            object.__setattr__(self, "held_tokenizer", _dir_held_tokenizer)


# ---------------------------------------------------------------------------------------------------------------
# the formats
# ---------------------------------------------------------------------------------------------------------------

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                       "merges.txt", "spiece.model")


def _dir_tokenizer(p: pathlib.Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(p, local_files_only=True)


def _dir_held_tokenizer(p: pathlib.Path) -> Optional[str]:
    files = [f for f in _HF_TOKENIZER_FILES if (p / f).is_file()]
    return f"files {files}" if files else None


def _gguf_tokenizer(p: pathlib.Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name, local_files_only=True)


def _gguf_held_tokenizer(p: pathlib.Path) -> Optional[str]:
    import gguf
    try:
        fields = gguf.GGUFReader(p).fields
    except (OSError, ValueError):
        return None
    tokens = fields.get("tokenizer.ggml.tokens")
    n = len(tokens.data) if tokens is not None else 0
    if n == 0:
        return None
    kind = fields.get("tokenizer.ggml.model")
    kind = kind.contents() if kind is not None else "no tokenizer.ggml.model"
    merges = fields.get("tokenizer.ggml.merges")
    n_merges = len(merges.data) if merges is not None else 0
    return f"{kind!r}, {n} tokens, {n_merges} merges"


def _kw(**kw) -> dict:
    """The keyword arguments that are set (None: the writer's default)."""
    return {k: v for k, v in kw.items() if v is not None}


def _write_hf(model: nn.Module, dst: pathlib.Path, r: ExportRequest) -> Written:
    info = HF.export_hf(model, dst, **_kw(config=r.config, tokenizer=r.tokenizer, max_shard_size=r.max_shard_size),
                        overwrite=r.overwrite, progress=r.progress)
    return Written(pathlib.Path(dst), info.directory, info.quant_method, info,
                   notes=(f"quant_method {info.quant_method!r}",))


def _write_gguf(model: nn.Module, dst: pathlib.Path, r: ExportRequest) -> Written:
    kw = dict(tokenizer=r.tokenizer, drop_activations=r.drop_activations, overwrite=r.overwrite,
              **_kw(tokenizer_pre=r.tokenizer_pre, name=r.name, metadata=r.metadata))
    if r.file_ok and dst.suffix == ".gguf":
        info = GG.export_gguf(model, dst, **kw)
    else:
        info = GG.export_gguf_dir(model, dst, **kw)
    return Written(pathlib.Path(info.path), str(dst), "gguf", info)


def _write_ct(model: nn.Module, dst: pathlib.Path, r: ExportRequest) -> Written:
    info = CT.export_compressed_tensors(model, dst, **_kw(config=r.config, tokenizer=r.tokenizer,
                                                          max_shard_size=r.max_shard_size),
                                        overwrite=r.overwrite, progress=r.progress)
    return Written(pathlib.Path(dst), info.directory, info.quant_method, info,
                   notes=(f"format {info.format!r}", *info.notes))


def _write_onnx(model: nn.Module, dst: pathlib.Path, r: ExportRequest) -> Written:
    with warnings.catch_warnings():  # its warning names ONNXExportInfo; callers report the dequantized weights
        warnings.simplefilter("ignore", UserWarning)
        if r.file_ok and dst.suffix == ".onnx":
            info = OX.export_onnx(model, dst, overwrite=r.overwrite, weight_format=r.onnx_weights,
                                  unsupported=r.onnx_unsupported)
        else:
            info = OX.export_onnx_dir(model, dst, tokenizer=r.tokenizer, overwrite=r.overwrite,
                                      weight_format=r.onnx_weights, unsupported=r.onnx_unsupported)
    return Written(pathlib.Path(info.path), str(dst), "onnx", info, dequantized=tuple(info.dequantized))


def _ct_config(qc: dict) -> ModelConfig:
    """The ``ModelConfig`` of a compressed-tensors ``quantization_config``: its qcore block (without one, its
    layers are named by module class, which only its model resolves)."""
    own = qc.get("qcore")
    if not (isinstance(own, dict) and isinstance(own.get("config"), dict)):
        raise ValueError("a compressed-tensors quantization_config without a qcore block names its layers "
                         "by module class, which only its model resolves; give a qcore or Quark config")
    check_format_version(own, "quantization_config")
    return ModelConfig.from_dict(own["config"])


def _load_gguf(path: pathlib.Path, dtype) -> nn.Module:
    return GG.from_gguf(path, dtype=dtype)


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("hf", ("quark",), "AMD Quark's HF layout (config.json + safetensors; vLLM, transformers + amd-quark and "
           "qcore load it)",
           check=lambda model, config, r, plans=None: HF.check_hf(model, config, plans=plans),
           write=_write_hf, load=lambda path, dtype: from_pretrained(path, dtype=dtype), methods=("quark", "qcore"),
           config_of=HF.checkpoint_config, shards=True),
    Format("gguf", (), "DIR/model.gguf for llama.cpp (every family with a llama.cpp graph: Llama, Mistral, Qwen2/3, "
           "Gemma 1/2/3, Phi-3, GPT-2, GPT-NeoX, Mixtral, Qwen2/3-MoE; k-quants and legacy types; see docs/gguf.md)",
           check=lambda model, config, r, plans=None: GG.check_gguf(model, config, drop_activations=r.drop_activations,
                                                                    plans=plans),
           write=_write_gguf, load=_load_gguf, options=(("drop_activations", False), ("tokenizer_pre", None)),
           activations=False,
           no_activations="llama.cpp quantizes activations its own way", suffix=".gguf", gguf_specs=True,
           copies_own_source=True,
           read_tokenizer=_gguf_tokenizer, held_tokenizer=_gguf_held_tokenizer),
    Format("onnx", (), "DIR/model.onnx for onnxruntime (Llama models with a KV cache, or any traced model; see "
           "docs/onnx.md)",
           check=lambda model, config, r, plans=None: OX.check_onnx(model, config, weight_format=r.onnx_weights,
                                                                    unsupported=r.onnx_unsupported, plans=plans),
           write=_write_onnx, options=(("onnx_weights", "qdq"), ("onnx_unsupported", "error")),
           float32_only=True, float32_why="computes in float32", weightless_ok=True, suffix=".onnx",
           file_holds_tokenizer=False),
    Format("compressed-tensors", ("ct", "compressed_tensors"), "llm-compressor's layout (vLLM, transformers + "
           "compressed-tensors; see docs/compressed_tensors.md)",
           check=lambda model, config, r, plans=None: CT.check_ct(model, config, plans=plans),
           write=_write_ct, load=lambda path, dtype: CT.load_compressed_tensors(path, dtype=dtype),
           methods=("compressed-tensors",), config_of=_ct_config, shards=True),
)}

#: every format-specific export option and its default (``Format.options``)
EXPORT_OPTION_DEFAULTS = {k: v for f in FORMATS.values() for k, v in f.options}


def option_owner(option: str) -> Format:
    """The format a format-specific export option belongs to (``Format.options``)."""
    return next(f for f in FORMATS.values() if option in dict(f.options))


def format_of_method(method: Any) -> Optional[Format]:
    """The format whose checkpoint directories declare ``quantization_config.quant_method`` ``method`` (None for
    a method qcore does not read)."""
    return next((f for f in FORMATS.values() if method in f.methods), None) if isinstance(method, str) else None


def aliases_text() -> str:
    """The formats' aliases, for messages: ``quark = hf, ct = compressed-tensors, ...``."""
    return ", ".join(f"{a} = {f.name}" for f in FORMATS.values() for a in f.aliases)


def format_named(name: Any, *, what: str = "format", sources: bool = False) -> Format:
    """The ``Format`` called ``name`` (or one of its aliases, any case); ``sources``: only formats that can be
    read. TypeError / ValueError naming ``what`` and the choices."""
    allowed = [f.name for f in FORMATS.values() if f.load is not None or not sources]
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, one of {allowed}, got {name!r}")
    key = name.lower()
    fmt = next((f for f in FORMATS.values() if key == f.name or key in f.aliases), None)
    if fmt is None or fmt.name not in allowed:
        raise ValueError(f"{what} must be one of {allowed}, got {name!r}")
    return fmt


def gguf_in_dir(p: pathlib.Path) -> Optional[pathlib.Path]:
    """The one ``.gguf`` file of directory ``p`` (None without one; ValueError with several)."""
    files = sorted(p.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"src {str(p)!r} holds several GGUF files ({[f.name for f in files]}); name one")
    return files[0] if files else None


def detect_format(path: Union[str, pathlib.Path]) -> Format:
    """The format of the quantized checkpoint at ``path``: a ``.gguf`` file (or a directory holding exactly one)
    is GGUF; a directory with ``config.json`` is read by its ``quantization_config.quant_method`` (``quark`` /
    ``qcore`` -> hf, ``compressed-tensors``). ValueError (FileNotFoundError) when it is none."""
    p = pathlib.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"src {str(p)!r} does not exist")
    if p.is_file():
        if p.suffix == ".gguf":
            return FORMATS["gguf"]
        raise ValueError(f"src {str(p)!r} is a file but not a .gguf file; give a .gguf file or an HF checkpoint "
                         f"directory")
    cfg = p / "config.json"
    if not cfg.is_file():
        if gguf_in_dir(p) is not None:
            return FORMATS["gguf"]
        raise ValueError(f"src {str(p)!r} has no config.json and no .gguf file: not a checkpoint")
    qc = read_json_object(cfg, what="the model config").get("quantization_config") or {}
    if not isinstance(qc, dict):
        raise ValueError(f"src {str(p)!r}: config.json's quantization_config must be a JSON object, got "
                         f"{type(qc).__name__}")
    method = qc.get("quant_method")
    fmt = format_of_method(method)
    if fmt is not None:
        return fmt
    if not qc:
        raise ValueError(f"src {str(p)!r} is not quantized (config.json has no quantization_config); quantize it "
                         f"with qcore quantize first")
    raise ValueError(f"src {str(p)!r}: quant_method {method!r} is not one qcore reads "
                     f"({', '.join(m for f in FORMATS.values() for m in f.methods)})")

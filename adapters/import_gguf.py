"""Import a Llama GGUF file (llama.cpp's format) into a transformers model with frozen qcore modules: ``from_gguf``.

Every Linear weight stored as Q4_0, Q4_1, Q8_0 or MXFP4 (type 39) becomes a frozen qcore module built from the
file's blocks directly (codes and scales, no float round trip; ``qcore.formats.gguf.import_blocks`` gives the
qcore spec, one per tensor, groups of 32 along the input axis): Q8_0 -> int8 symmetric, Q4_0 -> int4
symmetric (uint4 with zero points 7 / 8 where ggml's quantizer wrote negative block scales), Q4_1 -> uint4 with
integer zero points (symmetric when they are all 0), MXFP4 -> mxfp4; float16 scales (E8M0 for MXFP4). Each is
checked: ``qcore.dequantize`` of the imported parts equals ggml's dequantization (gguf-py's, bit for bit) of the
tensor, so the model computes with exactly the values transformers' own GGUF loader would give it (in float32).

What has no exact qcore grid is imported as a float weight holding ggml's dequantization and listed in a
warning and in the report (``how="dequantized"``), or refused with ``strict=True``:

- Q4_1 tensors whose offsets ``m`` are not ``-d * k`` for integer zero points ``k`` (ggml's own quantizer writes
  ``m = min(x)``; qcore's zero points are integer codes): llama.cpp's Q4_1 files are generally such;
- a quantized token embedding tied to the output head (an untied one becomes a frozen ``QuantEmbedding``);
- other block types (Q4_K, Q5_0, Q6_K, IQ*, ...): refused (ValueError naming the tensor) unless
  ``dequantize_other=True``.

F32 / F16 / BF16 tensors stay float (in ``dtype``). ``attn_q`` / ``attn_k`` rows are put back from llama.cpp's
rotary order into transformers' (``formats.gguf.unpermute_qk``; codes and scales move with their rows, exact).

The model carries ``model.qcore_config`` (a ``ModelConfig`` describing exactly its quantized modules, so that
``export_hf`` and ``export_gguf`` write it again) and ``model.qcore_gguf_report`` (``GGUFImportReport``: per
tensor its GGUF type, how it was imported, the qcore spec, and whether the model holds its values exactly).
"""

from __future__ import annotations

import collections
import os
import pathlib
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import nn

import qcore
from qcore import QuantSpec
from qcore.formats import gguf as G
from qcore.formats.safetensors_io import CorruptCheckpointError

from .config import LayerConfig, ModelConfig, TensorConfig
from .modules import QUANT_CLASSES
from .quantizer import _set_module

__all__ = ["from_gguf", "GGUFImportReport", "ImportedTensor"]

_FLOAT_TYPES = ("F32", "F16", "BF16")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HOW = ("codes", "dequantized", "float")


@dataclass(frozen=True)
class ImportedTensor:
    """One tensor of the GGUF file and what ``from_gguf`` made of it.

    how: ``"codes"`` (a frozen qcore module holding the blocks' codes and scales), ``"dequantized"`` (a block
        type stored as a float weight: ggml's dequantization, in the model dtype) or ``"float"`` (F32/F16/BF16).
    spec: the qcore spec of ``"codes"`` tensors (else None).
    exact: the model holds the tensor's values exactly: for ``"codes"`` always (checked: ``qcore.dequantize``
        equals ggml's dequantization); for float weights when ``dtype`` represents every value.
    max_abs_diff: largest distance between the model's values and the file's (0 when exact).
    reason: why a block-quantized tensor is not ``"codes"`` ("" otherwise).
    """

    name: str
    gguf_name: str
    gguf_type: str
    how: str
    spec: Optional[QuantSpec]
    exact: bool
    max_abs_diff: float
    reason: str = ""


@dataclass(frozen=True)
class GGUFImportReport:
    """What ``from_gguf`` imported, tensor by tensor (``tensors``, in the file's order)."""

    path: str
    tensors: tuple

    @property
    def codes(self) -> tuple:
        """Tensors imported as frozen qcore modules."""
        return tuple(r for r in self.tensors if r.how == "codes")

    @property
    def dequantized(self) -> tuple:
        """Block-quantized tensors imported as float weights (no exact qcore grid)."""
        return tuple(r for r in self.tensors if r.how == "dequantized")

    @property
    def inexact(self) -> tuple:
        return tuple(r for r in self.tensors if not r.exact)

    @property
    def exact(self) -> bool:
        """Every tensor's values are held exactly (a quantized tensor may still be a float weight)."""
        return not self.inexact

    def summary(self) -> str:
        c = collections.Counter((r.gguf_type, r.how) for r in self.tensors)
        return ", ".join(f"{n} {t} -> {h}" for (t, h), n in sorted(c.items()))


# ---------------------------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------------------------


def _shape(t) -> tuple:
    return tuple(int(x) for x in reversed(list(t.shape)))  # gguf-py lists ggml's order: [in, out]


def _float_values(data: np.ndarray, kind: str, shape: tuple, name: str) -> np.ndarray:
    raw = np.ascontiguousarray(data)
    if kind == "F32":
        a = raw.view(np.float32)
    elif kind == "F16":
        a = raw.view(np.float16)
    else:  # BF16: the upper half of float32
        a = (raw.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    if a.size != int(np.prod(shape)):
        raise CorruptCheckpointError(f"{name}: {kind} data of {a.size} values, expected {int(np.prod(shape))} "
                                     f"for shape {list(shape)}")
    return a.reshape(shape)


def _to_torch(a: np.ndarray, dtype: torch.dtype) -> tuple[torch.Tensor, bool, float]:
    """``a`` (float16 / float32) as a ``dtype`` tensor, whether that holds it exactly, the max abs difference."""
    t = torch.from_numpy(np.array(a, copy=True)).to(dtype)
    back = t.float().numpy()
    ref = a.astype(np.float32)
    exact = bool(np.array_equal(back, ref))
    diff = 0.0 if exact else float(np.max(np.abs(back.astype(np.float64) - ref.astype(np.float64)), initial=0.0))
    return t, exact, diff


def _check_args(path, dtype, strict, dequantize_other) -> pathlib.Path:
    for k, v in (("strict", strict), ("dequantize_other", dequantize_other)):
        if not isinstance(v, bool):
            raise TypeError(f"{k} must be a bool, got {v!r}")
    if strict and dequantize_other:
        raise ValueError("strict=True refuses every tensor that is not imported as qcore codes, "
                         "dequantize_other=True asks to dequantize some: pass one of them")
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {list(_DTYPES)} or None (float32), got {dtype!r}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike naming a .gguf file, got {type(path).__name__}")
    p = pathlib.Path(path)
    if p.suffix != ".gguf":
        raise ValueError(f"path must name a .gguf file, got {str(p)!r}")
    if not p.is_file():
        raise FileNotFoundError(f"{str(p)!r} is not a file")
    return p


def _plan(reader, model: nn.Module, cfg, strict: bool, dequantize_other: bool) -> list:
    """Per tensor ``(tensor, hf name, module name, kind, shape)``, validated before any data is read."""
    mods = dict(model.named_modules())
    params = dict(model.named_parameters())
    out, seen = [], set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        hf = G.gguf_to_hf_name(t.name)
        if hf is None:
            raise ValueError(f"from_gguf: tensor {t.name!r} has no place in transformers' Llama model (qcore imports "
                             f"the Llama layout: token_embd, output, output_norm, blk.N.attn_*/ffn_*)")
        if hf in seen:
            raise CorruptCheckpointError(f"from_gguf: tensor {t.name!r} appears twice in the file")
        seen.add(hf)
        if hf not in params:
            raise ValueError(f"from_gguf: tensor {t.name!r} ({hf}) is not a parameter of the model its metadata "
                             f"describes (e.g. a bias the config does not have)")
        shape = _shape(t)
        want = tuple(params[hf].shape)
        if shape != want:
            raise CorruptCheckpointError(f"from_gguf: tensor {t.name!r} has shape {list(shape)}; the model's "
                                         f"{hf} is {list(want)}")
        mod_name, _, leaf = hf.rpartition(".")
        if kind not in _FLOAT_TYPES and kind not in G.TYPE_BYTES:
            if strict or not dequantize_other:
                raise ValueError(f"from_gguf: tensor {t.name!r} is {kind}, which no qcore grid holds; qcore imports "
                                 f"Q4_0, Q4_1, Q8_0, MXFP4 and F32/F16/BF16 (from Python, from_gguf(..., "
                                 f"dequantize_other=True) imports it as its float32 dequantization; qcore convert "
                                 f"has no such option)")
        elif kind in G.TYPE_BYTES and (leaf != "weight" or len(shape) != 2):
            raise CorruptCheckpointError(f"from_gguf: tensor {t.name!r} ({hf}) is {kind}; qcore imports block types "
                                         f"for 2-D weights only")
        out.append((t, hf, mod_name, kind, shape))
    missing = [n for n in params if n not in seen and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing:
        raise CorruptCheckpointError(f"from_gguf: the file has no tensor for {missing[:5]} "
                                     f"({G.hf_to_gguf_name(missing[0])!r} ...)")
    return out


def _set_param(model: nn.Module, hf: str, value: torch.Tensor) -> None:
    mod_name, _, leaf = hf.rpartition(".")
    m = model.get_submodule(mod_name)
    m._parameters[leaf] = nn.Parameter(value, requires_grad=value.is_floating_point())


def _model_config(model: nn.Module, specs: dict[str, QuantSpec]) -> Optional[ModelConfig]:
    """The ModelConfig whose plan gives exactly the model's quantized modules: the most common spec as the
    global layer, the others (and every float Linear, and a quantized embedding) by name."""
    if not specs:
        return None
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    counts = collections.Counter(specs[n] for n in linears if n in specs)
    common = counts.most_common(1)[0][0] if counts else None
    by_name: dict[str, Optional[LayerConfig]] = {}
    for n in linears:
        s = specs.get(n)
        if s != common:
            by_name[n] = None if s is None else LayerConfig(weight=TensorConfig(s))
    for n, s in specs.items():  # embeddings: quantized only by name
        if n not in linears:
            by_name[n] = LayerConfig(weight=TensorConfig(s))
    layer = LayerConfig() if common is None else LayerConfig(weight=TensorConfig(common))
    return ModelConfig(layer, by_name=by_name, exclude=())


def _skeleton(path: pathlib.Path, dtype: torch.dtype):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    if cfg.model_type != "llama":
        raise ValueError(f"from_gguf: model_type {cfg.model_type!r} is not supported; qcore imports the Llama "
                         f"family (general.architecture 'llama')")
    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers (rotary) computed
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return cfg, model


def from_gguf(path: Union[str, os.PathLike], *, dtype: Optional[torch.dtype] = None, strict: bool = False,
              dequantize_other: bool = False) -> nn.Module:
    """Load the Llama GGUF file ``path`` as a transformers model whose GGUF-quantized Linear weights are frozen
    qcore modules (see the module docstring). Returns the model (eval mode) with ``model.qcore_config``
    (None when no tensor is quantized) and ``model.qcore_gguf_report``.

    dtype: the float dtype of the model (float tensors, and what frozen modules dequantize to); default float32.
    strict: refuse (ValueError naming the tensor) any block-quantized tensor that would not become qcore codes.
    dequantize_other: import block types qcore has no grid for (Q4_K, Q6_K, ...) as their float32
        dequantization (gguf-py's) instead of refusing them.

    The tokenizer loads with ``transformers.AutoTokenizer.from_pretrained(dir, gguf_file=name)``.
    """
    p = _check_args(path, dtype, strict, dequantize_other)
    try:
        return _load(p, dtype or torch.float32, strict, dequantize_other)
    except CorruptCheckpointError as e:  # every refusal names the file
        raise CorruptCheckpointError.naming(p, e) from None


def _load(p: pathlib.Path, dtype: torch.dtype, strict: bool, dequantize_other: bool) -> nn.Module:
    import gguf
    G.check_file(p)  # counts, types, data ranges: before gguf-py maps the file
    reader = gguf.GGUFReader(p)
    arch = reader.fields.get("general.architecture")
    arch = arch.contents() if arch is not None else None
    if arch != "llama":
        raise ValueError(f"from_gguf: general.architecture is {arch!r}; qcore imports 'llama' GGUF files")
    cfg, model = _skeleton(p, dtype)
    plan = _plan(reader, model, cfg, strict, dequantize_other)
    n_head = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_head)
    tied = bool(cfg.tie_word_embeddings)

    reports, specs, float_blocks = [], {}, []
    for t, hf, mod_name, kind, shape in plan:
        data = np.asarray(t.data)
        if ".attn_q." in t.name or ".attn_k." in t.name:
            data = G.unpermute_qk(data, n_head if ".attn_q." in t.name else n_kv)
        if kind in _FLOAT_TYPES:
            vals = _float_values(data, kind, shape, t.name)
            value, exact, diff = _to_torch(vals, dtype)
            _set_param(model, hf, value)
            reports.append(ImportedTensor(hf, t.name, kind, "float", None, exact, diff))
            continue
        module = model.get_submodule(mod_name)
        spec, parts, reason = None, None, ""
        if kind in G.TYPE_BYTES:
            if isinstance(module, nn.Embedding) and tied:
                reason = "the token embedding is tied to the output head (a frozen module has no float weight to share)"
            elif type(module) not in QUANT_CLASSES:
                reason = f"{type(module).__name__} modules are not quantized by qcore"
            else:
                spec, parts, reason = G.import_blocks(data, kind, shape, where=t.name)
            ref = G.dequantize(data, kind, shape, where=t.name)
        else:
            reason = f"{kind} is a block type no qcore grid holds"
            ref = np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32).reshape(shape)
            if ".attn_q." in t.name or ".attn_k." in t.name:
                ref = G.unpermute_qk(ref, n_head if ".attn_q." in t.name else n_kv)
        if spec is None:
            if strict:
                raise ValueError(f"from_gguf(strict=True): tensor {t.name!r} ({kind}) cannot be imported as qcore "
                                 f"codes: {reason}; pass strict=False to import it as its float dequantization")
            value, exact, diff = _to_torch(ref, dtype)
            _set_param(model, hf, value)
            reports.append(ImportedTensor(hf, t.name, kind, "dequantized", None, exact, diff, reason))
            float_blocks.append(t.name)
            continue
        got = qcore.dequantize(qcore.QTensor(parts.codes, parts.scales, parts.zero_points, spec))
        if not np.array_equal(got, ref):
            raise RuntimeError(f"from_gguf: {t.name!r}: the imported {spec.name} codes do not reproduce ggml's "
                               f"values (a qcore bug; please report it)")
        q = QUANT_CLASSES[type(module)].from_module(module, LayerConfig(weight=TensorConfig(spec)), name=mod_name)
        q.load_frozen(parts, shape=shape, dtype=dtype, device=torch.device("cpu"))
        q.eval()
        _set_module(model, mod_name, q)
        specs[mod_name] = spec
        reports.append(ImportedTensor(hf, t.name, kind, "codes", spec, True, 0.0))

    if tied:
        model.tie_weights()
        out, emb = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None and out.weight is not emb.weight:
            out.weight = emb.weight
    left = [n for n, v in list(model.named_parameters()) + list(model.named_buffers()) if v.is_meta]
    if left:
        raise CorruptCheckpointError(f"from_gguf: the file has no tensor for {left[:5]}")
    model.qcore_config = _model_config(model, specs)
    if model.qcore_config is not None:
        from .export import _check_config_describes
        _check_config_describes(model, model.qcore_config)  # a qcore bug if the config does not rebuild the model
    model.qcore_gguf_report = GGUFImportReport(str(p), tuple(reports))
    if float_blocks:
        warnings.warn(f"from_gguf: {len(float_blocks)} block-quantized tensor(s) have no exact qcore grid and are "
                      f"imported as float weights holding ggml's dequantization (model.qcore_gguf_report."
                      f"dequantized says why): {', '.join(float_blocks[:5])}{', ...' if len(float_blocks) > 5 else ''}",
                      stacklevel=3)
    return model.eval()

"""What every format's writer and loader shares (``quark_hf``, ``compressed_tensors``, ``gguf``, ``onnx`` and the
streaming writer, ``passes.streaming``).

- Before any work (the exporters' up-front checks): the destination (``check_destination``), the shard size
  (``parse_size``), the config written (``model_config``, ``check_config_describes``), the modules a format cannot
  write (``refuse_conv1d``, ``refuse_low_rank``, ``conv1d_error``, ``weightless_error``), and what the model is or
  will be once quantized (``export_units``, ``will_rotate_online``, ``online_rotations``).
- A quantized module's weight as qcore parts on canonical axes (``weight_parts``, ``canonical_shape``).
- Reading a checkpoint directory: ``read_config``, ``hf_config``, ``model_class``, ``check_format_version`` (the
  qcore block's ``QCORE_FORMAT_VERSION``), ``unexpected_keys``.
"""

from __future__ import annotations

import dataclasses

import json
import math
import os
import pathlib
import re
from typing import Any, Iterable, NamedTuple, Optional, Union

import numpy as np
import torch
from torch import nn

import qcore
from qcore._fsutil import check_not_source, model_sources, staged_dir
from qcore.algorithms.config import SVDQuantConfig, split_rotation
from qcore.formats import quark_layout as L
from qcore.formats.safetensors_io import (CorruptCheckpointError, SafetensorsFile, TensorRecord, read_json_object,
                                         write_file)

from .records import to_numpy
from ..config import ModelConfig
from ..modules import IN_OUT, QuantExperts, QuantModule, input_rotations, low_rank_modules, online_plan, weight_layout
from ..plan import plan_model

__all__ = ['QCORE_FORMAT_VERSION', 'ExportUnit', 'canonical_shape', 'check_config_describes', 'check_destination',
           'check_format_version', 'check_hyperparameters', 'conv1d_error', 'export_units', 'hf_config', 'model_class',
           'model_config', 'online_rotations', 'parse_size', 'read_config', 'refuse_conv1d', 'refuse_low_rank', 'unexpected_keys',
           'weight_parts', 'weightless_error', 'will_rotate_online']


QCORE_FORMAT_VERSION = 1


def parse_size(size: Union[int, str], *, what: Optional[str] = None) -> int:
    """``5GB``, ``500MB``, ``2GiB``, ``1000000`` -> bytes (decimal units as transformers reads them). ``what``: how
    errors name the value (default ``max_shard_size '5XB'``; a command line: ``--max-shard-size 5XB``)."""
    what = what or f"max_shard_size {size!r}"
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"{what}: must be positive")
        return size
    if not isinstance(size, str):
        raise TypeError(f"{what}: must be an int or a string like '5GB', not {type(size).__name__}")
    s = size.strip().upper()
    units = [("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)]
    for u, f in units:
        if s.endswith(u):
            try:
                v = float(s[:-len(u)])
            except ValueError:
                break
            if math.isfinite(v) and v * f >= 1:  # at least one byte: '0.0000001B', 'infGB', 'nanMB' are not sizes
                return int(v * f)
            break
    else:
        if s.isdigit() and int(s) > 0:
            return int(s)
    raise ValueError(f"{what} is not a size; expected e.g. '5GB', '500MB', '2GiB' or a byte count")


_PARTS_ROWS_ELEMENTS = 1 << 21  # weight elements weight_parts quantizes at once (_weight_parts_rows)


def _row_chunks(w: torch.Tensor, spec, kw: dict) -> int:
    """Rows of ``w`` that ``weight_parts`` may quantize at once (0: the whole weight in one call): a 2-D weight
    larger than ``_PARTS_ROWS_ELEMENTS`` whose scales (and zero points) hold one row per weight row (per-channel,
    per-group or block scales along the input axis), and a spec with nothing shared across rows (no tensor scale,
    no micro-exponent shifts). Quantizing with given scales is elementwise, so the rows' codes are the whole
    weight's, bit for bit."""
    if w.dim() != 2 or w.numel() <= _PARTS_ROWS_ELEMENTS or spec.two_level or spec.subblock_shift_bits:
        return 0
    for k in ("scale", "zero_point"):
        t = kw.get(k)
        if t is not None and (t.dim() != 2 or t.shape[0] != w.shape[0]):
            return 0
    return max(1, _PARTS_ROWS_ELEMENTS // w.shape[1])


def _weight_parts_rows(m, w: torch.Tensor, spec, kw: dict, step: int) -> L.WeightParts:
    """``weight_parts`` of a non-frozen module ``step`` rows at a time (``_row_chunks``): the float32 copy, the
    codes and their check cost one slice, not the whole weight several times over."""
    codes = scales = zps = None
    for i in range(0, w.shape[0], step):
        wc = w[i:i + step].float().cpu()
        part = {k: v[i:i + step] for k, v in kw.items()}
        q = qcore.quantize(wc, spec, **part)
        if not torch.equal(qcore.dequantize(q).to(w.dtype), wc.to(w.dtype)):
            raise RuntimeError(f"export {m.qname!r}: the weight is not on its quantization grid (was it changed "
                               f"after quantize_model without a forward?); run a forward or freeze the model first")
        c, sc = to_numpy(q.codes), to_numpy(q.scales)
        if codes is None:
            codes = np.empty((w.shape[0],) + c.shape[1:], c.dtype)
            scales = np.empty((w.shape[0],) + sc.shape[1:], sc.dtype)
            if q.zero_points is not None:
                zps = np.empty((w.shape[0],) + tuple(q.zero_points.shape[1:]), to_numpy(q.zero_points).dtype)
        codes[i:i + step], scales[i:i + step] = c, sc
        if zps is not None:
            zps[i:i + step] = to_numpy(q.zero_points)
    return L.WeightParts(codes=codes, scales=scales, zero_points=zps, shifts=None, tensor_scale=None)


def weight_parts(m: QuantModule) -> tuple[L.WeightParts, tuple]:
    """The qcore parts of a quantized module's weight (canonical layout) and the canonical shape; frozen or not
    (a fake-quantized weight is quantized again with its own scales, exactly as ``freeze`` does, nothing
    changes)."""
    spec = m.specs["weight"]
    if spec.gguf:
        raise ValueError(f"{m.qname!r}: its weight is GGUF {spec.gguf} (float block offsets and super-block scales), "
                         f"which only GGUF files hold; export it with export_gguf, or quantize the float model "
                         f"with another spec for this format")
    if m.frozen:
        shape = m.weight_shape
        codes = qcore.packing.unpack(m.weight_packed.cpu(), spec.dtype, axis=-1, length=shape[-1])
        sc = m.weight_scale.cpu()
        scales = sc.float() if sc.dtype == torch.float32 else qcore.decode(sc, spec.scale_dtype)
        stored = m.scales("weight")
        zp, sh, ts = stored.zero_point, stored.subblock_shifts, stored.tensor_scale
        return L.WeightParts(codes=to_numpy(codes), scales=to_numpy(scales.float()),
                             zero_points=None if zp is None else to_numpy(zp.float()), shifts=None if sh is None else to_numpy(sh),
                             tensor_scale=None if ts is None else to_numpy(ts.float())), shape
    w = m.effective("weight", canonical=True)
    kw: dict[str, Any] = {"scale": m.weight_scale.cpu()}
    if not spec.symmetric:
        kw["zero_point"] = m.weight_zero_point.cpu()
    if spec.two_level:
        kw["tensor_scale"] = m.weight_tensor_scale.cpu()
    rows = _row_chunks(w, spec, kw)
    if rows:
        return _weight_parts_rows(m, w, spec, kw, rows), tuple(w.shape)
    wc = w.float().cpu()
    q = qcore.quantize(wc, spec, **kw)
    back = qcore.dequantize(q).to(w.dtype)
    if not torch.equal(back, wc.to(w.dtype)):
        raise RuntimeError(f"export {m.qname!r}: the weight is not on its quantization grid (was it changed after "
                           f"quantize_model without a forward?); run a forward or freeze the model first")
    return L.WeightParts(codes=to_numpy(q.codes), scales=to_numpy(q.scales), zero_points=None if q.zero_points is None
                         else to_numpy(q.zero_points), shifts=None if q.subblock_shifts is None else to_numpy(q.subblock_shifts),
                         tensor_scale=None if q.tensor_scale is None else to_numpy(q.tensor_scale)), tuple(wc.shape)


def canonical_shape(m: QuantModule) -> tuple:
    """The shape of a quantized module's weight in the canonical ``[out, in, *kernel]`` layout, frozen or not."""
    if isinstance(m, QuantExperts):  # [E, 2I, H]: each expert's Linears are [I, H] (gate, up) and [H, I]
        return m.expert_shape("gate_up_proj")
    return m.weight_shape


def online_rotations(model: nn.Module, config: ModelConfig) -> bool:
    """Whether the model carries online rotations; ValueError if they are not what its config's rotation says
    (a loader re-installs them from the config)."""
    have = {n: (h.size, h.key, h.block) for n, h in input_rotations(model).items()}
    rot, _ = split_rotation(config.algorithms)
    want = {n: (h.size, h.key, h.block) for n, h in online_plan(model, rot).items()} if rot is not None else {}
    if have != want:
        raise ValueError(f"export: the model's online rotations ({len(have)} modules, e.g. "
                         f"{next(iter(have), None)!r}) are not the ones its config's algorithms give ({len(want)}, "
                         f"e.g. {next(iter(want), None)!r}); rotate through quantize_model's algorithms (quarot, "
                         f"spinquant) so that the checkpoint can re-install them")
    return bool(have)


class ExportUnit(NamedTuple):
    """One module an exporter writes quantized: its name, float module type name (``"Linear"``, ...), weight shape
    in the canonical ``[out, in, *kernel]`` layout, and ``LayerConfig``."""
    name: str
    type: str
    shape: tuple
    config: Any


def export_units(model: nn.Module, config: ModelConfig, *, plans=None) -> list[ExportUnit]:
    """The quantized modules of ``model`` as they are, or, for a model not quantized yet, as ``quantize_model``
    would make them from ``config`` (``plan_model``): what the exporters' up-front checks (``check_hf``,
    ``check_gguf``, ``check_onnx``, ``check_ct``) look at, before any evaluation or quantization."""
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantModule)]
    if mods:
        return [ExportUnit(n, "Experts" if isinstance(m, QuantExperts) else m.float_type.__name__,
                           canonical_shape(m), m.qconfig) for n, m in mods]
    out = []
    for p in plan_model(model, config) if plans is None else plans:  # plans: plan_model's, when the caller has it
        mod = model.get_submodule(p.name)
        w = getattr(mod, "weight" if p.type != "Experts" else "gate_up_proj", None)
        shape = tuple(w.shape) if w is not None else ()
        if (p.type == "ConvTranspose2d" or weight_layout(mod) == IN_OUT) and len(shape) >= 2:  # stored [in, out, ...]
            shape = (shape[1], shape[0], *shape[2:])
        out.append(ExportUnit(p.name, p.type, shape, p.config))
    return out


def refuse_conv1d(model: nn.Module, config: Optional[ModelConfig], who: str) -> None:
    """Before any work: ValueError naming the first module that is (or, for a float model and ``config``, will be)
    a quantized transformers ``Conv1D`` (GPT-2's projections): ``who`` (the ONNX and compressed-tensors
    exporters and their up-front checks) has no writer for them yet (docs/adapters.md); ``export_hf`` writes them.
    These exporters refuse SVDQuant's low-rank branches the same way, first (``refuse_low_rank``)."""
    refuse_low_rank(model, config, who)
    names = [n for n, m in model.named_modules()
             if isinstance(m, QuantModule) and weight_layout(m) == IN_OUT]
    if not names and isinstance(config, ModelConfig) and not any(isinstance(m, QuantModule) for m in model.modules()) \
            and any(weight_layout(m) == IN_OUT for m in model.modules()):  # models without one: not planned here
        names = [u.name for u in export_units(model, config) if u.type == "Conv1D"]
    if names:
        raise ValueError(conv1d_error(who, names))


def refuse_low_rank(model: nn.Module, config: Optional[ModelConfig], who: str) -> None:
    """Before any work: ValueError naming the first module that carries (or, for a float model and ``config`` with
    SVDQuant, will carry) SVDQuant's low-rank branch: ``who`` (GGUF, ONNX, compressed-tensors) has no way to
    write the branch, and dropping it would change the model's function; ``export_hf`` writes it."""
    names = low_rank_modules(model)
    if not names and isinstance(config, ModelConfig) and not any(isinstance(m, QuantModule) for m in model.modules()):
        if any(isinstance(a, SVDQuantConfig) for a in config.algorithms):
            names = ["every Linear SVDQuant quantizes"]
    if names:
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        raise ValueError(f"{who}: {names[0]!r}{more} carries SVDQuant's low-rank branch (a high-precision side "
                         f"matmul beside the quantized one), which this format cannot represent; export_hf writes it "
                         f"(quant_method 'qcore', qcore.adapters.from_pretrained loads it), or quantize without "
                         f"svdquant")


def conv1d_error(who: str, names: list) -> str:
    """The refusal of an exporter with no writer for quantized transformers ``Conv1D`` modules (``names``)."""
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return (f"{who}: {names[0]!r}{more} is a quantized transformers Conv1D (GPT-2's attention and MLP "
            f"projections); this format has no writer for it yet (docs/adapters.md). export_hf writes it "
            f"(qcore.adapters.from_pretrained loads it); or exclude these modules from the config to keep them float")


def will_rotate_online(model: nn.Module, config: ModelConfig) -> bool:
    """Whether the model carries (or, quantized with ``config``, will carry) online rotations."""
    if input_rotations(model):
        return True
    rot, _ = split_rotation(config.algorithms)
    if rot is None:
        return False
    if getattr(rot, "block", None) == "auto":  # resolved by quantize_model; which modules does not depend on it
        rot = dataclasses.replace(rot, block=None)
    return bool(online_plan(model, rot))


def model_config(model: nn.Module, config: Optional[ModelConfig], *, who: str) -> ModelConfig:
    """The ``ModelConfig`` an exporter writes: ``config``, or the model's own ``qcore_config`` (set by
    ``quantize_model`` and the loaders); TypeError / ValueError naming ``who`` otherwise."""
    if config is not None and not isinstance(config, ModelConfig):
        raise TypeError(f"{who}: config must be a ModelConfig (ModelConfig.from_dict reads a dict), "
                        f"got {type(config).__name__}")
    config = config if config is not None else getattr(model, "qcore_config", None)
    if not isinstance(config, ModelConfig):
        raise ValueError(f"{who}: the model carries no qcore config (quantize it with "
                         f"qcore.adapters.quantize_model, or pass config=)")
    return config


def check_config_describes(model: nn.Module, config: ModelConfig) -> None:
    """The config written must give exactly the model's quantized modules (a loader rebuilds them from it)."""
    plans = plan_model(model, config, quantized_ok=True)
    want = {p.name: p.config for p in plans}
    have = {n: m.qconfig for n, m in model.named_modules() if isinstance(m, QuantModule)}
    for name in sorted(set(want) | set(have)):
        if want.get(name) != have.get(name):
            got = "float" if name not in have else "quantized"
            raise ValueError(f"export: config does not describe the model: {name!r} is {got} in the model but the "
                             f"config gives {'float' if name not in want else repr(want[name])}; pass the config "
                             f"the model was quantized with")
    own = {p.name: p.proj_weights for p in plans if p.proj_weights}
    have_own = {n: m.proj_weights for n, m in model.named_modules() if getattr(m, "proj_weights", ())}
    for name in sorted(set(own) | set(have_own)):  # fused experts' per-projection weight specs
        if own.get(name, ()) != have_own.get(name, ()):
            raise ValueError(f"export: config does not describe the model: the experts {name!r} have the "
                             f"per-projection weight specs {have_own.get(name, ())} but the config gives "
                             f"{own.get(name, ())}; pass the config the model was quantized with")


def check_destination(directory: pathlib.Path, overwrite: bool, sources: Iterable = ()) -> None:
    """Before any work: ``directory`` is none of ``sources`` (nor contains, nor lies inside one:
    ``qcore._fsutil.check_not_source``, with overwrite or not) and is absent, empty, or ``overwrite`` is given."""
    check_not_source(directory, sources, what="export directory")
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"export directory {str(directory)!r} exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not overwrite:
        raise FileExistsError(f"export directory {str(directory)!r} exists and is not empty; pass overwrite=True "
                              f"(--overwrite) to replace it")


def weightless_error(what: str, names: list) -> str:
    """The refusal of a checkpoint writer whose format stores quantized weights, for modules that quantize only
    their activations or KV-cache outputs (a KV-cache-only or activation-only config)."""
    return (f"{what}: {len(names)} module(s) quantize activations or KV-cache outputs but not their weight (e.g. "
            f"{names[0]!r}); this checkpoint format stores quantized weights with their activation scales, so a "
            f"KV-cache-only or activation-only config is not exported: quantize the weights too (e.g. the ptpc_fp8 "
            f"preset with an fp8 KV cache), or export ONNX, which holds activation-only quantization")


def check_format_version(own: Any, where: str) -> None:
    """Refuse a qcore block (``quantization_config["qcore"]``) written by a newer qcore: its ``format_version``
    must be an int no greater than this reader's ``QCORE_FORMAT_VERSION``."""
    if not isinstance(own, dict) or "format_version" not in own:
        return
    v = own["format_version"]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise CorruptCheckpointError(f"{where}.qcore.format_version must be a positive int, got {v!r}")
    if v > QCORE_FORMAT_VERSION:
        raise CorruptCheckpointError(f"{where}.qcore.format_version is {v}; this qcore ({qcore.__version__}) reads "
                                     f"format versions up to {QCORE_FORMAT_VERSION}: upgrade qcore to load it")


def read_config(d: pathlib.Path) -> tuple:
    """``(config.json as a dict, its quantization_config)`` of the checkpoint directory ``d``, read safely (a
    malformed or too deeply nested file is a ``CorruptCheckpointError`` naming it)."""
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{str(d)!r} is not a checkpoint directory (no config.json)")
    cfg = read_json_object(d / "config.json", what="the model config")
    return cfg, cfg.get("quantization_config")


#: hyperparameters (in config.json, its text_config / vision_config, rope_parameters / rope_scaling) that are
#: sizes: a positive int (or null); those naming layers are at most the checkpoint's tensor count, the others at
#: most its bytes (a dimension of a stored tensor cannot exceed the bytes storing it), positions at most 2**31 - 1
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
          "n_embd", "n_head", "n_inner", "ffn_dim", "word_embed_proj_dim", "moe_intermediate_size",
          "shared_expert_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok",
          "embed_dim", "num_heads", "patch_size", "image_size", "num_channels", "projection_dim")
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "depth")
_POSITIONS = ("max_position_embeddings", "n_positions", "sliding_window", "original_max_position_embeddings")
#: hyperparameters that are positive finite floats (or null)
_POSITIVE_FLOATS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "rope_theta",
                    "partial_rotary_factor", "factor", "query_pre_attn_scalar")
_NESTED = ("text_config", "vision_config", "rope_parameters", "rope_scaling")
#: switches transformers reads in the forward pass or while building the model: JSON booleans
_BOOLS = ("output_hidden_states", "output_attentions", "use_cache", "return_dict", "tie_word_embeddings",
          "attention_bias", "mlp_bias", "is_decoder", "is_encoder_decoder", "torchscript", "use_bfloat16")
#: switches with one workable value: transformers' causal-LM forward reads its base model's output by attribute
_FIXED = {"return_dict": True, "torchscript": False}
#: activation names: a key of transformers' ACT2FN
_ACTIVATIONS = ("hidden_act", "hidden_activation", "activation_function")
_FLOAT_DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64", "auto")
_FLOAT32_MAX = 3.4028234663852886e38


def check_hyperparameters(cfg: dict, where: str, *, tensor_bytes: Optional[int] = None,
                          tensor_count: Optional[int] = None, rope_types: Optional[set] = None,
                          activations: Optional[set] = None, _path: str = "") -> None:
    """The hyperparameters of a model config (config.json as a dict) range-checked before transformers builds a
    model from them (``CorruptCheckpointError`` naming the file ``where`` and the field): sizes positive ints,
    layer counts at most ``tensor_count`` and other sizes at most ``tensor_bytes`` (the checkpoint's: a model
    larger than its checkpoint is not the checkpoint's), norm epsilons and RoPE bases positive and finite,
    ``architectures`` a list of names, ``dtype`` / ``torch_dtype`` a float dtype name, ``model_type`` a name,
    and in ``rope_parameters`` / ``rope_scaling`` a ``rope_theta`` present (not null) and a ``rope_type`` among
    ``rope_types`` (transformers' RoPE kinds; a vision tower's are its own); ``sliding_window`` may be 0 (none);
    the switches of ``_BOOLS`` booleans, an activation name among ``activations`` (transformers' ACT2FN), and
    ``head_dim`` even where the model has RoPE (it rotates pairs).
    A config whose model would allocate past the checkpoint's size, divide by zero or compute NaN is refused here
    instead."""
    def bad(key, v, expected):
        return CorruptCheckpointError(f"{where}: {_path}{key} is {v!r}; expected {expected}"[:300])
    rope = _path.rstrip(".").rsplit(".", 1)[-1] in ("rope_parameters", "rope_scaling")
    for key, v in cfg.items():
        if rope and key == "rope_type" and (not isinstance(v, str) or (  # ("type": legacy, e.g. Qwen2-VL's mrope)
                rope_types is not None and v not in rope_types and "vision_config" not in _path)):
            raise bad(key, v, f"a RoPE type ({', '.join(sorted(rope_types or ()))})")
        if rope and key == "rope_theta" and v is None:
            raise bad(key, v, "a positive finite number")
        if key == "model_type" and not _path and not isinstance(v, str):
            raise bad(key, v, "a model type name (a str)")
        if key in _FIXED and not _path and v is not _FIXED[key] and (v is not None or key == "return_dict"):
            raise bad(key, v, f"{str(_FIXED[key]).lower()} (or absent): with it the model returns tuples, on which "
                              f"transformers' own forward fails")
        if v is None:
            continue
        if key in _SIZES + _LAYER_COUNTS + _POSITIONS:
            low = 0 if key == "sliding_window" else 1  # 0: no sliding window (Qwen2-MoE)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise bad(key, v, "a positive int" if low else "an int >= 0")
            top = (tensor_count if key in _LAYER_COUNTS else 2 ** 31 - 1 if key in _POSITIONS else tensor_bytes)
            if top is not None and v > top:
                what = ("the checkpoint's tensor count" if key in _LAYER_COUNTS else "2**31 - 1" if key in _POSITIONS
                        else "the checkpoint's size in bytes")
                raise bad(key, v, f"at most {what} ({top})")
        elif key in _POSITIVE_FLOATS:  # torch takes them as float32 / int64: 2**64 was an OverflowError
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, int) and v >= 2 ** 63) \
                    or not (math.isfinite(v) and 0 < v <= _FLOAT32_MAX):
                raise bad(key, v, "a positive finite number (at most float32's largest)")
        elif key in _BOOLS:
            if not isinstance(v, bool):
                raise bad(key, v, "true or false")
        elif key in _ACTIVATIONS:
            if not isinstance(v, str) or (activations is not None and v not in activations):
                raise bad(key, v, "an activation name (e.g. silu, gelu)")
        elif key == "architectures":
            if not isinstance(v, list) or not all(isinstance(a, str) for a in v):
                raise bad(key, v, "a list of class names")
        elif key in ("dtype", "torch_dtype"):
            if not isinstance(v, str) or v.removeprefix("torch.") not in _FLOAT_DTYPE_NAMES:
                raise bad(key, v, f"a float dtype name ({', '.join(_FLOAT_DTYPE_NAMES[:3])})")
        elif key in _NESTED and isinstance(v, dict):
            check_hyperparameters(v, where, tensor_bytes=tensor_bytes, tensor_count=tensor_count,
                                  rope_types=rope_types, activations=activations, _path=f"{_path}{key}.")
    hd = cfg.get("head_dim")
    roped = any(k in cfg for k in ("rope_theta", "rope_parameters", "rope_scaling"))
    if roped and isinstance(hd, int) and not isinstance(hd, bool) and hd % 2:
        raise bad("head_dim", hd, "an even int (RoPE rotates pairs of a head's channels)")


def hf_config(d: pathlib.Path):
    """transformers' ``AutoConfig`` of the checkpoint directory ``d``; a config.json transformers cannot read is a
    ``CorruptCheckpointError`` naming the file, not transformers' traceback. The hyperparameters are range-checked
    first (``check_hyperparameters``, bounded by the safetensors files in ``d``)."""
    from transformers import AutoConfig
    where = repr(str(d / "config.json"))
    files = sorted(d.glob("*.safetensors"))
    count = None
    if files:
        try:
            count = sum(len(SafetensorsFile(f).entries) for f in files)
        except CorruptCheckpointError:  # reported by the caller's own reading of the files
            count = None
    from transformers.activations import ACT2FN
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    check_hyperparameters(read_json_object(d / "config.json", what="the model config"), where,
                          tensor_bytes=sum(f.stat().st_size for f in files) if files else None,
                          tensor_count=count, rope_types=set(ROPE_INIT_FUNCTIONS) | {"default"},
                          activations=set(ACT2FN))
    bad: tuple = (ValueError, TypeError, KeyError, AttributeError, OSError, IndexError)
    try:  # transformers 5 validates config fields with huggingface_hub's strict dataclasses
        from huggingface_hub.errors import StrictDataclassError
        bad += (StrictDataclassError,)
    except ImportError:
        pass
    try:
        return AutoConfig.from_pretrained(d, local_files_only=True)
    except bad as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CorruptCheckpointError(f"{str(d / 'config.json')!r}: transformers cannot build the model config from "
                                     f"it ({msg})") from None


def unexpected_keys(model: nn.Module, names) -> list:
    """The ``names`` (checkpoint tensors) that are not tensors of ``model``, sorted, leaving out those transformers
    itself ignores on load: the model's ``_keys_to_ignore_on_load_unexpected`` and its non-persistent buffers
    (older files store the rotary ``inv_freq``)."""
    state = model.state_dict(keep_vars=True)
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
    transient = {f"{n}.{b}" if n else b for n, m in model.named_modules() for b in m._non_persistent_buffers_set}
    return sorted(k for k in names if k not in state and k not in transient and not any(p.search(k) for p in ignore))


def model_class(config: Any):
    """The transformers class a checkpoint's ``config`` was saved from: the first of ``config.architectures`` that
    transformers has (a ``BertModel`` checkpoint loads as a ``BertModel``, not as the causal LM
    ``AutoModelForCausalLM`` would build), else ``AutoModelForCausalLM``."""
    import transformers
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(cls, type) and hasattr(cls, "from_pretrained"):
            return cls
    return transformers.AutoModelForCausalLM


def _shards(records: list[TensorRecord], max_bytes: int) -> list[list[TensorRecord]]:
    shards: list[list[TensorRecord]] = [[]]
    size = 0
    for r in records:
        if shards[-1] and size + r.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(r)
        size += r.nbytes
    return shards


def write_checkpoint(directory: pathlib.Path, model: nn.Module, hf_config: Any, qdict: dict,
                     records: list[TensorRecord], *, tokenizer: Any, overwrite: bool, max_bytes: int,
                     progress: bool) -> None:
    """An HF checkpoint directory (config with ``qdict`` as its ``quantization_config``, generation config,
    tokenizer, safetensors shards of ``records``), written atomically: staged beside ``directory``, renamed into
    place (shared by ``export_hf`` and ``export_compressed_tensors``)."""
    with staged_dir(directory, recheck=lambda: check_destination(directory, overwrite, model_sources(model))) as tmp:
        write_metadata(tmp, hf_config, qdict, type(model).__name__, getattr(model, "generation_config", None))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_shards(tmp, records, max_bytes, progress=progress)


def publishable(d: Any) -> Any:
    """``d`` (a config dict) without local paths: ``_name_or_path`` and every other string that is an absolute
    path are dropped, so that the same model exports the same bytes wherever it was loaded from."""
    if isinstance(d, dict):
        return {k: publishable(v) for k, v in d.items()
                if k != "_name_or_path" and not (isinstance(v, str) and _is_local_path(v))}
    if isinstance(d, (list, tuple)):
        return type(d)(publishable(v) for v in d if not (isinstance(v, str) and _is_local_path(v)))
    return d


def _is_local_path(v: str) -> bool:
    return os.path.isabs(v) or v.startswith(("~" + os.sep, "." + os.sep, ".." + os.sep))


def write_metadata(tmp: pathlib.Path, hf_config: Any, qdict: dict, architecture: str, generation_config: Any) -> None:
    """``config.json`` (the model's config with ``quantization_config``) and ``generation_config.json``."""
    cfg = publishable(hf_config.to_dict())
    cfg["quantization_config"] = qdict
    cfg["architectures"] = [architecture]  # as save_pretrained writes it (vLLM picks the class by it)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if generation_config is not None:
        (tmp / "generation_config.json").write_text(generation_config.to_json_string(use_diff=True))


def write_shards(tmp: pathlib.Path, records: list[TensorRecord], max_bytes: int, *, progress: bool = False) -> int:
    """The records as safetensors shards of at most ``max_bytes`` (in order), with an index file when there are
    several; returns the bytes of tensor data written."""
    shards = _shards(records, max_bytes)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    total = 0
    it = list(zip(names, shards))
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc="exporting", unit="shard", leave=False)
    for fname, shard in it:
        write_file(tmp / fname, shard, metadata={"format": "pt"})
        total += sum(r.nbytes for r in shard)
    if n > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": dict(sorted((r.name, f) for f, s in zip(names, shards) for r in s))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total

"""Export a quantized model as an HF checkpoint in AMD Quark's layout (``export_hf``), and read such checkpoints.

``export_hf(model, directory)`` writes ``config.json`` (the model's config with Quark's ``quantization_config``),
``generation_config.json``, the tokenizer (when given) and the weights as safetensors: each quantized layer's
real low-bit codes and scales in Quark's tensor names, dtypes, shapes and packing (``qcore.formats.quark_layout``),
every other tensor as it is in the model. vLLM's Quark loader and transformers with amd-quark read it
(``quant_method: "quark"``).

Formats Quark has no tensor layout for (MX9/MX6/MX4, BFP16, MXINT8, int2/int3, groups that do not divide the
row, quantized conv and embedding weights, ...) are written in qcore's extension of the layout and the checkpoint
says ``quant_method: "qcore"``: transformers and vLLM without qcore refuse it instead of misreading it, and
``qcore.adapters.from_pretrained`` (or ``AutoModelForCausalLM.from_pretrained`` after ``import qcore.adapters``)
loads it. Either kind also carries qcore's own config (``quantization_config["qcore"]``).

Guarantees: safetensors only (never pickle); the export is atomic (written into a temporary sibling directory
renamed into place at the end: an error or Ctrl-C leaves the destination as it was) and deterministic (the same
model and config give byte-identical files); tensors are converted and written one at a time, in shards of at
most ``max_shard_size`` bytes with an index file, so peak memory does not grow with the model.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Optional, Union

import numpy as np
import torch
from torch import nn

import qcore
from qcore._fsutil import check_not_source, model_sources, staged_dir
from qcore.formats import quark_layout as L
from qcore.formats.safetensors_io import TensorRecord, write_file

from .config import ModelConfig
from .modules import QuantExperts, QuantLinear, _QuantMixin

__all__ = ["export_hf", "ExportInfo", "parse_size", "QCORE_FORMAT_VERSION"]

QCORE_FORMAT_VERSION = 1

_TORCH_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
             torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


@dataclass(frozen=True)
class ExportInfo:
    """What ``export_hf`` wrote."""

    directory: str
    quant_method: str
    files: tuple
    bytes_on_disk: int
    layers: dict = field(default_factory=dict)  # module name -> layout


def parse_size(size: Union[int, str]) -> int:
    """``5GB``, ``500MB``, ``2GiB``, ``1000000`` -> bytes (decimal units as transformers reads them)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    if not isinstance(size, str):
        raise TypeError(f"max_shard_size must be an int or a string like '5GB', got {type(size).__name__}")
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
    raise ValueError(f"max_shard_size {size!r} is not a size; expected e.g. '5GB', '500MB', '2GiB' or a byte count")


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16):
        return t.view(torch.uint8 if t.element_size() == 1 else torch.int16).numpy()
    return t.numpy()


def weight_parts(m: _QuantMixin) -> tuple[L.WeightParts, tuple]:
    """The qcore parts of a quantized module's weight (canonical layout) and the canonical shape; frozen or not
    (a fake-quantized weight is quantized again with its own scales, exactly as ``freeze`` does, nothing
    changes)."""
    spec = m.specs["weight"]
    if m.frozen:
        shape = m.weight_shape
        codes = qcore.packing.unpack(m.weight_packed.cpu(), spec.dtype, axis=-1, length=shape[-1])
        sc = m.weight_scale.cpu()
        scales = sc.float() if sc.dtype == torch.float32 else qcore.decode(sc, spec.scale_dtype)
        stored = m.scales("weight")
        zp, sh, ts = stored.zero_point, stored.subblock_shifts, stored.tensor_scale
        return L.WeightParts(codes=_np(codes), scales=_np(scales.float()),
                             zero_points=None if zp is None else _np(zp.float()), shifts=None if sh is None else _np(sh),
                             tensor_scale=None if ts is None else _np(ts.float())), shape
    w = m.effective("weight", canonical=True)
    wc = w.float().cpu()
    kw: dict[str, Any] = {"scale": m.weight_scale.cpu()}
    if not spec.symmetric:
        kw["zero_point"] = m.weight_zero_point.cpu()
    if spec.two_level:
        kw["tensor_scale"] = m.weight_tensor_scale.cpu()
    q = qcore.quantize(wc, spec, **kw)
    back = qcore.dequantize(q).to(w.dtype)
    if not torch.equal(back, wc.to(w.dtype)):
        raise RuntimeError(f"export {m.qname!r}: the weight is not on its quantization grid (was it changed after "
                           f"quantize_model without a forward?); run a forward or freeze the model first")
    return L.WeightParts(codes=_np(q.codes), scales=_np(q.scales), zero_points=None if q.zero_points is None
                         else _np(q.zero_points), shifts=None if q.subblock_shifts is None else _np(q.subblock_shifts),
                         tensor_scale=None if q.tensor_scale is None else _np(q.tensor_scale)), tuple(wc.shape)


def canonical_shape(m: _QuantMixin) -> tuple:
    """The shape of a quantized module's weight in the canonical ``[out, in, *kernel]`` layout, frozen or not."""
    if isinstance(m, QuantExperts):  # [E, 2I, H]: each expert's Linears are [I, H] (gate, up) and [H, I]
        return m.expert_shape("gate_up_proj")
    return m.weight_shape


def module_layout(m: _QuantMixin) -> str:
    if isinstance(m, QuantExperts):
        from .experts import experts_layout
        return experts_layout(m.specs["weight"], {p: m.expert_shape(p) for p in ("gate_up_proj", "down_proj")})
    return L.weight_layout(m.specs["weight"], canonical_shape(m), module="Linear" if type(m) is QuantLinear
                           else "other")


def _activation_records(m: _QuantMixin, layout: str) -> dict:
    out = {}
    for role in m.static_roles():
        if not m.is_calibrated(role):
            raise ValueError(f"export {m.qname!r}: static {role} scales are not calibrated; run quantize_model "
                             f"with calibration data before exporting")
        spec = m.specs[role]
        b = m.scales(role)
        out.update(L.activation_tensors(
            role, spec, scale=None if spec.two_level else _np(b.scale.float()),
            zero_point=None if b.zero_point is None else _np(b.zero_point.float()),
            tensor_scale=_np(b.tensor_scale.float()) if spec.two_level else None, layout=layout))
    return out


def _record(name: str, dtype: str, arr_fn, shape: tuple) -> TensorRecord:
    return TensorRecord(name, dtype, tuple(int(d) for d in shape), lambda: np.ascontiguousarray(arr_fn()).tobytes())


def _tensor_record(name: str, t: torch.Tensor) -> TensorRecord:
    if t.dtype not in _TORCH_ST:
        raise TypeError(f"export: tensor {name!r} has dtype {t.dtype}, which safetensors cannot hold")
    return _record(name, _TORCH_ST[t.dtype], lambda: _np(t), tuple(t.shape))


def module_records(name: str, m: _QuantMixin, layout: str, cache: dict, pack_method: str = "reorder"
                   ) -> list[TensorRecord]:
    """One quantized module's tensors in the checkpoint (weight codes and scales in ``layout``, calibrated
    activation scales, bias), as lazy records; ``cache`` holds one module's encoded weight at a time."""
    prefix = f"{name}."
    spec = m.specs["weight"]
    records: list[TensorRecord] = []
    for suffix, (dt, shp) in L.expected_weight(spec, canonical_shape(m), layout=layout).items():
        def arr(m=m, suffix=suffix, layout=layout, spec=spec):
            if cache.get("module") is not m:  # one module's encoded tensors at a time (written together)
                cache.clear()
                cache["enc"] = L.encode_weight(weight_parts(m)[0], spec, layout=layout, pack_method=pack_method)
                cache["module"] = m
            return cache["enc"][suffix][1]
        records.append(_record(prefix + suffix, dt, arr, shp))
    for n, (dt, a) in _activation_records(m, layout).items():
        records.append(_record(prefix + n, dt, lambda a=a: a, a.shape))
    bias = m._parameters.get("bias")
    if bias is not None:
        if "bias" in m.specs:  # the fake-quantized bias the model computes with, as floats
            records.append(_tensor_record(prefix + "bias", m.effective("bias")))
        else:
            records.append(_tensor_record(prefix + "bias", bias))
    return records


def _plan_tensors(model: nn.Module, pack_method: str = "reorder") -> tuple[list[TensorRecord], dict[str, str]]:
    """Every tensor to write, as lazy records (nothing converted yet), and the layout of each quantized module.
    Order (it decides the shards): the quantized modules' tensors in module order, then every other tensor of
    the state dict in its order (a tied weight once)."""
    mods = {n: m for n, m in model.named_modules() if isinstance(m, _QuantMixin)}
    layouts = {n: module_layout(m) for n, m in mods.items()}
    records: list[TensorRecord] = []
    owned: set[str] = set()
    cache: dict = {}
    for name, m in mods.items():
        prefix = f"{name}."
        keys = [prefix + k for k in m.state_dict().keys()]
        owned.update(k for k in keys if "." not in k[len(prefix):])
        if isinstance(m, QuantExperts):  # per-expert Linears, under the family's checkpoint names
            from .experts import experts_records
            records.extend(experts_records(model, name, m, layouts[name], pack_method))
            continue
        records.extend(module_records(name, m, layouts[name], cache, pack_method))
    seen: dict[tuple, str] = {}
    from .experts import float_experts_records, float_experts_split
    split = float_experts_split(model)  # float fused experts: per expert, as the family's checkpoints hold them
    for k, t in model.state_dict(keep_vars=True).items():
        if k in owned or t is None:
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:  # a tied weight: written once, as save_pretrained does
            continue
        seen[key] = k
        records.extend(float_experts_records(model, k, t, split[k]) if k in split else [_tensor_record(k, t.detach())])
    return records, layouts


def _online_rotations(model: nn.Module, config: ModelConfig) -> bool:
    """Whether the model carries online rotations; ValueError if they are not what its config's rotation says
    (a loader re-installs them from the config)."""
    from qcore.algorithms.config import parse_algorithms, split_rotation
    from .rotation import input_rotations, online_plan
    have = {n: (h.size, h.key) for n, h in input_rotations(model).items()}
    rot, _ = split_rotation(parse_algorithms(config.algorithms))
    want = {n: (h.size, h.key) for n, h in online_plan(model, rot).items()} if rot is not None else {}
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


def export_units(model: nn.Module, config: ModelConfig) -> list[ExportUnit]:
    """The quantized modules of ``model`` as they are, or, for a model not quantized yet, as ``quantize_model``
    would make them from ``config`` (``plan_model``): what the exporters' up-front checks (``check_hf``,
    ``check_gguf``, ``check_onnx``, ``check_ct``) look at, before any evaluation or quantization."""
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, _QuantMixin)]
    if mods:
        return [ExportUnit(n, "Experts" if isinstance(m, QuantExperts) else m.float_type.__name__,
                           canonical_shape(m), m.qconfig) for n, m in mods]
    from .quantizer import plan_model
    out = []
    for p in plan_model(model, config):
        w = getattr(model.get_submodule(p.name), "weight" if p.type != "Experts" else "gate_up_proj", None)
        shape = tuple(w.shape) if w is not None else ()
        if p.type in ("ConvTranspose2d", "Conv1D") and len(shape) >= 2:  # stored [in, out, ...]
            shape = (shape[1], shape[0], *shape[2:])
        out.append(ExportUnit(p.name, p.type, shape, p.config))
    return out


def refuse_conv1d(model: nn.Module, config: Optional[ModelConfig], who: str) -> None:
    """Before any work: ValueError naming the first module that is (or, for a float model and ``config``, will be)
    a quantized transformers ``Conv1D`` (GPT-2's projections): ``who`` (the GGUF, ONNX and compressed-tensors
    exporters and their up-front checks) has no writer for them yet (issue 22); ``export_hf`` writes them."""
    names = [n for n, m in model.named_modules()
             if isinstance(m, _QuantMixin) and type(m).__bases__[1].__name__ == "Conv1D"]
    if not names and isinstance(config, ModelConfig) and not any(isinstance(m, _QuantMixin) for m in model.modules()) \
            and any(type(m).__name__ == "Conv1D" for m in model.modules()):  # models without one: not planned here
        names = [u.name for u in export_units(model, config) if u.type == "Conv1D"]
    if names:
        raise ValueError(conv1d_error(who, names))


def conv1d_error(who: str, names: list) -> str:
    """The refusal of an exporter with no writer for quantized transformers ``Conv1D`` modules (``names``)."""
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return (f"{who}: {names[0]!r}{more} is a quantized transformers Conv1D (GPT-2's attention and MLP "
            f"projections); this format has no writer for it yet (issue 22). export_hf writes it "
            f"(qcore.adapters.from_pretrained loads it); or exclude these modules from the config to keep them float")


def will_rotate_online(model: nn.Module, config: ModelConfig) -> bool:
    """Whether the model carries (or, quantized with ``config``, will carry) online rotations."""
    from .rotation import input_rotations
    if input_rotations(model):
        return True
    from qcore.algorithms.config import parse_algorithms, split_rotation
    rot, _ = split_rotation(parse_algorithms(config.algorithms))
    if rot is None:
        return False
    from .rotation import online_plan
    return bool(online_plan(model, rot))


def _model_dtype_name(model: nn.Module) -> str:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")


def _quark_part(config: ModelConfig, model_dtype: str, quark_ok: bool) -> dict:
    """Quark's spelling of ``config`` (``{}`` where it has none and the checkpoint is written as ``"qcore"``);
    ValueError where Quark's layout is used but the config has no Quark spelling (e.g. MX E8M0 scales in a
    float16 model)."""
    try:
        return config.to_quark(model_dtype=model_dtype)
    except (ValueError, TypeError) as e:
        if quark_ok:
            raise ValueError(f"export: the config has no Quark spelling ({e}); Quark's loaders could not read the "
                             f"checkpoint") from None
        return {}


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


def check_hf(model: nn.Module, config: Optional[ModelConfig] = None) -> None:
    """Before any work: ValueError if ``export_hf`` would refuse ``model`` quantized with ``config`` (default
    ``model.qcore_config``), for reasons the config and the float model already decide (``qcore quantize
    --output`` calls it before the baseline evaluation; ``export_hf`` itself too)."""
    config = model_config(model, config, who="export_hf")
    units = [u for u in export_units(model, config) if u.config.weight is not None]
    layouts = [L.weight_layout(u.config.weight.spec, u.shape, module="Linear" if u.type == "Linear" else "other")
               if u.type != "Experts" else _experts_unit_layout(u) for u in units]
    quark_ok = all(v != "qcore" for v in layouts) and not will_rotate_online(model, config) and not any(
        u.type == "Experts" for u in units)  # quantized fused experts: quant_method "qcore" (see _quantization_config)
    _quark_part(config, _model_dtype_name(model), quark_ok)


def _experts_unit_layout(u: ExportUnit) -> str:
    """The layout of a fused experts unit's per-expert Linears (ValueError where qcore cannot write them yet)."""
    from .experts import experts_layout, split_problem
    from .modules import _norm_weight_granularity, _with_granularity
    e, o, i = u.shape
    spec = u.config.weight.spec
    spec = _with_granularity(spec, _norm_weight_granularity(spec.granularity, "experts", u.name, 2, (o, i)))
    shapes = {"gate_up_proj": (e, o, i), "down_proj": (e, i, o // 2)}
    problem = split_problem(spec, shapes)
    if problem is not None:
        raise ValueError(f"export_hf: experts {u.name!r}: {problem}; not written yet (issue 22)")
    return experts_layout(spec, shapes)


def _quantization_config(model: nn.Module, config: ModelConfig, layouts: dict[str, str], pack_method: str) -> dict:
    # online rotations: Quark's and vLLM's loaders would not apply qcore's transforms; quant_method "qcore"
    quark_ok = all(v != "qcore" for v in layouts.values()) and not _online_rotations(model, config)
    # quantized fused MoE experts: transformers' Quark integration (amd-quark 0.13) does not read them (it merges the
    # per-expert codes into float parameters and drops their scales: checked), so qcore's loader is their reader
    quark_ok = quark_ok and not any(isinstance(m, QuantExperts) for m in model.modules())
    q = _quark_part(config, _model_dtype_name(model), quark_ok)
    if q:
        q["export"]["pack_method"] = pack_method
    q["quant_method"] = "quark" if quark_ok else "qcore"
    q["qcore"] = {"format_version": QCORE_FORMAT_VERSION, "qcore_version": qcore.__version__,
                  "config": config.to_dict(), "layouts": dict(sorted(layouts.items()))}
    return q


def _check_config_describes(model: nn.Module, config: ModelConfig) -> None:
    """The config written must give exactly the model's quantized modules (a loader rebuilds them from it)."""
    from .quantizer import plan_model
    want = {p.name: p.config for p in plan_model(model, config, _quantized_ok=True)}
    have = {n: m.qconfig for n, m in model.named_modules() if isinstance(m, _QuantMixin)}
    for name in sorted(set(want) | set(have)):
        if want.get(name) != have.get(name):
            got = "float" if name not in have else "quantized"
            raise ValueError(f"export: config does not describe the model: {name!r} is {got} in the model but the "
                             f"config gives {'float' if name not in want else repr(want[name])}; pass the config "
                             f"the model was quantized with")


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


def export_hf(model: nn.Module, directory: Union[str, os.PathLike], *, config: Optional[ModelConfig] = None,
              tokenizer: Any = None, overwrite: bool = False, max_shard_size: Union[int, str] = "5GB",
              pack_method: str = "reorder", progress: bool = False) -> ExportInfo:
    """Write ``model`` (quantized with ``quantize_model``; frozen or not) as an HF checkpoint in Quark's layout.

    config: the model's ``ModelConfig`` (default: the one ``quantize_model`` used, ``model.qcore_config``).
    tokenizer: saved alongside (``save_pretrained``) so the directory is a complete model.
    overwrite: replace an existing non-empty ``directory`` (else ``FileExistsError``, before any work). A directory
        that is, contains or lies inside where the model was loaded from is refused either way (ValueError; docs/
        export.md, "What writers guarantee").
    max_shard_size: largest shard in bytes (int) or ``"5GB"``-style; several shards get an index file.
    pack_method: int4 nibble order, ``"reorder"`` (Quark's default) or ``"order"``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if pack_method not in L.PACK_METHODS:
        raise ValueError(f"pack_method must be one of {sorted(L.PACK_METHODS)}, got {pack_method!r}")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {overwrite!r}")
    max_bytes = parse_size(max_shard_size)
    config = model_config(model, config, who="export_hf")
    if not any(isinstance(m, _QuantMixin) for m in model.modules()):
        raise ValueError("export_hf: the model has no qcore quantized modules; run quantize_model first")
    weightless = [n for n, m in model.named_modules() if isinstance(m, _QuantMixin) and "weight" not in m.specs]
    if weightless:  # before any work: the layouts are the weights' (a KV-cache-only / activation-only config)
        raise ValueError(weightless_error("export_hf", weightless))
    hf_config = getattr(model, "config", None)
    if hf_config is None or not hasattr(hf_config, "to_dict"):
        raise TypeError("export_hf: the model has no transformers config (model.config); only transformers models "
                        "can be written as HF checkpoints")
    directory = pathlib.Path(directory)
    check_destination(directory, overwrite, model_sources(model))
    _check_config_describes(model, config)
    check_hf(model, config)

    records, layouts = _plan_tensors(model, pack_method)
    qdict = _quantization_config(model, config, layouts, pack_method)

    write_checkpoint(directory, model, hf_config, qdict, records, tokenizer=tokenizer, overwrite=overwrite,
                     max_bytes=max_bytes, progress=progress)
    return _info(directory, qdict, layouts)


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


def _info(directory: pathlib.Path, qdict: dict, layouts: dict) -> ExportInfo:
    files = tuple(sorted(p.name for p in directory.iterdir()))
    size = sum((directory / f).stat().st_size for f in files)
    return ExportInfo(str(directory), qdict["quant_method"], files, size, layouts)


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


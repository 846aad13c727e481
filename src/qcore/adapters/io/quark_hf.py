"""Export a quantized model as an HF checkpoint in AMD Quark's layout (``export_hf``), and read such checkpoints.

``export_hf(model, directory)`` writes ``config.json`` (the model's config with Quark's ``quantization_config``),
``generation_config.json``, the tokenizer (when given) and the weights as safetensors: each quantized layer's
real low-bit codes and scales in Quark's tensor names, dtypes, shapes and packing (``qcore.formats.quark_layout``),
every other tensor as it is in the model. vLLM's Quark loader and transformers with amd-quark read it
(``quant_method: "quark"``).

Formats Quark has no tensor layout for (MX9/MX6/MX4, BFP16, MXINT8, int2/int3, groups that do not divide the
row, quantized conv and embedding weights, GPT-2's ``Conv1D``, ...), online rotations and quantized fused MoE
experts make the checkpoint ``quant_method: "qcore"`` (``checkpoint_method``, decided before any tensor is
written), and then EVERY quantized weight in it is written in qcore's extension of the layout (the 1-D byte string
of the packed codes), those Quark has a layout for included: vLLM refuses the unknown method, but transformers
without qcore skips it with only a warning and loads the checkpoint as a float one, so a tensor with a float
parameter's name and shape (int8 / fp8 codes in Quark's ``[out, in]`` layout, e.g. a Mixtral's per-expert
Linears) would load as a float weight, silently wrong; 1-D codes match no float weight's shape, so it fails
instead (tests/adapters/io/test_qcore_layout_unreadable.py, tests/interop/test_family_interop.py).
``quantization_config`` refuses a ``"qcore"`` checkpoint that would hold a Quark layout (a qcore bug). Exports
written before this rule (format_version 1 as well: some "qcore" checkpoints held Quark-layout experts or Linears)
still load: the loader reads a layer in the layout ``qcore.layouts`` states when it is qcore's or the one the
config gives (``own_layout``). ``import qcore.adapters`` registers the method, and
``qcore.adapters.from_pretrained`` (or ``AutoModelForCausalLM.from_pretrained`` after ``import qcore.adapters``)
loads it. Either kind also carries qcore's own config (``quantization_config["qcore"]``).

Guarantees: safetensors only (never pickle); the export is atomic (written into a temporary sibling directory
renamed into place at the end: an error or Ctrl-C leaves the destination as it was) and deterministic (the same
model and config give byte-identical files); tensors are converted and written one at a time, in shards of at
most ``max_shard_size`` bytes with an index file, so peak memory does not grow with the model.

Loading quantized checkpoints into qcore's modules through transformers (no amd-quark needed).

- ``from_pretrained(directory)`` loads a checkpoint written by ``export_hf`` or by AMD Quark itself
  (``quant_method`` ``"quark"`` or ``"qcore"``): the model's quantized Linears become frozen qcore modules
  (packed codes + scales, dequantized in the forward), with logits identical to the in-memory frozen model.
  ``load_quark`` is the same function, named for Quark-written checkpoints.
- ``import qcore.adapters`` registers the quantization method ``"qcore"`` with transformers' public plug-in API
  (``register_quantization_config`` / ``register_quantizer``), so ``AutoModelForCausalLM.from_pretrained(d)``
  loads checkpoints whose ``quant_method`` is ``"qcore"`` too. ``"quark"`` stays transformers' own (it needs
  amd-quark): qcore never replaces it; ``from_pretrained`` here routes a Quark checkpoint to qcore explicitly.

Loading checks every tensor against the config before any weight is read: names, dtypes and shapes (from the
safetensors headers; a truncated or corrupted file fails here), then the values (scales finite and positive,
e8m0 NaN codes, zero points in range); errors name the tensor and the layer.

What every format's writer and loader shares (up-front checks, ``weight_parts``, reading a checkpoint directory)
is in ``qcore.adapters.io.common``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn

import qcore
from qcore._fsutil import model_sources
from qcore.algorithms.config import SVDQuantConfig, split_rotation
from qcore.formats import quark_layout as L
from qcore.formats.inspect import checkpoint_files
from qcore.formats.safetensors_io import TensorRecord, CorruptCheckpointError, SafetensorsFile

from .records import ST_TORCH, TORCH_ST, to_numpy, record, tensor_record, untied_state  # noqa: F401
from .common import (QCORE_FORMAT_VERSION, canonical_shape, check_config_describes, check_destination,
                     check_format_version, export_units, ExportUnit, hf_config, model_class, model_config,
                     online_rotations, parse_size, read_config, unexpected_keys, weight_parts,
                     weightless_error, will_rotate_online, write_checkpoint)
from .experts import (ExpertsShell, check_split_experts, drop_expert_converters, exclude_float_experts,
                      experts_layout, experts_records, float_experts_records, float_experts_split, split_problem,
                      stored_float_experts)
from ..config import ModelConfig
from ..modules import (QUANT_CLASSES, QuantExperts, QuantLinear, QuantModule, install_online,
                       low_rank_modules, weight_granularity, with_granularity)
from ..batches import set_module
from .._device import check_device
from ..plan import plan_model

__all__ = ['export_hf', 'ExportInfo', 'from_pretrained', 'load_quark', 'register_with_transformers',
           'CorruptCheckpointError']


# ---------------------------------------------------------------------------------------------------------------
# export (formerly export.py)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportInfo:
    """What ``export_hf`` wrote."""

    directory: str
    quant_method: str
    files: tuple
    bytes_on_disk: int
    layers: dict = field(default_factory=dict)  # module name -> layout


def module_layout(m: QuantModule) -> str:
    if isinstance(m, QuantExperts):
        return experts_layout(m.specs["weight"], {p: m.expert_shape(p) for p in ("gate_up_proj", "down_proj")})
    return L.weight_layout(m.specs["weight"], canonical_shape(m), module="Linear" if type(m) is QuantLinear
                           else "other")


def _activation_records(m: QuantModule, layout: str) -> dict:
    out = {}
    for role in m.static_roles():
        if not m.is_calibrated(role):
            raise ValueError(f"export {m.qname!r}: static {role} scales are not calibrated; run quantize_model "
                             f"with calibration data before exporting")
        spec = m.specs[role]
        b = m.scales(role)
        out.update(L.activation_tensors(
            role, spec, scale=None if spec.two_level else to_numpy(b.scale.float()),
            zero_point=None if b.zero_point is None else to_numpy(b.zero_point.float()),
            tensor_scale=to_numpy(b.tensor_scale.float()) if spec.two_level else None, layout=layout))
    return out


def module_records(name: str, m: QuantModule, layout: str, cache: dict, pack_method: str = "reorder"
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
        records.append(record(prefix + suffix, dt, arr, shp))
    for n, (dt, a) in _activation_records(m, layout).items():
        records.append(record(prefix + n, dt, lambda a=a: a, a.shape))
    records.extend(_branch_records(prefix, m))
    bias = m._parameters.get("bias")
    if bias is not None:
        if "bias" in m.specs:  # the fake-quantized bias the model computes with, as floats
            records.append(tensor_record(prefix + "bias", m.effective("bias")))
        else:
            records.append(tensor_record(prefix + "bias", bias))
    return records


#: SVDQuant's branch in a checkpoint: qcore's names (Quark 0.13 has no export layout for it: its
#: ErrorCorrectedModule's correction.l1 / l2 stay in memory), float32, only in ``quant_method: "qcore"`` checkpoints
BRANCH_TENSORS = ("lowrank_down", "lowrank_up", "input_smoothing")


def _branch_records(prefix: str, m: nn.Module) -> list[TensorRecord]:
    br = getattr(m, "low_rank_branch", None)
    if br is None:
        return []
    out = [tensor_record(prefix + "lowrank_down", br.down.detach().float()),
           tensor_record(prefix + "lowrank_up", br.up.detach().float())]
    if br.smoothing is not None:
        out.append(tensor_record(prefix + "input_smoothing", br.smoothing.detach().float()))
    return out


def branch_shapes(model: nn.Module) -> dict:
    """``{module name: [rank, smoothing kept in the module]}`` of the modules carrying SVDQuant's branch (the
    ``quantization_config.qcore.low_rank`` entry a loader rebuilds them from)."""
    out = {}
    for n, m in model.named_modules():
        br = getattr(m, "low_rank_branch", None)
        if isinstance(m, QuantLinear) and br is not None:
            out[n] = [int(br.down.shape[0]), br.smoothing is not None]
    return out


def plan_tensors(model: nn.Module, pack_method: str = "reorder", *, own: bool = False
                  ) -> tuple[list[TensorRecord], dict[str, str]]:
    """Every tensor to write, as lazy records (nothing converted yet), and the layout of each quantized module:
    Quark's where it has one, or, with ``own`` (a ``quant_method: "qcore"`` checkpoint: ``checkpoint_method``),
    qcore's extension for every quantized module. Order (it decides the shards): the quantized modules' tensors
    in module order, then every other tensor of the state dict in its order (a tied weight once)."""
    mods = {n: m for n, m in model.named_modules() if isinstance(m, QuantModule)}
    layouts = {n: "qcore" if own else module_layout(m) for n, m in mods.items()}
    records: list[TensorRecord] = []
    owned: set[str] = set()
    cache: dict = {}
    for name, m in mods.items():
        prefix = f"{name}."
        keys = [prefix + k for k in m.state_dict().keys()]
        owned.update(k for k in keys if "." not in k[len(prefix):])
        if isinstance(m, QuantExperts):  # per-expert Linears, under the family's checkpoint names
            records.extend(experts_records(model, name, m, layouts[name], pack_method))
            continue
        records.extend(module_records(name, m, layouts[name], cache, pack_method))
    split = float_experts_split(model)  # float fused experts: per expert, as the family's checkpoints hold them
    for k, t in untied_state(model, owned):  # a tied weight: written once, as save_pretrained does
        records.extend(float_experts_records(model, k, t, split[k]) if k in split else [tensor_record(k, t.detach())])
    return records, layouts


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


def check_hf(model: nn.Module, config: Optional[ModelConfig] = None, *, plans=None) -> None:
    """Before any work: ValueError if ``export_hf`` would refuse ``model`` quantized with ``config`` (default
    ``model.qcore_config``), for reasons the config and the float model already decide (``qcore quantize
    --output`` calls it before the baseline evaluation, with its ``plans``; ``export_hf`` itself too)."""
    config = model_config(model, config, who="export_hf")
    _quark_part(config, _model_dtype_name(model), checkpoint_method(model, config, plans=plans) == "quark")


def checkpoint_method(model: nn.Module, config: ModelConfig, *, plans=None) -> str:
    """The ``quant_method`` of ``model``'s HF checkpoint (quantized, or a float model to be quantized with
    ``config``), decided before any tensor is written: ``"quark"`` when Quark has a tensor layout for every
    quantized module's weight and the model carries no online rotations and no quantized fused MoE experts, else
    ``"qcore"``. A ``"qcore"`` checkpoint stores EVERY quantized weight in qcore's extension (1-D packed codes),
    so that no tensor in it has the name and shape of a float parameter: transformers without qcore skips an
    unknown ``quant_method`` with a warning only, and must then fail on the shapes instead of loading codes as
    floats."""
    units = [u for u in export_units(model, config, plans=plans) if u.config.weight is not None]
    layouts = [L.weight_layout(u.config.weight.spec, u.shape, module="Linear" if u.type == "Linear" else "other")
               if u.type != "Experts" else _experts_unit_layout(u) for u in units]
    quark_ok = all(v != "qcore" for v in layouts) and not will_rotate_online(model, config) and not any(
        u.type == "Experts" for u in units)  # quantized fused experts: quant_method "qcore" (see quantization_config)
    quark_ok = quark_ok and not _low_rank(model, config)  # SVDQuant's branch: no Quark layout (BRANCH_TENSORS)
    return "quark" if quark_ok else "qcore"


def _low_rank(model: nn.Module, config: ModelConfig) -> bool:
    """Whether the model carries (or, quantized with ``config``, will carry) SVDQuant's low-rank branches."""
    return bool(low_rank_modules(model)) or any(isinstance(a, SVDQuantConfig) for a in config.algorithms)


def _experts_unit_layout(u: ExportUnit) -> str:
    """The layout of a fused experts unit's per-expert Linears (ValueError where qcore cannot write them yet)."""
    e, o, i = u.shape
    spec = u.config.weight.spec
    if spec.gguf:
        raise ValueError(f"export_hf: experts {u.name!r}: their weights are GGUF {spec.gguf} (float block offsets "
                         f"and super-block scales), which only GGUF files hold; export them with export_gguf, or "
                         f"quantize the float model with another spec for this format")
    spec = with_granularity(spec, weight_granularity(spec.granularity, "experts", u.name, 2, (o, i)))
    shapes = {"gate_up_proj": (e, o, i), "down_proj": (e, i, o // 2)}
    problem = split_problem(spec, shapes)
    if problem is not None:
        raise ValueError(f"export_hf: experts {u.name!r}: {problem}; not written yet (docs/adapters.md)")
    return experts_layout(spec, shapes)


def quantization_config(model: nn.Module, config: ModelConfig, layouts: dict[str, str], pack_method: str) -> dict:
    # online rotations: Quark's and vLLM's loaders would not apply qcore's transforms; quant_method "qcore"
    rotated = online_rotations(model, config)  # (ValueError where they are not the ones the config gives)
    quark_ok = all(v != "qcore" for v in layouts.values()) and not rotated
    # quantized fused MoE experts: transformers' Quark integration (amd-quark 0.13) does not read them (it merges the
    # per-expert codes into float parameters and drops their scales: checked), so qcore's loader is their reader
    quark_ok = quark_ok and not any(isinstance(m, QuantExperts) for m in model.modules())
    branches = branch_shapes(model)
    quark_ok = quark_ok and not branches  # SVDQuant's branch: a Quark loader would drop it silently
    mixed = sorted(n for n, v in layouts.items() if v != "qcore")
    if not quark_ok and mixed:  # a "qcore" checkpoint holds no Quark layout (checkpoint_method decides it up front)
        raise RuntimeError(f"export: quant_method 'qcore' but {mixed[0]!r} is planned in Quark's {layouts[mixed[0]]!r} "
                           f"layout, which a loader without qcore could read as float weights (a qcore bug; please "
                           f"report it)")
    q = _quark_part(config, _model_dtype_name(model), quark_ok)
    if q:
        q["export"]["pack_method"] = pack_method
    q["quant_method"] = "quark" if quark_ok else "qcore"
    q["qcore"] = {"format_version": QCORE_FORMAT_VERSION, "qcore_version": qcore.__version__,
                  "config": config.to_dict(), "layouts": dict(sorted(layouts.items()))}
    if branches:
        q["qcore"]["low_rank"] = dict(sorted(branches.items()))
    return q


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
    if not any(isinstance(m, QuantModule) for m in model.modules()):
        raise ValueError("export_hf: the model has no qcore quantized modules; run quantize_model first")
    weightless = [n for n, m in model.named_modules() if isinstance(m, QuantModule) and "weight" not in m.specs]
    if weightless:  # before any work: the layouts are the weights' (a KV-cache-only / activation-only config)
        raise ValueError(weightless_error("export_hf", weightless))
    hf_config = getattr(model, "config", None)
    if hf_config is None or not hasattr(hf_config, "to_dict"):
        raise TypeError("export_hf: the model has no transformers config (model.config); only transformers models "
                        "can be written as HF checkpoints")
    directory = pathlib.Path(directory)
    check_destination(directory, overwrite, model_sources(model))
    check_config_describes(model, config)
    check_hf(model, config)

    records, layouts = plan_tensors(model, pack_method, own=checkpoint_method(model, config) == "qcore")
    qdict = quantization_config(model, config, layouts, pack_method)

    write_checkpoint(directory, model, hf_config, qdict, records, tokenizer=tokenizer, overwrite=overwrite,
                     max_bytes=max_bytes, progress=progress)
    return export_info(directory, qdict, layouts)


def export_info(directory: pathlib.Path, qdict: dict, layouts: dict) -> ExportInfo:
    files = tuple(sorted(p.name for p in directory.iterdir()))
    size = sum((directory / f).stat().st_size for f in files)
    return ExportInfo(str(directory), qdict["quant_method"], files, size, layouts)


# ---------------------------------------------------------------------------------------------------------------
# import (formerly hf.py)
# ---------------------------------------------------------------------------------------------------------------

_OWN_KEYS = ("quant_method", "qcore", "source_method")
_QUARK_KEYS = ("global_quant_config", "layer_quant_config", "layer_type_quant_config", "kv_cache_quant_config",
               "exclude", "algo_config")


def checkpoint_config(raw: dict) -> ModelConfig:
    """The ``ModelConfig`` of a checkpoint's ``quantization_config``: qcore's own when present, else Quark's."""
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"quantization_config must be a JSON object, got {type(raw).__name__}")
    own = raw.get("qcore")
    if own is not None and not isinstance(own, dict):
        raise CorruptCheckpointError(f"quantization_config.qcore must be a JSON object, got {own!r}"[:300])
    check_format_version(own, "quantization_config")
    if isinstance(own, dict) and "config" in own:
        mine = ModelConfig.from_dict(own["config"])
        quark = raw.get("source_method", raw.get("quant_method")) == "quark"
        if quark or any(k in raw for k in _QUARK_KEYS):  # what Quark and vLLM read (or a reader of Quark's fields
            quark_part = {**{k: v for k, v in raw.items() if k not in _OWN_KEYS}, "quant_method": "quark"}  # and
            # the same: Quark's scale_type "float" is the model dtype the export wrote them in: equal for one of them
            # (read in that dtype too: float16 scales of a float16 model are "float" there)
            wheres = []
            for dt in ("float32", "bfloat16", "float16"):
                try:
                    theirs = ModelConfig.from_quark(quark_part, model_dtype=dt)
                    wheres.append(_first_difference(theirs.to_quark(model_dtype=dt), mine.to_quark(model_dtype=dt)))
                except ValueError:  # a config this dtype cannot spell (E8M0 scales in float16)
                    continue
            if not wheres:  # no model dtype spells the qcore block's config in Quark's terms (where a "qcore"
                if not quark:  # checkpoint then writes no Quark fields)
                    raise CorruptCheckpointError("quantization_config: Quark fields beside a qcore block whose "
                                                 "config has no Quark spelling")
                raise CorruptCheckpointError("quantization_config: quant_method 'quark', but the qcore block's "
                                             "config has no Quark spelling: Quark and vLLM would load another model "
                                             "than qcore")
            where = None if None in wheres else wheres[0]
            if where is not None:
                raise CorruptCheckpointError(f"quantization_config.{where} disagrees with the qcore block's config: "
                                             f"Quark and vLLM would load another model than qcore")
        return mine
    if raw.get("source_method", raw.get("quant_method")) not in ("quark", "qcore"):
        raise ValueError(f"quantization_config: quant_method {raw.get('quant_method')!r} is not 'quark' or 'qcore'")
    d = {k: v for k, v in raw.items() if k not in _OWN_KEYS}
    d["quant_method"] = "quark"
    return ModelConfig.from_quark(d)


def _first_difference(a: Any, b: Any, path: str = "") -> Optional[str]:
    """The dotted path of the first place two JSON-like values differ, or None when they are equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            where = _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else str(k))
            if where is not None:
                return where
        return None
    return None if a == b else (path or "(root)")


class _Shell(nn.Module):
    """Placeholder for one quantized module while transformers loads the checkpoint: parameters named, shaped and
    typed as the checkpoint stores them (on meta until loaded). ``own``: the weight is in qcore's extension
    (``"qcore"`` layout) whatever its format (``layer_layout``)."""

    def __init__(self, name: str, m: nn.Module, config, *, own: bool = False, branch: Optional[list] = None):
        super().__init__()
        q = QUANT_CLASSES[type(m)].from_module(m, config, name=name)  # on meta: planned here, filled in _build
        object.__setattr__(self, "_wrapper", q)  # not a submodule: its float weight is not in the checkpoint
        spec = q.specs["weight"]
        self.shape = q.weight_shape
        self.layout = "qcore" if own else L.weight_layout(spec, self.shape, module="Linear" if isinstance(m, nn.Linear)
                                                          else "other")
        self.expected = dict(L.expected_weight(spec, self.shape, layout=self.layout))
        for role in q.static_roles():
            self.expected.update(L.expected_activation(role, q.specs[role], q.static_scale_shape(role),
                                                       layout=self.layout))
        self.qname = name
        self.branch = None
        if branch is not None:  # SVDQuant's low-rank branch (quantization_config.qcore.low_rank): [rank, smoothing]
            if not isinstance(q, QuantLinear):
                raise CorruptCheckpointError(f"layer {name!r}: quantization_config.qcore.low_rank names it, but it is "
                                             f"a {type(m).__name__}; the branch is carried by Linears only")
            rank, smooth = branch
            n_out, n_in = q.weight_shape
            self.branch = {"lowrank_down": ("F32", (rank, n_in)), "lowrank_up": ("F32", (n_out, rank))}
            if smooth:
                self.branch["input_smoothing"] = ("F32", (n_in,))
            self.expected.update(self.branch)
        for n, (dt, shape) in self.expected.items():
            self.register_parameter(n, nn.Parameter(torch.empty(shape, dtype=ST_TORCH[dt], device="meta"),
                                                    requires_grad=False))
        if getattr(m, "bias", None) is not None:
            self.bias = m.bias


_FLOAT_ST = ("F32", "F16", "BF16")


def check_tensors(files: list, model: nn.Module, shells: dict[str, _Shell]) -> None:
    """The whole checkpoint against the model its config builds, from the safetensors headers (before any weight
    is read): every quantized module's tensors (names, dtypes, shapes of its layout), every other parameter and
    persistent buffer of the model present with its shape (float ones stored in one float dtype, the one the
    checkpoint's other float tensors use), and no tensor the config does not explain. A tensor the model needs
    and the file lacks would otherwise be left to random initialisation. Raises ``CorruptCheckpointError``
    naming the tensor (and its file)."""
    entries: dict = {}
    for f in files:
        st = SafetensorsFile(f)
        for k, e in st.entries.items():
            if k in entries:
                raise CorruptCheckpointError(f"tensor {k!r} is stored twice ({pathlib.Path(entries[k][1]).name} and "
                                             f"{pathlib.Path(f).name})")
            entries[k] = (e, f)
    if not entries:
        raise CorruptCheckpointError("the checkpoint has no safetensors files (qcore never loads pickled weights)")
    for name, sh in shells.items():
        for suffix, (dt, shape) in sh.expected.items():
            key = getattr(sh, "disk", {}).get(suffix, f"{name}.{suffix}")  # fused experts: the family's names
            if key not in entries:
                raise CorruptCheckpointError(f"layer {name!r}: tensor {key!r} is missing from the checkpoint "
                                             f"(layout {sh.layout!r} stores {sorted(sh.expected)})")
            e, f = entries[key]
            if e.dtype != dt or tuple(e.shape) != tuple(shape):
                raise CorruptCheckpointError(f"layer {name!r}: tensor {key!r} is {e.dtype} {list(e.shape)} in "
                                             f"{pathlib.Path(f).name}; the config ({sh.layout!r} layout) needs {dt} "
                                             f"{list(shape)}")
    quantized = {f"{n}.{s}" for n, sh in shells.items() for s in sh.expected}
    state = model.state_dict(keep_vars=True)
    groups: dict[int, list] = {}  # tied tensors (one object under several names) are stored once
    for k, t in state.items():
        if k not in quantized:
            groups.setdefault(id(t), []).append((k, t))
    floats = [entries[k][0].dtype for keys in groups.values() for k, t in keys
              if k in entries and t.is_floating_point()]
    want_float = max(set(floats), key=floats.count) if floats else None  # the checkpoint's float dtype
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})  # transformers' tied name -> its source
    split = {k: v for k, v in float_experts_split(model).items() if k not in entries}  # float fused experts stored
    for keys in groups.values():  # per expert (as save_pretrained writes them; transformers merges them on load)
        present = [(k, t) for k, t in keys if k in entries]
        if not present and all(tied.get(k) in entries for k, _ in keys):
            continue  # tied to a stored tensor (e.g. lm_head.weight to the token embedding): written once
        if not present and keys[0][0] in split:
            check_split_experts(keys[0][0], keys[0][1], split[keys[0][0]], entries, want_float)
            continue
        if not present:
            raise CorruptCheckpointError(f"tensor {keys[0][0]!r} of the model is missing from the checkpoint "
                                         f"(it would be left to random initialisation)")
        for k, t in present:
            e, f = entries[k]
            if t.is_floating_point():
                ok = e.dtype in _FLOAT_ST and e.dtype == want_float
                want = f"{want_float} (the checkpoint's float dtype)"
            else:
                want = TORCH_ST.get(t.dtype, str(t.dtype))
                ok = e.dtype == want
            if not ok or tuple(e.shape) != tuple(t.shape):
                raise CorruptCheckpointError(f"tensor {k!r} is {e.dtype} {list(e.shape)} in {pathlib.Path(f).name}; "
                                             f"the model needs {want} {list(t.shape)}")
    on_disk = {k for sh in shells.values() for k in getattr(sh, "disk", {}).values()}
    on_disk |= {d for parts in split.values() for d, _ in parts}
    extra = [k for k in unexpected_keys(model, entries) if k not in on_disk]
    if extra:
        raise CorruptCheckpointError(f"tensor {extra[0]!r} in {pathlib.Path(entries[extra[0]][1]).name} is not a "
                                     f"tensor of the model its config describes"
                                     f"{f' (and {len(extra) - 1} more: {extra[1:4]})' if len(extra) > 1 else ''}")


def _build(sh: _Shell, pack_method: str, dtype: torch.dtype) -> nn.Module:
    """The frozen qcore module of a loaded shell (validated values)."""
    if hasattr(sh, "build"):  # fused MoE experts (qcore.adapters.io.experts.ExpertsShell)
        return sh.build(pack_method, dtype)
    where = f"layer {sh.qname!r}"
    params = dict(sh.named_parameters(recurse=False))
    missing = [n for n in sh.expected if params[n].is_meta]
    if missing:
        raise CorruptCheckpointError(f"{where}: tensors {missing} were not loaded from the checkpoint")
    branch = getattr(sh, "branch", None) or {}
    arrays = {n: to_numpy(params[n]) for n in sh.expected if n not in branch}
    q, shape = sh._wrapper, sh.shape
    spec = q.specs["weight"]
    parts = L.decode_weight(arrays, spec, shape, layout=sh.layout, pack_method=pack_method, where=where)
    device = params["weight"].device
    q.load_frozen(parts, shape=shape, dtype=dtype, device=device)
    with torch.no_grad():
        if "bias" in q._parameters and q._parameters["bias"] is not None:
            q.load_bias(sh.bias)  # exported as the fake-quantized floats it computes with
        for role in q.static_roles():
            a = L.decode_activation(arrays, role, q.specs[role], where=where)
            if a["tensor_scale"] is not None:
                q.load_static_scales(role, tensor_scale=a["tensor_scale"], device=device)
            else:
                q.load_static_scales(role, scale=a["scale"], zero_point=a["zero_point"], device=device)
    if branch:
        vals = {n: params[n].detach() for n in branch}
        if not all(bool(torch.isfinite(v).all()) for v in vals.values()) or (
                "input_smoothing" in vals and not bool((vals["input_smoothing"] > 0).all())):
            raise CorruptCheckpointError(f"{where}: its low-rank branch holds NaN or Inf, or a smoothing scale <= 0")
        q.set_low_rank_branch(vals["lowrank_down"], vals["lowrank_up"], vals.get("input_smoothing"))
    left = [n for n, t in list(q.named_parameters()) + list(q.named_buffers()) if t is not None and t.is_meta]
    if left:
        raise RuntimeError(f"{where}: {left} stayed unloaded (a qcore bug; please report it)")
    return q


def own_layout(method: Any, stated: Optional[dict], name: str) -> bool:
    """Whether the checkpoint stores the quantized layer ``name`` in qcore's extension (``"qcore"`` layout) whatever
    its format: in a ``quant_method: "qcore"`` checkpoint, unless its ``qcore.layouts`` states another layout for
    the layer (earlier exports of the same ``format_version`` stored Quark-layout tensors in some "qcore"
    checkpoints: fused MoE experts, and Linears beside online rotations or qcore-only formats; they are read as
    their layouts say, and a stated layout must still be the one the config gives, see the caller). Never in a
    ``"quark"`` checkpoint."""
    if method != "qcore":
        return False
    return stated is None or stated.get(name, "qcore") == "qcore"


def _low_rank_entries(raw: dict, method: Any) -> dict:
    """``quantization_config.qcore.low_rank`` (SVDQuant's branches: ``{layer: [rank, smoothing kept]}``), checked;
    only in a ``"qcore"`` checkpoint."""
    own = raw.get("qcore") if isinstance(raw.get("qcore"), dict) else {}
    lr = own.get("low_rank")
    if lr is None:
        return {}
    if method != "qcore":
        raise CorruptCheckpointError("quantization_config: low-rank branches (qcore.low_rank) in a checkpoint whose "
                                     "quant_method is not 'qcore'")
    ok = isinstance(lr, dict) and all(
        isinstance(v, list) and len(v) == 2 and isinstance(v[0], int) and not isinstance(v[0], bool) and v[0] > 0
        and isinstance(v[1], bool) for v in lr.values())
    if not ok:
        raise CorruptCheckpointError(f"quantization_config.qcore.low_rank must map layer names to [rank, bool], got "
                                     f"{lr!r}"[:300])
    return dict(lr)


def _make_classes():
    from transformers.quantizers import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class QcoreHfConfig(QuantizationConfigMixin):
        """transformers' view of a qcore / Quark ``quantization_config`` (the dict is kept as it is)."""

        def __init__(self, **kwargs):
            self.raw = dict(kwargs)
            self.quant_method = "qcore"

        def to_dict(self) -> dict:
            d = dict(self.raw)
            d["quant_method"] = d.pop("source_method", d.get("quant_method", "qcore"))
            return d

        def to_diff_dict(self) -> dict:
            return self.to_dict()

    class QcoreHfQuantizer(HfQuantizer):
        """Swaps the planned modules for checkpoint-shaped placeholders before loading, and for frozen qcore
        modules after."""

        requires_calibration = True

        def __init__(self, quantization_config, **kwargs):
            super().__init__(quantization_config, **kwargs)
            self._shells: dict[str, _Shell] = {}

        def validate_environment(self, *args, **kwargs):
            return None

        def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
            raw = self.quantization_config.raw
            config = checkpoint_config(raw)
            export = raw.get("export") or {}
            if not isinstance(export, dict):
                raise CorruptCheckpointError(f"quantization_config.export must be a JSON object, got {export!r}"[:300])
            self.pack_method = export.get("pack_method", "reorder")
            if not isinstance(self.pack_method, str) or self.pack_method not in L.PACK_METHODS:
                raise CorruptCheckpointError(f"quantization_config.export.pack_method {self.pack_method!r} is not "
                                             f"one of {sorted(L.PACK_METHODS)}")
            stated = (raw.get("qcore") or {}).get("layouts") if isinstance(raw.get("qcore"), dict) else None
            if stated is not None and not (isinstance(stated, dict) and all(isinstance(v, str)
                                                                              for v in stated.values())):
                raise CorruptCheckpointError(f"quantization_config.qcore.layouts must map layer names to layout "
                                             f"names, got {stated!r}"[:300])
            self._float_experts = stored_float_experts(model, config, checkpoint_files)  # Quark 0.13's MoE exports
            method = raw.get("source_method", raw.get("quant_method"))
            low_rank = _low_rank_entries(raw, method)
            for p in plan_model(model, config, check_float=False):  # a saved config, as it was saved
                if p.name in self._float_experts:
                    continue
                own = own_layout(method, stated, p.name)
                if p.type == "Experts":
                    sh = ExpertsShell(model, p.name, model.get_submodule(p.name), p.config, own=own)
                else:
                    sh = _Shell(p.name, model.get_submodule(p.name), p.config, own=own,
                                branch=low_rank.pop(p.name, None))
                layout = sh.layout
                if stated is not None and stated.get(p.name, layout) != layout:
                    raise CorruptCheckpointError(f"layer {p.name!r}: the checkpoint says layout "
                                                 f"{stated[p.name]!r}, its config gives {layout!r}")
                if layout == "qcore" and raw.get("source_method", raw.get("quant_method")) == "quark":
                    raise CorruptCheckpointError(f"layer {p.name!r}: quant_method 'quark' but the config's format "
                                                 f"has no Quark tensor layout (a qcore extension checkpoint says "
                                                 f"quant_method 'qcore')")
                set_module(model, p.name, sh)
                self._shells[p.name] = sh
            if low_rank:
                raise CorruptCheckpointError(f"quantization_config.qcore.low_rank names {sorted(low_rank)[:3]}, which "
                                             f"the config does not quantize")
            if not checkpoint_files:
                raise CorruptCheckpointError("transformers found no checkpoint files to load")
            check_tensors(list(checkpoint_files), model, self._shells)
            return model

        def update_weight_conversions(self, weight_conversions, model):
            # quantized fused experts load per expert, as stored
            return super().update_weight_conversions(drop_expert_converters(weight_conversions, self._shells), model)

        def _process_model_after_weight_loading(self, model, **kwargs):
            shell = {id(p) for sh in self._shells.values() for p in sh.parameters()}
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point() and not p.is_meta
                          and id(p) not in shell  # checkpoint tensors (e.g. float16 scales), not the model's
                          and p.dtype in (torch.float32, torch.bfloat16, torch.float16)), torch.float32)
            for name, sh in self._shells.items():
                set_module(model, name, _build(sh, self.pack_method, dtype))
            self._shells = {}
            model.qcore_config = checkpoint_config(self.quantization_config.raw)
            if getattr(self, "_float_experts", None):  # fused experts the checkpoint stores float: excluded, by name
                model.qcore_config = exclude_float_experts(model, model.qcore_config, self._float_experts)
            rot, _ = split_rotation(model.qcore_config.algorithms)
            if rot is not None and rot.online:  # the online transforms of the rotated weights (QuaRot / SpinQuant)
                own = _own_rotation(model.qcore_config)
                if not own:
                    raise CorruptCheckpointError(
                        f"quantization_config.algo_config: Quark's rotation with online transforms "
                        f"({list(rot.online)}) uses Quark's own Hadamard tables, which qcore does not reproduce; "
                        f"load this checkpoint with amd-quark")
                install_online(model, rot)
            return model

        def is_serializable(self):
            return False

        @property
        def is_trainable(self):
            return False

    return QcoreHfConfig, QcoreHfQuantizer


_registered: dict = {}

#: loggers of optional libraries that print on import: torchao's "Failed to load ... _C_mxfp8 ... .so" (its CUDA
#: extensions, missing on CPU-only machines) and torch's pytree "register_constant() on Enum subclasses is
#: deprecated" (torchao registering its enums); neither concerns qcore, and they would print on every command
_NOISY_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_optional_imports():
    """Within the block, the loggers in ``_NOISY_IMPORT_LOGGERS`` show errors only (their levels are put back
    after it; nothing global changes, and later messages of those libraries show as usual)."""
    loggers = [logging.getLogger(n) for n in _NOISY_IMPORT_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _own_rotation(config: ModelConfig) -> bool:
    """Whether the rotation of a checkpoint's config is qcore's (its entry named ``qcore_rotation``, ``quarot`` or
    ``spinquant``, or a config read from qcore's own block), not Quark's ``rotation`` with its own Hadamard tables."""
    if config.origin is None:  # qcore's block of the checkpoint
        return True
    entries = config.origin.get("algo_config") or ()
    entries = [entries] if isinstance(entries, dict) else entries
    return any(isinstance(a, dict) and a.get("name") in ("qcore_rotation", "quarot", "spinquant") for a in entries)


def register_with_transformers() -> bool:
    """Register quant_method ``"qcore"`` with transformers (idempotent); False when transformers is absent."""
    if "config" in _registered:
        return True
    try:
        with quiet_optional_imports():  # transformers.quantizers imports torchao when it is installed
            from transformers.quantizers import auto
    except ImportError:
        return False
    cfg_cls, q_cls = _make_classes()
    if "qcore" in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:  # registered by an earlier import (e.g. a reload)
        cfg_cls = auto.AUTO_QUANTIZATION_CONFIG_MAPPING["qcore"]
    else:
        auto.register_quantization_config("qcore")(cfg_cls)
    if "qcore" not in auto.AUTO_QUANTIZER_MAPPING:
        auto.register_quantizer("qcore")(q_cls)
    _registered["config"] = cfg_cls
    return True


def __getattr__(name):
    if name == "QcoreHfConfig":
        register_with_transformers()
        return _registered["config"]
    raise AttributeError(name)


def from_pretrained(directory, *, dtype: Optional[torch.dtype] = None, device_map: Any = None, **kwargs):
    """Load a quantized checkpoint (``quant_method`` ``"quark"`` or ``"qcore"``) from a local directory into qcore's
    frozen modules (``qcore.adapters.from_pretrained``, ``qcore.adapters.io.from_pretrained``, also takes
    compressed-tensors checkpoints).
    ``dtype`` is the float dtype of the rest of the model (default: the checkpoint's). Extra keyword arguments go
    to the model class's ``from_pretrained`` (``model_class``)."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"from_pretrained: directory must be a str or os.PathLike, got {type(directory).__name__}")
    _check_device_map(device_map)
    register_with_transformers()
    d = pathlib.Path(directory)
    _, raw = read_config(d)
    if not isinstance(raw, dict) or raw.get("quant_method") not in ("quark", "qcore"):
        got = None if not isinstance(raw, dict) else raw.get("quant_method")
        raise ValueError(f"{str(d)!r}: quantization_config.quant_method is {got!r}; qcore loads 'quark' and 'qcore' "
                         f"checkpoints (a float model loads with AutoModelForCausalLM.from_pretrained)")
    try:
        checkpoint_config(raw)  # the quantization config, checked before any file is read
    except (ValueError, TypeError) as e:
        raise CorruptCheckpointError(f"{str(d / 'config.json')!r}: {e}") from None
    for f in checkpoint_files(d):  # headers first: a truncated or corrupted file fails here, naming the tensor
        SafetensorsFile(f)
    config = hf_config(d)
    config.quantization_config = dict(raw, quant_method="qcore", source_method=raw["quant_method"])
    kw = dict(config=config, local_files_only=True, use_safetensors=True)
    if dtype is not None:
        kw["dtype"] = dtype
    if device_map is not None:
        kw["device_map"] = device_map
    kw.update(kwargs)
    try:
        return model_class(config).from_pretrained(d, **kw).eval()
    except CorruptCheckpointError as e:  # raised by check_tensors / _build: name the checkpoint too
        raise CorruptCheckpointError.naming(d, e) from None


def _check_device_map(device_map: Any) -> None:
    """A ``device_map`` naming devices (a device, an index, or a dict of them) names ones this machine has
    (``ValueError`` before any file is read); accelerate's strategies ("auto", ...) are left to it."""
    values = list(device_map.values()) if isinstance(device_map, dict) else [device_map]
    for v in values:
        if isinstance(v, bool) or v is None or v in ("auto", "balanced", "balanced_low_0", "sequential", "disk"):
            continue
        if isinstance(v, int):
            v = f"cuda:{v}"
        if isinstance(v, (str, torch.device)):
            check_device(v, what="device_map")


load_quark = from_pretrained

"""Write a quantized model as a compressed-tensors checkpoint (llm-compressor's layout, read by vLLM and by
transformers with the compressed-tensors package): ``export_compressed_tensors``. ``qcore.adapters.io.compressed_tensors``
loads such checkpoints (qcore's or compressed-tensors' own) into qcore's frozen modules.

The schema and the tensor codecs are ``qcore.formats.compressed_tensors`` (numpy); this module walks the model.
What maps to what, what is lossless and where the numerics differ is in ``docs/compressed_tensors.md``. In short:

- each quantized ``Linear`` becomes one config group's member (one group per distinct layer config; a single
  group targets ``"Linear"`` with the float Linears in ``ignore``, several groups name their modules); its weight
  is written as real low-bit tensors in the format llm-compressor would pick (``pack-quantized``,
  ``int-quantized``, ``float-quantized``, ``naive-quantized``, ``mxfp4-pack-quantized``);
- float scales are written in the model dtype, as compressed-tensors stores (and its loaders allocate) them:
  the report (``info.tensors``) says per tensor whether that is exact; ``strict=True`` refuses any inexact tensor
  before anything is written. Codes and zero points are always exact.
- KV-cache scales (qcore: the fp8 output scales of ``k_proj`` / ``v_proj``) are written as the attention
  module's ``k_scale`` / ``v_scale`` with a ``kv_cache_scheme``.

Guarantees as ``export_hf``: safetensors only, validation naming the module and tensor before anything is written,
atomic (staging directory renamed into place), deterministic (byte-identical files for the same model).

Load a compressed-tensors checkpoint (qcore's ``export_compressed_tensors``, or one written by
compressed-tensors / llm-compressor) into qcore's frozen quantized modules, without the compressed_tensors
package: ``load_compressed_tensors(directory)``. ``model.qcore_config`` is the ``ModelConfig`` that describes the
loaded model (the one qcore stored in the checkpoint, else ``config_from_ct`` derives it from the
compressed-tensors config), so ``export_hf`` / ``export_gguf`` / ``export_compressed_tensors`` write it again.

The model is built with its parameters on the meta device (no random initialisation, one copy of the weights);
every tensor's name, dtype and shape is checked against the config before any weight is read, then the values;
errors name the tensor. The schema and codecs are ``qcore.formats.compressed_tensors``; what maps to what is in
``docs/compressed_tensors.md``.
"""

from __future__ import annotations

import os
import pathlib
import types
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import nn

import qcore
from qcore._fsutil import model_sources
from qcore.formats import compressed_tensors as CT
from qcore.formats.inspect import checkpoint_files
from qcore.formats.quark_layout import WeightParts
from qcore.formats.safetensors_io import TensorRecord, CorruptCheckpointError, SafetensorsFile

from ..config import ModelConfig, KVCacheConfig, LayerConfig, TensorConfig, match_name
from .records import ST_TORCH, TORCH_ST, record, tensor_record, untied_state
from .common import (QCORE_FORMAT_VERSION, canonical_shape, check_config_describes, check_destination,
                     check_format_version, conv1d_error, export_units, hf_config, model_class, model_config,
                     online_rotations, parse_size, read_config, refuse_conv1d, weight_parts, weightless_error,
                     will_rotate_online, write_checkpoint)
from .experts import check_no_experts
from ..families import fused_units
from ..batches import set_module
from ..modules import IN_OUT, QUANT_CLASSES, QuantLinear, QuantModule, weight_layout
from ..plan import plan_model

__all__ = ['export_compressed_tensors', 'check_ct', 'CTExportInfo', 'TensorReport', 'ct_quantization_config',
           'load_compressed_tensors', 'config_from_ct']


# ---------------------------------------------------------------------------------------------------------------
# export (formerly export_ct.py)
# ---------------------------------------------------------------------------------------------------------------

_MODEL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DTYPE_TORCH = {v: k for k, v in _MODEL_DTYPES.items()}


@dataclass(frozen=True)
class TensorReport:
    """One written quantization tensor: ``kind`` (codes, scale, zero_point, shape, activation_scale, kv_scale),
    safetensors ``dtype`` and ``shape``, ``exact`` (the stored values decode to qcore's exactly) and
    ``max_abs_diff`` (largest difference of a decoded value from qcore's; 0.0 when exact)."""

    kind: str
    dtype: str
    shape: tuple
    exact: bool
    max_abs_diff: float = 0.0


@dataclass(frozen=True)
class CTExportInfo:
    """What ``export_compressed_tensors`` wrote: the directory, its ``format``, files and size, each quantized
    layer's format (``layers``), every quantization tensor (``tensors``: name -> ``TensorReport``), ``lossless``
    (every tensor exact) and ``notes`` (where compressed-tensors' loaders compute differently from qcore)."""

    directory: str
    format: str
    files: tuple
    bytes_on_disk: int
    layers: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)
    lossless: bool = True
    notes: tuple = ()

    @property
    def quant_method(self) -> str:
        return CT.QUANT_METHOD

    @property
    def inexact(self) -> list:
        """Names of the tensors whose stored values differ from qcore's."""
        return [n for n, r in self.tensors.items() if not r.exact]


# ---------------------------------------------------------------------------------------------------------------
# planning: model -> config groups, records, report
# ---------------------------------------------------------------------------------------------------------------


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _kv_role(name: str, m: QuantModule, config: ModelConfig) -> Optional[str]:
    """'k' / 'v' when this module's output quantization is the config's KV cache, else None."""
    kv = config.kv_cache
    if kv is None or m.qconfig.output is None or m.qconfig.output != kv.output:
        return None
    if not any(match_name(p, name) for p in kv.targets):
        return None
    leaf = name.rsplit(".", 1)[-1]
    if leaf not in ("k_proj", "v_proj"):
        raise ValueError(f"export: KV-cache module {name!r} is not a k_proj / v_proj; compressed-tensors stores KV "
                         f"scales as the attention module's k_scale / v_scale")
    return leaf[0]


def _scales_of(m: QuantModule) -> np.ndarray:
    """The float32 weight scales of a quantized module (without touching its codes when it can)."""
    spec = m.specs["weight"]
    sc = m.scales("weight").scale
    if sc is not None and not sc.is_meta:
        v = sc.detach().cpu()
        v = v.float() if v.dtype == torch.float32 else torch.as_tensor(qcore.decode(v, spec.scale_dtype)).float()
        if bool(torch.isfinite(v).all()):
            return v.numpy()
    return weight_parts(m)[0].scales


def _diff(want: np.ndarray, got: np.ndarray) -> tuple[bool, float]:
    want = np.asarray(want, np.float64)
    got = np.asarray(got, np.float64).reshape(want.shape)
    exact = bool(np.array_equal(want, got))
    return exact, 0.0 if exact else float(np.max(np.abs(want - got)))


def _scale_report(kind: str, st: str, s: np.ndarray, shape: tuple, name: str) -> TensorReport:
    back = CT.scale_from_dtype(CT.scale_to_dtype(s, st), st)
    if not np.all(np.isfinite(back)) or not np.all(back > 0):
        bad = np.asarray(s, np.float32).reshape(-1)[~(np.isfinite(back) & (back > 0)).reshape(-1)][0]
        raise ValueError(f"export_compressed_tensors: tensor {name!r}: scale {float(bad)!r} is "
                         f"{'0' if np.isfinite(back).all() else 'Inf'} in the model dtype ({st}); compressed-"
                         f"tensors stores scales in the model dtype (use a float32 or bfloat16 model)")
    exact, d = _diff(s, back)
    return TensorReport(kind, st, tuple(shape), exact, d)


@dataclass
class _Layer:
    name: str
    m: QuantModule
    spec: Any
    shape: tuple
    fmt: CT.CTFormat
    group: str
    kv: Optional[str]


def _act_args(m: QuantModule, role: str, where: str) -> Optional[CT.CTArgs]:
    tc = getattr(m.qconfig, role)
    if tc is None:
        return None
    return CT.spec_to_args(m.specs[role], role=role, dynamic=tc.dynamic, where=f"{where} {role}")


def _unit_check(name: str, type_name: str, layout: Optional[str], lc: Any, config: ModelConfig) -> None:
    """What compressed-tensors cannot store about one quantized module (its float type, its ``weight_layout`` and
    its ``LayerConfig``): the one rule for ``export_compressed_tensors`` and ``check_ct``."""
    if layout == IN_OUT:
        raise ValueError(conv1d_error("export_compressed_tensors", [name]))
    if type_name != "Linear":
        raise ValueError(f"export: {name!r} is a quantized {type_name}; compressed-tensors stores quantized Linear "
                         f"layers only (exclude it from the config)")
    where = f"layer {name!r}"
    if lc.weight is None:
        kv = _kv_role(name, types.SimpleNamespace(qconfig=lc), config)
        if not (kv and lc.input is None and lc.bias is None):
            raise ValueError(f"export: {where} quantizes no weight; compressed-tensors stores quantized weights")
    if lc.bias is not None:
        raise ValueError(f"export: {where} quantizes its bias; compressed-tensors has no bias quantization")


def check_ct(model: nn.Module, config: Optional[ModelConfig] = None, *, plans=None) -> None:
    """Before any work: ValueError if ``export_compressed_tensors`` would refuse ``model`` quantized with ``config``
    (default ``model.qcore_config``) for reasons the model and the config already decide (the model dtype, module
    types, bias or weightless quantization, online rotations; ``qcore quantize --export compressed-tensors`` calls
    it before the baseline evaluation)."""
    check_no_experts(model, config if config is not None else getattr(model, "qcore_config", None),
                     who="export_compressed_tensors")  # fused MoE experts: not written yet (docs/adapters.md)
    dtype = _model_dtype(model)
    if dtype not in _MODEL_DTYPES:
        raise ValueError(f"export_compressed_tensors: model dtype {dtype} is not float32, bfloat16 or float16")
    config = config if config is not None else getattr(model, "qcore_config", None)
    refuse_conv1d(model, config, "export_compressed_tensors")
    if not isinstance(config, ModelConfig):
        return
    if will_rotate_online(model, config):
        raise ValueError(_ROTATION_REFUSAL)
    units = export_units(model, config, plans=plans)
    if units and all(u.config.weight is None for u in units):  # KV-cache-only or activation-only: no group
        raise ValueError(weightless_error("export_compressed_tensors", [u.name for u in units]))
    members: dict = {}
    for u in units:
        _unit_check(u.name, u.type, weight_layout(model.get_submodule(u.name)), u.config, config)
        if u.config.weight is None:
            continue
        # what _plan checks of each layer, from the config's specs: formats compressed-tensors spells, static
        # activation scales per tensor, a format that holds the weight, whole groups of a 2-D weight
        where, lc = f"layer {u.name!r}", u.config
        w = CT.spec_to_args(lc.weight.spec, role="weight", where=f"{where} weight")
        args = {}
        kv = _kv_role(u.name, types.SimpleNamespace(qconfig=lc), config)
        for role in ("input",) if kv else ("input", "output"):
            tc = getattr(lc, role)
            args[role] = None if tc is None else CT.spec_to_args(tc.spec, role=role, dynamic=tc.dynamic,
                                                                 where=f"{where} {role}")
            if args[role] is not None and not args[role].dynamic and args[role].strategy is not CT.Strategy.TENSOR:
                raise ValueError(f"export: {where} {role}: static activation scales must be per tensor in "
                                 f"compressed-tensors")
        fmt = CT.infer_format(w, args["input"])
        CT.expected_weight(lc.weight.spec, u.shape, fmt=fmt, scale_dtype="F32", where=where)
        members.setdefault((repr(w), repr(args["input"]), repr(args.get("output")), fmt), []).append(u.name)
    if members:  # the config groups _plan will make: read back by compressed-tensors and vLLM as qcore means them
        groups = {f"group_{i}": ns for i, ns in enumerate(members.values())}
        quantized = {n for ns in groups.values() for n in ns}
        _check_readers(model, groups, [n for n, _ in _linears(model) if n not in quantized],
                       "export_compressed_tensors")


_ROTATION_REFUSAL = ("export_compressed_tensors: the model carries online rotations (QuaRot / SpinQuant "
                     "InputRotation hooks), which compressed-tensors' loaders would not apply; fuse-only "
                     "rotations export fine")


def _plan(model: nn.Module, config: ModelConfig) -> tuple[list[_Layer], dict, list]:
    """Quantized layers (validated), config groups (name -> CTScheme without targets) and the float Linears."""
    layers: list[_Layer] = []
    schemes: dict[tuple, str] = {}
    groups: dict[str, dict] = {}
    floats: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, QuantModule):
            _unit_check(name, m.float_type.__name__, weight_layout(m), m.qconfig, config)
        if not isinstance(m, QuantLinear):
            if type(m) is nn.Linear:
                floats.append(name)
            continue
        where = f"layer {name!r}"
        if "weight" not in m.specs:  # KV cache only (_unit_check): a float Linear whose attention module
            kv = _kv_role(name, m, config)  # holds the k / v scale
            floats.append(name)
            layers.append(_Layer(name, m, None, tuple(m.weight.shape), None, None, kv))
            continue
        spec = m.specs["weight"]
        w = CT.spec_to_args(spec, role="weight", where=f"{where} weight")
        inp = _act_args(m, "input", where)
        kv = _kv_role(name, m, config)
        out = None if kv else _act_args(m, "output", where)
        for role, a in (("input", inp), ("output", out)):
            if a is not None and not a.dynamic and a.strategy is not CT.Strategy.TENSOR:
                raise ValueError(f"export: {where} {role}: static activation scales must be per tensor in "
                                 f"compressed-tensors")
        fmt = CT.infer_format(w, inp)
        shape = canonical_shape(m)
        CT.expected_weight(spec, shape, fmt=fmt, scale_dtype="F32", where=where)  # validates the layout
        key = (repr(w), repr(inp), repr(out), fmt)
        if key not in schemes:
            gname = f"group_{len(schemes)}"
            schemes[key] = gname
            groups[gname] = {"weights": w, "input_activations": inp, "output_activations": out, "format": fmt,
                             "members": []}
        g = schemes[key]
        groups[g]["members"].append(name)
        layers.append(_Layer(name, m, spec, tuple(shape), fmt, g, kv))
    if groups:
        _check_readers(model, {g: d["members"] for g, d in groups.items()}, floats, "export_compressed_tensors")
    return layers, groups, floats


def ct_quantization_config(model: nn.Module, config: Optional[ModelConfig] = None) -> dict:
    """The ``quantization_config`` dict ``export_compressed_tensors`` writes for ``model`` (no tensors
    converted)."""
    config = model_config(model, config, who="ct_quantization_config")
    layers, groups, floats = _plan(model, config)
    return _ct_config(layers, groups, floats, config).to_dict()


def _ct_config(layers: list, groups: dict, floats: list, config: ModelConfig) -> CT.CTConfig:
    single = len(groups) == 1
    schemes = {}
    for g, d in groups.items():
        schemes[g] = CT.CTScheme(targets=("Linear",) if single else tuple(d["members"]), weights=d["weights"],
                                 input_activations=d["input_activations"], output_activations=d["output_activations"],
                                 format=d["format"].value)
    fmts = {d["format"] for d in groups.values()}
    fmt = next(iter(fmts)).value if len(fmts) == 1 else CT.CTFormat.MIXED_PRECISION.value
    kv = None
    if any(lay.kv for lay in layers):
        kv = CT.spec_to_args(config.kv_cache.spec, role="kv_cache", dynamic=False, where="kv_cache")
    own = {"format_version": QCORE_FORMAT_VERSION, "qcore_version": qcore.__version__, "config": config.to_dict()}
    return CT.CTConfig(config_groups=schemes, format=fmt, ignore=tuple(floats), kv_cache_scheme=kv, qcore=own)


def _records(model: nn.Module, layers: list, st: str, report: dict) -> list[TensorRecord]:
    """Lazy records of every tensor (quantized layers in module order, KV scales, then the rest of the state
    dict, tied weights once); fills ``report`` for the quantization tensors (scales checked now)."""
    records: list[TensorRecord] = []
    owned: set = set()
    cache: dict = {}
    kv_recs: list[TensorRecord] = []
    for lay in layers:
        m, prefix = lay.m, lay.name + "."
        float_weight = lay.spec is None  # a KV-cache-only projection: weight and bias written as floats below
        owned.update(prefix + k for k in m.state_dict().keys() if "." not in k and not (
            float_weight and k in ("weight", "bias")))
        exp = {} if float_weight else CT.expected_weight(lay.spec, lay.shape, fmt=lay.fmt, scale_dtype=st,
                                                         where=f"layer {lay.name!r}")

        def enc(lay=lay):
            if cache.get("layer") is not lay:  # one layer's encoded tensors at a time (written together)
                cache.clear()
                p = weight_parts(lay.m)[0]
                cache["enc"] = CT.encode_weight(p.codes, p.scales, p.zero_points, lay.spec, lay.shape, fmt=lay.fmt,
                                                scale_dtype=st, where=f"layer {lay.name!r}")
                cache["layer"] = lay
            return cache["enc"]

        scales = None if float_weight else _scales_of(m)
        for suffix, (dt, shp) in exp.items():
            records.append(record(prefix + suffix, dt, lambda s=suffix, enc=enc: enc()[s][1], shp))
            if suffix == "weight_scale" and dt != "U8":
                report[prefix + suffix] = _scale_report("scale", dt, scales, shp, prefix + suffix)
            else:
                kind = {"weight_zero_point": "zero_point", "weight_shape": "shape", "weight_scale": "scale"}.get(
                    suffix, "codes")
                report[prefix + suffix] = TensorReport(kind, dt, tuple(shp), True)
        for role in m.static_roles():
            if not m.is_calibrated(role):
                raise ValueError(f"export: layer {lay.name!r}: static {role} scales are not calibrated; run "
                                 f"quantize_model with calibration data before exporting")
            s = m.scales(role).scale.detach().float().cpu().numpy().reshape(1)
            if role == "output" and lay.kv:
                parent = lay.name.rsplit(".", 1)[0]
                key = f"{parent}.{lay.kv}_scale"
                rep = _scale_report("kv_scale", st, s, (1,), key)
                report[key] = rep
                kv_recs.append(record(key, st, lambda s=s: CT.scale_to_dtype(s, st), (1,)))
                continue
            key = f"{prefix}{role}_scale"
            report[key] = _scale_report("activation_scale", st, s, (1,), key)
            records.append(record(key, st, lambda s=s: CT.scale_to_dtype(s, st), (1,)))
            zp = m.scales(role).zero_point
            if zp is not None:
                spec = m.specs[role]
                k = 0 if spec.dtype.signed else 1 << (spec.dtype.bits - 1)
                z = (zp.detach().float().cpu().numpy().reshape(1).astype(np.int64) - k).astype(np.int8)
                report[f"{prefix}{role}_zero_point"] = TensorReport("zero_point", "I8", (1,), True)
                records.append(record(f"{prefix}{role}_zero_point", "I8", lambda z=z: z, (1,)))
        bias = m._parameters.get("bias")
        if bias is not None and not float_weight:
            records.append(tensor_record(prefix + "bias", bias.detach()))
    records.extend(kv_recs)
    for k, t in untied_state(model, owned):  # a tied weight: written once, as save_pretrained does
        records.append(tensor_record(k, t.detach()))
    names = [r.name for r in records]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"export: tensor names {dup[:3]} would be written twice (a model with its own "
                         f"k_scale / v_scale?)")
    return records


_NOTES = {
    "kv": "KV cache: compressed-tensors and vLLM quantize the keys after RoPE (k_scale on the attention); qcore "
          "quantizes k_proj's output before RoPE with the same scale (values are the same either way)",
    "mx_dynamic": "dynamic MXFP4 activations: compressed-tensors derives the shared exponent with its own rounding "
                  "of the block max (qcore's ScaleMode.EVEN is the closest rule)",
}


def export_compressed_tensors(model: nn.Module, directory: Union[str, os.PathLike], *,
                              config: Optional[ModelConfig] = None, tokenizer: Any = None, overwrite: bool = False,
                              max_shard_size: Union[int, str] = "5GB", strict: bool = False,
                              progress: bool = False) -> CTExportInfo:
    """Write ``model`` (quantized with ``quantize_model``, frozen or not) as a compressed-tensors checkpoint.

    config: the model's ``ModelConfig`` (default ``model.qcore_config``); it is stored in the checkpoint too
        (``quantization_config["qcore"]``), so ``load_compressed_tensors`` restores it exactly.
    tokenizer: saved alongside. overwrite: replace an existing non-empty ``directory``.
    max_shard_size: largest shard (``"5GB"`` or bytes). strict: refuse (ValueError naming the tensor, nothing
        written) when a stored value is not exactly qcore's (float32 scales that the model dtype cannot hold).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for k, v in (("overwrite", overwrite), ("strict", strict), ("progress", progress)):
        if not isinstance(v, bool):
            raise TypeError(f"{k} must be a bool, got {v!r}")
    max_bytes = parse_size(max_shard_size)
    config = model_config(model, config, who="export_compressed_tensors")
    if not any(isinstance(m, QuantModule) for m in model.modules()):
        raise ValueError("export_compressed_tensors: the model has no qcore quantized modules; run quantize_model "
                         "first")
    hf_config = getattr(model, "config", None)
    if hf_config is None or not hasattr(hf_config, "to_dict"):
        raise TypeError("export_compressed_tensors: the model has no transformers config (model.config)")
    dtype = _model_dtype(model)
    check_ct(model, config)
    st = CT.SCALE_DTYPES[_MODEL_DTYPES[dtype]]
    directory = pathlib.Path(directory)
    check_destination(directory, overwrite, model_sources(model))
    check_config_describes(model, config)
    if online_rotations(model, config):
        raise ValueError(_ROTATION_REFUSAL)
    layers, groups, floats = _plan(model, config)
    ctc = _ct_config(layers, groups, floats, config)
    report: dict[str, TensorReport] = {}
    records = _records(model, layers, st, report)
    bad = [n for n, r in report.items() if not r.exact]
    if strict and bad:
        r = report[bad[0]]
        raise ValueError(f"export_compressed_tensors(strict=True): tensor {bad[0]!r} is not exact in {r.dtype} "
                         f"(max abs diff {r.max_abs_diff:.3g}); {len(bad)} tensor(s) inexact. Quantize with "
                         f"scale_dtype={_MODEL_DTYPES[dtype]!r} scales (or a float32 model) for a lossless export")
    notes = []
    if ctc.kv_cache_scheme is not None:
        notes.append(_NOTES["kv"])
    for d in groups.values():
        for a in (d["input_activations"], d["output_activations"]):
            if a is not None and a.dynamic and a.scale_dtype == "uint8" and _NOTES["mx_dynamic"] not in notes:
                notes.append(_NOTES["mx_dynamic"])
    qdict = ctc.to_dict()

    write_checkpoint(directory, model, hf_config, qdict, records, tokenizer=tokenizer, overwrite=overwrite,
                     max_bytes=max_bytes, progress=progress)
    files = tuple(sorted(p.name for p in directory.iterdir()))
    size = sum((directory / f).stat().st_size for f in files)
    return CTExportInfo(str(directory), ctc.format, files, size, {lay.name: lay.fmt.value for lay in layers
                                                                  if lay.fmt is not None},
                        report, not bad, tuple(notes))


# ---------------------------------------------------------------------------------------------------------------
# import (formerly import_ct.py)
# ---------------------------------------------------------------------------------------------------------------

def _layer_config(s: CT.CTScheme, where: str) -> LayerConfig:
    roles: dict[str, Any] = {}
    if s.weights is None:
        raise ValueError(f"{where}: a scheme without weights is not supported")
    ws, _ = CT.args_to_spec(s.weights, role="weight", where=f"{where}.weights")
    roles["weight"] = TensorConfig(ws)
    for role, a in (("input", s.input_activations), ("output", s.output_activations)):
        if a is not None:
            spec, dyn = CT.args_to_spec(a, role=role, where=f"{where}.{role}_activations")
            roles[role] = TensorConfig(spec, dynamic=dyn)
    return LayerConfig(**roles)


#: vLLM's fused layer for each of the records' fused units (``families.Family.fused_units``: what vLLM's
#: ``packed_modules_mapping`` fuses): q/k/v into ``qkv_proj`` (BERT's query/key/value too), gate/up into
#: ``gate_up_proj``
_VLLM_FUSED_NAMES = {("q_proj", "k_proj", "v_proj"): "qkv_proj", ("query", "key", "value"): "qkv_proj",
                     ("gate_proj", "up_proj"): "gate_up_proj"}


def _vllm_fused(model: nn.Module) -> dict:
    """vLLM's ``packed_modules_mapping`` for ``model`` (from its family's record; ``families.DEFAULT_FUSED`` for
    a model without one)."""
    return {_VLLM_FUSED_NAMES[u]: u for u in fused_units(model) if u in _VLLM_FUSED_NAMES}


def _linears(model: nn.Module) -> list:
    """``(name, class names of the float module's MRO)`` of every Linear of ``model`` (a quantized one as the
    float ``nn.Linear`` the readers build)."""
    out = []
    for name, m in model.named_modules():
        if type(m) is nn.Linear or isinstance(m, QuantLinear):
            cls = m.float_type if isinstance(m, QuantModule) else type(m)
            out.append((name, tuple(c.__name__ for c in cls.__mro__ if issubclass(c, nn.Module))))
    return out


def _module_groups(model: nn.Module, ctc: CT.CTConfig, *, own: bool = False) -> dict[str, str]:
    """Module name -> the config group that quantizes it, as compressed-tensors decides it (the rule llm-compressor
    wrote the tensors by: exact names, then ``re:`` patterns, then class names; ``CT.resolve_groups``). A config
    vLLM reads differently for some layer (its rule: names and patterns in config order, then class names, fused
    q/k/v and gate/up deciding together) is refused naming the layer, unless qcore wrote the checkpoint (``own``:
    its stored config says what each layer is)."""
    groups = {g: s.targets for g, s in ctc.config_groups.items()}
    out = {}
    for name, (ct, v) in CT.resolve_groups(_linears(model), groups, ctc.ignore, fused=_vllm_fused(model)).items():
        if not own and v.refused is None and v.group != ct.group:
            on = f" (as part of its fused {v.layer!r})" if v.layer else ""
            raise CorruptCheckpointError(
                f"quantization_config: layer {name!r}: compressed-tensors (llm-compressor, transformers) reads "
                f"{ct.describe()}, vLLM reads {v.describe()}{on}; qcore refuses a config the two read differently "
                f"(one of them would load the layer with the wrong scheme)")
        if ct.group is not None:
            out[name] = ct.group
    return out


def _check_readers(model: nn.Module, members: dict, floats: list, who: str) -> None:
    """The config qcore writes (``{group: members}``: a single group targets ``"Linear"``, several name their
    modules; ``floats`` in ``ignore``) read back by compressed-tensors' rule and vLLM's (``CT.resolve_groups``):
    every quantized module in its group, every float one float, for both; ValueError naming the first module
    either would read otherwise (vLLM fuses q/k/v and gate/up and gives them one scheme), before anything is
    written."""
    groups = {g: (("Linear",) if len(members) == 1 else tuple(ns)) for g, ns in members.items()}
    want = {n: g for g, ns in members.items() for n in ns}
    fused = _vllm_fused(model)
    for name, (ct, v) in CT.resolve_groups(_linears(model), groups, tuple(floats), fused=fused).items():
        if name not in want and name not in floats:
            continue
        g = want.get(name)
        mine = f"group {g!r}" if g is not None else "float"
        for reader, m in (("compressed-tensors", ct), ("vLLM", v)):
            if m.refused is None and m.group == g:
                continue
            unit = ""
            if m.layer is not None:
                leaf = m.layer.rsplit(".", 1)[-1]
                parent = name.rpartition(".")[0]
                sib = [f"{parent}.{x}" for x in fused[leaf]]
                kinds = sorted({want.get(x, "float") for x in sib})
                unit = (f"; vLLM fuses {[x.rsplit('.', 1)[-1] for x in sib]} into one {leaf} with one scheme, and "
                        f"qcore quantizes them differently ({', '.join(kinds)}): give them one config (or keep all "
                        f"of them float)")
            raise ValueError(f"{who}: layer {name!r} is {mine} in the config qcore would write, but {reader} would "
                             f"read {m.describe()}{unit}")


def config_from_ct(model: nn.Module, ctc: CT.CTConfig) -> ModelConfig:
    """The ``ModelConfig`` that gives ``model`` the quantization a compressed-tensors config describes: the
    layer config of a single ``"Linear"`` group with the float Linears excluded by name, else one ``by_name``
    entry per quantized module. A KV-cache scheme becomes ``KVCacheConfig`` on ``*k_proj`` / ``*v_proj``."""
    which = _module_groups(model, ctc)
    if not which:
        raise ValueError("quantization_config: the config groups match no Linear of the model")
    lcs = {g: _layer_config(s, f"quantization_config.config_groups.{g}") for g, s in ctc.config_groups.items()
           if g in which.values()}
    floats = tuple(n for n, m in model.named_modules() if type(m) is nn.Linear and n not in which)
    kv = None
    if ctc.kv_cache_scheme is not None:
        spec, dyn = CT.args_to_spec(ctc.kv_cache_scheme, role="kv_cache", where="quantization_config.kv_cache_scheme")
        if dyn or spec.dtype.name != "float8_e4m3fn" or not isinstance(spec.granularity, qcore.PerTensor):
            raise ValueError("quantization_config.kv_cache_scheme: qcore loads static per-tensor fp8 KV caches")
        kv = KVCacheConfig(spec)
    if len(lcs) == 1:
        return ModelConfig(next(iter(lcs.values())), exclude=floats, kv_cache=kv)
    return ModelConfig(LayerConfig(), by_name={n: lcs[g] for n, g in which.items()}, exclude=floats, kv_cache=kv)


_ST_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I8": np.int8, "U8": np.uint8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
          "BOOL": np.bool_, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "F8_E8M0": np.uint8}
_FLOAT_ST = ("F32", "BF16", "F16")


class _Reader:
    def __init__(self, d: pathlib.Path):
        self.entries: dict = {}
        for f in checkpoint_files(d):
            sf = SafetensorsFile(f)
            for k, e in sf.entries.items():
                self.entries[k] = (sf, e)
        if not self.entries:
            raise CorruptCheckpointError(f"{str(d)!r}: no tensors (qcore never loads pickled weights)")
        self.used: set = set()

    def check(self, name: str, dtypes: tuple, shape: Optional[tuple], where: str) -> str:
        if name not in self.entries:
            raise CorruptCheckpointError(f"{where}: tensor {name!r} is missing from the checkpoint")
        sf, e = self.entries[name]
        if e.dtype not in dtypes or (shape is not None and tuple(e.shape) != tuple(shape)):
            raise CorruptCheckpointError(f"{where}: tensor {name!r} is {e.dtype} {list(e.shape)} in "
                                         f"{sf.path.name}; expected {'/'.join(dtypes)} "
                                         f"{'any shape' if shape is None else list(shape)}")
        return e.dtype

    def array(self, name: str) -> np.ndarray:
        sf, e = self.entries[name]
        self.used.add(name)
        return np.frombuffer(sf.raw(name), dtype=_ST_NP[e.dtype]).reshape(e.shape)

    def torch(self, name: str) -> torch.Tensor:
        sf, e = self.entries[name]
        a = np.array(self.array(name))
        t = torch.from_numpy(a)
        if e.dtype in ("BF16", "F8_E4M3", "F8_E5M2"):
            t = t.view(ST_TORCH[e.dtype])
        return t


def load_compressed_tensors(directory: Union[str, os.PathLike], *, dtype: Optional[torch.dtype] = None,
                            device: Any = None) -> nn.Module:
    """Load a compressed-tensors checkpoint (qcore's export, or one written by compressed-tensors /
    llm-compressor) into qcore's frozen modules, without the compressed_tensors package. ``model.qcore_config``
    is the ``ModelConfig`` (the stored qcore one when qcore wrote the checkpoint, else ``config_from_ct``), so
    ``export_hf`` / ``export_compressed_tensors`` / ``export_gguf`` can write the model again.

    dtype: the float dtype of the model (default: the checkpoint config's ``torch_dtype``). device: where the
    model goes after loading (default CPU). Every tensor's name, dtype and shape is checked against the config
    before any weight is read; values too (scales finite and positive, codes and zero points in range); errors
    name the tensor."""
    d = pathlib.Path(directory)
    try:
        return _load(d, dtype, device)
    except CorruptCheckpointError as e:  # every refusal names the checkpoint
        raise CorruptCheckpointError.naming(d, e) from None


def _load(d: pathlib.Path, dtype: Optional[torch.dtype], device: Any) -> nn.Module:
    _, raw = read_config(d)
    if not isinstance(raw, dict) or raw.get("quant_method") != CT.QUANT_METHOD:
        got = raw.get("quant_method") if isinstance(raw, dict) else None
        raise ValueError(f"{str(d)!r}: quantization_config.quant_method is {got!r}; expected "
                         f"{CT.QUANT_METHOD!r} (qcore.adapters.from_pretrained loads 'quark' and 'qcore')")
    try:
        check_format_version(raw.get("qcore"), "quantization_config")
        ctc = CT.CTConfig.from_dict(raw)
    except (ValueError, TypeError) as e:
        raise CorruptCheckpointError(f"{str(d / 'config.json')!r}: {e}") from None
    reader = _Reader(d)
    hf = hf_config(d)
    if hasattr(hf, "quantization_config"):
        del hf.quantization_config
    if dtype is None:
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    if dtype not in _MODEL_DTYPES:
        raise ValueError(f"load_compressed_tensors: dtype {dtype} is not float32, bfloat16 or float16")
    from accelerate import init_empty_weights
    with init_empty_weights(include_buffers=False):  # parameters on meta (each is assigned from the checkpoint)
        cls = model_class(hf)
        model = (cls.from_config(hf, dtype=dtype) if hasattr(cls, "from_config") else cls._from_config(hf, dtype=dtype))
        model = model.eval()
    if raw.get("qcore") is not None and not isinstance(raw.get("qcore"), dict):
        raise CorruptCheckpointError(f"{str(d / 'config.json')!r}: quantization_config.qcore must be a JSON object, "
                                     f"got {raw.get('qcore')!r}"[:300])
    own = ctc.qcore if isinstance(ctc.qcore, dict) and "config" in ctc.qcore else None
    try:  # the stored qcore config: its own checks, naming the file and field
        config = ModelConfig.from_dict(own["config"]) if own is not None else config_from_ct(model, ctc)
        plans = plan_model(model, config, check_float=False)  # a saved config, as it was saved
    except (ValueError, TypeError) as e:
        if own is None or isinstance(e, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"{str(d / 'config.json')!r}: quantization_config.qcore.config: {e}"[:400]) \
            from None
    which = _module_groups(model, ctc, own=own is not None)
    float_here = sorted(set(which) - {p.name for p in plans if p.config.weight is not None})
    if float_here:  # compressed-tensors' loaders would quantize what qcore's config leaves float
        raise CorruptCheckpointError(f"layer {float_here[0]!r}: matched by the compressed-tensors group "
                                     f"{which[float_here[0]]!r} (not in quantization_config.ignore) but its weight is "
                                     f"float in the qcore config"
                                     + (f" (and {len(float_here) - 1} more)" if len(float_here) > 1 else ""))
    # 1. every quantized tensor's name, dtype and shape, before anything is read
    todo = []
    for p in plans:
        where = f"layer {p.name!r}"
        m = model.get_submodule(p.name)
        if type(m) is not nn.Linear:
            raise CorruptCheckpointError(f"{where}: a {type(m).__name__}; compressed-tensors stores Linear layers")
        if p.config.weight is None:  # KV cache only: a float projection whose attention holds the k / v scale
            q = QUANT_CLASSES[nn.Linear].from_module(m, p.config, name=p.name)
            kv = _kv_role(p.name, q, config)
            if not kv or p.config.input is not None or p.config.bias is not None:
                raise CorruptCheckpointError(f"{where}: the config quantizes no weight here, and compressed-tensors "
                                             f"has nothing but KV-cache scales for such a layer")
            dts = {"weight": reader.check(f"{p.name}.weight", _FLOAT_ST, (m.out_features, m.in_features), where)}
            if m.bias is not None:
                reader.check(f"{p.name}.bias", _FLOAT_ST, (m.out_features,), where)
            key = f"{p.name.rsplit('.', 1)[0]}.{kv}_scale"
            reader.check(key, _FLOAT_ST, None, where)
            todo.append((p, q, None, None, None, dts, {"output": (key, None)}))
            continue
        if p.name not in which:
            raise CorruptCheckpointError(f"{where}: quantized by the qcore config but matched by no config group's "
                                         f"targets (quantization_config.config_groups) of the compressed-tensors "
                                         f"config")
        g = which[p.name]
        fmt = ctc.scheme_format(g)
        q = QUANT_CLASSES[nn.Linear].from_module(m, p.config, name=p.name)
        spec = q.specs["weight"]
        want = CT.spec_to_args(spec, role="weight", where=f"{where} weight")
        have = ctc.config_groups[g].weights
        try:  # the group's own weights: a refusal names the file and the group's field
            have_bits = None if have is None else CT.args_to_spec(
                have, role="weight", where=f"quantization_config.config_groups.{g}.weights")[0].dtype.bits
        except ValueError as e:
            raise CorruptCheckpointError(f"{str(d / 'config.json')!r}: {e}"[:400]) from None
        if have is None or have_bits != spec.dtype.bits or \
                (want.type, want.strategy, want.group_size, want.block_structure, want.symmetric) != \
                (have.type, have.strategy, have.group_size, have.block_structure, have.symmetric):
            theirs = None if have is None else have.to_dict()
            raise CorruptCheckpointError(f"{where}: the qcore config's weight spec ({want.to_dict()}) is not the "
                                         f"compressed-tensors group {g!r}'s ({theirs})")
        shape = (m.out_features, m.in_features)
        exp = CT.expected_weight(spec, shape, fmt=fmt, scale_dtype="F32", where=where)
        dts = {}
        for suffix, (dt, shp) in exp.items():
            ok = _FLOAT_ST if dt == "F32" else (dt,)
            dts[suffix] = reader.check(f"{p.name}.{suffix}", ok, shp, where)
        if f"{p.name}.weight_g_idx" in reader.entries:
            reader.check(f"{p.name}.weight_g_idx", ("I32", "I64"), (shape[1],), where)
            dts["weight_g_idx"] = "I32"
        acts = {}
        kv = _kv_role(p.name, q, config) if q.qconfig.output is not None else None
        for role in q.static_roles():
            if role == "output" and kv:
                key = f"{p.name.rsplit('.', 1)[0]}.{kv}_scale"
            else:
                key = f"{p.name}.{role}_scale"
            reader.check(key, _FLOAT_ST, None, where)
            if int(np.prod(reader.entries[key][1].shape)) != 1:
                raise CorruptCheckpointError(f"{where}: tensor {key!r} has shape {list(reader.entries[key][1].shape)}; "
                                             f"qcore loads per-tensor static scales")
            zkey = f"{p.name}.{role}_zero_point"
            if not q.specs[role].symmetric:
                reader.check(zkey, ("I8", "I32", "U8"), None, where)
            acts[role] = (key, zkey if not q.specs[role].symmetric else None)
        if m.bias is not None:
            reader.check(f"{p.name}.bias", _FLOAT_ST, (m.out_features,), where)
        todo.append((p, q, spec, shape, fmt, dts, acts))
    owned = {f"{p.name}.{k}" for p, *_ in todo for k in ("weight", "bias")}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = set()
    for k, t in model.state_dict(keep_vars=True).items():
        if k in owned:
            continue
        if k not in reader.entries:
            if getattr(hf, "tie_word_embeddings", False) and head is not None and t is head.weight:
                tied.add(k)  # the output head shares the input embedding (written once)
                continue
            raise CorruptCheckpointError(f"tensor {k!r} of the model is missing from the checkpoint")
        reader.check(k, _FLOAT_ST if t.is_floating_point() else (TORCH_ST[t.dtype],), tuple(t.shape),
                     f"tensor {k!r}")
    # the model's float tensors (norms, embeddings, biases, float Linears) all in the checkpoint's one float dtype
    qweights = {f"{p.name}.weight" for p, q, spec, *_ in todo if spec is not None}
    floats = {k: reader.entries[k][1].dtype for k, t in model.state_dict(keep_vars=True).items()
              if t.is_floating_point() and k in reader.entries and k not in qweights}
    if floats:
        kinds = list(floats.values())
        want = max(set(kinds), key=kinds.count)
        odd = sorted(k for k, v in floats.items() if v != want)
        if odd:
            raise CorruptCheckpointError(f"tensor {odd[0]!r} is {floats[odd[0]]} in "
                                         f"{reader.entries[odd[0]][0].path.name}; the checkpoint's other float "
                                         f"tensors are {want}")
    # 2. values, module by module (parameters were created on the meta device: every one is assigned here)
    with torch.no_grad():
        for p, q, spec, shape, fmt, dts, acts in todo:
            where = f"layer {p.name!r}"
            if spec is None:
                q._parameters["weight"] = nn.Parameter(reader.torch(f"{p.name}.weight").to(dtype),
                                                       requires_grad=False)
            else:
                arrays = {s: reader.array(f"{p.name}.{s}") for s in dts}
                try:
                    codes, scales, zp = CT.decode_weight(arrays, spec, shape, fmt=fmt, dtypes=dts, where=where,
                                                         max_weight=float(torch.finfo(dtype).max))
                except ValueError as e:
                    raise CorruptCheckpointError(str(e)) from None
                q.load_frozen(WeightParts(codes=np.array(codes), scales=scales, zero_points=zp), shape=shape,
                              dtype=dtype, device=torch.device("cpu"))
            if q._parameters.get("bias") is not None:
                q._parameters["bias"] = nn.Parameter(reader.torch(f"{p.name}.bias").to(dtype), requires_grad=False)
            for role, (key, zkey) in acts.items():
                s = CT.scale_from_dtype(reader.array(key), reader.entries[key][1].dtype).reshape(())
                if not np.isfinite(s) or not s > 0:
                    raise CorruptCheckpointError(f"{where}: tensor {key!r} holds {float(s)!r}; scales must be "
                                                 f"finite and positive")
                z = None
                if zkey is not None:
                    rs = q.specs[role]
                    k = 0 if rs.dtype.signed else 1 << (rs.dtype.bits - 1)
                    z = float(reader.array(zkey).reshape(-1)[0]) + k
                    if not rs.qmin <= z <= rs.qmax:
                        raise CorruptCheckpointError(f"{where}: tensor {zkey!r} is out of range for {rs.dtype.name}")
                    z = torch.full(q.static_scale_shape(role), z)
                q.load_static_scales(role, scale=np.array(s, np.float32), zero_point=z)
            set_module(model, p.name, q)
        quantized = {p.name for p, *_ in todo}
        for name, mod in model.named_modules():
            if name in quantized:
                continue
            for leaf, t in list(mod._parameters.items()):
                k = f"{name}.{leaf}" if name else leaf
                if t is not None and k in reader.entries:
                    v = reader.torch(k)
                    mod._parameters[leaf] = nn.Parameter(v.to(t.dtype) if t.is_floating_point() else v,
                                                         requires_grad=t.requires_grad)
            for leaf, t in list(mod._buffers.items()):
                k = f"{name}.{leaf}" if name else leaf
                if t is not None and k in reader.entries and leaf not in mod._non_persistent_buffers_set:
                    v = reader.torch(k)
                    mod._buffers[leaf] = v.to(t.dtype) if t.is_floating_point() else v
    if tied:
        model.tie_weights()
    left_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left_meta:
        raise CorruptCheckpointError(f"tensors {left_meta[:5]} were not loaded from the checkpoint")
    left = sorted(set(reader.entries) - reader.used)
    if left:
        more = f" (and {len(left) - 1} more: {left[1:4]})" if len(left) > 1 else ""
        raise CorruptCheckpointError(f"tensor {left[0]!r} in {reader.entries[left[0]][0].path.name} is not a tensor "
                                     f"the config explains{more}")
    model.qcore_config = config
    if device is not None:
        model.to(device)
    return model.eval()

"""Write a quantized model as a compressed-tensors checkpoint (llm-compressor's layout, read by vLLM and by
transformers with the compressed-tensors package): ``export_compressed_tensors``. ``qcore.adapters.import_ct``
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
from qcore.formats import compressed_tensors as CT
from qcore.formats.safetensors_io import TensorRecord

from .config import ModelConfig
from .export import (QCORE_FORMAT_VERSION, _check_config_describes, _online_rotations, _record,
                     _tensor_record, check_destination, model_config, parse_size, weight_parts,
                     write_checkpoint)
from qcore._fsutil import model_sources
from .modules import QuantLinear, _QuantMixin

__all__ = ["export_compressed_tensors", "check_ct", "CTExportInfo", "TensorReport", "ct_quantization_config"]

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


def _kv_role(name: str, m: _QuantMixin, config: ModelConfig) -> Optional[str]:
    """'k' / 'v' when this module's output quantization is the config's KV cache, else None."""
    kv = config.kv_cache
    if kv is None or m.qconfig.output is None or m.qconfig.output != kv.output:
        return None
    from .quantizer import _match
    if not any(_match(p, name) for p in kv.targets):
        return None
    leaf = name.rsplit(".", 1)[-1]
    if leaf not in ("k_proj", "v_proj"):
        raise ValueError(f"export: KV-cache module {name!r} is not a k_proj / v_proj; compressed-tensors stores KV "
                         f"scales as the attention module's k_scale / v_scale")
    return leaf[0]


def _scales_of(m: _QuantMixin) -> np.ndarray:
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
    m: _QuantMixin
    spec: Any
    shape: tuple
    fmt: CT.CTFormat
    group: str
    kv: Optional[str]


def _act_args(m: _QuantMixin, role: str, where: str) -> Optional[CT.CTArgs]:
    tc = getattr(m.qconfig, role)
    if tc is None:
        return None
    return CT.spec_to_args(m.specs[role], role=role, dynamic=tc.dynamic, where=f"{where} {role}")


def _unit_check(name: str, type_name: str, lc: Any, config: ModelConfig) -> None:
    """What compressed-tensors cannot store about one quantized module (its float type and ``LayerConfig``): the one
    rule for ``export_compressed_tensors`` and ``check_ct``."""
    if type_name == "Conv1D":
        from .export import conv1d_error
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


def check_ct(model: nn.Module, config: Optional[ModelConfig] = None) -> None:
    """Before any work: ValueError if ``export_compressed_tensors`` would refuse ``model`` quantized with ``config``
    (default ``model.qcore_config``) for reasons the model and the config already decide (the model dtype, module
    types, bias or weightless quantization, online rotations; ``qcore quantize --export compressed-tensors`` calls
    it before the baseline evaluation)."""
    from .experts import check_no_experts
    from .export import export_units, refuse_conv1d, will_rotate_online
    check_no_experts(model, config if config is not None else getattr(model, "qcore_config", None),
                     who="export_compressed_tensors")  # fused MoE experts: not written yet (issue 22)
    dtype = _model_dtype(model)
    if dtype not in _MODEL_DTYPES:
        raise ValueError(f"export_compressed_tensors: model dtype {dtype} is not float32, bfloat16 or float16")
    config = config if config is not None else getattr(model, "qcore_config", None)
    refuse_conv1d(model, config, "export_compressed_tensors")
    if not isinstance(config, ModelConfig):
        return
    if will_rotate_online(model, config):
        raise ValueError(_ROTATION_REFUSAL)
    units = export_units(model, config)
    if units and all(u.config.weight is None for u in units):  # KV-cache-only or activation-only: no group
        from .export import weightless_error
        raise ValueError(weightless_error("export_compressed_tensors", [u.name for u in units]))
    for u in units:
        _unit_check(u.name, u.type, u.config, config)
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
        CT.expected_weight(lc.weight.spec, u.shape, fmt=CT.infer_format(w, args["input"]), scale_dtype="F32",
                           where=where)


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
        if isinstance(m, _QuantMixin):
            _unit_check(name, m.float_type.__name__, m.qconfig, config)
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
        from .export import canonical_shape
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
            records.append(_record(prefix + suffix, dt, lambda s=suffix, enc=enc: enc()[s][1], shp))
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
                kv_recs.append(_record(key, st, lambda s=s: CT.scale_to_dtype(s, st), (1,)))
                continue
            key = f"{prefix}{role}_scale"
            report[key] = _scale_report("activation_scale", st, s, (1,), key)
            records.append(_record(key, st, lambda s=s: CT.scale_to_dtype(s, st), (1,)))
            zp = m.scales(role).zero_point
            if zp is not None:
                spec = m.specs[role]
                k = 0 if spec.dtype.signed else 1 << (spec.dtype.bits - 1)
                z = (zp.detach().float().cpu().numpy().reshape(1).astype(np.int64) - k).astype(np.int8)
                report[f"{prefix}{role}_zero_point"] = TensorReport("zero_point", "I8", (1,), True)
                records.append(_record(f"{prefix}{role}_zero_point", "I8", lambda z=z: z, (1,)))
        bias = m._parameters.get("bias")
        if bias is not None and not float_weight:
            records.append(_tensor_record(prefix + "bias", bias.detach()))
    records.extend(kv_recs)
    seen: set = set()
    for k, t in model.state_dict(keep_vars=True).items():
        if k in owned or t is None:
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:  # a tied weight: written once, as save_pretrained does
            continue
        seen.add(key)
        records.append(_tensor_record(k, t.detach()))
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
    if not any(isinstance(m, _QuantMixin) for m in model.modules()):
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
    _check_config_describes(model, config)
    if _online_rotations(model, config):
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

"""compressed-tensors checkpoints (llm-compressor's layout, read by vLLM and by transformers with the
compressed-tensors package): ``export_compressed_tensors`` writes a quantized model, ``load_compressed_tensors``
loads one (qcore's or one written by compressed-tensors / llm-compressor) into qcore's frozen modules.

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

import json
import os
import pathlib
import re
import shutil
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import nn

import qcore
from qcore._fsutil import replace_dir, staging_dir
from qcore.formats import compressed_tensors as CT
from qcore.formats.quark_layout import WeightParts
from qcore.formats.safetensors_io import CorruptCheckpointError, SafetensorsFile, TensorRecord

from .config import KVCacheConfig, LayerConfig, ModelConfig, TensorConfig
from .export import (QCORE_FORMAT_VERSION, _TORCH_ST, _check_config_describes, _online_rotations, _record,
                     _tensor_record, check_destination, parse_size, weight_parts, write_metadata, write_shards)
from .modules import QUANT_CLASSES, QuantLinear, _QuantMixin

__all__ = ["export_compressed_tensors", "load_compressed_tensors", "CTExportInfo", "TensorReport",
           "ct_quantization_config", "config_from_ct"]

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
    spec = m._qspecs["weight"]
    sc = m._buffers.get("weight_scale")
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
    return CT.spec_to_args(m._qspecs[role], role=role, dynamic=tc.dynamic, where=f"{where} {role}")


def _plan(model: nn.Module, config: ModelConfig) -> tuple[list[_Layer], dict, list]:
    """Quantized layers (validated), config groups (name -> CTScheme without targets) and the float Linears."""
    layers: list[_Layer] = []
    schemes: dict[tuple, str] = {}
    groups: dict[str, dict] = {}
    floats: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, _QuantMixin) and not isinstance(m, QuantLinear):
            raise ValueError(f"export: {name!r} is a quantized {type(m).__bases__[1].__name__}; compressed-tensors "
                             f"stores quantized Linear layers only (exclude it from the config)")
        if not isinstance(m, QuantLinear):
            if type(m) is nn.Linear:
                floats.append(name)
            continue
        where = f"layer {name!r}"
        if "weight" not in m._qspecs:
            kv = _kv_role(name, m, config)
            if kv and m.qconfig.input is None and m.qconfig.bias is None:  # KV cache only: a float (ignored)
                floats.append(name)  # Linear whose attention module holds the k / v scale
                layers.append(_Layer(name, m, None, tuple(m.weight.shape), None, None, kv))
                continue
            raise ValueError(f"export: {where} quantizes no weight; compressed-tensors stores quantized weights")
        if m.qconfig.bias is not None:
            raise ValueError(f"export: {where} quantizes its bias; compressed-tensors has no bias quantization")
        spec = m._qspecs["weight"]
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
    config = config if config is not None else getattr(model, "qcore_config", None)
    if not isinstance(config, ModelConfig):
        raise ValueError("ct_quantization_config: the model carries no qcore config (pass config=)")
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
            if role not in m._calibrated:
                raise ValueError(f"export: layer {lay.name!r}: static {role} scales are not calibrated; run "
                                 f"quantize_model with calibration data before exporting")
            s = m._buffers[f"{role}_scale"].detach().float().cpu().numpy().reshape(1)
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
            zp = m._buffers.get(f"{role}_zero_point")
            if zp is not None:
                spec = m._qspecs[role]
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
    config = config if config is not None else getattr(model, "qcore_config", None)
    if not isinstance(config, ModelConfig):
        raise ValueError("export_compressed_tensors: the model carries no qcore config (quantize it with "
                         "qcore.adapters.quantize_model, or pass config=)")
    if not any(isinstance(m, _QuantMixin) for m in model.modules()):
        raise ValueError("export_compressed_tensors: the model has no qcore quantized modules; run quantize_model "
                         "first")
    hf_config = getattr(model, "config", None)
    if hf_config is None or not hasattr(hf_config, "to_dict"):
        raise TypeError("export_compressed_tensors: the model has no transformers config (model.config)")
    dtype = _model_dtype(model)
    if dtype not in _MODEL_DTYPES:
        raise ValueError(f"export_compressed_tensors: model dtype {dtype} is not float32, bfloat16 or float16")
    st = CT.SCALE_DTYPES[_MODEL_DTYPES[dtype]]
    directory = pathlib.Path(directory)
    check_destination(directory, overwrite)
    _check_config_describes(model, config)
    if _online_rotations(model, config):
        raise ValueError("export_compressed_tensors: the model carries online rotations (QuaRot / SpinQuant "
                         "InputRotation hooks), which compressed-tensors' loaders would not apply; fuse-only "
                         "rotations export fine")
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

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(directory)
    try:
        write_metadata(tmp, hf_config, qdict, type(model).__name__, getattr(model, "generation_config", None))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_shards(tmp, records, max_bytes, progress=progress)
        replace_dir(tmp, directory, recheck=lambda: check_destination(directory, overwrite))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = tuple(sorted(p.name for p in directory.iterdir()))
    size = sum((directory / f).stat().st_size for f in files)
    return CTExportInfo(str(directory), ctc.format, files, size, {lay.name: lay.fmt.value for lay in layers
                                                                  if lay.fmt is not None},
                        report, not bad, tuple(notes))


# ---------------------------------------------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------------------------------------------


def _ct_is_match(name: str, module: nn.Module, target: str) -> bool:
    """compressed-tensors' ``is_match`` for one target: ``re:`` (``re.match``), an exact name, or a class name of
    the module's MRO."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    if target == name:
        return True
    return any(c.__name__ == target for c in type(module).__mro__ if issubclass(c, nn.Module))


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


def _module_groups(model: nn.Module, ctc: CT.CTConfig) -> dict[str, str]:
    """Module name -> config group (the first group whose targets match it and that ``ignore`` does not)."""
    out = {}
    for name, m in model.named_modules():
        if type(m) is not nn.Linear:
            continue
        if any(_ct_is_match(name, m, t) for t in ctc.ignore):
            continue
        for g, s in ctc.config_groups.items():
            if any(_ct_is_match(name, m, t) for t in s.targets):
                out[name] = g
                break
    return out


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
_ST_TORCH = {st: t for t, st in _TORCH_ST.items()}
_FLOAT_ST = ("F32", "BF16", "F16")


class _Reader:
    def __init__(self, d: pathlib.Path):
        from qcore.formats.inspect import checkpoint_files
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
            t = t.view(_ST_TORCH[e.dtype])
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
    from transformers import AutoConfig, AutoModelForCausalLM

    d = pathlib.Path(directory)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{str(d)!r} is not a checkpoint directory (no config.json)")
    raw = json.loads((d / "config.json").read_text()).get("quantization_config")
    if not isinstance(raw, dict) or raw.get("quant_method") != CT.QUANT_METHOD:
        got = raw.get("quant_method") if isinstance(raw, dict) else None
        raise ValueError(f"{str(d)!r}: quantization_config.quant_method is {got!r}; expected "
                         f"{CT.QUANT_METHOD!r} (qcore.adapters.from_pretrained loads 'quark' and 'qcore')")
    ctc = CT.CTConfig.from_dict(raw)
    reader = _Reader(d)
    hf = AutoConfig.from_pretrained(d, local_files_only=True)
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
        model = AutoModelForCausalLM.from_config(hf, dtype=dtype).eval()
    own = ctc.qcore if isinstance(ctc.qcore, dict) and "config" in ctc.qcore else None
    config = ModelConfig.from_dict(own["config"]) if own is not None else config_from_ct(model, ctc)
    from .quantizer import _set_module, plan_model
    plans = plan_model(model, config)
    which = _module_groups(model, ctc)
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
            raise CorruptCheckpointError(f"{where}: quantized by the qcore config but matched by no config group "
                                         f"of the compressed-tensors config")
        g = which[p.name]
        fmt = ctc.scheme_format(g)
        q = QUANT_CLASSES[nn.Linear].from_module(m, p.config, name=p.name)
        spec = q._qspecs["weight"]
        want = CT.spec_to_args(spec, role="weight", where=f"{where} weight")
        have = ctc.config_groups[g].weights
        if have is None or CT.args_to_spec(have, role="weight")[0].dtype.bits != spec.dtype.bits or \
                (want.type, want.strategy, want.group_size, want.block_structure) != \
                (have.type, have.strategy, have.group_size, have.block_structure):
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
            if not q._qspecs[role].symmetric:
                reader.check(zkey, ("I8", "I32", "U8"), None, where)
            acts[role] = (key, zkey if not q._qspecs[role].symmetric else None)
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
        reader.check(k, _FLOAT_ST if t.is_floating_point() else (_TORCH_ST[t.dtype],), tuple(t.shape),
                     f"tensor {k!r}")
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
                    codes, scales, zp = CT.decode_weight(arrays, spec, shape, fmt=fmt, dtypes=dts, where=where)
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
                q._buffers[f"{role}_scale"] = torch.from_numpy(np.array(s, np.float32)).reshape(q._static_shape(role))
                if zkey is not None:
                    rs = q._qspecs[role]
                    k = 0 if rs.dtype.signed else 1 << (rs.dtype.bits - 1)
                    z = float(reader.array(zkey).reshape(-1)[0]) + k
                    if not rs.qmin <= z <= rs.qmax:
                        raise CorruptCheckpointError(f"{where}: tensor {zkey!r} is out of range for {rs.dtype.name}")
                    q._buffers[f"{role}_zero_point"] = torch.full(q._static_shape(role), z)
                q._calibrated.add(role)
            _set_module(model, p.name, q)
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
        raise CorruptCheckpointError(f"the checkpoint holds tensors the config does not explain: {left[:5]}"
                                     f"{' ...' if len(left) > 5 else ''}")
    model.qcore_config = config
    if device is not None:
        model.to(device)
    return model.eval()

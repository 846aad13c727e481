"""Named quantization schemes, as data: the names users know from AMD Quark.

``PRESETS`` maps a name to its roles; each role is ``(format, granularity, mode)``:

- format: a qcore format name (``"float8_e4m3fn"``, ``"int4"``, ``"uint4"``, ``"mxfp4"``, ``"mx9"``, ``"nvfp4"``, ...);
- granularity: ``"tensor"``, ``"channel"`` (weights: per output channel), ``"token"`` (activations, dynamic),
  ``"group"`` (groups of ``group_size`` along the input / feature axis) or ``"block"`` (the block format's own
  blocks along the input / feature axis; ``group_size`` overrides the block size);
- mode: ``"static"`` (calibrated; weights: from the weight), ``"dynamic"`` (per call) or
  ``"dynamic_calibrated_tensor_scale"`` (two-level formats: per-call block scales under a calibrated per-tensor
  scale, ``TensorScale.GIVEN``);
- an optional fourth entry on a weight: its observer's ``kind`` (``"four_over_six"``, ``"exponent_search"``: the
  searched FP4 block scales of ``qcore.adapters.FourOverSix`` / ``ExponentSearch``; default MinMax).

``preset(name, group_size=..., kv_cache=..., exclude=...)`` builds the ``ModelConfig``. OCP MX float formats
(MXFP4/6/8) use Quark's E8M0 rule (``ScaleMode.EVEN``) so that results match Quark; ``scale_mode=`` picks another
(``FLOOR`` is OCP's). MX9/MX6/bfp16/MXINT8 keep their formats' own rule (FLOOR, as Quark's mx9/mx6/bfp16).
Every preset that Quark 0.13 also writes equals ``ModelConfig.from_quark`` of Quark's own config (tested), except
``int4_fp8``: Quark rounds the weight to fp8 per tensor and then to int4 per channel (two quantizers); qcore's
preset is the int4 per-channel rounding alone.
The first list comes from Quark's ``quantize_quark.py`` (``--quant_scheme``), the second from Quark 0.13's
scheme names.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Optional

import qcore
from qcore import PerChannel, PerGroup, PerTensor, ScaleMode, TensorScale
from qcore.dtypes import BlockDType, FloatDType
from qcore.formats import gguf_mixes as GM

from .config import KVCacheConfig, LayerConfig, MinMax, ModelConfig, TensorConfig, observer_from_dict

__all__ = ["PRESETS", "DEFAULT_GROUP_SIZE", "GGUF_MIX_PRESETS", "mix_of_preset", "preset", "preset_names",
           "similar_schemes", "takes_group_size"]

DEFAULT_GROUP_SIZE = 128

_FP8 = "float8_e4m3fn"
_W = "weight"
_A = "input"


def _wa(w, a=None):
    return {_W: w, **({_A: a} if a else {})}


#: name -> {role: (format, granularity, mode)}; one source of truth for every preset
PRESETS: dict[str, dict[str, tuple]] = {
    # Quark quantize_quark.py --quant_scheme
    "w_fp8_a_fp8": _wa((_FP8, "tensor", "static"), (_FP8, "tensor", "static")),
    "w_int8_a_int8_per_tensor_sym": _wa(("int8", "tensor", "static"), ("int8", "tensor", "static")),
    "w_int8_per_channel_sym": _wa(("int8", "channel", "static")),
    "w_int8_per_channel_a_int8_per_tensor_sym": _wa(("int8", "channel", "static"), ("int8", "tensor", "static")),
    "w_int8_a_int8_per_token_dynamic": _wa(("int8", "channel", "static"), ("int8", "token", "dynamic")),
    "w_int4_per_group_sym": _wa(("int4", "group", "static")),
    "w_uint4_per_group_asym": _wa(("uint4", "group", "static")),
    "w_int2_per_group_asym": _wa(("int2_asym", "group", "static")),
    "w_mxfp4_a_mxfp4": _wa(("mxfp4", "block", "static"), ("mxfp4", "block", "dynamic")),
    "w_mxfp6_e2m3_a_mxfp6_e2m3": _wa(("mxfp6_e2m3", "block", "static"), ("mxfp6_e2m3", "block", "dynamic")),
    "w_mxfp6_e3m2_a_mxfp6_e3m2": _wa(("mxfp6_e3m2", "block", "static"), ("mxfp6_e3m2", "block", "dynamic")),
    "w_mxfp4_a_mxfp6_e2m3": _wa(("mxfp4", "block", "static"), ("mxfp6_e2m3", "block", "dynamic")),
    "w_mxfp8_a_mxfp8": _wa(("mxfp8_e4m3", "block", "static"), ("mxfp8_e4m3", "block", "dynamic")),
    "w_mxint8_a_mxint8": _wa(("mxint8", "block", "static"), ("mxint8", "block", "dynamic")),
    "w_mx9_a_mx9": _wa(("mx9", "block", "static"), ("mx9", "block", "dynamic")),
    "w_mx6_a_mx6": _wa(("mx6", "block", "static"), ("mx6", "block", "dynamic")),
    "w_bfp16_a_bfp16": _wa(("bfp16", "block", "static"), ("bfp16", "block", "dynamic")),
    # qcore: W4A4 int (QuaRot / SpinQuant's setting): int4 per-group weights, int4 per-token dynamic activations
    "w_int4_a_int4_per_token_dynamic": _wa(("int4", "group", "static"), ("int4", "token", "dynamic")),
    # Quark 0.13 scheme names
    "fp8": _wa((_FP8, "tensor", "static"), (_FP8, "tensor", "static")),
    "ptpc_fp8": _wa((_FP8, "channel", "static"), (_FP8, "token", "dynamic")),
    "int8": _wa(("int8", "tensor", "static"), ("int8", "tensor", "static")),
    "int4_wo_32": _wa(("int4", "group32", "static")),
    "int4_wo_64": _wa(("int4", "group64", "static")),
    "int4_wo_128": _wa(("int4", "group128", "static")),
    "uint4_wo_32": _wa(("uint4", "group32", "static")),
    "uint4_wo_64": _wa(("uint4", "group64", "static")),
    "uint4_wo_128": _wa(("uint4", "group128", "static")),
    "mxfp4": _wa(("mxfp4", "block", "static"), ("mxfp4", "block", "dynamic")),
    "mxfp4_weight_only": _wa(("mxfp4", "block", "static")),
    "mxfp6_e2m3": _wa(("mxfp6_e2m3", "block", "static"), ("mxfp6_e2m3", "block", "dynamic")),
    "mxfp6_e3m2": _wa(("mxfp6_e3m2", "block", "static"), ("mxfp6_e3m2", "block", "dynamic")),
    "mxfp4_fp8": _wa(("mxfp4", "block", "static"), (_FP8, "tensor", "static")),
    # NVFP4 (Quark's nvfp4): activations have per-call block scales under a calibrated per-tensor scale
    "nvfp4": _wa(("nvfp4", "block", "static"), ("nvfp4", "block", "dynamic_calibrated_tensor_scale")),
    "mx6": _wa(("mx6", "block", "static"), ("mx6", "block", "dynamic")),
    "mx9": _wa(("mx9", "block", "static"), ("mx9", "block", "dynamic")),
    "bfp16": _wa(("bfp16", "block", "static"), ("bfp16", "block", "dynamic")),
    # Quark's int4_fp8 rounds the weight to fp8 per tensor first, then to int4 per channel; qcore's preset is
    # the int4 per-channel rounding alone (one quantizer), with fp8 per-tensor dynamic activations as Quark's
    "int4_fp8": _wa(("int4", "channel", "static"), (_FP8, "tensor", "dynamic")),
    # qcore's searched FP4 weight scales (same files, same loaders; docs/numerics.md "Searched FP4 block scales")
    "nvfp4_4o6": _wa(("nvfp4", "block", "static", "four_over_six"),
                     ("nvfp4", "block", "dynamic_calibrated_tensor_scale")),
    "w_mxfp4_a_mxfp4_search": _wa(("mxfp4", "block", "static", "exponent_search"), ("mxfp4", "block", "dynamic")),
    "mxfp4_weight_only_search": _wa(("mxfp4", "block", "static", "exponent_search")),
}

_KV = {"fp8": _FP8, "float8_e4m3fn": _FP8, "fp8_e4m3": _FP8}


#: llama.cpp's mixes as preset names (``quantize_model(model, "gguf_q4_k_m")``, ``qcore quantize --scheme
#: gguf_q4_k_m``) -> the mix; resolved on a model by ``qcore.adapters.gguf_mix.gguf_mix`` (a type per tensor)
GGUF_MIX_PRESETS = {f"gguf_{m.lower()}": m for m in GM.MIX_NAMES}


def mix_of_preset(name) -> Optional[str]:
    """The llama.cpp mix a preset name stands for (``"gguf_q4_k_m"`` -> ``"Q4_K_M"``), or None."""
    return GGUF_MIX_PRESETS.get(name) if isinstance(name, str) else None


def similar_schemes(name: str) -> list[str]:
    """Up to three preset names (llama.cpp's mixes included) close to ``name``: the "did you mean" of every refusal
    of an unknown scheme name."""
    return difflib.get_close_matches(str(name).lower(), [*PRESETS, *GGUF_MIX_PRESETS], n=3)


def preset_names() -> list[str]:
    """The names ``preset`` builds a config from. llama.cpp's mixes (``gguf_q4_k_m``, ...) are presets of
    ``quantize_model`` too, resolved on the model: ``GGUF_MIX_PRESETS``."""
    return list(PRESETS)


def _spec(fmt: str, gran: str, group_size: Optional[int], scale_mode: ScaleMode):
    extra: dict[str, Any] = {}
    if fmt == "int2_asym":
        fmt, extra = "int2", {"symmetric": False}
    d = qcore.get_dtype(fmt)
    if gran == "block":
        if not isinstance(d, BlockDType):
            raise ValueError(f"preset role {fmt!r}: 'block' needs a block format")
        over: dict[str, Any] = {}
        if d.scale.mantissa_bits == 0 and isinstance(d.element, FloatDType) and not d.subblock_shift_bits:
            over["scale_mode"] = scale_mode  # OCP MX float formats; mx9/mx6/bfp16/mxint8 keep their own rule
        if group_size is not None:
            over["granularity"] = PerGroup(group_size, axis=1)
        return qcore.make_spec(fmt, axis=1, **over)
    if gran == "tensor":
        return qcore.make_spec(fmt, granularity=PerTensor(), **extra)
    if gran in ("channel", "token"):
        return qcore.make_spec(fmt, granularity=PerChannel(0), **extra)
    if gran.startswith("group"):
        size = int(gran[5:]) if gran[5:] else (group_size or DEFAULT_GROUP_SIZE)
        if gran[5:] and group_size is not None and group_size != size:
            raise ValueError(f"preset: this scheme fixes the group size to {size}; got group_size={group_size}")
        return qcore.make_spec(fmt, granularity=PerGroup(size, axis=1), **extra)
    raise ValueError(f"preset table: unknown granularity {gran!r}")


def takes_group_size(name: str) -> bool:
    """Whether preset ``name`` has a per-group or block role (which ``preset(group_size=)`` sets)."""
    return any(r[1] == "group" or r[1] == "block" or r[1].startswith("group") for r in PRESETS[name].values())


def preset(name: str, *, group_size: Optional[int] = None, kv_cache: Optional[str] = None,
           exclude: Optional[tuple] = None, scale_mode: ScaleMode = ScaleMode.EVEN) -> ModelConfig:
    """The ``ModelConfig`` of a named scheme.

    group_size: the group size of per-group schemes (default 128) or the block size of block formats (default:
        the format's, e.g. 32 for MX); ``int4_wo_64``-style names fix it.
    kv_cache: ``"fp8"`` adds fp8 e4m3 per-tensor static KV-cache scales on ``k_proj``/``v_proj``; None: none.
    exclude: module names/patterns left in float (default: the model's output head).
    scale_mode: the E8M0 rule of MX block scales (default ``EVEN``, Quark's; ``FLOOR`` is OCP's).
    """
    if name in GGUF_MIX_PRESETS:
        raise ValueError(f"preset {name!r} (llama.cpp's {GGUF_MIX_PRESETS[name]}) chooses a GGUF type per tensor from "
                         f"the model's shapes and layer count: give it to quantize_model(model, {name!r}) or use "
                         f"qcore.adapters.gguf_mix(model, {GGUF_MIX_PRESETS[name]!r}).config")
    if name not in PRESETS:
        close = similar_schemes(name)
        raise ValueError(f"unknown preset {name!r}" + (f"; did you mean {close}?" if close else "")
                         + f" Known presets: {', '.join(PRESETS)}; llama.cpp's mixes (resolved on a model by "
                         f"quantize_model): {', '.join(GGUF_MIX_PRESETS)}")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if not isinstance(scale_mode, ScaleMode):
        raise TypeError(f"scale_mode must be a qcore.ScaleMode, got {scale_mode!r}")
    table = PRESETS[name]
    if group_size is not None and not takes_group_size(name):
        raise ValueError(f"preset {name!r} has no per-group or block role: group_size={group_size} does not apply")
    mx_float = [f for f, g, *_ in table.values() if g == "block" and isinstance(qcore.get_dtype(f).element, FloatDType)
                and qcore.get_dtype(f).scale.mantissa_bits == 0 and not qcore.get_dtype(f).subblock_shift_bits]
    if scale_mode is not ScaleMode.EVEN and not mx_float:
        raise ValueError(f"preset {name!r} has no OCP MX float role (MXFP4/6/8): scale_mode={scale_mode.name} does "
                         f"not apply (its formats keep their own scale rule)")
    roles = {}
    for role, (fmt, gran, mode, *obs) in table.items():
        spec = _spec(fmt, gran, group_size, scale_mode)
        if mode == "dynamic_calibrated_tensor_scale":
            spec = dataclasses.replace(spec, tensor_scale_mode=TensorScale.GIVEN)
        observer = observer_from_dict({"kind": obs[0]}) if obs else MinMax()
        roles[role] = TensorConfig(spec, dynamic=mode.startswith("dynamic"), observer=observer)
    kv = None
    if kv_cache is not None:
        if kv_cache not in _KV:
            raise ValueError(f"kv_cache must be one of {sorted(_KV)} or None, got {kv_cache!r}")
        kv = KVCacheConfig(qcore.make_spec(_KV[kv_cache]))
    return ModelConfig(LayerConfig(**roles), exclude=exclude, kv_cache=kv)

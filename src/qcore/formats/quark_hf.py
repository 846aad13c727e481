"""AMD Quark's Hugging Face export format: the ``quantization_config`` of a ``config.json`` whose
``quant_method`` is ``"quark"``, read and written exactly, and its quantization specs converted to and from
``qcore.QuantSpec``.

The one schema (Quark 0.13's ``QConfig.to_dict()`` plus the exporter's ``"export"`` block, as
``QuarkSafetensorsExporter`` writes it; ``tests/formats/data/make_quark_configs.py`` regenerates the test
fixtures with Quark itself):

- ``QuarkSpec``: one tensor quantization spec (Quark's ``QTensorConfig``): every key Quark writes, validated as
  Quark's own ``QTensorConfig`` validates it, unknown keys kept in ``extra`` and absent optional keys recorded
  in ``omitted``, so that ``QuarkSpec.from_dict(d).to_dict() == d``.
- ``QuarkLayerSpec``: the ``{input_tensors, output_tensors, weight, bias, target_device}`` group (Quark's
  ``QLayerConfig``). A role holds ``None``, a ``QuarkSpec``, or a tuple of specs (a JSON list): two-level
  scales (``nvfp4``: the element spec, then an ``is_scale_quant`` per-tensor spec that quantizes its scales) or
  Quark's progressive two-stage quantization (``int4_fp8``'s weight).
- ``QuarkExport``: the ``"export"`` block (``kv_cache_group``, ``min_kv_scale``, ``pack_method``,
  ``weight_format``, ``weight_merge_groups``), kept as data (packing tensors is not this module's job).
- ``QuarkConfig``: the whole ``quantization_config``.

Conversion (``QuarkSpec.to_qcore`` / ``QuarkSpec.from_qcore``, and ``quark_to_qcore`` / ``qcore_to_quark``
for a role's value, lists included) maps the numerics; Quark-only bookkeeping that does not change the numbers
(``observer_cls`` of a static spec, the spelling of ``ch_axis``, ``scale_type`` "float" vs "float32" when the
model is float32, ``enable_buffer_reuse``, ``max_input_numel``) is derived the way Quark 0.13's spec classes
write it, or passed explicitly (``observer=``, ``quark_fields=``). Anything Quark means that qcore cannot
compute the same way raises ``ValueError`` naming the field; ``from_qcore`` converts its result back and raises
unless that gives exactly the spec it was given, so nothing is dropped silently in either direction.

Axes
----
qcore describes granularities on a canonical layout, with positive axes:

- weights ``[out_features, in_features, *kernel]``: per output channel ``PerChannel(0)``, groups along the
  input features ``PerGroup(size, 1)``, 2-D blocks ``PerBlock((bo, bi), axes=(0, 1))``;
- activations (``input`` / ``output``) as the 2-D view ``[tokens, features]``: per token ``PerChannel(0)``,
  per feature ``PerChannel(1)``, feature groups (MX) ``PerGroup(size, 1)``;
- bias ``[out_features]``: ``PerChannel(0)``, ``PerGroup(size, 0)``.

Quark's ``ch_axis`` is an axis of the tensor as the module sees it. For ``per_channel`` it is the axis that
*indexes* the scales: ``PerChannelMinMaxObserver._forward`` (``quark/torch/quantization/observer/observer.py``
lines 545-558, Quark 0.13) permutes ``ch_axis`` to the front and reduces over everything else. For
``per_group`` and the block formats it is the axis the groups *run along*: ``PerGroupMinMaxObserver._forward``
(lines 1093-1101) and ``utils.reshape_to_blocks`` (``quark/torch/quantization/utils.py`` line 226) move
``ch_axis`` last and cut it into groups. Quark's HF export packs ``nn.Linear`` weights only (2-D
``[out, in]``), and a Linear's input is ``[batch, seq, features]``. So, per role:

======== ============ ============================ =============================================
role     qscheme      Quark ch_axis -> qcore        written by ``from_qcore`` (Quark 0.13's choice)
======== ============ ============================ =============================================
weight   per_channel  0 -> PerChannel(0);           PerChannel(0) -> 0 (``int4_wo_per_channel``,
                      1, -1 -> PerChannel(1)        ``ptpc_fp8``: template.py lines 91, 298); PerChannel(1) -> 1
weight   per_group,   1, -1 -> PerGroup(g, 1);      PerGroup(g, 1) -> -1 (every 0.13 template and OCP MX
         MX / mx9 ... 0 -> PerGroup(g, 0)           spec, template.py lines 63, 157); PerGroup(g, 0) -> 0
input,   per_channel  1 -> PerChannel(0) per token; PerChannel(0) -> 1 (``ptpc_fp8``'s input, template.py
output                -1 -> PerChannel(1)           line 299); PerChannel(1) -> -1
input,   per_group,   -1 -> PerGroup(g, 1)          PerGroup(g, 1) -> -1
output   MX / mx9 ...
bias     per_channel, 0, -1 -> axis 0               PerChannel(0) -> 0, PerGroup(g, 0) -> -1
         per_group
======== ============ ============================ =============================================

Activation ``per_channel`` with ``ch_axis=1`` is per token for a batch of one (Quark applies it to the
``[batch, seq, features]`` input: checked with Quark 0.13, ``FP8E4M3PerChannelSpec(ch_axis=1, is_dynamic=True)``
on a ``[1, 5, 64]`` input scales each token by its own amax / 448; Quark's older example notes "only support
batch_size=1 for activation per-token"), and that is how vLLM reads it (``QuarkConfig._is_dynamic_per_token_w8a8``:
an input ``per_channel`` spec is per token, whatever ``ch_axis`` says). A ``ch_axis`` outside the table raises
``ValueError``; ``from_qcore`` writes the right column unless ``quark_fields={"ch_axis": ...}`` picks another
spelling of the same axis.

Numerics
--------
- Integers: Quark's symmetric scale is ``amax / ((qmax - qmin) / 2)`` over the full range (int8: /127.5), its
  asymmetric one ``(max - min) / (qmax - qmin)`` with an int32 zero point: qcore's rules
  (``docs/numerics.md`` "Scales"). Quark's symmetric *unsigned* spec (zero point 0, scale ``amax / 7.5`` for
  uint4) and its float zero points (``zero_point_type: "float32"``) have no qcore spelling (``ValueError``).
- ``scale_type`` "float" and null mean "the model's dtype" (Quark casts amax to the input dtype before
  dividing): ``to_qcore(model_dtype=...)`` (default float32) resolves them; "float32" / "float16" / "bfloat16"
  are fixed. "pof2" (Quark's power-of-two observers, exponent ``round(-log2(scale))``) and E5M3 scales
  (Quark's E5M3 saturates at 114688, qcore's ``float8_e5m3`` at 122880) raise ``ValueError``.
- OCP MX (``scale_format: "e8m0"``): ``scale_calculation_mode`` "even" (Quark's default) is
  ``ScaleMode.EVEN``, "floor" ``FLOOR``, "ceil" ``CEIL``; Quark computes floor/ceil with float32 ``log2``,
  one binade high just below some powers of two, where qcore is exact (``docs/numerics.md``). Quark's MXINT8
  (``dtype: "mx"``, ``mx_element_dtype: "int8"``) "even" rounds amax to 8 significant bits
  (``get_dtype_params(int8)`` has 8 mantissa bits) while ``ScaleMode.EVEN`` rounds to int8's 6: not
  represented (``ValueError``); MXINT8 "floor" is ``make_spec("mxint8")``.
- ``mx6`` / ``mx9`` / ``bfp16`` are ``make_spec("mx6" / "mx9" / "bfp16")`` blocked along the mapped axis
  (``docs/quark_block_semantics.md``: Quark-Torch flushes subnormals, passes NaN/Inf through and takes bfp16's
  exponent from float32 ``log2``; qcore documents and tests these differences). Quark ignores
  ``scale_calculation_mode`` for these three; its ``fake_quantize_bfp16`` always uses blocks of 8.
- Two-level (a list whose second spec has ``is_scale_quant``: ``nvfp4``): ``make_spec("nvfp4")``-style specs,
  ``tensor_scale_mode=TensorScale.GIVEN`` when the scale-of-scales spec is static (calibrated, stored in the
  checkpoint), ``AMAX`` when it is dynamic. qcore computes the two-level arithmetic as torchao does; the
  differences from Quark's (fake-quantized float32 block scales, zero blocks) are in ``docs/numerics.md``
  ("Two-level scales").
- Rounding: only "half_even" (and null for the block formats, which round half to even) is accepted. Quark's
  "round" and "floor" mean different things on its CPU path (``torch.round``, half to even, whatever the
  mode) and its GPU kernel (``floor(x + 0.5)``, and ``std::round`` for "floor"): ``ValueError``.
- A dynamic spec must use a min/max observer (its scale is then the qcore rule); a static spec's observer only
  decides how calibration picks the scale, which is passed to qcore at the call.

``QuarkSpec.to_qcore`` returns ``(spec, is_dynamic)``; the block formats ``mx`` / ``mx6`` / ``mx9`` /
``bfp16`` have no static form in Quark (``is_dynamic`` is null: the exponents come from the tensor at every
call) and report ``True``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

from qcore import (DTYPES, BlockDType, FloatDType, IntDType, PerBlock, PerChannel, PerGroup, PerTensor, QuantSpec,
                   RoundingMode, ScaleMode, TensorScale, get_dtype, make_spec)

__all__ = [
    "Role",
    "QuarkSpec",
    "QuarkLayerSpec",
    "QuarkExport",
    "QuarkConfig",
    "RoleValue",
    "quark_to_qcore",
    "qcore_to_quark",
]


class Role(enum.Enum):
    """Which tensor of a layer a spec quantizes (fixes the canonical layout, see the module docstring)."""

    WEIGHT = "weight"
    INPUT = "input"
    OUTPUT = "output"
    BIAS = "bias"


# ---- Quark 0.13's vocabulary (quark/torch/quantization/config/type.py, observer/__init__.py) ----------------
_QUARK_DTYPES = ("int8", "uint8", "uint16", "int16", "int32", "uint32", "int4", "uint4", "int3", "int2", "uint2",
                 "bfloat16", "float16", "fp8_e5m2", "fp8_e4m3", "fp8_e5m3", "fp6_e3m2", "fp6_e2m3", "fp4",
                 "mx", "mx6", "mx9", "bfp16")
_NON_SCALED = ("mx", "mx6", "mx9", "bfp16")     # constants.USING_NON_SCALED_QUANT: no observer, no stored scale
_CAST_ONLY = ("bfloat16", "float16")            # constants.ONLY_DTYPE_CHANGE: a cast, not a quantization
_INT_DTYPES = ("int2", "int3", "int4", "int8", "int16", "int32", "uint2", "uint4", "uint8", "uint16", "uint32")
_QSCHEMES = ("per_tensor", "per_channel", "per_group", "per_block")
_ROUND_METHODS = ("round", "floor", "half_even")                     # RoundType names (2, 3, 8)
_SCALE_TYPES = ("float", "pof2", "float32", "float16", "bfloat16", "float8_e5m3", "float8_e8m0fnu")
_ZERO_POINT_TYPES = ("int32", "float32")
_SCALE_FORMATS = ("e8m0", "e4m3", "e5m3", "float32")                # ObserverBase.get_scale
_SCALE_MODES = {"even": ScaleMode.EVEN, "floor": ScaleMode.FLOOR, "ceil": ScaleMode.CEIL}
_PER_TENSOR_OBSERVERS = frozenset({
    "PerTensorMinMaxObserver", "PerTensorPowOf2MinMaxObserver", "PerTensorPowOf2MinMSEObserver",
    "PerTensorHistogramObserver", "PerTensorHistogramObserverPro", "PerTensorPercentileObserver",
    "PerTensorMSEObserver", "TQTObserver", "LSQObserver"})
_PER_CHANNEL_OBSERVERS = frozenset({
    "PerChannelMinMaxObserver", "PerChannelPowOf2MinMaxObserver", "PerChannelPowOf2MinMSEObserver", "LSQObserver"})
_PER_GROUP_OBSERVERS = frozenset({
    "PerBlockMXObserver", "PerBlockMXBufferReuseObserver", "PerBlockMXDiffsObserver", "PerBlockBFPObserver",
    "PerBlock2DMinMaxObserver", "PerGroupMinMaxObserver"})
_OBSERVERS = (_PER_TENSOR_OBSERVERS | _PER_CHANNEL_OBSERVERS | _PER_GROUP_OBSERVERS
              | {"PlaceholderObserver", "UniformScalingObserver", "ObserverBase"})
# Observers whose scale is the plain amax rule (what a dynamic qcore spec computes); the buffer-reuse MX
# observer is a memory variant of PerBlockMXObserver.
_MINMAX_OBSERVERS = frozenset({"PerTensorMinMaxObserver", "PerChannelMinMaxObserver", "PerGroupMinMaxObserver",
                               "PerBlockMXObserver", "PerBlockMXBufferReuseObserver"})
_DEFAULT_MAX_INPUT_NUMEL = 4 * 1024 * 1024      # QTensorConfig.max_input_numel's default
_QUANT_MODES = ("eager_mode", "fx_graph_mode")
_TARGET_DEVICES = ("cpu", "ipu")
_WEIGHT_FORMATS = ("real_quantized", "fake_quantized")
_PACK_METHODS = ("reorder", "order")


# ---- small validation helpers --------------------------------------------------------------------------------
def _typename(v: Any) -> str:
    return type(v).__name__


def _check_choice(owner: str, name: str, value: Any, choices: Sequence[str], *, nullable: bool = True) -> None:
    if value is None and nullable:
        return
    if not isinstance(value, str):
        raise TypeError(f"{owner}.{name} must be a str{' or None' if nullable else ''}, got {value!r} "
                        f"({_typename(value)})")
    if value not in choices:
        raise ValueError(f"{owner}.{name}: expected one of {', '.join(choices)}{' or null' if nullable else ''}, "
                         f"got {value!r}")


def _check_bool(owner: str, name: str, value: Any, *, nullable: bool) -> None:
    if value is None and nullable:
        return
    if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be a bool{' or None' if nullable else ''}, got {value!r} "
                        f"({_typename(value)})")


def _check_int(owner: str, name: str, value: Any, *, nullable: bool) -> None:
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int{' or None' if nullable else ''}, got {value!r} "
                        f"({_typename(value)})")


def _freeze(value: Any, where: str) -> Any:
    """A JSON value as an immutable one (dict -> read-only mapping, list -> tuple); raises on non-JSON data."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: JSON object keys must be str, got {k!r} ({_typename(k)})")
            out[k] = _freeze(v, f"{where}.{k}")
        return MappingProxyType(out)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v, f"{where}[{i}]") for i, v in enumerate(value))
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise TypeError(f"{where}: expected JSON data (dict, list, str, number, bool, None), got {_typename(value)}")


def _thaw(value: Any) -> Any:
    """The inverse of ``_freeze``: plain dicts and lists, as ``json`` reads them."""
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def _check_mapping(owner: str, d: Any) -> Mapping:
    if not isinstance(d, Mapping):
        raise TypeError(f"{owner}.from_dict: expected a dict, got {_typename(d)}")
    for k in d:
        if not isinstance(k, str):
            raise TypeError(f"{owner}.from_dict: keys must be str, got {k!r} ({_typename(k)})")
    return d


def _missing(owner: str, d: Mapping, required: Sequence[str]) -> None:
    absent = [k for k in required if k not in d]
    if absent:
        raise ValueError(f"{owner}.from_dict: missing field(s) {', '.join(absent)} (required: "
                         f"{', '.join(required)})")


def _split_extra(d: Mapping, known: Sequence[str], owner: str) -> MappingProxyType:
    return MappingProxyType({k: _freeze(v, f"{owner}.{k}") for k, v in d.items() if k not in known})


def _check_extra_and_omitted(owner: str, obj: Any, known: Sequence[str], optional: Mapping[str, Any]) -> None:
    """``extra`` holds only unknown keys; ``omitted`` names optional keys whose field keeps its default."""
    if not isinstance(obj.extra, Mapping):
        raise TypeError(f"{owner}.extra must be a mapping, got {_typename(obj.extra)}")
    clash = [k for k in obj.extra if k in known]
    if clash:
        raise ValueError(f"{owner}.extra must hold unknown keys only; {', '.join(clash)} are fields")
    object.__setattr__(obj, "extra", MappingProxyType({k: _freeze(v, f"{owner}.extra.{k}")
                                                        for k, v in obj.extra.items()}))
    if not isinstance(obj.omitted, (frozenset, set, tuple, list)):
        raise TypeError(f"{owner}.omitted must be a frozenset of field names, got {_typename(obj.omitted)}")
    omitted = frozenset(obj.omitted)
    bad = sorted(k for k in omitted if k not in optional)
    if bad:
        raise ValueError(f"{owner}.omitted: {', '.join(map(repr, bad))} cannot be omitted (optional keys: "
                         f"{', '.join(optional)})")
    for k in omitted:
        if getattr(obj, k) != optional[k]:
            raise ValueError(f"{owner}.omitted names {k!r}, but {owner}.{k} is {getattr(obj, k)!r}, not the "
                             f"default {optional[k]!r} an absent key means")
    object.__setattr__(obj, "omitted", omitted)


def _role(role: Any) -> Role:
    if isinstance(role, Role):
        return role
    try:
        return Role(role)
    except ValueError:
        raise ValueError(f"role: expected one of {', '.join(r.value for r in Role)} (or a Role), got {role!r}") \
            from None


def _model_dtype(model_dtype: Any) -> FloatDType:
    d = get_dtype(model_dtype)
    if d.name not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"model_dtype: expected float32, float16 or bfloat16, got {model_dtype!r}")
    return d  # type: ignore[return-value]


# ---- QuarkSpec ---------------------------------------------------------------------------------------------------
_SPEC_KEYS = ("dtype", "is_dynamic", "qscheme", "ch_axis", "group_size", "block_size", "symmetric", "round_method",
              "scale_type", "zero_point_type", "scale_format", "scale_calculation_mode", "mx_element_dtype",
              "observer_cls", "is_scale_quant", "enable_buffer_reuse", "max_input_numel")
_SPEC_REQUIRED = ("dtype", "is_dynamic", "ch_axis", "group_size", "symmetric")   # QTensorConfig.from_dict
_SPEC_OPTIONAL = {"qscheme": None, "block_size": None, "round_method": None, "scale_type": None,
                  "zero_point_type": "int32", "scale_format": None, "scale_calculation_mode": None,
                  "mx_element_dtype": None, "observer_cls": None, "is_scale_quant": False,
                  "enable_buffer_reuse": False, "max_input_numel": _DEFAULT_MAX_INPUT_NUMEL}

# (role, family) -> {Quark ch_axis: canonical axis}; family "channel" (per_channel) or "group" (per_group and
# the block formats). _WRITE_AXIS: the ch_axis Quark 0.13's spec classes write for each canonical axis.
_READ_AXIS = {
    (Role.WEIGHT, "channel"): {0: 0, 1: 1, -1: 1},
    (Role.WEIGHT, "group"): {0: 0, 1: 1, -1: 1},
    (Role.INPUT, "channel"): {1: 0, -1: 1},
    (Role.INPUT, "group"): {-1: 1},
    (Role.OUTPUT, "channel"): {1: 0, -1: 1},
    (Role.OUTPUT, "group"): {-1: 1},
    (Role.BIAS, "channel"): {0: 0, -1: 0},
    (Role.BIAS, "group"): {0: 0, -1: 0},
}
_WRITE_AXIS = {
    (Role.WEIGHT, "channel"): {0: 0, 1: 1},
    (Role.WEIGHT, "group"): {0: 0, 1: -1},
    (Role.INPUT, "channel"): {0: 1, 1: -1},
    (Role.INPUT, "group"): {1: -1},
    (Role.OUTPUT, "channel"): {0: 1, 1: -1},
    (Role.OUTPUT, "group"): {1: -1},
    (Role.BIAS, "channel"): {0: 0},
    (Role.BIAS, "group"): {0: -1},
}
_LAYOUT = {Role.WEIGHT: "[out_features, in_features, *kernel]", Role.INPUT: "[tokens, features]",
           Role.OUTPUT: "[tokens, features]", Role.BIAS: "[out_features]"}


def _quark_element_name(el: Union[IntDType, FloatDType]) -> Optional[str]:
    """The Quark dtype name of a qcore element format (Quark's names are qcore aliases), or None."""
    for name in _QUARK_DTYPES:
        if name in _NON_SCALED or name in _CAST_ONLY:
            continue
        try:
            if get_dtype(name) == el:
                return name
        except ValueError:  # int32 / uint32 / fp8_e5m3 ... are not in qcore's table under that meaning
            continue
    return None


def _mx_block(element: Union[IntDType, FloatDType]) -> Optional[BlockDType]:
    """qcore's OCP MX block format (E8M0 scales, one level, no sub-blocks) with ``element``."""
    for d in DTYPES.values():
        if (isinstance(d, BlockDType) and d.element == element and d.scale.name == "float8_e8m0fnu"
                and d.subblock_size == 1 and not d.bump_on_overflow and d.tensor_scale is TensorScale.NONE):
            return d
    return None


@dataclass(frozen=True)
class QuarkSpec:
    """One Quark quantization spec (``QTensorConfig``), field for field as Quark 0.13 writes it.

    Fields hold JSON values (strings for Quark's enums: ``dtype`` "fp8_e4m3", ``qscheme`` "per_group",
    ``round_method`` "half_even", ``scale_type`` "float", ``observer_cls`` "PerBlockMXObserver", ...);
    ``block_size`` is a tuple (a JSON list). ``extra`` keeps keys this schema does not know; ``omitted`` names the
    optional keys the source dict did not have (the field then holds what Quark assumes for an absent key), so
    ``from_dict(d).to_dict() == d``. Validated at construction like Quark's own ``QTensorConfig``.
    """

    dtype: str
    is_dynamic: Optional[bool]
    qscheme: Optional[str] = None
    ch_axis: Optional[int] = None
    group_size: Optional[int] = None
    block_size: Optional[Tuple[int, int]] = None
    symmetric: Optional[bool] = None
    round_method: Optional[str] = None
    scale_type: Optional[str] = None
    zero_point_type: Optional[str] = "int32"
    scale_format: Optional[str] = None
    scale_calculation_mode: Optional[str] = None
    mx_element_dtype: Optional[str] = None
    observer_cls: Optional[str] = None
    is_scale_quant: bool = False
    enable_buffer_reuse: bool = False
    max_input_numel: int = _DEFAULT_MAX_INPUT_NUMEL
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)
    omitted: frozenset = frozenset()

    def __post_init__(self) -> None:
        o = "QuarkSpec"
        _check_choice(o, "dtype", self.dtype, _QUARK_DTYPES, nullable=False)
        _check_bool(o, "is_dynamic", self.is_dynamic, nullable=True)
        _check_choice(o, "qscheme", self.qscheme, _QSCHEMES)
        _check_int(o, "ch_axis", self.ch_axis, nullable=True)
        _check_int(o, "group_size", self.group_size, nullable=True)
        if self.group_size is not None and not (self.group_size > 0 or self.group_size == -1):
            raise ValueError(f"QuarkSpec.group_size: expected a positive int or -1 (the whole axis), got "
                             f"{self.group_size}")
        if self.block_size is not None:
            bs = self.block_size
            if (not isinstance(bs, (tuple, list)) or len(bs) != 2
                    or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in bs)):
                raise ValueError(f"QuarkSpec.block_size: expected two positive ints or None, got {bs!r}")
            object.__setattr__(self, "block_size", tuple(bs))
        _check_bool(o, "symmetric", self.symmetric, nullable=True)
        _check_choice(o, "round_method", self.round_method, _ROUND_METHODS)
        _check_choice(o, "scale_type", self.scale_type, _SCALE_TYPES)
        _check_choice(o, "zero_point_type", self.zero_point_type, _ZERO_POINT_TYPES)
        _check_choice(o, "scale_format", self.scale_format, _SCALE_FORMATS)
        _check_choice(o, "scale_calculation_mode", self.scale_calculation_mode, tuple(_SCALE_MODES))
        _check_choice(o, "mx_element_dtype", self.mx_element_dtype, _QUARK_DTYPES)
        _check_choice(o, "observer_cls", self.observer_cls, tuple(sorted(_OBSERVERS)))
        _check_bool(o, "is_scale_quant", self.is_scale_quant, nullable=False)
        _check_bool(o, "enable_buffer_reuse", self.enable_buffer_reuse, nullable=False)
        _check_int(o, "max_input_numel", self.max_input_numel, nullable=False)
        _check_extra_and_omitted(o, self, _SPEC_KEYS, _SPEC_OPTIONAL)
        self._check_like_quark()

    def _check_like_quark(self) -> None:
        """The consistency rules of Quark 0.13's ``QTensorConfig.__post_init__`` (a spec Quark would reject)."""
        d = self.dtype
        if d in _CAST_ONLY:
            if self.observer_cls != "PlaceholderObserver":
                raise ValueError(f"QuarkSpec.observer_cls: dtype {d!r} is a cast and needs PlaceholderObserver, "
                                 f"got {self.observer_cls!r}")
            return
        if d in _NON_SCALED:
            for name in ("ch_axis", "group_size"):
                if getattr(self, name) is None:
                    raise ValueError(f"QuarkSpec.{name}: dtype {d!r} needs an int {name}, got None")
            if d == "mx" and self.mx_element_dtype is None:
                raise ValueError("QuarkSpec.mx_element_dtype: dtype 'mx' needs mx_element_dtype, got None")
            return
        # Scaled dtypes: an observer and a qscheme (and is_dynamic for integers and fp8).
        if self.qscheme is None:
            raise ValueError(f"QuarkSpec.qscheme: cannot be None for dtype {d!r}")
        if self.observer_cls is None and "observer_cls" not in self.omitted:
            raise ValueError(f"QuarkSpec.observer_cls: cannot be None for dtype {d!r}")
        if (d in _INT_DTYPES or d in ("fp8_e4m3", "fp8_e5m2")) and self.is_dynamic is None:
            raise ValueError(f"QuarkSpec.is_dynamic: cannot be None for dtype {d!r}")
        if d in _INT_DTYPES:
            for name in ("symmetric", "round_method", "scale_type"):
                if getattr(self, name) is None:
                    raise ValueError(f"QuarkSpec.{name}: cannot be None for dtype {d!r}")
        q, obs = self.qscheme, self.observer_cls
        if q is None:
            return
        allowed = {"per_tensor": _PER_TENSOR_OBSERVERS, "per_channel": _PER_CHANNEL_OBSERVERS,
                   "per_group": _PER_GROUP_OBSERVERS}.get(q)
        if allowed is not None and obs is not None and obs not in allowed:
            raise ValueError(f"QuarkSpec.observer_cls: {obs!r} does not support qscheme {q!r} (expected one of "
                             f"{', '.join(sorted(allowed))})")
        if q == "per_channel" and self.ch_axis is None:
            raise ValueError("QuarkSpec.ch_axis: qscheme 'per_channel' needs an int ch_axis, got None")
        if q == "per_group":
            for name in ("ch_axis", "group_size"):
                if getattr(self, name) is None:
                    raise ValueError(f"QuarkSpec.{name}: qscheme 'per_group' needs an int {name}, got None")
        if q == "per_block" and self.block_size is None:
            raise ValueError("QuarkSpec.block_size: qscheme 'per_block' needs two ints, got None")

    # -- dicts ---------------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuarkSpec":
        """The spec of one JSON object as Quark writes it (required keys: those Quark's ``from_dict`` reads
        unconditionally: dtype, is_dynamic, ch_axis, group_size, symmetric)."""
        _check_mapping("QuarkSpec", d)
        _missing("QuarkSpec", d, _SPEC_REQUIRED)
        kw = {k: d[k] for k in _SPEC_KEYS if k in d}
        if kw.get("block_size") is not None and isinstance(kw["block_size"], list):
            kw["block_size"] = tuple(kw["block_size"])
        omitted = frozenset(k for k in _SPEC_OPTIONAL if k not in d)
        for k in omitted:
            kw[k] = _SPEC_OPTIONAL[k]
        return cls(**kw, extra=_split_extra(d, _SPEC_KEYS, "QuarkSpec"), omitted=omitted)

    def to_dict(self) -> dict:
        """The JSON object, keys in Quark's order, extra keys last."""
        out: dict = {}
        for k in _SPEC_KEYS:
            if k in self.omitted:
                continue
            v = getattr(self, k)
            out[k] = list(v) if k == "block_size" and v is not None else v
        out.update(_thaw(dict(self.extra)))
        return out

    # -- conversion ------------------------------------------------------------------------------------------------
    def _axis(self, role: Role, family: str) -> int:
        table = _READ_AXIS[(role, family)]
        if self.ch_axis not in table:
            what = "the axis that indexes the scales" if family == "channel" else "the axis the groups run along"
            raise ValueError(f"QuarkSpec.ch_axis: {self.ch_axis!r} for a {role.value} (canonical layout "
                             f"{_LAYOUT[role]}; ch_axis is {what}) is not one of {sorted(table)}")
        return table[self.ch_axis]

    def _group(self, role: Role) -> PerGroup:
        if self.group_size is None or self.group_size <= 0:
            raise ValueError(f"QuarkSpec.group_size: expected a positive group size, got {self.group_size!r} "
                             "(-1, a group of the whole axis, is per-channel: write qscheme 'per_channel')")
        return PerGroup(self.group_size, self._axis(role, "group"))

    def _granularity(self, role: Role):
        q = self.qscheme
        if q == "per_tensor":
            return PerTensor()  # Quark ignores ch_axis / group_size here
        if q == "per_channel":
            return PerChannel(self._axis(role, "channel"))
        if q == "per_group":
            return self._group(role)
        if q == "per_block":
            if role is not Role.WEIGHT:
                raise ValueError(f"QuarkSpec.qscheme: 'per_block' is for weights, got role {role.value!r}")
            return PerBlock(tuple(self.block_size), axes=(0, 1))  # [out, in] blocks (dequantize_fp8_per_block)
        raise ValueError(f"QuarkSpec.qscheme: dtype {self.dtype!r} needs a qscheme, got None")

    def _rounding(self) -> RoundingMode:
        if self.round_method in (None, "half_even"):
            return RoundingMode.NEAREST_EVEN
        raise ValueError(f"QuarkSpec.round_method: {self.round_method!r} has no single meaning in Quark 0.13 (its CPU "
                         "path rounds half to even whatever the mode; its GPU kernel computes floor(x + 0.5) for "
                         "'round' and std::round for 'floor'); only 'half_even' converts")

    def _scale_dtype(self, model: FloatDType) -> FloatDType:
        st = self.scale_type
        if st in (None, "float"):
            return model
        if st in ("float32", "float16", "bfloat16"):
            return get_dtype(st)  # type: ignore[return-value]
        if st == "pof2":
            raise ValueError("QuarkSpec.scale_type: 'pof2' (Quark's power-of-two observers pick the exponent as "
                             "round(-log2(scale)) of their float scale) has no qcore ScaleMode")
        if st == "float8_e5m3":
            raise ValueError("QuarkSpec.scale_type: 'float8_e5m3' is Quark's E5M3 (saturating at 114688, 0xFF "
                             "unused); qcore's float8_e5m3 reaches 122880: not the same scales")
        raise ValueError(f"QuarkSpec.scale_type: {st!r} needs scale_format 'e8m0' (got {self.scale_format!r})")

    def _check_dynamic_observer(self) -> None:
        if self.is_dynamic and self.observer_cls not in _MINMAX_OBSERVERS:
            raise ValueError(f"QuarkSpec.observer_cls: a dynamic spec computes its scale at every call; "
                             f"{self.observer_cls!r} is not a min/max observer (one of "
                             f"{', '.join(sorted(_MINMAX_OBSERVERS))}), so qcore's amax rule is not its scale")

    def to_qcore(self, *, role: Union[Role, str], model_dtype: str = "float32") -> tuple[QuantSpec, bool]:
        """``(qcore spec, is_dynamic)`` meaning the same numerics as this Quark spec on the canonical layout of
        ``role`` ("weight", "input", "output", "bias"; see the module docstring). ``model_dtype`` resolves
        ``scale_type`` "float" / null (scales in the model's dtype). Raises ``ValueError`` naming the field
        when qcore cannot compute what Quark computes."""
        role = _role(role)
        model = _model_dtype(model_dtype)
        d = self.dtype
        if self.is_scale_quant and self.qscheme != "per_tensor":
            raise ValueError(f"QuarkSpec.qscheme: a scale-of-scales spec (is_scale_quant) must be per_tensor, got "
                             f"{self.qscheme!r}")
        if d in _CAST_ONLY:
            raise ValueError(f"QuarkSpec.dtype: {d!r} is a cast (Quark's ONLY_DTYPE_CHANGE), not a quantization "
                             "spec; use qcore.cast")
        if d in _NON_SCALED:
            return self._block_to_qcore(role), True
        if d == "fp8_e5m3":
            raise ValueError("QuarkSpec.dtype: 'fp8_e5m3' is Quark's unsigned E5M3 (max 114688); qcore's "
                             "float8_e5m3 is not the same format")
        try:
            element = get_dtype(d)
        except ValueError:
            raise ValueError(f"QuarkSpec.dtype: {d!r} has no qcore element format (qcore integers are at most "
                             "16 bits)") from None
        if self.is_dynamic is None:
            raise ValueError(f"QuarkSpec.is_dynamic: dtype {d!r} needs true or false, got None")
        self._check_dynamic_observer()
        rounding = self._rounding()
        gran = self._granularity(role)
        fmt = self.scale_format
        if isinstance(element, IntDType):
            if fmt is not None:
                raise ValueError(f"QuarkSpec.scale_format: integer dtype {d!r} takes float scales (null), got "
                                 f"{fmt!r}")
            return self._int_to_qcore(element, gran, rounding, model), self.is_dynamic
        if fmt == "e8m0":
            return self._mx_to_qcore(element, gran, rounding, model), self.is_dynamic
        if fmt == "e4m3":
            raise ValueError("QuarkSpec.scale_format: 'e4m3' on one spec is Quark's in-spec two-level scale (the "
                             "tensor scale recomputed from the observed amax, float32 block scales e4m3-rounded "
                             "relative to it); qcore's two-level specs are Quark's two-spec form (nvfp4)")
        if fmt == "e5m3":
            raise ValueError("QuarkSpec.scale_format: 'e5m3' is Quark's E5M3 (saturating at 114688); qcore's "
                             "float8_e5m3 reaches 122880: not the same scales")
        if (self.qscheme == "per_group") != (fmt == "float32"):
            raise ValueError(f"QuarkSpec.scale_format: float dtype {d!r} with qscheme {self.qscheme!r} expects "
                             f"{'float32' if self.qscheme == 'per_group' else 'null'}, got {fmt!r}")
        spec = QuantSpec(element, gran, scale_dtype=self._scale_dtype(model), rounding=rounding)
        return spec, self.is_dynamic

    def _int_to_qcore(self, element: IntDType, gran, rounding: RoundingMode, model: FloatDType) -> QuantSpec:
        if self.symmetric and not element.signed:
            raise ValueError(f"QuarkSpec.symmetric: Quark's symmetric {self.dtype} uses zero point 0 with scale "
                             f"amax / ((qmax - qmin) / 2) (half the range unused); qcore's symmetric unsigned "
                             "spec uses amax / qmax")
        if not self.symmetric and self.zero_point_type == "float32":
            raise ValueError("QuarkSpec.zero_point_type: 'float32' (a float zero point -min/scale, not rounded) "
                             "has no qcore spelling; qcore zero points are integers")
        return QuantSpec(element, gran, symmetric=bool(self.symmetric), scale_dtype=self._scale_dtype(model),
                         rounding=rounding)

    def _mx_to_qcore(self, element, gran, rounding: RoundingMode, model: FloatDType) -> QuantSpec:
        if self.qscheme != "per_group":
            raise ValueError(f"QuarkSpec.qscheme: scale_format 'e8m0' needs 'per_group', got {self.qscheme!r}")
        st = self.scale_type
        storage = {None: model.name, "float": model.name, "float8_e8m0fnu": "float8_e8m0fnu"}.get(st, st)
        if storage not in ("float32", "bfloat16", "float8_e8m0fnu"):
            raise ValueError(f"QuarkSpec.scale_type: {st!r} stores E8M0 scales as {storage}, which cannot hold "
                             "every power of two 2**-127 .. 2**127 (float32, bfloat16, float8_e8m0fnu can)")
        block = _mx_block(element)
        if block is None:
            raise ValueError(f"QuarkSpec.dtype: qcore has no OCP MX format with {self.dtype!r} elements")
        mode = _SCALE_MODES[self.scale_calculation_mode or "even"]
        return make_spec(block.name, granularity=gran, scale_mode=mode, rounding=rounding)

    def _block_to_qcore(self, role: Role) -> QuantSpec:
        """mx / mx6 / mx9 / bfp16: Quark's non-scaled formats, blocked along ``ch_axis``."""
        d = self.dtype
        ignored = [n for n in ("qscheme", "symmetric", "round_method", "scale_type", "scale_format", "observer_cls")
                   if getattr(self, n) is not None]
        if ignored:
            raise ValueError(f"QuarkSpec.{ignored[0]}: dtype {d!r} is quantized without observer or stored scale "
                             f"(Quark ignores {', '.join(ignored)} with a warning); expected null, got "
                             f"{getattr(self, ignored[0])!r}")
        gran = self._group(role)
        if d == "mx":
            el = self.mx_element_dtype
            try:
                element = get_dtype(el) if el not in _NON_SCALED + _CAST_ONLY else None
            except ValueError:
                element = None
            block = _mx_block(element) if element is not None else None
            if block is None:
                raise ValueError(f"QuarkSpec.mx_element_dtype: qcore has no OCP MX format with {el!r} elements")
            mode = self.scale_calculation_mode or "even"
            if isinstance(element, IntDType) and mode == "even":
                raise ValueError("QuarkSpec.scale_calculation_mode: Quark's MXINT8 'even' rounds amax to 8 "
                                 "significant bits (get_dtype_params(int8)); qcore's ScaleMode.EVEN rounds to "
                                 "int8's 6 bits and FLOOR never rounds up: not represented ('floor' is "
                                 "make_spec('mxint8'))")
            return make_spec(block.name, granularity=gran, scale_mode=_SCALE_MODES[mode])
        block = get_dtype(d)
        if d == "bfp16" and self.group_size != block.block_size:
            raise ValueError(f"QuarkSpec.group_size: Quark's fake_quantize_bfp16 always uses blocks of "
                             f"{block.block_size}, got group_size {self.group_size}")
        try:
            return make_spec(d, granularity=gran)
        except ValueError as e:
            raise ValueError(f"QuarkSpec.group_size: {self.group_size} does not fit {d}: {e}") from None

    @classmethod
    def from_qcore(cls, spec: QuantSpec, *, role: Union[Role, str], dynamic: bool, observer: Optional[str] = None,
                   quark_fields: Optional[Mapping[str, Any]] = None, model_dtype: str = "float32") -> "QuarkSpec":
        """The Quark spec of a one-level qcore ``spec`` quantizing ``role`` (``dynamic``: scales computed at
        every call). Fields qcore does not carry are derived as Quark 0.13's spec classes write them:
        ``observer_cls`` from the qscheme and dtype (``observer`` overrides it), ``ch_axis`` from the module
        docstring's table, ``scale_type`` "float" when the scale dtype is ``model_dtype``. ``quark_fields`` sets
        other spellings of the same numerics: ``ch_axis``, ``scale_type``, ``zero_point_type``,
        ``enable_buffer_reuse``, ``max_input_numel``. The result is converted back and must give ``spec`` and
        ``dynamic`` exactly, else ``ValueError`` names the QuantSpec fields Quark cannot express."""
        if not isinstance(spec, QuantSpec):
            raise TypeError(f"spec must be a qcore.QuantSpec, got {_typename(spec)}")
        if spec.two_level:
            raise ValueError(f"spec: tensor_scale_mode={spec.tensor_scale_mode.name} is two-level: Quark writes it "
                             "as two specs; use qcore_to_quark")
        role = _role(role)
        _check_bool("from_qcore", "dynamic", dynamic, nullable=False)
        model = _model_dtype(model_dtype)
        kw = _derive(spec, role, dynamic, model)
        return _finish(cls, kw, spec, role, dynamic, observer, quark_fields, model_dtype)


def _derive(spec: QuantSpec, role: Role, dynamic: bool, model: FloatDType) -> dict:
    """Quark 0.13's spelling of a one-level qcore spec, before the round-trip check."""
    el = spec.dtype
    g = spec.granularity
    kw: dict = dict(zero_point_type="int32", is_scale_quant=False, enable_buffer_reuse=False,
                    max_input_numel=_DEFAULT_MAX_INPUT_NUMEL)

    def axis(family: str, canonical: int) -> int:
        table = _WRITE_AXIS[(role, family)]
        if canonical not in table:
            raise ValueError(f"spec.granularity: {g!r} for a {role.value} (canonical layout {_LAYOUT[role]}) has no "
                             f"Quark ch_axis (canonical axes: {sorted(table)})")
        return table[canonical]

    def group() -> tuple[int, int]:
        if not isinstance(g, PerGroup):
            raise ValueError(f"spec.granularity: {g!r} with power-of-two scales: Quark's E8M0 formats (OCP MX, "
                             "mx6, mx9, bfp16) are per-group (its 'pof2' integer scales are not converted)")
        return g.size, axis("group", g.axis)

    if spec.pow2_scale:
        mx9_like = [n for n in ("mx6", "mx9") if get_dtype(n).element == el]
        if spec.subblock_shift_bits:
            if not mx9_like:
                raise ValueError(f"spec.dtype: shared-microexponent elements {el.name} have no Quark-Torch dtype "
                                 "(Quark-Torch has mx6 and mx9; mx4 is Quark-ONNX only)")
            quark = mx9_like[0]
        elif spec.bump_on_overflow:
            quark = "bfp16"
        else:
            quark = None
        if quark is not None or isinstance(el, IntDType):
            gs, ax = group()
            kw.update(dtype=quark or "mx", is_dynamic=None, ch_axis=ax, group_size=gs,
                      scale_calculation_mode="even")
            if quark is None:
                mode = {v: k for k, v in _SCALE_MODES.items()}.get(spec.scale_mode)
                if mode is None:
                    raise ValueError(f"spec.scale_mode: {spec.scale_mode.name} has no Quark scale_calculation_mode "
                                     f"(even, floor, ceil)")
                kw.update(mx_element_dtype=_quark_element_name(el), scale_calculation_mode=mode)
            return kw
    name = _quark_element_name(el)
    if name is None:
        raise ValueError(f"spec.dtype: {el.name} has no Quark dtype")
    kw.update(dtype=name, is_dynamic=dynamic, round_method="half_even")
    if isinstance(g, PerTensor):
        kw.update(qscheme="per_tensor")
    elif isinstance(g, PerChannel):
        kw.update(qscheme="per_channel", ch_axis=axis("channel", g.axis))
    elif isinstance(g, PerGroup):
        gs, ax = group()
        kw.update(qscheme="per_group", ch_axis=ax, group_size=gs)
    elif isinstance(g, PerBlock):
        if role is not Role.WEIGHT or len(g.shape) != 2 or g.axes not in (None, (0, 1)):
            raise ValueError(f"spec.granularity: Quark's per_block is 2-D blocks of a weight over axes (0, 1), got "
                             f"{g!r} for a {role.value}")
        kw.update(qscheme="per_block", block_size=tuple(g.shape))
    if isinstance(el, IntDType):
        kw.update(symmetric=spec.symmetric)
    elif kw["qscheme"] != "per_group":
        kw.update(symmetric=True)
    if spec.pow2_scale:  # OCP MX with float elements
        mode = {v: k for k, v in _SCALE_MODES.items()}.get(spec.scale_mode)
        if mode is None:
            raise ValueError(f"spec.scale_mode: {spec.scale_mode.name} has no Quark scale_calculation_mode (even, "
                             "floor, ceil)")
        kw.update(scale_type="float", scale_format="e8m0", scale_calculation_mode=mode)
    else:
        sd = spec.scale_dtype
        if sd == model:
            kw.update(scale_type="float")
        elif sd.name in ("float32", "float16", "bfloat16"):
            kw.update(scale_type=sd.name)
        else:
            raise ValueError(f"spec.scale_dtype: one-level {sd.name} scales have no Quark scale_type (float32, "
                             "float16, bfloat16, or E8M0 for MX)")
        if kw["qscheme"] == "per_group" and not isinstance(el, IntDType):
            kw.update(scale_format="float32")
    q = kw["qscheme"]
    if q == "per_tensor":
        obs = "PerTensorMinMaxObserver"
    elif q == "per_channel":
        obs = "PerChannelMinMaxObserver"
    elif q == "per_block":
        obs = "PerBlock2DMinMaxObserver"
    else:
        obs = "PerGroupMinMaxObserver" if isinstance(el, IntDType) else "PerBlockMXObserver"
    kw.update(observer_cls=obs)
    return kw


_QUARK_ONLY_FIELDS = ("ch_axis", "scale_type", "zero_point_type", "enable_buffer_reuse", "max_input_numel")


def _finish(cls, kw: dict, spec: QuantSpec, role: Role, dynamic: bool, observer: Optional[str],
            quark_fields: Optional[Mapping[str, Any]], model_dtype: str) -> "QuarkSpec":
    if observer is not None:
        if kw.get("observer_cls") is None:
            raise ValueError(f"observer: dtype {kw['dtype']!r} is quantized without an observer in Quark, got "
                             f"{observer!r}")
        kw["observer_cls"] = observer
    if quark_fields is not None:
        if not isinstance(quark_fields, Mapping):
            raise TypeError(f"quark_fields must be a mapping, got {_typename(quark_fields)}")
        unknown = [k for k in quark_fields if k not in _QUARK_ONLY_FIELDS]
        if unknown:
            raise ValueError(f"quark_fields: {', '.join(map(repr, unknown))} not settable (Quark-only fields: "
                             f"{', '.join(_QUARK_ONLY_FIELDS)}; observer_cls via observer=)")
        kw.update(quark_fields)
    q = cls(**kw)
    back, back_dynamic = q.to_qcore(role=role, model_dtype=model_dtype)
    diffs = [f.name for f in dataclasses.fields(QuantSpec) if f.compare and getattr(back, f.name) !=
             getattr(spec, f.name)]
    if diffs:
        got = ", ".join(f"{n}={getattr(spec, n)!r}" for n in diffs)
        means = ", ".join(f"{n}={getattr(back, n)!r}" for n in diffs)
        raise ValueError(f"spec: no Quark spelling: QuantSpec {got}; the nearest Quark spec means {means}")
    if back_dynamic != dynamic and not (q.dtype in _NON_SCALED and role is Role.WEIGHT):
        raise ValueError(f"dynamic: Quark's {q.dtype!r} has no static form (is_dynamic null: its block exponents "
                         f"come from the tensor at every call), got dynamic={dynamic} for a {role.value}")
    return q


# ---- a role's value: None, one spec, or a list -----------------------------------------------------------------
RoleValue = Union[None, QuarkSpec, Tuple[QuarkSpec, ...]]


def quark_to_qcore(value: Union[QuarkSpec, Sequence[QuarkSpec]], *, role: Union[Role, str],
                   model_dtype: str = "float32") -> tuple[QuantSpec, bool]:
    """``(qcore spec, is_dynamic)`` of a role's value: one spec (``QuarkSpec.to_qcore``) or Quark's two-level
    list ``[element spec, is_scale_quant per-tensor spec]`` (NVFP4: a spec with ``tensor_scale_mode`` GIVEN when
    the scale-of-scales spec is static, AMAX when dynamic; ``is_dynamic`` is the element spec's). A progressive
    two-stage list (``int4_fp8``'s weight: fp8, then int4 of the fp8 values) is two quantizers in a row, not one
    qcore spec: ``ValueError`` (convert each stage with ``QuarkSpec.to_qcore``)."""
    if isinstance(value, QuarkSpec):
        return value.to_qcore(role=role, model_dtype=model_dtype)
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, QuarkSpec) for v in value):
        raise TypeError(f"value must be a QuarkSpec or a sequence of QuarkSpec, got {value!r}")
    if len(value) == 1:
        return value[0].to_qcore(role=role, model_dtype=model_dtype)
    if len(value) != 2:
        raise ValueError(f"value: Quark lists hold two specs (two-level or progressive), got {len(value)}")
    first, second = value
    if not second.is_scale_quant:
        raise ValueError("value: a list whose second spec is not is_scale_quant is Quark's progressive "
                         f"quantization ({first.dtype} then {second.dtype}): two quantizers, not one qcore spec; "
                         "convert each stage with QuarkSpec.to_qcore")
    if first.is_scale_quant:
        raise ValueError("value[0].is_scale_quant: the first spec of a two-level list quantizes the tensor")
    q1, dynamic = first.to_qcore(role=role, model_dtype=model_dtype)
    if q1.pow2_scale or not q1.dtype.is_float or first.scale_format != "float32":
        raise ValueError(f"value[0].scale_format: a two-level element spec has float block scales (scale_format "
                         f"'float32', float elements), got dtype {first.dtype!r} / {first.scale_format!r}")
    if q1.scale_dtype.name != "float32":
        raise ValueError(f"value[0].scale_type: two-level block scales are computed in float32 before the "
                         f"scale-of-scales rounds them; {first.scale_type!r} gives {q1.scale_dtype.name}")
    q2, dynamic2 = second.to_qcore(role=role, model_dtype=model_dtype)
    if not isinstance(q2.granularity, PerTensor) or not q2.dtype.is_float:
        raise ValueError(f"value[1]: the scale-of-scales spec must be a float per_tensor spec, got {second.dtype!r} "
                         f"/ {second.qscheme!r}")
    if q2.scale_dtype.name != "float32":
        raise ValueError(f"value[1].scale_type: the tensor scale is float32 in qcore, {second.scale_type!r} gives "
                         f"{q2.scale_dtype.name}")
    mode = TensorScale.AMAX if dynamic2 else TensorScale.GIVEN
    try:
        spec = dataclasses.replace(q1, scale_dtype=q2.dtype, tensor_scale_mode=mode, name="")
    except ValueError as e:
        raise ValueError(f"value: not a qcore two-level spec: {e}") from None
    if spec.dtype.name == "float4_e2m1fn" and spec.scale_dtype.name == "float8_e4m3fn":
        spec = make_spec("nvfp4", granularity=spec.granularity, tensor_scale_mode=mode)
    return spec, dynamic


def qcore_to_quark(spec: QuantSpec, *, role: Union[Role, str], dynamic: bool, observer: Optional[str] = None,
                   quark_fields: Optional[Mapping[str, Any]] = None,
                   model_dtype: str = "float32") -> Union[QuarkSpec, Tuple[QuarkSpec, QuarkSpec]]:
    """The inverse of ``quark_to_qcore``: ``QuarkSpec.from_qcore`` for one-level specs; a two-level spec
    (``tensor_scale_mode`` GIVEN or AMAX) becomes Quark's ``(element spec, is_scale_quant per-tensor spec)``
    pair as the ``nvfp4`` scheme writes it (float32 scales; ``observer`` and ``quark_fields`` apply to the
    element spec). Checked by converting back, like ``from_qcore``."""
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec must be a qcore.QuantSpec, got {_typename(spec)}")
    if not spec.two_level:
        return QuarkSpec.from_qcore(spec, role=role, dynamic=dynamic, observer=observer, quark_fields=quark_fields,
                                    model_dtype=model_dtype)
    role = _role(role)
    _check_bool("qcore_to_quark", "dynamic", dynamic, nullable=False)
    if spec.tensor_scale_mode not in (TensorScale.GIVEN, TensorScale.AMAX):
        raise ValueError(f"spec.tensor_scale_mode: {spec.tensor_scale_mode.name} has no Quark spelling (Quark's "
                         "two-level lists have a per-tensor scale-of-scales spec: GIVEN when static, AMAX when "
                         "dynamic)")
    one = dataclasses.replace(spec, scale_dtype="float32", tensor_scale_mode=TensorScale.NONE, name="")
    first_kw = _derive(one, role, dynamic, get_dtype("float32"))  # type: ignore[arg-type]
    first_kw.update(scale_type="float32")
    first = _finish(QuarkSpec, first_kw, one, role, dynamic, observer, quark_fields, "float32")
    scale_name = _quark_element_name(spec.scale_dtype)
    if scale_name is None:
        raise ValueError(f"spec.scale_dtype: {spec.scale_dtype.name} has no Quark dtype")
    second = QuarkSpec(dtype=scale_name, is_dynamic=spec.tensor_scale_mode is TensorScale.AMAX,
                       qscheme="per_tensor", symmetric=True, round_method="half_even", scale_type="float32",
                       observer_cls="PerTensorMinMaxObserver", is_scale_quant=True)
    back, back_dynamic = quark_to_qcore((first, second), role=role, model_dtype=model_dtype)
    if back != spec or back_dynamic != dynamic:
        raise ValueError(f"spec: no Quark spelling for {spec!r} (the nearest Quark lists mean {back!r})")
    return first, second


# ---- QuarkLayerSpec ----------------------------------------------------------------------------------------------
_LAYER_KEYS = ("input_tensors", "output_tensors", "weight", "bias", "target_device")
_LAYER_REQUIRED = ("input_tensors", "output_tensors", "weight", "bias")
_LAYER_OPTIONAL = {"target_device": None}
_LAYER_ROLES = {"input_tensors": Role.INPUT, "output_tensors": Role.OUTPUT, "weight": Role.WEIGHT,
                "bias": Role.BIAS}


def _role_value_from_dict(v: Any, where: str) -> RoleValue:
    if v is None:
        return None
    if isinstance(v, list):
        return tuple(_nested(QuarkSpec.from_dict, s, f"{where}[{i}]") for i, s in enumerate(v))
    return _nested(QuarkSpec.from_dict, v, where)


def _role_value_to_dict(v: RoleValue) -> Any:
    if v is None:
        return None
    if isinstance(v, tuple):
        return [s.to_dict() for s in v]
    return v.to_dict()


def _nested(fn, value: Any, where: str) -> Any:
    """``fn(value)``, with ``where`` (the JSON path) prefixed to a ValueError / TypeError message."""
    try:
        return fn(value)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{where}: {e}") from None


@dataclass(frozen=True)
class QuarkLayerSpec:
    """Quark's ``QLayerConfig``: the specs of one layer's tensors. Each role is ``None`` (not quantized), a
    ``QuarkSpec``, or a tuple of specs (a JSON list: two-level or progressive). ``target_device`` is
    ``None``, "cpu" or "ipu"."""

    input_tensors: RoleValue = None
    output_tensors: RoleValue = None
    weight: RoleValue = None
    bias: RoleValue = None
    target_device: Optional[str] = None
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)
    omitted: frozenset = frozenset()

    def __post_init__(self) -> None:
        for name in _LAYER_ROLES:
            v = getattr(self, name)
            if isinstance(v, list):
                v = tuple(v)
                object.__setattr__(self, name, v)
            if v is not None and not isinstance(v, QuarkSpec) and not (
                    isinstance(v, tuple) and v and all(isinstance(s, QuarkSpec) for s in v)):
                raise TypeError(f"QuarkLayerSpec.{name} must be None, a QuarkSpec or a non-empty tuple of "
                                f"QuarkSpec, got {v!r}")
            specs = v if isinstance(v, tuple) else (v,) if v is not None else ()
            for i, s in enumerate(specs):
                if s.is_scale_quant and not (len(specs) == 2 and i == 1):
                    raise ValueError(f"QuarkLayerSpec.{name}: an is_scale_quant spec only follows the element spec "
                                     "in a two-spec list")
                # QLayerConfig.__post_init__: static per-group activations are refused by Quark.
                if name in ("input_tensors", "output_tensors") and s.qscheme == "per_group" and s.is_dynamic is False:
                    raise ValueError(f"QuarkLayerSpec.{name}: per_group with is_dynamic=False is not supported by "
                                     "Quark for activations")
        _check_choice("QuarkLayerSpec", "target_device", self.target_device, _TARGET_DEVICES)
        _check_extra_and_omitted("QuarkLayerSpec", self, _LAYER_KEYS, _LAYER_OPTIONAL)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuarkLayerSpec":
        _check_mapping("QuarkLayerSpec", d)
        _missing("QuarkLayerSpec", d, _LAYER_REQUIRED)
        kw: dict = {k: _role_value_from_dict(d[k], k) for k in _LAYER_ROLES}
        omitted = frozenset(k for k in _LAYER_OPTIONAL if k not in d)
        kw["target_device"] = d.get("target_device")
        return cls(**kw, extra=_split_extra(d, _LAYER_KEYS, "QuarkLayerSpec"), omitted=omitted)

    def to_dict(self) -> dict:
        out: dict = {k: _role_value_to_dict(getattr(self, k)) for k in _LAYER_ROLES}
        if "target_device" not in self.omitted:
            out["target_device"] = self.target_device
        out.update(_thaw(dict(self.extra)))
        return out

    def to_qcore(self, *, model_dtype: str = "float32") -> dict:
        """``{Role: (qcore spec, is_dynamic)}`` for every quantized role (``quark_to_qcore`` each; raises on the
        first role qcore cannot represent, naming it)."""
        out = {}
        for name, role in _LAYER_ROLES.items():
            v = getattr(self, name)
            if v is not None:
                out[role] = _nested(lambda x: quark_to_qcore(x, role=role, model_dtype=model_dtype), v, name)
        return out


# ---- QuarkExport -------------------------------------------------------------------------------------------------
_EXPORT_KEYS = ("weight_merge_groups", "kv_cache_group", "min_kv_scale", "weight_format", "pack_method")


@dataclass(frozen=True)
class QuarkExport:
    """The ``"export"`` block (``dataclasses.asdict(JsonExporterConfig)``). vLLM requires it; Quark's own
    importer reads ``pack_method``, ``weight_format`` and ``kv_cache_group`` from it."""

    weight_merge_groups: Optional[Tuple[Tuple[str, ...], ...]] = None
    kv_cache_group: Tuple[str, ...] = ()
    min_kv_scale: float = 0.0
    weight_format: str = "real_quantized"
    pack_method: str = "reorder"
    extra: Mapping[str, Any] = field(default_factory=dict)
    omitted: frozenset = frozenset()

    def __post_init__(self) -> None:
        o = "QuarkExport"
        wmg = self.weight_merge_groups
        if wmg is not None:
            if not isinstance(wmg, (tuple, list)) or not all(
                    isinstance(g, (tuple, list)) and all(isinstance(n, str) for n in g) for g in wmg):
                raise TypeError(f"{o}.weight_merge_groups must be None or a list of lists of str, got {wmg!r}")
            object.__setattr__(self, "weight_merge_groups", tuple(tuple(g) for g in wmg))
        kv = self.kv_cache_group
        if not isinstance(kv, (tuple, list)) or not all(isinstance(n, str) for n in kv):
            raise TypeError(f"{o}.kv_cache_group must be a list of str, got {kv!r}")
        object.__setattr__(self, "kv_cache_group", tuple(kv))
        if isinstance(self.min_kv_scale, bool) or not isinstance(self.min_kv_scale, (int, float)):
            raise TypeError(f"{o}.min_kv_scale must be a number, got {self.min_kv_scale!r}")
        if not self.min_kv_scale >= 0:
            raise ValueError(f"{o}.min_kv_scale: expected a number >= 0, got {self.min_kv_scale!r}")
        _check_choice(o, "weight_format", self.weight_format, _WEIGHT_FORMATS, nullable=False)
        _check_choice(o, "pack_method", self.pack_method, _PACK_METHODS, nullable=False)
        _check_extra_and_omitted(o, self, _EXPORT_KEYS, {k: getattr(QuarkExport, k) for k in _EXPORT_KEYS})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuarkExport":
        _check_mapping("QuarkExport", d)
        kw = {k: d[k] for k in _EXPORT_KEYS if k in d}
        omitted = frozenset(k for k in _EXPORT_KEYS if k not in d)
        return cls(**kw, extra=_split_extra(d, _EXPORT_KEYS, "QuarkExport"), omitted=omitted)

    def to_dict(self) -> dict:
        out: dict = {}
        for k in _EXPORT_KEYS:
            if k in self.omitted:
                continue
            v = getattr(self, k)
            if k == "weight_merge_groups" and v is not None:
                v = [list(g) for g in v]
            elif k == "kv_cache_group":
                v = list(v)
            out[k] = v
        out.update(_thaw(dict(self.extra)))
        return out


# ---- QuarkConfig -------------------------------------------------------------------------------------------------
_CONFIG_KEYS = ("global_quant_config", "exclude", "algo_config", "softmax_quant_spec", "quant_method",
                "layer_type_quant_config", "layer_quant_config", "kv_cache_quant_config", "kv_cache_post_rope",
                "quant_mode", "version", "export")
_CONFIG_REQUIRED = ("global_quant_config", "exclude", "quant_method", "layer_type_quant_config",
                    "layer_quant_config")   # QConfig.from_dict, and quant_method for transformers / vLLM
_CONFIG_OPTIONAL = {"algo_config": None, "softmax_quant_spec": None, "kv_cache_quant_config": MappingProxyType({}),
                    "kv_cache_post_rope": False, "quant_mode": "eager_mode", "version": None, "export": None}


def _layer_map(value: Any, where: str) -> Optional[Mapping[str, QuarkLayerSpec]]:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a mapping of names to QuarkLayerSpec (or None), got {_typename(value)}")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, QuarkLayerSpec):
            raise TypeError(f"{where}[{k!r}] must map a str to a QuarkLayerSpec, got {_typename(v)}")
        out[k] = v
    return MappingProxyType(out)


@dataclass(frozen=True)
class QuarkConfig:
    """A whole ``quantization_config`` with ``quant_method: "quark"`` (Quark's ``QConfig.to_dict()`` plus the
    exporter's ``"export"`` block).

    ``global_quant_config``: the default ``QuarkLayerSpec``; ``layer_quant_config``: name pattern (fnmatch when
    it has ``*``) -> ``QuarkLayerSpec``; ``layer_type_quant_config``: module type name ("Linear", "Conv2d") ->
    ``QuarkLayerSpec`` (both ``None`` in legacy configs); ``kv_cache_quant_config``: KV projections (``*k_proj``
    / ``*v_proj``) -> ``QuarkLayerSpec`` whose ``output_tensors`` quantize the cache; ``exclude``: names or
    fnmatch patterns never quantized; ``softmax_quant_spec``: the attention-softmax output spec or ``None``;
    ``algo_config``: Quark's algorithm settings (GPTQ, AWQ, rotation, ...) kept as JSON data;
    ``kv_cache_post_rope``, ``quant_mode``, ``version``; ``export``: ``QuarkExport`` or ``None``.
    """

    global_quant_config: QuarkLayerSpec
    exclude: Optional[Tuple[str, ...]] = ()
    algo_config: Any = None
    softmax_quant_spec: Optional[QuarkSpec] = None
    quant_method: str = "quark"
    layer_type_quant_config: Optional[Mapping[str, QuarkLayerSpec]] = field(default_factory=dict)
    layer_quant_config: Optional[Mapping[str, QuarkLayerSpec]] = field(default_factory=dict)
    kv_cache_quant_config: Mapping[str, QuarkLayerSpec] = field(default_factory=dict)
    kv_cache_post_rope: bool = False
    quant_mode: str = "eager_mode"
    version: Optional[str] = None
    export: Optional[QuarkExport] = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    omitted: frozenset = frozenset()

    def __post_init__(self) -> None:
        o = "QuarkConfig"
        if not isinstance(self.global_quant_config, QuarkLayerSpec):
            raise TypeError(f"{o}.global_quant_config must be a QuarkLayerSpec, got "
                            f"{_typename(self.global_quant_config)}")
        ex = self.exclude
        if ex is not None:
            if not isinstance(ex, (tuple, list)) or not all(isinstance(n, str) for n in ex):
                raise TypeError(f"{o}.exclude must be a list of str (or None), got {ex!r}")
            object.__setattr__(self, "exclude", tuple(ex))
        object.__setattr__(self, "algo_config", _freeze(self.algo_config, f"{o}.algo_config"))
        if self.softmax_quant_spec is not None and not isinstance(self.softmax_quant_spec, QuarkSpec):
            raise TypeError(f"{o}.softmax_quant_spec must be a QuarkSpec or None, got "
                            f"{_typename(self.softmax_quant_spec)}")
        _check_choice(o, "quant_method", self.quant_method, ("quark",), nullable=False)
        for name in ("layer_type_quant_config", "layer_quant_config", "kv_cache_quant_config"):
            value = _layer_map(getattr(self, name), f"{o}.{name}")
            if value is None and name == "kv_cache_quant_config":
                raise TypeError(f"{o}.kv_cache_quant_config must be a mapping, got None")
            object.__setattr__(self, name, value)
        _check_bool(o, "kv_cache_post_rope", self.kv_cache_post_rope, nullable=False)
        _check_choice(o, "quant_mode", self.quant_mode, _QUANT_MODES, nullable=False)
        if self.version is not None and not isinstance(self.version, str):
            raise TypeError(f"{o}.version must be a str or None, got {self.version!r}")
        if self.export is not None and not isinstance(self.export, QuarkExport):
            raise TypeError(f"{o}.export must be a QuarkExport or None, got {_typename(self.export)}")
        _check_extra_and_omitted(o, self, _CONFIG_KEYS, _CONFIG_OPTIONAL)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuarkConfig":
        """The config of ``config.json["quantization_config"]``. Errors name the JSON path of the bad field."""
        _check_mapping("QuarkConfig", d)
        _missing("QuarkConfig", d, _CONFIG_REQUIRED)

        def layers(name: str) -> Optional[dict]:
            v = d[name]
            if v is None:
                return None
            if not isinstance(v, Mapping):
                raise TypeError(f"{name}: expected an object of layer specs, got {_typename(v)}")
            return {k: _nested(QuarkLayerSpec.from_dict, s, f"{name}[{k!r}]") for k, s in v.items()}

        kw: dict = dict(
            global_quant_config=_nested(QuarkLayerSpec.from_dict, d["global_quant_config"], "global_quant_config"),
            exclude=d["exclude"], quant_method=d["quant_method"],
            layer_type_quant_config=layers("layer_type_quant_config"), layer_quant_config=layers("layer_quant_config"))
        omitted = frozenset(k for k in _CONFIG_OPTIONAL if k not in d)
        for k in _CONFIG_OPTIONAL:
            if k in omitted:
                kw[k] = _CONFIG_OPTIONAL[k]
            elif k == "softmax_quant_spec":
                kw[k] = None if d[k] is None else _nested(QuarkSpec.from_dict, d[k], k)
            elif k == "kv_cache_quant_config":
                if d[k] is None:
                    raise TypeError("kv_cache_quant_config: expected an object of layer specs, got None")
                kw[k] = layers(k)
            elif k == "export":
                kw[k] = None if d[k] is None else _nested(QuarkExport.from_dict, d[k], k)
            else:
                kw[k] = d[k]
        return cls(**kw, extra=_split_extra(d, _CONFIG_KEYS, "QuarkConfig"), omitted=omitted)

    def to_dict(self) -> dict:
        """The JSON object, keys in the order Quark's exporter writes them, extra keys last."""
        def layers(m):
            return None if m is None else {k: v.to_dict() for k, v in m.items()}

        values = dict(
            global_quant_config=self.global_quant_config.to_dict(),
            exclude=None if self.exclude is None else list(self.exclude),
            algo_config=_thaw(self.algo_config),
            softmax_quant_spec=None if self.softmax_quant_spec is None else self.softmax_quant_spec.to_dict(),
            quant_method=self.quant_method,
            layer_type_quant_config=layers(self.layer_type_quant_config),
            layer_quant_config=layers(self.layer_quant_config),
            kv_cache_quant_config=layers(self.kv_cache_quant_config),
            kv_cache_post_rope=self.kv_cache_post_rope, quant_mode=self.quant_mode, version=self.version,
            export=None if self.export is None else self.export.to_dict())
        out = {k: values[k] for k in _CONFIG_KEYS if k not in self.omitted}
        out.update(_thaw(dict(self.extra)))
        return out

    @classmethod
    def from_json(cls, text: str) -> "QuarkConfig":
        """``from_dict`` of a JSON text: a ``quantization_config`` object, or a whole ``config.json``."""
        d = json.loads(text)
        if isinstance(d, Mapping) and "quantization_config" in d and "global_quant_config" not in d:
            d = d["quantization_config"]
        return cls.from_dict(d)

    def to_json(self, *, indent: int = 2) -> str:
        """``json.dumps(self.to_dict(), indent=indent)`` (Quark's key order)."""
        return json.dumps(self.to_dict(), indent=indent)

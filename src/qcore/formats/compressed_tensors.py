"""compressed-tensors (llm-compressor / vLLM): the ``quantization_config`` schema and the tensor layouts, numpy only.

A compressed-tensors checkpoint is an HF directory whose ``config.json`` has a ``quantization_config`` with
``quant_method: "compressed-tensors"``, ``quantization_status: "compressed"``, a ``format`` and ``config_groups``
(``{name: {targets, weights, input_activations, output_activations, format}}``, each role a
``QuantizationArgs``), an ``ignore`` list and an optional ``kv_cache_scheme``. This module is the one schema
used for reading and writing it (``CTConfig`` / ``CTScheme`` / ``CTArgs``, validated as compressed-tensors 0.20's
pydantic models validate them), the conversion of ``QuantizationArgs`` to and from ``qcore.QuantSpec``
(``args_to_spec`` / ``spec_to_args``), and the per-layer tensor codecs (``expected_weight``, ``encode_weight``,
``decode_weight``) for the formats below. The compressed_tensors package is never imported (it is the test
oracle); neither is torch.

Layouts (checked bit for bit against compressed-tensors 0.20's compressors in
``tests/formats/test_compressed_tensors.py``), weights ``[out, in]``:

- ``pack-quantized`` (int weights, no activation quantization): ``weight_packed`` I32 ``[out, ceil(in*b/32)]``:
  the codes plus ``2**(b-1)`` as unsigned ``b``-bit fields, element ``i`` of a row at bits ``i*b`` of the row's
  little-endian bit stream (for 4 bits: eight nibbles per int32, element 0 in the low nibble);
  ``weight_scale`` ``[out, 1]`` (channel), ``[out, in/G]`` (group) or ``[1]`` (tensor) in the model dtype;
  ``weight_shape`` I64 ``[2]``; asymmetric: ``weight_zero_point`` packed the same way along dim 0
  (``[ceil(out*b/32), n]``), symmetric ones have none.
- ``int-quantized`` (int weights with activation quantization): ``weight`` I8 ``[out, in]`` holding the signed
  codes, ``weight_scale`` as above, ``weight_zero_point`` I8 of the scale's shape when asymmetric.
- ``float-quantized`` / ``naive-quantized`` (fp8 e4m3 weights, with / without activation quantization):
  ``weight`` F8_E4M3 ``[out, in]``, ``weight_scale`` ``[1]`` / ``[out, 1]`` / ``[out, in/G]`` /
  ``[ceil(out/bo), ceil(in/bi)]`` (block).
- ``mxfp4-pack-quantized``: ``weight_packed`` U8 ``[out, in/2]`` (fp4 e2m1 codes, element ``2j`` in the low
  nibble of byte ``j``), ``weight_scale`` U8 E8M0 exponents ``[out, in/32]``.
- activations: ``input_scale`` ``[1]`` (static per tensor; I8 ``input_zero_point`` when asymmetric); dynamic
  activations have no tensors. KV cache: ``<attention>.k_scale`` / ``v_scale`` ``[1]``.

Asymmetric integers: compressed-tensors keeps codes and zero points in the signed range ``[-2**(b-1),
2**(b-1) - 1]`` and computes ``(q - zp) * s``; qcore's unsigned asymmetric ``uint{b}`` codes and zero points are
the same numbers plus ``2**(b-1)``, so the conversion is exact both ways (int{b} asymmetric specs convert with no
shift).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np

import qcore
from qcore import PerBlock, PerChannel, PerGroup, PerTensor, QuantSpec, RoundingMode, ScaleMode, TensorScale
from qcore.dtypes import FloatDType, IntDType

__all__ = ["QUANT_METHOD", "CTFormat", "QType", "Strategy", "CTArgs", "CTScheme", "CTConfig", "Match", "ct_match",
           "vllm_match", "resolve_groups", "target_groups", "args_to_spec",
           "spec_to_args", "infer_format", "pack_int32", "unpack_int32", "pack_fp4", "unpack_fp4",
           "expected_weight", "encode_weight", "decode_weight", "scale_to_dtype", "scale_from_dtype", "SCALE_DTYPES"]

QUANT_METHOD = "compressed-tensors"
#: the compressed-tensors release whose layouts and schema this module follows
CT_VERSION = "0.20.0"


class CTFormat(enum.Enum):
    """compressed-tensors' ``CompressionFormat`` values that this module reads and writes."""

    PACK_QUANTIZED = "pack-quantized"
    INT_QUANTIZED = "int-quantized"
    FLOAT_QUANTIZED = "float-quantized"
    NAIVE_QUANTIZED = "naive-quantized"
    MXFP4_PACK_QUANTIZED = "mxfp4-pack-quantized"
    MIXED_PRECISION = "mixed-precision"


#: compressed-tensors formats this module knows but does not convert (refused by name)
_KNOWN_UNSUPPORTED = ("dense", "sparse-bitmask", "sparse-24-bitmask", "marlin-24", "nvfp4-pack-quantized",
                      "mxfp6-pack-quantized", "mxfp8-quantized")


class QType(enum.Enum):
    INT = "int"
    FLOAT = "float"


class Strategy(enum.Enum):
    TENSOR = "tensor"
    CHANNEL = "channel"
    GROUP = "group"
    BLOCK = "block"
    TOKEN = "token"
    TENSOR_GROUP = "tensor_group"
    ATTN_HEAD = "attn_head"


def _err(what: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"{what}: got {value!r}; expected {expected}")


def _torch_dtype_name(v: Any, what: str) -> Optional[str]:
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise _err(what, v, "a torch dtype name such as 'torch.uint8'")
    return v[len("torch."):] if v.startswith("torch.") else v


_ARGS_KEYS = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
              "scale_dtype", "zp_dtype", "observer", "observer_kwargs")


@dataclass(frozen=True)
class CTArgs:
    """compressed-tensors' ``QuantizationArgs``: validated as compressed-tensors 0.20 does (strategy inferred from
    ``group_size`` when absent, group/block/token/dynamic rules). ``scale_dtype`` / ``zp_dtype`` are torch dtype
    names without the ``torch.`` prefix (``"uint8"``); ``given`` is the set of keys the source dict had (so that
    ``from_dict(d).to_dict()`` writes what compressed-tensors' serializer writes)."""

    num_bits: int = 8
    type: QType = QType.INT
    symmetric: bool = True
    group_size: Optional[int] = None
    strategy: Optional[Strategy] = None
    block_structure: Optional[tuple] = None
    dynamic: Any = False  # bool or "local"
    actorder: Optional[str] = None
    scale_dtype: Optional[str] = None
    zp_dtype: Optional[str] = None
    observer: Optional[str] = None
    observer_kwargs: Mapping = field(default_factory=dict)

    def __post_init__(self):
        nb = self.num_bits
        if isinstance(nb, bool) or not isinstance(nb, int) or not 1 <= nb <= 64:
            raise _err("QuantizationArgs.num_bits", nb, "an int in [1, 64]")
        if not isinstance(self.type, QType):
            try:
                object.__setattr__(self, "type", QType(str(self.type).lower()))
            except ValueError:
                raise _err("QuantizationArgs.type", self.type, "'int' or 'float'") from None
        if not isinstance(self.symmetric, bool):
            raise _err("QuantizationArgs.symmetric", self.symmetric, "a bool")
        g = self.group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < -1 or g == 0):
            raise _err("QuantizationArgs.group_size", g, "None, -1 (channel) or a positive int")
        st = self.strategy
        if st is not None and not isinstance(st, Strategy):
            try:
                st = Strategy(str(st).lower())
            except ValueError:
                raise _err("QuantizationArgs.strategy", st, f"one of {[s.value for s in Strategy]}") from None
        if st is None:
            st = Strategy.TENSOR if g is None else (Strategy.GROUP if g > 0 else Strategy.CHANNEL)
        object.__setattr__(self, "strategy", st)
        if st in (Strategy.GROUP, Strategy.TENSOR_GROUP) and (g is None or g <= 0):
            raise ValueError(f"QuantizationArgs: strategy {st.value!r} needs a positive group_size, got {g!r}")
        if g is not None and g > 0 and st not in (Strategy.GROUP, Strategy.TENSOR_GROUP):
            raise ValueError(f"QuantizationArgs: group_size {g} needs strategy 'group', got {st.value!r}")
        bs = self.block_structure
        if isinstance(bs, str):
            try:
                bs = [int(v) for v in bs.split("x")]
            except ValueError:
                raise _err("QuantizationArgs.block_structure", bs, "[rows, cols]") from None
        if bs is not None:
            if (not isinstance(bs, (list, tuple)) or len(bs) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in bs)):
                raise _err("QuantizationArgs.block_structure", bs, "a list of two positive ints [rows, cols]")
            bs = tuple(bs)
        object.__setattr__(self, "block_structure", bs)
        if (st is Strategy.BLOCK) != (bs is not None):
            raise ValueError(f"QuantizationArgs: strategy 'block' and block_structure go together; got strategy "
                             f"{st.value!r}, block_structure {bs!r}")
        dyn = self.dynamic
        if isinstance(dyn, str):
            if dyn.lower() != "local":
                raise _err("QuantizationArgs.dynamic", dyn, "true, false or 'local'")
            dyn = "local"
        elif not isinstance(dyn, bool):
            raise _err("QuantizationArgs.dynamic", dyn, "true, false or 'local'")
        object.__setattr__(self, "dynamic", dyn)
        if st is Strategy.TOKEN and not dyn:
            raise ValueError("QuantizationArgs: strategy 'token' needs dynamic=true (per-token scales change with "
                             "every call)")
        if dyn and st not in (Strategy.TOKEN, Strategy.TENSOR, Strategy.TENSOR_GROUP, Strategy.GROUP):
            raise ValueError(f"QuantizationArgs: dynamic quantization takes strategy token, tensor, group or "
                             f"tensor_group; got {st.value!r}")
        if dyn == "local" and st is not Strategy.TENSOR_GROUP:
            raise ValueError("QuantizationArgs: dynamic 'local' needs strategy 'tensor_group'")
        ao = self.actorder
        if ao is False:
            ao = None
        if ao is not None:
            if not isinstance(ao, str) or ao.lower() not in ("weight", "static", "group", "dynamic"):
                raise _err("QuantizationArgs.actorder", ao, "null, 'weight' or 'static'")
            ao = ao.lower()  # kept as spelled ("static" is compressed-tensors' alias of "weight")
        object.__setattr__(self, "actorder", ao)
        object.__setattr__(self, "scale_dtype", _torch_dtype_name(self.scale_dtype, "QuantizationArgs.scale_dtype"))
        zp = _torch_dtype_name(self.zp_dtype, "QuantizationArgs.zp_dtype")
        object.__setattr__(self, "zp_dtype", None if self.symmetric else zp)  # as compressed-tensors serializes it
        if self.observer is not None and not isinstance(self.observer, str):
            raise _err("QuantizationArgs.observer", self.observer, "a string or null")
        if not isinstance(self.observer_kwargs, Mapping):
            raise _err("QuantizationArgs.observer_kwargs", self.observer_kwargs, "a dict")

    @classmethod
    def from_dict(cls, d: Mapping, *, where: str = "QuantizationArgs") -> "CTArgs":
        if not isinstance(d, Mapping):
            raise _err(where, d, "a dict (QuantizationArgs)")
        unknown = sorted(set(d) - set(_ARGS_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; QuantizationArgs has {list(_ARGS_KEYS)}")
        kw = dict(d)
        if kw.get("type") is None:
            kw.pop("type", None)
        for k in ("num_bits", "symmetric", "dynamic"):
            if k in kw and kw[k] is None:
                kw.pop(k)
        if kw.get("observer_kwargs") is None:
            kw.pop("observer_kwargs", None)
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def to_dict(self) -> dict:
        """What compressed-tensors 0.20 serializes: optional keys only when set."""
        out: dict[str, Any] = {"num_bits": self.num_bits, "type": self.type.value, "symmetric": self.symmetric,
                               "group_size": self.group_size, "strategy": self.strategy.value,
                               "dynamic": self.dynamic}
        if self.block_structure is not None:
            out["block_structure"] = list(self.block_structure)
        if self.actorder is not None:
            out["actorder"] = self.actorder
        if self.scale_dtype is not None:
            out["scale_dtype"] = f"torch.{self.scale_dtype}"
        if self.zp_dtype is not None and not self.symmetric:
            out["zp_dtype"] = f"torch.{self.zp_dtype}"
        if self.observer is not None:
            out["observer"] = self.observer
        if self.observer_kwargs:
            out["observer_kwargs"] = dict(self.observer_kwargs)
        return out


_ROLE_KEYS = ("weights", "input_activations", "output_activations")


def _check_re(pattern: str, where: str) -> str:
    """``pattern`` itself, after checking that a ``re:`` pattern compiles (``ValueError`` naming it otherwise)."""
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as e:
            raise ValueError(f"{where}: bad regular expression {pattern!r}: {e}") from None
    return pattern


@dataclass(frozen=True)
class CTScheme:
    """One config group (compressed-tensors' ``QuantizationScheme``)."""

    targets: tuple
    weights: Optional[CTArgs] = None
    input_activations: Optional[CTArgs] = None
    output_activations: Optional[CTArgs] = None
    format: Optional[str] = None

    def __post_init__(self):
        t = self.targets
        if isinstance(t, str) or not isinstance(t, (list, tuple)) or not t or not all(isinstance(x, str) and x
                                                                                        for x in t):
            raise _err("QuantizationScheme.targets", t, "a non-empty list of names, class names or 're:' patterns")
        object.__setattr__(self, "targets", tuple(_check_re(x, "QuantizationScheme.targets") for x in t))
        for r in _ROLE_KEYS:
            v = getattr(self, r)
            if v is not None and not isinstance(v, CTArgs):
                raise TypeError(f"QuantizationScheme.{r} must be CTArgs or None, got {type(v).__name__}")
        if self.format is not None and not isinstance(self.format, str):
            raise _err("QuantizationScheme.format", self.format, "a format name or null")

    @classmethod
    def from_dict(cls, d: Mapping, *, where: str) -> "CTScheme":
        if isinstance(d, (list, tuple)):
            raise ValueError(f"{where}: a preset scheme name with a list of targets ({list(d)}) is not supported; "
                             f"expected the scheme written out ({{targets, weights, ...}})")
        if not isinstance(d, Mapping):
            raise _err(where, d, "a dict (QuantizationScheme)")
        unknown = sorted(set(d) - {"targets", "format", *_ROLE_KEYS})
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}")
        roles = {r: None if d.get(r) is None else CTArgs.from_dict(d[r], where=f"{where}.{r}") for r in _ROLE_KEYS}
        try:
            return cls(targets=d.get("targets"), format=d.get("format"), **roles)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"targets": list(self.targets)}
        for r in _ROLE_KEYS:
            v = getattr(self, r)
            out[r] = None if v is None else v.to_dict()
        out["format"] = self.format
        return out


_CONFIG_KEYS = ("config_groups", "quant_method", "kv_cache_scheme", "format", "quantization_status",
                "global_compression_ratio", "ignore", "moe_sparsity_config", "sparsity_config", "transform_config",
                "version", "qcore")


@dataclass(frozen=True)
class CTConfig:
    """The whole ``quantization_config`` of a compressed-tensors checkpoint (compressed status only)."""

    config_groups: Mapping
    format: str
    ignore: tuple = ()
    kv_cache_scheme: Optional[CTArgs] = None
    quantization_status: str = "compressed"
    version: Optional[str] = None
    qcore: Optional[Mapping] = None  # qcore's own block (its ModelConfig), when qcore wrote the checkpoint

    def __post_init__(self):
        if not isinstance(self.config_groups, Mapping) or not self.config_groups:
            raise _err("quantization_config.config_groups", self.config_groups, "a non-empty dict of schemes")
        for k, v in self.config_groups.items():
            if not isinstance(k, str) or not isinstance(v, CTScheme):
                raise TypeError(f"quantization_config.config_groups[{k!r}] must be a CTScheme")
        object.__setattr__(self, "config_groups", dict(self.config_groups))
        _check_format(self.format, "quantization_config.format")
        for name, s in self.config_groups.items():
            if s.format is not None:
                _check_format(s.format, f"quantization_config.config_groups.{name}.format")
        if isinstance(self.ignore, str) or not all(isinstance(x, str) and x for x in self.ignore):
            raise _err("quantization_config.ignore", self.ignore, "a list of module names or 're:' patterns")
        object.__setattr__(self, "ignore", tuple(_check_re(x, "quantization_config.ignore") for x in self.ignore))
        if self.kv_cache_scheme is not None and not isinstance(self.kv_cache_scheme, CTArgs):
            raise TypeError("quantization_config.kv_cache_scheme must be CTArgs or None")
        if self.quantization_status != "compressed":
            raise ValueError(f"quantization_config.quantization_status: got {self.quantization_status!r}; qcore reads "
                             f"and writes 'compressed' checkpoints (real low-bit tensors)")

    def scheme_format(self, name: str) -> CTFormat:
        """The format of config group ``name`` (its own, else the config's)."""
        f = self.config_groups[name].format or self.format
        if f == CTFormat.MIXED_PRECISION.value:
            raise ValueError(f"quantization_config.config_groups.{name}: format 'mixed-precision' needs a format per "
                             f"group; group {name!r} has none")
        return CTFormat(f)

    @classmethod
    def from_dict(cls, d: Mapping) -> "CTConfig":
        if not isinstance(d, Mapping):
            raise _err("quantization_config", d, "a dict")
        if d.get("quant_method") != QUANT_METHOD:
            raise _err("quantization_config.quant_method", d.get("quant_method"), repr(QUANT_METHOD))
        unknown = sorted(set(d) - set(_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"quantization_config: unknown key(s) {unknown}; expected keys among {list(_CONFIG_KEYS)}")
        for k in ("sparsity_config", "transform_config", "moe_sparsity_config"):
            if d.get(k):
                raise ValueError(f"quantization_config.{k}: {d[k]!r}; qcore does not read compressed-tensors "
                                 f"{k.split('_')[0]} configs (only quantization)")
        groups = d.get("config_groups")
        if not isinstance(groups, Mapping):
            raise _err("quantization_config.config_groups", groups, "a dict of schemes")
        schemes = {k: CTScheme.from_dict(v, where=f"quantization_config.config_groups.{k}") for k, v in groups.items()}
        kv = d.get("kv_cache_scheme")
        return cls(config_groups=schemes, format=d.get("format"), ignore=tuple(d.get("ignore") or ()),
                   kv_cache_scheme=None if kv is None else CTArgs.from_dict(kv, where="quantization_config."
                                                                                  "kv_cache_scheme"),
                   quantization_status=d.get("quantization_status", "compressed"), version=d.get("version"),
                   qcore=d.get("qcore"))

    def to_dict(self) -> dict:
        out: dict[str, Any] = {
            "config_groups": {k: v.to_dict() for k, v in self.config_groups.items()},
            "format": self.format,
            "global_compression_ratio": None,
            "ignore": list(self.ignore),
            "kv_cache_scheme": None if self.kv_cache_scheme is None else self.kv_cache_scheme.to_dict(),
            "quant_method": QUANT_METHOD,
            "quantization_status": self.quantization_status,
            "sparsity_config": {},
            "transform_config": {},
        }
        if self.version is not None:
            out["version"] = self.version
        if self.qcore is not None:
            out["qcore"] = dict(self.qcore)
        return out


def _check_format(f: Any, what: str) -> None:
    if f in _KNOWN_UNSUPPORTED:
        raise ValueError(f"{what}: format {f!r} is not supported by qcore (it reads and writes "
                         f"{[x.value for x in CTFormat]})")
    try:
        CTFormat(f)
    except ValueError:
        raise _err(what, f, f"one of {[x.value for x in CTFormat]}") from None


# ---------------------------------------------------------------------------------------------------------------
# which config group quantizes a module: compressed-tensors' rule and vLLM's
# ---------------------------------------------------------------------------------------------------------------
#
# Two readers decide, for every Linear, which config group (if any) quantizes it; qcore follows both and refuses a
# config they read differently (``resolve_groups``):
#
# - compressed-tensors 0.20 (what llm-compressor quantizes with, so what the tensors on disk were written by, and
#   what transformers loads with): compressed_tensors/quantization/lifecycle/apply.py ``apply_quantization_config``
#   and compressed_tensors/utils/match.py ``match_named_modules`` / ``is_match`` / ``match_targets`` /
#   ``_match_class`` (the release installed here, 0.20.0). Targets of all groups go into one ordered map (a target a
#   later group gives again takes that group's scheme); a module is skipped when an ``ignore`` entry matches its
#   name (exact or ``re:`` pattern, ``re.match``) or one of its classes; else its scheme is the one of the first of
#   ``match_targets``: exact names first, then ``re:`` patterns (each sorted by ``("re:" in t, t)``), then class
#   names of the module's MRO (``"Linear"`` also matching vLLM's ``LinearBase``).
# - vLLM: vllm/model_executor/layers/quantization/compressed_tensors/utils.py at commit 008014e8503b
#   (``should_ignore_layer``, ``find_matched_target``, ``_find_first_match``, ``_match_fused_layer``), called by
#   compressed_tensors.py ``get_scheme`` at commit be696453ee1b. The same ordered target map; ``ignore`` by exact
#   name or ``re:`` pattern only (no classes); then the first target in config order that equals or ``re:``-matches
#   the layer name (exact names and patterns NOT ranked: config order decides), else the first that ``re:``-matches
#   or is a case-insensitive substring of the layer's class name, else (a fused layer) the target of its first shard
#   when every shard matches one. vLLM fuses q/k/v into ``qkv_proj`` (class ``QKVParallelLinear``) and gate/up into
#   ``gate_up_proj`` (``MergedColumnParallelLinear``), so all shards get the fused module's one scheme, and an
#   ignore list that names some shards but not all is refused ("Found a different quantization schemes").
#
# Where the two differ (a regex before an exact name in config order, a class target that is a substring of a
# vLLM class, shards of a fused module in different groups), the checkpoint means different things to the two
# readers, and at least one of them misreads it.


@dataclass(frozen=True)
class Match:
    """One reader's decision for one module: ``group`` (None: float) and why: the ``target`` that matched, the
    ``ignore`` entry that matched, or ``refused`` (vLLM refuses the config for this module: the reason);
    ``layer``: the reader's name of the module when it is not the module's own (vLLM's fused ``...qkv_proj``)."""

    group: Optional[str] = None
    target: Optional[str] = None
    ignored: Optional[str] = None
    refused: Optional[str] = None
    layer: Optional[str] = None

    def describe(self) -> str:
        if self.refused:
            return f"refused ({self.refused})"
        if self.ignored is not None:
            return f"float (ignore entry {self.ignored!r})"
        if self.group is None:
            return "float (no target matches)"
        return f"group {self.group!r} (target {self.target!r})"


def target_groups(groups: Mapping[str, Sequence[str]]) -> dict:
    """``{target: group}`` as both readers build it from ``{group: targets}`` (config order): a target a later group
    gives again belongs to that group and keeps its first place."""
    out: dict = {}
    for g, targets in groups.items():
        for t in targets:
            out[t] = g
    return out


def _name_match(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def ct_match(name: str, classes: Sequence[str], groups: Mapping[str, Sequence[str]],
             ignore: Sequence[str] = ()) -> Match:
    """compressed-tensors 0.20's decision for module ``name`` whose class and base class names are ``classes``
    (section comment above)."""
    cls = set(classes) | ({"Linear"} if "LinearBase" in classes else set())
    for t in ignore:
        if _name_match(name, t) or t in cls:
            return Match(ignored=t)
    t2g = target_groups(groups)
    ranked = sorted(t2g, key=lambda t: ("re:" in t, t))
    hits = [t for t in ranked if _name_match(name, t)]
    hits += [t for t in ranked if t in cls and t not in hits]
    return Match(t2g[hits[0]], hits[0]) if hits else Match()


def _vllm_equal_or_regex(value: str, target: str, contains: bool = False) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    if contains:
        return target.lower() in value.lower()
    return target == value


def vllm_match(name: str, class_name: str, groups: Mapping[str, Sequence[str]], ignore: Sequence[str] = (), *,
               fused: Mapping[str, Sequence[str]] = {}) -> Match:
    """vLLM's decision for its layer ``name`` of class ``class_name`` (a fused ``...qkv_proj`` for q/k/v; section
    comment above); ``fused``: vLLM's ``packed_modules_mapping`` (``{"qkv_proj": ["q_proj", "k_proj", "v_proj"],
    ...}``)."""
    proj = name.split(".")[-1]
    if proj in fused and name not in ignore:  # should_ignore_layer
        flags = {s: any(_vllm_equal_or_regex(name.replace(proj, s), t) for t in ignore) for s in fused[proj]}
        if len(set(flags.values())) > 1:
            return Match(refused=f"vLLM ignores {sorted(s for s, f in flags.items() if f)} but not "
                                 f"{sorted(s for s, f in flags.items() if not f)} of its fused {proj}")
        ign = next((t for s in fused[proj] for t in ignore if _vllm_equal_or_regex(name.replace(proj, s), t)), None)
    else:
        ign = next((t for t in ignore if _vllm_equal_or_regex(name, t)), None)
    if ign is not None:
        return Match(ignored=ign)
    t2g = target_groups(groups)
    t = next((t for t in t2g if _vllm_equal_or_regex(name, t)), None)
    if t is None:
        t = next((t for t in t2g if _vllm_equal_or_regex(class_name, t, contains=True)), None)
    if t is None:  # _match_fused_layer: every shard matches a target; the first shard's is used
        key = next((k for k in fused if name.endswith(k)), None)
        if key is not None:
            firsts = [next((t for t in t2g if _vllm_equal_or_regex(name.replace(key, s), t)), None)
                      for s in fused[key]]
            t = firsts[0] if all(firsts) else None
    return Match(t2g[t], t) if t is not None else Match()


#: vLLM's class of a fused layer, by its name (vllm/model_executor/layers/linear.py)
VLLM_FUSED_CLASSES = {"qkv_proj": "QKVParallelLinear"}
_VLLM_MERGED = "MergedColumnParallelLinear"


def resolve_groups(modules: Sequence[tuple], groups: Mapping[str, Sequence[str]], ignore: Sequence[str] = (), *,
                   fused: Mapping[str, Sequence[str]] = {}) -> dict:
    """``{name: (compressed-tensors' Match, vLLM's Match)}`` for every ``(name, classes)`` of ``modules`` (the
    model's Linear-like modules as transformers builds them: class names of their MRO, most derived first),
    given the config's ``{group: targets}`` and ``ignore``. ``fused``: vLLM's ``packed_modules_mapping`` for the
    model (``{"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}``): shards
    whose siblings are all among ``modules`` get vLLM's decision for the fused layer."""
    names = {n for n, _ in modules}
    out = {}
    for name, classes in modules:
        ct = ct_match(name, classes, groups, ignore)
        parent, _, leaf = name.rpartition(".")
        vname, vcls = name, (classes[0] if classes else "")
        for key, shards in fused.items():
            sib = [f"{parent}.{s}" if parent else s for s in shards]
            if leaf in shards and all(s in names for s in sib):
                vname = f"{parent}.{key}" if parent else key
                vcls = VLLM_FUSED_CLASSES.get(key, _VLLM_MERGED)
                break
        v = vllm_match(vname, vcls, groups, ignore, fused=fused)
        out[name] = (ct, v if vname == name else dataclasses.replace(v, layer=vname))
    return out


# ---------------------------------------------------------------------------------------------------------------
# QuantizationArgs <-> QuantSpec
# ---------------------------------------------------------------------------------------------------------------

_WEIGHT, _INPUT, _OUTPUT, _KV = "weight", "input", "output", "kv_cache"


def _is_mxfp4(spec: QuantSpec) -> bool:
    return (spec.dtype.name == "float4_e2m1fn" and isinstance(spec.granularity, PerGroup)
            and spec.granularity.size == 32 and spec.scale_dtype.name == "float8_e8m0fnu"
            and spec.tensor_scale_mode is TensorScale.NONE and spec.subblock_shift_bits == 0)


def args_to_spec(args: CTArgs, *, role: str, where: str = "QuantizationArgs") -> tuple[QuantSpec, bool]:
    """(qcore spec on the canonical axes, dynamic) of compressed-tensors ``args`` for ``role`` ("weight", "input",
    "output" or "kv_cache"). Asymmetric integers become qcore's unsigned ``uint{b}`` (same numbers, see the module
    docstring); fp4 groups of 32 with E8M0 scales become MXFP4 with Quark's / compressed-tensors' ``EVEN``
    rounding of the shared exponent. Anything qcore cannot compute the same way raises ValueError."""
    if not isinstance(args, CTArgs):
        raise TypeError(f"{where} must be CTArgs, got {type(args).__name__}")
    st = args.strategy
    act = role != _WEIGHT
    if args.dynamic == "local" or st in (Strategy.TENSOR_GROUP, Strategy.ATTN_HEAD):
        raise ValueError(f"{where}: strategy {st.value!r} (dynamic {args.dynamic!r}) has no qcore mapping here "
                         f"(NVFP4 and attention-head scales are not converted)")
    if args.actorder in ("group", "dynamic"):
        raise ValueError(f"{where}: actorder 'group' (g_idx reordering) is not supported; 'weight' is")
    if role == _WEIGHT and args.dynamic:
        raise ValueError(f"{where}: dynamic weights are not supported")
    if st is Strategy.TENSOR:
        g: Any = PerTensor()
    elif st is Strategy.CHANNEL:
        if act:
            raise ValueError(f"{where}: per-channel activation scales (strategy 'channel') have no qcore mapping")
        g = PerChannel(0)
    elif st is Strategy.TOKEN:
        if not act:
            raise ValueError(f"{where}: strategy 'token' applies to activations, not weights")
        g = PerChannel(0)
    elif st is Strategy.GROUP:
        g = PerGroup(args.group_size, 1)
    else:  # block
        if act:
            raise ValueError(f"{where}: block strategy applies to weights")
        g = PerBlock(tuple(args.block_structure), axes=(0, 1))
    if args.type is QType.INT:
        b = args.num_bits
        if not 2 <= b <= 8:
            raise ValueError(f"{where}: int{b} is not supported; qcore converts 2..8-bit integers")
        if args.scale_dtype is not None and args.scale_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"{where}: scale_dtype {args.scale_dtype!r} for integers is not supported")
        if args.symmetric:
            spec = qcore.make_spec(f"int{b}", granularity=g)
        else:
            spec = qcore.make_spec(f"uint{b}", granularity=g, symmetric=False)
        return spec, bool(args.dynamic)
    if args.num_bits == 8:
        if not args.symmetric:
            raise ValueError(f"{where}: asymmetric fp8 is not supported")
        if args.scale_dtype is not None and args.scale_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"{where}: fp8 with scale_dtype {args.scale_dtype!r} (MXFP8) is not supported")
        return qcore.make_spec("float8_e4m3fn", granularity=g), bool(args.dynamic)
    if args.num_bits == 4 and st is Strategy.GROUP and args.group_size == 32 and args.scale_dtype == "uint8" \
            and args.symmetric:
        return qcore.make_spec("mxfp4", axis=1, scale_mode=ScaleMode.EVEN), bool(args.dynamic)
    raise ValueError(f"{where}: float{args.num_bits} with strategy {st.value!r}, group_size {args.group_size}, "
                     f"scale_dtype {args.scale_dtype!r} has no qcore mapping (fp8 e4m3 and MXFP4 are converted)")


def _plain_float_scale(spec: QuantSpec) -> bool:
    return (not spec.pow2_scale and spec.scale_dtype.name in ("float32", "bfloat16", "float16")
            and spec.tensor_scale_mode is TensorScale.NONE)


def spec_to_args(spec: QuantSpec, *, role: str, dynamic: bool = False, where: str = "spec") -> CTArgs:
    """compressed-tensors ``QuantizationArgs`` for a qcore spec on the canonical axes, or ValueError naming what
    compressed-tensors cannot express (the stored values would not decode to qcore's, or a dynamic activation
    would be computed differently). ``args_to_spec(spec_to_args(s))`` gives back a spec with the same grid."""
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"{where} must be a qcore.QuantSpec, got {type(spec).__name__}")
    d = spec.dtype
    name = spec.name or d.name

    def no(why: str) -> ValueError:
        return ValueError(f"{where} ({name}): {why}; compressed-tensors has no spelling for it")

    if spec.rounding is not RoundingMode.NEAREST_EVEN and (role != _WEIGHT):
        raise no(f"activation rounding {spec.rounding.name} (compressed-tensors rounds to nearest even)")
    if spec.subblock_shift_bits or spec.unit_exponent or spec.bump_on_overflow:
        raise no("shared micro-exponents / block integer formats")
    g = spec.granularity
    act = role != _WEIGHT
    kw: dict[str, Any] = {}
    if isinstance(g, PerTensor):
        kw["strategy"] = Strategy.TENSOR
    elif isinstance(g, PerChannel):
        if act:
            if g.axis % 2 != 0:
                raise no("per-feature activation scales (PerChannel(1))")
            if not dynamic:
                raise no("static per-token scales")
            kw["strategy"] = Strategy.TOKEN
        else:
            kw["strategy"] = Strategy.CHANNEL
    elif isinstance(g, PerGroup):
        kw["strategy"] = Strategy.GROUP
        kw["group_size"] = g.size
        if not dynamic and act:
            raise no("static per-group activation scales")
    elif isinstance(g, PerBlock):
        if act or len(g.shape) != 2:
            raise no(f"block granularity {g!r} on a {role}")
        kw["strategy"] = Strategy.BLOCK
        kw["block_structure"] = tuple(g.shape)
    else:
        raise no(f"granularity {g!r}")
    if role == _KV and not isinstance(g, PerTensor):
        raise no("a KV cache with other than per-tensor scales")
    if isinstance(d, IntDType):
        if d.bits > 8 or d.bits < 2:
            raise no(f"{d.bits}-bit integers (compressed-tensors packs 1..8 bits; qcore converts 2..8)")
        if not _plain_float_scale(spec):
            if act and dynamic:
                raise no(f"dynamic integer activations with {spec.scale_dtype.name} / power-of-two scales")
            if spec.tensor_scale_mode is not TensorScale.NONE:
                raise no("two-level scales")
        if spec.narrow_range:
            raise no("narrow-range integers (compressed-tensors uses the full range [-2**(b-1), 2**(b-1)-1])")
        if not d.signed and spec.symmetric:
            raise no("unsigned symmetric integers (zero point 0 over [0, qmax])")
        return CTArgs(num_bits=d.bits, type=QType.INT, symmetric=bool(spec.symmetric), dynamic=bool(dynamic), **kw)
    if isinstance(d, FloatDType):
        if d.name == "float8_e4m3fn":
            if spec.tensor_scale_mode is not TensorScale.NONE:
                raise no("two-level scales")
            if spec.pow2_scale and act and dynamic:
                raise no("dynamic fp8 activations with power-of-two scales")
            if not spec.saturate:
                raise no("non-saturating fp8 (compressed-tensors clamps to +-448)")
            if spec.scale_dtype.name not in ("float32", "bfloat16", "float16") and not (spec.pow2_scale and not
                                                                                          (act and dynamic)):
                raise no(f"{spec.scale_dtype.name} scales")
            return CTArgs(num_bits=8, type=QType.FLOAT, symmetric=True, dynamic=bool(dynamic), **kw)
        if _is_mxfp4(spec):
            if act and dynamic and spec.scale_mode is not ScaleMode.EVEN:
                raise no(f"dynamic MXFP4 with scale_mode {spec.scale_mode.name} (compressed-tensors rounds the "
                         f"shared exponent as ScaleMode.EVEN)")
            if isinstance(g, PerGroup) and g.axis % 2 != 1:
                raise no("MXFP4 blocks along another axis than the input features")
            return CTArgs(num_bits=4, type=QType.FLOAT, symmetric=True, dynamic=bool(dynamic), scale_dtype="uint8",
                          **kw)
    raise no(f"element format {d.name} (converted: int2..int8, uint2..uint8 asymmetric, fp8 e4m3, MXFP4)")


def infer_format(weights: Optional[CTArgs], inputs: Optional[CTArgs]) -> CTFormat:
    """The compression format llm-compressor picks for a scheme (compressed-tensors 0.20's
    ``infer_module_format`` priority: mxfp4, int-quantized, pack-quantized, float-quantized, naive)."""
    if weights is None:
        raise ValueError("infer_format: a scheme without weight quantization has no compressed format here")
    if weights.type is QType.FLOAT and weights.num_bits == 4 and weights.group_size == 32:
        return CTFormat.MXFP4_PACK_QUANTIZED
    if weights.type is QType.INT and inputs is not None:
        return CTFormat.INT_QUANTIZED
    if weights.type is QType.INT and 1 <= weights.num_bits <= 8:
        return CTFormat.PACK_QUANTIZED
    if weights.type is QType.FLOAT and inputs is not None:
        return CTFormat.FLOAT_QUANTIZED
    return CTFormat.NAIVE_QUANTIZED


# ---------------------------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------------------------


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an int in [1, 8], got {bits!r}")


def pack_int32(codes: np.ndarray, bits: int, *, dim: int = 1) -> np.ndarray:
    """compressed-tensors' ``pack_to_int32``: signed ``bits``-bit codes of a 2-D array, offset by ``2**(bits-1)``,
    packed densely along ``dim`` (element ``i`` at bit ``i*bits`` of each row's little-endian stream of int32
    words; ``ceil(n*bits/32)`` words)."""
    _check_bits(bits)
    c = np.asarray(codes)
    if c.ndim != 2:
        raise ValueError(f"pack_int32 takes a 2-D array, got shape {c.shape}")
    if dim not in (0, 1):
        raise ValueError(f"dim must be 0 or 1, got {dim!r}")
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if c.size and (int(c.min()) < lo or int(c.max()) > hi):
        raise ValueError(f"pack_int32: codes outside [{lo}, {hi}] for {bits} bits")
    u = (c.astype(np.int64) + (1 << (bits - 1))).astype(np.uint64)
    if dim == 0:
        u = u.T
    rows, cols = u.shape
    nwords = -(-cols * bits // 32)
    if 32 % bits == 0:
        per = 32 // bits
        pad = (-cols) % per
        if pad:
            u = np.concatenate([u, np.zeros((rows, pad), np.uint64)], axis=1)
        shifts = (np.arange(per, dtype=np.uint64) * np.uint64(bits))
        words = (u.reshape(rows, -1, per) << shifts).sum(axis=-1, dtype=np.uint64)
    else:
        pad = (-cols) % 32
        if pad:
            u = np.concatenate([u, np.zeros((rows, pad), np.uint64)], axis=1)
        # 32 elements fill exactly ``bits`` words: place each in a 64-bit window, split into the two words
        g = u.reshape(rows, -1, 32)
        start = np.arange(32, dtype=np.uint64) * np.uint64(bits)
        word, off = start // np.uint64(32), start % np.uint64(32)
        acc = np.zeros((rows, g.shape[1], bits + 1), np.uint64)
        val = g << off  # < 2**39
        for i in range(32):
            w = int(word[i])
            acc[:, :, w] += val[:, :, i] & np.uint64(0xFFFFFFFF)
            acc[:, :, w + 1] += val[:, :, i] >> np.uint64(32)
        words = acc[:, :, :bits].reshape(rows, -1)
    words = words.reshape(rows, -1)[:, :nwords]
    out = (words & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)
    return np.ascontiguousarray(out.T if dim == 0 else out)


def unpack_int32(packed: np.ndarray, bits: int, shape: tuple, *, dim: int = 1) -> np.ndarray:
    """Inverse of ``pack_int32``: int8 signed codes of ``shape`` (2-D)."""
    _check_bits(bits)
    p = np.asarray(packed)
    if p.dtype != np.int32 or p.ndim != 2:
        raise ValueError(f"unpack_int32 takes a 2-D int32 array, got {p.dtype} {p.shape}")
    shape = tuple(int(s) for s in shape)
    if dim == 0:
        p = p.T
    rows, nwords = p.shape
    cols = shape[dim]
    other = shape[1 - dim]
    if rows != other or nwords != -(-cols * bits // 32):
        raise ValueError(f"unpack_int32: packed shape {list(np.asarray(packed).shape)} does not hold {list(shape)} "
                         f"at {bits} bits along dim {dim}")
    w = p.view(np.uint32).astype(np.uint64)
    pos = np.arange(cols, dtype=np.int64) * bits
    wi, off = pos // 32, (pos % 32).astype(np.uint64)
    both = w[:, wi] >> off
    nxt = np.minimum(wi + 1, nwords - 1)
    spill = (off.astype(np.int64) + bits) > 32
    hi = np.where(spill, w[:, nxt] << (np.uint64(32) - off), np.uint64(0))
    vals = ((both | hi) & np.uint64((1 << bits) - 1)).astype(np.int64) - (1 << (bits - 1))
    out = vals.astype(np.int8)
    return np.ascontiguousarray(out.T if dim == 0 else out)


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """fp4 e2m1 codes (uint8 0..15) ``[rows, cols]`` -> bytes ``[rows, cols/2]``, element ``2j`` in the low
    nibble (compressed-tensors' ``pack_fp4_to_uint8``)."""
    c = np.asarray(codes)
    if c.ndim != 2 or c.shape[1] % 2:
        raise ValueError(f"pack_fp4 takes a 2-D array with an even number of columns, got {c.shape}")
    c = c.astype(np.uint8)
    if c.size and int(c.max()) > 15:
        raise ValueError("pack_fp4: codes above 15")
    return np.ascontiguousarray(c[:, 0::2] | (c[:, 1::2] << 4))


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    p = np.asarray(packed, np.uint8)
    out = np.empty((p.shape[0], p.shape[1] * 2), np.uint8)
    out[:, 0::2] = p & 0xF
    out[:, 1::2] = p >> 4
    return out


# ---------------------------------------------------------------------------------------------------------------
# scales in the model dtype
# ---------------------------------------------------------------------------------------------------------------

#: safetensors dtype of the scales for each model dtype name
SCALE_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def scale_to_dtype(s: np.ndarray, st_dtype: str) -> np.ndarray:
    """float32 scales as the raw array written for safetensors dtype ``st_dtype`` (F32 / BF16 bits as uint16 /
    F16), rounded to nearest even."""
    s = np.asarray(s, np.float32)
    if st_dtype == "F32":
        return s
    if st_dtype == "F16":
        with np.errstate(over="ignore"):
            return s.astype(np.float16)
    if st_dtype == "BF16":
        return np.asarray(qcore.encode(s, "bfloat16")).astype(np.uint16)
    raise ValueError(f"scale dtype {st_dtype!r}: expected one of {sorted(SCALE_DTYPES.values())}")


def scale_from_dtype(a: np.ndarray, st_dtype: str) -> np.ndarray:
    """The float32 values of a stored scale array (inverse of ``scale_to_dtype``; exact)."""
    a = np.asarray(a)
    if st_dtype == "F32":
        return a.astype(np.float32)
    if st_dtype == "F16":
        return a.view(np.float16).astype(np.float32)
    if st_dtype == "BF16":
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise ValueError(f"scale dtype {st_dtype!r}: expected one of {sorted(SCALE_DTYPES.values())}")


# ---------------------------------------------------------------------------------------------------------------
# one layer's weight tensors
# ---------------------------------------------------------------------------------------------------------------


def _scale_shape(spec: QuantSpec, shape: tuple) -> tuple:
    g = spec.granularity
    if isinstance(g, PerTensor):
        return (1,)
    if isinstance(g, PerChannel):
        return (shape[0], 1)
    return tuple(spec.scale_shape(shape))


def _shift(spec: QuantSpec) -> int:
    """What to subtract from qcore's integer codes / zero points to get compressed-tensors' signed ones."""
    d = spec.dtype
    return 0 if d.signed else 1 << (d.bits - 1)


def check_shape(spec: QuantSpec, shape: tuple, where: str) -> None:
    """ValueError unless compressed-tensors can store a weight of ``shape`` (canonical ``[out, in]``) quantized with
    ``spec``: 2-D, whole groups (what the format does not change; ``export_compressed_tensors``'s up-front check)."""
    if len(shape) != 2:
        raise ValueError(f"{where}: weight of shape {list(shape)}; compressed-tensors stores 2-D [out, in] weights")
    g = spec.granularity
    if isinstance(g, PerGroup) and shape[1] % g.size:
        raise ValueError(f"{where}: groups of {g.size} do not divide the {shape[1]} input features (compressed-"
                         f"tensors needs whole groups)")


def _check_layout(spec: QuantSpec, shape: tuple, fmt: CTFormat, where: str) -> None:
    check_shape(spec, shape, where)
    d = spec.dtype
    want = {CTFormat.PACK_QUANTIZED: isinstance(d, IntDType), CTFormat.INT_QUANTIZED: isinstance(d, IntDType),
            CTFormat.FLOAT_QUANTIZED: d.name == "float8_e4m3fn", CTFormat.NAIVE_QUANTIZED: d.name == "float8_e4m3fn",
            CTFormat.MXFP4_PACK_QUANTIZED: _is_mxfp4(spec)}.get(fmt, False)
    if not want:
        raise ValueError(f"{where}: format {fmt.value!r} does not hold {spec.name or d.name} weights")
    if fmt is CTFormat.MXFP4_PACK_QUANTIZED and shape[1] % 2:
        raise ValueError(f"{where}: MXFP4 needs an even number of input features")


def expected_weight(spec: QuantSpec, shape: tuple, *, fmt: CTFormat, scale_dtype: str,
                    where: str = "weight") -> dict:
    """``{suffix: (safetensors dtype, shape)}`` of one layer's weight tensors in ``fmt``; ``scale_dtype`` is the
    safetensors dtype of float scales (the model dtype)."""
    shape = tuple(int(s) for s in shape)
    _check_layout(spec, shape, fmt, where)
    out, inp = shape
    ss = _scale_shape(spec, shape)
    if fmt is CTFormat.PACK_QUANTIZED:
        b = spec.dtype.bits
        res = {"weight_packed": ("I32", (out, -(-inp * b // 32))), "weight_scale": (scale_dtype, ss),
               "weight_shape": ("I64", (2,))}
        if not spec.symmetric:
            if isinstance(spec.granularity, (PerTensor, PerBlock)):
                raise ValueError(f"{where}: pack-quantized stores asymmetric zero points per channel or group only")
            res["weight_zero_point"] = ("I32", (-(-ss[0] * b // 32), ss[1]))
        return res
    if fmt is CTFormat.INT_QUANTIZED:
        res = {"weight": ("I8", shape), "weight_scale": (scale_dtype, ss)}
        if not spec.symmetric:
            res["weight_zero_point"] = ("I8", ss)
        return res
    if fmt in (CTFormat.FLOAT_QUANTIZED, CTFormat.NAIVE_QUANTIZED):
        return {"weight": ("F8_E4M3", shape), "weight_scale": (scale_dtype, ss)}
    return {"weight_packed": ("U8", (out, inp // 2)), "weight_scale": ("U8", ss)}


def encode_weight(codes: np.ndarray, scales: np.ndarray, zero_points: Optional[np.ndarray], spec: QuantSpec,
                  shape: tuple, *, fmt: CTFormat, scale_dtype: str, where: str = "weight") -> dict:
    """``{suffix: (safetensors dtype, array)}`` of one layer's weight from qcore's parts (canonical codes,
    float32 scales of ``spec.scale_shape(shape)``, float32 zero points or None)."""
    exp = expected_weight(spec, shape, fmt=fmt, scale_dtype=scale_dtype, where=where)
    shape = tuple(int(s) for s in shape)
    ss = _scale_shape(spec, shape)
    codes = np.asarray(codes)
    if tuple(codes.shape) != shape:
        raise ValueError(f"{where}: codes of shape {list(codes.shape)}, expected {list(shape)}")
    scales = np.asarray(scales, np.float32).reshape(ss)
    out: dict[str, tuple] = {}
    if fmt is CTFormat.MXFP4_PACK_QUANTIZED:
        out["weight_packed"] = ("U8", pack_fp4(codes))
        out["weight_scale"] = ("U8", np.asarray(qcore.encode(scales, "float8_e8m0fnu")).astype(np.uint8))
    elif fmt in (CTFormat.FLOAT_QUANTIZED, CTFormat.NAIVE_QUANTIZED):
        out["weight"] = ("F8_E4M3", codes.astype(np.uint8))
        out["weight_scale"] = (scale_dtype, scale_to_dtype(scales, scale_dtype))
    else:
        k = _shift(spec)
        signed = codes.astype(np.int64) - k
        zp = None
        if not spec.symmetric:
            zp = np.asarray(zero_points, np.float32).reshape(ss).astype(np.int64) - k
        if fmt is CTFormat.PACK_QUANTIZED:
            b = spec.dtype.bits
            out["weight_packed"] = ("I32", pack_int32(signed, b, dim=1))
            out["weight_scale"] = (scale_dtype, scale_to_dtype(scales, scale_dtype))
            out["weight_shape"] = ("I64", np.asarray(shape, np.int64))
            if zp is not None:
                out["weight_zero_point"] = ("I32", pack_int32(zp, b, dim=0))
        else:
            out["weight"] = ("I8", signed.astype(np.int8))
            out["weight_scale"] = (scale_dtype, scale_to_dtype(scales, scale_dtype))
            if zp is not None:
                out["weight_zero_point"] = ("I8", zp.astype(np.int8))
    for k2, (dt, a) in out.items():
        if k2 not in exp or exp[k2][0] != dt or tuple(a.shape) != tuple(exp[k2][1]):
            raise RuntimeError(f"{where}: encoded {k2} {dt} {list(a.shape)} differs from its layout {exp.get(k2)} "
                               f"(a qcore bug; please report it)")
    return out


def decode_weight(arrays: Mapping, spec: QuantSpec, shape: tuple, *, fmt: CTFormat, dtypes: Mapping,
                  where: str = "weight") -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """(codes, float32 scales of ``spec.scale_shape(shape)``, float32 zero points or None) in qcore's terms from
    one layer's stored arrays (``dtypes``: their safetensors dtypes). Values are validated: scales finite and
    positive, E8M0 codes not NaN, ``weight_shape`` equal to ``shape``, ``weight_g_idx`` (if any) the identity
    grouping."""
    shape = tuple(int(s) for s in shape)
    _check_layout(spec, shape, fmt, where)
    qshape = tuple(spec.scale_shape(shape))
    if "weight_g_idx" in arrays:
        gi = np.asarray(arrays["weight_g_idx"]).reshape(-1)
        gsize = spec.granularity.size if isinstance(spec.granularity, PerGroup) else None
        if gsize is None or gi.shape != (shape[1],) or not np.array_equal(gi, np.arange(shape[1]) // gsize):
            raise ValueError(f"{where}: tensor 'weight_g_idx' reorders the groups (actorder 'group'); qcore loads "
                             f"only the identity grouping")
    zp = None
    if fmt is CTFormat.MXFP4_PACK_QUANTIZED:
        codes = unpack_fp4(arrays["weight_packed"])
        e = np.asarray(arrays["weight_scale"], np.uint8)
        if (e == 255).any():
            raise ValueError(f"{where}: tensor 'weight_scale' holds the E8M0 NaN code 255")
        scales = np.asarray(qcore.decode(e, "float8_e8m0fnu"), np.float32)
    elif fmt in (CTFormat.FLOAT_QUANTIZED, CTFormat.NAIVE_QUANTIZED):
        codes = np.asarray(arrays["weight"]).view(np.uint8)
        nan = (codes & 0x7F) == 0x7F
        if nan.any():
            raise ValueError(f"{where}: tensor 'weight' holds fp8 NaN codes")
        scales = scale_from_dtype(arrays["weight_scale"], dtypes["weight_scale"])
    else:
        k = _shift(spec)
        if fmt is CTFormat.PACK_QUANTIZED:
            ws = np.asarray(arrays["weight_shape"]).reshape(-1)
            if tuple(int(v) for v in ws) != shape:
                raise ValueError(f"{where}: tensor 'weight_shape' says {ws.tolist()}, the model's weight is "
                                 f"{list(shape)}")
            signed = unpack_int32(arrays["weight_packed"], spec.dtype.bits, shape, dim=1)
        else:
            signed = np.asarray(arrays["weight"]).astype(np.int8)
        codes = signed.astype(np.int32) + k
        lo, hi = spec.qmin, spec.qmax
        if codes.size and (codes.min() < lo or codes.max() > hi):
            raise ValueError(f"{where}: tensor 'weight' holds codes outside [{lo - k:g}, {hi - k:g}] for "
                             f"{spec.dtype.bits} bits")
        codes = codes.astype(np.int8 if spec.dtype.signed else np.uint8) if spec.dtype.bits <= 8 else codes
        scales = scale_from_dtype(arrays["weight_scale"], dtypes["weight_scale"])
        if not spec.symmetric:
            ss = _scale_shape(spec, shape)
            z = arrays.get("weight_zero_point")
            if z is None:
                raise ValueError(f"{where}: asymmetric weights need tensor 'weight_zero_point'")
            if fmt is CTFormat.PACK_QUANTIZED:
                zs = unpack_int32(np.asarray(z), spec.dtype.bits, ss, dim=0)
            else:
                zs = np.asarray(z).astype(np.int64)
            zp = (zs.astype(np.int64) + k).astype(np.float32)
            if zp.size and (zp.min() < spec.qmin or zp.max() > spec.qmax):
                raise ValueError(f"{where}: tensor 'weight_zero_point' holds values outside the code range")
            zp = zp.reshape(qshape)
    scales = np.asarray(scales, np.float32)
    if not np.all(np.isfinite(scales)) or not np.all(scales > 0):
        bad = scales[~(np.isfinite(scales) & (scales > 0))].reshape(-1)[0]
        raise ValueError(f"{where}: tensor 'weight_scale' holds {float(bad)!r}; scales must be finite and positive")
    return codes, scales.reshape(qshape), zp

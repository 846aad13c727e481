"""Quantization configs for torch models: frozen, validated values with a JSON round trip.

A config says, for every quantizable module of a model, what happens to each of its tensors (roles):

- ``TensorConfig(spec, dynamic=False, observer=MinMax())``: a core ``qcore.QuantSpec`` plus how its scale is
  found. Weights always take their scales from the weight itself (``MinMax``: the spec's own rule, exactly
  ``qcore.fake_quantize``; ``Percentile``/``MSE``: clipped; ``FourOverSix`` (NVFP4) / ``ExponentSearch`` (MX):
  searched per block, weights only). Activations are either *dynamic* (scales computed
  on every call from the tensor itself) or *static* (scales calibrated once over calibration batches by the
  observer, then fixed).
- ``LayerConfig(weight=, input=, output=, bias=)``: the roles of one module (None: that tensor stays float).
- ``ModelConfig(layer, by_type=, by_name=, exclude=, kv_cache=, algorithms=)``: the global layer config, overrides
  by module type (``"Linear"``, ``"Conv2d"``, ...) and by module name (glob patterns, or ``"re:<regex>"``), the
  modules left alone (default: the model's output head), the KV-cache config and the algorithms to run.

Granularity axes are written on a canonical layout, the same for every module type:

- weights as ``[out_features, in_features, *kernel]``: per output channel is ``PerChannel(0)``, groups along the
  input (reduction) axis are ``PerGroup(size, axis=1)``. ``nn.ConvTranspose2d`` stores ``[in, out, kh, kw]``;
  its wrapper maps the axes, so the same config means the same thing; so does transformers' ``Conv1D`` (GPT-2's
  projections, ``y = x @ W + b`` with ``W`` stored ``[in, out]``: quantized as the Linear holding ``W^T``).
  Embeddings are ``[num_embeddings, dim]``: ``PerChannel(0)`` is one scale per row, ``PerGroup(size, 1)`` groups
  along the embedding dimension.
- activations (input, output) as the 2-D view ``[tokens, features]``: per tensor ``PerTensor()``, per token
  ``PerChannel(0)`` (dynamic only), per feature ``PerChannel(1)``, per group / MX block along the features
  ``PerGroup(size, axis=1)``. For convolutions ``features`` are the channels (axis 1 of ``[N, C, H, W]``).

Precedence for a module named ``n`` of type ``T``: ``exclude`` (left alone), then the first ``by_name`` pattern
matching ``n`` (in insertion order), then ``by_type[T]``, then ``layer`` (which applies to ``Linear``, ``Conv2d``,
``ConvTranspose2d``, transformers' ``Conv1D`` and fused MoE ``Experts``; embeddings are quantized only through
``by_type``/``by_name``). A ``None`` value in ``by_name``/``by_type`` leaves the matching modules alone.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Union

import qcore
from qcore import PerBlock, PerChannel, PerGroup, PerTensor, QuantSpec, RoundingMode, ScaleMode, TensorScale
from qcore.algorithms.config import ALGORITHM_CONFIGS, ForeignAlgorithm, parse_algorithms, parse_quark_algorithm
from qcore.formats.quark_hf import QuarkConfig, QuarkExport, QuarkLayerSpec, qcore_to_quark, quark_to_qcore

__all__ = ["MinMax", "Percentile", "MSE", "FourOverSix", "ExponentSearch", "Observer", "TensorConfig", "LayerConfig",
           "KVCacheConfig", "ModelConfig", "ROLES", "MODULE_TYPES", "spec_to_dict", "spec_from_dict"]

ROLES = ("weight", "input", "output", "bias")
#: module types the adapters can wrap (``Conv1D``: transformers' GPT-2 projections; ``"Experts"``: fused MoE
#: experts, every expert's slices quantized as Linear weights: ``qcore.adapters.modules.QuantExperts``);
#: ``ModelConfig.layer`` applies to ``COMPUTE_TYPES``
MODULE_TYPES = ("Linear", "Conv2d", "ConvTranspose2d", "Embedding", "EmbeddingBag", "Conv1D", "Experts")
COMPUTE_TYPES = ("Linear", "Conv2d", "ConvTranspose2d", "Conv1D", "Experts")
DEFAULT_EXCLUDE = None  # sentinel meaning: the model's output head (see ModelConfig.exclude)
#: the largest group / block extent a config takes: a group spans at most one row of one layer, and a group longer
#: than its row is padded to its full size in memory, so 10**12 would ask for terabytes (per-channel scales are
#: ``PerChannel``)
MAX_GROUP_SIZE = 2**16
#: weights are [out_features, in_features, *kernel] (at most 4-D): their axes lie in [-4, 3]
_WEIGHT_NDIM = 4


def _err(what: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"{what}: got {value!r}; expected {expected}")


# ---------------------------------------------------------------------------------------------------------------
# observers
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MinMax:
    """Scales from the running absolute max (asymmetric: min and max), by the spec's own scale rule."""

    def to_dict(self) -> dict:
        return {"kind": "minmax"}


@dataclass(frozen=True)
class Percentile:
    """Scales from the ``q``-th percentile of |x| (0 < q <= 100) instead of the max; symmetric specs only.

    Static activations: the mean over calibration batches of each batch's percentile (``qcore.stats.percentile``).
    """

    q: float = 99.99

    def __post_init__(self):
        if isinstance(self.q, bool) or not isinstance(self.q, (int, float)) or not 0 < self.q <= 100:
            raise _err("Percentile.q", self.q, "a number in (0, 100]")
        object.__setattr__(self, "q", float(self.q))

    def to_dict(self) -> dict:
        return {"kind": "percentile", "q": self.q}


@dataclass(frozen=True)
class MSE:
    """Scales that minimise ``sum |x - fake_quantize(x)|**p`` over clipping ratios ``linspace(lo, 1, grid)``
    (``qcore.stats.mse_clip``). Static activations: the mean over calibration batches of each batch's best scale."""

    grid: int = 100
    lo: float = 0.5
    p: float = 2.0

    def __post_init__(self):
        if isinstance(self.grid, bool) or not isinstance(self.grid, int) or not 1 <= self.grid <= 10**6:
            raise _err("MSE.grid", self.grid, "a positive int, at most 10**6 (each point is one fake-quantize pass)")
        if isinstance(self.lo, bool) or not isinstance(self.lo, (int, float)) or not 0 < self.lo <= 1:
            raise _err("MSE.lo", self.lo, "a number in (0, 1]")
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not self.p > 0:
            raise _err("MSE.p", self.p, "a positive number")
        object.__setattr__(self, "lo", float(self.lo))
        object.__setattr__(self, "p", float(self.p))

    def to_dict(self) -> dict:
        return {"kind": "mse", "grid": self.grid, "lo": self.lo, "p": self.p}


@dataclass(frozen=True)
class FourOverSix:
    """Weights of two-level FP4 specs (NVFP4) only: per 16-block the E4M3 scale mapping the block's max to 6 or
    to 4, whichever has the smaller squared error, under the tensor scale amax / (6 * 256)
    (``qcore.stats.four_over_six``; arXiv 2512.02010). The scales are ordinary E4M3 values: files and loaders
    are unchanged."""

    def to_dict(self) -> dict:
        return {"kind": "four_over_six"}


@dataclass(frozen=True)
class ExponentSearch:
    """Weights of power-of-two (MX, E8M0) specs only: per block the exponent of the spec's own rule or a
    neighbour within ``radius`` (default 1: e - 1, e, e + 1), whichever has the smallest squared error
    (``qcore.stats.exponent_search``). The scales are ordinary E8M0 values: files and loaders are unchanged."""

    radius: int = 1

    def __post_init__(self):
        if isinstance(self.radius, bool) or not isinstance(self.radius, int) or not 1 <= self.radius <= 8:
            raise _err("ExponentSearch.radius", self.radius, "an int in [1, 8]")

    def to_dict(self) -> dict:
        return {"kind": "exponent_search", "radius": self.radius}


Observer = Union[MinMax, Percentile, MSE, FourOverSix, ExponentSearch]
_OBSERVERS = {"minmax": MinMax, "percentile": Percentile, "mse": MSE, "four_over_six": FourOverSix,
              "exponent_search": ExponentSearch}
#: observers that choose weight scales by a search over the weight itself (never activations)
WEIGHT_SEARCHES = (FourOverSix, ExponentSearch)


def observer_from_dict(d: Mapping) -> Observer:
    if not isinstance(d, Mapping) or d.get("kind") not in _OBSERVERS:
        raise _err("observer", d, f"a dict with 'kind' in {sorted(_OBSERVERS)}")
    args = {k: v for k, v in d.items() if k != "kind"}
    try:
        return _OBSERVERS[d["kind"]](**args)
    except TypeError as e:
        raise ValueError(f"observer {d!r}: {e}") from None


# ---------------------------------------------------------------------------------------------------------------
# QuantSpec <-> dict
# ---------------------------------------------------------------------------------------------------------------


def _g_to_dict(g) -> dict:
    if isinstance(g, PerTensor):
        return {"kind": "per_tensor"}
    if isinstance(g, PerChannel):
        return {"kind": "per_channel", "axis": g.axis}
    if isinstance(g, PerGroup):
        return {"kind": "per_group", "size": g.size, "axis": g.axis}
    return {"kind": "per_block", "shape": list(g.shape), "axes": None if g.axes is None else list(g.axes)}


def _g_from_dict(d) -> Any:
    if not isinstance(d, Mapping):
        raise _err("granularity", d, "a dict with 'kind'")
    kind = d.get("kind")
    args = {k: v for k, v in d.items() if k != "kind"}
    cls = {"per_tensor": PerTensor, "per_channel": PerChannel, "per_group": PerGroup, "per_block": PerBlock}.get(kind)
    if cls is None:
        raise _err("granularity.kind", kind, "'per_tensor', 'per_channel', 'per_group' or 'per_block'")
    if cls is PerBlock:
        for k in ("shape", "axes"):
            if k in args and args[k] is not None and not isinstance(args[k], (list, tuple)):
                raise _err(f"granularity.{k}", args[k], "a list of ints")
        args["shape"] = tuple(args.get("shape") or ())
        if args.get("axes") is not None:
            args["axes"] = tuple(args["axes"])
    try:
        return qcore.granularity.check_granularity(cls(**args))
    except TypeError as e:
        raise ValueError(f"granularity {d!r}: {e}") from None


_ENUMS = {"scale_mode": ScaleMode, "rounding": RoundingMode, "tensor_scale_mode": TensorScale}


def spec_to_dict(spec: QuantSpec) -> dict:
    """A JSON-able dict of every field of ``spec`` (``spec_from_dict`` inverts it exactly)."""
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec_to_dict takes a qcore.QuantSpec, got {type(spec).__name__}")
    out: dict[str, Any] = {}
    for f in dataclasses.fields(spec):
        v = getattr(spec, f.name)
        if f.name in ("dtype", "scale_dtype"):
            v = v.name
        elif f.name == "granularity":
            v = _g_to_dict(v)
        elif f.name in _ENUMS:
            v = v.value
        out[f.name] = v
    return out


def spec_from_dict(d: Mapping) -> QuantSpec:
    """The ``QuantSpec`` of a ``spec_to_dict`` dict. Missing fields take ``QuantSpec``'s defaults."""
    if not isinstance(d, Mapping):
        raise TypeError(f"spec_from_dict takes a dict, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(QuantSpec)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"spec dict: unknown field(s) {unknown}; expected fields of qcore.QuantSpec: {sorted(names)}")
    if "dtype" not in d:
        raise ValueError(f"spec dict {dict(d)!r} has no 'dtype'")
    args = dict(d)
    if "granularity" in args:
        args["granularity"] = _g_from_dict(args["granularity"])
    for k, e in _ENUMS.items():
        if k in args:
            try:
                args[k] = e(args[k])
            except ValueError:
                raise _err(f"spec.{k}", args[k], f"one of {[m.value for m in e]}") from None
    return QuantSpec(**args)


def _as_spec(spec: Any, what: str) -> QuantSpec:
    if isinstance(spec, QuantSpec):
        return spec
    if isinstance(spec, str):
        try:
            s = qcore.make_spec(spec)
        except (KeyError, ValueError) as e:
            raise ValueError(f"{what}: unknown format {spec!r} ({e})") from None
        if isinstance(s.granularity, PerGroup):  # block formats: blocks along the canonical input/feature axis
            s = dataclasses.replace(s, granularity=PerGroup(s.granularity.size, 1))
        return s
    raise TypeError(f"{what} must be a qcore.QuantSpec or a format name, got {type(spec).__name__}")


# ---------------------------------------------------------------------------------------------------------------
# tensor and layer configs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorConfig:
    """How one tensor of a module is quantized: ``spec`` (a ``QuantSpec`` or a format name for ``make_spec``),
    ``dynamic`` (activations only: scales from each call's tensor) and ``observer`` (static scales)."""

    spec: QuantSpec
    dynamic: bool = False
    observer: Observer = MinMax()

    def __post_init__(self):
        object.__setattr__(self, "spec", _as_spec(self.spec, "TensorConfig.spec"))
        if not isinstance(self.dynamic, bool):
            raise TypeError(f"TensorConfig.dynamic must be a bool, got {self.dynamic!r}")
        if not isinstance(self.observer, (MinMax, Percentile, MSE) + WEIGHT_SEARCHES):
            raise TypeError(f"TensorConfig.observer must be MinMax(), Percentile(q), MSE(), FourOverSix() or "
                            f"ExponentSearch(), got {self.observer!r}")
        if self.dynamic and not isinstance(self.observer, MinMax):
            raise ValueError(f"TensorConfig: a dynamic tensor takes its scale from each call (observer MinMax()); "
                             f"observer {self.observer!r} applies to static scales only")
        if isinstance(self.observer, Percentile) and not self.spec.symmetric:
            raise ValueError(f"TensorConfig: Percentile observes |x| and needs a symmetric spec; "
                             f"{self.spec.dtype.name} is asymmetric here (use MinMax() or MSE())")
        if self.spec.subblock_shift_bits and not isinstance(self.observer, MinMax):
            raise ValueError("TensorConfig: shared-microexponent specs (mx9/mx6/mx4) take MinMax() only")
        if isinstance(self.observer, FourOverSix) and not (self.spec.two_level
                                                           and self.spec.dtype.name == "float4_e2m1fn"):
            raise ValueError(f"TensorConfig.observer: FourOverSix() applies to two-level FP4 specs (NVFP4); spec "
                             f"{self.spec.name or self.spec.dtype.name!r} is not one (MX specs: ExponentSearch())")
        if isinstance(self.observer, ExponentSearch) and not self.spec.pow2_scale:
            raise ValueError(f"TensorConfig.observer: ExponentSearch() applies to power-of-two (MX, E8M0) scales; "
                             f"spec {self.spec.name or self.spec.dtype.name!r} has {self.spec.scale_dtype.name} "
                             f"scales (NVFP4: FourOverSix(); others: MSE())")
        if self.spec.two_level and not isinstance(self.observer, (MinMax, FourOverSix)):
            raise ValueError("TensorConfig: two-level (NVFP4) specs take MinMax() or FourOverSix() (weights) only")
        if self.spec.gguf and (self.dynamic or not isinstance(self.observer, MinMax)):
            raise ValueError(f"TensorConfig: GGUF type {self.spec.gguf!r} takes llama.cpp's own scale search: "
                             f"static (dynamic=False) with observer MinMax(); got dynamic={self.dynamic!r}, "
                             f"observer {self.observer!r}")
        g = self.spec.granularity
        sizes = (g.size,) if isinstance(g, PerGroup) else tuple(g.shape) if isinstance(g, PerBlock) else ()
        if any(n > MAX_GROUP_SIZE for n in sizes):
            raise ValueError(f"TensorConfig.spec: group / block size {max(sizes)} ({g!r}) is larger than qcore takes "
                             f"({MAX_GROUP_SIZE}); a group spans at most one row of a layer (per-channel scales: "
                             f"PerChannel)")

    @property
    def calibrated(self) -> bool:
        """True when calibration sets this tensor's scales: static activations, and two-level activations
        whose per-tensor scale is calibrated (``tensor_scale_mode=GIVEN``) under per-call block scales."""
        return not self.dynamic or self.spec.tensor_scale_mode is TensorScale.GIVEN

    def to_dict(self) -> dict:
        return {"spec": spec_to_dict(self.spec), "dynamic": self.dynamic, "observer": self.observer.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping) -> "TensorConfig":
        if not isinstance(d, Mapping) or "spec" not in d:
            raise _err("tensor config", d, "a dict with 'spec' (and 'dynamic', 'observer')")
        unknown = sorted(set(d) - {"spec", "dynamic", "observer"})
        if unknown:
            raise ValueError(f"tensor config: unknown field(s) {unknown}; expected 'spec', 'dynamic', 'observer'")
        obs = observer_from_dict(d["observer"]) if "observer" in d else MinMax()
        return cls(spec_from_dict(d["spec"]), dynamic=d.get("dynamic", False), observer=obs)


def _check_activation(tc: TensorConfig, role: str):
    g = tc.spec.granularity
    if isinstance(tc.observer, WEIGHT_SEARCHES):
        raise ValueError(f"LayerConfig.{role}: observer {tc.observer!r} searches a weight's scales; activations "
                         f"take MinMax(), Percentile(q) or MSE()")
    if tc.spec.gguf:
        raise ValueError(f"LayerConfig.{role}: GGUF type {tc.spec.gguf!r} is a weight format (llama.cpp stores "
                         f"weights in it); activations take another spec")
    if tc.spec.two_level and not tc.dynamic:
        raise ValueError(f"LayerConfig.{role}: two-level (NVFP4) activations have per-call block scales: "
                         f"dynamic=True, with tensor_scale_mode AMAX (tensor scale per call), GIVEN (tensor scale "
                         f"calibrated) or ONE")
    if isinstance(g, PerBlock):
        raise ValueError(f"LayerConfig.{role}: activations take PerTensor(), PerChannel(0) (per token, dynamic), "
                         f"PerChannel(1) (per feature) or PerGroup(size, axis=1); got {g!r}")
    if isinstance(g, (PerChannel, PerGroup)) and g.axis not in (0, 1, -1, -2):
        raise ValueError(f"LayerConfig.{role}: activation axes refer to the [tokens, features] view (0 or 1); "
                         f"got {g!r}")
    axis = g.axis % 2 if isinstance(g, (PerChannel, PerGroup)) else None
    if isinstance(g, PerGroup) and axis != 1:
        raise ValueError(f"LayerConfig.{role}: activation groups run along the features (axis=1); got {g!r}")
    if not tc.dynamic:
        if isinstance(g, PerChannel) and axis == 0:
            raise ValueError(f"LayerConfig.{role}: per-token scales (PerChannel(0)) change with every batch: "
                             f"they must be dynamic=True")
        if isinstance(g, PerGroup):
            raise ValueError(f"LayerConfig.{role}: per-group scales of activations ({g!r}) change with every token: "
                             f"they must be dynamic=True")
        if tc.spec.subblock_shift_bits:
            raise ValueError(f"LayerConfig.{role}: shared-microexponent activations must be dynamic=True")


def _check_weight(tc: TensorConfig, role: str):
    g = tc.spec.granularity
    if tc.spec.gguf and role != "weight":
        raise ValueError(f"LayerConfig.{role}: GGUF type {tc.spec.gguf!r} is a weight format; the {role} takes "
                         f"another spec")
    axes = (g.axis,) if isinstance(g, (PerChannel, PerGroup)) else tuple(g.axes or ()) if isinstance(g, PerBlock) \
        else ()
    if any(not -_WEIGHT_NDIM <= a < _WEIGHT_NDIM for a in axes):
        raise ValueError(f"LayerConfig.{role}: {g!r} names an axis outside [-{_WEIGHT_NDIM}, {_WEIGHT_NDIM - 1}] "
                         f"(weights are [out_features, in_features, *kernel])")
    if tc.spec.tensor_scale_mode is TensorScale.GIVEN:
        raise ValueError(f"LayerConfig.{role}: a two-level {role} spec takes its tensor scale from the {role} "
                         f"itself: tensor_scale_mode AMAX (or ONE), not GIVEN")
    if tc.dynamic:
        raise ValueError(f"LayerConfig.{role}: dynamic=True applies to activations; {role} scales always come "
                         f"from the {role} itself (use dynamic=False)")
    g = tc.spec.granularity
    if role == "bias" and not isinstance(g, (PerTensor, PerChannel, PerGroup)):
        raise ValueError(f"LayerConfig.bias: bias is 1-D; got granularity {g!r}")
    if role == "bias" and isinstance(g, (PerChannel, PerGroup)) and g.axis not in (0, -1):
        raise ValueError(f"LayerConfig.bias: bias is 1-D, its only axis is 0; got {g!r}")


@dataclass(frozen=True)
class LayerConfig:
    """The roles of one module; None leaves that tensor in float. Values may be ``TensorConfig`` or a bare
    ``QuantSpec``/format name (taken as ``TensorConfig(spec)``: static, MinMax)."""

    weight: Optional[TensorConfig] = None
    input: Optional[TensorConfig] = None
    output: Optional[TensorConfig] = None
    bias: Optional[TensorConfig] = None

    def __post_init__(self):
        for role in ROLES:
            v = getattr(self, role)
            if v is None or isinstance(v, TensorConfig):
                pass
            elif isinstance(v, (QuantSpec, str)):
                v = TensorConfig(v)
                object.__setattr__(self, role, v)
            else:
                raise TypeError(f"LayerConfig.{role} must be a TensorConfig, a QuantSpec, a format name or None, "
                                f"got {type(v).__name__}")
            if v is not None:
                (_check_activation if role in ("input", "output") else _check_weight)(v, role)

    @property
    def empty(self) -> bool:
        return all(getattr(self, r) is None for r in ROLES)

    def to_dict(self) -> dict:
        return {r: (None if getattr(self, r) is None else getattr(self, r).to_dict()) for r in ROLES}

    @classmethod
    def from_dict(cls, d: Mapping) -> "LayerConfig":
        if not isinstance(d, Mapping):
            raise _err("layer config", d, f"a dict with keys among {ROLES}")
        unknown = sorted(set(d) - set(ROLES))
        if unknown:
            raise ValueError(f"layer config: unknown role(s) {unknown}; expected {list(ROLES)}")
        return cls(**{r: (None if d.get(r) is None else TensorConfig.from_dict(d[r])) for r in ROLES})


def _fp8_per_tensor() -> QuantSpec:
    return qcore.make_spec("float8_e4m3fn")


@dataclass(frozen=True)
class KVCacheConfig:
    """Static per-tensor quantization of the keys and values written to the KV cache, as output quantization of
    the modules matching ``targets`` (Quark's way: the scales export as ``k_proj.output_scale`` /
    ``v_proj.output_scale``, which vLLM reads as ``k_scale`` / ``v_scale``). Default: fp8 e4m3, MinMax."""

    spec: QuantSpec = field(default_factory=_fp8_per_tensor)
    observer: Observer = MinMax()
    targets: tuple = ("*k_proj", "*v_proj")

    def __post_init__(self):
        object.__setattr__(self, "spec", _as_spec(self.spec, "KVCacheConfig.spec"))
        if not isinstance(self.spec.granularity, PerTensor):
            raise ValueError(f"KVCacheConfig.spec: the KV cache takes per-tensor scales (what vLLM reads); got "
                             f"{self.spec.granularity!r}")
        if isinstance(self.targets, (str, Mapping)) or not isinstance(self.targets, Iterable) or not self.targets:
            raise _err("KVCacheConfig.targets", self.targets, "a non-empty tuple of name patterns")
        object.__setattr__(self, "targets", tuple(check_pattern(t, "KVCacheConfig.targets entry")
                                                  for t in self.targets))
        if isinstance(self.observer, WEIGHT_SEARCHES):
            raise ValueError(f"KVCacheConfig.observer: {self.observer!r} searches a weight's scales; the KV cache "
                             f"takes MinMax(), Percentile(q) or MSE()")
        TensorConfig(self.spec, observer=self.observer)  # validates the observer against the spec

    @property
    def output(self) -> TensorConfig:
        return TensorConfig(self.spec, dynamic=False, observer=self.observer)

    def to_dict(self) -> dict:
        return {"spec": spec_to_dict(self.spec), "observer": self.observer.to_dict(), "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "KVCacheConfig":
        if not isinstance(d, Mapping) or "spec" not in d:
            raise _err("kv_cache", d, "a dict with 'spec', 'observer', 'targets'")
        unknown = sorted(set(d) - {"spec", "observer", "targets"})
        if unknown:
            raise ValueError(f"kv_cache: unknown field(s) {unknown}; expected 'spec', 'observer', 'targets'")
        t = d.get("targets", ("*k_proj", "*v_proj"))
        return cls(spec_from_dict(d["spec"]), observer=observer_from_dict(d.get("observer", {"kind": "minmax"})),
                   targets=tuple(t) if isinstance(t, list) else t)


def _type_name(t: Any) -> str:
    name = t if isinstance(t, str) else getattr(t, "__name__", None)
    if name not in MODULE_TYPES:
        raise ValueError(f"ModelConfig.by_type: unsupported module type {t!r}; expected one of {list(MODULE_TYPES)} "
                         f"(or the torch.nn classes)")
    return name


def check_pattern(p: Any, what: str) -> str:
    if not isinstance(p, str) or not p:
        raise _err(what, p, "a non-empty module-name pattern (glob, or 're:<regex>')")
    if p.startswith("re:"):
        try:
            re.compile(p[3:])
        except re.error as e:
            raise ValueError(f"{what}: bad regular expression {p!r}: {e}") from None
    return p


def _layer_or_none(v: Any, what: str) -> Optional[LayerConfig]:
    if v is None or isinstance(v, LayerConfig):
        return v
    raise TypeError(f"{what} must be a LayerConfig or None, got {type(v).__name__}")


@dataclass(frozen=True)
class ModelConfig:
    """What to do to a whole model (see the module docstring for precedence and axes).

    layer: the global ``LayerConfig`` (Linear, Conv2d, ConvTranspose2d, transformers' Conv1D).
    by_type: ``{module type name or torch.nn class: LayerConfig or None}``.
    by_name: ``{pattern: LayerConfig or None}``; glob (``fnmatch``) or ``"re:<regex>"`` (full match).
    exclude: names/patterns left in float. ``None`` (default): the model's output head
        (``get_output_embeddings()`` for transformers models, nothing for other models) and a vision-language
        model's vision tower and projector (``qcore.adapters.plan.default_exclude``).
    kv_cache: ``KVCacheConfig`` or None.
    algorithms: the algorithms to run before rounding, in order: their configs (``qcore.algorithms.config``:
        ``GPTQConfig``, ...), given as configs, dicts with a ``"name"`` (qcore's or Quark's keys) or names, and held
        as configs (dicts only in ``to_dict`` / ``from_dict``); an entry of a Quark config qcore cannot read is kept
        as a ``ForeignAlgorithm`` (``from_quark``) and refused by anything that would run it.
    origin: the AMD Quark ``quantization_config`` this config was read from (``from_quark``), kept so that
        ``to_quark`` writes the source's spelling back where the numerics did not change; not compared, not in
        JSON.
    """

    layer: LayerConfig = LayerConfig()
    by_type: Mapping[str, Optional[LayerConfig]] = field(default_factory=dict)
    by_name: Mapping[str, Optional[LayerConfig]] = field(default_factory=dict)
    exclude: Optional[tuple] = DEFAULT_EXCLUDE
    kv_cache: Optional[KVCacheConfig] = None
    algorithms: tuple = ()
    origin: Optional[Mapping] = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        _layer_or_none(self.layer, "ModelConfig.layer")
        if self.origin is not None and not isinstance(self.origin, Mapping):
            raise TypeError(f"ModelConfig.origin must be a dict or None, got {type(self.origin).__name__}")
        if self.layer is None:
            object.__setattr__(self, "layer", LayerConfig())
        if not isinstance(self.by_type, Mapping):
            raise TypeError(f"ModelConfig.by_type must be a dict, got {type(self.by_type).__name__}")
        bt = {_type_name(k): _layer_or_none(v, f"ModelConfig.by_type[{k!r}]") for k, v in self.by_type.items()}
        if not isinstance(self.by_name, Mapping):
            raise TypeError(f"ModelConfig.by_name must be a dict, got {type(self.by_name).__name__}")
        bn = {check_pattern(k, "ModelConfig.by_name key"): _layer_or_none(v, f"ModelConfig.by_name[{k!r}]")
              for k, v in self.by_name.items()}
        object.__setattr__(self, "by_type", _FrozenDict(bt))
        object.__setattr__(self, "by_name", _FrozenDict(bn))
        if self.exclude is not None:
            if isinstance(self.exclude, (str, Mapping)) or not isinstance(self.exclude, Iterable):
                raise _err("ModelConfig.exclude", self.exclude, "a list of names/patterns (or None: the output head)")
            object.__setattr__(self, "exclude", tuple(check_pattern(p, "ModelConfig.exclude entry")
                                                      for p in self.exclude))
        if self.kv_cache is not None and not isinstance(self.kv_cache, KVCacheConfig):
            raise TypeError(f"ModelConfig.kv_cache must be a KVCacheConfig or None, got {type(self.kv_cache).__name__}")
        if isinstance(self.algorithms, (str, Mapping)) or not isinstance(self.algorithms, Iterable):
            raise _err("ModelConfig.algorithms", self.algorithms, "a list of algorithm configs or dicts with a 'name'")
        algos = tuple(self.algorithms)
        for a in algos:
            if isinstance(a, Mapping) and not isinstance(a.get("name"), str) or \
                    not isinstance(a, (Mapping, str, ForeignAlgorithm, *ALGORITHM_CONFIGS)):
                raise _err("ModelConfig.algorithms entry", a, "a dict with a 'name'")
        try:
            object.__setattr__(self, "algorithms", parse_algorithms(algos))
        except (ValueError, TypeError) as e:
            raise type(e)(f"ModelConfig.algorithms: {e}") from None

    def to_dict(self) -> dict:
        return {
            "layer": self.layer.to_dict(),
            "by_type": {k: (None if v is None else v.to_dict()) for k, v in self.by_type.items()},
            "by_name": {k: (None if v is None else v.to_dict()) for k, v in self.by_name.items()},
            "exclude": None if self.exclude is None else list(self.exclude),
            "kv_cache": None if self.kv_cache is None else self.kv_cache.to_dict(),
            "algorithms": [a.to_dict() for a in self.algorithms],
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelConfig":
        if not isinstance(d, Mapping):
            raise TypeError(f"ModelConfig.from_dict takes a dict, got {type(d).__name__}")
        keys = {"layer", "by_type", "by_name", "exclude", "kv_cache", "algorithms"}
        unknown = sorted(set(d) - keys)
        if unknown:
            raise ValueError(f"model config: unknown field(s) {unknown}; expected {sorted(keys)}")
        for k, want, types in (("by_type", "an object {module type: layer config}", Mapping),
                               ("by_name", "an object {name pattern: layer config}", Mapping),
                               ("exclude", "a list of names/patterns", (list, tuple)),
                               ("algorithms", "a list of objects with a 'name'", (list, tuple))):
            if d.get(k) is not None and not isinstance(d[k], types):
                raise _err(f"model config field {k!r}", d[k], want)
        lc = lambda v: None if v is None else LayerConfig.from_dict(v)  # noqa: E731
        try:
            return cls(
                layer=lc(d.get("layer")) or LayerConfig(),
                by_type={k: lc(v) for k, v in (d.get("by_type") or {}).items()},
                by_name={k: lc(v) for k, v in (d.get("by_name") or {}).items()},
                exclude=None if d.get("exclude") is None else tuple(d["exclude"]),
                kv_cache=None if d.get("kv_cache") is None else KVCacheConfig.from_dict(d["kv_cache"]),
                algorithms=tuple(d.get("algorithms") or ()),
            )
        except RecursionError:
            raise ValueError("model config: nested too deeply (an algorithm's settings?)") from None

    @classmethod
    def from_quark(cls, quantization_config: Mapping, *, model_dtype: str = "float32") -> "ModelConfig":
        """The config of AMD Quark's ``quantization_config`` dict (``config_from_quark``)."""
        return config_from_quark(quantization_config, model_dtype=model_dtype)

    def to_quark(self, *, model_dtype: str = "float32") -> dict:
        """AMD Quark's ``quantization_config`` dict for this config (``config_to_quark``)."""
        return config_to_quark(self, model_dtype=model_dtype)

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_json(cls, s: str) -> "ModelConfig":
        """The config of a ``to_json`` string; malformed JSON is a ``ValueError`` (``json.JSONDecodeError``)."""
        if not isinstance(s, (str, bytes, bytearray)):
            raise TypeError(f"ModelConfig.from_json takes a JSON string, got {type(s).__name__}")
        try:
            d = json.loads(s)
        except RecursionError:
            raise ValueError("ModelConfig.from_json: the JSON is nested too deeply to be a config") from None
        return cls.from_dict(d)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _plain(v):
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


class _FrozenDict(dict):
    """A dict that refuses changes (configs are values) and hashes by content."""

    def _ro(self, *a, **k):
        raise TypeError("config mappings are read-only; build a new config (ModelConfig.replace)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _ro  # type: ignore[assignment]

    def __hash__(self):  # type: ignore[override]
        return hash(json.dumps(_plain(self), sort_keys=True, default=repr))


# ---------------------------------------------------------------------------------------------------------------
# ModelConfig <-> AMD Quark's quantization_config (formerly adapters/quark_config.py)
# ---------------------------------------------------------------------------------------------------------------
#
# ``ModelConfig`` <-> AMD Quark's ``quantization_config`` (the schema of ``qcore.formats.quark_hf``).
#
# - ``config_from_quark(d)``: Quark's dict (as written in an HF ``config.json``) -> ``ModelConfig``.
# - ``config_to_quark(config)``: ``ModelConfig`` -> Quark's dict, every field Quark writes derived the way Quark 0.13
#   writes it (observer classes, ``ch_axis`` spellings, ``"export"`` block).
#
# A Quark config read and written back is equal (tested on configs written by Quark 0.13 itself). What does not
# map is refused with a ``ValueError`` naming the field, in both directions: Quark's softmax quantization, KV
# scales after RoPE, progressive two-stage weights (``int4_fp8``), ``Percentile``/``MSE`` observers,
# non-default export settings.
#
# Mapping: ``global_quant_config`` <-> ``layer``; ``layer_quant_config`` <-> ``by_name``;
# ``layer_type_quant_config`` <-> ``by_type``; ``exclude`` <-> ``exclude`` (qcore's default, the model's output
# head, is written as Quark's ``["lm_head"]``, and Quark's ``["lm_head"]`` is read as that default, so the config also
# applies to models without an ``lm_head``); ``kv_cache_quant_config`` (one entry per target: the global layer config with
# ``output_tensors`` replaced) <-> ``kv_cache``; ``algo_config`` <-> ``algorithms``. Two-level NVFP4: Quark's
# static scale-of-scales spec is ``TensorScale.GIVEN``; on weights qcore computes it from the weight
# (``TensorScale.AMAX``), which is what Quark's static weight observer does.

__all__ += ["config_from_quark", "config_to_quark"]

_ROLES = {"weight": "weight", "input": "input_tensors", "output": "output_tensors", "bias": "bias"}
_QUARK_VERSION = "0.13"


def _tc_from_quark(value, role: str, where: str, model_dtype: str) -> Optional[TensorConfig]:
    if value is None:
        return None
    try:
        spec, dynamic = quark_to_qcore(value, role=role, model_dtype=model_dtype)
        if role in ("weight", "bias") and spec.tensor_scale_mode is TensorScale.GIVEN:
            spec = dataclasses.replace(spec, tensor_scale_mode=TensorScale.AMAX)
        if role in ("weight", "bias"):
            dynamic = False  # Quark writes is_dynamic false for weights; qcore's weights are always from the weight
        return TensorConfig(spec, dynamic=dynamic)  # its checks too (a group larger than qcore takes)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None


def _layer_from_quark(ls: QuarkLayerSpec, where: str, model_dtype: str) -> LayerConfig:
    return LayerConfig(**{r: _tc_from_quark(getattr(ls, q), r, f"{where}.{q}", model_dtype) for r, q in _ROLES.items()})


def _tc_to_quark(tc: Optional[TensorConfig], role: str, where: str, model_dtype: str, like=None):
    if tc is None:
        return None
    if tc.spec.gguf:
        raise ValueError(f"{where}: GGUF type {tc.spec.gguf!r} has no Quark spelling (Quark has no float block "
                         f"offsets or super-block scales); such configs are qcore's own (to_dict) and GGUF's")
    if like is not None:  # keep the source's spelling of the same numerics
        try:
            if _tc_from_quark(like, role, where, model_dtype) == tc:
                return like
        except ValueError:
            pass
    # a weight search's scales are ordinary scales of the spec, stored in the checkpoint: Quark's spelling is the
    # spec's (qcore's own config block keeps the observer)
    if not isinstance(tc.observer, MinMax) and not (role in ("weight", "bias")
                                                    and isinstance(tc.observer, WEIGHT_SEARCHES)):
        raise ValueError(f"{where}: observer {tc.observer!r} has no Quark spelling here (only MinMax() converts; "
                         f"FourOverSix() / ExponentSearch() on weights)")
    spec = tc.spec
    if role in ("weight", "bias") and spec.tensor_scale_mode is TensorScale.AMAX:
        spec = dataclasses.replace(spec, tensor_scale_mode=TensorScale.GIVEN)
    try:
        return qcore_to_quark(spec, role=role, dynamic=tc.dynamic, model_dtype=model_dtype)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from None


def _layer_to_quark(lc: Optional[LayerConfig], where: str, model_dtype: str,
                    like: Optional[QuarkLayerSpec] = None) -> QuarkLayerSpec:
    lc = lc or LayerConfig()
    out = QuarkLayerSpec(**{q: _tc_to_quark(getattr(lc, r), r, f"{where}.{r}", model_dtype,
                                            None if like is None else getattr(like, q))
                            for r, q in _ROLES.items()})
    if like is not None and all(getattr(out, q) is getattr(like, q) for q in _ROLES.values()):
        return like
    return out


def config_from_quark(d: Any, *, model_dtype: str = "float32") -> ModelConfig:
    """The ``ModelConfig`` of a Quark ``quantization_config`` (a dict, or a ``QuarkConfig``).

    model_dtype: the model's dtype, which Quark's ``scale_type: "float"`` refers to."""
    try:
        qc = d if isinstance(d, QuarkConfig) else QuarkConfig.from_dict(d)
    except RecursionError:  # unknown keys are kept (Quark adds fields); one nested without end is not a config
        raise ValueError("quantization_config: nested too deeply to be a Quark config") from None
    if qc.softmax_quant_spec is not None:
        raise ValueError("quantization_config.softmax_quant_spec: qcore does not quantize attention softmax outputs")
    if qc.kv_cache_post_rope:
        raise ValueError("quantization_config.kv_cache_post_rope: qcore's KV-cache scales are on the k/v projection "
                         "outputs (before RoPE)")
    ex = qc.export
    if ex is not None and (ex.weight_merge_groups or ex.min_kv_scale != 0.0 or ex.extra):
        raise ValueError(f"quantization_config.export: {ex.to_dict()} has settings qcore does not reproduce "
                         f"(weight_merge_groups / min_kv_scale)")
    layer = _layer_from_quark(qc.global_quant_config, "global_quant_config", model_dtype)
    by_type = {}
    for k, v in (qc.layer_type_quant_config or {}).items():
        name = k.rsplit(".", 1)[-1]
        if name not in MODULE_TYPES:
            raise ValueError(f"layer_type_quant_config: module type {k!r} is not one qcore quantizes "
                             f"({list(MODULE_TYPES)})")
        by_type[name] = _layer_from_quark(v, f"layer_type_quant_config[{k!r}]", model_dtype)
    by_name = {k: _layer_from_quark(v, f"layer_quant_config[{k!r}]", model_dtype)
               for k, v in (qc.layer_quant_config or {}).items()}
    kv = None
    if qc.kv_cache_quant_config:
        outs = set()
        for pat, ls in qc.kv_cache_quant_config.items():
            lc = _layer_from_quark(ls, f"kv_cache_quant_config[{pat!r}]", model_dtype)
            if lc.output is None:
                raise ValueError(f"kv_cache_quant_config[{pat!r}]: no output_tensors spec (the KV-cache scale)")
            rest = dataclasses.replace(lc, output=None)
            if rest != layer:
                raise ValueError(f"kv_cache_quant_config[{pat!r}]: its weight/input specs differ from "
                                 f"global_quant_config; qcore's KV-cache config changes only the output")
            outs.add(lc.output)
        if len(outs) != 1:
            raise ValueError("kv_cache_quant_config: the entries have different output specs; qcore's KV-cache config "
                             "has one")
        out = outs.pop()
        if out.dynamic:
            raise ValueError("kv_cache_quant_config: dynamic KV-cache scales are not supported (vLLM reads static ones)")
        kv = KVCacheConfig(out.spec, observer=out.observer, targets=tuple(qc.kv_cache_quant_config))
        if ex is not None and tuple(ex.kv_cache_group) != kv.targets:
            raise ValueError(f"quantization_config.export.kv_cache_group {list(ex.kv_cache_group)} differs from the "
                             f"kv_cache_quant_config patterns {list(kv.targets)}")
    elif ex is not None and ex.kv_cache_group:
        raise ValueError(f"quantization_config.export.kv_cache_group {list(ex.kv_cache_group)} without a "
                         f"kv_cache_quant_config")
    if kv is not None:  # Quark also lists the KV targets in layer_quant_config: implied by kv_cache here
        implied = dataclasses.replace(layer, output=kv.output)
        by_name = {k: v for k, v in by_name.items() if not (k in kv.targets and v == implied)}
    algos = qc.algo_config
    algorithms = ()
    if algos is not None:
        items = list(algos) if isinstance(algos, (list, tuple)) else [algos]
        for a in items:
            if not isinstance(a, Mapping) or not isinstance(a.get("name"), str):
                raise ValueError(f"quantization_config.algo_config: entry {a!r} has no 'name'")
        algorithms = tuple(parse_quark_algorithm(a) for a in items)
    exclude = None if qc.exclude is None or tuple(qc.exclude) == ("lm_head",) else tuple(qc.exclude)
    return ModelConfig(layer, by_type=by_type, by_name=by_name, exclude=exclude, kv_cache=kv, algorithms=algorithms,
                       origin=qc.to_dict())


def config_to_quark(config: ModelConfig, *, model_dtype: str = "float32", pack_method: str = "reorder",
                    weight_format: str = "real_quantized") -> dict:
    """Quark's ``quantization_config`` dict for ``config`` (what ``config.json`` holds for a Quark export).

    Fields are derived as Quark 0.13 writes them. A config read with ``config_from_quark`` remembers its source
    (``ModelConfig.origin``): wherever the numerics are unchanged, the source's own spelling is written back, so
    a Quark config read and written back is equal.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    like = QuarkConfig.from_dict(config.origin) if config.origin is not None else None
    if any(v is None for v in config.by_type.values()):
        raise ValueError(f"by_type: None entries ({[k for k, v in config.by_type.items() if v is None]}) have no "
                         f"Quark spelling (Quark's exclude lists names); use by_name or exclude")
    lk = (lambda m, k: None if like is None or not m(like) or k not in m(like) else m(like)[k])  # noqa: E731
    layer = _layer_to_quark(config.layer, "layer", model_dtype, None if like is None else like.global_quant_config)
    by_name = {k: _layer_to_quark(v, f"by_name[{k!r}]", model_dtype, lk(lambda q: q.layer_quant_config, k))
               for k, v in config.by_name.items() if v is not None}
    kv: dict[str, QuarkLayerSpec] = {}
    if config.kv_cache is not None:
        merged = dataclasses.replace(config.layer, output=config.kv_cache.output)
        for pat in config.kv_cache.targets:
            kv[pat] = _layer_to_quark(merged, f"kv_cache[{pat!r}]", model_dtype,
                                      lk(lambda q: q.kv_cache_quant_config, pat))
            if pat not in by_name:  # Quark lists the KV targets in layer_quant_config too
                by_name[pat] = _layer_to_quark(merged, f"kv_cache[{pat!r}]", model_dtype,
                                               lk(lambda q: q.layer_quant_config, pat))
    exclude = ("lm_head",) if config.exclude is None else tuple(config.exclude)
    # by_name entries left float, in sorted order: a config read back from JSON (written with sorted keys) spells
    # the same exclude list as the one in memory (from_gguf's configs name float Linears this way)
    exclude += tuple(sorted(n for n, v in config.by_name.items() if v is None and n not in exclude))
    algos = [e for e in map(_algo_to_quark, config.algorithms) if e is not None] or None  # None: no Quark entry
    if like is not None and algos is None and not like.algo_config:
        algos = like.algo_config  # [] and null both mean none
    export = QuarkExport(kv_cache_group=tuple(kv), weight_format=weight_format, pack_method=pack_method)
    if like is not None and like.export is not None and dataclasses.replace(
            like.export, weight_format=weight_format, pack_method=pack_method) == like.export and \
            tuple(like.export.kv_cache_group) == tuple(kv):
        export = like.export
    qc = QuarkConfig(
        global_quant_config=layer,
        exclude=exclude,
        algo_config=algos,
        layer_type_quant_config={k: _layer_to_quark(v, f"by_type[{k!r}]", model_dtype,
                                                    lk(lambda q: q.layer_type_quant_config, k))
                                 for k, v in config.by_type.items()},
        layer_quant_config=by_name,
        kv_cache_quant_config=kv,
        version=_QUARK_VERSION if like is None else like.version,
        export=export,
    )
    return qc.to_dict()


def _algo_to_quark(a) -> Optional[dict]:
    """One algorithm entry in Quark's ``algo_config`` schema (entries qcore cannot read are kept as given); None for
    an algorithm Quark has no entry for and whose checkpoint needs none to load (HQQ)."""
    return a.to_quark()


# ---------------------------------------------------------------------------------------------------------------
# name patterns (exclude, by_name, KV-cache targets): glob or "re:<regex>"
# ---------------------------------------------------------------------------------------------------------------

def match_name(pattern: str, name: str) -> bool:
    """Whether the module or parameter ``name`` matches ``pattern`` (a glob, ``fnmatch``, or ``"re:<regex>"``, a full
    match)."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def match_tree(pattern: str, name: str) -> bool:
    """``pattern`` matches ``name`` or one of its parent modules (a pattern naming a block covers the block)."""
    parts = name.split(".")
    return any(match_name(pattern, ".".join(parts[:i])) for i in range(len(parts), 0, -1))

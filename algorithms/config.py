"""Algorithm settings as frozen, validated values, read from qcore's own dicts and from AMD Quark's
``algo_config`` schema (as found in Quark's exported ``config.json`` files and its recipe JSON files).

``parse_algorithm(d)`` turns one dict (with a ``"name"``) into one of:

- ``GPTQConfig(block_size=128, damp=0.01, act_order=True, static_groups=False, true_sequential=False,
  modules=(), decoder_layers=None)``; Quark keys: ``damp_percent``, ``desc_act``, ``static_groups``,
  ``block_size``, ``inside_layer_modules``, ``model_decoder_layers``.
- ``AWQConfig(grid=20, clip=True, n_tokens=4096, scaling_layers=(), decoder_layers=None)``; Quark keys:
  ``scaling_layers``, ``model_decoder_layers`` (Quark's AWQ has no clip switch; its recipes search clipping).
- ``SmoothQuantConfig(alpha=0.5, clamp_min=1e-5, scaling_layers=(), decoder_layers=None)``; Quark name
  ``"smooth"``, keys ``alpha``, ``scale_clamp_min``, ``scaling_layers``, ``model_decoder_layers``.
- ``AutoSmoothQuantConfig(loss=SmoothLoss.MSE, n_tokens=4096, scaling_layers=(), decoder_layers=None)``; Quark keys
  ``compute_scale_loss`` ("MSE"/"MAE"), ``scaling_layers``, ``model_decoder_layers``.

Unknown keys are refused (naming the key and the known ones), except Quark bookkeeping keys that change nothing
here (listed in ``_IGNORED``). ``to_dict()`` gives qcore's dict back (``parse_algorithm(c.to_dict()) == c``);
``to_quark()`` gives Quark's schema. Pure data: no torch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from .smoothquant import SmoothLoss

__all__ = ["GPTQConfig", "AWQConfig", "SmoothQuantConfig", "AutoSmoothQuantConfig", "AlgorithmConfig",
           "parse_algorithm", "parse_algorithms", "ALGORITHM_NAMES"]

# Quark keys that carry no setting qcore uses (device placement, Quark-internal switches)
_IGNORED = frozenset({"num_fewshot", "cuda_graph", "use_cuda_graph", "device", "compute_device"})


def _bool(v, name):
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {v!r}")
    return v


def _int(v, name, lo=1):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return int(v)


def _real(v, name, lo, hi, *, lo_open=False):
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    v = float(v)
    if v < lo or v > hi or (lo_open and v == lo):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}")
    return v


def _names(v, name) -> tuple:
    if v is None:
        return ()
    if isinstance(v, str) or not all(isinstance(s, str) for s in v):
        raise TypeError(f"{name} must be a list of module names, got {v!r}")
    return tuple(v)


def _layers_path(v, name):
    if v in (None, ""):
        return None
    if not isinstance(v, str):
        raise TypeError(f"{name} must be a dotted module path such as 'model.layers', got {v!r}")
    return v


def _scaling_layers(v, name) -> tuple:
    if v is None:
        return ()
    if isinstance(v, (str, Mapping)):
        raise TypeError(f"{name} must be a list of dicts with prev_op, layers, inp, got {v!r}")
    out = []
    for e in v:
        if not isinstance(e, Mapping) or not isinstance(e.get("prev_op"), str) or not e.get("layers"):
            raise ValueError(f"{name}: entry {e!r} needs 'prev_op' (a module name) and 'layers' (a list of names)")
        unknown = set(e) - {"prev_op", "layers", "inp", "module2inspect", "help"}
        if unknown:
            raise ValueError(f"{name}: entry {e!r} has unknown keys {sorted(unknown)}")
        out.append(tuple(sorted((k, tuple(x) if isinstance(x, list) else x) for k, x in e.items())))
    return tuple(out)


def _entries(t: tuple) -> list:
    return [{k: (list(x) if isinstance(x, tuple) else x) for k, x in e} for e in t]


@dataclass(frozen=True)
class GPTQConfig:
    """GPTQ settings. ``damp``: relative to the mean Hessian diagonal; ``act_order``: process columns by
    descending Hessian diagonal; ``static_groups``: all group scales from the weight before the loop (else
    each group's scale from its current values when first reached); ``true_sequential``: within a decoder
    layer, quantize the attention input projections, then the output projection, then the MLP, each from
    statistics of the already quantized earlier ones; ``modules``: names (relative to the layer) in order,
    default all quantized Linears; ``decoder_layers``: dotted path of the decoder layer list (default:
    detected)."""

    block_size: int = 128
    damp: float = 0.01
    act_order: bool = True
    static_groups: bool = False
    true_sequential: bool = False
    modules: tuple = ()
    decoder_layers: Optional[str] = None
    name: str = field(default="gptq", init=False)

    def __post_init__(self):
        _int(self.block_size, "GPTQConfig.block_size")
        _real(self.damp, "GPTQConfig.damp", 0.0, 1e6)
        _bool(self.act_order, "GPTQConfig.act_order")
        _bool(self.static_groups, "GPTQConfig.static_groups")
        _bool(self.true_sequential, "GPTQConfig.true_sequential")
        object.__setattr__(self, "modules", _names(self.modules, "GPTQConfig.modules"))
        _layers_path(self.decoder_layers, "GPTQConfig.decoder_layers")

    def to_dict(self) -> dict:
        return {"name": "gptq", "block_size": self.block_size, "damp": self.damp, "act_order": self.act_order,
                "static_groups": self.static_groups, "true_sequential": self.true_sequential,
                "modules": list(self.modules), "decoder_layers": self.decoder_layers}

    def to_quark(self) -> dict:
        return {"name": "gptq", "block_size": self.block_size, "damp_percent": self.damp,
                "desc_act": self.act_order, "static_groups": self.static_groups,
                "inside_layer_modules": list(self.modules), "model_decoder_layers": self.decoder_layers or ""}


@dataclass(frozen=True)
class AWQConfig:
    """AWQ settings: ``grid`` points of the scale exponent in [0, 1); ``clip``: also search per-group
    clipping; ``n_tokens``: calibration tokens sampled for the searches; ``scaling_layers``: Quark-style
    entries (default: detected from the architecture)."""

    grid: int = 20
    clip: bool = True
    n_tokens: int = 4096
    scaling_layers: tuple = ()
    decoder_layers: Optional[str] = None
    name: str = field(default="awq", init=False)

    def __post_init__(self):
        _int(self.grid, "AWQConfig.grid")
        _bool(self.clip, "AWQConfig.clip")
        _int(self.n_tokens, "AWQConfig.n_tokens")
        object.__setattr__(self, "scaling_layers", _scaling_layers(self.scaling_layers, "AWQConfig.scaling_layers"))
        _layers_path(self.decoder_layers, "AWQConfig.decoder_layers")

    def to_dict(self) -> dict:
        return {"name": "awq", "grid": self.grid, "clip": self.clip, "n_tokens": self.n_tokens,
                "scaling_layers": _entries(self.scaling_layers), "decoder_layers": self.decoder_layers}

    def to_quark(self) -> dict:
        return {"name": "awq", "scaling_layers": _entries(self.scaling_layers),
                "model_decoder_layers": self.decoder_layers or ""}


@dataclass(frozen=True)
class SmoothQuantConfig:
    """SmoothQuant with a fixed ``alpha`` (migration strength, 0..1) and scales clamped at ``clamp_min``."""

    alpha: float = 0.5
    clamp_min: float = 1e-5
    scaling_layers: tuple = ()
    decoder_layers: Optional[str] = None
    name: str = field(default="smoothquant", init=False)

    def __post_init__(self):
        _real(self.alpha, "SmoothQuantConfig.alpha", 0.0, 1.0)
        _real(self.clamp_min, "SmoothQuantConfig.clamp_min", 0.0, 1e6, lo_open=True)
        object.__setattr__(self, "scaling_layers",
                           _scaling_layers(self.scaling_layers, "SmoothQuantConfig.scaling_layers"))
        _layers_path(self.decoder_layers, "SmoothQuantConfig.decoder_layers")

    def to_dict(self) -> dict:
        return {"name": "smoothquant", "alpha": self.alpha, "clamp_min": self.clamp_min,
                "scaling_layers": _entries(self.scaling_layers), "decoder_layers": self.decoder_layers}

    def to_quark(self) -> dict:
        return {"name": "smooth", "alpha": self.alpha, "scale_clamp_min": self.clamp_min,
                "scaling_layers": _entries(self.scaling_layers), "model_decoder_layers": self.decoder_layers or ""}


@dataclass(frozen=True)
class AutoSmoothQuantConfig:
    """SmoothQuant with ``alpha`` searched per scaling group, minimising the quantized output's ``loss``
    ("mse" or "mae") on ``n_tokens`` sampled calibration tokens."""

    loss: SmoothLoss = SmoothLoss.MSE
    n_tokens: int = 4096
    scaling_layers: tuple = ()
    decoder_layers: Optional[str] = None
    name: str = field(default="autosmoothquant", init=False)

    def __post_init__(self):
        loss = self.loss
        if isinstance(loss, str) and loss.lower() in ("mse", "mae"):  # JSON / Quark's "MSE", "MAE"
            loss = SmoothLoss(loss.lower())
        if not isinstance(loss, SmoothLoss):
            raise ValueError(f"AutoSmoothQuantConfig.loss must be 'mse' or 'mae' (SmoothLoss), got {self.loss!r}")
        object.__setattr__(self, "loss", loss)
        _int(self.n_tokens, "AutoSmoothQuantConfig.n_tokens")
        object.__setattr__(self, "scaling_layers",
                           _scaling_layers(self.scaling_layers, "AutoSmoothQuantConfig.scaling_layers"))
        _layers_path(self.decoder_layers, "AutoSmoothQuantConfig.decoder_layers")

    def to_dict(self) -> dict:
        return {"name": "autosmoothquant", "loss": self.loss.value, "n_tokens": self.n_tokens,
                "scaling_layers": _entries(self.scaling_layers), "decoder_layers": self.decoder_layers}

    def to_quark(self) -> dict:
        return {"name": "autosmoothquant", "compute_scale_loss": self.loss.value.upper(),
                "scaling_layers": _entries(self.scaling_layers), "model_decoder_layers": self.decoder_layers}


AlgorithmConfig = Union[GPTQConfig, AWQConfig, SmoothQuantConfig, AutoSmoothQuantConfig]

# name -> (class, {key in the dict: constructor argument}) ; qcore's own keys map to themselves
_SCHEMAS: dict[str, tuple[type, dict[str, str]]] = {
    "gptq": (GPTQConfig, {"damp_percent": "damp", "desc_act": "act_order", "inside_layer_modules": "modules",
                          "model_decoder_layers": "decoder_layers"}),
    "awq": (AWQConfig, {"model_decoder_layers": "decoder_layers"}),
    "smoothquant": (SmoothQuantConfig, {"scale_clamp_min": "clamp_min", "model_decoder_layers": "decoder_layers"}),
    "autosmoothquant": (AutoSmoothQuantConfig, {"compute_scale_loss": "loss", "model_decoder_layers": "decoder_layers"}),
}
_ALIASES = {"smooth": "smoothquant", "smooth_quant": "smoothquant", "auto_smoothquant": "autosmoothquant"}
ALGORITHM_NAMES = tuple(_SCHEMAS)


def parse_algorithm(d: Union[Mapping, AlgorithmConfig, str]) -> AlgorithmConfig:
    """One algorithm config from a dict with a ``"name"`` (qcore's or Quark's keys), a name alone, or a config."""
    if isinstance(d, (GPTQConfig, AWQConfig, SmoothQuantConfig, AutoSmoothQuantConfig)):
        return d
    if isinstance(d, str):
        d = {"name": d}
    if not isinstance(d, Mapping):
        raise TypeError(f"an algorithm config must be a dict with a 'name' or a name, got {type(d).__name__}")
    name = d.get("name")
    if not isinstance(name, str):
        raise ValueError(f"algorithm config {dict(d)!r} has no 'name'")
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in _SCHEMAS:
        raise ValueError(f"algorithm {name!r} is not available; known: {list(ALGORITHM_NAMES)} (Quark's 'smooth' "
                         f"is smoothquant; rotations arrive with issue 11)")
    cls, renames = _SCHEMAS[key]
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for k, v in d.items():
        if k == "name" or k in _IGNORED:
            continue
        arg = renames.get(k, k)
        if arg not in fields:
            raise ValueError(f"{key} config: unknown key {k!r}; known keys: {sorted(fields | set(renames))}")
        if arg in kwargs:
            raise ValueError(f"{key} config: {k!r} and another key both set {arg!r}")
        kwargs[arg] = v
    if key == "gptq" and "static_groups" not in kwargs and any(k in d for k in renames):
        kwargs["static_groups"] = True  # a Quark recipe gets Quark's default (its export needs static groups)
    return cls(**kwargs)


def parse_algorithms(items) -> tuple:
    """A tuple of algorithm configs from a list (or a comma-separated string of names, as ``--algo``)."""
    if isinstance(items, str):
        items = [s.strip() for s in items.split(",") if s.strip()]
    return tuple(parse_algorithm(a) for a in items)

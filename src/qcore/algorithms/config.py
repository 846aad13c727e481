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

- ``QuaRotConfig(key=0, heads=True, online=("mlp.down_proj", "self_attn.o_proj"), decoder_layers=None,
  block=None)`` (``block``: block-diagonal rotations of that size, or ``"auto"``) and
  ``SpinQuantConfig(..., steps=100, lr=1.5, batch=1, train_weights=None)``; Quark's ``{"name": "rotation", r1, r2, r4, random_r1,
  trainable, rotation_size, ...}`` (r3, online R1, online block rotations and trained smoothing are refused; a
  fused block rotation, ``rotation_size`` without r4, reads as ``block``).
- ``HQQConfig(p=0.7, beta=10.0, kappa=1.01, iters=20, error_p=2.0, scale_floor=1.0, decoder_layers=None)``: no
  Quark algorithm (``to_quark()`` is None);
  mobiusml/hqq's ``lp_norm`` reads as ``p``.

- ``AutoRoundConfig(iters=200, lr=None, minmax_lr=None, enable_minmax_tuning=True, batch_size=8, key=0, modules=(),
  decoder_layers=None)``; Quark keys ``iters``, ``lr``, ``minmax_lr``, ``enable_minmax_tuning``, ``batch_size``,
  ``inside_layer_modules``, ``model_decoder_layers``.

Unknown keys are refused (naming the key and the known ones), except Quark bookkeeping keys that change nothing
here (listed in ``_IGNORED``). ``to_dict()`` gives qcore's dict back (``parse_algorithm(c.to_dict()) == c``);
``to_quark()`` gives Quark's schema. Pure data: no torch.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Optional, Sequence, Union

from .hadamard import is_constructible
from .smoothquant import SmoothLoss

__all__ = ["GPTQConfig", "AWQConfig", "SmoothQuantConfig", "AutoSmoothQuantConfig", "QuaRotConfig",
           "SpinQuantConfig", "AutoRoundConfig", "GPTAQConfig", "QronosConfig", "HQQConfig", "SVDQuantConfig",
           "DistillConfig", "ROTATION_CONFIGS", "split_rotation", "AlgorithmConfig",
           "parse_algorithm", "parse_algorithms", "ALGORITHM_NAMES", "ALGORITHM_CONFIGS", "ForeignAlgorithm", "parse_quark_algorithm", "check_runnable"]

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


def real_in_range(v, name, lo, hi, *, lo_open=False):
    """``v`` as a float in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); ValueError naming ``name`` otherwise (a bool,
    a non-number, NaN or Inf, or out of range). The configs' check of a real setting, and ``hqq``'s."""
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
    if isinstance(v, (str, Mapping)) or not isinstance(v, (list, tuple)):
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
        real_in_range(self.damp, "GPTQConfig.damp", 0.0, 1e6)
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
        real_in_range(self.alpha, "SmoothQuantConfig.alpha", 0.0, 1.0)
        real_in_range(self.clamp_min, "SmoothQuantConfig.clamp_min", 0.0, 1e6, lo_open=True)
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


_ONLINE = ("mlp.down_proj", "self_attn.o_proj")
# Quark's RotationConfig keys whose Llama defaults are what qcore's rotations do (any other value is refused)
_QUARK_ROTATION_PATHS = {"backbone": "model", "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
                         "self_attn": "self_attn", "mlp": "mlp"}


def _online(v, name) -> tuple:
    v = _names(v, name)
    bad = [o for o in v if o not in _ONLINE]
    if bad or len(set(v)) != len(v):
        raise ValueError(f"{name} must name distinct entries of {list(_ONLINE)}, got {list(v)!r}")
    return tuple(o for o in _ONLINE if o in v)  # canonical order


@dataclass(frozen=True)
class QuaRotConfig:
    """QuaRot: norms folded, Hadamard rotations fused into the weights (residual stream R1; per attention head R2
    when ``heads``), online Hadamard transforms before the Linears in ``online`` (``"mlp.down_proj"``: QuaRot's
    R4; ``"self_attn.o_proj"``: across heads). ``key``: random signs (randomised Hadamard, QuaRot's default and
    better than the plain one on SmolLM2, bench/results/ROTATIONS.md; None: plain Hadamard). ``block``: every
    rotation (R1, R2, the online transforms) block-diagonal with Hadamard blocks of this size
    (``qcore.algorithms.hadamard.block_rotation``; MR-GPTQ's block rotations: the scale-block size, 32 for MX, 16
    for NVFP4), ``"auto"``: the weights' group / block size (``quantize_model`` resolves it from its plan); None:
    full-size rotations. Runs on the whole float model before the other algorithms
    (``qcore.adapters.passes.rotation``)."""

    key: Optional[int] = 0
    heads: bool = True
    online: tuple = _ONLINE
    decoder_layers: Optional[str] = None
    block: Union[int, str, None] = None
    name: str = field(default="quarot", init=False)

    def __post_init__(self):
        if self.key is not None:
            _int(self.key, f"{type(self).__name__}.key", lo=0)
        _bool(self.heads, f"{type(self).__name__}.heads")
        object.__setattr__(self, "online", _online(self.online, f"{type(self).__name__}.online"))
        _layers_path(self.decoder_layers, f"{type(self).__name__}.decoder_layers")
        if self.block is not None and self.block != "auto":
            b = _int(self.block, f"{type(self).__name__}.block (or 'auto' or None)")
            if not is_constructible(b):
                raise ValueError(f"{type(self).__name__}.block={b}: no Hadamard matrix of that order here (1, 2, "
                                 f"or a multiple of 4 that Sylvester / Paley constructions reach, e.g. 16, 32, 64)")
            object.__setattr__(self, "block", b)

    def _common(self) -> dict:
        out = {"key": self.key, "heads": self.heads, "online": list(self.online),
               "decoder_layers": self.decoder_layers}
        if self.block is not None:  # absent for full-size rotations: the landed configs' bytes
            out["block"] = self.block
        return out

    def to_dict(self) -> dict:
        return {"name": self.name, **self._common()}

    def to_quark(self) -> dict:
        """With online transforms: qcore's own entry, named ``"qcore_rotation"`` (Quark's loader would apply *its*
        Hadamard matrices to the online layers, not the ones the weights were rotated with, and compute a wrong
        model silently; it refuses this name, and such checkpoints say ``quant_method: "qcore"``); qcore
        re-installs the online transforms from it on loading. Without: Quark's offline ``rotation`` entry
        (r1, r2; the rotations live in the weights, nothing happens at run time), read back as a QuaRot config
        with the same ``heads`` (``key`` becomes 0 or None: the weights already hold it)."""
        if not self.online:  # fused into the weights only: Quark's offline R1/R2 spelling loads as it is
            return {"name": "rotation", "r1": True, "r2": self.heads, "r3": False, "r4": False,
                    "rotation_size": self.block, "random_r1": self.key is not None, "random_r2": self.key is not None and self.heads,
                    "trainable": False, "model_decoder_layers": self.decoder_layers or "model.layers",
                    "scaling_layers": {}, **_QUARK_ROTATION_PATHS}
        return {**self.to_dict(), "name": "qcore_rotation", "method": self.name}


@dataclass(frozen=True)
class SpinQuantConfig(QuaRotConfig):
    """SpinQuant: QuaRot's rotations, with the residual rotation R1 (and the per-head R2 when ``heads``) learnt
    by Cayley SGD on the orthogonal manifold, minimising the fake-quantized model's next-token loss (straight-
    through gradients) over ``steps`` steps of ``batch`` calibration sequences at learning rate ``lr``;
    initialised from QuaRot's (randomised when ``key``) Hadamard rotations. ``train_weights``: whether the
    weights are fake-quantized while training (None: yes, unless GPTQ runs afterwards; as in the SpinQuant
    paper, rotations for GPTQ are learnt with quantized activations only, since GPTQ rounds the weights)."""

    steps: int = 100
    lr: float = 1.5
    batch: int = 1
    train_weights: Optional[bool] = None
    name: str = field(default="spinquant", init=False)

    def __post_init__(self):
        super().__post_init__()
        if self.block is not None:
            raise ValueError(f"SpinQuantConfig.block={self.block!r}: block rotations are QuaRot's (quarot); "
                             f"SpinQuant learns full-size rotations (block must be None)")
        _int(self.steps, "SpinQuantConfig.steps")
        real_in_range(self.lr, "SpinQuantConfig.lr", 0.0, 1e3, lo_open=True)
        _int(self.batch, "SpinQuantConfig.batch")
        if self.train_weights is not None:
            _bool(self.train_weights, "SpinQuantConfig.train_weights")

    def to_dict(self) -> dict:
        return {"name": "spinquant", **self._common(), "steps": self.steps, "lr": self.lr, "batch": self.batch,
                "train_weights": self.train_weights}


def _from_quark_rotation(d: Mapping) -> "QuaRotConfig":
    """Quark's ``{"name": "rotation", ...}`` (or its deprecated ``"quarot"`` spelling with r1/r2 keys)."""
    known = {"name", "r1", "r2", "r3", "r4", "rotation_size", "random_r1", "random_r2", "model_decoder_layers",
             "online_r1_rotation", "online_config", "trainable", "train_smooth", "smooth_positions",
             "scaling_layers", *_QUARK_ROTATION_PATHS}
    for k in d:
        if k not in known and k not in _IGNORED:
            raise ValueError(f"rotation config: unknown key {k!r}; known keys: {sorted(known)}")
    if d.get("r1", True) is not True:
        raise ValueError(f"rotation config: r1={d.get('r1')!r}; qcore's rotations always rotate the residual "
                         f"stream (r1=True)")
    for k, what in (("r3", "R3 (query/key rotation for KV-cache quantization) is not implemented"),
                    ("online_r1_rotation", "online R1 rotations are not implemented"),
                    ("train_smooth", "trained smoothing scales (OSTQuant) are not implemented")):
        if d.get(k):
            raise ValueError(f"rotation config: {k}={d[k]!r}: {what}")
    if d.get("online_config") is not None:
        raise ValueError(f"rotation config: online_config={d['online_config']!r} is not supported")
    block = d.get("rotation_size")
    if block is not None and d.get("r4", False):  # fused block rotations are weights only; online ones use tables
        raise ValueError(f"rotation config: rotation_size={block!r} with r4 (online block transforms with Quark's "
                         f"Hadamard tables) is not supported; only fused block rotations (r4 false) load")
    for k, v in _QUARK_ROTATION_PATHS.items():
        if k in d and d[k] != v:
            raise ValueError(f"rotation config: {k}={d[k]!r}; qcore's rotations use Llama's layout ({v!r})")
    layers = d.get("model_decoder_layers") or None
    if layers == "model.layers":  # the only layout rotations support; None means the same
        layers = None
    random = bool(d.get("random_r1")) or bool(d.get("random_r2"))
    kw = {"key": 0 if random else None, "heads": _bool(d.get("r2", False), "rotation config r2"),
          "online": ("mlp.down_proj",) if d.get("r4", False) else (), "decoder_layers": layers}
    if block is not None:
        kw["block"] = block
    return SpinQuantConfig(**kw) if d.get("trainable") else QuaRotConfig(**kw)


# ---------------------------------------------------------------------------------------------------------------
# issue 24's algorithms: one section each
# ---------------------------------------------------------------------------------------------------------------

# [autoround] (its config class goes below this line)
@dataclass(frozen=True)
class AutoRoundConfig:
    """AutoRound / SignRound (arXiv 2309.05516): per decoder layer, rounding offsets and min/max range factors
    learnt by signed gradient descent over ``iters`` steps (``lr``: the offsets' step, default ``1 / iters``,
    decayed linearly to 0; ``minmax_lr``: the range factors', default ``lr``; ``enable_minmax_tuning``: learn the
    range factors), each step on ``batch_size`` calibration batches drawn in an order seeded by ``key``;
    ``modules``: names (relative to the layer), default all quantized Linears. Quark keys: ``iters``, ``lr``,
    ``minmax_lr``, ``enable_minmax_tuning``, ``batch_size``, ``inside_layer_modules``, ``model_decoder_layers``
    (Quark's dataclass defaults ``lr = minmax_lr = 1/200``, ours at the default 200 iterations)."""

    iters: int = 200
    lr: Optional[float] = None
    minmax_lr: Optional[float] = None
    enable_minmax_tuning: bool = True
    batch_size: int = 8
    key: int = 0
    modules: tuple = ()
    decoder_layers: Optional[str] = None
    name: str = field(default="autoround", init=False)

    def __post_init__(self):
        _int(self.iters, "AutoRoundConfig.iters", lo=0)
        for k in ("lr", "minmax_lr"):
            if getattr(self, k) is not None:
                real_in_range(getattr(self, k), f"AutoRoundConfig.{k}", 0.0, 1.0, lo_open=True)
        _bool(self.enable_minmax_tuning, "AutoRoundConfig.enable_minmax_tuning")
        _int(self.batch_size, "AutoRoundConfig.batch_size")
        _int(self.key, "AutoRoundConfig.key", lo=0)
        object.__setattr__(self, "modules", _names(self.modules, "AutoRoundConfig.modules"))
        object.__setattr__(self, "decoder_layers", _layers_path(self.decoder_layers, "AutoRoundConfig.decoder_layers"))

    @property
    def step_lr(self) -> float:
        """The offsets' initial step size (``lr``, else ``1 / iters``)."""
        return self.lr if self.lr is not None else 1.0 / max(self.iters, 1)

    def to_dict(self) -> dict:
        return {"name": "autoround", "iters": self.iters, "lr": self.lr, "minmax_lr": self.minmax_lr,
                "enable_minmax_tuning": self.enable_minmax_tuning, "batch_size": self.batch_size, "key": self.key,
                "modules": list(self.modules), "decoder_layers": self.decoder_layers}

    def to_quark(self) -> dict:
        return {"name": "autoround", "iters": self.iters, "lr": self.step_lr,
                "enable_minmax_tuning": self.enable_minmax_tuning,
                "minmax_lr": self.minmax_lr if self.minmax_lr is not None else self.step_lr,
                "batch_size": self.batch_size, "inside_layer_modules": list(self.modules),
                "model_decoder_layers": self.decoder_layers or ""}



# [gptaq] (its config class goes below this line)


@dataclass(frozen=True)
class GPTAQConfig:
    """GPTAQ settings (``qcore.algorithms.gptaq``: GPTQ against the float model's inputs, ``||W X - Q X~||``).
    ``alpha``: the weight of the input-mismatch correction (0.25, the paper's, Quark's and GPTQModel's
    default; 0 gives GPTQ on the quantized stream); every other key is ``GPTQConfig``'s, with its defaults.
    Quark keys (``GPTAQConfig``): ``block_size``, ``damp_percent``, ``alpha``, ``desc_act``, ``static_groups``,
    ``inside_layer_modules``, ``model_decoder_layers`` (a Quark dict without ``static_groups`` gets qcore's
    default, False; ``to_quark()`` always writes it)."""

    block_size: int = 128
    damp: float = 0.01
    alpha: float = 0.25
    act_order: bool = True
    static_groups: bool = False
    true_sequential: bool = False
    modules: tuple = ()
    decoder_layers: Optional[str] = None
    name: str = field(default="gptaq", init=False)

    def __post_init__(self):
        _int(self.block_size, "GPTAQConfig.block_size")
        real_in_range(self.damp, "GPTAQConfig.damp", 0.0, 1e6)
        real_in_range(self.alpha, "GPTAQConfig.alpha", 0.0, 1e6)
        _bool(self.act_order, "GPTAQConfig.act_order")
        _bool(self.static_groups, "GPTAQConfig.static_groups")
        _bool(self.true_sequential, "GPTAQConfig.true_sequential")
        object.__setattr__(self, "modules", _names(self.modules, "GPTAQConfig.modules"))
        _layers_path(self.decoder_layers, "GPTAQConfig.decoder_layers")

    def to_dict(self) -> dict:
        return {"name": "gptaq", "block_size": self.block_size, "damp": self.damp, "alpha": self.alpha,
                "act_order": self.act_order, "static_groups": self.static_groups,
                "true_sequential": self.true_sequential, "modules": list(self.modules),
                "decoder_layers": self.decoder_layers}

    def to_quark(self) -> dict:
        return {"name": "gptaq", "block_size": self.block_size, "damp_percent": self.damp, "alpha": self.alpha,
                "desc_act": self.act_order, "static_groups": self.static_groups,
                "inside_layer_modules": list(self.modules), "model_decoder_layers": self.decoder_layers or ""}


# [qronos] (its config class goes below this line)
@dataclass(frozen=True)
class QronosConfig:
    """Qronos settings (``qcore.algorithms.qronos``): GPTQ's ``block_size``, ``act_order``, ``static_groups``,
    ``true_sequential``, ``modules``, ``decoder_layers``; ``damp``: the damping relative to ``damp_scale``
    (``"max_eigenvalue"`` of ``H~``, Quark's ``alpha``, default 1e-3 as Quark's code; or ``"mean_diagonal"``,
    GPTQ's rule); ``beta``: Quark's Cholesky conditioning factor (it scales ``H~^-1`` before a float32
    factorisation and back; qcore factors in float64, where it changes nothing: kept for the round trip).
    ``true_sequential`` defaults to True here: each stage's inputs ``X~`` include this layer's modules already
    quantized (the error Qronos corrects). Quark keys: ``alpha``, ``beta``, ``desc_act``, ``static_groups``,
    ``block_size``, ``inside_layer_modules``, ``model_decoder_layers`` (a Quark dict without ``static_groups``
    gets Quark's default, True)."""

    block_size: int = 128
    damp: float = 1e-3
    damp_scale: str = "max_eigenvalue"
    beta: float = 1e4
    act_order: bool = True
    static_groups: bool = False
    true_sequential: bool = True
    modules: tuple = ()
    decoder_layers: Optional[str] = None
    name: str = field(default="qronos", init=False)

    def __post_init__(self):
        _int(self.block_size, "QronosConfig.block_size")
        real_in_range(self.damp, "QronosConfig.damp", 0.0, 1e6)
        if self.damp_scale not in ("max_eigenvalue", "mean_diagonal"):
            raise ValueError(f"QronosConfig.damp_scale must be 'max_eigenvalue' or 'mean_diagonal', got "
                             f"{self.damp_scale!r}")
        real_in_range(self.beta, "QronosConfig.beta", 0.0, 1e30, lo_open=True)
        _bool(self.act_order, "QronosConfig.act_order")
        _bool(self.static_groups, "QronosConfig.static_groups")
        _bool(self.true_sequential, "QronosConfig.true_sequential")
        object.__setattr__(self, "modules", _names(self.modules, "QronosConfig.modules"))
        _layers_path(self.decoder_layers, "QronosConfig.decoder_layers")

    def to_dict(self) -> dict:
        return {"name": "qronos", "block_size": self.block_size, "damp": self.damp, "damp_scale": self.damp_scale,
                "beta": self.beta, "act_order": self.act_order, "static_groups": self.static_groups,
                "true_sequential": self.true_sequential, "modules": list(self.modules),
                "decoder_layers": self.decoder_layers}

    def to_quark(self) -> dict:
        if self.damp_scale != "max_eigenvalue":
            raise ValueError(f"QronosConfig.to_quark: Quark's alpha damps relative to the largest eigenvalue; "
                             f"damp_scale={self.damp_scale!r} has no Quark spelling")
        return {"name": "qronos", "block_size": self.block_size, "desc_act": self.act_order,
                "static_groups": self.static_groups, "alpha": self.damp, "beta": self.beta,
                "inside_layer_modules": list(self.modules), "model_decoder_layers": self.decoder_layers or ""}



# [hqq] (its config class goes below this line)


@dataclass(frozen=True)
class HQQConfig:
    """HQQ (half-quadratic quantization, ``qcore.algorithms.hqq``): each quantized Linear weight's scales and
    integer zero points fitted to the weight alone by half-quadratic splitting on the ``Lp`` error (``p``), the
    coupling ``beta`` growing by ``kappa`` over ``iters`` iterations, each group keeping its iterate of least
    ``mean |error|^error_p`` (2: squared error), its scale never below ``scale_floor`` times the min/max one.
    Needs no calibration data (``data_free``).

    Quark has no HQQ, and loading an HQQ checkpoint needs nothing beyond its codes, scales and zero points (a
    plain integer checkpoint): ``to_quark()`` is None, no ``algo_config`` entry (amd-quark refuses algorithm
    names it does not know, which would make the checkpoint unloadable there); the qcore block of an export
    keeps ``to_dict()``."""

    p: float = 0.7
    beta: float = 10.0
    kappa: float = 1.01
    iters: int = 20
    error_p: float = 2.0
    scale_floor: float = 1.0
    decoder_layers: Optional[str] = None  # only where the layer runner runs it (streaming); quantize_model: all
    name: str = field(default="hqq", init=False)
    data_free: ClassVar[bool] = True  # quantize_model and the CLI need no calibration batches for it

    def __post_init__(self):
        object.__setattr__(self, "p", real_in_range(self.p, "HQQConfig.p", 0.0, 1.0, lo_open=True))
        object.__setattr__(self, "beta", real_in_range(self.beta, "HQQConfig.beta", 0.0, 1e12, lo_open=True))
        object.__setattr__(self, "kappa", real_in_range(self.kappa, "HQQConfig.kappa", 1.0, 100.0))
        object.__setattr__(self, "iters", _int(self.iters, "HQQConfig.iters", lo=0))
        object.__setattr__(self, "error_p", real_in_range(self.error_p, "HQQConfig.error_p", 0.0, 8.0, lo_open=True))
        object.__setattr__(self, "scale_floor", real_in_range(self.scale_floor, "HQQConfig.scale_floor", 0.0, 1.0))
        _layers_path(self.decoder_layers, "HQQConfig.decoder_layers")

    def to_dict(self) -> dict:
        return {"name": "hqq", "p": self.p, "beta": self.beta, "kappa": self.kappa, "iters": self.iters,
                "error_p": self.error_p, "scale_floor": self.scale_floor, "decoder_layers": self.decoder_layers}

    def to_quark(self) -> None:
        return None


# [svdquant] (its config class goes below this line)

@dataclass(frozen=True)
class SVDQuantConfig:
    """SVDQuant (qcore.algorithms.svdquant): per Linear, smoothing scales (``alpha``, searched per input group
    among ``alpha_candidates`` (empty: 0.05, ..., 0.95) when ``search_alpha``, on the tokens of the first
    ``search_samples`` calibration batches), a rank-``rank`` high-precision branch, the residual quantized by
    round-to-nearest or, ``use_gptq``, by GPTQ (``block_size``, ``damp``, ``act_order``) with the smoothed inputs'
    Hessian. Quark keys: ``svd_rank``, ``smooth_alpha``, ``search_alpha``, ``alpha_candidates``,
    ``alpha_search_max_samples``, ``use_gptq``, ``gptq_blocksize``, ``gptq_percdamp``, ``gptq_actorder``;
    Quark's ``exclude_patterns``, ``min_layer_size``, ``gptq_n_bits``, ``gptq_symmetric`` and ``gptq_group_size``
    are accepted and not used: the model config's exclude list and weight specs decide which Linears and which
    residual format (Quark's defaults skip Linears with a side under 256 and quantize the GPTQ residual to its
    own int4)."""

    rank: int = 32
    alpha: float = 0.5
    search_alpha: bool = True
    alpha_candidates: tuple = ()
    search_samples: int = 8
    use_gptq: bool = False
    block_size: int = 128
    damp: float = 0.01
    act_order: bool = False
    decoder_layers: Optional[str] = None
    name: str = field(default="svdquant", init=False)

    def __post_init__(self):
        _int(self.rank, "SVDQuantConfig.rank")
        real_in_range(self.alpha, "SVDQuantConfig.alpha", 0.0, 1.0)
        _bool(self.search_alpha, "SVDQuantConfig.search_alpha")
        c = self.alpha_candidates
        if c is None:
            c = ()
        if isinstance(c, (str, bytes)) or not isinstance(c, (list, tuple)):
            raise TypeError(f"SVDQuantConfig.alpha_candidates must be a list of numbers in [0, 1], got {c!r}")
        for a in c:
            real_in_range(a, "SVDQuantConfig.alpha_candidates[]", 0.0, 1.0)
        object.__setattr__(self, "alpha_candidates", tuple(float(a) for a in c))
        _int(self.search_samples, "SVDQuantConfig.search_samples")
        _bool(self.use_gptq, "SVDQuantConfig.use_gptq")
        _int(self.block_size, "SVDQuantConfig.block_size")
        real_in_range(self.damp, "SVDQuantConfig.damp", 0.0, 1e6)
        _bool(self.act_order, "SVDQuantConfig.act_order")
        _layers_path(self.decoder_layers, "SVDQuantConfig.decoder_layers")

    def to_dict(self) -> dict:
        return {"name": "svdquant", "rank": self.rank, "alpha": self.alpha, "search_alpha": self.search_alpha,
                "alpha_candidates": list(self.alpha_candidates), "search_samples": self.search_samples,
                "use_gptq": self.use_gptq, "block_size": self.block_size, "damp": self.damp,
                "act_order": self.act_order, "decoder_layers": self.decoder_layers}

    def to_quark(self) -> dict:
        return {"name": "svdquant", "svd_rank": self.rank, "smooth_alpha": self.alpha,
                "search_alpha": self.search_alpha,
                "alpha_candidates": list(self.alpha_candidates) if self.alpha_candidates else None,
                "alpha_search_max_samples": self.search_samples, "use_gptq": self.use_gptq,
                "gptq_blocksize": self.block_size, "gptq_percdamp": self.damp, "gptq_actorder": self.act_order}


# Quark SVDQuantConfig keys qcore takes from elsewhere: read only where they change nothing (the exclude list, the
# residual's format and the layer size limit come from the model config)
_SVDQUANT_QUARK_NOOPS = frozenset({"exclude_patterns", "min_layer_size", "gptq_n_bits", "gptq_symmetric",
                                   "gptq_group_size"})


# [distill] (its config class goes below this line)
@dataclass(frozen=True)
class DistillConfig:
    """Quantization-aware distillation (``qcore.algorithms.distill``, ``qcore.adapters.passes.distill``): after
    the other algorithms (it comes last), the fake-quantized model is trained against the float model's logits.

    ``steps`` optimizer steps of ``batch`` calibration batches each (gradients accumulated), drawn in epochs in the
    order ``key`` gives; ``lr``: the weights' learning rate (``optimizer`` ``"adamw"`` or ``"sgd"``, ``schedule``
    ``"cosine"`` decays it to 0 over the steps, ``"constant"`` keeps it), ``weight_decay``; ``loss`` ``"kl"`` or
    ``"jsd"`` at ``temperature``, blended with the next-token cross entropy by ``alpha`` (1 = pure distillation);
    ``train_scales``: also train the weights' float32 scales (integer weight formats; learned-step-size gradient)
    at ``scale_lr`` (default ``lr``); ``max_seconds``: stop earlier when the training has run that long (wall
    clock); ``eval_batches``: batches (of the calibration data) whose loss is reported before and after.
    Quark has no ``algo_config`` entry for it (its ``QADTrainer`` is a trainer): ``to_quark()`` gives that
    trainer's keyword spelling (``kd_loss_type``, ``temperature``, ``kd_alpha``, ``learning_rate``,
    ``max_steps``, ``per_device_train_batch_size``, ``weight_decay``), which ``parse_algorithm`` reads too."""

    steps: int = 100
    lr: float = 1e-5
    batch: int = 1
    loss: str = "kl"
    temperature: float = 1.0
    alpha: float = 1.0
    train_scales: bool = False
    scale_lr: Optional[float] = None
    optimizer: str = "adamw"
    schedule: str = "cosine"
    weight_decay: float = 0.0
    max_seconds: Optional[float] = None
    eval_batches: int = 0
    key: int = 0
    name: str = field(default="distill", init=False)

    def __post_init__(self):
        _int(self.steps, "DistillConfig.steps")
        real_in_range(self.lr, "DistillConfig.lr", 0.0, 1.0, lo_open=True)
        _int(self.batch, "DistillConfig.batch")
        if self.loss not in ("kl", "jsd"):
            raise ValueError(f"DistillConfig.loss must be 'kl' or 'jsd', got {self.loss!r}")
        real_in_range(self.temperature, "DistillConfig.temperature", 0.0, 1e3, lo_open=True)
        real_in_range(self.alpha, "DistillConfig.alpha", 0.0, 1.0)
        _bool(self.train_scales, "DistillConfig.train_scales")
        if self.scale_lr is not None:
            real_in_range(self.scale_lr, "DistillConfig.scale_lr", 0.0, 1.0, lo_open=True)
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"DistillConfig.optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"DistillConfig.schedule must be 'cosine' or 'constant', got {self.schedule!r}")
        real_in_range(self.weight_decay, "DistillConfig.weight_decay", 0.0, 1.0)
        if self.max_seconds is not None:
            real_in_range(self.max_seconds, "DistillConfig.max_seconds", 0.0, 1e9, lo_open=True)
        _int(self.eval_batches, "DistillConfig.eval_batches", 0)
        if isinstance(self.key, bool) or not isinstance(self.key, numbers.Integral):
            raise TypeError(f"DistillConfig.key must be an int, got {self.key!r}")
        for f in ("lr", "temperature", "alpha", "weight_decay"):
            object.__setattr__(self, f, float(getattr(self, f)))

    def to_dict(self) -> dict:
        return {"name": "distill", **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}}

    def to_quark(self) -> dict:
        """Quark's ``QADTrainer`` / transformers ``TrainingArguments`` spelling of the keys that map (the rest in
        qcore's spelling)."""
        d = self.to_dict()
        for ours, theirs in _DISTILL_QUARK.items():
            d[theirs] = d.pop(ours)
        return d


_DISTILL_QUARK = {"loss": "kd_loss_type", "alpha": "kd_alpha", "lr": "learning_rate", "steps": "max_steps",
                  "batch": "per_device_train_batch_size"}


def split_distill(algorithms: Sequence) -> tuple:
    """``(the distillation config or None, the other algorithms)`` (``parse_algorithms`` puts it last)."""
    d = [a for a in algorithms if isinstance(a, DistillConfig)]
    return (d[0] if d else None), tuple(a for a in algorithms if not isinstance(a, DistillConfig))


@dataclass(frozen=True, eq=True)
class ForeignAlgorithm:
    """An entry of a Quark ``algo_config`` that qcore cannot read (an algorithm it does not implement, or settings
    it does not know), kept as given: a checkpoint's config is written back as it was read. Anything that would
    run it refuses it, saying ``why`` (``check_runnable``)."""

    entry: Mapping
    why: str = field(default="", compare=False)

    @property
    def name(self) -> str:
        return str(self.entry.get("name"))

    def __hash__(self) -> int:
        return hash(json.dumps(self.entry, sort_keys=True, default=repr))

    def to_dict(self) -> dict:
        return copy.deepcopy(dict(self.entry))

    def to_quark(self) -> dict:
        return copy.deepcopy(dict(self.entry))


def parse_quark_algorithm(d: Mapping) -> Union["AlgorithmConfig", ForeignAlgorithm]:
    """An entry of a Quark ``algo_config``: its config where qcore reads it, else a ``ForeignAlgorithm``."""
    try:
        return parse_algorithm(d)
    except (ValueError, TypeError) as e:
        return ForeignAlgorithm(copy.deepcopy(dict(d)), str(e))


def check_runnable(algorithms: Sequence) -> None:
    """ValueError for an entry qcore cannot run (a ``ForeignAlgorithm``), with why it cannot read it."""
    for a in algorithms:
        if isinstance(a, ForeignAlgorithm):
            raise ValueError(a.why)


# ---------------------------------------------------------------------------------------------------------------

AlgorithmConfig = Union[GPTQConfig, AWQConfig, SmoothQuantConfig, AutoSmoothQuantConfig, QuaRotConfig,
                        SpinQuantConfig, AutoRoundConfig, GPTAQConfig, QronosConfig, HQQConfig, SVDQuantConfig,
                        DistillConfig]
ROTATION_CONFIGS = (QuaRotConfig, SpinQuantConfig)


def split_rotation(algorithms: Sequence) -> tuple:
    """``(rotation or None, the other algorithms)`` of a parsed algorithm tuple (``parse_algorithms`` puts a
    rotation first and allows one)."""
    rot = [a for a in algorithms if isinstance(a, ROTATION_CONFIGS)]
    return (rot[0] if rot else None), tuple(a for a in algorithms if not isinstance(a, ROTATION_CONFIGS))

# name -> (class, {key in the dict: constructor argument}) ; qcore's own keys map to themselves
_SCHEMAS: dict[str, tuple[type, dict[str, str]]] = {
    "gptq": (GPTQConfig, {"damp_percent": "damp", "desc_act": "act_order", "inside_layer_modules": "modules",
                          "model_decoder_layers": "decoder_layers"}),
    "awq": (AWQConfig, {"model_decoder_layers": "decoder_layers"}),
    "smoothquant": (SmoothQuantConfig, {"scale_clamp_min": "clamp_min", "model_decoder_layers": "decoder_layers"}),
    "autosmoothquant": (AutoSmoothQuantConfig, {"compute_scale_loss": "loss", "model_decoder_layers": "decoder_layers"}),
    "quarot": (QuaRotConfig, {}),
    "spinquant": (SpinQuantConfig, {}),
    # [autoround]
    "autoround": (AutoRoundConfig, {"inside_layer_modules": "modules", "model_decoder_layers": "decoder_layers"}),

    # [gptaq]
    "gptaq": (GPTAQConfig, {"damp_percent": "damp", "desc_act": "act_order", "inside_layer_modules": "modules",
                            "model_decoder_layers": "decoder_layers"}),

    # [qronos]
    "qronos": (QronosConfig, {"alpha": "damp", "desc_act": "act_order", "inside_layer_modules": "modules",
                              "model_decoder_layers": "decoder_layers"}),

    # [hqq]
    "hqq": (HQQConfig, {"lp_norm": "p", "model_decoder_layers": "decoder_layers"}),  # lp_norm: mobiusml/hqq's p

    # [svdquant]
    "svdquant": (SVDQuantConfig, {"svd_rank": "rank", "smooth_alpha": "alpha", "alpha_search_max_samples":
                                  "search_samples", "gptq_blocksize": "block_size", "gptq_percdamp": "damp",
                                  "gptq_actorder": "act_order", "model_decoder_layers": "decoder_layers"}),

    # [distill]
    "distill": (DistillConfig, {v: k for k, v in _DISTILL_QUARK.items()}),

}
_ALIASES = {"smooth": "smoothquant", "smooth_quant": "smoothquant", "auto_smoothquant": "autosmoothquant"}
ALGORITHM_NAMES = tuple(_SCHEMAS)
#: the config classes (one per algorithm; SpinQuantConfig is a QuaRotConfig)
ALGORITHM_CONFIGS = tuple(dict.fromkeys(cls for cls, _ in _SCHEMAS.values()))


def parse_algorithm(d: Union[Mapping, AlgorithmConfig, str]) -> AlgorithmConfig:
    """One algorithm config from a dict with a ``"name"`` (qcore's or Quark's keys), a name alone, or a config."""
    if isinstance(d, ALGORITHM_CONFIGS + (ForeignAlgorithm,)):
        return d
    if isinstance(d, str):
        d = {"name": d}
    if not isinstance(d, Mapping):
        raise TypeError(f"an algorithm config must be a dict with a 'name' or a name, got {type(d).__name__}")
    name = d.get("name")
    if not isinstance(name, str):
        raise ValueError(f"algorithm config {dict(d)!r} has no 'name'")
    key = _ALIASES.get(name.lower(), name.lower())
    if key == "rotation" or (key == "quarot" and any(k in d for k in ("r1", "r2", "r3", "r4"))):
        return _from_quark_rotation(d)
    if key == "qcore_rotation":
        method = d.get("method")
        if method not in ("quarot", "spinquant"):
            raise ValueError(f"qcore_rotation config: method must be 'quarot' or 'spinquant', got {method!r}")
        d = {**{k: v for k, v in d.items() if k != "method"}, "name": method}
        key = method
    if key not in _SCHEMAS:
        raise ValueError(f"algorithm {name!r} is not available; known: {list(ALGORITHM_NAMES)} (Quark's 'smooth' "
                         f"is smoothquant, Quark's 'rotation' is quarot or, trainable, spinquant)")
    cls, renames = _SCHEMAS[key]
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for k, v in d.items():
        if k == "name" or k in _IGNORED or (key == "svdquant" and k in _SVDQUANT_QUARK_NOOPS):
            continue
        arg = renames.get(k, k)
        if arg not in fields:
            raise ValueError(f"{key} config: unknown key {k!r}; known keys: {sorted(fields | set(renames))}")
        if arg in kwargs:
            raise ValueError(f"{key} config: {k!r} and another key both set {arg!r}")
        kwargs[arg] = v
    if key == "gptq" and "static_groups" not in kwargs and any(k in d for k in renames):
        kwargs["static_groups"] = True  # a Quark recipe gets Quark's default (its export needs static groups)
    if key == "qronos" and "static_groups" not in kwargs and any(k in d for k in renames):
        kwargs["static_groups"] = True  # Quark's QronosConfig default, as for gptq
    return cls(**kwargs)


def parse_algorithms(items) -> tuple:
    """A tuple of algorithm configs from a list (or a comma-separated string of names, as ``--algo``). A rotation
    (quarot, spinquant) acts on the whole float model: at most one, and it comes first."""
    if isinstance(items, str):
        items = [s.strip() for s in items.split(",") if s.strip()]
    out = tuple(parse_algorithm(a) for a in items)
    rot = [i for i, a in enumerate(out) if isinstance(a, QuaRotConfig)]
    if len(rot) > 1 or (rot and rot[0] != 0):
        raise ValueError(f"algorithms {[a.name for a in out]}: a rotation (quarot / spinquant) must come first, "
                         f"and only one")
    dist = [i for i, a in enumerate(out) if isinstance(a, DistillConfig)]
    if len(dist) > 1 or (dist and dist[0] != len(out) - 1):
        raise ValueError(f"algorithms {[a.name for a in out]}: distill trains the quantized model the other "
                         f"algorithms produced, so it must come last, and only once")
    return out

"""Quantized drop-in wrappers for ``nn.Linear``, ``nn.Conv2d``, ``nn.ConvTranspose2d``, ``nn.Embedding``,
``nn.EmbeddingBag`` and transformers' ``Conv1D`` (GPT-2's projections, quantized as the Linear of ``W^T``).

Each wrapper subclasses the module it replaces (``isinstance(q, nn.Linear)`` holds, ``state_dict`` keeps the
original keys) and adds the quantization of its roles (``LayerConfig``: weight, input, output, bias):

- **weights** (and bias) are quantized once. By default (``qat=False``) the float weight is overwritten in place
  by its fake-quantized values (``qcore.dequantize(qcore.quantize(w))`` cast to the model dtype), so a
  fake-quantized model holds one copy of its weights; the scales are kept as buffers (``weight_scale``,
  ``weight_zero_point``, ``weight_tensor_scale``). If the weight changes afterwards (``load_state_dict``, an
  optimizer step, any in-place write), it is quantized again at the next forward (tracked by the tensor's
  version counter), never on every forward; a weight loaded together with its ``weight_scale`` (a saved
  fake-quantized model) is kept as saved when it lies exactly on those scales' grid. With ``qat=True`` the
  float weight stays the trainable master copy; the forward uses its fake-quantized value with straight-through
  gradients (recomputed while the weight requires grad and grad is enabled, otherwise cached until the weight
  changes).
- **activations** (input, output) are fake-quantized in the forward: dynamic scales per call, or static scales
  (buffers ``input_scale`` / ``input_zero_point``, ``output_scale`` / ``output_zero_point``) calibrated by
  ``qcore.adapters.calibrate``. Granularities are given on the ``[tokens, features]`` view (see
  ``qcore.adapters.config``).
- ``freeze()``: the weight becomes packed low-bit codes (``weight_packed``, ``qcore.packing``) plus scale codes;
  the forward dequantizes them and gives the fake-quantized weight bit for bit.

Quantization math is qcore's, in float32 (exact for float32, bfloat16 and float16 inputs); results are cast back
to the module's dtype once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, Iterable, Mapping, NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import qcore
from qcore import PerBlock, PerChannel, PerGroup, PerTensor, QuantSpec
from qcore.dtypes import FloatDType
from qcore._backend import ops
from qcore.quantize import tensor_scale_from_amax
from qcore.stats import RunningStats

from .config import LayerConfig, MinMax, Percentile, TensorConfig

__all__ = ["QuantLinear", "QuantConv2d", "QuantConvTranspose2d", "QuantEmbedding", "QuantEmbeddingBag",
           "QUANT_CLASSES", "wrap", "is_quantized_module", "CalibrationError", "QuantExperts",
           "LowRankBranch", "add_low_rank_branch", "low_rank_modules"]


class CalibrationError(ValueError):
    """A calibration statistic is NaN or Inf, or a calibration batch does not fit the model."""


# ---------------------------------------------------------------------------------------------------------------
# axis maps: canonical config axes -> the module's tensors
# ---------------------------------------------------------------------------------------------------------------


def _norm_weight_granularity(g, kind: str, name: str, ndim: int, shape: tuple):
    """Check a weight/bias granularity given on the canonical layout; return it with non-negative axes."""
    where = f"{kind} {name!r} (weight shape {list(shape)})"
    if isinstance(g, PerTensor):
        return g
    if isinstance(g, PerChannel):
        if g.axis % ndim != 0:
            raise ValueError(f"weight granularity {g!r} on {where}: per-channel weight scales are per output "
                             f"channel, PerChannel(0) in the canonical [out, in, *kernel] layout")
        return PerChannel(0)
    if isinstance(g, PerGroup):
        if ndim < 2 or g.axis % ndim != 1 and not (ndim == 2 and g.axis == -1):
            raise ValueError(f"per-group weight spec {g!r} on {where}: groups run along the input axis, "
                             f"PerGroup(size, axis=1) in the canonical [out, in, *kernel] layout; axis {g.axis} "
                             f"is not the input axis")
        return PerGroup(g.size, 1)
    if isinstance(g, PerBlock):
        if ndim != 2:
            raise ValueError(f"PerBlock weight scales apply to 2-D weights; {where} is {ndim}-D")
        return g
    raise TypeError(f"unsupported granularity {g!r}")


def _act_granularity(g, conv: bool):
    """The granularity on the tensor the module sees: the 2-D [tokens, features] view (Linear, Embedding) or the
    [N, C, *spatial] tensor (conv), where features are axis 1 either way."""
    if isinstance(g, PerChannel):
        return PerChannel(g.axis % 2)
    if isinstance(g, PerGroup):
        return PerGroup(g.size, 1)
    return g


def _with_granularity(spec: QuantSpec, g) -> QuantSpec:
    if spec.granularity == g:
        return spec
    import dataclasses
    return dataclasses.replace(spec, granularity=g)


# ---------------------------------------------------------------------------------------------------------------
# static activation observers (statistics only, never activations)
# ---------------------------------------------------------------------------------------------------------------


class _Observer:
    """Running statistics of one static activation role, as values updated per batch."""

    def __init__(self, tc: TensorConfig, spec: QuantSpec, where: str):
        self.tc, self.spec, self.where = tc, spec, where
        # two-level activations calibrate their per-tensor scale only (block scales are per call)
        self.stats = RunningStats.empty(PerTensor() if spec.two_level else spec.granularity)
        self.sum: Optional[torch.Tensor] = None
        self.sum_zp: Optional[torch.Tensor] = None
        self.n = 0

    def _check(self, v, what: str):
        if not bool(torch.isfinite(v).all()):
            bad = "NaN" if bool(torch.isnan(v).any()) else "Inf"
            raise CalibrationError(f"calibration: {bad} met in the {what} of {self.where} (batch {self.n + 1}); "
                                   f"statistics need finite activations")

    def update(self, x: torch.Tensor) -> None:
        obs = self.tc.observer
        x = x.detach()
        if isinstance(obs, MinMax):
            self.stats = self.stats.update(x)
            self._check(self.stats.absmax, "statistics")
        elif isinstance(obs, Percentile):
            p = qcore.stats.percentile(x, self.spec.granularity, q=obs.q).double()
            self._check(p, "percentile")
            self.sum = p if self.sum is None else self.sum + p
        else:
            pr = qcore.stats.mse_clip(x, self.spec, grid=obs.grid, lo=obs.lo, p=obs.p)
            self._check(pr.scale, "MSE-chosen scale")
            s = pr.scale.double()
            s = torch.log2(s) if self.spec.pow2_scale else s
            self.sum = s if self.sum is None else self.sum + s
            if pr.zero_point is not None:
                z = pr.zero_point.double()
                self.sum_zp = z if self.sum_zp is None else self.sum_zp + z
        self.n += 1

    def params(self):
        """(scale, zero_point or None) as float32 tensors of the spec's scale shape."""
        if self.n == 0:
            raise CalibrationError(f"calibration: {self.where} saw no calibration batch (is it reached by the "
                                   f"model's forward?)")
        obs = self.tc.observer
        if self.spec.two_level:
            a = self.stats.absmax.reshape(())
            return tensor_scale_from_amax(a, self.spec, ops(a), a), None
        if isinstance(obs, MinMax):
            p = qcore.stats.scale_from_stats(self.stats, self.spec)
            return p.scale, p.zero_point
        mean = (self.sum / self.n)
        if isinstance(obs, Percentile):
            a = mean.float()
            rs = RunningStats(self.spec.granularity, absmax=a, lo=-a, hi=a, count=self.n)
            p = qcore.stats.scale_from_stats(rs, self.spec)
            return p.scale, p.zero_point
        if self.spec.pow2_scale:
            scale = torch.exp2(torch.round(mean)).float()
        else:
            scale = mean.float()
        zp = None if self.sum_zp is None else torch.round(self.sum_zp / self.n).float()
        return scale, zp


# ---------------------------------------------------------------------------------------------------------------
# the shared machinery
# ---------------------------------------------------------------------------------------------------------------

_PENDING, _INPLACE, _QAT, _FROZEN = "pending", "inplace", "qat", "frozen"


@contextlib.contextmanager
def calibrating(mods: Iterable[Any]):
    """Observe static activation statistics on ``mods`` inside the block, then set their scales; on any error
    the observers are dropped and the scales left as they were (``abort_calibration``)."""
    mods = list(mods)
    for m in mods:
        m.start_calibration()
    try:
        yield
        for m in mods:
            m.finish_calibration()
    except BaseException:
        for m in mods:
            m.abort_calibration()
        raise


def _quantize_observed(x: torch.Tensor, spec: QuantSpec, obs: Any):
    """QTensor of ``x`` with the scales its observer gives: MinMax (the spec's own rule), Percentile (the
    percentile's absmax) or MSE (the clipping search); what every wrapper quantizes a weight (or an expert's
    slice) with."""
    if isinstance(obs, MinMax):
        return qcore.quantize(x, spec)
    if isinstance(obs, Percentile):
        a = qcore.stats.percentile(x, spec.granularity, q=obs.q)
        p = qcore.stats.scale_from_stats(RunningStats(spec.granularity, absmax=a, lo=-a, hi=a, count=1), spec)
    else:
        p = qcore.stats.mse_clip(x, spec, grid=obs.grid, lo=obs.lo, p=obs.p)
    return qcore.quantize(x, spec, **p.kwargs())


class _QuantMixin:
    """State and helpers shared by the wrappers. Module state lives here only (adapters hold module state)."""

    _conv = False
    _index_input = False  # embeddings: the input is indices

    # -- construction ---------------------------------------------------------------------------------------

    @classmethod
    def from_module(cls, module: nn.Module, config: LayerConfig, *, name: str = "", qat: bool = False):
        """A wrapper sharing ``module``'s parameters, buffers, submodules and hooks (``module`` itself is not
        changed). Validates ``config`` against the module before doing anything."""
        if type(module) is not cls.__bases__[1]:
            raise TypeError(f"{cls.__name__}.from_module takes a {cls.__bases__[1].__name__}, got "
                            f"{type(module).__name__}")
        if not isinstance(config, LayerConfig):
            raise TypeError(f"config must be a LayerConfig, got {type(config).__name__}")
        plan = cls._plan(module, config, name)
        hook = module.__dict__.get("_hf_hook")
        if "forward" in module.__dict__ and hook is None:
            raise TypeError(f"{cls.__bases__[1].__name__} {name!r}: the module's forward is replaced on the instance (a "
                            f"monkey-patch); qcore cannot quantize through it")
        q = cls.__new__(cls)
        d = dict(module.__dict__)
        for k in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            d[k] = type(module.__dict__[k])(module.__dict__[k])
        for k in ("forward", "_old_forward", "_hf_hook"):  # accelerate's hook: bound to ``module``, put back below
            d.pop(k, None)
        q.__dict__.update(d)
        q._qinit(config, name, plan, qat)
        if hook is not None:
            # a model placed with accelerate (device_map): the same hook on the wrapper, so that its forward (not
            # the float module's) runs, with inputs moved to the module's execution device
            import copy
            from accelerate.hooks import add_hook_to_module
            add_hook_to_module(q, copy.copy(hook))
        return q

    @classmethod
    def _plan(cls, module, config: LayerConfig, name: str) -> dict:
        kind = cls.__bases__[1].__name__
        where = f"{kind} {name!r}"
        w = module.weight
        if not w.is_floating_point():
            raise TypeError(f"{where}: weight dtype {w.dtype} is not floating point")
        plan: dict[str, Any] = {}
        canon_shape = tuple(cls._canon(module, w).shape)
        if config.weight is not None:
            g = _norm_weight_granularity(config.weight.spec.granularity, kind, name, w.dim(), canon_shape)
            plan["weight"] = _with_granularity(config.weight.spec, g)
            try:
                plan["weight"].scale_shape(canon_shape)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{where}: weight spec {g!r} does not fit its weight of shape "
                                 f"{list(canon_shape)}: {e}") from None
            t = plan["weight"].gguf_dtype if plan["weight"].gguf else None
            if t is not None and (len(canon_shape) != 2 or canon_shape[-1] % t.block_size):
                raise ValueError(f"{where}: GGUF type {t.name!r} needs a 2-D weight whose rows are a multiple of "
                                 f"{t.block_size} (its blocks run along the input axis); the weight has shape "
                                 f"{list(canon_shape)} (choose another type for it, e.g. by_name)")
            if not w.is_meta and not bool(torch.isfinite(w).all()):
                raise ValueError(f"{where}: the weight holds NaN or Inf; refusing to quantize it")
        if config.bias is not None:
            if getattr(module, "bias", None) is None:
                raise ValueError(f"{where} has no bias but the config quantizes the bias")
            g = config.bias.spec.granularity
            plan["bias"] = _with_granularity(config.bias.spec, g if isinstance(g, PerTensor) else
                                             (PerChannel(0) if isinstance(g, PerChannel) else PerGroup(g.size, 0)))
        for role in ("input", "output"):
            tc = getattr(config, role)
            if tc is None:
                continue
            if role == "input" and cls._index_input:
                raise ValueError(f"{where}: the input of an embedding is indices; it takes no input quantization "
                                 f"(weight and output only)")
            g = tc.spec.granularity
            if cls._conv and isinstance(g, PerChannel) and g.axis % 2 == 0:
                raise ValueError(f"{where}: per-token scales (PerChannel(0)) apply to Linear activations; "
                                 f"convolution activations take PerTensor(), PerChannel(1) (per channel) or "
                                 f"PerGroup(size, axis=1) along the channels")
            plan[role] = _with_granularity(tc.spec, _act_granularity(g, cls._conv))
        if getattr(module, "max_norm", None) is not None and config.weight is not None:
            raise ValueError(f"{where}: max_norm renormalises the weight in place on every call; it cannot be "
                             f"combined with weight quantization")
        if getattr(module, "padding_mode", "zeros") != "zeros" and cls.__bases__[1] is nn.ConvTranspose2d:
            raise ValueError(f"{where}: ConvTranspose2d supports padding_mode='zeros' only")
        return plan

    def _qinit(self, config: LayerConfig, name: str, plan: dict, qat: bool) -> None:
        self.qconfig = config
        self.qname = name
        self._qspecs = plan
        self._qmode = _QAT if qat else _PENDING
        self._wcache = None  # (version key, fake-quantized weight) while pending / qat
        self._wver = None  # weight version after the last in-place quantization
        self._bver = None
        self._observers: Optional[dict] = None
        self._frozen_meta: Optional[dict] = None
        self.quant_enabled = True
        self._calibrated: set = set()
        for role in ("weight", "bias"):  # scale buffers exist from the start (state_dict keys are stable)
            spec = plan.get(role)
            if spec is None:
                continue
            p = getattr(self, role)
            shape = spec.scale_shape(tuple(self._canon(p).shape) if role == "weight" else tuple(p.shape))
            self.register_buffer(f"{role}_scale", torch.full(shape, float("nan"), device=p.device))
            if not spec.symmetric:
                self.register_buffer(f"{role}_zero_point", torch.zeros(shape, device=p.device))
            if spec.two_level:
                self.register_buffer(f"{role}_tensor_scale", torch.full((), float("nan"), device=p.device))
        for role in ("input", "output"):
            tc = getattr(config, role)
            if tc is not None and tc.calibrated and tc.spec.two_level:
                self.register_buffer(f"{role}_tensor_scale", torch.full((), float("nan"), device=self.weight.device))
            elif tc is not None and tc.calibrated:
                shape = self._static_shape(role)
                self.register_buffer(f"{role}_scale", torch.full(shape, float("nan"), device=self.weight.device))
                if not tc.spec.symmetric:
                    self.register_buffer(f"{role}_zero_point", torch.zeros(shape, device=self.weight.device))

    # -- layout --------------------------------------------------------------------------------------------

    def _canon(self, w: torch.Tensor) -> torch.Tensor:
        """The weight in the canonical [out, in/groups, *kernel] layout (a view, except for grouped transposed
        convolutions). Reads only ``self.groups``, so ``_plan`` may call it on the module being wrapped."""
        return w

    def _uncanon(self, w: torch.Tensor) -> torch.Tensor:
        return w

    def _features(self, role: str) -> int:
        raise NotImplementedError

    def _static_shape(self, role: str) -> tuple:
        g = self._qspecs[role].granularity
        return () if isinstance(g, PerTensor) else (self._features(role),)

    def _scale_view(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A stored static scale (shape () or (features,)) shaped for the tensor ``x`` it applies to."""
        if t.dim() == 0:
            return t.reshape((1,) * x.dim())
        shape = [1] * x.dim()
        shape[1] = t.shape[0]
        return t.reshape(shape)

    # -- weights -------------------------------------------------------------------------------------------

    def _quantize_param(self, w: torch.Tensor, role: str):
        """QTensor of the parameter in the canonical layout (float32 math), by the role's observer; a GGUF weight
        spec with an importance (``quantize_model(..., imatrix=)``, module-local ``_gguf_importance`` until the
        weight is committed or frozen) by llama.cpp's importance-weighted search."""
        x = self._canon(w).detach() if role == "weight" else w.detach()
        imp = self.__dict__.get("_gguf_importance") if role == "weight" else None
        if imp is not None and self._qspecs[role].gguf:
            return qcore.quantize(x, self._qspecs[role], imatrix=imp)
        return _quantize_observed(x, self._qspecs[role], getattr(self.qconfig, role).observer)

    def _fq_param(self, w: torch.Tensor, role: str) -> tuple[torch.Tensor, Any]:
        q = self._quantize_param(w, role)
        fq = qcore.dequantize(q)
        if role == "weight":
            fq = self._uncanon(fq)
        return fq.to(w.dtype), q

    def _keep_params(self, role: str, q) -> None:
        """Store the scales of a quantized weight/bias as buffers (what exporters and freeze read)."""
        pref = role
        for suffix, v in (("scale", q.scales), ("zero_point", q.zero_points), ("tensor_scale", q.tensor_scale)):
            key = f"{pref}_{suffix}"
            if v is None:
                continue
            v = v.detach().to(torch.float32)
            if key in self._buffers and self._buffers[key] is not None and self._buffers[key].shape == v.shape:
                self._buffers[key].copy_(v)
            else:
                self.register_buffer(key, v.clone())
        if self._qspecs[role].gguf:  # llama.cpp's stored scales (what freeze requantizes the weight with)
            ss = getattr(q, "super_scales", None)
            kept = self.__dict__.setdefault("_gguf_kept", {})
            if ss is None:
                kept.pop(role, None)
            else:
                kept[role] = _gguf_numpy(ss)

    def _inplace_quantize(self, role: str) -> None:
        p = getattr(self, role)
        key = (self._qspecs[role], getattr(self.qconfig, role).observer)
        mark = getattr(p, "_qcore_inplace", None)
        if mark is not None and mark[0] == (p._version, p.data_ptr()) and mark[1] == key:
            # a tied module (same tensor, same config) already wrote its fake-quantized values: quantizing them
            # again is not idempotent (int8: absmax 127.5 * s -> 127 * s); take its scales instead
            self._keep_params(role, mark[2])
        else:
            with torch.no_grad():
                fq, q = self._fq_param(p, role)
                p.copy_(fq)
                self._keep_params(role, q)
            self._mark(p, role, q)
        self._set_ver(role, p)

    def _mark(self, p: torch.Tensor, role: str, q) -> None:
        """Record on the tensor itself (shared by tied modules) that its current values are fake-quantized."""
        kept = _Kept(q.scales, q.zero_points, q.tensor_scale, getattr(q, "super_scales", None))
        p._qcore_inplace = ((p._version, p.data_ptr()), (self._qspecs[role], getattr(self.qconfig, role).observer),
                            kept)

    def _set_ver(self, role: str, p: torch.Tensor) -> None:
        if role == "weight":
            self._wver = (p._version, p.data_ptr())
        else:
            self._bver = (p._version, p.data_ptr())

    def _param(self, role: str) -> torch.Tensor:
        """The parameter to use in the forward (weight or bias), quantized per the module's mode."""
        p = getattr(self, role)
        if role not in self._qspecs or not self.quant_enabled or p is None:
            return p
        mode = self._qmode
        if mode == _INPLACE or (mode == _FROZEN and role == "bias"):  # a frozen module's bias stays quantized in place
            ver = self._wver if role == "weight" else self._bver
            if ver != (p._version, p.data_ptr()):
                self._inplace_quantize(role)
            return p
        if mode == _QAT and torch.is_grad_enabled() and p.requires_grad:
            with torch.no_grad():
                fq, q = self._fq_param(p, role)
            self._keep_params(role, q)  # the scale buffers follow the master weight at every step
            return _ste(p, fq)
        key = (role, p._version, p.data_ptr())
        cache = self._wcache or {}
        if cache.get(role, (None,))[0] != key:
            with torch.no_grad():
                fq, q = self._fq_param(p, role)
            cache[role] = (key, fq)
            self._wcache = cache
            if mode == _QAT:
                self._keep_params(role, q)
        return cache[role][1]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)  # type: ignore[misc]
        for role in ("input", "output"):  # static scales loaded from a checkpoint count as calibrated
            if any(f"{prefix}{role}_{k}" in state_dict for k in ("scale", "tensor_scale")):
                self._calibrated.add(role)
        if self._qmode not in (_INPLACE, _FROZEN):
            return
        for role in ("weight", "bias") if self._qmode == _INPLACE else ("bias",):
            if role in self._qspecs and prefix + role in state_dict and f"{prefix}{role}_scale" in state_dict:
                self._adopt_loaded(role)

    def _adopt_loaded(self, role: str) -> None:
        """A weight loaded together with its scales (a saved fake-quantized model) is kept as it is when it lies
        exactly on the grid of those scales: quantizing it again from its own statistics is not idempotent (int8:
        the absmax shrinks to 127 * scale, so the scale changes). Otherwise (float weights, stale scales) it is
        quantized again at the next forward, as after any other write."""
        p = getattr(self, role)
        spec = self._qspecs[role]
        kw = {"scale": self._buffers[f"{role}_scale"], "zero_point": self._buffers.get(f"{role}_zero_point")}
        if spec.two_level:
            kw["tensor_scale"] = self._buffers.get(f"{role}_tensor_scale")
        x = (self._canon(p) if role == "weight" else p).detach().float()
        try:
            back = qcore.dequantize(qcore.quantize(x, spec, **kw))
        except ValueError:
            return  # scales that cannot be used as given: quantize again from the weight
        if role == "weight":
            back = self._uncanon(back)
        if torch.equal(back.to(p.dtype), p.detach()):
            kept = (kw["scale"], kw["zero_point"], kw.get("tensor_scale"))
            self._mark(p, role, _Kept(*(None if t is None else t.clone() for t in kept)))
            self._set_ver(role, p)

    def commit(self, *, weight: Optional["qcore.QTensor"] = None) -> None:
        """Pending -> in place: write the fake-quantized weight (and bias) into the parameters; drop caches.

        ``weight``: an already quantized weight (a ``QTensor`` of this module's weight spec in the canonical
        layout, e.g. GPTQ's result) to commit as it is instead of rounding the current weight to nearest."""
        if self._qmode != _PENDING:
            return
        if weight is not None:
            self._check_given_weight(weight)
        for role in ("weight", "bias"):
            if role == "weight" and weight is not None:
                p = self.weight
                with torch.no_grad():
                    p.copy_(self._uncanon(qcore.dequantize(weight)).to(p.dtype))
                    self._keep_params("weight", weight)
                self._mark(p, "weight", weight)
                self._set_ver("weight", p)
            elif role in self._qspecs:
                self._inplace_quantize(role)
        self._wcache = None
        self._qmode = _INPLACE
        self.__dict__.pop("_gguf_importance", None)  # used: the weight is written with it

    def replace_weight(self, q: "qcore.QTensor") -> None:
        """Write an already quantized weight (a ``QTensor`` of this module's weight spec in the canonical layout)
        into a committed (in-place) module, with its scales, as ``commit(weight=q)`` does for a pending one: e.g.
        the weights a training pass re-rounded (``qcore.adapters.passes.distill``). Tied modules each take it."""
        if self._qmode != _INPLACE:
            raise ValueError(f"{self.qname!r}: replace_weight needs a committed module (mode {self._qmode!r}); a "
                             f"pending one takes commit(weight=...), a frozen one cannot change")
        self._check_given_weight(q)
        p = self.weight
        with torch.no_grad():
            p.copy_(self._uncanon(qcore.dequantize(q)).to(p.dtype))
            self._keep_params("weight", q)
        self._mark(p, "weight", q)
        self._set_ver("weight", p)
        self._wcache = None

    def to_canonical(self, w: torch.Tensor) -> torch.Tensor:
        """A weight-shaped tensor in the canonical ``[out, in/groups, *kernel]`` layout the weight spec is given on
        (differentiable; a view except for grouped transposed convolutions)."""
        return self._canon(w)

    def from_canonical(self, w: torch.Tensor) -> torch.Tensor:
        """The inverse of ``to_canonical``."""
        return self._uncanon(w)

    def _check_given_weight(self, q) -> None:
        spec = self._qspecs.get("weight")
        if spec is None:
            raise ValueError(f"{self.qname!r}: commit(weight=...) but the module's config quantizes no weight")
        if not isinstance(q, qcore.QTensor):
            raise TypeError(f"{self.qname!r}: commit(weight=...) takes a qcore.QTensor, got {type(q).__name__}")
        shape = tuple(self._canon(self.weight).shape)
        if q.spec != spec or tuple(q.shape) != shape:
            raise ValueError(f"{self.qname!r}: the given quantized weight (spec {q.spec.name or q.spec.dtype.name}, "
                             f"shape {tuple(q.shape)}) does not match the module's weight spec "
                             f"{spec.name or spec.dtype.name} and shape {shape}")

    # -- activations ---------------------------------------------------------------------------------------

    def _act_view(self, x: torch.Tensor) -> torch.Tensor:
        if self._conv:
            return x
        return x.reshape(-1, x.shape[-1])

    def _qact(self, x: torch.Tensor, role: str) -> torch.Tensor:
        if role not in self._qspecs or not self.quant_enabled:
            return x
        tc = getattr(self.qconfig, role)
        spec = self._qspecs[role]
        v = self._act_view(x)
        if not tc.calibrated:
            y = _fake_quantize(v, spec)
        elif self._observers is not None:
            self._observers[role].update(v)
            return x
        elif spec.two_level:
            ts = self._buffers[f"{role}_tensor_scale"]
            if role not in self._calibrated:
                raise RuntimeError(self._uncalibrated(role))
            y = _fake_quantize(v, spec, tensor_scale=ts)
        else:
            s = self._buffers[f"{role}_scale"]
            if role not in self._calibrated:
                raise RuntimeError(self._uncalibrated(role))
            zp = self._buffers.get(f"{role}_zero_point")
            y = _fake_quantize(v, spec, scale=self._scale_view(s, v),
                               zero_point=None if zp is None else self._scale_view(zp, v))
        return y.reshape(x.shape).to(x.dtype)

    def _uncalibrated(self, role: str) -> str:
        return (f"{self.qname!r}: static {role} scales are not calibrated; run "
                f"qcore.adapters.quantize_model(model, config, data) with calibration data")

    # -- calibration ---------------------------------------------------------------------------------------

    def static_roles(self) -> list[str]:
        """The activation roles calibration sets (static scales, calibrated two-level tensor scales)."""
        return [r for r in ("input", "output") if r in self._qspecs and getattr(self.qconfig, r).calibrated]

    def start_calibration(self) -> None:
        self._observers = {r: _Observer(getattr(self.qconfig, r), self._qspecs[r], f"{self.qname!r} ({r})")
                           for r in self.static_roles()}

    def finish_calibration(self) -> None:
        obs, self._observers = self._observers, None
        for role, o in (obs or {}).items():
            scale, zp = o.params()
            self._calibrated.add(role)
            if self._qspecs[role].two_level:
                self._buffers[f"{role}_tensor_scale"].copy_(scale.reshape(()))
                continue
            shape = self._static_shape(role)
            self._buffers[f"{role}_scale"].copy_(scale.reshape(shape).to(self._buffers[f"{role}_scale"].device))
            if zp is not None:
                self._buffers[f"{role}_zero_point"].copy_(zp.reshape(shape))

    def abort_calibration(self) -> None:
        self._observers = None

    # -- freeze --------------------------------------------------------------------------------------------

    @property
    def frozen(self) -> bool:
        return self._qmode == _FROZEN

    @property
    def keep_dequantized(self) -> bool:
        """Whether a frozen weight is dequantized once and kept (float memory) for repeated forwards, as evaluation
        wants, instead of at every forward. Setting it False drops the kept copy."""
        return self.__dict__.get("_keep_dequantized", False)

    @keep_dequantized.setter
    def keep_dequantized(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"keep_dequantized must be True or False, got {value!r}")
        self.__dict__["_keep_dequantized"] = value
        if not value:
            self.__dict__.pop("_dequantized", None)

    def freeze(self) -> None:
        """Store the weight as packed low-bit codes + scale codes; the forward dequantizes them (bit-identical to
        the fake-quantized weight). Irreversible (the float weight is dropped)."""
        if self._qmode == _FROZEN or "weight" not in self._qspecs:
            return
        if self._qmode == _PENDING:
            self.commit()
        with torch.no_grad():  # qat: the cached path, which also keeps the weight's scales as buffers
            w = self._param("weight").detach()
        spec = self._qspecs["weight"]
        wc = self._canon(w).float()
        if spec.gguf:
            self._freeze_gguf(w, wc, spec)
            return
        kw: dict[str, Any] = {"scale": self.weight_scale}
        if not spec.symmetric:
            kw["zero_point"] = self.weight_zero_point
        if spec.two_level:
            kw["tensor_scale"] = self.weight_tensor_scale
        q = qcore.quantize(wc, spec, **kw)
        back = self._uncanon(qcore.dequantize(q)).to(w.dtype)
        if not torch.equal(back.view(torch.int16 if w.element_size() == 2 else torch.int32),
                           w.view(torch.int16 if w.element_size() == 2 else torch.int32)):
            raise RuntimeError(f"freeze {self.qname!r}: the stored codes do not reproduce the fake-quantized weight "
                               f"exactly (a qcore bug; please report it)")
        packed = qcore.packing.pack(q.codes, spec.dtype, axis=-1)
        meta = {"shape": tuple(q.codes.shape), "dtype": w.dtype}
        del self._parameters["weight"]
        self.register_buffer("weight_packed", packed)
        if spec.scale_dtype.name == "float32":
            self._buffers["weight_scale"] = q.scales.float()
        else:
            self._buffers["weight_scale"] = q.scale_codes
        if q.zero_points is not None:
            d = spec.dtype
            self._buffers["weight_zero_point"] = q.zero_points.to(torch.int8 if d.signed else torch.uint8) \
                if d.bits <= 8 else q.zero_points.to(torch.int32)
        if q.subblock_shifts is not None:
            self.register_buffer("weight_subblock_shifts", q.subblock_shifts.to(torch.uint8))
        self._frozen_meta = meta
        self._qmode = _FROZEN
        if "bias" in self._qspecs:
            with torch.no_grad():
                self._param("bias")  # a quantized bias (qat: still the float master) is fake-quantized in place, once

    def _freeze_gguf(self, w: torch.Tensor, wc: torch.Tensor, spec: QuantSpec) -> None:
        """freeze for a GGUF spec: ggml's block bytes of the fake-quantized weight (``_gguf_blocks_of``) stored as
        ``weight_packed`` (uint8 ``[rows, blocks * type_size]``: codes, scales, offsets and super-scales as the
        file holds them)."""
        blocks = torch.from_numpy(self._gguf_blocks_of(w, wc, spec)).to(w.device)
        self._set_gguf_frozen(blocks, tuple(wc.shape), w.dtype)
        if "bias" in self._qspecs:
            with torch.no_grad():
                self._param("bias")

    def _gguf_blocks_of(self, w: torch.Tensor, wc: torch.Tensor, spec: QuantSpec) -> np.ndarray:
        """ggml's block bytes of the fake-quantized weight ``w`` (``wc``: canonical, float32): its codes under
        the super-scales kept when it was fake-quantized (llama.cpp's element rule, ``_kquants.requantize``),
        checked to reproduce ``w`` bit for bit."""
        from qcore import _kquants

        x = wc.detach().cpu().numpy().astype(np.float32)
        bits = torch.int16 if w.element_size() == 2 else torch.int32

        def same(q) -> bool:  # the blocks give the module's weight bit for bit (in its dtype)
            back = self._uncanon(torch.from_numpy(np.asarray(qcore.dequantize(q))).to(w.device)).to(w.dtype)
            return torch.equal(back.view(bits), w.view(bits))
        kept = self.__dict__.get("_gguf_kept", {}).get("weight")
        q = None
        if kept is not None and kept.d.shape[:-1] == x.shape[:-1]:
            q = _gguf_qtensor(_kquants.requantize(x, kept, spec.gguf), kept, spec)
        if (q is None or not same(q)) and self.__dict__.get("_gguf_importance") is not None \
                and self._qmode in (_PENDING, _QAT) and "weight" in self._parameters:
            xf = self._canon(self._parameters["weight"]).detach().float().cpu().numpy()  # w: its fake-quantized weight
            q = qcore.quantize(xf, spec, imatrix=self.__dict__["_gguf_importance"])
        if q is None or not same(q):
            q = qcore.quantize(x, spec)  # e.g. a tied module's weight: llama.cpp's search again, checked
            if not same(q):
                raise RuntimeError(f"freeze {self.qname!r}: the {spec.gguf} blocks do not reproduce the "
                                   f"fake-quantized weight exactly (a qcore bug; please report it)")
        return np.ascontiguousarray(qcore.packing.pack_gguf_blocks(q))

    def _set_gguf_frozen(self, blocks: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
        self._parameters.pop("weight", None)
        for k in ("weight_packed", "weight_scale", "weight_zero_point", "weight_subblock_shifts",
                  "weight_tensor_scale"):
            self._buffers.pop(k, None)
        self.register_buffer("weight_packed", blocks)
        self.__dict__.pop("_gguf_kept", None)
        self.__dict__.pop("_gguf_importance", None)
        self.__dict__.pop("_dequantized", None)
        self._frozen_meta = {"shape": tuple(shape), "dtype": dtype}
        self._qmode = _FROZEN

    def load_frozen_gguf(self, blocks: Any, *, shape: tuple, dtype: torch.dtype, device: Any = None) -> None:
        """Make this module frozen from ggml's block bytes of its GGUF weight spec (``spec.gguf``): ``blocks``
        uint8 ``[rows, blocks * type_size]`` (a GGUF file's tensor data, ``qcore.packing.pack_gguf_blocks``) of
        the canonical ``shape`` ``[rows, cols]``; kept as they are (export writes the same bytes). ``dtype``: the
        dtype the forward dequantizes to. ValueError (before any change) when the bytes do not fit the shape or
        do not decode (codes out of range)."""
        spec = self._qspecs.get("weight")
        if spec is None or not spec.gguf:
            raise ValueError(f"load_frozen_gguf {self.qname!r}: the module's weight spec is not a GGUF type "
                             f"({None if spec is None else spec.name or spec.dtype.name})")
        t = spec.gguf_dtype
        b = blocks.detach().cpu().numpy() if isinstance(blocks, torch.Tensor) else np.asarray(blocks)
        shape = tuple(int(n) for n in shape)
        if len(shape) != 2 or shape[1] % t.block_size:
            raise ValueError(f"load_frozen_gguf {self.qname!r}: shape {list(shape)} is not [rows, cols] with cols a "
                             f"multiple of {t.block_size} ({spec.gguf})")
        want = (shape[0], shape[1] // t.block_size * t.type_size)
        if b.dtype != np.uint8 or b.size != want[0] * want[1]:
            raise ValueError(f"load_frozen_gguf {self.qname!r}: blocks of {b.size} {b.dtype} values, expected "
                             f"{want[0] * want[1]} uint8 ({spec.gguf}, shape {list(shape)})")
        b = np.ascontiguousarray(b).reshape(want)
        try:
            qcore.dequantize(qcore.packing.unpack_gguf_blocks(b[:1], spec.gguf))
        except (ValueError, TypeError) as e:
            raise ValueError(f"load_frozen_gguf {self.qname!r}: {e}") from None
        if device is None:
            w = self._parameters.get("weight")
            device = w.device if w is not None and not w.is_meta else torch.device("cpu")
        self._set_gguf_frozen(torch.from_numpy(b.copy()).to(device), shape, dtype)

    def gguf_blocks(self) -> np.ndarray:
        """The weight of a module with a GGUF weight spec as ggml's block bytes (uint8 ``[rows, blocks *
        type_size]``, canonical layout): a frozen module's stored bytes, else those of its fake-quantized weight
        (what ``freeze`` would store; nothing changes)."""
        spec = self._qspecs.get("weight")
        if spec is None or not spec.gguf:
            raise ValueError(f"gguf_blocks {self.qname!r}: the module's weight spec is not a GGUF type")
        if self._qmode == _FROZEN:
            return self.weight_packed.detach().cpu().numpy()
        with torch.no_grad():
            w = self._param("weight").detach()
        return self._gguf_blocks_of(w, self._canon(w).float(), spec)

    def load_frozen(self, parts, *, shape: tuple, dtype: torch.dtype, device: Any = None) -> None:
        """Make this module frozen from a weight's qcore parts (``qcore.formats.quark_layout.WeightParts``:
        codes, float32 scales, zero points, shifts, tensor scale of the canonical ``shape``), as importers of
        checkpoints (Quark HF, GGUF, compressed-tensors) build modules without a float round trip. The float
        weight parameter (if any) is dropped; ``dtype`` is the dtype the forward dequantizes to."""
        if "weight" not in self._qspecs:
            raise ValueError(f"load_frozen {self.qname!r}: the module has no weight quantization spec")
        spec = self._qspecs["weight"]
        el = spec.dtype
        if spec.gguf:
            raise ValueError(f"load_frozen {self.qname!r}: a GGUF weight spec ({spec.gguf}) is loaded from its block "
                             f"bytes (load_frozen_gguf)")
        if tuple(parts.codes.shape) != tuple(shape):
            raise ValueError(f"load_frozen {self.qname!r}: codes of shape {list(parts.codes.shape)}, expected "
                             f"{list(shape)}")
        if device is None:
            w = self._parameters.get("weight")
            device = w.device if w is not None and not w.is_meta else torch.device("cpu")
        codes = torch.from_numpy(np.ascontiguousarray(parts.codes))
        with torch.no_grad():
            self._parameters.pop("weight", None)
            self._buffers.pop("weight_packed", None)
            self.register_buffer("weight_packed", qcore.packing.pack(codes, el, axis=-1).to(device))
            scales = torch.from_numpy(np.ascontiguousarray(parts.scales, np.float32))
            self._buffers["weight_scale"] = (scales if spec.scale_dtype.name == "float32"
                                             else torch.as_tensor(qcore.encode(scales, spec.scale_dtype))).to(device)
            if parts.zero_points is not None:
                zp = torch.from_numpy(np.ascontiguousarray(parts.zero_points))
                self._buffers["weight_zero_point"] = (zp.to(torch.int8 if el.signed else torch.uint8) if el.bits <= 8
                                                      else zp.to(torch.int32)).to(device)
            if parts.shifts is not None:
                self._buffers.pop("weight_subblock_shifts", None)
                self.register_buffer("weight_subblock_shifts",
                                     torch.from_numpy(np.ascontiguousarray(parts.shifts)).to(torch.uint8).to(device))
            if parts.tensor_scale is not None:
                self._buffers["weight_tensor_scale"] = torch.from_numpy(
                    np.asarray(parts.tensor_scale, np.float32)).to(device)
        self._frozen_meta = {"shape": tuple(shape), "dtype": dtype}
        self._qmode = _FROZEN
        self.__dict__.pop("_dequantized", None)
        from qcore.quantize import check_qtensor as _check_qtensor
        try:  # the parts against the spec, as the first forward would check them (pow2 scales, shifts, ...)
            _check_qtensor(self._frozen_qtensor())
        except (ValueError, TypeError) as e:
            raise ValueError(f"load_frozen {self.qname!r}: {e}") from None

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        """``module.to(dtype/device)``, ``.half()``, ...: scale buffers move device but stay float32 (casting them
        would change the numerics); a frozen weight dequantizes to the new dtype."""
        keys = [k for k, v in self._buffers.items() if v is not None and k.endswith(_SCALE_SUFFIXES)]
        saved = {k: self._buffers[k] for k in keys}
        for k in keys:
            self._buffers[k] = None
        try:
            out = super()._apply(fn, recurse)  # type: ignore[misc]
        finally:
            for k, v in saved.items():
                moved = fn(v)
                self._buffers[k] = moved if moved.dtype == v.dtype else v.to(device=moved.device)
        if self._frozen_meta is not None:
            self._frozen_meta["dtype"] = fn(torch.empty(0, dtype=self._frozen_meta["dtype"])).dtype
            self.__dict__.pop("_dequantized", None)
        return out

    def _frozen_weight(self) -> torch.Tensor:
        if self._qspecs["weight"].gguf:
            v = torch.from_numpy(np.asarray(qcore.dequantize(self._frozen_qtensor())))
            return self._uncanon(v.to(self.weight_packed.device)).to(self._frozen_meta["dtype"])
        return self._uncanon(_dequantize(self._frozen_qtensor())).to(self._frozen_meta["dtype"])

    def _frozen_qtensor(self) -> "qcore.QTensor":
        spec = self._qspecs["weight"]
        meta = self._frozen_meta
        if spec.gguf:  # numpy parts, from ggml's bytes
            return qcore.packing.unpack_gguf_blocks(self.weight_packed.detach().cpu().numpy(), spec.gguf)
        codes = qcore.packing.unpack(self.weight_packed, spec.dtype, axis=-1, length=meta["shape"][-1])
        sc = self.weight_scale
        scales = sc if sc.dtype == torch.float32 else qcore.decode(sc, spec.scale_dtype)
        zp = self._buffers.get("weight_zero_point")
        shifts = self._buffers.get("weight_subblock_shifts")
        ts = self._buffers.get("weight_tensor_scale")
        return qcore.QTensor(codes=codes.to(torch.uint8 if isinstance(spec.dtype, FloatDType) else codes.dtype),
                             scales=scales.float(), zero_points=None if zp is None else zp.float(), spec=spec,
                             subblock_shifts=None if shifts is None else shifts.to(torch.int32),
                             tensor_scale=ts)

    def _frozen_linear(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """``F.linear(x, self._w(), bias)`` by the fused Triton dequantize-matmul when the weight is frozen int4/uint4
        per group or MXFP4 and x is on a GPU with Triton (``qcore.adapters.triton.available``); None otherwise (the
        caller dequantizes). No autograd graph: None when x requires grad."""
        if self._qmode != _FROZEN or (x.requires_grad and torch.is_grad_enabled()):
            return None
        from . import triton as kernels

        spec = self._qspecs["weight"]
        meta = self._frozen_meta
        if spec.gguf:
            return None
        if not kernels.available(x) or x.dtype != meta["dtype"] or len(meta["shape"]) != 2 \
                or kernels.w4_format(spec) is None:
            return None
        bias = self._param("bias")
        if bias is not None and bias.requires_grad and torch.is_grad_enabled():
            return None
        return kernels.linear_w4(x, self.weight_packed, self.weight_scale, self._buffers.get("weight_zero_point"),
                                 None if bias is None else bias.detach(), spec=spec, k=meta["shape"][1])

    def _w(self) -> torch.Tensor:
        if self._qmode == _FROZEN:
            if not getattr(self, "keep_dequantized", False):
                return self._frozen_weight()
            dq = self.__dict__.get("_dequantized")
            if dq is None:  # dequantized once, kept (float memory) for repeated forwards: evaluation
                dq = self.__dict__["_dequantized"] = self._frozen_weight()
            return dq
        return self._param("weight")

    def extra_repr(self) -> str:  # type: ignore[override]
        base = super().extra_repr()  # type: ignore[misc]
        roles = ", ".join(f"{r}={self._qspecs[r].name or self._qspecs[r].dtype.name}"
                          + ("(dyn)" if r in ("input", "output") and getattr(self.qconfig, r).dynamic else "")
                          for r in ("weight", "input", "output", "bias") if r in self._qspecs)
        return f"{base}, quant=[{roles}], qmode={self._qmode}"

    # -- reading a quantized module: the public API ------------------------------------------------------------
    # Exporters, importers and algorithms read (and importers fill) a quantized module through these members
    # only, never through its private state; wrappers added later inherit them.

    @property
    def specs(self) -> "Mapping[str, QuantSpec]":
        """The spec of each quantized role (``"weight"``, ``"bias"``, ``"input"``, ``"output"``), read-only: a role
        the config does not quantize is absent. Weight specs are given on the canonical ``[out, in, *kernel]`` layout,
        activation specs on the ``[tokens, features]`` view (``[N, C, *spatial]`` for convolutions)."""
        return MappingProxyType(self._qspecs)

    @property
    def float_type(self) -> type:
        """The torch module class this wrapper replaces (``nn.Linear`` for ``QuantLinear``, ...)."""
        return type(self).__bases__[1]

    @property
    def activation_axis(self) -> int:
        """The features axis of the activations: 1 for convolutions (``[N, C, *spatial]``), -1 otherwise."""
        return 1 if self._conv else -1

    @property
    def weight_shape(self) -> tuple:
        """The weight's shape in the canonical ``[out, in, *kernel]`` layout, frozen or not."""
        if self.frozen:
            return tuple(self._frozen_meta["shape"])
        return tuple(self._canon(self.weight).shape)

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the forward computes the weight in: a frozen module's dequantization dtype, else the weight's."""
        return self._frozen_meta["dtype"] if self.frozen else self.weight.dtype

    def effective(self, role: str, *, canonical: bool = False) -> Optional[torch.Tensor]:
        """The ``"weight"`` or ``"bias"`` the forward computes with, detached: fake-quantized (computed at most once
        per change of the parameter), or dequantized from the frozen codes; the float parameter when the role is not
        quantized or ``quant_enabled`` is False (a frozen weight is dequantized either way); None for a missing
        bias. ``canonical=True``: the weight in the canonical ``[out, in, *kernel]`` layout."""
        if role not in ("weight", "bias"):
            raise ValueError(f"effective: role must be 'weight' or 'bias', got {role!r}")
        if canonical and role != "weight":
            raise ValueError("effective: canonical=True applies to role 'weight' only (a bias has one axis)")
        if role == "bias" and getattr(self, "bias", None) is None:  # embeddings have no bias attribute
            return None
        with torch.no_grad():
            t = self._w() if role == "weight" else self._param("bias")
        if t is None:
            return None
        return self._canon(t.detach()) if canonical else t.detach()

    def scales(self, role: str) -> "StoredScales":
        """The scale tensors the module stores for the quantized ``role`` (its buffers themselves, not copies).
        Weight and bias: float32 scales while fake-quantized; after ``freeze`` the weight's scale codes
        (``spec.scale_dtype`` decodes a dtype other than float32), integer zero points and sub-block shifts; the
        codes are the ``weight_packed`` buffer. Activations: static scales only (a dynamic role stores none); NaN
        until calibrated (``is_calibrated``)."""
        if role not in self._qspecs:
            raise ValueError(f"scales: {self.qname!r} does not quantize role {role!r}; its roles: "
                             f"{list(self._qspecs)}")
        b = self._buffers
        return StoredScales(b.get(f"{role}_scale"), b.get(f"{role}_zero_point"), b.get(f"{role}_tensor_scale"),
                            b.get(f"{role}_subblock_shifts"))

    def is_calibrated(self, role: str) -> bool:
        """Whether the static scales of activation ``role`` (``"input"`` / ``"output"``) hold values: calibrated by
        ``quantize_model`` / ``calibrate``, or loaded (``load_state_dict``, ``load_static_scales``)."""
        if role not in ("input", "output"):
            raise ValueError(f"is_calibrated: role must be 'input' or 'output', got {role!r}")
        return role in self._calibrated

    def static_scale_shape(self, role: str) -> tuple:
        """The shape of the static scale of activation ``role``: ``()`` per tensor, ``(features,)`` per feature."""
        if role not in ("input", "output") or role not in self._qspecs:
            raise ValueError(f"static_scale_shape: {self.qname!r} quantizes no activation role {role!r}; its "
                             f"roles: {list(self._qspecs)}")
        return self._static_shape(role)

    @property
    def observers(self) -> "Optional[Mapping[str, Any]]":
        """While calibrating (between ``start_calibration`` and ``finish_calibration`` / ``abort_calibration``):
        role -> the running statistics of that static role (``n``: the batches seen), read-only; else None."""
        return None if self._observers is None else MappingProxyType(self._observers)

    def fake_quantize_activation(self, x: torch.Tensor, role: str) -> torch.Tensor:
        """``x`` fake-quantized as the forward does for activation ``role`` (``"input"`` / ``"output"``): dynamic
        or calibrated static scales; ``x`` unchanged when the role is not quantized or ``quant_enabled`` is False."""
        if role not in ("input", "output"):
            raise ValueError(f"fake_quantize_activation: role must be 'input' or 'output', got {role!r}")
        return self._qact(x, role)

    def load_static_scales(self, role: str, *, scale: Any = None, zero_point: Any = None, tensor_scale: Any = None,
                           device: Any = None) -> None:
        """Set the static scales of activation ``role`` from a checkpoint (importers), as calibration would:
        ``scale`` (reshaped to ``static_scale_shape(role)``) and, for an asymmetric spec, ``zero_point`` (None: 0);
        for a two-level spec its per-tensor ``tensor_scale`` only. Tensors or arrays, stored as float32 (on
        ``device`` when given). Checked before anything is stored."""
        if role not in self.static_roles():
            raise ValueError(f"load_static_scales: {self.qname!r} has no static {role!r} scales; its static roles: "
                             f"{self.static_roles()}")
        spec = self._qspecs[role]
        new: dict[str, torch.Tensor] = {}
        if spec.two_level:
            if tensor_scale is None or scale is not None or zero_point is not None:
                raise ValueError(f"load_static_scales {self.qname!r} ({role}): a two-level spec takes tensor_scale "
                                 f"only")
            new["tensor_scale"] = torch.as_tensor(tensor_scale, dtype=torch.float32)
            if new["tensor_scale"].numel() != 1:
                raise ValueError(f"load_static_scales {self.qname!r} ({role}): tensor_scale has shape "
                                 f"{list(new['tensor_scale'].shape)}, expected one value")
            new["tensor_scale"] = new["tensor_scale"].reshape(())
        else:
            if scale is None or tensor_scale is not None:
                raise ValueError(f"load_static_scales {self.qname!r} ({role}): takes scale (and zero_point for an "
                                 f"asymmetric spec), not tensor_scale")
            if zero_point is not None and spec.symmetric:
                raise ValueError(f"load_static_scales {self.qname!r} ({role}): the spec is symmetric; it takes no "
                                 f"zero_point")
            shape = self._static_shape(role)
            vals = {"scale": scale}
            if not spec.symmetric:
                vals["zero_point"] = torch.zeros(shape) if zero_point is None else zero_point
            for k, v in vals.items():
                t = torch.as_tensor(v, dtype=torch.float32)
                if t.numel() != int(np.prod(shape)):
                    raise ValueError(f"load_static_scales {self.qname!r} ({role}): {k} has shape {list(t.shape)}, "
                                     f"expected {list(shape)}")
                new[k] = t.reshape(shape)
        for k, t in new.items():
            self._buffers[f"{role}_{k}"] = t if device is None else t.to(device)
        self._calibrated.add(role)

    def load_bias(self, bias: nn.Parameter) -> None:
        """Give the module the bias it computes with as floats (a checkpoint stores a quantized bias as its
        fake-quantized values): assigned as it is, never quantized again."""
        if not isinstance(bias, nn.Parameter):
            raise TypeError(f"load_bias {self.qname!r}: bias must be an nn.Parameter, got {type(bias).__name__}")
        old = self._parameters.get("bias")
        if old is None or tuple(old.shape) != tuple(bias.shape):
            raise ValueError(f"load_bias {self.qname!r}: a bias of shape {list(bias.shape)}, but the module's bias is "
                             f"{'absent' if old is None else list(old.shape)}")
        self._parameters["bias"] = bias
        self._qspecs.pop("bias", None)


_SCALE_SUFFIXES = ("_scale", "_zero_point", "_tensor_scale", "_subblock_shifts")


@dataclasses.dataclass(frozen=True, eq=False)
class StoredScales:
    """The scale tensors a quantized module stores for one role (``_QuantMixin.scales``); None: not stored."""

    scale: Optional[torch.Tensor]
    zero_point: Optional[torch.Tensor]
    tensor_scale: Optional[torch.Tensor]
    subblock_shifts: Optional[torch.Tensor]


__all__ += ["StoredScales"]


class _Kept(NamedTuple):
    """The scales of a fake-quantized parameter (what ``_keep_params`` stores as buffers)."""

    scales: Any
    zero_points: Any
    tensor_scale: Any
    super_scales: Any = None  # GGUF specs: llama.cpp's stored scales


def _gguf_numpy(ss):
    """A ``GGUFScales`` with numpy fields (torch inputs give torch fields)."""
    from qcore._kquants import GGUFScales

    def np_(v):
        return None if v is None else v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
    return GGUFScales(*(np_(getattr(ss, f.name)) for f in dataclasses.fields(ss)))


def _gguf_qtensor(codes: np.ndarray, ss, spec: QuantSpec) -> "qcore.QTensor":
    """The QTensor of GGUF ``codes`` under stored scales ``ss`` (scales and offsets derived from them)."""
    from qcore._kquants import sub_scales

    scales, offsets = sub_scales(ss, spec.granularity.size)
    return qcore.QTensor(codes, scales, None, spec, None, None, offsets, ss)


def _fake_quantize(x: torch.Tensor, spec: QuantSpec, **kw) -> torch.Tensor:
    """``qcore.fake_quantize(x, spec, **kw)``, computed by its Triton twin (same bits) when x is on a GPU with
    Triton (``qcore.adapters.triton.available``), the spec is covered and no gradient is needed."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        from . import triton as kernels

        if kernels.available(x) and kernels.supports(spec, ndim=x.dim(), given_scale=kw.get("scale") is not None):
            return kernels.fake_quantize(x, spec, **kw)
    return qcore.fake_quantize(x, spec, **kw)


def _dequantize(q) -> torch.Tensor:
    """``qcore.dequantize(q)``, by its Triton twin (same bits) when the codes are on a GPU with Triton."""
    from . import triton as kernels

    if kernels.available(q.codes) and kernels.supports(q.spec, ndim=q.codes.dim()):
        return kernels.dequantize(q)
    return qcore.dequantize(q)


def _ste(x: torch.Tensor, fq: torch.Tensor) -> torch.Tensor:
    """``fq`` in the forward, identity gradient to ``x`` in the backward."""
    return x + (fq.to(x.dtype) - x).detach()


# ---------------------------------------------------------------------------------------------------------------
# the wrappers
# ---------------------------------------------------------------------------------------------------------------


class LowRankBranch(NamedTuple):
    """SVDQuant's high-precision side branch of a ``QuantLinear`` (``QuantLinear.low_rank_branch``): ``down``
    ``[rank, in]`` and ``up`` ``[out, rank]`` (the layer adds ``x_hat down^T up^T``; Quark's ``correction.l1`` /
    ``l2``), and ``smoothing`` ``[in]`` or None: the per-input-channel divisor the layer applies to its input
    before both paths (``x_hat = x / smoothing``; None where it is folded into the preceding op)."""

    down: torch.Tensor
    up: torch.Tensor
    smoothing: Optional[torch.Tensor]


_BRANCH_BUFFERS = ("lowrank_down", "lowrank_up", "input_smoothing")


class QuantLinear(_QuantMixin, nn.Linear):
    """``nn.Linear`` with qcore quantization of its weight, input, output and bias; optionally SVDQuant's low-rank
    branch (buffers ``lowrank_down`` / ``lowrank_up``, and ``input_smoothing``): ``y = Q(x_hat) Q(W)^T +
    x_hat down^T up^T + b`` with ``x_hat = x / input_smoothing`` (``set_low_rank_branch``)."""

    def _features(self, role):
        return self.in_features if role == "input" else self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self._buffers
        sm = b.get("input_smoothing")
        if sm is not None:
            x = x / sm.to(x.dtype)
        xq = self._qact(x, "input")
        y = self._frozen_linear(xq)  # the fused kernel on a GPU (frozen int4 / MXFP4 weights), else None
        if y is None:
            y = F.linear(xq, self._w(), self._param("bias"))
        down = b.get("lowrank_down")
        if down is not None:  # the branch reads the unquantized (smoothed) input
            y = y + F.linear(F.linear(x, down.to(x.dtype)), b["lowrank_up"].to(x.dtype))
        return self._qact(y, "output")

    @property
    def low_rank_branch(self) -> Optional[LowRankBranch]:
        """The SVDQuant branch (its buffers themselves), or None."""
        b = self._buffers
        if b.get("lowrank_down") is None:
            return None
        return LowRankBranch(b["lowrank_down"], b["lowrank_up"], b.get("input_smoothing"))

    def set_low_rank_branch(self, down: torch.Tensor, up: torch.Tensor, smoothing: Optional[torch.Tensor] = None
                            ) -> None:
        """Give the module SVDQuant's branch (importers; ``qcore.adapters.passes.svdquant`` sets it on the float
        Linear before wrapping, where ``from_module`` carries it over). Shapes checked before anything is stored."""
        add_low_rank_branch(self, down, up, smoothing, where=self.qname)


def add_low_rank_branch(m: nn.Module, down: torch.Tensor, up: torch.Tensor, smoothing: Optional[torch.Tensor] = None,
                        *, where: str = "") -> None:
    """Register SVDQuant's branch buffers (``lowrank_down`` [r, in], ``lowrank_up`` [out, r], ``input_smoothing``
    [in] or None) on an ``nn.Linear`` (float or ``QuantLinear``); replaces a branch it has."""
    if not isinstance(m, nn.Linear):
        raise TypeError(f"low-rank branch {where!r}: takes an nn.Linear, got {type(m).__name__}")
    n_out, n_in = m.out_features, m.in_features
    for name, t in (("down", down), ("up", up), ("smoothing", smoothing)):
        if t is not None and not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            raise TypeError(f"low-rank branch {where!r}: {name} must be a floating torch tensor, got "
                            f"{type(t).__name__}")
    if down.dim() != 2 or up.dim() != 2 or down.shape[1] != n_in or up.shape[0] != n_out \
            or up.shape[1] != down.shape[0]:
        raise ValueError(f"low-rank branch {where!r}: down {list(down.shape)} and up {list(up.shape)} do not fit "
                         f"a Linear [{n_out}, {n_in}] (expected down [r, {n_in}], up [{n_out}, r])")
    if smoothing is not None and tuple(smoothing.shape) != (n_in,):
        raise ValueError(f"low-rank branch {where!r}: smoothing has shape {list(smoothing.shape)}, expected "
                         f"[{n_in}]")
    for k in _BRANCH_BUFFERS:
        m._buffers.pop(k, None)
    # contiguous copies: a loaded checkpoint's tensors are contiguous, and the matmul's summation order (so its
    # bits) follows the layout
    m.register_buffer("lowrank_down", down.detach().clone(memory_format=torch.contiguous_format))
    m.register_buffer("lowrank_up", up.detach().clone(memory_format=torch.contiguous_format))
    if smoothing is not None:
        m.register_buffer("input_smoothing", smoothing.detach().clone(memory_format=torch.contiguous_format))


def low_rank_modules(model: nn.Module) -> list[str]:
    """The names of the modules of ``model`` carrying an SVDQuant low-rank branch (exporters that cannot write it
    refuse them by name)."""
    return [n for n, m in model.named_modules() if m._buffers.get("lowrank_down") is not None]


class QuantConv2d(_QuantMixin, nn.Conv2d):
    """``nn.Conv2d`` with qcore quantization; activations per tensor or along the channel axis."""

    _conv = True

    def _features(self, role):
        return self.in_channels if role == "input" else self.out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._qact(x, "input")
        y = self._conv_forward(x, self._w(), self._param("bias"))
        return self._qact(y, "output")


class QuantConvTranspose2d(_QuantMixin, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` with qcore quantization. Its weight is stored ``[in, out/groups, kh, kw]``; the
    config's canonical ``[out, in/groups, ...]`` axes (those of ``nn.Conv2d``) are mapped, so PerChannel(0) is
    per output channel here too: output channel ``g * out/groups + j`` is ``weight[g*in/groups:(g+1)*in/groups, j]``."""

    _conv = True

    def _canon(self, w):
        g = self.groups
        if g == 1:
            return w.transpose(0, 1)
        i, og = w.shape[:2]
        return w.reshape(g, i // g, og, *w.shape[2:]).transpose(1, 2).reshape(g * og, i // g, *w.shape[2:])

    def _uncanon(self, w):
        g = self.groups
        if g == 1:
            return w.transpose(0, 1)
        o, ig = w.shape[:2]
        return w.reshape(g, o // g, ig, *w.shape[2:]).transpose(1, 2).reshape(g * ig, o // g, *w.shape[2:])

    def _features(self, role):
        return self.in_channels if role == "input" else self.out_channels

    def forward(self, x: torch.Tensor, output_size: Optional[list] = None) -> torch.Tensor:
        x = self._qact(x, "input")
        output_padding = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size, 2,
                                              self.dilation)
        y = F.conv_transpose2d(x, self._w(), self._param("bias"), self.stride, self.padding, output_padding,
                               self.groups, self.dilation)
        return self._qact(y, "output")


class QuantEmbedding(_QuantMixin, nn.Embedding):
    """``nn.Embedding`` with a quantized table (rows = canonical output axis) and optional output quantization."""

    _index_input = True

    def _features(self, role):
        return self.embedding_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.embedding(x, self._w(), self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                        self.sparse)
        return self._qact(y, "output")


class QuantEmbeddingBag(_QuantMixin, nn.EmbeddingBag):
    """``nn.EmbeddingBag`` with a quantized table and optional output quantization."""

    _index_input = True

    def _features(self, role):
        return self.embedding_dim

    def forward(self, x: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = F.embedding_bag(x, self._w(), offsets, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                            self.mode, self.sparse, per_sample_weights, self.include_last_offset, self.padding_idx)
        return self._qact(y, "output")


QUANT_CLASSES = {nn.Linear: QuantLinear, nn.Conv2d: QuantConv2d, nn.ConvTranspose2d: QuantConvTranspose2d,
                 nn.Embedding: QuantEmbedding, nn.EmbeddingBag: QuantEmbeddingBag}


def is_quantized_module(m: nn.Module) -> bool:
    return isinstance(m, _QuantMixin)


def wrap(module: nn.Module, config: LayerConfig, *, name: str = "", qat: bool = False,
         proj_weights: Any = ()) -> nn.Module:
    """The quantized wrapper of ``module`` (exact type match: Linear, Conv2d, ConvTranspose2d, Embedding,
    EmbeddingBag, transformers' Conv1D; or fused MoE experts of a known layout, ``QuantExperts``) for ``config``;
    ``module`` itself is not modified. ``proj_weights``: fused experts only, per-projection weight specs
    (``LayerPlan.proj_weights``; ``QuantExperts.from_module``)."""
    cls = QUANT_CLASSES.get(type(module))
    if cls is None and isinstance(module._parameters.get("gate_up_proj"), torch.Tensor):  # fused MoE experts
        return QuantExperts.from_module(module, config, name=name, qat=qat, proj_weights=proj_weights)
    if cls is None:
        raise TypeError(f"{name or 'module'}: cannot quantize a {type(module).__name__}; supported: "
                        f"{[c.__name__ for c in QUANT_CLASSES]}")
    if proj_weights:
        raise ValueError(f"{name or 'module'}: proj_weights applies to fused MoE experts only, not to a "
                         f"{type(module).__name__}")
    return cls.from_module(module, config, name=name, qat=qat)


# ---------------------------------------------------------------------------------------------------------------
# transformers' Conv1D (GPT-2's c_attn, c_proj, c_fc): a Linear whose weight is stored [in, out]
# ---------------------------------------------------------------------------------------------------------------

try:
    from transformers.pytorch_utils import Conv1D as _Conv1D
except ImportError:  # transformers absent: no model can hold a Conv1D
    _Conv1D = None

QuantConv1D: Any = None

if _Conv1D is not None:
    class QuantConv1D(_QuantMixin, _Conv1D):  # type: ignore[no-redef]
        """transformers' ``Conv1D`` (``y = x @ W + b``, ``W`` stored ``[in, out]``: GPT-2's ``attn.c_attn`` (fused
        q/k/v), ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``) with qcore quantization, exactly as a ``QuantLinear``
        holding ``W^T``: the canonical weight layout is ``W^T`` ``[out, in]`` (per-channel scales per output
        feature, groups along the input features), activations on the ``[tokens, features]`` view. The parameter
        keeps its ``[in, out]`` layout (state_dict keys and shapes as the float model's); the scale buffers, and a
        frozen weight's packed codes (``weight_packed``), are in the Linear ``[out, in]`` layout, so exporters and
        importers read and build it as a Linear's (``load_frozen`` takes parts of shape ``[out, in]``)."""

        def _canon(self, w):
            return w.t()

        def _uncanon(self, w):
            return w.t()

        def _features(self, role):
            return self.nx if role == "input" else self.nf

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self._qact(x, "input")
            shape = x.shape[:-1] + (self.nf,)
            x2 = x.reshape(-1, x.shape[-1])
            y = self._frozen_linear(x2)  # the fused kernel on a GPU (frozen int4 / MXFP4 codes are [out, in])
            if y is None:
                w = self._w()
                w = w if w.is_contiguous() else w.contiguous()  # Conv1D's own [in, out] operand: the same bits
                b = self._param("bias")
                y = torch.addmm(b, x2, w) if b is not None else torch.mm(x2, w)
            return self._qact(y.view(shape), "output")

        def __repr__(self) -> str:  # Conv1D's own __repr__ would hide the quantization
            return nn.Module.__repr__(self)

        def extra_repr(self) -> str:  # type: ignore[override]
            return f"nf={self.nf}, nx={self.nx}{_QuantMixin.extra_repr(self)}"

    QUANT_CLASSES[_Conv1D] = QuantConv1D
    __all__.append("QuantConv1D")


def linear_weight(m: nn.Module) -> Optional[torch.Tensor]:
    """The weight of a float Linear-like module as the Linear's ``[out, in]`` matrix: ``nn.Linear``'s parameter, or
    the transposed view of transformers' ``Conv1D`` parameter (in-place writes to it reach the parameter); None for
    any other module. What algorithms that treat a layer as ``x @ W^T`` (GPTQ, scale folding) read and write."""
    if type(m) is nn.Linear:
        return m.weight
    if _Conv1D is not None and type(m) is _Conv1D:
        return m.weight.t()
    return None


def linear_weight_spec(module: nn.Module, plan, name: str) -> QuantSpec:
    """The weight spec of ``plan`` (a ``LayerPlan``) on ``module``'s weight as a Linear's ``[out, in]`` matrix
    (``linear_weight``): the granularity normalised to that layout (what GPTQ, AWQ and SpinQuant quantize);
    ``name`` names the module in errors."""
    spec = plan.config.weight.spec
    w = linear_weight(module)  # [out, in]: nn.Linear's weight, transformers Conv1D's transposed
    g = _norm_weight_granularity(spec.granularity, "Linear", name, w.dim(), tuple(w.shape))
    return _with_granularity(spec, g)


# ---------------------------------------------------------------------------------------------------------------
# fused MoE experts (transformers 5: all experts of a layer in two 3-D parameters; issue 22)
# ---------------------------------------------------------------------------------------------------------------

#: the fused projections of an experts module, [experts, out, in] each: the hidden states go into gate_up_proj,
#: act(gate) * up into down_proj
EXPERT_PROJS = ("gate_up_proj", "down_proj")
#: experts classes whose eager forward is the one ``QuantExperts.forward`` computes (checked against each in the
#: tests): route, per hit expert ``act(x @ gate.T) * (x @ up.T) @ down.T`` weighted by the router, summed. Other
#: transformers experts classes qualify when their eager forward is, token for token, ``MixtralExperts``' (and
#: their parameters have the same layout): OLMoE, PhiMoE, GraniteMoE, DeepSeek-V2/V3, GLM-4-MoE, ... in 5.23
KNOWN_EXPERTS = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts")
_SAME_FORWARD: dict = {}


def _forward_source(cls: type) -> Optional[str]:
    """The eager forward of an experts class (under transformers' ``use_experts_implementation``), as tokens."""
    import inspect
    import io
    import tokenize
    f = getattr(cls, "forward", None)
    f = getattr(f, "__wrapped__", f)
    try:
        src = inspect.getsource(f)
        toks = [t.string for t in tokenize.generate_tokens(io.StringIO(src).readline)
                if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]
    except (OSError, TypeError, tokenize.TokenError, IndentationError):
        return None
    return " ".join(toks)


def _same_forward(cls: type) -> bool:
    """Whether ``cls``' eager forward is ``MixtralExperts``' (token for token; cached per class)."""
    if cls not in _SAME_FORWARD:
        try:
            from transformers.models.mixtral.modeling_mixtral import MixtralExperts
        except ImportError:
            return False
        ref, mine = _forward_source(MixtralExperts), _forward_source(cls)
        _SAME_FORWARD[cls] = ref is not None and mine == ref
    return _SAME_FORWARD[cls]


def experts_layout_problem(m: nn.Module) -> Optional[str]:
    """None when ``m`` is a fused experts module ``QuantExperts`` quantizes (a known class, or one whose eager
    forward is ``MixtralExperts``', with the parameter layout that forward reads); else why not (a module of
    another layout stays refused by ``plan_model``)."""
    t = type(m).__name__
    if t not in KNOWN_EXPERTS and not (t.endswith("Experts") and _same_forward(type(m))):
        return (f"{t} is not a fused experts layout qcore knows ({', '.join(KNOWN_EXPERTS)}, or an eager forward "
                f"identical to MixtralExperts')")
    params = {k for k, v in m._parameters.items() if v is not None}
    if params != set(EXPERT_PROJS):
        return f"{t} holds parameters {sorted(params)}; the known layout is exactly {list(EXPERT_PROJS)}"
    gu, d = m._parameters["gate_up_proj"], m._parameters["down_proj"]
    if gu.dim() != 3 or d.dim() != 3 or gu.shape[1] % 2 or tuple(d.shape) != (gu.shape[0], gu.shape[2],
                                                                           gu.shape[1] // 2):
        return (f"{t} gate_up_proj {list(gu.shape)} / down_proj {list(d.shape)}: the known layout is [E, 2I, H] / "
                f"[E, H, I]")
    if getattr(m, "num_experts", None) != gu.shape[0] or not callable(getattr(m, "act_fn", None)):
        return f"{t}: num_experts / act_fn do not match the known layout"
    for attr, want in (("is_transposed", False), ("is_concatenated", True), ("has_bias", False),
                       ("has_gate", True), ("has_post_expert_norm", False)):
        if getattr(m, attr, want) != want:
            return f"{t}: {attr}={getattr(m, attr)!r}; the known layout has {attr}={want!r}"
    return None


def experts_weight_spec(module: nn.Module, config: LayerConfig, name: str, proj: str) -> QuantSpec:
    """The weight spec of ``config`` (a ``LayerConfig`` quantizing weights) on each expert's ``[out, in]`` slice of
    the fused experts ``module``'s ``proj`` (``EXPERT_PROJS``): the granularity normalised to that layout, as for a
    Linear weight. What ``QuantExperts`` quantizes every slice with, and what GPTQ on experts quantizes to;
    ``name`` names the module in errors. A GGUF type needs each expert's rows to be whole blocks (ValueError)."""
    if proj not in EXPERT_PROJS:
        raise ValueError(f"proj must be one of {list(EXPERT_PROJS)}, got {proj!r}")
    if not isinstance(config, LayerConfig) or config.weight is None:
        raise ValueError(f"experts {name!r}: the config quantizes no weight")
    w = module._parameters[proj]
    t = config.weight.spec.gguf_dtype if config.weight.spec.gguf else None
    if t is not None and w.shape[-1] % t.block_size:
        raise ValueError(f"experts {name!r}: GGUF type {t.name!r} needs each expert's {proj} rows to be a multiple of "
                         f"{t.block_size} (its blocks run along the input axis); {proj} has shape {list(w.shape)} "
                         f"(choose another type for the experts, e.g. by_name)")
    g = _norm_weight_granularity(config.weight.spec.granularity, "experts", f"{name}.{proj}", 2, tuple(w.shape[1:]))
    return _with_granularity(config.weight.spec, g)


class QuantExperts(_QuantMixin):
    """A fused MoE experts module (``KNOWN_EXPERTS``: transformers 5's ``MixtralExperts``, ``Qwen2MoeExperts``,
    ``Qwen3MoeExperts``, and every experts class whose eager forward is ``MixtralExperts``'; with ``gate_up_proj``
    [E, 2I, H] and ``down_proj`` [E, H, I]: ``experts_layout_problem``) with every expert quantized as its own
    Linear layers would be.

    ``wrap`` / ``QuantExperts.from_module`` build it as a subclass of the module's own class
    (``isinstance(q, MixtralExperts)`` holds, ``state_dict`` keys stay ``gate_up_proj`` / ``down_proj`` plus the
    scale buffers). The layer's ``LayerConfig`` applies to each expert slice ``[out, in]`` of each projection as
    to a Linear weight: per channel is one scale per output row of each expert, per group runs along each
    expert's ``in`` axis, and **per tensor is one scale per expert** (per projection: ``gate_up_proj`` of expert
    ``e`` has one scale, shared by its gate and up halves); two-level formats (NVFP4) get one tensor scale per
    expert and projection. Scale buffers are the Linear's with a leading expert axis: ``gate_up_proj_scale``
    ``[E, *linear scale shape]``, ``..._zero_point``, ``..._tensor_scale`` ``[E]``.

    Activations are quantized where each expert's Linear would see them: the routed hidden states into
    ``gate_up_proj`` (input) and ``act(gate) * up`` into ``down_proj`` (input); the output role, when the config
    has one, quantizes each GEMM's output. Dynamic specs take their scales per call; static ones per expert and
    projection (buffers ``gate_up_proj_input_scale`` ``[E, *]``, ...), calibrated by
    ``qcore.adapters.calibrate``. During calibration every expert sees every token
    (``calibrate_all_experts``, the peers' practice: no expert is left without statistics), and the block's
    output is that of the routed top-k only.

    GGUF weight specs (``qcore.make_spec("q4_k")``, ...; each expert's rows whole blocks): every expert's slice is
    quantized by llama.cpp's search (weighted by the experts' importance under ``quantize_model(..., imatrix=)``),
    the super-scales are kept, and ``freeze`` stores ggml's block bytes per projection (``gate_up_proj_packed``
    uint8 ``[E, out, bytes]``; ``gguf_blocks(proj)``, ``load_frozen_gguf``). With GGUF specs one projection may
    have its own type (``proj_weights``, ``weight_spec(proj)``: llama.cpp's mixes type ``ffn_down_exps`` apart).

    Life cycle as the Linear wrappers: pending (fake-quantized on the fly) -> ``commit()`` (weights written in
    place; ``commit(weight={proj: [QTensor per expert]})`` commits an algorithm's result, GPTQ's, as it is) ->
    ``freeze()`` (packed per-expert codes ``gate_up_proj_packed`` [E, out, packed in] + scale codes);
    ``load_frozen`` for importers. ``qat=True`` is refused: not supported for fused experts yet (docs/adapters.md).
    The forward is the eager one whatever the model's ``_experts_implementation``; with every role off it equals the
    original module's eager forward bit for bit.
    """

    _classes: dict = {}
    calibrate_all_experts = True

    # -- construction ---------------------------------------------------------------------------------------

    @classmethod
    def class_for(cls, base: type) -> type:
        """The quantized class of the experts class ``base`` (made once)."""
        q = cls._classes.get(base)
        if q is None:
            q = cls._classes[base] = type(f"Quant{base.__name__}", (QuantExperts, base),
                                          {"__module__": __name__, "__doc__": QuantExperts.__doc__})
        return q

    @classmethod
    def from_module(cls, module: nn.Module, config: LayerConfig, *, name: str = "", qat: bool = False,
                    proj_weights: Any = ()):
        """``proj_weights``: ``{projection: TensorConfig or QuantSpec}`` (or its items) giving one projection
        (``"down_proj"`` or ``"gate_up_proj"``) its own weight spec, where it and ``config``'s weight spec are GGUF
        types (llama.cpp's mixes type ``ffn_down_exps`` apart); ``weight_spec(proj)`` reads it back."""
        if not isinstance(config, LayerConfig):
            raise TypeError(f"config must be a LayerConfig, got {type(config).__name__}")
        why = experts_layout_problem(module)
        if why is not None:
            raise TypeError(f"experts {name!r}: {why}")
        if qat:
            raise ValueError(f"experts {name!r}: qat=True is not supported for fused MoE experts yet "
                             f"(docs/adapters.md); quantize with qat=False, or exclude the experts")
        own = _proj_weight_specs(module, config, name, proj_weights)
        qcls = QuantExperts.class_for(type(module))
        q = _QuantMixin.from_module.__func__(qcls, module, config, name=name, qat=False)
        for p, (tc, spec) in own.items():
            q._wspecs[p] = spec
            q._proj_tcs[p] = tc
            w = q._parameters[p]
            for k in (f"{p}_scale", f"{p}_zero_point"):
                q._buffers.pop(k, None)
            shape = (w.shape[0], *spec.scale_shape(tuple(w.shape[1:])))
            q.register_buffer(f"{p}_scale", torch.full(shape, float("nan"), device=w.device))
            if not spec.symmetric:
                q.register_buffer(f"{p}_zero_point", torch.zeros(shape, device=w.device))
        return q

    @classmethod
    def _plan(cls, module, config: LayerConfig, name: str) -> dict:
        where = f"experts {name!r} ({type(module).__name__})"
        if config.bias is not None:
            raise ValueError(f"{where} has no bias but the config quantizes the bias")
        plan: dict[str, Any] = {}
        if config.weight is not None:
            for p in EXPERT_PROJS:
                w = module._parameters[p]
                if not w.is_floating_point():
                    raise TypeError(f"{where}: {p} dtype {w.dtype} is not floating point")
                shape = tuple(w.shape[1:])
                spec = experts_weight_spec(module, config, name, p)
                g = spec.granularity
                try:
                    spec.scale_shape(shape)
                except (ValueError, TypeError) as e:
                    raise ValueError(f"{where}: weight spec {g!r} does not fit each expert's {p} of shape "
                                     f"{list(shape)}: {e}") from None
                if not w.is_meta and not bool(torch.isfinite(w).all()):
                    raise ValueError(f"{where}: {p} holds NaN or Inf; refusing to quantize it")
                plan["weight"] = spec
        for role in ("input", "output"):
            tc = getattr(config, role)
            if tc is not None:
                plan[role] = _with_granularity(tc.spec, _act_granularity(tc.spec.granularity, False))
        return plan

    def _qinit(self, config: LayerConfig, name: str, plan: dict, qat: bool) -> None:
        self.qconfig = config
        self.qname = name
        self._qspecs = plan
        self._wspecs = {p: plan["weight"] for p in EXPERT_PROJS} if "weight" in plan else {}  # weight_spec(proj)
        self._proj_tcs: dict = {}  # projections with their own weight spec (proj_weights)
        self._qmode = _PENDING
        self._wcache = None  # {proj: (version key, fake-quantized [E, out, in])} while pending
        self._wver: dict = {}  # proj -> weight version after the last in-place quantization
        self._observers = None
        self._frozen_meta = None
        self.quant_enabled = True
        self._calibrated = set()
        spec = plan.get("weight")
        for p in EXPERT_PROJS:
            w = self._parameters[p]
            dev, e = w.device, w.shape[0]
            if spec is not None:
                shape = (e, *spec.scale_shape(tuple(w.shape[1:])))
                self.register_buffer(f"{p}_scale", torch.full(shape, float("nan"), device=dev))
                if not spec.symmetric:
                    self.register_buffer(f"{p}_zero_point", torch.zeros(shape, device=dev))
                if spec.two_level:
                    self.register_buffer(f"{p}_tensor_scale", torch.full((e,), float("nan"), device=dev))
            for role in ("input", "output"):
                tc = getattr(config, role)
                if tc is None or not tc.calibrated:
                    continue
                if tc.spec.two_level:
                    self.register_buffer(f"{p}_{role}_tensor_scale", torch.full((e,), float("nan"), device=dev))
                    continue
                shape = (e, *self._expert_static_shape(p, role))
                self.register_buffer(f"{p}_{role}_scale", torch.full(shape, float("nan"), device=dev))
                if not tc.spec.symmetric:
                    self.register_buffer(f"{p}_{role}_zero_point", torch.zeros(shape, device=dev))

    # -- layout --------------------------------------------------------------------------------------------

    def weight_spec(self, proj: str) -> QuantSpec:
        """The weight spec of each expert's ``[out, in]`` slice of ``proj``: ``specs["weight"]``, or the
        projection's own (``proj_weights``: a GGUF type llama.cpp's mix gives ``ffn_down_exps`` apart)."""
        if proj not in EXPERT_PROJS:
            raise ValueError(f"weight_spec: proj must be one of {list(EXPERT_PROJS)}, got {proj!r}")
        if "weight" not in self._qspecs:
            raise ValueError(f"weight_spec: experts {self.qname!r} quantize no weight")
        return self._wspecs[proj]

    def effective_proj(self, proj: str) -> torch.Tensor:
        """Every expert's ``proj`` weight ``[E, out, in]`` as the forward computes with it, detached: fake-quantized,
        or dequantized from the frozen codes (the experts' ``effective("weight")``)."""
        if proj not in EXPERT_PROJS:
            raise ValueError(f"effective_proj: proj must be one of {list(EXPERT_PROJS)}, got {proj!r}")
        with torch.no_grad():
            return self._proj(proj).detach()

    def to_float(self) -> nn.Module:
        """A float module of the original experts class computing with this module's effective weights
        (``effective_proj``; the model's dtype): what a destination without this module's weight format holds
        (``qcore convert`` of GGUF k-quant experts to an HF checkpoint). This module is not changed."""
        base = self.float_type
        f = base.__new__(base)
        mine = set(QuantExperts.__new__(type(self)).__dict__) | {
            "qconfig", "qname", "_qspecs", "_wspecs", "_proj_tcs", "_qmode", "_wcache", "_wver", "_observers",
            "_frozen_meta", "quant_enabled", "_calibrated", "_gguf_kept", "_dequantized", "_gguf_importance",
            "_keep_dequantized"}
        f.__dict__.update({k: v for k, v in self.__dict__.items() if k not in mine})
        f._parameters = {k: v for k, v in self._parameters.items() if k not in EXPERT_PROJS}
        f._buffers = {k: v for k, v in self._buffers.items() if not k.startswith(EXPERT_PROJS)}
        f._non_persistent_buffers_set = {k for k in self._non_persistent_buffers_set if k in f._buffers}
        f._modules = dict(self._modules)
        for p in EXPERT_PROJS:
            f._parameters[p] = nn.Parameter(self.effective_proj(p).clone(), requires_grad=False)
        return f

    def effective(self, role: str, *, canonical: bool = False) -> Optional[torch.Tensor]:  # type: ignore[override]
        raise ValueError(f"experts {self.qname!r}: effective() reads a single weight; fused experts have one per "
                         f"projection: effective_proj('gate_up_proj') / effective_proj('down_proj')")

    @property
    def proj_weights(self) -> tuple:
        """``((projection, TensorConfig), ...)``: the projections with their own weight spec (as
        ``LayerPlan.proj_weights``); empty when both take the config's."""
        return tuple(sorted(self._proj_tcs.items()))

    def mark_static_scales_loaded(self) -> None:
        """The importer (``qcore.adapters.io.experts``) has written every static activation scale buffer of every
        expert from a checkpoint: the roles count as calibrated (``is_calibrated``)."""
        self._calibrated.update(self.static_roles())

    def expert_shape(self, proj: str) -> tuple:
        """``(E, out, in)`` of ``proj``, frozen or not."""
        if self._frozen_meta is not None:
            return tuple(self._frozen_meta["shapes"][proj])
        return tuple(self._parameters[proj].shape)

    def _expert_static_shape(self, proj: str, role: str) -> tuple:
        """The stored static scale shape of one expert's ``proj`` for ``role``: () per tensor, (features,) per
        feature."""
        g = self._qspecs[role].granularity
        if isinstance(g, PerTensor):
            return ()
        _, o, i = self.expert_shape(proj)
        return (i if role == "input" else o,)

    def _static_shape(self, role: str) -> tuple:  # the per-expert shape of gate_up_proj (the mixin's accessor)
        return self._expert_static_shape("gate_up_proj", role)

    # -- weights -------------------------------------------------------------------------------------------

    def _quantize_slice(self, w: torch.Tensor, proj: str = "gate_up_proj"):
        """QTensor of one expert's [out, in] slice of ``proj``, as ``QuantLinear`` quantizes its weight (float32
        math); a GGUF spec by llama.cpp's search (``qcore.quantize``)."""
        spec = self._wspecs[proj]
        if spec.gguf:
            return qcore.quantize(w.detach().float(), spec)
        return _quantize_observed(w.detach(), spec, self.qconfig.weight.observer)

    def _fq_proj(self, w: torch.Tensor, proj: str) -> tuple[torch.Tensor, list]:
        spec = self._wspecs[proj]
        imp = (self.__dict__.get("_gguf_importance") or {}).get(proj) if spec.gguf else None
        if imp is not None:  # quantize_model(..., imatrix=): each expert (gate and up rows apart) with its importance
            e_, o, i = w.shape
            k = imp.shape[1]
            qs = [_gguf_cat([qcore.quantize(w[e, h * (o // k):(h + 1) * (o // k)].detach().float(), spec,
                                            imatrix=imp[e, h]) for h in range(k)]) for e in range(e_)]
            return torch.stack([torch.as_tensor(qcore.dequantize(q)) for q in qs]).to(w.dtype), qs
        if spec.gguf:  # rows are independent: every expert's [out, in] at once, then one QTensor per expert
            e_, o, i = w.shape
            q = qcore.quantize(w.detach().float().reshape(e_ * o, i), spec)
            return (qcore.dequantize(q).reshape(e_, o, i).to(w.dtype),
                    [_gguf_expert(q, e * o, (e + 1) * o) for e in range(e_)])
        qs = [self._quantize_slice(w[e], proj) for e in range(w.shape[0])]
        fq = torch.stack([qcore.dequantize(q) for q in qs]).to(w.dtype)
        return fq, qs

    def _keep_proj(self, proj: str, qs: list) -> None:
        if self._wspecs[proj].gguf:  # llama.cpp's stored scales per expert (what freeze requantizes with)
            from qcore._kquants import GGUFScales
            ss = [_gguf_numpy(q.super_scales) for q in qs]
            self.__dict__.setdefault("_gguf_kept", {})[proj] = GGUFScales(*(
                None if getattr(ss[0], f.name) is None else np.stack([getattr(x, f.name) for x in ss])
                for f in dataclasses.fields(ss[0])))
        for suffix, vals in (("scale", [q.scales for q in qs]), ("zero_point", [q.zero_points for q in qs]),
                             ("tensor_scale", [q.tensor_scale for q in qs])):
            if vals[0] is None:
                continue
            v = torch.stack([torch.as_tensor(t).detach().to(torch.float32).reshape(vals[0].shape) for t in vals])
            key = f"{proj}_{suffix}"
            if key in self._buffers and self._buffers[key] is not None and self._buffers[key].shape == v.shape:
                self._buffers[key].copy_(v.to(self._buffers[key].device))
            else:
                self.register_buffer(key, v.clone())

    def _inplace_proj(self, proj: str) -> None:
        p = self._parameters[proj]
        with torch.no_grad():
            fq, qs = self._fq_proj(p, proj)
            p.copy_(fq)
            self._keep_proj(proj, qs)
        self._wver[proj] = (p._version, p.data_ptr())

    def _proj(self, proj: str) -> torch.Tensor:
        """The [E, out, in] weight the forward uses (quantized per the module's mode)."""
        if self._qmode == _FROZEN:
            return self._frozen_proj(proj)
        p = self._parameters[proj]
        if "weight" not in self._qspecs or not self.quant_enabled:
            return p
        if self._qmode == _INPLACE:
            if self._wver.get(proj) != (p._version, p.data_ptr()):
                self._inplace_proj(proj)
            return p
        key = (p._version, p.data_ptr())
        cache = self._wcache or {}
        if cache.get(proj, (None,))[0] != key:
            with torch.no_grad():
                fq, _ = self._fq_proj(p, proj)
            cache[proj] = (key, fq)
            self._wcache = cache
        return cache[proj][1]

    def commit(self, *, weight: Optional[Mapping] = None) -> None:  # type: ignore[override]
        """Pending -> in place: write every expert's fake-quantized weights into ``gate_up_proj`` / ``down_proj``
        (scales kept as buffers).

        ``weight``: the experts' already quantized weights (an algorithm's result, e.g. GPTQ's), committed as they
        are instead of rounding to nearest: ``{proj: sequence of E entries}`` for both ``EXPERT_PROJS``, each entry a
        ``qcore.QTensor`` of this module's weight spec and the expert's ``[out, in]`` shape, or None for an expert
        rounded to nearest as without ``weight``. Everything is checked before any weight changes."""
        given = None if weight is None else self._check_given_experts(weight)
        if self._qmode != _PENDING:
            return
        if "weight" in self._qspecs:
            for p in EXPERT_PROJS:
                if given is None:
                    self._inplace_proj(p)
                    continue
                par = self._parameters[p]
                with torch.no_grad():
                    qs = [q if q is not None else self._quantize_slice(par[e], p) for e, q in enumerate(given[p])]
                    par.copy_(torch.stack([torch.as_tensor(qcore.dequantize(q)).to(par.device)
                                           for q in qs]).to(par.dtype))
                    self._keep_proj(p, qs)
                self._wver[p] = (par._version, par.data_ptr())
        self._wcache = None
        self._qmode = _INPLACE
        self.__dict__.pop("_gguf_importance", None)  # used: the weights are written with it

    def _check_given_experts(self, weight) -> dict:
        where = f"experts {self.qname!r}: commit(weight=...)"
        spec = self._qspecs.get("weight")
        if spec is None:
            raise ValueError(f"{where} but the module's config quantizes no weight")
        if not isinstance(weight, Mapping):
            raise TypeError(f"{where} takes {{proj: [qcore.QTensor per expert]}} for {list(EXPERT_PROJS)}, got "
                            f"{type(weight).__name__}")
        if set(weight) != set(EXPERT_PROJS):
            raise ValueError(f"{where}: keys {sorted(weight)}, expected {list(EXPERT_PROJS)}")
        out = {}
        for p in EXPERT_PROJS:
            e_, o, i = self.expert_shape(p)
            spec = self._wspecs[p]
            qs = weight[p]
            if isinstance(qs, (str, bytes, Mapping)) or not isinstance(qs, Sequence) or len(qs) != e_:
                raise ValueError(f"{where}: {p} must be a sequence of {e_} entries (one per expert), got "
                                 f"{type(qs).__name__}" + (f" of {len(qs)}" if isinstance(qs, Sequence) else ""))
            for e, q in enumerate(qs):
                if q is None:
                    continue
                if not isinstance(q, qcore.QTensor):
                    raise TypeError(f"{where}: {p} of expert {e} is a {type(q).__name__}, expected a qcore.QTensor "
                                    f"or None")
                if q.spec != spec or tuple(q.shape) != (o, i):
                    raise ValueError(f"{where}: {p} of expert {e} (spec {q.spec.name or q.spec.dtype.name}, shape "
                                     f"{tuple(q.shape)}) does not match the module's weight spec "
                                     f"{spec.name or spec.dtype.name} and the expert's shape {(o, i)}")
            out[p] = list(qs)
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        nn.Module._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)
        for role in ("input", "output"):
            if any(f"{prefix}{p}_{role}_{k}" in state_dict for p in EXPERT_PROJS for k in ("scale", "tensor_scale")):
                self._calibrated.add(role)
        if self._qmode != _INPLACE or "weight" not in self._qspecs:
            return
        for proj in EXPERT_PROJS:  # a saved fake-quantized model: kept as saved when on the grid of its scales
            if prefix + proj in state_dict and f"{prefix}{proj}_scale" in state_dict:
                p = self._parameters[proj]
                try:
                    back = torch.stack([qcore.dequantize(qcore.quantize(p[e].detach().float(), self._qspecs["weight"],
                                                                        **self._given(proj, e)))
                                        for e in range(p.shape[0])])
                except ValueError:
                    continue
                if torch.equal(back.to(p.dtype), p.detach()):
                    self._wver[proj] = (p._version, p.data_ptr())

    def _given(self, proj: str, e: int) -> dict:
        spec = self._qspecs["weight"]
        b = self._buffers
        kw: dict[str, Any] = {"scale": b[f"{proj}_scale"][e]}
        if not spec.symmetric:
            kw["zero_point"] = b[f"{proj}_zero_point"][e]
        if spec.two_level:
            kw["tensor_scale"] = b[f"{proj}_tensor_scale"][e]
        return kw

    def expert_qtensors(self, proj: str) -> list:
        """Every expert's weight of ``proj`` as a ``qcore.QTensor`` of the layer's spec ([out, in]), frozen or not
        (a committed weight is quantized again with its own scales, exactly as ``freeze`` does: nothing
        changes). What ``freeze`` and the exporters read. A GGUF spec: ``gguf_blocks(proj)`` unpacked (numpy)."""
        spec = self._wspecs.get(proj)
        if spec is not None and spec.gguf:
            b = self.gguf_blocks(proj)
            return [qcore.packing.unpack_gguf_blocks(b[e], spec) for e in range(b.shape[0])]
        return [self.expert_qtensor(proj, e) for e in range(self.expert_shape(proj)[0])]

    def expert_qtensor(self, proj: str, e: int) -> "qcore.QTensor":
        """Expert ``e``'s weight of ``proj`` as a ``qcore.QTensor`` (see ``expert_qtensors``)."""
        if "weight" not in self._qspecs:
            raise ValueError(f"experts {self.qname!r}: the module quantizes no weight")
        if self._qmode == _FROZEN:
            return self._frozen_qtensor_e(proj, e)
        if self._qmode == _PENDING:
            self.commit()
        if self._wspecs[proj].gguf:
            return qcore.packing.unpack_gguf_blocks(self.gguf_blocks(proj)[e], self._wspecs[proj])
        with torch.no_grad():
            w = self._proj(proj)[e].detach()
            q = qcore.quantize(w.float(), self._qspecs["weight"], **self._given(proj, e))
            if not torch.equal(qcore.dequantize(q).to(w.dtype), w):
                raise RuntimeError(f"experts {self.qname!r}: {proj} of expert {e} is not on its quantization grid "
                                   f"(was it changed after quantize_model without a forward?); run a forward or "
                                   f"freeze the model first")
        return q

    # -- freeze --------------------------------------------------------------------------------------------

    def freeze(self) -> None:
        """Store each projection as packed per-expert codes (``gate_up_proj_packed`` [E, out, packed in]) plus
        scale codes; the forward dequantizes them (bit-identical to the fake-quantized weights). Irreversible."""
        if self._qmode == _FROZEN or "weight" not in self._qspecs:
            return
        dtype = self._parameters[EXPERT_PROJS[0]].dtype
        if self._wspecs[EXPERT_PROJS[0]].gguf:
            if self._qmode == _PENDING:
                self.commit()
            blocks = {p: self.gguf_blocks(p) for p in EXPERT_PROJS}  # every check before anything is dropped
            dev = self._parameters[EXPERT_PROJS[0]].device
            self._set_gguf_experts({p: torch.from_numpy(b).to(dev) for p, b in blocks.items()},
                                   {p: self.expert_shape(p) for p in EXPERT_PROJS}, dtype)
            return
        qts = {p: self.expert_qtensors(p) for p in EXPERT_PROJS}  # every check before anything is dropped
        shapes = {p: self.expert_shape(p) for p in EXPERT_PROJS}
        with torch.no_grad():
            for p in EXPERT_PROJS:
                self._store_frozen(p, qts[p])
                del self._parameters[p]
        self._frozen_meta = {"shapes": shapes, "dtype": dtype}
        self._qmode = _FROZEN
        self.__dict__.pop("_dequantized", None)

    def _store_frozen(self, proj: str, qs: list) -> None:
        spec = self._qspecs["weight"]
        dev = qs[0].codes.device
        codes = torch.stack([q.codes for q in qs])
        self._buffers.pop(f"{proj}_packed", None)
        self.register_buffer(f"{proj}_packed", qcore.packing.pack(codes, spec.dtype, axis=-1).to(dev))
        if spec.scale_dtype.name == "float32":
            self._buffers[f"{proj}_scale"] = torch.stack([q.scales.float() for q in qs]).to(dev)
        else:
            self._buffers[f"{proj}_scale"] = torch.stack([torch.as_tensor(q.scale_codes) for q in qs]).to(dev)
        if qs[0].zero_points is not None:
            d = spec.dtype
            zp = torch.stack([q.zero_points for q in qs])
            self._buffers[f"{proj}_zero_point"] = (zp.to(torch.int8 if d.signed else torch.uint8) if d.bits <= 8
                                                   else zp.to(torch.int32)).to(dev)
        if qs[0].subblock_shifts is not None:
            self._buffers.pop(f"{proj}_subblock_shifts", None)
            self.register_buffer(f"{proj}_subblock_shifts",
                                 torch.stack([q.subblock_shifts for q in qs]).to(torch.uint8).to(dev))
        if qs[0].tensor_scale is not None:
            self._buffers[f"{proj}_tensor_scale"] = torch.stack(
                [torch.as_tensor(q.tensor_scale).float().reshape(()) for q in qs]).to(dev)

    def load_frozen(self, parts, *, dtype: torch.dtype, device: Any = None) -> None:  # type: ignore[override]
        """Make this module frozen from its experts' qcore parts, as importers build modules without a float round
        trip: ``parts[proj][e]`` is the ``qcore.formats.quark_layout.WeightParts`` of expert ``e``'s ``proj``
        slice ``[out, in]`` (canonical), for both projections. The float parameters (if any) are dropped;
        ``dtype`` is the dtype the forward dequantizes to. Everything is checked before the module changes."""
        if "weight" not in self._qspecs:
            raise ValueError(f"load_frozen {self.qname!r}: the module has no weight quantization spec")
        spec = self._qspecs["weight"]
        if not isinstance(parts, dict) or set(parts) != set(EXPERT_PROJS):
            raise ValueError(f"load_frozen {self.qname!r}: parts must map {list(EXPERT_PROJS)} to per-expert "
                             f"WeightParts, got {sorted(parts) if isinstance(parts, dict) else type(parts).__name__}")
        shapes = {p: self.expert_shape(p) for p in EXPERT_PROJS}
        if device is None:
            w = self._parameters.get(EXPERT_PROJS[0])
            device = w.device if w is not None and not w.is_meta else torch.device("cpu")
        qts: dict = {}
        from qcore.quantize import check_qtensor as _check_qtensor
        for p in EXPERT_PROJS:
            e_, o, i = shapes[p]
            if len(parts[p]) != e_:
                raise ValueError(f"load_frozen {self.qname!r}: {len(parts[p])} experts of {p}, expected {e_}")
            qts[p] = []
            for e, pt in enumerate(parts[p]):
                if tuple(pt.codes.shape) != (o, i):
                    raise ValueError(f"load_frozen {self.qname!r}: {p} of expert {e}: codes of shape "
                                     f"{list(pt.codes.shape)}, expected {[o, i]}")
                q = _qtensor_from_parts(pt, spec)
                try:
                    _check_qtensor(q)
                except (ValueError, TypeError) as err:
                    raise ValueError(f"load_frozen {self.qname!r}: {p} of expert {e}: {err}") from None
                qts[p].append(q)
        with torch.no_grad():
            for p in EXPERT_PROJS:
                self._parameters.pop(p, None)
                self._store_frozen(p, [_to_device(q, device) for q in qts[p]])
        self._frozen_meta = {"shapes": shapes, "dtype": dtype}
        self._qmode = _FROZEN
        self.__dict__.pop("_dequantized", None)

    # -- GGUF weight specs: ggml's block bytes per projection ---------------------------------------------------

    def gguf_blocks(self, proj: str) -> np.ndarray:  # type: ignore[override]
        """``proj``'s weights, for a module with a GGUF weight spec, as ggml's block bytes: uint8 ``[E, out, blocks *
        type_size]`` (each expert's ``[out, in]`` rows, as a GGUF file's 3-D expert tensor holds them): a frozen
        module's stored bytes, else those of its fake-quantized weights (what ``freeze`` would store; the codes
        under the super-scales kept when they were quantized, checked to reproduce the weights bit for bit)."""
        if proj not in EXPERT_PROJS:
            raise ValueError(f"gguf_blocks: proj must be one of {list(EXPERT_PROJS)}, got {proj!r}")
        spec = self._wspecs.get(proj)
        if spec is None or not spec.gguf:
            raise ValueError(f"gguf_blocks {self.qname!r}: the experts' {proj} weight spec is not a GGUF type")
        if self._qmode == _FROZEN:
            return self._buffers[f"{proj}_packed"].detach().cpu().numpy()
        from qcore import _kquants
        with torch.no_grad():
            w = self._proj(proj).detach()
        e_, o, i = w.shape
        x = w.float().cpu().numpy().reshape(e_ * o, i)
        bits = torch.int16 if w.element_size() == 2 else torch.int32

        def same(q) -> bool:
            back = torch.from_numpy(np.asarray(qcore.dequantize(q))).reshape(e_, o, i).to(w.dtype)
            return torch.equal(back.view(bits), w.cpu().view(bits))
        kept = self.__dict__.get("_gguf_kept", {}).get(proj)
        q = None
        if kept is not None and kept.d.shape[:-1] == (e_, o):
            from qcore._kquants import GGUFScales
            kept = GGUFScales(*(None if v is None else v.reshape(e_ * o, -1) for v in dataclasses.astuple(kept)))
            q = _gguf_qtensor(_kquants.requantize(x, kept, spec.gguf), kept, spec)
        if q is None or not same(q):
            q = qcore.quantize(x, spec)  # e.g. weights loaded from a checkpoint: llama.cpp's search again, checked
            if not same(q):
                raise RuntimeError(f"experts {self.qname!r}: {proj}'s {spec.gguf} blocks do not reproduce its "
                                   f"fake-quantized weights exactly (were they changed after quantize_model without "
                                   f"a forward?)")
        return np.ascontiguousarray(qcore.packing.pack_gguf_blocks(q)).reshape(e_, o, -1)

    def _set_gguf_experts(self, blocks: dict, shapes: dict, dtype: torch.dtype) -> None:
        for p in EXPERT_PROJS:
            self._parameters.pop(p, None)
            for suffix in ("_packed", "_scale", "_zero_point", "_subblock_shifts", "_tensor_scale"):
                self._buffers.pop(f"{p}{suffix}", None)
            self.register_buffer(f"{p}_packed", blocks[p])
        for k in ("_gguf_kept", "_dequantized", "_gguf_importance"):
            self.__dict__.pop(k, None)
        self._frozen_meta = {"shapes": {p: tuple(shapes[p]) for p in EXPERT_PROJS}, "dtype": dtype}
        self._qmode = _FROZEN

    def load_frozen_gguf(self, blocks: Any, *, dtype: torch.dtype, device: Any = None  # type: ignore[override]
                         ) -> None:
        """Make this module frozen from ggml's block bytes of its GGUF weight spec: ``blocks[proj]`` uint8 ``[E,
        out, blocks * type_size]`` for both ``EXPERT_PROJS`` (a GGUF file's expert tensors; ``gate_up_proj``'s
        rows are the gate rows then the up rows of each expert), kept as they are (export writes the same bytes).
        ``dtype``: the dtype the forward dequantizes to. ValueError (before any change) when the bytes do not fit
        the experts' shapes or do not decode."""
        bad = [p for p in EXPERT_PROJS if p not in self._wspecs or not self._wspecs[p].gguf]
        if bad:
            raise ValueError(f"load_frozen_gguf {self.qname!r}: the experts' {bad[0]} weight spec is not a GGUF type")
        if not isinstance(blocks, Mapping) or set(blocks) != set(EXPERT_PROJS):
            raise ValueError(f"load_frozen_gguf {self.qname!r}: blocks must map {list(EXPERT_PROJS)} to uint8 [E, out, "
                             f"bytes], got {sorted(blocks) if isinstance(blocks, Mapping) else type(blocks).__name__}")
        shapes = {p: self.expert_shape(p) for p in EXPERT_PROJS}
        out = {}
        for p in EXPERT_PROJS:
            spec = self._wspecs[p]
            t = spec.gguf_dtype
            b = blocks[p]
            b = b.detach().cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b)
            e_, o, i = shapes[p]
            want = (e_, o, i // t.block_size * t.type_size)
            if b.dtype != np.uint8 or b.size != int(np.prod(want)):
                raise ValueError(f"load_frozen_gguf {self.qname!r}: {p}: blocks of {b.size} {b.dtype} values, "
                                 f"expected {int(np.prod(want))} uint8 ({spec.gguf}, experts {[e_, o, i]})")
            b = np.ascontiguousarray(b).reshape(want)
            try:
                qcore.dequantize(qcore.packing.unpack_gguf_blocks(b.reshape(e_ * o, -1), spec.gguf))
            except (ValueError, TypeError) as err:
                raise ValueError(f"load_frozen_gguf {self.qname!r}: {p}: {err}") from None
            out[p] = b.copy()
        if device is None:
            w = self._parameters.get(EXPERT_PROJS[0])
            device = w.device if w is not None and not w.is_meta else torch.device("cpu")
        self._set_gguf_experts({p: torch.from_numpy(b).to(device) for p, b in out.items()}, shapes, dtype)

    def _frozen_dense_e(self, proj: str, e: int) -> torch.Tensor:
        """Expert ``e``'s dequantized ``proj`` weight ([out, in], the frozen dtype, on the codes' device)."""
        dtype = self._frozen_meta["dtype"]
        if self._wspecs[proj].gguf:
            b = self._buffers[f"{proj}_packed"]
            v = qcore.dequantize(qcore.packing.unpack_gguf_blocks(b[e].detach().cpu().numpy(), self._wspecs[proj]))
            return torch.from_numpy(np.asarray(v)).to(b.device).to(dtype)
        return _dequantize(self._frozen_qtensor_e(proj, e)).to(dtype)

    def _frozen_qtensor_e(self, proj: str, e: int) -> "qcore.QTensor":
        spec = self._wspecs[proj]
        if spec.gguf:
            return qcore.packing.unpack_gguf_blocks(self._buffers[f"{proj}_packed"][e].detach().cpu().numpy(), spec)
        _, o, i = self._frozen_meta["shapes"][proj]
        codes = qcore.packing.unpack(self._buffers[f"{proj}_packed"][e], spec.dtype, axis=-1, length=i)
        sc = self._buffers[f"{proj}_scale"][e]
        scales = sc if sc.dtype == torch.float32 else qcore.decode(sc, spec.scale_dtype)
        zp = self._buffers.get(f"{proj}_zero_point")
        shifts = self._buffers.get(f"{proj}_subblock_shifts")
        ts = self._buffers.get(f"{proj}_tensor_scale")
        return qcore.QTensor(codes=codes.to(torch.uint8 if isinstance(spec.dtype, FloatDType) else codes.dtype),
                             scales=scales.float(), zero_points=None if zp is None else zp[e].float(), spec=spec,
                             subblock_shifts=None if shifts is None else shifts[e].to(torch.int32),
                             tensor_scale=None if ts is None else ts[e])

    def _frozen_proj(self, proj: str) -> torch.Tensor:
        cache = self.__dict__.get("_dequantized")
        if cache is not None and proj in cache:
            return cache[proj]
        w = torch.stack([self._frozen_dense_e(proj, e) for e in range(self._frozen_meta["shapes"][proj][0])])
        if getattr(self, "keep_dequantized", False):
            self.__dict__.setdefault("_dequantized", {})[proj] = w
        return w

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        out = super()._apply(fn, recurse)
        self.__dict__.pop("_dequantized", None)
        return out

    # -- activations ---------------------------------------------------------------------------------------

    def _qact_e(self, x: torch.Tensor, proj: str, role: str, e: int) -> torch.Tensor:
        """Fake-quantize the activation ``x`` ([tokens, features]) of expert ``e``'s ``proj`` for ``role``."""
        if role not in self._qspecs or not self.quant_enabled or x.shape[0] == 0:
            return x
        tc = getattr(self.qconfig, role)
        spec = self._qspecs[role]
        if not tc.calibrated:
            return _fake_quantize(x, spec).to(x.dtype)
        if self._observers is not None:
            self._observers[_obs_key(proj, role, e)].update(x)
            return x
        if role not in self._calibrated:
            raise RuntimeError(self._uncalibrated(role))
        if spec.two_level:
            return _fake_quantize(x, spec, tensor_scale=self._buffers[f"{proj}_{role}_tensor_scale"][e]).to(x.dtype)
        s = self._buffers[f"{proj}_{role}_scale"][e]
        zp = self._buffers.get(f"{proj}_{role}_zero_point")
        return _fake_quantize(x, spec, scale=self._scale_view(s, x),
                              zero_point=None if zp is None else self._scale_view(zp[e], x)).to(x.dtype)

    def start_calibration(self) -> None:
        n = self.expert_shape(EXPERT_PROJS[0])[0]
        self._observers = {_obs_key(p, r, e): _Observer(getattr(self.qconfig, r), self._qspecs[r],
                                                        f"{self.qname!r} (expert {e} {p}, {r})")
                           for r in self.static_roles() for p in EXPERT_PROJS for e in range(n)}

    def finish_calibration(self) -> None:
        obs, self._observers = self._observers, None
        obs = obs or {}
        params = {k: o.params() for k, o in obs.items()}  # every expert's statistics before any buffer changes
        for k, (scale, zp) in params.items():
            p, role, e = _parse_obs_key(k)
            if self._qspecs[role].two_level:
                self._buffers[f"{p}_{role}_tensor_scale"][e].copy_(scale.reshape(()))
                continue
            shape = self._expert_static_shape(p, role)
            buf = self._buffers[f"{p}_{role}_scale"]
            buf[e].copy_(scale.reshape(shape).to(buf.device))
            if zp is not None:
                self._buffers[f"{p}_{role}_zero_point"][e].copy_(zp.reshape(shape).to(buf.device))
        self._calibrated.update(_parse_obs_key(k)[1] for k in params)

    # -- forward -------------------------------------------------------------------------------------------

    def _gate(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def _expert(self, x: torch.Tensor, e: int, gu, down) -> torch.Tensor:
        h = F.linear(self._qact_e(x, "gate_up_proj", "input", e), gu(e))
        h = self._gate(self._qact_e(h, "gate_up_proj", "output", e))
        y = F.linear(self._qact_e(h, "down_proj", "input", e), down(e))
        return self._qact_e(y, "down_proj", "output", e)

    def _expert_weights(self, proj: str):
        """``e -> expert e's [out, in] weight``: a frozen module dequantizes the experts that are hit only (unless
        ``keep_dequantized``)."""
        if self._qmode == _FROZEN and not getattr(self, "keep_dequantized", False):
            return lambda e: self._frozen_dense_e(proj, e)
        w = self._proj(proj)
        return lambda e: w[e]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,  # type: ignore[override]
                top_k_weights: torch.Tensor) -> torch.Tensor:
        n = self.expert_shape(EXPERT_PROJS[0])[0]
        gu, down = self._expert_weights("gate_up_proj"), self._expert_weights("down_proj")
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=n + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        every = self._observers is not None and self.calibrate_all_experts
        experts = range(n) if every else [int(e[0]) for e in hit]
        for e in experts:
            if e == n:
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            if every:  # calibration: every token through every expert (statistics); the routed rows are kept
                y = self._expert(hidden_states, e, gu, down)[token_idx]
            else:
                y = self._expert(hidden_states[token_idx], e, gu, down)
            y = y * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, y.to(final.dtype))
        return final

    def extra_repr(self) -> str:  # type: ignore[override]
        roles = ", ".join(f"{r}={self._qspecs[r].name or self._qspecs[r].dtype.name}"
                          + ("(dyn)" if r in ("input", "output") and getattr(self.qconfig, r).dynamic else "")
                          for r in ("weight", "input", "output") if r in self._qspecs)
        roles += "".join(f", {p}.weight={tc.spec.name or tc.spec.dtype.name}" for p, tc in self.proj_weights)
        shapes = {p: list(self.expert_shape(p)) for p in EXPERT_PROJS}
        return f"experts={shapes}, quant=[{roles}], qmode={self._qmode}"


def _proj_weight_specs(module: nn.Module, config: LayerConfig, name: str, proj_weights) -> dict:
    """``{proj: (TensorConfig, spec)}`` of ``QuantExperts.from_module``'s ``proj_weights``, checked: a projection's
    own weight spec is a GGUF type, as is the config's weight spec, and fits each expert's rows."""
    items = list(proj_weights.items()) if isinstance(proj_weights, Mapping) else list(proj_weights or ())
    out = {}
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"experts {name!r}: proj_weights must map a projection to a TensorConfig, got {item!r}")
        proj, tc = item
        if proj not in EXPERT_PROJS:
            raise ValueError(f"experts {name!r}: proj_weights names {proj!r}; the projections are {list(EXPERT_PROJS)}")
        if not isinstance(tc, TensorConfig):
            tc = LayerConfig(weight=tc).weight  # a QuantSpec or format name, as LayerConfig takes it
        if config.weight is None or not config.weight.spec.gguf or not tc.spec.gguf:
            raise ValueError(f"experts {name!r}: proj_weights gives {proj} its own weight spec ({tc.spec.name}); a "
                             f"projection takes its own spec only when it and the experts' weight spec "
                             f"({'none' if config.weight is None else config.weight.spec.name}) are GGUF types")
        if proj in out:
            raise ValueError(f"experts {name!r}: proj_weights names {proj!r} twice")
        out[proj] = (tc, experts_weight_spec(module, LayerConfig(weight=tc), name, proj))
    return out


def _gguf_cat(qs: list) -> "qcore.QTensor":
    """GGUF-spec QTensors of consecutive rows (torch parts) as one."""
    if len(qs) == 1:
        return qs[0]
    from qcore._kquants import GGUFScales

    def cat(vals):
        return None if vals[0] is None else torch.cat(vals)
    ss = [q.super_scales for q in qs]
    return qcore.QTensor(cat([q.codes for q in qs]), cat([q.scales for q in qs]), None, qs[0].spec, None, None,
                         cat([q.offsets for q in qs]),
                         GGUFScales(*(cat([getattr(x, f.name) for x in ss]) for f in dataclasses.fields(ss[0]))))


def _gguf_expert(q, a: int, b: int) -> "qcore.QTensor":
    """Rows ``a:b`` (one expert's ``[out, in]``) of a GGUF-spec QTensor of all experts' rows ``[E * out, in]``."""
    from qcore._kquants import GGUFScales

    ss = q.super_scales
    return qcore.QTensor(q.codes[a:b], q.scales[a:b], None, q.spec, None, None,
                         None if q.offsets is None else q.offsets[a:b],
                         GGUFScales(*(None if getattr(ss, f.name) is None else getattr(ss, f.name)[a:b]
                                      for f in dataclasses.fields(ss))))


def _obs_key(proj: str, role: str, e: int) -> str:
    return f"{proj}.{role}.{e:06d}"


def _parse_obs_key(k: str) -> tuple:
    p, r, e = k.split(".")
    return p, r, int(e)


def _qtensor_from_parts(pt, spec: QuantSpec) -> "qcore.QTensor":
    """A ``QTensor`` of ``spec`` from one weight's ``WeightParts`` (numpy: codes, float32 scales, ...)."""
    codes = torch.from_numpy(np.ascontiguousarray(pt.codes))
    if isinstance(spec.dtype, FloatDType):
        codes = codes.to(torch.uint8)
    return qcore.QTensor(codes=codes, scales=torch.from_numpy(np.ascontiguousarray(pt.scales, np.float32)),
                         zero_points=None if pt.zero_points is None else
                         torch.from_numpy(np.ascontiguousarray(pt.zero_points, np.float32)),
                         spec=spec, subblock_shifts=None if pt.shifts is None else
                         torch.from_numpy(np.ascontiguousarray(pt.shifts)).to(torch.int32),
                         tensor_scale=None if pt.tensor_scale is None else
                         torch.from_numpy(np.asarray(pt.tensor_scale, np.float32).reshape(())))


def _to_device(q, device) -> "qcore.QTensor":
    def mv(t):
        return None if t is None else t.to(device)
    return qcore.QTensor(codes=mv(q.codes), scales=mv(q.scales), zero_points=mv(q.zero_points), spec=q.spec,
                         subblock_shifts=mv(q.subblock_shifts), tensor_scale=mv(q.tensor_scale))


def is_fused_experts(m: nn.Module) -> bool:
    """Whether ``m`` is a fused experts module ``QuantExperts`` can quantize (float; see ``experts_layout_problem``)."""
    return (not isinstance(m, _QuantMixin) and type(m).__name__.endswith("Experts") and isinstance(
        m._parameters.get("gate_up_proj"), torch.Tensor) and experts_layout_problem(m) is None)


def quantizable_type(m: nn.Module) -> Optional[str]:
    """The config's type name of module ``m`` (``"Linear"``, ``"Conv2d"``, ..., ``"Conv1D"``; ``"Experts"`` for fused
    MoE experts of a known layout and ``QuantExperts``), or None for a module qcore does not quantize (a subclass of
    a supported type included: only the exact classes of ``QUANT_CLASSES``)."""
    if isinstance(m, QuantExperts) or is_fused_experts(m):
        return "Experts"
    return next((c.__name__ for c in QUANT_CLASSES if type(m) is c), None)

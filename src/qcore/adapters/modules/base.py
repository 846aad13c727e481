"""``QuantModule``: the state and machinery every quantized wrapper shares (the specs of its roles, weights
quantized in place / for QAT / frozen as packed codes, static and dynamic activations, calibration, the GGUF block
bytes), and the public accessors exporters, importers and algorithms read a quantized module through
(``specs``, ``effective``, ``scales``, ...). Module state lives here (and in the wrappers of this package) only."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Optional

import numpy as np
import torch
from torch import nn

import qcore
from qcore import PerChannel, PerGroup, PerTensor, QuantSpec
from qcore import _kquants
from qcore.dtypes import FloatDType
from qcore.quantize import check_qtensor

from .. import triton as kernels
from ..config import LayerConfig
from .granularity import activation_granularity, weight_granularity, with_granularity
from .gguf_parts import gguf_numpy, gguf_qtensor
from .observers import Observer, quantize_observed

__all__ = ["QuantModule", "StoredScales", "is_quantized_module", "fake_quantize_dispatch", "dequantize_dispatch",
           "PENDING", "INPLACE", "QAT", "FROZEN"]

#: a quantized module's modes: pending (fake-quantized on the fly), in place (committed), QAT, frozen (packed codes)
PENDING, INPLACE, QAT, FROZEN = "pending", "inplace", "qat", "frozen"


class QuantModule:
    """The base class of every quantized wrapper (``QuantLinear``, ``QuantConv2d``, ..., ``QuantExperts``): state and
    helpers shared by the wrappers. Module state lives here only (adapters hold module state)."""

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
            g = weight_granularity(config.weight.spec.granularity, kind, name, w.dim(), canon_shape)
            plan["weight"] = with_granularity(config.weight.spec, g)
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
            plan["bias"] = with_granularity(config.bias.spec, g if isinstance(g, PerTensor) else
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
            plan[role] = with_granularity(tc.spec, activation_granularity(g, cls._conv))
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
        self._qmode = QAT if qat else PENDING
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
        return quantize_observed(x, self._qspecs[role], getattr(self.qconfig, role).observer)

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
                kept[role] = gguf_numpy(ss)

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
        if mode == INPLACE or (mode == FROZEN and role == "bias"):  # a frozen module's bias stays quantized in place
            ver = self._wver if role == "weight" else self._bver
            if ver != (p._version, p.data_ptr()):
                self._inplace_quantize(role)
            return p
        if mode == QAT and torch.is_grad_enabled() and p.requires_grad:
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
            if mode == QAT:
                self._keep_params(role, q)
        return cache[role][1]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)  # type: ignore[misc]
        for role in ("input", "output"):  # static scales loaded from a checkpoint count as calibrated
            if any(f"{prefix}{role}_{k}" in state_dict for k in ("scale", "tensor_scale")):
                self._calibrated.add(role)
        if self._qmode not in (INPLACE, FROZEN):
            return
        for role in ("weight", "bias") if self._qmode == INPLACE else ("bias",):
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
        if self._qmode != PENDING:
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
        self._qmode = INPLACE
        self.__dict__.pop("_gguf_importance", None)  # used: the weight is written with it

    def replace_weight(self, q: "qcore.QTensor") -> None:
        """Write an already quantized weight (a ``QTensor`` of this module's weight spec in the canonical layout)
        into a committed (in-place) module, with its scales, as ``commit(weight=q)`` does for a pending one: e.g.
        the weights a training pass re-rounded (``qcore.adapters.passes.distill``). Tied modules each take it."""
        if self._qmode != INPLACE:
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
            y = fake_quantize_dispatch(v, spec)
        elif self._observers is not None:
            self._observers[role].update(v)
            return x
        elif spec.two_level:
            ts = self._buffers[f"{role}_tensor_scale"]
            if role not in self._calibrated:
                raise RuntimeError(self._uncalibrated(role))
            y = fake_quantize_dispatch(v, spec, tensor_scale=ts)
        else:
            s = self._buffers[f"{role}_scale"]
            if role not in self._calibrated:
                raise RuntimeError(self._uncalibrated(role))
            zp = self._buffers.get(f"{role}_zero_point")
            y = fake_quantize_dispatch(v, spec, scale=self._scale_view(s, v),
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
        self._observers = {r: Observer(getattr(self.qconfig, r), self._qspecs[r], f"{self.qname!r} ({r})")
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
        return self._qmode == FROZEN

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
        if self._qmode == FROZEN or "weight" not in self._qspecs:
            return
        if self._qmode == PENDING:
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
        self._qmode = FROZEN
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

        x = wc.detach().cpu().numpy().astype(np.float32)
        bits = torch.int16 if w.element_size() == 2 else torch.int32

        def same(q) -> bool:  # the blocks give the module's weight bit for bit (in its dtype)
            back = self._uncanon(torch.from_numpy(np.asarray(qcore.dequantize(q))).to(w.device)).to(w.dtype)
            return torch.equal(back.view(bits), w.view(bits))
        kept = self.__dict__.get("_gguf_kept", {}).get("weight")
        q = None
        if kept is not None and kept.d.shape[:-1] == x.shape[:-1]:
            q = gguf_qtensor(_kquants.requantize(x, kept, spec.gguf), kept, spec)
        if (q is None or not same(q)) and self.__dict__.get("_gguf_importance") is not None \
                and self._qmode in (PENDING, QAT) and "weight" in self._parameters:
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
        self._qmode = FROZEN

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
        if self._qmode == FROZEN:
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
        self._qmode = FROZEN
        self.__dict__.pop("_dequantized", None)
        try:  # the parts against the spec, as the first forward would check them (pow2 scales, shifts, ...)
            check_qtensor(self._frozen_qtensor())
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
        return self._uncanon(dequantize_dispatch(self._frozen_qtensor())).to(self._frozen_meta["dtype"])

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
        if self._qmode != FROZEN or (x.requires_grad and torch.is_grad_enabled()):
            return None
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
        if self._qmode == FROZEN:
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
    """The scale tensors a quantized module stores for one role (``QuantModule.scales``); None: not stored."""

    scale: Optional[torch.Tensor]
    zero_point: Optional[torch.Tensor]
    tensor_scale: Optional[torch.Tensor]
    subblock_shifts: Optional[torch.Tensor]


class _Kept(NamedTuple):
    """The scales of a fake-quantized parameter (what ``_keep_params`` stores as buffers)."""

    scales: Any
    zero_points: Any
    tensor_scale: Any
    super_scales: Any = None  # GGUF specs: llama.cpp's stored scales


def fake_quantize_dispatch(x: torch.Tensor, spec: QuantSpec, **kw) -> torch.Tensor:
    """``qcore.fake_quantize(x, spec, **kw)``, computed by its Triton twin (same bits) when x is on a GPU with
    Triton (``qcore.adapters.triton.available``), the spec is covered and no gradient is needed."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        if kernels.available(x) and kernels.supports(spec, ndim=x.dim(), given_scale=kw.get("scale") is not None):
            return kernels.fake_quantize(x, spec, **kw)
    return qcore.fake_quantize(x, spec, **kw)


def dequantize_dispatch(q) -> torch.Tensor:
    """``qcore.dequantize(q)``, by its Triton twin (same bits) when the codes are on a GPU with Triton."""
    if kernels.available(q.codes) and kernels.supports(q.spec, ndim=q.codes.dim()):
        return kernels.dequantize(q)
    return qcore.dequantize(q)


def _ste(x: torch.Tensor, fq: torch.Tensor) -> torch.Tensor:
    """``fq`` in the forward, identity gradient to ``x`` in the backward."""
    return x + (fq.to(x.dtype) - x).detach()


def is_quantized_module(m: nn.Module) -> bool:
    return isinstance(m, QuantModule)

"""Fused MoE experts (transformers 5: all experts of a layer in two 3-D parameters; issue 22): ``QuantExperts``,
each expert's ``[out, in]`` slice of each projection quantized as a Linear weight; the layouts qcore knows
(``KNOWN_EXPERTS``, ``experts_layout_problem``, ``is_fused_experts``) and the weight spec of an expert's slice
(``experts_weight_spec``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Mapping, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import qcore
from qcore import PerTensor, QuantSpec
from qcore import _kquants
from qcore._kquants import GGUFScales
from qcore.dtypes import FloatDType
from qcore.quantize import check_qtensor

from ..config import LayerConfig, TensorConfig
from .base import FROZEN, INPLACE, PENDING, QuantModule, dequantize_dispatch, fake_quantize_dispatch
from .granularity import activation_granularity, weight_granularity, with_granularity
from .gguf_parts import gguf_cat, gguf_numpy, gguf_qtensor
from .observers import Observer, quantize_observed

__all__ = ["EXPERT_PROJS", "KNOWN_EXPERTS", "QuantExperts", "experts_layout_problem", "experts_weight_spec",
           "is_fused_experts"]

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
    g = weight_granularity(config.weight.spec.granularity, "experts", f"{name}.{proj}", 2, tuple(w.shape[1:]))
    return with_granularity(config.weight.spec, g)


class QuantExperts(QuantModule):
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
        q = QuantModule.from_module.__func__(qcls, module, config, name=name, qat=False)
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
                plan[role] = with_granularity(tc.spec, activation_granularity(tc.spec.granularity, False))
        return plan

    def _qinit(self, config: LayerConfig, name: str, plan: dict, qat: bool) -> None:
        self.qconfig = config
        self.qname = name
        self._qspecs = plan
        self._wspecs = {p: plan["weight"] for p in EXPERT_PROJS} if "weight" in plan else {}  # weight_spec(proj)
        self._proj_tcs: dict = {}  # projections with their own weight spec (proj_weights)
        self._qmode = PENDING
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

    def expert_static_scale_shape(self, proj: str, role: str) -> tuple:
        """The shape of one expert's static scale of activation ``role`` (``"input"`` / ``"output"``) of
        ``proj``: ``()`` per tensor, ``(features,)`` per feature (the buffers hold one per expert in front)."""
        if proj not in EXPERT_PROJS:
            raise ValueError(f"expert_static_scale_shape: proj must be one of {list(EXPERT_PROJS)}, got {proj!r}")
        if role not in ("input", "output") or role not in self._qspecs:
            raise ValueError(f"expert_static_scale_shape: {self.qname!r} quantizes no activation role {role!r}; its "
                             f"roles: {list(self._qspecs)}")
        return self._expert_static_shape(proj, role)

    # -- weights -------------------------------------------------------------------------------------------

    def _quantize_slice(self, w: torch.Tensor, proj: str = "gate_up_proj"):
        """QTensor of one expert's [out, in] slice of ``proj``, as ``QuantLinear`` quantizes its weight (float32
        math); a GGUF spec by llama.cpp's search (``qcore.quantize``)."""
        spec = self._wspecs[proj]
        if spec.gguf:
            return qcore.quantize(w.detach().float(), spec)
        return quantize_observed(w.detach(), spec, self.qconfig.weight.observer)

    def _fq_proj(self, w: torch.Tensor, proj: str) -> tuple[torch.Tensor, list]:
        spec = self._wspecs[proj]
        imp = (self.__dict__.get("_gguf_importance") or {}).get(proj) if spec.gguf else None
        if imp is not None:  # quantize_model(..., imatrix=): each expert (gate and up rows apart) with its importance
            e_, o, i = w.shape
            k = imp.shape[1]
            qs = [gguf_cat([qcore.quantize(w[e, h * (o // k):(h + 1) * (o // k)].detach().float(), spec,
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
            ss = [gguf_numpy(q.super_scales) for q in qs]
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
        if self._qmode == FROZEN:
            return self._frozen_proj(proj)
        p = self._parameters[proj]
        if "weight" not in self._qspecs or not self.quant_enabled:
            return p
        if self._qmode == INPLACE:
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
        if self._qmode != PENDING:
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
        self._qmode = INPLACE
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
        if self._qmode != INPLACE or "weight" not in self._qspecs:
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
        if self._qmode == FROZEN:
            return self._frozen_qtensor_e(proj, e)
        if self._qmode == PENDING:
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
        if self._qmode == FROZEN or "weight" not in self._qspecs:
            return
        dtype = self._parameters[EXPERT_PROJS[0]].dtype
        if self._wspecs[EXPERT_PROJS[0]].gguf:
            if self._qmode == PENDING:
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
        self._qmode = FROZEN
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
                    check_qtensor(q)
                except (ValueError, TypeError) as err:
                    raise ValueError(f"load_frozen {self.qname!r}: {p} of expert {e}: {err}") from None
                qts[p].append(q)
        with torch.no_grad():
            for p in EXPERT_PROJS:
                self._parameters.pop(p, None)
                self._store_frozen(p, [_to_device(q, device) for q in qts[p]])
        self._frozen_meta = {"shapes": shapes, "dtype": dtype}
        self._qmode = FROZEN
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
        if self._qmode == FROZEN:
            return self._buffers[f"{proj}_packed"].detach().cpu().numpy()
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
            kept = GGUFScales(*(None if v is None else v.reshape(e_ * o, -1) for v in dataclasses.astuple(kept)))
            q = gguf_qtensor(_kquants.requantize(x, kept, spec.gguf), kept, spec)
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
        self._qmode = FROZEN

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
        return dequantize_dispatch(self._frozen_qtensor_e(proj, e)).to(dtype)

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
            return fake_quantize_dispatch(x, spec).to(x.dtype)
        if self._observers is not None:
            self._observers[_obs_key(proj, role, e)].update(x)
            return x
        if role not in self._calibrated:
            raise RuntimeError(self._uncalibrated(role))
        if spec.two_level:
            ts = self._buffers[f"{proj}_{role}_tensor_scale"][e]
            return fake_quantize_dispatch(x, spec, tensor_scale=ts).to(x.dtype)
        s = self._buffers[f"{proj}_{role}_scale"][e]
        zp = self._buffers.get(f"{proj}_{role}_zero_point")
        return fake_quantize_dispatch(x, spec, scale=self._scale_view(s, x),
                                      zero_point=None if zp is None else self._scale_view(zp[e], x)).to(x.dtype)

    def start_calibration(self) -> None:
        n = self.expert_shape(EXPERT_PROJS[0])[0]
        self._observers = {_obs_key(p, r, e): Observer(getattr(self.qconfig, r), self._qspecs[r],
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
        if self._qmode == FROZEN and not getattr(self, "keep_dequantized", False):
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


def _gguf_expert(q, a: int, b: int) -> "qcore.QTensor":
    """Rows ``a:b`` (one expert's ``[out, in]``) of a GGUF-spec QTensor of all experts' rows ``[E * out, in]``."""
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
    return (not isinstance(m, QuantModule) and type(m).__name__.endswith("Experts") and isinstance(
        m._parameters.get("gate_up_proj"), torch.Tensor) and experts_layout_problem(m) is None)

"""Export a quantized model as one ONNX file that onnxruntime runs: ``export_onnx``.

Two graph sources:

- **Decoder LLMs** (transformers Llama-like families: ``model_type`` ``llama`` (SmolLM2 is one), ``mistral``,
  ``qwen2``, ``qwen3``: biases, Qwen3's per-head q/k norms and sliding-window layers included): the graph is built
  directly from the model's config with standard ONNX ops (as onnxruntime-genai's builder does), with a KV cache.
  Inputs ``input_ids`` int64 ``[batch, seq]``, ``attention_mask`` int64 ``[batch, past + seq]``, ``position_ids``
  int64 ``[batch, seq]``, ``past_key_values.{i}.key`` / ``.value`` float32 ``[batch, kv_heads, past, head_dim]``
  (``past`` may be 0); outputs ``logits`` ``[batch, seq, vocab]`` and ``present.{i}.key`` / ``.value``
  ``[batch, kv_heads, past + seq, head_dim]``. Queries attend to keys ``j <= past + i`` where the mask is 1.
- **Any other torch model** (``inputs=`` example inputs; CNNs, BERT, ...): torch's TorchScript exporter
  (``torch.onnx.export(dynamo=False)``) traces the float graph, with each quantized module's weight and
  quantized activations replaced by marker nodes that are then rewritten into DequantizeLinear (weights) and
  QuantizeLinear + DequantizeLinear (static activations) / composed dynamic quantization.

Weights (``qcore.formats.onnx``): QDQ form by default (the codes in their ONNX type, float32 scales, one
DequantizeLinear in the canonical ``[out, in, *kernel]`` layout, exactly ``qcore.dequantize``); with
``weight_format=WeightFormat.MATMULNBITS`` the 4-bit group-quantized Linear weights of the decoder graph become
com.microsoft MatMulNBits nodes (``accuracy_level`` 0 by default: float32 activations). Formats onnxruntime
cannot run (fp4, fp6, MX micro-exponents, NVFP4, ...) raise ValueError naming the tensor, unless
``unsupported=Unsupported.DEQUANTIZE``: then the dequantized float32 weight is written, with a warning, and the
report says so. Biases, norms and every other tensor are float32 as in the model.

Activations: static scales -> QuantizeLinear + DequantizeLinear (round half to even, as qcore); dynamic
symmetric integer / fp8 per-tensor / per-token scales -> composed from standard ops with qcore's arithmetic;
other activation quantizers (asymmetric or per-group dynamic, E8M0 block scales, narrow-range static,
stochastic rounding) are refused, naming the module.

Guarantees: no pickle; everything is validated (and the tensors encoded) before anything is written; the write
is atomic (a hidden temporary sibling renamed into place) and deterministic (the same model gives a byte-identical
file). Models must be float32 (``model.float()``): the ONNX graph computes in float32.
"""

from __future__ import annotations

import enum
import io
import dataclasses
import os
import pathlib
import types
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from qcore.formats import onnx as X
from qcore._fsutil import check_file_destination, model_sources, staged_dir

from .common import canonical_shape, check_destination, export_units, refuse_conv1d, weight_parts, will_rotate_online
from .experts import check_no_experts
from ..batches import as_found
from ..config import ModelConfig
from ..families import FAMILIES, locate, non_language_modules
from ..modules import (QuantConvTranspose2d, QuantEmbedding, QuantEmbeddingBag, QuantLinear, QuantModule,
                       input_rotations)

__all__ = ["export_onnx", "WeightFormat", "Unsupported", "ONNXExportInfo", "TensorReport", "DECODER_TYPES",
           "decoder_logits", "export_onnx_dir", "ONNX_FILE", "check_onnx", "UnsupportedWeightError"]

def decoder_graph_fits(fam) -> bool:
    """Whether the decoder graph (``_Decoder``) computes a family's layers, read off its architecture record
    (``qcore.adapters.families``): a causal LM with RMSNorms (``x * w``) before separate q, k, v projections and
    gate / up projections, an output projection and a down projection, no norms on the block outputs, no experts,
    ``nn.Linear`` projections (per-head q/k norms, biases and sliding-window layers are in the graph)."""
    return (fam.causal and fam.norm == "rms" and len(fam.attn_in) == 3 and len(fam.mlp_in) == 2
            and fam.mlp_out is not None and fam.experts is None and not fam.output_norms and fam.linear == "linear"
            and fam.lm_head is not None and fam.final_norm is not None)


def _decoder_types() -> tuple:
    return tuple(f.model_type for f in FAMILIES if decoder_graph_fits(f))


#: the model types the decoder graph is built for: every record ``decoder_graph_fits`` (Llama, Mistral, Qwen2, Qwen3)
DECODER_TYPES = _decoder_types()


class WeightFormat(enum.Enum):
    """How quantized weights are written: ``QDQ`` (DequantizeLinear; every supported scheme) or ``MATMULNBITS``
    (com.microsoft MatMulNBits for 4-bit group-quantized Linear weights of a decoder graph, QDQ for the rest)."""

    QDQ = "qdq"
    MATMULNBITS = "matmulnbits"


class Unsupported(enum.Enum):
    """What to do with a weight onnxruntime cannot dequantize: ``ERROR`` (ValueError naming it) or ``DEQUANTIZE``
    (write the dequantized float32 weight, warn, report ``how="dequantized"``)."""

    ERROR = "error"
    DEQUANTIZE = "dequantize"


@dataclass(frozen=True)
class TensorReport:
    """One quantized weight in the ONNX file: how it is written, the ONNX element type, and whether onnxruntime's
    dequantization of it equals the in-memory dequantized weight (``max_abs_diff``)."""

    name: str
    how: str  # "qdq", "matmulnbits" or "dequantized"
    onnx_type: str
    exact: bool
    max_abs_diff: float


@dataclass(frozen=True)
class ONNXExportInfo:
    path: str
    bytes_on_disk: int
    graph: str  # "decoder" (built from the config, with KV cache) or "traced" (torch's exporter)
    inputs: tuple = ()
    outputs: tuple = ()
    quantized: tuple = ()  # TensorReport per quantized weight
    activations: tuple = ()  # "module (role): how" per quantized activation

    @property
    def lossless(self) -> bool:
        return all(r.exact and r.how != "dequantized" for r in self.quantized)

    @property
    def dequantized(self) -> tuple:
        return tuple(r.name for r in self.quantized if r.how == "dequantized")


class UnsupportedWeightError(ValueError):
    """A quantized weight onnxruntime cannot dequantize, refused under ``Unsupported.ERROR``. ``option`` is what
    the caller types to write it dequantized instead: the exporter names its own argument; ``convert`` and the
    command line re-raise with theirs (``with_option``), so the one message names what works where it is read."""

    def __init__(self, tensor: str, reason: str, option: str = "unsupported='dequantize'"):
        super().__init__(tensor, reason, option)
        self.tensor, self.reason, self.option = tensor, reason, option

    def __str__(self) -> str:
        return (f"export_onnx: {self.tensor}: {self.reason}; onnxruntime cannot run it. Pass {self.option} to "
                f"write the dequantized float32 weight instead")

    def with_option(self, option: str) -> "UnsupportedWeightError":
        return UnsupportedWeightError(self.tensor, self.reason, option)


def _enum(cls, v, arg):
    if isinstance(v, cls):
        return v
    if isinstance(v, str):
        try:
            return cls(v)
        except ValueError:
            pass
        raise ValueError(f"{arg}={v!r} is not one of {[m.value for m in cls]}")
    raise TypeError(f"{arg} must be a {cls.__name__} or one of {[m.value for m in cls]}, got {v!r}")


def _np32(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _in_memory_weight(m: QuantModule) -> np.ndarray:
    return np.ascontiguousarray(m.effective("weight", canonical=True).float().cpu().numpy())


class _Ctx:
    """One export's state: the graph, the options, the reports."""

    def __init__(self, graph: "X.Graph", weight_format: WeightFormat, unsupported: Unsupported, accuracy_level: int):
        self.g = graph
        self.weight_format = weight_format
        self.unsupported = unsupported
        self.accuracy_level = accuracy_level
        self.reports: list = []
        self.acts: list = []
        self.warned: list = []

    # -- weights ------------------------------------------------------------------------------------------

    def weight(self, name: str, m: QuantModule, *, output: Optional[str] = None) -> str:
        """The float32 canonical weight of quantized module ``m`` (DequantizeLinear, or the dequantized floats)."""
        spec = m.specs["weight"]
        ref = _in_memory_weight(m)
        if not m.quant_enabled:  # quantization switched off: the module computes with its float weight
            return self.g.init(f"{name}.weight", ref) if output is None else self.g.node(
                "Identity", [self.g.init(f"{name}.weight", ref)], f"{name}_weight", outputs=[output])
        reason = X.unsupported_reason(spec)
        if reason is None:
            parts, shape = weight_parts(m)
            try:
                vals = X.weight_onnx_values(parts, spec, shape)
            except ValueError as e:
                reason = str(e)
        if reason is not None:
            if self.unsupported is Unsupported.ERROR:
                raise UnsupportedWeightError(f"{name}.weight", reason)
            self.warned.append(f"{name}.weight")
            self.reports.append(TensorReport(f"{name}.weight", "dequantized", "FLOAT", True, 0.0))
            if output is None:
                return self.g.init(f"{name}.weight", ref)
            self.g.node("Identity", [self.g.init(f"{name}.weight", ref)], f"{name}_weight",
                        outputs=[output])
            return output
        diff = float(np.max(np.abs(vals.astype(np.float64) - ref), initial=0.0))
        exact = bool(np.array_equal(vals, ref))
        if not exact:
            raise RuntimeError(f"export_onnx: {name}.weight: DequantizeLinear of the written codes differs from the "
                               f"in-memory weight by {diff:.3g} (a qcore bug; please report it)")
        self.reports.append(TensorReport(f"{name}.weight", "qdq", X.ONNX_TYPES[spec.dtype.name], exact, diff))
        return X.weight_qdq(self.g, name, parts, spec, shape, output=output)

    # -- activations --------------------------------------------------------------------------------------

    def act(self, name: str, m: QuantModule, role: str, x: str, *, axis: int) -> str:
        if role not in m.specs or not m.quant_enabled:
            return x
        spec = m.specs[role]
        tc = getattr(m.qconfig, role)
        where = f"{name} ({role})"
        if not tc.calibrated:
            r = X.activation_reason(spec, dynamic=True)
            if r:
                raise ValueError(f"export_onnx: {where}: {r}")
            self.acts.append(f"{where}: dynamic {spec.name or spec.dtype.name} "
                             f"{'per-token' if type(spec.granularity).__name__ == 'PerChannel' else 'per-tensor'}")
            return X.dynamic_qdq(self.g, f"{name}_{role}", x, spec)
        r = X.activation_reason(spec, dynamic=False)
        if r:
            raise ValueError(f"export_onnx: {where}: {r}")
        if spec.two_level:
            raise ValueError(f"export_onnx: {where}: two-level activation scales have no ONNX operator")
        if not m.is_calibrated(role):
            raise ValueError(f"export_onnx: {where}: static scales are not calibrated; run quantize_model with "
                             f"calibration data first")
        b = m.scales(role)
        s = _np32(b.scale)
        zp = b.zero_point
        self.acts.append(f"{where}: static {spec.name or spec.dtype.name} QDQ")
        return X.activation_qdq(self.g, f"{name}_{role}", x, spec, s, None if zp is None else _np32(zp), axis=axis)


def _check_module(name: str, m: QuantModule, ctx: _Ctx) -> None:
    """Validate ``m``'s activation roles before any work (weights are checked when encoded, still before writing)."""
    if not m.quant_enabled:
        return
    _check_roles(name, m.qconfig, ctx.unsupported)
    for role in ("input", "output"):
        tc = getattr(m.qconfig, role)
        if role in m.specs and tc.calibrated and not m.is_calibrated(role):
            raise ValueError(f"export_onnx: {name} ({role}): static scales are not calibrated; run "
                             f"quantize_model with calibration data first")


def _check_roles(name: str, lc: Any, unsupported: Unsupported) -> None:
    """The formats of one module's ``LayerConfig`` that onnxruntime cannot run (the one rule for ``export_onnx``
    and ``check_onnx``)."""
    for role in ("input", "output"):
        tc = getattr(lc, role)
        if tc is not None:
            r = X.activation_reason(tc.spec, dynamic=not tc.calibrated)
            if r:
                raise ValueError(f"export_onnx: {name} ({role}): {r}")
    if lc.weight is not None and unsupported is Unsupported.ERROR:
        r = X.unsupported_reason(lc.weight.spec)
        if r:
            raise UnsupportedWeightError(f"{name}.weight", r)


def _check_float32(model: nn.Module) -> None:
    bad = [n for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float32]
    bad += [n for n, b in model.named_buffers() if b.is_floating_point() and b.dtype not in (torch.float32,)
            and not n.endswith(("_scale", "_zero_point"))]
    for n, m in model.named_modules():
        if isinstance(m, QuantModule) and m.frozen and m.weight_dtype != torch.float32:
            bad.append(f"{n}.weight")
    if bad:
        raise ValueError(f"export_onnx: the ONNX graph computes in float32; {bad[0]!r} is not float32 "
                         f"(convert with model.float() first)")


def _check_graph_kind(model: nn.Module, inputs: Any, wf: WeightFormat) -> bool:
    """True for the decoder graph, False for the traced one; ValueError where neither applies."""
    cfg = getattr(model, "config", None)
    if inputs is None and cfg is not None and getattr(cfg, "model_type", None) in DECODER_TYPES:
        return True
    if inputs is None:
        raise ValueError(f"export_onnx: inputs= (example inputs for torch's tracer) is needed for a "
                         f"{type(model).__name__} (model_type {getattr(cfg, 'model_type', None)!r}); the "
                         f"decoder graph is built for {list(DECODER_TYPES)}")
    if wf is WeightFormat.MATMULNBITS:
        raise ValueError("export_onnx: weight_format='matmulnbits' applies to the decoder graph; traced models "
                         "are written in QDQ form")
    return False


def check_onnx(model: nn.Module, config: Optional[Any] = None, *, inputs: Any = None,
               weight_format: Union[WeightFormat, str] = WeightFormat.QDQ,
               unsupported: Union[Unsupported, str] = Unsupported.ERROR, plans=None) -> None:
    """Before any work: ValueError if ``export_onnx`` would refuse ``model`` quantized with ``config`` (default
    ``model.qcore_config``) for reasons the model and the config already decide: not float32, no graph for its
    architecture without ``inputs``, formats onnxruntime cannot run (``qcore quantize --export onnx`` calls it
    before the baseline evaluation; ``export_onnx`` runs the same checks)."""
    wf = _enum(WeightFormat, weight_format, "weight_format")
    un = _enum(Unsupported, unsupported, "unsupported")
    refuse_conv1d(model, config if config is not None else getattr(model, "qcore_config", None), "export_onnx")
    check_no_experts(model, config if config is not None else getattr(model, "qcore_config", None),
                     who="export_onnx")  # fused MoE experts: not written yet (docs/adapters.md)
    _check_float32(model)
    if _check_graph_kind(model, inputs, wf):
        _check_decoder(model)
    config = config if config is not None else getattr(model, "qcore_config", None)
    if not isinstance(config, ModelConfig):
        return
    if inputs is None and will_rotate_online(model, config):
        raise ValueError("export_onnx: the model carries online rotations; the ONNX decoder graph does not "
                         "apply them")
    for u in export_units(model, config, plans=plans):
        _check_roles(u.name, u.config, un)


# ---------------------------------------------------------------------------------------------------------------
# decoder graph (Llama family), built from the config
# ---------------------------------------------------------------------------------------------------------------


class _Decoder:
    def __init__(self, model: nn.Module, ctx: _Ctx):
        self.model, self.ctx, self.g = model, ctx, ctx.g
        self.loc = locate(model, what="export_onnx")  # names from the architecture record
        cfg = model.config
        self.cfg = cfg
        self.nh = int(cfg.num_attention_heads)
        self.nkv = int(getattr(cfg, "num_key_value_heads", None) or self.nh)
        self.hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh)
        self.eps = float(cfg.rms_norm_eps)
        self.floats: dict = {}  # id(parameter) -> initializer name

    def c(self, base, v, dt=np.float32):
        return self.g.const(base, v, dt)

    def float_param(self, name: str, p: torch.Tensor, *, transpose: bool = False) -> str:
        key = (id(p), transpose)
        if key not in self.floats:
            a = _np32(p)
            self.floats[key] = self.g.init(name, np.ascontiguousarray(a.T if transpose else a))
        return self.floats[key]

    def linear(self, name: str, m: nn.Linear, x: str) -> str:
        g, ctx = self.g, self.ctx
        if not isinstance(m, QuantModule):
            y = g.node("MatMul", [x, self.float_param(f"{name}.weight.T", m.weight, transpose=True)], f"{name}_MatMul")
            if m.bias is not None:
                y = g.node("Add", [y, self.float_param(f"{name}.bias", m.bias)], f"{name}_Add")
            return y
        if type(m) is not QuantLinear:
            raise ValueError(f"export_onnx: {name} is a {type(m).__name__}; the decoder graph expects Linear layers")
        x = ctx.act(name, m, "input", x, axis=-1)
        bias = None
        if m.bias is not None:
            bias = self.g.init(f"{name}.bias", _np32(m.effective("bias")))
        if "weight" not in m.specs or not m.quant_enabled:
            y = g.node("MatMul", [x, self.float_param(f"{name}.weight.T", m.weight, transpose=True)], f"{name}_MatMul")
        else:
            spec = m.specs["weight"]
            shape = canonical_shape(m)
            if (ctx.weight_format is WeightFormat.MATMULNBITS and X.matmulnbits_block(spec, shape) is not None):
                parts, _ = weight_parts(m)
                ref = _in_memory_weight(m)
                vals = X.weight_onnx_values(parts, spec, shape)
                ctx.reports.append(TensorReport(f"{name}.weight", "matmulnbits", X.ONNX_TYPES[spec.dtype.name],
                                                bool(np.array_equal(vals, ref)),
                                                float(np.max(np.abs(vals.astype(np.float64) - ref), initial=0.0))))
                y = X.matmulnbits(g, name, parts, spec, shape, x, bias=bias, accuracy_level=ctx.accuracy_level)
                return ctx.act(name, m, "output", y, axis=-1)
            w = ctx.weight(name, m)
            wt = g.node("Transpose", [w], f"{name}_Transpose", perm=[1, 0])
            y = g.node("MatMul", [x, wt], f"{name}_MatMul")
        if bias is not None:
            y = g.node("Add", [y, bias], f"{name}_Add")
        return ctx.act(name, m, "output", y, axis=-1)

    def window(self, i: int) -> Optional[int]:
        """The sliding window of layer ``i`` (keys ``j > i - window`` only), or None for full attention."""
        cfg = self.cfg
        w = getattr(cfg, "sliding_window", None)
        types_ = getattr(cfg, "layer_types", None)
        if w is None or (types_ is not None and types_[i] != "sliding_attention") or \
                (types_ is None and cfg.model_type != "mistral"):
            return None
        return int(w)

    def rmsnorm(self, name: str, m: nn.Module, x: str) -> str:
        g = self.g
        eps = float(getattr(m, "variance_epsilon", getattr(m, "eps", self.eps)))
        sq = g.node("Mul", [x, x], f"{name}_Square")
        var = g.node("ReduceMean", [sq, self.c(f"{name}_axes", [-1], np.int64)], f"{name}_Mean", keepdims=1)
        var = g.node("Add", [var, self.c(f"{name}_eps", np.float32(eps))], f"{name}_AddEps")
        r = g.node("Reciprocal", [g.node("Sqrt", [var], f"{name}_Sqrt")], f"{name}_Rsqrt")
        y = g.node("Mul", [x, r], f"{name}_Normalize")
        return g.node("Mul", [self.float_param(f"{name}.weight", m.weight), y], f"{name}_Scale")

    def build(self) -> tuple[list, list]:
        g, ctx, model, cfg = self.g, self.ctx, self.model, self.cfg
        o = __import__("onnx")
        T = o.TensorProto
        h = o.helper
        nl = int(cfg.num_hidden_layers)
        names_in = ["input_ids", "attention_mask", "position_ids"]
        g.inputs += [h.make_tensor_value_info("input_ids", T.INT64, ["batch", "seq"]),
                     h.make_tensor_value_info("attention_mask", T.INT64, ["batch", "total"]),
                     h.make_tensor_value_info("position_ids", T.INT64, ["batch", "seq"])]
        for n in names_in:
            g.reserve(n)
        for i in range(nl):
            for kv in ("key", "value"):
                n = g.reserve(f"past_key_values.{i}.{kv}")
                names_in.append(n)
                g.inputs.append(h.make_tensor_value_info(n, T.FLOAT, ["batch", self.nkv, "past", self.hd]))
        loc, fam = self.loc, self.loc.family
        base = model.get_submodule(loc.prefix) if loc.prefix else model
        # embeddings
        emb = model.get_submodule(loc.embed)
        if isinstance(emb, QuantModule) and "weight" in emb.specs:
            table = ctx.weight(loc.embed, emb)
            tied_out = table
        else:
            table = self.float_param(f"{loc.embed}.weight", emb.weight)
            tied_out = None
        x = g.node("Gather", [table, "input_ids"], "embed_Gather", axis=0)
        if isinstance(emb, QuantModule):
            x = ctx.act(loc.embed, emb, "output", x, axis=-1)
        # rotary tables [batch, 1, seq, hd]
        rot = base.rotary_emb
        inv = _np32(rot.inv_freq).reshape(-1)
        pos = g.node("Cast", ["position_ids"], "pos_Cast", to=T.FLOAT)
        pos = g.node("Unsqueeze", [pos, self.c("pos_axes", [-1], np.int64)], "pos_Unsqueeze")
        fr = g.node("Mul", [pos, self.c("inv_freq", inv)], "rope_Freqs")
        embf = g.node("Concat", [fr, fr], "rope_Concat", axis=-1)
        cos = g.node("Cos", [embf], "rope_Cos")
        sin = g.node("Sin", [embf], "rope_Sin")
        sc = float(getattr(rot, "attention_scaling", 1.0))
        if sc != 1.0:
            cos = g.node("Mul", [cos, self.c("rope_scaling", np.float32(sc))], "rope_CosScale")
            sin = g.node("Mul", [sin, self.c("rope_scaling", np.float32(sc))], "rope_SinScale")
        ax1 = self.c("axis1", [1], np.int64)
        cos = g.node("Unsqueeze", [cos, ax1], "rope_CosU")
        sin = g.node("Unsqueeze", [sin, ax1], "rope_SinU")
        # mask [batch, 1, 1, seq, total] (bool): key j visible to query i iff j <= past + i and mask[j] == 1
        shp = g.node("Shape", ["input_ids"], "ids_Shape")
        seq = g.node("Gather", [shp, self.c("i1", 1, np.int64)], "seq_len", axis=0)
        tot = g.node("Gather", [g.node("Shape", ["attention_mask"], "mask_Shape"), self.c("i1b", 1, np.int64)],
                     "total_len", axis=0)
        past = g.node("Sub", [tot, seq], "past_len")
        qi = g.node("Range", [past, tot, self.c("one64", 1, np.int64)], "q_Range")
        kj = g.node("Range", [self.c("zero64", 0, np.int64), tot, self.c("one64b", 1, np.int64)], "k_Range")
        causal = g.node("LessOrEqual", [g.node("Unsqueeze", [kj, self.c("ax0", [0], np.int64)], "k_U"),
                                        g.node("Unsqueeze", [qi, self.c("axm1", [-1], np.int64)], "q_U")], "causal")
        pad = g.node("Cast", ["attention_mask"], "mask_Bool", to=T.BOOL)
        pad = g.node("Unsqueeze", [pad, self.c("ax123", [1, 2, 3], np.int64)], "mask_U")
        allowed = g.node("And", [causal, pad], "mask_And")
        windows = {}  # sliding-window layers (Mistral, Qwen2/3 "sliding_attention"): also j > i - window
        for w in sorted({w for w in (self.window(i) for i in range(nl)) if w is not None}):
            dist = g.node("Sub", [g.node("Unsqueeze", [qi, self.c(f"w{w}_axm1", [-1], np.int64)], f"w{w}_qU"),
                                  g.node("Unsqueeze", [kj, self.c(f"w{w}_ax0", [0], np.int64)], f"w{w}_kU")],
                          f"w{w}_Dist")
            near = g.node("Less", [dist, self.c(f"w{w}_size", w, np.int64)], f"w{w}_Near")
            windows[w] = g.node("And", [allowed, near], f"w{w}_mask_And")
        neg = self.c("mask_min", np.float32(np.finfo(np.float32).min))
        layers = model.get_submodule(loc.layers)
        attn_of = fam.attn_out.rpartition(".")[0]  # the attention module ("self_attn"), holding its scaling
        scale = self.c("attn_scale", np.float32(getattr(layers[0].get_submodule(attn_of), "scaling",
                                                        self.hd ** -0.5)))
        qn, vn = fam.attn_in[0], fam.attn_in[2]
        kn = fam.attn_in[1]
        gn, un = fam.mlp_in
        rep = self.nh // self.nkv
        half = self.hd // 2
        outs = []
        for i, layer in enumerate(layers):
            p = f"{loc.layers}.{i}"
            mod = layer.get_submodule
            hsn = self.rmsnorm(f"{p}.{fam.attn_norm}", mod(fam.attn_norm), x)

            def heads(t, n, nm):
                r = g.node("Reshape", [t, self.c(f"{nm}_shape", [0, 0, n, self.hd], np.int64)], f"{nm}_Reshape")
                return g.node("Transpose", [r], f"{nm}_T", perm=[0, 2, 1, 3])

            q = heads(self.linear(f"{p}.{qn}", mod(qn), hsn), self.nh, f"{p}_q")
            k = heads(self.linear(f"{p}.{kn}", mod(kn), hsn), self.nkv, f"{p}_k")
            if fam.qk_norms:  # Qwen3: RMSNorm over each head's features
                qkn, kkn = fam.qk_norms
                q = self.rmsnorm(f"{p}.{qkn}", mod(qkn), q)
                k = self.rmsnorm(f"{p}.{kkn}", mod(kkn), k)
            v = heads(self.linear(f"{p}.{vn}", mod(vn), hsn), self.nkv, f"{p}_v")

            def rope(t, nm):
                x1 = g.node("Slice", [t, self.c(f"{nm}_s0", [0], np.int64), self.c(f"{nm}_e0", [half], np.int64),
                                      self.c(f"{nm}_a0", [-1], np.int64)], f"{nm}_x1")
                x2 = g.node("Slice", [t, self.c(f"{nm}_s1", [half], np.int64),
                                      self.c(f"{nm}_e1", [self.hd], np.int64), self.c(f"{nm}_a1", [-1], np.int64)],
                            f"{nm}_x2")
                rh = g.node("Concat", [g.node("Neg", [x2], f"{nm}_Neg"), x1], f"{nm}_RotHalf", axis=-1)
                mc = g.node("Mul", [t, cos], f"{nm}_MulCos")
                return g.node("Add", [mc, g.node("Mul", [rh, sin], f"{nm}_MulSin")], f"{nm}_Rope")

            q = rope(q, f"{p}_q")
            k = rope(k, f"{p}_k")
            kall = g.node("Concat", [f"past_key_values.{i}.key", k], f"{p}_KCat", axis=2,
                          outputs=[g.reserve(f"present.{i}.key")])
            vall = g.node("Concat", [f"past_key_values.{i}.value", v], f"{p}_VCat", axis=2,
                          outputs=[g.reserve(f"present.{i}.value")])
            outs += [kall, vall]
            q5 = g.node("Reshape", [q, self.c(f"{p}_q5", [0, self.nkv, rep, -1, self.hd], np.int64)], f"{p}_q5")
            k5 = g.node("Unsqueeze", [kall, self.c(f"{p}_k5a", [2], np.int64)], f"{p}_k5")
            v5 = g.node("Unsqueeze", [vall, self.c(f"{p}_v5a", [2], np.int64)], f"{p}_v5")
            kt = g.node("Transpose", [k5], f"{p}_KT", perm=[0, 1, 2, 4, 3])
            s = g.node("Mul", [g.node("MatMul", [q5, kt], f"{p}_QK"), scale], f"{p}_Scores")
            w = self.window(i)
            s = g.node("Where", [allowed if w is None else windows[w], s, neg], f"{p}_Masked")
            pr = g.node("Softmax", [s], f"{p}_Softmax", axis=-1)
            a = g.node("MatMul", [pr, v5], f"{p}_AV")  # [b, nkv, rep, s, hd]
            a = g.node("Reshape", [a, self.c(f"{p}_a4", [0, self.nh, -1, self.hd], np.int64)], f"{p}_a4")
            a = g.node("Transpose", [a], f"{p}_aT", perm=[0, 2, 1, 3])
            a = g.node("Reshape", [a, self.c(f"{p}_a3", [0, 0, self.nh * self.hd], np.int64)], f"{p}_a3")
            a = self.linear(f"{p}.{fam.attn_out}", mod(fam.attn_out), a)
            x = g.node("Add", [x, a], f"{p}_Residual1")
            hsn = self.rmsnorm(f"{p}.{fam.mlp_norm}", mod(fam.mlp_norm), x)
            gt = self.linear(f"{p}.{gn}", mod(gn), hsn)
            up = self.linear(f"{p}.{un}", mod(un), hsn)
            act = g.node("Mul", [gt, g.node("Sigmoid", [gt], f"{p}_Sigmoid")], f"{p}_SiLU")
            d = self.linear(f"{p}.{fam.mlp_out}", mod(fam.mlp_out), g.node("Mul", [act, up], f"{p}_GateUp"))
            x = g.node("Add", [x, d], f"{p}_Residual2")
        x = self.rmsnorm(loc.final_norm, model.get_submodule(loc.final_norm), x)
        head = model.get_submodule(loc.lm_head)
        tied = getattr(head, "weight", None) is not None and getattr(emb, "weight", None) is head.weight
        same = (not isinstance(head, QuantModule) or "weight" not in head.specs or tied_out is not None
                and head.specs["weight"] == emb.specs["weight"] and getattr(head, "bias", None) is None)
        if tied and same:  # the embedding table once (float or dequantized), as the tied head's weight
            if isinstance(head, QuantModule):
                x = ctx.act(loc.lm_head, head, "input", x, axis=-1)
            wt = g.node("Transpose", [tied_out or table], "lm_head_Transpose", perm=[1, 0])
            y = g.node("MatMul", [x, wt], "lm_head_MatMul")
            if isinstance(head, QuantModule):
                y = ctx.act(loc.lm_head, head, "output", y, axis=-1)
            logits = g.node("Identity", [y], "logits_Identity", outputs=[g.reserve("logits")])
        else:
            y = self.linear(loc.lm_head, head, x)
            logits = g.node("Identity", [y], "logits_Identity", outputs=[g.reserve("logits")])
        g.outputs.append(h.make_tensor_value_info(logits, T.FLOAT, ["batch", "seq", int(cfg.vocab_size)]))
        for i in range(nl):
            for kv in ("key", "value"):
                g.outputs.append(h.make_tensor_value_info(f"present.{i}.{kv}", T.FLOAT,
                                                          ["batch", self.nkv, "total", self.hd]))
        return names_in, ["logits"] + outs


def _check_decoder(model: nn.Module) -> None:
    cfg = model.config
    rot = input_rotations(model)
    if rot:
        raise ValueError(f"export_onnx: the model carries online rotations (e.g. before {next(iter(rot))!r}); the "
                         f"ONNX decoder graph does not apply them")
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rtype = rp.get("rope_type", rp.get("type", "default")) if isinstance(rp, dict) else "default"
    if rtype not in ("default", "linear", "llama3", "yarn"):
        raise ValueError(f"export_onnx: rope_type {rtype!r} changes with the sequence length; the ONNX decoder "
                         f"graph has fixed rotary frequencies")
    loc = locate(model, what="export_onnx")
    if not decoder_graph_fits(loc.family) or non_language_modules(model):
        raise ValueError(f"export_onnx: the decoder graph does not compute {type(model).__name__} (the "
                         f"{loc.family.name} record); give inputs= to trace it")
    for i, layer in enumerate(model.get_submodule(loc.layers)):
        act = layer.get_submodule(loc.family.act)
        if type(act).__name__ not in ("SiLU", "SiLUActivation"):
            raise ValueError(f"export_onnx: {loc.layers}.{i}.{loc.family.act} is a {type(act).__name__}; the decoder "
                             f"graph's MLP is SiLU(gate) * up")
    for n, m in model.named_modules():
        if isinstance(m, (QuantConvTranspose2d, QuantEmbeddingBag)):
            raise ValueError(f"export_onnx: {n}: a {type(m).__name__} in a decoder")


# ---------------------------------------------------------------------------------------------------------------
# traced graph (torch's TorchScript exporter + rewriting of marker nodes)
# ---------------------------------------------------------------------------------------------------------------


def _traced(model: nn.Module, inputs: tuple, kwargs: Optional[dict], ctx: _Ctx, input_names, output_names,
            dynamic_axes) -> tuple:
    onnx = __import__("onnx")
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantModule)]
    table: list = []  # index -> (kind, name, module, role)

    class Mark(torch.autograd.Function):
        @staticmethod
        def forward(ctx_, x, idx: int):  # type: ignore[override]
            kind, name, m, role = table[idx]
            if kind != "act":
                return x.clone()
            state = torch._C._get_tracing_state()  # qcore's arithmetic is replaced by the marker: not traced
            torch._C._set_tracing_state(None)
            try:
                with torch.no_grad():
                    return m.fake_quantize_activation(x.detach(), role).detach()
            finally:
                torch._C._set_tracing_state(state)

        @staticmethod
        def symbolic(g, x, idx: int):
            y = g.op("qcore::Mark", x, idx_i=idx)
            y.setType(x.type())
            return y

    def mark(x, kind, name, m, role):
        table.append((kind, name, m, role))
        return Mark.apply(x, len(table) - 1)

    consts: dict = {}
    with torch.no_grad():
        for n, m in mods:
            w = m.effective("weight") if "weight" in m.specs else m.weight
            b = m.effective("bias") if getattr(m, "bias", None) is not None else None
            consts[n] = (w.detach().clone(), None if b is None else b.detach().clone())

    def make_forward(n, m):
        w, b = consts[n]
        F = torch.nn.functional

        def fwd(self, *args, **kwargs):
            wq = mark(w, "weight", n, m, "weight") if "weight" in m.specs else w
            if isinstance(m, QuantEmbedding):
                y = F.embedding(args[0], wq, m.padding_idx, m.max_norm, m.norm_type, m.scale_grad_by_freq, m.sparse)
            elif isinstance(m, QuantEmbeddingBag):
                raise ValueError(f"export_onnx: {n}: EmbeddingBag is not exported to ONNX")
            else:
                x = args[0]
                if "input" in m.specs and m.quant_enabled:
                    x = mark(x, "act", n, m, "input")
                if isinstance(m, QuantLinear):
                    y = F.linear(x, wq, b)
                elif isinstance(m, QuantConvTranspose2d):
                    op = m._output_padding(x, kwargs.get("output_size", args[1] if len(args) > 1 else None),
                                           m.stride, m.padding, m.kernel_size, 2, m.dilation)
                    y = F.conv_transpose2d(x, wq, b, m.stride, m.padding, op, m.groups, m.dilation)
                else:
                    y = m._conv_forward(x, wq, b)
            if "output" in m.specs and m.quant_enabled:
                y = mark(y, "act", n, m, "output")
            return y
        return fwd

    for n, m in mods:
        m.forward = types.MethodType(make_forward(n, m), m)
    keys = None if kwargs is None else list(kwargs)
    wrapper = _Call(model, keys)
    args = tuple(inputs) if kwargs is None else tuple(kwargs.values())
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.no_grad():
                torch.onnx.export(wrapper, args, buf, dynamo=False, opset_version=20, do_constant_folding=False,
                                  autograd_inlining=False, custom_opsets={"qcore": 1}, input_names=input_names,
                                  output_names=output_names, dynamic_axes=dynamic_axes)
        # the wrapper's parameter prefix off the initializer names
        src = onnx.load_from_string(buf.getvalue())
        _strip_prefix(src.graph, "m.")
    finally:
        for _, m in mods:
            m.__dict__.pop("forward", None)
    gr = src.graph
    g = ctx.g
    for coll in (gr.node, gr.initializer, gr.input, gr.output):
        for it in coll:
            g._names.add(it.name)
    for nd in gr.node:
        g._names.update(nd.output)
        g._names.add(nd.name)
    dropped_inputs: set = set()
    out_nodes: list = []
    for nd in gr.node:
        if nd.domain != "qcore":
            out_nodes.append(nd)
            continue
        idx = next(a.i for a in nd.attribute if a.name == "idx")
        kind, name, m, role = table[idx]
        start = len(g.nodes)
        if kind == "weight":
            dropped_inputs.add(nd.input[0])
            if isinstance(m, QuantConvTranspose2d):
                wc = ctx.weight(name, m)
                _uncanon_nodes(g, name, m, wc, nd.output[0])
            else:
                ctx.weight(name, m, output=nd.output[0])
        else:
            axis = m.activation_axis
            y = ctx.act(name, m, role, nd.input[0], axis=axis)
            g.node("Identity", [y], f"{name}_{role}_out", outputs=[nd.output[0]])
        out_nodes.extend(g.nodes[start:])
        del g.nodes[start:]
    used = {i for nd in out_nodes for i in nd.input} | {o.name for o in gr.output}
    out_nodes = [nd for nd in out_nodes if not (nd.op_type == "Constant" and nd.output[0] in dropped_inputs
                                                 and nd.output[0] not in used)]
    keep = [t for t in gr.initializer if t.name in used]
    del gr.node[:]
    gr.node.extend(out_nodes)
    del gr.initializer[:]
    gr.initializer.extend(keep + g.initializers)
    del src.opset_import[:]
    src.opset_import.extend([onnx.helper.make_opsetid("", X.OPSET)] +
                            [onnx.helper.make_opsetid(d, 1) for d in sorted(g.domains)])
    src.ir_version = X.IR_VERSION
    src.producer_name = "qcore"
    src.producer_version = ""
    return src, [i.name for i in gr.input], [o.name for o in gr.output]


class _Call(nn.Module):
    """What the tracer calls: positional tensors -> the model (positionally, or by ``keys``) -> a tuple of tensors."""

    def __init__(self, model: nn.Module, keys: Optional[list]):
        super().__init__()
        self.m = model
        self.keys = keys

    def forward(self, *args):
        out = self.m(*args) if self.keys is None else self.m(**dict(zip(self.keys, args)))
        if hasattr(out, "to_tuple"):
            out = out.to_tuple()
        return out


def _strip_prefix(gr: Any, prefix: str) -> None:
    ren = {t.name: t.name[len(prefix):] for t in gr.initializer if t.name.startswith(prefix)}
    taken = {t.name for t in gr.initializer} | {i.name for i in gr.input} | {n2 for nd in gr.node for n2 in nd.output}
    ren = {a: b for a, b in ren.items() if b not in taken}
    for t in gr.initializer:
        t.name = ren.get(t.name, t.name)
    for nd in gr.node:
        for i, v in enumerate(nd.input):
            if v in ren:
                nd.input[i] = ren[v]


def _uncanon_nodes(g: "X.Graph", name: str, m: QuantModule, w: str, out: str) -> None:
    """The module layout of a ConvTranspose2d weight from its canonical [out, in/groups, k, k] tensor."""
    groups = m.groups
    if groups == 1:
        g.node("Transpose", [w], f"{name}_Uncanon", perm=[1, 0, 2, 3], outputs=[out])
        return
    o, ig = m.out_channels, m.in_channels // groups
    kh, kw = m.kernel_size
    r = g.node("Reshape", [w, g.const(f"{name}_s5", [groups, o // groups, ig, kh, kw], np.int64)], f"{name}_R5")
    t = g.node("Transpose", [r], f"{name}_T5", perm=[0, 2, 1, 3, 4])
    g.node("Reshape", [t, g.const(f"{name}_s4", [groups * ig, o // groups, kh, kw], np.int64)], f"{name}_R4",
           outputs=[out])


# ---------------------------------------------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------------------------------------------


def export_onnx(model: nn.Module, path: Union[str, os.PathLike], *, inputs: Union[Sequence[Any], dict, None] = None,
                input_names: Optional[Sequence[str]] = None, output_names: Optional[Sequence[str]] = None,
                dynamic_axes: Optional[dict] = None, weight_format: Union[WeightFormat, str] = WeightFormat.QDQ,
                accuracy_level: int = 0, unsupported: Union[Unsupported, str] = Unsupported.ERROR,
                overwrite: bool = False) -> ONNXExportInfo:
    """Write ``model`` (quantized with ``quantize_model``, frozen or not, float32) to the ONNX file ``path``.

    A transformers Llama-family causal LM given without ``inputs`` gets the decoder graph with KV cache (see the
    module docstring); any other model needs ``inputs`` (a tuple of example inputs for torch's tracer) and
    optionally ``input_names`` / ``output_names`` / ``dynamic_axes`` (as ``torch.onnx.export``).

    weight_format: ``WeightFormat.QDQ`` (default) or ``WeightFormat.MATMULNBITS`` (decoder graph: 4-bit group
        Linear weights as com.microsoft MatMulNBits with ``accuracy_level``).
    unsupported: ``Unsupported.ERROR`` (default) or ``Unsupported.DEQUANTIZE`` for weights onnxruntime cannot run.
    overwrite: replace an existing file (else FileExistsError, before any work).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    wf = _enum(WeightFormat, weight_format, "weight_format")
    un = _enum(Unsupported, unsupported, "unsupported")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {overwrite!r}")
    if isinstance(accuracy_level, bool) or accuracy_level not in (0, 1, 2, 3, 4):
        raise ValueError(f"accuracy_level must be 0, 1, 2, 3 or 4 (onnxruntime's MatMulNBits), got {accuracy_level!r}")
    path = pathlib.Path(path)
    if path.suffix != ".onnx":
        raise ValueError(f"path must name a .onnx file, got {str(path)!r}")
    check_file_destination(path, overwrite, model_sources(model))
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantModule)]
    if not mods:
        raise ValueError("export_onnx: the model has no qcore quantized modules; run quantize_model first")
    refuse_conv1d(model, None, "export_onnx")
    check_no_experts(model, who="export_onnx")  # fused MoE experts: not written yet (docs/adapters.md)
    _check_float32(model)
    with as_found(model):  # the model left exactly as found: modes of every submodule, requires_grad, hooks
        return _export_onnx(model, path, inputs, input_names, output_names, dynamic_axes, wf, un, accuracy_level,
                            overwrite)


def _export_onnx(model, path, inputs, input_names, output_names, dynamic_axes, wf, un, accuracy_level,
                 overwrite) -> ONNXExportInfo:
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantModule)]
    ctx = _Ctx(X.Graph(), wf, un, accuracy_level)
    for n, m in mods:
        _check_module(n, m, ctx)
    cfg = getattr(model, "config", None)
    decoder = _check_graph_kind(model, inputs, wf)
    if decoder:
        _check_decoder(model)
        names_in, names_out = _Decoder(model, ctx).build()
        onnx_model = ctx.g.model("qcore_decoder", doc=f"qcore export of a {cfg.model_type} model")
        kind = "decoder"
    else:
        kwargs = None
        if isinstance(inputs, dict):
            inputs, kwargs = (), dict(inputs)
        else:
            inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
        onnx_model, names_in, names_out = _traced(model, inputs, kwargs, ctx, input_names, output_names, dynamic_axes)
        kind = "traced"
    if ctx.warned:  # stacklevel 3: the warning names the caller of export_onnx
        warnings.warn(f"export_onnx: {len(ctx.warned)} weight(s) onnxruntime cannot dequantize are written as "
                      f"dequantized float32 (e.g. {ctx.warned[0]}); see ONNXExportInfo.dequantized", stacklevel=3)
    size = X.save_model(onnx_model, path, overwrite=overwrite)
    return ONNXExportInfo(str(path), size, kind, tuple(names_in), tuple(names_out), tuple(ctx.reports),
                          tuple(ctx.acts))


def decoder_logits(session: Any, input_ids: Any, *, attention_mask: Any = None) -> np.ndarray:
    """Logits ``[batch, seq, vocab]`` (numpy float32) of an exported decoder graph run by the onnxruntime
    ``session`` on ``input_ids`` (numpy or torch int64 ``[batch, seq]``) with an empty KV cache."""
    ids = np.asarray(input_ids.cpu() if hasattr(input_ids, "cpu") else input_ids, np.int64)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {list(ids.shape)}")
    b, s = ids.shape
    mask = np.ones((b, s), np.int64) if attention_mask is None else np.asarray(attention_mask, np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": np.tile(np.arange(s, dtype=np.int64), (b, 1))}
    for i in session.get_inputs():
        if i.name.startswith("past_key_values."):
            feeds[i.name] = np.zeros((b, int(i.shape[1]), 0, int(i.shape[3])), np.float32)
    return session.run(["logits"], feeds)[0]


ONNX_FILE = "model.onnx"


def export_onnx_dir(model: nn.Module, directory: Union[str, os.PathLike], *, tokenizer: Any = None,
                    overwrite: bool = False, **kwargs: Any) -> ONNXExportInfo:
    """``export_onnx`` into ``directory/model.onnx`` (with the tokenizer's files when ``tokenizer`` is given), the
    directory written atomically like ``export_hf``'s (a staging sibling renamed into place; an existing non-empty
    directory needs ``overwrite=True``). ``kwargs`` go to ``export_onnx``."""
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {overwrite!r}")
    directory = pathlib.Path(directory)
    sources = model_sources(model)
    check_destination(directory, overwrite, sources)
    with staged_dir(directory, recheck=lambda: check_destination(directory, overwrite, sources)) as tmp:
        info = export_onnx(model, tmp / ONNX_FILE, **kwargs)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    path = directory / ONNX_FILE
    return dataclasses.replace(info, path=str(path), bytes_on_disk=path.stat().st_size)

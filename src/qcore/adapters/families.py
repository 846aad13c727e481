"""Architecture knowledge as data: one frozen ``Family`` record per transformers model family, keyed by the
config's ``model_type`` (for a vision-language model: its text config, the language tower).

The algorithms read the record instead of knowing structure themselves: AWQ/SmoothQuant take their scaling groups
from ``Family.scaling`` (``qcore.adapters.passes.scaling.scaling_groups``), QuaRot/SpinQuant their norm folds and the
names rotated on inputs / outputs from the attention and MLP names (``qcore.adapters.passes.rotation``), AMP its fused
units from ``Family.fused_units`` (``qcore.adapters.passes.amp``).

- ``family_of(model_or_config)``: the record of a model, a config or a ``model_type`` string; ``UnknownFamily``
  (a ValueError) naming the model type, the model class and the record to add (docs/adapters.md, "Architecture
  records") when the table has none.
- ``locate(model)``: the record plus the prefix where its backbone sits in this model (``"model"`` in a
  ``LlamaForCausalLM``, ``""`` in a bare ``LlamaModel``, ``"model.language_model"`` in a vision-language model),
  with the resolved dotted paths of the decoder layers, embedding, final norm and output head.
- ``decoder_layers_path(model)``: the dotted path of the decoder layers from the table (None when the model's
  family is not in it).
- ``FAMILIES``: the table, a tuple of records; ``BY_MODEL_TYPE``: the same, keyed by ``model_type``.

Names in a record are module names relative to one decoder layer, except ``backbone`` (relative to the model),
``layers``, ``embed``, ``final_norm`` (relative to the backbone) and ``lm_head`` (relative to the model). Every
name in the table was read off a tiny random model built from the family's transformers 5 config
(tests/adapters/test_families.py checks them all).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional


__all__ = ["Family", "Experts", "ScalingRule", "UnknownFamily", "Located", "FAMILIES", "BY_MODEL_TYPE",
           "family_of", "family_or_none", "locate", "non_language_modules", "decoder_layers_path", "fused_units", "DEFAULT_FUSED", "attach", "check_record", "ATTRIBUTE",
           "NORM_KINDS", "LINEAR_KINDS", "QKV_LAYOUTS", "ScalingGroup", "unit_offset_norm", "text_config"]

#: how a norm's weight scales: ``rms`` x * w (no bias), ``rms_unit_offset`` x * (1 + w) (Gemma), ``layernorm``
#: (x - mean) / std * w + b.
NORM_KINDS = ("rms", "rms_unit_offset", "layernorm")
#: the projections' module type: ``linear`` torch.nn.Linear (weight [out, in]); ``conv1d`` transformers' Conv1D
#: (weight [in, out], GPT-2).
LINEAR_KINDS = ("linear", "conv1d")
#: rows of a fused q/k/v projection: ``concat`` [q heads | k heads | v heads] (Phi-3, GPT-2); ``per_head``
#: [q, k, v] interleaved per head (GPT-NeoX).
QKV_LAYOUTS = ("concat", "per_head")

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")
_DOCS = "docs/adapters.md, section 'Architecture records'"


def _check_name(v: Any, what: str, *, empty_ok: bool = False) -> None:
    if not isinstance(v, str):
        raise ValueError(f"{what} must be a module name (str), got {v!r}")
    if v == "" and empty_ok:
        return
    if not _NAME.match(v):
        raise ValueError(f"{what} must be a dotted module name, got {v!r}")


def _check_names(v: Any, what: str, *, empty_ok: bool = False) -> tuple:
    if isinstance(v, str) or not isinstance(v, (tuple, list)):
        raise ValueError(f"{what} must be a tuple of module names, got {v!r}")
    if not v and not empty_ok:
        raise ValueError(f"{what} must name at least one module, got {v!r}")
    for i, x in enumerate(v):
        _check_name(x, f"{what}[{i}]")
    if len(set(v)) != len(v):
        raise ValueError(f"{what} must be distinct, got {v!r}")
    return tuple(v)


# Quark's scaling_layers entries (AWQ / SmoothQuant): a ScalingGroup per entry; folding them is
# qcore.adapters.passes.scaling's job
_QUARK_KEYS = {"prev_op", "layers", "inp", "module2inspect", "has_kwargs"}


def _name(v: Any, what: str, *, empty_ok: bool = False) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{what} must be a module name (str), got {v!r}")
    if not v and not empty_ok:
        raise ValueError(f"{what} must be a non-empty module name")
    return v


@dataclass(frozen=True)
class ScalingGroup:
    """Linears ``layers`` reading the output of ``prev_op`` (names relative to one decoder layer); ``inp``: the
    module whose input is the group's calibration sample; ``module2inspect``: Quark's module whose output its
    search measures (``""``: the whole layer; None: the single Linear)."""

    prev_op: str
    layers: tuple
    inp: str
    module2inspect: Optional[str] = None

    def __post_init__(self) -> None:
        _name(self.prev_op, "ScalingGroup.prev_op")
        if isinstance(self.layers, str) or not isinstance(self.layers, (list, tuple)):
            raise TypeError(f"ScalingGroup.layers must be a sequence of module names, got {self.layers!r}")
        layers = tuple(_name(v, f"ScalingGroup.layers[{i}]") for i, v in enumerate(self.layers))
        if not layers:
            raise ValueError("ScalingGroup.layers must name at least one Linear")
        if len(set(layers)) != len(layers):
            raise ValueError(f"ScalingGroup.layers must be distinct, got {layers!r}")
        if self.prev_op in layers:
            raise ValueError(f"ScalingGroup.prev_op {self.prev_op!r} is also one of its layers")
        object.__setattr__(self, "layers", layers)
        _name(self.inp, "ScalingGroup.inp")
        if self.module2inspect is not None:
            _name(self.module2inspect, "ScalingGroup.module2inspect", empty_ok=True)

    @classmethod
    def from_quark(cls, entry: Mapping[str, Any]) -> "ScalingGroup":
        """One entry of Quark's ``scaling_layers`` (keys ``prev_op``, ``layers``, ``inp``, optional
        ``module2inspect``; Quark's ``has_kwargs`` is accepted and ignored). Unknown keys raise ValueError."""
        if not isinstance(entry, Mapping):
            raise TypeError(f"a Quark scaling_layers entry must be a dict, got {entry!r}")
        unknown = set(entry) - _QUARK_KEYS
        if unknown:
            raise ValueError(f"unknown key(s) {sorted(unknown)} in Quark scaling_layers entry {dict(entry)!r}; "
                             f"expected {sorted(_QUARK_KEYS)}")
        missing = {"prev_op", "layers", "inp"} - set(entry)
        if missing:
            raise ValueError(f"Quark scaling_layers entry {dict(entry)!r} lacks {sorted(missing)}")
        return cls(entry["prev_op"], tuple(entry["layers"]) if isinstance(entry["layers"], list) else entry["layers"],
                   entry["inp"], entry.get("module2inspect"))


@dataclass(frozen=True)
class ScalingRule:
    """A scaling group of a family and when it applies (data flags for the conditional folds):
    ``sizes_match``: only when the producing Linear's ``out_features`` equals every reader's ``in_features``
    (``v_proj -> o_proj`` without grouped-query attention); ``relu``: only when the family's activation module
    (``Family.act``) is ``nn.ReLU`` (``fc1 -> fc2``: ``relu(x / s) = relu(x) / s`` for ``s > 0``, not for GELU);
    ``absent``: only when the layer has none of these modules (``self_attn.v_norm`` normalises v_proj's output,
    so a scale on it would not pass through)."""

    group: ScalingGroup
    sizes_match: bool = False
    relu: bool = False
    absent: tuple = ()

    def __post_init__(self) -> None:
        if not isinstance(self.group, ScalingGroup):
            raise ValueError(f"ScalingRule.group must be a ScalingGroup, got {self.group!r}")
        for f in ("sizes_match", "relu"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"ScalingRule.{f} must be a bool, got {getattr(self, f)!r}")
        object.__setattr__(self, "absent", _check_names(self.absent, "ScalingRule.absent", empty_ok=True))


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts block (names relative to one decoder layer). ``path``: the experts module;
    ``gate_up`` / ``down``: its fused 3-D parameters (transformers 5: ``gate_up_proj`` [E, 2I, H], ``down_proj``
    [E, H, I]); ``router``: the router Linear-like module (weight [E, H]); ``shared`` / ``shared_gate``: a
    shared expert MLP and its gate (Qwen2-MoE); ``shared_mlp``: the shared expert's gate, up and down Linears
    (relative to ``shared``); ``count``: the config attribute giving E."""

    path: str
    router: str
    count: str
    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    shared: Optional[str] = None
    shared_gate: Optional[str] = None
    shared_mlp: tuple = ("gate_proj", "up_proj", "down_proj")

    def __post_init__(self) -> None:
        for f in ("path", "router", "gate_up", "down"):
            _check_name(getattr(self, f), f"Experts.{f}")
        if not isinstance(self.count, str) or not self.count.isidentifier():
            raise ValueError(f"Experts.count must be a config attribute name, got {self.count!r}")
        for f in ("shared", "shared_gate"):
            if getattr(self, f) is not None:
                _check_name(getattr(self, f), f"Experts.{f}")


#: the fused units of a model whose family has no record (and of the Llama-like records): q/k/v into qkv_proj,
#: gate/up into gate_up_proj (vLLM)
DEFAULT_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(frozen=True)
class Family:
    """What qcore knows about one model family (module docstring). Fields:

    - ``model_type``: the transformers ``config.model_type`` (the key); ``name``: how people call it.
    - ``backbone``: the module holding layers/embedding/final norm in the usual head model (``"model"`` in
      ``LlamaForCausalLM``); ``layers``, ``embed``, ``final_norm`` relative to it; ``lm_head`` relative to the
      model (None: an encoder without one).
    - per layer: ``attn_in`` the projections reading the attention input (q, k, v, or one fused qkv);
      ``attn_out`` the output projection; ``mlp_in`` (gate, up / fused gate_up / fc1), ``mlp_out`` (down / fc2);
      ``qkv_layout`` the row layout when ``attn_in`` is one fused module (``QKV_LAYOUTS``); ``act`` the
      activation module; ``attn_norm`` / ``mlp_norm`` the norms whose outputs ``attn_in`` / ``mlp_in`` read
      (``attn_norm`` None: post-norm, the previous layer's output norm feeds the attention);
      with ``experts``, ``mlp_in`` is () and ``mlp_out`` None;
      ``output_norms`` norms on the block outputs (Gemma2/3's sandwich norms; BERT's post-norms);
      ``qk_norms`` per-head norms of q and k (Qwen3, Gemma3); ``norm`` how every norm scales
      (``NORM_KINDS``); ``linear`` the projections' module type (``LINEAR_KINDS``).
    - ``scaling``: AWQ/SmoothQuant's scaling groups (``ScalingRule``), in Quark's order; ``scaling_requires``: a
      layer attribute that must be True for them to apply (OPT's ``do_layer_norm_before``: pre-norm only);
      ``scaling_note``: what is left out and why (also the refusal when ``scaling`` is empty).
    - ``rotation``: "" when QuaRot/SpinQuant support the family; otherwise the reason they refuse it.
    - ``fused_units``: sibling leaf names vLLM fuses into one GEMM (AMP measures and assigns them together).
    - ``experts``: the MoE block (``Experts``), or None.
    - ``gguf_arch``: llama.cpp's architecture name (``general.architecture``), or None.
    - ``causal``: a decoder (False: an encoder such as BERT).
    - ``pos_embed``: a learned absolute position embedding (relative to the backbone: GPT-2's ``wpe``), or None.
    """

    model_type: str
    name: str
    backbone: str
    layers: str
    embed: str
    final_norm: Optional[str]
    lm_head: Optional[str]
    attn_in: tuple
    attn_out: str
    mlp_in: tuple
    mlp_out: Optional[str]
    act: str
    attn_norm: Optional[str]
    mlp_norm: str
    norm: str
    linear: str = "linear"
    qkv_layout: Optional[str] = None
    output_norms: tuple = ()
    qk_norms: tuple = ()
    scaling: tuple = ()
    scaling_requires: Optional[str] = None
    scaling_note: str = ""
    rotation: str = ""
    fused_units: tuple = DEFAULT_FUSED
    experts: Optional[Experts] = None
    gguf_arch: Optional[str] = None
    causal: bool = True
    pos_embed: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_type, str) or not re.match(r"^[a-z0-9_]+$", self.model_type):
            raise ValueError(f"Family.model_type must be a transformers model_type (lowercase letters, digits, _), "
                             f"got {self.model_type!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Family.name must be a non-empty str, got {self.name!r}")
        _check_name(self.backbone, "Family.backbone", empty_ok=True)
        for f in ("layers", "embed", "attn_out", "act", "mlp_norm"):
            _check_name(getattr(self, f), f"Family.{f}")
        for f in ("final_norm", "lm_head", "attn_norm", "pos_embed"):
            if getattr(self, f) is not None:
                _check_name(getattr(self, f), f"Family.{f}")
        object.__setattr__(self, "attn_in", _check_names(self.attn_in, "Family.attn_in"))
        if self.experts is not None and not isinstance(self.experts, Experts):
            raise ValueError(f"Family.experts must be an Experts record or None, got {self.experts!r}")
        if self.experts is None:
            object.__setattr__(self, "mlp_in", _check_names(self.mlp_in, "Family.mlp_in"))
            _check_name(self.mlp_out, "Family.mlp_out")
        elif self.mlp_in != () or self.mlp_out is not None:
            raise ValueError(f"Family {self.model_type!r}: with experts, mlp_in must be () and mlp_out None (the MLP "
                             f"is the experts block), got {self.mlp_in!r}, {self.mlp_out!r}")
        for f in ("output_norms", "qk_norms"):
            object.__setattr__(self, f, _check_names(getattr(self, f), f"Family.{f}", empty_ok=True))
        if self.norm not in NORM_KINDS:
            raise ValueError(f"Family.norm must be one of {NORM_KINDS}, got {self.norm!r}")
        if self.linear not in LINEAR_KINDS:
            raise ValueError(f"Family.linear must be one of {LINEAR_KINDS}, got {self.linear!r}")
        if len(self.attn_in) == 1:
            if self.qkv_layout not in QKV_LAYOUTS:
                raise ValueError(f"Family.qkv_layout must be one of {QKV_LAYOUTS} when attn_in is one fused "
                                 f"projection ({self.attn_in[0]!r}), got {self.qkv_layout!r}")
        elif len(self.attn_in) == 3:
            if self.qkv_layout is not None:
                raise ValueError(f"Family.qkv_layout must be None with separate q, k, v projections, got "
                                 f"{self.qkv_layout!r}")
        else:
            raise ValueError(f"Family.attn_in must name q, k, v or one fused qkv projection, got {self.attn_in!r}")
        if self.experts is None and len(self.mlp_in) not in (1, 2):
            raise ValueError(f"Family.mlp_in must name gate and up, or one fused gate_up / fc1, got {self.mlp_in!r}")
        names = self.layer_names()
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"Family {self.model_type!r}: the layer names {dup} are given twice")
        if not isinstance(self.scaling, tuple) or not all(isinstance(r, ScalingRule) for r in self.scaling):
            raise ValueError(f"Family.scaling must be a tuple of ScalingRule, got {self.scaling!r}")
        known = set(names)
        for i, r in enumerate(self.scaling):
            g = r.group
            for n in (g.prev_op, *g.layers, g.inp):
                if n not in known:
                    raise ValueError(f"Family {self.model_type!r}: scaling[{i}] names {n!r}, which is none of the "
                                     f"record's layer names {sorted(known)}")
        if self.scaling_requires is not None and not (isinstance(self.scaling_requires, str)
                                                      and self.scaling_requires.isidentifier()):
            raise ValueError(f"Family.scaling_requires must be a layer attribute name or None, got "
                             f"{self.scaling_requires!r}")
        for f in ("scaling_note", "rotation"):
            if not isinstance(getattr(self, f), str):
                raise ValueError(f"Family.{f} must be a str, got {getattr(self, f)!r}")
        if not self.scaling and not self.scaling_note:
            raise ValueError(f"Family {self.model_type!r}: scaling is empty; scaling_note must say why")
        fu = self.fused_units
        if not isinstance(fu, tuple) or not all(
                isinstance(g, tuple) and len(g) >= 2 and all(isinstance(x, str) and x.isidentifier() for x in g)
                for g in fu):
            raise ValueError(f"Family.fused_units must be a tuple of tuples of (at least two) leaf module names, "
                             f"got {fu!r}")
        if self.gguf_arch is not None and not (isinstance(self.gguf_arch, str) and self.gguf_arch):
            raise ValueError(f"Family.gguf_arch must be llama.cpp's architecture name or None, got {self.gguf_arch!r}")
        if not isinstance(self.causal, bool):
            raise ValueError(f"Family.causal must be a bool, got {self.causal!r}")

    # derived views (no per-family code: each reads the fields above)
    def norm_names(self) -> tuple:
        """Every norm of one layer: attn_norm, mlp_norm, output_norms, qk_norms."""
        first = () if self.attn_norm is None else (self.attn_norm,)
        return (*first, self.mlp_norm, *self.output_norms, *self.qk_norms)

    def projection_names(self) -> tuple:
        """The projections of one layer (attention, then MLP; experts are not projections)."""
        return (*self.attn_in, self.attn_out, *self.mlp_in, *((self.mlp_out,) if self.mlp_out else ()))

    def layer_names(self) -> list:
        """Every module name of one layer the record gives (projections, norms, act, MoE modules)."""
        out = [*self.projection_names(), *self.norm_names(), self.act]
        e = self.experts
        if e is not None:
            out += [e.path, e.router] + [n for n in (e.shared, e.shared_gate) if n is not None]
        return out


class UnknownFamily(ValueError):
    """``family_of`` found no record: ``model_type`` (None when the model has no transformers config) and
    ``cls`` (the model's class name)."""

    def __init__(self, model_type: Optional[str], cls: Optional[str], what: str = ""):
        self.model_type, self.cls = model_type, cls
        mt = f"model_type {model_type!r}" if model_type else "no transformers config (no config.model_type)"
        of = f" ({cls})" if cls else ""
        need = f"a Family record with model_type={model_type!r}" if model_type else "a Family record"
        super().__init__(f"{what}{': ' if what else ''}no architecture record for {mt}{of}; qcore knows "
                         f"{sorted(BY_MODEL_TYPE)}. Add {need} to qcore.adapters.families.FAMILIES (see {_DOCS})")


# ---------------------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------------------

_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


def _sg(prev, layers, inp=None, m2i=None):
    return ScalingGroup(prev, tuple(layers), inp or layers[0], m2i)


_ATTN_SCALING = (
    ScalingRule(_sg("input_layernorm", _QKV, m2i="self_attn")),
    ScalingRule(_sg("self_attn.v_proj", ("self_attn.o_proj",)), sizes_match=True, absent=("self_attn.v_norm",)),
)
_LLAMA_SCALING = _ATTN_SCALING + (
    ScalingRule(_sg("post_attention_layernorm", _GATE_UP, m2i="mlp")),
    ScalingRule(_sg("mlp.up_proj", ("mlp.down_proj",))),
)
_SANDWICH_SCALING = _ATTN_SCALING + (
    ScalingRule(_sg("pre_feedforward_layernorm", _GATE_UP, m2i="mlp")),
    ScalingRule(_sg("mlp.up_proj", ("mlp.down_proj",))),
)
_LLAMA = dict(backbone="model", layers="layers", embed="embed_tokens", final_norm="norm", lm_head="lm_head",
              attn_in=_QKV, attn_out="self_attn.o_proj", mlp_in=_GATE_UP, mlp_out="mlp.down_proj", act="mlp.act_fn",
              attn_norm="input_layernorm", mlp_norm="post_attention_layernorm", norm="rms", scaling=_LLAMA_SCALING)
_MOE_NOTE = ("the experts' fused 3-D weights (and the router) are not scaled: only the attention groups are "
             "built in")
_MOE = dict(_LLAMA, mlp_in=(), mlp_out=None, act="mlp.experts.act_fn", scaling=_ATTN_SCALING, scaling_note=_MOE_NOTE,
            rotation="its experts are fused 3-D parameters (mlp.experts.gate_up_proj / down_proj) that the "
                     "rotations do not transform yet, and the online down_proj transform sits inside them",
            fused_units=(("q_proj", "k_proj", "v_proj"),))
_SANDWICH_ROT = ("its sandwich norms (post_attention_layernorm, post_feedforward_layernorm) scale the block "
                 "outputs per channel before the residual add, which does not commute with the residual rotation")
_LAYERNORM_ROT = ("its norms are LayerNorms (mean subtraction and bias), which do not commute with the residual "
                  "rotation; QuaRot needs RMSNorm")


def _moe(model_type, name, experts, **kw):
    # MoE layers: attention as Llama; the MLP is the experts block (no per-layer mlp_in / mlp_out Linear)
    return Family(model_type, name, experts=experts, **dict(_MOE, **kw))


FAMILIES: tuple = (
    Family("llama", "Llama", gguf_arch="llama", **_LLAMA),
    Family("mistral", "Mistral", gguf_arch="llama", **_LLAMA),
    Family("qwen2", "Qwen2", gguf_arch="qwen2", **_LLAMA),
    # the language tower of Qwen2-VL (Qwen2VLForConditionalGeneration's model.language_model): Qwen2's layers with
    # multimodal rotary positions (mrope), which act on q and k only (the residual and head rotations commute)
    Family("qwen2_vl_text", "Qwen2-VL (language tower)", gguf_arch="qwen2vl", **_LLAMA),
    Family("qwen3", "Qwen3", gguf_arch="qwen3", **dict(_LLAMA, qk_norms=("self_attn.q_norm", "self_attn.k_norm"))),
    Family("gemma", "Gemma", gguf_arch="gemma", **dict(_LLAMA, norm="rms_unit_offset")),
    Family("gemma2", "Gemma2", gguf_arch="gemma2", **dict(
        _LLAMA, norm="rms_unit_offset", mlp_norm="pre_feedforward_layernorm", scaling=_SANDWICH_SCALING,
        output_norms=("post_attention_layernorm", "post_feedforward_layernorm"), rotation=_SANDWICH_ROT)),
    Family("gemma3_text", "Gemma3", gguf_arch="gemma3", **dict(
        _LLAMA, norm="rms_unit_offset", mlp_norm="pre_feedforward_layernorm", scaling=_SANDWICH_SCALING,
        output_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
        qk_norms=("self_attn.q_norm", "self_attn.k_norm"), rotation=_SANDWICH_ROT)),
    Family("phi3", "Phi-3", gguf_arch="phi3", **dict(
        _LLAMA, attn_in=("self_attn.qkv_proj",), qkv_layout="concat", mlp_in=("mlp.gate_up_proj",),
        act="mlp.activation_fn", fused_units=(),
        scaling=(ScalingRule(_sg("input_layernorm", ("self_attn.qkv_proj",), m2i="self_attn")),
                 ScalingRule(_sg("post_attention_layernorm", ("mlp.gate_up_proj",), m2i="mlp"))),
        scaling_note="v -> o and up -> down are not folded: v and up are row slices of the fused qkv_proj and "
                     "gate_up_proj")),
    Family("gpt2", "GPT-2", gguf_arch="gpt2", backbone="transformer", layers="h", embed="wte", pos_embed="wpe",
           final_norm="ln_f",
           lm_head="lm_head", attn_in=("attn.c_attn",), qkv_layout="concat", attn_out="attn.c_proj",
           mlp_in=("mlp.c_fc",), mlp_out="mlp.c_proj", act="mlp.act", attn_norm="ln_1", mlp_norm="ln_2",
           norm="layernorm", linear="conv1d", fused_units=(),
           scaling=(ScalingRule(_sg("ln_1", ("attn.c_attn",), m2i="attn")),
                    ScalingRule(_sg("ln_2", ("mlp.c_fc",), m2i="mlp"))),
           scaling_note="attn.c_attn -> attn.c_proj is not folded: only the v third of the fused c_attn's outputs "
                        "reaches c_proj, and a ScalingGroup divides all of a producer's outputs; the MLP's GELU "
                        "stops mlp.c_fc -> mlp.c_proj",
           rotation=_LAYERNORM_ROT),
    Family("gpt_neox", "GPT-NeoX", gguf_arch="gptneox", backbone="gpt_neox", layers="layers", embed="embed_in",
           final_norm="final_layer_norm", lm_head="lm_head", attn_in=("attention.query_key_value",),
           qkv_layout="per_head", attn_out="attention.dense", mlp_in=("mlp.dense_h_to_4h",),
           mlp_out="mlp.dense_4h_to_h", act="mlp.act", attn_norm="input_layernorm",
           mlp_norm="post_attention_layernorm", norm="layernorm", fused_units=(),
           scaling=(ScalingRule(_sg("input_layernorm", ("attention.query_key_value",), m2i="attention")),
                    ScalingRule(_sg("post_attention_layernorm", ("mlp.dense_h_to_4h",), m2i="mlp"))),
           scaling_note="v -> dense is not folded (v is interleaved in the fused query_key_value); the MLP's GELU "
                        "stops dense_h_to_4h -> dense_4h_to_h",
           rotation=_LAYERNORM_ROT),
    Family("opt", "OPT", backbone="model.decoder", layers="layers", embed="embed_tokens",
           final_norm="final_layer_norm", lm_head="lm_head",
           attn_in=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), attn_out="self_attn.out_proj",
           mlp_in=("fc1",), mlp_out="fc2", act="activation_fn", attn_norm="self_attn_layer_norm",
           mlp_norm="final_layer_norm", norm="layernorm", fused_units=(("q_proj", "k_proj", "v_proj"),),
           scaling=(ScalingRule(_sg("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj",
                                                              "self_attn.v_proj"), m2i="self_attn")),
                    ScalingRule(_sg("self_attn.v_proj", ("self_attn.out_proj",)), sizes_match=True),
                    ScalingRule(_sg("final_layer_norm", ("fc1",))),
                    ScalingRule(_sg("fc1", ("fc2",)), relu=True)),
           scaling_requires="do_layer_norm_before",
           scaling_note="post-norm OPT (do_layer_norm_before=False, opt-350m): the norms act on the block outputs",
           rotation=_LAYERNORM_ROT),
    Family("bert", "BERT", backbone="bert", layers="encoder.layer", embed="embeddings.word_embeddings",
           final_norm=None, lm_head=None,
           attn_in=("attention.self.query", "attention.self.key", "attention.self.value"),
           attn_out="attention.output.dense", mlp_in=("intermediate.dense",), mlp_out="output.dense",
           act="intermediate.intermediate_act_fn", attn_norm=None, mlp_norm="attention.output.LayerNorm",
           output_norms=("output.LayerNorm",), norm="layernorm", causal=False,
           fused_units=(("query", "key", "value"),),
           scaling_note="BERT is post-norm: each LayerNorm's output also feeds the residual, so no norm can take "
                        "the scales",
           gguf_arch="bert", rotation="it is a post-norm encoder; " + _LAYERNORM_ROT),
    _moe("mixtral", "Mixtral", Experts("mlp.experts", "mlp.gate", "num_local_experts"), gguf_arch="llama"),
    _moe("qwen2_moe", "Qwen2-MoE", Experts("mlp.experts", "mlp.gate", "num_experts", shared="mlp.shared_expert",
                                           shared_gate="mlp.shared_expert_gate"), gguf_arch="qwen2moe",
         fused_units=DEFAULT_FUSED),
    _moe("qwen3_moe", "Qwen3-MoE", Experts("mlp.experts", "mlp.gate", "num_experts"), gguf_arch="qwen3moe",
         qk_norms=("self_attn.q_norm", "self_attn.k_norm")),
)

BY_MODEL_TYPE: dict = {f.model_type: f for f in FAMILIES}
if len(BY_MODEL_TYPE) != len(FAMILIES):  # pragma: no cover - a table edit giving one model_type twice
    raise ValueError("qcore.adapters.families.FAMILIES gives a model_type twice")


# ---------------------------------------------------------------------------------------------------------------
# lookup
# ---------------------------------------------------------------------------------------------------------------

# where the language tower of a vision-language model sits (transformers 5 conventions), tried after the record's
# own backbone and the bare model
_TOWERS = ("model.language_model", "language_model.model", "language_model")


def text_config(cfg: Any) -> Any:
    """The language model's config of a model config: ``cfg.get_text_config()`` where it gives one with a
    ``model_type`` (vision-language models), else ``cfg`` itself."""
    get = getattr(cfg, "get_text_config", None)
    if callable(get):
        try:
            t = get()
        except Exception:  # noqa: BLE001 - a config class without a text config
            t = None
        if t is not None and isinstance(getattr(t, "model_type", None), str):
            return t
    return cfg


def _model_type(obj: Any) -> tuple:
    """``(model_type or None, class name or None)`` of a model, config or model_type string."""
    if isinstance(obj, str):
        return obj, None
    cfg = getattr(obj, "config", None) if not hasattr(obj, "model_type") else obj
    cls = type(obj).__name__
    if cfg is None or not isinstance(getattr(cfg, "model_type", None), str):
        return None, cls
    return text_config(cfg).model_type or None, cls


def family_of(obj: Any, *, what: str = "") -> Family:
    """The record of ``obj``: a model (its ``config``), a transformers config, or a ``model_type`` str. For a
    vision-language model, the record of its text config (the language tower). A model given a record with
    ``attach`` has that one. ``UnknownFamily`` (ValueError)
    naming the model type, the class and the record to add when the table has none; ``what`` prefixes it (the
    pass that needs the record)."""
    own = getattr(obj, ATTRIBUTE, None) if not isinstance(obj, str) else None
    if isinstance(own, Family):
        return own
    mt, cls = _model_type(obj)
    fam = BY_MODEL_TYPE.get(mt) if mt else None
    if fam is None:
        raise UnknownFamily(mt, cls, what)
    return fam


@dataclass(frozen=True)
class Located:
    """A family's record and where its backbone sits in one model (``prefix``), with the resolved paths."""

    family: Family
    prefix: str
    layers: str = field(init=False)
    embed: str = field(init=False)
    final_norm: Optional[str] = field(init=False)
    lm_head: Optional[str] = field(init=False)
    pos_embed: Optional[str] = field(init=False)

    def __post_init__(self) -> None:
        j = (lambda n: f"{self.prefix}.{n}" if self.prefix else n)
        f = self.family
        object.__setattr__(self, "layers", j(f.layers))
        object.__setattr__(self, "embed", j(f.embed))
        object.__setattr__(self, "final_norm", None if f.final_norm is None else j(f.final_norm))
        object.__setattr__(self, "lm_head", f.lm_head)
        object.__setattr__(self, "pos_embed", None if f.pos_embed is None else j(f.pos_embed))


def _get(model: Any, name: str) -> Any:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def locate(model: Any, *, what: str = "") -> Located:
    """``family_of(model)`` and the prefix of its backbone in ``model``: the record's ``backbone``, the bare
    backbone (``""``) or a vision-language model's language tower, whichever holds the record's ``layers`` as a
    ModuleList. ValueError naming the paths tried when none does."""
    return _locate(model, family_of(model, what=what), what)


def _locate(model: Any, fam: "Family", what: str) -> Located:
    from torch import nn
    tried = []
    for prefix in dict.fromkeys((fam.backbone, "", *_TOWERS)):
        path = f"{prefix}.{fam.layers}" if prefix else fam.layers
        tried.append(path)
        if isinstance(_get(model, path), nn.ModuleList):
            return Located(fam, prefix)
    raise ValueError(f"{what}{': ' if what else ''}{type(model).__name__} (model_type {fam.model_type!r}) has no "
                     f"decoder layers where the {fam.name} record says (tried {tried}); fix the record's backbone "
                     f"/ layers (see {_DOCS})")


def non_language_modules(model: Any) -> list:
    """For a vision-language model (its record located at a language tower, ``_TOWERS``): the names of the
    modules beside the tower that are not part of the language model (the vision tower, the multi-modal
    projector: every sibling of the tower holding parameters); [] for any other model. What ``plan_model``
    keeps float by default (calibration data is text: those modules would see none)."""
    try:
        loc = locate(model)
    except ValueError:
        return []
    if loc.prefix not in _TOWERS:
        return []
    parent_name, _, tower = loc.prefix.rpartition(".")
    parent = _get(model, parent_name) if parent_name else model
    j = (lambda n: f"{parent_name}.{n}" if parent_name else n)
    return [j(n) for n, m in parent.named_children() if n != tower and any(True for _ in m.parameters())]


def decoder_layers_path(model: Any) -> Optional[str]:
    """The dotted path of ``model``'s decoder layers from the table, or None when its family is not in the table
    or the layers are not where the record says (callers fall back to their own search)."""
    try:
        return locate(model).layers
    except ValueError:
        return None


def family_or_none(model: Any) -> Optional[Family]:
    """``family_of(model)``, or None for a model whose family the table lacks (passes that can do without it)."""
    try:
        return family_of(model)
    except UnknownFamily:
        return None


# RMSNorm classes computing normalize(x) * (1 + weight) (Quark 0.13's UNIT_OFFSET_NORM_CLASSES): what tells how the
# norms of a model WITHOUT a record scale (a record says it: Family.norm); unit_offset_norm reads it
_RECORDLESS_UNIT_OFFSET_NORMS = frozenset({
    "GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm", "RecurrentGemmaRMSNorm", "VaultGemmaRMSNorm",
    "T5GemmaRMSNorm", "T5Gemma2RMSNorm", "Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "MuseGlimmerTextCenteredRMSNorm",
})


def unit_offset_norm(norm: Any, family: Optional[Family] = None) -> bool:
    """Whether the norm module ``norm`` computes ``normalize(x) * (1 + weight)`` (folds into it act on ``1 +
    weight``): ``family.norm == "rms_unit_offset"``, the record of the model ``norm`` belongs to
    (``family_or_none(model)``, a record given with ``attach`` included). For a model without a record
    (``family`` None), whether ``norm``'s class is one of the RMSNorm classes Quark lists as computing ``1 +
    weight`` (Gemma's, Gemma2's, Gemma3's, Qwen3.5's, ...)."""
    if family is not None:
        return family.norm == "rms_unit_offset"
    return type(norm).__name__ in _RECORDLESS_UNIT_OFFSET_NORMS


def fused_units(model: Any) -> tuple:
    """AMP's default units: the record's ``fused_units``, or ``DEFAULT_FUSED`` for a model without a record."""
    try:
        return family_of(model).fused_units
    except UnknownFamily:
        return DEFAULT_FUSED


ATTRIBUTE = "qcore_family"  # where ``attach`` puts a user's record on one model


def attach(model: Any, family: Family) -> Family:
    """Give ``model`` the record ``family`` (a family the table lacks, or a replacement for one model): it is
    stored on the model (``model.qcore_family``), so every pass reading ``family_of(model)`` uses it; nothing
    global changes (a record for everyone belongs in ``FAMILIES``, with a tiny model in
    tests/adapters/test_families.py). Checked before it is attached (``check_record``), against the model's
    modules and against its float function: a record that contradicts the model would make the passes reading
    it (QuaRot's folds and rotations, AWQ / SmoothQuant's scaling groups) change the model's function silently.
    A ValueError naming the record's field refuses it, with nothing attached and the model as it was found.
    Returns the record."""
    check_record(model, family)
    setattr(model, ATTRIBUTE, family)
    return family


# ---------------------------------------------------------------------------------------------------------------
# checking a record against one model (attach)
# ---------------------------------------------------------------------------------------------------------------


def check_record(model: Any, family: Family) -> None:
    """What ``attach`` checks before it stores ``family`` on ``model``; ValueError (one line, naming the
    record's field, the module and what it found) at the first contradiction. Nothing of the model changes.

    1. Modules: the record's ``model_type`` is the model's; its layers are where it says; every module it names
       exists (top level: ``embed``, ``final_norm``, ``lm_head``, ``pos_embed``; in every layer: projections,
       norms, ``act``, the MoE modules and parameters); shapes agree with the model's config (``hidden_size``,
       heads): norms have one weight per hidden channel (``qk_norms``: per head dimension), ``attn_in`` / ``mlp_in``
       read the hidden size and ``attn_out`` / ``mlp_out`` write it, q / k / v (or the fused qkv) have the heads'
       rows and ``attn_out`` reads the query heads, the MLP's inner sizes agree, the head reads the hidden size
       (or the embedding's) and writes the vocabulary, the experts' parameters are ``[E, 2I, H]`` / ``[E, H, I]``
       with ``E`` the config's ``count``; the projections are the record's ``linear`` kind.
    2. Norms: every norm the record names computes what ``norm`` says (``x / rms(x) * w``, ``* (1 + w)``, or
       ``(x - mean) / std * w + b``) on a probe input (a fold scales ``w`` or ``1 + w``).
    3. The float function: a probe batch of token ids (one sequence of 8) through the model with the folds the
       record implies applied on the activations, by hooks (the same linear maps the weight folds apply; no
       weight changes, nothing copied), compared to the model without them (relative RMS difference of the
       output at most ``max(1e-4, 16 * eps)`` of the model's dtype): every applicable ``scaling`` group (random
       positive scales on ``prev_op``'s output, undone on ``layers``' inputs); when the record allows rotations
       (``rotation == ""``): the norm folds (``attn_norm`` into ``attn_in``, ``mlp_norm`` into ``mlp_in``,
       ``final_norm`` into ``lm_head``), a random orthogonal rotation of the residual stream (the embedding's
       output and ``attn_out`` / ``mlp_out``'s outputs rotated, ``attn_in`` / ``mlp_in`` / the head's inputs
       rotated back, the named norms seeing unrotated values) and one of each value head (``attn_in``'s v rows,
       ``attn_out``'s input)."""
    from torch import nn
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(family, Family):
        raise TypeError(f"family must be a qcore.adapters.families.Family, got {type(family).__name__}")
    mt, cls = _model_type(model)
    if mt != family.model_type:
        raise ValueError(f"attach: the record is for model_type {family.model_type!r}, the model ({cls}) is "
                         f"{mt!r}")
    located = _locate(model, family, "attach")
    layers = model.get_submodule(located.layers)
    for i, layer in enumerate(layers):
        for n in family.layer_names():
            if _get(layer, n) is None:
                raise ValueError(f"attach: the {family.name} record names {n!r}, which layer {i} "
                                 f"({located.layers}.{i}, {type(layer).__name__}) does not have")
    sizes = _check_shapes(model, family, located, layers)
    _check_norm_kinds(model, family, located, layers)
    _check_function(model, family, located, layers, sizes)


def _refuse(fam: Family, field_: str, what: str) -> ValueError:
    return ValueError(f"attach: the {fam.name} record's {field_} contradicts the model: {what}")


def _io(m: Any, kind: str) -> Optional[tuple]:
    """``(in, out)`` features of a Linear-like module: its ``in_features`` / ``out_features``, else its 2-D
    weight read as ``kind`` lays it out (``linear`` [out, in], ``conv1d`` [in, out]); None when it has neither."""
    import torch
    i, o = getattr(m, "in_features", None), getattr(m, "out_features", None)
    if isinstance(i, int) and isinstance(o, int):
        return i, o
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor) and w.ndim == 2:
        return (int(w.shape[1]), int(w.shape[0])) if kind == "linear" else (int(w.shape[0]), int(w.shape[1]))
    return None


def _int(cfg: Any, name: str) -> Optional[int]:
    v = getattr(cfg, name, None)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _check_shapes(model: Any, fam: Family, loc: Located, layers: Any) -> dict:
    """Step 1 of ``check_record`` past the names: the shapes (and the projections' kind); returns the sizes the
    function checks use (``hidden``, ``heads``, ``kv_heads``, ``head_dim``, ``vocab``; None where unknown)."""
    import torch
    from torch import nn
    cfg = text_config(model.config)
    emb = _get(model, loc.embed)
    ew = getattr(emb, "weight", None)
    if emb is None or not isinstance(ew, torch.Tensor) or ew.ndim != 2:
        raise _refuse(fam, f"embed={fam.embed!r}", f"{loc.embed} is "
                      f"{'missing' if emb is None else f'a {type(emb).__name__} without a 2-D weight'}; expected the "
                      f"token embedding")
    vocab, edim = int(ew.shape[0]), int(ew.shape[1])
    hidden = _int(cfg, "hidden_size") or edim
    nh = _int(cfg, "num_attention_heads")
    kv = _int(cfg, "num_key_value_heads") or nh
    hd = _int(cfg, "head_dim") or (hidden // nh if nh and hidden % nh == 0 else None)
    if fam.pos_embed is not None:
        pe = _get(model, loc.pos_embed)
        pw = getattr(pe, "weight", None)
        if not isinstance(pw, torch.Tensor) or pw.ndim != 2 or pw.shape[1] != edim:
            raise _refuse(fam, f"pos_embed={fam.pos_embed!r}", f"{loc.pos_embed} is "
                          f"{'missing' if pe is None else type(pe).__name__}; expected a position embedding of "
                          f"{edim} features")

    def norm_size(m: Any, path: str, field_: str, size: Optional[int], what: str) -> None:
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor) or w.ndim != 1 or (size is not None and w.shape[0] != size):
            got = f"weight {tuple(w.shape)}" if isinstance(w, torch.Tensor) else "no weight"
            raise _refuse(fam, field_, f"{path} ({type(m).__name__}) has {got}; a norm of {what} has one weight "
                          f"per channel ({size})")

    if fam.final_norm is not None:
        fn = _get(model, loc.final_norm)
        if fn is None:
            raise _refuse(fam, f"final_norm={fam.final_norm!r}", f"the model has no {loc.final_norm}")
        norm_size(fn, loc.final_norm, f"final_norm={fam.final_norm!r}", hidden, "the hidden size")
    if fam.lm_head is not None:
        head = _get(model, fam.lm_head)
        io = None if head is None else _io(head, "linear")
        if head is None or io is None:
            raise _refuse(fam, f"lm_head={fam.lm_head!r}", "the model has no such module" if head is None else
                          f"{fam.lm_head} is a {type(head).__name__}, not a Linear-like output head")
        if io[0] not in (hidden, edim) or io[1] != vocab:
            raise _refuse(fam, f"lm_head={fam.lm_head!r}", f"{fam.lm_head} maps {io[0]} -> {io[1]} features; the "
                          f"output head maps the hidden size {hidden} to the vocabulary {vocab}")
    e = fam.experts
    count = None if e is None else _int(cfg, e.count)
    if e is not None and count is None:
        raise _refuse(fam, f"experts.count={e.count!r}", f"the config ({type(cfg).__name__}) has no positive "
                      f"integer {e.count!r}")
    for i, layer in enumerate(layers):
        at = f"{loc.layers}.{i}"
        for f in ("attn_norm", "mlp_norm"):
            n = getattr(fam, f)
            if n is not None:
                norm_size(_get(layer, n), f"{at}.{n}", f"{f}={n!r}", hidden, "the residual stream")
        for n in fam.output_norms:
            norm_size(_get(layer, n), f"{at}.{n}", f"output_norms ({n!r})", hidden, "a block output")
        for n in fam.qk_norms:
            norm_size(_get(layer, n), f"{at}.{n}", f"qk_norms ({n!r})", hd, "one head")
        io = {}
        for f, names in (("attn_in", fam.attn_in), ("attn_out", (fam.attn_out,)), ("mlp_in", fam.mlp_in),
                         ("mlp_out", () if fam.mlp_out is None else (fam.mlp_out,))):
            for n in names:
                m = _get(layer, n)
                conv = type(m).__name__ == "Conv1D"
                if (fam.linear == "linear" and conv) or (fam.linear == "conv1d" and isinstance(m, nn.Linear)):
                    raise _refuse(fam, f"linear={fam.linear!r}", f"{at}.{n} is a {type(m).__name__}")
                io[n] = _io(m, fam.linear)
                if io[n] is None:
                    continue
                side, k = ("reads", 0) if f.endswith("_in") else ("writes", 1)
                if io[n][k] != hidden:
                    raise _refuse(fam, f"{f} ({n!r})", f"{at}.{n} {side} {io[n][k]} features, not the hidden "
                                  f"size {hidden}")
        o = io[fam.attn_out]
        if len(fam.attn_in) == 3 and all(io[n] is not None for n in fam.attn_in) and o is not None:
            (_, q), (_, k), (_, v) = (io[n] for n in fam.attn_in)
            if k != v or (nh and hd and (q, k) != (nh * hd, kv * hd)):
                heads = f"; the config has {nh} heads, {kv} key-value heads of {hd}" if nh and hd else ""
                raise _refuse(fam, f"attn_in={fam.attn_in!r}", f"q, k, v of {at} write {q}, {k}, {v} rows{heads}")
            if nh and hd and o[0] != nh * hd:
                raise _refuse(fam, f"attn_out={fam.attn_out!r}", f"{at}.{fam.attn_out} reads {o[0]} features, "
                              f"not the {nh} query heads of {hd}")
        elif len(fam.attn_in) == 1 and io[fam.attn_in[0]] is not None and nh and hd:
            rows = io[fam.attn_in[0]][1]
            if rows != (nh + 2 * kv) * hd:
                raise _refuse(fam, f"attn_in={fam.attn_in!r}", f"{at}.{fam.attn_in[0]} writes {rows} rows, not "
                              f"q, k and v of {nh} + 2 x {kv} heads of {hd}")
        if fam.mlp_out is not None and io[fam.mlp_out] is not None and all(io[n] is not None for n in fam.mlp_in):
            inner = io[fam.mlp_out][0]
            outs = [io[n][1] for n in fam.mlp_in]
            ok = outs == [inner, inner] if len(outs) == 2 else outs[0] in (inner, 2 * inner)
            if not ok:
                raise _refuse(fam, f"mlp_in={fam.mlp_in!r}", f"{at}: {', '.join(fam.mlp_in)} write {outs} features "
                              f"and {fam.mlp_out} reads {inner}")
        if e is not None:
            ex = _get(layer, e.path)
            gu, dn = getattr(ex, e.gate_up, None), getattr(ex, e.down, None)
            if not (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.ndim == dn.ndim == 3
                    and gu.shape[0] == dn.shape[0] == count and gu.shape[2] == dn.shape[1] == hidden
                    and gu.shape[1] == 2 * dn.shape[2]):
                got = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in (gu, dn)]
                raise _refuse(fam, f"experts ({e.path!r}: {e.gate_up!r}, {e.down!r})", f"{at}.{e.path} has "
                              f"{got}; expected [{count}, 2I, {hidden}] and [{count}, {hidden}, I]")
            r = _io(_get(layer, e.router), "linear")
            if r is not None and r != (hidden, count):
                raise _refuse(fam, f"experts.router={e.router!r}", f"{at}.{e.router} maps {r[0]} -> {r[1]}; "
                              f"expected {hidden} -> {count} experts")
            if e.shared is not None:
                for n in e.shared_mlp:
                    if _get(layer, f"{e.shared}.{n}") is None:
                        raise _refuse(fam, f"experts.shared_mlp ({n!r})", f"{at}.{e.shared} has no {n}")
    return dict(hidden=hidden, heads=nh, kv_heads=kv, head_dim=hd, vocab=vocab)


_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")


def _check_norm_kinds(model: Any, fam: Family, loc: Located, layers: Any) -> None:
    """Step 2 of ``check_record``: every named norm computes what the record's ``norm`` says, on a probe of
    values far from the norm's epsilon (every named norm of every layer, and the final norm)."""
    import torch
    gen = torch.Generator().manual_seed(0)
    named = [(loc.final_norm, _get(model, loc.final_norm))] if fam.final_norm is not None else []
    for i, layer in enumerate(layers):
        named += [(f"{loc.layers}.{i}.{n}", _get(layer, n)) for n in fam.norm_names()]
    with torch.no_grad():
        for path, m in named:
            w = m.weight
            b = getattr(m, "bias", None)
            x = (torch.randn((3, w.shape[0]), generator=gen, dtype=torch.float64) * 4 + 2)
            got = m(x.to(device=w.device, dtype=w.dtype)).double().cpu()
            wd = w.detach().double().cpu()
            if fam.norm == "layernorm":
                c = x - x.mean(-1, keepdim=True)
                want = c / c.pow(2).mean(-1, keepdim=True).sqrt() * wd
                want = want + (b.detach().double().cpu() if isinstance(b, torch.Tensor) else 0)
            else:
                want = x / x.pow(2).mean(-1, keepdim=True).sqrt() * (wd + 1 if fam.norm == "rms_unit_offset" else wd)
            diff = float((got - want).norm() / want.norm().clamp_min(1e-30))
            if not diff <= _tolerance(w.dtype):
                said = {"rms": "x / rms(x) * w", "rms_unit_offset": "x / rms(x) * (1 + w)",
                        "layernorm": "(x - mean) / std * w + b"}[fam.norm]
                raise _refuse(fam, f"norm={fam.norm!r}", f"{path} ({type(m).__name__}) does not compute {said} "
                              f"(relative difference {diff:.3g} on a probe input)")


def _tolerance(dtype: Any) -> float:
    import torch
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    return max(1e-4, 16 * eps)


def _output(out: Any) -> Any:
    """What the function checks compare: a transformers output's ``logits`` (a head model) or
    ``last_hidden_state`` (a backbone, an encoder)."""
    import torch
    for k in ("logits", "last_hidden_state"):
        v = getattr(out, k, None)
        if isinstance(v, torch.Tensor):
            return v
    raise TypeError(f"the model's output is a {type(out).__name__} without logits or a hidden state")


def _check_function(model: Any, fam: Family, loc: Located, layers: Any, sizes: dict) -> None:
    """Step 3 of ``check_record`` (its docstring): the folds the record implies, emulated by hooks on a probe
    batch, leave the model's output unchanged."""
    import torch
    from .batches import as_found
    emb = model.get_submodule(loc.embed)
    dev = emb.weight.device
    ids = torch.randint(0, sizes["vocab"], (1, 8), generator=torch.Generator().manual_seed(0)).to(dev)
    gen_seed, made = [0], {}

    def scales(width: int) -> torch.Tensor:  # log-uniform in [1/8, 8], the same for one width within a check
        key = ("s", width, gen_seed[0])
        if key not in made:
            g = torch.Generator().manual_seed(1000 * gen_seed[0] + width)
            made[key] = torch.pow(2.0, torch.rand(width, generator=g, dtype=torch.float64) * 6 - 3).to(dev)
        return made[key]

    def orthogonal(n: int) -> torch.Tensor:  # random orthogonal, the same for one size within a check
        key = ("q", n, gen_seed[0])
        if key not in made:
            g = torch.Generator().manual_seed(1000 * gen_seed[0] + n + 7)
            q, r = torch.linalg.qr(torch.randn((n, n), generator=g, dtype=torch.float64))
            made[key] = (q * torch.sign(torch.diagonal(r))).to(dev)
        return made[key]

    def times(t: torch.Tensor, f) -> torch.Tensor:
        return f(t.double()).to(t.dtype)

    def out_hook(f):
        return lambda m, args, y: times(y, f)

    def in_hook(f):
        return lambda m, args: (times(args[0], f), *args[1:])

    handles: list = []

    def on_out(m, f):
        handles.append(m.register_forward_hook(out_hook(f)))

    def on_in(m, f):
        handles.append(m.register_forward_pre_hook(in_hook(f), prepend=True))

    with as_found(model), torch.no_grad():
        try:
            raw = _output(model(ids))
        except Exception as e:  # noqa: BLE001 - any failure of the user's model: the record cannot be checked
            raise ValueError(f"attach: cannot check the {fam.name} record against the model's function: "
                             f"{type(model).__name__} does not run a probe batch of token ids ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
        ref, tol = raw.double(), _tolerance(raw.dtype)

        def check(field_: str, what: str) -> None:
            try:
                try:
                    got = _output(model(ids)).double()
                finally:
                    for h in handles:
                        h.remove()
                    handles.clear()
            except Exception as e:  # noqa: BLE001 - the hooks the record implies do not fit the model
                raise _refuse(fam, field_, f"{what} fails on a probe batch ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
            diff = float((got - ref).norm() / ref.norm().clamp_min(1e-30)) if got.shape == ref.shape else float("inf")
            if not diff <= tol:
                raise _refuse(fam, field_, f"{what} changes the model's output (relative difference {diff:.3g} on "
                              f"a probe batch; float rounding allows {tol:.3g})")

        for k, rule in enumerate(fam.scaling):
            g, any_layer = rule.group, False
            gen_seed[0] = k
            for layer in layers:
                if not _rule_applies(layer, fam, rule):
                    continue
                any_layer = True
                on_out(_get(layer, g.prev_op), lambda y: y * scales(y.shape[-1]))
                for n in g.layers:
                    on_in(_get(layer, n), lambda x: x / scales(x.shape[-1]))
            if any_layer:
                check(f"scaling[{k}] ({g.prev_op} -> {', '.join(g.layers)})",
                      f"dividing {g.prev_op}'s output by random positive scales and multiplying "
                      f"{', '.join(g.layers)}'s inputs by them")
        if fam.rotation:
            return
        folds = [("attn_norm", fam.attn_norm, "attn_in", fam.attn_in, None),
                 ("mlp_norm", fam.mlp_norm, "mlp_in", fam.mlp_in, None)]
        for k, (fn, norm, fr, readers, _) in enumerate(folds):
            if norm is None:
                continue
            gen_seed[0] = 100 + k
            for layer in layers:
                on_out(_get(layer, norm), lambda y: y * scales(y.shape[-1]))
                for n in readers:
                    on_in(_get(layer, n), lambda x: x / scales(x.shape[-1]))
            check(f"{fn}={norm!r} / {fr}={readers!r}", f"folding {norm}'s weight into {', '.join(readers)}")
        if fam.final_norm is not None and fam.lm_head is not None:
            gen_seed[0] = 102
            on_out(model.get_submodule(loc.final_norm), lambda y: y * scales(y.shape[-1]))
            on_in(model.get_submodule(fam.lm_head), lambda x: x / scales(x.shape[-1]))
            check(f"final_norm={fam.final_norm!r} / lm_head={fam.lm_head!r}",
                  f"folding {loc.final_norm}'s weight into {fam.lm_head}")
        gen_seed[0] = 103
        rot, back = (lambda t: t @ orthogonal(t.shape[-1])), (lambda t: t @ orthogonal(t.shape[-1]).T)
        if fam.final_norm is None and fam.lm_head is None:
            _check_heads(fam, layers, sizes, on_out, on_in, orthogonal, gen_seed, check)
            return  # nothing named reads the last residual stream: the model's output is it, rotated
        on_out(emb, rot)
        if fam.pos_embed is not None:
            on_out(model.get_submodule(loc.pos_embed), rot)
        norms = [n for n in (fam.attn_norm, fam.mlp_norm) if n is not None]
        for layer in layers:
            for n in norms:
                on_in(_get(layer, n), back)
                on_out(_get(layer, n), rot)
            for n in fam.attn_in + fam.mlp_in:
                on_in(_get(layer, n), back)
            for n in (fam.attn_out, fam.mlp_out):
                on_out(_get(layer, n), rot)
        if fam.final_norm is not None:  # the model's output: the head's, or the final norm's without a head
            on_in(model.get_submodule(loc.final_norm), back)
            if fam.lm_head is not None:
                on_out(model.get_submodule(loc.final_norm), rot)
        if fam.lm_head is not None:
            on_in(model.get_submodule(fam.lm_head), back)
        check("rotation='' (embed, attn_in, attn_out, mlp_in, mlp_out, lm_head, output_norms)",
              "rotating the residual stream (QuaRot's R1) where the record says it is read and written")
        _check_heads(fam, layers, sizes, on_out, on_in, orthogonal, gen_seed, check)


def _check_heads(fam: Family, layers: Any, sizes: dict, on_out, on_in, orthogonal, gen_seed, check) -> None:
    """The last function check of ``_check_function``: a random orthogonal rotation of each value head on
    ``attn_in``'s value rows, undone on ``attn_out``'s input (QuaRot's R2)."""
    import torch
    nh, kv, hd = sizes["heads"], sizes["kv_heads"], sizes["head_dim"]
    if nh and hd:  # (a fused qkv's value rows where QuaRot takes them: the concat layout's)
        gen_seed[0] = 104
        vname = fam.attn_in[2] if len(fam.attn_in) == 3 else fam.attn_in[0]
        rows = slice(None) if len(fam.attn_in) == 3 else slice((nh + kv) * hd, (nh + 2 * kv) * hd)

        def per_head(t: torch.Tensor, transpose: bool) -> torch.Tensor:
            q = orthogonal(hd)
            q = q.T if transpose else q
            return (t.reshape(*t.shape[:-1], -1, hd) @ q).reshape(t.shape)

        def values(y: torch.Tensor) -> torch.Tensor:
            y = y.clone()
            y[..., rows] = per_head(y[..., rows], False)
            return y

        for layer in layers:
            on_out(_get(layer, vname), values)
            on_in(_get(layer, fam.attn_out), lambda x: per_head(x, True))
        check(f"attn_in={fam.attn_in!r} / attn_out={fam.attn_out!r}",
              f"rotating each value head (QuaRot's R2) on {vname}'s value rows and {fam.attn_out}'s input")


def _rule_applies(layer: Any, fam: Family, rule: ScalingRule) -> bool:
    """Whether ``rule`` applies to ``layer`` (``ScalingRule``'s conditions and ``Family.scaling_requires``), as
    qcore.adapters.passes.scaling decides it."""
    from torch import nn
    if fam.scaling_requires is not None and getattr(layer, fam.scaling_requires, None) is not True:
        return False
    g = rule.group
    if rule.sizes_match:
        p = _io(_get(layer, g.prev_op), fam.linear)
        if p is None or any((_io(_get(layer, n), fam.linear) or (None,))[0] != p[1] for n in g.layers):
            return False
    if rule.relu and type(_get(layer, fam.act)) is not nn.ReLU:
        return False
    return not any(_get(layer, n) is not None for n in rule.absent)

"""llama.cpp's quantization mixes (Q4_K_M, Q3_K_M, Q2_K, ...) on a transformers model: ``gguf_mix``.

``gguf_mix(model, "Q4_K_M")`` gives the GGUF type llama.cpp's own quantizer (``llama_model_quantize``) would give
each tensor of the model's F16 / F32 GGUF export (``qcore.formats.gguf_mixes.tensor_types``: the rules as data,
from llama.cpp's ``llama_tensor_get_type``), and the qcore ``ModelConfig`` that quantizes each module with that
type (``LayerConfig(weight=qcore.make_spec("q6_k"))``, ...), so that ``quantize_model(model, mix.config)`` then
``export_gguf`` writes a file whose every tensor has the type llama.cpp's ``Q4_K_M`` file has.
``quantize_model(model, "gguf_q4_k_m")`` does the same by preset name (``GGUF_MIX_PRESETS``).

The tensor names are the model's GGUF names (``qcore.adapters.gguf_names.gguf_names``), so every family qcore writes
as GGUF works. A tied head (SmolLM2, Gemma) has no ``output.weight`` in the file: llama.cpp quantizes
``token_embd`` as the output (Q6_K, or Q8_0 where its rows are not a multiple of 256: SmolLM2's 576) and computes
the head with it; the config gives the head module the embedding's spec, so the tied modules share one quantized
weight (the same scales: ``src/qcore/adapters/modules/base.py`` ``_inplace_quantize``) and the model computes what
llama.cpp computes. A tensor llama.cpp writes as F16 (rows not a multiple of 32) stays float in qcore.

Fused MoE experts (``QuantExperts``) get llama.cpp's types: the module the type of ``ffn_gate_exps`` /
``ffn_up_exps`` and, where the mix types ``ffn_down_exps`` apart (Q4_K_M's ``use_more_bits`` layers, Q3_K_M, Q2_K,
...), ``<experts>.down_proj`` its own (a ``by_name`` entry: the experts' per-projection weight spec, in ``types``
under that name). ``exclude=["*experts*"]`` keeps them float.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from torch import nn

import qcore
from qcore.formats import gguf as G
from qcore.formats import gguf_mixes as GM

from .config import LayerConfig, ModelConfig, match_tree
from .gguf_names import expert_names, gguf_arch, gguf_family, gguf_names
from .modules import IN_OUT, quantizable_type, weight_layout
from .presets import GGUF_MIX_PRESETS, mix_of_preset  # noqa: F401  (re-exported: the preset names of the mixes)

__all__ = ["GGUFMix", "gguf_mix", "gguf_file_types", "GGUF_MIX_PRESETS", "mix_of_preset"]

@dataclass(frozen=True)
class GGUFMix:
    """llama.cpp's mix ``mix`` resolved on one model.

    config: the ``ModelConfig`` (a ``by_name`` entry per quantized module, embedding and head included).
    types: ``{module name: GGUF type}`` of the modules the config quantizes (``"Q4_K"``, ...; the type each has
        in the exported file); fused experts: their gate/up type, and ``<experts>.down_proj`` where the mix types
        ``ffn_down_exps`` apart.
    choices: ``{GGUF tensor name: Choice}`` for every tensor of the file (kept ones too), with the reason and any
        fallback.
    tensors: ``{module name: GGUF tensor name}`` of the modules in ``types``.
    kept_float: ``{module name: why}`` of the modules llama.cpp quantizes and this config leaves float (rows it
        writes as F16, ``exclude``, a module type qcore does not wrap such as Gemma's scaled embedding).
    """

    mix: str
    config: ModelConfig
    types: Mapping[str, str]
    choices: Mapping[str, GM.Choice]
    tensors: Mapping[str, str] = field(default_factory=dict)
    kept_float: Mapping[str, str] = field(default_factory=dict)

    def counts(self) -> dict:
        """``{GGUF type: number of quantized tensors}`` of the file, most common first."""
        return GM.type_counts(self.choices)

    def fallbacks(self) -> dict:
        """``{GGUF tensor name: Choice}`` of the tensors whose rows the mix's type does not fit."""
        return {n: c for n, c in self.choices.items() if c.quantized and c.fallback}

    def summary(self) -> str:
        """A short table: the number of tensors of each type, then each fallback (rows the wanted type's block
        does not divide), grouped by role."""
        lines = [f"llama.cpp {self.mix}: " + ", ".join(f"{t} x{n}" for t, n in self.counts().items())]
        groups: dict = {}
        for n, c in self.fallbacks().items():
            role = n.split(".", 2)[-1] if n.startswith("blk.") else n
            roles = groups.setdefault((c.wanted, c.type), {})
            roles[role.removesuffix(".weight")] = roles.get(role.removesuffix(".weight"), 0) + 1
        for (wanted, typ), roles in groups.items():
            lines.append(f"  fallback {wanted} -> {typ} (rows not a multiple of {GM.BLOCK_SIZES[wanted]}): "
                         + ", ".join(f"{r} x{k}" for r, k in sorted(roles.items())))
        for m, why in list(self.kept_float.items())[:4]:
            lines.append(f"  kept float: {m} ({why})")
        if len(self.kept_float) > 4:
            lines.append(f"  kept float: ... ({len(self.kept_float)} modules)")
        return "\n".join(lines)


def _file_tensors(model: nn.Module) -> tuple[dict, dict, dict]:
    """What ``export_gguf`` would write, as shapes: ``({GGUF tensor name: shape}, {module: GGUF base name},
    {experts module: GGUF layer prefix})``; a head tied to the embedding has no tensor (llama.cpp computes it with
    ``token_embd``)."""
    import torch

    fam, loc, arch = gguf_family(model)
    names, experts = gguf_names(model), expert_names(model)
    sd = model.state_dict(keep_vars=True)
    emb = sd.get(f"{loc.embed}.weight")
    shapes: dict = {}
    for k, t in sd.items():
        mod, _, leaf = k.rpartition(".")
        if mod in experts:
            e, two_i, h = model.get_submodule(mod).gate_up_proj.shape
            blk = experts[mod]
            d = model.get_submodule(mod).down_proj.shape
            shapes.update({f"{blk}.{G.EXPERT_TENSORS[0]}.weight": (e, two_i // 2, h),
                           f"{blk}.{G.EXPERT_TENSORS[1]}.weight": (e, two_i // 2, h),
                           f"{blk}.{G.EXPERT_TENSORS[2]}.weight": tuple(d)})
            continue
        base = names.get(mod)
        if base is None or leaf not in ("weight", "bias") or not isinstance(t, torch.Tensor):
            continue
        if base == "output" and leaf == "weight" and (t is emb or not arch.output):
            continue  # a tied head: llama.cpp computes it with token_embd
        shape = tuple(t.shape)
        if leaf == "weight" and weight_layout(model.get_submodule(mod)) == IN_OUT:
            shape = shape[::-1]  # GPT-2's Conv1D [in, out]: written as the Linear [out, in] it is (rows: in)
        shapes[f"{base}.{leaf}"] = shape
    return shapes, names, experts


def _hparams(model: nn.Module) -> dict:
    _, loc, _ = gguf_family(model)
    _, arch, meta, cfg = gguf_arch(model)  # what export_gguf refuses for the architecture alone, refused here too
    a = arch.name

    def get(key, default=None):
        v = meta.get(f"{a}.{key}")
        return default if v is None else int(v[0])
    n_layer = len(model.get_submodule(loc.layers))
    n_head = get("attention.head_count") or int(model.config.num_attention_heads)  # GPT-2's n_head: attribute_map
    return dict(arch=a, n_layer=get("block_count", n_layer), n_head=n_head,
                n_head_kv=get("attention.head_count_kv", n_head), n_expert=get("expert_count", 0))


def gguf_file_types(model: nn.Module, mix: str, *, imatrix: bool = False) -> dict:
    """``{GGUF tensor name: Choice}``: the type llama.cpp's quantizer gives each tensor of the model's float GGUF
    export (``export_gguf`` of the float model) in ``mix``, and why (``qcore.formats.gguf_mixes.tensor_types``
    on the model's GGUF names, shapes and hyperparameters). Fused experts included; nothing is refused but what
    llama.cpp refuses."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    mix = GM.mix_name(mix)
    shapes, _, _ = _file_tensors(model)
    return GM.tensor_types(mix, shapes, imatrix=imatrix, **_hparams(model))


def gguf_mix(model: nn.Module, mix: str, *, exclude: Optional[Sequence[str]] = None,
             imatrix: bool = False) -> GGUFMix:
    """llama.cpp's mix ``mix`` (``"Q4_K_M"``, ``"Q3_K_M"``, ``"Q2_K"``, ...; ``qcore.formats.gguf_mixes.MIX_NAMES``,
    case-insensitive) resolved on ``model`` (a transformers causal LM of a family qcore writes as GGUF): the type of
    every tensor, the reason, and the ``ModelConfig`` that quantizes each module with its type. Pure: the model is
    not changed. ValueError (before any work) for an unknown mix, a family or config qcore does not write as GGUF,
    or fused MoE experts whose llama.cpp types qcore cannot hold (gate and up apart, or a type with no GGUF spec)
    that ``exclude`` does not name.

    exclude: module names / patterns (glob or ``"re:..."``, as ``ModelConfig.exclude``) left float (default:
        none: llama.cpp quantizes the head too). Excluding one of a tied embedding / head excludes both.
    imatrix: the types llama.cpp gives when it is given an importance matrix (only Q4_0 / Q5_0 change: their
        first n/8 ``ffn_down`` layers get Q4_1 / Q5_1).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    mix = GM.mix_name(mix)
    if exclude is not None and (isinstance(exclude, str) or not all(isinstance(p, str) for p in exclude)):
        raise TypeError(f"exclude must be a list of module names / patterns, got {exclude!r}")
    if not isinstance(imatrix, bool):
        raise TypeError(f"imatrix must be a bool, got {imatrix!r}")
    shapes, names, experts = _file_tensors(model)
    choices = GM.tensor_types(mix, shapes, imatrix=imatrix, **_hparams(model))
    patterns = list(exclude or ())
    _, loc, _ = gguf_family(model)
    tied = loc.lm_head is not None and "output.weight" not in shapes
    tie = {loc.embed, loc.lm_head} if tied else set()

    def excluded(n):
        return any(match_tree(p, m) for p in patterns for m in ({n} | (tie if n in tie else set())))
    unwrapped = {m for m in names if quantizable_type(model.get_submodule(m)) is None}
    if tie & unwrapped:  # a tied pair stays float together (one weight, one config)
        unwrapped |= tie
    types, tensors, kept = {}, {}, {}
    for mod, base in names.items():
        if f"{base}.weight" in shapes:
            c = choices[f"{base}.weight"]
        elif mod == loc.lm_head and tied:
            c = choices["token_embd.weight"]
            base = "token_embd"
        else:
            continue
        if not c.quantized:
            continue
        if excluded(mod) or mod in unwrapped or c.type in ("F16", "F32", "BF16"):
            kept[mod] = f"llama.cpp: {c.type}; " + (
                "excluded" if excluded(mod) else "rows of no block type: F16" if mod not in unwrapped else
                f"qcore does not quantize {type(model.get_submodule(mod)).__name__}" if quantizable_type(
                    model.get_submodule(mod)) is None else "tied to a module qcore does not quantize")
            continue
        types[mod], tensors[mod] = c.type, f"{base}.weight"
    for mod, blk in experts.items():
        if excluded(mod):
            kept[mod] = "excluded"
            continue
        gate, up, down = G.EXPERT_TENSORS
        ts = {r: choices[f"{blk}.{r}.weight"].type for r in G.EXPERT_TENSORS}
        if ts[gate] == ts[up] and all(t.lower() in qcore.GGUF_DTYPES for t in ts.values()):
            # the experts' GGUF spec is gate/up's; down_proj its own when llama.cpp types ffn_down_exps apart
            # (by_name "<experts>.down_proj": QuantExperts' per-projection weight spec)
            types[mod], tensors[mod] = ts[gate], f"{blk}.{gate}.weight"
            if ts[down] != ts[gate]:
                types[f"{mod}.down_proj"], tensors[f"{mod}.down_proj"] = ts[down], f"{blk}.{down}.weight"
            continue
        raise ValueError(f"gguf_mix: llama.cpp's {mix} gives the experts of {blk} the types {ts}, which qcore's fused "
                         f"experts ({mod!r}) cannot hold (gate and up share one spec; every type a GGUF spec): "
                         f"exclude them (exclude=['*experts*'] keeps the experts float; every other tensor gets "
                         f"llama.cpp's type)")
    by_name = {m: LayerConfig(weight=qcore.make_spec(t.lower())) for m, t in types.items()}
    ex = tuple(patterns) + tuple(sorted(m for m in tie if patterns and excluded(m) and
                                        not any(match_tree(p, m) for p in patterns)))
    config = ModelConfig(LayerConfig(), by_name=by_name, exclude=ex)
    return GGUFMix(mix, config, types, choices, tensors, kept)

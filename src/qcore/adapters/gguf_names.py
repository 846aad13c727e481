"""GGUF names of a model's tensors, from its family record (architecture knowledge as data): which llama.cpp
architecture a family is written as (``gguf_family``), the tensor name of every module (``gguf_names``: the map
``export_gguf`` writes with, ``from_gguf`` reads with, ``gguf_mix`` types and ``collect_imatrix`` names entries
by), the fused experts' layer prefixes (``expert_names``) and the checks the architecture alone decides
(``gguf_arch``). No tensors are read or written here.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from qcore.formats import gguf as G

from .families import FAMILIES, UnknownFamily, family_of, locate

__all__ = ["gguf_family", "gguf_names", "expert_names", "gguf_arch", "family_problem", "layer_names",
           "writable_families"]


def writable_families() -> list:
    return [f.model_type for f in FAMILIES if f.gguf_arch in G.ARCHS
            and (f.experts is None or G.ARCHS[f.gguf_arch].moe_layer is not None)]


def family_problem(fam) -> Optional[str]:
    """Why qcore cannot write (or read) GGUF for the family record ``fam`` (None: it can)."""
    mt = fam.model_type
    if fam.gguf_arch is None:
        return (f"model_type {mt!r} is not supported: llama.cpp has no architecture for it (its record "
                f"{fam.name!r} has no gguf_arch); qcore writes GGUF for {writable_families()}")
    if fam.gguf_arch not in G.ARCHS:
        return (f"model_type {mt!r} is not supported: qcore does not write llama.cpp's {fam.gguf_arch!r} "
                f"architecture (its record {fam.name!r}; qcore.formats.gguf.ARCHS has {sorted(G.ARCHS)}); qcore "
                f"writes GGUF for {writable_families()}")
    arch = G.ARCHS[fam.gguf_arch]
    if fam.experts is not None and arch.moe_layer is None:
        return (f"model_type {mt!r} is not supported: its mixture-of-experts layers ({fam.experts.path}) have no "
                f"place in llama.cpp's {arch.name!r} graph; qcore writes GGUF for {writable_families()}")
    if fam.norm != arch.family_norm:  # the graph's norm kind (Arch.norm, norm_offset) against the record's
        how = ("a LayerNorm (weight and bias)" if arch.norm == "layernorm" else
               f"an RMS norm times the stored weight{' + 1' if arch.norm_offset else ''}")
        return (f"model_type {mt!r} is not supported: its norms are {fam.norm!r}, llama.cpp's {arch.name!r} graph "
                f"computes {how}")
    return None


def layer_names(fam) -> dict:
    """Module names of one layer (relative) -> llama.cpp tensor names, from the family record."""
    q = ("attn_q", "attn_k", "attn_v") if len(fam.attn_in) == 3 else ("attn_qkv",)
    up = ("ffn_gate", "ffn_up") if len(fam.mlp_in) == 2 else ("ffn_up",)
    out = dict(zip(fam.attn_in, q))
    out.update({fam.attn_out: "attn_output", fam.mlp_norm: "ffn_norm"})
    ex = fam.experts
    if ex is None:
        out.update({**dict(zip(fam.mlp_in, up)), fam.mlp_out: "ffn_down"})
    else:  # the experts module itself is written as G.EXPERT_TENSORS (_expert_names)
        out[ex.router] = "ffn_gate_inp"
        if ex.shared is not None:
            out.update({f"{ex.shared}.{n}": t for n, t in zip(ex.shared_mlp, ("ffn_gate_shexp", "ffn_up_shexp",
                                                                            "ffn_down_shexp"))})
        if ex.shared_gate is not None:
            out[ex.shared_gate] = "ffn_gate_inp_shexp"
    if fam.attn_norm is not None:
        out[fam.attn_norm] = "attn_norm"
    out.update(zip(fam.qk_norms, ("attn_q_norm", "attn_k_norm")))
    out.update(zip(fam.output_norms, ("post_attention_norm", "post_ffw_norm")))  # on the attention / MLP outputs
    return out


def gguf_family(model: nn.Module):
    """``(record, located, arch)`` of a model qcore writes as GGUF: its family record, where its backbone sits
    (``families.locate``) and llama.cpp's architecture (``formats.gguf.Arch``). ValueError (TypeError without a
    transformers config) naming the model_type and what is missing."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        raise TypeError("export_gguf: the model has no transformers config (model.config)")
    try:
        fam = family_of(model)
    except UnknownFamily as e:
        raise ValueError(f"export_gguf: model_type {getattr(cfg, 'model_type', None)!r} is not supported: {e}; "
                         f"qcore writes GGUF for {writable_families()}") from None
    why = family_problem(fam)
    if why:
        raise ValueError(f"export_gguf: {why}")
    arch = G.ARCHS[fam.gguf_arch]
    layer = layer_names(fam)
    have = set(layer.values()) | (set(G.EXPERT_TENSORS) if fam.experts is not None else set())
    want = arch.layer if fam.experts is None else arch.moe_layer
    extra = sorted(have - set(want))
    if extra:
        raise ValueError(f"export_gguf: model_type {fam.model_type!r}: llama.cpp's {arch.name!r} graph has no "
                         f"tensor for {extra} (the record's {[k for k, v in layer.items() if v in extra]})")
    lacking = sorted(set(want) - have)
    if lacking:
        raise ValueError(f"export_gguf: model_type {fam.model_type!r}: llama.cpp's {arch.name!r} graph needs "
                         f"{lacking}, which the {fam.name} record does not name")
    if (fam.pos_embed is not None) != arch.position_embd:
        raise ValueError(f"export_gguf: model_type {fam.model_type!r}: llama.cpp's {arch.name!r} graph "
                         f"{'adds' if arch.position_embd else 'has no'} learned positions (position_embd); the "
                         f"{fam.name} record's pos_embed is {fam.pos_embed!r}")
    loc = locate(model, what="export_gguf")
    if loc.prefix != fam.backbone:
        where = ("a bare backbone without its head" if loc.prefix == "" else
                 f"a vision-language model (its {fam.name} language tower at {loc.prefix}; llama.cpp keeps a "
                 f"vision tower in a separate mmproj file, which qcore does not write)")
        raise ValueError(f"export_gguf: {type(model).__name__} is {where}; qcore writes GGUF for a whole "
                         f"{fam.name} causal LM ({fam.backbone} + {fam.lm_head})")
    return fam, loc, arch


def gguf_names(model: nn.Module) -> dict:
    """Module name in ``model`` -> llama.cpp tensor name without ``.weight`` / ``.bias``
    (``model.layers.3.self_attn.q_proj`` -> ``blk.3.attn_q``), from the model's family record; the same map
    ``export_gguf`` writes with and ``from_gguf`` reads with."""
    fam, loc, arch = gguf_family(model)
    n_layers = len(model.get_submodule(loc.layers))
    out = {loc.embed: "token_embd"}
    if loc.pos_embed is not None:
        out[loc.pos_embed] = "position_embd"
    if loc.final_norm is not None:
        out[loc.final_norm] = "output_norm"
    if loc.lm_head is not None:
        out[loc.lm_head] = "output"
    layer = layer_names(fam)
    for i in range(n_layers):
        for k, v in layer.items():
            out[f"{loc.layers}.{i}.{k}"] = f"blk.{i}.{v}"
    return out


def expert_names(model: nn.Module) -> dict:
    """Fused experts module name in ``model`` -> its layer's GGUF prefix (``model.layers.3.mlp.experts`` ->
    ``blk.3``): written as ``blk.3.ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps`` (``G.EXPERT_TENSORS``)."""
    fam, loc, arch = gguf_family(model)
    if fam.experts is None:
        return {}
    n_layers = len(model.get_submodule(loc.layers))
    return {f"{loc.layers}.{i}.{fam.experts.path}": f"blk.{i}" for i in range(n_layers)}


def gguf_arch(model: nn.Module):
    """The checks the architecture alone decides, shared by ``check_gguf`` and ``export_gguf``: the family
    (``gguf_family``), then the config's settings llama.cpp's graph cannot run (``formats.gguf.metadata``), then a
    head llama.cpp would not read. Returns ``(record, arch, metadata, config dict)``."""
    fam, loc, arch = gguf_family(model)
    cfg = model.config.to_dict()
    try:
        meta = G.metadata(arch.name, cfg, experts=fam.experts is not None)
    except ValueError as e:
        raise ValueError(f"export_gguf: model_type {fam.model_type!r} ({arch.name!r} in GGUF): {e}") from None
    if not arch.output and loc.lm_head is not None and not cfg.get("tie_word_embeddings"):
        raise ValueError(f"export_gguf: model_type {fam.model_type!r}: llama.cpp's {arch.name!r} graph computes the "
                         f"head with token_embd, and the model's {loc.lm_head} is not tied to it")
    return fam, arch, meta, cfg

"""QuaRot's fused rotations for Llama-like transformers models (issue 11, first part): the float model computes the
same function, its weights and activations are spread by orthogonal (Hadamard) rotations before quantization.

``rotate_model(model, *, key=None, heads=True)`` in place, in float64 arithmetic cast back to each weight's dtype:

1. every RMSNorm's weight is folded into the Linears that read its output (``input_layernorm`` -> q, k, v;
   ``post_attention_layernorm`` -> gate, up; the final norm -> ``lm_head``), and set to ones; tied input and
   output embeddings are untied first (``config.tie_word_embeddings`` becomes False);
2. the residual stream is rotated by ``R1 = rotation(hidden, key=key)`` (``qcore.algorithms.hadamard``): the
   embedding rows and the input columns of q, k, v, gate, up, lm_head are multiplied by ``R1``; the output rows
   of o_proj and down_proj by ``R1^T``. RMSNorm with unit weight commutes with an orthogonal rotation, so the
   model's outputs are unchanged up to float rounding;
3. ``heads``: each attention head's values are rotated by ``R2 = rotation(head_dim, key=key)``: the rows of
   ``v_proj`` per key-value head by ``R2^T``, the columns of ``o_proj`` per query head by ``R2`` (grouped-query
   attention included: every query head reading a key-value head sees the same rotation).

Supported: layers with ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``input_layernorm``,
``post_attention_layernorm`` (RMSNorm without bias, not Gemma's ``1 + w`` form) and a model with
``model.embed_tokens``, ``model.norm``, ``lm_head``. Everything is checked before any weight changes (ValueError).
The online Hadamard transforms (before down_proj, across heads before o_proj) are not done here yet.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import nn

from qcore.algorithms.hadamard import rotation

__all__ = ["rotate_model"]

_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")


def _get(m, name):
    try:
        return m.get_submodule(name)
    except AttributeError:
        return None


def _check(model) -> tuple:
    inner = getattr(model, "model", None)
    emb, norm, head = _get(model, "model.embed_tokens"), _get(model, "model.norm"), getattr(model, "lm_head", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(emb, nn.Embedding) or norm is None or not isinstance(head, nn.Linear) or \
            not isinstance(layers, nn.ModuleList):
        raise ValueError(f"rotate_model: {type(model).__name__} is not a Llama-like causal LM (model.embed_tokens, "
                         f"model.layers, model.norm, lm_head)")
    for i, layer in enumerate(layers):
        for n in _LAYER:
            m = _get(layer, n)
            if m is None:
                raise ValueError(f"rotate_model: layer {i} ({type(layer).__name__}) has no {n}")
            if n.endswith("_proj") and type(m) is not nn.Linear:
                raise ValueError(f"rotate_model: model.layers.{i}.{n} is a {type(m).__name__}; rotate the float "
                                 f"model before quantizing it")
    for n, m in model.named_modules():
        if n.endswith("norm") and not type(m).__name__.endswith("RMSNorm"):
            raise ValueError(f"rotate_model: {n} is a {type(m).__name__}; only RMSNorm commutes with rotations")
        if type(m).__name__.startswith("Gemma"):
            raise ValueError(f"rotate_model: {n} is {type(m).__name__} (1 + w form): not supported")
        if n.endswith("norm") and getattr(m, "bias", None) is not None:
            raise ValueError(f"rotate_model: {n} has a bias")
    for i, layer in enumerate(layers):
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            if _get(layer, n).bias is not None:
                raise ValueError(f"rotate_model: model.layers.{i}.{n} has a bias (not supported yet)")
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return emb, norm, head, layers, int(hd)


@torch.no_grad()
def _set(p: torch.Tensor, v: torch.Tensor) -> None:
    p.copy_(v.to(p.dtype))


def _w(p):
    return p.detach().to(torch.float64)


@torch.no_grad()
def rotate_model(model: nn.Module, *, key: Optional[int] = None, heads: bool = True) -> nn.Module:
    """Fold norms and fuse QuaRot's rotations into ``model`` in place (module docstring); returns it."""
    emb, norm, head, layers, hd = _check(model)
    hidden = emb.weight.shape[1]
    dev = emb.weight.device
    r1 = torch.from_numpy(rotation(hidden, key=key)).to(dev)
    r2 = torch.from_numpy(rotation(hd, key=None if key is None else key + 1)).to(dev)
    if head.weight is emb.weight:  # untie: the head gets the final norm folded in, the embedding does not
        head.weight = nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False

    def fold(norm_mod, readers):
        g = _w(norm_mod.weight)
        for lin in readers:
            _set(lin.weight, _w(lin.weight) * g[None, :])
        _set(norm_mod.weight, torch.ones_like(g))

    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        fold(layer.input_layernorm, (a.q_proj, a.k_proj, a.v_proj))
        fold(layer.post_attention_layernorm, (m.gate_proj, m.up_proj))
    fold(norm, (head,))

    _set(emb.weight, _w(emb.weight) @ r1)
    _set(head.weight, _w(head.weight) @ r1)
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
            _set(lin.weight, _w(lin.weight) @ r1)
        for lin in (a.o_proj, m.down_proj):
            _set(lin.weight, r1.T @ _w(lin.weight))
        if heads:
            v, o = _w(a.v_proj.weight), _w(a.o_proj.weight)
            kv = v.shape[0] // hd
            v = (r2.T @ v.reshape(kv, hd, -1)).reshape(kv * hd, -1)
            if a.v_proj.bias is not None:
                _set(a.v_proj.bias, (r2.T @ _w(a.v_proj.bias).reshape(kv, hd, 1)).reshape(-1))
            nh = o.shape[1] // hd
            o = (o.reshape(-1, nh, hd) @ r2).reshape(o.shape[0], nh * hd)
            _set(a.v_proj.weight, v)
            _set(a.o_proj.weight, o)
    return model

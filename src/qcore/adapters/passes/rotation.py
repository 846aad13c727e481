"""QuaRot's fused rotations for Llama-like transformers models (issue 11, first part): the float model computes the
same function, its weights and activations are spread by orthogonal (Hadamard) rotations before quantization.

``rotate_model(model, *, key=0, heads=True, online=ONLINE)`` in place, in float64 arithmetic cast back to each weight's dtype:

1. every RMSNorm's weight is folded into the Linears that read its output (``input_layernorm`` -> q, k, v;
   ``post_attention_layernorm`` -> gate, up; the final norm -> ``lm_head``), and set to ones (zeros for a
   ``1 + w`` norm); tied input and output embeddings are untied first (``config.tie_word_embeddings`` becomes
   False);
2. the residual stream is rotated by ``R1 = rotation(hidden, key=key)`` (``qcore.algorithms.hadamard``): the
   embedding rows and the input columns of q, k, v, gate, up, lm_head are multiplied by ``R1``; the output rows
   of o_proj and down_proj by ``R1^T``. RMSNorm with unit weight commutes with an orthogonal rotation, so the
   model's outputs are unchanged up to float rounding;
3. ``heads``: each attention head's values are rotated by ``R2 = rotation(head_dim, key=key + 1)`` (``key``
   None: plain Hadamard everywhere): the rows of
   ``v_proj`` per key-value head by ``R2^T``, the columns of ``o_proj`` per query head by ``R2`` (grouped-query
   attention included: every query head reading a key-value head sees the same rotation).

4. ``online`` (default both): online Hadamard transforms where a rotation cannot be fused into the previous
   layer: the input of ``mlp.down_proj`` (after the SiLU gate, QuaRot's R4) and of ``self_attn.o_proj`` (after
   attention; a full transform of the ``heads * head_dim`` features, which mixes across heads as QuaRot's
   online head Hadamard does). The Linear's weight columns are multiplied by ``Q`` and an ``InputRotation``
   forward pre-hook multiplies its input by ``Q`` (``Q = diag(s) H^T / sqrt(n)`` with the signs of
   ``key + 2 + i`` for the i-th entry of ``ONLINE``, applied with the fast
   transform ``fwht``; a dense product for sizes with no construction, whose ``Q`` is ``rotation(n).T``). The
   pre-hook stays on the module when ``quantize_model`` wraps it (the wrapper shares its hooks), so the
   quantizer sees the rotated input: activation quantization and GPTQ's Hessians both act on rotated values.
   ``input_rotations(model)`` lists them.

5. ``block`` (an int): every rotation above is block-diagonal instead, ``n / block`` normalised Hadamard blocks of
   size ``block`` (``block_rotation``; random signs as above): R1 on the hidden size, R2 inside each head, the
   online transforms on each aligned run of ``block`` input features (the fast transform of size ``block``).
   MR-GPTQ's placement (arXiv 2509.23202, IST-DASLab FP-Quant: a block Hadamard of the scale-block size on the
   input of every Linear of a decoder layer, fused into its weight columns and applied online to its input) is
   ``block`` with ``key=None``: a block R1 fused into the residual stream *is* that transform on the inputs of q,
   k, v, gate and up (RMSNorm with unit weight commutes with any orthogonal matrix), at no run-time cost; the
   online transforms are the ones before o_proj and down_proj. Without ``online``, only the fused parts remain
   (no run-time transform: every runtime loads them). ``block`` must divide the hidden size, the head size (with
   ``heads``) and the input size of every online Linear (ValueError before any work).

Supported: the families whose architecture record (``qcore.adapters.families``) allows rotations (Llama,
Mistral, Qwen2, Qwen3 with its q/k norms, Gemma, whose ``x * (1 + w)`` norms fold ``1 + w`` and keep ``w = 0``,
Phi-3 with its fused ``qkv_proj`` / ``gate_up_proj``): the record names
the norms folded, the projections rotated on their inputs (``attn_in``, ``mlp_in``, the head) and outputs
(``attn_out``, ``mlp_out``), and where the online transforms go (``ONLINE``'s entries mean the MLP's and
attention's output projections). Every other family is refused by name with its record's reason; a family not in
the table, naming the record to add. Everything is checked before any weight changes (ValueError).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from torch import nn

from qcore.algorithms.hadamard import block_rotation, check_block, rotation
from qcore.granularity import PerGroup

from ..families import UnknownFamily, family_of, locate, non_language_modules, text_config
from ..modules import InputRotation, input_rotations, install_online, online_hooks, online_plan
from ..modules.rotation import online_module_names

__all__ = ["rotate_model", "check_rotation", "check_block_sizes", "resolve_block", "rotated_weights", "InputRotation",
           "input_rotations", "online_plan", "install_online", "ONLINE"]

ONLINE = ("mlp.down_proj", "self_attn.o_proj")

def _get(m, name):
    try:
        return m.get_submodule(name)
    except AttributeError:
        return None


def _located(model):
    """The architecture record of ``model`` and where it sits (``qcore.adapters.families.locate``); ValueError
    before any work when the family is unknown or its record says rotations do not support it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"rotate_model: model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        loc = locate(model, what="rotate_model")
    except UnknownFamily as e:
        raise ValueError(f"rotate_model: {type(model).__name__} is not a Llama-like causal LM of a known family; "
                         f"{str(e).split(': ', 1)[1]}") from None
    fam = loc.family
    if fam.rotation:
        detail = ""
        if fam.norm != "rms":
            n = f"{loc.layers}.0.{fam.attn_norm or fam.mlp_norm}"
            m = _get(model, n)
            if m is not None:
                detail = f"{n} is a {type(m).__name__}; "
        raise ValueError(f"rotate_model: {type(model).__name__} (model_type {fam.model_type!r}, the {fam.name} "
                         f"record) is not a Llama-like causal LM QuaRot/SpinQuant can rotate: {detail}{fam.rotation}")
    return loc


def _text_config(model):
    return text_config(model.config)


def rotation_parts(model) -> tuple:
    """``(embedding, final norm, head, decoder layers, head_dim)`` of a model QuaRot / SpinQuant can rotate (its
    family's record allows it, and every module the record names is where and what it says); ValueError naming
    the first thing that is not, before any work."""
    loc = _located(model)
    fam = loc.family
    other = non_language_modules(model)
    if other:  # their outputs (image features) enter the residual stream, which the rotation changes
        raise ValueError(f"rotate_model: {type(model).__name__} (model_type {model.config.model_type!r}) is a "
                         f"vision-language model: {other} feed the language tower's residual stream, which QuaRot / "
                         f"SpinQuant rotate, and qcore does not rotate their outputs yet (images would be read "
                         f"wrongly); quantize it without a rotation")
    emb, norm, head = _get(model, loc.embed), _get(model, loc.final_norm or ""), _get(model, loc.lm_head or "")
    layers = _get(model, loc.layers)
    if not isinstance(emb, nn.Embedding) or loc.final_norm is None or norm is None or \
            not isinstance(head, nn.Linear) or not isinstance(layers, nn.ModuleList):
        raise ValueError(f"rotate_model: {type(model).__name__} is not a Llama-like causal LM ({loc.embed}, "
                         f"{loc.layers}, {loc.final_norm}, {loc.lm_head} as the {fam.name} record says)")
    norms = (fam.attn_norm, fam.mlp_norm)
    for i, layer in enumerate(layers):
        for n in fam.projection_names() + norms:
            m = _get(layer, n)
            if m is None:
                raise ValueError(f"rotate_model: layer {i} ({type(layer).__name__}) has no {n} (the {fam.name} "
                                 f"record names it)")
            if n not in norms and type(m) is not nn.Linear:
                raise ValueError(f"rotate_model: {loc.layers}.{i}.{n} is a {type(m).__name__}; rotate the float "
                                 f"model before quantizing it")
    for n, m in [(f"{loc.layers}.{i}.{x}", _get(layer, x)) for i, layer in enumerate(layers) for x in norms] + \
            [(loc.final_norm, norm)]:
        if not type(m).__name__.endswith("RMSNorm"):
            raise ValueError(f"rotate_model: {n} is a {type(m).__name__}; only RMSNorm commutes with rotations")
        if getattr(m, "bias", None) is not None:
            raise ValueError(f"rotate_model: {n} has a bias")
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor) or w.shape != (emb.weight.shape[1],):
            raise ValueError(f"rotate_model: {n} has no per-channel weight of {emb.weight.shape[1]} values")
    for i, layer in enumerate(layers):
        for n in (fam.attn_out, fam.mlp_out):
            if _get(layer, n).bias is not None:
                raise ValueError(f"rotate_model: {loc.layers}.{i}.{n} has a bias (not supported yet)")
    cfg = _text_config(model)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return emb, norm, head, layers, int(hd)


def _v_rows(model, fam, hd: int) -> slice:
    """The rows of ``attn_in``'s value projection: all of v_proj, or v's slice of a fused (concat) qkv."""
    if len(fam.attn_in) == 3:
        return slice(None)
    cfg = _text_config(model)
    nh = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or nh)
    return slice((nh + kv) * hd, (nh + 2 * kv) * hd)


@torch.no_grad()
def _set(p: torch.Tensor, v: torch.Tensor) -> None:
    p.copy_(v.to(p.dtype))


def _w(p):
    return p.detach().to(torch.float64)


def fold_norms_and_untie(model, emb, norm, head, layers) -> None:
    """Fold every norm's weight into the Linears reading it (then the weight that makes the norm the identity
    scale: ones, or zeros for a unit-offset ``x * (1 + w)`` norm); untie the output head."""
    fam = family_of(model)
    if head.weight is emb.weight:  # untie: the head gets the final norm folded in, the embedding does not
        head.weight = nn.Parameter(head.weight.detach().clone())
        for cfg in {id(c): c for c in (model.config, _text_config(model))}.values():
            cfg.tie_word_embeddings = False
    c = 1.0 if fam.norm == "rms_unit_offset" else 0.0

    def fold(norm_mod, readers):
        g = _w(norm_mod.weight) + c
        for lin in readers:
            _set(lin.weight, _w(lin.weight) * g[None, :])
        _set(norm_mod.weight, torch.full_like(g, 1.0 - c))

    for layer in layers:
        fold(layer.get_submodule(fam.attn_norm), [layer.get_submodule(n) for n in fam.attn_in])
        fold(layer.get_submodule(fam.mlp_norm), [layer.get_submodule(n) for n in fam.mlp_in])
    fold(norm, (head,))


def rotated_weights(model: nn.Module, r1: Optional[torch.Tensor], r2: Optional[Sequence], *,
                    dtype: torch.dtype = torch.float64, start: Optional[dict] = None,
                    skip: Sequence[str] = ()) -> dict:
    """``{parameter name: rotated value}`` for the weights the rotations ``r1`` (``[hidden, hidden]``, residual
    stream) and ``r2`` (one ``[head_dim, head_dim]`` per layer, values per head) change, computed from the
    model's current (norm-folded, untied) weights in ``dtype``; differentiable in ``r1`` and ``r2`` (SpinQuant
    trains through it). None skips a rotation. The model is not changed. Which weights: the family's record
    (``qcore.adapters.families``): R1 on the input columns of ``attn_in``, ``mlp_in`` and the head and on the
    embedding rows, R1^T on the output rows of ``attn_out`` and ``mlp_out``; R2 on the value rows of
    ``attn_in`` and the per-head input columns of ``attn_out``. ``start``: ``{parameter name: value}`` to start
    from instead of the model's (SpinQuant's weights already times their online ``Q``); ``skip``: parameter names
    left out of R1 (SpinQuant rotates the embedding's output and the head's input instead)."""
    emb, norm, head, layers, hd = rotation_parts(model)
    fam = family_of(model)
    vrows = _v_rows(model, fam, hd)
    vname = fam.attn_in[2] if len(fam.attn_in) == 3 else fam.attn_in[0]
    names = {id(m): n for n, m in model.named_modules()}
    out: dict = {}

    start = start or {}

    def cur(mod, what="weight"):
        key = f"{names[id(mod)]}.{what}"
        if key in out:
            return out[key], key
        return (start[key] if key in start else getattr(mod, what).detach()).to(dtype), key

    if r1 is not None:
        r1 = r1.to(dtype)
        for mod in (emb, head):
            if f"{names[id(mod)]}.weight" in skip:
                continue
            w, k = cur(mod)
            out[k] = w @ r1
        for layer in layers:
            for n in fam.attn_in + fam.mlp_in:
                w, k = cur(layer.get_submodule(n))
                out[k] = w @ r1
            for n in (fam.attn_out, fam.mlp_out):
                w, k = cur(layer.get_submodule(n))
                out[k] = r1.T @ w
    if r2 is not None:
        for layer, r in zip(layers, r2):
            vmod, omod = layer.get_submodule(vname), layer.get_submodule(fam.attn_out)
            r = r.to(dtype)
            for what in ("weight", "bias"):
                if getattr(vmod, what, None) is None:
                    continue
                full, key = cur(vmod, what)
                v = full[vrows]
                kv = v.shape[0] // hd
                rv = (r.T @ v.reshape(kv, hd, -1)).reshape(v.shape)
                if vrows == slice(None):
                    out[key] = rv
                else:
                    out[key] = torch.cat([full[:vrows.start], rv, full[vrows.stop:]])
            o, ko = cur(omod)
            nh = o.shape[1] // hd
            out[ko] = (o.reshape(-1, nh, hd) @ r).reshape(o.shape[0], nh * hd)
    return out


@torch.no_grad()
def write_weights(model: nn.Module, values: dict) -> None:
    """Write ``{parameter name: value}`` into the model's parameters in place (cast to each one's dtype)."""
    for k, v in values.items():
        _set(model.get_parameter(k), v)


def times_online(model, values: dict, qs: dict, dtype=torch.float64) -> dict:
    """``values`` with every weight in ``qs`` (taken from the model where ``values`` lacks it) times its ``Q``."""
    out = dict(values)
    for k, q in qs.items():
        w = out.get(k, model.get_parameter(k).detach().to(dtype))
        out[k] = w @ q.to(w.dtype)
    return out


def _check_online(online) -> tuple:
    if isinstance(online, str) or not all(o in ONLINE for o in online):
        raise ValueError(f"online must be a subset of {list(ONLINE)}, got {online!r}")
    return tuple(o for o in ONLINE if o in online)  # canonical order: the keys (key + 2 + i) follow it


def check_block_sizes(model: nn.Module, block, *, heads: bool = True, online: Sequence[str] = ONLINE,
                      what: str = "quarot.block") -> None:
    """ValueError naming ``what`` unless the int ``block`` divides the hidden size, the head size (``heads``) and the
    input size of every online Linear in ``online`` (and is a Hadamard order here); before any work."""
    emb, _, _, layers, hd = rotation_parts(model)
    loc = _located(model)
    sizes = [("the hidden size", emb.weight.shape[1])] + ([("the head size", hd)] if heads else [])
    for entry, name in zip(online, online_module_names(loc.family, online)):
        lin = _get(layers[0], name) if len(layers) else None
        if lin is not None and hasattr(lin, "in_features"):
            sizes.append((f"the input size of {entry}", lin.in_features))
    for label, n in sizes:
        try:
            check_block(int(n), block, what=label)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what}={block!r}: {e}") from None


@torch.no_grad()
def rotate_model(model: nn.Module, *, key: Optional[int] = 0, heads: bool = True,
                 online: Sequence[str] = ONLINE, block: Optional[int] = None) -> nn.Module:
    """Fold norms and fuse QuaRot's rotations into ``model`` in place (module docstring); returns it. ``block``:
    block-diagonal rotations of that size (item 5)."""
    online = _check_online(online)
    emb, norm, head, layers, hd = rotation_parts(model)
    if input_rotations(model):
        raise ValueError("rotate_model: the model is already rotated (it has online InputRotation hooks)")
    if block is not None:
        check_block_sizes(model, block, heads=heads, online=online, what="rotate_model: block")
    hidden = emb.weight.shape[1]
    dev = emb.weight.device
    k2 = None if key is None else key + 1
    if block is None:
        r1 = torch.from_numpy(rotation(hidden, key=key)).to(dev)
        r2 = torch.from_numpy(rotation(hd, key=k2)).to(dev)
    else:
        r1 = torch.from_numpy(block_rotation(hidden, block=block, key=key)).to(dev)
        r2 = torch.from_numpy(block_rotation(hd, block=block, key=k2)).to(dev) if heads else None
    fold_norms_and_untie(model, emb, norm, head, layers)
    values = rotated_weights(model, r1, [r2] * len(layers) if heads else None)
    write_weights(model, times_online(model, values, online_hooks(model, online, key, block=block)))
    return model


def check_rotation(model: nn.Module, algo) -> None:
    """What ``apply_rotation`` checks before changing anything."""
    rotation_parts(model)
    block = getattr(algo, "block", None)
    if block == "auto":
        raise ValueError(f"{algo.name}.block='auto' takes the weights' block size from quantize_model's plan; "
                         f"run the rotation through quantize_model's algorithms, or give an int")
    if block is not None:
        check_block_sizes(model, block, heads=algo.heads, online=algo.online, what=f"{algo.name}.block")
    if input_rotations(model):
        raise ValueError("the model is already rotated (it has online InputRotation hooks); reload it")
    path = _located(model).layers
    if algo.decoder_layers not in (None, path):
        raise ValueError(f"{algo.name}: decoder_layers={algo.decoder_layers!r}; the model's architecture record "
                         f"puts its decoder layers at {path!r}")


def resolve_block(model: nn.Module, config, plans: Sequence):
    """``config`` (a ``ModelConfig``) with its rotation's ``block="auto"`` replaced by the group size of the weights
    the plan quantizes inside the decoder layers (their inputs' when no weight is quantized); ``config`` itself
    otherwise. ValueError naming ``block`` when those Linears have no one per-group size along their input."""
    algos = tuple(config.algorithms)
    i = next((j for j, a in enumerate(algos) if getattr(a, "block", None) == "auto"), None)
    if i is None:
        return config
    rot = algos[i]
    path = _located(model).layers + "."
    sizes = set()
    for p in plans:
        if not p.name.startswith(path):
            continue
        t = p.config.weight if p.config.weight is not None else p.config.input
        g = getattr(getattr(t, "spec", None), "granularity", None)
        sizes.add(g.size if isinstance(g, PerGroup) and g.axis in (1, -1) else None)
    if not sizes or None in sizes or len(sizes) > 1:
        found = sorted(map(str, sizes)) or ["no quantized Linear in the decoder layers"]
        raise ValueError(f"{rot.name}.block='auto': the decoder layers' Linears must share one per-group block size "
                         f"along their input (MX: 32, NVFP4: 16) to take it from; found {found}; give an int")
    b = sizes.pop()
    return config.replace(algorithms=algos[:i] + (dataclasses.replace(rot, block=b),) + algos[i + 1:])

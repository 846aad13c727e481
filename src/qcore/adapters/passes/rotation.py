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

Supported: the families whose architecture record (``qcore.adapters.families``) allows rotations (Llama,
Mistral, Qwen2, Qwen3 with its q/k norms, Gemma, whose ``x * (1 + w)`` norms fold ``1 + w`` and keep ``w = 0``,
Phi-3 with its fused ``qkv_proj`` / ``gate_up_proj``): the record names
the norms folded, the projections rotated on their inputs (``attn_in``, ``mlp_in``, the head) and outputs
(``attn_out``, ``mlp_out``), and where the online transforms go (``ONLINE``'s entries mean the MLP's and
attention's output projections). Every other family is refused by name with its record's reason; a family not in
the table, naming the record to add. Everything is checked before any weight changes (ValueError).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from qcore.algorithms.hadamard import reference_fwht, fwht, is_constructible, random_signs, rotation

from ..families import family_of

__all__ = ["rotate_model", "check_rotation", "rotated_weights", "InputRotation",
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
    from ..families import UnknownFamily, locate
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
    from ..families import _text_config as tc
    return tc(model.config)


def _check(model) -> tuple:
    loc = _located(model)
    fam = loc.family
    from ..families import non_language_modules
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


class InputRotation:
    """A forward pre-hook multiplying a Linear's input by the orthogonal ``Q`` of size ``size`` (see the module
    docstring): ``x @ Q`` with ``Q = rotation(size, key=key).T``. A value (size, key); the matrix is rebuilt
    from it, so a model with these hooks deep-copies and pickles. The signs (or the dense matrix of a size with
    no construction) are cached per (device, dtype) on first use; under autograd the transform is one
    ``torch.autograd.Function`` whose backward is the adjoint transform (``fwht(..., transpose=True)``), not the
    graph of the transform's elementwise operations (issue 23)."""

    __slots__ = ("size", "key", "_signs", "_dense", "_cache")

    def __init__(self, size: int, *, key: Optional[int] = None):
        self.size, self.key = int(size), key
        self._signs = self._dense = None
        self._cache = {}

    def __repr__(self) -> str:
        return f"InputRotation(size={self.size}, key={self.key})"

    def __getstate__(self):
        return {"size": self.size, "key": self.key}

    def __setstate__(self, st):
        self.size, self.key = st["size"], st["key"]
        self._signs = self._dense = None
        self._cache = {}

    def matrix(self) -> torch.Tensor:
        """``Q`` as a float64 [size, size] tensor."""
        return torch.from_numpy(rotation(self.size, key=self.key).T.copy())

    def __call__(self, module, args):
        x = args[0]
        return (self.apply(x),) + tuple(args[1:])

    def _on(self, what: str, device, dtype) -> torch.Tensor:
        """The signs (``what="signs"``) or the dense ``Q`` (``"dense"``) on ``device`` in ``dtype``, built once."""
        k = (what, str(device), dtype)
        t = self._cache.get(k)
        if t is None:
            if what == "signs":
                if self._signs is None:
                    self._signs = torch.from_numpy(random_signs(self.size, key=self.key))
                t = self._signs.to(device=device, dtype=dtype)
            else:
                if self._dense is None:
                    self._dense = self.matrix()
                t = self._dense.to(device=device, dtype=dtype)
            self._cache[k] = t
        return t

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.size:
            raise ValueError(f"InputRotation: input has {x.shape[-1]} features, the rotation is of size {self.size}")
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        z = x.to(ct)
        if is_constructible(self.size):
            if self.key is not None:
                z = z * self._on("signs", x.device, ct)
            y = _FWHT.apply(z) if z.requires_grad and torch.is_grad_enabled() else _fwht(z)
        else:
            y = z @ self._on("dense", x.device, ct)
        return y.to(x.dtype)


class _FWHT(torch.autograd.Function):
    """``fwht`` with the adjoint transform as its backward (``d/dz (z H^T / r) = g H / r``)."""

    @staticmethod
    def forward(ctx, z):
        return _fwht(z)

    @staticmethod
    def backward(ctx, g):
        return fwht(g, transpose=True)


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """``fwht(x)``, by its Triton twin (same bits) for float32 tensors on a GPU with Triton
    (``qcore.adapters.triton.available``) when no gradient is needed."""
    if x.dtype == torch.float32 and not (x.requires_grad and torch.is_grad_enabled()):
        from .. import triton as kernels

        if kernels.available(x):
            return kernels.fwht(x)
    return fwht(x)


class _ReferenceInputRotation(InputRotation):
    """The landed ``InputRotation.apply`` (issue 11): signs moved per call, ``reference_fwht`` differentiated through
    its elementwise graph; the reference SpinQuant (``spinquant._reference_spinquant``) is tested against."""

    __slots__ = ()

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.size:
            raise ValueError(f"InputRotation: input has {x.shape[-1]} features, the rotation is of size {self.size}")
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        if is_constructible(self.size):
            if self.key is not None:
                if self._signs is None:
                    self._signs = torch.from_numpy(random_signs(self.size, key=self.key))
                y = reference_fwht(x.to(ct) * self._signs.to(device=x.device, dtype=ct))
            else:
                y = reference_fwht(x.to(ct))
        else:
            if self._dense is None:
                self._dense = self.matrix()
            y = x.to(ct) @ self._dense.to(device=x.device, dtype=ct)
        return y.to(x.dtype)


def remove_online(model: nn.Module) -> None:
    """Remove every ``InputRotation`` hook (undoing ``_online_hooks`` when the weights were not rotated)."""
    for m in model.modules():
        for k in [k for k, h in m._forward_pre_hooks.items() if isinstance(h, InputRotation)]:
            del m._forward_pre_hooks[k]


def input_rotations(model: nn.Module) -> dict:
    """``{module name: InputRotation}`` for every module carrying one (``rotate_model(..., online=...)``)."""
    out = {}
    for n, m in model.named_modules():
        for h in m._forward_pre_hooks.values():
            if isinstance(h, InputRotation):
                out[n] = h
    return out


@torch.no_grad()
def _set(p: torch.Tensor, v: torch.Tensor) -> None:
    p.copy_(v.to(p.dtype))


def _w(p):
    return p.detach().to(torch.float64)


def _fold_and_untie(model, emb, norm, head, layers) -> None:
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
    emb, norm, head, layers, hd = _check(model)
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
def _write(model: nn.Module, values: dict) -> None:
    for k, v in values.items():
        _set(model.get_parameter(k), v)


def _online_names(fam, online) -> list:
    """The record's module for each canonical ``ONLINE`` entry (``mlp.down_proj``: the MLP's output projection,
    ``self_attn.o_proj``: attention's)."""
    where = {"mlp.down_proj": fam.mlp_out, "self_attn.o_proj": fam.attn_out}
    return [where.get(o, o) for o in online]


def online_plan(model: nn.Module, algo) -> dict:
    """``{module name: InputRotation}`` that ``rotate_model`` / ``apply_rotation`` install for the rotation config
    ``algo`` (``online``, ``key``) on ``model`` (what a checkpoint's config says to re-install on loading)."""
    from ..families import locate
    loc = locate(model, what=algo.name)
    path = loc.layers
    layers = _get(model, path)
    out = {}
    for li, layer in enumerate(layers):
        for i, name in enumerate(_online_names(loc.family, algo.online)):
            lin = _get(layer, name)
            if lin is None or not hasattr(lin, "in_features"):
                raise ValueError(f"{algo.name}: {path}.{li}.{name} is not a Linear")
            out[f"{path}.{li}.{name}"] = InputRotation(lin.in_features,
                                                       key=None if algo.key is None else algo.key + 2 + i)
    return out


def install_online(model: nn.Module, algo) -> dict:
    """Register ``online_plan(model, algo)``'s hooks on a model whose weights already hold the rotations (a
    reloaded checkpoint); returns the plan."""
    plan = online_plan(model, algo)
    for name, h in plan.items():
        model.get_submodule(name).register_forward_pre_hook(h)
    return plan


def _online_hooks(model, online: Sequence[str], key: Optional[int]) -> dict:
    """Register the online ``InputRotation`` hooks; ``{weight parameter name: Q}`` whose columns must be
    multiplied by ``Q`` (``W @ Q``) for the model to compute the same function."""
    from types import SimpleNamespace
    plan = install_online(model, SimpleNamespace(online=tuple(online), key=key, name="rotate_model"))
    return {f"{n}.weight": h.matrix().to(model.get_submodule(n).weight.device) for n, h in plan.items()}


def _times_online(model, values: dict, qs: dict, dtype=torch.float64) -> dict:
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


@torch.no_grad()
def rotate_model(model: nn.Module, *, key: Optional[int] = 0, heads: bool = True,
                 online: Sequence[str] = ONLINE) -> nn.Module:
    """Fold norms and fuse QuaRot's rotations into ``model`` in place (module docstring); returns it."""
    online = _check_online(online)
    emb, norm, head, layers, hd = _check(model)
    if input_rotations(model):
        raise ValueError("rotate_model: the model is already rotated (it has online InputRotation hooks)")
    hidden = emb.weight.shape[1]
    dev = emb.weight.device
    r1 = torch.from_numpy(rotation(hidden, key=key)).to(dev)
    r2 = torch.from_numpy(rotation(hd, key=None if key is None else key + 1)).to(dev)
    _fold_and_untie(model, emb, norm, head, layers)
    values = rotated_weights(model, r1, [r2] * len(layers) if heads else None)
    _write(model, _times_online(model, values, _online_hooks(model, online, key)))
    return model


def check_rotation(model: nn.Module, algo) -> None:
    """What ``apply_rotation`` checks before changing anything."""
    _check(model)
    if input_rotations(model):
        raise ValueError("the model is already rotated (it has online InputRotation hooks); reload it")
    path = _located(model).layers
    if algo.decoder_layers not in (None, path):
        raise ValueError(f"{algo.name}: decoder_layers={algo.decoder_layers!r}; the model's architecture record "
                         f"puts its decoder layers at {path!r}")

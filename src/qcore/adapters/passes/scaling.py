"""Where per-channel scales (AWQ, SmoothQuant) go in a model, and folding them in exactly.

A *scaling group* is a set of Linears that read the same input ``x`` and the op that produces ``x``:
``y_i = x W_i^T = (x / s) (W_i * s)^T``. Folding divides the producer's output by ``s`` (a norm's weight and
bias, or a previous Linear's output rows and bias) and multiplies every reader's input columns by ``s``; in exact
arithmetic the layer computes the same function, and only quantization sees the rescaled tensors. A transformers
``Conv1D`` (GPT-2: ``y = x @ W + b``, ``W`` stored ``[in, out]``) is the Linear of ``W^T``: the folds act on
``modules.linear_weight``'s ``[out, in]`` view of it (writes reach the parameter).

- ``ScalingGroup(prev_op, layers, inp, module2inspect)``: module names relative to one decoder layer, the fields
  of an entry of Quark's ``scaling_layers`` (``ScalingGroup.from_quark(entry)`` reads one; ``module2inspect``:
  the module whose output Quark measures, ``""`` = the whole layer, None = the single Linear; ``inp``: the module
  whose input is the group's sample).
- ``scaling_groups(layer, model_type=, quark_entries=)``: the groups of one decoder layer, from the architecture
  records (``qcore.adapters.families``: each family's ``scaling`` rules, with the flags saying when a group
  applies). With a ``model_type`` in the table, that record; otherwise the first record whose structure the
  layer has (every module it names present, and exactly its norms). E.g.:

  * Llama-like layers (Llama, Mistral, Qwen2/3, Gemma, SmolLM2): ``input_layernorm -> q,k,v``; ``v_proj ->
    o_proj`` only without grouped-query attention (``v_proj.out_features == o_proj.in_features``) and without a
    ``self_attn.v_norm``; ``post_attention_layernorm -> gate,up``; ``up_proj -> down_proj``. Gemma2/3 (whose
    ``post_attention_layernorm`` normalises the attention *output*): the MLP's group reads
    ``pre_feedforward_layernorm``. Phi-3, GPT-NeoX: the norms into the fused projections. GPT-2 (Conv1D):
    ``ln_1 -> attn.c_attn``, ``ln_2 -> mlp.c_fc``. MoE families: the attention groups only.
  * OPT (pre-norm, ``do_layer_norm_before=True``): ``self_attn_layer_norm -> q,k,v``; ``v_proj -> out_proj``
    (same size rule); ``final_layer_norm -> fc1``; ``fc1 -> fc2`` only when the activation is ReLU (``relu(x /
    s) = relu(x) / s`` for ``s > 0``; not true for GELU).

  Anything else (BERT's post-norm, a family not in the table) raises ``NoScalingMap`` (a ValueError) naming the
  layer type, the record's reason and the record to add, and asking for ``quark_entries`` (Quark's
  ``scaling_layers``). Given ``quark_entries``, every named module must exist (ValueError otherwise), the readers
  must be ``nn.Linear`` / ``Conv1D``, and a Linear -> Linear entry whose sizes do not match (Quark's ``v_proj ->
  o_proj`` under grouped-query attention, which Quark handles by a max over the query heads sharing a KV head) is
  left out, with a warning, rather than folded wrongly.
- ``fold_scales(layer, group, s, family=)``: in place, all checks before any change; float64 arithmetic, cast back
  to each parameter's dtype (so the float model changes only by that rounding). Foldable producers: a norm with a
  per-channel weight (``nn.LayerNorm``, ``nn.RMSNorm``, any module whose class name ends in ``RMSNorm`` /
  ``LayerNorm``; Gemma-style "unit offset" RMSNorms, ``x * (1 + w)`` (the family record's ``norm``,
  ``families.unit_offset_norm``), fold as ``(w + 1) / s - 1`` as Quark does)
  or an ``nn.Linear`` / ``Conv1D`` with ``len(s)`` outputs; the readers are ``nn.Linear`` / ``Conv1D``. Fold
  before a model is quantized (calibrated scales of a wrapped Linear would not follow the change).

Differences from Quark 0.13's ``apply_scale``: activations as producers (Quark's ``ScaledActivation`` for GELU),
grouped-query ``v_proj -> o_proj`` folds and folds into the v rows only of a fused qkv (GPT-2's ``c_attn ->
c_proj``, GPT-NeoX, Phi-3) are not done; Quark's NaN assertions after folding are replaced by the checks before
it (positive finite ``s``).
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Mapping, Optional

import numpy as np
import torch
from torch import nn

from ..families import BY_MODEL_TYPE, FAMILIES, ScalingGroup, unit_offset_norm  # the records and their type
from ..modules import linear_weight

__all__ = ["ScalingGroup", "NoScalingMap", "scaling_groups", "fold_scales", "check_fold", "linear_view"]

# ---------------------------------------------------------------------------------------------------------------
# architecture map
# ---------------------------------------------------------------------------------------------------------------


def linear_view(m: Optional[nn.Module]) -> Optional[torch.Tensor]:
    """The ``[out, in]`` weight of a Linear-like module the folds act on: an ``nn.Linear``'s (subclasses too), or
    ``linear_weight``'s transposed view of transformers' ``Conv1D`` (writes reach the parameter); None otherwise."""
    if isinstance(m, nn.Linear):
        return m.weight
    return None if m is None else linear_weight(m)


def _get(layer: nn.Module, name: str) -> Optional[nn.Module]:
    try:
        return layer.get_submodule(name) if name else layer
    except AttributeError:
        return None


def _fits(layer: nn.Module, fam) -> bool:
    """Whether ``layer`` has the structure of ``fam``'s record: every named module present, and exactly the
    record's norms (a norm the record does not know, e.g. Gemma2's sandwich norms seen from a Llama record,
    changes what a fold means)."""
    if not all(_get(layer, n) is not None for n in fam.layer_names()):
        return False
    norms = {n for n, m in layer.named_modules() if n and _is_norm(m)}
    return norms == set(fam.norm_names())


def _rule_applies(layer: nn.Module, fam, rule) -> bool:
    g = rule.group
    out = linear_view(_get(layer, g.prev_op)).shape[0] if rule.sizes_match else None
    if rule.sizes_match and any(out != linear_view(_get(layer, n)).shape[1] for n in g.layers):
        return False
    if rule.relu and type(_get(layer, fam.act)) is not nn.ReLU:
        return False
    return not any(_get(layer, n) is not None for n in rule.absent)


def _family_groups(layer: nn.Module, fam) -> Optional[list]:
    """The groups of ``fam``'s record that apply to ``layer`` (None: the record has none for it)."""
    if not fam.scaling:
        return None
    if not all(linear_view(_get(layer, n)) is not None for n in fam.projection_names()):
        return None
    if fam.scaling_requires is not None and getattr(layer, fam.scaling_requires, None) is not True:
        return None
    return [r.group for r in fam.scaling if _rule_applies(layer, fam, r)]


def _from_entries(layer: nn.Module, entries: Any) -> list:
    if isinstance(entries, (str, bytes, Mapping)) or not isinstance(entries, Iterable):
        raise TypeError(f"quark_entries must be a list of Quark scaling_layers dicts (or ScalingGroups), got "
                        f"{type(entries).__name__}")
    groups, dropped = [], []
    for i, e in enumerate(entries):
        g = e if isinstance(e, ScalingGroup) else ScalingGroup.from_quark(e)
        for n in (g.prev_op, *g.layers, g.inp) + (() if g.module2inspect is None else (g.module2inspect,)):
            if _get(layer, n) is None:
                raise ValueError(f"quark_entries[{i}] names {n!r}, which {type(layer).__name__} does not have")
        for n in g.layers:
            if linear_view(_get(layer, n)) is None:
                raise ValueError(f"quark_entries[{i}]: {n!r} is a {type(_get(layer, n)).__name__}, not an nn.Linear "
                                 f"(or a transformers Conv1D)")
        pw = linear_view(_get(layer, g.prev_op))
        if pw is not None and any(pw.shape[0] != linear_view(_get(layer, n)).shape[1] for n in g.layers):
            dropped.append(g)
            continue
        groups.append(g)
    if dropped:
        warnings.warn(f"scaling_groups: left out {len(dropped)} group(s) whose Linear -> Linear sizes differ (e.g. "
                      f"v_proj -> o_proj with grouped-query attention), which cannot be folded exactly: "
                      f"{[(g.prev_op, g.layers) for g in dropped]}", stacklevel=3)
    return groups


class NoScalingMap(ValueError):
    """``scaling_groups`` found no built-in map for a layer: ``what`` says which layer; ``hint`` how to give one
    (the algorithms replace it with their own spelling: the ``scaling_layers`` setting)."""

    def __init__(self, what: str, hint: str):
        super().__init__(f"{what}; {hint}")
        self.what, self.hint = what, hint


def scaling_groups(layer: nn.Module, *, model_type: Optional[str] = None,
                   quark_entries: Optional[Iterable[Any]] = None, family: Any = None) -> list:
    """The scaling groups of one decoder layer (module docstring), in Quark's order.

    ``quark_entries``: Quark's ``scaling_layers`` (list of dicts, or ScalingGroups) to use instead of the built-in
    map. ``family``: the record of the model the layer belongs to (``families.family_of(model)``, which includes a
    record given to that model with ``families.attach``): its groups. Otherwise the groups come from the
    architecture records (``qcore.adapters.families``): with a
    ``model_type`` in the table, that family's record (the layer must have its structure); without one, the
    first record whose structure the layer has (records naming more modules first).
    """
    if not isinstance(layer, nn.Module):
        raise TypeError(f"layer must be a torch.nn.Module (one decoder layer), got {type(layer).__name__}")
    if model_type is not None and not isinstance(model_type, str):
        raise TypeError(f"model_type must be a str or None, got {model_type!r}")
    if quark_entries is not None:
        return _from_entries(layer, quark_entries)
    fam = family if family is not None else BY_MODEL_TYPE.get(model_type.lower()) if model_type else None
    cands = [fam] if fam else sorted(FAMILIES, key=lambda f: -len(f.layer_names()))
    notes = []
    for f in cands:
        if _fits(layer, f):
            groups = _family_groups(layer, f)
            if groups is not None:
                return groups
            notes.append(f"the {f.name} record has none: {f.scaling_note}")
    what = f"model_type {model_type!r}, " if model_type else ""
    why = f" ({'; '.join(notes)})" if notes else ""
    known = sorted(x.model_type for x in FAMILIES if x.scaling)
    raise NoScalingMap(f"no built-in scaling map for {what}layer type {type(layer).__name__}{why}; the architecture "
                       f"records with scaling groups: {known} (a new family: add a Family record with scaling= to "
                       "qcore.adapters.families.FAMILIES, docs/adapters.md 'Architecture records')",
                       "pass quark_entries= (Quark's scaling_layers: dicts with prev_op, layers, inp, module2inspect)")


# ---------------------------------------------------------------------------------------------------------------
# folding
# ---------------------------------------------------------------------------------------------------------------


def _is_norm(m: nn.Module) -> bool:
    n = type(m).__name__
    return isinstance(m, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))) or n.endswith(("RMSNorm", "LayerNorm"))


def _scales(s: Any) -> torch.Tensor:
    if isinstance(s, np.ndarray):
        if s.dtype.kind != "f":
            raise TypeError(f"s must be a floating-point array, got dtype {s.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(s, dtype=np.float64))
    elif isinstance(s, torch.Tensor):
        if not s.dtype.is_floating_point:
            raise TypeError(f"s must be a floating-point tensor, got dtype {s.dtype}")
        t = s.detach().to(torch.float64)
    else:
        raise TypeError(f"s must be a numpy array or a torch tensor of per-channel scales, got {type(s).__name__}")
    if t.ndim != 1 or t.numel() == 0:
        raise ValueError(f"s must be a non-empty 1-D array of per-channel scales, got shape {tuple(t.shape)}")
    bad = ~(torch.isfinite(t) & (t > 0))
    if bool(bad.any()):
        j = int(bad.nonzero()[0, 0])
        raise ValueError(f"s must hold positive finite scales, got s[{j}] = {float(t[j])!r}")
    return t


@torch.no_grad()
def _assign(p: torch.Tensor, v: torch.Tensor) -> None:
    p.copy_(v.to(p.dtype))


def check_fold(layer: nn.Module, group: ScalingGroup, n: int) -> tuple:
    """The checks of ``fold_scales`` for ``n`` channels, changing nothing: ``(kind, producer, linears)`` with
    kind ``"norm"`` or ``"linear"``; ValueError/TypeError naming what cannot be folded."""
    if not isinstance(layer, nn.Module):
        raise TypeError(f"layer must be a torch.nn.Module, got {type(layer).__name__}")
    if not isinstance(group, ScalingGroup):
        raise TypeError(f"group must be a ScalingGroup, got {type(group).__name__}")
    prev = _get(layer, group.prev_op)
    if prev is None:
        raise ValueError(f"group.prev_op {group.prev_op!r} is not a module of {type(layer).__name__}")
    fcs = []
    for name in group.layers:
        fc = _get(layer, name)
        if fc is None:
            raise ValueError(f"group.layers names {name!r}, which {type(layer).__name__} does not have")
        w = linear_view(fc)
        if w is None:
            raise ValueError(f"group.layers: {name!r} is a {type(fc).__name__}, not an nn.Linear (or a transformers "
                             f"Conv1D)")
        if w.shape[1] != n:
            raise ValueError(f"group.layers: {name!r} has in_features={w.shape[1]}, but s has {n} channels")
        fcs.append(fc)
    pw = linear_view(prev)
    if pw is not None:
        if pw.shape[0] != n:
            raise ValueError(f"group.prev_op {group.prev_op!r} is a Linear with out_features={pw.shape[0]}, "
                             f"but s has {n} channels (grouped-query v_proj -> o_proj cannot be folded exactly)")
        kind = "linear"
    elif _is_norm(prev):
        w = getattr(prev, "weight", None)
        if not isinstance(w, torch.Tensor) or w.ndim != 1 or w.numel() != n:
            got = "no weight" if w is None else f"weight of shape {tuple(w.shape)}"
            raise ValueError(f"group.prev_op {group.prev_op!r} ({type(prev).__name__}) needs a per-channel weight of "
                             f"{n} values to fold into, got {got}")
        b = getattr(prev, "bias", None)
        if isinstance(b, torch.Tensor) and (b.ndim != 1 or b.numel() != n):
            raise ValueError(f"group.prev_op {group.prev_op!r}: bias of shape {tuple(b.shape)}, expected ({n},)")
        kind = "norm"
    else:
        raise ValueError(f"group.prev_op {group.prev_op!r} is a {type(prev).__name__}: scales fold only into a "
                         "norm with a per-channel weight or an nn.Linear (or a transformers Conv1D)")

    return kind, prev, fcs


def fold_scales(layer: nn.Module, group: ScalingGroup, s: Any, *, family: Any = None) -> None:
    """Fold per-channel scales ``s`` ([n], positive, finite; numpy or torch) into ``layer`` in place: the output
    of ``group.prev_op`` is divided by ``s`` and each Linear of ``group.layers`` has its input columns multiplied
    by ``s``, so the layer's float function is unchanged (up to rounding to the parameters' dtypes). Everything
    is checked first (ValueError/TypeError, nothing changed): the names exist, the layers are nn.Linear with
    ``in_features == n``, the producer is foldable (module docstring) with ``n`` output channels. ``family``: the
    record of the model the layer belongs to (``families.family_or_none(model)``): its ``norm`` says whether a
    norm computes ``x * (1 + w)``; None (a model without a record): ``families.unit_offset_norm`` by the norm's
    class."""
    st = _scales(s)
    kind, prev, fcs = check_fold(layer, group, int(st.numel()))
    with torch.no_grad():
        if kind == "linear":  # the producer's output rows (of its [out, in] weight) and its bias
            pw = linear_view(prev)
            sd = st.to(pw.device)
            _assign(pw, pw.to(torch.float64) / sd[:, None])
            if prev.bias is not None:
                _assign(prev.bias, prev.bias.to(torch.float64) / sd.to(prev.bias.device))
        else:
            c = 1.0 if unit_offset_norm(prev, family) else 0.0
            w = prev.weight
            _assign(w, (w.to(torch.float64) + c) / st.to(w.device) - c)
            b = getattr(prev, "bias", None)
            if isinstance(b, torch.Tensor):
                _assign(b, b.to(torch.float64) / st.to(b.device))
        for fc in fcs:  # the readers' input columns
            w = linear_view(fc)
            _assign(w, w.to(torch.float64) * st.to(w.device)[None, :])

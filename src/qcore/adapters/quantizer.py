"""Quantize a whole torch model from a ``ModelConfig``: plan, swap, calibrate, commit; freeze; sizes.

``quantize_model(model, config, data=None)`` is all-or-nothing: the plan (which module gets which config) and
every check run before any module is touched; calibration runs on wrappers whose weights are not yet written;
any error restores the original modules, so the model is either unchanged or fully quantized.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from ._batches import (_call, _check_batch, _check_batches, _describe, _device_of, _progress,  # noqa: F401
                       _set_module, _to)
from .config import COMPUTE_TYPES, LayerConfig, ModelConfig, TensorConfig
from .modules import (EXPERT_PROJS, QUANT_CLASSES, CalibrationError, QuantExperts, QuantModule, is_fused_experts,
                      is_quantized_module, wrap)

_log = logging.getLogger("qcore.adapters")

__all__ = ["quantize_model", "plan_model", "calibrate", "freeze", "model_bytes", "quantized_modules", "LayerPlan",
           "FloatWeight", "unquantized_weights", "excluded_weights"]


@dataclass(frozen=True)
class LayerPlan:
    """One module to quantize: its dotted name, type name and resolved ``LayerConfig``."""

    name: str
    type: str
    config: LayerConfig
    # fused MoE experts only: ((projection, TensorConfig), ...) weight specs of single projections that differ from
    # the module's (a ModelConfig.by_name entry naming ``<experts>.down_proj``; GGUF specs: llama.cpp's mixes)
    proj_weights: tuple = ()

    def __repr__(self) -> str:
        roles = []
        for r in ("weight", "input", "output", "bias"):
            tc = getattr(self.config, r)
            if tc is not None:
                spec = tc.spec
                g = type(spec.granularity).__name__
                mode = "" if r in ("weight", "bias") else (" dynamic" if tc.dynamic else " static")
                roles.append(f"{r}={spec.name or spec.dtype.name} {g}{mode}")
        roles += [f"{p}.weight={tc.spec.name or tc.spec.dtype.name}" for p, tc in self.proj_weights]
        return f"LayerPlan({self.name!r}, {self.type}, {', '.join(roles)})"


def _match(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def _match_tree(pattern: str, name: str) -> bool:
    """``pattern`` matches ``name`` or one of its parent modules (a pattern naming a block covers the block)."""
    parts = name.split(".")
    return any(_match(pattern, ".".join(parts[:i])) for i in range(len(parts), 0, -1))


def _no_match_error(what: str, pattern: str, names: list[str]) -> ValueError:
    core = pattern[3:] if pattern.startswith("re:") else pattern.replace("*", "")
    close = difflib.get_close_matches(core, names, n=5, cutoff=0.3)
    if not close:
        close = [n for n in names if core and core.split(".")[-1] in n][:5]
    hint = f"; closest module names: {close}" if close else f"; module names look like {names[:5]}"
    return ValueError(f"{what} {pattern!r} matches no module of the model{hint}")


def _output_head(model: nn.Module) -> list[str]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return []
    return [n for n, m in model.named_modules() if m is head]


def default_exclude(model: nn.Module) -> list[str]:
    """What a config without ``exclude`` keeps float: the output head (transformers' ``get_output_embeddings``)
    and, in a vision-language model, everything beside its language tower (vision tower, projector:
    ``families.non_language_modules``; they are calibrated with text, which never reaches them). An explicit
    ``exclude`` replaces this list."""
    from .families import non_language_modules
    return _output_head(model) + non_language_modules(model)


def _as_config(config: Any, model: Optional[nn.Module] = None, *, imatrix: bool = False) -> ModelConfig:
    if isinstance(config, ModelConfig):
        return config
    if model is not None and isinstance(config, str):  # llama.cpp's mixes: resolved on the model (and on whether
        from .gguf_mix import gguf_mix, mix_of_preset  # an imatrix is used: llama.cpp's Q4_0 / Q5_0 mixes differ)
        if mix_of_preset(config) is not None:
            return gguf_mix(model, mix_of_preset(config), imatrix=imatrix).config
    if isinstance(config, str):
        from .presets import preset
        return preset(config)
    if isinstance(config, Mapping):
        return ModelConfig.from_dict(config)
    raise TypeError(f"config must be a ModelConfig, a preset name or a config dict, got {type(config).__name__}")


def plan_model(model: nn.Module, config: Union[ModelConfig, str, Mapping], *, _quantized_ok: bool = False,
               _check_float: bool = True) -> list[LayerPlan]:
    """Resolve ``config`` on ``model``: the modules that will be quantized and their configs. Pure: raises
    ``ValueError``/``TypeError`` for patterns matching nothing, configs that cannot apply, tied weights shared
    with a module treated differently, an already quantized model, and weight matrices qcore cannot quantize
    yet that no exclusion names (fused MoE expert tensors of a layout qcore does not know, fused projections held
    on a module, ...: see ``unquantized_weights``); changes nothing. Fused MoE experts of a known layout
    (``qcore.adapters.modules.KNOWN_EXPERTS``) are planned as one module of type ``"Experts"``.

    ``exclude`` / ``by_name`` patterns match module names (a pattern naming a module covers everything in it) and,
    for the weights qcore cannot quantize and for fused experts, their parameter names too
    (``model.layers.0.mlp.experts.down_proj``; fused experts are kept float only as a whole: both parameters).
    (``_check_float=False``: the checkpoint loaders, which resolve a saved config on a float skeleton.)"""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = _as_config(config, model)
    mods = dict(model.named_modules())
    if _quantized_ok:  # exporters: resolve the config on a quantized model as on its float original
        mods = {n: _FloatView(m) if is_quantized_module(m) else m for n, m in mods.items()}
    elif any(is_quantized_module(m) for m in mods.values()):
        raise ValueError("the model already holds qcore quantized modules; quantize a float model (reload it)")
    names = [n for n in mods if n]
    if config.algorithms:
        from qcore.algorithms.config import parse_algorithms
        try:
            parse_algorithms(config.algorithms)
        except (ValueError, TypeError) as e:
            raise type(e)(f"ModelConfig.algorithms: {e}") from None
    if getattr(model, "_qcore_partial", False):
        raise ValueError("an algorithm run on this model failed half-way and left some layers rewritten; reload "
                         "the model and quantize it again")
    exclude = default_exclude(model) if config.exclude is None else list(config.exclude)
    odd = _odd_weights(mods)  # weight matrices of kinds qcore cannot quantize: excluded by name or refused below
    experts = {n: [f"{n}.{p}" for p in EXPERT_PROJS] for n, m in mods.items() if n and _tname(m) == "Experts"}
    # exclude / by_name may name those parameters, and the fused experts' (quantized together, per module)
    targets = names + [w.name for w in odd] + [q for ps in experts.values() for q in ps]
    for p in ([] if config.exclude is None else exclude):
        if not any(_match(p, n) for n in targets):
            raise _no_match_error("ModelConfig.exclude entry", p, names)
    for p in config.by_name:
        if not any(_match(p, n) for n in targets):
            raise _no_match_error("ModelConfig.by_name pattern", p, names)
    kv_targets = config.kv_cache.targets if config.kv_cache is not None else ()
    for p in kv_targets:
        if not any(_match(p, n) for n in names):
            raise _no_match_error("KVCacheConfig.targets pattern", p, names)

    plans: list[LayerPlan] = []
    skipped: list[str] = []
    for name, m in mods.items():
        if not name:
            continue
        tname = _tname(m)
        named = next((p for p in config.by_name if _match_tree(p, name)), None)
        excluded = any(_match_tree(p, name) for p in exclude)
        proj_weights: dict = {}
        if name in experts:  # fused experts: patterns may name the module or both of its parameters
            named, excluded, proj_weights = _experts_patterns(name, experts[name], config, exclude, named, excluded)
        if tname is None:
            if named is not None and config.by_name[named] is not None and not any(
                    _match_tree(named, n) and _tname(mods[n]) is not None for n in names):
                raise ValueError(f"ModelConfig.by_name pattern {named!r} matches only modules qcore cannot quantize "
                                 f"(e.g. {name!r}: {type(m).__name__}); supported: "
                                 f"{[c.__name__ for c in QUANT_CLASSES]}")
            base = next((c.__name__ for c in QUANT_CLASSES if isinstance(m, c)), None)
            if base is not None and not excluded:  # a subclass of a supported type: would the config apply?
                would = (config.by_name[named] if named is not None else config.by_type[base]
                         if base in config.by_type else config.layer if base in COMPUTE_TYPES else None)
                if would is not None and not would.empty:
                    skipped.append(f"{name} ({type(m).__name__})")
            continue
        if excluded:
            lc: Optional[LayerConfig] = None
        elif named is not None:
            lc = config.by_name[named]
        elif tname in config.by_type:
            lc = config.by_type[tname]
        elif tname in COMPUTE_TYPES:
            lc = config.layer
        else:
            lc = None
        if kv_targets and any(_match(p, name) for p in kv_targets):
            if tname != "Linear":
                raise ValueError(f"KVCacheConfig.targets: {name!r} is a {tname}; KV-cache scales go on the "
                                 f"outputs of the k/v projection Linears")
            base = lc or LayerConfig()
            if base.output is not None and base.output != config.kv_cache.output:
                raise ValueError(f"{name!r}: the layer config quantizes its output and the KV-cache config too; "
                                 f"give one of them")
            lc = LayerConfig(weight=base.weight, input=base.input, output=config.kv_cache.output, bias=base.bias)
        if proj_weights:
            lc_w = None if lc is None else lc.weight
            bad = [p for p, (_, tc) in proj_weights.items() if tc.spec.gguf == "" or lc_w is None or not lc_w.spec.gguf]
            if bad:
                pat = proj_weights[bad[0]][0]
                raise ValueError(f"ModelConfig.by_name pattern {pat!r} gives {name}.{bad[0]} its own weight spec "
                                 f"({proj_weights[bad[0]][1].spec.name}); a projection of fused MoE experts takes its "
                                 f"own spec only when it and the experts' weight spec "
                                 f"({'none' if lc_w is None else lc_w.spec.name}) are GGUF types (llama.cpp's mixes)")
        if lc is None or lc.empty:
            continue
        plans.append(LayerPlan(name, tname, lc, tuple((p, tc) for p, (_, tc) in sorted(proj_weights.items())
                                                      if tc != lc.weight)))
    if skipped:
        warnings.warn(f"qcore.adapters: {len(skipped)} module(s) subclass a supported type but are not exactly it "
                      f"and are left in float (their forward may not go through the module's weight as nn.Linear "
                      f"/ nn.Conv2d do): {', '.join(skipped[:5])}{', ...' if len(skipped) > 5 else ''}",
                      stacklevel=3)
    if not plans:
        raise _nothing_planned(mods)
    if _check_float and not _quantized_ok:
        left = [w for w in odd if not _kept_float(w, config, exclude)]
        if left:
            raise _unsupported_error(left, config, exclude)
    _check_ties(model, mods, plans)
    return plans


def _experts_patterns(name: str, params: list, config: ModelConfig, exclude: list, named, excluded) -> tuple:
    """(by_name pattern, excluded, {projection: (pattern, TensorConfig)}) of the fused experts module ``name``: a
    pattern naming the module (or a parent) or both its parameters applies; one naming one parameter only gives
    that projection its own weight spec when its config quantizes the weight only (GGUF types: checked by the
    caller), and is refused otherwise (the experts are quantized together)."""
    def hits(p):
        return [q for q in params if _match(p, q)]

    def refuse(what, got):
        return ValueError(f"{what} names {got} but not {[q for q in params if q not in got]}: the fused MoE experts "
                          f"{name!r} are quantized together; name the module {name!r} (or all of its parameters), "
                          f"or give the one projection a weight-only config of a GGUF type")
    proj_weights: dict = {}
    for p in config.by_name:
        if 0 < len(hits(p)) < len(params) and not _match_tree(p, name):
            lc = config.by_name[p]
            if lc is None or lc.weight is None or any(getattr(lc, r) is not None for r in ("input", "output", "bias")):
                raise refuse(f"ModelConfig.by_name pattern {p!r}", hits(p))
            proj_weights.setdefault(hits(p)[0].rsplit(".", 1)[1], (p, lc.weight))
    dropped = sorted({q for p in exclude for q in hits(p)})
    if not excluded and 0 < len(dropped) < len(params):
        raise refuse(f"ModelConfig.exclude {[p for p in exclude if hits(p)]}", dropped)
    excluded = excluded or len(dropped) == len(params)
    if named is None:
        named = next((p for p in config.by_name if len(hits(p)) == len(params)), None)
    return named, excluded, proj_weights


# ---------------------------------------------------------------------------------------------------------------
# weights qcore cannot quantize yet: found before any work, kept float only by an explicit exclusion
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FloatWeight:
    """A weight matrix left in float: its parameter name, the module holding it (name and type), its shape and
    why (``unquantized_weights``, ``excluded_weights``)."""

    name: str
    module: str
    type: str
    shape: tuple
    why: str


ISSUE = "docs/adapters.md, 'Families by feature'"  # what is supported, family by family
_WHY_EXPERTS = (f"3-D fused MoE expert weights of a layout qcore does not know (it quantizes the fused experts of "
                f"Mixtral, Qwen2-MoE, Qwen3-MoE and of the classes whose eager forward is MixtralExperts': "
                f"qcore.adapters.modules.experts_layout_problem; {ISSUE})")


def _why_odd(m: nn.Module, local: str, t: torch.Tensor) -> Optional[str]:
    """Why parameter ``local`` of module ``m`` is a weight matrix qcore would be expected to quantize but cannot;
    None for what is float by design (norms, biases, embeddings, routers, 1-D tensors) or is a supported module's
    (those are planned, excluded or warned about by ``plan_model``)."""
    if not t.is_floating_point() or t.dim() < 2 or "bias" in local.lower():
        return None
    if isinstance(m, (QuantModule, _FloatView)) or any(isinstance(m, c) for c in QUANT_CLASSES) or \
            is_fused_experts(m):  # fused experts of a known layout are planned (QuantExperts)
        return None
    tname = type(m).__name__
    low = tname.lower()
    if "router" in low or "norm" in low or "embed" in low or "embed" in local.lower():
        return None  # routers stay float (as in vLLM, llm-compressor, Quark); norms; embeddings (by_type only)
    if "expert" in low:  # all experts of a layer in one tensor: (experts, out, in), or stacked 2-D (DBRX)
        return _WHY_EXPERTS if t.dim() >= 3 else _WHY_EXPERTS.replace("3-D fused", "fused (stacked 2-D)")
    if isinstance(m, nn.MultiheadAttention):
        return (f"the fused q/k/v projection weight of torch.nn.MultiheadAttention: qcore cannot quantize it yet "
                f"({ISSUE})")
    if isinstance(m, (nn.Conv1d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose3d, nn.Bilinear, nn.RNNBase)):
        return (f"a {tname} weight: not a module type qcore quantizes (supported: "
                f"{', '.join(c.__name__ for c in QUANT_CLASSES)})")
    if local == "weight" or local.endswith(("_weight", "proj")) or "qkv" in local.lower() or \
            re.fullmatch(r"[wv]\d+", local):
        return (f"a weight matrix held directly by a {tname} module (fused projections such as qkv or gate_up, "
                f"or a custom layer): qcore quantizes Linear, Conv2d, ConvTranspose2d, Conv1D and embedding modules "
                f"only ({ISSUE})")
    return None


def _odd_weights(mods: Mapping[str, Any]) -> list[FloatWeight]:
    """Every weight matrix of ``mods`` that qcore would be expected to quantize but cannot (``_why_odd``); a tensor
    shared by several modules once."""
    out, seen = [], set()
    for mname, m in mods.items():
        params = getattr(m, "_parameters", None) or {}
        for local, t in params.items():
            if t is None or id(t) in seen:
                continue
            why = _why_odd(m, local, t)
            if why is not None:
                seen.add(id(t))
                out.append(FloatWeight(f"{mname}.{local}" if mname else local, mname, type(m).__name__,
                                       tuple(t.shape), why))
    return out


def _kept_float(w: FloatWeight, config: ModelConfig, exclude: list) -> bool:
    """Whether an exclusion (``exclude``, or a ``by_name`` pattern set to None) names ``w``: its module (or one of
    the module's parents), or the parameter itself."""
    def hit(p):
        return (bool(w.module) and _match_tree(p, w.module)) or _match(p, w.name)
    if any(hit(p) for p in exclude):
        return True
    named = next((p for p in config.by_name if hit(p)), None)
    return named is not None and config.by_name[named] is None


def _exclude_pattern(weights: list[FloatWeight]) -> str:
    r"""One ``re:`` pattern naming exactly these parameters, whatever layer they are in:
    ``re:.*\.experts\.(down_proj|gate_up_proj)``, ``re:.*\.(c_attn|c_fc|c_proj)\.weight``."""
    tails: dict[str, set] = {}
    for w in weights:
        tails.setdefault(w.module.rpartition(".")[2], set()).add(w.name.rpartition(".")[2])
    params = {frozenset(v) for v in tails.values()}
    if len(params) == 1:  # the same parameter names in every owner (one owner, or GPT-2's c_attn / c_fc / c_proj)
        body = _alt(tails) + r"\." + _alt(next(iter(params)))
    else:
        body = "(" + "|".join(sorted(re.escape(o) + r"\." + re.escape(x) for o, xs in tails.items() for x in xs)) + ")"
    pattern = (r".*\." if all("." in w.module for w in weights) else r"(.*\.)?") + body
    if not all(w.module and re.fullmatch(pattern, w.name) for w in weights):  # parameters of the root module
        pattern = _alt(w.name for w in weights)
    return "re:" + pattern


def _alt(items) -> str:
    """A regular expression matching exactly one of ``items`` (escaped)."""
    esc = sorted(re.escape(i) for i in set(items))
    return esc[0] if len(esc) == 1 else "(" + "|".join(esc) + ")"


def _unsupported_error(left: list[FloatWeight], config: ModelConfig, exclude: list) -> ValueError:
    """The refusal for weights qcore cannot quantize that no exclusion names: which (first few and how many),
    why, and the exclusion that keeps them float knowingly."""
    whys: dict[str, list[FloatWeight]] = {}
    for w in left:
        whys.setdefault(w.why, []).append(w)
    parts = []
    for why, ws in whys.items():
        shown = ", ".join(f"{w.name} {list(w.shape)}" for w in ws[:3])
        parts.append(f"{len(ws)} weight(s) ({shown}{', ...' if len(ws) > 3 else ''}) are {why}")
    pattern = _exclude_pattern(left)
    keep = list(exclude) + [pattern]
    cli = " ".join(f"--exclude {_shell(p)}" for p in keep)
    default = " (the first entries keep what the config already excludes: an explicit exclude replaces the "
    default += "default, the output head)" if config.exclude is None and exclude else ")"
    return ValueError(f"the model has weight matrices qcore would leave in float, silently half-quantizing it: "
                      f"{'; '.join(parts)}. Nothing was changed. To quantize the rest and keep these in float "
                      f"knowingly, exclude them: exclude={keep!r} (Python: config.replace(exclude=...)), or on the "
                      f"command line {cli}{default}")


def _shell(s: str) -> str:
    import shlex
    return shlex.quote(s)


def _walk_config(model: nn.Module, config: Any) -> tuple[ModelConfig, dict, list]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if config is None:
        config = getattr(model, "qcore_config", None)
        if config is None:
            raise ValueError("config: the model was not quantized by quantize_model (it has no qcore_config); "
                             "pass the config it was quantized with")
    config = _as_config(config, model)
    mods = dict(model.named_modules())
    exclude = default_exclude(model) if config.exclude is None else list(config.exclude)
    return config, mods, exclude


def unquantized_weights(model: nn.Module, config: Union[ModelConfig, str, Mapping, None] = None
                        ) -> list[FloatWeight]:
    """Every weight of ``model`` that ``config`` (default: the config ``quantize_model`` used,
    ``model.qcore_config``) should have quantized but that is still float and is not excluded: a module the plan
    quantizes whose weight is not quantized (for fused MoE experts: both of their parameters), and a weight
    matrix of a kind qcore cannot quantize yet (fused MoE experts of an unknown layout, fused projections held on
    a module, ...) that no exclusion names. Empty after a successful ``quantize_model``; the proof that a model is
    not half-done. Embeddings (quantized only through ``by_type`` / ``by_name``), norms, biases and MoE routers are
    float by design and never listed."""
    config, mods, exclude = _walk_config(model, config)
    out = []
    for p in plan_model(model, config, _quantized_ok=True, _check_float=False):
        if p.config.weight is None:
            continue
        m = mods[p.name]
        if p.type == "Experts" and not (is_quantized_module(m) and "weight" in m.specs):
            out += [FloatWeight(f"{p.name}.{q}", p.name, type(m).__name__, tuple(getattr(m, q).shape),
                                "the config quantizes these fused MoE experts, and they are float")
                    for q in EXPERT_PROJS]
            continue
        if not (is_quantized_module(m) and "weight" in m.specs):
            w = getattr(m, "weight", None)
            out.append(FloatWeight(f"{p.name}.weight", p.name, type(m).__name__,
                                   tuple(w.shape) if isinstance(w, torch.Tensor) else (),
                                   f"the config quantizes this {p.type}'s weight, and it is float"))
    out += [w for w in _odd_weights(mods) if not _kept_float(w, config, exclude)]
    return out


def excluded_weights(model: nn.Module, config: Union[ModelConfig, str, Mapping, None] = None
                     ) -> list[FloatWeight]:
    """The weight matrices ``config`` (default: ``model.qcore_config``) keeps float by an exclusion (``exclude``,
    by default the output head, or a ``by_name`` pattern set to None): the excluded modules of a type qcore
    quantizes and the weights of kinds it cannot quantize yet, each with why. What the ``qcore quantize``
    summary and report list as kept float."""
    config, mods, exclude = _walk_config(model, config)
    out = []
    for name, m in mods.items():
        if not name or _tname(m) is None or _tname(m) not in COMPUTE_TYPES:
            continue
        named = next((p for p in config.by_name if _match_tree(p, name)), None)
        if _tname(m) == "Experts":
            params = [f"{name}.{p}" for p in EXPERT_PROJS]
            named, excl, _ = _experts_patterns(name, params, config, exclude, named,
                                               any(_match_tree(p, name) for p in exclude))
            if excl or (named is not None and config.by_name[named] is None):
                out += [FloatWeight(f"{name}.{p}", name, type(m).__name__, tuple(getattr(m, p).shape),
                                    "excluded by the config") for p in EXPERT_PROJS]
            continue
        if any(_match_tree(p, name) for p in exclude) or (named is not None and config.by_name[named] is None):
            w = getattr(m, "weight", None)
            out.append(FloatWeight(f"{name}.weight", name, type(m).__name__,
                                   tuple(w.shape) if isinstance(w, torch.Tensor) else (), "excluded by the config"))
    out += [w for w in _odd_weights(mods) if _kept_float(w, config, exclude)]
    return out


class _FloatView:
    """Stands for a quantized module in ``plan_model(..., _quantized_ok=True)``: its float type and its weight."""

    def __init__(self, m):
        self.weight = m._parameters.get("weight", getattr(m, "weight_packed", None))
        self._base = m.float_type
        self._experts = isinstance(m, QuantExperts)


def _nothing_planned(mods: dict) -> ValueError:
    """The error for a config that quantizes no module: what the model has, and why none of it is quantized."""
    supported = [c.__name__ for c in QUANT_CLASSES]
    quantizable = [n for n, m in mods.items() if n and _tname(m) is not None]
    other: dict[str, int] = {}  # modules with a weight matrix of a type qcore does not wrap
    for n, m in mods.items():
        w = getattr(m, "weight", None)
        if n and _tname(m) is None and isinstance(w, torch.Tensor) and w.dim() >= 2 and \
                not any(isinstance(m, c) for c in QUANT_CLASSES):
            other[type(m).__name__] = other.get(type(m).__name__, 0) + 1
    msg = "the config quantizes no module of this model"
    if other:
        kinds = ", ".join(f"{k} ({v})" for k, v in other.items())
        msg += (f": its weight matrices are in modules of type(s) {kinds}, which qcore does not quantize "
                f"(supported module types: {', '.join(supported)})")
        msg += "; "
    else:
        msg += " (everything excluded or unmatched); "
    msg += (f"the supported modules it has: {quantizable[:10]}{' ...' if len(quantizable) > 10 else ''} (excluded, "
            f"unmatched, or embeddings, which only by_type / by_name quantize)" if quantizable
            else "it has no module of a supported type")
    return ValueError(msg)


def _tname(m) -> Optional[str]:
    if isinstance(m, QuantExperts) or (isinstance(m, _FloatView) and m._experts) or is_fused_experts(m):
        return "Experts"
    t = m._base if isinstance(m, _FloatView) else type(m)
    return next((c.__name__ for c in QUANT_CLASSES if t is c), None)


def _check_ties(model, mods, plans):
    """A weight tensor shared by several modules must get the same weight config in all of them."""
    by_param: dict[int, list[tuple[str, Any]]] = {}
    cfg = {p.name: p.config.weight for p in plans}
    for name, m in mods.items():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and _tname(m) is not None:
            by_param.setdefault(id(w), []).append((name, cfg.get(name)))
    for users in by_param.values():
        if len(users) > 1 and len({repr(c) for _, c in users}) > 1:
            desc = ", ".join(f"{n!r} ({'float' if c is None else c.spec.name or c.spec.dtype.name})" for n, c in users)
            raise ValueError(f"tied weight shared by {desc} would be quantized differently; give the tied modules "
                             f"the same config (or exclude all of them), or untie the weights first")


def calibrate(model: nn.Module, data: Iterable, *, progress: bool = True, distributed: Any = None,
              moe_all_experts: bool = True) -> int:
    """Run ``data`` through ``model`` under ``no_grad`` and set the static activation scales of its quantized
    modules from their observers (statistics only; activations are never kept). Returns the number of batches.

    Batches: a tensor (``model(batch)``), a dict (``model(**batch)``) or a tuple/list (``model(*batch)``),
    moved to the model's device. On any error the observers are dropped and the scales are left as they were.
    distributed: a ``qcore.adapters.distributed.Distributed``: ``data`` is this rank's share; the observers are
    combined over the ranks before the scales are set (every rank gets the same scales).
    moe_all_experts: every MoE block sends every token to every expert while calibrating (its output stays the
        routed one), so every expert's observers see tokens; the tokens routed to each expert are counted into
        ``model.qcore_moe_coverage`` (an ``ExpertCoverage``; this rank's share) and experts routed none are
        warned about (``qcore.adapters.moe``). False: the router's top-k only (an unrouted expert's observers
        see nothing, and calibration refuses).
    """
    if not isinstance(moe_all_experts, bool):
        raise TypeError(f"moe_all_experts must be a bool, got {moe_all_experts!r}")
    if isinstance(data, (torch.Tensor, Mapping)) or not isinstance(data, Iterable):
        raise TypeError(f"calibration data must be an iterable of batches (a list or a DataLoader), got "
                        f"{type(data).__name__}; wrap a single batch in a list: [batch]")
    mods = [m for m in model.modules() if isinstance(m, QuantModule) and m.static_roles()]
    if not mods:
        return 0
    device = _device_of(model)
    for m in mods:
        m.start_calibration()
    n = 0
    was_training = model.training
    model.eval()
    try:
        try:
            total = len(data)  # type: ignore[arg-type]
        except TypeError:  # a DataLoader over an IterableDataset, a generator
            total = None
        from ._calib_tail import TailSkip
        from .moe import moe_calibration
        with torch.no_grad(), moe_calibration(model, all_experts=moe_all_experts) as moe, \
                TailSkip(mods, enabled=not moe.blocks) as tail:  # forwards end after the last observed module
            for i, batch in enumerate(_progress(data, total=total, desc="calibrating", enabled=progress)):
                _check_batch(model, batch, i)
                try:
                    _call(model, _to(batch, device))
                except TailSkip.Done:
                    pass
                except CalibrationError:
                    raise
                except (RuntimeError, ValueError, TypeError, IndexError) as e:
                    raise ValueError(f"calibration batch {i} ({_describe(batch)}) does not fit the model: "
                                     f"{type(e).__name__}: {e}") from e
                tail.batch_done()
                n += 1
        if n == 0:
            raise ValueError("calibration data is empty; static activation scales need at least one batch")
        if distributed is not None:
            distributed.reduce_observers([o for m in mods for _, o in sorted(m.observers.items())])
        for m in mods:
            m.finish_calibration()
        if moe.blocks:
            model.qcore_moe_coverage = moe.coverage()
    except BaseException:
        for m in mods:
            m.abort_calibration()
        raise
    finally:
        model.train(was_training)
    return n


def quantize_model(model: nn.Module, config: Union[ModelConfig, str, Mapping], data: Optional[Iterable] = None, *,
                   imatrix: Any = None, qat: bool = False, progress: bool = True, distributed: Any = None,
                   reference: Optional[dict] = None, moe_all_experts: bool = True, work_dir=None,
                   resume: bool = False, distill_data: Optional[Iterable] = None) -> nn.Module:
    """Quantize ``model`` in place per ``config`` (a ``ModelConfig``, a preset name or a config dict) and return it.
    llama.cpp's mixes are preset names too (``"gguf_q4_k_m"``, ...: ``qcore.adapters.gguf_mix``, one GGUF type per
    tensor from the model's shapes and layers, exactly llama.cpp's choice).

    imatrix: an importance matrix for the modules whose weight spec is a GGUF type (llama.cpp's imatrix): the
        ``{name: ImatrixStats}`` of ``qcore.adapters.imatrix.collect_imatrix`` / ``load_imatrix`` (GGUF tensor
        names or module names), or the path of an imatrix file (``.gguf`` or legacy ``.dat``). Each such module is
        quantized by llama.cpp's importance-weighted search (``qcore.quantize(w, spec, imatrix=...)``, the bytes of
        ``ggml_quantize_chunk`` with that imatrix); GPTQ weights its per-block scale search by it. Modules with
        other specs ignore it; embeddings and the output head without an entry are quantized without (as
        llama.cpp); any other GGUF-spec Linear without an entry, or with an entry of another width, is an error
        before any work (``qcore.adapters.imatrix.model_importance``; docs/gguf.md).

    data: calibration batches (see ``calibrate``); needed when the config has static activation scales.
    qat: keep float master weights (trainable, straight-through gradients) instead of writing the fake-quantized
        weights in place (the default, which keeps one copy of the weights).
    progress: show progress bars.
    distributed: a ``qcore.adapters.distributed.Distributed`` when several processes (ranks of
        ``torch.distributed``) each hold a share of the calibration batches in ``data``: the algorithms' statistics
        (GPTQ's Hessians) and the static activation observers are reduced over the ranks, and every rank ends
        with the same quantized model (see ``qcore.adapters.distributed``). Every rank calls ``quantize_model``
        with the same model and config.
    reference: a dict that receives ``{module name: the float weight its quantized weight was rounded from}``
        (CPU copies: one more copy of the quantized weights; after a rotation or a smoothing fold, the transformed
        float weight, which computes what the original did; for GPTQ the weight GPTQ started from). What
        ``qcore.adapters.eval.layer_report`` measures the committed weights against.
    moe_all_experts: MoE blocks send every token to every expert during the algorithms' passes and calibration
        (outputs unchanged: the routed top-k only), so every expert gets statistics; see ``calibrate``.
    work_dir, resume: the layer algorithms (GPTQ, AWQ, SmoothQuant, AutoSmoothQuant) save their progress in
        ``work_dir`` after each decoder layer; ``resume=True`` continues a run saved there (same model, config and
        data: refused otherwise) to the same weights an uninterrupted run gives (``qcore.adapters.passes.
        checkpointing``; docs/adapters.md "Long runs: a work directory"). Not with ``distributed``.
    distill_data: the batches a ``distill`` algorithm trains on (default: ``data``).

    All or nothing: on any error the original modules are put back and the weights are untouched. With
    algorithms (``config.algorithms``: a rotation first, QuaRot or SpinQuant, on the whole float model,
    ``qcore.adapters.passes.rotation``; then GPTQ, AWQ, SmoothQuant, AutoSmoothQuant, ``qcore.adapters.passes.sequential``)
    every check still runs first, then the algorithms rewrite the weights; an error after that point leaves the
    model marked as partly rewritten (quantizing it again is refused; reload it).
    """
    kw = dict(qat=qat, progress=progress, distributed=distributed, reference=reference,
              moe_all_experts=moe_all_experts, work_dir=work_dir, resume=resume, distill_data=distill_data)
    if imatrix is None:
        return _quantize_model(model, config, data, **kw)
    from .imatrix import attached_importance, model_importance
    config = _as_config(config, model, imatrix=True)
    importance = model_importance(model, plan_model(model, config), imatrix, config_algorithms(config))
    with attached_importance(model, importance):
        return _quantize_model(model, config, data, **kw)


def _quantize_model(model: nn.Module, config: Union[ModelConfig, str, Mapping], data: Optional[Iterable] = None, *,
                    qat: bool = False, progress: bool = True, distributed: Any = None,
                    reference: Optional[dict] = None, moe_all_experts: bool = True, work_dir=None,
                    resume: bool = False, distill_data: Optional[Iterable] = None) -> nn.Module:
    """``quantize_model`` without ``imatrix`` (the importance, if any, is attached to the modules)."""
    if not isinstance(qat, bool):
        raise TypeError(f"qat must be a bool, got {qat!r}")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {progress!r}")
    if not isinstance(moe_all_experts, bool):
        raise TypeError(f"moe_all_experts must be a bool, got {moe_all_experts!r}")
    if reference is not None and not isinstance(reference, dict):
        raise TypeError(f"reference must be a dict (filled with the float weights) or None, got "
                        f"{type(reference).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = _as_config(config, model)
    plans = plan_model(model, config)
    meta = [n for n, t in model.named_parameters() if t.is_meta]
    if meta:
        raise ValueError(f"quantize_model: {len(meta)} parameters are on the meta device (e.g. {meta[0]!r}): offloaded "
                         f"by accelerate (a device_map with 'cpu' or 'disk' entries) or never loaded; quantize_model "
                         f"needs every weight in memory (on any devices). For a model larger than memory use "
                         f"qcore.adapters.passes.streaming.quantize_checkpoint")
    static = [f"{p.name}.{r}" for p in plans for r in ("input", "output")
              if isinstance(getattr(p.config, r), TensorConfig) and getattr(p.config, r).calibrated]
    if static and data is None:
        raise ValueError(f"the config has static activation scales ({', '.join(static[:3])}"
                         f"{', ...' if len(static) > 3 else ''}); pass calibration batches as data=")
    if data is not None and (isinstance(data, (torch.Tensor, Mapping)) or not isinstance(data, Iterable)):
        raise TypeError(f"data must be an iterable of batches (a list or a DataLoader), got {type(data).__name__}; "
                        f"wrap a single batch in a list: [batch]")
    _check_batches(model, data)
    if static and isinstance(data, (list, tuple)) and not data:
        raise ValueError("calibration data is empty; static activation scales need at least one batch")
    if distributed is not None:
        from .distributed import Distributed, fingerprint
        if not isinstance(distributed, Distributed):
            raise TypeError(f"distributed must be a qcore.adapters.distributed.Distributed, got "
                            f"{type(distributed).__name__}")
        distributed.check()
        if data is not None:
            data = list(data)
        distributed.check_consistent(fingerprint=fingerprint(model, config, plans),
                                     n_batches=len(data) if data is not None else 1)
    pinned: dict = {}
    algos = config_algorithms(config)
    from qcore.algorithms.config import split_distill
    dist, algos = split_distill(algos)  # quantization-aware distillation: last, on the whole quantized model
    teacher = None
    if dist is not None:
        from .passes.distill import check_distill, make_teacher
        if qat or distributed is not None:
            raise ValueError("distill trains the committed quantized model on one process: not with qat=True or "
                             "distributed=")
        if distill_data is None and data is None:
            raise ValueError("the algorithm distill needs training batches; pass calibration batches as data=")
        distill_data = list(data if distill_data is None else distill_data)
        _check_batches(model, distill_data)
        check_distill(model, plans, dist)
        teacher = make_teacher(model)  # the float model (a rotation keeps its function)
    elif distill_data is not None:
        raise ValueError("distill_data= is for the algorithm distill, which the config does not run")
    if work_dir is not None and data is not None:
        data = list(data)  # read by the fingerprint, then by the run
    work = _work_dir(model, config, algos, data, work_dir, resume, distributed, reference is not None)
    if algos:
        from qcore.algorithms.config import SpinQuantConfig, split_rotation
        rot, algos = split_rotation(algos)
        if qat:
            raise ValueError("qat=True keeps float master weights; the algorithms write quantized weights (use "
                             "qat=False with algorithms)")
        from .passes.hqq import split_hqq
        hq, algos = split_hqq(algos)  # HQQ (data-free) runs last, outside the layer runner: every Linear weight
        needs = [a.name for a in algos] + ([rot.name] if isinstance(rot, SpinQuantConfig) else [])
        if data is None and needs:
            raise ValueError(f"the algorithms {needs} need calibration data; pass calibration batches as data=")
        if data is not None:
            data = list(data)  # read more than once: by the algorithms and by calibration
            _check_batches(model, data)
        if hq is not None:
            from .passes.hqq import check_model
            check_model(model, plans, hq)
        if rot is not None:
            from .passes.rotation import check_rotation
            from .passes.spinquant import apply_rotation
            check_rotation(model, rot)
            if algos:
                from .passes.sequential import check_algorithms
                check_algorithms(model, plans, algos)
            try:
                apply_rotation(model, rot, plans=plans, data=data, progress=progress,
                               gptq_follows=any(a.name == "gptq" for a in algos))
            except BaseException:
                model._qcore_partial = True  # some weights may already be rotated
                raise
        if algos:
            from .moe import moe_calibration
            from .passes.sequential import run_algorithms
            # layers run several times per batch there: counted by calibrate's single pass only
            with moe_calibration(model, all_experts=moe_all_experts, warn=False) as moe, moe.counting(False):
                pinned = run_algorithms(model, plans, algos, data, progress=progress, reduce=distributed,
                                        reference=reference, work=work)
        if hq is not None:
            from .passes.hqq import apply_hqq
            try:
                apply_hqq(model, plans, hq, pinned, reference=reference, progress=progress)
            except BaseException:
                if rot is not None or algos:
                    model._qcore_partial = True  # the algorithms before it rewrote the float weights
                raise
    wrappers = [(p.name, model.get_submodule(p.name), wrap(model.get_submodule(p.name), p.config, name=p.name,
                                                           qat=qat, proj_weights=p.proj_weights)) for p in plans]
    for name, _, new in wrappers:
        _set_module(model, name, new)
    for name, _, new in wrappers:  # weights the algorithms quantized are committed as they are, before calibration
        if name in pinned:
            new.commit(weight=pinned[name])
    try:
        if static:
            calibrate(model, data, progress=progress, distributed=distributed, moe_all_experts=moe_all_experts)
        if qat:  # the scale buffers of the master weights, from the start
            with torch.no_grad():
                for _, _, new in wrappers:
                    for role in ("weight", "bias"):
                        if role in new.specs:
                            new.effective(role)
    except BaseException:
        for name, old, _ in wrappers:
            _set_module(model, name, old)
        if pinned:
            model._qcore_partial = True  # the float modules hold the algorithms' weights now
        raise
    if reference is not None:
        for name, _, new in wrappers:
            if name not in pinned and "weight" in new.specs and not isinstance(new, QuantExperts):  # experts:
                reference[name] = new.weight.detach().to("cpu", copy=True)  # not in layer_report yet (docs/adapters.md)
    if teacher is not None:  # what round-to-nearest rounded: the trained weights start there (distill's docs)
        distill_init = {name: new.weight.detach().clone() for name, _, new in wrappers
                        if name not in pinned and "weight" in new.specs and not isinstance(new, QuantExperts)}
    if not qat:
        # Past this point the model is quantized: writing the weights in place cannot be undone without a second
        # copy of them. If it is interrupted, the wrappers not yet written stay in their pending mode, which
        # fake-quantizes at the forward: the model is fully quantized either way.
        for _, _, new in _progress(wrappers, desc="quantizing weights", enabled=progress):
            new.commit()
    if teacher is not None:
        from .passes.distill import run_distill
        try:
            model.qcore_distill = run_distill(model, teacher, distill_data, dist, progress=progress,
                                              init=distill_init)
        except BaseException:
            model._qcore_partial = True  # trained part of the way (the weights are on their grids)
            raise
        finally:
            del teacher
    model.qcore_config = config  # what exporters write (qcore.adapters.export_hf)
    return model


def _work_dir(model, config, algos, data, work_dir, resume, distributed, keeps_reference):
    """``quantize_model``'s work directory (None without one), checked and tied to this run before any work."""
    from qcore._fsutil import model_sources

    from .passes.checkpointing import WorkDir, check_work_args, digest_model, fingerprint
    path = check_work_args(work_dir, resume, sources=model_sources(model))
    if path is None:
        return None
    from qcore.algorithms.config import ROTATION_CONFIGS
    layer_algos = [a for a in algos if not isinstance(a, ROTATION_CONFIGS)]
    if not layer_algos:
        raise ValueError(f"work_dir={str(work_dir)!r}: the config runs no layer-by-layer algorithm (gptq, awq, "
                         f"smoothquant, autosmoothquant), so there is no progress to save")
    if distributed is not None:
        raise ValueError(f"work_dir={str(work_dir)!r}: not with distributed= (each rank would write its own); run "
                         f"distributed calibration without a work directory")
    from .passes.runner import find_decoder_layers
    from .passes.sequential import _layers_path
    n = len(find_decoder_layers(model, _layers_path(layer_algos))[1])
    from .imatrix import importance_digest
    imp = importance_digest(model)
    fp = fingerprint(what="quantize_model", model=digest_model(model), config=config.to_dict(),
                     data=list(data) if data is not None else None, n_layers=n,
                     extra={"reference weights kept": keeps_reference, **({"imatrix": imp} if imp else {})})
    return WorkDir(path, fp, resume=resume)


def config_algorithms(config) -> tuple:
    """The algorithm configs of ``config`` (parsed; empty for round-to-nearest)."""
    from qcore.algorithms.config import parse_algorithms
    return parse_algorithms(_as_config(config).algorithms)


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: wrapper}`` of the quantized modules of ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantModule)}


def freeze(model: nn.Module, *, progress: bool = False) -> nn.Module:
    """Turn every quantized module's weight into packed low-bit codes + scales (in place; irreversible).

    Logs the model's bytes before and after (``logging`` at INFO, logger ``qcore.adapters``); ``model_bytes``
    gives them too."""
    mods = quantized_modules(model)
    if not mods:
        raise ValueError("freeze: the model has no qcore quantized modules; run quantize_model first")
    before = model_bytes(model)
    for m in _progress(list(mods.values()), desc="freezing", enabled=progress):
        m.freeze()
    after = model_bytes(model)
    _log.info("froze %d modules: %s -> %s bytes (%.3fx)", len(mods), f"{before:,}", f"{after:,}",
              after / before if before else 1.0)
    return model


def model_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (each storage counted once: tied weights once)."""
    seen: dict[Any, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if t is None:
            continue
        key = (t.device, t.untyped_storage().data_ptr()) if t.numel() else id(t)
        seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes() if t.numel() else 0)
    return sum(seen.values())

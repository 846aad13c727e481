"""The plan of a model under a ``ModelConfig``: which module gets which ``LayerConfig`` (``plan_model``), what the
config keeps float and why (``default_exclude``, ``excluded_weights``), what is still float that should not be
(``unquantized_weights``), and the model's quantized modules (``quantized_modules``). Pure: nothing here changes
a model. A scheme given by name (a preset, or one of llama.cpp's mixes, resolved on the model) becomes its
``ModelConfig`` once, in ``resolve_config``.
"""

from __future__ import annotations

import difflib
import re
import shlex
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from qcore.algorithms.config import check_runnable

from .config import COMPUTE_TYPES, LayerConfig, ModelConfig, match_name, match_tree
from .families import non_language_modules
from .gguf_mix import gguf_mix
from .modules import (EXPERT_PROJS, QUANT_CLASSES, QuantExperts, QuantModule, is_fused_experts, is_quantized_module,
                      quantizable_type)
from .presets import mix_of_preset, preset

__all__ = ["plan_model", "NoMatchError", "check_plannable", "resolve_config", "default_exclude", "LayerPlan", "FloatWeight", "unquantized_weights",
           "excluded_weights", "quantized_modules", "module_type"]


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


class NoMatchError(ValueError):
    """A config's pattern matches no module of the model: ``field`` (``"exclude"``, ``"by_name"``,
    ``"kv_cache.targets"``), the ``pattern``, and ``hint`` (the closest module names), so that a caller can name the
    option the pattern came from (``qcore quantize --exclude``)."""

    def __init__(self, what: str, field: str, pattern: str, hint: str):
        super().__init__(f"{what} {pattern!r} matches no module of the model{hint}")
        self.field, self.pattern, self.hint = field, pattern, hint


def _no_match_error(what: str, field: str, pattern: str, names: list[str]) -> NoMatchError:
    core = pattern[3:] if pattern.startswith("re:") else pattern.replace("*", "")
    close = difflib.get_close_matches(core, names, n=5, cutoff=0.3)
    if not close:
        close = [n for n in names if core and core.split(".")[-1] in n][:5]
    hint = f"; closest module names: {close}" if close else f"; module names look like {names[:5]}"
    return NoMatchError(what, field, pattern, hint)


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
    return _output_head(model) + non_language_modules(model)


def resolve_config(config: Any, model: Optional[nn.Module] = None, *, imatrix: bool = False) -> ModelConfig:
    if isinstance(config, ModelConfig):
        return config
    if model is not None and isinstance(config, str):  # llama.cpp's mixes: resolved on the model (and on whether
        if mix_of_preset(config) is not None:  # an imatrix is used: llama.cpp's Q4_0 / Q5_0 mixes differ)
            return gguf_mix(model, mix_of_preset(config), imatrix=imatrix).config
    if isinstance(config, str):
        return preset(config)
    if isinstance(config, Mapping):
        return ModelConfig.from_dict(config)
    raise TypeError(f"config must be a ModelConfig, a preset name or a config dict, got {type(config).__name__}")


def plan_model(model: nn.Module, config: Union[ModelConfig, str, Mapping], *, quantized_ok: bool = False,
               check_float: bool = True) -> list[LayerPlan]:
    """Resolve ``config`` on ``model``: the modules that will be quantized and their configs. Pure: raises
    ``ValueError``/``TypeError`` for patterns matching nothing, configs that cannot apply, tied weights shared
    with a module treated differently, an already quantized model, and weight matrices qcore cannot quantize
    yet that no exclusion names (fused MoE expert tensors of a layout qcore does not know, fused projections held
    on a module, ...: see ``unquantized_weights``); changes nothing. Fused MoE experts of a known layout
    (``qcore.adapters.modules.KNOWN_EXPERTS``) are planned as one module of type ``"Experts"``.

    ``exclude`` / ``by_name`` patterns match module names (a pattern naming a module covers everything in it) and,
    for the weights qcore cannot quantize and for fused experts, their parameter names too
    (``model.layers.0.mlp.experts.down_proj``; fused experts are kept float only as a whole: both parameters).
    quantized_ok: resolve the config on a quantized model as on its float original (the exporters, which check
        that the config describes the model they write). check_float=False: the checkpoint loaders, which
        resolve a saved config on a float skeleton."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = resolve_config(config, model)
    mods = dict(model.named_modules())
    if quantized_ok:  # exporters: resolve the config on a quantized model as on its float original
        mods = {n: _FloatView(m) if is_quantized_module(m) else m for n, m in mods.items()}
    else:
        check_plannable(model, config)
    names = [n for n in mods if n]
    exclude = default_exclude(model) if config.exclude is None else list(config.exclude)
    odd = _odd_weights(mods)  # weight matrices of kinds qcore cannot quantize: excluded by name or refused below
    experts = {n: [f"{n}.{p}" for p in EXPERT_PROJS] for n, m in mods.items() if n and module_type(m) == "Experts"}
    # exclude / by_name may name those parameters, and the fused experts' (quantized together, per module)
    targets = names + [w.name for w in odd] + [q for ps in experts.values() for q in ps]
    for p in ([] if config.exclude is None else exclude):
        if not any(match_name(p, n) for n in targets):
            raise _no_match_error("ModelConfig.exclude entry", "exclude", p, names)
    for p in config.by_name:
        if not any(match_name(p, n) for n in targets):
            raise _no_match_error("ModelConfig.by_name pattern", "by_name", p, names)
    kv_targets = config.kv_cache.targets if config.kv_cache is not None else ()
    for p in kv_targets:
        if not any(match_name(p, n) for n in names):
            raise _no_match_error("KVCacheConfig.targets pattern", "kv_cache.targets", p, names)

    plans: list[LayerPlan] = []
    skipped: list[str] = []
    for name, m in mods.items():
        if not name:
            continue
        tname = module_type(m)
        named = next((p for p in config.by_name if match_tree(p, name)), None)
        excluded = any(match_tree(p, name) for p in exclude)
        proj_weights: dict = {}
        if name in experts:  # fused experts: patterns may name the module or both of its parameters
            named, excluded, proj_weights = _experts_patterns(name, experts[name], config, exclude, named, excluded)
        if tname is None:
            if named is not None and config.by_name[named] is not None and not any(
                    match_tree(named, n) and module_type(mods[n]) is not None for n in names):
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
        if kv_targets and any(match_name(p, name) for p in kv_targets):
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
    if check_float and not quantized_ok:
        left = [w for w in odd if not _kept_float(w, config, exclude)]
        if left:
            raise _unsupported_error(left, config, exclude)
    _check_ties(model, mods, plans)
    return plans


def check_plannable(model: nn.Module, config: ModelConfig) -> None:
    """What makes ``model`` unfit to quantize with ``config`` whatever the plan: it already holds quantized modules,
    an algorithm run left it half-rewritten, or the config names an algorithm qcore cannot run. ``plan_model``
    checks it; ``quantize_model(..., plans=)`` checks it for the plan it is given."""
    if any(is_quantized_module(m) for m in model.modules()):
        raise ValueError("the model already holds qcore quantized modules; quantize a float model (reload it)")
    if config.algorithms:
        try:
            check_runnable(config.algorithms)
        except (ValueError, TypeError) as e:
            raise type(e)(f"ModelConfig.algorithms: {e}") from None
    if getattr(model, "_qcore_partial", False):
        raise ValueError("an algorithm run on this model failed half-way and left some layers rewritten; reload "
                         "the model and quantize it again")


def _experts_patterns(name: str, params: list, config: ModelConfig, exclude: list, named, excluded) -> tuple:
    """(by_name pattern, excluded, {projection: (pattern, TensorConfig)}) of the fused experts module ``name``: a
    pattern naming the module (or a parent) or both its parameters applies; one naming one parameter only gives
    that projection its own weight spec when its config quantizes the weight only (GGUF types: checked by the
    caller), and is refused otherwise (the experts are quantized together)."""
    def hits(p):
        return [q for q in params if match_name(p, q)]

    def refuse(what, got):
        return ValueError(f"{what} names {got} but not {[q for q in params if q not in got]}: the fused MoE experts "
                          f"{name!r} are quantized together; name the module {name!r} (or all of its parameters), "
                          f"or give the one projection a weight-only config of a GGUF type")
    proj_weights: dict = {}
    for p in config.by_name:
        if 0 < len(hits(p)) < len(params) and not match_tree(p, name):
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
        return (bool(w.module) and match_tree(p, w.module)) or match_name(p, w.name)
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
    return shlex.quote(s)


def _walk_config(model: nn.Module, config: Any) -> tuple[ModelConfig, dict, list]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if config is None:
        config = getattr(model, "qcore_config", None)
        if config is None:
            raise ValueError("config: the model was not quantized by quantize_model (it has no qcore_config); "
                             "pass the config it was quantized with")
    config = resolve_config(config, model)
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
    for p in plan_model(model, config, quantized_ok=True, check_float=False):
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
        if not name or module_type(m) is None or module_type(m) not in COMPUTE_TYPES:
            continue
        named = next((p for p in config.by_name if match_tree(p, name)), None)
        if module_type(m) == "Experts":
            params = [f"{name}.{p}" for p in EXPERT_PROJS]
            named, excl, _ = _experts_patterns(name, params, config, exclude, named,
                                               any(match_tree(p, name) for p in exclude))
            if excl or (named is not None and config.by_name[named] is None):
                out += [FloatWeight(f"{name}.{p}", name, type(m).__name__, tuple(getattr(m, p).shape),
                                    "excluded by the config") for p in EXPERT_PROJS]
            continue
        if any(match_tree(p, name) for p in exclude) or (named is not None and config.by_name[named] is None):
            w = getattr(m, "weight", None)
            out.append(FloatWeight(f"{name}.weight", name, type(m).__name__,
                                   tuple(w.shape) if isinstance(w, torch.Tensor) else (), "excluded by the config"))
    out += [w for w in _odd_weights(mods) if _kept_float(w, config, exclude)]
    return out


class _FloatView:
    """Stands for a quantized module in ``plan_model(..., quantized_ok=True)``: its float type and its weight."""

    def __init__(self, m):
        self.weight = m._parameters.get("weight", getattr(m, "weight_packed", None))
        self._base = m.float_type
        self._experts = isinstance(m, QuantExperts)


def _nothing_planned(mods: dict) -> ValueError:
    """The error for a config that quantizes no module: what the model has, and why none of it is quantized."""
    supported = [c.__name__ for c in QUANT_CLASSES]
    quantizable = [n for n, m in mods.items() if n and module_type(m) is not None]
    other: dict[str, int] = {}  # modules with a weight matrix of a type qcore does not wrap
    for n, m in mods.items():
        w = getattr(m, "weight", None)
        if n and module_type(m) is None and isinstance(w, torch.Tensor) and w.dim() >= 2 and \
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


def module_type(m) -> Optional[str]:
    """The config's type name of ``m`` (``"Linear"``, ..., ``"Experts"``; a quantized module's as its float type's,
    ``_FloatView`` too), or None for a module qcore does not quantize (``modules.quantizable_type``)."""
    if isinstance(m, _FloatView):
        return "Experts" if m._experts else next((c.__name__ for c in QUANT_CLASSES if m._base is c), None)
    return quantizable_type(m)


def _check_ties(model, mods, plans):
    """A weight tensor shared by several modules must get the same weight config in all of them."""
    by_param: dict[int, list[tuple[str, Any]]] = {}
    cfg = {p.name: p.config.weight for p in plans}
    for name, m in mods.items():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and module_type(m) is not None:
            by_param.setdefault(id(w), []).append((name, cfg.get(name)))
    for users in by_param.values():
        if len(users) > 1 and len({repr(c) for _, c in users}) > 1:
            desc = ", ".join(f"{n!r} ({'float' if c is None else c.spec.name or c.spec.dtype.name})" for n, c in users)
            raise ValueError(f"tied weight shared by {desc} would be quantized differently; give the tied modules "
                             f"the same config (or exclude all of them), or untie the weights first")


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: wrapper}`` of the quantized modules of ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantModule)}

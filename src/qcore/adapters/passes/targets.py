"""What every layer algorithm's binding shares: the modules of a decoder layer an algorithm acts on
(``named_targets``), the decoder layers and each layer's plans (``layers_path``, ``layer_plans``), the refusal of
fused MoE experts by the algorithms that do not handle them (``check_experts_algorithms``), the groups of modules
that read one input (``input_stages``), GPTQ's scale rule from a weight observer (``scale_fn``) and the writing of
a decided QTensor into a layer (``write_pinned``)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

import qcore
from qcore.algorithms.config import ROTATION_CONFIGS, GPTQConfig
from qcore.stats import RunningStats

from ..config import ExponentSearch, FourOverSix, MinMax, Percentile
from ..modules import linear_weight
from .runner import LayerInputs, find_decoder_layers, forward_layer

__all__ = ["named_targets", "scale_fn", "write_pinned", "input_stages", "layers_path", "layer_plans",
           "check_experts_algorithms"]


def scale_fn(plan, spec):
    """GPTQ's scale rule for a weight slice from the layer's weight observer (None: the spec's own rule). Two-level
    specs (FourOverSix) take the loop's ``tensor_scale`` (``qcore.algorithms.gptq``'s ``scale_fn`` protocol)."""
    obs = plan.config.weight.observer
    if isinstance(obs, MinMax):
        return None
    if isinstance(obs, FourOverSix):
        def f(part, tensor_scale=None):
            return qcore.stats.four_over_six(part, spec, tensor_scale=tensor_scale)._asdict()
        return f
    if isinstance(obs, ExponentSearch):
        def f(part):
            return qcore.stats.exponent_search(part, spec, radius=obs.radius)._asdict()
        return f
    if isinstance(obs, Percentile):
        def f(part):
            a = qcore.stats.percentile(part, spec.granularity, q=obs.q)
            return qcore.stats.scale_from_stats(RunningStats(spec.granularity, absmax=a, lo=-a, hi=a, count=1),
                                                spec)._asdict()
        return f

    def f(part):
        return qcore.stats.mse_clip(part, spec, grid=obs.grid, lo=obs.lo, p=obs.p)._asdict()
    return f


def named_targets(layer: nn.Module, lplans: dict, algo, prefix: str) -> list:
    """``[(name, module, plan)]`` of the modules a layer algorithm acts on: those ``algo.modules`` names (relative to
    the decoder layer; each must exist and be quantized by the config), or by default every module of the layer
    whose weight the config quantizes. Errors name the algorithm, the module and the layer."""
    names = list(algo.modules) if algo.modules else [n for n, p in lplans.items() if p.config.weight is not None]
    out = []
    for n in names:
        try:
            m = layer.get_submodule(n)
        except AttributeError:
            raise ValueError(f"{algo.name} modules: {n!r} is not a module of decoder layer {prefix!r}; its Linears: "
                             f"{[k for k, v in layer.named_modules() if isinstance(v, nn.Linear)][:8]}") from None
        plan = lplans.get(n)
        if plan is None or plan.config.weight is None:
            if algo.modules:
                raise ValueError(f"{algo.name} modules: {prefix}.{n} gets no weight quantization from the config")
            continue
        out.append((n, m, plan))
    return out


def input_stages(layer: nn.Module, targets: list[str], inputs: LayerInputs, true_sequential: bool,
            experts: frozenset = frozenset()) -> list[list[list[str]]]:
    """Targets grouped by shared input (the same tensor object) in call order; with ``true_sequential`` each
    input group is its own stage, else one stage holds every group. Fused experts modules (``experts``) are
    groups of their own."""
    order: list[str] = []
    seen: dict[str, Any] = {}  # the input tensors themselves (kept alive, so identity is meaningful)

    def hook(name):
        def f(mod, args):
            if name not in seen:
                seen[name] = args[0] if args else None
                order.append(name)
        return f

    hs = [layer.get_submodule(n).register_forward_pre_hook(hook(n)) for n in targets]
    try:
        with torch.no_grad():
            forward_layer(layer, LayerInputs(inputs.args[:1], inputs.kwargs[:1]), keep=False)
    finally:
        for h in hs:
            h.remove()
    missing = [n for n in targets if n not in seen]
    if missing:
        raise ValueError(f"gptq: modules {missing} are not called by the decoder layer's forward")
    groups: list[list[str]] = []
    for n in order:
        g = None if n in experts else next((g for g in groups if g[0] not in experts and seen[g[0]] is seen[n]), None)
        if g is None:
            groups.append([n])
        else:
            g.append(n)
    return [[g] for g in groups] if true_sequential else [groups]


def write_pinned(m: nn.Module, q, pinned: dict, name: str, reference: Optional[dict] = None) -> None:
    if reference is not None:  # the float weight GPTQ started from (after any folds), for the report
        reference[name] = m.weight.detach().to("cpu", copy=True)
    with torch.no_grad():
        linear_weight(m).copy_(qcore.dequantize(q).to(m.weight.dtype))
    pinned[name] = q


def layers_path(algos) -> Optional[str]:
    """The decoder layers' path the algorithm configs name (``decoder_layers``; None: found from the model)."""
    paths = {a.decoder_layers for a in algos if a.decoder_layers is not None}
    if len(paths) > 1:
        raise ValueError(f"the algorithm configs name different decoder layers: {sorted(paths)}")
    return next(iter(paths), None)


def layer_plans(model: nn.Module, plans: list, algos) -> tuple[str, nn.ModuleList, list[dict]]:
    """``(path, layers, by_layer)``: the decoder layers the algorithms act on and, per layer, ``{name relative to
    the layer: LayerPlan}`` of its quantized modules (``qcore.adapters.passes.streaming`` shares this)."""
    check_experts_algorithms(plans, algos)  # fused MoE experts: refused by name, before any work (issue 22)
    path, layers = find_decoder_layers(model, layers_path(algos))
    by_layer: list[dict] = [{} for _ in layers]
    for p in plans:
        if p.name.startswith(path + "."):
            idx, _, rel = p.name[len(path) + 1:].partition(".")
            if idx.isdigit() and rel:
                by_layer[int(idx)][rel] = p
    if not any(by_layer):
        raise ValueError(f"the algorithms act on the decoder layers {path!r}, but the config quantizes none of "
                         f"their modules")
    return path, layers, by_layer


def check_experts_algorithms(plans: list, algos, *, who: Optional[str] = None) -> None:
    """Before any work: ValueError when a layer algorithm other than GPTQ (AWQ, SmoothQuant, ...; or the pass
    ``who``, e.g. AMP's sensitivities) would run on a model whose plan quantizes fused experts (they know Linear
    weights only; fused experts would be left to round-to-nearest without a word). GPTQ quantizes each expert
    (``passes.gptq``); rotations act on the float model before it and are not concerned."""
    layer = [a.name for a in algos if not isinstance(a, ROTATION_CONFIGS + (GPTQConfig,))] + ([who] if who else [])
    experts = [p.name for p in plans if p.type == "Experts"]
    if layer and experts:
        raise ValueError(f"{', '.join(layer)}: the plan quantizes fused MoE experts ({len(experts)} module(s), e.g. "
                         f"{experts[0]!r}: tensors {experts[0]}.gate_up_proj / down_proj), which these algorithms "
                         f"do not handle yet (GPTQ does; docs/adapters.md); quantize without them (round-to-nearest or "
                         f"GPTQ), or keep the experts float: exclude=[..., 're:.*\\.experts']")

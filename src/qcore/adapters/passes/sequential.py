"""Run quantization algorithms (GPTQ, AWQ, SmoothQuant, AutoSmoothQuant) on a torch model one decoder layer at a
time, in bounded memory.

``run_algorithms(model, plans, algorithms, batches)`` (called by ``quantize_model`` when the config lists
algorithms) is a pass of the layer runner (``qcore.adapters.passes.runner``):

1. the decoder layers are found (``decoder_layers`` of the algorithm config, e.g. ``"model.layers"``, or the
   model's longest ``nn.ModuleList`` of identical blocks);
2. the calibration batches run through the model until the first layer; its inputs (hidden states and the
   keyword arguments: attention mask, position embeddings) are kept, once per batch;
3. for each layer in turn: each algorithm, in the order given, reads the statistics it needs from forwards of
   this layer alone over the kept inputs and rewrites the layer's float weights (scalings folded into the
   preceding op; GPTQ writes its quantized weights); then the layer's outputs over the kept inputs, with its
   weights as the algorithms left them, become the next layer's inputs.

GPTQ covers the Linear (and transformers Conv1D) modules of the layers and their fused MoE experts
(``_gptq_experts``: each expert's slice of ``gate_up_proj`` / ``down_proj``, with Hessians from the tokens that
expert's GEMMs compute on; every token under ``quantize_model``'s all-expert routing, docs/algorithms.md).

Peak memory: the model plus two copies of one layer's inputs (``batches x tokens x hidden`` floats) and the
statistics of one layer (GPTQ: one ``in x in`` float64 Hessian per distinct input; fused experts: one copy of
the MoE block's input and two Hessians at a time). Modules outside the decoder layers (embeddings, the output
head when not excluded) are quantized by round-to-nearest afterwards.

Returns ``{module name: QTensor}`` for the weights GPTQ quantized (fused experts: ``{proj: [QTensor or None per
expert]}``); ``quantize_model`` commits them as they are (the exported checkpoint holds exactly these codes and
scales).

Failure: every check (layer discovery, modules named in the configs, specs GPTQ cannot take, scaling groups
that cannot be folded) runs before any weight changes. An error or interrupt while layers are being processed
leaves the layers already done rewritten: the error says so, and the model is marked so that quantizing it again
is refused (reload it).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import qcore
from qcore.algorithms.config import (AutoSmoothQuantConfig, AWQConfig, GPTQConfig, SmoothQuantConfig,
                                     parse_algorithms)
from qcore.algorithms.gptq import HessianStats, _HessianSum, check_gptq_spec, gptq
from qcore.stats import RunningStats

from ..config import MinMax, Percentile
from ..modules import EXPERT_PROJS, experts_weight_spec, gguf_cat, is_fused_experts, linear_weight, linear_weight_spec
from ..families import family_or_none
from .runner import AlgorithmError, LayerInputs, LayerRunner, Stop, find_decoder_layers, forward_layer

_log = logging.getLogger("qcore.adapters")

__all__ = ["run_algorithms", "find_decoder_layers", "AlgorithmError"]


# layers and their inputs: qcore.adapters.passes.runner (find_decoder_layers and AlgorithmError stay importable here)


# ---------------------------------------------------------------------------------------------------------------
# GPTQ
# ---------------------------------------------------------------------------------------------------------------


def _scale_fn(plan, spec):
    """GPTQ's scale rule for a weight slice from the layer's weight observer (None: the spec's own rule)."""
    obs = plan.config.weight.observer
    if isinstance(obs, MinMax):
        return None
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


def _gptq_targets(layer: nn.Module, lplans: dict, algo: GPTQConfig, prefix: str) -> list[str]:
    out = []
    for n, m, plan in named_targets(layer, lplans, algo, prefix):
        if is_fused_experts(m):  # fused MoE experts: GPTQ per expert slice (_gptq_experts)
            for proj in EXPERT_PROJS:
                spec = experts_weight_spec(m, _proj_config(plan, proj), f"{prefix}.{n}", proj)
                try:
                    check_gptq_spec(spec, tuple(m._parameters[proj].shape[1:]))
                except ValueError as e:
                    raise ValueError(f"{algo.name}: {prefix}.{n}.{proj} (each expert's slice): {e}") from None
            out.append(n)
            continue
        if linear_weight(m) is None:
            continue  # GPTQ here covers Linear (and Conv1D) layers and fused experts; other types: round-to-nearest
        spec = linear_weight_spec(m, plan, f"{prefix}.{n}")
        if spec.gguf and algo.name != "gptq":
            raise ValueError(f"{algo.name}: {prefix}.{n}: GGUF weight specs ({spec.gguf}) are quantized by llama.cpp's "
                             f"search inside GPTQ only (qcore.algorithms.gptq_gguf); use gptq, or round-to-nearest")
        try:
            check_gptq_spec(spec, tuple(linear_weight(m).shape))
        except ValueError as e:
            raise ValueError(f"{algo.name}: {prefix}.{n}: {e}") from None
        out.append(n)
    return out


def _stages(layer: nn.Module, targets: list[str], inputs: LayerInputs, true_sequential: bool,
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


def _collect_hessians(layer, groups: list[list[str]], inputs: LayerInputs, stop_after: Optional[str],
                      experts: frozenset = frozenset()):
    """``(stats, calls)``: the Hessian statistics of each Linear group's head, and for each fused experts head
    its calls ``[(hidden states [T, H], top-k index [T, k'])]`` (one per batch)."""
    sums: dict[str, _HessianSum] = {}  # running sums updated in place (update_hessian's bits, no copy per batch)
    calls: dict[str, list] = {}
    heads = [g[0] for g in groups if g[0] not in experts]

    def hook(name):
        def f(mod, args):
            x = args[0].detach()
            if name not in sums:
                sums[name] = _HessianSum(x.shape[-1], like=x)
            sums[name].add(x)
            if name == stop_after:
                raise Stop
        return f

    def ehook(name):
        def f(mod, args, kwargs):
            calls.setdefault(name, []).append(_experts_call(args, kwargs, f"{name}"))
            if name == stop_after:
                raise Stop
        return f

    hs = [layer.get_submodule(n).register_forward_pre_hook(hook(n)) for n in heads]
    hs += [layer.get_submodule(g[0]).register_forward_pre_hook(ehook(g[0]), with_kwargs=True)
           for g in groups if g[0] in experts]
    try:
        forward_layer(layer, inputs, keep=False)
    finally:
        for h in hs:
            h.remove()
    return {k: v.stats() for k, v in sums.items()}, calls


def _experts_call(args, kwargs, name: str) -> tuple:
    """``(hidden states [T, H], top-k index [T, k'])`` of a call ``experts(hidden_states, top_k_index,
    top_k_weights)`` (transformers 5's fused experts, positional or by keyword)."""
    keys = ("hidden_states", "top_k_index")
    vals = list(args[:2]) + [kwargs.get(k) for k in keys[len(args[:2]):]]
    x, index = vals
    if not (isinstance(x, torch.Tensor) and isinstance(index, torch.Tensor) and x.dim() == 2 and index.dim() == 2
            and index.shape[0] == x.shape[0] and not index.is_floating_point()):
        raise ValueError(f"gptq: the fused experts {name} were called with "
                         f"{[tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in vals]}; "
                         f"expected experts(hidden_states [tokens, hidden], top_k_index [tokens, k], top_k_weights)")
    return x.detach(), index.detach()


def _hessian_rows(rows: list, n: int, like: torch.Tensor) -> HessianStats:
    st = _HessianSum(n, like=like)
    for x in rows:
        if x.shape[0]:
            st.add(x)
    return st.stats()


def _proj_config(plan, proj: str):
    """The LayerConfig of fused experts' projection ``proj``: the plan's, with the projection's own weight spec
    when it has one (``LayerPlan.proj_weights``)."""
    own = dict(getattr(plan, "proj_weights", ()) or ()).get(proj)
    if own is None:
        return plan.config
    return dataclasses.replace(plan.config, weight=own)


def _gptq_experts(layer, name: str, calls: list, lplans: dict, algo: GPTQConfig, prefix: str, pinned: dict,
                  reduce=None) -> None:
    """GPTQ on every expert's slice of both projections of the fused experts ``layer.<name>``, from its captured
    ``calls``. Expert ``e``'s Hessians come from the tokens its GEMMs compute on in those calls (its rows of the
    top-k index): every token under all-expert routing (``moe_calibration``, as ``quantize_model`` runs the
    algorithms), else the routed ones. ``gate_up_proj``'s from the hidden states; ``down_proj``'s from
    ``act(gate) * up`` with that expert's ``gate_up_proj`` (GPTQ's result under ``true_sequential``, else the
    float one, as for Linear stages). An expert without any token (after ``reduce``) is left to round-to-nearest
    (None in its slot: ``QuantExperts.commit``). ``pinned[name]``: ``{proj: [QTensor or None per expert]}``."""
    m = layer.get_submodule(name)
    full = f"{prefix}.{name}"
    plan = lplans[name]
    specs = {p: experts_weight_spec(m, _proj_config(plan, p), full, p) for p in EXPERT_PROJS}
    fns = {p: _scale_fn(plan, specs[p]) for p in EXPERT_PROJS}
    kw = dict(block_size=algo.block_size, damp=algo.damp, act_order=algo.act_order, static_groups=algo.static_groups)
    gu, dn = m._parameters["gate_up_proj"], m._parameters["down_proj"]
    imp = m.__dict__.get("_gguf_importance")  # quantize_model(..., imatrix=): {proj: [E, halves, in]}
    n_exp = gu.shape[0]
    out: dict = {p: [None] * n_exp for p in EXPERT_PROJS}
    every_token = None  # the gate_up statistics of all tokens (shared by the experts that computed on all of them)
    starved = []
    for e in range(n_exp):
        sel = [(idx == e).any(dim=-1) for _, idx in calls]
        every = all(bool(s.all()) for s in sel)
        xs = [x if every else x[s] for (x, _), s in zip(calls, sel)]
        if every:
            if every_token is None:
                every_token = _hessian_rows(xs, gu.shape[2], gu)
            h_gu = every_token
        else:
            h_gu = _hessian_rows(xs, gu.shape[2], gu)
        if reduce is not None:
            h_gu = reduce(h_gu)  # the same number of calls on every rank: counts are summed before deciding
        if h_gu.count == 0:
            starved.append(e)
            continue
        w0 = gu[e].detach().to(torch.float32, copy=True)
        q = _experts_gptq(w0.clone(), h_gu, specs["gate_up_proj"], fns["gate_up_proj"], kw, imp, "gate_up_proj", e)
        gu[e].copy_(qcore.dequantize(q).to(gu.dtype))
        out["gate_up_proj"][e] = q
        w_in = gu[e] if algo.true_sequential else w0.to(gu.dtype)
        acts = []
        for x in xs:
            g, u = F.linear(x, w_in).chunk(2, dim=-1)  # what the expert's eager forward computes
            acts.append(m.act_fn(g) * u)
        h_dn = _hessian_rows(acts, dn.shape[2], dn)
        if reduce is not None:
            h_dn = reduce(h_dn)
        q = _experts_gptq(dn[e].detach().to(torch.float32, copy=True), h_dn, specs["down_proj"], fns["down_proj"],
                          kw, imp, "down_proj", e)
        dn[e].copy_(qcore.dequantize(q).to(dn.dtype))
        out["down_proj"][e] = q
    if starved:
        _log.warning("gptq: %s: experts %s computed on no calibration token (routed-only calibration); they are "
                     "rounded to nearest", full, starved)
    pinned[full] = out


def _experts_gptq(w, hess, spec, fn, kw: dict, imp, proj: str, e: int):
    """GPTQ's QTensor of expert ``e``'s ``proj`` slice ``w``; with an importance (GGUF specs,
    ``quantize_model(..., imatrix=)``) llama.cpp's weighted search per block, the gate and up rows of
    ``gate_up_proj`` each with theirs (rows are independent under one Hessian: two runs when they differ)."""
    rows = None if imp is None or not spec.gguf else imp.get(proj)
    if rows is None:
        return gptq(w, hess, spec, scale_fn=fn, **kw).qtensor
    rows = rows[e]
    if all(np.array_equal(rows[0], r) for r in rows[1:]):
        return gptq(w, hess, spec, scale_fn=fn, imatrix=rows[0], **kw).qtensor
    k = w.shape[0] // len(rows)
    return gguf_cat([gptq(w[h * k:(h + 1) * k].contiguous(), hess, spec, scale_fn=fn, imatrix=r, **kw).qtensor
                     for h, r in enumerate(rows)])


def _concat_ok(specs: list) -> bool:
    s0 = specs[0]
    if any(s != s0 for s in specs):
        return False
    g = s0.granularity
    return not s0.two_level and not s0.gguf and not isinstance(g, (qcore.PerTensor, qcore.PerBlock)) and not (
        isinstance(g, qcore.PerGroup) and g.axis % 2 == 0)


def _gptq_group(layer, names: list[str], hess: HessianStats, lplans: dict, algo: GPTQConfig, prefix: str,
                pinned: dict, reduce=None, reference: Optional[dict] = None) -> None:
    if reduce is not None:
        hess = reduce(hess)
    kw = dict(block_size=algo.block_size, damp=algo.damp, act_order=algo.act_order, static_groups=algo.static_groups)
    solve_group(layer, names, lplans, prefix, pinned, reference,
                lambda w, spec, fn, **imp: gptq(w, hess, spec, scale_fn=fn, **imp, **kw))


def solve_group(layer, names: list[str], lplans: dict, prefix: str, pinned: dict, reference: Optional[dict],
                solve) -> None:
    """The Linears ``names`` of one input group through a GPTQ-like column solver, ``solve(weight [out, in],
    spec, scale_fn) -> GPTQResult`` (GPTQ, GPTAQ), their QTensors written (``_write``). Rows of weights sharing
    an input and a per-row / per-group spec are independent under one set of statistics: one run over the
    stacked rows equals the runs one by one, and is what runs when the specs allow it."""
    mods = [layer.get_submodule(n) for n in names]
    specs = [linear_weight_spec(m, lplans[n], f"{prefix}.{n}") for m, n in zip(mods, names)]
    fns = [_scale_fn(lplans[n], s) for n, s in zip(names, specs)]
    if len(mods) > 1 and _concat_ok(specs) and all(f is None for f in fns):
        w = torch.cat([linear_weight(m).detach().float() for m in mods], 0)
        r = solve(w, specs[0], None)
        q = r.qtensor
        rows = 0
        for n, m in zip(names, mods):
            k = linear_weight(m).shape[0]
            part = qcore.quantize(r.weight[rows:rows + k], specs[0],
                                  scale=q.scales[rows:rows + k],
                                  zero_point=None if q.zero_points is None else q.zero_points[rows:rows + k])
            _write(m, part, pinned, f"{prefix}.{n}", reference)
            rows += k
        return
    for n, m, spec, fn in zip(names, mods, specs, fns):
        imp = m.__dict__.get("_gguf_importance") if spec.gguf else None  # quantize_model(..., imatrix=)
        r = solve(linear_weight(m).detach().float().contiguous(), spec, fn,
                  **({} if imp is None else {"imatrix": imp}))
        _write(m, r.qtensor, pinned, f"{prefix}.{n}", reference)


def _write(m: nn.Module, q, pinned: dict, name: str, reference: Optional[dict] = None) -> None:
    if reference is not None:  # the float weight GPTQ started from (after any folds), for the report
        reference[name] = m.weight.detach().to("cpu", copy=True)
    with torch.no_grad():
        linear_weight(m).copy_(qcore.dequantize(q).to(m.weight.dtype))
    pinned[name] = q


def _run_gptq(layer, lplans, inputs: LayerInputs, algo: GPTQConfig, prefix: str, pinned: dict, reduce=None,
              reference: Optional[dict] = None) -> None:
    targets = _gptq_targets(layer, lplans, algo, prefix)
    if not targets:
        return
    experts = frozenset(n for n in targets if is_fused_experts(layer.get_submodule(n)))
    stages = _stages(layer, targets, inputs, algo.true_sequential, experts)
    for stage in stages:
        last_head = stage[-1][0]
        with torch.no_grad():
            stats, calls = _collect_hessians(layer, stage, inputs, stop_after=last_head, experts=experts)
            shared = _layer_parallel(layer, stage, stats, experts, lplans, algo, prefix, reduce, reference)
            for group in stage:
                if group[0] in experts:
                    _gptq_experts(layer, group[0], calls[group[0]], lplans, algo, prefix, pinned, reduce)
                elif shared is not None:
                    shared(group, pinned)
                else:
                    _gptq_group(layer, group, stats[group[0]], lplans, algo, prefix, pinned, reduce, reference)
            del stats, calls, shared


def _layer_parallel(layer, stage, stats, experts, lplans, algo, prefix, reduce, reference):
    """Layer-parallel GPTQ (``Distributed(layer_parallel=True)``; None otherwise): every Linear group's Hessian is
    reduced (on every rank, in stage order), the groups are given to the ranks by cost (``Distributed.owners``)
    and each rank runs ``_gptq_group`` on its own; the returned ``shared(group, pinned)`` then takes the group's
    QTensors from its owner (``Distributed.share``), writes them on the other ranks, and fills ``pinned`` (and
    ``reference``) in stage order, as one process does."""
    if not getattr(reduce, "layer_parallel", False):
        return None
    groups = [g for g in stage if g[0] not in experts]
    hess = {g[0]: reduce(stats.pop(g[0])) for g in groups}  # the local sums freed as they are reduced

    def cost(g):
        ws = [linear_weight(layer.get_submodule(n)) for n in g]
        cols = ws[0].shape[1]
        return sum(w.shape[0] for w in ws) * cols ** 2 + cols ** 3
    who = dict(zip((g[0] for g in groups), reduce.owners([cost(g) for g in groups])))
    rank = reduce.rank
    mine: dict = {}
    mine_ref: Optional[dict] = None if reference is None else {}
    for g in groups:
        if who[g[0]] == rank:
            _gptq_group(layer, g, hess[g[0]], lplans, algo, prefix, mine, None, mine_ref)

    def shared(group, pinned):
        names = [f"{prefix}.{n}" for n in group]
        mods = [layer.get_submodule(n) for n in group]
        src = who[group[0]]
        got = reduce.share({k: mine[k] for k in names} if src == rank else None, src=src,
                           device=linear_weight(mods[0]).device)
        for n, m in zip(names, mods):
            if src == rank:
                if reference is not None:
                    reference[n] = mine_ref[n]
                pinned[n] = got[n]
            else:
                _write(m, got[n], pinned, n, reference)
    return shared


# ---------------------------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------------------------


def _layers_path(algos) -> Optional[str]:
    paths = {a.decoder_layers for a in algos if a.decoder_layers is not None}
    if len(paths) > 1:
        raise ValueError(f"the algorithm configs name different decoder layers: {sorted(paths)}")
    return next(iter(paths), None)



def layer_plans(model: nn.Module, plans: list, algos) -> tuple[str, nn.ModuleList, list[dict]]:
    """``(path, layers, by_layer)``: the decoder layers the algorithms act on and, per layer, ``{name relative to
    the layer: LayerPlan}`` of its quantized modules (``qcore.adapters.passes.streaming`` shares this)."""
    check_experts_algorithms(plans, algos)  # fused MoE experts: refused by name, before any work (issue 22)
    path, layers = find_decoder_layers(model, _layers_path(algos))
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
    (``_gptq_experts``); rotations act on the float model before it and are not concerned."""
    from qcore.algorithms.config import ROTATION_CONFIGS
    layer = [a.name for a in algos if not isinstance(a, ROTATION_CONFIGS + (GPTQConfig,))] + ([who] if who else [])
    experts = [p.name for p in plans if p.type == "Experts"]
    if layer and experts:
        raise ValueError(f"{', '.join(layer)}: the plan quantizes fused MoE experts ({len(experts)} module(s), e.g. "
                         f"{experts[0]!r}: tensors {experts[0]}.gate_up_proj / down_proj), which these algorithms "
                         f"do not handle yet (GPTQ does; docs/adapters.md); quantize without them (round-to-nearest or "
                         f"GPTQ), or keep the experts float: exclude=[..., 're:.*\\.experts']")


# ---------------------------------------------------------------------------------------------------------------
# the other layer algorithms: one binding module each in this package (data: algorithm name -> module). A binding
# module has ``check(layer, lplans, algo, prefix, *, family=None)`` (every check, before any weight changes) and
# ``run(layer, lplans, inputs, algo, prefix, pinned, *, floats=None, reduce=None, reference=None, family=None)``
# (rewrites the layer's float weights; puts the QTensors it decides into ``pinned``, as GPTQ does).
# ---------------------------------------------------------------------------------------------------------------

_SCALING = (AWQConfig, SmoothQuantConfig, AutoSmoothQuantConfig)
_BINDINGS = {
    "autoround": "autoround",
    "gptaq": "gptaq",
    "qronos": "qronos",
    "hqq": "hqq",
    "svdquant": "svdquant",
}
# the algorithms that read the float model's stream beside the quantized one (LayerRunner.run(float_inputs=))
FLOAT_STREAM = frozenset({"autoround", "gptaq", "qronos"})


def _binding(algo):
    import importlib
    mod = _BINDINGS.get(algo.name)
    if mod is None:
        raise ValueError(f"algorithm {algo.name!r} has no layer binding in qcore.adapters.passes "
                         f"(bound here: gptq, awq, smoothquant, autosmoothquant, {', '.join(_BINDINGS)})")
    return importlib.import_module(f"{__package__}.{mod}")


def check_layers(layers, by_layer: list[dict], algos, path: str, *, family=None) -> None:
    """Every check the algorithms make on the layers before any weight changes (shapes only: meta layers too);
    ``family``: the model's architecture record (``families.family_or_none(model)``) or None."""
    for a in algos:
        if not isinstance(a, (GPTQConfig,) + _SCALING):
            b = _binding(a)
            for i, layer in enumerate(layers):
                b.check(layer, by_layer[i], a, f"{path}.{i}", family=family)
    scalers = [a for a in algos if isinstance(a, _SCALING)]
    if scalers:
        from .scaling_bind import check_scaling
        for i, layer in enumerate(layers):
            for a in scalers:
                check_scaling(layer, by_layer[i], a, f"{path}.{i}", family=family)
    for a in algos:
        if isinstance(a, GPTQConfig):
            for i, layer in enumerate(layers):
                _gptq_targets(layer, by_layer[i], a, f"{path}.{i}")


def run_layer(layer: nn.Module, lplans: dict, inputs: LayerInputs, algos, prefix: str, pinned: dict, reduce=None,
              reference: Optional[dict] = None, *, family=None, floats=None) -> None:
    """The algorithms, in order, on one decoder layer over its kept ``inputs`` (the per-layer step of
    ``run_algorithms``, shared with ``qcore.adapters.passes.streaming``); GPTQ's QTensors go into ``pinned``, and (when
    ``reference`` is a dict) the float weights GPTQ started from into ``reference`` (CPU copies). ``floats``: the
    float model's ``FloatStream`` of this layer (``runner.LayerRunner.run(float_inputs=)``) for the algorithms in
    ``FLOAT_STREAM``."""
    for a in algos:
        if isinstance(a, GPTQConfig):
            _run_gptq(layer, lplans, inputs, a, prefix, pinned, reduce, reference)
        elif isinstance(a, _SCALING):
            from .scaling_bind import apply_scaling
            apply_scaling(layer, lplans, inputs, a, prefix, reduce=reduce, family=family)
        else:
            if a.name in FLOAT_STREAM and floats is None:
                raise ValueError(f"{a.name} needs the float model's stream of layer inputs (floats=)")
            _binding(a).run(layer, lplans, inputs, a, prefix, pinned, floats=floats, reduce=reduce,
                            reference=reference, family=family)


def check_algorithms(model: nn.Module, plans: list, algorithms) -> None:
    """The checks ``run_algorithms`` makes before changing anything (so a rotation that runs first can rely on
    the layer algorithms being able to run)."""
    algos = parse_algorithms(algorithms)
    if algos:
        path, layers, by_layer = layer_plans(model, plans, algos)
        check_layers(layers, by_layer, algos, path, family=family_or_none(model))


def run_algorithms(model: nn.Module, plans: list, algorithms, batches: Sequence, *, progress: bool = True,
                   reduce=None, reference: Optional[dict] = None, work=None) -> dict:
    """Apply ``algorithms`` (configs or dicts, in order) layer by layer; return ``{module name: QTensor}`` of
    the weights GPTQ quantized (fused experts: ``{proj: [QTensor or None per expert]}``). ``plans``:
    ``plan_model``'s output; ``batches``: a sequence of calibration batches. ``reduce``: for several processes
    (each holding its share of the batches), a ``qcore.adapters.distributed.Distributed``: called on each
    layer's ``HessianStats`` (the sum over ranks, before GPTQ; for fused experts each expert's two), its ``sum``
    / ``max`` / ``min`` reduce other statistics; every rank then computes the same weights.
    ``reference``: a dict to receive ``{module name: float weight GPTQ started from}`` (CPU copies; the report's
    reference weights, ``qcore.adapters.eval.layer_report``). ``work``: a
    ``qcore.adapters.passes.checkpointing.WorkDir`` (``quantize_model(..., work_dir=)``): progress saved after each
    layer, a saved run resumed."""
    algos = parse_algorithms(algorithms)
    if not algos:
        return {}
    from qcore.algorithms.config import ROTATION_CONFIGS
    if any(isinstance(a, ROTATION_CONFIGS) for a in algos):
        raise ValueError("run_algorithms: rotations (quarot, spinquant) act on the whole model; run them through "
                         "quantize_model or qcore.adapters.passes.rotation.apply_rotation")
    if not isinstance(batches, Sequence) or len(batches) == 0:
        raise ValueError("the algorithms need calibration data: pass a non-empty list of batches as data=")
    if reduce is not None:
        searching = [a.name for a in algos if isinstance(a, (AWQConfig, AutoSmoothQuantConfig))
                     or a.name == "autoround"]
        if searching:
            raise ValueError(f"{searching} search over calibration samples, which distributed calibration does not "
                             f"share between ranks yet; run them in one process (gptq and smoothquant run "
                             f"distributed)")
    path, layers, by_layer = layer_plans(model, plans, algos)
    family = family_or_none(model)
    check_layers(layers, by_layer, algos, path, family=family)

    runner = LayerRunner(model, path=path, layers=layers, progress=progress)
    was_training = model.training
    model.eval()
    pinned: dict = {}
    t0 = time.perf_counter()

    def step(i, layer, inputs, floats=None):
        run_layer(layer, by_layer[i], inputs, algos, f"{path}.{i}", pinned, reduce, reference, family=family,
                  floats=floats)

    two_streams = any(a.name in FLOAT_STREAM for a in algos)

    checkpoint = None
    if work is not None:
        from .checkpointing import algorithms_checkpoint
        checkpoint = algorithms_checkpoint(work, path, by_layer, pinned, reference)
    try:
        with torch.no_grad():
            inputs = runner.capture(batches)
            runner.run(step, inputs, desc="algorithms, layer by layer", rewrites=True,
                       what=f"{[a.name for a in algos]}", checkpoint=checkpoint,
                       float_inputs=inputs if two_streams else None)
    finally:
        model.train(was_training)
    _log.info("algorithms %s on %d layers in %.1f s", [a.name for a in algos], len(layers), time.perf_counter() - t0)
    return pinned

"""GPTQ bound to a decoder layer: the Linear (and transformers Conv1D) modules of the layer and its fused MoE
experts, grouped by shared input (true-sequential stages optional), each group's Hessian from forwards of the layer
alone, then ``qcore.algorithms.gptq`` on the group's stacked rows (``solve_group``, shared with GPTAQ and Qronos);
fused experts per expert slice (``_gptq_experts``); layer-parallel over ranks with ``Distributed(layer_parallel=
True)``. ``check`` and ``run`` are the binding ``qcore.adapters.passes.sequential`` calls for ``GPTQConfig``."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import qcore
from qcore.algorithms.config import GPTQConfig
from qcore.algorithms.gptq import gptq
from qcore.algorithms.gptq_core import HessianStats, HessianSum, check_gptq_spec

from ..modules import EXPERT_PROJS, gguf_cat, experts_weight_spec, is_fused_experts, linear_weight, linear_weight_spec
from .runner import LayerInputs, Stop, forward_layer
from .targets import input_stages, named_targets, scale_fn, write_pinned

_log = logging.getLogger("qcore.adapters")

__all__ = ["check", "run", "gptq_targets", "solve_group"]

FLOAT_STREAM = False  # reads the quantized stream only


def gptq_targets(layer: nn.Module, lplans: dict, algo: GPTQConfig, prefix: str) -> list[str]:
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
        if spec.gguf and type(algo) is not GPTQConfig:
            raise ValueError(f"{algo.name}: {prefix}.{n}: GGUF weight specs ({spec.gguf}) are quantized by llama.cpp's "
                             f"search inside GPTQ only (qcore.algorithms.gptq_gguf); use gptq, or round-to-nearest")
        try:
            check_gptq_spec(spec, tuple(linear_weight(m).shape))
        except ValueError as e:
            raise ValueError(f"{algo.name}: {prefix}.{n}: {e}") from None
        out.append(n)
    return out


def _collect_hessians(layer, groups: list[list[str]], inputs: LayerInputs, stop_after: Optional[str],
                      experts: frozenset = frozenset()):
    """``(stats, calls)``: the Hessian statistics of each Linear group's head, and for each fused experts head
    its calls ``[(hidden states [T, H], top-k index [T, k'])]`` (one per batch)."""
    sums: dict[str, HessianSum] = {}  # running sums updated in place (update_hessian's bits, no copy per batch)
    calls: dict[str, list] = {}
    heads = [g[0] for g in groups if g[0] not in experts]

    def hook(name):
        def f(mod, args):
            x = args[0].detach()
            if name not in sums:
                sums[name] = HessianSum(x.shape[-1], like=x)
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
    st = HessianSum(n, like=like)
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
    fns = {p: scale_fn(plan, specs[p]) for p in EXPERT_PROJS}
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
    spec, scale_fn) -> GPTQResult`` (GPTQ, GPTAQ), their QTensors written (``targets.write_pinned``). Rows of weights sharing
    an input and a per-row / per-group spec are independent under one set of statistics: one run over the
    stacked rows equals the runs one by one, and is what runs when the specs allow it."""
    mods = [layer.get_submodule(n) for n in names]
    specs = [linear_weight_spec(m, lplans[n], f"{prefix}.{n}") for m, n in zip(mods, names)]
    fns = [scale_fn(lplans[n], s) for n, s in zip(names, specs)]
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
            write_pinned(m, part, pinned, f"{prefix}.{n}", reference)
            rows += k
        return
    for n, m, spec, fn in zip(names, mods, specs, fns):
        imp = m.__dict__.get("_gguf_importance") if spec.gguf else None  # quantize_model(..., imatrix=)
        r = solve(linear_weight(m).detach().float().contiguous(), spec, fn,
                  **({} if imp is None else {"imatrix": imp}))
        write_pinned(m, r.qtensor, pinned, f"{prefix}.{n}", reference)


def _run_gptq(layer, lplans, inputs: LayerInputs, algo: GPTQConfig, prefix: str, pinned: dict, reduce=None,
              reference: Optional[dict] = None) -> None:
    targets = gptq_targets(layer, lplans, algo, prefix)
    if not targets:
        return
    experts = frozenset(n for n in targets if is_fused_experts(layer.get_submodule(n)))
    stages = input_stages(layer, targets, inputs, algo.true_sequential, experts)
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
                write_pinned(m, got[n], pinned, n, reference)
    return shared


def check(layer: nn.Module, lplans: dict, algo, prefix: str, *, family=None) -> None:
    """Every check GPTQ makes on decoder layer ``prefix`` before any weight changes (its targets' specs)."""
    gptq_targets(layer, lplans, algo, prefix)


def run(layer: nn.Module, lplans: dict, inputs, algo, prefix: str, pinned: dict, *, floats=None, reduce=None,
        reference=None, family=None) -> None:
    """GPTQ on decoder layer ``prefix`` over its kept ``inputs``; its QTensors into ``pinned``."""
    _run_gptq(layer, lplans, inputs, algo, prefix, pinned, reduce, reference)

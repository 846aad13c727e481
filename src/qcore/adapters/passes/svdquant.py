"""SVDQuant bound to one decoder layer (``qcore.algorithms.svdquant``; called by ``qcore.adapters.passes.sequential``).

For each decoder layer:

1. the targets: the layer's ``nn.Linear`` modules the config quantizes (weight spec); they are grouped by the
   input they read. A group of the layer's scaling map (``qcore.adapters.passes.scaling.scaling_groups``: the
   norms before q/k/v and gate/up, ``up_proj`` before ``down_proj``, ``v_proj`` before ``o_proj`` without
   grouped-query attention) whose Linears are all targets and whose producer can take the fold gets ONE smoothing
   scale, folded into the producer (``fold_scales``, exact in float arithmetic); every other target is a group of
   its own whose scale stays in the module (``QuantLinear``'s ``input_smoothing`` buffer);
2. one forward of the layer over its kept inputs records, per group input, the per-channel max |x| over every
   token, an evenly spaced sample of at most ``_SAMPLE_ROWS`` token rows of the first ``search_samples`` batches
   (``search_alpha``), and (``use_gptq``) the Hessian ``sum x^T x``, all of the float layer before any change;
3. per group: ``s = smoothquant_scales(max|x|, max|W|, alpha)`` with ``alpha`` fixed or searched
   (``search_alpha``: the candidate minimising the group's output error with residuals rounded to nearest and the
   input fake-quantized by the layer's input spec, when it has one); every scale is computed before any fold;
4. the folds; then per target Linear: the rank-``rank`` branch of its smoothed weight and the residual quantized
   by round-to-nearest or GPTQ with the smoothed inputs' Hessian ``diag(1/s) H diag(1/s)``.

Each target's residual QTensor goes into ``pinned`` (``quantize_model`` commits it as the module's weight) and the
branch onto the float Linear as buffers (``modules.add_low_rank_branch``; the wrapper built from it carries them);
the float weight becomes ``(Q(R) + L2 L1) diag(1/s_module)``, the function the layer computes without activation
quantization, so that the next layer's inputs come from this layer as quantized.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

import torch
from torch import nn

from qcore.algorithms.gptq_core import HessianStats, HessianSum, check_gptq_spec
from qcore.algorithms.smoothquant import smoothquant_scales, weight_absmax
from qcore.algorithms.svdquant import DEFAULT_ALPHAS, search_alpha, svdquant

from ..modules import add_low_rank_branch, linear_weight_spec
from .runner import forward_layer
from .targets import scale_fn
from .scaling import NoScalingMap, ScalingGroup, check_fold, fold_scales, scaling_groups
from .scaling_bind import input_spec_of

__all__ = ["check", "run"]

FLOAT_STREAM = False  # reads the quantized stream only

_log = logging.getLogger("qcore.adapters")
_SAMPLE_ROWS = 512  # token rows of the alpha search's sample, per group input


def _targets(layer: nn.Module, lplans: dict, prefix: str, algo) -> list[str]:
    out = []
    for n, p in lplans.items():
        if p.config.weight is None:
            continue
        m = layer.get_submodule(n)
        if not isinstance(m, nn.Linear):
            raise ValueError(f"svdquant: {prefix}.{n} is a {type(m).__name__}; SVDQuant's branch is carried by "
                             f"nn.Linear modules only (exclude it, or quantize without svdquant)")
        spec = linear_weight_spec(m, p, f"{prefix}.{n}")
        if algo.use_gptq:
            try:
                check_gptq_spec(spec, tuple(m.weight.shape))
            except ValueError as e:
                raise ValueError(f"svdquant (use_gptq): {prefix}.{n}: {e}") from None
        out.append(n)
    return out


def _plan_groups(layer: nn.Module, targets: list[str], family) -> list["_Group"]:
    """``_Group``s covering every target once: the scaling map's groups whose Linears are all targets
    and whose fold is possible (``fold`` set), then each remaining target alone (``fold`` None: the scale is kept in the module).
    A group's ``inp`` is its first Linear when the map gives none."""
    try:
        groups = scaling_groups(layer, family=family)
    except NoScalingMap:
        groups = []
    out, covered = [], set()
    tset = set(targets)
    for g in groups:
        if not set(g.layers) <= tset or covered & set(g.layers):
            continue
        try:
            check_fold(layer, g, int(layer.get_submodule(g.layers[0]).in_features))
        except (ValueError, TypeError):
            continue
        out.append(_Group(tuple(g.layers), g.inp or g.layers[0], g))
        covered |= set(g.layers)
    for n in targets:
        if n not in covered:
            out.append(_Group((n,), n, None))
    return out


class _Group(NamedTuple):
    """Target Linears reading one input (``inp``: the module whose input is recorded) and the scaling group their
    smoothing scale is folded through, or None (the scale stays in the module)."""

    layers: tuple
    inp: str
    fold: Optional[ScalingGroup]


def check(layer: nn.Module, lplans: dict, algo, prefix: str, *, family=None) -> None:
    """Every check before any weight changes: the targets are nn.Linear, and (``use_gptq``) GPTQ takes their
    specs."""
    _targets(layer, lplans, prefix, algo)


class _Recorder:
    def __init__(self, stride: int, batches: int, gptq: bool):
        self.stride, self.batches, self.gptq = stride, batches, gptq
        self.absmax = None
        self.rows: list = []
        self.calls = 0
        self.seen = 0
        self.hess: Optional[HessianSum] = None

    def __call__(self, mod, args):
        x = args[0].detach()
        x = x.reshape(-1, x.shape[-1])
        xf = x.float()
        a = xf.abs().amax(0)
        self.absmax = a if self.absmax is None else torch.maximum(self.absmax, a)
        if self.calls < self.batches:
            start = (-self.seen) % self.stride
            self.rows.append(xf[start::self.stride].clone())
            self.seen += x.shape[0]
        self.calls += 1
        if self.gptq:
            if self.hess is None:
                self.hess = HessianSum(x.shape[-1], like=x)
            self.hess.add(x)


def _tokens(inputs, n_batches: int) -> int:
    total = 0
    for args, kwargs in list(zip(inputs.args, inputs.kwargs))[:n_batches]:
        h = args[0] if args else kwargs["hidden_states"]
        total += h.numel() // h.shape[-1]
    return total


def _smoothed_hessian(h: HessianStats, s: torch.Tensor) -> HessianStats:
    inv = 1.0 / s.to(h.sum.device, torch.float64)
    return HessianStats(h.sum * inv[:, None] * inv[None, :], h.count)


def run(layer: nn.Module, lplans: dict, inputs, algo, prefix: str, pinned: dict, *, floats=None, reduce=None,
        reference: Optional[dict] = None, family=None) -> None:
    """SVDQuant on one decoder layer in place (module docstring)."""
    if reduce is not None:
        raise ValueError("svdquant does not run with distributed calibration yet; run it in one process")
    targets = _targets(layer, lplans, prefix, algo)
    if not targets:
        return
    plan = _plan_groups(layer, targets, family)
    n_batches = min(algo.search_samples, len(inputs.args))
    stride = max(1, -(-_tokens(inputs, n_batches) // _SAMPLE_ROWS))
    recs = {}
    hooks = []
    for g in plan:
        if g.inp not in recs:
            recs[g.inp] = _Recorder(stride, n_batches if algo.search_alpha else 0, algo.use_gptq)
            hooks.append(layer.get_submodule(g.inp).register_forward_pre_hook(recs[g.inp]))
    try:
        with torch.no_grad():
            forward_layer(layer, inputs, keep=False)
    finally:
        for h in hooks:
            h.remove()

    alphas = algo.alpha_candidates or DEFAULT_ALPHAS
    scales = []
    for g in plan:  # every scale from the float layer, before any fold
        rec = recs[g.inp]
        mods = [layer.get_submodule(n) for n in g.layers]
        ws = [m.weight.detach().float() for m in mods]
        if algo.search_alpha:
            specs = [linear_weight_spec(m, lplans[n], f"{prefix}.{n}") for n, m in zip(g.layers, mods)]
            p0 = lplans[g.layers[0]]
            ispec = input_spec_of(p0) if p0.config.input is not None else None
            x = torch.cat(rec.rows, 0)
            r = search_alpha(x, ws, specs, rec.absmax, rank=algo.rank, alphas=alphas, input_spec=ispec, exact=False)
            s = r.scales
            _log.debug("svdquant %s.%s: alpha %.2f", prefix, g.inp, r.alpha)
        else:
            s = smoothquant_scales(rec.absmax, weight_absmax(ws), alpha=algo.alpha)
        scales.append(s)
    for g, s in zip(plan, scales):
        if g.fold is not None:
            fold_scales(layer, g.fold, s, family=family)
    for g, s in zip(plan, scales):
        folded = g.fold is not None
        rec = recs[g.inp]
        h = rec.hess.stats() if rec.hess is not None else None
        for n in g.layers:
            m = layer.get_submodule(n)
            full = f"{prefix}.{n}"
            spec = linear_weight_spec(m, lplans[n], full)
            w = m.weight.detach().float()
            own = torch.ones_like(s) if folded else s  # folded: the weight is smoothed already
            hess = None if h is None else (_smoothed_hessian(h, s) if folded else h)
            res = svdquant(w, own, spec, rank=algo.rank, hessian=hess, block_size=algo.block_size, damp=algo.damp,
                           act_order=algo.act_order, scale_fn=scale_fn(lplans[n], spec))  # the weight observer
            if reference is not None:  # the float residual the quantization started from
                resid = w.double() * own.double()[None, :] - res.l2.double() @ res.l1.double()
                reference[full] = resid.float().cpu()
            with torch.no_grad():
                eff = res.residual_weight.double() + res.l2.double() @ res.l1.double()
                if not folded:
                    eff = eff / s.double()[None, :]
                m.weight.copy_(eff.to(m.weight.dtype))
            add_low_rank_branch(m, res.l1, res.l2, None if folded else s, where=full)
            pinned[full] = res.residual

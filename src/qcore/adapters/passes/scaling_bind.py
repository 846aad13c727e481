"""AWQ, SmoothQuant and AutoSmoothQuant bound to one decoder layer (called by ``qcore.adapters.passes.sequential``).

For each layer: the scaling groups (``qcore.adapters.passes.scaling.scaling_groups``: detected, or Quark's
``scaling_layers``) are resolved; one forward of the layer over its kept inputs records, for each group's input,
the per-channel max |x| over every token and an evenly spaced sample of ``n_tokens`` token rows (AWQ,
AutoSmoothQuant; with distributed calibration, SmoothQuant's max |x| is the max over ranks, and the searching
algorithms are refused); then per group, in order:

- SmoothQuant: ``s = smoothquant_scales(max|x|, max|W|, alpha, clamp_min)``;
- AutoSmoothQuant: ``s`` of the alpha minimising the quantized output error on the sample (the layers' weight
  specs and the input's activation spec, applied dynamically), identity included;
- AWQ: ``s`` from ``awq_search`` over the group's weight specs, then (``clip``) ``awq_clip`` of each Linear on the
  rescaled sample, except the query and key projections (their errors are amplified by the attention scores;
  AutoAWQ and Quark skip them too);

and ``s`` is folded into the preceding op (``fold_scales``: exact in float arithmetic). All groups' statistics
come from the float layer before any fold, as AutoAWQ does: a fold leaves the float function unchanged, so the
statistics of later groups only miss the clipping of earlier ones.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from qcore.algorithms.awq import awq_clip, awq_search
from qcore.algorithms.config import AutoSmoothQuantConfig, AWQConfig, SmoothQuantConfig
from qcore.algorithms.smoothquant import auto_smoothquant, smoothquant_scales, weight_absmax

from ..modules import activation_granularity, with_granularity, linear_weight_spec
from .runner import forward_layer
from .scaling import NoScalingMap, ScalingGroup, check_fold, fold_scales, linear_view, scaling_groups

__all__ = ["check_scaling", "apply_scaling"]

_NO_CLIP = ("q_proj", "k_proj", "query", "key", "q", "k", "qkv_proj", "Wqkv", "c_attn")


def _entries(algo) -> Optional[list]:
    if not algo.scaling_layers:
        return None
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in e} for e in algo.scaling_layers]


def _groups(layer: nn.Module, algo, prefix: str, family=None) -> list[ScalingGroup]:
    try:
        return scaling_groups(layer, quark_entries=_entries(algo), family=family)
    except NoScalingMap as e:  # the algorithm's own setting, in Python and on the command line
        raise ValueError(f"{algo.name}: decoder layer {prefix!r}: {e.what}; give the algorithm Quark's "
                         f"scaling_layers (dicts with prev_op, layers, inp, module2inspect): in Python "
                         f"{type(algo).__name__}(scaling_layers=[...]), on the command line --algo "
                         f"'{{\"name\": \"{algo.name}\", \"scaling_layers\": [...]}}'") from None
    except (ValueError, TypeError) as e:
        raise type(e)(f"{algo.name}: decoder layer {prefix!r}: {e}") from None


def input_spec_of(plan):
    """The input activation spec a module's plan gives, on the activation axes (what the scale searches quantize
    the inputs with)."""
    tc = plan.config.input
    return with_granularity(tc.spec, activation_granularity(tc.spec.granularity, False))


def check_scaling(layer: nn.Module, lplans: dict, algo, prefix: str, *, family=None) -> None:
    """Everything ``apply_scaling`` needs from this layer, checked before any weight changes (``family``: the
    model's architecture record, ``families.family_or_none``)."""
    groups = _groups(layer, algo, prefix, family)
    for g in groups:
        w = linear_view(layer.get_submodule(g.layers[0]))  # [out, in]; None: check_fold says why
        n = 0 if w is None else int(w.shape[1])
        try:
            check_fold(layer, g, n)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{algo.name}: decoder layer {prefix!r}: {e}") from None
        for name in g.layers:
            plan = lplans.get(name)
            if isinstance(algo, AWQConfig) and (plan is None or plan.config.weight is None):
                raise ValueError(f"awq: {prefix}.{name} gets no weight quantization from the config; AWQ scales the "
                                 f"weights of quantized Linears (exclude the whole group, or quantize it)")
            if isinstance(algo, AutoSmoothQuantConfig) and (plan is None or plan.config.weight is None
                                                            or plan.config.input is None):
                raise ValueError(f"autosmoothquant: {prefix}.{name} needs weight and input quantization (its search "
                                 f"measures the quantized matmul); use smoothquant with a fixed alpha instead")


class _Recorder:
    """Per-channel max |x| and an evenly spaced row sample of one module's input over the layer's batches."""

    def __init__(self, stride: int, want_sample: bool):
        self.stride, self.want = stride, want_sample
        self.absmax = None
        self.rows: list = []
        self.seen = 0

    def __call__(self, mod, args):
        x = args[0].detach()
        x = x.reshape(-1, x.shape[-1]).float()
        a = x.abs().amax(0)
        self.absmax = a if self.absmax is None else torch.maximum(self.absmax, a)
        if self.want:
            start = (-self.seen) % self.stride
            self.rows.append(x[start::self.stride].clone())
        self.seen += x.shape[0]

    def sample(self):
        return torch.cat(self.rows, 0) if self.rows else None


def _tokens(inputs) -> int:
    total = 0
    for args, kwargs in zip(inputs.args, inputs.kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        total += h.numel() // h.shape[-1]
    return total


def apply_scaling(layer: nn.Module, lplans: dict, inputs, algo, prefix: str, *, reduce=None, family=None) -> None:
    """Run ``algo`` (SmoothQuant, AutoSmoothQuant or AWQ config) on one decoder layer in place."""
    if reduce is not None and not isinstance(algo, SmoothQuantConfig):  # run_algorithms refuses these up front
        raise ValueError(f"{algo.name} does not run with distributed calibration; run it in one process")
    groups = _groups(layer, algo, prefix, family)
    if not groups:
        return
    want = not isinstance(algo, SmoothQuantConfig)
    n_tok = getattr(algo, "n_tokens", 1)
    stride = max(1, -(-_tokens(inputs) // n_tok)) if want else 1
    recs: dict[str, _Recorder] = {}
    hooks = []
    for g in groups:
        inp = g.inp or g.layers[0]
        if inp not in recs:
            recs[inp] = _Recorder(stride, want)
            hooks.append(layer.get_submodule(inp).register_forward_pre_hook(recs[inp]))
    try:
        forward_layer(layer, inputs, keep=False)
    finally:
        for h in hooks:
            h.remove()

    if reduce is not None:  # SmoothQuant: max |x| over every rank's tokens
        for rec in recs.values():
            rec.absmax = reduce.max(rec.absmax)
    for g in groups:
        rec = recs[g.inp or g.layers[0]]
        mods = [layer.get_submodule(n) for n in g.layers]
        ws = [linear_view(m).detach().float() for m in mods]  # [out, in] (a Conv1D's transposed)
        if isinstance(algo, SmoothQuantConfig):  # needs no weight spec: the layers may be left unquantized
            s = smoothquant_scales(rec.absmax, weight_absmax(ws), alpha=algo.alpha, clamp_min=algo.clamp_min)
        else:
            specs = [linear_weight_spec(layer.get_submodule(n), lplans[n], n) for n in g.layers]
            x = rec.sample()
            if isinstance(algo, AutoSmoothQuantConfig):
                s = auto_smoothquant(x, ws, weight_spec=specs, input_spec=input_spec_of(lplans[g.layers[0]]),
                                     loss=algo.loss, act_absmax=rec.absmax).scales
            else:
                s = awq_search(x, ws, specs, grid=algo.grid).scales
        fold_scales(layer, g, s, family=family)
        if isinstance(algo, AWQConfig) and algo.clip:
            xs = x / s.to(x.dtype)
            for n, m, spec in zip(g.layers, mods, specs):
                if n.rsplit(".", 1)[-1] in _NO_CLIP:
                    continue
                try:
                    clipped = awq_clip(xs, linear_view(m).detach().float(), spec, grid=algo.grid)
                except ValueError:
                    continue  # specs whose scales couple rows (per-tensor, 2-D blocks): no clipping search
                with torch.no_grad():
                    w = linear_view(m)  # a Conv1D's transposed view: the copy reaches its [in, out] parameter
                    w.copy_(clipped.to(w.dtype))


FLOAT_STREAM = False  # reads the quantized stream only


def check(layer: nn.Module, lplans: dict, algo, prefix: str, *, family=None) -> None:
    """The binding ``qcore.adapters.passes.sequential`` calls for AWQ, SmoothQuant and AutoSmoothQuant configs."""
    check_scaling(layer, lplans, algo, prefix, family=family)


def run(layer: nn.Module, lplans: dict, inputs, algo, prefix: str, pinned: dict, *, floats=None, reduce=None,
        reference=None, family=None) -> None:
    apply_scaling(layer, lplans, inputs, algo, prefix, reduce=reduce, family=family)

"""Paired calibration statistics of a decoder layer's Linears (GPTAQ, Qronos): for each module, the quantized
model's inputs ``X~`` and the float model's inputs ``X`` of that module on the same tokens
(``qcore.algorithms.paired.PairedStats``: ``sum X~^T X~``, ``sum (X - X~)^T X~``, rows).

``collect_paired(layer, groups, inputs, floats, float_layer=...)``:

- ``X~``: forwards of ``layer`` *as it is now* (earlier stages of this layer may already be rewritten, as GPTQ's
  ``true_sequential`` does) over the quantized stream ``inputs`` (the layers before already quantized);
- ``X``: forwards of ``float_layer``, a float copy of the layer taken before any of its modules was rewritten
  (``float_copy(layer)``; the float model's internal activations, e.g. ``o_proj``'s or ``down_proj``'s input,
  need the float weights of the modules before them), over the float model's inputs of the layer
  (``floats.inputs``: ``runner.FloatStream``, what ``LayerRunner.run(float_inputs=)`` gives).

Batch ``b`` of both streams is the same calibration batch; the ``k``-th call of a module in batch ``b`` of one
stream is paired with its ``k``-th call in the other, token row by token row (the shapes must agree: a module
that sees different tokens in the two streams, e.g. an expert whose routing changed, is refused with a
ValueError naming it). One batch of each stream's module inputs is held at a time.

``reduce_paired(stats, reduce)``: the sums over ranks with the GPTQ reducer (``reduce(HessianStats)``, e.g.
``qcore.adapters.distributed.Distributed``), both parts and the count.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from qcore.algorithms.gptq_core import HessianStats
from qcore.algorithms.paired import PairedStats, PairedSum

from .runner import FloatStream, LayerInputs, Stop, forward_layer

__all__ = ["collect_paired", "float_copy", "reduce_paired"]


def float_copy(layer: nn.Module) -> nn.Module:
    """A copy of ``layer`` (its float weights as they are now), for the float stream's forwards of a layer whose
    modules are about to be rewritten; take it before the first rewrite (one decoder layer's weights)."""
    return copy.deepcopy(layer)


def _capture(layer: nn.Module, heads: list[str], inputs: LayerInputs, stop_after: Optional[str]) -> dict:
    """``{head: [input of each call, detached]}`` of one forward of ``layer`` over ``inputs`` (one batch)."""
    got: dict = {h: [] for h in heads}

    def hook(name):
        def f(mod, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            got[name].append(x.detach())
            if name == stop_after:
                raise Stop
        return f

    hs = [layer.get_submodule(h).register_forward_pre_hook(hook(h), with_kwargs=True) for h in heads]
    try:
        forward_layer(layer, inputs, keep=False)
    finally:
        for h in hs:
            h.remove()
    return got


def collect_paired(layer: nn.Module, groups: list[list[str]], inputs: LayerInputs, floats: FloatStream, *,
                   float_layer: nn.Module, stop_after: Optional[str] = None) -> dict[str, PairedStats]:
    """``{head: PairedStats}`` for the head (first name) of each group of ``groups`` (names relative to the
    layer; a group's modules share one input, ``passes.targets.input_stages``): ``X~`` from ``layer`` over ``inputs``,
    ``X`` from ``float_layer`` over ``floats.inputs`` (module docstring). ``stop_after``: a head after whose
    input the forwards stop (the last head of a stage)."""
    if not isinstance(floats, FloatStream):
        raise TypeError(f"floats must be the runner's FloatStream (the float model's inputs of this layer), got "
                        f"{type(floats).__name__}")
    if not isinstance(inputs, LayerInputs):
        raise TypeError(f"inputs must be LayerInputs, got {type(inputs).__name__}")
    if len(floats.inputs) != len(inputs):
        raise ValueError(f"the float stream has {len(floats.inputs)} batches and the quantized stream "
                         f"{len(inputs)}; they must be the same calibration batches")
    heads = [g[0] for g in groups]
    for h in heads:
        layer.get_submodule(h), float_layer.get_submodule(h)  # AttributeError names a missing module early
    sums: dict[str, PairedSum] = {}
    with torch.no_grad():
        for b in range(len(inputs)):
            xq = _capture(layer, heads, LayerInputs(inputs.args[b:b + 1], inputs.kwargs[b:b + 1]), stop_after)
            x = _capture(float_layer, heads, LayerInputs(floats.inputs.args[b:b + 1], floats.inputs.kwargs[b:b + 1]),
                         stop_after)
            for h in heads:
                if len(x[h]) != len(xq[h]):
                    raise ValueError(f"{h}: called {len(x[h])} times by the float layer and {len(xq[h])} times by "
                                     f"the quantized one in batch {b}; paired statistics need the same calls")
                for a, q in zip(x[h], xq[h]):
                    if a.shape != q.shape:
                        raise ValueError(f"{h}: the float and quantized streams give inputs of shapes "
                                         f"{tuple(a.shape)} and {tuple(q.shape)} in batch {b} (different tokens, "
                                         f"e.g. a changed routing); paired statistics need the same tokens")
                    if h not in sums:
                        sums[h] = PairedSum(q.shape[-1], like=q)
                    sums[h].add(a, q)
            del x, xq
    return {h: s.stats() for h, s in sums.items()}


def reduce_paired(stats: PairedStats, reduce) -> PairedStats:
    """``stats`` summed over the ranks by the GPTQ reducer ``reduce`` (a callable on ``HessianStats``); None:
    unchanged."""
    if reduce is None:
        return stats
    h = reduce(HessianStats(stats.hessian, stats.count))
    d = reduce(HessianStats(stats.delta, stats.count))
    return PairedStats(h.sum, d.sum, h.count)

"""GPTAQ on a decoder layer (``qcore.algorithms.gptaq``; ``sequential.LAYER_BINDINGS[GPTAQConfig]``).

The layer's targets, stages and groups are GPTQ's (``passes.gptq.gptq_targets``, ``passes.targets.input_stages``; ``modules``,
``true_sequential`` as ``GPTQConfig``'s): for each stage, the paired statistics of each group's shared input
(``paired.collect_paired``: ``X~`` from the layer as it is now over the quantized stream, ``X`` from a float
copy of the layer taken before its first rewrite over the float model's stream), then GPTAQ on each module;
rows of modules sharing an input and a concatenable spec run as one stacked weight (as GPTQ's
``_gptq_group``). The QTensors go into ``pinned`` (exported as they are); the dequantized weights replace the
float ones (``targets.write_pinned``).

Fused MoE experts are not handled (``targets.check_experts_algorithms`` refuses them by name before any work).
Distributed calibration: the paired sums are reduced with the GPTQ reducer (``paired.reduce_paired``); the
layer-parallel split of GPTQ is not used (every rank computes every module).
"""

from __future__ import annotations

import torch
from torch import nn

from qcore.algorithms.gptaq import gptaq
from qcore.algorithms.paired import PairedStats

from ..modules import is_fused_experts
from .paired import collect_paired, float_copy, reduce_paired
from .gptq import gptq_targets, solve_group
from .targets import input_stages

__all__ = ["check", "run"]

FLOAT_STREAM = True  # reads the float model's stream beside the quantized one (LayerRunner.run(float_inputs=))


def check(layer: nn.Module, lplans: dict, algo, prefix: str, *, family=None) -> None:
    """Every check before any weight changes: GPTQ's (targets, specs) and no fused experts."""
    targets = gptq_targets(layer, lplans, algo, prefix)
    fused = [n for n in targets if is_fused_experts(layer.get_submodule(n))]
    if fused:
        raise ValueError(f"gptaq: {prefix}.{fused[0]} are fused MoE experts, which GPTAQ does not handle (GPTQ "
                         f"does); quantize them with gptq, or keep them float")


def run(layer: nn.Module, lplans: dict, inputs, algo, prefix: str, pinned: dict, *, floats=None, reduce=None,
        reference=None, family=None) -> None:
    """GPTAQ on the layer's quantized Linears (module docstring)."""
    if floats is None:
        raise ValueError("gptaq needs the float model's stream of this layer's inputs (floats=)")
    check(layer, lplans, algo, prefix, family=family)
    targets = gptq_targets(layer, lplans, algo, prefix)
    if not targets:
        return
    stages = input_stages(layer, targets, inputs, algo.true_sequential)
    fl = float_copy(layer)  # the float weights, for the float stream's internal activations
    try:
        for stage in stages:
            with torch.no_grad():
                stats = collect_paired(layer, stage, inputs, floats, float_layer=fl, stop_after=stage[-1][0])
                for group in stage:
                    _group(layer, group, reduce_paired(stats.pop(group[0]), reduce), lplans, algo, prefix, pinned,
                           reference)
    finally:
        del fl


def _group(layer, names: list[str], st: PairedStats, lplans: dict, algo, prefix: str, pinned: dict,
           reference) -> None:
    kw = dict(alpha=algo.alpha, block_size=algo.block_size, damp=algo.damp, act_order=algo.act_order,
              static_groups=algo.static_groups)
    solve_group(layer, names, lplans, prefix, pinned, reference,
                lambda w, spec, fn: gptaq(w, st, spec, scale_fn=fn, **kw))

"""Qronos bound to a decoder layer (``sequential.LAYER_BINDINGS[QronosConfig]``): the Linear (and Conv1D) modules GPTQ
would take, grouped and staged as GPTQ groups them (``passes.gptq.gptq_targets`` / ``passes.targets.input_stages``), each quantized
by ``qcore.algorithms.qronos.qronos`` from the paired statistics of its input (``paired.collect_paired``:
``X~`` from this layer as it is now over the quantized stream, ``X`` from a float copy of the layer, taken before
any rewrite, over the float model's stream ``floats``).

With ``true_sequential`` (the default of ``QronosConfig``) each input group is a stage: the attention output
projection's ``X~`` already carries the quantized q/k/v projections, the MLP's the quantized attention, and so on.
Fused MoE experts are refused before any work (``targets.check_experts_algorithms`` by name, and here).
The QTensors go into ``pinned`` exactly as GPTQ's (``targets.write_pinned``), so the export writes these codes.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from qcore.algorithms.qronos import qronos

from ..modules import is_fused_experts, linear_weight, linear_weight_spec
from .paired import collect_paired, float_copy, reduce_paired
from .gptq import gptq_targets
from .targets import input_stages, scale_fn, write_pinned

__all__ = ["check", "run"]

FLOAT_STREAM = True  # reads the float model's stream beside the quantized one (LayerRunner.run(float_inputs=))


def _targets(layer: nn.Module, lplans: dict, algo, prefix: str) -> list[str]:
    names = gptq_targets(layer, lplans, algo, prefix)  # its errors name the algorithm (algo.name)
    experts = [n for n in names if is_fused_experts(layer.get_submodule(n))]
    if experts:
        raise ValueError(f"qronos: {prefix}.{experts[0]} are fused MoE experts, which Qronos does not handle yet "
                         f"(GPTQ does); quantize them without it or exclude them")
    return names


def check(layer: nn.Module, lplans: dict, algo, prefix: str, *, family=None) -> None:
    """Every check before any weight changes: the modules named exist and get weight specs GPTQ (hence Qronos)
    can take; no fused experts."""
    _targets(layer, lplans, algo, prefix)


def run(layer: nn.Module, lplans: dict, inputs, algo, prefix: str, pinned: dict, *, floats=None, reduce=None,
        reference: Optional[dict] = None, family=None) -> None:
    """Quantize the layer's target modules with Qronos (module docstring); ``floats``: the runner's
    ``FloatStream`` of this layer (required)."""
    if floats is None:
        raise ValueError("qronos needs the float model's stream of this layer's inputs (floats=)")
    targets = _targets(layer, lplans, algo, prefix)
    if not targets:
        return
    stages = input_stages(layer, targets, inputs, algo.true_sequential)
    float_layer = float_copy(layer)  # before any rewrite of this layer: the float model's internal activations
    kw = dict(block_size=algo.block_size, damp=algo.damp, damp_scale=algo.damp_scale, act_order=algo.act_order,
              static_groups=algo.static_groups)
    try:
        for stage in stages:
            stats = collect_paired(layer, stage, inputs, floats, float_layer=float_layer, stop_after=stage[-1][0])
            for group in stage:
                st = reduce_paired(stats[group[0]], reduce)
                for n in group:
                    m = layer.get_submodule(n)
                    spec = linear_weight_spec(m, lplans[n], f"{prefix}.{n}")
                    r = qronos(linear_weight(m).detach().float().contiguous(), st, spec,
                               scale_fn=scale_fn(lplans[n], spec), **kw)
                    write_pinned(m, r.qtensor, pinned, f"{prefix}.{n}", reference)
            del stats
    finally:
        del float_layer

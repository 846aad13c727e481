"""AutoRound (SignRound) bound to a decoder layer: ``qcore.algorithms.autoround.signround`` on the layer's quantized
Linear weights, the layer run by ``torch.func.functional_call`` with the fake-quantized weights substituted.

Inputs: the quantized stream's kept calls of the layer (``inputs``: the layers before already quantized, auto-round's
``enable_quanted_input``); targets: the float layer's outputs on the float stream (``floats.outputs``). Each
calibration batch is one sample of auto-round's minibatches (``batch_size`` of them per step, one backward each).
The learnt weights are written into the layer and their QTensors into ``pinned`` (export writes those codes).

Scales start from the weights' min/max (auto-round's starting point; the layer's weight observer is not used: the
learnt range factors replace its clipping search). Refused before any work: fused MoE experts
(``targets.check_experts_algorithms``), non-integer / power-of-two / two-level specs, groups along other axes,
modules the config names that are not quantized Linears.
"""

from __future__ import annotations

import logging
import time
import zlib

import torch
from torch import nn

from qcore.algorithms.autoround import check_autoround_spec, signround

from ..modules import IN_OUT, is_fused_experts, linear_weight, linear_weight_spec, weight_layout
from .runner import hidden_of
from .targets import named_targets, write_pinned

_log = logging.getLogger("qcore.adapters")

__all__ = ["check", "run"]

FLOAT_STREAM = True  # reads the float model's stream beside the quantized one (LayerRunner.run(float_inputs=))


def _targets(layer: nn.Module, lplans: dict, algo, prefix: str) -> list:
    out = []
    for n, m, plan in named_targets(layer, lplans, algo, prefix):
        if is_fused_experts(m):
            raise ValueError(f"autoround: {prefix}.{n} holds fused MoE experts, which autoround does not handle "
                             f"(GPTQ does); exclude them or use gptq")
        if linear_weight(m) is None:
            if algo.modules:
                raise ValueError(f"autoround modules: {prefix}.{n} is a {type(m).__name__}, not a Linear")
            continue  # other module types: round-to-nearest, as under GPTQ
        spec = linear_weight_spec(m, plan, f"{prefix}.{n}")
        try:
            check_autoround_spec(spec, tuple(linear_weight(m).shape))
        except ValueError as e:
            raise ValueError(f"autoround: {prefix}.{n}: {e}") from None
        out.append((n, m, spec))
    return out


def check(layer: nn.Module, lplans: dict, algo, prefix: str, *, family=None) -> None:
    """Every check, before any weight changes (shapes only)."""
    _targets(layer, lplans, algo, prefix)


def run(layer: nn.Module, lplans: dict, inputs, algo, prefix: str, pinned: dict, *, floats=None, reduce=None,
        reference=None, family=None) -> None:
    if floats is None:
        raise ValueError("autoround needs the float model's stream of layer inputs (floats=)")
    if reduce is not None:
        raise ValueError("autoround does not run under distributed calibration (its minibatches are not shared "
                         "between ranks); run it in one process")
    targets = _targets(layer, lplans, algo, prefix)
    if not targets:
        return
    weights = {n: linear_weight(m).detach().float().clone() for n, m, _ in targets}
    specs = {n: spec for n, _, spec in targets}
    conv = {n: weight_layout(m) == IN_OUT for n, m, _ in targets}  # Conv1D: the parameter is [in, out]
    dtypes = {n: m.weight.dtype for n, m, _ in targets}
    outs = [floats.outputs.hidden(b) for b in range(len(floats.outputs))]
    calls = list(zip(inputs.args, inputs.kwargs))

    def forward(fq: dict, call):
        args, kwargs = call
        sub = {f"{n}.weight": (w.t() if conv[n] else w).to(dtypes[n]) for n, w in fq.items()}
        return hidden_of(torch.func.functional_call(layer, sub, args, kwargs))

    frozen = [p for p in layer.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    t0 = time.perf_counter()
    try:
        key = (algo.key + zlib.crc32(prefix.encode())) % (2 ** 63)
        r = signround(weights, specs, forward, calls, outs, iters=algo.iters, lr=algo.lr, minmax_lr=algo.minmax_lr,
                      enable_minmax_tuning=algo.enable_minmax_tuning, batch_size=algo.batch_size, key=key)
    finally:
        for p in frozen:
            p.requires_grad_(True)
    _log.info("autoround %s: %d iterations in %.1f s, loss %.3g (iteration 0) -> %.3g (iteration %d)", prefix,
              algo.iters, time.perf_counter() - t0, r.init_loss, r.best_loss, r.best_iter)
    for n, m, _ in targets:
        write_pinned(m, r.qtensors[n], pinned, f"{prefix}.{n}", reference)

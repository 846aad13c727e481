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
(``passes.gptq``: each expert's slice of ``gate_up_proj`` / ``down_proj``, with Hessians from the tokens that
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

import logging
import time
from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn

from qcore.algorithms.config import (ROTATION_CONFIGS, AutoRoundConfig, AutoSmoothQuantConfig, AWQConfig,
                                     GPTAQConfig, GPTQConfig, HQQConfig, QronosConfig, SmoothQuantConfig,
                                     SVDQuantConfig, parse_algorithms)

from ..batches import FoundState
from ..families import family_or_none
from . import autoround, gptaq, hqq, qronos, scaling_bind, svdquant
from . import gptq as gptq_binding
from .checkpointing import algorithms_checkpoint
from .runner import AlgorithmError, LayerInputs, LayerRunner, find_decoder_layers
from .targets import layer_plans

_log = logging.getLogger("qcore.adapters")

__all__ = ["run_algorithms", "check_algorithms", "run_layer", "check_layers", "LAYER_BINDINGS", "binding",
           "reads_float_stream", "find_decoder_layers", "AlgorithmError"]


# ---------------------------------------------------------------------------------------------------------------
# the bindings: one module per layer algorithm in this package, keyed by the algorithm config's type (as torchao
# keys handlers by config type). A binding module has ``check(layer, lplans, algo, prefix, *, family=None)``
# (every check, before any weight changes), ``run(layer, lplans, inputs, algo, prefix, pinned, *, floats=None,
# reduce=None, reference=None, family=None)`` (rewrites the layer's float weights; puts the QTensors it decides
# into ``pinned``) and ``FLOAT_STREAM`` (whether it reads the float model's stream beside the quantized one,
# ``LayerRunner.run(float_inputs=)``).
# ---------------------------------------------------------------------------------------------------------------

LAYER_BINDINGS = {
    GPTQConfig: gptq_binding,
    AWQConfig: scaling_bind,
    SmoothQuantConfig: scaling_bind,
    AutoSmoothQuantConfig: scaling_bind,
    AutoRoundConfig: autoround,
    GPTAQConfig: gptaq,
    QronosConfig: qronos,
    HQQConfig: hqq,
    SVDQuantConfig: svdquant,
}


def binding(algo):
    """The binding module of layer algorithm ``algo`` (by its config's type); ValueError for one without."""
    b = LAYER_BINDINGS.get(type(algo))
    if b is None:
        raise ValueError(f"algorithm {algo.name!r} has no layer binding in qcore.adapters.passes "
                         f"(bound here: {', '.join(c().name for c in LAYER_BINDINGS)})")
    return b


def reads_float_stream(algos) -> bool:
    """Whether any of ``algos`` reads the float model's stream beside the quantized one."""
    return any(binding(a).FLOAT_STREAM for a in algos)


def check_layers(layers, by_layer: list[dict], algos, path: str, *, family=None) -> None:
    """Every check the algorithms make on the layers before any weight changes (shapes only: meta layers too);
    ``family``: the model's architecture record (``families.family_or_none(model)``) or None."""
    for a in algos:
        b = binding(a)
        for i, layer in enumerate(layers):
            b.check(layer, by_layer[i], a, f"{path}.{i}", family=family)


def run_layer(layer: nn.Module, lplans: dict, inputs: LayerInputs, algos, prefix: str, pinned: dict, reduce=None,
              reference: Optional[dict] = None, *, family=None, floats=None) -> None:
    """The algorithms, in order, on one decoder layer over its kept ``inputs`` (the per-layer step of
    ``run_algorithms``, shared with ``qcore.adapters.passes.streaming``); GPTQ's QTensors go into ``pinned``, and (when
    ``reference`` is a dict) the float weights GPTQ started from into ``reference`` (CPU copies). ``floats``: the
    float model's ``FloatStream`` of this layer (``runner.LayerRunner.run(float_inputs=)``) for the algorithms that
    read it (``FLOAT_STREAM``)."""
    for a in algos:
        b = binding(a)
        if b.FLOAT_STREAM and floats is None:
            raise ValueError(f"{a.name} needs the float model's stream of layer inputs (floats=)")
        b.run(layer, lplans, inputs, a, prefix, pinned, floats=floats, reduce=reduce, reference=reference,
              family=family)


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
    if any(isinstance(a, ROTATION_CONFIGS) for a in algos):
        raise ValueError("run_algorithms: rotations (quarot, spinquant) act on the whole model; run them through "
                         "quantize_model or qcore.adapters.passes.rotation.apply_rotation")
    if not isinstance(batches, Sequence) or len(batches) == 0:
        raise ValueError("the algorithms need calibration data: pass a non-empty list of batches as data=")
    if reduce is not None:
        searching = [a.name for a in algos if isinstance(a, (AWQConfig, AutoSmoothQuantConfig, AutoRoundConfig))]
        if searching:
            raise ValueError(f"{searching} search over calibration samples, which distributed calibration does not "
                             f"share between ranks yet; run them in one process (gptq and smoothquant run "
                             f"distributed)")
    path, layers, by_layer = layer_plans(model, plans, algos)
    family = family_or_none(model)
    check_layers(layers, by_layer, algos, path, family=family)

    runner = LayerRunner(model, path=path, layers=layers, progress=progress)
    found = FoundState(model, hooks=False)  # the passes install and remove their own hooks
    model.eval()
    pinned: dict = {}
    t0 = time.perf_counter()

    def step(i, layer, inputs, floats=None):
        run_layer(layer, by_layer[i], inputs, algos, f"{path}.{i}", pinned, reduce, reference, family=family,
                  floats=floats)

    two_streams = reads_float_stream(algos)

    checkpoint = None
    if work is not None:
        checkpoint = algorithms_checkpoint(work, path, by_layer, pinned, reference)
    try:
        with torch.no_grad():
            inputs = runner.capture(batches)
            runner.run(step, inputs, desc="algorithms, layer by layer", rewrites=True,
                       what=", ".join(a.name for a in algos), checkpoint=checkpoint,
                       float_inputs=inputs if two_streams else None)
    finally:
        found.restore()
    _log.info("algorithms %s on %d layers in %.1f s", [a.name for a in algos], len(layers), time.perf_counter() - t0)
    return pinned

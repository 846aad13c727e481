"""HQQ on a torch model: no calibration data, one pass over the weights (``qcore.algorithms.hqq``).

What it covers: EVERY quantized Linear (and transformers ``Conv1D``) weight of the plan, in the decoder layers and
outside them (the output head when the config quantizes it, a BERT pooler, ...), each fitted by ``hqq`` with its
own weight spec. Nothing the plan quantizes is left to round-to-nearest without a word: a quantized weight HQQ
cannot take (a float or MX spec, a quantized Embedding or Conv2d weight, fused MoE experts, a weight observer
other than min/max, whose scales HQQ would override) is refused by name before any work; exclude it or give it
``by_name`` / ``by_type`` settings HQQ can take.

``quantize_model`` runs it as the last algorithm (``apply_hqq``): after a rotation and after the scaling
algorithms (AWQ, SmoothQuant, AutoSmoothQuant: their folds are float rewrites, which HQQ then quantizes), and
without the algorithms that decide the quantized weights themselves (GPTQ and the like: refused, one algorithm
decides a weight's codes). Each weight's ``QTensor`` goes into the ``pinned`` dict that ``quantize_model`` commits,
so export writes HQQ's codes, scales and integer zero points. Alone (or after a rotation), HQQ needs no ``data=``.

``check`` / ``run`` are the layer runner's per-decoder-layer hook (``sequential.LAYER_BINDINGS``; used where a pass runs
the layer algorithms itself, e.g. ``qcore.adapters.passes.streaming``): the same fit for the layer's Linears,
inputs unused, float weights rewritten so the later layers see the quantized ones.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch
from torch import nn

from qcore.algorithms.config import ROTATION_CONFIGS, AutoSmoothQuantConfig, AWQConfig, SmoothQuantConfig
from qcore.algorithms.hqq import check_hqq_spec, hqq

from ..batches import progress_bar
from ..config import MinMax
from ..modules import linear_weight, linear_weight_spec
from .targets import check_experts_algorithms, write_pinned

_log = logging.getLogger("qcore.adapters")

__all__ = ["split_hqq", "check_model", "apply_hqq", "check", "run"]

FLOAT_STREAM = False  # reads the quantized stream only

# what may run before HQQ: float rewrites of the weights (the rotations run first anyway)
_BEFORE = (AWQConfig, SmoothQuantConfig, AutoSmoothQuantConfig)


def split_hqq(algos: tuple) -> tuple:
    """``(HQQConfig or None, the other algorithms)`` of parsed algorithms; ValueError (before any work) when HQQ
    is not last, given twice, or combined with an algorithm that decides the quantized weights itself."""
    names = [a.name for a in algos]
    if "hqq" not in names:
        return None, tuple(algos)
    if names.count("hqq") > 1 or names[-1] != "hqq":
        raise ValueError(f"algorithms {names}: hqq fits the quantized weights, so it comes last and once (after a "
                         f"rotation and the scaling algorithms awq / smoothquant / autosmoothquant)")
    rest = tuple(algos[:-1])
    bad = [a.name for a in rest if not isinstance(a, ROTATION_CONFIGS + _BEFORE)]
    if bad:
        raise ValueError(f"algorithms {names}: hqq and {bad} both decide the quantized weights (their codes and "
                         f"scales); use one of them (hqq combines with a rotation and with awq / smoothquant / "
                         f"autosmoothquant before it)")
    return algos[-1], rest


def _targets(model: nn.Module, plans: list, *, who: str = "hqq") -> list:
    """``[(name, module, spec)]`` of every quantized weight HQQ fits; ValueError naming what it cannot take."""
    out = []
    for p in plans:
        if p.config.weight is None:
            continue
        m = model.get_submodule(p.name)
        if linear_weight(m) is None:
            raise ValueError(f"{who}: {p.name!r} ({p.type}) gets weight quantization, but HQQ fits Linear (and "
                             f"Conv1D) weights only; exclude it or leave its weight float (by_name / by_type None)")
        obs = p.config.weight.observer
        if not isinstance(obs, MinMax):
            raise ValueError(f"{who}: {p.name!r} has the weight observer {type(obs).__name__}; HQQ fits the scales "
                             f"itself (from min/max), so that observer would be ignored: use MinMax with hqq")
        spec = linear_weight_spec(m, p, p.name)
        try:
            check_hqq_spec(spec)
            spec.scale_shape(tuple(linear_weight(m).shape))
        except ValueError as e:
            raise ValueError(f"{p.name}: {e}") from None
        out.append((p.name, m, spec))
    return out


def check_model(model: nn.Module, plans: list, algo) -> None:
    """Every check ``apply_hqq`` makes, before any weight changes."""
    check_experts_algorithms(plans, (algo,))
    if not _targets(model, plans):
        raise ValueError("hqq: the config quantizes no Linear weight")


def _fit(m: nn.Module, spec, algo):
    w = linear_weight(m).detach().float().contiguous()  # float32 [out, in]
    return hqq(w, spec, p=algo.p, beta=algo.beta, kappa=algo.kappa, iters=algo.iters, error_p=algo.error_p,
               scale_floor=algo.scale_floor)


def apply_hqq(model: nn.Module, plans: list, algo, pinned: dict, *, reference: Optional[dict] = None,
              progress: bool = True) -> dict:
    """HQQ on every quantized Linear weight of ``plans`` (``check_model`` first): ``pinned[name]`` = its
    ``QTensor`` (committed by ``quantize_model``; the float weights are not rewritten here, the commit does it);
    ``reference[name]``: the float weight it was fitted to (CPU copy). Returns ``pinned``."""
    check_model(model, plans, algo)
    targets = _targets(model, plans)
    t0 = time.perf_counter()
    with torch.no_grad():
        for name, m, spec in progress_bar(targets, desc="hqq", enabled=progress):
            q = _fit(m, spec, algo)
            if reference is not None:
                reference[name] = m.weight.detach().to("cpu", copy=True)
            pinned[name] = q
    _log.info("hqq on %d weights in %.1f s", len(targets), time.perf_counter() - t0)
    return pinned


# the layer runner's hook (sequential.LAYER_BINDINGS[HQQConfig])


def check(layer: nn.Module, lplans: dict, algo, prefix: str, *, family=None) -> None:
    _targets(layer, [_rel(p, n) for n, p in lplans.items()], who=f"hqq ({prefix})")


def run(layer: nn.Module, lplans: dict, inputs, algo, prefix: str, pinned: dict, *, floats=None, reduce=None,
        reference: Optional[dict] = None, family=None) -> None:
    for name, m, spec in _targets(layer, [_rel(p, n) for n, p in lplans.items()], who=f"hqq ({prefix})"):
        write_pinned(m, _fit(m, spec, algo), pinned, f"{prefix}.{name}", reference)


def _rel(plan, name: str):
    """``plan`` renamed relative to its decoder layer."""
    import dataclasses
    return dataclasses.replace(plan, name=name)

"""Quantize a whole torch model from a ``ModelConfig``: plan, algorithms, swap, calibrate, commit.

``quantize_model(model, config, data=None)`` is all-or-nothing: the plan (which module gets which config,
``qcore.adapters.plan``) and every check run before any module is touched; calibration runs on wrappers whose
weights are not yet written; any error restores the original modules, so the model is either unchanged or fully
quantized. The algorithms run first: a rotation on the whole float model, the layer algorithms through the layer
runner (``qcore.adapters.passes``), HQQ, then distillation on the committed model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

from qcore._fsutil import model_sources
from qcore.algorithms.config import ROTATION_CONFIGS, GPTQConfig, SpinQuantConfig, split_distill, split_rotation

from .batches import check_batches, check_data, progress_bar, set_module
from .calibration import calibrate
from .config import ModelConfig, TensorConfig
from .distributed import check_distributed, fingerprint as distributed_fingerprint
from .imatrix import attached_importance, importance_digest, model_importance
from .modules import QuantExperts, wrap
from .moe import moe_calibration
from .passes.checkpointing import WorkDir, check_work_args, digest_model, fingerprint
from .passes.distill import check_distill, make_teacher, run_distill
from .passes.hqq import apply_hqq, check_model as check_hqq, split_hqq
from .passes.rotation import check_rotation, resolve_block
from .passes.runner import find_decoder_layers
from .passes import sequential
from .passes.spinquant import apply_rotation
from .passes.targets import layers_path
from .plan import check_plannable, plan_model, resolve_config

__all__ = ["quantize_model"]


def quantize_model(model: nn.Module, config: Union[ModelConfig, str, Mapping], data: Optional[Iterable] = None, *,
                   imatrix: Any = None, qat: bool = False, progress: bool = True, distributed: Any = None,
                   reference: Optional[dict] = None, moe_all_experts: bool = True, work_dir=None,
                   resume: bool = False, distill_data: Optional[Iterable] = None,
                   plans: Optional[Sequence] = None) -> nn.Module:
    """Quantize ``model`` in place per ``config`` (a ``ModelConfig``, a preset name or a config dict) and return it.
    llama.cpp's mixes are preset names too (``"gguf_q4_k_m"``, ...: ``qcore.adapters.gguf_mix``, one GGUF type per
    tensor from the model's shapes and layers, exactly llama.cpp's choice).

    imatrix: an importance matrix for the modules whose weight spec is a GGUF type (llama.cpp's imatrix): the
        ``{name: ImatrixStats}`` of ``qcore.adapters.imatrix.collect_imatrix`` / ``load_imatrix`` (GGUF tensor
        names or module names), or the path of an imatrix file (``.gguf`` or legacy ``.dat``). Each such module is
        quantized by llama.cpp's importance-weighted search (``qcore.quantize(w, spec, imatrix=...)``, the bytes of
        ``ggml_quantize_chunk`` with that imatrix); GPTQ weights its per-block scale search by it. Modules with
        other specs ignore it; embeddings and the output head without an entry are quantized without (as
        llama.cpp); any other GGUF-spec Linear without an entry, or with an entry of another width, is an error
        before any work (``qcore.adapters.imatrix.model_importance``; docs/gguf.md).

    data: calibration batches (see ``calibrate``); needed when the config has static activation scales.
    qat: keep float master weights (trainable, straight-through gradients) instead of writing the fake-quantized
        weights in place (the default, which keeps one copy of the weights).
    progress: show progress bars.
    distributed: a ``qcore.adapters.distributed.Distributed`` when several processes (ranks of
        ``torch.distributed``) each hold a share of the calibration batches in ``data``: the algorithms' statistics
        (GPTQ's Hessians) and the static activation observers are reduced over the ranks, and every rank ends
        with the same quantized model (see ``qcore.adapters.distributed``). Every rank calls ``quantize_model``
        with the same model and config.
    reference: a dict that receives ``{module name: the float weight its quantized weight was rounded from}``
        (CPU copies: one more copy of the quantized weights; after a rotation or a smoothing fold, the transformed
        float weight, which computes what the original did; for GPTQ the weight GPTQ started from). What
        ``qcore.adapters.eval.layer_report`` measures the committed weights against.
    moe_all_experts: MoE blocks send every token to every expert during the algorithms' passes and calibration
        (outputs unchanged: the routed top-k only), so every expert gets statistics; see ``calibrate``.
    work_dir, resume: the layer algorithms (GPTQ, AWQ, SmoothQuant, AutoSmoothQuant) save their progress in
        ``work_dir`` after each decoder layer; ``resume=True`` continues a run saved there (same model, config and
        data: refused otherwise) to the same weights an uninterrupted run gives (``qcore.adapters.passes.
        checkpointing``; docs/adapters.md "Long runs: a work directory"). Not with ``distributed``.
    distill_data: the batches a ``distill`` algorithm trains on (default: ``data``).
    plans: ``plan_model(model, config)`` when the caller has made it (the main job plans once, in its checks);
        None: planned here.

    All or nothing: on any error the original modules are put back and the weights are untouched. With
    algorithms (``config.algorithms``: a rotation first, QuaRot or SpinQuant, on the whole float model,
    ``qcore.adapters.passes.rotation``; then GPTQ, AWQ, SmoothQuant, AutoSmoothQuant, ``qcore.adapters.passes.sequential``)
    every check still runs first, then the algorithms rewrite the weights; an error after that point leaves the
    model marked as partly rewritten (quantizing it again is refused; reload it).
    """
    kw = dict(qat=qat, progress=progress, distributed=distributed, reference=reference,
              moe_all_experts=moe_all_experts, work_dir=work_dir, resume=resume, distill_data=distill_data)
    if imatrix is None:
        return _quantize_model(model, config, data, plans=plans, **kw)
    config = resolve_config(config, model, imatrix=True)
    plans = plan_model(model, config) if plans is None else list(plans)
    importance = model_importance(model, plans, imatrix, config.algorithms)
    with attached_importance(model, importance):
        return _quantize_model(model, config, data, plans=plans, **kw)


def _quantize_model(model: nn.Module, config: Union[ModelConfig, str, Mapping], data: Optional[Iterable] = None, *,
                    plans: Optional[Sequence] = None, qat: bool = False, progress: bool = True,
                    distributed: Any = None, reference: Optional[dict] = None, moe_all_experts: bool = True,
                    work_dir=None, resume: bool = False, distill_data: Optional[Iterable] = None) -> nn.Module:
    """``quantize_model`` without ``imatrix`` (the importance, if any, is attached to the modules), in phases: every
    check, the algorithms on the float weights, the swap and calibration, the commit, distillation."""
    _check_options(model, qat=qat, progress=progress, moe_all_experts=moe_all_experts, reference=reference)
    config = resolve_config(config, model)
    if plans is None:
        plans = plan_model(model, config)
    else:  # the caller's plan of this model and config: what makes a model unfit whatever the plan, checked here
        check_plannable(model, config)
        plans = list(plans)
    config = resolve_block(model, config, plans)  # a rotation's block="auto": the weights' block size
    static, data = _check_data(model, plans, data, distributed=distributed, config=config)
    dist, algos = split_distill(config.algorithms)  # quantization-aware distillation: last, on the quantized model
    distill_data, teacher = _check_distill(model, plans, dist, data, distill_data, qat=qat, distributed=distributed)
    if work_dir is not None and data is not None:
        data = list(data)  # read by the fingerprint, then by the run
    work = _work_dir(model, config, algos, data, work_dir, resume, distributed, reference is not None)
    pinned: dict = {}
    if algos:
        pinned, data = _run_algorithms(model, plans, algos, data, qat=qat, progress=progress, distributed=distributed,
                                       reference=reference, work=work, moe_all_experts=moe_all_experts)
    wrappers = _swap_and_calibrate(model, plans, pinned, data, static=static, qat=qat, progress=progress,
                                   distributed=distributed, moe_all_experts=moe_all_experts)
    _commit(model, wrappers, pinned, qat=qat, progress=progress, reference=reference, teacher=teacher, dist=dist,
            distill_data=distill_data)
    model.qcore_config = config  # what exporters write (qcore.adapters.export_hf)
    return model


def _check_options(model, *, qat, progress, moe_all_experts, reference) -> None:
    if not isinstance(qat, bool):
        raise TypeError(f"qat must be a bool, got {qat!r}")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {progress!r}")
    if not isinstance(moe_all_experts, bool):
        raise TypeError(f"moe_all_experts must be a bool, got {moe_all_experts!r}")
    if reference is not None and not isinstance(reference, dict):
        raise TypeError(f"reference must be a dict (filled with the float weights) or None, got "
                        f"{type(reference).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def _check_data(model, plans, data, *, distributed, config) -> tuple:
    """``(static activation roles, data)``: every weight in memory, calibration batches where static scales need
    them, and the ranks of ``distributed`` agreeing on the model, the config and the number of batches."""
    meta = [n for n, t in model.named_parameters() if t.is_meta]
    if meta:
        raise ValueError(f"quantize_model: {len(meta)} parameters are on the meta device (e.g. {meta[0]!r}): offloaded "
                         f"by accelerate (a device_map with 'cpu' or 'disk' entries) or never loaded; quantize_model "
                         f"needs every weight in memory (on any devices). For a model larger than memory use "
                         f"qcore.adapters.jobs.checkpoint.quantize_checkpoint")
    static = [f"{p.name}.{r}" for p in plans for r in ("input", "output")
              if isinstance(getattr(p.config, r), TensorConfig) and getattr(p.config, r).calibrated]
    if static and data is None:
        raise ValueError(f"the config has static activation scales ({', '.join(static[:3])}"
                         f"{', ...' if len(static) > 3 else ''}); pass calibration batches as data=")
    check_data(data)
    check_batches(model, data)
    if static and isinstance(data, (list, tuple)) and not data:
        raise ValueError("calibration data is empty; static activation scales need at least one batch")
    if distributed is not None:
        check_distributed(distributed)
        if data is not None:
            data = list(data)
        distributed.check_consistent(fingerprint=distributed_fingerprint(model, config, plans),
                                     n_batches=len(data) if data is not None else 1)
    return static, data


def _check_distill(model, plans, dist, data, distill_data, *, qat, distributed) -> tuple:
    """``(distill batches, teacher)``: the float model kept as distillation's teacher (None without ``distill``)."""
    if dist is None:
        if distill_data is not None:
            raise ValueError("distill_data= is for the algorithm distill, which the config does not run")
        return distill_data, None
    if qat or distributed is not None:
        raise ValueError("distill trains the committed quantized model on one process: not with qat=True or "
                         "distributed=")
    if distill_data is None and data is None:
        raise ValueError("the algorithm distill needs training batches; pass calibration batches as data=")
    distill_data = list(data if distill_data is None else distill_data)
    check_batches(model, distill_data)
    check_distill(model, plans, dist)
    return distill_data, make_teacher(model)  # the float model (a rotation keeps its function)


def _run_algorithms(model, plans, algos, data, *, qat, progress, distributed, reference, work,
                    moe_all_experts) -> tuple:
    """``(pinned QTensors, data)``: a rotation on the whole float model, the layer algorithms through the layer
    runner (their checks first), HQQ last; a failure after the first rewrite marks the model partly rewritten."""
    rot, algos = split_rotation(algos)
    if qat:
        raise ValueError("qat=True keeps float master weights; the algorithms write quantized weights (use "
                         "qat=False with algorithms)")
    hq, algos = split_hqq(algos)  # HQQ (data-free) runs last, outside the layer runner: every Linear weight
    needs = [a.name for a in algos] + ([rot.name] if isinstance(rot, SpinQuantConfig) else [])
    if data is None and needs:
        raise ValueError(f"the algorithms {needs} need calibration data; pass calibration batches as data=")
    if data is not None:
        data = list(data)  # read more than once: by the algorithms and by calibration
        check_batches(model, data)
    if hq is not None:
        check_hqq(model, plans, hq)
    if rot is not None:
        check_rotation(model, rot)
        if algos:
            sequential.check_algorithms(model, plans, algos)
        try:
            apply_rotation(model, rot, plans=plans, data=data, progress=progress,
                           gptq_follows=any(type(a) is GPTQConfig for a in algos))
        except BaseException:
            model._qcore_partial = True  # some weights may already be rotated
            raise
    pinned: dict = {}
    if algos:
        # layers run several times per batch there: counted by calibrate's single pass only
        with moe_calibration(model, all_experts=moe_all_experts, warn=False) as moe, moe.counting(False):
            pinned = sequential.run_algorithms(model, plans, algos, data, progress=progress, reduce=distributed,
                                               reference=reference, work=work)
    if hq is not None:
        try:
            apply_hqq(model, plans, hq, pinned, reference=reference, progress=progress)
        except BaseException:
            if rot is not None or algos:
                model._qcore_partial = True  # the algorithms before it rewrote the float weights
            raise
    return pinned, data


def _swap_and_calibrate(model, plans, pinned, data, *, static, qat, progress, distributed, moe_all_experts) -> list:
    """``[(name, float module, wrapper)]``: each planned module swapped for its wrapper (the algorithms' weights
    committed as they are), static scales calibrated; on any error the float modules are put back."""
    wrappers = [(p.name, model.get_submodule(p.name), wrap(model.get_submodule(p.name), p.config, name=p.name,
                                                           qat=qat, proj_weights=p.proj_weights)) for p in plans]
    for name, _, new in wrappers:
        set_module(model, name, new)
    for name, _, new in wrappers:  # weights the algorithms quantized are committed as they are, before calibration
        if name in pinned:
            new.commit(weight=pinned[name])
    try:
        if static:
            calibrate(model, data, progress=progress, distributed=distributed, moe_all_experts=moe_all_experts)
        if qat:  # the scale buffers of the master weights, from the start
            with torch.no_grad():
                for _, _, new in wrappers:
                    for role in ("weight", "bias"):
                        if role in new.specs:
                            new.effective(role)
    except BaseException:
        for name, old, _ in wrappers:
            set_module(model, name, old)
        if pinned:
            model._qcore_partial = True  # the float modules hold the algorithms' weights now
        raise
    return wrappers


def _commit(model, wrappers, pinned, *, qat, progress, reference, teacher, dist, distill_data) -> None:
    """The reference weights kept, every weight written on its grid (not with ``qat``), then distillation."""
    if reference is not None:
        for name, _, new in wrappers:
            if name not in pinned and "weight" in new.specs and not isinstance(new, QuantExperts):  # experts:
                reference[name] = new.weight.detach().to("cpu", copy=True)  # not in layer_report yet (docs/adapters.md)
    if teacher is not None:  # what round-to-nearest rounded: the trained weights start there (distill's docs)
        distill_init = {name: new.weight.detach().clone() for name, _, new in wrappers
                        if name not in pinned and "weight" in new.specs and not isinstance(new, QuantExperts)}
    if not qat:
        # Past this point the model is quantized: writing the weights in place cannot be undone without a second
        # copy of them. If it is interrupted, the wrappers not yet written stay in their pending mode, which
        # fake-quantizes at the forward: the model is fully quantized either way.
        for _, _, new in progress_bar(wrappers, desc="quantizing weights", enabled=progress):
            new.commit()
    if teacher is not None:
        try:
            model.qcore_distill = run_distill(model, teacher, distill_data, dist, progress=progress,
                                              init=distill_init)
        except BaseException:
            model._qcore_partial = True  # trained part of the way (the weights are on their grids)
            raise
        finally:
            del teacher


def _work_dir(model, config, algos, data, work_dir, resume, distributed, keeps_reference):
    """``quantize_model``'s work directory (None without one), checked and tied to this run before any work."""
    path = check_work_args(work_dir, resume, sources=model_sources(model))
    if path is None:
        return None
    layer_algos = [a for a in algos if not isinstance(a, ROTATION_CONFIGS)]
    if not layer_algos:
        raise ValueError(f"work_dir={str(work_dir)!r}: the config runs no layer-by-layer algorithm (gptq, awq, "
                         f"smoothquant, autosmoothquant), so there is no progress to save")
    if distributed is not None:
        raise ValueError(f"work_dir={str(work_dir)!r}: not with distributed= (each rank would write its own); run "
                         f"distributed calibration without a work directory")
    n = len(find_decoder_layers(model, layers_path(layer_algos))[1])
    imp = importance_digest(model)
    fp = fingerprint(what="quantize_model", model=digest_model(model), config=config.to_dict(),
                     data=list(data) if data is not None else None, n_layers=n,
                     extra={"reference weights kept": keeps_reference, **({"imatrix": imp} if imp else {})})
    return WorkDir(path, fp, resume=resume)




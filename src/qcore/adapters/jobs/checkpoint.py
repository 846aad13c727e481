"""``quantize_checkpoint`` as a job: a float HF checkpoint, larger than memory, quantized one decoder layer at a
time and written in AMD Quark's HF layout (the same files ``quantize_model`` + ``export_hf`` write for the model
loaded whole). The job checks its arguments and the checkpoint against the config (``_check_arguments``,
``_plan``), then runs in phases: the weights outside the decoder layers (``_load_outside``), the streamed layers
and the written shards (``_write``). The streamed pass itself is ``qcore.adapters.passes.streaming``.
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from qcore._fsutil import staged_dir
from qcore.algorithms.config import ROTATION_CONFIGS
from qcore.formats import quark_layout as L

from .._device import check_device
from ..batches import check_data
from ..config import ModelConfig, TensorConfig
from ..distributed import check_distributed
from ..distributed import fingerprint as distributed_fingerprint
from ..families import family_or_none
from ..io.experts import check_no_experts
from ..io.common import check_destination, parse_size, weightless_error, write_metadata, write_shards
from ..io.quark_hf import ExportInfo, checkpoint_method, export_info, quantization_config
from ..passes.checkpointing import (WorkDir, check_work_args, digest_source, digest_source_files, fingerprint,
                                   read_work_dir, saved_run)
from ..passes.runner import Spill, find_decoder_layers
from ..passes.sequential import binding, check_layers
from ..passes.streaming import (TOKENIZER_FILES, Source, check_source, load_tensors, meta_keys, pin_mmap_threshold,
                                set_tensor, skeleton, stream_layers)
from ..passes.targets import layer_plans
from ..plan import plan_model, resolve_config
from .common import PYTHON
from .files import JobFiles

_log = logging.getLogger("qcore.adapters")

__all__ = ["quantize_checkpoint", "job_files"]


def quantize_checkpoint(src_dir: Union[str, os.PathLike], dst_dir: Union[str, os.PathLike],
                        config: Union[ModelConfig, str, Mapping], data: Optional[Iterable] = None, *,
                        dtype: Optional[torch.dtype] = None, device: Union[str, torch.device] = "cpu",
                        max_shard_size: Union[int, str] = "5GB", pack_method: str = "reorder",
                        overwrite: bool = False, progress: bool = True, work_dir=None,
                        resume: bool = False, distributed=None) -> Optional[ExportInfo]:
    """Quantize the float HF checkpoint in ``src_dir`` (config.json + safetensors) per ``config`` and write it to
    ``dst_dir`` in Quark's HF layout, one decoder layer in memory at a time (module docstring). The result is
    what ``quantize_model`` + ``export_hf`` write for the model loaded whole, bit for bit.

    data: calibration batches (token ids, as for ``quantize_model``); needed for algorithms and static scales.
    dtype: the float dtype to compute in (default: the checkpoint's, as ``from_pretrained`` picks it).
    device: where each layer and the activations live while it is processed (e.g. ``"cuda"``).
    max_shard_size, pack_method, overwrite, progress: as for ``export_hf`` (a ``dst_dir`` that is, contains or
        lies inside ``src_dir`` is refused, with overwrite or not).
    work_dir, resume: save the progress after each decoder layer in ``work_dir`` (the layer's encoded tensors,
        the next layer's inputs); ``resume=True`` continues a run saved there to the same files
        (``qcore.adapters.passes.checkpointing``; a work directory inside ``src_dir`` or ``dst_dir`` is refused).
    distributed: a ``qcore.adapters.distributed.Distributed`` when several processes each hold a share of the
        calibration batches (every rank calls ``quantize_checkpoint`` with the same arguments and its own
        ``data``): GPTQ's Hessians are reduced over the ranks (and with ``layer_parallel=True`` the ranks share
        the column loops), every rank computes the same layers, and rank 0 alone writes ``dst_dir`` (the other
        ranks return None). Static activation scales are refused with it (not reduced here yet). A refusal of
        rank 0's ``dst_dir`` is raised on every rank, as a ``ValueError`` naming it, before any work.
    """
    job = _check_arguments(src_dir, dst_dir, config, data, dtype=dtype, device=device, max_shard_size=max_shard_size,
                           pack_method=pack_method, overwrite=overwrite, progress=progress, work_dir=work_dir,
                           resume=resume, distributed=distributed)
    plan = _plan(job)
    _load_outside(plan)
    _check_resumed_source(plan)
    pin_mmap_threshold()
    t0 = time.perf_counter()
    if not job.writer:  # a distributed rank other than 0: the same layers as rank 0 (its collectives), nothing written
        with torch.no_grad():
            _stream(plan, None)
        return None
    info = _write(plan)
    _log.info("quantize_checkpoint: %d layers in %.1f s", len(plan.layers), time.perf_counter() - t0)
    return info


def job_files(src_dir, dst_dir, *, work_dir=None) -> JobFiles:
    """What ``quantize_checkpoint`` reads (``src_dir``, ``work_dir``) and writes (``dst_dir``, ``work_dir``)."""
    return JobFiles.of(PYTHON, reads=[("src_dir", src_dir), ("work_dir", work_dir)],
                       writes=[("dst_dir", dst_dir, "the export"), ("work_dir", work_dir, "the run", False)])


@dataclass(frozen=True)
class _Job:
    """``quantize_checkpoint``'s arguments, checked."""

    src: pathlib.Path
    dst: pathlib.Path
    config: ModelConfig
    data: Optional[list]
    dtype: Optional[torch.dtype]
    device: torch.device
    max_bytes: int
    pack_method: str
    overwrite: bool
    progress: bool
    work_path: Optional[pathlib.Path]
    resume: bool
    distributed: Any
    writer: bool  # this process writes dst (rank 0, or no ranks)
    refused: Optional[str]  # with ranks: rank 0's refusal of dst, raised on every rank by check_consistent


def _check_arguments(src_dir, dst_dir, config, data, *, dtype, device, max_shard_size, pack_method, overwrite,
                     progress, work_dir, resume, distributed) -> _Job:
    """Every argument checked, before anything is read but ``src_dir``'s config.json."""
    src, dst = pathlib.Path(src_dir), pathlib.Path(dst_dir)
    work_path = check_work_args(work_dir, resume)
    job_files(src, dst, work_dir=work_path).check()  # with overwrite or not: replacing the source would delete it
    if work_path is not None:  # a folder of someone's, or a saved run without resume: refused before any reading
        saved = read_work_dir(work_path)
        if saved is not None and not resume:
            raise ValueError(f"work_dir {str(work_path)!r} holds a run ({saved_run(saved)} saved); pass "
                             f"resume=True to continue it, or choose an empty or new directory")
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"src_dir {str(src)!r} is not a model directory (no config.json)")
    if pack_method not in L.PACK_METHODS:
        raise ValueError(f"pack_method must be one of {sorted(L.PACK_METHODS)}, got {pack_method!r}")
    for name, v in (("overwrite", overwrite), ("progress", progress)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {v!r}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    device = check_device(device, what="device")
    max_bytes = parse_size(max_shard_size)
    cfg = resolve_config(config)
    check_data(data)
    if data is not None:
        data = list(data)
    if distributed is not None:
        check_distributed(distributed)
        if work_path is not None:
            raise ValueError("quantize_checkpoint: work_dir= is not supported with distributed= (each rank would "
                             "need its own work directory); run without work_dir or in one process")
    writer = distributed is None or distributed.rank == 0
    refused = None
    if writer:
        try:
            check_destination(dst, overwrite, [src])
        except (OSError, ValueError) as e:
            if distributed is None:
                raise
            refused = f"dst_dir: {e}"
    return _Job(src, dst, cfg, data, dtype, device, max_bytes, pack_method, overwrite, progress, work_path, resume,
                distributed, writer, refused)


@dataclass(frozen=True)
class _Plan:
    """The checked job on the checkpoint: the meta skeleton and its plan, the algorithms, the decoder layers and
    each layer's plans, where every quantized module sits, the export's orders, the work directory."""

    job: _Job
    model: Any
    dtype: torch.dtype
    generation: Any
    source: Source
    plans: list
    algos: tuple
    static: list
    path: str
    layers: Any
    by_layer: list
    layer_of: dict
    outer_plans: list
    state_order: dict
    module_order: dict
    own: bool  # every quantized weight in qcore's layout (export_hf's rule)
    work: Optional[WorkDir]


def _plan(job: _Job) -> _Plan:
    """The skeleton built and planned, the config checked against it and the checkpoint: what the streamed pass
    refuses (fused experts, weightless modules, rotations, float-stream algorithms, missing data), before any
    tensor is read."""
    source = Source(job.src, hash=job.work_path is not None)  # with a work directory: hashed as it is read
    model, dtype, gen = skeleton(job.src, job.dtype)
    cfg = job.config
    plans = plan_model(model, cfg)
    check_no_experts(model, cfg, who="quantize_checkpoint")  # fused MoE experts: not streamed yet (docs/adapters.md)
    weightless = [p.name for p in plans if p.config.weight is None]
    if weightless:  # the checkpoint stores quantized weights with their scales (as export_hf, which refuses too)
        raise ValueError(weightless_error("quantize_checkpoint", weightless))
    static = [p for p in plans for r in ("input", "output")
              if isinstance(getattr(p.config, r), TensorConfig) and getattr(p.config, r).calibrated]
    algos = cfg.algorithms
    if any(isinstance(a, ROTATION_CONFIGS) for a in algos):
        raise ValueError(f"quantize_checkpoint: rotations ({[a.name for a in algos if isinstance(a, ROTATION_CONFIGS)]}) "
                         f"act on the whole model at once and are not streamed; use quantize_model")
    if (static or algos) and not job.data:
        what = "the algorithms" if algos else "static activation scales"
        raise ValueError(f"{what} need calibration data; pass a non-empty list of batches as data=")
    two = [a.name for a in algos if binding(a).FLOAT_STREAM]
    if two:
        raise ValueError(f"quantize_checkpoint: {two} read the float model's layer inputs beside the quantized "
                         f"ones, which the streamed pass does not keep yet; use quantize_model")
    if algos:
        path, layers, by_layer = layer_plans(model, plans, algos)
        check_layers(layers, by_layer, algos, path, family=family_or_none(model))
    else:
        path, layers = find_decoder_layers(model)
        by_layer = [{} for _ in layers]
    layer_of = {}
    for p in plans:
        idx, _, rel = p.name[len(path) + 1:].partition(".") if p.name.startswith(path + ".") else ("", "", "")
        if idx.isdigit() and rel:
            layer_of[p.name] = int(idx)
    check_source(model, source)
    if job.distributed is not None:
        if static:
            raise ValueError("quantize_checkpoint: static activation scales are not reduced over the ranks of "
                             "distributed= yet; quantize_model(..., distributed=...) reduces them, or run in one "
                             "process")
        job.distributed.check_consistent(fingerprint=distributed_fingerprint(model, cfg, plans),
                                         n_batches=len(job.data or ()), error=job.refused)
    own = checkpoint_method(model, cfg) == "qcore"  # every quantized weight in qcore's layout (export_hf's rule)
    work = None
    if job.work_path is not None:  # tied to this run before any work (checkpointing.streaming_checkpoint)
        files = {f"source file {n}": h for n, h in digest_source_files(job.src).items()}  # headers: a change names
        work = WorkDir(job.work_path, fingerprint(                                           # the file
            what="quantize_checkpoint", model=digest_source(job.src), config=cfg.to_dict(), data=job.data,
            n_layers=len(layers), extra={"dtype": str(dtype), "pack_method": job.pack_method,
                                         "device": str(job.device), **files}), resume=job.resume)
    return _Plan(job, model, dtype, gen, source, plans, algos, static, path, layers, by_layer, layer_of,
                 [p for p in plans if p.name not in layer_of],
                 {k: i for i, k in enumerate(model.state_dict(keep_vars=True))},
                 {p.name: i for i, p in enumerate(plans)}, own, work)


def _load_outside(plan: _Plan) -> None:
    """The weights outside the decoder layers, read into the skeleton (a tied weight stored once, tied again)."""
    model, path, source, device = plan.model, plan.path, plan.source, plan.job.device
    outer_keys = [k for k in meta_keys(model) if not k.startswith(path + ".")]
    load_tensors(model, "", [k for k in outer_keys if k in source.where], source, plan.dtype, device)
    if any(k not in source.where for k in outer_keys):
        model.tie_weights()  # a tied weight stored once (e.g. lm_head.weight = model.embed_tokens.weight)
    for name, b in list(model.named_buffers()):
        if not name.startswith(path + ".") and b is not None and b.device != device and not b.is_meta:
            set_tensor(model, name, b.to(device))


def _check_resumed_source(plan: _Plan) -> None:
    """A resumed run: the source's bytes that the saved layers were computed from are still there. The weights
    outside the layers were just read again (and hashed as they were read: compared with what the saved run
    read); each saved layer's tensors are checked per shard (``Source.changed``: a shard untouched since then,
    by size, mtime, ctime and inode, is trusted; any other is hashed again, those tensors only). A difference
    is refused in one line naming the shard, before any layer runs: the output would mix old and new weights."""
    work, source = plan.work, plan.source
    if work is None or not work.entries:
        return
    where = f"quantize_checkpoint: work_dir {str(work.path)!r}"
    if any(not isinstance(e.get("source"), dict) for e in work.entries):
        raise ValueError(f"{where} holds layers saved without the source's digests (an older qcore); start afresh "
                         f"in a new work directory")
    outer = [n for n in source.digests if not n.startswith(plan.path + ".")]
    f = source.changed(outer, work.entries[0]["source"]["outside"], reread=False)
    if f is not None:
        raise ValueError(f"{where}: the source's shard {f!r} changed since the saved run read it (the weights "
                         f"outside the decoder layers); resuming would mix old and new weights: start afresh in a "
                         f"new work directory")
    for i, e in enumerate(work.entries):
        f = source.changed([f"{plan.path}.{i}.{k}" for k in meta_keys(plan.layers[i])], e["source"]["layer"])
        if f is not None:
            raise ValueError(f"{where}: the source's shard {f!r} changed since the saved run quantized layer {i} "
                             f"from it; resuming would mix old and new weights: start afresh in a new work "
                             f"directory")


def _stream(plan: _Plan, spill: Optional[Spill]) -> tuple:
    """The streamed pass over the decoder layers (``passes.streaming.stream_layers``)."""
    job = plan.job
    return stream_layers(plan.model, plan.source, path=plan.path, layers=plan.layers, by_layer=plan.by_layer,
                         plans=plan.plans, outer_plans=plan.outer_plans, layer_of=plan.layer_of, algos=plan.algos,
                         static=plan.static, data=job.data, dtype=plan.dtype, device=job.device, spill=spill,
                         pack_method=job.pack_method, progress=job.progress, own=plan.own,
                         work_dir=None if spill is None else plan.work, reduce=job.distributed)


def _write(plan: _Plan) -> ExportInfo:
    """The streamed layers and the shards, in ``export_hf``'s order, staged beside ``dst`` and renamed into place."""
    job = plan.job
    src, dst = job.src, job.dst
    spill = None
    try:
        with staged_dir(dst, recheck=lambda: check_destination(dst, job.overwrite, [src])) as tmp:
            spill = Spill(tmp / ".qcore-layers.spill")
            with torch.no_grad():
                records, layouts = _stream(plan, spill)
            # export_hf's order: the quantized modules' tensors in module order, then the other tensors in
            # state-dict order (stable sort: each module keeps its own tensor order)
            qnames = {p.name for p in plan.plans}

            def key(r):
                owner = r.name.rpartition(".")[0]
                if owner in qnames:
                    return (0, plan.module_order[owner])
                return (1, plan.state_order[r.name])
            records.sort(key=key)
            qdict = quantization_config(plan.model, job.config, layouts, job.pack_method)
            write_metadata(tmp, plan.model.config, qdict, type(plan.model).__name__, plan.generation)
            for f in TOKENIZER_FILES:
                if (src / f).is_file():
                    shutil.copyfile(src / f, tmp / f)
            spill.close()
            write_shards(tmp, records, job.max_bytes, progress=job.progress)
            os.remove(spill.path)
    finally:
        if spill is not None:
            spill.close()
    return export_info(dst, qdict, layouts)

"""The streamed pass of a checkpoint larger than memory: read it one decoder layer at a time, write the result layer by
layer. The job that runs it is ``qcore.adapters.jobs.checkpoint.quantize_checkpoint``, which takes an HF model directory (``config.json`` and
safetensors shards) and writes the quantized checkpoint in AMD Quark's HF layout, the same files
``export_hf`` writes for the model quantized in memory:

    model = AutoModelForCausalLM.from_pretrained(src_dir)       # needs the whole model in memory
    quantize_model(model, config, data); export_hf(model, dst_dir)

gives the same tensors, bit for bit, as ``quantize_checkpoint(src_dir, dst_dir, config, data)``, which holds at
most: the weights outside the decoder layers (embeddings, final norm, output head), one decoder layer (in the
model dtype), the calibration activations of one layer (two copies per stream: the algorithms' stream and, with
static activation scales, the calibration stream) and one layer's algorithm statistics (GPTQ: one ``in x in``
float64 Hessian per distinct input).

How: the transformers model is built from ``config.json`` with its parameters on the meta device (no memory;
``accelerate.init_empty_weights``); the weights outside the decoder layers are read from the safetensors files
(plain reads, no memory map: the page cache is not part of the process); the calibration batches run to the
first decoder layer, whose inputs are kept; then for each layer in turn (a pass of ``qcore.adapters.passes.runner``):

1. its weights are read into a copy of the (meta) layer;
2. the algorithms run on it (``qcore.adapters.passes.sequential.run_layer``, the step ``run_algorithms`` runs) and
   the layer's outputs become the next layer's inputs;
3. its modules are wrapped and their weights written (GPTQ's QTensors as they are, round-to-nearest for the
   others); static activation scales are calibrated from this layer's inputs in the calibration stream (the
   inputs ``calibrate`` would give it: the earlier layers quantized, static activations unquantized);
4. its tensors are encoded in the checkpoint layout (``qcore.adapters.io.quark_hf.module_records``) and appended
   to a spill file in the staging directory; the layer is dropped (back to meta).

Modules outside the layers are quantized by round-to-nearest; static scales of modules after the layers (an
output head that is not excluded) are calibrated by running the model with the layers replaced by the kept
final hidden states. At the end the shards are written in ``export_hf``'s order (the same sharding, names and
index), with ``config.json``, ``generation_config.json`` and the source's tokenizer files, into a staging
directory renamed into place (an error or Ctrl-C leaves the destination as it was).

Limits: transformers causal LMs whose state-dict names are the checkpoint's names (no key renaming on load),
decoder layers that take the same keyword arguments (mask, position embeddings) at every layer (as
``run_algorithms`` assumes), float source checkpoints.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import pathlib
from typing import Optional

import numpy as np

import torch
from torch import nn

from qcore.formats.safetensors_io import (
    CorruptCheckpointError,
    SafetensorsFile,
    TensorRecord,
    index_shards,
    no_safetensors,
)

from ..batches import set_module
from ..families import family_or_none
from ..io.records import ST_TORCH
from ..io.common import read_config, unexpected_keys
from ..io.common import hf_config as read_hf_config
from ..io.quark_hf import (
    plan_tensors,
)
from ..modules import calibrating, wrap
from .checkpointing import streaming_checkpoint
from .runner import LayerRunner, forward_layer
from .sequential import run_layer

_log = logging.getLogger("qcore.adapters")

__all__ = ["Source", "skeleton", "check_source", "stream_layers", "load_tensors", "set_tensor", "meta_keys",
           "pin_mmap_threshold", "TOKENIZER_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja",
                    "chat_template.json")


# ---------------------------------------------------------------------------------------------------------------
# the source checkpoint
# ---------------------------------------------------------------------------------------------------------------


class Source:
    """The source checkpoint's tensors by name (headers validated; each tensor read on request). With ``hash=True``
    every tensor read is hashed as it is read (SHA-256 of its bytes, ``digests``): a run with a work directory
    records what it read per shard (``record``) and a resumed run checks the shards it does not read again
    (``changed``), without a second full read."""

    def __init__(self, directory: pathlib.Path, *, hash: bool = False):
        self.hash = hash
        self.digests: dict[str, str] = {}
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            files = [f.name for f in index_shards(directory, index)]
        elif (directory / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise no_safetensors(directory)
        self.where: dict[str, SafetensorsFile] = {}
        for f in files:
            st = SafetensorsFile(directory / f)
            for k in st.keys():
                self.where[k] = st

    def read(self, name: str, dtype: torch.dtype, device) -> torch.Tensor:
        st = self.where[name]
        e = st.entries[name]
        src = ST_TORCH.get(e.dtype)
        if src is None:
            raise CorruptCheckpointError(f"tensor {name!r} has dtype {e.dtype}, which torch cannot hold")
        t = torch.empty(tuple(e.shape), dtype=src)
        if t.numel():
            st.read_into(name, t.view(-1).view(torch.uint8).numpy())
        if self.hash:  # the bytes just read, as they are in the file
            self.digests[name] = hashlib.sha256(t.view(-1).view(torch.uint8).numpy() if t.numel() else b"").hexdigest()
        if src != dtype and t.is_floating_point():
            t = t.to(dtype)
        return t.to(device)


    def _stat(self, st: SafetensorsFile) -> list:
        s = os.stat(st.path)
        return [s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino]

    @staticmethod
    def _combine(names: list, digest) -> str:
        h = hashlib.sha256()
        for n in sorted(names):
            h.update(f"{n}\0{digest(n)}\0".encode())
        return h.hexdigest()

    def record(self, names) -> dict:
        """``{shard file: {"sha256": ..., "stat": [size, mtime_ns, ctime_ns, inode]}}`` of tensors ``names``, all
        read (hashed) by this run: the SHA-256 of their names and digests, per shard, and the shard's stat when
        they were read (what ``changed`` compares)."""
        by: dict = {}
        for n in names:
            by.setdefault(self.where[n], []).append(n)
        return {st.path.name: {"sha256": self._combine(ns, self.digests.__getitem__), "stat": self._stat(st)}
                for st, ns in sorted(by.items(), key=lambda kv: kv[0].path.name)}

    def changed(self, names, saved: dict, *, reread: bool = True) -> Optional[str]:
        """The first shard (file name) whose tensors among ``names`` no longer have the bytes ``saved`` (a
        ``record``) says, or None. A shard whose size, mtime, ctime and inode are as recorded is trusted; any other
        is hashed again (only these tensors: the ones the saved run processed); ``reread=False`` compares the
        digests this run took while reading them instead."""
        by: dict = {}
        for n in names:
            st = self.where.get(n)
            by.setdefault(st.path.name if st is not None else None, []).append(n)
        if None in by or set(by) != set(saved):
            return sorted(set(by) ^ set(saved), key=str)[0] or "(a tensor moved between shards)"
        for f, ns in sorted(by.items()):
            st = self.where[ns[0]]
            rec = saved[f]
            if reread and self._stat(st) == list(rec.get("stat", [])):
                continue  # the quick check: untouched since the saved run read it
            if reread:
                def digest(n, st=st):
                    e = st.entries[n]
                    buf = np.empty(e.end - e.begin, np.uint8)
                    if buf.size:
                        st.read_into(n, buf)
                    return hashlib.sha256(buf).hexdigest()
            else:
                digest = self.digests.__getitem__
            if self._combine(ns, digest) != rec.get("sha256"):
                return f
        return None


def set_tensor(root: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = root.get_submodule(mod_name) if mod_name else root
    if leaf in mod._parameters:
        old = mod._parameters[leaf]
        if tuple(old.shape) != tuple(value.shape):
            raise CorruptCheckpointError(f"tensor {name!r} has shape {list(value.shape)} in the checkpoint; the "
                                         f"model's config gives {list(old.shape)}")
        mod._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        old = mod._buffers[leaf]
        if old is not None and tuple(old.shape) != tuple(value.shape):
            raise CorruptCheckpointError(f"tensor {name!r} has shape {list(value.shape)} in the checkpoint; the "
                                         f"model's config gives {list(old.shape)}")
        mod._buffers[leaf] = value


def load_tensors(root: nn.Module, prefix: str, keys: list[str], source: Source, dtype, device) -> None:
    """Read ``keys`` (names relative to ``root``; ``prefix`` + key in the checkpoint) into ``root``."""
    missing = [prefix + k for k in keys if prefix + k not in source.where]
    if missing:
        raise CorruptCheckpointError(f"the checkpoint has no tensor {missing[0]!r} ({len(missing)} missing) that "
                                     f"the model built from its config.json needs")
    for k in keys:
        set_tensor(root, k, source.read(prefix + k, dtype, device))


def check_source(model: nn.Module, source: Source) -> None:
    """Every tensor of the model is in the checkpoint with its shape (from the headers, before any work); a tied
    weight may be stored under one of its names only."""
    present: dict[int, str] = {}
    sd = model.state_dict(keep_vars=True)
    for k, t in sd.items():
        if t is not None and k in source.where:
            present[id(t)] = k
    for k, t in sd.items():
        if t is None:
            continue
        if k not in source.where:
            if id(t) in present:
                continue
            raise CorruptCheckpointError(f"the checkpoint has no tensor {k!r}, which the model built from its "
                                         f"config.json needs")
        shape = tuple(source.where[k].entries[k].shape)
        if shape != tuple(t.shape):
            raise CorruptCheckpointError(f"tensor {k!r} has shape {list(shape)} in the checkpoint; the model's "
                                         f"config gives {list(t.shape)}")
    extra = unexpected_keys(model, source.where)  # what transformers itself ignores on load is let through
    if extra:
        raise CorruptCheckpointError(f"tensor {extra[0]!r} in {source.where[extra[0]].path.name} is not a tensor of "
                                     f"the model its config.json describes"
                                     f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}")


def meta_keys(module: nn.Module) -> list[str]:
    return [k for k, t in module.state_dict(keep_vars=True).items() if t is not None and t.is_meta]


def _release_memory() -> None:
    """Hand the memory freed with a layer back to the OS. glibc's malloc serves blocks of the sizes it has seen
    freed from its heap afterwards (its mmap threshold grows), and a fragmented heap keeps them resident: without
    this the process grows by about half a layer per layer. No-op where glibc is absent."""
    import ctypes
    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols: glibc's on Linux
    except (OSError, TypeError):
        trim = None
    if trim is not None:
        trim(0)


def pin_mmap_threshold() -> None:
    """Keep glibc's mmap threshold at its initial 128 KiB (``mallopt(M_MMAP_THRESHOLD, ...)``) for this process: by
    default every free of a mapped block raises the threshold, after which blocks of that size (a layer's weights,
    GPTQ's per-block temporaries) come from the heap, fragment it, and stay resident; with the threshold pinned
    they are mapped and unmapped, so the process holds about one layer's working set. No-op where glibc is
    absent. Process-wide and harmless elsewhere (fresh processes start at this value)."""
    import ctypes
    try:
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    except (OSError, TypeError):
        mallopt = None
    if mallopt is not None:
        mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD


# ---------------------------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------------------------


def skeleton(src: pathlib.Path, dtype: Optional[torch.dtype]):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GenerationConfig

    read_config(src)  # malformed or too deeply nested JSON: one error naming the file
    hf_config = read_hf_config(src)
    if getattr(hf_config, "quantization_config", None) is not None:
        raise ValueError(f"{str(src)!r} is already a quantized checkpoint (its config.json has a "
                         f"quantization_config); quantize_checkpoint takes a float checkpoint")
    if dtype is None:
        dtype = getattr(hf_config, "dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.tie_weights()
    model.eval()
    gen = None
    if model.can_generate():  # as from_pretrained reads it: generation_config.json, else from config.json
        if (src / "generation_config.json").is_file():
            gen = GenerationConfig.from_pretrained(src, local_files_only=True)
        else:
            gen = GenerationConfig.from_pretrained(src, config_file_name="config.json", _from_model_config=True,
                                                   local_files_only=True)
    return model, dtype, gen


def stream_layers(model, source: Source, *, path: str, layers, by_layer: list, plans: list, outer_plans: list,
                  layer_of: dict, algos: tuple, static: list, data, dtype, device, spill, pack_method: str,
                  progress: bool, own: bool = False, work_dir=None, reduce=None) -> tuple:
    """The streamed pass (module docstring, steps 1-4) over the decoder layers ``layers`` (at ``path``) of the meta
    skeleton ``model``, reading each layer's tensors from ``source``: ``by_layer`` / ``layer_of`` / ``outer_plans``
    say which planned modules sit in which layer and which outside; ``algos`` run on each layer over the kept
    inputs of ``data``; ``static`` roles are calibrated; each layer's encoded tensors go to ``spill`` (None: a rank
    that writes nothing). Returns ``(records, layouts)``: the tensor records in the checkpoint layout (the layers'
    spilled, the others' read from the live modules) and each module's layout.
    ``work_dir``: the run's ``WorkDir`` (progress saved per layer); ``reduce``: the ranks' ``Distributed``."""
    family = family_or_none(model)

    runner = LayerRunner(model, path=path, layers=layers, device=device, progress=progress)
    # streams of layer inputs: the algorithms' (float modules outside the layers, as run_algorithms sees them)
    # and the calibration's (quantized weights, static roles observed, as calibrate sees them)
    alg_in = runner.capture(data) if algos else None
    outer = []
    for p in outer_plans:
        w = wrap(model.get_submodule(p.name), p.config, name=p.name, proj_weights=p.proj_weights)
        set_module(model, p.name, w)
        outer.append(w)
    cal_in = None
    tail: list = []
    if static:
        for w in outer:
            if w.static_roles():
                w.start_calibration()
        cal_in = runner.capture(data)
        for w in outer:
            if w.observers:
                if all(o.n > 0 for o in w.observers.values()):
                    w.finish_calibration()  # called before the first layer: calibrated by the capture
                else:
                    w.abort_calibration()
                    tail.append(w)
    records: list[TensorRecord] = []
    layouts: dict[str, str] = {}
    n = len(layers)
    streams = {"alg": alg_in, "cal": cal_in}

    read: dict = {}  # with a work directory: what each layer read of the source, per shard (its manifest entry)
    outside = source.record(list(source.digests)) if work_dir is not None else None  # read before the layers

    def step(i, meta_layer, _):
        prefix = f"{path}.{i}"
        work = copy.deepcopy(meta_layer)
        keys = meta_keys(work)
        load_tensors(work, prefix + ".", keys, source, dtype, device)
        if work_dir is not None:
            read[i] = source.record([f"{prefix}.{k}" for k in keys])
        for name, b in list(work.named_buffers()):
            if b is not None and b.device != device:
                set_tensor(work, name, b.to(device))
        layers[i] = work
        try:
            pinned: dict = {}
            if algos:
                run_layer(work, by_layer[i], streams["alg"], algos, prefix, pinned, reduce, family=family)
                streams["alg"] = forward_layer(work, streams["alg"], keep=True) if i + 1 < n else None
            mine = [p for p in plans if layer_of.get(p.name) == i]
            wrappers = []
            for p in mine:
                w = wrap(model.get_submodule(p.name), p.config, name=p.name, proj_weights=p.proj_weights)
                set_module(model, p.name, w)
                wrappers.append(w)
                if p.name in pinned:
                    w.commit(weight=pinned.pop(p.name))
            if static:
                obs = [w for w in wrappers if w.static_roles()]
                for w in obs:
                    w.start_calibration()
                try:
                    streams["cal"] = forward_layer(work, streams["cal"], keep=True)
                except BaseException:
                    for w in obs:
                        w.abort_calibration()
                    raise
                for w in obs:
                    w.finish_calibration()
            for w in wrappers:
                w.commit()
            if spill is not None:  # None: a distributed rank other than 0, which writes nothing
                recs, lay = plan_tensors(work, pack_method, own=own)
                for r in recs:
                    records.append(spill.add(r, f"{prefix}.{r.name}"))
                layouts.update({f"{prefix}.{k}": v for k, v in lay.items()})
        finally:
            layers[i] = meta_layer
            del work
        _release_memory()

    checkpoint = None
    if work_dir is not None:
        checkpoint = streaming_checkpoint(work_dir, spill, records, layouts, streams, device,
                                          meta=lambda i: {"layer": read.pop(i), "outside": outside})
    runner.run(step, desc="quantizing layer by layer", replay=False, checkpoint=checkpoint)
    if tail:
        _calibrate_tail(runner, tail, streams["cal"], data)
    for w in outer:
        w.commit()
    # the tensors outside the layers (read from the live modules when the shards are written)
    parent_name, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, nn.ModuleList())
    try:
        recs, lay = plan_tensors(model, pack_method, own=own)
    finally:
        setattr(parent, child, layers)
    records.extend(recs)
    layouts.update(lay)
    return records, layouts


def _calibrate_tail(runner: LayerRunner, tail: list, finals, data) -> None:
    """Static scales of the modules after the decoder layers: the model runs with its layers replaced by the
    kept final hidden states (``LayerRunner.run_from`` past the last layer)."""
    with calibrating(tail):
        for _ in runner.run_from(len(runner), data, inputs=finals, move=True, desc="calibrating the output modules"):
            pass

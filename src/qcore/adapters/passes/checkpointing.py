"""Work directories: a layer-by-layer run saves its progress after each decoder layer and resumes from there.

GPTQ / AWQ / SmoothQuant / AutoSmoothQuant (``quantize_model(..., work_dir=, resume=)``, through
``qcore.adapters.passes.sequential.run_algorithms``), the streamed checkpoint (``quantize_checkpoint(...,
work_dir=, resume=)``) and AMP's sensitivities (``layer_sensitivity(..., work_dir=, resume=)``) run decoder
layers one at a time (``qcore.adapters.passes.runner``). Given a work directory, after each layer ``i`` the run
writes there:

- ``layer-<i>.pt``: what the pass changed or produced for that layer: the layer's whole state (every parameter
  and buffer: the algorithms' weights and every scale folded into a norm or a neighbouring Linear of the layer;
  the folds of AWQ / SmoothQuant never leave the layer), GPTQ's QTensors of its modules and the float weights
  they started from (the report's reference); streaming: the layer's encoded checkpoint tensors and layouts;
- ``carry-<i>.pt``: what the next layer starts from: its kept inputs (streaming: both streams); only the two
  latest are kept (the latest, and the one before it in case the latest is found damaged), so the disk holds
  the layers' states plus two copies of one layer's inputs;
- ``manifest.json``: the run's fingerprint and, per completed layer, the files and their SHA-256. It is written
  last (temporary file, fsync, rename): a layer is complete when the manifest lists it.

AMP keeps one ``sensitivities.json`` (each (unit, scheme) loss measured so far, exact float round trip), rewritten
after each measurement, in the same manifest.

Resume (``resume=True``): the manifest's fingerprint must equal this run's: the model's weights (SHA-256 of every
state-dict tensor; streaming: the source's safetensors headers and file sizes, one entry per file), the config
(algorithms included), the calibration data (SHA-256 of every batch), the pass, the number of layers and qcore's
version; a difference raises ``ValueError`` naming what differs, before any work. Streaming, the tensors' bytes
are hashed as the pass reads them (``streaming.Source(hash=True)``): each layer's manifest entry records, per
shard, the SHA-256 of what it read and the shard's stat, and a resume checks them
(``jobs.checkpoint._check_resumed_source``: a shard whose stat changed is hashed again; a changed one is
refused naming it). The completed layers are then checked
(sizes and SHA-256); the run continues after the last layer whose files and inputs are intact (a damaged last
entry: one layer earlier), with "resuming at layer k of n" on the log and the progress bar. Every layer's
result is the one an uninterrupted run computes, bit for bit (the saved tensors are the bytes the run held).

Decisions: ``resume=True`` without a work directory is a ``ValueError``; with a work directory that does not
exist or holds no manifest, the run starts afresh (and says so on the log), so the same command can be repeated
until it finishes. Without ``resume`` a work directory that already holds a run is refused (``ValueError``:
resume it or choose another). A work directory that is, contains or lies inside the model's source or the
output is refused. The work directory is left in place after the run (delete it when done).

Tensors are saved with ``torch.save`` and read back with ``torch.load(weights_only=True)`` (tensors and plain
containers only; QTensors are stored as their arrays and their spec is recomputed from the config and compared).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import nn

import qcore
from qcore._fsutil import check_not_source, staged_file
from qcore._kquants import GGUFScales
from qcore.formats.safetensors_io import TensorRecord
from qcore.quantize import QTensor

from ..batches import to_device
from ..modules import experts_weight_spec, is_fused_experts, linear_weight, linear_weight_spec
from .runner import LayerInputs

_log = logging.getLogger("qcore.adapters")

__all__ = ["WorkDir", "LayerCheckpoint", "fingerprint", "digest_data", "digest_model", "digest_source",
           "digest_source_files", "check_work_args", "read_work_dir", "saved_run", "qtensor_state", "qtensor_from_state"]

MANIFEST = "manifest.json"
FORMAT = 1
_KEEP_CARRIES = 2


# ---------------------------------------------------------------------------------------------------------------
# digests
# ---------------------------------------------------------------------------------------------------------------


def _hash_tensor(h, t: torch.Tensor) -> None:
    t = t.detach()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        c = t.to("cpu").contiguous().reshape(-1)
        h.update(c.view(torch.uint8).numpy().tobytes() if c.dtype != torch.bool else c.numpy().tobytes())


def _hash_value(h, v: Any) -> None:
    if isinstance(v, torch.Tensor):
        _hash_tensor(h, v)
    elif isinstance(v, np.ndarray):
        _hash_tensor(h, torch.from_numpy(np.ascontiguousarray(v)))
    elif isinstance(v, Mapping):
        h.update(b"{")
        for k in v:
            h.update(repr(k).encode())
            _hash_value(h, v[k])
        h.update(b"}")
    elif isinstance(v, (list, tuple)):
        h.update(b"[")
        for x in v:
            _hash_value(h, x)
        h.update(b"]")
    else:
        h.update(repr(v).encode())


def digest_model(model: nn.Module) -> str:
    """SHA-256 of every state-dict tensor of ``model`` (names, dtypes, shapes, bytes)."""
    h = hashlib.sha256()
    for k, t in model.state_dict(keep_vars=True).items():
        if t is None:
            continue
        h.update(k.encode())
        if t.is_meta:
            h.update(f"meta{t.dtype}{tuple(t.shape)}".encode())
        else:
            _hash_tensor(h, t)
    return h.hexdigest()


def digest_source_files(directory: Union[str, os.PathLike]) -> dict:
    """``{file name: SHA-256}`` of a streamed checkpoint's ``config.json``, index and safetensors files, without
    reading their tensors: name, size and header (names, dtypes, shapes, offsets) of each safetensors file, the
    others whole. The tensors' bytes are hashed as the streamed pass reads them (``streaming.Source``): each
    saved layer records what it read, per shard, and a resume checks it."""
    d = pathlib.Path(directory)
    out = {}
    for f in sorted(d.iterdir()):
        if f.name == "config.json" or f.name.endswith(".safetensors") or f.name.endswith(".safetensors.index.json"):
            h = hashlib.sha256()
            h.update(f.name.encode())
            size = f.stat().st_size
            h.update(str(size).encode())
            with open(f, "rb") as fh:
                if f.name.endswith(".safetensors"):
                    head = fh.read(8)
                    n = int.from_bytes(head, "little") if len(head) == 8 else 0
                    h.update(head + fh.read(min(n, max(0, size - 8))))
                else:
                    h.update(fh.read())
            out[f.name] = h.hexdigest()
    return out


def digest_source(directory: Union[str, os.PathLike]) -> str:
    """One SHA-256 of ``digest_source_files`` (the checkpoint's files, headers and sizes)."""
    h = hashlib.sha256()
    for name, v in digest_source_files(directory).items():
        h.update(f"{name}\0{v}\0".encode())
    return h.hexdigest()


def digest_data(data: Optional[Sequence]) -> str:
    """SHA-256 of the calibration batches (every tensor's dtype, shape and bytes, in order)."""
    h = hashlib.sha256()
    _hash_value(h, list(data) if data is not None else None)
    return h.hexdigest()


def fingerprint(*, what: str, model: str, config: Any, data: Optional[Sequence], n_layers: int,
                extra: Optional[Mapping] = None) -> dict:
    """The fingerprint a work directory is tied to: ``what`` (the pass), ``model`` (a digest: ``digest_model``
    / ``digest_source``), ``config`` (JSON-able), the calibration ``data``, ``n_layers``, qcore's version."""
    cfg = json.dumps(config, sort_keys=True, default=repr)
    fp = {"pass": what, "model weights": model, "config": hashlib.sha256(cfg.encode()).hexdigest(),
          "calibration data": digest_data(data), "decoder layers": int(n_layers), "qcore version": qcore.__version__}
    for k, v in (extra or {}).items():
        fp[k] = v if isinstance(v, (str, int, float, bool)) or v is None else hashlib.sha256(
            json.dumps(v, sort_keys=True, default=repr).encode()).hexdigest()
    return fp


# ---------------------------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------------------------


def _fsync_dir(d: pathlib.Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: pathlib.Path, write: Callable[[Any], None]) -> None:
    """``write(file object)`` into a staged file beside ``path`` (``qcore._fsutil.staged_file``, the one staged
    writer), fsync, then it replaces ``path``; the directory is fsynced after the rename."""
    with staged_file(path, recheck=lambda: None) as tmp:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    _fsync_dir(path.parent)


def _sha256_file(path: pathlib.Path) -> Optional[str]:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


def check_work_args(work_dir: Any, resume: Any, *, sources: Sequence = (), names: Callable[[str], str] = str) -> \
        Optional[pathlib.Path]:
    """The checks of ``work_dir`` / ``resume`` made before any work: types, ``resume`` needs a work directory, a
    work directory that is, contains or lies inside one of ``sources`` (the model's source, the output) is
    refused. Returns the path (None without one)."""
    if not isinstance(resume, bool):
        raise TypeError(f"{names('resume')} must be a bool, got {resume!r}")
    if work_dir is None:
        if resume:
            raise ValueError(f"{names('resume')}: there is nothing to resume without {names('work_dir')} (the "
                             f"directory an earlier run saved its progress in)")
        return None
    if not isinstance(work_dir, (str, os.PathLike)) or not os.fspath(work_dir):
        raise TypeError(f"{names('work_dir')} must be a directory path (str or os.PathLike) or None, got "
                        f"{work_dir!r}")
    check_not_source(work_dir, [s for s in sources if s is not None], what=names("work_dir"))
    p = pathlib.Path(work_dir)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{names('work_dir')} {str(p)!r} exists and is not a directory")
    return p


def read_work_dir(path: Union[str, os.PathLike], *, name: str = "work_dir") -> Optional[dict]:
    """What the work directory ``path`` holds, read before any work: None when it does not exist, is empty (hidden
    entries aside) or holds the manifest of a run that saved nothing yet; the manifest (a dict) of a run that
    saved layers or measurements (``saved_run`` says what). ``ValueError`` naming ``name`` for a file, a folder
    that is not empty and holds no manifest (not a qcore work directory: a run never writes into someone's
    folder), or an unreadable manifest."""
    p = pathlib.Path(path)
    if not os.path.lexists(p):
        return None
    if not p.is_dir():
        raise ValueError(f"{name} {str(p)!r} exists and is not a directory")
    man = p / MANIFEST
    if not man.is_file():
        if any(not f.name.startswith(".") for f in p.iterdir()):
            raise ValueError(f"{name} {str(p)!r} is not empty and holds no qcore run ({MANIFEST} missing); choose "
                             f"an empty or new directory")
        return None
    try:
        m = json.loads(man.read_text())
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise ValueError("unknown format")
    except (ValueError, OSError) as e:
        raise ValueError(f"{name} {str(p)!r}: its {MANIFEST} is unreadable ({e}); delete the directory to start "
                         f"afresh") from None
    return m if m.get("entries") or m.get("extra") else None  # nothing saved yet (e.g. a check failed after the start)


def saved_run(manifest: Mapping) -> str:
    """What the run of a work directory's ``manifest`` (``read_work_dir``'s) saved: ``"3 layers"``,
    ``"12 measurements"``."""
    done = len(manifest.get("entries") or ())
    return f"{done} layers" if done else f"{len((manifest.get('extra') or {}).get('sensitivities', {}))} measurements"


class WorkDir:
    """A run's work directory (module docstring): its manifest, fingerprint check, per-layer entries."""

    def __init__(self, path: Union[str, os.PathLike], fp: dict, *, resume: bool = False, name: str = "work_dir"):
        self.path = pathlib.Path(path)
        self.fp = dict(fp)
        self.entries: list[dict] = []
        self.extra: dict = {}
        m = read_work_dir(self.path, name=name)
        if m is not None:
            if not resume:
                raise ValueError(f"{name} {str(self.path)!r} holds a run ({saved_run(m)} saved); resume it "
                                 f"(resume=True, --resume) or choose an empty directory")
            theirs = m.get("fingerprint", {})
            diff = [k for k in sorted(set(self.fp) | set(theirs)) if self.fp.get(k) != theirs.get(k)]
            if diff:
                shown = "; ".join(f"{k}: this run {self.fp.get(k)!r}, the work directory's {theirs.get(k)!r}"
                                  for k in diff)
                raise ValueError(f"{name} {str(self.path)!r} holds a different run ({', '.join(diff)} differ: "
                                 f"{shown}); resume with the same model, config and calibration data, or choose "
                                 f"another directory")
            self.entries = list(m.get("entries", []))
            self.extra = dict(m.get("extra", {}))
        else:
            if resume:
                _log.warning("%s %s holds no saved run: starting afresh", name, self.path)
            self.path.mkdir(parents=True, exist_ok=True)
            self._write_manifest()

    # -- the manifest -----------------------------------------------------------------------------------------

    def _write_manifest(self) -> None:
        body = json.dumps({"format": FORMAT, "fingerprint": self.fp, "entries": self.entries, "extra": self.extra},
                          indent=1, sort_keys=True).encode()
        _atomic_write(self.path / MANIFEST, lambda f: f.write(body))

    def _save_file(self, name: str, obj: Any) -> dict:
        path = self.path / name
        _atomic_write(path, lambda f: torch.save(obj, f))
        return {"file": name, "bytes": path.stat().st_size, "sha256": _sha256_file(path)}

    def _intact(self, rec: Optional[dict]) -> bool:
        if rec is None:
            return False
        p = self.path / rec["file"]
        return p.is_file() and p.stat().st_size == rec["bytes"] and _sha256_file(p) == rec["sha256"]

    def load(self, rec: dict) -> Any:
        with open(self.path / rec["file"], "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)

    # -- layers -----------------------------------------------------------------------------------------------

    def completed(self) -> int:
        """The number of leading layers whose files (and the last one's carry) are intact; entries past it
        (a damaged last entry) are dropped."""
        k = 0
        while k < len(self.entries) and self._intact(self.entries[k].get("layer")):
            k += 1
        while k > 0 and not self._intact(self.entries[k - 1].get("carry")):
            k -= 1  # the latest inputs damaged: the layer before (its carry is kept too)
        if k < len(self.entries):
            _log.warning("work_dir %s: layer entries %d..%d are damaged or incomplete; resuming after layer %d",
                         self.path, k, len(self.entries) - 1, k - 1)
            self.entries = self.entries[:k]
            self._write_manifest()
        return k

    def save_layer(self, i: int, state: Any, carry: Any, meta: Optional[dict] = None) -> None:
        """Layer ``i`` done: its state and the next layer's carry, then the manifest (the commit point); carries
        older than the two latest are deleted. ``meta``: small JSON kept in the layer's manifest entry (the
        streamed pass: what it read of the source, ``"source"``)."""
        if i != len(self.entries):
            raise RuntimeError(f"work_dir: layer {i} saved after {len(self.entries)} entries")
        entry = {"layer": self._save_file(f"layer-{i:05d}.pt", state),
                 "carry": self._save_file(f"carry-{i:05d}.pt", carry)}
        if meta is not None:
            entry["source"] = meta
        self.entries.append(entry)
        old = [e for e in self.entries[:-_KEEP_CARRIES] if e.get("carry") is not None]
        for e in old:
            e["carry"] = None
        self._write_manifest()
        for i_old, e in enumerate(self.entries[:-_KEEP_CARRIES]):
            p = self.path / f"carry-{i_old:05d}.pt"
            if p.exists():
                p.unlink()

    def set_extra(self, key: str, value: Any) -> None:
        """A small JSON value kept in the manifest (AMP's measurements so far)."""
        self.extra[key] = value
        self._write_manifest()


# ---------------------------------------------------------------------------------------------------------------
# the runner's hook
# ---------------------------------------------------------------------------------------------------------------


def _inputs_state(inputs) -> Any:
    if inputs is None:
        return None
    return {"args": [list(a) for a in inputs.args], "kwargs": list(inputs.kwargs), "tuple_out": inputs.tuple_out}


def _inputs_from(state) -> Any:
    if state is None:
        return None
    return LayerInputs([tuple(a) for a in state["args"]], list(state["kwargs"]), state["tuple_out"])


class LayerCheckpoint:
    """What ``LayerRunner.run(..., checkpoint=)`` calls: ``begin`` (restore the completed layers; the index to
    start at and the inputs kept for it) and ``done`` after each layer.

    work: the ``WorkDir``. state(i, layer) -> what to save for layer ``i`` (default: the layer's state dict);
    restore(i, layer, saved) puts it back (default: copied into the layer's tensors). carry() / set_carry(saved):
    a pass that keeps its own streams (``replay=False``); by default the runner's inputs are the carry.
    meta(i) -> small JSON for layer ``i``'s manifest entry (``WorkDir.save_layer``)."""

    def __init__(self, work: WorkDir, *, state: Optional[Callable] = None, restore: Optional[Callable] = None,
                 carry: Optional[Callable] = None, set_carry: Optional[Callable] = None,
                 meta: Optional[Callable] = None):
        self.work = work
        self.meta = meta
        self.state = state or (lambda i, layer: {"state": layer_state(layer)})
        self.restore = restore or (lambda i, layer, saved: restore_layer_state(layer, saved["state"]))
        self.carry, self.set_carry = carry, set_carry
        self.start = 0

    def begin(self, layers, inputs, n: int, *, device=None, float_inputs=None):
        """``(start, inputs, float_inputs)``: the first layer to run and its kept inputs (with the float stream,
        ``LayerRunner.run(..., float_inputs=)``, the float model's too; else ``float_inputs`` as given)."""
        k = self.work.completed()
        if k == 0:
            return 0, inputs, float_inputs
        if k > n:
            raise ValueError(f"work_dir {str(self.work.path)!r}: {k} layers saved, the model has {n}")
        _log.warning("resuming at layer %d of %d (work_dir %s)", k, n, self.work.path)
        for i in range(k):
            self.restore(i, layers[i], self.work.load(self.work.entries[i]["layer"]))
        saved = self.work.load(self.work.entries[k - 1]["carry"])
        if device is not None:
            saved = to_device(saved, device)
        self.start = k
        if self.set_carry is not None:
            self.set_carry(saved)
            return k, inputs, float_inputs
        if float_inputs is not None:
            if not (isinstance(saved, dict) and set(saved) == {"quantized", "float"}):
                raise ValueError(f"work_dir {str(self.work.path)!r}: the saved run kept one stream of layer inputs; "
                                 f"this one keeps the float model's too (start it in a new work directory)")
            return k, _inputs_from(saved["quantized"]), _inputs_from(saved["float"])
        return k, _inputs_from(saved), None

    def done(self, i: int, layer, inputs, float_inputs=None) -> None:
        if self.carry is not None:
            carry = self.carry()
        elif float_inputs is not None:
            carry = {"quantized": _inputs_state(inputs), "float": _inputs_state(float_inputs)}
        else:
            carry = _inputs_state(inputs)
        self.work.save_layer(i, self.state(i, layer), carry, None if self.meta is None else self.meta(i))


def layer_state(layer: nn.Module) -> dict:
    """Every parameter and buffer of ``layer`` (CPU copies, exact bytes)."""
    return {k: t.detach().to("cpu", copy=True) for k, t in layer.state_dict(keep_vars=True).items()
            if t is not None}


def restore_layer_state(layer: nn.Module, saved: Mapping) -> None:
    """Copy ``saved`` (``layer_state``'s) into the layer's tensors, which must match it name for name."""
    own = {k: t for k, t in layer.state_dict(keep_vars=True).items() if t is not None}
    if set(own) != set(saved):
        raise ValueError(f"work_dir: a saved layer holds tensors {sorted(set(saved) ^ set(own))[:4]} that the "
                         f"model's layer does not (or the reverse)")
    with torch.no_grad():
        for k, t in own.items():
            s = saved[k]
            if s.dtype != t.dtype or tuple(s.shape) != tuple(t.shape):
                raise ValueError(f"work_dir: saved tensor {k!r} is {s.dtype} {tuple(s.shape)}; the model's is "
                                 f"{t.dtype} {tuple(t.shape)}")
            t.copy_(s)


# ---------------------------------------------------------------------------------------------------------------
# QTensors
# ---------------------------------------------------------------------------------------------------------------

_QFIELDS = ("codes", "scales", "zero_points", "subblock_shifts", "tensor_scale")
_GGUF_FIELDS = ("offsets", "ss_d", "ss_dmin", "ss_scale_codes", "ss_min_codes")  # GGUF specs: offsets, super_scales


def _field(q, f):
    if f.startswith("ss_"):
        ss = getattr(q, "super_scales", None)
        return None if ss is None else getattr(ss, f[3:])
    return getattr(q, f, None)


def qtensor_state(q) -> dict:
    """A QTensor as plain tensors (numpy arrays marked) and its spec's repr (GGUF specs: with the offsets and the
    super-scales' fields)."""
    out: dict = {"spec": repr(q.spec), "numpy": []}
    for f in _QFIELDS + (_GGUF_FIELDS if getattr(q.spec, "gguf", "") else ()):
        v = _field(q, f)
        if isinstance(v, np.ndarray):
            out["numpy"].append(f)
            v = torch.from_numpy(np.array(v, copy=True))
        elif isinstance(v, torch.Tensor):
            v = v.detach().to("cpu", copy=True)
        out[f] = v
    return out


def qtensor_from_state(saved: Mapping, spec, device=None) -> Any:
    """The QTensor ``qtensor_state`` saved, with ``spec`` (recomputed from the config; must have the saved repr),
    its torch arrays on ``device`` (where the module's weight is)."""
    if repr(spec) != saved["spec"]:
        raise ValueError(f"work_dir: a saved QTensor has spec {saved['spec']}; this run's is {spec!r}")
    vals = {f: (saved[f].numpy() if f in saved["numpy"] and saved[f] is not None else
                saved[f] if saved[f] is None or device is None else saved[f].to(device))
            for f in _QFIELDS + _GGUF_FIELDS if f in saved}
    ss = None
    if "ss_d" in vals:
        ss = GGUFScales(vals["ss_d"], vals["ss_dmin"], vals["ss_scale_codes"], vals["ss_min_codes"])
    return QTensor(vals["codes"], vals["scales"], vals["zero_points"], spec, subblock_shifts=vals["subblock_shifts"],
                   tensor_scale=vals["tensor_scale"], offsets=vals.get("offsets"), super_scales=ss)


# ---------------------------------------------------------------------------------------------------------------
# the passes' checkpoints
# ---------------------------------------------------------------------------------------------------------------


def algorithms_checkpoint(work: WorkDir, path: str, by_layer: list, pinned: dict,
                          reference: Optional[dict]) -> LayerCheckpoint:
    """``run_algorithms``'s: per layer its state, GPTQ's QTensors of its modules (fused experts: per projection,
    per expert, None where rounded to nearest) and the reference weights (when the run keeps them)."""

    def mine(d: Optional[dict], i: int) -> dict:
        return {} if d is None else {k: v for k, v in d.items() if k.startswith(f"{path}.{i}.")}

    def state(i, layer):
        qs: dict = {}
        for k, q in mine(pinned, i).items():
            if isinstance(q, dict):  # fused experts
                qs[k] = {p: [None if x is None else qtensor_state(x) for x in v] for p, v in q.items()}
            else:
                qs[k] = qtensor_state(q)
        return {"state": layer_state(layer), "pinned": qs,
                "reference": {k: v.detach().to("cpu", copy=True) for k, v in mine(reference, i).items()}}

    def restore(i, layer, saved):
        restore_layer_state(layer, saved["state"])
        prefix = f"{path}.{i}."
        for full, q in saved["pinned"].items():
            rel = full[len(prefix):]
            m, plan = layer.get_submodule(rel), by_layer[i][rel]
            if is_fused_experts(m):
                pinned[full] = {p: [None if x is None else qtensor_from_state(
                    x, experts_weight_spec(m, plan.config, full, p), m._parameters[p].device) for x in v]
                    for p, v in q.items()}
            else:
                pinned[full] = qtensor_from_state(q, linear_weight_spec(m, plan, full), linear_weight(m).device)
        if reference is not None:
            reference.update(saved["reference"])

    return LayerCheckpoint(work, state=state, restore=restore)


def streaming_checkpoint(work: WorkDir, spill, records: list, layouts: dict, streams: dict,
                         device, meta: Optional[Callable] = None) -> LayerCheckpoint:
    """``quantize_checkpoint``'s: per layer its encoded tensors (the spill's records of that layer, exact bytes)
    and layouts; the carry is both streams of layer inputs (the algorithms' and the calibration's); ``meta(i)``:
    what layer ``i`` read of the source (per shard digests, kept in the manifest)."""
    seen = {"records": 0, "layouts": set()}

    def state(i, layer):
        spill.f.flush()
        new = records[seen["records"]:]
        seen["records"] = len(records)
        lay = {k: v for k, v in layouts.items() if k not in seen["layouts"]}
        seen["layouts"].update(lay)
        return {"records": [{"name": r.name, "dtype": r.dtype, "shape": list(r.shape),
                             "data": _bytes_tensor(r.produce())} for r in new],
                "layouts": lay}

    def restore(i, layer, saved):
        for r in saved["records"]:
            data = r["data"].numpy().tobytes()
            rec = TensorRecord(r["name"], r["dtype"], tuple(r["shape"]), lambda data=data: data)
            records.append(spill.add(rec, r["name"]))
        layouts.update(saved["layouts"])
        seen["records"] = len(records)
        seen["layouts"].update(saved["layouts"])

    def carry():
        return {k: _inputs_state(v) for k, v in streams.items()}

    def set_carry(saved):
        for k in streams:
            streams[k] = _inputs_from(to_device(saved.get(k), device))

    return LayerCheckpoint(work, state=state, restore=restore, carry=carry, set_carry=set_carry, meta=meta)


def _bytes_tensor(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)


class _AmpWork:
    """AMP's measurements so far, kept in the work directory's manifest (``set_extra``; exact float round trip)."""

    def __init__(self, work: WorkDir, jobs: list):
        self.work = work
        self.index = {(tuple(u), s): j for j, (u, s) in enumerate(jobs)}
        self.saved = {int(j): float(v) for j, v in work.extra.get("sensitivities", {}).items()}
        self.jobs = jobs

    def done(self) -> dict:
        out = {self.jobs[j]: v for j, v in self.saved.items() if 0 <= j < len(self.jobs)}
        if out:
            _log.warning("resuming at measurement %d of %d (work_dir %s)", len(out), len(self.jobs), self.work.path)
        return out

    def add(self, unit, scheme: str, value: float) -> None:
        self.saved[self.index[(tuple(unit), scheme)]] = float(value)
        self.work.set_extra("sensitivities", {str(j): v for j, v in sorted(self.saved.items())})


def amp_work(path: pathlib.Path, resume: bool, model: nn.Module, table: Mapping, batches, metric, exclude,
             units, jobs) -> _AmpWork:
    """``layer_sensitivity``'s work directory, tied to the model, the schemes, metric, exclusions, units and
    batches."""
    cfg = {"schemes": {n: (None if lc is None else lc.to_dict()) for n, lc in table.items()},
           "metric": metric.value, "exclude": None if exclude is None else list(exclude),
           "units": [list(u) for u in units]}
    fp = fingerprint(what="layer_sensitivity", model=digest_model(model), config=cfg, data=batches,
                     n_layers=len(jobs))
    return _AmpWork(WorkDir(path, fp, resume=resume), jobs)

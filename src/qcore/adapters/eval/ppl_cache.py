"""The on-disk cache of float models' perplexities: the baseline ``qcore quantize`` (``quantize_and_report``) and
``qcore eval`` measure is computed once per model, text and windows, and read back on later runs.

Where: ``$QCORE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/qcore``, else ``~/.cache/qcore``; entries are the JSON
files ``ppl/<key>.json`` under it (``cache_dir()``). Delete the folder to clear the cache; ``--no-cache``
(``cache=False``) bypasses it (neither reads nor writes).

The key (``key()``) is a sha256 over everything that changes the figure: a digest of the model's bytes (every
tensor of its ``state_dict``, with names, dtypes and shapes, plus its class and config: never the path or a file's
mtime, so a model re-saved elsewhere hits and a changed weight misses), the token ids (the text and the tokenizer),
``seq_len``, the windows, ``batch_size``, the device type and the loss computation's version. The digest reads
every weight once: about 0.1-0.3 s per 100M float32 parameters on a CPU (bench/results/SPEED_EVAL.md measures it),
against seconds per evaluation window.

An entry may also hold the float model's hidden states before its output head on those windows
(``store(..., hidden=)``, the ``FloatReference`` of ``qcore.adapters.eval.evaluate.float_reference`` that the KL
divergence and top-1 agreement are measured against): a float32 ``ppl/<key>.hidden.npy`` beside the JSON, whose
sha256 the JSON holds (SmolLM2, 20 windows of 512: 23.5 MB), read back by ``load_hidden``.

Entries are written atomically (``qcore._fsutil.staged_file``: a staged sibling, then a rename); an entry that cannot be
read, is not valid JSON or does not hold the key it is filed under is ignored with a warning (the figure is
computed again and the entry rewritten), never trusted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import warnings
from typing import Optional

import numpy as np
import torch

from qcore import _fsutil

__all__ = ["cache_dir", "model_digest", "key", "load", "load_hidden", "store", "ENV_VAR", "LOSS_VERSION"]

ENV_VAR = "QCORE_CACHE_DIR"
#: bumped when the perplexity computation changes its figures (an old entry then misses)
LOSS_VERSION = "ppl-1"


def cache_dir() -> pathlib.Path:
    """The cache folder: ``$QCORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/qcore``, else ``~/.cache/qcore``."""
    env = os.environ.get(ENV_VAR)
    if env:
        return pathlib.Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache") / "qcore"


def model_digest(model: torch.nn.Module) -> str:
    """sha256 hex digest of the model's bytes: its class, its config (``config.to_json_string()`` where it has
    one) and every ``state_dict`` tensor (name, dtype, shape, bytes; a tied tensor once per name, its bytes
    once)."""
    h = hashlib.sha256()
    h.update(f"{type(model).__module__}.{type(model).__qualname__}\n".encode())
    cfg = getattr(model, "config", None)
    to_json = getattr(cfg, "to_json_string", None)
    if callable(to_json):
        try:
            h.update(to_json(use_diff=False).encode())
        except TypeError:
            h.update(to_json().encode())
        h.update(str(getattr(cfg, "_attn_implementation", None)).encode())
    seen: dict = {}
    for name, t in model.state_dict(keep_vars=False).items():
        if not isinstance(t, torch.Tensor):
            h.update(f"{name}:{t!r}\n".encode())
            continue
        ident = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.device)
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        if t.data_ptr() and ident in seen:
            h.update(f"same as {seen[ident]}\n".encode())
            continue
        seen[ident] = name
        data = t.detach().cpu().contiguous().reshape(-1)
        if data.numel():
            h.update(memoryview(data.view(torch.uint8).numpy()))
    return h.hexdigest()


def key(model: torch.nn.Module, token_ids: torch.Tensor, *, seq_len: int, spans, batch_size: int,
        device) -> str:
    """The entry's key: sha256 of the model digest and everything else that changes the figure (module doc)."""
    tok = hashlib.sha256(token_ids.detach().cpu().to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
    parts = {"version": LOSS_VERSION, "model": model_digest(model), "tokens": tok, "n_tokens": int(token_ids.numel()),
             "seq_len": int(seq_len), "spans": [[int(a), int(b)] for a, b in spans], "batch_size": int(batch_size),
             "device": torch.device(device).type, "torch": torch.__version__.split("+")[0]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _entry(k: str) -> pathlib.Path:
    return cache_dir() / "ppl" / f"{k}.json"


def load(k: str) -> Optional[float]:
    """The cached perplexity under key ``k``, or None (absent; or unreadable/corrupt: warned about and ignored)."""
    path = _entry(k)
    if not path.exists():
        return None
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        value = entry["perplexity"]
        if entry.get("key") != k or not isinstance(value, (int, float)) or isinstance(value, bool) \
                or not (math.isfinite(value) and value >= 1.0):
            raise ValueError("it does not hold a perplexity for this key")
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        warnings.warn(f"perplexity cache: ignoring the corrupt entry {path} ({type(e).__name__}: {e}); "
                      f"computing the figure again", RuntimeWarning, stacklevel=3)
        return None
    return float(value)


def _hidden_entry(k: str) -> pathlib.Path:
    return cache_dir() / "ppl" / f"{k}.hidden.npy"


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_hidden(k: str, *, shape: tuple) -> Optional[np.ndarray]:
    """The hidden states stored under key ``k`` (a float32 array of ``shape``: windows, predictions, hidden), or
    None: absent, or not what the entry's JSON names (its sha256, its shape), warned about and ignored."""
    path, hidden = _entry(k), _hidden_entry(k)
    if not path.exists() or not hidden.exists():
        return None
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        meta = entry.get("hidden") if isinstance(entry, dict) else None
        if meta is None and isinstance(entry, dict) and entry.get("key") == k:
            return None  # an entry of the perplexity alone: a miss
        if entry.get("key") != k or not isinstance(meta, dict) or meta.get("sha256") != _sha256(hidden):
            raise ValueError("its hidden states are not the ones the entry names")
        arr = np.load(hidden, allow_pickle=False)
        if arr.dtype != np.float32 or tuple(arr.shape) != tuple(shape):
            raise ValueError(f"hidden states {arr.dtype} {tuple(arr.shape)}, expected float32 {tuple(shape)}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        warnings.warn(f"perplexity cache: ignoring the hidden states of {path} ({type(e).__name__}: {e}); "
                      f"computing them again", RuntimeWarning, stacklevel=3)
        return None
    return arr


def store(k: str, value: float, *, hidden: Optional[np.ndarray] = None) -> None:
    """Write ``value`` under key ``k`` atomically (``qcore._fsutil.staged_file``: a staged sibling renamed into
    place; NaN / inf figures are not cached); ``hidden`` (a float32 array): the float model's hidden states before
    its head, written first, beside the JSON, which names their sha256. A cache folder that cannot be written is
    warned about, never fatal: the figure was computed."""
    if not math.isfinite(value):
        return
    path = _entry(k)
    entry: dict = {"key": k, "perplexity": float(value), "version": LOSS_VERSION}
    try:
        if hidden is not None:
            target = _hidden_entry(k)
            with _fsutil.staged_file(target, recheck=lambda: None) as tmp:
                with open(tmp, "wb") as f:
                    np.save(f, np.ascontiguousarray(hidden, dtype=np.float32), allow_pickle=False)
            entry["hidden"] = {"file": target.name, "sha256": _sha256(target), "shape": list(hidden.shape)}
        with _fsutil.staged_file(path, recheck=lambda: None) as tmp:
            tmp.write_text(json.dumps(entry), encoding="utf-8")
    except OSError as e:
        warnings.warn(f"perplexity cache: could not write {path} ({e}); the figure is not cached", RuntimeWarning,
                      stacklevel=3)

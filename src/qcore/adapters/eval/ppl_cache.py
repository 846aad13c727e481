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

import torch

from qcore import _fsutil

__all__ = ["cache_dir", "model_digest", "key", "load", "store", "ENV_VAR", "LOSS_VERSION"]

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


def store(k: str, value: float) -> None:
    """Write ``value`` under key ``k`` atomically (``qcore._fsutil.staged_file``: a staged sibling renamed into
    place; NaN / inf figures are not cached). A cache folder that cannot be written is warned about, never fatal:
    the figure was computed."""
    if not math.isfinite(value):
        return
    path = _entry(k)
    try:
        with _fsutil.staged_file(path, recheck=lambda: None) as tmp:
            tmp.write_text(json.dumps({"key": k, "perplexity": float(value), "version": LOSS_VERSION}),
                           encoding="utf-8")
    except OSError as e:
        warnings.warn(f"perplexity cache: could not write {path} ({e}); the figure is not cached", RuntimeWarning,
                      stacklevel=3)

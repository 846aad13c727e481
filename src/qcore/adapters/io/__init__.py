"""File formats for torch models: one module per format, export and import together, mirroring
``qcore.formats`` (Quark HF, GGUF, compressed-tensors, ONNX); ``formats`` (the table of formats) and ``common``
(what every writer and loader shares). Converting between them is a job (``qcore.adapters.jobs.convert``).

``from_pretrained(directory)``: any quantized HF checkpoint qcore reads, by its ``quant_method``: ``"quark"`` /
``"qcore"`` (``quark_hf.from_pretrained``) or ``"compressed-tensors"`` (``compressed_tensors.load_compressed_tensors``,
which takes ``dtype`` only). It is ``qcore.adapters.from_pretrained``.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from .common import read_config
from .compressed_tensors import load_compressed_tensors
from .quark_hf import from_pretrained as quark_from_pretrained

__all__ = ["from_pretrained"]


def from_pretrained(directory, *, dtype: Any = None, device_map: Any = None, **kwargs):
    """Load a quantized checkpoint from a local directory into qcore's frozen modules, by its ``quant_method``
    (module docstring); the arguments as ``quark_hf.from_pretrained``'s."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"from_pretrained: directory must be a str or os.PathLike, got {type(directory).__name__}")
    d = pathlib.Path(directory)
    _, raw = read_config(d)
    if isinstance(raw, dict) and raw.get("quant_method") == "compressed-tensors":
        if device_map is not None or kwargs:
            extra = sorted(kwargs) + (["device_map"] if device_map is not None else [])
            raise TypeError(f"from_pretrained: a compressed-tensors checkpoint loads through "
                            f"qcore.adapters.io.compressed_tensors.load_compressed_tensors, which takes dtype only; "
                            f"got {extra}")
        return load_compressed_tensors(d, dtype=dtype)
    return quark_from_pretrained(d, dtype=dtype, device_map=device_map, **kwargs)

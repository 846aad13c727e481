"""llama.cpp's own quantizer as an oracle: ``ggml_quantize_chunk`` from ``libggml-base`` through ctypes.

``ggml_library()`` finds the shared library (``$QCORE_GGML_LIB``, else the one llama-cpp-python ships, found
without importing ``llama_cpp``) and returns None when there is none, so tests can skip. ``ggml_quantize(x,
type_name, imatrix=None)`` runs llama.cpp's quantizer on a float32 (rows, n_per_row) array and returns the
GGUF bytes, (rows, row_size) uint8: the exact bytes llama.cpp writes into a GGUF file for that tensor (with
``imatrix``, the per-column importance weights of length n_per_row, llama.cpp's ``quant_weights`` path).

Type ids are ``gguf.GGMLQuantizationType``'s (the ggml_type enum); the few this module needs are listed in
``GGML_TYPES`` so that gguf-py is not required. numpy + ctypes only.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path
from typing import Optional

import numpy as np

__all__ = ["GGML_TYPES", "ggml_library", "ggml_quantize", "ggml_row_size", "llama_cpp_logits"]

# ggml_type enum values (ggml.h; the same numbers as gguf.GGMLQuantizationType).
GGML_TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q2_k": 10, "q3_k": 11, "q4_k": 12,
              "q5_k": 13, "q6_k": 14, "iq4_nl": 20}

_LIB: list = []


def _candidates():
    env = os.environ.get("QCORE_GGML_LIB")
    if env:
        yield Path(env)
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            yield Path(loc) / "lib" / "libggml-base.so"


def ggml_library() -> Optional[ctypes.CDLL]:
    """The loaded ``libggml-base`` (cached), or None when it is not installed."""
    if _LIB:
        return _LIB[0]
    lib = None
    for p in _candidates():
        if p.is_file():
            try:
                lib = ctypes.CDLL(str(p))
            except OSError:
                continue
            lib.ggml_quantize_chunk.restype = ctypes.c_size_t
            lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
            lib.ggml_row_size.restype = ctypes.c_size_t
            lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
            break
    _LIB.append(lib)
    return lib


def _type_id(type_name: str) -> int:
    key = str(type_name).lower()
    if key not in GGML_TYPES:
        raise ValueError(f"type_name must be one of {sorted(GGML_TYPES)}, got {type_name!r}")
    return GGML_TYPES[key]


def ggml_row_size(type_name: str, n_per_row: int) -> int:
    """Bytes of one row of ``n_per_row`` elements in llama.cpp's layout (``ggml_row_size``)."""
    lib = ggml_library()
    if lib is None:
        raise RuntimeError("libggml-base is not available (install llama-cpp-python or set QCORE_GGML_LIB)")
    return int(lib.ggml_row_size(_type_id(type_name), int(n_per_row)))


def ggml_quantize(x, type_name: str, imatrix=None) -> np.ndarray:
    """llama.cpp's bytes for float32 ``x`` of shape (rows, n_per_row) (1-D: one row) -> uint8 (rows, row_size).

    ``imatrix``: None or the importance weights of the columns, shape (n_per_row,) (llama.cpp's quant_weights).
    """
    lib = ggml_library()
    if lib is None:
        raise RuntimeError("libggml-base is not available (install llama-cpp-python or set QCORE_GGML_LIB)")
    tid = _type_id(type_name)
    a = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise ValueError(f"x must be 1-D or 2-D (rows, n_per_row), got shape {a.shape}")
    rows, n = a.shape
    size = int(lib.ggml_row_size(tid, n))
    out = np.zeros((rows, size), dtype=np.uint8)
    qw = None
    if imatrix is not None:
        qw = np.ascontiguousarray(np.asarray(imatrix, dtype=np.float32))
        if qw.shape != (n,):
            raise ValueError(f"imatrix must have shape ({n},), got {qw.shape}")
    got = lib.ggml_quantize_chunk(tid, a.ctypes.data, out.ctypes.data, 0, rows, n,
                                  None if qw is None else qw.ctypes.data)
    if int(got) != rows * size:
        raise RuntimeError(f"ggml_quantize_chunk wrote {got} bytes, expected {rows * size}")
    return out


def llama_cpp_logits(path, ids, *, n_ctx: int = 64, threads: int = 1) -> np.ndarray:
    """llama.cpp's float32 logits ``(len(ids), n_vocab)`` of the token ids ``ids`` (a list of ints) for the GGUF file
    ``path``: ``llama_cpp.Llama(..., logits_all=True).eval(ids)``, the model closed after. Needs llama-cpp-python
    (ImportError otherwise; tests skip on ``pytest.importorskip("llama_cpp")`` first)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=n_ctx, n_threads=threads, verbose=False)
    try:
        llm.eval(list(ids))
        return np.array(llm.scores[:llm.n_tokens])
    finally:
        llm.close()

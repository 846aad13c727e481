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
import time
from pathlib import Path
from typing import Optional

import numpy as np

__all__ = ["GGML_TYPES", "ggml_library", "ggml_quantize", "ggml_row_size", "llama_cpp_logits", "ggml_cpu_library",
           "ggml_from_float", "ggml_vec_dot_type"]

# ggml_type enum values (ggml.h; the same numbers as gguf.GGMLQuantizationType).
GGML_TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q2_k": 10, "q3_k": 11, "q4_k": 12,
              "q5_k": 13, "q6_k": 14, "iq4_nl": 20}

_LIB: list = []
_CPU: list = []


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


def ggml_cpu_library() -> Optional[ctypes.CDLL]:
    """The loaded ``libggml-cpu`` beside ``libggml-base`` (cached, ``ggml_cpu_init`` called), or None: the CPU
    backend's own activation quantizers (``quantize_row_q8_0`` / ``_q8_1`` / ``_q8_K``, what llama.cpp runs)."""
    if _CPU:
        return _CPU[0]
    lib = None
    base = ggml_library()
    path = getattr(base, "_name", None)
    if base is not None and path:
        p = Path(path).with_name("libggml-cpu.so")
        if p.is_file():
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)  # its symbols for libggml-cpu
                lib = ctypes.CDLL(str(p))
            except OSError:
                lib = None
    if lib is not None:
        lib.ggml_cpu_init.restype = None
        lib.ggml_cpu_init()
        for fn in ("quantize_row_q8_0", "quantize_row_q8_1", "quantize_row_q8_K"):
            getattr(lib, fn).restype = None
            getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TypeTraitsCPU)
        lib.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    _CPU.append(lib)
    return lib


class _TypeTraitsCPU(ctypes.Structure):  # ggml-cpu.h struct ggml_type_traits_cpu
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


# block bytes of the activation types: (elements per block, bytes per block)
_ACT_BLOCKS = {"q8_0": (32, 34), "q8_1": (32, 36), "q8_K": (256, 292)}


def ggml_from_float(x, type_name: str) -> np.ndarray:
    """llama.cpp's CPU conversion of float32 activations ``x`` (rows, n) to ``type_name`` (``q8_0``, ``q8_1``,
    ``q8_K``): ``quantize_row_<type>`` of libggml-cpu per row -> uint8 (rows, n / block, block bytes)."""
    lib = ggml_cpu_library()
    if lib is None:
        raise RuntimeError("libggml-cpu is not available (install llama-cpp-python or set QCORE_GGML_LIB)")
    key = {k.lower(): k for k in _ACT_BLOCKS}.get(str(type_name).lower())
    if key is None:
        raise ValueError(f"type_name must be one of {sorted(_ACT_BLOCKS)}, got {type_name!r}")
    qk, size = _ACT_BLOCKS[key]
    a = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.shape[1] % qk:
        raise ValueError(f"x must be (rows, n) with n a multiple of {qk}, got shape {a.shape}")
    out = np.zeros((a.shape[0], a.shape[1] // qk, size), dtype=np.uint8)
    fn = getattr(lib, f"quantize_row_{key}")
    for r in range(a.shape[0]):
        fn(a[r].ctypes.data, out[r].ctypes.data, a.shape[1])
    return out


def ggml_vec_dot_type(type_id: int) -> int:
    """ggml-cpu's ``vec_dot_type`` (a ggml_type id) of the weight type ``type_id``."""
    lib = ggml_cpu_library()
    if lib is None:
        raise RuntimeError("libggml-cpu is not available (install llama-cpp-python or set QCORE_GGML_LIB)")
    return int(lib.ggml_get_type_traits_cpu(int(type_id)).contents.vec_dot_type)


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


def llama_cpp_nll(path, ids, spans, *, threads: int = 1) -> tuple:
    """``(summed negative log-likelihood, predictions, seconds evaluating)`` of llama.cpp for the GGUF file ``path`` on the token windows
    ``spans`` (``(start, stop)`` pairs of equal length) of ``ids`` (a 1-D sequence of ints): each window evaluated
    from an empty context (``Llama.reset`` then ``eval``), log-softmax in float64. Perplexity is
    ``qcore.algorithms.metrics.perplexity_from_nll`` of it. Needs llama-cpp-python."""
    import llama_cpp

    seq = spans[0][1] - spans[0][0]
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=seq, n_batch=seq, n_threads=threads,
                          verbose=False)
    nll, n = 0.0, 0
    t = time.perf_counter()  # the windows' evaluation, the model's loading apart
    try:
        for a, b in spans:
            toks = [int(t) for t in ids[a:b]]
            llm.reset()
            llm.eval(toks)
            logits = np.asarray(llm.scores[:len(toks)], np.float64)[:-1]
            mx = logits.max(axis=-1, keepdims=True)
            lse = mx[:, 0] + np.log(np.exp(logits - mx).sum(axis=-1))
            nll += float(np.sum(lse - logits[np.arange(len(toks) - 1), toks[1:]]))
            n += len(toks) - 1
    finally:
        llm.close()
    return nll, n, time.perf_counter() - t

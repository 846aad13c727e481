"""``qcore.adapters.triton``: Triton kernels, each the twin of a pure ``qcore`` function (bit for bit).

Importing this package imports neither triton nor the kernels; they load on the first kernel call. A user never
has to call anything here: the adapters (``qcore.adapters.modules``) ask ``available(tensor)`` and use a kernel
when the tensor is on a GPU (CUDA or ROCm) with Triton installed and the spec is covered (``supports``), else the
core. docs/kernels.md is the guide.

- ``available(x, force=None)``: whether kernels run for tensor ``x``. Environment variable ``QCORE_TRITON``:
  ``0`` never, ``1`` always where Triton can run (a GPU tensor, or a CPU tensor under ``TRITON_INTERPRET=1``,
  Triton's CPU interpreter, as the tests do), unset: GPU tensors. ``force=`` overrides the variable.
- ``supports(spec, ndim=...)`` / ``why_not(spec, ...)``: whether the quantize kernels cover a spec (and why not).
- ``fake_quantize``, ``quantize``, ``dequantize``: the twins of ``qcore.fake_quantize`` / ``quantize`` /
  ``dequantize`` (same arguments; ValueError for a spec the kernels do not cover).
- ``quantize_packed``: codes packed as ``qcore.packing.pack`` (fp4 two per byte, fp6 four in three bytes, int4
  two per byte) plus scale codes (E8M0 / e4m3 bytes) written by the quantize kernel itself.
- ``dequantize_w4`` / ``linear_w4``: int4/uint4 per-group and MXFP4 packed weights: the dequantized weight, and
  the fused dequantize-matmul ``x @ W.T (+ bias)`` with float32 accumulation.
- ``fwht``: the twin of ``qcore.algorithms.hadamard.fwht`` (float32; sizes ``m * 2**k`` of its constructions).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, Optional

from . import _specs

__all__ = ["available", "supports", "why_not", "fake_quantize", "quantize", "dequantize", "quantize_packed",
           "dequantize_w4", "linear_w4", "w4_format", "fwht", "ENV"]

ENV = "QCORE_TRITON"


@functools.lru_cache(maxsize=1)
def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked installation
        return False


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(x: Any = None, *, force: Optional[bool] = None) -> bool:
    """Whether the kernels run for tensor ``x``: a torch tensor on a GPU (CUDA/ROCm) or, when forced, on the CPU
    under Triton's interpreter (``TRITON_INTERPRET=1``); Triton importable. ``force``: True / False overrides
    the ``QCORE_TRITON`` environment variable (``1``: force, ``0``: never, unset: GPU tensors only)."""
    if force is not None and not isinstance(force, bool):
        raise TypeError(f"force must be True, False or None, got {force!r}")
    if force is None:
        env = os.environ.get(ENV, "")
        if env not in ("", "0", "1"):
            raise ValueError(f"{ENV}={env!r}: expected 0 (never), 1 (force) or unset (GPU tensors)")
        force = {"": None, "0": False, "1": True}[env]
    if force is False or x is None or type(x).__module__.split(".")[0] != "torch" or not hasattr(x, "device"):
        return False
    dev = x.device.type
    if dev == "cuda":  # ROCm tensors are "cuda" tensors too
        return _triton_installed()
    if dev == "cpu" and force:
        return _triton_installed() and _interpreter_on()
    return False


def why_not(spec: Any, *, ndim: Optional[int] = None, given_scale: bool = False) -> Optional[str]:
    """None when the quantize kernels cover ``spec`` (a QuantSpec or format name) for inputs of ``ndim``
    dimensions, else the reason (a sentence). Covered: nearest-even rounding; float elements that are signed
    with subnormals, up to 8 bits (fp8 e4m3fn/e4m3fnuz/e5m2/e5m2fnuz, fp6, fp4), saturating; integer elements up
    to 8 bits (symmetric, narrow, unsigned, zero points); PerTensor, PerChannel (any axis) and PerGroup along the
    last axis (ragged last group included) with float32 scales; power-of-two scales (E8M0: MXFP8/MXFP6/MXFP4)
    with FLOOR, CEIL or EVEN; two-level scales (NVFP4) with a narrow float block-scale format."""
    return _specs.why_not(spec, ndim=ndim, given_scale=given_scale)


def supports(spec: Any, *, ndim: Optional[int] = None, given_scale: bool = False) -> bool:
    """``why_not(spec, ...) is None``."""
    return why_not(spec, ndim=ndim, given_scale=given_scale) is None


def fake_quantize(x, spec, **kw):
    """The kernel twin of ``qcore.fake_quantize(x, spec, ...)`` (keywords: ``axis``, ``scale``, ``zero_point``,
    ``tensor_scale`` and QuantSpec overrides). float32 out, like the core."""
    from ._launch import fake_quantize as f

    return f(x, spec, **kw)


def quantize(x, spec, **kw):
    """The kernel twin of ``qcore.quantize``: a ``qcore.QTensor`` (codes, float32 scales, zero points, tensor
    scale) on x's device."""
    from ._launch import quantize as f

    return f(x, spec, **kw)


def dequantize(q):
    """The kernel twin of ``qcore.dequantize(q)`` (validated the same way, float32 out)."""
    from ._launch import dequantize as f

    return f(q)


def quantize_packed(x, spec, **kw):
    """``(packed codes, scale codes, QTensor without codes)`` from one kernel pass: codes packed along the last axis
    as ``qcore.packing.pack(codes, spec.dtype, axis=-1)``; scale codes as ``QTensor.scale_codes``. Per-group specs
    along the last axis with computed scales only (MX, NVFP4, int per group)."""
    from ._launch import quantize_packed as f

    return f(x, spec, **kw)


def w4_format(spec: Any) -> Optional[str]:
    """``"int4"``, ``"uint4"`` or ``"mxfp4"`` when a weight spec's frozen layout is one the fused matmul reads
    (int4 / uint4 per group along the input axis with float32 scales, symmetric or with zero points; fp4 e2m1
    under E8M0 scales, any scale rule), else None."""
    return _specs.w4_format(spec)


def dequantize_w4(packed, scales, zero_points=None, *, spec, k: int):
    """The float32 weight ``[N, k]`` the fused matmul sees, from packed 4-bit codes ``[N, ceil(k/2)]`` (uint8),
    scales ``[N, groups]`` (float32, or E8M0 bytes for MXFP4) and zero points (uint4). Equals
    ``qcore.dequantize`` of the same QTensor bit for bit."""
    from ._launch import dequantize_w4 as f

    return f(packed, scales, zero_points, spec=spec, k=k)


def linear_w4(x, packed, scales, zero_points=None, bias=None, *, spec, k: int):
    """``x @ W.T + bias`` with ``W = dequantize_w4(...)`` cast to x's dtype, fused (W never materialised),
    float32 accumulation; x bfloat16 / float16 / float32 of shape ``[..., k]``."""
    from ._launch import linear_w4 as f

    return f(x, packed, scales, zero_points, bias, spec=spec, k=k)


def fwht(x, *, axis: int = -1):
    """The kernel twin of ``qcore.algorithms.hadamard.fwht`` for float32/bfloat16/float16 tensors (float32 out)."""
    from ._launch import fwht as f

    return f(x, axis=axis)

"""The few array operations qcore needs, for numpy arrays and torch tensors.

qcore's numerics are written once against this small shim. ``ops(x)`` returns the namespace for ``x``'s array
kind; every function here takes and returns arrays of that kind, on the input's device. torch is never
imported unless a torch tensor is passed in (a tensor can only exist once torch is in ``sys.modules``), so numpy
users never pay for it.

Only the operations whose spelling differs between numpy and torch live here (bit casts, dtype conversion,
reductions over several axes, padding, device-aware constants). Operators (``+ - * / >> & |``, comparisons,
indexing) are used directly on arrays.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import numpy as np

__all__ = ["ops", "is_torch", "to_array", "NumpyOps", "TorchOps"]


def is_torch(x: Any) -> bool:
    """True for a torch.Tensor or any subclass of it (``nn.Parameter``, user subclasses), decided without
    importing torch: if torch is not imported yet, ``x`` cannot be a tensor."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def np_view(p):
    """A torch tensor as a numpy array (no copy for a CPU tensor; a tensor on an accelerator is copied to the host:
    parameters are small); anything else as it is."""
    if p is not None and is_torch(p):
        p = p.detach()
        if p.device.type != "cpu":
            p = p.cpu()
        return (p.float() if p.dtype == p.new_empty(()).bfloat16().dtype else p).numpy()
    return p


def _c(a, dtype) -> bool:
    """True if ``a`` is a C-contiguous numpy array of ``dtype`` (so a bit view needs no copy)."""
    return isinstance(a, np.ndarray) and a.dtype == dtype and a.flags.c_contiguous


class NumpyOps:
    """numpy spelling of the shim (the oracle path)."""

    name = "numpy"
    float32 = np.float32
    int32 = np.int32
    int64 = np.int64
    uint8 = np.uint8
    int8 = np.int8
    bool_ = np.bool_

    # -- conversion -------------------------------------------------------------------------------------------
    @staticmethod
    def astype(x, dtype):
        return np.asarray(x).astype(dtype, copy=False)

    @staticmethod
    def bits_of_f32(x):
        """float32 -> int32 with the same bits (0-d arrays stay 0-d)."""
        return np.asarray(x, dtype=np.float32).copy(order="C").view(np.int32) if not _c(x, np.float32) \
            else np.asarray(x).view(np.int32)

    @staticmethod
    def f32_of_bits(i):
        """int32 -> float32 with the same bits."""
        return np.asarray(i, dtype=np.int32).copy(order="C").view(np.float32) if not _c(i, np.int32) \
            else np.asarray(i).view(np.float32)

    @staticmethod
    def full(shape, value, dtype, like):
        return np.full(shape, value, dtype=dtype)

    @staticmethod
    def asarray(value, dtype, like):
        return np.asarray(value, dtype=dtype)

    @staticmethod
    def arange(n, dtype, like):
        return np.arange(n, dtype=dtype)

    # -- elementwise ------------------------------------------------------------------------------------------
    where = staticmethod(np.where)
    abs = staticmethod(np.abs)
    floor = staticmethod(np.floor)
    ceil = staticmethod(np.ceil)
    trunc = staticmethod(np.trunc)
    rint = staticmethod(np.rint)
    isnan = staticmethod(np.isnan)
    isinf = staticmethod(np.isinf)
    isfinite = staticmethod(np.isfinite)
    maximum = staticmethod(np.maximum)
    minimum = staticmethod(np.minimum)
    logical_and = staticmethod(np.logical_and)
    logical_or = staticmethod(np.logical_or)
    logical_not = staticmethod(np.logical_not)

    @staticmethod
    def clip(x, lo, hi):
        return np.clip(x, lo, hi)

    # -- shape ------------------------------------------------------------------------------------------------
    @staticmethod
    def reshape(x, shape):
        return np.reshape(x, shape)

    @staticmethod
    def moveaxis(x, src, dst):
        return np.moveaxis(x, src, dst)

    @staticmethod
    def pad_axis(x, axis, after, value=0):
        """Pad ``after`` elements of ``value`` at the end of ``axis``."""
        if after == 0:
            return x
        width = [(0, 0)] * x.ndim
        width[axis] = (0, after)
        return np.pad(x, width, constant_values=value)

    @staticmethod
    def slice_axis(x, axis, n):
        """The first ``n`` entries along ``axis``."""
        idx = [slice(None)] * x.ndim
        idx[axis] = slice(0, n)
        return x[tuple(idx)]

    @staticmethod
    def slice_index(x, axis, j):
        """``x`` indexed at ``j:j+1`` along ``axis`` (the axis is kept, with length 1)."""
        idx = [slice(None)] * x.ndim
        idx[axis] = slice(j, j + 1)
        return x[tuple(idx)]

    @staticmethod
    def broadcast_to(x, shape):
        return np.broadcast_to(x, shape)

    # -- reductions -------------------------------------------------------------------------------------------
    @staticmethod
    def amax(x, axis, keepdims=True):
        return np.max(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def amin(x, axis, keepdims=True):
        return np.min(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def sum(x, axis, keepdims=True):
        return np.sum(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def any(x):
        return bool(np.any(x))

    @staticmethod
    def quiet():
        """Silence numpy's overflow/invalid warnings where Inf/NaN are intended and handled."""
        return np.errstate(all="ignore")

    @staticmethod
    def from_numpy(a, like):
        return np.asarray(a)


class TorchOps:
    """torch spelling of the shim (the fast path; CPU or any device torch supports)."""

    name = "torch"

    def __init__(self, torch):
        self.t = torch
        self.float32 = torch.float32
        self.int32 = torch.int32
        self.int64 = torch.int64
        self.uint8 = torch.uint8
        self.int8 = torch.int8
        self.bool_ = torch.bool
        t = torch
        self.where = t.where
        self.abs = t.abs
        self.floor = t.floor
        self.ceil = t.ceil
        self.trunc = t.trunc
        self.rint = t.round  # round half to even, like np.rint
        self.isnan = t.isnan
        self.isinf = t.isinf
        self.isfinite = t.isfinite
        self.logical_and = t.logical_and
        self.logical_or = t.logical_or
        self.logical_not = t.logical_not

    def astype(self, x, dtype):
        return x.to(dtype)

    def bits_of_f32(self, x):
        return x.to(self.t.float32).contiguous().view(self.t.int32)

    def f32_of_bits(self, i):
        return i.to(self.t.int32).contiguous().view(self.t.float32)

    def full(self, shape, value, dtype, like):
        return self.t.full(tuple(shape), value, dtype=dtype, device=like.device)

    def asarray(self, value, dtype, like):
        if isinstance(value, self.t.Tensor):
            return value.to(device=like.device, dtype=dtype)
        return self.t.as_tensor(np.asarray(value), dtype=dtype, device=like.device)

    def arange(self, n, dtype, like):
        return self.t.arange(n, dtype=dtype, device=like.device)

    def maximum(self, a, b):
        if not isinstance(b, self.t.Tensor):
            return self.t.clamp(a, min=b)
        if not isinstance(a, self.t.Tensor):
            return self.t.clamp(b, min=a)
        return self.t.maximum(a, b)

    def minimum(self, a, b):
        if not isinstance(b, self.t.Tensor):
            return self.t.clamp(a, max=b)
        if not isinstance(a, self.t.Tensor):
            return self.t.clamp(b, max=a)
        return self.t.minimum(a, b)

    def clip(self, x, lo, hi):
        return self.t.clamp(x, lo, hi)

    def reshape(self, x, shape):
        return x.reshape(tuple(shape))

    def moveaxis(self, x, src, dst):
        return self.t.movedim(x, src, dst)

    def pad_axis(self, x, axis, after, value=0):
        if after == 0:
            return x
        shape = list(x.shape)
        shape[axis] = after
        fill = self.t.full(shape, value, dtype=x.dtype, device=x.device)
        return self.t.cat([x, fill], dim=axis)

    def slice_axis(self, x, axis, n):
        return self.t.narrow(x, axis, 0, n)

    def slice_index(self, x, axis, j):
        return self.t.narrow(x, axis, j, 1)

    def broadcast_to(self, x, shape):
        return self.t.broadcast_to(x, tuple(shape))

    def amax(self, x, axis, keepdims=True):
        return self.t.amax(x, dim=axis, keepdim=keepdims)

    def amin(self, x, axis, keepdims=True):
        return self.t.amin(x, dim=axis, keepdim=keepdims)

    def sum(self, x, axis, keepdims=True):
        return self.t.sum(x, dim=axis, keepdim=keepdims)

    def any(self, x):
        return bool(self.t.any(x))

    def quiet(self):
        return contextlib.nullcontext()

    def from_numpy(self, a, like):
        return self.t.from_numpy(np.ascontiguousarray(a)).to(like.device)


_NUMPY = NumpyOps()


_TORCH_OPS: list = []  # filled on first use with the one TorchOps instance (a memo, not configuration)


def ops(x: Any):
    """The shim for ``x``'s array kind: ``TorchOps`` for torch tensors, ``NumpyOps`` otherwise."""
    if is_torch(x):
        if not _TORCH_OPS:
            _TORCH_OPS.append(TorchOps(sys.modules["torch"]))
        return _TORCH_OPS[0]
    return _NUMPY


def _is_ml_dtypes_float(dtype) -> bool:
    """True for ml_dtypes' float types (bfloat16, float8_*, float6_*, float4_*): all exact in float32."""
    if dtype.type.__module__ != "ml_dtypes" or "ml_dtypes" not in sys.modules:
        return False
    try:
        sys.modules["ml_dtypes"].finfo(dtype)
    except (TypeError, ValueError):  # ml_dtypes' integer types (int4, uint4, ...)
        return False
    return True


def to_array(x: Any, *, name: str = "x"):
    """Accept numpy arrays, torch tensors (subclasses included), Python scalars and lists; return (array, ops).

    Floating inputs of any width are accepted, including ml_dtypes' float types (bfloat16, float8_*, float6_*,
    float4_*: converted to float32, exactly). Python numbers and lists/tuples of numbers are values: ``3`` and
    ``[1, 2, 3]`` become float32 arrays. Integer or bool *arrays* raise ``TypeError`` naming ``name``.
    """
    if is_torch(x):
        o = ops(x)
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
        return x, o
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be floating point, got a bool")
    a = np.asarray(x)
    if a.dtype.kind == "f":
        return a, _NUMPY
    if _is_ml_dtypes_float(a.dtype):
        return a.astype(np.float32), _NUMPY
    if a.dtype.kind in "iu" and not isinstance(x, np.ndarray):
        # Python numbers and lists of numbers are values, not integer arrays: 3 -> 3.0, [1, 2] -> [1.0, 2.0].
        return a.astype(np.float32), _NUMPY
    raise TypeError(f"{name} must be a floating-point array (or a number or list of numbers), got "
                    f"{type(x).__name__} of dtype {a.dtype}")

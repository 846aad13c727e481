"""The fast path of ``fake_quantize`` with given parameters on a small tensor (GPTQ's column step).

``fake_quantize(w, spec, scale=s, zero_point=z)`` on a (576, 1) column used to spend ~15x the plain expression
``(clamp(round(w / s) + z, lo, hi) - z) * s`` in argument handling: spec lookups, shape arithmetic, and checks of
``s`` and ``z`` written for any array (broadcasting, dtype conversion, rounding to the scale dtype), each one a
few tensor operations. This module answers the common case with the same checks in a cheaper form and the same
element kernel (``qcore._fast.small_kernels``), so the bits are those of the general path:

- Per-spec facts (does the case apply, the element kind, the scale shape for an input shape) are computed once
  per spec object and kept in a small memo keyed by ``id(spec)`` (the spec is kept alive by the memo, so its id
  is not reused while the entry exists).
- The parameters are checked on numpy views (no tensor dispatch per check): the case applies only when they are
  float32 arrays of exactly the scale shape, every scale is positive and finite (two reductions: a NaN fails
  both), and every zero point is an integer in the code range. Anything else (NaN scales, broadcasting shapes,
  other dtypes, a bad value) goes to the general path, which checks it again and raises its usual error: every
  error is still raised before any work, with the same message.
- The values checked last (their bytes, per spec) are remembered: a loop that applies the same scale and zero
  point to many columns (GPTQ, within a group) checks them once. The memo compares values, not identities, so
  a parameter changed in place is checked again.

Covered: a torch CPU float32 tensor (not requiring grad under autograd) with torch CPU float32 parameters, or a
numpy float32 array with numpy float32 parameters; per-tensor or per-channel specs with integer or float
elements (``_fast.kernel_kind``), nearest-even rounding, float32 non-power-of-two scales; at most one slab of
elements (``_inplace.slab_size``). Everything else returns None (the caller runs the general path).
"""

from __future__ import annotations

import sys

import numpy as np

from . import _fast, _inplace
from ._backend import ops
from .dtypes import FloatDType
from .granularity import PerChannel, PerTensor

__all__ = ["fake_quantize_given"]

_MEMO: dict = {}  # id(spec) -> [spec, facts or None, {shape: scale shape}, the last parameters that passed]
_MEMO_MAX = 256
_SEEN_MAX = 4096  # parameters up to this many values are remembered (by their bytes) once they pass the checks
_INF = np.float32(np.inf)


def _facts(spec):
    """(kind, qmin, qmax, symmetric) where the fast path covers ``spec``, else None."""
    if spec.two_level or spec.pow2_scale or not isinstance(spec.granularity, (PerTensor, PerChannel)):
        return None
    if not (isinstance(spec.scale_dtype, FloatDType) and spec.scale_dtype.name == "float32"):
        return None
    kind = _fast.kernel_kind(spec)  # None for stochastic and other rounding modes, microexp, ...
    if kind not in ("int", "float"):
        return None
    return kind, float(spec.qmin), float(spec.qmax), spec.symmetric


def _entry(spec):
    e = _MEMO.get(id(spec))
    if e is None or e[0] is not spec:
        if len(_MEMO) >= _MEMO_MAX:
            _MEMO.clear()
        e = [spec, _facts(spec), {}, None]
        _MEMO[id(spec)] = e
    return e


def _np_params(p, torch_x, torch):
    """A parameter as a numpy float32 view, or None where the fast path does not take it."""
    if torch_x:
        if type(p) is not torch.Tensor or p.dtype is not torch.float32 or p.requires_grad \
                or p.device.type != "cpu":
            return None
        return p.numpy()
    if type(p) is not np.ndarray or p.dtype != np.float32:
        return None
    return p


def fake_quantize_given(x, spec, scale, zero_point):
    """``fake_quantize(x, spec, scale=scale, zero_point=zero_point)`` for the covered case, or None."""
    e = _entry(spec)
    facts = e[1]
    if facts is None:
        return None
    kind, qmin, qmax, symmetric = facts
    torch = sys.modules.get("torch")
    torch_x = torch is not None and isinstance(x, torch.Tensor)
    if torch_x:
        if x.dtype is not torch.float32 or x.device.type != "cpu" or (x.requires_grad and torch.is_grad_enabled()):
            return None
    elif type(x) is not np.ndarray or x.dtype != np.float32:
        return None
    shape = tuple(x.shape)
    sshape = e[2].get(shape)
    if sshape is None:
        if not shape or 0 in shape:
            return None
        try:
            sshape = spec.scale_shape(shape)
        except (ValueError, TypeError):
            return None  # a granularity that does not fit x: the general path raises its error
        e[2][shape] = sshape
    n = 1
    for v in shape:
        n *= v
    o = ops(x)
    if n > _inplace.slab_size(o):
        return None
    if (zero_point is None) is not symmetric:
        return None  # a missing or unexpected zero point: the general path says which
    s = _np_params(scale, torch_x, torch)
    if s is None or s.shape != sshape:
        return None
    z = None
    if zero_point is not None:
        z = _np_params(zero_point, torch_x, torch)
        if z is None or z.shape != sshape:
            return None
    if s.size == 1:  # one value each (per-tensor): Python floats are the cheapest check
        v = float(s.reshape(-1)[0])
        if not 0.0 < v < np.inf:  # NaN fails too
            return None
        if z is not None:
            v = float(z.reshape(-1)[0])
            if not (qmin <= v <= qmax and v == int(v)):
                return None
    else:
        seen = (s.tobytes(), None if z is None else z.tobytes()) if s.size <= _SEEN_MAX else None
        if seen is None or seen != e[3]:
            if not (s.min() > 0 and s.max() < _INF):  # NaN fails both
                return None
            if z is not None and not (z.min() >= qmin and z.max() <= qmax and np.array_equal(np.rint(z), z)):
                return None
            e[3] = seen
    x = x.contiguous() if torch_x else np.ascontiguousarray(x)
    return _fast.small_kernels(x, spec, scale, None, zero_point, kind, o, _inplace.inplace_ops(o))

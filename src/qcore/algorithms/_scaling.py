"""Helpers shared by the per-channel scaling algorithms (``awq``, ``smoothquant``): argument checks and the few
array operations they need, for numpy arrays and torch tensors through one code path.

torch is never imported here: a tensor is recognised through ``qcore._backend`` (a tensor can only exist once
torch is imported), and the torch namespace is reached through the shim (``ops(x).t``). Every helper keeps the
array kind and device of its input.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import numpy as np

from qcore._backend import is_torch, to_array
from qcore.quantize import QuantSpec, make_spec

# Token chunks are sized so that one float64 chunk of activations takes about this many bytes.
CHUNK_BYTES = 64 << 20


def describe(x: Any) -> str:
    """A short description of an argument for error messages (type and shape, never the values)."""
    shape = getattr(x, "shape", None)
    if shape is not None:
        return f"{type(x).__name__} of shape {tuple(shape)} and dtype {getattr(x, 'dtype', '?')}"
    return f"{type(x).__name__} {x!r}"[:120]


def as_float_array(x: Any, name: str, *, ndim: int):
    """``x`` as a floating array of ``ndim`` dimensions (numpy or torch, detached), with its ops namespace.
    TypeError for non-floating or non-array input, ValueError for the wrong number of dimensions or no elements."""
    if not (is_torch(x) or isinstance(x, np.ndarray)):
        raise TypeError(f"{name} must be a numpy array or a torch tensor, got {describe(x)}")
    a, o = to_array(x, name=name)
    if o.name == "torch":
        a = a.detach()
    if len(a.shape) != ndim:
        what = {1: "a 1-D array [channels]", 2: "a 2-D array"}[ndim]
        raise ValueError(f"{name} must be {what}, got shape {tuple(a.shape)}")
    if any(int(n) == 0 for n in a.shape):
        raise ValueError(f"{name} must not be empty, got shape {tuple(a.shape)}")
    return a, o


def same_kind(a: Any, b: Any, name_a: str, name_b: str) -> None:
    """TypeError unless ``a`` and ``b`` are the same array kind (numpy / torch) on the same device."""
    if is_torch(a) != is_torch(b):
        ka = "a torch tensor" if is_torch(a) else "a numpy array"
        kb = "a torch tensor" if is_torch(b) else "a numpy array"
        raise TypeError(f"{name_b} must be the same array kind as {name_a}: {name_a} is {ka}, {name_b} is {kb}")
    if is_torch(a) and a.device != b.device:
        raise ValueError(f"{name_b} is on {b.device} but {name_a} is on {a.device}; put them on one device")


def check_finite(a: Any, o: Any, name: str) -> None:
    """ValueError if ``a`` holds a NaN or an Inf."""
    if not bool(o.isfinite(a).all()):
        raise ValueError(f"{name} must be finite: it holds NaN or Inf")


def weight_list(weights: Any, x: Any = None, name: str = "weights") -> list:
    """``weights`` (one 2-D array or a non-empty sequence of them) as a list of detached float arrays of shape
    [out_i, in], finite, all the kind and device of ``x`` (or of the first weight) and with ``in == x.shape[1]``
    (or the first weight's ``in``)."""
    if is_torch(weights) or isinstance(weights, np.ndarray):
        weights = [weights]
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise TypeError(f"{name} must be a 2-D array or a list of 2-D arrays [out_i, in], got {describe(weights)}")
    if len(weights) == 0:
        raise ValueError(f"{name} must hold at least one weight [out_i, in], got an empty sequence")
    out = []
    ref_name = "x"
    for i, w in enumerate(weights):
        wi, o = as_float_array(w, f"{name}[{i}]", ndim=2)
        if x is None:
            x, ref_name = wi, f"{name}[0]"
        same_kind(x, wi, ref_name, f"{name}[{i}]")
        if int(wi.shape[1]) != int(x.shape[1]):
            raise ValueError(f"{name}[{i}] has shape {tuple(wi.shape)}: its {int(wi.shape[1])} input columns do not "
                             f"match the {int(x.shape[1])} columns of {ref_name} {tuple(x.shape)}")
        check_finite(wi, o, f"{name}[{i}]")
        out.append(wi)
    return out


def as_spec(spec: Any, name: str) -> QuantSpec:
    """A QuantSpec from a QuantSpec or a format name / dtype (``qcore.make_spec``); TypeError otherwise."""
    if isinstance(spec, QuantSpec):
        return spec
    if spec is None or isinstance(spec, (bool, numbers.Number)) or is_torch(spec) or isinstance(spec, np.ndarray):
        raise TypeError(f"{name} must be a qcore.QuantSpec or a format name, got {describe(spec)}")
    try:
        return make_spec(spec)
    except (TypeError, ValueError, KeyError) as e:
        raise type(e)(f"{name}: {e}") from None


def spec_list(spec: Any, n: int, name: str) -> list:
    """One spec per weight: ``spec`` is one spec (used for all ``n`` weights) or a sequence of ``n`` specs."""
    if isinstance(spec, (list, tuple)):
        if len(spec) != n:
            raise ValueError(f"{name} must be one spec or a sequence of one spec per weight ({n}), got {len(spec)}")
        return [as_spec(s, f"{name}[{i}]") for i, s in enumerate(spec)]
    return [as_spec(spec, name)] * n


def check_int(v: Any, name: str, *, minimum: int) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}, got {v!r}")
    v = int(v)
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def check_real(v: Any, name: str) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {v!r}")
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def f64(o: Any):
    return np.float64 if o.name == "numpy" else o.t.float64


def to64(a: Any, o: Any):
    return o.astype(a, f64(o))


def to32(a: Any, o: Any):
    return o.astype(a, o.float32)


def rows_per_chunk(width: int, budget: int = CHUNK_BYTES) -> int:
    """How many rows of ``width`` float64 values fit in ``budget`` bytes (at least 1)."""
    return max(1, budget // (8 * max(1, int(width))))


def chunks(n: int, step: int):
    """(start, stop) pairs covering range(n) in steps of ``step``."""
    for a in range(0, n, step):
        yield a, min(n, a + step)


def zeros64(shape: tuple, o: Any, like: Any):
    return o.full(shape, 0.0, f64(o), like)


def matmul(a: Any, b: Any):
    """``a @ b`` (batched over leading axes), the same for numpy and torch."""
    return a @ b


def transpose2(a: Any, o: Any):
    """Swap the last two axes."""
    return np.swapaxes(a, -1, -2) if o.name == "numpy" else a.transpose(-1, -2)


def sqrt(a: Any, o: Any):
    return np.sqrt(a) if o.name == "numpy" else o.t.sqrt(a)



# ---------------------------------------------------------------------------------------------------------------
# the two-pass candidate search (awq_search, auto_smoothquant)
# ---------------------------------------------------------------------------------------------------------------

#: Screening margin of the searches: a candidate is re-evaluated in float64 when its float32-product loss is
#: within this relative distance of the smallest one. The float32 losses differ from the float64 ones by a few
#: 1e-7 relative on SmolLM2-like data (bench/results/SPEED_SCALING.md), so the float64 winner is always among the finalists.
SCREEN_RTOL = 1e-4


def finalists(screened: list, rtol: float = SCREEN_RTOL) -> list:
    """Indices of the candidates whose screened loss is within ``rtol`` of the smallest (in evaluation order);
    every index when a screened loss is not finite (the float64 search then decides everything, as before)."""
    if not all(math.isfinite(v) for v in screened):
        return list(range(len(screened)))
    m = min(screened)
    return [i for i, v in enumerate(screened) if v <= m + rtol * abs(m)]

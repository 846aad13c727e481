"""Helpers shared by ``qcore.quantize``, ``qcore._microexp``, ``qcore._fast`` and ``qcore.stats``. Dependencies
point one way: ``quantize -> _microexp -> _elements`` (and ``quantize -> _elements``, ``_fast -> _elements``);
``_elements -> cast``; nothing here imports any of its users.

- ``round_elements``: round scaled values to the element grid.
- ``int_clip``: clamp integer element values (plus zero point) to the code range.
- ``check_param``: a calibrated scale / zero point as a float32 array of the spec's scale shape.
- ``check_given_scale``: a calibrated scale is positive (NaN marks a NaN block) and, for power-of-two specs,
  an exact power of two in range.
- ``bump_from_extremes``: bfp16's exponent bump from each block's min and max.
"""

from __future__ import annotations

import numpy as np

from ._backend import is_torch
from .cast import cast
from .dtypes import FloatDType
from .rounding import pow2, round_to_integral
from .scales import floor_log2, scale_exponent_range

__all__ = ["round_elements", "int_clip", "check_param", "check_given_scale", "bump_from_extremes"]


def round_elements(y, spec, key, o):
    """Round scaled values to the element grid; returns element values (float32) in scale units."""
    d = spec.dtype
    if isinstance(d, FloatDType):
        return cast(y, d, rounding=spec.rounding, saturate=True if spec.saturate else None, key=key)
    unit = spec.unit_exponent
    if unit:
        y = y * np.float32(2.0**-unit)
    return round_to_integral(y, mode=spec.rounding, key=key)


def int_clip(r, spec, o, zp=None):
    """Clamp rounded integer values (plus zero point) to the code range; -0 becomes 0 (integer codes have no
    sign of zero, so fake_quantize must not keep one either)."""
    lo, hi = np.float32(spec.qmin), np.float32(spec.qmax)
    if zp is not None:
        r = r + zp
    r = o.clip(r, lo, hi)
    return o.where(r == 0, np.float32(0), r)


def check_given_scale(scales, spec, o, name="scale"):
    """A calibrated scale must be positive (NaN allowed: it marks a NaN block) and, for power-of-two specs,
    an exact power of two in the scale dtype's exponent range."""
    if o.any(scales <= 0) or o.any(o.isinf(scales)):
        bad = scales[o.logical_or(scales <= 0, o.isinf(scales))]
        raise ValueError(f"{name} must be positive and finite (NaN marks a NaN block), got {float(bad[0])!r} "
                         f"(among {tuple(bad.shape)[0]} such values)")
    if spec.two_level:
        fin = o.where(o.isnan(scales), np.float32(1), scales)
        if o.any(cast(fin, spec.scale_dtype, saturate=True) != fin):
            raise ValueError(f"{name}: two-level block scales must be values of {spec.scale_dtype.name}")
    if spec.pow2_scale:
        fin = o.where(o.isnan(scales), np.float32(1), scales)
        e = floor_log2(fin)
        lo, hi = scale_exponent_range(spec.scale_dtype)
        wrong = o.logical_or(o.logical_or(e < lo, e > hi), pow2(o.clip(e, -149, 127), o, fin) != fin)
        if o.any(wrong):
            raise ValueError(f"{name}: this spec uses power-of-two scales ({spec.scale_dtype.name}): {name} must be "
                             f"2**k with k in [{lo}, {hi}], got {float(fin[wrong][0])!r}")


def check_param(p, shape, name, o, like):
    if o.name == "numpy" and is_torch(p):
        raise TypeError(f"{name} is a torch tensor but x is a numpy array; pass {name} as a numpy array (or x as "
                        f"a tensor)")
    p = o.asarray(p, o.float32, like) if o.name == "torch" else np.asarray(p, dtype=np.float32)
    if tuple(p.shape) != tuple(shape):
        try:
            p = o.broadcast_to(p, shape)
        except (ValueError, RuntimeError):
            raise ValueError(f"{name} has shape {tuple(p.shape)}; this spec needs {tuple(shape)} (or a shape that "
                             f"broadcasts to it)") from None
    return p


def bump_from_extremes(s, lo, hi, spec, o):
    """bfp16's bump decided from each block's min ``lo`` and max ``hi`` (deterministic rounding only):
    rounding is monotone, so an element rounds past the range iff the block's max or min does."""
    inv = pow2(o.clip(-s, -127, 127), o, s)
    rhi = round_elements(o.reshape(hi, tuple(s.shape)) * inv, spec, None, o)
    rlo = round_elements(o.reshape(lo, tuple(s.shape)) * inv, spec, None, o)
    over = o.logical_or(rhi > np.float32(spec.qmax), rlo < np.float32(spec.qmin))
    _, smax = scale_exponent_range(spec.scale_dtype)
    return o.minimum(s + o.astype(over, o.int32), smax)

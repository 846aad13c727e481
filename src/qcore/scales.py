"""Scales: from a block statistic (absmax, or min and max) to the scale (and zero point) of a block.

- ``floor_log2(x)``: exact ``floor(log2(|x|))`` read from the float32 bits (subnormals included). Computing it
  as ``floor(log2(x))`` in float32 is wrong just below powers of two (log2(2**k - ulp) rounds to k), which
  makes an MX scale one binade too big; qcore never takes a float log.
- ``pow2_scale_exponent(amax, ...)``: the shared exponent of a power-of-two (E8M0 / pow2) scale, for each
  ``qcore.ScaleMode`` (formulas in ``ScaleMode``'s docstring).
- ``symmetric_scale(amax, ...)``, ``asymmetric_scale(lo, hi, ...)``: ordinary float scales, rounded to a scale
  dtype.

Conventions (the same as AMD Quark, torch.ao and compressed-tensors): a symmetric integer scale is
``amax / ((qmax - qmin) / 2)`` (int8: amax / 127.5), or ``amax / qmax`` with ``narrow_range`` and for unsigned
integers (codes [0, qmax], zero point 0, negative inputs clamp to 0); a float element's
scale is ``amax / max_finite``; an asymmetric scale is ``(hi - lo) / (qmax - qmin)`` over the range widened to
contain 0, with zero point ``clip(qmin - round(lo / scale), qmin, qmax)`` (also for finite ranges wider than
float32's max: the scale is computed without the overflowing ``hi - lo``). A block whose statistic is 0 gets
scale 1 (pow2: the smallest exponent) so that it quantizes to exact zeros; a non-finite statistic gives a NaN
scale, which makes the whole block NaN.
"""

from __future__ import annotations

import math
from typing import Union

import numpy as np

from ._backend import ops
from ._typing import Array, ArrayLike
from .cast import cast
from .dtypes import FloatDType, IntDType, ScaleMode
from .rounding import RoundingMode, round_sig, decompose, pow2

__all__ = ["floor_log2", "pow2_scale_exponent", "symmetric_scale", "asymmetric_scale", "scale_exponent_range"]


def floor_log2(x: ArrayLike) -> Array:
    """Exact floor(log2(|x|)) of float32 ``x`` as int32 (from the bits; 0, Inf and NaN give -150 / 128)."""
    o = ops(x)
    x = o.astype(x, o.float32)
    _, sig, exp, finite = decompose(x, o)
    special = o.astype(o.where(finite, -150, 128), o.int32)
    return o.where(sig == 0, special, o.astype(exp, o.int32))


def inverse_pow2_scales(scales, o, like):
    """``2**-s`` for given power-of-two scales ``2**s`` (exact), NaN where the scale is NaN (a NaN block)."""
    nan = o.isnan(scales)
    s = o.where(nan, 0, floor_log2(scales))
    return o.where(nan, np.float32(math.nan), pow2(-s, o, like))


def scale_exponent_range(scale_dtype: FloatDType) -> tuple[int, int]:
    """Smallest and largest exponent of a power-of-two scale stored in ``scale_dtype``.

    E8M0: [-127, 127]. Other float dtypes: their normal range ([-126, 127] for float32), so that 1/scale is
    also representable.
    """
    if scale_dtype.mantissa_bits == 0 and not scale_dtype.subnormals:
        return scale_dtype.emin, scale_dtype.emax
    return max(scale_dtype.emin, -126), min(scale_dtype.emax, 126)


def element_emax_and_max(element: Union[FloatDType, IntDType], unit_exponent: int = 0,
                         narrow: bool = False) -> tuple[int, float]:
    """(emax, max) of the element grid in units of the scale: floats their own; ints ``emax + unit``."""
    if isinstance(element, FloatDType):
        return element.emax, element.max_finite
    qmax = element.max
    return element.emax + unit_exponent, float(qmax) * 2.0**unit_exponent


def pow2_scale_exponent(amax: Array, *, element: Union[FloatDType, IntDType], mode: ScaleMode = ScaleMode.FLOOR,
                        scale_dtype: FloatDType, unit_exponent: int = 0) -> tuple[Array, Array]:
    """Shared exponent ``s`` (int32; the scale is ``2**s``) per block from its float32 absmax ``amax``.

    ``element`` is the element dtype (``FloatDType`` or ``IntDType``; an ``IntDType`` element's value is
    ``code * 2**unit_exponent``). Returns ``(s, bad)`` where ``bad`` marks blocks whose amax is NaN or Inf
    (their scale is NaN). ``s`` is clamped to ``scale_exponent_range(scale_dtype)``; a zero block gets the
    smallest exponent.
    """
    if not isinstance(mode, ScaleMode):
        raise TypeError(f"scale_mode must be a qcore.ScaleMode, got {mode!r}")
    o = ops(amax)
    a = o.astype(amax, o.float32)
    emax, maxv = element_emax_and_max(element, unit_exponent)
    neg, sig, e, finite = decompose(a, o)
    bad = o.logical_not(finite)
    if mode is ScaleMode.FLOOR:
        s = e - emax
    elif mode is ScaleMode.CEIL:
        s = e - emax + o.astype(sig != (1 << 23), o.int32)
    elif mode is ScaleMode.EVEN:
        mbits = element.mantissa_bits
        r, exact = round_sig(neg, sig, e, e - mbits, RoundingMode.NEAREST_EVEN, None, o, a)
        # r counts steps of 2**(e - mbits); it reaches 2**(mbits + 1) exactly when amax rounds up a binade.
        carried = o.logical_and(o.logical_not(exact), r >= (1 << (mbits + 1)))
        s = e - emax + o.astype(carried, o.int32)
    elif mode is ScaleMode.RCEIL:
        # NVIDIA's recipe (cvt.rp.satfinite.ue8m0x2.f32 of amax / max, as torchao's RCEIL): the quotient is
        # rounded to float32 first, then up to a power of two. Computed without a division (compiled GPU
        # divisions are not always correctly rounded): the exact ceiling, then the float32 rounding's effect.
        s0 = e - emax
        lo, hi = -126, 127
        scaled = a * pow2(o.clip(-s0, lo, hi), o, a) * pow2(o.clip(-s0 - o.clip(-s0, lo, hi), lo, hi), o, a)
        s = s0 + o.astype(scaled > np.float32(maxv), o.int32)
        s = s - o.astype(_rceil_quotient_rounds_down(sig, e, s - 1, maxv, o), o.int32)
    else:  # pragma: no cover - enum is closed
        raise ValueError(mode)
    smin, smax = scale_exponent_range(scale_dtype)
    s = o.where(sig == 0, smin, s)
    s = o.clip(s, smin, smax)
    return o.astype(s, o.int32), bad


def _rceil_quotient_rounds_down(sig, e, k, maxv: float, o):
    """Where float32 rounding of the quotient ``t = amax / maxv`` lowers RCEIL's power-of-two ceiling by one.

    ``amax = sig * 2**(e - 23)`` (``sig`` in [2**23, 2**24)) and ``2**k < t <= 2**(k + 1)`` (``k + 1`` is the exact
    ceiling). For a normal quotient the rounding never reaches ``2**k`` (``maxv`` has at most 24 significant
    bits, so ``t`` exceeds ``2**k`` by more than half an ulp). For a subnormal one (``-149 <= k <= -127``) it
    rounds to nearest-even on the grid of ``2**-149``, down to ``2**k`` exactly when ``t <= 2**k + 2**-150``
    (``k = -149``: ``t < 1.5 * 2**-149``, the tie goes to the even 2**-148). With ``maxv = M * 2**b`` (M odd)
    that is ``sig * 2**(e + 127 - b) <= M * (2**(k + 150) + 1)``, decided in int64 (both sides stay below
    2**49 where it matters).
    """
    num, den = float(maxv).as_integer_ratio()
    b = -(den.bit_length() - 1)
    while num % 2 == 0:
        num //= 2
        b += 1
    i64 = o.int64
    region = o.logical_and(k >= -149, k <= -127)
    one = o.full((), 1, i64, sig)
    rhs = ((one << o.astype(o.clip(k + 150, 1, 23), i64)) + 1) * num
    d = o.astype(e, i64) + (127 - b)
    sig64 = o.astype(sig, i64)
    pos = d >= 0
    lhs = o.where(pos, sig64 << o.clip(d, 0, 25), sig64)
    small = o.where(o.logical_and(region, o.logical_not(pos)), rhs, 0)  # here rhs < 2**25: no overflow below
    rhs = o.where(pos, rhs, small << o.clip(-d, 0, 22))
    down = o.where(k == -149, lhs < rhs, lhs <= rhs)
    return o.logical_and(region, down)


def _int_range(dtype: IntDType, narrow: bool):
    qmin = -dtype.max if (narrow and dtype.signed) else dtype.min
    return qmin, dtype.max


def round_scale(scale, scale_dtype: FloatDType, o, *, positive):
    """Cast float32 scales to ``scale_dtype`` (RNE, saturating). Where the statistic was positive (``positive``)
    a scale that underflowed to 0 (in the float32 division or in the cast) becomes the dtype's smallest
    positive value, so tiny blocks keep a usable, positive scale."""
    s = scale if scale_dtype.name == "float32" else cast(scale, scale_dtype, saturate=True)
    return o.where(o.logical_and(s == 0, positive), np.float32(scale_dtype.min_subnormal), s)


def symmetric_scale(amax: Array, *, dtype: Union[IntDType, FloatDType], scale_dtype: FloatDType,
                    narrow_range: bool = False) -> Array:
    """Float scale per block from absmax for a symmetric spec (see the module docstring for the divisor)."""
    o = ops(amax)
    a = o.astype(amax, o.float32)
    if isinstance(dtype, IntDType):
        qmin, qmax = _int_range(dtype, narrow_range)
        # Unsigned (zero point 0, codes [0, qmax]): the whole range is on the positive side.
        div = float(qmax) if (narrow_range or not dtype.signed) else (qmax - qmin) / 2.0
    else:
        div = dtype.max_finite
    with o.quiet():
        s = a / np.float32(div)
    s = round_scale(s, scale_dtype, o, positive=a > 0)
    s = o.where(a == 0, np.float32(1.0), s)
    return o.where(o.isfinite(a), s, np.float32(math.nan))


def asymmetric_scale(lo: Array, hi: Array, *, dtype: IntDType, scale_dtype: FloatDType) -> tuple[Array, Array]:
    """(scale, zero_point) per block from the block min ``lo`` and max ``hi`` (integer elements only).

    The range is widened to contain 0 so that 0 is exactly representable; ``zero_point`` is float32 holding
    an integer in [qmin, qmax]. A finite block whose widened range ``hi - lo`` overflows float32 still gets its
    correctly rounded scale ``(hi - lo) / (qmax - qmin)`` (computed without the overflowing intermediate;
    saturated to float32's max for uint1); a NaN or Inf statistic gives a NaN scale.
    """
    if not isinstance(dtype, IntDType):
        raise ValueError(f"asymmetric quantization needs an integer dtype, got {dtype.name}")
    o = ops(lo)
    lo = o.minimum(o.astype(lo, o.float32), np.float32(0.0))
    hi = o.maximum(o.astype(hi, o.float32), np.float32(0.0))
    qmin, qmax = dtype.min, dtype.max
    with o.quiet():
        width = hi - lo
        s = width / np.float32(qmax - qmin)
        # A finite range wider than float32's max: hi - lo overflows, but the scale itself is a float32 (for
        # qmax - qmin >= 2). Halving is exact at these magnitudes, so this is the same correctly rounded
        # quotient; with qmax - qmin == 1 (uint1) it saturates to float32's max, like any scale (saturating
        # rounding to the scale dtype). Dynamic and static (scale_from_stats) quantization share this rule.
        wide = o.logical_and(o.isinf(width), o.logical_and(o.isfinite(lo), o.isfinite(hi)))
        half = (hi * np.float32(0.5) - lo * np.float32(0.5)) / np.float32((qmax - qmin) / 2.0)
        s = o.where(wide, o.minimum(half, np.float32(np.finfo(np.float32).max)), s)
    s = round_scale(s, scale_dtype, o, positive=width > 0)
    s = o.where(width == 0, np.float32(1.0), s)
    finite = o.logical_and(o.isfinite(lo), o.isfinite(hi))
    s = o.where(finite, s, np.float32(math.nan))
    with o.quiet():
        zp = o.clip(np.float32(qmin) - o.rint(lo / s), np.float32(qmin), np.float32(qmax))
    zp = o.where(finite, zp, np.float32(0.0))
    return s, zp

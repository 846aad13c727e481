"""Elementwise casts: value -> format grid (``cast``), value <-> bit code (``encode`` / ``decode``).

The semantics live in the docstrings of ``cast`` (rounding, overflow, underflow, -0, unsigned formats, NaN, the
ml_dtypes equivalence) and ``encode`` (codes, NaN codes), which ``help(qcore.cast)`` / ``help(qcore.encode)``
show: in the ``qcore`` namespace ``qcore.cast`` is the function, which shadows this module. docs/numerics.md
('cast') states the same rules and where qcore differs from other libraries.
"""

from __future__ import annotations

import math

import numpy as np

from . import _inplace
from ._typing import Array, ArrayLike, FormatLike, KeyLike
from ._backend import ops, to_array
from .dtypes import BlockDType, FloatDType, GGUFDType, IntDType, Specials, get_dtype
from .rounding import RoundingMode, round_sig, check_mode, decompose, pow2, round_to_integral

__all__ = ["cast", "encode", "decode", "code_dtype_bits"]


def _element_dtype(dtype, what: str):
    d = get_dtype(dtype)
    if isinstance(d, (BlockDType, GGUFDType)):
        raise ValueError(
            f"{what}: {d.name!r} is a block format (elements share scales); use qcore.quantize / "
            f"qcore.fake_quantize for it, or {d.element.name!r} for its elements"
        )
    return d


def _resolve_saturate(d: FloatDType, saturate):
    if saturate is None:
        return d.default_saturate
    if not isinstance(saturate, bool):
        raise TypeError(f"saturate must be True, False or None, got {saturate!r}")
    if not saturate and d.specials is Specials.FINITE:
        raise ValueError(f"{d.name} has no Inf or NaN code, so it always saturates; saturate=False is impossible")
    return saturate


def _as_f32(x, o):
    return o.astype(x, o.float32)


def _cast_float(x, d: FloatDType, rounding, saturate, key, o):
    neg, sig, exp, finite = decompose(x, o)
    m = d.mantissa_bits
    k = o.maximum(exp, d.emin) - m
    r, exact = round_sig(neg, sig, exp, k, rounding, key, o, x)
    # exact (d <= 0) only happens for values already on the grid; r * 2**k is then not needed.
    mag = o.where(exact, o.abs(x), o.astype(r, o.float32) * pow2(o.clip(k, -149, 127), o, x))
    f32 = np.float32
    maxf = f32(d.max_finite)
    inf = f32(math.inf)
    nan = f32(math.nan)
    # Overflow: rounded magnitude beyond max, or an infinite input.
    over = o.logical_or(mag > maxf, o.logical_not(finite))
    if saturate:
        over_val = maxf
    elif d.specials is Specials.IEEE:
        over_val = inf
    else:
        over_val = nan
    mag = o.where(over, over_val, mag)
    if not d.has_zero:
        mag = o.where(mag == 0, f32(d.min_subnormal), mag)
    out = o.where(neg, -mag, mag)
    if d.specials is Specials.FNUZ:
        out = o.where(mag == 0, f32(0.0), out)
    if not d.signed:
        bad = f32(math.nan) if d.has_nan else f32(0.0)
        out = o.where(neg, bad, out)
    if not d.has_zero:
        out = o.where(x == 0, nan, out)
    # NaN inputs stay NaN (decompose marks them non-finite, which the overflow rule above would replace).
    return o.where(o.isnan(x), x, out)


def _cast_int(x, d: IntDType, rounding, key, o):
    y = round_to_integral(x, mode=rounding, key=key)
    return o.clip(y, np.float32(d.min), np.float32(d.max))


def cast(x: ArrayLike, dtype: FormatLike, *, rounding: RoundingMode = RoundingMode.NEAREST_EVEN,
         saturate: bool | None = None, key: KeyLike = None) -> Array:
    """Round ``x`` elementwise to the grid of ``dtype``; float32 in, float32 out.

    ``x``: numpy array, torch tensor, or Python number/list (-> numpy). Any floating input dtype is accepted
    and converted to float32 first (float64 inputs are therefore rounded twice: to float32, then to dtype).
    ``dtype``: a name from ``qcore.DTYPES`` or a ``FloatDType``/``IntDType``. ``key``: for STOCHASTIC only.

    Semantics for a ``FloatDType`` (the same array kind and device out as in; docs/numerics.md, 'cast'):

    1. Round ``|x|`` to the format's grid with ``rounding`` (default ``NEAREST_EVEN``), subnormals included,
       exactly (``qcore.rounding.round_to_step``). The sign is kept; ``-0`` stays ``-0`` where the format has it.
    2. Overflow (the rounded magnitude exceeds the largest finite value) and ``±Inf`` inputs:
       ``saturate=True`` gives ``±max_finite``. Otherwise: IEEE formats give ``±Inf``; FN/FNUZ formats give NaN;
       formats without Inf/NaN (``Specials.FINITE``) always saturate (``saturate=False`` is an error for them).
       The default is the format's ``default_saturate`` (ml_dtypes: FINITE saturates, the others do not).
    3. Underflow below the smallest subnormal rounds to ``±0``; FNUZ formats have no ``-0`` (gives ``+0``);
       formats without zero (E8M0) give their smallest value instead of 0, and ``0`` itself becomes NaN.
    4. Unsigned formats: negative inputs (and ``-0``) give NaN if the format has NaN, else 0.
    5. NaN stays NaN, in every format, also those without a NaN code (ml_dtypes returns ``-0``/``0`` there,
       which silently hides the NaN; ``encode`` refuses it instead, with ``ValueError``).

    With the defaults this equals ``x.astype(ml_dtypes.<fmt>).astype(np.float32)`` bit for bit for every non-NaN
    float32 ``x`` and every format ml_dtypes has (tests/qcore/test_cast.py checks all formats of 8 bits or fewer
    exhaustively over codes and densely over float32).

    For an ``IntDType`` ``cast`` rounds to an integer with ``rounding`` and clamps to ``[min, max]`` (NaN stays
    NaN). Block formats are not elementwise: use ``qcore.fake_quantize``.
    """
    d = _element_dtype(dtype, "cast")
    key = check_mode(rounding, key)
    x, o = to_array(x)
    x = _as_f32(x, o)
    if isinstance(d, IntDType):
        if saturate is False:
            raise ValueError("integer formats always saturate in cast; saturate=False is impossible")
        return _cast_int(x, d, rounding, key, o)
    sat = _resolve_saturate(d, saturate)
    with o.quiet():
        if _is_fixed_point(d) and rounding in _DIRECT:
            return _cast_fixed_point(x, d, rounding, o)
        if _inplace.cast_ok(d, rounding) and not _inplace.is_empty(x) and not _inplace.tracing(o):
            return _inplace.run_cast(x, d, sat, o)
        return _cast_float(x, d, rounding, sat, key, o)


_DIRECT = (RoundingMode.NEAREST_EVEN, RoundingMode.TOWARD_ZERO, RoundingMode.FLOOR, RoundingMode.CEIL)


def _is_fixed_point(d: FloatDType) -> bool:
    """One binade plus its subnormals (E1Mx with bias 1: the MX9/MX6/MX4 elements) is a uniform grid of
    step 2**(emin - m), i.e. sign-magnitude fixed point, saturating."""
    return d.emin == d.emax and d.subnormals and d.signed and d.specials is Specials.FINITE


def _cast_fixed_point(x, d: FloatDType, rounding, o):
    """Fixed-point formats: scale up by 2**(m - emin) (exact: a power of two, upward), round to an integer
    with the array library's exact rint/trunc/floor/ceil, clamp, scale back (exact). Same result as the
    generic bit path, in a few fused operations; -0 and NaN are kept, Inf saturates."""
    m = d.mantissa_bits
    top = np.float32((1 << (m + 1)) - 1)
    y = round_to_integral(x * np.float32(2.0 ** (m - d.emin)), mode=rounding)
    return o.clip(y, -top, top) * np.float32(2.0 ** (d.emin - m))


def code_dtype_bits(d) -> int:
    """Width of the integer array that holds ``d``'s codes: 8 for formats of <= 8 bits, else 32."""
    return 8 if d.bits <= 8 else 32


def _float_codes_of_grid_values(v, d: FloatDType, o):
    """Bit codes of float32 values that already lie on ``d``'s grid (or are NaN/Inf)."""
    neg, sig, exp, finite = decompose(v, o)
    m, e = d.mantissa_bits, d.exponent_bits
    i32 = o.int32
    normal = exp >= d.emin
    field = o.where(normal, exp + d.bias, 0)
    shift = o.clip(23 - m + o.where(normal, 0, d.emin - exp), 0, 31)
    mant = (sig >> shift) & ((1 << m) - 1)
    mag = o.where(sig == 0, 0, (o.astype(field, i32) << m) | mant)
    top = (1 << (e + m)) - 1  # the all-ones magnitude: FN's NaN
    sign_bit = (1 << (e + m)) if d.signed else 0
    isnan = o.isnan(v)
    isinf = o.logical_and(o.logical_not(finite), o.logical_not(isnan))
    if d.specials is Specials.IEEE:
        nan_mag = (((1 << e) - 1) << m) | (1 << (m - 1) if m > 0 else 0)
        mag = o.where(isinf, ((1 << e) - 1) << m, mag)
        mag = o.where(isnan, nan_mag, mag)
    elif d.specials is Specials.FN:
        mag = o.where(isnan, top, mag)
    code = o.where(neg, mag | sign_bit, mag) if d.signed else mag
    if d.specials is Specials.FNUZ:
        code = o.where(o.logical_and(neg, sig == 0), 0, code)  # no -0 (cast already made it +0)
        code = o.where(isnan, 1 << (e + m), code)
    return code


def encode(x: ArrayLike, dtype: FormatLike, *, rounding: RoundingMode = RoundingMode.NEAREST_EVEN,
           saturate: bool | None = None, key: KeyLike = None) -> Array:
    """Round ``x`` to ``dtype`` (as ``cast``) and return the bit codes (uint8 for <= 8 bits, else int32).

    Signed integer formats of <= 8 bits return int8 values; unsigned ones uint8. NaN in a format without a NaN
    code raises ``ValueError``. NaN encodes to the format's canonical NaN: IEEE ``0 11..1 10..0`` with x's sign,
    FN all-ones with x's sign, FNUZ ``0x80``.
    """
    d = _element_dtype(dtype, "encode")
    v = cast(x, d, rounding=rounding, saturate=saturate, key=key)
    o = ops(v)
    if d.is_float and not d.has_nan or not d.is_float:
        if o.any(o.isnan(v)):
            raise ValueError(f"x contains NaN, which {d.name} cannot encode (it has no NaN code)")
    if isinstance(d, IntDType):
        if d.bits <= 8:
            return o.astype(v, o.int8 if d.signed else o.uint8)
        return o.astype(v, o.int32)
    if d.bits == 32:  # float32 itself: the codes are its bits (the sign bit does not fit the generic path)
        return o.bits_of_f32(v)
    code = _float_codes_of_grid_values(v, d, o)
    return o.astype(code, o.uint8 if d.bits <= 8 else o.int32)


def decode(codes: ArrayLike, dtype: FormatLike) -> Array:
    """Values (float32) of the bit codes ``codes`` of ``dtype``. Codes out of range raise ``ValueError``."""
    d = _element_dtype(dtype, "decode")
    o = ops(codes)
    if o.name == "numpy":
        codes = np.asarray(codes)
        kind = codes.dtype.kind
    else:
        kind = "f" if codes.dtype.is_floating_point else ("b" if codes.dtype == o.t.bool else "i")
    if kind not in "iu":
        raise TypeError(f"codes must be an integer array, got dtype {codes.dtype}")
    if isinstance(d, IntDType):
        lo, hi = d.min, d.max
    elif d.bits == 32:
        lo, hi = -(1 << 31), (1 << 32) - 1  # float32 bit patterns, read as int32 or uint32
    else:
        lo, hi = 0, (1 << d.bits) - 1
    # Check the range on the codes as given, before narrowing to int32 (which would wrap 2**32 + 3 to 3).
    wide = codes if o.name == "numpy" else o.astype(codes, o.int64)
    out = o.logical_or(wide < lo, wide > hi)
    if o.any(out):
        raise ValueError(f"codes out of range for {d.name}: valid codes are {lo}..{hi}, got {int(wide[out][0])}")
    c = o.astype(codes, o.int32) if o.name == "torch" or codes.dtype != np.uint32 else codes.view(np.int32)
    if not isinstance(d, IntDType) and d.bits == 32:
        return o.f32_of_bits(c)
    if isinstance(d, IntDType):
        return o.astype(c, o.float32)
    e, m = d.exponent_bits, d.mantissa_bits
    mag = c & ((1 << (e + m)) - 1)
    neg = (c >> (e + m)) != 0 if d.signed else o.full(tuple(c.shape), False, o.bool_, c)
    field = mag >> m
    mant = mag & ((1 << m) - 1)
    like = o.astype(c, o.float32)
    if d.subnormals:
        is_sub = field == 0
        # normal: (2**m + mant) * 2**(field - bias - m); subnormal: mant * 2**(emin - m)
        sigv = o.where(is_sub, mant, mant + (1 << m))
        k = o.where(is_sub, d.emin - m, field - d.bias - m)
    else:
        sigv = mant + (1 << m)
        k = field - d.bias - m
    with o.quiet():
        val = o.astype(sigv, o.float32) * pow2(o.clip(k, -149, 127), o, like)
    f32 = np.float32
    if d.specials is Specials.IEEE:
        top = field == (1 << e) - 1
        val = o.where(top, o.where(mant == 0, f32(math.inf), f32(math.nan)), val)
    elif d.specials is Specials.FN:
        val = o.where(mag == (1 << (e + m)) - 1, f32(math.nan), val)
    out = o.where(neg, -val, val)
    if d.specials is Specials.FNUZ:
        out = o.where(c == (1 << (e + m)), f32(math.nan), out)
    return out

"""Rounding: one exact primitive, every mode.

All of qcore's rounding goes through ``round_to_step(x, k, mode=...)``: round each float32 ``x`` to a multiple
of ``2**k`` (``k`` per element). It works on the float's integer significand, so it is exact for every input
(subnormals, huge values, ties) with no float arithmetic that could round twice. Casting to a float format is
``k = max(exponent(x), emin) - mantissa_bits``; rounding to integers is ``k = 0``.

``RoundingMode`` (the tie and direction rules; formulas for a value ``v`` between grid neighbours
``lo < v < hi`` with ``lo = q * 2**k``):

- ``NEAREST_EVEN``: nearer neighbour; a tie goes to the neighbour whose significand ``q`` is even (IEEE 754
  roundTiesToEven). For exponent-only formats (E8M0) the kept significand is the implicit 1, which is odd, so
  ties go up: 1.5 -> 2, 3 -> 4 (ml_dtypes agrees).
- ``NEAREST_AWAY``: nearer neighbour; ties away from zero (IEEE roundTiesToAway; C ``round``).
- ``TOWARD_ZERO``: truncate the magnitude (IEEE roundTowardZero).
- ``FLOOR``: toward -inf (IEEE roundTowardNegative).
- ``CEIL``: toward +inf (IEEE roundTowardPositive).
- ``STOCHASTIC``: up in magnitude with probability ``(|v| - lo) / 2**k``, resolved to 2**-32 of a step, so
  ``E[round(v)] = v`` (unbiased). Needs ``key``: an int in [0, 2**63) (the random bits are a counter-based hash
  of all 63 bits of the key and the flat element index, so the same key gives the same result on numpy and
  torch, on any device), or
  a ``numpy.random.Generator`` / ``torch.Generator`` from which one int key is drawn.
"""

from __future__ import annotations

import enum

import numpy as np

from ._typing import Array, ArrayLike, KeyLike
from ._backend import ops, to_array

__all__ = ["RoundingMode", "round_to_step", "round_to_integral", "random_bits"]


class RoundingMode(enum.Enum):
    """How a value between two grid points is rounded (see the module docstring for the formulas)."""

    NEAREST_EVEN = "nearest_even"
    NEAREST_AWAY = "nearest_away"
    TOWARD_ZERO = "toward_zero"
    FLOOR = "floor"
    CEIL = "ceil"
    STOCHASTIC = "stochastic"


_M32 = 0xFFFFFFFF


def _lowbias32_py(h: int) -> int:
    h &= _M32
    h ^= h >> 16
    h = (h * 0x7FEB352D) & _M32
    h ^= h >> 15
    h = (h * 0x846CA68B) & _M32
    h ^= h >> 16
    return h


def _is_torch_generator(key) -> bool:
    return type(key).__name__ == "Generator" and type(key).__module__.startswith("torch")


def check_mode(mode: RoundingMode, key: KeyLike) -> int | None:
    """Validate a rounding mode / key pair; returns the key as a non-negative int (or None).

    ``key`` may be an int in [0, 2**63) (the counter-based stream: same key, same bits, on numpy and torch), or a
    ``numpy.random.Generator`` / ``torch.Generator``, from which one 63-bit key is drawn (advancing it), so a
    seeded generator gives reproducible results too.
    """
    if not isinstance(mode, RoundingMode):
        raise TypeError(f"rounding must be a qcore.RoundingMode, got {mode!r}")
    if mode is not RoundingMode.STOCHASTIC:
        return None
    if key is None:
        raise ValueError("RoundingMode.STOCHASTIC needs an explicit key= (a non-negative int or a Generator)")
    if isinstance(key, np.random.Generator):
        return int(key.integers(0, 2**63, dtype=np.int64))
    if _is_torch_generator(key):
        import torch  # only reachable when the caller already uses torch

        return int(torch.randint(0, 2**62, (1,), generator=key, device=key.device).item())
    if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or not 0 <= key < 2**63:
        raise ValueError(f"key must be an int in [0, 2**63) or a numpy/torch Generator, got {key!r}")
    return int(key)


def random_bits(key: int, shape, *, like):
    """Uniform 32-bit random integers (as int64 in [0, 2**32)) for each element of ``shape``.

    Counter-based: element ``i`` (C order) gets ``lowbias32(lowbias32(i + k1) ^ k1) ^ k2`` with
    ``k1 = lowbias32(lo * 0x9E3779B9 + 0x85EBCA6B)`` from the key's low 32 bits ``lo`` and
    ``k2 = k1 ^ lowbias32(hi * 0x9E3779B9)`` from its high bits ``hi = key >> 32`` (all 63 bits count: keys 7 and
    7 + 2**32 give different streams; ``k2 = k1`` for keys below 2**32). The stream is a pure function of
    (key, index), identical on numpy and torch.
    """
    o = ops(like)
    n = 1
    for s in shape:
        n *= int(s)
    key = int(key)
    kh = _lowbias32_py((key & _M32) * 0x9E3779B9 + 0x85EBCA6B)
    kh2 = kh ^ _lowbias32_py((key >> 32) * 0x9E3779B9)
    h = (o.arange(n, o.int64, like) + kh) & _M32
    for k in (kh, kh2):
        h = h ^ (h >> 16)
        h = (h * 0x7FEB352D) & _M32
        h = h ^ (h >> 15)
        h = (h * 0x846CA68B) & _M32
        h = h ^ (h >> 16)
        h = h ^ k
    return o.reshape(h, tuple(shape))


def pow2(k, o, like):
    """2.0**k as float32, exactly, for integer arrays k in [-149, 127] (built from bits, no pow)."""
    k = o.astype(k, o.int32)
    normal = o.maximum(k, -126) + 127
    bits_normal = normal << 23
    sub_shift = o.clip(k + 149, 0, 22)
    one = o.full((), 1, o.int32, like)
    bits = o.where(k < -126, one << sub_shift, bits_normal)
    return o.f32_of_bits(bits)


def mul_pow2(x, k, o):
    """``x * 2**k`` for integer arrays ``k`` in [-252, 254], exact whenever the result is representable
    (two multiplications by in-range powers of two; 2**128 itself is not a float32)."""
    k = o.astype(k, o.int32)
    k1 = o.clip(k, -126, 127)
    return x * pow2(k1, o, x) * pow2(o.clip(k - k1, -126, 127), o, x)


def decompose(x, o):
    """Split float32 ``x`` into (negative, significand, exponent, finite) with ``|x| = sig * 2**(exp - 23)``.

    ``sig`` is int32 in [2**23, 2**24) for nonzero finite x (subnormal inputs are normalised exactly), 0 for
    zeros. Inf/NaN have ``finite`` False and meaningless sig/exp.
    """
    bits = o.bits_of_f32(x)
    neg = bits < 0
    u = bits & 0x7FFFFFFF
    field = u >> 23
    sub = field == 0
    # Normalise subnormals exactly: x * 2**64 is exact and normal for |x| < 2**-126.
    xs = o.where(sub, o.where(sub, x, np.float32(0)) * np.float32(2.0**64), x)
    us = o.bits_of_f32(xs) & 0x7FFFFFFF
    fs = us >> 23
    exp = fs - 127 - (o.astype(sub, o.int32) << 6)
    sig = o.where(fs == 0, 0, (us & 0x7FFFFF) | 0x800000)
    finite = field != 255
    return neg, sig, exp, finite


def round_sig(neg, sig, exp, k, mode, key, o, like):
    """Round |x| = sig * 2**(exp-23) to a multiple of 2**k; returns (r, exact) with rounded |x| = r * 2**k.

    ``exact`` marks elements already on the grid (d <= 0), for which r is meaningless and |x| is the answer.
    """
    d = k - (exp - 23)
    dc = o.clip(d, 0, 25)
    q = sig >> dc
    one = o.full((), 1, o.int32, like) << dc
    rem = sig & (one - 1)
    if mode is RoundingMode.NEAREST_EVEN:
        twice = rem << 1
        inc = o.logical_or(twice > one, o.logical_and(twice == one, (q & 1) == 1))
    elif mode is RoundingMode.NEAREST_AWAY:
        inc = (rem << 1) >= one
    elif mode is RoundingMode.TOWARD_ZERO:
        inc = None
    elif mode is RoundingMode.FLOOR:
        inc = o.logical_and(rem > 0, neg)
    elif mode is RoundingMode.CEIL:
        inc = o.logical_and(rem > 0, o.logical_not(neg))
    else:  # STOCHASTIC
        u = random_bits(key, tuple(sig.shape), like=like)
        rem64 = o.astype(rem, o.int64)
        d64 = o.astype(o.maximum(d, 1), o.int64)
        frac32 = o.where(
            d64 <= 32,
            rem64 << o.clip(32 - d64, 0, 31),
            rem64 >> o.clip(d64 - 32, 0, 62),
        )
        inc = u < frac32
    r = q if inc is None else q + o.astype(inc, o.int32)
    return r, d <= 0


def round_to_step(x: ArrayLike, k: ArrayLike, *, mode: RoundingMode = RoundingMode.NEAREST_EVEN,
                  key: KeyLike = None) -> Array:
    """Round float32 ``x`` to a multiple of ``2**k`` (``k`` an int or int array broadcastable to x).

    Exact for every finite input; Inf/NaN pass through. ``k`` must lie in [-149, 127]. Returns float32 of the
    same kind as ``x``. Results that round past the float32 range become Inf.
    """
    key = check_mode(mode, key)
    x, o = to_array(x)
    x = o.astype(x, o.float32)
    neg, sig, exp, finite = decompose(x, o)
    k = o.asarray(k, o.int32, x) if not hasattr(k, "shape") else o.astype(k, o.int32)
    r, exact = round_sig(neg, sig, exp, k, mode, key, o, x)
    with o.quiet():  # a result past float32's range is Inf, as documented
        mag = o.astype(r, o.float32) * pow2(k, o, x)
    ax = o.abs(x)
    mag = o.where(exact, ax, mag)
    out = o.where(neg, -mag, mag)
    return o.where(finite, out, x)


def round_to_integral(x: ArrayLike, *, mode: RoundingMode = RoundingMode.NEAREST_EVEN,
                      key: KeyLike = None) -> Array:
    """Round float32 ``x`` to integers (as float32) with ``mode``; equals ``round_to_step(x, 0)``.

    The four IEEE directed/even modes use the array library's own exact float ops (rint, trunc, floor, ceil:
    one pass, no integer work); NEAREST_AWAY and STOCHASTIC go through ``round_to_step``.
    """
    key = check_mode(mode, key)
    x, o = to_array(x)
    x = o.astype(x, o.float32)
    direct = {
        RoundingMode.NEAREST_EVEN: o.rint,
        RoundingMode.TOWARD_ZERO: o.trunc,
        RoundingMode.FLOOR: o.floor,
        RoundingMode.CEIL: o.ceil,
    }.get(mode)
    if direct is not None:
        with o.quiet():  # signalling NaNs make numpy warn; they stay NaN
            return direct(x)
    return round_to_step(x, 0, mode=mode, key=key)

"""Shared-microexponent blocks (MX9 / MX6 / MX4; Rouhani et al. 2023, "Shared Microexponents").

A block (16 elements along the blocked axis) shares an 8-bit exponent ``s`` (stored as an E8M0 scale
``2**s``); each sub-block (a pair) has a ``subblock_shift_bits``-bit microexponent ``d``; an element is
``sign * M * 2**(s - d + unit)`` with ``M`` a ``m``-bit magnitude (MX9: m = 7, MX6: 4, MX4: 2; ``unit = 1 - m``).

qcore's rules (docs/quark_block_semantics.md compares them with AMD Quark's two implementations):

1. ``s`` comes from the block absmax like any power-of-two scale (``ScaleMode``, default FLOOR):
   ``s = floor(log2(amax))`` read exactly from the bits (Quark does the same for these formats).
2. ``d`` is the largest shift in ``[0, 2**shift_bits - 1]`` that keeps the sub-block's absmax below
   ``2**(s - d + 1)``: with one bit, ``d = 1`` exactly when both elements of the pair are below ``2**s``
   (Quark: "both exponents below the block exponent").
3. ``M = round(|x| / 2**(s - d + unit))`` with the spec's rounding (default nearest-even), clamped to
   ``2**m - 1``.
4. A NaN or Inf anywhere in the block makes the whole block NaN (as for OCP MX; Quark-ONNX does the same,
   Quark-Torch lets them through). Subnormal inputs are kept (Quark-Torch flushes them to +0 first).
"""

from __future__ import annotations

import math

import numpy as np

from ._elements import int_clip, round_elements
from .dtypes import IntDType
from .granularity import scales_to_blocked
from .rounding import mul_pow2, pow2
from .scales import floor_log2, pow2_scale_exponent

__all__ = ["quantize_microexp_blocks", "dequant_microexp_blocks"]


def _tile_axis(blocked, spec) -> int:
    """Index (in the blocked array) of the tile axis that holds the group."""
    nd = len(blocked.shape)
    return 2 * (spec.granularity.axis % nd) + 1


def _split(xb, ax, sub, o):
    """(..., t, ...) -> (..., t // sub, sub, ...) at axis ``ax``."""
    shape = tuple(xb.shape)
    return o.reshape(xb, shape[:ax] + (shape[ax] // sub, sub) + shape[ax + 1:])


def _merge(xs, ax, o):
    shape = tuple(xs.shape)
    return o.reshape(xs, shape[:ax] + (shape[ax] * shape[ax + 1],) + shape[ax + 2:])


def _shifts_to_public(d, blocked, spec, o):
    """Blocked-sub layout (..., nb, 1, ..., nsub, 1, ...) -> x's shape with the group axis counted in
    sub-blocks (``ceil(n / block) * block / subblock`` entries: the padding's sub-blocks included)."""
    a = spec.granularity.axis % len(blocked.shape)
    shape = list(blocked.padded)
    shape[a] = shape[a] // spec.subblock_size
    return o.reshape(d, tuple(shape))


def _shifts_to_blocked(shifts, blocked, spec, o, ax):
    shape = []
    for i, (p, t) in enumerate(zip(blocked.padded, blocked.tile)):
        if 2 * i + 1 == ax:
            shape += [p // t, t // spec.subblock_size, 1]
        else:
            shape += [p // t, t]
    return o.reshape(shifts, tuple(shape))


def quantize_microexp_blocks(xb, blocked, spec, scale, key, o):
    ax = _tile_axis(blocked, spec)
    sub = spec.subblock_size
    maxshift = (1 << spec.subblock_shift_bits) - 1
    reduce_axes = blocked.reduce_axes
    if scale is None:
        amax = o.amax(o.abs(xb), reduce_axes)
        s, bad = pow2_scale_exponent(amax, element=spec.dtype, mode=spec.scale_mode,
                                     scale_dtype=spec.scale_dtype, unit_exponent=spec.unit_exponent)
        scales = o.reshape(o.where(bad, np.float32(math.nan), pow2(s, o, xb)), blocked.scale_shape)
    else:
        scales = scale  # validated and of the scale shape (qcore.quantize.prepare_params)
        bad = o.isnan(scales_to_blocked(scales, blocked, o))
        s = o.where(bad, 0, floor_log2(o.where(bad, np.float32(1), scales_to_blocked(scales, blocked, o))))
    s_b = o.reshape(s, blocked.scale_blocked_shape)
    bad_b = o.reshape(bad, blocked.scale_blocked_shape)
    xs = _split(xb, ax, sub, o)
    # Sub-blocks are tiny (2): an elementwise maximum over their slices fuses far better than a reduction.
    ax_xs = o.abs(xs)
    pair_amax = None
    for j in range(sub):
        part = o.slice_index(ax_xs, ax + 1, j)
        pair_amax = part if pair_amax is None else o.maximum(pair_amax, part)
    ep = floor_log2(pair_amax)
    emax_eff = spec.dtype.emax + spec.unit_exponent
    s_sub = o.reshape(s_b, tuple(s_b.shape[:ax]) + (1, 1) + tuple(s_b.shape[ax + 1:]))
    d = o.clip(s_sub + emax_eff - ep, 0, maxshift)
    d = o.where(o.reshape(bad_b, tuple(s_sub.shape)), 0, d)
    e_pair = s_sub - d
    # Spread the per-pair exponent back over the block's elements first: rounding on the contiguous (…, 16)
    # layout vectorises (on a (…, 8, 2) layout inductor's inner loop has stride 2 and runs ~7x slower).
    # e_pair can be -128 (s = -127 shifted once): 2**128 is not a float32, so scale in two exact steps.
    e_el = _merge(o.broadcast_to(e_pair, tuple(xs.shape)), ax, o)
    y = mul_pow2(xb, -e_el, o)
    v = round_elements(y, spec, key, o)
    if isinstance(spec.dtype, IntDType):
        v = int_clip(v, spec, o)
    v = o.where(bad_b, np.float32(math.nan), v)
    shifts = _shifts_to_public(o.astype(d, o.int32), blocked, spec, o)
    return v, scales, None, blocked, shifts


def dequant_microexp_blocks(vb, sb, shifts, blocked, spec, o):
    ax = _tile_axis(blocked, spec)
    d = _shifts_to_blocked(shifts, blocked, spec, o, ax)
    factor = pow2(o.clip(-d + spec.unit_exponent, -149, 127), o, vb)
    shape = tuple(d.shape[:ax + 1]) + (spec.subblock_size,) + tuple(d.shape[ax + 2:])
    factor = _merge(o.broadcast_to(factor, shape), ax, o)
    with o.quiet():
        return vb * factor * sb

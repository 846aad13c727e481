"""The default path: the exact semantics of the generic functions, computed in slabs, in place, in few passes.

The generic functions (``quantize._quantize_blocks``, ``cast._cast_float``) are the oracle: readable, exact, and
about 100 elementwise operations for an MX format, each a full-size temporary. This module computes the same bits
for the common specs with a handful of operations per element, on slabs of a few hundred KiB that stay in cache,
writing into one preallocated output. Peak extra memory is a few slabs, whatever the input size.

How (every step exact; tests/qcore/test_fast.py checks each against the generic path bit for bit):

1. Canonical layout. Adjacent axes that tile the same way are merged (``PerGroup(32)`` on (B, T, K) becomes
   (B*T, K) with tile (1, 32)), then the array is cut into slabs of whole rows that never split a block row.
2. Statistics. Per slab, ``|x|`` into a scratch buffer and one reduction per block (absmax, or min and max). Blocks
   that span several slabs (per-tensor, per-channel along the last axis) combine their partial statistics.
3. Parameters. The scales (and zero points) come from the statistics through the same functions as the generic
   path (``pow2_scale_exponent``, ``symmetric_scale``, ``asymmetric_scale``, bfp16's ``bump_from_extremes``),
   once, on the small arrays.
4. Elements. Float elements round to nearest-even with one add and one subtract: for ``a = |y|`` with float32
   exponent ``e``, the grid step is ``2**k`` with ``k = max(e, emin) - m``; ``C = 1.5 * 2**(k + 23)`` has ulp
   ``2**k`` and ``a + C`` stays in C's binade, so float32 addition rounds ``a`` to the grid, ties to even (C's
   significand is even), and ``(a + C) - C`` is exact. ``C`` is built from ``a``'s exponent bits with two integer
   operations. x's sign bit is OR-ed back (so ``-0`` survives). Integer elements use the array library's exact
   ``rint``; MX9/MX6/MX4 round each pair to ``2**-(m + d)`` by the same add-subtract, with per-element constants
   made by exponent shifts in int64 pairs (no broadcast over the pairs' tiny axis).

Layers: the in-place primitives, the slab size, the add-subtract rounding of step 4 and the elementwise cast
kernel live in ``qcore._inplace``, below ``qcore.cast`` (which dispatches to that kernel); this module sits above
``cast``, ``_elements`` and ``_two_level``, whose rules it reuses.

NaN outputs are NaN at the same positions as the generic path; their sign and payload are not specified (the
kit's comparisons treat NaNs as equal). Everything else is bit-identical.

Specs this path does not cover (rounding modes other than nearest-even, non-saturating float elements inside
quantize, bfloat16 / E8M0 / unsigned float elements, MX9/MX6/MX4 blocked along another axis than the last, NaN
inputs under a given scale for quantize) run the generic functions (``kernel_kind`` returns None).
"""

from __future__ import annotations

import math

import numpy as np

from ._elements import bump_from_extremes, check_param
from ._inplace import (SLAB, f32_contiguous, float_kernel_ok, inplace_ops, is_empty, round_float_abs,
                       slab_size)
from ._two_level import f32_const, tensor_scale_from_amax, two_level_multipliers, two_level_scales
from .cast import decode
from .dtypes import FloatDType, IntDType, ScaleMode, Specials, TensorScale
from .granularity import PerChannel, PerGroup, PerTensor, tile_shape
from .rounding import RoundingMode
from .scales import (asymmetric_scale, element_emax_and_max, inverse_pow2_scales, pow2_scale_exponent,
                     scale_exponent_range, symmetric_scale)

__all__ = ["run_fake_quantize", "run_quantize", "run_dequantize", "kernel_kind", "small_given_prepared"]


# ---------------------------------------------------------------------------------------------------------------
# Layout: canonical shape, slabs.
# ---------------------------------------------------------------------------------------------------------------
def canonical(shape, tile):
    """Merge adjacent axes that tile alike; returns (shape, tile) of the merged layout, or None where an axis is
    ragged (its length not a multiple of its tile) anywhere but axis 0."""
    shape, tile = list(shape), list(tile)
    if not shape:
        return [1], [1]
    for s, t in zip(shape[1:], tile[1:]):
        if s % t:
            return None
    out_s, out_t = [shape[0]], [tile[0]]
    for s, t in zip(shape[1:], tile[1:]):
        ps, pt = out_s[-1], out_t[-1]
        if pt == 1 and (t == 1 or s % t == 0):
            # a row of tile 1 followed by whole groups: groups never cross rows
            out_s[-1], out_t[-1] = ps * s, t
        elif pt == ps and t == s:  # whole axis followed by whole axis
            out_s[-1], out_t[-1] = ps * s, ps * s
        else:
            out_s.append(s)
            out_t.append(t)
    # A tile that covers a whole merged axis of length 0 stays valid; a leading axis of tile == its length is fine.
    return out_s, out_t


def slabs(cshape, ctile, target=SLAB):
    """Row ranges ``(r0, r1, block_row)`` along axis 0 of the canonical layout; a slab never splits a block row
    unless one block row alone exceeds ``target`` (then its slabs share ``block_row``, marked by r1 - r0 < its
    tile; their statistics combine)."""
    rows = cshape[0]
    rowsize = 1
    for s in cshape[1:]:
        rowsize *= s
    t0 = ctile[0]
    out = []
    if t0 * rowsize <= target:
        step = max(1, target // (t0 * rowsize)) * t0
        full = rows // t0 * t0  # a short last block row is a slab of its own
        for r0 in range(0, full, step):
            out.append((r0, min(r0 + step, full), None))
        if full < rows:
            out.append((full, rows, None))
        return out
    step = max(1, target // max(rowsize, 1))
    for b0 in range(0, rows, t0):
        end = min(b0 + t0, rows)
        for r0 in range(b0, end, step):
            out.append((r0, min(r0 + step, end), b0 // t0))
    return out


def _blocked_view(a, ctile, rows):
    """View a slab (rows, d1, ...) as (n0, t0, n1, t1, ...) with t0 = min(tile0, rows)."""
    t0 = min(ctile[0], rows)
    shape = [rows // t0, t0]
    for s, t in zip(a.shape[1:], ctile[1:]):
        shape += [s // t, t]
    return a.reshape(tuple(shape))


# ---------------------------------------------------------------------------------------------------------------
# Which specs the fast kernels cover.
# ---------------------------------------------------------------------------------------------------------------


def kernel_kind(spec):
    """'float', 'int', 'microexp' or None (generic)."""
    if spec.rounding is not RoundingMode.NEAREST_EVEN:
        return None
    d = spec.dtype
    if spec.subblock_shift_bits:
        if spec.subblock_shift_bits == 1 and spec.subblock_size == 2 and isinstance(d, FloatDType) \
                and _fixed_point(d) and not spec.unit_exponent:
            return "microexp"
        return None
    if isinstance(d, IntDType):
        return "int"
    if float_kernel_ok(d) and spec.saturate:
        return "float"
    return None


def _fixed_point(d) -> bool:
    return d.emin == d.emax and d.subnormals and d.signed and d.specials is Specials.FINITE


# ---------------------------------------------------------------------------------------------------------------
# Statistics and parameters.
# ---------------------------------------------------------------------------------------------------------------
def _stats(r, x, need_minmax):
    """Per-block statistics of every slab (``_slab_stats``): lists of absmax, or of (min, max), per slab in the
    blocked-scale layout, in canonical block order. Blocks that span several slabs combine their parts."""
    ip = r.ip
    parts_a, parts_lo, parts_hi = [], [], []
    pending = None  # (block_row, a, lo, hi) while a block row spans several slabs
    for r0, r1, brow in r.plan:
        a, lo, hi = _slab_stats(r.slab_in(x, r0, r1), r, need_minmax)
        if need_minmax:
            a = None
        if brow is None:
            parts_a.append(a), parts_lo.append(lo), parts_hi.append(hi)
            continue
        if pending is not None and pending[0] == brow:
            _, pa, plo, phi = pending
            pending = (brow, None if a is None else ip.maximum(pa, a),
                       None if lo is None else ip.minimum(plo, lo), None if hi is None else ip.maximum(phi, hi))
        else:
            if pending is not None:
                parts_a.append(pending[1]), parts_lo.append(pending[2]), parts_hi.append(pending[3])
            pending = (brow, a, lo, hi)
    if pending is not None:
        parts_a.append(pending[1]), parts_lo.append(pending[2]), parts_hi.append(pending[3])
    return parts_a, parts_lo, parts_hi


def _order_keys(bits, out, ip):
    """int32 keys that order like the float32 values: negative floats have their magnitude bits flipped."""
    ip.shr(bits, 31, out)
    ip.band(out, 0x7FFFFFFF, out)
    ip.bxor(out, bits, out)
    return out


def _from_keys(k, ip):
    """Inverse of ``_order_keys`` (it is an involution) on a small reduced array, as float32."""
    k = ip.contiguous(k)
    t = ip.band(ip.shr(k, 31, None), 0x7FFFFFFF, None)
    return ip.fbits(ip.contiguous(ip.bxor(t, k, None)))


def _cat(parts, o, sshape):
    """Concatenate per-slab statistics (blocked-scale layout, axis 0) into the public scale shape."""
    flat = [o.reshape(p, (-1,)) for p in parts]
    if o.name == "torch":
        v = o.t.cat(flat) if len(flat) > 1 else flat[0]
    else:
        v = np.concatenate(flat) if len(flat) > 1 else flat[0]
    return o.reshape(v, sshape)


def params(x, spec, scale, zero_point, o, r):
    """(scales, inv or None, zero points or None) in the public scale shape, exactly as the generic path.
    Given parameters were validated (and rounded to the scale dtype) by the caller (``prepare_params``)."""
    sshape = spec.scale_shape(tuple(x.shape))
    if scale is not None:
        scales = check_param(scale, sshape, "scale", o, x)
        zp = None
        if not spec.symmetric:
            if zero_point is None:
                raise ValueError("an asymmetric spec with a given scale also needs zero_point=")
            zp = check_param(zero_point, sshape, "zero_point", o, x)
        inv = inverse_pow2_scales(scales, o, x) if spec.pow2_scale else None
        return scales, inv, zp, None
    need_minmax = (not spec.symmetric) or spec.bump_on_overflow
    pa, plo, phi = _stats(r, x, need_minmax)
    if need_minmax:
        lo, hi = _cat(plo, o, sshape), _cat(phi, o, sshape)
        with o.quiet():
            amax = o.maximum(o.abs(lo), o.abs(hi))
    else:
        amax = _cat(pa, o, sshape)
    scales, inv, zp = _params_from_stats(amax, lo if need_minmax else None, hi if need_minmax else None, spec, o, x)
    return scales, inv, zp, None


def _params_from_stats(amax, lo, hi, spec, o, like):
    """(scales, 2**-s or None, zero points or None) from block statistics (any shape): the generic rules."""
    zp = None
    inv = None
    if spec.pow2_scale:
        emax_eff, _ = element_emax_and_max(spec.dtype, spec.unit_exponent)
        if spec.scale_mode is ScaleMode.FLOOR and emax_eff >= 0:
            fast = _floor_e8m0_params(amax, hi, emax_eff, spec, o)
            if fast is not None:
                return fast[0], fast[1], None
        if spec.scale_mode is ScaleMode.FLOOR and emax_eff >= 0:
            # OCP's rule straight from the exponent field of amax (>= 0): a zero or subnormal amax lands below the
            # smallest exponent and is clamped there; field 255 is NaN/Inf.
            smin, smax = scale_exponent_range(spec.scale_dtype)
            field = o.astype(amax, o.float32)
            field = inplace_ops(o).shr(inplace_ops(o).ibits(inplace_ops(o).contiguous(field)), 23, None)
            field = inplace_ops(o).band(field, 0xFF, field)  # a NaN from torch.maximum can carry the sign bit
            bad = field == 255
            s = o.clip(field - (127 + emax_eff), smin, smax)
        else:
            s, bad = pow2_scale_exponent(amax, element=spec.dtype, mode=spec.scale_mode,
                                         scale_dtype=spec.scale_dtype, unit_exponent=spec.unit_exponent)
        if spec.bump_on_overflow:
            s = bump_from_extremes(s, lo, hi, spec, o)
        scales = o.where(bad, np.float32(math.nan), _pow2_small(s, o))
        inv = o.where(bad, np.float32(math.nan), _pow2_small(-s, o))
    elif spec.symmetric:
        scales = symmetric_scale(amax, dtype=spec.dtype, scale_dtype=spec.scale_dtype,
                                 narrow_range=spec.narrow_range)
    else:
        scales, zp = asymmetric_scale(lo, hi, dtype=spec.dtype, scale_dtype=spec.scale_dtype)
    return scales, inv, zp


_ORDINARY: list = []  # [(scales, fwd, back, smallest e)] of the last _floor_e8m0_params result (see there)


def _ordinary(sc):
    """The ``_ORDINARY`` entry made with these very scales, or None (one read of the slot: another thread may
    replace it at any time, and then its entry is simply not ours)."""
    e = _ORDINARY[0] if _ORDINARY else None
    return e if e is not None and e[0] is sc else None


def _floor_e8m0_params(amax, hi, emax_eff, spec, o):
    """(2**s, 2**-s) straight from the bits when every block is ordinary, else None (the caller's general rule).

    The rule (FLOOR, ``emax_eff >= 0``, E8M0's exponent range [-127, 127]) is ``s = field - 127 - emax_eff``
    with ``field`` amax's float32 exponent field. Where every block has ``1 <= e <= 253`` (``e = s + 127``) and
    no NaN/Inf (field 255), both ``2**s`` and ``2**-s`` are normal float32 numbers: their bits are ``e << 23``
    and ``(254 - e) << 23`` (no clip, no select). A slab with a zero, subnormal or extreme block, or a NaN
    block, returns None: the general rule handles it (same bits).

    bfp16's bump (``bump_on_overflow``; signed ``b``-bit integers, ``unit_exponent = 2 - b``, full range), here
    in bits: with ``s`` the floor exponent every element has ``|x| < 2**(s + 1)``, so ``x * 2**(-s - unit)``
    lies in (-2**(b-1), 2**(b-1)): the minimum never rounds below ``qmin`` and the maximum rounds past ``qmax``
    exactly when ``hi >= (2 - 2**(1 - b)) * 2**s`` (nearest-even: the tie ``qmax + 1/2`` rounds up to the even
    ``2**(b-1)``), i.e. when hi's bits are at least ``(field << 23) | (2**23 - 2**(24 - b))``; then ``e`` grows
    by one (``bump_from_extremes``'s rule, which the general path runs). Integer specs also need
    ``2**(-s - unit)`` and ``2**(s + unit)`` as normal numbers (``_int_factors``): biased exponents
    ``254 - e - unit`` and ``e + unit`` in [1, 254], so ``1 - unit <= e <= 253 - unit`` (unit is 0 for floats).

    The result's scales, with the integer kernels' two factors, are remembered in ``_ORDINARY`` (one slot): for
    those scales ``_bad_blocks`` knows there is no NaN block and ``_int_factors`` has its factors, without
    another pass over the scales. A slot that holds other scales (another call in between) is simply not used."""
    if scale_exponent_range(spec.scale_dtype) != (-127, 127):
        return None
    d = spec.dtype
    unit = spec.unit_exponent
    bump = spec.bump_on_overflow
    if bump and not (isinstance(d, IntDType) and d.signed and spec.symmetric and not spec.narrow_range
                     and unit == 2 - d.bits and spec.rounding is RoundingMode.NEAREST_EVEN and hi is not None):
        return None
    ip = inplace_ops(o)
    field = ip.shr(ip.ibits(ip.contiguous(o.astype(amax, o.float32))), 23, None)
    ip.band(field, 0xFF, field)  # a NaN from torch.maximum can carry the sign bit
    if o.name == "torch":
        lo_f, hi_f = (int(v) for v in o.t.aminmax(field))
    else:
        lo_f, hi_f = int(field.min()), int(field.max())
    e_lo, e_hi = lo_f - emax_eff, hi_f - emax_eff + (1 if bump else 0)
    if hi_f == 255 or e_lo < max(1, 1 - unit) or e_hi > min(253, 253 - unit):
        return None
    if bump:
        # over = hi >= the threshold, as float32 bits compared as int32 (a negative hi is a negative int)
        thr = ip.bor(ip.shl(field, 23, None), (1 << 23) - (1 << (24 - d.bits)), None)
        over = ip.ibits(ip.contiguous(o.astype(hi, o.float32))).reshape(tuple(thr.shape)) >= thr
        if emax_eff:
            ip.sub(field, emax_eff, field)
        ip.add(field, over, field) if o.name == "numpy" else field.add_(over.to(field.dtype))
    elif emax_eff:
        ip.sub(field, emax_eff, field)  # e = s + 127, in [1, 253]
    inv = ip.fbits(ip.shl(254 - field, 23, None))
    fwd = back = None
    if isinstance(d, IntDType):
        fwd = ip.fbits(ip.shl(254 - unit - field, 23, None)) if unit else inv
        back = ip.fbits(ip.shl(field + unit, 23, None)) if unit else None
    sc = ip.fbits(ip.shl(field, 23, field))
    if back is None:
        back = sc
    _ORDINARY[:] = [(sc, fwd, back, e_lo)]
    return sc, inv


def _pow2_small(k, o):
    """2.0**k as float32 for int32 k in [-127, 127] (normal, or the one subnormal 2**-127), from bits."""
    ip = inplace_ops(o)
    bits = o.where(k >= -126, (k + 127) << 23, 0x00400000)
    return ip.fbits(ip.contiguous(o.astype(bits, o.int32)))


def _slab_stats(xb, r, need_minmax, cheap=False):
    """Statistics of one slab's blocks (blocked-scale layout): (absmax, lo, hi) with lo/hi None unless needed.

    ``cheap`` (bfp16, see ``iter_slabs``): (absmax, None, the maximum of x's bits as int32, as a float32 view):
    two reductions and no order keys. For blocks with a positive element that maximum is the bits of the
    largest one; otherwise it is <= 0 (as an int), below every positive threshold: all the bump rule needs.

    Reductions over the float32 bits as int32 (monotone keys): integer max/min vectorise well over the short
    inner axes of small blocks, where float reductions do not; NaN has the largest magnitude key, so a NaN in a
    block still makes its statistic NaN."""
    ip = r.ip
    red = tuple(range(1, 2 * len(r.cshape), 2))
    k = r.scratch(xb, "i")
    if ip.name == "numpy" and len(r.cshape) == 1:
        # Blocks are contiguous runs. Small power-of-two blocks: halving (the elementwise max of the even and odd
        # entries, log2(t) times) runs at memory speed, 2-8x faster than reduceat over blocks of 16 or 8; other
        # sizes: reduceat, about twice as fast as a reduction over a short axis.
        t, shape = int(xb.shape[1]), tuple(xb.shape[:1]) + (1,)  # t < the tile in a short last block row
        if t & (t - 1) == 0 and 2 <= t <= 16:
            buf = r.a.view(np.int32)

            def amax(a, _):
                return _np_halving(np.maximum, a.reshape(-1), t, buf).reshape(shape)

            def amin(a, _):
                return _np_halving(np.minimum, a.reshape(-1), t, buf).reshape(shape)
        else:
            starts = np.arange(0, k.size, t)

            def amax(a, _):
                return np.maximum.reduceat(a.reshape(-1), starts).reshape(shape)

            def amin(a, _):
                return np.minimum.reduceat(a.reshape(-1), starts).reshape(shape)
    else:
        amax, amin = ip.amax, ip.amin
    if cheap:
        ip.band(ip.ibits(xb), 0x7FFFFFFF, k)
        top = amax(k, red)
        raw = amax(ip.ibits(xb), red)
        return ip.fbits(ip.contiguous(top)), None, ip.fbits(ip.contiguous(raw))
    if need_minmax:
        _order_keys(ip.ibits(xb), k, ip)
        lo, hi = _from_keys(amin(k, red), ip), _from_keys(amax(k, red), ip)
        with r.o.quiet():
            return r.o.maximum(r.o.abs(lo), r.o.abs(hi)), lo, hi
    ip.band(ip.ibits(xb), 0x7FFFFFFF, k)
    r.abs_of = xb  # k (the "i" scratch) holds |x| of this slab until a kernel overwrites it
    t = int(xb.shape[-1])
    if r.pm is not None and t % 2 == 0:
        # Shared microexponents: the pairs' maxima first (kept: the kernel's shift flags come from them), then
        # the block maxima over them (half the elements of a reduction over the whole block).
        kf = k.reshape(-1)
        pm = r.pm[:kf.shape[0] // 2]
        ip.max2(kf[0::2], kf[1::2], pm)
        r.pm_of = xb
        pmb = pm.reshape(tuple(xb.shape[:-1]) + (t // 2,))
        if ip.name == "numpy" and len(r.cshape) == 1 and t // 2 in (2, 4, 8, 16):
            m = _np_halving(np.maximum, pm, t // 2, r.a.view(np.int32)).reshape(tuple(xb.shape[:1]) + (1,))
        elif ip.name == "numpy" and len(r.cshape) == 1:
            m = np.maximum.reduceat(pm, np.arange(0, pm.size, t // 2)).reshape(tuple(xb.shape[:1]) + (1,))
        else:
            m = ip.amax(pmb, red)
        return ip.fbits(ip.contiguous(m)), None, None
    return ip.fbits(ip.contiguous(amax(k, red))), None, None


def _np_halving(ufunc, a, t, buf):
    """``ufunc`` (np.maximum / np.minimum) over contiguous runs of ``t`` (a power of two) of the 1-D ``a``, by
    halving: each step combines the even and odd entries. The steps alternate between the two halves of ``buf``
    (at least ``a.size`` entries, a's dtype) so no step reads what it writes; the result is a new array."""
    n = a.size
    half = n // 2
    regions = (buf[:half], buf[half:2 * half])
    m = a
    step = 0
    while t > 1:
        n //= 2
        out = regions[step % 2][:n]
        ufunc(m[0::2], m[1::2], out=out)
        m, t, step = out, t // 2, step + 1
    return m.copy()


def iter_slabs(x, spec, scale, zero_point, o, r):
    """Yield ``(r0, r1, brow, xb, scales, inv, zp)`` per slab (parameters in blocked-scale layout); afterwards
    ``r.scales`` / ``r.zps`` hold the public arrays.

    Where every slab holds whole blocks and scales are computed (the usual case), each slab's parameters are
    computed right after its statistics, while the slab is still in cache; otherwise (blocks spanning slabs, or
    given scales) all parameters first, then the slabs."""
    fused = scale is None and all(b is None for _, _, b in r.plan)
    if spec.two_level and not fused:
        scales = check_param(scale, spec.scale_shape(tuple(x.shape)), "scale", o, x)
        q_mul, dq_mul = two_level_multipliers(scales, r.g, o)
        r.scales, r.zps = scales, None
        for r0, r1, brow in r.plan:
            yield (r0, r1, brow, r.slab_in(x, r0, r1), r.per_slab(dq_mul, r0, r1, brow),
                   r.per_slab(q_mul, r0, r1, brow), None)
        return
    if not fused:
        scales, inv, zp, _ = params(x, spec, scale, zero_point, o, r)
        r.scales, r.zps = scales, zp
        for r0, r1, brow in r.plan:
            yield (r0, r1, brow, r.slab_in(x, r0, r1), r.per_slab(scales, r0, r1, brow),
                   r.per_slab(inv, r0, r1, brow), r.per_slab(zp, r0, r1, brow))
        return
    sshape = spec.scale_shape(tuple(x.shape))
    need_minmax = (not spec.symmetric) or spec.bump_on_overflow
    ip = r.ip
    full_s = ip.empty(tuple(r.cscale), ip.f32, x) if ip.name == "torch" else np.empty(r.cscale, np.float32)
    full_z = None
    if not spec.symmetric:
        full_z = ip.empty(tuple(r.cscale), ip.f32, x) if ip.name == "torch" else np.empty(r.cscale, np.float32)
    t0 = r.ctile[0]
    # bfp16 (FLOOR scales with the bump): per slab first the cheap statistics (|x| max and the raw-bits max),
    # enough for an ordinary slab (_floor_e8m0_params); any other slab computes the full min/max statistics.
    emax_eff = element_emax_and_max(spec.dtype, spec.unit_exponent)[0] if spec.pow2_scale else -1
    cheap = (spec.bump_on_overflow and spec.scale_mode is ScaleMode.FLOOR and emax_eff >= 0
             and not spec.two_level)
    for r0, r1, _ in r.plan:
        xb = r.slab_in(x, r0, r1)
        quick = None
        if cheap:
            amax, _, hi = _slab_stats(xb, r, need_minmax, cheap=True)
            quick = _floor_e8m0_params(amax, hi, emax_eff, spec, o)
        if quick is not None:
            sc, inv = quick
            zp, pub = None, sc
        elif spec.two_level:  # the public scales are the block scales; the kernels take the two multipliers
            amax, lo, hi = _slab_stats(xb, r, need_minmax)
            pub, inv, sc = two_level_scales(amax, r.g, spec, o)
            zp = None
        else:
            amax, lo, hi = _slab_stats(xb, r, need_minmax)
            sc, inv, zp = _params_from_stats(amax, lo, hi, spec, o, x)
            pub = sc
        b0, b1 = r0 // t0, -(-r1 // t0)
        ip.copy_to(full_s[b0:b1], pub.reshape(tuple(full_s[b0:b1].shape)))
        if zp is not None:
            ip.copy_to(full_z[b0:b1], zp.reshape(tuple(full_z[b0:b1].shape)))
        yield r0, r1, None, xb, sc, inv, zp
    r.scales = full_s.reshape(sshape)
    r.zps = None if full_z is None else full_z.reshape(sshape)


def _slab_params(arr, cscale_shape, r0, r1, ctile, brow):
    """The rows of a canonical-scale-shaped array that a slab uses, in blocked-scale layout (n0, 1, n1, 1, ...)."""
    if arr is None:
        return None
    t0 = ctile[0]
    a = arr.reshape(tuple(cscale_shape))
    a = a[brow:brow + 1] if brow is not None else a[r0 // t0:-(-r1 // t0)]
    shape = []
    for n in a.shape:
        shape += [n, 1]
    return a.reshape(tuple(shape))


# ---------------------------------------------------------------------------------------------------------------
# Element kernels (one slab, blocked views; ``out`` may be the output slab).
# ---------------------------------------------------------------------------------------------------------------


def _scale_abs(xb, inv, sc, spec, ip, a):
    """a = |x| / scale (exact multiplication by 2**-s for power-of-two scales)."""
    ip.abs(xb, a)
    if inv is not None:
        ip.mul(a, inv, a)
    else:
        ip.div(a, sc, a)
    return a


def _fake_float(xb, sc, inv, spec, ip, a, ib, out):
    d = spec.dtype
    _scale_abs(xb, inv, sc, spec, ip, a)
    ip.min_(a, np.float32(d.max_finite))
    round_float_abs(a, d, ip, ib)
    ip.band(ip.ibits(xb), -0x80000000, ib)  # x's sign bit back onto the rounded magnitude (-0 kept)
    ip.bor(ip.ibits(a), ib, ip.ibits(out))
    if d.specials is Specials.FNUZ:
        ip.add(out, np.float32(0.0), out)  # FNUZ has no -0
    ip.mul(out, sc, out)
    return out


def _int_factors(spec, sc, inv, o):
    """Per-block multipliers for integer elements: forward (x -> code units) and back (code units -> value),
    each exact; None for the forward one where it would leave float32's range (then two steps are taken)."""
    e = _ordinary(sc)
    if e is not None and e[1] is not None:
        return e[1], e[2], inv  # made with sc, from the bits (_floor_e8m0_params)
    unit = spec.unit_exponent
    if inv is None:
        return None, sc, None
    fwd = inv * np.float32(2.0 ** -unit) if unit else inv
    if unit and o.any(o.isinf(fwd)):
        fwd = None  # some block needs 2**-s * 2**-unit beyond 2**127: multiply twice
    return fwd, _int_back(spec, sc, o), inv


def _int_back(spec, sc, o):
    """scale * 2**unit_exponent per block (exact), or None if that underflows for some block (generic path)."""
    unit = spec.unit_exponent
    if not unit:
        return sc
    back = sc * np.float32(2.0 ** unit)
    if o.any(o.logical_and(back == 0, sc > 0)):
        return None
    return back


def _int_codes_float(xb, sc, fwd, inv, zp, spec, ip, a):
    """a = clip(rint(x / scale) + zero point, qmin, qmax) as float32, with -0 made +0 (integer codes).
    ``a``: the buffer to write, or None (a new one)."""
    if inv is None:
        a = ip.div(xb, sc, a)
    elif fwd is not None:
        a = ip.mul(xb, fwd, a)
    else:
        a = ip.mul(xb, inv, a)
        ip.mul(a, np.float32(2.0 ** -spec.unit_exponent), a)
    ip.rint_(a)
    if zp is not None:
        ip.add(a, zp, a)
    else:
        ip.add(a, np.float32(0.0), a)  # -0 -> +0
    ip.clamp_(a, np.float32(spec.qmin), np.float32(spec.qmax))
    return a


def _fake_int(xb, sc, fwd, back, inv, zp, spec, ip, a, out):
    """Integer fake-quantize into ``out``; ``a`` (scratch) and ``out`` may be None: the codes' buffer, made by
    the first operation, then holds the result."""
    a = _int_codes_float(xb, sc, fwd, inv, zp, spec, ip, a)
    if zp is not None:
        ip.sub(a, zp, a)
    return ip.mul(a, back, a if out is None else out)


_SHIFT_PAIR = (1 << 23) | (1 << 55)


def _dup_shift(d, ip, l1, l2):
    """Per-pair flags ``d`` (bool, one per pair) -> int64 per pair holding ``d << 23`` in both float32 halves: added
    to (or subtracted from) the bits of a constant pair it multiplies (divides) both elements by ``2**d``:
    ``d * (2**23 + 2**55)`` (d is 0 or 1). Integer flags (stored shifts) are widened to int64 first (torch
    computes int32 * a Python int in int32)."""
    k = ip.scalar64(_SHIFT_PAIR)
    if str(d.dtype) not in ("bool", "torch.bool"):
        ip.copy_to(l1, d)
        return ip.mul(l1, k, l1)
    return ip.mul(d, k, l1)


def _pair64(v: float) -> int:
    b = int(np.array(v, np.float32).view(np.int32))
    return b | (b << 32)


def _microexp_round(xb, inv, spec, ip, o, r, a, ib):
    """Shared-microexponent rounding in units of the block scale. Returns (|rounded| as float32 view of ``ib``,
    ``a`` holding y = x * 2**-s, the per-pair shift flags d, their int64 shift S).

    With y = x * 2**-s (|y| < 2), a pair shifts (d = 1) iff both |y| < 1 (the same comparison as both exponents
    below the shared one); its elements round to multiples of 2**-(m + d) by one add and subtract of
    C = 1.5 * 2**(23 - m - d) and clamp at (2 - 2**-m) * 2**-d. The per-element constants come from per-pair ones
    by an exponent shift in int64 pairs, so no operation broadcasts over the pairs' tiny inner axis."""
    m = spec.dtype.mantissa_bits
    n = a.size if ip.name == "numpy" else a.numel()
    if r.abs_of is xb:  # the statistics left |x| in ib: |y| = |x| * 2**-s in place (exact, as |x * 2**-s|)
        absx = ip.fbits(ib).reshape(tuple(xb.shape))
        ip.mul(absx, inv, absx)
    else:
        ip.mul(xb, inv, a)
        ip.band(ip.ibits(a), 0x7FFFFFFF, ib)
    r.abs_of = None
    fa = ip.fbits(ib).reshape(-1)
    pm = ip.maximum(fa[0::2], fa[1::2])
    d = pm < np.float32(1.0)
    l1, l2 = r.l64[:n // 2], r.l64b[:n // 2]
    sh = _dup_shift(d, ip, l1, l2)
    c = ip.sub(ip.scalar64(_pair64(1.5 * 2.0 ** (23 - m))), sh, l2)
    cf = ip.fbits(ip.i32view(c))
    ip.add(fa, cf, fa)
    ip.sub(fa, cf, fa)
    b = ip.sub(ip.scalar64(_pair64(2.0 - 2.0 ** -m)), sh, l2)
    ip.min2(fa, ip.fbits(ip.i32view(b)), fa)
    return fa, d, sh


def _fake_microexp(xb, sc, inv, spec, ip, o, r, a, ib, out):
    """MX9/MX6/MX4 fake-quantize of one slab: the rounded magnitude gets x's sign back, then the block scale."""
    fa, d, sh = _microexp_round(xb, inv, spec, ip, o, r, a, ib)
    ai = ip.ibits(a).reshape(-1)
    ip.band(ip.ibits(xb).reshape(-1), -0x80000000, ai)  # the sign of x (= the sign of y)
    ii = ip.ibits(fa)
    ip.bor(ii, ai, ii)
    ip.mul(ip.fbits(ii).reshape(tuple(xb.shape)), sc, out)
    return out


def _fake_microexp_scaled(xb, sc, inv, spec, ip, r, a, out):
    """MX9/MX6/MX4 fake-quantize of an ordinary slab in fewer passes, or False (then ``_fake_microexp``).

    In units of the element step: with z = x * 2**(m + d - s), an element is round(z) (nearest-even, the sign
    and -0 kept) clamped to +-(2**(m + 1) - 1), times 2**(s - m - d): the same value as ``_microexp_round``'s
    magnitude grid 2**-(m + d) and bound (2 - 2**-m) * 2**-d, with scalar constants instead of per-element ones.
    The pair flag d (both |x| < 2**s) comes from the statistics' pair maxima ``r.pm`` compared with the bits of
    2**s; the factor 2**d is an exponent increment of z's bits (int64 pairs), exact for normal z and harmless for
    zero or subnormal z (they round to +-0 either way: |z| < 2**-125).

    Only for a slab whose statistics just ran (``r.pm_of is xb``) and whose blocks are all ordinary
    (``_floor_e8m0_params``) with ``e = s + 127 >= m + 2``: then 2**(m - s) and 2**(s - m) are normal and every
    product is exact (no overflow, no underflow of a nonzero result)."""
    m = spec.dtype.mantissa_bits
    e = _ordinary(sc)
    if r.pm_of is not xb or e is None or e[3] < m + 2:
        return False
    n = a.size if ip.name == "numpy" else a.numel()
    pm = r.pm[:n // 2].reshape(tuple(xb.shape[:-1]) + (int(xb.shape[-1]) // 2,))
    d = (pm < ip.ibits(sc)).reshape(-1)  # both |x| of the pair below 2**s (2**s normal here)
    sh = _dup_shift(d, ip, r.l64[:n // 2], None)
    torch_ = ip.name == "torch"
    inv_m = ip.mul(inv, float(2.0 ** m) if torch_ else np.float32(2.0 ** m), None)
    ip.mul(xb, inv_m, a)  # z / 2**d = x * 2**(m - s), exact
    af = a.reshape(-1)
    ai = af.view(ip.t.int64) if torch_ else af.view(np.int64)
    ip.add(ai, sh, ai)  # z = x * 2**(m + d - s)
    ip.rint_(af)
    top = np.float32(2.0 ** (m + 1) - 1)
    ip.clamp_(af, float(-top) if torch_ else -top, float(top) if torch_ else top)
    back = ip.sub(ip.scalar64(_pair64(1.0)), sh, r.l64b[:n // 2])  # 2**-d per element
    ip.mul(af, ip.fbits(ip.i32view(back)), af)
    sc_m = ip.mul(sc, float(2.0 ** -m) if torch_ else np.float32(2.0 ** -m), None)
    ip.mul(a.reshape(tuple(xb.shape)), sc_m, out)
    return True


def _codes_microexp(xb, sc, inv, spec, ip, o, r, a, ib, cb):
    """MX9/MX6/MX4 codes (sign-magnitude, sign at bit m + 1) and the per-pair shifts."""
    m = spec.dtype.mantissa_bits
    fa, d, sh = _microexp_round(xb, inv, spec, ip, o, r, a, ib)
    f = ip.add(ip.scalar64(_pair64(2.0 ** m)), sh, sh)  # 2**(m + d) per element
    ip.mul(fa, ip.fbits(ip.i32view(f)), fa)
    mag = ip.ibits(a).reshape(-1)
    ip.copy_to(mag, fa)
    sgn = ip.ibits(fa)  # reuse: sign bit of x moved to bit m + 1
    ip.shr(ip.ibits(xb).reshape(-1), 31 - (m + 1), sgn)
    ip.band(sgn, 1 << (m + 1), sgn)
    ip.bor(mag, sgn, mag)
    ip.copy_to(cb, mag.reshape(tuple(cb.shape)))
    return d


# ---------------------------------------------------------------------------------------------------------------
# Drivers.
# ---------------------------------------------------------------------------------------------------------------
class _Run:
    """Everything one call needs: canonical layout, slab plan, scratch buffers.

    Axes other than 0 whose length is not a multiple of the tile (a short last group) are padded with zeros slab
    by slab (as the generic path pads the whole array): ``slab_in`` copies a slab into a padded buffer, kernels
    write a padded output buffer, ``slab_done`` copies the valid part back.
    """

    def __init__(self, x, spec, o, ip):
        self.o, self.ip, self.spec = o, ip, spec
        shape = tuple(x.shape) if tuple(x.shape) else (1,)
        tile = tuple(tile_shape(spec.granularity, shape))
        lead = len(shape) == 1 and shape[0] % tile[0] != 0 and bool(spec.subblock_shift_bits)
        if lead:  # pairs of a short last group need the padding only axes other than 0 get
            shape, tile = (1,) + shape, (1,) + tile
        self.shape = shape
        self.pshape = (shape[0],) + tuple(-(-s // t) * t for s, t in zip(shape[1:], tile[1:]))
        self.public_pshape = self.pshape[1:] if lead else self.pshape
        self.ragged = self.pshape != self.shape
        if self.ragged:  # slabs are whole rows of axis 0, so axis 0 stays on its own
            rest = canonical(self.pshape[1:], tile[1:])
            self.cshape, self.ctile = [shape[0]] + rest[0], [tile[0]] + rest[1]
        else:
            self.cshape, self.ctile = canonical(self.pshape, tile)
        self.cscale = [-(-s // t) if s else 0 for s, t in zip(self.cshape, self.ctile)]
        self.plan = slabs(self.cshape, self.ctile, slab_size(o))
        rowsize = 1
        for s in self.cshape[1:]:
            rowsize *= s
        self.rowsize = rowsize
        prow = 1
        for s in self.pshape[1:]:
            prow *= s
        self.prow = prow  # elements per row of axis 0 of the (padded) input
        self.maxn = max((r1 - r0) * rowsize for r0, r1, _ in self.plan) if self.plan else 0
        self.a = ip.empty(self.maxn, ip.f32, x)
        self.ib = ip.empty(self.maxn, ip.i32, x)
        self.pm = None
        if spec.subblock_shift_bits:
            i64 = np.int64 if ip.name == "numpy" else ip.t.int64
            self.l64 = ip.empty(self.maxn // 2, i64, x)
            self.l64b = ip.empty(self.maxn // 2, i64, x)
            if spec.subblock_size == 2:
                self.pm = ip.empty(self.maxn // 2, ip.i32, x)  # the pairs' |x| maxima (_slab_stats)
        self.like = x
        self._pads = {}
        self.abs_of = None  # the slab whose |x| bits the "i" scratch holds (_slab_stats), if any
        self.pm_of = None  # the slab whose pairs' maxima ``pm`` holds, if any

    def _rows(self, r0, r1):
        """Canonical rows r0:r1 as rows of axis 0 of the input (canonical axis 0 may merge leading axes)."""
        return r0 * self.rowsize // self.prow, r1 * self.rowsize // self.prow

    def _pad(self, key, n, dtype):
        buf = self._pads.get(key)
        if buf is None:
            buf = self.ip.empty(self.maxn, dtype, self.like)
            self._pads[key] = buf
        return buf[:n]

    def slab_in(self, arr, r0, r1, key="in"):
        """The slab of ``arr`` (input shape) in blocked canonical layout; a zero-padded copy where ragged."""
        if not self.ragged:
            s = arr.reshape(tuple(self.cshape))[r0:r1]
            return _blocked_view(s, self.ctile, r1 - r0)
        arr = arr.reshape(self.shape)
        a0, a1 = self._rows(r0, r1)
        n = (r1 - r0) * self.rowsize
        buf = self._pad(key, n, arr.dtype).reshape((a1 - a0,) + self.pshape[1:])
        _zero(buf, self.ip)
        buf[(slice(None),) + tuple(slice(0, s) for s in self.shape[1:])] = arr[a0:a1]
        return _blocked_view(buf.reshape((r1 - r0,) + tuple(self.cshape[1:])), self.ctile, r1 - r0)

    def slab_out(self, arr, r0, r1, key="out"):
        """Where a kernel writes the slab: a view of ``arr``, or a padded buffer (then call ``slab_done``)."""
        if not self.ragged:
            return self.slab_in(arr, r0, r1)
        n = (r1 - r0) * self.rowsize
        return _blocked_view(self._pad(key, n, arr.dtype).reshape((r1 - r0,) + tuple(self.cshape[1:])),
                             self.ctile, r1 - r0)

    def slab_done(self, arr, buf, r0, r1):
        if not self.ragged:
            return
        arr = arr.reshape(self.shape)
        a0, a1 = self._rows(r0, r1)
        b = buf.reshape((a1 - a0,) + self.pshape[1:])
        self.ip.copy_to(arr[a0:a1], b[(slice(None),) + tuple(slice(0, s) for s in self.shape[1:])])

    def pairs(self, shifts, r0, r1):
        """The sub-block shifts of a slab (flat; one per pair of elements of the padded layout)."""
        return shifts.reshape(-1)[r0 * self.rowsize // 2:r1 * self.rowsize // 2]

    def scratch(self, xb, which):
        n = 1
        for v in xb.shape:
            n *= v
        buf = self.a if which == "f" else self.ib
        return buf[:n].reshape(tuple(xb.shape))

    def per_slab(self, arr, r0, r1, brow):
        return _slab_params(arr, self.cscale, r0, r1, self.ctile, brow)


def _zero(buf, ip):
    if ip.name == "numpy":
        buf.fill(0)
    else:
        buf.zero_()


def _is_int_array(a) -> bool:
    dt = a.dtype
    if isinstance(dt, np.dtype):
        return dt.kind in "iu"
    return not (dt.is_floating_point or dt.is_complex or str(dt) == "torch.bool")


def run_fake_quantize(x, spec, scale, zero_point, o, *, tensor_scale=None):
    """Fast fake_quantize, or None when the spec or layout is not covered (the caller uses the generic path)."""
    kind = kernel_kind(spec)
    if kind is None or is_empty(x) or (kind == "microexp" and not _group_last(spec, x)):
        return None
    ip = inplace_ops(o)
    x = f32_contiguous(x, o)
    if scale is not None and kind != "microexp" and isinstance(spec.granularity, (PerTensor, PerChannel)) \
            and _numel(x) <= slab_size(o) and not spec.two_level:
        return _small_given(x, spec, scale, zero_point, kind, o, ip)
    r = _Run(x, spec, o, ip)
    r.g = _tensor_scale(x, spec, tensor_scale, o, ip) if spec.two_level else None
    out = ip.empty(tuple(x.shape), ip.f32, x) if o.name == "torch" else np.empty(x.shape, np.float32)
    with o.quiet():
        for r0, r1, brow, xb, sc, inv, zp in iter_slabs(x, spec, scale, zero_point, o, r):
            ob = r.slab_out(out, r0, r1)
            a, ib = r.scratch(xb, "f"), r.scratch(xb, "i")
            if kind == "float":
                _fake_float(xb, sc, inv, spec, ip, a, ib, ob)
            elif kind == "int":
                fwd, back, inv2 = _int_factors(spec, sc, inv, o)
                if back is None:
                    return None
                _fake_int(xb, sc, fwd, back, inv2, zp, spec, ip, a, ob)
            elif not _fake_microexp_scaled(xb, sc, inv, spec, ip, r, a, ob):
                _fake_microexp(xb, sc, inv, spec, ip, o, r, a, ib, ob)
            r.abs_of = r.pm_of = None
            bad = _bad_blocks(sc, o)
            if bad is not None:
                ip.fill_where(ob, bad, np.float32(math.nan))
            r.slab_done(out, ob, r0, r1)
    return out


def generic_rows(fn, x, spec, scale, zero_point, key, o, *, tensor_scale=None):
    """The generic function ``fn(x_rows, None, None, key, ...)`` applied to slabs of whole rows of axis 0 (the
    memory bound for specs the fast kernels do not cover), or None where that would change the result: given
    parameters, blocks that span rows (per-tensor, per-channel along another axis), two-level scales (a
    tensor-wide scale) and stochastic rounding (its random bits follow the flat element index)."""
    shape = tuple(x.shape)
    if (scale is not None or zero_point is not None or tensor_scale is not None or spec.two_level or not shape
            or spec.rounding is RoundingMode.STOCHASTIC or _numel(x) <= slab_size(o)):
        return None
    t0 = tile_shape(spec.granularity, shape)[0]
    if t0 >= shape[0]:
        return None
    rowsize = _numel(x) // shape[0]
    step = max(1, slab_size(o) // max(1, t0 * rowsize)) * t0
    ip = inplace_ops(o)
    out = ip.empty(shape, ip.f32, x) if o.name == "torch" else np.empty(shape, np.float32)
    for r0 in range(0, shape[0], step):
        ip.copy_to(out[r0:r0 + step], fn(x[r0:r0 + step], None, None, key, spec=spec))
    return out


def _numel(x) -> int:
    n = 1
    for v in x.shape:
        n *= int(v)
    return n


def _small_given(x, spec, scale, zero_point, kind, o, ip):
    """Small tensors with given per-tensor or per-channel parameters (GPTQ's column step): the parameters
    already broadcast against x, so the kernels run on x directly, with no slab machinery."""
    scales, inv, zp, _ = params(x, spec, scale, zero_point, o, None)
    return small_kernels(x, spec, scales, inv, zp, kind, o, ip)


def small_given_prepared(x, spec, scales, zp, kind, o):
    """``_small_given`` for parameters already validated and shaped (``qcore.fake_quantizer``)."""
    inv = inverse_pow2_scales(scales, o, x) if spec.pow2_scale else None
    return small_kernels(x, spec, scales, inv, zp, kind, o, inplace_ops(o))


def small_kernels(x, spec, scales, inv, zp, kind, o, ip):
    with o.quiet():
        if kind == "int":
            fwd, back, inv2 = _int_factors(spec, scales, inv, o)
            if back is None:
                return None
            return _fake_int(x, scales, fwd, back, inv2, zp, spec, ip, None, None)
        out = ip.empty(tuple(x.shape), ip.f32, x) if o.name == "torch" else np.empty(x.shape, np.float32)
        ib = ip.empty(tuple(x.shape), ip.i32, x) if o.name == "torch" else np.empty(x.shape, np.int32)
        _fake_float(x, scales, inv, spec, ip, out, ib, out)
        bad = _bad_blocks(scales, o)
        if bad is not None:
            ip.fill_where(out, bad, np.float32(math.nan))
    return out


def _group_last(spec, x) -> bool:
    g = spec.granularity
    return isinstance(g, PerGroup) and len(x.shape) >= 1 and g.axis % len(x.shape) == len(x.shape) - 1


def run_quantize(x, spec, scale, zero_point, o, *, tensor_scale=None):
    """Fast quantize -> (codes, scales, zero points, shifts, tensor scale), or None (generic path)."""
    kind = kernel_kind(spec)
    if kind is None or is_empty(x) or (kind == "microexp" and not _group_last(spec, x)):
        return None
    ip = inplace_ops(o)
    x = f32_contiguous(x, o)
    if scale is not None and o.any(o.isnan(x)):
        return None  # NaN elements under a given scale: the generic path encodes (or refuses) them
    r = _Run(x, spec, o, ip)
    r.g = _tensor_scale(x, spec, tensor_scale, o, ip) if spec.two_level else None
    d = spec.dtype
    if isinstance(d, IntDType):
        cdt = (ip.i8 if d.signed else ip.u8) if d.bits <= 8 else ip.i32
    else:
        cdt = ip.u8 if d.bits <= 8 else ip.i32
    codes = ip.empty(tuple(x.shape), cdt, x) if o.name == "torch" else np.empty(x.shape, cdt)
    shifts = None
    if kind == "microexp":
        sh_shape = tuple(r.public_pshape[:-1]) + (r.public_pshape[-1] // 2,)
        shifts = ip.empty(sh_shape, ip.i32, x) if o.name == "torch" else np.empty(sh_shape, np.int32)
    with o.quiet():
        for r0, r1, brow, xb, sc, inv, zp in iter_slabs(x, spec, scale, zero_point, o, r):
            cb = r.slab_out(codes, r0, r1)
            a, ib = r.scratch(xb, "f"), r.scratch(xb, "i")
            if kind == "float":
                _codes_float(xb, sc, inv, spec, ip, a, ib, cb)
            elif kind == "int":
                fwd, _, inv2 = _int_factors(spec, sc, inv, o)
                _int_codes_float(xb, sc, fwd, inv2, zp, spec, ip, a)
                ip.copy_to(cb, a)
            else:
                dsh = _codes_microexp(xb, sc, inv, spec, ip, o, r, a, ib, cb)
                sh = r.pairs(shifts, r0, r1)
                ip.copy_to(sh, dsh.reshape(tuple(sh.shape)))
            bad = _bad_blocks(sc, o)
            if bad is not None:  # NaN blocks: codes 0 (their scale carries the NaN)
                ip.fill_where(cb, bad, 0)
            r.slab_done(codes, cb, r0, r1)
    return codes, r.scales, r.zps, shifts, r.g


def _tensor_scale(x, spec, given, o, ip):
    """Two-level specs: the tensor scale g, with AMAX's tensor absmax as a slab-wise integer reduction."""
    if given is not None:
        return given
    if spec.tensor_scale_mode is TensorScale.ONE:
        return f32_const(1.0, o, x)
    xf = ip.flat(x)
    n = _numel(x)
    step = slab_size(o)
    buf = ip.empty(min(n, step), ip.i32, x)
    best = None
    for i in range(0, n, step):
        k = buf[:min(n, i + step) - i]
        ip.band(ip.ibits(xf[i:i + step]), 0x7FFFFFFF, k)
        m = ip.amax(k, (0,))
        best = m if best is None else ip.maximum(best, m)
    amax = o.reshape(ip.fbits(ip.contiguous(best)), ())
    return tensor_scale_from_amax(amax, spec, o, x)


def _bad_blocks(scales, o):
    """Blocks with a NaN scale (a NaN or Inf met by the statistic), or None when there are none. Their outputs are
    the canonical NaN 0x7FC00000, as dequantize gives them (0 * NaN scale)."""
    if _ordinary(scales) is not None:
        return None  # every block ordinary (_floor_e8m0_params)
    bad = o.isnan(scales)
    return bad if o.any(bad) else None


def _codes_float(xb, sc, inv, spec, ip, a, ib, cb):
    """Bit codes of the rounded elements: magnitude from the exponent-rebiased grid value, sign from x."""
    d = spec.dtype
    e, m = d.exponent_bits, d.mantissa_bits
    _scale_abs(xb, inv, sc, spec, ip, a)
    ip.min_(a, np.float32(d.max_finite))
    round_float_abs(a, d, ip, ib)
    # a * 2**(bias - 127) puts d's exponent field into float32's (d's subnormals become float32 subnormals with
    # the same mantissa bits); exact, since a is on d's grid.
    ip.mul(a, np.float32(2.0 ** (d.bias - 127)), a)
    mag = ip.ibits(a)
    ip.shr(mag, 23 - m, mag)
    sgn = ip.shr(ip.ibits(xb), 31 - (e + m), ib)
    ip.band(sgn, 1 << (e + m), sgn)
    if d.specials is Specials.FNUZ:  # no -0: the sign only where the magnitude is not zero
        nz = mag != 0
        ip.mul(sgn, nz, sgn)
    ip.bor(mag, sgn, mag)
    ip.copy_to(cb, mag)
    return cb


def run_dequantize(q, o):
    """Fast dequantize, or None (generic path)."""
    spec = q.spec
    kind = kernel_kind(spec)
    if kind is None:
        return None
    codes = q.codes
    if kind == "microexp" and not _group_last(spec, codes):
        return None
    if is_empty(codes) or not _is_int_array(codes):
        return None  # the generic path raises its errors (or handles empty arrays)
    ip = inplace_ops(o)
    codes = ip.contiguous(codes)
    r = _Run(codes, spec, o, ip)
    d = spec.dtype
    out = ip.empty(tuple(codes.shape), ip.f32, codes) if o.name == "torch" else np.empty(codes.shape, np.float32)
    scales = q.scales
    zp = q.zero_points
    table = None
    _check_code_range(codes, d, o)
    if kind != "int":
        table = _code_table(d, o, codes)
    with o.quiet():
        if kind == "int":
            back = _int_back(spec, scales, o)
            if back is None:
                return None
        if spec.two_level:
            g = o.reshape(o.asarray(q.tensor_scale, o.float32, codes), ())
            _, scales = two_level_multipliers(scales, g, o)  # value = element * fl(g * block scale)
        bad = _bad_blocks(scales, o)
        for r0, r1, brow in r.plan:
            cb = r.slab_in(codes, r0, r1)
            cs = cb
            ob = r.slab_out(out, r0, r1)
            sc = r.per_slab(scales, r0, r1, brow)
            if kind == "int":
                ip.copy_to(ob, cb)
                if zp is not None:
                    ip.sub(ob, r.per_slab(zp, r0, r1, brow), ob)
                ip.mul(ob, r.per_slab(back, r0, r1, brow), ob)
            elif kind == "float":
                _lookup(table, cs, ob, ip, r)
                ip.mul(ob, sc, ob)
            else:
                _lookup(table, cs, ob, ip, r)
                n = (r1 - r0) * r.rowsize
                dd = _dup_shift(r.pairs(q.subblock_shifts, r0, r1), ip, r.l64[:n // 2], r.l64b[:n // 2])
                f = ip.sub(ip.scalar64(_pair64(1.0)), dd, dd)  # 2**-d per element
                of = ob.reshape(-1)
                ip.mul(of, ip.fbits(ip.i32view(f)), of)
                ip.mul(ob, sc, ob)
            if bad is not None:
                ip.fill_where(ob, r.per_slab(bad, r0, r1, brow), np.float32(math.nan))
            r.slab_done(out, ob, r0, r1)
    return out


def _code_table(d, o, like):
    n = 1 << d.bits
    if o.name == "torch":
        return decode(o.t.arange(n, dtype=o.t.int32, device=like.device), d)
    return decode(np.arange(n, dtype=np.int32), d)


def _check_code_range(codes, d, o):
    """Codes outside ``d``'s range raise decode's ValueError (two reductions; none where the container is
    exactly the format's width)."""
    if isinstance(d, IntDType):
        lo, hi = d.min, d.max
    else:
        lo, hi = 0, (1 << d.bits) - 1
    full = {(-128, 127): "int8", (0, 255): "uint8"}.get((lo, hi))
    if full is not None and str(codes.dtype).endswith(full) and not str(codes.dtype).endswith("u" + full):
        return
    if o.any(o.amin(codes, None, keepdims=False) < lo) or o.any(o.amax(codes, None, keepdims=False) > hi):
        decode(codes, d)  # raises, naming the first bad code
        raise ValueError(f"codes out of range for {d.name}: valid codes are {lo}..{hi}")


def _lookup(table, cs, ob, ip, r):
    if ip.name == "numpy":
        np.take(table, cs, out=ob.reshape(cs.shape))
        return
    idx = r.ib[:cs.numel()]
    idx.copy_(cs.reshape(-1))
    ip.t.index_select(table, 0, idx, out=ob.reshape(-1))



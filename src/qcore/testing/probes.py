"""Probe inputs: the float32 values on which a low-precision kernel is most likely to be wrong.

``probes(fmt)`` returns one float32 array; ``probes_by_kind(fmt)`` returns the same values split by *kind*
(an ordered ``dict[str, np.ndarray]``; ``probes(fmt)`` is exactly the kinds concatenated along axis 0 in this
order). Everything is deterministic: the random kinds draw from ``numpy.random.default_rng`` seeded by ``key``.
Kinds that would be empty (the random kinds with ``random=0``; float32's midpoints, which float32 cannot hold)
are left out of the dict. numpy only: this module never imports torch.

Element formats (a ``FloatDType`` or ``IntDType``, or its name: ``"float4_e2m1fn"``, ``"e4m3"``, ``"int4"``)
give a 1-D array. In every kind the positive values come first in ascending order, then the same values
negated (so both signs of everything are probed, also for unsigned formats, whose negative inputs are probes
too); bit-identical duplicates inside a kind are removed. "grid" below is the set of finite values of the
format (the decode of every code; for formats wider than 16 bits, float32 itself, every exponent field with a
handful of mantissas), ``s`` is its smallest positive value, ``max`` its largest.

=================== ===========================================================================================
kind                values (each with both signs)
=================== ===========================================================================================
``grid``            every finite grid value, ``±0`` included (where the format has zero)
``neighbours``      the float32 neighbours of every grid value, 1 and 2 float32 ulps below and above (for 0:
                    the smallest float32 subnormals), minus values that are themselves grid values
``midpoints``       the exact midpoint of every pair of adjacent grid values (the ties of round-to-nearest;
                    integers: ``k + 0.5``), where float32 holds it exactly
``near_midpoints``  the float32 values 1 ulp below and above every midpoint (must round down / up)
``subnormals``      below the smallest value: ``s * 2**-j`` for j = 1..6 and their ±1 ulp neighbours,
                    ``0.75 * s``; inside the subnormal range: 32 random float32 values in ``(0, min_normal)``,
                    ``min_normal`` ±1/2 ulps; float32's own subnormal landmarks (``2**-149``, ``3 * 2**-149``,
                    ``2**-127``, ``1.5 * 2**-127``, ``2**-126 - 2**-149``, ``2**-126``). Integer formats: the
                    same with ``s = 1`` (fractions of one).
``saturation``      for ``top`` = ``max`` (and ``|min|`` for signed integers): ``top`` and its ±1/±2 ulp
                    neighbours, ``top + step/2`` (the overflow tie; ``step`` = the grid spacing just above
                    ``top``) and its ±1/±2 ulp neighbours, ``top + step``, ``2 * top``, ``4 * top``, the largest
                    float32 and its lower neighbour, ``2**127``, ``Inf``
``specials``        ``±0``, ``±Inf``, NaN (0x7fc00000, 0xffc00000, payload NaNs 0x7fc00001 and 0x7f800001)
``random_bits``     ``random`` uniformly random float32 bit patterns (``default_rng(key)``; any value, NaN/Inf
                    included), in the order drawn (not sorted, no sign mirroring)
``random_range``    ``random`` random float32 values whose exponent is uniform over the format's range widened
                    by 3 binades below and 2 above, random 23-bit mantissa and sign (not sorted)
=================== ===========================================================================================

Block formats (a ``BlockDType`` name such as ``"mxfp4"``, ``"mxint8"``, ``"mx9"``, ``"bfp16"``, a ``BlockDType``,
or a ``QuantSpec`` whose granularity is ``PerGroup(size, axis=-1)``) give a 2-D array ``(rows, cols)`` whose
blocks of ``B = size`` lie along the last axis. Every row holds two full blocks, and with ``ragged=True`` a
short last group of ``B // 2`` elements: ``cols = 2 * B + B // 2`` (``2 * B`` without). Each kind is a list of
blocks laid out two per row (an odd count repeats the kind's first block); the short group of row ``r`` is the
first ``B // 2`` elements of the kind's block ``2r + 2`` (cyclically). Below, "in scale units" means relative
to the block's scale: ``emax`` and ``maxel`` are the element's largest exponent and value in scale units
(integer elements count ``code * 2**unit_exponent``, MXINT8: code / 64), ``m`` its mantissa bits (integers:
``emax``), ``2**e`` the binade of the block's amax. Unless said otherwise a block is its named value(s) at
fixed random positions and random filler with ``|filler| <= amax / 2``.

===================== =========================================================================================
kind                  blocks
===================== =========================================================================================
``zeros``             all ``+0``; all ``-0``; alternating ``±0``
``one_outlier``       one value ``±{6, 1000, 2**20}`` at position 0, ``B // 2`` or ``B - 1``; the rest random
                      values ``2**-3``, ``2**-10``, ``2**-24`` or ``2**-30`` times smaller (they survive, flush
                      to zero, or become float32 subnormals after scaling)
``pow2_amax``         amax exactly ``2**j``, its float32 lower neighbour (where a float ``log2`` gives ``j``) and
                      upper neighbour, for j in -126, -100, -40, -20, -3, -1, 0, 1, 2, 3, 10, 20, 40, 100, 126
``scale_boundaries``  for e in -20, -1, 0, 4, 30, amax at each scale rule's boundary, each exactly and ±1 ulp:
                      EVEN's round-up point ``2**(e+1) - 2**(e-m-1)`` (amax rounds up a binade on the element's
                      mantissa); the saturation tie ``(maxel + step/2) * 2**(e-emax)`` (FLOOR clamps above it;
                      bfp16 bumps the exponent); ``maxel * 2**(e-emax)`` (RCEIL's boundary); ``2**e`` (CEIL's).
                      Shared-microexponent formats add blocks of pairs around ``2**e`` under an amax of
                      ``1.75 * 2**e`` (both of a pair below ``2**e`` shifts the pair, one at ``2**e`` does not)
``element_grid``      every element grid value (both signs, ±0) in scale units, ``B - 1`` per block after a
                      leading ``+maxel`` that fixes the scale, times ``2**j`` for j in 0, -20, 17 (grids of more
                      than 4096 values are subsampled evenly, ends kept)
``element_midpoints`` the same with the midpoints between adjacent element grid values and their ±1 ulp
                      neighbours (in-block ties), for j in 0, -20
``nan``               one NaN among random values (at a random position; at ``B - 1``); all NaN; NaN and
                      +Inf; NaN and the largest float32
``inf``               +Inf at position 0; -Inf at ``B - 1`` (among random values); +Inf and -Inf; +Inf among
                      zeros
``tiny``              amax ``2**j`` (exact and ±1 ulp) for j in -149, -140, -130, -128, -127, -126, -125 and
                      around the FLOOR clamp ``-127 + emax`` (j - 1, j, j + 1); also ``1.75 * 2**-127`` and
                      ``2**-126 - 2**-149``; the filler reaches into float32 subnormals
``huge``              amax the largest float32, its lower neighbour, ``2**127`` and its lower neighbour,
                      ``1.5 * 2**126``; a block all at the largest float32
``random``            ``max(1, random // B)`` blocks of standard normals (every other one cubed: heavy tails)
                      times ``2**u``, ``u`` uniform in -40..40 per block
``random_bits``       ``max(1, random // (4 * B))`` blocks of random float32 bit patterns with exponent field
                      255 avoided (finite)
===================== =========================================================================================

Two-level specs (NVFP4: ``spec.two_level``) get one more kind, right after ``scale_boundaries``:

========================= =====================================================================================
``block_scale_rounding``  block amax = ``maxel * t`` (exact, and ±1/±2 float32 ulps) for every tie ``t`` of the
                          block scale's rounding under tensor scale 1: each midpoint between adjacent normal
                          values of the scale format, and the clamp edges (its smallest normal and half of it,
                          its largest value and the overflow tie above it)
========================= =====================================================================================

All kinds go into one tensor. Under ``TensorScale.AMAX`` the tensor scale comes from the whole tensor, so one
NaN/Inf probe makes every block NaN and the ``huge`` probes flatten everything else to zero: test two-level
kernels with a given tensor scale (``tensor_scale=``), with ``TensorScale.ONE``, or kind by kind.
"""

from __future__ import annotations

import math
from typing import Union

import numpy as np

from .._typing import SpecLike
from ..cast import decode
from ..dtypes import BlockDType, FloatDType, IntDType, get_dtype
from ..granularity import PerGroup
from ..quantize import QuantSpec, make_spec
from ..scales import element_emax_and_max

__all__ = ["probes", "probes_by_kind", "ELEMENT_KINDS", "BLOCK_KINDS", "resolve"]

ELEMENT_KINDS = ("grid", "neighbours", "midpoints", "near_midpoints", "subnormals", "saturation", "specials",
                 "random_bits", "random_range")
BLOCK_KINDS = ("zeros", "one_outlier", "pow2_amax", "scale_boundaries", "element_grid", "element_midpoints",
               "nan", "inf", "tiny", "huge", "random", "random_bits")

_F32 = np.float32
_F32_MAX = float(np.finfo(np.float32).max)
_BLOCKS_PER_ROW = 2
_MAX_GRID = 4096


# ---------------------------------------------------------------------------------------------------------------
# resolution
# ---------------------------------------------------------------------------------------------------------------


def resolve(fmt: SpecLike) -> Union[FloatDType, IntDType, QuantSpec]:
    """The element dtype of an element format, or the ``QuantSpec`` of a block format (``PerGroup`` along the
    last axis). Raises ``ValueError``/``TypeError`` naming ``fmt`` otherwise."""
    if isinstance(fmt, QuantSpec):
        g = fmt.granularity
        if not isinstance(g, PerGroup):
            raise ValueError(
                f"fmt: block probes need a QuantSpec with PerGroup granularity, got {type(g).__name__}; pass the "
                f"element dtype ({fmt.dtype.name!r}) for element probes"
            )
        if g.axis not in (-1, 1):
            raise ValueError(f"fmt: block probes put the blocks along the last axis; got PerGroup axis={g.axis} "
                             f"(use axis=-1 and transpose)")
        return fmt
    d = get_dtype(fmt)
    if isinstance(d, BlockDType):
        return make_spec(d)
    return d


# ---------------------------------------------------------------------------------------------------------------
# small exact helpers (float64 is exact for every value built here)
# ---------------------------------------------------------------------------------------------------------------


def _f32(v) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(v, dtype=np.float64).astype(np.float32).reshape(-1)


def _exact_f32(v) -> np.ndarray:
    """The float64 values ``v`` that float32 holds exactly, as float32."""
    v = np.asarray(v, dtype=np.float64).reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        f = v.astype(np.float32)
    return f[f.astype(np.float64) == v]


def _ulp_steps(v, steps) -> np.ndarray:
    """float32 neighbours of ``v``: for each s in ``steps`` (±1, ±2, ...), s ulps away."""
    v = _f32(v)
    out = []
    with np.errstate(over="ignore", invalid="ignore"):
        for s in steps:
            cur = v.copy()
            target = _F32(np.inf) if s > 0 else _F32(-np.inf)
            for _ in range(abs(s)):
                cur = np.nextafter(cur, target)
            out.append(cur)
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def _bits(v) -> np.ndarray:
    return np.ascontiguousarray(v, dtype=np.float32).view(np.uint32)


def _signed_sorted(v) -> np.ndarray:
    """Unique (by bits) non-negative values of |v| sorted ascending, then the same values negated."""
    v = np.abs(_f32(v))
    v = v[~np.isnan(v)]
    pos = np.unique(_bits(v)).view(np.float32)  # sorted by bits == sorted by value for non-negative floats
    return np.concatenate([pos, -pos]).astype(np.float32)


def _floor_log2(v: float) -> int:
    return math.frexp(v)[1] - 1


# ---------------------------------------------------------------------------------------------------------------
# element formats
# ---------------------------------------------------------------------------------------------------------------


def _grid(d) -> np.ndarray:
    """Sorted unique non-negative finite values (float64) of an element format."""
    if isinstance(d, IntDType):
        hi = max(d.max, -d.min)
        return np.arange(0, hi + 1, dtype=np.float64)
    if d.bits <= 16:
        codes = np.arange(1 << d.bits, dtype=np.int32)
    else:  # float32-wide: every exponent field with a few mantissas
        e, m = d.exponent_bits, d.mantissa_bits
        fields = np.arange(1 << e, dtype=np.int64)
        mants = np.array(sorted({0, 1, 2, 1 << (m - 1), (1 << m) - 2, (1 << m) - 1}), dtype=np.int64)
        codes = ((fields[:, None] << m) | mants[None, :]).reshape(-1).astype(np.int32)
    v = decode(codes, d)
    v = np.abs(v[np.isfinite(v)].astype(np.float64))
    return np.unique(v)


def _format_step_above(d, top: float) -> float:
    """Grid spacing just above ``top`` (what the next value would be if the format went on)."""
    if isinstance(d, IntDType):
        return 1.0
    e = max(_floor_log2(top), d.emin)
    return 2.0 ** (e - d.mantissa_bits)


def _element_kinds(d, key: int, random: int) -> dict:
    g = _grid(d)
    pos = g[g > 0]
    smallest = float(pos[0]) if isinstance(d, FloatDType) else 1.0
    min_normal = d.min_normal if isinstance(d, FloatDType) else 1.0
    kinds: dict = {}

    kinds["grid"] = _signed_sorted(g)

    nb = _ulp_steps(g, (-2, -1, 1, 2))
    nb = nb[np.isfinite(nb)]
    nb = nb[~np.isin(_bits(np.abs(nb)), _bits(np.abs(kinds["grid"])))]
    kinds["neighbours"] = _signed_sorted(nb)

    if d.bits > 16 and isinstance(d, FloatDType):
        # Sampled grid: a midpoint is value + half its own step.
        steps = np.array([_format_step_above(d, float(v)) if v > 0 else smallest for v in g])
        mids = _exact_f32(g + steps / 2)
    else:
        mids = _exact_f32((g[:-1] + g[1:]) / 2)
    kinds["midpoints"] = _signed_sorted(mids)
    near = _ulp_steps(mids, (-1, 1))
    kinds["near_midpoints"] = _signed_sorted(near[np.isfinite(near)])

    rng = np.random.default_rng([key, 1])
    below = smallest * 2.0 ** -np.arange(1, 7)
    sub = [_f32(below), _ulp_steps(below, (-1, 1)), _f32([0.75 * smallest])]
    sub.append(_f32(rng.uniform(0.0, min_normal, 32)))
    sub.append(_f32([min_normal]))
    sub.append(_ulp_steps([min_normal], (-2, -1, 1, 2)))
    sub.append(_f32([2.0**-149, 3 * 2.0**-149, 2.0**-127, 1.5 * 2.0**-127, 2.0**-126 - 2.0**-149, 2.0**-126]))
    s = np.concatenate(sub)
    kinds["subnormals"] = _signed_sorted(s[s > 0])

    tops = [float(d.max_finite)]
    if isinstance(d, IntDType) and d.signed:
        tops.append(float(-d.min))
    sat = []
    for top in tops:
        step = _format_step_above(d, top)
        tie = top + step / 2
        sat += [_f32([top, tie, top + step, 2 * top, 4 * top]), _ulp_steps([top, tie], (-2, -1, 1, 2))]
    sat.append(_f32([_F32_MAX, 2.0**127, np.inf]))
    sat.append(_ulp_steps([_F32_MAX], (-1,)))
    kinds["saturation"] = _signed_sorted(np.concatenate(sat))

    kinds["specials"] = np.concatenate([
        _f32([0.0, np.inf]), _f32([-0.0, -np.inf]),
        np.array([0x7FC00000, 0xFFC00000, 0x7FC00001, 0x7F800001], dtype=np.uint32).view(np.float32),
    ])

    if random > 0:
        kinds["random_bits"] = np.random.default_rng(key).integers(0, 1 << 32, size=random, dtype=np.uint64) \
            .astype(np.uint32).view(np.float32)
        rng = np.random.default_rng([key, 2])
        e_lo = _floor_log2(smallest) - 3
        e_hi = _floor_log2(float(g[-1])) + 2
        e = rng.integers(e_lo, e_hi + 1, size=random)
        mant = 1.0 + rng.integers(0, 1 << 23, size=random) / float(1 << 23)
        sign = np.where(rng.integers(0, 2, size=random) == 1, -1.0, 1.0)
        kinds["random_range"] = _f32(sign * np.ldexp(mant, e))
    return {k: v for k, v in kinds.items() if v.size}


# ---------------------------------------------------------------------------------------------------------------
# block formats
# ---------------------------------------------------------------------------------------------------------------


class _Blocks:
    """Collects blocks of length B for one kind."""

    def __init__(self, B: int, rng):
        self.B, self.rng, self.blocks = B, rng, []

    def filled(self, values, amax: float, *, filler: float = 0.5):
        """``values`` at random distinct positions, the rest random in [-filler*amax, filler*amax] (blocks
        shorter than ``values`` keep its first ``B``)."""
        B = self.B
        values = _f32(values)[:B]
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            fill = _f32(self.rng.uniform(-1.0, 1.0, B) * (filler * amax))
        pos = self.rng.permutation(B)[: values.size]
        fill[pos] = values
        self.blocks.append(fill)

    def exact(self, values):
        v = _f32(values)
        out = np.zeros(self.B, np.float32)
        out[: v.size] = v[: self.B]
        self.blocks.append(out)


def _element_grid_units(spec: QuantSpec) -> np.ndarray:
    """Non-negative element grid values in scale units (float64, sorted), subsampled to at most _MAX_GRID."""
    el = spec.dtype
    if isinstance(el, IntDType):
        g = np.arange(0, el.max + 1, dtype=np.float64) * 2.0**spec.unit_exponent
    else:
        g = _grid(el)
    if g.size > _MAX_GRID:
        g = g[np.unique(np.linspace(0, g.size - 1, _MAX_GRID).round().astype(np.int64))]
    return g


def _block_scale_ties(spec: QuantSpec, k: "_Blocks") -> "_Blocks":
    """Blocks whose amax / maxel sits on a rounding tie (or clamp edge) of a two-level block scale (g = 1)."""
    sd = spec.scale_dtype
    maxel = float(spec.dtype.max_finite)
    g = _grid(sd)
    g = g[g >= sd.min_normal]
    ties = list((g[:-1] + g[1:]) / 2)
    step_top = _format_step_above(sd, float(g[-1]))
    ties += [sd.min_normal, sd.min_normal / 2, float(g[-1]), float(g[-1]) + step_top / 2]
    for t in ties:
        a = _f32([maxel * t])
        for v in (a, _ulp_steps(a, (-2, -1, 1, 2))):
            for w in v:
                k.filled([w], float(w))
    return k


def _block_kinds(spec: QuantSpec, key: int, random: int) -> dict:
    B = spec.granularity.size
    el = spec.dtype
    emax, maxel = element_emax_and_max(el, spec.unit_exponent)
    mbits = el.mantissa_bits
    if isinstance(el, IntDType):
        step_top = 2.0**spec.unit_exponent
    else:
        step_top = 2.0 ** (emax - mbits)
    rng = np.random.default_rng([key, 3])
    kinds: dict = {}

    def new():
        return _Blocks(B, rng)

    k = new()
    k.exact(np.zeros(B))
    k.exact(np.full(B, -0.0))
    k.exact(np.where(np.arange(B) % 2 == 0, 0.0, -0.0))
    kinds["zeros"] = k

    k = new()
    for i, (out, ratio) in enumerate([(6.0, 2.0**-3), (-1000.0, 2.0**-10), (2.0**20, 2.0**-24), (-6.0, 2.0**-30),
                                      (1000.0, 2.0**-24), (-(2.0**20), 2.0**-3)]):
        for p in (0, B // 2, B - 1):
            b = _f32(rng.uniform(-1.0, 1.0, B) * abs(out) * ratio)
            b[p] = out
            k.blocks.append(b)
    kinds["one_outlier"] = k

    k = new()
    for j in (-126, -100, -40, -20, -3, -1, 0, 1, 2, 3, 10, 20, 40, 100, 126):
        p = _f32([2.0**j])
        for v in (p, _ulp_steps(p, (-1,)), _ulp_steps(p, (1,))):
            sign = rng.choice([-1.0, 1.0])
            k.filled(sign * v, float(v[0]))
    kinds["pow2_amax"] = k

    k = new()
    for e in (-20, -1, 0, 4, 30):
        s = e - emax
        even = 2.0 ** (e + 1) - 2.0 ** (e - mbits - 1)
        tie = (maxel + step_top / 2) * 2.0**s
        for t in (even, tie, maxel * 2.0**s, 2.0**e):
            for v in (_f32([t]), _ulp_steps([t], (-1,)), _ulp_steps([t], (1,))):
                k.filled(rng.choice([-1.0, 1.0]) * v, float(v[0]))
        if spec.subblock_shift_bits and spec.subblock_size == 2 and B >= 4:
            p = 2.0**e
            lo = float(_ulp_steps([p], (-1,))[0])
            pairs = [(lo, lo), (p, lo), (lo, 0.0), (p / 2, lo / 2), (0.0, 0.0), (-lo, p / 2), (p, p),
                     (-p, -lo), (lo, -(p * 0.75)), (p * 0.5 + p * 2.0 ** -(mbits + 2), lo)]
            vals = [1.75 * p, 0.0]
            for a, b in pairs:
                vals += [a, b]
            vals = np.array(vals[:B] + [0.0] * max(0, B - len(vals)))
            k.exact(vals)
    kinds["scale_boundaries"] = k

    if spec.two_level:
        kinds["block_scale_rounding"] = _block_scale_ties(spec, new())

    g = _element_grid_units(spec)
    signed_g = np.concatenate([g, [-0.0], -g[g > 0]])
    k = new()
    per = max(B - 1, 1)
    for j in (0, -20, 17):
        for i in range(0, signed_g.size, per):
            chunk = signed_g[i: i + per]
            k.exact(np.concatenate([[maxel], chunk]) * 2.0**j if B > 1 else chunk[:1] * 2.0**j)
    kinds["element_grid"] = k

    mids = (g[:-1] + g[1:]) / 2
    mids = np.concatenate([mids, _ulp_steps(mids, (-1, 1)).astype(np.float64)])
    mids = np.sort(mids[mids < maxel])
    signed_m = np.concatenate([mids, -mids])
    k = new()
    for j in (0, -20):
        for i in range(0, signed_m.size, per):
            chunk = signed_m[i: i + per]
            k.exact(np.concatenate([[maxel], chunk]) * 2.0**j if B > 1 else chunk[:1] * 2.0**j)
    kinds["element_midpoints"] = k

    k = new()
    k.filled([np.nan], 4.0)
    b = _f32(rng.uniform(-1, 1, B))
    b[B - 1] = np.nan
    k.blocks.append(b)
    k.exact(np.full(B, np.nan))
    k.filled([np.nan, np.inf], 1.0)
    k.filled([np.nan, _F32_MAX], 1.0)
    kinds["nan"] = k

    k = new()
    b = _f32(rng.uniform(-1, 1, B))
    b[0] = np.inf
    k.blocks.append(b)
    b = _f32(rng.uniform(-1, 1, B))
    b[B - 1] = -np.inf
    k.blocks.append(b)
    k.filled([np.inf, -np.inf], 2.0)
    k.exact([0.0] * (B // 2) + [np.inf])
    kinds["inf"] = k

    k = new()
    js = sorted({-149, -140, -130, -128, -127, -126, -125, -128 + emax, -127 + emax, -126 + emax})
    for j in js:
        p = _f32([2.0**j])
        for v in (p, _ulp_steps(p, (-1,)), _ulp_steps(p, (1,))):
            if v[0] > 0:
                k.filled(v, float(v[0]))
    k.filled(_f32([1.75 * 2.0**-127]), 1.75 * 2.0**-127)
    k.filled(_f32([2.0**-126 - 2.0**-149]), 2.0**-126)
    kinds["tiny"] = k

    k = new()
    for v in (_F32_MAX, float(_ulp_steps([_F32_MAX], (-1,))[0]), 2.0**127, float(_ulp_steps([2.0**127], (-1,))[0]),
              1.5 * 2.0**126):
        k.filled([v * rng.choice([-1.0, 1.0])], v)
    k.exact(np.full(B, _F32_MAX))
    kinds["huge"] = k

    if random > 0:
        k = new()
        n = max(1, random // B)
        for i in range(n):
            z = rng.standard_normal(B)
            if i % 2:
                z = z**3
            k.blocks.append(_f32(z * 2.0 ** int(rng.integers(-40, 41))))
        kinds["random"] = k
        k = new()
        bits_rng = np.random.default_rng([key, 4])
        for _ in range(max(1, random // (4 * B))):
            u = bits_rng.integers(0, 1 << 32, size=B, dtype=np.uint64).astype(np.uint32)
            top = (u >> 23) & 0xFF
            u = np.where(top == 0xFF, u & np.uint32(0xBFFFFFFF), u).astype(np.uint32)
            k.blocks.append(u.view(np.float32).copy())
        kinds["random_bits"] = k
    return kinds


def _rows(blocks: list, B: int, ragged: bool) -> np.ndarray:
    n = len(blocks)
    tail = B // 2 if ragged else 0
    nrows = -(-n // _BLOCKS_PER_ROW)
    out = np.zeros((nrows, _BLOCKS_PER_ROW * B + tail), np.float32)
    for r in range(nrows):
        for c in range(_BLOCKS_PER_ROW):
            out[r, c * B:(c + 1) * B] = blocks[(r * _BLOCKS_PER_ROW + c) % n]
        if tail:
            out[r, _BLOCKS_PER_ROW * B:] = blocks[(r * _BLOCKS_PER_ROW + _BLOCKS_PER_ROW) % n][:tail]
    return out


# ---------------------------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------------------------


def _check_args(key, random, ragged):
    if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or key < 0:
        raise TypeError(f"key must be a non-negative int, got {key!r}")
    if isinstance(random, bool) or not isinstance(random, (int, np.integer)) or random < 0:
        raise TypeError(f"random must be a non-negative int, got {random!r}")
    if not isinstance(ragged, bool):
        raise TypeError(f"ragged must be a bool, got {ragged!r}")


def probes_by_kind(fmt: SpecLike, *, key: int = 0, random: int = 1024, ragged: bool = True) -> dict[str, np.ndarray]:
    """The probe inputs of ``fmt`` split by kind: an ordered ``dict[str, np.ndarray]`` of float32 arrays (1-D
    for element formats, 2-D ``(rows, cols)`` for block formats). See the module docstring for each kind."""
    _check_args(key, random, ragged)
    r = resolve(fmt)
    if isinstance(r, QuantSpec):
        B = r.granularity.size
        kinds = _block_kinds(r, int(key), int(random))
        return {name: _rows(k.blocks, B, ragged) for name, k in kinds.items() if k.blocks}
    return _element_kinds(r, int(key), int(random))


def probes(fmt: SpecLike, *, key: int = 0, random: int = 1024, ragged: bool = True) -> np.ndarray:
    """Probe inputs of ``fmt`` (float32): ``probes_by_kind(fmt, ...)`` concatenated along axis 0, in kind order.

    Element format -> 1-D; block format (name, ``BlockDType`` or ``QuantSpec`` with ``PerGroup(size, -1)``) ->
    2-D with blocks along the last axis and, with ``ragged``, a short last group of ``size // 2``.
    """
    parts = list(probes_by_kind(fmt, key=key, random=random, ragged=ragged).values())
    return np.ascontiguousarray(np.concatenate(parts, axis=0), dtype=np.float32)


# help(probes) / help(probes_by_kind) show the table of kinds (``qcore.testing.probes`` is the function, so the
# module docstring is otherwise hard to reach).
if __doc__ and probes.__doc__ and probes_by_kind.__doc__:  # (python -OO strips docstrings)
    probes_by_kind.__doc__ += "\n" + __doc__
    probes.__doc__ += "\n" + __doc__

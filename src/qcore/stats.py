"""Per-block statistics that scales come from, and calibration state for static quantization.

Every function takes a numpy array or a torch tensor (same kind, same device back; numpy users never import
torch) and a granularity (``PerTensor()``, ``PerChannel(axis)``, ``PerGroup(size, axis)``, ``PerBlock(shape)``)
and returns arrays of the granularity's scale shape (``qcore.granularity.scale_shape(g, x.shape)``, equal to
``spec.scale_shape(x.shape)``). Inputs are floating point of any width; like ``qcore.quantize`` they are first
rounded to float32, and every statistic is a float32 array.

Statistics (exact; a short last group or block is *excluded*, not zero-padded):

- ``absmax(x, g)``: max |x| per block (the statistic of symmetric scales).
- ``minmax(x, g) -> (lo, hi)``: the true block min and max (not widened to include 0; ``asymmetric_scale``
  does that widening itself).
- ``percentile(x, g, q=...)``: the ``q``-th percentile of |x| per block, 0 < q <= 100, with numpy's default
  ``"linear"`` interpolation (Hyndman & Fan method 7): for the ``n`` values of the block sorted ascending,
  ``v = (n - 1) * (q / 100)``, ``i = floor(v)``, ``t = v - i`` and the result is
  ``a + (b - a) * t`` if ``t < 0.5`` else ``b - (b - a) * (1 - t)`` with ``a, b = sorted[i], sorted[min(i+1, n-1)]``,
  all in float64, then rounded to float32. These are numpy's own formulas, written out here with sort and
  gather so that they run vectorised over blocks; the float64 result equals
  ``np.percentile(abs(block).astype(np.float64), q)`` exactly, and numpy and torch give bit-identical results
  (the same correctly rounded float64 operations in the same order; tested).

NaN and Inf: a NaN in a block makes that block's absmax / min / max NaN (as ``np.max`` and ``torch.amax`` do);
an Inf gives Inf. ``percentile`` gives NaN for any block holding a NaN or an Inf (numpy's own lerp gives NaN
or Inf there depending on q; a non-finite statistic gives a NaN scale either way).

Scales:

- ``mse_clip(x, spec, grid=100, lo=0.5, p=2.0)``: per block, the clipping ratio ``r`` in
  ``linspace(lo, 1, grid)`` (``r = 1`` always included) whose scale minimises ``sum |x - fake_quantize(x)|**p``
  over the block; the scale of ratio ``r`` is what the spec's own scale rule gives for the statistic scaled
  by ``r`` (``absmax * r``; asymmetric: ``lo * r`` and ``hi * r``; power-of-two: the exponent of ``absmax * r``
  under ``spec.scale_mode``). Ties keep the larger ratio, so the result is never worse than ``r = 1``, which is
  exactly dynamic ``quantize``'s scale. Errors are float64 sums, whose order differs between numpy and torch:
  the backends agree bit for bit unless two ratios' errors differ by a few float64 ulps (not seen in tests; for
  ``p != 2`` torch's float64 ``pow`` may also differ from numpy's by an ulp).
- ``RunningStats``: calibration state as a frozen value (granularity, absmax, lo, hi, count) with pure updates
  (``update(stats, x)``: elementwise max / min with the new batch's block statistics).
- ``scale_from_stats(stats, spec)``: the scale (and zero point) that dynamic ``quantize`` computes from the same
  statistics, so ``quantize(x, spec, **scale_from_stats(RunningStats.from_array(x, g), spec).kwargs())`` equals
  ``quantize(x, spec)`` bit for bit.

Both scale functions return ``QParams(scale, zero_point)``, a named tuple (``zero_point`` is None for
symmetric specs): ``quantize(x, spec, scale=p.scale, zero_point=p.zero_point)`` or ``**p.kwargs()``.

Importance statistics: ``ImatrixStats``, llama.cpp's imatrix statistic of one weight (per input column, the sum of
``x**2`` over calibration tokens, and the token counts) as a frozen value; ``qcore.algorithms.imatrix`` updates
it, ``qcore.formats.imatrix`` reads and writes its files.

Not supported: shared-microexponent specs (MX9/MX6/MX4, ``subblock_shift_bits > 0``), whose sub-block shifts
depend on the data beyond a block statistic. float64 is used internally by ``percentile`` and ``mse_clip``
(torch devices without float64, such as MPS, are not supported there).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

from ._backend import is_torch, ops, to_array
from ._elements import bump_from_extremes
from ._typing import Array, ArrayLike, SpecLike
from .granularity import (Blocked, Granularity, PerChannel, PerGroup, PerTensor, check_granularity,
                          to_blocks)
from ._two_level import f32_const, tensor_scale_from_amax, two_level_scales
from .dtypes import FloatDType, TensorScale
from .quantize import QuantSpec, check_tensor_scale_arg, fake_quantize, make_spec
from .rounding import RoundingMode, check_mode, pow2
from .scales import asymmetric_scale, floor_log2, pow2_scale_exponent, scale_exponent_range, symmetric_scale

__all__ = ["absmax", "minmax", "percentile", "mse_clip", "four_over_six", "four_over_six_scale_max",
           "exponent_search", "QParams", "TwoLevelParams", "RunningStats", "update", "scale_from_stats",
           "ImatrixStats"]


# ---------------------------------------------------------------------------------------------------------------
# local backend helpers (ops the shared shim does not have)
# ---------------------------------------------------------------------------------------------------------------


def _f64(o):
    return np.float64 if o.name == "numpy" else o.t.float64


def _sort_last(x, o):
    if o.name == "numpy":
        return np.sort(x, axis=-1)
    return o.t.sort(x, dim=-1).values


def _take_last(x, idx, o):
    """x[..., idx[...]] for an integer array ``idx`` of x.shape[:-1]."""
    if o.name == "numpy":
        return np.take_along_axis(x, idx[..., None], axis=-1)[..., 0]
    return o.t.gather(x, -1, idx.unsqueeze(-1)).squeeze(-1)


def _same_kind(a, b) -> bool:
    return ops(a).name == ops(b).name


# ---------------------------------------------------------------------------------------------------------------
# blocking with a chosen pad value
# ---------------------------------------------------------------------------------------------------------------


def _check_g(granularity) -> Granularity:
    return check_granularity(granularity)


def _float_input(x, name="x"):
    x, o = to_array(x, name=name)
    return o.astype(x, o.float32), o


def _counts(b: Blocked, o, like):
    """Number of real (unpadded) elements in each block, int64 of ``b.scale_shape``."""
    cnt = np.ones(b.scale_shape, dtype=np.int64)
    nd = len(b.shape)
    for a, (s, t, p) in enumerate(zip(b.shape, b.tile, b.padded)):
        n = p // t
        c = np.minimum(t, s - np.arange(n, dtype=np.int64) * t)
        cnt = cnt * c.reshape([n if i == a else 1 for i in range(nd)])
    return cnt if o.name == "numpy" else o.from_numpy(cnt, like)


# ---------------------------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------------------------


def absmax(x: ArrayLike, granularity: Granularity) -> Array:
    """Max |x| per block (float32, shape ``scale_shape(granularity, x.shape)``). Padding (zeros) is harmless."""
    g = _check_g(granularity)
    x, o = _float_input(x)
    xb, b = to_blocks(o.abs(x), g, o)
    return o.amax(xb, b.reduce_axes, keepdims=False)


def minmax(x: ArrayLike, granularity: Granularity) -> tuple[Array, Array]:
    """(lo, hi): the true per-block min and max (float32); the padding of short tiles is excluded."""
    g = _check_g(granularity)
    x, o = _float_input(x)
    xlo, b = to_blocks(x, g, o, math.inf)
    xhi, _ = to_blocks(x, g, o, -math.inf)
    return o.amin(xlo, b.reduce_axes, keepdims=False), o.amax(xhi, b.reduce_axes, keepdims=False)


def _check_q(q):
    if isinstance(q, (bool, np.bool_)) or not isinstance(q, numbers.Real):
        raise TypeError(f"q must be a real number in (0, 100], got {q!r}")
    q = float(q)
    if not (0.0 < q <= 100.0):
        raise ValueError(f"q must be in (0, 100], got {q!r}")
    return q


def percentile(x: ArrayLike, granularity: Granularity, *, q: float) -> Array:
    """The ``q``-th percentile (0 < q <= 100) of |x| per block, numpy's "linear" method (module docstring).

    float32 of ``scale_shape(granularity, x.shape)``; the padding of short tiles is excluded; a block holding
    NaN or Inf gives NaN. numpy and torch agree bit for bit.
    """
    q = _check_q(q)
    g = _check_g(granularity)
    x, o = _float_input(x)
    xb, b = to_blocks(o.abs(x), g, o, math.inf)  # +inf padding sorts after every real value (NaN sorts last)
    k = len(b.shape)
    sshape = b.scale_shape
    tsize = 1
    for t in b.tile:
        tsize *= t
    xb = o.moveaxis(xb, list(b.reduce_axes), list(range(k, 2 * k)))
    srt = _sort_last(o.reshape(xb, tuple(sshape) + (tsize,)), o)
    n = _counts(b, o, x)
    f64 = _f64(o)
    v = o.astype(n - 1, f64) * (q / 100.0)  # numpy: (n - 1) * quantiles
    fi = o.floor(v)
    i = o.astype(fi, o.int64)
    j = o.minimum(i + 1, n - 1)
    t = v - fi
    a = o.astype(_take_last(srt, i, o), f64)
    bb = o.astype(_take_last(srt, j, o), f64)
    with o.quiet():
        d = bb - a
        r = o.where(t >= 0.5, bb - d * (1.0 - t), a + d * t)
    top = _take_last(srt, n - 1, o)  # the block's largest real |x|: Inf if it holds an Inf
    nonfinite = o.logical_or(o.isnan(srt[..., -1]), o.isinf(top))  # NaN sorts last, padding before it
    r = o.where(nonfinite, math.nan, r)
    return o.astype(r, o.float32)


# ---------------------------------------------------------------------------------------------------------------
# scales from statistics (the rule quantize applies)
# ---------------------------------------------------------------------------------------------------------------


class QParams(NamedTuple):
    """Quantization parameters: ``scale`` and ``zero_point`` (None for symmetric specs), of the spec's scale
    shape; pass them to ``quantize`` / ``fake_quantize`` as ``scale=`` / ``zero_point=`` (or ``**p.kwargs()``)."""

    scale: Any
    zero_point: Any = None

    def kwargs(self) -> dict[str, Any]:
        return {"scale": self.scale, "zero_point": self.zero_point}


def _as_spec(spec: SpecLike) -> "QuantSpec":
    if not isinstance(spec, QuantSpec):
        spec = make_spec(spec)
    if spec.subblock_shift_bits:
        raise ValueError(f"shared-microexponent specs ({spec.name or spec.dtype.name}) are not supported: their "
                         "sub-block shifts depend on the data, not only on a block statistic")
    if spec.two_level:
        raise ValueError(f"two-level specs ({spec.name or spec.dtype.name}, tensor_scale_mode="
                         f"{spec.tensor_scale_mode.name}) are not supported: calibrate the tensor scale (e.g. "
                         "absmax / (6 * 448) for NVFP4) and pass it as tensor_scale= to quantize")
    if spec.gguf:
        raise ValueError(f"GGUF specs ({spec.gguf}) are not supported: their scales come from llama.cpp's search "
                         "over the weights (quantize(x, spec, imatrix=...)), not from a block statistic")
    return spec


def _params(amax, lo, hi, spec, o, like):
    """QParams from block statistics, by the same rule as dynamic quantize (``qcore.quantize``)."""
    if spec.pow2_scale:
        s, bad = pow2_scale_exponent(amax, element=spec.dtype, mode=spec.scale_mode, scale_dtype=spec.scale_dtype,
                                     unit_exponent=spec.unit_exponent)
        if spec.bump_on_overflow:
            # The data's random bits are not known from a statistic: decide the bump as nearest-even would.
            det = dataclasses.replace(spec, rounding=RoundingMode.NEAREST_EVEN) \
                if spec.rounding is RoundingMode.STOCHASTIC else spec
            s = bump_from_extremes(s, lo, hi, det, o)
        return QParams(o.where(bad, np.float32(math.nan), pow2(s, o, like)), None)
    if spec.symmetric:
        return QParams(symmetric_scale(amax, dtype=spec.dtype, scale_dtype=spec.scale_dtype,
                                       narrow_range=spec.narrow_range), None)
    sc, zp = asymmetric_scale(lo, hi, dtype=spec.dtype, scale_dtype=spec.scale_dtype)
    return QParams(sc, zp)


# ---------------------------------------------------------------------------------------------------------------
# MSE-optimal clipping
# ---------------------------------------------------------------------------------------------------------------


def _check_real(v, name):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {v!r}")
    return float(v)


def _ratios(grid, lo):
    """Candidate ratios, 1 first, then descending (float32 values)."""
    if grid == 1 or lo == 1.0:
        return [np.float32(1.0)]
    r = np.linspace(lo, 1.0, grid)[:-1].astype(np.float32)
    return [np.float32(1.0)] + sorted({float(v) for v in r if v < 1.0}, reverse=True)


def mse_clip(x: ArrayLike, spec: SpecLike, *, grid: int = 100, lo: float = 0.5, p: float = 2.0,
             key: Optional[int] = None) -> QParams:
    """MSE-optimal (``p``-norm) clipping scale per block of ``spec``'s granularity (module docstring).

    Tries ``grid`` ratios ``r`` in ``linspace(lo, 1, grid)`` (0 < lo <= 1; ``r = 1`` always tried first) of each
    block's statistic, fake-quantizes ``x`` with each candidate scale, and keeps per block the one with the
    smallest ``sum |x - y|**p`` (float64 sums; ties keep the larger ratio). Vectorised over blocks; loops over
    the grid. ``key``: for ``RoundingMode.STOCHASTIC`` specs (the same key for every candidate).
    Returns ``QParams(scale, zero_point)`` of ``spec.scale_shape(x.shape)``.
    """
    spec = _as_spec(spec)
    if isinstance(grid, (bool, np.bool_)) or not isinstance(grid, numbers.Integral):
        raise TypeError(f"grid must be an int >= 1, got {grid!r}")
    grid = int(grid)
    if grid < 1:
        raise ValueError(f"grid must be >= 1, got {grid}")
    lo = _check_real(lo, "lo")
    if not (0.0 < lo <= 1.0):
        raise ValueError(f"lo (the smallest clip ratio, a fraction of the block statistic) must be in (0, 1], got {lo}")
    p = _check_real(p, "p")
    if not (p > 0 and math.isfinite(p)):
        raise ValueError(f"p must be a positive finite number, got {p}")
    key = check_mode(spec.rounding, key)
    x, o = _float_input(x)
    g = spec.granularity
    amax = absmax(x, g)
    need_range = (not spec.symmetric) or spec.bump_on_overflow
    blo, bhi = minmax(x, g) if need_range else (None, None)
    f64 = _f64(o)
    x64 = o.astype(x, f64)

    def error(params):
        return _block_error(x, x64, spec, key, o, p=p, scale=params.scale, zero_point=params.zero_point)

    best = None
    best_err = None
    for r in _ratios(grid, lo):
        r32 = np.float32(r)
        if r == 1.0:
            cand = _params(amax, blo, bhi, spec, o, x)
        else:
            cand = _params(amax * r32, None if blo is None else blo * r32, None if bhi is None else bhi * r32,
                           spec, o, x)
        err = error(cand)
        if best is None:
            best, best_err = cand, err
            continue
        better = err < best_err  # NaN never wins
        scale = o.where(better, cand.scale, best.scale)
        zp = None if cand.zero_point is None else o.where(better, cand.zero_point, best.zero_point)
        best, best_err = QParams(scale, zp), o.where(better, err, best_err)
    return best


# ---------------------------------------------------------------------------------------------------------------
# searched block scales for FP4: four over six (two-level, NVFP4) and the E8M0 exponent search (MX)
# ---------------------------------------------------------------------------------------------------------------


class TwoLevelParams(NamedTuple):
    """Parameters of a two-level spec: block ``scale`` (values of ``spec.scale_dtype``, the spec's scale shape)
    and the per-tensor ``tensor_scale`` (0-d float32; None under ``TensorScale.ONE``); pass them to ``quantize``
    / ``fake_quantize`` as ``**p.kwargs()``."""

    scale: Any
    tensor_scale: Any = None

    def kwargs(self) -> dict[str, Any]:
        return {"scale": self.scale, "tensor_scale": self.tensor_scale}


def _block_error(x, x64, spec, key, o, *, p: float = 2.0, **params):
    """Per block of ``spec.granularity``: the float64 ``sum |x - fake_quantize(x, **params)|**p`` (``x64``: ``x``
    in float64); what ``mse_clip``, ``four_over_six`` and ``exponent_search`` compare their candidates by."""
    y = fake_quantize(x, spec, key=key, **params)
    with o.quiet():
        d = o.abs(x64 - o.astype(y, _f64(o)))
        e = d * d if p == 2.0 else d**p
    eb, b = to_blocks(e, spec.granularity, o)  # zero padding adds 0
    return o.sum(eb, b.reduce_axes, keepdims=False)


#: the element values four over six maps a block's absmax to: FP4 E2M1's largest (6) and the one below it (4)
FOUR_OVER_SIX_TARGETS = (6.0, 4.0)


def four_over_six_scale_max(scale_dtype: FloatDType) -> float:
    """The block scale the tensor's largest block maps to under four over six: the largest power of two ``M``
    with ``M * 6 / 4 <= scale_dtype.max_finite``, so that a block's "max -> 4" scale (1.5 times its "max -> 6"
    scale) is never clamped. E4M3 (448): 256, the paper's ``E4M3_MAX_FOUROVERSIX``."""
    m = 1.0
    while m * 2.0 * 1.5 <= scale_dtype.max_finite:
        m *= 2.0
    return m


def four_over_six(x: ArrayLike, spec: SpecLike, *, tensor_scale: Optional[ArrayLike] = None,
                  key: Optional[int] = None) -> TwoLevelParams:
    """Four over six (arXiv 2512.02010, mit-han-lab/fouroversix): per block of a two-level FP4 spec (NVFP4), the
    block scale that maps the block's absmax to 6 or the one that maps it to 4, whichever gives the smaller
    ``sum (x - fake_quantize(x))**2`` over the block (float64 sums; ties keep 6, the spec's own rule).

    The tensor scale makes room for the "max -> 4" scales (1.5 times larger) in the scale dtype:
    ``g = amax(|x|) / (6 * four_over_six_scale_max(scale_dtype))`` (NVFP4: amax / (6 * 256) instead of the
    spec's amax / (6 * 448)), with ``TensorScale.AMAX``'s rules otherwise (raised to 2**-126; 1 for an all-zero
    tensor). ``tensor_scale``: use this ``g`` instead (GPTQ's groups share the whole weight's). Each candidate's
    block scales are the spec's own two-level arithmetic (``qcore._two_level.two_level_scales``) with target 6 or
    4. ``TensorScale.ONE`` keeps ``g = 1``; ``GIVEN`` needs ``tensor_scale``.

    Returns ``TwoLevelParams(scale, tensor_scale)``: ``quantize(x, spec, **p.kwargs())`` is the result. Refuses
    (ValueError) a spec that is not two-level or whose elements are not ``float4_e2m1fn`` (the grid whose 4 and 6
    the rule names), and an ``x`` holding NaN or Inf when the tensor scale is computed from it.
    """
    spec = spec if isinstance(spec, QuantSpec) else make_spec(spec)
    what = spec.name or spec.dtype.name
    if not spec.two_level:
        raise ValueError(f"four_over_six: spec {what!r} is not a two-level (NVFP4) spec (tensor_scale_mode="
                         f"{spec.tensor_scale_mode.name}); MX specs take exponent_search")
    if spec.dtype.name != "float4_e2m1fn":
        raise ValueError(f"four_over_six: spec {what!r} has elements {spec.dtype.name}; the rule picks between "
                         f"the scales mapping a block's max to 6 or 4 of float4_e2m1fn")
    key = check_mode(spec.rounding, key)
    x, o = _float_input(x)
    mode = spec.tensor_scale_mode
    if tensor_scale is not None:
        g = check_tensor_scale_arg(tensor_scale, spec, o, x)  # refuses it under TensorScale.ONE
    elif mode is TensorScale.GIVEN:
        raise ValueError(f"four_over_six: spec {what!r} has tensor_scale_mode=GIVEN: pass tensor_scale=")
    elif mode is TensorScale.ONE or math.prod(tuple(x.shape)) == 0:
        g = f32_const(1.0, o, x)
    else:
        amax = o.amax(o.reshape(o.abs(x), (-1,)), 0, keepdims=False)
        if not math.isfinite(float(amax)):
            raise ValueError("four_over_six: x holds NaN or Inf; its tensor scale (from amax |x|) would be NaN")
        g = tensor_scale_from_amax(amax, spec, o, x, scale_max=four_over_six_scale_max(spec.scale_dtype))
    ts = None if mode is TensorScale.ONE else g
    bmax = absmax(x, spec.granularity)
    x64 = o.astype(x, _f64(o))
    best = best_err = None
    for target in FOUR_OVER_SIX_TARGETS:
        cand, _, _ = two_level_scales(bmax, g, spec, o, target=target)
        err = _block_error(x, x64, spec, key, o, scale=cand, tensor_scale=ts)
        if best is None:
            best, best_err = cand, err
        else:
            better = err < best_err  # strict: ties keep 6; NaN never wins
            best, best_err = o.where(better, cand, best), o.where(better, err, best_err)
    return TwoLevelParams(best, ts)


def _check_radius(radius) -> int:
    if isinstance(radius, (bool, np.bool_)) or not isinstance(radius, numbers.Integral):
        raise TypeError(f"radius must be an int in [1, 8], got {radius!r}")
    if not 1 <= int(radius) <= 8:
        raise ValueError(f"radius must be in [1, 8] (exponents e - radius ... e + radius), got {radius!r}")
    return int(radius)


def exponent_search(x: ArrayLike, spec: SpecLike, *, radius: int = 1, key: Optional[int] = None) -> QParams:
    """E8M0 exponent search for power-of-two (MX) block scales: per block, the exponent ``e`` that the spec's own
    rule gives (``spec.scale_mode``; bfp16's bump included) and its neighbours ``e - 1``, ``e + 1`` (up to
    ``e +- radius``), keeping the one with the smallest ``sum (x - fake_quantize(x))**2`` over the block (float64
    sums). Candidates are tried in the order ``e, e - 1, e + 1, e - 2, ...`` and only a strictly smaller error
    replaces the best so far, so ties keep the rule's exponent (never worse than it) and then the smaller scale.
    ``e + 1`` is the scale that clips nothing (FLOOR's clipped top binade), ``e - 1`` the finer one that clips
    more; exponents stay in ``scale_exponent_range(spec.scale_dtype)``. A NaN block keeps its NaN scale.

    Returns ``QParams(scale, None)``: ``quantize(x, spec, **p.kwargs())`` is the result. Refuses (ValueError) a
    spec without power-of-two scales, and the specs ``mse_clip`` refuses (microexponents, two-level, GGUF).
    """
    spec = _as_spec(spec)
    if not spec.pow2_scale:
        raise ValueError(f"exponent_search: spec {spec.name or spec.dtype.name!r} has {spec.scale_dtype.name} "
                         f"scales, not powers of two (E8M0 / pow2_scale); use mse_clip")
    radius = _check_radius(radius)
    key = check_mode(spec.rounding, key)
    x, o = _float_input(x)
    g = spec.granularity
    amax = absmax(x, g)
    blo, bhi = minmax(x, g) if spec.bump_on_overflow else (None, None)
    base = _params(amax, blo, bhi, spec, o, x).scale
    nan = o.isnan(base)
    e = o.where(nan, 0, floor_log2(base))
    smin, smax = scale_exponent_range(spec.scale_dtype)
    x64 = o.astype(x, _f64(o))
    best, best_err = base, _block_error(x, x64, spec, key, o, scale=base)
    for k in [s * d for d in range(1, radius + 1) for s in (-1, 1)]:
        cand = o.where(nan, np.float32(math.nan), pow2(o.clip(e + k, smin, smax), o, x))
        err = _block_error(x, x64, spec, key, o, scale=cand)
        better = err < best_err
        best, best_err = o.where(better, cand, best), o.where(better, err, best_err)
    return QParams(best, None)


# ---------------------------------------------------------------------------------------------------------------
# calibration state
# ---------------------------------------------------------------------------------------------------------------


def _norm_g(g, nd):
    """A comparable form of a granularity for arrays of ``nd`` dimensions (negative axes resolved)."""
    if isinstance(g, PerTensor):
        return ("tensor",)
    if isinstance(g, PerChannel):
        return ("channel", g.axis % nd if nd else g.axis)
    if isinstance(g, PerGroup):
        return ("group", g.size, g.axis % nd if nd else g.axis)
    shape = tuple(g.shape)
    axes = tuple(g.axes) if g.axes is not None else tuple(range(nd - len(shape), nd))
    return ("block", tuple(sorted((a % nd if nd else a, s) for a, s in zip(axes, shape))))


def _check_same_g(a, b, nd, what):
    if a != b and _norm_g(a, nd) != _norm_g(b, nd):
        raise ValueError(f"{what}: granularity {b!r} does not match the stats' granularity {a!r}")


@dataclass(frozen=True)
class RunningStats:
    """Calibration state for static quantization, as a value.

    ``absmax``, ``lo``, ``hi``: float32 arrays of the granularity's scale shape (the block max |x|, min and max
    over every batch seen; None before the first batch); ``count``: number of batches. Build with
    ``RunningStats.empty(g)`` or ``RunningStats.from_array(x, g)``; ``update(stats, x)`` (or ``stats.update(x)``)
    returns new stats and never modifies ``stats``. Batches must give the same scale shape (e.g. activations
    of shape (B, K) with ``PerChannel(-1)`` or ``PerTensor()`` for any B).
    """

    granularity: Granularity
    absmax: Any = None
    lo: Any = None
    hi: Any = None
    count: int = 0

    def __post_init__(self) -> None:
        check_granularity(self.granularity)
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 0:
            raise ValueError(f"RunningStats.count must be a non-negative int, got {self.count!r}")
        have = [v is not None for v in (self.absmax, self.lo, self.hi)]
        if any(have) and not all(have):
            raise ValueError("RunningStats: absmax, lo and hi are given together or not at all")
        if all(have) and not (tuple(self.absmax.shape) == tuple(self.lo.shape) == tuple(self.hi.shape)):
            raise ValueError("RunningStats: absmax, lo and hi must have the same shape")

    @classmethod
    def empty(cls, granularity: Granularity) -> "RunningStats":
        """No batches seen yet."""
        return cls(check_granularity(granularity))

    @classmethod
    def from_array(cls, x: ArrayLike, granularity: Granularity) -> "RunningStats":
        """One-shot statistics of ``x`` (equal to ``update(RunningStats.empty(granularity), x)``)."""
        return update(cls.empty(granularity), x)

    @property
    def scale_shape(self) -> Optional[tuple[int, ...]]:
        return None if self.absmax is None else tuple(self.absmax.shape)

    def update(self, x: ArrayLike, granularity: Optional[Granularity] = None) -> "RunningStats":
        return update(self, x, granularity)


def update(stats: RunningStats, x: ArrayLike, granularity: Optional[Granularity] = None) -> RunningStats:
    """New ``RunningStats`` with batch ``x`` folded in (elementwise max of absmax/hi, min of lo).

    ``granularity``, if given, must match the stats' own. The batch must give the same scale shape and be the
    same array kind (numpy / torch) as the batches before.
    """
    if not isinstance(stats, RunningStats):
        raise TypeError(f"update takes a RunningStats, got {type(stats).__name__}")
    xa, o = _float_input(x)
    g = stats.granularity
    if granularity is not None:
        _check_same_g(g, check_granularity(granularity), len(xa.shape), "update")
    amax = absmax(xa, g)
    lo, hi = minmax(xa, g)
    if stats.absmax is None:
        return dataclasses.replace(stats, absmax=amax, lo=lo, hi=hi, count=stats.count + 1)
    if not _same_kind(stats.absmax, xa):
        raise TypeError(f"update: the stats hold {ops(stats.absmax).name} arrays but x is a {o.name} array")
    if tuple(amax.shape) != tuple(stats.absmax.shape):
        raise ValueError(f"update: x of shape {tuple(xa.shape)} gives block statistics of shape "
                         f"{tuple(amax.shape)}, the stats have {tuple(stats.absmax.shape)}")
    return dataclasses.replace(stats, absmax=o.maximum(stats.absmax, amax), lo=o.minimum(stats.lo, lo),
                               hi=o.maximum(stats.hi, hi), count=stats.count + 1)


def scale_from_stats(stats: RunningStats, spec: SpecLike) -> QParams:
    """``QParams(scale, zero_point)`` from calibrated stats, by the rule dynamic ``quantize`` uses.

    symmetric: ``symmetric_scale(absmax)``; asymmetric: ``asymmetric_scale(lo, hi)``; power-of-two:
    ``2**pow2_scale_exponent(absmax)`` under ``spec.scale_mode`` (bfp16's overflow bump decided from lo/hi,
    with nearest-even rounding if the spec rounds stochastically). ``spec.granularity`` must match the stats'.
    """
    if not isinstance(stats, RunningStats):
        raise TypeError(f"scale_from_stats takes a RunningStats, got {type(stats).__name__}")
    spec = _as_spec(spec)
    if stats.absmax is None:
        raise ValueError("scale_from_stats: the stats have seen no batch yet")
    o = ops(stats.absmax)
    _check_same_g(stats.granularity, spec.granularity, len(stats.absmax.shape), "scale_from_stats")
    return _params(stats.absmax, stats.lo, stats.hi, spec, o, stats.absmax)


# ---------------------------------------------------------------------------------------------------------------
# Importance statistics (llama.cpp's imatrix): the value type; its updates are in qcore.algorithms.imatrix, its
# files in qcore.formats.imatrix
# ---------------------------------------------------------------------------------------------------------------


def _host(x):
    return x.detach().cpu().numpy() if is_torch(x) else np.asarray(x)


@dataclass(frozen=True, eq=False)
class ImatrixStats:
    """Per input column: the sum of ``x**2`` over calibration tokens (float64 ``[n_mat, n]``) and the token
    counts (int64 ``[n_mat]``; ``n_mat`` = 1 for a dense matrix, one per expert for experts)."""

    sums: Any
    counts: Any

    def __post_init__(self):
        s, c = self.sums, self.counts
        if not (isinstance(s, np.ndarray) or is_torch(s)) or len(s.shape) != 2:
            raise ValueError(f"ImatrixStats: sums must be a 2-D [n_mat, n] array, got "
                             f"{type(s).__name__} of shape {getattr(s, 'shape', None)}")
        if not (isinstance(c, np.ndarray) or is_torch(c)) or tuple(c.shape) != (s.shape[0],):
            raise ValueError(f"ImatrixStats: counts must have shape ({s.shape[0]},) (one per matrix), got "
                             f"{getattr(c, 'shape', None)}")

    @classmethod
    def empty(cls, n: int, *, experts: Optional[int] = None, like: Any = None) -> "ImatrixStats":
        """No tokens yet, for ``n`` input columns; ``experts``: the expert count of a ``mul_mat_id`` weight (None
        for a dense matrix); ``like``: a torch tensor whose device the sums live on (None: numpy)."""
        for name, v in (("n", n), ("experts", experts)):
            if v is None and name == "experts":
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        m = 1 if experts is None else int(experts)
        if like is not None and is_torch(like):
            import torch

            return cls(torch.zeros((m, int(n)), dtype=torch.float64, device=like.device),
                       torch.zeros((m,), dtype=torch.int64, device=like.device))
        return cls(np.zeros((m, int(n)), np.float64), np.zeros((m,), np.int64))

    @property
    def n(self) -> int:
        """Input columns."""
        return int(self.sums.shape[1])

    @property
    def n_mat(self) -> int:
        """Matrices: 1 for a dense weight, the expert count for experts."""
        return int(self.sums.shape[0])

    def numpy(self) -> "ImatrixStats":
        """The same statistic as numpy arrays (host)."""
        return ImatrixStats(_host(self.sums).astype(np.float64), _host(self.counts).astype(np.int64))

    def __eq__(self, other) -> bool:
        if not isinstance(other, ImatrixStats):
            return NotImplemented
        a, b = self.numpy(), other.numpy()
        return a.sums.shape == b.sums.shape and bool((a.sums == b.sums).all()) and bool((a.counts == b.counts).all())

    __hash__ = None

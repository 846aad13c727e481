"""GGUF k-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL: llama.cpp's quantizer,
bit for bit, in numpy.

Each function here is a transcription of the function of the same name in llama.cpp's ``ggml/src/ggml-quants.c``
(``nearest_int``, ``make_qx_quants``, ``make_q3_quants``, ``make_qkx2_quants``, ``make_qkx3_quants``,
``make_qp_quants``, ``best_index_int8``, ``quantize_row_*_ref`` and the ``quantize_row_*_impl``
importance-weighted variants, ``quantize_iq4_nl``), vectorized over blocks: every float operation is a float32
operation in the C order (sums are sequential, never pairwise; max/min scans use C's strict comparisons from
C's start values), so the bytes equal ``ggml_quantize_chunk``'s. The oracle tests are
``tests/qcore/test_kquants.py`` and ``properties/test_prop_gguf.py`` (through ``qcore.testing.ggml``).

The result of ``quantize_kquant`` is the *parts* of the GGUF blocks, before packing (``qcore.packing``
``pack_gguf_blocks`` lays them out in GGUF's block bytes): the element codes and a ``GGUFScales``:

- ``codes``: element codes, x's shape, the values of the spec's element dtype: unsigned ``L`` (Q2_K 0..3,
  Q4_K/Q4_1 0..15, Q5_K/Q5_1 0..31; IQ4_NL: indices 0..15 into its levels; uint8) for the formats with offsets,
  signed ``L - bias`` (Q3_K -4..3, Q6_K -32..31, Q4_0 -8..7, Q5_0 -16..15, Q8_0 int8) for the symmetric ones;
- ``d`` (and ``dmin``): the fp16 (super-)block scale(s) as float32 values, shape (..., n / block); for Q4_1/Q5_1
  ``dmin`` holds the fp16 offset ``m``;
- k-quants: ``scale_codes`` (and ``min_codes``): the integer sub-block scale (and min) codes, shape
  (..., n / sub): Q4_K/Q5_K 0..63, Q2_K 0..15, Q3_K -32..31 (stored biased by 32), Q6_K -128..127 (int8).

A k-quant value is ``(d * scale_code) * code - (dmin * min_code)``: every product is exact in float32 (fp16
times a 6-bit code times a 6-bit code fits 24 bits), so only the final subtraction rounds, as in ggml's
dequantize; 32-element types ``d * code + m`` (IQ4_NL ``d * levels[code]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from .dtypes import GGUF_DTYPES

QK_K = 256
_F = np.float32
_MAGIC = _F(12582912.0)
_EPS = _F(1e-15)


@dataclass(frozen=True)
class GGUFScales:
    """The stored scales of GGUF blocks (``QTensor.super_scales``).

    k-quants: ``d`` and ``dmin`` (float32 arrays holding float16 values, shape (..., n / 256); ``dmin`` None for
    Q3_K/Q6_K), ``scale_codes`` and ``min_codes`` (integer arrays, shape (..., n / sub); ``min_codes`` None for
    Q3_K/Q6_K). A sub-block's scale is ``d * scale_code`` and its float offset ``-(dmin * min_code)`` (the
    value of code 0). 32-element types (Q4_0 ... Q8_0): ``d`` per block of 32 is the scale, ``dmin`` holds
    Q4_1/Q5_1's fp16 offset ``m`` (None otherwise), ``scale_codes`` and ``min_codes`` are None."""

    d: np.ndarray
    dmin: Optional[np.ndarray]
    scale_codes: np.ndarray
    min_codes: Optional[np.ndarray]


def nearest_int(v):
    """llama.cpp's ``nearest_int``: add 1.5 * 2**23 in float32 (which rounds to an integer, ties to even) and
    read the low mantissa bits. Bit-identical for every float32 input, the out-of-range ones included."""
    with np.errstate(all="ignore"):
        s = (np.asarray(v, dtype=_F) + _MAGIC).astype(_F)
    return (s.view(np.int32) & np.int32(0x007FFFFF)) - np.int32(0x00400000)


def _seqsum(a):
    """Sum along the last axis in order, in float32 (``float s = 0; for (...) s += a[i];``)."""
    a = np.asarray(a, dtype=_F)
    s = a[..., 0] + _F(0)
    for i in range(1, a.shape[-1]):
        s += a[..., i]
    return s


def _f16(v):
    """GGML_FP32_TO_FP16 then back: round to nearest even to float16, as float32."""
    with np.errstate(over="ignore"):
        return np.asarray(v, dtype=_F).astype(np.float16).astype(_F)


def _first_absmax(x):
    """(amax, max): ``float amax = 0, max = 0; for (...) if (fabsf(v) > amax) { amax = fabsf(v); max = v; }``
    along the last axis: the first element of largest |x|, NaNs never taken, (0, 0) when nothing exceeds 0."""
    amax = np.zeros(x.shape[:-1], dtype=_F)
    mx = np.zeros(x.shape[:-1], dtype=_F)
    for i in range(x.shape[-1]):
        v = x[..., i]
        a = np.abs(v)
        take = a > amax
        amax = np.where(take, a, amax)
        mx = np.where(take, v, mx)
    return amax, mx


def _div(a, b):
    with np.errstate(all="ignore"):
        return (a / b).astype(_F)


# ---------------------------------------------------------------------------------------------------------------
# the per-sub-block searches (x: (N, n) float32; weights (N, n); results per row)

def make_qx_quants(x, nmax: int, qw=None):
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, qw)`` -> (scale (N,), L (N, n) int32 in 0..2*nmax-1)."""
    N, n = x.shape
    amax, mx = _first_absmax(x)
    zero = amax < _EPS
    with np.errstate(all="ignore"):
        w = qw if qw is not None else (x * x).astype(_F)
        wx = (w * x).astype(_F)

        def attempt(iscale):
            l = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
            lf = l.astype(_F)
            sumlx = _seqsum(wx * lf)
            suml2 = _seqsum((w * lf) * lf)
            return l, sumlx, suml2

        iscale = _div(_F(-nmax), mx)
        l, sumlx, suml2 = attempt(iscale)
        L = l + nmax
        scale = np.where(suml2 != 0, _div(sumlx, suml2), _F(0)).astype(_F)
        best = (scale * sumlx).astype(_F)
        for is_ in range(-9, 10):
            if is_ == 0:
                continue
            iscale = _div(-(_F(nmax) + _F(0.1) * _F(is_)), mx)
            l, sumlx, suml2 = attempt(iscale)
            better = (suml2 > 0) & ((sumlx * sumlx).astype(_F) > (best * suml2).astype(_F))
            L = np.where(better[:, None], l + nmax, L)
            new_scale = _div(sumlx, suml2)
            scale = np.where(better, new_scale, scale)
            best = np.where(better, (new_scale * sumlx).astype(_F), best)
    scale = np.where(zero, _F(0), scale).astype(_F)
    L = np.where(zero[:, None], 0, L)
    return scale, L


def make_q3_quants(x, nmax: int):
    """``make_q3_quants(n, nmax, x, L, do_rmse=true)`` -> (scale (N,), L (N, n) in 0..2*nmax-1)."""
    N, n = x.shape
    amax, mx = _first_absmax(x)
    zero = amax < _EPS
    with np.errstate(all="ignore"):
        iscale = _div(_F(-nmax), mx)
        L = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
        w = (x * x).astype(_F)
        wx = (w * x).astype(_F)
        Lf = L.astype(_F)
        sumlx = _seqsum(wx * Lf)
        suml2 = _seqsum((w * Lf) * Lf)
        for _ in range(5):
            for i in range(n):
                wi, xi, wxi = w[:, i], x[:, i], wx[:, i]
                li = L[:, i].astype(_F)
                slx = (sumlx - wxi * li).astype(_F)
                ok = slx > 0
                sl2 = (suml2 - (wi * li) * li).astype(_F)
                new_l = np.clip(nearest_int(_div((xi * sl2).astype(_F), slx)), -nmax, nmax - 1)
                nl = new_l.astype(_F)
                changed = ok & (new_l != L[:, i])
                slx2 = (slx + wxi * nl).astype(_F)
                sl22 = (sl2 + (wi * nl) * nl).astype(_F)
                take = changed & (sl22 > 0) & (((slx2 * slx2).astype(_F) * suml2).astype(_F)
                                              > ((sumlx * sumlx).astype(_F) * sl22).astype(_F))
                L[:, i] = np.where(take, new_l, L[:, i])
                sumlx = np.where(take, slx2, sumlx)
                suml2 = np.where(take, sl22, suml2)
        scale = np.where(suml2 > 0, _div(sumlx, suml2), _F(0)).astype(_F)
    return np.where(zero, _F(0), scale).astype(_F), np.where(zero[:, None], 0, L + nmax)


def _rowsum(a, *, from_zero: bool = True):
    """Sequential float32 sum over the rows of ``a`` (n, N): ``float s = 0; for (...) s += a[i];``
    (``from_zero=False``: ``float s = a[0]; for (i = 1; ...)``)."""
    s = a[0] + _F(0) if from_zero else a[0].copy()
    for i in range(1, a.shape[0]):
        s += a[i]
    return s


def _errT(scale, L, mn, xt, wt, use_mad):
    with np.errstate(all="ignore"):
        diff = ((scale[None, :] * L.astype(_F)).astype(_F) + mn[None, :]).astype(_F) - xt
        diff = np.abs(diff) if use_mad else (diff * diff).astype(_F)
        return _rowsum((wt * diff).astype(_F))


def make_qkx_quants(x, w, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool, v3: bool):
    """``make_qkx2_quants`` (``v3=False``) / ``make_qkx3_quants`` (``v3=True``) with weights ``w``
    -> (scale (N,), the_min (N,) = -min >= 0, L (N, n) in 0..nmax). Computed on the transposed (n, N) layout
    (the sequential sums are then n contiguous vector additions)."""
    xt = np.ascontiguousarray(x.T, dtype=_F)
    wt = np.ascontiguousarray(w.T, dtype=_F)
    n = xt.shape[0]
    with np.errstate(all="ignore"):
        mn, mx = xt[0].copy(), xt[0].copy()  # C's strict comparisons from x[0]: the sign of a zero min is C's
        for i in range(1, n):
            mn = np.where(xt[i] < mn, xt[i], mn)
            mx = np.where(xt[i] > mx, xt[i], mx)
        sum_w = _rowsum(wt, from_zero=False)
        sum_x = _rowsum((wt * xt).astype(_F), from_zero=False)
    mn = np.where(mn > 0, _F(0), mn).astype(_F)
    degenerate = (mx <= mn) if v3 else (mx == mn)
    with np.errstate(all="ignore"):
        rng = (mx - mn).astype(_F)
        iscale = _div(_F(nmax), rng)
        scale = _div(_F(1), iscale)
        L = np.clip(nearest_int((iscale[None, :] * (xt - mn[None, :]).astype(_F)).astype(_F)), 0, nmax)
        best = _errT(scale, L, mn, xt, wt, use_mad)
        for is_ in range(nstep + 1):
            # min is the best fit so far: the C code divides by (max - min) with the updated min
            iscale = _div((_F(rmin) + _F(rdelta) * _F(is_)).astype(_F) + _F(nmax), (mx - mn).astype(_F))
            v = (iscale[None, :] * (xt - mn[None, :]).astype(_F)).astype(_F)
            if v3:
                la = np.where(v > 0, nearest_int(np.where(v < _F(nmax), v, _F(nmax))), 0)
            else:
                la = np.clip(nearest_int(v), 0, nmax)
            lf = la.astype(_F)
            wl = (wt * lf).astype(_F)
            sum_l = _rowsum(wl)
            sum_l2 = _rowsum((wl * lf).astype(_F))
            sum_xl = _rowsum((wl * xt).astype(_F))
            D = ((sum_w * sum_l2).astype(_F) - (sum_l * sum_l).astype(_F)).astype(_F)
            this_scale = _div(((sum_w * sum_xl).astype(_F) - (sum_x * sum_l).astype(_F)).astype(_F), D)
            this_min = _div(((sum_l2 * sum_x).astype(_F) - (sum_l * sum_xl).astype(_F)).astype(_F), D)
            pos = this_min > 0
            this_scale = np.where(pos, _div(sum_xl, sum_l2), this_scale).astype(_F)
            this_min = np.where(pos, _F(0), this_min).astype(_F)
            cur = _errT(this_scale, la, this_min, xt, wt, use_mad)
            better = (D > 0) & (cur < best)
            L = np.where(better[None, :], la, L)
            best = np.where(better, cur, best)
            scale = np.where(better, this_scale, scale)
            mn = np.where(better, this_min, mn)
    scale = np.where(degenerate, _F(0), scale).astype(_F)
    L = np.where(degenerate[None, :], 0, L)
    return scale, (-mn).astype(_F), np.ascontiguousarray(L.T)


def make_qp_quants(x, nmax: int, qw):
    """``make_qp_quants(n, nmax, x, L, quant_weights)`` -> (scale (N,), L (N, n) in 0..255 (uint8 wrap))."""
    N, n = x.shape
    with np.errstate(all="ignore"):
        mx = np.zeros(N, dtype=_F)
        for i in range(n):
            mx = np.where(mx > x[:, i], mx, x[:, i])
        zero = mx < _EPS
        iscale = _div(_F(nmax), mx)
        L = nearest_int(iscale[:, None] * x) & 0xFF
        scale = _div(_F(1), iscale)

        def mse(sc, l):
            diff = (x - (sc[:, None] * l.astype(_F)).astype(_F)).astype(_F)
            return _seqsum(((qw * diff).astype(_F) * diff).astype(_F))

        best = mse(scale, L)
        for is_ in range(-4, 5):
            if is_ == 0:
                continue
            isc = _div((_F(0.1) * _F(is_)).astype(_F) + _F(nmax), mx)
            sc = _div(_F(1), isc)
            l = np.minimum(nmax, nearest_int(isc[:, None] * x))
            m = mse(sc, l)
            better = m < best
            best = np.where(better, m, best)
            iscale = np.where(better, isc, iscale)
        L = np.minimum(nmax, nearest_int(iscale[:, None] * x))
        wx = (qw * x).astype(_F)
        Lf = L.astype(_F)
        sumlx = _seqsum((wx * Lf).astype(_F))
        suml2 = _seqsum(((qw * Lf).astype(_F) * Lf).astype(_F))
        for _ in range(5):
            for i in range(n):
                wi, xi, wxi = qw[:, i], x[:, i], wx[:, i]
                li = L[:, i].astype(_F)
                slx = (sumlx - (wxi * li).astype(_F)).astype(_F)
                sl2 = (suml2 - ((wi * li).astype(_F) * li).astype(_F)).astype(_F)
                ok = (slx > 0) & (sl2 > 0)
                new_l = np.minimum(nmax, nearest_int(_div((xi * sl2).astype(_F), slx)))
                nl = new_l.astype(_F)
                changed = ok & (new_l != L[:, i])
                slx2 = (slx + (wxi * nl).astype(_F)).astype(_F)
                sl22 = (sl2 + ((wi * nl).astype(_F) * nl).astype(_F)).astype(_F)
                take = changed & (((slx2 * slx2).astype(_F) * suml2).astype(_F)
                                  > ((sumlx * sumlx).astype(_F) * sl22).astype(_F))
                L[:, i] = np.where(take, new_l, L[:, i])
                sumlx = np.where(take, slx2, sumlx)
                suml2 = np.where(take, sl22, suml2)
        scale = np.where(suml2 > 0, _div(sumlx, suml2), _F(0)).astype(_F)
    return np.where(zero, _F(0), scale).astype(_F), np.where(zero[:, None], 0, L & 0xFF)


# ---------------------------------------------------------------------------------------------------------------
# the per-type drivers: x (B, 256) float32 super-blocks, qw (B, 256) or None

def _sub(x, size):
    B = x.shape[0]
    return x.reshape(B * (QK_K // size), size)


def _requant_asym(x, L, d, dmin, sc, mc, size, nmax):
    """Requantization with the stored fp16 d/dmin and integer codes (skipped where d * sc == 0)."""
    B = x.shape[0]
    ns = QK_K // size
    with np.errstate(all="ignore"):
        dd = (np.repeat(d, ns) * sc.reshape(-1).astype(_F)).astype(_F)
        dm = (np.repeat(dmin, ns) * mc.reshape(-1).astype(_F)).astype(_F)
        xs = _sub(x, size)
        l = np.clip(nearest_int(_div((xs + dm[:, None]).astype(_F), dd[:, None])), 0, nmax)
    L = np.where((dd != 0)[:, None], l, L.reshape(B * ns, size))
    return L.reshape(B, QK_K)


def _requant_sym(x, L, d, sc, size, lo, hi):
    B = x.shape[0]
    ns = QK_K // size
    with np.errstate(all="ignore"):
        dd = (np.repeat(d, ns) * sc.reshape(-1).astype(_F)).astype(_F)
        l = np.clip(nearest_int(_div(_sub(x, size), dd[:, None])), lo, hi) - lo
    L = np.where((dd != 0)[:, None], l, L.reshape(B * ns, size))
    return L.reshape(B, QK_K)


def _sigma2(x, factor):
    s = _seqsum((x * x).astype(_F))
    return ((_F(factor) * s).astype(_F) / _F(QK_K)).astype(_F)


def _imatrix_weights(x, qw, sigma2):
    with np.errstate(all="ignore"):
        return (qw * np.sqrt((sigma2[:, None] + (x * x).astype(_F)).astype(_F))).astype(_F)


def _running_max(v):
    """``float m = 0; for (...) if (v[j] > m) m = v[j];``: +0 (never -0) when nothing is positive."""
    m = np.max(v, axis=1)
    return np.where(m > 0, m, _F(0)).astype(_F)


def _q45_k(x, qw, nmax):
    """Q4_K (nmax 15) and Q5_K (nmax 31): 8 sub-blocks of 32, 6-bit scales and mins."""
    B = x.shape[0]
    xs = _sub(x, 32)
    if qw is None:
        with np.errstate(all="ignore"):
            av = np.sqrt(_seqsum((xs * xs).astype(_F)) / _F(32)).astype(_F)
            w = (av[:, None] + np.abs(xs)).astype(_F)
        rmin, nstep = (-1.0, 20) if nmax == 15 else (-0.5, 15)
        scales, mins, L = make_qkx_quants(xs, w, nmax, rmin, 0.1, nstep, False, False)
        scales, mins = scales.reshape(B, 8), mins.reshape(B, 8)
        max_scale, max_min = _running_max(scales), _running_max(mins)
        with np.errstate(all="ignore"):
            inv_s = np.where(max_scale > 0, _div(_F(63), max_scale), _F(0)).astype(_F)
            inv_m = np.where(max_min > 0, _div(_F(63), max_min), _F(0)).astype(_F)
            sc = np.minimum(63, nearest_int(inv_s[:, None] * scales) & 0xFF)
            mc = np.minimum(63, nearest_int(inv_m[:, None] * mins) & 0xFF)
        d = _f16(_div(max_scale, _F(63)))
        dmin = _f16(_div(max_min, _F(63)))
    else:
        sigma2 = _sigma2(x, 2)
        w = _sub(_imatrix_weights(x, qw, sigma2), 32)
        sw = _seqsum(w).reshape(B, 8)
        scales, mins, L = make_qkx_quants(xs, w, nmax, -0.9, 0.05, 36, False, True)
        d_block, sc = make_qp_quants(scales.reshape(B, 8), 63, sw)
        m_block, mc = make_qp_quants(mins.reshape(B, 8), 63, sw)
        if nmax == 31:
            sc, mc = np.minimum(63, sc), np.minimum(63, mc)
        else:
            sc, mc = sc & 63, mc & 63  # Q4_K stores them in 6 bits without a clamp; they never exceed 63
        d, dmin = _f16(d_block), _f16(m_block)
    L = _requant_asym(x, L, d, dmin, sc, mc, 32, nmax)
    return L, d, dmin, sc, mc


def _q2_k(x, qw):
    B = x.shape[0]
    xs = _sub(x, 16)
    if qw is None:
        w = np.abs(xs)
        scales, mins, L = make_qkx_quants(xs, w, 3, -0.5, 0.1, 15, True, False)
        scales, mins = scales.reshape(B, 16), mins.reshape(B, 16)
        max_scale, max_min = _running_max(scales), _running_max(mins)
        with np.errstate(all="ignore"):
            isc = _div(_F(15), max_scale)
            imn = _div(_F(15), max_min)
            sc = np.where((max_scale > 0)[:, None], nearest_int(isc[:, None] * scales), 0) & 0xFF
            mc = np.where((max_min > 0)[:, None], nearest_int(imn[:, None] * mins), 0)
        byte = (sc | (mc << 4)) & 0xFF
        sc, mc = byte & 0xF, byte >> 4
        d = np.where(max_scale > 0, _f16(_div(max_scale, _F(15))), _F(0)).astype(_F)
        dmin = np.where(max_min > 0, _f16(_div(max_min, _F(15))), _F(0)).astype(_F)
    else:
        sigma2 = _sigma2(x, 1)
        w = _sub(_imatrix_weights(x, qw, sigma2), 16)
        sw = _seqsum(w).reshape(B, 16)
        scales, mins, L = make_qkx_quants(xs, w, 3, -0.9, 0.05, 36, False, True)
        dm, sc = make_qp_quants(scales.reshape(B, 16), 15, sw)
        mm, mc = make_qp_quants(mins.reshape(B, 16), 15, sw)
        byte = (sc | (mc << 4)) & 0xFF
        sc, mc = byte & 0xF, byte >> 4
        d, dmin = _f16(dm), _f16(mm)
    L = _requant_asym(x, L, d, dmin, sc, mc, 16, 3)
    return L, d, dmin, sc, mc


def _q3_k(x, qw):
    B = x.shape[0]
    xs = _sub(x, 16)
    if qw is None:
        scales, L = make_q3_quants(xs, 4)
        scales = scales.reshape(B, 16)
        _, max_scale = _first_absmax(scales)
        with np.errstate(all="ignore"):
            iscale = _div(_F(-32), max_scale)
            l = nearest_int(iscale[:, None] * scales)
        l8 = ((l + 128) & 0xFF) - 128  # int8_t
        sc6 = np.clip(l8, -32, 31) + 32
        has = max_scale != 0
        sc6 = np.where(has[:, None], sc6, 0)
        d = np.where(has, _f16(_div(_F(1), iscale)), _F(0)).astype(_F)
    else:
        sigma2 = _sigma2(x, 2)
        w = _sub(_imatrix_weights(x, qw, sigma2), 16)
        sw = _seqsum(w).reshape(B, 16)
        scales, L = make_qx_quants(xs, 4, w)
        d_block, sc6 = make_qx_quants(scales.reshape(B, 16), 32, sw)
        d = _f16(d_block)
    sc = sc6 - 32
    L = _requant_sym(x, L, d, sc, 16, -4, 3)
    return L - 4, d, sc


def _q6_k(x, qw):
    B = x.shape[0]
    xs = _sub(x, 16)
    scales, L = make_qx_quants(xs, 32, None if qw is None else _sub(qw, 16))
    scales = scales.reshape(B, 16)
    amax, max_scale = _first_absmax(scales)
    zero = amax < _EPS
    with np.errstate(all="ignore"):
        iscale = _div(_F(-128), max_scale)
        sc = np.minimum(127, nearest_int(iscale[:, None] * scales))
    sc = ((sc + 128) & 0xFF) - 128
    d = _f16(_div(_F(1), iscale))
    L = _requant_sym(x, L, d, sc, 16, -32, 31)
    # A block whose sub-block scales all vanish is written as zero bytes: d = 0, scales 0, L = 0 (code -32).
    d = np.where(zero, _F(0), d).astype(_F)
    sc = np.where(zero[:, None], 0, sc)
    L = np.where(zero[:, None], 0, L)
    return L - 32, d, sc


# ---------------------------------------------------------------------------------------------------------------
# the 32-element types: quantize_row_q{4_0,4_1,5_0,5_1,8_0}_ref and the quantize_row_*_impl imatrix variants

def _seq_min_max(x):
    """``if (v < min) min = v; if (v > max) max = v;`` from FLT_MAX / -FLT_MAX: the first of equal extremes (so
    the sign of a zero is C's)."""
    mn = np.full(x.shape[0], np.finfo(_F).max, dtype=_F)
    mx = -mn
    for i in range(x.shape[1]):
        v = x[:, i]
        mn = np.where(v < mn, v, mn)
        mx = np.where(v > mx, v, mx)
    return mn, mx


def _trunc_int(v):
    """C's float -> integer conversion (truncation toward zero); the values here are small and finite."""
    with np.errstate(all="ignore"):
        return np.trunc(np.where(np.isfinite(v), v, 0)).astype(np.int64)


def _legacy(x, row_len, qw, name, row_sigma2=None):
    """x (B, 32) float32 blocks, ``row_len`` elements per row (for the imatrix path's sigma2) -> (L (B, 32) stored
    unsigned codes, d (B,), m (B,) or None). ``row_sigma2``: the rows' sigma2 given (one per row of ``row_len``
    elements) instead of computed from ``x`` (``search_blocks``)."""
    nmax = {"q4_0": 8, "q4_1": 15, "q5_0": 16, "q5_1": 31, "q8_0": 127}[name]
    with np.errstate(all="ignore"):
        if qw is not None and name != "q8_0":
            rows = x.reshape(-1, row_len)
            if row_sigma2 is None:
                sigma2 = (_seqsum((rows * rows).astype(_F)) / _F(row_len)).astype(_F)
            else:
                sigma2 = np.asarray(row_sigma2, dtype=_F).reshape(-1)
            s2 = np.repeat(sigma2, row_len // 32)
            w = (qw * np.sqrt((s2[:, None] + (x * x).astype(_F)).astype(_F))).astype(_F)
            if name in ("q4_0", "q5_0"):
                d, L = make_qx_quants(x, nmax, w)
                return L, _f16(d), None
            d, the_min, L = make_qkx_quants(x, w, nmax, -0.9, 0.05, 36, False, True)
            return L, _f16(d), _f16(-the_min)
        if name == "q8_0":
            amax = np.max(np.abs(x), axis=1)
            d = (amax / _F(127)).astype(_F)
            idv = np.where(d != 0, _div(_F(1), d), _F(0)).astype(_F)
            v = (x * idv[:, None]).astype(_F).astype(np.float64)
            q = np.sign(v) * np.floor(np.abs(v) + 0.5)  # roundf: half away from zero, exact in float64
            return q.astype(np.int64) + 128, _f16(d), None
        if name in ("q4_0", "q5_0"):
            _, mx = _first_absmax(x)  # max = +0 when no |v| exceeds 0 (a block of -0: d = -0, as in C)
            d = (mx / _F(-nmax)).astype(_F)
            idv = np.where(d != 0, _div(_F(1), d), _F(0)).astype(_F)
            v = ((x * idv[:, None]).astype(_F) + _F(nmax + 0.5)).astype(_F)
            L = np.minimum(2 * nmax - 1, _trunc_int(v) & 0xFF)  # (int8_t) then MIN
            return L, _f16(d), None
        mn, mx = _seq_min_max(x)
        d = ((mx - mn).astype(_F) / _F(nmax)).astype(_F)
        idv = np.where(d != 0, _div(_F(1), d), _F(0)).astype(_F)
        v = (((x - mn[:, None]).astype(_F) * idv[:, None]).astype(_F) + _F(0.5)).astype(_F)
        L = _trunc_int(v) & 0xFF
        if name == "q4_1":
            L = np.minimum(15, L)
        return L, _f16(d), _f16(mn)


def _best_index(levels, v):
    """``best_index_int8(16, values, v)``: the largest j with ``2v >= values[j-1] + values[j]`` (C's branch-free
    binary search over the sorted levels), 0 for NaN."""
    lv = np.asarray(levels, dtype=np.int64)
    x2 = (v + v).astype(_F)
    idx = np.zeros(x2.shape, dtype=np.int8)
    for t in (lv[:-1] + lv[1:]).astype(_F):  # increasing midpoint sums: idx counts those <= 2v (NaN: none)
        idx += x2 >= t
    return idx.astype(np.int64)


def _iq4_nl(x, qw, levels):
    """``quantize_iq4_nl`` (what llama.cpp writes to files): ``quantize_row_iq4_nl_impl(32, 32, 16, ...)`` with
    ntry 7, weights ``x^2`` without an imatrix (``quantize_row_iq4_nl_ref``'s ntry -1 is not what files get).
    Computed on the transposed (32, B) layout (sequential sums as contiguous vector additions)."""
    vals = np.asarray(levels, dtype=_F)
    ntry = 7
    xt = np.ascontiguousarray(x.T, dtype=_F)
    with np.errstate(all="ignore"):
        sigma2 = (_rowsum((xt * xt).astype(_F)) * _F(2.0 / 32)).astype(_F)
        if qw is not None:
            wt = (np.ascontiguousarray(qw.T, dtype=_F) * np.sqrt((sigma2[None, :] + (xt * xt).astype(_F)).astype(_F)))
        else:
            wt = xt * xt
        wt = wt.astype(_F)
        amax, mx = _first_absmax(x)
        zero = amax < _EPS
        d = _div(-mx if ntry > 0 else mx, vals[0])

        def sums(idv):
            L = _best_index(levels, (idv[None, :] * xt).astype(_F))
            q = vals[L]
            wq = (wt * q).astype(_F)
            return L, _rowsum((wq * xt).astype(_F)), _rowsum((wq * q).astype(_F))

        L, sumqx, sumq2 = sums(_div(_F(1), d))
        d = np.where(sumq2 > 0, _div(sumqx, sumq2), _F(0)).astype(_F)
        best = (d * sumqx).astype(_F)
        for itry in range(-ntry, ntry + 1):
            _, sqx, sq2 = sums(_div(_F(itry + int(levels[0])), mx))
            take = (sq2 > 0) & ((sqx * sqx).astype(_F) > (best * sq2).astype(_F))
            nd = _div(sqx, sq2)
            d = np.where(take, nd, d)
            best = np.where(take, (nd * sqx).astype(_F), best)
        d = np.where(zero, _F(0), d).astype(_F)
        L = np.where(zero[None, :], 0, L)
        if ntry > 0:
            idv = np.where(d != 0, _div(_F(1), d), _F(0)).astype(_F)
            L = _best_index(levels, (idv[None, :] * xt).astype(_F))
    return np.ascontiguousarray(L.T), _f16(d)


_CHUNK = 1 << 20  # elements per piece: the search keeps ~10 float32 temporaries of a piece alive


def quantize_kquant(x: np.ndarray, name: str, imatrix: Optional[np.ndarray] = None):
    """llama.cpp's quantization of float32 ``x`` (..., n) to the GGUF type ``name`` (``"q2_k"`` ... ``"q6_k"``: n
    a multiple of 256; ``"q4_0"`` ... ``"q8_0"``, ``"iq4_nl"``: of 32). ``imatrix``: None or per-column importance
    weights of shape (n,) (llama.cpp's ``quant_weights``: the ``quantize_row_*_impl`` path) -> (codes,
    ``GGUFScales``). Arguments are validated by the caller. Rows are independent: large tensors run in pieces
    of whole rows (about ``_CHUNK`` elements), which bounds the memory of the search's temporaries."""
    shape = x.shape
    n = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    per = max(1, _CHUNK // max(n, 1))
    if rows > per:
        x2 = x.reshape(rows, n)
        parts = [_quantize_rows(x2[r:r + per], name, imatrix) for r in range(0, rows, per)]
        codes = np.concatenate([p[0] for p in parts]).reshape(shape)

        def cat(field):
            vals = [getattr(p[1], field) for p in parts]
            return None if vals[0] is None else np.concatenate(vals).reshape(*shape[:-1], -1)

        return codes, GGUFScales(d=cat("d"), dmin=cat("dmin"), scale_codes=cat("scale_codes"),
                                 min_codes=cat("min_codes"))
    return _quantize_rows(x, name, imatrix)


def _quantize_rows(x: np.ndarray, name: str, imatrix: Optional[np.ndarray] = None):
    shape = x.shape
    n = shape[-1]
    lead = shape[:-1]
    rows = int(np.prod(lead, dtype=np.int64))
    qw = None
    if imatrix is not None:
        qw = np.ascontiguousarray(np.broadcast_to(np.asarray(imatrix, dtype=_F).reshape(1, n), (rows, n)))
    if name in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl"):
        B32 = rows * (n // 32)
        xb = np.ascontiguousarray(x, dtype=_F).reshape(B32, 32)
        if name == "iq4_nl":
            L, d = _iq4_nl(xb, None if qw is None else qw.reshape(B32, 32), GGUF_DTYPES[name].levels)
            m = None
        else:
            L, d, m = _legacy(xb, n, None if qw is None else qw.reshape(B32, 32), name)
        bias = {"q4_0": 8, "q5_0": 16, "q8_0": 128}.get(name, 0)
        codes = (L - bias).astype(np.int8 if bias else np.uint8)
        return codes.reshape(shape), GGUFScales(
            d=np.asarray(d, dtype=_F).reshape(*lead, n // 32),
            dmin=None if m is None else np.asarray(m, dtype=_F).reshape(*lead, n // 32),
            scale_codes=None, min_codes=None)
    B = rows * (n // QK_K)
    xb = np.ascontiguousarray(x, dtype=_F).reshape(B, QK_K)
    if qw is not None:
        qw = qw.reshape(B, QK_K)
    nsb = n // QK_K
    dmin = mc = None
    if name in ("q4_k", "q5_k"):
        L, d, dmin, sc, mc = _q45_k(xb, qw, 15 if name == "q4_k" else 31)
        codes = L.astype(np.uint8)
        sub = 32
    elif name == "q2_k":
        L, d, dmin, sc, mc = _q2_k(xb, qw)
        codes = L.astype(np.uint8)
        sub = 16
    elif name == "q3_k":
        L, d, sc = _q3_k(xb, qw)
        codes = L.astype(np.int8)
        sub = 16
    elif name == "q6_k":
        L, d, sc = _q6_k(xb, qw)
        codes = L.astype(np.int8)
        sub = 16
    else:  # pragma: no cover - the caller resolves names
        raise ValueError(f"unknown k-quant {name!r}")
    ns = n // sub
    return codes.reshape(shape), GGUFScales(
        d=np.asarray(d, dtype=_F).reshape(*lead, nsb),
        dmin=None if dmin is None else np.asarray(dmin, dtype=_F).reshape(*lead, nsb),
        scale_codes=np.asarray(sc).astype(np.int16).reshape(*lead, ns),
        min_codes=None if mc is None else np.asarray(mc).astype(np.int16).reshape(*lead, ns),
    )


def row_sigma2(x: np.ndarray) -> np.ndarray:
    """llama.cpp's ``sigma2`` of the 32-element types' importance-weighted search: ``sum(x^2) / n_per_row`` per row
    of ``x`` (..., n), float32, summed in order."""
    x = np.ascontiguousarray(x, dtype=_F)
    with np.errstate(all="ignore"):
        return (_seqsum((x * x).astype(_F)) / _F(x.shape[-1])).astype(_F)


def search_blocks(x: np.ndarray, name: str, imatrix: Optional[np.ndarray] = None, *, sigma2=None):
    """``quantize_kquant`` of ``x`` (rows, k whole blocks) with the 32-element types' ``sigma2`` given per row
    (``row_sigma2`` of the whole rows these blocks belong to) rather than computed from ``x``: llama.cpp's search
    of some blocks of a wider row, as GPTQ runs it one block at a time. k-quants' sigma2 is per super-block, so
    for them this is ``quantize_kquant``."""
    if sigma2 is None or imatrix is None or name not in ("q4_0", "q4_1", "q5_0", "q5_1"):
        return quantize_kquant(x, name, imatrix)
    rows, n = x.shape
    xb = np.ascontiguousarray(x, dtype=_F).reshape(rows * (n // 32), 32)
    qw = np.ascontiguousarray(np.broadcast_to(np.asarray(imatrix, dtype=_F).reshape(1, n), (rows, n)))
    L, d, m = _legacy(xb, n, qw.reshape(-1, 32), name, row_sigma2=sigma2)
    bias = {"q4_0": 8, "q5_0": 16}.get(name, 0)
    codes = (L - bias).astype(np.int8 if bias else np.uint8)
    return codes.reshape(rows, n), GGUFScales(
        d=np.asarray(d, dtype=_F).reshape(rows, n // 32),
        dmin=None if m is None else np.asarray(m, dtype=_F).reshape(rows, n // 32),
        scale_codes=None, min_codes=None)


def sub_scales(p: GGUFScales, sub: int):
    """(scales, offsets) per sub-block, float32, exact: k-quants ``d * scale_code`` and ``-(dmin * min_code)``;
    32-element types ``d`` and ``m`` (held in ``dmin``). Offsets None without mins."""
    with np.errstate(all="ignore"):
        if p.scale_codes is None:
            return np.asarray(p.d, dtype=_F), None if p.dmin is None else np.asarray(p.dmin, dtype=_F)
        rep = QK_K // sub
        scale = (np.repeat(p.d, rep, axis=-1) * p.scale_codes.astype(_F)).astype(_F)
        off = None
        if p.dmin is not None:
            off = -(np.repeat(p.dmin, rep, axis=-1) * p.min_codes.astype(_F)).astype(_F)
    return scale, off


def dequantize_kquant(codes, p: GGUFScales, sub: int, levels: tuple = ()) -> np.ndarray:
    """Float32 values: ``(d * scale_code) * code - (dmin * min_code)`` per sub-block (ggml's order; the products
    are exact, the subtraction rounds once); 32-element types ``d * code + m``; IQ4_NL ``d * levels[code]``."""
    shape = codes.shape
    scale, off = sub_scales(p, sub)
    if levels:
        codes = np.asarray(levels, dtype=_F)[codes.astype(np.int64)]
    with np.errstate(all="ignore"):
        c = codes.astype(_F).reshape(*shape[:-1], shape[-1] // sub, sub)
        y = (scale[..., None] * c).astype(_F)
        if off is not None:
            y = (y + off[..., None]).astype(_F)  # a + (-b) == a - b in IEEE arithmetic
    return y.reshape(shape)


def requantize(x: np.ndarray, p: GGUFScales, name: str) -> np.ndarray:
    """Codes of float32 ``x`` (..., n) under GIVEN stored scales ``p`` (a ``GGUFScales`` of x's blocks): the
    element step of llama.cpp's quantizer with the scales fixed (``element_codes`` per sub-block).
    ``requantize(x, quantize(x, k-quant).super_scales)`` gives llama.cpp's codes wherever ``d * sc`` is not 0
    (there: code 0, Q3_K / Q6_K their lowest; value = the offset); for the 32-element types llama.cpp's codes
    come from the unrounded d, so a few codes may differ from requantizing with the stored fp16 d."""
    sub = GGUF_DTYPES[name].subblock_size
    shape = x.shape
    scale, off = sub_scales(p, sub)
    xs = np.ascontiguousarray(x, dtype=_F).reshape(-1, sub)
    scale = np.asarray(scale, dtype=_F).reshape(-1, 1)
    off = None if off is None else np.asarray(off, dtype=_F).reshape(-1, 1)
    return element_codes(xs, scale, off, name).reshape(shape)


def element_codes(x, scale, offset, name: str) -> np.ndarray:
    """llama.cpp's element rule of GGUF type ``name`` with a given sub-block ``scale`` and float ``offset``
    (float32 arrays broadcasting against ``x``; ``offset`` None for the types without): what GPTQ needs column
    by column. A value is ``scale * code + offset`` (IQ4_NL: ``scale * levels[code]``).

    k-quants: ``clamp(nearest_int((x - offset) / scale), lo, hi)`` (llama.cpp's final requantization); where the
    scale is 0 code 0, or for q3_k / q6_k the lowest code where that gives the sign of ``x`` (so that the zero
    values of a fake-quantized weight, -0.0 in ggml's all-zero blocks, requantize bit for bit). 32-element types,
    with ``id = 1/scale`` (0 when the scale is 0): Q4_0/Q5_0 ``min(2*nmax - 1, trunc(x*id + nmax + 0.5)) -
    nmax``, Q4_1/Q5_1 ``clamp(trunc((x - offset)*id + 0.5), 0, nmax)``, Q8_0 ``roundf(x*id)``, IQ4_NL the level
    whose midpoint interval holds ``x*id``."""
    t = GGUF_DTYPES[name]
    x = np.asarray(x, dtype=_F)
    scale = np.asarray(scale, dtype=_F)
    off = None if offset is None else np.asarray(offset, dtype=_F)
    lo, hi = t.element.min, t.element.max
    with np.errstate(all="ignore"):
        idv = np.where(scale != 0, _div(_F(1), scale), _F(0)).astype(_F)
        if t.is_kquant:
            num = x if off is None else (x - off).astype(_F)  # x + dmin*m
            # a zero scale: any code gives a zero value; signed types (q3_k, q6_k) take lo where that keeps the
            # sign of x (ggml's all-zero blocks are memset to stored code 0 = lo: -0.0 values), else 0
            neg = (np.signbit(x) != np.signbit(scale)) if lo < 0 and off is None else False
            c = np.where(scale != 0, np.clip(nearest_int(_div(num, scale)), lo, hi), np.where(neg, lo, 0))
        elif t.levels:
            c = _best_index(t.levels, (x * idv).astype(_F))
        elif name == "q8_0":
            v = (x * idv).astype(_F).astype(np.float64)
            c = np.clip(np.sign(v) * np.floor(np.abs(v) + 0.5), lo, hi)
        elif off is None:  # q4_0, q5_0
            nmax = -lo
            v = ((x * idv).astype(_F) + _F(nmax + 0.5)).astype(_F)
            c = np.clip(_trunc_int(v), 0, 2 * nmax - 1) - nmax
        else:  # q4_1, q5_1
            v = (((x - off).astype(_F) * idv).astype(_F) + _F(0.5)).astype(_F)
            c = np.clip(_trunc_int(v), 0, hi)
    return np.asarray(c).astype(np.int8 if t.element.signed else np.uint8)

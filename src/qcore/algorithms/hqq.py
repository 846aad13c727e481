"""HQQ, half-quadratic quantization (Badri & Shaji, 2023; mobiusml/hqq ``optimize_weights_proximal_legacy``), as
a pure function: a weight and an integer spec in, a ``QTensor`` out. No calibration data.

HQQ fits each group's quantization parameters to the weight itself, minimising the sparsity-promoting error
``||W - dequant(quant(W))||_p^p`` (``p < 1``: a few large errors cost less than many small ones, so outliers do
not dictate the scale) by half-quadratic splitting: an auxiliary error ``W_e`` takes the ``Lp`` term, the
parameters take a quadratic one, and the two are solved in turn while the coupling ``beta`` grows by ``kappa``.

The zero point, and why the scale moves too
-------------------------------------------
The paper's update keeps the min/max scale and solves for a *float* zero point
``z = mean(W_q - (W - W_e) / s)``. qcore's zero points are integers in the code range (``QuantSpec``: "False adds
an integer zero point"; ``quantize`` refuses any other), and so are Quark's for these specs: its uint4 export
writes ``zero_point_type: "int32"``, and a ``"float32"`` zero point has no qcore spelling
(``qcore.formats.quark_hf``: ``ValueError``). A float zero point rounded at the end would undo most of what HQQ
found. So the quadratic step here solves the same subproblem over both parameters the format can store, the
scale ``s`` and an integer zero point ``z`` (per group, codes ``c = W_q`` fixed, target ``T = W - W_e``)::

    min over s, z of  || T - s (c - z) ||^2

by least squares in ``(s, b = s z)`` (``s = cov(c, T) / var(c)``, ``b = s mean(c) - mean(T)``, the paper's
zero-point step is this with ``s`` held), then ``z = clip(rint(b / s), qmin, qmax)`` and the scale re-solved
for that integer ``z`` (``s = <c - z, T> / <c - z, c - z>``), kept at least ``scale_floor`` times the min/max
scale (default 1: the paper never moves the scale, so never narrows the range; a free scale shrinks to clip the
largest weights, which lowered the weight error but raised SmolLM2's perplexity above round-to-nearest's),
rounded to the spec's scale dtype (what the export stores). A symmetric spec has no zero point (``z = 0``):
only the scale moves. One iteration, from the min/max
parameters (``quantize``'s own rule, i.e. round-to-nearest)::

    W_q = clip(rint(W / s) + z, qmin, qmax)           # quantize's codes (z integer: rint(W/s + z) == rint(W/s) + z)
    W_r = s (W_q - z)                                 # dequantized
    W_e = shrink_p(W - W_r, beta) = sign(D) relu(|D| - |D|^(p-1) / beta),  D = W - W_r
    s, z = the quadratic step above on T = W - W_e    # s >= scale_floor * (the min/max scale)
    beta = beta * kappa

Each group keeps its best iterate by ``mean |W - W_r|^error_p`` (default 2, the squared error; the min/max start
is iterate 0, so the result is never worse than round-to-nearest by that measure). HQQ stops the whole tensor when
its mean absolute error grows (``error_p=1``); here every group keeps its own best over ``iters`` iterations, and
by the squared error (docs/algorithms.md "HQQ" has the trials on SmolLM2). The ``QTensor`` is
``qcore.quantize(W, spec, scale=s, zero_point=z)`` with the chosen parameters: exporting it (Quark HF, the qcore
layout) writes exactly these codes, scales and integer zero points, and reloading reproduces them bit for bit.

Arithmetic: ``precision="float32"`` (default; the weights, scales and codes are float32, and float32 halves the
memory traffic of 20 passes over every weight) or ``"float64"``. tests/algorithms/test_hqq.py compares both with
a plain float64 per-group transcription of the update (``float64``: the same codes and scales).

Specs: integer elements with float scales (``uint4`` per group asymmetric, ``int4`` per group symmetric, per
channel, per tensor, blocks; ragged last groups). Refused (``ValueError`` before any work): float element formats
(FP8, FP4), power-of-two scales (MX, ``pow2_scale``), shared microexponents, two-level scales, stochastic
rounding. numpy arrays and torch tensors (any device) go through the same code; torch is never imported here.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

import qcore
from qcore import QTensor, QuantSpec
from qcore._backend import is_torch, ops
from qcore.dtypes import IntDType
from qcore.granularity import to_blocks
from qcore.rounding import RoundingMode
from qcore.scales import round_scale

from .config import real_in_range

__all__ = ["hqq", "check_hqq_spec"]

_PRECISIONS = ("float32", "float64")


def check_hqq_spec(spec: Any) -> QuantSpec:
    """``spec`` if HQQ can fit it, else ValueError (TypeError for a non-spec) naming what it cannot take."""
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec must be a qcore.QuantSpec, got {type(spec).__name__}")
    what = spec.name or spec.dtype.name
    if not isinstance(spec.dtype, IntDType):
        raise ValueError(f"hqq: spec {what!r} has {spec.dtype.name} elements; HQQ fits integer grids (uint4, int4, "
                         f"...) with a scale and zero point, not float element formats")
    if spec.pow2_scale:
        raise ValueError(f"hqq: spec {what!r} has power-of-two scales ({spec.scale_dtype.name}); HQQ solves for "
                         f"a continuous scale (MX and pow2_scale formats are not supported)")
    if spec.subblock_shift_bits or spec.two_level:
        raise ValueError(f"hqq: spec {what!r} has shared microexponents or a two-level scale; not supported")
    if spec.rounding is not RoundingMode.NEAREST_EVEN:
        raise ValueError(f"hqq: spec {what!r} rounds {spec.rounding.name}; HQQ's codes are round-to-nearest")
    return spec


def check_hqq_options(p, beta, kappa, iters, precision) -> None:
    """ValueError for an option out of range (shared by ``hqq`` and the config)."""
    real_in_range(p, "p", 0.0, 1.0, lo_open=True)
    real_in_range(beta, "beta", 0.0, 1e12, lo_open=True)
    real_in_range(kappa, "kappa", 1.0, 100.0)
    if isinstance(iters, bool) or not isinstance(iters, numbers.Integral) or iters < 0:
        raise ValueError(f"iters must be an int >= 0, got {iters!r}")
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")


class _Math:
    """The few calls numpy and torch spell differently (beyond qcore's ``ops`` shim)."""

    def __init__(self, x):
        self.torch = is_torch(x)
        self.o = ops(x)

    def cast(self, x, precision: str):
        if self.torch:
            t = self.o.t
            return x.detach().to(t.float64 if precision == "float64" else t.float32)
        return np.asarray(x, dtype=np.float64 if precision == "float64" else np.float32)

    def sign(self, x):
        return self.o.t.sign(x) if self.torch else np.sign(x)

    def pow(self, x, e: float):
        return self.o.t.pow(x, e) if self.torch else np.power(x, x.dtype.type(e))

    def relu(self, x):
        return self.o.t.clamp(x, min=0) if self.torch else np.maximum(x, x.dtype.type(0))

    def rint_(self, x):
        return x.round_() if self.torch else np.rint(x, out=x)

    def clip_(self, x, lo, hi):
        return x.clamp_(lo, hi) if self.torch else np.clip(x, lo, hi, out=x)

    def relu_(self, x):
        return x.clamp_(min=0) if self.torch else np.maximum(x, x.dtype.type(0), out=x)

    def copysign_(self, x, sign_of):
        return x.copysign_(sign_of) if self.torch else np.copysign(x, sign_of, out=x)

    def rsub_(self, x, y):
        """``y - x``, written into ``x``."""
        return self.o.t.sub(y, x, out=x) if self.torch else np.subtract(y, x, out=x)

    def floor_tiny(self, x):
        """``max(x, smallest normal)``: a new array."""
        if self.torch:
            return x.clamp(min=float(self.o.t.finfo(x.dtype).tiny))
        return np.maximum(x, np.finfo(x.dtype).tiny)

    def ones_like(self, x):
        return self.o.t.ones_like(x) if self.torch else np.ones_like(x)

    def zeros_like(self, x):
        return self.o.t.zeros_like(x) if self.torch else np.zeros_like(x)


def hqq(weight: Any, spec: QuantSpec, *, p: float = 0.7, beta: float = 10.0, kappa: float = 1.01,
        iters: int = 20, error_p: float = 2.0, scale_floor: float = 1.0, precision: str = "float32") -> QTensor:
    """The HQQ-fitted ``QTensor`` of ``weight`` under ``spec`` (module docstring).

    weight: a float numpy array or torch tensor of a shape ``spec``'s granularity fits (a Linear's ``[out, in]``).
    p: the ``Lp`` norm of the error, in (0, 1] (HQQ: 0.7). beta, kappa: the half-quadratic coupling and its
    growth per iteration (HQQ: 10, 1.01). iters: iterations (HQQ: 20; 0 gives round-to-nearest).
    error_p: the norm each group's best iterate is chosen by, ``mean |W - W_r|^error_p`` (default 2: the mean
    squared error; HQQ's own early stop reads the mean absolute error, 1). scale_floor: each group's scale stays
    at least this times its min/max scale (default 1: the range is never narrower than round-to-nearest's, as
    in the paper, where the scale does not move; 0: free). precision: "float32" or "float64" arithmetic for the
    iterations."""
    check_hqq_spec(spec)
    check_hqq_options(p, beta, kappa, iters, precision)
    real_in_range(error_p, "error_p", 0.0, 8.0, lo_open=True)
    real_in_range(scale_floor, "scale_floor", 0.0, 1.0)
    if not (is_torch(weight) or isinstance(weight, np.ndarray)):
        raise TypeError(f"weight must be a numpy array or a torch tensor, got {type(weight).__name__}")
    if is_torch(weight) and (weight.is_complex() or not weight.is_floating_point()):
        raise TypeError(f"weight must be a float tensor, got dtype {weight.dtype}")
    if not is_torch(weight) and weight.dtype.kind != "f":
        raise TypeError(f"weight must be a float array, got dtype {weight.dtype}")
    if weight.ndim < 1 or any(int(s) == 0 for s in weight.shape):
        raise ValueError(f"weight must be a non-empty array, got shape {tuple(weight.shape)}")
    spec.scale_shape(tuple(weight.shape))  # ValueError when the granularity does not fit the shape
    m = _Math(weight)
    o = m.o
    x32 = m.cast(weight, "float32")
    if o.any(o.logical_not(o.isfinite(x32))):
        raise ValueError("weight holds NaN or Inf; HQQ needs finite weights")

    start = qcore.quantize(x32, spec)  # the min/max parameters: round-to-nearest, iterate 0
    if iters == 0:
        return start
    s, z = _fit(x32, spec, start.scales, start.zero_points, m, p=p, beta=beta, kappa=kappa, iters=int(iters),
                precision=precision, error_p=float(error_p), scale_floor=float(scale_floor))
    return qcore.quantize(x32, spec, scale=s, zero_point=z)


def _fit(x32, spec: QuantSpec, s0, z0, m: _Math, *, p, beta, kappa, iters, precision, error_p, scale_floor):
    """The iterations on the blocked weight; returns the best (scale, zero point or None) per block, float32 in
    ``spec.scale_shape``. The least-squares step reads four sums per group (``sum c``, ``sum t``, ``sum c^2``,
    ``sum c t``); full-size temporaries are updated in place."""
    o = m.o
    x, blk = to_blocks(m.cast(x32, precision), spec.granularity, o)
    ax = blk.reduce_axes
    ragged = tuple(blk.padded) != tuple(blk.shape)
    mask = to_blocks(m.ones_like(m.cast(x32, precision)), spec.granularity, o)[0] if ragged else None
    n = o.sum(mask, ax) if ragged else float(math.prod(blk.tile))
    sym = bool(spec.symmetric)
    qmin, qmax = float(spec.qmin), float(spec.qmax)

    def total(v):
        return o.sum(v, ax)

    def rounded(s_new):  # float32 scale of the spec's scale dtype (what the export stores), in the compute dtype
        s32 = m.cast(s_new, "float32")
        return m.cast(round_scale(s32, spec.scale_dtype, o, positive=s32 > 0), precision)

    s = m.cast(o.reshape(s0, blk.scale_blocked_shape), precision)
    s_floor = None if not scale_floor else s * scale_floor  # the min/max scale times scale_floor
    z = None if sym else m.cast(o.reshape(z0, blk.scale_blocked_shape), precision)
    best_s, best_z, best_err = s, z, None
    for it in range(iters + 1):
        with o.quiet():
            c = m.rint_(x / s)                                   # W_q = clip(rint(W / s) + z, qmin, qmax)
            if not sym:
                c += z
            c = m.clip_(c, qmin, qmax)
            if mask is not None:
                c *= mask  # padding: code 0 and target 0 below, so it adds nothing to the sums
            d = c - z if not sym else c * 1.0                    # D = W - W_r = W - s (W_q - z)
            d *= s
            d = m.rsub_(d, x)
            ad = o.abs(d)
            if mask is not None:
                ad *= mask
            if p != 1.0:  # |D|^(p-1), finite at D == 0 (|D| floored at the smallest normal number: the shrinkage
                w = m.pow(m.floor_tiny(ad), p - 1.0)  # and |D|^p are still 0 there, and equal elsewhere)
            if error_p == p and p != 1.0:
                err = total(ad * w) / n  # |D|^p from |D|^(p-1)
            else:
                err = total(ad if error_p == 1.0 else ad * ad if error_p == 2.0 else m.pow(ad, error_p)) / n
        if best_err is None:
            best_err = err
        else:
            better = err < best_err
            best_err = o.where(better, err, best_err)
            best_s = o.where(better, s, best_s)
            if not sym:
                best_z = o.where(better, z, best_z)
        if it == iters:
            break
        with o.quiet():
            # W_e = shrink_p(D, beta) = sign(D) relu(|D| - |D|^(p-1) / beta); the target T = W - W_e
            if p != 1.0:
                w /= beta
                e = m.rsub_(w, ad)
            else:
                e = ad - 1.0 / beta
            e = m.copysign_(m.relu_(e), d)
            t = m.rsub_(e, x)
            if mask is not None:
                t *= mask
            sc, st, scc, sct = total(c), total(t), total(c * c), total(c * t)
            if sym:                                              # min_s ||T - s W_q||^2
                num, den = sct, scc
                s_new = num / den
            else:                                                # min_{s, z} ||T - s (W_q - z)||^2, z integer
                var, cov = scc - sc * sc / n, sct - sc * st / n
                s_ls = o.where(o.logical_and(var > 0, cov > 0), cov / var, s)
                z_new = o.clip(o.rint(sc / n - st / n / s_ls), qmin, qmax)
                num = sct - z_new * st                           # <W_q - z, T>
                den = scc - 2.0 * z_new * sc + n * z_new * z_new  # <W_q - z, W_q - z>
                s_new = num / den
            ok = o.logical_and(o.logical_and(den > 0, num > 0), o.isfinite(s_new))
            if s_floor is not None:
                s_new = o.maximum(s_new, s_floor)
            s_new = rounded(o.where(ok, s_new, s))  # a degenerate group keeps its parameters
            if not sym:
                z = o.where(ok, z_new, z)
            s = s_new
        beta = beta * kappa
    s_out = o.reshape(m.cast(best_s, "float32"), blk.scale_shape)
    z_out = None if sym else o.reshape(m.cast(best_z, "float32"), blk.scale_shape)
    return s_out, z_out

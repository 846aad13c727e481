"""SVDQuant (Li et al., arXiv 2411.05007) as pure functions: smoothing, a high-precision low-rank branch, and the
quantized residual, for numpy arrays or torch tensors through one code path (torch is never imported here).

For a Linear ``y = x W^T`` (``W``: [out, in]) with per-input-channel activation statistics ``max|x_j|``:

1. smoothing (the paper's eq. 4, SmoothQuant's rule): ``s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha)``
   (``qcore.algorithms.smoothquant.smoothquant_scales``: clamped below at ``clamp_min``, 1 where a statistic is
   0); ``x_hat = x / s``, ``W_hat = W diag(s)``, so ``x W^T = x_hat W_hat^T``. The smoothing moves the
   activations' outliers into the weights;
2. the low-rank branch (eq. 5): the rank-``r`` truncated SVD of the smoothed weight, ``W_hat ~ L2 L1`` with
   ``L1 = diag(S_r) V_r^T`` ([r, in]) and ``L2 = U_r`` ([out, r]) (Quark's ``correction.l1`` / ``l2``), computed
   in float64 (eigenvectors of the smaller Gram matrix) and kept in high precision;
3. the residual ``R = W_hat - L2 L1`` (its outliers absorbed by the branch) is quantized to the layer's weight
   spec, by round-to-nearest or by GPTQ (``hessian=``: the Hessian of the *smoothed* inputs,
   ``diag(1/s) H diag(1/s)``).

The layer then computes ``y = Q(x_hat) Q(R)^T + x_hat L1^T L2^T (+ bias)``: the branch reads the unquantized
smoothed input. ``alpha`` is searched per group of Linears reading one input (``search_alpha``): the candidate
minimising the summed squared error of that output over a sample of inputs, with the residual quantized by
round-to-nearest and the input (when ``input_spec`` is given) fake-quantized as the layer will be (Quark 0.13
searches ``alpha`` the same way, without the activation quantization).

Functions: ``low_rank(weight, rank)``, ``svdquant(weight, scales, spec, rank=, hessian=, ...)`` (one Linear
from given smoothing scales), ``svdquant_error`` (the search objective) and ``search_alpha``.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

import qcore
from qcore.quantize import QTensor, QuantSpec

from . import _scaling as u
from .gptq import HessianStats, check_gptq_spec, gptq
from .smoothquant import smoothquant_scales, weight_absmax

__all__ = ["low_rank", "svdquant", "SVDQuantResult", "svdquant_error", "search_alpha", "AlphaSearch",
           "DEFAULT_ALPHAS"]

#: Quark 0.13's default candidates (``alpha_candidates=None``): 0.05, 0.10, ..., 0.95.
DEFAULT_ALPHAS = tuple(round(i / 20, 2) for i in range(1, 20))


def _check_rank(rank: Any) -> int:
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or int(rank) < 1:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    return int(rank)


def low_rank(weight: Any, rank: int) -> tuple:
    """``(L1, L2)``: the rank-``rank`` truncated SVD of ``weight`` ([out, in]) as ``L2 @ L1`` with ``L1 =
    diag(S_r) V_r^T`` ([r, in]) and ``L2 = U_r`` ([out, r]); float64 (from the eigenvectors of the smaller Gram
    matrix), float32 results of the input's kind
    and device. ``rank`` above ``min(out, in)`` is cut to it (the branch then holds the whole weight)."""
    r = _check_rank(rank)
    w, o = u.as_float_array(weight, "weight", ndim=2)
    u.check_finite(w, o, "weight")
    r = min(r, int(w.shape[0]), int(w.shape[1]))
    w64 = u.to64(w, o)
    # the top singular vectors from the eigenvectors of the smaller float64 Gram matrix (W^T W or W W^T): the same
    # rank-r product as the full SVD's to ~1e-13 relative on LLM weights, 2-4x faster than svd of [1536, 576]
    eigh = o.t.linalg.eigh if o.name == "torch" else np.linalg.eigh
    wt = u.transpose2(w64, o)
    if int(w64.shape[1]) <= int(w64.shape[0]):
        v = eigh(wt @ w64)[1][:, -r:]  # [in, r] (eigenvalues ascending: the last r are the largest)
        wv = w64 @ v  # = U_r diag(S_r)
        sv = (wv * wv).sum(0) ** 0.5
        sv = o.where(sv > 0, sv, 1.0 + 0 * sv)
        l2, l1 = wv / sv[None, :], sv[:, None] * u.transpose2(v, o)
    else:
        uu = eigh(w64 @ wt)[1][:, -r:]  # [out, r]
        l2, l1 = uu, u.transpose2(uu, o) @ w64
    return u.to32(l1, o), u.to32(l2, o)


def _sketch_low_rank(w, rank: int, o, *, oversample: int = 10, power: int = 2):
    """A randomized rank-``rank`` approximation ``(L1, L2)`` of ``w`` (Halko, Martinsson and Tropp 2011, alg. 4.4:
    a Gaussian sketch of ``rank + oversample`` columns from a fixed seed, ``power`` subspace iterations, float64):
    the alpha search's stand-in for ``low_rank``, whose full SVD dominated the search's cost. Its residual is at
    most slightly larger than the exact one (the search compares candidates with the same approximation)."""
    w64 = u.to64(w, o)
    m, n = int(w64.shape[0]), int(w64.shape[1])
    k = min(rank + oversample, m, n)
    if k >= min(m, n):
        return low_rank(w, rank)
    omega = np.random.default_rng(0).standard_normal((n, k))
    om = o.from_numpy(omega, w64) if o.name == "torch" else omega
    om = u.to64(om, o)
    qr = o.t.linalg.qr if o.name == "torch" else np.linalg.qr
    svd = o.t.linalg.svd if o.name == "torch" else np.linalg.svd
    wt = u.transpose2(w64, o)
    q = qr(w64 @ om)[0]
    for _ in range(power):
        q = qr(w64 @ qr(wt @ q)[0])[0]
    b = u.transpose2(q, o) @ w64  # [k, n]
    ub, sb, vh = svd(b, full_matrices=False)
    r = min(rank, k)
    return u.to32(sb[:r, None] * vh[:r], o), u.to32(q @ ub[:, :r], o)


class SVDQuantResult(NamedTuple):
    """One Linear's SVDQuant: ``l1`` [r, in] and ``l2`` [out, r] (float32, the branch ``x_hat L1^T L2^T``),
    ``residual`` (the QTensor of ``W diag(s) - L2 L1``, what the layer's quantized matmul computes with) and
    its dequantized values ``residual_weight`` (float32)."""

    l1: Any
    l2: Any
    residual: QTensor
    residual_weight: Any


def _smoothed(weight, scales, name="weight"):
    w, o = u.as_float_array(weight, name, ndim=2)
    u.check_finite(w, o, name)
    s, _ = u.as_float_array(scales, "scales", ndim=1)
    u.same_kind(w, s, name, "scales")
    if int(s.shape[0]) != int(w.shape[1]):
        raise ValueError(f"scales has {int(s.shape[0])} channels but {name} has {int(w.shape[1])} inputs")
    if not bool(o.isfinite(s).all()) or bool((s <= 0).any()):
        raise ValueError("scales must be positive and finite")
    return u.to32(u.to64(w, o) * u.to64(s, o)[None, :], o), o


def svdquant(weight: Any, scales: Any, spec: QuantSpec, *, rank: int = 32, hessian: Any = None,
             block_size: int = 128, damp: float = 0.01, act_order: bool = False, scale_fn=None,
             _sketch: bool = False) -> SVDQuantResult:
    """SVDQuant of one Linear ``weight`` ([out, in]) given its smoothing ``scales`` ([in], positive; ones for no
    smoothing): the low-rank branch of ``W_hat = W diag(scales)`` and its residual quantized to ``spec`` by
    round-to-nearest, or by GPTQ when ``hessian`` (``HessianStats`` or [in, in] of the *unsmoothed* inputs) is
    given: it is turned into the smoothed inputs' ``diag(1/s) H diag(1/s)`` here (``block_size``, ``damp``,
    ``act_order``: ``qcore.algorithms.gptq.gptq``'s). ``scale_fn(part) -> dict``: the scale rule (``quantize``
    keyword arguments) of the residual or, under GPTQ, of its column groups; None: the spec's own."""
    spec = u.as_spec(spec, "spec")
    r = _check_rank(rank)
    w_hat, o = _smoothed(weight, scales)
    if hessian is not None:
        check_gptq_spec(spec, tuple(w_hat.shape))
    l1, l2 = _sketch_low_rank(w_hat, r, o) if _sketch else low_rank(w_hat, r)
    res = u.to32(u.to64(w_hat, o) - u.matmul(u.to64(l2, o), u.to64(l1, o)), o)
    if hessian is None:
        q = qcore.quantize(res, spec, **(scale_fn(res) if scale_fn is not None else {}))
        return SVDQuantResult(l1, l2, q, qcore.dequantize(q))
    inv = 1.0 / u.to64(scales, o)
    if isinstance(hessian, HessianStats):
        h = HessianStats(hessian.sum * inv[:, None] * inv[None, :], hessian.count)
    else:
        h = u.to64(hessian, o) * inv[:, None] * inv[None, :]
    g = gptq(res, h, spec, block_size=block_size, damp=damp, act_order=act_order, scale_fn=scale_fn)
    return SVDQuantResult(l1, l2, g.qtensor, g.weight)


def svdquant_error(x: Any, weights: Any, specs: Any, scales: Any, *, rank: int = 32,
                   input_spec: Optional[QuantSpec] = None, exact: bool = True) -> float:
    """The search objective: ``sum_i || x W_i^T - (Q_a(x / s) Q(R_i)^T + (x / s) L1_i^T L2_i^T) ||^2`` over the
    Linears ``weights`` (each [out_i, in], all reading ``x`` [tokens, in]) with specs ``specs`` (one or one per
    weight), the residuals rounded to nearest, ``Q_a`` the fake quantization by ``input_spec`` (None: the input
    is not quantized). float64 sums of float32 products. ``exact=False``: the branch from a randomized rank-``rank``
    SVD (``search_alpha``'s setting: about ten times faster than the full SVD on LLM-sized weights)."""
    xa, o = u.as_float_array(x, "x", ndim=2)
    ws = u.weight_list(weights, xa)
    sp = u.spec_list(specs, len(ws), "specs")
    s, _ = u.as_float_array(scales, "scales", ndim=1)
    u.same_kind(xa, s, "x", "scales")
    x32 = u.to32(xa, o)
    xh = u.to32(u.to64(x32, o) / u.to64(s, o)[None, :], o)
    xq = xh if input_spec is None else qcore.fake_quantize(xh, u.as_spec(input_spec, "input_spec"))
    total = 0.0
    for w, spec in zip(ws, sp):
        r = svdquant(w, s, spec, rank=rank, _sketch=not exact)
        # x W^T = x_hat (R + L2 L1)^T, so the error is x_hat R^T - Q_a(x_hat) Q(R)^T (two matmuls, not five)
        resid = u.to32(u.to64(w, o) * u.to64(s, o)[None, :] - u.to64(r.l2, o) @ u.to64(r.l1, o), o)
        d = u.to64(u.matmul(xh, u.transpose2(resid, o)) - u.matmul(xq, u.transpose2(r.residual_weight, o)), o)
        total += float((d * d).sum())
    return total


class AlphaSearch(NamedTuple):
    """``alpha``: the chosen migration strength; ``scales``: its smoothing scales (float32 [in]); ``losses``:
    ``{alpha: objective}`` of every candidate."""

    alpha: float
    scales: Any
    losses: dict


def search_alpha(x: Any, weights: Any, specs: Any, act_absmax: Any, *, rank: int = 32,
                 alphas: Sequence[float] = DEFAULT_ALPHAS, input_spec: Optional[QuantSpec] = None,
                 clamp_min: float = 1e-5, exact: bool = True) -> AlphaSearch:
    """The ``alpha`` among ``alphas`` whose smoothing scales (``smoothquant_scales(act_absmax, max|W|, alpha)``,
    ``max|W|`` over every weight of the group) minimise ``svdquant_error`` on the sample ``x``; ties go to the
    first candidate. ``exact``: as ``svdquant_error``'s (False: randomized SVDs, the layer binding's choice).
    All checks before any SVD."""
    xa, o = u.as_float_array(x, "x", ndim=2)
    ws = u.weight_list(weights, xa)
    u.spec_list(specs, len(ws), "specs")
    _check_rank(rank)
    cands = tuple(alphas)
    if not cands:
        raise ValueError("alphas must hold at least one candidate in [0, 1], got none")
    for a in cands:
        if isinstance(a, bool) or not isinstance(a, numbers.Real) or not 0.0 <= float(a) <= 1.0:
            raise ValueError(f"alphas must be numbers in [0, 1], got {a!r}")
    wmax = weight_absmax(ws)
    best = None
    losses = {}
    for a in cands:
        s = smoothquant_scales(act_absmax, wmax, alpha=float(a), clamp_min=clamp_min)
        loss = svdquant_error(xa, ws, specs, s, rank=rank, input_spec=input_spec, exact=exact)
        losses[float(a)] = loss
        if best is None or loss < best[1]:
            best = (float(a), loss, s)
    return AlphaSearch(best[0], best[2], losses)

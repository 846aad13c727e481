"""SmoothQuant (Xiao et al., arXiv 2211.10438) and AutoSmoothQuant as pure math over statistics and samples.

SmoothQuant moves quantization difficulty from activations to weights with a per-input-channel scale ``s``:
``y = x W^T = (x / s) (W * s)^T``. The division is folded into the op that produces ``x`` (a norm, or the
previous Linear's output rows) and the multiplication into every Linear that reads ``x``
(``qcore.adapters.passes.scaling.fold_scales``), so the float model is unchanged and only the quantization sees the
smoother ``x / s``.

Functions (numpy arrays and torch tensors, CPU or GPU, through the same code; torch is never imported here):

- ``smoothquant_scales(act_absmax, weight_absmax, alpha=, clamp_min=)``: the paper's rule, per channel ``j``:
  ``s_j = max(act_j**alpha / w_j**(1 - alpha), clamp_min)``, where ``act_j`` is max |x[:, j]| over the
  calibration tokens and ``w_j`` is max |W[:, j]| over the rows of *all* Linears reading ``x``. Computed in
  float64, returned as float32. A channel whose ``act_j`` or ``w_j`` is 0 gets ``s_j = 1`` (nothing to balance).
- ``weight_absmax(weights)``: that ``w`` statistic (float32, exact).
- ``auto_smoothquant(x, weights, weight_spec=, input_spec=)``: tries each alpha of a grid and keeps the one
  whose fake-quantized matmuls are closest to the float ones on the sample ``x`` (below).

AutoSmoothQuant's loss, for candidate scales ``s`` (float32)::

    loss(s) = sum_i  mean_{tokens, outputs} | x W_i^T - Q_in(x / s) Q_w(W_i * s)^T | ** p

with ``p = 2`` (``SmoothLoss.MSE``) or ``p = 1`` (``SmoothLoss.MAE``); ``Q_w = qcore.fake_quantize(., weight_spec)``
on the [out, in] weight, ``Q_in = qcore.fake_quantize(., input_spec)`` applied to the whole [tokens, in] sample
at once (dynamic scales: for a per-tensor input spec this is the scale a static calibration over the same sample
gives; per-token specs are unaffected). ``x / s`` and ``W_i * s`` are float32 operations; the matmuls and the
sums run in float64, over chunks of tokens (bounded memory). The first candidate with the smallest loss wins
(ties keep the earlier one); candidates are evaluated in this order: the identity ``s = 1`` (``alpha=None`` in
the result, see below), then the alphas in the given order.

Candidate rules (``SmoothRule``):

- ``SMOOTHQUANT`` (default): ``s = smoothquant_scales(act_absmax, weight_absmax(weights), alpha=alpha)``,
  default grid alpha = 0.05, 0.10, ..., 0.95 (19 values; 0.5 is the paper's default). So AutoSmoothQuant
  searches exactly the family plain SmoothQuant draws from.
- ``ACT_POWER``: Quark 0.13's AutoSmoothQuant rule: ``s = max(act_absmax**alpha, 1e-4)``, then divided by
  ``sqrt(max(s) * min(s))`` (AWQ's normalisation), default grid alpha = 0.0, 0.1, ..., 0.9 (Quark's ``i / 10``).

Differences from AMD Quark 0.13 (``quark/torch/algorithm/awq/{smooth,auto_smooth}.py``), on purpose:

- ``smoothquant_scales``: Quark clamps the weight statistic at 1e-5 and the scale at ``scale_clamp_min``
  (config default 1e-3, alpha default 1); a zero activation channel gets ``scale_clamp_min`` and a zero weight
  column a huge scale. Here zero statistics give ``s = 1`` and the defaults are the paper's (alpha 0.5,
  clamp_min 1e-5); pass Quark's values explicitly to reproduce a Quark recipe. Quark computes in the weight's
  dtype (bf16/fp16); here float64, rounded once to float32.
- AutoSmoothQuant: Quark searches only the ``ACT_POWER`` rule (the activation statistic alone, like AWQ; the
  weights play no part in the candidates) and measures the error at the output of ``module2inspect`` (e.g.
  the whole attention block), quantizing the input with the *last* Linear's input quantizer. Here the error is
  summed over the Linears' own outputs (a pure function has no module to run), the default rule is
  ``SMOOTHQUANT``, and ``input_spec`` is given explicitly. Quark's grid includes ratio 0, which is the identity
  (no smoothing); both rules here include that comparison too: ``include_identity=True`` (default) evaluates
  ``s = 1`` first and reports it as ``alpha=None`` (under ``ACT_POWER`` with 0 in the grid, alpha 0 *is* the
  identity and no extra candidate is added). So the result is never worse on the sample than not smoothing.
  Quark's ``"RMSE"`` loss (its code takes the mean of ``|d| ** 0.5``) is not offered.

Two passes (issue 23): the float64 matmuls and conversions were most of the search's time, so every candidate is
first *screened* with float32 matmuls and differences (the operands ``Q_in(x / s)`` and ``Q_w(W_i * s)`` are
float32 values already; only the accumulation is rounded), then the *finalists*, the candidates whose screened
loss is within ``SCREEN_RTOL`` (1e-4 relative, ``qcore.algorithms._scaling``) of the smallest, are evaluated
with the float64 computation above, in order, and the first smallest wins. Screened losses differ from the
float64 ones by about 1e-7 relative (1e-4 is a margin of about a thousand), so the result (alpha, scales, loss)
is the one-pass float64 search's, bit for bit (kept as ``_reference_auto_smoothquant``; tests compare them).
``SmoothResult.losses`` holds the finalists' float64 losses and the other candidates' screened ones (within
~1e-6 relative of their float64 values). When the float64 reference outputs do not fit in memory (``t * out``
above four chunk budgets) the search runs the one float64 pass, as before.

numpy and torch: the same float64 operations in the same order, except that the backends' float64 matmuls and
``pow`` may round differently in the last place; losses agree to ~1e-13 relative, and the chosen alpha and the
float32 scales are identical unless two candidates' losses tie within that (tested: same alpha, same scale bits).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from qcore._backend import ops
from qcore._typing import Array, ArrayLike, KeyLike, SpecLike
from qcore.quantize import fake_quantize
from qcore.rounding import RoundingMode, check_mode

from . import _scaling as u

__all__ = ["SmoothLoss", "SmoothRule", "SmoothResult", "smoothquant_scales", "weight_absmax", "auto_smoothquant"]


class SmoothLoss(enum.Enum):
    """AutoSmoothQuant's error measure: mean squared (``MSE``, Quark's default "MSE") or mean absolute (``MAE``,
    Quark's "MAE") difference of the outputs. ``SmoothLoss(name.lower())`` reads Quark's ``compute_scale_loss``."""

    MSE = "mse"
    MAE = "mae"


class SmoothRule(enum.Enum):
    """How AutoSmoothQuant turns an alpha into scales (module docstring): ``SMOOTHQUANT`` (the paper's
    ``act**alpha / w**(1 - alpha)``) or ``ACT_POWER`` (Quark 0.13's ``act**alpha`` normalised)."""

    SMOOTHQUANT = "smoothquant"
    ACT_POWER = "act_power"


_DEFAULT_ALPHAS = {
    SmoothRule.SMOOTHQUANT: tuple(i / 20 for i in range(1, 20)),
    SmoothRule.ACT_POWER: tuple(i / 10 for i in range(10)),
}


@dataclass(frozen=True)
class SmoothResult:
    """AutoSmoothQuant's choice: ``alpha`` (None when the identity ``s = 1`` won), ``scales`` (float32 [in], the
    array kind and device of ``x``), ``loss`` (its loss), ``losses`` ((alpha, loss) for every candidate, in the
    order evaluated)."""

    alpha: Optional[float]
    scales: Any
    loss: float
    losses: tuple = ()


# ---------------------------------------------------------------------------------------------------------------
# SmoothQuant's rule
# ---------------------------------------------------------------------------------------------------------------


def _stat(v: Any, name: str):
    a, o = u.as_float_array(v, name, ndim=1)
    u.check_finite(a, o, name)
    if bool((a < 0).any()):
        raise ValueError(f"{name} must be non-negative (a max |.| statistic), got a negative value")
    return a, o


def _check_alpha(alpha: Any, name: str = "alpha") -> float:
    a = u.check_real(alpha, name)
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {a}")
    return a


def _check_clamp_min(clamp_min: Any) -> float:
    c = u.check_real(clamp_min, "clamp_min")
    if not c > 0:
        raise ValueError(f"clamp_min must be > 0, got {c}")
    return c


def _finish_scales(s64: Any, o: Any, what: str):
    with o.quiet():
        s32 = u.to32(s64, o)
    bad = o.logical_not(o.logical_and(o.isfinite(s32), s32 > 0))
    if o.any(bad):
        j = int(np.flatnonzero(np.asarray(bad.cpu() if o.name == "torch" else bad))[0])
        raise ValueError(f"{what}: the scale of channel {j} is {float(s64[j])!r}, which is not a positive finite "
                         "float32 number; check the statistics (or raise clamp_min)")
    return s32


def _sq_scales(act, w, alpha: float, clamp_min: float, o):
    """The rule on validated arrays (float64 inside, float32 out)."""
    a64, w64 = u.to64(act, o), u.to64(w, o)
    with o.quiet():
        s = (a64 ** alpha) / (w64 ** (1.0 - alpha))
    s = o.maximum(s, clamp_min)
    s = o.where(o.logical_or(a64 == 0, w64 == 0), 1.0, s)
    return _finish_scales(s, o, "smoothquant_scales")


def smoothquant_scales(act_absmax: ArrayLike, weight_absmax: ArrayLike, *, alpha: float = 0.5,
                       clamp_min: float = 1e-5) -> Array:
    """Per-input-channel SmoothQuant scales ``s = max(act**alpha / w**(1 - alpha), clamp_min)`` (float32 [in]).

    ``act_absmax``: [in] max |x[:, j]| over the calibration tokens; ``weight_absmax``: [in] max |W[:, j]| over
    the rows of all Linears that read ``x`` (``weight_absmax(weights)``). Both non-negative and finite, the same
    array kind (and device). ``alpha`` in [0, 1] (1 moves all difficulty to the weights); ``clamp_min > 0``.
    Channels where either statistic is 0 get ``s = 1``. Computed in float64, rounded once to float32; a scale
    that is not a positive finite float32 raises ValueError. Fold with ``qcore.adapters.passes.scaling.fold_scales``.
    """
    a, o = _stat(act_absmax, "act_absmax")
    w, _ = _stat(weight_absmax, "weight_absmax")
    u.same_kind(a, w, "act_absmax", "weight_absmax")
    if int(a.shape[0]) != int(w.shape[0]):
        raise ValueError(f"act_absmax has {int(a.shape[0])} channels but weight_absmax has {int(w.shape[0])}")
    alpha = _check_alpha(alpha)
    clamp_min = _check_clamp_min(clamp_min)
    return _sq_scales(a, w, alpha, clamp_min, o)


def weight_absmax(weights: Any) -> Array:
    """max |W[:, j]| over the rows of every weight in ``weights`` (one [out, in] array or a list of them sharing
    ``in``): float32 [in], the arrays' kind and device. Exact (a max of float32 values)."""
    ws = u.weight_list(weights)
    o = ops(ws[0])
    m = None
    for w in ws:
        c = o.amax(o.abs(u.to32(w, o)), 0, keepdims=False)
        m = c if m is None else o.maximum(m, c)
    return m


# ---------------------------------------------------------------------------------------------------------------
# AutoSmoothQuant
# ---------------------------------------------------------------------------------------------------------------


def _act_power_scales(act, alpha: float, o):
    """Quark's AutoSmoothQuant / AWQ candidate: max(act**alpha, 1e-4) / sqrt(max * min), float64 -> float32."""
    return _finish_scales(act_power(u.to64(act, o), alpha, o), o, "auto_smoothquant")


def act_power(stat64: Any, ratio: float, o: Any):
    """``max(stat**ratio, 1e-4) / sqrt(max(.) * min(.))`` in float64 (AWQ's and Quark's AutoSmoothQuant's
    candidate scales; ``ratio = 0`` gives exactly 1)."""
    s = o.maximum(stat64 ** ratio, 1e-4)
    return s / u.sqrt(o.amax(s, 0, keepdims=False) * o.amin(s, 0, keepdims=False), o)


def _check_alphas(alphas: Any, rule: SmoothRule) -> tuple:
    if alphas is None:
        return _DEFAULT_ALPHAS[rule]
    if isinstance(alphas, (str, bytes)) or not isinstance(alphas, Sequence):
        raise TypeError(f"alphas must be a sequence of numbers in [0, 1], got {alphas!r}")
    out = tuple(_check_alpha(a, f"alphas[{i}]") for i, a in enumerate(alphas))
    if not out:
        raise ValueError("alphas must hold at least one value")
    if len(set(out)) != len(out):
        raise ValueError(f"alphas must be distinct, got {alphas!r}")
    return out


def _check_enum(v: Any, cls: type, name: str):
    if isinstance(v, cls):
        return v
    hint = f" (e.g. {cls.__name__}({str(v).lower()!r}))" if isinstance(v, str) else ""
    raise TypeError(f"{name} must be a {cls.__name__} member ({', '.join(m.name for m in cls)}), got {v!r}{hint}")


def _loss_of(xc, wq_t, ref, p: float, o):
    """sum |ref - xc @ wq_t| ** p over a chunk, float64 -> Python float."""
    d = ref - u.matmul(xc, wq_t)
    e = d * d if p == 2.0 else o.abs(d)
    return float(o.sum(e, (0, 1), keepdims=False))


def _search_setup(x, weights, *, weight_spec, input_spec, alphas, loss, rule, clamp_min, act_absmax,
                  include_identity, max_tokens, key):
    """``auto_smoothquant``'s argument checks (before any work) and what every candidate's loss reads: the
    candidates in evaluation order, the float32 / float64 weights, the token chunks and the float reference
    outputs (shared by the search and ``_reference_auto_smoothquant``)."""
    xa, o = u.as_float_array(x, "x", ndim=2)
    ws = u.weight_list(weights, xa)
    wspecs = u.spec_list(weight_spec, len(ws), "weight_spec")
    ispec = u.as_spec(input_spec, "input_spec")
    loss = _check_enum(loss, SmoothLoss, "loss")
    rule = _check_enum(rule, SmoothRule, "rule")
    alphas = _check_alphas(alphas, rule)
    clamp_min = _check_clamp_min(clamp_min)
    if not isinstance(include_identity, bool):
        raise TypeError(f"include_identity must be a bool, got {include_identity!r}")
    if max_tokens is not None:
        max_tokens = u.check_int(max_tokens, "max_tokens", minimum=1)
    stochastic = any(s.rounding is RoundingMode.STOCHASTIC for s in wspecs + [ispec])
    key = check_mode(RoundingMode.STOCHASTIC, key) if stochastic else None
    n_in = int(xa.shape[1])
    if act_absmax is None:
        u.check_finite(xa, o, "x")
        act = o.amax(o.abs(u.to32(xa, o)), 0, keepdims=False)
    else:
        act, _ = _stat(act_absmax, "act_absmax")
        u.same_kind(xa, act, "x", "act_absmax")
        if int(act.shape[0]) != n_in:
            raise ValueError(f"act_absmax has {int(act.shape[0])} channels but x has {n_in}")
        u.check_finite(xa, o, "x")

    t = int(xa.shape[0])
    if max_tokens is not None and t > max_tokens:
        xa = xa[::-(-t // max_tokens)]
        t = int(xa.shape[0])
    x32 = u.to32(xa, o)

    # Candidates, in evaluation order.
    cands: list = []
    if include_identity and not (rule is SmoothRule.ACT_POWER and 0.0 in alphas):
        cands.append((None, o.full((n_in,), 1.0, o.float32, x32)))
    wmax = weight_absmax(ws) if rule is SmoothRule.SMOOTHQUANT else None
    for a in alphas:
        s = _sq_scales(act, wmax, a, clamp_min, o) if rule is SmoothRule.SMOOTHQUANT else _act_power_scales(act, a, o)
        cands.append((a, s))

    p = 2.0 if loss is SmoothLoss.MSE else 1.0
    w32 = [u.to32(w, o) for w in ws]
    w64_t = [u.transpose2(u.to64(w, o), o) for w in w32]
    out_total = sum(int(w.shape[0]) for w in ws)
    step = u.rows_per_chunk(n_in + out_total)
    spans = list(u.chunks(t, step))
    # The float reference outputs are kept when they fit in 4 budgets, else recomputed per candidate.
    keep_ref = t * out_total * 8 <= 4 * u.CHUNK_BYTES
    ref_cache = [[u.matmul(u.to64(x32[a:b], o), wt) for wt in w64_t] for a, b in spans] if keep_ref else None
    return o, ws, wspecs, ispec, key, n_in, t, x32, cands, p, w32, w64_t, spans, keep_ref, ref_cache


def auto_smoothquant(x: ArrayLike, weights: Any, *, weight_spec: Any, input_spec: SpecLike,
                     alphas: Optional[Sequence[float]] = None, loss: SmoothLoss = SmoothLoss.MSE,
                     rule: SmoothRule = SmoothRule.SMOOTHQUANT, clamp_min: float = 1e-5,
                     act_absmax: Optional[ArrayLike] = None, include_identity: bool = True,
                     max_tokens: Optional[int] = None, key: KeyLike = None) -> SmoothResult:
    """Pick the SmoothQuant alpha that minimises the fake-quantized output error on the sample ``x``.

    ``x``: [tokens, in] inputs of the Linears in ``weights`` (one [out, in] array or a list of them sharing the
    input, e.g. q/k/v), the same array kind and device. ``weight_spec``: a qcore spec for the [out, in] weights
    (one, or one per weight); ``input_spec``: the spec of the activation (applied dynamically to the whole
    sample). ``alphas``: the grid (default per ``rule``, module docstring); ``loss``: ``SmoothLoss.MSE`` or
    ``SmoothLoss.MAE``; ``clamp_min``: as ``smoothquant_scales`` (SMOOTHQUANT rule). ``act_absmax``: [in] max |x|
    per channel over *all* calibration tokens (default: computed from ``x``). ``include_identity``: also try
    ``s = 1`` first (reported as ``alpha=None``). ``max_tokens``: evaluate the loss on every k-th token only,
    ``k = ceil(tokens / max_tokens)`` (the statistics still use every token of ``x``). ``key``: for
    stochastic-rounding specs (one key for every candidate).

    Returns ``SmoothResult(alpha, scales, loss, losses)``; fold ``scales`` with
    ``qcore.adapters.passes.scaling.fold_scales``. Deterministic. Work: per candidate one fake-quantization of ``x / s``
    and of each weight and float64 matmuls over token chunks.
    """
    (o, ws, wspecs, ispec, key, n_in, t, x32, cands, p, w32, w64_t, spans, keep_ref, ref_cache) = _search_setup(
        x, weights, weight_spec=weight_spec, input_spec=input_spec, alphas=alphas, loss=loss, rule=rule,
        clamp_min=clamp_min, act_absmax=act_absmax, include_identity=include_identity, max_tokens=max_tokens,
        key=key)

    def quantized(s):
        with o.quiet():
            xq = fake_quantize(x32 / s, ispec, key=key)
        return xq, [fake_quantize(w * s, sp, key=key) for w, sp in zip(w32, wspecs)]  # as the reference: not quiet

    def loss64(s, xq, wqs):  # the reference search's float64 loss of one candidate, operation for operation
        wq_t = [u.transpose2(u.to64(wq, o), o) for wq in wqs]
        sums = [0.0] * len(ws)
        for c, (a, b) in enumerate(spans):
            xc = u.to64(xq[a:b], o)
            refs = ref_cache[c] if keep_ref else [u.matmul(u.to64(x32[a:b], o), wt) for wt in w64_t]
            for i in range(len(ws)):
                sums[i] += _loss_of(xc, wq_t[i], refs[i], p, o)
        return sum(sm / (t * int(w.shape[0])) for sm, w in zip(sums, ws))

    def pick(order, loss_of):
        best, losses = None, {}
        for k in order:
            alpha, s = cands[k]
            total = loss_of(k)
            losses[k] = total
            if best is None or total < best[2] or (math.isnan(best[2]) and not math.isnan(total)):
                best = (alpha, s, total)
        return best, losses

    if keep_ref:
        # Pass 1 (screening): every candidate's loss with float32 matmuls and differences (the float64 conversions
        # and matmuls are most of the reference's time); the quantized operands of the candidates near the
        # running minimum are kept for pass 2.
        ref32 = [[u.to32(r, o) for r in rc] for rc in ref_cache]
        screened, kept = [], {}
        for k, (alpha, s) in enumerate(cands):
            xq, wqs = quantized(s)
            wq32_t = [u.transpose2(wq, o) for wq in wqs]
            sums = [0.0] * len(ws)
            for c, (a, b) in enumerate(spans):
                for i in range(len(ws)):
                    d = ref32[c][i] - u.matmul(xq[a:b], wq32_t[i])
                    sums[i] += float(o.sum(d * d if p == 2.0 else o.abs(d), (0, 1), keepdims=False))
            screened.append(sum(sm / (t * int(w.shape[0])) for sm, w in zip(sums, ws)))
            lo = min(screened)
            kept = {j: v for j, v in kept.items() if screened[j] <= lo + u.SCREEN_RTOL * abs(lo)}
            if screened[k] <= lo + u.SCREEN_RTOL * abs(lo):
                kept[k] = (xq, wqs)
        # Pass 2: the finalists (within u.SCREEN_RTOL of the smallest screened loss) in float64, in order.
        fin = u.finalists(screened)
        best, exact = pick(fin, lambda k: loss64(cands[k][1], *(kept.get(k) or quantized(cands[k][1]))))
        losses = [(a, exact.get(k, screened[k])) for k, (a, _) in enumerate(cands)]
    else:  # the reference outputs do not fit: one float64 pass (recomputing them per chunk)
        best, exact = pick(range(len(cands)), lambda k: loss64(cands[k][1], *quantized(cands[k][1])))
        losses = [(a, exact[k]) for k, (a, _) in enumerate(cands)]
    if math.isnan(best[2]):
        raise ValueError("auto_smoothquant: every candidate's loss is NaN (a quantized output overflowed?); check "
                         "weight_spec and input_spec")
    return SmoothResult(best[0], best[1], best[2], tuple(losses))


def _reference_auto_smoothquant(x: ArrayLike, weights: Any, *, weight_spec: Any, input_spec: SpecLike,
                     alphas: Optional[Sequence[float]] = None, loss: SmoothLoss = SmoothLoss.MSE,
                     rule: SmoothRule = SmoothRule.SMOOTHQUANT, clamp_min: float = 1e-5,
                     act_absmax: Optional[ArrayLike] = None, include_identity: bool = True,
                     max_tokens: Optional[int] = None, key: KeyLike = None) -> SmoothResult:
    """The one-pass float64 search ``auto_smoothquant`` replaced, kept for the tests proving that the two-pass
    search picks the same candidate: the same arguments, checks and result (``auto_smoothquant``'s docstring)."""
    (o, ws, wspecs, ispec, key, n_in, t, x32, cands, p, w32, w64_t, spans, keep_ref, ref_cache) = _search_setup(
        x, weights, weight_spec=weight_spec, input_spec=input_spec, alphas=alphas, loss=loss, rule=rule,
        clamp_min=clamp_min, act_absmax=act_absmax, include_identity=include_identity, max_tokens=max_tokens,
        key=key)

    best = None
    losses = []
    for alpha, s in cands:
        with o.quiet():
            xq = fake_quantize(x32 / s, ispec, key=key)
        wq_t = [u.transpose2(u.to64(fake_quantize(w * s, sp, key=key), o), o) for w, sp in zip(w32, wspecs)]
        sums = [0.0] * len(ws)
        for c, (a, b) in enumerate(spans):
            xc = u.to64(xq[a:b], o)
            refs = ref_cache[c] if keep_ref else [u.matmul(u.to64(x32[a:b], o), wt) for wt in w64_t]
            for i in range(len(ws)):
                sums[i] += _loss_of(xc, wq_t[i], refs[i], p, o)
        total = sum(sm / (t * int(w.shape[0])) for sm, w in zip(sums, ws))
        losses.append((alpha, total))
        if best is None or total < best[2] or (math.isnan(best[2]) and not math.isnan(total)):
            best = (alpha, s, total)
    if math.isnan(best[2]):
        raise ValueError("auto_smoothquant: every candidate's loss is NaN (a quantized output overflowed?); check "
                         "weight_spec and input_spec")
    return SmoothResult(best[0], best[1], best[2], tuple(losses))

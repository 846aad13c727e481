"""AutoRound / SignRound (Cheng et al., arXiv 2309.05516; intel/auto-round): learnt rounding and clipping.

For a block (a decoder layer) with weights ``W`` quantized by integer specs, SignRound learns per weight a rounding
offset ``V`` in [-0.5, 0.5] and per scale block two range factors ``min_scale``, ``max_scale`` in [0, 1]:

- asymmetric: ``lo = min(min(W_g), 0) * min_scale``, ``hi = max(max(W_g), 0) * max_scale``,
  ``s = (hi - lo) / (qmax - qmin)`` (rounded to the spec's scale dtype), ``z = clip(qmin - round(lo / s))``,
  ``q = clip(round(W / s + V) + z, qmin, qmax)``, ``W~ = s (q - z)``;
- symmetric: ``a = max(-min(W_g, 0) * min_scale, max(W_g, 0) * max_scale)``, ``s = a / d`` (``d`` qcore's
  divisor: ``(qmax - qmin) / 2``, or ``qmax`` for narrow or unsigned ranges), ``q = clip(round(W / s + V))``,
  ``W~ = s q``.

At ``V = 0``, ``min_scale = max_scale = 1`` this is qcore's round-to-nearest of the spec (same scales, zero
points and codes). The rounding is straight-through (``round`` has the identity as gradient), so the block's
output error is differentiable in ``V`` and the range factors. ``signround`` minimises the mean squared error
between the block's output with the fake-quantized weights and ``targets`` (the float block's outputs) over
minibatches of the calibration batches, by signed gradient descent ``p -= lr_t * sign(grad)`` with
``lr_t = lr * (1 - t / iters)`` (auto-round's ``LinearLR`` to 0; default ``lr = 1 / iters``), ``V`` clamped to
[-0.5, 0.5] and the range factors to [0, 1] after each step, and keeps the parameters of the iteration whose
minibatch loss was lowest (auto-round's best-iterate rule: with one minibatch of every batch, the result's
block loss is never above round-to-nearest's, the iterate 0). The final weights are quantized with the learnt
scales, zero points and offsets into QTensors (``qcore.quantize`` with those scales gives the same codes).

torch only (an autograd algorithm: it is handed torch tensors); ``import qcore`` does not import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import qcore
from qcore.dtypes import IntDType

__all__ = ["check_autoround_spec", "init_params", "scale_zero_point", "fake_quantize_rounded",
           "quantize_rounded", "learning_rate", "signround_step", "signround", "SignRoundResult"]


def _torch():
    import torch
    return torch


def check_autoround_spec(spec, shape: tuple) -> None:
    """ValueError unless SignRound can learn ``spec`` (a ``qcore.QuantSpec``) on a weight of ``shape`` ([out, in]):
    integer elements, ordinary float scales (no power-of-two / two-level scales), round-to-nearest-even, scales per
    tensor, per output channel or per group of input columns (whole groups)."""
    if not isinstance(spec, qcore.QuantSpec):
        raise TypeError(f"spec must be a qcore.QuantSpec, got {type(spec).__name__}")
    name = spec.name or spec.dtype.name
    if not isinstance(spec.dtype, IntDType):
        raise ValueError(f"autoround learns integer rounding; spec {name!r} has {spec.dtype.name} elements "
                         f"(float / MX formats are not supported)")
    if spec.pow2_scale or spec.two_level:
        raise ValueError(f"autoround: spec {name!r} has power-of-two or two-level scales; it learns ordinary float "
                         f"scales only")
    if spec.rounding != qcore.RoundingMode.NEAREST_EVEN:
        raise ValueError(f"autoround: spec {name!r} rounds {spec.rounding.value}; it learns the rounding of "
                         f"round-to-nearest-even specs only")
    if len(shape) != 2:
        raise ValueError(f"autoround quantizes 2-D [out, in] weights, got shape {tuple(shape)}")
    g = spec.granularity
    if isinstance(g, qcore.PerGroup):
        if g.axis not in (1, -1):
            raise ValueError(f"autoround: spec {name!r} groups along axis {g.axis}; groups of input columns "
                             f"(axis 1 of [out, in]) only")
        if shape[1] % g.size:
            raise ValueError(f"autoround: the weight's {shape[1]} input columns are not whole groups of {g.size}")
    elif isinstance(g, qcore.PerChannel):
        if g.axis not in (0, -2):
            raise ValueError(f"autoround: spec {name!r} has a scale per index of axis {g.axis}; per output channel "
                             f"(axis 0) only")
    elif not isinstance(g, qcore.PerTensor):
        raise ValueError(f"autoround: spec {name!r} has {type(g).__name__} scales; per tensor, per channel or per "
                         f"group only")


def _grouped(w, spec):
    """``w`` [out, in] as [out or 1, groups, group size] with the scale shape's first two axes."""
    g = spec.granularity
    out, n = w.shape
    if isinstance(g, qcore.PerGroup):
        return w.reshape(out, n // g.size, g.size)
    if isinstance(g, qcore.PerChannel):
        return w.reshape(out, 1, n)
    return w.reshape(1, 1, out * n)


def _int_range(spec) -> tuple:
    d = spec.dtype
    qmin = -d.max if (spec.narrow_range and d.signed) else d.min
    return float(qmin), float(d.max)


def _round_ste(x):
    return x + (x.detach().round() - x.detach())


def _scale_ste(s, spec):
    """``s`` rounded to the spec's scale dtype (RNE, saturating; an underflow of a positive scale to 0 gives the
    smallest subnormal, qcore's rule), with the identity as gradient."""
    torch = _torch()
    if spec.scale_dtype.name == "float32" and s.dtype == torch.float32:
        return s
    d = s.detach()
    r = qcore.cast(d.float(), spec.scale_dtype, saturate=True).to(d.dtype)
    if spec.scale_dtype.name != "float32":
        r = torch.where((r == 0) & (d > 0), torch.full_like(r, spec.scale_dtype.min_subnormal), r)
    return s + (r - d)


def init_params(w, spec, *, minmax: bool = True) -> dict:
    """SignRound's starting parameters for weight ``w`` [out, in]: ``value`` (``V``, zeros of ``w``'s shape) and,
    with ``minmax``, ``min_scale`` / ``max_scale`` (ones of the spec's scale shape); ``w``'s float dtype."""
    torch = _torch()
    check_autoround_spec(spec, tuple(w.shape))
    dt = w.dtype if w.is_floating_point() else torch.float32
    p = {"value": torch.zeros(w.shape, dtype=dt, device=w.device)}
    if minmax:
        sshape = spec.scale_shape(tuple(w.shape))
        p["min_scale"] = torch.ones(sshape, dtype=dt, device=w.device)
        p["max_scale"] = torch.ones(sshape, dtype=dt, device=w.device)
    return p


def scale_zero_point(w, spec, min_scale=None, max_scale=None) -> tuple:
    """``(scale, zero_point)`` of ``w`` [out, in] under ``spec`` with the range factors (None: 1): float tensors of
    the spec's scale shape (zero point None when symmetric), differentiable in the factors (straight-through
    rounding). At factors 1 these are qcore's round-to-nearest scales and zero points."""
    torch = _torch()
    wg = _grouped(w, spec)
    sshape = spec.scale_shape(tuple(w.shape))
    lo = torch.clamp(wg.amin(-1), max=0).reshape(sshape)
    hi = torch.clamp(wg.amax(-1), min=0).reshape(sshape)
    if min_scale is not None:
        lo = lo * min_scale
    if max_scale is not None:
        hi = hi * max_scale
    qmin, qmax = _int_range(spec)
    if spec.symmetric:
        a = torch.maximum(-lo, hi)
        div = qmax if (spec.narrow_range or not spec.dtype.signed) else (qmax - qmin) / 2.0
        s = _scale_ste(a / div, spec)
        s = torch.where(a.detach() > 0, s, torch.ones_like(s))
        return s, None
    width = hi - lo
    s = _scale_ste(width / (qmax - qmin), spec)
    s = torch.where(width.detach() > 0, s, torch.ones_like(s))
    zp = torch.clamp(qmin - _round_ste(lo / s), qmin, qmax)
    return s, zp


def _codes(w, spec, value, min_scale, max_scale):
    """``(codes, scale, zero point)`` in the grouped layout [rows, groups, group size] (scale and zero point
    [rows, groups, 1]; zero point None when symmetric), and the scale and zero point in the spec's scale shape."""
    torch = _torch()
    s, zp = scale_zero_point(w, spec, min_scale, max_scale)
    wg = _grouped(w, spec)
    sg = s.reshape(wg.shape[0], wg.shape[1], 1)
    v = value.reshape(wg.shape) if isinstance(value, torch.Tensor) else value
    qmin, qmax = _int_range(spec)
    r = _round_ste(wg / sg + v)
    if zp is None:
        return torch.clamp(r, qmin, qmax), sg, None, s, zp
    zg = zp.reshape(sg.shape)
    return torch.clamp(r + zg, qmin, qmax), sg, zg, s, zp


def fake_quantize_rounded(w, spec, value=None, min_scale=None, max_scale=None):
    """``w`` [out, in] quantized and dequantized with rounding offsets ``value`` (None: 0) and range factors (None:
    1), differentiable in them (straight-through rounding)."""
    q, sg, zg, _, _ = _codes(w, spec, 0.0 if value is None else value, min_scale, max_scale)
    return (sg * (q if zg is None else q - zg)).reshape(w.shape)


def quantize_rounded(w, spec, value=None, min_scale=None, max_scale=None):
    """The QTensor of ``w`` [out, in] with the learnt offsets and factors: ``qcore.quantize`` of the rounded weight
    with the learnt scales and zero points (its codes are the rounded ones; checked)."""
    torch = _torch()
    check_autoround_spec(spec, tuple(w.shape))
    with torch.no_grad():
        q, sg, zg, s, zp = _codes(w.float(), spec, 0.0 if value is None else value.float(),
                                  None if min_scale is None else min_scale.float(),
                                  None if max_scale is None else max_scale.float())
        deq = (sg * (q if zg is None else q - zg)).reshape(w.shape)
        kw = {"scale": s.contiguous()}
        if zp is not None:
            kw["zero_point"] = zp.contiguous()
        qt = qcore.quantize(deq.contiguous(), spec, **kw)
        if not torch.equal(qcore.dequantize(qt), deq):  # internal: the spec quantizes differently than learnt
            raise RuntimeError(f"autoround: qcore.quantize(spec={spec.name or spec.dtype.name}) with the learnt "
                               f"scales does not reproduce the learnt codes; please report this")
    return qt


def learning_rate(t: int, iters: int, lr: float) -> float:
    """auto-round's schedule: ``lr`` decayed linearly to 0 over ``iters`` steps (step ``t`` from 0)."""
    return lr * (1.0 - t / iters)


@dataclass(frozen=True)
class SignRoundResult:
    """``qtensors`` {name: QTensor}; ``params`` {name: {value, min_scale, max_scale}} of the kept iterate;
    ``losses`` the minibatch loss of each iteration (before its step); ``best_iter`` / ``best_loss`` the kept one;
    ``init_loss`` iteration 0's (round-to-nearest)."""

    qtensors: dict
    params: dict
    losses: tuple
    best_iter: int
    best_loss: float
    init_loss: float


def _check_common(weights, specs, forward, batches, targets):
    torch = _torch()
    if not isinstance(weights, Mapping) or not weights:
        raise TypeError(f"weights must be a non-empty dict {{name: torch tensor [out, in]}}, got {type(weights).__name__}")
    for n, w in weights.items():
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point():
            raise TypeError(f"weights[{n!r}] must be a 2-D float torch tensor, got "
                            f"{type(w).__name__}{tuple(getattr(w, 'shape', ()))}")
    if not isinstance(specs, Mapping) or set(specs) != set(weights):
        raise ValueError(f"specs must have the keys of weights {sorted(weights)}, got "
                         f"{sorted(specs) if isinstance(specs, Mapping) else type(specs).__name__}")
    for n, w in weights.items():
        try:
            check_autoround_spec(specs[n], tuple(w.shape))
        except ValueError as e:
            raise ValueError(f"{n}: {e}") from None
    if not callable(forward):
        raise TypeError(f"forward must be callable as forward({{name: weight}}, batch), got {type(forward).__name__}")
    if not isinstance(batches, Sequence) or isinstance(batches, (str, bytes)) or len(batches) == 0:
        raise ValueError("batches must be a non-empty sequence (one item per calibration batch)")
    if not isinstance(targets, Sequence) or len(targets) != len(batches):
        raise ValueError(f"targets must be a sequence of one target tensor per batch ({len(batches)}), got "
                         f"{type(targets).__name__}{f' of {len(targets)}' if isinstance(targets, Sequence) else ''}")


def _check_lr(v, name):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {v!r}")
    return float(v)


def signround_step(weights: Mapping, specs: Mapping, params: Mapping, forward: Callable, batches: Sequence,
                   targets: Sequence, indices: Sequence[int], *, lr: float, minmax_lr: float) -> float:
    """One SignRound iteration, in place on ``params`` ({name: init_params(...)}): the loss
    ``mean over i in indices of mean((forward(W~, batches[i]) - targets[i])^2)``, its gradients with respect to the
    offsets and range factors (one backward per batch, accumulated), then ``p -= lr * sign(grad)`` (``minmax_lr``
    for the factors), ``value`` clamped to [-0.5, 0.5], the factors to [0, 1]. Returns the loss (before the step)."""
    torch = _torch()
    k = len(indices)
    with torch.enable_grad():
        leaves = {n: {pn: p.detach().requires_grad_(True) for pn, p in params[n].items()} for n in weights}
        fq = {n: fake_quantize_rounded(weights[n], specs[n], leaves[n]["value"], leaves[n].get("min_scale"),
                                       leaves[n].get("max_scale")) for n in weights}
        # the block runs once per batch on detached copies of the quantized weights; their gradients are summed
        # and pushed through the quantizer once
        fq_leaf = {n: t.detach().requires_grad_(True) for n, t in fq.items()}
        total = 0.0
        for i in indices:
            out = forward(fq_leaf, batches[i])
            o = out if out.dtype == torch.float64 else out.float()
            loss = torch.mean((o - targets[i].to(o.dtype)) ** 2) / k
            loss.backward()
            total += float(loss.detach())
            del out, loss
        names = [n for n in fq if fq_leaf[n].grad is not None]
        if names:
            torch.autograd.backward([fq[n] for n in names], [fq_leaf[n].grad for n in names])
    with torch.no_grad():
        for n in weights:
            for pn, p in params[n].items():
                g = leaves[n][pn].grad
                if g is None:
                    continue
                p.sub_(torch.sign(g) * (lr if pn == "value" else minmax_lr))
                if pn == "value":
                    p.clamp_(-0.5, 0.5)
                else:
                    p.clamp_(0.0, 1.0)
    return total


class _Sampler:
    """auto-round's ``IndexSampler``: shuffled indices ``batch_size`` at a time; reshuffled when fewer remain."""

    def __init__(self, n: int, batch_size: int, key: int):
        torch = _torch()
        self.n, self.k = n, batch_size
        self.gen = torch.Generator().manual_seed(int(key))
        self.order = self._shuffle()
        self.pos = 0

    def _shuffle(self):
        return _torch().randperm(self.n, generator=self.gen).tolist()

    def next(self) -> list:
        if self.pos + self.k > self.n:
            self.order, self.pos = self._shuffle(), 0
        out = self.order[self.pos:self.pos + self.k]
        self.pos += self.k
        return out


def signround(weights: Mapping, specs: Mapping, forward: Callable, batches: Sequence, targets: Sequence, *,
              iters: int = 200, lr: Optional[float] = None, minmax_lr: Optional[float] = None,
              enable_minmax_tuning: bool = True, batch_size: int = 8, key: int = 0,
              progress: Optional[Callable[[int, float], None]] = None) -> SignRoundResult:
    """SignRound on one block (module docstring).

    weights: {name: float torch tensor [out, in]} (the block's float weights; not modified). specs: {name:
    QuantSpec}. forward(fq, batch): the block's output on ``batch`` with weights ``fq`` ({name: fake-quantized
    weight}); targets: one tensor per batch, what the output should be (the float block's output). iters: steps
    (0: round-to-nearest); lr: offsets' step size (default ``1 / iters``); minmax_lr: the range factors' (default
    ``lr``); enable_minmax_tuning: learn the range factors; batch_size: batches per step (at most all); key: seed of
    the minibatch order. progress(t, loss): called after each iteration.
    """
    _torch()  # torch is needed from here on (imported on first use)
    _check_common(weights, specs, forward, batches, targets)
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"iters must be an int >= 0, got {iters!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if not isinstance(enable_minmax_tuning, bool):
        raise TypeError(f"enable_minmax_tuning must be a bool, got {enable_minmax_tuning!r}")
    if isinstance(key, bool) or not isinstance(key, int):
        raise TypeError(f"key must be an int (the seed of the minibatch order), got {key!r}")
    lr = (1.0 / max(iters, 1)) if lr is None else _check_lr(lr, "lr")
    minmax_lr = lr if minmax_lr is None else _check_lr(minmax_lr, "minmax_lr")
    ws = {n: w.detach() for n, w in weights.items()}
    params = {n: init_params(w, specs[n], minmax=enable_minmax_tuning) for n, w in ws.items()}
    best = {n: {k: v.clone() for k, v in p.items()} for n, p in params.items()}
    sampler = _Sampler(len(batches), min(batch_size, len(batches)), key)
    losses = []
    best_loss, best_iter = math.inf, 0
    for t in range(iters):
        idx = sampler.next()
        before = {n: {k: v.clone() for k, v in p.items()} for n, p in params.items()}
        loss = signround_step(ws, specs, params, forward, batches, targets, idx,
                              lr=learning_rate(t, iters, lr), minmax_lr=learning_rate(t, iters, minmax_lr))
        losses.append(loss)
        if loss < best_loss:  # the loss was measured at the parameters before this step
            best_loss, best_iter, best = loss, t, before
        if progress is not None:
            progress(t, loss)
    qts = {n: quantize_rounded(ws[n], specs[n], best[n]["value"], best[n].get("min_scale"), best[n].get("max_scale"))
           for n in ws}
    return SignRoundResult(qts, best, tuple(losses), best_iter, best_loss if losses else math.nan,
                           losses[0] if losses else math.nan)

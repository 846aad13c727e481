"""Layerwise mixed precision (AMP): pick one quantization scheme per layer from measured sensitivities.

``search(sensitivity, weights, bits, target_bits=...)`` minimises the summed sensitivity (the predicted loss
increase) subject to an average of at most ``target_bits`` bits per weight; ``search(..., max_loss=...)`` finds
the cheapest assignment (fewest bits) whose summed sensitivity is at most ``max_loss``. Pure Python and numpy;
the sensitivities come from anywhere (``qcore.adapters.passes.amp.layer_sensitivity`` measures them on a torch model).

Inputs (one entry per layer, or per group of layers that must share a scheme):

- ``sensitivity``: ``{layer: {scheme: loss increase}}``: finite numbers (negative values, from noise in a
  measured loss difference, are allowed). A layer lists the schemes it may take (at least one).
- ``weights``: ``{layer: number of weights}``, positive ints: the averaging weights of the bits.
- ``bits``: ``{scheme: bits per weight}`` or ``{layer: {scheme: bits per weight}}`` (per layer when a scheme's
  scale overhead depends on the layer's shape, e.g. per-tensor scales): positive finite numbers. Take them from
  the spec: ``QuantSpec.bits_per_element(shape)`` (MXFP4: 4 + 8/32 = 4.25; fp8 per tensor: 8 + 32/numel).

The model of the loss is additive: the loss of an assignment is predicted as the sum of the layers' own
sensitivities (each measured with only that layer quantized). Interactions between layers are ignored; that is
the usual AMP approximation (HAWQ, Quark's AMP), and the reason the measured loss of the result should be checked.

Method and optimality: a multiple-choice knapsack solved exactly by dynamic programming over a discretised bit
budget. Each layer's cost is counted above its cheapest scheme ("extra bits"); the extra budget
``target_bits * total_weights - cheapest total`` is cut into ``resolution`` units of ``unit`` bits and every extra
cost is rounded *up* to whole units. So the result never exceeds the budget, and its predicted loss is at most
the exact optimum for the budget reduced by ``n_layers * unit`` bits (``MixedPrecision.gap_bits``, per weight);
when every extra cost is a multiple of ``unit`` it is the exact optimum. Arithmetic on costs is exact
(``fractions.Fraction`` of the given floats). ``max_loss`` mode runs the same program with units of
``(most expensive - cheapest total) / resolution`` and returns the cheapest number of units whose best loss is
within ``max_loss``: its bits are within ``gap_bits`` of the cheapest feasible assignment and its predicted loss
is within ``max_loss`` exactly. Cost: ``O(n_layers * n_schemes * resolution)`` numpy operations.

Deterministic: ties in loss go to the cheaper assignment, then to the scheme listed first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Optional

import numpy as np

__all__ = ["MixedPrecision", "search", "DEFAULT_RESOLUTION"]

DEFAULT_RESOLUTION = 10_000


@dataclass(frozen=True)
class MixedPrecision:
    """The result of ``search``: a value.

    choice: ``((layer, scheme), ...)`` in the order of the ``sensitivity`` argument.
    average_bits: bits per weight of the assignment, averaged with ``weights``.
    predicted_loss: the summed sensitivity of the chosen schemes (``math.fsum``).
    total_weights: the sum of ``weights``.
    scheme_weights: ``((scheme, weights taking it), ...)`` for every scheme that appears, in order of first use.
    gap_bits: the optimality bound in bits per weight (module docstring): 0.0 when the discretisation is exact
        or the budget does not bind.
    target_bits, max_loss: the constraint searched under (the other is None).
    """

    choice: tuple
    average_bits: float
    predicted_loss: float
    total_weights: int
    scheme_weights: tuple
    gap_bits: float
    target_bits: Optional[float] = None
    max_loss: Optional[float] = None

    def as_dict(self) -> dict:
        """``{layer: scheme}``."""
        return dict(self.choice)

    def share(self, scheme: str) -> float:
        """The fraction of the weights that take ``scheme`` (0.0 if none does)."""
        return dict(self.scheme_weights).get(scheme, 0) / self.total_weights


def _err(what: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"{what}: got {value!r}; expected {expected}")


def _number(v: Any, what: str, *, positive: bool) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what} must be a number, got {v!r} ({type(v).__name__})")
    f = float(v)
    if not math.isfinite(f) or (positive and f <= 0):
        raise _err(what, v, "a positive finite number" if positive else "a finite number")
    return f


def _check(sensitivity, weights, bits):
    if not isinstance(sensitivity, Mapping) or not sensitivity:
        raise _err("sensitivity", sensitivity, "a non-empty dict {layer: {scheme: loss increase}}")
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a dict {{layer: number of weights}}, got {type(weights).__name__}")
    if not isinstance(bits, Mapping) or not bits:
        raise _err("bits", bits, "a non-empty dict {scheme: bits per weight} or {layer: {scheme: bits}}")
    layers = list(sensitivity)
    missing = [k for k in layers if k not in weights]
    extra = [k for k in weights if k not in sensitivity]
    if missing or extra:
        raise _err("weights", sorted(weights)[:5], f"the layers of sensitivity exactly (missing {missing[:5]}, "
                                                   f"unknown {extra[:5]})")
    per_layer = all(isinstance(v, Mapping) for v in bits.values())
    if not per_layer and any(isinstance(v, Mapping) for v in bits.values()):
        raise _err("bits", bits, "either {scheme: bits} or {layer: {scheme: bits}}, not a mix")
    if per_layer:
        unknown = [k for k in bits if k not in sensitivity]
        if unknown or len(bits) != len(layers):
            raise _err("bits", sorted(bits)[:5], f"one entry per layer of sensitivity (unknown {unknown[:5]})")
    rows = []
    for layer in layers:
        if not isinstance(layer, str):
            raise TypeError(f"sensitivity keys must be layer names (str), got {layer!r}")
        opts = sensitivity[layer]
        if not isinstance(opts, Mapping) or not opts:
            raise _err(f"sensitivity[{layer!r}]", opts, "a non-empty dict {scheme: loss increase}")
        n = weights[layer]
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise _err(f"weights[{layer!r}]", n, "a positive int")
        table = bits[layer] if per_layer else bits
        row = []
        for scheme, loss in opts.items():
            if not isinstance(scheme, str):
                raise TypeError(f"sensitivity[{layer!r}] keys must be scheme names (str), got {scheme!r}")
            if scheme not in table:
                where = f"bits[{layer!r}]" if per_layer else "bits"
                raise _err(where, sorted(table), f"an entry for scheme {scheme!r} (used by layer {layer!r})")
            b = _number(table[scheme], f"bits[{scheme!r}]" if not per_layer else f"bits[{layer!r}][{scheme!r}]",
                        positive=True)
            row.append((scheme, Fraction(int(n)) * Fraction(b), _number(loss, f"sensitivity[{layer!r}][{scheme!r}]",
                                                                        positive=False)))
        rows.append((layer, int(n), row))
    return rows


def _solve(rows, extra_cost, cap_units, unit):
    """DP over whole units: per layer, the best option for each exact number of units used. Returns the
    per-layer option indices for each final unit count (via backtracking) and the final loss vector."""
    inf = np.inf
    dp = np.full(cap_units + 1, inf)
    dp[0] = 0.0
    picks = []
    for (layer, _n, row), extras in zip(rows, extra_cost):
        new = np.full(cap_units + 1, inf)
        pick = np.full(cap_units + 1, -1, dtype=np.int32)
        for j, ((_s, _c, loss), e) in enumerate(zip(row, extras)):
            if e == 0:
                u = 0
            elif unit is None:  # no extra budget at all: only zero-extra options fit
                continue
            else:
                u = math.ceil(e / unit)
            if u > cap_units:
                continue
            cand = np.full(cap_units + 1, inf)
            cand[u:] = dp[:cap_units + 1 - u] + loss
            better = cand < new
            new[better] = cand[better]
            pick[better] = j
        picks.append((pick, extras, row))
        dp = new
    return dp, picks


def _backtrack(picks, c, unit):
    out = []
    for pick, extras, row in reversed(picks):
        j = int(pick[c])
        e = extras[j]
        c -= 0 if e == 0 else math.ceil(e / unit)
        out.append(j)
    return out[::-1]


def search(sensitivity: Mapping, weights: Mapping, bits: Mapping, *, target_bits: Optional[float] = None,
           max_loss: Optional[float] = None, resolution: int = DEFAULT_RESOLUTION) -> MixedPrecision:
    """One scheme per layer: the least summed sensitivity within ``target_bits`` average bits per weight, or the
    fewest bits within a summed sensitivity of ``max_loss`` (give exactly one). See the module docstring for the
    inputs, the additive loss model and the optimality bound; ``resolution`` is the number of budget units of
    the dynamic program (more: a smaller ``gap_bits``, proportionally more time)."""
    if (target_bits is None) == (max_loss is None):
        raise ValueError(f"give exactly one of target_bits and max_loss; got target_bits={target_bits!r}, "
                         f"max_loss={max_loss!r}")
    if isinstance(resolution, bool) or not isinstance(resolution, (int, np.integer)) or not 1 <= resolution <= 10**7:
        raise _err("resolution", resolution, "an int in [1, 10_000_000]")
    resolution = int(resolution)
    if target_bits is not None:
        target = _number(target_bits, "target_bits", positive=True)
    else:
        limit = _number(max_loss, "max_loss", positive=False)
    rows = _check(sensitivity, weights, bits)
    total = sum(n for _, n, _ in rows)
    cheapest = [min(c for _, c, _ in row) for _, _, row in rows]
    extra_cost = [[c - m for _, c, _ in row] for (_, _, row), m in zip(rows, cheapest)]
    base = sum(cheapest, Fraction(0))

    if target_bits is not None:
        budget = Fraction(target) * total
        if base > budget:
            raise _err("target_bits", target_bits, f"at least {float(base / total):.6g}, the average bits of the "
                                                   f"cheapest scheme of every layer")
        room = budget - base
        if sum(max(e) for e in extra_cost) <= room:  # the budget does not bind: each layer's least loss
            choice = [min(range(len(row)), key=lambda j: (row[j][2], row[j][1], j)) for _, _, row in rows]
            return _result(rows, choice, total, 0.0, target_bits=target, max_loss=None)
        unit = room / resolution if room > 0 else None
        dp, picks = _solve(rows, extra_cost, resolution if unit is not None else 0, unit)
        c = int(np.argmin(dp))  # the least loss; ties: the fewest units
        gap = float(len(rows) * unit / total) if unit is not None else 0.0
        return _result(rows, _backtrack(picks, c, unit), total, gap, target_bits=target, max_loss=None)

    span = sum(max(e) for e in extra_cost)
    unit = span / resolution if span > 0 else None
    cap = sum(max(0 if e == 0 else math.ceil(e / unit) for e in ex) for ex in extra_cost) if unit else 0
    dp, picks = _solve(rows, extra_cost, cap, unit)
    ok = np.flatnonzero(dp <= limit)
    best = math.fsum(min(l for _, _, l in row) for _, _, row in rows)
    for c in ok:  # the fewest units whose best loss is within max_loss (re-checked with an exact sum)
        choice = _backtrack(picks, int(c), unit)
        loss = math.fsum(row[j][2] for (_, _, row), j in zip(rows, choice))
        if loss <= limit:
            gap = float(len(rows) * unit / total) if unit is not None else 0.0
            return _result(rows, choice, total, gap, target_bits=None, max_loss=limit)
    raise _err("max_loss", max_loss, f"at least {best:.6g}, the summed least sensitivity of every layer")


def _result(rows, choice, total, gap, *, target_bits, max_loss) -> MixedPrecision:
    pairs, used = [], {}
    cost = Fraction(0)
    losses = []
    for (layer, n, row), j in zip(rows, choice):
        scheme, c, loss = row[j]
        pairs.append((layer, scheme))
        used[scheme] = used.get(scheme, 0) + n
        cost += c
        losses.append(loss)
    return MixedPrecision(choice=tuple(pairs), average_bits=float(cost / total), predicted_loss=math.fsum(losses),
                          total_weights=total, scheme_weights=tuple(used.items()), gap_bits=gap,
                          target_bits=target_bits, max_loss=max_loss)

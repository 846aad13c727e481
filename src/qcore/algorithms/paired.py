"""Paired (asymmetric) calibration statistics: what GPTAQ and Qronos read beside GPTQ's Hessian.

A layer of the quantized model sees inputs ``X~`` (the quantized model's activations: the layers before it, and
the modules before it in this layer, already quantized) where the float model sees ``X`` (the float model's
activations of the same module on the same calibration tokens). Both as token rows: ``X``, ``X~`` are
``[tokens, n]`` for a module with ``n`` input features, row ``t`` of both from the same token of the same batch.

``PairedStats`` (a frozen value, float64 ``[n, n]`` sums and the row count):

- ``hessian`` = ``sum X~^T X~`` (the quantized stream's Gram matrix: GPTQ's statistics of ``X~``, the same
  bits as ``qcore.algorithms.gptq_core.update_hessian`` on ``X~``; ``hessian_stats()`` gives that ``HessianStats``);
- ``delta`` = ``sum (X - X~)^T X~`` (element ``[i, j] = sum_t (x[t, i] - x~[t, i]) * x~[t, j]``: the row index is the float-minus-quantized difference, the column
  index the quantized input). This is GPTAQ's ``dXXT`` (Quark's ``delta_X_Xt``, GPTQModel's ``dXXT``; the papers
  write activations as columns, ``(X - X~) X~^T`` there is this same matrix);
- ``cross()`` = ``delta + hessian`` = ``sum X^T X~`` (element ``[i, j] = sum_t x[t, i] * x~[t, j]``: row index
  float input, column index quantized input), the cross-Gram Qronos reads (its transpose ``sum X~^T X`` is
  ``cross().T``);
- ``count``: the number of token rows.

Why ``delta`` is what is stored: for the first layers ``X`` and ``X~`` are nearly equal, and ``cross - hessian``
computed from two float32 products would lose the difference to rounding; each batch's ``(X - X~)^T X~`` is one
float32 product of the (exact, float32) difference, accumulated in float64 like the Hessian, so ``delta`` is as
accurate relative to itself as the Hessian is, and ``cross()`` (a float64 sum) is as accurate as a direct
product. ``delta`` is exactly zero when ``X == X~`` (GPTAQ then equals GPTQ).

Pure updates: ``PairedStats.empty(n, like=)``, ``update_paired(stats, x, xq)`` (a new value), and
``merge_paired(a, b)`` (sums of both parts and the counts: what ranks all-reduce). ``PairedSum`` is the in-place
accumulator for a pass that owns its sums (the layer binding's hooks), with the same additions and bits.

numpy arrays or torch tensors (CPU or GPU) through the same code; torch is never imported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from qcore._backend import is_torch

from .gptq_core import HessianStats, as_array, batch_gram, lib_of

__all__ = ["PairedStats", "update_paired", "merge_paired", "PairedSum"]


@dataclass(frozen=True)
class PairedStats:
    """``hessian = sum X~^T X~``, ``delta = sum (X - X~)^T X~`` (float64 ``[n, n]``, numpy or torch) over
    ``count`` token rows; ``X``: the float model's inputs of the module, ``X~``: the quantized model's, row by
    row the same tokens (module docstring for the index conventions)."""

    hessian: Any
    delta: Any
    count: int

    @classmethod
    def empty(cls, n: int, *, like: Any = None) -> "PairedStats":
        """No rows yet, for ``n`` input features; ``like``: a torch tensor whose device the sums live on."""
        h = HessianStats.empty(n, like=like)
        d = HessianStats.empty(n, like=like)
        return cls(h.sum, d.sum, 0)

    @property
    def n(self) -> int:
        return int(self.hessian.shape[0])

    def hessian_stats(self) -> HessianStats:
        """GPTQ's statistics of the quantized stream ``X~`` (``gptq(weight, stats.hessian_stats(), spec)``)."""
        return HessianStats(self.hessian, self.count)

    def cross(self):
        """``sum X^T X~`` (float64 ``[n, n]``; row index: float input ``X``, column index: quantized ``X~``)."""
        return self.delta + self.hessian

    def scaled(self):
        """``(H~, dXXT)`` scaled as GPTQ scales its Hessian (``2 / count``; the scale does not change GPTAQ's or
        GPTQ's result, only its damping reference ``mean(diag H~)``, which scales with it)."""
        if self.count == 0:
            raise ValueError("PairedStats: no calibration rows were added (count == 0)")
        s = 2.0 / self.count
        return self.hessian * s, self.delta * s


def _check_pair(n: int, x: Any, xq: Any, like: Any):
    x = as_array(x, "x")
    xq = as_array(xq, "xq")
    if tuple(x.shape) != tuple(xq.shape):
        raise ValueError(f"x (the float model's inputs) and xq (the quantized model's) must have the same shape "
                         f"(the same tokens), got {tuple(x.shape)} and {tuple(xq.shape)}")
    if x.ndim < 1 or int(x.shape[-1]) != n:
        raise ValueError(f"x and xq must have {n} features on their last axis, got shape {tuple(x.shape)}")
    if is_torch(x) != is_torch(like) or is_torch(xq) != is_torch(like):
        raise TypeError("x, xq and the statistics must be the same kind of array (all numpy or all torch)")
    return x, xq


def _batch_delta(n: int, x: Any, xq: Any, like: Any):
    """``(X - X~)^T X~`` of one batch (float32 ``[n, n]``)."""
    lib = lib_of(x)
    if is_torch(x):
        a = x.reshape(-1, n).detach().to(device=like.device, dtype=lib.f32)
        b = xq.reshape(-1, n).detach().to(device=like.device, dtype=lib.f32)
    else:
        a = np.asarray(x).reshape(-1, n).astype(np.float32, copy=False)
        b = np.asarray(xq).reshape(-1, n).astype(np.float32, copy=False)
    prod = (a - b).T @ b
    if not lib.finite(prod):
        raise ValueError("x holds NaN or Inf (or values whose products overflow float32); paired statistics need "
                         "finite activations")
    return prod


def _widen(prod):
    return prod.to(lib_of(prod).f64) if is_torch(prod) else prod.astype(np.float64)


def update_paired(stats: PairedStats, x: Any, xq: Any) -> PairedStats:
    """``stats`` plus the rows of ``x`` (the float model's inputs, ``[..., n]``) paired with those of ``xq`` (the
    quantized model's inputs of the same module on the same tokens, same shape): a new value."""
    if not isinstance(stats, PairedStats):
        raise TypeError(f"stats must be a PairedStats, got {type(stats).__name__}")
    x, xq = _check_pair(stats.n, x, xq, stats.hessian)
    gram, rows = batch_gram(stats.n, xq, stats.hessian)
    d = _batch_delta(stats.n, x, xq, stats.hessian)
    return PairedStats(stats.hessian + _widen(gram), stats.delta + _widen(d), stats.count + rows)


class PairedSum:
    """``update_paired`` in place (``add(x, xq)``; ``stats()`` shares the sums): the same additions, the same
    bits, no new ``[n, n]`` sums per batch."""

    __slots__ = ("hessian", "delta", "count")

    def __init__(self, n: int, *, like: Any = None):
        st = PairedStats.empty(n, like=like)
        self.hessian, self.delta, self.count = st.hessian, st.delta, 0

    def add(self, x: Any, xq: Any) -> None:
        n = int(self.hessian.shape[0])
        x, xq = _check_pair(n, x, xq, self.hessian)
        gram, rows = batch_gram(n, xq, self.hessian)
        d = _batch_delta(n, x, xq, self.hessian)
        if is_torch(gram):
            self.hessian.add_(gram)
            self.delta.add_(d)
        else:
            np.add(self.hessian, gram, out=self.hessian)
            np.add(self.delta, d, out=self.delta)
        self.count += rows

    def stats(self) -> PairedStats:
        return PairedStats(self.hessian, self.delta, self.count)


def merge_paired(a: PairedStats, b: PairedStats) -> PairedStats:
    """The statistics of both row sets (sums of ``hessian``, ``delta`` and ``count``)."""
    for name, v in (("a", a), ("b", b)):
        if not isinstance(v, PairedStats):
            raise TypeError(f"{name} must be a PairedStats, got {type(v).__name__}")
    if a.n != b.n:
        raise ValueError(f"merge_paired: sizes differ ({a.n} and {b.n})")
    return PairedStats(a.hessian + b.hessian, a.delta + b.delta, a.count + b.count)


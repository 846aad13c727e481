"""Optimisation on the orthogonal group: the Cayley step SpinQuant learns its rotations with.

``cayley_step(r, grad, *, lr)``: one descent step from the orthogonal ``r`` along the Riemannian gradient, staying
on the manifold exactly (up to float rounding): with the skew-symmetric ``A = G R^T - R G^T``,

    R' = (I + t/2 A)^{-1} (I - t/2 A) R,    t = min(lr, 1 / ||A||_1)

The Cayley transform of a skew matrix is orthogonal, so ``R'`` is orthogonal when ``R`` is; to first order
``R' = R - t (G - R G^T R)``, the gradient projected on the tangent space. The step bound ``1 / ||A||_1`` is the
one of Li, Fuxin and Todorovic's Cayley SGD (ICLR 2020) that SpinQuant uses (lr 1.5 there). numpy arrays or
torch tensors (any float dtype; float64 advised for ``r``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from qcore._backend import is_torch

__all__ = ["cayley_step", "orthogonality_error"]


def _check(r, grad):
    if tuple(r.shape) != tuple(grad.shape) or r.ndim != 2 or r.shape[0] != r.shape[1]:
        raise ValueError(f"r and grad must be square matrices of one shape, got {tuple(r.shape)} and "
                         f"{tuple(grad.shape)}")


def cayley_step(r: Any, grad: Any, *, lr: float) -> Any:
    """One Cayley SGD step (module docstring); returns the new orthogonal matrix (same type and dtype as ``r``)."""
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    _check(r, grad)
    if is_torch(r):
        import torch
        g = grad.to(r.dtype)
        a = g @ r.T - r @ g.T
        norm = float(a.abs().sum(0).max())
        if norm == 0.0:
            return r.clone()
        t = min(float(lr), 1.0 / norm)
        eye = torch.eye(r.shape[0], dtype=r.dtype, device=r.device)
        return torch.linalg.solve(eye + (t / 2) * a, (eye - (t / 2) * a) @ r)
    r = np.asarray(r)
    g = np.asarray(grad, dtype=r.dtype)
    a = g @ r.T - r @ g.T
    norm = float(np.abs(a).sum(0).max())
    if norm == 0.0:
        return r.copy()
    t = min(float(lr), 1.0 / norm)
    eye = np.eye(r.shape[0], dtype=r.dtype)
    return np.linalg.solve(eye + (t / 2) * a, (eye - (t / 2) * a) @ r)


def orthogonality_error(r: Any) -> float:
    """``max |R R^T - I|``."""
    if is_torch(r):
        import torch
        return float((r @ r.T - torch.eye(r.shape[0], dtype=r.dtype, device=r.device)).abs().max())
    r = np.asarray(r)
    return float(np.abs(r @ r.T - np.eye(r.shape[0])).max())

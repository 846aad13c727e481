"""Straight-through gradients for ``fake_quantize`` on torch tensors that require grad.

Imported only when such a tensor reaches ``fake_quantize`` (``import qcore`` never imports torch).

The forward pass is the ordinary (eager or compiled) fake-quantize, bit for bit. The backward pass is the
straight-through estimator (Bengio et al. 2013): ``d out / d x = 1`` for every element, i.e. the upstream
gradient passes through unchanged, whatever rounding, clamping or saturation did (no masking of clamped
elements). Scales and zero points, given or computed from ``x``, are constants: they receive no gradient.
"""

from __future__ import annotations

import torch

__all__ = ["straight_through"]


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, run, scale, zero_point, key):
        return run(x, scale, zero_point, key)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, None, None, None, None


def straight_through(run, x, scale, zero_point, key):
    """``run(x, scale, zero_point, key)`` with the identity as its gradient with respect to ``x``."""
    return _StraightThrough.apply(x, run, scale, zero_point, key)

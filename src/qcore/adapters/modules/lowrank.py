"""SVDQuant's high-precision low-rank branch of a Linear: its buffers (``lowrank_down``, ``lowrank_up``,
``input_smoothing``), set on a float ``nn.Linear`` or a ``QuantLinear``, and the modules that carry one."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

__all__ = ["LowRankBranch", "add_low_rank_branch", "low_rank_modules"]


class LowRankBranch(NamedTuple):
    """SVDQuant's high-precision side branch of a ``QuantLinear`` (``QuantLinear.low_rank_branch``): ``down``
    ``[rank, in]`` and ``up`` ``[out, rank]`` (the layer adds ``x_hat down^T up^T``; Quark's ``correction.l1`` /
    ``l2``), and ``smoothing`` ``[in]`` or None: the per-input-channel divisor the layer applies to its input
    before both paths (``x_hat = x / smoothing``; None where it is folded into the preceding op)."""

    down: torch.Tensor
    up: torch.Tensor
    smoothing: Optional[torch.Tensor]


_BRANCH_BUFFERS = ("lowrank_down", "lowrank_up", "input_smoothing")


def add_low_rank_branch(m: nn.Module, down: torch.Tensor, up: torch.Tensor, smoothing: Optional[torch.Tensor] = None,
                        *, where: str = "") -> None:
    """Register SVDQuant's branch buffers (``lowrank_down`` [r, in], ``lowrank_up`` [out, r], ``input_smoothing``
    [in] or None) on an ``nn.Linear`` (float or ``QuantLinear``); replaces a branch it has."""
    if not isinstance(m, nn.Linear):
        raise TypeError(f"low-rank branch {where!r}: takes an nn.Linear, got {type(m).__name__}")
    n_out, n_in = m.out_features, m.in_features
    for name, t in (("down", down), ("up", up), ("smoothing", smoothing)):
        if t is not None and not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            raise TypeError(f"low-rank branch {where!r}: {name} must be a floating torch tensor, got "
                            f"{type(t).__name__}")
    if down.dim() != 2 or up.dim() != 2 or down.shape[1] != n_in or up.shape[0] != n_out \
            or up.shape[1] != down.shape[0]:
        raise ValueError(f"low-rank branch {where!r}: down {list(down.shape)} and up {list(up.shape)} do not fit "
                         f"a Linear [{n_out}, {n_in}] (expected down [r, {n_in}], up [{n_out}, r])")
    if smoothing is not None and tuple(smoothing.shape) != (n_in,):
        raise ValueError(f"low-rank branch {where!r}: smoothing has shape {list(smoothing.shape)}, expected "
                         f"[{n_in}]")
    for k in _BRANCH_BUFFERS:
        m._buffers.pop(k, None)
    # contiguous copies: a loaded checkpoint's tensors are contiguous, and the matmul's summation order (so its
    # bits) follows the layout
    m.register_buffer("lowrank_down", down.detach().clone(memory_format=torch.contiguous_format))
    m.register_buffer("lowrank_up", up.detach().clone(memory_format=torch.contiguous_format))
    if smoothing is not None:
        m.register_buffer("input_smoothing", smoothing.detach().clone(memory_format=torch.contiguous_format))


def low_rank_modules(model: nn.Module) -> list[str]:
    """The names of the modules of ``model`` carrying an SVDQuant low-rank branch (exporters that cannot write it
    refuse them by name)."""
    return [n for n, m in model.named_modules() if m._buffers.get("lowrank_down") is not None]

"""``QuantLinear`` (``nn.Linear``, with SVDQuant's optional low-rank branch) and ``QuantConv1D`` (transformers'
``Conv1D``: GPT-2's projections, quantized as the Linear of ``W^T``; None without transformers)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .base import QuantModule
from .layout import Conv1D
from .lowrank import LowRankBranch, add_low_rank_branch

__all__ = ["QuantLinear", "QuantConv1D"]


class QuantLinear(QuantModule, nn.Linear):
    """``nn.Linear`` with qcore quantization of its weight, input, output and bias; optionally SVDQuant's low-rank
    branch (buffers ``lowrank_down`` / ``lowrank_up``, and ``input_smoothing``): ``y = Q(x_hat) Q(W)^T +
    x_hat down^T up^T + b`` with ``x_hat = x / input_smoothing`` (``set_low_rank_branch``)."""

    def _features(self, role):
        return self.in_features if role == "input" else self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self._buffers
        sm = b.get("input_smoothing")
        if sm is not None:
            x = x / sm.to(x.dtype)
        xq = self._qact(x, "input")
        y = self._frozen_linear(xq)  # the fused kernel on a GPU (frozen int4 / MXFP4 weights), else None
        if y is None:
            y = F.linear(xq, self._w(), self._param("bias"))
        down = b.get("lowrank_down")
        if down is not None:  # the branch reads the unquantized (smoothed) input
            y = y + F.linear(F.linear(x, down.to(x.dtype)), b["lowrank_up"].to(x.dtype))
        return self._qact(y, "output")

    @property
    def low_rank_branch(self) -> Optional[LowRankBranch]:
        """The SVDQuant branch (its buffers themselves), or None."""
        b = self._buffers
        if b.get("lowrank_down") is None:
            return None
        return LowRankBranch(b["lowrank_down"], b["lowrank_up"], b.get("input_smoothing"))

    def set_low_rank_branch(self, down: torch.Tensor, up: torch.Tensor, smoothing: Optional[torch.Tensor] = None
                            ) -> None:
        """Give the module SVDQuant's branch (importers; ``qcore.adapters.passes.svdquant`` sets it on the float
        Linear before wrapping, where ``from_module`` carries it over). Shapes checked before anything is stored."""
        add_low_rank_branch(self, down, up, smoothing, where=self.qname)


# ---------------------------------------------------------------------------------------------------------------
# transformers' Conv1D (GPT-2's c_attn, c_proj, c_fc): a Linear whose weight is stored [in, out]
# ---------------------------------------------------------------------------------------------------------------

QuantConv1D: Any = None

if Conv1D is not None:
    class QuantConv1D(QuantModule, Conv1D):  # type: ignore[no-redef]
        """transformers' ``Conv1D`` (``y = x @ W + b``, ``W`` stored ``[in, out]``: GPT-2's ``attn.c_attn`` (fused
        q/k/v), ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``) with qcore quantization, exactly as a ``QuantLinear``
        holding ``W^T``: the canonical weight layout is ``W^T`` ``[out, in]`` (per-channel scales per output
        feature, groups along the input features), activations on the ``[tokens, features]`` view. The parameter
        keeps its ``[in, out]`` layout (state_dict keys and shapes as the float model's); the scale buffers, and a
        frozen weight's packed codes (``weight_packed``), are in the Linear ``[out, in]`` layout, so exporters and
        importers read and build it as a Linear's (``load_frozen`` takes parts of shape ``[out, in]``)."""

        def _canon(self, w):
            return w.t()

        def _uncanon(self, w):
            return w.t()

        def _features(self, role):
            return self.nx if role == "input" else self.nf

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self._qact(x, "input")
            shape = x.shape[:-1] + (self.nf,)
            x2 = x.reshape(-1, x.shape[-1])
            y = self._frozen_linear(x2)  # the fused kernel on a GPU (frozen int4 / MXFP4 codes are [out, in])
            if y is None:
                w = self._w()
                w = w if w.is_contiguous() else w.contiguous()  # Conv1D's own [in, out] operand: the same bits
                b = self._param("bias")
                y = torch.addmm(b, x2, w) if b is not None else torch.mm(x2, w)
            return self._qact(y.view(shape), "output")

        def __repr__(self) -> str:  # Conv1D's own __repr__ would hide the quantization
            return nn.Module.__repr__(self)

        def extra_repr(self) -> str:  # type: ignore[override]
            return f"nf={self.nf}, nx={self.nx}{QuantModule.extra_repr(self)}"

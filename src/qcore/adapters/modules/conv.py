"""``QuantConv2d`` and ``QuantConvTranspose2d`` (whose ``[in, out/groups, *kernel]`` weight is mapped to the
canonical ``[out, in/groups, *kernel]`` axes)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .base import QuantModule

__all__ = ["QuantConv2d", "QuantConvTranspose2d"]


class QuantConv2d(QuantModule, nn.Conv2d):
    """``nn.Conv2d`` with qcore quantization; activations per tensor or along the channel axis."""

    _conv = True

    def _features(self, role):
        return self.in_channels if role == "input" else self.out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._qact(x, "input")
        y = self._conv_forward(x, self._w(), self._param("bias"))
        return self._qact(y, "output")


class QuantConvTranspose2d(QuantModule, nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` with qcore quantization. Its weight is stored ``[in, out/groups, kh, kw]``; the
    config's canonical ``[out, in/groups, ...]`` axes (those of ``nn.Conv2d``) are mapped, so PerChannel(0) is
    per output channel here too: output channel ``g * out/groups + j`` is ``weight[g*in/groups:(g+1)*in/groups, j]``."""

    _conv = True

    def _canon(self, w):
        g = self.groups
        if g == 1:
            return w.transpose(0, 1)
        i, og = w.shape[:2]
        return w.reshape(g, i // g, og, *w.shape[2:]).transpose(1, 2).reshape(g * og, i // g, *w.shape[2:])

    def _uncanon(self, w):
        g = self.groups
        if g == 1:
            return w.transpose(0, 1)
        o, ig = w.shape[:2]
        return w.reshape(g, o // g, ig, *w.shape[2:]).transpose(1, 2).reshape(g * ig, o // g, *w.shape[2:])

    def _features(self, role):
        return self.in_channels if role == "input" else self.out_channels

    def forward(self, x: torch.Tensor, output_size: Optional[list] = None) -> torch.Tensor:
        x = self._qact(x, "input")
        output_padding = self._output_padding(x, output_size, self.stride, self.padding, self.kernel_size, 2,
                                              self.dilation)
        y = F.conv_transpose2d(x, self._w(), self._param("bias"), self.stride, self.padding, output_padding,
                               self.groups, self.dilation)
        return self._qact(y, "output")

"""The axis maps of quantized modules: a ``LayerConfig``'s granularities, given on the canonical layouts (weights
``[out, in, *kernel]``, activations ``[tokens, features]``), as the module's tensors take them."""

from __future__ import annotations

import dataclasses

from qcore import PerBlock, PerChannel, PerGroup, PerTensor, QuantSpec

__all__ = ["weight_granularity", "activation_granularity", "with_granularity"]


def weight_granularity(g, kind: str, name: str, ndim: int, shape: tuple):
    """Check a weight/bias granularity given on the canonical layout; return it with non-negative axes."""
    where = f"{kind} {name!r} (weight shape {list(shape)})"
    if isinstance(g, PerTensor):
        return g
    if isinstance(g, PerChannel):
        if g.axis % ndim != 0:
            raise ValueError(f"weight granularity {g!r} on {where}: per-channel weight scales are per output "
                             f"channel, PerChannel(0) in the canonical [out, in, *kernel] layout")
        return PerChannel(0)
    if isinstance(g, PerGroup):
        if ndim < 2 or g.axis % ndim != 1 and not (ndim == 2 and g.axis == -1):
            raise ValueError(f"per-group weight spec {g!r} on {where}: groups run along the input axis, "
                             f"PerGroup(size, axis=1) in the canonical [out, in, *kernel] layout; axis {g.axis} "
                             f"is not the input axis")
        return PerGroup(g.size, 1)
    if isinstance(g, PerBlock):
        if ndim != 2:
            raise ValueError(f"PerBlock weight scales apply to 2-D weights; {where} is {ndim}-D")
        return g
    raise TypeError(f"unsupported granularity {g!r}")


def activation_granularity(g, conv: bool):
    """The granularity on the tensor the module sees: the 2-D [tokens, features] view (Linear, Embedding) or the
    [N, C, *spatial] tensor (conv), where features are axis 1 either way."""
    if isinstance(g, PerChannel):
        return PerChannel(g.axis % 2)
    if isinstance(g, PerGroup):
        return PerGroup(g.size, 1)
    return g


def with_granularity(spec: QuantSpec, g) -> QuantSpec:
    if spec.granularity == g:
        return spec
    return dataclasses.replace(spec, granularity=g)

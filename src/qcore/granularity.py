"""Granularity: which elements share one scale, as one value.

Every granularity is a *tile*: an extent per axis (the whole axis, 1, or a size). Scales have the input's
number of dimensions, each axis ``ceil(n / tile)`` long:

============================== ============================= ======================================
value                          tile over x of shape (M, K)   scale shape
============================== ============================= ======================================
``PerTensor()``                (M, K)                        (1, 1)
``PerChannel(axis=0)``         (1, K)                        (M, 1)
``PerGroup(32, axis=-1)``      (1, 32)                       (M, ceil(K / 32))
``PerBlock((128, 128))``       (128, 128) on the last 2 axes (ceil(M/128), ceil(K/128))
============================== ============================= ======================================

A last group or block that does not divide the axis evenly is a short group: it is padded internally with
zeros (which change no absmax, no quantization error, and no scale: asymmetric ranges always include 0; the
true block min/max in ``qcore.stats`` masks the padding instead) and the padding is dropped from every result. Quark raises on hidden size 576 with group 128; qcore gives 5 groups, the last
one of 64.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Sequence, Union

from ._typing import Array

__all__ = ["PerTensor", "PerChannel", "PerGroup", "PerBlock", "Granularity", "tile_shape", "Blocked",
           "to_blocks", "from_blocks", "check_granularity"]


def as_int(v: Any) -> Any:
    """``v`` as a Python int if it is an integer (numpy integers included, bools excluded), else ``v`` unchanged
    (the validators below then name it in their error)."""
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return int(v)
    return v


@dataclass(frozen=True)
class PerTensor:
    """One scale for the whole tensor."""


@dataclass(frozen=True)
class PerChannel:
    """One scale per index along ``axis`` (e.g. per output channel: axis 0 of a Linear weight). ``axis`` may be
    a numpy integer; it is stored as an int."""

    axis: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", as_int(self.axis))


@dataclass(frozen=True)
class PerGroup:
    """One scale per ``size`` consecutive elements along ``axis`` (per index of every other axis). Numpy
    integers are accepted and stored as ints."""

    size: int
    axis: int = -1

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", as_int(self.size))
        object.__setattr__(self, "axis", as_int(self.axis))


@dataclass(frozen=True)
class PerBlock:
    """One scale per tile of ``shape`` over ``axes`` (default: the last ``len(shape)`` axes). ``shape`` and
    ``axes`` are stored as tuples of ints (numpy integers accepted)."""

    shape: tuple[int, ...]
    axes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.shape, (tuple, list)):
            object.__setattr__(self, "shape", tuple(as_int(s) for s in self.shape))
        if isinstance(self.axes, (tuple, list)):
            object.__setattr__(self, "axes", tuple(as_int(a) for a in self.axes))


Granularity = Union[PerTensor, PerChannel, PerGroup, PerBlock]


def _norm_axis(axis: Any, ndim: int, what: str) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"{what}: axis must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}: axis {axis} is out of range for an array of {ndim} dimensions")
    return axis % ndim


def check_granularity(g: object) -> Granularity:
    """Validate a granularity value without an array (sizes positive, types right)."""
    if isinstance(g, PerTensor):
        return g
    if isinstance(g, PerChannel):
        if isinstance(g.axis, bool) or not isinstance(g.axis, int):
            raise TypeError(f"PerChannel axis must be an int, got {g.axis!r}")
        return g
    if isinstance(g, PerGroup):
        if isinstance(g.size, bool) or not isinstance(g.size, int) or g.size <= 0:
            raise ValueError(f"PerGroup size must be a positive int, got {g.size!r}")
        if isinstance(g.axis, bool) or not isinstance(g.axis, int):
            raise TypeError(f"PerGroup axis must be an int, got {g.axis!r}")
        return g
    if isinstance(g, PerBlock):
        shape = tuple(g.shape)
        if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in shape):
            raise ValueError(f"PerBlock shape must be a non-empty tuple of positive ints, got {g.shape!r}")
        if g.axes is not None and len(tuple(g.axes)) != len(shape):
            raise ValueError(f"PerBlock axes {g.axes!r} must have one entry per block dimension {shape!r}")
        return g
    raise TypeError(f"granularity must be PerTensor, PerChannel, PerGroup or PerBlock, got {g!r}")


def tile_shape(g: Granularity, shape: Sequence[int]) -> tuple[int, ...]:
    """The tile extent along each axis of an array of ``shape`` (see the module table)."""
    check_granularity(g)
    shape = tuple(int(s) for s in shape)
    nd = len(shape)
    if isinstance(g, PerTensor):
        return tuple(max(s, 1) for s in shape)
    if nd == 0:
        raise ValueError(f"{type(g).__name__} needs an array with at least one dimension, got a scalar")
    if isinstance(g, PerChannel):
        a = _norm_axis(g.axis, nd, "PerChannel")
        return tuple(1 if i == a else max(s, 1) for i, s in enumerate(shape))
    if isinstance(g, PerGroup):
        a = _norm_axis(g.axis, nd, "PerGroup")
        return tuple(g.size if i == a else 1 for i in range(nd))
    bshape = tuple(g.shape)
    axes = tuple(g.axes) if g.axes is not None else tuple(range(nd - len(bshape), nd))
    if len(bshape) > nd:
        raise ValueError(f"PerBlock shape {bshape} has more dimensions than the array ({nd})")
    axes = tuple(_norm_axis(a, nd, "PerBlock") for a in axes)
    if len(set(axes)) != len(axes):
        raise ValueError(f"PerBlock axes {g.axes!r} repeat an axis")
    tile = [1] * nd
    for a, b in zip(axes, bshape):
        tile[a] = b
    return tuple(tile)


def scale_shape(g: Granularity, shape: Sequence[int]) -> tuple[int, ...]:
    """Shape of the scale array for an input of ``shape``."""
    tile = tile_shape(g, shape)
    return tuple(-(-int(s) // t) if s else 0 for s, t in zip(shape, tile))


@dataclass(frozen=True)
class Blocked:
    """How an array was reshaped into tiles: ``(n0, t0, n1, t1, ...)``; reduce over the odd axes."""

    shape: tuple[int, ...]  # original shape
    tile: tuple[int, ...]
    padded: tuple[int, ...]  # padded shape (multiples of tile)

    @property
    def blocked_shape(self) -> tuple[int, ...]:
        out: list[int] = []
        for p, t in zip(self.padded, self.tile):
            out += [p // t, t]
        return tuple(out)

    @property
    def reduce_axes(self) -> tuple[int, ...]:
        return tuple(range(1, 2 * len(self.shape), 2))

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return tuple(p // t for p, t in zip(self.padded, self.tile))

    @property
    def scale_blocked_shape(self) -> tuple[int, ...]:
        out: list[int] = []
        for p, t in zip(self.padded, self.tile):
            out += [p // t, 1]
        return tuple(out)


def to_blocks(x: Array, g: Granularity, o: Any, fill: float = 0) -> tuple[Array, Blocked]:
    """Pad ``x`` to whole tiles with ``fill`` (default 0; statistics that must ignore the padding pass +-inf)
    and reshape to ``(n0, t0, n1, t1, ...)``; returns (xb, Blocked)."""
    shape = tuple(x.shape)
    tile = tile_shape(g, shape)
    padded = tuple(-(-s // t) * t if s else 0 for s, t in zip(shape, tile))
    for a, (s, p) in enumerate(zip(shape, padded)):
        if p != s:
            x = o.pad_axis(x, a, p - s, fill)
    b = Blocked(shape, tile, padded)
    return o.reshape(x, b.blocked_shape), b


def from_blocks(xb: Array, b: Blocked, o: Any) -> Array:
    """Inverse of ``to_blocks``: reshape back and drop the padding."""
    x = o.reshape(xb, b.padded)
    for a, (s, p) in enumerate(zip(b.shape, b.padded)):
        if p != s:
            x = o.slice_axis(x, a, s)
    return x


def scales_to_blocked(s: Array, b: Blocked, o: Any) -> Array:
    """Scale array of shape ``b.scale_shape`` -> broadcastable against the blocked array."""
    return o.reshape(s, b.scale_blocked_shape)

"""argparse value types shared by the command lines (``qcore.cli`` and ``qcore.adapters.cli``): each raises
``argparse.ArgumentTypeError`` so that argparse's error names the flag."""

from __future__ import annotations

import argparse
import math

__all__ = ["_csv", "_positive_number", "_nonnegative_number", "_count", "_positive"]


def _csv(text: str) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of names, got {text!r}")
    return items


def _number(text: str, *, positive: bool) -> float:
    """A finite float (argparse type): positive, or non-negative when ``positive`` is False."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise argparse.ArgumentTypeError(f"must be a {'positive' if positive else 'non-negative'} finite number, "
                                         f"got {text!r}")
    return v


def _positive_number(text: str) -> float:
    return _number(text, positive=True)


def _nonnegative_number(text: str) -> float:
    return _number(text, positive=False)


def _count(text: str) -> int:
    """A non-negative int (argparse type), so that range errors name the flag, not a Python argument."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative int, got {v}")
    return v


def _positive(text: str) -> int:
    v = _count(text)
    if v == 0:
        raise argparse.ArgumentTypeError("must be a positive int, got 0")
    return v

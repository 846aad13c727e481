"""argparse value types shared by the command lines (``qcore.cli`` and ``qcore.adapters.cli``): each raises
``argparse.ArgumentTypeError`` so that argparse's error names the flag."""

from __future__ import annotations

import argparse
import math

__all__ = ["comma_list", "positive_number", "nonnegative_number", "nonnegative_int", "positive_int"]


def comma_list(text: str) -> list:
    """A non-empty comma-separated list of names (argparse type)."""
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


def positive_number(text: str) -> float:
    """A positive finite float (argparse type)."""
    return _number(text, positive=True)


def nonnegative_number(text: str) -> float:
    """A non-negative finite float (argparse type)."""
    return _number(text, positive=False)


def nonnegative_int(text: str) -> int:
    """A non-negative int (argparse type), so that range errors name the flag, not a Python argument."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative int, got {v}")
    return v


def positive_int(text: str) -> int:
    """A positive int (argparse type)."""
    v = nonnegative_int(text)
    if v == 0:
        raise argparse.ArgumentTypeError("must be a positive int, got 0")
    return v

"""What the command lines (``qcore.cli`` and ``qcore.adapters.cli``) share: argparse value types, each raising
``argparse.ArgumentTypeError`` so that argparse's error names the flag; and ``Needs`` / ``check_needs``, the context
in which an option has an effect, as data, and the one check that refuses an option given where it has none (an
option accepted and ignored is a silent wrong answer: the user believes it did something)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Mapping, Union

__all__ = ["nonempty", "comma_list", "positive_number", "nonnegative_number", "nonnegative_int", "positive_int", "Needs",
           "check_needs"]


@dataclass(frozen=True)
class Needs:
    """Option ``option`` (a parser's ``dest`` or a job's argument name) has an effect only where ``when(options)``
    holds; given anywhere else it is refused with ``why``: a phrase following the option as the user gave it
    (``--no-cache`` + ``"applies to perplexity; --eval none measures none"``), or a function of ``(names,
    options)`` returning it (``names``: whatever the caller passes to ``check_needs``, e.g. a job's ``Names``)."""

    option: str
    when: Callable[[Mapping[str, Any]], bool]
    why: Union[str, Callable[[Any, Mapping[str, Any]], str]]


def check_needs(needs: Iterable[Needs], options: Mapping[str, Any], *, given: Collection[str],
                show: Callable[[str, Any], str], names: Any = None, error: type = ValueError) -> None:
    """Refuse (``error``, a ValueError by default; one line) the first option of ``given`` whose ``Needs`` entry in ``needs`` does not hold
    for ``options``; ``show(option, value)``: the option as the user gave it (``--seq-len 64``, ``seq_len=64``).
    Options not given (defaults) are never refused."""
    for n in needs:
        if n.option in given and not n.when(options):
            why = n.why if isinstance(n.why, str) else n.why(names, options)
            raise error(f"{show(n.option, options[n.option])} {why}")


def nonempty(text: str) -> str:
    """A non-empty string (argparse type): an empty path would mean the working directory (``qcore conformance
    export '' --overwrite`` would replace it)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty value, got ''")
    return text


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

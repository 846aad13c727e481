"""Type aliases for qcore's annotations (no runtime behaviour).

torch is optional and never imported by qcore for numpy work, so array arguments are annotated ``Array`` (to a
type checker ``Any``): a ``numpy.ndarray`` or a ``torch.Tensor``, returned as the same kind on the same device.
``ArrayLike`` also admits what ``numpy.asarray`` accepts (Python numbers, lists).
"""

from typing import TYPE_CHECKING, Any, Union

Array = Any
"""A ``numpy.ndarray`` or a ``torch.Tensor``."""

ArrayLike = Any
"""An ``Array`` or anything ``numpy.asarray`` accepts."""

if TYPE_CHECKING:
    from .dtypes import BlockDType, FloatDType, IntDType
    from .quantize import QuantSpec

FormatLike = Union[str, "IntDType", "FloatDType", "BlockDType"]
"""A format name from ``qcore.DTYPES`` (or an alias) or a dtype object."""

SpecLike = Union[str, "IntDType", "FloatDType", "BlockDType", "QuantSpec"]
"""A ``QuantSpec``, or a format whose default spec ``qcore.make_spec`` builds."""

KeyLike = Any
"""A stochastic-rounding key: a non-negative int below 2**63, a ``numpy.random.Generator`` or a
``torch.Generator`` (or None where no key is needed)."""

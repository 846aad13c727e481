"""``qcore.testing``: the kernel-test oracle kit.

Kernel engineers (HIP, CUDA, Triton, C++) check a kernel against qcore's numpy oracle in a few lines::

    import numpy as np, torch
    from qcore.testing import Op, assert_matches_oracle, probes, probes_by_kind

    x = probes("mxfp4")                                  # 2-D float32 probe blocks (ragged last group)
    out = my_mxfp4_fake_quant_kernel(torch.from_numpy(x).cuda())
    assert_matches_oracle(out, x, "mxfp4", op=Op.FAKE_QUANTIZE, kinds=probes_by_kind("mxfp4"))

- ``probes(fmt)`` / ``probes_by_kind(fmt)``: the inputs on which kernels go wrong (every code and its
  neighbours, ties, subnormals, saturation edges, Inf/NaN, zero and one-outlier blocks, scale-rule boundaries,
  random bit patterns, ragged last groups); ``help(probes)`` lists every kind.
- ``assert_matches_oracle(actual, x, fmt, op=Op...)``: compute qcore's result on host numpy and compare bit for
  bit (or within ``ulps``); the ``AssertionError`` names the first mismatches with their inputs, both outputs,
  their bits, the probe kind and the block's scale (E8M0 byte) and amax. ``check_against_oracle`` returns the
  ``Report`` instead of raising; ``reference`` returns the oracle's output.
- ``compare`` / ``assert_equal``: the same comparison of two arrays, without an oracle.
- ``formats(kind)``: format names for ``pytest.mark.parametrize``.
- pytest: the ``qcore_oracle`` fixture (``qcore.testing.pytest_plugin``; auto-loaded through the ``pytest11``
  entry point, or ``pytest_plugins = ["qcore.testing.pytest_plugin"]`` in a top-level conftest).

numpy only: nothing here imports torch; torch tensors (any device) are read with ``.detach().cpu()``.
"""

from __future__ import annotations

import enum

from ..dtypes import DTYPES, BlockDType
from .compare import BlockInfo, Mismatch, Report, assert_equal, compare, ulp_distance
from .oracle import Op, assert_matches_oracle, check_against_oracle, reference
from .probes import BLOCK_KINDS, ELEMENT_KINDS, probes, probes_by_kind

__all__ = [
    "probes", "probes_by_kind", "ELEMENT_KINDS", "BLOCK_KINDS",
    "compare", "assert_equal", "Report", "Mismatch", "BlockInfo", "ulp_distance",
    "Op", "assert_matches_oracle", "check_against_oracle", "reference",
    "FormatKind", "formats",
]


class FormatKind(enum.Enum):
    """Which format names ``formats`` lists."""

    ELEMENT = "element"
    BLOCK = "block"
    ALL = "all"


def formats(kind: FormatKind | str = "all", *, max_bits: int | None = None) -> list[str]:
    """Canonical names from ``qcore.DTYPES`` for parametrizing kernel tests, sorted.

    ``kind``: a ``FormatKind`` or its value ``"element"`` (every ``FloatDType`` and ``IntDType``), ``"block"``
    (every ``BlockDType``) or ``"all"``. ``max_bits``: keep element formats of at most this many bits (block
    formats are kept by their element's width).
    """
    try:
        k = kind if isinstance(kind, FormatKind) else FormatKind(kind)
    except ValueError:
        raise ValueError(f"kind must be a FormatKind or one of 'element', 'block', 'all'; got {kind!r}") from None
    if max_bits is not None and (isinstance(max_bits, bool) or not isinstance(max_bits, int) or max_bits < 1):
        raise ValueError(f"max_bits must be a positive int or None, got {max_bits!r}")
    out = []
    for name, d in DTYPES.items():
        is_block = isinstance(d, BlockDType)
        if k is FormatKind.ELEMENT and is_block or k is FormatKind.BLOCK and not is_block:
            continue
        el = d.element if isinstance(d, BlockDType) else d
        if max_bits is not None and el.bits > max_bits:
            continue
        out.append(name)
    return sorted(out)

"""QuantSpec.bits_per_element: the one rule for storage bits per element (element + microexponent + amortised
scales and zero points + a two-level tensor scale), checked against the byte counts the formats imply."""

import pytest

import qcore
from qcore import PerBlock, PerChannel, PerGroup, PerTensor


@pytest.mark.parametrize("fmt, bits", [("mxfp4", 4.25), ("mxfp6_e2m3", 6.25), ("mxfp8_e4m3", 8.25),
                                        ("mxint8", 8.25), ("mx9", 9.0), ("mx6", 6.0), ("nvfp4", 4.5)])
def test_block_formats_agree_with_their_dtype(fmt, bits):
    spec = qcore.make_spec(fmt, axis=1)
    assert spec.bits_per_element() == bits == qcore.get_dtype(fmt).bits_per_element
    if fmt == "nvfp4":  # + the float32 per-tensor scale once the shape is known
        assert spec.bits_per_element((16, 64)) == 4.5 + 32 / 1024
    else:
        assert spec.bits_per_element((16, 64)) == bits


def test_scales_amortised_by_shape():
    fp8 = qcore.make_spec("float8_e4m3fn")
    assert fp8.bits_per_element() == 8.0 and fp8.bits_per_element((576, 576)) == 8 + 32 / (576 * 576)
    ch = qcore.make_spec("int8", granularity=PerChannel(0))
    assert ch.bits_per_element((10, 20)) == 8 + 32 / 20
    u4 = qcore.make_spec("uint4", granularity=PerGroup(64, 1))  # asymmetric: a 4-bit zero point per group
    assert u4.bits_per_element() == 4 + 36 / 64 == u4.bits_per_element((8, 128))
    assert u4.bits_per_element((8, 96)) == 4 + 2 * 36 / 96  # a short last group still holds a scale
    blk = qcore.make_spec("int4", granularity=PerBlock((4, 8)))
    assert blk.bits_per_element() == 4 + 1 and blk.bits_per_element((8, 16)) == 5
    assert qcore.make_spec("int4", granularity=PerTensor()).bits_per_element((2, 2)) == 4 + 8


def test_bad_shape():
    with pytest.raises(ValueError, match="bits_per_element: shape must be a non-empty tuple of positive ints"):
        qcore.make_spec("mxfp4", axis=1).bits_per_element((0, 32))

"""Packing round trips: ``unpack_*(pack_*(c), length=n) == c`` for random codes, shapes and axes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcore.packing import (
    Int4Order,
    pack_bits,
    pack_fp4,
    pack_fp6,
    pack_gguf_q4,
    pack_int4_int32,
    unpack_bits,
    unpack_fp4,
    unpack_fp6,
    unpack_gguf_q4,
    unpack_int4_int32,
)

from ._util import examples


@st.composite
def _codes(draw, lo, hi, dtype, *, multiple=1, max_len=40):
    """(codes, axis): an array of 1..3 dims with values in [lo, hi]; the packed axis length is a multiple of
    ``multiple``."""
    nd = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 4)) for _ in range(nd)]
    axis = draw(st.integers(-nd, nd - 1))
    shape[axis] = multiple * draw(st.integers(1, max(1, max_len // multiple)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    c = rng.integers(lo, hi + 1, size=shape).astype(dtype)
    # make sure the extremes of the range occur
    flat = c.reshape(-1)
    flat[0] = lo
    flat[-1] = hi
    return c, axis


def _packed_len(n, bits):
    import math

    span = bits * 8 // math.gcd(bits, 8)
    return -(-n // (span // bits)) * (span // 8)


@pytest.mark.parametrize("bits", range(1, 9))
@given(data=st.data(), signed=st.booleans())
@settings(max_examples=examples(0.1))
def test_pack_bits_round_trip(bits, data, signed):
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    c, axis = data.draw(_codes(lo, hi, np.int8 if signed else np.uint8))
    n = c.shape[axis]
    p = pack_bits(c, bits, axis=axis, signed=signed)
    assert p.dtype == np.uint8 and p.shape[axis] == _packed_len(n, bits)
    back = unpack_bits(p, bits, axis=axis, length=n, signed=signed)
    assert back.dtype == (np.int8 if signed else np.uint8)
    assert np.array_equal(back, c)


@given(data=st.data())
@settings(max_examples=examples(0.25))
def test_fp4_and_fp6_round_trip(data):
    c4, ax4 = data.draw(_codes(0, 15, np.uint8))
    n = c4.shape[ax4]
    assert np.array_equal(unpack_fp4(pack_fp4(c4, axis=ax4), axis=ax4, length=n), c4)
    assert np.array_equal(pack_fp4(c4, axis=ax4), pack_bits(c4, 4, axis=ax4))
    c6, ax6 = data.draw(_codes(0, 63, np.uint8))
    n = c6.shape[ax6]
    p6 = pack_fp6(c6, axis=ax6)
    assert p6.shape[ax6] == _packed_len(n, 6)
    assert np.array_equal(unpack_fp6(p6, axis=ax6, length=n), c6)


@pytest.mark.parametrize("order", list(Int4Order), ids=lambda o: o.name)
@given(data=st.data(), signed=st.booleans())
@settings(max_examples=examples(0.25))
def test_int4_int32_round_trip(order, data, signed):
    lo, hi = (-8, 7) if signed else (0, 15)
    c, axis = data.draw(_codes(lo, hi, np.int8 if signed else np.uint8))
    n = c.shape[axis]
    p = pack_int4_int32(c, order=order, axis=axis, signed=signed)
    assert p.dtype == np.int32 and p.shape[axis] == -(-n // 8)
    back = unpack_int4_int32(p, order=order, axis=axis, length=n, signed=signed)
    assert np.array_equal(back, c)
    # ORDER is the 4-bit little-endian stream read as int32 words
    if order is Int4Order.ORDER:
        stream = np.moveaxis(pack_bits(c, 4, axis=axis), axis, -1)
        stream = np.pad(stream, [(0, 0)] * (stream.ndim - 1) + [(0, (-stream.shape[-1]) % 4)])
        words = np.ascontiguousarray(stream).view("<i4")
        assert np.array_equal(np.moveaxis(p, axis, -1), words)


@given(data=st.data())
@settings(max_examples=examples(0.25))
def test_gguf_q4_round_trip(data):
    c, axis = data.draw(_codes(0, 15, np.uint8, multiple=32, max_len=96))
    p = pack_gguf_q4(c, axis=axis)
    assert p.dtype == np.uint8 and p.shape[axis] == c.shape[axis] // 2
    assert np.array_equal(unpack_gguf_q4(p, axis=axis), c)


@given(data=st.data(), bits=st.integers(1, 8))
@settings(max_examples=examples(0.1))
def test_packing_numpy_equals_torch(data, bits):
    torch = pytest.importorskip("torch")
    c, axis = data.draw(_codes(0, (1 << bits) - 1, np.uint8))
    t = torch.from_numpy(c.copy())
    assert np.array_equal(pack_bits(t, bits, axis=axis).numpy(), pack_bits(c, bits, axis=axis))
    c4, ax4 = data.draw(_codes(-8, 7, np.int8))
    for order in Int4Order:
        a = pack_int4_int32(c4, order=order, axis=ax4)
        b = pack_int4_int32(torch.from_numpy(c4.copy()), order=order, axis=ax4)
        assert np.array_equal(b.numpy(), a)
        n = c4.shape[ax4]
        assert np.array_equal(unpack_int4_int32(b, order=order, axis=ax4, length=n).numpy(), c4)

"""Tests for qcore.packing: byte layouts (named vectors), exact round trips, numpy/torch bit identity, errors.

numpy tests never import torch; torch tests import it with ``pytest.importorskip`` inside the test.
Independent references are written here with Python ints (a dense little-endian bitstream), not with qcore.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import qcore
from qcore.packing import (
    Int4Order,
    default_layout,
    pack,
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
    unpack,
)

ALL_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


# ---------------------------------------------------------------------------------------------------------------
# independent reference: a dense LSB-first bitstream built from Python ints
# ---------------------------------------------------------------------------------------------------------------


def ref_stream(values, bits):
    """Element i at stream bits [i*bits, (i+1)*bits), bytes little-endian, padded to whole lcm(bits, 8) groups."""
    mask = (1 << bits) - 1
    acc = 0
    for i, v in enumerate(values):
        acc |= (int(v) & mask) << (i * bits)
    span = bits * 8 // math.gcd(bits, 8)
    n_el, n_by = span // bits, span // 8
    nbytes = -(-len(values) // n_el) * n_by
    return np.frombuffer(acc.to_bytes(nbytes, "little"), dtype=np.uint8)


def all_codes(bits, signed):
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    return np.arange(lo, hi + 1, dtype=np.int8 if signed else np.uint8)


# ---------------------------------------------------------------------------------------------------------------
# fp4
# ---------------------------------------------------------------------------------------------------------------


def test_fp4_named_vector():
    # OCP e2m1 codes: 0.5 = 0x1, 1.0 = 0x2, 1.5 = 0x3, -6.0 = 0xF. Element 2i is the low nibble (torchao / Quark):
    # bytes 0x21 (1.0 high | 0.5 low), 0xF3 (-6.0 high | 1.5 low).
    packed = pack_fp4(np.array([0x1, 0x2, 0x3, 0xF], dtype=np.uint8))
    assert packed.dtype == np.uint8
    assert packed.tolist() == [0x21, 0xF3]
    assert unpack_fp4(packed).tolist() == [0x1, 0x2, 0x3, 0xF]


def test_fp4_exhaustive_every_byte():
    # Every (low, high) pair of codes: pair (b & 0xF, b >> 4) must pack to byte b, for all 256 bytes.
    b = np.arange(256)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(-1).astype(np.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == list(range(256))
    np.testing.assert_array_equal(unpack_fp4(packed), codes)
    assert unpack_fp4(packed).dtype == np.uint8


def test_fp4_equals_pack_bits_4():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(5, 37), dtype=np.uint8)
    np.testing.assert_array_equal(pack_fp4(codes), pack_bits(codes, 4))
    np.testing.assert_array_equal(unpack_fp4(pack_fp4(codes), length=37), unpack_bits(pack_bits(codes, 4), 4, length=37))


def test_fp4_odd_length_pads_with_zero():
    # [0x7, 0x9, 0x5] -> 0x97, then 0x5 alone with a zero high nibble -> 0x05.
    packed = pack_fp4(np.array([0x7, 0x9, 0x5], dtype=np.uint8))
    assert packed.tolist() == [0x97, 0x05]
    assert unpack_fp4(packed).tolist() == [0x7, 0x9, 0x5, 0x0]
    assert unpack_fp4(packed, length=3).tolist() == [0x7, 0x9, 0x5]


# ---------------------------------------------------------------------------------------------------------------
# generic bit packing
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("signed", [False, True])
def test_pack_bits_exhaustive_round_trip_and_reference(bits, signed):
    codes = all_codes(bits, signed)
    span = bits * 8 // math.gcd(bits, 8)
    n_el = span // bits
    # Every code at every position of a group (rotations), plus ragged tails of every length.
    seq = np.concatenate([np.roll(codes, k) for k in range(n_el)])
    for n in sorted({*range(min(2 * n_el + 2, len(seq) + 1)), len(seq)}):
        x = seq[:n]
        packed = pack_bits(x, bits)
        assert packed.dtype == np.uint8
        np.testing.assert_array_equal(packed, ref_stream(x.tolist(), bits), err_msg=f"bits={bits} n={n}")
        back = unpack_bits(packed, bits, length=n, signed=signed)
        assert back.dtype == (np.int8 if signed else np.uint8)
        np.testing.assert_array_equal(back, x)


@pytest.mark.parametrize("bits", (1, 2, 4))
def test_pack_bits_small_widths_lsb_first_within_byte(bits):
    # For widths dividing 8, element j of a byte's group sits at bit offset j*bits.
    per = 8 // bits
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, size=per * 9, dtype=np.uint8)
    expect = [sum(int(c) << (j * bits) for j, c in enumerate(codes[i : i + per])) for i in range(0, len(codes), per)]
    assert pack_bits(codes, bits).tolist() == expect


def test_pack_bits_named_vectors():
    # 1 bit: [1,0,1,1,0,0,0,1] -> 0b10001101 = 0x8D (element 0 is bit 0).
    assert pack_bits(np.array([1, 0, 1, 1, 0, 0, 0, 1], dtype=np.uint8), 1).tolist() == [0x8D]
    # 2 bit: [3,0,1,2] -> 3 | 0<<2 | 1<<4 | 2<<6 = 0x93.
    assert pack_bits(np.array([3, 0, 1, 2], dtype=np.uint8), 2).tolist() == [0x93]
    # int2 signed [-2,-1,0,1] -> fields 2,3,0,1 -> 2 | 3<<2 | 0<<4 | 1<<6 = 0x4E.
    assert pack_bits(np.array([-2, -1, 0, 1], dtype=np.int8), 2).tolist() == [0x4E]
    assert unpack_bits(np.array([0x4E], dtype=np.uint8), 2, signed=True).tolist() == [-2, -1, 0, 1]
    # 3 bit: values 0..7 -> stream 0o76543210 (octal digit i = element i) = 0xFAC688 -> bytes 88 C6 FA.
    assert pack_bits(np.arange(8, dtype=np.uint8), 3).tolist() == [0x88, 0xC6, 0xFA]
    # int4 signed [-8, 7] -> 0x8 low, 0x7 high = 0x78.
    assert pack_bits(np.array([-8, 7], dtype=np.int8), 4).tolist() == [0x78]
    # 8 bit: int8 -1 -> 0xFF (two's complement byte).
    assert pack_bits(np.array([-1, 5], dtype=np.int8), 8).tolist() == [0xFF, 0x05]


def test_pack_bits_group_sizes():
    # lcm(bits, 8) groups: 3/5/7 bits take 8 elements to 3/5/7 bytes, 6 bits 4 elements to 3 bytes.
    for bits, (n_el, n_by) in {1: (8, 1), 2: (4, 1), 3: (8, 3), 4: (2, 1), 5: (8, 5), 6: (4, 3), 7: (8, 7), 8: (1, 1)}.items():
        assert pack_bits(np.zeros(n_el, np.uint8), bits).shape == (n_by,)
        assert pack_bits(np.zeros(n_el + 1, np.uint8), bits).shape == (2 * n_by,)
        assert unpack_bits(np.zeros(2 * n_by, np.uint8), bits).shape == (2 * n_el,)


def test_signed_none_accepts_both_readings():
    # With signed=None (default) -1 and 15 are both the nibble 0xF.
    assert pack_bits(np.array([-1, 15]), 4).tolist() == [0xFF]
    with pytest.raises(ValueError, match="codes"):
        pack_bits(np.array([15]), 4, signed=True)
    with pytest.raises(ValueError, match="codes"):
        pack_bits(np.array([-1]), 4, signed=False)


def test_list_input_and_int64():
    assert pack_bits([1, 2, 3, 15], 4).tolist() == [0x21, 0xF3]
    assert pack_fp4(np.array([1, 2, 3, 15], dtype=np.int64)).tolist() == [0x21, 0xF3]


def test_unpack_reads_int8_bytes_bitwise():
    # A packed buffer stored as int8 (-1 = 0xFF) is read bit for bit.
    assert unpack_fp4(np.array([-1, 0x21], dtype=np.int8)).tolist() == [15, 15, 1, 2]


# ---------------------------------------------------------------------------------------------------------------
# fp6
# ---------------------------------------------------------------------------------------------------------------


def test_fp6_named_vectors():
    # [1, 2, 3, 4]: byte0 = 1 | (2 & 3) << 6 = 0x81; byte1 = 2 >> 2 | (3 & 0xF) << 4 = 0x30; byte2 = 3 >> 4 | 4 << 2 = 0x10.
    assert pack_fp6(np.array([1, 2, 3, 4], dtype=np.uint8)).tolist() == [0x81, 0x30, 0x10]
    # [0x3F, 0x01, 0x2A, 0x15]: byte0 = 0x3F | 1 << 6 = 0x7F; byte1 = 0 | 0xA << 4 = 0xA0; byte2 = 0x2 | 0x15 << 2 = 0x56.
    packed = pack_fp6(np.array([0x3F, 0x01, 0x2A, 0x15], dtype=np.uint8))
    assert packed.tolist() == [0x7F, 0xA0, 0x56]
    assert unpack_fp6(packed).tolist() == [0x3F, 0x01, 0x2A, 0x15]


def test_fp6_exhaustive_quark_formula_and_bitstream():
    # Every value in every slot: rows (a, b, a, b) and (b, a, b, a) over all 64 x 64 pairs.
    a, b = np.meshgrid(np.arange(64), np.arange(64), indexing="ij")
    a, b = a.reshape(-1), b.reshape(-1)
    v = np.concatenate([np.stack([a, b, a, b], -1), np.stack([b, a, b, a], -1)]).astype(np.uint8)
    packed = pack_fp6(v)  # (8192, 3), packed along the last axis row by row
    assert packed.shape == (8192, 3) and packed.dtype == np.uint8
    v0, v1, v2, v3 = (v[:, i].astype(np.int64) for i in range(4))
    quark = np.stack([v0 | (v1 & 3) << 6, (v1 >> 2) | (v2 & 0xF) << 4, (v2 >> 4) | v3 << 2], -1) & 0xFF
    np.testing.assert_array_equal(packed, quark)
    np.testing.assert_array_equal(pack_fp6(v.reshape(-1)), ref_stream(v.reshape(-1).tolist(), 6))
    np.testing.assert_array_equal(unpack_fp6(packed), v)


def test_fp6_ragged_length():
    x = np.array([63, 1, 2, 3, 4, 5], dtype=np.uint8)
    packed = pack_fp6(x)
    assert packed.shape == (6,)  # padded to 8 values -> 6 bytes
    np.testing.assert_array_equal(packed, ref_stream(x.tolist() + [0, 0], 6))
    np.testing.assert_array_equal(unpack_fp6(packed, length=6), x)
    with pytest.raises(ValueError, match="length"):
        unpack_fp6(packed, length=4)  # 4 values pack to 3 bytes, not 6
    with pytest.raises(ValueError, match="packed"):
        unpack_fp6(packed[:4])  # not whole 3-byte groups


# ---------------------------------------------------------------------------------------------------------------
# int4 in int32
# ---------------------------------------------------------------------------------------------------------------


def test_int4_int32_named_vectors():
    v = np.arange(8, dtype=np.int8)
    # REORDER (AWQ / Quark): slot i holds element [0,2,4,6,1,3,5,7][i] -> nibbles (high to low) 7 5 3 1 6 4 2 0.
    r = pack_int4_int32(v, order=Int4Order.REORDER)
    assert r.dtype == np.int32 and r.shape == (1,)
    assert int(r[0]) == 0x75316420
    # ORDER: slot i holds element i.
    assert int(pack_int4_int32(v, order=Int4Order.ORDER)[0]) == 0x76543210
    # Signed: [-8,-1,0,1,2,3,4,7] ORDER -> nibbles 8 F 0 1 2 3 4 7 -> 0x743210F8.
    s = np.array([-8, -1, 0, 1, 2, 3, 4, 7], dtype=np.int8)
    assert int(pack_int4_int32(s, order=Int4Order.ORDER)[0]) == 0x743210F8
    # Slot 7 is the int32 sign bit: element 7 = -1 (nibble 0xF) in ORDER -> 0xF0000000 = -268435456 as int32.
    t = np.array([0] * 7 + [-1], dtype=np.int8)
    assert int(pack_int4_int32(t, order=Int4Order.ORDER)[0]) == -268435456
    assert unpack_int4_int32(np.array([-268435456], np.int32), order=Int4Order.ORDER).tolist() == [0] * 7 + [-1]
    assert unpack_int4_int32(np.array([0x75316420], np.int32), order=Int4Order.REORDER).tolist() == list(range(8))


@pytest.mark.parametrize("order", list(Int4Order))
@pytest.mark.parametrize("signed", [True, False])
def test_int4_int32_exhaustive_round_trip(order, signed):
    codes = all_codes(4, signed)
    # every value in every slot: 16 rotations of a 16-cycle, 2 groups of 8 each
    v = np.stack([np.roll(codes, k) for k in range(16)])  # (16, 16)
    packed = pack_int4_int32(v, order=order)
    assert packed.shape == (16, 2) and packed.dtype == np.int32
    back = unpack_int4_int32(packed, order=order, signed=signed)
    assert back.dtype == (np.int8 if signed else np.uint8)
    np.testing.assert_array_equal(back, v)


def test_int4_int32_cross_checks():
    rng = np.random.default_rng(1)
    v = rng.integers(-8, 8, size=(3, 40), dtype=np.int8)
    # ORDER is the 4-bit LSB-first byte stream read as little-endian int32.
    order = pack_int4_int32(v, order=Int4Order.ORDER)
    np.testing.assert_array_equal(order, pack_bits(v, 4).view("<i4"))
    # REORDER is ORDER applied to each group permuted so that slot i gets element [0,2,4,6,1,3,5,7][i].
    perm = np.array([0, 2, 4, 6, 1, 3, 5, 7])
    permuted = v.reshape(3, 5, 8)[..., perm].reshape(3, 40)
    np.testing.assert_array_equal(pack_int4_int32(v, order=Int4Order.REORDER), pack_int4_int32(permuted, order=Int4Order.ORDER))
    # Reference with Python ints, reading words as uint32.
    words = pack_int4_int32(v, order=Int4Order.REORDER).view(np.uint32)
    for r in range(3):
        for g in range(5):
            grp = v[r, 8 * g : 8 * g + 8]
            assert int(words[r, g]) == sum((int(grp[perm[i]]) & 0xF) << (4 * i) for i in range(8))


def test_int4_int32_ragged_and_string_order():
    v = np.array([1, -2, 3], dtype=np.int8)
    packed = pack_int4_int32(v, order="reorder")  # the enum's value string is accepted
    assert int(packed[0]) == (1 | 3 << 4 | 0xE << 16)  # element 0 -> slot 0, 2 -> slot 1, 1 -> slot 4
    np.testing.assert_array_equal(unpack_int4_int32(packed, order=Int4Order.REORDER, length=3), v)
    np.testing.assert_array_equal(unpack_int4_int32(packed.view(np.uint32), order="reorder", length=3), v)


# ---------------------------------------------------------------------------------------------------------------
# GGUF Q4
# ---------------------------------------------------------------------------------------------------------------


def test_gguf_q4_named_vector():
    # Block of 32: c[j] = j % 16 for j < 16 and c[j + 16] = 15 - j. Byte j = c[j] (low) | c[j+16] << 4 (high).
    c = np.array(list(range(16)) + [15 - j for j in range(16)], dtype=np.uint8)
    packed = pack_gguf_q4(c)
    assert packed.shape == (16,) and packed.dtype == np.uint8
    assert packed.tolist() == [j | (15 - j) << 4 for j in range(16)]
    np.testing.assert_array_equal(unpack_gguf_q4(packed), c)


def test_gguf_q4_round_trip_blocks_and_errors():
    rng = np.random.default_rng(2)
    c = rng.integers(0, 16, size=(3, 96), dtype=np.uint8)
    packed = pack_gguf_q4(c)
    assert packed.shape == (3, 48)
    # block 1 byte j holds elements 32 + j and 32 + j + 16
    assert int(packed[0, 16 + 5]) == int(c[0, 37]) | int(c[0, 53]) << 4
    np.testing.assert_array_equal(unpack_gguf_q4(packed), c)
    np.testing.assert_array_equal(pack_gguf_q4(c.T, axis=0), packed.T)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_gguf_q4(np.zeros(48, np.uint8))
    with pytest.raises(ValueError, match="16 bytes"):
        unpack_gguf_q4(np.zeros(8, np.uint8))
    with pytest.raises(ValueError, match="codes"):
        pack_gguf_q4(np.full(32, 16))


def test_gguf_q4_against_gguf_package():
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 128)).astype(np.float32)
    blocks = quantize(x, gguf.GGMLQuantizationType.Q4_0)  # (4, 4 * 18): per block d fp16, qs[16]
    blocks = blocks.reshape(4, 4, 18)
    qs = blocks[..., 2:]
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)  # (4, 4, 1)
    codes = unpack_gguf_q4(qs)  # (4, 4, 32)
    ours = (d * (codes.astype(np.float32) - 8)).reshape(4, 128)
    np.testing.assert_array_equal(ours, dequantize(blocks.reshape(4, 72), gguf.GGMLQuantizationType.Q4_0))
    np.testing.assert_array_equal(pack_gguf_q4(codes), qs)


# ---------------------------------------------------------------------------------------------------------------
# axes, empty arrays
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2, -3])
def test_other_axes_match_moveaxis(axis):
    rng = np.random.default_rng(4)
    x = rng.integers(0, 64, size=(5, 6, 7), dtype=np.uint8)
    n = x.shape[axis]
    want = np.moveaxis(pack_fp6(np.moveaxis(x, axis, -1)), -1, axis)
    got = pack_fp6(x, axis=axis)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(unpack_fp6(got, axis=axis, length=n), x)
    x4 = x & 0xF
    p4 = pack_fp4(x4, axis=axis)
    np.testing.assert_array_equal(p4, np.moveaxis(pack_bits(np.moveaxis(x4, axis, -1), 4), -1, axis))
    np.testing.assert_array_equal(unpack_fp4(p4, axis=axis, length=n), x4)
    s = x4.astype(np.int8) - 8
    w = pack_int4_int32(s, order=Int4Order.REORDER, axis=axis)
    np.testing.assert_array_equal(unpack_int4_int32(w, order=Int4Order.REORDER, axis=axis, length=n), s)
    p3 = pack_bits(s & 7, 3, axis=axis)
    np.testing.assert_array_equal(unpack_bits(p3, 3, axis=axis, length=n), s & 7)


def test_empty_arrays():
    e = np.zeros((3, 0), np.uint8)
    assert pack_fp4(e).shape == (3, 0)
    assert unpack_fp4(pack_fp4(e)).shape == (3, 0)
    assert pack_fp6(e).shape == (3, 0) and unpack_fp6(pack_fp6(e), length=0).shape == (3, 0)
    assert pack_bits(e, 7).shape == (3, 0)
    assert pack_int4_int32(e, order=Int4Order.ORDER).shape == (3, 0)
    assert pack_int4_int32(e, order=Int4Order.ORDER).dtype == np.int32
    assert pack_gguf_q4(e).shape == (3, 0) and unpack_gguf_q4(np.zeros((3, 0), np.uint8)).shape == (3, 0)
    # empty along a non-packed axis keeps that axis
    z = np.zeros((0, 5), np.uint8)
    assert pack_fp4(z).shape == (0, 3)
    assert unpack_fp4(pack_fp4(z), length=5).shape == (0, 5)
    assert pack_fp4(z, axis=0).shape == (0, 5)


# ---------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------


def test_errors():
    u = np.zeros(4, np.uint8)
    with pytest.raises(TypeError, match="codes"):
        pack_fp4(np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="codes"):
        pack_bits(np.zeros(4, bool), 1)
    with pytest.raises(TypeError, match="packed"):
        unpack_fp4(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="codes"):
        pack_fp4(np.array([16], np.uint8))
    with pytest.raises(ValueError, match="codes"):
        pack_fp4(np.array([-1], np.int8))  # fp4 codes are unsigned bit patterns
    with pytest.raises(ValueError, match="codes"):
        pack_fp6(np.array([64]))
    with pytest.raises(ValueError, match="values"):
        pack_int4_int32(np.array([8], np.int8), order=Int4Order.ORDER, signed=True)
    with pytest.raises(ValueError, match="values"):
        pack_int4_int32(np.array([-9]), order=Int4Order.ORDER)
    with pytest.raises(ValueError, match="axis"):
        pack_fp4(u, axis=1)
    with pytest.raises(ValueError, match="axis"):
        unpack_fp4(u, axis=-2)
    with pytest.raises(ValueError, match="axis"):
        pack_fp4(np.uint8(3))  # 0-d has no axis to pack
    with pytest.raises(TypeError, match="axis"):
        pack_fp4(u, axis=0.0)
    for bad in (0, 9, 16):
        with pytest.raises(ValueError, match="bits"):
            pack_bits(u, bad)
        with pytest.raises(ValueError, match="bits"):
            unpack_bits(u, bad)
    with pytest.raises(TypeError, match="bits"):
        pack_bits(u, 4.0)
    with pytest.raises(TypeError, match="signed"):
        unpack_bits(u, 4, signed=None)
    with pytest.raises(ValueError, match="order"):
        pack_int4_int32(u, order="awq")
    with pytest.raises(TypeError, match="order"):
        pack_int4_int32(u, order=1)
    with pytest.raises(TypeError):
        pack_int4_int32(u)  # order is required
    with pytest.raises(TypeError, match="packed"):
        unpack_int4_int32(np.zeros(2, np.int64), order=Int4Order.ORDER)
    with pytest.raises(ValueError, match="length"):
        unpack_fp4(np.zeros(2, np.uint8), length=5)
    with pytest.raises(ValueError, match="length"):
        unpack_fp4(np.zeros(2, np.uint8), length=2)  # 2 values pack to 1 byte, not 2
    with pytest.raises(ValueError, match="length"):
        unpack_bits(np.zeros(3, np.uint8), 3, length=-1)
    with pytest.raises(TypeError, match="length"):
        unpack_fp4(np.zeros(2, np.uint8), length=3.0)
    with pytest.raises(ValueError, match="packed"):
        unpack_bits(np.array([256], np.int64), 8)
    with pytest.raises(ValueError, match="packed"):
        unpack_bits(np.zeros(4, np.uint8), 3)  # 3-bit groups are 3 bytes


# ---------------------------------------------------------------------------------------------------------------
# the default layout of a format (pack / unpack / default_layout): one rule for conformance and qcore.testing
# ---------------------------------------------------------------------------------------------------------------


def _codes_of(d, n=37, seed=0):
    """Random valid codes of element dtype ``d`` in the dtype qcore.encode gives them."""
    rng = np.random.default_rng(seed)
    if isinstance(d, qcore.IntDType):
        dt = (np.int8 if d.signed else np.uint8) if d.bits <= 8 else np.int32
        return rng.integers(d.min, d.max + 1, size=(3, n)).astype(dt)
    return rng.integers(0, 1 << d.bits, size=(3, n)).astype(np.uint8 if d.bits <= 8 else np.int32)


def test_default_layout_is_dense_bits_up_to_8_and_words_above():
    assert (default_layout("float4_e2m1fn").name, default_layout("mxfp6_e3m2").name) == ("fp4", "fp6")
    for name, bits, group in (("mx4", 3, (8, 3)), ("mx6", 5, (8, 5)), ("mx9", 8, (1, 1)), ("int4", 4, (2, 1)),
                              ("uint7", 7, (8, 7)), ("mxint8", 8, (1, 1)), ("int12", 12, (1, 2)),
                              ("bfloat16", 16, (1, 2))):
        lay = default_layout(name)
        assert lay.bits == bits and (lay.group_elements, lay.group_bytes) == group, name
    assert default_layout("mx4").dtype == "float3_e1m1" and not default_layout("mx4").signed
    assert default_layout("int4").signed and not default_layout("uint4").signed
    with pytest.raises(ValueError, match="16 bits or fewer"):
        default_layout("float32")
    with pytest.raises(ValueError, match="unknown dtype"):
        pack(np.zeros(2, np.uint8), "float3")


def test_pack_named_vectors_and_explicit_equivalents():
    # MX4 elements (3 bits): 8 codes -> 3 bytes; MX6 elements (5 bits): 8 codes -> 5 bytes
    assert pack(np.arange(8, dtype=np.uint8), "mx4").tolist() == [0x88, 0xC6, 0xFA]
    assert pack(np.arange(8, dtype=np.uint8), "float5_e1m3").tolist() == ref_stream(list(range(8)), 5).tolist()
    assert pack(np.array([-2048, 2047, -1], np.int32), "int12").tolist() == [0x00, 0xF8, 0xFF, 0x07, 0xFF, 0xFF]
    assert pack(np.array([0x3C00], np.int32), "float16").tolist() == [0x00, 0x3C]
    for name in ("float4_e2m1fn", "float6_e2m3fn", "float3_e1m1", "float5_e1m3", "float8_e4m3fn", "int4", "int8",
                 "uint3"):
        d = qcore.get_dtype(name)
        c = _codes_of(d)
        explicit = {"fp4": lambda: pack_fp4(c), "fp6": lambda: pack_fp6(c)}.get(
            default_layout(d).name, lambda: pack_bits(c, d.bits))()
        np.testing.assert_array_equal(pack(c, d), explicit, err_msg=name)
    with pytest.raises(ValueError, match="outside"):
        pack(np.array([8], np.uint8), "float3_e1m1")
    with pytest.raises(ValueError, match="outside"):
        pack(np.array([-1], np.int8), "float4_e2m1fn")  # float codes are unsigned bit patterns
    with pytest.raises(ValueError, match="outside"):
        pack(np.array([2048], np.int32), "int12")
    with pytest.raises(ValueError, match="outside"):
        unpack(np.array([0xFF, 0x7F], np.uint8), "int12")


@pytest.mark.parametrize("name", [n for n, d in qcore.DTYPES.items()
                                  if not isinstance(d, qcore.BlockDType) and d.bits <= 16])
def test_pack_round_trips_every_format(name):
    d = qcore.get_dtype(name)
    c = _codes_of(d)
    p = pack(c, d)
    lay = default_layout(d)
    assert p.dtype == np.uint8 and p.shape == (3, -(-c.shape[1] // lay.group_elements) * lay.group_bytes)
    back = unpack(p, d, length=c.shape[1])
    assert back.dtype == c.dtype
    np.testing.assert_array_equal(back, c)
    back0 = unpack(pack(c, d, axis=0), d, axis=0, length=3)
    np.testing.assert_array_equal(back0, c)


def test_pack_torch_bit_identical_to_numpy():
    torch = pytest.importorskip("torch")
    for name in ("float3_e1m1", "float5_e1m3", "int4", "int12", "float16", "uint16"):
        d = qcore.get_dtype(name)
        c = _codes_of(d, seed=1)
        p = pack(torch.from_numpy(c), d)
        assert p.dtype == torch.uint8
        np.testing.assert_array_equal(p.numpy(), pack(c, d), err_msg=name)
        u = unpack(p, d, length=c.shape[1])
        assert str(u.dtype).split(".")[-1] == c.dtype.name, name
        np.testing.assert_array_equal(u.numpy(), c, err_msg=name)


def test_numpy_path_does_not_import_torch(numpy_only):
    numpy_only(
        "import numpy as np\n"
        "from qcore import packing as p\n"
        "x = np.arange(16, dtype=np.uint8)\n"
        "p.unpack_fp4(p.pack_fp4(x)); p.unpack_fp6(p.pack_fp6(x)); p.unpack_bits(p.pack_bits(x, 5), 5)\n"
        "p.unpack_int4_int32(p.pack_int4_int32(x, order=p.Int4Order.REORDER), order=p.Int4Order.REORDER)\n"
        "p.unpack_gguf_q4(p.pack_gguf_q4(np.arange(32) % 16))\n"
    )


# ---------------------------------------------------------------------------------------------------------------
# torch: bit-identical to numpy
# ---------------------------------------------------------------------------------------------------------------


def _torch_cases():
    rng = np.random.default_rng(5)
    u4 = rng.integers(0, 16, size=(3, 4, 37), dtype=np.uint8)
    u6 = rng.integers(0, 64, size=(3, 4, 37), dtype=np.uint8)
    s4 = rng.integers(-8, 8, size=(3, 4, 37), dtype=np.int8)
    g = rng.integers(0, 16, size=(3, 64), dtype=np.uint8)
    cases = []
    for axis in (-1, 0, 1):
        cases.append(("fp4", u4, lambda x, a=axis: pack_fp4(x, axis=a), lambda p, n, a=axis: unpack_fp4(p, axis=a, length=n), axis))
        cases.append(("fp6", u6, lambda x, a=axis: pack_fp6(x, axis=a), lambda p, n, a=axis: unpack_fp6(p, axis=a, length=n), axis))
        for order in Int4Order:
            cases.append(
                (
                    f"int4_int32_{order.value}",
                    s4,
                    lambda x, a=axis, o=order: pack_int4_int32(x, order=o, axis=a),
                    lambda p, n, a=axis, o=order: unpack_int4_int32(p, order=o, axis=a, length=n),
                    axis,
                )
            )
    for bits in ALL_BITS:
        lo = -(1 << (bits - 1))
        s = rng.integers(lo, -lo, size=(2, 3, 29), dtype=np.int8)
        cases.append(
            (
                f"bits{bits}",
                s,
                lambda x, b=bits: pack_bits(x, b, axis=1),
                lambda p, n, b=bits: unpack_bits(p, b, axis=1, length=n, signed=True),
                1,
            )
        )
    cases.append(("gguf", g, pack_gguf_q4, lambda p, n: unpack_gguf_q4(p), -1))
    return cases


def _check_torch_matches_numpy(torch, device):
    for name, x, pack_fn, unpack_fn, axis in _torch_cases():
        n = x.shape[axis]
        p_np = pack_fn(x)
        t = torch.from_numpy(x).to(device)
        p_t = pack_fn(t)
        assert isinstance(p_t, torch.Tensor) and p_t.device == t.device, name
        assert str(p_t.dtype).split(".")[-1] == p_np.dtype.name, name
        np.testing.assert_array_equal(p_t.cpu().numpy(), p_np, err_msg=name)
        u_np = unpack_fn(p_np, n)
        u_t = unpack_fn(p_t, n)
        assert str(u_t.dtype).split(".")[-1] == u_np.dtype.name, name
        np.testing.assert_array_equal(u_t.cpu().numpy(), u_np, err_msg=name)
        np.testing.assert_array_equal(u_np, x, err_msg=name)


def test_torch_cpu_bit_identical_to_numpy():
    torch = pytest.importorskip("torch")
    _check_torch_matches_numpy(torch, "cpu")


def test_torch_accelerator_bit_identical_to_numpy():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _check_torch_matches_numpy(torch, "cuda")


def test_torch_exhaustive_and_named():
    torch = pytest.importorskip("torch")
    # fp4 named vector and all 256 bytes on torch
    assert pack_fp4(torch.tensor([1, 2, 3, 15], dtype=torch.uint8)).tolist() == [0x21, 0xF3]
    b = torch.arange(256)
    codes = torch.stack([b & 0xF, b >> 4], -1).reshape(-1).to(torch.uint8)
    assert pack_fp4(codes).tolist() == list(range(256))
    # int4 words, including the sign bit
    v = torch.arange(8, dtype=torch.int8)
    r = pack_int4_int32(v, order=Int4Order.REORDER)
    assert r.dtype == torch.int32 and int(r[0]) == 0x75316420
    t = torch.tensor([0] * 7 + [-1], dtype=torch.int8)
    w = pack_int4_int32(t, order=Int4Order.ORDER)
    assert int(w[0]) == -268435456
    assert unpack_int4_int32(w, order=Int4Order.ORDER).tolist() == [0] * 7 + [-1]
    # every code, every width, both signednesses
    for bits, signed in itertools.product(ALL_BITS, (False, True)):
        c = torch.from_numpy(all_codes(bits, signed))
        p = pack_bits(c, bits)
        np.testing.assert_array_equal(p.numpy(), ref_stream(c.tolist(), bits))
        assert torch.equal(unpack_bits(p, bits, length=len(c), signed=signed), c)


def test_torch_errors_and_empty():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="codes"):
        pack_fp4(torch.zeros(4))
    with pytest.raises(TypeError, match="codes"):
        pack_fp4(torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="codes"):
        pack_fp4(torch.tensor([16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="codes"):
        pack_fp4(torch.tensor([-1], dtype=torch.int8))
    with pytest.raises(ValueError, match="values"):
        pack_int4_int32(torch.tensor([8], dtype=torch.int8), order=Int4Order.ORDER, signed=True)
    with pytest.raises(TypeError, match="packed"):
        unpack_int4_int32(torch.zeros(2, dtype=torch.int64), order=Int4Order.ORDER)
    e = torch.zeros((2, 0), dtype=torch.uint8)
    assert pack_fp6(e).shape == (2, 0) and pack_fp6(e).dtype == torch.uint8
    assert unpack_fp4(pack_fp4(e)).shape == (2, 0)
    assert pack_int4_int32(e, order=Int4Order.ORDER).dtype == torch.int32

"""Bit packing: integer code arrays <-> the byte layouts that kernels and checkpoint files use.

Every function is pure, takes a numpy array or a torch tensor (any device torch runs on) and returns the same kind
on the same device, bit-identically between the two. torch is never imported for numpy input. Round trips are
exact: ``unpack_*(pack_*(c), length=n) == c`` for every valid code array ``c`` of length ``n`` along ``axis``.

Code conventions (what the rest of qcore produces and consumes):

- float-element codes are ``uint8`` arrays holding the bit pattern in the low bits (fp4 e2m1: 0..15, fp6: 0..63);
- signed integer codes (int2/int3/int4/int8) are ``int8`` arrays holding the value (-8..7 for int4), written as
  two's complement in their field and sign-extended again by ``unpack_*(..., signed=True)``;
- unsigned integer codes are ``uint8`` values. E8M0 scale codes are already one ``uint8`` per scale (nothing to
  pack).

Any integer dtype is accepted as input (``bool``, float and complex raise ``TypeError``). A value must fit the field:
with ``signed=None`` (the default for the generic packers) both readings are allowed, ``-2**(b-1) <= v < 2**b``;
``signed=True`` asks for ``-2**(b-1) <= v < 2**(b-1)`` and ``signed=False`` for ``0 <= v < 2**b``. The float-code
packers (``pack_fp4``, ``pack_fp6``, ``pack_gguf_q4``) want unsigned codes. Out-of-range values raise
``ValueError``.

Layouts (``axis`` picks the packed axis, default the last; other axes are carried along unchanged):

================== =================================================================================================
``pack_bits``       dense little-endian bitstream: element ``i`` occupies bits ``[i*b, (i+1)*b)`` of the byte
                    stream, byte ``k`` holding stream bits ``8k..8k+7`` (LSB first). For ``b`` in {1, 2, 4, 8} this
                    is "element ``j`` of a byte at bit offset ``j*b``". The stream is cut in groups of
                    ``lcm(b, 8) / b`` elements = ``lcm(b, 8) / 8`` bytes (b=1: 8->1, 2: 4->1, 3: 8->3, 4: 2->1,
                    5: 8->5, 6: 4->3, 7: 8->7, 8: 1->1); a ragged last group is padded with code 0.
``pack_fp4``        ``pack_bits(codes, 4)``: element ``2i`` in the low nibble of byte ``i``, ``2i+1`` in the high
                    nibble (torchao / Quark / OCP). [0.5, 1.0, 1.5, -6.0] = codes [1, 2, 3, 0xF] -> 0x21, 0xF3.
``pack_fp6``        ``pack_bits(codes, 6)``: 4 values -> 3 bytes, Quark's layout
                    ``b0 = v0 | (v1 & 3) << 6``, ``b1 = v1 >> 2 | (v2 & 0xF) << 4``, ``b2 = v2 >> 4 | v3 << 2``.
``pack_int4_int32`` eight nibbles per int32, slot ``i`` = bits ``4i..4i+3`` (slot 7 in the sign bit);
                    ``Int4Order.REORDER`` (AWQ / Quark) puts element ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of each group of
                    8 in slot ``i``, ``Int4Order.ORDER`` element ``i`` (so ``ORDER`` is ``pack_bits(v, 4)`` read as
                    little-endian int32). Values 0..7 -> 0x75316420 (reorder), 0x76543210 (order).
``pack_gguf_q4``    GGUF Q4 nibbles: in each block of 32 codes, byte ``j`` holds element ``j`` (low nibble) and
                    element ``j + 16`` (high nibble); 32 codes -> 16 bytes; the length must be a multiple of 32.
``pack_gguf_blocks`` a ``QTensor`` of a GGUF spec (``qcore.GGUF_DTYPES``) -> llama.cpp's block bytes, the
                    ``block_*`` structs of ggml-common.h back to back along the last axis: Q2_K ``scales[16] qs[64]
                    d dmin`` (84 bytes), Q3_K ``hmask[32] qs[64] scales[12] d`` (110), Q4_K ``d dmin scales[12]
                    qs[128]`` (144), Q5_K ``d dmin scales[12] qh[32] qs[128]`` (176), Q6_K ``ql[128] qh[64]
                    scales[16] d`` (210); Q4_0 / IQ4_NL ``d qs[16]`` (18), Q4_1 ``d m qs[16]`` (20), Q5_0 ``d
                    qh[4] qs[16]`` (22), Q5_1 ``d m qh[4] qs[16]`` (24), Q8_0 ``d qs[32]`` (34); fp16 little-endian.
                    ``unpack_gguf_blocks`` is its inverse (numpy only).
================== =================================================================================================

Ragged lengths: the packers pad the last group with code 0; the unpackers return every element of the packed
groups unless ``length=n`` is given, which trims to ``n`` (it must be a length that packs to exactly that many
groups, else ``ValueError``).

The default layout of a format (``default_layout(dtype)``, ``pack(codes, dtype)``, ``unpack(packed, dtype)``):
the one rule that ``qcore conformance export`` (``expected_packed``) and ``qcore.testing``'s ``Op.PACK`` use.

- Codes of 8 bits or fewer: the dense bitstream of ``pack_bits(codes, bits)``, whatever the width. fp4 is
  ``pack_fp4``, fp6 is ``pack_fp6`` (Quark's 3-in-4), int4 is two per byte, and the 3-bit and 5-bit
  sign-magnitude elements of MX4 / MX6 (``float3_e1m1``, ``float5_e1m3``) are dense too: 8 codes -> 3 bytes
  and 8 codes -> 5 bytes, as a kernel storing them packs them (one byte per code would be a different,
  silently incompatible layout). 8-bit codes are their own bytes (int8 values in two's complement).
- Codes of 9 to 16 bits (int9..int16, uint9..uint16, float16, bfloat16): one little-endian 16-bit word per code
  (two's complement for signed integers), 2 bytes per element.
- Wider formats (float32) have no packed layout (``ValueError``). Block formats pack their element's codes; the
  scales are separate arrays. ``pack_int4_int32`` and ``pack_gguf_q4`` are alternative layouts a caller picks
  explicitly (``Op.PACK`` takes ``order=`` for the former).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from qcore import _kquants
from qcore._backend import is_torch, np_view, ops
from qcore._typing import Array, ArrayLike
from qcore.dtypes import BlockDType, DType, FloatDType, GGUFDType, IntDType, get_dtype
from qcore.quantize import QTensor, QuantSpec, dequantize, make_spec

__all__ = [
    "Layout",
    "default_layout",
    "pack",
    "unpack",
    "Int4Order",
    "pack_bits",
    "unpack_bits",
    "pack_fp4",
    "unpack_fp4",
    "pack_fp6",
    "unpack_fp6",
    "pack_int4_int32",
    "unpack_int4_int32",
    "pack_gguf_q4",
    "unpack_gguf_q4",
    "pack_gguf_blocks",
    "unpack_gguf_blocks",
]

_SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
# In-field position of each element of a group of 8 for Int4Order.REORDER: slot i holds element _REORDER[i].
_REORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class Int4Order(enum.Enum):
    """Nibble order inside an int32 word for ``pack_int4_int32`` / ``unpack_int4_int32``.

    ``ORDER``: slot ``i`` (bits ``4i..4i+3``) holds element ``i`` of each group of 8 (compressed-tensors, GPTQ).
    ``REORDER``: slot ``i`` holds element ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` (AWQ, Quark).
    """

    ORDER = "order"
    REORDER = "reorder"


# ---------------------------------------------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------------------------------------------


def _as_int_array(x: Any, name: str):
    """Return (array, ops) for an integer-typed numpy array / torch tensor / list; TypeError otherwise."""
    if is_torch(x):
        t = x
        dt = t.dtype
        if dt.is_floating_point or dt.is_complex:
            raise TypeError(f"{name} must be an integer tensor of codes, got dtype {dt}")
        if str(dt) == "torch.bool":
            raise TypeError(f"{name} must be an integer tensor of codes, got dtype {dt}")
        if str(dt) in ("torch.uint16", "torch.uint32", "torch.uint64"):
            raise TypeError(
                f"{name} has dtype {dt}, which torch supports too sparsely; pass uint8/int8/int16/int32/int64"
            )
        return t, ops(t)
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer array of codes, got a bool")
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array of codes, got dtype {a.dtype}")
    return a, ops(a)


def _check_axis(axis: Any, ndim: int, name: str = "axis") -> int:
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(axis).__name__}")
    axis = int(axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}={axis} is out of range for an array with {ndim} dimension(s)")
    return axis % ndim


def _check_bits(bits: Any) -> int:
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, np.integer)):
        raise TypeError(f"bits must be an int, got {type(bits).__name__}")
    bits = int(bits)
    if bits not in _SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported; supported widths are {_SUPPORTED_BITS}")
    return bits


def _check_signed(signed: Any, *, allow_none: bool) -> Optional[bool]:
    if signed is None and allow_none:
        return None
    if not isinstance(signed, (bool, np.bool_)):
        allowed = "True, False or None" if allow_none else "True or False"
        raise TypeError(f"signed must be {allowed}, got {signed!r}")
    return bool(signed)


def _range_for(bits: int, signed: Optional[bool]) -> tuple[int, int]:
    """Inclusive [lo, hi] of the values a ``bits``-wide field accepts under ``signed``."""
    if signed is None:
        return -(1 << (bits - 1)), (1 << bits) - 1
    if signed:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


def _codes_to_int64(x: Any, bits: int, signed: Optional[bool], name: str):
    """Validate codes for a ``bits``-wide field and return them as int64 (array, ops)."""
    a, o = _as_int_array(x, name)
    lo, hi = _range_for(bits, signed)
    if is_torch(a):
        # torch compares against out-of-range Python scalars after wrapping them to the tensor dtype: widen first.
        w = o.astype(a, o.int64)
        bad = (w < lo) | (w > hi)
    else:
        # numpy >= 2 compares integer arrays with any Python int exactly; check before widening (uint64 safety).
        bad = (a < lo) | (a > hi)
        w = o.astype(a, o.int64)
    if o.any(bad):
        kind = {None: "", True: " signed", False: " unsigned"}[signed]
        raise ValueError(f"{name} holds values outside [{lo}, {hi}], the range of a {bits}-bit{kind} field")
    return w, o


def _bytes_to_int64(x: Any, name: str):
    """Validate packed bytes: uint8 as is, int8 reinterpreted bitwise, other integer dtypes must hold 0..255."""
    a, o = _as_int_array(x, name)
    w = o.astype(a, o.int64)
    if a.dtype == o.int8:
        return w & 0xFF, o
    if a.dtype != o.uint8 and o.any((w < 0) | (w > 255)):
        raise ValueError(f"{name} must hold bytes 0..255 (dtype {a.dtype} holds values outside that range)")
    return w, o


def _check_length(length: Any, n_groups: int, group: int, name_len: str = "length") -> int:
    """Resolve ``length`` for an unpack whose packed input holds ``n_groups`` groups of ``group`` elements."""
    capacity = n_groups * group
    if length is None:
        return capacity
    if isinstance(length, (bool, np.bool_)) or not isinstance(length, (int, np.integer)):
        raise TypeError(f"{name_len} must be an int or None, got {type(length).__name__}")
    length = int(length)
    if length < 0 or -(-length // group) != n_groups:
        raise ValueError(
            f"{name_len}={length} does not match the packed input: {n_groups} group(s) of {group} element(s) "
            f"hold lengths {max(capacity - group + 1, 0)}..{capacity}"
        )
    return length


def _to_end(x, o, axis: int):
    return x if axis == x.ndim - 1 else o.moveaxis(x, axis, -1)


def _from_end(x, o, axis: int):
    return x if axis == x.ndim - 1 else o.moveaxis(x, -1, axis)


def _shifts(o, n: int, step: int, like):
    """int64 array [0, step, 2*step, ...] of length n on ``like``'s device."""
    return o.arange(n, o.int64, like) * step


# ---------------------------------------------------------------------------------------------------------------
# generic bitstream packing
# ---------------------------------------------------------------------------------------------------------------


def _group(bits: int) -> tuple[int, int]:
    """(elements, bytes) per group: the smallest whole number of elements that fills whole bytes."""
    span = bits * 8 // math.gcd(bits, 8)  # lcm(bits, 8) <= 56, fits an int64 word
    return span // bits, span // 8


def _pack_stream(w, o, bits: int, axis: int):
    """Pack validated int64 codes ``w`` into a uint8 LSB-first bitstream along ``axis``."""
    n_el, n_by = _group(bits)
    x = _to_end(w, o, axis)
    lead = tuple(x.shape[:-1])
    n = int(x.shape[-1])
    n_groups = -(-n // n_el)
    x = o.pad_axis(x, -1, n_groups * n_el - n, 0)
    x = o.reshape(x & ((1 << bits) - 1), lead + (n_groups, n_el))
    # Fields do not overlap, so the sum of the shifted fields is their bitwise OR.
    word = o.sum(x << _shifts(o, n_el, bits, x), -1, keepdims=False)
    by = (word[..., None] >> _shifts(o, n_by, 8, x)) & 0xFF
    out = o.astype(o.reshape(by, lead + (n_groups * n_by,)), o.uint8)
    return _from_end(out, o, axis)


def _unpack_stream(b, o, bits: int, axis: int, length, signed: bool, name: str):
    """Inverse of ``_pack_stream`` on validated int64 bytes ``b``; returns uint8 (or int8 when ``signed``), or
    int32 for fields wider than 8 bits."""
    n_el, n_by = _group(bits)
    x = _to_end(b, o, axis)
    lead = tuple(x.shape[:-1])
    m = int(x.shape[-1])
    if m % n_by:
        raise ValueError(
            f"{name} has {m} byte(s) along axis {axis}; {bits}-bit packing comes in groups of {n_by} byte(s)"
        )
    n_groups = m // n_by
    n = _check_length(length, n_groups, n_el)
    x = o.reshape(x, lead + (n_groups, n_by))
    word = o.sum(x << _shifts(o, n_by, 8, x), -1, keepdims=False)
    v = (word[..., None] >> _shifts(o, n_el, bits, x)) & ((1 << bits) - 1)
    v = o.reshape(v, lead + (n_groups * n_el,))
    v = o.slice_axis(v, -1, n)
    if signed:
        half = 1 << (bits - 1)
        v = (v ^ half) - half
    if bits > 8:  # 16-bit words (``unpack``): int32, as qcore.encode returns codes wider than 8 bits
        v = o.astype(v, o.int32)
    else:
        v = o.astype(v, o.int8 if signed else o.uint8)
    return _from_end(v, o, axis)


def pack_bits(codes: ArrayLike, bits: int, *, axis: int = -1, signed: Optional[bool] = None) -> Array:
    """Pack ``bits``-wide integer codes along ``axis`` into a ``uint8`` little-endian bitstream.

    Element ``i`` occupies bits ``[i*bits, (i+1)*bits)`` of the byte stream (byte ``k`` = stream bits
    ``8k..8k+7``, LSB first); for ``bits`` in {1, 2, 4, 8} that is element ``j`` of each byte at bit offset
    ``j*bits``. Signed values are written as two's complement in their field. The packed axis has length
    ``ceil(n / E) * B`` where a group of ``E = lcm(bits, 8) / bits`` elements fills ``B = lcm(bits, 8) / 8``
    bytes; a ragged last group is padded with code 0 (pass ``length=n`` to ``unpack_bits`` to trim).

    Args:
        codes: integer array / tensor of codes.
        bits: field width, 1..8.
        axis: the axis to pack (default last).
        signed: which values are valid: ``True`` -2**(bits-1)..2**(bits-1)-1, ``False`` 0..2**bits-1,
            ``None`` (default) either.

    Returns:
        ``uint8`` array / tensor, same kind and device as ``codes``.
    """
    bits = _check_bits(bits)
    signed = _check_signed(signed, allow_none=True)
    w, o = _codes_to_int64(codes, bits, signed, "codes")
    axis = _check_axis(axis, w.ndim)
    return _pack_stream(w, o, bits, axis)


def unpack_bits(packed: ArrayLike, bits: int, *, axis: int = -1, length: Optional[int] = None,
                signed: bool = False) -> Array:
    """Inverse of ``pack_bits``: ``uint8`` codes (``signed=False``) or sign-extended ``int8`` (``signed=True``).

    ``length`` trims the unpacked axis to the original element count; by default every element of every packed
    group is returned. ``packed`` should be ``uint8`` (``int8`` is read bitwise; other integer dtypes must hold
    0..255).
    """
    bits = _check_bits(bits)
    signed = bool(_check_signed(signed, allow_none=False))  # never None here
    b, o = _bytes_to_int64(packed, "packed")
    axis = _check_axis(axis, b.ndim)
    return _unpack_stream(b, o, bits, axis, length, signed, "packed")


# ---------------------------------------------------------------------------------------------------------------
# fp4 / fp6
# ---------------------------------------------------------------------------------------------------------------


def pack_fp4(codes: ArrayLike, *, axis: int = -1) -> Array:
    """Pack fp4 (e2m1) codes 0..15 two per byte: element ``2i`` in the low nibble, ``2i+1`` in the high nibble.

    This is the torchao / Quark / OCP layout: [0.5, 1.0, 1.5, -6.0] = codes [0x1, 0x2, 0x3, 0xF] -> bytes
    [0x21, 0xF3]. An odd length is padded with code 0 (``unpack_fp4(..., length=n)`` trims). Returns ``uint8``.
    """
    w, o = _codes_to_int64(codes, 4, False, "codes")
    axis = _check_axis(axis, w.ndim)
    return _pack_stream(w, o, 4, axis)


def unpack_fp4(packed: ArrayLike, *, axis: int = -1, length: Optional[int] = None) -> Array:
    """Inverse of ``pack_fp4``: ``uint8`` fp4 codes 0..15, ``length`` (default ``2 * bytes``) along ``axis``."""
    b, o = _bytes_to_int64(packed, "packed")
    axis = _check_axis(axis, b.ndim)
    return _unpack_stream(b, o, 4, axis, length, False, "packed")


def pack_fp6(codes: ArrayLike, *, axis: int = -1) -> Array:
    """Pack fp6 (e2m3 / e3m2) codes 0..63, 4 values -> 3 bytes, in Quark's layout::

        byte0 = v0        | (v1 & 0x3) << 6
        byte1 = v1 >> 2   | (v2 & 0xF) << 4
        byte2 = v2 >> 4   | v3 << 2

    which is exactly the dense LSB-first 6-bit bitstream of ``pack_bits(codes, 6)`` (``v_i`` at stream bits
    ``6i..6i+5``: v0 = byte0 bits 0-5; v1 = byte0 bits 6-7 + byte1 bits 0-3; v2 = byte1 bits 4-7 + byte2 bits 0-1;
    v3 = byte2 bits 2-7). A length that is not a multiple of 4 is padded with code 0 (``length=`` trims on
    unpack). Returns ``uint8``.
    """
    w, o = _codes_to_int64(codes, 6, False, "codes")
    axis = _check_axis(axis, w.ndim)
    return _pack_stream(w, o, 6, axis)


def unpack_fp6(packed: ArrayLike, *, axis: int = -1, length: Optional[int] = None) -> Array:
    """Inverse of ``pack_fp6``: ``uint8`` fp6 codes 0..63; the packed axis must be a multiple of 3 bytes."""
    b, o = _bytes_to_int64(packed, "packed")
    axis = _check_axis(axis, b.ndim)
    return _unpack_stream(b, o, 6, axis, length, False, "packed")


# ---------------------------------------------------------------------------------------------------------------
# the default layout of a format
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """The default byte layout of one element format's codes (``default_layout``; see the module docstring).

    ``dtype``: the element format's name. ``bits``: its code width. ``field_bits``: the width each code takes in
    the byte stream (``bits`` for formats of 8 bits or fewer, 16 for wider ones). ``signed``: the codes are
    two's-complement integer values (signed ``IntDType``) rather than unsigned bit patterns. ``name``:
    ``"fp4"``, ``"fp6"``, ``"bits"`` (any other width of 8 bits or fewer) or ``"words16"``.
    """

    dtype: str
    bits: int
    field_bits: int
    signed: bool
    name: str

    def __post_init__(self) -> None:
        if self.field_bits not in _SUPPORTED_BITS + (16,) or not 1 <= self.bits <= self.field_bits:
            raise ValueError(f"Layout: bits={self.bits!r} / field_bits={self.field_bits!r} is not a layout qcore has")
        if self.name not in ("fp4", "fp6", "bits", "words16"):
            raise ValueError(f"Layout: unknown name {self.name!r}")

    @property
    def group_elements(self) -> int:
        """Elements in the smallest whole-byte group (fp4: 2, fp6: 4, 3- and 5-bit: 8, 8- and 16-bit: 1)."""
        return _group(self.field_bits)[0]

    @property
    def group_bytes(self) -> int:
        """Bytes of that group (fp4: 1, fp6: 3, 3-bit: 3, 5-bit: 5, 8-bit: 1, 16-bit words: 2)."""
        return _group(self.field_bits)[1]

    @property
    def function(self) -> str:
        """The explicit packer call that gives the same bytes."""
        if self.name == "fp4":
            return "qcore.packing.pack_fp4(codes)"
        if self.name == "fp6":
            return "qcore.packing.pack_fp6(codes)"
        if self.name == "bits":
            return f"qcore.packing.pack_bits(codes, {self.bits})"
        return "codes as 16-bit little-endian words"


def default_layout(dtype: Union[str, DType]) -> Layout:
    """The byte layout qcore uses for ``dtype``'s codes (a format name or dtype; a block format gives its
    element's layout): dense ``pack_bits`` bitstreams up to 8 bits, 16-bit little-endian words for 9 to 16 bits.

    ``ValueError`` for formats wider than 16 bits (float32 has no packed layout)."""
    d = get_dtype(dtype)
    if isinstance(d, BlockDType):
        d = d.element
    if not isinstance(d, (IntDType, FloatDType)):
        raise ValueError(f"dtype {d.name!r} is a GGUF block type: its bytes are whole blocks, "
                         "qcore.packing.pack_gguf_blocks(qtensor) / unpack_gguf_blocks(data, name)")
    signed = isinstance(d, IntDType) and d.signed
    if d.bits > 16:
        raise ValueError(f"dtype {d.name} has {d.bits}-bit codes; qcore packs formats of 16 bits or fewer")
    if d.bits > 8:
        return Layout(d.name, d.bits, 16, signed, "words16")
    name = f"fp{d.bits}" if isinstance(d, FloatDType) and d.bits in (4, 6) else "bits"
    return Layout(d.name, d.bits, d.bits, signed, name)


def pack(codes: ArrayLike, dtype: Union[str, DType], *, axis: int = -1) -> Array:
    """Pack ``dtype``'s codes (as ``qcore.encode`` / ``QTensor.codes`` give them) along ``axis`` in the
    format's default layout (``default_layout``); returns ``uint8``, same kind and device as ``codes``.

    Codes must fit the format: ``0 .. 2**bits - 1`` for float and unsigned formats, the value range for signed
    integers (``ValueError`` otherwise). A ragged last group is padded with code 0 (``unpack(..., length=n)``
    trims).
    """
    lay = default_layout(dtype)
    w, o = _codes_to_int64(codes, lay.bits, lay.signed, "codes")
    axis = _check_axis(axis, w.ndim)
    return _pack_stream(w, o, lay.field_bits, axis)


def unpack(packed: ArrayLike, dtype: Union[str, DType], *, axis: int = -1, length: Optional[int] = None) -> Array:
    """Inverse of ``pack``: the codes in ``qcore.encode``'s dtypes (``uint8`` bit patterns / unsigned values,
    ``int8`` values of signed integer formats, ``int32`` above 8 bits). ``length`` trims the unpacked axis.

    16-bit words that do not hold a code of a narrower format (int12: outside -2048..2047) raise ``ValueError``.
    """
    lay = default_layout(dtype)
    b, o = _bytes_to_int64(packed, "packed")
    axis = _check_axis(axis, b.ndim)
    v = _unpack_stream(b, o, lay.field_bits, axis, length, lay.signed, "packed")
    if lay.field_bits != lay.bits:
        lo, hi = _range_for(lay.bits, lay.signed)
        if o.any((v < lo) | (v > hi)):
            raise ValueError(f"packed holds 16-bit words outside [{lo}, {hi}], the codes of {lay.dtype}")
    return v


# ---------------------------------------------------------------------------------------------------------------
# int4 in int32 words
# ---------------------------------------------------------------------------------------------------------------


def _check_order(order: Any) -> Int4Order:
    if isinstance(order, Int4Order):
        return order
    if isinstance(order, str):
        try:
            return Int4Order(order.lower())
        except ValueError:
            raise ValueError(
                f"order={order!r} is not a known nibble order; use Int4Order.ORDER or Int4Order.REORDER"
            ) from None
    raise TypeError(f"order must be an Int4Order (ORDER or REORDER), got {type(order).__name__}")


def pack_int4_int32(values: ArrayLike, *, order: Union[Int4Order, str], axis: int = -1,
                    signed: Optional[bool] = None) -> Array:
    """Pack 4-bit integers eight per ``int32`` word along ``axis``.

    Nibble slot ``i`` is bits ``4i..4i+3`` of the word read as uint32 (slot 7 carries the sign bit of the
    ``int32``). ``Int4Order.ORDER`` puts element ``i`` of each group of 8 in slot ``i``; ``Int4Order.REORDER``
    (AWQ / Quark) puts element ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` there. Values 0..7 pack to 0x76543210 (ORDER) and
    0x75316420 (REORDER). Signed int4 is written in two's complement nibbles; uint4 0..15 works too (``signed``
    says which values are valid, default either). A length that is not a multiple of 8 is padded with 0
    (``length=`` trims on unpack).

    ``order`` is required (no default: the two layouts are silently incompatible). ``Int4Order`` is preferred;
    its value strings ``"order"`` / ``"reorder"`` are accepted for convenience.

    Returns:
        ``int32`` array / tensor (numpy ``int32`` / ``torch.int32``), same kind and device as ``values``.
    """
    order = _check_order(order)
    signed = _check_signed(signed, allow_none=True)
    w, o = _codes_to_int64(values, 4, signed, "values")
    axis = _check_axis(axis, w.ndim)
    x = _to_end(w, o, axis)
    lead = tuple(x.shape[:-1])
    n = int(x.shape[-1])
    n_groups = -(-n // 8)
    x = o.pad_axis(x, -1, n_groups * 8 - n, 0)
    x = o.reshape(x & 0xF, lead + (n_groups, 8))
    if order is Int4Order.REORDER:
        # slot i holds element _REORDER[i]; element e therefore sits in slot _REORDER.index(e).
        slot_of_element = [_REORDER.index(e) for e in range(8)]
        shifts = o.asarray([4 * s for s in slot_of_element], o.int64, x)
    else:
        shifts = _shifts(o, 8, 4, x)
    word = o.sum(x << shifts, -1, keepdims=False)  # 0 .. 2**32 - 1
    word = o.where(word >= (1 << 31), word - (1 << 32), word)  # reinterpret as int32, explicitly
    return _from_end(o.astype(word, o.int32), o, axis)


def unpack_int4_int32(
    packed: ArrayLike, *, order: Union[Int4Order, str], axis: int = -1, length: Optional[int] = None,
    signed: bool = True,
) -> Array:
    """Inverse of ``pack_int4_int32``: ``int8`` sign-extended int4 (``signed=True``, default) or ``uint8`` uint4.

    ``packed`` must be ``int32`` (numpy ``uint32`` is read bitwise too). ``length`` trims the unpacked axis
    (default ``8 * words``).
    """
    order = _check_order(order)
    signed = bool(_check_signed(signed, allow_none=False))  # never None here
    a, o = _as_int_array(packed, "packed")
    ok = a.dtype == o.int32 or (not is_torch(a) and a.dtype == np.uint32)
    if not ok:
        raise TypeError(f"packed must be an int32 array of packed words, got dtype {a.dtype}")
    axis = _check_axis(axis, a.ndim)
    w = o.astype(a, o.int64) & 0xFFFFFFFF
    x = _to_end(w, o, axis)
    lead = tuple(x.shape[:-1])
    n_groups = int(x.shape[-1])
    n = _check_length(length, n_groups, 8)
    if order is Int4Order.REORDER:
        shifts = o.asarray([4 * _REORDER.index(e) for e in range(8)], o.int64, x)
    else:
        shifts = _shifts(o, 8, 4, x)
    v = (x[..., None] >> shifts) & 0xF
    v = o.slice_axis(o.reshape(v, lead + (n_groups * 8,)), -1, n)
    v = o.astype((v ^ 8) - 8, o.int8) if signed else o.astype(v, o.uint8)
    return _from_end(v, o, axis)


# ---------------------------------------------------------------------------------------------------------------
# GGUF Q4 nibbles
# ---------------------------------------------------------------------------------------------------------------


def pack_gguf_q4(codes: ArrayLike, *, axis: int = -1) -> Array:
    """Pack 4-bit codes 0..15 in GGUF's Q4 nibble order: per block of 32, byte ``j`` = ``c[j] | c[j+16] << 4``.

    ``codes`` has shape (..., 32 * nb) along ``axis`` (default last; a length that is not a multiple of 32 raises
    ``ValueError``); the result is ``uint8`` of shape (..., 16 * nb) — the ``qs`` field of Q4_0 / Q4_1 / MXFP4
    blocks (the scale fields are not written here).
    """
    w, o = _codes_to_int64(codes, 4, False, "codes")
    axis = _check_axis(axis, w.ndim)
    x = _to_end(w, o, axis)
    lead = tuple(x.shape[:-1])
    n = int(x.shape[-1])
    if n % 32:
        raise ValueError(f"codes has length {n} along axis {axis}; GGUF Q4 blocks need a multiple of 32")
    x = o.reshape(x, lead + (n // 32, 2, 16))
    by = o.sum(x << _shifts(o, 2, 4, x)[:, None], -2, keepdims=False)  # low half | high half << 4
    out = o.astype(o.reshape(by, lead + (n // 2,)), o.uint8)
    return _from_end(out, o, axis)


def unpack_gguf_q4(packed: ArrayLike, *, axis: int = -1) -> Array:
    """Inverse of ``pack_gguf_q4``: (..., 16 * nb) bytes -> (..., 32 * nb) ``uint8`` codes 0..15."""
    b, o = _bytes_to_int64(packed, "packed")
    axis = _check_axis(axis, b.ndim)
    x = _to_end(b, o, axis)
    lead = tuple(x.shape[:-1])
    m = int(x.shape[-1])
    if m % 16:
        raise ValueError(f"packed has length {m} along axis {axis}; GGUF Q4 blocks are 16 bytes")
    x = o.reshape(x, lead + (m // 16, 1, 16))
    v = (x >> _shifts(o, 2, 4, x)[:, None]) & 0xF  # (..., nb, 2, 16): low nibbles then high nibbles
    out = o.astype(o.reshape(v, lead + (2 * m,)), o.uint8)
    return _from_end(out, o, axis)


# ---------------------------------------------------------------------------------------------------------------
# GGUF k-quants (Q2_K ... Q6_K): whole super-blocks, numpy only

def _kq_lowbits(L, shifts, group):
    """Bytes of ``len(shifts)`` planes: byte ``l`` of each ``group``-sized chunk ORs ``L[c*group*len + k*group + l]
    << shifts[k]`` (llama.cpp's ``qs`` loops). L: (B, 256) small ints."""
    B = L.shape[0]
    k = len(shifts)
    t = L.reshape(B, -1, k, group).astype(np.uint8)
    out = np.zeros((B, t.shape[1], group), dtype=np.uint8)
    for i, sh in enumerate(shifts):
        out |= (t[:, :, i, :] << np.uint8(sh)).astype(np.uint8)
    return out.reshape(B, -1)


def _kq_lowbits_inv(qs, shifts, group, mask):
    B = qs.shape[0]
    t = qs.reshape(B, -1, 1, group)
    planes = [(t >> np.uint8(sh)) & np.uint8(mask) for sh in shifts]
    return np.concatenate(planes, axis=2).reshape(B, -1)


def _k4_scales(sc, mc):
    """Q4_K/Q5_K's 12 scale bytes from 8 six-bit scales and mins (llama.cpp's packing, get_scale_min_k4)."""
    sc = sc.astype(np.uint8)
    mc = mc.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mc[:, 0:4] | ((mc[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mc[:, 4:8] & 0xF) << 4)
    return out


def _k4_scales_inv(b):
    sc = np.concatenate([b[:, 0:4] & 63, (b[:, 8:12] & 0xF) | ((b[:, 0:4] >> 6) << 4)], axis=1)
    mc = np.concatenate([b[:, 4:8] & 63, (b[:, 8:12] >> 4) | ((b[:, 4:8] >> 6) << 4)], axis=1)
    return sc, mc


def _k3_scales(s6):
    """Q3_K's 12 scale bytes from 16 six-bit (biased) scales."""
    s6 = s6.astype(np.uint8)
    out = np.zeros((s6.shape[0], 12), dtype=np.uint8)
    out[:, 0:8] = (s6[:, 0:8] & 0xF) | ((s6[:, 8:16] & 0xF) << 4)
    hi = (s6 >> 4).reshape(-1, 4, 4)  # [j // 4, j % 4]
    for g in range(4):
        out[:, 8:12] |= (hi[:, g, :] << np.uint8(2 * g)).astype(np.uint8)
    return out


def _k3_scales_inv(b):
    lo = np.concatenate([b[:, 0:8] & 0xF, b[:, 0:8] >> 4], axis=1)
    hi = np.concatenate([(b[:, 8:12] >> np.uint8(2 * g)) & 3 for g in range(4)], axis=1)
    return lo | (hi << 4)


def _f16_bytes(v):
    return np.ascontiguousarray(np.asarray(v, dtype=np.float32).astype(np.float16)).view(np.uint8).reshape(-1, 2)


def _f16_from(b):
    return np.ascontiguousarray(b).view(np.float16).reshape(-1).astype(np.float32)


def _kq_type(fmt):
    d = fmt.gguf_dtype if hasattr(fmt, "gguf_dtype") else get_dtype(fmt)
    if not isinstance(d, GGUFDType):
        raise ValueError(f"a GGUF k-quant (q2_k ... q6_k) is needed, got {getattr(d, 'name', fmt)!r}")
    return d


def _pack_gguf32(t, codes, ss, host):
    """Q4_0 ``d qs[16]``, Q4_1 ``d m qs[16]``, Q5_0 ``d qh[4] qs[16]``, Q5_1 ``d m qh[4] qs[16]``, Q8_0 ``d qs[32]``:
    byte ``j`` of ``qs`` holds elements ``j`` (low nibble) and ``j + 16``; ``qh`` bit ``j`` is element ``j``'s fifth
    bit (little-endian uint32)."""
    L = codes.reshape(-1, 32) - t.element.min
    parts = [_f16_bytes(host(ss.d))]
    if t.offset16:
        parts.append(_f16_bytes(host(ss.dmin)))
    if t.name == "q8_0":
        parts.append((L - 128).astype(np.int8).view(np.uint8))
    else:
        if t.element.bits == 5:
            bits = ((L >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
            qh = np.bitwise_or.reduce(bits, axis=1).astype("<u4")
            parts.append(np.ascontiguousarray(qh).view(np.uint8).reshape(-1, 4))
        parts.append(((L[:, :16] & 0xF) | ((L[:, 16:] & 0xF) << 4)).astype(np.uint8))
    return np.concatenate(parts, axis=1)


def _unpack_gguf32(t, spec, b):
    lead = b.shape[:-1]
    nb = b.shape[-1] // t.type_size
    blk = np.ascontiguousarray(b).reshape(-1, t.type_size)
    d = _f16_from(blk[:, 0:2])
    pos = 2
    m = None
    if t.offset16:
        m = _f16_from(blk[:, 2:4])
        pos = 4
    if t.name == "q8_0":
        L = blk[:, pos:].view(np.int8).astype(np.int64) + 128
    else:
        hi = np.zeros((blk.shape[0], 32), dtype=np.int64)
        if t.element.bits == 5:
            qh = np.ascontiguousarray(blk[:, pos:pos + 4]).view("<u4").reshape(-1, 1).astype(np.int64)
            hi = ((qh >> np.arange(32)) & 1) << 4
            pos += 4
        qs = blk[:, pos:pos + 16].astype(np.int64)
        L = np.concatenate([qs & 0xF, qs >> 4], axis=1) | hi
    codes = (L + t.element.min).astype(np.int8 if t.element.signed else np.uint8)
    ss = _kquants.GGUFScales(d=d.reshape(*lead, nb), dmin=None if m is None else m.reshape(*lead, nb),
                             scale_codes=None, min_codes=None)
    scales, offsets = _kquants.sub_scales(ss, 32)
    return QTensor(codes.reshape(*lead, nb * 32), scales, None, spec, None, None, offsets, ss)


def pack_gguf_blocks(q: Any) -> np.ndarray:
    """A ``QTensor`` of a GGUF type spec (``quantize(x, "q4_k")``, ``"q5_0"``, ...) -> uint8 (..., n / block *
    type_size): the GGUF bytes of each row, exactly what llama.cpp's ``ggml_quantize_chunk`` writes. numpy (torch
    parts are read on the host)."""
    if not isinstance(q, QTensor) or not getattr(q.spec, "gguf", ""):
        raise TypeError(f"pack_gguf_blocks takes a k-quant QTensor (quantize(x, 'q4_k')), got {type(q).__name__}"
                        + ("" if not isinstance(q, QTensor) else f" with spec {q.spec.name or q.spec.dtype.name!r}"))
    t = _kq_type(q.spec)
    dequantize(q)  # validates every part (codes range, scale codes, fp16 d, scales == d * codes) before packing
    codes = np.asarray(np_view(q.codes)).astype(np.int64)
    ss = q.super_scales
    shape = codes.shape
    lead, n = shape[:-1], shape[-1]
    if not t.is_kquant:
        return _pack_gguf32(t, codes, ss, np_view).reshape(*lead, n // 32 * t.type_size)
    B = codes.size // 256
    L = codes.reshape(B, 256) - t.element.min  # unsigned stored codes
    d = _f16_bytes(np_view(ss.d))
    sc = np.asarray(np_view(ss.scale_codes)).astype(np.int64).reshape(B, -1)
    if t.has_mins:
        dmin = _f16_bytes(np_view(ss.dmin))
        mc = np.asarray(np_view(ss.min_codes)).astype(np.int64).reshape(B, -1)
    name = t.name
    if name == "q2_k":
        parts = [(sc | (mc << 4)).astype(np.uint8), _kq_lowbits(L, (0, 2, 4, 6), 32), d, dmin]
    elif name == "q3_k":
        hm = np.zeros((B, 32), dtype=np.uint8)
        high = (L > 3).reshape(B, 8, 32)
        for bit in range(8):
            hm |= (high[:, bit, :].astype(np.uint8) << np.uint8(bit)).astype(np.uint8)
        parts = [hm, _kq_lowbits(L & 3, (0, 2, 4, 6), 32), _k3_scales(sc + 32), d]
    elif name == "q4_k":
        parts = [d, dmin, _k4_scales(sc, mc), _kq_lowbits(L, (0, 4), 32)]
    elif name == "q5_k":
        qh = np.zeros((B, 32), dtype=np.uint8)
        high = (L >> 4).reshape(B, 8, 32).astype(np.uint8)
        for bit in range(8):
            qh |= (high[:, bit, :] << np.uint8(bit)).astype(np.uint8)
        parts = [d, dmin, _k4_scales(sc, mc), qh, _kq_lowbits(L & 0xF, (0, 4), 32)]
    else:  # q6_k
        h = L.reshape(B, 2, 4, 32)  # halves of 128, quarters of 32
        ql = np.concatenate([(h[:, :, 0] & 0xF) | ((h[:, :, 2] & 0xF) << 4),
                             (h[:, :, 1] & 0xF) | ((h[:, :, 3] & 0xF) << 4)], axis=2).reshape(B, 128)
        qh = ((h[:, :, 0] >> 4) | ((h[:, :, 1] >> 4) << 2) | ((h[:, :, 2] >> 4) << 4)
              | ((h[:, :, 3] >> 4) << 6)).reshape(B, 64)
        parts = [ql.astype(np.uint8), qh.astype(np.uint8), (sc & 0xFF).astype(np.uint8), d]
    blocks = np.concatenate(parts, axis=1)
    return blocks.reshape(*lead, n // 256 * t.type_size)


def unpack_gguf_blocks(data: ArrayLike, fmt: Any) -> Any:
    """Inverse of ``pack_gguf_blocks``: uint8 (..., nb * type_size) GGUF bytes of the k-quant ``fmt`` (a name such
    as ``"q4_k"`` or a k-quant ``QuantSpec``) -> the ``QTensor`` (numpy parts, codes of shape (..., nb * 256)),
    which ``dequantize`` turns into llama.cpp's values and ``pack_gguf_blocks`` into the same bytes."""
    t = _kq_type(fmt)
    spec = fmt if isinstance(fmt, QuantSpec) else make_spec(t.name)
    b = np.asarray(data)
    if b.dtype == np.uint8 and b.ndim and b.shape[-1] % t.type_size == 0 and not t.is_kquant:
        return _unpack_gguf32(t, spec, b)
    if b.dtype != np.uint8:
        raise TypeError(f"data must be a uint8 array of GGUF bytes, got dtype {b.dtype}")
    if b.ndim == 0 or b.shape[-1] % t.type_size:
        raise ValueError(f"data has shape {b.shape}; {t.name} rows are whole blocks of {t.type_size} bytes")
    lead = b.shape[:-1]
    nb = b.shape[-1] // t.type_size
    B = int(np.prod(lead, dtype=np.int64)) * nb
    blk = np.ascontiguousarray(b).reshape(B, t.type_size)
    dmin = mc = None
    name = t.name
    if name == "q2_k":
        sb, qs, d, dmin = blk[:, :16], blk[:, 16:80], blk[:, 80:82], blk[:, 82:84]
        sc, mc = sb & 0xF, sb >> 4
        L = _kq_lowbits_inv(qs, (0, 2, 4, 6), 32, 3)
    elif name == "q3_k":
        hm, qs, s12, d = blk[:, :32], blk[:, 32:96], blk[:, 96:108], blk[:, 108:110]
        high = np.concatenate([(hm >> np.uint8(bit)) & 1 for bit in range(8)], axis=1)
        L = _kq_lowbits_inv(qs, (0, 2, 4, 6), 32, 3) | (high << 2)
        sc = _k3_scales_inv(s12).astype(np.int16) - 32
    elif name == "q4_k":
        d, dmin, s12, qs = blk[:, 0:2], blk[:, 2:4], blk[:, 4:16], blk[:, 16:144]
        sc, mc = _k4_scales_inv(s12)
        L = _kq_lowbits_inv(qs, (0, 4), 32, 0xF)
    elif name == "q5_k":
        d, dmin, s12, qh, qs = blk[:, 0:2], blk[:, 2:4], blk[:, 4:16], blk[:, 16:48], blk[:, 48:176]
        sc, mc = _k4_scales_inv(s12)
        high = np.concatenate([(qh >> np.uint8(bit)) & 1 for bit in range(8)], axis=1)
        L = _kq_lowbits_inv(qs, (0, 4), 32, 0xF) | (high << 4)
    else:  # q6_k
        ql, qh, s16, d = blk[:, :128].reshape(B, 2, 64), blk[:, 128:192].reshape(B, 2, 32), blk[:, 192:208], \
            blk[:, 208:210]
        q = [(ql[:, :, 0:32] & 0xF) | (((qh >> 0) & 3) << 4), (ql[:, :, 32:64] & 0xF) | (((qh >> 2) & 3) << 4),
             (ql[:, :, 0:32] >> 4) | (((qh >> 4) & 3) << 4), (ql[:, :, 32:64] >> 4) | (((qh >> 6) & 3) << 4)]
        L = np.stack(q, axis=2).reshape(B, 256)
        sc = s16.view(np.int8)
    codes = (L.astype(np.int16) + t.element.min).astype(np.int8 if t.element.signed else np.uint8)
    ns = 256 // t.subblock_size
    ss = _kquants.GGUFScales(
        d=_f16_from(d).reshape(*lead, nb),
        dmin=None if dmin is None else _f16_from(dmin).reshape(*lead, nb),
        scale_codes=np.asarray(sc).astype(np.int16).reshape(*lead, nb * ns),
        min_codes=None if mc is None else np.asarray(mc).astype(np.int16).reshape(*lead, nb * ns))
    scales, offsets = _kquants.sub_scales(ss, t.subblock_size)
    return QTensor(codes.reshape(*lead, nb * 256), scales, None, spec, None, None, offsets, ss)

"""The dtype table: every number format qcore knows, as data.

Three kinds of description, each a frozen dataclass whose constants are *derived* (nothing is typed twice):

- ``IntDType(bits, signed)``: two's-complement or unsigned integers (int2 ... int16, uint2 ... uint16).
- ``FloatDType(exponent_bits, mantissa_bits, bias, specials, ...)``: any small binary float that fits inside
  float32 (every value exactly representable as a float32). ``specials`` says which codes are Inf/NaN:

  ============ ======================================================== ==========================
  ``Specials``  codes                                                    examples
  ============ ======================================================== ==========================
  ``IEEE``      top exponent field: mantissa 0 = Inf, else NaN          float16, bfloat16, e5m2
  ``FN``        only the all-ones code (either sign) is NaN; no Inf     e4m3fn, e8m0fnu
  ``FNUZ``      the negative-zero code (0x80) is the only NaN; no -0     e4m3fnuz, e5m2fnuz
  ``FINITE``    every code is a finite number                           e2m3fn, e3m2fn, e2m1fn
  ============ ======================================================== ==========================

- ``BlockDType``: a block format (OCP MX, shared-microexponent MX9/MX6/MX4, bfp16, NVFP4): an element dtype, a
  block size, a scale dtype, the default scale rule and, for two-level formats (NVFP4), the per-tensor scale.

A new format is one line, e.g. ``FloatDType("float7_e3m3", 3, 3)`` (bias defaults to 2**(e-1)-1, IEEE-less
``FINITE`` specials default to saturating). ``get_dtype(name)`` looks a name up in ``DTYPES``, the one table.

Names follow ml_dtypes where it has the format. The table is a constant built once; nothing registers itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Union

__all__ = [
    "Specials",
    "IntDType",
    "FloatDType",
    "BlockDType",
    "GGUFDType",
    "GGUF_DTYPES",
    "ScaleMode",
    "TensorScale",
    "DType",
    "DTYPES",
    "get_dtype",
]


class Specials(enum.Enum):
    """Which codes of a float format are Inf / NaN (see the module docstring's table)."""

    IEEE = "ieee"
    FN = "fn"
    FNUZ = "fnuz"
    FINITE = "finite"


class ScaleMode(enum.Enum):
    """How a power-of-two (E8M0) block scale is chosen from the block's absolute maximum ``amax``.

    With ``e = floor(log2(amax))`` read exactly from amax's float32 bits and ``emax`` the element format's
    largest exponent (``IntDType``: ``bits - 2``), the shared scale is ``2**s`` with:

    - ``FLOOR`` (OCP MX v1.0 section 6.3, torchao's default): ``s = e - emax``. Elements that land above the
      element max after scaling are clamped (saturated).
    - ``CEIL``: ``s = e - emax + (amax is not a power of two)``; never clamps, wastes up to one binade.
    - ``EVEN`` (AMD Quark's default): round amax to the element's precision (round-half-even on its
      mantissa, ``mantissa_bits`` of the element) first, then ``s = floor(log2(rounded)) - emax``: the scale
      moves up one binade exactly when amax would round up into the next binade.
    - ``RCEIL`` (NVIDIA's ``cvt.rp.satfinite.ue8m0x2.f32`` recipe for MXFP8 scales, torchao's RCEIL):
      ``s = ceil(log2(fp32(amax / max_element)))``: the quotient is rounded to float32 (RNE) first, then rounded
      up to a power of two exactly (from its bits, no float log). This is the smallest power of two that keeps
      every element within the element max, except where the quotient is subnormal and its float32 rounding
      drops below the true value (e.g. amax one ulp above ``max * 2**-127`` gives ``s = -127``, byte 0, as the
      hardware and torchao do; an exact ceiling would give byte 1).

    Blocks of all zeros get ``s`` = the scale format's smallest exponent; a NaN or Inf in a block makes that
    block's scale NaN (the E8M0 NaN code 0xFF) and the whole block NaN, as the OCP spec reads.
    """

    FLOOR = "floor"
    CEIL = "ceil"
    EVEN = "even"
    RCEIL = "rceil"


class TensorScale(enum.Enum):
    """The per-tensor float32 scale ``g`` of a two-level format (NVFP4): block scales are stored in a narrow
    float format (float8_e4m3fn) *relative to* ``g``, and a value is ``element * block_scale * g``.

    - ``NONE``: no tensor scale; block scales follow the ordinary rules (the default of every spec).
    - ``ONE``: the two-level arithmetic with ``g = 1`` (NVFP4 without a global scale: torchao's
      ``nvfp4_quantize(x, per_tensor_scale=None)``).
    - ``AMAX``: ``g = amax(|x|) / (max_element * max_scale)`` computed from the whole tensor at every call
      (NVFP4: amax / (6 * 448), torchao's ``per_tensor_amax_to_scale``); dynamic.
    - ``GIVEN``: ``g`` is passed at the call (``quantize(x, spec, tensor_scale=g)``); static / calibrated.

    The exact arithmetic (order of operations, clamps, zero/NaN/Inf rules) is in docs/numerics.md
    ("Two-level scales").
    """

    NONE = "none"
    ONE = "one"
    AMAX = "amax"
    GIVEN = "given"


@dataclass(frozen=True)
class IntDType:
    """An integer format: ``bits`` wide, two's complement when ``signed`` else unsigned.

    ``min``/``max`` are the full two's-complement range (int4: -8..7); a symmetric "narrow" range (-7..7) is an
    option of the quantization spec, not a different dtype.
    """

    name: str
    bits: int
    signed: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.bits, int) or not 1 <= self.bits <= 16:
            raise ValueError(f"IntDType {self.name!r}: bits must be an int in [1, 16], got {self.bits!r}")
        if self.signed and self.bits < 2:
            raise ValueError(f"IntDType {self.name!r}: a signed integer needs at least 2 bits")

    @property
    def min(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def max(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two the format holds (int8: 6, since 2**6 <= 127 < 2**7)."""
        return self.max.bit_length() - 1

    @property
    def mantissa_bits(self) -> int:
        """Precision below the leading bit at the top of the range (int8: 6), used by ``ScaleMode.EVEN``."""
        return self.emax

    @property
    def max_finite(self) -> float:
        return float(self.max)

    @property
    def is_float(self) -> bool:
        return False


@dataclass(frozen=True)
class FloatDType:
    """A binary floating-point format whose values all fit in float32.

    ``bias`` defaults to ``2**(exponent_bits-1) - 1``. ``subnormals=False`` (only for exponent-only formats,
    ``mantissa_bits == 0``, such as E8M0) makes exponent field 0 an ordinary power of two and the format has
    no zero. ``signed=False`` drops the sign bit. ``saturate`` is the format's default overflow behaviour
    (``None``: saturate only for ``Specials.FINITE``, the ml_dtypes semantics).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int | None = None
    specials: Specials = Specials.FINITE
    signed: bool = True
    subnormals: bool = True

    def __post_init__(self) -> None:
        e, m = self.exponent_bits, self.mantissa_bits
        if not isinstance(e, int) or not 1 <= e <= 8:
            raise ValueError(f"FloatDType {self.name!r}: exponent_bits must be an int in [1, 8], got {e!r}")
        if not isinstance(m, int) or not 0 <= m <= 23:
            raise ValueError(f"FloatDType {self.name!r}: mantissa_bits must be an int in [0, 23], got {m!r}")
        if self.bias is None:
            object.__setattr__(self, "bias", (1 << (e - 1)) - 1)
        if not isinstance(self.specials, Specials):
            raise ValueError(f"FloatDType {self.name!r}: specials must be a Specials member, got {self.specials!r}")
        if not self.subnormals and m != 0:
            raise ValueError(f"FloatDType {self.name!r}: subnormals=False is supported for mantissa_bits=0 only")
        if self.specials is Specials.FNUZ and not self.signed:
            raise ValueError(f"FloatDType {self.name!r}: FNUZ puts NaN on the sign bit; it needs signed=True")
        if self.specials is Specials.IEEE and e < 2:
            raise ValueError(f"FloatDType {self.name!r}: IEEE specials need at least 2 exponent bits")
        if self.emax > 127 or self.emin - m < -149:
            raise ValueError(
                f"FloatDType {self.name!r}: values must fit in float32 (emax {self.emax} <= 127 and smallest "
                f"exponent {self.emin - m} >= -149)"
            )
        if self.emax < self.emin:
            raise ValueError(f"FloatDType {self.name!r}: no finite normal numbers with these specials")

    # -- derived constants ------------------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def _bias(self) -> int:
        """``bias`` as an int (``__post_init__`` replaces the default None with ``2**(e-1) - 1``)."""
        return int(self.bias or 0)

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self._bias if self.subnormals else -self._bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite number."""
        top = (1 << self.exponent_bits) - 1 - self._bias  # exponent of the all-ones exponent field
        if self.specials is Specials.IEEE:
            return top - 1
        if self.specials is Specials.FN and self.mantissa_bits == 0:
            return top - 1  # the whole top binade is the NaN code
        return top

    @property
    def max_finite(self) -> float:
        m = self.mantissa_bits
        top_mantissa = (1 << m) - 1
        if self.specials is Specials.FN and m > 0:
            top_mantissa -= 1  # all-ones mantissa in the top binade is NaN
        if self.specials is Specials.FN and m == 0:
            top_mantissa = 0
        return float((1 << m) + top_mantissa) * 2.0 ** (self.emax - m)

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (the smallest normal when there are no subnormals)."""
        return 2.0 ** (self.emin - self.mantissa_bits) if self.subnormals else self.min_normal

    @property
    def has_inf(self) -> bool:
        return self.specials is Specials.IEEE

    @property
    def has_nan(self) -> bool:
        return self.specials is not Specials.FINITE

    @property
    def has_zero(self) -> bool:
        return self.subnormals

    @property
    def has_negative_zero(self) -> bool:
        return self.signed and self.subnormals and self.specials is not Specials.FNUZ

    @property
    def default_saturate(self) -> bool:
        """ml_dtypes' overflow rule: only formats without Inf and NaN saturate by default."""
        return self.specials is Specials.FINITE

    @property
    def is_float(self) -> bool:
        return True


@dataclass(frozen=True)
class BlockDType:
    """A block format: ``block_size`` elements of ``element`` share one scale stored in ``scale`` (E8M0: a
    power of two; a float format with mantissa bits for two-level formats such as NVFP4).

    ``scale_mode`` is the default rule for choosing a power-of-two shared exponent (``ScaleMode``).
    ``tensor_scale`` (``TensorScale``) makes the format two-level: the block scales are stored relative to a
    per-tensor float32 scale (NVFP4: ``TensorScale.AMAX``). Shared-microexponent
    formats (MX9/MX6/MX4) also set ``subblock_size`` (2) and ``subblock_shift_bits`` (1): each sub-block may
    shift the shared exponent down by up to ``2**subblock_shift_bits - 1``. ``narrow`` clamps signed integer
    elements to ``[-max, max]`` (MXINT8 uses -127..127). ``bump_on_overflow`` raises the shared exponent once
    when an element would round past the element range (bfp16).
    """

    name: str
    element: Union[FloatDType, IntDType]
    block_size: int
    scale: FloatDType
    scale_mode: ScaleMode = ScaleMode.FLOOR
    subblock_size: int = 1
    subblock_shift_bits: int = 0
    narrow: bool = False
    bump_on_overflow: bool = False
    tensor_scale: TensorScale = TensorScale.NONE
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"BlockDType {self.name!r}: block_size must be a positive int, got {self.block_size!r}")
        if self.subblock_size <= 0 or self.block_size % self.subblock_size:
            raise ValueError(f"BlockDType {self.name!r}: subblock_size must divide block_size")
        if not isinstance(self.tensor_scale, TensorScale):
            raise TypeError(f"BlockDType {self.name!r}: tensor_scale must be a TensorScale, got {self.tensor_scale!r}")
        if self.tensor_scale is not TensorScale.NONE and not (
                isinstance(self.element, FloatDType) and self.scale.mantissa_bits > 0):
            raise ValueError(f"BlockDType {self.name!r}: a two-level format needs float elements and a float scale "
                             f"format with mantissa bits (e.g. float8_e4m3fn), got {self.element.name} / "
                             f"{self.scale.name}")

    @property
    def bits_per_element(self) -> float:
        shift = self.subblock_shift_bits / self.subblock_size
        return self.element.bits + shift + self.scale.bits / self.block_size

    @property
    def is_float(self) -> bool:
        return False


@dataclass(frozen=True)
class GGUFDType:
    """A GGUF block type with llama.cpp's own quantizer: the k-quants (Q2_K ... Q6_K) and the 32-element types
    (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL).

    k-quants: super-blocks of ``block_size`` (256) elements along a row, cut into sub-blocks of
    ``subblock_size`` (16 or 32) elements. Each sub-block has an integer scale code (``scale_bits`` wide: 4, 6,
    or 8 for Q6_K's int8) and, when ``min_bits`` > 0, an integer min code; both are multiplied by fp16
    super-block scales ``d`` (and ``dmin``). A value is ``(d * scale_code) * code - (dmin * min_code)``.
    32-element types (``scale_bits == 0``): one block of 32 is its own sub-block and its fp16 ``d`` is the scale;
    with ``offset16`` (Q4_1, Q5_1) the block also stores its fp16 offset ``m``: a value is ``d * code + m``.
    ``levels`` (IQ4_NL): the codes are indices into this non-uniform grid of integers: a value is
    ``d * levels[code]``.

    The mins and ``m`` are FLOAT offsets of the block (``QTensor.offsets``: the value of code 0), not integer
    zero points. ``element`` is the code format as qcore holds the codes: unsigned (uint2/uint4/uint5) for the
    formats with offsets, signed for the symmetric ones (int3/int4/int5/int6: the stored ``L - 4`` / ``L - 8``
    / ``L - 16`` / ``L - 32``; int8 for Q8_0). ``ggml_type`` is the ggml_type / GGMLQuantizationType number and
    ``type_size`` the bytes of one block in a GGUF file. The quantizer is llama.cpp's (``qcore._kquants``); the
    byte layout is ``qcore.packing.pack_gguf_blocks``'s.
    """

    name: str
    element: IntDType
    subblock_size: int
    scale_bits: int
    min_bits: int
    ggml_type: int
    type_size: int
    block_size: int = 256
    offset16: bool = False
    levels: tuple = ()
    super_scale: FloatDType = field(default_factory=lambda: _F16)
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.block_size % self.subblock_size:
            raise ValueError(f"GGUFDType {self.name!r}: subblock_size must divide block_size")

    @property
    def has_mins(self) -> bool:
        """True when blocks carry float offsets (k-quant min codes under ``dmin``, or Q4_1/Q5_1's fp16 ``m``)."""
        return self.min_bits > 0 or self.offset16

    @property
    def is_kquant(self) -> bool:
        return self.block_size == 256

    @property
    def bits_per_element(self) -> float:
        return self.type_size * 8 / self.block_size

    @property
    def is_float(self) -> bool:
        return False


DType = Union[IntDType, FloatDType, BlockDType, GGUFDType]


def _ints() -> list[IntDType]:
    out: list[IntDType] = []
    for b in range(2, 17):
        out.append(IntDType(f"int{b}", b, True))
    for b in range(1, 17):
        out.append(IntDType(f"uint{b}", b, False))
    return out


_S = Specials
_E8M0 = FloatDType("float8_e8m0fnu", 8, 0, 127, _S.FN, signed=False, subnormals=False)
_INT8 = IntDType("int8", 8)

_FLOATS = [
    FloatDType("float32", 8, 23, 127, _S.IEEE),
    FloatDType("float16", 5, 10, 15, _S.IEEE),
    FloatDType("bfloat16", 8, 7, 127, _S.IEEE),
    FloatDType("float8_e4m3fn", 4, 3, 7, _S.FN),
    FloatDType("float8_e4m3fnuz", 4, 3, 8, _S.FNUZ),
    FloatDType("float8_e4m3b11fnuz", 4, 3, 11, _S.FNUZ),
    FloatDType("float8_e4m3", 4, 3, 7, _S.IEEE),
    FloatDType("float8_e3m4", 3, 4, 3, _S.IEEE),
    FloatDType("float8_e5m2", 5, 2, 15, _S.IEEE),
    FloatDType("float8_e5m2fnuz", 5, 2, 16, _S.FNUZ),
    FloatDType("float6_e2m3fn", 2, 3, 1, _S.FINITE),
    FloatDType("float6_e3m2fn", 3, 2, 3, _S.FINITE),
    FloatDType("float4_e2m1fn", 2, 1, 1, _S.FINITE),
    # Scale formats: E8M0 (OCP MX shared scale) and unsigned E5M3 (NVIDIA-style fine scale; bias 15, no NaN).
    _E8M0,
    FloatDType("float8_e5m3", 5, 3, 15, _S.FINITE, signed=False),
    # Sign-magnitude fixed point in [-(2 - 2**-m), 2 - 2**-m], m = mantissa_bits (max 1.984375 / 1.875 / 1.5):
    # the elements of MX9 / MX6 / MX4.
    FloatDType("float8_e1m6", 1, 6, 1, _S.FINITE),
    FloatDType("float5_e1m3", 1, 3, 1, _S.FINITE),
    FloatDType("float3_e1m1", 1, 1, 1, _S.FINITE),
]

_F = {d.name: d for d in _FLOATS}
_F16 = _F["float16"]


def _blocks() -> list[BlockDType]:
    mx = [
        ("mxfp8_e4m3", _F["float8_e4m3fn"]),
        ("mxfp8_e5m2", _F["float8_e5m2"]),
        ("mxfp6_e2m3", _F["float6_e2m3fn"]),
        ("mxfp6_e3m2", _F["float6_e3m2fn"]),
        ("mxfp4", _F["float4_e2m1fn"]),
    ]
    out: list[BlockDType] = [BlockDType(n, el, 32, _E8M0, ScaleMode.FLOOR, description="OCP MX v1.0")
                             for n, el in mx]
    out.append(BlockDType("mxint8", _INT8, 32, _E8M0, ScaleMode.FLOOR, narrow=True, description="OCP MX v1.0"))
    # Shared-microexponent formats (Rouhani et al. 2023, AMD Quark's MX9/MX6/MX4): sign-magnitude elements
    # with 7/4/2 magnitude bits, blocks of 16, one 8-bit shared exponent, one 1-bit microexponent per pair.
    # A sign + m-bit magnitude k * 2**(1-m) is exactly the E1M(m-1) float grid with bias 1 (exponent field 0
    # holds the small magnitudes as "subnormals"), -0 included, so the elements are FloatDTypes.
    for name, el in (("mx9", "float8_e1m6"), ("mx6", "float5_e1m3"), ("mx4", "float3_e1m1")):
        out.append(
            BlockDType(
                name, _F[el], 16, _E8M0, ScaleMode.FLOOR,
                subblock_size=2, subblock_shift_bits=1, description="shared microexponents",
            )
        )
    out.append(
        BlockDType("bfp16", _INT8, 8, _E8M0, ScaleMode.FLOOR, bump_on_overflow=True, description="AMD bfp16")
    )
    # NVIDIA NVFP4 (Blackwell): fp4 e2m1 in blocks of 16, block scales in e4m3 under a float32 tensor scale
    # amax / (6 * 448); docs/numerics.md "Two-level scales" has the exact arithmetic (torchao's).
    out.append(
        BlockDType("nvfp4", _F["float4_e2m1fn"], 16, _F["float8_e4m3fn"], tensor_scale=TensorScale.AMAX,
                   description="NVIDIA NVFP4")
    )
    return out


def _all() -> list[DType]:
    return [*_ints(), *_FLOATS, *_blocks()]


DTYPES: dict[str, DType] = {d.name: d for d in _all()}
"""The one table of named formats. Keys are the canonical names (ml_dtypes spelling for elements)."""


def _gguf_types() -> list[GGUFDType]:
    def u(b: int) -> IntDType:
        return IntDType(f"uint{b}", b, False)

    def i(b: int) -> IntDType:
        return IntDType(f"int{b}", b, True)

    # name, element, sub-block, scale bits, min bits, ggml_type, bytes per 256 (ggml-common.h's block_q*_K)
    rows = [("q2_k", u(2), 16, 4, 4, 10, 84), ("q3_k", i(3), 16, 6, 0, 11, 110), ("q4_k", u(4), 32, 6, 6, 12, 144),
            ("q5_k", u(5), 32, 6, 6, 13, 176), ("q6_k", i(6), 16, 8, 0, 14, 210)]
    out = [GGUFDType(n, el, sub, sb, mb, t, size, description="GGUF k-quant (llama.cpp)")
           for n, el, sub, sb, mb, t, size in rows]
    # name, element, ggml_type, bytes per 32, stores an fp16 offset m (ggml-common.h's block_q4_0 ... block_q8_0)
    rows32 = [("q4_0", i(4), 2, 18, False), ("q4_1", u(4), 3, 20, True), ("q5_0", i(5), 6, 22, False),
              ("q5_1", u(5), 7, 24, True), ("q8_0", i(8), 8, 34, False)]
    out += [GGUFDType(n, el, 32, 0, 0, t, size, block_size=32, offset16=off, description="GGUF (llama.cpp)")
            for n, el, t, size, off in rows32]
    # IQ4_NL: 4-bit indices into a non-uniform grid (ggml-common.h's kvalues_iq4nl), one fp16 d per 32
    iq4nl = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
    out.append(GGUFDType("iq4_nl", u(4), 32, 0, 0, 20, 18, block_size=32, levels=iq4nl,
                         description="GGUF non-linear 4-bit (llama.cpp)"))
    return out


GGUF_DTYPES: dict[str, GGUFDType] = {d.name: d for d in _gguf_types()}
"""The GGUF types with llama.cpp's quantizer: k-quants ``q2_k`` ... ``q6_k`` and ``q4_0``, ``q4_1``, ``q5_0``,
``q5_1``, ``q8_0``, ``iq4_nl`` (llama.cpp's names in lower case; ``get_dtype`` also takes ``"Q4_K"``). A table
of its own: they are not element or block formats, and ``DTYPES``' users (the oracle kit's ``formats``,
conformance) iterate over those."""

# Short aliases people type; each maps to exactly one canonical entry.
_ALIASES = {
    "fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16",
    "fp8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2",
    "fp8_e4m3fnuz": "float8_e4m3fnuz", "fp8_e5m2fnuz": "float8_e5m2fnuz",
    "fp6_e2m3": "float6_e2m3fn", "fp6_e3m2": "float6_e3m2fn", "fp4": "float4_e2m1fn", "fp4_e2m1": "float4_e2m1fn",
    "e8m0": "float8_e8m0fnu", "e5m3": "float8_e5m3", "mxfp8": "mxfp8_e4m3", "mxfp6": "mxfp6_e2m3",
}


def get_dtype(dtype: Union[str, DType]) -> DType:
    """Resolve a name (or pass a dtype object through). Unknown names raise ``ValueError`` listing choices."""
    if isinstance(dtype, (IntDType, FloatDType, BlockDType, GGUFDType)):
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a name or a qcore dtype, got {type(dtype).__name__}")
    key = dtype.strip().lower()
    key = _ALIASES.get(key, key)
    if key in GGUF_DTYPES:
        return GGUF_DTYPES[key]
    try:
        return DTYPES[key]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPES))}, GGUF k-quants: "
            f"{', '.join(GGUF_DTYPES)} (aliases: {', '.join(sorted(_ALIASES))})"
        ) from None

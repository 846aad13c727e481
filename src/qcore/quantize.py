"""Quantize, dequantize, fake-quantize: ``QuantSpec`` (what to do) and ``QTensor`` (the result).

The semantics (scales, rounding, saturation, codes, block formats) live in ``quantize``'s docstring, which
``help(qcore.quantize)`` shows: in the ``qcore`` namespace ``qcore.quantize`` is the function, which shadows this
module. docs/numerics.md ('Scales', 'Quantize') states the same rules and where qcore differs from other
libraries.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np

from functools import partial

from . import _fast, _given, _kquants
from ._typing import Array, ArrayLike, KeyLike, SpecLike
from ._backend import is_torch, np_view, ops, to_array
from ._compiled import compiled
from ._elements import bump_from_extremes, check_given_scale, check_param, int_clip, round_elements
from ._two_level import F32_MIN_NORMAL, f32_const, tensor_scale_from_amax, two_level_multipliers, two_level_scales
from ._microexp import dequant_microexp_blocks, quantize_microexp_blocks
from .cast import cast, decode, encode
from .dtypes import (GGUF_DTYPES, BlockDType, FloatDType, IntDType, ScaleMode, GGUFDType, TensorScale,
                     get_dtype)
from .granularity import (Granularity, PerBlock, PerChannel, PerGroup, PerTensor, as_int, check_granularity,
                          from_blocks, scales_to_blocked, to_blocks)
from .granularity import scale_shape as _scale_shape
from .rounding import RoundingMode, check_mode, pow2
from .scales import (round_scale, asymmetric_scale, inverse_pow2_scales, pow2_scale_exponent, scale_exponent_range,
                     symmetric_scale)

__all__ = ["QuantSpec", "QTensor", "make_spec", "quantize", "dequantize", "fake_quantize", "fake_quantizer"]

_F32 = get_dtype("float32")


@dataclass(frozen=True)
class QuantSpec:
    """What a quantizer does; frozen and validated at construction.

    dtype: element format (``IntDType`` or ``FloatDType``; a name is resolved).
    granularity: ``PerTensor()``, ``PerChannel(axis)``, ``PerGroup(size, axis)`` or ``PerBlock(shape)``.
    symmetric: False adds an integer zero point (integer elements only). Default (None): True, except for
        unsigned integer dtypes (``uint8``, ...), which default to False (asymmetric, with a zero point).
        ``symmetric=True`` with an unsigned dtype is allowed and means zero point 0 over ``[0, qmax]``: scale
        ``amax / qmax`` and negative inputs clamp to code 0 (e.g. post-ReLU activations).
    scale_dtype: format the scales are stored in (float32, float16, bfloat16, float8_e8m0fnu, float8_e5m3,
        float8_e4m3fn, ...). ``float8_e8m0fnu`` implies ``pow2_scale``.
    pow2_scale: scales are powers of two chosen by ``scale_mode``.
    scale_mode: ``ScaleMode`` for power-of-two scales (FLOOR = OCP MX).
    rounding: ``RoundingMode`` of the elements; STOCHASTIC needs ``key=`` at the call.
    saturate: float elements: clamp at ±max (default True inside quantize).
    narrow_range: signed integers use [-max, max] (int8: -127..127).
    unit_exponent: integer elements of a block format mean ``code * 2**unit_exponent`` (MXINT8: -6); an int
        in ``[-126, 127 - emax]`` (``emax``: the dtype's, int8: 6) so that ``2**unit_exponent`` and
        ``qmax * 2**unit_exponent`` are normal float32 numbers.
    subblock_size, subblock_shift_bits: shared microexponents (MX9/MX6/MX4): each sub-block of the block may
        lower the shared exponent by up to ``2**subblock_shift_bits - 1``. Ints: ``subblock_size >= 1``,
        ``0 <= subblock_shift_bits <= 7`` (shifts up to 127 keep every ``2**-shift`` a float32).
    bump_on_overflow: bfp16's rule: if an element rounds past the integer range, raise the shared exponent once.
    tensor_scale_mode: ``TensorScale``: NONE (default) or a two-level scale (NVFP4): block scales stored in
        ``scale_dtype`` relative to a per-tensor float32 scale that is 1 (ONE), computed from the tensor's amax
        (AMAX) or passed at the call as ``tensor_scale=`` (GIVEN). Float elements, a non-power-of-two
        ``scale_dtype`` narrower than float32.
    gguf: a GGUF type whose llama.cpp quantizer the spec follows (``qcore.dtypes.GGUF_DTYPES``): a k-quant
        (``"q2_k"`` ... ``"q6_k"``), ``"q4_0"``, ``"q4_1"``, ``"q5_0"``, ``"q5_1"``, ``"q8_0"`` or ``"iq4_nl"``; or
        "" (default). Set by ``make_spec("q4_k")``, which also sets the fields it implies: ``dtype`` the code
        format (uint4 for Q4_K), ``granularity=PerGroup(sub-block size)`` along the last axis (rows; 32 for
        Q4_K/Q5_K and the 32-element types, 16 for the other k-quants), ``symmetric`` False exactly for the
        formats with offsets (Q2_K/Q4_K/Q5_K, Q4_1/Q5_1), whose offsets are FLOAT (``QTensor.offsets``), not
        integer zero points, and float32 ``scale_dtype`` (the sub-block scales ``d * scale_code`` are exact
        float32 values). Scales are llama.cpp's, bit for bit (docs/numerics.md, "GGUF k-quants").
    name: the format name this spec came from (for messages and exporters), or "".
    """

    dtype: Union[IntDType, FloatDType]
    granularity: Granularity = PerTensor()
    symmetric: Optional[bool] = None
    scale_dtype: FloatDType = _F32
    pow2_scale: bool = False
    scale_mode: ScaleMode = ScaleMode.FLOOR
    rounding: RoundingMode = RoundingMode.NEAREST_EVEN
    saturate: bool = True
    narrow_range: bool = False
    unit_exponent: int = 0
    subblock_size: int = 1
    subblock_shift_bits: int = 0
    bump_on_overflow: bool = False
    tensor_scale_mode: TensorScale = TensorScale.NONE
    gguf: str = ""
    name: str = field(default="", compare=False)

    def __post_init__(self):
        d = get_dtype(self.dtype)
        if isinstance(d, (BlockDType, GGUFDType)):
            raise ValueError(f"QuantSpec.dtype is the element format; build block formats with make_spec({d.name!r})")
        object.__setattr__(self, "dtype", d)
        sd = get_dtype(self.scale_dtype)
        if not isinstance(sd, FloatDType):
            raise ValueError(f"scale_dtype must be a float format, got {sd.name}")
        object.__setattr__(self, "scale_dtype", sd)
        check_granularity(self.granularity)
        if self.symmetric is None:
            object.__setattr__(self, "symmetric", not (isinstance(d, IntDType) and not d.signed))
        for name in ("symmetric", "pow2_scale", "saturate", "narrow_range", "bump_on_overflow"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"QuantSpec.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("unit_exponent", "subblock_size", "subblock_shift_bits"):
            v = as_int(getattr(self, name))
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"QuantSpec.{name} must be an int, got {getattr(self, name)!r}")
            object.__setattr__(self, name, v)
        if not isinstance(self.name, str):
            raise TypeError(f"QuantSpec.name must be a str, got {self.name!r}")
        if not isinstance(self.scale_mode, ScaleMode):
            raise TypeError(f"QuantSpec.scale_mode must be a qcore.ScaleMode, got {self.scale_mode!r}")
        if not isinstance(self.rounding, RoundingMode):
            raise TypeError(f"QuantSpec.rounding must be a qcore.RoundingMode, got {self.rounding!r}")
        if sd.mantissa_bits == 0 and not self.pow2_scale:
            object.__setattr__(self, "pow2_scale", True)
        if not self.symmetric:
            if not isinstance(d, IntDType):
                raise ValueError(f"asymmetric (zero-point) quantization needs an integer dtype, got {d.name}")
            if self.pow2_scale:
                hint = " (unsigned dtypes default to asymmetric; pass symmetric=True)" if not d.signed else ""
                raise ValueError(f"asymmetric quantization with power-of-two scales ({sd.name} / pow2_scale) is "
                                 f"not supported{hint}")
        if self.narrow_range and not (isinstance(d, IntDType) and d.signed and self.symmetric):
            raise ValueError("narrow_range applies to symmetric signed integer specs only")
        if self.unit_exponent and not (isinstance(d, IntDType) and self.pow2_scale):
            raise ValueError("unit_exponent applies to integer elements with power-of-two scales only")
        if self.unit_exponent:
            lo, hi = -126, 127 - d.emax
            if not lo <= self.unit_exponent <= hi:
                raise ValueError(f"QuantSpec.unit_exponent must be in [{lo}, {hi}] for {d.name} (so that "
                                 f"2**unit_exponent and qmax * 2**unit_exponent are float32 numbers), got "
                                 f"{self.unit_exponent}")
        if self.subblock_size < 1:
            raise ValueError(f"QuantSpec.subblock_size must be >= 1, got {self.subblock_size}")
        if not 0 <= self.subblock_shift_bits <= 7:
            raise ValueError(f"QuantSpec.subblock_shift_bits must be in [0, 7] (shifts up to 127), got "
                             f"{self.subblock_shift_bits}")
        if self.subblock_shift_bits and not (self.pow2_scale and isinstance(self.granularity, PerGroup)
                                              and self.granularity.size % self.subblock_size == 0):
            raise ValueError("shared microexponents need power-of-two scales and PerGroup blocks that are a "
                             f"multiple of subblock_size ({self.subblock_size}), got granularity "
                             f"{self.granularity!r}")
        if self.bump_on_overflow and not (self.pow2_scale and isinstance(d, IntDType)):
            raise ValueError("bump_on_overflow needs integer elements and power-of-two scales")
        _check_two_level_spec(self)
        _check_gguf_spec(self)

    @property
    def gguf_dtype(self) -> Optional[GGUFDType]:
        """The ``GGUFDType`` of a k-quant spec (``gguf``), else None."""
        return GGUF_DTYPES[self.gguf] if self.gguf else None

    @property
    def qmin(self) -> float:
        d = self.dtype
        if isinstance(d, IntDType):
            return float(-d.max if self.narrow_range else d.min)
        return -d.max_finite

    @property
    def qmax(self) -> float:
        d = self.dtype
        return float(d.max) if isinstance(d, IntDType) else d.max_finite

    def scale_shape(self, shape) -> tuple:
        """Shape of this spec's scales for an input of ``shape``."""
        return _scale_shape(self.granularity, shape)

    @property
    def two_level(self) -> bool:
        """True when block scales sit under a per-tensor scale (``tensor_scale_mode`` is not NONE)."""
        return self.tensor_scale_mode is not TensorScale.NONE

    def bits_per_element(self, shape=None) -> float:
        """Storage bits per element of a tensor quantized with this spec: the element bits, plus shared
        microexponent bits (``subblock_shift_bits / subblock_size``), plus the scales (``scale_dtype`` bits, and
        the zero point in ``dtype`` bits when asymmetric) amortised over the elements sharing them, plus a
        two-level spec's float32 per-tensor scale. MXFP4: ``4 + 8/32 = 4.25``; NVFP4: ``4 + 8/16`` (+ ``32/numel``).

        shape: the tensor's shape. Without it, per-group and per-block scales are amortised over their groups
        and blocks, but per-tensor and per-channel scales (and a two-level tensor scale), whose share depends on
        the shape, are left out (fp8 per tensor: 8.0). With it the figure is exact for that shape.
        GGUF k-quants: the bytes of a super-block over its 256 elements (Q4_K: 144 * 8 / 256 = 4.5).
        """
        if self.gguf:
            return self.gguf_dtype.bits_per_element
        bits = float(self.dtype.bits) + self.subblock_shift_bits / self.subblock_size
        per_scale = self.scale_dtype.bits + (0 if self.symmetric else self.dtype.bits)
        g = self.granularity
        if shape is None:
            if isinstance(g, PerGroup):
                bits += per_scale / g.size
            elif isinstance(g, PerBlock):
                bits += per_scale / math.prod(g.shape)
            return bits
        shape = tuple(as_int(s) for s in shape)
        if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
            raise ValueError(f"bits_per_element: shape must be a non-empty tuple of positive ints, got {shape!r}")
        numel = math.prod(shape)
        n_scales = math.prod(self.scale_shape(shape))
        bits += per_scale * n_scales / numel
        if self.two_level:
            bits += 32 / numel
        return bits


def _check_gguf_spec(spec: QuantSpec):
    """Validation of ``QuantSpec.gguf`` (called from ``__post_init__``): the k-quant's implied fields."""
    name = spec.gguf
    if not isinstance(name, str):
        raise TypeError(f"QuantSpec.gguf must be a str (a GGUF type name or ''), got {name!r}")
    if not name:
        return
    if name not in GGUF_DTYPES:
        raise ValueError(f"QuantSpec.gguf must be one of {', '.join(GGUF_DTYPES)} (or ''), got {name!r}")
    sb = GGUF_DTYPES[name]
    g = spec.granularity
    want = dict(dtype=sb.element, symmetric=not sb.has_mins, scale_dtype=get_dtype("float32"), pow2_scale=False,
                rounding=RoundingMode.NEAREST_EVEN, saturate=True, narrow_range=False, unit_exponent=0,
                subblock_size=1, subblock_shift_bits=0, bump_on_overflow=False, tensor_scale_mode=TensorScale.NONE)
    for k, v in want.items():
        if getattr(spec, k) != v:
            raise ValueError(f"gguf={name!r} fixes {k}={getattr(v, 'name', v)!r} (llama.cpp's {name.upper()}); "
                             f"got {k}={getattr(getattr(spec, k), 'name', getattr(spec, k))!r}. Build it with "
                             f"make_spec({name!r})")
    if not (isinstance(g, PerGroup) and g.size == sb.subblock_size):
        raise ValueError(f"gguf={name!r} needs granularity PerGroup({sb.subblock_size}) along the rows (the "
                         f"last axis), got {g!r}")


def _check_two_level_spec(spec: QuantSpec):
    """Validation of ``QuantSpec.tensor_scale_mode`` (called from ``__post_init__``)."""
    mode = spec.tensor_scale_mode
    if not isinstance(mode, TensorScale):
        raise TypeError(f"QuantSpec.tensor_scale_mode must be a qcore.TensorScale, got {mode!r}")
    if mode is TensorScale.NONE:
        return
    if not isinstance(spec.dtype, FloatDType):
        raise ValueError(f"tensor_scale_mode={mode.name}: two-level scales need float elements, got {spec.dtype.name}")
    if spec.pow2_scale:
        raise ValueError(f"tensor_scale_mode={mode.name}: two-level block scales are float scales; they cannot be "
                         f"powers of two (pow2_scale=True / scale_dtype={spec.scale_dtype.name})")
    if spec.scale_dtype.name == "float32":
        raise ValueError(f"tensor_scale_mode={mode.name}: two-level scales store block scales in a narrow float "
                         "format; scale_dtype must not be float32 (e.g. float8_e4m3fn, float8_e5m3)")


def _check_axis(axis) -> int:
    a = as_int(axis)
    if isinstance(a, bool) or not isinstance(a, int):
        raise TypeError(f"axis must be an int, got {axis!r}")
    return a


def _granularity_with_axis(g, axis: int, what: str):
    """``g`` with ``axis=`` applied: PerGroup/PerChannel take it; a granularity without one axis refuses it."""
    check_granularity(g)
    if isinstance(g, (PerGroup, PerChannel)):
        return dataclasses.replace(g, axis=axis)
    raise ValueError(f"axis={axis} does not apply to {what} {g!r}: {type(g).__name__} has no single axis; drop "
                     f"axis= (or use PerChannel/PerGroup)")


def make_spec(fmt: SpecLike, *, axis: Optional[int] = None, **overrides: Any) -> QuantSpec:
    """The default spec of a format name (or dtype), with keyword overrides of QuantSpec fields.

    Element formats default to per-tensor float32 scales, symmetric (unsigned integers: asymmetric). Block
    formats (``mxfp4``, ``mxint8``, ``mx9``, ``bfp16``, ...) give PerGroup(block_size, axis) with E8M0 scales and
    their scale rule; ``axis`` (default -1) picks the blocked axis. For element formats ``axis`` means
    per-channel along ``axis``. For a ``QuantSpec`` with PerGroup/PerChannel granularity ``axis`` replaces its
    axis; a PerTensor/PerBlock spec refuses ``axis`` (ValueError). With an explicit ``granularity=`` override,
    ``axis`` must equal that granularity's axis (or be omitted): a different one raises ValueError rather than
    being ignored. ``axis`` and granularity sizes may be numpy integers.
    """
    unknown = set(overrides) - {f.name for f in dataclasses.fields(QuantSpec)}
    if unknown:
        raise TypeError(f"unknown QuantSpec field(s): {', '.join(sorted(unknown))}")
    if axis is not None:
        axis = _check_axis(axis)
        if "granularity" in overrides:
            g = overrides["granularity"]
            check_granularity(g)
            if not isinstance(g, (PerGroup, PerChannel)):
                _granularity_with_axis(g, axis, "granularity=")  # raises
            if g.axis != axis:
                raise ValueError(f"axis={axis} conflicts with granularity={g!r} (axis {g.axis}); give the axis once, "
                                 f"in the granularity or as axis=")
            axis = None  # the granularity carries it
    if isinstance(fmt, QuantSpec):
        spec = fmt
        if axis is not None:
            overrides["granularity"] = _granularity_with_axis(spec.granularity, axis, "the spec's granularity")
        return dataclasses.replace(spec, **overrides) if overrides else spec
    d = get_dtype(fmt)
    if isinstance(d, GGUFDType):
        base = dict(dtype=d.element, granularity=PerGroup(d.subblock_size, -1 if axis is None else axis),
                    symmetric=not d.has_mins, gguf=d.name, name=d.name)
    elif isinstance(d, BlockDType):
        el = d.element
        unit = -el.emax if isinstance(el, IntDType) else 0
        base = dict(
            dtype=el, granularity=PerGroup(d.block_size, -1 if axis is None else axis), scale_dtype=d.scale,
            pow2_scale=d.scale.mantissa_bits == 0, scale_mode=d.scale_mode, narrow_range=d.narrow,
            unit_exponent=unit, subblock_size=d.subblock_size, subblock_shift_bits=d.subblock_shift_bits,
            bump_on_overflow=d.bump_on_overflow, tensor_scale_mode=d.tensor_scale, name=d.name,
        )
    else:
        gran = PerTensor() if axis is None else PerChannel(axis)
        base = dict(dtype=d, granularity=gran, name=d.name)
    base.update(overrides)
    return QuantSpec(**base)


@dataclass(frozen=True)
class QTensor:
    """A quantized tensor: ``codes`` (x's shape), ``scales`` (``spec.scale_shape(shape)``, float32 values that
    are exactly representable in ``spec.scale_dtype``), ``zero_points`` (same shape as scales, float32
    integers; None when symmetric), ``subblock_shifts`` (microexponent formats: int32, one per sub-block along
    the blocked axis, else None), ``tensor_scale`` (two-level specs such as NVFP4: the per-tensor float32
    scale ``g`` as a 0-d array, 1.0 under ``TensorScale.ONE``; else None). A two-level value is
    ``element * (g * scale)``.

    Codes are bit patterns (uint8, or int32 for > 8-bit formats) for float elements and integer values for
    integer elements (int8/uint8 up to 8 bits, else int32), as ``qcore.encode`` returns them.

    Float offsets (``offsets``, same shape as ``scales``, float32; None unless the spec has them): a value is
    ``code * scale + offset``, the offset being the value of code 0 of the block. GGUF k-quants with mins
    (Q2_K/Q4_K/Q5_K) have ``offset = -(dmin * min_code)``; llama.cpp's Q4_1/Q5_1 ``m`` is the same concept.
    They are not integer zero points (``zero_points`` stays None): llama.cpp's offsets are fp16 numbers that
    need not be a multiple of the scale.

    ``super_scales`` (k-quant specs only, ``spec.gguf``): the stored form of the scales, a
    ``GGUFScales`` (fp16 ``d``/``dmin`` per 256 elements, integer ``scale_codes``/``min_codes`` per
    sub-block) from which ``scales`` (``d * scale_code``) and ``offsets`` are derived exactly; it is what GGUF
    files hold (``qcore.packing.pack_gguf_blocks``) and what ``dequantize`` reads.
    """

    codes: Any
    scales: Any
    zero_points: Any
    spec: QuantSpec
    subblock_shifts: Any = None
    tensor_scale: Any = None
    offsets: Any = None
    super_scales: Any = None

    @property
    def shape(self) -> tuple:
        return tuple(self.codes.shape)

    @property
    def scale_codes(self) -> Any:
        """The scales as codes of ``spec.scale_dtype`` (``qcore.encode``), the bytes exporters and kernels store:
        ``uint8`` for 8-bit scale formats (E8M0: the biased exponent ``s + 127``, and 0xFF, its NaN code, for a
        NaN block; fp8 scales: their bit patterns), ``int32`` for wider ones (float16 / bfloat16: the 16-bit
        pattern; float32: its bits). Same array kind and device as ``scales``. A NaN scale in a format without a
        NaN code (``float8_e5m3``) raises ``ValueError``."""
        return encode(self.scales, self.spec.scale_dtype)


def spec_of(spec, axis, overrides) -> QuantSpec:
    """The spec of a call: ``spec`` itself, or ``make_spec(spec, axis=axis, **overrides)``."""
    if isinstance(spec, QuantSpec) and not overrides and axis is None:
        return spec
    return make_spec(spec, axis=axis, **overrides)


def _scaled(xb, sb, spec: QuantSpec, o):
    """x / scale for the element grid (exact for power-of-two scales)."""
    with o.quiet():
        if spec.pow2_scale:
            return xb * sb  # sb holds 2**-s here
        return xb / sb


def _pow2_exponents(xb, blocked, spec: QuantSpec, o):
    amax = o.amax(o.abs(xb), blocked.reduce_axes)
    s, bad = pow2_scale_exponent(amax, element=spec.dtype, mode=spec.scale_mode, scale_dtype=spec.scale_dtype,
                                 unit_exponent=spec.unit_exponent)
    return s, bad


def _quantize_blocks(x, spec: QuantSpec, scale, zero_point, key, o):
    """Core: returns (element values in scale units (float32, blocked layout, zero point added), scales
    (float32, scale shape), zero points or None, the Blocked layout, sub-block shifts or None)."""
    xb, blocked = to_blocks(x, spec.granularity, o)
    sshape = blocked.scale_shape
    zp = None
    if spec.subblock_shift_bits:
        return quantize_microexp_blocks(xb, blocked, spec, scale, key, o)
    if scale is None:
        if spec.pow2_scale:
            s, bad = _pow2_exponents(xb, blocked, spec, o)
            if spec.bump_on_overflow:
                s = _bump(xb, blocked, s, spec, key, o)
            scales = o.where(bad, np.float32(math.nan), pow2(s, o, x))
            inv = o.where(bad, np.float32(math.nan), pow2(-s, o, x))
        elif spec.symmetric:
            amax = o.amax(o.abs(xb), blocked.reduce_axes)
            scales = symmetric_scale(amax, dtype=spec.dtype, scale_dtype=spec.scale_dtype,
                                     narrow_range=spec.narrow_range)
        else:
            lo = o.amin(xb, blocked.reduce_axes)
            hi = o.amax(xb, blocked.reduce_axes)
            scales, zp = asymmetric_scale(lo, hi, dtype=spec.dtype, scale_dtype=spec.scale_dtype)
        scales = o.reshape(scales, sshape)
        if zp is not None:
            zp = o.reshape(zp, sshape)
    else:
        # Calibrated parameters arrive validated by prepare_params: float32 arrays of the scale shape, scales
        # rounded to the scale dtype, zero points integral and in range (None for symmetric specs).
        scales, zp = scale, zero_point
    if spec.pow2_scale:
        if scale is not None:
            inv = inverse_pow2_scales(scales, o, x)
        y = _scaled(xb, scales_to_blocked(inv, blocked, o), spec, o)
    else:
        y = _scaled(xb, scales_to_blocked(scales, blocked, o), spec, o)
    v = round_elements(y, spec, key, o)
    if isinstance(spec.dtype, IntDType):
        zpb = None if zp is None else scales_to_blocked(zp, blocked, o)
        v = int_clip(v, spec, o, zpb)
    return v, scales, zp, blocked, None


def _bump(xb, blocked, s, spec, key, o):
    """bfp16: raise the shared exponent once where any element of the block would round past the range."""
    if spec.rounding is RoundingMode.STOCHASTIC:
        # The random bits differ per element: round every element to see whether one overflows.
        sb = scales_to_blocked(s, blocked, o)
        r = round_elements(xb * pow2(o.clip(-sb, -127, 127), o, xb), spec, key, o)
        over = o.logical_or(r > np.float32(spec.qmax), r < np.float32(spec.qmin))
        anyover = o.amax(o.astype(over, o.int32), blocked.reduce_axes)
    else:
        return bump_from_extremes(s, o.amin(xb, blocked.reduce_axes), o.amax(xb, blocked.reduce_axes), spec, o)
    _, smax = scale_exponent_range(spec.scale_dtype)
    return o.minimum(s + o.reshape(anyover, tuple(s.shape)), smax)


# -- two-level scales (NVFP4): the rules are in src/qcore/_two_level.py ------------------------------------------

def _tensor_scale(x, spec: QuantSpec, given, o):
    """The per-tensor float32 scale ``g`` (0-d) of a two-level spec: the validated ``given`` one, 1 (ONE), or
    ``amax(|x|) / (max_element * max_scale)`` (AMAX) raised to float32's smallest normal 2**-126, 1 for an
    all-zero (or empty) tensor, NaN when the tensor holds a NaN or Inf."""
    if given is not None:
        return given
    if spec.tensor_scale_mode is TensorScale.ONE or math.prod(tuple(x.shape)) == 0:
        return f32_const(1.0, o, x)
    return tensor_scale_from_amax(o.amax(o.reshape(o.abs(x), (-1,)), 0, keepdims=False), spec, o, x)


def _quantize_two_level(x, spec: QuantSpec, scale, tensor_scale, key, o):
    """Two-level core: (element values (blocked), block scales, tensor scale g, dequantization multipliers,
    Blocked). The elementwise step is ``x * q_mul`` per block, then the element rounding."""
    xb, blocked = to_blocks(x, spec.granularity, o)
    g = _tensor_scale(x, spec, tensor_scale, o)
    if scale is None:
        amax = o.reshape(o.amax(o.abs(xb), blocked.reduce_axes), blocked.scale_shape)
        scales, q_mul, dq_mul = two_level_scales(amax, g, spec, o)
    else:
        scales = check_param(scale, blocked.scale_shape, "scale", o, x)
        check_given_scale(scales, spec, o)
        q_mul, dq_mul = two_level_multipliers(scales, g, o)
    with o.quiet():
        y = xb * scales_to_blocked(q_mul, blocked, o)
    v = round_elements(y, spec, key, o)
    return v, scales, g, dq_mul, blocked


def check_tensor_scale_arg(tensor_scale, spec: QuantSpec, o, like):
    """Validate the call's ``tensor_scale=`` against the spec; returns it as a 0-d float32 array/tensor on
    ``like``'s device, or None."""
    mode = spec.tensor_scale_mode
    if tensor_scale is None:
        if mode is TensorScale.GIVEN:
            raise ValueError(f"spec {spec.name or spec.dtype.name!r} has tensor_scale_mode=GIVEN: pass the per-tensor "
                             "scale as tensor_scale=")
        return None
    if mode in (TensorScale.NONE, TensorScale.ONE):
        raise ValueError(f"tensor_scale={tensor_scale!r}: spec {spec.name or spec.dtype.name!r} has "
                         f"tensor_scale_mode={mode.name}; a given tensor scale needs TensorScale.GIVEN or AMAX")
    if isinstance(tensor_scale, (bool, np.bool_, str, bytes)):
        raise TypeError(f"tensor_scale must be a positive float (or a 1-element array), got {tensor_scale!r}")
    try:
        with np.errstate(over="ignore"):  # a float64 beyond float32 becomes Inf and is refused below
            g = o.asarray(tensor_scale, o.float32, like) if o.name == "torch" else \
                np.asarray(tensor_scale, dtype=np.float32)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"tensor_scale must be a positive float (or a 1-element array), got {tensor_scale!r}") from None
    if math.prod(tuple(g.shape)) != 1:
        raise ValueError(f"tensor_scale must be one value, got shape {tuple(g.shape)}")
    g = o.reshape(g, ())
    v = float(g)
    if not (math.isfinite(v) and v >= float(F32_MIN_NORMAL)):
        raise ValueError(f"tensor_scale must be a finite float32 >= 2**-126 (a normal number), got {v!r}")
    return g


def _use_compiled(compile, x, spec) -> bool:
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be a bool, got {compile!r}")
    return compile and is_torch(x) and spec.rounding is not RoundingMode.STOCHASTIC


def _quantize_parts(x, scale, zero_point, key, tensor_scale=None, *, spec):
    """The pure core of quantize: float32 array -> (element values, scales, zero points, shifts, tensor scale)."""
    o = ops(x)
    g = None
    if spec.two_level:
        v, scales, g, _, blocked = _quantize_two_level(x, spec, scale, tensor_scale, key, o)
        zp = shifts = None
    else:
        v, scales, zp, blocked, shifts = _quantize_blocks(x, spec, scale, zero_point, key, o)
    # A NaN scale (a NaN or Inf in the block) already makes the whole block NaN, as in OCP MX: the element
    # codes of such a block are 0.
    v = o.where(o.isnan(scales_to_blocked(scales, blocked, o)), np.float32(0), v)
    return from_blocks(v, blocked, o), scales, zp, shifts, g


def _fake_quantize_pure(x, scale, zero_point, key, tensor_scale=None, *, spec):
    o = ops(x)
    if spec.two_level:
        v, _, _, dq_mul, blocked = _quantize_two_level(x, spec, scale, tensor_scale, key, o)
        return from_blocks(_dequant_two_level(v, dq_mul, blocked, o), blocked, o)
    v, scales, zp, blocked, shifts = _quantize_blocks(x, spec, scale, zero_point, key, o)
    return from_blocks(_dequant_blocks(v, scales, zp, shifts, blocked, spec, o), blocked, o)


def prepare_params(x, spec: QuantSpec, scale, zero_point, o):
    """Validate calibrated ``scale`` / ``zero_point`` against ``spec`` and ``x`` (float32) before any work.

    Returns (scale, zero_point) as float32 arrays of ``spec.scale_shape(x.shape)`` (broadcast if needed;
    detached: they get no gradient), scales rounded to ``spec.scale_dtype`` (RNE, saturating, like computed
    scales), or (None, None) for dynamic quantization. Also checks that ``spec.granularity`` fits ``x``.
    """
    if o.name == "torch" and scale is not None and _small_cpu_params(x, scale, zero_point):
        # Few parameters of a CPU tensor: validate them with numpy (no per-check tensor dispatch); same checks,
        # same messages, same bits.
        stand_in = np.broadcast_to(np.float32(0), tuple(x.shape))
        s, zp = prepare_params(stand_in, spec, np_view(scale), np_view(zero_point), ops(stand_in))
        return o.t.from_numpy(np.ascontiguousarray(s)), None if zp is None else o.t.from_numpy(np.ascontiguousarray(zp))
    sshape = spec.scale_shape(tuple(x.shape))
    if scale is None:
        if zero_point is not None:
            raise ValueError(f"zero_point={_brief(zero_point)} was given without scale=; a zero point belongs to a "
                             "calibrated scale: pass both (or neither, to compute them from x)")
        return None, None
    s = check_param(scale, sshape, "scale", o, x)
    if o.name == "torch":
        s = s.detach()
    check_given_scale(s, spec, o)
    if not spec.pow2_scale:
        s = round_scale(s, spec.scale_dtype, o, positive=s > 0)
    if spec.symmetric:
        if zero_point is not None:
            raise ValueError(f"zero_point={_brief(zero_point)} was given for a symmetric spec (no zero point); "
                             "use symmetric=False for zero-point quantization, or drop zero_point=")
        return s, None
    if zero_point is None:
        raise ValueError("an asymmetric spec with a given scale also needs zero_point=")
    zp = check_param(zero_point, sshape, "zero_point", o, x)
    if o.name == "torch":
        zp = zp.detach()
    _check_zero_points(zp, spec, o, "zero_point")
    return s, zp


def _small_cpu_params(x, scale, zero_point, limit: int = 4096) -> bool:
    """True when x is a CPU tensor and the given parameters are few values on the CPU (or Python/numpy)."""
    if x.device.type != "cpu":
        return False
    for p in (scale, zero_point):
        if p is None:
            continue
        if is_torch(p):
            if p.device.type != "cpu" or p.numel() > limit or p.requires_grad:
                return False
        elif np.size(p) > limit:
            return False
    return True


def _brief(v) -> str:
    """A short description of an argument's value for error messages."""
    shape = getattr(v, "shape", None)
    if shape is not None and len(tuple(shape)) > 0:
        return f"<array of shape {tuple(shape)}>"
    return repr(v)


def _check_zero_points(zp, spec: QuantSpec, o, name: str):
    """Zero points (float32 array) must be integers in the code range [qmin, qmax]."""
    with o.quiet():
        notint = o.logical_not(o.rint(zp) == zp)  # NaN and Inf included
    if o.any(notint):
        raise ValueError(f"{name} must hold integers (float32 integer values), got {float(zp[notint][0])!r}")
    lo, hi = spec.qmin, spec.qmax
    out = o.logical_or(zp < np.float32(lo), zp > np.float32(hi))
    if o.any(out):
        raise ValueError(f"{name} must lie in the code range [{int(lo)}, {int(hi)}] of {spec.dtype.name}, got "
                         f"{float(zp[out][0])!r}")


def _exact_f32(v, o, name: str):
    """A float (or integer) array as float32, refusing values that float32 does not hold exactly."""
    if o.name == "numpy":
        v = np.asarray(v)
        kind = v.dtype.kind
        if kind not in "fiu" and v.dtype.name != "bfloat16":
            raise TypeError(f"{name} must be a float array, got dtype {v.dtype}")
    elif v.dtype == o.t.bool or v.dtype.is_complex:
        raise TypeError(f"{name} must be a float tensor, got dtype {v.dtype}")
    f = o.astype(v, o.float32)
    if v.dtype in (np.float32, getattr(o, "float32", None)):
        return f
    with o.quiet():
        back = o.astype(f, v.dtype)
        same = o.logical_or(back == v, o.logical_and(o.isnan(f), o.isnan(back)))
    if not o.any(o.logical_not(same)):
        return f
    bad = v[o.logical_not(same)]
    raise ValueError(f"{name} must hold float32 values, got {float(bad[0])!r} ({v.dtype}), which float32 does "
                     "not represent exactly")


def check_qtensor(q: QTensor):
    """Validate a QTensor's parts against its spec before dequantizing; returns (codes, scales, zero points,
    shifts) with scales and zero points as float32."""
    spec = q.spec
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"QTensor.spec must be a QuantSpec, got {type(spec).__name__}")
    codes = q.codes
    if not (is_torch(codes) or isinstance(codes, np.ndarray)):
        raise TypeError(f"QTensor.codes must be a numpy array or a torch tensor, got {type(codes).__name__}")
    o = ops(codes)
    parts = {"scales": q.scales, "zero_points": q.zero_points, "subblock_shifts": q.subblock_shifts}
    for name, v in parts.items():
        if v is None:
            continue
        if is_torch(v) != is_torch(codes) or not (is_torch(v) or isinstance(v, np.ndarray)):
            kind = "a torch tensor" if is_torch(codes) else "a numpy array"
            raise TypeError(f"QTensor.{name} is {type(v).__name__}, but codes are {kind}; all parts of a QTensor "
                            "must be the same array kind")
        if o.name == "torch" and v.device != codes.device:
            raise ValueError(f"QTensor.{name} is on {v.device}, codes on {codes.device}; all parts must be on "
                             "one device")
    shape = tuple(codes.shape)
    sshape = spec.scale_shape(shape)
    if q.scales is None:
        raise ValueError("QTensor.scales is None; dequantize needs scales of shape "
                         f"{sshape} for codes of shape {shape}")
    for name in ("scales", "zero_points"):
        v = parts[name]
        if v is not None and tuple(v.shape) != sshape:
            raise ValueError(f"QTensor.{name} has shape {tuple(v.shape)}; spec {spec.name or spec.dtype.name!r} "
                             f"({spec.granularity!r}) needs {sshape} for codes of shape {shape}")
    scales = _exact_f32(q.scales, o, "QTensor.scales")
    check_given_scale(scales, spec, o, "QTensor.scales")
    if not spec.pow2_scale and spec.scale_dtype.name != "float32":
        r = cast(scales, spec.scale_dtype, saturate=True)
        off = o.logical_not(o.logical_or(r == scales, o.isnan(scales)))
        if o.any(off):
            raise ValueError(f"QTensor.scales must be {spec.scale_dtype.name} values (spec.scale_dtype), got "
                             f"{float(scales[off][0])!r}")
    zp = q.zero_points
    if spec.symmetric:
        if zp is not None:
            raise ValueError("QTensor.zero_points must be None for a symmetric spec, got "
                             f"{_brief(zp)}")
    else:
        if zp is None:
            raise ValueError(f"QTensor.zero_points is None, but the spec is asymmetric: it needs integer zero points "
                             f"of shape {sshape}")
        zp = _exact_f32(zp, o, "QTensor.zero_points")
        _check_zero_points(zp, spec, o, "QTensor.zero_points")
    shifts = q.subblock_shifts
    if spec.subblock_shift_bits:
        g = spec.granularity
        a = g.axis % len(shape)
        want = tuple(-(-n // g.size) * g.size // spec.subblock_size if i == a else n for i, n in enumerate(shape))
        if shifts is None:
            raise ValueError(f"QTensor.subblock_shifts is None, but {spec.name or 'this spec'} has shared "
                             f"microexponents: it needs integer shifts of shape {want}")
        kind_ok = shifts.dtype.kind in "iu" if o.name == "numpy" else \
            not (shifts.dtype.is_floating_point or shifts.dtype.is_complex or shifts.dtype == o.t.bool)
        if not kind_ok:
            raise TypeError(f"QTensor.subblock_shifts must be an integer array, got dtype {shifts.dtype}")
        if tuple(shifts.shape) != want:
            raise ValueError(f"QTensor.subblock_shifts has shape {tuple(shifts.shape)}; codes of shape {shape} need "
                             f"{want}")
        top = (1 << spec.subblock_shift_bits) - 1
        out = o.logical_or(shifts < 0, shifts > top)
        if o.any(out):
            raise ValueError(f"QTensor.subblock_shifts must lie in [0, {top}], got {int(shifts[out][0])}")
    elif shifts is not None:
        raise ValueError(f"QTensor.subblock_shifts must be None for a spec without shared microexponents, got "
                         f"{_brief(shifts)}")
    return codes, scales, zp, shifts


def quantize(x: ArrayLike, spec: SpecLike, *, axis: Optional[int] = None, scale: Optional[ArrayLike] = None,
             zero_point: Optional[ArrayLike] = None, key: KeyLike = None, tensor_scale: Optional[ArrayLike] = None,
             compile: bool = False, imatrix: Optional[ArrayLike] = None, **overrides: Any) -> QTensor:
    """Quantize ``x`` (float array) with ``spec`` (a QuantSpec, a format name or a dtype) -> ``QTensor``.

    ``scale``/``zero_point``: calibrated parameters of shape ``spec.scale_shape(x.shape)`` (static
    quantization; a smaller shape that broadcasts to it is accepted); if omitted they are computed from ``x``
    (dynamic). A given scale must be positive (NaN marks a NaN block) and is rounded to ``spec.scale_dtype``
    (RNE, saturating) like a computed one; power-of-two specs need exact powers of two. A zero point is
    needed exactly when the spec is asymmetric and a scale is given; it must hold integers in the code range.
    ``key``: for stochastic rounding. ``compile=True`` (torch tensors): run the same pure function through
    torch.compile, once per spec and shape class; bit-identical, eager fallback where no compiler is available
    (stochastic rounding stays eager). The QTensor holds no autograd graph (codes have no gradient).
    ``tensor_scale``: two-level specs (NVFP4) with ``TensorScale.GIVEN`` (required) or ``AMAX`` (replaces the
    computed one): the per-tensor float32 scale, a finite value >= 2**-126.

    ``quantize(x, spec)`` computes, per block of the spec's granularity, a scale (and zero point) from the block's
    statistic (absmax, or min/max when asymmetric) unless you pass calibrated ``scale=`` / ``zero_point=``; then
    codes = round(x / scale) (+ zero point) in the element format. ``dequantize(q)`` = (element value - zero
    point) * scale. ``fake_quantize(x, spec)`` = ``dequantize(quantize(x, spec))`` bit for bit, computed without
    materialising codes.

    A format name is shorthand for its default spec: ``fake_quantize(x, "mxfp4", axis=-1)`` (OCP FLOOR E8M0
    scales, blocks of 32 along ``axis``), ``quantize(x, "int4", granularity=PerGroup(128))``. Keyword overrides
    replace spec fields: ``fake_quantize(x, "mxfp4", scale_mode=ScaleMode.EVEN)``.

    Semantics decided here (the places where libraries differ; scale rules: ``qcore.ScaleMode`` and
    docs/numerics.md, 'Scales'):

    - Element rounding: ``spec.rounding`` (default nearest-even). Float elements saturate at ``±max_finite``
      inside quantize (OCP MX clamps; an FN format's NaN-on-overflow is for plain casts).
    - Power-of-two scales divide exactly (``x * 2**-s``); other scales divide in float32 (``x / scale``).
    - Integer codes are ``clip(round(x / scale) + zero_point, qmin, qmax)`` (``narrow_range``: qmin = -qmax).
    - Block formats with integer elements (MXINT8, bfp16, MX9/6/4) keep the OCP meaning of the scale: the element
      value is ``code * 2**unit_exponent`` (MXINT8: code/64), and the scale is the shared ``X = 2**s``.
    - Two-level scales (NVFP4, ``spec.tensor_scale_mode`` not ``TensorScale.NONE``): block scales in a narrow
      float format under a float32 tensor scale ``g``, with torchao's arithmetic; ``two_level_scales`` holds
      the whole rule (docs/numerics.md, "Two-level scales").
    - GGUF types (``"q2_k"`` ... ``"q6_k"``, ``"q4_0"`` ... ``"q8_0"``, ``"iq4_nl"``; ``spec.gguf``): llama.cpp's
      quantizer, bit for bit (``qcore._kquants``), along the last axis, which must be a multiple of the block
      (256 for k-quants, 32 otherwise); ``imatrix=`` (GGUF specs only) is the per-column importance (shape
      ``(x.shape[-1],)``, finite, >= 0): llama.cpp's ``quant_weights`` path. The QTensor carries
      ``super_scales`` and, for the formats with offsets, float ``offsets``. Computed on host numpy (torch
      tensors are copied there and back; ``compile=`` changes nothing).
    """
    spec = spec_of(spec, axis, overrides)
    if spec.gguf or imatrix is not None:
        return _quantize_gguf(x, spec, scale, zero_point, key, tensor_scale, compile, imatrix)
    key = check_mode(spec.rounding, key)
    x, o = to_array(x)
    if o.name == "torch":
        x = x.detach()
    x = o.astype(x, o.float32)
    use_compiled = _use_compiled(compile, x, spec)
    tensor_scale = check_tensor_scale_arg(tensor_scale, spec, o, x)
    scale, zero_point = prepare_params(x, spec, scale, zero_point, o)
    if not use_compiled:
        fast = _fast.run_quantize(x, spec, scale, zero_point, o, tensor_scale=tensor_scale)
        if fast is not None:
            return QTensor(*fast[:3], spec, fast[3], fast[4])
    fn = compiled(_quantize_parts, spec) if use_compiled else partial(_quantize_parts, spec=spec)
    v, scales, zp, shifts, g = fn(x, scale, zero_point, key, tensor_scale)
    d = spec.dtype
    if isinstance(d, IntDType):
        codes = o.astype(v, (o.int8 if d.signed else o.uint8) if d.bits <= 8 else o.int32)
    else:
        codes = encode(v, d, saturate=True)
    return QTensor(codes, scales, zp, spec, shifts, g)


def dequantize(q: QTensor) -> Array:
    """Float32 values of a ``QTensor``: (element value - zero point) * scale, per block.

    The QTensor is validated first (ValueError/TypeError naming the part): codes an integer array in the
    format's code range; scales of exactly ``spec.scale_shape(codes.shape)``, positive (or NaN), values of
    ``spec.scale_dtype`` (float16/float64 arrays are accepted when float32 holds them exactly); zero points
    present iff the spec is asymmetric, integers in the code range; sub-block shifts present iff the spec has
    shared microexponents; every part the same array kind (and device) as the codes.
    """
    if not isinstance(q, QTensor):
        raise TypeError(f"dequantize takes a QTensor, got {type(q).__name__}")
    if isinstance(q.spec, QuantSpec) and q.spec.gguf:
        return _dequantize_gguf(q)
    if q.offsets is not None or q.super_scales is not None:
        raise ValueError("QTensor.offsets / super_scales are set, but the spec has no float offsets or super-blocks "
                         f"(spec {q.spec.name or q.spec.dtype.name!r})")
    codes, scales, zp, shifts = check_qtensor(q)
    spec = q.spec
    o = ops(codes)
    if spec.two_level and q.tensor_scale is None:
        raise ValueError(f"dequantize: spec {spec.name or spec.dtype.name!r} is two-level but the QTensor has no "
                         "tensor_scale")
    fast = _fast.run_dequantize(QTensor(codes, scales, zp, spec, shifts, q.tensor_scale), o)
    if fast is not None:
        return fast
    v = decode(codes, spec.dtype)
    vb, blocked = to_blocks(v, spec.granularity, o)
    if spec.two_level:
        g = o.reshape(o.asarray(q.tensor_scale, o.float32, v), ())
        _, dq_mul = two_level_multipliers(scales, g, o)
        return from_blocks(_dequant_two_level(vb, dq_mul, blocked, o), blocked, o)
    return from_blocks(_dequant_blocks(vb, scales, zp, shifts, blocked, spec, o), blocked, o)


def _dequant_two_level(vb, dq_mul, blocked, o):
    """Two-level dequantization: element value * fl(g * scale) per block (torchao's order)."""
    with o.quiet():
        return vb * scales_to_blocked(dq_mul, blocked, o)


def _dequant_blocks(vb, scales, zp, shifts, blocked, spec, o):
    sb = scales_to_blocked(scales, blocked, o)
    if zp is not None:
        vb = vb - scales_to_blocked(zp, blocked, o)
    if spec.subblock_shift_bits:
        return dequant_microexp_blocks(vb, sb, shifts, blocked, spec, o)
    if spec.unit_exponent:
        vb = vb * np.float32(2.0**spec.unit_exponent)
    with o.quiet():
        return vb * sb


def fake_quantize(x: ArrayLike, spec: SpecLike, *, axis: Optional[int] = None, scale: Optional[ArrayLike] = None,
                  zero_point: Optional[ArrayLike] = None, key: KeyLike = None,
                  tensor_scale: Optional[ArrayLike] = None, compile: bool = False, imatrix: Optional[ArrayLike] = None,
                  **overrides: Any) -> Array:
    """``dequantize(quantize(x, spec, ...))``, bit for bit, without building codes. Same arguments as quantize.

    Gradients (torch tensors that require grad): straight-through, ``d out / d x`` is the identity, whatever
    the rounding, clamping or saturation did (``qcore._grad``). Scales and zero points, given or computed, get
    no gradient (they are treated as constants).
    """
    if scale is not None and key is None and tensor_scale is None and compile is False and axis is None \
            and not overrides and type(spec) is QuantSpec and not spec.gguf and imatrix is None:
        # Small tensors with given parameters (GPTQ's column step): the same checks, cheaper (qcore._given).
        out = _given.fake_quantize_given(x, spec, scale, zero_point)
        if out is not None:
            return out
    spec = spec_of(spec, axis, overrides)
    if spec.gguf or imatrix is not None:
        return _fake_quantize_gguf(x, spec, scale, zero_point, key, tensor_scale, compile, imatrix)
    key = check_mode(spec.rounding, key)
    x, o = to_array(x)
    x = o.astype(x, o.float32)
    use_compiled = _use_compiled(compile, x, spec)
    tensor_scale = check_tensor_scale_arg(tensor_scale, spec, o, x)
    scale, zero_point = prepare_params(x, spec, scale, zero_point, o)
    if use_compiled:
        guarded = compiled(_fake_quantize_pure, spec)

        def run(x, scale, zero_point, key):
            return guarded(x, scale, zero_point, key, tensor_scale)
    else:
        run = partial(_fake_quantize_default, tensor_scale=tensor_scale, spec=spec)
    if o.name == "torch" and x.requires_grad and o.t.is_grad_enabled():
        from ._grad import straight_through

        return straight_through(run, x, scale, zero_point, key)
    return run(x, scale, zero_point, key)


def _fake_quantize_default(x, scale, zero_point, key, tensor_scale=None, *, spec):
    """The default path: the fast slab kernels where they cover the spec (``qcore._fast``), else the generic."""
    fast = _fast.run_fake_quantize(x, spec, scale, zero_point, ops(x), tensor_scale=tensor_scale)
    if fast is not None:
        return fast
    rows = _fast.generic_rows(_fake_quantize_pure, x, spec, scale, zero_point, key, ops(x), tensor_scale=tensor_scale)
    if rows is not None:
        return rows
    return _fake_quantize_pure(x, scale, zero_point, key, tensor_scale, spec=spec)


def fake_quantizer(spec: SpecLike, *, shape: tuple[int, ...], scale: ArrayLike, zero_point: Optional[ArrayLike] = None,
                   like: Optional[Array] = None, axis: Optional[int] = None,
                   **overrides: Any) -> Callable[[Array], Array]:
    """Validate calibrated parameters once; return ``f(x) == fake_quantize(x, spec, scale=..., zero_point=...)``.

    For loops that apply the same scales to many tensors of one ``shape`` (GPTQ's column step: one column of
    a weight, per-row scale and zero point, hundreds of times): the checks of ``scale`` / ``zero_point`` (and
    their rounding to ``spec.scale_dtype``) run here, before any work, and each call of ``f`` only checks
    ``x.shape`` and runs the element kernel. ``like``: a torch tensor whose device the parameters move to
    (default: numpy). Same bits as ``fake_quantize``; no stochastic rounding, no two-level specs, no gradient
    (use ``fake_quantize`` for training).
    """
    spec = spec_of(spec, axis, overrides)
    if spec.gguf:
        raise ValueError(f"fake_quantizer: spec {spec.name!r} is a GGUF k-quant, whose scales come from llama.cpp's "
                         "search per call; use fake_quantize")
    if spec.rounding is RoundingMode.STOCHASTIC or spec.two_level:
        raise ValueError(f"fake_quantizer: spec {spec.name or spec.dtype.name!r} needs a key or a tensor scale per "
                         "call; use fake_quantize")
    shape = tuple(as_int(v) for v in shape)
    stand_in = np.broadcast_to(np.float32(0), shape)
    s, zp = prepare_params(stand_in, spec, np_view(scale), np_view(zero_point), ops(stand_in))
    if like is not None and is_torch(like):
        t = ops(like).t
        s = t.from_numpy(np.ascontiguousarray(s)).to(like.device)
        zp = None if zp is None else t.from_numpy(np.ascontiguousarray(zp)).to(like.device)
    kind = _fast.kernel_kind(spec)
    direct = kind in ("int", "float") and isinstance(spec.granularity, (PerTensor, PerChannel))
    po = ops(s)

    def f(x):
        if tuple(x.shape) != shape:
            raise ValueError(f"fake_quantizer was prepared for shape {shape}, got x of shape {tuple(x.shape)}")
        if ops(x) is not po:
            raise TypeError(f"fake_quantizer was prepared for {po.name} arrays (like=), got {type(x).__name__}")
        x, o = to_array(x) if po.name == "numpy" or x.dtype != po.float32 else (x, po)
        x = o.astype(x, o.float32)
        if direct:
            out = _fast.small_given_prepared(x, spec, s, zp, kind, o)
            if out is not None:
                return out
        return _fake_quantize_default(x, s, zp, None, spec=spec)

    return f


# -- GGUF k-quants (spec.gguf): llama.cpp's search in src/qcore/_kquants.py ---------------------------------

def _gguf_inputs(x, spec: QuantSpec, scale, zero_point, key, tensor_scale, compile, imatrix):
    """Check a k-quant call's arguments before any work; returns (host float32 x, host imatrix or None, ops,
    the original array)."""
    if not spec.gguf:
        raise ValueError(f"imatrix= applies to GGUF specs (q2_k ... q6_k, q4_0 ... q8_0, iq4_nl) only; spec "
                         f"{spec.name or spec.dtype.name!r} is not one")
    name = spec.gguf
    bs = spec.gguf_dtype.block_size
    for arg, v in (("scale", scale), ("zero_point", zero_point), ("tensor_scale", tensor_scale), ("key", key)):
        if v is not None:
            raise ValueError(f"{arg}=: {name} takes its scales from llama.cpp's search (and rounds to nearest); "
                             f"given parameters are not supported, got {arg}={_brief(v)}")
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be a bool, got {compile!r}")
    xa, o = to_array(x)
    shape = tuple(xa.shape)
    if len(shape) == 0:
        raise ValueError(f"{name}: x must have at least one axis (rows of a multiple of {bs}), got shape {shape}")
    if spec.granularity.axis % len(shape) != len(shape) - 1:
        raise ValueError(f"{name}: GGUF blocks run along the last axis (rows); spec axis "
                         f"{spec.granularity.axis} is not the last axis of x with shape {shape}")
    if shape[-1] % bs:
        raise ValueError(f"{name}: the last axis of x must be a multiple of {bs} (GGUF {'super-' if bs == 256 else ''}"
                         f"blocks), got x of shape {shape}")
    xn = np_view(xa.detach() if o.name == "torch" else xa)
    xn = np.ascontiguousarray(np.asarray(xn), dtype=np.float32)
    if not np.isfinite(xn).all():
        raise ValueError(f"{name}: x holds NaN or Inf, which {name} cannot encode (llama.cpp writes garbage "
                         "blocks for them)")
    qw = None
    if imatrix is not None:
        qw = np.asarray(np_view(imatrix))
        if qw.dtype.kind not in "fiu":
            raise TypeError(f"imatrix must be a float array, got dtype {qw.dtype}")
        qw = qw.astype(np.float32)
        if qw.shape != (shape[-1],):
            raise ValueError(f"imatrix must have shape ({shape[-1]},) (one weight per column of x with shape "
                             f"{shape}), got shape {qw.shape}")
        if not (np.isfinite(qw).all() and (qw >= 0).all()):
            raise ValueError("imatrix must hold finite, non-negative weights")
    return xn, qw, o, xa


def _to_kind(a, o, like):
    if a is None or o.name == "numpy":
        return a
    return o.t.from_numpy(np.ascontiguousarray(a)).to(like.device)


def _quantize_gguf(x, spec, scale, zero_point, key, tensor_scale, compile, imatrix) -> QTensor:
    xn, qw, o, xa = _gguf_inputs(x, spec, scale, zero_point, key, tensor_scale, compile, imatrix)
    codes, ss = _kquants.quantize_kquant(xn, spec.gguf, qw)
    scales, offsets = _kquants.sub_scales(ss, spec.granularity.size)
    if o.name == "torch":
        ss = _kquants.GGUFScales(*(_to_kind(getattr(ss, f.name), o, xa) for f in dataclasses.fields(ss)))
    return QTensor(_to_kind(codes, o, xa), _to_kind(scales, o, xa), None, spec, None, None,
                   _to_kind(offsets, o, xa), ss)


def _fake_quantize_gguf(x, spec, scale, zero_point, key, tensor_scale, compile, imatrix):
    xn, qw, o, xa = _gguf_inputs(x, spec, scale, zero_point, key, tensor_scale, compile, imatrix)

    def run(x_, scale_, zero_point_, key_):
        codes, ss = _kquants.quantize_kquant(xn, spec.gguf, qw)
        return _to_kind(_kquants.dequantize_kquant(codes, ss, spec.granularity.size, spec.gguf_dtype.levels), o, xa)

    if o.name == "torch" and xa.requires_grad and o.t.is_grad_enabled():
        from ._grad import straight_through

        return straight_through(run, xa, None, None, None)
    return run(xa, None, None, None)


def _dequantize_gguf(q: QTensor):
    """k-quant dequantization from ``q.super_scales`` after checking every part (ValueError/TypeError naming it)."""
    spec = q.spec
    sb = spec.gguf_dtype
    name = sb.name
    codes = q.codes
    if not (is_torch(codes) or isinstance(codes, np.ndarray)):
        raise TypeError(f"QTensor.codes must be a numpy array or a torch tensor, got {type(codes).__name__}")
    o = ops(codes)
    c = np.asarray(np_view(codes))
    shape = c.shape
    if c.dtype.kind not in "iu":
        raise TypeError(f"QTensor.codes must be an integer array, got dtype {c.dtype}")
    bs = sb.block_size
    if len(shape) == 0 or shape[-1] % bs:
        raise ValueError(f"{name}: QTensor.codes must have a last axis that is a multiple of {bs}, got shape {shape}")
    el = sb.element
    if c.size and (c.min() < el.min or c.max() > el.max):
        raise ValueError(f"{name}: QTensor.codes must lie in [{el.min}, {el.max}] ({el.name}), got "
                         f"{int(c.min()) if c.min() < el.min else int(c.max())}")
    ss = q.super_scales
    if not isinstance(ss, _kquants.GGUFScales):
        raise TypeError(f"{name}: QTensor.super_scales must be a GGUFScales (d, dmin, scale_codes, min_codes), "
                        f"got {type(ss).__name__}")
    lead = shape[:-1]
    nsb, ns = shape[-1] // bs, shape[-1] // sb.subblock_size
    parts = {}
    for fname, want_shape, is_code in (("d", (*lead, nsb), False), ("dmin", (*lead, nsb), False),
                                       ("scale_codes", (*lead, ns), True), ("min_codes", (*lead, ns), True)):
        v = getattr(ss, fname)
        needed = {"d": True, "dmin": sb.has_mins, "scale_codes": sb.scale_bits > 0, "min_codes": sb.min_bits > 0}[fname]
        if v is None:
            if needed:
                raise ValueError(f"{name}: QTensor.super_scales.{fname} is None; it needs shape {want_shape}")
            parts[fname] = None
            continue
        if not needed:
            raise ValueError(f"{name}: QTensor.super_scales.{fname} must be None for {name}")
        a = np.asarray(np_view(v))
        if a.shape != want_shape:
            raise ValueError(f"{name}: QTensor.super_scales.{fname} has shape {a.shape}; codes of shape {shape} need "
                             f"{want_shape}")
        if is_code:
            if a.dtype.kind not in "iu":
                raise TypeError(f"{name}: QTensor.super_scales.{fname} must be an integer array, got dtype {a.dtype}")
            bits = sb.scale_bits if fname == "scale_codes" else sb.min_bits
            lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if el.signed else (0, (1 << bits) - 1)
            if a.size and (a.min() < lo or a.max() > hi):
                raise ValueError(f"{name}: QTensor.super_scales.{fname} must lie in [{lo}, {hi}], got "
                                 f"{int(a.min()) if a.min() < lo else int(a.max())}")
        else:
            a = _exact_f32(a, ops(a), f"QTensor.super_scales.{fname}")
            with np.errstate(all="ignore"):
                f16 = a.astype(np.float16).astype(np.float32)
            if not np.array_equal(f16, a, equal_nan=True):
                raise ValueError(f"{name}: QTensor.super_scales.{fname} must hold float16 values (GGUF stores fp16)")
        parts[fname] = a
    ss_np = _kquants.GGUFScales(**parts)
    scales, offsets = _kquants.sub_scales(ss_np, sb.subblock_size)
    for fname, want, got in (("scales", scales, q.scales), ("offsets", offsets, q.offsets)):
        if want is None:
            if got is not None:
                raise ValueError(f"{name}: QTensor.{fname} must be None ({name} has no float offsets)")
            continue
        g = None if got is None else np.asarray(np_view(got))
        if g is None or g.shape != want.shape or not np.array_equal(g.astype(np.float32).view(np.int32),
                                                                    want.view(np.int32)):
            raise ValueError(f"{name}: QTensor.{fname} must equal the sub-block {fname} of super_scales "
                             f"({'d * scale_codes' if fname == 'scales' else '-(dmin * min_codes)'}; 32-element "
                             f"types: d, m), shape {want.shape}")
    if q.zero_points is not None or q.subblock_shifts is not None or q.tensor_scale is not None:
        raise ValueError(f"{name}: QTensor.zero_points / subblock_shifts / tensor_scale must be None for a k-quant")
    y = _kquants.dequantize_kquant(c, ss_np, sb.subblock_size, sb.levels)
    return _to_kind(y, o, codes)

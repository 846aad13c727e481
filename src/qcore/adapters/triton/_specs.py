"""What the kernels cover, and the constexpr parameters of a spec, all derived from ``qcore.dtypes`` (no triton
import here)."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

import qcore
from qcore import PerChannel, PerGroup, PerTensor, QuantSpec
from qcore.dtypes import FloatDType, IntDType, ScaleMode, Specials
from qcore.quantize import make_spec
from qcore.rounding import RoundingMode
from qcore.scales import scale_exponent_range

_SMODES = {ScaleMode.FLOOR: 0, ScaleMode.CEIL: 1, ScaleMode.EVEN: 2}
_SPECIALS = {Specials.FINITE: 0, Specials.IEEE: 1, Specials.FN: 2, Specials.FNUZ: 3}


def as_spec(spec: Any) -> QuantSpec:
    return spec if isinstance(spec, QuantSpec) else make_spec(spec)


def _narrow_float(d) -> bool:
    return isinstance(d, FloatDType) and d.signed and d.subnormals and d.bits <= 8 and d.mantissa_bits >= 1 \
        and d.exponent_bits >= 1


def why_not(spec: Any, *, ndim: Optional[int] = None, given_scale: bool = False) -> Optional[str]:
    try:
        spec = as_spec(spec)
    except (TypeError, ValueError) as e:
        return f"not a spec: {e}"
    name = spec.name or spec.dtype.name
    if spec.rounding is not RoundingMode.NEAREST_EVEN:
        return f"{name}: rounding {spec.rounding.name} (the kernels round NEAREST_EVEN only)"
    if spec.subblock_shift_bits or spec.bump_on_overflow or spec.unit_exponent:
        return f"{name}: shared microexponents / bfp16 bump / integer MX elements are not in the kernels"
    d = spec.dtype
    if isinstance(d, FloatDType):
        if not _narrow_float(d):
            return f"{name}: element format {d.name} (kernels: signed float formats with subnormals, <= 8 bits)"
        if not spec.saturate:
            return f"{name}: saturate=False"
    elif isinstance(d, IntDType):
        if d.bits > 8:
            return f"{name}: integer elements wider than 8 bits"
    g = spec.granularity
    if not isinstance(g, (PerTensor, PerChannel, PerGroup)):
        return f"{name}: granularity {g!r} (kernels: PerTensor, PerChannel, PerGroup along the last axis)"
    if isinstance(g, PerGroup) and ndim is not None and g.axis % max(ndim, 1) != ndim - 1:
        return f"{name}: PerGroup along axis {g.axis} of a {ndim}-D tensor (kernels: groups along the last axis)"
    if spec.two_level:
        if not isinstance(g, PerGroup):
            return f"{name}: two-level scales need PerGroup blocks in the kernels"
        if not _narrow_float(spec.scale_dtype):
            return f"{name}: two-level block scales in {spec.scale_dtype.name}"
        if given_scale:
            return f"{name}: given two-level block scales"
    elif spec.pow2_scale:
        if not isinstance(d, FloatDType):
            return f"{name}: power-of-two scales with integer elements"
        if spec.scale_mode not in _SMODES:
            return f"{name}: scale rule {spec.scale_mode.name} (kernels: FLOOR, CEIL, EVEN)"
        if d.emax < 1:
            return f"{name}: element emax {d.emax} < 1"
        lo, hi = scale_exponent_range(spec.scale_dtype)
        if lo < -127 or hi > 127:
            return f"{name}: scale exponents beyond [-127, 127]"
    elif spec.scale_dtype.name != "float32":
        return f"{name}: float scales stored in {spec.scale_dtype.name} (kernels: float32)"
    return None


def w4_format(spec: Any) -> Optional[str]:
    spec = as_spec(spec)
    if why_not(spec) is not None or not isinstance(spec.granularity, PerGroup) or spec.two_level:
        return None
    d = spec.dtype
    if isinstance(d, IntDType) and d.bits == 4 and not spec.pow2_scale:
        return "int4" if d.signed else "uint4"
    if isinstance(d, FloatDType) and d.name == "float4_e2m1fn" and spec.pow2_scale \
            and spec.scale_dtype.name == "float8_e8m0fnu":
        return "mxfp4"
    return None


def _float_consts(d: FloatDType) -> dict:
    signbit = 1 << (d.bits - 1)
    maxcode = int(np.asarray(qcore.encode(np.float32(d.max_finite), d)).reshape(-1)[0]) & (signbit - 1)
    e, m = d.exponent_bits, d.mantissa_bits
    if d.specials is Specials.IEEE:
        nanpos = (((1 << e) - 1) << m) | (1 << (m - 1))
        nanneg = nanpos | signbit
    elif d.specials is Specials.FN:
        nanpos, nanneg = signbit - 1, (signbit - 1) | signbit
    elif d.specials is Specials.FNUZ:
        nanpos = nanneg = signbit
    else:
        nanpos = nanneg = 0
    return dict(M=m, EMIN=d.emin, BIAS=1 - d.emin, MAXCODE=maxcode, SIGNBIT=signbit,
                FNUZ=d.specials is Specials.FNUZ, NANPOS=nanpos, NANNEG=nanneg)


def element_consts(spec: QuantSpec) -> dict:
    """Constexprs of ``_quant_elems`` for the spec's element format."""
    d = spec.dtype
    if isinstance(d, FloatDType):
        return dict(KIND=0, QMIN=0, QMAX=0, **_float_consts(d))
    return dict(KIND=1, M=1, EMIN=0, BIAS=1, MAXCODE=0, SIGNBIT=1 << 7, FNUZ=False, NANPOS=0, NANNEG=0,
                QMIN=int(spec.qmin), QMAX=int(spec.qmax))


def decode_consts(spec: QuantSpec) -> dict:
    d = spec.dtype
    if isinstance(d, FloatDType):
        c = _float_consts(d)
        return dict(KIND=0, M=c["M"], EMIN=c["EMIN"], BIAS=c["BIAS"], SIGNBIT=c["SIGNBIT"],
                    SPECIALS=_SPECIALS[d.specials], EBITS=d.exponent_bits)
    return dict(KIND=1, M=1, EMIN=0, BIAS=1, SIGNBIT=1 << 7, SPECIALS=0, EBITS=1)


def scale_consts(spec: QuantSpec) -> dict:
    """Constexprs of ``_scale_params``: SCALE 2 symmetric float, 3 asymmetric, 4 power of two, 5 two-level."""
    d = spec.dtype
    c = dict(SCALE=2, SDIV=1.0, EMAX_EL=0, MBITS_EL=0, SMIN=0, SMAX=0, SMODE=0, ELMAX=1.0, SM=1, SEMIN=0, SBIAS=1,
             SMAXCODE=0, SMINNORM=0.0, SMAXF=0.0, SNANCODE=0)
    if spec.two_level:
        sd = spec.scale_dtype
        f = _float_consts(sd)
        c.update(SCALE=5, ELMAX=float(spec.qmax), SM=f["M"], SEMIN=f["EMIN"], SBIAS=f["BIAS"], SMAXCODE=f["MAXCODE"],
                 SMINNORM=float(sd.min_normal), SMAXF=float(sd.max_finite), SNANCODE=f["NANPOS"])
    elif spec.pow2_scale:
        lo, hi = scale_exponent_range(spec.scale_dtype)
        c.update(SCALE=4, EMAX_EL=d.emax, MBITS_EL=d.mantissa_bits, SMIN=lo, SMAX=hi, SMODE=_SMODES[spec.scale_mode])
    elif not spec.symmetric:
        c.update(SCALE=3)
    else:
        if isinstance(d, IntDType):
            div = float(d.max) if (spec.narrow_range or not d.signed) else (spec.qmax - spec.qmin) / 2.0
        else:
            div = d.max_finite
        c.update(SCALE=2, SDIV=float(np.float32(div)))
        if float(np.float32(div)) != div:  # pragma: no cover - every divisor of the table is a float32
            raise ValueError(f"divisor {div} is not a float32")
    return c


def group_layout(spec: QuantSpec, shape: tuple) -> tuple:
    """(rows, C, G, groups per row) for PerGroup along the last axis."""
    C = shape[-1] if shape else 1
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    G = spec.granularity.size
    return rows, C, G, -(-C // G)


def channel_layout(spec: QuantSpec, shape: tuple) -> tuple:
    """(A, K, B) with the scale along the middle axis (PerTensor: K = 1)."""
    g = spec.granularity
    if isinstance(g, PerTensor) or not shape:
        return 1, 1, math.prod(shape)
    a = g.axis % len(shape)
    return math.prod(shape[:a]), shape[a], math.prod(shape[a + 1:])


def int_code_signed(spec: QuantSpec) -> bool:
    d = spec.dtype
    return isinstance(d, IntDType) and d.signed


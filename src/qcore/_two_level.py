"""Two-level scales (NVFP4): the tensor scale ``g`` and the per-block scales and multipliers, the one rule
``qcore.quantize`` (quantize, fake_quantize, dequantize), the fast path ``qcore._fast`` and the Triton kernels
share.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .cast import cast

if TYPE_CHECKING:  # pragma: no cover
    from .quantize import QuantSpec

# -- two-level scales (NVFP4) ---------------------------------------------------------------------------------
# The arithmetic is torchao's nvfp4_quantize (bit for bit on CPU); the zero / tiny / NaN / Inf rules are qcore's
# (docs/numerics.md, "Two-level scales"). Every division has a device tensor as divisor: torch on CUDA turns
# "tensor / python scalar" into a multiplication by the scalar's reciprocal, which is not the same number.

_F32_MAX = np.float32(np.finfo(np.float32).max)
F32_MIN_NORMAL = np.float32(2.0**-126)


def f32_const(v, o, like):
    """``v`` as a 0-d float32 array of ``like``'s kind (and device)."""
    return o.asarray(np.float32(v), o.float32, like)


def tensor_scale_from_amax(amax, spec: QuantSpec, o, like, *, scale_max=None):
    """AMAX's rule for ``g`` from the tensor's absmax (0-d float32): see ``_tensor_scale``. ``scale_max``: the
    block scale the tensor's largest block maps to (default the scale dtype's largest finite value; four over
    six uses less, ``qcore.stats.four_over_six``)."""
    one = f32_const(1.0, o, like)
    top = spec.scale_dtype.max_finite if scale_max is None else scale_max
    with o.quiet():
        g = amax / f32_const(spec.qmax * top, o, like)
    g = o.where(g < F32_MIN_NORMAL, F32_MIN_NORMAL, g)
    g = o.where(amax == 0, one, g)
    return o.where(o.isfinite(amax), g, np.float32(math.nan))


def two_level_scales(amax, g, spec: QuantSpec, o, *, target=None):
    """THE two-level rule: from block absmax ``amax`` (float32, scale shape) and tensor scale ``g`` (0-d) ->
    ``(scales, q_mul, dq_mul)``: the public block scales (values of ``spec.scale_dtype``), the quantization
    multiplier (codes = round(x * q_mul)) and the dequantization multiplier (value = element * dq_mul).

    scale = cast_RNE(clamp(fl(fl(amax / max_element) / g), min_normal, max_finite), scale_dtype); NaN where
    amax or g is NaN/Inf (the block is NaN). Multipliers: ``two_level_multipliers``. ``target``: the element
    value the block's absmax maps to instead of ``max_element`` (four over six's 4)."""
    sd = spec.scale_dtype
    with o.quiet():
        s = (amax / f32_const(spec.qmax if target is None else target, o, amax)) / g
    s = o.clip(s, np.float32(sd.min_normal), np.float32(sd.max_finite))
    scales = cast(s, sd, saturate=True)
    good = o.logical_and(o.isfinite(amax), o.isfinite(g))
    scales = o.where(good, scales, np.float32(math.nan))
    q_mul, dq_mul = two_level_multipliers(scales, g, o)
    return scales, q_mul, dq_mul


def two_level_multipliers(scales, g, o):
    """Per-block multipliers from block scales and the tensor scale (the one rule quantize, fake_quantize and
    dequantize share): ``q_mul = min(fl(fl(1 / g) / scale), FLT_MAX)`` (torchao's reciprocal, kept finite),
    ``dq_mul = fl(g * scale)`` (torchao's ``per_tensor_scale * scale``)."""
    with o.quiet():
        q_mul = (f32_const(1.0, o, scales) / g) / scales
        dq_mul = g * scales
    q_mul = o.where(q_mul > _F32_MAX, _F32_MAX, q_mul)
    return q_mul, dq_mul

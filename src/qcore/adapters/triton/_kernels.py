"""The Triton kernels (imported only by ``qcore.adapters.triton._launch``, i.e. only when a kernel runs).

Every float rounding here is integer arithmetic on float32 bits (round-half-even on the integer significand,
the rule of ``qcore.rounding``), never a ``tl`` fp8 cast: conversion instructions differ between CUDA and ROCm
and Triton's interpreter gets binade carries wrong. Float operations that remain are single IEEE operations the
core performs too (a multiplication by a scale, ``tl.math.div_rn`` for a correctly rounded division), so each
result is the core's bit for bit. Format constants come from ``qcore.dtypes`` through ``_launch`` (constexprs).
"""

from __future__ import annotations

import triton
import triton.language as tl

_F32_MAX = 3.4028234663852886e38


@triton.jit
def _pow2(e):
    """2**e as float32 for int32 ``e`` in [-149, 127], built from bits (2**-127 etc. are float32 subnormals)."""
    one = tl.full(e.shape, 1, tl.int32)
    sub = one << tl.minimum(tl.maximum(e + 149, 0), 22)
    return tl.where(e >= -126, (tl.maximum(e, -126) + 127) << 23, sub).to(tl.float32, bitcast=True)


@triton.jit
def _nan_like(x):
    return tl.full(x.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _float_code(y, M: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr, MAXCODE: tl.constexpr):
    """|y| (float32, not NaN) rounded to nearest-even on the grid of a float format with ``M`` mantissa bits,
    smallest exponent ``EMIN`` (subnormals below) and ``BIAS``; the magnitude code (no sign), saturated at
    ``MAXCODE`` (the code of ``max_finite``; Inf and huge values saturate too)."""
    ab = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    field = ab >> 23
    exp = tl.where(field == 0, -126, field - 127)
    sig = tl.where(field == 0, ab & 0x7FFFFF, (ab & 0x7FFFFF) | 0x800000)
    ee = tl.maximum(exp, EMIN)
    d = tl.minimum(ee - M - exp + 23, 25)  # >= 23 - M >= 1: right shift of the significand to the grid step
    one = tl.full(d.shape, 1, tl.int32)
    step = one << d
    q = sig >> d
    twice = (sig & (step - 1)) << 1
    up = (twice > step) | ((twice == step) & ((q & 1) == 1))
    q = q + up.to(tl.int32)
    # normal: ((e + bias) << M) | (q - 2**M) == ((e + bias - 1) << M) + q (a carry q == 2**(M+1) lands on the next
    # binade); subnormal (ee == EMIN, EMIN + BIAS == 1): the code is q itself
    code = ((ee + BIAS - 1) << M) + q
    return tl.minimum(code, MAXCODE)


@triton.jit
def _float_value(mag, M: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr):
    """Value (float32, >= 0) of a finite magnitude code."""
    field = mag >> M
    mant = mag & ((1 << M) - 1)
    sigv = tl.where(field == 0, mant, mant + (1 << M))
    k = tl.where(field == 0, EMIN - M, field - BIAS - M)
    return sigv.to(tl.float32) * _pow2(k)


@triton.jit
def _rne_int(y):
    """round-half-even(|y|) as int32, |y| clamped to 2**24 first (Inf and NaN give 2**24; callers clamp)."""
    ab = tl.minimum(y.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0x4B800000)
    field = ab >> 23
    exp = tl.where(field == 0, -126, field - 127)
    sig = tl.where(field == 0, ab & 0x7FFFFF, (ab & 0x7FFFFF) | 0x800000)
    d = tl.minimum(tl.maximum(23 - exp, 1), 25)
    one = tl.full(d.shape, 1, tl.int32)
    step = one << d
    q = sig >> d
    twice = (sig & (step - 1)) << 1
    up = (twice > step) | ((twice == step) & ((q & 1) == 1))
    q = q + up.to(tl.int32)
    return tl.where(exp >= 23, sig << tl.maximum(exp - 23, 0), q)


@triton.jit
def _quant_elems(x, s, mul, dq, zp, USE_MUL: tl.constexpr, KIND: tl.constexpr, M: tl.constexpr,
                 EMIN: tl.constexpr, BIAS: tl.constexpr, MAXCODE: tl.constexpr, SIGNBIT: tl.constexpr,
                 FNUZ: tl.constexpr, NANPOS: tl.constexpr, NANNEG: tl.constexpr, QMIN: tl.constexpr,
                 QMAX: tl.constexpr):
    """Quantize float32 ``x`` under its block's parameters -> (fake-quantized float32 value, code int32).

    ``USE_MUL``: y = x * mul (power-of-two scales, two-level multipliers), else y = x / s (correctly rounded).
    KIND 0 (float elements): code with the sign bit, value = element * dq. KIND 1 (integers): code =
    clip(round(y) + zp), value = (code - zp) * s. A NaN scale (a NaN block) gives code 0 and a NaN value."""
    if USE_MUL:
        y = x * mul
    else:
        y = tl.math.div_rn(x, s)
    ynan = y != y
    neg = y.to(tl.int32, bitcast=True) < 0
    if KIND == 0:
        mag = _float_code(y, M, EMIN, BIAS, MAXCODE)
        ev = _float_value(mag, M, EMIN, BIAS)
        if FNUZ:
            ev = tl.where(neg & (mag != 0), -ev, ev)  # no -0
        else:
            ev = tl.where(neg, -ev, ev)
        if FNUZ:
            code = tl.where(neg & (mag != 0), mag | SIGNBIT, mag)
        else:
            code = tl.where(neg, mag | SIGNBIT, mag)
        code = tl.where(ynan, tl.where(neg, NANNEG, NANPOS), code)
        val = ev * dq
    else:
        q = _rne_int(y)
        v = tl.where(neg, -q, q) + zp
        code = tl.minimum(tl.maximum(v, QMIN), QMAX)
        val = (code - zp).to(tl.float32) * s
        code = tl.where(ynan, 0, code)
    val = tl.where(ynan, _nan_like(val), val)
    code = tl.where(dq != dq, 0, code)
    return val, code


@triton.jit
def _decode_elems(code, s, dq, zp, KIND: tl.constexpr, M: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr,
                  SIGNBIT: tl.constexpr, SPECIALS: tl.constexpr, EBITS: tl.constexpr):
    """Dequantized float32 values of codes (int32): float elements ``decode(code) * dq``, integers
    ``(code - zp) * s``. SPECIALS: 0 FINITE, 1 IEEE, 2 FN, 3 FNUZ."""
    if KIND == 0:
        mag = code & (SIGNBIT - 1)
        neg = (code & SIGNBIT) != 0
        v = _float_value(mag, M, EMIN, BIAS)
        v = tl.where(neg, -v, v)
        nan = _nan_like(v)
        if SPECIALS == 1:
            top = (mag >> M) == ((1 << EBITS) - 1)
            inf = tl.full(v.shape, 0x7F800000, tl.int32).to(tl.float32, bitcast=True)
            special = tl.where((mag & ((1 << M) - 1)) == 0, tl.where(neg, -inf, inf), nan)
            v = tl.where(top, special, v)
        elif SPECIALS == 2:
            v = tl.where(mag == SIGNBIT - 1, nan, v)
        elif SPECIALS == 3:
            v = tl.where(code == SIGNBIT, nan, v)
        return v * dq
    else:
        return (code - zp).to(tl.float32) * s


# Integer reductions as tl.reduce with the combine functions tl.max / tl.min use (not tl.max / tl.min themselves:
# they are jit functions of triton's standard library, which the CPU interpreter can call only when triton was
# imported with TRITON_INTERPRET=1 already set, and torch._dynamo imports triton early; the interpreter runs
# these two combine functions as numpy reductions without calling them).
_imax = tl.standard._elementwise_max
_imin = tl.standard._elementwise_min


@triton.jit
def _ordered(b):
    """float32 bits -> int32 keys ordered like the floats (an involution)."""
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _scale_params(amax, lo, hi, bad, g, SCALE: tl.constexpr, SDIV: tl.constexpr, QMIN: tl.constexpr,
                  QMAX: tl.constexpr, EMAX_EL: tl.constexpr, MBITS_EL: tl.constexpr, SMIN: tl.constexpr,
                  SMAX: tl.constexpr, SMODE: tl.constexpr, ELMAX: tl.constexpr, SM: tl.constexpr,
                  SEMIN: tl.constexpr, SBIAS: tl.constexpr, SMAXCODE: tl.constexpr, SMINNORM: tl.constexpr,
                  SMAXF: tl.constexpr):
    """Scale parameters of blocks from their statistics (qcore.scales / qcore._two_level.two_level_scales):
    returns (scale, mul, dq, zp (int32), scale code (int32: E8M0 byte or narrow-float code)).

    SCALE 2: symmetric float scale ``amax / SDIV`` (float32 scale dtype); 3: asymmetric integer scale and zero
    point from ``lo``/``hi``; 4: power of two (SMODE 0 FLOOR, 1 CEIL, 2 EVEN) clamped to [SMIN, SMAX];
    5: two-level (block scale in a narrow float format under the tensor scale ``g``)."""
    nan = _nan_like(amax)
    zp = tl.full(amax.shape, 0, tl.int32)
    if SCALE == 2:
        s = tl.math.div_rn(amax, tl.full(amax.shape, SDIV, tl.float32))
        s = tl.where((s == 0) & (amax > 0), 1.401298464324817e-45, s)
        s = tl.where(amax == 0, 1.0, s)
        s = tl.where(bad, nan, s)
        mul = s
        dq = s
        scode = s.to(tl.int32, bitcast=True)
    elif SCALE == 3:
        lo = tl.minimum(lo, 0.0)
        hi = tl.maximum(hi, 0.0)
        width = hi - lo
        qr = tl.full(amax.shape, QMAX - QMIN, tl.float32)
        s = tl.math.div_rn(width, qr)
        finite = bad == 0  # every element finite (tl.minimum / maximum would drop a NaN)
        wide = ((width.to(tl.int32, bitcast=True) & 0x7FFFFFFF) == 0x7F800000) & finite
        half = tl.math.div_rn(hi * 0.5 - lo * 0.5, tl.full(amax.shape, (QMAX - QMIN) / 2.0, tl.float32))
        s = tl.where(wide, tl.minimum(half, 3.4028234663852886e38), s)
        s = tl.where((s == 0) & (width > 0), 1.401298464324817e-45, s)
        s = tl.where(width == 0, 1.0, s)
        s = tl.where(finite, s, nan)
        r = _rne_int(tl.math.div_rn(lo, s))
        r = tl.where(lo.to(tl.int32, bitcast=True) < 0, -r, r)
        zp = tl.minimum(tl.maximum(QMIN - r, QMIN), QMAX)
        zp = tl.where(finite, zp, 0)
        mul = s
        dq = s
        scode = s.to(tl.int32, bitcast=True)
    elif SCALE == 4:
        ab = amax.to(tl.int32, bitcast=True)
        field = ab >> 23
        e = field - 127
        if SMODE == 0:
            sx = e - EMAX_EL
        elif SMODE == 1:
            sx = e - EMAX_EL + ((ab & 0x7FFFFF) != 0).to(tl.int32)
        else:
            sig = (ab & 0x7FFFFF) | 0x800000
            q = sig >> (23 - MBITS_EL)
            rem2 = (sig & ((1 << (23 - MBITS_EL)) - 1)) << 1
            up = (rem2 > (1 << (23 - MBITS_EL))) | ((rem2 == (1 << (23 - MBITS_EL))) & ((q & 1) == 1))
            carried = (q + up.to(tl.int32)) >= (1 << (MBITS_EL + 1))
            sx = e - EMAX_EL + carried.to(tl.int32)
        # a zero or float32-subnormal amax: below every element's range, the smallest exponent
        sx = tl.where(field == 0, SMIN, sx)
        sx = tl.minimum(tl.maximum(sx, SMIN), SMAX)
        s = tl.where(bad, nan, _pow2(sx))
        mul = tl.where(bad, nan, _pow2(-sx))
        dq = s
        scode = tl.where(bad, 255, sx + 127)
    else:
        # two-level: b = RNE_scale_dtype(clamp(fl(fl(amax / ELMAX) / g), min_normal, max)); q_mul =
        # min(fl(fl(1 / g) / b), FLT_MAX); dq_mul = fl(g * b); NaN where amax or g is NaN/Inf
        t = tl.math.div_rn(tl.math.div_rn(amax, tl.full(amax.shape, ELMAX, tl.float32)), g)
        t = tl.minimum(tl.maximum(t, SMINNORM), SMAXF)
        scode = _float_code(t, SM, SEMIN, SBIAS, SMAXCODE)
        b = _float_value(scode, SM, SEMIN, SBIAS)
        gbad = (g.to(tl.int32, bitcast=True) & 0x7FFFFFFF) >= 0x7F800000
        good = (bad == 0) & (gbad == 0)
        s = tl.where(good, b, nan)
        qm = tl.math.div_rn(tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), g), s)
        mul = tl.where(qm > 3.4028234663852886e38, 3.4028234663852886e38, qm)
        dq = g * s
        scode = tl.where(good, scode, SMAXCODE + 1)  # the scale format's NaN code (e4m3fn: 0x7F) set by caller
    return s, mul, dq, zp, scode


@triton.jit
def _group_quant_kernel(x_ptr, val_ptr, code_ptr, pack_ptr, scale_ptr, scode_ptr, zp_ptr, ts_ptr,
                        total, ngc, C, PB,
                        G: tl.constexpr, BLOCK: tl.constexpr, NG: tl.constexpr,
                        SCALE: tl.constexpr, SDIV: tl.constexpr, EMAX_EL: tl.constexpr, MBITS_EL: tl.constexpr,
                        SMIN: tl.constexpr, SMAX: tl.constexpr, SMODE: tl.constexpr, ELMAX: tl.constexpr,
                        SM: tl.constexpr, SEMIN: tl.constexpr, SBIAS: tl.constexpr, SMAXCODE: tl.constexpr,
                        SMINNORM: tl.constexpr, SMAXF: tl.constexpr, SNANCODE: tl.constexpr,
                        KIND: tl.constexpr, M: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr,
                        MAXCODE: tl.constexpr, SIGNBIT: tl.constexpr, FNUZ: tl.constexpr, NANPOS: tl.constexpr,
                        NANNEG: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
                        WRITE_VAL: tl.constexpr, WRITE_CODE: tl.constexpr, PACK: tl.constexpr,
                        WRITE_SCALE: tl.constexpr, CODE_SIGNED: tl.constexpr):
    """Blocks of ``G`` along the last axis of a (rows, C) tensor (a ragged last group per row allowed), scales
    computed per block: NG blocks per program, one block per tile row. Writes the fake-quantized values,
    the codes (uint8/int8), the packed codes (PACK 4: two per byte, low nibble first; 6: 4 codes in 3 bytes,
    qcore.packing's layout), the float32 scales, their codes (E8M0 / narrow-float bytes) and zero points."""
    pid = tl.program_id(0)
    gid = pid * NG + tl.arange(0, NG)
    lane = tl.arange(0, BLOCK)
    row = gid // ngc
    gc = gid % ngc
    col = gc[:, None] * G + lane[None, :]
    mask = (gid < total)[:, None] & (lane < G)[None, :] & (col < C)
    offs = row[:, None].to(tl.int64) * C + col
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = x.to(tl.int32, bitcast=True)
    ab = tl.where(mask, b & 0x7FFFFFFF, 0)
    amax_b = tl.reduce(ab, 1, _imax)  # |x| bits order like |x|; a NaN's exceed Inf's
    bad = amax_b >= 0x7F800000
    amax = amax_b.to(tl.float32, bitcast=True)
    if SCALE == 3:
        big = tl.full(b.shape, 0x7FFFFFFF, tl.int32)
        key = _ordered(b)
        lo = _ordered(tl.reduce(tl.where(mask, key, big), 1, _imin)).to(tl.float32, bitcast=True)
        hi = _ordered(tl.reduce(tl.where(mask, key, -big - 1), 1, _imax)).to(tl.float32, bitcast=True)
    else:
        lo = amax
        hi = amax
    if SCALE == 5:
        g = tl.load(ts_ptr + gid * 0)
    else:
        g = amax
    s, mul, dq, zp, scode = _scale_params(amax, lo, hi, bad, g, SCALE, SDIV, QMIN, QMAX, EMAX_EL, MBITS_EL, SMIN,
                                          SMAX, SMODE, ELMAX, SM, SEMIN, SBIAS, SMAXCODE, SMINNORM, SMAXF)
    if SCALE == 5:
        scode = tl.where(scode == SMAXCODE + 1, SNANCODE, scode)
    USE_MUL: tl.constexpr = SCALE >= 4
    val, code = _quant_elems(x, s[:, None], mul[:, None], dq[:, None], zp[:, None], USE_MUL, KIND, M, EMIN, BIAS,
                             MAXCODE, SIGNBIT, FNUZ, NANPOS, NANNEG, QMIN, QMAX)
    if WRITE_VAL:
        tl.store(val_ptr + offs, val, mask=mask)
    code = tl.where(mask, code, 0)
    if WRITE_CODE:
        if CODE_SIGNED:
            tl.store(code_ptr + offs, code.to(tl.int8), mask=mask)
        else:
            tl.store(code_ptr + offs, code.to(tl.uint8), mask=mask)
    if PACK == 4:
        pairs = tl.reshape(code & 0xF, [NG, BLOCK // 2, 2])
        c0, c1 = tl.split(pairs)
        byte = c0 | (c1 << 4)
        i = tl.arange(0, BLOCK // 2)
        pcol = gc[:, None] * (G // 2) + i[None, :]
        pmask = (gid < total)[:, None] & (i < G // 2)[None, :] & (gc[:, None] * G + 2 * i[None, :] < C)
        tl.store(pack_ptr + row[:, None].to(tl.int64) * PB + pcol, byte.to(tl.uint8), mask=pmask)
    elif PACK == 6:
        quads = tl.reshape(code & 0x3F, [NG, BLOCK // 4, 2, 2])
        ev, od = tl.split(quads)  # ev[..., j] = code 4i + 2j, od[..., j] = code 4i + 2j + 1
        v0, v2 = tl.split(ev)
        v1, v3 = tl.split(od)
        b0 = v0 | ((v1 & 3) << 6)
        b1 = (v1 >> 2) | ((v2 & 0xF) << 4)
        b2 = (v2 >> 4) | (v3 << 2)
        i = tl.arange(0, BLOCK // 4)
        pcol = (gc[:, None] * (G // 4) + i[None, :]) * 3
        pmask = (gid < total)[:, None] & (i < G // 4)[None, :] & (gc[:, None] * G + 4 * i[None, :] < C)
        base = pack_ptr + row[:, None].to(tl.int64) * PB + pcol
        tl.store(base, b0.to(tl.uint8), mask=pmask)
        tl.store(base + 1, b1.to(tl.uint8), mask=pmask)
        tl.store(base + 2, b2.to(tl.uint8), mask=pmask)
    if WRITE_SCALE:
        gm = gid < total
        tl.store(scale_ptr + gid, s, mask=gm)
        tl.store(scode_ptr + gid, scode, mask=gm)
        tl.store(zp_ptr + gid, zp.to(tl.float32), mask=gm)


@triton.jit
def _stats_scale_kernel(amax_ptr, lo_ptr, hi_ptr, ts_ptr, scale_ptr, mul_ptr, dq_ptr, zp_ptr, scode_ptr, n,
                        SCALE: tl.constexpr, SDIV: tl.constexpr, EMAX_EL: tl.constexpr, MBITS_EL: tl.constexpr,
                        SMIN: tl.constexpr, SMAX: tl.constexpr, SMODE: tl.constexpr, ELMAX: tl.constexpr,
                        SM: tl.constexpr, SEMIN: tl.constexpr, SBIAS: tl.constexpr, SMAXCODE: tl.constexpr,
                        SMINNORM: tl.constexpr, SMAXF: tl.constexpr, SNANCODE: tl.constexpr,
                        QMIN: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr):
    """Scales of per-tensor / per-channel blocks from statistics reduced beforehand (absmax, min, max)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    amax = tl.load(amax_ptr + offs, mask=m, other=0.0)
    bad = (amax.to(tl.int32, bitcast=True) & 0x7FFFFFFF) >= 0x7F800000
    lo = tl.load(lo_ptr + offs, mask=m, other=0.0)
    hi = tl.load(hi_ptr + offs, mask=m, other=0.0)
    if SCALE == 5:
        g = tl.load(ts_ptr + offs * 0)
    else:
        g = amax
    s, mul, dq, zp, scode = _scale_params(amax, lo, hi, bad, g, SCALE, SDIV, QMIN, QMAX, EMAX_EL, MBITS_EL, SMIN,
                                          SMAX, SMODE, ELMAX, SM, SEMIN, SBIAS, SMAXCODE, SMINNORM, SMAXF)
    if SCALE == 5:
        scode = tl.where(scode == SMAXCODE + 1, SNANCODE, scode)
    tl.store(scale_ptr + offs, s, mask=m)
    tl.store(mul_ptr + offs, mul, mask=m)
    tl.store(dq_ptr + offs, dq, mask=m)
    tl.store(zp_ptr + offs, zp.to(tl.float32), mask=m)
    tl.store(scode_ptr + offs, scode, mask=m)


@triton.jit
def _param_index(offs, LAYOUT: tl.constexpr, P1, P2, G: tl.constexpr):
    """Index of an element's scale: LAYOUT 0: x viewed as (A, K=P1, B=P2), the scale of the middle index;
    LAYOUT 1: rows of P1 columns, groups of G along them, P2 groups per row."""
    if LAYOUT == 0:
        return (offs // P2) % P1
    else:
        return (offs // P1) * P2 + (offs % P1) // G


@triton.jit
def _elem_quant_kernel(x_ptr, val_ptr, code_ptr, s_ptr, mul_ptr, dq_ptr, zp_ptr, n, P1, P2,
                       LAYOUT: tl.constexpr, G: tl.constexpr, USE_MUL: tl.constexpr,
                       KIND: tl.constexpr, M: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr,
                       MAXCODE: tl.constexpr, SIGNBIT: tl.constexpr, FNUZ: tl.constexpr, NANPOS: tl.constexpr,
                       NANNEG: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
                       WRITE_VAL: tl.constexpr, WRITE_CODE: tl.constexpr, CODE_SIGNED: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Elementwise quantization under scales known before the pass (per tensor, per channel, or given)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    p = _param_index(offs, LAYOUT, P1, P2, G)
    s = tl.load(s_ptr + p, mask=m, other=1.0)
    mul = tl.load(mul_ptr + p, mask=m, other=1.0)
    dq = tl.load(dq_ptr + p, mask=m, other=1.0)
    zp = tl.load(zp_ptr + p, mask=m, other=0.0).to(tl.int32)
    val, code = _quant_elems(x, s, mul, dq, zp, USE_MUL, KIND, M, EMIN, BIAS, MAXCODE, SIGNBIT, FNUZ, NANPOS,
                             NANNEG, QMIN, QMAX)
    if WRITE_VAL:
        tl.store(val_ptr + offs, val, mask=m)
    if WRITE_CODE:
        if CODE_SIGNED:
            tl.store(code_ptr + offs, code.to(tl.int8), mask=m)
        else:
            tl.store(code_ptr + offs, code.to(tl.uint8), mask=m)


@triton.jit
def _dequant_kernel(code_ptr, s_ptr, dq_ptr, zp_ptr, out_ptr, n, P1, P2,
                    LAYOUT: tl.constexpr, G: tl.constexpr, KIND: tl.constexpr, M: tl.constexpr,
                    EMIN: tl.constexpr, BIAS: tl.constexpr, SIGNBIT: tl.constexpr, SPECIALS: tl.constexpr,
                    EBITS: tl.constexpr, BLOCK: tl.constexpr):
    """Codes (uint8 bit patterns / int8 or uint8 integers) and per-block parameters -> float32 values."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    code = tl.load(code_ptr + offs, mask=m, other=0).to(tl.int32)
    p = _param_index(offs, LAYOUT, P1, P2, G)
    s = tl.load(s_ptr + p, mask=m, other=1.0)
    dq = tl.load(dq_ptr + p, mask=m, other=1.0)
    zp = tl.load(zp_ptr + p, mask=m, other=0.0).to(tl.int32)
    v = _decode_elems(code, s, dq, zp, KIND, M, EMIN, BIAS, SIGNBIT, SPECIALS, EBITS)
    tl.store(out_ptr + offs, v, mask=m)


# -- packed 4-bit weights: the fused dequantize-matmul ----------------------------------------------------------


@triton.jit
def _w4_tile(w_ptr, s_ptr, zp_ptr, rn, k0, N, K, PK, NGK, G: tl.constexpr, FMT: tl.constexpr,
             HAS_ZP: tl.constexpr, BK: tl.constexpr):
    """Dequantized float32 tile [BN, BK] of a packed 4-bit weight (rows ``rn``, columns ``rk``, ``rk`` starting
    at an even column): bytes hold element 2i in the low nibble (qcore.packing.pack_fp4 / pack_bits(.., 4)).
    FMT 0: int4 (two's complement), 1: uint4, 2: fp4 e2m1 under E8M0 byte scales (255: NaN block). Integer
    weights: (code - zero point) * scale with float32 scales per group of G along K."""
    rk = k0 + tl.arange(0, BK)
    kb = k0 // 2 + tl.arange(0, BK // 2)
    nmask = rn < N
    bmask = nmask[:, None] & (kb < PK)[None, :]
    wb = tl.load(w_ptr + rn[:, None].to(tl.int64) * PK + kb[None, :], mask=bmask, other=0).to(tl.int32)
    codes = tl.reshape(tl.join(wb & 0xF, (wb >> 4) & 0xF), [wb.shape[0], BK])  # element 2i: low nibble
    kmask = nmask[:, None] & (rk < K)[None, :]
    gi = rn[:, None] * NGK + rk[None, :] // G
    if FMT == 2:
        sb = tl.load(s_ptr + gi, mask=kmask, other=127).to(tl.int32)
        scale = tl.where(sb == 255, _nan_like(codes.to(tl.float32)), _pow2(sb - 127))
        v = _float_value(codes & 7, 1, 0, 1)
        v = tl.where((codes & 8) != 0, -v, v)
        w = v * scale
    else:
        scale = tl.load(s_ptr + gi, mask=kmask, other=1.0)
        if FMT == 0:
            c = (codes ^ 8) - 8
        else:
            c = codes
        if HAS_ZP:
            zp = tl.load(zp_ptr + gi, mask=kmask, other=0).to(tl.int32)
            c = c - zp
        w = c.to(tl.float32) * scale
    return tl.where(kmask, w, 0.0)


@triton.jit
def _round_bf16(w):
    """float32 -> the nearest bfloat16 value (ties to even), as float32; NaN stays NaN."""
    b = w.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return tl.where(w != w, w, r.to(tl.float32, bitcast=True))


@triton.jit
def _w4_dequant_kernel(w_ptr, s_ptr, zp_ptr, out_ptr, N, K, PK, NGK, G: tl.constexpr, FMT: tl.constexpr,
                       HAS_ZP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The matmul's weight tiles written out (float32 [N, K]): tests check them against qcore.dequantize."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    w = _w4_tile(w_ptr, s_ptr, zp_ptr, rn, tl.program_id(1) * BK, N, K, PK, NGK, G, FMT, HAS_ZP, BK)
    m = (rn < N)[:, None] & (rk < K)[None, :]
    tl.store(out_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], w, mask=m)


@triton.jit
def _w4_matmul_kernel(x_ptr, w_ptr, s_ptr, zp_ptr, b_ptr, y_ptr, M, N, K, PK, NGK, sxm, sym,
                      G: tl.constexpr, FMT: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                      EMULATE: tl.constexpr, X_BF16: tl.constexpr):
    """y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with W dequantized tile by tile (``_w4_tile``), cast to x's dtype
    (as the core path's ``dequantize(...).to(dtype)``) and multiplied with float32 accumulation."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.full((BM, BN), 0.0, tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        xm = (rm < M)[:, None] & (rk < K)[None, :]
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * sxm + rk[None, :], mask=xm, other=0.0)
        w = _w4_tile(w_ptr, s_ptr, zp_ptr, rn, k0, N, K, PK, NGK, G, FMT, HAS_ZP, BK)
        if EMULATE:
            # the CPU interpreter (its bfloat16 cast truncates and its bfloat16 dot is wrong): the same numbers,
            # the weight rounded to x's dtype by integer arithmetic, multiplied in float32
            if X_BF16:
                w = _round_bf16(w)
            else:
                w = w.to(x.dtype).to(tl.float32)
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        elif IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    ym = (rm < M)[:, None] & (rn < N)[None, :]
    _store_out(y_ptr, rm[:, None].to(tl.int64) * sym + rn[None, :], acc, ym, EMULATE, X_BF16)


@triton.jit
def _store_out(y_ptr, offs, acc, mask, EMULATE: tl.constexpr, X_BF16: tl.constexpr):
    """Store float32 ``acc`` in y's dtype, rounded to nearest even (the interpreter's bfloat16 store truncates:
    there the rounding is done by integer arithmetic first)."""
    if EMULATE and X_BF16:
        acc = _round_bf16(acc)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _w4_gemv_kernel(x_ptr, w_ptr, s_ptr, zp_ptr, b_ptr, part_ptr, y_ptr, M, N, K, PK, NGK, sxm, KCHUNK,
                    G: tl.constexpr, FMT: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
                    DIRECT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, X_BF16: tl.constexpr,
                    X_F16: tl.constexpr, EMULATE: tl.constexpr):
    """Small batches (decode): one activation row per program, BN outputs, a K range of KCHUNK. Each weight tile
    is dequantized exactly, rounded to x's dtype (bfloat16 by integer arithmetic, round half to even),
    multiplied by x (exact in float32: two 8- or 11-bit significands) and summed in float32. DIRECT (one K
    range): bias added and y written here, one launch; else split-K: float32 partials ``part[split, m, n]``,
    summed in split order by ``_splitk_sum_kernel``."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    m = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.full((BN,), 0.0, tl.float32)
    k_start = split * KCHUNK
    for kk in range(0, KCHUNK, BK):
        k0 = k_start + kk
        rk = k0 + tl.arange(0, BK)
        xv = tl.load(x_ptr + m.to(tl.int64) * sxm + rk, mask=rk < K, other=0.0).to(tl.float32)
        w = _w4_tile(w_ptr, s_ptr, zp_ptr, rn, k0, N, K, PK, NGK, G, FMT, HAS_ZP, BK)
        if X_BF16:
            w = _round_bf16(w)
        elif X_F16:
            w = w.to(tl.float16).to(tl.float32)
        acc += tl.reduce(xv[None, :] * w, 1, _fsum)
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        _store_out(y_ptr, m.to(tl.int64) * N + rn, acc, rn < N, EMULATE, X_BF16)
    else:
        tl.store(part_ptr + (split.to(tl.int64) * M + m) * N + rn, acc, mask=rn < N)


@triton.jit
def _splitk_sum_kernel(part_ptr, b_ptr, y_ptr, S, MN, N, HAS_BIAS: tl.constexpr, EMULATE: tl.constexpr,
                       X_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """y = (part[0] + part[1] + ... + part[S-1]) + bias, in that order, float32, one rounding to y's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    msk = offs < MN
    acc = tl.load(part_ptr + offs, mask=msk, other=0.0)
    for sp in range(1, S):
        acc += tl.load(part_ptr + sp * MN + offs, mask=msk, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=msk, other=0.0).to(tl.float32)
    _store_out(y_ptr, offs, acc, msk, EMULATE, X_BF16)


_fsum = tl.standard._sum_combine  # tl.sum's combine (see _imax)


# -- the fast Walsh-Hadamard transform ---------------------------------------------------------------------------


@triton.jit
def _butterfly(y, MP: tl.constexpr, K2: tl.constexpr, HH: tl.constexpr):
    """One butterfly stage on [MP, K2]: pairs (i, i + HH) inside blocks of 2 * HH -> (a + b, a - b)."""
    t = tl.reshape(y, [MP, K2 // (2 * HH), 2, HH])
    t = tl.permute(t, [0, 1, 3, 2])
    a, b = tl.split(t)
    t = tl.join(a + b, a - b)
    t = tl.permute(t, [0, 1, 3, 2])
    return tl.reshape(t, [MP, K2])


@triton.jit
def _fwht_kernel(x_ptr, h_ptr, out_ptr, rdiv, MD: tl.constexpr, MP: tl.constexpr, K2: tl.constexpr,
                 LOGK2: tl.constexpr):
    """One row of n = MD * K2 per program: butterflies over the 2**k factor (the highest index bit first, as
    qcore.algorithms.hadamard.fwht), then the dense order-MD Hadamard factor summed over j = 0..MD-1 in order,
    then a correctly rounded division by fl(sqrt(n)). Output float32."""
    row = tl.program_id(0).to(tl.int64)
    n = MD * K2
    i = tl.arange(0, MP)
    j = tl.arange(0, K2)
    m2 = (i < MD)[:, None] & (j < K2)[None, :]
    offs = i[:, None] * K2 + j[None, :]
    y = tl.load(x_ptr + row * n + offs, mask=m2, other=0.0).to(tl.float32)
    for st in tl.static_range(LOGK2):
        y = _butterfly(y, MP, K2, K2 >> (st + 1))
    if MD > 1:
        tl.store(out_ptr + row * n + offs, y, mask=m2)
        tl.debug_barrier()
        h0 = tl.load(h_ptr + i * MD, mask=i < MD, other=0).to(tl.float32)
        y0 = tl.load(out_ptr + row * n + j)
        acc = h0[:, None] * y0[None, :]
        for jj in range(1, MD):
            hj = tl.load(h_ptr + i * MD + jj, mask=i < MD, other=0).to(tl.float32)
            yj = tl.load(out_ptr + row * n + jj * K2 + j)
            acc = acc + hj[:, None] * yj[None, :]
        tl.debug_barrier()
        y = acc
    y = tl.math.div_rn(y, tl.full(y.shape, 1.0, tl.float32) * rdiv)
    tl.store(out_ptr + row * n + offs, y, mask=m2)

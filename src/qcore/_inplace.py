"""The lowest layer of the fast path: the in-place primitives (numpy ``out=``, torch ``out=`` / ``_`` methods),
the slab size, the nearest-even rounding of magnitudes to a small float grid by one add and one subtract, and the
elementwise cast kernel built from them (``run_cast``, which ``qcore.cast`` dispatches to).

``qcore._fast`` (quantize's fast path, see its docstring for the method) builds on this module; this module
imports nothing of qcore above ``dtypes`` and ``rounding``, so ``cast -> _inplace`` and ``_fast -> cast`` point
one way. tests/qcore/test_fast.py checks ``run_cast`` against the generic ``cast`` bit for bit.
"""

from __future__ import annotations

import math

import numpy as np

from .dtypes import FloatDType, Specials
from .rounding import RoundingMode

__all__ = ["SLAB", "SLAB_TORCH", "slab_size", "inplace_ops", "float_kernel_ok", "round_float_abs", "is_empty",
           "f32_contiguous", "tracing", "cast_ok", "run_cast"]

SLAB = 1 << 18  # elements per slab on numpy: 1 MiB of float32, a few of which fit a CPU's L2/L3 caches
SLAB_TORCH = 1 << 20  # torch: fewer, larger slabs (each op has dispatch and thread-pool costs); fits L3


def slab_size(o) -> int:
    """Elements per slab for the array library ``o`` (``qcore._backend.ops``)."""
    return SLAB_TORCH if o.name == "torch" else SLAB


_EXP_MASK = 0x7F800000


# ---------------------------------------------------------------------------------------------------------------
# Backends: the in-place primitives (numpy ``out=`` and torch ``out=`` / ``_`` methods).
# ---------------------------------------------------------------------------------------------------------------
class _NumpyIP:
    name = "numpy"
    f32 = np.float32
    i32 = np.int32
    u8 = np.uint8
    i8 = np.int8

    @staticmethod
    def empty(n, dtype, like=None):
        return np.empty(n, dtype=dtype)

    @staticmethod
    def flat(x):
        return x.reshape(-1)

    @staticmethod
    def ibits(a):
        return a.view(np.int32)

    @staticmethod
    def fbits(i):
        return i.view(np.float32)

    @staticmethod
    def abs(a, out):
        return np.abs(a, out=out)

    @staticmethod
    def mul(a, b, out):
        return np.multiply(a, b, out=out)

    @staticmethod
    def div(a, b, out):
        return np.divide(a, b, out=out)

    @staticmethod
    def add(a, b, out):
        return np.add(a, b, out=out)

    @staticmethod
    def sub(a, b, out):
        return np.subtract(a, b, out=out)

    @staticmethod
    def clamp_(a, lo, hi):
        return np.clip(a, lo, hi, out=a)

    @staticmethod
    def min_(a, hi):
        return np.minimum(a, hi, out=a)

    @staticmethod
    def max_(a, lo):
        return np.maximum(a, lo, out=a)

    @staticmethod
    def rint_(a):
        return np.rint(a, out=a)

    @staticmethod
    def band(a, m, out):
        return np.bitwise_and(a, m, out=out)

    @staticmethod
    def bor(a, b, out):
        return np.bitwise_or(a, b, out=out)

    @staticmethod
    def bxor(a, b, out):
        return np.bitwise_xor(a, b, out=out)

    @staticmethod
    def shl(a, k, out):
        return np.left_shift(a, k, out=out)

    @staticmethod
    def scalar64(v):
        return np.int64(v)

    @staticmethod
    def i32view(a):
        return a.view(np.int32)

    @staticmethod
    def min2(a, b, out):
        return np.minimum(a, b, out=out)

    @staticmethod
    def max2(a, b, out):
        return np.maximum(a, b, out=out)

    @staticmethod
    def shr(a, k, out):
        return np.right_shift(a, k, out=out)

    @staticmethod
    def amax(a, axes):
        return np.max(a, axis=axes, keepdims=True) if axes else a.copy()

    @staticmethod
    def amin(a, axes):
        return np.min(a, axis=axes, keepdims=True) if axes else a.copy()

    @staticmethod
    def maximum(a, b):
        return np.maximum(a, b)

    @staticmethod
    def minimum(a, b):
        return np.minimum(a, b)

    @staticmethod
    def copy_to(dst, src):
        np.copyto(dst, src, casting="unsafe")
        return dst

    @staticmethod
    def fill_where(a, mask, value):
        np.copyto(a, value, where=mask)
        return a


    @staticmethod
    def contiguous(a):
        return np.ascontiguousarray(a)



class _TorchIP:
    name = "torch"

    def __init__(self, torch):
        self.t = torch
        self.f32, self.i32, self.u8, self.i8 = torch.float32, torch.int32, torch.uint8, torch.int8
        self.i64 = torch.int64
        self._scalars = {}

    def empty(self, n, dtype, like):
        return self.t.empty(n, dtype=dtype, device=like.device)

    @staticmethod
    def flat(x):
        return x.reshape(-1)

    def ibits(self, a):
        return a.view(self.t.int32)

    def fbits(self, i):
        return i.view(self.t.float32)

    def abs(self, a, out):
        return self.t.abs(a, out=out)

    # In place (``out is a``), the method form: same result, less dispatch than ``out=`` (no resize checks).
    def mul(self, a, b, out):
        return a.mul_(b) if out is a else self.t.mul(a, b, out=out)

    def div(self, a, b, out):
        return a.div_(b) if out is a else self.t.div(a, b, out=out)

    def add(self, a, b, out):
        return a.add_(b) if out is a else self.t.add(a, b, out=out)

    def sub(self, a, b, out):
        return a.sub_(b) if out is a else self.t.sub(a, b, out=out)

    @staticmethod
    def clamp_(a, lo, hi):
        return a.clamp_(lo, hi)

    @staticmethod
    def min_(a, hi):
        return a.clamp_(max=hi)

    @staticmethod
    def max_(a, lo):
        return a.clamp_(min=lo)

    @staticmethod
    def rint_(a):
        return a.round_()

    def band(self, a, m, out):
        return a.bitwise_and_(m) if out is a else self.t.bitwise_and(a, m, out=out)

    def bor(self, a, b, out):
        return a.bitwise_or_(b) if out is a else self.t.bitwise_or(a, b, out=out)

    def bxor(self, a, b, out):
        return self.t.bitwise_xor(a, b, out=out)

    def shl(self, a, k, out):
        return self.t.bitwise_left_shift(a, k, out=out)

    def scalar64(self, v):
        t = self._scalars.get(v)  # the few int64 constants of the kernels, made once (CPU; torch broadcasts a
        if t is None:  # 0-dim CPU tensor against tensors on any device)
            t = self._scalars[v] = self.t.tensor(v, dtype=self.t.int64)
        return t

    def i32view(self, a):
        return a.view(self.t.int32)

    def min2(self, a, b, out):
        return self.t.minimum(a, b, out=out)

    def max2(self, a, b, out):
        return self.t.maximum(a, b, out=out)

    def shr(self, a, k, out):
        return self.t.bitwise_right_shift(a, k, out=out)

    def amax(self, a, axes):
        return self.t.amax(a, dim=axes, keepdim=True) if axes else a.clone()

    def amin(self, a, axes):
        return self.t.amin(a, dim=axes, keepdim=True) if axes else a.clone()

    def maximum(self, a, b):
        return self.t.maximum(a, b)

    def minimum(self, a, b):
        return self.t.minimum(a, b)

    @staticmethod
    def copy_to(dst, src):
        return dst.copy_(src)

    @staticmethod
    def fill_where(a, mask, value):
        return a.masked_fill_(mask, float(value))


    @staticmethod
    def contiguous(a):
        return a.contiguous()



_NP = _NumpyIP()
_TORCH: list = []  # the one _TorchIP instance, made on first use (a memo, not configuration)


def inplace_ops(o):
    """The in-place primitives for the array library ``o`` (``qcore._backend.ops``): numpy's, or torch's."""
    if o.name == "numpy":
        return _NP
    if not _TORCH:
        _TORCH.append(_TorchIP(o.t))
    return _TORCH[0]


def float_kernel_ok(d: FloatDType) -> bool:
    """Small signed float formats with subnormals whose magic constant stays finite: 2**(emax + 1 + 23 - m)."""
    return (isinstance(d, FloatDType) and d.signed and d.subnormals and d.mantissa_bits <= 21
            and d.emax + 24 - d.mantissa_bits < 127 and d.emin > -126)


def round_float_abs(a, d: FloatDType, ip, ib):
    """Round non-negative float32 ``a`` (<= max_finite or NaN) to ``d``'s grid in place, nearest-even."""
    m = d.mantissa_bits
    ip.band(ip.ibits(a), _EXP_MASK, ib)
    ip.max_(ib, (d.emin + 127) << 23)
    ip.add(ib, ((23 - m) << 23) | 0x400000, ib)
    c = ip.fbits(ib)
    ip.add(a, c, a)
    ip.sub(a, c, a)
    return a


def is_empty(x) -> bool:
    """True where ``x`` has no element (a 0 in its shape)."""
    return any(int(s) == 0 for s in x.shape)


def f32_contiguous(x, o):
    """float32, contiguous (a copy only where the input is not already so)."""
    x = o.astype(x, o.float32)
    return _NP.contiguous(x) if o.name == "numpy" else x.contiguous()


def tracing(o) -> bool:
    """True while torch.compile traces the generic functions (``compile=True``): the slab loop is for eager
    calls; traced, the generic element-wise code fuses better."""
    if o.name != "torch":
        return False
    comp = getattr(o.t, "compiler", None)
    return bool(comp is not None and comp.is_compiling())


def cast_ok(d, rounding) -> bool:
    """Elementwise casts the fast kernel covers: nearest-even to small signed float formats with subnormals."""
    return (rounding is RoundingMode.NEAREST_EVEN and float_kernel_ok(d)
            and d.emax + 26 - d.mantissa_bits < 127)


def run_cast(x, d: FloatDType, saturate: bool, o):
    """``cast`` to a small float format, nearest-even, slab by slab: |x| clamped (at max, or past every value
    that overflows), rounded by the add-subtract of ``round_float_abs``, overflow mapped to Inf/NaN, sign bit
    back. NaN inputs come back as the same NaN (signalling NaNs quieted)."""
    ip = inplace_ops(o)
    shape = tuple(x.shape)
    x = f32_contiguous(x, o)
    xf = ip.flat(x)
    n = xf.size if ip.name == "numpy" else xf.numel()
    out = ip.empty(n, ip.f32, x)
    step = slab_size(o)
    m = min(n, step)
    a, ib = ip.empty(m, ip.f32, x), ip.empty(m, ip.i32, x)
    maxf = np.float32(d.max_finite)
    if d.specials is Specials.IEEE:
        over_val = np.float32(math.inf)
    else:
        over_val = np.float32(math.nan)
    with o.quiet():
        for i in range(0, n, step):
            j = min(i + step, n)
            xs, os_, aa, ii = xf[i:j], out[i:j], a[:j - i], ib[:j - i]
            ip.band(ip.ibits(xs), 0x7FFFFFFF, ip.ibits(aa))
            ip.min_(aa, maxf if saturate else np.float32(2.0 ** (d.emax + 2)))
            round_float_abs(aa, d, ip, ii)
            if not saturate:
                ip.fill_where(aa, aa > maxf, over_val)
            ip.band(ip.ibits(xs), -0x80000000, ii)
            ip.bor(ip.ibits(aa), ii, ip.ibits(os_))
            if d.specials is Specials.FNUZ:
                ip.add(os_, np.float32(0.0), os_)  # no -0 (NaN stays NaN)
    return out.reshape(shape)

"""llama.cpp's activation rounding in quantized dot products (ggml-cpu's ``vec_dot_type``), bit for bit.

ggml multiplies a quantized weight by a float32 activation row by first converting the row to the weight type's
``vec_dot_type`` (``ggml_get_type_traits_cpu(type)->vec_dot_type``; the conversion is that type's ``from_float``)
and then taking integer block dot products. What the weight sees is therefore not the activation but its
rounding:

- ``Q8_0`` (for Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4): blocks of 32, ``amax = max |x|``, ``d = amax / 127`` (float32,
  stored as float16), codes ``round(x * (127 / amax))`` (float32 product, round half to even: x86's
  ``_mm256_round_ps(.., _MM_ROUND_NEAREST)`` in ``quantize_row_q8_0``). The dot product sees ``fp16(d) * code``.
- ``Q8_1`` (for Q4_1, Q5_1): Q8_0's codes and ``d``, plus ``s = fp16(d * sum(codes))`` (float32 product of the
  float32 ``d``, rounded to float16). The dot product computes ``d_w * fp16(d) * sum(q_w * code) + m_w * s`` per
  block: the weight's offset ``m_w`` multiplies the stored ``s``, not the sum of the rounded activations, so the
  weight sees ``fp16(d) * code`` plus, per block, the residual ``s - sum_j fp16(d) * code_j`` times ``m_w``
  (``q8_1_residual``). ``s`` is float16: activations beyond about 2047 in a block overflow it to inf.
- ``Q8_K`` (for Q2_K..Q6_K, IQ4_XS): blocks of 256, ``max`` the first element of largest magnitude (signed),
  ``iscale = -127 / max``, codes ``min(127, nearest_int(iscale * x))``, ``d = 1 / iscale`` kept in float32, and
  per 16 the integer ``bsums`` (the k-quants' offsets multiply those, exactly). The dot product sees ``d * code``.
- ``F16`` / ``BF16`` (for F16 / BF16 weights): the row rounded to that float type (round to nearest even).
- ``F32``: the row as it is.

Variants: ``variant="x86"`` (the default) is ggml-cpu's x86 path (AVX2/AVX-512 ``quantize_row_q8_0`` /
``quantize_row_q8_1``: ``id = 127 / amax``, round half to even), what llama.cpp runs on x86 CPUs (its repacked
kernels' ``ggml_quantize_mat_q8_0_4x8`` agrees); ``variant="ref"`` is ``ggml-quants.c``'s
``quantize_row_q8_0_ref`` / ``quantize_row_q8_1_ref`` (``id = 1 / d``, C's ``roundf``: half away from zero), what
gguf-py's ``gguf.quants.Q8_0`` writes and ggml's generic path computes. Q8_K has one rule on every path
(``quantize_row_q8_K_ref``). The two Q8_0 variants differ only on halfway and last-ulp products.

Functions take numpy arrays or torch tensors (same results; torch only when a tensor is given) whose last axis is
a multiple of the block size, and compute in float32: ``quantize_q8_0``, ``quantize_q8_1``, ``quantize_q8_K``
(the blocks' parts), ``activation_values`` (what a weight of a GGUF type sees), ``q8_1_residual`` (the Q4_1 /
Q5_1 offsets' term), ``vec_dot_type``. Tests: tests/qcore/test_ggml_act.py (references written from the C
source, gguf-py's Q8_0, and llama.cpp's own ``quantize_row_*`` through ``qcore.testing.ggml`` when installed).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ._backend import is_torch

__all__ = ["VEC_DOT_TYPES", "VARIANTS", "vec_dot_type", "block_size", "quantize_q8_0", "quantize_q8_1",
           "quantize_q8_K", "activation_values", "q8_1_residual", "Q8Blocks", "Q8KBlocks"]

QK8 = 32
QK_K = 256
VARIANTS = ("x86", "ref")

# ggml-cpu's type_traits_cpu[type].vec_dot_type, for the weight types qcore writes or reads
VEC_DOT_TYPES = {
    "F32": "F32", "F16": "F16", "BF16": "BF16",
    "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "IQ4_NL": "Q8_0", "MXFP4": "Q8_0",
    "Q4_1": "Q8_1", "Q5_1": "Q8_1",
    "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K", "IQ4_XS": "Q8_K",
}


class Q8Blocks(NamedTuple):
    """Q8_0 / Q8_1 blocks of a ``(..., n)`` input: ``d`` ``(..., n / 32)`` float32 holding the stored float16
    scale, ``qs`` ``(..., n)`` int8 codes, ``s`` ``(..., n / 32)`` float32 holding Q8_1's float16 ``d * sum``
    (None for Q8_0)."""

    d: Any
    qs: Any
    s: Any = None


class Q8KBlocks(NamedTuple):
    """Q8_K blocks of a ``(..., n)`` input: ``d`` ``(..., n / 256)`` float32 (negative where the block's largest
    magnitude is positive), ``qs`` ``(..., n)`` int8 codes, ``bsums`` ``(..., n / 16)`` int16 sums of 16 codes."""

    d: Any
    qs: Any
    bsums: Any


def vec_dot_type(ggml_type: str) -> str:
    """The type ggml-cpu converts activations to before a dot product with a weight of ``ggml_type``."""
    key = str(ggml_type).upper()
    if key not in VEC_DOT_TYPES:
        raise ValueError(f"ggml_type must be one of {sorted(VEC_DOT_TYPES)}, got {ggml_type!r}")
    return VEC_DOT_TYPES[key]


def block_size(kind: str) -> int:
    """Elements per block of a vec_dot_type (1 for the float types)."""
    kind = _kind(kind)
    return QK_K if kind == "Q8_K" else QK8 if kind in ("Q8_0", "Q8_1") else 1


# -- array helpers (numpy or torch, float32) -------------------------------------------------------------------

class _Np:
    @staticmethod
    def f32(x):
        return np.asarray(x, dtype=np.float32)

    @staticmethod
    def blocks(x, k):
        return x.reshape(*x.shape[:-1], x.shape[-1] // k, k)

    @staticmethod
    def amax(x):
        return np.abs(x).max(axis=-1)

    @staticmethod
    def where(c, a, b):
        return np.where(c, a, b).astype(np.float32)

    @staticmethod
    def rint(x):
        return np.rint(x)

    @staticmethod
    def roundf(x):  # C's roundf, half away from zero (gguf-py's np_roundf: every step exact in float32)
        a = np.abs(x)
        f = np.floor(a)
        return (np.sign(x) * (f + np.floor(np.float32(2) * (a - f)))).astype(np.float32)

    @staticmethod
    def f16(x):
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)

    @staticmethod
    def bf16(x):
        u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        nan = np.isnan(x)
        r = np.where(nan, ((u >> 16) | 64) << 16, r)  # ggml_compute_fp32_to_bf16: quiet NaN
        return r.astype(np.uint32).view(np.float32).reshape(x.shape)

    @staticmethod
    def i8(x):
        return x.astype(np.int8)

    @staticmethod
    def isum(q):
        return q.astype(np.int32).sum(axis=-1)

    @staticmethod
    def first_absmax(x):
        i = np.abs(x).argmax(axis=-1)
        return np.take_along_axis(x, i[..., None], axis=-1)[..., 0]

    @staticmethod
    def minimum(x, v):
        return np.minimum(x, np.float32(v))

    @staticmethod
    def i16(x):
        return x.astype(np.int16)

    @staticmethod
    def scalar(v, like):
        return np.float32(v)


class _Torch:
    def __init__(self, torch):
        self.t = torch

    def f32(self, x):
        return x.float()

    @staticmethod
    def blocks(x, k):
        return x.reshape(*x.shape[:-1], x.shape[-1] // k, k)

    @staticmethod
    def amax(x):
        return x.abs().amax(dim=-1)

    def where(self, c, a, b):
        return self.t.where(c, a, b)

    def rint(self, x):
        return self.t.round(x)  # half to even

    def roundf(self, x):
        a = x.abs()
        f = self.t.floor(a)
        return self.t.sign(x) * (f + self.t.floor(2 * (a - f)))

    @staticmethod
    def f16(x):
        return x.half().float()

    @staticmethod
    def bf16(x):
        return x.bfloat16().float()  # round to nearest even, NaN kept

    def i8(self, x):
        return x.to(self.t.int8)

    def isum(self, q):
        return q.to(self.t.int32).sum(dim=-1)

    def first_absmax(self, x):
        i = x.abs().argmax(dim=-1, keepdim=True)  # the first index of the maximum
        return self.t.gather(x, -1, i)[..., 0]

    def minimum(self, x, v):
        return self.t.clamp(x, max=v)

    def i16(self, x):
        return x.to(self.t.int16)

    def scalar(self, v, like):
        return self.t.tensor(v, dtype=self.t.float32, device=like.device)


def _lib(x):
    if is_torch(x):
        import torch  # already imported: x is a tensor
        return _Torch(torch)
    return _Np()


def _checked(x, k: int, what: str):
    if not is_torch(x):
        x = np.asarray(x)
        if x.dtype.kind not in "fiu":
            raise TypeError(f"{what}: x must hold real numbers, got dtype {x.dtype}")
    elif x.is_complex():
        raise TypeError(f"{what}: x must hold real numbers, got dtype {x.dtype}")
    if x.ndim < 1 or x.shape[-1] % k:
        raise ValueError(f"{what}: the last axis of x must be a multiple of {k} (its blocks), got shape "
                         f"{tuple(x.shape)}")
    lib = _lib(x)
    return lib, lib.f32(x)


def _variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return variant


def _kind(kind: str) -> str:
    key = str(kind).upper()
    if key not in ("Q8_0", "Q8_1", "Q8_K", "F16", "BF16", "F32"):
        raise ValueError(f"kind must be a vec_dot_type (Q8_0, Q8_1, Q8_K, F16, BF16, F32), got {kind!r}")
    return key


# -- the quantizers --------------------------------------------------------------------------------------------

def _q8_32(lib, x, variant: str):
    """(float32 d before the float16 store, codes as float32) of Q8_0 / Q8_1 blocks."""
    xb = lib.blocks(x, QK8)
    amax = lib.amax(xb)
    d = amax / lib.scalar(127.0, x)
    zero = amax == 0
    if variant == "x86":  # quantize_row_q8_0 / _q8_1, AVX2 and AVX-512: id = 127 / amax, round half to even
        one = lib.where(zero, lib.scalar(1.0, x), amax)
        ident = lib.where(zero, lib.scalar(0.0, x), lib.scalar(127.0, x) / one)
        q = lib.rint(xb * ident[..., None])
    else:  # quantize_row_q8_0_ref / _q8_1_ref: id = 1 / d, roundf
        one = lib.where(zero, lib.scalar(1.0, x), d)
        ident = lib.where(zero, lib.scalar(0.0, x), lib.scalar(1.0, x) / one)
        q = lib.roundf(xb * ident[..., None])
    return d, q


def quantize_q8_0(x, *, variant: str = "x86") -> Q8Blocks:
    """ggml's Q8_0 blocks of ``x`` (last axis a multiple of 32): ``Q8Blocks(d, qs)``."""
    lib, x = _checked(x, QK8, "quantize_q8_0")
    d, q = _q8_32(lib, x, _variant(variant))
    return Q8Blocks(lib.f16(d), lib.i8(q.reshape(x.shape)))


def quantize_q8_1(x, *, variant: str = "x86") -> Q8Blocks:
    """ggml's Q8_1 blocks of ``x`` (last axis a multiple of 32): ``Q8Blocks(d, qs, s)``, ``s = fp16(d * sum(qs))``
    with the float32 ``d`` (the stored ``d`` is its float16 rounding)."""
    lib, x = _checked(x, QK8, "quantize_q8_1")
    d, q = _q8_32(lib, x, _variant(variant))
    total = lib.isum(lib.i8(q))
    s = lib.f16(d * lib.f32(total))
    return Q8Blocks(lib.f16(d), lib.i8(q.reshape(x.shape)), s)


def _q8_k(lib, x):
    xb = lib.blocks(x, QK_K)
    mx = lib.first_absmax(xb)
    zero = mx == 0
    iscale = lib.where(zero, lib.scalar(0.0, x), lib.scalar(-127.0, x) / lib.where(zero, lib.scalar(1.0, x), mx))
    q = lib.minimum(lib.rint(iscale[..., None] * xb), 127.0)  # nearest_int: round half to even
    d = lib.where(zero, lib.scalar(0.0, x), lib.scalar(1.0, x) / lib.where(zero, lib.scalar(1.0, x), iscale))
    return d, q


def quantize_q8_K(x) -> Q8KBlocks:
    """ggml's Q8_K blocks of ``x`` (last axis a multiple of 256): ``Q8KBlocks(d, qs, bsums)``."""
    lib, x = _checked(x, QK_K, "quantize_q8_K")
    d, q = _q8_k(lib, x)
    qs = lib.i8(q.reshape(x.shape))
    bsums = lib.i16(lib.isum(lib.blocks(qs, 16)))
    return Q8KBlocks(d, qs, bsums)


def activation_values(x, kind: str, *, variant: str = "x86"):
    """The float32 values a dot product with a weight of vec_dot_type ``kind`` (``vec_dot_type(weight_type)``)
    sees for the activations ``x`` (last axis: the dot product's; a multiple of the block size): ``fp16(d) * code``
    (Q8_0, Q8_1), ``d * code`` (Q8_K), ``x`` rounded to float16 / bfloat16 (F16, BF16), ``x`` (F32). Same shape
    as ``x``. For Q8_1 add the offsets' term, ``q8_1_residual``."""
    kind = _kind(kind)
    lib, xf = _checked(x, block_size(kind), "activation_values")
    if kind == "F32":
        return xf
    if kind == "F16":
        return lib.f16(xf)
    if kind == "BF16":
        return lib.bf16(xf)
    if kind == "Q8_K":
        d, q = _q8_k(lib, xf)
    else:
        d, q = _q8_32(lib, xf, _variant(variant))
        d = lib.f16(d)
    return (q * d[..., None]).reshape(xf.shape)


def q8_1_residual(x, *, variant: str = "x86"):
    """Per block of 32 of ``x``, ``s - sum_j fp16(d) * code_j`` (float32, shape ``(..., n / 32)``): what a Q4_1 /
    Q5_1 dot product adds to ``sum_j w_j * activation_values(x, "Q8_1")_j`` per unit of the block's weight offset
    ``m``. ggml computes ``d_w * fp16(d) * sum(q_w * code) + m * s``; with ``w = d_w * q_w + m`` that is
    ``sum(w * fp16(d) * code) + m * (s - fp16(d) * sum(code))``. The subtraction is exact in float32 up to the
    rounding of ``fp16(d) * sum(code)`` (24-bit products of an 11-bit scale and a sum below 2**12)."""
    lib, xf = _checked(x, QK8, "q8_1_residual")
    d, q = _q8_32(lib, xf, _variant(variant))
    total = lib.f32(lib.isum(lib.i8(q)))
    return lib.f16(d * total) - lib.f16(d) * total

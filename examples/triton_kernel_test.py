"""Testing a Triton kernel against qcore, bit for bit: an MXFP4 fake-quantize and an fp8 e4m3fn cast.

Run it with pytest (Triton's CPU interpreter is used when there is no GPU)::

    TRITON_INTERPRET=1 python -m pytest examples/triton_kernel_test.py -q     # CPU, interpreter
    python -m pytest examples/triton_kernel_test.py -q                         # on a CUDA/ROCm GPU

The recipe (docs/kernel_testing.md): probe inputs from ``qcore.testing.probes_by_kind(fmt)`` (grid values,
ties, neighbours, subnormals, saturation, NaN/Inf, scale boundaries, ragged blocks, ...), the expected output
from the numpy oracle (``qcore.fake_quantize`` / ``qcore.cast``), and ``qcore.testing.compare`` for a bit-exact
verdict whose ``format()`` shows the first mismatches.

The kernels round *arithmetically*, on the float32 bits with integer operations (exact, round-half-even,
no double rounding), instead of with ``.to(tl.float8e4nv)``: conversion instructions differ between backends
(Triton 3.9's interpreter gets binade carries wrong, e.g. values that round up into the next binade), and fp4
has no Triton dtype at all.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined: use the CPU interpreter
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import qcore  # noqa: E402
from qcore.testing import Op, assert_matches_oracle, compare, probes_by_kind  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1: Triton cannot run here", allow_module_level=True)


# ---------------------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------------------


@triton.jit
def _pow2(e):
    """2**e as float32 for int32 e in [-127, 127] (2**-127 is a float32 subnormal), built from bits."""
    return tl.where(e >= -126, (e + 127) << 23, 0x00400000).to(tl.float32, bitcast=True)


@triton.jit
def _round_sig_rne(sig, sh):
    """Round the integer significand ``sig`` right by ``sh`` bits (1 <= sh <= 25), ties to even."""
    q = sig >> sh
    rem = sig & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + up.to(tl.int32)


@triton.jit
def mxfp4_fake_quantize_kernel(x_ptr, y_ptr, cols, BLOCK: tl.constexpr):
    """One program per (row, block of 32 along the last axis): OCP MX FLOOR scale, fp4 e2m1 RNE elements."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols  # a ragged last block: the padding is 0 and changes no amax
    x = tl.load(x_ptr + row * cols + offs, mask=mask, other=0.0)
    ab = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |x| bits: ordered like |x| for non-NaN
    bad = tl.max(((ab >> 23) == 255).to(tl.int32), axis=0) > 0  # NaN or Inf in the block
    # FLOOR: s = floor(log2 amax) - emax(fp4) = exponent field - 127 - 2, clamped to E8M0's [-127, 127];
    # a zero (or float32-subnormal) amax gives -127.
    s = tl.minimum(tl.maximum((tl.max(ab, axis=0) >> 23) - 129, -127), 127)
    y = x * _pow2(-s)  # exact, a power of two
    # fp4 e2m1 round-half-even on the bits of |y|, saturating at 6 (values >= 6 all give 6, so clamp first).
    yb = tl.minimum(y.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0x40C00000)  # 0x40C00000 = 6.0
    e = (yb >> 23) - 127
    k = tl.maximum(e, 0) - 1  # grid step 2**k: 0.5 below 2, then 1, then 2
    sig = (yb & 0x7FFFFF) | 0x800000
    q = _round_sig_rne(sig, tl.minimum(23 + k - e, 25))
    v = tl.minimum(q.to(tl.float32) * _pow2(k), 6.0)
    v = tl.where(x.to(tl.int32, bitcast=True) < 0, -v, v)  # the sign bit: -0 stays -0
    out = v * _pow2(s)
    nan = tl.full([BLOCK], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    out = tl.where(bad, nan, out)
    tl.store(y_ptr + row * cols + offs, out, mask=mask)


@triton.jit
def e4m3fn_cast_kernel(x_ptr, y_ptr, n, SATURATE: tl.constexpr, BLOCK: tl.constexpr):
    """float32 -> float8_e4m3fn values (as float32), RNE; overflow gives NaN (ml_dtypes) or 448 (SATURATE)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    xb = x.to(tl.int32, bitcast=True)
    ab = xb & 0x7FFFFFFF
    field = ab >> 23
    e = tl.where(field == 0, -126, field - 127)
    sig = tl.where(field == 0, ab & 0x7FFFFF, (ab & 0x7FFFFF) | 0x800000)
    k = tl.maximum(tl.minimum(e, 127), -6) - 3  # e4m3: emin -6, 3 mantissa bits
    q = _round_sig_rne(sig, tl.minimum(23 + k - e, 25))
    mag = q.to(tl.float32) * _pow2(k)  # may be 2**128 = Inf for the largest inputs: that is overflow too
    over = (mag > 448.0) | (field == 255)
    nan = tl.full([BLOCK], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    if SATURATE:
        mag = tl.where(over, 448.0, mag)
    else:
        mag = tl.where(over, nan, mag)
    out = tl.where(xb < 0, -mag, mag)  # -0 stays -0; a negative overflow is -NaN, as qcore
    out = tl.where(x != x, x, out)  # NaN stays NaN (payload kept)
    tl.store(y_ptr + offs, out, mask=mask)


def mxfp4_fake_quantize(x: "torch.Tensor") -> "torch.Tensor":
    """MXFP4 fake-quantize of a 2-D float32 tensor along its last axis (blocks of 32, FLOOR scales)."""
    x = x.contiguous()
    rows, cols = x.shape
    y = torch.empty_like(x)
    mxfp4_fake_quantize_kernel[(rows, triton.cdiv(cols, 32))](x, y, cols, BLOCK=32)
    return y


def e4m3fn_cast(x: "torch.Tensor", *, saturate: bool = False) -> "torch.Tensor":
    x = x.contiguous()
    y = torch.empty_like(x)
    e4m3fn_cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), SATURATE=saturate, BLOCK=1024)
    return y


def _run(fn, x: np.ndarray, **kw) -> np.ndarray:
    return fn(torch.from_numpy(np.ascontiguousarray(x)).to(DEVICE), **kw).cpu().numpy()


# ---------------------------------------------------------------------------------------------------------------
# tests: the probes, the oracle, one assertion (mismatches are reported with their probe kind, input, both
# outputs' bits and, for MXFP4, the block's scale and amax)
# ---------------------------------------------------------------------------------------------------------------


def test_mxfp4_fake_quantize_matches_qcore():
    kinds = probes_by_kind("mxfp4")  # zeros, one_outlier, pow2_amax, scale_boundaries, element_grid, nan, ...
    x = np.concatenate(list(kinds.values()))  # 2-D, blocks of 32 along the last axis, a ragged last block
    assert_matches_oracle(_run(mxfp4_fake_quantize, x), x, "mxfp4", op=Op.FAKE_QUANTIZE, kinds=kinds)


@pytest.mark.parametrize("saturate", [False, True])
def test_e4m3fn_cast_matches_qcore(saturate):
    kinds = probes_by_kind("float8_e4m3fn")  # grid, neighbours, midpoints, subnormals, saturation, specials, ...
    x = np.concatenate(list(kinds.values()))
    actual = _run(e4m3fn_cast, x, saturate=saturate)
    assert_matches_oracle(actual, x, "float8_e4m3fn", op=Op.CAST, saturate=saturate, kinds=kinds)


def test_a_seeded_bug_is_caught():
    """The test must be able to fail: ties away from zero (microxcaling's fp4 rounding, 2.5 -> 3) is caught."""
    x = np.array([[2.5, 0.25, 5.0, 6.0] + [0.0] * 28], dtype=np.float32)  # amax 6: scale 1; 2.5 is a tie
    wrong = _run(mxfp4_fake_quantize, x).copy()
    wrong[0, 0] = 3.0
    with pytest.raises(AssertionError, match="1 of 32 values differ"):
        assert_matches_oracle(wrong, x, "mxfp4", op=Op.FAKE_QUANTIZE)
    report = compare(wrong, qcore.fake_quantize(x, "mxfp4"))  # the same comparison without the oracle call
    assert not report.ok and report.n_mismatch == 1 and report.mismatches[0].multi_index == (0, 0)

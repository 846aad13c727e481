"""Independent numpy oracle for AMD Quark's block formats: MX9/MX6/MX4, BFP16, MXINT8, MX fp scales.

Written from a reading of Quark's source (nothing copied); see ``docs/quark_block_semantics.md`` for the
step-by-step algorithms with file/function citations. Sources read:

- ``amd-quark`` 0.13 wheel from PyPI (the release ``shared/reference/numerics.md`` calls "Quark 0.13"):
  ``quark/torch/kernel/hw_emulation/hw_emulation_interface.py`` (``fake_quantize_bfp16``,
  ``fake_quantize_mx``, ``_compute_mx_exponents``, ``_mx6_mx9_codes``, ``fake_quantize_mx6_mx9``,
  ``fake_quantize_per_channel_affine``), ``quark/torch/quantization/utils.py`` (``even_round``,
  ``t_exponent``, ``get_dtype_params``, ``reshape_to_blocks``),
  ``quark/torch/quantization/observer/observer.py`` (``ObserverBase.get_scale``),
  ``quark/onnx/operators/custom_ops/src/bfp/cpu/bfp_kernel.cc`` (``BFPCPUKernel``, ``BFPPrimeCPUKernel``),
  ``quark/onnx/operators/custom_ops/src/mx/cpu/mx_kernel.cc`` (``MXCPUKernel``),
  ``quark/onnx/operators/custom_ops/include/mx/funcs.cuh`` (``fake_quantize_element``).
- github.com/amd/Quark at commit 1d27b5582e4ecbb466fa1658e0bc91d01a5fbdd1 (stored index), whose
  ``fake_quantize_mx6_mx9`` is an older variant: ``impl="torch_legacy"`` below.

Every function takes a float32 array whose LAST axis is a multiple of the block (Quark itself moves
``axis`` to the end and zero-pads; padding zeros never change a block's result) and returns the
fake-quantized (quantize-dequantize) float32 array of the same shape.

``impl`` selects which Quark code path is emulated:

- ``"torch"``  Quark-Torch 0.13 (``quark.torch``), CPU / float32 input. Default.
- ``"onnx"``   Quark-ONNX custom ops, CPU kernels (``BFPQuantizeDequantize`` / ``MXQuantizeDequantize``),
               with the rounding Quark's ONNX presets set (``rounding_mode=2``, half to even) unless
               ``rounding`` says otherwise.  MX4 exists only here.
- ``"torch_legacy"`` (MX6/MX9 only) the GitHub-commit variant of ``fake_quantize_mx6_mx9``.
- ``"onnx_compiler"`` (BFP16 only) ``BFPCPUKernelCompiler`` (``use_compiler_version_cpu_kernel=1``).

Not emulated: Quark's CUDA/HIP/Triton kernels (the CUDA ``BFPPrimeCUDAKernel`` uses stochastic rounding for
``rounding_mode=2`` and truncation for 0; the fp16/bf16 fused MXFP4 kernels), fp16/bf16 inputs.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "ELEMENTS",
    "quark_mx_scale",
    "quark_mx_scale_exponent",
    "quark_fp_element",
    "quark_mx_fp",
    "quark_mxint8",
    "quark_bfp16",
    "quark_mx_shared",
    "quark_mx9",
    "quark_mx6",
    "quark_mx4",
]

# name -> (ebits, mbits, emax, max_norm) as in quark.torch.quantization.utils.get_dtype_params and the
# quant_max formula of fake_quantize_mx (ONNX's ParseElementDataTypeString has the same numbers).
ELEMENTS = {
    "fp4": (2, 1, 2, 6.0),
    "fp6_e2m3": (2, 3, 2, 7.5),
    "fp6_e3m2": (3, 2, 4, 28.0),
    "fp8_e4m3": (4, 3, 8, 448.0),
    "fp8_e5m2": (5, 2, 15, 57344.0),
    "int8": (0, 8, 0, 127.0),
}
_ALIASES = {"fp4_e2m1": "fp4", "mxfp4": "fp4", "e2m1": "fp4", "e2m3": "fp6_e2m3", "e3m2": "fp6_e3m2",
            "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2"}

_TINY = np.float32(2.0**-126)   # torch.finfo(float32).tiny
_EPS = np.float32(2.0**-23)     # torch.finfo(float32).eps, Quark's fill for a zero scale
_QNAN = np.uint32(0x7FFFFFFF).view(np.float32)  # what BFPPrimeCPUKernel writes for a NaN/Inf block


def _element(name: str) -> tuple[int, int, int, float]:
    name = _ALIASES.get(name, name)
    if name not in ELEMENTS:
        raise ValueError(f"unknown element {name!r}; one of {sorted(ELEMENTS)}")
    return ELEMENTS[name]


def _blocks(x, block: int) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % block:
        raise ValueError(f"last dimension must be a multiple of block={block}, got shape {x.shape}")
    return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))


def _exp_field(x: np.ndarray) -> np.ndarray:
    """Biased IEEE exponent field (0..255) of float32 values, as int64."""
    x = np.asarray(x, dtype=np.float32)
    return ((np.ascontiguousarray(x).view(np.uint32).reshape(x.shape) >> 23) & 0xFF).astype(np.int64)


def _pow2_f32(e) -> np.ndarray:
    """float32(2**e) for float e that is integral or +-inf/NaN (torch.pow(2, e) / exp2 are exact there)."""
    e = np.asarray(e, dtype=np.float64)
    out = np.empty(e.shape, dtype=np.float64)
    fin = np.isfinite(e)
    out[fin] = np.ldexp(1.0, np.clip(e[fin], -1100, 1100).astype(np.int64))
    out[~fin] = np.exp2(e[~fin])  # inf -> inf, -inf -> 0, nan -> nan
    with np.errstate(over="ignore"):
        return out.astype(np.float32)  # 2**-150 -> 0 (tie to even), 2**128 -> inf


def _log2_f32(a: np.ndarray) -> np.ndarray:
    """float32(log2(a)) correctly rounded; floor/ceil of it match torch.log2 (checked exhaustively near 2**k)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log2(np.asarray(a, dtype=np.float32).astype(np.float64)).astype(np.float32)


def _round_half(v: np.ndarray, rounding: str) -> np.ndarray:
    """Quark-ONNX's integer rounding of a float (bfp_kernel.cc), zero signs included.

    'even' = ``py3_round`` (ties to even, computed as floor(v) [+ 1], so (-0.5, 0) gives +0.0),
    'away' = ``std::round`` (ties away from zero), 'up' = ``dpu_round`` (ties toward +inf).
    """
    v = np.asarray(v, dtype=np.float64)
    if rounding == "even":
        f = np.floor(v)
        d = v - f
        odd = np.mod(f, 2) == 1
        return np.where((d > 0.5) | ((d == 0.5) & odd), f + 1, f)
    if rounding == "away":
        return np.copysign(np.floor(np.abs(v) + 0.5), v)
    if rounding == "up":
        return np.where((v < 0) & (v - np.floor(v) == 0.5), np.ceil(v), np.copysign(np.floor(np.abs(v) + 0.5), v))
    raise ValueError(f"rounding must be 'even', 'away' or 'up', got {rounding!r}")


def _rne_fp(y: np.ndarray, mbits: int, emin: int) -> np.ndarray:
    """Round finite float64 values to the grid of a float format (mbits, emin, unbounded), ties to even."""
    a = np.abs(y)
    _, e2 = np.frexp(a)
    k = np.maximum(e2 - 1, emin) - mbits
    return np.copysign(np.round(np.ldexp(a, -k)) * np.ldexp(1.0, k), y)


# ----------------------------------------------------------------------------------------------------------
# MX (OCP) shared scale: quark.torch.quantization.utils.even_round / fake_quantize_mx / ObserverBase.get_scale
# ----------------------------------------------------------------------------------------------------------

def quark_mx_scale(amax, *, mode: str = "even", element: str = "fp4") -> np.ndarray:
    """The float32 block scale Quark-Torch uses for an MX block with max-abs ``amax`` (zero scale -> eps).

    mode ``"even"`` (default; ``None`` too): round amax's significand to ``mbits`` bits (ties up) with an
    integer add on its bits, take that binade: ``2**clamp(floor(log2(R)) - emax, -127, 127)``; amax == 0 ->
    ``2**clamp(-126 - emax, ..)``; NaN -> NaN; Inf -> 2**127.
    mode ``"floor"`` / ``"ceil"``: ``2**(floor|ceil(float32 log2(amax)) - emax)``, no clamp, 0 -> eps.
    There is no "rceil" mode in Quark (0.13): ObserverBase.get_scale raises for anything else.
    """
    ebits, mbits, emax, _ = _element(element)
    shape = np.shape(amax)
    a = np.array(amax, dtype=np.float32).reshape(-1)
    if mode is None or mode == "even":
        bits = a.view(np.uint32).astype(np.uint64)
        bits = (bits + (1 << (23 - mbits - 1))) & 0xFF800000  # sign + exponent bits survive
        r = bits.astype(np.uint32).view(np.float32).copy()
        r[a == 0] = _TINY
        r[np.isnan(a)] = np.nan
        e = np.floor(_log2_f32(r)).astype(np.float64) - emax  # r is a power of two, 0 or inf: exact
        e = np.where(np.isnan(e), e, np.clip(e, -127, 127))
        scale = _pow2_f32(e)
    elif mode in ("floor", "ceil"):
        lg = _log2_f32(a)
        e = (np.floor(lg) if mode == "floor" else np.ceil(lg)).astype(np.float64) - emax
        scale = _pow2_f32(e)
    else:
        raise ValueError(f"Quark has scale_calculation_mode 'even', 'floor', 'ceil' only; got {mode!r}")
    return np.where(scale == 0, _EPS, scale).astype(np.float32).reshape(shape)


def quark_mx_scale_exponent(amax, *, mode: str = "even", element: str = "fp4") -> np.ndarray:
    """log2 of :func:`quark_mx_scale` as float64 (an integer, or +inf / NaN; -23 where Quark used eps)."""
    with np.errstate(divide="ignore"):
        return np.log2(quark_mx_scale(amax, mode=mode, element=element).astype(np.float64))


def quark_fp_element(y, element: str) -> np.ndarray:
    """``fake_quantize_element`` (funcs.cuh), used by both Quark-Torch (fp4/fp6) and Quark-ONNX (all fp).

    Round half to even onto the element grid (subnormals included, emin = 2 - 2**(ebits-1)), saturate the
    magnitude at max_norm, Inf/NaN returned unchanged, float32 subnormal inputs -> 0, and every zero result is
    +0.0 (the sign of a value that rounds to zero is dropped).
    """
    ebits, mbits, _, max_norm = _element(element)
    if ebits == 0:
        raise ValueError("int8 is not a float element")
    y = np.asarray(y, dtype=np.float32)
    out = y.astype(np.float64).copy()
    fin = np.isfinite(y)
    emin = 1 - ((1 << (ebits - 1)) - 1)
    yf = np.where(_exp_field(y) == 0, 0.0, y.astype(np.float64))  # float32 subnormals flush
    r = _rne_fp(yf, mbits, emin)
    r = np.copysign(np.minimum(np.abs(r), max_norm), r)
    r = np.where(r == 0, 0.0, r)  # +0.0
    out[fin] = r[fin]
    return out.astype(np.float32)


def _fp8_cast(y: np.ndarray, element: str) -> np.ndarray:
    """torch ``.to(float8_e4m3fn|float8_e5m2)`` of values already clamped to +-max: RNE, keeps -0.0, NaN."""
    _, mbits, _, _ = _element(element)
    emin = -6 if element.endswith("e4m3") else -14
    y64 = np.asarray(y, dtype=np.float32).astype(np.float64)
    fin = np.isfinite(y64)
    out = y64.copy()
    out[fin] = _rne_fp(y64[fin], mbits, emin)
    return out.astype(np.float32)


def quark_mx_fp(x, *, element: str, mode: str = "even", block: int = 32, impl: str = "torch") -> np.ndarray:
    """MXFP4/MXFP6/MXFP8 fake quantization (OCP_MX*Spec / Dtype.mx): shared power-of-two scale per block.

    torch: scale = :func:`quark_mx_scale` of the block max-abs (NaN propagates: a NaN block is all NaN);
    fp4/fp6 -> ``quark_fp_element(x / scale) * scale``; fp8 -> ``cast(clamp(x / scale, +-max)) * scale``.
    onnx: scale = 2**(max biased exponent field over the block's finite elements - 127 - emax) (OCP floor,
    exact, unclamped), ``quark_fp_element`` for every fp element (fp8 too), Inf/NaN elements pass through.
    """
    name = _ALIASES.get(element, element)
    if name == "int8":
        return quark_mxint8(x, block=block, impl=impl, mode=mode)
    _, _, emax, max_norm = _element(name)
    b = _blocks(x, block)
    with np.errstate(all="ignore"):
        if impl == "torch":
            amax = np.max(np.abs(b), axis=-1, keepdims=True)  # NaN-propagating, like torch.max
            scale = quark_mx_scale(amax, mode=mode, element=name)
            y = (b / scale).astype(np.float32)
            if name.startswith("fp8"):
                q = _fp8_cast(np.clip(y, -max_norm, max_norm), name)
            else:
                q = quark_fp_element(y, name)
            out = (q * scale).astype(np.float32)
        elif impl == "onnx":
            ef = _exp_field(b)
            shared = np.max(np.where(ef == 0xFF, 0, ef), axis=-1, keepdims=True)
            scale = _pow2_f32(shared - 127 - emax)
            q = quark_fp_element((b / scale).astype(np.float32), name)
            out = np.where(ef == 0xFF, b, (scale * q).astype(np.float32))
        else:
            raise ValueError(f"impl must be 'torch' or 'onnx', got {impl!r}")
    return out.reshape(np.shape(x)).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------
# MXINT8
# ----------------------------------------------------------------------------------------------------------

def quark_mxint8(x, *, block: int = 32, impl: str = "torch", mode: str = "even",
                 rounding: str = "even") -> np.ndarray:
    """MXINT8: a power-of-two scale per block, int8 codes k with value k * scale / 64.

    torch (``fake_quantize_mx``, element int8, ``OCP_MXINT8Spec``): scale = :func:`quark_mx_scale`
    (mode even: significand rounded to 8 bits, emax 0); step = max(scale / 64, 2**-126) (the
    ``clamp(scale, min=finfo.tiny)`` in ``fake_quantize_per_channel_affine``); codes = RNE(x * (1/step))
    clamped to [-127, 127]. NaN in a block -> whole block NaN; +-Inf -> +-127 * step.
    onnx (``MXCPUKernel``, element_dtype int8): scale = 2**(max finite exponent field - 127) (floor, exact),
    codes = round(x / scale * 64) clamped to [-128, 127], Inf/NaN pass through. ``rounding``: Quark's ONNX
    presets use 'even' (rounding_mode=2); the op's default attribute is 0 = 'away'.
    """
    b = _blocks(x, block)
    with np.errstate(all="ignore"):
        if impl == "torch":
            amax = np.max(np.abs(b), axis=-1, keepdims=True)
            scale = quark_mx_scale(amax, mode=mode, element="int8")
            step = np.maximum((scale / np.float32(64)).astype(np.float32), _TINY)  # NaN propagates
            inv = (np.float32(1) / step).astype(np.float32)
            q = np.clip(np.round((b * inv).astype(np.float32)) + np.float32(0), -127, 127)  # "+ zero_point"
            out = (q.astype(np.float32) * step).astype(np.float32)
        elif impl == "onnx":
            ef = _exp_field(b)
            shared = np.max(np.where(ef == 0xFF, 0, ef), axis=-1, keepdims=True)
            s = _pow2_f32(shared - 127)
            y = (b / s).astype(np.float32)
            c = np.clip(_round_half((y * np.float32(64)).astype(np.float32), rounding), -128, 127)
            el = (c.astype(np.float32) * np.float32(2.0**-6)).astype(np.float32)
            out = np.where(ef == 0xFF, b, (s * el).astype(np.float32))
        else:
            raise ValueError(f"impl must be 'torch' or 'onnx', got {impl!r}")
    return out.reshape(np.shape(x)).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------
# BFP16
# ----------------------------------------------------------------------------------------------------------

def quark_bfp16(x, *, block: int = 8, impl: str = "torch", rounding: str = "even") -> np.ndarray:
    """BFP16: 8 elements share an exponent E, each keeps sign + 7 bits: value = k * 2**(E - 6).

    torch (``fake_quantize_bfp16``; block is forced to 8 there): NaN/Inf -> 0 first. E = floor(float32
    log2(amax)); first pass codes RNE(x / 2**(E-6)) in [-129, 128]; if any code is >= 128 or < -128
    (only +128 can happen) amax is doubled (E + 1); final codes RNE clamped to [-128, 127]. A scale that
    underflows float32 becomes eps (2**-23); the quantizer clamps the step to >= 2**-126.
    onnx (``BFPCPUKernel``, bfp_method to_bfp, bit_width 16): E = max finite biased exponent field - 127;
    out = clamp(round(x / 2**(E-6)) * 2**(E-6), +-(2**(E+1) - 2**(E-6))) i.e. codes in [-127, 127], no
    exponent bump, Inf/NaN pass through, subnormals not flushed.
    onnx_compiler (``BFPCPUKernelCompiler``): like onnx, but if an element whose exponent equals the shared
    one rounds to >= 128 or < -128, E += 1 (once); the final clamp [-128 * 2**E, 127 * 2**E] never binds.
    """
    b = _blocks(x, block)
    with np.errstate(all="ignore"):
        if impl == "torch":
            if block != 8:
                raise ValueError("Quark-Torch fake_quantize_bfp16 always uses block_size 8")
            bx = np.nan_to_num(b, nan=0.0, posinf=0.0, neginf=0.0).astype(np.float32)
            amax = np.max(np.abs(bx), axis=-1, keepdims=True)

            def scale_of(a):
                s = _pow2_f32(np.floor(_log2_f32(a)).astype(np.float64) - 6)
                return np.where(s == 0, _EPS, s).astype(np.float32)

            def fq(s, lo, hi):  # fake_quantize_per_channel_affine with zero_point 0
                st = np.maximum(s, _TINY).astype(np.float32)
                inv = (np.float32(1) / st).astype(np.float32)
                q = np.clip(np.round((bx * inv).astype(np.float32)) + np.float32(0), lo, hi).astype(np.float32)
                return (q * st).astype(np.float32)

            s1 = scale_of(amax)
            r = (fq(s1, -129, 128) / s1).astype(np.float32)
            bump = np.any((r >= 128) | (r < -128), axis=-1, keepdims=True)
            amax2 = (amax * np.where(bump, np.float32(2), np.float32(1))).astype(np.float32)
            out = fq(scale_of(amax2), -128, 127)
        elif impl in ("onnx", "onnx_compiler"):
            ef = _exp_field(b)
            shared = np.max(np.where(ef == 0xFF, 0, ef), axis=-1, keepdims=True)
            E = shared - 127
            bits = 7  # m_bits = bit_width - 9
            if impl == "onnx":
                step = _pow2_f32(E - (bits - 1))
                hi = (np.ldexp(1.0, E + 1) - step.astype(np.float64)).astype(np.float32)
                lo = -hi
            else:
                step0 = _pow2_f32(E - (bits - 1))
                c0 = _round_half((b / step0).astype(np.float32), rounding)
                bump = np.any((ef == shared) & ((c0 >= 128) | (c0 < -128)), axis=-1, keepdims=True)
                E = E + bump
                step = _pow2_f32(E - (bits - 1))
                hi = (np.ldexp(1.0, E) * (2.0**bits - 1)).astype(np.float32)
                lo = (-np.ldexp(1.0, E) * 2.0**bits).astype(np.float32)
            y = (_round_half((b / step).astype(np.float32), rounding).astype(np.float32) * step).astype(np.float32)
            out = np.where(ef == 0xFF, b, np.maximum(lo, np.minimum(y, hi))).astype(np.float32)
        else:
            raise ValueError(f"impl must be 'torch', 'onnx' or 'onnx_compiler', got {impl!r}")
    return out.reshape(np.shape(x)).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------
# MX9 / MX6 / MX4 (MicroeXponents, arXiv 2302.08007)
# ----------------------------------------------------------------------------------------------------------

def quark_mx_shared(x, *, mantissa_bits: int, block: int = 16, sub_block: int = 2, impl: str = "torch",
                    rounding: str = "even") -> np.ndarray:
    """MX9 (mantissa_bits=7), MX6 (4), MX4 (2): block of 16 shares an 8-bit exponent E (max biased exponent
    field in the block), each pair (sub_block) has a 1-bit shift d = 1 iff every element of the pair has
    exponent < E; element = sign * M * 2**(E - d - mantissa_bits + 1), M = |x| / step rounded half to even,
    M <= 2**mantissa_bits - 1 (saturates).

    torch (0.13 ``fake_quantize_mx6_mx9``, quant_bit = mantissa_bits + 1; Quark-Torch has MX6/MX9 only):
    |x| < 2**-126 -> +0.0 first; NaN/Inf count as zero for E and d and come back unchanged.
    onnx (``BFPPrimeCPUKernel``, bit_width = mantissa_bits + 9): subnormals -> signed 0; any NaN/Inf in the
    block makes the whole block NaN.
    torch_legacy (github commit 1d27b55): no subnormal flush, clamp bound (2**(E+1) - step) / step (so 255
    in a shifted pair), Inf saturates to that bound, NaN stays NaN.
    """
    m = int(mantissa_bits)
    b = _blocks(x, block)
    if block % sub_block:
        raise ValueError("block must be a multiple of sub_block")
    sub_shape = b.shape[:-1] + (block // sub_block, sub_block)
    with np.errstate(all="ignore"):
        if impl in ("torch", "torch_legacy"):
            qb = m + 1
            xf = np.where(np.abs(b) < _TINY, np.float32(0), b).astype(np.float32) if impl == "torch" else b
            clean = np.nan_to_num(xf, nan=0.0, posinf=0.0, neginf=0.0).astype(np.float32)
            amax = np.max(np.abs(clean), axis=-1, keepdims=True)
            max_exp = _exp_field(amax) - 127
            t_exp = _exp_field(clean) - 127
            low = (max_exp - t_exp >= 1).reshape(sub_shape)
            shift = np.repeat(np.all(low, axis=-1), sub_block, axis=-1).reshape(b.shape)
            step = _pow2_f32(max_exp - shift - qb + 2)
            if impl == "torch":
                qmax = np.float32(2 ** (qb - 1) - 1)
            else:
                bound = np.minimum(np.ldexp(1.0, max_exp + 1) - step.astype(np.float64),
                                   float(np.finfo(np.float32).max)).astype(np.float32)
                qmax = (bound / step).astype(np.float32)
            codes = np.clip(np.round((xf / step).astype(np.float32)), -qmax, qmax).astype(np.float32)
            out = (codes * step).astype(np.float32)
            if impl == "torch":
                out = np.where(np.isfinite(xf), out, xf)
        elif impl == "onnx":
            ef = _exp_field(b)
            shared = np.max(ef, axis=-1, keepdims=True)  # NaN/Inf (255) included
            sub_max = np.max(ef.reshape(sub_shape), axis=-1)
            shift = np.repeat(np.minimum(shared - sub_max, 1), sub_block, axis=-1).reshape(b.shape)
            k = shared - 127 - shift + 1 - m
            a = np.where(ef == 0, 0.0, np.abs(b.astype(np.float64)))
            M = np.minimum(_round_half(np.ldexp(a, -k), rounding), 2.0**m - 1)
            sign = np.where(np.signbit(b), -1.0, 1.0)
            out = (sign * np.ldexp(1.0, k) * M).astype(np.float32)
            out = np.where(shared == 0xFF, _QNAN, out)
        else:
            raise ValueError(f"impl must be 'torch', 'torch_legacy' or 'onnx', got {impl!r}")
    return out.reshape(np.shape(x)).astype(np.float32)


def quark_mx9(x, *, impl: str = "torch", **kw) -> np.ndarray:
    """MX9 = :func:`quark_mx_shared` with 7 mantissa bits (Quark-Torch MX9Spec / ONNX bit_width 16)."""
    return quark_mx_shared(x, mantissa_bits=7, impl=impl, **kw)


def quark_mx6(x, *, impl: str = "torch", **kw) -> np.ndarray:
    """MX6 = :func:`quark_mx_shared` with 4 mantissa bits (Quark-Torch MX6Spec / ONNX bit_width 13)."""
    return quark_mx_shared(x, mantissa_bits=4, impl=impl, **kw)


def quark_mx4(x, *, impl: str = "onnx", **kw) -> np.ndarray:
    """MX4 = :func:`quark_mx_shared` with 2 mantissa bits; only Quark-ONNX has it (bit_width 11)."""
    return quark_mx_shared(x, mantissa_bits=2, impl=impl, **kw)

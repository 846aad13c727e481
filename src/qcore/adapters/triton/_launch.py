"""Host side of the kernels: argument checks (the core's own validators), layouts, launches. Imports triton."""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple, Optional

import numpy as np
import torch
import triton

import qcore
from qcore._backend import ops
from qcore._two_level import tensor_scale_from_amax, two_level_multipliers
from qcore.quantize import QTensor, check_qtensor, check_tensor_scale_arg, prepare_params, spec_of
from qcore.granularity import PerGroup
from qcore.algorithms.hadamard import dense_factor, fwht_plan
from qcore.scales import inverse_pow2_scales

from . import _kernels as K
from ._specs import (as_spec, channel_layout, decode_consts, element_consts, group_layout, int_code_signed,
                     scale_consts, w4_format, why_not)

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _interp(x: torch.Tensor) -> bool:
    return x.device.type == "cpu"


def _sizes(x: torch.Tensor) -> dict:
    """Launch sizes: large tiles on the interpreter (fewer Python-level programs), GPU-sized ones otherwise."""
    if _interp(x):
        return dict(ELEM=65536, GROUP_ELEMS=16384)
    return dict(ELEM=1024, GROUP_ELEMS=2048)


def _quiet(x):
    """numpy's floating-point warnings off under the interpreter (it runs the kernels' IEEE operations in numpy:
    overflow to Inf and NaN blocks are part of the semantics); nothing on a GPU."""
    return np.errstate(all="ignore") if _interp(x) else contextlib.nullcontext()


def _opts(x) -> dict:
    """Compile options on a GPU: no floating-point contraction (Triton 3.9 still fuses a * b + c into an FMA by
    default; the kernels' float operations must be the core's separately rounded ones)."""
    return {} if _interp(x) else {"enable_fp_fusion": False}


def _as_input(x, what="x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch tensor for the Triton kernels, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{what} must be a floating tensor, got dtype {x.dtype}")
    x = x.detach()
    if x.dtype not in _FLOATS:
        x = x.float()  # float64: rounded to float32 first, as the core does
    return x.contiguous()


class _Run(NamedTuple):
    val: Optional[torch.Tensor]
    codes: Optional[torch.Tensor]
    packed: Optional[torch.Tensor]
    scales: torch.Tensor
    scale_codes: Optional[torch.Tensor]
    zero_points: Optional[torch.Tensor]
    tensor_scale: Optional[torch.Tensor]


def _next_pow2(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


def _tensor_scale(x: torch.Tensor, spec, given) -> Optional[torch.Tensor]:
    if not spec.two_level:
        return None
    if given is not None:
        return given.reshape(()).float()
    if spec.tensor_scale_mode.name == "ONE":
        return torch.ones((), dtype=torch.float32, device=x.device)
    lo, hi = _min_max(x.reshape(1, 1, -1))
    amax = torch.maximum(-lo, hi).reshape(())
    return tensor_scale_from_amax(amax, spec, ops(amax), amax)


def _min_max(xv: torch.Tensor):
    """Per-channel (min, max) of an (A, K, B) view over axes 0 and 2, float32 (K,): one pass without a |x|
    temporary where the layout allows (per tensor, per row, per column); NaN propagates."""
    A, Kc, B = xv.shape
    if A == 1:
        lo, hi = torch.aminmax(xv.reshape(Kc, B), dim=1)
    elif B == 1:
        lo, hi = torch.aminmax(xv.reshape(A, Kc), dim=0)
    else:
        lo, hi = xv.amin(dim=(0, 2)), xv.amax(dim=(0, 2))
    return lo.float(), hi.float()


def _run(x, spec, *, scale=None, zero_point=None, tensor_scale=None, want_val=True, want_codes=False, pack=0):
    """The shared driver: x validated float tensor (contiguous), spec covered. Returns a _Run."""
    o = ops(x)
    shape = tuple(x.shape)
    g = _tensor_scale(x, spec, tensor_scale)
    ec = element_consts(spec)
    code_dtype = torch.int8 if int_code_signed(spec) else torch.uint8
    dev = x.device
    f32 = torch.float32
    sz = _sizes(x)
    n = x.numel()
    grouped = isinstance(spec.granularity, PerGroup)
    sshape = spec.scale_shape(shape)
    if grouped and scale is None:
        rows, C, G, ngc = group_layout(spec, shape)
        total = rows * ngc
        BLOCK = _next_pow2(G)
        NG = max(1, min(_next_pow2(total), sz["GROUP_ELEMS"] // BLOCK))
        val = torch.empty(shape, dtype=f32, device=dev) if want_val else torch.empty(1, dtype=f32, device=dev)
        codes = torch.empty(shape, dtype=code_dtype, device=dev) if want_codes else torch.empty(1, dtype=code_dtype,
                                                                                                device=dev)
        if pack == 4:
            PB = -(-C // 2)
        elif pack == 6:
            PB = -(-C // 4) * 3
        else:
            PB = 1
        packed = torch.zeros(shape[:-1] + (PB,), dtype=torch.uint8, device=dev) if pack else \
            torch.empty(1, dtype=torch.uint8, device=dev)
        s = torch.empty(total, dtype=f32, device=dev)
        sc = torch.empty(total, dtype=torch.int32, device=dev)
        zp = torch.empty(total, dtype=f32, device=dev)
        ts = g if g is not None else s
        K._group_quant_kernel[(triton.cdiv(total, NG),)](
            x, val, codes, packed, s, sc, zp, ts, total, ngc, C, PB, G=G, BLOCK=BLOCK, NG=NG, **scale_consts(spec),
            **ec, WRITE_VAL=want_val, WRITE_CODE=want_codes, PACK=pack, WRITE_SCALE=True,
            CODE_SIGNED=int_code_signed(spec), **_opts(x))
        scales = s.reshape(sshape)
        zps = None if spec.symmetric else zp.reshape(sshape)
        return _Run(val if want_val else None, codes if want_codes else None, packed if pack else None, scales,
                    sc.reshape(sshape), zps, g)
    # scales known before the element pass: given, or from per-tensor / per-channel statistics
    if scale is None:
        A, Kc, B = channel_layout(spec, shape)
        lo, hi = _min_max(x.reshape(A, Kc, B))
        amax = torch.maximum(-lo, hi).contiguous()  # max |x| exactly (NaN propagates)
        lo, hi = lo.contiguous(), hi.contiguous()
        s = torch.empty(Kc, dtype=f32, device=dev)
        mul, dq, zp = torch.empty_like(s), torch.empty_like(s), torch.empty_like(s)
        sc = torch.empty(Kc, dtype=torch.int32, device=dev)
        K._stats_scale_kernel[(triton.cdiv(Kc, 1024),)](amax, lo, hi, g if g is not None else s, s, mul, dq, zp, sc, Kc,
                                                        **scale_consts(spec), QMIN=ec["QMIN"], QMAX=ec["QMAX"],
                                                        BLOCK=1024, **_opts(x))
        layout, P1, P2, G = 0, Kc, B, 1
        scales = s.reshape(sshape)
        zps = None if spec.symmetric else zp.reshape(sshape)
        scode = sc.reshape(sshape)
    else:
        s = scale.float().contiguous().reshape(-1)
        if spec.pow2_scale:
            mul = inverse_pow2_scales(s, o, s).contiguous()
        else:
            mul = s
        if spec.two_level:  # pragma: no cover - refused by why_not (given two-level block scales)
            raise ValueError("given two-level block scales are not covered by the kernels")
        dq = s
        zp = torch.zeros_like(s) if zero_point is None else zero_point.float().contiguous().reshape(-1)
        scales = scale.float().reshape(sshape)
        zps = None if zero_point is None else zero_point.float().reshape(sshape)
        scode = None
        if grouped:
            rows, C, G, ngc = group_layout(spec, shape)
            layout, P1, P2 = 1, C, ngc
        else:
            A, Kc, B = channel_layout(spec, shape)
            layout, P1, P2, G = 0, Kc, B, 1
    val = torch.empty(shape, dtype=f32, device=dev) if want_val else torch.empty(1, dtype=f32, device=dev)
    codes = torch.empty(shape, dtype=code_dtype, device=dev) if want_codes else torch.empty(1, dtype=code_dtype,
                                                                                            device=dev)
    BLOCK = sz["ELEM"]
    K._elem_quant_kernel[(triton.cdiv(n, BLOCK),)](
        x, val, codes, s, mul, dq, zp, n, P1, P2, LAYOUT=layout, G=G, USE_MUL=bool(spec.pow2_scale), **ec,
        WRITE_VAL=want_val, WRITE_CODE=want_codes, CODE_SIGNED=int_code_signed(spec), BLOCK=BLOCK, **_opts(x))
    return _Run(val if want_val else None, codes if want_codes else None, None, scales, scode, zps, g)


def _prepare(x, spec, axis, overrides, scale, zero_point, tensor_scale):
    spec = spec_of(spec, axis, overrides)
    x = _as_input(x)
    reason = why_not(spec, ndim=x.dim(), given_scale=scale is not None)
    if reason is not None:
        raise ValueError(f"the Triton kernels do not cover this spec: {reason}; use qcore (the core) instead")
    o = ops(x)
    ts = check_tensor_scale_arg(tensor_scale, spec, o, x)
    s, zp = prepare_params(x, spec, scale, zero_point, o)
    if s is not None:
        s = s.to(x.device)
        zp = None if zp is None else zp.to(x.device)
    return x, spec, s, zp, ts


def fake_quantize(x, spec, *, axis=None, scale=None, zero_point=None, tensor_scale=None, **overrides):
    x, spec, s, zp, ts = _prepare(x, spec, axis, overrides, scale, zero_point, tensor_scale)
    if x.numel() == 0:
        return qcore.fake_quantize(x, spec, scale=s, zero_point=zp, tensor_scale=ts)
    with _quiet(x):
        return _run(x, spec, scale=s, zero_point=zp, tensor_scale=ts).val


def _no_nan_code(spec) -> bool:
    d = spec.dtype
    return not getattr(d, "has_nan", False)


def quantize(x, spec, *, axis=None, scale=None, zero_point=None, tensor_scale=None, **overrides) -> QTensor:
    x, spec, s, zp, ts = _prepare(x, spec, axis, overrides, scale, zero_point, tensor_scale)
    if x.numel() == 0 or (s is not None and _no_nan_code(spec) and bool(torch.isnan(x).any())):
        # the core's answer (an error for a NaN that the format cannot encode)
        return qcore.quantize(x, spec, scale=s, zero_point=zp, tensor_scale=ts)
    with _quiet(x):
        r = _run(x, spec, scale=s, zero_point=zp, tensor_scale=ts, want_val=False, want_codes=True)
    return QTensor(r.codes, r.scales, r.zero_points, spec, None, r.tensor_scale)


class Packed(NamedTuple):
    """``quantize_packed``'s result: packed codes (uint8, ``qcore.packing.pack`` layout along the last axis),
    scale codes (``QTensor.scale_codes``), float32 scales, zero points (or None), tensor scale (or None)."""

    packed: torch.Tensor
    scale_codes: torch.Tensor
    scales: torch.Tensor
    zero_points: Optional[torch.Tensor]
    tensor_scale: Optional[torch.Tensor]


def quantize_packed(x, spec, *, axis=None, tensor_scale=None, **overrides) -> Packed:
    x, spec, _, _, ts = _prepare(x, spec, axis, overrides, None, None, tensor_scale)
    bits = spec.dtype.bits
    if not isinstance(spec.granularity, PerGroup) or bits not in (4, 6, 8) or x.numel() == 0:
        raise ValueError(f"quantize_packed covers 4-, 6- and 8-bit elements in groups along the last axis, got "
                         f"{spec.name or spec.dtype.name} ({spec.granularity!r})")
    G = spec.granularity.size
    if bits < 8 and G % (2 if bits == 4 else 4):
        raise ValueError(f"quantize_packed: group size {G} must be a multiple of {2 if bits == 4 else 4}")
    with _quiet(x):
        r = _run(x, spec, tensor_scale=ts, want_val=False, want_codes=bits == 8, pack=0 if bits == 8 else bits)
    sc = r.scale_codes
    sc = sc.to(torch.uint8) if spec.scale_dtype.bits <= 8 else sc
    packed = r.codes.view(torch.uint8) if bits == 8 else r.packed
    return Packed(packed, sc, r.scales, r.zero_points, r.tensor_scale)


def dequantize(q: QTensor) -> torch.Tensor:
    if not isinstance(q, QTensor):
        raise TypeError(f"dequantize takes a QTensor, got {type(q).__name__}")
    codes, scales, zp, _ = check_qtensor(q)
    spec = q.spec
    if not isinstance(codes, torch.Tensor):
        raise TypeError("the Triton dequantize takes a QTensor of torch tensors")
    reason = why_not(spec, ndim=codes.dim())
    if reason is not None:
        raise ValueError(f"the Triton kernels do not cover this spec: {reason}; use qcore.dequantize")
    if spec.two_level and q.tensor_scale is None:
        raise ValueError(f"dequantize: spec {spec.name or spec.dtype.name!r} is two-level but the QTensor has no "
                         "tensor_scale")
    shape = tuple(codes.shape)
    dev = codes.device
    out = torch.empty(shape, dtype=torch.float32, device=dev)
    n = codes.numel()
    if n == 0:
        return out
    s = scales.float().contiguous().reshape(-1)
    if spec.two_level:
        gt = torch.as_tensor(q.tensor_scale, dtype=torch.float32, device=dev).reshape(())
        _, dq = two_level_multipliers(s, gt, ops(s))
        dq = dq.contiguous()
    else:
        dq = s
    zpt = torch.zeros_like(s) if zp is None else zp.float().contiguous().reshape(-1)
    if isinstance(spec.granularity, PerGroup):
        _, C, G, ngc = group_layout(spec, shape)
        layout, P1, P2 = 1, C, ngc
    else:
        _, Kc, B = channel_layout(spec, shape)
        layout, P1, P2, G = 0, Kc, B, 1
    BLOCK = _sizes(codes)["ELEM"]
    with _quiet(codes):
        K._dequant_kernel[(triton.cdiv(n, BLOCK),)](codes.contiguous(), s, dq, zpt, out, n, P1, P2, LAYOUT=layout, G=G,
                                                    BLOCK=BLOCK, **decode_consts(spec), **_opts(codes))
    return out


# -- packed 4-bit weights ------------------------------------------------------------------------------------------


def _w4_args(packed, scales, zero_points, spec, k):
    spec = as_spec(spec)
    fmt = w4_format(spec)
    if fmt is None:
        raise ValueError(f"spec {spec.name or spec.dtype.name!r}: the fused matmul reads int4/uint4 per-group "
                         "(float32 scales) and MXFP4 weights only")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int (the weight's input size), got {k!r}")
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 2:
        raise TypeError(f"packed must be a 2-D uint8 tensor [N, ceil(k/2)], got {getattr(packed, 'dtype', packed)!r}")
    N, PK = packed.shape
    if PK != -(-k // 2):
        raise ValueError(f"packed has {PK} bytes per row; k={k} needs {-(-k // 2)}")
    G = spec.granularity.size
    ngk = -(-k // G)
    if tuple(scales.shape) != (N, ngk):
        raise ValueError(f"scales has shape {tuple(scales.shape)}; expected {(N, ngk)}")
    if fmt == "mxfp4":
        if scales.dtype != torch.uint8:
            raise TypeError(f"MXFP4 scales must be E8M0 bytes (uint8), got {scales.dtype}")
        s = scales.contiguous()
    else:
        s = scales.float().contiguous()
    has_zp = zero_points is not None
    if has_zp != (not spec.symmetric):
        raise ValueError(f"zero_points must be given exactly for an asymmetric spec (symmetric={spec.symmetric})")
    zp = zero_points.to(torch.int32).contiguous() if has_zp else s
    if has_zp and tuple(zero_points.shape) != (N, ngk):
        raise ValueError(f"zero_points has shape {tuple(zero_points.shape)}; expected {(N, ngk)}")
    FMT = {"int4": 0, "uint4": 1, "mxfp4": 2}[fmt]
    return packed.contiguous(), s, zp, N, PK, ngk, G, FMT, has_zp


def dequantize_w4(packed, scales, zero_points=None, *, spec, k):
    w, s, zp, N, PK, ngk, G, FMT, has_zp = _w4_args(packed, scales, zero_points, spec, k)
    out = torch.empty((N, k), dtype=torch.float32, device=w.device)
    BN, BK = 32, 64
    with _quiet(w):
        K._w4_dequant_kernel[(triton.cdiv(N, BN), triton.cdiv(k, BK))](w, s, zp, out, N, k, PK, ngk, G=G, FMT=FMT,
                                                                      HAS_ZP=has_zp, BN=BN, BK=BK, **_opts(w))
    return out


def linear_w4(x, packed, scales, zero_points=None, bias=None, *, spec, k):
    w, s, zp, N, PK, ngk, G, FMT, has_zp = _w4_args(packed, scales, zero_points, spec, k)
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        raise TypeError(f"x must be a bfloat16 / float16 / float32 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features; the weight takes k={k}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, the weight on {w.device}")
    lead = tuple(x.shape[:-1])
    x2 = x.reshape(-1, k).contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*lead, N)
    if M <= _GEMV_MAX_M:
        return _gemv_w4(x2, w, s, zp, bias, N, k, PK, ngk, G, FMT, has_zp).reshape(*lead, N)
    BM = 16
    BN = 32 if _interp(x) else 64
    BK = 64 if _interp(x) else 128
    b = bias if bias is not None else y
    with _quiet(x):
        K._w4_matmul_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
            x2, w, s, zp, b, y, M, N, k, PK, ngk, x2.stride(0), y.stride(0), G=G, FMT=FMT, HAS_ZP=has_zp,
            HAS_BIAS=bias is not None, BM=BM, BN=BN, BK=BK, IEEE=x.dtype == torch.float32, EMULATE=_interp(x),
            X_BF16=x.dtype == torch.bfloat16, **_opts(x))
    return y.reshape(*lead, N)


_GEMV_MAX_M = 4


def _gemv_w4(x2, w, s, zp, bias, N, k, PK, ngk, G, FMT, has_zp):
    """Batch <= _GEMV_MAX_M: a GEMV over (N / BN) x splits x M programs, enough to fill a GPU at batch 1. One
    launch when one K range suffices; else split-K float32 partials and a second launch that sums them in order,
    adds the bias in float32 and rounds once to x's dtype."""
    M = x2.shape[0]
    interp = _interp(x2)
    BN, BK = (32, 64) if interp else (32, 128)
    n_blocks = triton.cdiv(N, BN)
    k_blocks = triton.cdiv(k, BK)
    target = 4 if interp else 2 * _sm_count(x2.device)
    split = max(1, min(k_blocks, -(-target // max(1, n_blocks * M))))
    kchunk = triton.cdiv(k_blocks, split) * BK
    split = triton.cdiv(k, kchunk)
    y = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    part = torch.empty((split, M, N), dtype=torch.float32, device=x2.device) if split > 1 else y
    b = bias if bias is not None else y
    flags = dict(X_BF16=x2.dtype == torch.bfloat16, EMULATE=interp)
    with _quiet(x2):
        K._w4_gemv_kernel[(n_blocks, split, M)](x2, w, s, zp, b, part, y, M, N, k, PK, ngk, x2.stride(0), kchunk,
                                                G=G, FMT=FMT, HAS_ZP=has_zp, HAS_BIAS=bias is not None,
                                                DIRECT=split == 1, BN=BN, BK=BK, X_F16=x2.dtype == torch.float16,
                                                **flags, **_opts(x2))
        if split > 1:
            K._splitk_sum_kernel[(triton.cdiv(M * N, 1024),)](part, b, y, split, M * N, N,
                                                              HAS_BIAS=bias is not None, BLOCK=1024, **flags,
                                                              **_opts(x2))
    return y


def _sm_count(device) -> int:
    try:
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    except Exception:  # pragma: no cover - no device properties: a generic guess
        return 100


# -- FWHT ------------------------------------------------------------------------------------------------------------


def fwht(x, *, axis: int = -1):
    x = _as_input(x)
    m, k2 = fwht_plan(tuple(x.shape), axis)
    n = int(x.shape[axis])
    y = torch.movedim(x, axis, -1).contiguous()
    rows = y.numel() // n if n else 0
    out = torch.empty(y.shape, dtype=torch.float32, device=y.device)
    if rows:
        h = torch.as_tensor(dense_factor(m).astype(np.int32), device=y.device).contiguous()
        rdiv = float(np.float32(math.sqrt(n)))
        with _quiet(y):
            K._fwht_kernel[(rows,)](y, h, out, rdiv, MD=m, MP=_next_pow2(m), K2=k2, LOGK2=k2.bit_length() - 1,
                                    **_opts(y))
    return torch.movedim(out, -1, axis)

"""The tensors of one quantized layer in AMD Quark's HF checkpoint layout, and qcore's extension of it.

Pure numpy: a weight's qcore parts (codes in the canonical ``[out, in, *kernel]`` layout, float32 scales of
``spec.scale_shape``, zero points, sub-block shifts, the per-tensor scale of two-level formats) <-> the named
arrays a checkpoint holds for it (``weight``, ``weight_scale``, ``weight_zero_point``, ``weight_scale_2``, ...).
The file I/O is ``formats.safetensors_io``; the binding to modules is ``qcore.adapters.io.quark_hf``.

Quark's layouts (what amd-quark 0.13's ``export_safetensors(..., weight_format="real_quantized")`` writes, checked
byte for byte in ``tests/formats/test_quark_layout.py`` and by the interop suite):

================ ===================================== ====================== ==================================
layout           ``weight``                            ``weight_scale``       ``weight_zero_point``
================ ===================================== ====================== ==================================
``int8``         I8/U8 codes ``[out, in]``             F32 ``()`` / ``[out]`` I8/U8, as the scale (0: symmetric)
``fp8``          F8_E4M3/F8_E5M2 ``[out, in]``         F32 ``()`` / ``[out]`` --
``int4_channel`` I32 ``[out, in/8]`` (nibbles)         F32 ``[out]``          I32 ``[out/8]``
``int4_group``   I32 ``[in, out/8]`` (of the transpose) F32 ``[in/G, out]``   I32 ``[in/G, out/8]``
``mx``           U8 ``[out, in/2]`` fp4,               U8 e8m0 ``[out, in/32]`` --
                 ``[out, in*3/4]`` fp6
``nvfp4``        U8 ``[out, in/2]``                    F8_E4M3 ``[out, in/16]`` -- ; ``weight_scale_2`` F32 ``()``
================ ===================================== ====================== ==================================

Nibbles in int32 follow the export's ``pack_method`` ("reorder": slot ``i`` holds element ``[0,2,4,6,1,3,5,7][i]``;
"order": element ``i``); int4 values are two's complement nibbles, uint4 zero points are codes. fp4 packs two per
byte (low nibble first), fp6 four per three bytes (``qcore.packing.pack_fp6``).

**qcore's extension** (layout ``"qcore"``; the checkpoint's ``quant_method`` is then ``"qcore"``, and every
quantized weight of such a checkpoint is in this layout, those of Quark's formats too): every other weight format (MX9/MX6/MX4, BFP16, MXINT8, int2, int3, groups that do not divide the row, conv and embedding
weights, scales in other formats). ``weight`` is the 1-D ``U8`` byte string of ``qcore.packing.pack(codes,
dtype, axis=-1)`` of the canonical codes (its shape matches no float weight, so a loader that does not know the
method fails on the shape instead of reading codes as floats); ``weight_scale`` holds the scales in qcore's scale
shape, as their values (``F32``, ``F16``, ``BF16`` for ``scale_dtype`` float32, float16, bfloat16) or ``U8``
scale codes (8-bit scale formats);
``weight_zero_point`` ``F32`` zero points (codes); ``weight_shifts`` ``U8`` sub-block shifts; ``weight_scale_2``
the per-tensor scale.

Activations: a static ``input_scale`` / ``output_scale`` is ``F32`` ``()`` (per tensor) or ``[features]``, with an
``I8`` / ``U8`` zero point for integer formats (Quark writes one for symmetric int8 too); a two-level (NVFP4)
calibrated per-tensor scale is ``input_scale_2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

import qcore
from qcore import PerChannel, PerGroup, PerTensor, QuantSpec
from qcore.dtypes import FloatDType, IntDType
from qcore.packing import Int4Order

from .safetensors_io import CorruptCheckpointError

__all__ = ["LAYOUTS", "WeightParts", "weight_layout", "expected_weight", "encode_weight", "decode_weight",
           "activation_tensors", "expected_activation", "decode_activation", "PACK_METHODS"]

LAYOUTS = ("int8", "fp8", "int4_channel", "int4_group", "mx", "nvfp4", "qcore")
PACK_METHODS = {"reorder": Int4Order.REORDER, "order": Int4Order.ORDER}

_FP8 = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_MX_ELEMENTS = ("float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn")


@dataclass(frozen=True)
class WeightParts:
    """A quantized weight in qcore's terms (canonical layout). ``scales``: float32 of ``spec.scale_shape(shape)``;
    ``zero_points``: float32 codes or None; ``shifts``: int sub-block shifts or None; ``tensor_scale``: float32
    0-d or None."""

    codes: np.ndarray
    scales: np.ndarray
    zero_points: Optional[np.ndarray] = None
    shifts: Optional[np.ndarray] = None
    tensor_scale: Optional[np.ndarray] = None


def _plain_scale(spec: QuantSpec) -> bool:
    return spec.scale_dtype.name == "float32" and not spec.two_level and spec.subblock_shift_bits == 0


def weight_layout(spec: QuantSpec, shape: tuple, *, module: str = "Linear") -> str:
    """The layout a weight of ``shape`` (canonical) quantized by ``spec`` is stored in: one of Quark's (``int8``,
    ``fp8``, ``int4_channel``, ``int4_group``, ``mx``, ``nvfp4``) or ``"qcore"`` (the extension)."""
    if module != "Linear" or len(shape) != 2:
        return "qcore"
    out, n_in = shape
    el, g = spec.dtype, spec.granularity
    per_row = isinstance(g, PerTensor) or (isinstance(g, PerChannel) and g.axis % 2 == 0)
    if isinstance(el, IntDType) and el.bits == 8 and per_row and _plain_scale(spec):
        return "int8"
    if el.name in _FP8 and per_row and _plain_scale(spec):
        return "fp8"
    if isinstance(el, IntDType) and el.bits == 4 and _plain_scale(spec) and out % 8 == 0:
        if isinstance(g, PerChannel) and g.axis % 2 == 0 and n_in % 8 == 0:
            return "int4_channel"
        if isinstance(g, PerGroup) and g.axis % 2 == 1 and n_in % g.size == 0:
            return "int4_group"
    if (el.name in _MX_ELEMENTS and isinstance(g, PerGroup) and g.axis % 2 == 1 and g.size == 32 and n_in % 32 == 0
            and spec.scale_dtype.name == "float8_e8m0fnu" and not spec.two_level and spec.symmetric is not False
            and spec.subblock_shift_bits == 0):  # shared micro-exponent shifts: no tensor of Quark's holds them
        return "mx"
    if (el.name == "float4_e2m1fn" and isinstance(g, PerGroup) and g.axis % 2 == 1 and g.size == 16
            and n_in % 16 == 0 and spec.scale_dtype.name == "float8_e4m3fn" and spec.two_level
            and spec.subblock_shift_bits == 0):
        return "nvfp4"
    return "qcore"


def _int_dtype(el) -> str:
    return ("I" if el.signed else "U") + str(el.bits)


def _scale_code_dtype(spec: QuantSpec) -> str:
    """qcore layout: float32 / float16 / bfloat16 scales as their values (F32 / F16 / BF16), 8-bit scale
    formats as their U8 codes."""
    sd = spec.scale_dtype
    if sd.name in _SCALE_ST:
        return _SCALE_ST[sd.name]
    if sd.bits == 8:
        return "U8"
    raise ValueError(f"scale_dtype {sd.name} has no safetensors storage in qcore's layout (float32, float16, "
                     f"bfloat16 or an 8-bit format)")


_SCALE_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def _encode_scales(sc: np.ndarray, spec: QuantSpec) -> np.ndarray:
    """float32 scale values -> the qcore layout's stored array (see ``_scale_code_dtype``)."""
    name = spec.scale_dtype.name
    if name == "float32":
        return sc
    if name == "float16":
        return sc.astype(np.float16)  # float16 values (QTensor scales of a float16 spec): exact
    codes = np.asarray(qcore.encode(sc, spec.scale_dtype))
    return codes.astype(np.uint16 if name == "bfloat16" else np.uint8)


def _decode_scales(sc: np.ndarray, spec: QuantSpec) -> np.ndarray:
    name = spec.scale_dtype.name
    if name == "float32":
        return sc.astype(np.float32)
    if name == "float16":
        return sc.view(np.float16).astype(np.float32) if sc.dtype != np.float16 else sc.astype(np.float32)
    if name == "bfloat16":  # the bits (torch's bfloat16 is read as int16 / uint16)
        return (np.ascontiguousarray(sc).view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return np.asarray(qcore.decode(sc.view(np.uint8), spec.scale_dtype), np.float32)


def expected_weight(spec: QuantSpec, shape: tuple, *, layout: str) -> dict[str, tuple[str, tuple]]:
    """``{suffix: (safetensors dtype, shape)}`` of the tensors a weight in ``layout`` is stored as."""
    shape = tuple(shape)
    el, g = spec.dtype, spec.granularity
    sshape = tuple(spec.scale_shape(shape))
    if layout in ("int8", "fp8"):
        s = () if isinstance(g, PerTensor) else (shape[0],)
        out = {"weight": (_int_dtype(el) if layout == "int8" else _FP8[el.name], shape), "weight_scale": ("F32", s)}
        if layout == "int8":
            out["weight_zero_point"] = (_int_dtype(el), s)
        return out
    if layout == "int4_channel":
        return {"weight": ("I32", (shape[0], shape[1] // 8)), "weight_scale": ("F32", (shape[0],)),
                "weight_zero_point": ("I32", (shape[0] // 8,))}
    if layout == "int4_group":
        ng = shape[1] // g.size
        return {"weight": ("I32", (shape[1], shape[0] // 8)), "weight_scale": ("F32", (ng, shape[0])),
                "weight_zero_point": ("I32", (ng, shape[0] // 8))}
    if layout == "mx":
        per = 2 if el.bits == 4 else None
        cols = shape[1] // 2 if per else shape[1] * 3 // 4
        return {"weight": ("U8", (shape[0], cols)), "weight_scale": ("U8", sshape)}
    if layout == "nvfp4":
        return {"weight": ("U8", (shape[0], shape[1] // 2)), "weight_scale": ("F8_E4M3", sshape),
                "weight_scale_2": ("F32", ())}
    if layout != "qcore":
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    rows = math.prod(shape[:-1])
    nbytes = rows * int(qcore.packing.pack(np.zeros((1, shape[-1]), _code_np(el)), el, axis=-1).nbytes)
    out = {"weight": ("U8", (nbytes,)), "weight_scale": (_scale_code_dtype(spec), sshape)}
    if not spec.symmetric:
        out["weight_zero_point"] = ("F32", sshape)
    if spec.subblock_shift_bits:
        out["weight_shifts"] = ("U8", _shift_shape(spec, shape))
    if spec.two_level:
        out["weight_scale_2"] = ("F32", ())
    return out


def _shift_shape(spec: QuantSpec, shape: tuple) -> tuple:
    x = np.zeros(shape, np.float32)
    return tuple(qcore.quantize(x, spec).subblock_shifts.shape)


def _code_np(el):
    if isinstance(el, IntDType):
        return np.int8 if el.signed and el.bits <= 8 else (np.uint8 if el.bits <= 8 else np.int32)
    return np.uint8 if el.bits <= 8 else np.int32


def _zp_codes(zp: Optional[np.ndarray], n: tuple, el) -> np.ndarray:
    if zp is None:
        return np.zeros(n, _code_np(el))
    return np.asarray(zp).reshape(n).astype(np.int64).astype(_code_np(el))


_PACK_ROWS_ELEMENTS = 1 << 20  # codes packed at once by _pack_int4_rows


def _pack_int4_rows(codes, order) -> np.ndarray:
    """``qcore.packing.pack_int4_int32(codes, order=order, axis=-1)`` of a 2-D array (a transposed view is fine),
    packed a slice of rows at a time into one int32 array: the same words (packing works along the rows), but the
    whole-array call widens every code to int64 several times over (about 30 bytes a code, 2 GB for a 13B model's
    MLP weight); here that is bounded by the slice, and the slices stay in cache (faster too)."""
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.shape[0] * codes.shape[1] <= _PACK_ROWS_ELEMENTS:
        return qcore.packing.pack_int4_int32(np.ascontiguousarray(codes), order=order, axis=-1)
    step = max(1, _PACK_ROWS_ELEMENTS // codes.shape[1])
    out = np.empty((codes.shape[0], -(-codes.shape[1] // 8)), np.int32)
    for i in range(0, codes.shape[0], step):
        out[i:i + step] = _pack_int4_slice(np.ascontiguousarray(codes[i:i + step]), order)
    return out


_INT4_SLOTS = {qcore.packing.Int4Order.ORDER: tuple(range(8)),  # element e of a group of 8 -> its nibble slot
               qcore.packing.Int4Order.REORDER: tuple((0, 2, 4, 6, 1, 3, 5, 7).index(e) for e in range(8))}


def _pack_int4_slice(c: np.ndarray, order) -> np.ndarray:
    """``pack_int4_int32(c, order=order, axis=-1)``: uint8 / int8 codes in range and whole words are packed in
    uint32 (each nibble shifted into its slot: the words ``pack_int4_int32`` sums in int64); anything else goes
    to ``pack_int4_int32`` itself (its checks and errors)."""
    if c.dtype in (np.uint8, np.int8) and c.shape[-1] % 8 == 0 and c.size:
        lo, hi = (0, 15) if c.dtype == np.uint8 else (-8, 15)
        if int(c.min()) >= lo and int(c.max()) <= hi:
            g = c.view(np.uint8).reshape(c.shape[0], -1, 8)
            slots = _INT4_SLOTS[qcore.packing.Int4Order(order)]
            word = np.zeros(g.shape[:2], np.uint32)
            for e in range(8):
                word |= (g[..., e] & np.uint8(0xF)).astype(np.uint32) << np.uint32(4 * slots[e])
            return word.view(np.int32)
    return qcore.packing.pack_int4_int32(c, order=order, axis=-1)


def encode_weight(parts: WeightParts, spec: QuantSpec, *, layout: str, pack_method: str = "reorder") -> dict:
    """``{suffix: (safetensors dtype, numpy array)}`` for ``parts`` in ``layout`` (see ``expected_weight``)."""
    order = PACK_METHODS[pack_method]
    el = spec.dtype
    codes = np.asarray(parts.codes)
    shape = codes.shape
    exp = expected_weight(spec, shape, layout=layout)
    if layout in ("int8", "fp8"):
        s = exp["weight_scale"][1]
        out = {"weight": codes.astype(_code_np(el)), "weight_scale": np.asarray(parts.scales, np.float32).reshape(s)}
        if layout == "int8":
            out["weight_zero_point"] = _zp_codes(parts.zero_points, s, el)
    elif layout == "int4_channel":
        zp = _zp_codes(parts.zero_points, (shape[0],), el)
        out = {"weight": _pack_int4_rows(codes, order),
               "weight_scale": np.asarray(parts.scales, np.float32).reshape(shape[0]),
               "weight_zero_point": qcore.packing.pack_int4_int32(zp, order=order, axis=-1)}
    elif layout == "int4_group":
        ng = exp["weight_scale"][1][0]
        zp = _zp_codes(parts.zero_points, (shape[0], ng), el)
        out = {"weight": _pack_int4_rows(codes.T, order),
               "weight_scale": np.ascontiguousarray(np.asarray(parts.scales, np.float32).reshape(shape[0], ng).T),
               "weight_zero_point": qcore.packing.pack_int4_int32(np.ascontiguousarray(zp.T), order=order, axis=-1)}
    elif layout in ("mx", "nvfp4"):
        out = {"weight": qcore.packing.pack(codes, el, axis=-1),
               "weight_scale": np.asarray(qcore.encode(np.asarray(parts.scales, np.float32), spec.scale_dtype),
                                          np.uint8)}
        if layout == "nvfp4":
            out["weight_scale_2"] = np.asarray(parts.tensor_scale, np.float32).reshape(())
    elif layout == "qcore":
        out = {"weight": np.asarray(qcore.packing.pack(codes.reshape(-1, shape[-1]), el, axis=-1)).reshape(-1)
               .view(np.uint8)}
        sc = np.asarray(parts.scales, np.float32)
        out["weight_scale"] = _encode_scales(sc, spec)
        if not spec.symmetric:
            out["weight_zero_point"] = np.asarray(parts.zero_points, np.float32)
        if spec.subblock_shift_bits:
            out["weight_shifts"] = np.asarray(parts.shifts).astype(np.uint8)
        if spec.two_level:
            out["weight_scale_2"] = np.asarray(parts.tensor_scale, np.float32).reshape(())
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    result = {}
    for k, (dt, shp) in exp.items():
        a = np.array(out[k], order="C", copy=None)
        if tuple(a.shape) != tuple(shp):
            raise ValueError(f"{k}: encoded shape {list(a.shape)} differs from the layout's {list(shp)} (a qcore bug)")
        result[k] = (dt, a)
    return result


def _fail(where: str, msg: str):
    raise CorruptCheckpointError(f"{where}: {msg}")


def check_zero_points(zp: Optional[np.ndarray], spec: QuantSpec, *, name: str, where: str) -> Optional[np.ndarray]:
    """The zero points to use for ``spec`` from the stored ``zp`` (float32 codes, or None when none is stored),
    checked: a symmetric spec's stored zero points are all 0 (returns None); an asymmetric spec's are finite
    integers in the element's code range. ``CorruptCheckpointError`` naming ``where`` and the tensor ``name``."""
    if zp is None:
        return None
    zp = np.asarray(zp, np.float32)
    if spec.symmetric:
        if bool(np.any(zp != 0)):
            bad = zp[zp != 0]
            _fail(where, f"{name} holds {bad.size} nonzero values (e.g. {bad.flat[0]}) but the config's "
                         f"{spec.name or spec.dtype.name} spec is symmetric (zero points 0)")
        return None
    lo, hi = float(spec.qmin), float(spec.qmax)
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(zp) & (zp >= lo) & (zp <= hi) & (zp == np.round(zp))
    if not bool(np.all(ok)):
        bad = zp[~ok]
        _fail(where, f"{name} holds {bad.size} values that are not integers in the code range [{lo:g}, {hi:g}] "
                     f"of {spec.dtype.name} (e.g. {bad.flat[0]})")
    return zp


#: the largest float32: dequantized weights (codes x scales) must stay below it
FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_representable(scales: np.ndarray, spec: QuantSpec, *, where: str, max_weight: float = FLOAT32_MAX,
                        tensor_scale: Optional[np.ndarray] = None, name: str = "weight_scale") -> None:
    """Scales (finite and positive, checked before) whose dequantized weights are representable: the largest
    scale times the largest code distance of ``spec`` (``qmax - qmin`` asymmetric, ``max(|qmin|, qmax)``
    symmetric; times a two-level tensor scale) at most ``max_weight`` (the model dtype's largest finite value;
    float32's by default). A larger scale would load as inf weights and NaN outputs."""
    top = float(np.max(scales, initial=0.0)) * (float(np.max(tensor_scale)) if tensor_scale is not None else 1.0)
    amp = (spec.qmax - spec.qmin) if not spec.symmetric else max(abs(spec.qmin), abs(spec.qmax))
    if not top * amp <= max_weight:
        raise CorruptCheckpointError(f"{where}: {name} holds {top:g}, which times the largest code distance "
                                     f"{amp:g} of {spec.dtype.name} is past {max_weight:g}, the largest value of "
                                     f"the model's dtype (the weights would load as inf)")


def decode_weight(arrays: Mapping[str, np.ndarray], spec: QuantSpec, shape: tuple, *, layout: str,
                  pack_method: str = "reorder", where: str = "weight", max_weight: float = FLOAT32_MAX) -> WeightParts:
    """The inverse of ``encode_weight``: ``arrays`` maps each suffix of ``expected_weight`` to a numpy array
    (fp8 tensors as their uint8 bytes). Checks what a corrupted checkpoint would get wrong: scales that are not
    finite and positive, e8m0 NaN codes, zero points out of the code range, codes of 8-bit formats out of range,
    and scales whose weights would pass ``max_weight`` (``check_representable``)."""
    order = PACK_METHODS[pack_method]
    el = spec.dtype
    shape = tuple(shape)
    sshape = tuple(spec.scale_shape(shape))
    signed = bool(getattr(el, "signed", True))
    zp = shifts = ts = None
    if layout in ("int8", "fp8"):
        codes = np.asarray(arrays["weight"]).view(_code_np(el))
        scales = np.asarray(arrays["weight_scale"], np.float32).reshape(sshape)
        if layout == "int8":
            zp = np.asarray(arrays["weight_zero_point"]).astype(np.float32).reshape(sshape)
    elif layout == "int4_channel":
        codes = qcore.packing.unpack_int4_int32(np.asarray(arrays["weight"]), order=order, axis=-1,
                                                length=shape[1], signed=signed)
        scales = np.asarray(arrays["weight_scale"], np.float32).reshape(sshape)
        z = qcore.packing.unpack_int4_int32(np.asarray(arrays["weight_zero_point"]), order=order, axis=-1,
                                            length=shape[0], signed=signed)
        zp = z.astype(np.float32).reshape(sshape)
    elif layout == "int4_group":
        codes = np.ascontiguousarray(qcore.packing.unpack_int4_int32(
            np.asarray(arrays["weight"]), order=order, axis=-1, length=shape[0], signed=signed).T)
        scales = np.ascontiguousarray(np.asarray(arrays["weight_scale"], np.float32).T).reshape(sshape)
        z = qcore.packing.unpack_int4_int32(np.asarray(arrays["weight_zero_point"]), order=order, axis=-1,
                                            length=shape[0], signed=signed)
        zp = np.ascontiguousarray(z.T).astype(np.float32).reshape(sshape)
    elif layout in ("mx", "nvfp4"):
        codes = qcore.packing.unpack(np.asarray(arrays["weight"]), el, axis=-1, length=shape[1])
        sc = np.asarray(arrays["weight_scale"]).view(np.uint8).reshape(sshape)
        if layout == "mx" and bool((sc == 255).any()):
            _fail(where, "weight_scale holds the E8M0 NaN code 255")
        scales = np.asarray(qcore.decode(sc, spec.scale_dtype), np.float32)
        if layout == "nvfp4":
            ts = np.asarray(arrays["weight_scale_2"], np.float32).reshape(())
    elif layout == "qcore":
        flat = np.asarray(arrays["weight"]).view(np.uint8)
        row_bytes = flat.size // max(1, math.prod(shape[:-1]))
        packed = flat.reshape(math.prod(shape[:-1]), row_bytes)
        codes = np.asarray(qcore.packing.unpack(packed, el, axis=-1, length=shape[-1])).reshape(shape)
        sc = np.asarray(arrays["weight_scale"])
        scales = _decode_scales(sc, spec)
        if not spec.symmetric:
            zp = np.asarray(arrays["weight_zero_point"], np.float32)
        if spec.subblock_shift_bits:
            shifts = np.asarray(arrays["weight_shifts"]).astype(np.int32)
            if int(shifts.max(initial=0)) >= 2 ** spec.subblock_shift_bits:
                _fail(where, f"weight_shifts holds shifts >= {2 ** spec.subblock_shift_bits}")
        if spec.two_level:
            ts = np.asarray(arrays["weight_scale_2"], np.float32).reshape(())
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not bool(np.all(np.isfinite(scales))) or not bool(np.all(scales > 0)):
        bad = scales[~(np.isfinite(scales) & (scales > 0))]
        _fail(where, f"weight_scale holds {bad.size} values that are not finite and positive (e.g. {bad.flat[0]})")
    if ts is not None and not (np.isfinite(ts) and ts > 0):
        _fail(where, f"weight_scale_2 is {float(ts)}, expected a finite positive float")
    check_representable(scales, spec, where=where, max_weight=max_weight, tensor_scale=ts)
    zp = check_zero_points(zp, spec, name="weight_zero_point", where=where)
    if isinstance(el, FloatDType) and el.bits == 8 and not el.name.startswith("float8_e5m2"):
        nan = np.asarray(qcore.decode(np.asarray(codes, np.uint8), el))
        if not bool(np.all(np.isfinite(nan))):
            _fail(where, "weight holds NaN or Inf fp8 codes")
    return WeightParts(codes=np.asarray(codes), scales=scales, zero_points=zp, shifts=shifts, tensor_scale=ts)


# ---------------------------------------------------------------------------------------------------------------
# activations (static scales)
# ---------------------------------------------------------------------------------------------------------------


def expected_activation(role: str, spec: QuantSpec, shape: tuple, *, layout: str) -> dict[str, tuple[str, tuple]]:
    """The tensors of a calibrated activation role (``input`` / ``output``): ``shape`` is the stored scale's shape
    (``()`` per tensor, ``(features,)`` per feature); two-level specs store their per-tensor scale only."""
    if spec.two_level:
        return {f"{role}_scale_2": ("F32", ())}
    out = {f"{role}_scale": ("F32", tuple(shape))}
    if isinstance(spec.dtype, IntDType):
        if layout == "qcore":
            if not spec.symmetric:
                out[f"{role}_zero_point"] = ("F32", tuple(shape))
        else:
            out[f"{role}_zero_point"] = (_int_dtype(spec.dtype), tuple(shape))
    elif not spec.symmetric:
        out[f"{role}_zero_point"] = ("F32", tuple(shape))
    return out


def activation_tensors(role: str, spec: QuantSpec, *, scale: Optional[np.ndarray] = None,
                       zero_point: Optional[np.ndarray] = None, tensor_scale: Optional[np.ndarray] = None,
                       layout: str) -> dict:
    """``{name: (safetensors dtype, array)}`` for a calibrated activation role."""
    if spec.two_level:
        return {f"{role}_scale_2": ("F32", np.asarray(tensor_scale, np.float32).reshape(()))}
    s = np.asarray(scale, np.float32)
    exp = expected_activation(role, spec, s.shape, layout=layout)
    out = {f"{role}_scale": ("F32", s)}
    zname = f"{role}_zero_point"
    if zname in exp:
        dt = exp[zname][0]
        z = np.zeros(s.shape, np.float32) if zero_point is None else np.asarray(zero_point, np.float32)
        out[zname] = (dt, z if dt == "F32" else z.astype(np.int64).astype(_code_np(spec.dtype)))
    return out


def decode_activation(arrays: Mapping[str, np.ndarray], role: str, spec: QuantSpec, *, where: str) -> dict:
    """``{"scale", "zero_point", "tensor_scale"}`` (float32 numpy or None) from the stored tensors, validated."""
    if spec.two_level:
        ts = np.asarray(arrays[f"{role}_scale_2"], np.float32).reshape(())
        if not (np.isfinite(ts) and ts > 0):
            _fail(where, f"{role}_scale_2 is {float(ts)}, expected a finite positive float")
        return {"scale": None, "zero_point": None, "tensor_scale": ts}
    s = np.asarray(arrays[f"{role}_scale"], np.float32)
    if not bool(np.all(np.isfinite(s) & (s > 0))):
        _fail(where, f"{role}_scale holds values that are not finite and positive")
    z = arrays.get(f"{role}_zero_point")
    zp = check_zero_points(None if z is None else np.asarray(z).astype(np.float32).reshape(s.shape), spec,
                           name=f"{role}_zero_point", where=where)
    return {"scale": s, "zero_point": zp, "tensor_scale": None}


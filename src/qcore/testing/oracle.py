"""The oracle side: compute what a kernel must return with qcore on numpy, compare, and explain mismatches.

``assert_matches_oracle(actual, x, fmt, op=Op.FAKE_QUANTIZE)`` moves ``x`` to host numpy (float32 for float
inputs), runs the qcore numpy function named by ``op`` with ``fmt`` (a format name, dtype or ``QuantSpec``) and
the keyword ``overrides``, and compares ``actual`` (numpy or torch, any device) with it, bit for bit or within
``ulps``. On a mismatch it raises ``AssertionError`` listing the first mismatches: flat index and index, the
input element and its bits, expected and actual values and bits, ulp distance, the probe kind (with
``kinds=``), and for scaled formats the oracle's block: its index, scale (and E8M0 byte), amax, zero point and
sub-block shift.

========================= ================================ ================================================
``op``                    ``x``                            ``actual``, compared with
========================= ================================ ================================================
``Op.CAST``               float values                     float32 ``qcore.cast(x, fmt, **overrides)``
``Op.ENCODE``             float values                     integer codes ``qcore.encode(x, fmt, ...)``
                                                           (compared as values: signed integer formats give
                                                           values, int4: -8..7, not 4-bit fields)
``Op.DECODE``             integer codes                    float32 ``qcore.decode(x, fmt)``
``Op.QUANTIZE``           float values                     ``qcore.quantize(x, fmt, ...)``: a ``QTensor``
                                                           (numpy or torch parts), a tuple ``(codes, scales[,
                                                           zero_points[, subblock_shifts[, tensor_scale]]])``
                                                           or a dict with those keys. Scales may be float32
                                                           values or, for 8-bit scale dtypes, their codes
                                                           (E8M0 / e4m3 bytes). Zero points, shifts and the
                                                           two-level tensor scale are compared when given.
``Op.DEQUANTIZE``         a ``QTensor`` (or float values,  float32 ``qcore.dequantize(x)`` (or of
                          which the oracle quantizes)      ``quantize(x, fmt, ...)``)
``Op.FAKE_QUANTIZE``      float values                     float32 ``qcore.fake_quantize(x, fmt, ...)``
``Op.PACK``               integer codes (or float values,  packed bytes in the format's default layout,
                          which the oracle encodes)        ``qcore.packing.pack(codes, fmt)`` (dense bits up
                                                           to 8 bits: ``pack_fp4``, ``pack_fp6``,
                                                           ``pack_bits(codes, bits)``; 16-bit LE words above;
                                                           block formats use their element), or
                                                           ``pack_int4_int32`` with ``order=``; ``axis=``
========================= ================================ ================================================

numpy only: torch tensors are read through their methods, torch is never imported.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import replace
from typing import Any, Optional, Union

import numpy as np

from .. import packing
from .._typing import Array, ArrayLike, SpecLike
from ..cast import cast, decode, encode
from ..dtypes import BlockDType, FloatDType, IntDType, get_dtype
from ..granularity import tile_shape
from ..quantize import QTensor, QuantSpec, dequantize, fake_quantize, quantize
from .compare import (BlockInfo, Kinds, Report, assert_equal, check_opts, compare, compare_arrays, float_bits,
                      kind_labels, merge_reports, to_numpy)
from .probes import probes_by_kind

__all__ = ["Op", "reference", "assert_matches_oracle", "check_against_oracle", "Oracle"]


class Op(enum.Enum):
    """Which qcore function a kernel implements (see the module table)."""

    CAST = "cast"
    ENCODE = "encode"
    DECODE = "decode"
    QUANTIZE = "quantize"
    DEQUANTIZE = "dequantize"
    FAKE_QUANTIZE = "fake_quantize"
    PACK = "pack"


_QUANT_OPS = (Op.QUANTIZE, Op.DEQUANTIZE, Op.FAKE_QUANTIZE)


def _check_op(op):
    if not isinstance(op, Op):
        raise TypeError(f"op must be a qcore.testing.Op member (e.g. Op.FAKE_QUANTIZE), got {op!r}")


# ---------------------------------------------------------------------------------------------------------------
# host copies
# ---------------------------------------------------------------------------------------------------------------


def _host_float(x) -> np.ndarray:
    a = to_numpy(x, name="x")
    if a.dtype.kind != "f":
        raise TypeError(f"x must be a floating-point array for this op, got dtype {a.dtype}")
    return np.ascontiguousarray(a.astype(np.float32))


def _host_int(x) -> np.ndarray:
    a = to_numpy(x, name="x")
    if a.dtype.kind not in "iu":
        raise TypeError(f"x must be an integer array of codes for this op, got dtype {a.dtype}")
    return a


def _host_qtensor(q: QTensor) -> QTensor:
    def h(v):
        return None if v is None else to_numpy(v)

    ss = q.super_scales
    if ss is not None and dataclasses.is_dataclass(ss):  # GGUF types' stored scales: their arrays on the host
        ss = dataclasses.replace(ss, **{f.name: h(getattr(ss, f.name)) for f in dataclasses.fields(ss)})
    return QTensor(h(q.codes), h(q.scales), h(q.zero_points), q.spec, h(q.subblock_shifts), h(q.tensor_scale),
                   h(q.offsets), ss)


# ---------------------------------------------------------------------------------------------------------------
# the oracle
# ---------------------------------------------------------------------------------------------------------------


def _pack_reference(codes: np.ndarray, fmt, overrides: dict):
    d = fmt.dtype if isinstance(fmt, QuantSpec) else get_dtype(fmt)
    if isinstance(d, BlockDType):
        d = d.element
    axis = overrides.get("axis", -1)
    unknown = set(overrides) - {"axis", "order"}
    if unknown:
        raise TypeError(f"Op.PACK takes only axis= and order= options, got {', '.join(sorted(unknown))}")
    if "order" in overrides:
        if not (isinstance(d, IntDType) and d.bits == 4):
            raise ValueError(f"order= (int4 in int32) applies to int4/uint4 codes, not {d.name}")
        return packing.pack_int4_int32(codes, order=overrides["order"], axis=axis, signed=d.signed), 32, axis
    lay = packing.default_layout(d)  # the one packing rule, shared with qcore.conformance
    return packing.pack(codes, d, axis=axis), lay.field_bits, axis


def reference(x: Union[ArrayLike, QTensor], fmt_or_spec: SpecLike, *, op: Op = Op.FAKE_QUANTIZE,
              **overrides: Any) -> Union[Array, QTensor]:
    """What a kernel implementing ``op`` must return for input ``x``: qcore's numpy result (a ``QTensor`` for
    ``Op.QUANTIZE``, packed bytes for ``Op.PACK``, else an array). ``x`` is moved to host numpy first."""
    _check_op(op)
    with np.errstate(invalid="ignore", over="ignore", under="ignore", divide="ignore"):
        return _reference(x, fmt_or_spec, op, overrides)


def _reference(x, fmt_or_spec, op, overrides):
    if op is Op.CAST:
        return cast(_host_float(x), fmt_or_spec, **overrides)
    if op is Op.ENCODE:
        return encode(_host_float(x), fmt_or_spec, **overrides)
    if op is Op.DECODE:
        if overrides:
            raise TypeError(f"Op.DECODE takes no options, got {', '.join(sorted(overrides))}")
        return decode(_host_int(x), fmt_or_spec)
    if op is Op.QUANTIZE:
        return quantize(_host_float(x), fmt_or_spec, **_no_compile(overrides))
    if op is Op.FAKE_QUANTIZE:
        return fake_quantize(_host_float(x), fmt_or_spec, **_no_compile(overrides))
    if op is Op.DEQUANTIZE:
        if isinstance(x, QTensor):
            return dequantize(_host_qtensor(x))
        return dequantize(quantize(_host_float(x), fmt_or_spec, **_no_compile(overrides)))
    codes = _pack_codes(x, fmt_or_spec)
    return _pack_reference(codes, fmt_or_spec, overrides)[0]


def _fmt_name(fmt) -> str:
    if isinstance(fmt, QuantSpec):
        return fmt.name or f"QuantSpec({fmt.dtype.name}, {fmt.granularity})"
    return get_dtype(fmt).name


def _no_compile(overrides: dict) -> dict:
    return {k: v for k, v in overrides.items() if k != "compile"}


def _pack_codes(x, fmt):
    a = to_numpy(x, name="x")
    if a.dtype.kind == "f":
        d = fmt.dtype if isinstance(fmt, QuantSpec) else get_dtype(fmt)
        if isinstance(d, BlockDType):
            d = d.element
        return encode(a.astype(np.float32), d)
    if a.dtype.kind not in "iu":
        raise TypeError(f"x must be codes (integers) or float values for Op.PACK, got dtype {a.dtype}")
    return a


# ---------------------------------------------------------------------------------------------------------------
# block context
# ---------------------------------------------------------------------------------------------------------------


def _scale_code(scale: float, scale_dtype) -> Optional[int]:
    if scale_dtype.name == "float32" or scale_dtype.bits > 16:
        return None
    try:
        return int(np.asarray(encode(np.array([scale], np.float32), scale_dtype)).reshape(-1)[0]) & 0xFFFF
    except ValueError:
        return None


class _Blocks:
    """Finds the oracle's block of an element (or a scale index) and describes it."""

    def __init__(self, q: QTensor, x: Optional[np.ndarray]):
        self.q = q
        self.x = x
        self.spec = q.spec
        self.shape = tuple(q.codes.shape)
        self.tile = tile_shape(self.spec.granularity, self.shape)
        self.scales = to_numpy(q.scales).astype(np.float32)
        self.zp = None if q.zero_points is None else to_numpy(q.zero_points)
        self.shifts = None if q.subblock_shifts is None else to_numpy(q.subblock_shifts)

    def block_of(self, idx: tuple) -> tuple:
        return tuple(int(i) // t for i, t in zip(idx, self.tile))

    def info(self, bidx: tuple, elem_idx: Optional[tuple] = None) -> BlockInfo:
        if len(bidx) == 0:
            s = float(self.scales.reshape(-1)[0]) if self.scales.size else float("nan")
        else:
            s = float(self.scales[bidx])
        amax = amax_bits = None
        if self.x is not None and self.x.shape == self.shape:
            sl = tuple(slice(b * t, (b + 1) * t) for b, t in zip(bidx, self.tile))
            with np.errstate(invalid="ignore"):
                blk = np.abs(self.x[sl])
                a = np.float32(np.max(blk)) if blk.size else np.float32(0)
            amax, amax_bits = float(a), int(float_bits(a))
        zp = None if self.zp is None else float(self.zp[bidx])
        shift = None
        if self.shifts is not None and elem_idx is not None:
            g = self.spec.granularity
            ax = g.axis % len(self.shape)
            sidx = list(elem_idx)
            sidx[ax] = sidx[ax] // self.spec.subblock_size
            shift = int(self.shifts[tuple(sidx)])
        return BlockInfo(tuple(bidx), s, int(float_bits(np.float32(s))), self.spec.scale_dtype.name,
                         _scale_code(s, self.spec.scale_dtype), amax, amax_bits, zp, shift)


def _with_blocks(report: Report, blocks: Optional[_Blocks], *, scale_component: bool = False) -> Report:
    if blocks is None or not report.mismatches:
        return report
    out = []
    for m in report.mismatches:
        if scale_component:
            out.append(replace(m, block=blocks.info(m.multi_index)))
        else:
            out.append(replace(m, block=blocks.info(blocks.block_of(m.multi_index), m.multi_index)))
    return replace(report, mismatches=out)


def _code_note(report: Report, d) -> Report:
    """For float-element codes, say what each code decodes to."""
    if not isinstance(d, FloatDType) or not report.mismatches:
        return report
    out = []
    lo, hi = 0, (1 << d.bits) - 1
    for m in report.mismatches:
        def val(c):
            if not isinstance(c, int) or not lo <= c <= hi:
                return "not a code"
            return str(np.float32(decode(np.array([c], np.int32), d)[0]))

        note = f"{d.name} values: expected {val(m.expected)}, actual {val(m.actual)}"
        out.append(replace(m, note=(m.note + "; " if m.note else "") + note))
    return replace(report, mismatches=out)


# ---------------------------------------------------------------------------------------------------------------
# QUANTIZE: components
# ---------------------------------------------------------------------------------------------------------------


def _parts(actual) -> dict:
    names = ("codes", "scales", "zero_points", "subblock_shifts", "tensor_scale", "offsets")
    if isinstance(actual, dict):
        unknown = set(actual) - set(names)
        if unknown:
            raise TypeError(f"actual: unknown QTensor part(s) {', '.join(sorted(unknown))}; use {names}")
        return {k: actual.get(k) for k in names}
    if isinstance(actual, (tuple, list)):
        if not 2 <= len(actual) <= 6:
            raise TypeError("actual: a tuple (codes, scales[, zero_points[, subblock_shifts[, tensor_scale[, "
                            "offsets]]]])")
        vals = list(actual) + [None] * (6 - len(actual))
        return dict(zip(names, vals))
    if hasattr(actual, "codes") and hasattr(actual, "scales"):
        return {k: getattr(actual, k, None) for k in names}
    raise TypeError(f"actual for Op.QUANTIZE must be a QTensor, a tuple or a dict, got {type(actual).__name__}")


def _scales_expected(actual_scales, expected: np.ndarray, spec: QuantSpec):
    """Compare scale codes with codes when the kernel returns integer scales (E8M0 bytes)."""
    a = to_numpy(actual_scales, name="scales")
    if a.dtype.kind in "iu" and spec.scale_dtype.name != "float32":
        sd = spec.scale_dtype
        e = expected.astype(np.float32)
        if np.any(np.isnan(e)) and not sd.has_nan:
            return decode(a.astype(np.int32), sd), e
        return a, encode(e, sd)
    return a, expected


# ---------------------------------------------------------------------------------------------------------------
# the assertion
# ---------------------------------------------------------------------------------------------------------------


def check_against_oracle(actual: Any, x: Union[ArrayLike, QTensor], fmt_or_spec: SpecLike, *,
                         op: Op = Op.FAKE_QUANTIZE, ulps: int = 0, max_report: int = 10,
                         kinds: Optional[Kinds] = None, nan_equal: bool = True, signed_zero: bool = True,
                         **overrides: Any) -> Report:
    """``assert_matches_oracle`` without the raise: the ``Report``."""
    with np.errstate(invalid="ignore", over="ignore", under="ignore", divide="ignore"):
        return _check(actual, x, fmt_or_spec, op=op, ulps=ulps, max_report=max_report, kinds=kinds,
                      nan_equal=nan_equal, signed_zero=signed_zero, **overrides)


def _check(actual, x, fmt_or_spec, *, op, ulps, max_report, kinds, nan_equal, signed_zero, **overrides) -> Report:
    _check_op(op)
    check_opts(ulps, nan_equal, signed_zero, max_report)
    opts = dict(ulps=ulps, nan_equal=nan_equal, signed_zero=signed_zero, max_report=max_report)
    title = f"{op.name} {_fmt_name(fmt_or_spec)}"

    if op is Op.PACK:
        codes = _pack_codes(x, fmt_or_spec)
        expected, bits, axis = _pack_reference(codes, fmt_or_spec, overrides)
        labels = None if kinds is None else kind_labels(kinds, codes.shape[0] if codes.ndim else 1)
        ax = axis % codes.ndim
        per = 8 if bits == 32 else None

        def row_of(r):
            if ax != 0:
                return r
            return (r * 8) // bits if per is None else r * 8

        rep = compare_arrays(actual, expected, component="packed", row_of=row_of, kinds=labels, title=title,
                             **opts)
        return _pack_notes(rep, codes, bits, ax)

    if op in (Op.CAST, Op.ENCODE, Op.FAKE_QUANTIZE, Op.QUANTIZE) or (op is Op.DEQUANTIZE and
                                                                     not isinstance(x, QTensor)):
        xh = _host_float(x)
    elif op is Op.DECODE:
        xh = _host_int(x)
    else:
        xh = None
    labels = None
    if kinds is not None:
        shape0 = (x.codes.shape if isinstance(x, QTensor) else xh.shape)
        labels = kind_labels(kinds, shape0[0] if len(shape0) else 1)

    if op is Op.CAST:
        expected = cast(xh, fmt_or_spec, **overrides)
        return compare_arrays(actual, expected, inputs=xh, kinds=labels, title=title, **opts)
    if op is Op.ENCODE:
        expected = encode(xh, fmt_or_spec, **overrides)
        rep = compare_arrays(actual, expected, inputs=xh, kinds=labels, title=title, **opts)
        return _code_note(rep, get_dtype(fmt_or_spec))
    if op is Op.DECODE:
        expected = decode(xh, fmt_or_spec)
        return compare_arrays(actual, expected, inputs=xh, kinds=labels, title=title, **opts)

    ov = _no_compile(overrides)
    if op is Op.DEQUANTIZE and isinstance(x, QTensor):
        q = _host_qtensor(x)
        expected = dequantize(q)
        rep = compare_arrays(actual, expected, inputs=q.codes, kinds=labels, title=title, **opts)
        return _with_blocks(rep, _Blocks(q, None))
    if op is Op.FAKE_QUANTIZE:
        expected = fake_quantize(xh, fmt_or_spec, **ov)
        rep = compare_arrays(actual, expected, inputs=xh, kinds=labels, title=title, **opts)
        if rep.mismatches:  # the block context comes from the oracle's QTensor
            try:
                q = quantize(xh, fmt_or_spec, **ov)
            except ValueError:  # codes that cannot be encoded (NaN in a NaN-less format): no context then
                return rep
            rep = _with_blocks(rep, _Blocks(q, xh))
        return rep
    q = quantize(xh, fmt_or_spec, **ov)
    blocks = _Blocks(q, xh)
    if op is Op.DEQUANTIZE:
        expected = dequantize(q)
        rep = compare_arrays(actual, expected, inputs=xh, kinds=labels, title=title, **opts)
        return _with_blocks(rep, blocks)

    # Op.QUANTIZE: scales first (usually the root cause), then zero points, shifts, codes.
    parts = _parts(actual)
    if parts["codes"] is None or parts["scales"] is None:
        raise TypeError("actual for Op.QUANTIZE needs codes and scales")
    spec = q.spec
    tile0 = blocks.tile[0] if blocks.tile else 1
    reports = []
    a_s, e_s = _scales_expected(parts["scales"], to_numpy(q.scales), spec)
    r = compare_arrays(a_s, e_s, component="scales", kinds=labels, row_of=lambda r: r * tile0, title=title,
                       **{**opts, "ulps": 0})
    reports.append(_with_blocks(r, blocks, scale_component=True))
    if q.zero_points is not None:
        if parts["zero_points"] is None:
            reports.append(Report(False, 0, 0, [], problem="zero_points: the oracle has zero points (asymmetric "
                                                           "spec) but actual gives none", title=title))
        else:
            r = compare_arrays(parts["zero_points"], q.zero_points, component="zero_points", kinds=labels,
                               row_of=lambda r: r * tile0, title=title, **{**opts, "ulps": 0})
            reports.append(_with_blocks(r, blocks, scale_component=True))
    if q.offsets is not None:  # float block offsets (GGUF Q2_K/Q4_K/Q5_K, Q4_1/Q5_1): compared bit for bit
        if parts["offsets"] is None:
            reports.append(Report(False, 0, 0, [], problem="offsets: the oracle has float block offsets but actual "
                                                           "gives none", title=title))
        else:
            r = compare_arrays(parts["offsets"], q.offsets, component="offsets", kinds=labels,
                               row_of=lambda r: r * tile0, title=title, **{**opts, "ulps": 0})
            reports.append(_with_blocks(r, blocks, scale_component=True))
    if q.subblock_shifts is not None and parts["subblock_shifts"] is not None:
        sub = spec.subblock_size
        ax = spec.granularity.axis % xh.ndim

        def row_sub(r):
            return r * sub if ax == 0 else r

        r = compare_arrays(parts["subblock_shifts"], q.subblock_shifts, component="subblock_shifts", kinds=labels,
                           row_of=row_sub, title=title, **{**opts, "ulps": 0})
        reports.append(r)
    if q.tensor_scale is not None and parts["tensor_scale"] is not None:
        a_t = np.asarray(to_numpy(parts["tensor_scale"]), dtype=np.float32).reshape(-1)
        r = compare_arrays(a_t, np.asarray(q.tensor_scale, dtype=np.float32).reshape(-1), component="tensor_scale",
                           title=title, **{**opts, "ulps": 0})
        reports.append(r)
    r = compare_arrays(parts["codes"], q.codes, component="codes", inputs=xh, kinds=labels, title=title,
                       **{**opts, "ulps": 0})
    r = _code_note(_with_blocks(r, blocks), spec.dtype)
    reports.append(r)
    return merge_reports(reports, max_report=max_report, title=title)


def _pack_notes(rep: Report, codes: np.ndarray, bits: int, ax: int) -> Report:
    if not rep.mismatches:
        return rep
    n = codes.shape[ax]
    out = []
    for m in rep.mismatches:
        k = m.multi_index[ax]
        if bits == 32:
            first, last = 8 * k, 8 * k + 7
        else:
            first, last = (8 * k) // bits, (8 * k + 7) // bits
        last = min(last, n - 1)
        idx = list(m.multi_index)
        vals = []
        for j in range(first, last + 1):
            idx[ax] = j
            vals.append(int(codes[tuple(idx)]))
        mask = 0xF if bits == 32 else (1 << bits) - 1
        shown = ", ".join(f"0x{v & mask:x}" for v in vals)
        note = f"packs elements {first}..{last} along axis {ax}: codes [{shown}]"
        out.append(replace(m, note=note, input=vals[0] if vals else None,
                           input_bits=(vals[0] & 0xFF) if vals else None, input_kind="i", input_width=2))
    return replace(rep, mismatches=out)


def assert_matches_oracle(actual: Any, x: Union[ArrayLike, QTensor], fmt_or_spec: SpecLike, *,
                          op: Op = Op.FAKE_QUANTIZE, ulps: int = 0, max_report: int = 10,
                          kinds: Optional[Kinds] = None, nan_equal: bool = True, signed_zero: bool = True,
                          **overrides: Any) -> Report:
    """Assert that ``actual`` (a kernel's output for input ``x``) equals qcore's numpy result of ``op`` for
    ``fmt_or_spec`` (with keyword ``overrides``: spec fields, ``axis``, ``key``, ``rounding``, ``saturate``,
    ...), bit for bit or within ``ulps`` (float outputs). Raises ``AssertionError`` with the report; returns the
    ``Report`` when everything matches. ``kinds``: ``probes_by_kind``'s dict for ``x`` (names the probe kind of
    each mismatch)."""
    rep = check_against_oracle(actual, x, fmt_or_spec, op=op, ulps=ulps, max_report=max_report, kinds=kinds,
                               nan_equal=nan_equal, signed_zero=signed_zero, **overrides)
    if not rep.ok:
        raise AssertionError(rep.format())
    return rep


class Oracle:
    """What the ``qcore_oracle`` pytest fixture gives a test: the kit's functions in one object.

    ``probes``/``probes_by_kind`` remember the arrays they return, so that ``assert_matches(actual, x, fmt)``
    with one of those very arrays as ``x`` names the probe kind of every mismatch without ``kinds=``.
    """

    Op = Op

    def __init__(self) -> None:
        # id(array) -> (array, kinds dict): the arrays this fixture handed out
        self._kinds: dict[int, tuple[np.ndarray, dict[str, np.ndarray]]] = {}

    def probes(self, fmt: SpecLike, **kw: Any) -> np.ndarray:
        kinds = probes_by_kind(fmt, **kw)
        x = np.ascontiguousarray(np.concatenate(list(kinds.values()), axis=0), dtype=np.float32)
        self._kinds[id(x)] = (x, kinds)
        return x

    def probes_by_kind(self, fmt: SpecLike, **kw: Any) -> dict[str, np.ndarray]:
        return probes_by_kind(fmt, **kw)

    def kinds_of(self, x: Any) -> Optional[dict[str, np.ndarray]]:
        """The kinds dict of an array this object's ``probes`` returned, else None."""
        entry = self._kinds.get(id(x))
        return entry[1] if entry is not None and entry[0] is x else None

    # (``Op`` in these annotations is the enum; the class attribute ``Op`` above is that same enum.)
    def reference(self, x: Union[ArrayLike, QTensor], fmt_or_spec: SpecLike, *,
                  op: Op = Op.FAKE_QUANTIZE,  # type: ignore[valid-type]
                  **overrides: Any) -> Union[Array, QTensor]:
        return reference(x, fmt_or_spec, op=op, **overrides)

    def check(self, actual: Any, x: Union[ArrayLike, QTensor], fmt_or_spec: SpecLike, *,
              op: Op = Op.FAKE_QUANTIZE,  # type: ignore[valid-type]
              kinds: Optional[Kinds] = None, **kw: Any) -> Report:
        kinds = self.kinds_of(x) if kinds is None else kinds
        return check_against_oracle(actual, x, fmt_or_spec, op=op, kinds=kinds, **kw)

    def assert_matches(self, actual: Any, x: Union[ArrayLike, QTensor], fmt_or_spec: SpecLike, *,
                       op: Op = Op.FAKE_QUANTIZE,  # type: ignore[valid-type]
                       kinds: Optional[Kinds] = None, **kw: Any) -> Report:
        kinds = self.kinds_of(x) if kinds is None else kinds
        return assert_matches_oracle(actual, x, fmt_or_spec, op=op, kinds=kinds, **kw)

    @staticmethod
    def compare(actual: ArrayLike, expected: ArrayLike, **kw: Any) -> Report:
        return compare(actual, expected, **kw)

    @staticmethod
    def assert_equal(actual: ArrayLike, expected: ArrayLike, **kw: Any) -> Report:
        return assert_equal(actual, expected, **kw)

"""Conformance vectors on disk: inputs and qcore's expected outputs, for test suites that have no Python.

``export(directory, formats)`` writes, per format and per mode, one *case* folder holding the probe inputs
(``qcore.testing.probes``) and every output a kernel under test produces, computed by the numpy oracle:

==================================== ================================================================================
file (``.npy`` + raw ``.bin``)        contents
==================================== ================================================================================
``input``                             float32 inputs (element formats: 1-D; block formats: rows x cols, blocks along
                                      the last axis, a ragged last block included)
``expected_cast``                     element formats: ``qcore.cast`` values (float32)
``expected_codes``                    ``qcore.encode`` codes / ``QTensor.codes`` (uint8 bit patterns for float
                                      elements; int8/uint8 values for integer elements; int32 above 8 bits)
``expected_packed``                   uint8 bytes along the last axis, ``qcore.packing.pack(codes, format)``: the
                                      dense ``pack_bits(codes, bits)`` bitstream up to 8 bits (fp4 = ``pack_fp4``,
                                      fp6 = ``pack_fp6``, MX4's 3-bit and MX6's 5-bit elements 8 codes -> 3 / 5
                                      bytes), 16-bit little-endian words above (``default_layout``)
``input_tensor_scale``                two-level formats (NVFP4): the per-tensor float32 scale ``g`` (shape (1,)) the
                                      kernel is given (1.0 in mode ``tensor_scale_one``)
``expected_scales``                   block formats: float32 scales, one per block (NaN for a NaN/Inf block)
``expected_scale_codes``              block formats: the scales' bytes in the scale format (E8M0; NVFP4: e4m3)
``expected_shifts``                   MX9/MX6/MX4: int32 microexponent per sub-block (padding sub-blocks included)
``expected_dequantized``              block formats: ``dequantize(quantize(x))`` (float32)
==================================== ================================================================================

Next to them: ``manifest.json`` (qcore version, formats, and per case the format, op, mode, semantics, blocked
axis and block size, and per file its dtype, shape and sha256) and ``manifest.tsv``, one tab-separated line per
array (``case role dtype shape file format op mode block_size``), so that a C++/HIP test needs neither a JSON
nor an npy parser: it reads the ``.bin`` files (raw little-endian, C order) named in the TSV. When the optional
``safetensors`` package is importable, each case also gets a ``vectors.safetensors`` with all its arrays.

A kernel's test writes its outputs under the same relative names (``<case>/expected_codes.bin`` or ``.npy``;
``<case>/codes.bin`` is accepted too) and ``check(vectors, outputs)`` (or ``qcore conformance check``) compares
them bit for bit with ``qcore.testing.compare`` and reports per case: ok, the first mismatches (index, input,
expected, actual and their bits) or the missing files.

Modes (``modes=``, default per format):

- element formats (op ``cast``): ``<rounding>`` with the format's default overflow rule, ``<rounding>_saturate``
  (``saturate=True``) or ``<rounding>_nosaturate`` (``saturate=False``; impossible for formats that always
  saturate), rounding one of ``nearest_even`` (the default mode), ``nearest_away``, ``toward_zero``, ``floor``,
  ``ceil``;
- block formats (op ``quantize``): ``scale_floor``, ``scale_ceil``, ``scale_even``, ``scale_rceil`` (``ScaleMode``).
  OCP MX formats (mxfp8/mxfp6/mxfp4/mxint8) default to all four; MX9/MX6/MX4 and bfp16 to their own rule.
- two-level block formats (NVFP4, op ``quantize``): ``tensor_scale_one`` (tensor scale 1, ``TensorScale.ONE``)
  and ``tensor_scale_given`` (the fixed tensor scale ``CONFORMANCE_TENSOR_SCALE`` = float32(0.1) given to the
  kernel, ``TensorScale.GIVEN``), both by default. A tensor scale computed from the amax of the whole probe set
  is not exported: one NaN/Inf probe makes every block NaN (docs/numerics.md, "Two-level scales").
- ``all``: every mode of every family that applies to the format.

A mode of one family does not touch formats of the other: ``modes=["nearest_even_saturate"]`` with
``["float8_e4m3fn", "mxfp4"]`` gives fp8 its saturating case and mxfp4 its default cases. A mode that fits some
of the formats but not others is skipped for the others (``nearest_even_nosaturate`` for fp4, which always
saturates), and the manifest's ``skipped`` says why. A mode that fits none of the formats is an error
(``ValueError`` naming the mode and each format: ``modes=["nearest_even"]`` with ``["mxfp4"]``), never
ignored. The semantics are those of docs/numerics.md; each case's ``semantics`` line in the manifest says
which rule it pins.

Element formats without a NaN code (fp4, fp6, integers) cannot encode NaN: NaN probes are dropped from their
inputs (the manifest's ``dropped_nan_inputs`` counts them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from ._typing import FormatLike
from .cast import cast, decode, encode
from .dtypes import DTYPES, BlockDType, FloatDType, IntDType, ScaleMode, Specials, TensorScale, get_dtype
from .quantize import dequantize, fake_quantize, make_spec, quantize
from .rounding import RoundingMode
from . import __version__, packing, testing
from ._fsutil import check_not_source, staged_dir

__all__ = [
    "ELEMENT_MODES",
    "BLOCK_MODES",
    "TWO_LEVEL_MODES",
    "CONFORMANCE_TENSOR_SCALE",
    "SCHEMA",
    "Manifest",
    "CaseResult",
    "FileResult",
    "CheckReport",
    "DirectoryNotEmptyError",
    "default_modes",
    "export",
    "load_manifest",
    "check",
]

SCHEMA = "qcore-conformance/1"
DOCS = "docs/numerics.md"

_ROUNDINGS = ("nearest_even", "nearest_away", "toward_zero", "floor", "ceil")
_OVERFLOW = (("", None), ("_saturate", True), ("_nosaturate", False))
ELEMENT_MODES: tuple[str, ...] = tuple(r + suffix for r in _ROUNDINGS for suffix, _ in _OVERFLOW)
"""Modes of element formats (op ``cast``): rounding mode plus overflow rule."""
BLOCK_MODES: tuple[str, ...] = tuple("scale_" + m.value for m in ScaleMode)
"""Modes of block formats (op ``quantize``): the ``ScaleMode`` of the shared scale."""
TWO_LEVEL_MODES: tuple = ("tensor_scale_one", "tensor_scale_given")
"""Modes of two-level block formats (NVFP4, op ``quantize``): where the per-tensor scale comes from."""
CONFORMANCE_TENSOR_SCALE = np.float32(0.1)
"""The per-tensor scale of mode ``tensor_scale_given`` (not a power of two, so the two-level arithmetic rounds)."""

_OCP_MX = frozenset({"mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "mxint8"})

_SCALE_RULE = {
    ScaleMode.FLOOR: "s = floor(log2 amax) - emax_elem (OCP MX v1.0)",
    ScaleMode.CEIL: "s = floor(log2 amax) - emax_elem, +1 unless amax is a power of two",
    ScaleMode.EVEN: "s = floor(log2(amax rounded RNE to the element's mantissa bits)) - emax_elem (AMD Quark)",
    ScaleMode.RCEIL: "s = ceil(log2(fp32(amax / max_elem))): float32 quotient, exact ceiling (NVIDIA cvt.rp)",
}

# Roles in the order they are written; "input" first. Roles starting with "input" are given to the kernel.
_ROLE_ORDER = ("input", "input_tensor_scale", "expected_cast", "expected_codes", "expected_packed", "expected_scales",
               "expected_scale_codes", "expected_shifts", "expected_dequantized")


# ---------------------------------------------------------------------------------------------------------------
# modes
# ---------------------------------------------------------------------------------------------------------------


def _parse_element_mode(mode: str):
    for r in _ROUNDINGS:
        for suffix, sat in _OVERFLOW:
            if mode == r + suffix:
                return RoundingMode(r), sat
    raise ValueError(f"not an element mode: {mode!r}")


def _parse_block_mode(mode: str) -> ScaleMode:
    return ScaleMode(mode[len("scale_"):])


def _two_level(d) -> bool:
    return isinstance(d, BlockDType) and d.tensor_scale is not TensorScale.NONE


def default_modes(fmt: FormatLike) -> tuple[str, ...]:
    """The modes ``export`` writes for ``fmt`` when ``modes`` is None (see the module docstring)."""
    d = get_dtype(fmt)
    if _two_level(d):
        return TWO_LEVEL_MODES
    if isinstance(d, BlockDType):
        if d.name in _OCP_MX:
            return BLOCK_MODES
        return ("scale_" + d.scale_mode.value,)
    return ("nearest_even",)


def _always_saturates(d) -> bool:
    return isinstance(d, IntDType) or d.specials is Specials.FINITE


def _mode_problem(d, mode: str) -> Optional[str]:
    """Why ``mode`` cannot be exported for ``d`` (None if it can)."""
    if isinstance(d, BlockDType):
        return None
    _, sat = _parse_element_mode(mode)
    if sat is False and _always_saturates(d):
        return f"{d.name} always saturates (no Inf or NaN code), so it has no _nosaturate mode"
    return None


def normalize_modes(modes) -> Optional[list]:
    """``export``'s ``modes`` (None, ``"all"``, a comma-separated string or a sequence of names) as a list of
    checked mode names, or None."""
    if modes is None:
        return None
    if isinstance(modes, str):
        modes = [m for m in modes.split(",")]
    try:
        modes = [m.strip().lower() for m in modes]
    except (TypeError, AttributeError):
        raise TypeError(f"modes must be None, a comma-separated str or a list of str, got {modes!r}") from None
    modes = [m for m in modes if m]
    if not modes:
        raise ValueError("modes is empty; leave it None for each format's default modes")
    known = set(ELEMENT_MODES) | set(BLOCK_MODES) | set(TWO_LEVEL_MODES) | {"all"}
    bad = [m for m in modes if m not in known]
    if bad:
        raise ValueError(
            f"unknown mode(s) {', '.join(map(repr, bad))}; known: all, element formats: {', '.join(ELEMENT_MODES)}; "
            f"block formats: {', '.join(BLOCK_MODES)}; two-level block formats: {', '.join(TWO_LEVEL_MODES)}"
        )
    return list(dict.fromkeys(modes))


def _modes_for(d, modes: Optional[list]):
    """(modes to export, [(mode, reason) skipped]) for dtype ``d``."""
    family = TWO_LEVEL_MODES if _two_level(d) else BLOCK_MODES if isinstance(d, BlockDType) else ELEMENT_MODES
    if modes is None:
        wanted, explicit = list(default_modes(d)), True
    elif "all" in modes:
        wanted, explicit = list(family), False
        if not isinstance(d, BlockDType) and _always_saturates(d):
            # "<r>_saturate" is "<r>" again for a format that always saturates: not worth a second case.
            wanted = [m for m in wanted if not m.endswith("_saturate")]
    else:
        wanted = [m for m in modes if m in family]
        explicit = True
        if not wanted:
            wanted = list(default_modes(d))
    out, skipped = [], []
    for m in wanted:
        why = _mode_problem(d, m)
        if why is None:
            out.append(m)
        elif explicit:
            skipped.append((m, why))
    return out, skipped


def _why_not(d, mode: str) -> str:
    """Why ``mode`` does not fit dtype ``d`` (for a mode that no requested format takes)."""
    if isinstance(d, BlockDType) and mode not in BLOCK_MODES:
        return f"{d.name} is a block format (op quantize), its modes are {', '.join(BLOCK_MODES)}"
    if not isinstance(d, BlockDType) and mode not in ELEMENT_MODES:
        return (f"{d.name} is an element format (op cast), its modes are <rounding>[_saturate|_nosaturate] "
                f"with rounding one of {', '.join(_ROUNDINGS)}")
    return _mode_problem(d, mode) or "it is not among its modes"


def _check_all_modes_used(wanted: Optional[list], dtypes: list, plan: list) -> None:
    """A requested mode that no format takes is an error, not a silent no-op."""
    if wanted is None or "all" in wanted:
        return
    used = {m for _, m in plan}
    for m in wanted:
        if m not in used:
            names = ", ".join(d.name for d in dtypes)
            why = "; ".join(_why_not(d, m) for d in dtypes)
            raise ValueError(f"mode {m!r} does not fit format(s) {names}: {why}")


class DirectoryNotEmptyError(ValueError):
    """``export`` refuses to replace a non-empty ``directory`` without ``overwrite=True``."""

    def __init__(self, directory: Path, hint: str = "pass overwrite=True to replace it") -> None:
        self.directory = directory
        super().__init__(f"directory {str(directory)!r} exists and is not empty; {hint}")


def normalize_formats(formats) -> list:
    """``export``'s ``formats`` (a comma-separated string, a dtype, or a sequence of them) as a list of checked
    dtypes, without repeats; ValueError / TypeError name what is wrong."""
    if isinstance(formats, (str, IntDType, FloatDType, BlockDType)):
        formats = formats.split(",") if isinstance(formats, str) else [formats]
    try:
        items = list(formats)
    except TypeError:
        raise TypeError(f"formats must be a list of format names, got {formats!r}") from None
    out = []
    for f in items:
        if isinstance(f, str) and not f.strip():
            continue
        if isinstance(f, str):
            try:
                d = get_dtype(f)
            except ValueError:
                raise ValueError(f"formats: unknown format {f!r}; known: {', '.join(sorted(DTYPES))}") from None
        else:
            d = get_dtype(f)
        if not isinstance(d, BlockDType) and d.bits > 16:
            raise ValueError(f"formats: {d.name} is the input format itself; conformance vectors cover formats of "
                             f"16 bits or fewer")
        if d not in out:
            out.append(d)
    if not out:
        raise ValueError(f"formats is empty; pick from: {', '.join(sorted(DTYPES))}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# computing a case
# ---------------------------------------------------------------------------------------------------------------


def _packing_of(el) -> dict:
    """How codes of element dtype ``el`` become bytes along the last axis: ``qcore.packing.default_layout``."""
    lay = packing.default_layout(el)
    return dict(layout=lay.name, function=lay.function, bits=lay.bits, field_bits=lay.field_bits,
                group_elements=lay.group_elements, group_bytes=lay.group_bytes)


def _pack(codes: np.ndarray, el) -> np.ndarray:
    return packing.pack(codes, el)


def _overflow_words(d: FloatDType, sat: bool) -> str:
    if sat:
        return "overflow and ±Inf saturate to ±max"
    if d.specials is Specials.IEEE:
        return "overflow gives ±Inf"
    return "overflow and ±Inf give NaN"


def _cast_semantics(d, rounding: RoundingMode, saturate) -> str:
    if isinstance(d, IntDType):
        return (f"round float32 to an integer ({rounding.name}), clamp to [{d.min}, {d.max}]; codes are the "
                f"integer values; see {DOCS} ('cast')")
    sat = d.default_saturate if saturate is None else saturate
    extra = []
    if d.specials is Specials.FNUZ:
        extra.append("no -0 (gives +0)")
    if not d.has_zero:
        extra.append("0 gives NaN, underflow the smallest value")
    if not d.signed:
        extra.append("negative inputs give " + ("NaN" if d.has_nan else "0"))
    extra.append("NaN stays NaN" if d.has_nan else "NaN inputs dropped (no NaN code)")
    return (f"cast float32 to {d.name} with {rounding.name} on the exact value, subnormals kept; "
            f"{_overflow_words(d, sat)}; {'; '.join(extra)}; see {DOCS} ('cast')")


def _two_level_semantics(d: BlockDType, spec, g) -> str:
    el, sd = d.element, d.scale
    return (f"{d.name}: {el.name} elements in blocks of {d.block_size} along the last axis, block scales b in "
            f"{sd.name} under the float32 tensor scale g = {float(g)!r} (input_tensor_scale): "
            f"b = {sd.name}(RNE(clamp(fl(fl(amax / {el.max_finite:g}) / g), {sd.min_normal:g}, {sd.max_finite:g}))); "
            f"codes = {el.name}(RNE(x * min(fl(fl(1 / g) / b), FLT_MAX))), saturating; dequantized = value * "
            f"fl(g * b); a NaN/Inf block has a NaN scale, codes 0 and NaN values; an all-zero block has "
            f"b = {sd.min_normal:g}; see {DOCS} ('Two-level scales')")


def _quantize_semantics(d: BlockDType, spec) -> str:
    el = d.element
    scale = f"E8M0 scale 2**s per block of {d.block_size} along the last axis, {_SCALE_RULE[spec.scale_mode]}"
    if d.subblock_shift_bits:
        elem = (f"each pair of elements shifts s down by d = 1 iff both |x| < 2**s; codes = {el.name}(RNE(x / "
                f"2**(s - d))) (sign-magnitude), saturating at ±{el.max_finite:g}; shifts are d per pair")
    elif isinstance(el, IntDType):
        rng = f"[-{el.max}, {el.max}]" if spec.narrow_range else f"[{el.min}, {el.max}]"
        elem = f"codes = clamp(RNE(x / 2**s * 2**{-spec.unit_exponent}), {rng})"
        if spec.bump_on_overflow:
            elem += ", s bumped once if an element would round out of range"
    else:
        elem = f"codes = {el.name}(RNE(x / 2**s)), saturating"
    if d.subblock_shift_bits:
        deq = "value * 2**(s - d)"
    elif isinstance(el, IntDType):
        deq = f"code * 2**{spec.unit_exponent} * scale"
    else:
        deq = "value * scale"
    return (f"{d.name}: {scale}; {elem}; dequantized = {deq}; a NaN/Inf block has a NaN scale (0xFF), "
            f"codes 0 and NaN values; all-zero block: s = -127; see {DOCS} ('Scales', 'Quantize')")


def _probes(fmt, key: int) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(testing.probes(fmt, key=key), dtype=np.float32))


def _cast_case(d, mode: str, key: int):
    rounding, saturate = _parse_element_mode(mode)
    x = _probes(d, key).reshape(-1)
    with np.errstate(invalid="ignore"):  # integer formats: NaN inputs (dropped below) warn in rint
        values = cast(x, d, rounding=rounding, saturate=saturate)
    dropped = 0
    if not (isinstance(d, FloatDType) and d.has_nan):
        keep = ~np.isnan(values)
        dropped = int(x.size - np.count_nonzero(keep))
        x, values = np.ascontiguousarray(x[keep]), np.ascontiguousarray(values[keep])
    codes = encode(values, d, rounding=rounding, saturate=saturate)
    info = _packing_of(d)
    arrays = {
        "input": x,
        "expected_cast": values.astype(np.float32),
        "expected_codes": codes,
        "expected_packed": _pack(codes, d),
    }
    meta = dict(
        op="cast", element_format=d.name, options=dict(rounding=rounding.name, saturate=saturate),
        semantics=_cast_semantics(d, rounding, saturate), blocked_axis=None, block_size=None,
        subblock_size=None, packing=info, dropped_nan_inputs=dropped,
    )
    return arrays, meta


def _quantize_case(d: BlockDType, mode: str, key: int):
    kw = {}
    if _two_level(d):
        given = mode == "tensor_scale_given"
        spec = make_spec(d, tensor_scale_mode=TensorScale.GIVEN if given else TensorScale.ONE)
        if given:
            kw = dict(tensor_scale=CONFORMANCE_TENSOR_SCALE)
        scale_mode = spec.scale_mode
    else:
        scale_mode = _parse_block_mode(mode)
        spec = make_spec(d, scale_mode=scale_mode)
    x = _probes(d, key)
    if x.ndim < 2:
        x = x.reshape(1, -1)
    q = quantize(x, spec, **kw)
    deq = np.asarray(dequantize(q), dtype=np.float32)
    fq = np.asarray(fake_quantize(x, spec, **kw), dtype=np.float32)
    if not np.array_equal(deq.view(np.uint32), fq.view(np.uint32)):  # an invariant of qcore; never ship a lie
        raise RuntimeError(f"{d.name}/{mode}: dequantize(quantize(x)) != fake_quantize(x); qcore is inconsistent")
    codes = np.asarray(q.codes)
    scales = np.asarray(q.scales, dtype=np.float32)
    info = _packing_of(d.element)
    arrays = {
        "input": x,
        "expected_codes": codes,
        "expected_packed": _pack(codes, d.element),
        "expected_scales": scales,
        "expected_scale_codes": encode(scales, d.scale),
    }
    options = dict(scale_mode=scale_mode.name, rounding=spec.rounding.name, scale_dtype=d.scale.name,
                   unit_exponent=spec.unit_exponent, narrow_range=spec.narrow_range,
                   subblock_shift_bits=spec.subblock_shift_bits, bump_on_overflow=spec.bump_on_overflow)
    if spec.two_level:
        g = np.asarray(q.tensor_scale, dtype=np.float32).reshape(1)
        arrays["input_tensor_scale"] = g
        options.update(tensor_scale_mode=spec.tensor_scale_mode.name, tensor_scale=float(g[0]))
        semantics = _two_level_semantics(d, spec, g[0])
    else:
        semantics = _quantize_semantics(d, spec)
    if q.subblock_shifts is not None:
        arrays["expected_shifts"] = np.asarray(q.subblock_shifts, dtype=np.int32)
    arrays["expected_dequantized"] = deq
    meta = dict(
        op="quantize", element_format=d.element.name, options=options,
        semantics=semantics, blocked_axis=-1, block_size=d.block_size,
        subblock_size=d.subblock_size if d.subblock_shift_bits else None, packing=info, dropped_nan_inputs=0,
    )
    return arrays, meta


def _input_span(role: str, meta: dict) -> dict:
    """How many input elements along the last axis one index of this role's last axis covers (units -> elems)."""
    if role == "expected_packed":
        p = meta["packing"]
        return dict(elements=p["group_elements"], units=p["group_bytes"])
    if role in ("expected_scales", "expected_scale_codes"):
        return dict(elements=meta["block_size"], units=1)
    if role == "expected_shifts":
        return dict(elements=meta["subblock_size"], units=1)
    return dict(elements=1, units=1)


# ---------------------------------------------------------------------------------------------------------------
# the manifest
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """What ``export`` wrote (also ``load_manifest(directory)``): ``data`` is the parsed manifest.json."""

    directory: Path
    data: dict[str, Any]

    @property
    def formats(self) -> list[str]:
        return list(self.data["formats"])

    @property
    def cases(self) -> list[dict[str, Any]]:
        return list(self.data["cases"])

    @property
    def case_names(self) -> list[str]:
        return [c["name"] for c in self.data["cases"]]

    def case(self, name: str) -> dict[str, Any]:
        for c in self.data["cases"]:
            if c["name"] == name:
                return c
        raise KeyError(f"no case {name!r}; cases: {', '.join(self.case_names)}")

    def path(self, case: str, role: str, kind: str = "npy") -> Path:
        """Path of a case's file (``kind`` "npy" or "bin")."""
        for f in self.case(case)["files"]:
            if f["role"] == role:
                return self.directory / f[kind]
        raise KeyError(f"case {case!r} has no file {role!r}")

    def load(self, case: str, role: str) -> np.ndarray:
        return np.load(self.path(case, role), allow_pickle=False)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _le(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"), copy=False))


def _shape_str(shape) -> str:
    return "x".join(str(int(n)) for n in shape) if len(shape) else "scalar"


def _write_case(root: Path, name: str, arrays: dict, meta: dict, safetensors_ok: bool) -> dict:
    folder = root / name
    folder.mkdir()
    files = []
    for role in _ROLE_ORDER:
        if role not in arrays:
            continue
        a = _le(np.asarray(arrays[role]))
        npy, bin_ = folder / f"{role}.npy", folder / f"{role}.bin"
        np.save(npy, a, allow_pickle=False)
        bin_.write_bytes(a.tobytes(order="C"))
        files.append(dict(
            role=role, npy=f"{name}/{role}.npy", bin=f"{name}/{role}.bin", dtype=a.dtype.name,
            shape=list(a.shape), nbytes=int(a.nbytes), input_span=_input_span(role, meta),
            sha256=dict(npy=_sha256(npy), bin=_sha256(bin_)),
        ))
    case = dict(name=name, **meta)
    case["input_shape"] = list(np.shape(arrays["input"]))
    case["files"] = files
    if safetensors_ok:
        from safetensors.numpy import save_file

        st = folder / "vectors.safetensors"
        save_file({r: _le(np.asarray(a)) for r, a in arrays.items()}, str(st),
                  metadata={"format": meta["format"], "op": meta["op"], "mode": meta["mode"], "schema": SCHEMA})
        case["safetensors"] = dict(file=f"{name}/vectors.safetensors", sha256=_sha256(st))
    return case


_TSV_COLUMNS = ("case", "role", "dtype", "shape", "file", "format", "op", "mode", "block_size")


def _tsv(cases: list, version: str) -> str:
    lines = [
        f"# qcore {version} conformance vectors ({SCHEMA}); tab-separated, one line per array; 'file' is the raw "
        f"little-endian C-order .bin (the .npy of the same stem holds the same array); shape 'AxB', block_size 0 "
        f"for element formats",
        "# " + "\t".join(_TSV_COLUMNS),
    ]
    for c in cases:
        for f in c["files"]:
            lines.append("\t".join([
                c["name"], f["role"], f["dtype"], _shape_str(f["shape"]), f["bin"], c["format"], c["op"],
                c["mode"], str(c["block_size"] or 0),
            ]))
    return "\n".join(lines) + "\n"


def _check_target(directory: Path, overwrite: bool):
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"directory {str(directory)!r} exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not overwrite:
        raise DirectoryNotEmptyError(directory)
    if not directory.parent.is_dir():
        raise ValueError(f"the parent of {str(directory)!r} does not exist")


def export(directory: Union[str, os.PathLike], formats: Union[FormatLike, Sequence[FormatLike]], *,
           modes: Union[str, Sequence[str], None] = None, key: int = 0, overwrite: bool = False) -> Manifest:
    """Write conformance vectors for ``formats`` (names; a comma-separated str works) into ``directory``.

    ``modes``: None (each format's defaults), a list of mode names or ``["all"]`` (see the module docstring; a
    mode that fits none of the formats raises ``ValueError``). ``key``: seed of the random part of the probes.
    ``directory`` must not exist or be empty unless ``overwrite=True`` (else ``DirectoryNotEmptyError``, a
    ``ValueError``); everything is written to a temporary sibling first and renamed into place, so a failure
    leaves nothing half-written (and an existing directory untouched). Returns the ``Manifest``.
    """
    directory = Path(os.fspath(directory)).absolute()
    if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or key < 0:
        raise ValueError(f"key must be a non-negative int, got {key!r}")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {overwrite!r}")
    dtypes = normalize_formats(formats)
    wanted = normalize_modes(modes)
    plan, skipped = [], []
    for d in dtypes:
        ms, sk = _modes_for(d, wanted)
        skipped += [dict(format=d.name, mode=m, reason=why) for m, why in sk]
        if not ms:
            raise ValueError(f"no mode applies to {d.name}: " + "; ".join(f"{m}: {why}" for m, why in sk))
        plan += [(d, m) for m in ms]
    _check_all_modes_used(wanted, dtypes, plan)
    _check_target(directory, overwrite)

    safetensors_ok = importlib.util.find_spec("safetensors") is not None
    check_not_source(directory, (), what="directory")  # not the current directory (nor one that contains it)
    with staged_dir(directory, recheck=lambda: _check_target(directory, overwrite)) as tmp:
        cases = []
        for d, m in plan:
            op = "quantize" if isinstance(d, BlockDType) else "cast"
            arrays, meta = (_quantize_case if op == "quantize" else _cast_case)(d, m, int(key))
            meta = dict(format=d.name, mode=m, **meta)
            cases.append(_write_case(tmp, f"{d.name}.{op}.{m}", arrays, meta, safetensors_ok))
        data = dict(
            schema=SCHEMA, qcore_version=__version__, numpy_version=np.__version__, key=int(key),
            byte_order="little", docs=DOCS, formats=[d.name for d in dtypes], modes=wanted, skipped=skipped,
            tsv="manifest.tsv", cases=cases,
        )
        (tmp / "manifest.json").write_text(json.dumps(data, indent=1) + "\n")
        (tmp / "manifest.tsv").write_text(_tsv(cases, __version__))
    return Manifest(directory, data)


def load_manifest(directory: Union[str, os.PathLike]) -> Manifest:
    """Read ``directory/manifest.json`` (as written by ``export``)."""
    directory = Path(os.fspath(directory)).absolute()
    path = directory / "manifest.json"
    if not path.is_file():
        raise ValueError(f"{str(directory)!r} is not a conformance vectors directory (no manifest.json)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{str(path)!r}: the JSON nests too deeply to be a manifest") from None
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r}: expected a JSON object, got {type(data).__name__}")
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{str(path)!r} has schema {data.get('schema')!r}; this qcore reads {SCHEMA!r}")
    _check_manifest(data, str(path))
    return Manifest(directory, data)


def _check_manifest(data: dict, where: str) -> None:
    """The fields ``check`` reads, of the types ``export`` writes: a ValueError naming the first one that is not
    (a file name must stay inside the vectors directory)."""
    def bad(field: str, got: Any, want: str) -> ValueError:
        return ValueError(f"{where!r}: {field} must be {want}, got {got!r}"[:400])

    def inside(name: Any) -> bool:
        return isinstance(name, str) and bool(name) and not os.path.isabs(name) and \
            ".." not in Path(name).parts and "\\" not in name

    if not isinstance(data.get("formats"), list) or not all(isinstance(f, str) for f in data["formats"]):
        raise bad("formats", data.get("formats"), "a list of format names")
    cases = data.get("cases")
    if not isinstance(cases, list):
        raise bad("cases", cases, "a list of objects")
    for i, c in enumerate(cases):
        if not isinstance(c, dict):
            raise bad(f"cases[{i}]", c, "an object")
        for k in ("format", "op", "mode"):
            if not isinstance(c.get(k), str):
                raise bad(f"cases[{i}].{k}", c.get(k), "a string")
        if not inside(c.get("name")) or "/" in c["name"]:
            raise bad(f"cases[{i}].name", c.get("name"), "a directory name inside the vectors directory")
        files = c.get("files")
        if not isinstance(files, list) or not files or not all(isinstance(f, dict) for f in files):
            raise bad(f"cases[{i}].files", files, "a non-empty list of objects")
        for j, f in enumerate(files):
            if not isinstance(f.get("role"), str):
                raise bad(f"cases[{i}].files[{j}].role", f.get("role"), "a string")
            for k in ("npy", "bin"):
                if not inside(f.get(k)):
                    raise bad(f"cases[{i}].files[{j}].{k}", f.get(k), "a file name inside the vectors directory")
            if not isinstance(f.get("sha256"), dict):
                raise bad(f"cases[{i}].files[{j}].sha256", f.get("sha256"), "an object")


# ---------------------------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class FileResult:
    """One expected file of a case: ``status`` is "ok", "mismatch", "missing" or "error" (unreadable output,
    wrong dtype or size, or a vectors file whose sha256 changed since export)."""

    role: str
    status: str
    n_mismatch: int = 0
    n_total: int = 0
    path: Optional[str] = None
    message: str = ""
    examples: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class CaseResult:
    """``status``: "ok" (every file bit-exact), "mismatch" (a file differs or is unusable), "missing" (no output
    file at all) or "incomplete" (some files missing, the others ok)."""

    name: str
    format: str
    op: str
    mode: str
    files: list[FileResult]

    @property
    def status(self) -> str:
        st = {f.status for f in self.files}
        if st <= {"ok"}:
            return "ok"
        if st & {"mismatch", "error"}:
            return "mismatch"
        if st == {"missing"}:
            return "missing"
        return "incomplete"

    def to_dict(self) -> dict[str, Any]:
        return dict(name=self.name, format=self.format, op=self.op, mode=self.mode, status=self.status,
                    files=[f.to_dict() for f in self.files])


@dataclass
class CheckReport:
    """Result of ``check``: per case results; ``ok`` is True when every case is ok (missing files allowed with
    ``allow_missing``). ``format()`` is the text report, ``to_dict()`` a JSON-able one."""

    vectors: str
    outputs: str
    ulps: int
    qcore_version: str
    cases: list[CaseResult]
    allow_missing: bool = False

    def count(self, status: str) -> int:
        return sum(c.status == status for c in self.cases)

    @property
    def ok(self) -> bool:
        good = {"ok", "missing", "incomplete"} if self.allow_missing else {"ok"}
        return all(c.status in good for c in self.cases)

    def to_dict(self) -> dict[str, Any]:
        return dict(vectors=self.vectors, outputs=self.outputs, ulps=self.ulps, qcore_version=self.qcore_version,
                    ok=self.ok, counts={s: self.count(s) for s in ("ok", "mismatch", "missing", "incomplete")},
                    cases=[c.to_dict() for c in self.cases])

    def format(self, *, max_examples: int = 5) -> str:
        width = max([len(c.name) for c in self.cases] + [10])
        lines = [f"qcore conformance check: {len(self.cases)} case(s) of {self.vectors} (qcore {self.qcore_version}) "
                 f"against {self.outputs}, ulps={self.ulps}"]
        for c in self.cases:
            st = c.status
            label = {"ok": "ok", "mismatch": "MISMATCH", "missing": "missing", "incomplete": "incomplete"}[st]
            if st == "ok":
                n = sum(f.n_total for f in c.files)
                lines.append(f"  {label:<10} {c.name:<{width}}  {len(c.files)} file(s), {n} value(s) bit-exact")
                continue
            if st == "missing":
                lines.append(f"  {label:<10} {c.name:<{width}}  no output files ({', '.join(f.role for f in c.files)})")
                continue
            lines.append(f"  {label:<10} {c.name}")
            for f in c.files:
                if f.status == "ok":
                    lines.append(f"      ok        {f.role}: {f.n_total} value(s)")
                elif f.status == "missing":
                    lines.append(f"      missing   {f.role}")
                elif f.status == "error":
                    lines.append(f"      ERROR     {f.role}: {f.message}")
                else:
                    lines.append(f"      MISMATCH  {f.role}: {f.n_mismatch} of {f.n_total} differ ({f.path})")
                    if f.message:
                        lines += ["        " + ln for ln in f.message.splitlines()]
                    for e in f.examples[:max_examples]:
                        lines.append("        " + _example_line(e))
                    if f.n_mismatch > min(len(f.examples), max_examples):
                        lines.append(f"        ... {f.n_mismatch - min(len(f.examples), max_examples)} more")
        counts = ", ".join(f"{self.count(s)} {s}" for s in ("ok", "mismatch", "missing", "incomplete")
                           if self.count(s))
        verdict = "PASS" if self.ok else "FAIL"
        lines.append(f"summary: {counts or 'no cases'} -> {verdict}")
        return "\n".join(lines)


def _example_line(e: dict) -> str:
    idx = "[" + ", ".join(map(str, e["index"])) + "]"
    exp = f"{e['expected_bits']}" + (f" ({e['expected_value']})" if "expected_value" in e else "")
    act = f"{e['actual_bits']}" + (f" ({e['actual_value']})" if "actual_value" in e else "")
    return f"{idx} input {e['input']}: expected {exp}, actual {act}"


def _bits_view(a: np.ndarray) -> np.ndarray:
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _hex(v, itemsize: int) -> str:
    return f"0x{int(v):0{2 * itemsize}x}"


def _fmt_float(v) -> str:
    return str(np.float32(v))  # the shortest repr that round-trips float32


def _mismatch_positions(report, shape: tuple) -> list:
    """Multi-indices of the mismatches the compare report kept (its first ``max_report``)."""
    out = []
    for m in getattr(report, "mismatches", None) or []:
        mi = getattr(m, "multi_index", None)
        if mi is None:
            mi = np.unravel_index(int(getattr(m, "index")), shape)
        out.append(tuple(int(i) for i in mi))
    return out


def _input_context(x: np.ndarray, idx: tuple, span: dict, out_ndim: int) -> str:
    if x.ndim != out_ndim:
        return "?"
    e, u = span["elements"], span["units"]
    if e == 1 and u == 1:
        v = x[idx]
        return f"{_fmt_float(v)} ({_hex(_bits_view(np.asarray(v, np.float32).reshape(1))[0], 4)})"
    k = idx[-1]
    lo, hi = (k // u) * e, min((k // u + 1) * e, x.shape[-1])
    seg = x[idx[:-1] + (slice(lo, hi),)]
    where = "x[" + ", ".join(map(str, idx[:-1])) + (", " if idx[:-1] else "") + f"{lo}:{hi}]"
    if seg.size <= 4:
        return where + " = [" + ", ".join(_fmt_float(v) for v in seg) + "]"
    with np.errstate(invalid="ignore"):
        amax = np.max(np.abs(seg)) if seg.size else np.float32(0)
    return f"{where} (amax {_fmt_float(amax)})"


def _value_of(role: str, case: dict, v) -> Optional[str]:
    try:
        if role == "expected_codes":
            return _fmt_float(decode(np.asarray([v]), case["element_format"])[0])
        if role == "expected_scale_codes":
            return _fmt_float(decode(np.asarray([v], np.uint8), "float8_e8m0fnu")[0])
    except (ValueError, TypeError):
        return "invalid code"
    return None


def _examples(actual, expected, x, positions, role, case, span, limit) -> list:
    out = []
    for p in positions[:limit]:
        idx = tuple(int(i) for i in p)
        a, e = actual[idx], expected[idx]
        item: dict[str, Any] = dict(index=list(idx), input=_input_context(x, idx, span, expected.ndim))
        n = expected.dtype.itemsize
        item["expected_bits"] = _hex(_bits_view(np.asarray([e], expected.dtype))[0], n)
        item["actual_bits"] = _hex(_bits_view(np.asarray([a], expected.dtype))[0], n)
        if expected.dtype.kind == "f":
            item["expected_value"], item["actual_value"] = _fmt_float(e), _fmt_float(a)
        else:
            ev, av = _value_of(role, case, e), _value_of(role, case, a)
            if ev is not None:
                item["expected_value"], item["actual_value"] = ev, av
        out.append(item)
    return out


def _find_output(outputs: Path, case: str, role: str) -> Optional[Path]:
    short = role[len("expected_"):] if role.startswith("expected_") else role
    for stem in (role, short):
        for ext in (".npy", ".bin"):
            p = outputs / case / (stem + ext)
            if p.is_file():
                return p
    return None


def _load_output(path: Path, dtype: np.dtype, shape: tuple):
    """(array, None) or (None, error message)."""
    n = int(np.prod(shape, dtype=np.int64))
    if path.suffix == ".bin":
        size = path.stat().st_size
        if size != n * dtype.itemsize:
            return None, (f"{path.name} has {size} bytes; expected {n * dtype.itemsize} ({dtype.name}, shape "
                          f"{_shape_str(shape)}, little-endian)")
        return np.fromfile(path, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape), None
    try:
        a = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as err:
        return None, f"{path.name} is not a readable .npy file: {err}"
    if a.dtype.newbyteorder("=") != dtype.newbyteorder("=") or a.dtype.kind != dtype.kind:
        return None, f"{path.name} has dtype {a.dtype}; expected {dtype.name}"
    if a.size != n:
        return None, f"{path.name} has shape {_shape_str(a.shape)}; expected {_shape_str(shape)}"
    return np.ascontiguousarray(a.astype(dtype)).reshape(shape), None


def check(vectors_dir: Union[str, os.PathLike], outputs_dir: Union[str, os.PathLike], *, ulps: int = 0,
          formats: Union[FormatLike, Sequence[FormatLike], None] = None,
          cases: Union[str, Sequence[str], None] = None, allow_missing: bool = False, nan_equal: bool = True,
          max_examples: int = 5) -> CheckReport:
    """Compare a kernel's outputs in ``outputs_dir`` with the vectors ``export`` wrote to ``vectors_dir``.

    For every expected file ``<case>/<role>.npy`` of the manifest, the output is ``outputs_dir/<case>/<role>``
    (or ``<case>/<role without "expected_">``) with suffix ``.npy`` (dtype must match; any shape of the same
    size) or ``.bin`` (raw little-endian of the manifest's dtype, exactly its size). Values are compared with
    ``qcore.testing.compare``: bit for bit, -0 != +0, any NaN matching any NaN unless ``nan_equal=False`` (then
    NaN sign and payload must match too); ``ulps`` loosens float files only. ``formats`` / ``cases`` limit the
    check to some cases; ``allow_missing`` makes missing files not a failure; ``max_examples`` mismatches are
    shown per file. Expected files whose sha256 no longer matches the manifest are reported as errors (the
    vectors were modified after export).
    """
    if isinstance(ulps, bool) or not isinstance(ulps, (int, np.integer)) or ulps < 0:
        raise ValueError(f"ulps must be a non-negative int, got {ulps!r}")
    if not isinstance(nan_equal, bool):
        raise TypeError(f"nan_equal must be a bool, got {nan_equal!r}")
    if isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 0:
        raise ValueError(f"max_examples must be a non-negative int, got {max_examples!r}")
    manifest = load_manifest(vectors_dir)
    outputs = Path(os.fspath(outputs_dir)).absolute()
    if not outputs.is_dir():
        raise ValueError(f"outputs directory {str(outputs)!r} " + ("is a file, not a directory" if outputs.exists()
                                                                   else "does not exist"))
    selected = manifest.cases
    if formats is not None:
        names = [d.name for d in normalize_formats(formats)]
        present = sorted({c["format"] for c in selected})
        absent = [n for n in names if n not in present]
        if absent:
            raise ValueError(f"formats: {', '.join(absent)} not in these vectors; they have: {', '.join(present)}")
        selected = [c for c in selected if c["format"] in names]
    if cases is not None:
        wanted = [cases] if isinstance(cases, str) else list(cases)
        wanted = [w for s in wanted for w in s.split(",") if w]
        absent = [w for w in wanted if w not in manifest.case_names]
        if absent:
            raise ValueError(f"cases: {', '.join(absent)} not in these vectors; they have: "
                             f"{', '.join(manifest.case_names)}")
        selected = [c for c in selected if c["name"] in wanted]

    results = []
    for case in selected:
        x = np.load(manifest.directory / case["files"][0]["npy"], allow_pickle=False)
        files = []
        for f in case["files"]:
            role = f["role"]
            if role.startswith("input"):
                continue
            exp_path = manifest.directory / f["npy"]
            if not exp_path.is_file() or _sha256(exp_path) != f["sha256"]["npy"]:
                files.append(FileResult(role, "error", message=f"vectors file {f['npy']} is missing or changed "
                                                                f"since export (sha256 mismatch)"))
                continue
            expected = np.load(exp_path, allow_pickle=False)
            out = _find_output(outputs, case["name"], role)
            if out is None:
                files.append(FileResult(role, "missing", n_total=int(expected.size)))
                continue
            actual, err = _load_output(out, expected.dtype, expected.shape)
            rel = str(out.relative_to(outputs))
            if err is not None:
                files.append(FileResult(role, "error", n_total=int(expected.size), path=rel, message=err))
                continue
            rep = testing.compare(actual, expected, ulps=int(ulps) if expected.dtype.kind == "f" else 0,
                                  nan_equal=nan_equal, max_report=max_examples)
            if rep.ok:
                files.append(FileResult(role, "ok", 0, int(rep.n_total), rel))
                continue
            pos = _mismatch_positions(rep, expected.shape)
            ex = _examples(actual, expected, x, pos, role, case, f["input_span"], max_examples)
            msg = "" if pos or not max_examples else rep.format()
            files.append(FileResult(role, "mismatch", int(rep.n_mismatch), int(rep.n_total), rel, msg, ex))
        results.append(CaseResult(case["name"], case["format"], case["op"], case["mode"], files))
    return CheckReport(str(manifest.directory), str(outputs), int(ulps), manifest.data.get("qcore_version", "?"),
                       results, allow_missing)

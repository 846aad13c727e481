"""Compare a kernel's output with the oracle's, bit for bit (or within ``ulps``), and say where they differ.

``compare(actual, expected)`` returns a ``Report`` (a frozen dataclass: ``ok``, ``n_mismatch``, ``n_total``,
the first ``max_report`` ``Mismatch`` records, counts by probe kind and by component, and ``format()``);
``assert_equal(actual, expected)`` raises ``AssertionError`` with ``report.format()`` as the message.

Rules:

- Inputs are numpy arrays, torch tensors on any device (moved with ``.detach().cpu()``; torch is never
  imported here), or Python numbers/lists. float16/bfloat16 (torch or ml_dtypes) are widened to float32
  exactly; float64 must hold float32 values exactly (else the report says so and fails).
- Float arrays are compared as float32 bit patterns. With ``ulps=0`` every bit must match. With ``ulps=n`` two
  finite values match when the distance of their bit patterns on the ordered-integer line (``+x`` ->
  ``bits``, ``-x`` -> ``-(bits & 0x7fffffff)``, so ``±0`` are both 0 and neighbouring floats are 1 apart, across
  zero too) is at most ``n``. Inf matches only the same Inf, whatever ``ulps``.
- NaN: ``nan_equal=True`` (default) lets any NaN match any NaN (sign and payload ignored; kernels
  canonicalise NaNs); ``nan_equal=False`` compares NaN bit patterns like any other value. A NaN never matches a
  number.
- Zeros: ``signed_zero=True`` (default) makes ``-0`` and ``+0`` differ (also with ``ulps > 0``);
  ``signed_zero=False`` lets them match.
- Integer (and bool) arrays are compared exactly as integers (``ulps`` does not apply), whatever their widths.
- Different shapes, or a float array against an integer one, fail with ``Report.problem`` set.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from .._backend import is_torch
from .._typing import ArrayLike

__all__ = ["BlockInfo", "Mismatch", "Report", "compare", "assert_equal", "to_numpy", "float_bits",
           "ulp_distance", "kind_labels", "KindLabels"]

Number = Union[int, float]


Kinds = Union[Mapping[str, Any], Sequence[str]]
"""Probe kinds of an input: the dict ``probes_by_kind`` returned, or one label per row along axis 0."""


# ---------------------------------------------------------------------------------------------------------------
# conversion
# ---------------------------------------------------------------------------------------------------------------


def to_numpy(a: Any, *, name: str = "array") -> np.ndarray:
    """A numpy copy (or view) of ``a`` on the host: torch tensors via ``.detach().cpu()`` (float16/bfloat16
    widened to float32, exactly), ml_dtypes arrays widened to float32, Python values via ``np.asarray``."""
    if is_torch(a):
        t = a.detach()
        if t.is_complex():
            raise TypeError(f"{name}: complex tensors are not supported (dtype {t.dtype})")
        if t.is_floating_point() and t.element_size() < 4:
            t = t.float()
        t = t.cpu()
        try:
            return t.numpy()
        except TypeError:  # dtypes numpy lacks (uint16/32/64 on old numpy, float8 ...)
            return (t.float() if t.is_floating_point() else t.long()).numpy()
    arr = np.asarray(a)
    if arr.dtype.kind not in "fiub":
        try:
            arr = arr.astype(np.float32)  # ml_dtypes bfloat16 / float8 arrays
        except (TypeError, ValueError):
            raise TypeError(f"{name}: cannot compare arrays of dtype {arr.dtype}") from None
    return arr


def float_bits(v: ArrayLike) -> np.ndarray:
    """float32 bit patterns of ``v`` as uint32 (same shape)."""
    a = np.asarray(v, dtype=np.float32)
    return np.ascontiguousarray(a).view(np.uint32).reshape(a.shape)


def _ordered(bits_u32: np.ndarray) -> np.ndarray:
    b = bits_u32.astype(np.int64)
    mag = b & 0x7FFFFFFF
    return np.where(b & 0x80000000, -mag, mag)


def ulp_distance(a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """Elementwise distance of float32 ``a`` and ``b`` in float32 ulps (ordered-integer distance of the bits;
    ``±0`` are 0 apart). Meaningless where either is NaN."""
    return np.abs(_ordered(float_bits(a)) - _ordered(float_bits(b)))


# ---------------------------------------------------------------------------------------------------------------
# records
# ---------------------------------------------------------------------------------------------------------------


def _fmt_value(v, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "f":
        return str(np.float32(v))
    return str(int(v))


def _fmt_bits(bits: Optional[int], width: int) -> str:
    if bits is None:
        return "-"
    return f"0x{int(bits):0{width}x}"


def _pow2_text(v: float) -> str:
    if v > 0 and np.isfinite(v):
        m, e = np.frexp(np.float64(v))
        if m == 0.5:
            return f" = 2**{int(e) - 1}"
    return ""


@dataclass(frozen=True)
class BlockInfo:
    """The oracle's block (scale group) that holds a mismatching element.

    ``index``: the block's index in the scale array; ``scale``: its float32 value and ``scale_bits`` its bits;
    ``scale_code``: the scale's code in ``scale_dtype`` (the E8M0 byte for MX formats; None for float32 scales);
    ``amax``: the block's absolute maximum of the input (None when the input is not known);
    ``zero_point`` (asymmetric specs) and ``subblock_shift`` (MX9/MX6/MX4: the element's pair's shift).
    """

    index: tuple
    scale: float
    scale_bits: int
    scale_dtype: str
    scale_code: Optional[int] = None
    amax: Optional[float] = None
    amax_bits: Optional[int] = None
    zero_point: Optional[float] = None
    subblock_shift: Optional[int] = None

    def format(self) -> str:
        parts = [f"block {self.index}:"]
        if self.amax is not None:
            parts.append(f"amax {_fmt_value(self.amax, 'f')} ({_fmt_bits(self.amax_bits, 8)}),")
        code = ""
        if self.scale_code is not None:
            label = "E8M0 byte" if self.scale_dtype == "float8_e8m0fnu" else f"{self.scale_dtype} code"
            code = f"; {label} 0x{self.scale_code:02x}"
        parts.append(f"scale {_fmt_value(self.scale, 'f')}{_pow2_text(self.scale)} "
                     f"({_fmt_bits(self.scale_bits, 8)}{code})")
        if self.zero_point is not None:
            parts[-1] += ","
            parts.append(f"zero point {_fmt_value(self.zero_point, 'f')}")
        if self.subblock_shift is not None:
            parts[-1] += ","
            parts.append(f"sub-block shift {self.subblock_shift}")
        return " ".join(parts)


@dataclass(frozen=True)
class Mismatch:
    """One element where actual and expected differ.

    ``index``: flat (C-order) index; ``multi_index``: the same as a tuple; ``expected``/``actual`` their values
    (float, or int for integer arrays) and ``*_bits`` their bit patterns (float32 bits, or the integer's two's
    complement bits at the array's width); ``ulp``: float32 ulp distance (None for integers, NaN or Inf);
    ``input``/``input_bits``: the input element that produced them (when known); ``kind``: the probe kind of the
    input row; ``component``: which output it is in (``"codes"``, ``"scales"``, ...); ``block``: the oracle's
    block of the element (block formats and scaled specs); ``note``: anything else worth saying.
    """

    index: int
    multi_index: tuple
    expected: Number
    actual: Number
    expected_bits: int
    actual_bits: int
    ulp: Optional[int] = None
    value_kind: str = "f"  # "f" float32, "i" integer
    bits_width: int = 8  # hex digits
    input: Optional[Number] = None
    input_bits: Optional[int] = None
    input_kind: str = "f"
    input_width: int = 8
    kind: Optional[str] = None
    component: Optional[str] = None
    block: Optional[BlockInfo] = None
    note: str = ""

    def format(self, number: Optional[int] = None) -> str:
        head = f"#{number} " if number is not None else ""
        head += f"at flat index {self.index}, index {self.multi_index}"
        if self.component:
            head += f", {self.component}"
        if self.kind:
            head += f", probe kind {self.kind!r}"
        lines = [head]
        w = 14
        if self.input is not None:
            lines.append(f"    input     {_fmt_value(self.input, self.input_kind):<{w}} "
                         f"{_fmt_bits(self.input_bits, self.input_width)}")
        lines.append(f"    expected  {_fmt_value(self.expected, self.value_kind):<{w}} "
                     f"{_fmt_bits(self.expected_bits, self.bits_width)}")
        dist = ""
        if self.ulp is not None:
            dist = f"   ({self.ulp} ulp{'s' if self.ulp != 1 else ''} apart)"
        lines.append(f"    actual    {_fmt_value(self.actual, self.value_kind):<{w}} "
                     f"{_fmt_bits(self.actual_bits, self.bits_width)}{dist}")
        if self.block is not None:
            lines.append("    " + self.block.format())
        if self.note:
            lines.append("    " + self.note)
        return "\n".join(lines)


@dataclass(frozen=True)
class Report:
    """The result of a comparison. ``ok`` is True when nothing differs (and ``problem`` is None).

    ``n_mismatch`` of ``n_total`` values differ; ``mismatches`` holds the first ones (in component order, then
    C order). ``max_ulp``: the largest float32 ulp distance among all mismatching finite float pairs.
    ``by_kind``/``by_component``: mismatch counts per probe kind / output component (empty when unknown).
    ``problem``: why the arrays could not be compared element by element (shape, dtype), else None.
    """

    ok: bool
    n_mismatch: int
    n_total: int
    mismatches: list = field(default_factory=list)
    ulps: int = 0
    max_ulp: Optional[int] = None
    by_kind: dict = field(default_factory=dict)
    by_component: dict = field(default_factory=dict)
    problem: Optional[str] = None
    title: str = ""

    def format(self, *, max_rows: Optional[int] = None, title: Optional[str] = None) -> str:
        """A readable account: counts, then the first ``max_rows`` (default: all kept) mismatches."""
        title = self.title if title is None else title
        tol = "bit for bit" if self.ulps == 0 else f"within {self.ulps} ulp{'s' if self.ulps != 1 else ''}"
        suffix = f" [{title}]" if title else ""
        if self.problem is not None:
            return f"qcore.testing: cannot compare{suffix}: {self.problem}"
        if self.ok:
            return f"qcore.testing: all {self.n_total} values match {tol}{suffix}"
        lines = [f"qcore.testing: {self.n_mismatch} of {self.n_total} values differ ({tol}){suffix}"]
        if self.max_ulp is not None:
            lines.append(f"  largest distance among mismatching finite floats: {self.max_ulp} ulps")
        if self.by_component:
            lines.append("  by component: " + ", ".join(f"{k} {v}" for k, v in self.by_component.items()))
        if self.by_kind:
            lines.append("  by probe kind: " + ", ".join(f"{k} {v}" for k, v in self.by_kind.items()))
        rows = self.mismatches if max_rows is None else self.mismatches[:max_rows]
        if rows:
            lines.append(f"  first {len(rows)} mismatch{'es' if len(rows) != 1 else ''}:")
            for i, m in enumerate(rows, 1):
                lines.append("  " + m.format(i).replace("\n", "\n  "))
        rest = self.n_mismatch - len(rows)
        if rest > 0:
            lines.append(f"  ... and {rest} more")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


# ---------------------------------------------------------------------------------------------------------------
# kinds
# ---------------------------------------------------------------------------------------------------------------


class KindLabels:
    """Resolved ``kinds``: ``names`` and ``index`` (``names[index[i]]`` is the kind of input row ``i``)."""

    __slots__ = ("names", "index")

    def __init__(self, names: list, index: np.ndarray):
        self.names, self.index = names, index


def kind_labels(kinds: Optional[Kinds], n0: int) -> Optional[KindLabels]:
    """The kind of every row (index along axis 0) of an input of ``n0`` rows, from ``kinds``: the dict
    ``probes_by_kind`` returns (its arrays' lengths along axis 0, in order) or a sequence of one name per row.
    None when ``kinds`` is None."""
    if kinds is None or isinstance(kinds, KindLabels):
        return kinds
    if isinstance(kinds, dict):
        names = [str(k) for k in kinds]
        lengths = [int(np.shape(v)[0]) if np.ndim(v) else 1 for v in kinds.values()]
        if sum(lengths) != n0:
            raise ValueError(f"kinds: the kinds hold {sum(lengths)} rows along axis 0 together, but the input has "
                             f"{n0}; pass the dict probes_by_kind returned for this input")
        return KindLabels(names, np.repeat(np.arange(len(names)), lengths))
    seq = [str(k) for k in kinds]
    if len(seq) != n0:
        raise ValueError(f"kinds: {len(seq)} labels for an input of {n0} rows along axis 0")
    names = list(dict.fromkeys(seq))
    pos = {n: i for i, n in enumerate(names)}
    return KindLabels(names, np.array([pos[s] for s in seq], dtype=np.int64))


# ---------------------------------------------------------------------------------------------------------------
# the comparison
# ---------------------------------------------------------------------------------------------------------------


def _int_width(dtypes) -> int:
    size = max((np.dtype(d).itemsize for d in dtypes), default=1)
    return 2 * size


def _prepare(actual, expected):
    """Host arrays plus their kind ('f' or 'i'), or a problem string."""
    a = to_numpy(actual, name="actual")
    e = to_numpy(expected, name="expected")
    if a.shape != e.shape:
        return None, None, None, None, f"shape: actual {a.shape}, expected {e.shape}"
    ak = "f" if a.dtype.kind == "f" else "i"
    ek = "f" if e.dtype.kind == "f" else "i"
    if ak != ek:
        word = {"f": "floating point", "i": "integer"}
        return None, None, None, None, (f"dtype: actual is {word[ak]} ({a.dtype}), expected is {word[ek]} "
                                        f"({e.dtype})")
    if ak == "f":
        out = []
        for name, arr in (("actual", a), ("expected", e)):
            f = arr.astype(np.float32)
            if arr.dtype.itemsize > 4:
                with np.errstate(invalid="ignore"):
                    same = (f.astype(arr.dtype) == arr) | (np.isnan(f) & np.isnan(arr))
                if not np.all(same):
                    return None, None, None, None, (f"{name} is {arr.dtype} with values float32 does not hold "
                                                    f"exactly (e.g. {arr[~same].reshape(-1)[0]!r})")
            out.append(np.ascontiguousarray(f))
        return out[0], out[1], "f", 8, None
    width = _int_width([a.dtype, e.dtype])
    return a.astype(np.int64), e.astype(np.int64), "i", width, None


def _mismatch_mask(a, e, kind, ulps, nan_equal, signed_zero):
    if kind == "i":
        return a != e, None
    ab, eb = float_bits(a), float_bits(e)
    same = ab == eb
    an, en = np.isnan(a), np.isnan(e)
    ok = same.copy()
    if nan_equal:
        ok |= an & en
    zeros = (a == 0) & (e == 0)
    if not signed_zero:
        ok |= zeros
    dist = np.abs(_ordered(ab) - _ordered(eb))
    finite = np.isfinite(a) & np.isfinite(e)
    if ulps > 0:
        close = finite & (dist <= ulps)
        if signed_zero:
            close &= ~(zeros & ~same)
        ok |= close
    return ~ok, np.where(finite, dist, -1)


def _value_and_bits(arr, i, kind, width):
    v = arr.reshape(-1)[i]
    if kind == "f":
        return float(v), int(float_bits(v))
    iv = int(v)
    return iv, iv & ((1 << (4 * width)) - 1)


def compare_arrays(actual: ArrayLike, expected: ArrayLike, *, ulps: int = 0, nan_equal: bool = True,
                   signed_zero: bool = True, max_report: int = 10, inputs: Optional[ArrayLike] = None,
                   kinds: Any = None, component: Optional[str] = None,
                   row_of: Optional[Callable[[int], int]] = None, title: str = "") -> Report:
    """``compare`` plus what the oracle needs: ``component`` (a label for every mismatch), ``row_of`` (maps the
    axis-0 indices of the compared array to input rows for ``kinds``) and ``kinds`` already resolved by
    ``kind_labels`` for the input (whose row count may differ from the compared array's)."""
    check_opts(ulps, nan_equal, signed_zero, max_report)
    a, e, kind, width, problem = _prepare(actual, expected)
    if problem is not None:
        return Report(False, 0, 0, [], ulps=ulps, problem=(f"{component}: " if component else "") + problem,
                      title=title)
    bad, dist = _mismatch_mask(a, e, kind, ulps, nan_equal, signed_zero)
    flat_bad = np.flatnonzero(bad.reshape(-1))
    n_bad = int(flat_bad.size)
    inp = None
    if inputs is not None:
        inp = to_numpy(inputs, name="inputs")
        if inp.shape != e.shape:
            raise ValueError(f"inputs has shape {inp.shape}; it must have the compared arrays' shape {e.shape}")
        inp_kind = "f" if inp.dtype.kind == "f" else "i"
        inp_width = 8 if inp_kind == "f" else _int_width([inp.dtype])
        inp = inp.astype(np.float32) if inp_kind == "f" else inp.astype(np.int64)
    labels = kind_labels(kinds, e.shape[0] if e.ndim else 1)
    by_kind: dict = {}
    rows_of_bad = None
    if labels is not None and n_bad:
        names, lab = labels.names, labels.index
        row0 = np.unravel_index(flat_bad, e.shape)[0] if e.ndim else np.zeros(n_bad, np.int64)
        rows_of_bad = row_of(row0) if row_of is not None else row0
        counts = np.bincount(lab[rows_of_bad], minlength=len(names))
        by_kind = {names[i]: int(c) for i, c in enumerate(counts) if c}
    max_ulp = None
    if kind == "f" and n_bad:
        d = dist.reshape(-1)[flat_bad]
        d = d[d >= 0]
        max_ulp = int(d.max()) if d.size else None
    out = []
    for j, i in enumerate(flat_bad[:max_report]):
        i = int(i)
        ev, eb = _value_and_bits(e, i, kind, width)
        av, ab = _value_and_bits(a, i, kind, width)
        u = None
        if kind == "f":
            du = int(dist.reshape(-1)[i])
            u = du if du >= 0 else None
        m = Mismatch(i, tuple(int(t) for t in np.unravel_index(i, e.shape)), ev, av, eb, ab, ulp=u,
                     value_kind=kind, bits_width=width, component=component)
        if inp is not None:
            iv, ib = _value_and_bits(inp, i, inp_kind, inp_width)
            m = replace(m, input=iv, input_bits=ib, input_kind=inp_kind, input_width=inp_width)
        if rows_of_bad is not None:
            m = replace(m, kind=labels.names[int(labels.index[rows_of_bad[j]])])
        out.append(m)
    return Report(n_bad == 0, n_bad, int(e.size), out, ulps=ulps, max_ulp=max_ulp, by_kind=by_kind,
                  by_component={component: n_bad} if component and n_bad else {}, title=title)


def check_opts(ulps, nan_equal, signed_zero, max_report):
    """The comparison options every entry point takes (``compare``, ``assert_equal``, the oracle's checks)."""
    if isinstance(ulps, bool) or not isinstance(ulps, (int, np.integer)) or ulps < 0:
        raise ValueError(f"ulps must be a non-negative int, got {ulps!r}")
    for name, v in (("nan_equal", nan_equal), ("signed_zero", signed_zero)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {v!r}")
    if isinstance(max_report, bool) or not isinstance(max_report, (int, np.integer)) or max_report < 0:
        raise ValueError(f"max_report must be a non-negative int, got {max_report!r}")


def merge_reports(reports: list[Report], *, max_report: int, title: str = "") -> Report:
    """One report from several (components of one output, in order)."""
    problems = [r.problem for r in reports if r.problem is not None]
    if problems:
        return Report(False, 0, 0, [], ulps=reports[0].ulps, problem="; ".join(problems), title=title)
    mism: list = []
    for r in reports:
        mism += r.mismatches
    by_kind: dict = {}
    by_comp: dict = {}
    for r in reports:
        for k, v in r.by_kind.items():
            by_kind[k] = by_kind.get(k, 0) + v
        for k, v in r.by_component.items():
            by_comp[k] = by_comp.get(k, 0) + v
    ulp_vals = [r.max_ulp for r in reports if r.max_ulp is not None]
    n_bad = sum(r.n_mismatch for r in reports)
    return Report(n_bad == 0, n_bad, sum(r.n_total for r in reports), mism[:max_report], ulps=reports[0].ulps,
                  max_ulp=max(ulp_vals) if ulp_vals else None, by_kind=by_kind, by_component=by_comp,
                  title=title)


def compare(actual: ArrayLike, expected: ArrayLike, *, ulps: int = 0, nan_equal: bool = True,
            signed_zero: bool = True, max_report: int = 10, inputs: Optional[ArrayLike] = None,
            kinds: Optional[Kinds] = None, title: str = "") -> Report:
    """Compare ``actual`` with ``expected`` (see the module docstring for the rules) -> ``Report``.

    ``inputs``: the input array (same shape) whose elements are shown next to each mismatch. ``kinds``: the
    dict ``probes_by_kind`` returned (or one label per row along axis 0) to name each mismatch's probe kind and
    count mismatches per kind. ``max_report``: how many mismatches the report keeps. ``title``: a label for
    the report's first line.
    """
    return compare_arrays(actual, expected, ulps=ulps, nan_equal=nan_equal, signed_zero=signed_zero,
                          max_report=max_report, inputs=inputs, kinds=kinds, title=title)


def assert_equal(actual: ArrayLike, expected: ArrayLike, *, ulps: int = 0, inputs: Optional[ArrayLike] = None,
                 kinds: Optional[Kinds] = None, nan_equal: bool = True, signed_zero: bool = True,
                 max_report: int = 10, title: str = "") -> Report:
    """``compare`` and raise ``AssertionError(report.format())`` unless the report is ok; returns the report."""
    r = compare(actual, expected, ulps=ulps, nan_equal=nan_equal, signed_zero=signed_zero, max_report=max_report,
                inputs=inputs, kinds=kinds, title=title)
    if not r.ok:
        raise AssertionError(r.format())
    return r

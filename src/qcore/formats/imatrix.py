"""llama.cpp's importance-matrix files, read and written (bytes only; pure numpy).

Two formats, one schema class each (used for both reading and writing), following ``tools/imatrix/imatrix.cpp``
(``save_imatrix`` / ``save_imatrix_legacy`` / ``load_imatrix``) and ``tools/quantize/quantize.cpp``
(``load_imatrix`` / ``load_legacy_imatrix``):

**GGUF** (``imatrix.gguf``, the default since mid-2025; ``ImatrixGGUF``): a GGUF v3 file with no model, metadata
``general.type = "imatrix"``, ``imatrix.datasets`` (array of strings), ``imatrix.chunk_count`` (uint32) and
``imatrix.chunk_size`` (uint32), and per weight tensor ``NAME`` (``blk.0.attn_q.weight``; sorted by name) two
float32 tensors: ``NAME.in_sum2`` (ggml shape ``[n, n_mat]``: the per-column sums of ``x**2``, one row per
matrix: 1 for a dense weight, one per expert) and ``NAME.counts`` (``[1, n_mat]``: tokens seen per matrix, stored
as float32), plus, in llama.cpp versions that collect it, an optional ``NAME.in_sum`` (sums of ``x``, kept as
read). Trailing dimensions of 1 are dropped (``ggml_n_dims``): a dense entry's tensors are 1-D. llama.cpp's
quantizer weights are ``in_sum2 / counts`` per matrix (1 where a count is 0).

**Legacy** (``imatrix.dat``, ``--output-format dat``; ``ImatrixDat``): little-endian, ``int32 n_entries``; per
entry ``int32 len``, ``len`` bytes of name, ``int32 ncall``, ``int32 nval``, ``nval`` float32 ``values``; then
(files since early 2024) ``int32 last_call`` (chunks processed), ``int32 len`` and the dataset name. ``values``
is NOT a raw sum: llama.cpp writes ``(sum / count) * ncall`` with ``ncall = ceil(max(counts) / chunk_size)``
(a matrix with count 0 stores ``1 * ncall``), and its quantizer reads weights as ``values / ncall``
(``values`` when ``ncall`` is 0). The chunk size is not stored; ``ImatrixDat.stats(chunk_size=512)``
rebuilds sums and counts as llama.cpp's imatrix tool does when it loads a ``.dat`` (``values * chunk_size``,
``ncall * chunk_size``), so the mean, and so the quantizer's weights, are kept.

``read_imatrix(path)`` picks the format by content (the GGUF magic), ``write_imatrix(obj, path)`` writes through
the staged writer (nothing half-written on failure). Malformed files raise ``ValueError``
(``CorruptCheckpointError``) naming the file and what is wrong. ``from_stats`` / ``stats()`` convert to and from
``qcore.stats.ImatrixStats`` (``{tensor name: stats}``; ``qcore.algorithms.imatrix`` makes them).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import numpy as np

from qcore._fsutil import check_file_destination, staged_file
from qcore.stats import ImatrixStats

from .safetensors_io import CorruptCheckpointError

__all__ = ["ImatrixGGUF", "ImatrixDat", "GGUFEntry", "DatEntry", "read_imatrix", "write_imatrix",
           "CorruptCheckpointError"]

_ALIGN = 32
_GGUF_VERSION = 3
# GGUF metadata value types
_U32, _I32, _F32, _BOOL, _STR, _ARR, _U64, _I64 = 4, 5, 6, 7, 8, 9, 10, 11
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_F32_TYPE = 0  # ggml type id of float32


def _checked_entries(entries: Mapping, owner: str, kind: type, empty_why: str) -> dict:
    """``entries`` as a dict (file order) after the checks both file classes make: at least one, names non-empty
    strings, values of the file's entry class ``kind``."""
    ent = dict(entries)
    if not ent:
        raise ValueError(f"{owner}: no entries ({empty_why})")
    for k, v in ent.items():
        if not isinstance(k, str) or not k:
            raise ValueError(f"{owner}: entry names must be non-empty strings, got {k!r}")
        if not isinstance(v, kind):
            raise TypeError(f"{owner}: entry {k!r} must be a {kind.__name__}, got {type(v).__name__}")
    return ent


def _f32(a, what: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"{what} must be a numeric array, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32)


# ---------------------------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class GGUFEntry:
    """One weight tensor's statistic as stored: ``in_sum2`` float32 ``[n_mat, n]``, ``counts`` float32
    ``[n_mat]``, ``in_sum`` (optional) float32 ``[n_mat, n]``."""

    in_sum2: np.ndarray
    counts: np.ndarray
    in_sum: Optional[np.ndarray] = None

    def __post_init__(self):
        s = _f32(self.in_sum2, "in_sum2")
        if s.ndim == 1:
            s = s[None]
        c = _f32(self.counts, "counts").reshape(-1)
        if s.ndim != 2 or s.shape[0] != c.shape[0] or s.size == 0:
            raise ValueError(f"GGUFEntry: in_sum2 must be [n_mat, n] with n_mat = len(counts) = {c.shape[0]}, "
                             f"got shape {np.shape(self.in_sum2)}")
        a = None
        if self.in_sum is not None:
            a = _f32(self.in_sum, "in_sum").reshape(s.shape) if np.size(self.in_sum) == s.size else None
            if a is None:
                raise ValueError(f"GGUFEntry: in_sum has {np.size(self.in_sum)} values, in_sum2 {s.size}")
        object.__setattr__(self, "in_sum2", s)
        object.__setattr__(self, "counts", c)
        object.__setattr__(self, "in_sum", a)

    def __eq__(self, o) -> bool:
        if not isinstance(o, GGUFEntry):
            return NotImplemented
        same = lambda x, y: (x is None and y is None) or (x is not None and y is not None and x.shape == y.shape
                                                          and x.tobytes() == y.tobytes())
        return same(self.in_sum2, o.in_sum2) and same(self.counts, o.counts) and same(self.in_sum, o.in_sum)


@dataclass(frozen=True, eq=False)
class ImatrixGGUF:
    """llama.cpp's GGUF imatrix file: ``entries`` (weight tensor name -> ``GGUFEntry``), ``datasets`` (the
    calibration file names), ``chunk_count`` (chunks processed), ``chunk_size`` (tokens per chunk)."""

    entries: Mapping[str, GGUFEntry]
    datasets: tuple = ()
    chunk_count: int = 0
    chunk_size: int = 512

    def __post_init__(self):
        ent = _checked_entries(self.entries, "ImatrixGGUF", GGUFEntry,
                               "llama.cpp refuses an imatrix file without data")
        ds = (self.datasets,) if isinstance(self.datasets, str) else tuple(self.datasets)
        if not all(isinstance(d, str) for d in ds):
            raise TypeError(f"ImatrixGGUF: datasets must be strings, got {ds!r}")
        for name in ("chunk_count", "chunk_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < 2 ** 32:
                raise ValueError(f"ImatrixGGUF: {name} must be an int in [0, 2**32), got {v!r}")
        object.__setattr__(self, "entries", ent)
        object.__setattr__(self, "datasets", ds)

    def __eq__(self, o) -> bool:
        if not isinstance(o, ImatrixGGUF):
            return NotImplemented
        # entries compare as a mapping: the file stores them sorted by name whatever the order given
        return (self.datasets == o.datasets and self.chunk_count == o.chunk_count and self.chunk_size == o.chunk_size
                and set(self.entries) == set(o.entries) and all(self.entries[k] == o.entries[k] for k in self.entries))

    # -- conversions ------------------------------------------------------------------------------------------

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any], *, datasets=(), chunk_size: int = 512,
                   chunk_count: Optional[int] = None) -> "ImatrixGGUF":
        """From ``{tensor name: ImatrixStats}``; ``chunk_count`` defaults to ``max(counts) // chunk_size``
        (llama.cpp's ``m_last_chunk``)."""
        ent, top = {}, 0
        for k in sorted(stats):
            st = stats[k]
            if not isinstance(st, ImatrixStats):
                raise TypeError(f"stats[{k!r}] must be an ImatrixStats, got {type(st).__name__}")
            st = st.numpy()
            ent[k] = GGUFEntry(st.sums.astype(np.float32), st.counts.astype(np.float32))
            top = max(top, int(st.counts.max()))
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        return cls(ent, datasets, top // chunk_size if chunk_count is None else chunk_count, chunk_size)

    def stats(self) -> dict:
        """``{tensor name: ImatrixStats}`` (float32 sums widened, counts rounded as llama.cpp's ``lround``)."""
        return {k: ImatrixStats(e.in_sum2.astype(np.float64),
                                np.floor(e.counts.astype(np.float64) + 0.5).astype(np.int64))
                for k, e in self.entries.items()}

    def quant_weights(self) -> dict:
        """``{tensor name: float32 weights}`` exactly as ``llama-quantize`` computes them: ``in_sum2 / counts``
        in float32 per matrix, 1 where a count is 0; ``[n]`` for dense entries, ``[n_mat, n]`` for experts."""
        out = {}
        for k, e in self.entries.items():
            c = e.counts[:, None]
            w = np.where(c > 0, e.in_sum2 / np.where(c > 0, c, np.float32(1)), np.float32(1)).astype(np.float32)
            out[k] = w[0] if w.shape[0] == 1 else w
        return out

    # -- bytes ------------------------------------------------------------------------------------------------

    def tensors(self) -> list:
        """(name, ggml dims, float32 data) in the order llama.cpp writes them."""
        out = []
        for k in sorted(self.entries):
            e = self.entries[k]
            m, n = e.in_sum2.shape
            out.append((f"{k}.in_sum2", _ndims((n, m)), e.in_sum2))
            out.append((f"{k}.counts", _ndims((1, m)), e.counts))
            if e.in_sum is not None:
                out.append((f"{k}.in_sum", _ndims((n, m)), e.in_sum))
        return out

    def to_bytes(self) -> bytes:
        kv = [("general.type", _STR, "imatrix"), ("imatrix.datasets", _ARR, list(self.datasets)),
              ("imatrix.chunk_count", _U32, int(self.chunk_count)), ("imatrix.chunk_size", _U32, int(self.chunk_size))]
        tens = self.tensors()
        head = bytearray(b"GGUF" + struct.pack("<IQQ", _GGUF_VERSION, len(tens), len(kv)))
        for key, t, v in kv:
            head += _gstr(key) + struct.pack("<I", t)
            if t == _STR:
                head += _gstr(v)
            elif t == _ARR:
                head += struct.pack("<IQ", _STR, len(v)) + b"".join(_gstr(s) for s in v)
            else:
                head += struct.pack("<I", v)
        off, blobs = 0, []
        for name, dims, data in tens:
            head += _gstr(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
            head += struct.pack("<IQ", _F32_TYPE, off)
            b = np.ascontiguousarray(data, "<f4").tobytes()
            pad = -len(b) % _ALIGN
            blobs.append(b + b"\0" * pad)
            off += len(b) + pad
        head += b"\0" * (-len(head) % _ALIGN)
        return bytes(head) + b"".join(blobs)

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "imatrix") -> "ImatrixGGUF":
        r = _Reader(data, where)
        if r.take(4, "the magic") != b"GGUF":
            raise CorruptCheckpointError(f"{where}: not a GGUF file (no GGUF magic)")
        version = r.unpack("<I", "the version")
        if version not in (2, 3):
            raise CorruptCheckpointError(f"{where}: GGUF version {version}; llama.cpp reads versions 2 and 3")
        n_t = r.count("the tensor count", 24)
        n_kv = r.count("the metadata entry count", 13)
        meta, align = {}, _ALIGN
        for i in range(n_kv):
            key = r.string(f"metadata key {i}")
            if key in meta:
                raise CorruptCheckpointError(f"{where}: metadata {key!r} appears twice")
            t = r.unpack("<I", f"the type of metadata {key!r}")
            meta[key] = (t, r.value(t, f"metadata {key!r}"))
        if "general.alignment" in meta:
            t, align = meta["general.alignment"]
            if t != _U32 or align <= 0 or align & (align - 1):
                raise CorruptCheckpointError(f"{where}: general.alignment must be a uint32 power of two, got {align!r}")
        if "general.type" in meta and meta["general.type"] != (_STR, "imatrix"):
            raise CorruptCheckpointError(f"{where}: general.type is {meta['general.type'][1]!r}, not 'imatrix' (a "
                                         f"model file, not an importance matrix?)")
        for key in ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"):
            if key not in meta:  # llama-quantize: "missing imatrix metadata"
                raise CorruptCheckpointError(f"{where}: missing imatrix metadata {key!r} (llama-quantize refuses "
                                             f"such a file)")
        t, ds = meta["imatrix.datasets"]
        if t != _ARR or ds[0] != _STR:
            raise CorruptCheckpointError(f"{where}: imatrix.datasets must be an array of strings")
        nums = {}
        for key in ("imatrix.chunk_count", "imatrix.chunk_size"):
            t, v = meta[key]
            if t != _U32:
                raise CorruptCheckpointError(f"{where}: {key} must be a uint32, got GGUF type {t}")
            nums[key] = v
        infos = []
        for i in range(n_t):
            name = r.string(f"the name of tensor {i}")
            nd = r.unpack("<I", f"the dimension count of tensor {name!r}")
            if not 1 <= nd <= 4:
                raise CorruptCheckpointError(f"{where}: tensor {name!r} has {nd} dimensions; GGUF allows 1 to 4")
            dims = tuple(r.unpack("<Q", f"a dimension of tensor {name!r}") for _ in range(nd))
            tid = r.unpack("<I", f"the type of tensor {name!r}")
            off = r.unpack("<Q", f"the data offset of tensor {name!r}")
            if tid != _F32_TYPE:
                raise CorruptCheckpointError(f"{where}: tensor {name!r} has ggml type {tid}; imatrix tensors are "
                                             f"float32 (type 0)")
            if off % align:
                raise CorruptCheckpointError(f"{where}: tensor {name!r} starts at data offset {off}, not a multiple "
                                             f"of the alignment {align}")
            infos.append((name, dims, off))
        start = -(-r.pos // align) * align
        arrays = {}
        for name, dims, off in infos:
            if name in arrays:
                raise CorruptCheckpointError(f"{where}: tensor {name!r} appears twice")
            n = math.prod(dims)  # Python ints: numpy's int64 product wraps for dimensions near 2**63
            b, e = start + off, start + off + 4 * n
            if e > len(data):
                raise CorruptCheckpointError(f"{where}: the data of tensor {name!r} runs to byte {e}, past the end "
                                             f"of the file ({len(data)} bytes): truncated or corrupted")
            arrays[name] = (dims, np.frombuffer(data, "<f4", n, b).astype(np.float32))
        groups: dict = {}
        for name, (dims, a) in arrays.items():
            for suf, slot in ((".in_sum2", 0), (".counts", 1), (".in_sum", 2)):
                if name.endswith(suf) and len(name) > len(suf):
                    groups.setdefault(name[:-len(suf)], [None, None, None])[slot] = (dims, a)
                    break
        if not groups:  # llama.cpp: "no data in file"
            raise CorruptCheckpointError(f"{where}: no imatrix data (no NAME.in_sum2 / NAME.counts tensors)")
        ent = {}
        for k in sorted(groups):
            s2, c, s1 = groups[k]
            if s2 is None or c is None:
                raise CorruptCheckpointError(f"{where}: mismatched sums and counts for {k!r}: "
                                             f"{'no .in_sum2' if s2 is None else 'no .counts'} tensor")
            m = int(c[1].size)
            if m < 1 or s2[1].size % m or s2[1].size == 0 or (len(s2[0]) > 1 and int(np.prod(s2[0][1:])) != m):
                raise CorruptCheckpointError(f"{where}: {k!r}: in_sum2 of shape {s2[0]} does not hold one row per "
                                             f"count ({m} counts)")
            # token counts (llama.cpp stores int64 counts as float32: whole numbers): a fraction would divide the
            # sums up to inf, a count past int64 would wrap when read back as one
            cnt = c[1]
            if not (np.isfinite(cnt).all() and (cnt >= 0).all() and (cnt < 2.0 ** 63).all()
                    and (cnt == np.floor(cnt)).all()):
                raise CorruptCheckpointError(f"{where}: {k!r}: counts must be whole numbers in [0, 2**63) (token "
                                             f"counts), got {cnt[~((cnt >= 0) & (cnt < 2.0 ** 63) & (cnt == np.floor(cnt)))][:3]}")
            if not np.isfinite(s2[1]).all() or (s2[1] < 0).any():
                raise CorruptCheckpointError(f"{where}: {k!r}: in_sum2 holds negative or non-finite sums of squares")
            if s1 is not None and s1[1].size != s2[1].size:
                raise CorruptCheckpointError(f"{where}: mismatched sums and counts for {k!r}: in_sum has "
                                             f"{s1[1].size} values, in_sum2 {s2[1].size}")
            n = s2[1].size // m
            ent[k] = GGUFEntry(s2[1].reshape(m, n), c[1], None if s1 is None else s1[1].reshape(m, n))
        return cls(ent, tuple(ds[1]), nums["imatrix.chunk_count"], nums["imatrix.chunk_size"])


def _ndims(ne: tuple) -> list:
    """ggml_n_dims: the dimensions up to the last one that is not 1 (at least one)."""
    ne = list(ne)
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return ne


def _gstr(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


class _Reader:
    """Bounds-checked little-endian reads of bytes (every length checked against what is left)."""

    def __init__(self, data: bytes, where: str):
        self.data, self.where, self.pos = data, where, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > len(self.data) - self.pos:
            raise CorruptCheckpointError(f"{self.where}: {what} needs {n} bytes at offset {self.pos}, but the file "
                                         f"has {len(self.data) - self.pos} left (truncated or corrupted)")
        b = self.data[self.pos:self.pos + n]
        self.pos += n
        return bytes(b)

    def unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def count(self, what: str, min_bytes: int) -> int:
        n = self.unpack("<Q", what)
        if n * max(1, min_bytes) > len(self.data) - self.pos:
            raise CorruptCheckpointError(f"{self.where}: {what} is {n}, more than the {len(self.data) - self.pos} "
                                         f"bytes left in the file can hold")
        return n

    def string(self, what: str) -> str:
        b = self.take(self.count(f"the length of {what}", 1), what)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptCheckpointError(f"{self.where}: {what} is not UTF-8") from None

    def value(self, t: int, what: str, depth: int = 0):
        if t in _SCALAR:
            return self.unpack(_SCALAR[t], what)
        if t == _STR:
            return self.string(what)
        if t == _ARR and depth == 0:
            et = self.unpack("<I", f"the element type of {what}")
            if et not in _SCALAR and et not in (_STR, _ARR):
                raise CorruptCheckpointError(f"{self.where}: {what} has unknown element type {et}")
            n = self.count(f"the length of array {what}", struct.calcsize(_SCALAR[et]) if et in _SCALAR else 8)
            return (et, [self.value(et, f"{what}[{i}]", depth + 1) for i in range(n)])
        raise CorruptCheckpointError(f"{self.where}: {what} has unknown or nested value type {t}")


# ---------------------------------------------------------------------------------------------------------------
# legacy .dat
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class DatEntry:
    """One entry of a legacy file: ``ncall`` (int32) and ``values`` (float32, ``(sum / count) * ncall``)."""

    ncall: int
    values: np.ndarray

    def __post_init__(self):
        if isinstance(self.ncall, bool) or not isinstance(self.ncall, (int, np.integer)) \
                or not -2 ** 31 <= self.ncall < 2 ** 31:
            raise ValueError(f"DatEntry: ncall must be an int32, got {self.ncall!r}")
        v = _f32(self.values, "values").reshape(-1)
        if v.size < 1:
            raise ValueError("DatEntry: values must not be empty (llama.cpp refuses nval < 1)")
        object.__setattr__(self, "ncall", int(self.ncall))
        object.__setattr__(self, "values", v)

    def __eq__(self, o):
        if not isinstance(o, DatEntry):
            return NotImplemented
        return self.ncall == o.ncall and self.values.tobytes() == o.values.tobytes()


@dataclass(frozen=True, eq=False)
class ImatrixDat:
    """llama.cpp's legacy ``.dat`` imatrix: ``entries`` (name -> ``DatEntry``, file order), ``last_call`` (the
    chunk count of the trailer) and ``dataset`` (its name); both None for files written before the trailer
    existed (they must be None together)."""

    entries: Mapping[str, DatEntry]
    last_call: Optional[int] = None
    dataset: Optional[str] = None

    def __post_init__(self):
        ent = _checked_entries(self.entries, "ImatrixDat", DatEntry, "llama.cpp refuses a file with n_entries < 1")
        if (self.last_call is None) != (self.dataset is None):
            raise ValueError("ImatrixDat: last_call and dataset are the file's trailer: give both or neither, got "
                             f"last_call={self.last_call!r}, dataset={self.dataset!r}")
        if self.last_call is not None and (isinstance(self.last_call, bool) or not isinstance(
                self.last_call, (int, np.integer)) or not -2 ** 31 <= self.last_call < 2 ** 31):
            raise ValueError(f"ImatrixDat: last_call must be an int32, got {self.last_call!r}")
        if self.dataset is not None and not isinstance(self.dataset, str):
            raise TypeError(f"ImatrixDat: dataset must be a str, got {type(self.dataset).__name__}")
        object.__setattr__(self, "entries", ent)

    def __eq__(self, o):
        if not isinstance(o, ImatrixDat):
            return NotImplemented
        return (self.last_call == o.last_call and self.dataset == o.dataset and list(self.entries) == list(o.entries)
                and all(self.entries[k] == o.entries[k] for k in self.entries))

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any], *, chunk_size: int = 512, dataset: str = "",
                   last_call: Optional[int] = None) -> "ImatrixDat":
        """What ``llama-imatrix --output-format dat`` writes for ``{tensor name: ImatrixStats}``: entries with
        no token at all are skipped, names sorted, ``ncall = ceil(max(counts) / chunk_size)``, values
        ``(sum / count) * ncall`` in float32 (1 * ncall for an expert with no token); ``last_call`` defaults to
        ``max(counts) // chunk_size``."""
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        ent, top = {}, 0
        for k in sorted(stats):
            st = stats[k]
            if not isinstance(st, ImatrixStats):
                raise TypeError(f"stats[{k!r}] must be an ImatrixStats, got {type(st).__name__}")
            st = st.numpy()
            top = max(top, int(st.counts.max()))
            if not (st.counts > 0).any():
                continue
            ncall = (int(st.counts.max()) + chunk_size - 1) // chunk_size
            s = st.sums.astype(np.float32)
            c = st.counts.astype(np.float32)[:, None]
            zero = c == 0
            v = (np.where(zero, np.float32(1), s) / np.where(zero, np.float32(1), c)) * np.float32(ncall)
            ent[k] = DatEntry(ncall, v.astype(np.float32).reshape(-1))
        if not ent:
            raise ValueError("ImatrixDat.from_stats: no entry saw any token")
        return cls(ent, top // chunk_size if last_call is None else last_call, dataset)

    def stats(self, *, chunk_size: int = 512) -> dict:
        """``{tensor name: ImatrixStats}`` as llama.cpp's imatrix tool rebuilds them from a ``.dat`` (one count for
        all experts: the format has one ``ncall`` per entry): sums ``values * chunk_size``, count
        ``ncall * chunk_size``."""
        return {k: ImatrixStats((e.values.astype(np.float64) * chunk_size)[None],
                                np.array([e.ncall * chunk_size], np.int64))
                for k, e in self.entries.items()}

    def quant_weights(self) -> dict:
        """``{tensor name: float32 weights}`` as ``llama-quantize`` reads a ``.dat``: ``values / ncall`` (``values``
        when ``ncall`` is 0); flat ``[nval]`` (for experts, ``n_expert * n`` values, expert after expert)."""
        return {k: (e.values / np.float32(e.ncall)).astype(np.float32) if e.ncall > 0 else e.values.copy()
                for k, e in self.entries.items()}

    def to_bytes(self) -> bytes:
        out = bytearray(struct.pack("<i", len(self.entries)))
        for k, e in self.entries.items():
            name = k.encode("utf-8")
            out += struct.pack("<i", len(name)) + name + struct.pack("<ii", e.ncall, e.values.size)
            out += np.ascontiguousarray(e.values, "<f4").tobytes()
        if self.last_call is not None:
            ds = self.dataset.encode("utf-8")
            out += struct.pack("<ii", self.last_call, len(ds)) + ds
        return bytes(out)

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "imatrix") -> "ImatrixDat":
        r = _Reader(data, where)
        n = r.unpack("<i", "the entry count")
        if n < 1:  # llama.cpp: "no data in file"
            raise CorruptCheckpointError(f"{where}: entry count {n}; an imatrix .dat file has at least one entry")
        if n * 12 > len(data) - r.pos:
            raise CorruptCheckpointError(f"{where}: entry count {n} is more than the {len(data) - r.pos} bytes left "
                                         f"can hold (not an imatrix .dat file, or truncated)")
        ent = {}
        for i in range(n):
            ln = r.unpack("<i", f"the name length of entry {i}")
            if ln < 1:
                raise CorruptCheckpointError(f"{where}: entry {i} has name length {ln}")
            raw = r.take(ln, f"the name of entry {i}")
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise CorruptCheckpointError(f"{where}: the name of entry {i} is not UTF-8") from None
            if name in ent:
                raise CorruptCheckpointError(f"{where}: entry {name!r} appears twice")
            ncall = r.unpack("<i", f"ncall of entry {name!r}")
            nval = r.unpack("<i", f"nval of entry {name!r}")
            if nval < 1:
                raise CorruptCheckpointError(f"{where}: entry {name!r} has nval {nval}; llama.cpp needs at least 1")
            vals = np.frombuffer(r.take(4 * nval, f"the {nval} values of entry {name!r}"), "<f4").astype(np.float32)
            if ncall < 0 or not np.isfinite(vals).all() or (vals < 0).any():
                raise CorruptCheckpointError(f"{where}: entry {name!r}: ncall {ncall} must be >= 0 and the values "
                                             f"finite and non-negative")
            ent[name] = DatEntry(ncall, vals)
        if r.pos == len(data):  # files from before the trailer
            return cls(ent)
        last = r.unpack("<i", "the trailer's chunk count")
        ln = r.unpack("<i", "the trailer's dataset name length")
        if ln < 0:
            raise CorruptCheckpointError(f"{where}: dataset name length {ln}")
        raw = r.take(ln, "the dataset name")
        if r.pos != len(data):
            raise CorruptCheckpointError(f"{where}: {len(data) - r.pos} unexpected bytes after the dataset name")
        return cls(ent, last, raw.decode("utf-8", "replace"))


# ---------------------------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------------------------


def read_imatrix(path) -> Union[ImatrixGGUF, ImatrixDat]:
    """Read an imatrix file of either format (chosen by content: the GGUF magic, else legacy ``.dat``, as
    llama.cpp does)."""
    p = os.fspath(path)
    with open(p, "rb") as f:
        data = f.read()
    if data[:4] == b"GGUF":
        return ImatrixGGUF.from_bytes(data, where=p)
    return ImatrixDat.from_bytes(data, where=p)


def write_imatrix(obj: Union[ImatrixGGUF, ImatrixDat], path, *, overwrite: bool = False) -> None:
    """Write ``obj`` to ``path`` through the staged writer: a failure leaves nothing at ``path`` (or the old file
    untouched). ``overwrite``: replace an existing file."""
    if not isinstance(obj, (ImatrixGGUF, ImatrixDat)):
        raise TypeError(f"obj must be an ImatrixGGUF or an ImatrixDat, got {type(obj).__name__}")
    check_file_destination(path, overwrite, [])
    data = obj.to_bytes()
    with staged_file(path, recheck=lambda: check_file_destination(path, overwrite, [])) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)

"""safetensors files without torch: a streaming, deterministic writer and a validating reader.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length ``N``, ``N`` bytes
of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``, then the raw
little-endian tensor bytes, offsets relative to the end of the header.

- **Writer** (``write_file``): tensors are given as ``(name, dtype, shape, produce)`` where ``produce()`` returns
  the tensor's bytes when it is written, so a shard is written one tensor at a time and peak memory does not grow
  with the model. Names are written in sorted order with a fixed JSON layout, padding the header with spaces to
  a multiple of 8 bytes (as the reference implementation does): the same tensors give byte-identical files.
- **Reader** (``SafetensorsFile``): checks the header before any tensor is read: JSON, known dtypes, shapes,
  offsets that tile the data area exactly and fit the file (a truncated file fails here, naming the tensor), and
  byte counts that match ``dtype`` x ``shape``. ``raw(name)`` returns the bytes of one tensor.

Only the pickle-free format exists here; nothing in qcore reads pickled checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

__all__ = ["DTYPE_BYTES", "TensorRecord", "SafetensorsFile", "CorruptCheckpointError", "write_file", "header_bytes",
           "read_json", "read_json_object", "index_shards", "no_safetensors"]

# bytes per element of each safetensors dtype name
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}

_MAX_HEADER = 100_000_000  # the reference implementation's limit


class CorruptCheckpointError(ValueError):
    """A checkpoint file that is not a valid safetensors file, or whose tensors do not match what is expected."""

    @classmethod
    def naming(cls, path, e: "CorruptCheckpointError") -> "CorruptCheckpointError":
        """``e`` with the checkpoint ``path`` in front when its message does not name it already."""
        msg = str(e)
        return e if str(path) in msg else cls(f"{str(path)!r}: {msg}")


MAX_JSON_DEPTH = 64  # configs nest a few levels; deeper ones would only make later readers recurse


def _json_depth(value: object) -> int:
    """How deeply ``value`` (parsed JSON) nests, without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def read_json(path: Union[str, os.PathLike], *, what: str = "") -> object:
    """The JSON value of the file ``path``; ``CorruptCheckpointError`` naming the file (and ``what`` it is) when it
    is not UTF-8 JSON, or nests more than ``MAX_JSON_DEPTH`` levels (instead of a ``RecursionError`` here or in
    whatever reads it next)."""
    p = pathlib.Path(path)
    label = f"{str(p)!r}{f' ({what})' if what else ''}"
    try:
        text = p.read_bytes().decode("utf-8")
        value = json.loads(text)
        if _json_depth(value) > MAX_JSON_DEPTH:
            raise RecursionError
        return value
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{label}: not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise CorruptCheckpointError(f"{label}: not valid JSON ({e})") from None
    except RecursionError:
        raise CorruptCheckpointError(f"{label}: the JSON nests too deeply to read (more than {MAX_JSON_DEPTH} "
                                     f"levels)") from None


def read_json_object(path: Union[str, os.PathLike], *, what: str = "") -> dict:
    """``read_json`` of a file that must hold a JSON object (``config.json``, an index)."""
    d = read_json(path, what=what)
    if not isinstance(d, dict):
        raise CorruptCheckpointError(f"{str(path)!r}{f' ({what})' if what else ''}: expected a JSON object, got "
                                     f"{type(d).__name__}")
    return d


def no_safetensors(directory: Union[str, os.PathLike]) -> CorruptCheckpointError:
    """The error for a checkpoint directory without safetensors weights (naming the pickled files it holds
    instead: qcore never unpickles a file)."""
    d = pathlib.Path(directory)
    pickles = sorted(f.name for f in d.iterdir() if f.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl")) \
        if d.is_dir() else []
    return CorruptCheckpointError(f"{str(d)!r} has no .safetensors weights"
                                  f"{f' (only pickled ones: {pickles[:3]})' if pickles else ''}; qcore reads "
                                  f"safetensors only and never unpickles a file (transformers' save_pretrained "
                                  f"writes safetensors by default)")


def index_shards(directory: Union[str, os.PathLike], index: Union[str, os.PathLike, None] = None) -> list:
    """The shard files a safetensors index (``model.safetensors.index.json``) names, sorted, each checked: a
    ``weight_map`` of tensor names to relative file names inside ``directory`` (no absolute path, no ``..``),
    every one an existing file."""
    d = pathlib.Path(directory)
    idx = pathlib.Path(index) if index is not None else d / "model.safetensors.index.json"
    head = read_json_object(idx, what="safetensors index")
    wm = head.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise CorruptCheckpointError(f"{str(idx)!r}: weight_map must map tensor names to file names, got "
                                     f"{wm!r}"[:300])
    for k, v in wm.items():
        if not isinstance(v, str):
            raise CorruptCheckpointError(f"{str(idx)!r}: weight_map[{k!r}] must be a file name, got {v!r}"[:300])
    if not isinstance(head.get("metadata", {}), dict):
        raise CorruptCheckpointError(f"{str(idx)!r}: metadata must be a JSON object, got "
                                     f"{type(head['metadata']).__name__}")
    out = []
    for name in sorted(set(wm.values())):
        pp = pathlib.PurePath(name)
        f = d / name
        if (not name or pp.is_absolute() or pathlib.PureWindowsPath(name).is_absolute() or ".." in pp.parts
                or "\\" in name):
            key = next(k for k, v in wm.items() if v == name)
            raise CorruptCheckpointError(f"{str(idx)!r}: tensor {key!r} names the file {name!r}, which is not a file "
                                         f"directly inside the checkpoint directory")
        if not f.is_file():
            key = next(k for k, v in wm.items() if v == name)
            raise CorruptCheckpointError(f"{str(idx)!r}: shard {name!r} is missing (weight_map[{key!r}] names it)")
        out.append(f)
    held = {}
    for name in sorted(set(wm.values())):
        try:
            held[name] = SafetensorsFile(d / name).entries
        except CorruptCheckpointError as e:  # which entry of the index names the file, and what is wrong with it
            key = next(k for k, v in wm.items() if v == name)
            raise CorruptCheckpointError(f"{str(idx)!r}: weight_map[{key!r}] names {name!r}, which is not a valid "
                                         f"safetensors file ({e})") from None
    for k, v in wm.items():  # the index says where each tensor is: it must be there
        if k not in held[v]:
            raise CorruptCheckpointError(f"{str(idx)!r}: the index puts tensor {k!r} in {v!r}, which does not "
                                         f"hold it")
    return out


@dataclass(frozen=True)
class TensorRecord:
    """One tensor to write: ``produce()`` returns exactly ``nbytes`` bytes (called once, when it is written)."""

    name: str
    dtype: str
    shape: tuple
    produce: Callable[[], bytes]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name == "__metadata__":
            raise ValueError(f"tensor name must be a non-empty string other than '__metadata__', got {self.name!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {self.name!r}: dtype {self.dtype!r} is not a safetensors dtype; expected one "
                             f"of {sorted(DTYPE_BYTES)}")
        shape = tuple(self.shape)
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise ValueError(f"tensor {self.name!r}: shape {shape} must hold non-negative ints")
        object.__setattr__(self, "shape", shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def header_bytes(records: Sequence[TensorRecord], metadata: Optional[Mapping[str, str]] = None) -> bytes:
    """The 8-byte length + JSON header for ``records`` (sorted by name), padded to a multiple of 8 bytes."""
    names = [r.name for r in records]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate tensor names {dup}")
    head: dict = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("metadata must map str to str")
        head["__metadata__"] = dict(sorted(metadata.items()))
    offset = 0
    for r in sorted(records, key=lambda r: r.name):
        head[r.name] = {"dtype": r.dtype, "shape": list(r.shape), "data_offsets": [offset, offset + r.nbytes]}
        offset += r.nbytes
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_file(path: Union[str, os.PathLike], records: Iterable[TensorRecord],
               metadata: Optional[Mapping[str, str]] = None) -> int:
    """Write ``records`` to ``path`` one tensor at a time; returns the file size. The caller makes the write atomic
    (qcore's exporters write into a temporary directory that is renamed into place)."""
    records = sorted(records, key=lambda r: r.name)
    head = header_bytes(records, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for r in records:
            data = r.produce()
            if len(data) != r.nbytes:
                raise ValueError(f"tensor {r.name!r}: produced {len(data)} bytes, expected {r.nbytes} "
                                 f"({r.dtype} x {list(r.shape)})")
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(head) + sum(r.nbytes for r in records)


def _short(v: object) -> str:
    r = repr(v)
    return r if len(r) <= 100 else f"{r[:80]}... ({len(r)} characters)"


def _is_uint(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class _Duplicate(ValueError):
    pass


def _unique_keys(pairs: list) -> dict:
    d: dict = {}
    for k, v in pairs:
        if k in d:
            raise _Duplicate(k)
        d[k] = v
    return d


def _not_json(token: str):
    raise ValueError(f"{token} is not a JSON value")


def _header_json(raw: bytes, where: str) -> dict:
    """A safetensors header as the reference reader (serde_json) accepts it: UTF-8 JSON (no NaN / Infinity
    tokens, no key written twice in one object, nesting within ``MAX_JSON_DEPTH``), an object."""
    try:
        head = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_not_json)
    except _Duplicate as e:
        raise CorruptCheckpointError(f"{where}: the header writes key {str(e)!r} twice in one object") from None
    except (UnicodeDecodeError, ValueError) as e:  # json.JSONDecodeError and the NaN / Infinity tokens
        raise CorruptCheckpointError(f"{where}: the header is not valid JSON ({e})") from None
    except RecursionError:
        raise CorruptCheckpointError(f"{where}: the header JSON nests too deeply to read") from None
    if not isinstance(head, dict):
        raise CorruptCheckpointError(f"{where}: the header is not a JSON object")
    if _json_depth(head) > MAX_JSON_DEPTH:
        raise CorruptCheckpointError(f"{where}: the header JSON nests more than {MAX_JSON_DEPTH} levels")
    return head


@dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple
    begin: int
    end: int


class SafetensorsFile:
    """A validated safetensors file: ``entries`` (name -> dtype, shape, offsets), ``metadata``, ``raw(name)``.

    Raises ``CorruptCheckpointError`` naming the file (and the tensor) when the header is malformed, a tensor's
    byte range does not match its dtype and shape, the ranges overlap or leave gaps, or the file is shorter than
    its header says (a truncated download or copy)."""

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = pathlib.Path(path)
        where = str(self.path)
        if self.path.is_dir():
            raise CorruptCheckpointError(f"{where}: a directory, not a safetensors file")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            first = f.read(8)
            if len(first) < 8:
                raise CorruptCheckpointError(f"{where}: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", first)
            if n > _MAX_HEADER or 8 + n > size:
                raise CorruptCheckpointError(f"{where}: header length {n} does not fit the file ({size} bytes); "
                                             f"the file is truncated or not a safetensors file")
            head = _header_json(f.read(n), where)
        meta = head.pop("__metadata__", None)
        if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
            raise CorruptCheckpointError(f"{where}: __metadata__ must map strings to strings, got "
                                         f"{_short(meta)}")
        self.metadata = dict(meta or {})
        self.data_start = 8 + n
        entries = {}
        for name, e in head.items():
            if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
                raise CorruptCheckpointError(f"{where}: tensor {name!r} has a malformed header entry {_short(e)} "
                                             f"(expected dtype, shape and data_offsets)")
            dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
            if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
                raise CorruptCheckpointError(f"{where}: tensor {name!r} has unknown dtype {_short(dtype)}; expected "
                                             f"one of {sorted(DTYPE_BYTES)}")
            if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
                raise CorruptCheckpointError(f"{where}: tensor {name!r} has a malformed shape {_short(shape)} "
                                             f"(expected a list of non-negative ints)")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(v) for v in offsets)):
                raise CorruptCheckpointError(f"{where}: tensor {name!r} has malformed data_offsets {_short(offsets)} "
                                             f"(expected [begin, end], non-negative ints)")
            (b, end), shape = offsets, tuple(shape)
            if end - b != math.prod(shape) * DTYPE_BYTES[dtype]:
                raise CorruptCheckpointError(f"{where}: tensor {name!r} spans {end - b} bytes but {dtype} x "
                                             f"{list(shape)} needs {math.prod(shape) * DTYPE_BYTES[dtype]}")
            entries[name] = Entry(dtype, shape, b, end)
        pos = 0
        for name, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
            if e.begin != pos:
                raise CorruptCheckpointError(f"{where}: tensor {name!r} starts at byte {e.begin}, expected {pos} "
                                             f"(overlapping or gapped data)")
            pos = e.end
        if self.data_start + pos > size:
            last = max(entries, key=lambda k: entries[k].end)
            raise CorruptCheckpointError(f"{where}: the file is truncated: {size} bytes, its header needs "
                                         f"{self.data_start + pos} (tensor {last!r} is cut off)")
        if self.data_start + pos < size:
            raise CorruptCheckpointError(f"{where}: {size - self.data_start - pos} unexpected bytes after the last "
                                         f"tensor")
        self.entries = entries

    def raw(self, name: str) -> bytes:
        e = self.entries[name]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + e.begin)
            data = f.read(e.end - e.begin)
        if len(data) != e.end - e.begin:  # the file shrank after the header was read
            raise CorruptCheckpointError(f"{self.path}: tensor {name!r} is truncated")
        return data

    def read_into(self, name: str, out) -> None:
        """Read one tensor's bytes into ``out``, a writable buffer of exactly its size (a numpy array, a
        ``memoryview``), with plain file reads: no memory map, so reading a large checkpoint piece by piece keeps
        only the pieces in memory."""
        e = self.entries[name]
        view = memoryview(out).cast("B")
        if view.nbytes != e.end - e.begin:
            raise ValueError(f"read_into {name!r}: the buffer holds {view.nbytes} bytes, the tensor {e.end - e.begin}")
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.data_start + e.begin)
            done = 0
            while done < view.nbytes:
                n = f.readinto(view[done:])
                if not n:  # the file shrank after the header was read
                    raise CorruptCheckpointError(f"{self.path}: tensor {name!r} is truncated")
                done += n

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self) -> list[str]:
        return list(self.entries)

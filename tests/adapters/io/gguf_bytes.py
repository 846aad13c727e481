"""A GGUF file as editable parts (the GGUF loading gate's tests and fuzz target): ``Parts.of(path)`` splits a valid
file into its metadata entries (key, value type, the value's stored bytes), its tensor records (name, ggml dims,
type id, offset into the data region) and the data region; ``Parts.bytes()`` writes them back, byte for byte the
same file when nothing was edited. Edits are plain list edits, so a test can write what no writer would (a key
twice, a count of another type, a tensor's offset into another's data)."""

import dataclasses
import struct

from qcore.formats import gguf as G


def value_bytes(vtype: int, v) -> bytes:
    """The stored bytes of a scalar or string metadata value of GGUF value type ``vtype``."""
    if vtype == 8:
        b = v.encode() if isinstance(v, str) else bytes(v)
        return struct.pack("<Q", len(b)) + b
    return struct.pack({0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
                        11: "<q", 12: "<d"}[vtype], v)


@dataclasses.dataclass
class Parts:
    version: int
    kvs: list  # [key (str or bytes), value type, stored bytes]
    tensors: list  # [name (str or bytes), ggml dims, type id, offset in the data region]
    data: bytes
    alignment: int = 32
    tensor_count: int = None  # the header's counts; None: len(tensors) / len(kvs)
    kv_count: int = None

    @classmethod
    def of(cls, path) -> "Parts":
        h = G.read_header(path)
        raw = open(path, "rb").read()
        kvs = [[k, f.type, f.raw] for k, f in h.fields.items()]
        ts = [[t.name, list(t.dims), t.type_id, t.begin - h.data_start] for t in h.tensors]
        return cls(h.version, kvs, ts, raw[h.data_start:], h.alignment)

    def key(self, key: str) -> int:
        return next(i for i, kv in enumerate(self.kvs) if kv[0] == key)

    def tensor(self, name: str) -> int:
        return next(i for i, t in enumerate(self.tensors) if t[0] == name)

    def drop(self, name: str) -> "Parts":
        """The tensor ``name`` taken out with its data (the later tensors' offsets moved down): a well-formed
        file that lacks the tensor."""
        i = self.tensor(name)
        off = self.tensors[i][3]
        end = min([t[3] for t in self.tensors if t[3] > off] + [len(self.data)])
        self.data = self.data[:off] + self.data[end:]
        del self.tensors[i]
        for t in self.tensors:
            if t[3] > off:
                t[3] -= end - off
        return self

    def bytes(self) -> bytes:
        out = bytearray(b"GGUF" + struct.pack("<IQQ", self.version,
                                              len(self.tensors) if self.tensor_count is None else self.tensor_count,
                                              len(self.kvs) if self.kv_count is None else self.kv_count))
        for key, vtype, raw in self.kvs:
            k = key.encode() if isinstance(key, str) else key
            out += struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + raw
        for name, dims, tid, off in self.tensors:
            n = name.encode() if isinstance(name, str) else name
            out += struct.pack("<Q", len(n)) + n + struct.pack("<I", len(dims))
            out += struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", tid, off)
        out += b"\0" * (-len(out) % self.alignment)
        return bytes(out) + self.data

    def write(self, path):
        path.write_bytes(self.bytes())
        return path

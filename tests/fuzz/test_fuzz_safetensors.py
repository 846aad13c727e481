"""Fuzzing qcore's safetensors reader (``qcore.formats.safetensors_io.SafetensorsFile``) with mutations of a real
export's model.safetensors: header JSON edits (dtypes, shapes, data_offsets, __metadata__, entries added, removed
or written twice, NaN tokens, deep nesting), the 8-byte header length, byte flips anywhere, truncation and
appended bytes. A file qcore accepts must be one the safetensors library reads with the same names, dtypes,
shapes, bytes and metadata; anything else is a one-line CorruptCheckpointError naming the file (and the tensor
or field the edit touched)."""

import json
import pathlib
import shutil
import struct
import tempfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")

from fuzz_kit import Bytes, attempt, byte_edit, check_refusal, counts, fuzz, json_edit, record  # noqa: E402

from qcore.formats.safetensors_io import SafetensorsFile  # noqa: E402

_TORCH_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
             torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
             torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.float8_e8m0fnu: "F8_E8M0"}


def _split(data: bytes):
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join(header_text: str, body: bytes) -> bytes:
    h = header_text.encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + body


def qcore_view(path):
    f = SafetensorsFile(path)
    return {k: (e.dtype, tuple(e.shape), f.raw(k)) for k, e in f.entries.items()}, dict(f.metadata)


def library_view(path):
    out = {}
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        for k in f.keys():
            t = f.get_tensor(k)
            out[k] = (_TORCH_ST[t.dtype], tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy()
                      .tobytes() if t.numel() else b"")
    return out, dict(meta)


def library_reads(path) -> bool:
    try:
        library_view(path)
        return True
    except Exception:  # the library's SafetensorError and friends
        return False


@st.composite
def mutated(draw, data: bytes):
    """A ``Bytes`` case: a header JSON edit, a header-length edit or a byte edit (in the header or anywhere)."""
    head, body = _split(data)
    (n,) = struct.unpack("<Q", data[:8])
    kind = draw(st.sampled_from(["json", "json", "json", "json", "length", "bytes_header", "bytes"]))
    if kind == "json":
        e = draw(json_edit(head, vocabulary=["F32", "F16", "BF16", "I8", "U8", "I32", "I64", "F8_E4M3", "BOOL",
                                             "F8_E8M0", "Q4_0", "f32", "__metadata__"]))
        # an edit that leaves no JSON (cut short, NaN tokens, nesting) or removes a whole entry names no field
        named = e.strict and not (e.op == "delete" and len(e.path) == 1)
        return Bytes(_join(e.text, body), f"header {e.op} at {list(e.path)}: {e.value}", e.fields if named else ())
    if kind == "length":
        v = draw(st.sampled_from([0, 1, 7, n - 8, n - 1, n + 1, n + 8, len(data) - 8, len(data), 2 ** 63,
                                  2 ** 64 - 1, 100_000_001]))
        return Bytes(struct.pack("<Q", max(0, v)) + data[8:], f"header length {n} -> {v}")
    if kind == "bytes_header":
        return draw(byte_edit(data, lo=0, hi=8 + n))
    return draw(byte_edit(data))


def _check(path: pathlib.Path, fields) -> str:
    out = attempt(lambda: qcore_view(path), watch=[path.parent], size=path.stat().st_size)
    record("safetensors file", out)
    if out.ok:
        assert library_reads(path), "qcore read a file the safetensors library refuses"
        assert out.value == library_view(path), "qcore read other tensors than the safetensors library"
        return "accepted"
    check_refusal(out.error, files=[str(path)], fields=fields or ())
    return "refused"


@pytest.mark.parametrize("n", counts(60, 1000))
def test_fuzz_safetensors_file(quark_int8, n):
    src = (quark_int8 / "model.safetensors").read_bytes()
    assert qcore_view(quark_int8 / "model.safetensors") == library_view(quark_int8 / "model.safetensors")

    @fuzz(n)
    @given(mutated(src))
    def run(case):
        with tempfile.TemporaryDirectory() as tmp:
            p = pathlib.Path(tmp) / "model.safetensors"
            p.write_bytes(case.data)
            _check(p, case.fields)

    run()


def test_unchanged_file_reads_as_the_library_does(quark_int8, tmp_path):
    shutil.copy(quark_int8 / "model.safetensors", tmp_path / "model.safetensors")
    assert _check(tmp_path / "model.safetensors", ()) == "accepted"

"""Regression tests of the safetensors header reader (qcore.formats.safetensors_io.SafetensorsFile): the minimal
inputs tests/fuzz/test_fuzz_safetensors.py found (or that its oracle, the safetensors library, refuses), each
refused with one CorruptCheckpointError naming the file and the field instead of a traceback or a silent
acceptance."""

import json
import struct

import pytest

from qcore.formats.safetensors_io import CorruptCheckpointError, SafetensorsFile

_ENTRY = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}


def _file(tmp_path, header_text: str, body: bytes = b"\0" * 4):
    h = header_text.encode()
    h += b" " * (-len(h) % 8)
    p = tmp_path / "model.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h + body)
    return p


def test_a_plain_file_reads(tmp_path):
    f = SafetensorsFile(_file(tmp_path, json.dumps({"a": _ENTRY, "__metadata__": {"format": "pt"}})))
    assert f.metadata == {"format": "pt"} and f.entries["a"].shape == (1,) and f.raw("a") == b"\0" * 4


@pytest.mark.parametrize("text,match", [
    # nesting past Python's recursion limit: was a RecursionError
    ('{"__metadata__": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests too deeply"),
    # __metadata__ of the wrong type: false was read as no metadata, true raised "'bool' object is not iterable"
    ('{"__metadata__": false, "a": %s}' % json.dumps(_ENTRY), "__metadata__ must map strings to strings"),
    ('{"__metadata__": true, "a": %s}' % json.dumps(_ENTRY), "__metadata__ must map strings to strings"),
    ('{"__metadata__": [["k", "v"]], "a": %s}' % json.dumps(_ENTRY), "__metadata__ must map strings to strings"),
    ('{"__metadata__": {"k": 1}, "a": %s}' % json.dumps(_ENTRY), "__metadata__ must map strings to strings"),
    # a dtype that is not a string: was "unhashable type: 'list'"
    ('{"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}', "tensor 'a' has unknown dtype"),
    # booleans are not sizes (true was read as 1)
    ('{"a": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}', "tensor 'a' has a malformed shape"),
    ('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [false, 4]}}', "tensor 'a' has malformed data_offsets"),
    ('{"a": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}', "tensor 'a' has a malformed shape"),
    ('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}', "tensor 'a' has malformed data_offsets"),
    # what serde_json (the reference reader) refuses: a key twice in one object, NaN / Infinity tokens
    ('{"a": {"dtype": "F32", "dtype": "I32", "shape": [1], "data_offsets": [0, 4]}}', "key 'dtype' twice"),
    ('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": NaN}}', "not valid JSON"),
    ('{"a": {"dtype": "F32", "shape": [1]}}', "tensor 'a' has a malformed header entry"),
])
def test_malformed_headers_are_one_error_naming_file_and_field(tmp_path, text, match):
    p = _file(tmp_path, text)
    with pytest.raises(CorruptCheckpointError, match=match) as e:
        SafetensorsFile(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)

"""Fuzzing qcore's ONNX reader (``qcore.formats.inspect.inspect_onnx``, behind ``qcore inspect model.onnx``) with
mutations of real exports (the tiny Llama with int4 weights in groups of 32, as QDQ DequantizeLinear and as
com.microsoft MatMulNBits): protobuf edits (an initializer's dims, data type, raw data; a node's attributes
block_size / axis / K / N / bits set to zero, negative, huge or the wrong type, or removed; a node's inputs
dropped or renamed; its op type) and byte flips, truncation and appended bytes of the serialized file.

A file qcore reads must be described as the onnx package's own parse gives it (``expected_inspection``: every
initializer's dtype and shape, each quantized weight's form, element count and bytes), with bits per weight
finite and positive; anything else is a one-line ValueError naming the file (and the initializer, node or
attribute the edit touched). ``qcore inspect`` never runs the model, so no logits are compared; the export
tests (tests/adapters/io/test_export_onnx.py) compare onnxruntime's logits with qcore's."""

import math
import pathlib
import tempfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

onnx = pytest.importorskip("onnx")
pytest.importorskip("torch")

from fuzz_kit import Bytes, attempt, byte_edit, check_refusal, counts, fuzz, record  # noqa: E402

from qcore.formats.inspect import inspect_onnx  # noqa: E402

_BITS = {"FLOAT": 32, "FLOAT16": 16, "BFLOAT16": 16, "DOUBLE": 64, "INT64": 64, "UINT64": 64, "INT32": 32,
         "UINT32": 32, "INT16": 16, "UINT16": 16, "INT8": 8, "UINT8": 8, "BOOL": 8, "INT4": 4, "UINT4": 4,
         "FLOAT8E4M3FN": 8, "FLOAT8E4M3FNUZ": 8, "FLOAT8E5M2": 8, "FLOAT8E5M2FNUZ": 8, "FLOAT8E8M0": 8,
         "FLOAT4E2M1": 4, "INT2": 2, "UINT2": 2}  # the ONNX spec's element sizes


class Unreadable(Exception):
    pass


def expected_inspection(data: bytes) -> dict:
    """What the onnx package's parse says of the file: ``{"tensors": {name: (dtype, dims)}, "weights": {name:
    (form prefix, elements, bytes)}}``; ``Unreadable`` where the file is no model a reader could describe."""
    try:
        m = onnx.load_model_from_string(data)
    except Exception as e:  # DecodeError and friends
        raise Unreadable(f"{type(e).__name__}") from None
    inits = {}
    for t in m.graph.initializer:
        if t.name in inits:
            raise Unreadable(f"initializer {t.name!r} twice")
        if t.data_type not in onnx.TensorProto.DataType.values():
            raise Unreadable(f"data type {t.data_type}")
        name = onnx.TensorProto.DataType.Name(t.data_type)
        if any(d < 0 for d in t.dims):
            raise Unreadable(f"{t.name}: negative dims")
        inits[t.name] = (name, list(t.dims))

    def nbytes(n):
        name, dims = inits[n]
        if name not in _BITS:
            raise Unreadable(f"{n}: {name}")
        return -(-math.prod(dims) * _BITS[name] // 8)
    weights = {}
    for node in m.graph.node:
        ins = list(node.input)
        attrs = {}
        for a in node.attribute:
            if a.name in attrs:
                raise Unreadable(f"attribute {a.name} twice")
            attrs[a.name] = onnx.helper.get_attribute_value(a)
        if node.op_type == "DequantizeLinear" and ins and ins[0] in inits:
            parts = [n for n in ins[:3] if n in inits]
            weights[ins[0]] = ("qdq", math.prod(inits[ins[0]][1]), sum(nbytes(n) for n in parts))
        elif node.op_type == "MatMulNBits" and len(ins) > 1 and ins[1] in inits:
            k, n = attrs.get("K"), attrs.get("N")
            if not (isinstance(k, int) and isinstance(n, int) and k > 0 and n > 0):
                raise Unreadable(f"K {k!r}, N {n!r}")
            parts = [x for x in ins[1:4] if x in inits]
            weights[ins[1]] = ("MatMulNBits", k * n, sum(nbytes(x) for x in parts))
    for name, (_, elements, b) in weights.items():
        if elements <= 0:
            raise Unreadable(f"{name}: {elements} elements")
    return {"tensors": inits, "weights": weights}


# ----------------------------------------------------------------------------------------------- mutations


class Source:
    """A file's bytes with a short repr (hypothesis prints the strategy's arguments in failure reports)."""

    def __init__(self, name: str, data: bytes):
        self.name, self.data = name, data

    def __repr__(self) -> str:
        return f"Source({self.name}, {len(self.data)} bytes)"


@st.composite
def proto_edit(draw, source: Source):
    data = source.data
    m = onnx.load_model_from_string(data)
    g = m.graph
    kind = draw(st.sampled_from(["dims", "dtype", "raw", "attribute", "attribute", "inputs", "op", "bytes",
                                 "bytes_head"]))
    if kind == "bytes":
        return draw(byte_edit(data))
    if kind == "bytes_head":
        return draw(byte_edit(data, lo=0, hi=min(len(data), 4096)))
    q_nodes = [n for n in g.node if n.op_type in ("DequantizeLinear", "MatMulNBits")]
    if kind in ("dims", "dtype", "raw"):
        names = sorted({i for n in q_nodes for i in n.input} & {t.name for t in g.initializer})
        pick = draw(st.sampled_from(names))
        t = next(t for t in g.initializer if t.name == pick)
        if kind == "dims":
            new = draw(st.sampled_from([[], [0], [-1], [2 ** 62, 2 ** 62], list(t.dims) + [1], list(t.dims)[::-1],
                                        [d * 2 for d in t.dims], [2 ** 63 - 1]]))
            del t.dims[:]
            t.dims.extend(new)
            what = f"dims of {t.name} set to {new}"
        elif kind == "dtype":
            v = draw(st.sampled_from([0, 1, 2, 3, 6, 7, 8, 16, 17, 21, 22, 23, 25, 99, 2 ** 31 - 1]))
            t.data_type = v
            what = f"data_type of {t.name} set to {v}"
        else:
            cut = draw(st.integers(0, max(0, len(t.raw_data) - 1)))
            t.raw_data = t.raw_data[:cut]
            what = f"raw_data of {t.name} cut to {cut} bytes"
        return Bytes(m.SerializeToString(), what, (t.name,))
    node = draw(st.sampled_from(q_nodes))
    label = node.name or node.output[0]
    if kind == "attribute":
        names = [a.name for a in node.attribute] + ["K", "N", "block_size", "axis", "bits"]
        name = draw(st.sampled_from(sorted(set(names))))
        old = [a for a in node.attribute if a.name == name]
        v = draw(st.sampled_from([None, 0, -1, 1, 3, 7, 2 ** 40, 2 ** 62, 1.5, "x", [1, 2]]))
        for a in old:
            node.attribute.remove(a)
        if v is not None:
            node.attribute.append(onnx.helper.make_attribute(name, v))
        what = f"attribute {name} of {label} " + ("removed" if v is None else f"set to {v!r}")
        return Bytes(m.SerializeToString(), what, (label, name))
    if kind == "inputs":
        i = draw(st.integers(0, len(node.input) - 1))
        how = draw(st.sampled_from(["drop", "rename", "empty"]))
        if how == "drop":
            del node.input[i:]
        else:
            node.input[i] = "qcore_fuzz_missing" if how == "rename" else ""
        return Bytes(m.SerializeToString(), f"input {i} of {label}: {how}", (label,))
    old = node.op_type
    node.op_type = draw(st.sampled_from(["DequantizeLinear", "MatMulNBits", "QuantizeLinear", ""]))
    return Bytes(m.SerializeToString(), f"op_type of {label} {old} -> {node.op_type}", (label,))


# ----------------------------------------------------------------------------------------------- the target


def _check(path: pathlib.Path, case: Bytes) -> str:
    out = attempt(lambda: inspect_onnx(path), watch=[path.parent], size=path.stat().st_size)
    record("onnx inspect", out)
    if not out.ok:
        check_refusal(out.error, files=[str(path)], fields=case.fields)
        return "refused"
    got = out.value
    try:
        want = expected_inspection(path.read_bytes())
    except Unreadable as e:
        raise AssertionError(f"qcore described a file the onnx package's parse does not: {e}") from None
    assert {n: (v["dtype"], v["shape"]) for n, v in got["tensors"].items()} == want["tensors"]
    assert sorted(got["layers"]) == sorted(want["weights"]), "qcore found other quantized weights"
    for name, (form, elements, b) in want["weights"].items():
        layer = got["layers"][name]
        assert layer["form"].startswith(form) and layer["weights"] == elements and layer["bytes"] == b, name
        assert math.isfinite(layer["bits_per_weight"]) and layer["bits_per_weight"] >= 0, name
    return "accepted"


@pytest.mark.parametrize("name", ["qdq.onnx", "nbits.onnx"])
def test_unchanged_exports_inspect_as_the_onnx_parse_does(onnx_files, name, tmp_path):
    p = tmp_path / name
    p.write_bytes((onnx_files / name).read_bytes())
    assert _check(p, Bytes(p.read_bytes(), "unchanged")) == "accepted"


@pytest.mark.parametrize("n", counts(40, 600))
@pytest.mark.parametrize("name", ["qdq.onnx", "nbits.onnx"])
def test_fuzz_onnx(onnx_files, name, n):
    data = (onnx_files / name).read_bytes()

    @fuzz(n)
    @given(proto_edit(Source(name, data)))
    def run(case):
        with tempfile.TemporaryDirectory() as tmp:
            p = pathlib.Path(tmp) / name
            p.write_bytes(case.data)
            _check(p, case)

    run()

"""Fuzzing qcore's importance-matrix reader (``qcore.formats.imatrix.read_imatrix``, behind
``qcore.adapters.load_imatrix`` and ``qcore quantize --imatrix``) with mutations of real files qcore wrote for a
tiny model (imatrix.gguf and llama.cpp's legacy imatrix.dat): byte flips and sets in the header (counts, string
lengths, metadata types, tensor dimensions, types and offsets) and anywhere, truncation, appended bytes, the
ggml dimensions of a tensor, and the stored values themselves (sums of squares and counts set to inf / NaN /
negative / subnormal / huge; .dat ncall and nval).

A file qcore reads must give what an independent reader gives: gguf-py's ``GGUFReader`` for .gguf (the tensors
``NAME.in_sum2`` / ``NAME.counts``), a few lines of numpy over the documented layout for .dat; and its
quantization weights (what llama-quantize computes from them) must be finite and non-negative. Anything else is
a one-line CorruptCheckpointError naming the file (and the entry, where the change is to one entry's values)."""

import pathlib
import struct
import tempfile

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from fuzz_kit import FLOAT_VALUES, Bytes, attempt, byte_edit, check_refusal, counts, fuzz, record  # noqa: E402

from qcore.formats.imatrix import ImatrixDat, ImatrixGGUF, read_imatrix  # noqa: E402


# ----------------------------------------------------------------------------------------------- the readers


class Unreadable(Exception):
    pass


def gguf_reference(path) -> dict:
    """``{entry: (in_sum2 [n_mat, n], counts [n_mat])}`` by gguf-py."""
    try:
        r = gguf.GGUFReader(str(path))
        ts = {t.name: t for t in r.tensors}
        if "general.type" in r.fields and bytes(r.fields["general.type"].parts[-1]).decode() != "imatrix":
            raise Unreadable("general.type is not imatrix")
        for key in ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"):
            if key not in r.fields:
                raise Unreadable(f"no {key}")
        out = {}
        for name, t in ts.items():
            if name.endswith(".in_sum2"):
                k = name[:-len(".in_sum2")]
                c = np.asarray(ts[k + ".counts"].data, np.float32).reshape(-1)
                s = np.asarray(t.data, np.float32).reshape(c.size, -1)
                out[k] = (s, c)
        return out
    except Unreadable:
        raise
    except Exception as e:  # gguf-py's ValueError, KeyError, IndexError, struct and numpy errors
        raise Unreadable(f"{type(e).__name__}: {e}") from None


def dat_reference(data: bytes) -> dict:
    """``{entry: (ncall, values)}`` by the layout imatrix.cpp writes (int32 count; per entry int32 name length,
    name, int32 ncall, int32 nval, nval float32; an optional trailer)."""
    pos = 0

    def i32():
        nonlocal pos
        if pos + 4 > len(data):
            raise Unreadable("short")
        (v,) = struct.unpack_from("<i", data, pos)
        pos += 4
        return v
    out = {}
    for _ in range(max(0, i32())):
        ln = i32()
        if ln < 1 or pos + ln > len(data):
            raise Unreadable("name")
        name = data[pos:pos + ln].decode("utf-8", "strict")
        pos += ln
        ncall, nval = i32(), i32()
        if nval < 1 or pos + 4 * nval > len(data):
            raise Unreadable("values")
        out[name] = (ncall, np.frombuffer(data, "<f4", nval, pos).astype(np.float32))
        pos += 4 * nval
    return out


def check_weights(w: dict) -> None:
    for k, a in w.items():
        assert np.isfinite(a).all() and (a >= 0).all(), f"{k}: llama-quantize's weights are not finite and >= 0"


# ----------------------------------------------------------------------------------------------- mutations


def _gguf_layout(data: bytes):
    """(end of the header, [(entry, tensor name, offset of its dims, n_dims, offset of its data, n values)])."""
    with tempfile.TemporaryDirectory() as tmp:
        p = pathlib.Path(tmp) / "x.gguf"
        p.write_bytes(data)
        r = gguf.GGUFReader(str(p))
        out = []
        for t in r.tensors:
            dims_at = t.field.offset + 8 + len(t.name.encode()) + 4
            out.append((t.name.rsplit(".", 1)[0], t.name, dims_at, len(t.shape), int(t.data_offset), int(t.n_elements)))
        return r.data_offset, out


@st.composite
def gguf_case(draw, data: bytes):
    end, tensors = _gguf_layout(data)
    kind = draw(st.sampled_from(["values", "values", "dims", "header", "anywhere"]))
    if kind == "header":
        return draw(byte_edit(data, lo=0, hi=end))
    if kind == "anywhere":
        return draw(byte_edit(data))
    entry, name, dims_at, nd, data_at, n = draw(st.sampled_from(tensors))
    b = bytearray(data)
    if kind == "dims":
        i = draw(st.integers(0, nd - 1))
        v = draw(st.sampled_from([0, 1, 2, 63, 65, 2 ** 31, 2 ** 32 + 1, 2 ** 40, 2 ** 62, 2 ** 63, 2 ** 64 - 1]))
        struct.pack_into("<Q", b, dims_at + 8 * i, v)
        return Bytes(bytes(b), f"dimension {i} of {name} set to {v}", (name, entry))
    picks = [(draw(st.integers(0, n - 1)), draw(st.sampled_from(FLOAT_VALUES + [1e6, 3.0, 0.25])))
             for _ in range(draw(st.integers(1, 3)))]
    for i, v in picks:
        struct.pack_into("<f", b, data_at + 4 * i, v)
    return Bytes(bytes(b), f"{name}: values {picks} written", (entry,))


@st.composite
def dat_case(draw, data: bytes):
    ref = dat_reference(data)
    kind = draw(st.sampled_from(["values", "values", "ints", "anywhere", "anywhere"]))
    if kind == "anywhere":
        return draw(byte_edit(data))
    pos, where = 4, []
    for k, (ncall, vals) in ref.items():
        name_at = pos + 4
        pos = name_at + len(k.encode())
        where.append((k, pos, pos + 8, vals.size))  # ncall at pos, values at pos + 8
        pos += 8 + 4 * vals.size
    k, ncall_at, vals_at, nval = draw(st.sampled_from(where))
    b = bytearray(data)
    if kind == "ints":
        which = draw(st.sampled_from(["ncall", "nval", "count"]))
        v = draw(st.sampled_from([-2 ** 31, -1, 0, 1, 2, nval - 1, nval + 1, 2 ** 20, 2 ** 31 - 1]))
        at = {"ncall": ncall_at, "nval": ncall_at + 4, "count": 0}[which]
        struct.pack_into("<i", b, at, v)
        # a wrong nval desynchronizes the rest of the file: the error may be about a later entry
        return Bytes(bytes(b), f"{which} of {k} set to {v}", (k,) if which == "ncall" else ())
    picks = [(draw(st.integers(0, nval - 1)), draw(st.sampled_from(FLOAT_VALUES + [1e6, 3.0])))
             for _ in range(draw(st.integers(1, 3)))]
    for i, v in picks:
        struct.pack_into("<f", b, vals_at + 4 * i, v)
    return Bytes(bytes(b), f"{k}: values {picks} written", (k,))


# ----------------------------------------------------------------------------------------------- the targets


def _check(path: pathlib.Path, case: Bytes, target: str) -> str:
    out = attempt(lambda: read_imatrix(path), watch=[path.parent], size=path.stat().st_size)
    record(target, out)
    if not out.ok:
        check_refusal(out.error, files=[str(path)], fields=case.fields)
        return "refused"
    got = out.value
    check_weights(got.quant_weights())
    if isinstance(got, ImatrixGGUF):
        try:
            ref = gguf_reference(path)
        except Unreadable as e:
            raise AssertionError(f"qcore read a file gguf-py cannot: {e}") from None
        assert sorted(ref) == sorted(got.entries), "qcore read other entries than gguf-py"
        for k, (s, c) in ref.items():
            e = got.entries[k]
            assert e.in_sum2.tobytes() == s.tobytes() and e.counts.tobytes() == c.tobytes(), f"{k} differs"
        stats = got.stats()
        for k, s in stats.items():  # the statistics qcore's quantizer uses: the counts rounded, not wrapped
            assert (np.asarray(s.counts) == np.floor(got.entries[k].counts.astype(np.float64) + 0.5)).all(), k
    else:
        assert isinstance(got, ImatrixDat)
        try:
            ref = dat_reference(path.read_bytes())
        except (Unreadable, UnicodeDecodeError) as e:
            raise AssertionError(f"qcore read a file the layout does not describe: {e}") from None
        assert list(ref) == list(got.entries), "qcore read other entries than the layout gives"
        for k, (ncall, vals) in ref.items():
            assert got.entries[k].ncall == ncall and got.entries[k].values.tobytes() == vals.tobytes(), k
    return "accepted"


def _run(data: bytes, name: str, case: Bytes, target: str):
    with tempfile.TemporaryDirectory() as tmp:
        p = pathlib.Path(tmp) / name
        p.write_bytes(case.data)
        return _check(p, case, target)


@pytest.mark.parametrize("name", ["imatrix.gguf", "imatrix.dat"])
def test_unchanged_files_read_as_the_independent_readers_do(imatrix_files, name):
    data = (imatrix_files / name).read_bytes()
    assert _run(data, name, Bytes(data, "unchanged"), "imatrix (unchanged)") == "accepted"


@pytest.mark.parametrize("n", counts(60, 1000))
def test_fuzz_imatrix_gguf(imatrix_files, n):
    data = (imatrix_files / "imatrix.gguf").read_bytes()

    @fuzz(n)
    @given(gguf_case(data))
    def run(case):
        _run(data, "imatrix.gguf", case, "imatrix .gguf")

    run()


@pytest.mark.parametrize("n", counts(60, 1000))
def test_fuzz_imatrix_dat(imatrix_files, n):
    data = (imatrix_files / "imatrix.dat").read_bytes()

    @fuzz(n)
    @given(dat_case(data))
    def run(case):
        _run(data, "imatrix.dat", case, "imatrix .dat")

    run()



"""llama.cpp's imatrix files (src/qcore/formats/imatrix.py): round trips, gguf-py as the GGUF oracle, legacy bytes built by
hand following tools/imatrix/imatrix.cpp (save_imatrix_legacy) and tools/quantize/quantize.cpp
(load_legacy_imatrix / load_imatrix), malformed files refused."""

import struct

import numpy as np
import pytest

from qcore.algorithms.imatrix import ImatrixStats, quant_weights, update_imatrix
from qcore.formats.imatrix import (DatEntry, GGUFEntry, ImatrixDat, ImatrixGGUF, read_imatrix, write_imatrix)

gguf = pytest.importorskip("gguf")


def _stats(seed=0):
    rng = np.random.default_rng(seed)
    s = update_imatrix(ImatrixStats.empty(64), rng.normal(size=(3, 40, 64)).astype(np.float32))
    e = ImatrixStats.empty(32, experts=4)
    ids = rng.integers(0, 3, (50, 2))  # expert 3 never routed: partial data
    e = update_imatrix(e, rng.normal(size=(50, 32)), expert_ids=ids)
    return {"blk.1.ffn_down_exps.weight": e, "blk.0.attn_q.weight": s}


def test_gguf_round_trip_and_gguf_py_reads_it(tmp_path):
    st = _stats()
    g = ImatrixGGUF.from_stats(st, datasets=["wiki.train.raw"], chunk_size=32)
    p = tmp_path / "imatrix.gguf"
    write_imatrix(g, p)
    back = read_imatrix(p)
    assert isinstance(back, ImatrixGGUF) and back == g
    assert back.chunk_count == 120 // 32 and back.chunk_size == 32 and back.datasets == ("wiki.train.raw",)
    # the stats survive as float32 sums and exact counts
    for k, s in st.items():
        got = back.stats()[k]
        np.testing.assert_array_equal(got.counts, s.counts)
        np.testing.assert_array_equal(got.sums, s.sums.astype(np.float32).astype(np.float64))
    # gguf-py (an independent GGUF reader) sees llama.cpp's layout: sorted names, ggml shapes [n, n_mat] / [1, n_mat]
    # with trailing 1s dropped, float32, the three metadata keys
    r = gguf.GGUFReader(str(p))
    assert [t.name for t in r.tensors] == ["blk.0.attn_q.weight.in_sum2", "blk.0.attn_q.weight.counts",
                                           "blk.1.ffn_down_exps.weight.in_sum2", "blk.1.ffn_down_exps.weight.counts"]
    assert [list(t.shape) for t in r.tensors] == [[64], [1], [32, 4], [1, 4]]
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in r.tensors)
    np.testing.assert_array_equal(np.asarray(r.tensors[2].data).reshape(4, 32),
                                  st["blk.1.ffn_down_exps.weight"].sums.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(r.tensors[3].data).reshape(-1),
                                  st["blk.1.ffn_down_exps.weight"].counts.astype(np.float32))
    f = r.fields
    assert f["general.type"].contents() == "imatrix"
    assert f["imatrix.datasets"].contents() == ["wiki.train.raw"]
    assert f["imatrix.chunk_count"].contents() == 3 and f["imatrix.chunk_size"].contents() == 32


def test_gguf_read_what_gguf_py_writes(tmp_path):
    """A file written by gguf-py's GGUFWriter (as llama.cpp's save_imatrix lays it out, plus gguf-py's own
    general.architecture key and an in_sum tensor from the llama.cpp versions that collect it) reads back; the
    quantizer's weights are llama-quantize's: in_sum2 / counts in float32, 1 for a matrix with count 0."""
    rng = np.random.default_rng(1)
    s2 = (rng.random((3, 16)) * 5).astype(np.float32)
    s1 = rng.normal(size=(3, 16)).astype(np.float32)
    cnt = np.array([7, 0, 300], np.float32)
    p = tmp_path / "w.gguf"
    w = gguf.GGUFWriter(str(p), arch="imatrix")
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", ["a.txt", "b.txt"])
    w.add_uint32("imatrix.chunk_count", 9)
    w.add_uint32("imatrix.chunk_size", 512)
    w.add_tensor("blk.0.ffn_up_exps.weight.in_sum2", s2)
    w.add_tensor("blk.0.ffn_up_exps.weight.counts", cnt.reshape(3, 1))
    w.add_tensor("blk.0.ffn_up_exps.weight.in_sum", s1)
    w.add_tensor("output.weight.in_sum2", s2[0])
    w.add_tensor("output.weight.counts", cnt[:1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g = read_imatrix(p)
    assert g.datasets == ("a.txt", "b.txt") and g.chunk_count == 9 and g.chunk_size == 512
    e = g.entries["blk.0.ffn_up_exps.weight"]
    np.testing.assert_array_equal(e.in_sum2, s2)
    np.testing.assert_array_equal(e.in_sum, s1)
    qw = g.quant_weights()
    ref = np.empty_like(s2)
    for j in range(3):  # quantize.cpp load_imatrix, transcribed
        for i in range(16):
            ref[j, i] = np.float32(s2[j, i]) / np.float32(cnt[j]) if cnt[j] > 0 else np.float32(1)
    np.testing.assert_array_equal(qw["blk.0.ffn_up_exps.weight"], ref)
    np.testing.assert_array_equal(qw["output.weight"], ref[0])
    # in_sum survives our writer too
    assert ImatrixGGUF.from_bytes(g.to_bytes()) == g


def _legacy_bytes(entries, trailer=None):
    """save_imatrix_legacy's bytes, written out: int32 n_entries; per entry int32 len, name, int32 ncall,
    int32 nval, float32 values; then int32 m_last_chunk, int32 len, dataset."""
    b = struct.pack("<i", len(entries))
    for name, ncall, vals in entries:
        nb = name.encode()
        b += struct.pack("<i", len(nb)) + nb + struct.pack("<ii", ncall, len(vals))
        b += struct.pack(f"<{len(vals)}f", *vals)
    if trailer is not None:
        b += struct.pack("<ii", trailer[0], len(trailer[1])) + trailer[1].encode()
    return b


def test_dat_hand_built_bytes_and_writer_formula(tmp_path):
    b = _legacy_bytes([("blk.0.attn_k.weight", 3, [3.0, 6.0, 1.5]), ("blk.0.ffn_down.weight", 0, [2.0, 4.0])],
                      (5, "calib.txt"))
    d = ImatrixDat.from_bytes(b)
    assert list(d.entries) == ["blk.0.attn_k.weight", "blk.0.ffn_down.weight"]
    assert d.last_call == 5 and d.dataset == "calib.txt" and d.to_bytes() == b
    qw = d.quant_weights()  # load_legacy_imatrix: v /= ncall when ncall > 0
    np.testing.assert_array_equal(qw["blk.0.attn_k.weight"], np.float32([1.0, 2.0, 0.5]))
    np.testing.assert_array_equal(qw["blk.0.ffn_down.weight"], np.float32([2.0, 4.0]))
    # a file from before the trailer
    old = _legacy_bytes([("x.weight", 1, [1.0])])
    assert ImatrixDat.from_bytes(old).last_call is None and ImatrixDat.from_bytes(old).to_bytes() == old

    # the writer: save_imatrix_legacy's formula written plainly, element by element in float32
    st = _stats(2)
    cs = 16
    d = ImatrixDat.from_stats(st, chunk_size=cs, dataset="x.txt")
    assert list(d.entries) == sorted(st)
    for k, s in st.items():
        counts, sums = s.counts, s.sums.astype(np.float32).reshape(-1)
        ncall = (int(counts.max()) + cs - 1) // cs
        nval, nmat = sums.size, counts.size
        ref = np.empty(nval, np.float32)
        for i in range(nval):
            count, value = np.float32(counts[i // (nval // nmat)]), sums[i]
            if count == 0:
                value, count = np.float32(1), np.float32(1)
            ref[i] = (value / count) * np.float32(ncall)
        assert d.entries[k].ncall == ncall
        np.testing.assert_array_equal(d.entries[k].values, ref)
    assert d.last_call == 120 // cs
    p = tmp_path / "imatrix.dat"
    write_imatrix(d, p)
    assert read_imatrix(p) == d
    # dense weights survive the .dat round trip to float32 rounding of (mean * ncall) / ncall
    q = d.quant_weights()["blk.0.attn_q.weight"]
    np.testing.assert_allclose(q, quant_weights(st["blk.0.attn_q.weight"]), rtol=3e-7)
    # the stats llama.cpp's imatrix tool rebuilds from a .dat keep the mean
    back = d.stats(chunk_size=cs)["blk.0.attn_q.weight"]
    np.testing.assert_allclose(quant_weights(back), q, rtol=1e-7)


@pytest.mark.parametrize("cut", [3, 10, 40])
def test_dat_truncated_and_malformed(cut):
    b = _legacy_bytes([("blk.0.attn_k.weight", 3, [3.0, 6.0, 1.5])], (5, "calib.txt"))
    with pytest.raises(ValueError, match="bytes|entry"):
        ImatrixDat.from_bytes(b[:cut])


def test_dat_refusals():
    with pytest.raises(ValueError, match="entry count 0"):
        ImatrixDat.from_bytes(struct.pack("<i", 0))
    with pytest.raises(ValueError, match="nval 0"):
        ImatrixDat.from_bytes(_legacy_bytes([("a", 1, [])]))
    with pytest.raises(ValueError, match="appears twice"):
        ImatrixDat.from_bytes(_legacy_bytes([("a", 1, [1.0]), ("a", 1, [1.0])]))
    with pytest.raises(ValueError, match="non-negative"):
        ImatrixDat.from_bytes(_legacy_bytes([("a", 1, [-1.0])]))
    with pytest.raises(ValueError, match="unexpected bytes"):
        ImatrixDat.from_bytes(_legacy_bytes([("a", 1, [1.0])], (1, "d")) + b"\0")
    with pytest.raises(ValueError, match="give both or neither"):
        ImatrixDat({"a": DatEntry(1, [1.0])}, last_call=3)


def test_gguf_refusals(tmp_path):
    g = ImatrixGGUF.from_stats(_stats())
    b = g.to_bytes()
    with pytest.raises(ValueError, match="truncated|bytes"):
        ImatrixGGUF.from_bytes(b[:len(b) - 40])
    with pytest.raises(ValueError, match="no GGUF magic"):
        ImatrixGGUF.from_bytes(b"GGUX" + b[4:])
    # a tensor whose pair is missing; metadata missing; a model file
    one = ImatrixGGUF({"x.weight": GGUFEntry(np.ones((1, 32)), [4.0])}).to_bytes()
    broken = one.replace(b"x.weight.counts", b"x.weight.countz")
    with pytest.raises(ValueError, match="mismatched sums and counts for 'x.weight'"):
        ImatrixGGUF.from_bytes(broken)
    with pytest.raises(ValueError, match="missing imatrix metadata 'imatrix.chunk_size'"):
        ImatrixGGUF.from_bytes(one.replace(b"imatrix.chunk_size", b"imatrix.chunk_sizz"))
    with pytest.raises(ValueError, match="not 'imatrix'"):
        ImatrixGGUF.from_bytes(one.replace(b"\x07\x00\x00\x00\x00\x00\x00\x00imatrix", b"\x07\x00\x00\x00\x00\x00\x00\x00llamaxx", 1))
    with pytest.raises(ValueError, match="one row per count"):
        two = ImatrixGGUF({"x.weight": GGUFEntry(np.ones((2, 32)), [4.0, 1.0])}).to_bytes()
        info = b"x.weight.counts" + struct.pack("<IQQ", 2, 1, 2)
        assert info in two
        ImatrixGGUF.from_bytes(two.replace(info, b"x.weight.counts" + struct.pack("<IQQ", 2, 1, 3)))


def test_write_is_staged(tmp_path, monkeypatch):
    p = tmp_path / "m.gguf"
    g = ImatrixGGUF.from_stats(_stats())
    write_imatrix(g, p)
    before = p.read_bytes()
    with pytest.raises(FileExistsError):
        write_imatrix(g, p)
    import qcore.formats.imatrix as fi

    def boom(self, *a, **k):
        raise RuntimeError("disk full")

    real_open = open
    calls = []

    def failing_open(f, mode="r", *a, **k):  # the staged file is opened, then the write fails
        fh = real_open(f, mode, *a, **k)
        if "w" in mode:
            calls.append(f)
            fh.write = boom.__get__(fh)
        return fh

    monkeypatch.setattr(fi, "open", failing_open, raising=False)
    with pytest.raises(RuntimeError, match="disk full"):
        write_imatrix(ImatrixGGUF.from_stats(_stats(5)), p, overwrite=True)
    assert calls and p.read_bytes() == before and sorted(x.name for x in tmp_path.iterdir()) == ["m.gguf"]
    with pytest.raises(TypeError, match="ImatrixGGUF or an ImatrixDat"):
        write_imatrix({"a": 1}, tmp_path / "x.gguf")


def _llama_cpp_writer():
    """llama.cpp's own GGUF writer (libggml-base's gguf_* / ggml_* through ctypes), driven with the calls of
    tools/imatrix/imatrix.cpp save_imatrix in its order; None when libggml-base is not installed."""
    import ctypes as C

    from qcore.testing.ggml import ggml_library

    lib = ggml_library()
    if lib is None or not hasattr(lib, "gguf_write_to_file"):
        return None

    class InitParams(C.Structure):
        _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", C.c_void_p), ("no_alloc", C.c_bool)]

    lib.ggml_init.restype = C.c_void_p; lib.ggml_init.argtypes = [InitParams]
    lib.gguf_init_empty.restype = C.c_void_p
    lib.gguf_set_val_str.argtypes = [C.c_void_p, C.c_char_p, C.c_char_p]
    lib.gguf_set_arr_str.argtypes = [C.c_void_p, C.c_char_p, C.POINTER(C.c_char_p), C.c_size_t]
    lib.gguf_set_val_u32.argtypes = [C.c_void_p, C.c_char_p, C.c_uint32]
    lib.ggml_new_tensor_2d.restype = C.c_void_p; lib.ggml_new_tensor_2d.argtypes = [C.c_void_p, C.c_int, C.c_int64, C.c_int64]
    lib.ggml_set_name.restype = C.c_void_p; lib.ggml_set_name.argtypes = [C.c_void_p, C.c_char_p]
    lib.ggml_get_data.restype = C.c_void_p; lib.ggml_get_data.argtypes = [C.c_void_p]
    lib.gguf_add_tensor.argtypes = [C.c_void_p, C.c_void_p]
    lib.gguf_write_to_file.restype = C.c_bool; lib.gguf_write_to_file.argtypes = [C.c_void_p, C.c_char_p, C.c_bool]
    lib.gguf_free.argtypes = [C.c_void_p]; lib.ggml_free.argtypes = [C.c_void_p]
    lib.ggml_tensor_overhead.restype = C.c_size_t

    def write(path, entries, datasets, chunk_count, chunk_size):
        """save_imatrix's calls, in its order."""
        size = sum(2 * (lib.ggml_tensor_overhead() + 4 * a.size + 64) for a, c in entries.values()) + 4096
        ctx = lib.ggml_init(InitParams(size, None, False))
        g = lib.gguf_init_empty()
        lib.gguf_set_val_str(g, b"general.type", b"imatrix")
        arr = (C.c_char_p * len(datasets))(*[d.encode() for d in datasets])
        lib.gguf_set_arr_str(g, b"imatrix.datasets", arr, len(datasets))
        lib.gguf_set_val_u32(g, b"imatrix.chunk_count", chunk_count)
        lib.gguf_set_val_u32(g, b"imatrix.chunk_size", chunk_size)
        for name in sorted(entries):
            s, c = entries[name]
            nmat, n = s.shape
            t1 = lib.ggml_new_tensor_2d(ctx, 0, n, nmat)
            t2 = lib.ggml_new_tensor_2d(ctx, 0, 1, nmat)
            lib.ggml_set_name(t1, f"{name}.in_sum2".encode()); lib.ggml_set_name(t2, f"{name}.counts".encode())
            C.memmove(lib.ggml_get_data(t1), np.ascontiguousarray(s, np.float32).ctypes.data, 4 * s.size)
            C.memmove(lib.ggml_get_data(t2), np.ascontiguousarray(c, np.float32).ctypes.data, 4 * c.size)
            lib.gguf_add_tensor(g, t1); lib.gguf_add_tensor(g, t2)
        ok = lib.gguf_write_to_file(g, str(path).encode(), False)
        lib.gguf_free(g); lib.ggml_free(ctx)
        assert ok
    return write


def test_gguf_bytes_equal_llama_cpp_save_imatrix(tmp_path):
    """The file llama.cpp's save_imatrix writes (its gguf writer, its calls) and qcore's are the same bytes, and
    qcore reads llama.cpp's back to the same values."""
    write = _llama_cpp_writer()
    if write is None:
        pytest.skip("libggml-base (llama-cpp-python) is not installed")
    rng = np.random.default_rng(0)
    ent = {"blk.0.attn_q.weight": ((rng.random((1, 64)) * 9).astype(np.float32), np.float32([40])),
           "blk.1.ffn_up_exps.weight": (rng.random((4, 32)).astype(np.float32), np.float32([3, 0, 5, 7])),
           "blk.0.attn_k.weight": (rng.random((1, 256)).astype(np.float32), np.float32([1e6]))}
    p = tmp_path / "llama.gguf"
    write(p, ent, ["wiki.train.raw", "more.txt"], 3, 512)
    ours = ImatrixGGUF({k: GGUFEntry(s, c) for k, (s, c) in ent.items()}, ("wiki.train.raw", "more.txt"), 3, 512)
    assert p.read_bytes() == ours.to_bytes()
    assert read_imatrix(p) == ours
    # and from collected statistics
    st = _stats(4)
    g = ImatrixGGUF.from_stats(st, datasets=["c.txt"], chunk_size=64)
    write(tmp_path / "st.gguf", {k: (e.in_sum2, e.counts) for k, e in g.entries.items()}, ["c.txt"],
          g.chunk_count, 64)
    assert (tmp_path / "st.gguf").read_bytes() == g.to_bytes()

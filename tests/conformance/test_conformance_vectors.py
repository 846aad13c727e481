"""qcore.conformance: export writes what the manifest says; check finds seeded bugs and missing outputs."""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

import qcore
from qcore import conformance, packing
from qcore.testing import Op, reference

FORMATS = ["float4_e2m1fn", "float8_e4m3fn", "int4", "mxfp4", "mx6", "mxint8"]


@pytest.fixture(scope="module")
def vectors(tmp_path_factory):
    d = tmp_path_factory.mktemp("vec") / "vectors"
    m = conformance.export(d, FORMATS, modes=["nearest_even", "nearest_even_saturate", "nearest_even_nosaturate"])
    return d, m


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _outputs_from_expected(vectors_dir, out, *, kind="bin", cases=None):
    """A kernel that is exactly the oracle: copy every expected file into the outputs directory."""
    m = conformance.load_manifest(vectors_dir)
    for c in m.cases:
        if cases is not None and c["name"] not in cases:
            continue
        (out / c["name"]).mkdir(parents=True)
        for f in c["files"]:
            if f["role"] != "input":
                shutil.copy(vectors_dir / f[kind], out / c["name"])
    return out


def test_cases_and_modes(vectors):
    _, m = vectors
    names = m.case_names
    assert m.formats == FORMATS
    for mode in conformance.BLOCK_MODES:  # OCP MX formats get all four scale rules
        assert f"mxfp4.quantize.{mode}" in names and f"mxint8.quantize.{mode}" in names
    assert [n for n in names if n.startswith("mx6.")] == ["mx6.quantize.scale_floor"]
    assert {n for n in names if n.startswith("float8_e4m3fn.")} == {
        "float8_e4m3fn.cast.nearest_even", "float8_e4m3fn.cast.nearest_even_saturate",
        "float8_e4m3fn.cast.nearest_even_nosaturate"}
    # fp4 and int4 always saturate: the nosaturate mode is skipped, and the manifest says why
    assert "float4_e2m1fn.cast.nearest_even_nosaturate" not in names
    skipped = {(s["format"], s["mode"]) for s in m.data["skipped"]}
    assert ("float4_e2m1fn", "nearest_even_nosaturate") in skipped and ("int4", "nearest_even_nosaturate") in skipped


def test_files_dtypes_shapes_and_sha256(vectors):
    d, m = vectors
    data = json.loads((d / "manifest.json").read_text())
    assert data["qcore_version"] == qcore.__version__ and data["schema"] == conformance.SCHEMA
    roles_cast = ["input", "expected_cast", "expected_codes", "expected_packed"]
    roles_q = ["input", "expected_codes", "expected_packed", "expected_scales", "expected_scale_codes",
               "expected_dequantized"]
    dtypes = {"input": "float32", "expected_cast": "float32", "expected_scales": "float32",
              "expected_scale_codes": "uint8", "expected_packed": "uint8", "expected_dequantized": "float32",
              "expected_shifts": "int32"}
    n_files = 0
    for c in data["cases"]:
        roles = [f["role"] for f in c["files"]]
        if c["op"] == "cast":
            assert roles == roles_cast and c["block_size"] is None and c["blocked_axis"] is None
        else:
            want = roles_q[:-1] + (["expected_shifts"] if c["format"] == "mx6" else []) + roles_q[-1:]
            assert roles == want and c["blocked_axis"] == -1
            assert c["block_size"] == qcore.get_dtype(c["format"]).block_size
        assert "docs/numerics.md" in c["semantics"]
        for f in c["files"]:
            n_files += 1
            a = np.load(d / f["npy"], allow_pickle=False)
            assert a.dtype.name == f["dtype"] and list(a.shape) == f["shape"]
            if f["role"] in dtypes:
                assert f["dtype"] == dtypes[f["role"]], (c["name"], f["role"])
            raw = (d / f["bin"]).read_bytes()
            assert raw == a.astype(a.dtype.newbyteorder("<")).tobytes() and len(raw) == f["nbytes"]
            assert f["sha256"]["npy"] == _sha(d / f["npy"]) and f["sha256"]["bin"] == _sha(d / f["bin"])
        codes = np.load(d / c["name"] / "expected_codes.npy")
        want_codes = {"float4_e2m1fn": "uint8", "float8_e4m3fn": "uint8", "int4": "int8", "mxfp4": "uint8",
                      "mx6": "uint8", "mxint8": "int8"}[c["format"]]
        assert codes.dtype.name == want_codes
    # the TSV has one line per array, with the columns the C++ consumer reads
    lines = [ln.split("\t") for ln in (d / "manifest.tsv").read_text().splitlines() if not ln.startswith("#")]
    assert len(lines) == n_files and all(len(ln) == 9 for ln in lines)
    first = {(ln[0], ln[1]): ln for ln in lines}
    ln = first[("mxfp4.quantize.scale_floor", "expected_scale_codes")]
    shape = np.load(d / "mxfp4.quantize.scale_floor" / "expected_scale_codes.npy").shape
    assert ln[2] == "uint8" and ln[3] == "x".join(map(str, shape)) and ln[8] == "32"
    assert (d / ln[4]).is_file() and ln[4].endswith(".bin")


def test_expected_values_are_the_oracle(vectors):
    d, m = vectors
    x = m.load("float4_e2m1fn.cast.nearest_even", "input")
    assert not np.isnan(x).any()  # fp4 has no NaN code: NaN probes are dropped (and counted)
    assert m.case("float4_e2m1fn.cast.nearest_even")["dropped_nan_inputs"] > 0
    cast = m.load("float4_e2m1fn.cast.nearest_even", "expected_cast")
    assert np.array_equal(cast.view(np.uint32), qcore.cast(x, "float4_e2m1fn").view(np.uint32))
    codes = m.load("float4_e2m1fn.cast.nearest_even", "expected_codes")
    assert np.array_equal(qcore.decode(codes, "float4_e2m1fn").view(np.uint32), cast.view(np.uint32))
    assert np.array_equal(m.load("float4_e2m1fn.cast.nearest_even", "expected_packed"), packing.pack_fp4(codes))

    x8 = m.load("float8_e4m3fn.cast.nearest_even_saturate", "input")
    y8 = m.load("float8_e4m3fn.cast.nearest_even_saturate", "expected_cast")
    assert np.nanmax(np.abs(y8)) == 448 and np.isnan(x8).any()  # e4m3fn keeps NaN
    assert np.array_equal(y8, qcore.cast(x8, "float8_e4m3fn", saturate=True), equal_nan=True)

    i4 = m.load("int4.cast.nearest_even", "expected_codes")
    assert np.array_equal(m.load("int4.cast.nearest_even", "expected_packed"), packing.pack_bits(i4, 4))

    name = "mxfp4.quantize.scale_even"
    x = m.load(name, "input")
    assert x.ndim == 2 and x.shape[1] % 32  # a ragged last block
    q = qcore.quantize(x, "mxfp4", scale_mode=qcore.ScaleMode.EVEN)
    assert np.array_equal(m.load(name, "expected_codes"), q.codes)
    assert np.array_equal(m.load(name, "expected_scales"), q.scales, equal_nan=True)
    assert np.array_equal(m.load(name, "expected_scale_codes"), qcore.encode(q.scales, "float8_e8m0fnu"))
    assert np.array_equal(m.load(name, "expected_packed"), packing.pack_fp4(q.codes))
    deq = m.load(name, "expected_dequantized")
    fq = qcore.fake_quantize(x, "mxfp4", scale_mode=qcore.ScaleMode.EVEN)
    assert np.array_equal(deq.view(np.uint32), fq.view(np.uint32))

    q6 = qcore.quantize(m.load("mx6.quantize.scale_floor", "input"), "mx6")
    assert np.array_equal(m.load("mx6.quantize.scale_floor", "expected_shifts"), q6.subblock_shifts)
    # MX6's 5-bit elements are packed densely (8 codes -> 5 bytes), the same bytes Op.PACK expects
    p6 = m.load("mx6.quantize.scale_floor", "expected_packed")
    rows, cols = q6.codes.shape
    assert p6.shape == (rows, -(-cols // 8) * 5)
    assert np.array_equal(p6, packing.pack_bits(q6.codes, 5))
    assert np.array_equal(p6, reference(q6.codes, "mx6", op=Op.PACK))
    info = m.case("mx6.quantize.scale_floor")["packing"]
    assert (info["layout"], info["bits"], info["group_elements"], info["group_bytes"]) == ("bits", 5, 8, 5)
    qi = qcore.quantize(m.load("mxint8.quantize.scale_floor", "input"), "mxint8")
    assert np.array_equal(m.load("mxint8.quantize.scale_floor", "expected_packed"), qi.codes.view(np.uint8))


def test_check_passes_on_oracle_outputs(vectors, tmp_path):
    d, m = vectors
    out = _outputs_from_expected(d, tmp_path / "bin", kind="bin")
    r = conformance.check(d, out)
    assert r.ok and r.count("ok") == len(m.cases), r.format()
    assert "-> PASS" in r.format()
    # .npy outputs, and names without the "expected_" prefix, are read too
    out2 = tmp_path / "npy"
    _outputs_from_expected(d, out2, kind="npy", cases=["mxfp4.quantize.scale_floor"])
    for p in (out2 / "mxfp4.quantize.scale_floor").iterdir():
        p.rename(p.with_name(p.name.replace("expected_", "")))
    r2 = conformance.check(d, out2, cases=["mxfp4.quantize.scale_floor"])
    assert r2.ok, r2.format()


def test_check_catches_a_flipped_byte(vectors, tmp_path):
    d, m = vectors
    out = _outputs_from_expected(d, tmp_path / "out")
    name = "mxfp4.quantize.scale_floor"
    codes = m.load(name, "expected_codes")
    k = int(np.flatnonzero(codes.reshape(-1) == 3)[0])  # a code of 1.5
    p = out / name / "expected_codes.bin"
    raw = bytearray(p.read_bytes())
    raw[k] ^= 0x01  # 1.5 -> 1.0: a rounding bug
    p.write_bytes(bytes(raw))
    r = conformance.check(d, out)
    assert not r.ok
    bad = [c for c in r.cases if c.status != "ok"]
    assert [c.name for c in bad] == [name] and bad[0].status == "mismatch"
    f = {f.role: f for f in bad[0].files}["expected_codes"]
    assert f.status == "mismatch" and f.n_mismatch == 1 and f.n_total == codes.size
    ex = f.examples[0]
    idx = tuple(int(i) for i in np.unravel_index(k, codes.shape))
    assert tuple(ex["index"]) == idx and ex["expected_bits"] == "0x03" and ex["actual_bits"] == "0x02"
    assert ex["expected_value"] == "1.5" and ex["actual_value"] == "1.0"
    x = m.load(name, "input")
    assert ex["input"].startswith(str(x[idx]))
    text = r.format()
    assert "MISMATCH" in text and "1 of" in text and "-> FAIL" in text and "0x03" in text
    assert all(s["status"] == "ok" for s in r.to_dict()["cases"] if s["name"] != name)


def test_check_catches_a_flipped_scale_and_packed_byte(vectors, tmp_path):
    d, m = vectors
    name = "mxint8.quantize.scale_rceil"
    out = _outputs_from_expected(d, tmp_path / "out", cases=[name])
    for role, k in (("expected_scale_codes", 2), ("expected_packed", 40), ("expected_dequantized", 5)):
        p = out / name / f"{role}.bin"
        raw = bytearray(p.read_bytes())
        raw[k] ^= 0x80
        p.write_bytes(bytes(raw))
    r = conformance.check(d, out, cases=[name])
    files = {f.role: f for f in r.cases[0].files}
    assert [files[x].status for x in ("expected_codes", "expected_scales")] == ["ok", "ok"]
    for role in ("expected_scale_codes", "expected_packed", "expected_dequantized"):
        assert files[role].status == "mismatch" and files[role].n_mismatch == 1
    assert files["expected_scale_codes"].examples[0]["input"].startswith("x[")  # the block it scales
    assert "amax" in files["expected_scale_codes"].examples[0]["input"]


def test_missing_outputs_are_reported(vectors, tmp_path):
    d, m = vectors
    keep = ["mxfp4.quantize.scale_floor", "float4_e2m1fn.cast.nearest_even"]
    out = _outputs_from_expected(d, tmp_path / "out", cases=keep)
    (out / keep[1] / "expected_packed.bin").unlink()
    r = conformance.check(d, out)
    status = {c.name: c.status for c in r.cases}
    assert status[keep[0]] == "ok" and status[keep[1]] == "incomplete"
    assert status["mxfp4.quantize.scale_ceil"] == "missing"
    assert not r.ok and "missing" in r.format()
    assert conformance.check(d, out, allow_missing=True).ok
    assert conformance.check(d, out, cases=[keep[0]]).ok
    assert not conformance.check(d, out, formats=["fp4"]).ok  # an alias; its case is incomplete


def test_check_reports_unusable_outputs_and_changed_vectors(vectors, tmp_path):
    d, m = vectors
    name = "float8_e4m3fn.cast.nearest_even"
    out = _outputs_from_expected(d, tmp_path / "out", cases=[name])
    with open(out / name / "expected_cast.bin", "ab") as fh:
        fh.write(b"\0")  # one byte too many
    np.save(out / name / "expected_codes.npy", np.load(d / name / "expected_codes.npy").astype(np.int32))
    (out / name / "expected_codes.bin").unlink()
    r = conformance.check(d, out, cases=[name])
    files = {f.role: f for f in r.cases[0].files}
    assert files["expected_cast"].status == "error" and "bytes" in files["expected_cast"].message
    assert files["expected_codes"].status == "error" and "int32" in files["expected_codes"].message
    assert files["expected_packed"].status == "ok" and r.cases[0].status == "mismatch"
    # vectors changed after export: reported, never silently trusted
    vec = tmp_path / "vec"
    shutil.copytree(d, vec)
    a = np.load(vec / name / "expected_packed.npy")
    a[0] ^= 1
    np.save(vec / name / "expected_packed.npy", a)
    r = conformance.check(vec, out, cases=[name])
    assert {f.role: f for f in r.cases[0].files}["expected_packed"].status == "error"


def test_ulps_and_nan_options(vectors, tmp_path):
    d, m = vectors
    name = "mxfp4.quantize.scale_floor"
    out = _outputs_from_expected(d, tmp_path / "out", cases=[name])
    deq = m.load(name, "expected_dequantized").copy()
    finite = np.flatnonzero(np.isfinite(deq.reshape(-1)) & (deq.reshape(-1) > 0))
    flat = deq.reshape(-1)
    flat[finite[0]] = np.nextafter(flat[finite[0]], np.float32(np.inf))
    nan = np.flatnonzero(np.isnan(flat))
    assert nan.size
    flat.view(np.uint32)[nan] = 0x7FFFFFFF  # another NaN payload
    flat.tofile(out / name / "expected_dequantized.bin")
    assert not conformance.check(d, out, cases=[name]).ok
    assert conformance.check(d, out, cases=[name], ulps=1).ok
    assert not conformance.check(d, out, cases=[name], ulps=1, nan_equal=False).ok


def test_validation(vectors, tmp_path):
    d, _ = vectors
    with pytest.raises(ValueError, match="unknown format 'nope'.*mxfp4"):
        conformance.export(tmp_path / "a", ["mxfp4", "nope"])
    with pytest.raises(ValueError, match="unknown mode.*scale_floor"):
        conformance.export(tmp_path / "a", ["mxfp4"], modes=["scale_flor"])
    with pytest.raises(ValueError, match="always saturates"):
        conformance.export(tmp_path / "a", ["float4_e2m1fn"], modes=["nearest_even_nosaturate"])
    with pytest.raises(ValueError, match="16 bits or fewer"):
        conformance.export(tmp_path / "a", ["float32"])
    with pytest.raises(ValueError, match="formats is empty"):
        conformance.export(tmp_path / "a", [])
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match="no manifest.json"):
        conformance.check(tmp_path, tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        conformance.check(d, tmp_path / "nowhere")
    with pytest.raises(ValueError, match="not in these vectors"):
        conformance.check(d, tmp_path, formats=["mxfp8_e4m3"])
    with pytest.raises(ValueError, match="ulps"):
        conformance.check(d, tmp_path, ulps=-1)


def _leftovers(parent, name):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def test_refuses_to_overwrite_and_writes_atomically(tmp_path, monkeypatch):
    target = tmp_path / "v"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty.*overwrite"):
        conformance.export(target, ["float4_e2m1fn"])
    assert sorted(os.listdir(target)) == ["keep.txt"] and not _leftovers(tmp_path, "v")
    # a failure half-way leaves neither a half-written directory nor a damaged old one
    real = conformance._quantize_case

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(conformance, "_quantize_case", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        conformance.export(target, ["float4_e2m1fn", "mxfp4"], overwrite=True)
    assert sorted(os.listdir(target)) == ["keep.txt"] and not _leftovers(tmp_path, "v")
    with pytest.raises(RuntimeError):
        conformance.export(tmp_path / "new", ["float4_e2m1fn", "mxfp4"])
    assert not (tmp_path / "new").exists() and not _leftovers(tmp_path, "new")
    monkeypatch.setattr(conformance, "_quantize_case", real)
    # overwrite=True replaces the directory as a whole
    m = conformance.export(target, ["float4_e2m1fn"], overwrite=True)
    assert not (target / "keep.txt").exists() and (target / "manifest.json").is_file()
    assert m.case_names == ["float4_e2m1fn.cast.nearest_even"] and not _leftovers(tmp_path, "v")
    # an existing empty directory is fine without overwrite
    (tmp_path / "empty").mkdir()
    conformance.export(tmp_path / "empty", ["int4"])
    assert (tmp_path / "empty" / "manifest.tsv").is_file()


def test_key_changes_only_the_random_probes(tmp_path):
    a = conformance.export(tmp_path / "a", ["mxfp4"], modes=["scale_floor"])
    b = conformance.export(tmp_path / "b", ["mxfp4"], modes=["scale_floor"], key=1)
    c = conformance.export(tmp_path / "c", ["mxfp4"], modes=["scale_floor"])
    sha = lambda m: [f["sha256"]["npy"] for f in m.cases[0]["files"]]  # noqa: E731
    assert sha(a) == sha(c) and sha(a) != sha(b)


def test_safetensors_when_available(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.numpy import load_file

    m = conformance.export(tmp_path / "v", ["mxfp4"], modes=["scale_floor"])
    c = m.cases[0]
    st = tmp_path / "v" / c["safetensors"]["file"]
    assert c["safetensors"]["sha256"] == _sha(st)
    tensors = load_file(str(st))
    assert np.array_equal(tensors["expected_codes"], m.load(c["name"], "expected_codes"))


def test_numpy_only(tmp_path, numpy_only):
    numpy_only(
        "import qcore.conformance as c, qcore.cli\n"
        f"m = c.export({str(tmp_path / 'v')!r}, ['mxfp4', 'float8_e4m3fn'])\n"
        f"r = c.check({str(tmp_path / 'v')!r}, {str(tmp_path)!r}, allow_missing=True)\n"
        "assert r.ok\n"
    )

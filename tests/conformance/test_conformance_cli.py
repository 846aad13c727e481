"""The qcore command line: exit codes 0 (ok), 1 (mismatches / missing outputs), 2 (usage errors)."""

import shutil
import subprocess
import sys

import pytest

from qcore import cli, conformance


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_export_and_check_exit_codes(tmp_path, capsys):
    vec, out = tmp_path / "vec", tmp_path / "out"
    rc, text, _ = run(capsys, "conformance", "export", str(vec), "--formats", "mxfp4,float8_e4m3fn",
                      "--modes", "scale_floor,nearest_even_saturate")
    assert rc == 0 and "mxfp4.quantize.scale_floor" in text and "float8_e4m3fn.cast.nearest_even_saturate" in text
    m = conformance.load_manifest(vec)
    assert m.case_names == ["mxfp4.quantize.scale_floor", "float8_e4m3fn.cast.nearest_even_saturate"]

    # a kernel that is the oracle: exit 0
    for c in m.cases:
        (out / c["name"]).mkdir(parents=True)
        for f in c["files"][1:]:
            shutil.copy(vec / f["bin"], out / c["name"])
    rc, text, _ = run(capsys, "conformance", "check", str(vec), "--outputs", str(out))
    assert rc == 0 and "-> PASS" in text

    # one flipped byte: exit 1 and the report names it
    p = out / "mxfp4.quantize.scale_floor" / "expected_scale_codes.bin"
    raw = bytearray(p.read_bytes())
    raw[0] ^= 0x01
    p.write_bytes(bytes(raw))
    rc, text, _ = run(capsys, "conformance", "check", str(vec), "--outputs", str(out))
    assert rc == 1 and "MISMATCH" in text and "expected_scale_codes: 1 of" in text
    rc, text, _ = run(capsys, "conformance", "check", str(vec), "--outputs", str(out), "--json")
    import json

    data = json.loads(text)
    assert rc == 1 and data["ok"] is False and data["counts"]["mismatch"] == 1
    rc, _, _ = run(capsys, "conformance", "check", str(vec), "--outputs", str(out), "--cases",
                   "float8_e4m3fn.cast.nearest_even_saturate")
    assert rc == 0

    # missing outputs: exit 1, or 0 with --allow-missing
    shutil.rmtree(out / "float8_e4m3fn.cast.nearest_even_saturate")
    rc, text, _ = run(capsys, "conformance", "check", str(vec), "--outputs", str(out), "--formats", "e4m3")
    assert rc == 1 and "missing" in text
    rc, _, _ = run(capsys, "conformance", "check", str(vec), "--outputs", str(out), "--formats", "e4m3",
                   "--allow-missing")
    assert rc == 0

    # refusing to overwrite is a usage error; --overwrite replaces
    rc, _, err = run(capsys, "conformance", "export", str(vec), "--formats", "mxfp4")
    assert rc == 2 and "not empty" in err and "--overwrite" in err
    assert conformance.load_manifest(vec).case_names == m.case_names
    rc, _, _ = run(capsys, "conformance", "export", str(vec), "--formats", "mxfp4", "--overwrite")
    assert rc == 0 and len(conformance.load_manifest(vec).cases) == 4


@pytest.mark.parametrize("argv, message", [
    ((), "required"),
    (("conformance",), "required"),
    (("conformance", "export", "DIR"), "--formats"),
    (("conformance", "export", "DIR", "--formats", "mxfp4,nope"), "unknown format 'nope'"),
    (("conformance", "export", "DIR", "--formats", "mxfp4", "--modes", "bogus"), "unknown mode"),
    (("conformance", "check", "VEC"), "--outputs"),
    (("conformance", "check", "VEC", "--outputs", "OUT"), "no manifest.json"),
    (("conformance", "check", "VEC", "--outputs", "OUT", "--ulps", "x"), "invalid int"),
    (("frobnicate",), "invalid choice"),
])
def test_usage_errors_exit_2(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "VEC").mkdir()
    (tmp_path / "OUT").mkdir()
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and message in err
    assert not (tmp_path / "DIR").exists()


def test_help_and_version(capsys):
    assert run(capsys, "--help")[0] == 0
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out.startswith("qcore ")
    rc, out, _ = run(capsys, "conformance", "modes", "--formats", "mxfp4,float4_e2m1fn")
    assert rc == 0 and "mxfp4: scale_floor, scale_ceil, scale_even, scale_rceil" in out


def test_python_dash_m_qcore(tmp_path):
    vec = tmp_path / "v"
    r = subprocess.run([sys.executable, "-m", "qcore", "conformance", "export", str(vec), "--formats", "int4"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "qcore", "conformance", "check", str(vec), "--outputs", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "missing" in r.stdout
    r = subprocess.run([sys.executable, "-m", "qcore", "conformance", "export", str(vec), "--formats", "int4"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "not empty" in r.stderr

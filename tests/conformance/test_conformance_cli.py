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
    assert "overwrite=True" not in err  # the command line speaks flags, not Python arguments
    with pytest.raises(conformance.DirectoryNotEmptyError, match=r"overwrite=True"):
        conformance.export(vec, "mxfp4")
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
    # a mode that fits none of the formats is an error naming the mode and the format, not silently dropped
    (("conformance", "export", "DIR", "--formats", "mxfp4", "--modes", "nearest_even"),
     "mode 'nearest_even' does not fit format(s) mxfp4"),
    (("conformance", "export", "DIR", "--formats", "float8_e4m3fn", "--modes", "nearest_even,scale_ceil"),
     "mode 'scale_ceil' does not fit format(s) float8_e4m3fn"),
    (("conformance", "export", "DIR", "--formats", "float4_e2m1fn,mxfp4", "--modes", "nearest_even_nosaturate"),
     "nearest_even_nosaturate: float4_e2m1fn always saturates"),
    # range errors name the flag
    (("conformance", "export", "DIR", "--formats", "mxfp4", "--key", "-1"), "argument --key: must be a non-negative"),
    (("conformance", "export", "DIR", "--formats", "mxfp4", "--modes", ","), "argument --modes"),
    (("conformance", "check", "VEC", "--outputs", "OUT", "--ulps", "-1"), "argument --ulps: must be a non-negative"),
    (("conformance", "check", "VEC", "--outputs", "OUT", "--max-examples", "-3"), "argument --max-examples"),
    (("frobnicate",), "invalid choice"),
])
def test_usage_errors_exit_2(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "VEC").mkdir()
    (tmp_path / "OUT").mkdir()
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and message in err
    assert "=True" not in err and "=False" not in err and "=None" not in err
    assert not (tmp_path / "DIR").exists()


def test_unfitting_mode_is_an_error_in_python_too(tmp_path):
    with pytest.raises(ValueError, match=r"mode 'scale_floor' does not fit format\(s\) float8_e4m3fn, int4"):
        conformance.export(tmp_path / "v", ["float8_e4m3fn", "int4"], modes=["nearest_even", "scale_floor"])
    assert not (tmp_path / "v").exists()
    # a mode that fits one format of the list is used there and skipped (and recorded) for the others
    m = conformance.export(tmp_path / "v", ["float8_e4m3fn", "int4", "mxfp4"],
                           modes=["nearest_even_nosaturate", "nearest_even", "scale_even"])
    assert m.case_names == ["float8_e4m3fn.cast.nearest_even_nosaturate", "float8_e4m3fn.cast.nearest_even",
                            "int4.cast.nearest_even", "mxfp4.quantize.scale_even"]
    assert [(s["format"], s["mode"]) for s in m.data["skipped"]] == [("int4", "nearest_even_nosaturate")]


def test_closed_stdout_exits_quietly(tmp_path, root):
    """``qcore conformance check ... | head``: the reader goes away; no BrokenPipeError traceback, exit 141."""
    vec = tmp_path / "v"
    conformance.export(vec, ["float4_e2m1fn"])
    p = subprocess.Popen([sys.executable, "-m", "qcore", "conformance", "check", str(vec), "--outputs",
                          str(tmp_path)], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before the command prints anything (it imports numpy first)
    err = p.stderr.read().decode()
    p.stderr.close()
    assert p.wait(timeout=120) == cli.EXIT_BROKEN_PIPE
    assert err == ""


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

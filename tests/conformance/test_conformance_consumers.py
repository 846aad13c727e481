"""The examples that consume conformance vectors: the C++ program (g++) and the Triton kernel test."""

import os
import shutil
import subprocess
import sys

import pytest

from qcore import cli, conformance


@pytest.fixture(scope="module")
def check_fp4(root, tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    exe = tmp_path_factory.mktemp("cpp") / "check_fp4"
    src = root / "examples" / "cpp_conformance" / "check_fp4.cpp"
    subprocess.run([gxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(exe), str(src)], check=True)
    return exe


def test_cpp_consumer_against_fresh_vectors(check_fp4, tmp_path, capsys):
    vec, out = tmp_path / "vectors", tmp_path / "out"
    m = conformance.export(vec, ["float4_e2m1fn", "mxfp4", "float8_e4m3fn"])
    r = subprocess.run([str(check_fp4), str(vec), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    done = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("ok ")]
    assert done == [n for n in m.case_names if not n.startswith("float8")]  # 1 fp4 cast + 4 mxfp4 scale rules
    # qcore checks the C++ outputs too (the fp8 case is not implemented in C++: checked only with --formats)
    assert cli.main(["conformance", "check", str(vec), "--outputs", str(out), "--formats", "fp4,mxfp4"]) == 0
    assert "-> PASS" in capsys.readouterr().out
    assert cli.main(["conformance", "check", str(vec), "--outputs", str(out)]) == 1  # fp8 outputs missing
    capsys.readouterr()


def test_cpp_consumer_seeded_bug_is_caught_twice(check_fp4, tmp_path, capsys):
    vec, out = tmp_path / "vectors", tmp_path / "out"
    conformance.export(vec, ["float4_e2m1fn", "mxfp4"], modes=["nearest_even", "scale_floor"])
    r = subprocess.run([str(check_fp4), "--ties-away", str(vec), str(out)], capture_output=True, text=True)
    assert r.returncode == 1 and "MISMATCH float4_e2m1fn.cast.nearest_even" in r.stdout, r.stdout
    assert cli.main(["conformance", "check", str(vec), "--outputs", str(out)]) == 1
    text = capsys.readouterr().out
    assert "MISMATCH   float4_e2m1fn.cast.nearest_even" in text and "MISMATCH   mxfp4.quantize.scale_floor" in text
    # e.g. 2.5 -> 3 instead of 2: the example shows the input and both codes
    assert "expected_codes" in text and "input " in text


def test_cpp_consumer_usage(check_fp4, tmp_path):
    assert subprocess.run([str(check_fp4)], capture_output=True).returncode == 2
    assert subprocess.run([str(check_fp4), str(tmp_path), str(tmp_path / "o")], capture_output=True).returncode == 2


def test_triton_example_under_the_interpreter(root):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(root / "examples" / "triton_kernel_test.py")],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout and "skipped" not in r.stdout

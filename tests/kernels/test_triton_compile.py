"""Every kernel compiles for NVIDIA sm_90 and AMD gfx942 (MI300) ahead of time, without a GPU: the interpreter
tests do not compile, so this is what catches code the compiler refuses (constexpr rules, shapes, types). On
NVIDIA the quantization kernels' PTX has only correctly rounded float operations (no FMA, no flush to zero, no
approximate division). tests/kernels/aot_compile.py does the work in a fresh process (no TRITON_INTERPRET)."""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")
SCRIPT = pathlib.Path(__file__).resolve().parent / "aot_compile.py"


@pytest.mark.slow
def test_kernels_compile_for_gpu_targets():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "0")
    p = subprocess.run([sys.executable, str(SCRIPT), "cuda", "hip"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    for target in ("cuda", "hip"):
        assert p.stdout.count(f"{target} ") == 13, p.stdout

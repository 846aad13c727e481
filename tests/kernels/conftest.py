"""Kernel tests: Triton's CPU interpreter when there is no GPU.

``TRITON_INTERPRET=1`` is set here, at collection, before any kernel is defined (``qcore.adapters.triton`` loads
its kernels on the first call, and Triton reads the variable when a kernel is decorated). On a machine with a
CUDA/ROCm GPU the tests run the compiled kernels on it instead. Without triton installed every test here skips.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
torch.set_num_threads(1)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _kernels_forced(monkeypatch):
    """The adapters' dispatch sees QCORE_TRITON=1 in these tests (kernels also for CPU tensors)."""
    monkeypatch.setenv("QCORE_TRITON", "1")

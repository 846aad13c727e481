import atexit
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

HERE = pathlib.Path(__file__).resolve().parent
# the float-perplexity cache (qcore.adapters.eval.ppl_cache) of every test and of the commands tests start: a
# temporary folder, never the real ~/.cache/qcore
_CACHE = tempfile.mkdtemp(prefix="qcore-test-cache-")
os.environ["QCORE_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)
# tests/qcore holds independent reference implementations (e.g. quark_reference.py) imported by tests.
sys.path.insert(0, str(HERE / "qcore"))


def _run_numpy_only(code: str) -> None:
    """Run ``code`` in a fresh interpreter (this checkout first on the path), then fail if torch or the
    adapters got imported: qcore used on numpy arrays must never pull in torch."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    check = "\nimport sys\nassert 'torch' not in sys.modules and 'qcore.adapters' not in sys.modules, 'torch imported'\n"
    subprocess.run([sys.executable, "-c", code + check], check=True, env=env)


@pytest.fixture
def numpy_only():
    """``numpy_only(code)``: run code in a fresh interpreter and fail if it imported torch."""
    return _run_numpy_only

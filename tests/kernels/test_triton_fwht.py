"""The FWHT kernel against ``qcore.algorithms.hadamard.fwht`` bit for bit (sizes 2**k and m * 2**k with a Paley
factor m), float32 / bfloat16 / float16 inputs, any axis."""

import numpy as np
import pytest

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")

from qcore.algorithms.hadamard import fwht, hadamard_factors
from qcore.testing import compare, probes_by_kind

torch = pytest.importorskip("torch")
qt = pytest.importorskip("qcore.adapters.triton")


def _rows(n: int, rows: int = 6, seed: int = 0) -> np.ndarray:
    """Rows of length n: heavy-tailed randoms over many binades, plus float32 probe values (subnormals, huge,
    signed zeros, Inf/NaN in the last rows)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, n)) * 2.0 ** rng.integers(-30, 30, (rows, n))).astype(np.float32)
    p = probes_by_kind("float8_e4m3fn")
    extra = np.concatenate([p["subnormals"], p["specials"], p["grid"]])
    extra = np.resize(extra, (2, n)).astype(np.float32)
    return np.concatenate([x, extra])


@pytest.mark.parametrize("n", [1, 2, 4, 64, 256, 12, 20, 24, 40, 28 * 4, 36 * 8])
def test_fwht_kernel_matches_core(n, device):
    assert hadamard_factors(n) is not None
    x = _rows(n)
    got = qt.fwht(torch.from_numpy(x).to(device))
    want = fwht(x)
    rep = compare(got, want)
    assert rep.ok, rep.format()
    assert compare(fwht(torch.from_numpy(x)), want).ok  # the twin itself: torch and numpy agree


def test_fwht_kernel_axis_and_low_precision_inputs(device):
    x = _rows(48, rows=4, seed=1)[:4].reshape(4, 48)
    t = torch.from_numpy(np.ascontiguousarray(x.T)).to(device)  # transform along axis 0
    assert compare(qt.fwht(t, axis=0), fwht(x.T, axis=0)).ok
    for dt in (torch.bfloat16, torch.float16):
        xt = torch.from_numpy(x).to(dt)
        assert compare(qt.fwht(xt.to(device)), fwht(xt.float())).ok


def test_fwht_kernel_refuses_sizes_without_construction(device):
    with pytest.raises(ValueError, match="92"):
        qt.fwht(torch.zeros(2, 92).to(device))

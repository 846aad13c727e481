"""The Cayley step of SpinQuant (qcore.algorithms.orthogonal): stays orthogonal, descends."""

import numpy as np
import pytest

from qcore.algorithms.hadamard import rotation
from qcore.algorithms.orthogonal import cayley_step, orthogonality_error


def _loss_and_grad(r, target):
    d = r - target
    return float((d * d).sum()), 2 * d


@pytest.mark.parametrize("n", [4, 12, 36])
def test_cayley_steps_stay_orthogonal_and_descend(n):
    rng = np.random.default_rng(n)
    target, _ = np.linalg.qr(rng.standard_normal((n, n)))
    r = rotation(n, key=1)
    first, g = _loss_and_grad(r, target)
    small, _ = _loss_and_grad(cayley_step(r, g, lr=1e-3), target)
    assert small < first  # a small step along the Riemannian gradient descends
    best = first
    for _ in range(200):
        loss, g = _loss_and_grad(r, target)
        best = min(best, loss)
        r = cayley_step(r, g, lr=0.1)
        assert orthogonality_error(r) < 1e-12
    assert best < 0.1 * first


def test_torch_and_numpy_agree_and_errors():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    r = rotation(8)
    g = rng.standard_normal((8, 8))
    a = cayley_step(r, g, lr=0.1)
    b = cayley_step(torch.from_numpy(r), torch.from_numpy(g), lr=0.1)
    np.testing.assert_allclose(b.numpy(), a, rtol=0, atol=1e-12)
    assert orthogonality_error(b) < 1e-12
    np.testing.assert_array_equal(cayley_step(r, np.zeros((8, 8)), lr=1.0), r)  # zero gradient: no move
    with pytest.raises(ValueError, match="lr must be"):
        cayley_step(r, g, lr=0)
    with pytest.raises(ValueError, match="square matrices"):
        cayley_step(r, g[:4], lr=1.0)

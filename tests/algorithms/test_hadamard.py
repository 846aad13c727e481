"""Hadamard matrices (Sylvester, Paley I/II over prime-power fields, Kronecker products), the fast transform and the
orthogonal fallback for sizes without a construction."""

import math

import numpy as np
import pytest

from qcore.algorithms.hadamard import fwht, hadamard, hadamard_factors, is_constructible, rotation

# the orders peers hard-code (QuaRot's get_hadK) that these constructions reach, and SmolLM2's sizes
KNOWN = [12, 20, 28, 36, 40, 44, 52, 60, 108, 140, 576, 1536, 64, 2 * (25 + 1), 2 * (49 + 1), 28 * 4]


def _check(n):
    h = hadamard(n)
    assert h.dtype == np.int8 and set(np.unique(h)) <= {-1, 1}
    hf = h.astype(np.float64)
    np.testing.assert_array_equal(hf @ hf.T, n * np.eye(n))


@pytest.mark.parametrize("n", KNOWN)
def test_known_orders(n):
    _check(n)


def test_every_constructible_order_up_to_512_is_hadamard():
    sizes = [n for n in [1, 2] + list(range(4, 513, 4)) if is_constructible(n)]
    assert len(sizes) > 100
    for n in sizes:
        _check(n)


def test_orders_without_a_construction_are_refused_and_get_the_fallback():
    for n in (3, 6, 9, 92, 156, 172, 292):
        if n > 2 and n % 4 == 0:
            assert not is_constructible(n)
        with pytest.raises(ValueError, match=f"no Hadamard matrix of order {n}"):
            hadamard(n)
        r = rotation(n)
        np.testing.assert_allclose(r @ r.T, np.eye(n), atol=1e-12)
    r = rotation(9, key=3)
    np.testing.assert_allclose(r.T @ r, np.eye(9), atol=1e-12)
    assert not np.array_equal(r, rotation(9)) and np.array_equal(r, rotation(9, key=3))


@pytest.mark.parametrize("n", [1, 2, 12, 36, 52, 64, 576, 1536, 4096, 11 * 1024 + 1024])
def test_fast_transform_equals_the_dense_product(n):
    x = np.random.default_rng(n).standard_normal((3, n))
    if n <= 4096:
        np.testing.assert_allclose(fwht(x), x @ hadamard(n).T.astype(np.float64) / math.sqrt(n), atol=1e-12)
    y = fwht(x)
    np.testing.assert_allclose(y @ y.T, x @ x.T, rtol=1e-10)  # orthogonal: inner products kept


def test_fast_transform_up_to_16384_and_on_any_axis():
    x = np.random.default_rng(0).standard_normal((2, 16384)).astype(np.float32)
    y = fwht(x)
    assert y.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-5)
    z = np.random.default_rng(1).standard_normal((12, 5))
    np.testing.assert_allclose(fwht(z, axis=0), np.moveaxis(fwht(z.T), -1, 0), atol=1e-12)


def test_torch_runs_the_same_transform():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(2).standard_normal((4, 576))
    a = fwht(x)
    b = fwht(torch.from_numpy(x))
    assert b.dtype == torch.float64
    np.testing.assert_allclose(b.numpy(), a, atol=1e-12)


def test_factors_and_errors():
    assert hadamard_factors(576) == (36, 16, "paley2(17)")
    assert hadamard_factors(1536) == (12, 128, "paley1(11)")
    assert hadamard_factors(92) is None
    with pytest.raises(ValueError, match="positive int"):
        hadamard(0)
    with pytest.raises(TypeError, match="key"):
        rotation(4, key=1.5)
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        fwht(np.zeros((2, 4)), axis=2)
    with pytest.raises(ValueError, match="no Hadamard matrix of order 92"):
        fwht(np.zeros(92))


@pytest.mark.slow
def test_every_size_up_to_16384_gets_an_orthogonal_rotation():
    """Every multiple of 4 up to 16384 either has a construction (a Kronecker product of a dense Hadamard
    factor and a Sylvester one: the dense factors up to order 1024 are checked here in full; the fast transform
    is checked up to 16384 above) or gets the block-diagonal fallback, whose blocks are all constructible."""
    from qcore.algorithms.hadamard import _blocks, base_hadamard
    dense = set()
    missing = []
    for n in range(4, 16385, 4):
        f = hadamard_factors(n)
        if f is None:
            missing.append(n)
            assert all(is_constructible(b) for b in _blocks(n)) and sum(_blocks(n)) == n
        else:
            m, k2, _ = f
            assert m * k2 == n
            dense.add(m)
    assert missing[:3] == [92, 116, 156] and len(missing) < 2000
    for m in sorted(d for d in dense if d <= 1024):
        h = base_hadamard(m).astype(np.int64)
        assert np.array_equal(h @ h.T, m * np.eye(m, dtype=np.int64)), m

"""Block-diagonal Hadamard rotations (qcore.algorithms.hadamard.block_rotation, block_fwht): checked against a
float64 transcription of the rule (kron(I, H_b / sqrt(b)) times random column signs), built here from scratch."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from qcore.algorithms.hadamard import block_fwht, block_rotation, hadamard, random_signs, rotation


def _sylvester(b):
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    return h


def _reference(n, b, signs=None):
    """The rule, written out: block i (rows and columns i*b .. i*b + b - 1) is H_b / sqrt(b), zero elsewhere."""
    h = hadamard(b).astype(np.float64) / math.sqrt(b)
    r = np.zeros((n, n))
    for i in range(n // b):
        r[i * b:(i + 1) * b, i * b:(i + 1) * b] = h
    return r if signs is None else r * signs[None, :]


@settings(deadline=None, max_examples=25)
@given(b=st.sampled_from([1, 2, 4, 8, 12, 16, 20, 32, 64]), blocks=st.integers(1, 9),
       key=st.one_of(st.none(), st.integers(0, 2 ** 31)))
def test_block_rotation_is_the_block_diagonal_hadamard(b, blocks, key):
    n = b * blocks
    r = block_rotation(n, block=b, key=key)
    want = _reference(n, b, None if key is None else random_signs(n, key=key))
    np.testing.assert_array_equal(r, want)
    np.testing.assert_allclose(r @ r.T, np.eye(n), atol=1e-12)
    # nothing mixes across blocks
    mask = np.kron(np.eye(blocks), np.ones((b, b)))
    assert not np.any(r[mask == 0])


def test_power_of_two_blocks_are_sylvester_and_a_full_block_is_rotation():
    np.testing.assert_array_equal(block_rotation(64, block=32), np.kron(np.eye(2), _sylvester(32) / math.sqrt(32)))
    np.testing.assert_array_equal(block_rotation(576, block=576, key=5), rotation(576, key=5))


@settings(deadline=None, max_examples=20)
@given(b=st.sampled_from([2, 4, 12, 16, 32]), blocks=st.integers(1, 6), rows=st.integers(0, 5),
       axis=st.sampled_from([0, -1]))
def test_block_fwht_is_the_dense_product(b, blocks, rows, axis):
    n = b * blocks
    x = np.random.default_rng(b * 100 + blocks).standard_normal((rows, n) if axis == -1 else (n, rows))
    y = block_fwht(x, block=b, axis=axis)
    dense = x @ _reference(n, b).T if axis == -1 else (_reference(n, b) @ x)
    np.testing.assert_allclose(y, dense, rtol=1e-12, atol=1e-12)


def test_block_fwht_on_torch_and_its_adjoint():
    torch = pytest.importorskip("torch")
    n, b = 1536, 16  # SmolLM2's intermediate size, NVFP4's block
    x = torch.randn(2, 3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    r = torch.from_numpy(_reference(n, b))
    torch.testing.assert_close(block_fwht(x, block=b), x @ r.T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block_fwht(x, block=b, transpose=True), x @ r, rtol=1e-12, atol=1e-12)
    y32 = block_fwht(x.float(), block=b)
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32, (x @ r.T).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n, block, match", [
    (576, 40, "does not divide"), (96, 3, "no Hadamard matrix of order 3"), (92 * 2, 92, "order 92"),
    (64, 0, "positive int"),
])
def test_bad_blocks_are_refused(n, block, match):
    with pytest.raises(ValueError, match=match):
        block_rotation(n, block=block)
    with pytest.raises(ValueError, match=match):
        block_fwht(np.zeros((1, n)), block=block)


def test_bad_types_are_refused():
    with pytest.raises(TypeError, match="block must be a positive int"):
        block_rotation(64, block=32.0)
    with pytest.raises(TypeError, match="block must be a positive int"):
        block_rotation(64, block=True)
    with pytest.raises(TypeError, match="key must be an int"):
        block_rotation(64, block=32, key="0")
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        block_fwht(np.zeros((2, 64)), block=32, axis=2)

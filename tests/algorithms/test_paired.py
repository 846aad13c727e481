"""Paired calibration statistics (GPTAQ, Qronos): the sums against direct float64 formulas, values not
mutated, in-place sums with the same bits, merges, errors."""

from __future__ import annotations

import numpy as np
import pytest

from qcore.algorithms.paired import PairedStats, PairedSum, merge_paired, update_paired
from qcore.algorithms.gptq import HessianStats, update_hessian


def _pair(rows=300, n=16, seed=0, noise=0.05):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n)).astype(np.float32)
    xq = (x + noise * rng.standard_normal((rows, n))).astype(np.float32)
    return x, xq


def test_the_sums_are_the_papers_matrices():
    x, xq = _pair()
    st = PairedStats.empty(16)
    st = update_paired(st, x[:100].reshape(4, 25, 16), xq[:100].reshape(4, 25, 16))
    st = update_paired(st, x[100:], xq[100:])
    x64, q64 = x.astype(np.float64), xq.astype(np.float64)
    assert st.count == 300
    np.testing.assert_allclose(st.hessian, q64.T @ q64, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(st.delta, (x64 - q64).T @ q64, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(st.cross(), x64.T @ q64, rtol=1e-5, atol=1e-4)
    # element [i, j]: float input i (minus quantized input i) times quantized input j
    i, j = 3, 11
    assert st.delta[i, j] == pytest.approx(float(((x64[:, i] - q64[:, i]) * q64[:, j]).sum()), rel=1e-5)
    h, d = st.scaled()
    np.testing.assert_array_equal(h, st.hessian * (2.0 / 300))
    np.testing.assert_array_equal(d, st.delta * (2.0 / 300))


def test_the_quantized_gram_is_gptqs_hessian_bit_for_bit_and_delta_is_zero_without_a_mismatch():
    x, xq = _pair()
    st = update_paired(PairedStats.empty(16), x, xq)
    h = update_hessian(HessianStats.empty(16), xq)
    np.testing.assert_array_equal(st.hessian_stats().sum, h.sum)
    assert st.hessian_stats().count == h.count
    same = update_paired(PairedStats.empty(16), xq, xq)
    assert not np.any(same.delta)


def test_values_in_place_sums_and_merges():
    x, xq = _pair()
    a0 = PairedStats.empty(16)
    a = update_paired(a0, x[:150], xq[:150])
    assert a0.count == 0 and not np.any(a0.hessian) and not np.any(a0.delta)  # a value: unchanged
    b = update_paired(PairedStats.empty(16), x[150:], xq[150:])
    m = merge_paired(a, b)
    s = PairedSum(16)
    s.add(x[:150], xq[:150])
    s.add(x[150:], xq[150:])
    inplace = s.stats()
    seq = update_paired(a, x[150:], xq[150:])
    np.testing.assert_array_equal(inplace.hessian, seq.hessian)
    np.testing.assert_array_equal(inplace.delta, seq.delta)
    np.testing.assert_allclose(m.hessian, seq.hessian, rtol=1e-12)
    np.testing.assert_allclose(m.delta, seq.delta, rtol=1e-12, atol=1e-12)
    assert m.count == seq.count == inplace.count == 300


def test_torch_gives_the_same_statistics():
    torch = pytest.importorskip("torch")
    x, xq = _pair()
    a = update_paired(PairedStats.empty(16), x, xq)
    t = update_paired(PairedStats.empty(16, like=torch.zeros(1)), torch.from_numpy(x), torch.from_numpy(xq))
    np.testing.assert_allclose(t.hessian.numpy(), a.hessian, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(t.delta.numpy(), a.delta, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_refused():
    x, xq = _pair()
    st = PairedStats.empty(16)
    with pytest.raises(ValueError, match="same shape"):
        update_paired(st, x, xq[:10])
    with pytest.raises(ValueError, match="16 features"):
        update_paired(st, x[:, :8], xq[:, :8])
    with pytest.raises(TypeError, match="PairedStats"):
        update_paired(HessianStats.empty(16), x, xq)
    bad = x.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        update_paired(st, bad, xq)
    with pytest.raises(ValueError, match="sizes differ"):
        merge_paired(st, PairedStats.empty(8))
    with pytest.raises(ValueError, match="count == 0"):
        st.scaled()

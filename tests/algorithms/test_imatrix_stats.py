"""The importance-matrix statistic (src/qcore/algorithms/imatrix.py) against a direct transcription of llama.cpp's
IMatrixCollector::collect_imatrix (tools/imatrix/imatrix.cpp) and quantize.cpp's load_imatrix."""

import numpy as np
import pytest

from qcore.algorithms.imatrix import ImatrixStats, merge_imatrices, quant_weights, update_imatrix


def _reference_dense(batches, n):
    """collect_imatrix, MUL_MAT branch: for each row (token) of src1, values[j] += x[j] * x[j]; counts[0] +=
    ggml_nrows(src1). Plain loops, float64."""
    values, count = [0.0] * n, 0
    for x in batches:
        rows = np.asarray(x, np.float64).reshape(-1, n)
        for row in rows:
            for j in range(n):
                values[j] += float(row[j]) * float(row[j])
        count += rows.shape[0]
    return np.array(values), count


def _reference_experts(x, ids, n_as):
    """collect_imatrix, MUL_MAT_ID branch: for each expert ex, for each slot idx and token row with
    ids[row, idx] == ex: counts[ex]++, values[ex * n + j] += x[row, j]**2."""
    n = x.shape[1]
    values, counts = [0.0] * (n * n_as), [0] * n_as
    for ex in range(n_as):
        for idx in range(ids.shape[1]):
            for row in range(x.shape[0]):
                if ids[row, idx] != ex:
                    continue
                counts[ex] += 1
                for j in range(n):
                    values[ex * n + j] += float(x[row, j]) * float(x[row, j])
    return np.array(values).reshape(n_as, n), np.array(counts)


def _reference_weights(values, counts):
    """quantize.cpp load_imatrix: e[j*ne0 + i] = sums / count if count > 0 else 1 (float32)."""
    out = np.empty(values.shape, np.float32)
    for j in range(values.shape[0]):
        c = np.float32(counts[j])
        for i in range(values.shape[1]):
            out[j, i] = np.float32(values[j, i]) / c if c > 0 else np.float32(1)
    return out


def test_dense_matches_reference_and_is_pure():
    rng = np.random.default_rng(0)
    batches = [rng.normal(size=(2, 5, 24)).astype(np.float32), rng.normal(size=(7, 24)).astype(np.float32) * 3]
    s0 = ImatrixStats.empty(24)
    s = s0
    for b in batches:
        s = update_imatrix(s, b)
    assert s0.counts[0] == 0 and not s0.sums.any()  # the update returned new values
    ref, cnt = _reference_dense(batches, 24)
    np.testing.assert_allclose(s.sums[0], ref, rtol=1e-14)
    assert s.counts.tolist() == [cnt] == [17]
    np.testing.assert_array_equal(quant_weights(s), _reference_weights(s.sums, s.counts)[0])
    # merging the two halves gives the statistic of all tokens
    a = update_imatrix(ImatrixStats.empty(24), batches[0])
    b = update_imatrix(ImatrixStats.empty(24), batches[1])
    m = merge_imatrices(a, b)
    np.testing.assert_allclose(m.sums, s.sums, rtol=1e-14)
    assert m.counts.tolist() == [17]


def test_experts_match_reference():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(30, 16)).astype(np.float32)
    ids = rng.integers(0, 5, (30, 2))
    ids[:, 1] = (ids[:, 0] + 1 + rng.integers(0, 3, 30)) % 5  # top-2, distinct
    ids[ids == 4] = 3  # expert 4 never routed
    ids[:, 1] = np.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % 4, ids[:, 1])
    s = update_imatrix(ImatrixStats.empty(16, experts=5), x, expert_ids=ids)
    ref, cnt = _reference_experts(x, ids, 5)
    np.testing.assert_allclose(s.sums, ref, rtol=1e-14)
    assert s.counts.tolist() == cnt.tolist() and cnt[4] == 0 and cnt.sum() == 60
    qw = quant_weights(s)
    assert qw.shape == (5, 16) and (qw[4] == 1).all()
    np.testing.assert_array_equal(qw, _reference_weights(s.sums, s.counts))


def test_torch_equals_numpy(torch):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 9, 32)).astype(np.float32)
    ids = rng.integers(0, 4, (27, 2))
    sn = update_imatrix(ImatrixStats.empty(32), x)
    st = update_imatrix(ImatrixStats.empty(32, like=torch.zeros(1)), torch.from_numpy(x))
    assert isinstance(st.sums, torch.Tensor) and st.sums.dtype == torch.float64
    np.testing.assert_allclose(st.numpy().sums, sn.sums, rtol=1e-13)  # float64 sums in another order
    assert st.numpy().counts.tolist() == sn.counts.tolist() == [27]
    en = update_imatrix(ImatrixStats.empty(32, experts=4), x.reshape(-1, 32), expert_ids=ids)
    et = update_imatrix(ImatrixStats.empty(32, experts=4), torch.from_numpy(x.reshape(-1, 32)),
                        expert_ids=torch.from_numpy(ids))
    np.testing.assert_allclose(et.numpy().sums, en.sums, rtol=1e-13)
    assert et.numpy().counts.tolist() == en.counts.tolist()
    np.testing.assert_allclose(quant_weights(st), quant_weights(sn), rtol=1.2e-7)


def test_refusals_before_work():
    s = ImatrixStats.empty(8)
    with pytest.raises(ValueError, match="last axis of size 8"):
        update_imatrix(s, np.ones((3, 9), np.float32))
    with pytest.raises(TypeError, match="floating point"):
        update_imatrix(s, np.ones((3, 8), np.int32))
    with pytest.raises(ValueError, match="not finite"):
        update_imatrix(s, np.full((1, 8), np.inf, np.float32))
    with pytest.raises(ValueError, match="pass expert_ids"):
        update_imatrix(ImatrixStats.empty(8, experts=2), np.ones((3, 8), np.float32))
    with pytest.raises(ValueError, match=r"expert indices in \[0, 2\)"):
        update_imatrix(ImatrixStats.empty(8, experts=2), np.ones((3, 8), np.float32), expert_ids=np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="shapes differ"):
        merge_imatrices(s, ImatrixStats.empty(9))
    with pytest.raises(ValueError, match="n must be a positive int"):
        ImatrixStats.empty(0)
    with pytest.raises(TypeError, match="ImatrixStats"):
        quant_weights({"a": 1})
    # no token: llama.cpp's loader gives weights 1
    np.testing.assert_array_equal(quant_weights(s), np.ones(8, np.float32))


def test_expert_ids_shape_refused():
    s = ImatrixStats.empty(4, experts=3)
    with pytest.raises(ValueError, match="one row per token"):
        update_imatrix(s, np.ones((3, 4), np.float32), expert_ids=np.array([0, 1, 2, 0]))
    with pytest.raises(TypeError, match="integers"):
        update_imatrix(s, np.ones((3, 4), np.float32), expert_ids=np.zeros(3))
    empty = update_imatrix(s, np.ones((0, 4), np.float32), expert_ids=np.zeros((0, 2), np.int64))
    assert empty.counts.tolist() == [0, 0, 0]

"""GPTQ's Hessian preparation in place (issue 23: at most three float64 ``[n, n]`` arrays at once): the blocked
in-place symmetrization, the damping without an identity matrix and the split inverse give the whole-matrix
expressions of the landed code bit for bit, and ``gptq`` leaves a caller's Hessian untouched."""

import numpy as np
import pytest

from qcore.algorithms import gptq as G
from qcore.algorithms import gptq_core as core

torch = pytest.importorskip("torch")


def _sym_matrix(n, rng):
    h = rng.standard_normal((n, n))
    h[3, 5] = -0.0  # signed zeros and exact ties survive as the whole-matrix expression leaves them
    h[5, 3] = 0.0
    h[1, 1] = -0.0
    return h


@pytest.mark.parametrize("n,block", [(7, 1024), (37, 8), (64, 16), (6, 2)])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_symmetrize_in_place_equals_the_whole_matrix_expression(n, block, kind, monkeypatch):
    monkeypatch.setattr(core, "_SYM_BLOCK", block)
    h = _sym_matrix(n, np.random.default_rng(n))
    if kind == "torch":
        h = torch.from_numpy(h)
    want = (h + h.T) * 0.5
    got = h.clone() if kind == "torch" else h.copy()
    core.symmetrize_(got)
    a, b = (np.asarray(want), np.asarray(got))
    assert a.tobytes() == b.tobytes()  # bit for bit, signed zeros included


@pytest.mark.parametrize("s", [0.0, 0.37, 1e-300, -2.5, float("inf")])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_damped_equals_h_plus_eye_times_s(s, kind):
    h = _sym_matrix(9, np.random.default_rng(1))
    if kind == "torch":
        h = torch.from_numpy(h)
        lib, eye = core.TorchLib(torch), torch.eye(9, dtype=torch.float64)
    else:
        lib, eye = core.NumpyLib, np.eye(9)
    before = np.asarray(h).tobytes()
    with np.errstate(invalid="ignore"):
        want = h + eye * s
        got = core.damped(h, s, lib)
    assert np.asarray(want).tobytes() == np.asarray(got).tobytes()
    assert np.asarray(h).tobytes() == before  # a new array: H itself is kept for the retries


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_split_inverse_equals_inv_upper_chol(kind):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((80, 24))
    h = x.T @ x + np.eye(24)
    if kind == "torch":
        h, lib = torch.from_numpy(h), core.TorchLib(torch)
    else:
        lib = core.NumpyLib
    low = lib.cholesky_lower(h)
    want = lib.upper_chol(lib.chol_inverse(low))
    if kind == "torch":  # the landed torch expression
        ref, _ = torch.linalg.cholesky_ex(torch.cholesky_inverse(low), upper=True)
    else:  # the landed numpy expression
        li = np.linalg.inv(low)
        hinv = li.T @ li
        ref = np.linalg.cholesky((hinv + hinv.T) * 0.5).T.copy()
    assert np.asarray(want).tobytes() == np.asarray(ref).tobytes()
    assert np.asarray(lib.inv_upper_chol(low)).tobytes() == np.asarray(ref).tobytes()


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_gptq_leaves_the_callers_hessian_alone_and_matches_the_reference(act_order, kind):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((200, 64)).astype(np.float32)
    x[:, 7] = 0  # a dead input
    w = (rng.standard_normal((16, 64)) * 0.05).astype(np.float32)
    from qcore.adapters import preset
    spec = preset("w_uint4_per_group_asym", group_size=32).layer.weight.spec
    if kind == "torch":
        x, w = torch.from_numpy(x), torch.from_numpy(w)
    stats = G.update_hessian(G.HessianStats.empty(64, like=x if kind == "torch" else None), x)
    h = stats.hessian()
    h_bytes, sum_bytes = np.asarray(h).tobytes(), np.asarray(stats.sum).tobytes()
    for hess in (stats, h):
        r = G.gptq(w, hess, spec, act_order=act_order)
        ref = G._reference_gptq(w, hess, spec, act_order=act_order)
        assert np.asarray(r.weight).tobytes() == np.asarray(ref.weight).tobytes()
        assert r.loss == ref.loss and r.damp == ref.damp
    assert np.asarray(h).tobytes() == h_bytes and np.asarray(stats.sum).tobytes() == sum_bytes

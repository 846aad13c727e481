"""GPTAQ as a pure function: against a direct float64 transcription of the paper's column-by-column update (explicit
inverses, no Cholesky, no lazy batches), equal to GPTQ when the streams agree, lower asymmetric error than GPTQ,
every spec GPTQ takes, torch inputs, errors before any work."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import qcore
from qcore import PerChannel, PerGroup, make_spec
from qcore.algorithms.paired import PairedStats, update_paired
from qcore.algorithms.gptaq import gptaq
from qcore import PerBlock, PerTensor
from qcore.algorithms.gptq import gptq

SPECS = {  # every kind of scale GPTQ handles (as tests/algorithms/test_gptq.py)
    "uint4 g32 asym": make_spec("uint4", granularity=PerGroup(32, axis=1)),
    "uint4 g40 asym (ragged last group)": make_spec("uint4", granularity=PerGroup(40, axis=1)),
    "int4 per-channel": make_spec("int4", granularity=PerChannel(0)),
    "uint3 g32 asym": make_spec("uint3", granularity=PerGroup(32, axis=1)),
    "fp8 e4m3 per-tensor": make_spec("fp8_e4m3", granularity=PerTensor()),
    "fp8 e4m3 blocks 8x32": make_spec("fp8_e4m3", granularity=PerBlock((8, 32))),
    "mxfp4": make_spec("mxfp4"),
    "nvfp4 (two-level)": make_spec("nvfp4"),
    "int4 per input column": make_spec("int4", granularity=PerChannel(1)),
}


def _data(n_out=24, n=96, rows=1500, seed=0, noise=0.3):
    """A weight, float inputs X and quantized-model inputs X~ = X + correlated noise (what earlier quantized
    layers leave)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_out, n)).astype(np.float32)
    mix = rng.standard_normal((n, n)) * 0.3 + np.eye(n)
    x = (rng.standard_normal((rows, n)) @ mix * np.exp(rng.standard_normal(n) * 0.7)).astype(np.float32)
    xq = (x + noise * (rng.standard_normal((rows, n)) @ mix) * x.std(0)).astype(np.float32)
    return w, x, xq


def _stats(x, xq):
    return update_paired(PairedStats.empty(x.shape[1]), x, xq)


def _asym_err(x, xq, w, wq):
    """GPTAQ's objective: ||W X - Q X~||^2 per row and token."""
    return float(np.mean((x.astype(np.float64) @ w.T.astype(np.float64) - xq.astype(np.float64) @
                          wq.T.astype(np.float64)) ** 2))


def _paper_gptaq(w, h, dxxt, quant, alpha, damp=0.01):
    """The paper's update, column by column in float64 with explicit inverses of the remaining columns' Hessians:
    quantizing column q moves the later columns F by -(w_q - q) / [H_{q:}^-1]_qq [H_{q:}^-1]_{q,F} (GPTQ's
    optimal compensation of the rounding error) + alpha * w_q dXXT_{q,F} H_FF^-1 (the least-squares
    compensation of column q's input mismatch w_q (X_q - X~_q) by the later columns)."""
    w = w.astype(np.float64).copy()
    h = h.astype(np.float64).copy()
    n = h.shape[0]
    h += damp * np.mean(np.diag(h)) * np.eye(n)
    q = np.zeros_like(w)
    for j in range(n):
        hinv = np.linalg.inv(h[j:, j:])
        q[:, j] = quant(w[:, j], j)
        step = np.outer((w[:, j] - q[:, j]) / hinv[0, 0], hinv[0, 1:])
        if j + 1 < n:
            step -= alpha * np.outer(w[:, j], dxxt[j, j + 1:] @ np.linalg.inv(h[j + 1:, j + 1:]))
        w[:, j + 1:] -= step
        w[:, j] = q[:, j]
    return q


@pytest.mark.parametrize("block_size,alpha", [(7, 0.25), (32, 1.0), (96, 0.25)])
def test_equals_the_papers_update(block_size, alpha):
    w, x, xq = _data(n=64)
    st = _stats(x, xq)
    h, d = st.scaled()
    spec = make_spec("int4", granularity=PerChannel(0))
    s = qcore.quantize(w, spec).scales.astype(np.float64)  # per-row scales, fixed before the loop

    def quant(col, j):
        return np.clip(np.round(col / s[:, 0]), -8, 7) * s[:, 0]

    ref = _paper_gptaq(w, h, d, quant, alpha)
    r = gptaq(w, st, spec, alpha=alpha, block_size=block_size)
    codes = np.round(r.weight / s).astype(int)
    ref_codes = np.round(ref / s).astype(int)
    assert (codes == ref_codes).mean() > 0.99  # float32 loop vs float64 transcription: rare ties may flip
    assert _asym_err(x, xq, w, r.weight) == pytest.approx(_asym_err(x, xq, w, ref), rel=0.02)
    # and not GPTQ's answer: the mismatch term changes the codes
    g = gptq(w, st.hessian_stats(), spec, block_size=block_size)
    assert (np.round(g.weight / s).astype(int) != ref_codes).mean() > 0.05


@pytest.mark.parametrize("name", ["uint4 g32 asym", "mxfp4", "nvfp4 (two-level)", "fp8 e4m3 blocks 8x32"])
@pytest.mark.parametrize("act_order", [False, True])
def test_equals_gptq_bit_for_bit_when_the_streams_agree(name, act_order):
    w, x, _ = _data()
    spec = SPECS[name]
    st = _stats(x, x)  # X~ == X: dXXT == 0
    a = gptaq(w, st, spec, act_order=act_order, block_size=32)
    g = gptq(w, st.hessian_stats(), spec, act_order=act_order, block_size=32)
    np.testing.assert_array_equal(a.weight, g.weight)
    np.testing.assert_array_equal(np.asarray(a.qtensor.scales), np.asarray(g.qtensor.scales))
    assert a.damp == g.damp and a.loss == g.loss
    # alpha = 0 drops the mismatch term whatever the streams
    _, x2, xq2 = _data(seed=1)
    st2 = _stats(x2, xq2)
    np.testing.assert_array_equal(gptaq(w, st2, spec, alpha=0.0, act_order=act_order, block_size=32).weight,
                                  gptq(w, st2.hessian_stats(), spec, act_order=act_order, block_size=32).weight)


@pytest.mark.parametrize("name", list(SPECS))
def test_lower_asymmetric_error_than_gptq_on_every_spec(name):
    w, x, xq = _data(seed=2)
    st = _stats(x, xq)
    spec = SPECS[name]
    a = gptaq(w, st, spec, alpha=1.0, act_order=True)
    g = gptq(w, st.hessian_stats(), spec, act_order=True)
    assert qcore.dequantize(a.qtensor).shape == w.shape
    np.testing.assert_array_equal(qcore.dequantize(a.qtensor), a.weight)
    assert _asym_err(x, xq, w, a.weight) < _asym_err(x, xq, w, g.weight)


def test_the_result_does_not_depend_on_the_block_size():
    w, x, xq = _data(seed=3)
    st = _stats(x, xq)
    for ao in (False, True):  # scales fixed before the loop: the same values whatever the blocks
        r = [gptaq(w, st, SPECS["int4 per-channel"], block_size=b, act_order=ao).weight for b in (5, 32, 96)]
        assert (r[0] == r[1]).mean() > 0.995 and (r[1] == r[2]).mean() > 0.995
    # group scales from the current values: a last-bit change of a group's extreme moves the whole group's
    # values slightly (as GPTQ's), the objective stays
    r = [gptaq(w, st, SPECS["uint4 g32 asym"], block_size=b, act_order=True).weight for b in (5, 32, 96)]
    e = [_asym_err(x, xq, w, v) for v in r]
    assert max(e) == pytest.approx(min(e), rel=1e-5)


def test_torch_runs_the_same_algorithm():
    torch = pytest.importorskip("torch")
    w, x, xq = _data(seed=4)
    spec = make_spec("uint4", granularity=PerGroup(32, axis=1))
    st = _stats(x, xq)
    tst = update_paired(PairedStats.empty(96, like=torch.zeros(1)), torch.from_numpy(x), torch.from_numpy(xq))
    a = gptaq(w, st, spec, act_order=True)
    t = gptaq(torch.from_numpy(w), tst, spec, act_order=True)
    assert isinstance(t.weight, torch.Tensor) and isinstance(t.qtensor.scales, torch.Tensor)
    torch.testing.assert_close(qcore.dequantize(t.qtensor), t.weight, rtol=0, atol=0)
    # the statistics' float32 sums differ in the last bits, and so a group's scale may
    assert _asym_err(x, xq, w, t.weight.numpy()) == pytest.approx(_asym_err(x, xq, w, a.weight), rel=1e-4)


def test_bad_arguments_are_refused_before_any_work():
    w, x, xq = _data(n=32)
    st = _stats(x, xq)
    spec = make_spec("uint4", granularity=PerGroup(32, axis=1))
    w0 = w.copy()
    with pytest.raises(ValueError, match="alpha"):
        gptaq(w, st, spec, alpha=-1.0)
    with pytest.raises(ValueError, match="alpha"):
        gptaq(w, st, spec, alpha=float("nan"))
    with pytest.raises(TypeError, match="PairedStats"):
        gptaq(w, st.hessian_stats(), spec)
    with pytest.raises(ValueError, match=r"\[16, 16\]|\[32, 32\]"):
        gptaq(w[:, :16], st, make_spec("int4", granularity=PerChannel(0)))
    with pytest.raises(ValueError, match="count == 0"):
        gptaq(w, PairedStats.empty(32), spec)
    with pytest.raises(ValueError, match="block_size"):
        gptaq(w, st, spec, block_size=0)
    with pytest.raises(TypeError, match="act_order"):
        gptaq(w, st, spec, act_order=1)
    with pytest.raises(ValueError, match="stochastic"):
        gptaq(w, st, dataclasses.replace(spec, rounding=qcore.RoundingMode.STOCHASTIC))
    np.testing.assert_array_equal(w, w0)

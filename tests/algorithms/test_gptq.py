"""GPTQ as a pure function: against a direct transcription of the paper's algorithm, against round-to-nearest,
on every kind of weight spec, numpy and torch, damping retries, dead inputs, statistics as values, errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import qcore
from qcore import PerBlock, PerChannel, PerGroup, PerTensor, make_spec
from qcore.algorithms.gptq import HessianStats, check_gptq_spec, gptq, merge_hessians, update_hessian


def _data(n_out=24, n=96, rows=1500, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_out, n)).astype(np.float32)
    mix = rng.standard_normal((n, n)) * 0.3 + np.eye(n)  # correlated features, as real activations are
    x = (rng.standard_normal((rows, n)) @ mix * np.exp(rng.standard_normal(n) * 0.7)).astype(np.float32)
    return w, x


def _out_err(x, w, wq):
    return float(np.mean((x.astype(np.float64) @ (w.astype(np.float64) - wq.astype(np.float64)).T) ** 2))


SPECS = {
    "uint4 g32 asym": make_spec("uint4", granularity=PerGroup(32, axis=1)),
    "uint4 g40 asym (ragged last group)": make_spec("uint4", granularity=PerGroup(40, axis=1)),
    "int4 per-channel": make_spec("int4", granularity=PerChannel(0)),
    "int8 per-channel": make_spec("int8", granularity=PerChannel(0)),
    "fp8 e4m3 per-tensor": make_spec("fp8_e4m3", granularity=PerTensor()),
    "fp8 e4m3 blocks 8x32": make_spec("fp8_e4m3", granularity=PerBlock((8, 32))),
    "mxfp4": make_spec("mxfp4"),
    "nvfp4 (two-level)": make_spec("nvfp4"),
    "int4 per input column": make_spec("int4", granularity=PerChannel(1)),
}


def _paper_gptq(w, h, quant, damp=0.01):
    """Algorithm 1 of Frantar et al. (2022), written out directly in float64 without lazy batches: every column's
    error updates all later columns at once. ``quant(column, j)`` rounds column ``j``."""
    w = w.astype(np.float64).copy()
    h = h.astype(np.float64).copy()
    n = h.shape[0]
    h += damp * np.mean(np.diag(h)) * np.eye(n)
    hinv = np.linalg.cholesky(np.linalg.inv(h)).T  # upper Cholesky factor of H^-1
    q = np.zeros_like(w)
    for j in range(n):
        q[:, j] = quant(w[:, j], j)
        err = (w[:, j] - q[:, j]) / hinv[j, j]
        w[:, j:] -= np.outer(err, hinv[j, j:])
    return q


@pytest.mark.parametrize("block_size", [7, 32, 96])
def test_equals_the_papers_algorithm(block_size):
    w, x = _data()
    spec = make_spec("int4", granularity=PerChannel(0))
    h = 2 * x.astype(np.float64).T @ x.astype(np.float64) / len(x)
    s = qcore.quantize(w, spec).scales.astype(np.float64)  # per-row scales, fixed before the loop

    def quant(col, j):
        return np.clip(np.round(col / s[:, 0]), -8, 7) * s[:, 0]  # int4: half-to-even, [-8, 7]

    ref = _paper_gptq(w, h, quant)
    r = gptq(w, h, spec, block_size=block_size, act_order=False)
    codes = np.round(r.weight / s).astype(int)
    ref_codes = np.round(ref / s).astype(int)
    assert (codes == ref_codes).mean() > 0.995  # float32 loop vs float64 transcription: rare ties may flip
    assert _out_err(x, w, r.weight) == pytest.approx(_out_err(x, w, ref), rel=0.02)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("act_order", [False, True])
def test_lower_output_error_than_round_to_nearest_on_every_spec(name, act_order):
    spec = SPECS[name]
    w, x = _data(n=120 if "g40" in name else 96)
    st = update_hessian(HessianStats.empty(w.shape[1]), x)
    r = gptq(w, st, spec, act_order=act_order, block_size=32)
    rtn = np.asarray(qcore.fake_quantize(w, spec))
    assert _out_err(x, w, r.weight) < 0.97 * _out_err(x, w, rtn)
    # the result is a QTensor of the spec itself: its scales have the spec's shape (contiguous groups, no g_idx)
    # and quantizing the returned weight with them gives it back bit for bit
    assert r.qtensor.scales.shape == spec.scale_shape(w.shape)
    kw = dict(scale=r.qtensor.scales, zero_point=r.qtensor.zero_points)
    if spec.two_level:
        kw["tensor_scale"] = r.qtensor.tensor_scale
    again = qcore.quantize(r.weight, spec, **kw)
    np.testing.assert_array_equal(np.asarray(again.codes), np.asarray(r.qtensor.codes))
    np.testing.assert_array_equal(np.asarray(qcore.dequantize(again)), r.weight)


def test_static_groups_use_the_round_to_nearest_scales():
    w, x = _data()
    spec = SPECS["uint4 g32 asym"]
    r = gptq(w, update_hessian(HessianStats.empty(96), x), spec, act_order=True, static_groups=True)
    q0 = qcore.quantize(w, spec)
    np.testing.assert_array_equal(r.qtensor.scales, q0.scales)
    np.testing.assert_array_equal(r.qtensor.zero_points, q0.zero_points)
    # first-touch groups see the compensated weights: different scales, lower error on this data
    r2 = gptq(w, update_hessian(HessianStats.empty(96), x), spec, act_order=True)
    assert not np.array_equal(r2.qtensor.scales, q0.scales)


def test_numpy_and_torch_run_the_same_code():
    torch = pytest.importorskip("torch")
    w, x = _data()
    for spec in (SPECS["uint4 g32 asym"], SPECS["nvfp4 (two-level)"], SPECS["fp8 e4m3 per-tensor"]):
        a = gptq(w, update_hessian(HessianStats.empty(96), x), spec, act_order=True)
        st = update_hessian(HessianStats.empty(96, like=torch.zeros(1)), torch.from_numpy(x))
        b = gptq(torch.from_numpy(w), st, spec, act_order=True)
        assert isinstance(b.weight, torch.Tensor) and b.weight.dtype == torch.float32
        # the same algorithm; the BLAS matmuls of numpy and torch may round differently in the last bit, which
        # can flip an occasional rounding tie: nearly all codes agree
        agree = (np.asarray(a.qtensor.codes) == b.qtensor.codes.numpy()).mean()
        assert agree > 0.99, (spec.name, agree)
        assert _out_err(x, w, b.weight.numpy()) == pytest.approx(_out_err(x, w, a.weight), rel=0.02)


def test_damping_grows_until_the_hessian_factors():
    w, x = _data(rows=20)  # 20 rows, 96 features: a singular Hessian
    h = 2 * x.astype(np.float64).T @ x.astype(np.float64) / 20
    h[3, 3] = -abs(h[3, 3])  # not even positive semi-definite
    r = gptq(w, h, SPECS["uint4 g32 asym"], damp=0.0)
    assert r.damp > 0.0
    assert np.isfinite(r.weight).all()
    r1 = gptq(w, h, SPECS["uint4 g32 asym"], damp=0.01)
    assert r1.damp > 0.01


def test_dead_inputs_get_a_zero_weight_column():
    w, x = _data()
    x[:, [5, 17]] = 0.0
    r = gptq(w, update_hessian(HessianStats.empty(96), x), SPECS["int8 per-channel"])
    assert np.all(r.weight[:, [5, 17]] == 0)
    assert np.count_nonzero(r.weight[:, 6])


def test_hessian_statistics_are_values():
    _, x = _data(rows=300)
    empty = HessianStats.empty(96)
    a = update_hessian(empty, x[:100])
    b = update_hessian(a, x[100:])
    assert empty.count == 0 and not empty.sum.any()  # unchanged by the updates
    assert a.count == 100 and b.count == 300
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(b.sum, x64.T @ x64, rtol=1e-5, atol=1e-3)
    m = merge_hessians(update_hessian(empty, x[:100]), update_hessian(empty, x[100:]))
    np.testing.assert_array_equal(m.sum, b.sum)  # float64 sums of the same float32 products
    np.testing.assert_allclose(b.hessian(), 2 * b.sum / 300)
    y = x[:10].copy()
    y[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        update_hessian(empty, y)
    with pytest.raises(ValueError, match="96 features"):
        update_hessian(empty, x[:, :10])
    with pytest.raises(ValueError, match="no calibration rows"):
        empty.hessian()
    with pytest.raises(ValueError, match="positive int"):
        HessianStats.empty(0)


def test_bad_arguments_are_refused_before_any_work():
    w, x = _data()
    st = update_hessian(HessianStats.empty(96), x)
    spec = SPECS["uint4 g32 asym"]
    with pytest.raises(ValueError, match="rounds stochastically"):
        gptq(w, st, dataclasses.replace(spec, rounding=qcore.RoundingMode.STOCHASTIC))
    with pytest.raises(ValueError, match="micro-exponents"):
        gptq(w, st, make_spec("mx9"))
    with pytest.raises(ValueError, match=r"hessian must be \[96, 96\]"):
        gptq(w, np.eye(95), spec)
    with pytest.raises(ValueError, match="block_size"):
        gptq(w, st, spec, block_size=0)
    with pytest.raises(ValueError, match="damp"):
        gptq(w, st, spec, damp=-1)
    with pytest.raises(ValueError, match="2-D"):
        check_gptq_spec(spec, (4, 4, 4))
    with pytest.raises(TypeError, match="floating point"):
        gptq(w.astype(np.int32), st, spec)
    bad = w.copy()
    bad[0, 0] = np.inf
    with pytest.raises(ValueError, match="weight holds NaN or Inf"):
        gptq(bad, st, spec)
    h = st.hessian().copy()
    h[1, 2] = np.nan
    with pytest.raises(ValueError, match="hessian holds NaN"):
        gptq(w, h, spec)


def test_two_level_scale_fn_protocol_sets_the_tensor_scale():
    """Two-level specs: ``scale_fn(weight)``'s tensor scale is the loop's, every group gets
    ``scale_fn(part, tensor_scale=g)``; with an identity Hessian (no error feedback) GPTQ is four over six's RTN."""
    from qcore.stats import four_over_six
    rng = np.random.default_rng(0)
    w = (rng.standard_t(3, (16, 64)) * 0.05).astype(np.float32)
    spec = make_spec("nvfp4", axis=1)
    calls = []

    def fn(part, tensor_scale=None):
        calls.append(tensor_scale)
        return four_over_six(part, spec, tensor_scale=tensor_scale)._asdict()

    r = gptq(w, np.eye(64, dtype=np.float64), spec, scale_fn=fn, damp=1e-9, act_order=False)
    p = four_over_six(w, spec)
    assert calls[0] is None and all(float(c) == float(p.tensor_scale) for c in calls[1:]) and len(calls) == 5
    assert float(r.qtensor.tensor_scale) == float(p.tensor_scale)
    np.testing.assert_array_equal(r.qtensor.scales, p.scale)
    np.testing.assert_array_equal(r.weight, qcore.fake_quantize(w, spec, **p.kwargs()))

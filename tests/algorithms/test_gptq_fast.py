"""The fast GPTQ paths (issue 23) give the same bits as the landed ones they replace: the CPU column loop against
the kept reference loop (``_reference_gptq``) on every kind of spec, act-order on and off, static groups, numpy
and torch, scale rules from an observer; the blocked ``x^T x`` against the one product; the in-place Hessian
sum against ``update_hessian``."""

from __future__ import annotations

import numpy as np
import pytest

import qcore
from qcore import PerBlock, PerChannel, PerGroup, PerTensor, make_spec
from qcore.algorithms import gptq as G
from qcore.algorithms import gptq_core
from qcore.algorithms.gptq import HessianStats, gptq, update_hessian

torch = pytest.importorskip("torch")

SPECS = {
    "uint4 g64 asym": make_spec("uint4", granularity=PerGroup(64, axis=1)),
    "uint4 g40 asym (ragged last group)": make_spec("uint4", granularity=PerGroup(40, axis=1)),
    "int4 per-channel sym": make_spec("int4", granularity=PerChannel(0)),
    "int8 per-channel sym": make_spec("int8", granularity=PerChannel(0)),
    "fp8 e4m3 per-tensor": make_spec("fp8_e4m3", granularity=PerTensor()),
    "fp8 e4m3 blocks 8x32": make_spec("fp8_e4m3", granularity=PerBlock((8, 32))),
    "mxfp4": make_spec("mxfp4"),
    "nvfp4 (two-level)": make_spec("nvfp4"),
    "int4 per input column": make_spec("int4", granularity=PerChannel(1)),
}


def _data(n_out=24, n=136, rows=400, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_out, n)).astype(np.float32)
    mix = rng.standard_normal((n, n)) * 0.3 + np.eye(n)
    x = (rng.standard_normal((rows, n)) @ mix * np.exp(rng.standard_normal(n) * 0.7)).astype(np.float32)
    x[:, 7] = 0.0  # a dead input
    return w, x


def _same(a, b):
    assert np.array_equal(np.asarray(a.weight), np.asarray(b.weight))
    assert np.array_equal(np.asarray(a.qtensor.codes), np.asarray(b.qtensor.codes))
    assert np.array_equal(np.asarray(a.qtensor.scales), np.asarray(b.qtensor.scales))
    assert a.loss == b.loss and a.damp == b.damp


_CASES = [(name, ao, sg, "torch") for name in SPECS for ao, sg in [(False, False), (True, False), (True, True)]]
_CASES += [(name, True, False, "numpy") for name in ("uint4 g64 asym", "mxfp4", "nvfp4 (two-level)")]


@pytest.mark.parametrize("name,act_order,static_groups,kind", _CASES)
def test_fast_column_loop_has_the_reference_bits(name, act_order, static_groups, kind):
    spec = SPECS[name]
    w, x = _data()
    if kind == "torch":
        w, x = torch.from_numpy(w), torch.from_numpy(x)
    st = update_hessian(HessianStats.empty(w.shape[1], like=x if kind == "torch" else None), x)
    kw = dict(act_order=act_order, static_groups=static_groups, block_size=48)  # blocks cut through groups
    _same(gptq(w, st, spec, **kw), G._reference_gptq(w, st, spec, **kw))


@pytest.mark.parametrize("block_size", [1, 17, 128, 1000])
def test_fast_column_loop_any_block_size(block_size):
    w, x = _data(seed=3)
    w, x = torch.from_numpy(w), torch.from_numpy(x)
    st = update_hessian(HessianStats.empty(w.shape[1], like=x), x)
    spec = SPECS["uint4 g64 asym"]
    _same(gptq(w, st, spec, block_size=block_size, act_order=True),
          G._reference_gptq(w, st, spec, block_size=block_size, act_order=True))


def test_fast_column_loop_with_an_observer_scale_rule():
    w, x = _data(seed=1)
    w, x = torch.from_numpy(w), torch.from_numpy(x)
    st = update_hessian(HessianStats.empty(w.shape[1], like=x), x)
    spec = SPECS["uint4 g64 asym"]

    def mse(part):
        return qcore.stats.mse_clip(part, spec, grid=20, lo=0.5, p=2.0)._asdict()

    _same(gptq(w, st, spec, scale_fn=mse, act_order=True), G._reference_gptq(w, st, spec, scale_fn=mse, act_order=True))


def test_fast_column_loop_leaves_the_inputs_alone():
    w, x = _data(seed=2)
    w, x = torch.from_numpy(w), torch.from_numpy(x)
    w0 = w.clone()
    h = (x.T.double() @ x.double())
    h0 = h.clone()
    gptq(w, h, SPECS["mxfp4"], act_order=True)
    assert torch.equal(w, w0) and torch.equal(h, h0)


@pytest.mark.parametrize("n", [64, 511, 512, 576, 700])
def test_blocked_gram_is_the_one_product(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(300, n, generator=g) * torch.rand(n, generator=g) * 4
    want = x.T @ x
    got = gptq_core.gram(x)
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    # a GEMM's sum over its inner axis does not depend on how the output is tiled (MKL, OpenBLAS): same bits
    assert torch.equal(got, want)
    xn = x.numpy()
    assert np.array_equal(gptq_core.gram(xn), xn.T @ xn)  # numpy: the one product


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_in_place_hessian_sum_equals_update_hessian(kind):
    g = np.random.default_rng(5)
    xs = [g.standard_normal((3, 50, 600)).astype(np.float32) for _ in range(3)]
    if kind == "torch":
        xs = [torch.from_numpy(x) for x in xs]
    like = xs[0] if kind == "torch" else None
    st = HessianStats.empty(600, like=like)
    acc = gptq_core.HessianSum(600, like=like)
    for x in xs:
        st = update_hessian(st, x)
        acc.add(x)
    got = acc.stats()
    assert got.count == st.count == 450
    assert np.array_equal(np.asarray(got.sum), np.asarray(st.sum))
    # the landed accumulation: one full product per batch, widened and added into a new sum
    ref = sum(np.asarray(x.reshape(-1, 600).T @ x.reshape(-1, 600), dtype=np.float64) for x in xs)
    assert np.array_equal(np.asarray(got.sum), ref)


def test_in_place_hessian_sum_refuses_bad_rows():
    acc = gptq_core.HessianSum(8, like=torch.zeros(1))
    with pytest.raises(ValueError, match="8 features"):
        acc.add(torch.zeros(4, 9))
    bad = torch.zeros(4, 8)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        acc.add(bad)
    with pytest.raises(TypeError, match="same kind"):
        acc.add(np.zeros((4, 8), np.float32))
    assert acc.count == 0 and not acc.sum.any()  # nothing was added by the refused calls

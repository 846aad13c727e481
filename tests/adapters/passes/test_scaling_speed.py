"""Issue 23: the fast paths of AutoSmoothQuant's alpha search and of static calibration give the same bits as the
landed implementation (kept as ``_reference_auto_smoothquant`` and as calibration without the tail skip)."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from qcore import PerChannel, PerTensor, make_spec  # noqa: E402
from qcore.adapters import _calib_tail, preset, quantize_model  # noqa: E402
from qcore.algorithms import _scaling as u  # noqa: E402
from qcore.algorithms.smoothquant import SmoothLoss, SmoothRule, _reference_auto_smoothquant, auto_smoothquant  # noqa: E402,E501


def _sample(seed, t=256, n=48, outs=(32, 16), numpy=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, generator=g) * (1 + 30 * (torch.rand(n, generator=g) < 0.1))
    ws = [torch.randn(o, n, generator=g) * 0.1 for o in outs]
    if numpy:
        return x.numpy(), [w.numpy() for w in ws]
    return x, ws


def _same(a, b):
    assert a.alpha == b.alpha
    assert np.array_equal(np.asarray(a.scales), np.asarray(b.scales))
    assert a.loss == b.loss  # the winner's loss is the float64 one, bit for bit
    la, lb = dict((k, v) for k, v in a.losses), dict((k, v) for k, v in b.losses)
    assert la.keys() == lb.keys()
    for k in la:  # screened (non-finalist) losses: float32 products, within the screening margin's scale
        assert la[k] == pytest.approx(lb[k], rel=1e-5)


@pytest.mark.parametrize("wspec,ispec", [
    (make_spec("int8", granularity=PerTensor()), make_spec("int8", granularity=PerTensor())),
    (make_spec("int8", granularity=PerChannel(axis=0)), make_spec("int8", granularity=PerTensor())),
    (make_spec("fp8_e4m3", granularity=PerTensor()), make_spec("fp8_e4m3", granularity=PerTensor())),
])
@pytest.mark.parametrize("loss", [SmoothLoss.MSE, SmoothLoss.MAE])
def test_auto_smoothquant_picks_the_reference_candidate(wspec, ispec, loss):
    for seed in range(3):
        x, ws = _sample(seed)
        _same(auto_smoothquant(x, ws, weight_spec=wspec, input_spec=ispec, loss=loss),
              _reference_auto_smoothquant(x, ws, weight_spec=wspec, input_spec=ispec, loss=loss))


def test_auto_smoothquant_numpy_rules_and_options_match_the_reference():
    spec = make_spec("int8", granularity=PerTensor())
    x, ws = _sample(7, numpy=True)
    for kw in (dict(rule=SmoothRule.ACT_POWER), dict(include_identity=False), dict(max_tokens=100),
               dict(alphas=(0.3, 0.5, 0.7)), dict(act_absmax=np.abs(x).max(0) * 2)):
        _same(auto_smoothquant(x, ws, weight_spec=spec, input_spec=spec, **kw),
              _reference_auto_smoothquant(x, ws, weight_spec=spec, input_spec=spec, **kw))


def test_auto_smoothquant_without_room_for_the_reference_outputs_is_the_reference(monkeypatch):
    spec = make_spec("int8", granularity=PerTensor())
    x, ws = _sample(3)
    want = _reference_auto_smoothquant(x, ws, weight_spec=spec, input_spec=spec)
    monkeypatch.setattr(u, "CHUNK_BYTES", 1024)  # keep_ref False: the one-pass float64 search, chunked
    got = auto_smoothquant(x, ws, weight_spec=spec, input_spec=spec)
    assert got.alpha == want.alpha and got.losses == want.losses and torch.equal(got.scales, want.scales)


def test_finalists():
    assert u.finalists([3.0, 1.0, 1.00001, 2.0]) == [1, 2]
    assert u.finalists([1.0, float("nan"), 2.0]) == [0, 1, 2]  # not finite: everything in float64
    assert u.finalists([0.0, 0.0, 1e-30]) == [0, 1]


def _states(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _assert_same_states(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_autosmoothquant_on_tiny_models_equals_the_reference_search(zoo, family, monkeypatch):
    model = zoo.tiny_family(family)
    data = zoo.token_batches(3, seed=1, batch=2, seq=16)
    cfg = preset("int8").replace(algorithms=({"name": "autosmoothquant"},))
    fast = quantize_model(copy.deepcopy(model), cfg, data, progress=False)
    import qcore.adapters.passes.scaling_bind as sb
    monkeypatch.setattr(sb, "auto_smoothquant", _reference_auto_smoothquant)
    ref = quantize_model(copy.deepcopy(model), cfg, data, progress=False)
    _assert_same_states(_states(fast), _states(ref))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("name", ["int8", "w_fp8_a_fp8"])
def test_static_calibration_skips_the_output_head_with_the_same_scales(zoo, family, name, monkeypatch):
    model = zoo.tiny_family(family)
    data = zoo.token_batches(4, seed=2, batch=2, seq=16)
    fast = quantize_model(copy.deepcopy(model), preset(name), data, progress=False)
    monkeypatch.setattr(_calib_tail.TailSkip, "_hook", lambda self, mod, args, out: None)  # never cut
    ref = quantize_model(copy.deepcopy(model), preset(name), data, progress=False)
    _assert_same_states(_states(fast), _states(ref))


def test_tail_skip_cuts_later_batches_after_the_last_observed_module(zoo):
    model = zoo.tiny_family("llama")
    data = zoo.token_batches(4, seed=2, batch=2, seq=16)
    m = copy.deepcopy(model)
    calls = []
    m.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    cut = []
    orig = _calib_tail.TailSkip.__exit__

    def exit_(self, *exc):
        cut.append(self.cut)
        return orig(self, *exc)

    _calib_tail.TailSkip.__exit__ = exit_
    try:
        quantize_model(m, preset("int8"), data, progress=False)
    finally:
        _calib_tail.TailSkip.__exit__ = orig
    assert cut == [3]  # batches 1..3 cut short
    assert len(calls) == 1  # the (excluded) output head ran for the first batch only


def test_tail_skip_never_cuts_a_batch_whose_calls_diverge():
    a, b, c = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    t = _calib_tail.TailSkip([a, b, c])
    with t:
        for m in (a, b, c):
            t._hook(m, None, None)
        t.batch_done()
        t._hook(a, None, None)
        t._hook(c, None, None)  # diverged: b was expected
        t._hook(b, None, None)  # no cut even though the count is reached
        t.batch_done()
        t._hook(a, None, None)
        t._hook(b, None, None)
        with pytest.raises(_calib_tail.TailSkip.Done):
            t._hook(c, None, None)
        t.batch_done()
    assert t.cut == 1

"""Issue 23: AWQ's two-pass scale search (float32 screen, float64 finalists) chooses the same ratio, the same
scales (bits) and the same loss as the landed one-pass float64 search, kept as ``_reference_awq_search``."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qcore import PerChannel, PerGroup, make_spec  # noqa: E402
from qcore.adapters import preset, quantize_model  # noqa: E402
from qcore.adapters.passes import scaling_bind  # noqa: E402
from qcore.algorithms import _scaling as u  # noqa: E402
from qcore.algorithms import awq  # noqa: E402
from qcore.algorithms.awq import _reference_awq_search, awq_search  # noqa: E402


def _sample(seed, t=256, n=48, outs=(32, 16), numpy=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, generator=g) * (1 + 30 * (torch.rand(n, generator=g) < 0.1))
    ws = [torch.randn(o, n, generator=g) * 0.1 for o in outs]
    if numpy:
        return x.numpy(), [w.numpy() for w in ws]
    return x, ws


def _same(a, b):
    assert a.ratio == b.ratio
    assert np.array_equal(np.asarray(a.scales), np.asarray(b.scales))
    assert np.asarray(a.scales).dtype == np.asarray(b.scales).dtype
    assert a.loss == b.loss  # the winner's loss is the float64 one, bit for bit
    assert [r for r, _ in a.losses] == [r for r, _ in b.losses]
    for (_, la), (_, lb) in zip(a.losses, b.losses):  # screened losses: float32 products
        assert la == pytest.approx(lb, rel=1e-5)


SPECS = {
    "uint4_g16_asym": make_spec("uint4", granularity=PerGroup(16, axis=1), symmetric=False),
    "int4_g20_short_last_group": make_spec("int4", granularity=PerGroup(20, axis=1)),
    "int8_per_channel": make_spec("int8", granularity=PerChannel(axis=0)),
    "fp8_g16": make_spec("fp8_e4m3", granularity=PerGroup(16, axis=1)),
}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("gram", [None, True, False])
def test_awq_search_picks_the_reference_candidate(name, gram):
    for seed in range(3):
        x, ws = _sample(seed)
        _same(awq_search(x, ws, SPECS[name], gram=gram), _reference_awq_search(x, ws, SPECS[name], gram=gram))


def test_awq_search_numpy_per_weight_specs_and_grids_match_the_reference():
    x, ws = _sample(4, numpy=True)
    specs = [SPECS["uint4_g16_asym"], SPECS["int8_per_channel"]]
    for kw in (dict(), dict(grid=7), dict(grid=1), dict(gram=False)):
        _same(awq_search(x, ws, specs, **kw), _reference_awq_search(x, ws, specs, **kw))


def test_awq_search_few_tokens_and_single_weight_match_the_reference():
    """Fewer tokens than channels (a singular Gram: no Cholesky factor, the screen uses G itself) and one weight
    given as an array, not a list."""
    x, ws = _sample(5, t=24, n=64, outs=(40,))
    o = awq.u.as_float_array(x, "x", ndim=2)[1]
    _, g = awq._x_stats(x, o, True)
    assert awq._cholesky32(g, o) is None
    for gram in (None, True):
        _same(awq_search(x, ws[0], SPECS["uint4_g16_asym"], gram=gram),
              _reference_awq_search(x, ws[0], SPECS["uint4_g16_asym"], gram=gram))


def test_the_triangular_screen_equals_the_gram_quadratic_form(monkeypatch):
    """||D L||^2 block by block (L the Cholesky factor of G) is sum_rows D G D^T, for block widths that do and do
    not divide the channels."""
    x, ws = _sample(9, t=300, n=80, outs=(24,))
    xd = x.double()
    o = awq.u.as_float_array(xd, "x", ndim=2)[1]
    _, g = awq._x_stats(xd, o, True)
    lo = torch.linalg.cholesky(g)
    d = ws[0].double()
    want = float(((d @ g) * d).sum())
    for block in (16, 32, 80, 128):
        monkeypatch.setattr(awq, "_TRI_BLOCK", block)
        assert awq._loss_tri(d, lo, o) == pytest.approx(want, rel=1e-12)


def test_untrusted_screen_falls_back_to_the_landed_search(monkeypatch):
    """With a zero margin only the screened minimum is a finalist and its screened loss differs from its float64
    one: the screen is not trusted and every candidate is evaluated in float64 (the landed search)."""
    calls = []
    real = awq._search64
    monkeypatch.setattr(awq, "_search64", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(u, "SCREEN_RTOL", 0.0)
    x, ws = _sample(6)
    a = awq_search(x, ws, SPECS["uint4_g16_asym"])
    assert calls  # the fallback ran
    ref = _reference_awq_search(x, ws, SPECS["uint4_g16_asym"])
    assert a.ratio == ref.ratio and torch.equal(a.scales, ref.scales) and a.loss == ref.loss
    assert a.losses == ref.losses  # every loss in float64, as the landed search computes them


def test_awq_search_errors_are_the_landed_ones():
    x, ws = _sample(8)
    for bad, err in ((dict(grid=0), ValueError), (dict(gram=1), TypeError)):
        with pytest.raises(err):
            awq_search(x, ws, SPECS["uint4_g16_asym"], **bad)
        with pytest.raises(err):
            _reference_awq_search(x, ws, SPECS["uint4_g16_asym"], **bad)
    with pytest.raises(ValueError, match="finite"):
        awq_search(x * float("nan"), ws, SPECS["uint4_g16_asym"])


def _quantized_state(model, cfg, data, search, monkeypatch):
    monkeypatch.setattr(scaling_bind, "awq_search", search)
    m = quantize_model(copy.deepcopy(model), cfg, data, progress=False)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _check_models_equal(model, cfg, data, monkeypatch):
    new = _quantized_state(model, cfg, data, awq_search, monkeypatch)
    old = _quantized_state(model, cfg, data, _reference_awq_search, monkeypatch)
    assert new.keys() == old.keys()
    for k in new:
        assert torch.equal(new[k], old[k]), k


def test_quantize_model_awq_on_a_llama_equals_the_reference_bit_for_bit(zoo, monkeypatch):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[:4] *= 20
            layer.post_attention_layernorm.weight[3:6] *= 15
    qcfg = preset("w_uint4_per_group_asym", group_size=16).replace(algorithms=({"name": "awq"},))
    _check_models_equal(model, qcfg, zoo.token_batches(4, seed=1, batch=2, seq=32), monkeypatch)


def test_quantize_model_awq_on_gpt2_conv1d_equals_the_reference_bit_for_bit(monkeypatch):
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for block in model.transformer.h:
            block.ln_1.weight[:4] *= 20
            block.ln_2.weight[:4] *= 20
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 96, (2, 16), generator=g) for _ in range(4)]
    qcfg = preset("w_uint4_per_group_asym", group_size=16).replace(algorithms=({"name": "awq"},))
    _check_models_equal(model, qcfg, data, monkeypatch)

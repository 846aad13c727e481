"""collect_paired: each module's quantized-stream inputs (the layer as it is now, over the quantized stream) paired
with its float-model inputs (the float copy of the layer over the float stream), against hooks on an untouched
float model."""

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import numpy as np  # noqa: E402

from qcore.adapters.passes.paired import collect_paired, float_copy, reduce_paired  # noqa: E402
from qcore.adapters.passes.runner import FloatStream, LayerRunner  # noqa: E402
from qcore.algorithms.paired import PairedStats, update_paired  # noqa: E402

GROUPS = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
          ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]


def _inputs_of(layer, names, run):
    got = {n: [] for n in names}
    hs = [layer.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: got[n].append(a[0].detach().clone()))
          for n in names]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hs:
            h.remove()
    return got


def test_pairs_the_float_models_inputs_with_the_rewritten_layers(zoo):
    model = zoo.tiny_llama()
    data = zoo.token_batches(3, seed=7)
    ref = copy.deepcopy(model)
    heads = [g[0] for g in GROUPS]
    want_x = _inputs_of(ref.model.layers[1], heads, lambda: [ref(b) for b in data])  # the float model's
    runner = LayerRunner(model, progress=False)
    seen = {}

    def step(i, layer, inputs, floats):
        with torch.no_grad():
            layer.mlp.down_proj.weight.mul_(0.5)  # "quantize" layer 0's output: layer 1's quantized stream differs
        if i != 1:
            return
        fl = float_copy(layer)
        with torch.no_grad():
            layer.self_attn.v_proj.weight.mul_(0.7)  # an earlier stage rewritten: o_proj's X~ changes, X must not
        want_xq = _inputs_of(layer, heads, lambda: [layer(*a, **k) for a, k in zip(inputs.args, inputs.kwargs)])
        seen["stats"] = collect_paired(layer, GROUPS, inputs, floats, float_layer=fl)
        seen["want_xq"] = want_xq
        seen["stop"] = collect_paired(layer, GROUPS[:2], inputs, floats, float_layer=fl, stop_after="self_attn.o_proj")

    with torch.no_grad():
        inputs = runner.capture(data)
        runner.run(step, inputs, float_inputs=inputs)
    stats = seen["stats"]
    assert set(stats) == set(heads)
    for h in heads:
        exp = PairedStats.empty(stats[h].n)
        for a, q in zip(want_x[h], seen["want_xq"][h]):
            exp = update_paired(exp, a.numpy(), q.numpy())
        got = stats[h]
        assert got.count == exp.count == 3 * 2 * zoo.SEQ
        np.testing.assert_allclose(got.hessian.numpy(), exp.hessian, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got.delta.numpy(), exp.delta, rtol=1e-4, atol=1e-5)
        assert np.abs(exp.delta).max() > 1e-3  # the streams really differ
    for h in heads[:2]:
        np.testing.assert_array_equal(seen["stop"][h].hessian.numpy(), stats[h].hessian.numpy())
    assert set(seen["stop"]) == set(heads[:2])
    # a sum over ranks through the GPTQ reducer: two identical "ranks" double every part
    r = reduce_paired(stats[heads[0]], lambda hs: type(hs)(hs.sum * 2, hs.count * 2))
    np.testing.assert_array_equal(r.delta.numpy(), stats[heads[0]].delta.numpy() * 2)
    assert r.count == 2 * stats[heads[0]].count


def test_same_streams_give_a_zero_delta_and_bad_streams_are_refused(zoo):
    model = zoo.tiny_llama()
    runner = LayerRunner(model, progress=False)
    with torch.no_grad():
        inputs = runner.capture(zoo.token_batches(2, seed=3))
    layer = runner.layers[0]
    st = collect_paired(layer, GROUPS, inputs, FloatStream(inputs, inputs), float_layer=float_copy(layer))
    assert all(not torch.any(s.delta) for s in st.values())
    with pytest.raises(TypeError, match="FloatStream"):
        collect_paired(layer, GROUPS, inputs, inputs, float_layer=layer)
    short = type(inputs)(inputs.args[:1], inputs.kwargs[:1])
    with pytest.raises(ValueError, match="same calibration batches"):
        collect_paired(layer, GROUPS, inputs, FloatStream(short, short), float_layer=layer)

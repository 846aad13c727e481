"""The layer runner's float stream (``LayerRunner.run(..., float_inputs=)``): each step sees the float model's
inputs and outputs of its layer beside the quantized stream's inputs; a work directory keeps both streams and a
resumed run continues them exactly."""

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from qcore.adapters.passes.checkpointing import LayerCheckpoint, WorkDir  # noqa: E402
from qcore.adapters.passes.runner import FloatStream, LayerRunner, hidden_of  # noqa: E402


def _float_outputs(model, layers, batches) -> list:
    outs: list = [[] for _ in layers]
    hs = [layer.register_forward_hook(lambda m, a, o, i=i: outs[i].append(hidden_of(o).clone()))
          for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            for b in batches:
                model(b)
    finally:
        for h in hs:
            h.remove()
    return outs


def _halve(i, layer, inputs, floats):
    with torch.no_grad():
        layer.mlp.down_proj.weight.mul_(0.5)


def test_the_float_stream_is_the_float_model_while_the_quantized_one_sees_the_rewrites(zoo):
    model = zoo.tiny_llama()
    data = zoo.token_batches(2, seed=5)
    ref = copy.deepcopy(model)
    runner = LayerRunner(model, progress=False)
    want = _float_outputs(ref, LayerRunner(ref, progress=False).layers, data)
    seen: list = []

    def step(i, layer, inputs, floats):
        assert isinstance(floats, FloatStream)
        seen.append(([inputs.hidden(b).clone() for b in range(2)], [floats.outputs.hidden(b).clone() for b in range(2)],
                     [floats.inputs.hidden(b).clone() for b in range(2)]))
        _halve(i, layer, inputs, floats)

    with torch.no_grad():
        inputs = runner.capture(data)
        runner.run(step, inputs, float_inputs=inputs)
    assert len(seen) == 2
    for b in range(2):
        assert torch.equal(seen[0][1][b], want[0][b]) and torch.equal(seen[1][1][b], want[1][b])
        assert torch.equal(seen[1][2][b], want[0][b])  # layer 1's float inputs: layer 0's float outputs
        assert not torch.equal(seen[1][0][b], want[0][b])  # the quantized stream saw layer 0 halved


def test_bad_float_inputs_are_refused_before_any_step(zoo):
    model = zoo.tiny_llama()
    runner = LayerRunner(model, progress=False)
    calls = []
    with torch.no_grad():
        inputs = runner.capture(zoo.token_batches(1, seed=1))
        with pytest.raises(TypeError, match="float_inputs"):
            runner.run(lambda *a: calls.append(a), inputs, float_inputs=[1])
    assert calls == []


def test_a_work_directory_keeps_both_streams_and_resumes_them(zoo, tmp_path):
    data = zoo.token_batches(2, seed=6)

    def go(model, work, stop_at=None):
        runner = LayerRunner(model, progress=False)
        seen = []

        def step(i, layer, inputs, floats):
            if i == stop_at:
                raise KeyboardInterrupt
            seen.append((i, floats.inputs.hidden(0).clone(), inputs.hidden(0).clone()))
            _halve(i, layer, inputs, floats)

        with torch.no_grad():
            inputs = runner.capture(data)
            runner.run(step, inputs, float_inputs=inputs, checkpoint=LayerCheckpoint(work))
        return seen

    whole = go(zoo.tiny_llama(), WorkDir(tmp_path / "a", {"t": 1}))
    with pytest.raises(KeyboardInterrupt):
        go(zoo.tiny_llama(), WorkDir(tmp_path / "b", {"t": 1}), stop_at=1)
    resumed = go(zoo.tiny_llama(), WorkDir(tmp_path / "b", {"t": 1}, resume=True))
    assert [s[0] for s in resumed] == [1]
    assert torch.equal(resumed[0][1], whole[1][1]) and torch.equal(resumed[0][2], whole[1][2])

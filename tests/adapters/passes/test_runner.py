"""The layer runner (qcore.adapters.passes.runner): capture and replay reproduce the full model layer by layer (Llama,
OPT, Mixtral MoE), a pass sees the layers before it as they were left, GPTQ and AMP results equal a direct
computation from full-model forwards, one abort path (no hooks left, the model marked partial), progress bars,
bad arguments refused before any work."""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qcore.adapters.passes.runner import (AlgorithmError, LayerInputs, LayerRunner, Stop,  # noqa: E402
                                   find_decoder_layers, forward_layer, hidden_of)


def _mixtral(seed: int = 0):
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(cfg).eval()


def _models(zoo):
    return {"llama": zoo.tiny_llama, "opt": zoo.tiny_opt, "mixtral": _mixtral}


def _hooks_left(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _layer_outputs(model, layers, batches) -> list[list]:
    """``[layer][batch]`` hidden-state outputs of each decoder layer in full-model forwards (the reference)."""
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


@pytest.mark.parametrize("family", ["llama", "opt", "mixtral"])
def test_capture_and_replay_equal_the_full_model_layer_by_layer(zoo, family):
    model = _models(zoo)[family]()
    data = zoo.token_batches(2, seed=3)
    runner = LayerRunner(model, progress=False)
    ref = _layer_outputs(model, runner.layers, data)
    seen: list = []

    def step(i, layer, inputs):
        seen.append([inputs.hidden(b).clone() for b in range(len(inputs))])

    with torch.no_grad():
        inputs = runner.capture(data)
        assert len(inputs) == 2 and all(kw.get("past_key_values") is None for kw in inputs.kwargs)
        final = runner.run(step, inputs, keep_last=True)
    assert len(seen) == len(runner.layers) == 2
    for i in range(1, len(seen)):  # layer i's replayed inputs are layer i-1's outputs in the full model
        for b in range(2):
            assert torch.equal(seen[i][b], ref[i - 1][b]), (family, i, b)
    for b in range(2):
        assert torch.equal(final.hidden(b), ref[-1][b])
    assert isinstance(final.tuple_out, bool)  # known after a replay (run_from past the last layer needs it)
    # the modules after the layers, run from the kept final hidden states, give the model's logits
    with torch.no_grad():
        tail = [o.logits for o in runner.run_from(len(runner), data, inputs=final)]
        full = [model(b).logits for b in data]
        mid = [o.logits for o in runner.run_from(1, data, inputs=LayerInputs(
            [(ref[0][b],) + tuple(inputs.args[b][1:]) for b in range(2)], inputs.kwargs))] if inputs.args[0] else None
    for a, b in zip(tail, full):
        assert torch.equal(a, b)
    if mid is not None:
        for a, b in zip(mid, full):
            assert torch.equal(a, b)
    assert _hooks_left(model) == 0 and all(type(x).__name__ != "_Skip" for x in runner.layers)


def test_a_pass_sees_the_layers_before_it_as_it_left_them(zoo):
    model = zoo.tiny_llama()
    data = zoo.token_batches(2, seed=4)
    runner = LayerRunner(model, progress=False)
    seen: list = []

    def step(i, layer, inputs):
        seen.append(inputs.hidden(0).clone())
        with torch.no_grad():
            layer.mlp.down_proj.weight.mul_(0.5)

    with torch.no_grad():
        runner.run(step, runner.capture(data))
    ref = _layer_outputs(model, runner.layers, data[:1])  # the model as the pass left it
    assert torch.equal(seen[1], ref[0][0])


def test_gptq_equals_a_direct_computation_from_full_model_forwards(zoo):
    from qcore.adapters import preset
    from qcore.adapters.plan import plan_model
    from qcore.adapters.modules import linear_weight_spec
    from qcore.adapters.passes.sequential import run_algorithms
    from qcore.algorithms.gptq import HessianStats, gptq, update_hessian

    import qcore

    float_model = zoo.tiny_llama()
    data = zoo.token_batches(2, seed=5)
    model = copy.deepcopy(float_model)
    cfg = preset("uint4_wo_32")
    targets = ("self_attn.o_proj", "mlp.down_proj")
    plans = {p.name: p for p in plan_model(model, cfg)}
    pinned = run_algorithms(model, list(plans.values()), [{"name": "gptq", "modules": list(targets)}], data,
                            progress=False)
    assert len(pinned) == 4
    for i in range(2):
        # the float model with the layers before i as GPTQ left them: its layer i's inputs, directly
        mix = copy.deepcopy(float_model)
        for j in range(i):
            mix.model.layers[j].load_state_dict(model.model.layers[j].state_dict())
        stats: dict = {}

        def hook(name):
            def f(mod, args):
                x = args[0].detach()
                stats[name] = update_hessian(stats.get(name) or HessianStats.empty(x.shape[-1], like=x), x)
            return f

        hs = [mix.model.layers[i].get_submodule(t).register_forward_pre_hook(hook(t)) for t in targets]
        with torch.no_grad():
            for b in data:
                mix(b)
        for h in hs:
            h.remove()
        for t in targets:
            name = f"model.layers.{i}.{t}"
            mod = float_model.get_submodule(name)
            r = gptq(mod.weight.detach().float(), stats[t], linear_weight_spec(mod, plans[name], name), act_order=True)
            assert torch.equal(qcore.dequantize(pinned[name]), qcore.dequantize(r.qtensor)), name


def test_amp_sensitivity_equals_a_direct_full_forward(zoo):
    from qcore.adapters import ModelConfig, preset
    from qcore.adapters.passes.amp import layer_sensitivity
    from qcore.adapters.modules import wrap
    from qcore.adapters.batches import set_module
    from qcore.adapters.plan import plan_model

    model = zoo.tiny_llama()
    data = zoo.token_batches(2, seed=6)
    sens = layer_sensitivity(model, ["w_mxfp4_a_mxfp4"], data, progress=False)
    plans = {p.name: p for p in plan_model(model, ModelConfig(preset("w_mxfp4_a_mxfp4").layer))}
    with torch.no_grad():
        ref = [torch.log_softmax(model(b).logits.float(), dim=-1) for b in data]
    for unit, (loss,) in zip(sens.units, sens.loss):
        mods = [(n, model.get_submodule(n)) for n in unit]
        try:
            for n, m in mods:
                set_module(model, n, wrap(m, plans[n].config, name=n))
            total, count = 0.0, 0
            with torch.no_grad():
                for r, b in zip(ref, data):
                    logq = torch.log_softmax(model(b).logits.float(), dim=-1)
                    kl = (r.exp() * (r - logq)).sum(-1)
                    total += float(kl.double().sum())
                    count += kl.numel()
        finally:
            for n, m in mods:
                set_module(model, n, m)
        assert loss == total / count, unit  # bit for bit: the runner's skipped layers change nothing


def test_an_abort_in_a_pass_leaves_no_hooks_and_marks_the_model_partial(zoo):
    model = zoo.tiny_llama()
    data = zoo.token_batches(2, seed=7)
    runner = LayerRunner(model, progress=False)
    inputs = runner.capture(data)

    def step(i, layer, inputs):
        h = layer.self_attn.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(Stop()))
        try:
            forward_layer(layer, inputs, keep=False)  # Stop ends each batch's call, quietly
            if i == 1:
                raise ValueError("boom")
        finally:
            h.remove()  # a pass removes its own hooks

    with pytest.raises(AlgorithmError, match=r"ValueError: boom \(while running \['p'\] on decoder layer 1 of "
                                             r"'model.layers'; layers 0..1 may already be rewritten"):
        runner.run(step, inputs, rewrites=True, what="['p']")
    assert model._qcore_partial is True and _hooks_left(model) == 0

    # a pass that leaves a Stop hook behind: the replay refuses (the next layer would miss batches)
    leaky = zoo.tiny_llama()
    r1 = LayerRunner(leaky, progress=False)

    def leaves_hook(i, layer, inputs):
        layer.mlp.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(Stop()))

    with pytest.raises(AlgorithmError, match="a hook stopped the replay of batch 0"):
        r1.run(leaves_hook, r1.capture(data), rewrites=True)
    assert leaky._qcore_partial is True

    fresh = zoo.tiny_llama()
    r2 = LayerRunner(fresh, progress=False)
    with pytest.raises(KeyError, match="nope"):  # nothing rewritten: the error as it was, the model unmarked
        r2.run(lambda i, layer, x: (_ for _ in ()).throw(KeyError("nope")), r2.capture(data))
    assert not hasattr(fresh, "_qcore_partial")
    with pytest.raises(KeyboardInterrupt):  # an interrupt keeps its type, the model still marked
        r2.run(lambda i, layer, x: (_ for _ in ()).throw(KeyboardInterrupt()), r2.capture(data), rewrites=True)
    assert fresh._qcore_partial is True

    # run_from: an error in the consumer, or a generator dropped half-way, restores the layers and hooks
    m3 = zoo.tiny_llama()
    r3 = LayerRunner(m3, progress=False)
    kept = r3.record(data)
    layers_before = list(r3.layers)
    gen = r3.run_from(1, data, inputs=kept[1])
    next(gen)
    gen.close()
    assert list(r3.layers) == layers_before and _hooks_left(m3) == 0
    with pytest.raises(RuntimeError, match="consumer"):
        for _ in r3.run_from(1, data, inputs=kept[1]):
            raise RuntimeError("consumer")
    assert list(r3.layers) == layers_before and _hooks_left(m3) == 0
    assert list(r3.run_from(1, data, inputs=kept[1], stop=1)) == []  # stop: each forward cut after layer 1
    assert list(r3.layers) == layers_before and _hooks_left(m3) == 0
    # a batch that does not fit the model: refused naming it, no hook left
    tiny = _Stack()
    with pytest.raises(ValueError, match=r"calibration batch 1 \(tensor \(2, 5\).*\) does not fit the model"):
        LayerRunner(tiny, progress=False).capture([torch.randn(2, 4), torch.randn(2, 5)])
    assert _hooks_left(tiny) == 0


class _Stack(torch.nn.Module):
    """Not a transformers model: a projection, then a ModuleList of identical blocks."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        h = self.proj(x)
        for layer in self.layers:
            h = layer(h)
        return h


def test_a_plain_module_stack_runs_too():
    torch.manual_seed(0)
    model = _Stack()
    data = [torch.randn(2, 4), torch.randn(3, 4)]
    runner = LayerRunner(model, progress=False)
    assert runner.path == "layers" and runner.layer_of("layers.2.weight") == 2 and runner.layer_of("proj") is None
    with torch.no_grad():
        final = runner.run(lambda i, layer, x: None, runner.capture(data), keep_last=True)
        for b, x in enumerate(data):
            assert torch.equal(final.hidden(b), model(x))


def test_progress_bars_on_and_off(zoo, capsys):
    model = zoo.tiny_llama()
    data = zoo.token_batches(2, seed=8)
    for progress in (False, True):
        runner = LayerRunner(model, progress=progress)
        with torch.no_grad():
            runner.run(lambda i, layer, x: None, runner.capture(data), desc="my pass")
        err = capsys.readouterr().err
        assert ("my pass" in err and "capturing layer inputs" in err) is progress
        assert (err == "") is not progress


def test_bad_arguments_are_refused_before_any_work(zoo):
    model = zoo.tiny_llama()
    data = zoo.token_batches(2, seed=9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = [
        (TypeError, "model must be a torch.nn.Module", lambda: LayerRunner("model")),
        (TypeError, "progress must be a bool", lambda: LayerRunner(model, progress=1)),
        (TypeError, "required must be a bool", lambda: LayerRunner(model, required="no")),
        (TypeError, "path must be a dotted module path", lambda: LayerRunner(model, path=3)),
        (ValueError, "decoder_layers 'model.blocks' is not a module", lambda: LayerRunner(model, path="model.blocks")),
        (ValueError, "not a non-empty nn.ModuleList", lambda: LayerRunner(model, path="model.norm")),
        (ValueError, "without path=", lambda: LayerRunner(model, layers=model.model.layers)),
        (ValueError, "no nn.ModuleList of identical blocks",
         lambda: LayerRunner(torch.nn.Linear(2, 2))),
        (ValueError, "no identifiable decoder layers",
         lambda: LayerRunner(torch.nn.Linear(2, 2), required=False).capture(data)),
        (ValueError, r"batches: got \[\]; expected a non-empty list", lambda: LayerRunner(model).capture([])),
        (TypeError, "batches: got Tensor; expected a non-empty list", lambda: LayerRunner(model).capture(data[0])),
        (TypeError, "step must be callable", lambda: LayerRunner(model).run(3, None)),
        (TypeError, "inputs must be LayerInputs", lambda: LayerRunner(model).run(lambda *a: None, data)),
        (TypeError, "rewrites must be a bool", lambda: LayerRunner(model).run(lambda *a: None, rewrites=1)),
        (ValueError, r"k: got 3; expected None or a layer index in \[0, 2\]",
         lambda: next(LayerRunner(model).run_from(3, data, inputs=LayerInputs([], [])))),
        (ValueError, r"one call per batch \(2\), got LayerInputs of 0",
         lambda: next(LayerRunner(model).run_from(1, data, inputs=LayerInputs([], [])))),
        (ValueError, r"stop: got 0; expected None or a layer index in \[1, 2\)",
         lambda: next(LayerRunner(model).run_from(1, data, inputs=LayerInputs([(), ()], [{}, {}]), stop=0))),
    ]
    for exc, msg, call in bad:
        with pytest.raises(exc, match=msg):
            call()
    assert _hooks_left(model) == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # the old import names still work
    from qcore.adapters.passes import sequential
    assert sequential.find_decoder_layers is find_decoder_layers and sequential.AlgorithmError is AlgorithmError
    assert LayerRunner(torch.nn.Linear(2, 2), required=False).layers is None

"""Issue 33: exporters, evaluators and calibrators leave the user's model exactly as they found it (the mode of every
submodule, requires_grad, hooks, parameters and buffers): ``qcore.adapters.batches.as_found`` / ``FoundState``, and
each caller of a model on a tiny Llama in training mode with one submodule frozen in eval (dropout on: the outputs
after the call are compared with a seeded forward before it)."""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qcore.adapters import calibrate, export_hf, quantize_model  # noqa: E402
from qcore.adapters.batches import FoundState, as_found  # noqa: E402
from qcore.adapters.eval.evaluate import perplexity  # noqa: E402
from qcore.adapters.eval.layer_report import measure  # noqa: E402
from qcore.adapters.io.compressed_tensors import export_compressed_tensors  # noqa: E402
from qcore.adapters.io.gguf import export_gguf  # noqa: E402


def _llama(seed=0):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   attention_dropout=0.3)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def _batches(n=2):
    return [torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _state(m):
    return ({n: s.training for n, s in m.named_modules()}, {n: p.requires_grad for n, p in m.named_parameters()},
            {n: (list(s._forward_hooks), list(s._forward_pre_hooks)) for n, s in m.named_modules()},
            {k: v.clone() for k, v in m.state_dict().items()})


def _as_user_left_it(m):
    m.train()
    m.model.layers[1].eval()  # a frozen block inside a model in training mode
    m.model.norm.weight.requires_grad_(False)
    m.model.layers[0].mlp.register_forward_hook(lambda mod, a, out: None)
    return m


def _check_unchanged(m, call, *, values=True):
    x = _batches(1)[0]
    for _ in range(2):  # a forward in training mode settles the not-yet-committed weights: twice, then equal
        torch.manual_seed(3)
        ref = m(x).logits.detach()
    before = _state(m)
    call(m)
    after = _state(m)
    assert before[:3] == after[:3]
    if not values:  # calibrate's purpose is new scales
        return
    assert before[3].keys() == after[3].keys()
    assert [k for k in before[3] if not torch.equal(before[3][k], after[3][k])] == []
    torch.manual_seed(3)
    assert torch.equal(m(x).logits.detach(), ref)


def test_as_found_restores_modes_grads_and_hooks():
    m = _as_user_left_it(_llama())
    before = _state(m)
    with pytest.raises(RuntimeError):
        with as_found(m):
            assert not any(s.training for s in m.modules())
            m.model.layers[0].register_forward_pre_hook(lambda mod, a: None)  # left behind
            m.model.layers[0].mlp._forward_hooks.clear()  # the user's removed
            for p in m.parameters():
                p.requires_grad_(False)
            raise RuntimeError("the body failed")
    assert _state(m)[:3] == before[:3]
    saved = FoundState(m, hooks=False)
    m.eval()
    h = m.model.layers[0].register_forward_pre_hook(lambda mod, a: None)
    saved.restore()  # modes back; a pass's own hooks stay with hooks=False
    assert _state(m)[0] == before[0] and len(m.model.layers[0]._forward_pre_hooks) == 1
    h.remove()


@pytest.fixture(scope="module")
def quantized():
    m = _llama()
    ref = {}
    quantize_model(m, "w_int8_a_int8_per_tensor_sym", _batches(), progress=False, reference=ref)
    return m, ref


@pytest.mark.parametrize("what", ["calibrate", "perplexity", "measure", "export_hf", "export_compressed_tensors",
                                  "export_gguf"])
def test_callers_leave_the_model_as_found(quantized, what, tmp_path):
    m0, ref = quantized
    m = _as_user_left_it(copy.deepcopy(m0))
    calls = {
        "calibrate": lambda m: calibrate(m, _batches(), progress=False),
        "perplexity": lambda m: perplexity(m, None, token_ids=torch.randint(0, 128, (40,)), seq_len=16,
                                           windows=[0, 1], progress=False),
        "measure": lambda m: measure(m, ref, _batches()),
        "export_hf": lambda m: export_hf(m, tmp_path / "hf"),
        "export_compressed_tensors": lambda m: export_compressed_tensors(m, tmp_path / "ct"),
        "export_gguf": lambda m: export_gguf(m, tmp_path / "m.gguf", drop_activations=True),
    }
    _check_unchanged(m, calls[what], values=what != "calibrate")

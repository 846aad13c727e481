"""The KL divergence to the float model and the top-1 agreement beside perplexity
(``qcore.adapters.eval.evaluate.float_reference`` / ``compare``; the arithmetic is
``qcore.algorithms.metrics.token_divergence``, tests/algorithms/test_token_divergence.py): the float model's hidden
states before its head are kept (or read from the perplexity cache) instead of its logits, and each chunk of the
other model's logits is compared with the float logits recomputed for the same rows."""

import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from qcore.adapters import quantize_model  # noqa: E402
from qcore.adapters.eval import evaluate as E  # noqa: E402
from qcore.adapters.eval import ppl_cache  # noqa: E402
from qcore.adapters.presets import preset  # noqa: E402
from qcore.algorithms.metrics import token_divergence  # noqa: E402

WINDOWS = dict(seq_len=32, windows=range(4), progress=False)


@pytest.fixture
def ids():
    return torch.randint(0, 128, (160,), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(ppl_cache.ENV_VAR, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _rtn(model):
    q = copy.deepcopy(model)
    quantize_model(q, preset("w_uint4_per_group_asym", group_size=16), None, progress=False)
    return q


def _direct(float_model, model, ids, seq_len=32, n=4):
    """Mean KL and top-1 from the two models' whole logits (one forward each per window)."""
    kl, agree = [], []
    with torch.no_grad():
        for w in range(n):
            x = ids[w * seq_len:(w + 1) * seq_len].reshape(1, -1)
            d = token_divergence(float_model(x).logits[0, :-1], model(x).logits[0, :-1])
            kl.append(d.kl)
            agree.append(d.agree)
    return float(np.concatenate(kl).mean()), float(np.concatenate(agree).mean())


def test_the_float_model_against_itself_is_zero_and_agrees_everywhere(zoo, ids):
    model = zoo.tiny_llama()
    ref = E.float_reference(model, None, token_ids=ids, **WINDOWS)
    assert ref.ppl == E.perplexity(model, None, token_ids=ids, **WINDOWS)  # the same figure, the same computation
    assert len(ref.hidden) == 4 and tuple(ref.hidden[0].shape) == (31, zoo.HIDDEN)
    c = E.compare(model, ref, progress=False)
    assert c.kl == 0.0 and c.top1 == 1.0 and c.ppl == ref.ppl == c.ppl_reference
    assert c.kl_per_window == (0.0,) * 4 and c.top1_per_window == (1.0,) * 4 and c.predictions == 4 * 31


def test_a_quantized_model_against_the_float_one(zoo, ids):
    model = zoo.tiny_llama()
    ref = E.float_reference(model, None, token_ids=ids, **WINDOWS)
    q = _rtn(model)
    c = E.compare(q, ref, progress=False)
    assert c.ppl == E.perplexity(q, None, token_ids=ids, **WINDOWS)  # perplexity unchanged by the comparison
    kl, top1 = _direct(model, q, ids)
    assert c.kl > 0 and c.kl == pytest.approx(kl, rel=1e-6)
    assert 0.5 < c.top1 < 1 and c.top1 == pytest.approx(top1, abs=1e-12)
    assert np.mean(c.kl_per_window) == pytest.approx(c.kl, rel=1e-12)  # equal windows: the mean of the means


def test_the_reference_survives_the_model_being_rewritten(zoo, ids):
    """The head is copied and the hidden states kept: quantizing the float model in place (as qcore quantize does,
    the head too) leaves the reference what it was."""
    model = zoo.tiny_llama()
    twin = copy.deepcopy(model)
    ref = E.float_reference(model, None, token_ids=ids, **WINDOWS)
    quantize_model(model, preset("w_uint4_per_group_asym", group_size=16).replace(exclude=None), None,
                   progress=False)
    c = E.compare(model, ref, progress=False)
    kl, top1 = _direct(twin, model, ids)
    assert c.kl == pytest.approx(kl, rel=1e-6) and c.top1 == pytest.approx(top1, abs=1e-12)


def test_windows_in_batches_give_the_same_figures(zoo, ids):
    model = zoo.tiny_llama()
    q = _rtn(model)
    one = E.compare(q, E.float_reference(model, None, token_ids=ids, **WINDOWS), progress=False)
    two = E.compare(q, E.float_reference(model, None, token_ids=ids, batch_size=2, **WINDOWS), progress=False)
    assert two.kl == pytest.approx(one.kl, rel=1e-5) and two.top1 == pytest.approx(one.top1, abs=0.02)


def test_the_cache_holds_the_hidden_states(zoo, ids, cache):
    model = zoo.tiny_llama()
    first = E.float_reference(model, None, token_ids=ids, cache=True, **WINDOWS)
    assert not first.cached and len(list((cache / "ppl").glob("*.hidden.npy"))) == 1
    second = E.float_reference(model, None, token_ids=ids, cache=True, **WINDOWS)
    assert second.cached and second.ppl == first.ppl
    assert all(torch.equal(a, b) for a, b in zip(first.hidden, second.hidden))
    q = _rtn(model)
    assert E.compare(q, second, progress=False) == E.compare(q, first, progress=False)
    # the perplexity alone reads the same entry
    assert E.perplexity(model, None, token_ids=ids, cache=True, **WINDOWS) == first.ppl
    # damaged hidden states: warned about, computed again, rewritten
    hidden = next((cache / "ppl").glob("*.hidden.npy"))
    data = bytearray(hidden.read_bytes())
    data[-1] ^= 0xFF
    hidden.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="ignoring the hidden states"):
        third = E.float_reference(model, None, token_ids=ids, cache=True, **WINDOWS)
    assert not third.cached and all(torch.equal(a, b) for a, b in zip(first.hidden, third.hidden))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert E.float_reference(model, None, token_ids=ids, cache=True, **WINDOWS).cached


def test_a_perplexity_entry_without_hidden_states_is_a_quiet_miss(zoo, ids, cache):
    model = zoo.tiny_llama()
    value = E.perplexity(model, None, token_ids=ids, cache=True, **WINDOWS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref = E.float_reference(model, None, token_ids=ids, cache=True, **WINDOWS)
    assert not ref.cached and ref.ppl == value
    assert E.float_reference(model, None, token_ids=ids, cache=True, **WINDOWS).cached


def test_refusals(zoo, ids):
    model = zoo.tiny_llama()
    with pytest.raises(ValueError, match="float reference is taken of a float model"):
        E.float_reference(_rtn(model), None, token_ids=ids, **WINDOWS)
    with pytest.raises(TypeError, match="reference must be a FloatReference"):
        E.compare(model, 1.0)
    ref = E.float_reference(model, None, token_ids=ids, **WINDOWS)
    other = zoo.tiny_llama()
    other.resize_token_embeddings(130)
    with pytest.raises(ValueError, match="130 tokens, the float reference's 128"):
        E.compare(other, ref, progress=False)

    class NoLinearHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4))

        def get_output_embeddings(self):
            return None

    with pytest.raises(E.FloatReferenceError, match="no output head whose inputs can be read"):
        E.float_reference(NoLinearHead(), None, token_ids=ids, **WINDOWS)

"""The fast AMP sensitivity path (issue 23) against the landed one: the KL over the vocabulary in blocks of
positions (``amp._kl_rows``) is bit-identical to the landed expression (``amp._reference_kl_rows``), and
``layer_sensitivity`` gives the same sensitivities, bit for bit, through either."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from qcore.adapters.passes import amp  # noqa: E402

MX, FP8 = "w_mxfp4_a_mxfp4", "w_fp8_a_fp8"


@pytest.fixture
def threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("shape", [(1, 512, 1000), (2, 129, 300), (1, 65, 50), (3, 7, 11), (1, 1, 20), (4, 33, 77)])
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("rows", [2, 3, 64])
def test_blocked_kl_is_bit_identical_to_the_landed_expression(monkeypatch, threads, shape, n_threads, rows):
    monkeypatch.setattr(amp, "_KL_ROWS", rows)
    torch.set_num_threads(n_threads)
    g = torch.Generator().manual_seed(sum(shape) + rows)
    ref = torch.log_softmax(3 * torch.randn(shape, generator=g), dim=-1)
    lg = 3 * torch.randn(shape, generator=g)
    want = amp._reference_kl_rows(ref, lg)
    got = amp._kl_rows(ref, ref.exp(), lg)
    assert got.shape == want.shape == shape[:-1]
    assert torch.equal(got, want)
    assert (got >= -1e-6).all()  # a KL: never (meaningfully) negative


def test_blocked_kl_of_a_non_contiguous_logits_view(monkeypatch):
    monkeypatch.setattr(amp, "_KL_ROWS", 3)
    g = torch.Generator().manual_seed(5)
    full = torch.randn(2, 20, 40, generator=g)
    lg = full[:, 3:, :]  # a slice, as a model returning logits for the last positions gives
    ref = torch.log_softmax(torch.randn(lg.shape, generator=g), dim=-1)
    assert torch.equal(amp._kl_rows(ref, ref.exp(), lg), amp._reference_kl_rows(ref, lg))


def _landed(monkeypatch):
    monkeypatch.setattr(amp, "_kl_rows", lambda ref, prob, lg: amp._reference_kl_rows(ref, lg))


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2", "tiny_opt"])
def test_sensitivities_equal_the_landed_path(zoo, monkeypatch, family):
    model = getattr(zoo, family)(0)
    batches = zoo.token_batches(2, seed=1, seq=13)  # 2 x 13 positions per batch: blocks of 3 leave 2
    monkeypatch.setattr(amp, "_KL_ROWS", 3)
    new = amp.layer_sensitivity(model, [MX, FP8, "float"], batches, progress=False)
    with monkeypatch.context() as m:
        _landed(m)
        old = amp.layer_sensitivity(model, [MX, FP8, "float"], batches, progress=False)
    assert new.units == old.units and new.schemes == old.schemes
    assert new.loss == old.loss  # bit for bit
    assert all(x[0] > 0 and x[1] > 0 and x[2] == 0.0 for x in new.loss)
    assert new.search(target_bits=6.0).choice == old.search(target_bits=6.0).choice


def test_the_reference_probabilities_are_kept_once(zoo):
    model = zoo.tiny_llama(1)
    batches = zoo.token_batches(2, seed=2)
    model.eval()
    probe = amp._Probe(model, batches, amp.Metric.KL, False)
    assert len(probe.prob) == len(probe.ref) == len(batches)
    for lp, p in zip(probe.ref, probe.prob):
        assert torch.equal(p, lp.exp())
    nll = amp._Probe(model, batches, amp.Metric.NLL, False)
    assert nll.prob == [] and nll.ref == []  # the NLL metric keeps no vocabulary-sized tensors

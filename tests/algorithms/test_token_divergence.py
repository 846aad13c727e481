"""``qcore.algorithms.metrics.token_divergence``: the KL divergence of next-token distributions and their top-1
agreement (what ``qcore quantize`` and ``qcore eval --reference`` report beside perplexity), against a float64
transcription of the definition in plain numpy, on known cases and on the edges (-inf, NaN, block boundaries)."""

import math

import numpy as np
import pytest

from qcore.algorithms import metrics as M


def _transcription(ref, x):
    """The definition, row by row in float64: p = softmax(ref), q = softmax(x), KL = sum p (log p - log q)."""
    ref = np.asarray(ref, dtype=np.float64).reshape(-1, np.shape(ref)[-1])
    x = np.asarray(x, dtype=np.float64).reshape(-1, np.shape(x)[-1])
    kl, agree = [], []
    for r, q in zip(ref, x):
        lp = r - np.log(np.sum(np.exp(r)))
        lq = q - np.log(np.sum(np.exp(q)))
        kl.append(float(np.sum(np.exp(lp) * (lp - lq))))
        agree.append(int(np.argmax(r)) == int(np.argmax(q)))
    return np.array(kl), np.array(agree)


def test_random_logits_match_the_transcription():
    rng = np.random.default_rng(0)
    ref = rng.normal(scale=3.0, size=(3, 5, 17))
    x = ref + rng.normal(scale=0.5, size=ref.shape)
    d = M.token_divergence(ref, x)
    kl, agree = _transcription(ref, x)
    assert d.kl.dtype == np.float64 and d.kl.shape == (15,) and d.agree.dtype == bool
    np.testing.assert_allclose(d.kl, kl, rtol=1e-12, atol=1e-15)
    assert (d.kl > 0).all()
    np.testing.assert_array_equal(d.agree, agree)
    assert 0 < agree.sum() < 15  # both outcomes present: the comparison is exercised


def test_identical_logits_give_zero_and_full_agreement():
    x = np.random.default_rng(1).normal(size=(4, 50)).astype(np.float32)
    d = M.token_divergence(x, x.copy())
    assert (d.kl == 0.0).all() and d.agree.all()


def test_known_small_case():
    ref = np.array([[0.0, 0.0], [0.0, math.log(3.0)]])  # p = (1/2, 1/2), (1/4, 3/4)
    x = np.array([[math.log(3.0), 0.0], [math.log(3.0), 0.0]])  # q = (3/4, 1/4) twice
    d = M.token_divergence(ref, x)
    assert d.kl[0] == pytest.approx(0.5 * math.log(4.0 / 3.0), rel=1e-14)  # 1/2 log(2/3) + 1/2 log 2
    assert d.kl[1] == pytest.approx(0.5 * math.log(3.0), rel=1e-14)  # 1/4 log(1/3) + 3/4 log 3
    assert d.agree.tolist() == [True, False]  # a tie ranks the first index first (numpy's and torch's argmax)


def test_impossible_tokens_and_nan():
    ninf = -np.inf
    d = M.token_divergence([[ninf, 0.0, 1.0]], [[0.0, 0.0, 1.0]])  # p = 0 on token 0: adds nothing
    # p = (0, 1, e) / (1 + e), q = (1, 1, e) / (2 + e): KL = sum over tokens 1, 2 of p log(p / q)
    assert d.kl[0] == pytest.approx(math.log(2 + math.e) - math.log(1 + math.e), rel=1e-12)
    assert M.token_divergence([[0.0, 1.0]], [[ninf, 1.0]]).kl[0] == math.inf  # q = 0 where p > 0
    assert math.isnan(M.token_divergence([[0.0, np.nan]], [[0.0, 1.0]]).kl[0])  # never hidden
    assert math.isnan(M.token_divergence([[0.0, 1.0]], [[np.nan, 1.0]]).kl[0])


def test_blocks_of_rows_change_nothing(monkeypatch):
    rng = np.random.default_rng(2)
    ref, x = rng.normal(size=(7, 11)), rng.normal(size=(7, 11))
    whole = M.token_divergence(ref, x)
    monkeypatch.setattr(M, "DIVERGENCE_BLOCK_ELEMENTS", 30)  # 2 rows per block, the last one short
    blocks = M.token_divergence(ref, x)
    np.testing.assert_array_equal(blocks.kl, whole.kl)
    np.testing.assert_array_equal(blocks.agree, whole.agree)


def test_torch_tensors_agree_with_the_float64_computation():
    """torch: float32 log-softmax (the logits' precision), float64 sums; float64 tensors: float64 throughout."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    ref = rng.normal(scale=4.0, size=(2, 9, 33)).astype(np.float32)
    x = (ref + rng.normal(scale=0.1, size=ref.shape)).astype(np.float32)
    want = M.token_divergence(ref, x)
    got = M.token_divergence(torch.from_numpy(ref).double(), torch.from_numpy(x).double())
    assert isinstance(got.kl, np.ndarray) and got.kl.dtype == np.float64
    np.testing.assert_allclose(got.kl, want.kl, rtol=1e-10, atol=1e-14)
    np.testing.assert_array_equal(got.agree, want.agree)
    got32 = M.token_divergence(torch.from_numpy(ref), torch.from_numpy(x))
    np.testing.assert_allclose(got32.kl, want.kl, rtol=0, atol=1e-6)  # float32 log-probs: absolute error
    np.testing.assert_array_equal(got32.agree, want.agree)
    assert M.token_divergence(torch.from_numpy(ref).bfloat16(), torch.from_numpy(x).bfloat16()).kl.dtype == np.float64
    mixed = M.token_divergence(torch.from_numpy(ref), x)  # one of each kind: numpy
    np.testing.assert_allclose(mixed.kl, want.kl, rtol=1e-11, atol=1e-16)
    same = torch.from_numpy(ref)
    assert (M.token_divergence(same, same.clone()).kl == 0.0).all()  # equal logits: exactly 0 in float32 too


def test_float32_on_a_real_vocabulary_size_stays_within_the_documented_bounds():
    """64 rows of SmolLM2's 49,152-token vocabulary: each token's KL within 1e-5 of float64's, the mean within
    1e-7 (the docstring's measured figures on 511 rows: 5.2e-6 and 3.2e-8)."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 49152, generator=g) * 3
    x = ref + 0.5 * torch.randn(64, 49152, generator=g)
    got, want = M.token_divergence(ref, x), M.token_divergence(ref.numpy(), x.numpy())
    assert np.abs(got.kl - want.kl).max() < 1e-5 and abs(got.kl.mean() - want.kl.mean()) < 1e-7
    np.testing.assert_array_equal(got.agree, want.agree)
    edges = ([[-np.inf, 0.0, 1.0], [0.0, 1.0, 2.0], [0.0, np.nan, 1.0]], [[0.0, 0.0, 1.0], [-np.inf, 1.0, 2.0],
                                                                          [0.0, 1.0, 1.0]])
    got = M.token_divergence(*(torch.tensor(e, dtype=torch.float64) for e in edges)).kl
    want = M.token_divergence(*edges).kl
    assert got[0] == pytest.approx(want[0], rel=1e-14) and got[1] == want[1] == math.inf
    assert math.isnan(got[2]) and math.isnan(want[2])


@pytest.mark.parametrize("ref, x, exc, msg", [
    (np.zeros((2, 3)), np.zeros((2, 4)), ValueError, "same shape"),
    (np.zeros((0, 3)), np.zeros((0, 3)), ValueError, "not be empty"),
    (np.float64(1.0), np.float64(1.0), ValueError, "at least 1 dimension"),
    ("ab", np.zeros(2), TypeError, "ref_logits"),
])
def test_bad_arguments(ref, x, exc, msg):
    with pytest.raises(exc, match=msg):
        M.token_divergence(ref, x)


def test_integer_tensors_are_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="float tensor of logits"):
        M.token_divergence(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3))

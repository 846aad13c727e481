"""Quality metrics as pure math: token windows, perplexity from negative log-likelihoods, the KL divergence and top-1
agreement of next-token distributions, MSE, SQNR, cosine.

Inputs may be numpy arrays, Python sequences or torch tensors; every result is a Python float (or a tuple of
ints), computed in float64. torch is never imported here: a tensor is recognised through ``qcore._backend``
(a tensor can only exist once torch is imported) and converted with its own methods.

The model-facing side (running a model over the windows, pooling embeddings) lives in
``qcore.adapters.eval.evaluate``; this module is the arithmetic it relies on, testable without a model.
"""

from __future__ import annotations

import math
import operator
import sys
from typing import Any, Iterable, NamedTuple

import numpy as np

from qcore._backend import is_torch

__all__ = ["token_windows", "perplexity_from_nll", "TokenDivergence", "token_divergence", "mse", "sqnr_db", "sqnr_db_of_sums", "cosine_similarities", "mean_cosine"]


def _as_index(value: Any, name: str, *, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (bool and floats rejected), else TypeError/ValueError naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r} (a bool)")
    try:
        i = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})") from None
    if i < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {i}")
    return i


def token_windows(n_tokens: int, *, seq_len: int, windows: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """The token ranges ``(start, stop)`` of non-overlapping windows: window ``w`` is tokens
    ``[w * seq_len, (w + 1) * seq_len)`` of a sequence of ``n_tokens`` tokens.

    ``windows`` is an iterable of distinct window indices (e.g. ``range(0, 20)``), kept in the given order.
    Raises ValueError if it is empty, repeats an index, or names a window that does not fit entirely inside
    ``n_tokens`` (a partial last window is never used).
    """
    n_tokens = _as_index(n_tokens, "n_tokens", minimum=0)
    seq_len = _as_index(seq_len, "seq_len", minimum=2)
    try:
        ws = [_as_index(w, "windows[...]", minimum=0) for w in windows]
    except TypeError as e:
        if "windows[...]" in str(e):
            raise
        raise TypeError(f"windows must be an iterable of ints, got {windows!r}") from None
    if not ws:
        raise ValueError(f"windows must name at least one window, got {windows!r}")
    if len(set(ws)) != len(ws):
        raise ValueError(f"windows must be distinct, got {windows!r}")
    available = n_tokens // seq_len
    too_far = [w for w in ws if w >= available]
    if too_far:
        raise ValueError(f"windows {too_far[:5]} do not fit: {n_tokens} tokens hold {available} full windows of "
                         f"seq_len={seq_len} (indices 0..{available - 1})")
    return tuple((w * seq_len, (w + 1) * seq_len) for w in ws)


def perplexity_from_nll(nll_sum: float, n_predictions: int) -> float:
    """``exp(nll_sum / n_predictions)``: perplexity from the summed negative log-likelihood (natural log) of
    ``n_predictions`` predicted tokens. A NaN sum gives NaN (a broken model is reported, not hidden); a mean
    too large for exp gives inf."""
    n = _as_index(n_predictions, "n_predictions", minimum=1)
    if isinstance(nll_sum, bool) or not isinstance(nll_sum, (int, float, np.floating, np.integer)):
        raise TypeError(f"nll_sum must be a real number, got {nll_sum!r} ({type(nll_sum).__name__})")
    mean = float(nll_sum) / n
    if math.isnan(mean):
        return math.nan
    try:
        return math.exp(mean)
    except OverflowError:
        return math.inf


class TokenDivergence(NamedTuple):
    """Per predicted token (row): ``kl`` the KL divergence ``KL(P_ref || P)`` in nats (float64 array), ``agree``
    whether both distributions put their largest probability on the same token (bool array)."""

    kl: np.ndarray
    agree: np.ndarray


#: float64 elements one block of rows of ``token_divergence`` holds (32 MB; SmolLM2's 49,152-token vocabulary:
#: 85 rows): a window's logits are never all converted to float64 at once
DIVERGENCE_BLOCK_ELEMENTS = 1 << 22


def _block_divergence(r, q):
    """KL and top-1 agreement of one block of rows. numpy: float64 throughout, with ``m`` the row maximum,
    ``e = exp(r - m_r)`` and ``lse = m + log(sum(e))``, ``KL = sum(e * (r - q)) / sum(e) - lse(r) + lse(q)`` (the
    definition, as ``sum(p) = 1``). torch: ``p * (log p - log q)`` from torch's fused log-softmax in the logits'
    precision (float32 at least; float64 logits stay float64), summed in float64."""
    if is_torch(r):
        torch = sys.modules["torch"]
        wide = torch.promote_types(torch.promote_types(r.dtype, q.dtype), torch.float32)
        lp, lq = r.detach().to(wide).log_softmax(-1), q.detach().to(wide).log_softmax(-1)
        p = lp.exp()
        t = (lp - lq).mul_(p)
        dot = t.sum(-1, dtype=torch.float64)
        if dot.isnan().any():  # a token with p = 0 (logit -inf) adds nothing: 0 * log(0 / q) = 0; NaN (p NaN) stays
            t[p == 0] = 0.0
            dot = t.sum(-1, dtype=torch.float64)
        return dot.cpu().numpy(), (r.argmax(-1) == q.argmax(-1)).cpu().numpy()
    r64, q64 = np.asarray(r, dtype=np.float64), np.asarray(q, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        mr, mq = np.max(r64, axis=-1, keepdims=True), np.max(q64, axis=-1, keepdims=True)
        mr, mq = np.where(np.isfinite(mr), mr, 0.0), np.where(np.isfinite(mq), mq, 0.0)
        e = np.exp(r64 - mr)
        sr, sq = e.sum(-1), np.exp(q64 - mq).sum(-1)
        t = e * (r64 - q64)
        dot = t.sum(-1)
        if np.isnan(dot).any():
            t[e == 0] = 0.0
            dot = t.sum(-1)
        kl = dot / sr - (mr[:, 0] + np.log(sr)) + (mq[:, 0] + np.log(sq))
    return kl, r.argmax(-1) == q.argmax(-1)


def _logit_rows(x: Any, name: str):
    if is_torch(x):
        if not (x.dtype.is_floating_point and x.ndim >= 1):
            raise TypeError(f"{name} must be a float tensor of logits [..., vocab], got {x.dtype} {tuple(x.shape)}")
        return x.reshape(-1, x.shape[-1]) if x.ndim else x
    a = _f64(x, name)
    if a.ndim < 1:
        raise ValueError(f"{name} must hold logits [..., vocab] (at least 1 dimension), got shape {a.shape}")
    return a.reshape(-1, a.shape[-1])


def token_divergence(ref_logits: Any, logits: Any) -> TokenDivergence:
    """KL divergence and top-1 agreement of the next-token distributions ``P_ref = softmax(ref_logits)`` and
    ``P = softmax(logits)``, row by row (the last axis is the vocabulary; leading axes are flattened into rows):

        kl[i]    = sum_v P_ref[i, v] * (log P_ref[i, v] - log P[i, v])    (nats, >= 0; 0 for equal logits)
        agree[i] = argmax_v ref_logits[i, v] == argmax_v logits[i, v]      (first index among equal maxima)

    what llama.cpp's ``llama-perplexity --kl-divergence`` reports as mean KLD and "same top p" (its reference is the
    float model's logits). numpy arrays are computed in float64 throughout (the reference computation), as
    ``KL = sum(e * (r - q)) / sum(e) - logsumexp(r) + logsumexp(q)`` with ``e = exp(r - max(r))`` (the definition
    rewritten with ``sum(P_ref) = 1``); torch tensors on their device by torch's fused log-softmax in the logits'
    own precision (float32 at least: bfloat16 / float16 logits are widened, float64 ones stay float64), the sums
    over the vocabulary in float64: 1.5x less CPU time than float64 elementwise; on 511 rows of 49,152 random
    logits (SmolLM2's vocabulary) the mean KL is within 3.2e-8 of float64's, each token's within 5.2e-6
    (tests/algorithms/test_token_divergence.py checks 1e-7 and 1e-5); SmolLM2's uint4_wo_64 run (20 windows):
    mean 0.2970624 against float64's 0.2970598 (2.6e-6 apart), the same top-1 agreement. Rows go in blocks of at most
    ``DIVERGENCE_BLOCK_ELEMENTS`` elements; equal logits give exactly 0. A token with ``P_ref = 0`` (logit -inf)
    adds nothing; one with ``P_ref > 0`` and ``P = 0`` makes the row's KL inf; NaN logits give NaN
    (never hidden). Returns ``TokenDivergence`` of numpy arrays (float64 and bool) of one entry per row.
    """
    r, q = _logit_rows(ref_logits, "ref_logits"), _logit_rows(logits, "logits")
    if tuple(r.shape) != tuple(q.shape):
        raise ValueError(f"ref_logits and logits must have the same shape, got {tuple(_shape(ref_logits))} and "
                         f"{tuple(_shape(logits))}")
    if r.shape[0] == 0 or r.shape[1] == 0:
        raise ValueError(f"ref_logits and logits must not be empty, got shape {tuple(_shape(ref_logits))}")
    if is_torch(r) != is_torch(q):  # one of each kind: both in numpy
        r, q = _f64(r, "ref_logits"), _f64(q, "logits")
    elif is_torch(r) and r.device != q.device:
        raise ValueError(f"ref_logits and logits must be on the same device, got {r.device} and {q.device}")
    step = max(1, DIVERGENCE_BLOCK_ELEMENTS // r.shape[1])
    kl, agree = [], []
    for a in range(0, r.shape[0], step):
        k, same = _block_divergence(r[a:a + step], q[a:a + step])
        kl.append(k)
        agree.append(same)
    return TokenDivergence(np.concatenate(kl).astype(np.float64, copy=False), np.concatenate(agree).astype(bool))


def _shape(x) -> tuple:
    return tuple(getattr(x, "shape", np.shape(x)))


def _f64(x: Any, name: str) -> np.ndarray:
    """``x`` as a float64 numpy array (a torch tensor through its own detach/cpu/double, no torch import)."""
    if is_torch(x):
        return x.detach().cpu().double().numpy()
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real array (numpy array, torch tensor or sequence of numbers), got "
                        f"{type(x).__name__}") from None
    return a


def _pair(ref: Any, x: Any, *, min_ndim: int = 0) -> tuple[np.ndarray, np.ndarray]:
    r, q = _f64(ref, "ref"), _f64(x, "x")
    if r.shape != q.shape:
        raise ValueError(f"ref and x must have the same shape, got {r.shape} and {q.shape}")
    if r.size == 0:
        raise ValueError(f"ref and x must not be empty, got shape {r.shape}")
    if r.ndim < min_ndim:
        raise ValueError(f"ref and x must have at least {min_ndim} dimensions, got shape {r.shape}")
    return r, q


def mse(ref: Any, x: Any) -> float:
    """Mean squared error ``mean((ref - x)**2)`` in float64."""
    r, q = _pair(ref, x)
    return float(np.mean(np.square(r - q)))


def sqnr_db(ref: Any, x: Any) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(sum(ref**2) / sum((ref - x)**2))``, float64.

    ``inf`` when ``x == ref`` exactly (no noise); ``-inf`` when ``ref`` is all zeros but ``x`` is not;
    NaN when either input holds NaN.
    """
    r, q = _pair(ref, x)
    return sqnr_db_of_sums(float(np.sum(np.square(r))), float(np.sum(np.square(r - q))))


def sqnr_db_of_sums(signal: float, noise: float) -> float:
    """``sqnr_db`` from the two sums of squares (``signal = sum(ref**2)``, ``noise = sum((ref - x)**2)``), for
    callers that accumulate them over batches; the same ``inf`` / ``-inf`` / NaN rules."""
    if math.isnan(signal) or math.isnan(noise):
        return math.nan
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def cosine_similarities(a: Any, b: Any) -> np.ndarray:
    """Row-wise cosine similarity of two ``[n, d]`` arrays (the last axis is the vector; leading axes are
    flattened), float64 array of shape ``[n]``. A row of zero norm has no direction: ValueError naming it."""
    x, y = _pair(a, b, min_ndim=1)
    x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    nx, ny = np.linalg.norm(x, axis=1), np.linalg.norm(y, axis=1)
    for arg, n in (("a", nx), ("b", ny)):
        zero = np.flatnonzero(n == 0)
        if zero.size:
            raise ValueError(f"{arg} has rows of zero norm (rows {zero[:5].tolist()}): their cosine is undefined")
    return np.einsum("ij,ij->i", x, y) / (nx * ny)


def mean_cosine(a: Any, b: Any) -> float:
    """Mean of the row-wise cosine similarities of ``a`` and ``b`` (see ``cosine_similarities``)."""
    return float(np.mean(cosine_similarities(a, b)))

"""Model quality evaluation: the project's perplexity protocol, its calibration data, sentence-embedding similarity.

The protocol (../shared/reference/anchors.md, the one Quark's figures were measured with):

- text: ``pydoc_text()``, the CPython help topics joined by blank lines (stdlib, no download);
- tokenized once by the model's tokenizer, called the usual way (``tokenizer(text)``: special tokens as the
  tokenizer adds them by default). SmolLM2's GGUF tokenizer adds none (``add_bos_token`` false): 113,108 tokens
  with or without ``add_special_tokens``, no BOS at the start of the text or of any window;
- evaluation: non-overlapping windows of 512 tokens, windows 0..19 (tokens [0, 10240)); each window is one
  independent forward pass; the loss is the next-token cross entropy of the 511 predictions inside the window
  (the first token of a window is context only), perplexity = exp(mean over all 20 x 511 = 10,220 predictions);
- calibration: windows 20, 21, ... of the same token stream (never overlapping the evaluation tokens).

fp32 SmolLM2-135M-Instruct (Q4_1 GGUF dequantized) gives 14.0122 under this protocol.

Sentence embeddings (for MiniLM): attention-mask weighted mean of ``last_hidden_state`` (sentence-transformers'
mean pooling), compared by cosine similarity against the fp32 model's embeddings. Two disjoint sentence sets
come from the same stdlib text: ``calibration_sentences()`` and ``evaluation_sentences()``.

The arithmetic (windows, nll -> ppl, cosine) is in ``qcore.algorithms.metrics``.
"""

from __future__ import annotations

import hashlib
import math
import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from tqdm.auto import tqdm

from qcore.algorithms.metrics import mean_cosine, perplexity_from_nll, token_divergence, token_windows

from ..batches import FoundState
from ..plan import quantized_modules
from . import ppl_cache

__all__ = [
    "pydoc_text", "protocol_token_ids", "perplexity", "calibration_batches", "sentence_embeddings",
    "embedding_similarity", "mean_cosine", "split_sentences", "calibration_sentences", "evaluation_sentences",
    "SEQ_LEN", "EVAL_WINDOWS", "CALIBRATION_START_WINDOW", "PYDOC_TEXT_SHA256", "SMOLLM2_TOKENS",
    "SMOLLM2_REFERENCE_PPL", "text_sha256", "FloatReference", "Comparison", "float_reference", "compare",
]

SEQ_LEN = 512
EVAL_WINDOWS = range(0, 20)
CALIBRATION_START_WINDOW = 20
# The protocol's text as CPython 3.11.7 ships it (465,126 characters). pydoc_data differs between Python
# versions: the reference figures below hold only for this text.
PYDOC_TEXT_SHA256 = "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee"
SMOLLM2_TOKENS = 113_108
# Quark 0.13 on SmolLM2-135M-Instruct under this protocol (anchors.md): the figures to beat.
SMOLLM2_REFERENCE_PPL = {
    "fp32": 14.012,
    "uint4 weight-only g64 asym RTN": 18.201,
    "uint4 weight-only g64 asym GPTQ": 15.565,
    "W MXFP4 / A MXFP4 dynamic (even)": 44.914,
    "W fp8 / A fp8 per-tensor static": 14.345,
    # MXFP4 by E8M0 scale mode (anchors.md; all linears but lm_head, activations per 32-block dynamic)
    "W MXFP4 / A MXFP4 dynamic (rceil)": 54.62,
    "W MXFP4 / A MXFP4 dynamic (floor)": 56.89,
    "W MXFP4 / A MXFP4 dynamic (ceil)": 98.50,
    "W MXFP4 weight-only (even)": 20.74,
    "W MXFP4 weight-only (rceil)": 21.09,
    "W MXFP4 weight-only (floor)": 22.68,
}


# -- text and tokens ------------------------------------------------------------------------------------------------

def pydoc_text() -> str:
    """The protocol text: ``"\\n\\n".join(pydoc_data.topics.topics[k] for k in sorted(topics))``.
    Compare ``hashlib.sha256(text.encode()).hexdigest()`` with ``PYDOC_TEXT_SHA256`` to know whether the
    reference figures apply (the text changes between Python versions)."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distributions strip pydoc_data
        raise ModuleNotFoundError("the protocol text needs the stdlib module pydoc_data.topics, which this Python "
                                  "installation lacks") from e
    return "\n\n".join(topics[k] for k in sorted(topics))


def _text_arg(text):
    if text is None:
        return pydoc_text()
    if not isinstance(text, str) or not text:
        raise TypeError(f"text must be a non-empty str or None (the protocol text), got {type(text).__name__}")
    return text


def protocol_token_ids(tokenizer, *, text: str | None = None) -> torch.Tensor:
    """The token stream of the protocol: ``tokenizer(text)["input_ids"]`` as a 1-D int64 tensor (``text``
    defaults to ``pydoc_text()``). Tokenize once and pass ``token_ids=`` to ``perplexity`` and
    ``calibration_batches`` to skip re-tokenizing (about 0.5 s for SmolLM2)."""
    text = _text_arg(text)
    if tokenizer is None or not callable(tokenizer):
        raise TypeError(f"tokenizer must be a callable transformers tokenizer, got {tokenizer!r}")
    ids = tokenizer(text)["input_ids"]
    return torch.as_tensor(ids, dtype=torch.int64).reshape(-1)


def _token_ids_arg(tokenizer, text, token_ids) -> torch.Tensor:
    if token_ids is None:
        return protocol_token_ids(tokenizer, text=text)
    if text is not None:
        raise ValueError("give text or token_ids, not both")
    if not isinstance(token_ids, torch.Tensor) or token_ids.ndim != 1 or token_ids.dtype.is_floating_point \
            or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
        raise TypeError(f"token_ids must be a 1-D integer torch.Tensor (from protocol_token_ids), got "
                        f"{getattr(token_ids, 'shape', None)} {getattr(token_ids, 'dtype', type(token_ids))}")
    return token_ids.to(torch.int64)


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _window_args(model, seq_len, batch_size, progress, cache) -> tuple:
    """``(seq_len, batch_size, device)``: the options ``perplexity`` and ``float_reference`` share, checked, and
    the device of a causal LM ``model``."""
    seq_len = _positive_int(seq_len, "seq_len")
    batch_size = _positive_int(batch_size, "batch_size")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {progress!r}")
    if not isinstance(cache, bool):
        raise TypeError(f"cache must be True or False, got {cache!r}")
    device = _model_device(model)
    _check_causal_lm(model)
    return seq_len, batch_size, device


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        raise TypeError(f"model must be a torch nn.Module with parameters, got {type(model).__name__}") from None


# -- perplexity -----------------------------------------------------------------------------------------------------

def perplexity(model, tokenizer, *, text: str | None = None, token_ids: torch.Tensor | None = None,
               seq_len: int = SEQ_LEN, windows: Iterable[int] = EVAL_WINDOWS, batch_size: int = 1,
               progress: bool = True, cache: bool = False) -> float:
    """Perplexity of a causal LM under the protocol (module docstring): windows ``windows`` of ``seq_len``
    tokens of ``protocol_token_ids(tokenizer, text=text)`` (or of ``token_ids``), each its own forward pass.

    ``batch_size`` windows go through the model at once (on CPU 1 is as fast as more). The model runs under
    ``torch.inference_mode`` in eval mode (its train/eval mode is restored afterwards) with ``use_cache=False``;
    logits are taken in float32 for the cross entropy and the sum is accumulated in float64. ``progress`` shows a
    tqdm bar per window. Returns a float (NaN if the model produced NaN logits, never hidden).

    The loss never holds a window's whole ``[seq_len, vocab]`` logits (537 MB per 512-token window for a
    262k vocabulary) where it need not: for a model with an output head (``get_output_embeddings()``: a plain
    ``nn.Linear`` or a weight-only quantized one) the hidden states before the head are taken, and the head, the
    model's own logit post-processing (Gemma's final-logit softcapping, Cohere's ``logit_scale``, Granite's
    ``logits_scaling``) and the cross entropy run over chunks of tokens (``LOSS_CHUNK_ELEMENTS`` logits each): each
    token's loss is computed by the same ops as the plain computation's, only the sum runs in chunks.
    Each window checks the chunked logits against the model's own for its last position (bit-identical, or the
    window is recomputed the plain way and the model evaluated that way from then on, with a warning). The figure
    equals the plain computation within float32 rounding of the summation order over tokens (relative 2e-6 on the
    tests' models, 0 on SmolLM2's protocol windows; docs/adapters.md, "Evaluation speed and the float-baseline
    cache"). Other models (no head found, a head quantizing activations)
    use the plain computation: one forward, ``cross_entropy`` over the logits.

    Frozen quantized weights (``qcore.adapters.freeze``) are dequantized once for the evaluation, not per window
    (``keep_dequantized`` for its duration; the float copies are dropped afterwards).

    ``cache=True``: the figure of a float model (no qcore quantized modules) is read from / written to the
    on-disk perplexity cache (``qcore.adapters.eval.ppl_cache``: keyed by a digest of the model's weights and
    config, the tokens, ``seq_len``, the windows, ``batch_size`` and the device type), so the same float baseline
    is computed once across runs. A quantized model is always evaluated (the cache is not used for it).

    Speed (fp32 SmolLM2, 2-core CPU, 2 threads): about 1.4 s per window, 28-30 s for the 20 protocol windows
    on an idle machine. On a shared machine set ``OMP_WAIT_POLICY=PASSIVE`` before importing torch (see
    bench/bench_quality.py): with spinning OpenMP waits a busy neighbour makes 2 threads 3-8x slower.
    """
    seq_len, batch_size, device = _window_args(model, seq_len, batch_size, progress, cache)
    ids = _token_ids_arg(tokenizer, text, token_ids)
    spans = token_windows(ids.numel(), seq_len=seq_len, windows=windows)

    qmods = list(quantized_modules(model).values())
    key = None
    if cache and not qmods:
        key = ppl_cache.key(model, ids, seq_len=seq_len, spans=spans, batch_size=batch_size, device=device)
        hit = ppl_cache.load(key)
        if hit is not None:
            return hit
    value = _run_windows(model, ids, spans, batch_size=batch_size, progress=progress)
    if key is not None:
        ppl_cache.store(key, value)
    return value


def _run_windows(model, ids: torch.Tensor, spans, *, batch_size: int, progress: bool, keep: Optional[list] = None,
                 divergence: Optional["_Divergence"] = None, desc: str = "perplexity") -> float:
    """The perplexity of ``model`` on windows ``spans`` of ``ids``, ``batch_size`` windows per forward (module
    docstring); ``keep``: a list the hidden states before the output head are appended to, one ``[seq_len - 1,
    hidden]`` CPU tensor per window (``float_reference``); ``divergence``: compared with a float reference chunk by
    chunk (``compare``)."""
    device = _model_device(model)
    seq_len = spans[0][1] - spans[0][0]
    nll_sum, n_predictions = 0.0, 0
    found = FoundState(model)
    model.eval()
    loss = _WindowLoss(model)
    kept = [m for m in quantized_modules(model).values() if m.frozen and not m.keep_dequantized]
    for m in kept:  # frozen weights dequantized once for the whole evaluation, not per window
        m.keep_dequantized = True
    try:
        with torch.inference_mode(), tqdm(total=len(spans), desc=desc, unit="window",
                                          disable=not progress) as bar:
            for i in range(0, len(spans), batch_size):
                batch = torch.stack([ids[a:b] for a, b in spans[i:i + batch_size]]).to(device)
                nll_sum += loss(batch, keep=keep, compare=None if divergence is None else (
                    lambda logits, a, b, i=i: divergence.add(i, logits, a, b)))
                n_predictions += batch.shape[0] * (seq_len - 1)
                bar.update(batch.shape[0])
    finally:
        for m in kept:
            m.keep_dequantized = False
        found.restore()
    return perplexity_from_nll(nll_sum, n_predictions)


# -- KL divergence and top-1 agreement against the float model ------------------------------------------------------

class FloatReferenceError(ValueError):
    """The float model's hidden states before its output head cannot be read (its head is not a plain
    ``nn.Linear`` whose inputs the chunked loss takes), so no ``FloatReference`` of it can be kept."""


@dataclass(frozen=True, eq=False)
class FloatReference:
    """The float model's next-token distributions on the evaluation windows, kept small (``float_reference``).

    Not the logits (20 windows x 511 predictions x 49,152 tokens of SmolLM2 are 2 GB in float32) but what they are
    computed from: per window the hidden states the output head reads (``hidden[i]``: ``[seq_len - 1, hidden]``,
    the model's dtype, on the CPU; 23.5 MB for SmolLM2's 20 windows) and a copy of the head (``weight``,
    ``bias``: 113 MB for SmolLM2's tied 49,152 x 576 head) with the model's logit post-processing (``post``).
    ``logits(i, a, b)`` recomputes window ``i``'s float logits of predictions ``a .. b - 1`` by the head's own ops,
    chunk by chunk, while the other model runs (``compare``). ``ppl``: the float model's perplexity on those
    windows; ``token_ids``, ``spans``, ``batch_size``: the windows ``compare`` evaluates the other model on;
    ``cached``: the hidden states came from the perplexity cache (the float model did not run)."""

    ppl: float
    token_ids: torch.Tensor = field(repr=False)
    spans: tuple
    batch_size: int
    hidden: tuple = field(repr=False)
    weight: torch.Tensor = field(repr=False)
    bias: Optional[torch.Tensor] = field(repr=False)
    post: Optional[Callable] = field(repr=False)
    cached: bool = False

    @property
    def seq_len(self) -> int:
        a, b = self.spans[0]
        return b - a

    def logits(self, i: int, a: int, b: int) -> torch.Tensor:
        """``[1, b - a, vocab]``: the float model's logits of predictions ``a .. b - 1`` of window ``i``."""
        h = self.hidden[i][a:b].to(self.weight.device).unsqueeze(0)  # the shape the model's head saw (batch 1)
        out = torch.nn.functional.linear(h, self.weight, self.bias)
        return out if self.post is None else self.post(out)


@dataclass(frozen=True)
class Comparison:
    """A model against a ``FloatReference`` on the same windows (``compare``): ``ppl`` and the reference's
    ``ppl_reference``; ``kl`` the mean over every prediction of ``KL(P_float || P_model)`` (nats) and ``top1`` the
    fraction of predictions whose most likely token is the same (llama.cpp's ``--kl-divergence``: mean KLD and
    "same top p"); per window the same two (``kl_per_window``, ``top1_per_window``); ``predictions`` counted."""

    ppl: float
    ppl_reference: float
    kl: float
    top1: float
    kl_per_window: tuple
    top1_per_window: tuple
    predictions: int


class _Divergence:
    """The running sums of ``compare``: per window the summed KL and the count of equal top-1 tokens."""

    def __init__(self, reference: FloatReference):
        self.reference = reference
        self.kl = [0.0] * len(reference.spans)
        self.agree = [0] * len(reference.spans)

    def add(self, first: int, logits: torch.Tensor, a: int, b: int) -> None:
        for j in range(logits.shape[0]):
            ref = self.reference.logits(first + j, a, b)[0]
            d = token_divergence(ref, logits[j].to(ref.device))  # widened to float32 at least inside
            self.kl[first + j] += math.fsum(d.kl.tolist())
            self.agree[first + j] += int(d.agree.sum())


def _reference_head(model):
    head = _WindowLoss._chunkable_head(model)
    if head is None:
        raise FloatReferenceError(f"model: {type(model).__name__} has no output head whose inputs can be read "
                                  f"(get_output_embeddings() is not a plain nn.Linear): no float reference of it")
    return head


def float_reference(model, tokenizer, *, text: str | None = None, token_ids: torch.Tensor | None = None,
                    seq_len: int = SEQ_LEN, windows: Iterable[int] = EVAL_WINDOWS, batch_size: int = 1,
                    progress: bool = True, cache: bool = False) -> FloatReference:
    """The float ``model``'s ``FloatReference`` on the perplexity windows (``perplexity``'s arguments): its
    perplexity, computed as ``perplexity`` computes it (the same figure), and per window the hidden states before
    its output head, plus a copy of the head. ``cache=True``: both are read from the perplexity cache when an
    earlier run stored them (``ppl_cache``: the same key as ``perplexity``'s; then the model does not run), and
    stored there otherwise (an entry holding the perplexity alone: the model runs for the hidden states, the
    figure is the cached one). Take it before the model is changed (quantized, rotated): the copy is what keeps it.

    ``FloatReferenceError`` (a ValueError) for a model whose head is not a plain ``nn.Linear`` (or whose chunked
    logits do not reproduce its own); ValueError for a model that holds qcore quantized modules."""
    seq_len, batch_size, device = _window_args(model, seq_len, batch_size, progress, cache)
    if quantized_modules(model):
        raise ValueError(f"model: the float reference is taken of a float model; {type(model).__name__} holds qcore "
                         f"quantized modules")
    head = _reference_head(model)
    ids = _token_ids_arg(tokenizer, text, token_ids)
    spans = token_windows(ids.numel(), seq_len=seq_len, windows=windows)
    weight = head.weight.detach().clone()
    bias = None if head.bias is None else head.bias.detach().clone()
    shape = (len(spans), seq_len - 1, head.in_features)
    key, hidden, value, cached = None, None, None, False
    if cache:
        key = ppl_cache.key(model, ids, seq_len=seq_len, spans=spans, batch_size=batch_size, device=device)
        value = ppl_cache.load(key)
        stored = ppl_cache.load_hidden(key, shape=shape) if value is not None else None
        if stored is not None:
            dt = weight.dtype
            hidden, cached = tuple(torch.from_numpy(stored[i]).to(dt) for i in range(len(spans))), True
    if hidden is None:
        keep: list = []
        ran = _run_windows(model, ids, spans, batch_size=batch_size, progress=progress, keep=keep)
        value = ran if value is None else value  # a cached figure is the figure, as perplexity(cache=True) reads it
        hidden = tuple(keep)
        if key is not None:
            ppl_cache.store(key, value, hidden=torch.stack(hidden).float().numpy())
    return FloatReference(value, ids, spans, batch_size, hidden, weight, bias, _logit_post(model), cached)


def compare(model, reference: FloatReference, *, progress: bool = True) -> Comparison:
    """``model`` (a quantized copy of the reference's float model, or another model with its tokenizer and
    vocabulary) on the reference's windows: its perplexity, as ``perplexity`` computes it (the same figure), and
    per prediction the KL divergence from the float model's next-token distribution and whether both rank the
    same token first (``qcore.algorithms.metrics.token_divergence``: float64 log-softmax, float64 sums), from
    the same forward pass: each chunk of the model's logits is compared with the float logits the reference
    recomputes for the same rows, so neither model's whole logits are ever held (time: the float head's matmul
    and the float64 log-softmax per window; docs/adapters.md "KL divergence and top-1 agreement")."""
    if not isinstance(reference, FloatReference):
        raise TypeError(f"reference must be a FloatReference (from float_reference), got {type(reference).__name__}")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {progress!r}")
    _model_device(model)
    _check_causal_lm(model)
    vocab = _vocab_size(model)
    if vocab is not None and vocab != reference.weight.shape[0]:
        raise ValueError(f"model: its output head has {vocab} tokens, the float reference's {reference.weight.shape[0]}; "
                         f"KL divergence compares distributions over the same vocabulary")
    d = _Divergence(reference)
    value = _run_windows(model, reference.token_ids, reference.spans, batch_size=reference.batch_size,
                         progress=progress, divergence=d)
    n = reference.seq_len - 1
    total = len(reference.spans) * n
    return Comparison(value, reference.ppl, math.fsum(d.kl) / total, sum(d.agree) / total,
                      tuple(k / n for k in d.kl), tuple(a / n for a in d.agree), total)


def _vocab_size(model) -> Optional[int]:
    get = getattr(model, "get_output_embeddings", None)
    n = getattr(get() if callable(get) else None, "out_features", None)
    return n if isinstance(n, int) else None


#: logits per chunk of the chunked loss (float32: 256 MB): 256 tokens of a 262k vocabulary (the head's weight is
#: read once per chunk: fewer, larger chunks are faster), a whole 512-token window of SmolLM2's 49k
LOSS_CHUNK_ELEMENTS = 1 << 26


def _check_causal_lm(model) -> None:
    """A transformers model without an output head (``BertModel``, any encoder) has no next-token logits."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency of the adapters
        return
    if isinstance(model, PreTrainedModel) and model.get_output_embeddings() is None:
        raise TypeError(f"model: perplexity needs a causal LM with an output head (a ...ForCausalLM), got "
                        f"{type(model).__name__}, which has none; for an encoder compare sentence embeddings "
                        f"(embedding_similarity)")


def _reference_window_nll(model, batch: torch.Tensor, *, compare: Optional[Callable] = None) -> float:
    """The plain loss of one batch of windows (the landed computation): one forward, the whole logits, float32
    cross entropy summed over the next-token predictions inside each window (``compare``: given those logits)."""
    out = model(input_ids=batch, use_cache=False)
    logits = getattr(out, "logits", None)
    if logits is None:
        raise TypeError(f"model: perplexity needs a causal LM whose output has logits, got "
                        f"{type(out).__name__} from {type(model).__name__}")
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                            batch[:, 1:].reshape(-1), reduction="sum")
    if compare is not None:
        compare(logits[:, :-1], 0, logits.shape[1] - 1)
    return float(nll)


def _logit_post(model):
    """The model's own elementwise logit post-processing after its head, as transformers writes it, or None."""
    cfg = getattr(model, "config", None)
    cap = getattr(cfg, "final_logit_softcapping", None)
    scale = getattr(model, "logit_scale", None) if str(getattr(cfg, "model_type", "")).startswith("cohere") else None
    div = getattr(cfg, "logits_scaling", None) if str(getattr(cfg, "model_type", "")).startswith("granite") else None
    if cap is None and scale is None and div is None:
        return None

    def post(logits):  # in place on the head's fresh output: the same values, no temporaries
        if cap is not None:  # Gemma 2 / 3: logits / cap -> tanh -> * cap
            logits.div_(cap).tanh_().mul_(cap)
        if scale is not None:
            logits.mul_(scale)
        if div is not None:
            logits.div_(div)
        return logits
    return post


class _WindowLoss:
    """The summed next-token loss of a batch of windows, chunked over tokens where the model allows it."""

    def __init__(self, model):
        self.model = model
        self.head = self._chunkable_head(model)
        self.post = _logit_post(model)

    @staticmethod
    def _chunkable_head(model):
        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else None
        if not isinstance(head, torch.nn.Linear):
            return None
        specs = getattr(head, "specs", None)  # a quantized head: row-independent only without activation roles
        if specs is not None and ("input" in specs or "output" in specs):
            return None
        return head

    def __call__(self, batch: torch.Tensor, *, keep: Optional[list] = None, compare: Optional[Callable] = None) -> float:
        """The summed loss of ``batch``; ``keep``: the hidden states before the head appended per window (CPU,
        predictions only; needs the chunked head: ``FloatReferenceError`` otherwise); ``compare(logits, a, b)``:
        called with each chunk of logits ``[batch, b - a, vocab]``, predictions ``a .. b - 1`` of every window."""
        if self.head is None:
            if keep is not None:
                raise FloatReferenceError(f"{type(self.model).__name__} has no output head whose inputs can be read "
                                          f"(get_output_embeddings() is not a plain nn.Linear)")
            return _reference_window_nll(self.model, batch, compare=compare)
        captured = []

        def grab(module, args):  # the hidden states before the head; the head itself computes the last token only
            if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
                captured.append(None)  # called another way: the check below falls back
                return None
            captured.append(args[0])
            return (args[0][..., -1:, :],) + tuple(args[1:])

        handle = self.head.register_forward_pre_hook(grab)
        try:
            out = self.model(input_ids=batch, use_cache=False)
        finally:
            handle.remove()
        last = getattr(out, "logits", None)
        h = captured[0] if len(captured) == 1 else None
        if h is None or last is None or tuple(h.shape[:-1]) != tuple(batch.shape) \
                or tuple(last.shape[:-1]) != (batch.shape[0], 1) or not torch.equal(self._logits(h[:, -1:]), last):
            warnings.warn(f"perplexity: the chunked loss does not reproduce {type(self.model).__name__}'s own "
                          f"logits; computing them whole (slower, more memory)", RuntimeWarning, stacklevel=3)
            self.head = None
            if keep is not None:
                raise FloatReferenceError(f"the chunked loss does not reproduce {type(self.model).__name__}'s own "
                                          f"logits")
            return _reference_window_nll(self.model, batch, compare=compare)
        del out, last
        captured.clear()
        x, targets = h[:, :-1], batch[:, 1:]
        if keep is not None:
            keep.extend(x[j].detach().to("cpu", copy=True) for j in range(x.shape[0]))
        step = max(1, LOSS_CHUNK_ELEMENTS // max(1, self.head.out_features * batch.shape[0]))
        total = 0.0
        for a in range(0, x.shape[1], step):  # each row's loss as the plain computation's (the same ops per row)
            logits = self._logits(x[:, a:a + step])
            total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                             targets[:, a:a + step].reshape(-1), reduction="sum"))
            if compare is not None:
                compare(logits, a, a + logits.shape[1])
            del logits
        return total

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.head(h)
        return logits if self.post is None else self.post(logits)


def calibration_batches(tokenizer, *, n: int = 32, seq_len: int = SEQ_LEN,
                        start_window: int = CALIBRATION_START_WINDOW, text: str | None = None,
                        token_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The protocol's calibration data: ``n`` int64 tensors of shape ``[1, seq_len]`` (CPU), windows
    ``start_window .. start_window + n - 1`` of the token stream. ValueError if they would overlap the
    evaluation tokens [0, 20 * 512) or run past the end of the text (220 full 512-token windows for
    SmolLM2: at most 200 calibration windows from window 20)."""
    n = _positive_int(n, "n")
    seq_len = _positive_int(seq_len, "seq_len")
    if isinstance(start_window, bool) or not isinstance(start_window, int) or start_window < 0:
        raise ValueError(f"start_window must be a non-negative int, got {start_window!r}")
    eval_stop = EVAL_WINDOWS.stop * SEQ_LEN
    if start_window * seq_len < eval_stop:
        raise ValueError(f"start_window={start_window} with seq_len={seq_len} starts at token "
                         f"{start_window * seq_len}, inside the evaluation tokens [0, {eval_stop}); calibration "
                         f"must start at token {eval_stop} or later")
    ids = _token_ids_arg(tokenizer, text, token_ids)
    spans = token_windows(ids.numel(), seq_len=seq_len, windows=range(start_window, start_window + n))
    return [ids[a:b].reshape(1, seq_len).clone() for a, b in spans]


# -- sentence embeddings --------------------------------------------------------------------------------------------

def _sentences_arg(sentences) -> list[str]:
    if isinstance(sentences, str) or not isinstance(sentences, Sequence) or not sentences:
        raise TypeError(f"sentences must be a non-empty list of str, got {type(sentences).__name__}")
    bad = [i for i, s in enumerate(sentences) if not isinstance(s, str) or not s]
    if bad:
        raise TypeError(f"sentences must be non-empty str; items {bad[:5]} are not")
    return list(sentences)


def sentence_embeddings(model, tokenizer, sentences: Sequence[str], *, batch_size: int = 32,
                        max_length: int = 256) -> torch.Tensor:
    """``[len(sentences), hidden]`` float32 CPU tensor: for each sentence the mean of the encoder's
    ``last_hidden_state`` over its tokens, weighted by the attention mask (padding excluded; the tokenizer's
    special tokens included, as sentence-transformers does). Not normalized (cosine does not need it)."""
    sentences = _sentences_arg(sentences)
    batch_size = _positive_int(batch_size, "batch_size")
    max_length = _positive_int(max_length, "max_length")
    device = _model_device(model)
    out = []
    found = FoundState(model)
    model.eval()
    try:
        with torch.inference_mode():
            for i in range(0, len(sentences), batch_size):
                enc = tokenizer(sentences[i:i + batch_size], padding=True, truncation=True, max_length=max_length,
                                return_tensors="pt").to(device)
                hidden = model(**enc).last_hidden_state.float()
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                out.append(((hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)).cpu())
    finally:
        found.restore()
    return torch.cat(out)


def embedding_similarity(model, tokenizer, sentences: Sequence[str], *, reference_embeddings,
                         batch_size: int = 32) -> float:
    """Mean cosine similarity between ``model``'s sentence embeddings of ``sentences`` and
    ``reference_embeddings`` (usually ``sentence_embeddings(fp32_model, tokenizer, sentences)``): 1.0 means the
    same directions. ValueError if the reference does not hold one row per sentence."""
    sentences = _sentences_arg(sentences)
    shape = tuple(getattr(reference_embeddings, "shape", ()))
    if len(shape) != 2 or shape[0] != len(sentences):
        raise ValueError(f"reference_embeddings must have shape [{len(sentences)}, hidden] (one row per sentence), "
                         f"got {shape}")
    emb = sentence_embeddings(model, tokenizer, sentences, batch_size=batch_size)
    return mean_cosine(emb, reference_embeddings)


# -- sentence sets ----------------------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"(?<=[a-z0-9)][.!?])\s+(?=[A-Z])")
_PROSE = re.compile(r"[A-Z][A-Za-z0-9 ,;:'()\-]+[.!?]")


def split_sentences(text: str, *, min_words: int = 6, max_words: int = 40) -> list[str]:
    """Prose sentences of ``text`` in order of first appearance, without duplicates: paragraphs (blank-line
    separated, whitespace collapsed) cut after ``.``/``!``/``?`` followed by a capital letter; kept if the
    sentence starts with a capital, ends with terminal punctuation, holds only letters, digits, spaces and
    ``,;:'()-`` (no code, no markup) and has ``min_words..max_words`` words."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    seen: dict[str, None] = {}
    for paragraph in re.split(r"\n\s*\n", text):
        flat = " ".join(paragraph.split())
        for s in _SENTENCE_END.split(flat):
            if _PROSE.fullmatch(s) and min_words <= len(s.split()) <= max_words:
                seen.setdefault(s, None)
    return list(seen)


def _sentence_share(parity: int, n: int) -> list[str]:
    n = _positive_int(n, "n")
    pool = split_sentences(pydoc_text())[parity::2]
    if n > len(pool):
        raise ValueError(f"n={n} sentences requested, the text holds {len(pool)} for this set")
    return [pool[(k * len(pool)) // n] for k in range(n)]  # evenly spread over the whole text


def evaluation_sentences(*, n: int = 64) -> list[str]:
    """``n`` prose sentences of ``pydoc_text()``, spread evenly over the text: taken from the even-numbered
    sentences of ``split_sentences(pydoc_text())``, so never one of ``calibration_sentences`` (odd-numbered),
    for any ``n``."""
    return _sentence_share(0, n)


def calibration_sentences(*, n: int = 64) -> list[str]:
    """``n`` prose sentences of ``pydoc_text()`` from the odd-numbered sentences: disjoint from
    ``evaluation_sentences`` for any ``n`` (the pool holds unique sentences)."""
    return _sentence_share(1, n)


def text_sha256(text: str) -> str:
    """sha256 hex digest of ``text`` (utf-8); compare ``text_sha256(pydoc_text())`` with ``PYDOC_TEXT_SHA256``."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()

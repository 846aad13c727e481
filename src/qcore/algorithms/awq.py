"""AWQ (Lin et al., arXiv 2306.00978): activation-aware per-channel scale search and clipping search, as pure
math over a sample of a Linear group's inputs and its weights.

``awq_search(x, weights, spec)``: for the Linears that read the same input ``x`` ([tokens, in]; e.g. q/k/v),
find per-input-channel scales ``s`` so that quantizing ``W_i * s`` (and dividing the input by ``s``, folded into
the op before: ``qcore.adapters.passes.scaling.fold_scales``) loses the least. Candidates, for ``ratio = k / grid``,
``k = 0 .. grid - 1`` (AutoAWQ's and Quark's grid: 0, 0.05, ..., 0.95 for ``grid=20``; ratio 1 is not tried)::

    m_j = mean_t |x[t, j]|                         (float64)
    s   = max(m ** ratio, 1e-4);  s = s / sqrt(max(s) * min(s))   (float64, then rounded to float32)
    loss(s) = sum_i  mean_{tokens, outputs} (x W_i^T - (x / s) Q(W_i * s)^T) ** 2

``Q = qcore.fake_quantize(., spec)`` with the spec's exact quantization (a spec for the [out, in] weight, e.g.
``make_spec("uint4", granularity=PerGroup(64, axis=1))``; one spec, or one per weight). ``W_i * s`` is a
float32 product (what folding stores); the error ``D_i = Q(W_i * s) / s - W_i`` and the loss are float64. The
loss is computed either directly over token chunks (``sum ||x_c D^T||^2``) or through the Gram matrix
``G = x^T x`` (``sum_rows D G D^T``), whichever needs fewer operations (``gram=`` forces one); both are the same
sum up to float64 rounding. The search runs in two passes (issue 23): a float32 screen of every candidate, then
the landed float64 loss for ratio 0 and the candidates within 1e-4 of the best screened loss, which decide
(``awq_search``'s docstring; ``_reference_awq_search`` is the one-pass float64 search, chosen bits identical).
Ratio 0 gives ``s = 1`` exactly, i.e. plain round-to-nearest, and is evaluated
first; a later ratio wins only with a strictly smaller loss, so the result is never worse than no scaling on the
sample.

``awq_clip(x, weight, spec)``: AutoAWQ's clipping search for one Linear (run after the scales are folded: ``x``
is then the scaled input and ``weight`` the scaled weight). Per output row and per group of the spec (the whole
row for per-channel specs), with ``amax`` the group's max |w|, try the clip values ``amax * (1 - k / grid)``,
``k = 0 .. int(max_shrink * grid) - 1`` (1, 0.95, ..., 0.55 by default): clamp the weight to
``[-clip, clip]``, fake-quantize the whole weight with ``spec``, and measure the group's output error
``mean_t (x_g . (Q(w_clipped)_g - w_g))**2`` on every ``k``-th token of ``x``, ``k = tokens // min(tokens,
n_tokens)`` (AutoAWQ's and Quark's sampling, 512 tokens by default; ``n_tokens=None``: every token). The
smallest error wins per (row, group); ties keep the larger clip (ratio 1, no clipping, is tried first), so the
clipped weight is never worse than the original on the sample, group by group. Returns the clipped float32
weight (not quantized): quantizing it with ``spec`` gives exactly the winning candidates, since each group's
scale depends only on its own values.
Supported specs: groups that live inside one row of the [out, in] weight: ``PerGroup(size, axis=1)`` (or -1) and
``PerChannel(axis=0)`` (or -2), any element format (int, fp8, fp4, MX blocks, ...), two-level specs only with
``TensorScale.ONE``. Other granularities (PerTensor, PerBlock, per-input-channel) couple groups across rows
or the whole tensor; ``awq_clip`` raises ValueError for them rather than return a wrong "optimum".

Differences from AMD Quark 0.13 (``quark/torch/algorithm/awq/awq.py``), on purpose:

- Quark measures the scale search's loss at the output of ``module2inspect`` (e.g. the whole attention block
  for q/k/v, the MLP for gate/up); this pure function sums the Linears' own output errors. Quark computes the
  candidate scales in the activation dtype (bf16/fp16); here float64, rounded once to float32.
- AutoAWQ's optional ``duo_scaling`` (weights in the candidate rule) is not offered (Quark does not use it).
- Quark initialises the clip search's best error at 1e9 (so a group with a larger error keeps its first
  candidate anyway); here the best starts at ratio 1's own error. Quark asserts that groups divide ``in``;
  here a short last group is handled like everywhere in qcore. Which Linears to clip (Quark skips q/k: "due to
  qk bmm, it is hard to clip precisely") is the caller's choice.

numpy and torch: the same float64 operations in the same order; the backends' float64 matmuls, sums and ``pow``
may round differently in the last place, so losses agree to ~1e-13 relative and the chosen ratios, the float32
scales and the clipped weights are identical unless two candidates tie within that (tested bit for bit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from qcore._typing import Array, ArrayLike, KeyLike
from qcore.dtypes import TensorScale
from qcore.granularity import PerChannel, PerGroup
from qcore.quantize import fake_quantize
from qcore.rounding import RoundingMode, check_mode

from . import _scaling as u
from .smoothquant import act_power

__all__ = ["AWQResult", "awq_search", "awq_clip"]  # and _reference_awq_search (tests)

# The Gram path is used only while G = x^T x (float64, in x in) stays below this many bytes.
_GRAM_MAX_BYTES = 1 << 31


@dataclass(frozen=True)
class AWQResult:
    """``awq_search``'s choice: ``scales`` (float32 [in], the array kind and device of ``x``), ``ratio`` (the
    exponent of the winning candidate), ``loss`` (its loss), ``losses`` ((ratio, loss) for every candidate, in
    the order evaluated)."""

    scales: Any
    ratio: float
    loss: float
    losses: tuple = ()


def _key(specs: list, key: KeyLike):
    stochastic = any(s.rounding is RoundingMode.STOCHASTIC for s in specs)
    return check_mode(RoundingMode.STOCHASTIC, key) if stochastic else None


def _check_gram(gram: Any) -> Optional[bool]:
    if gram is not None and not isinstance(gram, bool):
        raise TypeError(f"gram must be None (choose by cost), True or False, got {gram!r}")
    return gram


def _check_search_spec(spec, name):
    if spec.two_level and spec.tensor_scale_mode is TensorScale.GIVEN:
        raise ValueError(f"{name}: two-level specs with TensorScale.GIVEN need a tensor scale per call, which "
                         "the AWQ search does not take; use TensorScale.AMAX or ONE")
    return spec


# ---------------------------------------------------------------------------------------------------------------
# scale search
# ---------------------------------------------------------------------------------------------------------------


def _x_stats(x, o, want_gram: bool):
    """mean |x| per channel (float64 [in]) and, if asked, G = x^T x (float64 [in, in]), over token chunks."""
    t, n = int(x.shape[0]), int(x.shape[1])
    step = u.rows_per_chunk(n)
    sabs = u.zeros64((n,), o, x)
    g = u.zeros64((n, n), o, x) if want_gram else None
    for a, b in u.chunks(t, step):
        xc = u.to64(x[a:b], o)
        sabs = sabs + o.sum(o.abs(xc), 0, keepdims=False)
        if want_gram:
            g = g + u.matmul(u.transpose2(xc, o), xc)
    return sabs / t, g


def _loss_gram(d, g, o) -> float:
    """sum over rows of d G d^T (= ||x d^T||^2), row chunks."""
    total = 0.0
    n = int(d.shape[1])
    for a, b in u.chunks(int(d.shape[0]), u.rows_per_chunk(n)):
        dc = d[a:b]
        total += float(o.sum(u.matmul(dc, g) * dc, (0, 1), keepdims=False))
    return total


def _loss_direct(d, x, o, *, cast: bool = True) -> float:
    """||x d^T||^2 over token chunks (``cast``: x's chunks to float64 first)."""
    total = 0.0
    d_t = u.transpose2(d, o)
    step = u.rows_per_chunk(int(x.shape[1]) + int(d.shape[0]))
    for a, b in u.chunks(int(x.shape[0]), step):
        e = u.matmul(u.to64(x[a:b], o) if cast else x[a:b], d_t)
        total += float(o.sum(e * e, (0, 1), keepdims=False))
    return total


def _prepare(x, weights, spec, grid, gram, key):
    """Argument checks (before any work) and the x statistics shared by both searches."""
    xa, o = u.as_float_array(x, "x", ndim=2)
    ws = u.weight_list(weights, xa)
    specs = [_check_search_spec(s, f"spec[{i}]") for i, s in enumerate(u.spec_list(spec, len(ws), "spec"))]
    grid = u.check_int(grid, "grid", minimum=1)
    gram = _check_gram(gram)
    key = _key(specs, key)
    u.check_finite(xa, o, "x")
    t, n = int(xa.shape[0]), int(xa.shape[1])
    out_total = sum(int(w.shape[0]) for w in ws)
    if gram is None:
        direct_cost = grid * t * n * out_total
        gram_cost = t * n * n + grid * out_total * n * n
        gram = gram_cost < direct_cost and 8 * n * n <= _GRAM_MAX_BYTES
    mean_abs, g = _x_stats(xa, o, gram)
    return xa, o, ws, specs, grid, gram, key, mean_abs, g


def _candidate(mean_abs, ratio, o):
    """Candidate ``ratio``'s scales: float32, and the same values as float64."""
    s32 = u.to32(act_power(mean_abs, ratio, o), o)
    return s32, u.to64(s32, o)


def _error(w, wd, s32, s_back, sp, key, o):
    """D = Q(W * s) / s - W (float64), the landed expression."""
    with o.quiet():
        return u.to64(fake_quantize(w * s32, sp, key=key), o) / s_back - wd


def _loss64(w32, w64, specs, s32, s_back, key, g, xa, o, gram, t) -> float:
    """A candidate's float64 loss, exactly as the landed search sums it."""
    total = 0.0
    for w, wd, sp in zip(w32, w64, specs):
        d = _error(w, wd, s32, s_back, sp, key, o)
        sq = _loss_gram(d, g, o) if gram else _loss_direct(d, xa, o)
        total += sq / (t * int(w.shape[0]))
    return total


# Column block width of the triangular screen (``_loss_tri``).
_TRI_BLOCK = 128


def _cholesky32(g, o):
    """The lower Cholesky factor L of the float64 Gram (G = L L^T), rounded to float32; None when G is not
    positive definite (fewer tokens than channels, a constant channel): the screen then uses G itself."""
    if o.name == "numpy":
        try:
            lo = np.linalg.cholesky(g)
        except np.linalg.LinAlgError:
            return None
    else:
        lo, info = o.t.linalg.cholesky_ex(g)
        if int(info) != 0:
            return None
    if not bool(o.isfinite(lo).all()):
        return None
    return u.to32(lo, o)


def _loss_tri(d, lo, o) -> float:
    """||d L||^2 = sum_rows d G d^T with L lower triangular, column block by column block: block J of d L is
    d[:, J0:] @ L[J0:, J] (the zeros above the diagonal are skipped: about half the multiply-adds of d G)."""
    total = 0.0
    n = int(d.shape[1])
    for a, b in u.chunks(int(d.shape[0]), u.rows_per_chunk(n)):
        dc = d[a:b]
        for c0, c1 in u.chunks(n, _TRI_BLOCK):
            e = u.matmul(dc[:, c0:], lo[c0:, c0:c1])
            total += float(o.sum(e * e, (0, 1), keepdims=False))
    return total


def _loss32(ds, lo32, g32, x32, o, gram, t) -> float:
    """The screened loss: the same sum with float32 products (float32 D times the float32 Cholesky factor of G,
    or G itself, or the float32 sample)."""
    total = 0.0
    for d in ds:
        if gram:
            sq = _loss_tri(d, lo32, o) if lo32 is not None else _loss_gram(d, g32, o)
        else:
            sq = _loss_direct(d, x32, o, cast=False)
        total += sq / (t * int(d.shape[0]))
    return total


def awq_search(x: ArrayLike, weights: Any, spec: Any, *, grid: int = 20, gram: Optional[bool] = None,
               key: KeyLike = None) -> AWQResult:
    """AWQ's per-input-channel scale search for the Linears in ``weights`` that read ``x`` (module docstring).

    ``x``: [tokens, in] sampled inputs (numpy array or torch tensor, any float dtype); ``weights``: one [out, in]
    array or a list of them (same kind and device as ``x``); ``spec``: the weights' qcore spec in [out, in]
    layout (one, or one per weight). ``grid``: number of ratios ``k / grid`` (k = 0 .. grid - 1). ``gram``: None
    picks the cheaper loss evaluation (module docstring), True/False forces the Gram / direct one. ``key``: for
    stochastic-rounding specs. Returns ``AWQResult(scales, ratio, loss, losses)``: fold ``scales`` with
    ``qcore.adapters.passes.scaling.fold_scales`` (the previous op divided by ``s``, the Linears' columns times ``s``).
    Deterministic; memory: one float64 chunk of ``x`` (about 64 MiB) plus, on the Gram path, the [in, in] Gram.

    Two passes (issue 23): every candidate's loss is first *screened* with float32 products (the float64 error
    ``D`` rounded to float32; on the Gram path ``||D L||^2`` with ``L`` the float32 lower Cholesky factor of the
    float64 Gram, skipping the zero upper triangle, or ``sum D G D^T`` where ``G`` is singular; on the direct
    path times the float32 sample: together about a quarter of the float64 matmuls that dominated the landed
    search), then the candidates within ``SCREEN_RTOL`` (1e-4 relative) of the smallest screened
    loss are evaluated in float64 exactly as the landed one-pass search (``_reference_awq_search``) does, in
    order (ratio 0, plain round-to-nearest, always). So ``ratio``, ``scales`` and ``loss`` are the landed
    search's, bit for bit; ``losses`` holds the float64 losses of ratio 0 and the finalists and the others'
    screened ones (~1e-7 relative from float64 on SmolLM2's data). If
    a finalist's screened loss is further than a quarter of the margin from its float64 one, or a screened loss
    is not finite, the screen is not trusted and every candidate is evaluated in float64 (the landed search).
    Stochastic-rounding specs (whose draws depend on the call order) always take the landed one-pass search.
    """
    xa, o, ws, specs, grid, gram, key, mean_abs, g = _prepare(x, weights, spec, grid, gram, key)
    if key is not None:
        return _search64(xa, o, ws, specs, grid, gram, key, mean_abs, g)
    t = int(xa.shape[0])
    w32 = [u.to32(w, o) for w in ws]
    w64 = [u.to64(w, o) for w in w32]
    lo32 = _cholesky32(g, o) if gram else None
    g32 = u.to32(g, o) if gram and lo32 is None else None
    x32 = None if gram else u.to32(xa, o)
    cands, screened = [], []
    for k in range(grid):
        ratio = k / grid
        s32, s_back = _candidate(mean_abs, ratio, o)
        ds = [u.to32(_error(w, wd, s32, s_back, sp, key, o), o) for w, wd, sp in zip(w32, w64, specs)]
        cands.append((ratio, s32, s_back))
        screened.append(_loss32(ds, lo32, g32, x32, o, gram, t))
    fin = u.finalists(screened)
    if fin[0] != 0:  # ratio 0 (plain round-to-nearest, the baseline) is always reported in float64
        fin = [0] + fin
    exact = {}
    for i in fin:
        _, s32, s_back = cands[i]
        exact[i] = _loss64(w32, w64, specs, s32, s_back, key, g, xa, o, gram, t)
    if len(fin) < grid:
        for i in fin:
            e, v = exact[i], screened[i]
            if not (math.isfinite(e) and abs(v - e) <= 0.25 * u.SCREEN_RTOL * abs(e)):
                return _search64(xa, o, ws, specs, grid, gram, key, mean_abs, g)
    best = None
    for i in fin:
        total = exact[i]
        if best is None or total < best[2] or (math.isnan(best[2]) and not math.isnan(total)):
            best = (cands[i][0], cands[i][1], total)
    if math.isnan(best[2]):
        raise ValueError("awq_search: every candidate's loss is NaN (the quantized weights overflowed?); check spec")
    losses = tuple((c[0], exact.get(i, screened[i])) for i, c in enumerate(cands))
    return AWQResult(best[1], best[0], best[2], losses)


def _search64(xa, o, ws, specs, grid, gram, key, mean_abs, g) -> AWQResult:
    """The landed one-pass float64 search over prepared arguments."""
    t = int(xa.shape[0])
    w32 = [u.to32(w, o) for w in ws]
    w64 = [u.to64(w, o) for w in w32]
    best = None
    losses = []
    for k in range(grid):
        ratio = k / grid
        s32, s_back = _candidate(mean_abs, ratio, o)
        total = _loss64(w32, w64, specs, s32, s_back, key, g, xa, o, gram, t)
        losses.append((ratio, total))
        if best is None or total < best[2] or (math.isnan(best[2]) and not math.isnan(total)):
            best = (ratio, s32, total)
    if math.isnan(best[2]):
        raise ValueError("awq_search: every candidate's loss is NaN (the quantized weights overflowed?); check spec")
    return AWQResult(best[1], best[0], best[2], tuple(losses))


def _reference_awq_search(x: ArrayLike, weights: Any, spec: Any, *, grid: int = 20, gram: Optional[bool] = None,
               key: KeyLike = None) -> AWQResult:
    """The landed one-pass float64 search (every candidate's loss in float64), kept as the reference that
    ``awq_search`` is tested against (same arguments, checks and result, ``awq_search``'s docstring; ``losses``
    all float64). The arguments are checked by the shared ``_prepare``; the loop is the landed text, written out
    rather than through ``_candidate`` / ``_loss64``, so the tests compare the fast search with independent code.
    """
    xa, o, ws, specs, grid, gram, key, mean_abs, g = _prepare(x, weights, spec, grid, gram, key)
    t = int(xa.shape[0])

    w32 = [u.to32(w, o) for w in ws]
    w64 = [u.to64(w, o) for w in w32]
    best = None
    losses = []
    for k in range(grid):
        ratio = k / grid
        s64 = act_power(mean_abs, ratio, o)
        s32 = u.to32(s64, o)
        s_back = u.to64(s32, o)
        total = 0.0
        for w, wd, sp in zip(w32, w64, specs):
            with o.quiet():
                d = u.to64(fake_quantize(w * s32, sp, key=key), o) / s_back - wd
            sq = _loss_gram(d, g, o) if gram else _loss_direct(d, xa, o)
            total += sq / (t * int(w.shape[0]))
        losses.append((ratio, total))
        if best is None or total < best[2] or (math.isnan(best[2]) and not math.isnan(total)):
            best = (ratio, s32, total)
    if math.isnan(best[2]):
        raise ValueError("awq_search: every candidate's loss is NaN (the quantized weights overflowed?); check spec")
    return AWQResult(best[1], best[0], best[2], tuple(losses))


# ---------------------------------------------------------------------------------------------------------------
# clipping search
# ---------------------------------------------------------------------------------------------------------------


def _row_groups(spec, n_in: int, name: str) -> int:
    """The group size along ``in`` of a spec whose groups stay inside one row of an [out, in] weight."""
    g = spec.granularity
    if isinstance(g, PerGroup) and g.axis in (1, -1):
        size = g.size
    elif isinstance(g, PerChannel) and g.axis in (0, -2):
        size = n_in
    else:
        raise ValueError(f"{name}: awq_clip needs groups inside one row of the [out, in] weight (PerGroup(size, "
                         f"axis=1) or PerChannel(axis=0)), got {g!r}: its scales couple rows, so clipping cannot be "
                         "chosen group by group")
    if spec.two_level and spec.tensor_scale_mode is not TensorScale.ONE:
        raise ValueError(f"{name}: two-level specs couple every group through the tensor scale "
                         f"(tensor_scale_mode={spec.tensor_scale_mode.name}); awq_clip supports TensorScale.ONE only")
    return size


def _blocks(a, o, n_groups: int, size: int):
    """[rows, in] -> [rows, n_groups, size] (zero padding of a short last group)."""
    a = o.pad_axis(a, 1, n_groups * size - int(a.shape[1]))
    return o.reshape(a, (int(a.shape[0]), n_groups, size))


def _unblock(a, o, n_in: int):
    a = o.reshape(a, (int(a.shape[0]), int(a.shape[1]) * int(a.shape[2])))
    return o.slice_axis(a, 1, n_in)


def _group_errors(d, xb, hb, n_tok: int, o):
    """Per (row, group) mean over tokens of (x_g . d_g)^2: ``d`` [out, G, size] float64; ``xb`` [G, T, size]
    (direct) or ``hb`` [G, size, size] (block Gram). Returns [out, G] float64."""
    rows, n_groups, size = (int(v) for v in d.shape)
    if hb is not None:
        step = u.rows_per_chunk(n_groups * size * 2)
    else:
        step = u.rows_per_chunk(n_groups * n_tok)
    parts = []
    for a, b in u.chunks(rows, step):
        dc = o.moveaxis(d[a:b], 1, 0)                                           # [G, R, size]
        if hb is not None:
            e = o.sum(u.matmul(dc, hb) * dc, 2, keepdims=False)                 # [G, R]
        else:
            y = u.matmul(xb, u.transpose2(dc, o))                               # [G, T, R]
            e = o.sum(y * y, 1, keepdims=False)                                 # [G, R]
        parts.append(o.moveaxis(e, 0, 1))
    err = parts[0] if len(parts) == 1 else (np.concatenate(parts, 0) if o.name == "numpy" else o.t.cat(parts, 0))
    return err / n_tok


def awq_clip(x: ArrayLike, weight: ArrayLike, spec: Any, *, grid: int = 20, max_shrink: float = 0.5,
             n_tokens: Optional[int] = 512, gram: Optional[bool] = None, key: KeyLike = None) -> Array:
    """AWQ's clipping search for one Linear (module docstring): returns ``weight`` clamped per (row, group) to
    the clip value whose quantized group output error on the sampled ``x`` is smallest (float32 [out, in], the
    array kind and device of ``weight``; not quantized).

    ``x``: [tokens, in] inputs of the Linear (after folding any AWQ scales); ``weight``: [out, in]; ``spec``: the
    weight's qcore spec, ``PerGroup(size, axis=1)`` or ``PerChannel(axis=0)`` (others: ValueError). ``grid`` and
    ``max_shrink`` (in [0, 1)): clip ratios ``1 - k / grid`` for ``k < int(max_shrink * grid)`` (at least ratio
    1). ``n_tokens``: sample every ``tokens // min(tokens, n_tokens)``-th token (None: all). ``gram``: None picks
    the cheaper error evaluation (per-group Gram blocks or direct), True/False forces one. ``key``: stochastic
    rounding.
    """
    xa, o = u.as_float_array(x, "x", ndim=2)
    wa = u.weight_list(weight, xa, "weight")[0]
    sp = _check_search_spec(u.as_spec(spec, "spec"), "spec")
    n_in, n_out = int(wa.shape[1]), int(wa.shape[0])
    size = _row_groups(sp, n_in, "spec")
    grid = u.check_int(grid, "grid", minimum=1)
    max_shrink = u.check_real(max_shrink, "max_shrink")
    if not 0.0 <= max_shrink < 1.0:
        raise ValueError(f"max_shrink must be in [0, 1), got {max_shrink}")
    if n_tokens is not None:
        n_tokens = u.check_int(n_tokens, "n_tokens", minimum=1)
    gram = _check_gram(gram)
    key = _key([sp], key)
    u.check_finite(xa, o, "x")

    t = int(xa.shape[0])
    if n_tokens is not None:
        xa = xa[::t // min(t, n_tokens)]
    n_tok = int(xa.shape[0])
    n_groups = -(-n_in // size)
    n_ratios = max(1, int(max_shrink * grid))
    if gram is None:
        gram = n_tok * n_in * size + n_ratios * n_out * n_in * size < n_ratios * n_tok * n_in * n_out \
            and 8 * n_in * size <= _GRAM_MAX_BYTES
    xb = o.moveaxis(_blocks(u.to64(xa, o), o, n_groups, size), 1, 0)             # [G, T, size]
    hb = u.matmul(u.transpose2(xb, o), xb) if gram else None                    # [G, size, size]

    w32 = u.to32(wa, o)
    wb = _blocks(w32, o, n_groups, size)                                        # [out, G, size]
    amax = o.amax(o.abs(wb), 2, keepdims=True)                                  # [out, G, 1]
    w64 = u.to64(w32, o)
    best_clip = best_err = None
    for k in range(n_ratios):
        r = 1.0 - k / grid
        clip = amax if k == 0 else amax * np.float32(r)
        cand = _unblock(o.clip(wb, -clip, clip) if k else wb, o, n_in)
        with o.quiet():
            d = u.to64(fake_quantize(cand, sp, key=key), o) - w64
        err = _group_errors(_blocks(d, o, n_groups, size), None if gram else xb, hb, n_tok, o)[..., None]
        if best_err is None:
            best_clip, best_err = clip, err
            continue
        better = err < best_err
        best_clip = o.where(better, clip, best_clip)
        best_err = o.where(better, err, best_err)
    return _unblock(o.clip(wb, -best_clip, best_clip), o, n_in)

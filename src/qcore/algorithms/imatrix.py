"""Importance matrices (llama.cpp's ``imatrix``, PR 4861; ``tools/imatrix/imatrix.cpp``) as a pure value.

The statistic of one weight matrix ``W`` (``[out, in]``, applied as ``y = x @ W.T``) over calibration tokens:

- ``sums[j] = sum over tokens t of x[t, j]**2`` (``in_sum2`` in llama.cpp's files) and ``count`` = the number of
  tokens (llama.cpp's ``counts``: ``ggml_nrows(src1)`` per call, i.e. one per token);
- the weights llama.cpp's quantizer gets (``quant_weights``, what ``qcore.quantize(..., imatrix=)`` takes) are
  ``sums / count``: the mean of ``x**2`` per input column (``llama-quantize``'s ``load_imatrix``). A matrix
  that saw no token has weights 1 (llama.cpp's loader: "partial imatrix data").

Experts (ggml's ``mul_mat_id``: a 3-D weight ``[n_expert, out, in]``): one row of sums and one count per
expert, each over the tokens routed to that expert only (a token routed to ``k`` experts adds its row to each
of the ``k``); ``quant_weights`` is then ``[n_expert, in]``, row ``e`` for expert ``e``'s matrix.

``ImatrixStats(sums, counts)``: ``sums`` float64 ``[n_mat, n]`` (``n_mat`` = 1 for a dense matrix, the expert
count for experts), ``counts`` int64 ``[n_mat]``; numpy, or torch when the updates are handed torch tensors
(then the sums live on the tensors' device). The value type lives in ``qcore.stats`` (the file formats of
``qcore.formats.imatrix`` share it); this module re-exports it. Pure updates: ``update_imatrix(stats, x)``,
``update_imatrix(stats, x, expert_ids=ids)`` and ``merge_imatrices(a, b)`` return new values.

Precision: llama.cpp adds ``x*x`` token by token into float32 sums; qcore squares in float64 and sums each
batch in float64 (the same statistic, without the float32 accumulation error of very long runs: the values
agree to float32 rounding, relative ~1e-7 per addition; files store float32 either way).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qcore._backend import is_torch
from qcore.stats import ImatrixStats

__all__ = ["ImatrixStats", "update_imatrix", "merge_imatrices", "quant_weights"]


def _np(x):
    return x.detach().cpu().numpy() if is_torch(x) else np.asarray(x)


def _rows(n: int, x: Any, name: str = "x"):
    if not (isinstance(x, np.ndarray) or is_torch(x)):
        raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}")
    if len(x.shape) < 1 or x.shape[-1] != n:
        raise ValueError(f"{name} must have its last axis of size {n} (the input columns), got shape "
                         f"{tuple(x.shape)}")
    if is_torch(x):
        if not x.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {x.dtype}")
        import torch

        return x.detach().reshape(-1, n).to(torch.float64)
    if x.dtype.kind != "f":
        raise TypeError(f"{name} must be floating point, got {x.dtype}")
    return np.asarray(x, dtype=np.float64).reshape(-1, n)


def update_imatrix(stats: ImatrixStats, x: Any, *, expert_ids: Any = None) -> ImatrixStats:
    """``stats`` plus the tokens of ``x`` (shape ``[..., n]``, one token per row): a new value.

    Dense (``stats.n_mat == 1``, ``expert_ids`` None): every token adds ``x**2`` and one count. Experts:
    ``expert_ids`` holds the experts each token was routed to (integers, shape ``[tokens]`` or ``[tokens, k]``
    for top-``k`` routing, in ``[0, n_mat)``); expert ``e`` adds ``x**2`` of the tokens routed to it and counts
    them (llama.cpp's ``mul_mat_id`` branch). A non-finite square is refused (llama.cpp stops there too)."""
    if not isinstance(stats, ImatrixStats):
        raise TypeError(f"stats must be an ImatrixStats, got {type(stats).__name__}")
    rows = _rows(stats.n, x)
    sq = rows * rows
    torch_in = is_torch(sq)
    finite = bool(sq.isfinite().all()) if torch_in else bool(np.isfinite(sq).all())
    if not finite:
        raise ValueError("update_imatrix: x holds values whose square is not finite (inf or nan)")
    if expert_ids is None:
        if stats.n_mat != 1:
            raise ValueError(f"update_imatrix: stats has {stats.n_mat} experts; pass expert_ids= (the experts each "
                             f"token was routed to)")
        add = sq.sum(0, keepdim=True) if torch_in else sq.sum(0, keepdims=True)
        cnt = [int(rows.shape[0])]
    else:
        ids = _np(expert_ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"expert_ids must be integers, got {ids.dtype}")
        t = int(rows.shape[0])
        if (t == 0) != (ids.size == 0) or (t and ids.size % t):
            raise ValueError(f"expert_ids must have one row per token ({t}), got shape {ids.shape}")
        ids = ids.astype(np.int64).reshape(t, -1) if t else np.zeros((0, 1), np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= stats.n_mat):
            raise ValueError(f"expert_ids must have one row per token ({rows.shape[0]}) of expert indices in "
                             f"[0, {stats.n_mat}), got shape {ids.shape}"
                             + (f" with values {ids.min()}..{ids.max()}" if ids.size else ""))
        # one-hot routing matrix [tokens, n_mat]: how often each token went to each expert (0 or 1 for top-k)
        route = np.zeros((rows.shape[0], stats.n_mat), np.float64)
        np.add.at(route, (np.repeat(np.arange(rows.shape[0]), ids.shape[1]), ids.reshape(-1)), 1.0)
        cnt = route.sum(0).astype(np.int64).tolist()
        if torch_in:
            import torch

            add = torch.as_tensor(route, device=sq.device).T @ sq
        else:
            add = route.T @ sq
    if torch_in:
        import torch

        sums = (stats.sums if is_torch(stats.sums) else torch.as_tensor(stats.sums)).to(sq.device) + add
        counts = (stats.counts if is_torch(stats.counts) else torch.as_tensor(stats.counts)).to(sq.device) \
            + torch.as_tensor(cnt, dtype=torch.int64, device=sq.device)
        return ImatrixStats(sums, counts)
    return ImatrixStats(_np(stats.sums) + add, _np(stats.counts) + np.asarray(cnt, np.int64))


def merge_imatrices(a: ImatrixStats, b: ImatrixStats) -> ImatrixStats:
    """The statistic of both token sets (sums and counts added: what ranks all-reduce, and what llama.cpp's
    ``--in-file`` merging does)."""
    for name, v in (("a", a), ("b", b)):
        if not isinstance(v, ImatrixStats):
            raise TypeError(f"{name} must be an ImatrixStats, got {type(v).__name__}")
    if tuple(a.sums.shape) != tuple(b.sums.shape):
        raise ValueError(f"merge_imatrices: shapes differ ({tuple(a.sums.shape)} and {tuple(b.sums.shape)})")
    if is_torch(a.sums) and is_torch(b.sums):
        return ImatrixStats(a.sums + b.sums.to(a.sums.device), a.counts + b.counts.to(a.counts.device))
    a, b = a.numpy(), b.numpy()
    return ImatrixStats(a.sums + b.sums, a.counts + b.counts)


def quant_weights(stats: ImatrixStats) -> np.ndarray:
    """llama.cpp's ``quant_weights`` (float32): ``sums / count`` per matrix (the mean of ``x**2``; the sums rounded to
    float32 and divided in float32, as ``llama-quantize`` does with the file's values), 1 for a matrix
    that saw no token; shape ``[n]`` for a dense matrix, ``[n_expert, n]`` for experts. The argument
    ``qcore.quantize(w, spec, imatrix=...)`` takes (row ``e`` for expert ``e``)."""
    if not isinstance(stats, ImatrixStats):
        raise TypeError(f"stats must be an ImatrixStats, got {type(stats).__name__}")
    s = stats.numpy()
    c = s.counts.astype(np.float32)[:, None]  # float32 sums / float32 count: llama-quantize on the file's values
    one = np.float32(1)
    out = np.where(c > 0, s.sums.astype(np.float32) / np.where(c > 0, c, one), one).astype(np.float32)
    return out[0] if s.n_mat == 1 else out

"""Qronos (Zhang, Saab et al., "Qronos: correcting the past by shaping the future", arXiv 2505.11695) as a pure
function: GPTQ-style quantization of a layer whose *inputs* are already perturbed by the quantization of the
layers before it.

Notation (one weight row ``w``; every row is independent): ``X`` = the float model's inputs of the layer
(``[rows, n]``), ``X~`` = the quantized model's inputs of the same layer on the same calibration rows. Qronos
minimises the asymmetric objective ``||X w - X~ q||^2`` over ``q`` on the spec's grid, one column ``t`` at a
time (in processing order), from ``w^(0) = w``:

- correct the past: ``q_t = Q(v_t)``, ``v_t = <X~_t, X w - sum_{j<t} X~_j q_j - sum_{j>t} X~_j w^(t-1)_j> /
  ||X~_t||^2`` (the best value of coordinate ``t`` with the quantized columns and the future held fixed);
- shape the future: ``w^(t)_{>t} = argmin_v ||X w - sum_{j<=t} X~_j q_j - X~_{>t} v||^2`` (least squares).

After the first step the future is the least-squares optimum, so for ``t >= 2`` ``v_t = w^(t-1)_t`` and the
least-squares update is GPTQ's error feedback with ``H~ = X~^T X~`` (the paper's Sec. 4; Quark and Brevitas
compute it so): only the first column differs from GPTQ, where the cross statistics ``C = X^T X~`` enter.
This module computes, in float64 in processing order:

1. ``b = W C + delta W`` (the target ``X w`` seen through ``X~``, plus the ridge below);
2. ``v_1 = (b_1 - W_{>1} Hd_{>1,1}) / Hd_{11}``, ``q_1 = Q(v_1)`` (the scale of its group from the group's current
   values with ``v_1`` in place, or the static / per-row scales);
3. ``W_{>1} <- (b_{>1} - q_1 Hd_{1,>1}) (Hd_{>1,>1})^-1`` (the inverse from ``Hd^-1`` by the Schur complement,
   as Quark's Sherman-Morrison step), column 1 set to ``q_1``;

then runs ``qcore.algorithms.gptq.gptq`` on that weight with ``H~`` (column 1 is already on the grid with its
scale: it quantizes to itself, error zero, and the later columns are exactly GPTQ's on ``H~`` restricted to
them: the trailing block of the upper Cholesky factor of ``Hd^-1`` is that of ``(Hd_{>1,>1})^-1``).

Damping: ``Hd = H~ + delta I`` and the cross term ``C + delta I``, i.e. Qronos on the data augmented with
``sqrt(delta) I`` rows in both ``X`` and ``X~`` (a ridge pulling the solution toward the current weight; Quark
damps its step 2 so, ``G + alpha_damp I``). ``delta = damp * lambda_max(H~)`` (``damp_scale="max_eigenvalue"``,
Quark's ``alpha`` rule, by 30 power iterations from the ones vector) or ``damp * mean(diag H~)``
(``"mean_diagonal"``, GPTQ's rule); a Hessian that does not factor gets tenfold damping, as in GPTQ.

When ``X == X~`` (``C == H~``; no error before the layer), ``v_1 = w_1`` and step 3 is GPTQ's update: Qronos
is GPTQ (with the same damping), up to float rounding.

Statistics: ``stats`` = ``(H~, C)`` as arrays with one normalisation (e.g. both ``sum / count``), or the paired
statistics ``qcore.algorithms.paired.PairedStats`` (``hessian`` = ``sum X~^T X~``, ``cross()`` = ``sum X^T X~``). Every
spec GPTQ takes (``check_gptq_spec``). Two-level specs (NVFP4): the tensor scale is GPTQ's, from the weight
after step 3, so column 1 is re-rounded under it by the loop (its error fed forward as for any column).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

import qcore
from qcore._backend import is_torch

from .gptq import gptq_loop
from .gptq_core import (GPTQResult, HessianStats, as_array, check_gptq_spec, check_loop_options, damped, group_width,
                        lib_of, per_row, symmetrize_, to_numpy)
from .paired import PairedStats

__all__ = ["qronos", "DAMP_SCALES"]

DAMP_SCALES = ("max_eigenvalue", "mean_diagonal")


def _paired(stats, n: int, like):
    """``(H~, C)`` from the accepted forms (arrays as given, not yet copied)."""
    if isinstance(stats, PairedStats):
        if stats.count == 0:
            raise ValueError("stats: no calibration rows were added (count == 0)")
        h, c = stats.hessian, stats.cross()  # raw sums: one normalisation
    elif isinstance(stats, (tuple, list)) and len(stats) == 2:
        h, c = stats
        if isinstance(h, HessianStats):
            raise TypeError("stats: give (H~, C) as two arrays of one normalisation, not a HessianStats (its "
                            "hessian() is 2 * sum / count; C must be scaled the same way)")
    else:
        raise TypeError(f"stats must be (H~, C) (two [n, n] arrays: sum X~^T X~ and sum X^T X~, one normalisation) "
                        f"or a qcore.algorithms.paired.PairedStats, got {type(stats).__name__}")
    h, c = as_array(h, "stats[0] (H~)"), as_array(c, "stats[1] (C)")
    for name, v in (("H~", h), ("C", c)):
        if tuple(v.shape) != (n, n):
            raise ValueError(f"stats: {name} must be [{n}, {n}] for a weight with {n} inputs, got {list(v.shape)}")
        if is_torch(v) != is_torch(like):
            raise TypeError(f"stats: weight and {name} must be the same kind of array (both numpy or both torch)")
    return h, c


def _max_eigenvalue(h, lib, iters: int = 30) -> float:
    """The largest eigenvalue of the symmetric PSD ``h`` by power iteration from the ones vector (Quark's rule;
    an estimate from below)."""
    c = float(abs(h).max())
    if c == 0.0:
        return 0.0
    hk = h / c
    b = lib.zeros((int(h.shape[0]),), lib.f64, h) + 1.0
    for _ in range(iters):
        b1 = hk @ b
        nrm = float((b1 * b1).sum()) ** 0.5
        b = b1 / (nrm + 1e-12)
    return float((b * (hk @ b)).sum()) * c


def qronos(weight: Any, stats: Any, spec: qcore.QuantSpec, *, block_size: int = 128, damp: float = 1e-3,
           damp_scale: str = "max_eigenvalue", act_order: bool = False, static_groups: bool = False,
           max_retries: int = 8, scale_fn: Optional[Callable[[Any], dict]] = None) -> GPTQResult:
    """Quantize ``weight`` ([out, in], numpy or torch) with Qronos from ``stats`` (``(H~, C)``: ``X~^T X~`` and
    ``X^T X~`` of the quantized and float inputs, one normalisation; see the module docstring) to ``spec``.

    Options as ``gptq`` (``block_size``, ``act_order``: columns by descending ``H~`` diagonal, ``static_groups``,
    ``max_retries``, ``scale_fn``); ``damp`` relative to ``damp_scale`` (``"max_eigenvalue"`` of ``H~``, Quark's
    ``alpha``; or ``"mean_diagonal"``, GPTQ's). Returns a ``GPTQResult`` (``damp``: the damping used relative to
    ``mean(diag H~)``, as GPTQ reports it; ``loss``: GPTQ's objective over the columns after the first)."""
    return _qronos(weight, stats, spec, block_size=block_size, damp=damp, damp_scale=damp_scale,
                   act_order=act_order, static_groups=static_groups, max_retries=max_retries, scale_fn=scale_fn,
                   reference=False)


def _qronos(weight, stats, spec, *, block_size, damp, damp_scale, act_order, static_groups, max_retries, scale_fn,
            reference):
    weight = as_array(weight, "weight")
    if not (weight.dtype.is_floating_point if is_torch(weight) else np.issubdtype(weight.dtype, np.floating)):
        raise TypeError(f"weight must be floating point, got dtype {weight.dtype}")
    shape = tuple(int(s) for s in weight.shape)
    check_gptq_spec(spec, shape)
    n_out, n = shape
    h_in, c_in = _paired(stats, n, weight)
    check_loop_options(block_size, damp, max_retries)
    if damp_scale not in DAMP_SCALES:
        raise ValueError(f"damp_scale must be one of {DAMP_SCALES}, got {damp_scale!r}")
    for name, v in (("act_order", act_order), ("static_groups", static_groups)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {v!r}")
    if scale_fn is not None and not callable(scale_fn):
        raise TypeError(f"scale_fn must be callable or None, got {type(scale_fn).__name__}")
    lib = lib_of(weight)
    if is_torch(weight):
        h_in, c_in = h_in.to(weight.device), c_in.to(weight.device)
    for name, v in (("stats H~", h_in), ("stats C", c_in), ("weight", weight)):
        if not lib.finite(v):
            raise ValueError(f"{name} holds NaN or Inf")

    # ---- the same preparation as gptq (H~ symmetrised, dead inputs, order) -----------------------------------
    W0 = lib.cast(weight, lib.f64)  # the float target X w uses the weight as given
    H = lib.cast(h_in, lib.f64)
    symmetrize_(H)
    h_gptq = lib.cast(H, lib.f64)  # what gptq receives (it repeats these steps and finds the same order)
    C = lib.cast(c_in, lib.f64)
    W32 = lib.cast(weight, lib.f32)
    dead = lib.diag(H) == 0
    if bool(dead.any()):
        idx = lib.index(np.flatnonzero(to_numpy(dead)), W32)
        H[idx, idx] = 1.0
        W32[:, idx] = 0.0
    W = lib.cast(W32, lib.f64)
    perm = lib.argsort_desc(lib.diag(H)) if act_order else lib.index(np.arange(n), W)
    perm_np = to_numpy(perm)
    c0 = int(perm_np[0])  # the first column in processing order (original index)
    Hp = H[perm][:, perm]
    mean_diag = float(lib.diag(Hp).mean())  # as gptq computes it (after the permutation)
    ref = _max_eigenvalue(Hp, lib) if damp_scale == "max_eigenvalue" else mean_diag
    rel = float(damp) * ref / mean_diag  # damping relative to mean(diag), the unit gptq takes
    Hinv = None
    for _ in range(int(max_retries) + 1):
        low = lib.cholesky_lower(damped(Hp, rel * mean_diag, lib))
        if low is not None:
            Hinv = lib.chol_inverse(low)
            low = None
            if lib.finite(Hinv) and lib.upper_chol(Hinv) is not None:
                break
        Hinv = None
        rel = max(rel * 10.0, 1e-6)
    if Hinv is None:
        raise ValueError(f"Qronos: H~ is not positive definite even with damping {rel:g} x mean(diag); check the "
                         f"calibration data")
    delta = rel * mean_diag
    Hd = damped(Hp, delta, lib)
    Wp, W0p = W[:, perm], W0[:, perm]

    # ---- step 1: correct the past (column 1 against the float target through the cross term) -------------------
    b = W0p @ C[perm][:, perm] + delta * Wp  # [n_out, n]: <X w, X~_j> + delta w_j (the augmented rows)
    v1 = (b[:, 0] - Wp[:, 1:] @ Hd[1:, 0]) / Hd[0, 0]

    two_level = bool(spec.two_level)
    width = group_width(spec, n)

    def own_params(part):
        if scale_fn is not None:
            return dict(scale_fn(part))
        q = qcore.quantize(part, spec)
        return {"scale": q.scales, "zero_point": q.zero_points}

    presets: list = []
    q1 = None
    if not two_level:
        cur = lib.cast(W32, lib.f32)
        cur[:, c0] = v1.to(lib.f32) if is_torch(v1) else v1.astype(np.float32)
        if width is None:
            presets = [own_params(cur)]
            kw = presets[0]
        elif static_groups:  # every group from the weight before the loop (as gptq's static groups)
            presets = [own_params(W32[:, g * width:min(n, (g + 1) * width)]) for g in range(-(-n // width))]
            kw = presets[c0 // width]
        else:
            g0 = c0 // width
            presets = [own_params(cur[:, g0 * width:min(n, (g0 + 1) * width)])]
            kw = presets[0]
        f = qcore.fake_quantizer(_row_spec(spec), shape=(n_out, 1), scale=per_row(kw["scale"], n_out),
                                 zero_point=per_row(kw.get("zero_point"), n_out), like=W32 if is_torch(W32) else None)
        q1 = f(cur[:, c0:c0 + 1])[:, 0]
        q1_64 = lib.cast(q1, lib.f64)
    else:
        # two-level specs: GPTQ's tensor scale comes from the weight it is given (by scale_fn's rule, if any);
        # column 1's value here is v_1 rounded by the spec's own rule with the tensor scale of the current weight
        # (the loop re-rounds it)
        cur = lib.cast(W32, lib.f32)
        cur[:, c0] = v1.to(lib.f32) if is_torch(v1) else v1.astype(np.float32)
        q1_64 = lib.cast(qcore.fake_quantize(cur, spec)[:, c0], lib.f64)

    # ---- step 2: shape the future (least squares for the later columns with column 1 fixed) --------------------
    A = Hinv[1:, 1:] - (Hinv[1:, 0][:, None] * Hinv[0, 1:][None, :]) / Hinv[0, 0]  # (Hd_{>1,>1})^-1
    Hinv = None
    Wp_new = lib.zeros((n_out, n), lib.f64, W)
    Wp_new[:, 1:] = (b[:, 1:] - q1_64[:, None] * Hd[0, 1:][None, :]) @ A
    Wp_new[:, 0] = q1_64
    A = b = Hd = None
    inv = np.empty(n, np.int64)
    inv[perm_np] = np.arange(n)
    W_after = Wp_new[:, lib.index(inv, W)]
    W_after = W_after.to(lib.f32) if is_torch(W_after) else W_after.astype(np.float32)
    if bool(dead.any()):
        W_after[:, lib.index(np.flatnonzero(to_numpy(dead)), W_after)] = 0.0

    # ---- the later columns: GPTQ on H~ (the first group's scales as decided above) -----------------------------
    pending = list(presets)

    def loop_scale_fn(part):
        if pending:
            return pending.pop(0)
        return own_params(part)

    r = gptq_loop(W_after, h_gptq, spec, block_size=block_size, damp=rel, act_order=act_order,
                  static_groups=static_groups, max_retries=max_retries,
                  scale_fn=scale_fn if two_level else loop_scale_fn, reference=reference)
    return r


def _row_spec(spec):
    import dataclasses

    return dataclasses.replace(spec, granularity=qcore.PerChannel(0))


def _reference_qronos(weight: Any, stats: Any, spec, **kw) -> GPTQResult:
    """``qronos`` with GPTQ's column loop as first landed (``_columns_reference``; GPU tensors use it anyway)."""
    kw.setdefault("block_size", 128)
    kw.setdefault("damp", 1e-3)
    kw.setdefault("damp_scale", "max_eigenvalue")
    kw.setdefault("act_order", False)
    kw.setdefault("static_groups", False)
    kw.setdefault("max_retries", 8)
    kw.setdefault("scale_fn", None)
    return _qronos(weight, stats, spec, reference=True, **kw)

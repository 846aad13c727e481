"""GPTAQ (asymmetric calibration; Li et al., "GPTAQ: Efficient Finetuning-Free Quantization for Asymmetric
Calibration", arXiv 2504.02692, "GPTQv2") as a pure function.

GPTQ quantizes a layer against its inputs in the quantized model, ``X~``, minimising ``||(W - Q) X~||``: the
error the earlier quantized layers left in ``X~`` is taken as the truth. GPTAQ minimises ``||W X - Q X~||``
(``X``: the float model's inputs of the same module on the same tokens), so each column's quantization also
absorbs that input mismatch. Statistics: ``qcore.algorithms.paired.PairedStats`` (``H~ = sum X~^T X~`` and
``dXXT = sum (X - X~)^T X~``, token rows; scaled by ``2 / count`` as GPTQ scales its Hessian).

The update (activations as token rows, a weight row ``w`` over input columns; ``F``: the columns after ``q``):
quantizing column ``q`` (current value ``w_q``, quantized ``q(w_q)``) moves the later columns by

    dw_F = -(w_q - q(w_q)) / [H_{q:}^-1]_qq * [H_{q:}^-1]_{q,F}  +  alpha * w_q * dXXT_{q,F} H_{FF}^-1

(the first term is GPTQ's: the optimal correction of the later columns for column ``q``'s rounding error; the
second is the least-squares correction of the later columns for column ``q``'s input mismatch
``w_q (X_q - X~_q)``, ``H_{FF}`` the damped ``H~`` restricted to the later columns; ``alpha`` scales it, 0.25 by
default as in the paper, Quark and GPTQModel). With ``U`` the upper Cholesky factor of ``H^-1`` (GPTQ's), row
``q`` of ``H_{q:}^-1`` is ``U_qq U_{q,q:}`` and ``H_{FF}^-1 = U_FF^T U_FF``, so both terms come from ``U`` and one
matrix computed once, ``P = alpha * triu(dXXT U^T, 1) U`` (row ``q`` of ``P`` is ``alpha dXXT_{q,F} H_FF^-1``; float32 products of the float64 statistics and factor):

    dw_{q:} = -((w_q - q(w_q)) / U_qq) U_{q,q:} + w_q P_{q,q:}

and GPTQ's lazy batches apply to both (``_columns``): inside a block of ``block_size`` columns each column's
update is applied to the block's later columns at once; the later blocks receive ``Err1 @ U`` and ``W0 @ P`` per
block, ``Err1`` the block's scaled errors and ``W0`` its columns' values *when each was quantized* (the values
the per-column update multiplies). The result therefore does not depend on ``block_size`` (up to float32
rounding), and equals the column-by-column update above (tests/algorithms/test_gptaq.py checks it against a
direct float64 transcription with explicit inverses). Quark 0.13, GPTQModel and the paper's code apply the
later blocks' ``P`` term with the block's *quantized* values instead (their ``W1`` after the block loop), which
makes their result depend on ``block_size``; ours follows the paper's update.

Everything else is GPTQ's (``qcore.algorithms.gptq``): dead inputs, ``act_order`` (by descending ``diag H~``;
``dXXT`` permuted with it), damping ``damp * mean(diag H~)`` grown tenfold until the Cholesky factorisations
succeed, scales of the spec computed from the current (compensated) values when a group is first reached (or
from the weight before the loop with ``static_groups``), ``scale_fn``, every spec ``check_gptq_spec`` accepts,
and the result a ``GPTQResult`` whose QTensor dequantizes to the loop's values bit for bit. With ``X == X~``
(``dXXT == 0``) or ``alpha == 0`` the result equals ``gptq``'s on numpy inputs (the same float32 operations; a
subtracted ``0`` is the only difference).

As in GPTQ's CPU loop, the matrix work (factorisations, ``P``, the block products) runs in the input's own
library (numpy, or torch on the CPU) and the per-column steps as numpy operations on views of the same memory;
torch GPU inputs are copied to the CPU for the loop and the result is returned on the weight's device. torch is
never imported here.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Optional

import numpy as np

import qcore
from qcore import PerChannel, QuantSpec
from qcore._backend import is_torch

from .gptq_core import (GPTQResult, as_array, assemble, check_gptq_spec, check_loop_options, dead_inputs, group_setup,
                        lib_of, numpy_column_quantizers, numpy_view, symmetrize_, to_numpy, upper_factor)
from .paired import PairedStats

__all__ = ["gptaq"]


def _check_alpha(alpha) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"alpha must be a non-negative finite number (the weight of the input-mismatch "
                         f"correction; 0.25 in the paper), got {alpha!r}")
    return float(alpha)


def _cpu_f64(a, torch_like: bool):
    """``a`` as a new float64 array of the weight's kind, on the CPU."""
    if torch_like:
        import torch
        t = a if is_torch(a) else torch.from_numpy(np.asarray(a))
        return t.detach().to(device="cpu", dtype=torch.float64, copy=True)
    return to_numpy(a).astype(np.float64, copy=True)


def _stats_arrays(stats, n: int, torch_like: bool):
    """``(H~, dXXT)`` as new float64 CPU arrays of the weight's kind (scaled as ``PairedStats.scaled``)."""
    if isinstance(stats, PairedStats):
        h, d = stats.scaled()
    elif isinstance(stats, tuple) and len(stats) == 2:
        h, d = (as_array(stats[0], "stats[0] (H~)"), as_array(stats[1], "stats[1] (dXXT)"))
    else:
        raise TypeError(f"stats must be a PairedStats or a pair (H~, dXXT) of [in, in] arrays, got "
                        f"{type(stats).__name__}")
    out = []
    for name, a in (("H~", h), ("dXXT", d)):
        if tuple(a.shape) != (n, n):
            raise ValueError(f"stats {name} must be [{n}, {n}] for a weight with {n} input columns, got "
                             f"{list(a.shape)}")
        a = _cpu_f64(a, torch_like)
        if not lib_of(a).finite(a):
            raise ValueError(f"stats {name} holds NaN or Inf")
        out.append(a)
    return out


def _triu1(x):
    return x.triu(1) if is_torch(x) else np.triu(x, 1)


def gptaq(weight: Any, stats: Any, spec: QuantSpec, *, alpha: float = 0.25, block_size: int = 128,
          damp: float = 0.01, act_order: bool = False, static_groups: bool = False, max_retries: int = 8,
          scale_fn: Optional[Callable[[Any], dict]] = None) -> GPTQResult:
    """Quantize ``weight`` ([out, in], numpy or torch) with GPTAQ to ``spec`` from the paired statistics
    ``stats`` (a ``PairedStats``, or a pair ``(H~, dXXT)`` of ``[in, in]`` arrays already scaled alike). See the
    module docstring; the options are ``gptq``'s, plus ``alpha`` (the weight of the input-mismatch term)."""
    weight = as_array(weight, "weight")
    if not (weight.dtype.is_floating_point if is_torch(weight) else np.issubdtype(weight.dtype, np.floating)):
        raise TypeError(f"weight must be floating point, got dtype {weight.dtype}")
    shape = tuple(int(s) for s in weight.shape)
    check_gptq_spec(spec, shape)
    alpha = _check_alpha(alpha)
    check_loop_options(block_size, damp, max_retries)
    for name, v in (("act_order", act_order), ("static_groups", static_groups)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {v!r}")
    if scale_fn is not None and not callable(scale_fn):
        raise TypeError(f"scale_fn must be callable or None, got {type(scale_fn).__name__}")
    n_out, n = shape
    tl = is_torch(weight)
    H, D = _stats_arrays(stats, n, tl)
    lib = lib_of(H)
    if tl:
        import torch
        device = weight.device
        W = weight.detach().to(device="cpu", dtype=torch.float32, copy=True)
    else:
        W = np.asarray(weight).astype(np.float32, copy=True)
    if not lib.finite(W):
        raise ValueError("weight holds NaN or Inf")

    symmetrize_(H)
    idx = dead_inputs(W, H, lib)
    if idx is not None:
        D[:, idx] = 0.0
    two_level, tensor_scale, width, params_of, group_params = group_setup(W, spec, n, scale_fn, static_groups)

    perm = None
    if act_order:
        perm = lib.argsort_desc(lib.diag(H))
        W = W[:, perm]
        H = H[perm]
        H = H[:, perm]
        D = D[perm]
        D = D[:, perm]
    perm_np = None if perm is None else to_numpy(perm)
    U, rel = upper_factor(H, damp, max_retries, lib, who="GPTAQ")
    H = None
    # row q of P: alpha * dXXT[q, F] (H_FF)^-1 over the later columns F (module docstring); float32 products
    # (P is a correction used in float32 by the loop; two [n, n] float64 products cost as much as the rest)
    D = D.to(lib.f32) if tl else D.astype(np.float32)
    P = _triu1(D @ U.T) @ U
    P *= np.float32(alpha) if not tl else alpha
    D = None
    if not lib.finite(P):
        raise ValueError("GPTAQ: the input-mismatch correction overflowed (dXXT much larger than H~?)")

    orig = np.arange(n) if perm_np is None else perm_np
    group_of = np.zeros(n, np.int64) if width is None else orig // width
    pos_of = np.empty(n, np.int64)
    pos_of[orig] = np.arange(n)
    Q, loss = _columns(W, U, P, lib, n_out, n, block_size, width, group_of, pos_of, group_params, params_of, spec,
                       two_level)
    if perm is not None:
        inv = np.empty(n, np.int64)
        inv[perm_np] = np.arange(n)
        Q = Q[:, lib.index(inv, Q)]
    if tl and device.type != "cpu":
        Q = Q.to(device)
        group_params = [{k: (v.to(device) if is_torch(v) else v) for k, v in p.items()} for p in group_params]
        tensor_scale = tensor_scale.to(device) if is_torch(tensor_scale) else tensor_scale
    final = assemble(Q, spec, group_params, width, two_level, tensor_scale)
    deq = qcore.dequantize(final)
    same = bool((deq == Q).all()) if is_torch(Q) else bool(np.array_equal(deq, Q))
    if not same:
        raise RuntimeError(f"GPTAQ: the quantized columns differ from quantize(spec={spec.name or spec.dtype.name}) "
                           f"with the same scales; please report this")
    return GPTQResult(final, deq, rel, loss)


def _columns(W, U, P, lib, n_out, n, block_size, width, group_of, pos_of, group_params, params_of, spec, two_level):
    """The column loop on the CPU: GPTQ's ``_columns_fast`` with the input-mismatch term (per-column steps as numpy
    operations on views, block products in the arrays' own library). ``W`` is updated in place; returns
    ``(Q, loss)`` (``loss``: GPTQ's ``sum(err^2) / 2`` of the scaled errors)."""
    row_spec = dataclasses.replace(spec, granularity=PerChannel(0))
    quantizer = numpy_column_quantizers(W, lib, n_out, group_params, spec, two_level, row_spec)
    Un, Pn = numpy_view(U), numpy_view(P)
    Q = lib.zeros((n_out, n), lib.f32, W)
    loss = 0.0
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        b = i2 - i1
        W1T = lib.zeros((b, n_out), lib.f32, W)  # the block, transposed: column i is a contiguous row
        W1T[:] = W[:, i1:i2].T
        Q1T = lib.zeros((b, n_out), lib.f32, W)
        Err1 = lib.zeros((n_out, b), lib.f32, W)  # scaled errors (w - q) / U_ii
        W01 = lib.zeros((n_out, b), lib.f32, W)  # each column's value when it was quantized (the P term's factor)
        w1t, q1t, e1, w01 = numpy_view(W1T), numpy_view(Q1T), numpy_view(Err1), numpy_view(W01)
        U1, P1 = Un[i1:i2, i1:i2], Pn[i1:i2, i1:i2]
        for i in range(b):
            gi = int(group_of[i1 + i])
            if group_params[gi] is None:
                group_params[gi] = params_of(_first_touch(gi, i, i1, i2, W, W1T, Err1, W01, U, P, lib, n_out, n,
                                                          width, pos_of))
            w = w1t[i].reshape(n_out, 1)
            q = quantizer(gi)(w)
            q1t[i] = q[:, 0]
            err = (w - q) / U1[i, i]
            e1[:, i] = err[:, 0]
            w01[:, i] = w[:, 0]
            if i + 1 < b:
                w1t[i + 1:] -= U1[i, i + 1:, None] * err[:, 0][None, :] - P1[i, i + 1:, None] * w[:, 0][None, :]
        Q[:, i1:i2] = Q1T.T
        e64 = lib.cast(Err1, lib.f64)
        loss += 0.5 * float((e64 * e64).sum())
        if i2 < n:
            W[:, i2:] -= Err1 @ U[i1:i2, i2:] - W01 @ P[i1:i2, i2:]
    return Q, loss


def _first_touch(gi, i, i1, i2, W, W1T, Err1, W01, U, P, lib, n_out, n, width, pos_of):
    """The current values of group ``gi``'s columns when the loop first reaches one of them (block column ``i``
    of ``[i1, i2)``): block columns from the block's working copy, later columns from ``W`` with the updates of
    this block's columns so far, which the lazy batch has not applied yet (both terms)."""
    cols = np.arange(gi * width, min(n, (gi + 1) * width))
    p = pos_of[cols]
    part = lib.zeros((n_out, len(cols)), lib.f32, W)
    inb = (p >= i1) & (p < i2)
    if inb.any():
        part[:, lib.index(np.flatnonzero(inb), W)] = W1T[lib.index(p[inb] - i1, W)].T
    if (~inb).any():
        pp = lib.index(p[~inb], W)
        cur = W[:, pp]
        if i > 0:
            cur = cur - (Err1[:, :i] @ U[i1:i1 + i][:, pp] - W01[:, :i] @ P[i1:i1 + i][:, pp])
        part[:, lib.index(np.flatnonzero(~inb), W)] = cur
    return part

"""GPTQ (Frantar et al., arXiv 2210.17323) as pure functions: Hessian statistics built by pure updates, and the
column-by-column quantization with error feedback, for every qcore weight spec.

Statistics (``qcore.algorithms.gptq_core``, re-exported here): ``HessianStats``, the running sum of ``x^T x``
over calibration rows (float64) and the row count, a frozen value; ``HessianStats.empty(n)``,
``update_hessian(stats, x)`` (a new value), ``merge_hessians(a, b)`` (sums: this is what ranks all-reduce).

The algorithm, ``gptq(weight, hessian, spec)`` on a weight in the canonical ``[out, in]`` layout:

1. dead inputs (``H[j, j] == 0``: the feature is always zero) get ``H[j, j] = 1`` and a zero weight column;
2. ``act_order``: columns are processed by descending ``H[j, j]``;
3. damping: ``H + damp * mean(diag H) * I``; when the Cholesky factorisation fails (``H`` not positive
   definite in floating point) the damping grows tenfold and the factorisation is retried, up to 8 times (a
   finite ``H`` then always factors); the damping used is returned;
4. ``U`` = the upper Cholesky factor of ``H^-1`` (float64; the loop runs in float32);
5. blocks of ``block_size`` columns with lazy batch updates: inside a block each column ``w`` is quantized to
   ``q``, its error ``(w - q) / U[j, j]`` is spread over the block's remaining columns, and the block's errors
   update the later columns once per block. On the CPU (numpy, or torch CPU tensors) the per-column steps run
   as numpy operations on views of the same memory (``_columns_fast``: the same float32 operations element by
   element, so the same bits as the loop as first landed, ``_columns_reference``, which GPU tensors keep and
   ``_reference_gptq`` runs; tests/algorithms/test_gptq_fast.py compares them on every kind of spec).

Scales come from qcore's own scale rule for the spec (``qcore.quantize``), applied to the *current* (already
error-compensated) weights:

- scales spanning whole input rows (``PerTensor``, ``PerChannel(0)``; and the tensor scale of two-level specs
  such as NVFP4) are computed once from the weight before the loop;
- scales of groups along the input axis (``PerGroup(size, axis=1)``, ``PerBlock``, MX and NVFP4 blocks, ragged
  last groups, ``PerChannel(1)``) are computed when the loop first reaches a column of the group, from the
  group's current values (exact, including the updates still pending in the lazy batch). With ``act_order``
  the groups stay the contiguous groups of the spec (no ``g_idx`` is needed to load the result);
  ``static_groups=True`` instead computes every group's scale from the weight before the loop (Quark's
  ``static_groups``).

Each column is quantized by qcore's exact quantization for the spec with those scales (``fake_quantize``), and
the result is ``quantize(W_q, spec, scale=..., zero_point=..., tensor_scale=...)`` of the whole quantized
weight, so exporting it reproduces the same values bit for bit.

The pieces GPTQ shares with its other flavours (``gptq_gguf``, ``gptaq``, ``qronos``): the statistics, the checks,
the damping and factorisation (steps 1-4), the scale groups and column quantizers, are in
``qcore.algorithms.gptq_core``; this module is the column loop (``gptq_loop``) and the entry ``gptq``, which hands
GGUF specs to ``qcore.algorithms.gptq_gguf``.

Every function takes numpy arrays or torch tensors (CPU or GPU) through the same code; torch is never imported
here. Not supported (``ValueError`` before any work): stochastic rounding and shared-microexponent specs
(MX9/MX6/MX4), whose per-column quantization is not determined by a block scale.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import numpy as np

import qcore
from qcore import PerChannel, QuantSpec
from qcore._backend import is_torch

from .gptq_core import (GPTQResult, HessianStats, as_array, assemble, check_gptq_spec, checked_hessian, dead_inputs,
                        group_first_touch, group_setup, merge_hessians, numpy_column_quantizers, numpy_view,
                        per_row, symmetrize_, to_numpy, update_hessian, upper_factor)
from .gptq_gguf import gptq_gguf

__all__ = ["HessianStats", "update_hessian", "merge_hessians", "gptq", "GPTQResult", "check_gptq_spec"]


def gptq(weight: Any, hessian: Any, spec: QuantSpec, *, block_size: int = 128, damp: float = 0.01,
         act_order: bool = False, static_groups: bool = False, max_retries: int = 8,
         scale_fn: Optional[Callable[[Any], dict]] = None, imatrix: Any = None) -> GPTQResult:
    """Quantize ``weight`` ([out, in], numpy or torch) with GPTQ against ``hessian`` (a ``HessianStats`` or an
    ``[in, in]`` array) to ``spec``. See the module docstring for the algorithm.

    ``scale_fn(w_part) -> dict``: optional scale rule (``quantize`` keyword arguments: ``scale``,
    ``zero_point``) for a slice of the weight covering whole scale groups, used instead of the spec's own rule
    (e.g. an MSE-clipped scale). Two-level specs: ``scale_fn(weight)`` is called once first, and the
    ``tensor_scale`` of its result (default: the spec's own) is the loop's; every group is then
    ``scale_fn(part, tensor_scale=g)`` (``qcore.stats.four_over_six`` fits that protocol).

    GGUF specs (``spec.gguf``: k-quants, Q4_0 ... Q8_0, IQ4_NL) run llama.cpp's scale search per block inside the
    loop (``qcore.algorithms.gptq_gguf``), weighted by ``imatrix`` (per-column importance, llama.cpp's
    ``quant_weights``) when given, else by the Hessian's diagonal; ``scale_fn`` does not apply to them."""
    if isinstance(spec, QuantSpec) and spec.gguf:
        if scale_fn is not None:
            raise ValueError(f"scale_fn: a GGUF spec ({spec.gguf}) takes its scales from llama.cpp's search")
        return gptq_gguf(weight, hessian, spec, imatrix=imatrix, block_size=block_size, damp=damp,
                         act_order=act_order, static_groups=static_groups, max_retries=max_retries)
    if imatrix is not None:
        what = getattr(spec, "name", "") or getattr(getattr(spec, "dtype", None), "name", spec)
        raise ValueError(f"imatrix= applies to GGUF specs (q2_k ... q6_k, q4_0 ... q8_0, iq4_nl) only; spec "
                         f"{what!r} is not one")
    return gptq_loop(weight, hessian, spec, block_size=block_size, damp=damp, act_order=act_order,
                     static_groups=static_groups, max_retries=max_retries, scale_fn=scale_fn, reference=False)


def _reference_gptq(weight: Any, hessian: Any, spec: QuantSpec, **kw) -> GPTQResult:
    """``gptq`` with the column loop as first landed (``_columns_reference``): what the fast CPU loop is tested
    against (bit for bit)."""
    return gptq_loop(weight, hessian, spec, reference=True, **kw)


def gptq_loop(weight, hessian, spec, *, block_size: int = 128, damp: float = 0.01, act_order: bool = False,
              static_groups: bool = False, max_retries: int = 8, scale_fn=None,
              reference: bool = False) -> GPTQResult:
    """GPTQ's column loop with the spec's own scale rule (or ``scale_fn``'s): what ``gptq`` runs for every spec but
    GGUF's (no ``imatrix``, no dispatch), and what Qronos runs after its first column. The options are ``gptq``'s;
    ``reference=True`` runs the loop as first landed (``_columns_reference``) on every device."""
    weight = as_array(weight, "weight")
    if not (weight.dtype.is_floating_point if is_torch(weight) else np.issubdtype(weight.dtype, np.floating)):
        raise TypeError(f"weight must be floating point, got dtype {weight.dtype}")
    shape = tuple(int(s) for s in weight.shape)
    check_gptq_spec(spec, shape)
    h_in, lib = checked_hessian(weight, hessian, shape, block_size, damp, max_retries)

    n_out, n = shape
    W = lib.cast(weight, lib.f32)
    # at most three float64 [n, n] arrays at once here (13B's down_proj: 1.5 GB each): H, and the damped copy /
    # its Cholesky factor / the inverse / its factor two at a time; every step gives the whole-matrix
    # expressions' values bit for bit (symmetrize_, damped)
    if isinstance(hessian, HessianStats) and h_in.dtype == lib.f64 and h_in is not hessian.sum:
        H = h_in  # hessian() computed a new float64 array: ours to change in place
    else:
        H = lib.cast(h_in, lib.f64)
    h_in = None
    symmetrize_(H)  # H = (H + H.T) * 0.5
    dead_inputs(W, H, lib)
    two_level, tensor_scale, width, params_of, group_params = group_setup(W, spec, n, scale_fn, static_groups)

    perm = None
    if act_order:
        perm = lib.argsort_desc(lib.diag(H))
        W = W[:, perm]
        H = H[perm]  # H[perm][:, perm] in two steps: the first copy is freed before the second is made
        H = H[:, perm]
    perm_np = None if perm is None else to_numpy(perm)
    U, rel = upper_factor(H, damp, max_retries, lib, who="GPTQ")
    H = None

    # column j (in processing order) -> original column, group
    orig = np.arange(n) if perm_np is None else perm_np
    group_of = np.zeros(n, np.int64) if width is None else orig // width
    quantizers: dict = {}

    row_spec = dataclasses.replace(spec, granularity=PerChannel(0))

    def col_quantizer(gi):
        f = quantizers.get(gi)
        if f is None:
            kw = group_params[gi]
            if two_level:
                def f(col, kw=kw):
                    return qcore.fake_quantize(col, spec, **kw)
            else:
                # a column's elements each use their row's scale: the same element arithmetic as the spec's own
                # granularity, through the direct per-row kernel (the final quantize() of the whole weight with
                # the spec checks nothing changed)
                like = W if is_torch(W) else None
                f = qcore.fake_quantizer(row_spec, shape=(n_out, 1), scale=per_row(kw["scale"], n_out),
                                         zero_point=per_row(kw.get("zero_point"), n_out), like=like)
            quantizers[gi] = f
        return f

    # processing position of each original column (to locate a group's columns in W during the loop)
    pos_of = np.empty(n, np.int64)
    pos_of[orig] = np.arange(n)
    fast = not reference and (not is_torch(W) or W.device.type == "cpu")
    columns = _columns_fast if fast else _columns_reference
    Q, loss = columns(W, U, lib, n_out, n, block_size, width, group_of, pos_of, group_params, params_of,
                      col_quantizer if not fast else None, spec, two_level, row_spec)

    if perm is not None:
        inv = np.empty(n, np.int64)
        inv[perm_np] = np.arange(n)
        Q = Q[:, lib.index(inv, Q)]
    final = assemble(Q, spec, group_params, width, two_level, tensor_scale)
    deq = qcore.dequantize(final)
    same = bool((deq == Q).all()) if is_torch(Q) else bool(np.array_equal(deq, Q))
    if not same:  # an internal error: the columns were not quantized as the spec quantizes the whole weight
        raise RuntimeError(f"GPTQ: the quantized columns differ from quantize(spec={spec.name or spec.dtype.name}) "
                           f"with the same scales; please report this")
    return GPTQResult(final, deq, rel, loss)


def _columns_reference(W, U, lib, n_out, n, block_size, width, group_of, pos_of, group_params, params_of,
                       col_quantizer, spec, two_level, row_spec):
    """The column loop as first landed (every backend and device; the fast CPU loop ``_columns_fast`` is
    tested against it): ``(Q, loss)``. ``W`` is updated in place."""
    Q = lib.zeros((n_out, n), lib.f32, W)
    loss = 0.0
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1 = W[:, i1:i2].clone() if is_torch(W) else W[:, i1:i2].copy()
        Q1 = lib.zeros((n_out, i2 - i1), lib.f32, W)
        Err1 = lib.zeros((n_out, i2 - i1), lib.f32, W)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            gi = int(group_of[j])
            if group_params[gi] is None:
                # first touch of this group: its current values (block columns from W1; later columns from W
                # minus the updates of this block's columns so far, which the lazy batch has not applied yet)
                cols = np.arange(gi * width, min(n, (gi + 1) * width))
                p = pos_of[cols]
                part = lib.zeros((n_out, len(cols)), lib.f32, W)
                inb = (p >= i1) & (p < i2)
                if inb.any():
                    k = np.flatnonzero(inb)
                    part[:, lib.index(k, W)] = W1[:, lib.index(p[inb] - i1, W)]
                if (~inb).any():
                    k = np.flatnonzero(~inb)
                    pp = lib.index(p[~inb], W)
                    cur = W[:, pp]
                    if i > 0:
                        cur = cur - Err1[:, :i] @ U[i1:j][:, pp]
                    part[:, lib.index(k, W)] = cur
                group_params[gi] = params_of(part)
            w = W1[:, i:i + 1]
            q = col_quantizer(gi)(w)
            Q1[:, i:i + 1] = q
            d = U1[i, i]
            err = (w - q) / d
            W1[:, i:] -= err @ U1[i:i + 1, i:]
            Err1[:, i:i + 1] = err
        Q[:, i1:i2] = Q1
        e64 = lib.cast(Err1, lib.f64)
        loss += 0.5 * float((e64 * e64).sum())  # once per block: no host sync per column
        if i2 < n:
            W[:, i2:] -= Err1 @ U[i1:i2, i2:]

    return Q, loss


def _columns_fast(W, U, lib, n_out, n, block_size, width, group_of, pos_of, group_params, params_of,
                  col_quantizer, spec, two_level, row_spec):
    """``_columns_reference`` on the CPU with the same bits and far fewer operations per column.

    The per-column steps (quantize the column, its error, the rank-1 update of the block's later columns) are
    element-wise: each result element is one correctly rounded float32 operation (the rank-1 "matmul" has one
    product per element), so they run as numpy operations on views of the same memory, which cost about a
    microsecond each instead of a torch dispatch (and never wake a second thread: on a loaded machine every
    parallel region of a tiny op waited for a descheduled thread). The block working copy is kept transposed
    (column ``i`` is a contiguous row) and only the columns after ``i`` are updated (column ``i`` is not read
    again). Every matrix product (the lazy batch update, a group's pending updates at its first touch) and every
    scale computation is the reference's own call on the same arrays in the same layout."""
    Q = lib.zeros((n_out, n), lib.f32, W)
    loss = 0.0
    quantizer = numpy_column_quantizers(W, lib, n_out, group_params, spec, two_level, row_spec)
    Un = numpy_view(U)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        b = i2 - i1
        W1T = lib.zeros((b, n_out), lib.f32, W)
        W1T[:] = W[:, i1:i2].T
        Q1T = lib.zeros((b, n_out), lib.f32, W)
        Err1 = lib.zeros((n_out, b), lib.f32, W)
        w1t, q1t, e1 = numpy_view(W1T), numpy_view(Q1T), numpy_view(Err1)
        U1 = Un[i1:i2, i1:i2]
        for i in range(b):
            gi = int(group_of[i1 + i])
            if group_params[gi] is None:
                group_params[gi] = params_of(group_first_touch(gi, i, i1, i2, W, lambda idx: W1T[lib.index(idx, W)].T,
                                                               Err1, U, lib, n_out, n, width, pos_of))
            w = w1t[i].reshape(n_out, 1)
            q = quantizer(gi)(w)
            q1t[i] = q[:, 0]
            err = (w - q) / U1[i, i]
            e1[:, i] = err[:, 0]
            if i + 1 < b:
                w1t[i + 1:] -= U1[i, i + 1:, None] * err[:, 0][None, :]
        Q[:, i1:i2] = Q1T.T
        e64 = lib.cast(Err1, lib.f64)
        loss += 0.5 * float((e64 * e64).sum())  # once per block: no host sync per column
        if i2 < n:
            W[:, i2:] -= Err1 @ U[i1:i2, i2:]
    return Q, loss

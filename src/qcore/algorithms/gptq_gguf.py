"""GPTQ to GGUF block types (k-quants Q2_K ... Q6_K and the 32-element Q4_0 ... Q8_0, IQ4_NL): llama.cpp's scale
search inside GPTQ's column loop (``qcore.algorithms.gptq.gptq`` dispatches here for ``spec.gguf``).

GPTQ's loop (``qcore.algorithms.gptq``: dead inputs, ``act_order``, damping, the upper Cholesky factor of
``H^-1``, lazy batches of ``block_size`` columns; the pieces from ``qcore.algorithms.gptq_core``, the only GPTQ
module imported here) with the scales of each GGUF block (256 columns for k-quants, 32 otherwise) chosen the way
llama.cpp chooses them:

1. when the loop first reaches a column of a block, llama.cpp's search (``qcore._kquants``: ``make_qkx3_quants``
   / ``make_qx_quants`` / ... with importance weights, the ``quantize_row_*_impl`` path) runs on the block's
   *current* values (the error-compensated weights, updates still pending in the lazy batch included), weighted
   by the importance ``imatrix`` when given, else by the Hessian's diagonal ``diag(H) / 2`` = the mean of
   ``x^2`` per input column, which is what llama.cpp's imatrix holds for the same calibration rows. The block's
   stored scales (a ``GGUFScales``: fp16 ``d``/``dmin``, integer sub-block scale and min codes) are kept;
   ``static_groups=True`` instead searches every block of the weight before the loop;
2. each column is then quantized under those scales by llama.cpp's element rule (``qcore._kquants.
   element_codes``: ``nearest_int((x - offset) / scale)`` clamped for k-quants, Q4_0's ``trunc(x/d + 8.5)``,
   ...), and its error is spread over the later columns as GPTQ does.

The result is a ``QTensor`` of ``spec`` with ``super_scales``: exactly the codes the loop chose and the blocks'
stored scales, so ``qcore.packing.pack_gguf_blocks`` writes ggml's bytes of the GPTQ weight, and requantizing
its values under those scales (what a module's ``freeze`` does) gives the same codes.

When ``H`` is diagonal (no error to spread: ``U`` is diagonal) the result is llama.cpp's quantizer with that
importance: ``qcore.quantize(weight, spec, imatrix=diag(H) / 2 or imatrix)`` (for the 32-element types with
llama.cpp's per-row ``sigma2`` taken from the whole rows of the weight, as here). ``act_order`` keeps the
contiguous GGUF blocks (a block's scales are searched at its first column in the processing order).

The column loop runs on the CPU in numpy (llama.cpp's search is numpy code); the factorisation runs where the
Hessian is. Torch inputs give torch results on the weight's device.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

import qcore
from qcore import QTensor, QuantSpec, _kquants
from qcore._backend import is_torch

from .gptq_core import (GPTQResult, HessianStats, NumpyLib, as_array, checked_hessian, dead_inputs,
                        group_first_touch, symmetrize_, to_numpy, upper_factor)

__all__ = ["gptq_gguf"]


def _importance(imatrix, hessian, n: int) -> np.ndarray:
    """float32 [n]: the given imatrix (checked), else ``diag(H) / 2`` (``HessianStats``: ``diag(sum) / count``)."""
    if imatrix is not None:
        qw = np.asarray(to_numpy(imatrix))
        if qw.dtype.kind not in "fiu":
            raise TypeError(f"imatrix must be a float array, got dtype {qw.dtype}")
        if qw.shape != (n,):
            raise ValueError(f"imatrix must have shape ({n},) (one weight per input column), got shape {qw.shape}")
        qw = qw.astype(np.float32)
        if not (np.isfinite(qw).all() and (qw >= 0).all()):
            raise ValueError("imatrix must hold finite, non-negative weights")
        return qw
    if isinstance(hessian, HessianStats):  # the diagonal taken where the sum lives (no [n, n] copy to the host)
        d = np.asarray(to_numpy(hessian.sum.diagonal())).astype(np.float64) / max(hessian.count, 1)
    else:
        d = np.asarray(to_numpy(hessian.diagonal())).astype(np.float64) / 2.0
    return np.maximum(d, 0.0).astype(np.float32)


def _search(part: np.ndarray, name: str, qw: np.ndarray, sigma2: Optional[np.ndarray]):
    return _kquants.search_blocks(part, name, qw, sigma2=sigma2)


def gptq_gguf(weight: Any, hessian: Any, spec: QuantSpec, *, imatrix: Any = None, block_size: int = 128,
              damp: float = 0.01, act_order: bool = False, static_groups: bool = False,
              max_retries: int = 8):
    """GPTQ of ``weight`` ([out, in], numpy or torch) to the GGUF spec ``spec`` against ``hessian`` (a
    ``HessianStats`` or an ``[in, in]`` array), with llama.cpp's scale search per block weighted by ``imatrix``
    ([in], llama.cpp's ``quant_weights``) or the Hessian's diagonal. See the module docstring. Returns a
    ``qcore.algorithms.gptq_core.GPTQResult``."""
    if not isinstance(spec, QuantSpec) or not spec.gguf:
        raise ValueError(f"gptq_gguf takes a GGUF spec (q2_k ... q6_k, q4_0 ... q8_0, iq4_nl), got {spec!r}")
    weight = as_array(weight, "weight")
    if not (weight.dtype.is_floating_point if is_torch(weight) else np.issubdtype(weight.dtype, np.floating)):
        raise TypeError(f"weight must be floating point, got dtype {weight.dtype}")
    shape = tuple(int(s) for s in weight.shape)
    name = spec.gguf
    t = spec.gguf_dtype
    bs, sub = t.block_size, t.subblock_size
    if len(shape) != 2 or shape[1] % bs:
        raise ValueError(f"GPTQ {name}: weight must be 2-D [out, in] with in a multiple of {bs} (GGUF blocks run "
                         f"along the input axis), got shape {shape}")
    n_out, n = shape
    h_in, lib = checked_hessian(weight, hessian, shape, block_size, damp, max_retries)
    for k, v in (("act_order", act_order), ("static_groups", static_groups)):
        if not isinstance(v, bool):
            raise TypeError(f"{k} must be a bool, got {v!r}")
    qw = _importance(imatrix, hessian if isinstance(hessian, HessianStats) else h_in, n)

    H = lib.cast(h_in, lib.f64)
    h_in = None
    symmetrize_(H)
    W = lib.cast(weight, lib.f32)
    dead_inputs(W, H, lib)
    Wn = W.detach().cpu().numpy().copy() if is_torch(W) else np.asarray(W, dtype=np.float32).copy()
    W = None
    legacy = name in ("q4_0", "q4_1", "q5_0", "q5_1")
    sig = _kquants.row_sigma2(Wn) if legacy else None  # llama.cpp's per-row sigma2, of the whole rows

    ngroups = n // bs
    found: list = [None] * ngroups  # per block: (GGUFScales [n_out, ...], sub scales [n_out, bs/sub], offsets)

    def take(gi, part):
        cols = slice(gi * bs, (gi + 1) * bs)
        _, ss = _search(np.ascontiguousarray(part, dtype=np.float32), name, qw[cols], sig)
        sc, off = _kquants.sub_scales(ss, sub)
        found[gi] = (ss, np.ascontiguousarray(sc, dtype=np.float32),
                     None if off is None else np.ascontiguousarray(off, dtype=np.float32))

    if static_groups:
        for gi in range(ngroups):
            take(gi, Wn[:, gi * bs:(gi + 1) * bs])

    perm = None
    if act_order:
        perm = lib.argsort_desc(lib.diag(H))
        H = H[perm]
        H = H[:, perm]
    perm_np = None if perm is None else (perm.cpu().numpy() if is_torch(perm) else np.asarray(perm))
    U, rel = upper_factor(H, damp, max_retries, lib, who=f"GPTQ {name}")
    H = None
    Un = U.detach().cpu().numpy() if is_torch(U) else np.asarray(U)
    U = None
    if perm_np is not None:
        Wn = np.ascontiguousarray(Wn[:, perm_np])
    orig = np.arange(n) if perm_np is None else perm_np
    pos_of = np.empty(n, np.int64)
    pos_of[orig] = np.arange(n)
    levels = np.asarray(t.levels, dtype=np.float32) if t.levels else None
    signed = t.element.signed
    Q = np.zeros((n_out, n), np.float32)
    C = np.zeros((n_out, n), np.int8 if signed else np.uint8)
    loss = 0.0
    f32 = np.float32
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        b = i2 - i1
        W1T = np.ascontiguousarray(Wn[:, i1:i2].T)
        Err1 = np.zeros((n_out, b), np.float32)
        U1 = Un[i1:i2, i1:i2]
        for i in range(b):
            c = int(orig[i1 + i])
            gi = c // bs
            if found[gi] is None:
                take(gi, group_first_touch(gi, i, i1, i2, Wn, lambda idx: W1T[idx].T, Err1, Un, NumpyLib, n_out, n,
                                           bs, pos_of))
            _, sc, off = found[gi]
            s = (c % bs) // sub
            scale = sc[:, s]
            offset = None if off is None else off[:, s]
            w = W1T[i]
            code = _kquants.element_codes(w, scale, offset, name)
            with np.errstate(all="ignore"):
                v = levels[code.astype(np.int64)] if levels is not None else code.astype(f32)
                q = (scale * v).astype(f32)
                if offset is not None:
                    q = (q + offset).astype(f32)
            C[:, i1 + i] = code
            Q[:, i1 + i] = q
            err = ((w - q) / U1[i, i]).astype(f32)
            Err1[:, i] = err
            if i + 1 < b:
                W1T[i + 1:] -= U1[i, i + 1:, None] * err[None, :]
        e64 = Err1.astype(np.float64)
        loss += 0.5 * float((e64 * e64).sum())
        if i2 < n:
            Wn[:, i2:] -= Err1 @ Un[i1:i2, i2:]
    if perm_np is not None:
        inv = np.empty(n, np.int64)
        inv[perm_np] = np.arange(n)
        Q = np.ascontiguousarray(Q[:, inv])
        C = np.ascontiguousarray(C[:, inv])

    def cat(field):
        vals = [getattr(f[0], field) for f in found]
        return None if vals[0] is None else np.concatenate([np.asarray(v) for v in vals], axis=-1)

    ss = _kquants.GGUFScales(d=cat("d"), dmin=cat("dmin"), scale_codes=cat("scale_codes"), min_codes=cat("min_codes"))
    scales, offsets = _kquants.sub_scales(ss, sub)
    final = QTensor(C, scales, None, spec, None, None, offsets, ss)
    deq = np.asarray(qcore.dequantize(final))
    if not np.array_equal(deq.view(np.int32), Q.view(np.int32)):
        raise RuntimeError(f"GPTQ {name}: the quantized columns differ from dequantize() of their codes and block "
                           f"scales; please report this")
    if is_torch(weight):
        import torch

        dev = weight.device

        def tt(a):
            return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(dev)
        ss_t = _kquants.GGUFScales(tt(ss.d), tt(ss.dmin), tt(ss.scale_codes), tt(ss.min_codes))
        final = QTensor(tt(C), tt(scales), None, spec, None, None, tt(offsets), ss_t)
        deq = tt(deq)
    return GPTQResult(final, deq, rel, loss)

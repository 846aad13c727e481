"""GPTQ (Frantar et al., arXiv 2210.17323) as pure functions: Hessian statistics built by pure updates, and the
column-by-column quantization with error feedback, for every qcore weight spec.

Statistics:

- ``HessianStats``: the running sum of ``x^T x`` over calibration rows (float64) and the row count, a frozen
  value. ``HessianStats.empty(n)``, ``update_hessian(stats, x)`` (``x``: any array whose last axis is the ``n``
  input features; each batch's ``x^T x`` is a float32 matmul, accumulated in float64; for torch inputs of 512
  features or more the product is computed by row blocks of its upper triangle and mirrored, about half the
  multiply-adds with the same bits, ``_gram``), ``merge_hessians(a, b)`` (sums: this is what ranks all-reduce).
  The layer runner's hooks add batches in place (``_HessianSum``: the same additions without a new sum per
  batch).

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

Every function takes numpy arrays or torch tensors (CPU or GPU) through the same code; torch is never imported
here. Not supported (``ValueError`` before any work): stochastic rounding and shared-microexponent specs
(MX9/MX6/MX4), whose per-column quantization is not determined by a block scale.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import numpy as np

import qcore
from qcore import PerBlock, PerChannel, PerGroup, PerTensor, QTensor, QuantSpec
from qcore._backend import is_torch
from qcore.rounding import RoundingMode

__all__ = ["HessianStats", "update_hessian", "merge_hessians", "gptq", "GPTQResult", "check_gptq_spec"]


# ---------------------------------------------------------------------------------------------------------------
# a tiny backend: the handful of linear-algebra calls that differ between numpy and torch
# ---------------------------------------------------------------------------------------------------------------


class _Np:
    name = "numpy"
    f32, f64 = np.float32, np.float64

    @staticmethod
    def cast(x, dt):
        return np.asarray(x).astype(dt, copy=True)

    @staticmethod
    def zeros(shape, dt, like):
        return np.zeros(shape, dt)

    @staticmethod
    def eye(n, dt, like):
        return np.eye(n, dtype=dt)

    @staticmethod
    def cholesky_lower(h):
        try:
            return np.linalg.cholesky(h)
        except np.linalg.LinAlgError:
            return None

    @staticmethod
    def inv_upper_chol(low):
        """Upper Cholesky factor of (L L^T)^-1."""
        return _Np.upper_chol(_Np.chol_inverse(low))

    @staticmethod
    def chol_inverse(low):
        """(L L^T)^-1, symmetric."""
        li = np.linalg.inv(low)
        hinv = li.T @ li
        del li
        _symmetrize_(hinv)  # (hinv + hinv.T) * 0.5, in place
        return hinv

    @staticmethod
    def upper_chol(hinv):
        try:
            return np.linalg.cholesky(hinv).T.copy()
        except np.linalg.LinAlgError:
            return None

    @staticmethod
    def add_diag_(h, s: float):
        idx = np.arange(h.shape[0])
        h[idx, idx] += s

    @staticmethod
    def argsort_desc(d):
        return np.argsort(-d, kind="stable")

    @staticmethod
    def finite(x) -> bool:
        return bool(np.isfinite(x).all())

    @staticmethod
    def diag(x):
        return np.diagonal(x).copy()

    @staticmethod
    def index(idx, like):
        return np.asarray(idx, dtype=np.int64)


class _Torch:
    name = "torch"

    def __init__(self, t):
        self.t = t
        self.f32, self.f64 = t.float32, t.float64

    def cast(self, x, dt):
        return x.detach().to(dt).clone()

    def zeros(self, shape, dt, like):
        return self.t.zeros(shape, dtype=dt, device=like.device)

    def eye(self, n, dt, like):
        return self.t.eye(n, dtype=dt, device=like.device)

    def cholesky_lower(self, h):
        low, info = self.t.linalg.cholesky_ex(h)
        return low if int(info) == 0 else None

    def inv_upper_chol(self, low):
        return self.upper_chol(self.chol_inverse(low))

    def chol_inverse(self, low):
        return self.t.cholesky_inverse(low)

    def upper_chol(self, hinv):
        up, info = self.t.linalg.cholesky_ex(hinv, upper=True)
        return up if int(info) == 0 else None

    def add_diag_(self, h, s: float):
        h.diagonal().add_(s)

    def argsort_desc(self, d):
        return self.t.argsort(d, descending=True, stable=True)

    def finite(self, x) -> bool:
        return bool(self.t.isfinite(x).all())

    def diag(self, x):
        return self.t.diagonal(x).clone()

    def index(self, idx, like):
        return self.t.as_tensor(np.asarray(idx, dtype=np.int64), device=like.device)


def _lib(x):
    if is_torch(x):
        import torch

        return _Torch(torch)
    return _Np


def _as_array(x, name: str):
    if is_torch(x):
        return x
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except Exception:
        raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}") from None


def _to_numpy(x):
    return x.detach().cpu().numpy() if is_torch(x) else np.asarray(x)


# ---------------------------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HessianStats:
    """Running ``sum(x^T x)`` over calibration rows (float64 ``[n, n]``) and the number of rows ``count``.

    ``hessian()`` is ``2 * sum / count`` (GPTQ's ``H``; its scale does not change the result)."""

    sum: Any
    count: int

    @classmethod
    def empty(cls, n: int, *, like: Any = None) -> "HessianStats":
        """No rows yet, for ``n`` input features; ``like``: a torch tensor whose device the sum lives on."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"n must be a positive int (the number of input features), got {n!r}")
        lib = _lib(like) if like is not None else _Np
        return cls(lib.zeros((int(n), int(n)), lib.f64, like), 0)

    @property
    def n(self) -> int:
        return int(self.sum.shape[0])

    def hessian(self):
        if self.count == 0:
            raise ValueError("HessianStats: no calibration rows were added (count == 0)")
        return self.sum * (2.0 / self.count)


# below this many features the Gram matrix is one product; above, blocks of at least this many rows of x^T x
_GRAM_BLOCK = 128


def _gram(rows):
    """``rows.T @ rows`` (float32 ``[n, n]``) with about half the multiply-adds for wide torch inputs: the row
    blocks of the upper triangle (``rows[:, a:b].T @ rows[:, a:]``), mirrored. Each element is the same
    float32 dot product over the same rows as in the full product (a GEMM's sum over its inner axis does not
    depend on how the output is tiled), so the result has the same bits as ``rows.T @ rows`` (checked in
    tests/algorithms/test_gptq_fast.py); narrow inputs and numpy take the one product."""
    n = int(rows.shape[1])
    if not is_torch(rows) or n < 4 * _GRAM_BLOCK:
        return rows.T @ rows
    import torch

    bs = max(_GRAM_BLOCK, -(-n // 8))
    out = torch.empty((n, n), dtype=rows.dtype, device=rows.device)
    for a in range(0, n, bs):
        b = min(a + bs, n)
        blk = rows[:, a:b].T @ rows[:, a:]
        out[a:b, a:] = blk
        if b < n:
            out[b:, a:b] = blk[:, b - a:].T
    return out


def _batch_gram(n: int, x: Any, like: Any):
    """``(x^T x as float32 [n, n], rows)`` of a batch ``x`` (``[..., n]``) for statistics whose sum is ``like``;
    ValueError / TypeError for a wrong shape, kind, or non-finite values."""
    x = _as_array(x, "x")
    if x.ndim < 1 or int(x.shape[-1]) != n:
        raise ValueError(f"x must have {n} features on its last axis (the Hessian's size), got shape "
                         f"{tuple(x.shape)}")
    if is_torch(x) != is_torch(like):
        raise TypeError("x and stats.sum must be the same kind of array (both numpy or both torch)")
    lib = _lib(x)
    rows = x.reshape(-1, n)
    if is_torch(x):
        rows = rows.detach().to(device=like.device, dtype=lib.f32)
    else:
        rows = rows.astype(np.float32, copy=False)
    prod = _gram(rows)
    if not lib.finite(prod.diagonal()):  # sum of squares per feature: NaN or Inf in x shows up here
        raise ValueError("x holds NaN or Inf (or values whose squares overflow float32); Hessian statistics need "
                         "finite activations")
    return prod, int(rows.shape[0])


def update_hessian(stats: HessianStats, x: Any) -> HessianStats:
    """``stats`` plus the rows of ``x`` (shape ``[..., n]``): a new value, ``stats`` is unchanged."""
    if not isinstance(stats, HessianStats):
        raise TypeError(f"stats must be a HessianStats, got {type(stats).__name__}")
    prod, rows = _batch_gram(stats.n, x, stats.sum)
    prod = prod.to(_lib(prod).f64) if is_torch(prod) else prod.astype(np.float64)
    return HessianStats(stats.sum + prod, stats.count + rows)


class _HessianSum:
    """``update_hessian`` in place, for a pass that owns its running sum (the layer runner's hooks): ``add(x)``
    adds the rows of ``x`` to the float64 sum without allocating a new ``[n, n]`` sum per batch (the same
    additions, the same bits); ``stats()`` is the ``HessianStats`` value (sharing the sum)."""

    __slots__ = ("sum", "count")

    def __init__(self, n: int, *, like: Any = None):
        st = HessianStats.empty(n, like=like)
        self.sum, self.count = st.sum, 0

    def add(self, x: Any) -> None:
        prod, rows = _batch_gram(int(self.sum.shape[0]), x, self.sum)
        if is_torch(prod):
            self.sum.add_(prod)  # float32 into float64: exact widening, then the same float64 addition
        else:
            np.add(self.sum, prod, out=self.sum)
        self.count += rows

    def stats(self) -> HessianStats:
        return HessianStats(self.sum, self.count)


def merge_hessians(a: HessianStats, b: HessianStats) -> HessianStats:
    """The statistics of both row sets (``a.sum + b.sum``, ``a.count + b.count``)."""
    for name, v in (("a", a), ("b", b)):
        if not isinstance(v, HessianStats):
            raise TypeError(f"{name} must be a HessianStats, got {type(v).__name__}")
    if a.n != b.n:
        raise ValueError(f"merge_hessians: sizes differ ({a.n} and {b.n})")
    return HessianStats(a.sum + b.sum, a.count + b.count)


# ---------------------------------------------------------------------------------------------------------------
# the algorithm
# ---------------------------------------------------------------------------------------------------------------


class GPTQResult(NamedTuple):
    """``qtensor``: the quantized weight (codes and scales of ``spec``); ``weight``: its dequantized values
    (float32, the input's kind and device); ``damp``: the relative damping used (larger than asked when
    the Hessian needed retries); ``loss``: GPTQ's objective ``sum((w - q)^2 / U[j, j]^2) / 2`` over columns."""

    qtensor: QTensor
    weight: Any
    damp: float
    loss: float


def _group_width(spec: QuantSpec, n_in: int) -> Optional[int]:
    """Width of the spec's scale groups along the input axis, or None when scales span whole rows."""
    g = spec.granularity
    if isinstance(g, PerTensor):
        return None
    if isinstance(g, PerChannel):
        return None if g.axis % 2 == 0 else 1
    if isinstance(g, PerGroup):
        return g.size if g.axis % 2 == 1 else 1
    if isinstance(g, PerBlock):
        return int(g.shape[-1])
    raise ValueError(f"spec granularity {g!r} is not supported by GPTQ")


def check_gptq_spec(spec: QuantSpec, shape: tuple) -> QuantSpec:
    """``spec`` if GPTQ can quantize a weight of ``shape`` ([out, in]) with it, else ValueError."""
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec must be a qcore.QuantSpec, got {type(spec).__name__}")
    if len(shape) != 2:
        raise ValueError(f"weight must be 2-D [out, in] (flatten convolution kernels first), got shape {shape}")
    if spec.rounding is RoundingMode.STOCHASTIC:
        raise ValueError(f"spec {spec.name or spec.dtype.name!r} rounds stochastically; GPTQ needs a deterministic "
                         f"rounding (its error feedback is per column)")
    if getattr(spec, "subblock_shift_bits", 0):
        raise ValueError(f"spec {spec.name or spec.dtype.name!r} has shared micro-exponents (MX9/MX6/MX4); GPTQ "
                         f"supports specs whose per-column quantization is fixed by a block scale")
    g = spec.granularity
    if isinstance(g, PerBlock) and len(g.shape) != 2:
        raise ValueError(f"spec granularity {g!r}: GPTQ takes 2-D blocks on the [out, in] weight")
    _group_width(spec, shape[1])
    try:
        spec.scale_shape(tuple(shape))
    except (ValueError, TypeError) as e:
        raise ValueError(f"spec {spec.name or spec.dtype.name!r} does not fit a weight of shape {shape}: {e}") from None
    return spec


_SYM_BLOCK = 1024  # rows of the blocks _symmetrize_ averages at once


def _symmetrize_(h) -> None:
    """``h[...] = (h + h.T) * 0.5`` in place (numpy or torch, square), a pair of blocks at a time: each pair's
    ``(a + b.T) * 0.5`` is computed once and written to both places. The same values as the whole-matrix
    expression, bit for bit (``x + y == y + x`` exactly), without its two temporary ``[n, n]`` arrays."""
    n = int(h.shape[0])
    for a in range(0, n, _SYM_BLOCK):
        b = min(n, a + _SYM_BLOCK)
        for c in range(a, n, _SYM_BLOCK):
            d = min(n, c + _SYM_BLOCK)
            blk = (h[a:b, c:d] + h[c:d, a:b].T) * 0.5
            h[a:b, c:d] = blk
            h[c:d, a:b] = blk.T


def _damped(h, s: float, lib):
    """``h + eye * s`` (a new array) without the identity matrix: ``h + 0.0 * s`` (what ``eye * s`` adds off the
    diagonal, a signed zero), then ``s`` added to the diagonal: ``(x + 0.0 * s) + s == x + 1.0 * s`` bit for bit
    (the two differ only for ``x = -0.0`` with ``0.0 * s = +0.0``, where both give ``s``). A non-finite ``s``
    (an overflowing damping) takes the identity-matrix expression itself (its diagonal is ``x + inf``)."""
    if not math.isfinite(s):
        return h + lib.eye(int(h.shape[0]), lib.f64, h) * s
    out = h + 0.0 * s
    lib.add_diag_(out, s)
    return out


def _check_positive(v, name, *, allow_zero=False):
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} finite number, got {v!r}")


def gptq(weight: Any, hessian: Any, spec: QuantSpec, *, block_size: int = 128, damp: float = 0.01,
         act_order: bool = False, static_groups: bool = False, max_retries: int = 8,
         scale_fn: Optional[Callable[[Any], dict]] = None, imatrix: Any = None) -> GPTQResult:
    """Quantize ``weight`` ([out, in], numpy or torch) with GPTQ against ``hessian`` (a ``HessianStats`` or an
    ``[in, in]`` array) to ``spec``. See the module docstring for the algorithm.

    ``scale_fn(w_part) -> dict``: optional scale rule (``quantize`` keyword arguments: ``scale``,
    ``zero_point``) for a slice of the weight covering whole scale groups, used instead of the spec's own rule
    (e.g. an MSE-clipped scale); ``tensor_scale`` of two-level specs is always the spec's own.

    GGUF specs (``spec.gguf``: k-quants, Q4_0 ... Q8_0, IQ4_NL) run llama.cpp's scale search per block inside the
    loop (``qcore.algorithms.gptq_gguf``), weighted by ``imatrix`` (per-column importance, llama.cpp's
    ``quant_weights``) when given, else by the Hessian's diagonal; ``scale_fn`` does not apply to them."""
    if isinstance(spec, QuantSpec) and spec.gguf:
        if scale_fn is not None:
            raise ValueError(f"scale_fn: a GGUF spec ({spec.gguf}) takes its scales from llama.cpp's search")
        from .gptq_gguf import gptq_gguf
        return gptq_gguf(weight, hessian, spec, imatrix=imatrix, block_size=block_size, damp=damp,
                         act_order=act_order, static_groups=static_groups, max_retries=max_retries)
    if imatrix is not None:
        what = getattr(spec, "name", "") or getattr(getattr(spec, "dtype", None), "name", spec)
        raise ValueError(f"imatrix= applies to GGUF specs (q2_k ... q6_k, q4_0 ... q8_0, iq4_nl) only; spec "
                         f"{what!r} is not one")
    return _gptq(weight, hessian, spec, block_size=block_size, damp=damp, act_order=act_order,
                 static_groups=static_groups, max_retries=max_retries, scale_fn=scale_fn, reference=False)


def _reference_gptq(weight: Any, hessian: Any, spec: QuantSpec, **kw) -> GPTQResult:
    """``gptq`` with the column loop as first landed (``_columns_reference``): what the fast CPU loop is tested
    against (bit for bit)."""
    return _gptq(weight, hessian, spec, reference=True, **kw)


def _check_loop_options(block_size, damp, max_retries) -> None:
    """The column loop's options (GPTQ's, shared by GPTAQ and Qronos), checked before any work."""
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    _check_positive(damp, "damp", allow_zero=True)
    if isinstance(max_retries, bool) or not isinstance(max_retries, numbers.Integral) or max_retries < 0:
        raise ValueError(f"max_retries must be a non-negative int, got {max_retries!r}")


def _dead_inputs(W, H, lib):
    """Dead inputs (``H[j, j] == 0``: the feature is always zero) get ``H[j, j] = 1`` and a zero weight column,
    in place; returns their index (or None)."""
    dead = lib.diag(H) == 0
    if not bool(dead.any()):
        return None
    idx = lib.index(np.flatnonzero(_to_numpy(dead)), W)
    H[idx, idx] = 1.0
    W[:, idx] = 0.0
    return idx


def _group_setup(W, spec: QuantSpec, n: int, scale_fn, static_groups: bool):
    """``(two_level, tensor_scale, width, params_of, group_params)``: the scale rule the column loop uses (module
    docstring): ``params_of(part)`` gives the quantize() keyword arguments fixing the scales of ``part`` (whole
    groups of the weight); ``group_params[g]`` is filled here for whole-row scales and static groups, else when
    the loop first reaches group ``g``."""
    two_level = bool(spec.two_level)
    tensor_scale = qcore.quantize(W, spec).tensor_scale if two_level else None
    width = _group_width(spec, n)

    def params_of(part):
        if scale_fn is not None:
            kw = dict(scale_fn(part))
        else:
            q = qcore.quantize(part, spec, tensor_scale=tensor_scale) if two_level else qcore.quantize(part, spec)
            kw = {"scale": q.scales, "zero_point": q.zero_points}
        if two_level:
            kw["tensor_scale"] = tensor_scale
        return kw

    ngroups = 1 if width is None else -(-n // width)
    group_params: list = [None] * ngroups
    if width is None:
        group_params[0] = params_of(W)
    elif static_groups:
        for gi in range(ngroups):
            group_params[gi] = params_of(W[:, gi * width:min(n, (gi + 1) * width)])
    return two_level, tensor_scale, width, params_of, group_params


def _upper_factor(H, damp: float, max_retries: int, lib, *, who: str):
    """``(U, rel)``: the upper Cholesky factor of ``(H + rel * mean(diag H) * I)^-1`` in float32, with the damping
    ``rel`` grown tenfold until it factors (module docstring); ValueError naming ``who`` when it never does."""
    mean_diag = float(lib.diag(H).mean())
    rel = float(damp)
    U = None
    for attempt in range(int(max_retries) + 1):
        low = lib.cholesky_lower(_damped(H, rel * mean_diag, lib))  # H + eye * (rel * mean_diag)
        if low is not None:
            hinv = lib.chol_inverse(low)
            low = None
            U = lib.upper_chol(hinv)
            hinv = None
        if U is not None and lib.finite(U):
            break
        U = None
        rel = max(rel * 10.0, 1e-6)
    if U is None:
        raise ValueError(f"{who}: the Hessian is not positive definite even with damping {rel:g} x mean(diag); "
                         f"check the calibration data")
    return (U.to(lib.f32) if is_torch(U) else U.astype(np.float32)), rel


def _checked_hessian(weight, hessian, shape: tuple, block_size, damp, max_retries) -> tuple:
    """The Hessian of a ``[out, in]`` weight as an array on the weight's device, and the weight's array library,
    after every check GPTQ's loop needs (shape, kind, loop options, finite values); shared by every GPTQ flavour."""
    h_in = hessian.hessian() if isinstance(hessian, HessianStats) else _as_array(hessian, "hessian")
    if tuple(h_in.shape) != (shape[1], shape[1]):
        raise ValueError(f"hessian must be [{shape[1]}, {shape[1]}] for a weight of shape {list(shape)}, got "
                         f"{list(h_in.shape)}")
    if is_torch(h_in) != is_torch(weight):
        raise TypeError("weight and hessian must be the same kind of array (both numpy or both torch)")
    _check_loop_options(block_size, damp, max_retries)
    lib = _lib(weight)
    if is_torch(weight):
        h_in = h_in.to(weight.device)
    if not lib.finite(h_in):
        raise ValueError("hessian holds NaN or Inf")
    if not lib.finite(weight):
        raise ValueError("weight holds NaN or Inf")
    return h_in, lib


def _gptq(weight, hessian, spec, *, block_size: int = 128, damp: float = 0.01, act_order: bool = False,
          static_groups: bool = False, max_retries: int = 8, scale_fn=None, reference: bool = False) -> GPTQResult:
    weight = _as_array(weight, "weight")
    if not (weight.dtype.is_floating_point if is_torch(weight) else np.issubdtype(weight.dtype, np.floating)):
        raise TypeError(f"weight must be floating point, got dtype {weight.dtype}")
    shape = tuple(int(s) for s in weight.shape)
    check_gptq_spec(spec, shape)
    h_in, lib = _checked_hessian(weight, hessian, shape, block_size, damp, max_retries)

    n_out, n = shape
    W = lib.cast(weight, lib.f32)
    # at most three float64 [n, n] arrays at once here (13B's down_proj: 1.5 GB each): H, and the damped copy /
    # its Cholesky factor / the inverse / its factor two at a time; every step gives the whole-matrix
    # expressions' values bit for bit (_symmetrize_, _damped)
    if isinstance(hessian, HessianStats) and h_in.dtype == lib.f64 and h_in is not hessian.sum:
        H = h_in  # hessian() computed a new float64 array: ours to change in place
    else:
        H = lib.cast(h_in, lib.f64)
    h_in = None
    _symmetrize_(H)  # H = (H + H.T) * 0.5
    _dead_inputs(W, H, lib)
    two_level, tensor_scale, width, params_of, group_params = _group_setup(W, spec, n, scale_fn, static_groups)

    perm = None
    if act_order:
        perm = lib.argsort_desc(lib.diag(H))
        W = W[:, perm]
        H = H[perm]  # H[perm][:, perm] in two steps: the first copy is freed before the second is made
        H = H[:, perm]
    perm_np = None if perm is None else _to_numpy(perm)
    U, rel = _upper_factor(H, damp, max_retries, lib, who="GPTQ")
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
                f = qcore.fake_quantizer(row_spec, shape=(n_out, 1), scale=_per_row(kw["scale"], n_out),
                                         zero_point=_per_row(kw.get("zero_point"), n_out), like=like)
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
    final = _assemble(Q, spec, group_params, width, two_level, tensor_scale)
    deq = qcore.dequantize(final)
    same = bool((deq == Q).all()) if is_torch(Q) else bool(np.array_equal(deq, Q))
    if not same:  # an internal error: the columns were not quantized as the spec quantizes the whole weight
        raise RuntimeError(f"GPTQ: the quantized columns differ from quantize(spec={spec.name or spec.dtype.name}) "
                           f"with the same scales; please report this")
    return GPTQResult(final, deq, rel, loss)



def _group_first_touch(gi, i, i1, i2, W, W1_cols, Err1, U, lib, n_out, n, width, pos_of):
    """The current values of group ``gi``'s columns when the loop first reaches one of them (at block column
    ``i`` of the block ``[i1, i2)``): block columns from the block's working copy (``W1_cols(idx)``: those
    columns, ``[n_out, len(idx)]``); later columns from ``W`` minus the updates of this block's columns so far,
    which the lazy batch has not applied yet."""
    cols = np.arange(gi * width, min(n, (gi + 1) * width))
    p = pos_of[cols]
    part = lib.zeros((n_out, len(cols)), lib.f32, W)
    inb = (p >= i1) & (p < i2)
    if inb.any():
        k = np.flatnonzero(inb)
        part[:, lib.index(k, W)] = W1_cols(p[inb] - i1)
    if (~inb).any():
        k = np.flatnonzero(~inb)
        pp = lib.index(p[~inb], W)
        cur = W[:, pp]
        if i > 0:
            cur = cur - Err1[:, :i] @ U[i1:i1 + i][:, pp]
        part[:, lib.index(k, W)] = cur
    return part


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


def _np_view(x):
    """A numpy array sharing ``x``'s memory (a CPU torch tensor or a numpy array)."""
    return x.numpy() if is_torch(x) else x


def _numpy_column_quantizers(W, lib, n_out, group_params, spec, two_level, row_spec):
    """``quantizer(group index)`` -> the fake-quantizer of one numpy column ``(n_out, 1)`` of that group (built once
    per group): each element by its row's scale (``row_spec``, the direct per-row kernel), or for two-level specs
    ``qcore.fake_quantize`` with the group's parameters on the weight's array kind. The CPU column loops'
    quantizers (GPTQ's ``_columns_fast``, GPTAQ's ``_columns``)."""
    quantizers: dict = {}

    def quantizer(gi):
        f = quantizers.get(gi)
        if f is None:
            kw = group_params[gi]
            if two_level:
                def f(col, kw=kw):
                    c = lib.t.from_numpy(col) if is_torch(W) else col
                    return _np_view(qcore.fake_quantize(c, spec, **kw))
            else:
                f = qcore.fake_quantizer(row_spec, shape=(n_out, 1), scale=_to_numpy(_per_row(kw["scale"], n_out)),
                                         zero_point=(None if kw.get("zero_point") is None else
                                                     _to_numpy(_per_row(kw["zero_point"], n_out))))
            quantizers[gi] = f
        return f
    return quantizer


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
    quantizer = _numpy_column_quantizers(W, lib, n_out, group_params, spec, two_level, row_spec)
    Un = _np_view(U)
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        b = i2 - i1
        W1T = lib.zeros((b, n_out), lib.f32, W)
        W1T[:] = W[:, i1:i2].T
        Q1T = lib.zeros((b, n_out), lib.f32, W)
        Err1 = lib.zeros((n_out, b), lib.f32, W)
        w1t, q1t, e1 = _np_view(W1T), _np_view(Q1T), _np_view(Err1)
        U1 = Un[i1:i2, i1:i2]
        for i in range(b):
            gi = int(group_of[i1 + i])
            if group_params[gi] is None:
                group_params[gi] = params_of(_group_first_touch(gi, i, i1, i2, W, lambda idx: W1T[lib.index(idx, W)].T,
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


def _per_row(v, n_out: int):
    """A group's scale (or zero point), shape [rows or row blocks, 1], as one value per weight row [n_out, 1]."""
    if v is None:
        return None
    r = int(v.shape[0]) if getattr(v, "ndim", 0) else 1
    if r == n_out:
        return v.reshape(n_out, 1)
    if r == 1:
        return (v.reshape(1, 1).expand(n_out, 1) if is_torch(v) else np.broadcast_to(np.asarray(v).reshape(1, 1),
                                                                                       (n_out, 1)))
    rep = -(-n_out // r)
    if is_torch(v):
        return v.reshape(r, 1).repeat_interleave(rep, dim=0)[:n_out]
    return np.repeat(np.asarray(v).reshape(r, 1), rep, axis=0)[:n_out]


def _assemble(Q, spec, group_params, width, two_level, tensor_scale) -> QTensor:
    """The QTensor of the whole quantized weight ``Q`` with the scales the loop used."""
    if width is None:
        kw = dict(group_params[0])
    else:
        if is_torch(Q):
            import torch

            def cat(xs):
                return torch.cat(xs, dim=1)
        else:
            def cat(xs):
                return np.concatenate(xs, 1)
        scales = [_same_kind(p["scale"], Q) for p in group_params]
        kw = {"scale": cat(scales)}
        zps = [p.get("zero_point") for p in group_params]
        kw["zero_point"] = None if zps[0] is None else cat([_same_kind(z, Q) for z in zps])
        if two_level:
            kw["tensor_scale"] = tensor_scale
    kw = {k: v for k, v in kw.items() if v is not None}
    return qcore.quantize(Q, spec, **kw)


def _same_kind(v, like):
    if is_torch(like):
        import torch

        return v if is_torch(v) else torch.as_tensor(np.asarray(v), device=like.device)
    return _to_numpy(v)

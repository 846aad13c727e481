"""The pieces every GPTQ flavour is built from (``gptq``, ``gptq_gguf``, ``gptaq``, ``qronos``; and the passes that
collect their statistics): Hessian statistics, the checks and the factorisation before the column loop, and the
per-group column quantizers of the loop. Public so that each flavour (and each pass) imports them from here; the
algorithms themselves live in their own modules. The imports point one way: ``qcore.algorithms.gptq`` (the plain
loop and the entry ``gptq``) imports ``qcore.algorithms.gptq_gguf`` to hand it GGUF specs, and ``gptq_gguf``
imports only this module; ``gptaq`` and ``paired`` import this module, ``qronos`` this module and ``gptq``'s loop.

Arrays:

- ``lib_of(x)``: the handful of linear-algebra calls that differ between numpy and torch (``NumpyLib``, or a
  ``TorchLib`` over the torch module); ``as_array``, ``to_numpy``, ``numpy_view`` (a numpy array sharing a CPU
  tensor's memory).

Statistics:

- ``HessianStats``: the running sum of ``x^T x`` over calibration rows (float64) and the row count, a frozen
  value. ``HessianStats.empty(n)``, ``update_hessian(stats, x)`` (``x``: any array whose last axis is the ``n``
  input features; each batch's ``x^T x`` is a float32 matmul, accumulated in float64; for torch inputs of 512
  features or more the product is computed by row blocks of its upper triangle and mirrored, about half the
  multiply-adds with the same bits, ``gram``), ``merge_hessians(a, b)`` (sums: this is what ranks all-reduce).
  The layer runner's hooks add batches in place (``HessianSum``: the same additions without a new sum per
  batch); ``batch_gram`` is one batch's checked product (shared with ``qcore.algorithms.paired``).

Before the loop (every flavour):

- ``check_gptq_spec`` (the specs GPTQ's loop takes), ``check_loop_options`` (``block_size``, ``damp``,
  ``max_retries``), ``checked_hessian`` (the Hessian of a weight, checked, on the weight's device);
- ``symmetrize_`` (``(H + H^T) / 2`` in place), ``dead_inputs`` (``H[j, j] == 0``: ``H[j, j] = 1`` and a zero
  weight column), ``damped`` (``H + s I`` without the identity matrix), ``upper_factor`` (the upper Cholesky
  factor ``U`` of the damped ``H^-1``, the damping grown tenfold until it factors);
- ``GPTQResult``: what every flavour returns.

The column quantizers (the plain loop and GPTAQ's):

- ``group_width`` and ``group_setup`` (the scale rule: whole-row scales and static groups before the loop, the
  others when the loop first reaches a group, ``group_first_touch``), ``per_row`` (a group's scale as one value
  per weight row), ``numpy_column_quantizers`` (the CPU loops' per-group column quantizers), ``assemble`` (the
  ``QTensor`` of the whole quantized weight with the scales the loop used).

Every function takes numpy arrays or torch tensors (CPU or GPU) through the same code; torch is never imported
here at module level.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

import qcore
from qcore import PerBlock, PerChannel, PerGroup, PerTensor, QTensor, QuantSpec
from qcore._backend import is_torch
from qcore.rounding import RoundingMode

__all__ = [
    # arrays
    "NumpyLib", "TorchLib", "lib_of", "as_array", "to_numpy", "numpy_view",
    # statistics
    "HessianStats", "update_hessian", "merge_hessians", "HessianSum", "gram", "batch_gram",
    # before the loop
    "GPTQResult", "check_gptq_spec", "check_loop_options", "checked_hessian", "symmetrize_", "damped",
    "dead_inputs", "upper_factor",
    # the column quantizers
    "group_width", "group_setup", "group_first_touch", "per_row", "numpy_column_quantizers", "assemble",
]


# ---------------------------------------------------------------------------------------------------------------
# arrays: the handful of linear-algebra calls that differ between numpy and torch
# ---------------------------------------------------------------------------------------------------------------


class NumpyLib:
    """The linear-algebra calls of the loops on numpy arrays (static methods; ``lib_of(x)`` for a numpy ``x``):
    ``cast``, ``zeros`` / ``eye`` (``like`` ignored), ``cholesky_lower`` / ``upper_chol`` (None when the matrix
    does not factor), ``chol_inverse``, ``inv_upper_chol``, ``add_diag_``, ``argsort_desc`` (stable), ``finite``,
    ``diag``, ``index``; ``f32`` / ``f64`` the dtypes."""

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
        return NumpyLib.upper_chol(NumpyLib.chol_inverse(low))

    @staticmethod
    def chol_inverse(low):
        """(L L^T)^-1, symmetric."""
        li = np.linalg.inv(low)
        hinv = li.T @ li
        del li
        symmetrize_(hinv)  # (hinv + hinv.T) * 0.5, in place
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


class TorchLib:
    """``NumpyLib``'s calls on torch tensors (``t``: the torch module; arrays made on ``like``'s device)."""

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


def lib_of(x):
    """The array library of ``x``: a ``TorchLib`` for a torch tensor (torch imported here, when one exists), else
    ``NumpyLib``."""
    if is_torch(x):
        import torch

        return TorchLib(torch)
    return NumpyLib


def as_array(x, name: str):
    """``x`` itself for a torch tensor or numpy array, else ``np.asarray(x)``; TypeError naming ``name`` when it is
    neither."""
    if is_torch(x):
        return x
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except Exception:
        raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}") from None


def to_numpy(x):
    """``x`` as a numpy array (a torch tensor detached and copied to the host)."""
    return x.detach().cpu().numpy() if is_torch(x) else np.asarray(x)


def numpy_view(x):
    """A numpy array sharing ``x``'s memory (a CPU torch tensor or a numpy array)."""
    return x.numpy() if is_torch(x) else x


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
        lib = lib_of(like) if like is not None else NumpyLib
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


def gram(rows):
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


def batch_gram(n: int, x: Any, like: Any):
    """``(x^T x as float32 [n, n], rows)`` of a batch ``x`` (``[..., n]``) for statistics whose sum is ``like``;
    ValueError / TypeError for a wrong shape, kind, or non-finite values."""
    x = as_array(x, "x")
    if x.ndim < 1 or int(x.shape[-1]) != n:
        raise ValueError(f"x must have {n} features on its last axis (the Hessian's size), got shape "
                         f"{tuple(x.shape)}")
    if is_torch(x) != is_torch(like):
        raise TypeError("x and stats.sum must be the same kind of array (both numpy or both torch)")
    lib = lib_of(x)
    rows = x.reshape(-1, n)
    if is_torch(x):
        rows = rows.detach().to(device=like.device, dtype=lib.f32)
    else:
        rows = rows.astype(np.float32, copy=False)
    prod = gram(rows)
    if not lib.finite(prod.diagonal()):  # sum of squares per feature: NaN or Inf in x shows up here
        raise ValueError("x holds NaN or Inf (or values whose squares overflow float32); Hessian statistics need "
                         "finite activations")
    return prod, int(rows.shape[0])


def update_hessian(stats: HessianStats, x: Any) -> HessianStats:
    """``stats`` plus the rows of ``x`` (shape ``[..., n]``): a new value, ``stats`` is unchanged."""
    if not isinstance(stats, HessianStats):
        raise TypeError(f"stats must be a HessianStats, got {type(stats).__name__}")
    prod, rows = batch_gram(stats.n, x, stats.sum)
    prod = prod.to(lib_of(prod).f64) if is_torch(prod) else prod.astype(np.float64)
    return HessianStats(stats.sum + prod, stats.count + rows)


class HessianSum:
    """``update_hessian`` in place, for a pass that owns its running sum (the layer runner's hooks): ``add(x)``
    adds the rows of ``x`` to the float64 sum without allocating a new ``[n, n]`` sum per batch (the same
    additions, the same bits); ``stats()`` is the ``HessianStats`` value (sharing the sum)."""

    __slots__ = ("sum", "count")

    def __init__(self, n: int, *, like: Any = None):
        st = HessianStats.empty(n, like=like)
        self.sum, self.count = st.sum, 0

    def add(self, x: Any) -> None:
        prod, rows = batch_gram(int(self.sum.shape[0]), x, self.sum)
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
# before the loop: checks, the Hessian's preparation and factorisation
# ---------------------------------------------------------------------------------------------------------------


class GPTQResult(NamedTuple):
    """``qtensor``: the quantized weight (codes and scales of ``spec``); ``weight``: its dequantized values
    (float32, the input's kind and device); ``damp``: the relative damping used (larger than asked when
    the Hessian needed retries); ``loss``: GPTQ's objective ``sum((w - q)^2 / U[j, j]^2) / 2`` over columns."""

    qtensor: QTensor
    weight: Any
    damp: float
    loss: float


def group_width(spec: QuantSpec, n_in: int) -> Optional[int]:
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
    group_width(spec, shape[1])
    try:
        spec.scale_shape(tuple(shape))
    except (ValueError, TypeError) as e:
        raise ValueError(f"spec {spec.name or spec.dtype.name!r} does not fit a weight of shape {shape}: {e}") from None
    return spec


def _check_positive(v, name, *, allow_zero=False):
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} finite number, got {v!r}")


def check_loop_options(block_size, damp, max_retries) -> None:
    """The column loop's options (GPTQ's, shared by GPTAQ and Qronos), checked before any work."""
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    _check_positive(damp, "damp", allow_zero=True)
    if isinstance(max_retries, bool) or not isinstance(max_retries, numbers.Integral) or max_retries < 0:
        raise ValueError(f"max_retries must be a non-negative int, got {max_retries!r}")


def checked_hessian(weight, hessian, shape: tuple, block_size, damp, max_retries) -> tuple:
    """The Hessian of a ``[out, in]`` weight as an array on the weight's device, and the weight's array library,
    after every check GPTQ's loop needs (shape, kind, loop options, finite values); shared by every GPTQ flavour."""
    h_in = hessian.hessian() if isinstance(hessian, HessianStats) else as_array(hessian, "hessian")
    if tuple(h_in.shape) != (shape[1], shape[1]):
        raise ValueError(f"hessian must be [{shape[1]}, {shape[1]}] for a weight of shape {list(shape)}, got "
                         f"{list(h_in.shape)}")
    if is_torch(h_in) != is_torch(weight):
        raise TypeError("weight and hessian must be the same kind of array (both numpy or both torch)")
    check_loop_options(block_size, damp, max_retries)
    lib = lib_of(weight)
    if is_torch(weight):
        h_in = h_in.to(weight.device)
    if not lib.finite(h_in):
        raise ValueError("hessian holds NaN or Inf")
    if not lib.finite(weight):
        raise ValueError("weight holds NaN or Inf")
    return h_in, lib


_SYM_BLOCK = 1024  # rows of the blocks symmetrize_ averages at once


def symmetrize_(h) -> None:
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


def damped(h, s: float, lib):
    """``h + eye * s`` (a new array) without the identity matrix: ``h + 0.0 * s`` (what ``eye * s`` adds off the
    diagonal, a signed zero), then ``s`` added to the diagonal: ``(x + 0.0 * s) + s == x + 1.0 * s`` bit for bit
    (the two differ only for ``x = -0.0`` with ``0.0 * s = +0.0``, where both give ``s``). A non-finite ``s``
    (an overflowing damping) takes the identity-matrix expression itself (its diagonal is ``x + inf``)."""
    if not math.isfinite(s):
        return h + lib.eye(int(h.shape[0]), lib.f64, h) * s
    out = h + 0.0 * s
    lib.add_diag_(out, s)
    return out


def dead_inputs(W, H, lib):
    """Dead inputs (``H[j, j] == 0``: the feature is always zero) get ``H[j, j] = 1`` and a zero weight column,
    in place; returns their index (or None)."""
    dead = lib.diag(H) == 0
    if not bool(dead.any()):
        return None
    idx = lib.index(np.flatnonzero(to_numpy(dead)), W)
    H[idx, idx] = 1.0
    W[:, idx] = 0.0
    return idx


def upper_factor(H, damp: float, max_retries: int, lib, *, who: str):
    """``(U, rel)``: the upper Cholesky factor of ``(H + rel * mean(diag H) * I)^-1`` in float32, with the damping
    ``rel`` grown tenfold until it factors (``qcore.algorithms.gptq``'s docstring, step 3); ValueError naming
    ``who`` when it never does."""
    mean_diag = float(lib.diag(H).mean())
    rel = float(damp)
    U = None
    for attempt in range(int(max_retries) + 1):
        low = lib.cholesky_lower(damped(H, rel * mean_diag, lib))  # H + eye * (rel * mean_diag)
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


# ---------------------------------------------------------------------------------------------------------------
# the column quantizers
# ---------------------------------------------------------------------------------------------------------------


def group_setup(W, spec: QuantSpec, n: int, scale_fn, static_groups: bool):
    """``(two_level, tensor_scale, width, params_of, group_params)``: the scale rule the column loop uses
    (``qcore.algorithms.gptq``'s docstring): ``params_of(part)`` gives the quantize() keyword arguments fixing the
    scales of ``part`` (whole groups of the weight); ``group_params[g]`` is filled here for whole-row scales and
    static groups, else when the loop first reaches group ``g``."""
    two_level = bool(spec.two_level)
    tensor_scale = None
    if two_level and scale_fn is not None:  # the rule's tensor scale of the whole weight (four over six's)
        tensor_scale = dict(scale_fn(W)).get("tensor_scale")
    if two_level and tensor_scale is None:
        tensor_scale = qcore.quantize(W, spec).tensor_scale
    width = group_width(spec, n)

    def params_of(part):
        if scale_fn is not None:
            kw = dict(scale_fn(part, tensor_scale=tensor_scale)) if two_level else dict(scale_fn(part))
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


def group_first_touch(gi, i, i1, i2, W, W1_cols, Err1, U, lib, n_out, n, width, pos_of):
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


def numpy_column_quantizers(W, lib, n_out, group_params, spec, two_level, row_spec):
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
                    return numpy_view(qcore.fake_quantize(c, spec, **kw))
            else:
                f = qcore.fake_quantizer(row_spec, shape=(n_out, 1), scale=to_numpy(per_row(kw["scale"], n_out)),
                                         zero_point=(None if kw.get("zero_point") is None else
                                                     to_numpy(per_row(kw["zero_point"], n_out))))
            quantizers[gi] = f
        return f
    return quantizer


def per_row(v, n_out: int):
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


def assemble(Q, spec, group_params, width, two_level, tensor_scale) -> QTensor:
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
    return to_numpy(v)

"""Hadamard matrices of many sizes, their fast transform, and orthogonal rotations for every size.

A Hadamard matrix ``H`` of order ``n`` has entries +-1 and ``H H^T = n I``; ``H / sqrt(n)`` is orthogonal. Orders
other than 1 and 2 are multiples of 4 (and every multiple of 4 is conjectured to have one). Constructions here:

- Sylvester: ``H_{2n} = [[H_n, H_n], [H_n, -H_n]]`` (orders ``2^k``);
- Paley I: for a prime power ``q = 3 (mod 4)``, order ``q + 1``;
- Paley II: for a prime power ``q = 1 (mod 4)``, order ``2 (q + 1)``;
- Kronecker products ``H_m (x) S_{2^k}`` of one of the above with a Sylvester matrix (two Paley factors are
  not combined: e.g. 1904 = 28 x 68 gets the fallback).

``hadamard(n)`` returns one (int8 +-1 entries, rows in a fixed, documented order) or raises ValueError when no
construction above reaches ``n`` (``hadamard_factors(n)`` says which, without building). Orders the constructions
miss up to 16384 include 92, 116, 156, 172, 184, 188, 232, 236, ... (Williamson and other special constructions,
which QuaRot hard-codes as tables, are not included).

``rotation(n, *, key=None)``: an orthogonal ``[n, n]`` float64 matrix for *every* ``n``: the normalised Hadamard
matrix when one is constructible; otherwise (documented fallback) a block-diagonal matrix of normalised Hadamard
blocks of the largest constructible orders (greedy; a size-1 block is ``[1]``), so it stays a sum of Hadamard
transforms. With ``key`` (an int seed), the result is ``R @ diag(signs)`` with random signs from
``numpy.random.default_rng(key)`` (QuaRot's randomised Hadamard).

``block_rotation(n, *, block, key=None)``: the block-diagonal ``[n, n]`` float64 matrix with ``n / block`` copies of
the normalised ``hadamard(block)`` on its diagonal (times the random signs of ``random_signs(n, key=key)`` on its
columns when ``key`` is given): a rotation that mixes features only inside each aligned ``block`` (MR-GPTQ's and
"Block rotation is all you need for MXFP4"'s block rotations, of the scale-block size). ``block_fwht(x, *, block,
axis=-1)`` applies its unsigned transpose fast (``fwht`` on each block).

``fwht(x, *, axis=-1)``: ``x @ hadamard(n).T / sqrt(n)`` along ``axis`` for ``n = m * 2^k`` with a
constructible ``m``, in ``O(n log n + n m)``: butterflies on the ``2^k`` factor, a dense ``m x m`` product for
the rest (summed over its columns in order, then one correctly rounded division by ``sqrt(n)`` rounded to the
result's dtype: a defined float order, bit-identical between numpy and torch on any device, and the twin of the
Triton kernel ``qcore.adapters.triton.fwht``). numpy arrays and torch tensors (any device) through the same code;
float32 or float64 results.
"""

from __future__ import annotations

import math
import numbers
from functools import lru_cache
from typing import Any, Optional

import numpy as np

from qcore._backend import is_torch

__all__ = ["hadamard", "hadamard_factors", "is_constructible", "rotation", "block_rotation", "check_block",
           "random_signs", "fwht", "block_fwht", "fwht_plan"]


def _check_n(n, name="n") -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
    return int(n)


@lru_cache(maxsize=None)
def _prime_power(q: int) -> Optional[tuple[int, int]]:
    """``(p, k)`` with ``q = p**k`` for a prime ``p``, else None."""
    if q < 2:
        return None
    for p in range(2, math.isqrt(q) + 1):
        if q % p == 0:
            k = 0
            while q % p == 0:
                q //= p
                k += 1
            return (p, k) if q == 1 else None
    return (q, 1)


# --- finite fields GF(p^k): elements are ints 0..q-1, the base-p digits of a polynomial's coefficients -------


def _poly_mulmod(a: list, b: list, mod: list, p: int) -> list:
    k = len(mod) - 1
    out = [0] * (2 * k - 1)
    for i, x in enumerate(a):
        if x:
            for j, y in enumerate(b):
                out[i + j] = (out[i + j] + x * y) % p
    for d in range(len(out) - 1, k - 1, -1):  # reduce by the monic modulus
        c = out[d]
        if c:
            for j in range(k + 1):
                out[d - k + j] = (out[d - k + j] - c * mod[j]) % p
    return out[:k]


def _digits(v: int, p: int, k: int) -> list:
    return [(v // p ** i) % p for i in range(k)]


@lru_cache(maxsize=None)
def _irreducible(p: int, k: int) -> tuple:
    """The first monic irreducible polynomial of degree ``k`` over GF(p) (coefficients low to high)."""
    for v in range(p ** k):
        mod = _digits(v, p, k) + [1]
        if mod[0] == 0:
            continue
        # irreducible iff no root-free factorisation: check it has no factor of degree <= k // 2 by trial division
        if all(_has_no_factor(mod, p, d) for d in range(1, k // 2 + 1)):
            return tuple(mod)
    raise RuntimeError(f"no irreducible polynomial of degree {k} over GF({p})")  # impossible


def _has_no_factor(mod: list, p: int, d: int) -> bool:
    for v in range(p ** d):
        f = _digits(v, p, d) + [1]
        # remainder of mod by f
        r = list(mod)
        for i in range(len(r) - 1, d - 1, -1):
            c = r[i]
            if c:
                for j in range(d + 1):
                    r[i - d + j] = (r[i - d + j] - c * f[j]) % p
        if not any(r[:d]):
            return False
    return True


@lru_cache(maxsize=None)
def _quadratic_character(q: int) -> np.ndarray:
    """``chi[a]`` for the elements ``a`` of GF(q) (ints): 0 for 0, 1 for non-zero squares, -1 otherwise; and the
    subtraction table is built by ``_sub``."""
    p, k = _prime_power(q)
    chi = -np.ones(q, np.int8)
    chi[0] = 0
    if k == 1:
        chi[(np.arange(1, p, dtype=np.int64) ** 2) % p] = 1
        return chi
    mod = list(_irreducible(p, k))
    for v in range(1, q):
        d = _digits(v, p, k)
        s = _poly_mulmod(d, d, mod, p)
        chi[sum(c * p ** i for i, c in enumerate(s))] = 1
    return chi


def _sub_table(q: int) -> np.ndarray:
    """``T[a, b] = a - b`` in GF(q) (digit-wise mod p)."""
    p, k = _prime_power(q)
    v = np.arange(q)
    digits = np.stack([(v // p ** i) % p for i in range(k)], -1)  # [q, k]
    diff = (digits[:, None, :] - digits[None, :, :]) % p
    return (diff * (p ** np.arange(k))).sum(-1)


def _jacobsthal(q: int) -> np.ndarray:
    return _quadratic_character(q)[_sub_table(q)].astype(np.int64)


def _paley1(q: int) -> np.ndarray:
    """Order q + 1, q = 3 mod 4."""
    Q = _jacobsthal(q)
    n = q + 1
    S = np.zeros((n, n), np.int64)
    S[0, 1:] = 1
    S[1:, 0] = -1
    S[1:, 1:] = Q
    return (S + np.eye(n, dtype=np.int64)).astype(np.int8)


def _paley2(q: int) -> np.ndarray:
    """Order 2 (q + 1), q = 1 mod 4."""
    Q = _jacobsthal(q)
    m = q + 1
    C = np.zeros((m, m), np.int64)
    C[0, 1:] = 1
    C[1:, 0] = 1
    C[1:, 1:] = Q
    A = np.array([[1, -1], [-1, -1]], np.int64)
    B = np.array([[1, 1], [1, -1]], np.int64)
    out = np.kron(C, A) + np.kron(np.eye(m, dtype=np.int64), B)
    return out.astype(np.int8)


@lru_cache(maxsize=None)
def _base(m: int) -> Optional[str]:
    """How ``dense_factor`` builds an order-``m`` Hadamard matrix: ``"sylvester"`` (m = 1, 2), ``"paley1(q)"``,
    ``"paley2(q)"``; None if neither applies."""
    if m in (1, 2):
        return "sylvester"
    if m % 4:
        return None
    q = m - 1
    pp = _prime_power(q)
    if pp is not None and q % 4 == 3:
        return f"paley1({q})"
    if m % 2 == 0:
        q = m // 2 - 1
        pp = _prime_power(q)
        if pp is not None and q % 4 == 1:
            return f"paley2({q})"
    return None


def hadamard_factors(n: int) -> Optional[tuple]:
    """How ``hadamard(n)`` builds its matrix: ``(m, 2^k, construction of m)`` with ``n = m * 2^k`` and the largest
    power of two pulled out that leaves a constructible ``m``; None when no construction here reaches ``n``."""
    n = _check_n(n)
    # prefer the smallest dense factor m (fastest transform): scan all splits
    cands = []
    k = 0
    while n % (1 << k) == 0:
        m = n >> k
        c = _base(m)
        if c is not None:
            cands.append((m, 1 << k, c))
        k += 1
    if not cands:
        return None
    return min(cands, key=lambda t: t[0])


def is_constructible(n: int) -> bool:
    """Whether ``hadamard(n)`` exists here."""
    return hadamard_factors(n) is not None


@lru_cache(maxsize=64)
def dense_factor(m: int) -> np.ndarray:
    """The order-``m`` Hadamard matrix (int8) that ``hadamard(n)`` takes as its dense factor ``H_m`` (``m`` from
    ``hadamard_factors(n)``): Sylvester's for m = 1, 2, else Paley's construction (I or II); cached. The Triton
    FWHT kernel multiplies by it too."""
    c = _base(m)
    if c == "sylvester":
        return np.ones((1, 1), np.int8) if m == 1 else np.array([[1, 1], [1, -1]], np.int8)
    q = int(c[c.index("(") + 1:-1])
    return _paley1(q) if c.startswith("paley1") else _paley2(q)


def _sylvester(k2: int) -> np.ndarray:
    h = np.ones((1, 1), np.int8)
    while h.shape[0] < k2:
        h = np.block([[h, h], [h, -h]]).astype(np.int8)
    return h


def hadamard(n: int) -> np.ndarray:
    """An order-``n`` Hadamard matrix (int8, entries +-1): ``kron(H_m, S_{2^k})`` with ``(m, 2^k)`` from
    ``hadamard_factors(n)`` and ``S`` Sylvester's. ValueError when no construction here reaches ``n``."""
    f = hadamard_factors(n)
    if f is None:
        raise ValueError(_no_hadamard(n))
    m, k2, _ = f
    return np.kron(dense_factor(m), _sylvester(k2)).astype(np.int8)


def _no_hadamard(n: int) -> str:
    why = "Hadamard orders are 1, 2 and multiples of 4" if n > 2 and n % 4 else \
        "no Sylvester / Paley / Kronecker construction reaches it (Williamson-type orders are not included)"
    return f"no Hadamard matrix of order {n} here: {why}; rotation(n) gives a block-diagonal Hadamard fallback"


def _blocks(n: int) -> list:
    """Greedy block sizes for the fallback: the largest constructible order <= what is left, repeatedly."""
    out = []
    left = n
    while left:
        b = left
        while b > 1 and not is_constructible(b):
            b -= 1
        out.append(b)
        left -= b
    return out


def rotation(n: int, *, key: Optional[int] = None) -> np.ndarray:
    """An orthogonal ``[n, n]`` float64 matrix (module docstring): normalised Hadamard, or the block-diagonal
    fallback; times random signs on the columns when ``key`` is given."""
    n = _check_n(n)
    if key is not None and (isinstance(key, bool) or not isinstance(key, numbers.Integral)):
        raise TypeError(f"key must be an int seed or None, got {key!r}")
    if is_constructible(n):
        r = hadamard(n).astype(np.float64) / math.sqrt(n)
    else:
        r = np.zeros((n, n))
        at = 0
        for b in _blocks(n):
            r[at:at + b, at:at + b] = hadamard(b).astype(np.float64) / math.sqrt(b)
            at += b
    if key is not None:
        r = r * random_signs(n, key=key)[None, :]
    return r


def check_block(n: int, block: Any, *, what: str = "n") -> int:
    """``block`` as an int after checking it is a positive int, a constructible Hadamard order
    (``is_constructible``) and a divisor of ``n`` (``what`` names ``n`` in the message); TypeError / ValueError."""
    n = _check_n(n, what)
    if isinstance(block, bool) or not isinstance(block, numbers.Integral):
        raise TypeError(f"block must be a positive int, got {block!r}")
    block = _check_n(block, "block")
    if not is_constructible(block):
        raise ValueError(f"block={block}: {_no_hadamard(block)}")
    if n % block:
        raise ValueError(f"block={block} does not divide {what}={n}")
    return block


def block_rotation(n: int, *, block: int, key: Optional[int] = None) -> np.ndarray:
    """The orthogonal block-diagonal ``[n, n]`` float64 matrix ``kron(I_{n / block}, hadamard(block) / sqrt(block))``
    (module docstring), times ``random_signs(n, key=key)`` on its columns when ``key`` is given (as ``rotation``).
    ValueError when ``block`` does not divide ``n`` or has no Hadamard construction here; ``block == n`` is
    ``rotation(n, key=key)`` for a constructible ``n``."""
    block = check_block(n, block)
    if key is not None and (isinstance(key, bool) or not isinstance(key, numbers.Integral)):
        raise TypeError(f"key must be an int seed or None, got {key!r}")
    h = hadamard(block).astype(np.float64) / math.sqrt(block)
    r = np.kron(np.eye(n // block), h)
    if key is not None:
        r = r * random_signs(n, key=key)[None, :]
    return r


def block_fwht(x: Any, *, block: int, axis: int = -1, transpose: bool = False) -> Any:
    """``x`` times ``block_rotation(n, block=block).T`` along ``axis`` (``n = x.shape[axis]``): ``fwht`` of each
    aligned run of ``block`` features, the same float order as ``fwht`` of size ``block`` (``transpose``: times
    ``block_rotation(n, block=block)``, torch only, as ``fwht``). numpy or torch; ValueError as ``block_rotation``."""
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"axis must be an int, got {axis!r}")
    nd = len(x.shape)
    if not -nd <= axis < nd:
        raise ValueError(f"axis {axis} is out of range for x of shape {tuple(x.shape)}")
    axis = int(axis) % nd
    n = int(x.shape[axis])
    block = check_block(n, block, what=f"x.shape[{axis}]")
    if is_torch(x):
        import torch
        y = torch.movedim(x, axis, -1)
    else:
        y = np.moveaxis(np.asarray(x), axis, -1)
    lead = tuple(y.shape[:-1])
    y = y.reshape(*lead, n // block, block)
    y = fwht(y, axis=-1, transpose=transpose) if transpose else fwht(y, axis=-1)
    y = y.reshape(*lead, n)
    return torch.movedim(y, -1, axis) if is_torch(x) else np.moveaxis(y, -1, axis)


def random_signs(n: int, *, key: int) -> np.ndarray:
    """The ``+-1`` float64 vector of length ``n`` that ``rotation(n, key=key)`` multiplies its columns by."""
    n = _check_n(n)
    if isinstance(key, bool) or not isinstance(key, numbers.Integral):
        raise TypeError(f"key must be an int seed, got {key!r}")
    return np.where(np.random.default_rng(int(key)).random(n) < 0.5, -1.0, 1.0)


def fwht_plan(shape: tuple, axis: Any) -> tuple[int, int]:
    """``(m, 2**k)`` with ``shape[axis] == m * 2**k`` for a transform along ``axis`` (``m`` a known Hadamard order);
    TypeError / ValueError for a bad axis or a size with no construction (``fwht`` and the Triton kernel)."""
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"axis must be an int, got {axis!r}")
    nd = len(shape)
    if not -nd <= axis < nd:
        raise ValueError(f"axis {axis} is out of range for x of shape {tuple(shape)}")
    n = int(shape[axis])
    f = hadamard_factors(n)
    if f is None:
        raise ValueError(_no_hadamard(n))
    return f[0], f[1]


def fwht(x: Any, *, axis: int = -1, transpose: bool = False) -> Any:
    """``x`` times ``hadamard(n).T / sqrt(n)`` along ``axis`` (``n = x.shape[axis]``), fast (module docstring).
    numpy or torch; float64 inputs stay float64, others compute in float32. ValueError when ``n`` has no
    construction here. ``transpose``: times ``hadamard(n) / sqrt(n)`` instead (the transform's adjoint, for a
    backward pass; the same float order with the dense factor transposed).

    torch tensors run ``_fwht_rows``: the same operations in the same order as ``reference_fwht`` (the landed
    code, bit for bit), in place on blocks of rows small enough to stay in cache (issue 23: the landed code made
    one full-size tensor per butterfly stage and per dense term, 40 passes over memory for 576 features)."""
    if not is_torch(x):
        if transpose:
            raise ValueError("fwht: transpose=True is for torch tensors")
        return reference_fwht(x, axis=axis)
    import torch
    m, k2 = fwht_plan(tuple(x.shape), axis)
    n = int(x.shape[axis])
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.movedim(x.to(dt), axis, -1)
    lead = y.shape[:-1]
    y = _fwht_rows(y.reshape(-1, n), m, k2, transpose=transpose)
    return torch.movedim(y.reshape(*lead, n), -1, axis)


_ROW_BYTES = 1 << 20  # a block of rows of about 1 MiB: few, large operations (a loaded machine pays per op)


def _fwht_rows(x, m: int, k2: int, *, transpose: bool = False):
    """``fwht`` of the rows of the float32 / float64 ``[rows, m * k2]`` torch tensor ``x`` (a new tensor; ``x`` is
    not changed). Per block of rows, transposed to ``[m, k2, rows]`` so every elementwise operation runs over a
    long contiguous inner dimension: the butterflies ping-pong between two buffers (``torch.add`` / ``torch.sub``
    with ``out=``: the reference's ``a + b`` and ``a - b``), the dense factor accumulates in place in the
    reference's order (``acc = h[:, 0] * y_0``, then ``acc += h[:, j] * y_j`` for j = 1..m-1: each product is
    exact, as entries are +-1, so ``addcmul_`` rounds as the reference's add), then one in-place division by
    ``fl(sqrt(n))``: the reference's operations on the same values, so the same bits."""
    import torch
    n = m * k2
    rows = x.shape[0]
    dev, dt = x.device, x.dtype
    out = torch.empty((rows, n), dtype=dt, device=dev)
    if rows == 0:
        return out
    hm = _dense_t(m, dt, dev, transpose)
    root = torch.as_tensor(np.asarray(math.sqrt(n), dtype=np.float64 if dt == torch.float64 else np.float32),
                           device=dev)
    step = max(1, min(rows, _ROW_BYTES // (n * x.element_size())))
    bufs = (torch.empty((n, step), dtype=dt, device=dev), torch.empty((n, step), dtype=dt, device=dev),
            torch.empty((n, step), dtype=dt, device=dev))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        c = r1 - r0
        src = x[r0:r1].T  # [n, c], a strided view: the first stage reads it transposed
        if k2 == 1:
            bufs[0][:, :c].copy_(src)
            src = bufs[0][:, :c]
        w = 0
        h = k2
        while h > 1:  # butterflies over the 2^k factor, one bit of the index at a time (the reference's order)
            dst = bufs[w][:, :c]
            sv = src.reshape(m, k2 // h, 2, h // 2, c)
            dv = dst.view(m, k2 // h, 2, h // 2, c) if dst.is_contiguous() else dst.reshape(m, k2 // h, 2, h // 2, c)
            torch.add(sv[:, :, 0], sv[:, :, 1], out=dv[:, :, 0])
            torch.sub(sv[:, :, 0], sv[:, :, 1], out=dv[:, :, 1])
            src, w = dst, 1 - w
            h //= 2
        if m > 1:
            y = src.reshape(m, k2 * c)
            acc = bufs[2][:, :c].reshape(m, k2 * c) if c == step else torch.empty((m, k2 * c), dtype=dt, device=dev)
            torch.mul(hm[:, 0:1], y[0:1], out=acc)
            for j in range(1, m):
                acc.addcmul_(hm[:, j:j + 1], y[j:j + 1])
            src = acc
        out[r0:r1].copy_(src.reshape(n, c).T)
    return out.div_(root)


_DENSE_T: dict = {}


def _dense_t(m: int, dtype, device, transpose: bool):
    """``dense_factor(m)`` (or its transpose) as a torch tensor of ``dtype`` on ``device``, built once per (m, dtype,
    device, transpose)."""
    import torch
    k = (m, dtype, str(device), bool(transpose))
    t = _DENSE_T.get(k)
    if t is None:
        d = dense_factor(m)
        t = torch.as_tensor(np.ascontiguousarray(d.T if transpose else d), dtype=dtype, device=device)
        _DENSE_T[k] = t
    return t


def reference_fwht(x: Any, *, axis: int = -1) -> Any:
    """The landed ``fwht`` (issue 11), kept as the reference the fast torch path is tested against bit for bit:
    one out-of-place tensor per butterfly stage and per term of the dense stage."""
    torch_in = is_torch(x)
    if not torch_in:
        x = np.asarray(x)
    m, k2 = fwht_plan(tuple(x.shape), axis)
    n = int(x.shape[axis])
    if torch_in:
        import torch
        f64 = x.dtype == torch.float64
        y = torch.movedim(x.to(torch.float64 if f64 else torch.float32), axis, -1).contiguous()
        hm = torch.as_tensor(dense_factor(m), dtype=y.dtype, device=y.device)
        stack, moveaxis = torch.stack, torch.movedim
    else:
        dt = np.float64 if x.dtype == np.float64 else np.float32
        y = np.ascontiguousarray(np.moveaxis(x.astype(dt), axis, -1))
        hm = dense_factor(m).astype(dt)
        stack, moveaxis = np.stack, np.moveaxis
    lead = y.shape[:-1]
    y = y.reshape(-1, m, k2)
    h = k2
    while h > 1:  # butterflies over the 2^k factor, one bit of the index at a time
        y = y.reshape(-1, m, k2 // h, 2, h // 2)
        a, b = y[..., 0, :], y[..., 1, :]
        y = stack((a + b, a - b), -2)
        h //= 2
    y = y.reshape(-1, m, k2)
    if m > 1:
        # the dense factor summed over j in order (a defined float order, which the Triton kernel's twin follows;
        # entries are +-1, so each product is exact)
        acc = hm[None, :, 0:1] * y[:, 0:1, :]
        for j in range(1, m):
            acc = acc + hm[None, :, j:j + 1] * y[:, j:j + 1, :]
        y = acc
    # a correctly rounded division by fl(sqrt(n)) (a device tensor as divisor: torch on CUDA turns a division by a
    # Python scalar into a multiplication by its reciprocal)
    root = np.asarray(math.sqrt(n), dtype=y.dtype if not torch_in else (np.float64 if f64 else np.float32))
    div = torch.as_tensor(root, device=y.device) if torch_in else root
    y = (y / div).reshape(*lead, n)
    return moveaxis(y, -1, axis)

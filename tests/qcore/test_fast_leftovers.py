"""Issue 23's core leftovers: the faster MX9/MX6/MX4, bfp16 and MX scale paths and the cheap checks of
``fake_quantize`` with given parameters give the generic path's bits and errors.

What the fast code assumes, each pinned by a case here:

- ``_fast._floor_e8m0_params``: E8M0 FLOOR scales (and bfp16's bump, and the integer factors) from the exponent
  bits when every block of a slab is ordinary; any other slab (zeros, subnormals, extreme exponents, NaN/Inf)
  takes the general rule. Slabs of both kinds in one call must not leak into each other (its one-slot memo).
- bfp16's bump: ``hi >= (2 - 2**-7) * 2**s`` (the tie rounds to the even 128 and bumps); the negative side never
  bumps.
- numpy's halving block reductions (blocks of 2..16, a short last block row of another length).
- MX9/MX6/MX4: |y| from the statistics' |x| bits (only where the statistics ran on that very slab), pairs
  straddling 1, binade carries (a value that rounds up to 2**k), ties on both grids (shifted or not), saturation.
- ``qcore._given``: the same bits as the general path; every refused argument raises the general path's error
  (before any work); the memo of checked values compares values, so a parameter changed in place is re-checked.
"""

from __future__ import annotations

import importlib
from unittest import mock

import numpy as np
import pytest

import qcore
from qcore import PerChannel, make_spec
from qcore import _fast, _given, _inplace
from qcore._backend import ops

from test_fast import _bits_equal, _generic_dequantize, _generic_quantize, _np  # noqa: E402 (tests/qcore is on sys.path via tests/conftest.py)

_quantize_module = importlib.import_module("qcore.quantize")

BACKENDS = ["numpy", "torch"]
CORE = ["mx9", "mx6", "mx4", "bfp16", "mxint8", "mxfp4", "mxfp8_e4m3"]


def _oracle(x, spec, scale=None, zp=None):
    """The generic path alone: ``_fake_quantize_pure`` with the fast cast kernel refused (as the bench does)."""
    with mock.patch.object(_inplace, "cast_ok", lambda *a, **k: False):
        return _quantize_module._fake_quantize_pure(_np(x), None if scale is None else _np(scale),
                                                    None if zp is None else _np(zp), None, spec=spec)


def _as(backend, *arrays):
    if backend == "numpy":
        return arrays if len(arrays) > 1 else arrays[0]
    torch = pytest.importorskip("torch")
    out = tuple(None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)
    return out if len(out) > 1 else out[0]


def _check_all(x, spec):
    """fake_quantize, quantize (codes, scales, shifts) and dequantize against the generic path."""
    o = ops(x)
    ref = _oracle(x, spec)
    _bits_equal(_np(qcore.fake_quantize(x, spec)), ref)
    q = _fast.run_quantize(x, spec, None, None, o)
    codes, scales, _, shifts, _ = _generic_quantize(x, spec)
    if q is not None:
        _bits_equal(_np(q[0]), _np(codes))
        _bits_equal(_np(q[1]), _np(scales))
        if shifts is not None:
            _bits_equal(_np(q[3]), _np(shifts))
    qt = qcore.QTensor(codes, scales, None, spec, shifts, None)
    _bits_equal(_np(qcore.dequantize(qt)), _np(_generic_dequantize(qt)))
    _bits_equal(_np(qcore.dequantize(qcore.quantize(x, spec))), ref)


def _edge_rows(fmt, cols=64):
    """Rows of blocks that exercise every branch: ordinary rows, and rows that force the general rule."""
    rng = np.random.default_rng(7)
    spec = make_spec(fmt)
    m = getattr(spec.dtype, "mantissa_bits", 6)
    rows = []
    base = rng.standard_normal(cols).astype(np.float32)
    rows.append(base)
    # binade carries and saturation: values just under 2**k that round up to it, and to past the grid's max
    rows.append(np.float32(2.0) - np.float32(2.0) ** -np.arange(1, cols + 1, dtype=np.float32) % 24)
    # ties on both grids: k/2**(m+1) and k/2**(m+2) (shifted pairs) for odd k, with a partner above / below 1
    k = np.arange(cols, dtype=np.float32)
    rows.append(((2 * (k % 7) + 1) / np.float32(2.0 ** (m + 1))).astype(np.float32) * np.where(k % 2, 1, -1))
    rows.append(((2 * (k % 5) + 1) / np.float32(2.0 ** (m + 2))).astype(np.float32))
    alt = np.where(k % 4 < 2, np.float32(1.5), np.float32(0.25)).astype(np.float32)
    alt[1::4] = np.float32(0.999)  # a pair straddling 1
    rows.append(alt)
    # bfp16's bump: block max at, just below and just above the threshold (2 - 2**-7) * 2**s, and negative
    thr = np.float32(2.0 - 2.0 ** -7)
    below = np.nextafter(thr, np.float32(0))
    rows.append(np.tile(np.float32([thr, 0.5, below, -1.0, -thr, 0.25, 1.0, -0.0]), cols // 8))
    rows.append(np.tile(np.float32([below, 0.5, -thr, -1.9999, 0.0, 1.25, -0.5, 1.0]), cols // 8))
    rows.append(np.tile(np.float32([-thr, -1.0, -0.5, -0.25, -1.5, -1.75, -1.99, -1.0]), cols // 8))
    return np.stack(rows).astype(np.float32), base


def _special_rows(cols=64):
    """Rows that leave the ordinary range: zeros, subnormals, tiny, huge, NaN and Inf blocks."""
    rng = np.random.default_rng(8)
    r = rng.standard_normal((8, cols)).astype(np.float32)
    r[0] = 0
    r[1] = r[1] * np.float32(2.0 ** -140)  # subnormal blocks
    r[2] = r[2] * np.float32(2.0 ** -120)  # amax exponent field just above 0 (bfp16's integer factors need >= 7)
    with np.errstate(over="ignore"):
        r[3] = r[3] * np.float32(2.0 ** 126)  # amax exponent field 253-254
        r[4] = np.float32(3.4e38) * np.sign(r[4])
    r[5, 3] = np.nan
    r[6, 17] = np.inf
    r[7, :16] = -0.0
    return r


@pytest.mark.parametrize("fmt", CORE)
@pytest.mark.parametrize("backend", BACKENDS)
def test_edge_rows_equal_generic(fmt, backend):
    rows, _ = _edge_rows(fmt)
    specials = _special_rows(rows.shape[1])
    for scale in (1.0, 2.0 ** -100, 2.0 ** 100, 2.0 ** -126):
        with np.errstate(over="ignore"):
            _check_all(_as(backend, (rows * np.float32(scale)).astype(np.float32)), make_spec(fmt))
    _check_all(_as(backend, specials), make_spec(fmt))
    _check_all(_as(backend, np.concatenate([rows, specials])), make_spec(fmt))


@pytest.mark.parametrize("fmt", CORE)
@pytest.mark.parametrize("backend", BACKENDS)
def test_many_slabs_mixed_ordinary_and_not(fmt, backend, monkeypatch):
    """Small slabs (one per few rows): ordinary slabs (bit formulas) and others (general rule) alternate, so a
    slab must never use another slab's parameters."""
    rows, base = _edge_rows(fmt)
    specials = _special_rows(rows.shape[1])
    x = np.concatenate([rows, specials[:2], rows[::-1], specials[2:], rows]).astype(np.float32)
    ref = _oracle(x, make_spec(fmt))
    monkeypatch.setattr(_inplace, "SLAB", 128)
    monkeypatch.setattr(_inplace, "SLAB_TORCH", 128)
    xx = _as(backend, x)
    assert len(_fast.slabs([x.shape[0], x.shape[1]], [1, 32], 128)) > 8
    _bits_equal(_np(qcore.fake_quantize(xx, make_spec(fmt))), ref)
    _bits_equal(_np(qcore.dequantize(qcore.quantize(xx, make_spec(fmt)))), ref)


@pytest.mark.parametrize("shape", [(45,), (3, 37), (5, 100), (7, 2, 24), (2, 17), (1, 9), (31,)])
@pytest.mark.parametrize("fmt", ["mx9", "mx6", "mx4", "bfp16", "mxint8", "mxfp4"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_odd_sizes_equal_generic(shape, fmt, backend):
    rng = np.random.default_rng(abs(hash(shape)) % 2**32)
    x = rng.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[::5] *= np.float32(1.9921875)
    _check_all(_as(backend, x), make_spec(fmt))


@pytest.mark.parametrize("backend", BACKENDS)
def test_microexp_given_scale_with_inf_and_big_inputs(backend):
    """Given scales: |y| can reach 2 and beyond, and Inf (the statistics' |x| bits are not there to reuse)."""
    spec = make_spec("mx9")
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 32)).astype(np.float32) * np.float32(4)
    x[0, 1] = np.inf
    x[1, 4] = -np.inf
    s = np.exp2(rng.integers(-2, 2, (4, 2))).astype(np.float32)
    xx, ss = _as(backend, x, s)
    got = qcore.fake_quantize(xx, spec, scale=ss)
    _bits_equal(_np(got), _oracle(x, spec, s))


@pytest.mark.parametrize("t", [2, 4, 8, 16])
def test_numpy_halving_reduction(t):
    rng = np.random.default_rng(t)
    for n in (t, 4 * t, 1000 * t):
        a = rng.integers(-2**31, 2**31 - 1, n, dtype=np.int64).astype(np.int32)
        buf = np.empty(n, np.int32)
        np.testing.assert_array_equal(_fast._np_halving(np.maximum, a, t, buf), a.reshape(-1, t).max(axis=1))
        np.testing.assert_array_equal(_fast._np_halving(np.minimum, a, t, buf), a.reshape(-1, t).min(axis=1))


# ---------------------------------------------------------------------------------------------------------------
# fake_quantize with given parameters (qcore._given)
# ---------------------------------------------------------------------------------------------------------------
def _general(x, spec, **kw):
    """The general path: the small-tensor fast path switched off."""
    with mock.patch.object(_given, "fake_quantize_given", lambda *a, **k: None):
        return qcore.fake_quantize(x, spec, **kw)


GIVEN = [
    ("uint4 tensor", make_spec("uint4"), (1, 1), True),
    ("uint4 rows", make_spec("uint4", granularity=PerChannel(0)), (576, 1), True),
    ("int8 rows", make_spec("int8", granularity=PerChannel(0)), (576, 1), False),
    ("int4 narrow", make_spec("int4", narrow_range=True, granularity=PerChannel(0)), (576, 1), False),
    ("fp8 tensor", make_spec("float8_e4m3fn"), (1, 1), False),
    ("fp8 rows", make_spec("float8_e4m3fn", granularity=PerChannel(0)), (576, 1), False),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", GIVEN, ids=[c[0] for c in GIVEN])
def test_given_equals_general_path(backend, case):
    _, spec, sshape, asym = case
    rng = np.random.default_rng(3)
    w = rng.standard_normal((576, 1)).astype(np.float32)
    w[:6, 0] = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40]
    s = rng.uniform(0.01, 0.3, sshape).astype(np.float32)
    z = rng.integers(0, 16, sshape).astype(np.float32) if asym else None
    xx, ss, zz = _as(backend, w, s, z)
    got = qcore.fake_quantize(xx, spec, scale=ss, zero_point=zz)
    assert type(got) is type(xx)
    _bits_equal(_np(got), _np(_general(xx, spec, scale=ss, zero_point=zz)))
    _bits_equal(_np(got), _oracle(w, spec, s, z))
    with mock.patch.object(_fast, "small_kernels", wraps=_fast.small_kernels) as k:
        qcore.fake_quantize(xx, spec, scale=ss, zero_point=zz)
        assert k.called  # the covered case does take the small kernels


def _bad_params():
    """(label, spec, scale, zero point): arguments the general path refuses."""
    u4 = make_spec("uint4", granularity=PerChannel(0))
    i8 = make_spec("int8", granularity=PerChannel(0))
    s = np.full((8, 1), 0.1, np.float32)
    z = np.full((8, 1), 3.0, np.float32)
    neg = s.copy()
    neg[5] = -0.1
    zero = s.copy()
    zero[2] = 0
    inf = s.copy()
    inf[1] = np.inf
    frac = z.copy()
    frac[4] = 2.5
    high = z.copy()
    high[0] = 16
    low = z.copy()
    low[7] = -1
    nanz = z.copy()
    nanz[3] = np.nan
    t4 = make_spec("uint4")
    s1, one = np.float32([[0.1]]), np.float32([[1.0]])
    inf1 = np.float32([[np.inf]])
    return [("negative scale", u4, neg, z), ("zero scale", u4, zero, z), ("inf scale", u4, inf, z),
            ("fractional zero point", u4, s, frac), ("zero point above", u4, s, high),
            ("zero point below", u4, s, low), ("NaN zero point", u4, s, nanz), ("missing zero point", u4, s, None),
            ("zero point for symmetric", i8, s, z), ("wrong scale shape", u4, s[:4], z),
            ("wrong zero point shape", u4, s, z[:4]),
            # per-tensor (one value each: checked as Python floats)
            ("tensor: negative scale", t4, np.float32([[-0.1]]), one),
            ("tensor: zero scale", t4, np.float32([[0.0]]), one), ("tensor: inf scale", t4, inf1, one),
            ("tensor: fractional zero point", t4, s1, np.float32([[1.5]])),
            ("tensor: zero point above", t4, s1, np.float32([[16.0]])),
            ("tensor: inf zero point", t4, s1, inf1)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", _bad_params(), ids=[c[0] for c in _bad_params()])
def test_given_refusals_match_general_path(backend, case):
    _, spec, s, z = case
    x = _as(backend, np.linspace(-1, 1, 8, dtype=np.float32).reshape(8, 1))
    ss, zz = (_as(backend, s) if s is not None else None), (_as(backend, z) if z is not None else None)
    with pytest.raises((ValueError, TypeError)) as general:
        _general(x, spec, scale=ss, zero_point=zz)
    with mock.patch.object(_fast, "small_kernels", side_effect=AssertionError("work before the error")):
        with pytest.raises(type(general.value)) as fast:
            qcore.fake_quantize(x, spec, scale=ss, zero_point=zz)
    assert str(fast.value) == str(general.value)


def test_given_torch_scale_with_numpy_x_is_refused_as_before():
    torch = pytest.importorskip("torch")
    spec = make_spec("uint4")
    x = np.zeros((4, 1), np.float32)
    with pytest.raises(TypeError, match="torch tensor but x is a numpy array"):
        qcore.fake_quantize(x, spec, scale=torch.full((1, 1), 0.1), zero_point=torch.zeros(1, 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_given_memo_rechecks_values_changed_in_place(backend):
    spec = make_spec("uint4", granularity=PerChannel(0))
    w = np.linspace(-1, 1, 16, dtype=np.float32).reshape(16, 1)
    s = np.full((16, 1), 0.1, np.float32)
    z = np.full((16, 1), 8.0, np.float32)
    ww, ss, zz = _as(backend, w, s, z)
    qcore.fake_quantize(ww, spec, scale=ss, zero_point=zz)  # checked and remembered
    ss[3] = -0.5  # the same object, now invalid
    with pytest.raises(ValueError, match="scale must be positive"):
        qcore.fake_quantize(ww, spec, scale=ss, zero_point=zz)
    ss[3] = 0.1
    zz[2] = 0.5
    with pytest.raises(ValueError, match="zero_point must hold integers"):
        qcore.fake_quantize(ww, spec, scale=ss, zero_point=zz)


@pytest.mark.parametrize("backend", BACKENDS)
def test_given_nan_scale_and_broadcast_shapes_take_the_general_path(backend):
    spec = make_spec("uint4", granularity=PerChannel(0))
    w = np.linspace(-1, 1, 16, dtype=np.float32).reshape(16, 1)
    s = np.full((16, 1), 0.1, np.float32)
    s[4] = np.nan  # a NaN scale marks a NaN block: allowed, handled by the general path
    z = np.full((16, 1), 8.0, np.float32)
    ww, ss, zz = _as(backend, w, s, z)
    got = qcore.fake_quantize(ww, spec, scale=ss, zero_point=zz)
    assert np.isnan(_np(got)[4, 0]) and not np.isnan(_np(got)[5, 0])
    _bits_equal(_np(got), _oracle(w, spec, s, z))
    # a per-tensor scale given as shape (1,) broadcasts: general path, same bits
    t = make_spec("uint4")
    s1, z1 = _as(backend, np.float32([0.1]), np.float32([8.0]))
    _bits_equal(_np(qcore.fake_quantize(ww, t, scale=s1, zero_point=z1)),
                _oracle(w, t, np.float32([[0.1]]), np.float32([[8.0]])))


def test_given_keeps_gradients_and_other_dtypes_on_the_general_path():
    torch = pytest.importorskip("torch")
    spec = make_spec("uint4")
    w = torch.linspace(-1, 1, 16).reshape(16, 1).requires_grad_()
    s, z = torch.full((1, 1), 0.1), torch.full((1, 1), 8.0)
    y = qcore.fake_quantize(w, spec, scale=s, zero_point=z)
    y.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))
    wb = w.detach().to(torch.bfloat16)
    _bits_equal(_np(qcore.fake_quantize(wb, spec, scale=s, zero_point=z)),
                _np(_general(wb, spec, scale=s, zero_point=z)))
    ws = w.detach()[::2]  # a strided view
    _bits_equal(_np(qcore.fake_quantize(ws, spec, scale=s, zero_point=z)),
                _np(_general(ws.contiguous(), spec, scale=s, zero_point=z)))


@pytest.mark.parametrize("fmt", ["mx9", "mx6", "mx4", "bfp16", "mxint8", "mxfp4"])
def test_ordinary_rows_take_the_bit_formulas_and_special_rows_do_not(fmt):
    """The edge rows above really run ``_floor_e8m0_params``' formulas (bfp16: with a bump), the special rows the
    general rule: both branches are covered by the equality tests."""
    rows, _ = _edge_rows(fmt)
    seen = []
    real = _fast._floor_e8m0_params

    def spy(*a, **k):
        r = real(*a, **k)
        seen.append(r is not None)
        return r

    with mock.patch.object(_fast, "_floor_e8m0_params", spy):
        qcore.fake_quantize(rows, make_spec(fmt))
        assert seen == [True]
        seen.clear()
        qcore.fake_quantize(_special_rows(), make_spec(fmt))
        assert seen and not any(seen)  # bfp16: tried on the cheap statistics, then on the full ones
    if fmt == "bfp16":
        s = np.asarray(qcore.quantize(rows[5:6, :8], make_spec(fmt)).scales)
        assert s.reshape(-1)[0] == 2.0  # amax (2 - 2**-7) * 2**0 rounds to 128: the exponent was bumped


@pytest.mark.parametrize("backend", BACKENDS)
def test_given_granularity_that_does_not_fit_raises_the_general_error(backend):
    spec = make_spec("int8", granularity=PerChannel(2))  # axis 2 on a 2-D x
    x = _as(backend, np.zeros((8, 1), np.float32))
    s = _as(backend, np.full((8, 1), 0.1, np.float32))
    with pytest.raises(ValueError) as general:
        _general(x, spec, scale=s)
    with pytest.raises(ValueError) as fast:
        qcore.fake_quantize(x, spec, scale=s)
    assert str(fast.value) == str(general.value)

"""The default (fast, slab-wise) path against the generic exact path, bit for bit (NaN positions equal).

The generic functions in qcore.quantize (``_fake_quantize_pure``, ``_quantize_parts`` + ``encode``, and the
decode-based dequantize) are the oracle; ``qcore._fast`` must give the same bits for every covered spec, on
numpy and torch, for every layout (per-tensor, per-channel on either axis, groups on either axis, blocks, short
last block rows, 1-D and 3-D inputs) and for adversarial values (zeros, subnormals, NaN/Inf blocks, huge and tiny
blocks, ties).
"""

from __future__ import annotations

import numpy as np
import pytest

import qcore
from qcore import PerBlock, PerChannel, PerGroup, make_spec
from qcore import _fast, _inplace
from qcore._backend import ops
from qcore.cast import decode, encode
from qcore.granularity import from_blocks, to_blocks
from qcore.quantize import _dequant_blocks, _fake_quantize_pure, _quantize_parts

SPECS = [
    ("mxfp4", {}), ("mxfp6_e2m3", {}), ("mxfp6_e3m2", {}), ("mxfp8_e4m3", {}), ("mxfp8_e5m2", {}),
    ("mxint8", {}), ("mx9", {}), ("mx6", {}), ("mx4", {}), ("bfp16", {}),
    ("mxfp4", {"scale_mode": qcore.ScaleMode.EVEN}), ("mxfp4", {"scale_mode": qcore.ScaleMode.CEIL}),
    ("mxfp4", {"scale_mode": qcore.ScaleMode.RCEIL}), ("mxfp4", {"granularity": PerGroup(16)}),
    ("float8_e4m3fn", {}), ("float8_e4m3fnuz", {}), ("float8_e5m2", {}), ("float8_e5m2fnuz", {}),
    ("float16", {}), ("float6_e2m3fn", {}), ("float4_e2m1fn", {}),
    ("float8_e4m3fn", {"granularity": PerChannel(0)}), ("float8_e4m3fn", {"granularity": PerChannel(-1)}),
    ("float8_e4m3fn", {"scale_dtype": "float8_e8m0fnu"}),
    ("int8", {}), ("int8", {"narrow_range": True}), ("int4", {"granularity": PerGroup(32)}),
    ("int4", {"granularity": PerGroup(16, axis=0)}), ("uint4", {"granularity": PerGroup(32), "symmetric": False}),
    ("int8", {"granularity": PerChannel(0)}), ("int8", {"granularity": PerChannel(1)}),
    ("int8", {"symmetric": False}), ("uint8", {"symmetric": False, "granularity": PerChannel(0)}),
    ("int8", {"granularity": PerBlock((8, 16))}), ("int4", {"scale_dtype": "float16", "granularity": PerGroup(32)}),
    ("int16", {"granularity": PerGroup(32)}), ("int2", {"granularity": PerGroup(32), "symmetric": False}),
    ("int8", {"pow2_scale": True, "granularity": PerGroup(32)}),
    ("nvfp4", {}), ("nvfp4", {"tensor_scale_mode": qcore.TensorScale.ONE}),
    ("nvfp4", {"scale_dtype": "float8_e5m3", "granularity": PerGroup(32)}),
]


def _ids(p):
    fmt, kw = p
    return fmt + ("-" + "-".join(f"{k}={v}" for k, v in kw.items()) if kw else "")


def _inputs(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    n = flat.size
    # adversarial values scattered over the array: zeros, subnormals, ties, huge, tiny, NaN, Inf
    idx = rng.choice(n, size=min(n, 64), replace=False)
    specials = np.array([0.0, -0.0, 1e-40, -1e-45, 2.5, -3.5, 0.75, 1e30, -1e-30, 6.0, 448.0, 464.0,
                         np.nan, np.inf, -np.inf, 3.4e38], np.float32)
    flat[idx] = specials[rng.integers(0, specials.size, idx.size)]
    # whole blocks of zeros and of tiny values
    if x.ndim == 2 and x.shape[0] > 4:
        x[1] = 0
        x[2] = x[2] * np.float32(2.0 ** -130)
        with np.errstate(over="ignore"):
            x[3] = x[3] * np.float32(2.0 ** 100)
    return x


def _bits_equal(a, b):
    a = np.asarray(a)
    b = np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    if a.dtype.kind == "f":
        an, bn = np.isnan(a), np.isnan(b)
        assert np.array_equal(an, bn), f"NaN positions differ: {np.argwhere(an != bn)[:5]}"
        ai, bi = a.view(np.uint32), b.view(np.uint32)
        bad = (ai != bi) & ~an
        assert not bad.any(), f"{bad.sum()} differ, first at {np.argwhere(bad)[:3]}: {a[bad][:5]} vs {b[bad][:5]}"
    else:
        bad = a != b
        assert not bad.any(), f"{bad.sum()} codes differ, first at {np.argwhere(bad)[:3]}: {a[bad][:5]} vs {b[bad][:5]}"


def _generic_fake(x, spec, scale=None, zp=None):
    return _fake_quantize_pure(x, scale, zp, None, spec=spec)


def _generic_quantize(x, spec, scale=None, zp=None):
    v, scales, z, shifts, g = _quantize_parts(x, scale, zp, None, spec=spec)
    d = spec.dtype
    o = ops(x)
    if isinstance(d, qcore.IntDType):
        codes = o.astype(v, (o.int8 if d.signed else o.uint8) if d.bits <= 8 else o.int32)
    else:
        codes = encode(v, d, saturate=True)
    return codes, scales, z, shifts, g


def _generic_dequantize(q):
    o = ops(q.codes)
    if q.spec.two_level:
        return _generic_two_level_deq(q)
    v = decode(q.codes, q.spec.dtype)
    vb, blocked = to_blocks(v, q.spec.granularity, o)
    return from_blocks(_dequant_blocks(vb, q.scales, q.zero_points, q.subblock_shifts, blocked, q.spec, o), blocked, o)


def _generic_two_level_deq(q):
    from qcore.quantize import _dequant_two_level, two_level_multipliers

    o = ops(q.codes)
    v = decode(q.codes, q.spec.dtype)
    vb, blocked = to_blocks(v, q.spec.granularity, o)
    g = o.reshape(o.asarray(q.tensor_scale, o.float32, v), ())
    _, dq = two_level_multipliers(q.scales, g, o)
    return from_blocks(_dequant_two_level(vb, dq, blocked, o), blocked, o)


def _np(a):
    return a.numpy() if hasattr(a, "numpy") else np.asarray(a)


SHAPES = [(16, 64), (5, 96), (37, 64), (3, 4, 64), (128,), (2, 32), (6, 40), (9, 100), (2, 3, 20), (45,)]


@pytest.mark.parametrize("p", SPECS, ids=_ids)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_fast_equals_generic(p, shape, backend):
    fmt, kw = p
    spec = make_spec(fmt, **kw)
    g = spec.granularity
    if isinstance(g, PerBlock) and len(shape) < 2:
        pytest.skip("PerBlock 2-D on a 1-D input")
    if isinstance(g, PerChannel) and g.axis >= len(shape):
        pytest.skip("axis out of range")
    if isinstance(g, PerGroup) and g.axis == 0 and len(shape) < 2:
        pytest.skip("groups along axis 0 of a 1-D input: same as last axis")
    rng = np.random.default_rng(abs(hash((fmt, shape))) % 2**32)
    x = _inputs(rng, shape)
    if backend == "torch":
        torch = pytest.importorskip("torch")
        x = torch.from_numpy(x)
    o = ops(x)
    fast = _fast.run_fake_quantize(x, spec, None, None, o)
    ref = _generic_fake(x, spec)
    if fast is not None:
        _bits_equal(_np(fast), _np(ref))
    q = _fast.run_quantize(x, spec, None, None, o)
    codes, scales, z, shifts, g = _generic_quantize(x, spec)
    if q is not None:
        _bits_equal(_np(q[0]), _np(codes))
        _bits_equal(_np(q[1]), _np(scales))
        if z is not None:
            _bits_equal(_np(q[2]), _np(z))
        if shifts is not None:
            _bits_equal(_np(q[3]), _np(shifts))
    if g is not None:
        _bits_equal(_np(q[4]), _np(g))
    qt = qcore.QTensor(codes, scales, z, spec, shifts, g)
    deq = _fast.run_dequantize(qt, o)
    if deq is not None:
        _bits_equal(_np(deq), _np(_generic_dequantize(qt)))
    # the public functions: fake == dequantize(quantize), same bits on both backends
    fq = qcore.fake_quantize(x, spec)
    _bits_equal(_np(fq), _np(ref))
    _bits_equal(_np(qcore.dequantize(qcore.quantize(x, spec))), _np(ref))


def test_fast_path_is_taken():
    """The common specs do run the fast kernels (a silent fallback would hide a slowdown)."""
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    o = ops(x)
    for fmt in ("mxfp4", "mxfp8_e4m3", "mxint8", "mx9", "mx6", "bfp16", "float8_e4m3fn", "int8"):
        spec = make_spec(fmt)
        assert _fast.run_fake_quantize(x, spec, None, None, o) is not None, fmt
        assert _fast.run_quantize(x, spec, None, None, o) is not None, fmt
    assert _fast.run_fake_quantize(x, make_spec("int4", granularity=PerGroup(32)), None, None, o) is not None


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_given_scale_and_zero_point(backend):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((576, 1)).astype(np.float32)
    spec = make_spec("uint4", symmetric=False, granularity=PerChannel(1))
    s = np.array([[0.37]], np.float32)
    z = np.array([[8.0]], np.float32)
    if backend == "torch":
        torch = pytest.importorskip("torch")
        w, s, z = torch.from_numpy(w), torch.from_numpy(s), torch.from_numpy(z)
    got = qcore.fake_quantize(w, spec, scale=s, zero_point=z)
    _bits_equal(_np(got), _np(_generic_fake(w, spec, s, z)))
    expected = (np.clip(np.rint(_np(w) / np.float32(0.37)) + 8, 0, 15) - 8) * np.float32(0.37)
    _bits_equal(_np(got), expected.astype(np.float32))


def test_slabs_split_blocks_rows_only_when_needed():
    plan = _fast.slabs([40, 64], [16, 1], target=2048)
    assert plan == [(0, 32, None), (32, 40, None)]
    plan = _fast.slabs([100, 1000], [100, 1], target=30000)
    assert all(b == 0 for _, _, b in plan) and plan[0][0] == 0 and plan[-1][1] == 100


def test_small_slabs_equal_one_slab(monkeypatch):
    """Statistics that combine across slabs (per-tensor, per-channel along the last axis) give the same bits."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 48)).astype(np.float32)
    for fmt, kw in [("float8_e4m3fn", {}), ("int8", {"granularity": PerChannel(1)}), ("int8", {"symmetric": False})]:
        spec = make_spec(fmt, **kw)
        ref = _generic_fake(x, spec)
        monkeypatch.setattr(_inplace, "SLAB", 100)
        monkeypatch.setattr(_inplace, "SLAB_TORCH", 100)
        plan = _fast.slabs([64, 48], [64, 1] if kw.get("granularity") else [64, 48], target=100)
        assert len(plan) > 1
        got = _fast.run_fake_quantize(x, spec, None, None, ops(x))
        monkeypatch.undo()
        _bits_equal(got, ref)


PROBE_FORMATS = ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxint8", "mx9", "mx6", "mx4",
                 "bfp16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float4_e2m1fn", "int8", "int4"]


@pytest.mark.parametrize("fmt", PROBE_FORMATS)
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_fast_on_probes(fmt, backend):
    """The kit's probes (every code's neighbours, ties, subnormals, saturation edges, special blocks)."""
    from qcore.testing import probes

    x = np.ascontiguousarray(probes(fmt), dtype=np.float32)
    if backend == "torch":
        torch = pytest.importorskip("torch")
        x = torch.from_numpy(x)
    o = ops(x)
    specs = [make_spec(fmt)]
    if isinstance(qcore.get_dtype(fmt), qcore.BlockDType):
        specs.append(make_spec(fmt, scale_mode=qcore.ScaleMode.EVEN))
    else:
        specs.append(make_spec(fmt, granularity=PerChannel(0)))
    for spec in specs:
        fast = _fast.run_fake_quantize(x, spec, None, None, o)
        assert fast is not None
        _bits_equal(_np(fast), _np(_generic_fake(x, spec)))
        q = _fast.run_quantize(x, spec, None, None, o)
        codes = _generic_quantize(x, spec)[0]
        _bits_equal(_np(q[0]), _np(codes))


@pytest.mark.parametrize("fmt", ["float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn", "float8_e4m3fn", "float8_e5m2",
                                 "float8_e4m3fnuz", "float16", "int4", "int8"])
def test_fast_ties_with_unit_scale(fmt):
    """Every midpoint between grid neighbours (and +-1 ulp around it) under a given scale of 1: ties to even."""
    d = qcore.get_dtype(fmt)
    if isinstance(d, qcore.IntDType):
        grid = np.arange(d.min, d.max + 1, dtype=np.float32)
    else:
        codes = np.arange(1 << d.bits)
        if d.bits > 8:
            codes = codes[::37]
        grid = np.unique(np.abs(decode(codes.astype(np.int32), d)))
        grid = grid[np.isfinite(grid)]
        grid = np.concatenate([-grid[::-1], grid])
    mids = (grid[:-1] + grid[1:]) / np.float32(2)
    x = np.concatenate([mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)), grid])
    x = x.astype(np.float32).reshape(1, -1)
    spec = make_spec(fmt)
    one = np.ones((1, 1), np.float32)
    got = _fast.run_fake_quantize(x, spec, one, None, ops(x))
    _bits_equal(got, _generic_fake(x, spec, one))


CAST_FORMATS = ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e4m3", "float8_e3m4",
                "float8_e4m3b11fnuz", "float16", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"]


@pytest.mark.parametrize("fmt", CAST_FORMATS)
@pytest.mark.parametrize("saturate", [None, True])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_fast_cast_equals_generic(fmt, saturate, backend):
    """``cast``'s fast kernel against the generic bit path on 2**18 random bit patterns plus the kit's probes."""
    from qcore.cast import _cast_float, _resolve_saturate
    from qcore.testing import probes

    d = qcore.get_dtype(fmt)
    if saturate is False and d.specials is qcore.Specials.FINITE:
        pytest.skip("always saturates")
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.integers(-2**31, 2**31, 2**18, dtype=np.int64).astype(np.int32).view(np.float32),
                        np.asarray(probes(fmt), np.float32).reshape(-1)])
    x = x[~np.isnan(x) | (x.view(np.int32) & 0x400000 != 0)]  # quiet NaNs only (signalling ones come back quiet)
    if backend == "torch":
        torch = pytest.importorskip("torch")
        x = torch.from_numpy(x)
    o = ops(x)
    sat = _resolve_saturate(d, saturate)
    assert _inplace.cast_ok(d, qcore.RoundingMode.NEAREST_EVEN)
    got = _inplace.run_cast(x, d, sat, o)
    with np.errstate(all="ignore"):
        ref = _cast_float(x, d, qcore.RoundingMode.NEAREST_EVEN, sat, None, o)
    _bits_equal(_np(got), _np(ref))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("case", ["uint4_tensor", "uint4_rows", "int8_rows", "fp8_tensor", "mxfp4"])
def test_fake_quantizer_equals_fake_quantize(backend, case):
    """``qcore.fake_quantizer`` (parameters validated once) gives fake_quantize's bits on many tensors."""
    rng = np.random.default_rng(21)
    shape = (576, 1) if case != "mxfp4" else (4, 64)
    if case == "uint4_tensor":
        spec, s, z = make_spec("uint4", symmetric=False), np.float32([[0.11]]), np.float32([[7]])
    elif case == "uint4_rows":
        spec = make_spec("uint4", symmetric=False, granularity=PerChannel(0))
        s, z = rng.uniform(0.01, 0.2, (576, 1)).astype(np.float32), rng.integers(0, 16, (576, 1)).astype(np.float32)
    elif case == "int8_rows":
        spec, s, z = make_spec("int8", granularity=PerChannel(0)), rng.uniform(0.01, 0.2, (576, 1)).astype(np.float32), None
    elif case == "fp8_tensor":
        spec, s, z = make_spec("float8_e4m3fn"), np.float32([[0.003]]), None
    else:
        spec = make_spec("mxfp4")
        s, z = np.exp2(rng.integers(-3, 3, (4, 2))).astype(np.float32), None
    like = None
    if backend == "torch":
        torch = pytest.importorskip("torch")
        like = torch.zeros(1)
    f = qcore.fake_quantizer(spec, shape=shape, scale=s, zero_point=z, like=like)
    for i in range(3):
        x = rng.standard_normal(shape).astype(np.float32) * np.float32(0.5 + i)
        x.reshape(-1)[:3] = [0.0, -0.0, np.nan]
        if backend == "torch":
            x = torch.from_numpy(x)
        sp = s if backend == "numpy" else torch.from_numpy(s)
        zp = z if (z is None or backend == "numpy") else torch.from_numpy(z)
        _bits_equal(_np(f(x)), _np(qcore.fake_quantize(x, spec, scale=sp, zero_point=zp)))
    with pytest.raises(ValueError, match="prepared for shape"):
        f(x[:2])


def test_fake_quantizer_validates_before_work():
    spec = make_spec("uint4", symmetric=False)
    with pytest.raises(ValueError, match="zero_point"):
        qcore.fake_quantizer(spec, shape=(8, 1), scale=np.float32([[0.1]]), zero_point=np.float32([[0.5]]))
    with pytest.raises(ValueError, match="scale must be positive"):
        qcore.fake_quantizer(spec, shape=(8, 1), scale=np.float32([[-0.1]]), zero_point=np.float32([[1]]))
    with pytest.raises(ValueError, match="key"):
        qcore.fake_quantizer(make_spec("int8", rounding=qcore.RoundingMode.STOCHASTIC), shape=(8, 1),
                             scale=np.float32([[0.1]]))


@pytest.mark.parametrize("mode", ["NEAREST_AWAY", "TOWARD_ZERO", "FLOOR", "CEIL"])
@pytest.mark.parametrize("fmt", ["mxfp4", "int4", "bfloat16"])
def test_generic_specs_run_in_row_slabs(monkeypatch, mode, fmt):
    """Specs the fast kernels do not cover run the generic function on slabs of rows: same bits as one call."""
    rng = np.random.default_rng(2)
    x = _inputs(rng, (64, 96))
    kw = {"granularity": PerGroup(32)} if fmt == "int4" else ({"granularity": PerChannel(0)} if fmt == "bfloat16" else {})
    spec = make_spec(fmt, rounding=getattr(qcore.RoundingMode, mode), **kw)
    assert _fast.kernel_kind(spec) is None
    monkeypatch.setattr(_inplace, "SLAB", 500)
    monkeypatch.setattr(_inplace, "SLAB_TORCH", 500)
    got = _fast.generic_rows(_fake_quantize_pure, x, spec, None, None, None, ops(x))
    assert got is not None
    _bits_equal(got, _generic_fake(x, spec))

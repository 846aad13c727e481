"""The fused dequantize-matmul for int4/uint4 per-group and MXFP4 packed weights.

Its weight tiles (``dequantize_w4``, the same jit function the matmul calls) equal ``qcore.dequantize`` bit for bit;
the product is within a stated tolerance of torch's matmul on the core's dequantized weight cast to the
activation dtype: float32 accumulation in both, so the difference is summation order only (relative error at
most ``k * eps32`` of the sum of |products|; asserted: |y - ref| <= 1e-5 * (|x| @ |W|.T) + output rounding).
"""

import numpy as np
import pytest

import qcore
from qcore import PerGroup, ScaleMode
from qcore.testing import compare, probes_by_kind

torch = pytest.importorskip("torch")
qt = pytest.importorskip("qcore.adapters.triton")

SPECS = {
    "int4_g32": qcore.make_spec("int4", granularity=PerGroup(32, -1)),
    "int4_g48": qcore.make_spec("int4", granularity=PerGroup(48, -1)),
    "uint4_g64": qcore.make_spec("uint4", granularity=PerGroup(64, -1)),
    "uint4_sym_g32": qcore.make_spec("uint4", granularity=PerGroup(32, -1), symmetric=True),
    "mxfp4": qcore.make_spec("mxfp4"),
    "mxfp4_even": qcore.make_spec("mxfp4", scale_mode=ScaleMode.EVEN),
}


def _frozen(w: torch.Tensor, spec):
    """A weight quantized by the core and stored as a frozen module stores it (qcore.adapters.modules.freeze)."""
    q = qcore.quantize(w, spec)
    packed = qcore.packing.pack(q.codes, spec.dtype, axis=-1)
    scales = q.scale_codes if spec.pow2_scale else q.scales
    zp = None if q.zero_points is None else q.zero_points.to(torch.uint8)
    return q, packed, scales, zp


@pytest.mark.parametrize("name", list(SPECS))
def test_weight_tiles_equal_the_core_dequantize(name, device):
    spec = SPECS[name]
    probe_spec = qcore.make_spec(spec, granularity=PerGroup(spec.granularity.size, -1))
    kinds = probes_by_kind(probe_spec)
    w = np.concatenate([kinds[k] for k in ("zeros", "one_outlier", "pow2_amax", "element_grid", "tiny", "random")])
    if spec.dtype.name == "float4_e2m1fn":
        w = np.concatenate([w, kinds["nan"], kinds["inf"]])  # NaN blocks (E8M0 byte 0xFF)
    q, packed, scales, zp = _frozen(torch.from_numpy(w), spec)
    d = lambda t: None if t is None else t.to(device)  # noqa: E731
    got = qt.dequantize_w4(d(packed), d(scales), d(zp), spec=spec, k=w.shape[1])
    rep = compare(got, qcore.dequantize(q))
    assert rep.ok, rep.format()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", ["int4_g32", "uint4_g64", "mxfp4"])
@pytest.mark.parametrize("lead", [(1,), (3, 1), (3, 5)])  # M = 1: split-K GEMV; 3: one-launch GEMV; 15: tl.dot
def test_product_within_tolerance_of_torch(name, dtype, lead, device):
    spec = SPECS[name]
    g = torch.Generator().manual_seed(0)
    n, k = 40, 136  # ragged: 136 = 4 * 32 + 8, not a multiple of 64, odd tile counts
    w = torch.randn(n, k, generator=g)
    x = torch.randn(*lead, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    q, packed, scales, zp = _frozen(w, spec)
    wd = qcore.dequantize(q).to(dtype)
    ref = torch.nn.functional.linear(x.float(), wd.float(), bias.float())
    d = lambda t: None if t is None else t.to(device)  # noqa: E731
    y = qt.linear_w4(d(x), d(packed), d(scales), d(zp), d(bias), spec=spec, k=k).cpu()
    assert y.dtype == dtype and y.shape == (*lead, n)
    bound = 1e-5 * (x.float().abs() @ wd.float().abs().T + bias.float().abs()) + ref.abs() * _eps(dtype)
    err = (y.float() - ref).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    # a wrong weight (one code off) is caught by the same check
    if dtype == torch.float32:
        bad = packed.clone()
        bad[0, 0] ^= 0x1
        yb = qt.linear_w4(d(x), d(bad), d(scales), d(zp), d(bias), spec=spec, k=k).cpu()
        assert not bool(((yb.float() - ref).abs() <= bound).all())


def _eps(dtype):
    return {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[dtype]


def test_arguments_are_checked_before_work(device):
    spec = SPECS["int4_g32"]
    w = torch.randn(8, 128)
    q, packed, scales, zp = _frozen(w, spec)
    x = torch.randn(2, 128).to(device)
    with pytest.raises(ValueError, match="k=125"):
        qt.linear_w4(x, packed.to(device), scales.to(device), spec=spec, k=125)
    with pytest.raises(ValueError, match="scales has shape"):
        qt.linear_w4(x, packed.to(device), scales[:, :1].to(device), spec=spec, k=128)
    with pytest.raises(ValueError, match="fused matmul reads"):
        qt.linear_w4(x, packed.to(device), scales.to(device), spec=qcore.make_spec("int8", granularity=PerGroup(32)),
                     k=128)
    with pytest.raises(ValueError, match="zero_points"):
        qt.linear_w4(x, packed.to(device), scales[:, :2].to(device), spec=SPECS["uint4_g64"], k=128)
    assert qt.w4_format(SPECS["mxfp4_even"]) == "mxfp4" and qt.w4_format("nvfp4") is None

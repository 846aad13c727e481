"""qcore.ggml_act: llama.cpp's activation quantizers (Q8_0, Q8_1, Q8_K) bit for bit.

Three independent references: scalar transcriptions of the C source written here (x86's ``quantize_row_q8_0`` /
``quantize_row_q8_1`` from ggml-cpu's arch/x86/quants.c, and ``quantize_row_q8_0_ref`` / ``_q8_1_ref`` /
``_q8_K_ref`` from ggml-quants.c; Python floats hold float32 values exactly, float16 through ``struct``'s "e"),
gguf-py's ``Q8_0`` (the reference variant), and llama.cpp's own CPU backend through ctypes
(``qcore.testing.ggml.ggml_from_float``, when llama-cpp-python is installed: it is in this project's environment)."""

import math
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qcore import ggml_act as A
from qcore.testing import ggml

torch = pytest.importorskip("torch")

F32 = np.float32


def f16(v: float) -> float:
    """IEEE half rounding (round to nearest even, overflow to inf) by the struct module."""
    try:
        return struct.unpack("e", struct.pack("e", float(v)))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def rne(v: float) -> int:
    return int(round(v))  # Python rounds half to even, on the exact value


def roundf(v: float) -> int:
    return int(math.copysign(math.floor(abs(v) + 0.5), v))  # C's roundf (exact in double for a float32 v)


def ref_q8_32(x: np.ndarray, variant: str):
    """Per block of 32: (stored d, codes, s) as the C functions compute them; float32 arithmetic via F32."""
    ds, qs, ss = [], [], []
    for blk in x.reshape(-1, 32):
        amax = F32(0)
        for v in blk:
            amax = max(amax, abs(F32(v)))
        d = F32(amax / F32(127))
        if variant == "x86":  # id = 127 / max, _mm256_round_ps(_MM_ROUND_NEAREST)
            ident = F32(F32(127) / amax) if amax != 0 else F32(0)
            q = [rne(float(F32(F32(v) * ident))) for v in blk]
        else:  # id = 1 / d, roundf
            ident = F32(F32(1) / d) if d != 0 else F32(0)
            q = [roundf(float(F32(F32(v) * ident))) for v in blk]
        ds.append(f16(d))
        qs.append(q)
        ss.append(f16(float(F32(d * F32(sum(q))))))
    n = x.shape[-1] // 32
    return (np.array(ds, np.float32).reshape(*x.shape[:-1], n), np.array(qs, np.int8).reshape(x.shape),
            np.array(ss, np.float32).reshape(*x.shape[:-1], n))


def ref_q8_k(x: np.ndarray):
    ds, qs, bs = [], [], []
    for blk in x.reshape(-1, 256):
        amax, mx = F32(0), F32(0)
        for v in blk:
            if abs(F32(v)) > amax:
                amax, mx = abs(F32(v)), F32(v)
        if amax == 0:
            ds.append(0.0)
            qs.append([0] * 256)
            bs.append([0] * 16)
            continue
        iscale = F32(F32(-127) / mx)
        q = [min(127, rne(float(F32(iscale * F32(v))))) for v in blk]
        ds.append(float(F32(F32(1) / iscale)))
        qs.append(q)
        bs.append([sum(q[16 * j:16 * j + 16]) for j in range(16)])
    n = x.shape[-1] // 256
    return (np.array(ds, np.float32).reshape(*x.shape[:-1], n), np.array(qs, np.int8).reshape(x.shape),
            np.array(bs, np.int16).reshape(*x.shape[:-1], n * 16))


def inputs(seed: int, rows: int = 3, n: int = 512) -> np.ndarray:
    """Rows of every kind the quantizers branch on: Gaussian, an outlier, exact halves (ties), an all-zero block, a
    block of one repeated value, negative and positive maxima of equal magnitude, tiny and large magnitudes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[0, 5] = 40.0
    x[1] = np.round(x[1] * 8) / 8  # many products land on halves
    x[1, :32] = 0.0
    x[1, 32:64] = 0.75
    x[2, 256:288] = np.where(np.arange(32) % 2, 3.0, -3.0)
    x[2, :256] *= 1e-3
    x[0, 256:] *= 300.0
    return x


def np_or_torch(x, lib):
    return torch.from_numpy(x) if lib == "torch" else x


def as_np(a):
    return a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("variant", ["x86", "ref"])
def test_q8_0_and_q8_1_equal_the_c_source(lib, variant):
    x = inputs(0)
    d, q, s = ref_q8_32(x, variant)
    b0 = A.quantize_q8_0(np_or_torch(x, lib), variant=variant)
    b1 = A.quantize_q8_1(np_or_torch(x, lib), variant=variant)
    assert b0.s is None
    for b in (b0, b1):
        assert as_np(b.qs).dtype == np.int8 and as_np(b.qs).shape == x.shape
        np.testing.assert_array_equal(as_np(b.d), d)
        np.testing.assert_array_equal(as_np(b.qs), q)
    np.testing.assert_array_equal(as_np(b1.s), s)


def test_the_two_variants_differ_where_the_c_differs():
    """x86 rounds halves to even, the reference away from zero: a block whose products land on .5."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1] = 127.0, 2.5  # id = 1 exactly: 2.5 -> 2 (x86) or 3 (ref)
    assert as_np(A.quantize_q8_0(x).qs)[0, 1] == 2
    assert as_np(A.quantize_q8_0(x, variant="ref").qs)[0, 1] == 3


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_q8_k_equals_the_c_source(lib):
    x = inputs(1)
    d, q, bs = ref_q8_k(x)
    b = A.quantize_q8_K(np_or_torch(x, lib))
    np.testing.assert_array_equal(as_np(b.d), d)
    np.testing.assert_array_equal(as_np(b.qs), q)
    np.testing.assert_array_equal(as_np(b.bsums), bs)
    tie = np.zeros((2, 256), np.float32)
    tie[0, :2], tie[1, :2] = (-3, 3), (3, -3)  # equal magnitudes: the first one's sign decides d's
    d = as_np(A.quantize_q8_K(np_or_torch(tie, lib)).d)
    assert d[0, 0] > 0 > d[1, 0]


def test_reference_variant_is_gguf_py_q8_0():
    gguf = pytest.importorskip("gguf")
    x = inputs(2)
    blocks = np.asarray(gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)).reshape(3, -1, 34)
    b = A.quantize_q8_0(x, variant="ref")
    np.testing.assert_array_equal(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32), b.d)
    np.testing.assert_array_equal(blocks[..., 2:].view(np.int8).reshape(x.shape), b.qs)


needs_cpu = pytest.mark.skipif(ggml.ggml_cpu_library() is None,
                               reason="llama.cpp's CPU backend (libggml-cpu, from llama-cpp-python) not installed")


@needs_cpu
def test_x86_variant_is_llama_cpps_own_cpu_backend():
    """libggml-cpu's quantize_row_q8_0 / _q8_1 / _q8_K (what llama.cpp converts activations with), byte for byte."""
    x = np.concatenate([inputs(3), inputs(4)])
    x[4, :32] = 5000.0  # Q8_1's float16 s overflows: inf in both
    blocks = ggml.ggml_from_float(x, "q8_0")
    b = A.quantize_q8_0(x)
    np.testing.assert_array_equal(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32), b.d)
    np.testing.assert_array_equal(blocks[..., 2:].view(np.int8).reshape(x.shape), b.qs)
    blocks = ggml.ggml_from_float(x, "q8_1")
    b = A.quantize_q8_1(x)
    np.testing.assert_array_equal(blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32), b.d)
    np.testing.assert_array_equal(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), b.s)
    np.testing.assert_array_equal(blocks[..., 4:].view(np.int8).reshape(x.shape), b.qs)
    assert np.isinf(b.s[4, 0])
    blocks = ggml.ggml_from_float(x, "q8_K")
    b = A.quantize_q8_K(x)
    np.testing.assert_array_equal(blocks[..., :4].copy().view(np.float32)[..., 0], b.d)
    np.testing.assert_array_equal(blocks[..., 4:260].view(np.int8).reshape(x.shape), b.qs)
    np.testing.assert_array_equal(blocks[..., 260:].copy().view(np.int16).reshape(b.bsums.shape), b.bsums)


@needs_cpu
def test_vec_dot_types_are_llama_cpps():
    gguf = pytest.importorskip("gguf")
    for name, want in A.VEC_DOT_TYPES.items():
        got = ggml.ggml_vec_dot_type(int(gguf.GGMLQuantizationType[name]))
        assert gguf.GGMLQuantizationType(got).name == want, name


@needs_cpu
def test_q4_1_dot_product_is_rounded_activations_plus_offsets_times_the_residual():
    """ggml_vec_dot_q4_1_q8_1 (llama.cpp's Q4_1 product) equals ``sum(w * activation_values) + sum(m *
    q8_1_residual)`` to float32 rounding, and not the plain product of the rounded activations."""
    import ctypes
    lib = ggml.ggml_cpu_library()
    fn = lib.ggml_vec_dot_q4_1_q8_1
    fn.restype = None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                   ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    rng = np.random.default_rng(5)
    n = 1024
    misses = []
    for t in range(8):
        w = (rng.standard_normal(n) * 0.05 + 0.04).astype(np.float32)  # offsets far from zero
        x = (rng.standard_normal(n) * 3 + 2).astype(np.float32)
        wb = np.ascontiguousarray(ggml.ggml_quantize(w[None], "q4_1")[0])
        xb = np.ascontiguousarray(ggml.ggml_from_float(x[None], "q8_1")[0])
        out = np.zeros(1, np.float32)
        fn(n, out.ctypes.data, 0, wb.ctypes.data, 0, xb.ctypes.data, 0, 1)
        blk = wb.reshape(-1, 20)
        d = blk[:, :2].copy().view(np.float16)[:, 0].astype(np.float64)
        m = blk[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float64)
        q = np.concatenate([blk[:, 4:] & 15, blk[:, 4:] >> 4], axis=1).astype(np.float64)
        wv = (d[:, None] * q + m[:, None]).reshape(-1)
        a = A.activation_values(x, "Q8_1").astype(np.float64)
        plain = float(wv @ a)
        pred = plain + float(m @ A.q8_1_residual(x).astype(np.float64))
        assert abs(pred - out[0]) <= 2e-6 * np.abs(wv * a).sum(), (t, pred, out[0])
        misses.append(abs(plain - out[0]) / max(abs(pred - out[0]), 1e-9))
    assert np.median(misses) > 10  # the residual term is what makes the difference


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_activation_values_and_the_q8_1_residual(lib):
    x = inputs(6)
    xt = np_or_torch(x, lib)
    b = A.quantize_q8_1(x)
    want = (b.qs.astype(np.float32).reshape(3, -1, 32) * b.d[..., None]).reshape(x.shape)
    np.testing.assert_array_equal(as_np(A.activation_values(xt, "Q8_1")), want)
    np.testing.assert_array_equal(as_np(A.activation_values(xt, "q8_0")), want)
    k = A.quantize_q8_K(x)
    np.testing.assert_array_equal(as_np(A.activation_values(xt, "Q8_K")),
                                  (k.qs.astype(np.float32).reshape(3, -1, 256) * k.d[..., None]).reshape(x.shape))
    np.testing.assert_array_equal(as_np(A.activation_values(xt, "F16")), x.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(as_np(A.activation_values(xt, "BF16")),
                                  torch.from_numpy(x).bfloat16().float().numpy())
    np.testing.assert_array_equal(as_np(A.activation_values(xt, "F32")), x)
    sums = b.qs.astype(np.int32).reshape(3, -1, 32).sum(-1).astype(np.float32)
    np.testing.assert_array_equal(as_np(A.q8_1_residual(xt)), b.s - b.d * sums)


def test_bfloat16_rounding_of_numpy_is_torchs():
    x = np.array([1.0, 1.00390625, 1.01171875, -3.3e38, 3.4e38, np.inf, -0.0, 1e-40, 2.5e-39], np.float32)
    np.testing.assert_array_equal(A.activation_values(x[None, :], "BF16")[0], torch.from_numpy(x).bfloat16().float())
    assert np.isnan(A.activation_values(np.array([np.nan], np.float32), "BF16")[0])


@settings(deadline=None, max_examples=25)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1e-6, 1.0, 1e3]), st.sampled_from(["x86", "ref"]))
def test_torch_path_equals_numpy_path(seed, scale, variant):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, 256)) * scale).astype(np.float32)
    x[0, :16] = np.round(x[0, :16] * 4) / 4
    xt = torch.from_numpy(x)
    for f in (A.quantize_q8_0, A.quantize_q8_1):
        for a, b in zip(f(x, variant=variant), f(xt, variant=variant)):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(a, b.numpy())
    for a, b in zip(A.quantize_q8_K(x), A.quantize_q8_K(xt)):
        np.testing.assert_array_equal(a, b.numpy())
    np.testing.assert_array_equal(A.q8_1_residual(x, variant=variant), A.q8_1_residual(xt, variant=variant).numpy())


def test_vec_dot_type_and_block_size():
    assert A.vec_dot_type("q4_1") == "Q8_1" and A.vec_dot_type("Q4_K") == "Q8_K" and A.vec_dot_type("F16") == "F16"
    assert A.vec_dot_type("MXFP4") == "Q8_0"
    assert [A.block_size(k) for k in ("Q8_0", "Q8_1", "Q8_K", "F16")] == [32, 32, 256, 1]


def test_refusals_name_the_argument():
    with pytest.raises(ValueError, match="last axis of x must be a multiple of 32.*shape \\(2, 48\\)"):
        A.quantize_q8_0(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="multiple of 256"):
        A.quantize_q8_K(np.zeros(128, np.float32))
    with pytest.raises(ValueError, match="multiple of 256"):
        A.activation_values(np.zeros(32, np.float32), "Q8_K")
    with pytest.raises(ValueError, match="variant must be one of .*'arm'"):
        A.quantize_q8_1(np.zeros(32, np.float32), variant="arm")
    with pytest.raises(ValueError, match="kind must be a vec_dot_type.*'Q4_0'"):
        A.activation_values(np.zeros(32, np.float32), "Q4_0")
    with pytest.raises(ValueError, match="ggml_type must be one of.*'IQ2_XXS'"):
        A.vec_dot_type("IQ2_XXS")
    with pytest.raises(TypeError, match="real numbers, got dtype complex64"):
        A.quantize_q8_0(np.zeros(32, np.complex64))
    with pytest.raises(ValueError, match="multiple of 32"):
        A.quantize_q8_0(np.float32(1.0))

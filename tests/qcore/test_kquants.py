"""GGUF k-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and the 32-element types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) as qcore
specs with llama.cpp's quantizer (docs/numerics.md, "GGUF k-quants").

Oracles: llama.cpp's own quantizer, ``ggml_quantize_chunk`` from llama-cpp-python's ``libggml-base`` through
ctypes (``qcore.testing.ggml``; skipped without the library): qcore's bytes must equal it, with and without an
importance matrix; and gguf-py's ``gguf.quants.dequantize`` (skipped without gguf): qcore's values must equal
it bit for bit, on llama.cpp's bytes and on random bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

import qcore
from qcore import PerGroup, dequantize, fake_quantize, make_spec, quantize
from qcore.packing import pack_gguf_blocks, unpack_gguf_blocks
from qcore.testing import probes
from qcore.testing.ggml import ggml_library, ggml_quantize

KQ = ["q4_k", "q6_k", "q5_k", "q3_k", "q2_k"]
LEGACY = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]
ALL = KQ + LEGACY + ["iq4_nl"]
SIZE = {"q2_k": 84, "q3_k": 110, "q4_k": 144, "q5_k": 176, "q6_k": 210,
        "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34, "iq4_nl": 18}
BLOCK = {n: 256 if n in KQ else 32 for n in ALL}

needs_ggml = pytest.mark.skipif(ggml_library() is None, reason="llama.cpp's libggml-base is not installed")


def _gguf():
    gq = pytest.importorskip("gguf.quants")
    import gguf

    return gq, gguf


def _inputs(seed: int = 0) -> np.ndarray:
    """(rows, 512) float32: two super-blocks per row, one distribution per row."""
    rng = np.random.default_rng(seed)
    n = 512
    rows = [
        rng.standard_normal(n),                                   # normal
        rng.standard_t(1.5, n),                                   # heavy-tailed
        np.concatenate([np.zeros(256), rng.standard_normal(256)]),  # an all-zero super-block
        np.concatenate([np.full(256, 0.7), np.full(256, -1.25)]),   # constant super-blocks
        np.concatenate([np.full(32, 3.0), rng.standard_normal(224), np.zeros(16), rng.random(240)]),  # const/zero subs
        rng.standard_normal(n) * 1e-6,                            # tiny
        rng.standard_normal(n) * 1e-30,                           # d underflows fp16
        rng.standard_normal(n) * 3e4,                             # huge
        rng.random(n) + 5.0,                                      # all positive, offset
        -rng.random(n) - 5.0,                                     # all negative
        np.round(rng.standard_normal(n) * 4) / 4,                 # ties on a grid
        np.where(rng.random(n) < 0.05, rng.standard_normal(n) * 20, 0.0),  # sparse with outliers
        rng.standard_normal(n).astype(np.float16),                # fp16 weights
        np.concatenate([rng.standard_normal(256) * 1e3, rng.standard_normal(256) * 1e-3]),
    ]
    return np.stack(rows).astype(np.float32)


def _probe_rows() -> np.ndarray:
    """The oracle kit's probe values (finite ones), cut into rows of 256."""
    v = np.concatenate([probes(f).reshape(-1) for f in ("mxfp4", "nvfp4", "int8", "uint4")])
    v = v[np.isfinite(v)]
    v = v[np.abs(v) < 1e6].astype(np.float32)
    n = len(v) // 256 * 256
    return v[:n].reshape(-1, 256)


def _imatrices(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return {"none": None, "ones": np.ones(n, np.float32), "random": (rng.random(n) ** 3).astype(np.float32),
            "sq": (rng.standard_normal(n) ** 2).astype(np.float32)}


# ---------------------------------------------------------------------------------------------------------------
# bytes == llama.cpp's


@needs_ggml
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("imx", ["none", "ones", "random", "sq"])
def test_bytes_equal_ggml(name, imx):
    x = _inputs()
    qw = _imatrices(x.shape[1])[imx]
    q = quantize(x, name, imatrix=qw)
    ours = pack_gguf_blocks(q)
    ref = ggml_quantize(x, name, qw)
    assert ours.shape == ref.shape == (x.shape[0], 512 // BLOCK[name] * SIZE[name])
    bad = np.nonzero((ours != ref).any(axis=1))[0]
    assert bad.size == 0, f"{name} imatrix={imx}: rows {bad.tolist()} differ from ggml_quantize_chunk"


@needs_ggml
@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("seed", [3, 4])
def test_bytes_equal_ggml_random(name, seed):
    rng = np.random.default_rng(seed)
    n = 768 if name in KQ else 576  # SmolLM2's rows: not a multiple of 256, whole blocks of 32
    x = (rng.standard_normal((48, n)) * np.exp(rng.uniform(-8, 8, (48, 1)))).astype(np.float32)
    qw = (rng.random(n) * 2).astype(np.float32)
    for w in (None, qw):
        assert np.array_equal(pack_gguf_blocks(quantize(x, name, imatrix=w)), ggml_quantize(x, name, w))


@needs_ggml
@pytest.mark.parametrize("name", ALL)
def test_bytes_equal_ggml_on_probes(name):
    x = _probe_rows()
    assert x.shape[0] >= 4
    for w in (None, np.linspace(0.01, 3, 256, dtype=np.float32)):
        assert np.array_equal(pack_gguf_blocks(quantize(x, name, imatrix=w)), ggml_quantize(x, name, w))


# ---------------------------------------------------------------------------------------------------------------
# values == gguf-py's dequantize; pack / unpack


@needs_ggml
@pytest.mark.parametrize("name", ALL)
def test_dequantize_equals_gguf_py(name):
    gq, gguf = _gguf()
    t = getattr(gguf.GGMLQuantizationType, name.upper())
    x = _inputs(5)
    for w in (None, _imatrices(512)["random"]):
        ref_bytes = ggml_quantize(x, name, w)
        want = gq.dequantize(ref_bytes, t)
        q = quantize(x, name, imatrix=w)
        got = dequantize(q)
        assert got.dtype == np.float32 and got.shape == x.shape
        assert np.array_equal(got.view(np.int32), want.view(np.int32))
        assert np.array_equal(fake_quantize(x, name, imatrix=w).view(np.int32), want.view(np.int32))
        assert np.array_equal(dequantize(unpack_gguf_blocks(ref_bytes, name)).view(np.int32), want.view(np.int32))


def _random_blocks(name, rows, nb, rng):
    """Random GGUF bytes whose fp16 super-scales are finite (no NaN payloads to compare)."""
    b = rng.integers(0, 256, (rows, nb, SIZE[name]), dtype=np.uint8)
    offs = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q4_0": (0,),
            "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,), "iq4_nl": (0,)}[name]
    for o in offs:
        b[..., o + 1] &= 0x7B  # exponent field never all ones
    return b.reshape(rows, nb * SIZE[name])


@pytest.mark.parametrize("name", ALL)
def test_unpack_pack_round_trip_random_bytes(name):
    rng = np.random.default_rng(7)
    data = _random_blocks(name, 5, 3, rng)
    q = unpack_gguf_blocks(data, name)
    assert q.codes.shape == (5, 3 * BLOCK[name])
    assert np.array_equal(pack_gguf_blocks(q), data)
    gq, gguf = _gguf()
    want = gq.dequantize(data, getattr(gguf.GGMLQuantizationType, name.upper()))
    got = dequantize(q)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("name", ALL)
def test_pack_unpack_round_trip_parts(name):
    x = _inputs(2).reshape(2, 7, 512)
    q = quantize(x, name)
    back = unpack_gguf_blocks(pack_gguf_blocks(q), name)
    assert back.codes.shape == x.shape and back.codes.dtype == q.codes.dtype
    assert np.array_equal(back.codes, q.codes)
    for f in ("d", "dmin", "scale_codes", "min_codes"):
        a, b = getattr(q.super_scales, f), getattr(back.super_scales, f)
        assert (a is None) == (b is None)
        if a is not None:
            assert np.array_equal(a, b), f
    assert np.array_equal(back.scales, q.scales)
    assert (q.offsets is None) == (name in ("q3_k", "q6_k", "q4_0", "q5_0", "q8_0", "iq4_nl"))


# ---------------------------------------------------------------------------------------------------------------
# the spec


def test_spec_and_table():
    s = make_spec("Q4_K")
    assert s == make_spec("q4_k") and s.gguf == "q4_k" and s.name == "q4_k"
    assert s.dtype.name == "uint4" and s.granularity == PerGroup(32, -1) and s.symmetric is False
    assert make_spec("q6_k").dtype.name == "int6" and make_spec("q6_k").symmetric is True
    assert make_spec("q3_k").granularity == PerGroup(16, -1)
    assert [make_spec(n).bits_per_element() for n in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")] == \
        [2.625, 3.4375, 4.5, 5.5, 6.5625]
    assert make_spec("q4_k").bits_per_element((3, 512)) == 4.5
    assert set(qcore.dtypes.GGUF_DTYPES) == set(ALL)
    assert [make_spec(n).bits_per_element() for n in LEGACY] == [4.5, 5.0, 5.5, 6.0, 8.5]
    assert make_spec("q5_0").dtype.name == "int5" and make_spec("q5_1").symmetric is False
    assert make_spec("q8_0").granularity == PerGroup(32, -1)
    assert make_spec("iq4_nl").dtype.name == "uint4" and make_spec("iq4_nl").symmetric is True
    assert make_spec("iq4_nl").bits_per_element() == 4.5
    assert "q4_k" not in qcore.DTYPES  # its own table (not an element or block format)


def test_spec_refuses_other_fields():
    with pytest.raises(ValueError, match="gguf='q4_k' fixes dtype"):
        make_spec("q4_k", dtype="uint8")
    with pytest.raises(ValueError, match="PerGroup\\(32\\)"):
        make_spec("q4_k", granularity=PerGroup(64))
    with pytest.raises(ValueError, match="one of q2_k"):
        make_spec("int4", gguf="q7_k")
    with pytest.raises(ValueError, match="make_spec\\('q4_k'\\)"):
        qcore.QuantSpec("q4_k")


@pytest.mark.parametrize("shape", [(4, 100), (300,), (2, 3, 320)])
def test_shape_not_multiple_of_256(shape):
    x = np.ones(shape, np.float32)
    with pytest.raises(ValueError, match=r"multiple of 256.*" + str(shape).replace("(", r"\(").replace(")", r"\)")):
        quantize(x, "q4_k")
    with pytest.raises(ValueError, match="multiple of 256"):
        fake_quantize(x, "q6_k")


def test_argument_errors():
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    with pytest.raises(ValueError, match="last axis"):
        quantize(x.T.copy().reshape(256, 2), "q4_k", axis=0)
    with pytest.raises(ValueError, match=r"imatrix must have shape \(256,\)"):
        quantize(x, "q4_k", imatrix=np.ones(128))
    with pytest.raises(ValueError, match="non-negative"):
        quantize(x, "q4_k", imatrix=-np.ones(256))
    with pytest.raises(ValueError, match="applies to GGUF specs"):
        quantize(x, "int4", imatrix=np.ones(256))
    with pytest.raises(ValueError, match="scale="):
        quantize(x, "q4_k", scale=np.ones((2, 8)))
    y = x.copy()
    y[1, 3] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(y, "q5_k")
    with pytest.raises(ValueError, match="fake_quantizer"):
        qcore.fake_quantizer("q4_k", shape=(2, 256), scale=np.ones((2, 8)))


def test_dequantize_checks_parts():
    x = _inputs(1)
    q = quantize(x, "q4_k")
    import dataclasses

    bad_scales = dataclasses.replace(q, scales=q.scales * 2)
    with pytest.raises(ValueError, match="QTensor.scales must equal"):
        dequantize(bad_scales)
    bad_codes = dataclasses.replace(q, codes=q.codes + np.uint8(16))
    with pytest.raises(ValueError, match=r"QTensor.codes must lie in \[0, 15\]"):
        dequantize(bad_codes)
    ss = dataclasses.replace(q.super_scales, d=q.super_scales.d + np.float32(1e-7))
    with pytest.raises(ValueError, match="float16 values"):
        dequantize(dataclasses.replace(q, super_scales=ss))
    with pytest.raises(ValueError, match="offsets"):
        dequantize(dataclasses.replace(q, offsets=None))
    with pytest.raises(ValueError, match="offsets / super_scales"):
        dequantize(dataclasses.replace(quantize(x, "int4"), offsets=np.zeros(1, np.float32)))


def test_value_formula_and_empty():
    x = _inputs(3)
    q = quantize(x, "q5_k")
    v = q.codes.astype(np.float32).reshape(x.shape[0], -1, 32) * q.scales[..., None] + q.offsets[..., None]
    assert np.array_equal(v.reshape(x.shape), dequantize(q))
    e = quantize(np.zeros((0, 512), np.float32), "q4_k")
    assert e.codes.shape == (0, 512) and dequantize(e).shape == (0, 512)


def test_torch_path():
    torch = pytest.importorskip("torch")
    x = _inputs(4)
    t = torch.from_numpy(x.copy()).requires_grad_(True)
    y = fake_quantize(t, "q4_k")
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    assert np.array_equal(y.detach().numpy(), fake_quantize(x, "q4_k"))
    y.sum().backward()
    assert torch.equal(t.grad, torch.ones_like(t))  # straight-through
    q = quantize(t, "q6_k", imatrix=torch.ones(512))
    assert isinstance(q.codes, torch.Tensor) and isinstance(q.super_scales.d, torch.Tensor)
    assert np.array_equal(dequantize(q).numpy(), dequantize(quantize(x, "q6_k", imatrix=np.ones(512))))
    assert np.array_equal(pack_gguf_blocks(q), pack_gguf_blocks(quantize(x, "q6_k", imatrix=np.ones(512))))


@pytest.mark.parametrize("name", LEGACY)
def test_legacy_equals_gguf_py_quantize(name):
    """gguf-py quantizes the 32-element types too: its bytes equal qcore's (and ggml's) on these inputs."""
    gq, gguf = _gguf()
    x = _inputs(6)
    x = np.concatenate([x, x[:, :96].copy()], axis=1)  # 608 columns: not a multiple of 256
    assert np.array_equal(pack_gguf_blocks(quantize(x, name)), gq.quantize(x, getattr(gguf.GGMLQuantizationType,
                                                                                       name.upper())))


@needs_ggml
@pytest.mark.parametrize("name", ["q4_0", "q5_0"])
def test_negative_zero_block_follows_ggml_not_gguf_py(name):
    """A block of -0: ggml keeps max = +0 (no |v| exceeds 0), d = +0 / -8 = -0 (fp16 0x8000); gguf-py takes the
    first element (-0), d = +0. qcore writes ggml's bytes."""
    gq, gguf = _gguf()
    x = np.full((1, 32), -0.0, np.float32)
    ours = pack_gguf_blocks(quantize(x, name))
    assert np.array_equal(ours, ggml_quantize(x, name))
    assert ours[0, 1] == 0x80
    assert gq.quantize(x, getattr(gguf.GGMLQuantizationType, name.upper()))[0, 1] == 0x00


def test_legacy_value_formula():
    x = _inputs(8)
    q = quantize(x, "q5_1")
    assert np.array_equal(q.offsets, q.super_scales.dmin) and np.array_equal(q.scales, q.super_scales.d)
    v = q.codes.astype(np.float32).reshape(x.shape[0], -1, 32) * q.scales[..., None] + q.offsets[..., None]
    assert np.array_equal(v.reshape(x.shape), dequantize(q))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.ones((2, 48), np.float32), "q8_0")


def test_oracle_kit():
    """qcore.testing compares a kernel's k-quant output (values, or QTensor parts incl. float offsets)."""
    import dataclasses

    from qcore.testing import Op, assert_matches_oracle

    x = _inputs(9)
    w = _imatrices(512)["random"]
    q = quantize(x, "q4_k", imatrix=w)
    assert_matches_oracle(q, x, "q4_k", op=Op.QUANTIZE, imatrix=w)
    assert_matches_oracle(dequantize(q), q, "q4_k", op=Op.DEQUANTIZE)
    assert_matches_oracle(fake_quantize(x, "q5_1"), x, "q5_1", op=Op.FAKE_QUANTIZE)
    with pytest.raises(AssertionError, match="offsets"):
        assert_matches_oracle(dataclasses.replace(q, offsets=q.offsets * 2), x, "q4_k", op=Op.QUANTIZE, imatrix=w)



def test_iq4_nl_values_are_grid_levels():
    x = _inputs(10)
    q = quantize(x, "iq4_nl")
    levels = np.array(qcore.dtypes.GGUF_DTYPES["iq4_nl"].levels, np.float32)
    v = levels[q.codes.astype(np.int64)].reshape(x.shape[0], -1, 32) * q.scales[..., None]
    assert np.array_equal(v.reshape(x.shape), dequantize(q))


def test_other_entry_points_refuse_gguf_names():
    x = np.ones((2, 256), np.float32)
    for f in (lambda: qcore.cast(x, "q4_k"), lambda: qcore.encode(x, "q6_k"),
              lambda: qcore.decode(np.zeros(3, np.uint8), "q8_0")):
        with pytest.raises(ValueError, match="block format"):
            f()
    with pytest.raises(ValueError, match="GGUF block type"):
        qcore.packing.pack(np.zeros(4, np.uint8), "q4_k")
    with pytest.raises(ValueError, match="GGUF specs"):
        qcore.stats.mse_clip(x, "q4_k")


@pytest.mark.parametrize("name", KQ)
def test_requantize_with_given_scales_is_llama_cpp_element_step(name):
    """GPTQ's building block: codes under fixed stored scales. For k-quants llama.cpp's final codes ARE this
    requantization, wherever the sub-block scale is not 0."""
    from qcore._kquants import requantize

    x = _inputs(11)
    for w in (None, _imatrices(512)["random"]):
        q = quantize(x, name, imatrix=w)
        c = requantize(x, q.super_scales, name)
        live = np.repeat(q.scales, q.spec.granularity.size, axis=-1) != 0
        assert np.array_equal(c[live], q.codes[live])
        assert c.dtype == q.codes.dtype


@pytest.mark.parametrize("name", ALL)
def test_element_codes_column_by_column(name):
    """GPTQ's column step: element_codes on one column with that column's sub-block scale/offset per row equals
    requantizing the whole row."""
    from qcore._kquants import element_codes, requantize

    x = _inputs(12)
    q = quantize(x, name)
    whole = requantize(x, q.super_scales, name)
    sub = q.spec.granularity.size
    for j in (0, 17, 300, 511):
        s = q.scales[:, j // sub]
        o = None if q.offsets is None else q.offsets[:, j // sub]
        assert np.array_equal(element_codes(x[:, j], s, o, name), whole[:, j])


@needs_ggml
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("magnitude", [1e13, 1e30])
def test_overflowing_magnitudes_follow_ggml(magnitude):
    """Where llama.cpp's float32 search overflows (x^3 terms, Inf/NaN block scales), qcore still writes its bytes:
    C's comparisons skip NaNs (the first-absmax scans), which np.argmax would not. iq4_nl is exact up to ~1e13
    only (NaN scales whose sign differs)."""
    rng = np.random.default_rng(13)
    x = (rng.standard_normal((4, 512)) * magnitude).astype(np.float32)
    for name in ALL:
        if name == "iq4_nl" and magnitude > 1e13:
            continue
        for w in (None, np.ones(512, np.float32)):
            assert np.array_equal(pack_gguf_blocks(quantize(x, name, imatrix=w)), ggml_quantize(x, name, w)), name


@pytest.mark.parametrize("name", ALL)
def test_round_trip_keeps_nan_and_inf_scales(name):
    """Import as codes and export back is byte-identical even for fp16 scales that are Inf or NaN (quiet or
    signaling payloads)."""
    rng = np.random.default_rng(14)
    data = _random_blocks(name, 4, 1, rng)
    off = {"q2_k": 80, "q3_k": 108, "q6_k": 208}.get(name, 0)
    for row, pattern in enumerate(([0x01, 0x7C], [0x00, 0x7E], [0x55, 0xFD], [0x00, 0xFC])):
        data[row, off:off + 2] = pattern
    assert np.array_equal(pack_gguf_blocks(unpack_gguf_blocks(data, name)), data)


def test_nearest_int_is_round_half_even():
    """llama.cpp's nearest_int (add 1.5 * 2**23, read the mantissa) rounds ties to EVEN, not away from zero."""
    from qcore._kquants import nearest_int

    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.4999998, 4194303.0, -4194303.0], np.float32)
    assert nearest_int(v).tolist() == [0, 2, 2, 0, -2, -2, 3, 4194303, -4194303]


@needs_ggml
def test_large_tensors_run_in_pieces_of_rows(monkeypatch):
    """Rows are independent: quantize_kquant splits a large tensor into pieces of whole rows (bounded memory);
    the bytes are the same."""
    import qcore._kquants as K

    x = _inputs(15).reshape(2, 7, 512)
    w = _imatrices(512)["sq"]
    monkeypatch.setattr(K, "_CHUNK", 1024)  # two rows per piece
    for name in ("q4_k", "q6_k", "q4_1", "iq4_nl"):
        q = quantize(x, name, imatrix=w)
        assert q.super_scales.d.shape[:2] == (2, 7)
        assert np.array_equal(pack_gguf_blocks(q).reshape(14, -1), ggml_quantize(x.reshape(14, 512), name, w))


@pytest.mark.parametrize("name", ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_0", "q4_1", "q5_1", "iq4_nl"])
def test_imatrix_lowers_the_weighted_error(name):
    """The point of the importance matrix: with it, the error weighted by it is smaller (llama.cpp's search
    minimizes it); columns with little weight pay."""
    rng = np.random.default_rng(16)
    x = rng.standard_normal((64, 512)).astype(np.float32)
    w = np.where(rng.random(512) < 0.1, 50.0, 0.1).astype(np.float32)  # a few columns matter

    def werr(y):
        return float(((y - x) ** 2 * w).sum())

    plain = werr(fake_quantize(x, name))
    weighted = werr(fake_quantize(x, name, imatrix=w))
    assert weighted < 0.9 * plain, (name, weighted, plain)

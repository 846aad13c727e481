"""formats/gguf.py: block codecs checked byte for byte against gguf-py 0.19 (ggml's reference quantizers and
dequantizers), and qcore grids that map exactly."""

import numpy as np
import pytest

import qcore
from qcore import PerChannel, PerGroup, PerTensor
from qcore.formats import gguf as G
from qcore.formats.quark_layout import WeightParts
from qcore.formats.safetensors_io import CorruptCheckpointError

gq = pytest.importorskip("gguf.quants")
gg = pytest.importorskip("gguf")

KINDS = ["Q4_0", "Q4_1", "Q8_0", "MXFP4"]


def _x(seed, shape=(8, 128)):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(0.05)
    x[0, :32] = 0.0  # a zero block
    x[1, 5] = 3.0  # an outlier
    return x


def _ggtype(kind):
    return getattr(gg.GGMLQuantizationType, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_float_is_ggml_reference_byte_for_byte(kind):
    x = _x(0)
    ref = gq.quantize(x, _ggtype(kind))
    got = G.quantize_float(x, kind)
    assert got.dtype == np.uint8 and got.shape == ref.shape
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_ggml_bit_for_bit(kind):
    x = _x(1)
    blocks = gq.quantize(x, _ggtype(kind))
    ref = gq.dequantize(blocks, _ggtype(kind))
    got = G.dequantize(blocks, kind, x.shape)
    assert np.array_equal(got.view(np.uint32), ref.astype(np.float32).view(np.uint32))


def _spec(kind, **kw):
    return {"Q4_0": lambda: qcore.make_spec("int4", granularity=PerGroup(32, axis=-1), scale_dtype="float16", **kw),
            "Q4_1": lambda: qcore.make_spec("uint4", granularity=PerGroup(32, axis=-1), scale_dtype="float16",
                                            **{"symmetric": True, **kw}),
            "Q8_0": lambda: qcore.make_spec("int8", granularity=PerGroup(32, axis=-1), scale_dtype="float16", **kw),
            "MXFP4": lambda: qcore.make_spec("mxfp4", axis=-1, **kw)}[kind]()


def _parts(q):
    return WeightParts(codes=np.asarray(q.codes), scales=np.asarray(q.scales),
                       zero_points=None if q.zero_points is None else np.asarray(q.zero_points))


@pytest.mark.parametrize("kind", KINDS)
def test_qcore_grid_exact_and_decode_roundtrip(kind):
    x = _x(2)
    spec = _spec(kind)
    assert G.gguf_type(spec, x.shape) == kind
    q = qcore.quantize(x, spec)
    ref = np.asarray(qcore.dequantize(q))
    data = G.encode(_parts(q), spec, kind=kind)
    assert data.shape == (8, 128 // 32 * G.TYPE_BYTES[kind])
    exact, diff = G.is_exact(data, kind, ref)
    assert exact and diff == 0.0
    # gguf-py's dequantizer reads the same values
    assert np.array_equal(gq.dequantize(data, _ggtype(kind)), ref)
    back = G.decode(data, kind, spec, x.shape)
    assert np.array_equal(back.codes, np.asarray(q.codes))
    assert np.array_equal(back.scales, np.asarray(q.scales))
    if q.zero_points is not None:
        assert np.array_equal(back.zero_points, np.asarray(q.zero_points))
    # decode -> encode gives the same bytes (no float round trip)
    assert np.array_equal(G.encode(back, spec, kind=kind), data)


@pytest.mark.parametrize("kind", KINDS)
def test_ggml_blocks_decode_encode_byte_identical(kind):
    """Blocks from ggml's own quantizer survive decode -> encode unchanged (where qcore can hold them)."""
    x = _x(3)
    if kind == "Q4_1":  # ggml's m = min is generally not -d * integer: qcore's zero points refuse it
        x = np.abs(x)
        data = gq.quantize(x, _ggtype(kind))
        with pytest.raises(CorruptCheckpointError, match="Q4_1 offsets"):
            G.decode(data, kind, _spec(kind), x.shape, where="blk.0.ffn_up.weight")
        return
    if kind == "Q4_0":  # ggml's d = x[argmax |x|] / -8 is negative for a positive extreme: qcore refuses that
        data = gq.quantize(np.abs(x) + np.float32(0.01), _ggtype(kind))
        with pytest.raises(CorruptCheckpointError, match="not finite and positive"):
            G.decode(data, kind, _spec(kind), x.shape)
        x = -np.abs(x)
    if kind != "MXFP4":
        x[0, :32] = -0.01  # ggml writes d = 0 for an all-zero block; qcore scales are positive
    data = gq.quantize(x, _ggtype(kind))
    spec = _spec(kind)
    back = G.decode(data, kind, spec, x.shape)
    assert np.array_equal(G.encode(back, spec, kind=kind), data)
    assert np.array_equal(np.asarray(qcore.dequantize(qcore.quantize(
        np.asarray(gq.dequantize(data, _ggtype(kind)), np.float32), spec, scale=back.scales))),
        gq.dequantize(data, _ggtype(kind)))


@pytest.mark.parametrize("dtype", ["uint4", "int4"])
def test_asymmetric_q4_1_exact_iff_offset_is_float16(dtype):
    """Q4_1's m = -scale * zero_point must itself be a float16: with float16 scales it is when the product needs
    at most 11 significant bits; otherwise the export is off by at most half a float16 ulp of m."""
    x = _x(4)
    spec = qcore.make_spec(dtype, granularity=PerGroup(64, axis=-1), symmetric=False, scale_dtype="float16")
    assert G.gguf_type(spec, x.shape) == "Q4_1"
    q = qcore.quantize(x, spec)
    ref = np.asarray(qcore.dequantize(q))
    data = G.encode(_parts(q), spec, kind="Q4_1")
    off = 8 if dtype == "int4" else 0
    m = np.asarray(q.scales, np.float64) * (np.asarray(q.zero_points, np.float64) + off)
    m16_exact = bool(np.all(m.astype(np.float16).astype(np.float64) == m))
    exact, diff = G.is_exact(data, "Q4_1", ref)
    assert exact == m16_exact
    assert diff <= float(np.max(np.abs(m))) * 2.0 ** -11
    # scales chosen so that every m is a float16: exact, and decode gives back qcore's codes and zero points
    sc = np.full(np.asarray(q.scales).shape, 2.0 ** -6, np.float32)
    q2 = qcore.quantize(x, spec, scale=sc, zero_point=np.asarray(q.zero_points))
    d2 = G.encode(_parts(q2), spec, kind="Q4_1")
    assert G.is_exact(d2, "Q4_1", np.asarray(qcore.dequantize(q2)))[0]


@pytest.mark.parametrize("gran", [PerTensor(), PerChannel(0), PerGroup(128, axis=-1)])
def test_coarser_granularities_repeat_scales_per_block(gran):
    x = _x(5)
    spec = qcore.make_spec("int8", granularity=gran, scale_dtype="float16")
    q = qcore.quantize(x, spec)
    data = G.encode(_parts(q), spec, kind="Q8_0")
    assert G.is_exact(data, "Q8_0", np.asarray(qcore.dequantize(q)))[0]


def test_float32_scales_are_rounded_and_reported_inexact():
    x = _x(6)
    spec = qcore.make_spec("int4", granularity=PerGroup(32, axis=-1))  # float32 scales
    q = qcore.quantize(x, spec)
    ref = np.asarray(qcore.dequantize(q))
    exact, diff = G.is_exact(G.encode(_parts(q), spec, kind="Q4_0"), "Q4_0", ref)
    assert not exact and 0 < diff < 1e-3


@pytest.mark.parametrize("spec,shape", [
    (qcore.make_spec("int4", granularity=PerGroup(16, axis=-1)), (4, 64)),  # groups smaller than a block
    (qcore.make_spec("int4", granularity=PerGroup(32, axis=-1)), (4, 48)),  # row not a multiple of 32
    (qcore.make_spec("int4", granularity=PerChannel(1)), (4, 64)),  # scales vary along the block
    (qcore.make_spec("uint8", granularity=PerGroup(32, axis=-1)), (4, 64)),  # Q8_0 has no offset
    (qcore.make_spec("float8_e4m3fn"), (4, 64)),
    (qcore.make_spec("mxfp6_e2m3", axis=-1), (4, 64)),
    (qcore.make_spec("mx4", axis=-1), (4, 64)),
])
def test_grids_gguf_cannot_hold(spec, shape):
    assert G.gguf_type(spec, shape) is None


def test_encode_refuses_wrong_kind():
    spec = _spec("Q4_0")
    q = qcore.quantize(_x(7), spec)
    with pytest.raises(ValueError, match="not a Q8_0 grid"):
        G.encode(_parts(q), spec, kind="Q8_0")


def test_decode_validates():
    spec = _spec("MXFP4")
    x = _x(8, (2, 64))
    data = G.encode(_parts(qcore.quantize(x, spec)), spec, kind="MXFP4")
    bad = data.copy()
    bad[1, 0] = 255
    with pytest.raises(CorruptCheckpointError, match="blk.1.attn_q.weight: an MXFP4 block holds the E8M0 NaN"):
        G.decode(bad, "MXFP4", spec, x.shape, where="blk.1.attn_q.weight")
    with pytest.raises(CorruptCheckpointError, match="tok: MXFP4 data of 33"):
        G.decode(data.reshape(-1)[:33], "MXFP4", spec, x.shape, where="tok")
    q8 = _spec("Q8_0")
    d8 = G.encode(_parts(qcore.quantize(x, q8)), q8, kind="Q8_0")
    d8[0, :2] = np.array([np.float16(np.inf)]).view(np.uint8)
    with pytest.raises(CorruptCheckpointError, match="not finite and positive"):
        G.decode(d8, "Q8_0", q8, x.shape)


def test_permute_matches_llama_cpp_convert_and_inverts():
    w = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
    n_head = 3

    def hf_permute(weights, n_head):  # convert_hf_to_gguf.py LlamaModel.permute
        return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
                .swapaxes(1, 2).reshape(weights.shape))
    assert np.array_equal(G.permute_qk(w, n_head), hf_permute(w, n_head))
    assert np.array_equal(G.unpermute_qk(G.permute_qk(w, n_head), n_head), w)
    with pytest.raises(ValueError, match="rows do not split"):
        G.permute_qk(w[:10], 3)


def test_names():
    assert G.hf_to_gguf_name("model.layers.12.self_attn.k_proj.weight") == "blk.12.attn_k.weight"
    assert G.hf_to_gguf_name("model.embed_tokens.weight") == "token_embd.weight"
    assert G.hf_to_gguf_name("model.rotary_emb.inv_freq") is None
    for n in ["blk.0.ffn_down.weight", "output.weight", "output_norm.weight", "blk.3.attn_norm.weight"]:
        assert G.hf_to_gguf_name(G.gguf_to_hf_name(n)) == n

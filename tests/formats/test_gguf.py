"""src/qcore/formats/gguf.py: block codecs checked byte for byte against gguf-py 0.19 (ggml's reference quantizers and
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


# ---------------------------------------------------------------------------------------------------------------
# import_blocks: the qcore grid of whatever wrote the blocks
# ---------------------------------------------------------------------------------------------------------------


def _dq(spec, parts):
    return np.asarray(qcore.dequantize(qcore.QTensor(parts.codes, parts.scales, parts.zero_points, spec)))


@pytest.mark.parametrize("kind", KINDS)
def test_import_blocks_of_ggml_quantizer_exact_or_no_grid(kind):
    x = _x(9)  # a zero block, an outlier, blocks with a positive extreme (Q4_0: negative d)
    data = gq.quantize(x, _ggtype(kind))
    ref = gq.dequantize(data, _ggtype(kind))
    spec, parts, why = G.import_blocks(data, kind, x.shape, where="blk.0.ffn_up.weight")
    if kind == "Q4_1":  # ggml's m = min: no integer zero point
        assert spec is None and parts is None and "integer zero point" in why
        return
    assert why == "" and spec == G.import_spec(kind, signed=kind != "Q4_0")
    assert spec.granularity == PerGroup(32, 1)
    assert np.array_equal(_dq(spec, parts), ref)  # -0 == +0 (ggml's d = 0 block times a negative code)
    if kind == "Q4_0":
        d = data.reshape(-1, 18)[:, :2].copy().view(np.float16).ravel()
        assert (d < 0).any() and (d > 0).any() and (d == 0).any()
        assert set(np.unique(parts.zero_points)) == {7.0, 8.0}
        # back to Q4_0 byte for byte, except the zero block (scale 1 instead of d = 0)
        assert G.q4_0_holds(parts, spec, x.shape)
        back = G.encode(parts, spec, kind="Q4_0")
        nz = np.ones(back.shape[0] * 4, bool)
        nz[0] = False
        assert np.array_equal(back.reshape(-1, 18)[nz], data.reshape(-1, 18)[nz])


def test_import_blocks_q4_0_all_positive_d_is_int4_symmetric():
    x = -np.abs(_x(10)) - np.float32(0.01)  # negative extremes: d > 0 everywhere
    data = gq.quantize(x, _ggtype("Q4_0"))
    spec, parts, _ = G.import_blocks(data, "Q4_0", x.shape)
    assert spec == G.import_spec("Q4_0") and spec.dtype.name == "int4" and parts.zero_points is None
    assert np.array_equal(_dq(spec, parts), gq.dequantize(data, _ggtype("Q4_0")))
    assert np.array_equal(G.encode(parts, spec, kind="Q4_0"), data)


def _q4_1_blocks(d, m, q):
    """Q4_1 blocks from per-block d, m (float16) and codes [n, 32]."""
    q = np.asarray(q, np.uint8)
    return np.concatenate([np.asarray(d, np.float16).reshape(-1, 1).view(np.uint8),
                           np.asarray(m, np.float16).reshape(-1, 1).view(np.uint8),
                           q[:, :16] | (q[:, 16:] << 4)], axis=1)


def test_import_blocks_q4_1_integer_offsets_any_sign_and_zero_d():
    rng = np.random.default_rng(11)
    q = rng.integers(0, 16, (5, 32))
    d = np.array([0.25, -0.125, 0.0, 0.0, 0.0], np.float16)
    m = np.array([-0.25 * 3, 0.125 * 12, 0.5, -0.75, 0.0], np.float16)  # k = 3, 12; d = 0: m, m, 0
    data = _q4_1_blocks(d, m, q)
    spec, parts, why = G.import_blocks(data, "Q4_1", (1, 160))
    assert why == "" and spec.dtype.name == "uint4" and not spec.symmetric
    assert np.array_equal(_dq(spec, parts), G.dequantize(data, "Q4_1", (1, 160)))
    assert parts.zero_points.ravel().tolist() == [3, 15 - 12, 0, 1, 0]
    # all zero points 0 (what qcore writes for symmetric uint4): symmetric
    sym = _q4_1_blocks([0.5, 0.25], [0.0, -0.0], q[:2])
    spec, parts, _ = G.import_blocks(sym, "Q4_1", (1, 64))
    assert spec.symmetric and parts.zero_points is None
    ours = _q4_1_blocks([0.5, 0.25], [-0.0, -0.0], q[:2])  # qcore writes m = -(d * 0) = -0
    assert np.array_equal(G.encode(parts, spec, kind="Q4_1"), ours.reshape(1, -1))
    # a k outside [0, 15] or not an integer: no grid
    for mm in (-0.25 * 16, -0.25 * 2.5):
        s, p, why = G.import_blocks(_q4_1_blocks([0.25], [mm], q[:1]), "Q4_1", (1, 32))
        assert s is None and "integer zero point k in [0, 15]" in why


def test_import_blocks_q8_0_negative_d():
    q = np.random.default_rng(12).integers(-127, 128, (2, 32)).astype(np.int8)
    d = np.array([-0.5, 0.25], np.float16)
    data = np.concatenate([d.reshape(-1, 1).view(np.uint8), q.view(np.uint8)], axis=1)
    spec, parts, _ = G.import_blocks(data, "Q8_0", (1, 64))
    assert np.array_equal(_dq(spec, parts), G.dequantize(data, "Q8_0", (1, 64)))
    q[0, 3] = -128  # |d| * 128 is not an int8 code
    data = np.concatenate([d.reshape(-1, 1).view(np.uint8), q.view(np.uint8)], axis=1)
    spec, parts, why = G.import_blocks(data, "Q8_0", (1, 64))
    assert spec is None and "-128" in why


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_import_blocks_refuses_nan_scales(kind):
    data = gq.quantize(_x(13, (2, 64)), _ggtype(kind)).copy()
    data[1, :2] = np.array([np.nan], np.float16).view(np.uint8)
    with pytest.raises(CorruptCheckpointError, match=f"blk.3.attn_v.weight: {kind} block scales d that are NaN"):
        G.import_blocks(data, kind, (2, 64), where="blk.3.attn_v.weight")


def test_q4_0_holds_only_zero_points_7_and_8():
    spec = qcore.make_spec("uint4", granularity=PerGroup(32, axis=-1), scale_dtype="float16", symmetric=False)
    x = _x(14)
    q = qcore.quantize(x, spec)
    assert not G.q4_0_holds(_parts(q), spec, x.shape)  # zero points from min/max: many values
    zp = np.where(np.arange(np.asarray(q.scales).size).reshape(np.asarray(q.scales).shape) % 2, 7, 8)
    q2 = qcore.quantize(x, spec, scale=np.asarray(q.scales), zero_point=zp.astype(np.float32))
    assert G.q4_0_holds(_parts(q2), spec, x.shape)
    data = G.encode(_parts(q2), spec, kind="Q4_0")
    assert G.is_exact(data, "Q4_0", np.asarray(qcore.dequantize(q2)))[0]
    with pytest.raises(ValueError, match="not a Q4_0 grid"):
        G.encode(_parts(q), spec, kind="Q4_0")


def test_architectures_are_gguf_pys():
    """Every architecture, tensor name and metadata key qcore writes is one gguf-py (llama.cpp's constants) defines
    for that architecture."""
    pytest.importorskip("gguf")
    from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES, Keys
    by_name = {v: k for k, v in MODEL_ARCH_NAMES.items()}
    keys = {v for cls in (Keys.LLM, Keys.Attention, Keys.Rope) for k, v in vars(cls).items()
            if isinstance(v, str) and v.startswith("{arch}.")}
    for name, a in G.ARCHS.items():
        assert a.name == name and name in by_name
        known = {TENSOR_NAMES[t].replace("blk.{bid}.", "") for t in MODEL_TENSORS[by_name[name]]}
        assert set(a.layer) | set(G.TOP_TENSORS[:2]) <= known, name
        assert ("output" in known) == a.output, name
        assert set(a.biases) <= set(a.layer) and set(a.layer) <= set(G.LAYER_TENSORS)
        if a.norm == "layernorm":  # GPT-2 / GPT-NeoX configs: tests/adapters/io/test_gguf_gpt2_neox.py
            continue
        cfg = dict(num_attention_heads=4, hidden_size=64, head_dim=32, max_position_embeddings=64,
                   num_hidden_layers=2, intermediate_size=128, rms_norm_eps=1e-6, vocab_size=128,
                   hidden_act=a.acts[0], rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                   sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   layer_types=["sliding_attention" if i % max(a.swa_pattern, 1) < a.swa_pattern - 1 else
                                "full_attention" for i in range(2)])
        meta = G.metadata(name, cfg)
        assert {k.replace(name, "{arch}", 1) for k in meta} <= keys
        back = G.config_from_metadata(name, {k: v for k, (v, _) in meta.items()})
        rope = back["rope_parameters"]
        assert back["head_dim"] == 32 and rope.get("full_attention", rope) == cfg["rope_parameters"]
        if a.swa_rope_theta is not None:  # Gemma3: the sliding layers' own rope
            assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": a.swa_rope_theta}
        assert {k: back[k] for k in ("hidden_size", "num_hidden_layers", "num_key_value_heads")} == dict(
            hidden_size=64, num_hidden_layers=2, num_key_value_heads=4)

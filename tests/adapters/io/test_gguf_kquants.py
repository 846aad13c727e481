"""GGUF block types as adapter weight specs (issue 25): Linear / Embedding modules with ``make_spec("q4_k")``
and the other ``qcore.GGUF_DTYPES`` fake-quantize by the core, freeze to ggml's block bytes and dequantize exactly;
``export_gguf`` writes them as their ggml type byte for byte; ``from_gguf`` imports k-quant, Q5_0/Q5_1, IQ4_NL
and float-offset Q4_1 tensors as codes and re-export gives the same file. llama.cpp (marker ``gguf_client``)
loads the exports, and its own Q4_K_M quantizer's output imports as codes and exports to the same tensors.

Tiny Llama with 256-wide rows (k-quant super-blocks are 256 elements)."""

import ctypes

import numpy as np
import pytest
import torch
from torch import nn

import qcore
from qcore.formats import gguf as G

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from qcore.adapters import freeze, quantize_model  # noqa: E402
from qcore.adapters.config import LayerConfig, ModelConfig, TensorConfig  # noqa: E402
from qcore.adapters.io.gguf import export_gguf, from_gguf  # noqa: E402
from qcore.adapters.modules import wrap  # noqa: E402
from gguf_kit import llama_logits, tiny_tokenizer, token_ids  # noqa: E402

ALL = list(qcore.GGUF_DTYPES)


def tiny_llama256(seed=0, layers=1):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


def _config(name, embedding=True):
    layer = LayerConfig(weight=qcore.make_spec(name))
    return ModelConfig(layer, by_type={"Embedding": layer} if embedding else {})


def _quantized(name, seed=0, layers=1, embedding=True):
    m = tiny_llama256(seed, layers)
    quantize_model(m, _config(name, embedding), [torch.randint(0, 128, (1, 8))], progress=False)
    return m


def _ids(n=12):
    return token_ids(n)


def _tensors(path):
    return {t.name: (t.tensor_type.name, bytes(np.asarray(t.data))) for t in gguf.GGUFReader(path).tensors}


# ---------------------------------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_linear_fake_quantizes_by_the_core_and_freezes_exactly(name):
    torch.manual_seed(0)
    lin = nn.Linear(256, 6)
    w = lin.weight.detach().clone()
    m = wrap(lin, LayerConfig(weight=qcore.make_spec(name)), name="l")
    x = torch.randn(3, 256)
    y = m(x)
    q = qcore.quantize(w.numpy(), qcore.make_spec(name))
    assert torch.equal(m.effective("weight"), torch.from_numpy(np.asarray(qcore.dequantize(q))))
    m.freeze()
    t = qcore.GGUF_DTYPES[name]
    assert sorted(m._buffers) == ["weight_packed"] and m.weight_packed.dtype == torch.uint8
    assert tuple(m.weight_packed.shape) == (6, 256 // t.block_size * t.type_size)
    # the stored bytes are llama.cpp's blocks of the float weight (what ggml's quantizer writes)
    assert bytes(m.gguf_blocks()) == bytes(qcore.packing.pack_gguf_blocks(q))
    assert torch.equal(m(x), y)


def test_embedding_q6_k_freezes_and_tied_modules_share_the_scales():
    torch.manual_seed(0)
    emb = nn.Embedding(16, 256)
    m = wrap(emb, LayerConfig(weight="q6_k"), name="e")
    ids = torch.tensor([[1, 5, 7, 15]])
    y = m(ids)
    m.freeze()
    assert torch.equal(m(ids), y) and m.gguf_blocks().shape == (16, 210)


def test_load_frozen_gguf_checks_before_any_change():
    m = wrap(nn.Linear(256, 2), LayerConfig(weight="q4_k"), name="l")
    good = qcore.packing.pack_gguf_blocks(qcore.quantize(np.random.default_rng(0).normal(size=(2, 256))
                                                         .astype(np.float32), "q4_k"))
    with pytest.raises(ValueError, match="expected 288 uint8"):
        m.load_frozen_gguf(good[:, :100], shape=(2, 256), dtype=torch.float32)
    with pytest.raises(ValueError, match="multiple of 256"):
        m.load_frozen_gguf(good, shape=(4, 128), dtype=torch.float32)
    assert not m.frozen and "weight" in m._parameters
    m.load_frozen_gguf(good, shape=(2, 256), dtype=torch.float32)
    assert m.frozen and bytes(m.gguf_blocks()) == bytes(good)
    lin = wrap(nn.Linear(256, 2), LayerConfig(weight="int4"), name="i")
    with pytest.raises(ValueError, match="not a GGUF type"):
        lin.load_frozen_gguf(good, shape=(2, 256), dtype=torch.float32)


def test_config_round_trip_and_refusals():
    c = _config("q4_k")
    assert ModelConfig.from_dict(c.to_dict()) == c
    for role in ("input", "output", "bias"):
        with pytest.raises(ValueError, match="GGUF type 'q4_k' is a weight format"):
            LayerConfig(**{role: "q4_k"})
    with pytest.raises(ValueError, match="llama.cpp's own scale search"):
        TensorConfig("q4_k", observer=__import__("qcore.adapters.config", fromlist=["MSE"]).MSE())


def test_other_exporters_refuse_gguf_weights(tmp_path):
    from qcore.adapters.io.common import weight_parts
    m = wrap(nn.Linear(256, 2), LayerConfig(weight="q5_k"), name="l")
    with pytest.raises(ValueError, match="only GGUF files hold"):
        weight_parts(m)


# ---------------------------------------------------------------------------------------------------------------
# GGUF files
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q2_k", "q5_0", "q4_1", "iq4_nl"])
def test_export_import_as_codes_same_file(tmp_path, name):
    m = _quantized(name)
    kind = G.GGUF_KIND_OF[name]
    a = export_gguf(m, tmp_path / "a.gguf")
    assert a.lossless and {r.gguf_type for r in a.quantized} == {kind} and len(a.quantized) == 8
    assert a.types["token_embd.weight"] == kind and a.types["output.weight"] == "F32"
    ts = _tensors(tmp_path / "a.gguf")
    # the q rows in llama.cpp's order, block bytes as pack_gguf_blocks writes them
    q_proj = m.model.layers[0].self_attn.q_proj
    assert ts["blk.0.attn_q.weight"] == (kind, bytes(G.permute_qk(q_proj.gguf_blocks(), 4)))
    back = from_gguf(tmp_path / "a.gguf")
    codes = [r for r in back.qcore_gguf_report.tensors if r.how == "codes"]
    assert len(codes) == 8 and {r.spec.gguf for r in codes} == {name}  # Q4_1 with m = min(x): float offsets
    assert back.model.layers[0].mlp.down_proj.frozen
    with torch.no_grad():
        assert torch.equal(back(_ids()).logits, m(_ids()).logits)
    export_gguf(back, tmp_path / "b.gguf")
    assert (tmp_path / "b.gguf").read_bytes() == (tmp_path / "a.gguf").read_bytes()


def test_frozen_and_fake_quantized_write_the_same_file(tmp_path):
    m = _quantized("q3_k")
    export_gguf(m, tmp_path / "a.gguf")
    freeze(m)
    export_gguf(m, tmp_path / "b.gguf")
    assert (tmp_path / "b.gguf").read_bytes() == (tmp_path / "a.gguf").read_bytes()


def test_convert_gguf_to_gguf_same_bytes(tmp_path):
    from qcore.adapters.jobs.convert import convert
    m = _quantized("q5_k")
    export_gguf(m, tmp_path / "a.gguf", tokenizer=_tokenizer())
    convert(tmp_path / "a.gguf", tmp_path / "b.gguf", to="gguf")
    assert (tmp_path / "b.gguf").read_bytes() == (tmp_path / "a.gguf").read_bytes()


def test_k_quant_import_is_refused_by_strict_only_for_misfits(tmp_path):
    """strict=True accepts k-quant tensors now (they are codes); a tied embedding stays the float exception."""
    m = _quantized("q4_k")
    export_gguf(m, tmp_path / "a.gguf")
    back = from_gguf(tmp_path / "a.gguf", strict=True)
    assert back.qcore_gguf_report.exact and not back.qcore_gguf_report.dequantized


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp
# ---------------------------------------------------------------------------------------------------------------

def _llama_logits(path, ids):
    return llama_logits(path, ids)


def _tokenizer():
    return tiny_tokenizer()


@pytest.mark.gguf_client
@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q2_k", "q3_k", "q5_k", "q5_1", "iq4_nl"])
def test_llama_cpp_loads_k_quant_exports(tmp_path, name):
    """llama.cpp's logits of qcore's export against the in-memory model (llama.cpp quantizes activations to 8
    bits inside its k-quant dot products: a small difference, as for Q4_0)."""
    pytest.importorskip("llama_cpp")
    m = _quantized(name, layers=2)
    export_gguf(m, tmp_path / "m.gguf", tokenizer=_tokenizer())
    ids = _ids()
    with torch.no_grad():
        ref = m(ids).logits[0].numpy()
    got = _llama_logits(tmp_path / "m.gguf", ids)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 0.03 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


@pytest.mark.gguf_client
def test_llama_cpp_q4_k_m_imports_as_codes_and_exports_the_same_tensors(tmp_path):
    """llama.cpp's own quantizer (llama_model_quantize, Q4_K_M) on an F32 GGUF of a tiny Llama: every tensor it
    writes in a k-quant imports as codes (Q4_K, and Q6_K where Q4_K_M gives more bits), the model's logits in
    qcore equal llama.cpp's dequantization, and qcore's export has the same tensors byte for byte. qcore's own
    q4_k of the same float weights is llama.cpp's Q4_K bytes."""
    llama_cpp = pytest.importorskip("llama_cpp")
    m = tiny_llama256(layers=2)
    # an fp8 weight grid writes F32/F16 floats (no GGUF type holds it): the float file llama.cpp quantizes
    quantize_model(m, ModelConfig(LayerConfig(weight="fp8_e4m3")), [torch.randint(0, 128, (1, 8))],
                   progress=False)
    export_gguf(m, tmp_path / "f.gguf", tokenizer=_tokenizer())
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    p.nthread = 1
    assert llama_cpp.llama_model_quantize(str(tmp_path / "f.gguf").encode(), str(tmp_path / "q.gguf").encode(),
                                          ctypes.byref(p)) == 0
    src = _tensors(tmp_path / "q.gguf")
    kinds = {k: v[0] for k, v in src.items()}
    assert {"Q4_K", "Q6_K"} <= set(kinds.values()) <= {"Q4_K", "Q6_K", "F32"}
    back = from_gguf(tmp_path / "q.gguf", strict=True)
    rep = {r.gguf_name: r for r in back.qcore_gguf_report.tensors}
    for k, kind in kinds.items():
        if kind != "F32":
            assert rep[k].how == "codes" and rep[k].spec.gguf == G.GGUF_SPEC_KINDS[kind], k
    export_gguf(back, tmp_path / "b.gguf", tokenizer=tmp_path / "q.gguf")
    assert _tensors(tmp_path / "b.gguf") == src
    ids = _ids()
    with torch.no_grad():
        ref = back(ids).logits[0].numpy()
    got = _llama_logits(tmp_path / "q.gguf", ids)
    assert np.abs(got - ref).max() <= 0.03 * np.abs(ref).max()
    # llama.cpp's Q4_K tensors are qcore's q4_k of the same (fp8-valued) weights, rows in llama.cpp's order
    fq = m.model.layers[0].mlp.up_proj.effective("weight").numpy()
    assert src["blk.0.ffn_up.weight"][1] == bytes(qcore.packing.pack_gguf_blocks(qcore.quantize(fq, "q4_k")))


def test_convert_to_hf_names_the_gguf_tensors_it_dequantizes(tmp_path):
    """HF (Quark) checkpoints have no float offsets: GGUF-spec tensors go out as float weights holding their
    exact values, each named in the report; the others stay codes; strict refuses."""
    from qcore.adapters.jobs.convert import convert
    m = tiny_llama256()
    q8 = qcore.make_spec("int8", granularity=qcore.PerGroup(32, axis=-1), scale_dtype="float16")
    cfg = ModelConfig(LayerConfig(weight=q8), by_name={"model.layers.0.mlp.down_proj": LayerConfig(weight="q4_k")})
    quantize_model(m, cfg, [torch.randint(0, 128, (1, 8))], progress=False)
    export_gguf(m, tmp_path / "a.gguf", tokenizer=_tokenizer())
    with pytest.raises(ValueError, match=r"not lossless, 1 tensors change: model\.layers\.0\.mlp\.down_proj\.weight"):
        convert(tmp_path / "a.gguf", tmp_path / "s", to="hf", strict=True)
    info = convert(tmp_path / "a.gguf", tmp_path / "hf", to="hf")
    assert [(t.name, t.what) for t in info.tensors] == [("model.layers.0.mlp.down_proj.weight", "dequantized")]
    assert "GGUF q4_k" in info.tensors[0].source and info.quantized == 6
    from qcore.adapters import from_pretrained
    back = from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        assert torch.equal(back(_ids()).logits, m(_ids()).logits)


def test_quark_spelling_refused_by_name():
    """No presets for GGUF types: Quark has no spelling for them (the config round trips through to_dict only)."""
    c = ModelConfig(LayerConfig(weight=qcore.make_spec("q6_k")))
    with pytest.raises(ValueError, match="GGUF type 'q6_k' has no Quark spelling"):
        c.to_quark()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["q4_k", "q4_1"])
def test_half_precision_modules_freeze_exactly(name, dtype):
    torch.manual_seed(0)
    m = wrap(nn.Linear(256, 4).to(dtype), LayerConfig(weight=name), name="l")
    x = torch.randn(2, 256, dtype=dtype)
    y = m(x)
    m.freeze()
    assert torch.equal(m(x), y) and m._w().dtype == dtype


def test_rows_not_a_multiple_of_the_block_refused_before_any_change():
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    with pytest.raises(ValueError, match=r"GGUF type 'q4_k' needs a 2-D weight whose rows are a multiple of 256"):
        quantize_model(m, ModelConfig(LayerConfig(weight="q4_k")), None, progress=False)
    assert type(m.model.layers[0].self_attn.q_proj) is nn.Linear

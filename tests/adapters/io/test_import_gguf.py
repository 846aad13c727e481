"""from_gguf: GGUF files (qcore's exports and files quantized by ggml's own reference quantizer) imported as frozen
qcore modules without a float round trip; round trips through export_gguf and export_hf; the report; refusals;
the real SmolLM2 file (real_model)."""

import warnings

import numpy as np
import pytest
import torch

import qcore
from qcore import PerGroup
from qcore.formats import gguf as G

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from qcore.adapters import export_hf, from_pretrained, quantize_model  # noqa: E402
from qcore.adapters.config import LayerConfig, ModelConfig  # noqa: E402
from qcore.adapters.io.common import weight_parts  # noqa: E402
from qcore.adapters.io.gguf import export_gguf  # noqa: E402
from qcore.adapters.io.gguf import from_gguf  # noqa: E402
from qcore.adapters.modules import QuantEmbedding, QuantLinear, QuantModule  # noqa: E402

SPECS = {
    "Q4_0": lambda: qcore.make_spec("int4", granularity=PerGroup(32, axis=-1), scale_dtype="float16"),
    "Q4_1": lambda: qcore.make_spec("uint4", granularity=PerGroup(32, axis=-1), scale_dtype="float16",
                                    symmetric=True),
    "Q8_0": lambda: qcore.make_spec("int8", granularity=PerGroup(32, axis=-1), scale_dtype="float16"),
    "MXFP4": lambda: qcore.make_spec("mxfp4", axis=-1),
}


def _quantized(zoo, spec, seed=0, **kw):
    m = zoo.tiny_llama(seed)
    quantize_model(m, ModelConfig(LayerConfig(weight=spec), **kw), [torch.randint(0, 128, (1, 8))], progress=False)
    return m


def _ids(n=16):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(1))


def _logits(m, ids=None):
    with torch.no_grad():
        return m(_ids() if ids is None else ids).logits


def _import(path, **kw):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m = from_gguf(path, **kw)
    return m, [str(x.message) for x in w if "from_gguf" in str(x.message)]


def _hf_gguf(path):
    """transformers' own GGUF loader (dequantizes with gguf-py), float32."""
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def _tensors(path) -> dict:
    return {t.name: (t.tensor_type.name, np.asarray(t.data).copy()) for t in gguf.GGUFReader(path).tensors}


def _ggml_file(model, path, kind, *, embed=False):
    """A GGUF of the float ``model`` written the way llama.cpp's tools quantize: ggml's reference quantizer
    (``G.quantize_float`` = gguf-py's, or gguf-py's for other types) on every Linear weight (and the token
    embedding when ``embed``), norms F32, q/k rows in llama.cpp's order."""
    cfg = model.config.to_dict()
    V = gguf.GGUFValueType
    w = gguf.GGUFWriter(path, arch="llama")
    for k, (v, vk) in G.llama_metadata(cfg).items():
        w.add_key_value(k, v, {"u32": V.UINT32, "f32": V.FLOAT32, "str": V.STRING}[vk])
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, t in model.state_dict().items():
        g = G.hf_to_gguf_name(name)
        if g is None or g == "output.weight" and cfg.get("tie_word_embeddings"):
            continue
        a = t.detach().float().numpy()
        if ".attn_q." in g or ".attn_k." in g:
            a = G.permute_qk(a, n_head if ".attn_q." in g else n_kv)
        if a.ndim == 2 and (g != "token_embd.weight" or embed):
            qt = getattr(gguf.GGMLQuantizationType, kind)
            data = G.quantize_float(a, kind) if kind in G.TYPE_BYTES else gguf.quants.quantize(a, qt)
            w.add_tensor(g, data, raw_dtype=qt)
        else:
            w.add_tensor(g, np.ascontiguousarray(a, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------------------------------------------
# qcore's own exports: bit-identical parts, logits, files
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(SPECS))
def test_export_import_roundtrip_bit_identical(zoo, tmp_path, kind):
    m = _quantized(zoo, SPECS[kind]())
    export_gguf(m, tmp_path / "m.gguf")
    b, warned = _import(tmp_path / "m.gguf")
    rep = b.qcore_gguf_report
    assert not warned and rep.exact and not rep.dequantized
    assert len(rep.codes) == 14 and {r.gguf_type for r in rep.codes} == {kind}
    assert {r.how for r in rep.tensors if r.gguf_type == "F32"} == {"float"}
    for n, mod in m.named_modules():
        if isinstance(mod, QuantModule):
            got = b.get_submodule(n)
            assert type(got) is QuantLinear and got.frozen
            p1, s1 = weight_parts(mod)
            p2, s2 = weight_parts(got)
            assert s1 == s2 and np.array_equal(p1.codes, p2.codes)
            assert np.array_equal(p1.scales.view(np.uint32), p2.scales.view(np.uint32))
            assert p2.zero_points is None and p1.zero_points is None
    assert torch.equal(_logits(b), _logits(m))
    # the config describes the model exactly: export_gguf / export_hf accept it; the same file comes back
    assert b.qcore_config.layer.weight.spec.granularity == PerGroup(32, 1)
    name = gguf.GGUFReader(tmp_path / "m.gguf").fields["general.name"].contents()
    export_gguf(b, tmp_path / "n.gguf", name=name)
    assert (tmp_path / "n.gguf").read_bytes() == (tmp_path / "m.gguf").read_bytes()


def test_asymmetric_uint4_exact_offsets_import_as_codes(zoo, tmp_path):
    """uint4 asymmetric with power-of-two float16 scales: every m = -scale * zp is a float16, so the file is
    lossless Q4_1 and imports as uint4 with the same zero points."""
    spec = qcore.make_spec("uint4", granularity=PerGroup(32, axis=-1), scale_dtype="float16", symmetric=False,
                           pow2_scale=False)
    m = zoo.tiny_llama(0)
    with torch.no_grad():  # weights on a grid with scale 2**-6 and zero points 0..15
        g = torch.Generator().manual_seed(3)
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear):
                rows, cols = mod.weight.shape
                zp = torch.randint(0, 16, (rows, cols // 32, 1), generator=g).float()
                c = torch.randint(0, 16, (rows, cols // 32, 32), generator=g).float()
                c[..., 0], c[..., 1] = 0, 15  # the block's range is the grid's
                mod.weight.copy_(((c - zp) * 2.0 ** -6).reshape(rows, cols))
    quantize_model(m, ModelConfig(LayerConfig(weight=spec)), [torch.randint(0, 128, (1, 8))], progress=False)
    info = export_gguf(m, tmp_path / "m.gguf")
    assert info.lossless and {r.gguf_type for r in info.quantized} == {"Q4_1"}
    b, warned = _import(tmp_path / "m.gguf")
    assert not warned and len(b.qcore_gguf_report.codes) == 14
    q = b.model.layers[0].mlp.up_proj
    assert q.specs["weight"].symmetric is False and q.specs["weight"].dtype.name == "uint4"
    p1, _ = weight_parts(m.model.layers[0].mlp.up_proj)
    p2, _ = weight_parts(q)
    assert np.array_equal(p1.codes, p2.codes) and np.array_equal(p1.zero_points, p2.zero_points)
    assert torch.equal(_logits(b), _logits(m))


def test_inexact_q4_1_offsets_import_as_float_offset_codes(zoo, tmp_path):
    """An asymmetric export whose m = -scale * zp was rounded to float16 is not an integer-zero-point grid any
    more: such tensors import as codes of the GGUF spec q4_1 (float block offsets m), exactly, and the file
    converts back to the same bytes (issue 25; before, ggml's dequantization as float weights)."""
    m = _quantized(zoo, qcore.make_spec("uint4", granularity=PerGroup(32, axis=-1), scale_dtype="float16",
                                        symmetric=False))
    info = export_gguf(m, tmp_path / "m.gguf")
    assert not info.lossless
    b, warned = _import(tmp_path / "m.gguf")
    rep = b.qcore_gguf_report
    assert not warned and not rep.dequantized and rep.exact
    assert any(r.spec.gguf == "q4_1" for r in rep.codes)
    assert torch.equal(_logits(b), _logits(_hf_gguf(tmp_path / "m.gguf")))
    from_gguf(tmp_path / "m.gguf", strict=True)
    export_gguf(b, tmp_path / "n.gguf")
    assert (tmp_path / "n.gguf").read_bytes() == (tmp_path / "m.gguf").read_bytes()


# ---------------------------------------------------------------------------------------------------------------
# files written by ggml's own quantizer
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "MXFP4"])
def test_ggml_quantized_file_imports_as_codes(zoo, tmp_path, kind):
    path = _ggml_file(zoo.tiny_llama(0), tmp_path / "g.gguf", kind)
    b, warned = _import(path)
    rep = b.qcore_gguf_report
    assert not warned and rep.exact and len(rep.codes) == 15  # 14 + the untied output head
    assert isinstance(b.lm_head, QuantLinear) and b.lm_head.frozen
    spec = b.model.layers[0].self_attn.q_proj.specs["weight"]
    if kind == "Q4_0":  # ggml writes d = x[argmax |x|] / -8: negative scales -> uint4 with zero points 7 / 8
        assert spec.dtype.name == "uint4" and not spec.symmetric
        zp = weight_parts(b.model.layers[0].self_attn.q_proj)[0].zero_points
        assert set(np.unique(zp)) == {7.0, 8.0}
    assert torch.equal(_logits(b), _logits(_hf_gguf(path)))
    # back to GGUF: the same blocks (Q4_0 again, not Q4_1)
    export_gguf(b, tmp_path / "back.gguf")
    src, back = _tensors(path), _tensors(tmp_path / "back.gguf")
    assert sorted(src) == sorted(back)
    for k, (t, a) in src.items():
        assert back[k][0] == t and np.array_equal(back[k][1], a), k


def test_ggml_q4_1_file_imports_as_float_offset_codes(zoo, tmp_path):
    """ggml's Q4_1 (m = min(x), not -d * k): codes of the GGUF spec q4_1 (issue 25; before, float weights)."""
    path = _ggml_file(zoo.tiny_llama(0), tmp_path / "g.gguf", "Q4_1")
    b, warned = _import(path)
    rep = b.qcore_gguf_report
    assert len(rep.codes) == 15 and not rep.dequantized and rep.exact and not warned
    assert {r.spec.gguf for r in rep.codes} == {"q4_1"}
    q = b.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantModule) and q.frozen and q.specs["weight"].gguf == "q4_1"
    assert torch.equal(_logits(b), _logits(_hf_gguf(path)))
    export_gguf(b, tmp_path / "n.gguf")
    assert _tensors(tmp_path / "n.gguf").keys() == _tensors(path).keys()
    for k, (t, a) in _tensors(path).items():
        got = _tensors(tmp_path / "n.gguf")[k]
        assert got[0] == t and np.array_equal(got[1], a), k


def test_ggml_file_to_hf_checkpoint_and_back(zoo, tmp_path):
    path = _ggml_file(zoo.tiny_llama(0), tmp_path / "g.gguf", "Q4_0")
    b, _ = _import(path)
    info = export_hf(b, tmp_path / "hf")
    assert info.quant_method == "qcore"  # float16 scales: qcore's layout
    c = from_pretrained(tmp_path / "hf")
    assert torch.equal(_logits(c), _logits(b))
    p1, _ = weight_parts(b.model.layers[1].mlp.down_proj)
    p2, _ = weight_parts(c.model.layers[1].mlp.down_proj)
    assert np.array_equal(p1.codes, p2.codes) and np.array_equal(p1.scales, p2.scales)
    assert np.array_equal(p1.zero_points, p2.zero_points)


def test_quantized_untied_embedding_becomes_quant_embedding(zoo, tmp_path):
    spec = SPECS["Q8_0"]()
    m = _quantized(zoo, spec, by_name={"model.embed_tokens": LayerConfig(weight=spec)}, exclude=())
    export_gguf(m, tmp_path / "m.gguf")
    b, warned = _import(tmp_path / "m.gguf")
    assert not warned and len(b.qcore_gguf_report.codes) == 16
    assert type(b.model.embed_tokens) is QuantEmbedding and b.model.embed_tokens.frozen
    assert type(b.lm_head) is QuantLinear
    assert torch.equal(_logits(b), _logits(m))
    export_hf(b, tmp_path / "hf")
    assert torch.equal(_logits(from_pretrained(tmp_path / "hf")), _logits(m))


def test_tied_quantized_embedding_imports_as_codes_the_head_shares(zoo, tmp_path):
    """A quantized token_embd tied to the head: a frozen QuantEmbedding and a frozen head holding the same buffers
    (llama.cpp's head multiplies by the same quantized matrix); the values are ggml's, as transformers' load."""
    t = transformers
    cfg = t.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    path = _ggml_file(t.LlamaForCausalLM(cfg).eval(), tmp_path / "g.gguf", "Q8_0", embed=True)
    b, warned = _import(path)
    r = {x.gguf_name: x for x in b.qcore_gguf_report.tensors}["token_embd.weight"]
    assert r.how == "codes" and r.exact and not warned
    assert type(b.model.embed_tokens) is QuantEmbedding and type(b.lm_head) is QuantLinear
    assert b.lm_head.weight_packed is b.model.embed_tokens.weight_packed
    assert torch.equal(_logits(b), _logits(_hf_gguf(path)))
    export_gguf(b, tmp_path / "b.gguf")
    assert {x.name for x in gguf.GGUFReader(tmp_path / "b.gguf").tensors} == {
        x.name for x in gguf.GGUFReader(path).tensors}


def test_q5_0_file_imports_as_codes(zoo, tmp_path):
    path = _ggml_file(zoo.tiny_llama(0), tmp_path / "g.gguf", "Q5_0")
    b, warned = _import(path)
    assert {(r.how, r.spec.gguf) for r in b.qcore_gguf_report.tensors if r.gguf_type == "Q5_0"} == {("codes", "q5_0")}
    assert not warned
    assert torch.equal(_logits(b), _logits(_hf_gguf(path)))


def test_other_block_types_refused_or_dequantized(tmp_path):
    t = transformers
    cfg = t.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = _ggml_file(t.LlamaForCausalLM(cfg).eval(), tmp_path / "g.gguf", "TQ2_0")
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_q.weight' is TQ2_0, which no qcore grid holds"):
        from_gguf(path)
    b, warned = _import(path, dequantize_other=True)
    assert {r.how for r in b.qcore_gguf_report.tensors if r.gguf_type == "TQ2_0"} == {"dequantized"}
    assert warned


def test_dtype_bfloat16(zoo, tmp_path):
    m = _quantized(zoo, SPECS["Q4_0"]())
    export_gguf(m, tmp_path / "m.gguf")
    b, _ = _import(tmp_path / "m.gguf", dtype=torch.bfloat16)
    q = b.model.layers[0].self_attn.q_proj
    assert q._w().dtype == torch.bfloat16 and b.model.norm.weight.dtype == torch.bfloat16
    assert torch.equal(q._w(), m.model.layers[0].self_attn.q_proj.weight.to(torch.bfloat16))
    rep = b.qcore_gguf_report
    assert all(r.exact for r in rep.codes)
    assert {r.name for r in rep.inexact} <= {r.name for r in rep.tensors if r.how == "float"}


def test_validation(zoo, tmp_path):
    m = _quantized(zoo, SPECS["Q8_0"]())
    export_gguf(m, tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="must name a .gguf file"):
        from_gguf(tmp_path / "m.bin")
    with pytest.raises(FileNotFoundError, match="is not a file"):
        from_gguf(tmp_path / "x.gguf")
    with pytest.raises(TypeError, match="strict must be a bool"):
        from_gguf(tmp_path / "m.gguf", strict=1)
    with pytest.raises(ValueError, match="dtype must be one of"):
        from_gguf(tmp_path / "m.gguf", dtype=torch.int8)
    with pytest.raises(ValueError, match="pass one of them"):
        from_gguf(tmp_path / "m.gguf", strict=True, dequantize_other=True)
    # a file whose tensor has no place in the Llama model, and one with a truncated tensor
    src = gguf.GGUFReader(tmp_path / "m.gguf")

    def rewrite(path, edit):
        w = gguf.GGUFWriter(path, arch="llama")
        for k, f in src.fields.items():
            if k.startswith("llama."):
                w.add_key_value(k, f.contents(), f.types[0])
        for t in src.tensors:
            name, data = edit(t.name, np.asarray(t.data))
            if t.tensor_type.name in G.TYPE_BYTES:
                w.add_tensor(name, data, raw_dtype=t.tensor_type)
            else:
                w.add_tensor(name, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    p = rewrite(tmp_path / "a.gguf", lambda n, d: ("blk.0.attn_qkv.weight" if n == "blk.0.attn_q.weight" else n, d))
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_qkv.weight' has no place"):
        from_gguf(p)
    p = rewrite(tmp_path / "b.gguf", lambda n, d: (n, d[:32] if n == "blk.1.ffn_up.weight" else d))
    with pytest.raises(qcore.adapters.CorruptCheckpointError, match=r"'blk.1.ffn_up.weight' has shape"):
        from_gguf(p)


def test_import_blocks_refuses_nan_scales_naming_the_tensor(zoo, tmp_path):
    path = _ggml_file(zoo.tiny_llama(0), tmp_path / "g.gguf", "Q8_0")
    data = bytearray(path.read_bytes())
    t = {x.name: x for x in gguf.GGUFReader(path).tensors}["blk.1.ffn_down.weight"]
    off = int(t.data_offset)
    data[off:off + 2] = np.array([np.nan], np.float16).tobytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(qcore.adapters.CorruptCheckpointError, match=r"blk.1.ffn_down.weight: Q8_0 block scales"):
        from_gguf(bad)


# ---------------------------------------------------------------------------------------------------------------
# the real SmolLM2 file
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_smollm2_gguf_imports_with_transformers_logits(smollm2):
    """SmolLM2's shipped file is llama.cpp's Q4_1 (m = min: all 210 import as codes of the GGUF spec q4_1, float
    offsets) plus a Q8_0 token embedding tied to the head (codes, shared by the head); every value is held
    exactly, so the logits equal transformers' float load of the same file."""
    from qcore.adapters.eval.models import smollm2_path
    b, warned = _import(smollm2_path())
    rep = b.qcore_gguf_report
    assert len(rep.tensors) == 272 and rep.exact
    counts = {}
    for r in rep.tensors:
        counts[(r.gguf_type, r.how)] = counts.get((r.gguf_type, r.how), 0) + 1
    assert counts == {("F32", "float"): 61, ("Q4_1", "codes"): 210, ("Q8_0", "codes"): 1}
    assert {r.spec.gguf for r in rep.codes if r.gguf_type == "Q4_1"} == {"q4_1"} and not warned
    ids = torch.randint(0, 49152, (1, 48), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(b, ids), _logits(smollm2[0], ids))


# ---------------------------------------------------------------------------------------------------------------
# the other families (architecture from the file; the model from the family record naming it)
# ---------------------------------------------------------------------------------------------------------------

# model_type -> the transformers class from_gguf builds (Mistral is written as llama.cpp's 'llama')
FAMILY_CLASSES = {"mistral": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                  "phi3": "Phi3ForCausalLM"}


@pytest.mark.parametrize("fam", list(FAMILY_CLASSES))
def test_family_export_import_same_logits_and_same_file(zoo, tmp_path, fam):
    from test_export_gguf import family_quantized
    m = family_quantized(zoo, fam)
    export_gguf(m, tmp_path / "m.gguf")
    b, warned = _import(tmp_path / "m.gguf")
    assert type(b).__name__ == FAMILY_CLASSES[fam] and not warned
    rep = b.qcore_gguf_report
    assert rep.exact and len(rep.codes) == (8 if fam == "phi3" else 14)
    assert torch.equal(_logits(b), _logits(m))
    for n, p in m.named_parameters():  # norms, biases: the same floats (Gemma: 1 + w, what its norms multiply by)
        if p.ndim == 1:
            off = 1.0 if fam.startswith("gemma") and n.endswith("norm.weight") else 0.0
            assert torch.equal(b.get_parameter(n) + off, p + off), n
    assert b.config.tie_word_embeddings == m.config.tie_word_embeddings
    export_gguf(b, tmp_path / "n.gguf")  # the imported model writes the same file again
    assert (tmp_path / "n.gguf").read_bytes() == (tmp_path / "m.gguf").read_bytes()


def test_head_dim_from_key_length(zoo, tmp_path):
    """Qwen3 with head_dim != hidden / heads (as the real Qwen3 models): attention.key_length carries it."""
    base = zoo.tiny_family("qwen3")
    m = type(base)(type(base.config)(**dict(base.config.to_dict(), head_dim=32))).eval()
    quantize_model(m, ModelConfig(LayerConfig(weight=SPECS["Q8_0"]())), None, progress=False)
    export_gguf(m, tmp_path / "m.gguf")
    f = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert f["qwen3.attention.key_length"].contents() == 32 and f["qwen3.rope.dimension_count"].contents() == 32
    b, _ = _import(tmp_path / "m.gguf")
    assert b.config.head_dim == 32 and torch.equal(_logits(b), _logits(m))


def test_architecture_qcore_does_not_read_is_refused(zoo, tmp_path):
    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(path, arch="bloom")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.zeros((128, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"general.architecture is 'bloom'; qcore reads GGUF models of the "
                                         r"architectures its records describe, \['gemma', 'gemma2', "
                                         r"'gemma3', 'gpt2', 'gptneox', 'llama', 'phi3', 'qwen2', 'qwen2moe', 'qwen3', "
                                         r"'qwen3moe'\] .*randomly initialised"):
        from_gguf(path)
    w = gguf.GGUFWriter(tmp_path / "q.gguf", arch="qwen3")  # an architecture qcore reads, without its metadata
    w.add_tensor("token_embd.weight", np.zeros((128, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(qcore.adapters.CorruptCheckpointError, match=r"q.gguf: the file has no "
                                                                     r"qwen3.embedding_length metadata"):
        from_gguf(tmp_path / "q.gguf")


# ---------------------------------------------------------------------------------------------------------------
# mixture of experts: 3-D ffn_*_exps tensors into frozen QuantExperts
# ---------------------------------------------------------------------------------------------------------------

MOE_CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM"}


def _rewrite(src, dst, edit):
    """A copy of the GGUF ``src`` (metadata verbatim) whose tensors go through ``edit(name, type name, data)``,
    which returns ``(data, type name)`` or None to drop the tensor."""
    r = gguf.GGUFReader(src)
    V = gguf.GGUFValueType
    w = gguf.GGUFWriter(dst, arch=r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        w.add_key_value(k, f.contents(), f.types[0], sub_type=f.types[1] if f.types[0] == V.ARRAY else None)
    for t in r.tensors:
        out = edit(t.name, t.tensor_type.name, np.asarray(t.data).copy())
        if out is None:
            continue
        data, kind = out
        if kind in G.TYPE_BYTES:
            w.add_tensor(t.name, data, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _expert_values(ex, proj):
    return np.stack([qcore.dequantize(q).numpy() for q in ex.expert_qtensors(proj)])


@pytest.mark.parametrize("fam", list(MOE_CLASSES))
def test_moe_export_import_bit_identical_and_same_file(zoo, tmp_path, fam):
    """Q4_0 (int4 symmetric, groups of 32, float16 scales): the experts come back as frozen QuantExperts holding
    the file's codes; the logits are bit-identical and the imported model writes the same file again."""
    from test_export_gguf import family_quantized
    from qcore.adapters.modules import QuantExperts
    m = family_quantized(zoo, fam)
    export_gguf(m, tmp_path / "m.gguf")
    b, warned = _import(tmp_path / "m.gguf")
    assert type(b).__name__ == MOE_CLASSES[fam] and not warned
    for i in range(2):
        ex = b.model.layers[i].mlp.experts
        assert isinstance(ex, QuantExperts) and ex.frozen and ex.specs["weight"] == G.import_spec("Q4_0")
        for proj in ("gate_up_proj", "down_proj"):
            src = m.model.layers[i].mlp.experts
            assert np.array_equal(_expert_values(ex, proj), _expert_values(src, proj))
    rep = b.qcore_gguf_report
    assert rep.exact and sum(r.gguf_name.endswith("_exps.weight") and r.how == "codes" for r in rep.tensors) == 6
    assert b.qcore_config is not None
    assert torch.equal(_logits(b), _logits(m))
    export_gguf(b, tmp_path / "n.gguf")
    assert (tmp_path / "n.gguf").read_bytes() == (tmp_path / "m.gguf").read_bytes()


def test_moe_ggml_quantized_experts_import_as_codes(zoo, tmp_path):
    """Experts quantized by ggml's reference quantizer (Q4_0 with negative block scales where a block's extreme
    is positive) import as uint4 codes with zero points 7 / 8 (one spec for gate/up and down), exactly ggml's
    values; Q8_0 experts as int8 codes."""
    m = zoo.tiny_family("qwen3_moe")
    quantize_model(m, ModelConfig(LayerConfig(weight=SPECS["Q8_0"]()), exclude=["re:.*experts"]), None,
                   progress=False)
    export_gguf(m, tmp_path / "f.gguf")  # experts F32: come back as float experts, the same values
    b, warned = _import(tmp_path / "f.gguf")
    assert not warned and b.qcore_gguf_report.exact and not isinstance(b.model.layers[0].mlp.experts, QuantModule)
    assert torch.equal(b.model.layers[0].mlp.experts.gate_up_proj, m.model.layers[0].mlp.experts.gate_up_proj)
    assert torch.equal(_logits(b), _logits(m))
    for kind in ("Q4_0", "Q8_0"):
        def edit(name, t, data, kind=kind):
            if "_exps." not in name:
                return data, t
            e, o, i = data.shape
            return G.quantize_float(data.reshape(e * o, i), kind).reshape(e, o, -1), kind
        path = _rewrite(tmp_path / "f.gguf", tmp_path / f"{kind}.gguf", edit)
        b, warned = _import(path)
        assert not warned and b.qcore_gguf_report.exact
        ex = b.model.layers[1].mlp.experts
        spec = ex.specs["weight"]
        assert (spec.dtype.name, spec.symmetric) == (("uint4", False) if kind == "Q4_0" else ("int8", True))
        t = {x.name: x for x in gguf.GGUFReader(path).tensors}
        gate = np.asarray(t["blk.1.ffn_gate_exps.weight"].data)
        want = G.dequantize(gate.reshape(4 * 32, -1), kind, (4 * 32, 64)).reshape(4, 32, 64)
        assert np.array_equal(_expert_values(ex, "gate_up_proj")[:, :32], want)
        if kind == "Q4_0":
            assert set(np.unique(ex.expert_qtensor("down_proj", 0).zero_points.numpy())) == {7.0, 8.0}


def test_moe_mixed_expert_types_dequantized_or_refused(zoo, tmp_path):
    """Gate and up of different block types have no one qcore spec (down may differ from them: its own GGUF spec,
    tests/adapters/io/test_gguf_moe_kquants.py): imported as float experts holding ggml's dequantization, with a
    warning and in the report; strict=True refuses naming the experts."""
    from test_export_gguf import family_quantized
    from qcore.adapters.modules import QuantExperts
    m = family_quantized(zoo, "mixtral")
    export_gguf(m, tmp_path / "m.gguf")

    def edit(name, t, data):
        if name == "blk.0.ffn_up_exps.weight":
            e, o, i = data.shape[0], data.shape[1], 64
            vals = G.dequantize(data.reshape(e * o, -1), t, (e * o, i))
            return G.quantize_float(vals, "Q8_0").reshape(e, o, -1), "Q8_0"
        return data, t
    path = _rewrite(tmp_path / "m.gguf", tmp_path / "x.gguf", edit)
    b, warned = _import(path)
    assert len(warned) == 1 and "blk.0.ffn_gate_exps.weight" in warned[0], warned
    assert not isinstance(b.model.layers[0].mlp.experts, QuantExperts)
    assert isinstance(b.model.layers[1].mlp.experts, QuantExperts)
    deq = b.qcore_gguf_report.dequantized
    assert len(deq) == 3 and "different types" in deq[0].reason and all(r.exact for r in deq)
    with pytest.raises(ValueError, match=r"strict=True\): experts model.layers.0.mlp.experts"):
        from_gguf(path, strict=True)


@pytest.mark.parametrize("edit,err,match", [
    (lambda n, t, d: None if n == "blk.1.ffn_up_exps.weight" else (d, t), "CorruptCheckpointError",
     r"no tensor 'blk.1.ffn_up_exps.weight' \(experts model.layers.1.mlp.experts\)"),
    (lambda n, t, d: (d[:3], t) if n == "blk.0.ffn_down_exps.weight" else (d, t), "CorruptCheckpointError",
     r"'blk.0.ffn_down_exps.weight' has shape \[3, 64, 128\]; the model's experts model.layers.0.mlp.experts "
     r"need \[4, 64, 128\]"),
    (lambda n, t, d: (d[:, :64], t) if n == "blk.0.ffn_gate_exps.weight" else (d, t), "CorruptCheckpointError",
     r"'blk.0.ffn_gate_exps.weight' has shape \[4, 64, 64\]"),
])
def test_moe_broken_expert_tensors_refused_naming_them(zoo, tmp_path, edit, err, match):
    from test_export_gguf import family_quantized
    m = family_quantized(zoo, "mixtral")
    export_gguf(m, tmp_path / "m.gguf")
    path = _rewrite(tmp_path / "m.gguf", tmp_path / "x.gguf", edit)
    with pytest.raises(Exception, match=match) as e:
        from_gguf(path)
    assert type(e.value).__name__ == err and "x.gguf" in str(e.value)

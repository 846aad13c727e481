"""A quantized token embedding tied to the output head (issue 25): ``export_gguf`` writes a head that shares the
quantized embedding as no tensor (llama.cpp computes the head with ``token_embd``), ``from_gguf`` imports such a
``token_embd`` as a frozen ``QuantEmbedding`` and the head as a frozen module sharing its buffers (codes, not a
dequantized float copy), and the file goes back byte for byte; llama.cpp (marker ``gguf_client``) computes the
same logits, also on llama.cpp's own Q4_K_M / Q8_0 / Q4_0 files of a tied model."""

import numpy as np
import pytest
import torch

import qcore
from qcore.testing.ggml import llama_cpp_logits

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from qcore.adapters import quantize_model  # noqa: E402
from qcore.adapters.config import LayerConfig, ModelConfig  # noqa: E402
from qcore.adapters.io.gguf import check_gguf, export_gguf, from_gguf  # noqa: E402
from qcore.adapters.modules import QuantEmbedding, QuantLinear  # noqa: E402

SPECS = {"q6_k": lambda: qcore.make_spec("q6_k"), "q4_k": lambda: qcore.make_spec("q4_k"),
         "q8_0": lambda: qcore.make_spec("q8_0"), "q4_0": lambda: qcore.make_spec("q4_0"),
         "int4_g32": lambda: qcore.make_spec("int4", granularity=qcore.PerGroup(32, axis=-1),
                                             scale_dtype="float16")}


def tied(arch="llama", seed=0):
    torch.manual_seed(seed)
    kw = dict(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    if arch == "gemma":
        return transformers.GemmaForCausalLM(transformers.GemmaConfig(head_dim=64, **kw)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()


def quantized_tied(name, arch="llama"):
    m = tied(arch)
    layer = LayerConfig(weight=SPECS[name]())
    quantize_model(m, ModelConfig(layer, by_type={"Embedding": layer}, exclude=()), [torch.randint(0, 128, (1, 8))],
                   progress=False)
    return m


def _ids(n=12):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(1))


def _tensors(path):
    return {t.name: (t.tensor_type.name, bytes(np.asarray(t.data))) for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("name", list(SPECS))
def test_tied_quantized_embedding_round_trips_as_codes(tmp_path, name):
    m = quantized_tied(name)
    check_gguf(m)
    export_gguf(m, tmp_path / "a.gguf")
    t = _tensors(tmp_path / "a.gguf")
    assert "output.weight" not in t and t["token_embd.weight"][0] == {"int4_g32": "Q4_0"}.get(name, name.upper())
    with torch.no_grad():
        ref = m(_ids()).logits
    back = from_gguf(tmp_path / "a.gguf")
    emb, head = back.get_input_embeddings(), back.get_output_embeddings()
    assert isinstance(emb, QuantEmbedding) and isinstance(head, QuantLinear) and emb.frozen and head.frozen
    assert head.weight_packed is emb.weight_packed  # one copy of the blocks
    rep = {r.gguf_name: r for r in back.qcore_gguf_report.tensors}
    assert rep["token_embd.weight"].how == "codes" and not back.qcore_gguf_report.dequantized
    with torch.no_grad():
        assert torch.equal(back(_ids()).logits, ref)
    export_gguf(back, tmp_path / "b.gguf")
    assert _tensors(tmp_path / "b.gguf") == t


def test_head_quantized_apart_from_a_tied_embedding_still_refused(tmp_path):
    """Gemma's graph has no output tensor: its head may go out only as the quantized token embedding itself.
    Gemma's scaled embedding (``GemmaTextScaledWordEmbedding``) is no module qcore quantizes, so a quantized
    head tied to it stays refused; a Llama head quantized apart from its tied embedding is refused by
    quantize_model."""
    layer = LayerConfig(weight=SPECS["q4_k"]())
    with pytest.raises(ValueError, match="computes the head with token_embd"):
        check_gguf(tied("gemma"), ModelConfig(layer, by_type={"Embedding": layer}, exclude=()))
    with pytest.raises(ValueError, match="tied weight shared by"):
        quantize_model(tied(), ModelConfig(layer, by_type={"Embedding": LayerConfig(weight=SPECS["q6_k"]())},
                                           exclude=()), None, progress=False)


@pytest.mark.gguf_client
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q8_0", "Q4_0"])
def test_llama_cpp_quantized_tied_model_imports_as_codes_and_goes_back_byte_for_byte(tmp_path, ftype):
    """llama.cpp's own quantizer on an F32 GGUF of a tied Llama: token_embd quantized, no output tensor. The
    import holds the file's blocks (no dequantized tensor), re-export gives the same tensors, and llama.cpp's
    logits on the file match the imported model's (llama.cpp's 8-bit activations: asserted 2%)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    m = tied()
    quantize_model(m, ModelConfig(LayerConfig(weight=qcore.make_spec("float8_e4m3fn"))), None, progress=False)
    from test_export_gguf import tiny_tokenizer
    export_gguf(m, tmp_path / "f.gguf", tokenizer=tiny_tokenizer())  # fp8 weights as F32 (no block type near)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    assert llama_cpp.llama_model_quantize(str(tmp_path / "f.gguf").encode(), str(tmp_path / "q.gguf").encode(),
                                          params) == 0
    t = _tensors(tmp_path / "q.gguf")
    assert "output.weight" not in t and t["token_embd.weight"][0] not in ("F32", "F16")
    back = from_gguf(tmp_path / "q.gguf")
    assert not back.qcore_gguf_report.dequantized
    assert back.get_output_embeddings().weight_packed is back.get_input_embeddings().weight_packed
    export_gguf(back, tmp_path / "b.gguf")
    assert _tensors(tmp_path / "b.gguf") == t
    ids = _ids()
    with torch.no_grad():
        ref = back(ids).logits[0].numpy()
    got = llama_cpp_logits(str(tmp_path / "q.gguf"), ids[0].tolist())
    assert np.abs(got - ref).max() <= 0.02 * np.abs(ref).max()


def test_tied_head_with_copied_buffers_and_bfloat16_still_goes_back(tmp_path):
    """A model cast to bfloat16 (frozen GGUF blocks then compute in bfloat16) and a tied head whose buffers are
    equal copies of the embedding's (as a device move leaves them) export the same tensors."""
    m = quantized_tied("q6_k")
    export_gguf(m, tmp_path / "a.gguf")
    back = from_gguf(tmp_path / "a.gguf").to(torch.bfloat16)
    head = back.get_output_embeddings()
    for k in [k for k in head._buffers if k.startswith("weight_")]:
        head._buffers[k] = head._buffers[k].clone()
    assert head.weight_packed is not back.get_input_embeddings().weight_packed
    export_gguf(back, tmp_path / "b.gguf")
    assert _tensors(tmp_path / "b.gguf") == _tensors(tmp_path / "a.gguf")

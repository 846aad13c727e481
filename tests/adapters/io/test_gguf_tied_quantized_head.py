"""A quantized output head tied to a token embedding of the same GGUF type is written once, as ``token_embd``
(llama.cpp's tied layout, as llama.cpp's own quantizer writes it), not again as ``output.weight``."""

import pytest
import torch

import qcore

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from qcore.adapters import quantize_model  # noqa: E402
from qcore.adapters.config import LayerConfig, ModelConfig  # noqa: E402
from qcore.adapters.io.gguf import export_gguf, from_gguf  # noqa: E402


def _tied(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    m = transformers.LlamaForCausalLM(cfg).eval()
    assert m.lm_head.weight is m.model.embed_tokens.weight
    return m


def _types(path):
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("head", ["q8_0", "q6_k"])
def test_tied_quantized_head_is_token_embd_only(tmp_path, head):
    m = _tied()
    emb = LayerConfig(weight=qcore.make_spec(head))
    cfg = ModelConfig(LayerConfig(weight=qcore.make_spec("q4_k")),
                      by_name={"model.embed_tokens": emb, "lm_head": emb}, exclude=())
    quantize_model(m, cfg, progress=False)
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(ids).logits
    info = export_gguf(m, tmp_path / "m.gguf")
    types = _types(tmp_path / "m.gguf")
    assert "output.weight" not in types and types["token_embd.weight"] == head.upper()
    assert info.lossless and "output.weight" not in {r.gguf_name for r in info.quantized}
    # the file computes what the model computed: the head reads token_embd's values
    back = from_gguf(tmp_path / "m.gguf")
    with torch.no_grad():
        got = back(ids).logits
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)


def test_untied_quantized_head_is_still_written(tmp_path):
    m = _tied()
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone())
    m.config.tie_word_embeddings = False
    emb = LayerConfig(weight=qcore.make_spec("q8_0"))
    quantize_model(m, ModelConfig(LayerConfig(weight=qcore.make_spec("q4_k")),
                                  by_name={"model.embed_tokens": emb, "lm_head": emb}, exclude=()), progress=False)
    types = _types(export_gguf(m, tmp_path / "m.gguf").path)
    assert types["output.weight"] == "Q8_0" and types["token_embd.weight"] == "Q8_0"

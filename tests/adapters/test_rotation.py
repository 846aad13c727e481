"""QuaRot's fused rotations (qcore.adapters.rotation): the rotated float model computes the same function."""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qcore.adapters.rotation import rotate_model  # noqa: E402


def _llama(hidden, heads, kv, inter, tie, seed=0):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so folding them matters
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 2.0)
    return m


@pytest.mark.parametrize("hidden, heads, kv, inter, tie", [
    (64, 4, 2, 128, False),
    (72, 9, 3, 96, True),    # 9 heads as SmolLM2, grouped-query, tied embeddings, 72 = Paley I (71)
    (60, 5, 5, 84, False),   # 60: Paley II (29); head_dim 12: Paley I (11)
    (92, 2, 1, 64, False),   # 92 and head_dim 46: no construction here, the block-diagonal fallback
    (36, 3, 1, 52, True),    # head_dim 12, multi-query
])
@pytest.mark.parametrize("key", [None, 7])
def test_rotated_model_computes_the_same_function(hidden, heads, kv, inter, tie, key):
    m = _llama(hidden, heads, kv, inter, tie)
    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(x).logits
    r = rotate_model(copy.deepcopy(m), key=key)
    with torch.no_grad():
        out = r(x).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(r.model.layers[0].self_attn.q_proj.weight, m.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(r.model.layers[0].input_layernorm.weight, torch.ones(hidden))
    if tie:
        assert r.lm_head.weight is not r.model.embed_tokens.weight and not r.config.tie_word_embeddings


def test_unsupported_models_are_refused_before_any_change():
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match="not a Llama-like causal LM"):
        rotate_model(bert)
    m = _llama(64, 4, 2, 128, False)
    from qcore.adapters import preset, quantize_model
    quantize_model(m, preset("int8"), [torch.randint(0, 96, (1, 8))], progress=False)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match="rotate the float model before quantizing"):
        rotate_model(m)
    for k, v in m.state_dict().items():
        assert torch.equal(v.nan_to_num(), before[k].nan_to_num()), k

"""What the rotation tests share: a tiny random Llama with non-trivial norm weights (so that folding them matters)."""

import torch
import transformers


def rotation_llama(hidden=64, heads=4, kv=2, inter=128, tie=False, *, vocab=96, seed=0):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 2.0)
    return m

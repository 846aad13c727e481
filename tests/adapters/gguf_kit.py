"""What the GGUF, convert and destination tests share (tests/adapters is on sys.path through its conftest.py): a
tiny byte-level BPE tokenizer built offline, fixed token ids, llama.cpp's logits of a file."""

import pytest
import torch
import transformers


def tiny_tokenizer():
    """A 128-token byte-level BPE tokenizer (the tiny Llama's vocab size), built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    base = ["<|endoftext|>"] + [c for c in sorted(ByteLevel.alphabet()) if c in "ĠĊ" or c.isascii() and c.isalnum()]
    letters = "etaoinshr"
    merges = [(a, b) for a in letters for b in letters][:128 - len(base)]
    vocab = {t: i for i, t in enumerate(base)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>",
                                                bos_token="<|endoftext|>")


def token_ids(n: int = 12) -> torch.Tensor:
    """``[1, n]`` token ids below 128 (the tiny models' vocabulary), from a fixed generator."""
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(1))


def llama_logits(path, ids: torch.Tensor):
    """llama.cpp's logits of the GGUF file ``path`` on ``ids`` (skipped without llama-cpp-python)."""
    pytest.importorskip("llama_cpp")
    from qcore.testing.ggml import llama_cpp_logits
    return llama_cpp_logits(path, ids[0].tolist())


# -- trained tiny models of every family llama.cpp runs (tests/adapters/eval/test_llama_cpp_ppl.py,
#    bench/bench_gguf_llama_ppl.py) ------------------------------------------------------------------------------

# 256-wide rows everywhere (k-quant blocks), two layers, heads of 64, the tiny tokenizer's 128 tokens, 512 positions
_WIDE = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_MOE = dict(intermediate_size=256, num_experts_per_tok=2)
# model_type -> (config class, config edits, model class)
WIDE_FAMILIES = {
    "llama": ("LlamaConfig", {}, "LlamaForCausalLM"),
    "mistral": ("MistralConfig", {}, "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", {}, "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", dict(head_dim=64), "Qwen3ForCausalLM"),
    "gemma": ("GemmaConfig", dict(head_dim=64), "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", dict(head_dim=64, query_pre_attn_scalar=64), "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=64, query_pre_attn_scalar=64), "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", {}, "Phi3ForCausalLM"),
    "gpt2": ("GPT2Config", None, "GPT2LMHeadModel"),
    "gpt_neox": ("GPTNeoXConfig", dict(num_key_value_heads=None), "GPTNeoXForCausalLM"),
    "mixtral": ("MixtralConfig", dict(_MOE, num_local_experts=4), "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_MOE, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                                         num_experts=4), "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_MOE, moe_intermediate_size=256, num_experts=4, head_dim=64,
                                         norm_topk_prob=True), "Qwen3MoeForCausalLM"),
}


def wide_family(fam: str, seed: int = 0):
    """The untrained 256-wide model of ``fam`` (``WIDE_FAMILIES``), float32, eval mode."""
    cfg_cls, edits, model_cls = WIDE_FAMILIES[fam]
    if edits is None:  # GPT-2's own names
        kw = dict(vocab_size=128, n_embd=256, n_layer=2, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2)
    else:
        kw = {k: v for k, v in dict(_WIDE, **edits).items() if v is not None}
    cfg = getattr(transformers, cfg_cls)(**kw)
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(cfg).eval()


def text_ids() -> torch.Tensor:
    """The protocol text (the pydoc topics) in the tiny tokenizer's ids: 342,349 tokens, 1-D int64."""
    from qcore.adapters.eval.evaluate import protocol_token_ids
    return protocol_token_ids(tiny_tokenizer())


def trained_family(fam: str, *, steps: int = 60, seed: int = 0, seq: int = 128, batch: int = 8,
                   start: int = 4096, ids: torch.Tensor = None):
    """``wide_family(fam)`` trained ``steps`` AdamW steps on random windows of the protocol text from token
    ``start`` on (the evaluation windows come before it), so that its perplexity is far below its 128 tokens and
    its activations have a trained model's structure. Deterministic for a given thread count."""
    ids = text_ids() if ids is None else ids
    m = wide_family(fam, seed).train()
    g = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    for _ in range(steps):
        at = torch.randint(start, ids.numel() - seq, (batch,), generator=g)
        x = torch.stack([ids[a:a + seq] for a in at.tolist()])
        loss = m(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


# (norm, its consumers) per decoder layer: the norms whose output feeds the layer's first products
_NORM_CONSUMERS = {
    "llama": (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
              ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))),
    "gemma2": (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
               ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"))),
    "phi3": (("input_layernorm", ("self_attn.qkv_proj",)), ("post_attention_layernorm", ("mlp.gate_up_proj",))),
    "gpt2": (("ln_1", ("attn.c_attn",)), ("ln_2", ("mlp.c_fc",))),
    "gpt_neox": (("input_layernorm", ("attention.query_key_value",)),
                 ("post_attention_layernorm", ("mlp.dense_h_to_4h",))),
    "moe": (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),),
}
_NORM_OF = dict(mistral="llama", qwen2="llama", qwen3="llama", gemma="llama", gemma3_text="gemma2",
                mixtral="moe", qwen2_moe="moe", qwen3_moe="moe")


def with_outliers(model, fam: str, *, alpha: float = 30.0, every: int = 32, at: int = 5):
    """``model`` (a ``WIDE_FAMILIES`` model of ``fam``) with the same float function but outlier activation
    channels, as real LLMs have: in each layer, the norms feeding the attention and MLP products scaled by
    ``alpha`` on channels ``at, at + every, ...`` and the consumers' input columns divided by ``alpha``. Each
    8-bit activation block of llama.cpp then holds one value ``alpha`` times its neighbours' scale. In place."""
    pairs = _NORM_CONSUMERS[_NORM_OF.get(fam, fam)]
    base = getattr(model, "model", None) or getattr(model, "transformer", None) or model.gpt_neox
    layers = base.layers if hasattr(base, "layers") else base.h
    with torch.no_grad():
        for layer in layers:
            for norm_name, consumers in pairs:
                norm = layer.get_submodule(norm_name)
                idx = torch.arange(at, norm.weight.numel(), every)
                if fam == "gemma" or fam.startswith("gemma"):  # x * (1 + w)
                    norm.weight[idx] = (1 + norm.weight[idx]) * alpha - 1
                else:
                    norm.weight[idx] *= alpha
                if getattr(norm, "bias", None) is not None:
                    norm.bias[idx] *= alpha
                for c in consumers:
                    lin = layer.get_submodule(c)
                    if type(lin).__name__ == "Conv1D":  # GPT-2: weight [in, out]
                        lin.weight[idx, :] /= alpha
                    else:
                        lin.weight[:, idx] /= alpha
    return model

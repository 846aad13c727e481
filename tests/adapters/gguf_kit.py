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

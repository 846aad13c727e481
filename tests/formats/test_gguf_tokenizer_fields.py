"""qcore.formats.gguf_tokenizer: vocabulary lists -> llama.cpp's SentencePiece (``llama``) tokenizer metadata
(pure; the llama.cpp checks are in tests/adapters/io/test_gguf_tokenizers.py)."""

import pytest

from qcore.formats import gguf_tokenizer as GT


def test_scores_from_merges_rank_the_pieces_by_their_first_merge():
    vocab = {"a": 0, "b": 1, "ab": 2, "abb": 3, "bb": 4}
    assert GT.scores_from_merges(vocab, ["a b", ("ab", "b"), ("a", "bb"), ("b", "b")]) == [0.0, 0.0, -0.0, -1.0,
                                                                                          -3.0]
    with pytest.raises(ValueError, match="rank 0 .* not in the vocabulary"):
        GT.scores_from_merges(vocab, [("b", "a")])


def test_sentencepiece_fields_pad_and_validate():
    pieces, scores = ["<unk>", "<s>", "▁a"], [0.0, 0.0, -1.0]
    types = GT.piece_types(pieces, unk_id=0, control=[1])
    assert types == [2, 3, 1]
    f = {k: v for k, v, _ in GT.sentencepiece_fields(pieces, scores, types, vocab_size=5, bos_id=1, eos_id=None,
                                                      unk_id=0, pad_id=None, add_bos=True, add_eos=False,
                                                      add_space_prefix=True)}
    assert f["tokenizer.ggml.model"] == "llama" and f["tokenizer.ggml.tokens"][3:] == ["[PAD3]", "[PAD4]"]
    assert f["tokenizer.ggml.token_type"][3:] == [5, 5] and "tokenizer.ggml.eos_token_id" not in f
    with pytest.raises(ValueError, match="vocab_size is 2"):
        GT.sentencepiece_fields(pieces, scores, types, vocab_size=2, bos_id=1, eos_id=None, unk_id=0, pad_id=None,
                                add_bos=True, add_eos=False, add_space_prefix=True)
    with pytest.raises(ValueError, match="also pieces"):
        GT.sentencepiece_fields(pieces + ["▁a"], scores + [0.0], types + [1], vocab_size=5, bos_id=1, eos_id=None,
                                unk_id=0, pad_id=None, add_bos=True, add_eos=False, add_space_prefix=True)

"""Tokenizers in GGUF: vocabulary lists -> llama.cpp's ``tokenizer.ggml.*`` metadata. Pure Python (no torch,
transformers or sentencepiece; ``qcore.adapters.io.gguf`` reads the tokenizer objects and calls these).

llama.cpp's SentencePiece tokenizer (``tokenizer.ggml.model = "llama"``, ``LLAMA_VOCAB_TYPE_SPM``) is what
llama.cpp's converter writes for Llama-2, Mistral, Gemma and Phi-3 (``convert_hf_to_gguf.py``
``_set_vocab_sentencepiece``): the pieces as they are spelled (``"▁the"``, byte pieces ``"<0x0A>"``), a score per
piece, a type per piece (``TOKEN_TYPES``: normal, unknown, control, user-defined, unused, byte), the special
token ids, ``add_bos_token`` / ``add_eos_token`` and ``add_space_prefix`` (SentencePiece's dummy prefix: a
``"▁"`` before the text). llama.cpp tokenizes by merging, among adjacent symbols (UTF-8 characters at first), the
pair whose concatenation is the piece of highest score (leftmost first on ties), which is SentencePiece's BPE;
characters no piece holds become their byte pieces (byte fallback). Scores are what a SentencePiece model
stores; for a transformers fast tokenizer (a BPE with merges and byte fallback, what ``LlamaTokenizerFast`` is)
``scores_from_merges`` gives each piece ``-rank`` of the first merge that makes it, so that the highest score is
the earliest merge: the same order.

Pieces the vocabulary does not fill up to the model's ``vocab_size`` are ``[PAD<i>]`` (unused), as llama.cpp's
converter writes them.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional, Sequence

__all__ = ["TOKEN_TYPES", "BYTE_PIECE", "scores_from_merges", "piece_types", "sentencepiece_fields"]

# llama.cpp's llama_token_type (gguf-py's gguf.TokenType)
TOKEN_TYPES = {"normal": 1, "unknown": 2, "control": 3, "user_defined": 4, "unused": 5, "byte": 6}
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
PAD_SCORE = -1000.0  # the converter's score of added and padding pieces


def scores_from_merges(vocab: dict, merges: Iterable) -> list:
    """Score per id (``len = max id + 1``) of a BPE vocabulary: ``-rank`` of the first merge that makes the piece
    (merges as ``"a b"`` strings or ``(a, b)`` pairs, in rank order); pieces no merge makes (characters, bytes,
    specials) score 0, which llama.cpp never compares (it starts from characters and only merges into pieces)."""
    if not isinstance(vocab, dict) or not vocab:
        raise TypeError(f"vocab must be a non-empty dict piece -> id, got {type(vocab).__name__}")
    scores = [0.0] * (max(vocab.values()) + 1)
    seen = set()
    for rank, m in enumerate(merges):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        i = vocab.get(a + b)
        if i is None:
            raise ValueError(f"merges: rank {rank} ({a!r}, {b!r}) makes {a + b!r}, which is not in the vocabulary")
        if i not in seen:
            seen.add(i)
            scores[i] = -float(rank)
    return scores


def piece_types(pieces: Sequence[str], *, unk_id: Optional[int] = None, control: Iterable[int] = (),
                user_defined: Iterable[int] = (), unused: Iterable[int] = ()) -> list:
    """llama.cpp's type of each piece: byte pieces ``<0xNN>`` byte, ``unk_id`` unknown, then the given control,
    user-defined and unused ids; the rest normal."""
    types = [TOKEN_TYPES["byte"] if BYTE_PIECE.fullmatch(p) else TOKEN_TYPES["normal"] for p in pieces]
    for ids, kind in ((user_defined, "user_defined"), (control, "control"), (unused, "unused")):
        for i in ids:
            types[i] = TOKEN_TYPES[kind]
    if unk_id is not None:
        types[unk_id] = TOKEN_TYPES["unknown"]
    return types


def sentencepiece_fields(pieces: Sequence[str], scores: Sequence[float], types: Sequence[int], *, vocab_size: int,
                         bos_id: Optional[int], eos_id: Optional[int], unk_id: Optional[int],
                         pad_id: Optional[int], add_bos: bool, add_eos: bool, add_space_prefix: bool,
                         chat_template: Optional[str] = None) -> list:
    """``[(key, value, kind)]`` of llama.cpp's ``"llama"`` tokenizer; kind ``"str"``, ``"u32"``, ``"bool"`` or
    ``"[str]"`` / ``"[f32]"`` / ``"[i32]"`` (arrays). The pieces are padded with ``[PAD<i>]`` up to
    ``vocab_size``; more pieces than that, or lists of different lengths, are refused (ValueError)."""
    n = len(pieces)
    if len(scores) != n or len(types) != n:
        raise ValueError(f"pieces, scores and types must have one entry per piece, got {n}, {len(scores)}, "
                         f"{len(types)}")
    if not isinstance(vocab_size, int) or vocab_size < n:
        raise ValueError(f"vocab_size: the tokenizer has {n} pieces, the model's vocab_size is {vocab_size}")
    bad = sorted(set(types) - set(TOKEN_TYPES.values()))
    if bad:
        raise ValueError(f"types: {bad} are not llama.cpp token types {sorted(TOKEN_TYPES.values())}")
    seen = {}
    for i, p in enumerate(pieces):
        if not isinstance(p, str) or not p:
            raise ValueError(f"pieces[{i}] must be a non-empty str, got {p!r}")
        if p in seen and types[i] != TOKEN_TYPES["unused"]:
            raise ValueError(f"pieces[{i}] {p!r} is also pieces[{seen[p]}]: llama.cpp maps a piece to one id")
        seen.setdefault(p, i)
    pieces = list(pieces) + [f"[PAD{i}]" for i in range(n, vocab_size)]
    scores = [float(s) for s in scores] + [PAD_SCORE] * (vocab_size - n)
    types = [int(t) for t in types] + [TOKEN_TYPES["unused"]] * (vocab_size - n)
    out = [("tokenizer.ggml.model", "llama", "str"), ("tokenizer.ggml.pre", "default", "str"),
           ("tokenizer.ggml.tokens", pieces, "[str]"), ("tokenizer.ggml.scores", scores, "[f32]"),
           ("tokenizer.ggml.token_type", types, "[i32]")]
    for key, v in (("bos", bos_id), ("eos", eos_id), ("unknown", unk_id), ("padding", pad_id)):
        if v is not None:
            if not 0 <= int(v) < vocab_size:
                raise ValueError(f"{key} token id {v} is outside the vocabulary [0, {vocab_size})")
            out.append((f"tokenizer.ggml.{key}_token_id", int(v), "u32"))
    out += [("tokenizer.ggml.add_bos_token", bool(add_bos), "bool"),
            ("tokenizer.ggml.add_eos_token", bool(add_eos), "bool"),
            ("tokenizer.ggml.add_space_prefix", bool(add_space_prefix), "bool")]
    if isinstance(chat_template, str):
        out.append(("tokenizer.chat_template", chat_template, "str"))
    return out

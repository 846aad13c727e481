"""SentencePiece tokenizers (Llama-2, Mistral, Gemma, Phi-3) -> llama.cpp's ``"llama"`` tokenizer metadata, for
``export_gguf(tokenizer=)``: the transformers-facing half (reading the tokenizer object); the conversion itself is
``qcore.formats.gguf_tokenizer``.

Two kinds of tokenizer are read:

- a slow tokenizer whose backend is SentencePiece (``tokenizer.sp_model``, a ``sentencepiece.SentencePieceProcessor``:
  transformers' ``SentencePieceBackend`` tokenizers, transformers 4's slow ``LlamaTokenizer`` / ``GemmaTokenizer``):
  the model's own pieces, scores and piece types (SentencePiece's types are llama.cpp's), ``add_dummy_prefix`` as
  ``add_space_prefix``; needs the ``sentencepiece`` package (and protobuf) to read the model;
- a fast tokenizer whose ``tokenizer.json`` is a BPE with byte fallback (what transformers converts SentencePiece
  models to: ``LlamaTokenizer`` / ``LlamaTokenizerFast``, ``GemmaTokenizer``): pieces from its vocabulary, scores
  from its merges (``formats.gguf_tokenizer.scores_from_merges``), the space prefix from its ``Metaspace``
  pre-tokenizer or its ``Prepend("▁")`` normalizer.

What llama.cpp's tokenizer cannot reproduce is refused (ValueError) rather than written to tokenize differently: a
Unigram model (llama.cpp's ``"llama"`` tokenizer merges like SentencePiece's BPE), a vocabulary without the 256
byte pieces ``<0x00>``..``<0xFF>``, normalizers other than the space rules above (NFKC, removing extra whitespace),
pre-tokenizers that split words. transformers' ``Metaspace`` (``prepend_scheme="first"``) puts no ``"▁"`` before a
text that already begins with a space, SentencePiece and llama.cpp do: such a tokenizer is written with
``add_space_prefix`` and a warning says that texts beginning with a space get one more ``"▁"`` in llama.cpp.
``add_bos`` / ``add_eos`` are what the tokenizer does: whether ``tokenizer("a")`` puts its BOS / EOS around
``tokenizer("a", add_special_tokens=False)``.
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Optional

from qcore.formats import gguf_tokenizer as GT

__all__ = ["sentencepiece_fields_of"]

_SPM_BPE = 2  # sentencepiece_model.proto TrainerSpec.ModelType BPE


def _adds(tokenizer: Any) -> tuple[bool, bool]:
    bos, eos = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)
    try:
        ids = list(tokenizer("a")["input_ids"])
        plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    except Exception as e:  # noqa: BLE001 - a tokenizer that cannot encode is refused, naming why
        raise ValueError(f"export_gguf: the tokenizer could not encode 'a' ({type(e).__name__}: {e})") from e
    extra = len(ids) - len(plain)
    add_bos = extra > 0 and bos is not None and ids[0] == bos and ids[1:1 + len(plain)] == plain
    add_eos = extra > 0 and eos is not None and ids[-1] == eos and (extra > 1 or not add_bos)
    return add_bos, add_eos


def _special_ids(tokenizer: Any) -> dict:
    return {k: getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "unk", "pad")}


def _added(tokenizer: Any) -> dict:
    """``{id: (content, special)}`` of the tokenizer's added tokens."""
    return {int(i): (t.content, bool(t.special)) for i, t in (getattr(tokenizer, "added_tokens_decoder", None)
                                                               or {}).items()}


def _check_bytes(pieces: list, where: str) -> None:
    have = {p.upper() for p in pieces if GT.BYTE_PIECE.fullmatch(p)}
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0X{b:02X}>" not in have]
    if missing:
        raise ValueError(f"export_gguf: {where} lacks the byte pieces {missing[:3]}{'...' if len(missing) > 3 else ''}"
                         f" ({len(missing)} of 256): llama.cpp's SentencePiece tokenizer falls back to them for "
                         f"characters no piece holds (train with byte_fallback=True, or give a GGUF file's tokenizer)")


def _fields(pieces, scores, types, tokenizer, vocab_size, add_space_prefix) -> list:
    # added tokens: past the base vocabulary appended (control if special, else user-defined), inside it retyped
    for i, (content, special) in sorted(_added(tokenizer).items()):
        kind = GT.TOKEN_TYPES["control" if special else "user_defined"]
        if i < len(pieces):
            if pieces[i] != content:
                raise ValueError(f"export_gguf: the tokenizer's added token {i} is {content!r}, its vocabulary "
                                 f"says {pieces[i]!r}")
            if not GT.BYTE_PIECE.fullmatch(content) and types[i] != GT.TOKEN_TYPES["unknown"]:
                types[i] = kind
            continue
        while len(pieces) < i:
            pieces.append(f"[PAD{len(pieces)}]")
            scores.append(GT.PAD_SCORE)
            types.append(GT.TOKEN_TYPES["unused"])
        pieces.append(content)
        scores.append(GT.PAD_SCORE)
        types.append(kind)
    if len(pieces) > vocab_size:
        raise ValueError(f"export_gguf: the tokenizer has ids up to {len(pieces) - 1}, the model's vocab_size is "
                         f"{vocab_size}")
    add_bos, add_eos = _adds(tokenizer)
    sid = _special_ids(tokenizer)
    if sid["unk"] is not None and 0 <= sid["unk"] < len(types):
        types[sid["unk"]] = GT.TOKEN_TYPES["unknown"]  # llama.cpp's converter: the unknown piece is UNKNOWN
    tmpl = getattr(tokenizer, "chat_template", None)
    return GT.sentencepiece_fields(pieces, scores, types, vocab_size=vocab_size, bos_id=sid["bos"],
                                   eos_id=sid["eos"], unk_id=sid["unk"], pad_id=sid["pad"], add_bos=add_bos,
                                   add_eos=add_eos, add_space_prefix=add_space_prefix,
                                   chat_template=tmpl if isinstance(tmpl, str) else None)


def _from_sp_model(tokenizer: Any, vocab_size: int) -> list:
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError as e:
        raise ValueError(f"export_gguf: reading the tokenizer's SentencePiece model needs the sentencepiece and "
                         f"protobuf packages ({e})") from e
    m = pb.ModelProto()
    m.ParseFromString(tokenizer.sp_model.serialized_model_proto())
    if m.trainer_spec.model_type != _SPM_BPE:
        raise ValueError(f"export_gguf: the tokenizer's SentencePiece model is of type "
                         f"{pb.TrainerSpec.ModelType.Name(m.trainer_spec.model_type)}; llama.cpp's 'llama' "
                         f"tokenizer merges as SentencePiece's BPE does (give a GGUF file's tokenizer instead)")
    ns = m.normalizer_spec
    if (ns.name not in ("identity", "") and ns.precompiled_charsmap) or ns.remove_extra_whitespaces \
            or m.trainer_spec.treat_whitespace_as_suffix:
        raise ValueError(f"export_gguf: the tokenizer's SentencePiece model normalizes text (normalizer "
                         f"{ns.name!r}, remove_extra_whitespaces={ns.remove_extra_whitespaces}, "
                         f"treat_whitespace_as_suffix={m.trainer_spec.treat_whitespace_as_suffix}); llama.cpp's "
                         f"tokenizer does not (give a GGUF file's tokenizer instead)")
    pieces = [p.piece for p in m.pieces]
    scores = [float(p.score) for p in m.pieces]
    types = [int(p.type) for p in m.pieces]  # SentencePiece's piece types are llama.cpp's (1..6)
    _check_bytes(pieces, "the tokenizer's SentencePiece model")
    return _fields(pieces, scores, types, tokenizer, vocab_size, bool(ns.add_dummy_prefix))


def _space_prefix(spec: dict) -> Optional[bool]:
    """llama.cpp's add_space_prefix for a tokenizer.json's normalizer and pre-tokenizer, None where llama.cpp's
    tokenizer does not split and normalize as it does."""
    norm, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
    if norm is None and pre is not None and pre.get("type") == "Metaspace":
        if pre.get("replacement") != "▁" or pre.get("split", True):
            return None
        scheme = pre.get("prepend_scheme")
        if scheme is None and "add_prefix_space" in pre:
            scheme = "always" if pre["add_prefix_space"] else "never"
        prefix = {"first": True, "always": True, "never": False}.get(scheme)
        if prefix:
            warnings.warn("export_gguf: the tokenizer's Metaspace puts no '▁' before a text that begins with a space, "
                          "llama.cpp's add_space_prefix (SentencePiece's dummy prefix) always does: such texts "
                          "tokenize with one more '▁' in llama.cpp (as the SentencePiece model itself gives)",
                          UserWarning, stacklevel=4)
        return prefix
    if pre is not None or norm is None:
        return None
    steps = norm["normalizers"] if norm.get("type") == "Sequence" else [norm]
    kinds = [(s.get("type"), s.get("prepend"), (s.get("pattern") or {}).get("String"), s.get("content"))
             for s in steps]
    if kinds == [("Prepend", "▁", None, None), ("Replace", None, " ", "▁")]:
        return True
    if kinds == [("Replace", None, " ", "▁")]:
        return False
    return None


def _from_json(tokenizer: Any, spec: dict, vocab_size: int) -> list:
    model = spec["model"]
    vocab = model.get("vocab") or {}
    if not isinstance(vocab, dict) or not vocab:
        raise ValueError("export_gguf: the tokenizer's BPE model has no vocabulary")
    _check_bytes(list(vocab), "the tokenizer's vocabulary")
    prefix = _space_prefix(spec)
    if prefix is None:
        raise ValueError(f"export_gguf: the tokenizer's normalizer {json.dumps(spec.get('normalizer'))[:120]} and "
                         f"pre-tokenizer {json.dumps(spec.get('pre_tokenizer'))[:120]} are not SentencePiece's "
                         f"(a '▁' for each space, optionally one before the text, no word splitting): llama.cpp's "
                         f"tokenizer would split text differently (give a GGUF file's tokenizer instead)")
    n = max(vocab.values()) + 1
    by_id = {i: p for p, i in vocab.items()}
    pieces = [by_id.get(i, f"[PAD{i}]") for i in range(n)]
    types = GT.piece_types(pieces, unused=[i for i in range(n) if i not in by_id])
    scores = GT.scores_from_merges(vocab, model.get("merges") or [])
    unk = model.get("unk_token")
    if unk in vocab:
        types[vocab[unk]] = GT.TOKEN_TYPES["unknown"]
    return _fields(pieces, scores, types, tokenizer, vocab_size, prefix)


def sentencepiece_fields_of(tokenizer: Any, vocab_size: int) -> Optional[list]:
    """``[(key, value, kind)]`` (``formats.gguf_tokenizer.sentencepiece_fields``) of a SentencePiece tokenizer,
    None for a tokenizer that is not one (a byte-level BPE, converted as ``"gpt2"`` by the caller); ValueError for
    one llama.cpp cannot reproduce (see the module docstring)."""
    if getattr(tokenizer, "sp_model", None) is not None:
        return _from_sp_model(tokenizer, vocab_size)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") == "Unigram":
        raise ValueError("export_gguf: the tokenizer is a Unigram model; llama.cpp's 'llama' tokenizer merges as "
                         "SentencePiece's BPE does, so it would tokenize differently (give a GGUF file's tokenizer "
                         "instead)")
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return _from_json(tokenizer, spec, vocab_size)
    return None

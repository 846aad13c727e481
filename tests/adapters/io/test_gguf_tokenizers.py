"""Tokenizers carried into GGUF exports (issue 25): byte-level BPE (llama.cpp's ``gpt2``) and SentencePiece
(llama.cpp's ``llama``: pieces, scores, piece types, space prefix), from a fast tokenizer (a BPE with byte
fallback, what transformers converts SentencePiece models to) and from a slow one (``sp_model``). llama.cpp
(marker ``gguf_client``) and transformers' GGUF tokenizer loader tokenize the export into the ids the source
tokenizer gives. Tiny vocabularies built offline."""

import io

import pytest
import torch

import qcore

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from qcore.adapters import quantize_model  # noqa: E402
from qcore.adapters.config import LayerConfig, ModelConfig  # noqa: E402
from qcore.adapters.io.gguf import export_gguf  # noqa: E402

TEXTS = ["Hello world", "the theory of the thing", "Grüße aus München — naïve café", "日本語 ok",
         "  two leading spaces", " one", "digits 2024 and 3.14159", "line one\nline two\n\n", "tab\there", "x"]

# A SentencePiece-style BPE vocabulary (pieces in score order, each merged piece the concatenation of two
# earlier ones), as SentencePiece writes it and transformers' LlamaTokenizer holds it
_CHARS = list("▁etaoinshrdlucmwfgypbvkxjqzTHEGMO0123456789.,")
_MERGED = ["▁t", "he", "▁the", "in", "er", "▁a", "on", "re", "▁o", "or", "▁of", "en", "ing", "▁in", "at", "es",
           "▁w", "▁s", "ou", "it", "is", "▁th", "▁c", "an", "▁b", "ed", "▁f", "ll", "▁an", "▁and", "▁p", "ar", "▁m",
           "▁d", "ic", "ion", "▁l", "▁h", "ory", "▁theory", "▁thing", "▁wor", "ld", "▁world", "el", "▁H", "▁Hel",
           "lo", "▁Hello", "▁▁", "▁▁▁", "ig", "its", "▁dig", "▁digits", "▁lin", "▁line", "▁on", "▁one", "▁tw",
           "▁two", "▁sp", "▁spa", "▁spac", "▁spaces"]


def _spm_vocab():
    """(pieces, scores): <unk> <s> </s>, the 256 byte pieces, merged pieces (score -rank), characters."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0] * len(pieces)
    merged = []
    for p in _MERGED:
        if p not in merged:
            merged.append(p)
    for r, p in enumerate(merged):
        pieces.append(p)
        scores.append(-float(r))
    for c in _CHARS:
        if c not in pieces:
            pieces.append(c)
            scores.append(-float(len(merged) + len(pieces)))
    for r, p in enumerate(merged):  # every merged piece merges two characters or earlier pieces
        assert any(all(h in _CHARS or h in merged[:r] for h in (p[:i], p[i:])) for i in range(1, len(p))), p
    return pieces, scores


def spm_fast_tokenizer(style="metaspace", *, add_bos=True):
    """A transformers fast tokenizer of the SentencePiece vocabulary above: a BPE with byte fallback, its merges
    generated from the scores as transformers converts SentencePiece models; spaces as ``"▁"`` by transformers 5's
    Llama ``Metaspace`` (one ``"▁"`` before a text that does not begin with a space), by Llama-2's
    ``tokenizer.json`` normalizer (``"legacy"``: ``Prepend("▁")``, ``Replace(" ", "▁")``), or by Gemma's
    (``"gemma"``: ``Replace`` only, no prefix)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers.tokenization_utils_base import generate_merges
    pieces, scores = _spm_vocab()
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = generate_merges(vocab, dict(zip(pieces, scores)))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if style == "metaspace":
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    elif style == "legacy":
        tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tk.normalizer = normalizers.Replace(" ", "▁")
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    if add_bos:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                          special_tokens=[("<s>", 1)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")


def sp_model_bytes(*, dummy_prefix=True, model_type="bpe", byte_fallback=True, identity=True):
    spm = pytest.importorskip("sentencepiece")
    corpus = ["the theory of the thing is that the world turns", "Hello world, hello there",
              "Grüße aus München — naïve café", "digits 2024 and 3.14159 and 42", "two  spaces\nand a new line",
              "in the end the answer is in the question", "on and on the river runs to the sea"] * 8
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=out, vocab_size=360, model_type=model_type,
        byte_fallback=byte_fallback, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1, split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        add_dummy_prefix=dummy_prefix, normalization_rule_name="identity" if identity else "nmt_nfkc",
        hard_vocab_limit=False, minloglevel=2)
    return out.getvalue()


def slow_tokenizer(tmp_path, model: bytes):
    """A slow transformers tokenizer whose backend is SentencePiece (``sp_model``), adding BOS."""
    pytest.importorskip("sentencepiece")
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    class SlowSPM(SentencePieceBackend):
        def build_inputs_with_special_tokens(self, ids, ids2=None):
            return [self.bos_token_id] + ids + ([] if ids2 is None else [self.bos_token_id] + ids2)

    d = tmp_path / "sp"  # not beside the export: transformers' GGUF loader would read it
    d.mkdir(exist_ok=True)
    (d / "tokenizer.model").write_bytes(model)
    return SlowSPM(vocab_file=str(d / "tokenizer.model"), bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def tiny_model(vocab, arch="llama"):
    torch.manual_seed(0)
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64)
    if arch == "gemma":
        m = transformers.GemmaForCausalLM(transformers.GemmaConfig(head_dim=32, **kw)).eval()
    else:
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    quantize_model(m, ModelConfig(LayerConfig(weight=qcore.make_spec("q8_0"))), [torch.randint(0, vocab, (1, 8))],
                   progress=False)
    return m


def _fields(path):
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}


def _llama_cpp_ids(path, texts, add_special):
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        return [llm.tokenize(t.encode(), add_bos=add_special, special=False) for t in texts]
    finally:
        llm.close()


def _hf_ids(tok, texts, add_special):
    return [list(tok(t, add_special_tokens=add_special)["input_ids"]) for t in texts]


def _check_same_ids(path, tok, *, metaspace=False, hf=True):
    """llama.cpp gives ``tok``'s ids, with and without its specials; for a ``metaspace`` tokenizer, a text that
    begins with a space gets the ids ``tok`` gives with one more space (SentencePiece's dummy prefix, which
    transformers' Metaspace leaves out there). transformers' GGUF tokenizer loader (``hf``) gives ``tok``'s ids
    for the texts that do not begin with a space (it builds a Metaspace tokenizer from a ``llama`` file)."""
    back = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name) if hf else None
    lead = [t for t in TEXTS if t.startswith(" ")]
    for add in (True, False):
        want = _hf_ids(tok, TEXTS, add)
        if metaspace:
            want = [w if not t.startswith(" ") else _hf_ids(tok, [" " + t], add)[0] for t, w in zip(TEXTS, want)]
        assert _llama_cpp_ids(path, TEXTS, add) == want, ("llama.cpp", add)
        if hf:
            rest = [t for t in TEXTS if t not in lead]
            assert _hf_ids(back, rest, add) == _hf_ids(tok, rest, add), ("transformers", add)


# ---------------------------------------------------------------------------------------------------------------
# export: fields, refusals
# ---------------------------------------------------------------------------------------------------------------

def test_fast_sentencepiece_tokenizer_written_as_llamas(tmp_path):
    tok = spm_fast_tokenizer("legacy")
    n = len(tok)
    export_gguf(tiny_model(n + 3), tmp_path / "m.gguf", tokenizer=tok)
    f = _fields(tmp_path / "m.gguf")
    assert f["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.merges" not in f
    toks, types, scores = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.token_type"], f["tokenizer.ggml.scores"]
    assert len(toks) == n + 3 and toks[n:] == [f"[PAD{i}]" for i in range(n, n + 3)]
    assert types[:3] == [2, 3, 3] and set(types[3:259]) == {6} and toks[3 + 0x0A] == "<0x0A>"
    assert toks[259] == "▁t" and scores[259] == 0 and scores[toks.index("▁the")] < scores[toks.index("he")]
    assert f["tokenizer.ggml.add_bos_token"] is True and f["tokenizer.ggml.add_eos_token"] is False
    assert f["tokenizer.ggml.add_space_prefix"] is True
    assert (f["tokenizer.ggml.bos_token_id"], f["tokenizer.ggml.eos_token_id"],
            f["tokenizer.ggml.unknown_token_id"]) == (1, 2, 0)


def test_sentencepiece_tokenizers_llama_cpp_cannot_reproduce_refused(tmp_path):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    m = tiny_model(400)
    tok = spm_fast_tokenizer()
    tk = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    with pytest.raises(ValueError, match="not SentencePiece's"):
        export_gguf(m, tmp_path / "a.gguf", tokenizer=transformers.PreTrainedTokenizerFast(tokenizer_object=tk))
    tk = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    tk.normalizer = normalizers.NFKC()
    with pytest.raises(ValueError, match="not SentencePiece's"):
        export_gguf(m, tmp_path / "a.gguf", tokenizer=transformers.PreTrainedTokenizerFast(tokenizer_object=tk))
    uni = Tokenizer(models.Unigram([("<unk>", 0.0), ("▁a", -1.0), ("a", -2.0)], unk_id=0, byte_fallback=True))
    with pytest.raises(ValueError, match="Unigram"):
        export_gguf(m, tmp_path / "a.gguf", tokenizer=transformers.PreTrainedTokenizerFast(tokenizer_object=uni))
    nobytes = Tokenizer(models.BPE(vocab={"<unk>": 0, "a": 1, "b": 2, "ab": 3}, merges=[("a", "b")],
                                   unk_token="<unk>", byte_fallback=True))
    nobytes.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    with pytest.raises(ValueError, match="lacks the byte pieces"):
        export_gguf(m, tmp_path / "a.gguf", tokenizer=transformers.PreTrainedTokenizerFast(tokenizer_object=nobytes))
    with pytest.raises(ValueError, match="vocab_size is 300"):
        export_gguf(tiny_model(300), tmp_path / "a.gguf", tokenizer=spm_fast_tokenizer("legacy"))
    assert not list(tmp_path.glob("*.gguf"))


def test_slow_sentencepiece_models_refused_when_llama_cpp_tokenizes_otherwise(tmp_path):
    m = tiny_model(400)
    for kw, match in ((dict(model_type="unigram"), "UNIGRAM"), (dict(byte_fallback=False), "lacks the byte"),
                      (dict(identity=False), "normalizes text")):
        d = tmp_path / kw.__repr__().replace(" ", "")[1:12]
        d.mkdir()
        with pytest.raises(ValueError, match=match):
            export_gguf(m, tmp_path / "a.gguf", tokenizer=slow_tokenizer(d, sp_model_bytes(**kw)))
    assert not (tmp_path / "a.gguf").exists()


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp and transformers tokenize the export as the source tokenizer does
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.gguf_client
def test_llama_cpp_tokenizes_a_byte_level_bpe_export_the_same(tmp_path):
    from test_export_gguf import tiny_tokenizer
    tok = tiny_tokenizer()
    export_gguf(tiny_model(128), tmp_path / "m.gguf", tokenizer=tok)
    texts = ["the rain in spain", "hello there 42", "  leading", "tea\nnote", "x"]  # the tiny vocab's alphabet
    for add in (True, False):
        assert _llama_cpp_ids(tmp_path / "m.gguf", texts, add) == _hf_ids(tok, texts, add)
    back = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    assert _hf_ids(back, texts, False) == _hf_ids(tok, texts, False)


@pytest.mark.gguf_client
@pytest.mark.parametrize("style", ["metaspace", "legacy", "gemma"])
def test_llama_cpp_tokenizes_a_fast_sentencepiece_export_the_same(tmp_path, style):
    """transformers 5.23 reads no ``gemma`` GGUF model (so no tokenizer from one either)."""
    tok = spm_fast_tokenizer(style)
    m = tiny_model(len(tok) + 3, "gemma" if style == "gemma" else "llama")
    if style == "metaspace":
        with pytest.warns(UserWarning, match="begins with a space"):
            export_gguf(m, tmp_path / "m.gguf", tokenizer=tok)
    else:
        export_gguf(m, tmp_path / "m.gguf", tokenizer=tok)
    assert _fields(tmp_path / "m.gguf")["tokenizer.ggml.add_space_prefix"] is (style != "gemma")
    _check_same_ids(tmp_path / "m.gguf", tok, metaspace=style == "metaspace", hf=style != "gemma")


@pytest.mark.gguf_client
@pytest.mark.parametrize("dummy_prefix", [True, False])
def test_llama_cpp_tokenizes_a_slow_sentencepiece_export_the_same(tmp_path, dummy_prefix):
    model = sp_model_bytes(dummy_prefix=dummy_prefix)
    tok = slow_tokenizer(tmp_path, model)
    assert _hf_ids(tok, TEXTS, False) == [tok.sp_model.encode(t) for t in TEXTS]
    export_gguf(tiny_model(len(tok)), tmp_path / "m.gguf", tokenizer=tok)
    f = _fields(tmp_path / "m.gguf")
    assert f["tokenizer.ggml.scores"][:len(tok)] == [tok.sp_model.GetScore(i) for i in range(len(tok))]
    assert f["tokenizer.ggml.add_space_prefix"] is dummy_prefix and f["tokenizer.ggml.add_bos_token"] is True
    # transformers 5.23's GGUF loader reads no add_space_prefix for a llama file (it always prefixes)
    _check_same_ids(tmp_path / "m.gguf", tok, hf=dummy_prefix)

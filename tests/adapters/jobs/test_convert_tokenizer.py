"""Issue 21: ``convert`` never drops a source's tokenizer silently. A GGUF byte-level BPE tokenizer without merges
(transformers' GGUF reader raises ``KeyError: 'scores'``) is reported in ``ConvertInfo.notes`` and the printed
report, refused under ``strict`` / ``--strict`` before anything is written, warned about by ``load_quantized``;
GGUF -> GGUF still copies its fields verbatim; a tokenizer with merges is carried; a source without one has no
note."""

import re
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import qcore.adapters as A  # noqa: E402
from qcore.adapters.jobs.convert import convert, load_quantized  # noqa: E402
from qcore.adapters.io.gguf import export_gguf  # noqa: E402
from qcore.cli import main  # noqa: E402

from gguf_kit import tiny_tokenizer  # noqa: E402

WHY = "transformers cannot load the source's tokenizer ('gpt2', 128 tokens, 0 merges)"


def _no_merges_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    base = ["<|endoftext|>"] + sorted(pre_tokenizers.ByteLevel.alphabet())[:127]
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(base)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>",
                                                bos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """The same int4 tiny Llama as GGUF with a no-merges tokenizer, with a merges tokenizer, and with none."""
    root = tmp_path_factory.mktemp("tok")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    A.quantize_model(m, A.preset("int4_wo_32"), progress=False)
    A.freeze(m)
    export_gguf(m, root / "nomerges.gguf", tokenizer=_no_merges_tokenizer())
    export_gguf(m, root / "merges.gguf", tokenizer=tiny_tokenizer())
    export_gguf(m, root / "none.gguf")
    return root


def test_the_file_really_has_no_merges_and_transformers_cannot_read_it(ggufs):
    fields = gguf.GGUFReader(ggufs / "nomerges.gguf").fields
    assert "tokenizer.ggml.tokens" in fields and "tokenizer.ggml.merges" not in fields
    with pytest.raises(KeyError, match="scores"):
        transformers.AutoTokenizer.from_pretrained(ggufs, gguf_file="nomerges.gguf", local_files_only=True)


def test_gguf_to_hf_reports_the_dropped_tokenizer_and_strict_refuses(ggufs, tmp_path):
    with pytest.raises(ValueError, match=rf"not lossless: tokenizer dropped: {re.escape(WHY)}.*'scores'.*dst was not written"):
        convert(ggufs / "nomerges.gguf", tmp_path / "s", to="hf", strict=True)
    assert not (tmp_path / "s").exists()
    info = convert(ggufs / "nomerges.gguf", tmp_path / "h", to="hf")
    assert info.notes[0].startswith(f"tokenizer dropped: {WHY}: its GGUF reader needs merges")
    assert info.to_dict()["notes"][0] == info.notes[0]
    assert not list((tmp_path / "h").glob("tokenizer*"))
    with pytest.warns(UserWarning, match=rf"load_quantized: tokenizer dropped: {re.escape(WHY)}"):
        _, tok, fmt = load_quantized(ggufs / "nomerges.gguf")
    assert tok is None and fmt == "gguf"


def test_the_other_sources_and_destinations_have_no_such_note(ggufs, tmp_path):
    info = convert(ggufs / "nomerges.gguf", tmp_path / "g.gguf", to="gguf", strict=True)  # fields copied verbatim
    assert not any("tokenizer" in n for n in info.notes)
    fields = gguf.GGUFReader(tmp_path / "g.gguf").fields
    assert len(fields["tokenizer.ggml.tokens"].data) == 128
    info = convert(ggufs / "merges.gguf", tmp_path / "m", to="hf", strict=True)  # carried
    assert not any("tokenizer" in n for n in info.notes) and (tmp_path / "m" / "tokenizer.json").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert load_quantized(ggufs / "none.gguf")[1] is None  # nothing held: nothing dropped
    info = convert(ggufs / "none.gguf", tmp_path / "n", to="hf", strict=True)
    assert not any("tokenizer" in n for n in info.notes)


def test_qcore_convert_prints_it_and_strict_exits_2(ggufs, tmp_path, capsys):
    assert main(["convert", str(ggufs / "nomerges.gguf"), str(tmp_path / "s"), "--to", "hf", "--strict"]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("qcore ")]
    assert len(lines) == 1 and "Traceback" not in err and WHY in lines[0] and not (tmp_path / "s").exists()
    assert main(["convert", str(ggufs / "nomerges.gguf"), str(tmp_path / "h"), "--to", "hf"]) == 0
    out = capsys.readouterr().out
    assert "; tokenizer dropped (see the note)" in out and f"tokenizer dropped: {WHY}" in out

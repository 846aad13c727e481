"""Issue 33 (part 3): every "lossless" ``convert`` / ``qcore convert`` prints is computed from the written file.

- each tensor is compared bit for bit with the source's, its dtype included: ``dtype=float16`` of a float32
  checkpoint is a change of every float tensor (counted: elements changed, max abs / rel error), never "lossless";
- every metadata entry is compared: GGUF -> GGUF every key/value of the two files, directories file by file
  (config.json, generation_config.json, tokenizer files), a GGUF file against a directory the model config keys
  GGUF has a field for and the tokenizer; a difference is reported (missing / changed / added) and refused by
  ``strict``, which always verifies (``--strict --no-verify`` is refused) and leaves dst as it was;
- ONNX, which qcore cannot load back, is never called lossless;
- an option that changes nothing for the source and destination formats is refused in one line, before any work.
"""

import json
import pathlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import qcore  # noqa: E402
import qcore.adapters as A  # noqa: E402
from qcore.adapters.jobs import convert as CV  # noqa: E402
from qcore.adapters.jobs.convert import convert  # noqa: E402
from qcore.cli import main  # noqa: E402

from gguf_kit import tiny_tokenizer  # noqa: E402

FLOATS = {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"} | {
    f"model.layers.{i}.{n}.weight" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")}


def _llama(**cfg):
    c = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 **{"bos_token_id": 0, "eos_token_id": 0, **cfg})
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(c).eval()
    spec = qcore.make_spec("int4", granularity=qcore.PerGroup(32, axis=-1), scale_dtype="float16")  # Q4_0 exactly
    A.quantize_model(m, A.ModelConfig(A.LayerConfig(weight=spec)), None, progress=False)
    A.freeze(m)
    return m


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A float32 int4 checkpoint that GGUF holds exactly (``hf``, with a tokenizer) and its GGUF file."""
    root = tmp_path_factory.mktemp("claims")
    A.export_hf(_llama(), root / "hf", tokenizer=tiny_tokenizer())
    assert convert(root / "hf", root / "q.gguf", to="gguf").lossless
    return root


def _files(d: pathlib.Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------------------------
# tensors: values and dtype
# ---------------------------------------------------------------------------------------------------------------


def test_dtype_float16_is_a_counted_loss_and_strict_refuses_it(src, tmp_path, capsys):
    info = convert(src / "hf", tmp_path / "h16", to="hf", dtype=torch.float16)
    assert info.lossless is False and info.verified_by == "reload"
    ch = {t.name: t for t in info.tensors}
    assert FLOATS <= set(ch)  # every float tensor: float32 -> float16 is a change even where the values survive
    for n in FLOATS:
        assert "float32" in ch[n].source and "float16" in ch[n].destination and ch[n].size > 0
    emb = ch["model.embed_tokens.weight"]  # random normal values: most of them rounded
    assert emb.size == 128 * 64 and 0 < emb.changed <= emb.size and emb.max_abs_diff > 0 and emb.max_rel_diff > 0
    norm = ch["model.norm.weight"]  # ones: float16 holds them, the narrower dtype is still reported
    assert norm.changed == 0 and norm.max_abs_diff == 0
    assert info.compared["tensors"] == {"tensor": 7, "weight": 14}

    with pytest.raises(ValueError, match=r"not lossless, \d+ tensors change: .*float16.*dst was not written"):
        convert(src / "hf", tmp_path / "s16", to="hf", dtype=torch.float16, strict=True)
    assert not (tmp_path / "s16").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    rc = main(["convert", str(src / "hf"), str(tmp_path / "c16"), "--to", "hf", "--dtype", "float16",
               "--no-progress", "--report", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "lossless" not in out and f"{len(info.tensors)} tensors changed" in out
    assert "model.embed_tokens.weight" in out and "elements" in out
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["lossless"] is False and rep["tensors_changed"] == len(info.tensors) == len(rep["changed"])
    e = next(c for c in rep["changed"] if c["name"] == "model.embed_tokens.weight")
    assert e["elements"] == 8192 and e["elements_changed"] == emb.changed and e["max_rel_diff"] == emb.max_rel_diff
    rc = main(["convert", str(src / "hf"), str(tmp_path / "c16s"), "--to", "hf", "--dtype", "float16", "--strict",
               "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "not lossless" in err and len(err.splitlines()) == 1 and not (tmp_path / "c16s").exists()


def test_lossless_names_what_was_compared(src, tmp_path, capsys):
    info = convert(src / "q.gguf", tmp_path / "h", to="hf")
    assert info.lossless is True and not info.tensors and not info.metadata
    assert info.compared["tensors"] == {"tensor": 7, "weight": 14}
    assert info.compared["metadata"]["model config"] > 10 and info.compared["metadata"]["tokenizer"] == 8
    assert "general.name" in info.not_carried  # listed, not silently dropped: a directory has no field for it
    rc = main(["convert", str(tmp_path / "h"), str(tmp_path / "g.gguf"), "--to", "gguf", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "lossless (21 tensors and" in out and "metadata entries compared with dst loaded back" in out


# ---------------------------------------------------------------------------------------------------------------
# --strict always verifies
# ---------------------------------------------------------------------------------------------------------------


def test_strict_always_verifies(src, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"strict with verify=False: strict always loads dst back"):
        convert(src / "hf", tmp_path / "o", to="gguf", strict=True, verify=False)
    rc = main(["convert", str(src / "hf"), str(tmp_path / "o"), "--to", "gguf", "--strict", "--no-verify"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--strict with --no-verify" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()
    # without --strict, --no-verify is never called lossless
    info = convert(src / "hf", tmp_path / "nv", to="hf", verify=False)
    assert info.lossless is None and info.verified_by == "none" and info.compared == {}
    rc = main(["convert", str(src / "hf"), str(tmp_path / "nv2"), "--to", "hf", "--no-verify", "--no-progress",
               "--report", str(tmp_path / "nv.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "not verified (--no-verify): nothing compared" in out and "lossless" not in out
    assert json.loads((tmp_path / "nv.json").read_text())["lossless"] is None


# ---------------------------------------------------------------------------------------------------------------
# metadata
# ---------------------------------------------------------------------------------------------------------------


def _gguf_with(path: pathlib.Path, out: pathlib.Path, extra: dict) -> None:
    """A copy of GGUF file ``path`` with the string entries ``extra`` added (gguf-py's gguf_new_metadata way)."""
    r = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(out), r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        t = f.types[0]
        w.add_key_value(f.name, f.contents(), t, sub_type=f.types[-1] if t == gguf.GGUFValueType.ARRAY else None)
    for k, v in extra.items():
        w.add_key_value(k, v, gguf.GGUFValueType.STRING)
    for t in r.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(t.data)
    w.close()


def test_gguf_to_gguf_compares_every_key_value(src, tmp_path):
    _gguf_with(src / "q.gguf", tmp_path / "lic.gguf", {"general.license": "apache-2.0", "general.author": "qcore"})
    src_keys = {k for k in gguf.GGUFReader(str(tmp_path / "lic.gguf")).fields if not k.startswith("GGUF.")}
    info = convert(tmp_path / "lic.gguf", tmp_path / "out.gguf", to="gguf")
    dst_keys = {k for k in gguf.GGUFReader(str(tmp_path / "out.gguf")).fields if not k.startswith("GGUF.")}
    # read independently of convert: whatever the writer keeps, the report says exactly what is missing
    assert {m.key for m in info.metadata if m.change == "missing"} == src_keys - dst_keys
    assert {m.key for m in info.metadata if m.change == "added"} == dst_keys - src_keys
    assert info.compared["metadata"] == {"gguf": len(src_keys | dst_keys)}
    assert info.lossless is (not info.metadata and not info.tensors)
    if src_keys - dst_keys:
        with pytest.raises(ValueError, match=r"metadata entries differ: gguf general\.(license|author) \(missing\)"):
            convert(tmp_path / "lic.gguf", tmp_path / "s.gguf", to="gguf", strict=True)
        assert not (tmp_path / "s.gguf").exists()


def test_a_changed_gguf_entry_is_refused_by_strict_and_dst_kept(src, tmp_path, monkeypatch):
    """A writer that does not carry the source's ``general.name``: reported as changed, refused by strict, and the
    existing dst keeps its bytes (the write is staged and published only after the comparison)."""
    monkeypatch.setattr(CV, "_gguf_name", lambda path: "another name")
    info = convert(src / "q.gguf", tmp_path / "o.gguf", to="gguf")
    (m,) = info.metadata
    assert (m.where, m.key, m.change, m.destination) == ("gguf", "general.name", "changed", "another name")
    assert info.lossless is False and not info.tensors
    (tmp_path / "keep.gguf").write_bytes(b"old bytes")
    with pytest.raises(ValueError, match=r"not lossless, 1 metadata entries differ: gguf general\.name \(changed\)"):
        convert(src / "q.gguf", tmp_path / "keep.gguf", to="gguf", strict=True, overwrite=True)
    assert (tmp_path / "keep.gguf").read_bytes() == b"old bytes"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_directories_are_compared_file_by_file(src, tmp_path, monkeypatch):
    h = tmp_path / "hf"
    h.mkdir()
    for name, data in _files(src / "hf").items():
        (h / name).write_bytes(data)
    g = json.loads((h / "generation_config.json").read_text())
    (h / "generation_config.json").write_text(json.dumps({**g, "temperature": 0.7, "do_sample": True}))
    t = json.loads((h / "tokenizer_config.json").read_text())
    (h / "tokenizer_config.json").write_text(json.dumps({**t, "chat_template": "{{ messages }}"}))
    for to in ("hf", "compressed-tensors"):  # carried: lossless, wherever transformers puts the chat template
        info = convert(h, tmp_path / f"o-{to}", to=to)
        assert info.lossless is True, info.metadata
        assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(
            info.compared["metadata"])

    real = CV._export

    def lossy(*a, **kw):  # a writer that drops generation_config.json and a config entry
        path, notes, exp = real(*a, **kw)
        (path / "generation_config.json").unlink()
        cfg = json.loads((path / "config.json").read_text())
        cfg["max_position_embeddings"] = 32
        (path / "config.json").write_text(json.dumps(cfg))
        return path, notes, exp
    monkeypatch.setattr(CV, "_export", lossy)
    info = convert(h, tmp_path / "lossy", to="hf")
    got = {(m.where, m.key, m.change) for m in info.metadata}
    assert got == {("generation_config.json", "(the file)", "missing"), ("config.json", "max_position_embeddings", "changed")}
    assert info.lossless is False and not info.tensors
    with pytest.raises(ValueError, match=r"2 metadata entries differ: .*generation_config\.json"):
        convert(h, tmp_path / "strict", to="hf", strict=True)
    assert not (tmp_path / "strict").exists()


def test_hf_to_gguf_compares_the_config_gguf_holds(tmp_path):
    # config.json says bos/eos 1/2, its tokenizer says 0: GGUF holds the tokenizer's ids only
    A.export_hf(_llama(bos_token_id=1, eos_token_id=2, initializer_range=0.5), tmp_path / "hf",
                tokenizer=tiny_tokenizer())
    info = convert(tmp_path / "hf", tmp_path / "o.gguf", to="gguf")
    got = {(m.where, m.key, m.change, m.source, m.destination) for m in info.metadata}
    assert got == {("model config", "bos_token_id", "changed", "1", "0"),
                   ("model config", "eos_token_id", "changed", "2", "0")}
    # a key GGUF has no field for is listed, not compared
    assert "model config initializer_range" in info.not_carried and "generation_config.json" in info.not_carried
    with pytest.raises(ValueError, match=r"model config bos_token_id \(changed\)"):
        convert(tmp_path / "hf", tmp_path / "s.gguf", to="gguf", strict=True)
    assert not (tmp_path / "s.gguf").exists()


# ---------------------------------------------------------------------------------------------------------------
# ONNX and the options
# ---------------------------------------------------------------------------------------------------------------


def test_onnx_is_never_called_lossless(src, tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    rc = main(["convert", str(src / "hf"), str(tmp_path / "o"), "--to", "onnx", "--no-progress",
               "--report", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "lossless" not in out and "dst not loaded back" in out
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["lossless"] is None and rep["verified_by"] == "exporter"


@pytest.mark.parametrize("src_name,to,flags,match", [
    ("hf", "hf", ["--tokenizer-pre", "smollm"], "--tokenizer-pre smollm changes nothing: it names llama.cpp's"),
    ("q.gguf", "gguf", ["--tokenizer-pre", "smollm"], "--tokenizer-pre smollm changes nothing: a GGUF source's"),
    ("notok", "gguf", ["--tokenizer-pre", "smollm"], "--tokenizer-pre smollm changes nothing: the source holds no"),
    ("hf", "compressed-tensors", ["--onnx-unsupported", "dequantize"], "applies to --to onnx, not --to compressed"),
    ("hf", "onnx", ["--dtype", "float16"], "--dtype float16: ONNX exports are float32 models"),
    ("hf", "onnx", ["--dtype", "float32"], "--dtype float32 changes nothing with --to onnx"),
    ("q.gguf", "hf", ["--dtype", "float32"], "--dtype float32 changes nothing: a GGUF source loads in float32"),
    ("hf", "onnx", ["--no-verify"], "--no-verify changes nothing with --to onnx"),
    ("hf", "onnx", ["--strict"], "--strict loads dst back and compares it, and --to onnx cannot be loaded back"),
    ("hf", "hf", ["--strict", "--no-verify"], "--strict with --no-verify"),
])
def test_an_option_with_no_effect_is_refused(src_name, to, flags, match, src, tmp_path, capsys):
    if src_name == "notok" and not (src / "notok").exists():
        A.export_hf(_llama(), src / "notok")
    rc = main(["convert", str(src / src_name), str(tmp_path / "o"), "--to", to, "--no-progress", *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and match in err and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_python_names_its_arguments(src, tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer_pre='smollm' changes nothing"):
        convert(src / "hf", tmp_path / "o", to="hf", tokenizer_pre="smollm")
    with pytest.raises(ValueError, match=r"onnx_unsupported='dequantize' applies to to='onnx', not to='gguf'"):
        convert(src / "hf", tmp_path / "o", to="gguf", onnx_unsupported="dequantize")
    with pytest.raises(ValueError, match=r"dst .*o\.gguf' is named like a GGUF file, but to='hf' writes a directory"):
        convert(src / "hf", tmp_path / "o.gguf", to="hf")
    assert list(tmp_path.iterdir()) == []


def test_a_written_checkpoint_that_does_not_load_back_is_not_published(src, tmp_path, monkeypatch):
    """The comparison loads dst back with qcore's own loader: a refusal there is one line naming dst (not the
    staging place), and nothing is published."""
    def refuse(path, to):
        raise ValueError(f"{str(path / 'config.json')!r}: quantization_config disagrees with the qcore block")
    monkeypatch.setattr(CV, "_reload", refuse)
    with pytest.raises(ValueError, match=r"convert to hf: the written hf checkpoint does not load back with qcore's "
                                         r"own loader \(ValueError: '.*/o/config\.json': quantization_config "
                                         r"disagrees.*\); dst was not written") as e:
        convert(src / "hf", tmp_path / "o", to="hf")
    assert ".tmp" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_the_chat_template_is_one_entry_wherever_it_is_saved(tmp_path):
    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    (a / "tokenizer_config.json").write_text(json.dumps({"eos_token": "x", "chat_template": "{{ m }}"}))
    (b / "tokenizer_config.json").write_text(json.dumps({"eos_token": "x"}))
    (b / "chat_template.jinja").write_text("{{ m }}")
    (c / "tokenizer_config.json").write_text(json.dumps({"eos_token": "x"}))
    (c / "chat_template.json").write_text(json.dumps({"chat_template": "{{ other }}"}))
    assert CV._compare_dirs(a, b, True)[0] == []
    (ch,) = CV._compare_dirs(a, c, True)[0]
    assert (ch.where, ch.key, ch.change, ch.source, ch.destination) == (
        "tokenizer_config.json", "chat_template", "changed", "{{ m }}", "{{ other }}")


def test_activation_quantization_is_compared_whole():
    """A static activation's zero point and its whole spec are compared, not only its scale."""
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    act = qcore.make_spec("uint8", granularity=qcore.PerTensor(), symmetric=False)
    models = []
    for _ in range(2):
        c = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2)
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(c).eval()
        A.quantize_model(m, A.ModelConfig(A.LayerConfig(weight=qcore.make_spec("int8", granularity=qcore.PerChannel(0)),
                                                        input=act)), [ids], progress=False)
        A.freeze(m)
        models.append(m)
    a, b = models
    assert CV.compare_models(a, b) == []
    q = b.model.layers[0].mlp.down_proj
    assert q.scales("input").zero_point is not None
    q.scales("input").zero_point.add_(1)  # the scale is the same
    (ch,) = CV.compare_models(a, b)
    assert ch.name == "model.layers.0.mlp.down_proj.input_quant" and ch.what == "activation" and ch.changed == 1


def test_gguf_to_hf_in_float16_loads_back_and_counts_the_loss(src, tmp_path):
    """GGUF's float16 block scales in a float16 model are Quark's scale_type "float": the written checkpoint loads
    back with qcore's own loader (it was refused as a disagreement) and the narrower floats are counted."""
    info = convert(src / "q.gguf", tmp_path / "o", to="hf", dtype=torch.float16)
    assert info.lossless is False and info.verified_by == "reload"
    assert any("float16" in t.destination for t in info.tensors)

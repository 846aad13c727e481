"""Every loader checks the whole file against its config before returning a model, and names what disagrees.

A corrupted-checkpoint family per loader: ``from_pretrained`` (Quark / qcore HF checkpoints),
``load_compressed_tensors``, ``from_gguf`` (and ``formats.gguf.check_file``, which every GGUF reader passes
first), the float model folders of ``qcore quantize/eval --model``, and ``qcore convert`` (whose readers are the
loaders above). Each tiny model is exported once per module; each case copies it, corrupts one thing (a tensor
removed, renamed, retyped, reshaped, a zero point or scale changed, an extra tensor, a newer ``format_version``,
an index naming files outside the directory, a truncated file, malformed or deeply nested JSON, GGUF ranges
that overlap or run past the end, GGUF counts no file could hold) and asserts a ``ValueError`` naming the
tensor or field, and for the CLI exit code 2, one error line, no traceback, nothing written.
"""

import json
import re
import shutil
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
gguf = pytest.importorskip("gguf")

import qcore  # noqa: E402
import qcore.adapters as A  # noqa: E402
from qcore.adapters.config import LayerConfig, ModelConfig, TensorConfig  # noqa: E402
from qcore.adapters.io.compressed_tensors import export_compressed_tensors  # noqa: E402
from qcore.adapters.io.gguf import export_gguf  # noqa: E402
from qcore.adapters.io.compressed_tensors import load_compressed_tensors  # noqa: E402
from qcore.adapters.io.gguf import from_gguf  # noqa: E402
from qcore.cli import main  # noqa: E402
from qcore.formats import gguf as G  # noqa: E402

P = "model.layers.0.self_attn.q_proj."


def _quantized(zoo, config):
    m = zoo.tiny_llama(0)
    A.quantize_model(m, A.preset(config) if isinstance(config, str) else config, zoo.token_batches(2, seed=1),
                     progress=False)
    A.freeze(m)
    return m


# int2 asymmetric weights (qcore layout: F32 zero points) and a static asymmetric int4 input (F32 zero point)
ASYM = ModelConfig(LayerConfig(weight=TensorConfig(qcore.make_spec("int2", granularity=qcore.PerGroup(32, axis=1),
                                                                   symmetric=False)),
                               input=TensorConfig(qcore.make_spec("int4", symmetric=False), dynamic=False)))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, zoo):
    """One export of each kind: hf_sym (int8, symmetric weights and static inputs, zero points stored), hf_asym
    (ASYM), ct (int8 compressed-tensors), gguf (int4 groups of 32 -> Q4_0)."""
    root = tmp_path_factory.mktemp("loader_checks")
    A.export_hf(_quantized(zoo, "int8"), root / "hf_sym")
    A.export_hf(_quantized(zoo, ASYM), root / "hf_asym")
    export_compressed_tensors(_quantized(zoo, "int8"), root / "ct")
    export_gguf(_quantized(zoo, "int4_wo_32"), root / "m.gguf")
    return root


def _copy(ckpts, name, tmp_path):
    src = ckpts / name
    if src.is_file():
        shutil.copy(src, tmp_path / src.name)
        return tmp_path / src.name
    shutil.copytree(src, tmp_path / name)
    return tmp_path / name


# ---------------------------------------------------------------------------------------------------- edits


def _tensors(fn):
    """An edit of the checkpoint's tensors (a dict of torch tensors, rewritten as model.safetensors)."""
    def edit(d):
        f = d / "model.safetensors"
        sd = safetensors_torch.load_file(f)
        fn(sd)
        safetensors_torch.save_file(sd, f, metadata={"format": "pt"})
    return edit


def _set(key, value, dtype=None):
    def fn(sd):
        t = sd[key].clone() if dtype is None else sd[key].to(dtype)
        t.view(-1)[0] = value
        sd[key] = t
    return _tensors(fn)


def _pop(key):
    return _tensors(lambda sd: sd.pop(key))


def _rename(key, new):
    return _tensors(lambda sd: sd.__setitem__(new, sd.pop(key)))


def _retype(key, dtype):
    return _tensors(lambda sd: sd.__setitem__(key, sd[key].to(dtype)))


def _reshape(key, shape):
    return _tensors(lambda sd: sd.__setitem__(key, sd[key].reshape(shape)))


def _add(key):
    return _tensors(lambda sd: sd.__setitem__(key, torch.zeros(4)))


def _config(fn):
    def edit(d):
        c = json.loads((d / "config.json").read_text())
        fn(c)
        (d / "config.json").write_text(json.dumps(c))
    return edit


def _qconfig(path, value):
    def fn(c):
        *head, last = path
        o = c["quantization_config"]
        for k in head:
            o = o[k]
        o[last] = value
    return _config(fn)


def _text(text):
    def edit(d):
        (d / "config.json").write_text(text)
    return edit


def _index(target):
    def edit(d):
        keys = list(safetensors_torch.load_file(d / "model.safetensors"))
        wm = {k: "model.safetensors" for k in keys}
        wm[keys[0]] = target
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return edit


def _index_with(fn):
    """A model.safetensors.index.json naming model.safetensors for every tensor, then edited by ``fn(head, d)``."""
    def edit(d):
        keys = list(safetensors_torch.load_file(d / "model.safetensors"))
        head = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in keys}}
        fn(head, d)
        (d / "model.safetensors.index.json").write_text(json.dumps(head))
    return edit


def _other_shard(head, d):  # the index puts model.norm.weight in a shard that holds something else
    safetensors_torch.save_file({"x": torch.zeros(2)}, d / "model-2.safetensors")
    head["weight_map"]["model.norm.weight"] = "model-2.safetensors"


def _truncate(n):
    """Cut ``n`` bytes off the end of model.safetensors (a negative ``n``: keep ``-n`` bytes)."""
    def edit(d):
        f = d / "model.safetensors"
        data = f.read_bytes()
        f.write_bytes(data[:-n] if n > 0 else data[:-n])
    return edit


DEEP = '{"quantization_config": ' + "[" * 100_000 + "]" * 100_000 + "}"  # past json's recursion limit
DEEPISH = '{"quantization_config": {"algo_config": ' + "[" * 900 + "]" * 900 + "}}"  # parses; would recurse later

# the families every safetensors loader shares: (id, checkpoint, edit, what the error must name)
COMMON = [
    ("float-removed", _pop("model.norm.weight"), r"'model\.norm\.weight'.*missing"),
    ("embedding-removed", _pop("model.embed_tokens.weight"), r"'model\.embed_tokens\.weight'.*missing"),
    ("float-renamed", _rename("model.layers.1.input_layernorm.weight", "model.layers.1.input_norm.weight"),
     r"'model\.layers\.1\.input_layernorm\.weight'.*missing"),
    ("float-retyped", _retype("model.norm.weight", torch.float16), r"'model\.norm\.weight' is F16"),
    ("float-reshaped", _reshape("model.layers.0.post_attention_layernorm.weight", (8, 8)),
     r"'model\.layers\.0\.post_attention_layernorm\.weight' is F32 \[8, 8\]"),
    ("weight-removed", _pop(P + "weight"), r"q_proj\.weight' is missing"),
    ("scale-removed", _pop(P + "weight_scale"), r"q_proj\.weight_scale' is missing"),
    ("weight-retyped", _retype(P + "weight", torch.int16), r"q_proj\.weight' is I16"),
    ("scale-retyped", _retype(P + "weight_scale", torch.float16), r"q_proj.*weight_scale' is F16"),
    ("extra-tensor", _add("model.layers.0.mlp.extra"), r"'model\.layers\.0\.mlp\.extra' in model\.safetensors"),
    ("scale-zero", _set(P + "weight_scale", 0.0), r"q_proj.*weight_scale.*finite and positive"),
    ("scale-nan", _set(P + "weight_scale", float("nan")), r"q_proj.*weight_scale.*finite and positive"),
    ("scale-negative", _set(P + "weight_scale", -1.0), r"q_proj.*weight_scale.*finite and positive"),
    ("input-scale-zero", _set(P + "input_scale", 0.0), r"q_proj.*input_scale.*finite and positive"),
    ("input-scale-inf", _set(P + "input_scale", float("inf")), r"q_proj.*input_scale.*finite and positive"),
    ("format-version", _qconfig(("qcore", "format_version"), 2), r"format_version is 2"),
    ("format-version-type", _qconfig(("qcore", "format_version"), "1"), r"format_version must be a positive int"),
    ("index-parent", _index("../model.safetensors"), r"names the file '\.\./model\.safetensors'"),
    ("index-absolute", _index("/etc/passwd"), r"names the file '/etc/passwd'"),
    ("index-missing-shard", _index("model-00002.safetensors"), r"shard 'model-00002\.safetensors' is missing"),
    ("index-wrong-shard", _index_with(_other_shard),
     r"index puts tensor 'model\.norm\.weight' in 'model-2\.safetensors', which does not hold it"),
    ("index-unknown-tensor", _index_with(lambda h, d: h["weight_map"].__setitem__("model.extra", "model.safetensors")),
     r"index puts tensor 'model\.extra' in 'model\.safetensors', which does not hold it"),
    ("index-metadata", _index_with(lambda h, d: h.__setitem__("metadata", "x")), r"metadata must be a JSON object"),
    ("index-file-int", _index_with(lambda h, d: h["weight_map"].__setitem__("model.norm.weight", 5)),
     r"weight_map\['model\.norm\.weight'\] must be a file name, got 5"),
    ("truncated", _truncate(100), r"model\.safetensors.*truncated.*tensor"),
    ("truncated-header", _truncate(-20), r"model\.safetensors.*header length"),
    ("config-deep", _text(DEEP), r"config\.json.*nests too deeply"),
    ("config-deepish", _text(DEEPISH), r"config\.json.*nests too deeply"),
    ("config-not-json", _text('{"quantization_config": '), r"config\.json.*not valid JSON"),
    ("config-list", _text("[1, 2]"), r"config\.json.*expected a JSON object, got list"),
    ("config-bad-field", _config(lambda c: c.__setitem__("num_hidden_layers", "two")),
     r"config\.json.*num_hidden_layers"),
]

HF = COMMON + [
    ("sym-weight-zero-point", _set(P + "weight_zero_point", 3), r"q_proj.*weight_zero_point.*nonzero.*symmetric"),
    ("sym-input-zero-point", _set(P + "input_zero_point", -1), r"q_proj.*input_zero_point.*nonzero.*symmetric"),
    ("zero-point-removed", _pop(P + "weight_zero_point"), r"q_proj\.weight_zero_point' is missing"),
    ("quark-config-list", _qconfig(("global_quant_config",), [1]), r"global_quant_config"),
    ("qcore-config-bad", _qconfig(("qcore", "config"), {"layer": 3}), r"config\.json.*layer config: got 3"),
    ("quark-fields-disagree", _qconfig(("exclude",), ["lm_head", P[:-1]]),
     r"quantization_config\.exclude disagrees with the qcore block's config"),
    ("qcore-block-not-object", _qconfig(("qcore",), 5), r"quantization_config\.qcore must be a JSON object"),
    ("layouts-not-object", _qconfig(("qcore", "layouts"), 5), r"quantization_config\.qcore\.layouts must map"),
    ("export-not-object", _qconfig(("export",), 5), r"export: QuarkExport\.from_dict: expected a dict, got int"),
]

HF_ASYM = [
    ("weight-zp-fraction", _set(P + "weight_zero_point", 0.5), r"q_proj.*weight_zero_point.*not integers"),
    ("weight-zp-range", _set(P + "weight_zero_point", 5.0), r"q_proj.*weight_zero_point.*\[-2, 1\]"),
    ("weight-zp-nan", _set(P + "weight_zero_point", float("nan")), r"q_proj.*weight_zero_point.*not integers"),
    ("input-zp-fraction", _set(P + "input_zero_point", 1.25), r"q_proj.*input_zero_point.*not integers"),
    ("input-zp-range", _set(P + "input_zero_point", 100.0), r"q_proj.*input_zero_point.*\[-8, 7\]"),
    ("input-zp-inf", _set(P + "input_zero_point", float("-inf")), r"q_proj.*input_zero_point.*not integers"),
    ("weight-zp-removed", _pop(P + "weight_zero_point"), r"q_proj\.weight_zero_point' is missing"),
    ("input-zp-retyped", _retype(P + "input_zero_point", torch.int8), r"q_proj.*input_zero_point' is I8"),
]

CT = [c for c in COMMON if c[0] not in ("scale-retyped",)] + [
    ("sym-zero-point-added", _tensors(lambda sd: sd.__setitem__(P + "weight_zero_point",
                                                                torch.ones(1, dtype=torch.int8))),
     r"q_proj\.weight_zero_point' in model\.safetensors is not a tensor"),
    ("ct-config-groups", _qconfig(("config_groups",), [1]), r"config\.json.*config_groups"),
    ("pow2-scales-claimed", _qconfig(("qcore", "config", "layer", "weight", "spec", "pow2_scale"), True),
     r"q_proj'?: QTensor\.scales: this spec uses power-of-two scales"),
    ("ct-ignore-dropped", _qconfig(("ignore",), []),
     r"layer 'lm_head': matched by the compressed-tensors group 'group_0' \(not in quantization_config\.ignore\) "
     r"but its weight is float"),
    ("ct-qcore-not-object", _qconfig(("qcore",), 5), r"quantization_config\.qcore must be a JSON object"),
    ("ct-symmetric-flipped", _qconfig(("config_groups", "group_0", "weights", "symmetric"), False),
     r"q_proj.*the qcore config's weight spec .* is not the compressed-tensors group 'group_0'"),
]


def _ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize("name, edit, match", HF + [(f"asym-{n}", e, m) for n, e, m in HF_ASYM],
                         ids=_ids(HF) + [f"asym-{c[0]}" for c in HF_ASYM])
def test_from_pretrained_refuses(ckpts, tmp_path, name, edit, match):
    d = _copy(ckpts, "hf_asym" if name.startswith("asym-") else "hf_sym", tmp_path)
    edit(d)
    with pytest.raises(ValueError, match=match):
        A.from_pretrained(d)


@pytest.mark.parametrize("name, edit, match", CT, ids=_ids(CT))
def test_load_compressed_tensors_refuses(ckpts, tmp_path, name, edit, match):
    d = _copy(ckpts, "ct", tmp_path)
    edit(d)
    with pytest.raises(ValueError, match=match):
        load_compressed_tensors(d)


def test_the_unchanged_exports_load(ckpts):
    """The fixtures are sound: each check above fails for the corruption, not for the export."""
    A.from_pretrained(ckpts / "hf_sym")
    A.from_pretrained(ckpts / "hf_asym")
    load_compressed_tensors(ckpts / "ct")
    from_gguf(ckpts / "m.gguf")


BAD_ARGS = [  # from_pretrained's arguments, refused before any file is read
    (dict(directory=None), TypeError, r"directory must be a str or os\.PathLike, got NoneType"),
    (dict(device_map="cuda:99"), ValueError, r"device_map cuda:99: "),
    (dict(device_map={"": 99}), ValueError, r"device_map cuda:99: "),
    (dict(device_map="tpu"), ValueError, r"device_map tpu: not a torch device"),
]


@pytest.mark.parametrize("kw, exc, match", BAD_ARGS, ids=[str(i) for i in range(len(BAD_ARGS))])
def test_from_pretrained_refuses_bad_arguments(ckpts, kw, exc, match):
    kw = {"directory": ckpts / "hf_sym", **kw}
    with pytest.raises(exc, match=match):
        A.from_pretrained(kw.pop("directory"), **kw)


def test_the_unchanged_exports_convert_quietly(ckpts, tmp_path, capsys):
    """The CLI readers pass the sound exports too, and --no-progress silences transformers' loading bars."""
    for src, to in (("hf_sym", "gguf"), ("ct", "hf")):
        assert main(["convert", str(ckpts / src), str(tmp_path / src), "--to", to, "--no-progress"]) == 0
        assert "Loading weights" not in capsys.readouterr().err


def test_what_transformers_ignores_is_not_an_unexplained_tensor(ckpts, tmp_path):
    """A non-persistent buffer stored anyway (older files hold the rotary inv_freq) loads, as in transformers."""
    d = _copy(ckpts, "hf_sym", tmp_path)
    _tensors(lambda sd: sd.__setitem__("model.rotary_emb.inv_freq", torch.ones(8)))(d)
    A.from_pretrained(d)


def test_tied_output_head_may_be_absent_but_not_the_embedding(zoo, tmp_path):
    """A tied lm_head is written once (as the embedding): loading fills it from the embedding; without the
    embedding nothing fills either, and that is refused."""
    cfg = zoo.tiny_llama(0).config
    cfg.tie_word_embeddings = True
    m = transformers.LlamaForCausalLM(cfg).eval()
    A.quantize_model(m, A.preset("int8"), zoo.token_batches(1, seed=1), progress=False)
    A.freeze(m)
    A.export_hf(m, tmp_path / "t")
    A.from_pretrained(tmp_path / "t")
    _pop("model.embed_tokens.weight")(tmp_path / "t")
    with pytest.raises(ValueError, match=r"'(model\.embed_tokens|lm_head)\.weight'.*missing"):
        A.from_pretrained(tmp_path / "t")


# ----------------------------------------------------------------------------------------------------- GGUF


def _info_pos(data: bytes, name: str) -> int:
    """Where the tensor info of ``name`` starts (its length-prefixed name) in the header."""
    rec = struct.pack("<Q", len(name)) + name.encode()
    i = data.index(rec)
    return i + len(rec)  # at n_dims


def _gguf_patch(fn):
    def edit(f):
        data = bytearray(f.read_bytes())
        fn(data)
        f.write_bytes(bytes(data))
    return edit


def _set_offset(name, offset_of):
    """Point tensor ``name``'s data offset at ``offset_of(data)``."""
    def fn(data):
        i = _info_pos(data, name)
        nd = struct.unpack_from("<I", data, i)[0]
        at = i + 4 + 8 * nd + 4
        data[at:at + 8] = struct.pack("<Q", offset_of(data))
    return _gguf_patch(fn)


def _offset(data, name):
    i = _info_pos(data, name)
    nd = struct.unpack_from("<I", data, i)[0]
    return struct.unpack_from("<Q", data, i + 4 + 8 * nd + 4)[0]


def _set_type(name, type_id):
    def fn(data):
        i = _info_pos(data, name)
        nd = struct.unpack_from("<I", data, i)[0]
        struct.pack_into("<I", data, i + 4 + 8 * nd, type_id)
    return _gguf_patch(fn)


def _set_dims(name, dims):
    def fn(data):
        i = _info_pos(data, name)
        nd = struct.unpack_from("<I", data, i)[0]
        assert nd == len(dims)
        struct.pack_into(f"<{nd}Q", data, i + 4, *dims)
    return _gguf_patch(fn)


def _rename_gguf(name, new):
    assert len(new) == len(name)
    return _gguf_patch(lambda data: data.__setitem__(slice(data.index(name.encode()),
                                                           data.index(name.encode()) + len(name)), new.encode()))


def _header_u64(at, value):
    return _gguf_patch(lambda data: struct.pack_into("<Q", data, at, value))


def _first_key_length(value):
    return _header_u64(24, value)


def _gguf_truncate(n):
    def edit(f):
        f.write_bytes(f.read_bytes()[:-n])
    return edit


def _gguf_drop(name):
    """Rewrite the file without tensor ``name`` (metadata kept byte for byte, data re-laid out)."""
    def edit(f):
        data = f.read_bytes()
        spans = G.check_file(f)
        first = spans[0].name
        infos_at = data.index(struct.pack("<Q", len(first)) + first.encode())
        keep = [s for s in spans if s.name != name]
        head = bytearray(data[:infos_at])
        struct.pack_into("<Q", head, 8, len(keep))
        infos, blobs, off = bytearray(), bytearray(), 0
        for s in keep:
            infos += struct.pack("<Q", len(s.name)) + s.name.encode() + struct.pack("<I", len(s.dims))
            infos += struct.pack(f"<{len(s.dims)}Q", *s.dims) + struct.pack("<IQ", s.type_id, off)
            blob = data[s.begin:s.end]
            blob += b"\0" * (-len(blob) % 32)
            blobs += blob
            off += len(blob)
        out = head + infos
        out += b"\0" * (-len(out) % 32)
        f.write_bytes(bytes(out + blobs))
    return edit


def _nan_block(name):
    """The first Q4_0 block's fp16 scale d of ``name`` set to NaN."""
    def edit(f):
        s = next(s for s in G.check_file(f) if s.name == name)
        data = bytearray(f.read_bytes())
        data[s.begin:s.begin + 2] = np.float16("nan").tobytes()
        f.write_bytes(bytes(data))
    return edit


Q = "blk.0.attn_q.weight"
K = "blk.0.attn_k.weight"
GGUF = [
    ("truncated", _gguf_truncate(1000), r"m\.gguf.*tensor 'output\.weight'.*past the end"),
    ("truncated-header", _gguf_truncate(110_000), r"m\.gguf.*(needs|more than)"),
    ("overlap", _set_offset(K, lambda d: _offset(d, Q)), r"m\.gguf.*(attn_q|attn_k).*overlaps"),
    ("past-end", _set_offset(Q, lambda d: 1 << 40), r"m\.gguf.*'blk\.0\.attn_q\.weight'.*past the end"),
    ("misaligned", _set_offset(Q, lambda d: _offset(d, Q) + 4), r"'blk\.0\.attn_q\.weight'.*alignment"),
    ("gap", _set_offset("output.weight", lambda d: _offset(d, "output.weight") + 32),
     r"'output\.weight'.*(unaccounted|past the end)"),
    ("retyped", _set_type(Q, 8), r"m\.gguf.*(attn_q|attn_k).*overlaps"),
    ("retyped-float", _set_type("output_norm.weight", 1), r"output_norm\.weight"),
    ("unknown-type", _set_type(Q, 31), r"'blk\.0\.attn_q\.weight' has unknown ggml type 31"),
    ("reshaped", _set_dims(Q, (32, 128)), r"'blk\.0\.attn_q\.weight' has shape \[128, 32\]"),
    ("huge-tensor-count", _header_u64(8, 1 << 60), r"m\.gguf.*tensor count is 1152921504606846976"),
    ("huge-kv-count", _header_u64(16, 1 << 62), r"m\.gguf.*metadata entry count"),
    ("huge-string", _first_key_length(1 << 62), r"m\.gguf.*length of metadata key 0"),
    ("renamed", _rename_gguf(Q, "blk.0.attn_x.weight"), r"'blk\.0\.attn_x\.weight' has no place"),
    ("removed", _gguf_drop(Q), r"no tensor for \['model\.layers\.0\.self_attn\.q_proj\.weight'\]"),
    ("removed-norm", _gguf_drop("output_norm.weight"), r"no tensor for \['model\.norm\.weight'\]"),
    ("nan-scale", _nan_block(Q), r"blk\.0\.attn_q\.weight.*NaN"),
    ("bad-magic", _gguf_patch(lambda d: d.__setitem__(slice(0, 4), b"GGUX")), r"not a GGUF file"),
    ("bad-version", _header_u64(4, 99), r"GGUF version"),
]


@pytest.mark.parametrize("name, edit, match", GGUF, ids=_ids(GGUF))
def test_from_gguf_refuses(ckpts, tmp_path, name, edit, match):
    f = _copy(ckpts, "m.gguf", tmp_path)
    edit(f)
    with pytest.raises(ValueError, match=match):
        from_gguf(f)


def _raw_gguf(kv: bytes, n_kv: int = 1, n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kv


def _key(k: str) -> bytes:
    return struct.pack("<Q", len(k)) + k.encode()


RAW = [  # hand-written headers: what gguf-py would allocate or loop over before noticing
    ("array-length", _raw_gguf(_key("a") + struct.pack("<IIQ", 9, 4, 1 << 40)), r"length of array metadata 'a'"),
    ("string-array-length", _raw_gguf(_key("a") + struct.pack("<IIQ", 9, 8, 1 << 40)),
     r"length of array metadata 'a'"),
    ("string-value-length", _raw_gguf(_key("a") + struct.pack("<IQ", 8, 1 << 50)), r"length of metadata 'a'"),
    ("nested-arrays", _raw_gguf(_key("a") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 0)),
     r"array of arrays"),
    ("value-type", _raw_gguf(_key("a") + struct.pack("<I", 77)), r"unknown value type 77"),
    ("alignment", _raw_gguf(_key("general.alignment") + struct.pack("<II", 4, 3)), r"general\.alignment"),
    ("dims", _raw_gguf(_key("t") + struct.pack("<I", 9), n_kv=0, n_tensors=1) + b"\0" * 64,
     r"tensor 't' has 9 dimensions"),
    ("empty", b"", r"needs 4 bytes"),
]


@pytest.mark.parametrize("name, data, match", RAW, ids=_ids(RAW))
def test_gguf_check_file_refuses_before_allocating(tmp_path, name, data, match):
    f = tmp_path / "x.gguf"
    f.write_bytes(data)
    with pytest.raises(ValueError, match=match):
        G.check_file(f)


def test_gguf_check_file_reads_qcore_and_gguf_py_files(ckpts):
    spans = G.check_file(ckpts / "m.gguf")
    r = gguf.GGUFReader(ckpts / "m.gguf")
    assert [(s.name, s.type_id, s.end - s.begin) for s in spans] == \
        [(t.name, int(t.tensor_type), int(t.n_bytes)) for t in r.tensors]
    assert [s.begin for s in spans] == [int(t.data_offset) for t in r.tensors]


# ---------------------------------------------------------------------------------------------- float folders


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory, zoo):
    d = tmp_path_factory.mktemp("float") / "f"
    zoo.tiny_llama(0).save_pretrained(d)
    return d


def _cli(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    return code, err, lines


FLOAT = [
    ("pickles-only", lambda d: (d / "model.safetensors").unlink() or torch.save({}, d / "pytorch_model.bin"),
     r"no \.safetensors weights \(only pickled ones: \['pytorch_model\.bin'\]\)"),
    ("removed", _pop("model.norm.weight"), r"'model\.norm\.weight'.*(is missing|needs)"),
    ("extra", _add("model.extra"), r"'model\.extra'.* is not a tensor"),
    ("truncated", _truncate(100), r"truncated"),
    ("deep-config", _text(DEEP), r"nests too deeply"),
    ("safetensors-is-a-folder", lambda d: (d / "model.safetensors").unlink() or (d / "model.safetensors").mkdir(),
     r"model\.safetensors: a directory, not a safetensors file|has no \.safetensors weights"),
]
# what the command line also reads from a float folder (quantize_checkpoint takes no tokenizer)
FLOAT_CLI = FLOAT + [("tokenizer-malformed", lambda d: (d / "tokenizer.json").write_text("{"),
                      r"--model .*: its tokenizer \(tokenizer\.json\) cannot be read")]


@pytest.mark.parametrize("name, edit, match", FLOAT_CLI, ids=_ids(FLOAT_CLI))
def test_float_model_folders_are_checked(float_dir, tmp_path, capsys, name, edit, match):
    d = tmp_path / "f"
    shutil.copytree(float_dir, d)
    edit(d)
    code, err, lines = _cli(capsys, ["quantize", "--model", str(d), "--scheme", "int8", "--eval", "none",
                                     "--output", str(tmp_path / "out")])
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert re.search(match, lines[0]), lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, edit, match", FLOAT, ids=_ids(FLOAT))
def test_quantize_checkpoint_reads_float_folders_the_same_way(float_dir, zoo, tmp_path, name, edit, match):
    """The streaming quantizer (``qcore quantize --streaming``) reads float folders with the same checks."""
    d = tmp_path / "f"
    shutil.copytree(float_dir, d)
    edit(d)
    with pytest.raises(ValueError, match=match):
        A.quantize_checkpoint(d, tmp_path / "out", A.preset("int8"), zoo.token_batches(1, seed=1), progress=False)
    assert not (tmp_path / "out").exists()


GGUF_CLI = [c for c in GGUF if c[0] in ("truncated", "overlap", "huge-tensor-count", "huge-string", "bad-magic")]


@pytest.mark.parametrize("name, edit, match", GGUF_CLI, ids=_ids(GGUF_CLI))
def test_float_load_of_a_gguf_file_is_checked(ckpts, tmp_path, capsys, name, edit, match):
    """``qcore quantize/eval --model X.gguf`` (transformers' float GGUF load) checks the file first."""
    f = _copy(ckpts, "m.gguf", tmp_path)
    edit(f)
    code, err, lines = _cli(capsys, ["quantize", "--model", str(f), "--scheme", "int8", "--eval", "none",
                                     "--output", str(tmp_path / "out")])
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert re.search(match, lines[0]), lines[0]
    assert not (tmp_path / "out").exists()
    code, err, lines = _cli(capsys, ["inspect", str(f)])  # qcore inspect reads it through the same check
    assert code == 2 and len(lines) == 1 and "Traceback" not in err and re.search(match, lines[0]), err


# ------------------------------------------------------------------------------------------------------ CLI

CLI = ([("hf_sym", n, e, m) for n, e, m in HF] + [("hf_asym", n, e, m) for n, e, m in HF_ASYM]
       + [("ct", n, e, m) for n, e, m in CT] + [("m.gguf", n, e, m) for n, e, m in GGUF])


@pytest.mark.parametrize("src, name, edit, match", CLI, ids=[f"{c[0]}-{c[1]}" for c in CLI])
def test_convert_cli_exits_2_with_one_line(ckpts, tmp_path, capsys, src, name, edit, match):
    """``qcore convert`` reads through the loaders above: each corruption is exit code 2, one error line naming
    what is wrong, no traceback, and no destination written."""
    s = _copy(ckpts, src, tmp_path)
    edit(s)
    dst = tmp_path / "out"
    code, err, lines = _cli(capsys, ["convert", str(s), str(dst), "--to", "hf" if src == "m.gguf" else "gguf"])
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert re.search(match, lines[0]), lines[0]
    assert not dst.exists() and not (tmp_path / "out.gguf").exists()


def test_micro_exponent_shifts_are_never_stored_in_quarks_mx_layout(zoo, tmp_path):
    """An MXFP4 spec with shared micro-exponent shifts is written in qcore's layout, shifts included, and loads back
    exactly (Quark's mx layout has no tensor for them: the export was refused); a checkpoint whose config gains
    shifts while its tensors stay in the mx layout is refused at load (it loaded, then failed at the first
    forward)."""
    d = A.preset("mxfp4_weight_only").to_dict()
    d["layer"]["weight"]["spec"].update(subblock_shift_bits=1, subblock_size=2)
    m = _quantized(zoo, ModelConfig.from_dict(d))
    ids = zoo.token_batches(1, seed=2)[0]
    info = A.export_hf(m, tmp_path / "shifts")
    assert set(info.layers.values()) == {"qcore"}
    with torch.no_grad():
        assert torch.equal(A.from_pretrained(tmp_path / "shifts")(ids).logits, m(ids).logits)
    A.export_hf(_quantized(zoo, "mxfp4_weight_only"), tmp_path / "mx")
    c = json.loads((tmp_path / "mx" / "config.json").read_text())
    c["quantization_config"]["qcore"]["config"]["layer"]["weight"]["spec"]["subblock_shift_bits"] = 1
    (tmp_path / "mx" / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=r"layout 'mx', its config gives 'qcore'|no Quark spelling"):
        A.from_pretrained(tmp_path / "mx")


def _f16_llama(scale_dtype):
    c = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM._from_config(c, torch_dtype=torch.float16).eval()  # rotary buffers float32,
    spec = qcore.make_spec("int4", granularity=qcore.PerGroup(32, axis=1), scale_dtype=scale_dtype)  # as from_pretrained
    A.quantize_model(m, ModelConfig(LayerConfig(weight=spec)), progress=False)
    return m


@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
def test_a_float16_model_with_float16_scales_loads_back(tmp_path, scale_dtype):
    """Quark spells float16 scales of a float16 model scale_type "float" (the model's dtype): the loader reads the
    Quark fields in each model dtype, so qcore's own export loads back (it was refused as a disagreement, and
    ``qcore convert X.gguf DIR --to hf --dtype float16`` with it)."""
    m = _f16_llama(scale_dtype)
    A.export_hf(m, tmp_path / "o")
    q = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    assert q["global_quant_config"]["weight"]["scale_type"] == ("float" if scale_dtype == "float16" else "float32")
    back = A.from_pretrained(tmp_path / "o")
    ids = torch.arange(16).reshape(1, 16)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, m(ids).logits)
    q["global_quant_config"]["weight"]["scale_type"] = "bfloat16"  # a real disagreement is still refused
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    cfg["quantization_config"] = q
    (tmp_path / "o" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=r"global_quant_config\.weight\.scale_type disagrees with the qcore block"):
        A.from_pretrained(tmp_path / "o")

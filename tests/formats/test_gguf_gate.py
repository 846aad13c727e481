"""The GGUF loading gate, numpy only (``qcore.formats.gguf``): ``read_header`` (the structure: duplicate keys,
UTF-8, gguf-py's reserved prefix) and ``check_model_file`` (the model the file describes: every hyperparameter of
its type, in range and consistent with the tensors, before any reader allocates what a header number asks for;
an architecture no record describes refused), on files built byte by byte here; ``metadata_differences``; the
type tables against gguf-py's. The per-tensor match against the family records, and every loader behind the gate,
are tested in tests/adapters/io/test_gguf_loading_gate.py and test_gguf_fuzz.py."""

import re
import struct

import numpy as np
import pytest

from qcore.formats import gguf as G

U32, I32, F32, BOOL, STR, ARR, U64, F64 = 4, 5, 6, 7, 8, 9, 10, 12
_PACK = {0: "<B", 1: "<b", 2: "<H", 3: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q", 11: "<q",
         F64: "<d"}


def _val(vtype, v, item=None) -> bytes:
    """The stored bytes of a metadata value (after its type)."""
    if vtype == STR:
        b = v.encode() if isinstance(v, str) else v
        return struct.pack("<Q", len(b)) + b
    if vtype == ARR:
        return struct.pack("<IQ", item, len(v)) + b"".join(_val(item, x) for x in v)
    return struct.pack(_PACK[vtype], v)


def _kv(key, vtype, v, item=None):
    return (key, vtype, _val(vtype, v, item))


def _write(path, kvs, tensors, *, alignment=32):
    """A GGUF v3 file of ``kvs`` ``[(key, type, stored bytes)]`` and ``tensors`` ``[(name, ggml dims, type id,
    data bytes)]``, each tensor's data padded to the alignment."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)))
    for key, vtype, raw in kvs:
        k = key.encode() if isinstance(key, str) else key
        out += struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + raw
    blobs, off = bytearray(), 0
    for name, dims, tid, data in tensors:
        n = name.encode() if isinstance(name, str) else name
        out += struct.pack("<Q", len(n)) + n + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", tid, off)
        blob = data + b"\0" * (-len(data) % alignment)
        blobs += blob
        off += len(blob)
    out += b"\0" * (-len(out) % alignment)
    path.write_bytes(bytes(out + blobs))
    return path


HIDDEN, HEADS, KV, FFN, VOCAB, LAYERS = 32, 4, 2, 64, 64, 2


def _meta(**over):
    """A tiny llama's metadata; ``over``: key suffix (``attention.head_count``) -> (type, value) or None (drop)."""
    m = {"context_length": (U32, 64), "embedding_length": (U32, HIDDEN), "block_count": (U32, LAYERS),
         "feed_forward_length": (U32, FFN), "attention.head_count": (U32, HEADS),
         "attention.head_count_kv": (U32, KV), "rope.dimension_count": (U32, HIDDEN // HEADS),
         "rope.freq_base": (F32, 10000.0), "attention.layer_norm_rms_epsilon": (F32, 1e-5),
         "vocab_size": (U32, VOCAB)}
    for k, v in over.items():
        k = k.replace("__", ".")
        if v is None:
            m.pop(k, None)
        else:
            m[k] = v
    return [("general.architecture", STR, _val(STR, "llama")), ("general.name", STR, _val(STR, "tiny"))] + [
        (f"llama.{k}", t, _val(t, v)) for k, (t, v) in m.items()]


def _tok(n=VOCAB):
    return [_kv("tokenizer.ggml.model", STR, "gpt2"), _kv("tokenizer.ggml.tokens", ARR, [f"t{i}" for i in range(n)], STR),
            _kv("tokenizer.ggml.token_type", ARR, [1] * n, I32), _kv("tokenizer.ggml.eos_token_id", U32, 1)]


def _f32(*shape):
    return np.zeros(shape, np.float32).tobytes()


def _tensors(*, layers=LAYERS, q_rows=HIDDEN, vocab=VOCAB, hidden=HIDDEN):
    """The tiny llama's tensors (F32 zeros), ggml dims ([in, out])."""
    hd = HIDDEN // HEADS
    t = [("token_embd.weight", (hidden, vocab), 0, _f32(vocab, hidden))]
    for i in range(layers):
        t += [(f"blk.{i}.attn_norm.weight", (hidden,), 0, _f32(hidden)),
              (f"blk.{i}.attn_q.weight", (hidden, q_rows), 0, _f32(q_rows, hidden)),
              (f"blk.{i}.attn_k.weight", (hidden, KV * hd), 0, _f32(KV * hd, hidden)),
              (f"blk.{i}.attn_v.weight", (hidden, KV * hd), 0, _f32(KV * hd, hidden)),
              (f"blk.{i}.attn_output.weight", (hidden, hidden), 0, _f32(hidden, hidden)),
              (f"blk.{i}.ffn_norm.weight", (hidden,), 0, _f32(hidden)),
              (f"blk.{i}.ffn_gate.weight", (hidden, FFN), 0, _f32(FFN, hidden)),
              (f"blk.{i}.ffn_up.weight", (hidden, FFN), 0, _f32(FFN, hidden)),
              (f"blk.{i}.ffn_down.weight", (FFN, hidden), 0, _f32(hidden, FFN))]
    return t + [("output_norm.weight", (hidden,), 0, _f32(hidden))]


def test_the_tiny_file_passes_and_gives_its_config(tmp_path):
    m = G.check_model_file(_write(tmp_path / "m.gguf", _meta() + _tok(), _tensors()))
    assert (m.arch, m.experts) == ("llama", False)
    assert m.config["hidden_size"] == HIDDEN and m.config["num_key_value_heads"] == KV
    assert m.header.get("general.name") == "tiny" and m.header.fields["tokenizer.ggml.token_type"].describe() == \
        "array of 64 int32"
    assert G.check_file(tmp_path / "m.gguf") == m.header.tensors
    assert m.header.tensor("blk.0.attn_q.weight").shape == (HIDDEN, HIDDEN)


HUGE = 1 << 31
# (name, metadata edits, tokenizer, tensors, what the one-line error says)
MODEL = [
    ("zero-heads", dict(attention__head_count=(U32, 0)), None, None,
     r"'llama\.attention\.head_count' is 0; it must be at least 1"),
    ("zero-kv-heads", dict(attention__head_count_kv=(U32, 0)), None, None, r"head_count_kv' is 0"),
    ("kv-not-dividing", dict(attention__head_count_kv=(U32, 3)), None, None,
     r"head_count_kv' is 3; it must divide llama\.attention\.head_count \(4\)"),
    ("heads-not-dividing", dict(attention__head_count=(U32, 3), attention__head_count_kv=(U32, 3)), None, None,
     r"head_count' is 3; it must divide llama\.embedding_length \(32\)"),
    ("huge-heads", dict(attention__head_count=(U32, 0xFFFFFFFF)), None, None, r"head_count_kv' is 2; it must divide"),
    ("huge-embedding", dict(embedding_length=(U32, HUGE)), None, None,
     r"'llama\.embedding_length' is 2147483648; tensor 'token_embd\.weight' has \[64, 32\]"),
    ("huge-blocks", dict(block_count=(U32, HUGE)), None, None,
     r"'llama\.block_count' is 2147483648; the file's tensors are of layers 0\.\.1"),
    ("too-few-blocks", dict(block_count=(U32, 1)), None, None, r"block_count' is 1; the file's tensors are of layers"),
    ("zero-blocks", dict(block_count=(U32, 0)), None, None, r"block_count' is 0; it must be at least 1"),
    ("vocab", dict(vocab_size=(U32, 1000)), None, None, r"vocab_size' is 1000; tensor 'token_embd\.weight' has 64 rows"),
    ("zero-context", dict(context_length=(U32, 0)), None, None, r"context_length' is 0"),
    ("zero-eps", dict(attention__layer_norm_rms_epsilon=(F32, 0.0)), None, None,
     r"layer_norm_rms_epsilon' is 0\.0; it must be finite and > 0"),
    ("nan-eps", dict(attention__layer_norm_rms_epsilon=(F32, float("nan"))), None, None, r"epsilon' is nan"),
    ("inf-rope", dict(rope__freq_base=(F32, float("inf"))), None, None, r"freq_base' is inf; it must be finite"),
    ("negative-rope", dict(rope__freq_base=(F32, -1.0)), None, None, r"freq_base' is -1\.0"),
    ("string-count", dict(block_count=(STR, "2")), None, None,
     r"'llama\.block_count' is string '2'; qcore and llama\.cpp read it as one .*uint32"),
    ("float-count", dict(attention__head_count=(F32, 4.0)), None, None, r"head_count' is float32 4\.0"),
    ("int-eps", dict(attention__layer_norm_rms_epsilon=(U32, 1)), None, None, r"epsilon' is uint32 1; .* float32"),
    ("rope-dims", dict(rope__dimension_count=(U32, 64)), None, None,
     r"rope\.dimension_count' is 64; it must be at most the head size 8"),
    ("partial-rope", dict(rope__dimension_count=(U32, 4)), None, None, r"rope\.dimension_count is 4 for heads of 8"),
    ("value-length", dict(attention__value_length=(U32, 16)), None, None, r"value_length' is 16, the head size is 8"),
    ("key-length", dict(attention__key_length=(U32, 1 << 30)), None, None,
     r"tensor 'blk\.0\.attn_q\.weight' has shape \[32, 32\]; .* = 4294967296 rows"),
    ("no-embedding-length", dict(embedding_length=None), None, None, r"no llama\.embedding_length metadata"),
    ("no-ffn", dict(feed_forward_length=None), None, None, r"no llama\.feed_forward_length metadata"),
    ("linear-rope-no-factor", dict(rope__scaling__type=(STR, "linear")), None, None,
     r"rope\.scaling\.type' is 'linear' but the file has no llama\.rope\.scaling\.factor"),
    ("yarn-rope", dict(rope__scaling__type=(STR, "yarn")), None, None, r"rope\.scaling\.type is 'yarn'"),
    ("tokens-vs-vocab", {}, _tok(60), None, r"'tokenizer\.ggml\.tokens' has 60 tokens; tensor 'token_embd\.weight' "
                                            r"has 64 rows"),
    ("token-id", {}, _tok() + [_kv("tokenizer.ggml.bos_token_id", U32, 64)], None,
     r"'tokenizer\.ggml\.bos_token_id' is uint32 64; a token id is an integer below the vocabulary size 64"),
    ("token-types", {}, _tok()[:2] + [_kv("tokenizer.ggml.token_type", ARR, [1] * 3, I32)], None,
     r"'tokenizer\.ggml\.token_type' has 3 entries for 64 tokens"),
    ("tokens-of-ints", {}, [_kv("tokenizer.ggml.tokens", ARR, list(range(VOCAB)), U32)], None,
     r"'tokenizer\.ggml\.tokens' is array of 64 uint32; readers expect an array of string"),
    ("flag", {}, [_kv("tokenizer.ggml.add_bos_token", U32, 1)], None, r"add_bos_token' is uint32 1; .* bool"),
    ("no-embedding", {}, None, [t for t in _tensors() if t[0] != "token_embd.weight"], r"no tensor 'token_embd"),
    ("missing-layer", {}, None, [t for t in _tensors(layers=3) if not t[0].startswith("blk.1.")],
     r"block_count' is 2; the file's tensors are of layers 0, 2"),
    ("q-rows", {}, None, _tensors(q_rows=48), r"'blk\.0\.attn_q\.weight' has shape \[48, 32\]; the metadata gives "
                                               r"head_count x the head size = 32 rows"),
    ("embedding-1d", {}, None, [("token_embd.weight", (HIDDEN * VOCAB,), 0, _f32(HIDDEN * VOCAB))] + _tensors()[1:],
     r"'token_embd\.weight' has shape \[2048\]; the llama model needs a 2-D tensor"),
]


@pytest.mark.parametrize("name, meta, tok, tensors, match", MODEL, ids=[c[0] for c in MODEL])
def test_check_model_file_refuses_before_any_model_is_built(tmp_path, name, meta, tok, tensors, match):
    f = _write(tmp_path / "m.gguf", _meta(**meta) + (tok if tok is not None else _tok()),
               tensors if tensors is not None else _tensors())
    with pytest.raises(ValueError, match=match) as e:
        G.check_model_file(f)
    assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_architectures_no_record_describes_are_refused(tmp_path):
    kvs = [_kv("general.architecture", STR, "falcon")] + _meta()[2:]
    with pytest.raises(ValueError, match=r"general\.architecture is 'falcon'; qcore reads GGUF models of .*\['gemma', "
                                         r".*'qwen3moe'\] .*a missing one would be randomly initialised"):
        G.check_model_file(_write(tmp_path / "f.gguf", kvs, _tensors()))
    with pytest.raises(ValueError, match=r"no general\.architecture metadata: not a model"):
        G.check_model_file(_write(tmp_path / "n.gguf", _meta()[1:], _tensors()))
    with pytest.raises(ValueError, match=r"'general\.architecture' is uint32 7; readers expect string"):
        G.check_model_file(_write(tmp_path / "t.gguf", [_kv("general.architecture", U32, 7)] + _meta()[1:],
                                  _tensors()))


HEADER = [  # the structure: what gguf-py would keep under a made-up name, or fail to decode
    ("duplicate-key", _meta() + [_kv("llama.attention.head_count", U32, 8)], _tensors(),
     r"metadata key 'llama\.attention\.head_count' appears twice"),
    ("reserved-key", _meta() + [_kv("GGUF.version", U32, 3)], _tensors(), r"'GGUF\.version': the GGUF\. prefix"),
    ("key-not-utf8", _meta() + [(b"general.\xff", U32, _val(U32, 1))], _tensors(),
     r"metadata key 12 is not UTF-8 text"),
    ("value-not-utf8", _meta() + [("general.license", STR, _val(STR, b"MIT\xc3"))], _tensors(),
     r"metadata 'general\.license' is not UTF-8 text"),
    ("token-not-utf8", _meta() + [("tokenizer.ggml.tokens", ARR, struct.pack("<IQ", STR, 1) + _val(STR, b"\xfe"))],
     _tensors(), r"metadata 'tokenizer\.ggml\.tokens'\[0\] is not UTF-8 text"),
    ("name-not-utf8", _meta(), [(b"blk.0.\xe9", (4,), 0, _f32(4))], r"the name of tensor 0 is not UTF-8 text"),
    ("alignment-type", _meta() + [_kv("general.alignment", U64, 32)], _tensors(),
     r"'general\.alignment' must be a uint32 power of two, got uint64 32"),
]


@pytest.mark.parametrize("name, kvs, tensors, match", HEADER, ids=[c[0] for c in HEADER])
def test_read_header_refuses(tmp_path, name, kvs, tensors, match):
    f = _write(tmp_path / "h.gguf", kvs, tensors)
    for fn in (G.read_header, G.check_file, G.check_model_file):
        with pytest.raises(ValueError, match=match) as e:
            fn(f)
        assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_header_values_and_raw_bytes(tmp_path):
    kvs = _meta() + [_kv("general.languages", ARR, ["en", "fr"], STR), _kv("x.f64", F64, 0.1),
                     _kv("x.flags", ARR, [True, False], BOOL), _kv("x.neg", I32, -3)]
    h = G.read_header(_write(tmp_path / "v.gguf", kvs, _tensors()))
    assert h.get("general.languages") == ("en", "fr") and h.get("x.f64") == 0.1 and h.get("x.neg") == -3
    assert h.get("x.flags").tolist() == [True, False] and h.get("absent", 5) == 5
    assert {k: f.raw for k, f in h.fields.items()} == {k: raw for k, _, raw in kvs}
    assert h.fields["general.languages"].item_type == STR and h.fields["x.neg"].describe() == "int32 -3"
    assert list(h.fields) == [k for k, _, _ in kvs]


def test_metadata_differences(tmp_path):
    a = _write(tmp_path / "a.gguf", _meta() + _tok(), _tensors())
    same = _write(tmp_path / "same.gguf", list(reversed(_meta())) + _tok(), _tensors()[:3] + _tensors()[3:])
    assert G.metadata_differences(a, same) == ()
    b = _write(tmp_path / "b.gguf", _meta(rope__freq_base=(F32, 5e5), vocab_size=None) + _tok()
               + [_kv("general.license", STR, "mit")], _tensors())
    d = G.metadata_differences(a, G.read_header(b))
    assert [(x.key, x.a, x.b) for x in d] == [
        ("llama.rope.freq_base", "float32 10000.0", "float32 500000.0"), ("llama.vocab_size", "uint32 64", None),
        ("general.license", None, "string 'mit'")]
    assert str(d[1]) == "llama.vocab_size: uint32 64 -> absent"
    c = _write(tmp_path / "c.gguf", _meta(block_count=(U64, LAYERS)) + _tok(), _tensors())  # same value, other type
    assert [x.key for x in G.metadata_differences(a, c)] == ["llama.block_count"]


def test_type_tables_are_gguf_pys():
    gguf = pytest.importorskip("gguf")
    assert G.GGML_NAMES == {int(t): t.name for t in gguf.GGMLQuantizationType}
    assert set(G.GGML_NAMES) == set(G.GGML_SIZES)
    assert G.VALUE_TYPES == {int(t): t.name.lower() for t in gguf.GGUFValueType}
    from gguf.quants import _type_traits
    assert set(G.WEIGHT_TYPES) == {int(t) for t in _type_traits} | {0, 1}  # what gguf.quants.dequantize reads


def test_gate_reads_the_header_only(tmp_path):
    """A file whose every tensor lies in its data region is checked from its header (the data is not read): the
    gate takes the same time for tensors of any size."""
    f = _write(tmp_path / "m.gguf", _meta() + _tok(), _tensors())
    data = f.read_bytes()
    tail = len(data) - G.read_header(f).data_start
    f.write_bytes(data[:-tail] + b"\x7f" * tail)  # every data byte changed: the header gate cannot tell
    assert G.check_model_file(f).config["hidden_size"] == HIDDEN
    assert re.fullmatch(r"blk\.0\.attn_norm\.weight", G.check_file(f)[1].name)

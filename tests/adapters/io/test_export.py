"""Quark HF export and reload (``qcore.adapters.export_hf`` / ``from_pretrained`` / ``load_quark``): round trips
per scheme with equal logits, Quark-written checkpoints read without amd-quark, determinism, atomicity, sharding,
corruption and the errors."""

import dataclasses
import json
import pathlib
import shutil
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qcore  # noqa: E402
import qcore.adapters as A  # noqa: E402
from qcore.adapters.io import common as E  # noqa: E402  (the shards are written there)
from qcore.formats.inspect import inspect_checkpoint  # noqa: E402
from qcore.formats.safetensors_io import CorruptCheckpointError, SafetensorsFile  # noqa: E402

QUARK_EXPORTS = pathlib.Path(__file__).resolve().parents[2] / "formats" / "data" / "quark_exports"


def llama(seed=0, hidden=128):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


IDS = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
CALIB = [IDS[:, :20], IDS[:, 20:]]

# preset -> the layout its Linears are written in (Quark's, or qcore's extension)
SCHEMES = {
    "uint4_wo_128": "int4_group", "int4_wo_64": "int4_group", "int8": "int8", "fp8": "fp8", "ptpc_fp8": "fp8",
    "w_int8_per_channel_sym": "int8", "w_uint4_per_group_asym": "int4_group", "mxfp4": "mx", "mxfp6_e2m3": "mx",
    "mxfp6_e3m2": "mx", "mxfp4_fp8": "mx", "nvfp4": "nvfp4", "w_int8_a_int8_per_token_dynamic": "int8",
    "w_mx9_a_mx9": "qcore", "w_mx6_a_mx6": "qcore", "w_bfp16_a_bfp16": "qcore", "w_mxint8_a_mxint8": "qcore",
    "w_int2_per_group_asym": "qcore", "mx9": "qcore",
}


def quantized(scheme, *, kv=None, seed=0, freeze=True, **kw):
    m = llama(seed)
    cfg = A.preset(scheme, kv_cache=kv, **kw) if kv else A.preset(scheme, **kw)
    A.quantize_model(m, cfg, CALIB, progress=False)
    if freeze:
        A.freeze(m)
    return m


def logits(m):
    with torch.no_grad():
        return m(IDS).logits


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_export_reload_gives_identical_logits(scheme, tmp_path):
    m = quantized(scheme)
    ref = logits(m)
    info = A.export_hf(m, tmp_path / "ckpt")
    assert set(info.layers.values()) == {SCHEMES[scheme]}
    assert info.quant_method == ("qcore" if SCHEMES[scheme] == "qcore" else "quark")
    back = A.from_pretrained(tmp_path / "ckpt")
    assert isinstance(back.model.layers[0].mlp.down_proj, A.QuantLinear) and back.model.layers[0].mlp.down_proj.frozen
    assert torch.equal(logits(back), ref)
    desc = inspect_checkpoint(tmp_path / "ckpt")
    assert desc["quantized_layers"] == 14 and desc["quant_method"] == info.quant_method
    if SCHEMES[scheme] == "qcore":  # our method name loads through transformers' own entry point too
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
        assert torch.equal(logits(plain), ref)



@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
def test_16_bit_scales_are_stored_whole(scale_dtype, tmp_path):
    """qcore's layout stores float16 / bfloat16 scales as F16 / BF16 values (they were once cut to U8 codes)."""
    from qcore import PerGroup
    spec = qcore.make_spec("int4", granularity=PerGroup(32, axis=-1), scale_dtype=scale_dtype)
    m = llama()
    A.quantize_model(m, A.ModelConfig(A.LayerConfig(weight=spec)), CALIB, progress=False)
    A.freeze(m)
    info = A.export_hf(m, tmp_path / "ckpt")
    assert set(info.layers.values()) == {"qcore"}
    st = SafetensorsFile(tmp_path / "ckpt" / "model.safetensors")
    assert st.entries["model.layers.0.mlp.up_proj.weight_scale"].dtype == {"float16": "F16", "bfloat16": "BF16"}[
        scale_dtype]
    back = A.from_pretrained(tmp_path / "ckpt")
    assert torch.equal(logits(back), logits(m))
    assert torch.equal(back.model.layers[0].mlp.up_proj.weight_scale, m.model.layers[0].mlp.up_proj.weight_scale)


@pytest.mark.parametrize("pack_method", ["order", "reorder"])
def test_pack_method_is_used_for_the_nibbles_not_only_named(pack_method, tmp_path):
    """export_hf(pack_method="order") once wrote "order" in the config but packed the nibbles in Quark's
    "reorder" order, so the reloaded model computed with shuffled weights."""
    m = quantized("uint4_wo_128")
    A.export_hf(m, tmp_path / "ckpt", pack_method=pack_method)
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]["export"][
        "pack_method"] == pack_method
    assert torch.equal(logits(A.from_pretrained(tmp_path / "ckpt")), logits(m))

def test_kv_cache_scales_are_written_and_reloaded(tmp_path):
    m = quantized("fp8", kv="fp8")
    ref = logits(m)
    A.export_hf(m, tmp_path / "c")
    st = SafetensorsFile(tmp_path / "c" / "model.safetensors")
    assert st.entries["model.layers.0.self_attn.k_proj.output_scale"].dtype == "F32"
    assert "model.layers.0.self_attn.q_proj.output_scale" not in st
    qc = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert qc["export"]["kv_cache_group"] == ["*k_proj", "*v_proj"] and "*k_proj" in qc["kv_cache_quant_config"]
    assert torch.equal(logits(A.from_pretrained(tmp_path / "c")), ref)


def test_unfrozen_model_exports_the_same_bytes_as_frozen(tmp_path):
    a, b = quantized("uint4_wo_128", freeze=False), quantized("uint4_wo_128")
    A.export_hf(a, tmp_path / "a")
    A.export_hf(b, tmp_path / "b")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_export_is_deterministic(tmp_path):
    for d in ("x", "y"):
        A.export_hf(quantized("mxfp4"), tmp_path / d)
    for f in (tmp_path / "x").iterdir():
        assert f.read_bytes() == (tmp_path / "y" / f.name).read_bytes(), f.name


def test_tied_embedding_is_written_once(tmp_path):
    m = llama()
    m.config.tie_word_embeddings = True
    m.lm_head.weight = m.model.embed_tokens.weight
    A.quantize_model(m, A.preset("int8"), CALIB, progress=False)
    A.export_hf(m, tmp_path / "t")
    st = SafetensorsFile(tmp_path / "t" / "model.safetensors")
    assert "model.embed_tokens.weight" in st and "lm_head.weight" not in st
    assert torch.equal(logits(A.from_pretrained(tmp_path / "t")), logits(m))


def test_shards_with_an_index(tmp_path):
    m = quantized("int8")
    info = A.export_hf(m, tmp_path / "s", max_shard_size=100_000)
    shards = sorted(p.name for p in (tmp_path / "s").glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert all(SafetensorsFile(tmp_path / "s" / f).entries for f in shards)
    assert info.files == tuple(sorted(p.name for p in (tmp_path / "s").iterdir()))
    assert torch.equal(logits(A.from_pretrained(tmp_path / "s")), logits(m))


def test_interrupted_export_leaves_nothing(tmp_path, monkeypatch):
    m = quantized("int8")
    calls = []

    def boom(path, records, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(path, records, metadata)

    real = E.write_file
    monkeypatch.setattr(E, "write_file", boom)
    with pytest.raises(KeyboardInterrupt):
        A.export_hf(m, tmp_path / "out", max_shard_size=200_000)
    assert list(tmp_path.iterdir()) == []  # neither the destination nor a partial directory
    # an existing checkpoint survives an interrupted --overwrite untouched
    monkeypatch.setattr(E, "write_file", real)
    A.export_hf(m, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    calls.clear()
    monkeypatch.setattr(E, "write_file", boom)
    with pytest.raises(KeyboardInterrupt):
        A.export_hf(quantized("mxfp4"), tmp_path / "out", overwrite=True, max_shard_size=200_000)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_existing_directory_needs_overwrite(tmp_path):
    m = quantized("int8")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite"):
        A.export_hf(m, tmp_path / "d")
    assert (tmp_path / "d" / "keep.txt").read_text() == "x"
    A.export_hf(m, tmp_path / "d", overwrite=True)
    assert not (tmp_path / "d" / "keep.txt").exists() and (tmp_path / "d" / "model.safetensors").is_file()


@pytest.mark.parametrize("kwargs, err, match", [
    ({"pack_method": "zigzag"}, ValueError, "pack_method"),
    ({"max_shard_size": "lots"}, ValueError, "max_shard_size"),
    ({"max_shard_size": 0}, ValueError, "positive"),
    ({"overwrite": "yes"}, TypeError, "overwrite"),
])
def test_bad_export_arguments(kwargs, err, match, tmp_path):
    with pytest.raises(err, match=match):
        A.export_hf(quantized("int8"), tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


def test_float_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="qcore config|no qcore quantized"):
        A.export_hf(llama(), tmp_path / "x")


# ------------------------------------------------------------------------------------------------ corruption


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("good") / "c"
    A.export_hf(quantized("mxfp4"), d)
    return d


def _copy(good, tmp_path):
    d = tmp_path / "c"
    shutil.copytree(good, d)
    return d


def test_truncated_file_fails_naming_the_tensor(good_ckpt, tmp_path):
    d = _copy(good_ckpt, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    with pytest.raises(CorruptCheckpointError, match="truncated.*tensor"):
        A.from_pretrained(d)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        inspect_checkpoint(d)


def _rewrite_header(f, fn):
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    head = json.loads(data[8:8 + n])
    fn(head)
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])


def test_wrong_shape_fails_naming_layer_and_tensor(good_ckpt, tmp_path):
    d = _copy(good_ckpt, tmp_path)
    key = "model.layers.1.mlp.up_proj.weight_scale"

    def edit(h):
        h[key]["shape"] = [h[key]["shape"][1], h[key]["shape"][0]]
    _rewrite_header(d / "model.safetensors", edit)
    with pytest.raises(CorruptCheckpointError, match=r"layer 'model.layers.1.mlp.up_proj'.*weight_scale"):
        A.from_pretrained(d)


def test_missing_tensor_fails(good_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file
    d = _copy(good_ckpt, tmp_path)
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.0.self_attn.v_proj.weight_scale"]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CorruptCheckpointError, match="v_proj.weight_scale' is missing"):
        A.from_pretrained(d)


def test_config_must_describe_the_model(tmp_path):
    m = quantized("mxfp4")
    cfg = m.qcore_config.replace(by_name={"model.layers.0.self_attn.v_proj": None})
    with pytest.raises(ValueError, match="v_proj' is quantized in the model but the config gives float"):
        A.export_hf(m, tmp_path / "x", config=cfg)
    assert not (tmp_path / "x").exists()


def _poke(f, key, value: bytes):
    st = SafetensorsFile(f)
    e = st.entries[key]
    data = bytearray(f.read_bytes())
    data[st.data_start + e.begin:st.data_start + e.begin + len(value)] = value
    f.write_bytes(bytes(data))


def test_e8m0_nan_scale_fails(good_ckpt, tmp_path):
    d = _copy(good_ckpt, tmp_path)
    _poke(d / "model.safetensors", "model.layers.0.mlp.gate_proj.weight_scale", b"\xff")
    with pytest.raises(CorruptCheckpointError, match="gate_proj.*NaN code 255"):
        A.from_pretrained(d)


def test_nan_float_scale_fails(tmp_path):
    A.export_hf(quantized("int8"), tmp_path / "c")
    _poke(tmp_path / "c" / "model.safetensors", "model.layers.0.self_attn.o_proj.input_scale",
          np.float32("nan").tobytes())
    with pytest.raises(CorruptCheckpointError, match="o_proj.*input_scale"):
        A.from_pretrained(tmp_path / "c")


def test_not_a_quantized_checkpoint(tmp_path):
    llama().save_pretrained(tmp_path / "f")
    with pytest.raises(ValueError, match="quant_method is None"):
        A.from_pretrained(tmp_path / "f")


# ------------------------------------------------------------------------------- Quark-written checkpoints


@pytest.mark.parametrize("name", sorted(p.name for p in QUARK_EXPORTS.iterdir()) if QUARK_EXPORTS.is_dir() else [])
def test_reads_quark_written_checkpoints_like_quark(name):
    """Checkpoints exported by amd-quark 0.13 (``make_quark_exports.py``) load without amd-quark, and give the
    logits Quark's own loader computed from them."""
    d = QUARK_EXPORTS / name
    m = A.load_quark(d)
    assert sum(isinstance(x, A.QuantLinear) for x in m.modules()) == 7
    with torch.no_grad():
        got = m(torch.from_numpy(np.load(d / "ids.npy"))).logits.numpy()
    ref = np.load(d / "quark_logits.npy")
    assert np.abs(got - ref).max() <= 1e-5 * (ref.max() - ref.min())
    desc = inspect_checkpoint(d)
    assert desc["written_by"] == "AMD Quark 0.13" and desc["quantized_layers"] == 7


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
def test_16_bit_scales_in_qcore_layout_round_trip(scale_dtype, model_dtype, tmp_path):
    """Groups of 32 with float16 / bfloat16 scales (the GGUF-exact grids) are stored as F16 / BF16 values (they
    were once truncated to one byte); reload gives the same logits, also in a bfloat16 model."""
    import qcore
    spec = qcore.make_spec("uint4", granularity=qcore.PerGroup(32, axis=-1), scale_dtype=scale_dtype,
                           symmetric=False)
    m = llama(0).to(model_dtype)
    A.quantize_model(m, A.ModelConfig(A.LayerConfig(weight=spec)), CALIB, progress=False)
    A.freeze(m)
    ref = logits(m)
    info = A.export_hf(m, tmp_path / "ckpt")
    assert set(info.layers.values()) == {"qcore"}
    hdr = SafetensorsFile(tmp_path / "ckpt" / "model.safetensors").entries
    assert hdr["model.layers.0.mlp.up_proj.weight_scale"].dtype == {"float16": "F16", "bfloat16": "BF16"}[scale_dtype]
    back = A.from_pretrained(tmp_path / "ckpt")
    if model_dtype == torch.float32:  # (a bf16 cast of the float model also casts its rotary buffer; a loaded one not)
        assert torch.equal(logits(back), ref)
    qs, qb = A.quantized_modules(m), A.quantized_modules(back)
    assert set(qs) == set(qb) and len(qs) == 14
    for name, q in qs.items():
        assert torch.equal(q.weight_scale, qb[name].weight_scale), name
        assert torch.equal(q._w(), qb[name]._w()) and q._w().dtype == model_dtype, name


@pytest.mark.parametrize("scheme,obs", [("nvfp4", "four_over_six"), ("w_mxfp4_a_mxfp4", "exponent_search")])
def test_searched_weight_scales_export_and_reload(scheme, obs, tmp_path):
    """FourOverSix (NVFP4: E4M3 block scales under the tensor scale amax / (6 * 256)) and ExponentSearch (MX: E8M0
    exponents) are ordinary scales of the spec: Quark's layout and spelling are unchanged, the checkpoint reloads
    with the same scales, tensor scale and logits, and qcore's own config block keeps the observer."""
    base = A.preset(scheme)
    weight = A.TensorConfig(base.layer.weight.spec, observer=A.FourOverSix() if obs == "four_over_six" else
                            A.ExponentSearch())
    cfg = base.replace(layer=dataclasses.replace(base.layer, weight=weight))
    m = llama()
    w_amax = m.model.layers[1].mlp.down_proj.weight.detach().abs().max().item()
    A.quantize_model(m, cfg, CALIB, progress=False)
    A.freeze(m)
    ref = logits(m)
    info = A.export_hf(m, tmp_path / "ckpt")
    assert set(info.layers.values()) == {SCHEMES.get(scheme, "mx")} and info.quant_method == "quark"
    qc = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert qc["qcore"]["config"]["layer"]["weight"]["observer"]["kind"] == obs
    assert qc["global_quant_config"] == base.to_quark()["global_quant_config"]
    back = A.from_pretrained(tmp_path / "ckpt")
    assert torch.equal(logits(back), ref)
    a, b = m.model.layers[1].mlp.down_proj, back.model.layers[1].mlp.down_proj
    assert torch.equal(a.weight_scale, b.weight_scale)
    if obs == "four_over_six":
        assert float(a.weight_tensor_scale) == float(np.float32(w_amax) / np.float32(6 * 256))
        assert torch.equal(a.weight_tensor_scale, b.weight_tensor_scale)
        assert float(a.weight_scale.max()) <= 384.0  # room for "max -> 4" under the 4/6 tensor scale
    assert back.qcore_config == cfg

"""export_compressed_tensors / load_compressed_tensors on tiny random Llamas.

(a) transformers with the compressed-tensors package loads each export (decompressing on CPU) with logits equal
to the in-memory model (exact for float32 models; the KV-cache schemes within 3% of the largest logit: keys are
quantized after RoPE there, before RoPE in qcore); (b) compressed-tensors' own ModelCompressor, given the same
fake-quantized weights and scales, writes the same tensors byte for byte; (c) qcore's importer loads qcore's
exports and compressed-tensors' own checkpoints with logits equal to the in-memory model; (d) determinism,
atomicity, errors naming the tensor. Tests that need the compressed_tensors package are marked ``ct_client``."""

import json
import pathlib

import numpy as np
import pytest
import torch

import qcore
from qcore import PerBlock, PerChannel, PerGroup

transformers = pytest.importorskip("transformers")

from qcore.adapters import freeze, quantize_model  # noqa: E402
from qcore.adapters.config import KVCacheConfig, LayerConfig, ModelConfig, TensorConfig  # noqa: E402
from qcore.adapters.io.compressed_tensors import export_compressed_tensors  # noqa: E402
from qcore.adapters.io.compressed_tensors import load_compressed_tensors  # noqa: E402
from qcore.adapters.presets import preset  # noqa: E402
from qcore.formats.safetensors_io import CorruptCheckpointError, SafetensorsFile  # noqa: E402


def _llama(seed=0, wide=False, dtype=torch.float32):
    h, i = (128, 256) if wide else (64, 128)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=h, intermediate_size=i, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval().to(dtype)


def _fp8_channel_static_kv():
    return ModelConfig(LayerConfig(weight=qcore.make_spec("float8_e4m3fn", granularity=PerChannel(0)),
                                   input=qcore.make_spec("float8_e4m3fn")), kv_cache=KVCacheConfig())


SCHEMES = {  # name: (config, wide model, weight-only, KV cache)
    "w4a16_sym_g32": (lambda: ModelConfig(LayerConfig(weight=qcore.make_spec("int4", granularity=PerGroup(32, 1)))),
                      False, True, False),
    "w4a16_sym_g128": (lambda: preset("int4_wo_128"), True, True, False),
    "w4a16_asym_g32": (lambda: preset("uint4_wo_32"), False, True, False),
    "w4a16_asym_g128": (lambda: preset("uint4_wo_128"), True, True, False),
    "w8a8_int8_static": (lambda: preset("w_int8_a_int8_per_tensor_sym"), False, False, False),
    "w8a8_int8_dynamic_token": (lambda: preset("w_int8_a_int8_per_token_dynamic"), False, False, False),
    "fp8_tensor_static_kv": (lambda: preset("fp8", kv_cache="fp8"), False, False, True),
    "fp8_channel_dynamic_token": (lambda: preset("ptpc_fp8"), False, False, False),
    "fp8_channel_static_kv": (_fp8_channel_static_kv, False, False, True),
    "mxfp4_weight_only": (lambda: preset("mxfp4_weight_only"), False, True, False),
    "fp8_block_dynamic": (lambda: ModelConfig(LayerConfig(
        weight=qcore.make_spec("float8_e4m3fn", granularity=PerBlock((32, 32), axes=(0, 1))),
        input=TensorConfig("float8_e4m3fn", dynamic=True))), False, False, False),
    "fp8_weight_only": (lambda: ModelConfig(LayerConfig(weight=qcore.make_spec("float8_e4m3fn",
                                                                               granularity=PerChannel(0)))),
                        False, True, False),
    "w8a8_uint8_static_asym": (lambda: ModelConfig(LayerConfig(
        weight=qcore.make_spec("int8", granularity=PerChannel(0)), input=qcore.make_spec("uint8"))),
        False, False, False),
    "w8a16_asym_channel": (lambda: ModelConfig(LayerConfig(weight=qcore.make_spec("uint8",
                                                                                  granularity=PerChannel(0)))),
                           False, True, False),
}

FORMATS = {"w4a16": "pack-quantized", "w8a8": "int-quantized", "fp8": "float-quantized",
           "mxfp4": "mxfp4-pack-quantized", "fp8_weight_only": "naive-quantized", "w8a16": "pack-quantized"}


def _format(name):
    return FORMATS.get(name) or FORMATS.get("_".join(name.split("_")[:3])) or FORMATS[name.split("_")[0]]

_CALIB = [torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(3)]
_IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(99))


def _quantized(name, *, seed=0, dtype=torch.float32):
    cfg, wide, _, _ = SCHEMES[name]
    m = _llama(seed, wide, dtype)
    quantize_model(m, cfg(), _CALIB, progress=False)
    return m


def _logits(m, ids=_IDS):
    with torch.no_grad():
        return m(ids).logits


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """name -> (in-memory quantized model, its logits, export directory, info); exported once per module."""
    out = {}
    for name in SCHEMES:
        m = _quantized(name)
        d = tmp_path_factory.mktemp("ct") / name
        info = export_compressed_tensors(m, d)
        out[name] = (m, _logits(m), d, info)
    return out


def _ct_load(d, weight_only, dtype=torch.float32):
    pytest.importorskip("compressed_tensors")
    kw = {}
    if weight_only:  # dequantized while loading; the compressed route mis-sizes asymmetric zero points (below)
        kw["quantization_config"] = transformers.CompressedTensorsConfig(dequantize=True)
    import warnings
    with warnings.catch_warnings():  # "the quantization_config from the model will be used" (and our dequantize)
        warnings.simplefilter("ignore", UserWarning)
        return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype, local_files_only=True, **kw).eval()


# ---------------------------------------------------------------------------------------------------------------
# (a) the real client
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.ct_client
@pytest.mark.parametrize("name", list(SCHEMES))
def test_transformers_compressed_tensors_loads_export(exports, name):
    m, ref, d, info = exports[name]
    _, _, weight_only, kv = SCHEMES[name]
    assert info.format == _format(name) and info.lossless
    got = _logits(_ct_load(d, weight_only))
    if kv:  # keys quantized after RoPE by compressed-tensors, before RoPE by qcore
        assert float((got - ref).abs().max()) <= 0.03 * float(ref.abs().max())
        assert not torch.equal(got, ref)  # the difference is real, and documented
    else:
        assert torch.equal(got, ref)


@pytest.mark.ct_client
def test_mxfp4_w4a4_bfloat16_close(tmp_path):
    # compressed-tensors' MXFP4 decompression yields bfloat16 weights: its compressed route needs a bf16 model
    m = transformers.AutoModelForCausalLM.from_config(_llama().config, dtype=torch.bfloat16).eval()
    quantize_model(m, preset("mxfp4"), _CALIB, progress=False)
    info = export_compressed_tensors(m, tmp_path / "mx")
    assert info.lossless and "MXFP4" in info.notes[0]
    ours = _logits(load_compressed_tensors(tmp_path / "mx")).float()
    theirs = _logits(_ct_load(tmp_path / "mx", False, torch.bfloat16)).float()
    assert torch.equal(ours, _logits(m).float())
    assert float((theirs - ours).abs().max()) <= 0.05 * float(ours.abs().max())


@pytest.mark.ct_client
def test_bfloat16_scales_reported_and_client_matches_reimport(tmp_path):
    m = transformers.AutoModelForCausalLM.from_config(_llama().config, dtype=torch.bfloat16).eval()
    quantize_model(m, preset("int4_wo_32"), _CALIB, progress=False)
    info = export_compressed_tensors(m, tmp_path / "bf")
    assert not info.lossless
    bad = info.inexact
    assert bad and all(n.endswith("weight_scale") for n in bad)
    r = info.tensors[bad[0]]
    assert r.dtype == "BF16" and r.max_abs_diff > 0 and r.kind == "scale"
    assert all(info.tensors[n].exact for n in info.tensors if n.endswith("weight_packed"))
    ours = _logits(load_compressed_tensors(tmp_path / "bf"))
    theirs = _logits(_ct_load(tmp_path / "bf", True, torch.bfloat16))
    assert torch.equal(ours, theirs)  # the same bf16-rounded scales in both loaders
    with pytest.raises(ValueError, match=r"strict=True\): tensor 'model\.layers\.0\..*weight_scale'"):
        export_compressed_tensors(m, tmp_path / "strict", strict=True)
    assert not (tmp_path / "strict").exists()


# ---------------------------------------------------------------------------------------------------------------
# (b) compressed-tensors' own compressor on the same fake-quantized model
# ---------------------------------------------------------------------------------------------------------------


def _their_checkpoint(m, qdict, d):
    """compressed-tensors compresses a float Llama holding ``m``'s fake-quantized weights and qcore's scales with
    its ModelCompressor and saves it as llm-compressor does."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    del ct
    f = transformers.LlamaForCausalLM(m.config).eval().to(next(m.parameters()).dtype)
    own = {k: v for k, v in m.state_dict().items() if k in f.state_dict()}
    f.load_state_dict(own, strict=False)
    qc = {k: v for k, v in qdict.items() if k not in ("qcore", "sparsity_config", "transform_config")}
    qc = QuantizationConfig.model_validate(dict(qc, quantization_status="initialized"))
    apply_quantization_config(f, qc)
    from qcore.adapters.modules import QuantLinear
    for name, q in m.named_modules():
        if not isinstance(q, QuantLinear):
            continue
        t = f.get_submodule(name)
        spec = q.specs.get("weight")
        if spec is not None:
            shift = 0 if not isinstance(spec.dtype, qcore.dtypes.IntDType) or spec.dtype.signed else \
                1 << (spec.dtype.bits - 1)
            t.weight_scale.data.copy_(q.weight_scale.reshape(t.weight_scale.shape))
            if not spec.symmetric:
                t.weight_zero_point.data.copy_((q.weight_zero_point - shift).reshape(t.weight_zero_point.shape))
        for role in q.static_roles():
            s = q._buffers[f"{role}_scale"].reshape(1)
            if role == "output":
                parent = f.get_submodule(name.rsplit(".", 1)[0])
                getattr(parent, name.rsplit(".", 1)[1][0] + "_scale").data.copy_(s)
            else:
                getattr(t, f"{role}_scale").data.copy_(s)
    for mod in f.modules():
        if hasattr(mod, "quantization_status"):
            mod.quantization_status = QuantizationStatus.FROZEN
    comp = ModelCompressor.from_pretrained_model(f)
    comp.compress_model(f)
    f.save_pretrained(d)
    comp.update_config(str(d))
    return d


def _tensors(d):
    out = {}
    for p in sorted(pathlib.Path(d).glob("*.safetensors")):
        sf = SafetensorsFile(p)
        out.update({k: (e.dtype, tuple(e.shape), sf.raw(k)) for k, e in sf.entries.items()})
    return out


@pytest.mark.ct_client
@pytest.mark.parametrize("name", ["w4a16_sym_g32", "w4a16_asym_g128", "w8a8_int8_static", "fp8_tensor_static_kv",
                                  "fp8_channel_dynamic_token", "mxfp4_weight_only"])
def test_model_compressor_writes_the_same_tensors(exports, name, tmp_path):
    m, ref, d, info = exports[name]
    qdict = json.loads((d / "config.json").read_text())["quantization_config"]
    theirs = _tensors(_their_checkpoint(m, qdict, tmp_path / "theirs"))
    ours = _tensors(d)
    quant = [k for k in ours if k in info.tensors]
    assert quant and set(quant) <= set(theirs)
    for k in quant:
        assert theirs[k][:2] == ours[k][:2], k
        a, b = theirs[k][2], ours[k][2]
        if name.startswith("mxfp4") and k.endswith("weight_packed"):
            # fp4 -0.0 (code 8): qcore keeps the sign as compressed-tensors' GPU kernel does; its CPU fallback
            # writes +0.0. Same values; compared with -0 mapped to +0
            a, b = (np.frombuffer(x, np.uint8) for x in (a, b))
            norm = lambda v: np.where((v & 0xF) == 8, v & 0xF0, v) & np.where((v >> 4) == 8, 0x0F, 0xFF)  # noqa
            a, b = norm(a).tobytes(), norm(b).tobytes()
        assert a == b, k
    cfg = json.loads((tmp_path / "theirs" / "config.json").read_text())["quantization_config"]
    mine = {k: v for k, v in qdict.items() if k != "qcore"}
    for k in ("config_groups", "format", "ignore", "kv_cache_scheme", "quantization_status"):
        assert cfg[k] == mine[k], k


# ---------------------------------------------------------------------------------------------------------------
# (c) qcore's importer
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMES))
def test_importer_loads_export_exactly(exports, name):
    m, ref, d, _ = exports[name]
    back = load_compressed_tensors(d)
    assert torch.equal(_logits(back), ref)
    assert back.qcore_config == m.qcore_config
    q = back.model.layers[0].self_attn.q_proj
    assert q.frozen and "weight" not in q._parameters


@pytest.mark.ct_client
@pytest.mark.parametrize("name", ["w4a16_asym_g32", "w4a16_sym_g128", "w8a8_int8_static", "fp8_tensor_static_kv",
                                  "mxfp4_weight_only"])
def test_importer_loads_compressed_tensors_checkpoints(exports, name, tmp_path):
    m, ref, d, _ = exports[name]
    qdict = json.loads((d / "config.json").read_text())["quantization_config"]
    theirs = _their_checkpoint(m, qdict, tmp_path / "theirs")
    assert "qcore" not in json.loads((theirs / "config.json").read_text())["quantization_config"]
    back = load_compressed_tensors(theirs)  # the config is derived from compressed-tensors' own
    assert torch.equal(_logits(back), ref)
    derived = back.qcore_config
    for p in ("model.layers.0.mlp.up_proj", "model.layers.1.self_attn.k_proj"):
        a, b = back.get_submodule(p), m.get_submodule(p)
        assert a.specs["weight"] == b.specs["weight"]
    assert derived.exclude == ("lm_head",)
    from qcore.adapters import export_hf, from_pretrained
    export_hf(back, tmp_path / "quark")  # the derived config describes the model: Quark's layout writes it again
    assert torch.equal(_logits(from_pretrained(tmp_path / "quark")), ref)


def test_imported_model_exports_again(exports, tmp_path):
    from qcore.adapters import export_hf, from_pretrained
    m, ref, d, _ = exports["w4a16_asym_g32"]
    back = load_compressed_tensors(d)
    export_hf(back, tmp_path / "quark")
    assert torch.equal(_logits(from_pretrained(tmp_path / "quark")), ref)
    info = export_compressed_tensors(back, tmp_path / "again")
    assert _tensors(tmp_path / "again") == _tensors(d) and info.lossless


# ---------------------------------------------------------------------------------------------------------------
# (d) determinism, atomicity, errors
# ---------------------------------------------------------------------------------------------------------------


def test_deterministic_and_frozen_equal(tmp_path):
    m1 = _quantized("w8a8_int8_static")
    m2 = _quantized("w8a8_int8_static")
    export_compressed_tensors(m1, tmp_path / "a")
    freeze(m2)
    export_compressed_tensors(m2, tmp_path / "b", max_shard_size=20_000)
    assert (tmp_path / "a" / "config.json").read_bytes() == (tmp_path / "b" / "config.json").read_bytes()
    assert _tensors(tmp_path / "a") == _tensors(tmp_path / "b")
    assert (tmp_path / "b" / "model.safetensors.index.json").is_file()
    export_compressed_tensors(m1, tmp_path / "c")
    for f in (tmp_path / "a").iterdir():
        assert f.read_bytes() == (tmp_path / "c" / f.name).read_bytes()
    assert torch.equal(_logits(load_compressed_tensors(tmp_path / "b")), _logits(m1))


def test_atomic_on_failure(tmp_path, monkeypatch):
    import qcore.adapters.io.common as E  # export_compressed_tensors writes through common.write_checkpoint
    m = _quantized("w4a16_sym_g32")
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "keep.txt").write_text("old")

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(E, "write_shards", boom)
    with pytest.raises(KeyboardInterrupt):
        export_compressed_tensors(m, dest, overwrite=True)
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging directory left
    with pytest.raises(FileExistsError, match="overwrite"):
        export_compressed_tensors(m, dest)


@pytest.mark.parametrize("cfg, msg", [
    (ModelConfig(LayerConfig(weight=qcore.make_spec("int8", granularity=PerChannel(0), narrow_range=True))),
     r"layer 'model\.layers\.0\.self_attn\.q_proj' weight .*narrow"),
    (ModelConfig(LayerConfig(weight="mx9")), r"layer 'model\.layers\.0\.self_attn\.q_proj' weight .*micro"),
    (ModelConfig(LayerConfig(weight=qcore.make_spec("int4", granularity=PerGroup(48, 1)))), "groups of 48"),
    (ModelConfig(LayerConfig(weight="int8", bias="int8")), "bias"),
    (ModelConfig(LayerConfig(weight="int8", input=qcore.make_spec("int8", granularity=PerChannel(1)))),
     "per-feature"),
])
def test_refusals_name_the_layer(tmp_path, cfg, msg):
    m = _llama()
    if cfg.layer.bias is not None:
        for n, mod in m.named_modules():
            if isinstance(mod, torch.nn.Linear) and n != "lm_head":
                mod.bias = torch.nn.Parameter(torch.zeros(mod.out_features))
    quantize_model(m, cfg, _CALIB, progress=False)
    with pytest.raises(ValueError, match=msg):
        export_compressed_tensors(m, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def _rewrite(path, drop=None, retype=None):
    """Rewrite a safetensors file without tensor ``drop`` / with ``retype = (name, dtype)`` (same bytes)."""
    from qcore.formats.safetensors_io import TensorRecord, write_file
    sf = SafetensorsFile(path)
    recs = []
    for k, e in sf.entries.items():
        if k == drop:
            continue
        dt = retype[1] if retype and retype[0] == k else e.dtype
        recs.append(TensorRecord(k, dt, e.shape, lambda k=k: sf.raw(k)))
    data = [(r.name, r.dtype, r.shape, r.produce()) for r in recs]
    write_file(path, [TensorRecord(n, dt, s, lambda b=b: b) for n, dt, s, b in data], metadata={"format": "pt"})


def test_importer_errors_name_the_tensor(exports, tmp_path):
    import shutil
    _, _, d, _ = exports["w4a16_asym_g32"]
    key = "model.layers.1.mlp.down_proj.weight_zero_point"
    a = tmp_path / "a"
    shutil.copytree(d, a)
    _rewrite(a / "model.safetensors", drop=key)
    with pytest.raises(CorruptCheckpointError, match=f"tensor '{key}' is missing"):
        load_compressed_tensors(a)
    b = tmp_path / "b"
    shutil.copytree(d, b)
    _rewrite(b / "model.safetensors", retype=("model.layers.0.mlp.up_proj.weight_packed", "F32"))
    with pytest.raises(CorruptCheckpointError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight_packed' is F32"):
        load_compressed_tensors(b)
    c = tmp_path / "c"
    shutil.copytree(d, c)
    raw = json.loads((c / "config.json").read_text())
    raw["quantization_config"]["format"] = "nvfp4-pack-quantized"
    (c / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="nvfp4-pack-quantized"):
        load_compressed_tensors(c)
    from qcore.adapters import export_hf
    export_hf(_quantized("w4a16_sym_g32"), tmp_path / "quark")
    with pytest.raises(ValueError, match="quant_method is 'quark'"):
        load_compressed_tensors(tmp_path / "quark")


def test_scale_values_validated(exports, tmp_path):
    import shutil
    _, _, d, _ = exports["fp8_tensor_static_kv"]
    a = tmp_path / "a"
    shutil.copytree(d, a)
    from qcore.formats.safetensors_io import TensorRecord, write_file
    sf = SafetensorsFile(a / "model.safetensors")
    key = "model.layers.0.self_attn.k_scale"
    neg = np.array([-1.0], np.float32).tobytes()
    recs = [TensorRecord(k, e.dtype, e.shape, (lambda b=sf.raw(k) if k != key else neg: b)) for k, e in
            sf.entries.items()]
    data = [(r.name, r.dtype, r.shape, r.produce()) for r in recs]
    write_file(a / "model.safetensors", [TensorRecord(n, t, s, lambda b=b: b) for n, t, s, b in data])
    with pytest.raises(CorruptCheckpointError, match=f"'{key}' holds -1.0"):
        load_compressed_tensors(a)


def test_cli_export_compressed_tensors(tmp_path, capsys):
    from qcore.cli import main
    src = tmp_path / "float"
    _llama().save_pretrained(src)
    out, rep = tmp_path / "ct", tmp_path / "r.json"
    code = main(["quantize", "--model", str(src), "--scheme", "int4_wo_32", "--eval", "none", "--export",
                 "compressed-tensors", "--output", str(out), "--report", str(rep), "--no-progress"])
    o = capsys.readouterr()
    assert code == 0, o.err
    r = json.loads(rep.read_text())
    assert r["export_format"] == "compressed-tensors" and r["quant_method"] == "compressed-tensors"
    assert r["ct_lossless"] is True and r["ct_inexact"] == []
    assert "pack-quantized" in o.out
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["ignore"] == ["lm_head"]
    back = load_compressed_tensors(out)
    assert back.model.layers[0].mlp.down_proj.frozen


def test_from_pretrained_and_cli_models_route_compressed_tensors(exports):
    from qcore.adapters import from_pretrained
    from qcore.adapters.jobs.common import load_model
    m, ref, d, _ = exports["w4a16_sym_g32"]
    assert torch.equal(_logits(from_pretrained(d)), ref)
    with pytest.raises(TypeError, match="device_map"):
        from_pretrained(d, device_map="cpu")
    model, tok, desc = load_model(str(d), dtype=torch.float32, device="cpu")  # qcore eval / quantize --model DIR
    assert torch.equal(_logits(model), ref) and model.model.layers[0].mlp.up_proj.frozen


def test_inspect_compressed_tensors(exports, capsys):
    from qcore.cli import main
    from qcore.formats.inspect import inspect_checkpoint
    _, _, d, _ = exports["w4a16_asym_g32"]
    info = inspect_checkpoint(d)
    assert info["quant_method"] == "compressed-tensors" and info["written_by"].startswith("qcore")
    assert info["layers_per_layout"] == {"pack-quantized": 14} and info["group_size"] == 32
    assert info["weight_format"] == "int4 asymmetric" and info["exclude"] == ["lm_head"]
    assert info["bits_per_weight"] == pytest.approx(4 + 32 / 32 + 4 / 32, abs=0.01)  # codes, f32 scales, 4-bit zps
    kv = inspect_checkpoint(exports["fp8_tensor_static_kv"][2])
    assert kv["kv_cache"] == ["k_scale", "v_scale"] and kv["activations"] == "float8 tensor static"
    assert main(["inspect", str(d)]) == 0
    assert "pack-quantized: 14" in capsys.readouterr().out


def test_tied_embeddings_round_trip(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    m.tie_weights()
    assert m.lm_head.weight is m.model.embed_tokens.weight
    quantize_model(m, preset("int4_wo_32"), None, progress=False)
    export_compressed_tensors(m, tmp_path / "t")
    names = _tensors(tmp_path / "t")
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # written once
    back = load_compressed_tensors(tmp_path / "t")
    assert back.lm_head.weight is back.model.embed_tokens.weight
    assert torch.equal(_logits(back), _logits(m))


def test_float16_scale_underflow_refused(tmp_path):
    m = _llama().half()
    with torch.no_grad():  # float16's smallest subnormal: the float32 scale 6e-8 / 7.5 is 0 in float16
        w = m.model.layers[1].mlp.down_proj.weight
        w.copy_(torch.sign(torch.randn(w.shape)) * 2.0 ** -24)
    quantize_model(m, preset("int4_wo_32"), None, progress=False)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight_scale': scale .* is 0"):
        export_compressed_tensors(m, tmp_path / "h")
    assert not (tmp_path / "h").exists()


@pytest.mark.ct_client
def test_kv_cache_on_float_attention(tmp_path):
    """Attention left in float but its KV cache quantized: k_proj / v_proj are float Linears in ``ignore`` and
    the attention modules hold k_scale / v_scale."""
    m = _llama()
    cfg = preset("int4_wo_32", kv_cache="fp8", exclude=("lm_head", "*self_attn*"))
    quantize_model(m, cfg, _CALIB, progress=False)
    info = export_compressed_tensors(m, tmp_path / "kv")
    qc = json.loads((tmp_path / "kv" / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.self_attn.k_proj" in qc["ignore"] and qc["kv_cache_scheme"]["type"] == "float"
    assert "model.layers.0.self_attn.k_scale" in info.tensors and "model.layers.0.self_attn.k_proj" not in info.layers
    ref = _logits(m)
    back = load_compressed_tensors(tmp_path / "kv")
    assert torch.equal(_logits(back), ref) and back.qcore_config == m.qcore_config
    got = _logits(_ct_load(tmp_path / "kv", False))
    assert float((got - ref).abs().max()) <= 0.03 * float(ref.abs().max())
    theirs = _their_checkpoint(m, qc, tmp_path / "theirs")
    back = load_compressed_tensors(theirs)  # derived config: KV on the ignored projections
    assert torch.equal(_logits(back), ref)
    assert back.qcore_config.kv_cache is not None and "model.layers.1.self_attn.v_proj" in back.qcore_config.exclude


# ---------------------------------------------------------------------------------------------------------------
# which config group quantizes a layer (issue 33): compressed-tensors' and vLLM's rules, reading and writing
# ---------------------------------------------------------------------------------------------------------------

_W4A16 = LayerConfig(weight=qcore.make_spec("int4", granularity=PerGroup(32, 1)))
_W8A8 = LayerConfig(weight=qcore.make_spec("int8", granularity=PerChannel(0)), input=qcore.make_spec("int8"))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A tiny Llama quantized W4A16 with its down_proj layers W8A8, exported (two groups naming their layers)."""
    m = _llama(3)
    quantize_model(m, ModelConfig(_W4A16, by_name={"*mlp.down_proj": _W8A8}, exclude=("lm_head",)), _CALIB,
                   progress=False)
    d = tmp_path_factory.mktemp("mixed") / "ct"
    export_compressed_tensors(m, d)
    return m, _logits(m), d


def _foreign(src, dst, targets):
    """A copy of ``src`` as another tool would write it: no qcore block; the group holding ``targets[g][0]``-style
    members renamed by ``targets`` (``{kind: targets}``, kind 'w4a16' / 'w8a8'), in the order given."""
    import shutil
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    q = cfg["quantization_config"]
    del q["qcore"]
    kind = {g: ("w8a8" if any("down_proj" in t for t in s["targets"]) else "w4a16")
            for g, s in q["config_groups"].items()}
    by_kind = {kind[g]: s for g, s in q["config_groups"].items()}
    q["config_groups"] = {f"group_{k}": dict(by_kind[k], targets=t) for k, t in targets.items()}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_a_pattern_target_beats_a_class_target_on_load(mixed, tmp_path):
    """The report: a W4A16 group targeting "Linear" listed before a W8A8 group targeting the down projections by a
    re: pattern. Both compressed-tensors and vLLM give the down projections the pattern's group (names and patterns
    before classes); qcore loaded the first group that matched ("Linear") and read W8A8 layers as W4A16."""
    m, ref, d = mixed
    src = _foreign(d, tmp_path / "theirs", {"w4a16": ["Linear"], "w8a8": ["re:.*mlp\\.down_proj$"]})
    back = load_compressed_tensors(src)
    assert torch.equal(_logits(back), ref)
    down, up = back.model.layers[1].mlp.down_proj, back.model.layers[1].mlp.up_proj
    assert down.specs["weight"] == m.model.layers[1].mlp.down_proj.specs["weight"] and "input" in down.specs
    assert up.specs["weight"].dtype.name == "int4" and "input" not in up.specs


def test_a_config_the_two_readers_read_differently_is_refused(mixed, tmp_path):
    """A pattern listed before exact names: compressed-tensors ranks the exact names first (the down projections
    W8A8), vLLM takes the first target in config order (the pattern: W4A16). The checkpoint means two things;
    refused naming the layer and both readings."""
    m, ref, d = mixed
    downs = [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    src = _foreign(d, tmp_path / "theirs", {"w4a16": ["re:.*proj$"], "w8a8": downs})
    with pytest.raises(CorruptCheckpointError, match=r"layer 'model\.layers\.0\.mlp\.down_proj': compressed-tensors "
                                                     r".* group 'group_w8a8' .* vLLM reads group 'group_w4a16'"):
        load_compressed_tensors(src)
    ok = _foreign(d, tmp_path / "ok", {"w8a8": downs, "w4a16": ["re:.*proj$"]})  # exact names first: one reading
    assert torch.equal(_logits(load_compressed_tensors(ok)), ref)


def test_writer_config_read_back_by_both_readers(mixed):
    """qcore's own config (exact names per group, float Linears in ignore) gives every layer its group under both
    rules."""
    from qcore.adapters.io.compressed_tensors import _linears, _vllm_fused
    from qcore.formats import compressed_tensors as CT
    m, _, d = mixed
    q = json.loads((d / "config.json").read_text())["quantization_config"]
    groups = {g: s["targets"] for g, s in q["config_groups"].items()}
    res = CT.resolve_groups(_linears(m), groups, q["ignore"], fused=_vllm_fused(m))
    for name, (ct, v) in res.items():
        assert ct.group == v.group and v.refused is None, name
        assert (ct.group is None) == (name == "lm_head")


@pytest.mark.parametrize("by_name, msg", [
    ({"*self_attn.k_proj": _W8A8}, r"vLLM fuses \['q_proj', 'k_proj', 'v_proj'\] into one qkv_proj"),
    ({"*mlp.up_proj": _W8A8}, r"vLLM fuses \['gate_proj', 'up_proj'\] into one gate_up_proj"),
])
def test_fused_projections_with_different_schemes_are_refused_before_writing(tmp_path, by_name, msg):
    """vLLM loads q/k/v (gate/up) as one fused layer with one scheme: a model quantizing them differently cannot be
    written so that vLLM reads it as meant; refused by check_ct (before qcore quantize's baseline) and the export."""
    from qcore.adapters.io.compressed_tensors import check_ct
    cfg = ModelConfig(_W4A16, by_name=by_name, exclude=("lm_head",))
    with pytest.raises(ValueError, match=msg):
        check_ct(_llama(), cfg)
    m = _llama()
    quantize_model(m, cfg, _CALIB, progress=False)
    with pytest.raises(ValueError, match=msg):
        export_compressed_tensors(m, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    partial = ModelConfig(_W4A16, exclude=("lm_head", "*self_attn.q_proj"))  # one shard float: vLLM refuses it
    with pytest.raises(ValueError, match="vLLM would read refused"):
        check_ct(_llama(), partial)

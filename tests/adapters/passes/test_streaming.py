"""Models larger than memory (``qcore.adapters.jobs.checkpoint.quantize_checkpoint``): the checkpoint read and written one
decoder layer at a time equals ``quantize_model`` + ``export_hf`` of the whole model, file for file and byte for
byte; peak memory stays far below the model's weights; errors leave the destination alone."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import stream_worker  # noqa: E402  (tests/adapters, next to this file)

import qcore.adapters as A  # noqa: E402
from qcore.adapters import LayerConfig, TensorConfig  # noqa: E402
from qcore.adapters.jobs.checkpoint import quantize_checkpoint  # noqa: E402
from qcore.formats.inspect import inspect_checkpoint  # noqa: E402
from qcore.formats.safetensors_io import CorruptCheckpointError, SafetensorsFile  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
VOCAB = stream_worker.VOCAB
BATCHES = [torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1)) for _ in range(4)]


def _w16():
    return A.preset("w_uint4_per_group_asym", group_size=16)


def _scenarios():
    w = _w16()
    gptq = ({"name": "gptq"},)
    emb = LayerConfig(weight=TensorConfig(A.preset("w_int8_per_channel_sym").layer.weight.spec))
    return {
        "rtn": A.preset("uint4_wo_64"),
        "gptq": w.replace(algorithms=gptq),
        # static input scales everywhere, fp8 KV cache, and the output head quantized too (calibrated after the
        # layers, from the kept final hidden states)
        "static_head": A.preset("w_int8_a_int8_per_tensor_sym", kv_cache="fp8", exclude=()),
        "gptq_static": A.preset("w_int8_a_int8_per_tensor_sym", kv_cache="fp8").replace(algorithms=gptq),
        # a quantized module before the layers (the embedding)
        "gptq_embedding": w.replace(by_type={"Embedding": emb}, algorithms=gptq),
    }


def _checkpoint(tmp_path, *, tie=False, dtype=torch.float32, layers=3):
    src = tmp_path / "src"
    stream_worker.write_llama(src, hidden=64, intermediate=128, layers=layers, tie=tie, dtype=dtype)
    return src


def _in_memory(src, cfg, dst, **kw):
    m = transformers.AutoModelForCausalLM.from_pretrained(src, local_files_only=True).eval()
    A.quantize_model(m, cfg, BATCHES, progress=False)
    A.export_hf(m, dst, max_shard_size="60KB", **kw)
    return m


def _same_files(a: pathlib.Path, b: pathlib.Path):
    fa, fb = sorted(p.name for p in a.iterdir()), sorted(p.name for p in b.iterdir())
    assert fa == fb
    for f in fa:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f"{f} differs"
    return fa


@pytest.mark.parametrize("scenario", list(_scenarios()))
def test_streaming_equals_quantize_model_and_export_hf(scenario, tmp_path):
    src = _checkpoint(tmp_path)
    cfg = _scenarios()[scenario]
    ref = _in_memory(src, cfg, tmp_path / "ref")
    info = quantize_checkpoint(src, tmp_path / "out", cfg, BATCHES, max_shard_size="60KB", progress=False)
    files = _same_files(tmp_path / "ref", tmp_path / "out")
    assert sum(f.endswith(".safetensors") for f in files) > 1 and "model.safetensors.index.json" in files
    written = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_method"]
    assert info.quant_method == written == ("qcore" if scenario == "gptq_embedding" else "quark")
    assert len(info.layers) == len(A.quantized_modules(ref))
    names = set()
    for f in files:
        if f.endswith(".safetensors"):
            names |= set(SafetensorsFile(tmp_path / "out" / f).keys())
    if scenario == "static_head":
        assert "lm_head.input_scale" in names and "model.layers.2.self_attn.v_proj.output_scale" in names
    if scenario == "gptq_embedding":  # a "qcore" checkpoint: every quantized weight in qcore's layout (1-D codes)
        assert "model.embed_tokens.weight_scale" in names and set(info.layers.values()) == {"qcore"}
    back = A.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(back(BATCHES[0]).logits, ref(BATCHES[0]).logits)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no staging or spill left behind


@pytest.mark.parametrize("tie,dtype,pack", [(True, torch.float32, "reorder"), (False, torch.bfloat16, "order")])
def test_tied_weights_bfloat16_and_pack_method(tie, dtype, pack, tmp_path):
    src = _checkpoint(tmp_path, tie=tie, dtype=dtype)
    cfg = _scenarios()["gptq"]
    ref = _in_memory(src, cfg, tmp_path / "ref", pack_method=pack)
    quantize_checkpoint(src, tmp_path / "out", cfg, BATCHES, max_shard_size="60KB", pack_method=pack,
                        progress=False)
    _same_files(tmp_path / "ref", tmp_path / "out")
    assert next(ref.parameters()).dtype == dtype
    back = A.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(back(BATCHES[1]).logits, ref(BATCHES[1]).logits)


@pytest.mark.slow
def test_peak_memory_is_a_fraction_of_the_weights(tmp_path):
    """A synthetic Llama (hidden 256, 56 layers: about 100 MB of float32 weights) is quantized, uint4 g64
    round-to-nearest and GPTQ, each in its own process (both at once), holding at most a third of its weights:
    peak resident memory grows by less than weights / 3 (measured: about 1/10 for RTN, 1/4 for GPTQ, whose
    working set for one layer is several times the layer itself)."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("the peak-memory measure needs Linux's /proc/self/clear_refs (to reset the peak)")
    src = tmp_path / "big"
    weight_bytes = stream_worker.write_llama(src, hidden=256, intermediate=256, layers=56)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    procs = {a: subprocess.Popen([sys.executable, str(HERE / "stream_worker.py"), str(src), str(tmp_path / a), a],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for a in ("rtn", "gptq")}
    results = {}
    try:
        for a, p in procs.items():
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err.decode(errors="replace")[-4000:]
            results[a] = json.loads(out.decode().strip().splitlines()[-1])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for a, r in results.items():
        assert r["growth"] < weight_bytes / 3, (a, r, weight_bytes)
        desc = inspect_checkpoint(tmp_path / a)
        assert desc["quantized_layers"] == 56 * 7
    print({a: f"{r['growth'] / weight_bytes:.3f} x weights, {r['seconds']:.1f} s" for a, r in results.items()})


def test_errors_leave_the_destination_alone(tmp_path):
    src = _checkpoint(tmp_path)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite"):
        quantize_checkpoint(src, dst, "uint4_wo_64", progress=False)
    with pytest.raises(ValueError, match="calibration data"):
        quantize_checkpoint(src, tmp_path / "o2", _scenarios()["gptq"], progress=False)
    with pytest.raises(ValueError, match="pack_method"):
        quantize_checkpoint(src, tmp_path / "o2", "uint4_wo_64", pack_method="zigzag", progress=False)
    with pytest.raises(TypeError, match="dtype"):
        quantize_checkpoint(src, tmp_path / "o2", "uint4_wo_64", dtype="float32", progress=False)
    with pytest.raises(FileNotFoundError, match="config.json"):
        quantize_checkpoint(tmp_path / "nowhere", tmp_path / "o2", "uint4_wo_64", progress=False)
    # a checkpoint missing a layer's tensor fails before any work; nothing is written
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.2.mlp.up_proj.weight"]
    layer2 = src / "layer-00002.safetensors"
    from safetensors.torch import load_file, save_file
    t = load_file(layer2)
    del t["model.layers.2.mlp.up_proj.weight"]
    save_file(t, str(layer2), metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="model.layers.2.mlp.up_proj.weight"):
        quantize_checkpoint(src, dst, "uint4_wo_64", overwrite=True, progress=False)
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no staging directory left


def test_quantized_source_is_refused(tmp_path):
    src = _checkpoint(tmp_path)
    _in_memory(src, A.preset("uint4_wo_64"), tmp_path / "q")
    with pytest.raises(ValueError, match="already a quantized checkpoint"):
        quantize_checkpoint(tmp_path / "q", tmp_path / "o", "uint4_wo_64", progress=False)

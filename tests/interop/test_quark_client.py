"""Self-check of the Quark interop harness, without qcore's exporter: Quark 0.13 exports the tiny Llama with six
schemes and reloads each export through transformers' Quark integration; the reloaded logits must match Quark's own
quantized model and differ from the float model's. Two Quark processes in all (one ``export`` batch, one ``logits``
batch): each process pays Quark's import (25-60 s here).

Also pins down, as facts for qcore's exporter and loader, what Quark 0.13 writes (``LAYOUT``, tests/interop/README.md)
and that each export's ``quantization_config`` is the fixture in tests/formats/data/quark_configs/.
"""

from __future__ import annotations

import json
import pathlib
import struct

import numpy as np
import pytest

pytestmark = pytest.mark.interop

from interop_schemes import NAMES  # noqa: E402  (the schemes of the shared ``roundtrip`` fixture)
QUARK_CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "formats" / "data" / "quark_configs"

# The tiny Llama's Linear layers (out_features, in_features); lm_head is excluded by Quark's llama template.
LINEARS = {"self_attn.q_proj": (128, 128), "self_attn.k_proj": (64, 128), "self_attn.v_proj": (64, 128),
           "self_attn.o_proj": (128, 128), "mlp.gate_proj": (256, 128), "mlp.up_proj": (256, 128),
           "mlp.down_proj": (128, 256)}
N_LINEARS = 2 * len(LINEARS)


def _int4_group128(o, i):
    # reorder packing: transposed to [in, out], 8 nibbles per int32 along out (order 0,2,4,6,1,3,5,7)
    return {"weight": ("I32", [i, o // 8]), "weight_scale": ("F32", [i // 128, o]),
            "weight_zero_point": ("I32", [i // 128, o // 8])}


# What Quark 0.13 writes per quantized Linear (out features o, in features i): suffix -> (safetensors dtype, shape)
LAYOUT = {
    "int8": lambda o, i: {"weight": ("I8", [o, i]), "weight_scale": ("F32", []), "weight_zero_point": ("I8", []),
                          "input_scale": ("F32", []), "input_zero_point": ("I8", [])},
    "fp8_kv_fp8": lambda o, i: {"weight": ("F8_E4M3", [o, i]), "weight_scale": ("F32", []),
                                "input_scale": ("F32", [])},
    "uint4_wo_128": _int4_group128,
    "int4_wo_128": _int4_group128,
    "mxfp4": lambda o, i: {"weight": ("U8", [o, i // 2]), "weight_scale": ("U8", [o, i // 32])},
    "mxfp6_e2m3": lambda o, i: {"weight": ("U8", [o, i * 3 // 4]), "weight_scale": ("U8", [o, i // 32])},
}
KV_OUTPUT = ("self_attn.k_proj", "self_attn.v_proj")  # fp8_kv_fp8: these also get output_scale F32 []
# (weight, input, output) quantizers transformers' Quark loader must build on the 14 QParamsLinear layers
QUANTIZERS = {"int8": (14, 14, 0), "fp8_kv_fp8": (14, 14, 4), "uint4_wo_128": (14, 0, 0), "int4_wo_128": (14, 0, 0),
              "mxfp4": (14, 14, 0), "mxfp6_e2m3": (14, 14, 0)}


def safetensors_header(path) -> dict:
    """name -> (dtype, shape) from a .safetensors file's JSON header (what is on disk, no framework involved)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}


def safetensors_scalar_f32(path, name) -> float:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        start, end = header[name]["data_offsets"]
        assert header[name]["dtype"] == "F32" and end - start == 4, header[name]
        f.seek(8 + n + start)
        return struct.unpack("<f", f.read(4))[0]


def test_every_scheme_exported_with_quark_config(roundtrip):
    assert sorted(roundtrip.exports) == sorted(NAMES)
    for name, rec in roundtrip.exports.items():
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(rec["files"])
        config = json.loads((roundtrip.dir / "exports" / name / "config.json").read_text())
        qc = config["quantization_config"]
        assert qc["quant_method"] == "quark" and qc["export"]["weight_format"] == "real_quantized"
        assert qc["export"]["pack_method"] == "reorder"
        assert qc == json.loads((QUARK_CONFIGS / f"{name}.json").read_text()), name  # the repo's fixture


@pytest.mark.parametrize("name", NAMES)
def test_layout(roundtrip, name):
    """The tensors Quark 0.13 writes for every Linear (the table in tests/interop/README.md)."""
    tensors = safetensors_header(roundtrip.dir / "exports" / name / "model.safetensors")
    expected = {"model.embed_tokens.weight": ("F32", [256, 128]), "lm_head.weight": ("F32", [256, 128]),
                "model.norm.weight": ("F32", [128])}
    for layer in range(2):
        p = f"model.layers.{layer}"
        expected[f"{p}.input_layernorm.weight"] = ("F32", [128])
        expected[f"{p}.post_attention_layernorm.weight"] = ("F32", [128])
        for lin, (o, i) in LINEARS.items():
            for suffix, spec in LAYOUT[name](o, i).items():
                expected[f"{p}.{lin}.{suffix}"] = spec
            if name == "fp8_kv_fp8" and lin in KV_OUTPUT:
                expected[f"{p}.{lin}.output_scale"] = ("F32", [])
    assert {k: (d, list(s)) for k, (d, s) in tensors.items()} == expected


def test_kv_output_scales_are_merged_to_the_group_max(roundtrip):
    """Quark's exporter writes max(k_scale, v_scale) as both k_proj and v_proj output_scale (kv_cache_group)."""
    before = roundtrip.exports["fp8_kv_fp8"]["output_scales"]
    path = roundtrip.dir / "exports" / "fp8_kv_fp8" / "model.safetensors"
    assert len(before) == 4, before
    for layer in range(2):
        p = f"model.layers.{layer}.self_attn"
        k, v = before[f"{p}.k_proj"], before[f"{p}.v_proj"]
        print(f"layer {layer}: in-memory k {k:.6g} v {v:.6g}")
        for proj in ("k_proj", "v_proj"):
            assert safetensors_scalar_f32(path, f"{p}.{proj}.output_scale") == np.float32(max(k, v))


@pytest.mark.parametrize("name", NAMES)
def test_quark_loader_builds_quantized_layers(roundtrip, name):
    rec = roundtrip.loads[name]
    assert rec["quant_method"] == "quark"
    assert rec["modules"]["QParamsLinear"] == N_LINEARS and rec["modules"]["Linear"] == 1, rec["modules"]
    q = rec["quantizers"]
    assert (q.get("weight", 0), q.get("input", 0), q.get("output", 0)) == QUANTIZERS[name], q
    assert roundtrip.loads[roundtrip.float_name]["modules"] == {"Linear": N_LINEARS + 1}


@pytest.mark.parametrize("name", NAMES)
def test_reload_matches_quark_model_and_differs_from_float(roundtrip, name):
    d = roundtrip.dir
    flt = np.load(d / "inmem" / "float.npy")
    inmem = np.load(d / "inmem" / f"{name}.npy")  # Quark's frozen quantized model before export
    exported = np.load(d / "inmem" / f"{name}.exported.npy")  # the same model object after export_safetensors
    reload = np.load(d / "reload" / f"{name}.npy")  # transformers + Quark loading the export
    tol = 1e-3 * float(np.ptp(inmem))
    diff = {k: float(np.abs(reload - v).max()) for k, v in
            (("inmem", inmem), ("exported", exported), ("float", flt))}
    print(f"{name}: logit range {np.ptp(inmem):.4f} tol {tol:.2e} max|reload - x|: {diff}; "
          f"reload[0, 0, :4] {reload[0, 0, :4]} inmem {inmem[0, 0, :4]} float {flt[0, 0, :4]}")
    assert reload.shape == flt.shape == (2, 32, 256) and reload.dtype == np.float32
    assert diff["exported"] <= tol
    if name == "fp8_kv_fp8":
        # export merged the v_proj output scale into max(k, v) (test above): the reload runs that, not the
        # in-memory model's own v scale, so it only stays within quantization-error distance of it.
        assert diff["inmem"] <= 0.1 * float(np.ptp(inmem))
    else:
        assert diff["inmem"] <= tol
    assert diff["float"] > 5 * tol  # quantization really happened


def test_float_model_agrees_between_envs(roundtrip):
    """The float model gives the same logits in the Quark venv (both ways of loading) and in this env."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    venv_export = np.load(roundtrip.dir / "inmem" / "float.npy")
    venv_load = np.load(roundtrip.dir / "reload" / f"{roundtrip.float_name}.npy")
    model = transformers.AutoModelForCausalLM.from_pretrained(roundtrip.float_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        here = model(input_ids=torch.from_numpy(np.load(roundtrip.eval_ids))).logits.numpy()
    np.testing.assert_array_equal(venv_export, venv_load)
    np.testing.assert_allclose(here, venv_load, rtol=0, atol=1e-5)

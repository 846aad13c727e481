"""Regenerate the Quark ``quantization_config`` fixtures in ``quark_configs/`` with AMD Quark itself.

CI does not run this script: it needs ``amd-quark`` (with torch and transformers), which the project does not
depend on. Run it in a separate virtual environment:

    python -m venv /tmp/quarkvenv
    /tmp/quarkvenv/bin/pip install amd-quark==0.13 torch==2.13.0 transformers
    /tmp/quarkvenv/bin/python tests/formats/data/make_quark_configs.py            # writes quark_configs/*.json
    /tmp/quarkvenv/bin/python tests/formats/data/make_quark_configs.py --check   # compare, write nothing
    /tmp/quarkvenv/bin/python tests/formats/data/make_quark_configs.py --check-export   # + a tiny real export

(``torch==2.13.0`` takes the CPU wheel; the first ``import quark.torch`` compiles a C++ extension, ~30 s.)

Each fixture is the dict Quark's HF exporter writes into ``config.json["quantization_config"]``:
``QuarkSafetensorsExporter._prepare_quantization_config`` (``quark/torch/export/api.py``), i.e.
``QConfig.to_dict()`` plus ``"export": dataclasses.asdict(JsonExporterConfig(...))`` built as
``SafetensorsExporter._export_impl`` builds it (``weight_format="real_quantized"``, ``pack_method="reorder"``,
``kv_cache_group`` only when a KV cache is quantized, ``min_kv_scale``). The script calls that method of Quark
itself; ``--check-export`` also quantizes and exports a tiny random Llama for two schemes and checks that the
written ``config.json`` holds exactly the fixture dict.

Fixtures (file name = scheme name):

- Quark 0.13's named schemes, ``LLMTemplate.get("llama").get_config(scheme=...)`` (the registry in
  ``quark/torch/quantization/config/template.py``, ``QuantizationSchemeCollection``): every built-in scheme
  except the alias ``fp4_block16_scale_e4m3`` (the same object as ``nvfp4``). The llama template excludes
  ``lm_head``.
- ``fp8_kv_fp8``: ``get_config("fp8", kv_cache_scheme="fp8")`` (``kv_cache_quant_config`` and
  ``layer_quant_config`` on ``*k_proj`` / ``*v_proj`` with an fp8 ``output_tensors`` spec).
- ``int4_wo_128_exclude``: ``get_config("int4_wo_128", exclude_layers=[...])`` (an exclude list with
  fnmatch patterns).
- ``w_*``: the ``--quant_scheme`` names of the older example ``examples/torch/language_modeling/llm_ptq/
  customized_configuration.py`` (github.com/amd/Quark @9234960c; Quark 0.13's ``quantize_quark.py`` takes the
  ``LLMTemplate`` names above instead, so none of the ``w_*`` names exists in 0.13). Each is built from that
  example's recipe (the same spec classes and arguments, group size 128 for the integer per-group schemes, 32 for
  OCP MX) with Quark 0.13's classes and serialized by Quark 0.13, as the example's ``get_config`` assembles it
  (``exclude=["lm_head"]``, ``algo_config=[]``). Names in that table whose recipe does not run on 0.13
  (``w_mx6_a_mx6``, ``w_bfp16_a_bfp16``: 0.13's ``MX6Spec`` / ``BFP16Spec`` take no ``is_dynamic``) are reported
  and skipped; 0.13's ``mx6`` / ``bfp16`` schemes cover those formats.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

OUT = pathlib.Path(__file__).resolve().parent / "quark_configs"


def exporter_dict(quant_config) -> dict:
    """What QuarkSafetensorsExporter writes as config.json's quantization_config for ``quant_config``."""
    from quark.torch.export.api import QuarkSafetensorsExporter
    from quark.torch.export.config.config import JsonExporterConfig

    # As SafetensorsExporter._export_impl builds it (quark/torch/export/api.py).
    kv_cache_group = (getattr(quant_config, "kv_cache_group", [])
                      if getattr(quant_config, "kv_cache_quant_config", {}) else [])
    json_config = JsonExporterConfig(weight_format="real_quantized", pack_method="reorder",
                                     kv_cache_group=kv_cache_group,
                                     min_kv_scale=getattr(quant_config, "min_kv_scale", 0.0))
    exporter = object.__new__(QuarkSafetensorsExporter)  # the method reads nothing from the instance
    d = exporter._prepare_quantization_config(quant_config, json_config)
    return json.loads(json.dumps(d))  # what json.dump writes and reads back (tuples -> lists)


def template_configs() -> dict:
    from quark.torch import LLMTemplate

    template = LLMTemplate.get("llama")
    out = {}
    for scheme in LLMTemplate._SUPPORTED_SCHEMES:
        if scheme == "fp4_block16_scale_e4m3":  # alias: the same QuantizationScheme object as "nvfp4"
            continue
        out[scheme] = template.get_config(scheme=scheme)
    out["fp8_kv_fp8"] = template.get_config(scheme="fp8", kv_cache_scheme="fp8")
    out["int4_wo_128_exclude"] = template.get_config(
        scheme="int4_wo_128", exclude_layers=["lm_head", "*mlp.gate", "*mlp.gate.*", "model.layers.0.*"])
    return out


def old_example_configs() -> tuple[dict, dict]:
    """The w_* recipes of customized_configuration.py @9234960c, built with Quark 0.13's classes."""
    from quark.torch.quantization import (BFP16Spec, FP4PerGroupSpec, FP8E4M3PerTensorSpec, Int2PerGroupSpec,
                                          Int4PerGroupSpec, Int8PerChannelSpec, Int8PerTensorSpec, MX6Spec,
                                          OCP_MXFP6E2M3Spec, OCP_MXFP6E3M2Spec, OCP_MXFP8E4M3Spec, OCP_MXINT8Spec,
                                          QConfig, QLayerConfig, Uint4PerGroupSpec)

    int_kw = dict(scale_type="float", round_method="half_even")
    recipes = {
        "w_fp8_a_fp8": lambda: dict(
            weight=FP8E4M3PerTensorSpec(observer_method="min_max", is_dynamic=False),
            input_tensors=FP8E4M3PerTensorSpec(observer_method="min_max", is_dynamic=False)),
        "w_int8_a_int8_per_tensor_sym": lambda: dict(
            weight=Int8PerTensorSpec(observer_method="min_max", symmetric=True, is_dynamic=False, **int_kw),
            input_tensors=Int8PerTensorSpec(observer_method="min_max", symmetric=True, is_dynamic=False, **int_kw)),
        "w_int8_per_channel_a_int8_per_tensor_sym": lambda: dict(
            weight=Int8PerChannelSpec(symmetric=True, ch_axis=0, is_dynamic=False, **int_kw),
            input_tensors=Int8PerTensorSpec(observer_method="min_max", symmetric=True, is_dynamic=False, **int_kw)),
        "w_int8_a_int8_per_token_dynamic": lambda: dict(
            weight=Int8PerChannelSpec(symmetric=True, ch_axis=0, is_dynamic=False, **int_kw),
            input_tensors=Int8PerChannelSpec(symmetric=True, ch_axis=1, is_dynamic=True, **int_kw)),
        "w_int4_per_group_sym": lambda: dict(
            weight=Int4PerGroupSpec(symmetric=True, ch_axis=1, is_dynamic=False, group_size=128, **int_kw)),
        "w_uint4_per_group_asym": lambda: dict(
            weight=Uint4PerGroupSpec(symmetric=False, ch_axis=1, is_dynamic=False, group_size=128, **int_kw)),
        "w_int2_per_group_asym": lambda: dict(
            weight=Int2PerGroupSpec(symmetric=False, ch_axis=1, is_dynamic=False, group_size=128, **int_kw)),
        "w_mxfp4_a_mxfp4": lambda: dict(
            weight=FP4PerGroupSpec(ch_axis=-1, group_size=32, scale_format="e8m0", scale_calculation_mode="even",
                                   is_dynamic=False),
            input_tensors=FP4PerGroupSpec(ch_axis=-1, group_size=32, scale_format="e8m0",
                                          scale_calculation_mode="even", is_dynamic=True)),
        "w_mxfp6_e2m3_a_mxfp6_e2m3": lambda: dict(
            weight=OCP_MXFP6E2M3Spec(ch_axis=-1, scale_calculation_mode="even", is_dynamic=False),
            input_tensors=OCP_MXFP6E2M3Spec(ch_axis=-1, scale_calculation_mode="even", is_dynamic=True)),
        "w_mxfp6_e3m2_a_mxfp6_e3m2": lambda: dict(
            weight=OCP_MXFP6E3M2Spec(ch_axis=-1, scale_calculation_mode="even", is_dynamic=False),
            input_tensors=OCP_MXFP6E3M2Spec(ch_axis=-1, scale_calculation_mode="even", is_dynamic=True)),
        "w_mxfp8_a_mxfp8": lambda: dict(
            weight=OCP_MXFP8E4M3Spec(ch_axis=-1, is_dynamic=False),
            input_tensors=OCP_MXFP8E4M3Spec(ch_axis=-1, is_dynamic=True)),
        "w_mxint8": lambda: dict(
            weight=OCP_MXINT8Spec(scale_calculation_mode="even", ch_axis=-1, is_dynamic=False)),
        # The example's recipes for these pass is_dynamic=, which Quark 0.13's MX6Spec / BFP16Spec reject.
        "w_mx6_a_mx6": lambda: dict(
            weight=MX6Spec(ch_axis=-1, block_size=32, is_dynamic=False),
            input_tensors=MX6Spec(ch_axis=-1, block_size=32, is_dynamic=True)),
        "w_bfp16_a_bfp16": lambda: dict(
            weight=BFP16Spec(is_dynamic=False, ch_axis=-1), input_tensors=BFP16Spec(is_dynamic=True, ch_axis=-1)),
    }
    out, skipped = {}, {}
    for name, recipe in recipes.items():
        try:
            layer = {k: v.to_quantization_spec() for k, v in recipe().items()}
        except TypeError as e:  # the recipe does not run on this Quark version
            skipped[name] = f"{type(e).__name__}: {e}"
            continue
        out[name] = QConfig(global_quant_config=QLayerConfig(**layer), layer_quant_config={},
                            kv_cache_quant_config={}, kv_cache_group=[], min_kv_scale=0.0,
                            softmax_quant_spec=None, exclude=["lm_head"], algo_config=[])
    return out, skipped


def check_export(configs: dict, names: list[str]) -> None:
    """Quantize and export a tiny random Llama with Quark; config.json must hold exactly the fixture dict."""
    import torch
    from quark.torch import ModelQuantizer, export_safetensors
    from transformers import LlamaConfig, LlamaForCausalLM

    for name in names:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
        model = LlamaForCausalLM(cfg).eval()
        calib = [torch.randint(0, 128, (1, 16)) for _ in range(2)]
        model = ModelQuantizer(configs[name]).quantize_model(model, calib)
        model = ModelQuantizer(configs[name]).freeze(model)
        with tempfile.TemporaryDirectory() as d, torch.no_grad():
            export_safetensors(model=model, output_dir=d, custom_mode="quark", weight_format="real_quantized",
                               pack_method="reorder")
            written = json.loads(pathlib.Path(d, "config.json").read_text())["quantization_config"]
        expected = json.loads((OUT / f"{name}.json").read_text())
        if written != expected:
            raise SystemExit(f"{name}: config.json differs from the fixture:\n{json.dumps(written, indent=1)}")
        print(f"export check ok: {name}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the files on disk; write nothing")
    ap.add_argument("--check-export", action="store_true", help="also export a tiny model (fp8_kv_fp8, mxfp4)")
    args = ap.parse_args()

    import quark

    configs = template_configs()
    old, skipped = old_example_configs()
    configs.update(old)
    bad = []
    for name, qc in sorted(configs.items()):
        text = json.dumps(exporter_dict(qc), indent=2) + "\n"
        path = OUT / f"{name}.json"
        if args.check:
            if not path.exists() or path.read_text() != text:
                bad.append(name)
        else:
            path.write_text(text)
    for name, why in skipped.items():
        print(f"skipped {name}: the example's recipe fails on amd-quark {quark.__version__}: {why}")
    if bad:
        print("differ from Quark's output:", ", ".join(bad))
        return 1
    print(f"{len(configs)} fixtures {'match' if args.check else 'written'} (amd-quark {quark.__version__})")
    if args.check_export:
        check_export(configs, ["fp8_kv_fp8", "mxfp4"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

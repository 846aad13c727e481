"""Regenerate ``quark_exports/``: tiny random Llamas quantized and exported by AMD Quark 0.13 itself, with the
logits Quark's own loader (transformers + amd-quark) computes from each export.

CI does not run this (it needs amd-quark); run it in the separate venv of ``make_quark_configs.py``:

    /tmp/quarkvenv/bin/python tests/formats/data/make_quark_exports.py

Each ``quark_exports/<scheme>/`` holds what ``export_safetensors(..., custom_mode="quark",
weight_format="real_quantized", pack_method="reorder")`` writes (``config.json``, ``generation_config.json``,
``model.safetensors``) plus ``ids.npy`` (int64 [1, 24]) and ``quark_logits.npy`` (float32 logits of Quark's
``AutoModelForCausalLM.from_pretrained(dir)`` on those ids). ``tests/adapters/io/test_export.py`` checks that
``qcore.adapters.load_quark`` reads each with the same logits, without amd-quark.
"""

import pathlib
import shutil
import tempfile

import numpy as np
import torch

OUT = pathlib.Path(__file__).resolve().parent / "quark_exports"
SCHEMES = {"int8": ("int8", None), "fp8_kv_fp8": ("fp8", "fp8"), "uint4_wo_64": ("uint4_wo_64", None),
           "int4_wo_32": ("int4_wo_32", None), "mxfp4": ("mxfp4", None), "mxfp6_e2m3": ("mxfp6_e2m3", None),
           "ptpc_fp8": ("ptpc_fp8", None)}


def main() -> None:
    from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    tmpl = LLMTemplate.get("llama")
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    for name, (scheme, kv) in SCHEMES.items():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
        model = LlamaForCausalLM(cfg).eval()
        qc = tmpl.get_config(scheme=scheme, kv_cache_scheme=kv) if kv else tmpl.get_config(scheme=scheme)
        calib = [torch.randint(0, 128, (1, 16)) for _ in range(2)]
        model = ModelQuantizer(qc).quantize_model(model, calib)
        model = ModelQuantizer(qc).freeze(model)
        d = OUT / name
        shutil.rmtree(d, ignore_errors=True)
        with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
            export_safetensors(model=model, output_dir=tmp, custom_mode="quark", weight_format="real_quantized",
                               pack_method="reorder")
            d.mkdir(parents=True)
            for f in ("config.json", "generation_config.json", "model.safetensors"):
                shutil.copy(pathlib.Path(tmp, f), d / f)
        loaded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = loaded(ids).logits
        np.save(d / "ids.npy", ids.numpy())
        np.save(d / "quark_logits.npy", logits.numpy())
        print("wrote", d)


if __name__ == "__main__":
    main()

"""qcore's fused-MoE-expert checkpoints against AMD Quark 0.13 (transformers 5.23's Mixtral; issue 22).

- Quark 0.13 leaves transformers 5's fused 3-D experts float (its fp8 export of a Mixtral writes them under their
  fused names): the gap qcore's ``QuantExperts`` fills.
- A qcore export whose experts are kept float (excluded) writes them per expert, as ``save_pretrained`` does;
  Quark's loader (transformers + amd-quark) reads it with qcore's logits, bit for bit.
- A qcore export with quantized experts says ``quant_method: "qcore"``: transformers' Quark integration does not
  read quantized fused experts (it merges the per-expert codes into float parameters and drops their scales).
- qcore reads Quark's Mixtral export (experts float under their fused names) with Quark's loader's logits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.interop

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _mixtral(path):
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).eval().save_pretrained(path)
    return path


def test_quark_and_qcore_on_a_fused_experts_mixtral(quark_python, run_quark, tmp_path):
    import qcore.adapters as A
    from safetensors import safe_open

    src = _mixtral(tmp_path / "float")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    np.save(tmp_path / "ids.npy", ids.numpy())
    np.save(tmp_path / "calib.npy", torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1)).numpy())
    kept = transformers.MixtralForCausalLM.from_pretrained(src).eval()
    A.quantize_model(kept, A.preset("fp8").replace(exclude=("lm_head", "re:.*\\.experts")), [ids], progress=False)
    A.export_hf(kept, tmp_path / "kept")
    with torch.no_grad():
        want = kept(ids).logits.numpy()
    full = transformers.MixtralForCausalLM.from_pretrained(src).eval()
    A.quantize_model(full, "fp8", [ids], progress=False)
    A.export_hf(full, tmp_path / "full")
    assert json.loads((tmp_path / "full" / "config.json").read_text())["quantization_config"]["quant_method"] == "qcore"

    run_quark(quark_python, "export", "--model", src, "--calib", tmp_path / "calib.npy", "--out", tmp_path / "qx",
              "--scheme", "fp8", timeout=900)
    with safe_open(str(tmp_path / "qx" / "fp8" / "model.safetensors"), "pt") as f:
        experts = {k: f.get_slice(k).get_dtype() for k in f.keys() if ".experts." in k}
    assert experts == {f"model.layers.{i}.mlp.experts.{p}": "F32" for i in (0, 1) for p in ("gate_up_proj",
                                                                                         "down_proj")}
    run = run_quark(quark_python, "logits", "--ids", tmp_path / "ids.npy", "--out", tmp_path / "logits",
                    tmp_path / "kept", tmp_path / "qx" / "fp8", timeout=900)
    recs = {r["name"]: r for r in run.results("logits")}
    assert recs["kept"]["modules"].get("QParamsLinear") == 8  # the attention projections, quantized by its loader
    assert np.array_equal(np.load(tmp_path / "logits" / "kept.npy"), want)
    theirs = A.from_pretrained(tmp_path / "qx" / "fp8")
    assert "model.layers.0.mlp.experts" in theirs.qcore_config.exclude and A.unquantized_weights(theirs) == []
    with torch.no_grad():
        got = theirs(ids).logits.numpy()
    assert np.array_equal(got, np.load(tmp_path / "logits" / "fp8.npy"))

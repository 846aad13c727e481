"""AMD Quark 0.13 reads qcore's layerwise mixed-precision export (issue 11, AMP): a tiny Llama with MXFP4 and fp8
layers chosen by ``amp_config`` is exported with ``export_hf`` (per-layer ``layer_quant_config``) and loaded by
transformers + amd-quark in Quark's own venv; its logits match qcore's frozen model within 1e-3 of the logit range,
and Quark builds a quantized layer for every Linear."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytestmark = pytest.mark.interop

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_quark_reads_a_qcore_amp_export(quark_python, run_quark, tiny_llama_dir, calib_ids, eval_ids, tmp_path):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import qcore.adapters as A
    from qcore.adapters.passes.amp import amp_config

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.from_numpy(np.load(calib_ids))
    calib = [ids[i:i + 1] for i in range(ids.shape[0])]
    schemes = ["w_mxfp4_a_mxfp4", "w_fp8_a_fp8"]
    cfg = amp_config(model, schemes, calib[:2], target_bits=6.0, progress=False)
    kinds = {repr(v) for v in cfg.by_name.values()}
    assert len(cfg.by_name) == 14 and len(kinds) == 2  # a real mix
    A.quantize_model(model, cfg, calib, progress=False)
    A.freeze(model)
    A.export_hf(model, tmp_path / "amp")
    lqc = json.loads((tmp_path / "amp" / "config.json").read_text())["quantization_config"]["layer_quant_config"]
    assert {v["weight"]["dtype"] for v in lqc.values()} == {"fp4", "fp8_e4m3"}
    ev = torch.from_numpy(np.load(eval_ids))
    with torch.no_grad():
        ours = model(ev).logits.numpy()
    loads = run_quark(quark_python, "logits", "--ids", eval_ids, "--out", tmp_path / "quark", tmp_path / "amp",
                      timeout=1800)
    rec = loads.results("logits")[0]
    assert rec["quant_method"] == "quark"
    assert rec["modules"].get("QParamsLinear", 0) >= 14, rec["modules"]
    got = np.load(tmp_path / "quark.npy") if (tmp_path / "quark.npy").exists() else \
        np.load(tmp_path / "quark" / "amp.npy")
    rng = float(np.ptp(ours))
    diff = float(np.abs(got - ours).max())
    print(f"Quark on qcore's AMP export: max |diff| {diff:.3g}, logit range {rng:.3g}")
    assert got.shape == ours.shape and diff <= 1e-3 * rng

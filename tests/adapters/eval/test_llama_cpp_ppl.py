"""A GGUF export evaluated as llama.cpp computes it (``qcore.adapters.eval.llama_cpp``), and the report's
``ppl_llama_cpp``.

Default run: the emulation's parts on a tiny Llama (what each module sees, nothing left patched, refusals) and the
report field. Marker ``gguf_client``: for every family llama.cpp runs, a trained tiny model with outlier
activation channels (``gguf_kit.with_outliers``: 8-bit activation blocks then hold values 100 times their
neighbours', as in real LLMs), exported as Q4_1 (the issue's uint4 g64) and Q4_K: qcore's prediction is within
1% of llama-cpp-python's perplexity on the same tokens (measured: 0.01% at most, bench/results/GGUF_LLAMA_PPL.md).
"""

import copy
import json
import math
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")


from qcore import ggml_act  # noqa: E402
from qcore.adapters import quantize_model  # noqa: E402
from qcore.adapters.eval import evaluate as E  # noqa: E402
from qcore.adapters.eval.llama_cpp import (LlamaCppNumerics, computing_as_llama_cpp, gguf_matmul_types,  # noqa: E402
                                           llama_cpp_perplexity)
from qcore.adapters.io.gguf import export_gguf, from_gguf  # noqa: E402
from qcore.adapters.presets import preset  # noqa: E402
from qcore.cli import main  # noqa: E402

from gguf_kit import WIDE_FAMILIES, tiny_tokenizer, trained_family, text_ids, wide_family, with_outliers  # noqa: E402


@pytest.fixture(scope="module")
def q4_1_file(tmp_path_factory):
    """An untrained 256-wide Llama with outlier channels, uint4_wo_64 (-> Q4_1 in the file), and its GGUF path."""
    m = with_outliers(wide_family("llama"), "llama", alpha=100.0)
    quantize_model(m, preset("uint4_wo_64"), None, progress=False)
    path = tmp_path_factory.mktemp("q41") / "m.gguf"
    export_gguf(m, path, tokenizer=tiny_tokenizer())
    return path


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_each_product_sees_the_rounded_activations_and_nothing_stays_patched(q4_1_file):
    model = from_gguf(q4_1_file, dtype=torch.float32)
    types = gguf_matmul_types(model)
    assert types["model.layers.0.self_attn.q_proj"] == ("Q4_1", ("blk.0.attn_q.weight",))
    assert types["lm_head"][0] == "F32" and len(types) == 2 * 7 + 1
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)) * 3
    x[:, 5::32] *= 100
    with computing_as_llama_cpp(model, numerics=LlamaCppNumerics(offsets=False, kv_cache=False)):
        got = q(x)
        rounded = _logits(model, ids)
    want = q(ggml_act.activation_values(x, "Q8_1"))  # the same module, unpatched, on the rounded input
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with computing_as_llama_cpp(model, numerics=LlamaCppNumerics(activations=False, offsets=False, kv_cache=False)):
        torch.testing.assert_close(_logits(model, ids), before, rtol=0, atol=0)  # every part off: the file
    after = _logits(model, ids)
    torch.testing.assert_close(after, before, rtol=0, atol=0)  # put back on exit
    assert (rounded - before).abs().max() > 1e-4  # the outliers make the rounding visible
    assert model.config._attn_implementation != "qcore_llama_cpp"


def test_q4_1_offsets_add_the_q8_1_residual(q4_1_file):
    model = from_gguf(q4_1_file, dtype=torch.float32)
    q = model.model.layers[1].mlp.down_proj  # 512 inputs: 16 blocks
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(2))
    with computing_as_llama_cpp(model, numerics=LlamaCppNumerics(offsets=False, kv_cache=False)):
        plain = q(x)
    with computing_as_llama_cpp(model, numerics=LlamaCppNumerics(kv_cache=False)):
        full = q(x)
    import gguf
    t = next(t for t in gguf.GGUFReader(q4_1_file).tensors if t.name == "blk.1.ffn_down.weight")
    m = np.ascontiguousarray(np.asarray(t.data).reshape(256, 16, 20)[..., 2:4]).view(np.float16)[..., 0]
    want = plain + ggml_act.q8_1_residual(x) @ torch.from_numpy(m.astype(np.float32)).T
    torch.testing.assert_close(full, want, rtol=0, atol=1e-6)
    assert (full - plain).abs().max() > 0


def test_refusals(q4_1_file, tmp_path):
    with pytest.raises(ValueError, match="needs a model loaded by from_gguf.*LlamaForCausalLM"):
        with computing_as_llama_cpp(wide_family("llama")):
            pass
    with pytest.raises(ValueError, match="offsets=True. needs activations=True"):
        LlamaCppNumerics(activations=False)
    with pytest.raises(ValueError, match="variant must be one of .*'arm'"):
        LlamaCppNumerics(variant="arm")
    with pytest.raises(TypeError, match="kv_cache must be True or False, got 1"):
        LlamaCppNumerics(kv_cache=1)
    with pytest.raises(ValueError, match="float32 weights"):
        with computing_as_llama_cpp(from_gguf(q4_1_file, dtype=torch.bfloat16)):
            pass
    with pytest.raises(ValueError, match="no such GGUF file"):
        llama_cpp_perplexity(tmp_path / "none.gguf", None, token_ids=torch.arange(300) % 128)


def test_the_report_gives_the_prediction_for_gguf_exports_only(lm_dir, tmp_path, capsys):
    text = lm_dir.parent / "text.txt"
    base = ["quantize", "--model", str(lm_dir), "--scheme", "uint4_wo_64", "--eval", "ppl", "--eval-text",
            str(text), "--seq-len", "64", "--no-progress", "--calib-samples", "2"]
    rep = tmp_path / "r.json"
    assert main(base + ["--export", "gguf", "--output", str(tmp_path / "g"), "--report", str(rep)]) == 0
    r = json.loads(rep.read_text())
    assert re.search(rf"perplexity in llama.cpp +{r['ppl_llama_cpp']:.3f} ", capsys.readouterr().out)
    tok = transformers.AutoTokenizer.from_pretrained(lm_dir)
    ids = E.protocol_token_ids(tok, text=text.read_text())
    want = llama_cpp_perplexity(tmp_path / "g" / "model.gguf", tok, token_ids=ids, seq_len=64,
                                windows=range(r["eval_windows"]), progress=False)
    assert r["ppl_llama_cpp"] == want  # the written file, the same windows
    assert math.isfinite(want) and want != r["ppl"] and want == pytest.approx(r["ppl"], rel=0.05)
    rep2 = tmp_path / "r2.json"
    assert main(base + ["--export", "hf", "--output", str(tmp_path / "h"), "--report", str(rep2)]) == 0
    assert json.loads(rep2.read_text())["ppl_llama_cpp"] is None
    assert "llama.cpp" not in capsys.readouterr().out


# -- against llama.cpp itself -------------------------------------------------------------------------------------

def _llama_cpp_ppl(path, ids, spans) -> float:
    from qcore.algorithms.metrics import perplexity_from_nll
    from qcore.testing.ggml import llama_cpp_nll
    nll, n, _ = llama_cpp_nll(path, ids, spans, threads=1)
    return perplexity_from_nll(nll, n)


@pytest.mark.gguf_client
@pytest.mark.parametrize("fam", list(WIDE_FAMILIES))
def test_the_prediction_is_llama_cpps_perplexity(fam, tmp_path):
    pytest.importorskip("llama_cpp")
    import qcore
    from qcore.adapters.config import LayerConfig, ModelConfig
    from qcore.algorithms.metrics import token_windows
    ids = text_ids()
    base = with_outliers(trained_family(fam, steps=60, ids=ids), fam, alpha=100.0)
    ev = dict(token_ids=ids, seq_len=128, windows=range(4), progress=False)
    spans = token_windows(ids.numel(), seq_len=128, windows=range(4))
    for kind, config in (("Q4_1", preset("uint4_wo_64")),
                         ("Q4_K", ModelConfig(LayerConfig(weight=qcore.make_spec("q4_k"))))):
        m = copy.deepcopy(base)
        quantize_model(m, config, None, progress=False)
        path = tmp_path / f"{kind}.gguf"
        info = export_gguf(m, path, tokenizer=tiny_tokenizer())
        assert kind in set(info.types.values())
        predicted = llama_cpp_perplexity(path, None, **ev)
        llama = _llama_cpp_ppl(path, ids, spans)
        file = E.perplexity(from_gguf(path), None, **ev)
        assert predicted == pytest.approx(llama, rel=0.01), (kind, predicted, llama, file)
        assert predicted == pytest.approx(llama, rel=1e-3), (kind, predicted, llama, file)  # measured: 1e-4

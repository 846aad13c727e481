"""Evaluation speed (issue 23): the vocabulary-chunked loss against the plain one, frozen weights dequantized once
per evaluation, and the on-disk float-perplexity cache (hit, miss, invalidation, --no-cache, corrupt entries).

The chunked loss sums in another order than ``cross_entropy`` over the whole logits: the perplexities agree within
``REL`` (float32 rounding; docs/adapters.md, "Evaluation speed"). Where the chunked path cannot reproduce the
model's logits the plain computation runs, and the figure is bit-identical to it.
"""

import json
import math
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qcore.adapters import freeze, preset, quantize_model, quantized_modules  # noqa: E402
from qcore.adapters.eval import evaluate as E  # noqa: E402
from qcore.adapters.eval import ppl_cache  # noqa: E402

REL = 2e-6  # the chunked loss against the plain one: the same ops per token, the sum in chunks
V = 300  # a vocabulary larger than one test chunk


def _cfg(name):
    t = transformers
    small = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=128)
    if name == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**small, num_key_value_heads=2))
    if name == "gemma2":
        return t.Gemma2ForCausalLM(t.Gemma2Config(**small, num_key_value_heads=2, head_dim=16,
                                                  final_logit_softcapping=0.05))  # a cap the random logits reach
    if name == "gemma3":
        return t.Gemma3ForCausalLM(t.Gemma3TextConfig(**small, num_key_value_heads=1, head_dim=16,
                                                      final_logit_softcapping=0.05))  # a cap the random logits reach
    if name == "gpt2":  # a tied head
        return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                              bos_token_id=0, eos_token_id=0))
    if name == "cohere":  # logits * logit_scale
        return t.CohereForCausalLM(t.CohereConfig(**small, num_key_value_heads=2, logit_scale=0.5))
    if name == "gemma3_vlm":  # a VLM evaluated on text: its forward applies no softcapping (transformers 5)
        text = t.Gemma3TextConfig(**small, num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.05)
        vision = t.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      image_size=32, patch_size=8)
        return t.Gemma3ForConditionalGeneration(t.Gemma3Config(text_config=text, vision_config=vision,
                                                               mm_tokens_per_image=4, image_token_index=V - 1,
                                                               boi_token_index=V - 3, eoi_token_index=V - 2))
    raise KeyError(name)


def _model(name, seed=0):
    torch.manual_seed(seed)
    return _cfg(name).eval()


def _ids(n=400, seed=1):
    return torch.randint(0, V - 3, (n,), generator=torch.Generator().manual_seed(seed))  # no image tokens


def _reference_ppl(model, ids, *, seq_len=64, windows=range(5), batch_size=1):
    """The landed loop: whole logits, cross entropy per batch of windows."""
    nll, n = 0.0, 0
    spans = [(w * seq_len, (w + 1) * seq_len) for w in windows]
    with torch.inference_mode():
        for i in range(0, len(spans), batch_size):
            batch = torch.stack([ids[a:b] for a, b in spans[i:i + batch_size]])
            nll += E._reference_window_nll(model, batch)
            n += batch.shape[0] * (seq_len - 1)
    return math.exp(nll / n)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(E, "LOSS_CHUNK_ELEMENTS", 63 * 37)  # 37 vocabulary entries per chunk: 9 chunks


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(ppl_cache.ENV_VAR, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("name", ["llama", "gemma2", "gemma3", "gpt2", "cohere", "gemma3_vlm"])
def test_chunked_loss_equals_the_whole_logits_loss(name, small_chunks):
    model, ids = _model(name), _ids()
    loss = E._WindowLoss(model)
    assert loss.head is model.get_output_embeddings()  # the chunked path is taken
    assert (loss.post is not None) == (name in ("gemma2", "gemma3", "cohere"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        for bs in (1, 2):
            got = E.perplexity(model, None, token_ids=ids, seq_len=64, windows=range(5), batch_size=bs,
                               progress=False)
            want = _reference_ppl(model, ids, batch_size=bs)
            assert got == pytest.approx(want, rel=REL), (name, bs)
    assert loss.head is not None


def test_softcapping_matters_and_is_applied(small_chunks):
    """Without its softcapping the figure would differ by far more than the tolerance: the chunked path applies it."""
    model, ids = _model("gemma2"), _ids()
    model.config.final_logit_softcapping = 0.05  # a cap the random logits reach
    got = E.perplexity(model, None, token_ids=ids, seq_len=64, windows=range(3), progress=False)
    assert got == pytest.approx(_reference_ppl(model, ids, windows=range(3)), rel=REL)
    model.config.final_logit_softcapping = None
    uncapped = _reference_ppl(model, ids, windows=range(3))
    assert abs(got / uncapped - 1) > 100 * REL


def test_unknown_logit_processing_falls_back_to_the_whole_logits_bit_identically():
    class Shifted(transformers.LlamaForCausalLM):  # post-processing the chunked path does not know
        def forward(self, *a, **kw):
            out = super().forward(*a, **kw)
            out.logits = out.logits * 1.5 + 0.25
            return out

    torch.manual_seed(0)
    model = Shifted(_model("llama").config).eval()
    ids = _ids()
    with pytest.warns(RuntimeWarning, match="does not reproduce"):
        got = E.perplexity(model, None, token_ids=ids, seq_len=64, windows=range(3), progress=False)
    assert got == _reference_ppl(model, ids, windows=range(3))


def test_an_encoder_is_refused_before_any_forward(zoo):
    bert = zoo.tiny_bert()
    calls = []
    bert.register_forward_pre_hook(lambda m, a: calls.append(1))
    with pytest.raises(TypeError, match="causal LM with an output head.*BertModel"):
        E.perplexity(bert, None, token_ids=torch.arange(100) % 64, seq_len=10, windows=range(2), progress=False)
    assert calls == []


@pytest.mark.parametrize("scheme,exclude", [("uint4_wo_64", None), ("uint4_wo_64", ()),
                                            ("w_int8_a_int8_per_token_dynamic", ()), ("ptpc_fp8", None),
                                            ("w_mxfp4_a_mxfp4", None)])
def test_fake_quantized_and_frozen_models_evaluate_as_the_landed_loop(scheme, exclude, small_chunks):
    """exclude=(): the head is quantized too (weight-only: chunked with its effective weight; activations
    quantized: the plain path, bit-identical). Frozen: the same figure as fake-quantized, weights dequantized
    once and the kept copies dropped afterwards."""
    model, ids = _model("llama"), _ids()
    config = preset(scheme)
    if exclude is not None:
        config = config.replace(exclude=exclude)
    calib = [ids[i * 32:(i + 1) * 32].reshape(1, -1) for i in range(2)]
    quantize_model(model, config, calib, progress=False)
    head_plain = exclude is not None and "a_" in scheme
    got = E.perplexity(model, None, token_ids=ids, seq_len=64, windows=range(4), progress=False)
    want = _reference_ppl(model, ids, windows=range(4))
    assert got == want if head_plain else got == pytest.approx(want, rel=REL)
    assert (E._WindowLoss(model).head is None) == head_plain
    freeze(model)
    mods = list(quantized_modules(model).values())
    assert all(m.frozen and not m.keep_dequantized for m in mods)
    assert E.perplexity(model, None, token_ids=ids, seq_len=64, windows=range(4), progress=False) == got
    assert not any(m.keep_dequantized for m in mods)  # restored; the dequantized copies dropped
    mods[0].keep_dequantized = True  # a caller's own setting is kept
    E.perplexity(model, None, token_ids=ids, seq_len=64, windows=range(1), progress=False)
    assert mods[0].keep_dequantized is True
    with pytest.raises(TypeError, match="keep_dequantized"):
        mods[0].keep_dequantized = 1


# -- the float-baseline cache -----------------------------------------------------------------------------------


def _counting(model):
    calls = []
    model.register_forward_pre_hook(lambda m, a, k: calls.append(1), with_kwargs=True)
    return calls


def test_cache_hit_miss_and_invalidation(cache_dir):
    model, ids = _model("llama"), _ids()
    calls = _counting(model)

    def ppl(m=model, **kw):
        kw = dict(dict(token_ids=ids, seq_len=64, windows=range(3), progress=False, cache=True), **kw)
        return E.perplexity(m, None, **kw)

    first = ppl()
    assert len(calls) == 3 and len(list((cache_dir / "ppl").glob("*.json"))) == 1
    assert ppl() == first and len(calls) == 3  # a hit: no forward
    assert ppl(cache=False) == first and len(calls) == 6  # bypassed: computed, nothing written
    assert len(list((cache_dir / "ppl").glob("*.json"))) == 1
    # each of these changes the figure's inputs: a miss, computed and stored
    for kw in (dict(windows=range(2)), dict(seq_len=32), dict(token_ids=_ids(seed=2)), dict(batch_size=3)):
        before = len(calls)
        ppl(**kw)
        assert len(calls) > before, kw
        after = len(calls)
        ppl(**kw)
        assert len(calls) == after, kw  # and a hit the second time
    n = len(calls)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 0.5  # one weight changed
    changed = ppl()
    assert len(calls) == n + 3 and changed != first
    same = _model("llama")  # a fresh copy of the original bytes (another object, no path): a hit
    s_calls = _counting(same)
    assert ppl(same) == first and s_calls == []
    bf16 = _model("llama").to(torch.bfloat16)  # the dtype changes the bytes
    b_calls = _counting(bf16)
    ppl(bf16)
    assert len(b_calls) == 3


def test_cache_ignores_quantized_models(cache_dir):
    model, ids = _model("llama"), _ids()
    quantize_model(model, preset("uint4_wo_32"), progress=False)
    E.perplexity(model, None, token_ids=ids, seq_len=64, windows=range(2), progress=False, cache=True)
    assert not (cache_dir / "ppl").exists()


@pytest.mark.parametrize("content", ["{not json", json.dumps({"key": "other", "perplexity": 3.0}),
                                     json.dumps({"perplexity": "x"}), "", "\xff"])
def test_a_corrupt_entry_is_recomputed_with_a_warning_and_rewritten(cache_dir, content):
    model, ids = _model("llama"), _ids()
    kw = dict(token_ids=ids, seq_len=64, windows=range(2), progress=False, cache=True)
    first = E.perplexity(model, None, **kw)
    (entry,) = (cache_dir / "ppl").glob("*.json")
    entry.write_bytes(content.encode("latin-1"))
    calls = _counting(model)
    with pytest.warns(RuntimeWarning, match="corrupt entry"):
        assert E.perplexity(model, None, **kw) == first
    assert len(calls) == 2
    assert json.loads(entry.read_text())["perplexity"] == first  # rewritten
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # nothing staged left beside it


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv(ppl_cache.ENV_VAR, str(tmp_path / "a"))
    assert ppl_cache.cache_dir() == tmp_path / "a"
    monkeypatch.delenv(ppl_cache.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ppl_cache.cache_dir() == tmp_path / "xdg" / "qcore"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ppl_cache.cache_dir() == tmp_path / "home" / ".cache" / "qcore"


def test_an_unwritable_cache_warns_and_still_returns_the_figure(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(ppl_cache.ENV_VAR, str(blocker))
    model, ids = _model("llama"), _ids()
    with pytest.warns(RuntimeWarning, match="could not write"):
        got = E.perplexity(model, None, token_ids=ids, seq_len=64, windows=range(1), progress=False, cache=True)
    assert got == pytest.approx(_reference_ppl(model, ids, windows=range(1)), rel=REL)


def test_cache_argument_is_checked():
    with pytest.raises(TypeError, match="cache must be True or False"):
        E.perplexity(_model("llama"), None, token_ids=_ids(), seq_len=64, windows=range(1), cache="yes")


def test_quantize_and_report_and_the_cli_use_the_cache_for_the_float_baseline(lm_dir, cache_dir, capsys):
    from qcore.adapters import quantize_and_report
    from qcore.cli import main
    text = lm_dir.parent / "text.txt"
    opts = dict(eval_text=text, seq_len=64, calib_samples=0, progress=False)
    r1 = quantize_and_report(str(lm_dir), "uint4_wo_32", **opts)
    entries = list((cache_dir / "ppl").glob("*.json"))
    assert len(entries) == 1  # the float baseline only, not the quantized figure
    assert json.loads(entries[0].read_text())["perplexity"] == r1.ppl_baseline
    entries[0].write_text(json.dumps({"key": entries[0].stem, "perplexity": 123.5}))  # a planted figure is read
    assert quantize_and_report(str(lm_dir), "uint4_wo_32", **opts).ppl_baseline == 123.5
    assert quantize_and_report(str(lm_dir), "uint4_wo_32", cache=False, **opts).ppl_baseline == r1.ppl_baseline
    with pytest.raises(TypeError, match="cache"):
        quantize_and_report(str(lm_dir), "uint4_wo_32", cache="no", **opts)
    base = ["quantize", "--model", str(lm_dir), "--scheme", "uint4_wo_32", "--eval-text", str(text), "--seq-len",
            "64", "--calib-samples", "0", "--no-progress"]
    assert main(base) == 0
    assert "123.500 ->" in capsys.readouterr().out
    assert main(base + ["--no-cache"]) == 0
    assert f"{r1.ppl_baseline:.3f} ->" in capsys.readouterr().out
    ev = ["eval", "--model", str(lm_dir), "--eval-text", str(text), "--seq-len", "64", "--no-progress"]
    assert main(ev) == 0  # qcore eval of the float model on the same windows: the same entry
    assert "123.5000" in capsys.readouterr().out
    assert main(ev + ["--no-cache"]) == 0
    assert f"{r1.ppl_baseline:.4f}" in capsys.readouterr().out

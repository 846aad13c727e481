"""Every family of issue 22 end to end, on tiny random models (``conftest.FAMILIES``): each preset quantizes every
weight it should (``unquantized_weights`` is empty: nothing silently left float), each algorithm runs or refuses
before any work naming the family, and each export writes a file that loads back with the same logits or refuses
before writing anything.

The expected outcome of every (family, algorithm) and (family, export) cell is the table "Families by feature" in
docs/adapters.md: the documentation is the test's expectation, so the two cannot drift apart. "yes" means it
runs (and the checks above hold); "no" means it is refused before work (the model untouched, the message naming
the family's ``model_type`` or model class, nothing written).
"""

import copy
import pathlib
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from qcore.adapters import (excluded_weights, preset, quantize_model, unquantized_weights)  # noqa: E402

FAMILY_NAMES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2", "gpt_neox",
                "opt", "bert", "mixtral", "qwen2_moe", "qwen3_moe", "llava", "gemma3", "qwen2_vl"]
# One preset of each kind: weight-only int groups, static int8 activations (calibrated), dynamic per-token int8,
# fp8, MX (shared-exponent blocks), NVFP4.
CORE_PRESETS = ["uint4_wo_64", "w_int8_a_int8_per_tensor_sym", "w_int8_a_int8_per_token_dynamic", "fp8", "mxfp4",
                "nvfp4"]
ALGORITHMS = {
    "gptq": ("uint4_wo_32", {"name": "gptq"}),
    "awq": ("uint4_wo_32", {"name": "awq"}),
    "smoothquant": ("w_int8_a_int8_per_token_dynamic", {"name": "smoothquant"}),
    "quarot": ("uint4_wo_32", {"name": "quarot"}),
}
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "adapters.md"
TABLE_HEADING = "Families by feature"


def support_table() -> dict:
    """``{(family, column): "yes" | "no"}`` from the markdown table under the heading "Families by feature" of
    docs/adapters.md (first column: the family's ``model_type`` in backticks)."""
    text = DOC.read_text()
    m = re.search(rf"^#+ {TABLE_HEADING}\s*$", text, re.M)
    if m is None:
        return {}
    lines = []
    for line in text[m.end():].lstrip("\n").splitlines():
        if not line.strip():
            if lines:
                break
            continue
        if line.startswith("|"):
            lines.append(line)
        elif lines:
            break
    rows = lines
    if len(rows) < 3:
        return {}
    head = [c.strip().strip("`").lower() for c in rows[0].strip("|").split("|")]
    out = {}
    for row in rows[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        fam = cells[0].strip("`").split()[0].strip("`")
        for col, cell in zip(head[1:], cells[1:]):
            word = cell.split()[0].lower() if cell.split() else ""
            out[(fam, col)] = "yes" if word.startswith("yes") else "no" if word.startswith(("no", "refused")) \
                else word
    return out


TABLE = support_table()


def expected(family: str, column: str) -> str:
    v = TABLE.get((family, column))
    if v not in ("yes", "no"):
        pytest.fail(f"docs/adapters.md '{TABLE_HEADING}' has no yes/no cell for ({family!r}, {column!r}): "
                    f"got {v!r}")
    return v


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(model, before: dict) -> bool:
    after = model.state_dict()
    return after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def _names_family(msg: str, model) -> bool:
    """The message names the model's family: its model_type (or its text config's), its class or its record."""
    from qcore.adapters.families import family_or_none
    fam = family_or_none(model)
    names = [model.config.model_type, type(model).__name__] + ([fam.model_type, f"{fam.name} record"] if fam else [])
    return any(n in msg for n in names)


def test_the_families_are_the_conftest_ones(zoo):
    assert sorted(FAMILY_NAMES) == sorted(zoo.FAMILIES)


def test_the_docs_table_covers_every_family():
    fams = {f for f, _ in TABLE}
    assert fams == set(FAMILY_NAMES), f"docs/adapters.md '{TABLE_HEADING}': families {sorted(fams)}"


# ---------------------------------------------------------------------------------------------------------------
# presets: every weight of a supported kind quantized
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CORE_PRESETS)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_preset_quantizes_every_weight(family, name, family_model, zoo):
    model = copy.deepcopy(family_model(family))
    data = zoo.token_batches(2, seed=1)
    quantize_model(model, name, data, progress=False)
    assert unquantized_weights(model) == []
    kept = {w.name for w in excluded_weights(model)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    assert all(n.endswith("weight") for n in kept)
    if head is None:
        assert kept == set()
    out = zoo.model_output(model, data[0])
    assert torch.isfinite(out).all()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_preset_quantizes_every_weight(family, family_model, zoo):
    from qcore.adapters import preset_names
    data = zoo.token_batches(2, seed=1)
    for name in preset_names():
        model = copy.deepcopy(family_model(family))
        quantize_model(model, name, data, progress=False)
        assert unquantized_weights(model) == [], name


# ---------------------------------------------------------------------------------------------------------------
# algorithms: run, or refuse before work by name
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", list(ALGORITHMS))
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_algorithm_runs_or_refuses_before_work(family, algo, family_model, zoo):
    want = expected(family, algo)
    base, entry = ALGORITHMS[algo]
    model = copy.deepcopy(family_model(family))
    before = _state(model)
    data = zoo.token_batches(2, seed=1)
    cfg = preset(base).replace(algorithms=(entry,))
    if want == "no":
        with pytest.raises((ValueError, TypeError)) as e:
            quantize_model(model, cfg, data, progress=False)
        assert _names_family(str(e.value), model) or "docs/adapters.md" in str(e.value), str(e.value)
        assert _same_state(model, before), "refused after changing weights"
        assert not getattr(model, "_qcore_partial", False)
        return
    quantize_model(model, cfg, data, progress=False)
    assert unquantized_weights(model) == []
    assert torch.isfinite(zoo.model_output(model, data[0])).all()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_amp_runs_or_refuses_before_work(family, family_model, zoo):
    """AMP (a scheme per layer from measured sensitivities) within 6 bits per weight, from int4 and int8."""
    from qcore.adapters.passes.amp import amp_config
    want = expected(family, "amp")
    model = copy.deepcopy(family_model(family))
    before = _state(model)
    data = zoo.token_batches(2, seed=1)
    schemes = ["uint4_wo_32", "w_int8_per_channel_sym"]
    if want == "no":
        with pytest.raises((ValueError, TypeError)) as e:
            amp_config(model, schemes, data, target_bits=6.0, progress=False)
        assert _names_family(str(e.value), model) or "docs/adapters.md" in str(e.value), str(e.value)
        assert _same_state(model, before)
        return
    cfg = amp_config(model, schemes, data, target_bits=6.0, progress=False)
    assert _same_state(model, before)  # measuring changes nothing
    quantize_model(model, cfg, data, progress=False)
    assert unquantized_weights(model) == []


# ---------------------------------------------------------------------------------------------------------------
# exports: same logits after reload, or refused before writing
# ---------------------------------------------------------------------------------------------------------------


def _quantized(family, family_model, zoo, config="uint4_wo_64"):
    model = copy.deepcopy(family_model(family))
    quantize_model(model, config, zoo.token_batches(2, seed=1), progress=False)
    return model


def _refused(fn, model, dst: pathlib.Path):
    with pytest.raises((ValueError, TypeError)) as e:
        fn()
    assert _names_family(str(e.value), model) or "docs/adapters.md" in str(e.value), str(e.value)
    assert not dst.exists() or not any(dst.iterdir() if dst.is_dir() else [dst])


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_export_hf_reloads_with_same_logits(family, family_model, zoo, tmp_path):
    from qcore.adapters import export_hf, from_pretrained
    model = _quantized(family, family_model, zoo)
    dst = tmp_path / "hf"
    if expected(family, "quark hf") == "no":
        _refused(lambda: export_hf(model, dst), model, dst)
        return
    x = zoo.token_batches(1, seed=3)[0]
    want = zoo.model_output(model, x)
    export_hf(model, dst)
    back = from_pretrained(dst)
    assert torch.equal(zoo.model_output(back, x), want)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_export_gguf_reloads_with_same_logits(family, family_model, zoo, tmp_path):
    import qcore
    from qcore import PerGroup
    from qcore.adapters import LayerConfig, ModelConfig
    from qcore.adapters.io.gguf import export_gguf
    from qcore.adapters.io.gguf import from_gguf
    # int4 symmetric, groups of 32, float16 scales: exactly GGUF's Q4_0, so the file holds the model's own weights
    spec = qcore.make_spec("int4", granularity=PerGroup(32, axis=-1), scale_dtype="float16")
    model = _quantized(family, family_model, zoo, ModelConfig(LayerConfig(weight=spec)))
    dst = tmp_path / "m.gguf"
    if expected(family, "gguf") == "no":
        _refused(lambda: export_gguf(model, dst), model, dst)
        return
    x = zoo.token_batches(1, seed=3)[0]
    want = zoo.model_output(model, x)
    info = export_gguf(model, dst)
    assert info.lossless
    back = from_gguf(dst)
    assert torch.equal(zoo.model_output(back, x), want)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_export_compressed_tensors_reloads_with_same_logits(family, family_model, zoo, tmp_path):
    from qcore.adapters.io.compressed_tensors import export_compressed_tensors
    from qcore.adapters.io.compressed_tensors import load_compressed_tensors
    model = _quantized(family, family_model, zoo)
    dst = tmp_path / "ct"
    if expected(family, "compressed-tensors") == "no":
        _refused(lambda: export_compressed_tensors(model, dst), model, dst)
        return
    x = zoo.token_batches(1, seed=3)[0]
    want = zoo.model_output(model, x)
    export_compressed_tensors(model, dst)
    back = load_compressed_tensors(dst)
    assert torch.equal(zoo.model_output(back, x), want)


@pytest.mark.ct_client
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_export_compressed_tensors_real_client(family, family_model, zoo, tmp_path):
    """transformers with the compressed-tensors package (its own loader, dequantizing while loading) reads the
    export and computes the same logits (bit for bit)."""
    if expected(family, "compressed-tensors") == "no":
        pytest.skip("refused before work (test_export_compressed_tensors_reloads_with_same_logits)")
    pytest.importorskip("compressed_tensors")
    import warnings

    import transformers
    from qcore.adapters.io.compressed_tensors import export_compressed_tensors
    from qcore.adapters.io.common import model_class
    model = _quantized(family, family_model, zoo)
    x = zoo.token_batches(1, seed=3)[0]
    want = zoo.model_output(model, x)
    dst = tmp_path / "ct"
    export_compressed_tensors(model, dst)
    with warnings.catch_warnings():  # "the quantization_config from the model will be used" (and our dequantize)
        warnings.simplefilter("ignore", UserWarning)
        back = model_class(transformers.AutoConfig.from_pretrained(dst)).from_pretrained(
            dst, dtype=torch.float32, local_files_only=True,
            quantization_config=transformers.CompressedTensorsConfig(dequantize=True)).eval()
    assert torch.equal(zoo.model_output(back, x), want)


def _onnx_feeds(sess, ids):
    """Inputs for an exported graph: the token ids, a full attention mask, positions, empty KV caches."""
    import numpy as np
    b, s = ids.shape
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = ids.numpy()
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((b, s), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.tile(np.arange(s, dtype=np.int64), (b, 1))
        elif i.name.startswith("past"):
            feeds[i.name] = np.zeros([b, i.shape[1], 0, i.shape[3]], np.float32)
        else:
            raise AssertionError(f"unexpected ONNX input {i.name!r}")
    return feeds


@pytest.mark.onnx_client
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_export_onnx_runs_with_same_logits(family, family_model, zoo, tmp_path):
    """The decoder graph (with KV cache) for the Llama-like families, torch's tracer for the others (a causal LM
    traced with ``use_cache=False`` and an attention mask, as docs/onnx.md says)."""
    pytest.importorskip("onnxruntime")
    from qcore.adapters.io.onnx import DECODER_TYPES, export_onnx
    from qcore.formats.onnx import ort_session
    model = _quantized(family, family_model, zoo)
    dst = tmp_path / "m.onnx"
    x = zoo.token_batches(1, seed=3)[0]
    causal = model.get_output_embeddings() is not None

    def export():
        if model.config.model_type in DECODER_TYPES:
            return export_onnx(model, dst)
        if causal:
            return export_onnx(model, dst, inputs={"input_ids": x, "attention_mask": torch.ones_like(x),
                                                   "use_cache": False},
                               input_names=["input_ids", "attention_mask"], output_names=["logits"])
        return export_onnx(model, dst, inputs={"input_ids": x}, input_names=["input_ids"])
    if expected(family, "onnx") == "no":
        _refused(export, model, dst)
        return
    want = zoo.model_output(model, x)
    export()
    sess = ort_session(dst)  # onnxruntime without its integer rewrites of QDQ patterns (docs/onnx.md)
    got = sess.run(None, _onnx_feeds(sess, x))[0]
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=1e-5)

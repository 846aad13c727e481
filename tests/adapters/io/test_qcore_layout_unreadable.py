"""A checkpoint that says ``quant_method: "qcore"`` is unreadable by a loader that does not know the method.

transformers without qcore installed skips an unknown ``quant_method`` with only a warning and then loads the
checkpoint as a float one: any tensor holding the name and the shape of a float parameter is read into it, int8 or
fp8 codes included (silently wrong logits). qcore therefore stores every quantized weight of a ``"qcore"``
checkpoint in its 1-D packed layout (``qcore.adapters.io.quark_hf.checkpoint_method``), whatever the format: the
fused MoE experts' per-expert Linears (int8, fp8), GPT-2's ``Conv1D`` and the Linears of a checkpoint that is
``"qcore"`` because another layer (here a quantized embedding) has no Quark layout. Checked directly (no tensor of
the export has the name and shape of a tensor ``save_pretrained`` writes for the float model, unless it holds that
tensor's own float values), through transformers' own loading with qcore's registration removed (it must raise),
and against a control written the old way (Quark's layouts under ``"qcore"``), which transformers loads silently.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qcore.adapters as A  # noqa: E402
from qcore.adapters import LayerConfig, TensorConfig  # noqa: E402
from qcore.formats.safetensors_io import SafetensorsFile  # noqa: E402

IDS = torch.arange(3, 19).reshape(2, 8)


def _llama_embedding_config():
    emb = LayerConfig(weight=TensorConfig(A.preset("w_mxint8_a_mxint8").layer.weight.spec))  # no Quark layout
    return A.preset("w_int8_per_channel_sym").replace(by_type={"Embedding": emb})


CASES = {  # name: (family, config); each export is a "qcore" checkpoint
    "mixtral-int8": ("mixtral", lambda: "w_int8_a_int8_per_tensor_sym"),
    "mixtral-fp8": ("mixtral", lambda: "fp8"),
    "gpt2-int8": ("gpt2", lambda: "w_int8_a_int8_per_tensor_sym"),
    "llama-int8-with-qcore-embedding": ("llama", _llama_embedding_config),
}


def _tensors(d) -> dict:
    """``{name: torch tensor}`` of every safetensors file of the checkpoint directory ``d``."""
    from safetensors.torch import load_file
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _misreadable(export_dir, float_dir) -> list:
    """The tensors of the export that a loader reading by name and shape would take for a float parameter and that
    do not hold that parameter's float values (``save_pretrained``'s tensors of the float model)."""
    ref = _tensors(float_dir)
    bad = []
    for name, t in _tensors(export_dir).items():
        want = ref.get(name)
        if want is None or tuple(t.shape) != tuple(want.shape):
            continue
        if t.dtype == torch.bool or not torch.equal(t.to(want.dtype), want) or t.dtype != want.dtype:
            bad.append(f"{name} {t.dtype} {list(t.shape)}")
    return bad


def _plain_load(d, monkeypatch):
    """transformers' own ``from_pretrained`` of ``d`` as it runs without qcore: the ``"qcore"`` method unregistered
    (restored after the test)."""
    from transformers.quantizers import auto
    for mapping in (auto.AUTO_QUANTIZATION_CONFIG_MAPPING, auto.AUTO_QUANTIZER_MAPPING):
        if "qcore" in mapping:
            monkeypatch.delitem(mapping, "qcore")
    return transformers.AutoModelForCausalLM.from_pretrained(d, local_files_only=True)


def _export(family_model, zoo, case, tmp_path):
    family, config = CASES[case]
    model = copy.deepcopy(family_model(family))
    model.save_pretrained(tmp_path / "float")
    A.quantize_model(model, config(), zoo.token_batches(2, seed=1), progress=False)
    A.freeze(model)
    info = A.export_hf(model, tmp_path / "q")
    return model, info


@pytest.mark.parametrize("case", list(CASES))
def test_a_qcore_checkpoint_holds_no_tensor_a_plain_loader_reads_as_float(case, family_model, zoo, tmp_path,
                                                                         monkeypatch):
    model, info = _export(family_model, zoo, case, tmp_path)
    assert info.quant_method == "qcore" and set(info.layers.values()) == {"qcore"}, info.layers
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert set(cfg["qcore"]["layouts"].values()) == {"qcore"}
    assert _misreadable(tmp_path / "q", tmp_path / "float") == []
    entries = SafetensorsFile(tmp_path / "q" / "model.safetensors").entries
    codes = [e for k, e in entries.items() if k.endswith(".weight") and (k[:-7] in info.layers or ".experts." in k)]
    assert codes and all(e.dtype == "U8" and len(e.shape) == 1 for e in codes)  # the quantized weights: 1-D bytes
    with torch.no_grad():
        want = model(IDS).logits
        back = A.from_pretrained(tmp_path / "q")  # qcore's own loader reads it back exactly
        assert torch.equal(back(IDS).logits, want)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # and transformers without qcore fails loudly
        _plain_load(tmp_path / "q", monkeypatch)


def test_the_check_catches_quark_layouts_under_quant_method_qcore(family_model, zoo, tmp_path, monkeypatch):
    """The control: a Mixtral int8 export written as before the fix (Quark's int8 layout for the per-expert Linears
    and the attention, config saying "qcore" and stating those layouts) is misread by a plain loader: the property
    check names its tensors, and transformers loads it without an error (the silently wrong model the fix
    prevents). qcore itself still reads such an older file right, by the layouts it states."""
    model, _ = _export(family_model, zoo, "mixtral-int8", tmp_path)
    from qcore.adapters.io.common import write_shards
    from qcore.adapters.io.quark_hf import plan_tensors
    records, layouts = plan_tensors(model)  # Quark's layouts, where they exist
    assert set(layouts.values()) == {"int8"}
    old = tmp_path / "old"
    old.mkdir()
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "qcore"
    cfg["quantization_config"]["qcore"]["layouts"] = layouts  # as the export wrote them before the fix
    (old / "config.json").write_text(json.dumps(cfg))
    write_shards(old, records, 2**40)
    bad = _misreadable(old, tmp_path / "float")
    assert any(".experts.0.w1.weight torch.int8" in b for b in bad), bad
    assert any("self_attn.q_proj.weight torch.int8" in b for b in bad), bad
    with torch.no_grad():
        assert torch.equal(A.from_pretrained(old)(IDS).logits, model(IDS).logits)
    plain = _plain_load(old, monkeypatch)  # loads: int8 codes taken for float weights
    w1 = plain.model.layers[0].mlp.experts.gate_up_proj
    assert w1.is_floating_point() and torch.equal(w1, w1.round())  # whole numbers: the codes, as floats


def test_a_qcore_checkpoint_stating_a_quark_layout_the_config_does_not_give_is_refused(family_model, zoo,
                                                                                        tmp_path):
    from qcore.adapters import CorruptCheckpointError
    _export(family_model, zoo, "mixtral-int8", tmp_path)
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["quantization_config"]["qcore"]["layouts"]["model.layers.0.mlp.experts"] = "fp8"
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "q", bad)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CorruptCheckpointError, match="says layout 'fp8', its config gives 'int8'"):
        A.from_pretrained(bad)

"""Fused 3-D MoE experts (transformers 5's MixtralExperts / Qwen2MoeExperts / Qwen3MoeExperts) quantized per expert.

Every expert slice ``[out, in]`` of ``gate_up_proj`` / ``down_proj`` is quantized as a Linear weight would be
(checked against qcore's own Linear path, slice by slice), activations where each expert's Linear sees them;
freeze, export (per-expert Linears under the family's checkpoint names) and reload keep the logits bit for bit.
Tiny random models built offline.
"""

import copy
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch import nn  # noqa: E402

import qcore  # noqa: E402
from qcore import PerChannel  # noqa: E402
from qcore.adapters import (CorruptCheckpointError, LayerConfig, ModelConfig, TensorConfig,  # noqa: E402
                            excluded_weights, export_hf, freeze, from_pretrained, plan_model, preset,
                            quantize_model, quantized_modules, unquantized_weights)
from qcore.adapters.modules import QuantExperts, QuantLinear, wrap  # noqa: E402
from qcore.adapters.presets import PRESETS  # noqa: E402

V = 128


def tiny_mixtral(layers: int = 2):
    cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).eval()


def tiny_qwen2_moe(layers: int = 1):
    cfg = transformers.Qwen2MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(cfg).eval()


def tiny_qwen3_moe(layers: int = 1):
    cfg = transformers.Qwen3MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


FAMILIES = {"mixtral": tiny_mixtral, "qwen2_moe": tiny_qwen2_moe, "qwen3_moe": tiny_qwen3_moe}
IDS = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
EXPERTS = "model.layers.0.mlp.experts"
#: per expert on disk: the names save_pretrained writes for the float model of each family
DISK = {"mixtral": ("model.layers.0.block_sparse_moe.experts.{e}.w1", "model.layers.0.block_sparse_moe.experts.{e}.w3",
                    "model.layers.0.block_sparse_moe.experts.{e}.w2"),
        "qwen2_moe": ("model.layers.0.mlp.experts.{e}.gate_proj", "model.layers.0.mlp.experts.{e}.up_proj",
                      "model.layers.0.mlp.experts.{e}.down_proj")}
DISK["qwen3_moe"] = DISK["qwen2_moe"]


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def _experts(model, layer: int = 0):
    return model.get_submodule(f"model.layers.{layer}.mlp.experts")


def _state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, before) -> bool:
    after = model.state_dict()
    return set(before) == set(after) and all(
        torch.equal(before[k], after[k]) or (before[k].is_floating_point() and before[k].shape == after[k].shape
                                             and torch.allclose(before[k], after[k], rtol=0, atol=0, equal_nan=True))
        for k in before)


# ---------------------------------------------------------------------------------------------------------------
# the module
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forward_equals_the_original_with_every_role_off(family):
    model = FAMILIES[family]()
    ex = _experts(model)
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(1))
    idx = torch.randint(0, 4, (10, 2), generator=torch.Generator().manual_seed(2))
    w = torch.rand(10, 2, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fast = ex(x, idx, w)  # transformers' default experts implementation (grouped_mm)
        ex.config._experts_implementation = "eager"
        eager = ex(x, idx, w)
        off = wrap(ex, LayerConfig(), name=EXPERTS)  # no role at all
        disabled = wrap(ex, preset("w_int8_a_int8_per_token_dynamic").layer, name=EXPERTS)
        disabled.quant_enabled = False
        assert isinstance(off, QuantExperts) and isinstance(off, type(ex))
        assert torch.equal(off(x, idx, w), eager) and torch.equal(disabled(x, idx, w), eager)
        assert torch.allclose(off(x, idx, w), fast, atol=1e-6)
        on = wrap(ex, preset("w_int8_a_int8_per_token_dynamic").layer, name=EXPERTS)(x, idx, w)
    assert not torch.equal(on, eager) and torch.allclose(on, eager, atol=0.05)
    assert torch.equal(ex.gate_up_proj, off.gate_up_proj)  # the float module is not changed


@pytest.mark.parametrize("scheme", ["uint4_wo_32", "w_int8_per_channel_sym", "fp8", "nvfp4"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_expert_is_quantized_as_its_own_linear(family, scheme):
    """Every expert slice equals qcore's Linear path on that slice alone (weights and scales); per tensor is one
    scale per expert, two-level formats one tensor scale per expert."""
    model = FAMILIES[family]()
    float_w = {p: getattr(_experts(model), p).detach().clone() for p in ("gate_up_proj", "down_proj")}
    quantize_model(model, scheme, [IDS], progress=False)
    q = _experts(model)
    assert isinstance(q, QuantExperts) and EXPERTS in quantized_modules(model)
    lc = preset(scheme).layer
    weight_only = LayerConfig(weight=lc.weight)
    for p, w in float_w.items():
        scales = []
        for e in range(w.shape[0]):
            lin = nn.Linear(w.shape[2], w.shape[1], bias=False)
            with torch.no_grad():
                lin.weight.copy_(w[e])
            ref = wrap(lin, weight_only, name=f"expert {e}")
            assert isinstance(ref, QuantLinear)
            ref.commit()
            assert torch.equal(getattr(q, p)[e], ref.weight), (p, e)
            assert torch.equal(getattr(q, f"{p}_scale")[e], ref.weight_scale), (p, e)
            if "weight_tensor_scale" in ref._buffers:
                assert torch.equal(getattr(q, f"{p}_tensor_scale")[e], ref.weight_tensor_scale)
            scales.append(ref.weight_scale)
        if scheme == "fp8":  # per tensor: one scale per expert, and they differ
            assert getattr(q, f"{p}_scale").shape == (4, 1, 1) and len({float(s) for s in scales}) == 4
    assert unquantized_weights(model) == []


def test_static_activation_scales_are_calibrated_per_expert_on_every_token():
    model = tiny_qwen3_moe()
    seen = []
    _experts(model).register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    cfg = preset("w_int8_a_int8_per_tensor_sym")
    one_token = IDS[:1, :1]  # routed to 2 of the 4 experts: every expert still gets statistics
    quantize_model(model, cfg, [IDS, one_token], progress=False)
    q = _experts(model)
    assert q.gate_up_proj_input_scale.shape == (4,) and q.down_proj_input_scale.shape == (4,)
    x = torch.cat(seen[:2])  # the two calibration batches' hidden states into the experts
    for e in range(4):  # each expert's Linear, calibrated alone on every token (the peers' all-expert routing)
        gu = nn.Linear(32, 64, bias=False)
        with torch.no_grad():
            gu.weight.copy_(q.gate_up_proj[e])
        ref = wrap(gu, LayerConfig(input=cfg.layer.input), name="gate_up")  # the committed expert weight as it is
        ref.start_calibration()
        h = [ref(seen[0]), ref(seen[1])]
        ref.finish_calibration()
        assert torch.equal(q.gate_up_proj_input_scale[e], ref.input_scale)
        down = nn.Linear(32, 32, bias=False)
        with torch.no_grad():
            down.weight.copy_(q.down_proj[e])
        ref2 = wrap(down, LayerConfig(input=cfg.layer.input), name="down")
        ref2.start_calibration()
        with torch.no_grad():
            for t in h:
                g, u = t.chunk(2, dim=-1)
                ref2(q.act_fn(g) * u)
        ref2.finish_calibration()
        assert torch.equal(q.down_proj_input_scale[e], ref2.input_scale)
    assert len({float(s) for s in q.down_proj_input_scale}) == 4 and x.shape[0] == 25
    assert torch.isfinite(_logits(model)).all()


# ---------------------------------------------------------------------------------------------------------------
# freeze, export, reload
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["uint4_wo_32", "w_int8_a_int8_per_tensor_sym", "nvfp4", "w_mxint8_a_mxint8"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_freeze_export_and_reload_give_the_same_logits(family, scheme, tmp_path):
    model = FAMILIES[family]()
    quantize_model(model, scheme, [IDS], progress=False)
    q = _logits(model)
    freeze(model)
    assert _experts(model).frozen and "gate_up_proj" not in dict(_experts(model).named_parameters())
    assert torch.equal(_logits(model), q)
    info = export_hf(model, tmp_path / "out")
    # quantized fused experts: transformers' Quark integration cannot read them, so qcore's loader is the reader and
    # the checkpoint is a "qcore" one: every quantized weight in qcore's 1-D packed layout, whatever the format
    assert info.quant_method == "qcore" and set(info.layers.values()) == {"qcore"}
    from safetensors import safe_open
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        weights = {k: f.get_slice(k) for k in keys if k.endswith(".weight") and "experts." in k}
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)
    for e in range(4):
        for prefix in DISK[family]:
            assert f"{prefix.format(e=e)}.weight" in keys and f"{prefix.format(e=e)}.weight_scale" in keys
    assert weights and all(len(w.get_shape()) == 1 and w.get_dtype() == "U8" for w in weights.values())
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "qcore" and cfg["qcore"]["layouts"][EXPERTS] == "qcore"
    back = from_pretrained(tmp_path / "out")
    assert isinstance(_experts(back), QuantExperts) and _experts(back).frozen
    assert torch.equal(_logits(back), q)
    assert unquantized_weights(back) == []


def test_activation_roles_per_feature_and_output_round_trip(tmp_path):
    from qcore import PerTensor, QuantSpec
    from qcore.dtypes import get_dtype
    w = preset("w_int8_per_channel_sym").layer.weight
    int8, uint8 = get_dtype("int8"), get_dtype("uint8")
    cases = {"input per feature": (LayerConfig(weight=w, input=TensorConfig(QuantSpec(int8, PerChannel(1)))),
                                   {"gate_up_proj_input_scale": (4, 32), "down_proj_input_scale": (4, 32)}),
             "output per tensor": (LayerConfig(weight=w, output=TensorConfig(QuantSpec(int8, PerTensor()))),
                                   {"gate_up_proj_output_scale": (4,), "down_proj_output_scale": (4,)}),
             "output per feature, asymmetric": (
                 LayerConfig(weight=w, output=TensorConfig(QuantSpec(uint8, PerChannel(1), symmetric=False))),
                 {"gate_up_proj_output_scale": (4, 64), "down_proj_output_zero_point": (4, 32)})}
    for i, (lc, shapes) in enumerate(cases.values()):
        model = tiny_qwen3_moe()
        quantize_model(model, ModelConfig(preset("uint4_wo_32").layer, by_type={"Experts": lc}), [IDS],
                       progress=False)
        q = _experts(model)
        for buf, shape in shapes.items():
            assert tuple(getattr(q, buf).shape) == shape and torch.isfinite(getattr(q, buf)).all(), buf
        logits = _logits(model)
        freeze(model)
        export_hf(model, tmp_path / f"out{i}")
        back = from_pretrained(tmp_path / f"out{i}")
        assert torch.equal(_logits(back), logits)
        for buf in shapes:
            assert torch.equal(getattr(_experts(back), buf), getattr(q, buf))


def test_unquantized_weights_is_empty_after_every_weight_preset():
    names = [n for n, roles in PRESETS.items() if "weight" in roles]
    assert len(names) > 30
    base = tiny_qwen3_moe()
    for name in names:
        model = copy.deepcopy(base)
        quantize_model(model, name, [IDS[:1]], progress=False)
        assert unquantized_weights(model) == [], name
        assert isinstance(_experts(model), QuantExperts), name
    for make in (tiny_mixtral, tiny_qwen2_moe):
        model = make(1)
        quantize_model(model, "mxfp4", progress=False)
        assert unquantized_weights(model) == [] and isinstance(_experts(model), QuantExperts)


def test_experts_follow_by_type_by_name_and_exclude():
    model = tiny_qwen3_moe()
    int8 = preset("int8").layer
    plans = {p.name: p for p in plan_model(model, preset("uint4_wo_32").replace(by_type={"Experts": int8}))}
    assert plans[EXPERTS].type == "Experts" and plans[EXPERTS].config == int8
    assert plans["model.layers.0.self_attn.q_proj"].config == preset("uint4_wo_32").layer
    for exclude in ((EXPERTS,), ("re:.*\\.experts",), (f"{EXPERTS}.gate_up_proj", f"{EXPERTS}.down_proj")):
        cfg = preset("uint4_wo_32").replace(exclude=("lm_head", *exclude))
        m = copy.deepcopy(model)
        before = _experts(m).gate_up_proj.detach().clone()
        quantize_model(m, cfg, progress=False)
        assert not isinstance(_experts(m), QuantExperts) and torch.equal(_experts(m).gate_up_proj, before)
        assert unquantized_weights(m) == []
        assert {w.name for w in excluded_weights(m)} == {"lm_head.weight", f"{EXPERTS}.gate_up_proj",
                                                         f"{EXPERTS}.down_proj"}
    assert ModelConfig.from_json(preset("uint4_wo_32").replace(by_type={"Experts": int8}).to_json()).by_type == {
        "Experts": int8}


# ---------------------------------------------------------------------------------------------------------------
# refused before any work
# ---------------------------------------------------------------------------------------------------------------


def _refused(model, fn, match, exc=ValueError):
    before = _state(model)
    with pytest.raises(exc, match=match):
        fn()
    assert _unchanged(model, before) and not quantized_modules(model)


def test_bad_configs_and_models_are_refused_before_any_work():
    model = tiny_qwen3_moe()
    lc = preset("uint4_wo_32").layer
    # 1. qat: not supported for fused experts
    _refused(model, lambda: quantize_model(model, "uint4_wo_32", qat=True, progress=False),
             r"experts 'model.layers.0.mlp.experts': qat=True is not supported.*docs/adapters.md")
    # 2. a bias spec: the experts have no bias
    int8 = qcore.dtypes.get_dtype("int8")
    bias = LayerConfig(weight=lc.weight, bias=TensorConfig(qcore.QuantSpec(int8, PerChannel(0))))
    _refused(model, lambda: quantize_model(model, ModelConfig(lc, by_type={"Experts": bias}), progress=False),
             "has no bias but the config quantizes the bias")
    # 3. a weight spec that cannot apply: per-channel scales along the input axis
    bad = LayerConfig(weight=TensorConfig(qcore.QuantSpec(int8, PerChannel(1))))
    _refused(model, lambda: quantize_model(model, ModelConfig(lc, by_type={"Experts": bad}), progress=False),
             "per-channel weight scales are per output channel")
    # 4. a pattern naming one of the two fused parameters only
    _refused(model, lambda: quantize_model(model, preset("uint4_wo_32").replace(
        exclude=("lm_head", f"{EXPERTS}.down_proj")), progress=False), "quantized together")
    # 5. NaN in one expert
    nan = copy.deepcopy(model)
    with torch.no_grad():
        _experts(nan).down_proj[2, 0, 0] = float("nan")
    _refused(nan, lambda: quantize_model(nan, "uint4_wo_32", progress=False), "NaN or Inf")
    # 6. algorithms that do not handle fused experts (GPTQ does: tests/adapters/passes/test_moe_gptq.py)
    for algo in ("awq", "smoothquant"):
        cfg = preset("uint4_wo_32").replace(algorithms=({"name": algo},))
        _refused(model, lambda cfg=cfg: quantize_model(model, cfg, [IDS], progress=False),
                 rf"{algo}: the plan quantizes fused MoE experts .*model.layers.0.mlp.experts.*docs/adapters.md")
    # 7. AMP's sensitivities
    from qcore.adapters.passes.amp import layer_sensitivity
    _refused(model, lambda: layer_sensitivity(model, ["uint4_wo_32", "float"], [IDS], progress=False),
             "amp: the plan quantizes fused MoE experts")
    # 8. an experts module of a layout qcore does not know: wrap refuses it by name
    odd = copy.deepcopy(_experts(model))
    odd.is_transposed = True
    with pytest.raises(TypeError, match="is_transposed=True"):
        wrap(odd, lc, name="odd")


def test_exporters_without_fused_experts_refuse_before_work(tmp_path):
    from qcore.adapters.io.compressed_tensors import check_ct, export_compressed_tensors
    from qcore.adapters.io.gguf import check_gguf, export_gguf
    from qcore.adapters.io.onnx import check_onnx, export_onnx
    model = tiny_mixtral(1)
    want = r"tensor model.layers.0.mlp.experts.gate_up_proj.*docs/adapters.md"
    for check in (check_onnx, check_ct):  # the float model and the config: before the baseline
        with pytest.raises(ValueError, match=want):
            check(model, preset("uint4_wo_32"))
    check_gguf(model, preset("uint4_wo_32"))  # GGUF writes fused experts (test_export_gguf.py)
    quantize_model(model, "uint4_wo_32", progress=False)
    for fn in (lambda: export_onnx(model, tmp_path / "m.onnx"),
               lambda: export_compressed_tensors(model, tmp_path / "ct")):
        with pytest.raises(ValueError, match=want):
            fn()
    assert not any(tmp_path.iterdir())
    info = export_gguf(model, tmp_path / "m.gguf")
    assert {r.gguf_type for r in info.quantized if "exps" in r.gguf_name} == {"Q4_1"}
    (tmp_path / "m.gguf").unlink()
    from qcore.adapters import quantize_checkpoint  # streaming: refused before any layer is read
    src = tmp_path / "src"
    tiny_qwen3_moe().save_pretrained(src)
    with pytest.raises(ValueError, match=r"quantize_checkpoint: .*tensor model.layers.0.mlp.experts.gate_up_proj"):
        quantize_checkpoint(src, tmp_path / "dst", "uint4_wo_32", progress=False)
    assert not (tmp_path / "dst").exists()


def test_commit_and_load_frozen_refuse_bad_inputs():
    model = tiny_qwen3_moe()
    q = wrap(_experts(model), preset("uint4_wo_32").layer, name=EXPERTS)
    with pytest.raises(TypeError, match=r"commit\(weight=...\) takes \{proj: \[qcore.QTensor per expert\]\}"):
        q.commit(weight=qcore.quantize(torch.zeros(64, 32), q._qspecs["weight"]))
    parts = {p: [_parts(qt) for qt in q.expert_qtensors(p)] for p in ("gate_up_proj", "down_proj")}
    before = q.gate_up_proj.detach().clone()
    for bad, match in (({"gate_up_proj": parts["gate_up_proj"]}, "parts must map"),
                       ({**parts, "down_proj": parts["down_proj"][:3]}, "3 experts of down_proj, expected 4"),
                       ({**parts, "down_proj": parts["gate_up_proj"]}, "codes of shape")):
        with pytest.raises(ValueError, match=match):
            q.load_frozen(bad, dtype=torch.float32)
        assert not q.frozen and torch.equal(q.gate_up_proj, before)
    x = torch.randn(5, 32)
    idx, w = torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
    y = q(x, idx, w)
    q.load_frozen(parts, dtype=torch.float32)  # the good parts: the same function
    assert q.frozen and torch.equal(q(x, idx, w), y)


def _parts(qt):
    from qcore.formats.quark_layout import WeightParts
    return WeightParts(codes=qt.codes.numpy(), scales=qt.scales.numpy(),
                       zero_points=None if qt.zero_points is None else qt.zero_points.numpy())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe") / "out"
    model = tiny_mixtral(1)
    quantize_model(model, "w_int8_a_int8_per_tensor_sym", [IDS], progress=False)
    export_hf(model, d)
    return d


def _rewrite(src, dst, change):
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    change(t)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_corrupted_expert_tensors_are_refused_naming_them(exported, tmp_path):
    w1 = "model.layers.0.block_sparse_moe.experts.2.w1"
    w3 = "model.layers.0.block_sparse_moe.experts.2.w3"
    cases = [(lambda t: t.pop(f"{w1}.weight_scale"), f"{w1}.weight_scale' is missing"),
             (lambda t: t.__setitem__(f"{w3}.weight_scale", t[f"{w3}.weight_scale"] * 2),
              "different per-tensor scales"),
             (lambda t: t.__setitem__(f"{w3}.input_scale", t[f"{w3}.input_scale"] * 2), "input scales of expert 2"),
             (lambda t: t.__setitem__(f"{w1}.weight_scale", -t[f"{w1}.weight_scale"]), "experts.2.w1"),
             (lambda t: t.__setitem__(f"{w1}.weight", t[f"{w1}.weight"][:10]),
              f"{w1}.weight' is U8 \\[10\\] in model.safetensors")]
    for i, (change, match) in enumerate(cases):
        d = tmp_path / f"bad{i}"
        _rewrite(exported, d, change)
        with pytest.raises(CorruptCheckpointError, match=match):
            from_pretrained(d)
    assert torch.isfinite(_logits(from_pretrained(exported))).all()  # the good checkpoint loads


class OtherExperts(nn.Module):
    """Fused experts of a class qcore does not know (3-D, the same parameter names)."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 16, 8))
        self.down_proj = nn.Parameter(torch.randn(4, 8, 8))


class DbrxLikeExperts(nn.Module):
    """DBRX-style experts: every expert's rows stacked in a 2-D parameter."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4 * 8, 8))


@pytest.mark.parametrize("experts,why", [(OtherExperts, "3-D fused MoE expert weights of a layout qcore does not"),
                                         (DbrxLikeExperts, "fused \\(stacked 2-D\\) MoE expert weights")])
def test_experts_of_unknown_layouts_stay_refused(experts, why):
    model = nn.Sequential(nn.Linear(8, 8))
    model.add_module("experts", experts())
    _refused(model, lambda: quantize_model(model, "uint4_wo_32", progress=False), f"{why}.*docs/adapters.md")
    quantize_model(model, preset("uint4_wo_32").replace(exclude=("experts",)), progress=False)
    assert unquantized_weights(model) == [] and list(quantized_modules(model)) == ["0"]


def test_state_dict_round_trip_and_keep_dequantized():
    a = tiny_qwen3_moe()
    quantize_model(a, "int8", [IDS], progress=False)  # per-tensor int8: quantizing again would not be idempotent
    b = tiny_qwen3_moe()
    with torch.no_grad():
        _experts(b).down_proj.mul_(1.5)
    quantize_model(b, "int8", [IDS], progress=False)
    b.load_state_dict(a.state_dict())  # the saved fake-quantized experts and scales, kept as saved
    assert torch.equal(_logits(b), _logits(a))
    assert torch.equal(_experts(b).down_proj_scale, _experts(a).down_proj_scale)
    freeze(b)
    q = _experts(b)
    q.keep_dequantized = True  # evaluation: the experts dequantized once and kept
    assert torch.equal(_logits(b), _logits(a)) and set(q.__dict__["_dequantized"]) == {"gate_up_proj", "down_proj"}
    b.to(torch.bfloat16)  # scales stay float32; the frozen experts dequantize to the new dtype
    assert q.down_proj_scale.dtype == torch.float32 and "_dequantized" not in q.__dict__
    assert _logits(b).dtype == torch.bfloat16


def _keys(d) -> set:
    from safetensors import safe_open
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {k for k in f.keys() if ".experts." in k}


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_experts_are_written_under_the_names_save_pretrained_writes(family, tmp_path):
    model = FAMILIES[family](1)
    model.save_pretrained(tmp_path / "float")
    float_keys = _keys(tmp_path / "float")  # e.g. model.layers.0.block_sparse_moe.experts.3.w1.weight
    quantized = copy.deepcopy(model)
    quantize_model(quantized, "fp8", [IDS], progress=False)
    export_hf(quantized, tmp_path / "q")
    assert {k for k in _keys(tmp_path / "q") if k.endswith(".weight")} == float_keys
    assert {k.rpartition(".")[2] for k in _keys(tmp_path / "q")} == {"weight", "weight_scale", "input_scale"}
    kept = copy.deepcopy(model)  # experts kept float: the float per-expert tensors, as save_pretrained writes them
    quantize_model(kept, preset("fp8").replace(exclude=("lm_head", "re:.*\\.experts")), [IDS], progress=False)
    export_hf(kept, tmp_path / "kept")
    assert _keys(tmp_path / "kept") == float_keys
    assert torch.equal(_logits(from_pretrained(tmp_path / "kept")), _logits(kept))
    first = sorted(float_keys)[0]
    _rewrite(tmp_path / "kept", tmp_path / "bad", lambda t: t.pop(first))
    with pytest.raises(CorruptCheckpointError, match=f"per-expert tensors such as '{first}'"):
        from_pretrained(tmp_path / "bad")


def test_fused_experts_a_quark_checkpoint_stores_float_load_float(tmp_path):
    """AMD Quark 0.13 leaves transformers 5's fused experts float (fused names) whatever its config says: qcore
    reads them float and says so (excluded in the loaded model's config)."""
    model = tiny_mixtral(2)
    quantize_model(model, preset("fp8").replace(exclude=("lm_head", "model.layers.1.mlp.experts")), [IDS],
                   progress=False)
    logits = _logits(model)
    # as Quark writes it: its tensor layouts (export_hf writes a "qcore" checkpoint with quantized experts, all in
    # qcore's layout), no qcore block, the head excluded only
    from qcore.adapters.io.common import write_checkpoint
    from qcore.adapters.io.quark_hf import plan_tensors
    records, layouts = plan_tensors(model)
    assert set(layouts.values()) == {"fp8"}
    q = dict(model.qcore_config.to_quark(model_dtype="float32"), quant_method="quark", exclude=["lm_head"])
    write_checkpoint(tmp_path / "out", model, model.config, q, records, tokenizer=None, overwrite=False,
                     max_bytes=2**40, progress=False)
    assert "model.layers.1.mlp.experts.gate_up_proj" in _keys(tmp_path / "out")  # (mixed: float ones fused)
    back = from_pretrained(tmp_path / "out")
    assert isinstance(_experts(back, 0), QuantExperts) and not isinstance(_experts(back, 1), QuantExperts)
    assert torch.equal(_logits(back), logits)
    assert "model.layers.1.mlp.experts" in back.qcore_config.exclude and unquantized_weights(back) == []


def test_bfloat16_experts_freeze_export_and_reload(tmp_path):
    tiny_mixtral(1).save_pretrained(tmp_path / "float")
    model = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.bfloat16).eval()
    quantize_model(model, "w_int8_a_int8_per_tensor_sym", [IDS], progress=False)
    logits = _logits(model)
    assert logits.dtype == torch.bfloat16 and _experts(model).gate_up_proj_scale.dtype == torch.float32
    freeze(model)
    assert torch.equal(_logits(model), logits)
    export_hf(model, tmp_path / "out")
    back = from_pretrained(tmp_path / "out")
    assert _experts(back)._frozen_meta["dtype"] == torch.bfloat16 and torch.equal(_logits(back), logits)


OTHERS = {  # experts classes whose eager forward is MixtralExperts' (qcore.adapters.modules.experts_layout_problem)
    "olmoe": lambda: transformers.OlmoeConfig(vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                              num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                              num_experts_per_tok=2, eos_token_id=0, pad_token_id=0),
    "phimoe": lambda: transformers.PhimoeConfig(vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                                num_experts_per_tok=2),
    "granitemoe": lambda: transformers.GraniteMoeConfig(vocab_size=V, hidden_size=32, intermediate_size=32,
                                                        num_hidden_layers=1, num_attention_heads=4,
                                                        num_key_value_heads=2, num_local_experts=4,
                                                        num_experts_per_tok=2),
}


@pytest.mark.filterwarnings("ignore:qcore.adapters. 1 module")  # PhiMoE's router subclasses Linear
@pytest.mark.parametrize("family", sorted(OTHERS))
def test_other_families_with_the_same_experts_forward(family, tmp_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(OTHERS[family]()).eval()
    name, ex = next((n, m) for n, m in model.named_modules() if type(m).__name__.endswith("Experts"))
    x, idx, w = torch.randn(6, 32), torch.randint(0, 4, (6, 2)), torch.rand(6, 2)
    with torch.no_grad():
        ex.config._experts_implementation = "eager"
        assert torch.equal(wrap(ex, LayerConfig(), name=name)(x, idx, w), ex(x, idx, w))
    model.save_pretrained(tmp_path / "float")
    quantize_model(model, "w_int8_a_int8_per_tensor_sym", [IDS], progress=False)
    assert isinstance(model.get_submodule(name), QuantExperts) and unquantized_weights(model) == []
    logits = _logits(model)
    freeze(model)
    export_hf(model, tmp_path / "out")
    back = from_pretrained(tmp_path / "out")
    assert torch.equal(_logits(back), logits) and isinstance(back.get_submodule(name), QuantExperts)
    written = {k for k in _keys(tmp_path / "out") if k.endswith(".weight")}
    saved = _keys(tmp_path / "float")
    # per expert under save_pretrained's names; GraniteMoE's checkpoints hold fused 3-D tensors (input_linear,
    # output_linear): qcore's own per-expert names
    assert written == (saved if saved else {f"{name}.{e}.{p}_proj.weight" for e in range(4)
                                            for p in ("gate", "up", "down")})


def test_cli_refuses_layer_algorithms_on_fused_experts_before_any_evaluation(tmp_path, capsys):
    from qcore.cli import main
    tiny_qwen3_moe().save_pretrained(tmp_path / "moe")
    capsys.readouterr()  # (save_pretrained's progress bar)
    out = tmp_path / "out"
    args = ["quantize", "--model", str(tmp_path / "moe"), "--scheme", "uint4_wo_32", "--algo", "awq", "--eval",
            "none", "--no-progress", "--output", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "awq: the plan quantizes fused MoE experts" in err and "docs/adapters.md" in err
    assert not out.exists()

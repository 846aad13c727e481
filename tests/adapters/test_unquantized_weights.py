"""A model is never silently half-done: every weight matrix is quantized, excluded by name, or refused before work.

Weights qcore cannot quantize yet (fused 3-D MoE expert tensors of a layout it does not know, fused projections
held directly on a module) are refused by ``plan_model`` before any work unless an exclusion names them;
``unquantized_weights`` walks a quantized model and lists every weight left float without being excluded.
Tiny random models built offline (Qwen3-MoE, Mixtral, GPT-2, and the conftest families).
"""

import ast
import copy
import json
import re
import shlex

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch import nn  # noqa: E402

from qcore.adapters import (ModelConfig, excluded_weights, export_hf, freeze, from_pretrained, plan_model,  # noqa: E402
                            preset, quantize_model, quantized_modules, unquantized_weights)
from qcore.cli import main  # noqa: E402

V = 128


def tiny_qwen3_moe():
    cfg = transformers.Qwen3MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def tiny_mixtral():
    cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).eval()


def tiny_gpt2(*, tie: bool = True):
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                                  eos_token_id=0, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


MOE = {"qwen3_moe": tiny_qwen3_moe, "mixtral": tiny_mixtral}
EXPERTS = r"re:.*\.experts\.(down_proj|gate_up_proj)"
IDS = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(0))


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _suggested_exclude(msg: str) -> list:
    """The ``exclude=[...]`` the refusal proposes, read back as Python."""
    m = re.search(r"exclude=(\[.*?\]) \(Python", msg)
    assert m, msg
    return ast.literal_eval(m.group(1))


def _state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unknown_layout(model):
    """The model with its fused experts in a layout qcore does not know (transposed 3-D tensors)."""
    for m in model.modules():
        if type(m).__name__.endswith("Experts"):
            m.is_transposed = True
    return model


@pytest.mark.parametrize("family", sorted(MOE))
def test_fused_experts_of_an_unknown_layout_are_refused_before_any_work(family):
    model = _unknown_layout(MOE[family]())
    before = _state(model)
    with pytest.raises(ValueError) as e:
        quantize_model(model, preset("uint4_wo_64"), progress=False)
    msg = str(e.value)
    assert "4 weight(s)" in msg and "model.layers.0.mlp.experts.gate_up_proj [4," in msg
    assert "3-D fused MoE expert weights of a layout qcore does not know" in msg and "docs/adapters.md" in msg
    assert "mlp.gate" not in msg  # the router stays float by design, as the peers keep it
    assert "Nothing was changed" in msg and "--exclude lm_head --exclude" in msg
    assert _suggested_exclude(msg) == ["lm_head", EXPERTS]
    assert not quantized_modules(model)  # nothing was touched
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="docs/adapters.md"):  # plan_model is where it is found: every path refuses
        plan_model(model, "uint4_wo_64")
    assert "model.layers.0.mlp.experts" in [p.name for p in plan_model(MOE[family](), "uint4_wo_64")]  # known


@pytest.mark.parametrize("family", sorted(MOE))
def test_the_suggested_exclusion_quantizes_the_rest_and_keeps_experts_float(family):
    model = MOE[family]()
    float_logits = _logits(model)
    experts = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}
    cfg = preset("uint4_wo_64").replace(exclude=("lm_head", EXPERTS))
    quantize_model(model, cfg, progress=False)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    assert linears and set(linears) == set(quantized_modules(model))  # every attention projection quantized
    assert len(linears) == 8
    assert unquantized_weights(model) == []  # the config it was quantized with (model.qcore_config)
    kept = {w.name: w for w in excluded_weights(model)}
    assert set(kept) == {"lm_head.weight", *experts}
    assert kept["model.layers.1.mlp.experts.down_proj"].why == "excluded by the config"
    for n, p in model.named_parameters():  # the experts are exactly as they were
        if n in experts:
            assert torch.equal(p, experts[n])
    q = _logits(model)
    assert torch.isfinite(q).all() and not torch.equal(q, float_logits)


def test_experts_excluded_by_module_name_or_by_name_none_also_count():
    for cfg in (preset("uint4_wo_64").replace(exclude=("lm_head", r"re:.*\.experts")),
                preset("uint4_wo_64").replace(by_name={"*.mlp.experts.*_proj": None})):
        model = tiny_qwen3_moe()
        quantize_model(model, cfg, progress=False)
        assert unquantized_weights(model) == [] and len(quantized_modules(model)) >= 8


def test_exclude_names_parameters_only_of_weights_qcore_cannot_quantize():
    model = tiny_qwen3_moe()
    # a parameter name of a Linear is not an exclusion (the module name is): refused as matching nothing
    with pytest.raises(ValueError, match="matches no module"):
        plan_model(model, preset("uint4_wo_64").replace(exclude=(EXPERTS, "*.q_proj.weight")))
    # a by_name config for the fused experts applies to them (qcore quantizes them, per expert)
    lc = preset("int8").layer
    plans = {p.name: p for p in plan_model(model, preset("uint4_wo_64").replace(by_name={"*.experts": lc}))}
    assert plans["model.layers.0.mlp.experts"].config == lc and plans["model.layers.0.mlp.experts"].type == "Experts"


def test_excluded_experts_freeze_export_and_reload_with_the_same_logits(tmp_path):
    model = tiny_mixtral()
    quantize_model(model, preset("uint4_wo_64").replace(exclude=("lm_head", EXPERTS)), progress=False)
    q = _logits(model)
    freeze(model)
    assert torch.equal(_logits(model), q)
    export_hf(model, tmp_path / "out")
    back = from_pretrained(tmp_path / "out")
    assert torch.equal(_logits(back), q)
    assert unquantized_weights(back) == []
    assert {w.name for w in excluded_weights(back)} >= {"model.layers.0.mlp.experts.gate_up_proj"}


def test_gpt2_conv1d_is_quantized_and_kept_float_only_knowingly():
    # transformers' Conv1D is quantized as a Linear (issue 22; tests/adapters/modules/test_conv1d.py): not refused any more
    model = tiny_gpt2()
    float_attn = copy.deepcopy(model.transformer.h[1].attn.c_attn)
    quantize_model(model, preset("uint4_wo_64"), progress=False)
    assert len(quantized_modules(model)) == 8 and unquantized_weights(model) == []
    model.transformer.h[1].attn.c_attn = float_attn  # a hole: one planned Conv1D back in float is found
    assert [w.name for w in unquantized_weights(model)] == ["transformer.h.1.attn.c_attn.weight"]
    model = tiny_gpt2(tie=False)
    with pytest.raises(ValueError, match="matches no module"):  # a module's parameter name is not an exclusion
        plan_model(model, preset("uint4_wo_64").replace(exclude=(r"re:.*\.(c_attn|c_fc|c_proj)\.weight",)))
    quantize_model(model, preset("uint4_wo_64").replace(exclude=(r"re:.*\.(c_attn|c_fc|c_proj)",)), progress=False)
    assert list(quantized_modules(model)) == ["lm_head"]
    assert unquantized_weights(model) == []
    kept = [w for w in excluded_weights(model) if w.type == "Conv1D"]
    assert len(kept) == 8 and {w.why for w in kept} == {"excluded by the config"}


@pytest.mark.parametrize("family", ["llama", "opt", "bert", "qwen2"])
def test_every_family_quantizes_every_weight_it_should(family, family_model):
    model = copy.deepcopy(family_model(family))
    quantize_model(model, preset("uint4_wo_64"), progress=False)
    assert unquantized_weights(model) == []
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    kept = {w.module for w in excluded_weights(model)}
    assert set(quantized_modules(model)) | kept == linears  # every Linear quantized or excluded (the head)


def test_unquantized_weights_finds_what_was_left_float(family_model):
    model = copy.deepcopy(family_model("llama"))
    float_q = copy.deepcopy(model.model.layers[0].self_attn.q_proj)
    quantize_model(model, "uint4_wo_64", progress=False)
    model.model.layers[0].self_attn.q_proj = float_q  # a hole: one planned layer back in float
    left = unquantized_weights(model)
    assert [w.name for w in left] == ["model.layers.0.self_attn.q_proj.weight"]
    # a float MoE model against the config: every planned Linear and every expert tensor
    moe = tiny_qwen3_moe()
    names = {w.name for w in unquantized_weights(moe, preset("uint4_wo_64"))}
    assert len(names) == 8 + 4 and "model.layers.1.mlp.experts.down_proj" in names
    with pytest.raises(ValueError, match="qcore_config"):
        unquantized_weights(tiny_mixtral())
    with pytest.raises(TypeError, match="torch.nn.Module"):
        unquantized_weights("model", preset("uint4_wo_64"))


class FusedQKV(nn.Module):
    """A custom attention holding its fused q/k/v projection as a bare parameter, and a Linear output."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.qkv_proj = nn.Parameter(torch.randn(3 * d, d))
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = (self.norm(x) @ self.qkv_proj.t()).chunk(3, -1)
        return self.out(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)


def test_fused_parameters_held_on_a_custom_module_are_refused_too():
    model = FusedQKV()
    with pytest.raises(ValueError, match=r"1 weight\(s\) \(qkv_proj \[48, 16\]\) are a weight matrix held directly") as e:
        quantize_model(model, "uint4_wo_64", progress=False)
    assert _suggested_exclude(str(e.value)) == ["re:qkv_proj"]  # a parameter of the root module: named as it is
    quantize_model(model, preset("uint4_wo_64").replace(exclude=("qkv_proj",)), progress=False)
    assert unquantized_weights(model) == [] and list(quantized_modules(model)) == ["out"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_qwen3_moe")
    tiny_qwen3_moe().save_pretrained(d)
    return d


def test_cli_quantizes_fused_experts_or_keeps_them_float_by_exclusion(moe_dir, tmp_path, capsys):
    out = tmp_path / "out"
    base = ["quantize", "--model", str(moe_dir), "--scheme", "uint4_wo_64", "--eval", "none", "--no-progress"]
    rep = tmp_path / "r.json"
    assert main([*base, "--output", str(out), "--report", str(rep)]) == 0  # the experts quantized too
    capsys.readouterr()
    r = json.loads(rep.read_text())
    assert r["layers_quantized"] == 8 + 2 and {k["weight"] for k in r["kept_float"]} == {"lm_head.weight"}
    assert unquantized_weights(from_pretrained(out)) == []
    out = tmp_path / "out2"
    cli = f"--exclude lm_head --exclude {shlex.quote(EXPERTS)}"
    assert main([*base, *shlex.split(cli), "--output", str(out), "--report", str(rep)]) == 0
    printed = capsys.readouterr().out
    assert "kept float (excluded)" in printed and "5 weight(s): model.layers.0.mlp.experts.gate_up_proj" in printed
    r = json.loads(rep.read_text())
    assert r["layers_quantized"] == 8
    assert {k["weight"] for k in r["kept_float"]} == {"lm_head.weight"} | {
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")}
    assert unquantized_weights(from_pretrained(out)) == []


def test_config_round_trip_keeps_the_exclusion():
    cfg = preset("uint4_wo_64").replace(exclude=("lm_head", EXPERTS))
    assert ModelConfig.from_json(cfg.to_json()).exclude == ("lm_head", EXPERTS)


def test_multihead_attention_fused_in_projection_is_refused():
    model = nn.Sequential(nn.Linear(16, 16))
    model.add_module("attn", nn.MultiheadAttention(16, 2))
    with pytest.raises(ValueError, match=r"attn.in_proj_weight \[48, 16\]\) are the fused q/k/v projection"), \
            pytest.warns(UserWarning, match="attn.out_proj"):
        plan_model(model, "uint4_wo_64")
    with pytest.warns(UserWarning, match="attn.out_proj"):  # a Linear subclass the attention reads directly
        plans = plan_model(model, preset("uint4_wo_64").replace(exclude=("attn.in_proj_weight",)))
    assert [p.name for p in plans] == ["0"]

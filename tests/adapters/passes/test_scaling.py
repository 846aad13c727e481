"""qcore.adapters.passes.scaling: the built-in scaling map, Quark's scaling_layers, and folds that leave the float
model's outputs unchanged (Llama with and without grouped-query attention, Qwen2, OPT, unit-offset norms)."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch import nn  # noqa: E402

from qcore.adapters.passes.scaling import ScalingGroup, fold_scales, scaling_groups  # noqa: E402

LLAMA_QUARK = [  # Quark 0.13's AWQ_MAP["llama"].scaling_layers
    {"prev_op": "input_layernorm", "layers": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
     "inp": "self_attn.q_proj", "module2inspect": "self_attn"},
    {"prev_op": "self_attn.v_proj", "layers": ["self_attn.o_proj"], "inp": "self_attn.o_proj"},
    {"prev_op": "post_attention_layernorm", "layers": ["mlp.gate_proj", "mlp.up_proj"], "inp": "mlp.gate_proj",
     "module2inspect": "mlp"},
    {"prev_op": "mlp.up_proj", "layers": ["mlp.down_proj"], "inp": "mlp.down_proj"},
]


def llama(kv_heads, seed=0):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=kv_heads, num_hidden_layers=2, vocab_size=128,
                                   max_position_embeddings=64)
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so that folding into them is visible
        for layer in m.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5)
    return m


def opt(seed=0, activation="relu", pre_norm=True):
    cfg = transformers.OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64,
                                 dropout=0.0, attention_dropout=0.0, activation_function=activation,
                                 do_layer_norm_before=pre_norm)
    torch.manual_seed(seed)
    m = transformers.OPTForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.decoder.layers:
            for norm in (layer.self_attn_layer_norm, layer.final_layer_norm):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.2, 0.2)
        for mod in m.modules():  # biases start at zero; make the bias folds visible
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.uniform_(-0.2, 0.2)
    return m


def random_scales(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.randn(n, generator=g) * 1.5)  # spread over ~two decades


def logits(m, ids):
    with torch.no_grad():
        return m(ids).logits.double()


def fold_everything(layers, seed, **kw):
    n = 0
    for i, layer in enumerate(layers):
        for j, g in enumerate(scaling_groups(layer, **kw)):
            fc = layer.get_submodule(g.layers[0])
            fold_scales(layer, g, random_scales(fc.in_features, seed + 10 * i + j))
            n += 1
    return n


def assert_same_function(before, after):
    diff = (before - after).abs().max().item()
    assert diff <= 1e-5 * before.abs().max().item(), diff


IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kv_heads, n_groups", [(4, 4), (2, 3)])
def test_llama_fold_leaves_outputs_unchanged(kv_heads, n_groups):
    m = llama(kv_heads)
    layer = m.model.layers[0]
    groups = scaling_groups(layer)
    assert len(groups) == n_groups
    assert groups[0] == ScalingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                     "self_attn.q_proj", "self_attn")
    assert [g.prev_op for g in groups] == ["input_layernorm"] + (["self_attn.v_proj"] if kv_heads == 4 else []) + \
        ["post_attention_layernorm", "mlp.up_proj"]
    assert scaling_groups(layer) == [ScalingGroup.from_quark(e) for e in LLAMA_QUARK
                                     if kv_heads == 4 or e["prev_op"] != "self_attn.v_proj"]
    before = logits(m, IDS)
    w0 = layer.input_layernorm.weight.detach().clone()
    assert fold_everything(m.model.layers, 1) == 2 * n_groups
    assert not torch.equal(layer.input_layernorm.weight, w0)  # the fold did change the parameters
    assert_same_function(before, logits(m, IDS))


def test_fold_arithmetic_is_exactly_the_float64_rule():
    m = llama(4)
    layer = m.model.layers[0]
    ref = copy.deepcopy(layer)
    s = random_scales(64, 5)
    fold_scales(layer, scaling_groups(layer)[0], s.numpy())  # numpy scales are accepted too
    s64 = s.double()
    assert torch.equal(layer.input_layernorm.weight, (ref.input_layernorm.weight.double() / s64).float())
    for n in ("q", "k", "v"):
        got = layer.self_attn.get_submodule(f"{n}_proj").weight
        want = (ref.self_attn.get_submodule(f"{n}_proj").weight.double() * s64).float()
        assert torch.equal(got, want)
    assert torch.equal(layer.self_attn.o_proj.weight, ref.self_attn.o_proj.weight)  # untouched
    # A Linear producer: output rows (and bias) divided.
    fold_scales(layer, scaling_groups(layer)[1], s)
    assert torch.equal(layer.self_attn.v_proj.weight, ((ref.self_attn.v_proj.weight.double() * s64)
                                                       .float().double() / s64[:, None]).float())


def test_qwen2_detected_and_exact():
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    m = transformers.Qwen2ForCausalLM(cfg).eval()  # q/k/v have biases
    assert len(scaling_groups(m.model.layers[0], model_type="qwen2")) == 3
    before = logits(m, IDS)
    fold_everything(m.model.layers, 3)
    assert_same_function(before, logits(m, IDS))


def test_opt_fold_leaves_outputs_unchanged():
    m = opt()
    groups = scaling_groups(m.model.decoder.layers[0], model_type="opt")
    assert [(g.prev_op, g.layers) for g in groups] == [
        ("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("self_attn.v_proj", ("self_attn.out_proj",)), ("final_layer_norm", ("fc1",)), ("fc1", ("fc2",))]
    before = logits(m, IDS)
    fold_everything(m.model.decoder.layers, 7)
    assert_same_function(before, logits(m, IDS))


def test_opt_gelu_has_no_fc1_fc2_group_and_post_norm_is_refused():
    groups = scaling_groups(opt(activation="gelu").model.decoder.layers[0])
    assert "fc1" not in [g.prev_op for g in groups] and len(groups) == 3
    with pytest.raises(ValueError, match="OPTDecoderLayer.*quark_entries"):
        scaling_groups(opt(pre_norm=False).model.decoder.layers[0])


def test_unsupported_layers_raise():
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                          num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(ValueError, match="layer type BertLayer.*quark_entries"):
        scaling_groups(bert.encoder.layer[0])
    with pytest.raises(ValueError, match="model_type 'opt', layer type LlamaDecoderLayer"):
        scaling_groups(llama(4).model.layers[0], model_type="opt")
    with pytest.raises(TypeError, match="layer must be a torch.nn.Module"):
        scaling_groups("layer")


def test_sandwich_norm_layers_are_not_llama_like():
    layer = llama(4).model.layers[0]
    layer.pre_feedforward_layernorm = copy.deepcopy(layer.post_attention_layernorm)
    with pytest.raises(ValueError, match="quark_entries"):
        scaling_groups(layer)


def test_quark_entries():
    gqa = llama(2).model.layers[0]
    with pytest.warns(UserWarning, match="left out 1 group"):
        groups = scaling_groups(gqa, quark_entries=LLAMA_QUARK)
    assert groups == scaling_groups(gqa)
    full = llama(4).model.layers[0]
    assert scaling_groups(full, quark_entries=LLAMA_QUARK) == [ScalingGroup.from_quark(e) for e in LLAMA_QUARK]
    with pytest.raises(ValueError, match="names 'mlp.w9'"):
        scaling_groups(full, quark_entries=[{"prev_op": "mlp.up_proj", "layers": ["mlp.w9"], "inp": "mlp.w9"}])
    with pytest.raises(ValueError, match="not an nn.Linear"):
        scaling_groups(full, quark_entries=[{"prev_op": "input_layernorm", "layers": ["mlp"], "inp": "mlp"}])
    with pytest.raises(TypeError, match="quark_entries must be a list"):
        scaling_groups(full, quark_entries={"prev_op": "x"})


def test_scaling_group_from_quark_and_validation():
    g = ScalingGroup.from_quark({"prev_op": "a", "layers": ["b", "c"], "inp": "b", "module2inspect": "",
                                 "has_kwargs": True})
    assert g == ScalingGroup("a", ("b", "c"), "b", "")
    with pytest.raises(ValueError, match="unknown key"):
        ScalingGroup.from_quark({"prev_op": "a", "layers": ["b"], "inp": "b", "scale": 2})
    with pytest.raises(ValueError, match="lacks"):
        ScalingGroup.from_quark({"prev_op": "a", "layers": ["b"]})
    with pytest.raises(ValueError, match="at least one"):
        ScalingGroup("a", (), "b")
    with pytest.raises(TypeError, match="layers must be a sequence"):
        ScalingGroup("a", "b", "b")
    with pytest.raises(ValueError, match="also one of its layers"):
        ScalingGroup("a", ("a",), "a")
    with pytest.raises(TypeError, match="prev_op must be a module name"):
        ScalingGroup(1, ("b",), "b")


def params_of(layer):
    return {k: v.detach().clone() for k, v in layer.state_dict().items()}


def assert_unchanged(layer, snap):
    for k, v in layer.state_dict().items():
        assert torch.equal(v, snap[k]), k


@pytest.mark.parametrize("group, s, exc, match", [
    (ScalingGroup("input_layernorm", ("self_attn.q_proj",), "self_attn.q_proj"), torch.ones(63), ValueError,
     "in_features=64, but s has 63"),
    (ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"), torch.ones(64), ValueError,
     "out_features=32.*grouped-query"),
    (ScalingGroup("mlp.act_fn", ("mlp.down_proj",), "mlp.down_proj"), torch.ones(128), ValueError,
     "SiLUActivation.*fold only into"),
    (ScalingGroup("input_layernorm", ("mlp",), "mlp"), torch.ones(64), ValueError, "not an nn.Linear"),
    (ScalingGroup("nope", ("self_attn.q_proj",), "self_attn.q_proj"), torch.ones(64), ValueError, "'nope'"),
    (ScalingGroup("input_layernorm", ("self_attn.q_proj",), "self_attn.q_proj"),
     torch.tensor([1.0] * 63 + [0.0]), ValueError, r"s\[63\] = 0.0"),
    (ScalingGroup("input_layernorm", ("self_attn.q_proj",), "self_attn.q_proj"),
     torch.tensor([1.0] * 63 + [float("nan")]), ValueError, "positive finite"),
    (ScalingGroup("input_layernorm", ("self_attn.q_proj",), "self_attn.q_proj"), np.ones(64, np.int64), TypeError,
     "floating-point"),
    (ScalingGroup("input_layernorm", ("self_attn.q_proj",), "self_attn.q_proj"), [1.0] * 64, TypeError,
     "numpy array or a torch tensor"),
    (ScalingGroup("input_layernorm", ("self_attn.q_proj",), "self_attn.q_proj"), torch.ones(8, 8), ValueError,
     "1-D"),
])
def test_fold_checks_everything_before_changing_anything(group, s, exc, match):
    layer = llama(2).model.layers[0]
    snap = params_of(layer)
    with pytest.raises(exc, match=match):
        fold_scales(layer, group, s)
    assert_unchanged(layer, snap)


def test_fold_refuses_norm_without_weight():
    layer = nn.Module()
    layer.norm = nn.LayerNorm(8, elementwise_affine=False)
    layer.fc = nn.Linear(8, 4)
    with pytest.raises(ValueError, match="needs a per-channel weight"):
        fold_scales(layer, ScalingGroup("norm", ("fc",), "fc"), torch.ones(8))
    with pytest.raises(TypeError, match="group must be a ScalingGroup"):
        fold_scales(layer, {"prev_op": "norm"}, torch.ones(8))


class GemmaRMSNorm(nn.Module):
    """Gemma's convention: normalize(x) * (1 + weight)."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n) * 0.3)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.weight)


def test_unit_offset_norm_folds_exactly():
    torch.manual_seed(0)
    block = nn.Module()
    block.norm = GemmaRMSNorm(32)
    block.fc = nn.Linear(32, 16)
    x = torch.randn(10, 32)
    before = block.fc(block.norm(x)).detach().double()
    fold_scales(block, ScalingGroup("norm", ("fc",), "fc"), random_scales(32, 9))
    assert_same_function(before, block.fc(block.norm(x)).detach().double())



class OffsetRMSNorm(GemmaRMSNorm):
    """A ``1 + w`` norm whose class no list knows: only its model's record can say how it scales."""


def test_the_family_record_says_how_a_norm_folds():
    """``fold_scales(..., family=)``: the record's ``norm`` (``rms_unit_offset``) decides, whatever the norm's class
    is called; without a record, Quark's class list does (``families.unit_offset_norm``)."""
    from qcore.adapters.families import BY_MODEL_TYPE, unit_offset_norm
    torch.manual_seed(0)
    block = nn.Module()
    block.norm = OffsetRMSNorm(32)
    block.fc = nn.Linear(32, 16)
    x = torch.randn(10, 32)
    before = block.fc(block.norm(x)).detach().double()
    assert not unit_offset_norm(block.norm) and unit_offset_norm(block.norm, BY_MODEL_TYPE["gemma"])
    assert not unit_offset_norm(GemmaRMSNorm(4), BY_MODEL_TYPE["llama"]) and unit_offset_norm(GemmaRMSNorm(4))
    fold_scales(block, ScalingGroup("norm", ("fc",), "fc"), random_scales(32, 9), family=BY_MODEL_TYPE["gemma"])
    assert_same_function(before, block.fc(block.norm(x)).detach().double())

def test_fold_keeps_parameter_dtype_and_identity():
    m = llama(4).to(torch.bfloat16)
    layer = m.model.layers[0]
    w = layer.self_attn.q_proj.weight
    fold_scales(layer, scaling_groups(layer)[0], random_scales(64, 2))
    assert layer.self_attn.q_proj.weight is w and w.dtype == torch.bfloat16

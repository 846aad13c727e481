"""Algorithm configs: qcore's dicts and AMD Quark's algo_config schema, validated, round-tripped."""

import pytest

from qcore.algorithms.config import (AutoSmoothQuantConfig, AWQConfig, GPTQConfig, SmoothQuantConfig,
                                     parse_algorithm, parse_algorithms)

# as Quark 0.13 writes them in an exported config.json / its recipe JSON files
QUARK_GPTQ = {"name": "gptq", "block_size": 128, "damp_percent": 0.01, "desc_act": True, "static_groups": True,
              "inside_layer_modules": ["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj", "self_attn.o_proj",
                                       "mlp.up_proj", "mlp.gate_proj", "mlp.down_proj"],
              "model_decoder_layers": "model.layers"}
SCALING = [{"prev_op": "input_layernorm", "layers": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            "inp": "self_attn.q_proj", "module2inspect": "self_attn"},
           {"prev_op": "post_attention_layernorm", "layers": ["mlp.gate_proj", "mlp.up_proj"],
            "inp": "mlp.gate_proj", "module2inspect": "mlp"}]


def test_quark_gptq_recipe():
    c = parse_algorithm(QUARK_GPTQ)
    assert c == GPTQConfig(block_size=128, damp=0.01, act_order=True, static_groups=True,
                           modules=tuple(QUARK_GPTQ["inside_layer_modules"]), decoder_layers="model.layers")
    assert c.to_quark() == QUARK_GPTQ
    assert parse_algorithm(c.to_dict()) == c
    # a Quark dict without static_groups gets Quark's default (True); qcore's own default is first-touch groups
    assert parse_algorithm({"name": "gptq", "desc_act": False}).static_groups is True
    assert parse_algorithm({"name": "gptq"}).static_groups is False


def test_quark_smooth_awq_autosmooth():
    s = parse_algorithm({"name": "smooth", "alpha": 0.85, "scale_clamp_min": 1e-3, "scaling_layers": SCALING,
                         "model_decoder_layers": "model.layers"})
    assert isinstance(s, SmoothQuantConfig) and s.alpha == 0.85 and s.clamp_min == 1e-3
    assert s.to_quark()["name"] == "smooth" and s.to_quark()["scaling_layers"] == SCALING
    a = parse_algorithm({"name": "awq", "scaling_layers": SCALING, "model_decoder_layers": "model.layers"})
    assert isinstance(a, AWQConfig) and parse_algorithm(a.to_dict()) == a
    z = parse_algorithm({"name": "autosmoothquant", "compute_scale_loss": "MAE"})
    assert isinstance(z, AutoSmoothQuantConfig) and z.loss.value == "mae" and z.to_quark()["compute_scale_loss"] == "MAE"


def test_names_list_as_the_command_line_gives_it():
    assert [c.name for c in parse_algorithms("smoothquant, gptq")] == ["smoothquant", "gptq"]
    assert parse_algorithms([]) == ()


@pytest.mark.parametrize("bad, err, match", [
    ({"name": "nosuchalgo"}, ValueError, "'nosuchalgo' is not available; known"),
    ({"alpha": 0.5}, ValueError, "has no 'name'"),
    ({"name": "gptq", "dampp": 0.1}, ValueError, "unknown key 'dampp'"),
    ({"name": "gptq", "damp": -0.1}, ValueError, "GPTQConfig.damp"),
    ({"name": "gptq", "block_size": 0}, ValueError, "GPTQConfig.block_size"),
    ({"name": "gptq", "desc_act": "yes"}, TypeError, "GPTQConfig.act_order must be a bool"),
    ({"name": "gptq", "damp": 0.1, "damp_percent": 0.1}, ValueError, "both set 'damp'"),
    ({"name": "smoothquant", "alpha": 1.5}, ValueError, r"alpha must be in \[0.0, 1.0\]"),
    ({"name": "awq", "scaling_layers": [{"layers": ["a"]}]}, ValueError, "needs 'prev_op'"),
    ({"name": "autosmoothquant", "compute_scale_loss": "L1"}, ValueError, "'mse' or 'mae'"),
    (3, TypeError, "a dict with a 'name'"),
])
def test_bad_configs_name_the_problem(bad, err, match):
    with pytest.raises(err, match=match):
        parse_algorithm(bad)


def test_rotation_configs_qcore_and_quark_spellings():
    from qcore.algorithms.config import QuaRotConfig, SpinQuantConfig
    q = parse_algorithm("quarot")
    assert q == QuaRotConfig() and q.online == ("mlp.down_proj", "self_attn.o_proj") and q.heads
    s = parse_algorithm({"name": "spinquant", "steps": 5, "online": ["self_attn.o_proj", "mlp.down_proj"], "key": 2})
    assert isinstance(s, SpinQuantConfig) and s.online == ("mlp.down_proj", "self_attn.o_proj")
    for c in (q, s, QuaRotConfig(online=("mlp.down_proj",), heads=False)):
        assert parse_algorithm(c.to_dict()) == c
        assert parse_algorithm(c.to_quark()) == c  # the exported spelling reads back
        assert c.to_quark()["name"] == "qcore_rotation"  # not Quark's "rotation": Quark must not load it
    fused = QuaRotConfig(online=(), heads=False)  # all in the weights: Quark's offline spelling
    assert fused.to_quark()["name"] == "rotation" and parse_algorithm(fused.to_quark()) == fused
    # Quark's RotationConfig: r2 -> heads, r4 -> online down_proj, trainable -> SpinQuant, random -> a key
    r = parse_algorithm({"name": "rotation", "r1": True, "r2": True, "r3": False, "r4": True, "random_r1": True,
                         "trainable": True, "model_decoder_layers": "model.layers", "scaling_layers": {}})
    assert isinstance(r, SpinQuantConfig) and r.online == ("mlp.down_proj",) and r.key == 0 and r.decoder_layers is None
    assert parse_algorithm({"name": "quarot", "r1": True, "r2": False}) == QuaRotConfig(key=None, heads=False, online=())
    for bad, msg in (({"r3": True}, "R3"), ({"online_r1_rotation": True}, "online R1"),
                     ({"rotation_size": 32, "r4": True}, "online block transforms"), ({"r1": False}, "r1=True"),
                     ({"mlp": "feed_forward"}, "Llama's layout"), ({"bogus": 1}, "unknown key")):
        with pytest.raises(ValueError, match=msg):
            parse_algorithm({"name": "rotation", **bad})
    # a fused block rotation (rotation_size, no r4) is weights only: it reads as quarot's block, and back
    b = parse_algorithm({"name": "rotation", "r1": True, "r2": False, "rotation_size": 32})
    assert b == QuaRotConfig(key=None, heads=False, online=(), block=32) and parse_algorithm(b.to_quark()) == b
    with pytest.raises(ValueError, match="online must name"):
        QuaRotConfig(online=("mlp.up_proj",))
    with pytest.raises(ValueError, match="lr must be"):
        SpinQuantConfig(lr=0)
    with pytest.raises(ValueError, match="must come first"):
        parse_algorithms(["gptq", "quarot"])
    with pytest.raises(ValueError, match="must come first"):
        parse_algorithms(["quarot", "spinquant"])
    assert [a.name for a in parse_algorithms("quarot,gptq")] == ["quarot", "gptq"]

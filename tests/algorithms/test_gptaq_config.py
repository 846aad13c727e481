"""GPTAQConfig: qcore's dict round trip, Quark's algo_config spelling read and written (checked against the field
names of Quark 0.13's GPTAQConfig when its source is installed), validation."""

from __future__ import annotations

import ast
import pathlib

import pytest

from qcore.algorithms.config import GPTAQConfig, parse_algorithm, parse_algorithms

QUARK_CONFIG = pathlib.Path.home() / (".cache/qcore/interop/quark-0.13/lib/python3.11/site-packages/quark/torch/"
                                      "quantization/config/config.py")

QUARK_DICT = {"name": "gptaq", "block_size": 64, "damp_percent": 0.02, "alpha": 0.5, "desc_act": True,
              "static_groups": True, "inside_layer_modules": ["self_attn.q_proj", "mlp.down_proj"],
              "model_decoder_layers": "model.layers"}


def test_round_trips_qcores_dict():
    for c in (GPTAQConfig(), GPTAQConfig(alpha=0.0, act_order=False, true_sequential=True, modules=("mlp.up_proj",),
                                         decoder_layers="model.layers", block_size=32, damp=0.1)):
        assert parse_algorithm(c.to_dict()) == c
    assert parse_algorithm("gptaq") == GPTAQConfig()
    assert parse_algorithms("gptaq") == (GPTAQConfig(),)
    assert GPTAQConfig().alpha == 0.25


def test_reads_and_writes_quarks_spelling():
    c = parse_algorithm(QUARK_DICT)
    assert c == GPTAQConfig(block_size=64, damp=0.02, alpha=0.5, act_order=True, static_groups=True,
                            modules=("self_attn.q_proj", "mlp.down_proj"), decoder_layers="model.layers")
    assert c.to_quark() == QUARK_DICT
    assert parse_algorithm(c.to_quark()) == c
    assert GPTAQConfig().to_quark()["model_decoder_layers"] == ""


def test_quarks_field_names_are_the_ones_written():
    if not QUARK_CONFIG.exists():
        pytest.skip("Quark 0.13's source is not installed here")
    tree = ast.parse(QUARK_CONFIG.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "GPTAQConfig")
    fields = {s.target.id: s for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    assert set(fields) == set(QUARK_DICT)
    assert ast.literal_eval(fields["alpha"].value) == GPTAQConfig().alpha  # the same default weight


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="alpha"):
        GPTAQConfig(alpha=-0.1)
    with pytest.raises(ValueError, match="unknown key 'alpah'"):
        parse_algorithm({"name": "gptaq", "alpah": 0.3})
    with pytest.raises(TypeError, match="act_order"):
        GPTAQConfig(act_order="yes")

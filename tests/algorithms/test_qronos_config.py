"""QronosConfig: qcore's dict round trip, Quark's algo_config spelling read and written (field names checked
against Quark 0.13's QronosConfig source when it is installed), validation."""

from __future__ import annotations

import os
import pathlib
import re

import pytest

from qcore.algorithms.config import QronosConfig, parse_algorithm, parse_algorithms

# as Quark 0.13's QronosConfig has them (quark/torch/quantization/config/config.py)
QUARK_QRONOS = {"name": "qronos", "block_size": 128, "desc_act": True, "static_groups": True, "alpha": 1e-3,
                "beta": 1e4, "inside_layer_modules": ["self_attn.q_proj", "mlp.down_proj"],
                "model_decoder_layers": "model.layers"}
# in the interop suite's venv (tests/interop/conftest.py: $QCORE_INTEROP_CACHE, default ~/.cache/qcore/interop/...)
QUARK_SRC = next(iter(sorted(
    pathlib.Path(os.environ.get("QCORE_INTEROP_CACHE", "~/.cache/qcore/interop/quark-0.13")).expanduser()
    .glob("lib/python3*/site-packages/quark/torch/quantization/config/config.py"))), None)


def test_qcore_dict_round_trip():
    for c in (QronosConfig(), QronosConfig(block_size=64, damp=0.01, damp_scale="mean_diagonal", act_order=False,
                                           static_groups=True, true_sequential=False, modules=("mlp.up_proj",),
                                           decoder_layers="model.layers")):
        assert parse_algorithm(c.to_dict()) == c
        assert parse_algorithm(c) is c
    assert parse_algorithm("qronos") == QronosConfig()
    assert parse_algorithms("qronos")[0].name == "qronos"


def test_quark_spelling_read_and_written():
    c = parse_algorithm(QUARK_QRONOS)
    assert c == QronosConfig(block_size=128, damp=1e-3, damp_scale="max_eigenvalue", beta=1e4, act_order=True,
                             static_groups=True, modules=("self_attn.q_proj", "mlp.down_proj"),
                             decoder_layers="model.layers")
    assert c.to_quark() == QUARK_QRONOS
    # a Quark dict without static_groups gets Quark's default (True); qcore's own default is first-touch groups
    assert parse_algorithm({"name": "qronos", "alpha": 0.01}).static_groups is True
    assert QronosConfig().static_groups is False
    with pytest.raises(ValueError, match="damp_scale='mean_diagonal' has no Quark spelling"):
        QronosConfig(damp_scale="mean_diagonal").to_quark()


def test_field_names_are_quarks():
    if QUARK_SRC is None:
        pytest.skip("Quark 0.13's source is not installed here")
    src = QUARK_SRC.read_text()
    body = src[src.index("class QronosConfig("):]
    body = body[:body.index("\n    def ")]
    fields = set(re.findall(r"^    (\w+): [^=\n]+", body, flags=re.M))
    assert fields == set(QronosConfig().to_quark())
    assert re.search(r"^    alpha: float = 1e-3$", body, flags=re.M) and QronosConfig().damp == 1e-3
    assert re.search(r"^    beta: float = 1e4$", body, flags=re.M) and QronosConfig().beta == 1e4


@pytest.mark.parametrize("bad, match", [
    ({"block_size": 0}, "block_size"), ({"damp": -1.0}, "damp"), ({"damp_scale": "trace"}, "damp_scale"),
    ({"beta": 0.0}, "beta"), ({"act_order": 1}, "act_order"), ({"modules": "mlp"}, "modules"),
    ({"nope": 1}, "unknown key 'nope'"),
])
def test_bad_values_are_refused(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        parse_algorithm({"name": "qronos", **bad})

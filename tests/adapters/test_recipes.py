"""``--algo best``: each scheme's measured recipe as data (src/qcore/adapters/recipes.py), resolved by the main job
before any work, shown by ``qcore schemes`` and listed in docs/algorithms.md."""

import json
import pathlib
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from qcore.adapters import quantize_and_report  # noqa: E402
from qcore.adapters.config import MSE, MinMax  # noqa: E402
from qcore.adapters.jobs.common import CommandError  # noqa: E402
from qcore.adapters.presets import PRESETS, preset  # noqa: E402
from qcore.adapters.recipes import RECIPES, Recipe, apply_recipe, best_recipe, recipe_label  # noqa: E402
from qcore.cli import main  # noqa: E402

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"


def test_every_recipe_belongs_to_a_preset_and_parses():
    for name, r in RECIPES.items():
        assert name in PRESETS, name
        assert r.algorithms and r.measured and r.source, name
        c = apply_recipe(preset(name), r)
        assert c.algorithms == r.algorithms


def test_a_recipe_replaces_the_weight_observer_and_keeps_the_rest():
    r = Recipe(("gptq",), weight_observer=MSE(grid=10))
    base = preset("uint4_wo_64")
    c = apply_recipe(base, r, after=("distill",))
    assert [a.name for a in c.algorithms] == ["gptq", "distill"]
    assert c.layer.weight.observer == MSE(grid=10) and base.layer.weight.observer == MinMax()
    assert c.layer.weight.spec == base.layer.weight.spec and c.exclude == base.exclude
    with pytest.raises(ValueError, match=r"only distill may follow"):
        apply_recipe(base, r, after=("gptq",))
    with pytest.raises(TypeError, match=r"Recipe\.weight_observer must be an observer"):
        Recipe(("gptq",), weight_observer="mse")


def test_schemes_without_a_recipe_are_named():
    with pytest.raises(ValueError, match=r"'fp8' is a preset without a measured recipe; the schemes with a best "
                                         r"recipe are w_mxfp4_a_mxfp4"):
        best_recipe("fp8")
    with pytest.raises(ValueError, match=r"'nope' is not a preset"):
        best_recipe("nope")


@pytest.mark.parametrize("algos, scheme, extra, match", [
    (["gptq", "best"], "w_mxfp4_a_mxfp4", {}, r"'best' stands for the scheme's whole recipe: it comes first"),
    (["best", "gptq"], "w_mxfp4_a_mxfp4", {}, r"only distill may follow"),
    (["best"], "fp8", {}, r"'fp8' is a preset without a measured recipe"),
    (["best"], None, dict(amp="w_mxfp4_a_mxfp4,float", target_bits=6.0), r"a recipe belongs to one "
                                                                                          r"scheme"),
])
def test_best_is_refused_before_any_work(lm_dir, algos, scheme, extra, match, monkeypatch):
    from qcore.adapters.jobs import quantize as J

    def fail(*a, **k):
        pytest.fail("work started before the refusal")
    monkeypatch.setattr(J, "load_model", fail)
    monkeypatch.setattr(J.quantizer, "quantize_model", fail)
    with pytest.raises(CommandError, match=match):
        quantize_and_report(lm_dir, scheme, algorithms=algos, eval="none", progress=False, **extra)


def test_best_runs_the_recipe_and_reports_it(lm_dir, tmp_path, capsys):
    report = tmp_path / "r.json"
    assert main(["quantize", "--model", str(lm_dir), "--scheme", "mxfp4_weight_only", "--algo", "best",
                 "--eval", "none", "--eval-text", str(lm_dir.parent / "text.txt"), "--seq-len", "32",
                 "--calib-samples", "2", "--no-progress", "--report", str(report)]) == 0
    d = json.loads(report.read_text())
    assert d["algorithms"] == [a.name for a in RECIPES["mxfp4_weight_only"].algorithms]
    assert "--algo best: " + recipe_label(RECIPES["mxfp4_weight_only"]) in capsys.readouterr().out


def test_qcore_schemes_prints_each_recipe(capsys):
    assert main(["schemes"]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines() if ln.strip()}
    for name, r in RECIPES.items():
        assert lines[name].endswith(f"--algo best: {recipe_label(r)}"), name
    assert "--algo best" not in lines["fp8"]


def test_the_docs_table_is_the_recipes():
    """docs/algorithms.md's table 'The best recipe of each scheme' lists RECIPES, row for row."""
    text = DOCS.read_text()
    section = text.split("## The best recipe of each scheme", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    got = {re.match(r"\| `([^`]+)`", ln).group(1): ln for ln in rows}
    assert list(got) == list(RECIPES)
    for name, r in RECIPES.items():
        assert f"`{recipe_label(r)}`" in got[name] and r.measured in got[name], name

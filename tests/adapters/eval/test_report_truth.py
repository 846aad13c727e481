"""What ``qcore quantize`` shows is what it committed: per-layer SQNR after an algorithm, the output-error ranking,
the plot (``qcore.adapters.eval.layer_report``)."""

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qcore.algorithms.metrics import sqnr_db  # noqa: E402
from qcore.cli import main  # noqa: E402


def _quantize(lm_dir, tmp_path, name, *extra):
    rep = tmp_path / f"{name}.json"
    argv = ["quantize", "--model", str(lm_dir), "--eval", "none", "--eval-text", str(lm_dir.parent / "text.txt"),
            "--seq-len", "32", "--calib-samples", "3", "--report", str(rep), "--no-progress", *extra]
    assert main(argv) == 0
    return json.loads(rep.read_text())


@pytest.fixture(scope="module")
def gptq_run(lm_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gptq")
    out = tmp / "ckpt"
    r = _quantize(lm_dir, tmp, "gptq", "--scheme", "uint4_wo_32", "--algo", "gptq", "--output", str(out))
    return r, out


def test_after_gptq_the_report_shows_the_committed_weights_not_rtn(lm_dir, gptq_run, tmp_path):
    r, _ = gptq_run
    rtn = _quantize(lm_dir, tmp_path, "rtn", "--scheme", "uint4_wo_32")
    assert set(r["per_layer_sqnr_db"]) == set(rtn["per_layer_sqnr_db"]) and len(rtn["per_layer_sqnr_db"]) == 14
    # the RTN run and the GPTQ run's own round-to-nearest reference agree (same weights, same rule)
    assert r["per_layer_rtn_sqnr_db"] == pytest.approx(rtn["per_layer_sqnr_db"], rel=1e-9)
    assert rtn["per_layer_rtn_sqnr_db"] is None  # no algorithm: nothing to compare with
    # GPTQ's weights differ from round-to-nearest in every layer; it trades weight error for output error
    for n, v in r["per_layer_sqnr_db"].items():
        assert abs(v - rtn["per_layer_sqnr_db"][n]) > 1e-3, n
    assert sum(r["per_layer_output_sqnr_db"].values()) > sum(r["per_layer_rtn_output_sqnr_db"].values())


def test_reported_sqnr_equals_the_sqnr_of_the_exported_weights(lm_dir, gptq_run):
    r, out = gptq_run
    from qcore.adapters import from_pretrained
    from qcore.adapters.plan import quantized_modules
    float_model = transformers.AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)
    q = from_pretrained(out, dtype=torch.float32)
    mods = quantized_modules(q)
    assert set(mods) == set(r["per_layer_sqnr_db"])
    for n, m in mods.items():
        w = float_model.get_submodule(n).weight.detach()
        assert sqnr_db(w, m._w().detach()) == pytest.approx(r["per_layer_sqnr_db"][n], abs=1e-9), n


def test_output_error_ranks_layers_that_weight_sqnr_ties(lm_dir, tmp_path, capsys):
    # block 1's attention made sensitive without changing its weight SQNR: its input gets a huge channel 0 (the
    # norm scaled there) and the q/k/v weight columns 0 are shrunk by the same factor (the float layers compute
    # what they did). Those columns are tiny next to the rows' absmax, so fp8 rounds them coarsely (subnormals),
    # and per-token fp8 activations lose the other channels next to the huge one: the weight SQNR cannot see it
    # (the columns hold no energy), the output SQNR does
    import shutil
    d = tmp_path / "outlier"
    shutil.copytree(lm_dir, d)
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.no_grad():
        m.model.layers[1].input_layernorm.weight[0] *= 1e5
        for p in ("q_proj", "k_proj", "v_proj"):
            getattr(m.model.layers[1].self_attn, p).weight[:, 0] *= 1e-5
    m.save_pretrained(d)
    shutil.copy(lm_dir.parent / "text.txt", tmp_path / "text.txt")
    r = _quantize(d, tmp_path, "fp8", "--scheme", "ptpc_fp8")
    w, o = r["per_layer_sqnr_db"], r["per_layer_output_sqnr_db"]
    assert all(v is not None and math.isfinite(v) for v in o.values())
    attn1 = {f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")}
    assert max(w.values()) - min(w.values()) < 1.0  # per-channel fp8 weights: every layer ~32 dB
    assert set(sorted(w, key=w.get)[:3]) != attn1
    assert set(r["worst_layers"][:3]) == attn1  # ranked by output SQNR, worst first
    assert max(o[n] for n in attn1) + 5.0 < min(v for n, v in o.items() if n not in attn1)
    assert r["worst_layers"] == sorted(o, key=o.get)[:5]
    assert r["layer_metrics"]["ranked_by"] == "output SQNR" and r["layer_metrics"]["output_windows"] == 3
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "worst layers" in ln)
    assert "output SQNR" in line and r["worst_layers"][0] in line


def test_without_calibration_text_layers_rank_by_weight_sqnr(tmp_path, lm_dir, capsys):
    import shutil
    d = tmp_path / "notok"
    shutil.copytree(lm_dir, d)
    for f in d.glob("tokenizer*"):
        f.unlink()
    (d / "special_tokens_map.json").unlink(missing_ok=True)
    rep = tmp_path / "r.json"
    assert main(["quantize", "--model", str(d), "--scheme", "uint4_wo_32", "--eval", "none", "--report", str(rep),
                 "--no-progress"]) == 0
    r = json.loads(rep.read_text())
    assert all(v is None for v in r["per_layer_output_sqnr_db"].values())
    assert r["worst_layers"] == sorted(r["per_layer_sqnr_db"], key=r["per_layer_sqnr_db"].get)[:5]
    assert "worst layers (weight SQNR)" in capsys.readouterr().out


def test_plot_has_two_panels_by_block_and_projection_before_and_after(lm_dir, tmp_path):
    pytest.importorskip("matplotlib")
    from qcore.adapters.eval import layer_report as LR
    png = tmp_path / "p.png"
    rep = tmp_path / "r.json"
    assert main(["quantize", "--model", str(lm_dir), "--eval-text", str(lm_dir.parent / "text.txt"), "--seq-len",
                 "32", "--calib-samples", "3", "--scheme", "uint4_wo_32", "--algo", "gptq", "--plot", str(png),
                 "--report", str(rep), "--no-progress"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob("*.partial"))
    r = json.loads(rep.read_text())

    def errs(w, o):
        return {n: LR.LayerError(r[w][n], r[o][n]) for n in r[w]}
    fig = LR.figure(errs("per_layer_sqnr_db", "per_layer_output_sqnr_db"),
                    errs("per_layer_rtn_sqnr_db", "per_layer_rtn_output_sqnr_db"),
                    title=f"tiny: {r['scheme']} + gptq\nperplexity {r['ppl_baseline']:.3f} (float) -> {r['ppl']:.3f}")
    axes = fig.get_axes()
    assert [a.get_ylabel() for a in axes] == ["weight SQNR (dB)", "output SQNR on calibration (dB)"]
    assert axes[1].get_xlabel() == "decoder block" and [t.get_text() for t in axes[1].get_xticklabels()] == ["0", "1"]
    assert "uint4_wo_32 + gptq" in fig._suptitle.get_text() and "perplexity" in fig._suptitle.get_text()
    kinds = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    labels = {t.get_text() for t in fig.legends[0].get_texts()}
    assert kinds <= labels and "round-to-nearest\n(before)" in labels
    for ax in axes:  # one committed and one RTN line per projection kind, one point per block
        assert len(ax.get_lines()) == 2 * len(kinds)
        assert all(len(ln.get_xdata()) == 2 for ln in ax.get_lines())
    ys = {tuple(ln.get_ydata()) for ln in axes[0].get_lines()}
    q = [n for n in r["per_layer_sqnr_db"] if n.endswith("q_proj")]
    assert tuple(r["per_layer_sqnr_db"][n] for n in sorted(q)) in ys


def test_block_and_kind():
    from qcore.adapters.eval.layer_report import block_and_kind
    assert block_and_kind("model.layers.12.self_attn.q_proj") == (12, "q_proj")
    assert block_and_kind("model.layers.3.mlp.experts.7.down_proj") == (3, "down_proj")
    assert block_and_kind("lm_head") == (None, "lm_head")


def test_convert_shows_progress_unless_told_not_to(lm_dir, tmp_path, capsys):
    src = tmp_path / "src"
    assert main(["quantize", "--model", str(lm_dir), "--scheme", "uint4_wo_32", "--eval", "none", "--output",
                 str(src), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "ct"), "--to", "ct"]) == 0
    err = capsys.readouterr().err
    for stage in ("convert: loading hf source", "convert: writing compressed-tensors",
                  "convert: loading the result back to compare", "convert: moving into place"):
        assert stage in err, stage
    assert main(["convert", str(src), str(tmp_path / "ct2"), "--to", "ct", "--no-progress"]) == 0
    assert "convert:" not in capsys.readouterr().err


@pytest.mark.parametrize("algo", ["smoothquant", "quarot", "awq"])
def test_after_a_transform_the_reference_is_the_transformed_float_weight(zoo, algo):
    """Rotations and smoothing folds change the float weights: the reference is the weight rounding started from,
    in the basis the layer computes in. A reference in the wrong basis would give an output SQNR near 0 dB."""
    from qcore.adapters import preset, quantize_model
    from qcore.adapters.eval import layer_report as LR
    model = zoo.tiny_llama()
    original = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    data = zoo.token_batches(2, seed=1)
    reference: dict = {}
    quantize_model(model, preset("w_int8_a_int8_per_token_dynamic").replace(algorithms=({"name": algo},)), data,
                   progress=False, reference=reference)
    errors = LR.measure(model, reference, data)
    changed = [n for n in reference if not torch.equal(reference[n], original[n])]
    assert changed  # the transform rewrote float weights before rounding
    for n, e in errors.items():
        assert e.weight_sqnr_db == pytest.approx(sqnr_db(reference[n], model.get_submodule(n).weight.detach()))
        assert e.output_sqnr_db is not None and e.output_sqnr_db > 20.0, (n, e)  # int8: ~40 dB


def test_figure_places_modules_outside_blocks_after_the_last_block():
    pytest.importorskip("matplotlib")
    from qcore.adapters.eval import layer_report as LR
    errs = {f"model.layers.{b}.self_attn.{k}": LR.LayerError(30.0 + b, None) for b in range(3) for k in ("q_proj",
                                                                                                        "o_proj")}
    errs["lm_head"] = LR.LayerError(25.0, None)
    fig = LR.figure(errs, title="t")
    (ax,) = fig.get_axes()  # no output SQNR measured: one panel
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "2", "lm_head"]
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}
    assert lines["q_proj"] == ([0, 1, 2], [30.0, 31.0, 32.0]) and lines["lm_head"] == ([3], [25.0])
    assert "then: lm_head" in ax.get_xlabel()

"""Layerwise mixed precision (qcore.adapters.passes.amp): sensitivities equal a direct measurement with quantize_model,
coarser schemes cost more, the model is left unchanged, amp_config meets its target, and the AMP export writes
Quark's layer_quant_config and reloads with the same logits."""

import copy
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import qcore.adapters as A  # noqa: E402
from qcore.adapters.passes.amp import (DEFAULT_TIE, Metric, Sensitivity, amp_config, config_from_choice,  # noqa: E402
                                layer_sensitivity)

MX, FP8 = "w_mxfp4_a_mxfp4", "w_fp8_a_fp8"


@pytest.fixture(scope="module")
def llama(zoo):
    return zoo.tiny_llama(0)


@pytest.fixture(scope="module")
def batches(zoo):
    return zoo.token_batches(2, seed=1)


@pytest.fixture(scope="module")
def sens(llama, batches):
    return layer_sensitivity(llama, [MX, FP8, "float"], batches, progress=False)


def _direct_kl(model, unit, scheme, batches, exclude=None):
    """KL(float || model with only ``unit`` quantized), measured with quantize_model on a copy."""
    ref = [torch.log_softmax(model(b).logits.float(), -1) for b in batches]
    m = copy.deepcopy(model)
    A.quantize_model(m, A.ModelConfig(A.LayerConfig(), by_name={n: A.preset(scheme).layer for n in unit},
                                      exclude=exclude), batches, progress=False)
    tot, cnt = 0.0, 0
    with torch.no_grad():
        for b, lp in zip(batches, ref):
            lq = torch.log_softmax(m(b).logits.float(), -1)
            kl = (lp.exp() * (lp - lq)).sum(-1)
            tot += float(kl.double().sum())
            cnt += kl.numel()
    return tot / cnt


def test_units_follow_vllms_fused_layers(sens):
    assert sens.schemes == (MX, FP8, "float")
    assert len(sens.units) == 8  # per decoder layer: qkv, o, gate_up, down
    assert sens.units[0] == tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    assert sens.units[2] == ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")
    assert not any("lm_head" in n for u in sens.units for n in u)
    assert sens.weights[0] == 64 * 64 + 2 * 64 * 32 and sens.weights[3] == 128 * 64


@pytest.mark.parametrize("i", [0, 3, 5])  # layer 0 (full forward) and layer 1 (earlier layer skipped, replayed)
def test_sensitivity_equals_a_direct_measurement(llama, batches, sens, i):
    with torch.no_grad():
        for j, scheme in enumerate((MX, FP8)):  # dynamic and static (calibrated) activations
            assert sens.loss[i][j] == pytest.approx(_direct_kl(llama, sens.units[i], scheme, batches), rel=1e-6,
                                                    abs=1e-12)


def test_a_unit_after_the_decoder_layers_is_calibrated_and_measured_by_full_forwards(llama, batches):
    s = layer_sensitivity(llama, [FP8], batches, exclude=(), progress=False)
    assert s.units[-1] == ("lm_head",)
    with torch.no_grad():
        assert s.loss[-1][0] == pytest.approx(_direct_kl(llama, ("lm_head",), FP8, batches, exclude=()), rel=1e-6)


def test_coarser_schemes_lose_more_and_float_loses_nothing(sens):
    for unit, (mx, fp8, fl) in zip(sens.units, sens.loss):
        assert mx > fp8 > 0.0, unit
        assert fl == 0.0
    for (mx, fp8, fl), unit in zip(sens.bits, sens.units):
        assert mx == 4.25 and 8.0 < fp8 < 8.02 and fl == 32.0  # fp8: 8 + 32/numel per layer (float32 scale)


def test_model_is_left_unchanged(zoo, batches):
    m = zoo.tiny_llama(0)
    ref = [m(b).logits for b in batches]
    state = {k: v.clone() for k, v in m.state_dict().items()}
    layer_sensitivity(m, [MX, FP8], batches, progress=False)
    assert all(type(x) in (torch.nn.Linear,) for n, x in m.named_modules() if n.endswith("_proj"))
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in state.items())
    assert all(torch.equal(m(b).logits, r) for b, r in zip(batches, ref))


def test_nll_metric(llama, batches):
    s = layer_sensitivity(llama, [MX], batches, metric=Metric.NLL, tie=(), progress=False)
    assert len(s.units) == 14 and s.metric is Metric.NLL
    with torch.no_grad():
        nll = [torch.nn.functional.cross_entropy(llama(b).logits[:, :-1].reshape(-1, 128), b[:, 1:].reshape(-1),
                                                 reduction="sum") for b in batches]
    assert s.base == pytest.approx(float(sum(nll)) / sum(b[:, 1:].numel() for b in batches), rel=1e-6)
    m = copy.deepcopy(llama)
    A.quantize_model(m, A.ModelConfig(A.LayerConfig(), by_name={s.units[4][0]: A.preset(MX).layer}), progress=False)
    with torch.no_grad():
        q = [torch.nn.functional.cross_entropy(m(b).logits[:, :-1].reshape(-1, 128), b[:, 1:].reshape(-1),
                                               reduction="sum") for b in batches]
    assert s.loss[4][0] == pytest.approx(float(sum(q)) / sum(b[:, 1:].numel() for b in batches) - s.base, abs=1e-6)


def test_a_model_without_decoder_layers_runs_full_forwards():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).eval()
    xs = [torch.randn(4, 64) for _ in range(2)]
    s = layer_sensitivity(m, {"mx": MX, "fp8": FP8}, xs, progress=False)
    assert s.units == (("0",), ("2",))
    ref = [torch.log_softmax(m(x), -1) for x in xs]
    q = copy.deepcopy(m)
    A.quantize_model(q, A.ModelConfig(A.LayerConfig(), by_name={"2": A.preset(FP8).layer}, exclude=()), xs,
                     progress=False)
    with torch.no_grad():
        kl = [(r.exp() * (r - torch.log_softmax(q(x), -1))).sum(-1) for x, r in zip(xs, ref)]
    assert s.loss[1][1] == pytest.approx(float(torch.cat(kl).double().mean()), rel=1e-6)


@pytest.mark.parametrize("target", [4.25, 5.0, 6.0, 8.1])
def test_amp_config_meets_the_target(llama, batches, sens, target):
    cfg = amp_config(llama, [MX, FP8, "float"], sensitivity=sens, target_bits=target)
    names = [n for u in sens.units for n in u]
    assert list(cfg.by_name) == names  # exactly the layer names: Quark's layer_quant_config
    plans = {p.name: p for p in A.plan_model(copy.deepcopy(llama), cfg)}
    total = bits = 0
    for n in names:
        w = llama.get_submodule(n).weight
        lc = cfg.by_name[n]
        b = 32.0 if lc is None else lc.weight.spec.bits_per_element(tuple(w.shape))
        assert (lc is None) == (n not in plans)
        bits += b * w.numel()
        total += w.numel()
    assert bits / total <= target + 1e-9
    r = sens.search(target_bits=target)
    assert bits / total == pytest.approx(r.average_bits)
    for unit in sens.units:  # vLLM's fused shards share one scheme
        assert len({repr(cfg.by_name[n]) for n in unit}) == 1


def test_amp_config_measures_when_not_given_a_sensitivity(llama, batches, sens):
    a = amp_config(llama, [MX, FP8, "float"], batches, target_bits=5.0, progress=False)
    assert a == amp_config(llama, [MX, FP8, "float"], sensitivity=sens, target_bits=5.0)
    b = amp_config(llama, [MX, FP8, "float"], sensitivity=sens, max_loss=sum(x[1] for x in sens.loss))
    assert all(v is not None for v in b.by_name.values())  # fp8 everywhere fits this quality budget


def test_amp_export_reloads_with_layer_quant_config(llama, batches, sens, tmp_path):
    sens2 = Sensitivity.from_dict(json.loads(json.dumps(sens.to_dict())))
    assert sens2 == sens
    r = sens.search(target_bits=5.5)
    assert 0 < r.share(FP8) < 1 and r.share("float") == 0  # a real mix of MXFP4 and fp8
    cfg = config_from_choice(sens, [MX, FP8, "float"], r)
    m = copy.deepcopy(llama)
    A.quantize_model(m, cfg, batches, progress=False)
    A.freeze(m)
    with torch.no_grad():
        ref = [m(b).logits for b in batches]
    A.export_hf(m, tmp_path / "amp")
    qc = json.loads((tmp_path / "amp" / "config.json").read_text())["quantization_config"]
    lqc = qc["layer_quant_config"]
    chosen = r.as_dict()
    for unit in sens.units:
        for n in unit:
            w = lqc[n]["weight"]
            dtype = "fp4" if chosen[Sensitivity.label(unit)] == MX else "fp8_e4m3"
            assert w["dtype"] == dtype, (n, w)
            assert lqc[n]["input_tensors"]["dtype"] == dtype
    assert qc["exclude"] == ["lm_head"]
    back = A.from_pretrained(tmp_path / "amp")
    with torch.no_grad():
        assert all(torch.equal(back(b).logits, x) for b, x in zip(batches, ref))
    for n, lc in cfg.by_name.items():
        assert back.get_submodule(n).qconfig == lc


def test_errors(llama, batches, sens):
    with pytest.raises(ValueError, match="unknown preset 'mxfp3'"):
        layer_sensitivity(llama, ["mxfp3"], batches)
    with pytest.raises(ValueError, match="at least one that quantizes"):
        layer_sensitivity(llama, ["float"], batches)
    with pytest.raises(TypeError, match="metric must be"):
        layer_sensitivity(llama, [MX], batches, metric="kl")
    with pytest.raises(TypeError, match="batches must be a non-empty list"):
        layer_sensitivity(llama, [MX], batches[0])
    with pytest.raises(ValueError, match="tie"):
        layer_sensitivity(llama, [MX], batches, tie="q_proj")
    with pytest.raises(ValueError, match="given twice"):
        layer_sensitivity(llama, [MX, MX], batches)
    with pytest.raises(ValueError, match="exactly one of target_bits and max_loss"):
        amp_config(llama, [MX, FP8, "float"], sensitivity=sens)
    with pytest.raises(ValueError, match="measured for schemes"):
        amp_config(llama, [MX, FP8], sensitivity=sens, target_bits=5)
    with pytest.raises(ValueError, match="pass batches"):
        amp_config(llama, [MX, FP8], target_bits=5)
    with pytest.raises(ValueError, match="target_bits: got 4.0; expected at least 4.25"):
        amp_config(llama, [MX, FP8, "float"], sensitivity=sens, target_bits=4.0)
    assert DEFAULT_TIE == (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

"""transformers' ``Conv1D`` (GPT-2's ``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``: ``y = x @ W + b``
with ``W`` stored ``[in, out]``) is quantized exactly as the ``nn.Linear`` holding ``W^T`` (issue 22).

The references are independent of the wrapper: a Linear twin of each Conv1D (``weight = W^T``) quantized by
``QuantLinear``, and ``qcore.fake_quantize`` on ``W^T`` itself. Tiny random GPT-2 built offline.
"""

import copy
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch import nn  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

import qcore  # noqa: E402
from qcore import PerChannel, PerGroup, PerTensor  # noqa: E402
from qcore.adapters import (PRESETS, LayerConfig, ModelConfig, TensorConfig, excluded_weights, export_hf,  # noqa: E402
                            freeze, from_pretrained, plan_model, preset, quantize_model, quantized_modules,
                            unquantized_weights, wrap)
from qcore.adapters.modules import (IN_OUT, OUT_IN, QuantConv1D, QuantLinear, linear_weight,  # noqa: E402
                                    weight_layout)

V = 128
CONV1D = [f"transformer.h.{i}.{n}" for i in (0, 1) for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


def tiny_gpt2(*, tie: bool = True):
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                                  eos_token_id=0, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def gpt2():
    return tiny_gpt2()


def linear_twin(model):
    """A copy of ``model`` with every Conv1D replaced by the nn.Linear computing the same function (W^T, b)."""
    twin = copy.deepcopy(model)
    for name, m in list(twin.named_modules()):
        if type(m) is Conv1D:
            lin = nn.Linear(m.nx, m.nf)
            with torch.no_grad():
                lin.weight.copy_(m.weight.t())
                lin.bias.copy_(m.bias)
            parent, _, child = name.rpartition(".")
            setattr(twin.get_submodule(parent), child, lin)
    return twin


def batches(n, *, seed, seq=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (2, seq), generator=g) for _ in range(n)]


IDS = batches(1, seed=5)[0]


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def bits(t):
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def needs_data(cfg: ModelConfig) -> bool:
    return any(tc is not None and tc.calibrated for tc in (cfg.layer.input, cfg.layer.output))


# ---------------------------------------------------------------------------------------------------------------
# the module: bit for bit the Linear of W^T
# ---------------------------------------------------------------------------------------------------------------

def _tc(name, gran, *, dynamic=False, **kw):
    return TensorConfig(qcore.make_spec(name, granularity=gran, **kw), dynamic=dynamic)


CONFIGS = {
    "uint4_group32_asym": LayerConfig(weight=_tc("uint4", PerGroup(32, 1), symmetric=False)),
    "int8_channel_static_input": LayerConfig(weight=_tc("int8", PerChannel(0)), input=_tc("int8", PerTensor())),
    "int8_channel_per_token_dynamic": LayerConfig(weight=_tc("int8", PerChannel(0)),
                                                  input=_tc("int8", PerChannel(0), dynamic=True)),
    "mxfp4_weight_and_input": preset("mxfp4").layer,
    "nvfp4_two_level": preset("nvfp4").layer,
    "fp8_static_output_and_bias": LayerConfig(weight=_tc("float8_e4m3fn", PerTensor()),
                                              output=_tc("float8_e4m3fn", PerTensor()),
                                              bias=_tc("int8", PerTensor())),
}


@pytest.mark.parametrize("cname", sorted(CONFIGS))
def test_quant_conv1d_is_quant_linear_on_the_transposed_weight_bit_for_bit(cname):
    lc = CONFIGS[cname]
    torch.manual_seed(1)
    conv = Conv1D(48, 64)  # nf (out) = 48, nx (in) = 64
    with torch.no_grad():
        conv.bias.normal_()
    lin = nn.Linear(64, 48)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.t())
        lin.bias.copy_(conv.bias)
    x = torch.randn(3, 5, 64)
    wt = lin.weight.detach().clone()  # the wrappers share (and overwrite) the modules' parameters
    qc, ql = wrap(conv, lc, name="c"), wrap(lin, lc, name="l")
    assert type(qc) is QuantConv1D and isinstance(qc, Conv1D) and type(ql) is QuantLinear
    assert list(qc.state_dict()) == list(ql.state_dict())  # the same keys (the original ones + the scales)
    assert qc.weight.shape == (64, 48)  # the parameter keeps Conv1D's [in, out] layout
    for q in (qc, ql):
        if q.static_roles():
            q.start_calibration()
            with torch.no_grad():
                q(x)
            q.finish_calibration()
        q.commit()
    assert same_bits(qc.weight.t(), ql.weight)
    for k, v in ql.state_dict().items():
        if k != "weight":
            assert same_bits(qc.state_dict()[k], v), k  # scales, zero points, bias: Linear layout, same values
    if lc.weight.observer.__class__.__name__ == "MinMax":  # the independent reference: qcore on W^T itself
        spec = ql._qspecs["weight"]
        assert same_bits(ql.weight, qcore.fake_quantize(wt, spec))
    with torch.no_grad():
        yc, yl = qc(x), ql(x)
        assert same_bits(yc, yl)
        qc.freeze(), ql.freeze()
        assert qc.weight_packed.shape == ql.weight_packed.shape  # codes stored in the Linear [out, in] layout
        assert torch.equal(qc.weight_packed, ql.weight_packed)
        assert same_bits(qc(x), yc) and same_bits(ql(x), yl)
    assert "quant=[weight=" in repr(qc) and "nf=48, nx=64" in repr(qc)


def test_quant_conv1d_with_quantization_off_is_the_original_conv1d():
    torch.manual_seed(2)
    conv = Conv1D(24, 16)
    q = wrap(copy.deepcopy(conv), CONFIGS["int8_channel_per_token_dynamic"], name="c")
    q.quant_enabled = False
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        assert same_bits(q(x), conv(x))
        q.quant_enabled = True
        assert not torch.equal(q(x), conv(x))


def test_quant_conv1d_checks_before_any_work():
    conv = Conv1D(24, 16)
    lc = CONFIGS["uint4_group32_asym"]
    with pytest.raises(TypeError, match="QuantConv1D.from_module takes a Conv1D, got Linear"):
        QuantConv1D.from_module(nn.Linear(16, 24), lc)
    bad = LayerConfig(weight=_tc("int8", PerChannel(1)))  # per-channel weight scales are per output feature
    with pytest.raises(ValueError, match=r"Conv1D 'h.c_fc'.*PerChannel\(0\) in the canonical \[out, in"):
        wrap(conv, bad, name="h.c_fc")
    with pytest.raises(ValueError, match=r"Conv1D 'c' \(weight shape \[24, 16\]\).*groups run along the input"):
        wrap(conv, LayerConfig(weight=_tc("int8", PerGroup(8, 0))), name="c")  # shape given as [out, in]
    with torch.no_grad():
        conv.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="Conv1D 'c': the weight holds NaN"):
        wrap(conv, lc, name="c")
    # an importer's parts in Conv1D's own [in, out] layout instead of the Linear one
    good = wrap(Conv1D(24, 16), lc, name="c")
    good.commit()
    from qcore.adapters.io.common import weight_parts
    parts, shape = weight_parts(good)
    assert shape == (24, 16)
    fresh = wrap(Conv1D(24, 16), lc, name="c")
    with pytest.raises(ValueError, match=r"codes of shape \[24, 16\], expected \[16, 24\]"):
        fresh.load_frozen(parts, shape=(16, 24), dtype=torch.float32)
    fresh.load_frozen(parts, shape=shape, dtype=torch.float32)
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert same_bits(fresh(x), good(x))


# ---------------------------------------------------------------------------------------------------------------
# the model: planned like Linears, every preset, calibration, freeze, GPTQ
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_quantizes_every_gpt2_weight(name, gpt2):
    model = copy.deepcopy(gpt2)
    cfg = preset(name)
    assert cfg.layer.weight is not None
    data = batches(2, seed=1) if needs_data(cfg) else None
    quantize_model(model, cfg, data, progress=False)
    assert unquantized_weights(model) == []
    mods = quantized_modules(model)
    assert sorted(mods) == sorted(CONV1D) and all(type(m) is QuantConv1D for m in mods.values())
    assert [w.name for w in excluded_weights(model)] == ["lm_head.weight"]  # tied to wte: float, as by default
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.transformer.wte.weight, gpt2.transformer.wte.weight)
    q, ref = logits(model), logits(gpt2)
    assert torch.isfinite(q).all() and not torch.equal(q, ref)
    assert float((q - ref).norm() / ref.norm()) < 0.5


def test_plan_by_type_by_name_and_exclusions(gpt2):
    int8 = preset("w_int8_per_channel_sym").layer
    plans = plan_model(gpt2, preset("uint4_wo_32").replace(by_type={"Conv1D": int8}))
    assert [p.type for p in plans] == ["Conv1D"] * 8 and all(p.config == int8 for p in plans)
    plans = plan_model(gpt2, preset("uint4_wo_32").replace(by_type={Conv1D: int8}))  # the class itself
    assert all(p.config == int8 for p in plans)
    with pytest.raises(ValueError, match="quantizes no module"):
        plan_model(gpt2, preset("uint4_wo_32").replace(by_type={"Conv1D": None}))
    model = copy.deepcopy(gpt2)
    quantize_model(model, preset("uint4_wo_32").replace(exclude=("lm_head", "*.mlp"),
                                                        by_name={"transformer.h.1.attn.c_proj": None}),
                   progress=False)
    assert sorted(quantized_modules(model)) == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                                                "transformer.h.1.attn.c_attn"]
    assert unquantized_weights(model) == []
    kept = {w.name: w for w in excluded_weights(model)}
    assert set(kept) == {"lm_head.weight", "transformer.h.1.attn.c_proj.weight",
                         *(f"transformer.h.{i}.mlp.{n}.weight" for i in (0, 1) for n in ("c_fc", "c_proj"))}
    assert kept["transformer.h.0.mlp.c_fc.weight"].type == "Conv1D"
    assert kept["transformer.h.0.mlp.c_fc.weight"].why == "excluded by the config"
    assert type(model.transformer.h[0].mlp.c_fc) is Conv1D  # untouched
    # an untied head is quantized with the rest when the exclusion does not name it
    untied = tiny_gpt2(tie=False)
    quantize_model(untied, preset("uint4_wo_32").replace(exclude=()), progress=False)
    assert sorted(quantized_modules(untied)) == sorted(CONV1D + ["lm_head"]) and unquantized_weights(untied) == []


def test_static_calibration_matches_the_linear_twin(gpt2):
    cfg = preset("w_int8_per_channel_a_int8_per_tensor_sym")
    data = batches(3, seed=2)
    model, twin = copy.deepcopy(gpt2), linear_twin(gpt2)
    assert torch.equal(logits(twin), logits(gpt2))
    seen = []
    hook = gpt2.transformer.h[0].attn.c_attn.register_forward_pre_hook(  # its input is float either way
        lambda m, a: seen.append(a[0].reshape(-1, 32)))
    for b in data:
        logits(gpt2, b)
    hook.remove()
    quantize_model(model, cfg, data, progress=False)
    quantize_model(twin, cfg, data, progress=False)
    for name in CONV1D:
        qc, ql = model.get_submodule(name), twin.get_submodule(name)
        assert "input" in qc._calibrated and same_bits(qc.input_scale, ql.input_scale), name
        assert same_bits(qc.weight.t(), ql.weight) and same_bits(qc.weight_scale, ql.weight_scale), name
    # the static input scale is qcore's per-tensor scale of all the calibration inputs (min-max observer)
    c_attn = model.transformer.h[0].attn.c_attn
    want = qcore.quantize(torch.cat(seen), c_attn._qspecs["input"]).scales
    assert same_bits(c_attn.input_scale, want.reshape(()).float())
    q = logits(model)
    assert same_bits(q, logits(twin))
    freeze(model)
    assert same_bits(logits(model), q)


def test_bfloat16_freeze_and_qat(gpt2):
    model = copy.deepcopy(gpt2).to(torch.bfloat16)
    quantize_model(model, preset("w_mxfp4_a_mxfp4"), progress=False)
    q = logits(model)
    assert q.dtype == torch.bfloat16
    freeze(model)
    assert same_bits(logits(model), q)
    rtn = quantize_model(copy.deepcopy(gpt2), preset("uint4_wo_32"), progress=False)
    qat = quantize_model(copy.deepcopy(gpt2), preset("uint4_wo_32"), qat=True, progress=False)
    out = qat(IDS).logits
    assert same_bits(out.detach(), logits(rtn))  # the master weight's fake-quantized value in the forward
    out.sum().backward()
    grad = qat.transformer.h[0].attn.c_attn.weight.grad  # straight through, in Conv1D's [in, out] layout
    assert grad.shape == (32, 96) and float(grad.abs().sum()) > 0


def test_layer_report_measures_conv1d_outputs(gpt2):
    from qcore.adapters.eval.layer_report import measure
    model, twin, reference, ref_twin = copy.deepcopy(gpt2), linear_twin(gpt2), {}, {}
    data = batches(2, seed=6)
    quantize_model(model, preset("uint4_wo_32"), reference=reference, progress=False)
    quantize_model(twin, preset("uint4_wo_32"), reference=ref_twin, progress=False)
    got, want = measure(model, reference, data), measure(twin, ref_twin, data)
    assert set(got) == set(CONV1D)
    for n in CONV1D:  # the same numbers as for the Linear twin, output SQNR included
        assert got[n].output_sqnr_db is not None
        assert got[n].weight_sqnr_db == pytest.approx(want[n].weight_sqnr_db, rel=1e-9)
        assert got[n].output_sqnr_db == pytest.approx(want[n].output_sqnr_db, rel=1e-6)


def test_gptq_runs_on_conv1d_through_the_transposed_weight(gpt2):
    cfg = preset("uint4_wo_32").replace(algorithms=({"name": "gptq"},))
    data = batches(4, seed=3, seq=16)
    model, twin = copy.deepcopy(gpt2), linear_twin(gpt2)
    quantize_model(model, cfg, data, progress=False)
    quantize_model(twin, cfg, data, progress=False)
    rtn = quantize_model(copy.deepcopy(gpt2), preset("uint4_wo_32"), progress=False)
    for name in CONV1D:  # GPTQ's codes, not round-to-nearest's, and the same as on the Linear twin
        qc = model.get_submodule(name)
        assert same_bits(qc.weight.t(), twin.get_submodule(name).weight), name
        assert not torch.equal(qc.weight, rtn.get_submodule(name).weight), name
    assert unquantized_weights(model) == []
    ref = logits(gpt2, data[0])
    err = float((logits(model, data[0]) - ref).norm())
    assert err < float((logits(rtn, data[0]) - ref).norm())  # on calibration data, GPTQ's objective
    q = logits(model)
    freeze(model)
    assert same_bits(logits(model), q)


def test_linear_weight_lets_scale_folding_reach_conv1d(gpt2):
    """What AWQ / SmoothQuant folding needs from a Conv1D reader: ``linear_weight`` is the [out, in] view, so
    multiplying its input columns by s (and dividing the producing norm by s) keeps the function."""
    model = copy.deepcopy(gpt2).double()
    block = model.transformer.h[0]
    ref = logits(model)
    s = torch.rand(32, dtype=torch.float64) + 0.5
    with torch.no_grad():
        block.ln_1.weight.div_(s)
        block.ln_1.bias.div_(s)
        w = linear_weight(block.attn.c_attn)
        assert w.shape == (96, 32) and w.data_ptr() == block.attn.c_attn.weight.data_ptr()
        w.mul_(s[None, :])
    torch.testing.assert_close(logits(model), ref, rtol=1e-9, atol=1e-9)
    assert linear_weight(model.lm_head) is model.lm_head.weight and linear_weight(block.ln_1) is None



def test_weight_layout_says_how_a_linear_like_weight_is_stored(gpt2):
    """``weight_layout``: ``in_out`` for transformers' Conv1D (float, quantized, frozen), ``out_in`` for nn.Linear
    (float, quantized), None for modules that are not Linear-like; what the exporters, imatrix, the layer report and
    AutoRound ask instead of the class name."""
    block = gpt2.transformer.h[0]
    assert (OUT_IN, IN_OUT) == ("out_in", "in_out")
    assert weight_layout(block.attn.c_attn) == IN_OUT and weight_layout(gpt2.lm_head) == OUT_IN
    assert weight_layout(block.ln_1) is None and weight_layout(gpt2.transformer.wte) is None
    assert weight_layout(nn.Conv2d(2, 2, 1)) is None and weight_layout(nn.ConvTranspose2d(2, 2, 1)) is None
    q = wrap(copy.deepcopy(block.attn.c_attn), LayerConfig(weight="int8"), name="c_attn")
    lq = wrap(nn.Linear(8, 4), LayerConfig(weight="int8"), name="fc")
    assert weight_layout(q) == IN_OUT and weight_layout(lq) == OUT_IN
    q.freeze()
    assert weight_layout(q) == IN_OUT and "weight" not in q._parameters

# ---------------------------------------------------------------------------------------------------------------
# AWQ / SmoothQuant / AutoSmoothQuant: the GPT-2 record's groups (ln_1 -> attn.c_attn, ln_2 -> mlp.c_fc), folded
# through linear_weight
# ---------------------------------------------------------------------------------------------------------------

SCALERS = {
    "awq": ("uint4_wo_32", {"name": "awq", "clip": False}),  # no clipping: the folds alone keep the function
    "smoothquant": ("w_int8_a_int8_per_token_dynamic", {"name": "smoothquant"}),
    "autosmoothquant": ("w_int8_a_int8_per_token_dynamic", {"name": "autosmoothquant"}),
}
FOLDED = {f"transformer.h.{i}.{n}" for i in (0, 1)
          for n in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight")}


@pytest.fixture(scope="module")
def gpt2_outliers():
    """The tiny GPT-2 with four outlier channels in each LayerNorm feeding a projection (as trained models have:
    what AWQ and SmoothQuant are for) and non-zero LayerNorm biases (so a fold that forgets the bias shows)."""
    model = tiny_gpt2()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for block in model.transformer.h:
            for ln in (block.ln_1, block.ln_2):
                ln.weight[:4] *= 20
                ln.bias.add_(torch.randn(ln.bias.shape, generator=g) * 0.1)
    return model


def test_gpt2_scaling_groups_come_from_its_record(gpt2):
    from qcore.adapters.passes.scaling import scaling_groups
    for block in gpt2.transformer.h:
        groups = scaling_groups(block, model_type="gpt2")
        assert [(g.prev_op, g.layers) for g in groups] == [("ln_1", ("attn.c_attn",)), ("ln_2", ("mlp.c_fc",))]
        assert scaling_groups(block) == groups  # the structure alone finds the GPT-2 record


@pytest.mark.parametrize("algo", list(SCALERS))
def test_scaling_algorithms_fold_into_gpt2_keeping_the_float_logits(algo, gpt2_outliers):
    """The folds alone (before any quantization): the float64 model computes the same logits, and only the two
    groups' LayerNorms (weight and bias) and Conv1D readers changed."""
    from qcore.adapters.passes.sequential import run_algorithms
    base, entry = SCALERS[algo]
    model = copy.deepcopy(gpt2_outliers).double()
    ref = logits(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    run_algorithms(model, plan_model(model, preset(base)), [entry], batches(4, seed=3, seq=16), progress=False)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    if algo == "autosmoothquant":  # its search may keep the identity for a group
        assert changed and changed <= FOLDED
    else:
        assert changed == FOLDED
    torch.testing.assert_close(logits(model), ref, rtol=1e-9, atol=1e-9)
    assert all(type(model.get_submodule(n)) is Conv1D for n in CONV1D)  # still the float model: nothing quantized


@pytest.mark.parametrize("algo", list(SCALERS))
def test_scaling_algorithms_on_gpt2_equal_the_linear_twin_bit_for_bit(algo, gpt2_outliers):
    """The same algorithm on the model whose Conv1Ds are nn.Linears of W^T (the Linear code path) gives the same
    norms and, bit for bit, the same quantized weights (AWQ with its clipping search, the default)."""
    base, entry = SCALERS[algo]
    cfg = preset(base).replace(algorithms=({"name": algo},))
    data = batches(4, seed=3, seq=16)
    model, twin = copy.deepcopy(gpt2_outliers), linear_twin(gpt2_outliers)
    quantize_model(model, cfg, data, progress=False)
    quantize_model(twin, cfg, data, progress=False)
    assert unquantized_weights(model) == []
    for name in CONV1D:
        assert same_bits(model.get_submodule(name).weight.t(), twin.get_submodule(name).weight), name
    for i in (0, 1):
        for ln in ("ln_1", "ln_2"):
            for p in ("weight", "bias"):
                a, b = (getattr(m.transformer.h[i].get_submodule(ln), p) for m in (model, twin))
                assert torch.equal(a, b), (i, ln, p)
    assert torch.equal(logits(model, data[0]), logits(twin, data[0]))


def test_awq_on_gpt2_beats_round_to_nearest(gpt2_outliers):
    data = batches(4, seed=3, seq=16)
    awq = quantize_model(copy.deepcopy(gpt2_outliers), preset("uint4_wo_32").replace(algorithms=({"name": "awq"},)),
                         data, progress=False)
    rtn = quantize_model(copy.deepcopy(gpt2_outliers), preset("uint4_wo_32"), progress=False)
    ref = logits(gpt2_outliers, data[0])
    err = float((logits(awq, data[0]) - ref).norm())
    assert err < 0.8 * float((logits(rtn, data[0]) - ref).norm())  # on calibration data, AWQ's objective
    for name in ("transformer.h.0.attn.c_attn", "transformer.h.0.mlp.c_fc"):  # scaled, not RTN's codes
        assert not torch.equal(awq.get_submodule(name).weight, rtn.get_submodule(name).weight), name


def test_smoothquant_on_gpt2_equals_an_independent_fold(gpt2_outliers):
    """Layer 0 by hand: max |x| of the Conv1Ds' inputs over the calibration tokens (hooks on the float model),
    max |W| over each input channel of the [in, out] Conv1D weight, s = sqrt(max|x| / max|W|) (alpha 0.5),
    divided into the LayerNorm's weight and bias and multiplied into the Conv1D's input rows; then round-to-nearest.
    SmoothQuant's layer 0 is that, bit for bit."""
    cfg = preset("w_int8_a_int8_per_token_dynamic")
    data = batches(4, seed=3, seq=16)
    block = gpt2_outliers.transformer.h[0]
    amax = {}

    def hook(name):
        def record(mod, args):
            a = args[0].detach().reshape(-1, args[0].shape[-1]).float().abs().amax(0)
            amax[name] = a if name not in amax else torch.maximum(amax[name], a)
        return record

    hooks = [block.attn.c_attn.register_forward_pre_hook(hook("ln_1")),
             block.mlp.c_fc.register_forward_pre_hook(hook("ln_2"))]
    try:
        for ids in data:
            logits(gpt2_outliers, ids)
    finally:
        for h in hooks:
            h.remove()
    hand = copy.deepcopy(gpt2_outliers)
    hb = hand.transformer.h[0]
    with torch.no_grad():
        for ln, conv in ((hb.ln_1, hb.attn.c_attn), (hb.ln_2, hb.mlp.c_fc)):
            a = amax["ln_1" if ln is hb.ln_1 else "ln_2"].double()
            w = conv.weight.detach().abs().amax(1).double()  # [in, out]: max over the outputs of each input
            s = torch.clamp(a ** 0.5 / w ** 0.5, min=1e-5).float().double()
            ln.weight.copy_(ln.weight.double() / s)
            ln.bias.copy_(ln.bias.double() / s)
            conv.weight.copy_(conv.weight.double() * s[:, None])
    quantize_model(hand, cfg, progress=False)
    sq = quantize_model(copy.deepcopy(gpt2_outliers), cfg.replace(algorithms=({"name": "smoothquant"},)), data,
                        progress=False)
    for n in ("ln_1", "ln_2", "attn.c_attn", "mlp.c_fc", "attn.c_proj", "mlp.c_proj"):
        for p in ("weight", "bias"):
            got, want = (getattr(m.transformer.h[0].get_submodule(n), p) for m in (sq, hand))
            assert same_bits(got, want), (n, p)


# ---------------------------------------------------------------------------------------------------------------
# export: export_hf + from_pretrained round trip; the other formats refuse before work
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["uint4_wo_32", "w_int8_per_channel_a_int8_per_tensor_sym", "mxfp4"])
def test_export_hf_and_reload_give_the_same_logits(name, gpt2, tmp_path):
    model = copy.deepcopy(gpt2)
    cfg = preset(name)
    quantize_model(model, cfg, batches(2, seed=1) if needs_data(cfg) else None, progress=False)
    q = logits(model)
    info = export_hf(model, tmp_path / "out")
    # qcore's layout (codes of W^T, [out, in]) under quant_method "qcore": vLLM's GPT-2 loader transposes every
    # c_attn / c_proj / c_fc ".weight" it reads, so Quark's layout would be misread there; "qcore" is refused instead
    assert info.quant_method == "qcore" and set(info.layers) == set(CONV1D)
    assert set(info.layers.values()) == {"qcore"}
    written = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert written["quant_method"] == "qcore"
    from qcore.formats.safetensors_io import SafetensorsFile
    st = SafetensorsFile(tmp_path / "out" / "model.safetensors")
    assert st.entries["transformer.h.0.mlp.c_fc.weight_scale"].shape[0] == 128  # per output feature: [out, ...]
    back = from_pretrained(tmp_path / "out")
    assert type(back.transformer.h[0].attn.c_attn) is QuantConv1D and back.transformer.h[0].attn.c_attn.frozen
    assert same_bits(logits(back), q)
    assert unquantized_weights(back) == []
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    assert same_bits(logits(auto), q)  # "qcore" is registered with transformers by import qcore.adapters
    freeze(model)
    assert same_bits(logits(model), q)
    export_hf(model, tmp_path / "frozen")  # frozen or not: the same bytes
    assert (tmp_path / "frozen" / "model.safetensors").read_bytes() == \
        (tmp_path / "out" / "model.safetensors").read_bytes()


def test_by_type_conv1d_config_round_trips_through_the_checkpoint(gpt2, tmp_path):
    cfg = preset("uint4_wo_32").replace(by_type={"Conv1D": preset("w_int8_per_channel_sym").layer},
                                        by_name={"*.h.1.mlp.c_fc": preset("mxfp4").layer})
    model = quantize_model(copy.deepcopy(gpt2), cfg, progress=False)
    assert model.transformer.h[1].mlp.c_fc._qspecs["weight"].dtype.name == "float4_e2m1fn"
    assert model.transformer.h[0].mlp.c_fc._qspecs["weight"].dtype.name == "int8"
    q = logits(model)
    export_hf(model, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert list(written["layer_type_quant_config"]) == ["Conv1D"]  # Quark's spelling of by_type
    assert ModelConfig.from_quark({**written, "quant_method": "quark"}).by_type == cfg.by_type
    back = from_pretrained(tmp_path / "out")
    assert back.qcore_config.to_dict() == cfg.to_dict() and same_bits(logits(back), q)


def test_quantize_checkpoint_streams_gpt2_to_the_same_bytes(gpt2, tmp_path):
    from qcore.adapters import quantize_checkpoint
    gpt2.save_pretrained(tmp_path / "src")
    cfg = preset("uint4_wo_32").replace(algorithms=({"name": "gptq"},))
    data = batches(2, seed=4, seq=16)
    quantize_checkpoint(tmp_path / "src", tmp_path / "streamed", cfg, data, progress=False)
    whole = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "src").eval()
    quantize_model(whole, cfg, data, progress=False)
    export_hf(whole, tmp_path / "whole")
    assert (tmp_path / "streamed" / "model.safetensors").read_bytes() == \
        (tmp_path / "whole" / "model.safetensors").read_bytes()


def _exporters(tmp_path):
    from qcore.adapters.io.compressed_tensors import check_ct, export_compressed_tensors
    from qcore.adapters.io.gguf import check_gguf, export_gguf
    from qcore.adapters.io.onnx import check_onnx, export_onnx
    ids = IDS[:1]
    return {
        "gguf": (check_gguf, lambda m: export_gguf(m, tmp_path / "m.gguf")),
        "onnx": (lambda m, c=None: check_onnx(m, c, inputs=(ids,)),
                 lambda m: export_onnx(m, tmp_path / "m.onnx", inputs=(ids,))),
        "ct": (check_ct, lambda m: export_compressed_tensors(m, tmp_path / "ct")),
    }


@pytest.mark.parametrize("fmt", ["onnx", "ct"])  # GGUF writes Conv1D as its Linear: test_gguf_gpt2_neox.py
def test_other_exporters_refuse_quantized_conv1d_before_work(fmt, gpt2, tmp_path):
    check, export = _exporters(tmp_path)[fmt]
    cfg = preset("w_int8_per_channel_sym")
    pattern = r"'transformer.h.0.attn.c_attn' \(and 7 more\) is a quantized transformers Conv1D.*docs/adapters.md"
    with pytest.raises(ValueError, match=pattern):  # the float model and the config: before quantizing
        check(gpt2, cfg)
    model = quantize_model(copy.deepcopy(gpt2), cfg, progress=False)
    with pytest.raises(ValueError, match=pattern):
        check(model)
    with pytest.raises(ValueError, match=pattern.replace(r" \(and 7 more\)", r"( \(and 7 more\))?")):
        export(model)
    assert list(tmp_path.iterdir()) == []  # nothing written
    # with the Conv1D modules excluded they are not what refuses
    only_head = preset("w_int8_per_channel_sym").replace(exclude=("re:.*\\.(c_attn|c_proj|c_fc)",))
    untied = tiny_gpt2(tie=False)
    try:
        check(untied, only_head)
    except ValueError as e:
        assert "Conv1D" not in str(e)


def test_fold_scales_on_conv1d_producers_and_readers_and_its_checks(gpt2):
    """A Conv1D producer (its output columns and bias divided) into a Conv1D reader: ``c_fc -> c_proj`` is exact
    once the GELU is a ReLU (given as Quark's scaling_layers entry); wrong sizes and non-Linear readers are refused
    before any change, naming the module and the sizes."""
    from qcore.adapters.passes.scaling import ScalingGroup, fold_scales, scaling_groups
    model = copy.deepcopy(gpt2).double()
    for block in model.transformer.h:
        block.mlp.act = nn.ReLU()
    ref = logits(model)
    g = torch.Generator().manual_seed(4)
    for block in model.transformer.h:
        (grp,) = scaling_groups(block, quark_entries=[{"prev_op": "mlp.c_fc", "layers": ["mlp.c_proj"],
                                                       "inp": "mlp.c_proj"}])
        c_fc_bias = block.mlp.c_fc.bias.detach().clone()
        s = torch.rand(128, generator=g, dtype=torch.float64) * 3 + 0.25
        fold_scales(block, grp, s)
        torch.testing.assert_close(block.mlp.c_fc.bias, c_fc_bias / s, rtol=1e-15, atol=0)
    torch.testing.assert_close(logits(model), ref, rtol=1e-9, atol=1e-9)

    block = model.transformer.h[0]
    before = {n: p.detach().clone() for n, p in block.named_parameters()}
    bad = [
        (ScalingGroup("ln_1", ("attn.c_attn",), "attn.c_attn"), 31, "in_features=32, but s has 31"),
        (ScalingGroup("attn.c_attn", ("attn.c_proj",), "attn.c_proj"), 32, "out_features=96, but s has 32"),
        (ScalingGroup("ln_1", ("attn",), "attn"), 32, "'attn' is a GPT2Attention, not an nn.Linear"),
        (ScalingGroup("mlp.act", ("mlp.c_proj",), "mlp.c_proj"), 128, "'mlp.act' is a ReLU"),
    ]
    for grp, n, msg in bad:
        with pytest.raises(ValueError, match=msg):
            fold_scales(block, grp, torch.ones(n, dtype=torch.float64))
    assert all(torch.equal(p, before[n]) for n, p in block.named_parameters())

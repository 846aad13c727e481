"""Integration tests of qcore.adapters on tiny models: transformers Llama / OPT / Qwen2 / BERT (built offline from
configs, see conftest.py), a small CNN (Conv2d, grouped Conv2d, ConvTranspose2d) and embedding models.

Expected values are computed independently with qcore directly (``qcore.fake_quantize`` on the weight and on the
activation viewed as ``[tokens, features]``, static scales from ``qcore.stats`` over every calibration batch) and
compared bit for bit with the wrapped modules.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import qcore  # noqa: E402
from qcore import PerChannel, PerGroup, PerTensor, ScaleMode  # noqa: E402
from qcore.stats import RunningStats, scale_from_stats  # noqa: E402
from qcore.adapters import (PRESETS, LayerConfig, ModelConfig, QuantConv2d, QuantConvTranspose2d,  # noqa: E402
                            QuantEmbedding, QuantEmbeddingBag, QuantLinear, TensorConfig, calibrate, freeze,
                            model_bytes, preset, quantize_model, quantized_modules, wrap)

EXCLUDED_HEAD = {"llama": {"lm_head"}, "opt": {"lm_head"}, "qwen2": {"lm_head"}, "bert": set()}
FAMILY_PRESETS = ["w_int8_a_int8_per_tensor_sym", "w_mxfp4_a_mxfp4", "uint4_wo_32", "ptpc_fp8"]
MXFP4_EVEN = qcore.make_spec("mxfp4", axis=1, scale_mode=ScaleMode.EVEN)


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of a float tensor, for bit-for-bit comparisons (NaN payloads and -0.0 included)."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    same = _bits(a) == _bits(b)
    assert bool(same.all()), f"{what}: {int((~same).sum())} of {a.numel()} elements differ"


def _preset_kwargs(name: str) -> dict:
    """Group size 32 for the per-group presets that take one (hidden size 64: several groups per row)."""
    grans = [r[1] for r in PRESETS[name].values()]
    return {"group_size": 32} if "group" in grans else {}


def _has_static_activations(cfg: ModelConfig) -> bool:
    return any(tc is not None and tc.calibrated for tc in (cfg.layer.input, cfg.layer.output))


def _error_bound(cfg: ModelConfig) -> float:
    """A generous relative-error bound for the model output from the narrowest element format of the config."""
    bits = min(tc.spec.dtype.bits for tc in (cfg.layer.weight, cfg.layer.input) if tc is not None)
    return {2: 1.0, 4: 0.5, 5: 0.3, 6: 0.3}.get(bits, 0.1)


def _linear_names(model) -> set:
    return {n for n, m in model.named_modules() if type(m) is nn.Linear}


def _rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """[tokens, features] view of a Linear activation (features last) or a conv activation (channels = axis 1)."""
    if x.dim() == 4:
        return x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])
    return x.reshape(-1, x.shape[-1])


def _untokens(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if like.dim() == 4:
        n, c, h, w = like.shape
        return t.reshape(n, h, w, c).permute(0, 3, 1, 2)
    return t.reshape(like.shape)


def _static_scale(inputs: list, spec) -> tuple:
    """(scale, zero_point) of a static per-tensor activation spec from every calibration input, via qcore.stats."""
    p = scale_from_stats(RunningStats.from_array(torch.cat([_tokens(x) for x in inputs]), PerTensor()), spec)
    return p.scale, p.zero_point


def _rtn(w, tc):
    """``qcore.fake_quantize`` of a float weight with the scales of its observer (the searched-scale presets)."""
    kw = {}
    if tc.observer.to_dict()["kind"] == "four_over_six":
        kw = qcore.stats.four_over_six(w, tc.spec).kwargs()
    elif tc.observer.to_dict()["kind"] == "exponent_search":
        kw = qcore.stats.exponent_search(w, tc.spec, radius=tc.observer.radius).kwargs()
    return qcore.fake_quantize(w, tc.spec, **kw)


def _check_family(model, ref_model, cfg, family, ids):
    """Quantized-model checks shared by the preset tests; returns the quantized output."""
    q = quantized_modules(model)
    assert set(q) == _linear_names(ref_model) - EXCLUDED_HEAD[family]
    assert all(type(m) is QuantLinear for m in q.values())
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n in EXCLUDED_HEAD[family])
    # weights: qcore.fake_quantize of the float weight, bit for bit; everything not quantized is unchanged
    ref_params = dict(ref_model.named_parameters(remove_duplicate=False))
    for n, p in model.named_parameters(remove_duplicate=False):
        mod = n.rpartition(".")[0]
        if mod in q and n.endswith(".weight"):
            want = _rtn(ref_params[n].detach().float(), cfg.layer.weight).to(p.dtype)
            assert_bits_equal(p.detach(), want, n)
        else:
            assert_bits_equal(p.detach(), ref_params[n].detach(), n)
    out = _out(model, ids)
    ref = _out(ref_model, ids)
    assert out.dtype == ref.dtype and bool(torch.isfinite(out).all())
    err = _rel_err(out, ref)
    assert 1e-6 < err < _error_bound(cfg), err
    return out


def _out(model, ids):
    with torch.no_grad():
        o = model(ids)
    return o.logits if getattr(o, "logits", None) is not None else o.last_hidden_state


def _check_freeze(model, ids, out, float_bytes):
    cfg_bits = {n: m.qconfig.weight.spec.dtype.bits for n, m in quantized_modules(model).items()}
    freeze(model)
    for n, m in quantized_modules(model).items():
        assert m.frozen and "weight" not in dict(m.named_parameters(recurse=False)), n
        # packed low-bit codes: bits per element, rows of 64 or 128 elements pack without padding
        assert m.weight_packed.dtype == torch.uint8
        assert m.weight_packed.numel() * 8 == m.out_features * m.in_features * cfg_bits[n], n
    assert_bits_equal(_out(model, ids), out, "output after freeze")
    if max(cfg_bits.values()) <= 8:
        assert model_bytes(model) < float_bytes


# ---------------------------------------------------------------------------------------------------------------
# every preset on the tiny Llama, a subset on OPT / Qwen2 / BERT
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_on_tiny_llama(name, family_model, zoo):
    base = family_model("llama")
    cfg = preset(name, **_preset_kwargs(name))
    model = copy.deepcopy(base)
    data = zoo.token_batches(2, seed=1) if _has_static_activations(cfg) else None
    quantize_model(model, cfg, data, progress=False)
    ids = zoo.token_batches(1, seed=5)[0]
    out = _check_family(model, base, cfg, "llama", ids)
    for m in quantized_modules(model).values():
        for role in ("input", "output"):
            tc = getattr(cfg.layer, role)
            two_level = tc is not None and tc.spec.two_level
            has = hasattr(m, f"{role}_{'tensor_scale' if two_level else 'scale'}")
            assert has == (tc is not None and tc.calibrated), (m.qname, role)
            if has:
                s = getattr(m, f"{role}_{'tensor_scale' if two_level else 'scale'}")
                assert s.shape == () and bool(torch.isfinite(s)) and float(s) > 0
    _check_freeze(model, ids, out, model_bytes(base))


@pytest.mark.parametrize("family", ["opt", "qwen2", "bert"])
@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_preset_subset_on_other_families(family, name, family_model, zoo):
    base = family_model(family)
    cfg = preset(name)
    model = copy.deepcopy(base)
    data = zoo.token_batches(2, seed=1) if _has_static_activations(cfg) else None
    quantize_model(model, cfg, data, progress=False)
    ids = zoo.token_batches(1, seed=5)[0]
    out = _check_family(model, base, cfg, family, ids)
    _check_freeze(model, ids, out, model_bytes(base))


def test_opt_tied_head_stays_tied_and_float(family_model, zoo):
    model = copy.deepcopy(family_model("opt"))
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    quantize_model(model, preset("w_int8_per_channel_sym"), progress=False)
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    assert_bits_equal(model.lm_head.weight.detach(), family_model("opt").lm_head.weight.detach())


def test_opt_tied_head_and_embedding_quantized_once(family_model, zoo):
    """Tied lm_head / embed_tokens with the same config: the shared table is fake-quantized once (quantizing it
    again is not idempotent for int8), stays put across forwards and survives a state_dict round trip."""
    base = family_model("opt")
    cfg = ModelConfig(LayerConfig(weight=INT8_CH), by_type={"Embedding": LayerConfig(weight=INT8_CH)}, exclude=[])
    model = quantize_model(copy.deepcopy(base), cfg, progress=False)
    head, emb = model.lm_head, model.model.decoder.embed_tokens
    assert type(head) is QuantLinear and type(emb) is QuantEmbedding and head.weight is emb.weight
    w0 = base.lm_head.weight.detach()
    want = qcore.fake_quantize(w0, INT8_CH)
    assert_bits_equal(head.weight.detach(), want, "tied table")
    scales = qcore.quantize(w0, INT8_CH).scales
    assert_bits_equal(head.weight_scale, scales, "lm_head.weight_scale")
    assert_bits_equal(emb.weight_scale, scales, "embed_tokens.weight_scale")
    ids = zoo.token_batches(1, seed=5)[0]
    out = _out(model, ids)
    ver = head.weight._version
    assert_bits_equal(_out(model, ids), out, "second forward")
    assert head.weight._version == ver  # not re-quantized by either module
    assert_bits_equal(head.weight.detach(), want, "tied table after forwards")
    other = quantize_model(zoo.tiny_opt(seed=1), cfg, progress=False)
    other.load_state_dict(model.state_dict())
    assert_bits_equal(_out(other, ids), out, "after load_state_dict")


# ---------------------------------------------------------------------------------------------------------------
# one Linear against an independent reference
# ---------------------------------------------------------------------------------------------------------------

INT8_CH = qcore.make_spec("int8", granularity=PerChannel(0))
LINEAR_SCHEMES = {
    "int8_channel_w_int8_static_a": LayerConfig(weight=INT8_CH, input=TensorConfig(qcore.make_spec("int8"))),
    "mxfp4_w_a_dynamic": LayerConfig(weight=MXFP4_EVEN, input=TensorConfig(MXFP4_EVEN, dynamic=True)),
    "uint4_group_asym_w": LayerConfig(weight=qcore.make_spec("uint4", granularity=PerGroup(32, axis=1))),
    "fp8_w_per_token_a": LayerConfig(weight="float8_e4m3fn",
                                     input=TensorConfig(qcore.make_spec("float8_e4m3fn", axis=0), dynamic=True)),
}


def _calibration_inputs(seed: int) -> list:
    """Three [2, 5, 64] batches; the middle one holds the largest |x|, so neither the first nor the last batch
    alone gives the static scale."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, 5, 64, generator=g) for _ in range(3)]
    xs[1] = xs[1] * 4
    return xs


@pytest.mark.parametrize("scheme", list(LINEAR_SCHEMES))
def test_linear_matches_independent_reference(scheme):
    lc = LINEAR_SCHEMES[scheme]
    torch.manual_seed(3)
    lin = nn.Linear(64, 48)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    model = nn.Sequential(copy.deepcopy(lin))
    calib = _calibration_inputs(11)
    static = lc.input is not None and not lc.input.dynamic
    quantize_model(model, ModelConfig(lc), calib if static else None, progress=False)
    x = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(12)) * 2

    wq = qcore.fake_quantize(w, lc.weight.spec)
    if lc.input is None:
        xq = x
    elif static:
        scale, zp = _static_scale(calib, lc.input.spec)
        assert zp is None
        assert_bits_equal(model[0].input_scale, scale.reshape(()), "input_scale")
        last_only, _ = _static_scale(calib[-1:], lc.input.spec)
        assert not torch.equal(last_only, scale)  # the scale saw every batch
        xq = qcore.fake_quantize(_tokens(x), lc.input.spec, scale=scale).reshape(x.shape)
    else:
        xq = qcore.fake_quantize(_tokens(x), lc.input.spec).reshape(x.shape)
    assert not torch.equal(wq, w)
    want = F.linear(xq, wq, b)
    with torch.no_grad():
        got = model(x)
    assert_bits_equal(got, want, scheme)
    assert_bits_equal(model[0].weight.detach(), wq, "weight")
    ref_q = qcore.quantize(w, lc.weight.spec)
    assert_bits_equal(model[0].weight_scale, ref_q.scales.float(), "weight_scale")
    if not lc.weight.spec.symmetric:
        assert_bits_equal(model[0].weight_zero_point, ref_q.zero_points.float(), "weight_zero_point")


# ---------------------------------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["w_int8_a_int8_per_tensor_sym", "w_mxfp4_a_mxfp4", "uint4_wo_32"])
def test_model_dtype_is_kept(dtype, name, family_model, zoo):
    base = copy.deepcopy(family_model("llama")).to(dtype)
    model = copy.deepcopy(base)
    cfg = preset(name)
    quantize_model(model, cfg, zoo.token_batches(2, seed=1) if _has_static_activations(cfg) else None,
                   progress=False)
    assert {p.dtype for p in model.parameters()} == {dtype}
    # _check_family compares each quantized weight with fake_quantize(w.float(), spec).to(dtype), bit for bit
    ids = zoo.token_batches(1, seed=5)[0]
    out = _check_family(model, base, cfg, "llama", ids)
    assert out.dtype == dtype
    lin = model.model.layers[0].mlp.down_proj
    x = torch.randn(2, 3, lin.in_features).to(dtype)
    with torch.no_grad():
        y = lin(x)
    assert y.dtype == dtype


# ---------------------------------------------------------------------------------------------------------------
# wrappers that quantize nothing are the original module
# ---------------------------------------------------------------------------------------------------------------


def test_empty_layer_config_is_bit_identical(zoo):
    torch.manual_seed(0)
    cnn = zoo.small_cnn()
    x = zoo.image_batches(1, seed=2)[0]
    lin = nn.Linear(64, 48)
    xl = torch.randn(2, 5, 64)
    emb, bag = nn.Embedding(100, 32), nn.EmbeddingBag(100, 32, mode="sum")
    ids, offsets = zoo.bag_inputs(3)
    cases = [(lin, (xl,)), (cnn.conv1, (x,)), (cnn.conv2, (torch.relu(cnn.conv1(x)),)),
             (cnn.up, (torch.randn(2, 32, 4, 4),)), (emb, (ids.reshape(4, 5),)), (bag, (ids, offsets))]
    with torch.no_grad():
        for mod, args in cases:
            for qat in (False, True):
                q = wrap(mod, LayerConfig(), qat=qat)
                assert type(q) is not type(mod) and isinstance(q, type(mod))
                assert_bits_equal(q(*args), mod(*args), type(mod).__name__)
                assert q.state_dict().keys() == mod.state_dict().keys()


def test_qat_model_with_quantization_disabled_is_the_float_model(family_model, zoo):
    base = family_model("llama")
    model = copy.deepcopy(base)
    quantize_model(model, preset("fp8"), zoo.token_batches(2, seed=1), qat=True, progress=False)
    ids = zoo.token_batches(1, seed=5)[0]
    quantized = _out(model, ids)
    for m in quantized_modules(model).values():
        m.quant_enabled = False
    assert_bits_equal(_out(model, ids), _out(base, ids), "quant_enabled=False")
    for m in quantized_modules(model).values():
        m.quant_enabled = True
    assert_bits_equal(_out(model, ids), quantized, "quant_enabled=True again")
    assert not torch.equal(quantized, _out(base, ids))


# ---------------------------------------------------------------------------------------------------------------
# state_dict
# ---------------------------------------------------------------------------------------------------------------

W4A8_ASYM = ModelConfig(LayerConfig(weight=qcore.make_spec("uint4", granularity=PerGroup(32, axis=1)),
                                    input=TensorConfig(qcore.make_spec("uint8"))))


def test_state_dict_keys_are_float_keys_plus_scales(family_model, zoo):
    base = family_model("llama")
    model = quantize_model(copy.deepcopy(base), W4A8_ASYM, zoo.token_batches(2, seed=1), progress=False)
    extra = {f"{n}.{role}_{part}" for n in quantized_modules(model) for role in ("weight", "input")
             for part in ("scale", "zero_point")}
    assert model.state_dict().keys() == base.state_dict().keys() | extra
    assert not (base.state_dict().keys() & extra)


@pytest.mark.parametrize("name", ["w4a8_asym", "w_int8_a_int8_per_tensor_sym", "nvfp4", "w_mx9_a_mx9"])
def test_state_dict_round_trip_into_a_fresh_quantized_copy(name, family_model, zoo):
    # int8/uint4 re-quantized from their own statistics are not idempotent (absmax 127.5 * s -> 127 * s):
    # a loaded fake-quantized weight must be kept as saved, not quantized a second time
    cfg = W4A8_ASYM if name == "w4a8_asym" else preset(name)
    a = quantize_model(copy.deepcopy(family_model("llama")), cfg, zoo.token_batches(2, seed=1), progress=False)
    b = quantize_model(zoo.tiny_llama(seed=1), cfg, zoo.token_batches(2, seed=2), progress=False)
    ids = zoo.token_batches(1, seed=5)[0]
    want = _out(a, ids)
    assert not torch.equal(_out(b, ids), want)
    b.load_state_dict(a.state_dict())
    assert_bits_equal(_out(b, ids), want, "after load_state_dict")
    for k, v in a.state_dict().items():
        assert_bits_equal(b.state_dict()[k], v, k)


def test_float_weights_with_stale_scales_are_quantized_again():
    spec = qcore.make_spec("int8", granularity=PerChannel(0))
    torch.manual_seed(0)
    model = quantize_model(nn.Sequential(nn.Linear(64, 48)), ModelConfig(LayerConfig(weight=spec)), progress=False)
    torch.manual_seed(7)
    new = nn.Linear(64, 48)
    stale = {k: v.clone() for k, v in model.state_dict().items()}
    stale["0.weight"], stale["0.bias"] = new.weight.detach(), new.bias.detach()
    model.load_state_dict(stale)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        got = model(x)
    assert_bits_equal(got, F.linear(x, qcore.fake_quantize(new.weight.detach(), spec), new.bias.detach()), "output")
    assert_bits_equal(model[0].weight_scale, qcore.quantize(new.weight.detach(), spec).scales, "fresh scales")


def test_loading_new_float_weights_requantizes_them():
    spec = qcore.make_spec("uint4", granularity=PerGroup(32, axis=1))
    torch.manual_seed(0)
    model = quantize_model(nn.Sequential(nn.Linear(64, 48)), ModelConfig(LayerConfig(weight=spec)), progress=False)
    torch.manual_seed(7)
    new = nn.Linear(64, 48)
    res = model.load_state_dict({"0.weight": new.weight.detach(), "0.bias": new.bias.detach()}, strict=False)
    assert sorted(res.missing_keys) == ["0.weight_scale", "0.weight_zero_point"] and not res.unexpected_keys
    x = torch.randn(2, 5, 64)
    want = F.linear(x, qcore.fake_quantize(new.weight.detach(), spec), new.bias.detach())
    with torch.no_grad():
        assert_bits_equal(model(x), want, "first forward after load")
        ver = model[0].weight._version
        assert_bits_equal(model(x), want, "second forward")
    assert model[0].weight._version == ver  # quantized once, not on every forward
    q = qcore.quantize(new.weight.detach(), spec)
    assert_bits_equal(model[0].weight_scale, q.scales, "weight_scale of the new weight")
    assert_bits_equal(model[0].weight_zero_point, q.zero_points.float(), "weight_zero_point of the new weight")
    # any other in-place write is tracked the same way
    with torch.no_grad():
        model[0].weight.mul_(3)
        w3 = model[0].weight.detach().clone()
        assert_bits_equal(model(x), F.linear(x, qcore.fake_quantize(w3, spec), new.bias.detach()), "after mul_")


# ---------------------------------------------------------------------------------------------------------------
# quantization-aware training
# ---------------------------------------------------------------------------------------------------------------


def test_qat_straight_through_gradients_reach_float_weights():
    lc = LayerConfig(weight=INT8_CH, input=TensorConfig(MXFP4_EVEN, dynamic=True))
    torch.manual_seed(4)
    lin = nn.Linear(64, 48)
    w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
    model = quantize_model(nn.Sequential(lin), ModelConfig(lc), qat=True, progress=False)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 64, generator=g).requires_grad_()
    upstream = torch.randn(2, 5, 48, generator=g)
    y = model(x)
    (y * upstream).sum().backward()

    wq = qcore.fake_quantize(w0, INT8_CH).requires_grad_()
    br = b0.clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    xq = qcore.fake_quantize(xr.reshape(-1, 64), MXFP4_EVEN).reshape(xr.shape)
    yr = F.linear(xq, wq, br)
    (yr * upstream).sum().backward()

    qlin = model[0]
    assert_bits_equal(y.detach(), yr.detach(), "forward")
    assert_bits_equal(qlin.weight.grad, wq.grad, "weight grad")
    assert_bits_equal(qlin.bias.grad, br.grad, "bias grad")
    assert_bits_equal(x.grad, xr.grad, "input grad")
    assert bool(qlin.weight.grad.abs().sum() > 0)
    # the master weights stay float (not written with their fake-quantized values)
    assert isinstance(qlin.weight, nn.Parameter) and qlin.weight.requires_grad
    assert_bits_equal(qlin.weight.detach(), w0, "master weight")
    assert not torch.equal(wq.detach(), w0)
    # an optimizer step changes the master weights; the next forward quantizes the new ones
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    w1 = qlin.weight.detach().clone()
    assert not torch.equal(w1, w0)
    with torch.no_grad():
        xe = torch.randn(3, 64, generator=g)
        want = F.linear(qcore.fake_quantize(xe, MXFP4_EVEN), qcore.fake_quantize(w1, INT8_CH), qlin.bias)
        assert_bits_equal(model(xe), want, "forward after the step")
    freeze(model)
    with torch.no_grad():
        assert_bits_equal(model(xe), want, "after freeze")


def test_freeze_right_after_qat_training():
    torch.manual_seed(4)
    model = quantize_model(nn.Sequential(nn.Linear(64, 48)), ModelConfig(LayerConfig(weight=INT8_CH)), qat=True,
                           progress=False)
    x = torch.randn(5, 64)
    model(x).square().sum().backward()  # grad-mode forwards only: no scales cached yet
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    w1, b1 = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    freeze(model)
    assert model[0].frozen and model[0].weight_scale.shape == (48, 1)
    with torch.no_grad():
        assert_bits_equal(model(x), F.linear(x, qcore.fake_quantize(w1, INT8_CH), b1), "after freeze")


def test_qat_on_tiny_llama_trains_the_float_weights(family_model, zoo):
    base = family_model("llama")
    model = copy.deepcopy(base).train()
    quantize_model(model, preset("w_int4_per_group_sym", group_size=32), qat=True, progress=False)
    ids = zoo.token_batches(1, seed=5)[0]
    loss = model(ids, labels=ids).loss
    loss.backward()
    ref = dict(base.named_parameters())
    for n, m in quantized_modules(model).items():
        assert m.weight.dtype == torch.float32 and m.weight.grad is not None, n
        assert bool(torch.isfinite(m.weight.grad).all()) and bool(m.weight.grad.abs().sum() > 0), n
        assert_bits_equal(m.weight.detach(), ref[f"{n}.weight"].detach(), n)


# ---------------------------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------------------------


def test_kv_cache_scales_on_k_and_v_projections(family_model, zoo):
    model = copy.deepcopy(family_model("llama"))
    cfg = preset("w_int8_per_channel_sym", kv_cache="fp8")
    quantize_model(model, cfg, zoo.token_batches(2, seed=1), progress=False)
    qm = quantized_modules(model)
    kv = {n for n in qm if n.endswith(("k_proj", "v_proj"))}
    assert len(kv) == 4
    assert {n for n, m in qm.items() if hasattr(m, "output_scale")} == kv
    sd = model.state_dict()
    for n in kv:
        s = qm[n].output_scale
        assert s.shape == () and s.dtype == torch.float32 and bool(torch.isfinite(s)) and float(s) > 0, n
        assert f"{n}.output_scale" in sd and f"{n}.output_zero_point" not in sd
        assert not hasattr(qm[n], "input_scale")

    # recalibrate with other batches: each scale is the fp8 per-tensor scale of its module's outputs over all
    # batches, and the forward afterwards puts k and v on that fp8 grid
    fp8 = qcore.make_spec("float8_e4m3fn")
    seen: dict = {n: [] for n in kv}
    hooks = [qm[n].register_forward_hook(lambda mod, a, out, n=n: seen[n].append(out.detach().clone()))
             for n in kv]
    calibrate(model, zoo.token_batches(3, seed=8), progress=False)
    for n in kv:
        scale, _ = _static_scale(seen[n], fp8)
        assert_bits_equal(qm[n].output_scale, scale.reshape(()), n)
        seen[n].clear()
    model(zoo.token_batches(1, seed=5)[0])
    for h in hooks:
        h.remove()
    for n in kv:
        out = seen[n][0]
        assert_bits_equal(qcore.fake_quantize(out, fp8, scale=qm[n].output_scale), out, f"{n} output on the grid")


# ---------------------------------------------------------------------------------------------------------------
# the CNN
# ---------------------------------------------------------------------------------------------------------------


def _convt_per_out_channel(w: torch.Tensor, groups: int, fn):
    """Apply ``fn`` to each output channel's slice of a ConvTranspose2d weight [in, out/groups, kh, kw]:
    output channel o = gi * (out/groups) + j uses weight[gi*in/groups:(gi+1)*in/groups, j]."""
    in_g = w.shape[0] // groups
    outs = []
    for gi in range(groups):
        for j in range(w.shape[1]):
            outs.append(fn(w[gi * in_g:(gi + 1) * in_g, j]))
    return outs


def _cnn_reference(cnn, x, weights, acts):
    """The SmallCNN forward with given weights and per-layer activation functions."""
    (w1, w2, w3), (a1, a2, a3) = weights, acts
    h = torch.relu(F.conv2d(a1(x), w1, cnn.conv1.bias, padding=1))
    h = torch.relu(F.conv2d(a2(h), w2, cnn.conv2.bias, padding=1, groups=4))
    return F.conv_transpose2d(a3(h), w3, cnn.up.bias, stride=2, padding=1)


def _mxfp4_acts(x):
    return _untokens(qcore.fake_quantize(_tokens(x), MXFP4_EVEN), x)


@pytest.mark.parametrize("scheme", ["int8_channel_w_int8_static_a", "mxfp4_w_a_dynamic"])
def test_cnn_matches_independent_reference(scheme, zoo):
    cnn = zoo.small_cnn()
    w1, w2, w3 = (cnn.conv1.weight.detach(), cnn.conv2.weight.detach(), cnn.up.weight.detach())
    calib = zoo.image_batches(3, seed=1)
    x = zoo.image_batches(1, seed=2)[0]
    if scheme == "int8_channel_w_int8_static_a":
        cfg = ModelConfig(LINEAR_SCHEMES[scheme])
        act = qcore.make_spec("int8")
        fq = [qcore.fake_quantize(w1, INT8_CH), qcore.fake_quantize(w2, INT8_CH)]
        cols = _convt_per_out_channel(w3, 1, lambda s: qcore.fake_quantize(s, qcore.make_spec("int8")))
        fq.append(torch.stack(cols, dim=1))
        # calibration runs with fake-quantized weights and float activations; collect each layer's inputs
        seen: list = [[], [], []]

        def record(i):
            return lambda t: (seen[i].append(t), t)[1]

        with torch.no_grad():
            for b in calib:
                _cnn_reference(cnn, b, fq, [record(0), record(1), record(2)])
        scales = [_static_scale(s, act)[0] for s in seen]
        acts = [lambda t, s=s: qcore.fake_quantize(t, act, scale=s) for s in scales]
    else:
        cfg = preset("w_mxfp4_a_mxfp4")
        assert cfg.layer.weight.spec == MXFP4_EVEN and cfg.layer.input.spec == MXFP4_EVEN
        # blocks of 32 along the input channels, per output channel and kernel position
        last = qcore.make_spec(MXFP4_EVEN, axis=-1)
        fq = [qcore.fake_quantize(w.permute(0, 2, 3, 1), last).permute(0, 3, 1, 2) for w in (w1, w2)]
        fq.append(qcore.fake_quantize(w3.permute(1, 2, 3, 0), last).permute(3, 0, 1, 2))  # [in, out, ..]: out first
        acts = [_mxfp4_acts] * 3
        scales = None
    model = quantize_model(copy.deepcopy(cnn), cfg, calib, progress=False)
    qm = quantized_modules(model)
    assert {n: type(m) for n, m in qm.items()} == {"conv1": QuantConv2d, "conv2": QuantConv2d,
                                                 "up": QuantConvTranspose2d}
    for n, want in zip(("conv1", "conv2", "up"), fq):
        assert_bits_equal(qm[n].weight.detach(), want, f"{n}.weight")
    if scales is not None:
        for n, s in zip(("conv1", "conv2", "up"), scales):
            assert_bits_equal(qm[n].input_scale, s.reshape(()), f"{n}.input_scale")
    with torch.no_grad():
        want = _cnn_reference(cnn, x, fq, acts)
        got = model(x)
        assert_bits_equal(got, want, scheme)
        assert 1e-6 < _rel_err(got, cnn(x)) < 0.5
        freeze(model)
        assert_bits_equal(model(x), want, "after freeze")


@pytest.mark.parametrize("groups", [1, 2])
def test_conv_transpose_per_channel_means_per_output_channel(groups):
    torch.manual_seed(6)
    ct = nn.ConvTranspose2d(8, 12, 3, groups=groups, bias=False)
    w = ct.weight.detach().clone()
    assert w.shape == (8, 12 // groups, 3, 3)
    model = quantize_model(nn.Sequential(ct), ModelConfig(LayerConfig(weight=INT8_CH)), progress=False)
    q = model[0]
    per_tensor = qcore.make_spec("int8")
    want_scales = _convt_per_out_channel(w, groups, lambda s: qcore.quantize(s, per_tensor).scales.reshape(()))
    assert q.weight_scale.numel() == 12
    assert_bits_equal(q.weight_scale.reshape(-1), torch.stack(want_scales), "weight_scale")
    # the fake-quantized weight: each output channel's slice quantized on its own
    want = w.clone()
    in_g = 8 // groups
    for gi in range(groups):
        for j in range(12 // groups):
            sl = w[gi * in_g:(gi + 1) * in_g, j]
            want[gi * in_g:(gi + 1) * in_g, j] = qcore.fake_quantize(sl, per_tensor)
    assert_bits_equal(q.weight.detach(), want, "weight")
    x = torch.randn(2, 8, 5, 5)
    with torch.no_grad():
        y = model(x)
        assert_bits_equal(y, F.conv_transpose2d(x, want, groups=groups), "output")
        freeze(model)
        assert_bits_equal(model(x), y, "after freeze")


# ---------------------------------------------------------------------------------------------------------------
# embeddings
# ---------------------------------------------------------------------------------------------------------------


def test_embedding_bag_table_quantized_by_type(zoo):
    spec = INT8_CH  # one scale per row of the table
    base = zoo.bag_model()
    model = quantize_model(copy.deepcopy(base), ModelConfig(by_type={"EmbeddingBag": LayerConfig(weight=spec)}),
                           progress=False)
    qm = quantized_modules(model)
    assert {n: type(m) for n, m in qm.items()} == {"bag": QuantEmbeddingBag}  # the empty global layer: Linear float
    table = qcore.fake_quantize(base.bag.weight.detach(), spec)
    assert_bits_equal(model.bag.weight.detach(), table, "table")
    assert model.bag.weight_scale.shape == (100, 1)
    idx, offsets = zoo.bag_inputs(4)
    with torch.no_grad():
        want = base.head(F.embedding_bag(idx, table, offsets, mode="mean"))
        got = model(idx, offsets)
        assert_bits_equal(got, want, "output")
        assert not torch.equal(got, base(idx, offsets))
        freeze(model)
        assert_bits_equal(model(idx, offsets), want, "after freeze")
    assert model.bag.weight_packed.numel() == 100 * 32


def test_embedding_table_quantized_by_type_and_linear_by_layer(zoo):
    emb_spec = qcore.make_spec("uint4", granularity=PerGroup(16, axis=1))
    base = zoo.emb_model()
    cfg = ModelConfig(LayerConfig(weight=INT8_CH), by_type={"Embedding": LayerConfig(weight=emb_spec)})
    model = quantize_model(copy.deepcopy(base), cfg, progress=False)
    assert {n: type(m) for n, m in quantized_modules(model).items()} == {"emb": QuantEmbedding, "head": QuantLinear}
    table = qcore.fake_quantize(base.emb.weight.detach(), emb_spec)
    assert_bits_equal(model.emb.weight.detach(), table, "table")
    assert model.emb.weight_scale.shape == (100, 2) and model.emb.weight_zero_point.shape == (100, 2)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = F.linear(F.embedding(ids, table), qcore.fake_quantize(base.head.weight.detach(), INT8_CH),
                        base.head.bias)
        assert_bits_equal(model(ids), want, "output")
    # without by_type the global layer config leaves embeddings alone
    only_linear = quantize_model(copy.deepcopy(base), ModelConfig(LayerConfig(weight=INT8_CH)), progress=False)
    assert set(quantized_modules(only_linear)) == {"head"}
    assert_bits_equal(only_linear.emb.weight.detach(), base.emb.weight.detach(), "embedding left float")


@pytest.mark.parametrize("kind", ["Embedding", "EmbeddingBag"])
def test_input_role_on_an_embedding_is_refused(kind, zoo):
    base = zoo.emb_model() if kind == "Embedding" else zoo.bag_model()
    model = copy.deepcopy(base)
    lc = LayerConfig(weight=INT8_CH, input=TensorConfig(qcore.make_spec("int8"), dynamic=True))
    with pytest.raises(ValueError, match="indices"):
        quantize_model(model, ModelConfig(by_type={kind: lc}), progress=False)
    assert not quantized_modules(model)
    for (n, p), (_, p0) in zip(model.named_parameters(), base.named_parameters()):
        assert_bits_equal(p.detach(), p0.detach(), n)

"""The public read API of quantized modules (``QuantModule``: specs, float_type, weight_shape, weight_dtype,
effective, scales, is_calibrated, static_scale_shape, observers, fake_quantize_activation, load_static_scales,
load_bias) on every wrapper type, before and after commit and freeze; and a source check that nothing under
src/qcore/adapters/ but the modules/ package reads a quantized module's private state."""

import pathlib
import re

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qcore  # noqa: E402
from qcore import PerGroup  # noqa: E402
from qcore.adapters import LayerConfig, TensorConfig  # noqa: E402
from qcore.adapters.modules import QuantExperts, QuantModule, StoredScales, wrap  # noqa: E402

ADAPTERS = pathlib.Path(qcore.adapters.__file__).resolve().parent

INT8_CH = qcore.make_spec("int8", axis=0)
UINT4_G8 = qcore.make_spec("uint4", granularity=PerGroup(8, 1), symmetric=False)


def _cases():
    """(name, float module, config, canonical weight shape, an input)."""
    torch.manual_seed(0)
    idx = torch.tensor([[1, 5, 7, 2], [0, 3, 3, 9]])
    return [
        ("linear", nn.Linear(16, 6), LayerConfig(weight=UINT4_G8, bias="int8"), (6, 16), torch.randn(3, 16)),
        ("conv2d", nn.Conv2d(4, 6, 3, groups=2), LayerConfig(weight=INT8_CH), (6, 2, 3, 3), torch.randn(1, 4, 6, 6)),
        ("convt", nn.ConvTranspose2d(4, 6, 3), LayerConfig(weight=INT8_CH), (6, 4, 3, 3), torch.randn(1, 4, 5, 5)),
        ("convt_g2", nn.ConvTranspose2d(4, 6, 3, groups=2), LayerConfig(weight=INT8_CH), (6, 2, 3, 3),
         torch.randn(1, 4, 5, 5)),
        ("embedding", nn.Embedding(10, 16), LayerConfig(weight=UINT4_G8), (10, 16), idx),
        ("embedding_bag", nn.EmbeddingBag(10, 16), LayerConfig(weight=INT8_CH), (10, 16), idx),
    ]


CASES = _cases()


def _forward_with(q, x, w, b):
    """The float type's forward with the weight and bias the accessors give (no activation quantization here)."""
    if isinstance(q, nn.Linear):
        return F.linear(x, w, b)
    if isinstance(q, nn.ConvTranspose2d):
        return F.conv_transpose2d(x, w, b, q.stride, q.padding, q.output_padding, q.groups, q.dilation)
    if isinstance(q, nn.Conv2d):
        return F.conv2d(x, w, b, q.stride, q.padding, q.dilation, q.groups)
    if isinstance(q, nn.EmbeddingBag):
        return F.embedding_bag(x, w, mode=q.mode)
    return F.embedding(x, w)


@pytest.mark.parametrize("name,fm,config,shape,x", CASES, ids=[c[0] for c in CASES])
def test_accessors_through_commit_and_freeze(name, fm, config, shape, x):
    q = wrap(fm, config, name=name)
    assert q.float_type is type(fm) and isinstance(q, q.float_type)
    assert set(q.specs) == {r for r in ("weight", "bias") if getattr(config, r) is not None}
    assert q.specs["weight"].dtype == config.weight.spec.dtype
    with pytest.raises(TypeError):
        q.specs["weight"] = INT8_CH  # read-only
    assert q.weight_shape == shape and q.weight_dtype == torch.float32
    assert q.observers is None

    pending = q.effective("weight")  # pending: the fake-quantized weight, the float parameter untouched
    assert tuple(pending.shape) == tuple(fm.weight.shape) and not pending.requires_grad
    assert torch.equal(q.weight, fm.weight) and not torch.equal(pending, fm.weight)
    assert tuple(q.effective("weight", canonical=True).shape) == shape
    torch.testing.assert_close(_forward_with(q, x, pending, q.effective("bias")), q(x), rtol=0, atol=0)

    q.commit()  # in place: the parameter now holds the fake-quantized values
    assert torch.equal(q.weight, pending) and torch.equal(q.effective("weight"), pending)
    s = q.scales("weight")
    assert isinstance(s, StoredScales) and s.scale is q.weight_scale  # the buffer itself
    assert (s.zero_point is not None) == (not q.specs["weight"].symmetric)
    assert s.tensor_scale is None and s.subblock_shifts is None
    ref = qcore.fake_quantize(q.effective("weight", canonical=True), q.specs["weight"], scale=s.scale,
                              zero_point=s.zero_point)
    assert torch.equal(ref, q.effective("weight", canonical=True))  # the stored scales are the weight's
    out = q(x)

    q.freeze()
    assert q.frozen and "weight" not in dict(q.named_parameters())
    assert q.weight_shape == shape and q.weight_dtype == torch.float32
    assert torch.equal(q.effective("weight"), pending)  # dequantized codes: bit for bit
    assert q.scales("weight").scale is q.weight_scale
    assert torch.equal(q(x), out)
    q.half()
    assert q.weight_dtype == torch.float16 and q.effective("weight").dtype == torch.float16
    assert q.weight_shape == shape


def test_bad_roles_are_refused():
    q = wrap(nn.Linear(16, 6, bias=False), LayerConfig(weight=UINT4_G8), name="fc")
    for call, msg in ((lambda: q.effective("input"), "'weight' or 'bias'"),
                      (lambda: q.effective("bias", canonical=True), "role 'weight' only"),
                      (lambda: q.scales("bias"), "does not quantize role 'bias'"),
                      (lambda: q.scales("input"), "does not quantize role 'input'"),
                      (lambda: q.is_calibrated("weight"), "'input' or 'output'"),
                      (lambda: q.static_scale_shape("input"), "no activation role 'input'"),
                      (lambda: q.fake_quantize_activation(torch.zeros(2, 16), "weight"), "'input' or 'output'"),
                      (lambda: q.load_static_scales("input", scale=1.0), "no static 'input' scales"),
                      (lambda: q.load_bias(nn.Parameter(torch.zeros(6))), "absent")):
        with pytest.raises(ValueError, match=msg):
            call()
    assert q.effective("bias") is None


def _static_linear():
    torch.manual_seed(1)
    cfg = LayerConfig(weight=UINT4_G8, input=TensorConfig(qcore.make_spec("int8", axis=1)),
                      output=TensorConfig(qcore.make_spec("uint8", symmetric=False)))
    return nn.Linear(16, 6), cfg


def test_static_activations_calibrate_and_load():
    fm, cfg = _static_linear()
    q = wrap(fm, cfg, name="fc")
    xs = [torch.randn(4, 16) for _ in range(3)]
    assert q.static_scale_shape("input") == (16,) and q.static_scale_shape("output") == ()
    assert not q.is_calibrated("input") and not q.is_calibrated("output")
    assert bool(torch.isnan(q.scales("input").scale).all()) and q.scales("input").zero_point is None
    with pytest.raises(RuntimeError, match="not calibrated"):
        q(xs[0])
    q.start_calibration()
    assert set(q.observers) == {"input", "output"} and all(o.n == 0 for o in q.observers.values())
    for x in xs:
        q(x)
    assert all(o.n == 3 for o in q.observers.values())
    q.finish_calibration()
    assert q.observers is None and q.is_calibrated("input") and q.is_calibrated("output")
    s_in, s_out = q.scales("input"), q.scales("output")
    assert s_in.scale is q.input_scale and s_out.zero_point is q.output_zero_point
    assert bool(torch.isfinite(s_in.scale).all()) and tuple(s_in.scale.shape) == (16,)
    x = xs[0]
    want = qcore.fake_quantize(x, q.specs["input"], scale=s_in.scale.reshape(1, 16))
    assert torch.equal(q.fake_quantize_activation(x, "input"), want)
    y = q(x)

    # an importer's route: a fresh wrapper given the same scales computes the same outputs
    fm2 = nn.Linear(16, 6)
    fm2.load_state_dict(fm.state_dict())
    r = wrap(fm2, cfg, name="fc")
    r.load_static_scales("input", scale=s_in.scale.numpy())
    r.load_static_scales("output", scale=s_out.scale.clone(), zero_point=s_out.zero_point.clone())
    assert r.is_calibrated("input") and r.is_calibrated("output")
    assert torch.equal(r(x), y)
    r.load_static_scales("output", scale=s_out.scale.clone())  # asymmetric without zero point: 0
    assert float(r.scales("output").zero_point) == 0.0


def test_load_static_scales_checks_before_storing():
    fm, cfg = _static_linear()
    q = wrap(fm, cfg, name="fc")
    before = {k: v.clone() for k, v in q.named_buffers()}
    bad = [(dict(role="input", scale=torch.ones(15)), "expected \\[16\\]"),
           (dict(role="input", scale=torch.ones(16), zero_point=torch.zeros(16)), "symmetric"),
           (dict(role="input"), "takes scale"),
           (dict(role="input", scale=torch.ones(16), tensor_scale=1.0), "takes scale"),
           (dict(role="output", scale=torch.ones(()), zero_point=torch.zeros(2)), "zero_point has shape"),
           (dict(role="weight", scale=torch.ones(6)), "no static 'weight' scales")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            q.load_static_scales(kw.pop("role"), **kw)
    after = dict(q.named_buffers())
    assert all(torch.equal(v, after[k]) or bool(torch.isnan(v).all() and torch.isnan(after[k]).all())
               for k, v in before.items())
    assert not q.is_calibrated("input") and not q.is_calibrated("output")


def test_load_bias():
    torch.manual_seed(2)
    fm = nn.Linear(16, 6)
    q = wrap(fm, LayerConfig(weight=UINT4_G8, bias="int8"), name="fc")
    assert "bias" in q.specs and not torch.equal(q.effective("bias"), fm.bias)
    with pytest.raises(TypeError, match="nn.Parameter"):
        q.load_bias(torch.zeros(6))
    with pytest.raises(ValueError, match="shape \\[5\\]"):
        q.load_bias(nn.Parameter(torch.zeros(5)))
    b = nn.Parameter(torch.linspace(-1, 1, 6), requires_grad=False)
    q.load_bias(b)
    assert "bias" not in q.specs and q.bias is b and torch.equal(q.effective("bias"), b)


# ---------------------------------------------------------------------------------------------------------------
# nothing under src/qcore/adapters/ but the modules/ package reads a quantized module's private state
# ---------------------------------------------------------------------------------------------------------------

#: the package that owns quantized modules' state: its files may read it
OWNER = ADAPTERS / "modules"
#: the private state of ``QuantModule`` / ``QuantExperts`` (instance attributes); the public API stands for them
STATE = ("_qspecs", "_qmode", "_observers", "_frozen_meta", "_calibrated", "_wcache", "_wver", "_bver", "_dequantized",
         "_wspecs", "_proj_tcs")


def _private_members(cls) -> set:
    """The private members ``cls`` defines itself (helpers, class flags), torch's ``nn.Module`` names excluded."""
    return {k for k in vars(cls) if k.startswith("_") and not k.startswith("__") and not hasattr(nn.Module, k)}


#: the private members of ``QuantModule`` and ``QuantExperts`` (their state and helpers)
PRIVATE = tuple(sorted(set(STATE) | _private_members(QuantModule) | _private_members(QuantExperts)))
_ATTR = re.compile(r"\.(%s)\b" % "|".join(PRIVATE))
# the scale buffers through torch's private dict (m._buffers["input_scale"], m._buffers.get(f"{role}_zero_point"))
_BUF = re.compile(r"\._buffers(?:\.get\(|\[)\s*f?[\"'][^\"']*(?:scale|zero_point|packed|shifts)[\"']")


def _private_reads(text: str) -> list:
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        code = line.split("#", 1)[0]
        for m in list(_ATTR.finditer(code)) + list(_BUF.finditer(code)):
            if not code[:m.start()].rstrip().endswith("self"):  # a file's own classes may use their own state
                out.append((i, m.group(0)))
    return out


def test_the_source_check_finds_private_reads():
    found = _private_reads('w = m._qspecs["weight"]\nm._buffers[f"{role}_scale"] = s\nself._param = 1\n'
                           'x = m.specs["weight"]  # not m._qspecs\nq._calibrated.add(role)\n'
                           'mod._buffers[leaf] = v\n')
    assert [i for i, _ in found] == [1, 2, 5]


def test_the_private_members_are_the_classes_own():
    """The list is derived from the classes, and holds at least what the hand-written list of modules.py's
    ``_QuantMixin`` held (so the check is no weaker than it was)."""
    before = {"_qspecs", "_qmode", "_qinit", "_plan", "_observers", "_frozen_meta", "_calibrated", "_wcache", "_wver",
              "_bver", "_dequantized", "_param", "_w", "_canon", "_uncanon", "_features", "_static_shape",
              "_scale_view", "_act_view", "_qact", "_uncalibrated", "_quantize_param", "_fq_param", "_keep_params",
              "_inplace_quantize", "_mark", "_set_ver", "_adopt_loaded", "_check_given_weight", "_frozen_weight",
              "_frozen_qtensor", "_frozen_linear", "_conv", "_index_input"}
    assert before <= set(PRIVATE)
    assert {"_gguf_blocks_of", "_proj", "_qact_e", "_expert_static_shape"} <= set(PRIVATE)


def test_no_private_module_state_outside_the_modules_package():
    files = sorted(p for p in ADAPTERS.rglob("*.py") if OWNER not in p.parents)
    assert len(files) > 20 and not any(p.name == "base.py" and p.parent == OWNER for p in files)
    bad = [f"{p.relative_to(ADAPTERS.parent)}:{i}: {what}" for p in files for i, what in _private_reads(p.read_text())]
    assert not bad, ("read a quantized module through its public API (specs, effective, scales, ...; "
                     "src/qcore/adapters/modules/), not its private state:\n" + "\n".join(bad))


def test_frozen_quantized_bias_is_quantized_once():
    """A quantized bias is fake-quantized once: freeze and a reload of the frozen state_dict keep the committed
    module's outputs (quantizing a fake-quantized int8 bias again moves it: 127.5 * s -> 127 * s)."""
    torch.manual_seed(3)
    fm, x = nn.Linear(16, 6), torch.randn(3, 16)
    cfg = LayerConfig(weight="int8", bias="int8")
    q = wrap(fm, cfg, name="fc")
    q.commit()
    b, y = q.effective("bias").clone(), q(x).detach()
    q.freeze()
    assert torch.equal(q.effective("bias"), b) and torch.equal(q(x), y)
    r = wrap(nn.Linear(16, 6), cfg, name="fc")
    r.freeze()
    r.load_state_dict({k: v.clone() for k, v in q.state_dict().items()})
    assert torch.equal(r.effective("bias"), b) and torch.equal(r(x), y)


def test_activation_axis():
    assert wrap(nn.Linear(4, 2), LayerConfig(weight="int8"), name="a").activation_axis == -1
    assert wrap(nn.Embedding(4, 2), LayerConfig(weight="int8"), name="b").activation_axis == -1
    assert wrap(nn.Conv2d(4, 2, 1), LayerConfig(weight="int8"), name="c").activation_axis == 1
    assert wrap(nn.ConvTranspose2d(4, 2, 1), LayerConfig(weight="int8"), name="d").activation_axis == 1


def test_freeze_after_qat_quantizes_the_bias_once():
    torch.manual_seed(4)
    fm, x = nn.Linear(16, 6), torch.randn(3, 16)
    q = wrap(fm, LayerConfig(weight="int8", bias="int8"), name="fc", qat=True)
    with torch.no_grad():
        y, b = q(x), q.effective("bias").clone()
    assert not torch.equal(b, fm.bias)  # the master stays float under qat
    q.freeze()
    assert torch.equal(q.bias.detach(), b) and torch.equal(q.effective("bias"), b)
    with torch.no_grad():
        assert torch.equal(q(x), y)

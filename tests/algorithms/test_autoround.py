"""SignRound (qcore.algorithms.autoround): one step against a direct float64 transcription of the paper's update,
round-to-nearest at the starting point, the best-iterate guarantee, the schedule, refusals, the config."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

import qcore  # noqa: E402
from qcore.algorithms import autoround as ar  # noqa: E402
from qcore.algorithms.config import AutoRoundConfig, parse_algorithm  # noqa: E402


def _spec(dtype="uint4", group=8, symmetric=False):
    g = qcore.PerGroup(group, axis=1) if group else qcore.PerChannel(0)
    return qcore.QuantSpec(dtype=qcore.get_dtype(dtype), granularity=g, symmetric=symmetric,
                           scale_dtype=qcore.get_dtype("float32"), name=dtype)


def _reference_step(W, X, V, alpha, beta, *, group, bits, lr):
    """SignRound (arXiv 2309.05516, eqs. 1-4), written plainly in float64: W~ = s (clip(round(W/s + V) + zp, 0,
    2^b - 1) - zp), s = (max(W) beta - min(W) alpha) / (2^b - 1) (max >= 0 >= min, per group; scale kept as a
    float32 value), zp = round(-min(W) alpha / s); loss = mean((X W~^T - X W^T)^2) (straight-through rounding);
    V -= lr sign(dL/dV), alpha, beta -= lr sign(.), then V in [-0.5, 0.5], alpha, beta in [0, 1]."""
    V = V.clone().requires_grad_(True)
    alpha = alpha.clone().requires_grad_(True)
    beta = beta.clone().requires_grad_(True)

    def rnd(t):
        return t + (torch.round(t) - t).detach()
    out, n = W.shape
    Wg = W.reshape(out, n // group, group)
    wmin = torch.clamp(Wg.min(-1).values, max=0) * alpha
    wmax = torch.clamp(Wg.max(-1).values, min=0) * beta
    s = (wmax - wmin) / (2 ** bits - 1)
    s = s + (s.detach().float().double() - s.detach())
    zp = torch.clamp(rnd(-wmin / s), 0, 2 ** bits - 1)
    se = s.repeat_interleave(group, 1)
    ze = zp.repeat_interleave(group, 1)
    q = torch.clamp(rnd(W / se + V) + ze, 0, 2 ** bits - 1)
    Wq = se * (q - ze)
    loss = torch.mean((X @ Wq.T - X @ W.T) ** 2)
    loss.backward()
    with torch.no_grad():
        V2 = torch.clamp(V - lr * torch.sign(V.grad), -0.5, 0.5)
        a2 = torch.clamp(alpha - lr * torch.sign(alpha.grad), 0, 1)
        b2 = torch.clamp(beta - lr * torch.sign(beta.grad), 0, 1)
    return float(loss.detach()), V2, a2, b2


@pytest.mark.parametrize("bits", [3, 4])
def test_one_step_equals_the_float64_transcription_of_the_paper(bits):
    g = torch.Generator().manual_seed(bits)
    W = torch.randn(6, 16, generator=g, dtype=torch.float64)
    X = torch.randn(40, 16, generator=g, dtype=torch.float64)
    V = (torch.rand(6, 16, generator=g, dtype=torch.float64) - 0.5) * 0.6
    alpha = 0.7 + 0.3 * torch.rand(6, 2, generator=g, dtype=torch.float64)
    beta = 0.7 + 0.3 * torch.rand(6, 2, generator=g, dtype=torch.float64)
    lr = 0.05
    want = _reference_step(W, X, V, alpha, beta, group=8, bits=bits, lr=lr)
    spec = _spec(f"uint{bits}")
    params = {"w": {"value": V.clone(), "min_scale": alpha.clone(), "max_scale": beta.clone()}}
    loss = ar.signround_step({"w": W}, {"w": spec}, params, lambda fq, x: x @ fq["w"].T, [X], [X @ W.T], [0],
                             lr=lr, minmax_lr=lr)
    assert loss == pytest.approx(want[0], rel=1e-12)
    assert torch.equal(params["w"]["value"], want[1])
    assert torch.equal(params["w"]["min_scale"], want[2]) and torch.equal(params["w"]["max_scale"], want[3])
    assert not torch.equal(want[1], V)  # the step moved the offsets


@pytest.mark.parametrize("spec", [_spec("uint4", 8), _spec("uint3", 16), _spec("int4", 8, symmetric=True),
                                  _spec("int8", 0, symmetric=True), _spec("uint4", 0)],
                         ids=["uint4-g8", "uint3-g16", "int4-sym-g8", "int8-sym-channel", "uint4-channel"])
def test_the_starting_point_is_qcores_round_to_nearest(spec):
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    w[0, :8] = 0.0  # an all-zero group
    assert torch.equal(ar.fake_quantize_rounded(w, spec), qcore.fake_quantize(w, spec))
    q, rtn = ar.quantize_rounded(w, spec), qcore.quantize(w, spec)
    assert torch.equal(q.codes, rtn.codes) and torch.equal(q.scales, rtn.scales)
    p = ar.init_params(w, spec)
    assert torch.equal(ar.fake_quantize_rounded(w, spec, p["value"], p["min_scale"], p["max_scale"]),
                       qcore.fake_quantize(w, spec))


def _block(seed=0):
    g = torch.Generator().manual_seed(seed)
    W1, W2 = torch.randn(24, 16, generator=g), torch.randn(16, 24, generator=g) * 0.3
    xs = [torch.randn(20, 16, generator=g) for _ in range(3)]

    def forward(w, x):
        return torch.nn.functional.gelu(x @ w["up"].T) @ w["down"].T
    ys = [forward({"up": W1, "down": W2}, x) for x in xs]
    return {"up": W1, "down": W2}, forward, xs, ys


def _loss(w, forward, xs, ys):
    return sum(float(torch.mean((forward(w, x) - y) ** 2)) for x, y in zip(xs, ys)) / len(xs)


@pytest.mark.parametrize("dtype", ["uint3", "uint4"])
def test_the_kept_iterate_is_never_worse_than_round_to_nearest(dtype):
    W, forward, xs, ys = _block()
    specs = {n: _spec(dtype, 8) for n in W}
    r = ar.signround(W, specs, forward, xs, ys, iters=100, batch_size=3, key=0)
    rtn = _loss({n: qcore.fake_quantize(w, specs[n]) for n, w in W.items()}, forward, xs, ys)
    got = _loss({n: qcore.dequantize(q) for n, q in r.qtensors.items()}, forward, xs, ys)
    assert r.init_loss == pytest.approx(rtn, rel=1e-6) and r.losses[0] == r.init_loss
    assert got == pytest.approx(r.best_loss, rel=1e-5) and r.best_loss == min(r.losses)
    assert got <= rtn and got < 0.95 * rtn  # never worse (best iterate), and here better
    for n, q in r.qtensors.items():
        assert q.spec == specs[n] and r.params[n]["value"].abs().max() <= 0.5
        assert 0 <= float(r.params[n]["min_scale"].min()) and float(r.params[n]["max_scale"].max()) <= 1


def test_minibatch_order_comes_from_the_key():
    W, forward, xs, ys = _block(1)
    specs = {n: _spec("uint4", 8) for n in W}
    a = ar.signround(W, specs, forward, xs, ys, iters=6, batch_size=1, key=3)
    b = ar.signround(W, specs, forward, xs, ys, iters=6, batch_size=1, key=3)
    assert a.losses == b.losses
    def order(k):
        s = ar._Sampler(10, 3, k)
        return [s.next() for _ in range(4)]  # the 4th after a reshuffle (fewer than 3 left)
    orders = {k: order(k) for k in (3, 4)}
    assert orders[3] == order(3) and orders[3] != orders[4]
    assert all(len(set(o)) == 3 for o in orders[3])  # without replacement within a minibatch
    zero = ar.signround(W, specs, forward, xs, ys, iters=0)
    assert all(torch.equal(zero.qtensors[n].codes, qcore.quantize(W[n], specs[n]).codes) for n in W)


def test_schedule_is_linear_decay_from_lr():
    assert [ar.learning_rate(t, 4, 0.25) for t in range(4)] == [0.25, 0.1875, 0.125, 0.0625]


def test_refusals_before_any_work():
    W, forward, xs, ys = _block()
    specs = {n: _spec("uint4", 8) for n in W}
    calls = []

    def fwd(w, x):
        calls.append(1)
        return forward(w, x)
    mx = {n: qcore.make_spec("mxfp4") for n in W}
    with pytest.raises(ValueError, match="float / MX"):
        ar.signround(W, mx, fwd, xs, ys)
    with pytest.raises(ValueError, match="whole groups"):
        ar.signround(W, {n: _spec("uint4", 5) for n in W}, fwd, xs, ys)
    with pytest.raises(ValueError, match="targets"):
        ar.signround(W, specs, fwd, xs, ys[:2])
    with pytest.raises(ValueError, match="iters"):
        ar.signround(W, specs, fwd, xs, ys, iters=-1)
    with pytest.raises(ValueError, match="lr"):
        ar.signround(W, specs, fwd, xs, ys, lr=0.0)
    assert calls == []


# the fields of Quark 0.13's AutoRoundConfig (quark/torch/quantization/config/config.py, class AutoRoundConfig)
QUARK_FIELDS = {"name", "iters", "lr", "enable_minmax_tuning", "minmax_lr", "batch_size", "inside_layer_modules",
                "model_decoder_layers"}


def test_config_round_trips_and_reads_and_writes_quarks_spelling():
    c = AutoRoundConfig(iters=50, lr=0.01, batch_size=2, key=3, modules=("mlp.up_proj",), decoder_layers="model.layers")
    assert parse_algorithm(c.to_dict()) == c and parse_algorithm("autoround") == AutoRoundConfig()
    q = c.to_quark()
    assert set(q) == QUARK_FIELDS and q["inside_layer_modules"] == ["mlp.up_proj"] and q["minmax_lr"] == 0.01
    back = parse_algorithm(q)
    assert back == dataclasses.replace(c, key=0, minmax_lr=0.01)
    quark = {"name": "autoround", "iters": 200, "lr": 0.005, "enable_minmax_tuning": False, "minmax_lr": 0.005,
             "batch_size": 8, "inside_layer_modules": [], "model_decoder_layers": ""}
    got = parse_algorithm(quark)
    assert (got.iters, got.lr, got.minmax_lr, got.enable_minmax_tuning, got.batch_size, got.modules,
            got.decoder_layers) == (200, 0.005, 0.005, False, 8, (), None)
    assert AutoRoundConfig().to_quark() == {**quark, "enable_minmax_tuning": True}
    for bad, what in (({"iters": -1}, "iters"), ({"lr": 0}, "lr"), ({"batch_size": 0}, "batch_size"),
                      ({"nsamples": 128}, "unknown key 'nsamples'"), ({"enable_minmax_tuning": 1}, "bool")):
        with pytest.raises((ValueError, TypeError), match=what):
            parse_algorithm({"name": "autoround", **bad})

"""GPTQ on fused MoE experts (issue 22): each expert's slice of ``gate_up_proj`` [E, 2I, H] and ``down_proj``
[E, H, I] is quantized by GPTQ as its own Linear weight would be, from the inputs that expert's GEMMs see.

The expected weights are computed here independently of the layer runner: the hidden states entering the MoE
block are captured from a plain forward of the float model (under all-expert routing every expert computes on
all of them), the Hessians built with ``update_hessian`` per batch, and ``qcore.algorithms.gptq.gptq`` run on
each expert slice; the committed ``QuantExperts`` must hold exactly those codes and scales.
"""

import copy
import logging

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402

import qcore  # noqa: E402
from qcore.adapters import (export_hf, freeze, from_pretrained, preset, quantize_model,  # noqa: E402
                            unquantized_weights)
from qcore.adapters.modules import QuantExperts  # noqa: E402
from qcore.algorithms.config import GPTQConfig  # noqa: E402
from qcore.algorithms.gptq import HessianStats, gptq, update_hessian  # noqa: E402

MOE = ["mixtral", "qwen3_moe"]
EXPERTS = "model.layers.0.mlp.experts"
PROJS = ("gate_up_proj", "down_proj")


def _data(zoo):
    return zoo.token_batches(3, seed=1, seq=12)


def _gptq_cfg(**kw):
    return preset("uint4_wo_32").replace(algorithms=({"name": "gptq", **kw},))


def _block_inputs(model, batches, layer: int = 0) -> list:
    """``[(hidden states [T, H], top-k index [T, k])]`` entering layer ``layer``'s experts, one per batch, from a
    plain forward (the routing the model computes)."""
    caps = []
    experts = model.model.layers[layer].mlp.experts
    h = experts.register_forward_pre_hook(lambda mod, args: caps.append((args[0].detach().clone(),
                                                                          args[1].detach().clone())))
    try:
        with torch.no_grad():
            for b in batches:
                model(b)
    finally:
        h.remove()
    return caps


def _hess(rows, n):
    st = HessianStats.empty(n, like=rows[0])
    for x in rows:
        if x.shape[0]:
            st = update_hessian(st, x)
    return st


def _expected(float_experts, caps, spec, *, routed_only: bool = False, gate_up=None) -> dict:
    """Per expert, GPTQ on each projection's slice from the tokens it computes on (all of them, or the routed
    ones); ``down_proj``'s inputs from ``gate_up`` (default: the float ``gate_up_proj``)."""
    a = GPTQConfig()
    kw = dict(block_size=a.block_size, damp=a.damp, act_order=a.act_order, static_groups=a.static_groups)
    gu, dn = float_experts.gate_up_proj.detach(), float_experts.down_proj.detach()
    gate_up = gu if gate_up is None else gate_up
    out = {p: [] for p in PROJS}
    for e in range(gu.shape[0]):
        xs = [x[(i == e).any(-1)] if routed_only else x for x, i in caps]
        if sum(x.shape[0] for x in xs) == 0:
            out["gate_up_proj"].append(None)
            out["down_proj"].append(None)
            continue
        out["gate_up_proj"].append(gptq(gu[e].clone(), _hess(xs, gu.shape[2]), spec, **kw).qtensor)
        acts = []
        for x in xs:
            g, u = F.linear(x, gate_up[e]).chunk(2, dim=-1)
            acts.append(float_experts.act_fn(g) * u)
        out["down_proj"].append(gptq(dn[e].clone(), _hess(acts, dn.shape[2]), spec, **kw).qtensor)
    return out


def _same_q(a, b) -> bool:
    return (torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
            and (a.zero_points is None) == (b.zero_points is None)
            and (a.zero_points is None or torch.equal(a.zero_points, b.zero_points)))


def _check_equal(q: QuantExperts, want: dict, skip=()) -> None:
    for p in PROJS:
        for e, w in enumerate(want[p]):
            if e in skip:
                continue
            assert _same_q(q.expert_qtensor(p, e), w), (p, e)


@pytest.mark.parametrize("family", MOE)
def test_gptq_on_experts_equals_an_independent_computation(family, family_model, zoo):
    float_model = family_model(family)
    model = copy.deepcopy(float_model)
    data = _data(zoo)
    # all-expert routing: every expert computes on every token entering the block (the block's input rows)
    caps = _block_inputs(float_model, data)
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    quantize_model(model, _gptq_cfg(), data, progress=False)
    q = model.get_submodule(EXPERTS)
    assert isinstance(q, QuantExperts) and unquantized_weights(model) == []
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks  # none left
    assert preset("uint4_wo_32").layer.weight.observer.__class__.__name__ == "MinMax"  # GPTQ's own scale rule
    want = _expected(float_model.get_submodule(EXPERTS), caps, q.specs["weight"])
    _check_equal(q, want)
    # and the weights the forward uses are those QTensors, dequantized
    for p in PROJS:
        got = torch.stack([qcore.dequantize(w) for w in want[p]]).to(getattr(q, p).dtype)
        assert torch.equal(getattr(q, p).detach(), got)


def test_true_sequential_down_proj_sees_the_quantized_gate_up(family_model, zoo):
    """With ``true_sequential`` the attention is GPTQ'd first (the experts' inputs pass through it) and each
    expert's ``down_proj`` Hessian comes from its GPTQ'd ``gate_up_proj``."""
    float_model = family_model("qwen3_moe")
    model = copy.deepcopy(float_model)
    data = _data(zoo)
    quantize_model(model, _gptq_cfg(true_sequential=True), data, progress=False)
    q = model.get_submodule(EXPERTS)
    # the float model with layer 0's attention as GPTQ left it: the experts' inputs of the runner's stage
    mixed = copy.deepcopy(float_model)
    with torch.no_grad():
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            src = model.get_submodule(f"model.layers.0.self_attn.{n}")
            mixed.get_submodule(f"model.layers.0.self_attn.{n}").weight.copy_(src.weight)
    caps = _block_inputs(mixed, data)
    fe = float_model.get_submodule(EXPERTS)
    spec = q.specs["weight"]
    gu_q = torch.stack([qcore.dequantize(q.expert_qtensor("gate_up_proj", e)) for e in range(4)])
    want = _expected(fe, caps, spec, gate_up=gu_q)
    _check_equal(q, want)
    # (the float gate_up would give other down_proj weights: the test distinguishes the two)
    other = _expected(fe, caps, spec)
    assert any(not _same_q(a, b) for a, b in zip(other["down_proj"], want["down_proj"]))


def _moe_out(model, x):
    with torch.no_grad():
        return model.model.layers[0].mlp(x)


@pytest.mark.parametrize("family", MOE)
def test_gptq_beats_round_to_nearest_on_the_experts_output(family, family_model, zoo):
    float_model = family_model(family)
    data = _data(zoo)
    # the MoE block's input on the calibration data, as a [1, T, H] batch
    x = torch.cat([c[0] for c in _block_inputs(float_model, data)])[None]
    ref = _moe_out(float_model, x)
    exp_only = {"exclude": ("lm_head", "re:.*self_attn.*")}  # the experts alone are quantized
    rtn, gq = copy.deepcopy(float_model), copy.deepcopy(float_model)
    quantize_model(rtn, preset("uint4_wo_32").replace(**exp_only), progress=False)
    quantize_model(gq, _gptq_cfg().replace(**exp_only), data, progress=False)
    e_rtn = (_moe_out(rtn, x) - ref).pow(2).mean().item()
    e_gq = (_moe_out(gq, x) - ref).pow(2).mean().item()
    assert e_gq < 0.7 * e_rtn, (e_gq, e_rtn)
    # and the logits too
    y = data[0]
    want = zoo.model_output(float_model, y)
    assert (zoo.model_output(gq, y) - want).pow(2).mean() < (zoo.model_output(rtn, y) - want).pow(2).mean()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_gptq_experts_freeze_export_reload_same_logits(family, family_model, zoo, tmp_path):
    model = copy.deepcopy(family_model(family))
    data = _data(zoo)
    quantize_model(model, _gptq_cfg(), data, progress=False)
    assert unquantized_weights(model) == []
    q = model.get_submodule(EXPERTS)
    before = {p: [q.expert_qtensor(p, e) for e in range(4)] for p in PROJS}
    y = zoo.token_batches(1, seed=7)[0]
    logits = zoo.model_output(model, y)
    freeze(model)
    assert torch.equal(zoo.model_output(model, y), logits)
    _check_equal(model.get_submodule(EXPERTS), before)  # freezing keeps GPTQ's codes and scales
    export_hf(model, tmp_path / "out")
    back = from_pretrained(tmp_path / "out")
    assert isinstance(back.get_submodule(EXPERTS), QuantExperts)
    assert torch.equal(zoo.model_output(back, y), logits)
    _check_equal(back.get_submodule(EXPERTS), before)


def test_routed_only_calibration_uses_routed_tokens_and_rounds_unused_experts_to_nearest(family_model, zoo,
                                                                                         caplog):
    """``moe_all_experts=False``: expert e's Hessians come from the tokens routed to it; an expert routed no
    token is rounded to nearest (and logged)."""
    float_model = copy.deepcopy(family_model("mixtral"))
    router = float_model.model.layers[0].mlp.gate

    def never_three(mod, args, out):  # expert 3 of layer 0 is never routed (each token keeps 2 distinct experts)
        logits, w, idx = out
        idx = idx.clone()
        for t in range(idx.shape[0]):
            if 3 in idx[t].tolist():
                other = idx[t][idx[t] != 3]
                free = [e for e in range(3) if e not in other.tolist()]
                idx[t][idx[t] == 3] = free[0]
        return logits, w, idx

    router.register_forward_hook(never_three)
    data = _data(zoo)
    caps = _block_inputs(float_model, data)
    assert all(not (i == 3).any() for _, i in caps)
    model, rtn = copy.deepcopy(float_model), copy.deepcopy(float_model)
    with caplog.at_level(logging.WARNING, logger="qcore.adapters"):
        quantize_model(model, _gptq_cfg(), data, progress=False, moe_all_experts=False)
    assert any("experts [3] computed on no calibration token" in r.getMessage() for r in caplog.records)
    quantize_model(rtn, "uint4_wo_32", progress=False)
    q = model.get_submodule(EXPERTS)
    want = _expected(float_model.get_submodule(EXPERTS), caps, q.specs["weight"], routed_only=True)
    assert want["gate_up_proj"][3] is None
    _check_equal(q, want, skip=(3,))
    for p in PROJS:
        assert _same_q(q.expert_qtensor(p, 3), rtn.get_submodule(EXPERTS).expert_qtensor(p, 3))
    assert unquantized_weights(model) == []


def test_distributed_reduce_sees_every_expert_hessian_and_ranks_agree(family_model, zoo):
    """``run_algorithms(reduce=...)``: each expert's two Hessians go through ``reduce`` (the same number of calls
    on every rank); two ranks holding the same data (``reduce`` doubles the sums and counts) give the same
    weights as one process."""
    from qcore.adapters import plan_model
    from qcore.adapters.moe import moe_calibration
    from qcore.adapters.passes.sequential import run_algorithms
    cfg = _gptq_cfg()
    data = _data(zoo)
    results = []
    calls = []

    def double(st):
        calls.append(st.n)
        return HessianStats(st.sum * 2, st.count * 2)

    for reduce in (None, double):
        model = copy.deepcopy(family_model("qwen3_moe"))
        with moe_calibration(model, warn=False):
            results.append(run_algorithms(model, plan_model(model, cfg), cfg.algorithms, data, progress=False,
                                          reduce=reduce))
    one, two = results
    assert set(one) == set(two) and EXPERTS in one
    for name, v in one.items():
        if isinstance(v, dict):
            for p in PROJS:
                assert all(_same_q(a, b) for a, b in zip(v[p], two[name][p]))
        else:
            assert _same_q(v, two[name])
    # 2 layers, each: 2 attention groups (q/k/v, o) and per expert one gate_up (hidden 64) and one down (32)
    assert calls.count(32) == 2 * 4
    assert len(calls) == 2 * (2 + 2 * 4)


@pytest.mark.parametrize("algo", ["awq", "smoothquant"])
def test_awq_and_smoothquant_on_experts_stay_refused_by_name(algo, family_model, zoo):
    model = copy.deepcopy(family_model("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    base = "w_int8_a_int8_per_token_dynamic" if algo == "smoothquant" else "uint4_wo_32"
    for algos in (({"name": algo},), ({"name": "gptq"}, {"name": algo})):
        cfg = preset(base).replace(algorithms=algos)
        with pytest.raises(ValueError, match=rf"^{algo}: the plan quantizes fused MoE experts .*{EXPERTS}.*docs/adapters.md"):
            quantize_model(model, cfg, _data(zoo), progress=False)
        after = model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items())
        assert not getattr(model, "_qcore_partial", False)


def test_commit_weight_refuses_bad_inputs_before_any_change(family_model):
    from qcore.adapters import wrap
    model = copy.deepcopy(family_model("qwen3_moe"))
    ex = model.get_submodule(EXPERTS)
    q = wrap(ex, preset("uint4_wo_32").layer, name=EXPERTS)
    spec = q.specs["weight"]
    good = {p: [qcore.quantize(getattr(q, p)[e].detach(), spec) for e in range(4)] for p in PROJS}
    other = qcore.quantize(q.down_proj[0].detach(), preset("w_int8_per_channel_sym").layer.weight.spec)
    before = {p: getattr(q, p).detach().clone() for p in PROJS}
    bad = [
        (good["gate_up_proj"][0], TypeError, r"takes \{proj: \[qcore.QTensor per expert\]\}"),
        ({"gate_up_proj": good["gate_up_proj"]}, ValueError, "keys"),
        ({**good, "down_proj": good["down_proj"][:3]}, ValueError, "sequence of 4 entries"),
        ({**good, "down_proj": good["gate_up_proj"]}, ValueError, "does not match"),
        ({**good, "down_proj": good["down_proj"][:3] + [other]}, ValueError, "does not match"),
        ({**good, "down_proj": good["down_proj"][:3] + [torch.zeros(32, 32)]}, TypeError, "expected a qcore.QTensor"),
        ({**good, "down_proj": "abcd"}, ValueError, "sequence of 4 entries"),
    ]
    for w, exc, match in bad:
        with pytest.raises(exc, match=match):
            q.commit(weight=w)
        assert all(torch.equal(getattr(q, p), before[p]) for p in PROJS) and bool(q.gate_up_proj_scale.isnan().all())
    q.commit(weight=good)
    _check_equal(q, good)


def test_two_gloo_ranks_agree_with_one_process(tmp_path):
    """``quantize_model(..., distributed=Distributed())`` on 2 gloo ranks, each with half of the batches: both
    ranks end with the same model, bit for bit, as one process given all the batches (the float64 sums of this
    test's per-batch statistics do not depend on their order, as in test_distributed.py), and rank 0's half
    alone gives other experts: the reduction is what makes them equal."""
    import os
    import pathlib
    import subprocess
    import sys
    here = pathlib.Path(__file__).resolve().parents[1]  # tests/adapters: moe_dist_worker.py and conftest.py
    sys.path.insert(0, str(here))
    try:
        import moe_dist_worker as w
    finally:
        sys.path.remove(str(here))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parents[1]), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(here / "moe_dist_worker.py"), str(r), "2", str(tmp_path / "init"),
                               str(tmp_path / f"rank{r}.pt")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(2)]
    outs = []
    try:  # (the one-process references while the ranks start)
        one = w.model()
        quantize_model(one, w.config(), w.batches(), progress=False)
        ref = one.state_dict()
        alone = w.model()
        quantize_model(alone, w.config(), w.batches()[0::2], progress=False)
        for p in procs:
            outs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, o) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{o[-4000:]}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    keys = [k for k in ref if ".experts." in k]
    assert keys and all(k in r for r in ranks for k in ref)
    for r, res in enumerate(ranks):
        for k in ref:
            assert torch.equal(res[k], ref[k]), f"rank {r}: {k} differs"
    assert any(not torch.equal(alone.state_dict()[k], ref[k]) for k in keys)

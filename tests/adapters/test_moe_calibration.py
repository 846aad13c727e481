"""MoE calibration (qcore.adapters.moe): all-expert routing with the routed output kept, token coverage, restore.

Tiny Mixtral / Qwen2-MoE / Qwen3-MoE models built offline from configs. The tolerance on the logits: under
all-expert routing each expert's matrix products run on every token instead of its routed tokens; the
unrouted experts add exact zeros, but the products of one row can round differently when the matrix has more
rows (the BLAS kernel blocks differently). With transformers' ``batched_mm`` experts (one product per token and
slot, independent of the row count) the logits are bit for bit equal, which shows the zeros add nothing; with
``eager`` and ``grouped_mm`` the measured difference is a few float32 ulps (3e-8..6e-8 on logits of size ~0.5);
the bound asserted is 1e-5 of the largest logit.
"""

import copy
import json
import re
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from qcore.adapters import CalibrationError, calibrate, quantize_model  # noqa: E402
from qcore.adapters.moe import (MOE_LAYOUTS, ExpertCoverage, MoELayout, find_moe_blocks,  # noqa: E402
                                moe_calibration)

VOCAB = 128


def _config(family: str, experts: int = 4, top_k: int = 2):
    t = transformers
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64)
    if family == "mixtral":
        return t.MixtralConfig(intermediate_size=64, num_local_experts=experts, num_experts_per_tok=top_k, **common)
    if family == "qwen2_moe":
        return t.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                num_experts=experts, num_experts_per_tok=top_k, **common)
    return t.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=experts,
                            num_experts_per_tok=top_k, head_dim=8, **common)


FAMILIES = {"mixtral": (4, 2), "qwen2_moe": (8, 3), "qwen3_moe": (8, 3)}


@pytest.fixture(scope="module")
def models():
    out = {}
    for fam, (e, k) in FAMILIES.items():
        torch.manual_seed(0)
        out[fam] = transformers.AutoModelForCausalLM.from_config(_config(fam, e, k)).eval()
    return out


def _ids(seed=0, shape=(2, 12)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, shape, generator=g)


def _hooks(model):
    """Every hook of every module (the context must leave these as it found them)."""
    return {n: (len(m._forward_hooks), len(m._forward_pre_hooks), hasattr(m, "_qcore_moe_calibration"))
            for n, m in model.named_modules()}


def _router_topk(gate, h):
    """An independent top-k from the router's weight (softmax of the logits, then top-k)."""
    probs = torch.softmax(F.linear(h.reshape(-1, gate.weight.shape[1]), gate.weight).float(), dim=-1)
    return torch.topk(probs, gate.top_k, dim=-1).indices


def _no_warnings():
    return warnings.catch_warnings(record=True)


@pytest.mark.parametrize("impl", ["batched_mm", "eager", "grouped_mm"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_are_the_routed_ones(models, family, impl):
    m = copy.deepcopy(models[family])
    m.set_experts_implementation(impl)
    x = _ids(1)
    with torch.no_grad():
        ref = m(x).logits
        with moe_calibration(m, min_tokens=0) as moe:
            got = m(x).logits
        after = m(x).logits
    assert len(moe.blocks) == 2
    if impl == "batched_mm":
        assert torch.equal(got, ref)
    else:
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(after, ref)  # back to the routed computation


OTHER = {  # the other layouts of MOE_LAYOUTS and other routers (sigmoid + groups, sparsemixer, biased)
    "olmoe": lambda c: transformers.OlmoeConfig(intermediate_size=32, num_experts=8, num_experts_per_tok=2, **c),
    "deepseek_v3": lambda c: transformers.DeepseekV3Config(
        intermediate_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, **{**c, "num_key_value_heads": 4}),
    "phimoe": lambda c: transformers.PhimoeConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                                  **c),
    "granitemoe": lambda c: transformers.GraniteMoeConfig(intermediate_size=32, num_local_experts=4,
                                                          num_experts_per_tok=2, **c),
    "gpt_oss": lambda c: transformers.GptOssConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                                   head_dim=8, **c),
}


@pytest.mark.parametrize("family", list(OTHER))
def test_other_transformers_moe_families(family):
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = transformers.AutoModelForCausalLM.from_config(OTHER[family](common)).eval()
    blocks = find_moe_blocks(m)
    assert len(blocks) == 2 and blocks[0].router == ("router" if family in ("phimoe", "granitemoe", "gpt_oss")
                                                     else "gate")
    x = _ids(12)
    for impl in ("batched_mm", "eager"):
        m.set_experts_implementation(impl)
        widths = []
        h = m.get_submodule(blocks[0].name).experts.register_forward_pre_hook(
            lambda mod, args: widths.append(args[1].shape[1]))
        try:
            with torch.no_grad():
                ref = m(x).logits
                with moe_calibration(m, min_tokens=0) as moe:
                    got = m(x).logits
        finally:
            h.remove()
        assert widths == [blocks[0].top_k, blocks[0].num_experts]
        assert sum(moe.coverage().blocks[0].routed) == x.numel() * blocks[0].top_k
        if impl == "batched_mm":
            assert torch.equal(got, ref)
        else:
            assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_expert_gets_every_token_and_counts_match_the_router(models, family):
    m = models[family]
    e, k = FAMILIES[family]
    seen, gate_in = [], {}
    blocks = find_moe_blocks(m)
    assert [b.name for b in blocks] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(b.num_experts == e and b.top_k == k and (b.router, b.experts) == ("gate", "experts") for b in blocks)
    hs = []
    for b in blocks:
        blk = m.get_submodule(b.name)
        hs.append(blk.experts.register_forward_pre_hook(
            lambda mod, args, name=b.name: seen.append((name, args[0].shape[0], args[1].clone()))))
        hs.append(blk.gate.register_forward_pre_hook(
            lambda mod, args, name=b.name: gate_in.setdefault(name, []).append(args[0].detach().clone())))
    batches = [_ids(2), _ids(3, (1, 7))]
    try:
        with torch.no_grad(), moe_calibration(m, min_tokens=0) as moe:
            for x in batches:
                m(x)
    finally:
        for h in hs:
            h.remove()
    assert len(seen) == 2 * len(batches)
    for name, tokens, index in seen:  # every expert, every token: each row is a permutation of the E experts
        assert index.shape == (tokens, e)
        assert torch.equal(index.sort(dim=1).values, torch.arange(e).expand(tokens, e))
    cov = moe.coverage()
    for b in blocks:
        ins = gate_in[b.name]
        want = sum(torch.bincount(_router_topk(m.get_submodule(b.name).gate, h).reshape(-1), minlength=e)
                   for h in ins)
        c = cov[b.name]
        assert c.routed == tuple(want.tolist())
        assert c.tokens == sum(x.numel() for x in batches) == sum(c.routed) // k
        assert c.seen == (c.tokens,) * e
        first = [s for s in seen if s[0] == b.name]
        for (_, _, index), h in zip(first, ins):  # the routed experts first, in the router's order
            assert torch.equal(index[:, :k], _router_topk(m.get_submodule(b.name).gate, h))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_restored_after_exit_and_after_an_error(models, family):
    m = models[family]
    before = _hooks(m)
    x = _ids(4)
    with torch.no_grad(), moe_calibration(m):
        assert _hooks(m) != before
        m(x)
    assert _hooks(m) == before
    with _no_warnings() as w:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="boom"):
            with torch.no_grad(), moe_calibration(m, min_tokens=10**6):
                m(x)
                raise RuntimeError("boom")
    assert not [x for x in w if "MoE calibration" in str(x.message)]  # an error: no coverage warning
    assert _hooks(m) == before
    k = FAMILIES[family][1]
    got = []
    h = m.model.layers[0].mlp.experts.register_forward_pre_hook(lambda mod, args: got.append(args[1].shape[1]))
    try:
        with torch.no_grad():
            m(x)
    finally:
        h.remove()
    assert got == [k]  # the top-k routing again


def _starved_mixtral(seed=0):
    """A Mixtral with 6 experts whose routers never pick experts 4 and 5: rows v, -v, u, -u, 0, 0 give two
    positive logits (|h.v| and |h.u|) against the zeros of experts 4 and 5."""
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(_config("mixtral", 6, 2)).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            v, u = torch.randn(32), torch.randn(32)
            layer.mlp.gate.weight.copy_(torch.stack([v, -v, u, -u, torch.zeros(32), torch.zeros(32)]))
    return m


def test_under_calibrated_experts_are_reported_and_warned():
    m = _starved_mixtral()
    with pytest.warns(UserWarning, match=r"4 expert\(s\) were routed no calibration token: model.layers.0.mlp "
                                         r"expert 4 \(0\), model.layers.0.mlp expert 5 \(0\)"):
        with torch.no_grad(), moe_calibration(m) as moe:
            m(_ids(5))
    cov = moe.coverage()
    assert cov.under == (("model.layers.0.mlp", 4, 0), ("model.layers.0.mlp", 5, 0),
                         ("model.layers.1.mlp", 4, 0), ("model.layers.1.mlp", 5, 0))
    assert all(b.routed[4] == b.routed[5] == 0 and min(b.routed[:4]) > 0 for b in cov.blocks)
    assert "4 expert(s) routed fewer than 1 tokens" in str(cov)
    d = json.loads(json.dumps(cov.to_dict()))
    assert d["under_calibrated"][0] == {"block": "model.layers.0.mlp", "expert": 4, "routed": 0}
    assert d["blocks"]["model.layers.1.mlp"]["tokens"] == 24
    # a threshold above the busiest expert lists them all; 0 lists none and warns nothing
    with pytest.warns(UserWarning, match="12 expert"):
        with torch.no_grad(), moe_calibration(m, min_tokens=10**6) as moe:
            m(_ids(5))
    assert len(moe.coverage().under) == 12
    with _no_warnings() as w:
        warnings.simplefilter("always")
        with torch.no_grad(), moe_calibration(m, min_tokens=0, all_experts=False) as moe:
            m(_ids(5))
    assert not w and moe.coverage().under == () and moe.coverage().blocks[0].seen == moe.coverage().blocks[0].routed
    with pytest.raises(KeyError, match="no MoE block 'model.layers.9.mlp'"):
        moe.coverage()["model.layers.9.mlp"]
    with pytest.raises(AttributeError):
        moe.coverage().min_tokens = 3  # frozen


def test_counting_can_be_paused_routing_stays_wide(models):
    m = models["mixtral"]
    widths = []
    h = m.model.layers[1].mlp.experts.register_forward_pre_hook(lambda mod, args: widths.append(args[1].shape[1]))
    try:
        with torch.no_grad(), moe_calibration(m, min_tokens=0) as moe:
            with moe.counting(False):
                m(_ids(6))
            m(_ids(7, (1, 5)))
    finally:
        h.remove()
    assert widths == [4, 4]
    assert [b.tokens for b in moe.coverage().blocks] == [5, 5]


class LinearExperts(nn.Module):
    """Per-expert Linears with the experts call of transformers 5 (an unrouted expert is never called)."""

    def __init__(self, e, h, i):
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(h, i, bias=False) for _ in range(e))
        self.down = nn.ModuleList(nn.Linear(i, h, bias=False) for _ in range(e))

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(len(self.up)):
            tok, pos = torch.where(top_k_index == e)
            if tok.numel():
                y = self.down[e](F.silu(self.up[e](hidden[tok]))) * top_k_weights[tok, pos, None]
                out.index_add_(0, tok, y.to(out.dtype))
        return out


def _starved_linear_mixtral():
    m = _starved_mixtral(1)
    torch.manual_seed(2)
    for layer in m.model.layers:
        layer.mlp.experts = LinearExperts(6, 32, 64)
    return m


def test_static_calibration_reaches_every_expert():
    m = _starved_linear_mixtral()
    data = [_ids(8), _ids(9)]
    m2 = copy.deepcopy(m)
    with pytest.warns(UserWarning, match="were routed no calibration token"):
        quantize_model(m, "w_int8_a_int8_per_tensor_sym", data, progress=False)
    cov = m.qcore_moe_coverage
    assert isinstance(cov, ExpertCoverage) and cov.all_experts
    assert [(n, e) for n, e, _ in cov.under] == [("model.layers.0.mlp", 4), ("model.layers.0.mlp", 5),
                                                  ("model.layers.1.mlp", 4), ("model.layers.1.mlp", 5)]
    assert cov.blocks[0].tokens == 48
    scale = m.model.layers[0].mlp.experts.up[4].input_scale  # the never-routed expert got a static scale
    assert torch.isfinite(scale).all() and (scale > 0).all()
    with pytest.raises(CalibrationError, match=r"model.layers.0.mlp.experts.up.4' \(input\) saw no calibration"):
        with _no_warnings():
            quantize_model(m2, "w_int8_a_int8_per_tensor_sym", data, progress=False, moe_all_experts=False)
    assert _hooks(m2) == _hooks(_starved_linear_mixtral())  # refused: the float modules and no hooks back


def test_gptq_collects_every_experts_statistics():
    m = _starved_linear_mixtral()
    data = [_ids(10)]
    algo = {"algorithms": [{"name": "gptq", "decoder_layers": "model.layers"}]}
    from qcore.adapters.plan import resolve_config as _as_config
    cfg = _as_config("w_int4_per_group_sym").replace(algorithms=tuple(algo["algorithms"]))
    m2 = copy.deepcopy(m)
    quantize_model(m, cfg, data, progress=False)
    assert not hasattr(m, "qcore_moe_coverage")  # the layer passes are not counted (no static calibration here)
    with pytest.raises(Exception, match=r"modules \['mlp.experts.up.4', 'mlp.experts.up.5'"):
        quantize_model(m2, cfg, data, progress=False, moe_all_experts=False)


def test_models_without_moe_are_untouched(zoo):
    m = zoo.tiny_llama()
    before = _hooks(m)
    x = _ids(11)
    with torch.no_grad():
        ref = m(x).logits
        with _no_warnings() as w:
            warnings.simplefilter("always")
            with moe_calibration(m, min_tokens=10**6) as moe:
                assert _hooks(m) == before
                got = m(x).logits
    assert torch.equal(got, ref) and not w
    assert find_moe_blocks(m) == [] and moe.blocks == () and moe.coverage().blocks == ()
    assert str(moe.coverage()) == "no MoE blocks"
    quantize_model(m, "w_int8_a_int8_per_tensor_sym", [x], progress=False)
    assert not hasattr(m, "qcore_moe_coverage")
    # a plain nn.Linear named gate next to experts is not a router
    blk = nn.Module()
    blk.gate, blk.experts = nn.Linear(4, 2), nn.ModuleList([nn.Linear(4, 4)])
    assert find_moe_blocks(blk) == []


BAD_CONTEXT_ARGS = [
    (dict(model=None), TypeError, "model must be a torch nn.Module, got NoneType"),
    (dict(model="mixtral"), TypeError, "model must be a torch nn.Module, got str"),
    (dict(all_experts=1), TypeError, "all_experts must be a bool, got 1"),
    (dict(all_experts="yes"), TypeError, "all_experts must be a bool, got 'yes'"),
    (dict(min_tokens=-1), ValueError, "min_tokens must be >= 0, got -1"),
    (dict(min_tokens=1.5), TypeError, "min_tokens must be an int"),
    (dict(min_tokens=True), TypeError, "min_tokens must be an int"),
    (dict(min_tokens="3"), TypeError, "min_tokens must be an int"),
    (dict(warn=None), TypeError, "warn must be a bool, got None"),
    (dict(layouts=[MoELayout("gate", "experts")]), TypeError, "layouts must be a tuple of MoELayout"),
    (dict(layouts=("gate", "experts")), TypeError, "layouts must be a tuple of MoELayout"),
]


@pytest.mark.parametrize("kw,exc,msg", BAD_CONTEXT_ARGS, ids=[str(i) for i in range(len(BAD_CONTEXT_ARGS))])
def test_bad_arguments_are_refused_before_any_hook(models, kw, exc, msg):
    m = models["mixtral"]
    before = _hooks(m)
    kw = dict(kw)
    model = kw.pop("model", m)
    with pytest.raises(exc, match=msg):
        with moe_calibration(model, **kw):
            pytest.fail("the body ran")
    assert _hooks(m) == before


def test_bad_arguments_of_the_callers_and_nesting(models):
    m = models["mixtral"]
    before = _hooks(m)
    with pytest.raises(TypeError, match="moe_all_experts must be a bool, got 'yes'"):
        quantize_model(copy.deepcopy(m), "w_int8_a_int8_per_tensor_sym", [_ids()], moe_all_experts="yes")
    with pytest.raises(TypeError, match="moe_all_experts must be a bool, got None"):
        calibrate(m, [_ids()], moe_all_experts=None)
    with moe_calibration(m) as moe:
        with pytest.raises(ValueError, match=r"\['model.layers.0.mlp', 'model.layers.1.mlp'\] are already under"):
            with moe_calibration(m):
                pass
        with pytest.raises(TypeError, match="enabled must be a bool, got 'no'"):
            with moe.counting("no"):
                pass
    assert _hooks(m) == before
    assert MOE_LAYOUTS == (MoELayout("gate", "experts"), MoELayout("router", "experts"))


class _Gate(nn.Module):
    def __init__(self, mode, e=4, k=2):
        super().__init__()
        self.mode, self.num_experts, self.top_k = mode, e, k
        self.weight = nn.Parameter(torch.randn(e, 8))

    def forward(self, h):
        logits = h @ self.weight.T
        w, i = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        if self.mode == "logits":
            return logits
        if self.mode == "twice":
            i = torch.zeros_like(i)
        if self.mode == "outside":
            i = i + self.num_experts
        if self.mode == "int32":
            i = i.int()
        return logits, w, i


class _Block(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.gate = _Gate(mode)
        self.experts = LinearExperts(4, 8, 8)

    def forward(self, h):
        _, w, i = self.gate(h) if self.mode != "logits" else (None, None, self.gate(h))
        if self.mode == "bypass":  # computes its experts with its own index, not the router's
            return self.experts(h, torch.topk(h @ self.gate.weight.T, 2, dim=-1).indices, w)
        if self.mode == "skip":  # never calls its experts module
            return h * w.sum(-1, keepdim=True)
        return self.experts(h, i, w)


@pytest.mark.parametrize("mode,msg", [
    ("logits", r"returned Tensor, not \(logits, top-k weights, top-k index\)"),
    ("twice", "sent a token to one expert twice"),
    ("outside", r"sent tokens to expert [4-7], outside \[0, 4\)"),
    ("bypass", "was not called with its router's top-k index"),
    ("skip", r"blk.experts was not called after its router blk.gate"),
])
def test_blocks_that_do_not_fit_the_layout_are_refused(mode, msg):
    torch.manual_seed(0)
    model = nn.Module()
    model.blk = _Block(mode)
    before = _hooks(model)
    assert [b.name for b in find_moe_blocks(model)] == ["blk"]
    with pytest.raises(CalibrationError, match=msg):
        with torch.no_grad(), moe_calibration(model, warn=False):
            model.blk(torch.randn(5, 8))
    assert _hooks(model) == before
    if mode not in ("bypass", "skip", "logits"):
        return
    with torch.no_grad(), moe_calibration(model, all_experts=False, warn=False) as moe:  # counting only: fine
        if mode != "logits":
            model.blk(torch.randn(5, 8))
    assert _hooks(model) == before and moe.coverage().all_experts is False


def test_quantize_command_reports_the_coverage(lm_dir, tmp_path, capsys):
    import shutil

    from qcore.cli import main
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(_config("mixtral", 6, 2)).eval()
    m.resize_token_embeddings(256)
    with torch.no_grad():
        for layer in m.model.layers:  # experts 4 and 5 never routed (see _starved_mixtral)
            v, u = torch.randn(32), torch.randn(32)
            layer.mlp.gate.weight.copy_(torch.stack([v, -v, u, -u, torch.zeros(32), torch.zeros(32)]))
    d = tmp_path / "mixtral"
    m.save_pretrained(d)
    for f in lm_dir.iterdir():
        if "token" in f.name:
            shutil.copy(f, d / f.name)
    rep = tmp_path / "r.json"
    with pytest.warns(UserWarning, match="4 expert"):
        code = main(["quantize", "--model", str(d), "--scheme", "w_int8_a_int8_per_tensor_sym", "--exclude", "lm_head",
                     "--exclude", r"re:.*\.experts\.(down_proj|gate_up_proj)", "--eval", "none", "--eval-text",
                     str(lm_dir.parent / "text.txt"), "--calib-samples", "2", "--seq-len", "16", "--report", str(rep),
                     "--no-progress"])
    o = capsys.readouterr()
    assert code == 0, o.err
    assert re.search(r"MoE experts never routed\s+4 \(calibrated on all tokens; the report's moe_coverage", o.out)
    r = json.loads(rep.read_text())["moe_coverage"]
    assert r["all_experts"] and r["blocks"]["model.layers.1.mlp"]["tokens"] == 32
    assert [(u["block"], u["expert"], u["routed"]) for u in r["under_calibrated"]] == [
        ("model.layers.0.mlp", 4, 0), ("model.layers.0.mlp", 5, 0), ("model.layers.1.mlp", 4, 0),
        ("model.layers.1.mlp", 5, 0)]


def test_an_int32_router_index_keeps_its_dtype():
    torch.manual_seed(0)
    model = nn.Module()
    model.blk = _Block("int32")
    got = []
    model.blk.experts.register_forward_pre_hook(lambda mod, args: got.append(args[1]))
    x = torch.randn(5, 8)
    with torch.no_grad():
        ref = model.blk(x)
        with moe_calibration(model, warn=False) as moe:
            out = model.blk(x)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()  # more rows per product: GEMM rounding
    assert got[0].dtype == got[1].dtype == torch.int32 and got[1].shape == (5, 4)
    assert sum(moe.coverage().blocks[0].routed) == 10

"""The architecture records (qcore.adapters.families) against tiny random models of every family in the table,
built offline from their transformers configs: every name a record gives exists with the expected type and
shape relations; the scaling groups fold random positive scales with the logits unchanged; the rotation keeps
the float function of every family whose record supports it and refuses the others by name before any change;
an unknown family refuses naming the record to add; records validate their fields.
"""

import copy
import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch import nn  # noqa: E402

from qcore.adapters.families import (BY_MODEL_TYPE, DEFAULT_FUSED, FAMILIES, Experts, Family,  # noqa: E402
                                     ScalingRule, UnknownFamily, decoder_layers_path, family_of, fused_units,
                                     locate, unit_offset_norm)
from qcore.adapters.modules import linear_weight  # noqa: E402
from qcore.adapters.passes.rotation import rotate_model  # noqa: E402
from qcore.adapters.passes.scaling import NoScalingMap, ScalingGroup, fold_scales, scaling_groups  # noqa: E402

VOCAB, HIDDEN, HEADS, KV, HD = 128, 32, 4, 2, 8
_DEC = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=64)

CONFIGS = {
    "llama": lambda t: t.LlamaConfig(**_DEC),
    "mistral": lambda t: t.MistralConfig(**_DEC),
    "qwen2": lambda t: t.Qwen2Config(**_DEC),
    "qwen3": lambda t: t.Qwen3Config(**_DEC, head_dim=HD),
    "qwen2_vl_text": lambda t: t.Qwen2VLConfig(
        text_config=dict(_DEC, model_type="qwen2_vl_text", rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=HIDDEN, num_heads=2, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2), image_token_id=3, video_token_id=4, vision_start_token_id=5),
    "gemma": lambda t: t.GemmaConfig(**_DEC, head_dim=HD),
    "gemma2": lambda t: t.Gemma2Config(**_DEC, head_dim=HD),
    "gemma3_text": lambda t: t.Gemma3TextConfig(**_DEC, head_dim=HD),
    "phi3": lambda t: t.Phi3Config(**_DEC, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gpt2": lambda t: t.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=HEADS, n_positions=64,
                                   bos_token_id=1, eos_token_id=2),
    "gpt_neox": lambda t: t.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=HEADS,
                                          max_position_embeddings=64),
    "opt": lambda t: t.OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=64, num_hidden_layers=2,
                                 num_attention_heads=HEADS, word_embed_proj_dim=HIDDEN, max_position_embeddings=64),
    "bert": lambda t: t.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=HEADS, max_position_embeddings=64),
    "mixtral": lambda t: t.MixtralConfig(**_DEC, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda t: t.Qwen2MoeConfig(**_DEC, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                            shared_expert_intermediate_size=32),
    "qwen3_moe": lambda t: t.Qwen3MoeConfig(**_DEC, head_dim=HD, num_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=16),
}
VLM = ("qwen2_vl_text",)  # records of a language tower: built here as the whole vision-language model
ROTATES = [f.model_type for f in FAMILIES if not f.rotation and f.model_type not in VLM]
REFUSES = [f.model_type for f in FAMILIES if f.rotation]
SCALES = [f.model_type for f in FAMILIES if f.scaling]
IDS = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
_CACHE: dict = {}


def build(mt: str):
    """A fresh float64 tiny model of family ``mt`` (built once, deep-copied)."""
    if mt not in _CACHE:
        cfg = CONFIGS[mt](transformers)
        torch.manual_seed(0)
        auto = (transformers.AutoModel if mt == "bert" else transformers.AutoModelForImageTextToText
                if mt == "qwen2_vl_text" else transformers.AutoModelForCausalLM)
        kw = {"experts_implementation": "eager"} if BY_MODEL_TYPE[mt].experts else {}  # grouped_mm: no float64
        m = auto.from_config(cfg, **kw).eval().double()
        with torch.no_grad():  # non-trivial norm weights, so a fold that forgets them shows
            for n, p in m.named_parameters():
                if p.ndim == 1 and ("norm" in n.lower() or "ln_" in n):
                    p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(1), dtype=p.dtype) * 0.5)
        _CACHE[mt] = m
    return copy.deepcopy(_CACHE[mt])


def out(m) -> torch.Tensor:
    with torch.no_grad():
        o = m(IDS)
    return o.logits if hasattr(o, "logits") else o.last_hidden_state


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to float32 rounding: the models run in float64, but the transformers RMSNorms compute in float32
    whatever the dtype (a wrong fold or rotation is off by the logits' own size)."""
    assert a.shape == b.shape
    err = float((a - b).norm() / b.norm())
    assert err < 1e-5, err


def test_the_table_covers_the_families_of_the_issue():
    assert set(CONFIGS) == set(BY_MODEL_TYPE)
    assert ROTATES and REFUSES and SCALES
    assert "gpt2" in SCALES  # Conv1D projections: the folds go through linear_weight


@pytest.mark.parametrize("mt", list(CONFIGS))
def test_every_name_of_the_record_exists_with_its_shape(mt):
    m = build(mt)
    fam = family_of(m)
    assert fam is BY_MODEL_TYPE[mt] and family_of(m.config) is fam and family_of(mt) is fam
    loc = locate(m)
    assert decoder_layers_path(m) == loc.layers
    layers = m.get_submodule(loc.layers)
    assert isinstance(layers, nn.ModuleList) and len(layers) == 2
    emb = m.get_submodule(loc.embed)
    assert isinstance(emb, nn.Embedding) and tuple(emb.weight.shape) == (VOCAB, HIDDEN)
    if fam.final_norm is not None:
        assert tuple(m.get_submodule(loc.final_norm).weight.shape) == (HIDDEN,)
    if fam.lm_head is not None:
        head = m.get_submodule(loc.lm_head)
        assert isinstance(head, nn.Linear) and (head.in_features, head.out_features) == (HIDDEN, VOCAB)
    cfg = m.config.get_text_config()
    hd = getattr(cfg, "head_dim", None) or HIDDEN // HEADS
    nh, kv = HEADS, getattr(cfg, "num_key_value_heads", None) or HEADS

    def io(mod):  # (in, out) of a Linear or a transformers Conv1D (weight [in, out])
        if fam.linear == "conv1d":
            assert type(mod).__name__ == "Conv1D"
            return tuple(mod.weight.shape)
        assert type(mod) is nn.Linear
        return mod.in_features, mod.out_features

    for layer in layers:
        for n in fam.layer_names():
            layer.get_submodule(n)  # AttributeError names the missing module
        ins = [io(layer.get_submodule(n)) for n in fam.attn_in]
        assert all(i == HIDDEN for i, _ in ins)
        assert sum(o for _, o in ins) == (nh + 2 * kv) * hd
        assert io(layer.get_submodule(fam.attn_out)) == (nh * hd, HIDDEN)
        for n in fam.mlp_in:
            assert io(layer.get_submodule(n))[0] == HIDDEN
        if fam.mlp_out is not None:
            inter = io(layer.get_submodule(fam.mlp_out))[0]
            assert io(layer.get_submodule(fam.mlp_out))[1] == HIDDEN
            assert sum(io(layer.get_submodule(n))[1] for n in fam.mlp_in) == inter * len(fam.mlp_in) or \
                io(layer.get_submodule(fam.mlp_in[0]))[1] == 2 * inter  # gate, up / fc1 / fused gate_up
        for n in fam.norm_names():
            norm = layer.get_submodule(n)
            want = HIDDEN if n not in fam.qk_norms else hd
            assert tuple(norm.weight.shape) == (want,), n
            # the record agrees with what a model without one would be told (Quark's class list) and with the fold
            assert unit_offset_norm(norm, fam) == unit_offset_norm(norm) == (fam.norm == "rms_unit_offset"), n
            kind = ("layernorm" if isinstance(norm, nn.LayerNorm) else
                    "rms_unit_offset" if unit_offset_norm(norm) else
                    "rms" if type(norm).__name__.endswith("RMSNorm") else type(norm).__name__)
            assert kind == fam.norm, (n, type(norm).__name__)
        all_norms = {n for n, x in layer.named_modules() if type(x).__name__.endswith(("RMSNorm", "LayerNorm"))}
        assert all_norms == set(fam.norm_names())
        leaves = {n.rpartition(".")[2] for n, _ in layer.named_modules()}
        for unit in fam.fused_units:
            assert set(unit) <= leaves, unit
        e = fam.experts
        if e is not None:
            experts = layer.get_submodule(e.path)
            n_exp = getattr(cfg, e.count)
            gu, dn = getattr(experts, e.gate_up), getattr(experts, e.down)
            assert gu.ndim == 3 and gu.shape[0] == n_exp and gu.shape[2] == HIDDEN
            assert tuple(dn.shape) == (n_exp, HIDDEN, gu.shape[1] // 2)
            assert tuple(layer.get_submodule(e.router).weight.shape) == (n_exp, HIDDEN)
        else:
            assert fam.mlp_in and fam.mlp_out


@pytest.mark.parametrize("mt", [f.model_type for f in FAMILIES if f.gguf_arch])
def test_gguf_architecture_names_are_llama_cpps(mt):
    gguf = pytest.importorskip("gguf")
    assert BY_MODEL_TYPE[mt].gguf_arch in set(gguf.MODEL_ARCH_NAMES.values())


@pytest.mark.parametrize("mt", SCALES)
def test_scaling_groups_fold_with_the_logits_unchanged(mt):
    m = build(mt)
    fam = family_of(m)
    ref = out(m)
    layers = m.get_submodule(locate(m).layers)
    first = layers[0].get_submodule(fam.scaling[0].group.layers[0])
    before = first.weight.detach().clone()
    g = torch.Generator().manual_seed(2)
    n_groups = 0
    for layer in layers:
        groups = scaling_groups(layer, model_type=mt)
        assert groups == scaling_groups(layer)  # the structure alone finds the same groups
        assert groups and all(isinstance(x, ScalingGroup) for x in groups)
        n_groups += len(groups)
        for grp in groups:
            n = linear_weight(layer.get_submodule(grp.layers[0])).shape[1]  # Linear or Conv1D (GPT-2)
            fold_scales(layer, grp, torch.rand(n, generator=g, dtype=torch.float64) * 3 + 0.25)
    assert n_groups >= len(layers)
    new = out(m)
    assert not torch.equal(first.weight, before)  # the folds changed the weights, not the function
    same(new, ref)


@pytest.mark.parametrize("mt", ["phi3", "gpt_neox", "gpt2"])
def test_smoothquant_runs_on_the_groups_of_fused_projections(mt):
    """quantize_model's SmoothQuant takes the record's groups (the norms into fused qkv / gate_up projections)."""
    from qcore.adapters import preset, quantize_model
    m = build(mt).float()
    fam = family_of(m)
    norm0 = m.get_submodule(f"{locate(m).layers}.0.{fam.attn_norm}").weight.detach().clone()
    ref = out(m)
    quantize_model(m, preset("int8").replace(algorithms=({"name": "smoothquant"},)), [IDS], progress=False)
    assert not torch.equal(m.get_submodule(f"{locate(m).layers}.0.{fam.attn_norm}").weight, norm0)  # folded
    assert float((out(m) - ref).norm() / ref.norm()) < 0.05


def test_conditional_scaling_rules():
    # grouped-query attention drops v -> o; without it (kv heads = heads) it is there
    gqa = scaling_groups(build("mistral").model.layers[0])
    mha_cfg = transformers.MistralConfig(**dict(_DEC, num_key_value_heads=HEADS))
    mha = scaling_groups(transformers.MistralForCausalLM(mha_cfg).model.layers[0])
    assert [x.prev_op for x in mha] == ["input_layernorm", "self_attn.v_proj", "post_attention_layernorm",
                                        "mlp.up_proj"]
    assert [x.prev_op for x in gqa] == ["input_layernorm", "post_attention_layernorm", "mlp.up_proj"]
    # Gemma2's sandwich: the MLP reads pre_feedforward_layernorm, not post_attention_layernorm
    g2 = scaling_groups(build("gemma2").model.layers[0])
    assert "post_attention_layernorm" not in [x.prev_op for x in g2]
    assert ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")) in [(x.prev_op, x.layers) for x in g2]
    # GPT-2 (Conv1D projections): the norms into the fused c_attn and into c_fc; no c_attn -> c_proj (v is a slice
    # of c_attn's outputs) and no c_fc -> c_proj (GELU)
    g = scaling_groups(build("gpt2").transformer.h[0])
    assert [(x.prev_op, x.layers) for x in g] == [("ln_1", ("attn.c_attn",)), ("ln_2", ("mlp.c_fc",))]
    assert "c_proj" in BY_MODEL_TYPE["gpt2"].scaling_note
    # families without groups refuse naming their record's reason and the record to add
    for mt, why in (("bert", "post-norm"),):
        m = build(mt)
        with pytest.raises(NoScalingMap, match=why) as e:
            scaling_groups(m.get_submodule(locate(m).layers)[0])
        assert "Family record" in str(e.value) and "quark_entries" in str(e.value)


@pytest.mark.parametrize("mt", ROTATES)
def test_rotation_keeps_the_float_function(mt):
    m = build(mt)
    ref = out(m)
    rotate_model(m)
    fam = family_of(m)
    layer = m.get_submodule(locate(m).layers)[0]
    unit = 0.0 if fam.norm == "rms_unit_offset" else 1.0  # the folded norm scales by 1: w = 1, or 1 + w with w = 0
    assert torch.equal(layer.get_submodule(fam.attn_norm).weight, torch.full((HIDDEN,), unit, dtype=torch.float64))
    same(out(m), ref)
    m2 = build(mt)
    rotate_model(m2, key=None, heads=False, online=())
    same(out(m2), ref)
    m3 = build(mt)  # block-diagonal rotations (of the scale-block size in use; 8 divides the head size here)
    rotate_model(m3, key=3, block=8)
    same(out(m3), ref)


@pytest.mark.parametrize("mt", [x for x in ROTATES if x != "llama"])
def test_quarot_exports_and_reloads_with_its_online_hooks(mt, tmp_path):
    """QuaRot through quantize_model, then export_hf + from_pretrained: the online transforms are re-installed
    where the record says (online_plan), and the reloaded model gives the same logits."""
    from qcore.adapters import export_hf, from_pretrained, preset, quantize_model
    from qcore.adapters.passes.rotation import input_rotations
    m = build(mt).float()
    quantize_model(m, preset("w_int8_per_channel_sym").replace(algorithms=({"name": "quarot"},)), [IDS],
                   progress=False)
    fam, path = family_of(m), locate(m).layers
    assert set(input_rotations(m)) == {f"{path}.{i}.{n}" for i in range(2) for n in (fam.mlp_out, fam.attn_out)}
    export_hf(m, tmp_path / "q")
    back = from_pretrained(tmp_path / "q")
    assert set(input_rotations(back)) == set(input_rotations(m))
    assert torch.equal(out(back), out(m))


def test_rotation_unties_tied_embeddings_of_a_supported_family():
    cfg = transformers.Qwen3Config(**_DEC, head_dim=HD, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = transformers.Qwen3ForCausalLM(cfg).eval().double()
    assert m.lm_head.weight is m.model.embed_tokens.weight
    ref = out(m)
    rotate_model(m)
    assert m.lm_head.weight is not m.model.embed_tokens.weight and not m.config.tie_word_embeddings
    same(out(m), ref)


@pytest.mark.parametrize("mt", REFUSES)
def test_rotation_refuses_by_family_before_any_change(mt):
    m = build(mt)
    fam = family_of(m)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError) as e:
        rotate_model(m)
    msg = str(e.value)
    assert f"model_type {mt!r}" in msg and fam.name in msg and fam.rotation in msg
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_vision_language_model_is_its_language_tower():
    cfg = transformers.Gemma3Config(
        text_config=dict(_DEC, head_dim=HD),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           image_size=28, patch_size=14), mm_tokens_per_image=4)
    m = transformers.Gemma3ForConditionalGeneration(cfg)
    assert family_of(m) is BY_MODEL_TYPE["gemma3_text"]
    loc = locate(m)
    assert loc.prefix == "model.language_model" and decoder_layers_path(m) == "model.language_model.layers"
    assert type(m.get_submodule(loc.embed)).__name__ == "Gemma3TextScaledWordEmbedding"
    assert type(m.get_submodule(loc.final_norm)).__name__ == "Gemma3RMSNorm"


@pytest.mark.parametrize("mt", VLM)
def test_a_vision_language_model_refuses_rotation_before_any_change(mt):
    m = build(mt)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match=r"vision-language model: \['model.visual'\]"):
        rotate_model(m)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8)) for _ in range(2)])


def test_an_unknown_family_refuses_naming_the_record_to_add():
    with pytest.raises(UnknownFamily, match=r"_Custom.*Add a Family record.*Architecture records"):
        family_of(_Custom())
    assert decoder_layers_path(_Custom()) is None and fused_units(_Custom()) == DEFAULT_FUSED
    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(UnknownFamily) as e:
        family_of(cfg)
    assert e.value.model_type == "falcon" and "model_type='falcon'" in str(e.value)
    assert isinstance(e.value, ValueError)
    with pytest.raises(ValueError, match=r"rotate_model: _Custom .*Add a Family record"):
        rotate_model(_Custom())
    with pytest.raises(NoScalingMap, match="add a Family record"):
        scaling_groups(_Custom().layers[0])


def test_attach_gives_one_model_a_record_and_checks_it_first():
    from qcore.adapters.families import attach
    a, b = build("llama"), build("llama")
    llama = BY_MODEL_TYPE["llama"]
    own = dataclasses.replace(llama, name="My Llama", fused_units=(("q_proj", "k_proj"),))
    assert attach(a, own) is own
    assert family_of(a) is own and family_of(b) is llama  # on that model only: nothing global changed
    assert fused_units(a) == (("q_proj", "k_proj"),) and family_of("llama") is llama
    with pytest.raises(ValueError, match=r"model_type 'mistral'.*'llama'"):
        attach(b, BY_MODEL_TYPE["mistral"])
    bad = dataclasses.replace(llama, act="mlp.activation")
    with pytest.raises(ValueError, match=r"'mlp.activation', which layer 0"):
        attach(b, bad)
    with pytest.raises(ValueError, match="has no decoder layers"):
        attach(b, dataclasses.replace(llama, layers="blocks"))
    with pytest.raises(TypeError, match="Family"):
        attach(b, {"model_type": "llama"})
    with pytest.raises(TypeError, match="torch.nn.Module"):
        attach("llama", llama)
    assert not hasattr(b, "qcore_family")  # every refusal before anything was attached
    from qcore.adapters.families import check_record
    assert check_record(b, llama) is None and not hasattr(b, "qcore_family")  # checks only


def test_fused_units_come_from_the_record():
    assert fused_units(build("phi3")) == () and fused_units(build("llama")) == DEFAULT_FUSED
    assert fused_units(build("bert")) == (("query", "key", "value"),)
    from qcore.adapters.passes.amp import layer_sensitivity
    torch.manual_seed(0)
    bert = transformers.BertForMaskedLM(CONFIGS["bert"](transformers)).eval()
    sens = layer_sensitivity(bert, ["int8"], [IDS], progress=False)  # tie=None: the record's (not DEFAULT_TIE's)
    p = "bert.encoder.layer.0."
    assert (p + "attention.self.query", p + "attention.self.key", p + "attention.self.value") in sens.units
    assert (p + "intermediate.dense",) in sens.units
    assert all(len(u) == 1 for u in layer_sensitivity(bert, ["int8"], [IDS], tie=DEFAULT_FUSED, progress=False).units)


LLAMA = BY_MODEL_TYPE["llama"]
BAD = [
    (dict(model_type="Llama"), "model_type"),
    (dict(model_type=""), "model_type"),
    (dict(name=""), "name"),
    (dict(layers=""), "Family.layers"),
    (dict(layers=3), "Family.layers"),
    (dict(embed="model..x"), "Family.embed"),
    (dict(attn_in="self_attn.q_proj"), "Family.attn_in"),
    (dict(attn_in=("a", "b")), "Family.attn_in"),
    (dict(attn_in=("self_attn.qkv",)), "qkv_layout"),
    (dict(qkv_layout="concat"), "qkv_layout"),
    (dict(mlp_in=()), "Family.mlp_in"),
    (dict(mlp_in=("a", "b", "c")), "Family.mlp_in"),
    (dict(norm="rmsnorm"), "Family.norm"),
    (dict(linear="conv2d"), "Family.linear"),
    (dict(mlp_norm="input_layernorm"), "given twice"),
    (dict(scaling=[LLAMA.scaling[0]]), "Family.scaling"),
    (dict(scaling=(ScalingRule(ScalingGroup("ln", ("self_attn.q_proj",), "self_attn.q_proj")),)), "names 'ln'"),
    (dict(scaling=(), scaling_note=""), "scaling_note"),
    (dict(scaling_requires="not a name"), "scaling_requires"),
    (dict(rotation=None), "Family.rotation"),
    (dict(fused_units=(("q_proj",),)), "fused_units"),
    (dict(fused_units=("q_proj", "k_proj")), "fused_units"),
    (dict(experts="mlp.experts"), "Family.experts must be an Experts"),
    (dict(experts=Experts("mlp.experts", "mlp.gate", "num_local_experts")), "with experts"),
    (dict(gguf_arch=""), "gguf_arch"),
    (dict(causal="yes"), "causal"),
]


@pytest.mark.parametrize("kw,match", BAD, ids=[next(iter(k)) for k, _ in BAD])
def test_records_validate_their_fields(kw, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(LLAMA, **kw)


def test_sub_records_validate_their_fields():
    with pytest.raises(ValueError, match="Experts.count"):
        Experts("mlp.experts", "mlp.gate", "num experts")
    with pytest.raises(ValueError, match="Experts.path"):
        Experts("", "mlp.gate", "num_experts")
    with pytest.raises(ValueError, match="ScalingRule.group"):
        ScalingRule({"prev_op": "a"})
    with pytest.raises(ValueError, match="ScalingRule.relu"):
        ScalingRule(LLAMA.scaling[0].group, relu=1)
    with pytest.raises(ValueError, match="ScalingRule.absent"):
        ScalingRule(LLAMA.scaling[0].group, absent="self_attn.v_norm")
    assert isinstance(dataclasses.replace(LLAMA, model_type="my_llama"), Family)


def test_the_docs_table_matches_the_records():
    import pathlib
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "adapters.md").read_text()
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]]
            for ln in text.split("## Architecture records", 1)[1].splitlines() if ln.startswith("| ") and "(`" in ln and not ln.startswith("| family")}
    assert len(rows) == len(CONFIGS)
    for mt in CONFIGS:
        fam = BY_MODEL_TYPE[mt]
        layers, norms, groups, rot, moe, _, gguf = rows[f"{fam.name} (`{mt}`)"]
        assert layers == f"`{fam.backbone}.{fam.layers}`"
        assert rot.startswith("yes" if not fam.rotation else "no:")
        assert (moe == "-") == (fam.experts is None)
        assert gguf == (fam.gguf_arch or "-")
        assert groups.startswith("none") == (not fam.scaling)


# ---------------------------------------------------------------------------------------------------------------
# attach checks a record against the model's modules and its float function (issue 33)
# ---------------------------------------------------------------------------------------------------------------

def _state(m):
    return ({k: v.clone() for k, v in m.state_dict().items()}, [x.training for x in m.modules()],
            sum(len(x._forward_hooks) + len(x._forward_pre_hooks) for x in m.modules()))


def _same_state(m, before):
    sd, modes, hooks = before
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in sd.items())
    assert [x.training for x in m.modules()] == modes
    assert sum(len(x._forward_hooks) + len(x._forward_pre_hooks) for x in m.modules()) == hooks


@pytest.mark.parametrize("mt", list(CONFIGS))
def test_attach_accepts_each_tables_record_on_its_model_and_leaves_the_model_as_found(mt):
    from qcore.adapters.families import attach
    m = build(mt).train()  # train mode: the probes run in eval mode and put every submodule's mode back
    seen = []
    m.register_forward_hook(lambda *a: seen.append(1))  # the user's own hook stays
    before = _state(m)
    fam = BY_MODEL_TYPE[mt]
    assert attach(m, fam) is fam and family_of(m) is fam
    _same_state(m, before)
    assert seen  # the record was checked on the model's function (the probe batches ran)


def _logits(m):
    with torch.no_grad():
        return m(IDS).logits.double()


def _rel(a, b):
    return float((a - b).norm() / b.norm())


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
# records that name only modules the model has, with the right shapes, and yet contradict it: QuaRot, given one,
# rotates the model without an error and changes its function; attach refuses each in one line naming the field
QUAROT_CONTRADICTIONS = [
    ("gemma", dict(norm="rms"), r"record's norm='rms' contradicts the model: model\.norm \(GemmaRMSNorm\) does "
                                r"not compute x / rms\(x\) \* w"),
    ("llama", dict(attn_norm="post_attention_layernorm", mlp_norm="input_layernorm"),
     r"record's attn_norm='post_attention_layernorm' / attn_in=.* folding post_attention_layernorm's weight"),
    ("llama", dict(mlp_in=("mlp.up_proj",), scaling=tuple(LLAMA.scaling[i] for i in (0, 1, 3))),
     r"record's mlp_norm='post_attention_layernorm' / mlp_in=\('mlp.up_proj',\) contradicts the model"),
    ("llama", dict(attn_in=("self_attn.q_proj", "self_attn.v_proj", "self_attn.k_proj")),
     r"record's attn_in=\('self_attn.q_proj', 'self_attn.v_proj', 'self_attn.k_proj'\) / attn_out='self_attn.o_proj'"
     r" contradicts the model: rotating each value head"),
    ("gemma2", dict(rotation=""), r"record's rotation='' \(.*output_norms\) contradicts the model: rotating the "
                                  r"residual stream"),
]


@pytest.mark.parametrize("mt,kw,match", QUAROT_CONTRADICTIONS, ids=[f"{c[0]}-{next(iter(c[1]))}" for c in
                                                                     QUAROT_CONTRADICTIONS])
def test_attach_refuses_a_record_with_which_quarot_would_change_the_float_function(mt, kw, match):
    from qcore.adapters.families import ATTRIBUTE, attach
    bad = dataclasses.replace(BY_MODEL_TYPE[mt], **kw)
    m = build(mt)
    with torch.no_grad():  # a different weight in every norm (build's are alike: a swap of two would not show)
        for i, (n, p) in enumerate(m.named_parameters()):
            if p.ndim == 1 and "norm" in n:
                p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(10 + i), dtype=p.dtype))
    ref = _logits(m)
    unchecked = copy.deepcopy(m)  # what attach used to let through: the record stored as it was given
    setattr(unchecked, ATTRIBUTE, bad)
    rotate_model(unchecked)  # no error ...
    assert _rel(_logits(unchecked), ref) > 0.05  # ... and a different function
    before = _state(m)
    with pytest.raises(ValueError, match=match) as e:
        attach(m, bad)
    assert "\n" not in str(e.value) and str(e.value).startswith("attach: ")
    assert not hasattr(m, ATTRIBUTE)
    _same_state(m, before)
    attach(m, BY_MODEL_TYPE[mt])  # the table's record: accepted
    if not BY_MODEL_TYPE[mt].rotation:
        assert _rel(_logits(rotate_model(m)), ref) < 1e-6  # and QuaRot keeps the function


def _moe_record(count):
    return dataclasses.replace(BY_MODEL_TYPE["mixtral"], experts=Experts("mlp.experts", "mlp.gate", count))


STRUCTURE_CONTRADICTIONS = [
    ("qwen3", dict(attn_norm="self_attn.q_norm", qk_norms=("input_layernorm", "self_attn.k_norm")),
     r"record's attn_norm='self_attn.q_norm' contradicts the model: model.layers.0.self_attn.q_norm \(Qwen3RMSNorm\) "
     r"has weight \(8,\); a norm of the residual stream has one weight per channel \(32\)"),
    ("gpt2", dict(linear="linear"), r"record's linear='linear' contradicts the model: transformer.h.0.attn.c_attn is a "
                                    r"Conv1D"),
    ("llama", dict(attn_in=("self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj")),
     r"record's attn_in=.* q, k, v of model.layers.0 write 16, 32, 16 rows; the config has 4 heads, 2 key-value "
     r"heads of 8"),
    ("llama", dict(attn_out="mlp.down_proj", mlp_out="self_attn.o_proj"),
     r"record's attn_out='mlp.down_proj' contradicts the model: model.layers.0.mlp.down_proj reads 64 features"),
    ("llama", dict(final_norm="final"), r"record's final_norm='final' contradicts the model: the model has no "
                                        r"model.final"),
    ("llama", dict(lm_head="model.norm"), r"record's lm_head='model.norm' .* LlamaRMSNorm, not a Linear-like"),
    ("llama", dict(embed="norm"), r"record's embed='norm' contradicts the model: model.norm is a LlamaRMSNorm"),
    ("mixtral", dict(experts=_moe_record("num_hidden_layers").experts),
     r"record's experts \('mlp.experts': 'gate_up_proj', 'down_proj'\) .* expected \[2, 2I, 32\]"),
    ("gpt2", dict(pos_embed="wpe2"), r"record's pos_embed='wpe2' contradicts the model: transformer.wpe2 is missing"),
    ("mixtral", dict(experts=_moe_record("num_experts_total").experts),
     r"record's experts.count='num_experts_total' contradicts the model: the config \(MixtralConfig\) has no"),
    ("qwen2_moe", dict(experts=dataclasses.replace(BY_MODEL_TYPE["qwen2_moe"].experts,
                                                   router="mlp.shared_expert.gate_proj")),
     r"record's experts.router='mlp.shared_expert.gate_proj' .* maps 32 -> 32; expected 32 -> 4 experts"),
    ("qwen2_moe", dict(experts=dataclasses.replace(BY_MODEL_TYPE["qwen2_moe"].experts,
                                                   shared_mlp=("gate_proj", "up_proj", "fc2"))),
     r"record's experts.shared_mlp \('fc2'\) contradicts the model: model.layers.0.mlp.shared_expert has no fc2"),
    ("gemma3_text", dict(output_norms=("self_attn.q_norm", "post_feedforward_layernorm"),
                         qk_norms=("post_attention_layernorm", "self_attn.k_norm")),
     r"record's output_norms \('self_attn.q_norm'\) .* has weight \(8,\); a norm of a block output"),
    ("gemma3_text", dict(output_norms=("post_attention_layernorm",),
                         qk_norms=("self_attn.q_norm", "post_feedforward_layernorm")),
     r"record's qk_norms \('post_feedforward_layernorm'\) .* has weight \(32,\); a norm of one head has one "
     r"weight per channel \(8\)"),
    ("llama", dict(mlp_in=("mlp.gate_proj", "mlp.down_proj"), mlp_out="mlp.up_proj"),
     r"record's mlp_in \('mlp.down_proj'\) contradicts the model: model.layers.0.mlp.down_proj reads 64 features, "
     r"not the hidden size 32"),
    ("llama", dict(lm_head="model.embed_tokens"),  # an [vocab, hidden] weight, but not the head
     r"record's final_norm='norm' / lm_head='model.embed_tokens' contradicts the model: folding model.norm's weight "
     r"into model.embed_tokens fails on a probe batch \(IndexError: "),
    # a scaling group through a post-norm's LayerNorm (its output also feeds the residual): AWQ would change BERT
    ("bert", dict(scaling=(ScalingRule(ScalingGroup("attention.output.LayerNorm", ("intermediate.dense",),
                                                    "intermediate.dense")),)),
     r"record's scaling\[0\] \(attention.output.LayerNorm -> intermediate.dense\) contradicts the model: dividing "
     r"attention.output.LayerNorm's output by random positive scales .* changes the model's output"),
]


@pytest.mark.parametrize("mt,kw,match", STRUCTURE_CONTRADICTIONS,
                         ids=[f"{c[0]}-{next(iter(c[1]))}" for c in STRUCTURE_CONTRADICTIONS])
def test_attach_refuses_a_record_that_contradicts_the_models_modules(mt, kw, match):
    from qcore.adapters.families import ATTRIBUTE, attach
    m = build(mt)
    before = _state(m)
    with pytest.raises(ValueError, match=match) as e:
        attach(m, dataclasses.replace(BY_MODEL_TYPE[mt], **kw))
    assert "\n" not in str(e.value) and not hasattr(m, ATTRIBUTE)
    _same_state(m, before)


def test_attach_refuses_a_model_that_contradicts_the_tables_record():
    from qcore.adapters.families import attach
    m = build("llama")
    m.model.layers[1].mlp.gate_proj = nn.Linear(HIDDEN, 48, bias=False, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"record's mlp_in=\('mlp.gate_proj', 'mlp.up_proj'\) contradicts the model: "
                                         r"model.layers.1: mlp.gate_proj, mlp.up_proj write \[48, 64\] features and "
                                         r"mlp.down_proj reads 64"):
        attach(m, LLAMA)


def test_attach_checks_a_bfloat16_model_within_its_rounding():
    from qcore.adapters.families import attach
    m = build("llama").to(torch.bfloat16)
    attach(m, LLAMA)  # float rounding of bf16 (16 eps) passes the table's record ...
    with pytest.raises(ValueError, match=r"attn_norm='post_attention_layernorm'"):  # ... and not a contradiction
        attach(m, dataclasses.replace(LLAMA, attn_norm="post_attention_layernorm", mlp_norm="input_layernorm"))



def test_attach_checks_a_bare_backbone_and_refuses_a_model_it_cannot_run():
    from qcore.adapters.families import attach
    m = build("llama")
    bare = dataclasses.replace(LLAMA, backbone="", lm_head=None)  # LlamaModel: the final norm's output, no head
    assert attach(m.model, bare) is bare
    assert attach(m.model, dataclasses.replace(bare, final_norm=None)).final_norm is None  # its output: the stream
    vars(m.config)["num_attention_heads"] = None  # heads unknown: their checks left out, the rest done
    assert attach(m, LLAMA) is LLAMA
    with pytest.raises(ValueError, match=r"record's norm='rms_unit_offset'"):
        attach(m, dataclasses.replace(LLAMA, norm="rms_unit_offset"))
    vars(m.config)["num_attention_heads"] = HEADS
    with pytest.raises(ValueError, match=r"attn_norm='post_attention_layernorm'"):
        attach(m.model, dataclasses.replace(bare, attn_norm="post_attention_layernorm", mlp_norm="input_layernorm"))

    def needs_pixels(*a, **k):
        raise RuntimeError("pixel_values are required\nsecond line")
    m2 = build("llama")
    m2.forward = needs_pixels
    with pytest.raises(ValueError, match=r"^attach: cannot check the Llama record against the model's function: "
                                         r"LlamaForCausalLM does not run a probe batch of token ids \(RuntimeError: "
                                         r"pixel_values are required\)$"):
        attach(m2, LLAMA)
    assert not hasattr(m2, "qcore_family")
    m2.forward = lambda *a, **k: (torch.zeros(1),)
    with pytest.raises(ValueError, match=r"\(TypeError: the model's output is a tuple without logits or a hidden "
                                         r"state\)$"):
        attach(m2, LLAMA)
    with pytest.raises(ValueError, match=r"record's norm='rms_unit_offset'"):  # a refused record: the one attached
        attach(m, dataclasses.replace(LLAMA, norm="rms_unit_offset"))          # before stays
    assert family_of(m) is LLAMA
